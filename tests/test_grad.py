"""Autodiff on the IR (csrc/grad/) through the binding: Graph.grad(wrt) builds the backward graph,
the C interpreter runs forward and backward on CPU tensors, and the gradients must match
torch.autograd in float64 at two symbol bindings. Also Partition.region_graph(r)."""
import math

import pytest
import torch
import torch.nn.functional as F

from kbench import _C
from kbench.runtime.interp import run_graph, run_region

S0 = (1, (0,))  # the dim "s0": 1 * s0
SYMVALS = ([3], [5])
TORCH_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64,
                "i64": torch.int64, "i32": torch.int32, "bool": torch.bool}


class GB:
    """A graph under construction that remembers each value's dims and dtype."""

    def __init__(self, nsyms=1):
        self.g = _C.Graph()
        for i in range(nsyms):
            self.g.add_symbol(f"s{i}", 3)
        self.dims, self.dtype = {}, {}

    def _rec(self, v, dims, dtype):
        self.dims[v], self.dtype[v] = list(dims), dtype
        return v

    def input(self, name, dims, dtype="f64", kind="user"):
        return self._rec(self.g.add_input(name, kind, dtype, list(dims)), dims, dtype)

    def op(self, op, *xs, dims=None, dtype=None, **kw):
        dims = self.dims[xs[0]] if dims is None else dims
        if dtype is None:  # the first float operand's (where's condition and gather's index are not)
            dtype = next((self.dtype[v] for v in xs if self.dtype[v] not in ("bool", "i64", "i32")), self.dtype[xs[0]])
        return self._rec(self.g.add_node(op, list(xs), dtype, list(dims), **kw), dims, dtype)

    def const(self, value, dims, dtype="f64"):
        return self._rec(self.g.add_node("const", [], dtype, list(dims), scalars=(value, 0.0)), dims, dtype)

    def reduce(self, op, x, axes, keepdim):
        d = self.dims[x]
        dims = [1 if i in axes else s for i, s in enumerate(d) if keepdim or i not in axes]
        return self.op(op, x, dims=dims, axes=sum(1 << a for a in axes))

    def view(self, op, x, dims, **kw):
        return self.op(op, x, dims=dims, **kw)

    def out(self, *vs):
        for v in vs:
            self.g.add_output(v)


def concrete(dims, sv):
    return [d if isinstance(d, int) else d[0] * math.prod(sv[s] for s in d[1]) for d in dims]


def run(g, sv, inputs):
    """Runs g in the interpreter; inputs are CPU tensors in input order, returns the outputs."""
    outs = run_graph(g, sv, inputs)
    return outs


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item() if b.numel() else 0.0


def check_vjp(gb, torch_fn, make_inputs, wrt=None, tol=1e-9):
    """Forward and VJP through the IR against torch (float64) at every binding in SYMVALS."""
    g = gb.g
    nin = g.num_inputs
    wrt = [TORCH_DTYPES[g.node(v)["dtype"]].is_floating_point for v in g.inputs] if wrt is None else wrt
    gg = g.grad(wrt)
    assert gg.num_inputs == nin + g.num_outputs and gg.num_outputs == sum(map(bool, wrt))
    for k in range(g.num_outputs):
        assert gg.node(gg.inputs[nin + k])["name"] == f"grad_out{k}"
    for sv in SYMVALS:
        torch.manual_seed(sv[0])
        inputs = make_inputs(lambda v: concrete(gb.dims[v], sv))
        outs = run(g, sv, inputs)
        leaves = [x.clone().requires_grad_(bool(w)) for x, w in zip(inputs, wrt)]
        want = torch_fn(*leaves)
        want = list(want) if isinstance(want, (tuple, list)) else [want]
        assert len(want) == len(outs)
        for o, w in zip(outs, want):
            assert o.shape == w.shape and rel_err(o, w.detach()) <= tol
        gouts = [torch.randn_like(o) if o.is_floating_point() else torch.zeros_like(o) for o in outs]
        grads = run(gg, sv, inputs + gouts)
        diff = [(w, go) for w, go in zip(want, gouts) if w.requires_grad]
        ref = torch.autograd.grad([w for w, _ in diff], [x for x, f in zip(leaves, wrt) if f],
                                  [go for _, go in diff], allow_unused=True)
        for got, r, x in zip(grads, ref, [x for x, f in zip(leaves, wrt) if f]):
            r = torch.zeros_like(x) if r is None else r
            assert got.dtype == x.dtype and got.shape == x.shape
            assert rel_err(got, r) <= tol, (sv, got, r)


# ---------------------------------------------------------------- pointwise ops

def pos(x):
    return x.abs() + 0.3


UNARY = [  # (op, scalars, torch, input transform)
    ("neg", None, torch.neg, None), ("abs", None, torch.abs, None), ("exp", None, torch.exp, None),
    ("log", None, torch.log, pos), ("log1p", None, torch.log1p, pos), ("expm1", None, torch.expm1, None),
    ("sqrt", None, torch.sqrt, pos), ("rsqrt", None, torch.rsqrt, pos), ("recip", None, torch.reciprocal, pos),
    ("sin", None, torch.sin, None), ("cos", None, torch.cos, None), ("tanh", None, torch.tanh, None),
    ("erf", None, torch.erf, None), ("sigmoid", None, torch.sigmoid, None), ("relu", None, torch.relu, None),
    ("leaky_relu", (0.1, 0.0), lambda x: F.leaky_relu(x, 0.1), None), ("gelu", None, F.gelu, None),
    ("gelu_tanh", None, lambda x: F.gelu(x, approximate="tanh"), None), ("silu", None, F.silu, None),
    ("mish", None, F.mish, None), ("softplus", (2.0, 1.5), lambda x: F.softplus(x, beta=2.0, threshold=1.5), None),
    ("hardswish", None, F.hardswish, lambda x: 3 * x),
]


