"""The IR builder of capture: a Python-side list of IR nodes (CSE'd, shape-checked as csrc's IR
checks them), the walk over the FX graph that calls a lowering per ATen op (the table in ops.py,
handed in by lower.py), EXTERN calls for whatever has no lowering, and the emission of the live
nodes into a kbench._C.Graph (inputs first). Every IR value records the FX node whose lowering
made it (Builder.origin), and every lowered node its ATen call on IR values (Builder.node_calls):
the provenance that lets a region be timed, or kept, as the torch ops it came from.

Values in the walk's environment: V (an IR value), Multi (a multi-output op whose outputs are
made on first use), Sym (a size expression), plain Python values, or TorchSide (a value the IR
cannot carry, e.g. a complex tensor: computed inside the extern that first needs it)."""
from __future__ import annotations

import contextlib
import operator

import sympy
import torch
import torch.fx as fx
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from .. import _C
from ..dtypes import IR_TO_TORCH, TORCH_TO_IR
from ..errors import CaptureError
from .modes import autocast_mode
from .types import DeviceSlot, Extern, NodeCall, StepRef, SymExpr, TensorSlot

aten = torch.ops.aten

# Ops autocast runs in its lower-precision dtype, casting every float operand to it first (torch's
# autocast_mode.cpp, lower_precision_fp, on CUDA or CPU): an op counts where it is listed here, has
# an autocast kernel for the operands' device type, and its traced result has autocast's dtype.
_LOWER_PRECISION = {getattr(aten, name) for name in (
    "addmm", "addbmm", "baddbmm", "bmm", "mm", "matmul", "linear", "addmv", "addr", "mv", "conv1d", "conv2d",
    "conv3d", "convolution", "_convolution", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "prelu", "scaled_dot_product_attention") if hasattr(aten, name)}
_AUTOCAST_KEY = {"cuda": "AutocastCUDA", "cpu": "AutocastCPU"}


class NeedStatic(Exception):
    """A size the IR cannot write (s0 - 1, s0 // 2, ...): capture re-exports with the user-input
    dims it depends on fixed (`dims`: [(input, dim)]; empty: everything static)."""

    def __init__(self, msg, syms=()):
        super().__init__(msg)
        self.syms = set(syms)
        self.dims = []


class Unsupported(Exception):
    """This op (or this use of it) has no IR lowering: it becomes an EXTERN call."""


class V:
    """An IR value: id in the builder's node list, IR dtype name, dims (int or (coef, syms))."""
    __slots__ = ("id", "dtype", "dims")

    def __init__(self, id, dtype, dims):
        self.id, self.dtype, self.dims = id, dtype, dims

    @property
    def rank(self):
        return len(self.dims)

    def __repr__(self):
        return f"%{self.id}:{self.dtype}{list(self.dims)}"


class Sym:
    __slots__ = ("expr",)

    def __init__(self, expr):
        self.expr = expr


class TorchSide:
    __slots__ = ("node",)

    def __init__(self, node):
        self.node = node


_TORCH = object()   # Multi.get's answer for an output the IR cannot carry


class Multi:
    """Outputs of a multi-output op, made on first use: get(i) tries the native lowering and
    falls back to one EXTERN call of the whole op (shared by all its outputs)."""

    def __init__(self, b, node, native=None):
        self.b, self.node, self.native, self.cache = b, node, native, {}
        self._extern = None

    def get(self, i):
        if i not in self.cache:
            with self.b.lowering(self.node):   # made at a getitem's visit, but this node's values
                try:
                    if self.native is None:
                        raise Unsupported("no native lowering")
                    self.cache[i] = self.native(i)
                except Unsupported as e:
                    if self._extern is None:
                        self._extern = self.b.extern(self.node, str(e), multi=True)
                    self.cache[i] = self._extern.get(i)
        return self.cache[i]


