"""kbench: capture a PyTorch module, generate verified CUDA kernels for it, swap them in.

    import kbench
    model = kbench.optimize(model, example_inputs)           # CUDA kernels on a GPU
    model = kbench.optimize(model, example_inputs, backend="interp")   # the C interpreter, CPU
    print(kbench.capture(model, example_inputs))             # the IR
"""
from __future__ import annotations

__version__ = "0.1.0"

from . import _C  # noqa: E402  (the C core; builds with no GPU and no CUDA toolkit)
from ._C import CompileError, CudaError  # noqa: E402
from .api import Graph, capture, generate, optimize  # noqa: E402
from .errors import CaptureError  # noqa: E402

__all__ = ["optimize", "capture", "generate", "Graph", "CaptureError", "CompileError", "CudaError",
           "__version__"]
