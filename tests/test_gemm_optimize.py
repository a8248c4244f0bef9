"""optimize(..., gemm=True) on the CPU (interp backend): matrix products lowered to MATMUL, run as
GEMM regions in the C interpreter, forward and backward, against eager (f32 and bf16 autocast) —
a small MLP, a tiny attention block and the zoo's tiny GPT-2; with gemm off nothing changes (the
capture keeps its products as torch calls, and its cache key is its own)."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import kbench
from _float64 import assert_grads_as_exact_as_eager, rel
from kbench.capture import capture
from kbench.capture.cache import fingerprint
from models.zoo import BY_NAME

F32_TOL, BF16_TOL = 1e-4, 2e-2



class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8, bias=False)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.fc2(F.gelu(self.fc1(x))) + x)


class Attention(torch.nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.scale = dim ** -0.5

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = torch.bmm(q, k.transpose(1, 2)) * self.scale
        return torch.bmm(scores.softmax(-1), v)


def _optimize(model, args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kbench.optimize(model, args, backend="interp", verbose=False, strict=True, budget="none", **kw)


def _kinds(opt):
    return [r.kind for r in opt._kbench_plan.regions]


def _check(model, x, autocast, tol):
    twin, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        opt = _optimize(model, (x,), gemm=True)
        assert "GEMM" in _kinds(opt) and "EXTERN" not in _kinds(opt), opt.kbench_report
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = opt(xa), twin(xb)
        g = torch.randn_like(want)
    assert got.dtype == want.dtype and rel(got, want) <= tol
    got.backward(g)
    want.backward(g)
    xr = x.double().requires_grad_()
    exact(xr).backward(g.double())
    # (a gradient zero in exact arithmetic, a key's bias under softmax, is rounding noise in eager too)
    assert_grads_as_exact_as_eager([(xa.grad, xb.grad, xr.grad)], model, twin, exact, tol)
    return opt


@pytest.mark.parametrize("autocast,tol", [(False, F32_TOL), (True, BF16_TOL)], ids=["f32", "bf16"])
def test_mlp(autocast, tol):
    torch.manual_seed(0)
    opt = _check(MLP(), torch.randn(2, 3, 8), autocast, tol)
    kinds = _kinds(opt)
    assert kinds.count("GEMM") == 2 and "ROW" in kinds, kinds   # the LayerNorm stays a row region


@pytest.mark.parametrize("autocast,tol", [(False, F32_TOL), (True, BF16_TOL)], ids=["f32", "bf16"])
def test_attention(autocast, tol):
    torch.manual_seed(1)
    opt = _check(Attention(), torch.randn(2, 5, 8), autocast, tol)
    assert _kinds(opt).count("GEMM") == 5, _kinds(opt)


@pytest.mark.parametrize("autocast,tol", [(False, F32_TOL), (True, BF16_TOL)], ids=["f32", "bf16"])
def test_tiny_gpt2(autocast, tol):
    entry = BY_NAME["gpt2"]
    torch.manual_seed(0)
    model = entry.make("tiny")
    twin = copy.deepcopy(model)
    args, kwargs = entry.call("tiny", torch.Generator().manual_seed(1), "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = kbench.optimize(model, args, kwargs, backend="interp", verbose=False, strict=True,
                                  budget="none", gemm=True)
        assert "GEMM" in _kinds(opt), opt.kbench_report
        out, want = opt(*args, **kwargs), twin(*args, **kwargs)
        loss, want_loss = entry.loss(out, args, kwargs), entry.loss(want, args, kwargs)
    assert rel(entry.output(out), entry.output(want)) <= tol
    loss.backward()
    want_loss.backward()
    grads = dict(twin.named_parameters())
    scale = max(float(q.grad.abs().max()) for q in grads.values() if q.grad is not None)
    for n, p in model.named_parameters():
        if grads[n].grad is not None:
            assert rel(p.grad, grads[n].grad, floor=1e-3 * scale) <= tol, n


def test_gemm_off_changes_nothing():
    """Without gemm the products stay torch calls (no matmul node), the graph is the one the
    capture made before the option existed, and the capture cache keeps the two apart."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 3, 8)
    off, on = capture(model, (x,)), capture(model, (x,), gemm=True)
    ops_off = {off.graph.node(i)["op"] for i in range(off.graph.num_nodes)}
    ops_on = {on.graph.node(i)["op"] for i in range(on.graph.num_nodes)}
    assert "matmul" not in ops_off and "extern" in ops_off
    assert "matmul" in ops_on and "extern" not in ops_on
    assert str(capture(model, (x,), gemm=False).graph) == str(off.graph)
    assert fingerprint(model, (x,), "interp") != fingerprint(model, (x,), "interp", gemm=True)
    opt = _optimize(model, (x,))
    assert "GEMM" not in _kinds(opt) and "EXTERN" in _kinds(opt)


