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
