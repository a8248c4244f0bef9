"""A Captured as data, for the capture cache (capture/cache.py): JSON in which every value is a
plain datum (None, bool, int, float, str, list) or a tagged one from a closed list — tuples and
dicts, dtypes, devices, layouts and memory formats by name, torch operators by qualified name
looked up in torch.ops, a few builtin functions by name from an allow-list, size expressions as
trees of allow-listed sympy classes, constant tensors as raw bytes — and the graph as its node
list, rebuilt through the IR builder, which checks every node again, then checked against its own
fields. Loading imports nothing and calls nothing the data names but torch operators (none that
names a file), those allow-listed classes and functions, and output classes this process has
registered with torch's pytree: a planted entry can fail to load, never run code."""
from __future__ import annotations

import base64
import collections
import contextlib
import dataclasses
import gc
import importlib
import json
import math
import operator
import re

import sympy
import torch
import torch.utils._pytree as pytree
import torch.utils._sympy.functions as sympy_functions

from .. import _C
from .types import Captured, DeviceSlot, Extern, NodeCall, OutputTree, StepRef, SymExpr, TensorSlot

MAGIC = b"kbench-capture-json-1\n"


class NotData(ValueError):
    """The capture holds something the data format has no tag for (dumps: the capture is not
    kept), or a stored entry is not what dumps writes (loads: the entry is not used)."""


# ------------------------------------------------------------------------------ allow-lists

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

# builtins an exported graph calls on sizes (operator.getitem on a multi-output op, sym arithmetic);
# nothing that reaches attributes or calls what it is given (attrgetter, methodcaller, call)
_OPERATOR = ("getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "eq",
             "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert", "lshift", "rshift", "truth")
_MATH = ("ceil", "floor", "trunc", "sqrt", "exp", "log", "log2", "cos", "sin", "tan", "tanh")
_TORCH_FNS = ("sym_max", "sym_min", "sym_float", "sym_int", "sym_not", "sym_ite", "sym_sum", "_sym_sqrt")
FUNCTIONS = {f"{mod.__name__}.{name}": getattr(mod, name)
             for mod, names in ((operator, _OPERATOR), (math, _MATH), (torch, _TORCH_FNS))
             for name in names if hasattr(mod, name)}
_FUNCTION_NAMES = {id(f): name for name, f in FUNCTIONS.items()}

# the sympy classes a size expression or guard is made of: sympy's own arithmetic, logic and
# relations, and torch's size functions (FloorDiv, ModularIndexing, ...), each by its own name
_SYMPY = {f"sympy.{c.__name__}": c for c in (
    sympy.Add, sympy.Mul, sympy.Pow, sympy.Mod, sympy.floor, sympy.ceiling, sympy.Abs, sympy.Max, sympy.Min,
    sympy.Eq, sympy.Ne, sympy.Lt, sympy.Le, sympy.Gt, sympy.Ge, sympy.And, sympy.Or, sympy.Not)}
_SYMPY.update({f"torch.{name}": c for name, c in vars(sympy_functions).items()
               if isinstance(c, type) and issubclass(c, sympy.Basic) and c.__module__ == sympy_functions.__name__})
_SYMPY_NAMES = {c: name for name, c in _SYMPY.items()}
# the assumption names sympy knows (integer, positive, ...): a symbol is rebuilt with these only
_ASSUMPTIONS = frozenset(importlib.import_module("sympy.core.assumptions")._assume_defined)

_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_LAYOUTS = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_FORMATS = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.memory_format)}
_SPEC_TYPES = {"tuple": tuple, "list": list, "dict": dict, "OrderedDict": collections.OrderedDict}
_SPEC_NAMES = {t: n for n, t in _SPEC_TYPES.items()}
_LISTS = (list, torch.fx.immutable_collections.immutable_list)
_DICTS = (dict, torch.fx.immutable_collections.immutable_dict)


# ------------------------------------------------------------------------------------ writing

