"""The side of the benchmark that runs an implementation: builds it for a task's model, calls it
on the inputs it is handed, times it (kbench/tune/timing.py, fresh inputs) and samples its timed
outputs. It reports facts and copies; it decides nothing (docs/benchmarking.md, "The trust
boundary"): the harness compares what it reports with references of its own.

Implementation files run here in a separate process, started with multiprocessing's "spawn"
(worker_boot.py -> serve); tensors cross between the processes as bytes in a shared file
(Arena) and replies as JSON, so nothing the worker sends is ever unpickled by the harness.
Callables handed to the harness directly (built-in baselines, tests) run the same code in the
harness's own process (runner.LocalRunner)."""
from __future__ import annotations

import json
import math
import os
import random
import sys
import threading
import time
import traceback
from typing import Callable, List, Optional

import torch

from ..tune import timing
from . import compare
from .compare import flatten

_INT_OF_SIZE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Outputs sampled from one timed config: at most this many calls, and this many bytes of
# copies (the copies at return, the outputs kept to see whether they change later, the inputs).
MAX_SAMPLES = 16
SAMPLE_BYTES = {"cpu": 64 << 20, "cuda": 1 << 30}


class CaseFailure(Exception):
    """A candidate call that cannot even be compared (raised, or broke the protocol)."""


# ------------------------------------------------------------------------- one call

def clone_args(xs: list) -> list:
    return [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in xs]


def _snapshot(outs: list) -> list:
    """Copies of the outputs as they are when the call returns (on CUDA: ordered on the current
    stream right after the call), before anything else runs: what a caller could read."""
    return [o.detach().clone() if isinstance(o, torch.Tensor) else None for o in outs]


def run_call(fn: Callable, xs: list, params: list, grad_outs: Optional[list], backward: bool,
             snapshot: bool = False):
    """(outputs, their snapshot at return or None, gradients of the floating inputs and of
    `params`). Forward runs under no_grad; forward+backward takes the gradients of every
    floating input and parameter against `grad_outs`."""
    if not backward:
        with torch.no_grad():
            outs = flatten(fn(*xs))
        return outs, (_snapshot(outs) if snapshot else None), []
    leaves = [x.requires_grad_() for x in xs
              if isinstance(x, torch.Tensor) and x.is_floating_point()]
    with torch.enable_grad():
        outs = flatten(fn(*xs))
    snap = _snapshot(outs) if snapshot else None
    if len(outs) != len(grad_outs):
        raise CaseFailure(f"returned {len(outs)} outputs, expected {len(grad_outs)}")
    pairs = [(o, g) for o, g in zip(outs, grad_outs) if g is not None]
    for i, (o, _) in enumerate(pairs):
        if not isinstance(o, torch.Tensor) or not o.requires_grad:
            raise CaseFailure(f"output {i} does not require grad (no backward)")
    wrt = leaves + list(params)
    grads = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                allow_unused=True)
    return [o.detach() if isinstance(o, torch.Tensor) else o for o in outs], snap, list(grads)


def timed_fn(f: Callable, params: list, gouts: Optional[list], backward: bool) -> Callable:
    """What the timer calls: the forward (no_grad), or forward+backward; it returns every
    output and gradient, so that sampled calls can be checked."""
    if not backward:
        def fwd(*xs):
            with torch.no_grad():
                return flatten(f(*xs))
        return fwd

    def fwd_bwd(*xs):
        outs = flatten(f(*xs))
        leaves = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
        pairs = [(o, g) for o, g in zip(outs, gouts) if g is not None]
        grads = torch.autograd.grad([o for o, _ in pairs], leaves + params,
                                    [g for _, g in pairs], allow_unused=True)
        return [o.detach() if isinstance(o, torch.Tensor) else o for o in outs] + list(grads)
    return fwd_bwd


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN equals the same NaN, -0.0 differs from 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_floating_point() and a.element_size() in _INT_OF_SIZE:
        a, b = a.view(_INT_OF_SIZE[a.element_size()]), b.view(_INT_OF_SIZE[b.element_size()])
    return torch.equal(a, b)


_POISON_MAX_BLOCKS = 64  # per size, when draining the CUDA cache of blocks that fit


