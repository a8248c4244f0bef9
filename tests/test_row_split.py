"""Rows split over blocks (the row_split gene, csrc/codegen/kernel.c): few long rows get it from
the default genome, where the rows are few next to the SMs and each part keeps >= 8K elements;
many rows keep today's schedule; legality and codegen agree on what a split row can merge; the
split kernels compile for sm_80 and sm_90. Their numbers are the GPU's to check
(tests/gpu/test_row_split.py)."""
import re

import pytest
import torch

from kbench import _C, api

from test_codegen import Builder, layernorm

H100 = {"sm": 90, "num_sms": 132, "max_smem_per_block": 232448, "regs_per_sm": 65536, "l2_bytes": 50 << 20}
A100 = dict(H100, sm=80, num_sms=108)


def ln_graph(dt, n, stats=True, rows=8):
    """LayerNorm over rows of n: y, and (stats) mean and rstd as per-row outputs."""
    b = Builder(s0=rows)
    x, w, bias = b.input("x", dt, ["s0", n]), b.input("w", dt, [n], "param"), b.input("b", dt, [n], "param")
    y, mean, rstd = layernorm(b, dt, "s0", n, x, w, bias)
    for v in (y, mean, rstd) if stats else (y,):
        b.g.add_output(v)
    return b.g


def rms_graph(dt, n, rows=8):
    b = Builder(s0=rows)
    full, keep = ["s0", n], ["s0", 1]
    x = b.op("cast", [b.input("x", dt, full)], "f32", full)
    ms = b.op("mean", [b.op("mul", [x, x], "f32", full)], "f32", keep, axes=2)
    r = b.op("rsqrt", [b.op("add", [ms, b.op("const", [], "f32", keep, scalars=(1e-6, 0.0))], "f32", keep)], "f32", keep)
    w = b.op("expand", [b.op("reshape", [b.op("cast", [b.input("w", dt, [n], "param")], "f32", [n])], "f32", [1, n])],
             "f32", full)
    y = b.op("mul", [b.op("mul", [x, b.op("expand", [r], "f32", full)], "f32", full), w], "f32", full)
    b.g.add_output(b.op("cast", [y], dt, full))
    return b.g


def softmax_graph(dt, n, rows=8):
    b = Builder(s0=rows)
    x = b.input("x", dt, ["s0", n])
    full, keep = ["s0", n], ["s0", 1]
    m = b.op("expand", [b.op("max", [x], dt, keep, axes=2)], dt, full)
    e = b.op("exp", [b.op("sub", [x, m], dt, full)], dt, full)
    s = b.op("expand", [b.op("sum", [e], dt, keep, axes=2)], dt, full)
    b.g.add_output(b.op("div", [e, s], dt, full))
    return b.g


class NormAndSquares(torch.nn.Module):
    """x / x.norm() and x.pow(2).sum(): one ROW region whose row is the whole tensor."""

    def forward(self, x):
        return x / x.norm(), x.pow(2).sum()


@pytest.fixture(scope="module")
def norm_capture():
    with torch.no_grad():
        return api._fresh_capture(NormAndSquares(), (torch.randn(4, 64),), "cuda").graph


def saved_ln():
    """A LayerNorm region whose mean and rstd are saved for the backward (nsaved = 2)."""
    p = ln_graph("f32", 1 << 20, stats=False).partition()
    p.save_stats(0)
    assert p.region(0)["saved"] == 2
    return p


# ------------------------------------------------------------------ the default genome

@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_default_splits_few_long_rows(dt):
    """8 rows of 1M: about four blocks an SM in all (132 SMs: 66 parts a row, A100's 108: 54),
    one block a row without it; the rest of the schedule is chosen for a part."""
    p = ln_graph(dt, 1 << 20).partition()
    for dev, split in ((None, 66), (H100, 66), (A100, 54)):
        gn = _C.genome_default(p, 0, [8], dev)
        assert gn.row_split == split and gn.rows == 1 and gn.persistent == 0 and gn.cache != "smem", (dev, gn)
        assert gn.threads == 256, gn      # a part: twice the blocks an SM of 512 threads
        assert _C.genome_legal(p, 0, [8], dev, gn)
    # more parts than 4 an SM would cut a part below 8K elements: 300 rows are many, 8 rows of
    # 64K split 8 ways
    assert _C.genome_default(p, 0, [300]).row_split == 1
    assert _C.genome_default(ln_graph(dt, 1 << 16).partition(), 0, [8]).row_split == 8


def test_default_splits_one_row_of_the_whole_tensor(norm_capture):
    """x / x.norm() over 2^28 elements is one row: 528 parts (4 an SM) of 508K elements, read in
    16-byte vectors (the varying last dim divides at the example; the kernel says it requires so)."""
    p = norm_capture.partition()
    gn = _C.genome_default(p, 0, [1 << 14, 1 << 14])
    assert gn.row_split == 528 and gn.vec == 4, gn
    assert _C.genome_default(p, 0, [64, 64]).row_split == 1     # 4096 elements: no part of 8K


