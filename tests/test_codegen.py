# test_codegen.py — fusion (csrc/fuse/), default schedules (csrc/tune/) and CUDA generation
# (csrc/codegen/) through kbench._C: the partition of each model-like graph, run region by
# region in the interpreter, computes what the whole graph computes; generation is deterministic
# (golden sources under tests/golden_cuda/, KBENCH_UPDATE_GOLDEN=1 rewrites them); illegal
# genomes are refused with ValueError; where NVRTC is present (required where
# KBENCH_REQUIRE_NVRTC=1, as in CI) every kernel compiles for sm_80 and sm_90; on a GPU (-m gpu)
# every kernel matches the interpreter.
import math
import os
import re
import pathlib

import pytest
import torch

from kbench import _C
from kbench.runtime.interp import run_graph, run_region

DT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64,
      "i64": torch.int64, "i32": torch.int32, "bool": torch.bool}
GOLDEN = pathlib.Path(__file__).parent / "golden_cuda"


class Builder:
    """Terse graph building: dims are ints or symbol names ("s0")."""

    def __init__(self, **syms):
        self.g = _C.Graph()
        self.example = list(syms.values())
        self.sym = {name: self.g.add_symbol(name, ex) for name, ex in syms.items()}

    def dims(self, dims):
        return [(1, (self.sym[d],)) if isinstance(d, str) else d for d in dims]

    def input(self, name, dtype, dims, kind="user"):
        return self.g.add_input(name, kind, dtype, self.dims(dims))

    def op(self, op, inputs, dtype, dims, **kw):
        return self.g.add_node(op, list(inputs), dtype, self.dims(dims), **kw)


def layernorm(b, dt, rows, n, x, w, bias, eps=1e-5):
    full, keep = [rows, n], [rows, 1]
    mean = b.op("mean", [x], dt, keep, axes=2)
    xc = b.op("sub", [x, b.op("expand", [mean], dt, full)], dt, full)
    var = b.op("mean", [b.op("mul", [xc, xc], dt, full)], dt, keep, axes=2)
    eps_c = b.op("const", [], dt, keep, scalars=(eps, 0.0))
    rstd = b.op("rsqrt", [b.op("add", [var, eps_c], dt, keep)], dt, keep)
    y = b.op("mul", [xc, b.op("expand", [rstd], dt, full)], dt, full)
    we = b.op("expand", [b.op("reshape", [w], dt, [1, n])], dt, full)
    be = b.op("expand", [b.op("reshape", [bias], dt, [1, n])], dt, full)
    return b.op("add", [b.op("mul", [y, we], dt, full), be], dt, full), mean, rstd


def g_layernorm(dt):
    b = Builder(s0=6)
    x, w, bias = b.input("x", dt, ["s0", 1024]), b.input("w", dt, [1024], "param"), b.input("b", dt, [1024], "param")
    y, mean, rstd = layernorm(b, dt, "s0", 1024, x, w, bias)
    for v in (y, mean, rstd):
        b.g.add_output(v)
    return b, ["ROW"], 1


def g_res_layernorm(dt):
    b = Builder(s0=5)
    x, r = b.input("x", dt, ["s0", 768]), b.input("res", dt, ["s0", 768])
    w, bias = b.input("w", dt, [768], "param"), b.input("b", dt, [768], "param")
    h = b.op("add", [x, r], dt, ["s0", 768])
    y, _, _ = layernorm(b, dt, "s0", 768, h, w, bias)
    b.g.add_output(h)
    b.g.add_output(y)
    return b, ["ROW"], 1


def g_softmax(dt, n=1000):
    b = Builder(s0=5, s1=300)
    x = b.input("x", dt, ["s0", n])
    full, keep = ["s0", n], ["s0", 1]
    m = b.op("expand", [b.op("max", [x], dt, keep, axes=2)], dt, full)
    e = b.op("exp", [b.op("sub", [x, m], dt, full)], dt, full)
    s = b.op("expand", [b.op("sum", [e], dt, keep, axes=2)], dt, full)
    b.g.add_output(b.op("div", [e, s], dt, full))
    return b, ["ROW"], 1


def g_softmax_dyn(dt):
    return g_softmax(dt, "s1")


def g_bias_gelu(dt):
    b = Builder(s0=7)
    x, bias = b.input("x", dt, ["s0", 768]), b.input("bias", dt, [768], "param")
    be = b.op("expand", [b.op("reshape", [bias], dt, [1, 768])], dt, ["s0", 768])
    b.g.add_output(b.op("gelu_tanh", [b.op("add", [x, be], dt, ["s0", 768])], dt, ["s0", 768]))
    return b, ["POINTWISE"], 1


def g_swiglu(dt):
    b = Builder(s0=7)
    x = b.input("x", dt, ["s0", 1024])
    a = b.op("slice", [x], dt, ["s0", 512], axis=1, start=0, step=1)
    gate = b.op("slice", [x], dt, ["s0", 512], axis=1, start=512, step=1)
    b.g.add_output(b.op("mul", [b.op("silu", [a], dt, ["s0", 512]), gate], dt, ["s0", 512]))
    return b, ["POINTWISE"], 1


