"""One lowering per ATen op: (builder, fx node, bound args) → IR value(s). Composites (layer_norm,
softmax, cross_entropy, batch/group norm, ...) are decomposed into the IR's primitives here
(docs/DESIGN.md, "The IR"); half-precision composites compute in f32 and cast back, as torch's
kernels do. A lowering raises Unsupported for a case it does not handle, and the op becomes an
EXTERN call instead; it never has to be complete."""
from __future__ import annotations

import math
import operator

import sympy
import torch

from ..dtypes import TORCH_TO_IR
from .builder import Builder, Multi, Sym, Unsupported, V, mono_dim
from .types import StepRef, TensorSlot

aten = torch.ops.aten
LOWER = {}


def _reg(*names):
    def deco(fn):
        for name in names:
            packet, _, overload = name.partition(".")
            op = getattr(getattr(aten, packet, None), overload or "default", None)
            if op is not None:
                LOWER[op] = fn
        return fn
    return deco


def _out(node):
    v = node.meta["val"]
    return TORCH_TO_IR[v.dtype]


def _odims(b: Builder, node):
    return b.rep_dims(node.meta["val"])


def _opmath(dt):
    return "f32" if dt in ("f16", "bf16") else dt


def _num(x):
    """A Python number argument (a symbolic one makes the op an extern)."""
    if isinstance(x, Sym) or isinstance(x, V):
        raise Unsupported("scalar argument is not a constant")
    if isinstance(x, torch.Tensor):
        raise Unsupported("tensor held by value")
    return x


def _t(x):
    if not isinstance(x, V):
        raise Unsupported(f"expected a tensor operand, got {type(x).__name__}")
    return x


def _axes(rank, dim):
    if dim is None:
        return list(range(rank))
    if isinstance(dim, int):
        dim = [dim]
    dim = [_num(d) for d in dim]
    if not dim:
        return list(range(rank))
    return sorted({d % rank for d in dim}) if rank else []


# ---------------------------------------------------------------------------- pointwise

_UNARY = {"neg": "neg", "abs": "abs", "sign": "sign", "exp": "exp", "log": "log", "log1p": "log1p",
          "expm1": "expm1", "sqrt": "sqrt", "rsqrt": "rsqrt", "reciprocal": "recip", "sin": "sin",
          "cos": "cos", "tanh": "tanh", "erf": "erf", "sigmoid": "sigmoid", "relu": "relu",
          "silu": "silu", "mish": "mish", "hardswish": "hardswish"}


def _make_unary(ir):
    def lower(b, node, a):
        return b.unary(ir, _t(a["self"]), _out(node))
    return lower


for _name, _ir in _UNARY.items():
    _reg(f"{_name}.default")(_make_unary(_ir))


@_reg("gelu.default")
def _gelu(b, node, a):
    approx = a.get("approximate") or "none"
    return b.unary("gelu_tanh" if approx == "tanh" else "gelu", _t(a["self"]), _out(node))


@_reg("leaky_relu.default")
def _leaky_relu(b, node, a):
    return b.unary("leaky_relu", _t(a["self"]), _out(node), scalars=(float(_num(a["negative_slope"])), 0.0))


@_reg("softplus.default")
def _softplus(b, node, a):
    beta, thr = float(_num(a["beta"])), float(_num(a["threshold"]))
    return b.unary("softplus", _t(a["self"]), _out(node), scalars=(beta, thr))


@_reg("hardtanh.default")
def _hardtanh(b, node, a):
    return _clamp_to(b, _t(a["self"]), _num(a["min_val"]), _num(a["max_val"]), _out(node), strict=True)


@_reg("relu6.default")
def _relu6(b, node, a):
    return _clamp_to(b, _t(a["self"]), 0, 6, _out(node), strict=True)


@_reg("hardsigmoid.default")
def _hardsigmoid(b, node, a):
    dt = _out(node)
    x = b.cast(_t(a["self"]), dt)
    return b.arith("div", _clamp_to(b, b.arith("add", x, 3.0, dt), 0, 6, dt, strict=True), 6.0, dt)


@_reg("elu.default")
def _elu(b, node, a):
    dt = _out(node)
    x = b.cast(_t(a["self"]), dt)
    alpha, scale, iscale = (float(_num(a[k])) for k in ("alpha", "scale", "input_scale"))
    neg = b.unary("expm1", b.arith("mul", x, iscale, dt) if iscale != 1 else x)
    neg = b.arith("mul", neg, alpha * scale, dt)
    pos = b.arith("mul", x, scale, dt) if scale != 1 else x
    return b.where(b.arith("gt", x, 0.0), pos, neg, dt)


@_reg("logical_not.default", "bitwise_not.default")
def _not(b, node, a):
    x = _t(a["self"])
    if node.target is aten.bitwise_not.default and x.dtype != "bool":
        raise Unsupported("bitwise not of integers")
    return b.unary("not", b.cast(x, "bool"), "bool")


@_reg("square.default")
def _square(b, node, a):
    x = b.cast(_t(a["self"]), _out(node))
    return b.arith("mul", x, x)


@_reg("exp2.default", "log2.default", "log10.default")
def _explog_base(b, node, a):
    dt = _out(node)
    x = b.cast(_t(a["self"]), dt)
    name = node.target._schema.name.split("::")[-1]
    if name == "exp2":
        return b.unary("exp", b.arith("mul", x, math.log(2.0), dt))
    return b.arith("mul", b.unary("log", x), 1.0 / math.log(2.0 if name == "log2" else 10.0), dt)


def _clamp_to(b, x, lo, hi, dt, strict=False):
    """Clamping as selects, so the gradient at a bound is torch's (a max/min would split a tie
    half and half): clamp passes it to x where lo <= x <= hi, and a tensor bound gets it only
    where x is outside; hardtanh, relu6 and hardsigmoid (strict) pass it only strictly inside.
    A NaN x stays NaN (every comparison with it is false); a NaN tensor bound gives NaN, as in
    torch."""
    x = b.cast(x, dt)
    below, above = ("le", "ge") if strict else ("lt", "gt")
    for bound, cmp in ((lo, below), (hi, above)):
        if bound is None:
            continue
        outside = b.arith(cmp, x, bound, dt)
        if isinstance(bound, V):
            outside = b.arith("or", outside, b.arith("ne", bound, bound, dt))
        x = b.where(outside, bound, x, dt)
    return x