def dumps(captured) -> bytes:
    """MAGIC, then the capture as JSON; NotData for anything without a tag."""
    g = captured.graph
    state = {"symbols": [[name, example] for name, example in g.symbols],
             "nodes": [_enc(g.node(i)) for i in range(g.num_nodes)], "outputs": list(g.outputs),
             "fields": {f.name: _enc(getattr(captured, f.name)) for f in dataclasses.fields(Captured)
                        if f.name != "graph"}}
    return MAGIC + json.dumps(state, separators=(",", ":"), allow_nan=False).encode()


def _enc(v):
    if v is None or isinstance(v, (bool, str)):
        return v
    if type(v) is int:
        return v
    if type(v) is float:
        return v if math.isfinite(v) else {"$": "float", "v": repr(v)}
    if type(v) in _LISTS:
        return [_enc(x) for x in v]
    if type(v) is tuple:
        return {"$": "tuple", "v": [_enc(x) for x in v]}
    if type(v) is torch.Size:
        return {"$": "size", "v": [int(x) for x in v]}
    if type(v) in _DICTS:
        return {"$": "dict", "v": [[_enc(k), _enc(x)] for k, x in v.items()]}
    if isinstance(v, torch.dtype):
        return {"$": "dtype", "v": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"$": "device", "v": str(v)}
    if isinstance(v, torch.layout):
        return {"$": "layout", "v": str(v).removeprefix("torch.")}
    if isinstance(v, torch.memory_format):
        return {"$": "memory_format", "v": str(v).removeprefix("torch.")}
    if type(v) is slice:
        return {"$": "slice", "v": [_enc(v.start), _enc(v.stop), _enc(v.step)]}
    if v is Ellipsis:
        return {"$": "ellipsis"}
    if type(v) is complex:
        return {"$": "complex", "v": [_enc(v.real), _enc(v.imag)]}
    if isinstance(v, TensorSlot):
        return {"$": "slot", "v": v.k}
    if isinstance(v, StepRef):
        return {"$": "step", "v": v.j}
    if isinstance(v, DeviceSlot):
        return {"$": "device_slot", "v": _enc(v.captured)}
    if isinstance(v, SymExpr):
        return {"$": "symexpr", "e": _enc_sympy(v.expr), "syms": [[_enc_sympy(s), i] for s, i in v.syms.items()]}
    if isinstance(v, Extern):
        return {"$": "extern", "name": v.name, "noperands": v.noperands, "autocast": _enc(v.autocast),
                "steps": [[_enc_callable(fn), _enc(args), _enc(kwargs)] for fn, args, kwargs in v.steps]}
    if isinstance(v, NodeCall):
        return {"$": "node_call", "name": v.name, "op": v.op, "call": _enc(v.call), "operands": _enc(v.operands),
                "results": _enc(v.results)}
    if isinstance(v, OutputTree):
        return {"$": "output_tree", "spec": _enc_spec(v.spec), "leaves": _enc(v.leaves)}
    if type(v) in (torch.Tensor, torch.nn.Parameter):
        return _enc_tensor(v)
    if callable(v):
        return _enc_callable(v)
    raise NotData(f"a {type(v).__module__}.{type(v).__qualname__} value")


def _enc_callable(fn):
    if isinstance(fn, torch._ops.OpOverload):
        ns, name = fn._schema.name.split("::")
        _check_op(fn, [fn._schema])
        return {"$": "op", "v": [ns, name, fn._overloadname]}
    if isinstance(fn, torch._ops.OpOverloadPacket):
        ns, name = fn._qualified_op_name.split("::")
        _check_op(fn, torch._C._jit_get_schemas_for_operator(fn._qualified_op_name))
        return {"$": "op_packet", "v": [ns, name]}
    if isinstance(fn, torch._ops.HigherOrderOperator):
        return {"$": "hop", "v": fn.name()}
    name = _FUNCTION_NAMES.get(id(fn))
    if name is not None and FUNCTIONS[name] is fn:
        return {"$": "fn", "v": name}
    raise NotData(f"the callable {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}")


