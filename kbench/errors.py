"""errors.py — the exceptions kbench's Python layer raises itself (the C core's own errors,
CompileError and CudaError, come from kbench._C)."""


class CaptureError(RuntimeError):
    """torch.export could not capture the model (data-dependent control flow, unsupported
    Python, ...). The message names the model and the first line of export's own error."""