@_reg("clamp.default", "clamp.Tensor", "clamp_min.default", "clamp_max.default",
      "clamp_min.Tensor", "clamp_max.Tensor")
def _clamp(b, node, a):
    dt = _out(node)
    lo = a.get("min")
    hi = a.get("max")
    name = node.target._schema.name.split("::")[-1]
    if name == "clamp_max":
        lo, hi = None, a.get("max")
    if isinstance(lo, Sym) or isinstance(hi, Sym):
        raise Unsupported("symbolic clamp bound")
    return _clamp_to(b, _t(a["self"]), lo, hi, dt)


def _binop(ir):
    def lower(b, node, a):
        x, y = a["self"], a["other"]
        alpha = a.get("alpha", 1)
        dt = _out(node)
        if alpha not in (None, 1):
            y = y * _num(alpha) if not isinstance(y, V) else b.arith("mul", y, _num(alpha), dt)
        return b.arith(ir, _num_or_t(x), _num_or_t(y), dt, _odims(b, node))
    return lower


def _num_or_t(x):
    return x if isinstance(x, V) else _num(x)


for _name, _ir in (("add", "add"), ("sub", "sub"), ("mul", "mul"), ("div", "div")):
    _reg(f"{_name}.Tensor", f"{_name}.Scalar")(_binop(_ir))
_reg("maximum.default")(_binop("max"))
_reg("minimum.default")(_binop("min"))


@_reg("div.Tensor_mode", "div.Scalar_mode")
def _div_mode(b, node, a):
    if a.get("rounding_mode") is not None:
        raise Unsupported("rounded division")
    return b.arith("div", _num_or_t(a["self"]), _num_or_t(a["other"]), _out(node), _odims(b, node))


@_reg("rsub.Tensor", "rsub.Scalar")
def _rsub(b, node, a):
    dt = _out(node)
    x, y, alpha = a["self"], _num_or_t(a["other"]), _num(a.get("alpha", 1))
    if alpha != 1:
        x = b.arith("mul", x, alpha, dt)
    return b.arith("sub", y, x, dt, _odims(b, node))


@_reg("pow.Tensor_Scalar")
def _pow_ts(b, node, a):
    dt = _out(node)
    x, e = b.cast(_t(a["self"]), dt), _num(a["exponent"])
    if e == 1:
        return x
    if e == 2:
        return b.arith("mul", x, x, dt)
    if dt in ("f32", "f16", "bf16", "f64"):
        special = {0.5: "sqrt", -0.5: "rsqrt", -1: "recip"}
        if e in special:
            return b.unary(special[e], x)
    return b.arith("pow", x, e, dt)


@_reg("pow.Tensor_Tensor", "pow.Scalar")
def _pow(b, node, a):
    return b.arith("pow", _num_or_t(a["self"]), _num_or_t(a["exponent"]), _out(node), _odims(b, node))


def _cmp(ir):
    def lower(b, node, a):
        return b.arith(ir, _num_or_t(a["self"]), _num_or_t(a["other"]), dims=_odims(b, node))
    return lower


for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    _reg(f"{_name}.Tensor", f"{_name}.Scalar")(_cmp(_name))


def _logic(ir):
    def lower(b, node, a):
        x, y = _num_or_t(a["self"]), _num_or_t(a["other"])
        if node.target._schema.name.startswith("aten::bitwise") and any(
                isinstance(v, V) and v.dtype != "bool" for v in (x, y)):
            raise Unsupported("bitwise ops on integers")
        return b.arith(ir, x, y, "bool", _odims(b, node))
    return lower


_reg("logical_and.default", "bitwise_and.Tensor", "__and__.Tensor")(_logic("and"))
_reg("logical_or.default", "bitwise_or.Tensor", "__or__.Tensor")(_logic("or"))


@_reg("where.self", "where.ScalarOther", "where.ScalarSelf", "where.Scalar")
def _where(b, node, a):
    return b.where(_num_or_t(a["condition"]), _num_or_t(a["self"]), _num_or_t(a["other"]), _out(node))


@_reg("masked_fill.Scalar", "masked_fill.Tensor")
def _masked_fill(b, node, a):
    x, m, v = _t(a["self"]), _t(a["mask"]), a["value"]
    if isinstance(v, V):
        if v.rank != 0:
            raise Unsupported("masked_fill value must be 0-dim")
    else:
        v = _num(v)
    return b.where(m, v, x, _out(node))


# ---------------------------------------------------------------------------- casts, copies

@_reg("clone.default", "contiguous.default", "alias.default", "lift_fresh_copy.default",
      "alias_copy.default")
def _identity(b, node, a):
    return _t(a["self"])


@_reg("detach.default", "detach_copy.default")
def _detach(b, node, a):
    """The IR has no stop-gradient: kbench's backward would flow through an identity, so torch
    runs the detach (its output carries no gradient, as in eager)."""
    raise Unsupported("a detach (stops the gradient)")


@_reg("_to_copy.default", "to.dtype", "to.dtype_layout", "to.device", "to.other", "type_as.default")
def _to(b, node, a):
    src = node.args[0].meta["val"]
    if src.device != node.meta["val"].device:
        raise Unsupported("device transfer")
    return b.cast(_t(a["self"]), _out(node))


@_reg("copy.default")
def _copy(b, node, a):
    return b.bcast(b.cast(_t(a["src"]), _out(node)), _odims(b, node))


@_reg("dropout.default", "feature_dropout.default", "alpha_dropout.default",
      "feature_alpha_dropout.default")
def _dropout(b, node, a):
    if a.get("train") and _num(a.get("p", 0)) != 0:
        raise Unsupported("dropout in training mode")
    return _t(a["input"])


@_reg("native_dropout.default")
def _native_dropout(b, node, a):
    x = _t(a["input"])
    if a.get("train") is not False and _num(a["p"]) != 0:
        raise Unsupported("dropout in training mode")
    return Multi(b, node, lambda i: x if i == 0 else b.const(True, "bool", x.dims))


