"""A forward that writes its input in place (x.mul_(2), x.add_(1), x[:, 0] = 0), through
optimize(backend="interp"), behaves as in eager: the output, the input's value after the call, its
version counter, and gradients through both the output and the input used after the call; a leaf
that requires grad raises eager's RuntimeError; an input that needs no gradient is simply updated."""
import pytest
import torch
import torch.nn as nn

import kbench


def _mul(x):
    x.mul_(2)


def _add(x):
    x.add_(1)


def _column(x):
    x[:, 0] = 0


def _twice(x):
    x.mul_(2).add_(1)


WRITES = {"mul_": _mul, "add_": _add, "setitem": _column, "mul_add_": _twice}


class Writes(nn.Module):
    def __init__(self, write):
        super().__init__()
        self.write = write
        self.w = nn.Parameter(torch.linspace(-1, 2, 4))

    def forward(self, x):
        self.write(x)
        return torch.softmax((x * self.w).tanh(), -1)


_OPTIMIZED = {}   # one capture per write, shared by the tests (each starts with no gradients)


def _pair(name):
    eager = Writes(WRITES[name])
    if name not in _OPTIMIZED:
        _OPTIMIZED[name] = kbench.optimize(Writes(WRITES[name]), (torch.randn(3, 4),), backend="interp",
                                           budget="none")
    opt = _OPTIMIZED[name]
    opt.w.grad = None
    return eager, opt


def _train_step(model, a):
    """A non-leaf input written in place, then used after the call: the gradient through the
    input reaches a through the forward's update of it."""
    x = a * 1
    v0 = x._version
    out = model(x)
    g = torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)
    ((out * g).sum() + (x * x.detach().cos()).sum()).backward()
    return out.detach(), x.detach().clone(), x._version - v0


@pytest.mark.parametrize("name", list(WRITES))
def test_non_leaf_input_written_in_place_trains_as_eager(name):
    eager, opt = _pair(name)
    a0 = torch.randn(3, 4)
    got, want = [], []
    for model, into in ((opt, got), (eager, want)):
        a = a0.clone().requires_grad_()
        into.extend(_train_step(model, a))
        into.extend([a.grad, model.w.grad])
    assert not opt._kbench_reasons, opt._kbench_reasons   # kbench's regions ran, not eager
    out, x_after, bumps, da, dw = got
    assert torch.allclose(out, want[0], atol=1e-6)
    assert torch.allclose(x_after, want[1], atol=1e-6)     # the update is written back
    assert bumps == want[2], f"version counter moved {bumps}, eager's {want[2]}"
    assert torch.allclose(da, want[3], atol=1e-5)           # through the update, as eager's autograd
    assert torch.allclose(dw, want[4], atol=1e-5)


@pytest.mark.parametrize("name,message", [("mul_", "^a leaf Variable that requires grad"),
                                          ("setitem", "^a view of a leaf Variable that requires grad")])
def test_leaf_that_requires_grad_raises_as_eager(name, message):
    eager, opt = _pair(name)
    x = torch.randn(3, 4, requires_grad=True)
    before = x.detach().clone()
    with pytest.raises(RuntimeError, match=message):
        eager(x)
    with pytest.raises(RuntimeError, match=message):
        opt(x)
    assert torch.equal(x.detach(), before) and x.grad_fn is None
    with torch.no_grad():   # eager lets a no-grad block write a leaf
        out = opt(x)
        assert torch.allclose(out, eager(before.clone()), atol=1e-6)
    assert torch.allclose(x.detach(), before * 2 if name == "mul_" else before.index_fill(1, torch.tensor([0]), 0))


@pytest.mark.parametrize("name", ["mul_", "mul_add_"])
def test_input_without_grad_is_updated_as_eager(name):
    eager, opt = _pair(name)
    x0 = torch.randn(3, 4)
    x, y = x0.clone(), x0.clone()
    v0 = x._version
    out = opt(x)
    assert torch.allclose(out, eager(y), atol=1e-6)
    assert torch.allclose(x, y) and x._version - v0 == y._version - v0
    assert out.grad_fn is not None and x.grad_fn is None   # the parameter wants gradients; x does not
    out.sum().backward()
    assert opt.w.grad is not None