def poison(like: List[torch.Tensor], kind: str, device) -> None:
    """Fill the memory the caching allocator will hand out next with garbage, so an output
    element a kernel never writes cannot hold an earlier (correct) result.

    On CUDA the cache is first emptied (whole free segments go back to the driver); then, for
    each expected output size, blocks of that size are allocated and filled until the
    allocator has to reserve new memory (so every cached free block that could serve that size
    is poisoned), plus one block as large as all outputs together; all are then freed. The
    allocator splits blocks from the front, so the next allocations land on poisoned bytes.
    kind 'nan' fills with 0xFF bytes (NaN in every float format, -1 in integers), 'random'
    with random bytes. This reaches external kernels too, as long as they allocate through
    torch (torch::empty); the CPU allocator gives no such guarantee (best effort there)."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sizes = sorted({t.numel() * t.element_size() for t in like
                    if isinstance(t, torch.Tensor)})
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
    bufs = []

    def grab(nbytes: int) -> None:
        b = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=dev)
        if kind == "nan":
            b.fill_(0xFF)
        else:
            b.random_(0, 256)
        bufs.append(b)

    for nbytes in sizes:
        for i in range(_POISON_MAX_BLOCKS if cuda else 2):
            before = torch.cuda.memory_reserved(dev) if cuda else 0
            grab(nbytes)
            if cuda and i >= 1 and torch.cuda.memory_reserved(dev) > before:
                break  # the cache had no more free blocks of this size: all are poisoned
    grab(2 * sum(sizes))
    del bufs
    timing.sync(dev)


# ------------------------------------------------------------------------- sampling timed calls

class Sampler:
    """timing.time_fn's after_call: right after a timed call's window closes, it decides at
    random (random.SystemRandom: nothing an implementation can read predicts it) whether to keep
    this call, and if so copies its outputs at once. Kept calls are checked afterwards: their
    outputs must not have changed since the copy (work still running on another stream or
    thread), their inputs must be unchanged; the harness checks the copies against its
    reference for the call's input set. At least one call is kept."""

    def __init__(self, arg_sets: list, calls: int, max_samples: int, max_bytes: int):
        self.sets, self.calls = arg_sets, calls
        self.p = min(1.0, max_samples / max(1, calls))
        self.left, self.bytes_left = max_samples, max_bytes
        self.rng = random.SystemRandom()
        self.i = 0
        self.kept = []        # (call index, set index, copies, outputs, args)
        self.last_use = {}    # data_ptr of an output -> the last call that returned it

    def __call__(self, s: int, args: list, out) -> None:
        i, self.i = self.i, self.i + 1
        outs = out if isinstance(out, list) else flatten(out)
        take = self.left > 0 and (self.rng.random() < self.p
                                  or (not self.kept and i == self.calls - 1))
        if take:
            copies = _snapshot(outs)   # first: the output as the call left it
            nbytes = sum(t.numel() * t.element_size() for t in copies if t is not None)
            nbytes = 2 * nbytes + sum(x.numel() * x.element_size() for x in args
                                      if isinstance(x, torch.Tensor))
            if nbytes <= self.bytes_left or not self.kept:
                self.left -= 1
                self.bytes_left -= nbytes
                self.kept.append((i, s, copies, [o.detach() if isinstance(o, torch.Tensor)
                                                 else o for o in outs], args))
        for o in outs:
            if isinstance(o, torch.Tensor) and o.numel():
                self.last_use[o.untyped_storage().data_ptr()] = i

    def finish(self, device) -> List[str]:
        """Problems seen in the kept calls (each one line)."""
        timing.sync(device)
        problems = []
        for i, s, copies, outs, args in self.kept:
            for j, (c, o) in enumerate(zip(copies, outs)):
                if c is None or not isinstance(o, torch.Tensor) or not o.numel():
                    continue
                if self.last_use.get(o.untyped_storage().data_ptr(), i) > i:
                    continue   # a later call returned the same buffer: it was meant to change
                if not same_bits(c, o.detach()):
                    problems.append(f"timed call {i}: output {j} changed after the call "
                                    f"returned (work still running on another stream or "
                                    f"thread when it returned)")
            for j, (x, p) in enumerate(zip(args, self.sets[s])):
                if isinstance(x, torch.Tensor) and not same_bits(x.detach(), p.detach()):
                    problems.append(f"timed call {i}: modified input {j} in place")
        return problems

    def samples(self) -> list:
        """(call index, set index, copies of the outputs) of the kept calls."""
        return [(i, s, copies) for i, s, copies, _, _ in self.kept]


