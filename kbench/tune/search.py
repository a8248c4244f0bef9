"""The schedule search of one region (docs/DESIGN.md, "Search"): csrc/tune/evolve.c's genetic
search asks for genomes; each is generated, compiled by NVRTC (several at once), run first in the
sandbox's worker process at every size its verification uses (sandbox.py: a hang, a trap or an
out-of-bounds write refuses it there, never here), gated on one shape against the float64
reference with NaN-poisoned outputs, timed (CUDA events, median, L2 flushed between repetitions)
and told. The fastest few, the default genome among them, are
re-timed interleaved (A B C A B C) and the winner goes through full verification. Every
candidate is recorded.

The same seed must pick the same winner, yet two kernels a few percent apart swap places from
run to run on a real GPU. So the winner is never decided by "whichever measured faster" where the
measurements cannot tell:
- finalists: all candidates within FINALIST_BAND (twice the tie band) of the generation's fastest,
  in asked order (fixed by the seed), up to a cap; one near a later decision is in every run,
  however the noisy generation timing ordered it;
- each decision (is X within KEEP_DEFAULT of every finalist? is the default beaten by more than
  KEEP_DEFAULT? does X beat the default?) looks at the per-round ratios of the two (rounds are
  paired: interleaved, so drift hits both alike) and a distribution-free interval of their median.
  Clear when the interval is on one side of the threshold; otherwise more interleaved rounds, for
  the finalists in the decisions that pick the winner only, up to MAX_ROUNDS_FACTOR x the budget's
  rounds and RETIME_EXTRA_S. Still unclear then: a near-tie, resolved the deterministic way (the
  default stays, the earliest asked wins), never toward the one measured faster;
- after each L2 flush the region's buffers are touched, one byte per 64 KB (kernels/touch.cu): the
  flush also evicts their address translations, and what a kernel then pays to get them back
  depends on where the flush buffer falls against its buffers, enough to reorder two kernels a
  few percent apart; touched, the ratio stays within its noise;
- every round runs on a layout of its own: the inputs copied to, and the outputs written at, an
  offset into one arena drawn for that round, with a gap between the buffers drawn too (_layout;
  the same sequence in every search). Where a region's buffers fall moves the ratio of two
  kernels by several percent (docs/learned.md), so a few fixed layouts give each search a level
  of its own; a round per layout makes the rounds a sample of layouts, the interval covers the
  spread over them, and the more rounds an unclear decision takes, the nearer every search's
  median comes to the same value, the user's run's layout being one more;
- and each finalist is loaded LOADS times, round n running load n % LOADS: loaded instances (a
  module each) of one kernel differ in speed by a few percent, beyond their noise and whatever
  the order, so a search, which loads its kernels afresh, would otherwise have a level of its
  own; the user's process loads its own instance.

Everything that touches a device is in a bench object (CudaRegionBench), so the driver (ask/tell
loop, budgets, finalists, the default-kept rule, the record) runs on the CPU with a fake one."""
from __future__ import annotations

import concurrent.futures as cf
import functools
import hashlib
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from .. import _C, verify
from ..runtime import nvrtc
from . import sandbox

log = logging.getLogger("kbench")


@dataclass(frozen=True)
class Budget:
    candidates: int          # distinct kernels generated, compiled and timed
    seconds: float           # wall clock of the generations (finalists and verification come after)
    population: int          # candidates per generation
    compile_timeout: float   # one compile, from when it starts
    reps: int                # timed repetitions per candidate (the median is told)
    finalists: int           # re-timed interleaved, the default genome joining them
    rounds: int              # interleaved rounds of one repetition each
    generations: int = 0     # at most this many generations (0: no limit but the others)


BUDGETS = {
    # fast is one generation: the default and 11 seeded random genomes, the same for a seed
    "fast": Budget(12, 10.0, 12, 20.0, 10, 3, 20, generations=1),
    "default": Budget(48, 60.0, 12, 30.0, 20, 3, 20),
    "max": Budget(160, 300.0, 16, 60.0, 30, 4, 30),
}
KEEP_DEFAULT = 0.05      # a winner within 5% of the default is noise: the default stays
GATE_TIMEOUT_S = 10.0    # a kernel still running after this long is taken as hung
DUPLICATE_FACTOR = 4     # asks (kernels generated more than once included) per budgeted candidate
FINALIST_BAND = 2 * KEEP_DEFAULT   # re-timed: every candidate within this of the fastest, but
FINALIST_CAP_FACTOR = 2  # at most this many times the budget's finalists
MAX_ROUNDS_FACTOR = 128  # unclear decisions: more interleaved rounds, up to this many times the budget's
RETIME_EXTRA_S = 2.0     # and this many seconds of extra rounds
ALPHA = 1e-4             # a decision is clear when the two-sided 1 - ALPHA interval is on one side
LOADS = 16               # instances of each finalist its rounds rotate through
ARENA_SPANS = 16         # the layouts' arena: this many times a region's buffers, at least ARENA_MIN_BYTES
ARENA_MIN_BYTES = 64 << 20
PLACEMENT_BYTES = 2 << 30   # and at most this much, and a quarter of what is free

