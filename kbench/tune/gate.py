"""The model-level gate: an optimized module is timed end to end against the original at the
example call — the forward, and forward + backward where the model is training with parameters
that want gradients — and the original keeps running where kbench's is not faster. Per-region
timings cannot promise this: a region's time leaves out the launches, the autograd nodes and
the host work between regions, which on a small or host-bound model are most of a call.

Nothing the user owns changes: gradients are taken with torch.autograd.grad (no .grad is
written), buffers a training forward updates (BatchNorm's running statistics) and the random
number generators are put back as they were."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time

import torch
import torch.utils._pytree as pytree

KEEP_BELOW = 0.98   # kbench's module runs where its median time is under this fraction of eager's
GRAPHS_BELOW = 0.98  # its CUDA graphs stay where a graphed call's median is under this fraction of
                     # the un-graphed one's (they pin memory; and a replay copies the inputs in and
                     # the outputs out, which a small memory-bound module can feel): in calls queued
                     # back to back, or in one call waited for, where the queued ones are no slower
WARMUP = 3          # calls of each before timing (binding, the first backward's preparation)
ROUNDS = 15         # interleaved timed calls of each
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

    def describe(self) -> str:
        what = "forward + backward" if self.backward else "forward"
        ratio = self.eager_ms / self.kbench_ms if self.kbench_ms else math.inf
        head = (f"model gate ({what} at the example call): eager {self.eager_ms:.4g} ms, kbench "
                f"{self.kbench_ms:.4g} ms ({ratio:.2f}x)")
        if self.ungraphed_ms is not None:
            head += f"; kbench with CUDA graphs {self.graphed_ms:.4g} ms, without {self.ungraphed_ms:.4g} ms"
            if self.ungraphed_latency_ms is not None:
                head += (f" (one call waited for: {self.graphed_latency_ms:.4g} ms with, "
                         f"{self.ungraphed_latency_ms:.4g} ms without)")
            head += "" if self.graphs else " (graphs not faster: off)"
        return head + ("" if self.keep else "; kbench is not faster, the original module runs") + \
            (f"; {self.note}" if self.note else "")


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
    backward = model.training and bool(params) and torch.is_grad_enabled()
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
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                _step(m, args, kwargs, params, backward, upstream)
                b.record()
                times[name].append((a, b))
        torch.cuda.synchronize(device)
        latency = _latencies(runs, ("kbench", "ungraphed"), args, kwargs, params, upstream, device, backward) \
            if "ungraphed" in runs else {}
    med = {name: statistics.median(a.elapsed_time(b) for a, b in pairs) for name, pairs in times.items()}
    eager, ours = med["eager"], med["kbench"]
    graphed = plain = None
    use_graphs = True
    if "ungraphed" in med:
        graphed, plain = ours, med["ungraphed"]
        use_graphs = graphs_stay(graphed, plain, latency["kbench"], latency["ungraphed"])
        ours = graphed if use_graphs else plain
    return Verdict(keep=ours < KEEP_BELOW * eager, eager_ms=eager, kbench_ms=ours, backward=backward,
                   graphed_ms=graphed, ungraphed_ms=plain, graphs=use_graphs,
                   graphed_latency_ms=latency.get("kbench"), ungraphed_latency_ms=latency.get("ungraphed"))


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
