"""A call holds only live values: each value slot of a bound program is dropped after its last
reader (plan.release_after_last_use), on the Python path here; csrc/fast/program.cpp does the same
for the C++ path (its GPU test: tests/gpu/test_fast_path.py). Outputs stay, and the results and
gradients are eager's."""
import warnings
import weakref

import torch

import kbench
from kbench.runtime import plan as runtime


class Chain(torch.nn.Module):
    """Regions in a row, each reading the one before: every intermediate dies one step later."""

    def __init__(self, width=64, depth=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(self.norm(x))) + x
        return x.softmax(-1), x


def optimized():
    torch.manual_seed(0)
    model = Chain()
    x = torch.randn(8, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = kbench.optimize(model, (x,), backend="interp", gate=False, strict=True)
    return model, opt, x


def test_every_slot_released_once_after_its_last_reader():
    _, opt, x = optimized()
    opt(x)
    (bound,) = opt._kbench_sigs.values()
    released = [i for step in bound.steps for i in step.release]
    assert len(released) == len(set(released)) and released
    assert not set(released) & set(bound.outputs)
    for k, step in enumerate(bound.steps):
        for i in step.release:
            assert i in step.ins or i in step.made   # read here, or made here and never read
            assert all(i not in later.ins for later in bound.steps[k + 1:])
    every = {i for step in bound.steps for i in step.ins + step.made} - set(bound.outputs)
    assert every == set(released)


def test_released_intermediates_are_freed_and_results_are_eagers(monkeypatch):
    model, opt, x = optimized()
    alive, most = [], [0]
    run = runtime.Step.run

    def tracked(self, inputs):
        # the values made so far that are still held (by the call's slots) when this step starts
        most[0] = max(most[0], sum(r() is not None for r in alive))
        outs = run(self, inputs)
        alive.extend(weakref.ref(t) for t in outs if isinstance(t, torch.Tensor))
        return outs
    monkeypatch.setattr(runtime.Step, "run", tracked)
    with torch.no_grad():
        got = opt(x)
        want = model(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert len(alive) >= 8, "the regions did not run through Step.run"
    assert most[0] <= 4, f"{most[0]} of {len(alive)} intermediates held at once"
    # with gradients: the same release, and autograd keeps what the backward needs
    xg = x.clone().requires_grad_(True)
    (opt(xg)[0] * torch.arange(64.0)).sum().backward()
    xr = x.clone().requires_grad_(True)
    (model(xr)[0] * torch.arange(64.0)).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad)
