"""Gradient checks away from the points where an op's derivative jumps (torch_eval.away_from_kinks).
There the derivative is a convention: hardswish at +-3 is 1 and 0 in torch (and ops.def),
x/3 + 1/2 (1.5 and -0.5) in code that takes the closed [-3, 3]; and a value within rounding of a
kink lands on different sides in a float32 kernel and a float64 reference. A bf16 value lands
exactly on 3.0 about once in 14,000 draws, so the check of a large bf16 hardswish region could
fail a correct backward (MobileNetV3 on a GPU, issue 29). Here the closed convention stands in the
float64 reference, on the CPU (interp backend)."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kbench
from kbench.runtime import torch_eval


class ClosedHardswish(torch.autograd.Function):
    """hardswish with the derivative x/3 + 1/2 on the closed [-3, 3] (1.5 at 3, -0.5 at -3)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.hardswish(x)

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return g * torch.where(x < -3, 0.0, torch.where(x <= 3, x / 3 + 0.5, 1.0)).to(g.dtype)


class Block(nn.Module):
    """MobileNetV3's activations on bf16 activations: hardswish alone, a bias add then hardswish
    (its bias gradient sums over the hardswish's kinks), squeeze-excite's x * hardsigmoid(s)."""

    def __init__(self, c=16):
        super().__init__()
        self.b = nn.Parameter(torch.randn(c, 1, 1))

    def forward(self, x, s):
        y = F.hardswish(x) + 1
        y = F.hardswish(y + self.b.to(y.dtype))
        return y * F.hardsigmoid(F.relu(s))


def optimize_block():
    torch.manual_seed(0)
    # 16 x 48 x 48 bf16 values: ~5 of them exactly +-3 per draw
    x = torch.randn(1, 16, 48, 48).to(torch.bfloat16)
    s = torch.randn(1, 16, 1, 1).to(torch.bfloat16)
    model = Block().to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = kbench.optimize(model, (x, s), backend="interp", verbose=False)
    xg, sg = x.clone().requires_grad_(), s.clone().requires_grad_()
    opt(xg, sg).float().square().mean().backward()
    return opt


def backward_notes(opt):
    return {r: info.backward for r, info in enumerate(opt._kbench_plan.regions) if info.backward}


def test_backward_check_passes_with_another_convention_at_the_kinks(monkeypatch):
    monkeypatch.setitem(torch_eval._UNARY, "hardswish", ClosedHardswish.apply)
    notes = backward_notes(optimize_block())
    assert notes and all("gradients match torch.autograd" in n for n in notes.values()), notes


def test_backward_check_still_fails_a_wrong_gradient(monkeypatch):
    """Off the kinks nothing is excused: a reference 10% off inside (-3, 3) fails the check."""
    class Off(ClosedHardswish):
        @staticmethod
        def backward(ctx, g):
            x, = ctx.saved_tensors
            return g * torch.where(x <= -3, 0.0, torch.where(x < 3, 1.1 * (x / 3 + 0.5), 1.0)).to(g.dtype)

    monkeypatch.setitem(torch_eval._UNARY, "hardswish", Off.apply)
    notes = backward_notes(optimize_block())
    assert any("gradient check failed" in n for n in notes.values()), notes


def kink_masks(module, x):
    """kink_inputs of the module's one compute region at x (float64, CPU): None is no kink."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = kbench.optimize(module, (x,), backend="interp", verbose=False)
    plan = opt._kbench_plan
    (r,) = [r for r, i in enumerate(plan.regions) if i.kind != "EXTERN"]
    mask = torch_eval.kink_inputs(
        lambda xs, kinks: plan.eager_region(r, plan.example_symvals, xs, dtype=torch.float64, kinks=kinks), [x])[0]
    return torch.zeros_like(x, dtype=torch.bool) if mask is None else mask


class Lambda(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x):
        return self.f(x)


@pytest.mark.parametrize("f,values,want", [
    (F.hardswish, [3.0, -3.0, 2.984375, 0.5, -3.015625, 1.0], [1, 1, 0, 0, 0, 0]),
    (F.relu, [0.0, 1e-3, -1e-3, 2.0, 0.0, -2.0], [1, 0, 0, 0, 1, 0]),
    # hardsigmoid lowers to selects: its kinks are its comparisons' switches
    (F.hardsigmoid, [3.0, -3.0, 2.5, 0.0, 2.984375, 5.0], [1, 1, 0, 0, 0, 0]),
    # a row's maximum tied (the gradient's split is a convention too); a structural tie
    # (max(x, x)) is not one that moving x can break
    (lambda x: x.amax(-1, keepdim=True) * torch.maximum(x, x), [2.0, 2.0, 1.0, 0.5, 2.5, -1.0],
     [1, 1, 0, 0, 0, 0]),
    # an infinite bound is never reached: no kink, nothing drawn again
    (lambda x: torch.maximum(x, torch.full_like(x, float("-inf"))), [2.0, 2.0, 0.0, -1.0, 3.0, -3.0],
     [0, 0, 0, 0, 0, 0]),
], ids=["hardswish", "relu", "hardsigmoid", "max", "infinite"])
def test_kink_inputs_finds_the_values_on_a_kink(f, values, want):
    x = torch.tensor(values, dtype=torch.float32).reshape(2, 3)
    mask = kink_masks(Lambda(f), x)
    assert mask.flatten().tolist() == [bool(w) for w in want]


def test_away_from_kinks_redraws_only_those():
    x = torch.tensor([[3.0, -3.0, 1.0], [0.5, 3.0, -2.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = kbench.optimize(Lambda(F.hardswish), (x,), backend="interp", verbose=False)
    plan = opt._kbench_plan
    (r,) = [r for r, i in enumerate(plan.regions) if i.kind != "EXTERN"]
    (y,) = torch_eval.away_from_kinks(
        lambda xs, kinks: plan.eager_region(r, plan.example_symvals, xs, dtype=torch.float64, kinks=kinks), [x],
        lambda i, t: torch.full_like(t, 0.25))
    assert y.tolist() == [[0.25, 0.25, 1.0], [0.5, 0.25, -2.0]]


class HardswishLoss(nn.Module):
    def forward(self, x):
        return F.hardswish(x).float().square().mean()


def test_joint_loss_check_passes_with_another_convention_at_the_kinks(monkeypatch):
    """A loss's gradients in its forward (runtime/joint.py) are checked the same way."""
    monkeypatch.setitem(torch_eval._UNARY, "hardswish", ClosedHardswish.apply)
    torch.manual_seed(0)
    x = torch.randn(16, 4096).to(torch.bfloat16)    # ~9 values exactly +-3 per draw
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = kbench.optimize(HardswishLoss(), (x,), backend="interp", verbose=False)
    xg = x.clone().requires_grad_()
    opt(xg).backward()
    report = str(opt.kbench_report)
    assert "loss gradients in the forward (gradients wanted: x): yes" in report, report