@pytest.mark.parametrize("op,scalars,fn,tf", UNARY, ids=[u[0] for u in UNARY])
def test_unary(op, scalars, fn, tf):
    gb = GB()
    x = gb.input("x", [S0, 7])
    gb.out(gb.op(op, x, **({"scalars": scalars} if scalars else {})))
    tf = tf or (lambda t: t)
    check_vjp(gb, fn, lambda shape: [tf(torch.randn(shape(x), dtype=torch.float64))])


KINKS = torch.tensor([-3.0, 3.0, 0.0, -0.0, 6.0, 0.75, -6.0], dtype=torch.float64)


@pytest.mark.parametrize("op,scalars,fn,tf", [u for u in UNARY if u[3] is not pos], ids=[u[0] for u in UNARY if u[3] is not pos])
def test_unary_at_kinks(op, scalars, fn, tf):
    """At the points where a rule switches branch (hardswish at ±3, relu at 0, softplus at its
    threshold) the derivative is torch's one-sided choice, not the other branch's."""
    gb = GB()
    x = gb.input("x", [S0, 7])
    gb.out(gb.op(op, x, **({"scalars": scalars} if scalars else {})))
    check_vjp(gb, fn, lambda shape: [KINKS.expand(shape(x)).clone()])


BINARY = [("add", torch.add, None), ("sub", torch.sub, None), ("mul", torch.mul, None),
          ("div", torch.div, pos), ("max", torch.maximum, None), ("min", torch.minimum, None),
          ("pow", torch.pow, pos)]


@pytest.mark.parametrize("op,fn,tf", BINARY, ids=[b[0] for b in BINARY])
def test_binary(op, fn, tf):
    gb = GB()
    x, y = gb.input("x", [S0, 7]), gb.input("y", [S0, 7])
    gb.out(gb.op(op, x, y))
    tf = tf or (lambda t: t)
    check_vjp(gb, fn, lambda shape: [tf(torch.randn(shape(x), dtype=torch.float64)),
                                     tf(torch.randn(shape(y), dtype=torch.float64))])


def test_where_of_comparison():
    gb = GB()
    x, y = gb.input("x", [S0, 6]), gb.input("y", [S0, 6])
    c = gb.op("gt", x, y, dtype="bool")
    gb.out(gb.op("where", c, gb.op("mul", x, x), gb.op("exp", y)))
    check_vjp(gb, lambda a, b: torch.where(a > b, a * a, b.exp()),
              lambda shape: [torch.randn(shape(x), dtype=torch.float64) for _ in range(2)])


# ---------------------------------------------------------------- reductions and index maps

@pytest.mark.parametrize("op,fn", [("sum", torch.sum), ("mean", torch.mean),
                                   ("max", torch.amax), ("min", torch.amin)])
@pytest.mark.parametrize("axes", [(0,), (1,), (2,), (0, 2), (0, 1, 2)])
@pytest.mark.parametrize("keepdim", [False, True])
def test_reduce(op, fn, axes, keepdim):
    gb = GB()
    x = gb.input("x", [S0, 3, 4])
    gb.out(gb.reduce(op, gb.op("sin", x), axes, keepdim))
    check_vjp(gb, lambda t: fn(t.sin(), dim=axes, keepdim=keepdim),
              lambda shape: [torch.randn(shape(x), dtype=torch.float64)])


@pytest.mark.parametrize("op,fn", [("max", torch.amax), ("min", torch.amin)])
def test_reduce_ties_split_like_amax(op, fn):
    gb = GB()
    x = gb.input("x", [S0, 4])
    gb.out(gb.reduce(op, x, (1,), False))
    check_vjp(gb, lambda t: fn(t, dim=1),
              lambda shape: [torch.randint(0, 3, shape(x)).to(torch.float64)])  # many ties


def test_views():
    gb = GB()
    x, z = gb.input("x", [S0, 1, 3]), gb.input("z", [S0, 4, 3])
    e = gb.op("mul", gb.view("expand", x, [S0, 4, 3]), z)
    p = gb.view("permute", e, [3, S0, 4], perm=[2, 0, 1])
    r = gb.view("reshape", gb.op("tanh", p), [3, (4, (0,))])
    gb.out(r)
    check_vjp(gb, lambda a, b: torch.tanh((a.expand(-1, 4, 3) * b).permute(2, 0, 1)).reshape(3, -1),
              lambda shape: [torch.randn(shape(x), dtype=torch.float64), torch.randn(shape(z), dtype=torch.float64)])


# ---------------------------------------------------------------- composites, as capture decomposes them

def layernorm(gb, x, w, b, n, eps):
    full, keep = gb.dims[x], gb.dims[x][:-1] + [1]
    mean = gb.reduce("mean", x, (1,), True)
    xc = gb.op("sub", x, gb.view("expand", mean, full))
    var = gb.reduce("mean", gb.op("mul", xc, xc), (1,), True)
    rs = gb.op("rsqrt", gb.op("add", var, gb.const(eps, keep)))
    xn = gb.op("mul", xc, gb.view("expand", rs, full))
    we = gb.view("expand", gb.view("reshape", w, [1, n]), full)
    be = gb.view("expand", gb.view("reshape", b, [1, n]), full)
    return gb.op("add", gb.op("mul", xn, we), be)


def log_softmax(gb, x):
    full = gb.dims[x]
    xs = gb.op("sub", x, gb.view("expand", gb.reduce("max", x, (1,), True), full))
    lse = gb.op("log", gb.reduce("sum", gb.op("exp", xs), (1,), True))
    return gb.op("sub", xs, gb.view("expand", lse, full))


