"""The captured model as data: the graph (kbench._C.Graph) with everything the runtime needs to
run it — how to find each graph input (user input, live parameter or buffer, held constant), how
to bind the size symbols from actual inputs, the torch callables behind EXTERN nodes, and how to
rebuild the model's output structure.

Conventions (the runtime and the reference evaluator rely on them):
  graph inputs    user inputs first (all of them, in order), then the parameters, buffers and
                  lifted constants the graph reads, in export's order; names are module paths.
  symbols         "s0", "s1", ... in order of first appearance among the user inputs' dims;
                  input_syms[i][d] is the symbol that user input i's dim d binds (None: pinned).
  constants       a Python scalar becomes a "const" node of the full shape of its use.
  broadcasting    explicit: "reshape" (prepend 1s) then "expand" to the operand's shape.
  externs         EXTERN node: index = position in Captured.externs, axis = which output.
  output_tree     the model's outputs rebuilt from the graph outputs with torch's pytree spec.
  mutations       in-place updates of buffers / inputs are extra graph outputs the runtime
                  copies back (Captured.apply_mutations).
  provenance      origin[v]: the FX node graph value v came from; calls[name]: that node's ATen
                  call on graph values, for every node lowered into IR (what eager runs for it);
                  kept[name]: why a node the IR could decompose is an EXTERN call instead.
  python_state    what the forward read of Python state (attributes, submodules, globals) and
                  the capture specialized on: checked at every call (capture/guards.py).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Optional

import sympy
import torch
import torch.utils._pytree as pytree

# ---------------------------------------------------------------------------- extern calls


class TensorSlot:
    """Extern argument: the k-th operand tensor of the EXTERN node."""
    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k

    def __repr__(self):
        return f"TensorSlot({self.k})"


class StepRef:
    """Extern argument: the result of an earlier step of a multi-step extern."""
    __slots__ = ("j",)

    def __init__(self, j: int):
        self.j = j

    def __repr__(self):
        return f"StepRef({self.j})"


class DeviceSlot:
    """Extern argument: the device to run on (the operands' device, else the runtime's)."""
    __slots__ = ("captured",)

    def __init__(self, captured: torch.device):
        self.captured = captured

    def __repr__(self):
        return "DeviceSlot()"


class SymExpr:
    """A size expression over the graph's symbols (a sympy expression), evaluated from the bound
    symbol values; used where an extern's argument depends on a size (arange(T), x / T, ...)."""
    __slots__ = ("expr", "syms", "_cache")

    def __init__(self, expr, syms: dict):
        self.expr = expr
        self.syms = {s: i for s, i in syms.items() if s in expr.free_symbols}
        self._cache: dict = {}

    def __call__(self, symvals) -> Any:
        key = tuple(symvals[i] for i in self.syms.values())
        hit = self._cache.get(key)
        if hit is None:
            v = self.expr.xreplace({s: sympy.Integer(symvals[i]) for s, i in self.syms.items()})
            hit = int(v) if v.is_integer else (bool(v) if v.is_Boolean else float(v))
            self._cache[key] = hit
        return hit

    def __repr__(self):
        return f"SymExpr({self.expr})"


def _subst(tmpl, tensors, results, symvals, device):
    if isinstance(tmpl, TensorSlot):
        return tensors[tmpl.k]
    if isinstance(tmpl, StepRef):
        return results[tmpl.j]
    if isinstance(tmpl, SymExpr):
        return tmpl(symvals)
    if isinstance(tmpl, DeviceSlot):
        return device if device is not None else tmpl.captured
    if isinstance(tmpl, (list, tuple)) and not hasattr(tmpl, "_fields"):
        return type(tmpl)(_subst(t, tensors, results, symvals, device) for t in tmpl)
    if isinstance(tmpl, dict):
        return {k: _subst(t, tensors, results, symvals, device) for k, t in tmpl.items()}
    return tmpl


