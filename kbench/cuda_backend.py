"""The cuda backend: each compute region's kernel generated (csrc/codegen.c), compiled by
NVRTC (cached on disk), loaded through the driver, verified against eager PyTorch before it is
trusted, timed against eager, then launched on the caller's stream with no host sync.

A region whose kernel fails to compile or to verify stays eager; the report says why."""
from __future__ import annotations

import hashlib
import logging
import math
import statistics

import torch

from . import _C, nvrtc, torch_eval, verify
from ._dtypes import torch_dtype
from .runtime import Executor, Fallback, RegionFallback, use_fast_call

log = logging.getLogger("kbench")

INT32_LIMIT = (1 << 31) - 1
NOSTATS_TIMED_MIN = 1 << 20   # input elements: below, launches cost more than either entry's difference
NOSTATS_REPS = 15             # interleaved pairs timed per kernel
NOSTATS_SLOWER = 0.03         # the statistics-writing entry runs inference where _nostats is slower by more


def _load_fast():
    """kbench._fast (csrc/fast/, C++): launches and autograd nodes without Python, or None where
    it was not built (no torch at build time) or KBENCH_FAST=0 asks for the Python path."""
    import os
    if os.environ.get("KBENCH_FAST", "1") == "0":
        return None
    try:
        from . import _fast
    except ImportError as e:
        log.warning("kbench: kbench._fast is not available (%s); launches run in Python "
                    "(rebuild with pip install --no-build-isolation -e .)", e)
        return None
    _fast.init(_C.launch_api(), Fallback, RegionFallback, _C.CudaError)
    return _fast


_fast = _load_fast()
use_fast_call(_fast)


