"""MATMUL in the IR (csrc/core), GEMM regions (csrc/fuse) and MATMUL's autodiff (csrc/grad): the
builder's checks and text, the interpreter against torch (batch, broadcast, transposed operands,
bf16 rounded once), vector-Jacobian products against torch.autograd, and the partitions that a
Linear + bias + GELU, a residual add and a LayerNorm after it make. All on the CPU, small."""
import pytest
import torch
import torch.nn.functional as F

from kbench import _C
from kbench.runtime.interp import run_graph, run_region

from test_grad import GB, S0, SYMVALS, check_vjp  # noqa: F401 (the shared graph helper)

# ---------------------------------------------------------------- builder and text


def test_builder_checks():
    gb = GB()
    a = gb.input("a", [2, 3, 4], "f32")
    b = gb.input("b", [2, 4, 5], "f32")
    mm = gb.op("matmul", a, b, dims=[2, 3, 5])
    assert gb.g.node(mm)["op"] == "matmul"
    bad = [
        ([a, b], [2, 3, 4], "f32", "output must be"),                 # wrong N
        ([a, a], [2, 3, 4], "f32", "last dim"),                       # K mismatch
        ([a, gb.input("c", [3, 4, 5], "f32")], [2, 3, 5], "f32", "batch dim 0"),
        ([a, gb.input("d", [2, 4, 5], "bf16")], [2, 3, 5], "f32", "one dtype"),
        ([gb.input("e", [2, 3, 4], "i64"), gb.input("f", [2, 4, 5], "i64")], [2, 3, 5], "i64", "float"),
        ([gb.input("v", [4], "f32"), gb.input("w", [4], "f32")], [1], "f32", "rank >= 2"),
    ]
    for ins, dims, dt, msg in bad:
        with pytest.raises(ValueError, match=msg):
            gb.g.add_node("matmul", ins, dt, dims)
    # symbolic sizes: M may vary, K must agree symbolically
    x = gb.input("x", [S0, 4], "f32")
    w = gb.input("w2", [4, 6], "f32")
    y = gb.op("matmul", x, w, dims=[S0, 6])
    assert "matmul %" in str(gb.g) and ": f32[s0,6]" in str(gb.g)
    assert tuple(gb.g.sizes(y, [7])) == (7, 6)


# ---------------------------------------------------------------- the interpreter


def _run1(gb, inputs, sv=(3,)):
    return run_graph(gb.g, list(sv), inputs)


def test_interp_batched_and_transposed():
    torch.manual_seed(0)
    gb = GB()
    a = gb.input("a", [2, S0, 5])                       # [B, M, K]
    bt = gb.input("bt", [2, 4, 5])                      # stored [B, N, K]: b = bt^T
    b = gb.view("permute", bt, [2, 5, 4], perm=[0, 2, 1])
    gb.out(gb.op("matmul", a, b, dims=[2, S0, 4]))
    A, BT = torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(2, 4, 5, dtype=torch.float64)
    (got,) = _run1(gb, [A, BT])
    torch.testing.assert_close(got, A @ BT.transpose(1, 2), rtol=1e-14, atol=1e-14)


def test_interp_broadcast_batch():
    """A weight shared by every batch entry: an EXPAND of its size-1 batch dim feeds MATMUL."""
    torch.manual_seed(1)
    gb = GB()
    x = gb.input("x", [S0, 3, 4])
    w = gb.input("w", [1, 4, 2], kind="param")
    we = gb.view("expand", w, [S0, 4, 2])
    gb.out(gb.op("matmul", x, we, dims=[S0, 3, 2]))
    X, W = torch.randn(5, 3, 4, dtype=torch.float64), torch.randn(1, 4, 2, dtype=torch.float64)
    (got,) = _run1(gb, [X, W], (5,))
    torch.testing.assert_close(got, X @ W, rtol=1e-14, atol=1e-14)


def test_interp_bf16_rounds_once():
    """A bf16 product is the exact sum rounded once to bf16 (torch's, up to its f32 accumulation):
    never a bf16 rounding per partial sum."""
    torch.manual_seed(2)
    gb = GB()
    a = gb.input("a", [8, 64], "bf16")
    b = gb.input("b", [64, 8], "bf16")
    gb.out(gb.op("matmul", a, b, dims=[8, 8], dtype="bf16"))
    A, B = torch.randn(8, 64).bfloat16(), torch.randn(64, 8).bfloat16()
    (got,) = _run1(gb, [A, B])
    exact = A.double() @ B.double()
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, exact.float().bfloat16())
    assert (got.float() - (A @ B).float()).abs().max() <= exact.abs().max() * 2 ** -7