def _check_op(op, schemas) -> None:
    """No operator that reads or writes a file by name (aten::save, aten::from_file): a capture
    never holds one, and a stored one must not be able to name a file of the user's."""
    for schema in schemas:
        if schema.name.startswith("debugprims::") or any(
                str(a.type) in ("str", "str?") and ("file" in a.name or "path" in a.name) for a in schema.arguments):
            raise NotData(f"the operator {op}, which names a file")


def _enc_tensor(t):
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta" or t.dtype not in _DTYPES.values() \
            or t.dtype.is_complex:
        raise NotData(f"a {t.dtype} {t.layout} tensor on {t.device}")
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return {"$": "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "device": str(t.device), "param": type(t) is torch.nn.Parameter, "requires_grad": t.requires_grad,
            "data": base64.b64encode(data).decode()}


def _enc_sympy(e):
    if e is sympy.true or e is sympy.false:
        return [str(bool(e)).lower()]
    if isinstance(e, sympy.Integer):
        return ["Integer", int(e)]
    if isinstance(e, sympy.Rational):
        return ["Rational", int(e.p), int(e.q)]
    if isinstance(e, sympy.Float):
        return ["Float", repr(float(e))]
    if type(e) is sympy.Symbol:
        return ["Symbol", e.name, {k: v for k, v in e.assumptions0.items() if isinstance(v, bool)}]
    name = _SYMPY_NAMES.get(type(e))
    if name is None:
        raise NotData(f"the size expression {type(e).__name__}")
    return [name, *(_enc_sympy(a) for a in e.args)]


def _enc_spec(spec):
    if spec is None:
        return None
    if spec.is_leaf():
        return {"$": "leaf"}
    name = _SPEC_NAMES.get(spec.type)
    if name is None:
        # a class registered with torch's pytree under a serialized name (Hugging Face's
        # ModelOutput classes are): looked up again in that registry, in the loading process,
        # which imports nothing. A namedtuple or a class without one is not stored.
        node = pytree.SUPPORTED_SERIALIZED_TYPES.get(spec.type)
        registered = getattr(node, "serialized_type_name", None)
        if not isinstance(registered, str) or pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(registered) is not spec.type:
            raise NotData(f"an output of type {getattr(spec.type, '__qualname__', spec.type)}")
        name = "registered:" + registered
    return {"$": "spec", "type": name, "context": _enc(spec.context),
            "children": [_enc_spec(c) for c in spec.children()]}


# ------------------------------------------------------------------------------------ reading

def loads(blob: bytes):
    """The Captured that dumps() wrote; NotData (or the builder's ValueError) when blob is
    anything else."""
    with _collector_paused():
        return _loads(blob)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while a capture is decoded: the JSON tree is alive
    until the capture is built from it, so each young collection on the way promotes its
    containers, until their number sets off a full collection of the whole process (torch's
    and the model's objects: 0.4-0.5 s, every other warm optimize() of a 12-layer GPT-2 on the
    CPU). The tree holds no cycles; reference counting frees it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _loads(blob: bytes):
    if not blob.startswith(MAGIC):
        raise NotData("not a stored capture of this format (an older kbench's entry, or not kbench's)")
    state = json.loads(blob[len(MAGIC):].decode(), parse_constant=_no_constant)
    if not isinstance(state, dict) or set(state) != {"symbols", "nodes", "outputs", "fields"}:
        raise NotData("a stored capture without its parts")
    g = _C.Graph()
    for name, example in _list(state["symbols"]):
        g.add_symbol(_str(name), _int(example))
    for i, raw in enumerate(_list(state["nodes"])):
        n = _dec(raw)
        if not isinstance(n, dict):
            raise NotData(f"stored node {i} is not a node")
        if n["op"] == "input":
            got = g.add_input(n["name"], n["input_kind"], n["dtype"], n["dims"])
        else:
            got = g.add_node(n["op"], n["inputs"], n["dtype"], n["dims"], scalars=tuple(n["scalars"]),
                             axes=n["axes"], perm=n["perm"] or None, axis=n["axis"], start=n["start"],
                             step=n["step"], index=n["index"], name=n["name"], nograd=n["nograd"])
        if got != i:
            raise NotData(f"stored node {i} rebuilt as {got}")
    for v in _list(state["outputs"]):
        g.add_output(_int(v))
    names = {f.name for f in dataclasses.fields(Captured)} - {"graph"}
    fields = state["fields"]
    if not isinstance(fields, dict) or not set(fields) <= names:
        raise NotData(f"stored fields {sorted(fields) if isinstance(fields, dict) else fields!r}")
    captured = Captured(graph=g, **{k: _dec(v) for k, v in fields.items()})
    _check(captured)
    return captured


