"""The swapped-in model: runs a captured graph region by region, each region through a backend
(the C interpreter, or generated CUDA kernels), EXTERN regions through torch, with guards that
fall back to eager — with a one-time reason — whenever a call leaves the verified envelope.

Autograd: every compute region is one torch.autograd.Function; until backward kernels exist its
backward recomputes the region with torch ops (kbench.torch_eval) and differentiates that.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from . import _C, torch_eval
from ._dtypes import torch_dtype

log = logging.getLogger("kbench")


class Fallback(Exception):
    """Raised inside a call to send the whole call to eager; the message is the one-line reason."""


class RegionFallback(Exception):
    """Raised by a backend to run one region in eager for this call (e.g. a misaligned input)."""


@dataclass
class RegionInfo:
    index: int
    kind: str               # POINTWISE | ROW | COL | EXTERN
    nodes: list
    inputs: list
    outputs: list
    ops: str                # "mean sub mul ..." for the report
    status: str = "interp"  # what runs it (or why it stays eager)
    genome: str = ""
    envelope: str = ""
    eager_ms: float | None = None
    kernel_ms: float | None = None
    extra: dict = field(default_factory=dict)


class Plan:
    """Everything about a captured graph that does not change between calls."""

    def __init__(self, captured, module: torch.nn.Module):
        self.captured = captured
        self.graph = captured.graph
        g = self.graph
        self.nodes = [g.node(i) for i in range(g.num_nodes)]
        self.partition = g.partition()
        self.region_of = [-1] * g.num_nodes
        self.regions: list[RegionInfo] = []
        for r in range(len(self.partition)):
            d = self.partition.region(r)
            ops = " ".join(self.nodes[n]["op"] for n in d["nodes"] if self.nodes[n]["op"] not in ("const",))
            self.regions.append(RegionInfo(r, d["kind"], d["nodes"], d["inputs"], d["outputs"], ops))
            for n in d["nodes"]:
                if self.region_of[n] < 0:
                    self.region_of[n] = r
        # graph inputs: user inputs in forward order, then where params/buffers come from
        self.user_inputs = [v for v in g.inputs if self.nodes[v]["input_kind"] == "user"]
        self.param_inputs = [v for v in g.inputs if self.nodes[v]["input_kind"] != "user"]
        self.input_syms = captured.input_syms
        self.nsyms = g.num_symbols
        self.user_dtypes = [torch_dtype(self.nodes[v]["dtype"]) for v in self.user_inputs]
        self.user_dims = [self.nodes[v]["dims"] for v in self.user_inputs]

    # ------------------------------------------------------------------ per call

    def bind(self, args) -> list:
        """Symbol values from the actual user inputs, or Fallback naming what is outside."""
        if len(args) != len(self.user_inputs):
            raise TypeError(f"expected {len(self.user_inputs)} input tensor(s), got {len(args)}")
        symvals = [None] * self.nsyms
        for i, (x, dims, syms) in enumerate(zip(args, self.user_dims, self.input_syms)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {i} must be a tensor, got {type(x).__name__}")
            if x.dtype != self.user_dtypes[i]:
                raise Fallback(f"input {i} has dtype {x.dtype}, captured with {self.user_dtypes[i]}")
            if x.dim() != len(dims):
                raise Fallback(f"input {i} has rank {x.dim()}, captured with rank {len(dims)}")
            for d, (size, dim) in enumerate(zip(x.shape, dims)):
                sym = syms[d] if syms is not None else None
                if sym is None:
                    if not isinstance(dim, int) or size != dim:
                        raise Fallback(f"input {i} dim {d} is {size}; it is pinned to {dim}")
                    continue
                if symvals[sym] is None:
                    symvals[sym] = size
                elif symvals[sym] != size:
                    raise Fallback(f"input {i} dim {d} is {size}, but the same size elsewhere is {symvals[sym]}")
        for s, v in enumerate(symvals):
            if v is None:  # a symbol no input names directly: cannot bind
                raise Fallback(f"size symbol {self.graph.symbols[s][0]} is not an input dim")
        # every user input dim must now equal its symbolic size (catches products like 2*s0)
        for i, x in enumerate(args):
            if tuple(x.shape) != self.graph.sizes(self.user_inputs[i], symvals):
                raise Fallback(f"input {i} shape {tuple(x.shape)} does not fit the captured shape relation")
            if x.numel() == 0:
                raise Fallback(f"input {i} is empty")
        return symvals


class RegionFunction(torch.autograd.Function):
    """One compute region as an autograd node: forward through the backend, backward by
    differentiating the region's torch recomputation (until generated backward kernels)."""

    @staticmethod
    def forward(ctx, model, r, symvals, *inputs):
        outs = model._run_region(r, symvals, inputs)
        ctx.model, ctx.r, ctx.symvals = model, r, symvals
        ctx.save_for_backward(*inputs)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors
        model, r = ctx.model, ctx.r
        need = ctx.needs_input_grad[3:]
        with torch.enable_grad():
            xs = [x.detach().requires_grad_(bool(n) and x.is_floating_point()) for x, n in zip(inputs, need)]
            outs = model._eager_region(r, ctx.symvals, xs)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
            wrt = [x for x in xs if x.requires_grad]
            if not pairs or not wrt:
                return (None, None, None) + tuple(None for _ in inputs)
            got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
        it = iter(got)
        return (None, None, None) + tuple(next(it) if x.requires_grad else None for x in xs)


class Executor:
    """A backend: runs compute region r on its input tensors, returns its output tensors."""

    name = "?"

    def prepare(self, plan: Plan, module: torch.nn.Module, example_args) -> None:  # compile, verify
        pass

    def can_run(self, r: int) -> bool:
        return True

    def run(self, r: int, symvals: list, inputs) -> list:
        raise NotImplementedError


