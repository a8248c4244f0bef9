"""One tuning for all ranks (kbench/distributed.py), the parts a single process can check: the
ranks' fingerprints and the first difference named; rank 0's decisions exported from its cache
and stored in another rank's (signed there with that rank's key); a region rank 0 left to torch
left to torch without a search; the group chosen for each `distributed` setting. The collectives
themselves run in tests/test_distributed.py (2 processes, gloo)."""
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cache_times import key, winner  # noqa: E402

from kbench import distributed as kd  # noqa: E402
from kbench.runtime.plan import Status  # noqa: E402
from kbench.tune import cache as kc  # noqa: E402
from kbench.tune import tuner  # noqa: E402


def _print(model, *args, **options):
    return kd.fingerprint(model, args, {}, dict(budget="fast", **options))


def test_ranks_that_differ_are_named_with_the_difference():
    m = torch.nn.Linear(4, 3)
    same = _print(m, torch.randn(2, 4), 0.5)
    assert kd.disagreement([same, _print(m, torch.randn(2, 4), 0.5)]) == ""     # values may differ
    why = kd.disagreement([same, same, _print(m, torch.randn(5, 4), 0.5)])
    assert why.startswith("rank 2 differs from rank 0 in the example inputs:") and "(5, 4)" in why, why
    why = kd.disagreement([same, _print(torch.nn.Linear(4, 2), torch.randn(2, 4), 0.5)])
    assert "rank 1 differs from rank 0 in the model's parameters and buffers" in why, why
    assert "rank 1" in kd.disagreement([same, _print(m, torch.randn(2, 4), 0.25)])   # a specialized float
    assert "the options" in kd.disagreement([same, _print(m, torch.randn(2, 4), 0.5, seed=1)])


def test_decisions_travel_from_rank_0s_cache_to_another_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(tmp_path / "rank0"))
    k, left = key(), key(region_sig="b" * 64)
    db = kc.open_cache()
    db.store(k, winner())
    db.close()
    shared = tuner.Shared()
    shared.used, shared.torch = [k, k, key(region_sig="c" * 64)], [left]   # the third: not stored
    decisions = kd.export_decisions(shared)
    assert len(decisions["winners"]) == 1 and decisions["torch"] == [left.as_dict()]
    # another host: another cache, another key file
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(tmp_path / "rank1"))
    assert kd.import_decisions(decisions) == 1
    db = kc.open_cache()
    got = db.lookup(k)
    db.close()
    assert got is not None and got.cubin == winner().cubin and got.envelope == winner().envelope
    bad = {"winners": [{"key": k.as_dict(), "winner": dict(dataclasses.asdict(winner()), code="x")}]}
    with pytest.raises(ValueError, match="unknown fields"):
        kd.import_decisions(bad)


def test_a_region_rank_0_left_to_torch_is_not_searched_again():
    t = tuner.Tuner(budget="fast", verbose=False)
    with tuner.sharing(skip=[key()]) as shared:
        kernel, (status, why), envelope, extra = t.tune(None, 0, key(), None, None)
        assert kernel is None and status is Status.EAGER and "rank 0" in why
        assert shared.used == [] and shared.torch == []
    assert tuner._shared is None


def test_which_ranks_share():
    import torch.distributed as dist
    assert not dist.is_initialized()
    for mode in kd.MODES:
        assert kd.group_for(mode) is None      # no process group
    with pytest.raises(ValueError, match="distributed"):
        kd.group_for("yes")