def softmax(gb, x):
    full = gb.dims[x]
    e = gb.op("exp", gb.op("sub", x, gb.view("expand", gb.reduce("max", x, (1,), True), full)))
    return gb.op("div", e, gb.view("expand", gb.reduce("sum", e, (1,), True), full))


def rms_norm(gb, x, w, n, eps):
    full, keep = gb.dims[x], gb.dims[x][:-1] + [1]
    ms = gb.reduce("mean", gb.op("mul", x, x), (1,), True)
    r = gb.op("rsqrt", gb.op("add", ms, gb.const(eps, keep)))
    return gb.op("mul", gb.op("mul", x, gb.view("expand", r, full)),
                 gb.view("expand", gb.view("reshape", w, [1, n]), full))


def test_layernorm():
    gb = GB()
    x, w, b = gb.input("x", [S0, 8]), gb.input("weight", [8], kind="param"), gb.input("bias", [8], kind="param")
    gb.out(layernorm(gb, x, w, b, 8, 1e-5))
    check_vjp(gb, lambda a, ww, bb: F.layer_norm(a, (8,), ww, bb, 1e-5),
              lambda shape: [torch.randn(shape(v), dtype=torch.float64) for v in (x, w, b)])


def test_softmax_and_log_softmax_two_outputs():
    gb = GB()
    x = gb.input("x", [S0, 8])
    gb.out(softmax(gb, x), log_softmax(gb, x))
    check_vjp(gb, lambda a: (torch.softmax(a, -1), torch.log_softmax(a, -1)),
              lambda shape: [3 * torch.randn(shape(x), dtype=torch.float64)])


def test_rms_norm():
    gb = GB()
    x, w = gb.input("x", [S0, 8]), gb.input("weight", [8], kind="param")
    gb.out(rms_norm(gb, x, w, 8, 1e-6))
    check_vjp(gb, lambda a, ww: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * ww,
              lambda shape: [torch.randn(shape(v), dtype=torch.float64) for v in (x, w)])


def test_value_used_three_times_and_wrt_subset():
    gb = GB()
    x, y, k = gb.input("x", [S0, 4]), gb.input("y", [S0, 4]), gb.input("k", [S0, 4], dtype="i64")
    xx = gb.op("mul", x, x)
    gb.out(gb.op("add", gb.op("mul", xx, gb.op("cast", k, dtype="f64")), gb.op("mul", x, y)))
    check_vjp(gb, lambda a, b, kk: a * a * kk + a * b,
              lambda shape: [torch.randn(shape(x), dtype=torch.float64), torch.randn(shape(y), dtype=torch.float64),
                             torch.randint(-2, 3, shape(k))],
              wrt=[True, False, False])


def test_mean_over_symbolic_dim():
    gb = GB()
    x = gb.input("x", [S0, 3])
    gb.out(gb.op("exp", gb.reduce("mean", x, (0,), False)))
    check_vjp(gb, lambda a: a.mean(0).exp(), lambda shape: [torch.randn(shape(x), dtype=torch.float64)])


def test_f32_graph_gives_f32_gradients():
    gb = GB()
    x = gb.input("x", [S0, 8], dtype="f32")
    gb.out(softmax(gb, x))
    gg = gb.g.grad([True])
    assert gg.node(gg.outputs[0])["dtype"] == "f32"
    xs, go = torch.randn(3, 8), torch.randn(3, 8)
    (got,) = run(gg, [3], [xs, go])
    xd = xs.double().requires_grad_()
    (ref,) = torch.autograd.grad(torch.softmax(xd, -1), xd, go.double())
    assert rel_err(got.double(), ref) <= 1e-6


# ---------------------------------------------------------------- what is refused

def test_errors():
    gb = GB()
    x, k = gb.input("x", [S0, 4]), gb.input("k", [S0, 1], dtype="i64")
    gb.out(gb.op("gather", log_softmax(gb, x), k, dims=[S0, 1], axis=1))
    with pytest.raises(ValueError):
        gb.g.grad([True, True])          # an integer input has no gradient
    with pytest.raises(ValueError):
        gb.g.grad([True])                # one flag per input
    # one index per row differentiates (an iota mask); two per row would need a scatter
    assert gb.g.grad([True, False]).num_outputs == 1
    assert gb.g.grad([False, False]).num_outputs == 0
    with pytest.raises(ValueError):
        gb.g.grad([True, False], saved=2)   # more saved statistics than outputs
    with pytest.raises(ValueError):
        gb.g.grad([True, False], saved=-1)
    gb2 = GB()
    x2, k2 = gb2.input("x", [S0, 4]), gb2.input("k", [S0, 2], dtype="i64")
    gb2.out(gb2.op("gather", x2, k2, dims=[S0, 2], axis=1))
    with pytest.raises(NotImplementedError):
        gb2.g.grad([True, False])


# ---------------------------------------------------------------- regions as graphs

def test_region_graph_runs_like_the_region():
    gb = GB()
    x, w, b = gb.input("x", [S0, 8]), gb.input("weight", [8], kind="param"), gb.input("bias", [8], kind="param")
    gb.out(gb.op("gelu", layernorm(gb, softmax(gb, x), w, b, 8, 1e-5)))
    p = gb.g.partition()
    assert len(p) >= 1
    sv = [5]
    for r in range(len(p)):
        reg, rg = p.region(r), p.region_graph(r)
        assert rg.num_inputs == len(reg["inputs"]) and rg.num_outputs == len(reg["outputs"])
        if reg["kind"].lower() == "extern":
            continue
        ins = [torch.randn(gb.g.sizes(v, sv), dtype=TORCH_DTYPES[gb.g.node(v)["dtype"]]) for v in reg["inputs"]]
        for v, i in zip(reg["inputs"], rg.inputs):
            assert rg.node(i)["dtype"] == gb.g.node(v)["dtype"] and rg.sizes(i, sv) == gb.g.sizes(v, sv)
        want = run_region(p, r, sv, ins)
        got = run(rg, sv, ins)
        for a, c in zip(got, want):
            assert torch.equal(a, c)
        # and a region graph differentiates like any graph
        rg.grad([True] * rg.num_inputs)