def _no_constant(name):
    raise NotData(f"a bare {name} in a stored capture")


def _list(v) -> list:
    if not isinstance(v, list):
        raise NotData(f"expected a list, got {type(v).__name__}")
    return v


def _int(v) -> int:
    if type(v) is not int:
        raise NotData(f"expected an int, got {type(v).__name__}")
    return v


def _str(v) -> str:
    if not isinstance(v, str):
        raise NotData(f"expected a str, got {type(v).__name__}")
    return v


def _dec(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_dec(x) for x in v]
    if not isinstance(v, dict) or not isinstance(v.get("$"), str):
        raise NotData("an untagged object")
    tag = v["$"]
    dec = _DECODERS.get(tag)
    if dec is None:
        raise NotData(f"unknown tag {tag!r}")
    return dec(v)


def _named(table: dict, what: str):
    def dec(v):
        name = v.get("v")
        if not isinstance(name, str) or name not in table:
            raise NotData(f"unknown {what} {name!r}")
        return table[name]
    return dec


def _dec_float(v):
    if v.get("v") not in ("nan", "inf", "-inf"):
        raise NotData(f"bad float {v.get('v')!r}")
    return float(v["v"])


def _dec_pairs(v):
    out = {}
    for pair in _list(v.get("v")):
        if not isinstance(pair, list) or len(pair) != 2:
            raise NotData("a dict entry that is not a pair")
        out[_dec(pair[0])] = _dec(pair[1])
    return out


def _dec_device(v):
    d = torch.device(_str(v.get("v")))
    return d


def _dec_op(v):
    parts = _list(v.get("v"))
    if len(parts) != (3 if v["$"] == "op" else 2) or not all(isinstance(p, str) and _IDENT.match(p) for p in parts):
        raise NotData(f"bad operator name {parts!r}")
    ns = getattr(torch.ops, parts[0], None)
    if not isinstance(ns, torch._ops._OpNamespace):
        raise NotData(f"no operator namespace {parts[0]!r}")
    try:   # torch.ops.<ns>.<op> finds registered operators only: it imports nothing
        packet = getattr(ns, parts[1])
        op = packet if len(parts) == 2 else getattr(packet, parts[2])
    except (AttributeError, RuntimeError) as e:
        raise NotData(f"no operator {'.'.join(parts)}") from e
    want = torch._ops.OpOverloadPacket if len(parts) == 2 else torch._ops.OpOverload
    if not isinstance(op, want):
        raise NotData(f"{'.'.join(parts)} is not an operator")
    _enc_callable(op)   # the same rules as for storing it
    return op


def _dec_hop(v):
    name = _str(v.get("v"))
    hop = torch._ops._higher_order_ops.get(name) if _IDENT.match(name) else None
    if not isinstance(hop, torch._ops.HigherOrderOperator):
        raise NotData(f"no higher-order operator {name!r}")
    return hop


