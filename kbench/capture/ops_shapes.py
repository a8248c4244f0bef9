"""Lowerings of shape ops: views (reshape, permute, transpose, slices, select, split/unbind),
view writes as functional scatters (slice_scatter, select_scatter, fill.Tensor), and cat/stack.
Views rename indices and move no data; cat stays torch's call (joined 16 at a time past 16), but
for a cat onto nothing but empty tensors, which is a copy kbench's kernel writes."""
from __future__ import annotations

import sympy

from .builder import Multi, Unsupported, V
# The shared helpers, under the short names every lowering below is written with.
from .ops_base import (aten, cat_operand_alone, number_arg as _num, out_dims as _odims, out_dtype as _out,
                       register as _reg, slot as _slot, tensor_arg as _t)
from .ops_matmul import only_torch_consumes


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


# ---------------------------------------------------------------------------- cat, stack

@_reg("cat.default", "stack.default")
def _cat(b, node, a):
    """cat/stack stay one extern call; past 16 tensors (the most one IR node takes) the
    tensors are joined 16 at a time."""
    ts = list(a["tensors"])
    alone = cat_operand_alone(node)
    if alone is not None and isinstance(ts[alone], V):
        # the operand, written as a fresh tensor as torch's cat writes it: a kernel reads it
        # through its views (a cache's keys: a transposed slice of the qkv product) and stores
        # it contiguous, where torch's cat of a strided operand is a slow copy
        return b.copy(ts[alone])
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


_cat.takes_torch_side = True   # the builder hands it operands the IR does not carry (an empty one)


def _cat_group(b, ts, dim, name):
    size = b.dim(sum((b.dim_expr(t.dims[dim]) for t in ts), sympy.Integer(0)))
    dims = ts[0].dims[:dim] + (size,) + ts[0].dims[dim + 1:]
    slots = [_slot(k) for k in range(len(ts))]
    return b.extern_call(aten.cat.default, ts, (slots, dim), {}, b.promote(*ts), dims, name)
