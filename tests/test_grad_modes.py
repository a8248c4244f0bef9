"""Modes inside and around a forward. A `torch.no_grad()` block (Hugging Face's rotary embeddings)
and `.detach()` stop the gradient in kbench's backward as they do in eager — the parameters read
only there get no gradient, the others get eager's. A `torch.autocast(enabled=False)` block runs
its torch calls in float32 under an outer autocast, and a module captured under autocast (or
without) serves calls in the other mode as eager would. Gradients at clamp bounds are torch's."""
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
    export._inline_context_blocks(ep)
    assert not any(n.target is hop for n in ep.graph.nodes)
    assert not any(n.op == "get_attr" for n in ep.graph.nodes)
    detaches = [n for n in ep.graph.nodes if n.target is torch.ops.aten.detach.default]
    assert len(detaches) == 2   # w.detach() and the value leaving the no_grad block
    x = torch.randn(4, 8)
    torch.testing.assert_close(ep.module()(x), model(x))


class Bounds(torch.nn.Module):
    """Every clamp-like op, each with its own input (values sit exactly on the bounds)."""

    def forward(self, a, b, c, d, e, f, lo):
        return (torch.clamp(a, -1.0, 1.0), torch.nn.functional.hardtanh(b, -2.0, 2.0),
                torch.nn.functional.relu6(c), torch.nn.functional.hardsigmoid(d),
                torch.nn.functional.hardswish(e), torch.clamp(f, min=lo))


def test_gradients_at_clamp_bounds_are_torchs():
    """At an input exactly on a bound torch picks a side (clamp passes the gradient, hardtanh,
    relu6, hardsigmoid and hardswish do not or take one branch): kbench's gradients are eager's
    there, not a tie split half and half."""
    kinks = torch.tensor([-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 6.0, 0.5, -0.5], dtype=torch.float64)
    make = lambda: [kinks.clone().requires_grad_() for _ in range(6)] + [torch.full((10,), 0.5, dtype=torch.float64,
                                                                                   requires_grad=True)]
    model = Bounds()
    opt = kbench.optimize(model, tuple(x.detach() for x in make()), backend="interp", verbose=False)
    got_in, ref_in = make(), make()
    seed = torch.linspace(0.5, 1.5, 10, dtype=torch.float64)
    sum((o * seed).sum() for o in opt(*got_in)).backward()
    sum((o * seed).sum() for o in model(*ref_in)).backward()
    for i, (g, r) in enumerate(zip(got_in, ref_in)):
        assert torch.allclose(g.grad, r.grad, rtol=1e-6, atol=0), (i, g.grad, r.grad)


class AutocastOffBlock(torch.nn.Module):
    """A float32 block inside an autocast forward (Hugging Face's rotary frequencies), whose
    result feeds a cos: computed in bf16 instead, the cos of large values is wrong outright."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        h = x @ self.w
        with torch.autocast("cpu", enabled=False):
            y = h.float() @ self.w
        return (y * 1.0001).cos()


def test_autocast_disabled_block_runs_in_float32():
    torch.manual_seed(0)
    model, x = AutocastOffBlock(), torch.randn(8, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        opt = kbench.optimize(model, (x,), backend="interp", verbose=False)
        got, want = opt(x), model(x)
    assert type(opt).__name__ == "OptimizedModule"
    assert got.dtype == want.dtype == torch.float32
    assert float((got - want).abs().max()) <= 1e-4
    with torch.autocast("cpu", dtype=torch.bfloat16):   # again, from the capture cache: the mode is kept
        again = kbench.optimize(model, (x,), backend="interp", verbose=False)
        got = again(x)
    assert any(n.startswith("capture: from the cache") for n in again.kbench_report.notes)
    assert float((got - want).abs().max()) <= 1e-4


def test_calls_with_and_without_autocast_get_eagers_dtypes():
    """A capture is for the autocast mode it was made in: a call in another mode is served by a
    capture of its own, with eager's dtypes and values."""
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()), torch.randn(8, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = kbench.optimize(model, (x,), backend="interp", verbose=False)
        first = under(x)
    plain = under(x)
    assert first.dtype == torch.bfloat16 and plain.dtype == torch.float32
    assert float((plain - model(x)).abs().max()) <= 1e-5
    assert (model.training, ()) in under._kbench_modes
    off = kbench.optimize(model, (x,), backend="interp", verbose=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = off(x), model(x)
    assert got.dtype == want.dtype == torch.bfloat16
    assert float((got.float() - want.float()).abs().max()) <= 2e-2 * float(want.float().abs().max())
    assert any("under cpu autocast bfloat16: served by a capture of its own" in n for n in off.kbench_report.notes)


def test_switching_the_original_model_is_served_in_its_mode_by_one_capture():
    """model.eval() on the original rather than on the optimized module: the optimized module's
    own flag still says train, the original's submodules say eval. The call is served in eval, as
    eager runs it, by one capture of the state as it is, which is not sent back to train mode
    (set so, it captured the original again, in eval again, until Python's recursion limit)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Softmax(-1))
    x = torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = kbench.optimize(model, (x,), backend="interp", verbose=False)
        model.eval()
        for _ in range(2):
            torch.testing.assert_close(opt(x), model(x))
    (_, variant), = opt._kbench_variants
    assert not variant._kbench_modes and variant._kbench_captured_training is False
    assert not opt._kbench_reasons and not variant._kbench_reasons
