"""Mapping between torch dtypes and the IR's dtype names (the one place both spellings meet)."""
import torch

TORCH_TO_IR = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "bool",
}
IR_TO_TORCH = {v: k for k, v in TORCH_TO_IR.items()}


def ir_dtype(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_IR[dtype]
    except KeyError:
        raise TypeError(f"kbench does not support dtype {dtype} (supported: "
                        f"{', '.join(str(d) for d in TORCH_TO_IR)})") from None


def torch_dtype(name: str) -> torch.dtype:
    return IR_TO_TORCH[name]
