"""The model gate's verdict remembered (kbench/tune/gate.py, Memory) and rank 0's imposed on
every rank, without a GPU: api._gated's decision path on an interp module with the CUDA-graph
runner's stand-in (tests/test_cuda_graphs.py) and gate.compare replaced by a fake; the store,
its key and its unreadable entries with real files in a temporary KBENCH_CACHE_DIR. The ranks
themselves: tests/test_distributed.py (2 processes, gloo); on a GPU: tests/gpu/test_gate_memory_gpu.py."""
import json
import logging
import sqlite3
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cache_times import key, winner  # noqa: E402
from test_cuda_graphs import graphed, mlp  # noqa: E402

import kbench  # noqa: E402
from kbench import api  # noqa: E402
from kbench.runtime import graphs  # noqa: E402
from kbench.tune import cache as kc  # noqa: E402
from kbench.tune import gate, tuner  # noqa: E402

CPU = torch.device("cpu")
OPTIONS = dict(gate=True, cuda_graphs="auto", budget="fast", grad_in_forward=True)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(tmp_path))
    return tmp_path


def fresh():
    """A new model object and its optimized module, graphed on the stand-in (as the cuda backend's)."""
    model, x = mlp(), torch.randn(4, 16)
    opt = kbench.optimize(model, (x,), backend="interp", budget="fast", verbose=False)   # the capture cached
    return model, opt, graphed(opt, option="auto"), x


def fake_compare(calls, eager_ms):
    """gate.compare's stand-in: the timed calls replay the graphs (as the real one's do), and the
    times say the graphs are not faster (1.2 ms with, 1.0 without), kbench at 1.0 ms against eager_ms."""
    def compare(model, optimized, args, kwargs, device, ungraphed=None):
        calls.append(ungraphed is not None)
        with torch.no_grad():
            for _ in range(graphs.WARMUP + 2):
                optimized(*args)
        return gate.decide(eager_ms, 1.2, False, 1.0, 5.0, 5.0)
    return compare


def gated(options=OPTIONS, capture_key="capture-key"):
    model, opt, runner, x = fresh()
    assert api._gated(model, opt, (x,), {}, "cuda", CPU, options, capture_key) is opt
    return opt, runner


def count(what="gate_verdicts"):
    db = kc.open_cache()
    try:
        return db.info()[what]
    finally:
        db.close()


@pytest.mark.parametrize("keep", [True, False])
def test_a_verdict_is_remembered_and_applied_without_timing(monkeypatch, keep):
    calls = []
    monkeypatch.setattr(gate, "compare", fake_compare(calls, 2.0 if keep else 1.0))
    first, runner = gated()
    assert calls == [True] and runner.off and bool(first._kbench_original) is not keep
    measured = first._kbench_gate
    assert "remembered" not in measured and count() == 1

    # a new module object, the same capture and kernels: the verdict applies, nothing is timed
    again, runner = gated()
    assert calls == [True]
    line = again._kbench_gate
    assert "(forward at the example call, a remembered verdict, measured " in line, line
    assert line.split("): ", 1)[1] == measured.split("): ", 1)[1]   # the same times and decision
    assert bool(again._kbench_original) is not keep
    assert runner.off.startswith("the model gate runs the original") if not keep else \
        runner.off == "the model gate timed the call at 1.2 ms with graphs, 1 ms without (a remembered verdict)"
    assert line in str(again.kbench_report)

    gated(dict(OPTIONS, gate="measure"))            # measured again, and kept in its place
    assert calls == [True, True] and count() == 1
    gated(dict(OPTIONS, budget="none"))             # keeps nothing between processes
    gated(capture_key=None)                         # a capture that is not kept: nor its verdict
    assert calls == [True] * 4 and count() == 1
    gated(dict(OPTIONS, cuda_graphs=True))          # another option: another verdict
    assert calls == [True] * 4 + [False] and count() == 2


def test_the_key_holds_everything_the_verdict_depends_on():
    model, opt, runner, x = fresh()
    base = dict(backward=False, autocast=(), cuda_graphs="auto", graphs_timed=True, grad_in_forward=True,
                device=CPU, kernels=gate.forward_kernels(opt._kbench_plan.regions))
    keys = {gate.Memory.of("capture", **base).key}
    for change in (dict(backward=True), dict(autocast=(("cuda", torch.bfloat16),)), dict(cuda_graphs=True),
                   dict(graphs_timed=False), dict(grad_in_forward=False), dict(device=torch.device("meta")),
                   dict(kernels=base["kernels"][:-1])):
        keys.add(gate.Memory.of("capture", **{**base, **change}).key)
    keys.add(gate.Memory.of("another capture", **base).key)
    assert len(keys) == 9
    # a kernel that changes (another genome or source) is another key
    info = next(i for i in opt._kbench_plan.regions if i.kind != "EXTERN")
    info.status, info.genome, info.source_hash = type(info.status).KERNEL, "threads=256", "ab" * 32
    one = gate.Memory.of("capture", **{**base, "kernels": gate.forward_kernels(opt._kbench_plan.regions)}).key
    info.source_hash = "cd" * 32
    assert gate.Memory.of("capture", **{**base, "kernels": gate.forward_kernels(opt._kbench_plan.regions)}).key != one


