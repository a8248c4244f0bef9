"""Verification of a region's kernel against eager PyTorch (docs/DESIGN.md, "Verification"): nothing
is swapped in unverified. A candidate must match a float64 reference over a sweep of shapes, value
distributions and seeds, with NaN-poisoned outputs, input dependence, repeatability, untouched
inputs, and a test that a constant or zero output would not have passed."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .dtypes import torch_dtype

# tolerance on max|out - ref| relative to max|ref| (the norm), per output dtype
TOLERANCE = {torch.float32: 2e-5 * 16, torch.float64: 1e-9, torch.float16: 4e-3, torch.bfloat16: 2e-2}
# A gradient need not beat torch's own: where the fixed tolerance fails, a kernel whose error is at
# most this many times that of torch's ops on the same inputs, in the same dtypes, passes
# (torch._dynamo's accuracy check takes the same rule against eager). A backward reads what its
# forward saved, rounded to 16 bits (a softmax's output): where a row's terms cancel, torch's own
# error against the float64 recomputation is past the fixed tolerance too.
BASELINE_FACTOR = 2.0
# A matrix product sums K terms per output element, and the rounding error of such a sum in f32
# grows like sqrt(K) (K roundings of random sign: the probabilistic bound of Higham & Mary, 2019),
# not like K (the worst case, which real data does not reach). So a region with a MATMUL is held to
# TOLERANCE[dtype] * gemm_scale(K): the per-dtype tolerance up to K = GEMM_K_BASE, which is about
# the reduction length of the rows those tolerances were set on, and sqrt(K / GEMM_K_BASE) times
# it past that (x2 at K = 1024, x8 at K = 16384).
GEMM_K_BASE = 256
DISTRIBUTIONS = ("normal", "uniform", "large", "tiny")
# A sweep point is checked only where what it holds at once (point_bytes) is at most this share
# of the free device memory: the rest is the sandbox's, the timing's and the user's.
MEMORY_SHARE = 0.5
# Nodes that move no data: views in the float64 reference, no memory of their own.
VIEW_OPS = frozenset(("input", "reshape", "permute", "expand", "slice", "squeeze"))


@dataclass
class Verdict:
    ok: bool
    reason: str = ""
    checked: int = 0                    # sweep points compared
    max_error: float = 0.0              # worst relative-to-norm error seen
    sizes: list = field(default_factory=list)   # symbol values that passed
    note: str = ""                      # where the sizes checked stop short of the example (memory)

    def __bool__(self) -> bool:
        return self.ok


# A kernel with vectors along a varying last dim runs only where that dim is a multiple of its vec
# (KernelInfo.last_multiple, at most 8: 16 bytes of 16-bit elements); sweep points that keep it so
# move its symbols to VEC_SWEEP and to the example + VEC_SWEEP, which keep its residue mod 8.
VEC_SWEEP = 8


def sweep_symvals(example: list[int], pinned_limit: int = 1 << 31, multiples=()) -> list[list[int]]:
    """Every varying size at 1, a small odd size, the example and a larger one; one symbol
    moves at a time (the others stay at the example) so the sweep stays small. multiples: the
    symbols of a last dim a kernel may require to stay a multiple of its vec, which also move to
    sizes that keep it one (VEC_SWEEP): the odd ones run such a kernel's region in eager."""
    points = [list(example)]
    for s, v in enumerate(example):
        extra = (VEC_SWEEP, v + VEC_SWEEP) if s in multiples else ()
        for alt in (1, 7, v + 3 if v % 2 == 0 else v + 2, 2 * v + 1, *extra):
            if alt == v or alt < 1 or alt >= pinned_limit:
                continue
            p = list(example)
            p[s] = alt
            if p not in points:
                points.append(p)
    return points


def vec_symbols(plan, r, symvals) -> set:
    """The symbols of region r's last dim where a kernel may require it to stay a multiple of its
    vec (a ROW or COL region whose anchor's last dim varies and is even at symvals), or of a GEMM
    region's M, N and K that are multiples of 8 at symvals (its kernel's guard may be any of
    them): those sweep_symvals also moves to sizes that keep it so."""
    part = getattr(plan, "partition", None)
    if part is None:
        return set()
    region = part.region(r)
    if region["kind"] == "GEMM":   # its kernel may require any of M, N, K to stay a multiple of 8
        mm = plan.graph.node(region["anchor"])
        sizes = mm["dims"][-2:] + plan.graph.node(mm["inputs"][0])["dims"][-1:]
        return {s for d in sizes if not isinstance(d, int) and dim_value(d, symvals) % 8 == 0 for s in d[1]}
    if region["kind"] not in ("ROW", "COL"):
        return set()
    dims = plan.graph.node(region["anchor"])["dims"]
    last = dims[-1] if dims else 1
    if isinstance(last, int) or dim_value(last, symvals) % 2:
        return set()
    return set(last[1])