@pytest.mark.parametrize("build", [lambda: ln_graph("bf16", 4096), lambda: softmax_graph("f32", 4096),
                                   lambda: rms_graph("bf16", 4096)], ids=["layernorm", "softmax", "rms_norm"])
def test_many_rows_keep_their_schedule(build):
    """bench_ops' 8192 x 4096 (and 64 or 512 rows of 4096: each part would hold under 8K
    elements) keep the one-block-a-row default, text included."""
    p = build().partition()
    for rows in (8192, 512, 64):
        gn = _C.genome_default(p, 0, [rows])
        assert gn.row_split == 1 and "row_split" not in str(gn), (rows, gn)


# ------------------------------------------------------------------ legality and codegen

def test_legality_of_a_split():
    p = ln_graph("f32", 1 << 20).partition()
    gn = _C.genome_default(p, 0, [8])
    legal = lambda **kw: _C.genome_legal(p, 0, [8], None, gn.replace(**kw))   # noqa: E731
    assert legal(row_split=2) and legal(row_split=1024, threads=256) and legal(row_split=1)
    assert not legal(row_split=1024, threads=512)          # 512 threads for 256 vectors a part
    assert not legal(row_split=2048, threads=128)          # parts of 512 elements: under 1024
    assert not legal(rows=2, threads=512)                  # a part per block
    assert not legal(persistent=1)
    assert not legal(cache="smem")
    assert legal(cache="regs", threads=1024, row_split=256)   # a part of 4096 in registers
    # a column sum (LayerNorm's backward: dweight and dbias over the rows) does not split
    b = ln_graph("f32", 1 << 16, stats=False).grad([True, True, True]).partition()
    r = next(i for i in range(len(b)) if b.region(i)["kind"] == "ROW")
    dflt = _C.genome_default(b, r, [8])
    assert dflt.row_split == 1 and not _C.genome_legal(b, r, [8], None, dflt.replace(row_split=4))
    with pytest.raises(ValueError, match="row_split"):
        _C.generate(b, r, 90, dflt.replace(row_split=4))


def test_a_reduction_of_another_is_not_split():
    """mean(|x - mean(x)|) reads the mean in a second pass that no partial merges: illegal, and
    codegen refuses it; softmax's sum of exp(x - max) and the variance's squares about the mean
    do merge."""
    b = Builder(s0=4)
    n = 1 << 16
    full, keep = ["s0", n], ["s0", 1]
    x = b.input("x", "f32", full)
    d = b.op("sub", [x, b.op("expand", [b.op("mean", [x], "f32", keep, axes=2)], "f32", full)], "f32", full)
    b.g.add_output(b.op("mean", [b.op("abs", [d], "f32", full)], "f32", keep, axes=2))
    p = b.g.partition()
    gn = _C.genome_default(p, 0, [4])
    assert gn.row_split == 1 and not _C.genome_legal(p, 0, [4], None, gn.replace(row_split=8))
    with pytest.raises(ValueError, match="row_split"):
        _C.generate(p, 0, 90, gn.replace(row_split=8))
    for g in (softmax_graph("f32", n, rows=4), ln_graph("f32", n, rows=4)):
        assert _C.genome_default(g.partition(), 0, [4]).row_split == 8


def test_split_kernel_shape():
    """Two entry points on one grid of rows x parts, a partial per row reduction per unit; the
    LayerNorm merges its squares about each part's mean with Chan's formula (no sum of squares
    minus a squared sum), and its per-row outputs are written by each row's first part."""
    p = ln_graph("f32", 1 << 20).partition()
    gn = _C.genome_default(p, 0, [8])
    k = _C.generate(p, 0, 90, gn)
    assert k.nkernels == 2 and k.finish_name == k.name + "_finish" and k.nostats_name is None
    assert k.grid_units == (66, (0,)) and k.units_per_block == 1 and k.max_blocks == 0
    assert k.workspace_bytes_per_unit == 2 * 4 and k.workspace_bytes_per_block == 0
    main, finish = k.source.split("__global__")[1:]
    assert "kb_chan_m2(" in finish and "kb_chan_m2(" not in main
    assert "if (lane == 0 && part == 0) {" in finish and "out[row] =" in finish
    assert re.search(r"for \(long long c0 = cb \+ \(long long\)lane \* 4; c0 < ce;", main)
    sm = _C.generate(softmax_graph("f32", 1 << 20).partition(), 0, 90, None)
    assert "kb_online_merge(" in sm.source.split("__global__")[2]