# driver errors after which the context is unusable (a trap poisons it for every later call)
_STICKY = ("illegal_address", "illegal memory access", "launch_failed", "unspecified launch failure",
           "misaligned", "illegal_instruction", "illegal instruction", "hardware_stack_error",
           "hardware stack error", "assert", "launch_timeout", "launch timed out", "context is destroyed",
           "context_is_destroyed", "ecc", "kernel hang")


class KernelHang(RuntimeError):
    """A launched kernel did not finish within GATE_TIMEOUT_S."""


def is_fatal(exc: BaseException) -> bool:
    """Does this error leave the CUDA context unusable (a trap, a hang)?"""
    if isinstance(exc, KernelHang):
        return True
    text = str(exc).lower()
    return any(s in text for s in _STICKY)


def is_oom(exc: BaseException) -> bool:
    """Did the device run out of memory (torch's allocator, or the driver's CUDA_ERROR_OUT_OF_MEMORY)?"""
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


@dataclass
class SearchResult:
    best_k: object | None            # the winner's _C.KernelInfo (generate()); None when nothing verified
    best_ms: float | None            # its time (interleaved re-timing when there were finalists)
    default_ms: float | None         # the default genome's, measured the same way
    candidates: list = field(default_factory=list)   # one dict per candidate (cache.CANDIDATE_FIELDS + extras)
    seconds: float = 0.0
    best_genome: str = ""            # canonical texts (str(Genome)): the names of their candidates' records
    default_genome: str = ""
    generations: int = 0
    kernel: object = None            # the winner as loaded by the bench (the executor's Kernel)
    verdict: object = None           # the winner's full verification
    note: str = ""                   # why there is no winner, where there is none
    poisoned: bool = False           # a kernel trapped or hung in this process: its CUDA context may be unusable


def _first_lines(text: str, n: int = 2) -> str:
    return "\n".join(str(text).strip().splitlines()[:n])


