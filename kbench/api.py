"""The public entry points: capture (model → IR), optimize (model → model on kbench's
regions), generate (model → every region's CUDA source, compiled by NVRTC, no GPU needed).
optimize() also keeps in torch, as their own ATen calls, the ops of every region whose kernel
did not beat eager's or did not work (the same export lowered again: _demote)."""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from . import _C
from . import distributed as kb_distributed
from .capture import cache as capture_cache
from .capture import guards as state_guards
from .capture import capture_exported, relower, repin, validate
from .capture import capture as capture_graph
from .capture.modes import autocast_mode
from .capture.signature import CallSpec, FlatCall
from .errors import CaptureError
from .report import Report
from .runtime import graphs, nvrtc
from .runtime.cuda import CudaExecutor
from .runtime.interp import InterpExecutor
from .runtime.module import OptimizedModule, SharesOriginal
from .runtime.plan import SAVE_STATS_MIN_ROW_BYTES, Status
from .tune import gate, spread
from .tune.tuner import BUDGET_NAMES, Tuner, time_eager_regions
from .tune.tuner import share as share_decisions

_log = logging.getLogger("kbench")


class Graph:
    """A captured model: `print(graph)` shows the IR, `print(graph.regions())` the kernels."""

    def __init__(self, captured):
        self.captured = captured
        self._graph = captured.graph

    def __str__(self) -> str:
        return str(self._graph)

    def __repr__(self) -> str:
        return (f"<kbench.Graph: {self._graph.num_nodes} nodes, {self._graph.num_inputs} inputs, "
                f"{self._graph.num_symbols} varying sizes>")

    def regions(self) -> "Regions":
        return Regions(self._graph.partition())

    @property
    def ir(self):
        """The underlying kbench._C.Graph."""
        return self._graph


class Regions:
    """The fused regions of a graph; `print()` gives one block per region."""

    def __init__(self, partition):
        self.partition = partition

    def __len__(self) -> int:
        return len(self.partition)

    def __getitem__(self, i: int) -> dict:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self.partition.region(i % len(self))

    def __str__(self) -> str:
        return str(self.partition)

    def __repr__(self) -> str:
        kinds = [self[i]["kind"] for i in range(len(self))]
        return f"<kbench.Regions: {len(self)} ({', '.join(kinds)})>"


def _as_tuple(example_inputs):
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise TypeError("example_inputs must be a tensor or a tuple/list of tensors, "
                    f"got {type(example_inputs).__name__}")


def capture(model: torch.nn.Module, example_inputs) -> Graph:
    """Capture model's operations on example_inputs into kbench's IR (torch.export, non-strict)."""
    return Graph(capture_graph(model, _as_tuple(example_inputs)))


BACKENDS = ("cuda", "interp")


class LazyOptimized(SharesOriginal, torch.nn.Module):
    """optimize(model) without example inputs: the first call's arguments are the example. Shares
    the model's parameters and buffers like the optimized module it becomes."""

    def __init__(self, model: torch.nn.Module, options: dict, group=None):
        super().__init__()
        self._parameters, self._buffers, self._modules = model._parameters, model._buffers, model._modules
        self.training = model.training
        self.__dict__.update(_kbench_orig=model, _kbench_options=options, _kbench_impl=None, _kbench_group=group)

    def forward(self, *args, **kwargs):
        if self._kbench_impl is None:
            def run():
                return optimize(self._kbench_orig, args, kwargs, **self._kbench_options)
            group = self._kbench_group   # the ranks' first calls share rank 0's tuning
            self.__dict__["_kbench_impl"] = run() if group is None else kb_distributed.optimize_once(
                run, self._kbench_orig, args, kwargs, self._kbench_options, group)
        return self._kbench_impl(*args, **kwargs)

    def train(self, mode: bool = True):
        self._kbench_orig.train(mode)
        if self._kbench_impl is not None:
            self._kbench_impl.train(mode)
        return super().train(mode)

    @property
    def kbench_report(self):
        if self._kbench_impl is None:
            raise RuntimeError("not captured yet: call the module once (its inputs are the example)")
        return self._kbench_impl.kbench_report