def test_saved_statistics_are_the_finishing_kernels():
    """A split row's mean and rstd saved for the backward are known after the merge: the
    finishing kernel writes them, one entry point (inference writes them to scratch)."""
    p = saved_ln()
    k = _C.generate(p, 0, 90, None)
    assert k.genome.row_split > 1 and k.nkernels == 2 and k.nostats_name is None
    finish = k.source.split(k.name + "_finish(")[1]
    stores = re.findall(r"\n\s+(\w+)\[row\] = ", finish)
    assert len(stores) == 2, finish


def test_split_kernels_compile(compile_once, norm_capture):
    """The default (split) kernels of LayerNorm f32 (its statistics saved) and bf16, RMSNorm
    bf16, softmax f32 and a whole-tensor norm and sum compile for sm_90 and sm_80."""
    cases = [("layernorm saved", saved_ln(), [8]),
             ("layernorm bf16", ln_graph("bf16", 1 << 20).partition(), [8]),
             ("rms_norm bf16", rms_graph("bf16", 1 << 20).partition(), [8]),
             ("softmax f32", softmax_graph("f32", 1 << 20).partition(), [8]),
             ("norm and sum", norm_capture.partition(), [1 << 14, 1 << 14])]
    items = []
    for label, p, symvals in cases:
        for sm in (90, 80):
            dev = H100 if sm == 90 else A100
            gn = _C.genome_default(p, 0, symvals, dev)
            assert gn.row_split > 1, (label, gn)
            items.append((_C.generate(p, 0, sm, gn, dev).source, f"sm_{sm}", (label, str(gn))))
    for (_, arch, what), cubin in zip(items, compile_once(items)):
        assert cubin[:4] == b"\x7fELF", (*what, arch)


# ------------------------------------------------------------------ the backward of few long rows

def _ln_capture(normalized, batch, dtype=torch.float64):
    from kbench.capture import capture
    m = torch.nn.LayerNorm(normalized).to(dtype)
    with torch.no_grad():
        m.weight.normal_(), m.bias.normal_()
    return m, capture(m, (torch.randn(batch, *normalized, dtype=dtype),))


def test_layernorm_backward_over_several_dims_is_one_pass_of_sums():
    """LayerNorm over three dims, its mean and variance saved: the backward's sum of
    -(g * rstd + 2 * k * xc), k from another row sum, is regrouped into sums that wait for no
    other (simplify.c, over an axis set, as over one axis), and the gradients match autograd."""
    from kbench.runtime.interp import run_graph
    m, cap = _ln_capture((3, 4, 5), 2)
    p = cap.graph.partition()
    p.save_stats(0)
    bwd = p.region_graph(0).grad([True, True, True], saved=p.region(0)["saved"])
    text = str(bwd)
    depth, row_sums = {}, []
    for ln in text.splitlines():    # "%k = op %a, %b ..." in id order: reductions nested under v
        mt = re.match(r"\s*%(\d+) = (\w+)(.*)", ln)
        if not mt:
            continue
        v, op = int(mt.group(1)), mt.group(2)
        d = max([depth.get(int(u), 0) for u in re.findall(r"%(\d+)", mt.group(3))], default=0)
        depth[v] = d + (op in ("sum", "mean", "max", "min"))
        if op == "sum" and "axes=[1,2,3]" in ln:
            row_sums.append(v)
    assert len(row_sums) == 2 and max(depth[v] for v in row_sums) == 1, text
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    up = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    want = torch.autograd.grad(m(x), [x, m.weight, m.bias], up)
    xd = x.detach()
    mean = xd.mean((1, 2, 3), keepdim=True)
    var = ((xd - mean) ** 2).mean((1, 2, 3), keepdim=True)
    got = run_graph(bwd, cap.example_symvals, [xd, m.weight.detach(), m.bias.detach(), mean, var, up])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_layernorm_backward_of_long_rows_recomputes_instead_of_writing():
    """With the forward's mean and variance saved (rows this long save them), the backward is
    the column sums for dweight and dbias and one split row kernel for dx, each reading x and dy
    itself: x - mean, dy * w and dy * w * xhat are recomputed where read (fuse.c,
    float_input_work), not written by the first kernel and read back by the next two."""
    _, cap = _ln_capture((4, 64, 128), 2, torch.float32)
    p = cap.graph.partition()
    p.save_stats(0)
    reg = p.region(0)
    bwd = p.region_graph(0).grad([True, True, True], saved=reg["saved"]).partition()
    kinds = [bwd.region(r)["kind"] for r in range(len(bwd))]
    assert sorted(kinds) == ["COL", "ROW"], str(bwd)
    for r in range(len(bwd)):
        outs = bwd.region(r)["outputs"]
        # only the graph's own outputs leave a region: dx from the row kernel, dw and db from the columns
        assert len(outs) == (1 if kinds[r] == "ROW" else 2), (kinds, str(bwd))
    row = kinds.index("ROW")
    assert _C.genome_default(bwd, row, [8]).row_split > 1