def g_col_sum(dt):
    b = Builder(s0=3, s1=11)
    gy = b.input("gy", dt, ["s0", "s1", 256])
    gf = b.op("cast", [gy], "f32", ["s0", "s1", 256])
    b.g.add_output(b.op("cast", [b.op("sum", [gf], "f32", [256], axes=3)], dt, [256]))
    b.g.add_output(b.op("sum", [b.op("mul", [gf, gf], "f32", ["s0", "s1", 256])], "f32", [256], axes=3))
    return b, ["ROW"], 1  # one pass of sums over the leading dims: ROW with column sums


def g_col_var(dt):
    """Batch statistics over the rows: the variance reads the mean, so the region stays COL."""
    b = Builder(s0=9)
    x = b.input("x", dt, ["s0", 384])
    xf = b.op("cast", [x], "f32", ["s0", 384])
    m = b.op("mean", [xf], "f32", [1, 384], axes=1)
    xc = b.op("sub", [xf, b.op("expand", [m], "f32", ["s0", 384])], "f32", ["s0", 384])
    b.g.add_output(b.op("mean", [b.op("mul", [xc, xc], "f32", ["s0", 384])], "f32", [1, 384], axes=1))
    b.g.add_output(m)
    return b, ["COL"], 1


def g_cross_entropy(dt):
    b = Builder(s0=5)
    x, t = b.input("logits", dt, ["s0", 1000]), b.input("target", "i64", ["s0"])
    full, keep = ["s0", 1000], ["s0", 1]
    xf = b.op("cast", [x], "f32", full)
    m = b.op("max", [xf], "f32", keep, axes=2)
    sh = b.op("sub", [xf, b.op("expand", [m], "f32", full)], "f32", full)
    lse = b.op("log", [b.op("sum", [b.op("exp", [sh], "f32", full)], "f32", keep, axes=2)], "f32", keep)
    logp = b.op("sub", [sh, b.op("expand", [lse], "f32", full)], "f32", full)
    picked = b.op("gather", [logp, b.op("reshape", [t], "i64", keep)], "f32", keep, axis=1)
    nll = b.op("reshape", [b.op("neg", [picked], "f32", keep)], "f32", ["s0"])
    b.g.add_output(b.op("mean", [nll], "f32", [], axes=1))
    b.g.add_output(lse)
    return b, ["ROW", "ROW"], 1000


def g_layernorm_bwd(dt):
    """LayerNorm's backward: dx, and dweight / dbias as column sums of the one ROW region."""
    b = Builder(s0=6)
    x, w, bias = b.input("x", dt, ["s0", 1024]), b.input("w", dt, [1024], "param"), b.input("b", dt, [1024], "param")
    y, _, _ = layernorm(b, dt, "s0", 1024, x, w, bias)
    b.g.add_output(y)
    b.g = b.g.grad([True, True, True])
    return b, ["ROW"], 1


def g_row_colsum(dt):
    """A ROW region with column sums beside its row statistics: a sum, a mean finished by a
    cast and a reshape, and a full-size output."""
    b = Builder(s0=37)
    x, w = b.input("x", dt, ["s0", 256]), b.input("w", dt, [256], "param")
    full, keep = ["s0", 256], ["s0", 1]
    xf = b.op("cast", [x], "f32", full)
    xc = b.op("sub", [xf, b.op("expand", [b.op("mean", [xf], "f32", keep, axes=2)], "f32", full)], "f32", full)
    wf = b.op("expand", [b.op("reshape", [b.op("cast", [w], "f32", [256])], "f32", [1, 256])], "f32", full)
    b.g.add_output(b.op("cast", [b.op("mul", [xc, wf], "f32", full)], dt, full))
    sq = b.op("mean", [b.op("mul", [xc, xc], "f32", full)], "f32", [1, 256], axes=1)
    b.g.add_output(b.op("cast", [b.op("reshape", [sq], "f32", [256])], dt, [256]))
    b.g.add_output(b.op("sum", [x], dt, [1, 256], axes=1))
    return b, ["ROW"], 1


def g_swiglu_bwd(dt):
    """x.chunk(2)'s backward: dx is a select on the column index between the two halves'
    gradients, recomputed where dx reads them: one POINTWISE region over dx's shape."""
    b, _, _ = g_swiglu(dt)
    b.g = b.g.grad([True])
    return b, ["POINTWISE"], 1


def g_ce_bwd_index_first(dt, v=1000):
    """Cross-entropy's backward with its nodes in an order where the targets' index work comes
    first and the softmax statistics before the one-hot mask iota == target: the mask (and the
    work on it) is recomputed in the row kernel, which then also takes the mask's row sum, so
    nothing of the logits' size but dlogits is written."""
    b = Builder(s0=5)
    x, t, go = b.input("logits", dt, ["s0", v]), b.input("target", "i64", ["s0"]), b.input("grad_out", "f32", ["s0"])
    full, keep, rows = ["s0", v], ["s0", 1], ["s0"]
    valid = b.op("ne", [t, b.op("const", [], "i64", rows, scalars=(-100.0, 0.0))], "bool", rows)
    tt = b.op("where", [valid, t, b.op("const", [], "i64", rows, scalars=(0.0, 0.0))], "i64", rows)
    gg = b.op("neg", [b.op("where", [valid, go, b.op("const", [], "f32", rows, scalars=(0.0, 0.0))], "f32", rows)],
              "f32", rows)
    xf = b.op("cast", [x], "f32", full)
    m = b.op("max", [xf], "f32", keep, axes=2, nograd=True)
    e = b.op("exp", [b.op("sub", [xf, b.op("expand", [m], "f32", full)], "f32", full)], "f32", full)
    s = b.op("sum", [e], "f32", keep, axes=2)
    mask = b.op("eq", [b.op("iota", [], "i64", full, axis=1),
                       b.op("expand", [b.op("reshape", [tt], "i64", keep)], "i64", full)], "bool", full)
    d = b.op("where", [mask, b.op("expand", [b.op("reshape", [gg], "f32", keep)], "f32", full),
                       b.op("const", [], "f32", full, scalars=(0.0, 0.0))], "f32", full)
    ds = b.op("sum", [b.op("neg", [d], "f32", full)], "f32", keep, axes=2)
    dx = b.op("add", [d, b.op("mul", [b.op("expand", [b.op("div", [ds, s], "f32", keep)], "f32", full), e], "f32", full)],
              "f32", full)
    b.g.add_output(b.op("cast", [dx], dt, full))
    return b, ["POINTWISE", "ROW"], v


