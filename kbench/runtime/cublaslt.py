"""cuBLASLt with its fused epilogues, through kbench._C (csrc/cuda/cublaslt.c): D = epilogue(A·B + bias)
for row-major torch tensors, on torch's current stream.

The library is opened at run time, never linked: $KBENCH_CUBLASLT, else the copy torch already loaded
(read from /proc/self/maps: one cuBLASLt per process), else the torch wheel's nvidia/*/lib folders
(nvidia/cu13/lib/libcublasLt.so.13, nvidia/cublas/lib/libcublasLt.so.12), else the sonames.

cuBLASLt's GELU is the tanh approximation, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))): torch's
gelu(approximate='tanh') and HF's gelu_new, not torch's default erf GELU."""
from __future__ import annotations

import atexit
import functools
import glob
import os

import torch

from .. import _C
from .nvrtc import wheel_lib_dirs

# kb_lt_epilogue's names, in its order (kbench.h)
EPILOGUES = ("none", "bias", "relu_bias", "gelu_bias", "gelu_aux_bias", "dgelu", "dgelu_bgrad", "bgradb")
_BGRAD = ("dgelu_bgrad", "bgradb")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# cuBLASLt picks among more algorithms with more room; 32 MiB is what torch gives it on Hopper
WORKSPACE_BYTES = 32 << 20


def library_candidates() -> list[str]:
    """Where cuBLASLt is looked for, in order (the module docstring says why)."""
    out = []
    if os.environ.get("KBENCH_CUBLASLT"):
        out.append(os.environ["KBENCH_CUBLASLT"])
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(None, 5)   # address perms offset dev inode [path]
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libcublasLt.so"):
                    out.append(fields[5].strip())
    except OSError:
        pass
    for d in wheel_lib_dirs():
        out += sorted(glob.glob(os.path.join(d, "libcublasLt.so.*")), reverse=True)
    out += ["libcublasLt.so.13", "libcublasLt.so.12"]
    return list(dict.fromkeys(out))


@functools.lru_cache(maxsize=1)
def handle():
    """The process's cuBLASLt (opened once, closed at exit). RuntimeError says why it is not there."""
    try:
        return _C.lt_open(library_candidates())
    except FileNotFoundError as e:
        raise RuntimeError(f"cuBLASLt is not available: {e}") from e


def available() -> tuple[bool, str]:
    """(True, "<path> (cuBLASLt <version>)") or (False, the reason)."""
    try:
        path, version = _C.lt_info(handle())
    except RuntimeError as e:
        return False, str(e)
    return True, f"{path} (cuBLASLt {version // 10000}.{version // 100 % 100}.{version % 100})"


@atexit.register
def _close():
    # the handles go while the CUDA context is still up (cuBLASLt's handles free device memory)
    handle.cache_clear()


_workspaces: dict[tuple[int, int], torch.Tensor] = {}


def workspace_for(device: torch.device) -> torch.Tensor:
    """A WORKSPACE_BYTES buffer per (device, current stream): two streams never share one."""
    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream)
    ws = _workspaces.get(key)
    if ws is None:
        ws = _workspaces[key] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return ws


def matmul(a: torch.Tensor, b: torch.Tensor, *, b_transposed: bool, bias: torch.Tensor | None = None,
           epilogue: str = "none", aux: torch.Tensor | None = None, bgrad: torch.Tensor | None = None,
           workspace: torch.Tensor | None = None, tf32: bool = False):
    """D[..., m, n] = epilogue(a[..., m, k] · B + bias) through cuBLASLt.

    B is b ([k, n]) or, with b_transposed, bᵀ where b is a Linear weight [n, k]; a or b may be a
    batch (3-D), a 2-D operand is shared by the batch. a and b may be transposed views (their rows or
    their columns contiguous). bf16/f16 operands compute in f32; f32 ones in f32, or TF32 with tf32.
    Every tensor has a's dtype and device.

    Epilogues (cuBLASLt's GELU is the tanh approximation):
    - "none", "bias" (bias [n]), "relu_bias", "gelu_bias": returns D.
    - "gelu_aux_bias": returns (D, aux), aux the pre-activation a·B + bias, shaped like D with its rows
      a multiple of 8 elements apart (cuBLASLt's rule; made so when aux is None).
    - "dgelu": D = (a·B) · gelu'(aux), aux the forward's pre-activation; returns D.
    - "dgelu_bgrad": as "dgelu", and bgrad [n] = D summed over its rows; returns (D, bgrad).
    - "bgradb": the weight-gradient GEMM dW = dYᵀ·X with a = dYᵀ (a transposed view), and bgrad [m] =
      a summed over k (the bias gradient); returns (D, bgrad).
    ValueError for what cuBLASLt would refuse (dtypes, shapes, strides, alignment of aux), before
    anything runs; RuntimeError where cuBLASLt is not available."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"unknown epilogue {epilogue!r}: one of {', '.join(EPILOGUES)}")
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"cuBLASLt matmul takes bf16, f16 or f32 operands; {name} is {t.dtype}")
        if t.dim() not in (2, 3):
            raise ValueError(f"{name} has {t.dim()} dimensions: a matrix (2-D) or a batch of them (3-D) is taken")
    m, n = a.shape[-2], b.shape[-2] if b_transposed else b.shape[-1]
    lead = (a.shape[0],) if a.dim() == 3 else (b.shape[0],) if b.dim() == 3 else ()
    new = functools.partial(torch.empty, dtype=a.dtype, device=a.device)
    d = new(*lead, m, n)
    if epilogue == "gelu_aux_bias" and aux is None:
        aux = new(*lead, m, (n + 7) // 8 * 8)[..., :n]
    if epilogue in _BGRAD and bgrad is None:
        bgrad = new(m if epilogue == "bgradb" else n)
    try:
        h = handle()
    except RuntimeError:
        # a bad call says what is wrong before it hears that cuBLASLt is missing, on any machine
        _C.lt_check(a, b, b_transposed, d, epilogue, bias, aux, bgrad, tf32)
        raise
    if a.device.type != "cuda":
        raise ValueError(f"cuBLASLt runs on CUDA tensors; a is on {a.device}")
    with torch.cuda.device(a.device):
        ws = workspace_for(a.device) if workspace is None else workspace
        _C.lt_matmul(h, a, b, b_transposed, d, epilogue, bias, aux, bgrad, tf32, ws, None)
    if epilogue == "gelu_aux_bias":
        return d, aux
    if epilogue in _BGRAD:
        return d, bgrad
    return d