def test_nograd_cuts_the_stability_shift():
    """x - max(x) with the max marked nograd: its gradient is g itself (the shift is a
    constant to autodiff); without the mark, the max's gradient lands on the argmax."""
    import torch
    from kbench import _C

    def build(nograd):
        g = _C.Graph()
        x = g.add_input("x", "user", "f64", [2, 5])
        m = g.add_node("max", [x], "f64", [2, 1], axes=2, nograd=nograd)
        e = g.add_node("expand", [m], "f64", [2, 5])
        y = g.add_node("sub", [x, e], "f64", [2, 5])
        g.add_output(y)
        return g

    x = torch.randn(2, 5, dtype=torch.float64)
    up = torch.randn(2, 5, dtype=torch.float64)
    for nograd in (True, False):
        bwd = build(nograd).grad([True])
        assert ("nograd" in str(build(nograd))) == nograd
        out = torch.empty(2, 5, dtype=torch.float64)
        run_graph(bwd, [], [x, up], [out])
        want = up.clone()
        if not nograd:
            want[torch.arange(2), x.argmax(1)] -= up.sum(1)
        assert torch.allclose(out, want), (nograd, out, want)


def test_gather_and_slice_adjoints_match_autograd():
    """Cross-entropy's gather (one index per row) and a chunk (slice, step 1) now differentiate
    inside the IR: the backward graph run by the interpreter matches torch.autograd."""
    import torch
    import torch.nn.functional as F
    from kbench.capture import capture

    class CE(torch.nn.Module):
        def forward(self, x, t):
            return F.cross_entropy(x, t, reduction="sum")

    class Swiglu(torch.nn.Module):
        def forward(self, x):
            a, b = x.chunk(2, dim=-1)
            return F.silu(a) * b

    cases = [(CE(), (torch.randn(6, 11, dtype=torch.float64), torch.randint(0, 11, (6,)))),
             (Swiglu(), (torch.randn(5, 8, dtype=torch.float64),))]
    for model, args in cases:
        cap = capture(model, args)
        g = cap.graph
        wrt = [args[i].is_floating_point() if i < len(args) else False for i in range(g.num_inputs)]
        bwd = g.grad(wrt)
        assert "iota" in str(bwd)
        out = model(*[a.clone().requires_grad_(a.is_floating_point()) for a in args])
        up = torch.randn_like(out)
        xs = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
        want = torch.autograd.grad(model(*xs), [x for x in xs if x.requires_grad], up)
        ins = list(args) + [up]
        outs = [torch.empty_like(w) for w in want]
        run_graph(bwd, cap.example_symvals, ins, outs)
        for o, w in zip(outs, want):
            assert torch.allclose(o, w, atol=1e-12, rtol=1e-9), (type(model).__name__, o, w)


# ---------------------------------------------------------------- slices that tile an axis

def _slice(gb, x, axis, start, length):
    dims = list(gb.dims[x])
    dims[axis] = length
    return gb.view("slice", x, dims, axis=axis, start=start, step=1)


def _ops(g):
    """(op, dims) of every node of g."""
    return [(g.node(v)["op"], g.node(v)["dims"]) for v in range(g.num_nodes)]


def test_chunk_adjoint_is_one_select_in_one_pointwise_region():
    """x.chunk(3): the slices tile the axis, so dx is one select on the column index (two
    `where`s, no sum of zero-padded copies), and the backward is one POINTWISE region over dx's
    shape that reads x and the upstream gradient and writes dx alone: the chunks' gradients are
    recomputed where dx reads them, never materialized."""
    gb = GB()
    x = gb.input("x", [S0, 12])
    a, b, c = (_slice(gb, x, 1, 4 * k, 4) for k in range(3))
    gb.out(gb.op("add", gb.op("mul", gb.op("silu", a), b), gb.op("sin", c)))
    check_vjp(gb, lambda t: F.silu(t[:, :4]) * t[:, 4:8] + torch.sin(t[:, 8:]),
              lambda shape: [torch.randn(shape(x), dtype=torch.float64)])
    bwd = gb.g.grad([True])
    ops = _ops(bwd)
    full = [S0, 12]
    assert [o for o, d in ops if d == full and o in ("add", "where")] == ["where", "where"], str(bwd)
    assert sum(o == "gather" for o, _ in ops) == 3
    p = bwd.partition()
    assert len(p) == 1, str(p)
    reg = p.region(0)
    assert reg["kind"] == "POINTWISE" and bwd.node(reg["anchor"])["dims"] == full
    assert reg["inputs"] == list(bwd.inputs) and reg["outputs"] == list(bwd.outputs)


