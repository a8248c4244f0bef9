"""Timing for the benchmark (docs/DESIGN.md, "Timing"): CUDA events on the current stream, warm-up,
median of many repetitions with the L2 flushed and inputs rotated between them, a wall-clock
cross-check that exposes work hidden on another stream or thread, and the device-to-device copy
that sets the roofline. With `fresh=True` every call gets new input tensors (FreshArgs), so
nothing an implementation remembers about an input object it saw before can serve it again.

Two measurements of one call: `time_fn` ("per-call": events around each call, so where the GPU
waits on the host, e.g. the autograd engine between kernels, that wait is counted) and
`time_graph` ("device": the calls replayed from one CUDA graph, so the host is out of the loop
and what is left is the kernels and the gaps between them on the device).

Imports only torch and the standard library: benchmarks/bench_ops.py loads this file by path
when the kbench package itself cannot be imported.
"""
from __future__ import annotations

import dataclasses
import gc
import math
import random
import statistics
import threading
import time
from typing import Callable, Optional, Sequence

import torch

# Bound when this module is imported: the benchmark's worker imports it before it loads an
# implementation, so a file that later replaces time.perf_counter or threading.enumerate does not
# change the clocks this module reads (docs/benchmarking.md, "The trust boundary").
_perf_counter = time.perf_counter
_process_time = time.process_time
_sleep = time.sleep
_enumerate_threads = threading.enumerate
_main_thread = threading.main_thread

# A run whose wall-clock time exceeds this multiple of its event time did work the events on
# the current stream did not see (another stream, another thread): its timing is not trusted.
WALL_OVER_EVENT_LIMIT = 3.0
# Achieved bytes/s above this multiple of the measured copy bandwidth is flagged impossible.
# The margin covers read-mostly kernels, which run somewhat faster than a read+write copy.
ROOFLINE_LIMIT = 1.25
_DEFAULT_L2 = 50 * 2**20  # H100's L2, when the device does not say
# time_graph replays its graphs untimed for this long first (see time_graph)
GRAPH_WARM_S = 0.1
# fresh=True rotates at least this many argument sets (a result cached for one set is wrong for
# the others), and keeps at most this many bytes of prepared copies at once (CPU / CUDA)
MIN_ARG_SETS = 3
FRESH_POOL_BYTES = {"cpu": 256 << 20, "cuda": 2 << 30}
FRESH_BATCH = 64   # copies made at a time between timed calls (fewer where memory says so)
# The CPU wall-clock loop runs at least this long (so the wait for other threads and the clock's
# granularity stay small beside it), at most CPU_WALL_MAX_CALLS calls, best of CPU_WALL_TRIES.
CPU_WALL_MIN_S = 0.02
CPU_WALL_MAX_CALLS = 200
CPU_WALL_TRIES = 3
# After the wall-clock loop on the CPU, threads the calls started may run this long to finish.
THREAD_WAIT_S = 10.0
# On the CPU a loop must also exceed the per-call time by this much to be flagged: below it,
# freeing each output inside the loop (outside the per-call window) weighs as much as the call.
CPU_HIDDEN_MIN_MS = 0.1


def is_hidden_work(loop_ms: float, per_call_ms: float, device) -> bool:
    """Does a back-to-back loop's time per call (loop_ms) exceed the per-call time by more than
    the calls themselves explain: work the per-call window did not see?"""
    over = loop_ms > WALL_OVER_EVENT_LIMIT * per_call_ms
    return over if is_cuda(device) else over and loop_ms - per_call_ms > CPU_HIDDEN_MIN_MS