# ---------------------------------------------------------------------------- constants

def _fill(value_key):
    def lower(b, node, a):
        value = {"zeros": 0, "ones": 1, "empty": 0}.get(value_key)
        if value is None:
            value = _num(a[value_key])
        return b.const(value, _out(node), _odims(b, node))
    return lower


_reg("zeros.default", "zeros_like.default", "new_zeros.default")(_fill("zeros"))
_reg("ones.default", "ones_like.default", "new_ones.default")(_fill("ones"))
_reg("empty_like.default", "empty.memory_format", "new_empty.default")(_fill("empty"))
_reg("full.default", "full_like.default", "new_full.default")(_fill("fill_value"))
_reg("fill.Scalar")(_fill("value"))
_reg("scalar_tensor.default")(_fill("s"))


# ---------------------------------------------------------------------------- views

@_reg("view.default", "reshape.default", "_unsafe_view.default", "view_copy.default",
      "unsqueeze.default", "squeeze.default", "squeeze.dim", "squeeze.dims", "flatten.using_ints",
      "unflatten.int", "view_as.default", "reshape_as.default")
def _reshape(b, node, a):
    return b.reshape(_t(a["self"]), _odims(b, node))


@_reg("expand.default", "expand_as.default", "broadcast_to.default", "expand_copy.default")
def _expand(b, node, a):
    return b.bcast(_t(a["self"]), _odims(b, node))


@_reg("permute.default", "permute_copy.default")
def _permute(b, node, a):
    return b.permute(_t(a["self"]), [_num(d) for d in a["dims"]])


@_reg("transpose.int", "transpose_copy.int", "swapaxes.default")
def _transpose(b, node, a):
    x = _t(a["self"])
    d0, d1 = (_num(a[k]) for k in (("dim0", "dim1") if "dim0" in a else ("axis0", "axis1")))
    perm = list(range(x.rank))
    if x.rank:
        d0, d1 = d0 % x.rank, d1 % x.rank
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return b.permute(x, perm)


@_reg("t.default")
def _tt(b, node, a):
    x = _t(a["self"])
    return b.permute(x, [1, 0]) if x.rank == 2 else x


def _slice(b, x, dim, start, length_dim, step=1):
    """x[start : start + step*len : step] on dim; length from torch's output shape."""
    dim %= x.rank
    size = x.dims[dim]
    start = _num(start) if start is not None else 0
    if start < 0:
        if not isinstance(size, int):
            raise Unsupported("negative start on a varying size")
        start = max(start + size, 0)
    if isinstance(size, int):
        start = min(start, size)
    if start == 0 and step == 1 and length_dim == size:
        return x
    if isinstance(length_dim, int):   # the last element read must exist
        b.require_at_least(size, start + (length_dim - 1) * step + 1 if length_dim else start)
    dims = list(x.dims)
    dims[dim] = length_dim
    return b.add("slice", [x], x.dtype, dims, axis=dim, start=int(start), step=int(step))


@_reg("slice.Tensor", "slice_copy.Tensor")
def _slice_t(b, node, a):
    x = _t(a["self"])
    dim = _num(a["dim"]) % x.rank
    return _slice(b, x, dim, a["start"], _odims(b, node)[dim], _num(a["step"]))


@_reg("narrow.default")
def _narrow(b, node, a):
    x = _t(a["self"])
    dim = _num(a["dim"]) % x.rank
    return _slice(b, x, dim, a["start"], _odims(b, node)[dim])


@_reg("select.int", "select_copy.int")
def _select(b, node, a):
    x = _t(a["self"])
    dim = _num(a["dim"]) % x.rank
    return b.reshape(_slice(b, x, dim, _num(a["index"]), 1), _odims(b, node))


def _split_lower(b, node, x, dim, drop_dim=False):
    if only_torch_consumes(node, b.keep, gemm=b.gemm):
        raise Unsupported("its pieces feed torch's ops alone: one call (torch's backward is one cat)")
    outs = node.meta["val"]
    starts, acc = [], 0
    for o in outs:
        starts.append(acc)
        size = b.dim(o.shape[dim]) if not drop_dim else 1   # a pinned size is a number here too
        acc = acc + size if isinstance(acc, int) and isinstance(size, int) else None

    def get(i):
        if starts[i] is None:
            raise Unsupported("split offsets vary")
        dims = b.rep_dims(outs[i])
        length = dims[dim] if not drop_dim else 1
        s = _slice(b, x, dim, starts[i], length)
        return b.reshape(s, dims)
    return Multi(b, node, get)


@_reg("split.Tensor", "split_with_sizes.default", "chunk.default", "split.sizes",
      "split_with_sizes_copy.default", "split_copy.Tensor")
def _split(b, node, a):
    x = _t(a["self"])
    return _split_lower(b, node, x, _num(a.get("dim", 0)) % x.rank)


@_reg("unbind.int", "unbind_copy.int")
def _unbind(b, node, a):
    x = _t(a["self"])
    return _split_lower(b, node, x, _num(a.get("dim", 0)) % x.rank, drop_dim=True)


# ---------------------------------------------------------------------------- view writes
# x[..., a:b] = y and x[..., i] = y as functional ops (capture/export.py rewrites writes into views
# of a fresh value to these): a select on the coordinate, where(mask(iota), y placed, x), a
# pointwise mask that fuses with what reads the result.

def _axis_position(b, x, dim, index, what):
    """index (a constant, negative from the end) as a position on x's dim."""
    index = _num(index) if index is not None else 0
    if index < 0:
        if not isinstance(x.dims[dim], int):
            raise Unsupported(f"{what}: a negative position on a varying size")
        index += x.dims[dim]
    return index


