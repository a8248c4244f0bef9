# test_interp.py — the C interpreter (kbench._C.interp_graph / interp_region) on graphs built
# through the binding, against torch computing in float64: every pointwise op, reductions,
# index maps, gather, casts, and the store rule (compute in double, round once on store).
import math

import pytest
import torch
import torch.nn.functional as F

from kbench import _C
from kbench.runtime import interp

DT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64,
      "i64": torch.int64, "i32": torch.int32, "bool": torch.bool}
FLOATS = ["f32", "f64", "bf16", "f16"]


class Builder:
    """Terse graph building: dims are ints or symbol names ("s0"), or (coef, ("s0", ...))."""

    def __init__(self, **syms):
        self.g = _C.Graph()
        self.sym = {name: self.g.add_symbol(name, ex) for name, ex in syms.items()}

    def dims(self, dims):
        out = []
        for d in dims:
            if isinstance(d, str):
                out.append((1, (self.sym[d],)))
            elif isinstance(d, tuple):
                out.append((d[0], tuple(self.sym[s] for s in d[1])))
            else:
                out.append(d)
        return out

    def input(self, name, dtype, dims, kind="user"):
        return self.g.add_input(name, kind, dtype, self.dims(dims))

    def op(self, op, inputs, dtype, dims, **kw):
        return self.g.add_node(op, list(inputs), dtype, self.dims(dims), **kw)

    def out(self, *vs):
        for v in vs:
            self.g.add_output(v)
        return self


def run_graph(g, inputs, symvals=()):
    """Runs g on host tensors; returns its outputs, allocated in their IR dtype."""
    return interp.run_graph(g, symvals, inputs)


def assert_stored(out, ref64, ulps=1):
    """out = ref64 rounded once to out's dtype, up to `ulps` (libm and torch's double kernels may
    differ in the last bit of a double, which can move a rounding by one ulp at most)."""
    want = ref64.to(out.dtype)
    if out.dtype.is_floating_point:
        fi = torch.finfo(out.dtype)
        torch.testing.assert_close(out.double(), want.double(), rtol=ulps * fi.eps, atol=1e-12,
                                   equal_nan=True)
        if out.dtype in (torch.bfloat16, torch.float16) and out.numel() >= 64:
            same = (out == want) | (out.isnan() & want.isnan())
            assert same.double().mean() > 0.98, "bf16/f16 outputs must be rounded once, on store"
    else:
        assert torch.equal(out, want)


# ---------------------------------------------------------------------- composite ops

def build_layernorm(b, dt, x, w, bias, n, eps):
    keep = ["s0", 1]
    full = ["s0", n]
    mean = b.op("mean", [x], dt, keep, axes=0b10)
    xc = b.op("sub", [x, b.op("expand", [mean], dt, full)], dt, full)
    var = b.op("mean", [b.op("mul", [xc, xc], dt, full)], dt, keep, axes=0b10)
    rs = b.op("rsqrt", [b.op("add", [var, b.op("const", [], dt, keep, scalars=(eps, 0.0))], dt, keep)], dt, keep)
    xn = b.op("mul", [xc, b.op("expand", [rs], dt, full)], dt, full)
    we = b.op("expand", [b.op("reshape", [w], dt, [1, n])], dt, full)
    be = b.op("expand", [b.op("reshape", [bias], dt, [1, n])], dt, full)
    return b.op("add", [b.op("mul", [xn, we], dt, full), be], dt, full)


@pytest.mark.parametrize("dt", FLOATS)
def test_layernorm(dt):
    n, eps = 48, 1e-5
    b = Builder(s0=7)
    x, w, bias = b.input("x", dt, ["s0", n]), b.input("w", dt, [n], "param"), b.input("b", dt, [n], "param")
    b.out(build_layernorm(b, dt, x, w, bias, n, eps))
    gen = torch.Generator().manual_seed(0)
    for s0 in (7, 3):  # one graph, two bindings of its symbol
        xt = (torch.randn(s0, n, generator=gen) * 3 + 1).to(DT[dt])
        wt, bt = torch.randn(n, generator=gen).to(DT[dt]), torch.randn(n, generator=gen).to(DT[dt])
        (y,) = run_graph(b.g, [xt, wt, bt], [s0])
        ref = F.layer_norm(xt.double(), (n,), wt.double(), bt.double(), eps)
        assert y.shape == (s0, n)
        assert_stored(y, ref)


