"""The profile a scored candidate gets for the agent's feedback (harness.score(profile=True)), on
CUDA: one call at the task's first config under the profiler's CUDA activity, in the process the
implementation runs in (a file: the worker; a callable: the harness's), summarized as kernels."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _bench_package import ROOT  # noqa: E402,F401

from kbench.bench import harness  # noqa: E402
from kbench.bench.tasks import TASKS  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _score(env, name, factory):
    return harness.score(TASKS["softmax"], name, factory, dtype="float32", backward=False, env=env,
                         baselines=("eager",), configs=["n16_h64", "n37_h1000"], profile=True)


def test_a_files_profile_counts_its_kernels_in_the_worker(tmp_path):
    f = tmp_path / "one_kernel.py"
    f.write_text("import torch\n\ndef make(model, example_inputs):\n"
                 "    return lambda x: torch.softmax(x, dim=-1)\n")
    with harness.Env("cuda", "quick") as env:
        row = _score(env, "one_kernel", str(f))
    assert row["status"] == "PASS", row["failures"] + row["flags"]
    p = row["profile"]
    assert isinstance(p, dict), p   # not "profile unavailable: ..."
    assert p["device"] == "cuda" and p["config"] == "n16_h64" and p["launches"] == 1, p
    assert p["device_ms"] > 0 and p["host_ms"] > 0 and len(p["top"]) == 1, p
    assert "softmax" in p["top"][0]["name"].lower() and p["top"][0]["count"] == 1, p


def test_a_callables_profile_in_the_harness_process():
    with harness.Env("cuda", "quick") as env:
        row = _score(env, "two_kernels", lambda model, ex: (lambda x: torch.softmax(x * 1.0, dim=-1)))
    assert row["status"] == "PASS", row["failures"] + row["flags"]
    p = row["profile"]
    assert isinstance(p, dict) and p["device"] == "cuda" and p["launches"] == 2, p
    assert sorted(t["count"] for t in p["top"]) == [1, 1] and p["device_ms"] >= max(t["self_ms"] for t in p["top"]), p
