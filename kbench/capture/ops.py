"""One lowering per ATen op: (builder, fx node, bound args) → IR value(s). Composites (layer_norm,
softmax, cross_entropy, batch/group norm, ...) are decomposed into the IR's primitives (docs/DESIGN.md,
"The IR"); half-precision composites compute in f32 and cast back, as torch's kernels do. A lowering
raises Unsupported for a case it does not handle, and the op becomes an EXTERN call instead; it never
has to be complete.

This module is the table's one entry point: importing it imports every op family, which registers
its lowerings into LOWER (ops_base.py holds the table and the shared helpers; ops_pointwise.py,
ops_shapes.py, ops_reduce.py, ops_matmul.py the lowerings). A family module alone fills only part
of the table."""
from __future__ import annotations

from . import ops_matmul, ops_pointwise, ops_reduce, ops_shapes  # noqa: F401  (they fill LOWER)
from .ops_base import LOWER
from .ops_matmul import gemm_row_padding, only_torch_consumes

# PAD_GEMM_MIN_MACS is not re-exported: setting it here would not reach ops_matmul, which reads it.
__all__ = ["LOWER", "gemm_row_padding", "only_torch_consumes"]
