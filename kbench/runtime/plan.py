"""A captured graph as the runtime runs it: a Plan (the graph, its regions and what is known of
each), an Executor (the backend that prepares and runs compute regions: interp.py, cuda.py), a
Program (a plan bound to a prepared executor) and its Bound form (the steps of a call at one set
of sizes, every lookup resolved once). EXTERN regions and values between regions run in torch
(torch_eval.py); a backend may send one region, or the whole call, to eager with a reason. Where
the capture says which FX nodes each value came from, each region also knows what eager runs for
it (eager.py): the ATen calls the report times, and those optimize() keeps in torch where the
region's kernel does not beat them."""
from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

from .. import verify
from ..capture.types import DeviceSlot, StepRef, SymExpr, TensorSlot
from ..dtypes import torch_dtype
from . import torch_eval
from .eager import RegionEager, analyze

log = logging.getLogger("kbench")

VIEW_OPS = ("reshape", "permute", "expand", "slice")   # IR ops that move no data
_RANDOM = torch.Tag.nondeterministic_seeded
# what an extern's arguments may hold besides tensors for its result to depend on its operands alone
_PLAIN = (TensorSlot, StepRef, SymExpr, DeviceSlot, type(None), bool, int, float, str, torch.dtype,
          torch.device, torch.layout, torch.memory_format)


class Fallback(Exception):
    """Raised inside a call to send the whole call to eager; the message is the one-line reason."""


class RegionFallback(Exception):
    """Raised by a backend to run one region in eager for this call (e.g. a misaligned input)."""


class Status(enum.Enum):
    """What runs a region; RegionInfo.reason says why where torch runs one that kbench could."""
    INTERP = "interp"                     # the C interpreter (backend "interp")
    KERNEL = "kernel"                     # a generated kernel, verified here
    CACHED = "kernel (cached)"            # a stored winner, gated against the reference on load
    UNVERIFIED = "kernel (unverified)"    # a generated kernel with verification turned off (tests)
    EAGER = "eager"                       # torch runs it: no kernel compiled and verified, or it lost to eager
    TORCH = "torch"                       # an EXTERN region: torch's own op (or ops kept in torch)

    @property
    def kernel(self) -> bool:
        """A generated kernel runs the region."""
        return self in (Status.KERNEL, Status.CACHED, Status.UNVERIFIED)