class ExternOutputs:
    def __init__(self, b, idx, operands, val, node):
        self.b, self.idx, self.operands, self.val, self.node = b, idx, operands, val, node

    def get(self, i):
        t = self.val[i]
        if not isinstance(t, torch.Tensor):
            return t
        dims = self.b.rep_dims(t)
        if dims is None:
            return _TORCH
        with self.b.lowering(self.node):
            return self.b.add("extern", self.operands, TORCH_TO_IR[t.dtype], dims, index=self.idx,
                              axis=i, name=self.node.name)


def has_tensor(val):
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in val)


_SKIP = {aten._assert_tensor_metadata.default, aten._assert_scalar.default,
         aten.sym_constrain_range_for_size.default, aten.sym_constrain_range.default,
         aten._assert_async.msg}

_UNARY_ELEMENTWISE = ("unary", "binary", "ternary")


def _mono(dims):
    """Product of dims as (coef, sorted symbol tuple)."""
    coef, syms = 1, []
    for d in dims:
        if isinstance(d, int):
            coef *= d
        else:
            coef *= d[0]
            syms += d[1]
    return coef, tuple(sorted(syms))


def _no_larger(i, a):
    """Is size i at most size a for every value of the symbols (the IR's gather check)?"""
    ci, si = (i, ()) if isinstance(i, int) else i
    ca, sa = (a, ()) if isinstance(a, int) else a
    return tuple(si) == tuple(sa) and ci <= ca


def mono_dim(dims):
    """The product of dims as one dim, or None if it has too many symbols."""
    coef, syms = _mono(dims)
    if not syms:
        return coef
    return (coef, syms) if len(syms) <= 4 else None


