"""Verification of a region's kernel against eager PyTorch (DESIGN §5): nothing is swapped in
unverified. A candidate must match a float64 reference over a sweep of shapes, value
distributions and seeds, with NaN-poisoned outputs, input dependence, repeatability, untouched
inputs, and a test that a constant or zero output would not have passed."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# tolerance on max|out - ref| relative to max|ref| (the norm), per output dtype
TOLERANCE = {torch.float32: 2e-5 * 16, torch.float64: 1e-9, torch.float16: 4e-3, torch.bfloat16: 2e-2}
DISTRIBUTIONS = ("normal", "uniform", "large", "tiny")


@dataclass
class Verdict:
    ok: bool
    reason: str = ""
    checked: int = 0                    # sweep points compared
    max_error: float = 0.0              # worst relative-to-norm error seen
    sizes: list = field(default_factory=list)   # symbol values that passed

    def __bool__(self) -> bool:
        return self.ok


def sweep_symvals(example: list[int], pinned_limit: int = 1 << 31) -> list[list[int]]:
    """Every varying size at 1, a small odd size, the example and a larger one; one symbol
    moves at a time (the others stay at the example) so the sweep stays small."""
    points = [list(example)]
    for s, v in enumerate(example):
        for alt in (1, 7, v + 3 if v % 2 == 0 else v + 2, 2 * v + 1):
            if alt == v or alt < 1 or alt >= pinned_limit:
                continue
            p = list(example)
            p[s] = alt
            if p not in points:
                points.append(p)
    return points


def fill(t: torch.Tensor, dist: str, gen: torch.Generator, high: int | None = None) -> torch.Tensor:
    """Random contents for an input of t's shape/dtype, drawn on t's device with gen (a generator
    on that device, so a sweep over large shapes costs no host time) — repeatable per seed."""
    shape, dtype, dev = t.shape, t.dtype, t.device
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen, device=dev) < 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, max(int(high or 2), 1), shape, generator=gen, device=dev, dtype=dtype)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    if dist == "normal":
        x = torch.randn(shape, generator=gen, device=dev, dtype=wide)
    elif dist == "uniform":
        x = torch.rand(shape, generator=gen, device=dev, dtype=wide)
    elif dist == "large":
        x = (torch.rand(shape, generator=gen, device=dev, dtype=wide) * 2 - 1) * 1e3
    else:  # tiny, with negatives
        x = (torch.rand(shape, generator=gen, device=dev, dtype=wide) * 2 - 1) * 1e-3
    return x.to(dtype)


# The largest magnitude each distribution of fill() draws (normal: a few sigma).
_DIST_BOUND = {"normal": 8.0, "uniform": 1.0, "large": 1e3, "tiny": 1e-3}


def fill_statistic(t: torch.Tensor, dist: str, gen: torch.Generator) -> torch.Tensor:
    """Contents for a saved row statistic (a softmax's max and sum, a norm's mean and variance)
    next to inputs drawn by fill(t, dist): positive and at least as large as any element drawn,
    as a row's max bounds its elements and the sums a backward divides by are positive. Drawn
    freely, a "max" below the row's elements sends exp(x - max) past f32's range, a state no
    forward can produce, where f32 and the float64 reference disagree about Inf."""
    hi = _DIST_BOUND.get(dist, 1e-3)
    wide = torch.float64 if t.dtype == torch.float64 else torch.float32
    x = (1 + torch.rand(t.shape, generator=gen, device=t.device, dtype=wide)) * hi
    return x.to(t.dtype)


def poison_like(shape, dtype, device) -> torch.Tensor:
    """An output buffer whose every element is wrong until written."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.empty(shape, dtype=torch.uint8, device=device).fill_(0xA5).view(torch.bool)
    return torch.full(shape, -0x5A5A5A5, dtype=dtype, device=device)


def compare_grads(got, ref, sizes) -> tuple[str, set]:
    """Gradients against torch.autograd's (ref: None where it gives none, and then ours must be
    zeros): (why not or '', the positions torch leaves None)."""
    unused = set()
    for i, (mine, theirs) in enumerate(zip(got, ref)):
        if theirs is None:
            if mine is not None and bool(mine.ne(0).any()):
                return f"input {i} gets a gradient where torch.autograd gives none", unused
            unused.add(i)
            continue
        ok, _, why = compare(mine, theirs)
        if not ok:
            return f"gradient of input {i} at sizes {sizes}: {why}", unused
    return "", unused


def compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float, str]:
    """(ok, error relative to the reference's norm, why not). ref is float64 (or the exact
    integer result); NaN and Inf must sit in the same places."""
    if out.shape != ref.shape:
        return False, math.inf, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    if not out.dtype.is_floating_point:
        if out.dtype == torch.bool:
            bad = (out.view(torch.uint8) > 1).any() or (out != ref.to(torch.bool)).any()
        else:
            bad = (out != ref.to(out.dtype)).any()
        return (not bool(bad)), 0.0 if not bad else math.inf, "integer outputs differ" if bad else ""
    o, r = out.double(), ref.double()
    nan_o, nan_r = torch.isnan(o), torch.isnan(r)
    if not torch.equal(nan_o, nan_r):
        n = int((nan_o & ~nan_r).sum())
        return False, math.inf, (f"{n} element(s) NaN where eager is not (unwritten or wrong)" if n
                                 else "NaN missing where eager has one")
    inf_o, inf_r = torch.isinf(o), torch.isinf(r)
    if not torch.equal(inf_o, inf_r) or not torch.equal(o[inf_o], r[inf_r]):
        return False, math.inf, "Inf in different places"
    finite = ~(nan_r | inf_r)
    if not finite.any():
        return True, 0.0, ""
    o, r = o[finite], r[finite]
    norm = float(r.abs().max())
    err = float((o - r).abs().max())
    rel = err / norm if norm > 0 else err
    tol = TOLERANCE.get(out.dtype, 1e-4)
    # a small absolute floor: a reference of all ~0 is compared absolutely
    ok = err <= tol * max(norm, 1e-6) + (tol * 1e-3 if norm < 1e-3 else 0.0)
    return ok, rel, "" if ok else f"error {rel:.3g} of the norm exceeds {tol:g}"


def discriminates(ref: torch.Tensor, inputs: list[torch.Tensor]) -> bool:
    """Would zeros, a constant or one of the inputs fail against ref? If not, this sweep point
    proves little (a kernel writing zeros would pass it)."""
    if not ref.dtype.is_floating_point:
        return ref.numel() > 1 and bool((ref != ref.flatten()[0]).any())
    r = ref.double()
    finite = torch.isfinite(r)
    if int(finite.sum()) < 2:
        return False
    rf = r[finite]
    tol = TOLERANCE[torch.float32]
    norm = float(rf.abs().max())
    if norm == 0:
        return False
    if float((rf - rf.mean()).abs().max()) <= tol * norm:    # constant (zeros included)
        return False
    for x in inputs:
        if x.shape == ref.shape and x.is_floating_point():
            xf = x.double()[finite]
            if float((xf - rf).abs().max()) <= tol * norm:  # the identity would pass
                return False
    return True


def varies(values: list) -> bool:
    """Did a reference value move between test points (beyond the f32 tolerance)?"""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2:
        return False
    scale = max(abs(v) for v in finite)
    return scale > 0 and max(finite) - min(finite) > TOLERANCE[torch.float32] * 10 * scale
