"""Lowerings of pointwise ops: unary and binary arithmetic, comparisons and logic, where and
masked_fill, casts and copies, dropout at inference, constant fills. Each is one or a few IR
pointwise nodes; none reads across elements."""
from __future__ import annotations

import math

from .builder import Multi, Sym, Unsupported, V
# The shared helpers, under the short names every lowering below is written with.
from .ops_base import (aten, number_arg as _num, out_dims as _odims, out_dtype as _out, register as _reg,
                       tensor_arg as _t)


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
    # the exponents torch's pow kernel spells out (PowKernel.cu), spelled as it does: the same
    # rounding, and no powf (dozens of instructions a value: a GELU-tanh's x**3 made its kernel
    # compute-bound)
    if e == 2:
        return b.arith("mul", x, x, dt)
    if e == 3:
        return b.arith("mul", b.arith("mul", x, x, dt), x, dt)
    if dt in ("f32", "f16", "bf16", "f64"):
        if e == -2:
            return b.unary("recip", b.arith("mul", x, x, dt))
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
