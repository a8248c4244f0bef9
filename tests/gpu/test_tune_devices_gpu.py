"""The search spread over two GPUs (optimize(devices=[0, 1]), kbench/tune/spread.py) on a small
model with three distinct regions (budget "fast", a cold cache each): both GPUs search, the report
names the GPU of each region, every region kbench runs on one GPU it runs on two (verified), a
winner that differs from the one-GPU run's was re-timed on the model's GPU and kept there, and the
module computes what the model computes."""
import pytest
import torch
from torch import nn

import kbench
from kbench import _C
from kbench.runtime.plan import Status

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


class Block(nn.Module):
    def __init__(self, d=256):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _optimize(model, x, cache, devices, monkeypatch):
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(cache))
    return kbench.optimize(model, (x,), budget="fast", verbose=False, gate=False, devices=devices)


def _compute(m):
    return [info for info in m._kbench_plan.regions if info.kind != "EXTERN"]


def test_the_search_spreads_over_two_gpus_and_keeps_what_one_gpu_keeps(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = Block().cuda().eval()
    x = torch.randn(4096, 256, device="cuda:0")
    one = _optimize(model, x, tmp_path / "one", None, monkeypatch)
    two = _optimize(model, x, tmp_path / "two", [0, 1], monkeypatch)
    assert not any("tuned_on" in info.extra for info in _compute(one))     # devices=None: as ever
    searched = [info for info in _compute(two) if info.extra.get("candidates")]
    assert len(searched) >= 2, str(two.kbench_report)
    assert {info.extra["tuned_on"] for info in searched} == {"cuda:0", "cuda:1"}, str(two.kbench_report)
    report = str(two.kbench_report)
    assert "on cuda:0" in report and "on cuda:1" in report, report
    ex = two._kbench_executor
    for a, b in zip(_compute(one), _compute(two)):
        assert a.ops == b.ops
        if a.status.kernel:       # the same or better: verified here too
            assert b.status is Status.KERNEL, (b.index, b.status, b.reason)
        default = str(_C.generate(two._kbench_plan.partition, b.index, ex.sm, None, ex.dev).genome)
        if b.genome != a.genome and b.genome != default:   # another winner: shown faster here than the default
            assert "the winner kept" in b.extra.get("confirmed", ""), (b.index, b.genome, a.genome, b.extra)
    with torch.no_grad():
        want = model(x)
        got = two(x)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    assert got.device == x.device and not two._kbench_reasons


def test_gpus_of_another_kind_are_refused_before_anything_is_captured():
    names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
    x = torch.randn(8, 256, device="cuda:0")
    with pytest.raises(ValueError, match="is not visible"):
        kbench.optimize(Block().cuda(), (x,), devices=[0, torch.cuda.device_count()], verbose=False)
    if len(names) > 1:   # a mixed host: "all" names a GPU of another kind
        with pytest.raises(ValueError, match="one GPU's timings decide nothing"):
            kbench.optimize(Block().cuda(), (x,), devices="all", verbose=False)