def _dec_tensor(v):
    dtype = _DTYPES.get(v.get("dtype"))
    shape = [_int(s) for s in _list(v.get("shape"))]
    if dtype is None or dtype.is_complex or any(s < 0 for s in shape):
        raise NotData(f"a stored tensor of dtype {v.get('dtype')!r}, shape {shape}")
    data = base64.b64decode(_str(v.get("data")), validate=True)
    numel = math.prod(shape)
    if len(data) != numel * dtype.itemsize:
        raise NotData(f"a stored tensor of {len(data)} bytes for {numel} {dtype} elements")
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    t = t.view(dtype).reshape(shape).clone().to(_dec_device({"v": v.get("device")}))   # clone: aligned
    if v.get("param") is True:
        return torch.nn.Parameter(t, requires_grad=v.get("requires_grad") is True)
    return t.requires_grad_(v.get("requires_grad") is True) if t.is_floating_point() else t


def _dec_sympy(node):
    node = _list(node)
    if not node or not isinstance(node[0], str):
        raise NotData("an empty size expression")
    kind, args = node[0], node[1:]
    if kind in ("true", "false") and not args:
        return sympy.true if kind == "true" else sympy.false
    if kind == "Integer" and len(args) == 1:
        if not -2 ** 63 <= _int(args[0]) < 2 ** 63:   # sizes are int64: a larger one is not a size
            raise NotData("an integer beyond int64 in a size expression")
        return sympy.Integer(args[0])
    if kind == "Rational" and len(args) == 2:
        return sympy.Rational(_int(args[0]), _int(args[1]))
    if kind == "Float" and len(args) == 1:
        return sympy.Float(float(_str(args[0])))
    if kind == "Symbol" and len(args) == 2 and isinstance(args[1], dict):
        assumptions = args[1]
        if not set(assumptions) <= _ASSUMPTIONS or not all(isinstance(x, bool) for x in assumptions.values()):
            raise NotData(f"symbol assumptions {sorted(assumptions)}")
        return sympy.Symbol(_str(args[0]), **assumptions)
    cls = _SYMPY.get(kind)
    if cls is None:
        raise NotData(f"the size expression {kind!r}")
    parts = [_dec_sympy(a) for a in args]
    if "Pow" in kind and len(parts) == 2 and parts[1].is_number and not abs(parts[1]) <= 64:
        raise NotData("a power beyond 64 in a size expression")   # evaluating it would not end
    return cls(*parts)


def _dec_symexpr(v):
    expr = _dec_sympy(v.get("e"))
    syms = {}
    for pair in _list(v.get("syms")):
        if not isinstance(pair, list) or len(pair) != 2:
            raise NotData("a symbol binding that is not a pair")
        s = _dec_sympy(pair[0])
        if not isinstance(s, sympy.Symbol):
            raise NotData("a symbol binding without a symbol")
        syms[s] = _int(pair[1])
    return SymExpr(expr, syms)


def _dec_callable(v):
    if not isinstance(v, dict) or v.get("$") not in ("op", "op_packet", "hop", "fn"):
        raise NotData("a step that calls something other than an operator")
    return _dec(v)


def _dec_extern(v):
    steps = []
    for step in _list(v.get("steps")):
        if not isinstance(step, list) or len(step) != 3:
            raise NotData("an extern step that is not (callable, args, kwargs)")
        args, kwargs = _dec(step[1]), _dec(step[2])
        if not isinstance(args, tuple) or not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise NotData("an extern step's arguments")
        steps.append((_dec_callable(step[0]), args, kwargs))
    if not steps:
        raise NotData("an extern without steps")
    return Extern(steps, _str(v.get("name")), _int(v.get("noperands")), _dec_autocast(v.get("autocast")))


def _strings(x, depth=0) -> bool:
    """A string, or tuples of them (a Python-state description, capture/guards.py)."""
    return isinstance(x, str) or (isinstance(x, tuple) and depth < 8 and all(_strings(y, depth + 1) for y in x))


def _dec_autocast(v):
    """An extern's autocast mode: None, or (device type, dtype, enabled, cache enabled)."""
    mode = _dec(v) if v is not None else None
    if mode is None:
        return None
    if not (isinstance(mode, tuple) and len(mode) == 4 and mode[0] in ("cuda", "cpu")
            and isinstance(mode[1], torch.dtype) and all(type(b) is bool for b in mode[2:])):
        raise NotData("an extern's autocast mode")
    return mode