# ---------------------------------------------------------------- autodiff


def test_vjp_matmul_transposed_and_broadcast():
    gb = GB()
    x = gb.input("x", [2, S0, 3])
    w = gb.input("w", [4, 3], kind="param")             # a Linear's weight [N, K]
    wt = gb.view("permute", w, [3, 4], perm=[1, 0])
    wb = gb.view("expand", gb.view("reshape", wt, [1, 3, 4]), [2, 3, 4])
    gb.out(gb.op("matmul", x, wb, dims=[2, S0, 4]))
    check_vjp(gb, lambda X, W: X @ W.t(),
              lambda d: [torch.randn(*d(x), dtype=torch.float64), torch.randn(*d(w), dtype=torch.float64)])


def _linear(gb, x, w, bias, n, m_dim, act=None):
    """x [M, K] . w[N, K]^T + bias[N] (and an activation), the IR a Linear lowers to."""
    k = gb.dims[w][1]
    wt = gb.view("permute", w, [k, n], perm=[1, 0])
    y = gb.op("matmul", x, wt, dims=[m_dim, n])
    be = gb.view("expand", gb.view("reshape", bias, [1, n]), [m_dim, n])
    y = gb.op("add", y, be)
    return gb.op(act, y) if act else y


def test_vjp_linear_bias_gelu():
    gb = GB()
    x = gb.input("x", [S0, 4])
    w = gb.input("w", [6, 4], kind="param")
    b = gb.input("b", [6], kind="param")
    gb.out(_linear(gb, x, w, b, 6, S0, "gelu"))
    check_vjp(gb, lambda X, W, B: F.gelu(F.linear(X, W, B)),
              lambda d: [torch.randn(*d(v), dtype=torch.float64) for v in (x, w, b)])


def _mlp(dt="f64"):
    gb = GB()
    x = gb.input("x", [S0, 4], dt)
    w1, b1 = gb.input("w1", [8, 4], dt, "param"), gb.input("b1", [8], dt, "param")
    w2, b2 = gb.input("w2", [4, 8], dt, "param"), gb.input("b2", [4], dt, "param")
    h = _linear(gb, x, w1, b1, 8, S0, "gelu")
    gb.out(_linear(gb, h, w2, b2, 4, S0))
    return gb, (x, w1, b1, w2, b2)


def test_vjp_mlp():
    gb, vs = _mlp()
    check_vjp(gb, lambda X, W1, B1, W2, B2: F.linear(F.gelu(F.linear(X, W1, B1)), W2, B2),
              lambda d: [torch.randn(*d(v), dtype=torch.float64) for v in vs])


# ---------------------------------------------------------------- GEMM regions


def _regions(p):
    return [p.region(r) for r in range(len(p))]


def test_linear_bias_gelu_is_one_gemm_region():
    gb = GB()
    x = gb.input("x", [S0, 4], "f32")
    w = gb.input("w", [6, 4], "f32", "param")
    b = gb.input("b", [6], "f32", "param")
    y = _linear(gb, x, w, b, 6, S0, "gelu")
    gb.out(y)
    p = gb.g.partition()
    (r,) = _regions(p)
    assert r["kind"] == "GEMM"
    text = str(p)
    # A is x as stored (row-major), B the weight [N, K] read transposed; bias add and GELU its epilogue
    assert f"a=%{x}:row b=%{w}:trans epilogue=(%{y - 1},%{y})" in text, text
    (got,) = run_region(p, 0, [3], [torch.ones(3, 4), torch.ones(6, 4), torch.zeros(6)])
    torch.testing.assert_close(got, F.gelu(torch.full((3, 6), 4.0)))


def test_residual_joins_layernorm_stays_row():
    gb = GB()
    x = gb.input("x", [S0, 4], "f32")
    w = gb.input("w", [4, 4], "f32", "param")
    b = gb.input("b", [4], "f32", "param")
    y = gb.op("add", _linear(gb, x, w, b, 4, S0), x)            # residual
    mean = gb.reduce("mean", y, [1], True)
    d = gb.op("sub", y, gb.view("expand", mean, [S0, 4]))
    var = gb.reduce("mean", gb.op("mul", d, d), [1], True)
    rstd = gb.op("rsqrt", gb.op("add", var, gb.const(1e-5, [S0, 1], "f32")))
    gb.out(gb.op("mul", d, gb.view("expand", rstd, [S0, 4])))
    p = gb.g.partition()
    kinds = [r["kind"] for r in _regions(p)]
    assert kinds == ["GEMM", "ROW"], str(p)
    gemm = p.region(0)
    assert y in gemm["nodes"] and gemm["outputs"] == [y]
    assert f"epilogue=(%{y - 1},%{y})" in str(p)


