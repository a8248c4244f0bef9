"""Lowerings of matrix products (linear, mm, bmm, matmul, addmm/baddbmm): MATMUL nodes with gemm
on, else torch's calls (linear's bias add in the IR, a 16-bit weight padded to aligned rows), and
only_torch_consumes, which asks whether a value feeds torch's calls alone (split and linear use it)."""
from __future__ import annotations

import operator

import torch

from .builder import Unsupported, mono_dim
# The shared helpers, under the short names every lowering below is written with.
from .ops_base import (LOWER, aten, cat_operand_alone, number_arg as _num, out_dims as _odims, out_dtype as _out,
                       register as _reg, slot as _slot, tensor_arg as _t)
from .types import StepRef


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
    x, w = _autocast(b, node, x, w)
    mm = b.extern_call(aten.linear.default, [x, w], (_slot(0), _slot(1)), {}, dt, dims, node.name)
    return b.arith("add", mm, _t(bias), dt, dims)



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


def _autocast(b, node, *operands):
    """A linear's operands as autocast casts them (Builder.autocast_operand): those computed
    from parameters alone cast in the IR; the rest as they are."""
    casts = b.autocast_dtypes(node)
    args = [a for a in node.args[:len(operands)]]
    devices = [getattr(getattr(a, "meta", {}).get("val"), "device", None) for a in args]
    return [b.autocast_operand(v, d.type if d is not None else None, casts) if v is not None else None
            for v, d in zip(operands, devices + [None] * (len(operands) - len(devices)))]


def _hint(v) -> int:
    """An example size as an int (a symbolic size's hint)."""
    node = getattr(v, "node", None)
    return int(node.hint if node is not None and getattr(node, "hint", None) is not None else v)


def _padded_linear(b, node, x, w, bias, pad):
    """linear(x, w, bias) as one torch call on w (and bias) padded with `pad` zero rows, the output
    sliced back, and made contiguous where kbench's kernels read it (where only torch's ops or the
    caller do, as an LM head's logits, the slice is the result, as torch.compile's padded GEMM
    gives it: the copy would cost as much as the product). Its backward is torch's: the padded
    output gradient keeps both backward GEMMs aligned."""
    n = w.dims[0]
    # a parameter's autocast cast first (padding with zeros commutes with the rounding): the
    # padded call then casts nothing, and the cast is computed once per parameter version
    x, w, bias = _autocast(b, node, x, w, _t(bias) if bias is not None else None)
    steps = [(aten.constant_pad_nd.default, (_slot(1), [0, 0, 0, pad], 0.0), {})]
    operands = [x, w]
    if bias is not None:
        operands.append(bias)
        steps.append((aten.constant_pad_nd.default, (_slot(2), [0, pad], 0.0), {}))
    steps.append((aten.linear.default, (_slot(0), StepRef(0), StepRef(1) if bias is not None else None), {}))
    steps.append((aten.slice.Tensor, (StepRef(len(steps) - 1), -1, 0, n), {}))
    if not only_torch_consumes(node, b.keep):
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
        if cat_operand_alone(user) is not None:    # lowered to a copy kbench's kernel writes
            return False
        if user.op != "call_function" or (target in LOWER and target not in _TORCH_CALLS | _PRODUCTS):
            return False
    return True