def _dec_node_call(v):
    call = _dec(v.get("call"))
    if not isinstance(call, Extern):
        raise NotData("a node call without its call")
    return NodeCall(name=_str(v.get("name")), op=_str(v.get("op")), call=call, operands=_list(_dec(v.get("operands"))),
                    results=_list(_dec(v.get("results"))))


def _dec_spec(v):
    if v is None:
        return None
    if not isinstance(v, dict):
        raise NotData("an output spec that is not one")
    if v.get("$") == "leaf":
        return pytree.tree_structure(0)
    name = v.get("type") if v.get("$") == "spec" else None
    typ = _SPEC_TYPES.get(name)
    if typ is None and isinstance(name, str) and name.startswith("registered:"):
        typ = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(name.removeprefix("registered:"))
        if typ not in pytree.SUPPORTED_NODES:
            typ = None
    if typ is None:
        raise NotData(f"an output spec of type {v.get('type')!r}")
    return pytree.TreeSpec(typ, _dec(v.get("context")), [_dec_spec(c) for c in _list(v.get("children"))])


_DECODERS = {
    "float": _dec_float,
    "tuple": lambda v: tuple(_dec(x) for x in _list(v.get("v"))),
    "size": lambda v: torch.Size([_int(x) for x in _list(v.get("v"))]),
    "dict": _dec_pairs,
    "dtype": _named(_DTYPES, "dtype"),
    "layout": _named(_LAYOUTS, "layout"),
    "memory_format": _named(_FORMATS, "memory format"),
    "device": _dec_device,
    "slice": lambda v: slice(*(_dec(x) for x in _list(v.get("v")))),
    "ellipsis": lambda v: Ellipsis,
    "complex": lambda v: complex(*(float(_dec(x)) for x in _list(v.get("v")))),
    "slot": lambda v: TensorSlot(_int(v.get("v"))),
    "step": lambda v: StepRef(_int(v.get("v"))),
    "device_slot": lambda v: DeviceSlot(_dec_device(v.get("v") or {})),
    "symexpr": _dec_symexpr,
    "extern": _dec_extern,
    "node_call": _dec_node_call,
    "output_tree": lambda v: OutputTree(_dec_spec(v.get("spec")), _list(_dec(v.get("leaves")))),
    "tensor": _dec_tensor,
    "op": _dec_op,
    "op_packet": _dec_op,
    "hop": _dec_hop,
    "fn": _named(FUNCTIONS, "function"),
}


# ----------------------------------------------------------------------------------- checking

