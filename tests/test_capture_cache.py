"""The capture kept between processes (kbench/capture/cache.py): what its key sees, that a stored
capture rebuilds the same graph, that a hit is checked against eager and a stale or corrupt entry
is replaced, and what is never kept."""
import contextlib
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kbench
from kbench.capture import cache as capture_cache
from kbench.tune import cache
from kbench.capture import capture

from models import MODELS


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(tmp_path))
    return tmp_path


def _stored(cache_dir):
    with contextlib.closing(cache.open_cache()) as db:
        return db.info()["captures"]


@pytest.mark.parametrize("case", MODELS, ids=[c.name for c in MODELS])
def test_stored_capture_rebuilds_the_same_graph(case):
    model, args = case.make(), case.inputs()
    captured = capture(model, args)
    again = capture_cache.loads(capture_cache.dumps(captured))
    assert str(again.graph) == str(captured.graph)
    for field in ("input_names", "input_syms", "param_names", "input_kinds", "static_reason", "example_symvals",
                  "notes", "input_dtypes", "value_names"):
        assert getattr(again, field) == getattr(captured, field), field
    assert [e.name for e in again.externs] == [e.name for e in captured.externs]
    # the rebuilt capture computes what the model computes (externs and output structure included)
    from kbench.runtime.interp import InterpExecutor
    from kbench.runtime.module import OptimizedModule
    optimized = OptimizedModule(model, again, InterpExecutor(), torch.device("cpu"))
    assert capture_cache.matches_eager(model, optimized, case.other_inputs()) == ""


def test_a_stored_capture_is_decoded_with_the_cyclic_collector_off(monkeypatch):
    """Decoding a capture makes a large JSON tree that lives until the capture is built: with the
    collector on, the young collections on the way promote it until a full collection of the
    whole process runs (0.4-0.5 s with torch and a 12-layer GPT-2 in it). Off while it is read,
    and on again after, as it was; a failed read turns it back on too."""
    import gc
    import json
    from kbench.capture import stored
    blob = capture_cache.dumps(capture(MODELS[0].make(), MODELS[0].inputs()))
    seen, real = [], json.loads
    monkeypatch.setattr(stored.json, "loads", lambda *a, **k: seen.append(gc.isenabled()) or real(*a, **k))
    assert gc.isenabled()
    capture_cache.loads(blob)
    assert seen == [False] and gc.isenabled()
    with pytest.raises(stored.NotData):
        capture_cache.loads(blob[:len(stored.MAGIC)] + b"[]")
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:                               # a caller's choice stays
        capture_cache.loads(blob)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_every_test_model_has_its_own_key():
    keys = {}
    for case in MODELS:
        key = capture_cache.fingerprint(case.make(), case.inputs(), "interp")
        assert key == capture_cache.fingerprint(case.make(), case.inputs(), "interp"), case.name
        keys.setdefault(key, []).append(case.name)
    assert all(len(names) == 1 for names in keys.values()), [n for n in keys.values() if len(n) > 1]


class Scaled(nn.Module):
    def __init__(self, scale=2.0, n=8):
        super().__init__()
        self.scale = scale
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        return F.layer_norm(self.lin(x), x.shape[-1:]) * self.scale


def test_key_sees_attributes_parameters_inputs_and_modes():
    x = torch.randn(4, 8)
    key = capture_cache.fingerprint(Scaled(), (x,), "interp")
    assert key == capture_cache.fingerprint(Scaled(), (torch.randn(4, 8),), "interp")  # values do not matter
    others = [
        capture_cache.fingerprint(Scaled(scale=3.0), (x,), "interp"),              # a plain attribute
        capture_cache.fingerprint(Scaled(n=6), (torch.randn(4, 6),), "interp"),    # parameter shapes
        capture_cache.fingerprint(Scaled(), (x.double(),), "interp"),             # input dtype
        capture_cache.fingerprint(Scaled(), (torch.randn(5, 8),), "interp"),      # input shape
        capture_cache.fingerprint(Scaled(), (torch.randn(8, 4).t(),), "interp"),  # strides
        capture_cache.fingerprint(Scaled(), (x,), "cuda"),                        # backend
        capture_cache.fingerprint(Scaled().eval(), (x,), "interp"),               # train/eval
        capture_cache.fingerprint(Scaled().double(), (x,), "interp"),             # parameter dtype
    ]
    frozen = Scaled()
    frozen.lin.weight.requires_grad_(False)
    others.append(capture_cache.fingerprint(frozen, (x,), "interp"))
    with torch.no_grad():
        others.append(capture_cache.fingerprint(Scaled(), (x,), "interp"))   # grad mode
    assert len({key, *others}) == len(others) + 1


def test_key_sees_closures_of_lambda_modules():
    from models import Lambda
    x = torch.randn(4, 8)

    def make(k):
        return Lambda(lambda t: t * k, "scale")
    assert capture_cache.fingerprint(make(2.0), (x,), "interp") != capture_cache.fingerprint(make(3.0), (x,), "interp")


def test_hooks_make_a_model_uncacheable():
    model = Scaled()
    model.lin.register_forward_hook(lambda m, i, o: o * 2)
    with pytest.raises(capture_cache.Uncacheable, match="forward_hooks"):
        capture_cache.fingerprint(model, (torch.randn(4, 8),), "interp")


