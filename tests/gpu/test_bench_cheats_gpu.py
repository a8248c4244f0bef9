"""The cheat files of tests/bench_cheats on CUDA (tests/test_bench_cheats.py runs them on the
CPU): each runs in the harness's worker process and must be flagged, or, for the shortcuts keyed
by the input object, must never have found its shortcut. On the GPU the outputs are copied next
on the current stream when a call returns, so work left to another stream or to a thread (which
launches on its own stream order, later) is seen as an output that was not ready."""
from __future__ import annotations

import os
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

CHEATS = Path(__file__).resolve().parents[1] / "bench_cheats"
CONFIGS = ["n16_h64", "n37_h1000", "b2_t3_h50257"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    log = tmp_path_factory.mktemp("cheat_log")
    old = os.environ.get("KBENCH_CHEAT_LOG")
    os.environ["KBENCH_CHEAT_LOG"] = str(log)
    e = harness.Env("cuda", "quick", share_worker=True)
    e.cheat_log = log
    yield e
    e.close()
    if old is None:
        os.environ.pop("KBENCH_CHEAT_LOG", None)
    else:
        os.environ["KBENCH_CHEAT_LOG"] = old


def score(env, name, configs=CONFIGS, dtype="float32"):
    return harness.score(TASKS["softmax"], name, str(CHEATS / f"{name}.py"), dtype=dtype,
                         backward=False, env=env, baselines=("eager",), configs=configs)


def reasons(row):
    return " | ".join(row["failures"] + row["task_problems"] + row["flags"])


def fired(env, name) -> bool:
    return (env.cheat_log / f"{name}.py.log").exists()


def test_honest_file_passes_on_cuda(env):
    row = score(env, "honest", dtype="bfloat16")
    assert row["status"] == "PASS", reasons(row)
    t = row["timings"][0]["impls"]["honest"]
    assert t["method"] == "cuda-events" and t["input_sets"] == 3 and t["samples_checked"] >= 1
    assert t["runner_wall_ms"] > 0 and not t["hidden_work"], t


@pytest.mark.parametrize("name", ["identity_cache", "seen_empty", "seen_thread", "side_stream"])
def test_identity_shortcuts_never_fire_or_are_caught_on_cuda(env, name):
    row = score(env, name)
    assert row["status"] in ("FAIL", "FLAGGED") or not fired(env, name), reasons(row)


def test_thread_finishing_later_is_caught_on_cuda(env):
    row = score(env, "thread_later")
    assert fired(env, "thread_later") and row["status"] == "FAIL", reasons(row)
    assert "timed call" in reasons(row)


@pytest.mark.parametrize("name", ["patch_compare", "patch_torch"])
def test_patching_the_checker_is_caught_on_cuda(env, name):
    row = score(env, name)
    assert row["status"] == "FAIL" and "replaced the harness's code" in reasons(row), reasons(row)


def test_crash_on_cuda_fails_the_row_only(env):
    row = score(env, "crash", configs=CONFIGS[:1])
    assert row["status"] == "FAIL" and "exit code 3" in reasons(row), reasons(row)


def test_honest_file_on_the_perf_config(tmp_path):
    """The default budget's large config (128 MB per input set): fresh copies in a pool bounded
    by memory, sampled outputs through a larger exchange file."""
    with harness.Env("cuda", "default") as env:
        row = harness.score(TASKS["softmax"], "honest", str(CHEATS / "honest.py"),
                            dtype="float32", backward=False, env=env, baselines=("eager",),
                            configs=["n16_h64", "n8192_h4096"])
    assert row["status"] == "PASS", reasons(row)
    (t,) = [x for x in row["timings"] if "impls" in x]
    assert t["config"] == "n8192_h4096" and t["impls"]["honest"]["samples_checked"] >= 1
    assert t["impls"]["honest"]["wall_calls"] >= 3
