"""The model zoo on the GPU (cuda backend, tiny sizes): a training step and eval match eager's,
and the model-level gate: it leaves no trace on the model (no gradients written, BatchNorm's
running statistics and the random generators as they were) and, where kbench's module is not
faster, the original runs."""
import copy
import os
import sys
import warnings

import pytest
import torch

import kbench
from kbench.tune import gate

pytestmark = pytest.mark.gpu
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from models.zoo import BY_NAME, ZOO  # noqa: E402


def rel(got, want, floor=1e-6):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(floor))


def setup(name):
    entry = BY_NAME[name]
    torch.manual_seed(0)
    model = entry.make("tiny").cuda()
    twin = copy.deepcopy(model)
    args, kwargs = entry.call("tiny", torch.Generator().manual_seed(1), "cuda")
    return entry, model, twin, args, kwargs


def step(entry, module, args, kwargs):
    out = module(*args, **kwargs)
    loss = entry.loss(out, args, kwargs)
    loss.backward()
    return out, loss


@pytest.mark.parametrize("name", [m.name for m in ZOO])
def test_zoo_training_step_and_eval_on_kernels(name):
    entry, model, twin, args, kwargs = setup(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = kbench.optimize(model, args, kwargs, budget="none", verbose=False, strict=True, gate=False)
    assert opt.kbench_report.kernels > 0, opt.kbench_report
    out, loss = step(entry, opt, args, kwargs)
    want_out, want_loss = step(entry, twin, args, kwargs)
    assert rel(entry.output(out), entry.output(want_out)) <= 1e-4, opt.kbench_report
    assert rel(loss, want_loss) <= 1e-4
    scale = max(float(p.grad.abs().max()) for p in twin.parameters() if p.grad is not None)
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if q.grad is not None:
            # a gradient that is zero in exact arithmetic (a conv bias before train-mode
            # BatchNorm) is rounding noise whose size depends on the reduction order: judged on
            # the model's gradient scale
            assert rel(p.grad, q.grad, floor=1e-2 * scale) <= 1e-4, n
    assert not opt._kbench_reasons, opt._kbench_reasons   # no call fell back to eager
    opt.eval()
    twin.eval()
    with torch.no_grad():
        assert rel(entry.output(opt(*args, **kwargs)), entry.output(twin(*args, **kwargs))) <= 1e-4


def test_gate_leaves_no_trace_and_runs_the_original_where_kbench_is_not_faster(monkeypatch):
    entry, model, twin, args, kwargs = setup("resnet50")
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.cuda.get_rng_state()
    monkeypatch.setattr(gate, "KEEP_BELOW", 0.0)          # kbench can never be faster than this
    opt = kbench.optimize(model, args, kwargs, budget="none", verbose=False)
    assert all(p.grad is None for p in model.parameters())
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n               # running statistics as they were
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    assert opt._kbench_original and "original module runs" in str(opt.kbench_report)
    out, _ = step(entry, opt, args, kwargs)
    want, _ = step(entry, twin, args, kwargs)
    assert rel(entry.output(out), entry.output(want)) <= 1e-6   # the original ran
    monkeypatch.setattr(gate, "KEEP_BELOW", float("inf"))  # kbench always kept
    entry, model, twin, args, kwargs = setup("resnet50")
    opt = kbench.optimize(model, args, kwargs, budget="none", verbose=False)
    assert not opt._kbench_original and "model gate" in str(opt.kbench_report)
