"""The model-level gate: an optimized module is timed end to end against the original at the
example call — the forward, and forward + backward where the model is training with parameters
that want gradients — and the original keeps running where kbench's is not faster. Per-region
timings cannot promise this: a region's time leaves out the launches, the autograd nodes and
the host work between regions, which on a small or host-bound model are most of a call.

Nothing the user owns changes: gradients are taken with torch.autograd.grad (no .grad is
written), buffers a training forward updates (BatchNorm's running statistics) and the random
number generators are put back as they were.

A verdict is remembered: its measurement is kept in the kernel cache (Memory) under a key of
everything it depends on, and a later optimize() of the same model on the same kernels applies
it without timing. Under a shared tuning (kbench/distributed.py) rank 0's verdict is every
rank's (imposing)."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import statistics
import time

import torch
import torch.utils._pytree as pytree

from ..version import __version__
from . import cache

log = logging.getLogger("kbench")

KEEP_BELOW = 0.98   # kbench's module runs where its median time is under this fraction of eager's
GRAPHS_BELOW = 0.98  # its CUDA graphs stay where a graphed call's median is under this fraction of
                     # the un-graphed one's (they pin memory; and a replay copies the inputs in and
                     # the outputs out, which a small memory-bound module can feel): in calls queued
                     # back to back, or in one call waited for, where the queued ones are no slower
WARMUP = 3          # calls of each before timing (binding, the first backward's preparation)
ROUNDS = 7          # interleaved timed blocks of each
BLOCK = 3           # calls queued back to back in a timed block, which starts on an idle GPU
LATENCY_ROUNDS = 5  # interleaved calls of each waited for (graphed and not)


@dataclasses.dataclass
class Verdict:
    keep: bool              # kbench's module runs (else the original)
    eager_ms: float
    kbench_ms: float        # kbench as it will run: with its CUDA graphs where `graphs`
    backward: bool          # forward + backward was timed
    note: str = ""
    graphed_ms: float | None = None     # with its CUDA graphs, and with them paused, where both
    ungraphed_ms: float | None = None   # were timed (as `backward` says)
    graphs: bool = True     # the graphed call was faster: its graphs stay (else they go)
    graphed_latency_ms: float | None = None     # one call waited for (host time included), with
    ungraphed_latency_ms: float | None = None   # its graphs and without
    graphs_served: bool = False  # the timed calls were replays of its graphs (api._gated): where the
                                 # graphs were not faster, they are released
    measured: float = dataclasses.field(default_factory=time.time)   # when the times were taken
    origin: str = ""        # "": measured by this optimize(); else whose verdict it applies

    def describe(self) -> str:
        what = "forward + backward" if self.backward else "forward"
        ratio = self.eager_ms / self.kbench_ms if self.kbench_ms else math.inf
        how = f", {self.origin}, measured {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.measured))}" \
            if self.origin else ""
        head = (f"model gate ({what} at the example call{how}): eager {self.eager_ms:.4g} ms, kbench "
                f"{self.kbench_ms:.4g} ms ({ratio:.2f}x)")
        if self.ungraphed_ms is not None:
            head += f"; kbench with CUDA graphs {self.graphed_ms:.4g} ms, without {self.ungraphed_ms:.4g} ms"
            if self.ungraphed_latency_ms is not None:
                head += (f" (one call waited for: {self.graphed_latency_ms:.4g} ms with, "
                         f"{self.ungraphed_latency_ms:.4g} ms without)")
            head += "" if self.graphs else " (graphs not faster: off)"
        return head + ("" if self.keep else "; kbench is not faster, the original module runs") + \
            (f"; {self.note}" if self.note else "")

    @property
    def release_graphs(self) -> bool:
        """Its graphs go: they served the timed calls and were not faster."""
        return not self.graphs and self.graphs_served

    def record(self) -> dict:
        """The measurement as plain data (JSON; what Memory keeps and rank 0 sends): the times and
        what was timed. The decision is not in it: from_record takes it again (decide)."""
        return {"eager_ms": self.eager_ms, "kbench_ms": self.kbench_ms if self.ungraphed_ms is None else self.graphed_ms,
                "backward": self.backward, "ungraphed_ms": self.ungraphed_ms,
                "graphed_latency_ms": self.graphed_latency_ms, "ungraphed_latency_ms": self.ungraphed_latency_ms,
                "graphs_served": self.graphs_served, "measured": self.measured}

    @classmethod
    def from_record(cls, rec: dict, origin: str) -> "Verdict":
        """The verdict of a recorded measurement, decided as compare() decides; ValueError where
        the record is not one (a field missing, of another type, a time not positive)."""
        def ms(name, optional=False):
            v = rec.get(name)
            if v is None and optional:
                return None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ValueError(f"{name} is {v!r}")
            return float(v)
        if not isinstance(rec, dict):
            raise ValueError(f"a record is a dict, got {type(rec).__name__}")
        for flag in ("backward", "graphs_served"):
            if not isinstance(rec.get(flag), bool):
                raise ValueError(f"{flag} is {rec.get(flag)!r}")
        plain = ms("ungraphed_ms", optional=True)
        latency = (ms("graphed_latency_ms"), ms("ungraphed_latency_ms")) if plain is not None else (None, None)
        v = decide(ms("eager_ms"), ms("kbench_ms"), rec["backward"], plain, *latency)
        v.graphs_served, v.measured, v.origin = rec["graphs_served"], ms("measured"), origin
        return v


def _grad_leaves(out):
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
            and t.is_floating_point()]


def _step(module, args, kwargs, params, backward, upstream):
    out = module(*args, **kwargs)
    if backward:
        leaves = _grad_leaves(out)
        if leaves:
            grads = upstream(leaves)
            torch.autograd.grad(leaves, params, grads, allow_unused=True)


@contextlib.contextmanager
def _state_kept(model):
    """The model's buffers and the random generators as they were, whatever the timed calls did."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        for b, saved in buffers:   # untracked: an autograd graph that saved one stays valid
            b.data.copy_(saved)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def compare(model, optimized, args, kwargs, device, ungraphed=None) -> Verdict:
    """Times both modules at the example call on `device` (interleaved rounds, CUDA events,
    medians) and decides which runs. ungraphed: the optimized module with its CUDA graphs paused
    (a callable), timed as a third (the forward, or forward + backward where training graphs
    serve it): the graphs stay only where they make the call faster."""
    params = [p for p in model.parameters() if p.requires_grad]
    backward = gates_backward(model)
    gen = torch.Generator(device=device).manual_seed(0)
    cache = {}

    def upstream(leaves):
        key = tuple((t.shape, t.dtype) for t in leaves)
        if key not in cache:
            cache[key] = [torch.randn(t.shape, generator=gen, device=t.device).to(t.dtype) for t in leaves]
        return cache[key]

    runs = {"eager": model, "kbench": optimized}
    if ungraphed is not None:
        runs["ungraphed"] = ungraphed
    times = {name: [] for name in runs}
    with _state_kept(model), torch.no_grad() if not backward else contextlib.nullcontext():
        for _ in range(WARMUP):
            for m in runs.values():
                _step(m, args, kwargs, params, backward, upstream)
        torch.cuda.synchronize(device)
        for _ in range(ROUNDS):
            for name, m in runs.items():
                # from an idle GPU: queued behind another module's work, a host path longer than
                # the GPU's would hide (an un-graphed call's launches behind eager's kernels)
                torch.cuda.synchronize(device)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(BLOCK):
                    _step(m, args, kwargs, params, backward, upstream)
                b.record()
                times[name].append((a, b))
        torch.cuda.synchronize(device)
        latency = _latencies(runs, ("kbench", "ungraphed"), args, kwargs, params, upstream, device, backward) \
            if "ungraphed" in runs else {}
    med = {name: statistics.median(a.elapsed_time(b) / BLOCK for a, b in pairs) for name, pairs in times.items()}
    return decide(med["eager"], med["kbench"], backward, med.get("ungraphed"), latency.get("kbench"),
                  latency.get("ungraphed"))