@dataclasses.dataclass
class Timing:
    """One timed callable. Times are per call, in milliseconds."""

    method: str                 # "cuda-events" or "perf_counter"
    reps: int
    median_ms: float
    mean_ms: float
    min_ms: float
    std_ms: float
    wall_ms: float = math.nan   # per call, synchronized loop timed on the host
    loop_event_ms: float = math.nan  # per call, events around that same loop (CPU: the median)
    wall_over_event: float = math.nan
    hidden_work: bool = False   # wall_over_event > WALL_OVER_EVENT_LIMIT
    block_medians_ms: list = dataclasses.field(default_factory=list)  # time_fn(blocks > 1): each block's median
    wall_calls: int = 0         # calls in the wall-clock loop
    input_sets: int = 0         # fresh=True: argument sets rotated (0: the given objects reused)
    cpu_ms: float = math.nan    # CPU: process CPU time per call of the wall loop, all threads
    threads_left: int = 0       # CPU: threads the calls started still running THREAD_WAIT_S after

    def as_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in dataclasses.asdict(self).items()}


def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def sync(device) -> None:
    if is_cuda(device):
        torch.cuda.synchronize(device)


def l2_bytes(device) -> int:
    if not is_cuda(device):
        return 0
    props = torch.cuda.get_device_properties(torch.device(device))
    return int(getattr(props, "L2_cache_size", 0) or _DEFAULT_L2)


_flush_cache: dict = {}
FLUSH_KINDS = ("write", "read")