@pytest.mark.parametrize("dt", FLOATS)
def test_softmax_and_logsumexp(dt):
    n = 37
    b = Builder(s0=4)
    full, keep = ["s0", n], ["s0", 1]
    x = b.input("x", dt, full)
    m = b.op("max", [x], dt, keep, axes=0b10)
    e = b.op("exp", [b.op("sub", [x, b.op("expand", [m], dt, full)], dt, full)], dt, full)
    s = b.op("sum", [e], dt, keep, axes=0b10)
    y = b.op("div", [e, b.op("expand", [s], dt, full)], dt, full)
    lse = b.op("add", [b.op("log", [s], dt, keep), m], dt, keep)
    b.out(y, lse)
    xt = (torch.randn(4, n, generator=torch.Generator().manual_seed(1)) * 20).to(DT[dt])
    xt[1] += 500  # exp overflows without the max
    y, lse = run_graph(b.g, [xt], [4])
    assert_stored(y, torch.softmax(xt.double(), -1))
    assert_stored(lse, torch.logsumexp(xt.double(), -1, keepdim=True))


@pytest.mark.parametrize("dt", FLOATS)
def test_rms_norm(dt):
    n, eps = 64, 1e-6
    b = Builder()
    x, w = b.input("x", dt, [3, 2, n]), b.input("w", dt, [n], "param")
    full, keep = [3, 2, n], [3, 2, 1]
    ms = b.op("mean", [b.op("mul", [x, x], dt, full)], dt, keep, axes=0b100)
    rs = b.op("rsqrt", [b.op("add", [ms, b.op("const", [], dt, keep, scalars=(eps, 0.0))], dt, keep)], dt, keep)
    we = b.op("expand", [b.op("reshape", [w], dt, [1, 1, n])], dt, full)
    b.out(b.op("mul", [b.op("mul", [x, b.op("expand", [rs], dt, full)], dt, full), we], dt, full))
    gen = torch.Generator().manual_seed(2)
    xt, wt = torch.randn(3, 2, n, generator=gen).to(DT[dt]), torch.randn(n, generator=gen).to(DT[dt])
    (y,) = run_graph(b.g, [xt, wt])
    x64 = xt.double()
    assert_stored(y, x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * wt.double())


# ---------------------------------------------------------------------- pointwise ops

UNARY = {
    "neg": torch.neg, "abs": torch.abs, "sign": torch.sign, "exp": torch.exp,
    "log": lambda x: torch.log(x.abs() + 0.1), "log1p": lambda x: torch.log1p(x.abs()),
    "expm1": torch.expm1, "sqrt": lambda x: torch.sqrt(x.abs()), "rsqrt": lambda x: torch.rsqrt(x.abs() + 0.1),
    "recip": lambda x: torch.reciprocal(x.abs() + 0.1), "sin": torch.sin, "cos": torch.cos,
    "tanh": torch.tanh, "erf": torch.erf, "sigmoid": torch.sigmoid, "relu": torch.relu,
    "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu,
    "mish": F.mish, "hardswish": F.hardswish,
}
# inputs that the reference transforms first (log of |x| + 0.1, ...) get the same transform in the IR
PRE = {"log": ("abs", 0.1), "log1p": ("abs", None), "sqrt": ("abs", None), "rsqrt": ("abs", 0.1), "recip": ("abs", 0.1)}


@pytest.mark.parametrize("dt", ["f32", "bf16", "f64"])
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary(op, dt):
    shape = [4, 50]
    b = Builder()
    x = b.input("x", dt, shape)
    a = x
    if op in PRE:
        a = b.op("abs", [x], dt, shape)
        if PRE[op][1] is not None:
            a = b.op("add", [a, b.op("const", [], dt, shape, scalars=(PRE[op][1], 0.0))], dt, shape)
    b.out(b.op(op, [a], dt, shape))
    xt = torch.linspace(-25, 25, 200).reshape(shape).to(DT[dt])
    (y,) = run_graph(b.g, [xt])
    assert_stored(y, UNARY[op](xt.double()), ulps=2)


def test_scalar_attributes():
    b = Builder()
    x = b.input("x", "f64", [101])
    b.out(b.op("leaky_relu", [x], "f64", [101], scalars=(0.2, 0.0)),
          b.op("softplus", [x], "f64", [101], scalars=(2.0, 5.0)))
    xt = torch.linspace(-10, 10, 101, dtype=torch.float64)
    lr, sp = run_graph(b.g, [xt])
    torch.testing.assert_close(lr, F.leaky_relu(xt, 0.2), rtol=1e-15, atol=0)
    torch.testing.assert_close(sp, F.softplus(xt, beta=2.0, threshold=5.0), rtol=1e-15, atol=0)


BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "max": torch.maximum, "min": torch.minimum, "pow": lambda a, b: torch.pow(a.abs() + 0.5, b),
}
COMPARE = {"lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne}


@pytest.mark.parametrize("dt", ["f32", "f16", "f64"])
@pytest.mark.parametrize("op", sorted(BINARY) + sorted(COMPARE))
def test_binary(op, dt):
    shape = [3, 40]
    b = Builder()
    x, y = b.input("x", dt, shape), b.input("y", dt, shape)
    lhs = x
    if op == "pow":
        lhs = b.op("add", [b.op("abs", [x], dt, shape), b.op("const", [], dt, shape, scalars=(0.5, 0.0))], dt, shape)
    out_dt = "bool" if op in COMPARE else dt
    b.out(b.op(op, [lhs, y], out_dt, shape))
    gen = torch.Generator().manual_seed(3)
    xt = torch.randn(shape, generator=gen).to(DT[dt])
    yt = torch.randn(shape, generator=gen).to(DT[dt])
    yt[0, :10] = xt[0, :10]  # ties for the comparisons
    xt[2, 0], yt[2, 1] = float("nan"), float("nan")  # NaN through max, min, comparisons
    (z,) = run_graph(b.g, [xt, yt])
    ref = (COMPARE.get(op) or BINARY[op])(xt.double(), yt.double())
    assert_stored(z, ref, ulps=2)


def test_logic_and_where():
    shape = [64]
    b = Builder()
    c, d = b.input("c", "bool", shape), b.input("d", "bool", shape)
    x, y = b.input("x", "f32", shape), b.input("y", "f32", shape)
    b.out(b.op("and", [c, d], "bool", shape), b.op("or", [c, d], "bool", shape),
          b.op("not", [c], "bool", shape), b.op("where", [c, x, y], "f32", shape))
    gen = torch.Generator().manual_seed(4)
    ct, dt_ = torch.rand(64, generator=gen) > 0.5, torch.rand(64, generator=gen) > 0.5
    xt, yt = torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    a, o, n, w = run_graph(b.g, [ct, dt_, xt, yt])
    assert torch.equal(a, ct & dt_) and torch.equal(o, ct | dt_) and torch.equal(n, ~ct)
    assert torch.equal(w, torch.where(ct, xt, yt))


# ---------------------------------------------------------------------- reductions

@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("axes", [0b001, 0b010, 0b100, 0b011, 0b110, 0b101, 0b111])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_reduce(op, axes, keepdim):
    shape = [3, 4, 5]
    dims = [i for i in range(3) if axes >> i & 1]
    out_shape = [1 if i in dims else s for i, s in enumerate(shape)] if keepdim else \
        [s for i, s in enumerate(shape) if i not in dims]
    b = Builder()
    x = b.input("x", "f32", shape)
    b.out(b.op(op, [x], "f32", out_shape, axes=axes))
    xt = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    if op in ("max", "min"):
        xt[1, 2, 3] = float("nan")  # propagates, like torch.amax / amin
    (y,) = run_graph(b.g, [xt])
    x64 = xt.double()
    ref = {"sum": lambda: x64.sum(dims, keepdim=keepdim), "mean": lambda: x64.mean(dims, keepdim=keepdim),
           "max": lambda: x64.amax(dims, keepdim=keepdim), "min": lambda: x64.amin(dims, keepdim=keepdim)}[op]()
    assert y.shape == ref.shape
    assert_stored(y, ref)


def test_reduce_integer_and_bool_sums():
    b = Builder()
    m, k = b.input("m", "bool", [6, 7]), b.input("k", "i64", [6, 7])
    b.out(b.op("sum", [m], "i64", [6], axes=0b10), b.op("sum", [k], "i64", [7], axes=0b01))
    gen = torch.Generator().manual_seed(6)
    mt, kt = torch.rand(6, 7, generator=gen) > 0.3, torch.randint(-1000, 1000, (6, 7), generator=gen)
    s1, s2 = run_graph(b.g, [mt, kt])
    assert torch.equal(s1, mt.sum(1)) and torch.equal(s2, kt.sum(0))


# ---------------------------------------------------------------------- index maps and gather

def test_views():
    b = Builder(s0=3)
    x = b.input("x", "f32", ["s0", 4, 5])
    p = b.op("permute", [x], "f32", [5, "s0", 4], perm=[2, 0, 1])
    r = b.op("reshape", [p], "f32", [5, (4, ("s0",))])
    e = b.op("expand", [b.op("reshape", [r], "f32", [5, 1, (4, ("s0",))])], "f32", [5, 6, (4, ("s0",))])
    sl = b.op("slice", [x], "f32", ["s0", 2, 5], axis=1, start=1, step=2)
    b.out(p, r, e, sl)
    for s0 in (3, 1):
        xt = torch.randn(s0, 4, 5, generator=torch.Generator().manual_seed(s0))
        p_, r_, e_, sl_ = run_graph(b.g, [xt], [s0])
        assert torch.equal(p_, xt.permute(2, 0, 1))
        assert torch.equal(r_, xt.permute(2, 0, 1).reshape(5, 4 * s0))
        assert torch.equal(e_, xt.permute(2, 0, 1).reshape(5, 1, 4 * s0).expand(5, 6, 4 * s0))
        assert torch.equal(sl_, xt[:, 1::2])


@pytest.mark.parametrize("index_dtype", ["i64", "i32"])
def test_gather(index_dtype):
    b = Builder()
    x = b.input("x", "f32", [4, 10])
    i1 = b.input("i1", index_dtype, [4, 3])
    i0 = b.input("i0", index_dtype, [2, 10])
    b.out(b.op("gather", [x, i1], "f32", [4, 3], axis=1), b.op("gather", [x, i0], "f32", [2, 10], axis=0))
    gen = torch.Generator().manual_seed(7)
    xt = torch.randn(4, 10, generator=gen)
    it1 = torch.randint(0, 10, (4, 3), generator=gen)
    it0 = torch.randint(0, 4, (2, 10), generator=gen)
    g1, g0 = run_graph(b.g, [xt, it1.to(DT[index_dtype]), it0.to(DT[index_dtype])])
    assert torch.equal(g1, torch.gather(xt, 1, it1)) and torch.equal(g0, torch.gather(xt, 0, it0))
    for bad in (10, -1):
        it1[2, 1] = bad
        with pytest.raises(ValueError, match="out of range"):
            run_graph(b.g, [xt, it1.to(DT[index_dtype]), it0.to(DT[index_dtype])])


def test_cross_entropy_decomposed():
    """log_softmax + gather of the target + mean: how capture lowers F.cross_entropy."""
    n, c = 6, 11
    b = Builder(s0=n)
    x, t = b.input("x", "f32", ["s0", c]), b.input("t", "i64", ["s0", 1])
    full, keep = ["s0", c], ["s0", 1]
    m = b.op("expand", [b.op("max", [x], "f32", keep, axes=0b10)], "f32", full)
    z = b.op("sub", [x, m], "f32", full)
    lse = b.op("log", [b.op("sum", [b.op("exp", [z], "f32", full)], "f32", keep, axes=0b10)], "f32", keep)
    logp = b.op("sub", [z, b.op("expand", [lse], "f32", full)], "f32", full)
    picked = b.op("gather", [logp, t], "f32", keep, axis=1)
    b.out(b.op("neg", [b.op("mean", [picked], "f32", [], axes=0b11)], "f32", []))
    gen = torch.Generator().manual_seed(8)
    xt, tt = torch.randn(n, c, generator=gen) * 4, torch.randint(0, c, (n,), generator=gen)
    (loss,) = run_graph(b.g, [xt, tt[:, None]], [n])
    assert_stored(loss, F.cross_entropy(xt.double(), tt))


# ---------------------------------------------------------------------- casts and the store rule

SPECIAL = [0.0, -0.0, 1 / 3, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 65504.0, 65519.0,
           65520.0, 1e5, 3e-8, 1e-8, 2 ** -24 * 1.5, 1e-40, 3.4e38, float("inf"), float("-inf"),
           -2.7, 2.7, -0.5, 0.5, 1e10, -1e10, 123456789.0]


@pytest.mark.parametrize("src", ["f32", "f64"])
@pytest.mark.parametrize("dst", ["bf16", "f16", "f32", "i64", "i32", "bool"])
def test_cast(src, dst):
    vals = SPECIAL + torch.randn(200, generator=torch.Generator().manual_seed(9)).mul(1000).tolist()
    if dst in ("i64", "i32"):
        vals = [v for v in vals if math.isfinite(v) and abs(v) < 2 ** 31]  # out of range: unspecified in torch
    xt = torch.tensor(vals, dtype=DT[src])
    b = Builder()
    x = b.input("x", src, [len(vals)])
    c = b.op("cast", [x], dst, [len(vals)])
    b.out(c, b.op("cast", [c], "f64", [len(vals)]))  # the CAST node itself rounds
    y, back = run_graph(b.g, [xt])
    want = xt.to(DT[dst])
    if dst in ("bf16", "f16"):
        # bit for bit (through f32, round to nearest even), like torch's .to()
        assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    else:
        assert torch.equal(y, want)
    assert torch.equal(back, want.double())


def test_nan_casts():
    xt = torch.tensor([float("nan"), -float("nan")], dtype=torch.float32)
    b = Builder()
    x = b.input("x", "f32", [2])
    b.out(b.op("cast", [x], "bf16", [2]), b.op("cast", [x], "f16", [2]), b.op("cast", [x], "bool", [2]))
    bf, h, bo = run_graph(b.g, [xt])
    assert bf.isnan().all() and h.isnan().all() and bo.all()


@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_round_once_on_store(dt):
    """Intermediates stay in double: ((x * 3) / 3 - x) * 1000 + x is x exactly, where eager
    torch in bf16/f16 rounds after every op and drifts."""
    shape = [256]
    b = Builder()
    x = b.input("x", dt, shape)
    k = lambda v: b.op("const", [], dt, shape, scalars=(v, 0.0))  # noqa: E731
    t = b.op("div", [b.op("mul", [x, k(3.0)], dt, shape), k(3.0)], dt, shape)
    d = b.op("mul", [b.op("sub", [t, x], dt, shape), k(1000.0)], dt, shape)
    b.out(b.op("add", [d, x], dt, shape))
    xt = torch.randn(256, generator=torch.Generator().manual_seed(10)).to(DT[dt])
    (y,) = run_graph(b.g, [xt])
    assert torch.equal(y, xt)
    eager = ((xt * 3) / 3 - xt) * 1000 + xt
    assert not torch.equal(eager, xt)  # the property is not vacuous


def test_extern_graph_refused():
    b = Builder()
    x = b.input("x", "f32", [2, 2])
    b.out(b.op("extern", [x, x], "f32", [2, 2], index=0))
    with pytest.raises(ValueError, match="EXTERN"):
        run_graph(b.g, [torch.zeros(2, 2)])


# ---------------------------------------------------------------------- regions

def run_regions(g, inputs, symvals=()):
    """Runs every region of g.partition() in order with interp_region, passing values between
    regions in their IR dtype; returns the graph's outputs."""
    p = g.partition()
    symvals = list(symvals)
    vals = dict(zip(g.inputs, [t.contiguous() for t in inputs]))
    for r in range(len(p)):
        reg = p.region(r)
        assert reg["kind"] != "extern"
        outs = interp.run_region(p, r, symvals, [vals[v] for v in reg["inputs"]])
        vals.update(zip(reg["outputs"], outs))
    return [vals[v] for v in g.outputs]


@pytest.mark.parametrize("dt", ["f64", "f32"])
def test_regions_match_graph(dt):
    n = 40
    b = Builder(s0=5)
    x, w, bias = b.input("x", dt, ["s0", n]), b.input("w", dt, [n], "param"), b.input("b", dt, [n], "param")
    full, keep = ["s0", n], ["s0", 1]
    ln = build_layernorm(b, dt, x, w, bias, n, 1e-5)
    h = b.op("gelu", [ln], dt, full)
    m = b.op("expand", [b.op("max", [h], dt, keep, axes=0b10)], dt, full)
    e = b.op("exp", [b.op("sub", [h, m], dt, full)], dt, full)
    sm = b.op("div", [e, b.op("expand", [b.op("sum", [e], dt, keep, axes=0b10)], dt, full)], dt, full)
    col = b.op("sum", [sm], dt, [n], axes=0b01)  # a column reduction too
    b.out(sm, col, ln)
    gen = torch.Generator().manual_seed(11)
    xt = torch.randn(5, n, generator=gen).to(DT[dt])
    wt, bt = torch.randn(n, generator=gen).to(DT[dt]), torch.randn(n, generator=gen).to(DT[dt])
    whole = run_graph(b.g, [xt, wt, bt], [5])
    pieces = run_regions(b.g, [xt, wt, bt], [5])
    for a, c in zip(whole, pieces):
        if dt == "f64":  # nothing is rounded between regions: identical
            assert torch.equal(a, c)
        else:  # values crossing a region boundary are stored in f32
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)