def g_onehot(dt):
    """A one-hot mask of a per-row index as a graph output, and its row sums: the mask floats
    (an iota and a broadcast are all it reads), so the row kernel recomputes it and a kernel of
    its own writes the output; neither reads a materialized mask."""
    b = Builder(s0=6)
    t = b.input("target", "i64", ["s0"])
    full, keep = ["s0", 96], ["s0", 1]
    mask = b.op("eq", [b.op("iota", [], "i64", full, axis=1),
                       b.op("expand", [b.op("reshape", [t], "i64", keep)], "i64", full)], "bool", full)
    hot = b.op("cast", [mask], dt, full)
    b.g.add_output(hot)
    b.g.add_output(b.op("sum", [b.op("cast", [mask], "f32", full)], "f32", keep, axes=2))
    return b, ["ROW", "POINTWISE"], 96


def g_masked_center(dt):
    """x minus its row sum where the column is below 200, 0 elsewhere: the mask (an integer
    comparison of the column) is used in both passes, so a register row cache keeps it."""
    b = Builder(s0=5)
    full, keep = ["s0", 256], ["s0", 1]
    x = b.op("cast", [b.input("x", dt, full)], "f32", full)
    mask = b.op("lt", [b.op("iota", [], "i64", full, axis=1), b.op("const", [], "i64", full, scalars=(200.0, 0.0))],
                "bool", full)
    zero = b.op("const", [], "f32", full, scalars=(0.0, 0.0))
    s = b.op("sum", [b.op("where", [mask, x, zero], "f32", full)], "f32", keep, axes=2)
    shifted = b.op("sub", [x, b.op("expand", [s], "f32", full)], "f32", full)
    b.g.add_output(b.op("cast", [b.op("where", [mask, shifted, zero], "f32", full)], dt, full))
    return b, ["ROW"], 1


GRAPHS = {"layernorm": g_layernorm, "res_layernorm": g_res_layernorm, "softmax": g_softmax,
          "softmax_dyn": g_softmax_dyn, "bias_gelu": g_bias_gelu, "swiglu": g_swiglu, "col_sum": g_col_sum,
          "cross_entropy": g_cross_entropy, "layernorm_bwd": g_layernorm_bwd, "col_var": g_col_var, "row_colsum": g_row_colsum,
          "swiglu_bwd": g_swiglu_bwd, "ce_bwd_index_first": g_ce_bwd_index_first, "onehot": g_onehot,
          "masked_center": g_masked_center}
CASES = [(name, dt) for name in GRAPHS for dt in ("f32", "bf16", "f16")]


def build(name, dt):
    b, kinds, bound = GRAPHS[name](dt)
    return b.g, b.example, kinds, bound


def random_inputs(g, symvals, bound, gen):
    ins = []
    for v in g.inputs:
        nd, shape = g.node(v), g.sizes(v, symvals)
        if nd["dtype"] in ("i64", "i32"):
            ins.append(torch.randint(0, bound, shape, generator=gen, dtype=DT[nd["dtype"]]))
        else:
            ins.append(torch.randn(shape, generator=gen, dtype=torch.float64).to(DT[nd["dtype"]]))
    return ins


def interp_region(p, g, r, symvals, values):
    rg = p.region(r)
    outs = run_region(p, r, symvals, [values[v] for v in rg["inputs"]])
    return dict(zip(rg["outputs"], outs))


def tol(dtype):
    return {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 2e-5}.get(dtype, 1e-12)


def assert_close(got, want, what):
    if not got.dtype.is_floating_point:
        assert torch.equal(got, want), what
        return
    g64, w64 = got.double(), want.double()
    scale = max(1.0, w64.abs().max().item()) if w64.numel() else 1.0
    err = (g64 - w64).abs().max().item() if w64.numel() else 0.0
    assert err <= tol(got.dtype) * scale, f"{what}: max error {err:.3g} (scale {scale:.3g})"


# ------------------------------------------------------------------ fusion

@pytest.mark.parametrize("name,dt", CASES)
def test_partition_kinds(name, dt):
    g, _, kinds, _ = build(name, dt)
    p = g.partition()
    assert [p.region(r)["kind"] for r in range(len(p))] == kinds
    text = str(p)
    assert text.startswith("region 0 ") and text == str(g.partition())  # stable text