def flush_l2(device, kind: str = "write") -> None:
    """Evict the L2 so that nothing the timed call reads is cached. Called outside the timed
    window (before the start event is recorded, or between the calls of a timed graph).

    "write" zeroes a buffer of twice the L2 size, as triton's do_bench does: the L2 is left full
    of dirty lines, written back by whatever evicts them next. A call timed by events writes back
    the flush's as it runs, which pays, on average, for its own dirty lines left behind at its end
    event. "read" sums the buffer into a scalar: the L2 is left holding clean lines only, and the
    call's own dirty lines are written back during the next flush."""
    if kind not in FLUSH_KINDS:
        raise ValueError(f"flush kind {kind!r}: expected one of {FLUSH_KINDS}")
    if not is_cuda(device):
        return
    key = str(torch.device(device))
    bufs = _flush_cache.get(key)
    if bufs is None:
        bufs = (torch.zeros(2 * l2_bytes(device) // 4, dtype=torch.float32, device=device),
                torch.zeros((), dtype=torch.float32, device=device))
        _flush_cache[key] = bufs
    if kind == "write":
        bufs[0].zero_()
    else:
        torch.sum(bufs[0], dim=0, out=bufs[1])


class FreshArgs:
    """New tensor objects for every call: copies of one of the argument sets, made before the
    call's timed window, so a call never receives an object (or, with its contents, a version
    counter) an earlier call saw.

    Which set a copy holds is drawn at random among the sets, but never the one that memory
    address, or that Python id(), held first: allocators hand freed blocks back, and a result
    cached under an address or an id is then one computed for other values (a wrong output the
    harness's sampled checks see), never the right one. Copies keep the requires_grad of their
    set. Non-tensor arguments are passed as they are."""

    def __init__(self, arg_sets: Sequence[Sequence], pool_bytes: Optional[int] = None,
                 rng: Optional[random.Random] = None):
        if len(arg_sets) < 1:
            raise ValueError("FreshArgs needs at least one argument set")
        self.sets = [list(a) for a in arg_sets]
        self.rng = rng or random.SystemRandom()
        self.set_bytes = max(sum(x.numel() * x.element_size() for x in a
                                 if isinstance(x, torch.Tensor)) for a in self.sets)
        dev = next((x.device for a in self.sets for x in a if isinstance(x, torch.Tensor)),
                   torch.device("cpu"))
        budget = pool_bytes if pool_bytes is not None else FRESH_POOL_BYTES.get(dev.type,
                                                                                 256 << 20)
        self.pool = max(MIN_ARG_SETS, budget // max(1, self.set_bytes))   # copies held at most
        self._first_at: dict = {}   # data_ptr or ("id", id) -> the set that first held it
        self._ready: list = []

    def take(self, n: int) -> list:
        """n fresh (set index, args) pairs, made now."""
        return [self._one() for _ in range(n)]

    def next(self) -> tuple:
        """One fresh (set index, args); copies are made in batches (FRESH_BATCH, or fewer where
        `pool` says so) between timed windows, never inside one."""
        if not self._ready:
            self._ready = self.take(min(self.pool, FRESH_BATCH))
            self._ready.reverse()
        return self._ready.pop()

    def _one(self) -> tuple:
        shells = [torch.empty_like(x) if isinstance(x, torch.Tensor) else x
                  for x in self.sets[0]]
        keys = [("id", id(t)) for t in shells if isinstance(t, torch.Tensor)]
        keys += [t.data_ptr() for t in shells if isinstance(t, torch.Tensor) and t.numel()]
        banned = {self._first_at[k] for k in keys if k in self._first_at}
        choices = [i for i in range(len(self.sets)) if i not in banned] or list(range(len(self.sets)))
        k = self.rng.choice(choices)
        with torch.no_grad():
            for t, x in zip(shells, self.sets[k]):
                if isinstance(t, torch.Tensor):
                    t.copy_(x)
        args = [t.requires_grad_(x.requires_grad) if isinstance(t, torch.Tensor) else t
                for t, x in zip(shells, self.sets[k])]
        for key in keys:
            self._first_at.setdefault(key, k)
        return k, args


def time_fn(fn: Callable, arg_sets: Sequence[Sequence], *, device, reps: int = 50,
            warmup: int = 5, flush: bool = True,
            before_each: Optional[Callable[[], None]] = None, blocks: int = 1,
            fresh: bool = False, after_call: Optional[Callable] = None,
            mark: Optional[Callable[[str], None]] = None,
            pool_bytes: Optional[int] = None, wall_check: bool = True) -> Timing:
    """Time fn(*arg_sets[i % len(arg_sets)]): per-call times from events on the current stream
    (L2 flushed and `before_each` run outside each timed window), then a wall-clock check.

    Rotating several argument sets keeps one set's data from staying warm across calls even
    when flushing is off; outputs are dropped as soon as the call returns. blocks > 1: the reps
    run that many times and the block with the least median is the one reported (every block's
    median is kept): a stretch of slow host (another process busy) only ever adds time, and it
    can cover half of one block's calls.

    fresh=True: every call (warm-up, timed, wall-clock loop) gets new tensors from FreshArgs
    over arg_sets (at least MIN_ARG_SETS of them), copied before its timed window; at most
    `pool_bytes` of copies are held at once. after_call(set_index, args, output) runs right
    after each timed call's window closes (its end event recorded, or its clock read), before
    anything else: the harness samples outputs there. mark("wall-start") and mark("wall-end")
    are called around the wall-clock loop, so a caller in another process can time it with its
    own clock. wall_check=False (timing on the CPU) leaves the CPU's wall-clock loop out (its
    fields stay unset): for a median that is only reported, where the loop would cost more calls
    than the timing itself."""
    if not arg_sets:
        raise ValueError("time_fn needs at least one argument set")
    if fresh and len(arg_sets) < MIN_ARG_SETS:
        raise ValueError(f"fresh inputs rotate at least {MIN_ARG_SETS} argument sets, "
                         f"got {len(arg_sets)}")
    k = len(arg_sets)
    src = FreshArgs(arg_sets, pool_bytes) if fresh else None

    def args_for(i):
        return src.next() if src is not None else (i % k, arg_sets[i % k])

    for i in range(warmup):
        if before_each is not None:
            before_each()
        fn(*args_for(i)[1])
    if not is_cuda(device):
        t = _time_host(fn, args_for, reps, before_each, after_call)
        if wall_check:
            _host_wall_check(fn, t, src, arg_sets, mark)
        t.input_sets = k if fresh else 0
        return t

    stream = torch.cuda.current_stream(device)
    times, medians = None, []
    for _ in range(max(1, blocks)):
        block = _event_block(fn, args_for, device, stream, reps, flush, before_each, after_call)
        medians.append(statistics.median(block))
        if medians[-1] < min(medians[:-1], default=math.inf):   # the first of equal ones stays
            times = block

    # Wall-clock cross-check: the same calls back to back, timed both ways. Events only see
    # the current stream; torch.cuda.synchronize() waits for every stream on the device.
    loop_reps = max(10, min(reps, 100))
    if src is not None:
        loop = [a for _, a in src.take(min(loop_reps, src.pool))]
    else:
        loop = [arg_sets[i % k] for i in range(loop_reps)]
    e0 = torch.cuda.Event(enable_timing=True)
    e1 = torch.cuda.Event(enable_timing=True)
    sync(device)
    if mark is not None:
        mark("wall-start")
    t0 = _perf_counter()
    e0.record(stream)
    for args in loop:
        fn(*args)
    e1.record(stream)
    sync(device)
    t1 = _perf_counter()
    if mark is not None:
        mark("wall-end")
    wall = (t1 - t0) * 1e3 / len(loop)
    loop_ev = e0.elapsed_time(e1) / len(loop)
    ratio = wall / max(loop_ev, 1e-6)
    return Timing("cuda-events", reps, statistics.median(times), statistics.fmean(times),
                  min(times), statistics.pstdev(times), wall, loop_ev, ratio,
                  ratio > WALL_OVER_EVENT_LIMIT, medians if blocks > 1 else [],
                  wall_calls=len(loop), input_sets=k if fresh else 0)


def _event_block(fn, args_for, device, stream, reps, flush, before_each, after_call) -> list:
    """reps calls, each between two events (L2 flushed before each): their times, in ms."""
    sync(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        s, args = args_for(i)   # fresh copies are enqueued here, before the flush
        if before_each is not None:  # first, so that what it touches is flushed too
            before_each()
        if flush:
            flush_l2(device)
        starts[i].record(stream)
        out = fn(*args)
        ends[i].record(stream)
        if after_call is not None:
            after_call(s, args, out)
        del out, args
    sync(device)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _time_host(fn, args_for, reps, before_each, after_call) -> Timing:
    times = []
    for i in range(reps):
        s, args = args_for(i)
        if before_each is not None:
            before_each()
        t0 = _perf_counter()
        out = fn(*args)
        t1 = _perf_counter()
        if after_call is not None:
            after_call(s, args, out)
        del out, args
        times.append((t1 - t0) * 1e3)
    med = statistics.median(times)
    return Timing("perf_counter", reps, med, statistics.fmean(times), min(times),
                  statistics.pstdev(times), loop_event_ms=med)


def _host_wall_check(fn, t: Timing, src, arg_sets, mark) -> None:
    """The CPU's wall-clock cross-check, filled into t: calls back to back, then a wait until
    every thread they started has finished and every other Python thread is idle; that loop's
    time per call against the per-call median. A call that returns at once and leaves its work
    to a thread is cheap per call and dear per loop.

    The loop's time is the lesser of its wall time and its process CPU time (all threads): on a
    busy machine the wall clock runs on while this process waits for a core, and CPU time does
    not; work moved to another thread still counts in CPU time. Best of CPU_WALL_TRIES loops."""
    n = int(min(CPU_WALL_MAX_CALLS, max(10, math.ceil(CPU_WALL_MIN_S * 1e3
                                                       / max(t.median_ms, 1e-6)))))
    if src is not None:
        n = min(n, src.pool)
    best = None
    for _ in range(CPU_WALL_TRIES):
        loop = ([a for _, a in src.take(n)] if src is not None
                else [arg_sets[i % len(arg_sets)] for i in range(n)])
        before = {th.ident for th in _enumerate_threads()}
        if mark is not None:
            mark("wall-start")
        c0, t0 = _process_time(), _perf_counter()
        for args in loop:
            fn(*args)
        left = _wait_for_threads(before)
        c1, t1 = _process_time(), _perf_counter()
        if mark is not None:
            mark("wall-end")
        del loop
        wall, cpu = (t1 - t0) * 1e3 / n, (c1 - c0) * 1e3 / n
        if best is None or min(wall, cpu) < min(best[0], best[1]):
            best = (wall, cpu, left)
        if not is_hidden_work(min(wall, cpu), t.median_ms, "cpu") and not left:
            break
    wall, cpu, left = best
    t.wall_ms, t.cpu_ms, t.wall_calls, t.threads_left = wall, cpu, n, left
    t.wall_over_event = min(wall, cpu) / max(t.median_ms, 1e-6)
    t.hidden_work = is_hidden_work(min(wall, cpu), t.median_ms, "cpu") or left > 0


def _wait_for_threads(before: set, limit_s: float = THREAD_WAIT_S) -> int:
    """Wait until the Python threads started since `before` have ended and the others are idle
    (see _thread_busy) at three looks in a row, 2 ms apart; the number still going after
    limit_s. The main thread waits by sleeping, without the GIL, so the others are free to run.
    torch's own pool threads are not Python threads and are not waited for."""
    me = threading.get_ident()
    deadline = _perf_counter() + limit_s
    quiet, last = 0, {}
    while quiet < 3:
        others = [th for th in _enumerate_threads() if th.ident != me and th.is_alive()]
        new = [th for th in others if th.ident not in before]
        for th in new:
            th.join(timeout=max(0.0, deadline - _perf_counter()))
        busy = [th for th in others if th.ident in before and _thread_busy(th, last)]
        quiet = 0 if new or busy else quiet + 1
        if _perf_counter() > deadline:
            return sum(th.is_alive() for th in new) + len(busy)
        _sleep(2e-3)
    return 0


def _thread_busy(th: threading.Thread, last: dict) -> bool:
    """Has the thread run since the last look (its CPU clock moved), or is it running or
    waiting for a core now (Linux: state R in /proc, which holds while other processes keep
    every core busy)? A thread that waits for the GIL or on a queue is neither."""
    busy = False
    try:
        clock = time.clock_gettime(time.pthread_getcpuclockid(th.ident))
        busy = th.ident in last and clock > last[th.ident]
        last[th.ident] = clock
    except (AttributeError, OSError, TypeError):   # not on this platform, or just ended
        pass
    try:
        with open(f"/proc/self/task/{th.native_id}/stat") as f:
            busy |= f.read().rsplit(")", 1)[1].split()[0] in ("R", "D")
    except (OSError, IndexError, AttributeError, TypeError):
        pass
    return busy


class GraphTimingError(RuntimeError):
    """time_graph could not capture or replay fn (it synchronizes, reads a value on the host,
    launches on another stream, ...). The message says which step failed."""


@dataclasses.dataclass
class GraphTiming:
    """Device time of one call from CUDA-graph replay, in milliseconds per call."""

    method: str        # "cuda-graph"
    calls: int         # calls captured in one graph (each between two L2 flushes)
    replays: int       # timed replays of each graph
    median_ms: float   # median over replays of (calls graph - flushes graph) / calls
    min_ms: float
    max_ms: float
    flush_ms: float    # the flushes alone per call (median of replays / calls), the part subtracted
    flush: str = "write"  # how the L2 was flushed (flush_l2's kinds, or "none")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def time_graph(fn: Callable, arg_sets: Sequence[Sequence], *, device, reps: int = 5,
               warmup: int = 3, flush: bool = True, calls: int = 16,
               flush_kind: str = "write") -> Optional[GraphTiming]:
    """Device time per call of fn(*arg_sets[i % len(arg_sets)]), host overhead removed: like
    triton.testing.do_bench_cudagraph, with the L2 flush kept. One graph holds `calls` calls,
    each between two L2 flushes (flush_l2, written by default as in time_fn); a second graph
    holds the flushes alone; both are replayed interleaved, first untimed for GRAPH_WARM_S, then
    `reps` times timed, and per call = (t_calls - t_flushes) / calls, median.

    The untimed replays are there because the first milliseconds of replays after a capture can
    run slow, the flushes alone as much as the calls (a forward+backward's graph read up to 15%
    slower in its first rounds than later, at the same SM clock; docs/learned.md).

    Returns None where the device is not CUDA (no graphs; host time is device time there).
    Raises GraphTimingError when fn cannot be captured or replayed; CUDA is usable afterwards
    (the capture is ended, the current stream restored, the device synchronized).

    Outputs are dropped inside the capture, so their memory is reused by the next call of the
    same capture and again on every replay: the graph's private pool does not grow. Inputs that
    require grad must be the same tensor objects on every call (arg_sets are fixed)."""
    if not is_cuda(device):
        return None
    if not arg_sets:
        raise ValueError("time_graph needs at least one argument set")
    fk = flush_kind if flush else None
    if fk is not None and fk not in FLUSH_KINDS:
        raise ValueError(f"flush kind {fk!r}: expected one of {FLUSH_KINDS}")
    graphs = []
    try:
        _warm_on_side_stream(fn, arg_sets, device, warmup, fk)
        graphs.append(_capture(fn, arg_sets, device, calls, fk, "the calls"))
        graphs.append(_capture(None, arg_sets, device, calls, fk, "the flushes"))
        try:
            t_calls, t_flush = _replay_ms(graphs, reps, device)
        except RuntimeError as e:
            raise GraphTimingError(f"replaying failed: {_short(str(e))}") from e
    finally:
        del graphs  # the private pools go back to the allocator with the graphs
        sync(device)
        torch.cuda.empty_cache()
    per_call = [(c - f) / calls for c, f in zip(t_calls, t_flush)]
    med = statistics.median(per_call)
    if med <= 0:
        raise GraphTimingError(f"device time {med * 1e3:.2f} us <= 0: the call is lost in the "
                               f"noise of the flushes ({statistics.median(t_flush) / calls:.4f} ms each)")
    return GraphTiming("cuda-graph", calls, reps, med, min(per_call), max(per_call),
                       statistics.median(t_flush) / calls, fk or "none")


def _warm_on_side_stream(fn, arg_sets, device, warmup, flush_kind):
    """torch.cuda.graph wants lazy initialization (autograd's, torch.compile's, workspaces,
    the flush buffer) done before capture, on a side stream (the CUDA graphs notes on
    whole-network capture)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            for i in range(max(1, warmup)):
                if flush_kind:
                    flush_l2(device, flush_kind)
                fn(*arg_sets[i % len(arg_sets)])
    except Exception as e:  # noqa: BLE001 - said as a timing failure, like the capture's
        raise GraphTimingError(f"warm-up on a side stream failed: {_short(f'{type(e).__name__}: {e}')}") from e
    finally:
        torch.cuda.current_stream(device).wait_stream(side)


def _capture(fn, arg_sets, device, calls, flush_kind, what) -> "torch.cuda.CUDAGraph":
    """One graph of `calls` calls of fn (or none, fn=None), each between two L2 flushes of that
    kind (calls + 1 flushes; None: no flush). The last flush writes back the last call's dirty
    lines inside its own graph, not in the next one replayed."""
    k = len(arg_sets)
    g = torch.cuda.CUDAGraph()
    # torch.cuda.graph's exit does not restore the stream when ending the capture raises
    stream = torch.cuda.current_stream(device)
    try:
        with torch.cuda.graph(g):
            for i in range(calls):
                if flush_kind:
                    flush_l2(device, flush_kind)
                if fn is not None:
                    fn(*arg_sets[i % k])  # the outputs are dropped here, inside the capture
            if flush_kind:
                flush_l2(device, flush_kind)
    except Exception as e:  # noqa: BLE001
        torch.cuda.set_stream(stream)
        cause = e.__context__  # fn's own error, when ending the aborted capture raised again
        why = f"{type(e).__name__}: {e}" + (f" (after {type(cause).__name__}: {cause})"
                                            if cause is not None else "")
        sync(device)  # raises here if the failure left the device itself broken
        raise GraphTimingError(f"capturing {what} failed: {_short(why)}") from e
    return g


def _replay_ms(graphs, replays, device):
    """Milliseconds of each replay of each graph, interleaved so that both see the same clocks.
    The first replay of a graph uploads it: done once, untimed. Then rounds of untimed replays
    until GRAPH_WARM_S have passed (at least two), and one more untimed replay of the last graph
    keeps the device busy while the host enqueues the timed ones, so no timed replay waits for
    its own launch."""
    stream = torch.cuda.current_stream(device)
    for g in graphs:
        g.replay()
    sync(device)
    t0, rounds = time.perf_counter(), 0
    while rounds < 2 or time.perf_counter() - t0 < GRAPH_WARM_S:
        for g in graphs:
            g.replay()
        sync(device)
        rounds += 1
    ev = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
           for _ in range(replays)] for _ in graphs]
    graphs[-1].replay()
    for i in range(replays):
        for g, pairs in zip(graphs, ev):
            pairs[i][0].record(stream)
            g.replay()
            pairs[i][1].record(stream)
    sync(device)
    return [[s.elapsed_time(e) for s, e in pairs] for pairs in ev]


def _short(text: str, limit: int = 300) -> str:
    """torch's CUDA errors run to many lines (a C++ trace); the JSON cell keeps the start."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + "..."


def copy_bandwidth(device, nbytes: int = 1 << 30, reps: int = 20) -> dict:
    """Bytes/s of dst.copy_(src) counting bytes read plus written: the roofline's denominator,
    measured in the same run as the kernels it is compared with."""
    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), [()], device=device, reps=reps, warmup=3)
    moved = 2 * n * 4
    del src, dst
    return {"bytes": moved, "median_ms": t.median_ms,
            "bytes_per_s": moved / (t.median_ms * 1e-3), "method": t.method}