def kernel_key(k) -> str:
    """What makes two generated kernels (_C.KernelInfo) the same: the source (less its genome
    comment) and the launch. Genomes that differ only in genes codegen ignores give the same key."""
    src = "\n".join(line for line in k.source.splitlines() if not line.startswith("// genome:"))
    launch = (k.block, k.smem, repr(k.grid_units), k.units_per_block, k.nkernels, k.workspace_bytes_per_unit,
              k.workspace_bytes_per_block, k.max_blocks)
    return hashlib.sha256((src + "\n" + repr(launch)).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _trim(n: int) -> int:
    """Order statistics to drop at each end of n samples for a two-sided 1 - ALPHA interval of their
    median: the largest k with 2 P(Binomial(n, 1/2) <= k - 1) <= ALPHA (0: too few to say anything)."""
    k, tail = 0, 0.0
    while True:
        tail += math.comb(n, k) / 2 ** n     # P(Binomial(n, 1/2) <= k)
        if 2 * tail > ALPHA:
            return k
        k += 1


def _hash(k: int, salt: int = 0) -> int:
    """A fixed 15-bit value of k (Fibonacci hashing): the same layouts in every search."""
    return ((((k ^ salt) * 0x9E3779B97F4A7C15) & (2 ** 64 - 1)) >> 49)


def _layout(k: int, sizes, room: int) -> tuple[int, int]:
    """(offset, gap) of layout k in an arena of room bytes holding buffers of these sizes (each a
    multiple of 256), one after another with gap bytes after each: layout 0 at offset 0 without
    gaps (a candidate's generation timing), the others with gaps of 256 B to 8 MB and offsets
    spread over the arena, both in 256-byte steps and shrunk to fit."""
    if k == 0:
        return 0, 0
    total, n = sum(sizes), len(sizes)
    gap = min(_hash(k) * 256, (room - total) // n // 256 * 256)
    slots = (room - total - gap * n) // 256 + 1
    return (_hash(k, 0x5bd1e995) * slots >> 15) * 256, gap


def _ratio_interval(a: dict, b: dict) -> tuple[float, float]:
    """An interval for the median of a[i] / b[i] over the rounds i both were timed in (times by round).
    Distribution-free (order statistics) and without randomness: the same samples, the same decision.
    (0, inf) when there are too few paired rounds to say anything."""
    r = sorted(a[i] / b[i] for i in a.keys() & b.keys() if b[i] > 0)
    k = _trim(len(r))
    return (r[k - 1], r[len(r) - k]) if k else (0.0, math.inf)


# ---------------------------------------------------------------------------------------- the GPU side

class CudaRegionBench:
    """Region r of a CudaExecutor at one shape: generate, compile, load, gate, time, verify.
    Built inside the executor's device context; the gate's inputs and float64 reference are
    computed once and shared by every candidate."""

    def __init__(self, executor, r: int, symvals, verifier=verify.verify_region, sizes=None):
        self.torch, self.verify_mod, self.verifier = torch, verify, verifier
        self.sizes = sizes       # where the sandbox runs each candidate: verification's points (plan_points)
        plan = getattr(executor, "plan", None)
        self.precision = plan.precision(r) if hasattr(plan, "precision") else None
        self.ex, self.r, self.symvals = executor, r, list(symvals)
        gen = torch.Generator().manual_seed(getattr(executor, "seed", 0) + 7919 * (r + 1))
        self.inputs = executor.region_inputs(r, self.symvals, "normal", gen)
        self.clones = [x.clone() for x in self.inputs]
        self.ref = executor.reference(r, self.symvals, self.clones)
        device = self.inputs[0].device if self.inputs else getattr(executor, "device", torch.device("cpu"))
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        l2 = int((getattr(executor, "dev", None) or {}).get("l2_bytes", 0)) if self.cuda else 0
        # reading twice the L2 between repetitions evicts the inputs: each repetition reads from DRAM.
        # Read, not written: a written flush leaves the L2 full of dirty lines, and how many of them
        # a candidate then writes back depends on where its buffers fall, enough to double one
        # kernel's measured time from one search to the next; the ranking of candidates needs each
        # one's own traffic only.
        self.flush = torch.zeros(max(1, 2 * l2 // 4), dtype=torch.int32, device=self.device) if l2 else None
        self.flush_out = torch.zeros((), dtype=torch.int64, device=self.device) if l2 else None
        self.arena = None        # the layouts' memory, made at first use (see placement)
        self._shapes = self._sizes = None   # the outputs' (shape, dtype); every buffer's bytes in the arena
        self.layout = None       # (k, (inputs, outputs, spans)): the layout the buffers are in now

    def placement(self, kernel, round_index: int):
        """The buffers of one timed repetition: layout round_index (_layout) of the arena, the
        inputs copied there when it changes, the outputs beside them. The arena is ARENA_SPANS
        times the buffers (ARENA_MIN_BYTES at least), capped by PLACEMENT_BYTES and a quarter of
        the free memory. Where not even one copy fits: the gate's inputs and outputs of their own,
        the same for every round. Returns (inputs, outputs, spans)."""
        if self.layout is not None and self.layout[0] in (round_index, None):
            return self.layout[1]
        torch = self.torch
        if self.arena is None:
            self._shapes = shapes = self.ex.launch_params(kernel, self.r, self.symvals)[0]
            sizes = [x.numel() * x.element_size() for x in self.inputs] + [math.prod(s) * d.itemsize for s, d in shapes]
            self._sizes = [-(-n // 256) * 256 for n in sizes]   # each buffer 256-byte aligned
            room = min(PLACEMENT_BYTES, max(ARENA_SPANS * sum(self._sizes), ARENA_MIN_BYTES))
            if self.cuda:
                room = min(room, torch.cuda.mem_get_info(self.device)[0] // 4)
            room = room // 256 * 256
            if room < sum(self._sizes):   # no room for a copy of the inputs: the gate's own, for good
                outs = [torch.empty(s, dtype=d, device=self.device) for s, d in shapes]
                self.arena = False
                self.layout = (None, (self.inputs, outs, self._spans(self.inputs + outs)))
                return self.layout[1]
            self.arena = torch.empty(room, dtype=torch.uint8, device=self.device)
        offset, gap = _layout(round_index, self._sizes, self.arena.numel())
        views, at = [], offset
        for n in self._sizes:
            views.append(self.arena[at:at + n])
            at += n + gap
        ins = []
        for x, v in zip(self.inputs, views):
            t = v[:x.numel() * x.element_size()].view(x.dtype).view(x.shape)
            t.copy_(x)
            ins.append(t)
        outs = [v[:math.prod(s) * d.itemsize].view(d).view(s) for v, (s, d) in zip(views[len(ins):], self._shapes)]
        self.layout = (round_index, (ins, outs, self._spans(ins + outs)))
        return self.layout[1]

    def _spans(self, tensors):
        """What the touch reads: (address, bytes) of each tensor, flat, on the device."""
        spans = [v for t in tensors for v in (t.data_ptr(), t.numel() * t.element_size())]
        return self.torch.tensor(spans, dtype=self.torch.int64, device=self.device)

    def touch(self, buffers) -> None:
        """Reads one byte per 64 KB of a buffer set's tensors (kbench/kernels/touch.cu): the flush
        also evicted their address translations (see the module's docstring)."""
        ex = self.ex
        spans = buffers[2]
        _C.launch(ex.cuda, ex.helper("touch.cu", "kb_touch"), 32, 256, 0, None,
                  (spans, self.flush_out, spans.numel() // 2))

    def flush_l2(self) -> None:
        """Reads the flush buffer (its sum into a scalar): the L2 then holds clean lines only."""
        if self.flush is not None:
            self.torch.sum(self.flush, dim=0, dtype=self.torch.int64, out=self.flush_out)

    def generate(self, genome):
        """The region's kernel (a _C.KernelInfo) for a _C.Genome; ValueError where codegen refuses it."""
        ex = self.ex
        return _C.generate(ex.plan.partition, self.r, ex.sm, genome, ex.dev)

    def compile(self, k) -> None:
        """NVRTC into the disk cache; runs in a worker thread (the compile releases the GIL)."""
        nvrtc.compile(k.source, self.ex.arch)

    def load(self, k):
        return self.ex.load(k)   # a cache hit after compile()

    def sandbox(self, k, kernel) -> str:
        """The candidate's first launches, in the sandbox's worker process at every size its
        verification uses (kbench/tune/sandbox.py): "" where it passed, else its fate. On a CPU
        stand-in executor (tests) there is no GPU to protect and nothing runs there."""
        if not self.cuda:
            return ""
        if self.sizes is None:
            self.sizes = verify.plan_points(self.ex, self.r, self.symvals)[0] or [self.symvals]
        return sandbox.check(self.ex, self.r, k, kernel, nvrtc.compile(k.source, self.ex.arch), self.sizes)

    def _launch(self, kernel, poison=False, buffers=None):
        ins, outs = buffers[:2] if buffers else (self.inputs, None)
        return self.ex.launch(kernel, self.r, self.symvals, ins, poison=poison, outs=outs)

    def _sync(self, timeout: float = GATE_TIMEOUT_S) -> None:
        if not self.cuda:
            return
        torch = self.torch
        ev = torch.cuda.Event()
        ev.record()
        deadline = time.perf_counter() + timeout
        while not ev.query():   # raises the driver's error after a trap
            if time.perf_counter() > deadline:
                raise KernelHang(f"kernel hang: still running after {timeout:.0f} s")
            time.sleep(1e-4)

    def gate(self, kernel) -> str:
        """One shape, one distribution, outputs poisoned: "" if the kernel matches, else why not."""
        outs = self._launch(kernel, poison=True)
        self._sync()
        for i, (x, c) in enumerate(zip(self.inputs, self.clones)):
            if not self.torch.equal(x, c):
                x.copy_(c)
                return f"the kernel modified input {i}"
        for j, (o, ref) in enumerate(zip(outs, self.ref)):
            ok, _, why = self.verify_mod.compare(o, ref, self.precision)
            if not ok:
                return f"output {j}: {why}"
        return ""

    def time(self, kernel, reps: int, warmup: int = 2) -> list:
        """reps times in ms, each after the L2 flush, from CUDA events on the current stream, on
        layout 0: a generation's candidates all on the same one."""
        buffers = self.placement(kernel, 0)
        # one call first: a candidate the sandbox passed ends, but may take long (one block
        # over a huge row, seconds a call). All its reps would pass the hang timeout; it
        # cannot win, so that one call stands for every rep
        first = self._timed([kernel], buffers)
        if first[0] * (warmup + reps) > GATE_TIMEOUT_S * 1e3 / 2:
            return first * reps
        for _ in range(warmup - 1):
            self._launch(kernel, buffers=buffers)
        return self._timed([kernel] * reps, buffers)

    def time_each(self, kernels, round_index: int = 0) -> list:
        """One repetition of each kernel, in order, each after the L2 flush, in ms; one sync for
        them all. The finalists' rounds, on the round's own layout (placement). With a sync per
        repetition (milliseconds each, for kernels of tens of microseconds) the extra rounds'
        time cap, RETIME_EXTRA_S, cut them off long before their count cap did."""
        if not kernels:
            return []
        return self._timed(kernels, self.placement(kernels[0], round_index))

    def _timed(self, kernels, buffers) -> list:
        """Each kernel launched once after the L2 flush and the touch of its buffers, timed by CUDA
        events; one sync at the end. On a CPU stand-in executor (tests): wall clock."""
        if not self.cuda:
            out = []
            for k in kernels:
                t = time.perf_counter()
                self._launch(k, buffers=buffers)
                out.append((time.perf_counter() - t) * 1e3)
            return out
        torch = self.torch
        pairs = []
        for k in kernels:
            self.flush_l2()   # also keeps the GPU busy while the host enqueues the launch
            if self.flush is not None:
                self.touch(buffers)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self._launch(k, buffers=buffers)
            b.record()
            pairs.append((a, b))
        self._sync()
        return [a.elapsed_time(b) for a, b in pairs]

    def verify(self, kernel):
        return self.verifier(self.ex, self.r, kernel, self.symvals)


# ---------------------------------------------------------------------------------------- the driver

class _Search:
    def __init__(self, executor, r, symvals, budget: Budget, seed, progress, bench):
        self.r, self.symvals, self.b, self.seed, self.progress, self.bench = r, list(symvals), budget, seed, progress, bench
        self.h = _C.evolve_new(executor.plan.partition, r, self.symvals, getattr(executor, "dev", None), seed,
                               budget.population)
        # every dict below is keyed by the genome's canonical text, as the records name it
        self.records: list[dict] = []
        self.by_genome: dict[str, dict] = {}
        self.by_kernel: dict[str, dict] = {}
        self.genomes: dict = {}               # genome text -> the _C.Genome asked
        self.ks: dict = {}                    # genome text -> generated kernel (_C.KernelInfo)
        self.kernels: dict[str, object] = {}  # genome text -> loaded kernel (timed successfully)
        self.default_genome = ""
        self.fatal = ""                       # why the search stopped before its budget
        self.poisoned = False                 # ... where that was a trap or hang in this process
        self.counted = 0
        self.asked = 0
        self.generations = 0
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def tell(self, rec: dict, ms: float) -> None:
        _C.evolve_tell(self.h, self.genomes[rec["genome"]], ms)

    def fail(self, rec: dict, status: str | None = None, log_text: str = "", verify: str = "") -> None:
        if status is not None:
            rec["compile_status"] = status
        if log_text:
            rec["compile_log"] = _first_lines(log_text)
        if verify:
            rec["verify"] = verify
        self.tell(rec, -1.0)

    def new_record(self, genome, gen: int) -> dict:
        """The record of an asked _C.Genome, named by its canonical text (the cache stores it)."""
        text = str(genome)
        rec = {"genome": text, "compile_status": None, "compile_log": "", "regs": None, "spills": None,
               "time_ms": None, "verify": "", "generation": gen, "seed": self.seed}
        self.records.append(rec)
        self.by_genome[text] = rec
        self.genomes[text] = genome
        return rec

    # ------------------------------------------------------------------ generations

    def run(self) -> None:
        b = self.b
        # NOTE: not a `with` block: its exit would wait for a compile that hangs past its timeout
        pool = cf.ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 2)),
                                     thread_name_prefix="kbench-nvrtc")
        try:
            while not self.fatal and self.counted < b.candidates and self.elapsed() < b.seconds \
                    and self.asked < DUPLICATE_FACTOR * b.candidates \
                    and not (b.generations and self.generations >= b.generations):
                genomes = _C.evolve_ask(self.h, min(b.population, b.candidates - self.counted))
                if not genomes:
                    break   # every legal genome was tried
                gen = _C.evolve_generation(self.h)
                if not self.default_genome:
                    self.default_genome = str(genomes[0])
                self.generations = gen + 1
                self.asked += len(genomes)
                self.batch(pool, genomes, gen)
                if self.progress is not None:
                    best = _C.evolve_best(self.h)
                    self.progress(self.r, gen, best[1] if best else None)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def batch(self, pool, genomes, gen) -> None:
        pending, dups = [], []
        for genome in genomes:
            rec = self.new_record(genome, gen)
            try:
                k = self.bench.generate(genome)
            except (ValueError, NotImplementedError) as e:
                self.fail(rec, "codegen rejected", str(e))
                self.counted += 1
                continue
            key = kernel_key(k)
            rec["source_hash"] = key[:12]
            same = self.by_kernel.get(key)
            self.ks[rec["genome"]] = k
            if same is not None:   # codegen ignored the genes that differ: share the result, no budget
                dups.append((rec, same))
                continue
            self.by_kernel[key] = rec
            self.counted += 1
            pending.append((rec, k))
        started: dict[int, float] = {}

        def job(i, k):
            started[i] = time.perf_counter()
            self.bench.compile(k)

        futures = [pool.submit(job, i, k) for i, (_, k) in enumerate(pending)]
        for i, ((rec, k), fut) in enumerate(zip(pending, futures)):
            if self.fatal:
                rec["compile_status"] = rec["compile_status"] or "not run"
                rec["verify"] = f"search stopped: {self.fatal}"
                continue
            self.evaluate(rec, k, fut, started, i)
        for rec, same in dups:
            for f in ("compile_status", "compile_log", "regs", "spills", "time_ms", "verify", "sandbox"):
                if f in same:
                    rec[f] = same[f]
            rec["same_kernel_as"] = same["genome"]
            if same.get("_ok"):
                self.kernels[rec["genome"]] = self.kernels[same["genome"]]
                self.tell(rec, same["time_ms"])
            elif same["compile_status"] != "not run":
                self.tell(rec, -1.0)

    def wait_compile(self, fut, started, i) -> str:
        """Empty when compiled, "timeout" when it ran past the limit; a compile error raises."""
        limit = self.b.compile_timeout
        while True:
            try:
                fut.result(timeout=0.05)
                return ""
            except cf.TimeoutError:
                t = started.get(i)
                if t is not None and time.perf_counter() - t > limit:
                    return "timeout"
                # queued behind hung compiles: give up once the whole search is over time
                if t is None and self.elapsed() > self.b.seconds + limit:
                    return "timeout"

    def evaluate(self, rec, k, fut, started, i) -> None:
        bench = self.bench
        try:
            why = self.wait_compile(fut, started, i)
        except Exception as e:   # CompileError (NVRTC's log) or anything the compile raised
            self.fail(rec, "compile error", str(e))
            return
        if why == "timeout":
            self.fail(rec, "compile timeout", f"no CUBIN after {self.b.compile_timeout:g} s")
            return
        rec["compile_status"] = "ok"
        try:
            kernel = bench.load(k)
        except Exception as e:
            if is_oom(e):
                raise
            if is_fatal(e):
                self.fatal, self.poisoned = _first_lines(e, 1), True
            self.fail(rec, "load error", str(e))
            return
        rec["regs"], rec["spills"] = getattr(kernel, "regs", None), getattr(kernel, "spills", None)
        # nothing launches here before the sandbox's worker has run it (a trap there costs that process)
        try:
            fate = bench.sandbox(k, kernel)
        except sandbox.SandboxUnavailable as e:   # nothing can be checked: no candidate can be run
            self.fatal = _first_lines(e, 1)
            self.fail(rec, verify=f"sandbox: {self.fatal}")
            rec["sandbox"] = "unavailable"
            return
        except Exception as e:
            if is_oom(e):
                raise
            fate = f"could not be run there: {_first_lines(e, 1)}"
        rec["sandbox"] = fate or "ok"
        if fate:
            self.fail(rec, verify=f"sandbox: {fate}")
            return
        try:
            why = bench.gate(kernel)
            if why:
                self.fail(rec, verify=f"gate: {why}")
                return
            times = bench.time(kernel, self.b.reps)
        except Exception as e:
            if is_oom(e):
                raise
            if is_fatal(e):
                self.fatal, self.poisoned = _first_lines(e, 1), True
                self.fail(rec, verify=f"trap: {_first_lines(e, 1)}")
            else:
                self.fail(rec, verify=f"launch failed: {_first_lines(e, 1)}")
            return
        rec["verify"] = "gate ok"
        rec["time_ms"] = statistics.median(times)
        rec["_ok"] = True
        self.kernels[rec["genome"]] = kernel
        self.tell(rec, rec["time_ms"])

    # ------------------------------------------------------------------ finalists

    def finalists(self) -> list[str]:
        """Every candidate within FINALIST_BAND of the fastest, those within KEEP_DEFAULT first, each
        in the order asked (fixed by the seed), at most FINALIST_CAP_FACTOR x the budget's finalists;
        then the fastest of the rest up to the budget's finalists; the default joins them. The band
        is twice the tie band, so one near a later decision gets in every run however the noisy
        generation timing ordered it: only far slower ones sit at its edge. Where the cap bites,
        those in the tie band go first, so the generation's fastest (or a near-tie of it) is in."""
        ok = [rec for rec in self.records if rec.get("_ok") and "same_kernel_as" not in rec]
        names = []
        if ok:
            top = min(rec["time_ms"] for rec in ok)
            near = [rec for rec in ok if rec["time_ms"] <= top * (1 + FINALIST_BAND)]
            near.sort(key=lambda rec: rec["time_ms"] > top * (1 + KEEP_DEFAULT))   # stable: asked order kept
            names = [rec["genome"] for rec in near][:FINALIST_CAP_FACTOR * self.b.finalists]
            rest = sorted((rec for rec in ok if rec["genome"] not in names), key=lambda rec: rec["time_ms"])
            names += [rec["genome"] for rec in rest[:max(0, self.b.finalists - len(names))]]
        if self.default_genome in self.kernels and self.default_genome not in names:
            names.append(self.default_genome)
        return names

    def retime(self, names) -> dict[str, dict[int, float]]:
        """Interleaved: one repetition of each finalist per round, so drift hits all alike; the
        budget's rounds, then batches of as many again for the finalists of the unclear decisions
        that pick the winner (standings), until clear or the cap. Each finalist's times by round."""
        samples: dict[str, dict[int, float]] = {g: {} for g in names}
        if len(names) < 2:
            return samples
        loads = {g: self.instances(g) for g in names}
        for g in names:
            for kernel in loads[g]:
                self.bench.time(kernel, 0)   # warm-up only (a lazily loaded module loads at its first launch)
        b, n = self.b, 0
        cap, timing, deadline = MAX_ROUNDS_FACTOR * b.rounds, list(names), None
        while timing:
            for _ in range(min(b.rounds, cap - n)):
                if deadline is not None and time.perf_counter() >= deadline:
                    return samples
                for g, ms in zip(timing, self.bench.time_each([loads[g][n % len(loads[g])] for g in timing], n)):
                    samples[g][n] = ms
                n += 1
            if n >= cap:
                break
            deadline = deadline or time.perf_counter() + RETIME_EXTRA_S
            unclear = self.standings(names, samples)[1]
            timing = [g for g in names if g in unclear]
        return samples

    def instances(self, g) -> list:
        """Finalist g's kernel and LOADS - 1 more loads of it (see the module's docstring)."""
        return _instances(self.bench, self.ks[g], self.kernels[g])

    def standings(self, names, samples) -> tuple[dict[str, str], set[str]]:
        """Each finalist's standing, from the paired intervals of its time over the others':
          "out":  another is clearly more than KEEP_DEFAULT faster (for the default: its time
                  clearly more than KEEP_DEFAULT over another's; the default-kept rule);
          "in":   none can be;
          "tie":  not out, but a comparison is unclear: taken as a near-tie, so it may win;
          "not faster than the default": the default is out, and this one is not clearly faster
                  than it (an unclear one does not replace the default: the default stays).
        The winner is the first "in" or "tie" in asked order (the default is asked first). Also
        returns the finalists of the unclear decisions up to the winner: more rounds may settle them."""
        d = self.default_genome if self.default_genome in names else None
        asked = {rec["genome"]: i for i, rec in enumerate(self.records)}
        stand: dict[str, str] = {}
        unclear: set[str] = set()
        decided = False
        for g in sorted(names, key=lambda g: (g != d, asked[g])):
            limit = 1 / (1 - KEEP_DEFAULT) if g == d else 1 + KEEP_DEFAULT
            ivals = {t: _ratio_interval(samples[g], samples[t]) for t in names if t != g}
            unsure = {t for t, (lo, hi) in ivals.items() if lo <= limit < hi}
            if any(lo > limit for lo, _ in ivals.values()):
                stand[g], unsure = "out", set()
            else:
                stand[g] = "tie" if unsure else "in"
                if d is not None and g != d and stand[d] == "out":
                    lo, hi = ivals[d]
                    if hi >= 1:
                        stand[g] = "not faster than the default"
                        unsure = (unsure | {d}) if lo < 1 else set()   # unclear: more rounds may tell
            if not decided and unsure:
                unclear |= unsure | {g}
            decided = decided or stand[g] in ("in", "tie")
        return stand, unclear

    def order(self, names, stand: dict, final: dict) -> list[str]:
        """Verification order: those that may win ("in", "tie") in asked order, the default first;
        then the others, fastest first."""
        asked = {rec["genome"]: i for i, rec in enumerate(self.records)}
        d = self.default_genome
        first = sorted((g for g in names if stand[g] in ("in", "tie")), key=lambda g: (g != d, asked[g]))
        return first + sorted((g for g in names if g not in first), key=lambda g: (final[g], asked[g]))

    def finish(self) -> SearchResult:
        """The winner: the first finalist, in order(), that passes full verification. Nothing
        unverified is ever kept: a search that stopped (a trap or hang here, no sandbox) or where
        nothing verified has no winner, and the note says why (the region runs in torch)."""
        res = SearchResult(None, None, None, self.records, 0.0, default_genome=self.default_genome,
                           generations=self.generations)
        d = self.by_genome.get(self.default_genome)
        res.default_ms = d["time_ms"] if d else None
        if self.fatal:
            res.poisoned = self.poisoned
            res.note = f"search stopped: {self.fatal}" + ("; the CUDA context may be unusable" if self.poisoned else "")
            return self._done(res)
        names = self.finalists()
        try:
            samples = self.retime(names)
        except Exception as e:
            if not is_fatal(e):
                raise
            self.fatal, self.poisoned = _first_lines(e, 1), True
            return self.finish()
        stand = self.standings(names, samples)[0]
        final = {g: statistics.median(list(samples[g].values())) if samples[g] else self.by_genome[g]["time_ms"]
                 for g in names}
        for g in names:
            rec = self.by_genome[g]
            rec["final_ms"], rec["final_rounds"], rec["tie"] = final[g], len(samples[g]), stand[g]
        if d is not None and self.default_genome in final:
            res.default_ms = final[self.default_genome]
        for g in self.order(names, stand, final):
            rec = self.by_genome[g]
            try:
                verdict = self.bench.verify(self.kernels[g])
            except Exception as e:
                if is_oom(e):
                    raise
                if not is_fatal(e):
                    rec["verify"] = f"full: raised {_first_lines(e, 1)}"
                    continue
                self.fatal, self.poisoned = _first_lines(e, 1), True
                rec["verify"] = f"trap: {self.fatal}"
                return self.finish()
            if not verdict:
                rec["verify"] = f"full: {getattr(verdict, 'reason', 'failed')}"
                continue
            rec["verify"] = "full ok"
            res.best_genome, res.best_k, res.best_ms = g, self.ks[g], final[g]
            res.kernel, res.verdict = self.kernels[g], verdict
            break
        else:
            res.note = self.why_none(names)
        return self._done(res)

    def why_none(self, names) -> str:
        """One line on why no candidate won: verification refused the finalists, or none got that
        far (what became of the candidates, the sandbox's first refusal among them)."""
        if names:
            first = next((self.by_genome[g]["verify"] for g in names if self.by_genome[g]["verify"].startswith("full:")),
                         "")
            return f"no candidate passed full verification (first: {first.removeprefix('full: ')})"
        refused = [rec for rec in self.records if rec.get("sandbox") not in (None, "ok")]
        gated = [rec for rec in self.records if rec["verify"].startswith("gate:")]
        built = [rec for rec in self.records if rec["compile_status"] == "ok"]
        parts = [f"{len(built)} of {len(self.records)} compiled"]
        if refused:
            parts.append(f"{len(refused)} refused by the sandbox (first: {refused[0]['sandbox']})")
        if gated:
            parts.append(f"{len(gated)} failed the gate (first: {gated[0]['verify'][6:]})")
        return "no candidate compiled and passed the sandbox and the gate: " + ", ".join(parts)

    def _done(self, res: SearchResult) -> SearchResult:
        for rec in self.records:
            rec.pop("_ok", None)
        res.seconds = self.elapsed()
        return res


def search_region(executor, r: int, example_symvals, *, budget="default", seed: int = 0, progress=None,
                  bench=None, verifier=verify.verify_region, sizes=None) -> SearchResult:
    """Search region r's schedule on the executor's GPU at the example sizes.

    budget: "fast" | "default" | "max" or a Budget. progress: optional callable (region,
    generation, best_ms) after each generation. bench: the device side (CudaRegionBench by
    default; tests pass a fake); verifier(executor, r, kernel, symvals) -> verify.Verdict, the
    winner's full check; sizes: the sizes it checks at, where the sandbox runs each candidate
    (verify.plan_points' by default). The default genome is always a candidate and stays unless a
    verified candidate beats it by more than KEEP_DEFAULT; result.best_k is None when nothing
    verified, and result.note says why (result.poisoned: a trap or hang in this process). The
    device running out of memory ends the search the same way."""
    b = BUDGETS.get(budget) if isinstance(budget, str) else budget
    if not isinstance(b, Budget):
        raise ValueError(f"budget must be one of {sorted(BUDGETS)} or a Budget, got {budget!r}")
    s = None
    try:
        if bench is None:
            bench = CudaRegionBench(executor, r, example_symvals, verifier, sizes)
        s = _Search(executor, r, example_symvals, b, seed, progress, bench)
        s.run()
        res = s.finish()
    except Exception as e:
        if not is_oom(e):
            raise
        if torch.cuda.is_available():
            torch.cuda.empty_cache()   # what the search held goes back before the region runs in torch
        res = SearchResult(None, None, None, s.records if s else [], note=f"out of GPU memory: {_first_lines(e, 1)}")
        if s is not None:
            for rec in s.records:
                if not rec["verify"] and rec["compile_status"] in (None, "ok"):
                    rec["verify"] = "search stopped: out of GPU memory"
            s._done(res)
    if res.best_k is not None and not res.note:
        log.debug("kbench: region %d searched %d candidates in %.1f s: %s (%.4g ms; default %.4g ms)", r,
                  len(res.candidates), res.seconds, res.best_genome, res.best_ms or 0, res.default_ms or 0)
    return res


def _instances(bench, k, first=None) -> list:
    """LOADS loaded instances of kernel k (`first`, already loaded, among them); where a load fails
    short of a dead context, the rounds rotate through those made."""
    out = [first if first is not None else bench.load(k)]
    for _ in range(LOADS - 1):
        try:
            out.append(bench.load(k))
        except Exception as e:
            if is_fatal(e) or is_oom(e):
                raise
            log.debug("kbench: another load of %s failed: %s", getattr(k, "name", k), _first_lines(e, 1))
            break
    return out


def confirm(bench, default_k, winner_k, budget="default") -> tuple[bool, float, float, int]:
    """A winner a search found on another GPU (optimize(devices=)), re-timed here against the
    default genome before it is kept: does it beat the default by more than KEEP_DEFAULT on this
    GPU too? default_k, winner_k: their _C.KernelInfo, each loaded LOADS times (instances differ
    by a few percent) and timed in interleaved rounds, each round on its own layout, as the
    search's finalists are; the decision on the paired interval of default / winner, with more
    rounds while it is unclear (up to MAX_ROUNDS_FACTOR x the budget's rounds and RETIME_EXTRA_S),
    and the default kept where it stays unclear (the search's own rule). Returns (the winner
    kept, the default's median ms, the winner's, rounds)."""
    b = BUDGETS.get(budget) if isinstance(budget, str) else budget
    loads = [_instances(bench, k) for k in (default_k, winner_k)]
    for kernel in loads[0] + loads[1]:
        bench.time(kernel, 0)   # warm-up (a lazily loaded module loads at its first launch)
    samples: tuple[dict, dict] = ({}, {})
    limit, cap, n, deadline = 1 / (1 - KEEP_DEFAULT), MAX_ROUNDS_FACTOR * b.rounds, 0, None
    while True:
        for _ in range(min(b.rounds, cap - n)):
            got = bench.time_each([mine[n % len(mine)] for mine in loads], n)
            samples[0][n], samples[1][n] = got
            n += 1
        lo, hi = _ratio_interval(samples[0], samples[1])
        if lo > limit or hi <= limit or n >= cap:
            keep = lo > limit
            break
        deadline = deadline or time.perf_counter() + RETIME_EXTRA_S
        if time.perf_counter() >= deadline:
            keep = False
            break
    return keep, statistics.median(samples[0].values()), statistics.median(samples[1].values()), n
