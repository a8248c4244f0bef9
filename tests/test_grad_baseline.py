"""A 16-bit gradient check that fails the fixed tolerance passes where the kernel's error is no more
than verify.BASELINE_FACTOR times that of torch's own ops on the same inputs, in the same dtypes
(the backward reads what its forward saved, rounded to 16 bits); a gradient worse than that
still fails."""
import warnings

import torch
import torch.nn as nn

import kbench
from kbench import verify


def test_compare_takes_torchs_own_error_as_a_floor():
    ref = torch.linspace(-1, 1, 64, dtype=torch.float64)
    ours = (ref + 0.03).to(torch.bfloat16)            # 3% of the norm: past bf16's 2%
    assert not verify.compare(ours, ref)[0]
    near = (ref - 0.02).to(torch.bfloat16)            # torch's own is 2% off: 2x that admits 3%
    assert verify.compare(ours, ref, baseline=near)[0]
    close = (ref - 0.01).to(torch.bfloat16)           # torch's own is 1% off: 3% is too much
    ok, _, why = verify.compare(ours, ref, baseline=close)
    assert not ok and "exceeds 0.02" in why
    # a gradient check passes each gradient its own baseline
    why, _ = verify.compare_grads([ours, ours], [ref, ref], [8], baseline=[near, close])
    assert why.startswith("gradient of input 1")


class MaskedSoftmax(nn.Module):
    def forward(self, x, m):
        return torch.softmax(x + m, -1) * 2


def notes_with_tolerance(monkeypatch, tol, factor):
    """The backward check of a bf16 masked softmax (interp backend) with the float tolerances set to
    tol and verify.BASELINE_FACTOR to factor."""
    for dt in (torch.bfloat16, torch.float32):
        monkeypatch.setitem(verify.TOLERANCE, dt, tol)
    monkeypatch.setattr(verify, "BASELINE_FACTOR", factor)
    torch.manual_seed(0)
    x = torch.randn(8, 4, 7, 8).to(torch.bfloat16)
    m = torch.zeros(8, 1, 1, 8, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = kbench.optimize(MaskedSoftmax(), (x, m), backend="interp", verbose=False)
    opt(x.clone().requires_grad_(), m).float().square().mean().backward()
    return [i.backward for i in opt._kbench_plan.regions if i.backward]


def test_backward_as_exact_as_torchs_own_passes(monkeypatch):
    # a tolerance nothing 16-bit meets: the check passes on the baseline alone
    notes = notes_with_tolerance(monkeypatch, 1e-7, 2.0)
    assert notes and all("gradients match torch.autograd" in n for n in notes), notes
    notes = notes_with_tolerance(monkeypatch, 1e-7, 0.0)
    assert any("gradient check failed" in n for n in notes), notes