# ------------------------------------------------------------------------- the session

def load_state(model: torch.nn.Module, values: list) -> None:
    """Give the model these parameter and buffer values (state_dict order) in place, so an
    implementation that kept references to them sees the new values."""
    state = list(model.state_dict(keep_vars=True).values())
    if len(state) != len(values):
        raise ValueError(f"{len(values)} state values for {len(state)} tensors")
    with torch.no_grad():
        for dst, src in zip(state, values):
            dst.copy_(src)


class Session:
    """The implementations built in this process, by key (task, dtype, mode, model group), each
    with the model it was built for: the harness keeps its own model and sends values."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.built: dict = {}

    def build(self, key: str, model: torch.nn.Module, factory: Callable, example: list) -> None:
        self.built.pop(key, None)
        self.built[key] = (model, factory(model, example))

    def drop(self, key: str) -> None:
        self.built.pop(key, None)

    def _get(self, key: str):
        if key not in self.built:
            raise KeyError(f"nothing built under {key!r}")
        return self.built[key]

    def set_state(self, key: str, values: list) -> None:
        load_state(self._get(key)[0], values)

    def state(self, key: str) -> list:
        model, _ = self._get(key)
        return [t.detach() for t in model.state_dict(keep_vars=True).values()]

    def call(self, key: str, xs: list, gouts: Optional[list], backward: bool, poison_kind: str,
             expect: list, model_first: bool = False) -> dict:
        """One candidate call on private copies of xs, with the allocator poisoned first. Returns
        {"error"} or {"facts", "grad_facts", "outs", "grads", "inputs_after", "late"}: the
        outputs as copied when the call returned, which outputs changed afterwards, and the
        inputs as the call left them."""
        model, impl = self._get(key)
        params = list(model.parameters())
        if model_first:   # the task's own module first: its freed blocks are where a stale
            # output would come from, and the poison must cover them
            run_call(model, clone_args(xs), params, gouts, backward)
        poison(expect, poison_kind, self.device)
        cx = clone_args(xs)
        try:
            outs, snap, grads = run_call(impl, cx, params, gouts, backward, snapshot=True)
        except CaseFailure as e:
            return {"error": str(e)}
        except Exception as e:  # noqa: BLE001 - any exception is this candidate's failure
            return {"error": f"raised {type(e).__name__}: {e}"}
        timing.sync(self.device)
        in_ptrs = compare.storage_ptrs(cx)
        late = [i for i, (o, c) in enumerate(zip(outs, snap))
                if c is not None and type(o) is torch.Tensor and not same_bits(o, c)]
        return {"facts": [compare.describe(o, in_ptrs) for o in outs],
                "grad_facts": [compare.describe(g, ()) for g in grads],
                "outs": snap, "grads": [g.detach() if isinstance(g, torch.Tensor) else None
                                        for g in grads],
                "inputs_after": [x.detach() if isinstance(x, torch.Tensor) else x for x in cx],
                "late": late}

    def time(self, key: str, arg_sets: list, gouts: Optional[list], backward: bool, *,
             reps: int, warmup: int, flush: bool = True, max_samples: int = MAX_SAMPLES,
             sample_bytes: Optional[int] = None, mark: Optional[Callable] = None) -> dict:
        """Time the implementation on fresh copies of arg_sets (timing.time_fn, fresh=True),
        sampling outputs. {"timing", "samples", "problems"}."""
        model, impl = self._get(key)
        params = list(model.parameters())
        if backward:
            for a in arg_sets:
                for x in a:
                    if isinstance(x, torch.Tensor) and x.is_floating_point():
                        x.requires_grad_()
        if sample_bytes is None:
            sample_bytes = SAMPLE_BYTES.get(self.device.type, 64 << 20)
        sampler = Sampler(arg_sets, reps, max_samples, sample_bytes)
        fn = timed_fn(impl, params, gouts, backward)
        # the first call (where torch.compile compiles) is timed on its own, by the clock
        first = timing.FreshArgs(arg_sets).take(1)[0][1]
        t0 = time.perf_counter()
        fn(*first)
        timing.sync(self.device)
        first_call_s = time.perf_counter() - t0
        del first
        t = timing.time_fn(fn, arg_sets, device=self.device, reps=reps, warmup=warmup,
                           flush=flush, fresh=True, after_call=sampler, mark=mark)
        problems = sampler.finish(self.device)
        return {"timing": dict(t.as_dict(), first_call_s=first_call_s),
                "samples": sampler.samples(), "problems": problems}

    def profile(self, key: str, xs: list, gouts: Optional[list], backward: bool) -> dict:
        """One profiled call on xs (profile_call): feedback for whoever writes the next
        implementation, never part of a verdict."""
        model, impl = self._get(key)
        return profile_call(impl, xs, list(model.parameters()), gouts, backward, self.device)


# ------------------------------------------------------------------------- profiling

PROFILE_TOP = 5


DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")   # Kineto's kinds of launched device work


def _launched(e) -> bool:
    """A device event that some launch asked for: not the profiler's own (CUPTI's buffer
    requests and other overhead are device events too). Kineto's kind where torch records it."""
    kind = getattr(e, "activity_type", None)
    return kind in DEVICE_WORK if kind else e.name != "Activity Buffer Request"


