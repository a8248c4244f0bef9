"""GEMM regions run kbench's generated tensor-core GEMM (csrc/codegen/gemm_region.c) on the cuda
backend: optimize(gemm=True, budget="none") on bf16 MLP and attention blocks gives every forward
GEMM region and every backward one whose operands are bf16 as stored a verified kernel; outputs and gradients are no worse than twice
eager's own error against float64; a call whose K breaks the kernel's multiple of 8 runs that
region in torch with the reason."""
import copy

import pytest
import torch
import torch.nn.functional as F

import kbench
from _float64 import assert_grads_as_exact_as_eager, rel

pytestmark = pytest.mark.gpu

TOL = 1e-2   # below this, eager's own bf16 error decides (twice it)


class MLP(torch.nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x))) + x


class Attention(torch.nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.scale = dim ** -0.5

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        return torch.bmm((torch.bmm(q, k.transpose(1, 2)) * self.scale).softmax(-1), v)



def _optimize(model, x):
    return kbench.optimize(model, (x,), backend="cuda", budget="none", verbose=False, strict=True, gemm=True,
                           cuda_graphs=False)


def _check(model, x, ngemm, every_back):
    """The GEMM regions run kernels, and the backward's: all of them (every_back), or all but those
    that read an f32 gradient through a cast (the attention score's: a prologue the kernel does not
    take, torch with that reason); output and gradients against float64."""
    twin, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    opt = _optimize(model, x)
    gemms = [r for r in opt._kbench_plan.regions if r.kind == "GEMM"]
    assert len(gemms) == ngemm and all(r.status.kernel for r in gemms), opt.kbench_report
    assert all("gemm=" in r.genome for r in gemms), [r.genome for r in gemms]
    xa, xb, xr = x.clone().requires_grad_(), x.clone().requires_grad_(), x.double().requires_grad_()
    got, want, ref = opt(xa), twin(xb), exact(xr)
    assert not opt._kbench_reasons, opt._kbench_reasons   # every kernel ran
    assert rel(got, ref) <= max(TOL, 2 * rel(want, ref)), (rel(got, ref), rel(want, ref))
    g = torch.randn_like(want)
    got.backward(g)
    want.backward(g)
    ref.backward(g.double())
    progs = [p for p in opt._kbench_backward.values() if p is not None]
    back = [i for p in progs for i in p.plan.regions if i.kind == "GEMM"]
    ran = [i for i in back if i.status.kernel]
    assert ran and (len(ran) == len(back) or not every_back), [(i.index, i.status_text) for i in back]
    assert all("prologue work (cast)" in i.reason for i in back if not i.status.kernel), [i.reason for i in back]
    assert_grads_as_exact_as_eager([(xa.grad, xb.grad, xr.grad)], model, twin, exact, TOL)
    return opt


def test_mlp_gemm_regions_run_generated_kernels():
    torch.manual_seed(0)
    _check(MLP().cuda().to(torch.bfloat16), torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16), 2, True)


def test_attention_gemm_regions_run_generated_kernels():
    torch.manual_seed(1)
    _check(Attention().cuda().to(torch.bfloat16), torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16), 5, False)


def test_k_not_a_multiple_of_8_runs_that_region_in_torch():
    """Attention at 7 keys: P @ V's K is 7, which its kernel cannot load (16-byte chunks): that
    region runs in torch for the call with the launchers' reason, the others keep their kernels,
    and the output matches eager."""
    torch.manual_seed(2)
    model = Attention().cuda().to(torch.bfloat16)
    opt = _optimize(model, torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16))
    gemms = [r for r in opt._kbench_plan.regions if r.kind == "GEMM"]
    assert all(r.status.kernel for r in gemms), opt.kbench_report
    pv = gemms[-1].index
    x = torch.randn(4, 7, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got, want, ref = opt(x), model(x), copy.deepcopy(model).double()(x.double())
    why = f"region {pv}: last dim 7 is not a multiple of 8 (kernel uses vec=8)"
    assert why in opt._kbench_reasons, opt._kbench_reasons
    assert not any(f"region {r.index}:" in w for r in gemms[:-1] for w in opt._kbench_reasons), opt._kbench_reasons
    assert rel(got, ref) <= max(TOL, 2 * rel(want, ref))