def matmul_flops(device, dtype: torch.dtype, n: int = 8192, reps: int = 10) -> dict:
    """FLOP/s of one large square matmul in `dtype`: the compute roof for tasks that declare
    their FLOPs (GEMM and conv chains), measured rather than taken from a datasheet."""
    if not is_cuda(device):
        n = min(n, 512)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = time_fn(lambda: a @ b, [()], device=device, reps=reps, warmup=2, flush=False)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""),
            "flops_per_s": 2 * n**3 / (t.median_ms * 1e-3)}


def roofline(nbytes: int, ms: float, bytes_per_s: float, flops: int = 0,
             flops_per_s: float = 0.0) -> dict:
    """The fraction of the roofline reached: (the least time the work can take) / (time taken),
    where the least time is max(bytes / copy bandwidth, flops / matmul rate). Above
    ROOFLINE_LIMIT the result is impossible (a skipped computation, or a broken timer)."""
    if not ms or ms <= 0 or math.isnan(ms) or not bytes_per_s:
        return {"fraction": None, "achieved_bytes_per_s": None, "impossible": False}
    t_min = nbytes / bytes_per_s
    if flops and flops_per_s:
        t_min = max(t_min, flops / flops_per_s)
    frac = t_min / (ms * 1e-3)
    return {"fraction": frac, "achieved_bytes_per_s": nbytes / (ms * 1e-3),
            "impossible": frac > ROOFLINE_LIMIT}


def host_overhead_us(fn: Callable, args: Sequence, calls: int = 200, warmup: int = 20,
                     device=None) -> float:
    """Host time per call of fn(*args) without synchronizing (the launch path only). Inputs are
    small so the device keeps up and the queue never pushes back. The garbage collector is off
    while timing, as timeit has it: a collection is the process's cost, not the call's."""
    for _ in range(warmup):
        fn(*args)
    if device is not None:
        sync(device)
    collecting = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        dt = time.perf_counter() - t0
    finally:
        if collecting:
            gc.enable()
    if device is not None:
        sync(device)
    return dt * 1e6 / calls