class Extern:
    """One torch computation the runtime runs between kernels. `steps` is a list of
    (callable, args, kwargs); the last step's result is the extern's result (a tensor, or a tuple
    the EXTERN node's axis indexes). Templates hold TensorSlot (the node's operands), StepRef,
    SymExpr and DeviceSlot placeholders. Most externs are one step: fn(*args, **kwargs).
    autocast: (device type, dtype, enabled, cache enabled) of a `torch.autocast` block inside the
    forward that the call came from (None: the call runs in the caller's autocast mode)."""
    __slots__ = ("steps", "name", "noperands", "autocast")

    def __init__(self, steps, name: str, noperands: int, autocast=None):
        self.steps = steps
        self.name = name
        self.noperands = noperands
        self.autocast = autocast

    @property
    def fn(self):
        return self.steps[-1][0]

    @property
    def args(self):
        return self.steps[-1][1]

    def __iter__(self):  # (callable, args-template), for one-step externs
        yield self.fn
        yield self.args

    def call(self, tensors, symvals=(), device=None):
        """Runs the extern on the operand tensors (in the EXTERN node's input order)."""
        if self.autocast is not None:
            device_type, dtype, enabled, cache = self.autocast
            with torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache):
                return self._call(tensors, symvals, device)
        return self._call(tensors, symvals, device)

    def _call(self, tensors, symvals, device):
        if device is None:
            device = next((t.device for t in tensors if isinstance(t, torch.Tensor)), None)
        results: list = []
        for fn, args, kwargs in self.steps:
            results.append(fn(*_subst(args, tensors, results, symvals, device),
                              **_subst(kwargs, tensors, results, symvals, device)))
        return results[-1]

    def __repr__(self):
        return f"Extern({self.name}, {len(self.steps)} step(s), {self.noperands} operand(s))"


@dataclasses.dataclass
class NodeCall:
    """One FX node lowered into IR, as eager PyTorch runs it: its ATen call (`call`, an Extern whose
    TensorSlot k is operands[k]) on graph values, and which graph values its results are. One
    aten.layer_norm, where the IR holds its mean, sub, mul, rsqrt...: the runtime runs these to
    time what eager really runs for a region (runtime/eager.py)."""
    name: str            # the FX node's name
    op: str              # its target, "aten.layer_norm.default"
    call: Extern
    operands: list       # per TensorSlot: (graph value id, or None where the graph dropped it; IR dtype; IR dims)
    results: list        # (output index, or None for a single tensor; graph value id)


# ---------------------------------------------------------------------------- the result


@dataclasses.dataclass
class OutputTree:
    """How to rebuild the model's outputs: torch's pytree spec over leaves that are ("out", i)
    (graph output i), ("value", v) (a constant such as None) or ("sym", SymExpr)."""
    spec: Any
    leaves: list

    def build(self, graph_outputs, symvals=(), fresh=False):
        """fresh: the graph outputs are tensors nothing else holds (a graph replay's copies), so
        an output container may keep them rather than a copy of them (_TakeFresh)."""
        leaf = self.__dict__.get("_one_out")
        if leaf is None:   # the common case, one tensor out: no pytree on the hot path
            leaf = self.__dict__["_one_out"] = (
                len(self.leaves) == 1 and self.leaves[0][0] == "out"
                and (self.spec is None or (hasattr(self.spec, "is_leaf") and self.spec.is_leaf())))
        if leaf:
            return graph_outputs[self.leaves[0][1]]
        vals = []
        for kind, x in self.leaves:
            vals.append(graph_outputs[x] if kind == "out" else x(symvals) if kind == "sym" else x)
        if self.spec is None:
            return vals[0] if len(vals) == 1 else tuple(vals)
        custom = self.__dict__.get("_custom")
        if custom is None:
            custom = self.__dict__["_custom"] = _custom_node(self.spec)
        if fresh and custom:
            with _TakeFresh(vals):
                return pytree.tree_unflatten(vals, self.spec)
        return pytree.tree_unflatten(vals, self.spec)


