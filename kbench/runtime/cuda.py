"""The cuda backend: each compute region's kernel (chosen and verified by a tuner, kbench/tune/)
loaded through the driver and launched on the caller's stream with no host sync. This file is
the loading and the launching; which kernel a region gets, and why, is the tuner's business (it
is handed in, so the runtime never imports the search)."""
from __future__ import annotations

import logging
import math

import torch

from .. import _C, kernels, verify
from ..dtypes import torch_dtype
from . import fast, nvrtc, torch_eval
from .plan import Executor, Fallback, RegionFallback

log = logging.getLogger("kbench")

INT32_LIMIT = (1 << 31) - 1


class Kernel:
    """A loaded, verified kernel and what a launch needs, precomputed."""

    __slots__ = ("fn", "fn_nostats", "finish_fn", "block", "smem", "grid_units", "units_per_block", "max_blocks",
                 "genome", "name", "vec", "workspace_per_unit", "workspace_per_block", "source", "module", "regs",
                 "spills", "launches", "workspaces", "last_multiple", "last_dim")

    def __init__(self):
        self.launches = {}   # sizes -> precomputed launch parameters (see CudaExecutor.launch_params)
        self.workspaces = {}  # stream -> workspace reused by every launch on that stream (launcher)

    @classmethod
    def of(cls, info) -> "Kernel":
        """What a launch needs of a _C.KernelInfo, before anything is loaded (its functions are
        None until CudaExecutor.load sets them)."""
        kernel = cls()
        kernel.source, kernel.module, kernel.regs, kernel.spills = info.source, None, 0, 0
        kernel.fn = kernel.finish_fn = kernel.fn_nostats = None
        kernel.name, kernel.block, kernel.smem = info.name, info.block, info.smem
        kernel.grid_units, kernel.units_per_block = info.grid_units, info.units_per_block
        kernel.max_blocks, kernel.genome = info.max_blocks, info.genome
        kernel.vec = info.genome.vec
        # vectors along a varying last dim: launched only where it is a multiple of them (verify.refused)
        kernel.last_multiple, kernel.last_dim = info.last_multiple, info.last_dim
        kernel.workspace_per_unit = info.workspace_bytes_per_unit
        kernel.workspace_per_block = info.workspace_bytes_per_block
        return kernel

    def grid(self, symvals) -> int:
        units = verify.dim_value(self.grid_units, symvals)
        g = min(max(1, -(-units // self.units_per_block)), 0x7FFFFFFF)   # every kernel loops over its work
        return min(g, self.max_blocks) if self.max_blocks else g


def resident_blocks(regs: int, threads: int, regs_per_sm: int) -> int:
    """Blocks of `threads` threads at `regs` registers each that one SM holds by registers (they
    are allocated per warp in units of 256); 0 when unknown. The generator caps a persistent or
    column-sum grid by threads and shared memory alone: a grid of more blocks than fit runs a
    second, mostly idle wave."""
    if regs <= 0 or threads <= 0 or regs_per_sm <= 0:
        return 0
    per_warp = -(-regs * 32 // 256) * 256
    return max(1, regs_per_sm // (per_warp * -(-threads // 32)))


class CudaExecutor(Executor):
    """Generated kernels on one CUDA device. `tuner` (kbench.tune.Tuner) prepares each compute
    region: it sets self.kernels[r] for the regions a verified kernel runs, and their status."""

    name = "cuda"

    def __init__(self, tuner):
        self.tuner = tuner
        self.seed = tuner.seed
        self.kernels: dict[int, Kernel] = {}
        self._helpers: dict = {}     # (file, entry) -> function of a kbench/kernels helper

    def fresh(self):
        """An executor for another plan (a region's backward) with the same tuner: its memo of
        tuned kernels and timings is shared, so the same backward region of twelve blocks is
        found, searched, compiled and timed once."""
        return CudaExecutor(self.tuner)

    def prepare(self, plan, device):
        super().prepare(plan, device)
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'cuda' needs a CUDA GPU; torch.cuda.is_available() is False "
                               "(use backend='interp' on the CPU)")
        with torch.cuda.device(device):
            self._open(device)
            path, version = nvrtc.info()  # FileNotFoundError here names every place looked
            plan.nvrtc = f"{path} ({version // 1000}.{version % 1000 // 10})"
            self.tuner.prepare(self)

    def _open(self, device) -> None:
        """The driver handle and the facts of `device` (its context current on this thread)."""
        self.device = device
        torch.cuda.current_stream().synchronize()  # torch creates the primary context first
        self.cuda = _C.cuda_open()
        self.dev = _C.device_info(self.cuda, device.index or 0)
        self.sm = self.dev["sm"]
        self.arch = f"sm_{self.sm}"

    def sibling(self, device):
        """An executor of the same plan on another GPU of this host, for the tuner's searches there
        (optimize(devices=)): its own driver handle and loaded kernels, nothing tuned when made.
        Called with `device` current on the calling thread."""
        ex = CudaExecutor(self.tuner)
        ex.plan = self.plan   # not prepare(): the plan's device stays the one the model runs on
        ex._open(torch.device(device))
        return ex

    def helper(self, file: str, entry: str):
        """A function of a hand-written helper kernel (kbench/kernels/<file>), compiled and loaded
        once per executor."""
        fn = self._helpers.get((file, entry))
        if fn is None:
            module = self._helpers.get(file)
            if module is None:
                module = self._helpers[file] = _C.module_load(self.cuda, nvrtc.compile(kernels.source(file), self.arch))
            fn = self._helpers[(file, entry)] = _C.get_function(self.cuda, module, entry, 0)[0]
        return fn

    def load(self, info, cubin=None) -> Kernel:
        """Compile (NVRTC, disk-cached) and load one generated kernel (a _C.KernelInfo); a cached
        winner comes with its CUBIN. CompileError on failure."""
        if cubin is None:
            cubin = nvrtc.compile(info.source, self.arch)
        kernel = Kernel.of(info)
        kernel.module = _C.module_load(self.cuda, cubin)
        kernel.fn, kernel.regs, kernel.spills = _C.get_function(self.cuda, kernel.module, info.name, info.smem)
        if info.finish_name is not None:
            kernel.finish_fn, _, _ = _C.get_function(self.cuda, kernel.module, info.finish_name, 0)
        if info.nostats_name is not None:   # the same kernel without its saved statistics (no backward follows)
            kernel.fn_nostats, _, _ = _C.get_function(self.cuda, kernel.module, info.nostats_name, info.smem)
        if kernel.max_blocks >= 0x7FFFFFFF:   # an older cache entry's int32 grid clamp, once taken
            kernel.max_blocks = 0             # for a cap; a real cap is a few blocks per SM
        if kernel.max_blocks:   # a capped grid is one wave: no more blocks than fit at once
            fit = resident_blocks(kernel.regs, kernel.block, self.dev.get("regs_per_sm", 0))
            if fit:
                kernel.max_blocks = min(kernel.max_blocks, fit * self.dev["num_sms"])
        return kernel

    # ------------------------------------------------------------------ checks

    def reference(self, r, symvals, inputs):
        """The region in float64 through torch (integer inputs stay integers)."""
        plan = self.plan
        info = plan.regions[r]
        ins = {v: (x.double() if x.is_floating_point() else x) for v, x in zip(info.inputs, inputs)}
        out = torch_eval.evaluate(plan.graph, plan, ins, symvals, nodes=info.nodes, dtype=torch.float64,
                                  device=self.device)
        return [out[v] for v in info.outputs]

    # ------------------------------------------------------------------ launching

    def launch_params(self, kernel, r, symvals):
        """What launching kernel at these sizes takes beyond the pointers, computed once per size:
        (output shapes and dtypes, grid, int arguments, workspace bytes, largest element count)."""
        key = tuple(symvals)
        lp = kernel.launches.get(key)
        if lp is None:
            plan = self.plan
            shapes = [(torch.Size(plan.graph.sizes(v, key)), torch_dtype(plan.nodes[v]["dtype"]))
                      for v in plan.regions[r].outputs]
            units = verify.dim_value(kernel.grid_units, key)
            numel = max([math.prod(plan.graph.sizes(v, key)) for v in plan.regions[r].inputs + plan.regions[r].outputs]
                        or [0])
            grid = kernel.grid(key)
            workspace = kernel.workspace_per_unit * units + kernel.workspace_per_block * grid
            lp = (shapes, (grid, 1, 1), key, workspace, numel)
            if len(kernel.launches) > 256:
                kernel.launches.clear()
            kernel.launches[key] = lp
        return lp

    def launch(self, kernel, r, symvals, inputs, poison=False, lp=None, nostats=False, outs=None):
        """nostats: through the entry point without the saved statistics (their outputs left out).
        outs: tensors to write (the region's outputs, shaped as _launch_params says) instead of
        new ones (the search times candidates on buffer layouts of its own)."""
        why = verify.refused(kernel, r, symvals)
        if why:   # checks and searches never launch a kernel where it cannot run
            raise RegionFallback(why)
        shapes, grid, ints, workspace_bytes, _ = lp or self.launch_params(kernel, r, symvals)
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
        args = [*inputs, *outs, *[None] * skipped, *ints]
        if workspace_bytes:
            args.append(torch.empty(workspace_bytes, dtype=torch.uint8, device=device))
        _C.launch(self.cuda, kernel.fn_nostats if nostats else kernel.fn, grid, kernel.block, kernel.smem, None, args)
        if kernel.finish_fn is not None:
            _C.launch(self.cuda, kernel.finish_fn, grid, kernel.block, 0, None, args)
        return outs

    def can_run(self, r):
        return r in self.kernels

    def refuses(self, r, symvals) -> str:
        kernel = self.kernels.get(r)
        return verify.refused(kernel, r, symvals) if kernel is not None else ""

    def scale(self, grads, grad_out) -> None:
        """Executor.scale on the device, without a host sync (kbench/kernels/scale.cu)."""
        for t in grads:
            g = grad_out.to(device=t.device, dtype=t.dtype).contiguous()
            if not t.is_contiguous():
                raise RuntimeError("kbench: a gradient computed in the forward is not contiguous")
            n = t.numel()
            blocks = max(1, min((n + 255) // 256, 8 * self.dev["num_sms"]))
            _C.launch(self.cuda, self.helper("scale.cu", _SCALE_NAMES[t.dtype]), blocks, 256, 0, None, (t, g, n))

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
        inputs not known to be contiguous (trusted), the last dim a multiple of the kernel's vec
        where it requires that (the same at every call at these sizes, checked per call as on the
        C++ path: RegionFallback, the region in eager), the alignment of every input's pointer,
        one allocation per output, and the launch. stats=False: the kernel's `_nostats` entry
        point (its saved statistics' stores compiled out) runs, and they come back as None."""
        kernel = self.kernels.get(r)
        if kernel is None:
            return None
        shapes, grid, ints, workspace_bytes, numel = self.launch_params(kernel, r, symvals)
        if numel > INT32_LIMIT:
            return None   # run() refuses every call, with the reason
        # stats=False: the entry point that does not write the saved statistics (where the
        # kernel has none, the statistics are written to buffers of their own and dropped)
        skipped = self.plan.regions[r].saved if not stats else 0
        scratch = []
        if skipped and kernel.fn_nostats is None:
            # the entry point that writes them (the tuner found it faster) writes
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
        last_size = verify.dim_value(kernel.last_dim, symvals)
        refused = verify.refused(kernel, r, symvals)
        ext = fast.module()
        if ext is not None:   # the same steps in C++ (csrc/fast/launch.cpp)
            return ext.Launch(
                cuda=self.cuda, keep=(kernel, scratch), fn=fn, finish=kernel.finish_fn, grid=grid,
                block=kernel.block, smem=kernel.smem,
                device=device.index if device.index is not None else torch.cuda.current_device(),
                region=r, vec=kernel.vec, check=check, ints=ints, workspace_bytes=workspace_bytes,
                outs=[(j, s, d) for j, (s, d) in zip(like, shapes)], skipped=skipped,
                scratch=scratch, last_size=last_size, last_multiple=kernel.last_multiple).run
        launch, cuda, finish, block, smem = _C.launch, self.cuda, kernel.finish_fn, kernel.block, kernel.smem
        no_ptrs = list(scratch) if scratch else [None] * skipped
        no_outs = [None] * skipped
        empty, empty_like, u8 = torch.empty, torch.empty_like, torch.uint8
        stream_of = stream_getter(device)
        workspaces = kernel.workspaces
        capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing)

        def run(inputs):
            for j in check:
                if inputs[j].device != device:
                    raise Fallback(f"the model was optimized for {device}; got a tensor on {inputs[j].device} "
                                   f"(region {r}, input {j})")
                if not inputs[j].is_contiguous():
                    raise RegionFallback(f"region {r}: input {j} is not contiguous")
            if refused:
                raise RegionFallback(refused)
            if align:   # every input's pointer, in integer arithmetic
                for j, x in enumerate(inputs):
                    if x.data_ptr() & 15:
                        raise RegionFallback(f"region {r}: input {j} is not 16-byte aligned (kernel uses vec={kernel.vec})")
            outs = [empty_like(inputs[j]) if j >= 0 else empty(s, dtype=d, device=device)
                    for j, (s, d) in zip(like, shapes)]
            args = [*inputs, *outs, *no_ptrs, *ints] if skipped else [*inputs, *outs, *ints]
            if workspace_bytes:
                # One workspace per kernel and stream, kept: launches on one stream run in
                # order, so the next launch cannot overwrite partial sums the finishing kernel
                # has yet to read. Under CUDA-graph capture each launch gets its own (from the
                # graph's pool), as a replay may overlap work outside the graph.
                stream = stream_of()
                workspace = workspaces.get(stream)
                capture = capturing()
                if capture or workspace is None or workspace.numel() < workspace_bytes:
                    workspace = empty(workspace_bytes, dtype=u8, device=device)
                    if not capture:
                        workspaces[stream] = workspace
                args.append(workspace)
            # stream None: torch's current stream on the tensors' device
            launch(cuda, fn, grid, block, smem, None, args)
            if finish is not None:
                launch(cuda, finish, grid, block, 0, None, args)
            return outs + no_outs if skipped else outs
        return run

    # ------------------------------------------------------------------ timing

    def scale_ms(self, metas) -> float:
        bufs = [torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in metas]
        g = torch.tensor(0.5, device=self.device)
        return event_ms(lambda: self.scale(bufs, g), 10)


_SCALE_NAMES = {torch.float32: "kb_scale_f32", torch.float64: "kb_scale_f64", torch.float16: "kb_scale_f16",
                torch.bfloat16: "kb_scale_bf16"}


def stream_getter(device):
    """A callable returning the raw handle of torch's current stream on device, bound once."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if get is not None:
        return lambda: get(index)
    dev = torch.device("cuda", index)
    return lambda: torch.cuda.current_stream(dev).cuda_stream


def event_ms(fn, reps: int) -> float:
    """The median of reps CUDA-event timings of fn() on the current stream, after one warm-up."""
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