def _placed(b, x, src, dim, start, dtype):
    """where(iota on dim in [start, start + len), src at iota - start, x): src written into x."""
    n = src.dims[dim]
    if start == 0 and n == x.dims[dim]:
        return b.bcast(b.cast(src, dtype), x.dims)
    if not isinstance(n, int):
        raise Unsupported("a varying-length slice written into part of an axis")
    io = b.add("iota", [], "i64", x.dims, axis=dim)
    at = b.arith("ge", io, start) if start > 0 else None
    if x.dims[dim] != start + n:
        below = b.arith("lt", io, start + n)
        at = below if at is None else b.arith("and", at, below)
    if n == 1:          # one position: src broadcast along dim, whose gradient is a sum
        placed = b.bcast(b.cast(src, dtype), x.dims)
    else:               # src at iota - start, clamped so that every read is in range
        idx = b.arith("max", b.arith("sub", io, start), 0) if start else io
        idx = b.arith("min", idx, n - 1) if x.dims[dim] != start + n else idx
        placed = b.add("gather", [b.cast(src, dtype), idx], dtype, x.dims, axis=dim)
    return b.where(at, placed, x, dtype)


@_reg("slice_scatter.default")
def _slice_scatter(b, node, a):
    x, src, dtype = _t(a["self"]), _t(a["src"]), _out(node)
    dim = _num(a.get("dim", 0)) % x.rank
    step = _num(a.get("step", 1))
    start = _axis_position(b, x, dim, a.get("start"), "slice_scatter")
    if isinstance(x.dims[dim], int):
        start = min(start, x.dims[dim])
    n = src.dims[dim]
    if n == 0:
        return b.cast(x, dtype)
    if start == 0 and n == x.dims[dim]:     # x[:, :] = src, a chain's whole-axis link
        return b.bcast(b.cast(src, dtype), x.dims)
    if step != 1 and n != 1:
        raise Unsupported("slice_scatter with a step")
    if n != 1 and dtype not in ("i64", "i32", "bool"):
        # its gradient would read src through a gather of many positions per row, which kbench's
        # autodiff cannot scatter back: torch runs it, with its own backward
        raise Unsupported("slice_scatter of a float slice longer than 1 (its gradient is a scatter)")
    return _placed(b, x, src, dim, start, dtype)


@_reg("select_scatter.default")
def _select_scatter(b, node, a):
    x, src, dtype = _t(a["self"]), _t(a["src"]), _out(node)
    dim = _num(a["dim"]) % x.rank
    index = _axis_position(b, x, dim, a["index"], "select_scatter")
    src = b.reshape(src, src.dims[:dim] + (1,) + src.dims[dim:])
    return _placed(b, x, src, dim, index, dtype)


@_reg("fill.Tensor")
def _fill_t(b, node, a):
    v = _t(a["value"])
    if v.rank != 0:
        raise Unsupported("fill value must be 0-dim")
    return b.bcast(b.cast(v, _out(node)), _odims(b, node))


# ---------------------------------------------------------------------------- reductions

def _reduce_op(ir, all_dims=False):
    def lower(b, node, a):
        x = _t(a["self"])
        dt = _out(node)
        axes = list(range(x.rank)) if all_dims else _axes(x.rank, a.get("dim"))
        return b.reduce(ir, b.cast(x, dt), axes, bool(a.get("keepdim", False)))
    return lower


_reg("sum.dim_IntList")(_reduce_op("sum"))
_reg("sum.default")(_reduce_op("sum", all_dims=True))
_reg("mean.dim")(_reduce_op("mean"))
_reg("mean.default")(_reduce_op("mean", all_dims=True))
_reg("amax.default")(_reduce_op("max"))
_reg("amin.default")(_reduce_op("min"))
_reg("max.default")(_reduce_op("max", all_dims=True))
_reg("min.default")(_reduce_op("min", all_dims=True))


@_reg("max.dim", "min.dim")
def _minmax_dim(b, node, a):
    x = _t(a["self"])
    ir = "max" if node.target is aten.max.dim else "min"

    def get(i):
        if i != 0:
            raise Unsupported("arg-max/min indices")
        return b.reduce(ir, x, _axes(x.rank, a["dim"]), bool(a["keepdim"]))
    return Multi(b, node, get)


@_reg("logsumexp.default")
def _logsumexp(b, node, a):
    dt = _out(node)
    x = b.cast(_t(a["self"]), _opmath(dt))
    axes, keep = _axes(x.rank, a["dim"]), bool(a["keepdim"])
    if not axes:
        return b.cast(x, dt)
    m = b.reduce("max", x, axes, True, nograd=True)  # a stability shift: no gradient
    # torch zeroes an infinite max so that all -inf rows give -inf, not nan
    m = b.where(b.arith("eq", b.unary("abs", m), math.inf), 0.0, m, m.dtype)
    s = b.reduce("sum", b.unary("exp", b.arith("sub", x, m)), axes, True)
    y = b.arith("add", b.unary("log", s), m)
    return b.cast(b.reshape(y, _odims(b, node)) if not keep else y, dt)


def _moments(b, x, axes, correction):
    """(var, mean) over axes with keepdim; var divides by max(n - correction, 0) like torch.
    When a reduced size varies, n is counted in the graph (a sum of ones)."""
    mean = b.reduce("mean", x, axes, True)
    d = b.arith("sub", x, mean)
    ss = b.reduce("sum", b.arith("mul", d, d), axes, True)
    if all(isinstance(x.dims[ax], int) for ax in axes):
        n = 1
        for ax in axes:
            n *= x.dims[ax]
        return b.arith("div", ss, float(max(n - correction, 0))), mean
    n = b.reduce("sum", b.const(1.0, x.dtype, x.dims), axes, True)
    denom = b.arith("max", b.arith("sub", n, float(correction)), 0.0)
    return b.arith("div", ss, denom), mean


def _var_args(a, rank):
    axes = _axes(rank, a.get("dim"))
    if "correction" in a and a.get("correction") is not None:
        corr = _num(a["correction"])
    elif "unbiased" in a and a.get("unbiased") is not None:
        corr = 1 if a["unbiased"] else 0
    else:
        corr = 1
    return axes, corr, bool(a.get("keepdim", False))


@_reg("var.correction", "var.dim", "var.default", "std.correction", "std.dim", "std.default")
def _var(b, node, a):
    dt = _out(node)
    x = b.cast(_t(a["self"]), _opmath(dt))
    axes, corr, _ = _var_args(a, x.rank)
    var, _ = _moments(b, x, axes, corr)
    if node.target._schema.name.endswith("std"):
        var = b.unary("sqrt", var)
    return b.cast(b.reshape(var, _odims(b, node)), dt)