def _custom_node(spec) -> bool:
    """Does a pytree spec hold a container whose unflatten is code of its own (not a tuple, list,
    dict, named tuple or ordered dict)?"""
    if spec.is_leaf():
        return False
    if spec.type not in (tuple, list, dict, collections.OrderedDict) and \
            not (isinstance(spec.type, type) and issubclass(spec.type, tuple)):
        return True
    return any(_custom_node(c) for c in (spec.children() if hasattr(spec, "children") else spec.children_specs))


class _TakeFresh(torch.overrides.TorchFunctionMode):
    """While an output container is rebuilt from fresh tensors: a torch.cat of one of them onto
    nothing but empty tensors is that tensor, not a copy. Hugging Face's DynamicCache rebuilds
    itself by re-running its update, a cat onto an empty tensor per layer: copies of every key
    and value (24 for GPT-2, about as long as its attention kernels) that nothing needs, since
    no one else holds the tensor copied. A tensor two outputs share memory with is copied, as
    eager's cat copies it."""

    def __init__(self, vals):
        super().__init__()
        seen = {}
        for t in vals:
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                seen[ptr] = None if ptr in seen else t
        self.fresh = {id(t) for t in seen.values() if t is not None}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.cat and len(args) + len(kwargs) <= 2:
            only = self._alone(args[0] if args else kwargs.get("tensors", ()),
                               args[1] if len(args) > 1 else kwargs.get("dim", 0))
            if only is not None:
                self.fresh.discard(id(only))   # one container takes it
                return only
        return func(*args, **kwargs)

    def _alone(self, tensors, dim):
        """The one fresh tensor a cat joins to empty ones of its dtype and device, or None."""
        try:
            full = [t for t in tensors if not (t.dim() == 1 and t.numel() == 0) and t.shape[dim] != 0]
        except (AttributeError, IndexError, TypeError):
            return None
        if len(full) != 1 or id(full[0]) not in self.fresh or \
                any(t.dtype != full[0].dtype or t.device != full[0].device for t in tensors):
            return None
        return full[0]