def test_slice_adjoints_with_gaps_overlaps_and_two_axes():
    """Slices of x that leave gaps (zeros there: one select with a zero default) and cut another
    axis, slices of y that overlap (each zero-padded, summed): the adjoints still match
    autograd."""
    gb = GB()
    x, y = gb.input("x", [6, 10]), gb.input("y", [S0, 10])
    xa, xb, xr = _slice(gb, x, 1, 1, 2), _slice(gb, x, 1, 6, 3), _slice(gb, x, 0, 1, 2)
    ya, yb, yc = _slice(gb, y, 1, 0, 4), _slice(gb, y, 1, 2, 5), _slice(gb, y, 1, 7, 3)
    sx = gb.op("add", gb.reduce("sum", gb.op("exp", xa), (1,), True),
               gb.reduce("sum", gb.op("mul", xb, xb), (1,), True))
    sy = gb.op("add", gb.op("add", gb.reduce("sum", gb.op("sin", ya), (1,), True),
                              gb.reduce("sum", gb.op("cos", yb), (1,), True)),
               gb.reduce("sum", gb.op("exp", yc), (1,), True))
    gb.out(sx, gb.op("tanh", xr), sy)

    def fn(a, b):
        sx = a[:, 1:3].exp().sum(1, keepdim=True) + (a[:, 6:9] ** 2).sum(1, keepdim=True)
        sy = b[:, :4].sin().sum(1, keepdim=True) + b[:, 2:7].cos().sum(1, keepdim=True) + b[:, 7:].exp().sum(1, keepdim=True)
        return sx, torch.tanh(a[1:3]), sy

    check_vjp(gb, fn, lambda shape: [torch.randn(shape(x), dtype=torch.float64),
                                     torch.randn(shape(y), dtype=torch.float64)])


def test_whole_axis_slice_and_single_chunk_half():
    """A slice that is the whole axis reads g at the coordinate itself; one half of a chunk
    alone leaves zeros in the other half."""
    gb = GB()
    x = gb.input("x", [S0, 8])
    gb.out(gb.op("exp", _slice(gb, x, 1, 0, 8)), gb.op("sin", _slice(gb, x, 1, 4, 4)))
    check_vjp(gb, lambda t: (t.exp(), t[:, 4:].sin()), lambda shape: [torch.randn(shape(x), dtype=torch.float64)])


def test_saved_outputs_become_inputs():
    """grad(wrt, saved=k): the last k outputs (statistics the forward kept) are read, not
    recomputed, and take no upstream gradient; the gradient is the same as without."""
    gb = GB()
    x = gb.input("x", [S0, 6])
    m = gb.reduce("max", x, (1,), True)
    e = gb.op("exp", gb.op("sub", x, gb.view("expand", m, gb.dims[x])))
    s = gb.reduce("sum", e, (1,), True)
    gb.out(gb.op("div", e, gb.view("expand", s, gb.dims[x])))
    gb.out(m)
    gb.out(s)
    full, saved = gb.g.grad([True]), gb.g.grad([True], saved=2)
    assert [full.node(v)["name"] for v in full.inputs] == ["x", "grad_out0", "grad_out1", "grad_out2"]
    assert [saved.node(v)["name"] for v in saved.inputs] == ["x", "saved0", "saved1", "grad_out0"]
    assert "max" not in {saved.node(v)["op"] for v in range(saved.num_nodes)}   # read, not recomputed
    sv = [3]
    x_ = torch.randn(3, 6, dtype=torch.float64)
    m_, s_ = x_.amax(1, keepdim=True), (x_ - x_.amax(1, keepdim=True)).exp().sum(1, keepdim=True)
    g_ = torch.randn(3, 6, dtype=torch.float64)
    zeros = torch.zeros(3, 1, dtype=torch.float64)
    want = run(full, sv, [x_, g_, zeros, zeros])[0]
    got = run(saved, sv, [x_, m_, s_, g_])[0]
    assert rel_err(got, want) < 1e-12
    xr = x_.clone().requires_grad_(True)
    (torch.softmax(xr, 1) * g_).sum().backward()
    assert rel_err(got, xr.grad) < 1e-12


# ---------------------------------------------------------------- the one-hot's row sum (simplify.c)

def _one_hot_sums(g):
    """Sums of g whose operand is, through neg / cast / mul / div, a where on iota ==/!= index: the
    row sum of a one-hot, a pass over the row that simplify() turns into per-row work."""
    def is_one_hot(v):
        n = g.node(v)
        if n["op"] in ("neg", "cast", "mul", "div"):
            return any(is_one_hot(u) for u in n["inputs"])
        if n["op"] != "where":
            return False
        c = g.node(n["inputs"][0])
        return c["op"] in ("eq", "ne") and any(
            g.node(u)["op"] == "iota" or (g.node(u)["op"] == "expand" and g.node(g.node(u)["inputs"][0])["op"] == "iota")
            for u in c["inputs"])
    return [v for v in range(g.num_nodes) if g.node(v)["op"] == "sum" and is_one_hot(g.node(v)["inputs"][0])]


@pytest.mark.parametrize("kw,ignore", [({}, None), ({"ignore_index": -100}, -100), ({"ignore_index": 3}, 3),
                                       ({"reduction": "sum", "ignore_index": 3}, 3)],
                         ids=["mean", "ignore_-100", "ignore_3", "sum_ignore_3"])