def _summarize_profile(events, cuda: bool, host_ms: float) -> dict:
    """Plain data from one profiled call's events: the time on the device (on the CPU: the time
    in ops), the launches (device kernels and copies; on the CPU every op call counts as one),
    the PROFILE_TOP kernels (on the CPU, ops) by self time with their counts, and the call's host
    time. Advisory: the harness never scores or verifies with it."""
    from torch.autograd import DeviceType
    per: dict = {}
    if cuda:   # the device's own events: their time is their span on the device
        evs = [e for e in events if e.device_type == DeviceType.CUDA and _launched(e)]
        spans = [(e.name, e.time_range.elapsed_us()) for e in evs]
    else:
        evs = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
        spans = [(e.name, e.self_cpu_time_total) for e in evs]
    for name, us in spans:
        t = per.setdefault(name, [0.0, 0])
        t[0] += us
        t[1] += 1
    top = sorted(per.items(), key=lambda kv: -kv[1][0])[:PROFILE_TOP]
    return {"device": "cuda" if cuda else "cpu", "device_ms": sum(us for _, us in spans) / 1e3,
            "launches": len(spans), "host_ms": host_ms,
            "top": [{"name": n, "self_ms": us / 1e3, "count": c} for n, (us, c) in top]}


def profile_call(impl: Callable, xs: list, params: list, gouts: Optional[list], backward: bool,
                 device) -> dict:
    """One call of the implementation under the profiler (CUDA activity on a GPU, CPU activity
    otherwise), summarized (_summarize_profile); {"unavailable": why} where the profiler or the
    call failed: a profile is feedback, and its absence never fails a candidate.
    torch.autograd.profiler.profile is what torch.profiler.profile drives; used directly because
    the latter imports torch._inductor when it starts (seconds, in a fresh worker)."""
    from torch.autograd import ProfilerActivity, _supported_activities
    from torch.autograd import profiler as autograd_profiler
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda and ProfilerActivity.CUDA not in _supported_activities():
        # the fallback (CUDA events around each op) times ops, not kernels: not this summary
        return {"unavailable": "this torch's profiler has no CUDA activity (no CUPTI)"}
    if backward:
        for x in xs:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                x.requires_grad_()
    fn = timed_fn(impl, params, gouts, backward)
    try:
        timing.sync(dev)
        with autograd_profiler.profile(use_cpu=True, use_device="cuda" if cuda else None,
                                       use_kineto=True) as prof:
            t0 = time.perf_counter()
            fn(*xs)
            host_ms = (time.perf_counter() - t0) * 1e3
            timing.sync(dev)
        return _summarize_profile(prof.function_events, cuda, host_ms)
    except Exception as e:  # noqa: BLE001 - any failure here only loses the profile
        return {"unavailable": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}


# ------------------------------------------------------------------------- the exchange file

class ProtocolError(Exception):
    """A message or tensor description from the worker that does not follow the protocol."""