@pytest.mark.parametrize("name,dt", CASES)
def test_regions_compute_the_graph(name, dt):
    g, symvals, _, bound = build(name, dt)
    p = g.partition()
    gen = torch.Generator().manual_seed(0)
    for sv in (symvals, [max(1, s // 2 + 1) for s in symvals]):
        inputs = random_inputs(g, sv, bound, gen)
        want = run_graph(g, sv, inputs)
        values = dict(zip(g.inputs, inputs))
        for r in range(len(p)):
            values.update(interp_region(p, g, r, sv, values))
        for v, w in zip(g.outputs, want):
            assert_close(values[v], w, f"{name}/{dt} output %{v}")


def test_layernorm_is_one_row_region_with_stats():
    g, _, _, _ = build("layernorm", "bf16")
    p = g.partition()
    rg = p.region(0)
    assert rg["kind"] == "ROW" and rg["reduce_axes"] == 0b10 and rg["anchor"] == 0
    assert rg["inputs"] == [0, 1, 2] and len(rg["outputs"]) == 3


def test_views_of_intermediates_end_the_region():
    b = Builder(s0=4)
    x = b.input("x", "f32", ["s0", 8])
    e = b.op("exp", [x], "f32", ["s0", 8])
    t = b.op("permute", [e], "f32", [8, "s0"], perm=[1, 0])
    b.g.add_output(b.op("add", [t, t], "f32", [8, "s0"]))
    p = b.g.partition()
    assert [p.region(r)["kind"] for r in range(len(p))] == ["POINTWISE", "POINTWISE"]
    assert p.region(1)["inputs"] == [e]  # the second kernel reads the materialized exp, transposed


def _full_size_outputs(g, p, dims):
    return [(r, v) for r in range(len(p)) for v in p.region(r)["outputs"] if g.node(v)["dims"] == dims]


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_swiglu_backward_materializes_nothing(dt):
    """One kernel over dx's shape: it reads x and the upstream gradient once each and writes dx;
    no half-size gradient and no zero-padded copy is a region output."""
    g, _, _, _ = build("swiglu_bwd", dt)
    p = g.partition()
    reg = p.region(0)
    assert len(p) == 1 and reg["kind"] == "POINTWISE", str(p)
    assert reg["inputs"] == list(g.inputs) and reg["outputs"] == list(g.outputs)
    assert g.node(reg["anchor"])["dims"] == g.node(g.outputs[0])["dims"]
    full = [(g.node(v)["op"], g.node(v)["dims"]) for v in reg["nodes"]]
    full = [op for op, dims in full if dims == g.node(reg["anchor"])["dims"]]
    assert full.count("gather") == 2 and full.count("where") == 1 and "add" not in full  # a select, no pads summed


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_swiglu_backward_reads_each_half_where_selected(dt):
    """dx = where(a1 < 512, g0[min(a1, 511)], g1[max(a1 - 512, 0)]): each branch is generated
    under its column range, so the clamps drop out, the halves read as 16-byte vector loads at
    a1 and a1 - 512 that only chunks the branch selects issue, and no index goes through float."""
    g, _, _, _ = build("swiglu_bwd", dt)
    src = _C.generate(g.partition(), 0, 90, None).source
    vec = 4 if dt == "f32" else 8
    body = src[src.index("if (i0 + %d <= n)" % vec):src.index("// the tail")]
    loads = [ln for ln in body.splitlines() if "kb_ld<" in ln]
    assert len(loads) == 5, body  # dy and x at both halves' positions, x's other half for the gate
    assert sum("(a1_0 < 512) ?" in ln for ln in loads) == 3 and sum("(a1_0 >= 512) ?" in ln for ln in loads) == 2, body
    assert "(a1_0 + -512)" in body and "(a1_0 + 512)" in body
    assert len(re.findall(r"if \(v\d+ != 0\.f\) \{", body)) == 1, body  # one side computed per element
    assert "(float)(a1)" not in src and "out of range" not in src and "kb_minf(" not in src[src.index("__global__"):], src
    tail = src[src.index("// the tail"):]
    assert "grad_out0[(a1 >= 512) ? (a0 * 512 + (a1 + -512)) : 0]" in tail, tail  # one element: the read is guarded


def test_select_over_uneven_halves_reads_element_by_element():
    """Halves that do not start at a whole vector: the branch's reads stay guarded per element
    (no vector load may straddle the split)."""
    b = Builder(s0=3)
    x = b.input("x", "f32", ["s0", 1002])
    lo = b.op("slice", [x], "f32", ["s0", 501], axis=1, start=0, step=1)
    hi = b.op("slice", [x], "f32", ["s0", 501], axis=1, start=501, step=1)
    b.g.add_output(b.op("mul", [b.op("silu", [lo], "f32", ["s0", 501]), hi], "f32", ["s0", 501]))
    g = b.g.grad([True])
    p = g.partition()
    genome = _C.Genome.parse("threads=256 vec=2 rows=1 items=1 cache=regs two_pass=1 fast_math=0 persistent=0 col_split=1")
    src = _C.generate(p, 0, 90, genome).source
    assert "(a1 < 501) ?" in src and "(a1 >= 501) ?" in src, src
    assert not any("kb_ld<" in ln and "?" in ln for ln in src.splitlines()), src


def test_row_cache_is_filled_by_every_kind_of_node():
    """A value the register row cache keeps is stored in the pass that first computes it, also
    where it is an integer comparison of coordinates (generated apart from other pointwise work):
    a row-cache array read by a later pass but never written would be uninitialized registers
    (on a GPU, test_kernels_match_interpreter runs this graph)."""
    g, symvals, _, _ = build("masked_center", "f32")
    p = g.partition()
    cached = 0
    for genome in variants(p, 0, symvals):
        src = _C.generate(p, 0, 90, genome).source
        for arr in set(re.findall(r"rc(\d+)\[u\]", src)):
            cached += 1
            assert re.search(r"rc%s\[u\]\[[^\]]*\] = " % arr, src), (str(genome), arr, src)
    assert cached, "no variant keeps a value in the register row cache"


def test_cross_entropy_backward_recomputes_the_mask():
    """Whatever the node order, the one-hot mask iota == target and the work on it stay inside
    the row kernel: the only region output of the logits' size is dlogits."""
    g, _, _, _ = build("ce_bwd_index_first", "f32")
    p = g.partition()
    full = g.node(g.inputs[0])["dims"]
    assert _full_size_outputs(g, p, full) == [(1, g.outputs[0])], str(p)
    row = p.region(1)
    assert row["kind"] == "ROW" and any(g.node(v)["op"] == "eq" for v in row["nodes"])
    # the real cross-entropy backward (forward nodes first): one row kernel, dlogits its only output
    bwd = build("cross_entropy", "f32")[0]
    p = bwd.partition()
    assert [p.region(r)["kind"] for r in range(len(p))] == ["ROW", "ROW"]


def test_extern_is_a_boundary():
    b = Builder(s0=4)
    x = b.input("x", "f32", ["s0", 8])
    e = b.op("exp", [x], "f32", ["s0", 8])
    mm = b.op("extern", [e], "f32", ["s0", 8], index=0)
    b.g.add_output(b.op("relu", [mm], "f32", ["s0", 8]))
    p = b.g.partition()
    assert [p.region(r)["kind"] for r in range(len(p))] == ["POINTWISE", "EXTERN", "POINTWISE"]
    with pytest.raises(ValueError):
        _C.generate(p, 1, 90, None)


# ------------------------------------------------------------------ schedules and generation

@pytest.mark.parametrize("name,dt", CASES)
def test_generate_default_is_deterministic(name, dt):
    g, symvals, _, _ = build(name, dt)
    p = g.partition()
    for r in range(len(p)):
        genome = _C.genome_default(p, r, symvals)
        k = _C.generate(p, r, 90, None)
        assert k.genome == genome
        again = _C.generate(build(name, dt)[0].partition(), r, 90, genome)
        assert again.source == k.source, "same region and genome, different source"
        assert k.name in k.source and f"__launch_bounds__({k.block})" in k.source
        assert k.units_per_block >= 1 and k.nkernels in (1, 2)
        body = k.source.split("\n\n", 1)[1]  # headers only where the kernel uses the type
        assert ("cuda_bf16.h" in k.source) == ("bfloat16" in body)
        assert ("cuda_fp16.h" in k.source) == ("half" in body.replace("kb_half", ""))   # not the variable


def test_genome_text_errors():
    g, _, _, _ = build("softmax", "f32")
    p = g.partition()
    for bad in ("threads=256 warps=4", "cache=disk", "vec=3", "threads=100", "threads=256 rows=3",
                "threads=256 col_split=4"):
        with pytest.raises(ValueError):   # the text (Genome.parse) or the genome (codegen)
            _C.generate(p, 0, 90, _C.Genome.parse(bad))
    # a row length that varies cannot live in registers
    pd = build("softmax_dyn", "f32")[0].partition()
    with pytest.raises(ValueError):
        _C.generate(pd, 0, 90, _C.Genome.parse("threads=256 cache=regs"))
    assert _C.genome_default(pd, 0, [5, 300]).cache == "reread"
    with pytest.raises(TypeError):        # a genome is a Genome, not its text
        _C.generate(p, 0, 90, "threads=256 vec=1")


def test_default_genomes():
    g, sv, _, _ = build("layernorm", "bf16")
    genome = _C.genome_default(g.partition(), 0, sv)
    assert genome.vec == 8 and genome.cache == "regs"  # 16-byte bf16 vectors, the row in registers
    g, sv, _, _ = build("bias_gelu", "f32")
    assert _C.genome_default(g.partition(), 0, sv).vec == 4
    g, sv, _, _ = build("col_sum", "f32")
    assert _C.genome_default(g.partition(), 0, sv).col_split >= 1


def capture_task(task, dt, cols=4096):
    """A benchmark task's module captured for CUDA at 64 x cols (the batch dims symbolic)."""
    from kbench import api
    from kbench.bench.tasks import TASKS
    t = TASKS[task]
    model = t.build(dict(shape=(64, cols)), dt, "cpu", seed=0)
    x = tuple(t.inputs(dict(shape=(64, cols)), dt, "cpu", seed=1))
    with torch.no_grad():
        return api._fresh_capture(model, x, "cuda")


@pytest.mark.parametrize("task,dt,rows,items,threads", [
    ("bias_gelu_erf", torch.bfloat16, 8192, 4, 256), ("bias_gelu_erf", torch.bfloat16, 256, 1, 128),
    ("bias_gelu_erf", torch.float32, 8192, 1, 128), ("bias_gelu_tanh", torch.bfloat16, 8192, 1, 128),
    ("swiglu_two", torch.bfloat16, 8192, 1, 128)])
def test_default_pointwise_items(task, dt, rows, items, threads):
    """A pointwise region takes one 16-byte vector per thread, 128 threads a block, unless its body
    is heavy (a precise erf on eight bf16 elements a vector) and the grid has waves to spare:
    then four, 256 threads (H100 at 8192x4096: erf bf16 48.4 us with four against 51.2 with one;
    tanh bf16, fast math, 44.1 with one against 46.7 with four)."""
    ex = capture_task(task, dt)
    p = ex.graph.partition()
    r = next(i for i in range(len(p)) if p.region(i)["kind"] == "POINTWISE")
    symvals = [rows if v == 64 else v for v in ex.example_symvals]     # the batch, at `rows`
    gn = _C.genome_default(p, r, symvals)
    assert (gn.items, gn.threads) == (items, threads), gn


def test_grid_cap_is_only_a_real_one():
    """max_blocks is the persistent cap alone: a region with two dynamic dims (SwiGLU of two
    [s0, s1] inputs) and 512 units a block once had its grid's 2^31 - 1 clamp at huge sizes
    taken for a cap, which the loader then cut to one wave of resident blocks (H100 f32: 133.5
    us against 129.1 uncapped)."""
    ex = capture_task("swiglu_two", torch.float32)
    p = ex.graph.partition()
    assert len(ex.example_symvals) == 2
    genome = _C.Genome(threads=128, vec=4, rows=1, items=1, cache="regs", two_pass=1, fast_math=0, col_split=1)
    k = _C.generate(p, 0, 90, genome.replace(persistent=0))
    assert k.max_blocks == 0 and k.grid_units[1] == (0, 1)
    k = _C.generate(p, 0, 90, genome.replace(persistent=1))
    assert 0 < k.max_blocks < 2 ** 20    # blocks that fit at once: a few per SM


def column_sum_backward(module, dt, cols):
    """(partition, ROW region) of the backward of a LayerNorm ("ln") or bias+GELU tanh
    ("bias_gelu") over rows of `cols`, every float input wanting its gradient: a row kernel with
    column sums (dgamma/dbeta, dbias)."""
    from kbench import api
    if module == "ln":
        model, x = torch.nn.LayerNorm(cols).to(dt), (torch.randn(64, cols, dtype=dt),)
        with torch.no_grad():
            g = api._fresh_capture(model, x, "cuda").graph
    else:
        g = capture_task("bias_gelu_tanh", dt, cols).graph
    p = g.partition()
    p.save_stats(0)
    region = p.region(0)
    bp = p.region_graph(0).grad([True] * len(region["inputs"]), saved=region["saved"]).partition()
    return bp, next(i for i in range(len(bp)) if bp.region(i)["kind"] == "ROW")


@pytest.mark.parametrize("module,dt,cols,threads,vec,cache", [
    ("ln", torch.float32, 4096, 1024, 4, "regs"), ("ln", torch.bfloat16, 4096, 512, 8, "smem"),
    ("bias_gelu", torch.float32, 4096, 1024, 4, "regs"), ("bias_gelu", torch.bfloat16, 8192, 1024, 8, "reread")])
def test_default_genome_of_rows_with_column_sums(module, dt, cols, threads, vec, cache):
    """A backward row with column sums (LayerNorm's dgamma/dbeta, bias+GELU's dbias) gets one
    16-byte vector per thread: rows of 4096 f32 take 1024 threads of 4, bf16 512 of 8 (H100:
    f32 LayerNorm backward 152 -> 142 us with 1024); one pass with column sums is not capped at
    512 threads as a re-read row is (bias+GELU bf16 at 8192: 1024 threads)."""
    bp, r = column_sum_backward(module, dt, cols)
    gn = _C.genome_default(bp, r, [64])
    assert (gn.threads, gn.vec, gn.cache) == (threads, vec, cache), gn


@pytest.mark.parametrize("module,dt,cols,genome", [
    ("ln", torch.float32, 768, "threads=512 vec=2 rows=2 items=1 cache=regs"),
    ("ln", torch.bfloat16, 1024, "threads=512 vec=2 rows=2 items=1 cache=regs"),
    ("ln", torch.float32, 100, "threads=512 vec=2 rows=16 items=1 cache=regs"),
    ("ln", torch.float32, 33, "threads=512 vec=1 rows=16 items=1 cache=regs"),
    ("bias_gelu", torch.bfloat16, 768, "threads=512 vec=2 rows=2 items=1 cache=regs")])
def test_default_genome_of_short_rows_with_column_sums(module, dt, cols, genome):
    """Rows of at most 1024 with column sums take many threads a row, about two 2-element chunks
    each, in 512-thread persistent blocks: a warp per row kept 24 columns' partials a thread
    (H100, LayerNorm f32 backward at 2048x768: 36.4 -> 17.5 us; bf16 77.3 -> 16.8)."""
    bp, r = column_sum_backward(module, dt, cols)
    for rows in (64, 2048):
        gn = _C.genome_default(bp, r, [rows])
        assert str(gn).startswith(genome) and gn.persistent == 1, gn
        k = _C.generate(bp, r, 90, gn)
        assert k.block == 512 and k.max_blocks > 0


def variants(p, r, symvals):
    """The default genome and a sweep over the genes of the region's kind (illegal ones skipped)."""
    base = _C.genome_default(p, r, symvals)
    kind = p.region(r)["kind"]
    sweeps = {"POINTWISE": [{"vec": 1}, {"vec": 2, "items": 2}, {"persistent": 1}],
              "ROW": [{"cache": c, "threads": t, "rows": rw, "two_pass": tp} for c in ("regs", "smem", "reread")
                      for t, rw in ((256, 1), (256, 8), (64, 8)) for tp in (0, 1)] + [{"vec": 1}]
                   + [{"persistent": 1, "cache": "regs"},
                      {"persistent": 1, "cache": "regs", "rows": 8, "threads": 256}],
              "COL": [{"col_split": 1}, {"col_split": 4}, {"vec": 1}]}[kind]
    out = [base]
    for s in sweeps:
        genome = base.replace(**s)
        try:
            _C.generate(p, r, 90, genome)
        except ValueError:
            continue
        out.append(genome)
    return out


@pytest.mark.parametrize("name", ["layernorm", "softmax", "bias_gelu"])
def test_golden_sources(name):
    g, _, _, _ = build(name, "bf16" if name != "softmax" else "f32")
    src = _C.generate(g.partition(), 0, 90, None).source
    path = GOLDEN / f"{name}.cu"
    if os.environ.get("KBENCH_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(src)
    assert path.exists(), f"missing {path}; run with KBENCH_UPDATE_GOLDEN=1"
    assert src == path.read_text(), f"{name}: generated source differs from {path}"


@pytest.mark.parametrize("name,dt", CASES)
def test_kernels_compile(compile_once, name, dt):
    """Every variant's source, generated for sm_90, compiles for sm_90; each region's default
    kernel generated for sm_80 compiles for sm_80. The genome sweep is compiled for one arch: the
    sources differ between archs only in the defaults codegen picks (shared memory, block limits),
    which the sm_80 default covers, and a second compile of the sweep costs a minute of CI.
    Variants often generate the same source (a gene the region's kind ignores): compile_once
    (conftest.py) compiles each distinct source once per arch in the session, several at once,
    and several sources as one translation unit (NVRTC parses the headers once for them)."""
    g, symvals, _, _ = build(name, dt)
    p = g.partition()
    items = []
    for r in range(len(p)):
        for genome in variants(p, r, symvals):
            src = _C.generate(p, r, 90, genome).source
            items.append((src, "sm_90", (name, dt, r, str(genome))))
        items.append((_C.generate(p, r, 80, None).source, "sm_80", (name, dt, r, "default")))
    for (_, arch, what), cubin in zip(items, compile_once(items, together=True)):
        assert cubin[:4] == b"\x7fELF", (*what, arch)


# ------------------------------------------------------------------ on the GPU

def launch(cuda, k, fn, finish, symvals, ins, outs):
    units = k.grid_units if isinstance(k.grid_units, int) else \
        k.grid_units[0] * math.prod(symvals[s] for s in k.grid_units[1])
    grid = max(1, -(-units // k.units_per_block))
    if k.max_blocks:
        grid = min(grid, k.max_blocks)
    args = [*ins, *outs, *symvals]
    ws_bytes = k.workspace_bytes_per_unit * units + k.workspace_bytes_per_block * grid
    if ws_bytes:
        args.append(torch.empty(ws_bytes, dtype=torch.uint8, device="cuda"))
    _C.launch(cuda, fn, (grid, 1, 1), k.block, k.smem, None, args)
    if finish is not None:
        _C.launch(cuda, finish, (grid, 1, 1), k.block, 0, None, args)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("name,dt", CASES)
def test_kernels_match_interpreter(name, dt):
    from kbench.runtime import nvrtc as nv
    from kbench.verify import poison_like, refused
    cuda = _C.cuda_open()
    dev = _C.device_info(cuda, torch.cuda.current_device())
    arch = f"sm_{dev['sm']}"
    g, symvals, _, bound = build(name, dt)
    p = g.partition()
    gen = torch.Generator().manual_seed(1)
    for sv in (symvals, [1] * len(symvals), [s * 7 + 3 for s in symvals]):
        inputs = random_inputs(g, sv, bound, gen)
        values = dict(zip(g.inputs, inputs))
        for r in range(len(p)):
            rg = p.region(r)
            want = interp_region(p, g, r, sv, values)
            ins = [values[v].cuda() for v in rg["inputs"]]
            for genome in variants(p, r, symvals):
                k = _C.generate(p, r, dev["sm"], genome, dev)
                if refused(k, r, sv):   # vectors along a varying last dim it no longer divides: the
                    continue            # runtime runs the region in eager there (the vec=1 variant runs)
                module = _C.module_load(cuda, nv.compile(k.source, arch))
                fn, _, _ = _C.get_function(cuda, module, k.name, k.smem)
                finish = _C.get_function(cuda, module, k.finish_name, 0)[0] if k.finish_name else None
                outs = [poison_like(tuple(want[v].shape), want[v].dtype, "cuda") for v in rg["outputs"]]
                launch(cuda, k, fn, finish, sv, ins, outs)
                for v, o in zip(rg["outputs"], outs):
                    assert_close(o.cpu(), want[v], f"{name}/{dt} region {r} [{genome}] sizes {sv} output %{v}")
            values.update(want)


def g_softmax_parts(dt):
    """exp(x - max), softmax and log-softmax of one row: every consumer of the online pair."""
    b = Builder(s0=9)
    x = b.input("x", dt, ["s0", 1000])
    full, keep = ["s0", 1000], ["s0", 1]
    m = b.op("expand", [b.op("max", [x], dt, keep, axes=2)], dt, full)
    d = b.op("sub", [x, m], dt, full)
    e = b.op("exp", [d], dt, full)
    s = b.op("sum", [e], dt, keep, axes=2)
    b.g.add_output(e)
    b.g.add_output(b.op("div", [e, b.op("expand", [s], dt, full)], dt, full))
    b.g.add_output(b.op("sub", [d, b.op("expand", [b.op("log", [s], dt, keep)], dt, full)], dt, full))
    return b


def special_rows(n, gen):
    """Rows where the online normalizer's edge cases live: whole threads of -inf beside finite
    values, all -inf, +inf, NaN, exp underflow, large magnitudes."""
    x = torch.randn(9, n, generator=gen, dtype=torch.float64)
    x[1, :] = -math.inf                       # all -inf: NaN everywhere, as torch
    x[2, : n // 2] = -math.inf                # threads whose elements are all -inf, M finite
    x[3, :] = -math.inf
    x[3, n - 3] = 2.0                         # one finite value
    x[4, 17] = math.inf                       # +inf: NaN row (inf - inf)
    x[5, 400] = math.nan                      # NaN propagates
    x[6] = torch.linspace(-300.0, 0.0, n, dtype=torch.float64)  # most exps underflow
    x[7] *= 1e30                              # large magnitudes
    x[8, 1::2] = -math.inf
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_online_normalizer_special_values(dt):
    """Each ROW genome (two_pass=0 is the online max and sum; with the row in registers, each
    thread's own max first, its exps kept and rescaled) gives torch's values, NaN where torch has
    NaN, on rows of -inf, +inf, NaN and underflow."""
    from kbench.runtime import nvrtc as nv
    from kbench.verify import poison_like
    cuda = _C.cuda_open()
    dev = _C.device_info(cuda, torch.cuda.current_device())
    b = g_softmax_parts(dt)
    g, p, n = b.g, b.g.partition(), 1000
    x64 = special_rows(n, torch.Generator().manual_seed(3))
    x = x64.to(DT[dt])
    xr = x.double()
    m = xr.max(dim=-1, keepdim=True).values
    e = torch.exp(xr - m)
    s = e.sum(-1, keepdim=True)
    wants = [e, e / s, xr - m - torch.log(s)]
    genomes = variants(p, 0, [9])
    assert any(g.two_pass == 0 and g.cache == "regs" for g in genomes)
    for genome in genomes:
        k = _C.generate(p, 0, dev["sm"], genome, dev)
        module = _C.module_load(cuda, nv.compile(k.source, f"sm_{dev['sm']}"))  # kept: its functions live with it
        fn, _, _ = _C.get_function(cuda, module, k.name, k.smem)
        outs = [poison_like((9, n), DT[dt], "cuda") for _ in wants]
        launch(cuda, k, fn, None, [9], [x.cuda()], outs)
        for j, (o, w) in enumerate(zip(outs, wants)):
            o, w = o.cpu().double(), w.to(DT[dt]).double()
            what = f"{dt} [{genome}] output {j}"
            assert torch.equal(o.isnan(), w.isnan()), f"{what}: NaN at other places"
            inf = w.isinf()
            assert torch.equal(o.isinf(), inf) and torch.equal(o[inf], w[inf]), f"{what}: infinities differ"
            for i in range(9):   # row by row: a row of 1e30 does not loosen the others' tolerance
                ok = w[i].isfinite()
                assert_close(o[i][ok].to(DT[dt]), w[i][ok].to(DT[dt]), f"{what} row {i}")


def test_backward_row_kernel_loads_ahead_in_words():
    """LayerNorm bf16's backward as optimize() builds it (torch.nn.LayerNorm captured; the
    forward's saved mean and rstd are inputs): with its column sums the grid is capped and each
    block walks rows, so the next row's vectors and its saved statistics are loaded while this row
    is reduced (no load of a statistic where a row starts), the vectors carried as 32-bit words,
    and bf16 elements read from their words."""
    from kbench import api
    x = torch.randn(64, 4096, dtype=torch.bfloat16)
    with torch.no_grad():
        g = api._fresh_capture(torch.nn.LayerNorm(4096).to(torch.bfloat16), (x,), "cuda").graph
    p = g.partition()
    p.save_stats(0)
    region = p.region(0)
    assert region["kind"] == "ROW" and region["saved"], region
    bp = p.region_graph(0).grad([True] * len(region["inputs"]), saved=region["saved"]).partition()
    r = next(i for i in range(len(bp)) if bp.region(i)["kind"] == "ROW")
    src = _C.generate(bp, r, 90, None).source
    stats = re.findall(r"// in  (\w+) = %(\d+) = input user \"saved\d+\" : f32\[s0,1\]", src)
    assert len(stats) == 2, src[:1500]                      # mean and rstd
    for name, v in stats:
        assert f"pfs{v} = {name}[prow];" in src and f"const float rs{v} = pfs{v};" in src
        assert f"{name}[row]" not in src                    # no load of it where a row starts
    assert re.search(r"kb_vec<unsigned, 4> pf\d+\[1\];", src) and "kb_bits<__nv_bfloat16, 8>(pf" in src
    assert "kb_bf16_at(" in src and "__bfloat162float(x" not in src
