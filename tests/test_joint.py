"""A loss's gradients computed in its forward (kbench/runtime/joint.py), on the CPU (interp backend):
the joint graph's partition (the cross-entropy's gradient written by the kernel that reduces the
rows), gradients that match eager for upstream gradients of 1 and not 1, a second backward, a
double backward, ignored targets, parameters accumulating into .grad, unused inputs, and the
cases that keep the per-region backward."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kbench
from kbench.capture import capture


class CE(nn.Module):
    def forward(self, x, t):
        return F.cross_entropy(x, t)


class WeightedMSE(nn.Module):
    def __init__(self, h=5):
        super().__init__()
        self.w = nn.Parameter(torch.rand(h) + 0.5)

    def forward(self, x, y):
        return ((x - y) ** 2 * self.w).mean()


class XOnly(nn.Module):
    """y is an input the loss does not read through a differentiable path."""

    def forward(self, x, y):
        return (x * x).sum() + (y > 0).float().sum()


def _ce_inputs(n=12, v=50, ignore=()):
    x = torch.randn(n, v, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, v, (n,))
    for i in ignore:
        t[i] = -100
    return x, t


def test_joint_graph_writes_the_gradient_in_the_row_kernel():
    x, t = _ce_inputs()
    g = capture(CE(), (x.detach(), t), pin=[(0, 1)]).graph
    joint = g.grad([True, False], joint=True)
    assert len(joint.outputs) == 2          # the loss, then d loss / d x
    part = joint.partition()
    kinds = [part.region(r)["kind"] for r in range(len(part))]
    # the count of valid targets first (the gradient divides by it), then one kernel over the
    # logits' rows writing the per-row losses and the gradient, then the mean
    assert kinds == ["ROW", "ROW", "ROW"], kinds
    big = part.region(1)
    dx = joint.outputs[1]
    assert dx in big["outputs"] and g.inputs[0] in big["inputs"]
    assert all(dx not in part.region(r)["outputs"] for r in (0, 2))
    with pytest.raises(ValueError, match="joint"):
        g.grad([True, False], joint=True, saved=1)


@pytest.mark.parametrize("upstream", [1.0, 0.37])
def test_cross_entropy_gradient_matches_eager(upstream):
    x, t = _ce_inputs(ignore=(3, 7))
    fast = kbench.optimize(CE(), (x.detach(), t), backend="interp")
    loss = fast(x, t)
    assert type(loss.grad_fn).__name__ == "LossFunctionBackward"
    loss.backward(torch.tensor(upstream, dtype=torch.float64))
    xr = x.detach().clone().requires_grad_()
    ref = F.cross_entropy(xr, t)
    ref.backward(torch.tensor(upstream, dtype=torch.float64))
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-9, atol=1e-12)
    assert x.grad[3].abs().max() == 0 and x.grad[7].abs().max() == 0  # ignored targets
    report = str(fast.kbench_report)
    assert "loss gradients in the forward (gradients wanted: x): yes" in report, report
    assert not fast._kbench_reasons


def test_second_and_double_backward_go_through_torch():
    x, t = _ce_inputs(n=6, v=9)
    fast = kbench.optimize(CE(), (x.detach(), t), backend="interp")
    xr = x.detach().clone().requires_grad_()
    loss, ref = fast(x, t), F.cross_entropy(xr, t)
    g1, = torch.autograd.grad(loss, x, retain_graph=True)
    g2, = torch.autograd.grad(loss, x, torch.tensor(2.0, dtype=torch.float64))  # the second backward
    r1, = torch.autograd.grad(ref, xr, retain_graph=True)
    torch.testing.assert_close(g1, r1)
    torch.testing.assert_close(g2, 2 * r1)
    # create_graph: a differentiable gradient (gradcheck's second-order check)
    assert torch.autograd.gradgradcheck(lambda a: fast(a, t), (x,), eps=1e-6, atol=1e-6)
    assert torch.autograd.gradcheck(lambda a: fast(a, t), (x,), eps=1e-6, atol=1e-7)


def test_parameter_gradients_accumulate_and_inputs_without_grad():
    model = WeightedMSE().double()
    x = torch.randn(4, 5, dtype=torch.float64)
    y = torch.randn(4, 5, dtype=torch.float64)
    fast = kbench.optimize(model, (x, y), backend="interp")
    ref = WeightedMSE().double()
    ref.load_state_dict(model.state_dict())
    for step in range(2):   # .grad accumulates over two backward passes, x needs no gradient
        fast(x, y).backward()
        ref(x, y).backward()
    torch.testing.assert_close(model.w.grad, ref.w.grad)
    xs = x.clone().requires_grad_()
    fast(xs, y).backward()               # another need pattern: x and w
    xr = x.clone().requires_grad_()
    ref(xr, y).backward()
    torch.testing.assert_close(xs.grad, xr.grad)
    torch.testing.assert_close(model.w.grad, ref.w.grad)
    wanted = set(fast._kbench_loss)
    assert {"w", "x, w"} <= wanted, wanted
    with torch.no_grad():                # no gradient wanted: the plain forward
        torch.testing.assert_close(fast(x, y), ref(x, y))


def test_unused_input_gets_no_gradient():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    fast = kbench.optimize(XOnly(), (x.detach(), y.detach()), backend="interp")
    fast(x, y).backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())
    assert y.grad is None


def test_per_region_backward_where_the_mode_does_not_apply():
    x, t = _ce_inputs(n=5, v=7)
    off = kbench.optimize(CE(), (x.detach(), t), backend="interp", grad_in_forward=False)
    loss = off(x, t)
    assert type(loss.grad_fn).__name__ != "LossFunctionBackward"
    loss.backward()
    xr = x.detach().clone().requires_grad_()
    F.cross_entropy(xr, t).backward()
    torch.testing.assert_close(x.grad, xr.grad)
    # a per-sample loss is not a scalar: each region keeps its own backward
    per_sample = kbench.optimize(nn.CrossEntropyLoss(reduction="none"), (x.detach(), t), backend="interp")
    out = per_sample(x, t)
    assert type(out.grad_fn).__name__ != "LossFunctionBackward"
    assert per_sample._kbench_loss_why == "the output is not a scalar"
