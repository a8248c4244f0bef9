"""The model gate's remembered verdict on a GPU (kbench/tune/gate.py, Memory): a second optimize()
of the same model, a new module object with the same cache folder, times nothing (gate.compare
raises if called) and applies the first optimize()'s verdict: kbench's module kept, its CUDA
graphs released (the gate's graph threshold is set so that graphs are never faster), the
report's line the first one's times, marked remembered. Inference and a training step (forward
+ backward gated; the backward's kernels named in the record)."""
import pytest
import torch

import kbench
from kbench.runtime import graphs
from kbench.tune import gate

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 256)
        self.ln = torch.nn.LayerNorm(256)
        self.fc2 = torch.nn.Linear(256, 16)

    def forward(self, x):
        return self.fc2(self.ln(torch.nn.functional.gelu(self.fc1(x))))


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_a_second_optimize_applies_the_remembered_verdict_without_timing(tmp_path, monkeypatch, train):
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gate, "GRAPHS_BELOW", 0.0)     # graphs never faster: the verdict releases them
    real, calls = gate.compare, []

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(gate, "compare", counted)

    def model():
        torch.manual_seed(0)
        return Net().cuda().train(train)
    x = torch.randn(512, 64, device="cuda")
    first = kbench.optimize(model(), (x,), budget="fast", verbose=False)
    assert calls == [1] and first._kbench_gate_verdict.backward is train, first._kbench_gate
    runner = first._kbench_graphs
    assert isinstance(runner, graphs.GraphRunner) and runner.off.startswith("the model gate timed the call"), \
        first.kbench_report

    def timed_again(*a, **kw):
        raise AssertionError("gate.compare called: the verdict was not remembered")
    monkeypatch.setattr(gate, "compare", timed_again)
    twin = model()
    again = kbench.optimize(twin, (x,), budget="fast", verbose=False)
    line = again._kbench_gate
    assert "a remembered verdict, measured" in line, again.kbench_report   # not "model gate not measured (...)"
    assert line.split("): ", 1)[1] == first._kbench_gate.split("): ", 1)[1]   # the first one's times and decision
    assert not again._kbench_original
    assert again._kbench_graphs.off.endswith("(a remembered verdict)"), again._kbench_graphs.off
    out = again(x)
    want = twin(x)
    assert (out - want).abs().max().item() <= 1e-3 * want.abs().max().item()
    if train:   # the backward, built at this first call, runs
        out.square().mean().backward()
        assert all(p.grad is not None for p in twin.parameters())

    monkeypatch.setattr(gate, "compare", counted)       # gate="measure" times it again
    kbench.optimize(model(), (x,), budget="fast", verbose=False, gate="measure")
    assert calls == [1, 1]
