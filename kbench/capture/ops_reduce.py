"""Lowerings of reductions and the composites built on them: sum/mean/max/min, logsumexp,
var/std, vector norms, layer/rms/batch/group norm, softmax and log_softmax, cross entropy and
nll losses, gather/embedding/index_select. Half-precision composites compute in f32 (opmath)."""
from __future__ import annotations

import math

import torch

from ..dtypes import TORCH_TO_IR
from .builder import Multi, Unsupported, mono_dim
# The shared helpers, under the short names every lowering below is written with.
from .ops_base import (aten, number_arg as _num, opmath as _opmath, out_dims as _odims, out_dtype as _out,
                       register as _reg, tensor_arg as _t)


def _axes(rank, dim):
    if dim is None:
        return list(range(rank))
    if isinstance(dim, int):
        dim = [dim]
    dim = [_num(d) for d in dim]
    if not dim:
        return list(range(rank))
    return sorted({d % rank for d in dim}) if rank else []


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