def dim_value(dim, symvals) -> int:
    """A size as the C core gives it (an int, or (coef, (symbol, ...))) at these symbol values."""
    if isinstance(dim, int):
        return dim
    return dim[0] * math.prod(symvals[s] for s in dim[1])


def refused(kernel, r, symvals) -> str:
    """Why kernel may not run region r at symvals ("" where it may): one with vectors along a
    varying last dim runs only where that dim is a multiple of its vec (last_multiple); the
    launchers run the region in eager elsewhere with this reason (csrc/fast/launch.cpp's too)."""
    m = getattr(kernel, "last_multiple", 1)
    if m <= 1:
        return ""
    n = dim_value(kernel.last_dim, symvals)
    if n % m == 0:
        return ""
    return f"region {r}: last dim {n} is not a multiple of {m} (kernel uses vec={getattr(kernel, 'vec', m)})"


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


def precision(dtypes) -> torch.dtype | None:
    """Of the float dtypes a computation passes through, the one with the loosest tolerance: a
    region that casts to bf16 inside (torch.autocast) is as exact as bf16, whatever the dtype of
    its outputs. None where there is no float dtype."""
    floats = [d for d in dtypes if d in TOLERANCE]
    return max(floats, key=TOLERANCE.__getitem__) if floats else None


def gemm_scale(k: int) -> float:
    """The factor a region's tolerance grows by for a matrix product of reduction length k
    (GEMM_K_BASE says why); 1 for no product (k 0)."""
    return max(1.0, math.sqrt(k / GEMM_K_BASE))


def compare_grads(got, ref, sizes, precision: torch.dtype | None = None, reduction: int = 0,
                  baseline=None) -> tuple[str, set]:
    """Gradients against torch.autograd's (ref: None where it gives none, and then ours must be
    zeros): (why not or '', the positions torch leaves None). precision, reduction, baseline: see
    compare (baseline: torch's own gradients in the region's dtypes, one per gradient, or None)."""
    unused = set()
    baseline = baseline if baseline is not None else [None] * len(got)
    for i, (mine, theirs, torch_own) in enumerate(zip(got, ref, baseline)):
        if theirs is None:
            if mine is not None and bool(mine.ne(0).any()):
                return f"input {i} gets a gradient where torch.autograd gives none", unused
            unused.add(i)
            continue
        ok, _, why = compare(mine, theirs, precision, reduction, torch_own)
        if not ok:
            return f"gradient of input {i} at sizes {sizes}: {why}", unused
    return "", unused


def compare(out: torch.Tensor, ref: torch.Tensor, precision: torch.dtype | None = None,
            reduction: int = 0, baseline: torch.Tensor | None = None) -> tuple[bool, float, str]:
    """(ok, error relative to the reference's norm, why not). ref is float64 (or the exact
    integer result); NaN and Inf must sit in the same places. precision: the least precise
    dtype the computation went through (verify.precision), when it is less precise than out's.
    reduction: the longest matrix-product reduction the computation made (0: none; gemm_scale).
    baseline: what torch itself computes from the same inputs in the same dtypes; the tolerance
    is then at least BASELINE_FACTOR times its error (see BASELINE_FACTOR)."""
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
    tol = max(TOLERANCE.get(out.dtype, 1e-4), TOLERANCE.get(precision, 0.0)) * gemm_scale(reduction)
    if baseline is not None and baseline.shape == ref.shape:
        b = baseline.double()[finite]
        if bool(torch.isfinite(b).all()):
            tol = max(tol, BASELINE_FACTOR * float((b - r).abs().max()) / max(norm, 1e-300))
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


# ---------------------------------------------------------------------------------- sizes that fit

