"""Capture: nn.Module + example inputs -> torch.export -> kbench's IR (a types.Captured).

export.py drives torch.export, lower.py lowers its ATen graph through builder.py and the op
table in ops.py, symbols.py handles the size symbols, cache.py keeps captures between
processes."""
from __future__ import annotations

from ..errors import CaptureError
from .export import Exported, capture, capture_exported, relower, repin, validate
from .types import Captured, Extern, NodeCall, SymExpr

__all__ = ["capture", "capture_exported", "relower", "repin", "validate", "Exported", "Captured", "Extern",
           "NodeCall", "SymExpr", "CaptureError"]
