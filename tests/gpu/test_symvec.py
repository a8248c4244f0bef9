"""Vectors along a varying last dim on the GPU (tests/test_symvec.py has the CPU side): optimize()
of a softmax or LayerNorm over a row of two varying dims, `x / x.norm()` (one row, split) and a
column sum, at an example whose last dim is a multiple of 4, runs a vec=4 kernel that records the
requirement; a call at another multiple runs that kernel and matches eager; a call whose last dim
is odd runs the region in eager for that call, with the same one-line reason from the C++ launch
(kbench._fast) and the Python one, and matches eager too, forward and backward."""
import os

import pytest
import torch
import torch.nn.functional as F

import kbench
from kbench import verify
from kbench.runtime import fast as fastmod
from kbench.runtime.plan import KERNEL

pytestmark = pytest.mark.gpu


class SoftmaxFlat(torch.nn.Module):      # a row of s1 * s2 (not pinned: a product of varying dims)
    def forward(self, x):
        return torch.softmax(x.flatten(1), dim=-1)


class LayerNormFlat(torch.nn.Module):
    def forward(self, x):
        y = x.flatten(1)
        return F.layer_norm(y, y.shape[-1:])


class FrobeniusNorm(torch.nn.Module):    # KernelBench's 37_FrobeniusNorm_
    def forward(self, x):
        return x / torch.norm(x, p="fro")


class SumDim1(torch.nn.Module):          # a COL region along the last dim
    def forward(self, x):
        return x.sum(dim=1)


# model, example, another shape whose last dim is a multiple of 4, one whose last dim is odd and
# what that last dim is (the anchor's: a flattened row is s1 * s2)
CASES = [(SoftmaxFlat, (8, 16, 64), (5, 12, 36), (5, 9, 35), 9 * 35),
         (LayerNormFlat, (8, 16, 64), (5, 12, 36), (5, 9, 35), 9 * 35),
         (FrobeniusNorm, (4, 8, 32, 256), (2, 8, 32, 128), (2, 8, 32, 127), 127),
         (SumDim1, (16, 256, 64), (9, 100, 36), (9, 100, 33), 33)]
IDS = [c[0].__name__ for c in CASES]


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("path", ["fast", "python"])
@pytest.mark.parametrize("model,shape,other,odd,odd_last", CASES, ids=IDS)
def test_vectors_over_a_varying_last_dim(monkeypatch, model, shape, other, odd, odd_last, path):
    if path == "python":
        monkeypatch.setattr(fastmod, "module", lambda: None)
    elif fastmod.module() is None and os.environ.get("KBENCH_FAST", "1") != "0":
        pytest.fail("kbench._fast is not built", pytrace=False)
    torch.manual_seed(0)
    m = model().cuda()
    opt = kbench.optimize(m, (torch.randn(*shape, device="cuda"),), budget="none", verbose=False, gate=False,
                          cuda_graphs=False)
    plan, ex = opt._kbench_plan, opt._kbench_executor
    (r,) = [i.index for i in plan.regions if i.kind != "EXTERN"]
    assert plan.regions[r].status.kernel, opt.kbench_report
    kernel = ex.kernels[r]
    assert kernel.vec == 4 and kernel.last_multiple == 4 and not isinstance(kernel.last_dim, int)
    assert "vec=4" in plan.regions[r].genome
    for size in (shape, other, odd):
        for call in range(2):   # the first binds the sizes, the second is served (C++ on the fast path)
            x = torch.randn(*size, device="cuda", requires_grad=True)
            g = torch.randn_like(m(x))
            got = opt(x)
            want = m(x)
            assert rel_err(got, want) <= 1e-4, (size, call)
            (dx,), (dxe,) = torch.autograd.grad(got, [x], g), torch.autograd.grad(want, [x], g)
            assert rel_err(dx, dxe) <= 1e-4, (size, call)
            with torch.no_grad():
                assert rel_err(opt(x), want) <= 1e-4, (size, call)
        if size is not odd:
            assert not opt._kbench_reasons, opt._kbench_reasons   # the kernel ran
    # the odd size: the forward's region in eager, for the reason both launchers give
    why = f"region {r}: last dim {odd_last} is not a multiple of 4 (kernel uses vec=4)"
    assert why in opt._kbench_reasons, opt._kbench_reasons
    refusing = [bd.symvals for bd in opt._kbench_sigs.values() if verify.refused(kernel, r, bd.symvals)]
    assert refusing and all(verify.refused(kernel, r, sv) == why for sv in refusing)
    # the launches were kbench._fast's on the fast path, Python closures on the other
    launches = [fastmod.launch_of(s.launch) for bd in opt._kbench_sigs.values() for s in bd.steps
                if s.kind == KERNEL and s.r == r]
    assert launches and all((x is not None) == (path == "fast") for x in launches)
