"""The mode a capture is for: the module's train/eval flag and the autocast in force. A call in
another mode is served by a capture of its own (runtime/module.py, OptimizedModule._other_mode)."""
from __future__ import annotations

import torch


def describe_mode(mode) -> str:
    """(training, autocast_mode()) in words: "eval mode", "training mode under cuda autocast bfloat16"."""
    training, autocast = mode
    text = f"{'training' if training else 'eval'} mode"
    for device, dtype in autocast:
        text += f" under {device} autocast {str(dtype).replace('torch.', '')}"
    return text


def autocast_mode() -> tuple:
    """The autocast modes in force, ((device type, dtype), ...): part of the mode a capture is
    for. torch.export records autocast implicitly (a matmul's result is bf16, its inputs are not
    cast in the graph), so the externs of a capture made under autocast must run under it, and
    a capture made without must not."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cuda", "cpu") if torch.is_autocast_enabled(d))
