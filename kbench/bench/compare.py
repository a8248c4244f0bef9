"""Comparing a candidate's tensors with a float64 reference (docs/DESIGN.md, "Verification"):
per-dtype tolerances that scale with the reference's magnitude and with eager PyTorch's own error,
NaN/Inf in the same places, exact tensor type/dtype/shape, and a guard against references that
cannot tell a right answer from zeros, a constant or an input.

Imports only torch and the standard library (benchmarks/bench_ops.py may load it by path).
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch

# (atol as a fraction of the reference's RMS, rtol, bound on the relative-to-norm error).
# f32 is tight enough that TF32 matmuls fail it (they are a different precision); bf16 and
# f16 allow a couple of units in the last place of the output.
TOLERANCES = {
    torch.float64: (1e-10, 1e-9, 1e-10),
    torch.float32: (1e-5, 1e-4, 1e-5),
    torch.float16: (1e-3, 4e-3, 2e-3),
    torch.bfloat16: (1e-2, 1.6e-2, 1e-2),
}
# A candidate may be this many times less accurate than eager PyTorch on the same case: a
# different accumulation order is legitimate, a different algorithm rarely needs more.
EAGER_SLACK = 4.0
_TINY = 1e-30


def flatten(out) -> list:
    """A module's output as a flat list (tensor, or nested tuples/lists of them)."""
    if isinstance(out, (tuple, list)):
        res = []
        for o in out:
            res.extend(flatten(o))
        return res
    return [out]


def to_f64(t):
    """Floating tensors to float64 (exact for every narrower float), others unchanged."""
    if isinstance(t, torch.Tensor) and t.is_floating_point():
        return t.detach().to(torch.float64)
    return t


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """max |out-ref|, ||out-ref|| / ||ref|| and the reference's scale, over finite positions
    of the reference (NaN/Inf positions are compared separately)."""
    o = out.detach().to(torch.float64)
    r = ref.detach().to(torch.float64)
    finite = torch.isfinite(r)
    if not bool(finite.all()):
        o, r = o[finite], r[finite]
    if r.numel() == 0:
        return {"max_abs": 0.0, "rel_norm": 0.0, "ref_rms": 0.0, "ref_absmax": 0.0}
    d = o - r
    dn = torch.linalg.vector_norm(d).item()
    rn = torch.linalg.vector_norm(r).item()
    return {"max_abs": d.abs().max().item(),
            "rel_norm": dn / max(rn, _TINY) if rn > _TINY or dn > 0 else 0.0,
            "ref_rms": rn / math.sqrt(r.numel()),
            "ref_absmax": r.abs().max().item()}


def tolerance(dtype: torch.dtype, ref: torch.Tensor, eager_err: Optional[dict] = None) -> dict:
    """The bounds a result of `dtype` must meet against float64 `ref`. eager_err, the errors of
    eager PyTorch on the same case, widens them for cases where eager itself is inexact."""
    atol_f, rtol, norm = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    r = ref.detach().to(torch.float64)
    r = r[torch.isfinite(r)]
    rms = (torch.linalg.vector_norm(r).item() / math.sqrt(r.numel())) if r.numel() else 0.0
    atol = atol_f * max(rms, _TINY)
    if eager_err is not None:
        atol = max(atol, EAGER_SLACK * eager_err["max_abs"])
        norm = max(norm, EAGER_SLACK * eager_err["rel_norm"])
    return {"atol": atol, "rtol": rtol, "rel_norm": norm}


def _special_masks(t: torch.Tensor):
    t = t.detach()
    return torch.isnan(t), torch.isposinf(t), torch.isneginf(t)