def test_prologue_cast_floats_activation_stays():
    """Autocast's casts of x and the weight are applied as the GEMM loads them (a prologue); an
    activation of x before the product is a region of its own."""
    gb = GB()
    x = gb.input("x", [S0, 4], "f32")
    w = gb.input("w", [6, 4], "f32", "param")
    xc = gb.op("cast", x, dtype="bf16")
    wc = gb.op("cast", w, dtype="bf16")
    wt = gb.view("permute", wc, [4, 6], perm=[1, 0])
    y = gb.op("matmul", xc, wt, dims=[S0, 6], dtype="bf16")
    gb.out(y)
    p = gb.g.partition()
    assert [r["kind"] for r in _regions(p)] == ["GEMM"]
    assert f"a=%{x}:row:prologue b=%{w}:trans:prologue" in str(p), str(p)

    gb2 = GB()
    x = gb2.input("x", [S0, 4], "f32")
    w = gb2.input("w", [4, 6], "f32", "param")
    h = gb2.op("tanh", x)
    gb2.out(gb2.op("matmul", h, w, dims=[S0, 6]))
    p2 = gb2.g.partition()
    assert [r["kind"] for r in _regions(p2)] == ["POINTWISE", "GEMM"], str(p2)
    assert f"a=%{h}:row b=%{w}:row" in str(p2)


def test_bmm_broadcast_recorded():
    gb = GB()
    q = gb.input("q", [2, S0, 4], "f32")
    k = gb.input("k", [1, S0, 4], "f32")
    kt = gb.view("expand", gb.view("permute", k, [1, 4, S0], perm=[0, 2, 1]), [2, 4, S0])
    gb.out(gb.op("matmul", q, kt, dims=[2, S0, S0]))
    text = str(gb.g.partition())
    assert f"b=%{k}:trans:bcast=0x1" in text, text


def test_mlp_backward_gemm_regions_and_saved_product():
    """The forward saves the first GEMM's product (GELU's derivative reads it; recomputing it
    would be a third GEMM), and the backward's GEMMs fuse GELU' into the dX product's epilogue."""
    gb, vs = _mlp("f32")
    p = gb.g.partition()
    assert [r["kind"] for r in _regions(p)] == ["GEMM", "GEMM"]
    p.save_stats(0)
    assert p.region(0)["saved"] == 1 and p.region(1)["saved"] == 0
    fg = p.region_graph(0)
    bwd = fg.grad([True, True, True], saved=1)
    nodes = [bwd.node(i)["op"] for i in range(bwd.num_nodes)]
    assert nodes.count("matmul") == 2                        # dX and dW; the product is read
    kinds = [r["kind"] for r in _regions(bwd.partition())]
    assert kinds.count("GEMM") == 2, kinds
    # the whole MLP's backward: dH = g . W2 with GELU' (erf, exp of the pre-activation) fused as the
    # epilogue of that GEMM
    full = gb.g.grad([True] * 5)
    fp = full.partition()
    gemms = [r for r in _regions(fp) if r["kind"] == "GEMM"]
    assert len(gemms) == 5, str(fp)      # the forward's first product, recomputed, dH, dW2, dX, dW1
    assert any({"erf", "exp"} <= {full.node(v)["op"] for v in r["nodes"]} for r in gemms), str(fp)


def test_activation_before_a_cast_is_no_prologue():
    """tanh(x) cast to bf16 for a product: the cast alone would be a cheap prologue, but not the
    tanh under it (which would float on its own as work on one input): one region computes both."""
    gb = GB()
    x = gb.input("x", [S0, 4], "f32")
    w = gb.input("w", [4, 6], "bf16", "param")
    h = gb.op("cast", gb.op("tanh", x), dtype="bf16")
    gb.out(gb.op("matmul", h, w, dims=[S0, 6], dtype="bf16"))
    p = gb.g.partition()
    assert [r["kind"] for r in _regions(p)] == ["POINTWISE", "GEMM"], str(p)
    assert f"a=%{h}:row b=%{w}:row" in str(p)
