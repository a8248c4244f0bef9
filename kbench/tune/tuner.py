"""The tuner: prepares each compute region of a CUDA executor — the kernel cache's winner (loaded
from its CUBIN, gated once), else the search's (budget fast/default/max), else (budget none) the
default genome — each run first in the sandbox (sandbox.py) and verified (kbench/verify.py) before
the runtime may launch it; a region left without one runs in torch with the reason; and times each
region against what eager runs for its ops (their ATen calls, runtime/eager.py), for the report
and for the verdict: a region whose kernel does not beat that goes back to torch (status eager),
and optimize() keeps its ops in torch as those calls. One tuner serves an optimized module's
forward executor and every backward or joint executor made from it (CudaExecutor.fresh), and
every round of optimize()'s demotion, so identical regions (a repeated block) are tuned,
compiled and timed once."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import statistics

import torch

from .. import _C, verify
from ..runtime import nvrtc, torch_eval
from ..runtime.cuda import event_ms
from ..runtime.plan import Status
from . import cache, sandbox, search, spread, timing

log = logging.getLogger("kbench")

NOSTATS_TIMED_MIN = 1 << 20   # input elements: below, launches cost more than either entry's difference
NOSTATS_REPS = 15             # interleaved pairs timed per kernel
NOSTATS_SLOWER = 0.03         # the statistics-writing entry runs inference where _nostats is slower by more
BUDGET_NAMES = ("none", "fast", "default", "max")
# A region goes back to torch where its kernel takes longer than this multiple of what eager runs
# for its ops (Tuner.verdict; with a search budget only). Not 1: two times a few percent apart swap
# places from run to run (docs/DESIGN.md, "Search"), and where the times cannot tell them apart
# the kernel keeps its region (its fusion, the C++ fast path) rather than flip between runs.
TORCH_ABOVE = 1.05
# The eager time of a region that holds part of an op: none (the report says why); stored so.
PARTIAL = "partial"


class Shared:
    """One optimize()'s decisions per region, shared with the other ranks of a process group
    (kbench/distributed.py): the keys of the winners it used (a cache hit, or a search's winner
    stored) and of the regions its search left to torch; on a receiving rank, `skip`, the keys
    rank 0's search left to torch, which this rank leaves to torch without a search of its own."""

    def __init__(self, skip=()):
        self.used: list = []
        self.torch: list = []
        self.skip = {_key_tuple(k) for k in skip}


def _key_tuple(key) -> tuple:
    return tuple(sorted((key.as_dict() if isinstance(key, cache.CacheKey) else key).items()))


_shared: Shared | None = None


@contextlib.contextmanager
def sharing(skip=()):
    """Within: every tuner notes its decisions in the Shared it yields."""
    global _shared
    prev, _shared = _shared, Shared(skip)
    try:
        yield _shared
    finally:
        _shared = prev


def share(used=(), torch=()) -> None:
    """Decisions taken without a tuner (a remembered model gate verdict's backward regions, which
    this optimize() did not build) noted in the current Shared, where one is sharing."""
    if _shared is not None:
        _shared.used.extend(used)
        _shared.torch.extend(torch)


def eager_signature(info) -> str:
    """Which eager time region `info` has: "" its IR run through torch op by op (a graph without
    provenance: a backward's), PARTIAL none (it holds part of an op), else the text of its
    eager program (the ATen calls eager runs for its ops). Stored with the cached times."""
    if info.eager is None:
        return ""
    return info.eager.program.signature if info.eager.program is not None else PARTIAL


def eager_call(plan, r, inputs, symvals, device, gen):
    """A callable that runs what eager runs for region r on its inputs (as region_inputs draws
    them): its ATen calls where the capture recorded them, else its IR through torch op by op;
    None where the region holds part of an op (there is no eager call of its own to time)."""
    info = plan.regions[r]
    if info.eager is None:
        given = dict(zip(info.inputs, inputs))
        return lambda: torch_eval.evaluate(plan.graph, plan, given, symvals, nodes=info.nodes, device=device)
    program = info.eager.program
    if program is None:
        return None
    args = program.draw(dict(zip(info.inputs, inputs)), symvals, device, gen)
    return lambda: program.run(args, symvals, device)