@_reg("var_mean.correction", "var_mean.dim", "std_mean.correction", "std_mean.dim")
def _var_mean(b, node, a):
    outs = node.meta["val"]
    dt = TORCH_TO_IR[outs[0].dtype]
    x = b.cast(_t(a["self"]), _opmath(dt))
    axes, corr, _ = _var_args(a, x.rank)
    is_std = node.target._schema.name.endswith("std_mean")

    def get(i):
        var, mean = _moments(b, x, axes, corr)
        v = (b.unary("sqrt", var) if is_std else var) if i == 0 else mean
        return b.cast(b.reshape(v, b.rep_dims(outs[i])), dt)
    return Multi(b, node, get)


@_reg("linalg_vector_norm.default")
def _vector_norm(b, node, a):
    dt = _out(node)
    x = b.cast(_t(a["self"]), _opmath(dt))
    ord_, axes, keep = _num(a["ord"]), _axes(x.rank, a.get("dim")), bool(a["keepdim"])
    if ord_ == 2:
        y = b.unary("sqrt", b.reduce("sum", b.arith("mul", x, x), axes, keep))
    elif ord_ == 1:
        y = b.reduce("sum", b.unary("abs", x), axes, keep)
    elif ord_ == math.inf:
        y = b.reduce("max", b.unary("abs", x), axes, keep)
    else:
        raise Unsupported(f"norm of order {ord_}")
    return b.cast(y, dt)


# ---------------------------------------------------------------------------- normalization

def _normalize(b, x, axes, eps, rms=False):
    """(x - mean) * rsqrt(var + eps) over axes (or x * rsqrt(mean(x^2) + eps) for rms);
    returns (y, mean or None, rstd), statistics with keepdim."""
    if rms:
        mean, d = None, x
    else:
        mean = b.reduce("mean", x, axes, True)
        d = b.arith("sub", x, mean)
    var = b.reduce("mean", b.arith("mul", d, d), axes, True)
    rstd = b.unary("rsqrt", b.arith("add", var, float(eps)))
    return b.arith("mul", d, rstd), mean, rstd


def _affine(b, y, w, bias, channel_rank=None):
    """y * w + bias; w, bias broadcast from the right, or along dim 1 when channel_rank is set."""
    for p, op in ((w, "mul"), (bias, "add")):
        if p is None:
            continue
        p = b.cast(_t(p), y.dtype)
        if channel_rank is not None:
            p = b.reshape(p, (1, p.dims[0]) + (1,) * (channel_rank - 2))
        y = b.arith(op, y, p, y.dtype)
    return y


@_reg("layer_norm.default", "native_layer_norm.default")
def _layer_norm(b, node, a):
    x0 = _t(a["input"])
    k = len(a["normalized_shape"])
    x = b.cast(x0, _opmath(x0.dtype))
    axes = list(range(x.rank - k, x.rank))
    y, mean, rstd = _normalize(b, x, axes, _num(a["eps"]))
    if node.target is aten.native_layer_norm.default:
        outs = node.meta["val"]
        res = [None, mean, rstd]

        def get(i):
            if i == 0:
                return b.cast(_affine(b, y, a["weight"], a["bias"]), TORCH_TO_IR[outs[0].dtype])
            return b.cast(b.reshape(res[i], b.rep_dims(outs[i])), TORCH_TO_IR[outs[i].dtype])
        return Multi(b, node, get)
    return b.cast(_affine(b, y, a["weight"], a["bias"]), _out(node))


@_reg("rms_norm.default")
def _rms_norm(b, node, a):
    x0 = _t(a["input"])
    k = len(a["normalized_shape"])
    cdt = _opmath(x0.dtype)
    eps = a.get("eps")
    eps = torch.finfo(torch.float32 if cdt == "f32" else torch.float64).eps if eps is None else _num(eps)
    x = b.cast(x0, cdt)
    y, _, _ = _normalize(b, x, list(range(x.rank - k, x.rank)), eps, rms=True)
    # torch: normalize in opmath, cast back to the input dtype, then multiply by the weight
    y = b.cast(y, x0.dtype)
    if a.get("weight") is not None:
        y = b.arith("mul", y, _t(a["weight"]), _out(node))
    return b.cast(y, _out(node))


@_reg("_native_batch_norm_legit_no_training.default", "batch_norm.default",
      "_native_batch_norm_legit.default")
def _batch_norm(b, node, a):
    if a.get("training"):
        raise Unsupported("batch norm in training mode")
    x0 = _t(a["input"])
    rm, rv = a.get("running_mean"), a.get("running_var")
    if rm is None or rv is None or x0.rank < 2:
        raise Unsupported("batch norm without running statistics")
    cdt = _opmath(x0.dtype)
    x = b.cast(x0, cdt)
    shape = (1, x.dims[1]) + (1,) * (x.rank - 2)
    mean = b.reshape(b.cast(_t(rm), cdt), shape)
    rstd = b.unary("rsqrt", b.arith("add", b.reshape(b.cast(_t(rv), cdt), shape), float(_num(a["eps"]))))
    y = b.arith("mul", b.arith("sub", x, mean), rstd)
    y = b.cast(_affine(b, y, a.get("weight"), a.get("bias"), channel_rank=x.rank), TORCH_TO_IR[
        (node.meta["val"][0] if isinstance(node.meta["val"], (list, tuple)) else node.meta["val"]).dtype])
    if node.target is aten.batch_norm.default:
        return y
    return Multi(b, node, lambda i: y if i == 0 else _raise("batch norm statistics"))


def _raise(why):
    raise Unsupported(why)