def close(out: torch.Tensor, ref: torch.Tensor, tol: dict) -> tuple:
    """(ok, reason, errors) for one float tensor against its float64 reference."""
    if out.is_floating_point() != ref.is_floating_point() or not out.is_floating_point():
        same = torch.equal(out.detach().cpu().to(ref.dtype), ref.detach().cpu())
        return same, ("" if same else "integer/bool output differs"), {}
    for name, mo, mr in zip(("NaN", "+Inf", "-Inf"), _special_masks(out), _special_masks(ref)):
        if not torch.equal(mo, mr):
            bad = int((mo != mr).sum())
            return False, f"{name} positions differ from the reference at {bad} elements", {}
    err = errors(out, ref)
    o = out.detach().to(torch.float64)
    r = ref.detach().to(torch.float64)
    finite = torch.isfinite(r)
    excess = ((o - r).abs() - (tol["atol"] + tol["rtol"] * r.abs()))[finite]
    n_bad = int((excess > 0).sum()) if excess.numel() else 0
    if n_bad:
        return False, (f"{n_bad}/{excess.numel()} elements out of tolerance "
                       f"(max abs err {err['max_abs']:.3g}, atol {tol['atol']:.3g}, "
                       f"rtol {tol['rtol']:.3g})"), err
    if err["rel_norm"] > tol["rel_norm"]:
        return False, (f"relative-to-norm error {err['rel_norm']:.3g} > "
                       f"{tol['rel_norm']:.3g}"), err
    return True, "", err


def storage_ptrs(tensors: Iterable) -> set:
    """The storages of the tensors among `tensors` (for aliasing checks)."""
    return {t.untyped_storage().data_ptr() for t in tensors
            if isinstance(t, torch.Tensor) and t.numel() > 0}


def describe(o, in_ptrs: set = frozenset()) -> dict:
    """What check_structure needs to know of one output, as plain data (the harness's worker
    reports it for outputs that stay in its process)."""
    if not isinstance(o, torch.Tensor):
        return {"type": type(o).__name__}
    return {"type": "Tensor" if type(o) is torch.Tensor else type(o).__name__,
            "dtype": str(o.dtype), "shape": list(o.shape), "device": str(o.device),
            "aliases_input": bool(o.numel() > 0 and o.untyped_storage().data_ptr() in in_ptrs)}


def structure_problem(facts: Sequence[dict], expect: Sequence) -> str:
    """'' if the described outputs are exactly torch.Tensor with the expected dtypes, shapes and
    devices, and none shares storage with an input; otherwise why not."""
    if len(facts) != len(expect):
        return f"returned {len(facts)} outputs, expected {len(expect)}"
    for i, (f, e) in enumerate(zip(facts, expect)):
        if f.get("type") != "Tensor":  # not a subclass, not a Parameter, not an array
            return f"output {i} is {f.get('type')}, not torch.Tensor"
        if f["dtype"] != str(e.dtype):
            return f"output {i} has dtype {f['dtype']}, expected {e.dtype}"
        if tuple(f["shape"]) != tuple(e.shape):
            return f"output {i} has shape {tuple(f['shape'])}, expected {tuple(e.shape)}"
        if torch.device(f["device"]) != e.device:
            return f"output {i} is on {f['device']}, expected {e.device}"
        if f["aliases_input"]:
            return f"output {i} shares storage with an input"
    return ""


def check_structure(outs: Sequence, expect: Sequence, inputs: Iterable = ()) -> str:
    """'' if `outs` are exactly torch.Tensor with the expected dtypes, shapes and devices, and
    none shares storage with an input; otherwise why not."""
    ptrs = storage_ptrs(inputs)
    return structure_problem([describe(o, ptrs) for o in outs], expect)


def discriminating(ref: torch.Tensor, tol: dict, inputs: Iterable = ()) -> str:
    """'' if zeros, a constant and each same-shaped input all FAIL against `ref` under `tol`;
    otherwise the trivial answer that would pass (the case cannot tell right from wrong)."""
    if not ref.is_floating_point() or ref.numel() == 0:
        return ""
    guesses = [("zeros", torch.zeros_like(ref))]
    finite = ref[torch.isfinite(ref)]
    if ref.numel() > 1 and finite.numel():
        guesses.append(("a constant", torch.full_like(ref, finite.mean().item())))
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.shape == ref.shape:
            guesses.append((f"input {i}", x.detach().to(ref.dtype)))
    for name, g in guesses:
        if close(g, ref, tol)[0]:
            return f"{name} would pass against this reference"
    return ""