class EagerModule(SharesOriginal, torch.nn.Module):
    """What optimize() returns for a model it cannot capture (unless strict=True): the model
    itself, run by eager PyTorch, sharing its parameters, with a report that says why."""

    def __init__(self, model: torch.nn.Module, reason: str):
        super().__init__()
        self._parameters, self._buffers, self._modules = model._parameters, model._buffers, model._modules
        self.training = model.training
        self.__dict__.update(_kbench_orig=model, _kbench_reason=reason)

    def forward(self, *args, **kwargs):
        return self._kbench_orig(*args, **kwargs)

    def train(self, mode: bool = True):
        self._kbench_orig.train(mode)
        return super().train(mode)

    @property
    def kbench_report(self):
        return Report("eager", notes=[f"not captured, the model runs in eager PyTorch: {self._kbench_reason}"])


def optimize(model: torch.nn.Module, example_inputs=None, example_kwargs: dict | None = None, *,
             backend: str | None = None, budget: str = "default", seed: int = 0, verbose: bool = True,
             grad_in_forward: bool = True, strict: bool = False, gate=True,
             cuda_graphs="auto", distributed="auto", devices=None, gemm: bool = False) -> torch.nn.Module:
    """Return a module that computes what `model` computes, on kbench's regions.

    example_inputs, example_kwargs: a call's positional arguments (a tensor or a tuple) and
    keyword arguments, as torch.export takes them; None for both captures at the first call
    (`model = kbench.optimize(model)`). Tensors anywhere in them (nested tuples, lists, dicts
    included) are the captured graph's inputs; every other value (a Python number, a string,
    None) is specialized: a call that passes another value runs in eager, with a one-time reason.

    backend: "cuda" (generated kernels; the default for inputs on a GPU) or "interp" (the C
    interpreter on the CPU; the default for CPU inputs).
    budget: the schedule search per region — "fast", "default", "max" (bounded candidates and
    seconds; winners persist in the kernel cache, so a second optimize() searches nothing), or
    "none" (default schedules, no search, no cache). seed makes the search repeatable.
    grad_in_forward: for a module whose output is a scalar (a loss), a forward with gradients
    enabled computes the gradients too, in the same kernels as the loss (see
    kbench/runtime/joint.py), where that moves fewer bytes; the backward then only scales them by
    the upstream gradient.
    strict: a model torch.export cannot capture raises CaptureError; otherwise optimize() logs
    one line saying why and returns a module that runs the model in eager PyTorch.
    gate: on the GPU, time the optimized module against the model at the example call (forward,
    and forward + backward for a training model with trainable parameters) and run the model
    itself where kbench's is not faster (kbench/tune/gate.py; the report gives both times).
    True (the default) remembers the verdict in the kernel cache: a later optimize() of the same
    model code and state shapes, example call, train/eval and autocast state, cuda_graphs option
    and GPU model, on the same kernels, applies it without timing (the report says when it was
    measured); "measure" times it again (and remembers that); False: no gate. budget="none"
    remembers nothing.
    cuda_graphs: "auto" (the default) replays a call from a CUDA graph, captured at the third call
    of its input signature, where that is safe: the cuda backend, every region a generated kernel
    or a torch op that does not sync (kbench/runtime/graphs.py says what else is guarded); a
    training call (one that wants gradients) as a forward graph and a backward graph replayed
    through one autograd node (kbench/runtime/train_graphs.py: two forwards before a backward,
    retain_graph, create_graph, gradient accumulation and in-place changes are guarded); with the
    gate on, only where the graphed example call is faster than the un-graphed one. True graphs
    where safe, whatever the gate, and logs once why a call runs without; "inference" graphs
    calls without gradients only; False never. The report gives the graphed signatures and the
    memory they pin.
    distributed: with torch.distributed initialized, whether the ranks share one tuning (rank 0
    captures and tunes, the others receive its winners and the regions it left to torch, and load
    and gate those on their own GPU; kbench/distributed.py): "auto" (the default) for a
    DistributedDataParallel model, over its process group; True for any model, over the default
    group (every rank must call optimize() on the same model and example shapes: ranks that
    differ get an error naming the rank and the difference); False: each rank tunes on its own.
    devices: None (the default) searches on the GPU the model runs on; a list of GPU indices of
    this host ([0, 1], or "cuda:1"), or "all" (every visible GPU), spreads the regions' searches
    over them, a thread per GPU (kbench/tune/spread.py); each winner is then gated and re-timed
    against the default genome on the model's GPU before it is kept, and the report says where
    each region was searched. Every GPU named must be the model of the one the model runs on.
    gemm: lower matrix products (Linear, mm, bmm, addmm, matmul, baddbmm) into the IR as MATMUL
    nodes, so that fusion builds GEMM regions (a product and its pointwise epilogue) and autodiff
    differentiates them; False (the default for now) leaves every product a torch call. The
    interp backend runs GEMM regions in the C interpreter; the cuda backend runs each as kbench's
    generated tensor-core GEMM with the region's epilogue where it can (bf16/f16 operands read
    as stored), else in torch with the reason in the report.
    The returned module shares model's parameters and buffers; model itself is not modified,
    but for a DistributedDataParallel model: its `module` is replaced by the optimized one and the
    same DDP object returned (its gradient synchronization stays as it was built)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if budget not in BUDGET_NAMES:
        raise ValueError(f"budget must be 'none', 'fast', 'default' or 'max', got {budget!r}")
    if not (isinstance(gate, bool) or gate == "measure"):
        raise ValueError(f"gate must be True, False or 'measure', got {gate!r}")
    graphs.check_option(cuda_graphs)
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    group = kb_distributed.group_for(distributed, getattr(model, "process_group", None) if ddp else None)
    # below this call every rank is on its own: a later recapture (new shapes at some call) is local
    options = dict(backend=backend, budget=budget, seed=seed, verbose=verbose, grad_in_forward=grad_in_forward,
                   strict=strict, gate=gate, cuda_graphs=cuda_graphs, distributed=False, devices=devices)
    if gemm:   # only where asked: a module made without it pickles the options it had
        options["gemm"] = True
    if example_inputs is None and example_kwargs is None:   # capture on the first call
        if ddp:
            model.module = LazyOptimized(model.module, options, group)
            return model
        return LazyOptimized(model, options, group)
    args = () if example_inputs is None else _as_args(example_inputs)
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(f"example_kwargs must be a dict, got {type(example_kwargs).__name__}")
    kwargs = dict(example_kwargs or {})
    target = model.module if ddp else model

    def run():
        try:
            return _optimize(target, args, kwargs, options)
        except CaptureError as e:
            if strict:
                raise
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            _log.warning("kbench: %s runs in eager PyTorch: %s", type(target).__name__, reason)
            return EagerModule(target, reason)

    optimized = run() if group is None else kb_distributed.optimize_once(run, target, args, kwargs, options, group)
    if ddp:
        # torch.export cannot take DDP's forward; its reducer, hooks and buckets belong to the
        # parameters, which the optimized module shares: the wrapped module is optimized and the
        # same DDP object returned, synchronizing gradients as before
        model.module = optimized
        return model
    return optimized


def _as_args(example_inputs) -> tuple:
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def reoptimize(model, args, kwargs, wants_grad, options):
    """An optimized module made again from what it pickled (OptimizedModule.__reduce__): the original
    module (as loaded, or deep-copied: parameters of its own), the example call it was optimized at
    (tensors detached; wants_grad: which of them wanted gradients, the capture's key sees it) and
    its options. The capture cache spares the export where it holds the capture."""
    flags = iter(wants_grad)

    def leaf(x):
        return x.detach().requires_grad_(next(flags)) if isinstance(x, torch.Tensor) else x
    args, kwargs = pytree.tree_map(leaf, (tuple(args), dict(kwargs)))
    return optimize(model, args, kwargs, **options)


def _restore_args(args, kwargs, options) -> tuple:
    """reoptimize's arguments after the model, for an OptimizedModule made at this example call:
    the tensors detached (kept by reference, not copied: pickling copies them)."""
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
    wants_grad = tuple(x.requires_grad for x in leaves if isinstance(x, torch.Tensor))
    args, kwargs = pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x,
                                   (tuple(args), dict(kwargs)))
    return args, kwargs, wants_grad, dict(options)


def _optimize(model, args, kwargs, options):
    """optimize() for one example call: its call spec, the capture (from the cache where it
    holds), the executor, the optimized module."""
    spec = CallSpec(args, kwargs)
    target = model if spec.plain else FlatCall(model, spec)
    tensors = tuple(args) if spec.plain else tuple(spec.tensors(args, kwargs))
    if not spec.plain:
        try:
            inspect.signature(model.forward).bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"the example call does not fit {type(model).__name__}.forward: {e}") from None
    backend = options["backend"]
    if backend is None:
        backend = "cuda" if any(t.is_cuda for t in tensors) else "interp"
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"example_inputs are on several devices: {sorted(map(str, devices))}")
    device = next(iter(devices)) if devices else next((p.device for p in model.parameters()), torch.device("cpu"))
    if backend == "interp" and device.type != "cpu":
        raise ValueError(f"backend 'interp' runs on the CPU; example_inputs are on {device}")
    if backend == "cuda" and device.type != "cuda":
        raise ValueError(f"backend 'cuda' needs example_inputs on a CUDA device, got {device}")
    devices = spread.resolve(options.get("devices"), device)   # GPUs the searches spread over (None: device's)
    validate(target, tensors)   # the same errors whether or not the capture is cached
    budget = options["budget"]
    # one tuner for every round of _demote: a region tuned in one is not tuned again
    tuner = Tuner(budget=budget, seed=options["seed"], verbose=options["verbose"],
                  devices=devices) if backend == "cuda" else None

    def executor():
        if backend == "interp":
            return InterpExecutor()
        return CudaExecutor(tuner)

    restore = (reoptimize, _restore_args(args, kwargs, options))

    def build(captured):
        optimized = OptimizedModule(model, captured, executor(), device, options["grad_in_forward"],
                                    call_spec=None if spec.plain else spec,
                                    rebuild=lambda a, k: _optimize(model, a, k, options),
                                    cuda_graphs=options["cuda_graphs"], restore=restore)
        if backend == "interp":   # the report's eager column (the cuda tuner times its own)
            time_eager_regions(optimized._kbench_executor, seed=options["seed"])
        return optimized

    gemm = bool(options.get("gemm"))
    lowering = Lowering(target, tensors, backend, gemm)

    # budget "none" keeps nothing between processes: neither kernels nor the capture
    key, captured = (capture_cache.lookup(model, tensors, backend, call_key="" if spec.plain else spec.key(),
                                          gemm=gemm)
                     if budget != "none" else (None, None))
    if captured is not None:
        try:
            optimized = build(captured)
            stale = optimized._kbench_stale
            why = capture_cache.matches_eager(model, optimized, args, kwargs) if not stale else ""
        except Exception as e:  # noqa: BLE001 - a stored capture that does not fit is recaptured
            stale, why = "", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if not why and not stale:
            demoted = _demote(optimized, lowering, build, tuner)
            note = "from the cache (torch.export skipped; checked against eager on the example inputs)"
            if demoted is not optimized:   # kept so: the next optimize() starts from the ops kept in torch
                capture_cache.remember(key, demoted._kbench_captured)
                if lowering.exported is not None:
                    note = ("from the cache (checked against eager on the example inputs), then torch.export "
                            "to keep ops in torch, kept in the cache")
            demoted.__dict__["_kbench_capture_note"] = note
            del lowering   # torch's ExportedProgram, where one was made: not kept
            return _gated(model, demoted, args, kwargs, backend, device, options, key)
        if stale:
            _log.warning("kbench: the stored capture of %s read other Python state (%s); capturing it again",
                         type(model).__name__, stale)
        else:
            _log.warning("kbench: the stored capture of %s does not match eager on the example inputs (%s); "
                         "capturing it again", type(model).__name__, why)
        capture_cache.forget(key)
    captured = lowering.capture()
    if state_guards.stale(model, captured.python_state):
        # the forward set state as it ran (a default filled in at the first call, a config's
        # problem_type): captured once more, from the state it left; a forward that sets state at
        # every call stays stale, and its module runs the model (OptimizedModule says why)
        if key is not None:   # the key of the state as it is now
            try:
                key = capture_cache.fingerprint(model, tensors, backend, "" if spec.plain else spec.key(), gemm=gemm)
            except Exception:  # noqa: BLE001 - as lookup(): a key that cannot be made only costs the cache
                key = None
        lowering = Lowering(target, tensors, backend, gemm)
        captured = lowering.capture()
    optimized = _demote(build(captured), lowering, build, tuner)
    del lowering   # torch's ExportedProgram (fake tensors, shape environment): not kept
    if optimized._kbench_stale:   # the forward changes what it reads: a stored capture would never hold
        key = None
    if key is not None:
        capture_cache.remember(key, optimized._kbench_captured)
    optimized.__dict__["_kbench_capture_note"] = "torch.export" + (", kept in the cache" if key is not None else "")
    return _gated(model, optimized, args, kwargs, backend, device, options, key)


DEMOTE_ROUNDS = 2   # lowerings with more ops kept in torch, at most: each can change the regions around them


def lost_nodes(plan, kept) -> dict:
    """FX node name -> why, for the ops of every compute region that runs in torch (status eager:
    its kernel did not beat eager's, did not compile or did not verify) and are not kept yet. A
    GEMM region in torch is not demoted: torch runs its product and epilogue as the region's
    nodes, and its product stays a GEMM region."""
    lost = {}
    for info in plan.regions:
        if info.kind not in ("EXTERN", "GEMM") and info.status is Status.EAGER:
            for name in info.fx_nodes:
                if name not in kept:
                    lost.setdefault(name, info.reason)
    return lost


def _demote(optimized, lowering, build, tuner):
    """The optimized module with the ops of its regions that run in torch (lost_nodes) kept in
    torch as their own ATen calls: the same export lowered again with them kept (EXTERN calls,
    one each, as eager runs them, not their decomposition op by op), partitioned and tuned again
    (the tuner and the kernel cache make the regions tuned before free), at most DEMOTE_ROUNDS
    times. A region that loses after the last lowering keeps its kernel: nothing would lower
    its ops again."""
    for n in range(DEMOTE_ROUNDS):
        captured = optimized._kbench_captured
        lost = lost_nodes(optimized._kbench_plan, captured.kept)
        if not lost:
            break
        if tuner is not None and n == DEMOTE_ROUNDS - 1:
            tuner.demote = False
        try:
            again = build(lowering.capture({**captured.kept, **lost}))
        except Exception as e:  # noqa: BLE001 - the module as it is still computes the right thing
            _log.warning("kbench: could not keep %s in torch (%s: %s)", ", ".join(sorted(lost)), type(e).__name__,
                         str(e).splitlines()[0] if str(e) else "")
            break
        optimized = again
    return optimized


def _gated(model, optimized, args, kwargs, backend, device, options, capture_key=None):
    """The optimized module, set to run the original model where the gate finds it no faster: the
    verdict rank 0 sent (a shared tuning), else one remembered for this capture and these kernels
    (capture_key: the capture cache's key; None: nothing is remembered), else measured here
    (and remembered)."""
    if backend != "cuda" or not options["gate"]:
        return optimized
    # cuda_graphs="auto": the graphs must also beat the un-graphed call (True keeps them)
    runner = optimized.__dict__.get("_kbench_graphs")
    timed = options["cuda_graphs"] == "auto" and isinstance(runner, graphs.GraphRunner)
    given = gate.imposed()
    if given is not None:   # one verdict for every rank: rank 0's
        try:
            verdict = gate.Verdict.from_record(given["verdict"], "rank 0's verdict, applied on every rank") \
                if given.get("verdict") is not None else None
        except (ValueError, TypeError, KeyError) as e:
            verdict, given = None, {"line": f"its record is unreadable here ({e})"}
        if verdict is None:
            optimized.__dict__["_kbench_gate"] = (f"model gate: no verdict from rank 0 ({given.get('line') or 'none'}); "
                                                  f"kbench's module runs on every rank")
            return optimized
        return _apply_verdict(optimized, runner, verdict)
    memory = None
    if capture_key is not None and options["budget"] != "none":   # budget none keeps nothing
        try:
            memory = gate.Memory.of(capture_key, backward=gate.gates_backward(model), autocast=autocast_mode(),
                                    cuda_graphs=options["cuda_graphs"], graphs_timed=timed,
                                    grad_in_forward=options["grad_in_forward"], device=device,
                                    kernels=gate.forward_kernels(optimized._kbench_plan.regions))
        except Exception as e:  # noqa: BLE001 - a key that cannot be made only costs the memory
            _log.warning("kbench: the model gate's verdict is not remembered (%s: %s)", type(e).__name__, e)
    verdict = memory.recall() if memory is not None and options["gate"] != "measure" else None
    if verdict is not None:   # rank 0 of a shared tuning sends the backward winners its record names
        share_decisions(used=[k for k, digest, _ in memory.elsewhere if digest],
                        torch=[k for k, _, left in memory.elsewhere if left])
    else:
        try:
            verdict = gate.compare(model, optimized, args, kwargs, device,
                                   ungraphed=graphs.paused(optimized, runner) if timed else None)
        except Exception as e:  # noqa: BLE001 - an unmeasured gate keeps kbench's module, and says so
            optimized.__dict__["_kbench_gate"] = f"model gate not measured ({type(e).__name__}: {e})"
            return optimized
        verdict.graphs_served = timed and runner.replays > 0
        if memory is not None:
            tuner = getattr(optimized._kbench_executor, "tuner", None)
            memory.keep(verdict, _outside_forward(optimized), tuner.left if tuner is not None else ())
    return _apply_verdict(optimized, runner, verdict)


def _apply_verdict(optimized, runner, verdict):
    """The verdict as the module's: its graphs released where they served the timed calls and
    were not faster, the original run where kbench's is not faster; the report's line."""
    optimized.__dict__.update(_kbench_gate=verdict.describe(), _kbench_gate_verdict=verdict)
    if verdict.release_graphs and isinstance(runner, graphs.GraphRunner):
        runner.release(f"the model gate timed the call at {verdict.graphed_ms:.4g} ms with graphs, "
                       f"{verdict.ungraphed_ms:.4g} ms without" + (f" ({verdict.origin})" if verdict.origin else ""))
    if not verdict.keep:
        optimized.run_original(verdict.describe())
    return optimized


def _outside_forward(optimized) -> list:
    """The kernel-cache keys of the regions the module runs outside its forward plan: its regions'
    backward programs and a loss's joint programs (built by the calls the gate timed)."""
    d = optimized.__dict__
    programs = [p for p in d.get("_kbench_backward", {}).values() if p is not None]
    programs += [j.program for j in d.get("_kbench_joint", {}).values() if j]
    return [info.key for p in programs for info in p.plan.regions if info.key is not None]


def _fresh_capture(model, args, backend):
    return Lowering(model, args, backend).capture()


class Lowering:
    """A model's capture for a backend, and its export kept while optimize() may lower it again
    with ops kept in torch (_demote): torch.export runs once (the first capture() exports; the
    cuda backend's row-length pins are laid on that export, and on every lowering after)."""

    def __init__(self, model, args, backend, gemm=False):
        self.model, self.args, self.backend, self.gemm = model, args, backend, gemm
        self.exported, self.pin, self.reason = None, (), ""

    def capture(self, keep=None):
        """The capture; keep (FX node name -> why): those nodes as torch calls (lower's keep)."""
        if self.exported is None:
            captured, self.exported = capture_exported(self.model, self.args, gemm=self.gemm)
            if self.backend == "cuda":   # the row lengths pinned on the same export
                self.pin, self.reason = row_length_pins(captured, self.args)
                if self.pin:
                    captured = repin(self.exported, self.pin, self.reason)
            if not keep:
                return captured
        return relower(self.exported, keep, self.pin, self.reason)


def row_length_dims(captured) -> set:
    """(input, dim) of the user-input dims whose size is the length of a reduced row.

    A ROW kernel keeps its row on chip and reads it with 16-byte vectors only when the row
    length is known when it is generated; a row length that may vary means a kernel that
    re-reads the row element by element. Batch-like dims are unaffected."""
    g = captured.graph
    part = g.partition()
    syms = set()
    for r in range(len(part)):
        region = part.region(r)
        if region["kind"] != "ROW":
            continue
        dims = g.node(region["anchor"])["dims"]
        if all(region["reduce_axes"] >> d & 1 for d in range(len(dims))):
            continue  # one row: a total (a loss over the batch), not rows of features
        for d, dim in enumerate(dims):
            # a row that is one varying size (a feature dim), not a product of them (a loss
            # summed over the whole batch is a reduction of batch dims: those stay free)
            if region["reduce_axes"] >> d & 1 and not isinstance(dim, int) and dim[0] == 1 and len(dim[1]) == 1:
                syms.add(dim[1][0])
    # only where that size is an input's innermost dim: the dim a row of that input runs along
    return {(i, len(per_input) - 1) for i, per_input in enumerate(captured.input_syms)
            if per_input and per_input[-1] is not None and per_input[-1] in syms}


def row_length_pins(captured, args) -> tuple:
    """(the dims _pin_row_lengths pins, sorted; the reason the capture gives for them)."""
    pin = sorted(row_length_dims(captured))
    where = ", ".join(f"input {i} dim {d} = {args[i].shape[d]}" for i, d in pin)
    return pin, f"row lengths pinned for on-chip rows ({where})" if pin else ""


def _pin_row_lengths(model, args, captured, exported=None):
    """The cuda backend specializes row lengths, as torch.compile specializes shapes: the
    kernel is generated for the example's row length; batch sizes still vary, and a call with
    another row length runs in eager with a one-time reason. exported (from
    capture.capture_exported, the export behind `captured`) is lowered again with those dims
    pinned instead of exporting the model a second time."""
    pin, reason = row_length_pins(captured, args)
    if not pin:
        return captured
    if exported is not None:
        return repin(exported, sorted(pin), reason)
    return capture_graph(model, args, pin=sorted(pin), pin_reason=reason)


@dataclass
class GeneratedKernel:
    region: int
    kind: str
    name: str
    genome: _C.Genome       # str(genome) is its canonical text
    source: str
    ok: bool
    log: str
    cubin_bytes: int = 0

    def __repr__(self) -> str:
        status = "ok" if self.ok else "FAILED"
        return f"<kernel region {self.region} {self.kind} {self.name} [{self.genome}] {status}>"


def generate(model: torch.nn.Module, example_inputs, *, arch: str = "sm_90", compile: bool = True):
    """Every compute region's CUDA kernel for arch, compiled by NVRTC — no GPU needed.
    Returns a list of GeneratedKernel (.region, .source, .genome (a _C.Genome), .ok, .log)."""
    if not (isinstance(arch, str) and arch.startswith("sm_") and arch[3:].rstrip("a").isdigit()):
        raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
    sm = int(arch[3:].rstrip("a"))
    graph = capture(model, example_inputs)
    part = graph.ir.partition()
    part.save_stats(SAVE_STATS_MIN_ROW_BYTES)   # as optimize()'s forward kernels: long rows' statistics too
    kernels = []
    for r in range(len(part)):
        region = part.region(r)
        if region["kind"] == "EXTERN":
            continue
        k = _C.generate(part, r, sm, None)
        ok, log, size = True, "", 0
        if compile:
            try:
                size = len(nvrtc.compile(k.source, arch))
            except (_C.CompileError, FileNotFoundError) as e:
                ok, log = False, str(e)
        kernels.append(GeneratedKernel(r, region["kind"], k.name, k.genome, k.source, ok, log, size))
    return kernels