def test_cross_entropy_backward_has_no_one_hot_row_sum(kw, ignore):
    """Cross-entropy's backward sums the gather's adjoint (a one-hot times the upstream gradient)
    over the class axis; simplify() makes that sum per-row work (the upstream gradient where the
    target is in range), exactly: the interpreter's gradient matches torch.autograd with targets at
    0, the last class and the ignored index, and the long-row backward that reads the forward's
    statistics is pointwise work alone (no ROW region, the logits read once)."""
    from kbench.capture import capture
    from kbench.runtime.plan import SAVE_STATS_MIN_ROW_BYTES

    class CE(torch.nn.Module):
        def forward(self, x, t):
            return F.cross_entropy(x, t, **kw)

    V = 11
    x = torch.randn(6, V, dtype=torch.float64)
    t = torch.tensor([0, V - 1, 5, 0 if ignore is None else ignore, V - 1, 2])
    cap = capture(CE(), (x, t))
    g = cap.graph
    bwd = g.grad([True, False])
    assert not _one_hot_sums(bwd), str(bwd)
    assert "iota" in str(bwd)     # the one-hot itself stays: dx reads it
    xs = x.clone().requires_grad_(True)
    out = CE()(xs, t)
    up = torch.randn_like(out)
    want, = torch.autograd.grad(out, [xs], up)
    got = torch.empty_like(x)
    run_graph(bwd, cap.example_symvals, [x, t, up], [got])
    assert torch.allclose(got, want, atol=1e-12, rtol=1e-9), (got, want)

    # without saved statistics (they are recomputed): one row kernel still
    part = g.partition()
    assert part.region(0)["saved"] == 0
    rbwd = part.region_graph(0).grad([True, False])
    assert not _one_hot_sums(rbwd), str(rbwd)
    bpart = rbwd.partition()
    assert [bpart.region(r)["kind"] for r in range(len(bpart))] == ["ROW"], str(bpart)

    # as the runtime builds it: the forward region's graph, its statistics saved
    xl = torch.randn(4, 20000)
    cap = capture(CE(), (xl, torch.tensor([0, 19999, 7, 1 if ignore is None else ignore])))
    part = cap.graph.partition()
    part.save_stats(SAVE_STATS_MIN_ROW_BYTES)
    info = part.region(0)
    assert info["kind"] == "ROW" and info["saved"] == 2
    rbwd = part.region_graph(0).grad([True, False], saved=2)
    assert not _one_hot_sums(rbwd), str(rbwd)
    bpart = rbwd.partition()
    regions = [bpart.region(r) for r in range(len(bpart))]
    assert [r["kind"] for r in regions] == ["POINTWISE", "POINTWISE"], str(bpart)
    x_in = rbwd.inputs[0]     # the logits: read by the dx kernel alone, and once
    assert [x_in in r["inputs"] for r in regions] == [False, True], str(bpart)


def _iota(gb, dims, axis):
    return gb._rec(gb.g.add_node("iota", [], "i64", list(dims), axis=axis), dims, "i64")


def test_simplify_one_hot_sum_is_exact_out_of_range():
    """simplify() on a hand-built one-hot row sum: targets below 0, at the row length and far past
    it pick nothing, as the sum did; NaN and inf values pass through; i64 and i32 targets, the row
    length varying (read off an iota) or pinned; near misses (a nonzero default, a target that
    varies along the row) keep their sum."""
    for tdt, pinned in (("i64", False), ("i32", True), ("i64", True)):
        gb = GB(2)
        L = 5 if pinned else (1, (1,))
        full, keep = [S0, L], [S0, 1]
        t_ = gb.input("t", keep, tdt)
        d_ = gb.input("d", keep)
        hot = gb.op("eq", _iota(gb, full, 1), gb.view("expand", t_, full), dtype="bool")
        w = gb.op("where", hot, gb.view("expand", d_, full), gb.const(0.0, full))
        gb.out(gb.reduce("sum", gb.op("neg", w), (1,), True), w)
        simple = gb.g.simplify()
        assert not _one_hot_sums(simple) and _one_hot_sums(gb.g), str(simple)
        for sv in ([6, 4], [6, 7], [5, 1]):
            n = L if pinned else sv[1]
            big = (1 << 40, -(1 << 33)) if tdt == "i64" else (-7, n + 2)
            tv = torch.tensor([[-1], [n], [n - 1], [0], [big[0]], [big[1]]], dtype=TORCH_DTYPES[tdt])[:sv[0]]
            dv = torch.tensor([[2.5], [4.0], [float("nan")], [float("-inf")], [3.0], [-1.25]], dtype=torch.float64)[:sv[0]]
            a, b = run(gb.g, sv, [tv, dv]), run(simple, sv, [tv, dv])
            for p, q in zip(a, b):
                assert torch.equal(p.nan_to_num(7.0), q.nan_to_num(7.0)), (sv, tdt, p, q)

    # near misses: where's other branch is 1; the target varies along the row
    for variant in ("one", "full_t"):
        gb = GB(2)
        full, keep = [S0, (1, (1,))], [S0, 1]
        t_ = gb.input("t", full if variant == "full_t" else keep, "i64")
        d_ = gb.input("d", keep)
        hot = gb.op("eq", _iota(gb, full, 1), t_ if variant == "full_t" else gb.view("expand", t_, full), dtype="bool")
        w = gb.op("where", hot, gb.view("expand", d_, full), gb.const(1.0 if variant == "one" else 0.0, full))
        gb.out(gb.reduce("sum", w, (1,), True))
        assert _one_hot_sums(gb.g.simplify()), variant


def _reduce_depth(g):
    """How deeply reductions along the last axis (the row) nest in g: a sum over a mean's result
    is 2, a pass over the row each; sums over the rows (a weight's gradient) do not count."""
    depth, v = {}, 0
    while True:
        try:
            n = g.node(v)
        except (IndexError, ValueError):
            break
        row = n["op"] in ("sum", "mean", "max", "min") and n["axes"] == 1 << (len(g.node(n["inputs"][0])["dims"]) - 1)
        depth[v] = max((depth[u] for u in n["inputs"]), default=0) + row
        v += 1
    return max(depth[u] for u in g.outputs)