def _check(c) -> None:
    """What the IR builder cannot see: the capture's fields agree with its graph, so a damaged
    entry fails here with a reason instead of somewhere in the runtime."""
    g = c.graph
    nin, nout, nsym, nnodes = len(g.inputs), len(g.outputs), len(g.symbols), g.num_nodes

    def need(cond, what):
        if not cond:
            raise NotData(f"stored capture: {what}")

    def is_int(x, lo, hi):
        return type(x) is int and lo <= x < hi

    for name in ("input_names", "input_syms", "param_names", "externs", "example_symvals", "input_kinds",
                 "mutations", "symbol_sources", "guards", "input_dtypes", "notes"):
        need(isinstance(getattr(c, name), list), f"{name} is not a list")
    for name in ("constants", "value_names", "origin", "calls", "kept"):
        need(isinstance(getattr(c, name), dict), f"{name} is not a dict")
    nuser = len(c.input_names)
    need(all(isinstance(n, str) for n in c.input_names + c.param_names), "input names")
    need(nuser + len(c.param_names) == nin and len(c.input_kinds) == nin, "inputs do not match the graph's")
    need(all(k in ("user", "param", "buffer", "const") for k in c.input_kinds), "input kinds")
    need(len(c.input_syms) == nuser and all(isinstance(s, list) and all(d is None or is_int(d, 0, nsym) for d in s)
                                            for s in c.input_syms), "input symbols")
    need(len(c.example_symvals) == nsym and all(type(v) is int for v in c.example_symvals), "example sizes")
    need(not c.input_dtypes or (len(c.input_dtypes) == nuser and all(isinstance(d, torch.dtype)
                                                                     for d in c.input_dtypes)), "input dtypes")
    need(c.device is None or isinstance(c.device, torch.device), "device")
    need(c.static_reason is None or isinstance(c.static_reason, str), "static reason")
    need(all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in c.constants.items()), "constants")
    need(all(kind != "const" or name in c.constants for kind, name in zip(c.input_kinds[nuser:], c.param_names)),
         "a constant input without its value")
    need(all(isinstance(e, Extern) for e in c.externs), "externs")
    for e in [*c.externs, *(nc.call for nc in c.calls.values() if isinstance(nc, NodeCall))]:
        need(_refs_ok(e), f"extern {e.name}: an argument refers past its operands or steps")
    for i in range(nnodes):
        n = g.node(i)
        if n["op"] == "extern":
            need(is_int(n["index"], 0, len(c.externs)), f"node {i} runs extern {n['index']}, of {len(c.externs)}")
    need(all(isinstance(s, SymExpr) for s in c.guards), "guards")
    need(all(isinstance(m, tuple) and len(m) == 3 and is_int(m[0], 0, nout) and m[1] in ("buffer", "param", "user")
             and isinstance(m[2], str) for m in c.mutations), "mutations")
    need(isinstance(c.output_tree, OutputTree) and isinstance(c.output_tree.leaves, list), "output tree")
    for leaf in c.output_tree.leaves:
        need(isinstance(leaf, tuple) and len(leaf) == 2 and leaf[0] in ("out", "value", "sym"), "an output leaf")
        need(leaf[0] != "out" or is_int(leaf[1], 0, nout), "an output leaf past the graph's outputs")
        need(leaf[0] != "sym" or isinstance(leaf[1], SymExpr), "a size output without its expression")
    spec = c.output_tree.spec
    need(spec is None or spec.num_leaves == len(c.output_tree.leaves), "output spec and leaves disagree")
    for d in (c.value_names, c.origin):
        need(all(is_int(k, 0, nnodes) and isinstance(v, str) for k, v in d.items()), "value names")
    for name, nc in c.calls.items():
        need(isinstance(nc, NodeCall) and nc.name == name, "node calls")
        need(all(isinstance(o, tuple) and len(o) == 3 and (o[0] is None or is_int(o[0], 0, nnodes))
                 for o in nc.operands) and len(nc.operands) == nc.call.noperands, f"node call {name}: operands")
        need(all(isinstance(r, tuple) and len(r) == 2 and is_int(r[1], 0, nnodes) for r in nc.results),
             f"node call {name}: results")
    need(all(isinstance(k, str) and isinstance(v, str) for k, v in c.kept.items()), "kept ops")
    need(all(isinstance(x, str) for x in c.notes + c.symbol_sources), "notes")
    need(isinstance(c.input_writes, dict) and all(
        isinstance(k, str) and isinstance(v, tuple) and len(v) == 2 and type(v[0]) is int and type(v[1]) is bool
        for k, v in c.input_writes.items()), "input writes")
    need(isinstance(c.python_state, tuple) and all(isinstance(d, tuple) and _strings(d) for d in c.python_state),
         "python state")


def _refs_ok(e) -> bool:
    """Every TensorSlot names one of e's operands and every StepRef an earlier step."""
    def ok(x, nsteps):
        if isinstance(x, TensorSlot):
            return type(x.k) is int and 0 <= x.k < e.noperands
        if isinstance(x, StepRef):
            return type(x.j) is int and 0 <= x.j < nsteps
        if isinstance(x, (list, tuple)):
            return all(ok(y, nsteps) for y in x)
        if isinstance(x, dict):
            return all(ok(y, nsteps) for y in x.values())
        return True
    return type(e.noperands) is int and e.noperands >= 0 and \
        all(ok(args, j) and ok(kwargs, j) for j, (_, args, kwargs) in enumerate(e.steps))