class Kernel:
    """A loaded, verified kernel and what a launch needs, precomputed."""

    __slots__ = ("fn", "fn_nostats", "finish_fn", "block", "smem", "grid_units", "units_per_block", "max_blocks",
                 "genome", "name", "vec", "workspace_per_unit", "workspace_per_block", "source", "module", "regs",
                 "spills", "launches", "workspaces")

    def __init__(self):
        self.launches = {}   # sizes -> precomputed launch parameters (see CudaExecutor._launch_params)
        self.workspaces = {}  # stream -> workspace reused by every launch on that stream (launcher)

    def grid(self, symvals) -> int:
        units = self.grid_units if isinstance(self.grid_units, int) else \
            self.grid_units[0] * math.prod(symvals[s] for s in self.grid_units[1])
        g = min(max(1, -(-units // self.units_per_block)), 0x7FFFFFFF)   # every kernel loops over its work
        return min(g, self.max_blocks) if self.max_blocks else g


def _resident_blocks(regs: int, threads: int, regs_per_sm: int) -> int:
    """Blocks of `threads` threads at `regs` registers each that one SM holds by registers (they
    are allocated per warp in units of 256); 0 when unknown. The generator caps a persistent or
    column-sum grid by threads and shared memory alone: a grid of more blocks than fit runs a
    second, mostly idle wave."""
    if regs <= 0 or threads <= 0 or regs_per_sm <= 0:
        return 0
    per_warp = -(-regs * 32 // 256) * 256
    return max(1, regs_per_sm // (per_warp * -(-threads // 32)))


def _genome_field(genome: str, key: str, default: int) -> int:
    for part in genome.split():
        k, _, v = part.partition("=")
        if k == key:
            try:
                return int(v)
            except ValueError:
                return default
    return default


class CudaExecutor(Executor):
    name = "cuda"

    def __init__(self, *, budget: str = "default", seed: int = 0, verbose: bool = True, verify_kernels: bool = True):
        self.budget, self.seed, self.verbose, self.verify_kernels = budget, seed, verbose, verify_kernels
        if budget not in ("none", "fast", "default", "max"):
            raise ValueError(f"budget must be 'none', 'fast', 'default' or 'max', got {budget!r}")
        self.kernels: dict[int, Kernel] = {}
        self._by_source: dict = {}   # cache key -> prepared kernel: identical regions tuned once
        self._times: dict = {}       # cache key -> (eager ms, kernel ms) for the report
        self._cache_db = None

    # ------------------------------------------------------------------ preparation

    def fresh(self):
        """An executor for another plan (a region's backward) that shares this one's tuned
        kernels, timings and cache connection: the same backward region of twelve blocks is
        found, searched, compiled and timed once."""
        other = CudaExecutor(budget=self.budget, seed=self.seed, verbose=self.verbose,
                             verify_kernels=self.verify_kernels)
        other._by_source, other._times, other._cache_db = self._by_source, self._times, self._cache_db
        return other

    def prepare(self, plan, device):
        self.plan = plan
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'cuda' needs a CUDA GPU; torch.cuda.is_available() is False "
                               "(use backend='interp' on the CPU)")
        self.device = device
        with torch.cuda.device(device):
            torch.cuda.current_stream().synchronize()  # torch creates the primary context first
            self.cuda = _C.cuda_open()
            self.dev = _C.device_info(self.cuda, device.index or 0)
            self.sm = self.dev["sm"]
            self.arch = f"sm_{self.sm}"
            path, version = nvrtc.info()  # FileNotFoundError here names every place looked
            plan.nvrtc = f"{path} ({version // 1000}.{version % 1000 // 10})"
            compute = [info for info in plan.regions if info.kind != "EXTERN"]
            for n, info in enumerate(compute):
                if self.verbose:
                    log.info("kbench: region %d/%d %s: %s", n + 1, len(compute), info.kind, info.ops)
                self._prepare_region(info, plan.example_symvals)

    def _prepare_region(self, info, example_symvals):
        """Pick region r's kernel: the cache's winner, else the search's (budget fast/default/max),
        else the default genome — each verified before the runtime trusts it."""
        r = info.index
        key = self._cache_key(r)
        memo = self._by_source.get(key)
        tuned_here = memo is None
        if tuned_here:                         # identical regions (a repeated block) are tuned once
            memo = self._cached(r, key, example_symvals) or self._tune(r, key, example_symvals, info)
            self._by_source[key] = memo + (r,)
            kernel, status, envelope, extra = memo
            info.extra.update(extra)
        else:
            kernel, status, envelope, extra, first = memo
            info.extra.update(cache=f"same as region {first}")
        info.status, info.envelope = status, envelope
        if kernel is None:
            return
        info.genome = kernel.genome
        info.extra.update(regs=kernel.regs, spills=kernel.spills)
        self.kernels[r] = kernel
        if tuned_here and kernel.fn_nostats is not None:   # once per kernel: identical regions share it
            self._choose_inference_entry(r, kernel, example_symvals, info)
        # identical regions (same key: same ops, dtypes and sizes) time the same: measure once; a
        # cache hit brings the times measured when the kernel was tuned (_cached fills them in)
        if key not in self._times:
            self._times[key] = self._time_region(r, example_symvals)
            if self.budget != "none":   # with the stored winner, so that a later hit need not time
                try:
                    self._store().set_times(key, *self._times[key])
                except Exception as e:  # noqa: BLE001 - only the report's numbers are not persisted
                    log.warning("kbench: could not store region %d's timings in the cache: %s", r, e)
        info.eager_ms, info.kernel_ms = self._times[key]

    def _cache_key(self, r):
        """The region's identity: its IR with value names stripped, dtypes inside; sizes that vary
        bucketed; the GPU, driver, NVRTC, torch and kbench versions."""
        from . import cache
        text = self.plan.region_text(r)
        varying = {name: v for (name, _), v in zip(self.plan.graph.symbols, self.plan.example_symvals)}
        _, nvrtc_version = nvrtc.info()
        return cache.make_key(text, "-", cache.shape_class({}, varying), driver=self.dev.get("driver_version", 0),
                              nvrtc=nvrtc_version, device=self.device)

    def _store(self):
        if self._cache_db is None:
            from . import cache
            self._cache_db = cache.open_cache()
        return self._cache_db

    def _cached(self, r, key, example_symvals):
        """A stored winner: loaded from its CUBIN (nothing compiled, nothing searched), then gated
        once against the reference on the example sizes."""
        if self.budget == "none":
            return None
        try:
            w = self._store().lookup(key)
        except Exception as e:  # noqa: BLE001 - a cache problem never stops optimize
            log.warning("kbench: cache lookup failed: %s", e)
            return None
        if w is None or not w.cubin:
            return None
        try:
            k = dict(w.launch, name=w.entries[0], genome=w.genome, source="",
                     nostats=int(w.entries[0] + "_nostats" in w.entries))
            k["workspace_bytes_per_unit"] = k.pop("workspace", 0)
            k["workspace_bytes_per_block"] = k.pop("workspace_per_block", 0)
            kernel = self._load(k, cubin=w.cubin)
        except Exception as e:  # noqa: BLE001 - a stale entry is recompiled, not trusted
            log.warning("kbench: cached kernel for region %d unusable (%s); tuning again", r, e)
            return None
        why = self._gate(r, kernel, example_symvals) or self._gate_nostats(r, kernel, example_symvals)
        if why:
            log.warning("kbench: cached kernel for region %d fails its check (%s); tuning again", r, why)
            return None
        extra = {"search_s": 0.0, "candidates": 0, "cache": "hit"}
        if w.eager_ms is not None and w.kernel_ms is not None:
            # the report's eager and kernel times as measured when the kernel was tuned: a hit
            # times nothing for the report (an entry from before they were stored is timed once
            # here and the times added to it); only a large region's two entry points are timed
            self._times[key] = (w.eager_ms, w.kernel_ms)
            extra["times"] = "from cache"
        return kernel, "kernel (cached)", w.envelope, extra

    def _tune(self, r, key, example_symvals, info):
        k = None
        extra = {"cache": "miss" if self.budget != "none" else "off"}
        if self.budget != "none":
            from . import search
            progress = self._progress(info)
            try:
                res = search.search_region(self, r, example_symvals, budget=self.budget, seed=self.seed,
                                           progress=progress)
            finally:
                if progress is not None:
                    progress.close()
            extra.update(search_s=round(res.seconds, 2), candidates=len(res.candidates),
                         default_ms=res.default_ms, best_ms=res.best_ms, search_note=res.note)
            if res.kernel is not None and res.verdict and not self._gate_nostats(r, res.kernel, example_symvals):
                kernel = res.kernel
                envelope = self._envelope(res.verdict)
                self._remember(key, res.best_k, kernel, envelope, res)
                return kernel, "kernel", envelope, extra
            k = res.best_k  # the default genome's dict, when the search could not do better
        if k is None:
            try:
                k = _C.generate(self.plan.partition, r, self.sm, None, self.dev)
            except (NotImplementedError, ValueError) as e:
                return None, f"eager (no kernel: {str(e).splitlines()[0]})", "", extra
        kernel, status, envelope = self._build(k, r, example_symvals)
        if kernel is not None and self.budget != "none":
            self._remember(key, k, kernel, envelope, None)
        return kernel, status, envelope, extra

    def _remember(self, key, k, kernel, envelope, res):
        from . import cache
        try:
            cubin = nvrtc.compile(k["source"], self.arch)  # the CUBIN cache makes this a file read
            launch = {f: k[f] for f in ("block", "smem", "grid_units", "units_per_block", "max_blocks", "nkernels")}
            launch["workspace"] = k["workspace_bytes_per_unit"]
            launch["workspace_per_block"] = k["workspace_bytes_per_block"]
            entries = ([k["name"]] + ([k["name"] + "_finish"] if k["nkernels"] > 1 else [])
                       + ([k["name"] + "_nostats"] if k.get("nostats") else []))
            db = self._store()
            db.store(key, cache.Winner(genome=k["genome"], source_hash=hashlib.sha256(k["source"].encode()).hexdigest(),
                                       cubin=cubin, entries=entries, launch=launch, envelope=envelope,
                                       best_ms=res.best_ms if res else None, search_s=res.seconds if res else None,
                                       ncandidates=len(res.candidates) if res else 0))
            if res is not None and res.candidates:
                db.record(key, res.candidates)
        except Exception as e:  # noqa: BLE001 - the kernel is fine; only persistence failed
            log.warning("kbench: could not store region's kernel in the cache: %s", e)

    def _progress(self, info):
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

    def _gate(self, r, kernel, symvals, nostats=False) -> str:
        """One quick check against the float64 reference (NaN-poisoned outputs); '' when it passes.
        nostats: of the entry point without the saved statistics (the outputs it writes)."""
        gen = torch.Generator(device=self.device).manual_seed(self.seed + 17)
        inputs = self._region_inputs(r, symvals, "normal", gen)
        outs = self._launch(kernel, r, symvals, inputs, poison=True, nostats=nostats)
        for o, ref in zip(outs, self._reference(r, symvals, inputs)):
            ok, _, why = verify.compare(o, ref)
            if not ok:
                return why
        return ""

    def _gate_nostats(self, r, kernel, symvals) -> str:
        """The inference entry point (the same body, the statistics' stores compiled out) gets a
        gate of its own, so no entry point runs unchecked; '' where it passes or there is none."""
        return self._gate(r, kernel, symvals, nostats=True) if kernel.fn_nostats else ""

    def _choose_inference_entry(self, r, kernel, symvals, info):
        """A forward no backward follows runs the `_nostats` entry point: the same body with the
        statistics' stores compiled out, which ptxas may schedule differently, for better (bf16
        softmax 58 -> 52 us) or worse (residual LayerNorm f32 in shared memory: 0.26 ms against
        0.185 ms with the stores). Both are timed, interleaved, at the example sizes of large
        regions, and the one that writes the statistics (to buffers dropped at once) is kept
        where it is faster by more than NOSTATS_SLOWER. The choice is not stored with a cached
        winner: a cache hit times the two again (2 x NOSTATS_REPS launches)."""
        plan = self.plan
        if max(math.prod(plan.graph.sizes(v, symvals)) for v in plan.regions[r].inputs) < NOSTATS_TIMED_MIN:
            return
        gen = torch.Generator(device=self.device).manual_seed(self.seed)
        inputs = self._region_inputs(r, symvals, "normal", gen)
        lp = self._launch_params(kernel, r, symvals)
        times = {True: [], False: []}
        for nostats in (True, False) * 2:   # warm-up, both
            self._launch(kernel, r, symvals, inputs, lp=lp, nostats=nostats)
        for _ in range(NOSTATS_REPS):
            for nostats in (True, False):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                self._launch(kernel, r, symvals, inputs, lp=lp, nostats=nostats)
                b.record()
                times[nostats].append((a, b))
        torch.cuda.synchronize(self.device)
        ms = {k: statistics.median(a.elapsed_time(b) for a, b in v) for k, v in times.items()}
        info.extra["inference_entry"] = f"nostats {ms[True]:.4f} ms, with statistics {ms[False]:.4f} ms"
        if ms[True] > ms[False] * (1 + NOSTATS_SLOWER):
            kernel.fn_nostats = None   # the launcher then writes them into scratch buffers of its own
            info.extra["inference_entry"] += ": the one with statistics runs"

    def _envelope(self, verdict) -> str:
        sizes = sorted({tuple(s) for s in verdict.sizes})
        return f"{verdict.checked} checks, sizes {self._describe_sizes(sizes)}, max err {verdict.max_error:.2g}"

    def _load(self, k, cubin=None) -> "Kernel":
        """Compile (NVRTC, disk-cached) and load one generated kernel; CompileError on failure."""
        if cubin is None:
            cubin = nvrtc.compile(k["source"], self.arch)
        kernel = Kernel()
        kernel.source = k["source"]
        kernel.module = _C.module_load(self.cuda, cubin)
        kernel.fn, kernel.regs, kernel.spills = _C.get_function(self.cuda, kernel.module, k["name"], k["smem"])
        kernel.finish_fn = kernel.fn_nostats = None
        if k["nkernels"] > 1:
            kernel.finish_fn, _, _ = _C.get_function(self.cuda, kernel.module, k["name"] + "_finish", 0)
        if k.get("nostats"):   # the same kernel without its saved statistics (no backward follows)
            kernel.fn_nostats, _, _ = _C.get_function(self.cuda, kernel.module, k["name"] + "_nostats", k["smem"])
        kernel.name, kernel.block, kernel.smem = k["name"], k["block"], k["smem"]
        kernel.grid_units, kernel.units_per_block = k["grid_units"], k["units_per_block"]
        kernel.max_blocks, kernel.genome = k["max_blocks"], k["genome"]
        if kernel.max_blocks >= 0x7FFFFFFF:   # an older cache entry's int32 grid clamp, once taken
            kernel.max_blocks = 0             # for a cap; a real cap is a few blocks per SM
        if kernel.max_blocks:   # a capped grid is one wave: no more blocks than fit at once
            fit = _resident_blocks(kernel.regs, kernel.block, self.dev.get("regs_per_sm", 0))
            if fit:
                kernel.max_blocks = min(kernel.max_blocks, fit * self.dev["num_sms"])
        kernel.vec = _genome_field(k["genome"], "vec", 1)
        kernel.workspace_per_unit = k["workspace_bytes_per_unit"]
        kernel.workspace_per_block = k.get("workspace_bytes_per_block", 0)
        return kernel

    def _build(self, k, r, example_symvals):
        """(kernel or None, status, envelope): load, then verify before anything trusts it."""
        try:
            kernel = self._load(k)
        except _C.CompileError as e:
            return None, f"eager (compile failed: {str(e).splitlines()[0][:120]})", ""
        if not self.verify_kernels:
            return kernel, "kernel (unverified)", "unverified"
        try:
            verdict = self._verify(r, kernel, example_symvals)
            why = self._gate_nostats(r, kernel, example_symvals) if verdict else ""
        except _C.CudaError as e:  # a launch the driver refuses (resources): this region stays eager
            return None, f"eager (launch failed: {str(e).splitlines()[0][:120]})", ""
        if not verdict:
            return None, f"eager (verification failed: {verdict.reason})", ""
        if why:
            return None, f"eager (verification failed without saved statistics: {why})", ""
        return kernel, "kernel", self._envelope(verdict)

    def _describe_sizes(self, sizes):
        names = [s[0] for s in self.plan.graph.symbols]
        if not names:
            return "pinned"
        lo = [min(s[i] for s in sizes) for i in range(len(names))]
        hi = [max(s[i] for s in sizes) for i in range(len(names))]
        return ", ".join(f"{n}∈[{a},{b}]" for n, a, b in zip(names, lo, hi))

    # ------------------------------------------------------------------ verification

    def _reference(self, r, symvals, inputs):
        """The region in float64 through torch (integer inputs stay integers)."""
        plan = self.plan
        info = plan.regions[r]
        ins = {v: (x.double() if x.is_floating_point() else x) for v, x in zip(info.inputs, inputs)}
        out = torch_eval.evaluate(plan.graph, plan, ins, symvals, nodes=info.nodes, dtype=torch.float64,
                                  device=self.device)
        return [out[v] for v in info.outputs]

    def _verify(self, r, kernel, example_symvals) -> verify.Verdict:
        plan = self.plan
        info = plan.regions[r]
        gen = torch.Generator(device=self.device).manual_seed(self.seed + 1000 * r)
        verdict = verify.Verdict(ok=True)
        strong = False
        seen = [[] for _ in info.outputs]   # each output's reference at every point (its first values)
        for symvals in verify.sweep_symvals(example_symvals):
            if symvals != example_symvals and not plan.admits(symvals):
                continue  # sizes the captured graph does not hold for (the runtime guard refuses them too)
            if any(math.prod(plan.graph.sizes(v, symvals)) > (1 << 28) for v in info.inputs + info.outputs):
                continue  # keep verification memory bounded; the example point is never skipped this way
            for dist in verify.DISTRIBUTIONS if symvals == example_symvals else ("normal", "large"):
                inputs = self._region_inputs(r, symvals, dist, gen)
                clones = [x.clone() for x in inputs]
                out1 = self._launch(kernel, r, symvals, inputs, poison=True)
                ref = self._reference(r, symvals, clones)
                out2 = self._launch(kernel, r, symvals, inputs, poison=True)
                torch.cuda.synchronize(self.device)
                for x, c in zip(inputs, clones):
                    if not torch.equal(x, c):
                        return verify.Verdict(False, "the kernel modified its input")
                for j, (o1, o2, rf) in enumerate(zip(out1, out2, ref)):
                    ok, err, why = verify.compare(o1, rf)
                    verdict.checked += 1
                    if not ok:
                        return verify.Verdict(False, f"output {j} at sizes {symvals}, {dist} inputs: {why}")
                    if not torch.equal(o1.nan_to_num(0.0) if o1.is_floating_point() else o1,
                                       o2.nan_to_num(0.0) if o2.is_floating_point() else o2):
                        return verify.Verdict(False, "two runs on the same inputs differ (a race)")
                    verdict.max_error = max(verdict.max_error, err)
                    strong = strong or verify.discriminates(rf, clones)
                    if rf.numel() and rf.is_floating_point():
                        seen[j].append(float(rf.flatten()[0]))
                verdict.sizes.append(list(symvals))
            # input dependence: change each float input a little, the output must move where eager's does
            if symvals == example_symvals:
                why = self._check_dependence(kernel, r, symvals, gen)
                if why:
                    return verify.Verdict(False, why)
        # a small output (a loss) tells a constant apart across points: it matched a reference
        # that moved from one input draw to the next
        strong = strong or any(verify.varies(vals) for vals in seen)
        if not strong and any(plan.nodes[v]["dtype"] in ("f32", "f16", "bf16", "f64") for v in info.outputs):
            verdict = verify.Verdict(False, "no test point could tell this kernel from a constant output",
                                     verdict.checked, verdict.max_error, verdict.sizes)
        return verdict

    def _check_dependence(self, kernel, r, symvals, gen):
        inputs = self._region_inputs(r, symvals, "normal", gen)
        base = self._launch(kernel, r, symvals, inputs)
        ref_base = self._reference(r, symvals, inputs)
        for i, x in enumerate(inputs):
            if not x.is_floating_point():
                continue
            moved = list(inputs)
            moved[i] = x + torch.randn(x.shape, generator=gen, device=x.device).to(x.dtype) * 0.5
            out = self._launch(kernel, r, symvals, moved)
            ref = self._reference(r, symvals, moved)
            for o, b, rf, rb in zip(out, base, ref, ref_base):
                if not o.is_floating_point():
                    continue
                eager_moved = not torch.allclose(rf, rb, equal_nan=True)
                kernel_moved = not torch.equal(o.nan_to_num(0.0), b.nan_to_num(0.0))
                if eager_moved and not kernel_moved:
                    return f"output ignores input {i} (eager's output changes with it)"
        return ""

    # ------------------------------------------------------------------ launching

    def _launch_params(self, kernel, r, symvals):
        """What launching kernel at these sizes takes beyond the pointers, computed once per size:
        (output shapes and dtypes, grid, int arguments, workspace bytes, largest element count)."""
        key = tuple(symvals)
        lp = kernel.launches.get(key)
        if lp is None:
            plan = self.plan
            shapes = [(torch.Size(plan.graph.sizes(v, key)), torch_dtype(plan.nodes[v]["dtype"]))
                      for v in plan.regions[r].outputs]
            units = kernel.grid_units if isinstance(kernel.grid_units, int) else \
                kernel.grid_units[0] * math.prod(key[s] for s in kernel.grid_units[1])
            numel = max([math.prod(plan.graph.sizes(v, key)) for v in plan.regions[r].inputs + plan.regions[r].outputs]
                        or [0])
            grid = kernel.grid(key)
            workspace = kernel.workspace_per_unit * units + kernel.workspace_per_block * grid
            lp = (shapes, (grid, 1, 1), key, workspace, numel)
            if len(kernel.launches) > 256:
                kernel.launches.clear()
            kernel.launches[key] = lp
        return lp

    def _launch(self, kernel, r, symvals, inputs, poison=False, lp=None, nostats=False, outs=None):
        """nostats: through the entry point without the saved statistics (their outputs left out).
        outs: tensors to write (the region's outputs, shaped as _launch_params says) instead of
        new ones (the search times candidates on buffer layouts of its own)."""
        shapes, grid, ints, workspace_bytes, _ = lp or self._launch_params(kernel, r, symvals)
        device = inputs[0].device if inputs else self.device
        skipped = self.plan.regions[r].saved if nostats else 0
        shapes = shapes[:len(shapes) - skipped]
        if outs is not None:
            if [(o.shape, o.dtype) for o in outs] != list(shapes):
                raise ValueError("kbench: outs do not match the region's outputs")
        elif poison:
            outs = [verify.poison_like(s, d, device) for s, d in shapes]
        else:
            outs = [torch.empty(s, dtype=d, device=device) for s, d in shapes]
        if workspace_bytes:
            workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
            ints = ints + (workspace.data_ptr(),)  # a pointer argument is 8 bytes, like an int64
        ptrs = tuple([x.data_ptr() for x in inputs] + [o.data_ptr() for o in outs] + [0] * skipped)
        stream = _current_stream(device)
        _C.launch(self.cuda, kernel.fn_nostats if nostats else kernel.fn, grid, kernel.block, kernel.smem, stream,
                  ptrs, ints)
        if kernel.finish_fn is not None:
            _C.launch(self.cuda, kernel.finish_fn, grid, kernel.block, 0, stream, ptrs, ints)
        return outs

    def can_run(self, r):
        return r in self.kernels

    def scale(self, grads, grad_out) -> None:
        """Executor.scale on the device, without a host sync (see _SCALE_SOURCE)."""
        fns = getattr(self, "_scale_fns", None)
        if fns is None:
            module = _C.module_load(self.cuda, nvrtc.compile(_SCALE_SOURCE, self.arch))
            fns = self._scale_fns = {dt: _C.get_function(self.cuda, module, name, 0)[0]
                                     for dt, name in _SCALE_NAMES.items()}
            self._scale_module = module
        for t in grads:
            g = grad_out.to(device=t.device, dtype=t.dtype).contiguous()
            if not t.is_contiguous():
                raise RuntimeError("kbench: a gradient computed in the forward is not contiguous")
            n = t.numel()
            blocks = max(1, min((n + 255) // 256, 8 * self.dev["num_sms"]))
            _C.launch(self.cuda, fns[t.dtype], blocks, 256, 0, _current_stream(t.device),
                      (t.data_ptr(), g.data_ptr()), (n,))

    def run(self, r, symvals, inputs):
        """One call off the hot path (gradient checks, Program.run): through a launcher made
        for it, so both paths check and launch the same way."""
        launch = self.launcher(r, symvals)
        if launch is None:
            raise RegionFallback(f"region {r}: a tensor has more than 2^31 elements")
        return launch(inputs)

    def launcher(self, r, symvals, trusted=(), stats=True):
        """The hot path of region r at these sizes (see Executor.launcher): grid, arguments,
        output shapes and the stream lookup resolved once; per call only the contiguity checks on
        inputs not known to be contiguous (trusted), the alignment of every input's pointer,
        one allocation per output, and the launch. stats=False: the kernel's `_nostats` entry
        point (its saved statistics' stores compiled out) runs, and they come back as None."""
        kernel = self.kernels.get(r)
        if kernel is None:
            return None
        shapes, grid, ints, workspace_bytes, numel = self._launch_params(kernel, r, symvals)
        if numel > INT32_LIMIT:
            return None   # run() refuses every call, with the reason
        # stats=False: the entry point that does not write the saved statistics (where the
        # kernel has none, the statistics are written to buffers of their own and dropped)
        skipped = self.plan.regions[r].saved if not stats else 0
        scratch = []
        if skipped and kernel.fn_nostats is None:
            # the entry point that writes them (_choose_inference_entry found it faster) writes
            # into buffers of its own, allocated once here: nothing reads them, so launches on
            # several streams may write them at once
            scratch = [torch.empty(s, dtype=d, device=self.device) for s, d in shapes[len(shapes) - skipped:]]
        shapes = shapes[:len(shapes) - skipped]
        check = [j for j in range(len(self.plan.regions[r].inputs)) if not (j < len(trusted) and trusted[j])]
        # an output shaped like an input is allocated with empty_like(input): no size or dtype to
        # parse (a few us per output on a slow host); every input is contiguous by the checks
        in_meta = [(torch.Size(self.plan.graph.sizes(v, symvals)), torch_dtype(self.plan.nodes[v]["dtype"]))
                   for v in self.plan.regions[r].inputs]
        like = [in_meta.index(m) if m in in_meta else -1 for m in shapes]
        device, align = self.device, kernel.vec > 1
        fn = kernel.fn_nostats if skipped and not scratch else kernel.fn
        if _fast is not None:   # the same steps in C++ (csrc/fast/launch.cpp)
            return _fast.Launch(
                cuda=self.cuda, keep=(kernel, scratch), fn=fn, finish=kernel.finish_fn, grid=grid,
                block=kernel.block, smem=kernel.smem,
                device=device.index if device.index is not None else torch.cuda.current_device(),
                region=r, vec=kernel.vec, check=check, ints=ints, workspace_bytes=workspace_bytes,
                outs=[(j, s, d) for j, (s, d) in zip(like, shapes)], skipped=skipped,
                scratch=[t.data_ptr() for t in scratch]).run
        launch, cuda, finish, block, smem = _C.launch, self.cuda, kernel.finish_fn, kernel.block, kernel.smem
        no_ptrs = tuple(t.data_ptr() for t in scratch) if scratch else (0,) * skipped
        no_outs = [None] * skipped
        empty, empty_like, u8 = torch.empty, torch.empty_like, torch.uint8
        stream_of = _stream_getter(device)
        workspaces = kernel.workspaces
        capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)

        def run(inputs):
            if check and inputs[check[0]].device != device:
                raise Fallback(f"the model was optimized for {device}; got a tensor on {inputs[check[0]].device}")
            for j in check:
                if not inputs[j].is_contiguous():
                    raise RegionFallback(f"region {r}: input {j} is not contiguous")
            in_ptrs = [x.data_ptr() for x in inputs]
            if align:   # every input: the pointers are at hand, the test is integer arithmetic
                for j, p in enumerate(in_ptrs):
                    if p & 15:
                        raise RegionFallback(f"region {r}: input {j} is not 16-byte aligned (kernel uses vec={kernel.vec})")
            outs = [empty_like(inputs[j]) if j >= 0 else empty(s, dtype=d, device=device)
                    for j, (s, d) in zip(like, shapes)]
            args = ints
            stream = stream_of()
            if workspace_bytes:
                # One workspace per kernel and stream, kept: launches on one stream run in
                # order, so the next launch cannot overwrite partial sums the finishing kernel
                # has yet to read. Under CUDA-graph capture each launch gets its own (from the
                # graph's pool), as a replay may overlap work outside the graph.
                workspace = workspaces.get(stream)
                capture = capturing()
                if capture or workspace is None or workspace.numel() < workspace_bytes:
                    workspace = empty(workspace_bytes, dtype=u8, device=device)
                    if not capture:
                        workspaces[stream] = workspace
                args = ints + (workspace.data_ptr(),)
            ptrs = tuple(in_ptrs + [o.data_ptr() for o in outs])
            if skipped:
                ptrs += no_ptrs
            launch(cuda, fn, grid, block, smem, stream, ptrs, args)
            if finish is not None:
                launch(cuda, finish, grid, block, 0, stream, ptrs, args)
            return outs + no_outs if skipped else outs
        return run

    # ------------------------------------------------------------------ timing for the report

    def scale_ms(self, metas) -> float:
        bufs = [torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in metas]
        g = torch.tensor(0.5, device=self.device)
        return _event_ms(lambda: self.scale(bufs, g), 10)

    def _time_region(self, r, symvals, reps=20):
        plan = self.plan
        gen = torch.Generator(device=self.device).manual_seed(self.seed)
        inputs = self._region_inputs(r, symvals, "normal", gen)
        info = plan.regions[r]
        kernel = self.kernels[r]

        def eager():
            torch_eval.evaluate(plan.graph, plan, dict(zip(info.inputs, inputs)), symvals, nodes=info.nodes,
                                device=self.device)

        def ours():
            self._launch(kernel, r, symvals, inputs)

        return _event_ms(eager, reps), _event_ms(ours, reps)


# Scales gradients a forward computed with the upstream gradient taken as 1 (kbench/joint.py)
# by the real one, in place. loss.backward() passes exactly 1: every block reads it and returns,
# so that case moves no bytes and needs no host sync to find out. Otherwise one pass, in f32
# (f64 for f64 gradients); the upstream gradient comes in the gradient's dtype.
_SCALE_SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
template <typename T, typename C>
__device__ __forceinline__ void scale(T *__restrict__ p, const T *__restrict__ g, long long n)
{
    const C s = (C)g[0];
    if (s == (C)1) return;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        p[i] = (T)((C)p[i] * s);
}
extern "C" __global__ void kb_scale_f32(float *p, const float *g, long long n) { scale<float, float>(p, g, n); }
extern "C" __global__ void kb_scale_f64(double *p, const double *g, long long n) { scale<double, double>(p, g, n); }
extern "C" __global__ void kb_scale_f16(__half *p, const __half *g, long long n) { scale<__half, float>(p, g, n); }
extern "C" __global__ void kb_scale_bf16(__nv_bfloat16 *p, const __nv_bfloat16 *g, long long n)
{
    scale<__nv_bfloat16, float>(p, g, n);
}
"""
_SCALE_NAMES = {torch.float32: "kb_scale_f32", torch.float64: "kb_scale_f64", torch.float16: "kb_scale_f16",
                torch.bfloat16: "kb_scale_bf16"}


def _current_stream(device) -> int:
    """The raw handle of torch's current stream on device (the cheap way, where torch has it)."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is not None:
        return get(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


def _stream_getter(device):
    """A callable returning the raw handle of torch's current stream on device, bound once."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if get is not None:
        return lambda: get(index)
    dev = torch.device("cuda", index)
    return lambda: torch.cuda.current_stream(dev).cuda_stream


def _event_ms(fn, reps):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]