def test_layernorm_backward_sums_wait_for_one_statistic_only():
    """LayerNorm's backward sums -(g * rstd + 2 * k * (x - mean)) with k from the sum before it;
    simplify() splits it into rstd * sum(g) and k * sum(x - mean) (never sum(x) - n * mean), so
    the backward nests reductions two deep, not three, and still matches torch.autograd."""
    from kbench.capture import capture

    class LN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(16, dtype=torch.float64)

        def forward(self, x):
            return self.ln(x)

    torch.manual_seed(0)
    m = LN()
    with torch.no_grad():
        m.ln.weight.normal_(), m.ln.bias.normal_()
    x = torch.randn(5, 16, dtype=torch.float64) * 3 + 100.0   # a large mean: cancellation would show
    cap = capture(m, (x,))
    g = cap.graph
    bwd = g.grad([True] * len(g.inputs))
    assert _reduce_depth(bwd) == 2, str(bwd)
    xid = g.inputs[0]
    assert f"sum %{xid} axes=[1]" not in str(bwd), str(bwd)  # x - mean summed whole, not expanded
    xs = x.clone().requires_grad_(True)
    out = m(xs)
    up = torch.randn_like(out)
    want = torch.autograd.grad(out, [xs, m.ln.weight, m.ln.bias], up)
    names = [g.node(v)["name"] for v in g.inputs]
    vals = {"x": x, "ln.weight": m.ln.weight.detach(), "ln.bias": m.ln.bias.detach()}
    ins = [vals.get(n, None) for n in names[:len(g.inputs)]]
    assert all(t is not None for t in ins), names
    got = run(bwd, [5], ins + [up])
    for w_, g_ in zip(want, got):
        assert rel_err(g_, w_) < 1e-9, (rel_err(g_, w_), w_, g_)


def test_linear_sum_rule_keeps_sums_that_would_not_move():
    """sum(c * X) with c a per-row value that waits on no reduction stays as it is (splitting it
    would only change rounding), and so does sum(y - mean(x)) (no expansion into sum(y) - n *
    mean); sum(x - mean(x)) is 0."""
    gb = GB(1)
    full, keep = [S0, 8], [S0, 1]
    x, y, c = gb.input("x", full), gb.input("y", full), gb.input("c", keep)
    s1 = gb.reduce("sum", gb.op("mul", x, gb.view("expand", c, full)), (1,), True)
    m = gb.reduce("mean", x, (1,), True)
    s2 = gb.reduce("sum", gb.op("sub", y, gb.view("expand", m, full)), (1,), True)
    s3 = gb.reduce("sum", gb.op("sub", x, gb.view("expand", m, full)), (1,), True)
    gb.out(s1, s2, s3)
    simple = gb.g.simplify()
    assert str(simple) == str(gb.g.simplify()) and str(simple).count("sum ") == 2, str(simple)
    assert "mul %" in str(simple) and _reduce_depth(simple) == 2
    last = simple.outputs[2]
    assert simple.node(last)["op"] == "const" and simple.node(last)["dims"] == [S0, 1], str(simple)
    # the same, but the multiplier comes from a sum: split, the sums are one level shallower
    gb = GB(1)
    x, y = gb.input("x", full), gb.input("y", full)
    k = gb.reduce("sum", y, (1,), True)
    t = gb.op("add", gb.op("mul", x, gb.view("expand", k, full)), gb.op("neg", y))
    gb.out(gb.reduce("sum", t, (1,), True))
    simple = gb.g.simplify()
    assert _reduce_depth(gb.g) == 2 and _reduce_depth(simple) == 1, str(simple)
    for sv in ([3], [6]):
        xv, yv = torch.randn(sv[0], 8, dtype=torch.float64), torch.randn(sv[0], 8, dtype=torch.float64)
        a, b = run(gb.g, sv, [xv, yv])[0], run(simple, sv, [xv, yv])[0]
        assert rel_err(b, a) < 1e-12, (a, b)


def test_deviation_from_a_mean_sums_to_zero():
    """simplify(): sum_a(x - mean_a(x)) is 0, also inside a sum of per-row multiples (LayerNorm's
    backward has k * sum(x - mean), a third row reduction as written); not for a mean along
    another axis, of another value, or a sum over another axis."""
    gb = GB(1)
    full, keep = [S0, 8], [S0, 1]
    x, y, c = gb.input("x", full), gb.input("y", full), gb.input("c", keep)
    m = gb.reduce("mean", x, (1,), True)
    xc = gb.op("sub", x, gb.view("expand", m, full))
    k = gb.reduce("sum", y, (1,), True)
    t = gb.op("add", gb.op("mul", y, gb.view("expand", c, full)), gb.op("mul", xc, gb.view("expand", k, full)))
    gb.out(gb.reduce("sum", t, (1,), True))
    gb.out(gb.reduce("sum", xc, (0,), True))     # down the columns: not 0
    m0 = gb.reduce("mean", x, (0,), True)
    gb.out(gb.reduce("sum", gb.op("sub", x, gb.view("expand", m0, full)), (1,), True))  # another axis's mean
    simple = gb.g.simplify()
    rows = [s for s in str(simple).splitlines() if " sum " in s or "= sum" in s]
    # left: sum(y) (c * sum(y), the deviation's term dropped), the column sum, the other axis's mean's sum
    assert len(rows) == 3, str(simple)
    for sv in ([3], [5]):
        xs = [torch.randn(sv[0], 8, dtype=torch.float64) * 3 + 50 for _ in range(2)] + [torch.randn(sv[0], 1, dtype=torch.float64)]
        want, got = run(gb.g, sv, xs), run(simple, sv, xs)
        assert rel_err(got[0], want[0]) < 1e-9 and (got[1] - want[1]).abs().max() < 1e-9
        assert (got[2] - want[2]).abs().max() < 1e-9