_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                               torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                               torch.bool)}
MAX_DIMS = 16


class Arena:
    """A file both processes map (torch.from_file, shared): the harness writes inputs at its
    start, the worker writes outputs after them; a tensor crosses as {"off", "dtype", "shape"}
    and is read back only after that description is checked against the file's bounds."""

    ALIGN = 64

    def __init__(self, path: str, nbytes: int):
        self.path, self.nbytes = path, int(nbytes)
        self.buf = torch.from_file(path, shared=True, size=self.nbytes, dtype=torch.uint8)

    def write(self, t: torch.Tensor, off: int):
        """(description, next offset), or (None, off) where t does not fit."""
        off = -(-off // self.ALIGN) * self.ALIGN
        n = t.numel() * t.element_size()
        if str(t.dtype) not in _DTYPES or off + n > self.nbytes or t.dim() > MAX_DIMS:
            return None, off
        if n:
            self.buf[off:off + n].view(t.dtype).view(t.shape).copy_(t.detach())
        return {"off": off, "dtype": str(t.dtype), "shape": list(t.shape)}, off + n

    def read(self, desc) -> torch.Tensor:
        """A view of the file described by desc (which the other process wrote): checked."""
        if not isinstance(desc, dict) or set(desc) != {"off", "dtype", "shape"}:
            raise ProtocolError(f"not a tensor description: {str(desc)[:80]}")
        off, dtype, shape = desc["off"], desc["dtype"], desc["shape"]
        if (type(off) is not int or dtype not in _DTYPES or not isinstance(shape, list)
                or len(shape) > MAX_DIMS or any(type(d) is not int or d < 0 for d in shape)):
            raise ProtocolError(f"bad tensor description: {str(desc)[:80]}")
        dt = _DTYPES[dtype]
        n = math.prod(shape) * dt.itemsize
        if off < 0 or off % self.ALIGN or off + n > self.nbytes:
            raise ProtocolError(f"tensor description outside the exchange file: {desc}")
        if n == 0:
            return torch.empty(shape, dtype=dt)
        return self.buf[off:off + n].view(dt).view(shape)


class Writer:
    """Writes a reply's tensors into the arena from `start`, as descriptions."""

    def __init__(self, arena: Arena, start: int):
        self.arena, self.off, self.full = arena, start, False

    def put(self, t):
        if not isinstance(t, torch.Tensor):
            return None
        desc, self.off = self.arena.write(t, self.off)
        self.full |= desc is None
        return desc


# ------------------------------------------------------------------------- the worker process

_TORCH_USED = ((torch, "equal empty empty_like from_file"),
               (torch.Tensor, "clone copy_ detach view numel element_size untyped_storage "
                              "data_ptr requires_grad_ to"),
               (time, "perf_counter process_time sleep monotonic"),
               (threading, "enumerate get_ident"), (json, "dumps"))


def harness_code() -> list:
    """(owner, name, object, code) for the harness's code in this process (this module, the
    timer, the comparisons) and the torch/time functions it calls, as they are now: taken
    before any implementation is loaded, then compared by tampered()."""
    owners = []
    for m in (timing, compare, sys.modules[__name__]):
        owners.append((m, [n for n, v in vars(m).items() if callable(v)]))
        owners += [(v, [k for k, f in vars(v).items() if callable(f)]) for v in vars(m).values()
                   if isinstance(v, type) and v.__module__ == m.__name__]
    owners += [(o, names.split()) for o, names in _TORCH_USED]
    if torch.cuda.is_available():
        owners += [(torch.cuda, ["synchronize", "current_stream", "Event", "empty_cache"]),
                   (torch.cuda.Event, ["record", "elapsed_time", "synchronize"])]
    snap = []
    for owner, names in owners:
        for n in names:
            obj = getattr(owner, n, None)
            snap.append((owner, n, obj, getattr(obj, "__code__", None)))
    return snap


def tampered(snap: list) -> List[str]:
    """Names of the snapshot's functions that have been replaced since (or had their code
    replaced): an implementation rewrote what measures and reports it."""
    bad = []
    for owner, n, obj, code in snap:
        now = getattr(owner, n, None)
        if now is not obj or (code is not None and getattr(now, "__code__", None) is not code):
            bad.append(f"{getattr(owner, '__module__', '') if isinstance(owner, type) else ''}"
                       f"{getattr(owner, '__name__', '?')}.{n}".lstrip("."))
    return bad


def serve(conn, arena_path: str, arena_bytes: int, device: str, threads: int) -> None:
    """The worker's loop: one request (a pickle from the harness) at a time, one JSON reply.
    Timing marks are sent as they happen, for the harness's own clock."""
    from . import impls, suite_formats
    from .tasks import TASKS

    torch.set_num_threads(max(1, threads))
    snap = harness_code()   # before any implementation is loaded
    session = Session(device)
    arena = Arena(arena_path, arena_bytes)
    factories: dict = {}
    dev = torch.device(device)

    def send(msg: dict) -> None:
        conn.send_bytes(json.dumps(msg).encode())

    def tensors_in(descs) -> list:
        return [None if d is None else arena.read(d).to(dev, copy=True) for d in descs]

    def handle(req: dict) -> dict:
        nonlocal arena
        op = req["op"]
        if op == "arena":
            arena = Arena(req["path"], req["nbytes"])
            return {}
        if op == "load":
            name, factories[req["spec"]] = impls.resolve(req["spec"], budget=req.get("budget"))
            return {"name": name}
        if op == "build":
            task = (suite_formats.local_task(req["suite"]) if req.get("suite")
                    else TASKS[req["task"]])
            model = task.build(req["cfg"], req["dtype"], dev, init=req["init"], seed=req["seed"])
            load_state(model, tensors_in(req["state"]))   # the harness's values, exactly
            session.build(req["key"], model, factories[req["spec"]],
                          task.inputs(req["cfg"], req["dtype"], dev, seed=req["seed"]))
            return {}
        if op == "drop":
            session.drop(req["key"])
            return {}
        if op == "set_state":
            session.set_state(req["key"], tensors_in(req["state"]))
            return {}
        w = Writer(arena, req["out_start"])
        if op.startswith("suite_"):   # the task side of a suite task (suites.py)
            return dict(suite_formats.handle(req, tensors_in, w.put, dev), full=w.full)
        if op == "state":
            return {"state": [w.put(t) for t in session.state(req["key"])], "full": w.full}
        gouts = tensors_in(req["gouts"]) if req.get("gouts") is not None else None
        if op == "call":
            expect = [torch.empty(s, dtype=_DTYPES[d], device="meta") for d, s in req["expect"]]
            r = session.call(req["key"], tensors_in(req["inputs"]), gouts, req["backward"],
                             req["poison"], expect, req.get("model_first", False))
            if "error" in r:
                return r
            return {"facts": r["facts"], "grad_facts": r["grad_facts"], "late": r["late"],
                    "outs": [w.put(t) for t in r["outs"]],
                    "grads": [w.put(t) for t in r["grads"]],
                    "inputs_after": [w.put(t) for t in r["inputs_after"]], "full": w.full}
        if op == "profile":
            return {"profile": session.profile(req["key"], tensors_in(req["inputs"]), gouts,
                                               req["backward"])}
        if op == "time":
            sets = [tensors_in(s) for s in req["sets"]]
            r = session.time(req["key"], sets, gouts, req["backward"], reps=req["reps"],
                             warmup=req["warmup"], flush=req.get("flush", True),
                             max_samples=req["max_samples"], sample_bytes=req["sample_bytes"],
                             mark=lambda label: send({"mark": label}))
            return {"timing": r["timing"], "problems": r["problems"], "full": w.full,
                    "samples": [{"call": i, "set": s, "outs": [w.put(t) for t in copies]}
                                for i, s, copies in r["samples"]]}
        raise ValueError(f"unknown request {op!r}")

    while True:
        try:
            req = conn.recv()
        except (EOFError, OSError):
            return
        if req.get("op") == "exit":
            return
        try:
            reply = handle(req)
        except Exception as e:  # noqa: BLE001 - reported to the harness, which decides
            reply = {"error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc(limit=8)}
        bad = tampered(snap)
        if bad:
            reply["tampered"] = bad[:20]
        reply["reply"] = req["op"]
        send(reply)
        if req["op"] == "time" and dev.type == "cuda":
            torch.cuda.empty_cache()


def boot_path() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker_boot.py")