def time_eager_regions(ex, reps: int = 5, seed: int = 0) -> None:
    """The report's eager column where the backend times no kernels (interp, on the CPU): each
    compute region's eager program timed on the host (timing.time_fn), the per-call median
    only: the benchmark's wall-clock loop would cost three times the calls for a number the
    report does not show."""
    plan = ex.plan
    for info in plan.regions:
        if info.kind == "EXTERN" or info.eager is None:
            continue
        gen = torch.Generator().manual_seed(seed)
        inputs = ex.region_inputs(info.index, plan.example_symvals, "normal", gen)
        device = inputs[0].device if inputs else torch.device("cpu")
        call = eager_call(plan, info.index, inputs, plan.example_symvals, device, gen)
        if call is not None:
            with torch.no_grad():
                info.eager_ms = timing.time_fn(call, [()], device=device, reps=reps, warmup=1,
                                               wall_check=False).median_ms


def stored_launch(k) -> dict:
    """What a _C.KernelInfo's launch needs, as the cache stores it (cache.LAUNCH_FIELDS)."""
    launch = {f: getattr(k, f) for f in ("block", "smem", "grid_units", "units_per_block", "max_blocks", "nkernels")}
    launch["workspace"] = k.workspace_bytes_per_unit
    launch["workspace_per_block"] = k.workspace_bytes_per_block
    if k.last_multiple > 1:   # the sizes it runs at (absent: every size, as in entries stored before it)
        launch["last_multiple"], launch["last_dim"] = k.last_multiple, k.last_dim
    return launch


def stored_kernel(w) -> _C.KernelInfo:
    """A cached winner's kernel (launched from its CUBIN: no source); ValueError where its stored
    entry names are not the ones its launch fields give (a stale entry, tuned again)."""
    n = w.launch
    k = _C.KernelInfo(name=w.entries[0], genome=_C.Genome.parse(w.genome), source="", block=n["block"],
                      smem=n["smem"], grid_units=n["grid_units"], units_per_block=n["units_per_block"],
                      max_blocks=n["max_blocks"], nkernels=n["nkernels"],
                      workspace_bytes_per_unit=n.get("workspace", 0),
                      workspace_bytes_per_block=n.get("workspace_per_block", 0),
                      nostats=len(w.entries) > n["nkernels"],   # the entry without the statistics comes last
                      last_multiple=n.get("last_multiple", 1), last_dim=n.get("last_dim", 1))
    if list(k.entries) != list(w.entries):
        raise ValueError(f"stored entry points {w.entries} are not {list(k.entries)}")
    return k