def test_second_optimize_reads_the_capture_and_matches_eager(cache_dir):
    model, x = Scaled(), torch.randn(4, 8)
    first = kbench.optimize(model, x)
    assert "capture: torch.export, kept in the cache" in first.kbench_report.notes
    assert _stored(cache_dir) == 1
    second = kbench.optimize(model, x)
    assert any(n.startswith("capture: from the cache") for n in second.kbench_report.notes)
    y = torch.randn(6, 8)   # another batch size: the stored capture kept its varying sizes
    torch.testing.assert_close(second(y), model(y))
    # training through the stored capture reaches the original parameters
    second(y).sum().backward()
    assert model.lin.weight.grad is not None


def test_stale_entry_is_detected_and_replaced(cache_dir, caplog):
    """A key that missed a difference (here the capture of scale=2.0 stored under scale=5.0's key):
    the Python state the stored capture read does not hold, and the model is captured again."""
    x = torch.randn(4, 8)
    kbench.optimize(Scaled(scale=2.0), x)
    stale = capture_cache.fingerprint(Scaled(scale=2.0), (x,), "interp")
    model = Scaled(scale=5.0)
    model.lin.load_state_dict(Scaled(scale=2.0).lin.state_dict())
    fresh = capture_cache.fingerprint(model, (x,), "interp")
    with contextlib.closing(cache.open_cache()) as db:   # pretend the key missed the difference
        db.store_capture(fresh, db.load_capture(stale))
    with caplog.at_level(logging.WARNING, logger="kbench"):
        optimized = kbench.optimize(model, x)
    assert "read other Python state (attribute scale is 5.0" in caplog.text
    assert "capture: torch.export, kept in the cache" in optimized.kbench_report.notes
    torch.testing.assert_close(optimized(x), model(x))
    again = kbench.optimize(model, x)   # the entry now holds the right capture
    assert any(n.startswith("capture: from the cache") for n in again.kbench_report.notes)
    torch.testing.assert_close(again(x), model(x))


def test_entry_that_does_not_fit_the_module_is_recaptured(cache_dir, caplog):
    """A stored capture naming parameters the module lacks fails while it is checked: recaptured,
    not raised."""
    x = torch.randn(4, 8)
    kbench.optimize(Scaled(), x)
    other = nn.Sequential(nn.Linear(8, 8))
    other.scale = torch.tensor(2.0)   # a 0-dim tensor attribute: in the key by its value
    with contextlib.closing(cache.open_cache()) as db:
        db.store_capture(capture_cache.fingerprint(other, (x,), "interp"),
                         db.load_capture(capture_cache.fingerprint(Scaled(), (x,), "interp")))
    with caplog.at_level(logging.WARNING, logger="kbench"):
        optimized = kbench.optimize(other, x)
    assert "does not match eager" in caplog.text
    torch.testing.assert_close(optimized(x), other(x))


def test_corrupt_entry_is_dropped(cache_dir, caplog):
    model, x = Scaled(), torch.randn(4, 8)
    key = capture_cache.fingerprint(model, (x,), "interp")
    with contextlib.closing(cache.open_cache()) as db:
        db.store_capture(key, b"not a capture")
    with caplog.at_level(logging.WARNING, logger="kbench"):
        optimized = kbench.optimize(model, x)
    assert "stored capture is unusable" in caplog.text
    torch.testing.assert_close(optimized(x), model(x))
    assert any(n.startswith("capture: from the cache") for n in kbench.optimize(model, x).kbench_report.notes)


def test_budget_none_keeps_nothing(cache_dir):
    kbench.optimize(Scaled(), torch.randn(4, 8), budget="none")
    assert _stored(cache_dir) == 0


class Noisy(nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.5, training=True) + 1


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(x)


@pytest.mark.parametrize("model", [Noisy(), Counting().train()], ids=["random", "mutates"])
def test_random_or_mutating_forward_is_not_kept(cache_dir, model):
    x = torch.randn(4, 8)
    kbench.optimize(model, x)
    assert _stored(cache_dir) == 0


def test_new_process_skips_export(cache_dir, tmp_path):
    """The point of it all: a second process optimizes without running torch.export."""
    script = tmp_path / "m.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, kbench, torch.export
        calls = []
        real = torch.export.export
        torch.export.export = lambda *a, **k: calls.append(1) or real(*a, **k)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.GELU())
        x = torch.randn(4, 8)
        out = kbench.optimize(model, x)
        torch.testing.assert_close(out(x), model(x))
        print(len(calls))
    """))
    runs = [subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "KBENCH_CACHE_DIR": str(cache_dir),
                                "PYTHONPATH": os.pathsep.join(sys.path)})
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert [r.stdout.split()[-1] for r in runs] == ["1", "0"]


def test_cache_cli_counts_and_clears_captures(cache_dir, capsys):
    kbench.optimize(Scaled(), torch.randn(4, 8))
    assert cache.cli_main(["info"]) == 0
    assert "captures: 1" in capsys.readouterr().out
    assert cache.cli_main(["clear"]) == 0
    assert "1 captured model(s)" in capsys.readouterr().out
    assert _stored(cache_dir) == 0
