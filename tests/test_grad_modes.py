"""Grad modes inside a forward: a `torch.no_grad()` block (Hugging Face's rotary embeddings) and
`.detach()` stop the gradient in kbench's backward as they do in eager — the parameters read only
there get no gradient, the others get eager's."""
import warnings

import pytest
import torch

import kbench
from kbench.capture import export


class NoGradBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))
        self.v = torch.nn.Parameter(torch.randn(8))
        self.u = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        with torch.no_grad():
            c = (self.v * 2).exp()
            with torch.enable_grad():
                d = self.u.tanh()   # grad enabled again: u gets this gradient too, as in eager
        return (x @ self.w.detach() + c * self.v + d * x).sum(-1) + (self.u * x).mean(-1)


def grads(module, x):
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    module(x).square().sum().backward()
    return [x.grad] + [p.grad for p in module.parameters()]


def test_no_grad_blocks_and_detach_stop_the_gradient():
    torch.manual_seed(0)
    model = NoGradBlocks()
    x = torch.randn(4, 8)
    want = grads(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = kbench.optimize(model, (x,), backend="interp", gate=False, strict=True)
    got = grads(opt, x)
    assert want[1] is None and want[2] is not None   # w is read only detached
    for name, g, w in zip(["x", "w", "v", "u"], got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            torch.testing.assert_close(g, w, msg=name)
    assert "interp" in str(opt.kbench_report)   # the model ran on kbench's regions, not in eager
    assert not opt._kbench_reasons


def test_no_grad_block_is_inlined_with_detached_outputs():
    model = NoGradBlocks()
    ep = torch.export.export(model, (torch.randn(4, 8),), strict=False)
    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    assert any(n.target is hop for n in ep.graph.nodes)
    export._inline_grad_mode_blocks(ep)
    assert not any(n.target is hop for n in ep.graph.nodes)
    assert not any(n.op == "get_attr" for n in ep.graph.nodes)
    detaches = [n for n in ep.graph.nodes if n.target is torch.ops.aten.detach.default]
    assert len(detaches) == 2   # w.detach() and the value leaving the no_grad block
    x = torch.randn(4, 8)
    torch.testing.assert_close(ep.module()(x), model(x))