class Tuner:
    """budget: "none" (default genomes, no search, no cache) or a search budget (search.BUDGETS);
    seed makes the search repeatable; verify_kernels=False trusts kernels unverified (tests);
    devices: GPU indices (spread.resolve) the searches are spread over, None: all on the
    executor's own GPU."""

    def __init__(self, *, budget: str = "default", seed: int = 0, verbose: bool = True, verify_kernels: bool = True,
                 devices=None):
        if budget not in BUDGET_NAMES:
            raise ValueError(f"budget must be 'none', 'fast', 'default' or 'max', got {budget!r}")
        self.budget, self.seed, self.verbose, self.verify_kernels = budget, seed, verbose, verify_kernels
        self.devices = tuple(devices) if devices is not None else None
        self.found: dict = {}       # cache key -> (GPU index, SearchResult): searched on another GPU, not adopted yet
        self.lost: set = set()      # GPUs whose search trapped or hung in this process: searched on no more
        self.by_source: dict = {}   # cache key -> prepared kernel: identical regions tuned once
        self.times: dict = {}       # (cache key, eager signature) -> (eager ms, kernel ms)
        self.demote = True          # verdicts may send a working kernel's region back to torch
        self.poisoned = ""          # why this process's CUDA context may be unusable (nothing more is tried)
        self.sizes: dict = {}       # cache key -> the sizes its checks and timings ran at (points())
        self.sources: dict = {}     # cache key -> sha256 of a stored winner's source, as stored (cached())
        self.left: set = set()      # cache keys whose search found no verified kernel (torch runs them)
        self._db = None

    def prepare(self, ex) -> None:
        """Every compute region of the executor's plan (the executor's device context is current)."""
        compute = [info for info in ex.plan.regions if info.kind != "EXTERN"]
        if self.devices is not None and self.budget != "none" and not self.poisoned:
            self.search_spread(ex, compute)
        for n, info in enumerate(compute):
            if self.verbose:
                log.info("kbench: region %d/%d %s: %s", n + 1, len(compute), info.kind, info.ops)
            self.prepare_region(ex, info, ex.plan.example_symvals)

    def gate(self, ex, r, kernel, symvals) -> str:
        """The quick check a cached winner passes on load (verify.gate)."""
        return verify.gate(ex, r, kernel, symvals)

    def envelope(self, ex, verdict) -> str:
        return verify.envelope(verdict, [s[0] for s in ex.plan.graph.symbols])

    def points(self, ex, r, example_symvals):
        """(points, note): the sizes region r is checked at, those that fit the free device memory
        (verify.plan_points); the first stands for the example (note: where it is smaller)."""
        return verify.plan_points(ex, r, example_symvals)

    def prepare_region(self, ex, info, example_symvals):
        """Pick region r's kernel: the cache's winner, else the search's (budget fast/default/max),
        else (budget none) the default genome — each verified before the runtime trusts it. A
        region without one runs in torch with the reason; the device running out of memory on the
        way is such a reason, never an error out of optimize(), and so is a trap or hang here
        (after which nothing more is launched: self.poisoned)."""
        r = info.index
        if self.poisoned:   # a trap or hang earlier: nothing is launched here any more
            ex.kernels.pop(r, None)
            info.set_status(Status.EAGER, f"not tried: {self.poisoned}")
            return
        key = self.cache_key(ex, r)
        try:
            self._prepare(ex, info, key, example_symvals)
        except RuntimeError as e:
            line = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            if search.is_oom(e):
                torch.cuda.empty_cache()
                why = f"out of GPU memory while it was searched, verified or timed ({line})"
            elif search.is_fatal(e):   # a kernel the sandbox passed trapped or hung here after all
                self.poisoned = f"region {r}: {line}"
                why = f"trap: {line}; the CUDA context may be unusable"
            else:
                raise
            ex.kernels.pop(r, None)
            info.set_status(Status.EAGER, why)
            info.envelope = ""
            self.by_source[key] = (None, (Status.EAGER, why), "", {}, r)

    def _prepare(self, ex, info, key, example_symvals):
        r = info.index
        info.key = key
        sig = eager_signature(info)
        memo = self.by_source.get(key)
        tuned_here = memo is None
        if tuned_here:                         # identical regions (a repeated block) are tuned once
            points, note = self.points(ex, r, example_symvals)
            self.sizes[key] = sizes = points[0] if points else list(example_symvals)
            if not points:
                memo = None, (Status.EAGER, f"not verified: {note}"), "", {}
            else:
                memo = self.cached(ex, r, key, sizes, sig) or self.tune(ex, r, key, example_symvals, info,
                                                                        points=(points, note))
            self.by_source[key] = memo + (r,)
            kernel, status, envelope, extra = memo
            info.extra.update(extra)
        else:
            kernel, status, envelope, extra, first = memo
            info.extra.update(cache=f"same as region {first}")
        info.set_status(*status)
        info.envelope = envelope
        if kernel is None:
            return
        sizes = self.sizes.get(key, list(example_symvals))
        info.genome = str(kernel.genome)   # the canonical text: the report's and the plan's name for it
        # which kernel runs it, for the model gate's remembered verdict (a stored winner has no source here)
        info.source_hash = self.sources.get(key) or hashlib.sha256(kernel.source.encode()).hexdigest()
        info.extra.update(regs=kernel.regs, spills=kernel.spills)
        ex.kernels[r] = kernel
        if tuned_here and kernel.fn_nostats is not None:   # once per kernel: identical regions share it
            self.choose_inference_entry(ex, r, kernel, sizes, info)
        # identical regions (same key: same ops, dtypes and sizes; the same ATen calls in eager)
        # time the same: measure once; a cache hit brings the times measured when the kernel was
        # tuned (cached() fills them in)
        if (key, sig) not in self.times:
            self.times[(key, sig)] = self.time_region(ex, r, sizes)
            if self.budget != "none":   # with the stored winner, so that a later hit need not time
                try:
                    self.store().set_times(key, *self.times[(key, sig)], eager_sig=sig or None)
                except Exception as e:  # noqa: BLE001 - only the report's numbers are not persisted
                    log.warning("kbench: could not store region %d's timings in the cache: %s", r, e)
        info.eager_ms, info.kernel_ms = self.times[(key, sig)]
        if self.demote and info.eager is not None:
            why = self.verdict(info)
            if why:   # the runtime runs it in torch; optimize() keeps its ops as their ATen calls
                ex.kernels.pop(r, None)
                info.set_status(Status.EAGER, why)

    def verdict(self, info) -> str:
        """Why region `info` goes back to torch although its kernel works ("": its kernel runs):
        the kernel does not beat what eager runs for its ops (their ATen calls, each whole): it
        is slower beyond the tie band (TORCH_ABOVE).
        Only with a search budget ("none" takes the default schedules as they come), and only
        where the region has an eager time (not where it holds part of an op)."""
        if self.budget == "none" or info.eager is None or info.eager.program is None:
            return ""
        if info.eager_ms is None or info.kernel_ms is None or info.kernel_ms <= TORCH_ABOVE * info.eager_ms:
            return ""
        return (f"its kernel did not beat eager's {info.eager.ops} ({info.kernel_ms:.4f} ms against "
                f"{info.eager_ms:.4f} ms)")

    def cache_key(self, ex, r):
        """The region's identity: its IR with value names stripped, dtypes inside; sizes that vary
        bucketed; the GPU, driver, NVRTC, torch and kbench versions."""
        text = ex.plan.region_text(r)
        varying = {name: v for (name, _), v in zip(ex.plan.graph.symbols, ex.plan.example_symvals)}
        _, nvrtc_version = nvrtc.info()
        return cache.make_key(text, "-", cache.shape_class({}, varying), driver=ex.dev.get("driver_version", 0),
                              nvrtc=nvrtc_version, device=ex.device)

    def store(self):
        """The kernel cache (opened at first use, shared by every executor of this tuner)."""
        if self._db is None:
            self._db = cache.open_cache()
        return self._db

    def cached(self, ex, r, key, example_symvals, sig=""):
        """A stored winner: loaded from its CUBIN (nothing compiled, nothing searched), then gated
        once against the reference on the example sizes. sig: the region's eager signature; the
        stored times are its where they were measured for the same one."""
        if self.budget == "none":
            return None
        try:
            w = self.store().lookup(key)
        except Exception as e:  # noqa: BLE001 - a cache problem never stops optimize
            log.warning("kbench: cache lookup failed: %s", e)
            return None
        if w is None or not w.cubin:
            return None
        try:
            kernel = ex.load(stored_kernel(w), cubin=w.cubin)
        except Exception as e:  # noqa: BLE001 - a stale entry is recompiled, not trusted
            log.warning("kbench: cached kernel for region %d unusable (%s); tuning again", r, e)
            return None
        why = self.gate(ex, r, kernel, example_symvals) or verify.gate_nostats(ex, r, kernel, example_symvals)
        if why:
            log.warning("kbench: cached kernel for region %d fails its check (%s); tuning again", r, why)
            return None
        if _shared is not None:
            _shared.used.append(key)
        self.sources[key] = w.source_hash
        extra = {"search_s": 0.0, "candidates": 0, "cache": "hit"}
        if w.kernel_ms is not None and (w.eager_sig or "") == sig and (w.eager_ms is not None or sig == PARTIAL):
            # the report's eager and kernel times as measured when the kernel was tuned: a hit
            # times nothing for the report (an entry from before they were stored, or from a
            # region of the same IR made of other ATen ops, is timed once here and the times
            # stored with it); only a large region's two entry points are timed
            self.times[(key, sig)] = (w.eager_ms, w.kernel_ms)
            extra["times"] = "from cache"
        return kernel, (Status.CACHED, ""), w.envelope, extra

    def tune(self, ex, r, key, example_symvals, info, points=None):
        """(kernel or None, (Status, reason), envelope, extra): the search's verified winner (budget
        fast/default/max), or the default genome built and verified (budget none). A search without
        a verified winner leaves the region to torch with its reason: nothing is built after it
        (after a trap or hang here, nothing is launched again: self.poisoned). points: the points()
        to check at."""
        extra = {"cache": "miss" if self.budget != "none" else "off"}
        if _shared is not None and self.budget != "none" and _key_tuple(key) in _shared.skip:
            return None, (Status.EAGER, "rank 0's search found no verified kernel for it: runs in torch"), "", extra
        points, note = points if points is not None else self.points(ex, r, example_symvals)
        if not points:
            return None, (Status.EAGER, f"not verified: {note}"), "", extra
        sizes = points[0]
        found = self.found.pop(key, None) if self.budget != "none" else None
        if found is not None:
            return self.adopt(ex, r, key, found, points, note, extra)
        if self.budget != "none" and info.kind != "GEMM":   # a GEMM region: its default genome alone
            progress = self.progress(info)
            try:
                res = search.search_region(ex, r, sizes, budget=self.budget, seed=self.seed, progress=progress,
                                           verifier=functools.partial(verify.verify_region, points=points, note=note),
                                           sizes=points)
            finally:
                if progress is not None:
                    progress.close()
            extra.update(search_s=round(res.seconds, 2), candidates=len(res.candidates),
                         default_ms=res.default_ms, best_ms=res.best_ms, search_note=res.note)
            if res.poisoned:
                self.poisoned = f"region {r}'s search: {res.note}"
            if res.kernel is not None and res.verdict:
                why = verify.gate_nostats(ex, r, res.kernel, sizes)
                if not why:
                    kernel = res.kernel
                    envelope = self.envelope(ex, res.verdict)
                    self.remember(ex, key, res.best_k, kernel, envelope, res)
                    return kernel, (Status.KERNEL, ""), envelope, extra
                reason = f"verification failed without saved statistics: {why}"
            else:
                reason = res.note or "no verified kernel"
            self.left.add(key)
            if _shared is not None:
                _shared.torch.append(key)
            self.record(key, res)
            return None, (Status.EAGER, reason.splitlines()[0][:240]), "", extra
        try:
            k = _C.generate(ex.plan.partition, r, ex.sm, None, ex.dev)
        except (NotImplementedError, ValueError) as e:
            return None, (Status.EAGER, f"no kernel: {str(e).splitlines()[0]}"), "", extra
        kernel, status, envelope = self.build(ex, k, r, points, note)
        return kernel, status, envelope, extra

    def search_spread(self, ex, compute) -> None:
        """The searches this executor's regions need (no winner in the cache, not tuned before, not
        left to torch by rank 0), spread over self.devices (spread.spread): each run on an executor
        of that GPU's own (CudaExecutor.sibling), its result kept in self.found for tune() to adopt
        on the executor's GPU (adopt), region by region in order. A GPU whose search trapped or hung
        takes no more; a region no GPU searched is searched on the executor's GPU, as without
        devices."""
        jobs, seen = [], set()
        for info in compute:
            if info.kind == "GEMM":   # its default genome alone: nothing to search (tune())
                continue
            r = info.index
            key = self.cache_key(ex, r)
            k = _key_tuple(key)
            if key in self.by_source or key in self.found or k in seen or (_shared is not None and k in _shared.skip):
                continue
            try:
                w = self.store().lookup(key)
            except Exception:  # noqa: BLE001 - cached() logs it when it looks again
                w = None
            if w is not None and w.cubin:
                continue   # a stored winner: loaded and gated on the executor's GPU, as ever
            points, note = self.points(ex, r, ex.plan.example_symvals)
            if points:
                seen.add(k)
                jobs.append((key, r, points, note))
        devices = [d for d in self.devices if d not in self.lost]
        if not jobs or not devices:
            return
        siblings = {}

        def work(d, job):
            key, r, points, note = job
            with torch.cuda.device(d):
                if d not in siblings:
                    siblings[d] = ex.sibling(torch.device("cuda", d))
                if self.verbose:
                    log.info("kbench: region %d searched on cuda:%d", r, d)
                return search.search_region(siblings[d], r, points[0], budget=self.budget, seed=self.seed,
                                            verifier=functools.partial(verify.verify_region, points=points, note=note),
                                            sizes=points)

        for (key, *_), got in zip(jobs, spread.spread(jobs, devices, work, stop=lambda res: res.poisoned)):
            if got is not None:
                self.found[key] = got
                if got[1].poisoned:
                    self.lost.add(got[0])

    def adopt(self, ex, r, key, found, points, note, extra):
        """tune()'s answer for a region searched on another GPU (search_spread): its winner loaded
        here from the same CUBIN and gated, as a cached winner is (it was verified in full there, on
        a GPU of this model: spread.resolve), then re-timed against the default genome here
        (search.confirm); where it does not beat the default here, the default is built, run in the
        sandbox and verified here instead."""
        d, res = found
        here = f"cuda:{ex.device.index if ex.device.index is not None else torch.cuda.current_device()}"
        extra.update(search_s=round(res.seconds, 2), candidates=len(res.candidates), default_ms=res.default_ms,
                     best_ms=res.best_ms, search_note=res.note, tuned_on=f"cuda:{d}")
        if res.poisoned and f"cuda:{d}" == here:
            self.poisoned = f"region {r}'s search: {res.note}"
        sizes = points[0]
        why = ""
        if res.best_k is not None and res.verdict:
            winner = ex.load(res.best_k)
            why = self.gate(ex, r, winner, sizes) or verify.gate_nostats(ex, r, winner, sizes)
            if why:
                why = f"the winner searched on cuda:{d} fails its check on {here}: {why}"
        else:
            why = res.note or "no verified kernel"
        if why:
            self.left.add(key)
            if _shared is not None:
                _shared.torch.append(key)
            self.record(key, res)
            return None, (Status.EAGER, why.splitlines()[0][:240]), "", extra
        chosen_k, kernel, envelope = res.best_k, winner, self.envelope(ex, res.verdict)
        default = next((c for c in res.candidates if c["genome"] == res.default_genome), {})
        default_k = _C.generate(ex.plan.partition, r, ex.sm, None, ex.dev) if default.get("time_ms") is not None \
            else None   # a default that did not pass the sandbox and the gate there: nothing to re-time against
        if default_k is not None and search.kernel_key(default_k) != search.kernel_key(res.best_k):
            bench = search.CudaRegionBench(ex, r, sizes, sizes=points)
            keep, d_ms, w_ms, rounds = search.confirm(bench, default_k, res.best_k, self.budget)
            extra["confirmed"] = (f"on {here}: default {d_ms:.4f} ms, winner {w_ms:.4f} ms over {rounds} rounds: "
                                  + ("the winner kept" if keep else "the default stays"))
            del bench
            if not keep:
                built, status, built_envelope = self.build(ex, default_k, r, points, note)
                if built is not None:
                    chosen_k, kernel, envelope = default_k, built, built_envelope
                    res = dataclasses.replace(res, best_ms=d_ms, best_genome=res.default_genome)
                    extra["best_ms"] = d_ms
                else:   # the default fails here where the winner passed: the winner stays
                    extra["confirmed"] += f", but the default was refused here ({status[1]}): the winner kept"
        self.remember(ex, key, chosen_k, kernel, envelope, res)
        return kernel, (Status.KERNEL, ""), envelope, extra

    def record(self, key, res) -> None:
        """The search's record of candidates (each one's fate), kept where no winner is stored."""
        if not res.candidates:
            return
        try:
            self.store().record(key, res.candidates)
        except Exception as e:  # noqa: BLE001 - only the record is not persisted
            log.warning("kbench: could not record the search's candidates in the cache: %s", e)

    def remember(self, ex, key, k, kernel, envelope, res):
        """Store k (a _C.KernelInfo), the region's verified kernel, as the key's winner, with the
        search's record of candidates."""
        try:
            cubin = nvrtc.compile(k.source, ex.arch)  # the CUBIN cache makes this a file read
            db = self.store()
            db.store(key, cache.Winner(genome=str(k.genome), source_hash=hashlib.sha256(k.source.encode()).hexdigest(),
                                       cubin=cubin, entries=list(k.entries), launch=stored_launch(k), envelope=envelope,
                                       best_ms=res.best_ms if res else None, search_s=res.seconds if res else None,
                                       ncandidates=len(res.candidates) if res else 0))
            if res is not None and res.candidates:
                db.record(key, res.candidates)
            if _shared is not None:
                _shared.used.append(key)
        except Exception as e:  # noqa: BLE001 - the kernel is fine; only persistence failed
            log.warning("kbench: could not store region's kernel in the cache: %s", e)

    def progress(self, info):
        """A progress bar (notebook-aware) for one region's search, or None when not verbose."""
        if not self.verbose:
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
        label = f"kbench region {info.index} {info.kind}"
        if tqdm is None:
            class Line:
                def __call__(self, region, generation, best_ms):
                    print(f"\r{label}: generation {generation}, best {best_ms:.4f} ms", end="", flush=True)

                def close(self):
                    print()
            return Line()
        bar = tqdm(desc=label, unit="gen", leave=False)

        class Bar:
            def __call__(self, region, generation, best_ms):
                bar.set_postfix_str(f"gen {generation} best {best_ms:.4f} ms" if best_ms else f"gen {generation}")
                bar.update(1)

            def close(self):
                bar.close()
        return Bar()

    def choose_inference_entry(self, ex, r, kernel, symvals, info):
        """A forward no backward follows runs the `_nostats` entry point: the same body with the
        statistics' stores compiled out, which ptxas may schedule differently, for better or
        worse by tens of percent (info.extra["inference_entry"] records both times). Both are timed, interleaved, at the example sizes of large
        regions, and the one that writes the statistics (to buffers dropped at once) is kept
        where it is faster by more than NOSTATS_SLOWER. The choice is not stored with a cached
        winner: a cache hit times the two again (2 x NOSTATS_REPS launches)."""
        plan = ex.plan
        if max(math.prod(plan.graph.sizes(v, symvals)) for v in plan.regions[r].inputs) < NOSTATS_TIMED_MIN:
            return
        gen = torch.Generator(device=ex.device).manual_seed(self.seed)
        inputs = ex.region_inputs(r, symvals, "normal", gen)
        lp = ex.launch_params(kernel, r, symvals)
        times = {True: [], False: []}
        for nostats in (True, False) * 2:   # warm-up, both
            ex.launch(kernel, r, symvals, inputs, lp=lp, nostats=nostats)
        for _ in range(NOSTATS_REPS):
            for nostats in (True, False):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                ex.launch(kernel, r, symvals, inputs, lp=lp, nostats=nostats)
                b.record()
                times[nostats].append((a, b))
        torch.cuda.synchronize(ex.device)
        ms = {k: statistics.median(a.elapsed_time(b) for a, b in v) for k, v in times.items()}
        info.extra["inference_entry"] = f"nostats {ms[True]:.4f} ms, with statistics {ms[False]:.4f} ms"
        if ms[True] > ms[False] * (1 + NOSTATS_SLOWER):
            kernel.fn_nostats = None   # the launcher then writes them into scratch buffers of its own
            info.extra["inference_entry"] += ": the one with statistics runs"

    def build(self, ex, k, r, points, note=""):
        """(kernel or None, (Status, reason), envelope): load, run in the sandbox at every point,
        then verify before anything trusts it."""
        try:
            kernel = ex.load(k)
        except _C.CompileError as e:
            return None, (Status.EAGER, f"compile failed: {str(e).splitlines()[0][:120]}"), ""
        if not self.verify_kernels:
            return kernel, (Status.UNVERIFIED, ""), "unverified"
        try:
            fate = sandbox.check(ex, r, k, kernel, nvrtc.compile(k.source, ex.arch), points)
        except sandbox.SandboxUnavailable as e:
            fate = str(e)
        if fate:   # never launched here
            return None, (Status.EAGER, f"refused by the sandbox: {fate.splitlines()[0][:200]}"), ""
        try:
            verdict = verify.verify_region(ex, r, kernel, points[0], points=points, note=note)
            why = verify.gate_nostats(ex, r, kernel, points[0]) if verdict else ""
        except Exception as e:
            if search.is_oom(e):
                raise
            if search.is_fatal(e):   # the sandbox passed it, yet it trapped here: nothing more is launched
                self.poisoned = f"region {r}'s kernel: {str(e).splitlines()[0][:160]}"
                return None, (Status.EAGER, f"trap: {str(e).splitlines()[0][:160]}"), ""
            if isinstance(e, _C.CudaError):   # a launch the driver refuses (resources): this region stays eager
                return None, (Status.EAGER, f"launch failed: {str(e).splitlines()[0][:120]}"), ""
            raise
        if not verdict:
            return None, (Status.EAGER, f"verification failed: {verdict.reason}"), ""
        if why:
            return None, (Status.EAGER, f"verification failed without saved statistics: {why}"), ""
        return kernel, (Status.KERNEL, ""), self.envelope(ex, verdict)

    def time_region(self, ex, r, symvals, reps=20):
        """(eager ms, kernel ms) of region r at these sizes: what eager runs for its ops (eager_call;
        None where the region holds part of an op) and its kernel, on the same inputs."""
        plan = ex.plan
        gen = torch.Generator(device=ex.device).manual_seed(self.seed)
        inputs = ex.region_inputs(r, symvals, "normal", gen)
        kernel = ex.kernels[r]
        eager = eager_call(plan, r, inputs, symvals, ex.device, gen)

        def ours():
            ex.launch(kernel, r, symvals, inputs)

        with torch.no_grad():
            return (event_ms(eager, reps) if eager is not None else None), event_ms(ours, reps)
