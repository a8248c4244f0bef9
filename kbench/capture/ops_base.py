"""The lowering table LOWER (ATen op -> lowering) and the helpers every op family's lowerings
share: the registration decorator, the output's dtype and dims, argument checks. The families
(ops_pointwise, ops_shapes, ops_reduce, ops_matmul) fill LOWER as ops.py imports them."""
from __future__ import annotations

import torch

from ..dtypes import TORCH_TO_IR
from .builder import Builder, Sym, Unsupported, V
from .types import TensorSlot

aten = torch.ops.aten
LOWER = {}


def register(*names):
    def deco(fn):
        for name in names:
            packet, _, overload = name.partition(".")
            op = getattr(getattr(aten, packet, None), overload or "default", None)
            if op is not None:
                LOWER[op] = fn
        return fn
    return deco


def out_dtype(node):
    v = node.meta["val"]
    return TORCH_TO_IR[v.dtype]


def out_dims(b: Builder, node):
    return b.rep_dims(node.meta["val"])


def opmath(dt):
    return "f32" if dt in ("f16", "bf16") else dt


def number_arg(x):
    """A Python number argument (a symbolic one makes the op an extern)."""
    if isinstance(x, Sym) or isinstance(x, V):
        raise Unsupported("scalar argument is not a constant")
    if isinstance(x, torch.Tensor):
        raise Unsupported("tensor held by value")
    return x


def tensor_arg(x):
    if not isinstance(x, V):
        raise Unsupported(f"expected a tensor operand, got {type(x).__name__}")
    return x



def slot(k):
    return TensorSlot(k)


def cat_operand_alone(node):
    """The position of the one operand an FX cat joins to nothing but empty tensors, or None. A
    key-value cache's first update is such a cat (Hugging Face's: an empty tensor, then the step's
    keys). Empty means so for every size: a 1-D tensor of size 0 (which torch's cat skips) or a
    pinned 0 along the cat's dim; the operand's dtype must be the result's (an empty operand still
    takes part in type promotion)."""
    if getattr(node, "target", None) is not aten.cat.default:
        return None
    out = node.meta.get("val")
    tensors = node.args[0] if node.args else node.kwargs.get("tensors", ())
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(out, torch.Tensor) or len(tensors) < 2 or not isinstance(dim, int):
        return None
    rank = out.dim()
    dim %= max(rank, 1)
    alone = None
    for i, arg in enumerate(tensors):
        val = getattr(arg, "meta", {}).get("val")
        if not isinstance(val, torch.Tensor):
            return None
        shape = list(val.shape)
        if (len(shape) == 1 and type(shape[0]) is int and shape[0] == 0) or \
                (len(shape) == rank and type(shape[dim]) is int and shape[dim] == 0):
            continue
        if alone is not None:
            return None
        alone = i
    if alone is None or getattr(tensors[alone], "meta", {})["val"].dtype != out.dtype or \
            tensors[alone].meta["val"].dim() != rank:
        return None
    return alone