class InterpExecutor(Executor):
    """Every region through the C interpreter on the CPU (double accumulation)."""

    name = "interp"

    def prepare(self, plan, module, example_args):
        self.plan = plan
        for info in plan.regions:
            if info.kind != "EXTERN":
                info.status = "interp"

    def run(self, r, symvals, inputs):
        plan = self.plan
        info = plan.regions[r]
        ins = []
        for x in inputs:
            if x.device.type != "cpu":
                raise Fallback(f"the interp backend runs on the CPU; got a tensor on {x.device}")
            ins.append(x.contiguous())
        outs = [torch.empty(plan.graph.sizes(v, symvals), dtype=torch_dtype(plan.nodes[v]["dtype"]))
                for v in info.outputs]
        _C.interp_region(plan.partition, r, symvals, [x.data_ptr() for x in ins], [o.data_ptr() for o in outs])
        return outs


class OptimizedModule(torch.nn.Module):
    """The model with its regions swapped for kbench's. Shares the original's parameters and
    buffers (the very same tensors, the same state_dict keys); the original is left as it was."""

    def __init__(self, module: torch.nn.Module, captured, executor: Executor, example_args):
        super().__init__()
        # share, not copy: the same dicts, so .parameters(), state_dict() and optimizers see the
        # original's tensors, and updates through either module are the same update
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._modules = module._modules
        self.__dict__["_kbench_orig"] = module
        self.__dict__["_kbench_plan"] = Plan(captured, module)
        self.__dict__["_kbench_executor"] = executor
        self.__dict__["_kbench_reasons"] = set()
        self.training = module.training
        self._kbench_param_sources = [self._resolve(self._kbench_plan.nodes[v]["name"], captured)
                                      for v in self._kbench_plan.param_inputs]
        executor.prepare(self._kbench_plan, module, example_args)

    def _resolve(self, name, captured):
        """A getter for a parameter / buffer / lifted constant, read at each call (so that a
        replaced or updated tensor is the one used)."""
        constants = getattr(captured, "constants", {}) or {}
        if name in constants:
            t = constants[name]
            return lambda: t
        mod, _, attr = name.rpartition(".")
        orig = self._kbench_orig

        def get():
            owner = orig.get_submodule(mod) if mod else orig
            return getattr(owner, attr)
        get()  # fail now, not in the first call, if the name does not resolve
        return get

    @property
    def kbench_report(self):
        from .report import Report
        return Report.from_module(self)

    def train(self, mode: bool = True):
        self._kbench_orig.train(mode)
        return super().train(mode)

    def _fallback(self, reason: str, args, kwargs):
        self._note(reason)
        return self._kbench_orig(*args, **kwargs)

    def forward(self, *args, **kwargs):
        plan = self._kbench_plan
        if kwargs:
            return self._fallback("keyword arguments are not captured", args, kwargs)
        try:
            symvals = plan.bind(args)
            return self._run(symvals, args)
        except Fallback as e:
            return self._fallback(str(e), args, kwargs)

    # ------------------------------------------------------------------ the region loop

    def _run(self, symvals, args):
        plan = self._kbench_plan
        values = dict(zip(plan.user_inputs, args))
        for v, get in zip(plan.param_inputs, self._kbench_param_sources):
            values[v] = get()
        device = args[0].device if args else None
        for t in values.values():
            if device is not None and t.device != device:
                raise Fallback(f"tensors on {device} and {t.device}")
        grad_on = torch.is_grad_enabled()
        for info in plan.regions:
            for v in info.inputs:
                if v not in values:
                    self._materialize(v, values, symvals)
            ins = [values[v] for v in info.inputs]
            if info.kind == "EXTERN":
                outs = self._eager_region(info.index, symvals, ins)
            elif grad_on and any(x.requires_grad for x in ins):
                outs = RegionFunction.apply(self, info.index, symvals, *ins)
            else:
                outs = self._run_region(info.index, symvals, ins)
            values.update(zip(info.outputs, outs))
        results = []
        for v in plan.graph.outputs:
            if v not in values:
                self._materialize(v, values, symvals)
            results.append(values[v])
        return self._kbench_plan.captured.output_tree(results) if callable(
            getattr(self._kbench_plan.captured, "output_tree", None)) else (
            results[0] if len(results) == 1 else tuple(results))

    def _materialize(self, v, values, symvals):
        """A value no region produces (a view or constant between regions): torch computes it."""
        plan = self._kbench_plan
        missing = []
        stack = [v]
        while stack:
            n = stack.pop()
            if n in values or n in missing:
                continue
            missing.append(n)
            stack.extend(plan.nodes[n]["inputs"])
        out = torch_eval.evaluate(plan.graph, plan.captured, values, symvals, nodes=sorted(missing))
        values.update({n: out[n] for n in missing if n in out})

    def _run_region(self, r, symvals, inputs):
        executor = self._kbench_executor
        if not executor.can_run(r):
            return self._eager_region(r, symvals, inputs)
        try:
            return executor.run(r, symvals, inputs)
        except RegionFallback as e:
            self._note(str(e))
            return self._eager_region(r, symvals, inputs)

    def _note(self, reason: str):
        if reason not in self._kbench_reasons:
            self._kbench_reasons.add(reason)
            log.warning("kbench: running in eager PyTorch: %s", reason)

    def _eager_region(self, r, symvals, inputs):
        plan = self._kbench_plan
        info = plan.regions[r]
        out = torch_eval.evaluate(plan.graph, plan.captured, dict(zip(info.inputs, inputs)), symvals,
                                  nodes=info.nodes)
        return [out[v] for v in info.outputs]