@dataclass
class RegionInfo:
    index: int
    kind: str               # POINTWISE | ROW | COL | EXTERN
    nodes: list
    inputs: list
    outputs: list
    ops: str                # "mean sub mul ..." for the report
    status: Status = Status.INTERP
    reason: str = ""        # why torch runs it (status EAGER)
    genome: str = ""
    envelope: str = ""
    eager_ms: float | None = None
    kernel_ms: float | None = None
    backward: str = ""      # how its backward runs
    extra: dict = field(default_factory=dict)
    saved: int = 0          # its last `saved` outputs are row statistics kept for the backward
    saved_outputs: tuple = ()  # the outputs (indices) its backward reads, kept for it
    eager: RegionEager | None = None   # what eager runs for it (None: the graph has no provenance)
    key: object = None      # the tuner's cache key for it (tune/cache.CacheKey), where a tuner prepared it
    source_hash: str = ""   # sha256 of the CUDA source of the kernel that runs it (a stored winner's as stored)

    @property
    def fx_nodes(self) -> tuple:
        """The FX nodes (names) its values came from, in graph order; () where unknown."""
        return self.eager.nodes if self.eager is not None else ()

    def set_status(self, status: Status, reason: str = "") -> None:
        self.status, self.reason = status, reason

    @property
    def status_text(self) -> str:
        """The status as the report prints it: "kernel", "eager (compile failed: ...)"."""
        return f"{self.status.value} ({self.reason})" if self.reason else self.status.value


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
                 save_stats=False, origin=None, calls=None, kept=None):
        """origin, calls, kept: the capture's provenance (Captured.origin, .calls, .kept), where
        the graph is a capture's (a backward's has none)."""
        self.graph = graph
        self.guards = list(guards)     # size relations the capture relies on (callables of symvals)
        self.externs = list(externs)   # torch_eval reads .externs of its `captured` argument
        self.example_symvals = list(example_symvals if example_symvals is not None
                                    else [s[1] for s in graph.symbols])
        self.static_reason = static_reason
        # where values with no tensor input (constants, iotas between regions) are made: the
        # device the executor runs on (Executor.prepare sets it; None: the CPU)
        self.device = None
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
                                           status=Status.TORCH if d["kind"] == "EXTERN" else Status.INTERP,
                                           saved=d["saved"], saved_outputs=tuple(d["saved_outputs"])))
        kept = kept or {}
        for info, eager in zip(self.regions, analyze(self.nodes, self.regions, origin or {}, calls or {})):
            info.eager = eager
            why = list(dict.fromkeys(kept[n] or "kept in torch" for n in info.fx_nodes if n in kept))
            if info.kind == "EXTERN" and why:   # ops whose IR lost to eager's: the report says so
                info.reason = "kept: " + "; ".join(why)
        self.nvrtc = None
        self._region_texts = {}

    def region_text(self, r) -> str:
        """Region r's IR with value names stripped: the same for the same region in repeated
        blocks (the cache key's text, and what makes two gradient checks the same)."""
        text = self._region_texts.get(r)
        if text is None:
            text = self._region_texts[r] = re.sub(r'"[^"]*"', '""', str(self.partition.region_graph(r)))
        return text

    def precision(self, r=None):
        """The least precise float dtype region r's values (every node's, r None) pass through:
        what its results are compared with a float64 reference at (verify.precision)."""
        nodes = self.nodes if r is None else [self.nodes[n] for n in self.regions[r].nodes]
        return verify.precision({torch_dtype(nd["dtype"]) for nd in nodes})

    def reduction(self, r, symvals, backward=False) -> int:
        """The longest reduction a MATMUL of region r makes at these sizes (0: none): its K, or,
        backward, the longest of M, N and K (the backward's products dA = g . B^T and dB = A^T . g
        reduce over N and M): what verify.gemm_scale widens the region's tolerance by."""
        longest = 0
        for n in self.regions[r].nodes:
            nd = self.nodes[n]
            if nd["op"] != "matmul":
                continue
            a = self.graph.sizes(nd["inputs"][0], symvals)
            b = self.graph.sizes(nd["inputs"][1], symvals)
            longest = max([longest, a[-1]] + ([a[-2], b[-1]] if backward else []))
        return longest

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
        out = torch_eval.evaluate(self.graph, self, values, symvals, nodes=missing, device=self.device)
        values.update({n: out[n] for n in missing if n in out})

    def deterministic(self, info) -> bool:
        """EXTERN region info's torch calls give the same values for the same operands: none draws
        random numbers (torch's nondeterministic_seeded tag) or reads an object held for it (a
        cache object, whose state may change between calls)."""
        for n in info.nodes:
            nd = self.nodes[n]
            if nd["op"] != "extern":
                continue
            for fn, args, kwargs in self.externs[nd["index"]].steps:
                if not isinstance(fn, torch._ops.OpOverload) or _RANDOM in fn.tags:
                    return False
                if not all(isinstance(x, _PLAIN) for x in pytree.tree_leaves((args, kwargs))):
                    return False
        return True

    def fresh_outputs(self, info) -> bool:
        """EXTERN region info's outputs are never views of its inputs: each is an extern call's
        result that is a new tensor or a view of one the call made (a padded product's slice),
        following the ATen ops that return a view (their schemas say) back to an operand."""
        for v in info.outputs:
            nd = self.nodes[v]
            if nd["op"] != "extern":
                return False
            steps = self.externs[nd["index"]].steps
            j = len(steps) - 1
            while True:
                fn, args, _ = steps[j]
                if not isinstance(fn, torch._ops.OpOverload):
                    return False
                if all(r.alias_info is None for r in fn._schema.returns):
                    break   # a new tensor
                base = args[0] if args else None
                if not isinstance(base, StepRef):
                    return False   # a view of an operand (or of something unknown)
                j = base.j
        return True

    def eager_region(self, r, symvals, inputs, dtype=None, kinks=None):
        info = self.regions[r]
        out = torch_eval.evaluate(self.graph, self, dict(zip(info.inputs, inputs)), symvals, nodes=info.nodes,
                                  dtype=dtype, device=self.device, kinks=kinks)
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
        plan.device = device

    def can_run(self, r: int) -> bool:
        return True

    def refuses(self, r: int, symvals) -> str:
        """Why region r's kernel does not run at these sizes at all ("" where it may): the same
        for every call at them (a last dim no multiple of the kernel's vec), unlike a misaligned
        input."""
        return ""

    def scale(self, grads, grad_out) -> None:
        """Gradients computed with the upstream gradient taken as 1 (runtime/joint.py), times the
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

    def region_inputs(self, r, symvals, dist, gen):
        """Random inputs of region r at these sizes (gather indices in range), for checks."""
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

    def input_roles(self, r, symvals) -> list:
        """What region_inputs draws for each input of region r, as data (the sandbox's worker makes
        its own): (sizes, dtype, role), role "stat" (a row statistic), "index:N" (integers below
        N: a gather's indices, or 0 and 1) or "input" (random values)."""
        plan = self.plan
        out = []
        for v in plan.regions[r].inputs:
            dtype = torch_dtype(plan.nodes[v]["dtype"])
            role = "input"
            if v in plan.stat_inputs and v not in plan.output_inputs:
                role = "stat"
            elif not dtype.is_floating_point and dtype != torch.bool:
                role = f"index:{max(int(self._index_bound(r, v, symvals) or 2), 1)}"
            out.append((list(plan.graph.sizes(v, symvals)), dtype, role))
        return out

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


class Program:
    """A plan bound to a prepared executor: runs every region in order."""

    def __init__(self, plan: Plan, executor: Executor, note):
        self.plan, self.executor, self.note = plan, executor, note

    def run_region(self, r, symvals, inputs):
        """Region r off the hot path (checks; a call's steps are bind()'s). At sizes its kernel
        refuses (Executor.refuses) the region runs in eager without a note: a gradient check at
        sizes no call used is nobody's fallback."""
        if not self.executor.can_run(r) or self.executor.refuses(r, symvals):
            return self.plan.eager_region(r, symvals, inputs)
        try:
            return self.executor.run(r, symvals, inputs)
        except RegionFallback as e:
            self.note(str(e))
            return self.plan.eager_region(r, symvals, inputs)

    def bind(self, symvals, trusted=(), hoist=False) -> Bound:
        """The steps of a call at these sizes: the same order and the same values as run(), with
        every dict lookup and launch parameter resolved once. trusted: graph input positions
        the caller guarantees contiguous. Each step knows whether it is pure (its values depend
        on parameters, buffers and constants alone: no user input, nothing random). hoist: the
        work on parameters alone that an EXTERN region holds (autocast's cast of a weight,
        floated into the region) runs as a step of its own before it, a pure one, which a
        forward's parameter cache computes once per parameter version (param_cache.py)."""
        plan, graph = self.plan, self.plan.graph
        symvals = tuple(symvals)
        slot = {v: i for i, v in enumerate(graph.inputs)}
        pure = {i for i, v in enumerate(graph.inputs) if plan.nodes[v].get("input_kind", "user") != "user"}
        fresh = set(trusted)    # slots known contiguous: trusted inputs, outputs of our kernels
        steps = []

        def materialize(nodes, made):
            """A MATERIALIZE step computing nodes (ids, in order), whose values `made` get slots."""
            inside = set(nodes)
            deps = sorted({u for n in nodes for u in plan.nodes[n]["inputs"] if u not in inside})
            step = Step()
            step.kind, step.r, step.ins = MATERIALIZE, -1, [slot[u] for u in deps]
            step.launch = self._materializer(deps, nodes, symvals, made)
            step.pure = all(i in pure for i in step.ins)
            step.sizes = tuple(tuple(graph.sizes(n, symvals)) for n in nodes)
            step.views = all(plan.nodes[n]["op"] in VIEW_OPS for n in nodes)
            step.nbytes = sum(_nbytes(graph.sizes(n, symvals), plan.nodes[n]["dtype"]) for n in made)
            for n in made:
                slot[n] = len(slot)
            step.made = [slot[n] for n in made]
            if step.pure:
                pure.update(step.made)
            steps.append(step)

        def ensure(v):
            if v not in slot:
                nodes = plan.missing(v, slot)
                materialize(nodes, nodes)

        for info in plan.regions:
            for v in info.inputs:
                ensure(v)
            step = Step()
            step.r, step.symvals, step.program, step.backward = info.index, symvals, self, {}
            ins = list(info.inputs)
            if info.kind == "EXTERN" and hoist:
                ins = self._hoist(info, slot, pure, materialize, symvals, step)
            step.ins = [slot[v] for v in ins]
            step.float_in = tuple(torch_dtype(plan.nodes[v]["dtype"]).is_floating_point for v in ins)
            step.out_meta = [(torch.Size(graph.sizes(v, symvals)), torch_dtype(plan.nodes[v]["dtype"]))
                             for v in info.outputs]
            step.int_outs = not all(d.is_floating_point for _, d in step.out_meta)
            step.nsaved, step.no_stats = info.saved, [None] * info.saved
            step.saved_outputs = info.saved_outputs
            step.sizes = tuple(tuple(graph.sizes(n, symvals)) for n in info.nodes)
            step.nbytes = sum(_nbytes(graph.sizes(v, symvals), plan.nodes[v]["dtype"]) for v in info.outputs)
            step.pure = all(i in pure for i in step.ins) and (info.kind != "EXTERN" or plan.deterministic(info))
            step.fresh_outs = info.kind != "EXTERN" or plan.fresh_outputs(info)
            if info.kind == "EXTERN":
                step.kind = EAGER
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
            step.made = [slot[v] for v in info.outputs]
            if step.pure:
                pure.update(step.made)
            steps.append(step)
        for v in graph.outputs:
            ensure(v)
        outputs = [slot[v] for v in graph.outputs]
        release_after_last_use(steps, outputs)
        return Bound(symvals, steps, outputs)

    def _hoist(self, info, slot, pure, materialize, symvals, step) -> list:
        """EXTERN region `info`'s IR nodes computed from pure slots alone (not its extern calls,
        nor views alone: those cost nothing) as a MATERIALIZE step of their own, made by
        materialize(); `step` (the region's) then evaluates the rest, reading them. A node an
        earlier step made already (work floated into two regions) is read from its slot. Returns
        the values the region's step reads."""
        nodes = self.plan.nodes
        inside = [n for n in info.nodes if n not in slot]
        hoistable = set()
        for n in inside:
            if nodes[n]["op"] != "extern" and all(u in hoistable if u not in slot else slot[u] in pure
                                                  for u in nodes[n]["inputs"]):
                hoistable.add(n)
        # from the outputs back: what the region computes itself, and the hoisted work it reads
        rest, need, stack = set(), set(), list(info.outputs)
        while stack:
            n = stack.pop()
            if n in slot or n in rest or n in need:
                continue
            (need if n in hoistable else rest).add(n)
            stack.extend(nodes[n]["inputs"])
        made = [n for n in inside if n in need and (n in info.outputs or any(
            n in nodes[r]["inputs"] for r in rest))]
        if any(nodes[n]["op"] not in VIEW_OPS for n in need):
            materialize([n for n in inside if n in need], made)
        else:   # views alone: the region computes them itself
            rest |= need
        if len(rest) == len(info.nodes):
            return list(info.inputs)
        rest = [n for n in info.nodes if n in rest]
        ins = sorted({u for n in rest for u in nodes[n]["inputs"] if u in slot})
        graph, plan, outputs = self.plan.graph, self.plan, list(info.outputs)

        def run(values):
            out = torch_eval.evaluate(graph, plan, dict(zip(ins, values)), symvals, nodes=rest, device=plan.device)
            return [out[v] for v in outputs]
        step.launch = run
        return ins

    def _materializer(self, deps, nodes, symvals, made=None):
        plan = self.plan
        made = nodes if made is None else made

        def materialize(inputs):
            out = torch_eval.evaluate(plan.graph, plan, dict(zip(deps, inputs)), symvals, nodes=nodes,
                                      device=plan.device)
            return [out.get(n) for n in made]
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


def _nbytes(sizes, dtype) -> int:
    n = torch_dtype(dtype).itemsize
    for d in sizes:
        n *= d
    return n


class Step:
    """One region (or one materialization of in-between values) bound to sizes: which slots it
    reads, and how to run it, decided once per input signature instead of once per call."""

    __slots__ = ("kind", "r", "ins", "launch", "launch_nograd", "program", "symvals", "float_in", "int_outs",
                 "out_meta", "nsaved", "no_stats", "saved_outputs", "owner", "backward", "fast", "release",
                 "made", "pure", "sizes", "cache", "views", "nbytes", "fresh_outs")

    def __init__(self):
        # launch: a KERNEL's launcher, a MATERIALIZE's torch evaluation, or an EAGER region's
        # evaluation where part of it was hoisted (None: the whole region, Plan.eager_region)
        self.launch = self.launch_nograd = self.fast = None
        self.pure = False    # its values depend on parameters, buffers and constants alone
        self.sizes = ()      # the sizes of every value it computes (what its values depend on)
        self.cache = -1      # its index among the parameter cache's values (param_cache.py), -1: none
        self.views = False   # a MATERIALIZE of views alone (it moves no data)
        self.nbytes = 0      # the bytes of its values
        self.fresh_outs = False   # its outputs are new tensors, never views of its inputs

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

    def run_pure(self, inputs):
        """The step's values for the parameter cache, whatever its kind: no autograd (the caller's
        no_grad), statistics left out where the kernel may."""
        if self.kind == MATERIALIZE:
            return self.launch(inputs)
        return self.run(inputs)


def release_after_last_use(steps, outputs) -> None:
    """step.release: the slots no later step reads and no output is, dropped once the step has
    run, so that a call holds only live values (an inference call otherwise keeps every
    intermediate to the end; autograd keeps what a backward needs on its own)."""
    last = {}
    for k, step in enumerate(steps):
        for i in step.made:     # a value nothing reads (a statistic only a backward wants) goes
            last[i] = k         # right after the step that made it
        for i in step.ins:
            last[i] = k
    keep = set(outputs)
    for step in steps:
        step.release = []
    for i, k in last.items():
        if i not in keep:
            steps[k].release.append(i)


class Bound:
    """A program bound to one set of sizes: its steps over a flat list of value slots (graph
    inputs first, then each step's outputs in order) and which slots are the graph outputs."""

    __slots__ = ("symvals", "steps", "outputs", "cache")

    def __init__(self, symvals, steps, outputs):
        self.symvals, self.steps, self.outputs = symvals, steps, outputs
        self.cache = None    # its parameter cache (param_cache.BoundCache), where it has one

    def run(self, slots: list) -> list:
        """Run every step without autograd wrapping (backward programs, checks)."""
        for step in self.steps:
            ins = [slots[i] for i in step.ins]
            if step.kind == MATERIALIZE:
                slots.extend(step.launch(ins))
            else:
                slots.extend(step.run(ins))
            for i in step.release:
                slots[i] = None
        return [slots[i] for i in self.outputs]