def test_saved_mean_is_known_as_one():
    """grad(saved=k) of LayerNorm: the saved mean is an input of the backward, and the sum of
    the deviations from it (the variance's adjoint through the mean) is still known to be 0, so
    the backward sums two things per row, not three, and matches torch."""
    gb = GB()
    x, w, b = gb.input("x", [S0, 8]), gb.input("weight", [8], kind="param"), gb.input("bias", [8], kind="param")
    full, keep = gb.dims[x], [S0, 1]
    mean = gb.reduce("mean", x, (1,), True)
    xc = gb.op("sub", x, gb.view("expand", mean, full))
    var = gb.reduce("mean", gb.op("mul", xc, xc), (1,), True)
    xn = gb.op("mul", xc, gb.view("expand", gb.op("rsqrt", gb.op("add", var, gb.const(1e-5, keep))), full))
    we = gb.view("expand", gb.view("reshape", w, [1, 8]), full)
    be = gb.view("expand", gb.view("reshape", b, [1, 8]), full)
    gb.out(gb.op("add", gb.op("mul", xn, we), be))
    gb.out(mean)
    gb.out(var)
    bwd = gb.g.grad([True, True, True], saved=2)
    row_sums = [v for v in range(bwd.num_nodes)
                if bwd.node(v)["op"] == "sum" and bwd.node(v)["axes"] == 2]
    assert len(row_sums) == 2, str(bwd)
    torch.manual_seed(0)
    x_ = (torch.randn(4, 8, dtype=torch.float64) * 3 + 100).requires_grad_(True)
    w_, b_ = torch.randn(8, dtype=torch.float64, requires_grad=True), torch.randn(8, dtype=torch.float64, requires_grad=True)
    out = F.layer_norm(x_, (8,), w_, b_, 1e-5)
    up = torch.randn_like(out)
    want = torch.autograd.grad(out, [x_, w_, b_], up)
    m_, v_ = x_.mean(1, keepdim=True), x_.var(1, unbiased=False, keepdim=True)
    got = run(bwd, [4], [x_.detach(), w_.detach(), b_.detach(), m_.detach(), v_.detach(), up])
    for g_, w2 in zip(got, want):
        assert rel_err(g_, w2) < 1e-9, (rel_err(g_, w2), g_, w2)


@pytest.mark.parametrize("task,width", [("layer_norm", 4096), ("layer_norm", 16384), ("rms_norm", 4096),
                                        ("softmax", 4096), ("log_softmax", 1000),
                                        ("residual_layer_norm", 512)])
def test_backward_reading_saved_statistics_is_one_row_kernel(task, width):
    """The runtime saves every row region's statistics; the backward that reads them (per-row
    work on them, rstd = rsqrt(var + eps), floats into the row kernel; dbias = sum(dy) over the
    rows, met before any row reduction, becomes a column sum of it) is one ROW region with a
    single reduction pass before the output pass, reading x once: a LayerNorm backward used to
    fall apart into five kernels with full-size f32 intermediates. Gradients through the
    interpreter match torch.autograd."""
    import importlib

    from kbench import _C
    from kbench.capture import capture
    from kbench.runtime.plan import SAVE_STATS_MIN_ROW_BYTES

    mod = importlib.import_module(f"kbench.bench.tasks.{task}")
    model = (mod.Model(width) if task != "softmax" and task != "log_softmax" else mod.Model()).double()
    xs = mod.make_inputs(dict(shape=(6, width)), torch.float64, "cpu", torch.Generator().manual_seed(0))
    part = capture(model, tuple(xs), pin=[(0, 1)]).graph.partition()
    part.save_stats(SAVE_STATS_MIN_ROW_BYTES)
    fwd = part.region(0)
    if task == "log_softmax":   # its backward reads its output instead (eager's saved tensor)
        assert fwd["kind"] == "ROW" and fwd["saved"] == 0 and fwd["saved_outputs"] == [0], fwd
    else:   # a residual LayerNorm's reads the sum x + r it returns, not x and r
        reads = [0] if task == "residual_layer_norm" else []
        assert fwd["kind"] == "ROW" and fwd["saved"] >= 1 and fwd["saved_outputs"] == reads, fwd
    rg = part.region_graph(0)
    bwd = rg.grad([True] * len(fwd["inputs"]), saved=fwd["saved"], outputs=fwd["saved_outputs"])
    bpart = bwd.partition()
    regions = [bpart.region(r) for r in range(len(bpart))]
    assert [r["kind"] for r in regions] == ["ROW"], regions
    if task == "log_softmax":   # dx = dy - exp(y) * sum(dy): y and dy, not x
        assert bwd.inputs[0] not in regions[0]["inputs"] and bwd.inputs[1] in regions[0]["inputs"], str(bpart)
    assert sorted(regions[0]["outputs"]) == sorted(set(bwd.outputs))
    src = _C.generate(bpart, 0, 90, None).source
    assert "pass 2 over the row: write the outputs" in src and "pass 3" not in src, src

    # gradients through the runtime (interpreter backend), statistics saved by the forward
    import kbench

    opt = kbench.optimize(model, tuple(xs), backend="interp", verbose=False)
    assert opt._kbench_plan.regions[0].saved == fwd["saved"]
    assert list(opt._kbench_plan.regions[0].saved_outputs) == fwd["saved_outputs"]
    mine = [x.clone().requires_grad_(True) for x in xs]
    theirs = [x.clone().requires_grad_(True) for x in xs]
    outs, refs = opt(*mine), model(*theirs)
    outs, refs = (outs, refs) if isinstance(outs, tuple) else ((outs,), (refs,))
    ups = [torch.randn_like(r) for r in refs]
    params = list(model.parameters())
    got = torch.autograd.grad(outs, mine + params, ups)
    want = torch.autograd.grad(refs, theirs + params, ups)
    # the generated backward ran (not torch's recomputation), and matches at the precision of the
    # model's own arithmetic: Llama's RMSNorm computes in f32 (x.float()) even for f64 inputs
    assert opt._kbench_plan.regions[0].backward.startswith("interp"), opt._kbench_plan.regions[0].backward
    rtol, atol = (1e-4, 1e-6) if task == "rms_norm" else (1e-6, 1e-9)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