def decide(eager_ms, kbench_ms, backward, ungraphed_ms=None, graphed_latency_ms=None,
           ungraphed_latency_ms=None) -> Verdict:
    """The verdict of a measurement: kbench_ms is the module as it runs (with its graphs, where
    ungraphed_ms timed it with them paused too; then the graphs stay where graphs_stay says)."""
    ours, graphed, use_graphs = kbench_ms, None, True
    if ungraphed_ms is not None:
        graphed = kbench_ms
        use_graphs = graphs_stay(graphed, ungraphed_ms, graphed_latency_ms, ungraphed_latency_ms)
        ours = graphed if use_graphs else ungraphed_ms
    return Verdict(keep=ours < KEEP_BELOW * eager_ms, eager_ms=eager_ms, kbench_ms=ours, backward=backward,
                   graphed_ms=graphed, ungraphed_ms=ungraphed_ms, graphs=use_graphs,
                   graphed_latency_ms=graphed_latency_ms, ungraphed_latency_ms=ungraphed_latency_ms)


def gates_backward(model) -> bool:
    """Whether the gate times forward + backward (compare's rule): a training model with parameters
    that want gradients, under grad mode."""
    return model.training and torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())


def graphs_stay(graphed_ms, ungraphed_ms, graphed_latency_ms, ungraphed_latency_ms) -> bool:
    """Do the graphs stay? Where calls queued back to back are faster with them, or no slower and
    one call waited for is faster: queued, a host path shorter than the GPU's work is hidden, but a
    caller who waits for each call (a served request, a loss printed each step) pays it, and the
    graphs take it away."""
    if graphed_ms < GRAPHS_BELOW * ungraphed_ms:
        return True
    return graphed_ms * GRAPHS_BELOW <= ungraphed_ms and graphed_latency_ms < GRAPHS_BELOW * ungraphed_latency_ms