class Builder:
    def __init__(self, table, sym_of, subst, example, keep=None, gemm=False):
        self.table = table            # ATen op -> lowering(builder, node, bound args) (ops.LOWER)
        self.gemm = gemm              # matrix products as MATMUL nodes (optimize(gemm=True)), else torch calls
        self.sym_of = sym_of          # sympy.Symbol -> symbol id
        self.subst = subst            # sympy.Symbol -> sympy.Symbol (unified sizes)
        self.example = example        # symbol values in the example
        self.nodes = []               # dict(op, inputs, dtype, dims, attrs, name, kind)
        self.cse = {}
        self.env = {}
        self.externs = []
        self.notes = []               # why each extern exists
        self.value_names = {}         # value id -> FX node name
        # FX node names to run as torch calls although they have a lowering, with why (lower's keep)
        self.keep = dict(keep) if isinstance(keep, dict) else dict.fromkeys(keep or (), "")
        self.current = None           # the FX node being lowered: the origin add() records
        self.origin = {}              # value id -> the FX node name whose lowering made it
        self.lowered = []             # (node, result) of each node lowered into IR, in graph order
        # size relations the IR relies on that export keeps only as its symbols' default range
        # (x[:, 1] needs the dim at 2 or more: export assumes every varying size is): sympy
        # relations over the unified symbols, kept with export's guards
        self.size_guards = []
        # the autocast the capture is made under (device type -> dtype; capture/modes.py): what an
        # extern's implicit casts are (autocast_operands)
        self.autocast = {d: dt for d, dt in autocast_mode()}
        self._from_params = {}

    def dim_expr(self, d):
        """A dim (int or (coef, sym ids)) as a sympy expression over the unified symbols."""
        if isinstance(d, int):
            return sympy.Integer(d)
        by_id = {i: s for s, i in self.sym_of.items()}
        return d[0] * sympy.Mul(*(by_id[s] for s in d[1]))

    def require_at_least(self, d, n) -> None:
        """Sizes where dim d is under n are outside what the graph computes (a slice's last read)."""
        if not isinstance(d, int) and n > 1:
            self.size_guards.append(sympy.Ge(self.dim_expr(d), n))

    @staticmethod
    def autocast_of(node):
        """The torch.autocast block a node came from (capture/export.py inlines such blocks and
        marks their nodes), or None."""
        return node.meta.get("kbench_autocast") if node is not None else None

    @contextlib.contextmanager
    def lowering(self, node):
        """Values added inside come from node (a multi-output op's outputs are made when a
        getitem asks for them, but they are the op's)."""
        prev, self.current = self.current, node
        try:
            yield
        finally:
            self.current = prev

    # ---------------------------------------------------------------- sizes

    def expr(self, s):
        e = s.node.expr if isinstance(s, torch.SymInt) else sympy.sympify(s)
        return e.xreplace(self.subst) if self.subst else e

    def dim(self, s):
        """int (pinned) or (coef, sorted sym ids); None if it uses an unknown (data-dependent)
        symbol; NeedStatic if it is an expression the IR cannot write."""
        if isinstance(s, int):
            return s
        e = self.expr(s)
        if e.is_Integer:
            return int(e)
        if any(x not in self.sym_of for x in e.free_symbols):
            return None
        coef, rest = e.as_coeff_Mul()
        if not coef.is_Integer or coef <= 0:
            raise NeedStatic(f"size {e}", e.free_symbols)
        syms = []
        for f in sympy.Mul.make_args(rest):
            if f.is_Symbol:
                syms.append(self.sym_of[f])
            elif f.is_Pow and f.base.is_Symbol and f.exp.is_Integer and f.exp > 0:
                syms += [self.sym_of[f.base]] * int(f.exp)
            else:
                raise NeedStatic(f"size {e}", e.free_symbols)
        if len(syms) > 4:
            raise NeedStatic(f"size {e} multiplies more than 4 symbols", e.free_symbols)
        return (int(coef), tuple(sorted(syms)))

    def rep_dims(self, t):
        """dims of a fake tensor if the IR can carry it, else None."""
        if t.dtype not in TORCH_TO_IR or t.dim() > 8:
            return None
        dims = tuple(self.dim(s) for s in t.shape)
        return None if any(d is None for d in dims) else dims

    # ---------------------------------------------------------------- nodes

    def add(self, op, inputs, dtype, dims, name="", **attrs):
        dims = tuple(dims)
        self.check(op, inputs, dims, attrs)
        key = None
        if op != "input":
            key = (op, tuple(v.id for v in inputs), dtype, dims, tuple(sorted(attrs.items())))
            hit = self.cse.get(key)
            if hit is not None:
                return hit
        self.nodes.append(dict(op=op, inputs=[v.id for v in inputs], dtype=dtype, dims=dims,
                               attrs=attrs, name=name))
        v = V(len(self.nodes) - 1, dtype, dims)
        if self.current is not None:   # a CSE hit keeps its first maker as origin
            self.origin[v.id] = self.current.name
        if key is not None:
            self.cse[key] = v
        return v

    def check(self, op, inputs, dims, attrs):
        """The builder checks of csrc/core/ir.c, early: a failure means "no lowering", not a crash."""
        if not _KIND:
            _load_kinds()
        kind = "reduce" if op in ("max", "min") and len(inputs) == 1 else _KIND.get(op)
        if len(dims) > 8:
            raise Unsupported("rank above 8")
        if kind in _UNARY_ELEMENTWISE:
            for v in inputs:
                if v.dims != dims:
                    raise Unsupported(f"{op}: operand {v} does not have the output's shape {dims}")
        elif op == "reshape":
            if _mono(inputs[0].dims) != _mono(dims):
                raise Unsupported(f"reshape {inputs[0].dims} -> {dims}: element counts differ "
                                  "symbolically")
        elif op == "expand":
            a = inputs[0].dims
            if len(a) != len(dims) or any(x != 1 and x != y for x, y in zip(a, dims)):
                raise Unsupported(f"expand {a} -> {dims}")
        elif op == "gather":
            if inputs[1].dims != dims or len(inputs[0].dims) != len(dims):
                raise Unsupported("gather: index and output shapes")
            for d, (i, a) in enumerate(zip(dims, inputs[0].dims)):
                if d != attrs.get("axis") and i != a and not _no_larger(i, a):
                    raise Unsupported(f"gather: the index may be larger than the operand on dim {d}")
        elif op == "matmul":
            a, b = inputs[0].dims, inputs[1].dims
            if len(a) < 2 or len(a) != len(b) or a[:-2] != b[:-2] or a[-1] != b[-2] or \
                    dims != a[:-1] + b[-1:] or inputs[0].dtype != inputs[1].dtype:
                raise Unsupported(f"matmul {a} . {b} -> {dims}")
        elif op == "extern" and len(inputs) > 16:
            raise Unsupported("more than 16 tensor operands")

    def const_value(self, v):
        n = self.nodes[v.id]
        return n["attrs"]["scalars"][0] if n["op"] == "const" else None

    def const(self, value, dtype, dims):
        if isinstance(value, (Sym, V)) or not isinstance(value, (int, float, bool)):
            raise Unsupported(f"non-constant scalar {value!r}")
        if dtype == "bool":
            value = 1.0 if value else 0.0
        elif dtype in ("i64", "i32"):
            value = float(int(value))
        return self.add("const", [], dtype, dims, scalars=(float(value), 0.0))

    def copy(self, v):
        """v written as a tensor of its own (a cast to its own dtype, which nothing folds away):
        where torch's op makes a fresh copy that a kernel should write, not a view of v."""
        return self.add("cast", [v], v.dtype, v.dims)

    def cast(self, v, dtype):
        if v.dtype == dtype:
            return v
        c = self.const_value(v)
        if c is not None:
            return self.const(c if dtype not in ("i64", "i32") else int(c), dtype, v.dims)
        return self.add("cast", [v], dtype, v.dims)

    def reshape(self, v, dims):
        dims = tuple(dims)
        if v.dims == dims:
            return v
        c = self.const_value(v)
        if c is not None and _mono(v.dims) == _mono(dims):
            return self.const(c, v.dtype, dims)
        return self.add("reshape", [v], v.dtype, dims)

    def bcast(self, v, dims):
        """Broadcast v to dims: reshape (prepend 1s) then expand."""
        dims = tuple(dims)
        if v.dims == dims:
            return v
        c = self.const_value(v)
        if c is not None:
            return self.const(c, v.dtype, dims)
        if v.rank > len(dims):
            raise Unsupported(f"cannot broadcast {v.dims} to {dims}")
        vd = (1,) * (len(dims) - v.rank) + v.dims
        for x, y in zip(vd, dims):
            if x != y and x != 1:
                raise Unsupported(f"cannot broadcast {v.dims} to {dims}")
        v = self.reshape(v, vd)
        return v if vd == dims else self.add("expand", [v], v.dtype, dims)

    def permute(self, v, perm):
        perm = tuple(int(p) % max(v.rank, 1) for p in perm)
        if perm == tuple(range(v.rank)):
            return v
        return self.add("permute", [v], v.dtype, tuple(v.dims[p] for p in perm), perm=perm)

    def reduce(self, op, v, axes, keepdim, nograd=False):
        """nograd: the value is a shift the result does not depend on (softmax's max), so
        autodiff sends no gradient through it."""
        axes = sorted({a % v.rank for a in axes}) if v.rank else []
        if not axes:
            return v
        mask = sum(1 << a for a in axes)
        dims = tuple(1 if i in axes else d for i, d in enumerate(v.dims)) if keepdim else \
            tuple(d for i, d in enumerate(v.dims) if i not in axes)
        if nograd:
            return self.add(op, [v], v.dtype, dims, axes=mask, nograd=True)
        return self.add(op, [v], v.dtype, dims, axes=mask)

    def unary(self, op, v, dtype=None, **attrs):
        dtype = dtype or v.dtype
        v = self.cast(v, dtype)
        return self.add(op, [v], dtype, v.dims, **attrs)

    def bshape(self, *dimss):
        rank = max((len(d) for d in dimss), default=0)
        out = []
        for i in range(rank):
            cand = {d[len(d) - rank + i] for d in dimss if len(d) - rank + i >= 0}
            non1 = cand - {1}
            if len(non1) > 1:
                raise Unsupported(f"cannot broadcast sizes {sorted(map(str, non1))}")
            out.append(non1.pop() if non1 else 1)
        return tuple(out)

    def promote(self, *xs):
        args = []
        for x in xs:
            if isinstance(x, V):
                args.append(torch.empty((1,) * min(x.rank, 1), dtype=IR_TO_TORCH[x.dtype], device="meta"))
            elif isinstance(x, (bool, int, float)):
                args.append(x)
            else:
                raise Unsupported(f"operand {x!r}")
        _, result = elementwise_dtypes(*args, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)
        if result not in TORCH_TO_IR:
            raise Unsupported(f"dtype {result}")
        return TORCH_TO_IR[result]

    def operand(self, x, dtype, dims):
        if isinstance(x, V):
            return self.bcast(self.cast(x, dtype), dims)
        return self.const(x, dtype, dims)

    def arith(self, op, a, b, cdt=None, dims=None):
        """Binary op with torch's type promotion and broadcasting; Python scalars become const
        nodes of the full shape. Comparisons return bool."""
        if cdt is None:
            cdt = "bool" if op in ("and", "or") else self.promote(a, b)
        if dims is None:
            dims = self.bshape(*(x.dims for x in (a, b) if isinstance(x, V)))
        out = "bool" if op in _CMP else cdt
        return self.add(op, [self.operand(a, cdt, dims), self.operand(b, cdt, dims)], out, dims)

    def where(self, c, a, b, dtype=None):
        dtype = dtype or self.promote(a, b)
        dims = self.bshape(*(x.dims for x in (c, a, b) if isinstance(x, V)))
        c = self.operand(c, "bool", dims)
        return self.add("where", [c, self.operand(a, dtype, dims), self.operand(b, dtype, dims)],
                        dtype, dims)

    def extern_call(self, fn, operands, args, kwargs, dtype, dims, name):
        """A one-step extern made by a lowering (linear without its bias, ...)."""
        return self.extern_steps([(fn, args, kwargs)], str(fn), operands, dtype, dims, name)

    def extern_steps(self, steps, label, operands, dtype, dims, name, why=""):
        """An extern made by a lowering, of one or more steps (TensorSlot k is operands[k], StepRef
        j the result of step j); `why`, where given, goes into the capture notes."""
        idx = len(self.externs)
        self.externs.append(Extern(steps, label, len(operands), self.autocast_of(self.current)))
        if why:
            self.notes.append(f"{name}: extern ({why})")
        return self.add("extern", operands, dtype, dims, index=idx, axis=0, name=name)

    # ---------------------------------------------------------------- autocast's casts

    def autocast_dtypes(self, node) -> dict:
        """{device type: IR dtype} that autocast casts node's float operands to, where node is an op
        autocast runs in its lower precision ({} where it is not): the capture's autocast, or the
        torch.autocast block the node came from, for the device types whose autocast kernel it has,
        and only where the traced result has that dtype (what export saw autocast do)."""
        if getattr(node.target, "overloadpacket", None) not in _LOWER_PRECISION:
            return {}
        modes = dict(self.autocast)
        block = self.autocast_of(node)
        if block is not None:
            device, dtype, enabled, _ = block
            modes[device] = dtype if enabled else None
        val = node.meta.get("val")
        out = {}
        for device, dtype in modes.items():
            key = _AUTOCAST_KEY.get(device)
            if dtype is None or key is None or dtype not in TORCH_TO_IR or not isinstance(val, torch.Tensor) \
                    or val.dtype != dtype:
                continue
            if torch._C._dispatch_has_kernel_for_dispatch_key(node.target.name(), key):
                out[device] = TORCH_TO_IR[dtype]
        return out

    def from_params(self, v) -> bool:
        """v is computed from parameters, buffers and constants alone, in the IR (no extern)."""
        got = self._from_params.get(v.id)
        if got is None:
            n = self.nodes[v.id]
            if n["op"] == "input":
                got = n["attrs"]["kind"] != "user"
            else:
                got = n["op"] != "extern" and all(self.from_params(V(u, self.nodes[u]["dtype"], self.nodes[u]["dims"]))
                                                  for u in n["inputs"])
            self._from_params[v.id] = got
        return got

    def autocast_operand(self, v, device, casts):
        """v as the op reads it under autocast: cast in the IR, as autocast would cast it inside
        the call (an f32 weight or activation to bf16), so that the call finds it cast already
        and autocast leaves it. A cast of parameters alone is a value of its own, which the
        runtime computes once per parameter version (runtime/param_cache.py); a cast of an
        activation joins the kernel that makes it (a LayerNorm's region writes the bf16 operand
        of the product that follows, where torch would read the f32 output back to cast it)."""
        dtype = casts.get(device)
        if dtype is None or not isinstance(v, V) or v.dtype == dtype or v.dtype not in ("f32", "f16", "bf16"):
            return v
        return self.cast(v, dtype)

    # ---------------------------------------------------------------- externs

    def extern(self, node, reason, multi=False):
        """node as an EXTERN call; its torch-side inputs are recomputed inside (extra steps)."""
        devices = {}
        steps, operands = self.call_steps(node, devices)
        casts = self.autocast_dtypes(node)
        if casts:
            # only operands the op itself reads (not torch-side values recomputed from them first)
            early = {s.k for fn, a, k in steps[:-1] for s in flat_slots((a, k))}
            operands = [v if i in early else self.autocast_operand(v, devices.get(i), casts)
                        for i, v in enumerate(operands)]
        if len(operands) > 16:
            raise CaptureError(f"{node.name} ({node.target}) would be an extern call with "
                               f"{len(operands)} tensor operands; kbench supports 16")
        idx = len(self.externs)
        self.externs.append(Extern(steps, str(node.target), len(operands), self.autocast_of(node)))
        self.notes.append(f"{node.name}: extern {node.target} ({reason})")
        val = node.meta.get("val")
        outs = ExternOutputs(self, idx, operands, val if multi else [val], node)
        if multi:
            return outs
        r = outs.get(0)
        if r is _TORCH:
            raise CaptureError(f"internal: extern {node.name} has an output the IR cannot carry")
        return r

    def call_steps(self, node, devices=None):
        """node as torch calls on IR values: (steps, operands), the steps as Extern takes them
        (TensorSlot k is operands[k]; torch-side inputs recomputed as earlier steps). devices, a
        dict, gets each operand's device type (k -> "cuda")."""
        operands, slot_of, steps, step_of = [], {}, [], {}

        def tmpl(x):
            if isinstance(x, fx.Node):
                e = self.env.get(x)
                if isinstance(e, V):
                    if e.id not in slot_of:
                        slot_of[e.id] = len(operands)
                        operands.append(e)
                        val = x.meta.get("val")
                        if devices is not None and isinstance(val, torch.Tensor):
                            devices[slot_of[e.id]] = val.device.type
                    return TensorSlot(slot_of[e.id])
                if isinstance(e, Sym):
                    return SymExpr(e.expr, self.sym_of)
                if isinstance(e, (TorchSide, Multi, ExternOutputs)) or x.op == "call_function" and e is None:
                    return StepRef(step(x))
                return e
            if isinstance(x, (list, tuple)):
                return type(x)(tmpl(y) for y in x)
            if isinstance(x, dict):
                return {k: tmpl(y) for k, y in x.items()}
            if isinstance(x, torch.device):
                return DeviceSlot(x)
            return x

        def step(n):
            if n not in step_of:
                a, k = tmpl(tuple(n.args)), tmpl(dict(n.kwargs))
                steps.append((n.target, a, k))
                step_of[n] = len(steps) - 1
            return step_of[n]

        step(node)
        return steps, operands

    # ---------------------------------------------------------------- the walk

    def val(self, x):
        if isinstance(x, fx.Node):
            return self.env.get(x)
        if isinstance(x, (list, tuple)):
            return type(x)(self.val(y) for y in x)
        return x

    def bind(self, node):
        """The node's arguments by schema name (defaults filled), mapped to env values."""
        schema = node.target._schema
        out = {}
        for i, arg in enumerate(schema.arguments):
            if i < len(node.args) and not arg.kwarg_only:
                v = node.args[i]
            elif arg.name in node.kwargs:
                v = node.kwargs[arg.name]
            elif arg.has_default_value():
                v = arg.default_value
            else:
                v = None
            out[arg.name] = self.val(v)
        return out

    def non_tensor(self, node, val):
        if val is None or isinstance(val, (bool, int, float)):
            return val
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            e = self.expr(val)
            if e.is_number or e in (sympy.true, sympy.false):
                return bool(e) if e in (sympy.true, sympy.false) else (int(e) if e.is_integer else float(e))
            if all(x in self.sym_of for x in e.free_symbols):
                return Sym(e)
        return TorchSide(node)

    def visit(self, node):
        with self.lowering(node):
            self._visit(node)

    def _visit(self, node):
        tgt = node.target
        if tgt in _SKIP:
            return
        val = node.meta.get("val")
        if tgt is operator.getitem:
            base = self.env.get(node.args[0])
            if isinstance(base, (Multi, ExternOutputs)):
                r = base.get(node.args[1])
                self.env[node] = TorchSide(node) if r is _TORCH else r
                self._name(node)
                return
            if isinstance(base, (list, tuple)):
                self.env[node] = base[node.args[1]]
                return
        if not has_tensor(val):
            self.env[node] = self.non_tensor(node, val)
            return
        flat = [a for a in flat_nodes((node.args, node.kwargs))]
        torch_side = any(isinstance(self.env.get(a), TorchSide) for a in flat)
        if isinstance(val, torch.Tensor):
            # the IR cannot carry the result, or it is empty (a slice past the end: Phi-3's
            # rotary pass-through of width 0): stay lazy, its readers are torch's calls
            if self.rep_dims(val) is None or _empty(val):
                self.env[node] = TorchSide(node)
                return
        if torch_side and not getattr(self.table.get(tgt), "takes_torch_side", False):
            self.env[node] = self.extern(node, "uses a value the IR cannot carry",
                                         multi=not isinstance(val, torch.Tensor))
            return
        if node.name in self.keep:   # torch's one call, where the IR's decomposition lost to it
            why = self.keep[node.name]
            self.env[node] = self.extern(node, f"kept in torch{': ' + why if why else ''}",
                                         multi=not isinstance(val, torch.Tensor))
            self._name(node)
            return
        fn = self.table.get(tgt)
        try:
            if fn is None:
                raise Unsupported("no lowering")
            res = fn(self, node, self.bind(node))
            if isinstance(val, torch.Tensor):
                res = self.conform(node, val, res)
            self.lowered.append((node, res))
        except Unsupported as e:
            res = self.extern(node, str(e), multi=not isinstance(val, torch.Tensor))
        self.env[node] = res
        self._name(node)

    def _name(self, node):
        r = self.env.get(node)
        if isinstance(r, V) and r.id not in self.value_names:
            self.value_names[r.id] = node.name

    def conform(self, node, val, res):
        """A lowering's result must have the FX node's dtype and shape."""
        if not isinstance(res, V):
            raise Unsupported(f"lowering returned {type(res).__name__}")
        want_dims = self.rep_dims(val)
        want_dt = TORCH_TO_IR[val.dtype]
        if res.dtype != want_dt:
            self.notes.append(f"{node.name}: lowering gave {res.dtype}, cast to {want_dt}")
            res = self.cast(res, want_dt)
        if res.dims != want_dims:
            if _mono(res.dims) != _mono(want_dims):
                raise Unsupported(f"lowering gave shape {res.dims}, torch says {want_dims}")
            res = self.reshape(res, want_dims)
        return res

    def node_calls(self, idmap) -> dict:
        """FX node name -> NodeCall for every node lowered into IR, in graph order, over the
        emitted graph's value ids (idmap: builder id -> graph id)."""
        calls = {}
        for node, res in self.lowered:
            if isinstance(res, Multi):
                results = [(i, v) for i, v in sorted(res.cache.items()) if isinstance(v, V)]
            else:
                results = [(None, res)] if isinstance(res, V) else []
            try:
                steps, operands = self.call_steps(node)
            except Exception:  # noqa: BLE001 - only the eager timing of its region is lost
                continue
            calls[node.name] = NodeCall(
                name=node.name, op=str(node.target), call=Extern(steps, str(node.target), len(operands), self.autocast_of(node)),
                operands=[(idmap.get(v.id), v.dtype, v.dims) for v in operands],
                results=[(i, idmap[v.id]) for i, v in results if v.id in idmap])
        return calls

    def emit(self, outputs, keep, symbols):
        """The live nodes into a kbench._C.Graph: user inputs, other inputs, then the rest in
        creation order (which is topological). Returns (graph, old id -> new id, [(kind, name)])."""
        live, stack = set(), [v.id for v in outputs] + list(keep)
        while stack:
            i = stack.pop()
            if i not in live:
                live.add(i)
                stack += self.nodes[i]["inputs"]
        order = sorted(live)
        ins = [i for i in order if self.nodes[i]["op"] == "input"]
        user = [i for i in ins if self.nodes[i]["attrs"]["kind"] == "user"]
        other = [i for i in ins if self.nodes[i]["attrs"]["kind"] != "user"]
        g = _C.Graph()
        for name, ex in symbols:
            g.add_symbol(name, ex)
        m = {}
        for i in user + other:
            n = self.nodes[i]
            kind = n["attrs"]["kind"]
            m[i] = g.add_input(n["name"], "buffer" if kind == "const" else kind, n["dtype"], list(n["dims"]))
        for i in order:
            n = self.nodes[i]
            if n["op"] == "input":
                continue
            kw = dict(n["attrs"])
            if "perm" in kw:
                kw["perm"] = list(kw["perm"])
            name = n["name"] or self.value_names.get(i, "")
            try:
                m[i] = g.add_node(n["op"], [m[j] for j in n["inputs"]], n["dtype"], list(n["dims"]),
                                  name=name, **kw)
            except Exception as e:  # noqa: BLE001 - the Python checks should have caught it
                raise CaptureError(f"internal: the IR builder rejected {n['op']} {n['dims']} "
                                   f"({name}): {e}") from e
        for v in outputs:
            g.add_output(m[v.id])
        others = [(self.nodes[i]["attrs"]["kind"], self.nodes[i]["name"]) for i in other]
        return g, m, others


_CMP = {"lt", "le", "gt", "ge", "eq", "ne"}
_KIND = {}


def _load_kinds():
    for name, info in _C.ops().items():
        _KIND[name] = info["kind"]
    # "max"/"min" name both the binary op and the reduction; Builder.check tells them apart by
    # operand count.
    for r in ("max", "min"):
        _KIND[r] = "binary"


def flat_nodes(x):
    if isinstance(x, fx.Node):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from flat_nodes(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from flat_nodes(y)


def _empty(val) -> bool:
    """A tensor with a size fixed at 0."""
    return any(isinstance(d, int) and d == 0 for d in val.shape)


def flat_slots(x):
    """The TensorSlots in an extern step's arguments."""
    if isinstance(x, TensorSlot):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from flat_slots(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from flat_slots(y)