def free_bytes(device) -> int | None:
    """Device memory this process may still use: what the driver reports free plus what torch's
    allocator holds unused; None off the GPU (no limit)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def point_bytes(plan, r, symvals) -> int:
    """What checking region r at one sweep point holds at once, at most: each input, its clone and
    its float64 copy; every value the float64 reference computes (views excepted); two launches'
    outputs; and as much again while the input dependence is checked beside them."""
    info = plan.regions[r]

    def numel(v):
        return math.prod(plan.graph.sizes(v, symvals))

    def itemsize(v):
        return torch_dtype(plan.nodes[v]["dtype"]).itemsize
    total = sum(numel(v) * (2 * itemsize(v) + 8) for v in info.inputs)
    inputs = set(info.inputs)
    total += sum(numel(v) * 8 for v in info.nodes if v not in inputs and plan.nodes[v]["op"] not in VIEW_OPS)
    total += sum(numel(v) * 2 * itemsize(v) for v in info.outputs)
    return 2 * total


def plan_points(ex, r, example_symvals, free: int | None = -1) -> tuple[list, str]:
    """The sweep points region r is checked at (the sandbox runs each candidate at the same ones):
    (points, note). The first point is the example, or, where checking at the example would not
    fit MEMORY_SHARE of the free memory (free_bytes; free=None: no limit), the example with every
    varying size divided by the smallest power of two that makes it fit, and the note says so;
    the other points are sweep_symvals' that the graph admits and that fit. No points where not
    even all sizes at 1 fit (or nothing varies), and the note says why."""
    plan = ex.plan
    if free == -1:
        free = free_bytes(getattr(ex, "device", "cpu"))
    limit = None if free is None else MEMORY_SHARE * free

    def fits(p):
        return limit is None or point_bytes(plan, r, p) <= limit
    example = list(example_symvals)
    base, note = example, ""
    if not fits(example):
        base, f = None, 2
        while any(v // (f // 2) > 1 for v in example):
            p = [max(1, v // f) for v in example]
            if plan.admits(p) and fits(p):
                base = p
                break
            f *= 2
        need = point_bytes(plan, r, example) / 2 ** 30
        if base is None:
            return [], (f"too large to verify in the free GPU memory (~{need:.3g} GiB at the example sizes, "
                        f"{free / 2 ** 30:.3g} GiB free)")
        note = (f"the example {example} does not fit the free GPU memory (~{need:.3g} GiB, "
                f"{free / 2 ** 30:.3g} GiB free): checked at {base} in its stead")
    points = [base]
    for p in sweep_symvals(base, multiples=vec_symbols(plan, r, base))[1:]:
        if not plan.admits(p) or not fits(p):
            continue
        if any(math.prod(plan.graph.sizes(v, p)) > (1 << 28) for v in plan.regions[r].inputs + plan.regions[r].outputs):
            continue  # keep verification memory bounded; the first point is never skipped this way
        points.append(p)
    return points, note


# ---------------------------------------------------------------------------------- a region's kernel
# `ex` below is a CUDA executor (runtime/cuda.py) whose plan holds the region: region_inputs(),
# reference() (the region in float64 through torch), launch(), plan, device, seed.

def gate(ex, r, kernel, symvals, nostats=False) -> str:
    """One quick check against the float64 reference (NaN-poisoned outputs); '' when it passes.
    nostats: of the entry point without the saved statistics (the outputs it writes)."""
    why = refused(kernel, r, symvals)
    if why:   # never launched where it cannot run
        return why
    gen = torch.Generator(device=ex.device).manual_seed(ex.seed + 17)
    inputs = ex.region_inputs(r, symvals, "normal", gen)
    outs = ex.launch(kernel, r, symvals, inputs, poison=True, nostats=nostats)
    for o, ref in zip(outs, ex.reference(r, symvals, inputs)):
        ok, _, why = compare(o, ref, ex.plan.precision(r), ex.plan.reduction(r, symvals))
        if not ok:
            return why
    return ""


def gate_nostats(ex, r, kernel, symvals) -> str:
    """The inference entry point (the same body, the statistics' stores compiled out) gets a
    gate of its own, so no entry point runs unchecked; '' where it passes or there is none."""
    return gate(ex, r, kernel, symvals, nostats=True) if kernel.fn_nostats else ""


def verify_region(ex, r, kernel, example_symvals, points=None, note: str = "") -> Verdict:
    """The full check before a kernel is trusted: every sweep point the captured graph admits,
    several value distributions at the example sizes, outputs poisoned, run twice (a race moves
    the result), inputs untouched, input dependence, and a test point that tells the kernel
    from a constant output. points, note: plan_points' (made here where not given): sizes that
    fit the free memory, the first one standing for the example. A point where the kernel may not
    run (refused: its last dim no multiple of its vec) is one where the region runs in eager: not
    checked, and the note says so; the first point must not be one."""
    plan = ex.plan
    info = plan.regions[r]
    if points is None:
        points, note = plan_points(ex, r, example_symvals)
    if not points:
        return Verdict(False, note or "no sizes to check at")
    why = refused(kernel, r, points[0])
    if why:
        return Verdict(False, why)
    eager = [p for p in points if refused(kernel, r, p)]
    if eager:
        points = [p for p in points if p not in eager]
        m = kernel.last_multiple
        note = "; ".join(n for n in (note, f"{len(eager)} sizes whose last dim is no multiple of {m} run in eager")
                         if n)
    example_symvals = points[0]
    gen = torch.Generator(device=ex.device).manual_seed(ex.seed + 1000 * r)
    verdict = Verdict(ok=True, note=note)
    strong = False
    seen = [[] for _ in info.outputs]   # each output's reference at every point (its first values)
    least = plan.precision(r)
    for symvals in points:   # sizes the graph admits and that fit (plan_points)
        for dist in DISTRIBUTIONS if symvals == example_symvals else ("normal", "large"):
            inputs = ex.region_inputs(r, symvals, dist, gen)
            clones = [x.clone() for x in inputs]
            out1 = ex.launch(kernel, r, symvals, inputs, poison=True)
            ref = ex.reference(r, symvals, clones)
            out2 = ex.launch(kernel, r, symvals, inputs, poison=True)
            torch.cuda.synchronize(ex.device)
            for x, c in zip(inputs, clones):
                if not torch.equal(x, c):
                    return Verdict(False, "the kernel modified its input")
            for j, (o1, o2, rf) in enumerate(zip(out1, out2, ref)):
                ok, err, why = compare(o1, rf, least, plan.reduction(r, symvals))
                verdict.checked += 1
                if not ok:
                    return Verdict(False, f"output {j} at sizes {symvals}, {dist} inputs: {why}")
                if not torch.equal(o1.nan_to_num(0.0) if o1.is_floating_point() else o1,
                                   o2.nan_to_num(0.0) if o2.is_floating_point() else o2):
                    return Verdict(False, "two runs on the same inputs differ (a race)")
                verdict.max_error = max(verdict.max_error, err)
                strong = strong or discriminates(rf, clones)
                if rf.numel() and rf.is_floating_point():
                    seen[j].append(float(rf.flatten()[0]))
            verdict.sizes.append(list(symvals))
        # input dependence: change each float input a little, the output must move where eager's does
        if symvals == example_symvals:
            why = check_dependence(ex, kernel, r, symvals, gen)
            if why:
                return Verdict(False, why)
    # a small output (a loss) tells a constant apart across points: it matched a reference
    # that moved from one input draw to the next
    strong = strong or any(varies(vals) for vals in seen)
    if not strong and any(plan.nodes[v]["dtype"] in ("f32", "f16", "bf16", "f64") for v in info.outputs):
        verdict = Verdict(False, "no test point could tell this kernel from a constant output",
                          verdict.checked, verdict.max_error, verdict.sizes, note)
    return verdict


def check_dependence(ex, kernel, r, symvals, gen) -> str:
    """Each float input moved a little: the kernel's output must move wherever eager's does."""
    inputs = ex.region_inputs(r, symvals, "normal", gen)
    base = ex.launch(kernel, r, symvals, inputs)
    ref_base = ex.reference(r, symvals, inputs)
    for i, x in enumerate(inputs):
        if not x.is_floating_point():
            continue
        moved = list(inputs)
        moved[i] = x + torch.randn(x.shape, generator=gen, device=x.device).to(x.dtype) * 0.5
        out = ex.launch(kernel, r, symvals, moved)
        ref = ex.reference(r, symvals, moved)
        for o, b, rf, rb in zip(out, base, ref, ref_base):
            if not o.is_floating_point():
                continue
            eager_moved = not torch.allclose(rf, rb, equal_nan=True)
            kernel_moved = not torch.equal(o.nan_to_num(0.0), b.nan_to_num(0.0))
            if eager_moved and not kernel_moved:
                return f"output ignores input {i} (eager's output changes with it)"
    return ""


def envelope(verdict: Verdict, names) -> str:
    """The verified envelope as the report gives it; names: the graph's size symbols."""
    sizes = sorted({tuple(s) for s in verdict.sizes})
    text = f"{verdict.checked} checks, sizes {describe_sizes(names, sizes)}, max err {verdict.max_error:.2g}"
    return f"{text} ({verdict.note})" if verdict.note else text


def describe_sizes(names, sizes) -> str:
    """Each size symbol's range over the points checked: "s0∈[1,301]"."""
    if not names:
        return "pinned"
    lo = [min(s[i] for s in sizes) for i in range(len(names))]
    hi = [max(s[i] for s in sizes) for i in range(len(names))]
    return ", ".join(f"{n}∈[{a},{b}]" for n, a, b in zip(names, lo, hi))