@dataclasses.dataclass
class Captured:
    """A captured model. Graph inputs are the user inputs (input_names, in order) followed by
    param_names (input_kinds says "param", "buffer" or "const" for each: the first two are
    fetched from the live module by path, "const" from `constants`). Graph outputs are the
    model's tensor outputs (output_tree rebuilds its structure) then the in-place updates
    listed in `mutations`. EXTERN node i runs externs[node.index]."""
    graph: Any                      # kbench._C.Graph
    input_names: list               # user inputs (graph inputs 0..n-1)
    input_syms: list                # per user input, per dim: symbol id or None (pinned)
    param_names: list               # the other graph inputs, in order (module paths)
    externs: list                   # Extern per EXTERN index
    static_reason: Optional[str]    # None when sizes may vary
    output_tree: OutputTree
    example_symvals: list           # the symbols' values in the example
    input_kinds: list = dataclasses.field(default_factory=list)   # per graph input
    constants: dict = dataclasses.field(default_factory=dict)     # lifted constants, by name
    mutations: list = dataclasses.field(default_factory=list)     # (graph output, kind, name)
    symbol_sources: list = dataclasses.field(default_factory=list)  # torch's name per symbol
    guards: list = dataclasses.field(default_factory=list)        # SymExpr that must be true
    input_dtypes: list = dataclasses.field(default_factory=list)  # torch dtype per user input
    device: Optional[torch.device] = None
    notes: list = dataclasses.field(default_factory=list)         # why each extern exists
    value_names: dict = dataclasses.field(default_factory=dict)   # value id -> FX node name
    origin: dict = dataclasses.field(default_factory=dict)        # graph value id -> the FX node it came from
    calls: dict = dataclasses.field(default_factory=dict)         # FX node name -> NodeCall, graph order
    kept: dict = dataclasses.field(default_factory=dict)          # FX node name -> why it stays a torch call
    # user input name -> (in-place ops that write it, whether the first writes a view of it)
    input_writes: dict = dataclasses.field(default_factory=dict)
    python_state: tuple = ()        # the Python state the forward read (capture/guards.py descriptions)

    # -- helpers the runtime and the reference evaluator share

    def bind(self, user_inputs) -> list:
        """Symbol values for actual user inputs; ValueError when the shapes (or dtypes) do not
        fit the captured graph (the caller falls back to eager)."""
        user_inputs = as_tuple(user_inputs)
        if len(user_inputs) != len(self.input_names):
            raise ValueError(f"expected {len(self.input_names)} inputs, got {len(user_inputs)}")
        symvals = [None] * len(self.example_symvals)
        for i, (t, syms) in enumerate(zip(user_inputs, self.input_syms)):
            if not isinstance(t, torch.Tensor) or t.dim() != len(syms):
                raise ValueError(f"input {self.input_names[i]}: expected a tensor of rank {len(syms)}")
            if self.input_dtypes and t.dtype != self.input_dtypes[i]:
                raise ValueError(f"input {self.input_names[i]}: dtype {t.dtype}, captured with "
                                 f"{self.input_dtypes[i]}")
            for d, s in enumerate(syms):
                if s is not None:
                    if symvals[s] is None:
                        symvals[s] = int(t.shape[d])
                    elif symvals[s] != t.shape[d]:
                        raise ValueError(f"input {self.input_names[i]} dim {d} is {t.shape[d]}, "
                                         f"but {self.graph.symbols[s][0]} = {symvals[s]} elsewhere")
        if any(v is None for v in symvals):
            raise ValueError("a size symbol is bound by no input")
        for i, t in enumerate(user_inputs):
            want = tuple(self.graph.sizes(self.graph.inputs[i], symvals))
            if tuple(t.shape) != want:
                raise ValueError(f"input {self.input_names[i]}: shape {tuple(t.shape)}, "
                                 f"the graph needs {want}")
        for g in self.guards:
            if not g(symvals):
                raise ValueError(f"sizes {symvals} break the captured guard {g.expr}")
        return symvals

    def graph_inputs(self, model, user_inputs) -> list:
        """Tensors for every graph input: the user inputs, then the live module's parameters
        and buffers (so an optimized module shares them) and the held constants."""
        out = list(as_tuple(user_inputs))
        for kind, name in zip(self.input_kinds[len(out):], self.param_names):
            if kind == "param":
                out.append(model.get_parameter(name))
            elif kind == "buffer":
                out.append(model.get_buffer(name))
            else:
                out.append(self.constants[name])
        return out

    def build_outputs(self, graph_outputs, symvals=(), fresh=False):
        return self.output_tree.build(graph_outputs, symvals, fresh)

    def apply_mutations(self, model, user_inputs, graph_outputs, carries=None):
        """Copies in-place updates the model makes (BatchNorm running stats in training mode,
        user inputs changed in place) back into the live tensors, as eager would. A buffer's or
        parameter's update carries no gradient (BatchNorm's does not). A user input's is eager's
        in-place op on it: under grad mode the input's autograd history becomes the update's (a
        gradient through the input after the call reaches what the forward computed it from),
        and its version counter moves once per in-place op the forward makes on it. carries: the
        graph outputs whose update carries a gradient (None: wherever autograd says so)."""
        if not self.mutations:
            return
        user_inputs = as_tuple(user_inputs)
        for out, kind, name in self.mutations:
            src = graph_outputs[out]
            if kind != "user":
                with torch.no_grad():
                    (model.get_buffer(name) if kind == "buffer" else model.get_parameter(name)).copy_(src)
                continue
            dst = user_inputs[self.input_names.index(name)]
            writes = self.input_writes.get(name, (0, False))[0]
            # writes == 0: the forward writes it inside torch.no_grad() only
            if carries is not None and out not in carries:
                src = src.detach()
            with torch.no_grad() if writes == 0 else contextlib.nullcontext():
                dst.copy_(src)
            if not dst.is_inference():
                for _ in range(writes - 1):
                    torch.autograd.graph.increment_version(dst)


def as_tuple(x):
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)