def _latencies(runs, names, args, kwargs, params, upstream, device, backward=False) -> dict:
    """Median wall time (ms) of one call waited for, host time included, per name in names
    (interleaved rounds)."""
    times = {name: [] for name in names}
    for _ in range(LATENCY_ROUNDS):
        for name in names:
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            _step(runs[name], args, kwargs, params, backward, upstream)
            torch.cuda.synchronize(device)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


# ----------------------------------------------------------------------------- remembered

FORMAT = 1   # the record's layout: bump when it changes (older records then miss)


def device_name(device) -> str:
    """The GPU's name (a verdict holds for that model of GPU only); the device type elsewhere."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def forward_kernels(regions) -> list:
    """What runs each region of a forward plan (runtime/plan.RegionInfo): a generated kernel's
    genome and source digest, else who runs it (torch: a region left to it, an extern op)."""
    return [(info.index, info.kind, (info.genome, info.source_hash) if info.status.kernel else info.status.name)
            for info in regions]


class Memory:
    """A verdict kept in the kernel cache (tune/cache.py, signed like a winner). Its key holds
    everything the verdict depends on (Memory.of). The kernels that run outside the forward (its
    regions' backward programs, a loss's joint program) are built at the first backward, after
    optimize() returns: the record names them by their kernel-cache keys with the winners it was
    measured with, and recall() finds those winners unchanged in the cache, or measures again."""

    def __init__(self, key: str):
        self.key = key
        self.elsewhere: list = []   # recall()'s: (CacheKey, a stored winner's source digest or "",
                                    # whether its search left it to torch) per region outside the forward

    @classmethod
    def of(cls, capture_key: str, *, backward: bool, autocast, cuda_graphs, graphs_timed: bool,
           grad_in_forward: bool, device, kernels: list) -> "Memory":
        """capture_key: the capture cache's fingerprint (the model's code and state shapes, the
        example call); backward: forward + backward is gated (gates_backward); autocast: its state
        (capture.modes.autocast_mode); graphs_timed: the call was also timed with its graphs
        paused; kernels: forward_kernels of the module's plan. The GPU's name and kbench's
        version are added here."""
        parts = ("kbench-gate", FORMAT, __version__, capture_key, bool(backward), repr(autocast), repr(cuda_graphs),
                 bool(graphs_timed), bool(grad_in_forward), device_name(device), repr(kernels))
        return cls(hashlib.sha256(repr(parts).encode()).hexdigest())

    def recall(self) -> Verdict | None:
        """The remembered verdict, or None: none kept, one unreadable (logged, then measured and
        replaced), or one measured with other kernels outside the forward."""
        try:
            with contextlib.closing(cache.open_cache()) as db:
                body = db.load_verdict(self.key)
                if body is None:
                    return None
                rec = json.loads(body)
                if not isinstance(rec, dict) or rec.get("format") != FORMAT:
                    raise ValueError(f"not a format {FORMAT} record")
                verdict = Verdict.from_record(rec, "a remembered verdict")
                elsewhere = _elsewhere(rec.get("elsewhere"))
                changed = next((f"the kernel of a region outside the forward (a backward's: {k.region_sig[:12]}) "
                                f"changed" for k, h, _ in elsewhere if _winner(db, k) != h), "")
        except Exception as e:  # noqa: BLE001 - an entry that cannot be read is measured again
            log.warning("kbench: the model gate's remembered verdict is unreadable (%s: %s); measuring again",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return None
        if changed:
            log.info("kbench: model gate: %s since its verdict was measured; measuring again", changed)
            return None
        self.elsewhere = elsewhere
        return verdict

    def keep(self, verdict: Verdict, elsewhere=(), left=()) -> None:
        """Store the verdict's measurement; elsewhere: the kernel-cache keys of the regions run
        outside the forward (the winners they have now are recorded with it); left: keys whose
        search found no verified kernel (Tuner.left)."""
        try:
            with contextlib.closing(cache.open_cache()) as db:
                keys = {tuple(sorted(k.as_dict().items())): k for k in elsewhere}
                others = [[k.as_dict(), _winner(db, k), k in left] for _, k in sorted(keys.items())]
                db.store_verdict(self.key, json.dumps({"format": FORMAT, **verdict.record(), "elsewhere": others},
                                                      sort_keys=True))
        except Exception as e:  # noqa: BLE001 - only the next optimize() measures again
            log.warning("kbench: could not keep the model gate's verdict in the cache (%s: %s)", type(e).__name__, e)


def _winner(db, key) -> str:
    """The source digest of the kernel cache's winner for key ("": none)."""
    w = db.lookup(key)
    return w.source_hash if w is not None else ""


def _elsewhere(entries) -> list:
    """A record's regions outside the forward, checked: (CacheKey, winner digest, left to torch)."""
    if not isinstance(entries, list):
        raise ValueError("elsewhere is not a list")
    out = []
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], dict)
                and isinstance(entry[1], str) and isinstance(entry[2], bool)):
            raise ValueError(f"elsewhere holds {entry!r:.80}")
        out.append((cache.CacheKey(**entry[0]), entry[1], entry[2]))
    return out


# ----------------------------------------------------------------------------- shared by ranks

_imposed = None


@contextlib.contextmanager
def imposing(decision):
    """Within: the gate applies `decision` (shared(), rank 0's) instead of measuring or recalling."""
    global _imposed
    prev, _imposed = _imposed, decision
    try:
        yield
    finally:
        _imposed = prev


def imposed():
    """The decision imposing() set (None: each optimize() decides for itself)."""
    return _imposed


def shared(module) -> dict:
    """What rank 0 sends the others: the record of the verdict its module applies (None where its
    gate gave none) and its gate's report line."""
    d = getattr(module, "__dict__", {})
    verdict = d.get("_kbench_gate_verdict")
    return {"verdict": verdict.record() if verdict is not None else None, "line": d.get("_kbench_gate", "")}
