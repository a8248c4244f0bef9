"""The swapped-in model: runs a captured graph region by region, each compute region through a
backend (the C interpreter, or generated CUDA kernels), EXTERN regions through torch, with
guards that fall back to eager — with a one-time reason — whenever a call leaves the envelope.

Autograd: every compute region is one torch.autograd.Function. Its backward is the region's
own backward graph (csrc/grad.c: the vector-Jacobian product, recomputing from the saved region
inputs), partitioned and run by the same backend; where autodiff cannot handle a region, the
backward differentiates the region's torch recomputation instead, and the report says so.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

import torch

from . import joint, torch_eval
from ._dtypes import torch_dtype
from .backward import RegionBackward

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
    backward: str = ""      # how its backward runs
    extra: dict = field(default_factory=dict)
    saved: int = 0          # its last `saved` outputs are row statistics kept for the backward
    saved_outputs: tuple = ()  # the outputs (indices) its backward reads, kept for it


# Saved-tensor policy: a region's backward recomputes what it needs from the region's inputs,
# except the row statistics (max, sum, mean) the row's elements are computed from, which the
# forward writes (a value per row) and the backward reads: 4 bytes a row, where recomputing them
# costs the backward kernel a pass over the row per statistic (a LayerNorm backward makes one
# reduction pass instead of two), and a row too long to hold on chip a second read. Rows of at
# least this many bytes (f32) save them: every row. A forward that will not be differentiated
# skips them (Step.run: the kernel's `_nostats` entry point, no buffer for them). Where reading
# the region's outputs moves fewer bytes (a log_softmax's backward needs only its output, as
# eager's does), the backward reads those instead and no statistics are kept (partition.c,
# choose_reads; RegionInfo.saved_outputs).
SAVE_STATS_MIN_ROW_BYTES = 0


class Plan:
    """A graph and its regions: everything about it that does not change between calls."""

    def __init__(self, graph, externs=(), example_symvals=None, static_reason=None, guards=(),
                 save_stats=False):
        self.graph = graph
        self.guards = list(guards)     # size relations the capture relies on (callables of symvals)
        self.externs = list(externs)   # torch_eval reads .externs of its `captured` argument
        self.example_symvals = list(example_symvals if example_symvals is not None
                                    else [s[1] for s in graph.symbols])
        self.static_reason = static_reason
        self.stat_inputs = set()       # a backward's inputs that are a forward's row statistics
        # a backward's inputs that are a forward's outputs (input id -> output index), drawn for
        # checks as the forward makes them: forward_outputs(symvals, dist, gen) -> its outputs
        self.output_inputs, self.forward_outputs = {}, None
        self.nodes = [graph.node(i) for i in range(graph.num_nodes)]
        self.partition = graph.partition()
        if save_stats:  # a forward: its long-row regions also write the statistics their backward reads
            self.partition.save_stats(SAVE_STATS_MIN_ROW_BYTES)
        self.regions: list[RegionInfo] = []
        for r in range(len(self.partition)):
            d = self.partition.region(r)
            ops = " ".join(self.nodes[n]["op"] for n in d["nodes"]
                           if self.nodes[n]["op"] not in ("const", "input"))
            self.regions.append(RegionInfo(r, d["kind"], d["nodes"], d["inputs"], d["outputs"], ops,
                                           saved=d["saved"], saved_outputs=tuple(d["saved_outputs"])))
        self.nvrtc = None
        self._region_texts = {}

    def region_text(self, r) -> str:
        """Region r's IR with value names stripped: the same for the same region in repeated
        blocks (the cache key's text, and what makes two gradient checks the same)."""
        text = self._region_texts.get(r)
        if text is None:
            text = self._region_texts[r] = re.sub(r'"[^"]*"', '""', str(self.partition.region_graph(r)))
        return text

    def admits(self, symvals) -> bool:
        """Do these sizes satisfy every relation the capture relies on (e.g. a slice's bound)?"""
        return all(g(symvals) for g in self.guards)

    # the reference evaluator takes the plan where it would take a Captured
    @property
    def captured(self):
        return self

    def missing(self, v, have) -> list:
        """The nodes torch must compute for value v, given the values in `have`, in id order."""
        missing, stack = set(), [v]
        while stack:
            n = stack.pop()
            if n in have or n in missing:
                continue
            missing.add(n)
            stack.extend(self.nodes[n]["inputs"])
        return sorted(missing)

    def materialize(self, v, values, symvals):
        """A value no region produces (a view or constant between regions): torch computes it."""
        missing = self.missing(v, values)
        out = torch_eval.evaluate(self.graph, self, values, symvals, nodes=missing)
        values.update({n: out[n] for n in missing if n in out})

    def eager_region(self, r, symvals, inputs, dtype=None):
        info = self.regions[r]
        out = torch_eval.evaluate(self.graph, self, dict(zip(info.inputs, inputs)), symvals, nodes=info.nodes,
                                  dtype=dtype)
        return [out[v] for v in info.outputs]


class Executor:
    """A backend: prepares (compiles, verifies) a plan's compute regions, then runs region r on
    its input tensors and returns its output tensors."""

    name = "?"

    def fresh(self) -> "Executor":
        """A new executor of the same kind and settings, for another plan (a backward graph)."""
        return type(self)()

    def prepare(self, plan: Plan, device: torch.device) -> None:
        self.plan = plan

    def can_run(self, r: int) -> bool:
        return True

    def scale(self, grads, grad_out) -> None:
        """Gradients computed with the upstream gradient taken as 1 (kbench/joint.py), times the
        real one, in place; nothing to do where it is 1 (on the CPU, asking costs nothing)."""
        if bool((grad_out != 1).any()):
            for t in grads:
                t.mul_(grad_out.to(t.dtype))

    def scale_ms(self, metas) -> float | None:
        """How long scale() takes on gradients of these (shape, dtype), where it is timed."""
        return None

    def run(self, r: int, symvals: list, inputs) -> list:
        raise NotImplementedError

    def launcher(self, r: int, symvals, trusted=(), stats=True):
        """A callable(inputs) -> outputs that runs region r at these sizes with everything that
        does not depend on the tensors precomputed (the hot path), or None where run() must
        decide per call. trusted[j]: input j is known contiguous (an earlier kernel's output, or
        a backward input the forward's kernel already checked), so that check can be skipped.
        stats=False: the region's saved statistics may be left out (None), no backward reads
        them."""
        if not self.can_run(r):
            return None
        run, symvals = self.run, list(symvals)
        return lambda inputs: run(r, symvals, inputs)

    def _region_inputs(self, r, symvals, dist, gen):
        """Random inputs of region r at these sizes (gather indices in range), for checks."""
        from . import verify

        device = getattr(self, "device", torch.device("cpu"))
        if gen.device.type != device.type:  # inputs are drawn where they live
            gen = torch.Generator(device=device).manual_seed(gen.initial_seed())
        plan = self.plan
        info = plan.regions[r]
        inputs, made = [], None
        for v in info.inputs:
            nd = plan.nodes[v]
            if v in plan.output_inputs:
                # a forward's output (a log_softmax's log-probabilities): drawn freely, values no
                # forward makes (exp(y) past f32's range) would fail a correct kernel
                made = made if made is not None else plan.forward_outputs(symvals, dist, gen)
                inputs.append(made[plan.output_inputs[v]].to(torch_dtype(nd["dtype"])).contiguous())
                continue
            t = torch.empty(plan.graph.sizes(v, symvals), dtype=torch_dtype(nd["dtype"]), device=device)
            if v in plan.stat_inputs:
                inputs.append(verify.fill_statistic(t, dist, gen))
            else:
                inputs.append(verify.fill(t, dist, gen, high=self._index_bound(r, v, symvals)))
        return inputs

    def _index_bound(self, r, v, symvals):
        """For an integer input used as a gather index: the size of the gathered axis."""
        plan = self.plan
        for n in plan.regions[r].nodes:
            nd = plan.nodes[n]
            if nd["op"] == "gather" and self._reaches(v, nd["inputs"][1], plan.regions[r].nodes):
                return plan.graph.sizes(nd["inputs"][0], symvals)[nd["axis"]]
        return None

    def _reaches(self, src, dst, region_nodes):
        seen, stack = set(), [dst]
        while stack:
            n = stack.pop()
            if n == src:
                return True
            if n in seen or n not in region_nodes:
                continue
            seen.add(n)
            stack.extend(self.plan.nodes[n]["inputs"])
        return False


class InterpExecutor(Executor):
    """Every region through the C interpreter on the CPU (double accumulation)."""

    name = "interp"

    def prepare(self, plan, device):
        self.plan = plan
        for info in plan.regions:
            if info.kind != "EXTERN":
                info.status = "interp"

    def run(self, r, symvals, inputs):
        from . import _C

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


class Program:
    """A plan bound to a prepared executor: runs every region in order."""

    def __init__(self, plan: Plan, executor: Executor, note):
        self.plan, self.executor, self.note = plan, executor, note

    def run_region(self, r, symvals, inputs):
        if not self.executor.can_run(r):
            return self.plan.eager_region(r, symvals, inputs)
        try:
            return self.executor.run(r, symvals, inputs)
        except RegionFallback as e:
            self.note(str(e))
            return self.plan.eager_region(r, symvals, inputs)

    def bind(self, symvals, trusted=()) -> Bound:
        """The steps of a call at these sizes: the same order and the same values as run(), with
        every dict lookup and launch parameter resolved once. trusted: graph input positions
        the caller guarantees contiguous."""
        plan, graph = self.plan, self.plan.graph
        symvals = tuple(symvals)
        slot = {v: i for i, v in enumerate(graph.inputs)}
        fresh = set(trusted)    # slots known contiguous: trusted inputs, outputs of our kernels
        steps = []

        def ensure(v):
            if v in slot:
                return
            nodes = plan.missing(v, slot)
            deps = sorted({u for n in nodes for u in plan.nodes[n]["inputs"] if u not in nodes})
            step = Step()
            step.kind, step.r, step.ins, step.launch_nograd = MATERIALIZE, -1, [slot[u] for u in deps], None
            step.fast = None
            step.launch = self._materializer(deps, nodes, symvals)
            for n in nodes:
                slot[n] = len(slot)
            steps.append(step)

        for info in plan.regions:
            for v in info.inputs:
                ensure(v)
            step = Step()
            step.r, step.symvals, step.program, step.backward, step.fast = info.index, symvals, self, {}, None
            step.ins = [slot[v] for v in info.inputs]
            step.float_in = tuple(torch_dtype(plan.nodes[v]["dtype"]).is_floating_point for v in info.inputs)
            step.out_meta = [(torch.Size(graph.sizes(v, symvals)), torch_dtype(plan.nodes[v]["dtype"]))
                             for v in info.outputs]
            step.int_outs = not all(d.is_floating_point for _, d in step.out_meta)
            step.nsaved, step.no_stats = info.saved, [None] * info.saved
            step.saved_outputs = info.saved_outputs
            step.launch_nograd = None
            if info.kind == "EXTERN":
                step.kind, step.launch = EAGER, None
            else:
                step.kind = KERNEL
                trusted_ins = [i in fresh for i in step.ins]
                step.launch = self.executor.launcher(info.index, symvals, trusted_ins)
                if info.saved and step.launch is not None:
                    step.launch_nograd = self.executor.launcher(info.index, symvals, trusted_ins, stats=False)
            for v in info.outputs:
                slot[v] = len(slot)
                if step.launch is not None and info.kind != "EXTERN":
                    fresh.add(slot[v])
            steps.append(step)
        for v in graph.outputs:
            ensure(v)
        return Bound(symvals, steps, [slot[v] for v in graph.outputs])

    def _materializer(self, deps, nodes, symvals):
        plan = self.plan

        def materialize(inputs):
            out = torch_eval.evaluate(plan.graph, plan, dict(zip(deps, inputs)), symvals, nodes=nodes)
            return [out.get(n) for n in nodes]
        return materialize

    def run(self, symvals, values: dict, region_call=None) -> list:
        """values: graph input id -> tensor; returns the graph outputs. region_call(r, ins) may
        wrap compute regions (the forward wraps them in autograd Functions)."""
        plan = self.plan
        for info in plan.regions:
            for v in info.inputs:
                if v not in values:
                    plan.materialize(v, values, symvals)
            ins = [values[v] for v in info.inputs]
            if info.kind == "EXTERN":
                outs = plan.eager_region(info.index, symvals, ins)
            elif region_call is not None:
                outs = region_call(info.index, ins)
            else:
                outs = self.run_region(info.index, symvals, ins)
            values.update(zip(info.outputs, outs))
        for v in plan.graph.outputs:
            if v not in values:
                plan.materialize(v, values, symvals)
        return [values[v] for v in plan.graph.outputs]


KERNEL, EAGER, MATERIALIZE = 0, 1, 2


class Step:
    """One region (or one materialization of in-between values) bound to sizes: which slots it
    reads, and how to run it, decided once per input signature instead of once per call."""

    __slots__ = ("kind", "r", "ins", "launch", "launch_nograd", "program", "symvals", "float_in", "int_outs",
                 "out_meta", "nsaved", "no_stats", "saved_outputs", "owner", "backward", "fast")

    def run(self, inputs):
        """The region's outputs where no backward will follow (kernel, or eager where the backend
        declines this call): the saved statistics may come back as None."""
        return self._run_with(self.launch_nograd or self.launch, inputs)[0]

    def run_kernel(self, inputs):
        """(outputs, whether the backend's kernel ran): a kernel ran only on inputs it checked,
        so the region's backward may take them as contiguous."""
        return self._run_with(self.launch, inputs)

    def _run_with(self, launch, inputs):
        if launch is not None:
            try:
                return launch(inputs), True
            except RegionFallback as e:
                self.program.note(str(e))
                # later kernels trust this step's outputs to be contiguous and 16-byte aligned
                return [o if o.is_contiguous() and o.data_ptr() % 16 == 0
                        else torch.empty_like(o, memory_format=torch.contiguous_format).copy_(o)
                        for o in self.program.plan.eager_region(self.r, self.symvals, inputs)], False
        return self.program.plan.eager_region(self.r, self.symvals, inputs), False


class Bound:
    """A program bound to one set of sizes: its steps over a flat list of value slots (graph
    inputs first, then each step's outputs in order) and which slots are the graph outputs."""

    __slots__ = ("symvals", "steps", "outputs")

    def __init__(self, symvals, steps, outputs):
        self.symvals, self.steps, self.outputs = symvals, steps, outputs

    def run(self, slots: list) -> list:
        """Run every step without autograd wrapping (backward programs, checks)."""
        for step in self.steps:
            ins = [slots[i] for i in step.ins]
            if step.kind == MATERIALIZE:
                slots.extend(step.launch(ins))
            else:
                slots.extend(step.run(ins))
        return [slots[i] for i in self.outputs]


class RegionFunction(torch.autograd.Function):
    """One compute region as an autograd node: forward through the backend; backward through the
    region's generated backward program (or, where there is none, torch's recomputation)."""

    @staticmethod
    def forward(ctx, step, *inputs):
        outs, ctx.checked = step.run_kernel(inputs)
        ctx.step = step
        # the outputs its backward reads are saved as torch saves a node's outputs (no cycle, and
        # changed in place after this they fail the backward, as eager's would)
        ctx.save_for_backward(*inputs, *[outs[k] for k in step.saved_outputs])
        ns = step.nsaved
        if ns:
            # the row statistics are the node's own (the backward reads them instead of reducing
            # the rows again), not outputs: no autograd bookkeeping for them, and the caller's
            # slots get None in their place (nothing in the forward reads them)
            ctx.stats = outs[len(outs) - ns:]
            outs = outs[:len(outs) - ns]
        if step.int_outs:
            ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        step = ctx.step
        need = tuple(a and b for a, b in zip(ctx.needs_input_grad[1:], step.float_in))
        saved, nin = ctx.saved_tensors, len(step.ins)
        if step.nsaved:  # the backward's order: inputs, statistics, outputs read
            saved = saved[:nin] + tuple(ctx.stats) + saved[nin:]
        return (None,) + tuple(step.owner._region_backward(step, saved, grads, need, ctx.checked))


def _fast_apply():
    """RegionFunction.apply without the Python wrapper's per-call work (binding default
    arguments, unwrapping dead functorch wrappers), which only matters under functorch
    transforms: those take the full path."""
    raw = getattr(torch._C, "_FunctionBase", None)
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if raw is None or active is None or "apply" not in vars(raw):
        return RegionFunction.apply
    direct = vars(raw)["apply"].__get__(None, RegionFunction)
    full = RegionFunction.apply
    return lambda *args: full(*args) if active() else direct(*args)


apply_region = _fast_apply()


def _fast_launch(launcher):
    """The kbench._fast.Launch behind a launcher (its bound .run), or None (a Python closure)."""
    launch = getattr(launcher, "__self__", None)
    kind = type(launch)
    return launch if kind.__module__ == "kbench._fast" and kind.__name__ == "Launch" else None


class OptimizedModule(RegionBackward, torch.nn.Module):
    """The model with its regions swapped for kbench's. Shares the original's parameters and
    buffers (the very same tensors, the same state_dict keys); the original is left as it was."""

    def __init__(self, module: torch.nn.Module, captured, executor: Executor, device: torch.device,
                 grad_in_forward: bool = True):
        super().__init__()
        # share, not copy: the same dicts, so .parameters(), state_dict() and optimizers see the
        # original's tensors, and updates through either module are the same update
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._modules = module._modules
        self.training = module.training
        plan = Plan(captured.graph, captured.externs, captured.example_symvals, captured.static_reason,
                    captured.guards, save_stats=True)
        executor.prepare(plan, device)
        self.__dict__.update(_kbench_orig=module, _kbench_captured=captured, _kbench_plan=plan,
                             _kbench_executor=executor, _kbench_reasons=set(), _kbench_device=device,
                             _kbench_program=Program(plan, executor, self._note), _kbench_backward={},
                             _kbench_unused_grads={}, _kbench_grad_checks={},
                             _kbench_captured_training=module.training)
        # parameters and buffers as captured: a later .double() or resize sends calls to eager
        nuser = len(captured.input_names)
        self.__dict__["_kbench_param_meta"] = [
            (plan.nodes[v]["name"], torch_dtype(plan.nodes[v]["dtype"]),
             torch.Size(plan.graph.sizes(v, plan.example_symvals)))
            for v in plan.graph.inputs[nuser:]]
        self.__dict__["_kbench_param_chains"] = self._param_chains()
        self.__dict__["_kbench_sigs"] = {}
        # a loss: its gradients computed in the forward (kbench/joint.py); per need pattern, the
        # joint program (None: not used) and, for the report, whether and why
        why = joint.scalar_output(plan, captured) if grad_in_forward else "grad_in_forward=False"
        self.__dict__.update(_kbench_loss_why=why, _kbench_loss={}, _kbench_joint={})
        self.__dict__["_kbench_fast_program"] = self._fast_program()

    @property
    def kbench_report(self):
        from .report import Report
        return Report.from_module(self)

    def train(self, mode: bool = True):
        self._kbench_orig.train(mode)
        return super().train(mode)

    def _note(self, reason: str):
        if reason not in self._kbench_reasons:
            self._kbench_reasons.add(reason)
            log.warning("kbench: running in eager PyTorch: %s", reason)

    def _fallback(self, reason: str, args, kwargs):
        self._note(reason)
        return self._kbench_orig(*args, **kwargs)

    def forward(self, *args, **kwargs):
        # the common case in C++ (kbench._fast.Program): a bound signature, every region a
        # generated kernel; NotImplemented for anything else, decided before any launch. A
        # plain call (no hooks) does this in C++ too: kbench._fast.module_call, use_fast_call
        program = self._kbench_fast_program
        if program is not None and not kwargs:
            try:
                out = program.call(self, args)
            except Fallback as e:
                return self._fallback(str(e), args, kwargs)
            if out is not NotImplemented:
                return out
        return self._forward_python(args, kwargs)

    def _forward_python(self, args, kwargs):
        """The forward where kbench._fast.Program declines: a new signature to bind, a step or an
        output it leaves to Python, a fallback."""
        if kwargs:
            return self._fallback("keyword arguments are not captured", args, kwargs)
        # the hot path: sizes bound once per input signature (shapes, dtypes, devices)
        try:
            sig = tuple((x.shape, x.dtype, x.device) for x in args)
        except AttributeError:
            sig = None
        bound = self._kbench_sigs.get(sig) if sig is not None else None
        if bound is None:
            bound = self._bind(args, sig)
            if isinstance(bound, str):
                return self._fallback(bound, args, kwargs)
        if self.training != self._kbench_captured_training:
            return self._fallback("the module's train/eval mode differs from the captured one", args, kwargs)
        try:
            return self._run(bound, args)
        except Fallback as e:
            return self._fallback(str(e), args, kwargs)

    def _bind(self, args, sig):
        """The program bound to a new input signature's sizes, or the reason the call must go to
        eager."""
        captured = self._kbench_captured
        if len(args) != len(captured.input_names):
            raise TypeError(f"{type(self._kbench_orig).__name__} was captured with {len(captured.input_names)} "
                            f"input(s); got {len(args)}")
        for i, x in enumerate(args):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {i} must be a tensor, got {type(x).__name__}")
        try:
            symvals = tuple(captured.bind(args))
        except ValueError as e:
            return str(e)
        bound = self._kbench_program.bind(symvals)
        for step in bound.steps:
            step.owner = self
            if step.kind == KERNEL:
                step.fast = self._fast_region(step)
        if sig is not None:
            program = self._kbench_fast_program
            if len(self._kbench_sigs) > 256:   # many shapes: keep the table bounded
                self._kbench_sigs.clear()
                if program is not None:
                    program.clear()
            self._kbench_sigs[sig] = bound
            if program is not None:
                entry = self._fast_entry(bound)
                if entry is not None:
                    program.add(tuple(args), *entry)
        return bound

    def _fast_program(self):
        """The kbench._fast.Program that runs the common call from C++, where the executor's
        launches are kbench._fast's; None: every call takes the Python path."""
        if self._kbench_executor.name != "cuda":
            return None
        from . import cuda_backend
        fast = cuda_backend._fast   # None under KBENCH_FAST=0 (or where it was not built)
        if fast is None or not hasattr(fast, "Program"):
            return None
        return fast.Program(orig=self._kbench_orig, captured=self._kbench_captured,
                            ninputs=len(self._kbench_captured.input_names), chains=self._kbench_param_chains,
                            meta=self._kbench_param_meta, training=self._kbench_captured_training,
                            grad_ok=bool(self._kbench_loss_why), apply_region=apply_region)

    def _fast_entry(self, bound):
        """What kbench._fast.Program.add takes for this bound signature: (steps, outputs, build),
        or None where _run must run every call: a region that is not a kbench._fast launch and
        Region (eager, EXTERN, a Python launcher), a value torch computes in between, in-place
        updates to copy back."""
        captured = self._kbench_captured
        if captured.mutations:
            return None
        steps = []
        for step in bound.steps:
            launch = _fast_launch(step.launch_nograd or step.launch) if step.kind == KERNEL else None
            if launch is None or step.fast is None:
                return None
            steps.append((step, launch, step.fast, list(step.ins), len(step.out_meta)))
        # build_outputs as C++ reproduces it where that is exact: the one output itself, or a
        # plain tuple of outputs; anything else (a dict, None or a size among them) it calls
        probe = [object() for _ in bound.outputs]
        try:
            shaped = captured.build_outputs(probe, bound.symvals)
        except Exception:  # noqa: BLE001 - whatever it does with real tensors, the Python path does it
            return None
        where = {id(p): i for i, p in enumerate(probe)}
        if id(shaped) in where:
            return steps, [bound.outputs[where[id(shaped)]]], "one"
        if type(shaped) is tuple and shaped and all(id(x) in where for x in shaped):
            return steps, [bound.outputs[where[id(x)]] for x in shaped], "tuple"
        symvals, build = bound.symvals, captured.build_outputs
        return steps, list(bound.outputs), lambda outs: build(outs, symvals)

    def _param_chains(self):
        """(module path, table, name) per parameter/buffer input: read through the live modules'
        own dicts at each call, so a replaced tensor or submodule is the one used."""
        chains = []
        for v in self._kbench_plan.graph.inputs[len(self._kbench_captured.input_names):]:
            name = self._kbench_plan.nodes[v]["name"]
            if name in self._kbench_captured.constants:
                chains.append((None, None, name))
                continue
            *path, leaf = name.split(".")
            owner = self._kbench_orig.get_submodule(".".join(path)) if path else self._kbench_orig
            table = "_parameters" if leaf in owner._parameters else "_buffers"
            chains.append((tuple(path), table, leaf))
        return chains

    def _params(self):
        out = []
        constants = self._kbench_captured.constants
        for path, table, leaf in self._kbench_param_chains:
            if path is None:
                out.append(constants[leaf])
                continue
            m = self._kbench_orig
            try:
                for part in path:
                    m = m._modules[part]
                t = getattr(m, table)[leaf]
            except (KeyError, AttributeError):
                raise Fallback(f"{'.'.join(path + (leaf,))} is gone from the module") from None
            if t is None:
                raise Fallback(f"{'.'.join(path + (leaf,))} is None")
            out.append(t)
        return out

    def _run(self, bound, args):
        captured = self._kbench_captured
        params = self._params()
        device = args[0].device if args else self._kbench_device
        # checked every call: module.double() or .to() change a Parameter's dtype in place
        # (param.data = ...), so the same tensor object can come back as something else
        for t, (name, dtype, shape) in zip(params, self._kbench_param_meta):
            if t.dtype != dtype or t.shape != shape or t.device != device:
                raise Fallback(f"{name} is now {t.dtype}{list(t.shape)} on {t.device}; it was captured as "
                               f"{dtype}{list(shape)}, and the inputs are on {device}")
        for x in args:
            if x.device != device:
                raise Fallback(f"tensors on {device} and {x.device}")
        slots = [*args, *params]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in slots)
        if grad and not self._kbench_loss_why:
            need = tuple(t.requires_grad and t.is_floating_point() for t in slots)
            program = self._kbench_joint.get(need, False)
            if program is False:
                program = self._kbench_joint[need] = joint.build(self, need)
            if program is not None:
                loss = joint.LossFunction.apply(program, bound.symvals, *slots)
                return captured.build_outputs([loss], bound.symvals)
        for step in bound.steps:
            ins = [slots[i] for i in step.ins]
            if step.kind == KERNEL:
                if grad and any(x.requires_grad for x in ins):
                    fast = step.fast
                    if fast is None:
                        slots.extend(apply_region(step, *ins))
                    else:
                        try:
                            slots.extend(fast.apply(*ins))
                        except RegionFallback:   # the Python node runs it in eager, and notes why
                            slots.extend(apply_region(step, *ins))
                    if step.nsaved:
                        slots.extend(step.no_stats)
                else:
                    slots.extend(step.run(ins))
            elif step.kind == MATERIALIZE:
                slots.extend(step.launch(ins))
            else:
                slots.extend(self._kbench_plan.eager_region(step.r, bound.symvals, ins))
        outs = [slots[i] for i in bound.outputs]
        if captured.mutations:
            captured.apply_mutations(self._kbench_orig, args, outs)
        return captured.build_outputs(outs, bound.symvals)


def use_fast_call(fast) -> None:
    """OptimizedModule.__call__ from kbench._fast (csrc/fast/call.cpp): torch's nn.Module.__call__
    wherever a hook, a compiled call, a JIT trace or a keyword argument needs it, else forward()'s
    C++ path without the Python frames of __call__ and forward in between. kbench.cuda_backend
    calls it once kbench._fast is loaded; None (or a build without it) keeps torch's."""
    make = getattr(fast, "module_call", None)
    if make is None:
        if "__call__" in vars(OptimizedModule):   # torch's, looked up on nn.Module (FX patches it there)
            del OptimizedModule.__call__
        return
    OptimizedModule.__call__ = make(torch.nn.Module, vars(torch.nn.modules.module))
