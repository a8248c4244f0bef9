"""optimize(..., gemm=True) on the cuda backend where the generated GEMM kernel cannot take a GEMM
region: f32 products (cuBLAS keeps them) and autocast's weight casts (a prologue the kernel does not
apply on load) run in torch with their reason (never a crash, never demoted into torch calls); under
autocast the attention score, whose operands are bf16 as stored, runs the generated kernel; the
pointwise and row regions around them still run generated kernels, and outputs and gradients match
eager in f32 and under bf16 autocast."""
import copy

import pytest
import torch
import torch.nn.functional as F

import kbench
from _float64 import assert_grads_as_exact_as_eager, rel
from kbench.runtime.plan import Status

pytestmark = pytest.mark.gpu


class Block(torch.nn.Module):
    """Linear-GELU-Linear, a residual add, a LayerNorm; then a bmm attention score."""

    def __init__(self, dim=64):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x):
        h = self.norm(self.fc2(F.gelu(self.fc1(x))) + x)
        # scores scaled as attention scales them: unscaled, the softmax saturates and every
        # gradient is bf16 rounding noise (eager's own is 12% off float64 there)
        return (torch.bmm(h, h.transpose(1, 2)) * 0.125).softmax(-1)



@pytest.mark.parametrize("autocast,tol", [(False, 1e-4), (True, 3e-2)], ids=["f32", "bf16"])
def test_gemm_regions_the_kernel_cannot_take_run_in_torch(autocast, tol):
    torch.manual_seed(0)
    model = Block().cuda()
    twin, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    x = torch.randn(4, 32, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        opt = kbench.optimize(model, (x,), backend="cuda", budget="none", verbose=False, strict=True,
                              gemm=True, cuda_graphs=False)
        regions = opt._kbench_plan.regions
        gemms = [r for r in regions if r.kind == "GEMM"]
        assert len(gemms) == 3, opt.kbench_report
        linears, score = gemms[:2], gemms[2]
        for r in linears if autocast else gemms:
            assert r.status is Status.EAGER, opt.kbench_report
            assert ("prologue" if autocast else "bf16 or f16") in r.reason, r.reason
        if autocast:
            assert score.status.kernel, opt.kbench_report
        assert "EXTERN" not in [r.kind for r in regions], opt.kbench_report   # nothing demoted
        assert any(r.status.kernel for r in regions if r.kind == "ROW"), opt.kbench_report
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = opt(xa), twin(xb)
        g = torch.randn_like(want)
    assert got.dtype == want.dtype and rel(got, want) <= tol
    got.backward(g)
    want.backward(g)
    xr = x.double().requires_grad_()
    exact(xr).backward(g.double())
    assert_grads_as_exact_as_eager([(xa.grad, xb.grad, xr.grad)], model, twin, exact, tol)
