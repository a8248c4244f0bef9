"""kbench._fast (csrc/fast/): a region's launch and its autograd node in C++. The node's
backward runs the generated backward kernels from C++ once Python has built and checked them;
it must give the Python path's exact bits and behave as a torch node does (retain_graph, a
second backward, create_graph, inputs without gradients, in-place changes to saved inputs,
upstream gradients that are misaligned or not contiguous, a model dropped before backward)."""
import gc
import weakref

import pytest
import torch

import kbench
from kbench import cuda_backend, runtime

pytestmark = pytest.mark.gpu

needs_fast = pytest.mark.skipif(cuda_backend._fast is None, reason="kbench._fast was not built")


def layer_norm(n=1024):
    torch.manual_seed(0)
    model = torch.nn.LayerNorm(n).cuda()
    with torch.no_grad():
        model.weight.uniform_(0.5, 1.5)
        model.bias.uniform_(-0.5, 0.5)
    return model


def grads(m, x, g, **kw):
    return torch.autograd.grad(m(x), [x, *m.parameters()], g, **kw)


def assert_close(got, want, tol=1e-4):
    for h, w in zip(got, want):
        assert ((h - w).abs().max() / w.abs().max()).item() <= tol


@needs_fast
def test_backward_runs_from_cpp_after_the_first(monkeypatch):
    model = layer_norm()
    fast = kbench.optimize(model, (torch.randn(256, 1024, device="cuda"),), budget="none", verbose=False)
    calls = []
    orig = runtime.OptimizedModule._fast_backward

    def counted(self, *a):
        calls.append(1)
        return orig(self, *a)
    monkeypatch.setattr(runtime.OptimizedModule, "_fast_backward", counted)
    for i in range(4):
        x = torch.randn(256, 1024, device="cuda", requires_grad=True)
        g = torch.randn(256, 1024, device="cuda")
        out = fast(x)
        assert out.grad_fn.name() == "KbenchRegionBackward"
        assert_close(torch.autograd.grad(out, [x, *fast.parameters()], g), grads(model, x, g))
    assert len(calls) == 1   # the first builds, checks and hands over the program; the rest are C++
    (bound,) = fast._kbench_sigs.values()
    assert [s.fast.backward_patterns() for s in bound.steps if s.fast is not None] == [1]


@needs_fast
def test_same_bits_as_the_python_path(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.LayerNorm(512), torch.nn.GELU()).cuda()
    example = (torch.randn(128, 512, device="cuda"),)
    x = torch.randn(128, 512, device="cuda", requires_grad=True)
    g = torch.randn(128, 512, device="cuda")
    fast = kbench.optimize(model, example, budget="none", verbose=False)
    grads(fast, x, g)   # launches are bound at the first call of a size: before the patch
    monkeypatch.setattr(cuda_backend, "_fast", None)
    slow = kbench.optimize(model, example, budget="none", verbose=False)
    for _ in range(2):   # the second: the C++ program
        a, b = fast(x), slow(x)
        assert torch.equal(a, b)
        for h, w in zip(grads(fast, x, g), grads(slow, x, g)):
            assert torch.equal(h, w)
    assert any(s.fast is not None for bd in fast._kbench_sigs.values() for s in bd.steps)
    assert all(s.fast is None for bd in slow._kbench_sigs.values() for s in bd.steps)


def test_node_semantics_as_torch():
    model = layer_norm()
    fast = kbench.optimize(model, (torch.randn(64, 1024, device="cuda"),), budget="none", verbose=False)
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    g = torch.randn(64, 1024, device="cuda")
    want = grads(model, x, g)
    for _ in range(2):   # warm: the C++ program is registered after the first
        out = fast(x)
        first = torch.autograd.grad(out, [x, *fast.parameters()], g, retain_graph=True)
        second = torch.autograd.grad(out, [x, *fast.parameters()], g)   # retain_graph: same bits
        assert_close(first, want)
        for a, b in zip(first, second):
            assert torch.equal(a, b)
        with pytest.raises(RuntimeError, match="second time"):
            torch.autograd.grad(out, [x], g)

    # create_graph: differentiable gradients (through torch), double backward as eager's
    xg = x.detach().requires_grad_()
    (dx,) = torch.autograd.grad(fast(xg), [xg], g, create_graph=True)
    (ddx,) = torch.autograd.grad(dx.square().sum(), [xg])
    xe = x.detach().requires_grad_()
    (dxe,) = torch.autograd.grad(model(xe), [xe], g, create_graph=True)
    (ddxe,) = torch.autograd.grad(dxe.square().sum(), [xe])
    assert_close([dx, ddx], [dxe, ddxe], 1e-3)

    # an input without gradients: the parameters' still arrive, accumulated into .grad
    model.zero_grad(set_to_none=True)   # the same parameters as fast's
    xn = x.detach()
    fast(xn).backward(g)
    assert model.weight.grad is not None and xn.grad is None
    w_fast = model.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    model(xn).backward(g)
    assert_close([w_fast], [model.weight.grad])

    # an input changed in place after the forward: torch's version check, not a wrong gradient
    xi = torch.randn(64, 1024, device="cuda", requires_grad=True)
    y = xi * 1.0
    out = fast(y)
    with torch.no_grad():
        y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(g)


def test_awkward_upstream_gradients():
    model = layer_norm()
    fast = kbench.optimize(model, (torch.randn(64, 1024, device="cuda"),), budget="none", verbose=False)
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    g = torch.randn(64, 1024, device="cuda")
    grads(fast, x, g)   # the C++ program registered
    misaligned = torch.empty(64 * 1024 + 1, device="cuda")[1:].view(64, 1024).copy_(g)
    strided = g.t().contiguous().t()
    for up in (misaligned, strided):
        assert_close(grads(fast, x, up), grads(model, x, g))
    with pytest.raises(RuntimeError, match="shape"):
        torch.autograd.grad(fast(x), [x], g[:32])


def test_model_dropped_before_backward_and_collected_after():
    model = layer_norm()
    fast = kbench.optimize(model, (torch.randn(64, 1024, device="cuda"),), budget="none", verbose=False)
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    g = torch.randn(64, 1024, device="cuda")
    grads(fast, x, g)
    out = fast(x)
    ref = weakref.ref(fast)
    del fast
    gc.collect()
    assert ref() is not None   # the pending node keeps its regions' module alive
    (dx,) = torch.autograd.grad(out, [x], g)
    assert_close([dx], grads(model, x, g)[:1])
    del out
    gc.collect()
    assert ref() is None       # and nothing keeps it after: the cycles through C++ are collectable
