"""kbench: capture a PyTorch module, generate verified CUDA kernels for it, swap them in.

    import kbench
    model = kbench.optimize(model, example_inputs)           # CUDA kernels on a GPU
    model = kbench.optimize(model, example_inputs, backend="interp")   # the C interpreter, CPU
    print(kbench.capture(model, example_inputs))             # the IR
"""
from __future__ import annotations

from . import _C  # the C core; builds with no GPU and no CUDA toolkit
from ._C import CompileError, CudaError
# NOTE: `capture` below is the function; it shadows the attribute of the kbench.capture package,
# which stays importable by name (from kbench.capture import ...).
from .api import Graph, capture, generate, optimize
from .errors import CaptureError
from .version import __version__

__all__ = ["optimize", "capture", "generate", "Graph", "CaptureError", "CompileError", "CudaError",
           "__version__"]