def _body(memory):
    db = kc.open_cache()
    try:
        return json.loads(db.load_verdict(memory.key))
    finally:
        db.close()


def test_an_unreadable_entry_is_measured_again_with_one_log_line(monkeypatch, caplog, cache_dir):
    calls = []
    monkeypatch.setattr(gate, "compare", fake_compare(calls, 2.0))
    gated()
    memory = gate.Memory(next(iter(_keys(cache_dir))))
    good = _body(memory)
    damaged = {"not json": "{not json", "a bad time": json.dumps(dict(good, eager_ms=-1.0)),
               "a missing field": json.dumps({k: v for k, v in good.items() if k != "backward"}),
               "another format": json.dumps(dict(good, format=gate.FORMAT + 1)),
               "a bad region": json.dumps(dict(good, elsewhere=[[{"region_sig": "x"}, "", False]])),
               "tampered": None}
    for damage, body in damaged.items():
        if body is None:   # changed behind the signature's back
            with sqlite3.connect(cache_dir / "kbench.sqlite") as conn:
                conn.execute("UPDATE gate_verdicts SET body = ?", (json.dumps(dict(good, eager_ms=100.0)),))
        else:              # signed, but not a record
            db = kc.open_cache()
            db.store_verdict(memory.key, body)
            db.close()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kbench"):
            assert memory.recall() is None, damage
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "remembered verdict is unreadable" in lines[0] and "\n" not in lines[0], lines
    opt, _ = gated()                                     # measured again, and replaced
    assert len(calls) == 2 and "remembered" not in opt._kbench_gate
    assert gated()[0]._kbench_gate.count("a remembered verdict") == 1 and len(calls) == 2


def _keys(cache_dir):
    with sqlite3.connect(cache_dir / "kbench.sqlite") as conn:
        return [r[0] for r in conn.execute("SELECT key FROM gate_verdicts")]


def test_a_backward_kernel_that_changed_in_the_cache_is_measured_again(caplog):
    """The regions outside the forward (built at the first backward, after optimize()) are named
    in the record with the winners they had; one re-stored with another kernel misses. Recalled
    under a shared tuning, they are rank 0's decisions to send (tuner.share)."""
    db = kc.open_cache()
    db.store(key(), winner())
    db.close()
    v = gate.decide(2.0, 1.0, True)
    memory = gate.Memory("k")
    memory.keep(v, [key(), key(), key(region_sig="b" * 64)], left={key(region_sig="b" * 64)})
    with tuner.sharing() as shared:
        got = memory.recall()
        api.share_decisions(used=[k for k, digest, _ in memory.elsewhere if digest],
                            torch=[k for k, _, left in memory.elsewhere if left])
    assert got is not None and got.keep and got.backward and got.origin == "a remembered verdict"
    assert memory.elsewhere == [(key(), winner().source_hash, False), (key(region_sig="b" * 64), "", True)]
    assert shared.used == [key()] and shared.torch == [key(region_sig="b" * 64)]
    db = kc.open_cache()
    db.store(key(), winner(source_hash="cd" * 32))        # tuned again: another kernel
    db.close()
    with caplog.at_level(logging.INFO, logger="kbench"):
        assert gate.Memory("k").recall() is None
    assert any("outside the forward" in r.getMessage() and "measuring again" in r.getMessage()
               for r in caplog.records)


def test_rank_0s_verdict_is_applied_untimed(monkeypatch):
    calls = []
    monkeypatch.setattr(gate, "compare", fake_compare(calls, 1.0))
    record = dict(gate.decide(2.0, 1.2, False, 1.0, 5.0, 5.0).record(), graphs_served=True)
    with gate.imposing({"verdict": record, "line": "model gate (...)"}):
        opt, runner = gated()
    assert calls == [] and not opt._kbench_original
    assert "rank 0's verdict, applied on every rank, measured" in opt._kbench_gate
    assert runner.off.endswith("(rank 0's verdict, applied on every rank)")
    assert count() == 0                                   # nothing remembered here: it is rank 0's
    with gate.imposing({"verdict": None, "line": "model gate not measured (RuntimeError: x)"}):
        opt, runner = gated()
    assert calls == [] and not opt._kbench_original and not runner.off
    assert opt._kbench_gate == ("model gate: no verdict from rank 0 (model gate not measured (RuntimeError: x)); "
                                "kbench's module runs on every rank")
    assert gate.shared(opt) == {"verdict": None, "line": opt._kbench_gate}
    opt, _ = gated()                                      # outside: measured here
    assert calls == [True] and gate.shared(opt)["verdict"] == opt._kbench_gate_verdict.record()


def test_the_gate_option_is_checked():
    with pytest.raises(ValueError, match="gate must be True, False or 'measure', got 'yes'"):
        kbench.optimize(torch.nn.Linear(2, 2), (torch.randn(1, 2),), gate="yes")