def test_f32_gemm_regions_stay_in_torch_with_a_reason():
    """An f32 product (cuBLAS keeps it): the region has a default genome with the GEMM genes, but
    codegen refuses it with its reason (never an assert), the search has no genes for it (a GEMM
    region runs its default genome), and a GEMM region left to torch is not demoted into torch
    calls (it is no loss to eager)."""
    from kbench import _C
    from kbench.api import lost_nodes
    from kbench.runtime.plan import Status
    model, x = MLP(), torch.randn(2, 3, 8)
    part = capture(model, (x,), gemm=True).graph.partition()
    r = next(i for i in range(len(part)) if part.region(i)["kind"] == "GEMM")
    assert "gemm=" in str(_C.genome_default(part, r, [2, 3]))
    with pytest.raises(NotImplementedError, match="bf16 or f16"):
        _C.generate(part, r, 90, None)
    with pytest.raises(Exception, match="GEMM region"):
        _C.evolve_new(part, r, [2, 3], None, 7, 8)
    opt = _optimize(model, (x,), gemm=True)
    info = next(i for i in opt._kbench_plan.regions if i.kind == "GEMM")
    info.set_status(Status.EAGER, "no kernel: f32")
    assert lost_nodes(opt._kbench_plan, {}) == {}


class Products(torch.nn.Module):
    """Every product the capture lowers besides linear and bmm: addmm (alpha, beta), mm, a 3-D by
    2-D matmul and baddbmm of a transposed operand."""

    def __init__(self):
        super().__init__()
        self.w, self.b, self.c = (torch.nn.Parameter(torch.randn(*s)) for s in ((8, 6), (6,), (6, 5)))

    def forward(self, x, y):
        a = torch.addmm(self.b, x.reshape(-1, 8), self.w, beta=0.5, alpha=2.0)
        t = torch.matmul(x * 0.5, self.w)
        return torch.mm(a, self.c).sum() + torch.baddbmm(y, t, t.transpose(1, 2)).tanh().sum()


def test_every_product_lowers_and_matches_eager():
    torch.manual_seed(3)
    model = Products()
    twin = copy.deepcopy(model)
    x, y = torch.randn(2, 3, 8), torch.randn(2, 3, 3)
    opt = _optimize(model, (x, y), gemm=True)
    graph = opt._kbench_plan.graph
    assert [graph.node(i)["op"] for i in range(graph.num_nodes)].count("matmul") == 4
    assert "EXTERN" not in _kinds(opt)
    got, want = opt(x, y), twin(x, y)
    assert rel(got, want) <= F32_TOL
    got.backward()
    want.backward()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert rel(p.grad, q.grad) <= F32_TOL, n


def test_tolerance_grows_with_the_reduction_length():
    """A GEMM region is checked at TOLERANCE * sqrt(K / 256) past K = 256 (verify.gemm_scale),
    its gradients at the longest of M, N and K; a region without a product as before."""
    from kbench import verify
    assert verify.gemm_scale(0) == verify.gemm_scale(256) == 1.0 and verify.gemm_scale(4096) == 4.0
    ref = torch.ones(4, dtype=torch.float64)
    off = ref.float() * (1 + 3 * verify.TOLERANCE[torch.float32])
    assert not verify.compare(off, ref)[0] and verify.compare(off, ref, reduction=4096)[0]
    model, x = MLP(), torch.randn(2, 3, 8)
    plan = _optimize(model, (x,), gemm=True)._kbench_plan
    gemm, row = (next(r.index for r in plan.regions if r.kind == k) for k in ("GEMM", "ROW"))
    assert plan.reduction(gemm, [5, 7]) == 8                       # fc1: K = 8
    assert plan.reduction(gemm, [5, 7], backward=True) == 35       # M = 5 * 7 rows
    assert plan.reduction(row, [5, 7]) == 0


def test_an_integer_product_stays_torchs_call():
    """MATMUL is for float operands: with gemm on, an integer mm is torch's own call, as eager's."""
    class IntMM(torch.nn.Module):
        def forward(self, a, b):
            return torch.mm(a, b) + 1

    a, b = torch.randint(-5, 5, (3, 4)), torch.randint(-5, 5, (4, 2))
    opt = _optimize(IntMM(), (a, b), gemm=True)
    assert "GEMM" not in _kinds(opt) and "EXTERN" in _kinds(opt), opt.kbench_report
    assert torch.equal(opt(a, b), IntMM()(a, b))