@_reg("group_norm.default", "native_group_norm.default")
def _group_norm(b, node, a):
    x0 = _t(a["input"])
    g = _num(a["num_groups"] if "num_groups" in a else a["group"])
    if x0.rank < 2 or not isinstance(x0.dims[1], int) or x0.dims[1] % g:
        raise Unsupported("group norm channels must be pinned and divisible")
    x = b.cast(x0, _opmath(x0.dtype))
    inner = mono_dim((x.dims[1] // g,) + x.dims[2:])
    if inner is None:
        raise Unsupported("group too large to name")
    xg = b.reshape(x, (x.dims[0], g, inner))
    yg, mean, rstd = _normalize(b, xg, [2], _num(a["eps"]))
    y = _affine(b, b.reshape(yg, x.dims), a.get("weight"), a.get("bias"), channel_rank=x.rank)
    if node.target is aten.group_norm.default:
        return b.cast(y, _out(node))
    outs = node.meta["val"]
    res = [y, mean, rstd]
    return Multi(b, node, lambda i: b.cast(b.reshape(res[i], b.rep_dims(outs[i])),
                                            TORCH_TO_IR[outs[i].dtype]))


# ---------------------------------------------------------------------------- softmax family

def _softmax_common(b, node, a, log):
    x0 = _t(a["self"])
    dt = _out(node)
    x = b.cast(x0, _opmath(dt))
    if x.rank == 0:
        return b.const(0.0 if log else 1.0, dt, ())
    ax = [_num(a["dim"]) % x.rank]
    m = b.reduce("max", x, ax, True, nograd=True)  # a stability shift: no gradient
    sh = b.arith("sub", x, m)
    e = b.unary("exp", sh)
    s = b.reduce("sum", e, ax, True)
    # softmax scales by one reciprocal per row: a division per element is most of the
    # arithmetic of a bf16 softmax at memory speed (within 1 ulp of e / s in f32)
    y = b.arith("sub", sh, b.unary("log", s)) if log else b.arith("mul", e, b.unary("recip", s))
    if node.target._schema.name == "aten::_safe_softmax":
        y = b.where(b.arith("eq", m, -math.inf), 0.0, y, y.dtype)   # all -inf rows give 0
    return b.cast(y, dt)


@_reg("softmax.int", "_softmax.default", "_safe_softmax.default")
def _softmax(b, node, a):
    return _softmax_common(b, node, a, log=False)


@_reg("log_softmax.int", "_log_softmax.default")
def _log_softmax(b, node, a):
    return _softmax_common(b, node, a, log=True)


# ---------------------------------------------------------------------------- losses, gathers

def _nll(b, lsm, target, weight, reduction, ignore_index):
    """Negative log-likelihood of log-probabilities lsm ([N, C, d...] or [C]) at integer targets
    ([N, d...] or []); returns (loss after reduction, total weight)."""
    if target.dtype not in ("i64", "i32"):
        raise Unsupported("class-probability targets")
    if lsm.rank >= 3:   # classes last: [N, d..., C]
        lsm = b.permute(lsm, [0] + list(range(2, lsm.rank)) + [1])
    cdt = lsm.dtype
    tdims = target.dims
    mask = b.arith("ne", target, int(_num(ignore_index)))
    tsafe = b.where(mask, target, 0, target.dtype)
    picked = b.add("gather", [lsm, b.reshape(tsafe, tdims + (1,))], cdt, tdims + (1,), axis=lsm.rank - 1)
    nll = b.unary("neg", b.reshape(picked, tdims))
    wt = None
    if weight is not None:
        flat = mono_dim(tdims)
        if flat is None:
            raise Unsupported("too many varying target dims")
        w = b.cast(_t(weight), cdt)
        wt = b.add("gather", [w, b.reshape(tsafe, (flat,))], cdt, (flat,), axis=0)
        wt = b.reshape(wt, tdims)
        nll = b.arith("mul", nll, wt)
    loss = b.where(mask, nll, 0.0, cdt)
    counted = b.where(mask, wt, 0.0, cdt) if wt is not None else b.cast(mask, cdt)
    total = b.reduce("sum", counted, range(len(tdims)), False)
    reduction = _num(reduction)
    if reduction == 0:
        return loss, total
    s = b.reduce("sum", loss, range(len(tdims)), False)
    return (s if reduction == 2 else b.arith("div", s, total)), total


@_reg("cross_entropy_loss.default")
def _cross_entropy(b, node, a):
    x0 = _t(a["self"])
    if _num(a.get("label_smoothing", 0.0)) != 0.0:
        raise Unsupported("label smoothing")
    dt = _out(node)
    x = b.cast(x0, _opmath(x0.dtype))
    cdim = 1 if x.rank >= 2 else 0
    m = b.reduce("max", x, [cdim], True, nograd=True)  # a stability shift: no gradient
    sh = b.arith("sub", x, m)
    lsm = b.arith("sub", sh, b.unary("log", b.reduce("sum", b.unary("exp", sh), [cdim], True)))
    loss, _ = _nll(b, lsm, _t(a["target"]), a.get("weight"), a["reduction"], a["ignore_index"])
    return b.cast(loss, dt)


@_reg("nll_loss_nd.default", "nll_loss.default", "nll_loss2d.default", "nll_loss_forward.default",
      "nll_loss2d_forward.default")
def _nll_loss(b, node, a):
    x0 = _t(a["self"])
    x = b.cast(x0, _opmath(x0.dtype))
    loss, total = _nll(b, x, _t(a["target"]), a.get("weight"), a["reduction"], a["ignore_index"])
    val = node.meta["val"]
    if isinstance(val, torch.Tensor):
        return b.cast(loss, _out(node))
    return Multi(b, node, lambda i: b.cast((loss, total)[i], TORCH_TO_IR[val[i].dtype]))


@_reg("gather.default")
def _gather(b, node, a):
    x, idx = _t(a["self"]), _t(a["index"])
    if x.rank != idx.rank or x.rank == 0:
        raise Unsupported("gather of rank-0 tensors")
    return b.add("gather", [x, idx], x.dtype, idx.dims, axis=_num(a["dim"]) % x.rank)


@_reg("embedding.default")
def _embedding(b, node, a):
    w, idx = _t(a["weight"]), _t(a["indices"])
    if w.rank != 2 or _num(a.get("padding_idx", -1)) != -1 or a.get("scale_grad_by_freq") or a.get("sparse"):
        raise Unsupported("embedding options")
    flat = mono_dim(idx.dims)
    if flat is None:
        raise Unsupported("too many varying index dims")
    rows = b.bcast(b.reshape(idx, (flat, 1)), (flat, w.dims[1]))
    out = b.add("gather", [w, rows], w.dtype, (flat, w.dims[1]), axis=0)
    return b.reshape(out, _odims(b, node))


@_reg("index_select.default")
def _index_select(b, node, a):
    x, idx = _t(a["self"]), _t(a["index"])
    if idx.rank != 1 or x.rank == 0:
        raise Unsupported("index_select with a scalar index")
    dim = _num(a["dim"]) % x.rank
    out = _odims(b, node)
    shape = tuple(idx.dims[0] if i == dim else 1 for i in range(x.rank))
    return b.add("gather", [x, b.bcast(b.reshape(idx, shape), out)], x.dtype, out, axis=dim)


# ---------------------------------------------------------------------------- matmul family

@_reg("linear.default")
def _linear(b, node, a):
    """A Linear with bias: the product (torch's) and the bias add (IR), so that the add fuses
    with what follows (an activation, a residual add, a norm). Where nothing kbench computes
    follows, the bias stays in cuBLAS's GEMM epilogue (one call, as eager's). With gemm on, the
    product is a MATMUL too: x [..., K] flattened to [M, K] times the weight [N, K] read through a
    PERMUTE as [K, N], then the bias add, all IR (one GEMM region with its epilogue)."""
    x, w, bias = _t(a["input"]), _t(a["weight"]), a.get("bias")
    if b.gemm:
        return _linear_ir(b, node, x, w, bias)
    pad = gemm_row_padding(node, w)
    if pad:
        return _padded_linear(b, node, x, w, bias, pad)
    if bias is None:
        raise Unsupported("linear without bias is one extern call as it is")
    if only_torch_consumes(node, b.keep):
        raise Unsupported("only torch's ops use it: the bias stays in the GEMM")
    dt, dims = _out(node), _odims(b, node)
    mm = b.extern_call(aten.linear.default, [x, w], (_slot(0), _slot(1)), {}, dt, dims, node.name)
    return b.arith("add", mm, _t(bias), dt, dims)


def _slot(k):
    return TensorSlot(k)


# With gemm off these stay torch calls: "no lowering", as they were before they had one.
_NO_GEMM = "no lowering"


def _mm_ir(b, x, y, dt):
    """x [*batch, M, K] . y [*batch, K, N] as a MATMUL of dtype dt; batch dims of size 1 broadcast
    by EXPAND. The operands are cast to dt first: torch.export records autocast implicitly (an f32
    Linear whose result is bf16), and autocast runs the product on operands cast to its dtype."""
    if x.rank < 2 or y.rank < 2:
        raise Unsupported("matmul of a vector")
    if dt in ("f32", "f16", "bf16", "f64"):
        x, y = b.cast(x, dt), b.cast(y, dt)
    if x.dtype != y.dtype or x.dtype not in ("f32", "f16", "bf16", "f64"):
        raise Unsupported(f"matmul of {x.dtype} and {y.dtype}")
    if x.rank != y.rank:
        raise Unsupported("matmul operands of different ranks")
    batch = b.bshape(x.dims[:-2], y.dims[:-2])
    x = b.bcast(x, tuple(batch) + x.dims[-2:])
    y = b.bcast(y, tuple(batch) + y.dims[-2:])
    return b.add("matmul", [x, y], dt, tuple(batch) + (x.dims[-2], y.dims[-1]))


def _transposed(b, w):
    return b.permute(w, tuple(range(w.rank - 2)) + (w.rank - 1, w.rank - 2))


def _flat_mm(b, x, w, dt):
    """x [..., K] . w [K, N] -> [..., N]: the leading dims of x folded into M (as torch's linear
    folds them), so the weight is one [K, N] operand, not broadcast over a batch."""
    if x.rank == 2:
        return _mm_ir(b, x, w, dt)
    flat = mono_dim(x.dims[:-1])
    if flat is None:
        raise Unsupported("too many varying dims to fold into M")
    y = _mm_ir(b, b.reshape(x, (flat, x.dims[-1])), w, dt)
    return b.reshape(y, x.dims[:-1] + (w.dims[-1],))


def _scaled(b, v, s, dt):
    s = _num(s)
    return v if s == 1 else b.arith("mul", v, float(s), dt)


def _linear_ir(b, node, x, w, bias):
    if w.rank != 2 or x.rank < 1:
        raise Unsupported("linear of this rank")
    dt = _out(node)
    x2 = b.reshape(x, (1, x.dims[0])) if x.rank == 1 else x
    y = _flat_mm(b, x2, _transposed(b, w), dt)
    if x.rank == 1:
        y = b.reshape(y, (w.dims[0],))
    return y if bias is None else b.arith("add", y, _t(bias), dt, y.dims)


@_reg("mm.default")
def _mm(b, node, a):
    if not b.gemm:
        raise Unsupported(_NO_GEMM)
    return _mm_ir(b, _t(a["self"]), _t(a["mat2"]), _out(node))


@_reg("bmm.default")
def _bmm(b, node, a):
    if not b.gemm:
        raise Unsupported(_NO_GEMM)
    return _mm_ir(b, _t(a["self"]), _t(a["mat2"]), _out(node))


@_reg("matmul.default")
def _matmul(b, node, a):
    """torch.matmul of 2-D and 3-D operands (export mostly leaves mm/bmm): [B, M, K] . [K, N]
    folds B into M; equal or size-1 batch dims broadcast."""
    if not b.gemm:
        raise Unsupported(_NO_GEMM)
    x, y, dt = _t(a["self"]), _t(a["other"]), _out(node)
    if x.rank not in (2, 3) or y.rank not in (2, 3):
        raise Unsupported("matmul of this rank")
    if y.rank == 2:
        return _flat_mm(b, x, y, dt)
    if x.rank == 2:
        x = b.reshape(x, (1,) + x.dims)
    return _mm_ir(b, x, y, dt)


@_reg("addmm.default", "baddbmm.default")
def _addmm(b, node, a):
    """beta * self + alpha * (mat1 . mat2) (batch1 . batch2 for baddbmm): the product a MATMUL,
    the rest its epilogue."""
    if not b.gemm:
        raise Unsupported(_NO_GEMM)
    dt = _out(node)
    x, y = (a["mat1"], a["mat2"]) if "mat1" in a else (a["batch1"], a["batch2"])
    y = _scaled(b, _mm_ir(b, _t(x), _t(y), dt), a.get("alpha", 1), dt)
    if _num(a.get("beta", 1)) == 0:
        return y
    return b.arith("add", y, _scaled(b, _t(a["self"]), a.get("beta", 1), dt), dt, y.dims)


# A 16-bit GEMM whose output rows are not a multiple of 8 elements (16 bytes) long — a vocabulary of
# 50257 — gets cuBLAS kernels for unaligned operands, 5-7x slower than the aligned ones at
# GPT-2's LM head (H200, its forward and both backward GEMMs). Padding the weight's rows to the
# next multiple of 8 with zeros and slicing the output back costs two copies, worth it from about
# this many multiply-adds (the example call's).
PAD_GEMM_MIN_MACS = 1 << 30


def gemm_row_padding(node, w) -> int:
    """Zero rows to add to a linear's weight [N, K] so that N is a multiple of 8 (0: none): for a
    16-bit result, N and K pinned, K a multiple of 8 already (padding K would copy the input too),
    and a product of at least PAD_GEMM_MIN_MACS at the example call."""
    if _out(node) not in ("bf16", "f16") or w.rank != 2:
        return 0
    n, k = w.dims
    if not isinstance(n, int) or not isinstance(k, int) or n % 8 == 0 or k % 8:
        return 0
    try:
        rows = _hint(node.meta["val"].numel()) // n
    except (TypeError, ValueError, KeyError, AttributeError):
        return 0
    return (-n) % 8 if rows * n * k >= PAD_GEMM_MIN_MACS else 0


def _hint(v) -> int:
    """An example size as an int (a symbolic size's hint)."""
    node = getattr(v, "node", None)
    return int(node.hint if node is not None and getattr(node, "hint", None) is not None else v)


def _padded_linear(b, node, x, w, bias, pad):
    """linear(x, w, bias) as one torch call on w (and bias) padded with `pad` zero rows, the output
    sliced back and made contiguous (kbench's kernels read it). Its backward is torch's: the
    padded output gradient keeps both backward GEMMs aligned."""
    n = w.dims[0]
    steps = [(aten.constant_pad_nd.default, (_slot(1), [0, 0, 0, pad], 0.0), {})]
    operands = [x, w]
    if bias is not None:
        operands.append(_t(bias))
        steps.append((aten.constant_pad_nd.default, (_slot(2), [0, pad], 0.0), {}))
    steps.append((aten.linear.default, (_slot(0), StepRef(0), StepRef(1) if bias is not None else None), {}))
    steps.append((aten.slice.Tensor, (StepRef(len(steps) - 1), -1, 0, n), {}))
    steps.append((aten.clone.default, (StepRef(len(steps) - 1),), {"memory_format": torch.contiguous_format}))
    return b.extern_steps(steps, str(aten.linear.default), operands, _out(node), _odims(b, node), node.name,
                          f"linear, weight padded from {n} to {n + pad} rows (aligned GEMMs)")


# ---------------------------------------------------------------------------- what follows a node

# Ops that move no data (a lowering renames indices): a value's uses are looked for through them.
_NO_DATA = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.permute.default,
            aten.transpose.int, aten.t.default, aten.expand.default, aten.unsqueeze.default,
            aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims, aten.contiguous.default, aten.clone.default,
            aten.alias.default, aten.detach.default, aten.slice.Tensor, aten.narrow.default, aten.select.int,
            aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int,
            aten.flatten.using_ints, aten.unflatten.int}
# Ops whose lowering is torch's own call (or starts with one): a value they use is read by torch.
_TORCH_CALLS = {aten.linear.default, aten.cat.default, aten.stack.default}
# Matrix products: torch's calls unless the capture lowers them (gemm)
_PRODUCTS = {aten.linear.default, aten.mm.default, aten.bmm.default, aten.matmul.default, aten.addmm.default,
             aten.baddbmm.default}


def only_torch_consumes(node, keep=(), _depth: int = 0, gemm: bool = False) -> bool:
    """Is every use of node's value — looked for through ops that move no data — an op torch
    runs (one kbench has no lowering for, a matrix product, attention, a cat, a node named in
    keep: kept in torch) or the graph's output? Then lowering node itself would make a region of
    its own between torch's calls: a launch more than eager makes, and for a split, a backward
    of zeros and copies where torch's is one cat."""
    if _depth > 16 or not node.users:
        return False
    for user in node.users:
        target = getattr(user, "target", None)
        if user.op == "output" or user.name in keep:
            continue
        if target is operator.getitem or target in _NO_DATA:
            if not only_torch_consumes(user, keep, _depth + 1, gemm):
                return False
            continue
        if gemm and target in _PRODUCTS:
            return False
        if user.op != "call_function" or (target in LOWER and target not in _TORCH_CALLS | _PRODUCTS):
            return False
    return True


@_reg("cat.default", "stack.default")
def _cat(b, node, a):
    """cat/stack stay one extern call; past 16 tensors (the most one IR node takes) the
    tensors are joined 16 at a time."""
    ts = list(a["tensors"])
    if len(ts) <= 16 or not all(isinstance(t, V) for t in ts):
        raise Unsupported("cat is an extern call")
    dim = _num(a["dim"])
    if node.target is aten.stack.default:
        rank = ts[0].rank + 1
        dim %= rank
        ts = [b.reshape(t, t.dims[:dim] + (1,) + t.dims[dim:]) for t in ts]
    dim %= ts[0].rank
    while len(ts) > 16:
        ts = [g[0] if len(g) == 1 else _cat_group(b, g, dim, node.name)
              for g in (ts[i:i + 16] for i in range(0, len(ts), 16))]
    return _cat_group(b, ts, dim, node.name)


def _cat_group(b, ts, dim, name):
    size = b.dim(sum((b.dim_expr(t.dims[dim]) for t in ts), sympy.Integer(0)))
    dims = ts[0].dims[:dim] + (size,) + ts[0].dims[dim + 1:]
    slots = [_slot(k) for k in range(len(ts))]
    return b.extern_call(aten.cat.default, ts, (slots, dim), {}, b.promote(*ts), dims, name)
