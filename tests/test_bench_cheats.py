"""The benchmark harness (kbench/bench) against implementation files that win without computing.
Each file in tests/bench_cheats/ was scored correct and faster than eager when the timing loop
handed every call the same input objects, never looked at a timed output, and the file ran in
the harness's own process. Here each must be flagged, or (the identity caches) must never have
found the shortcut it looks for: every timed call now gets new input objects.

The files run in one worker process, in this file's order (Env(share_worker=True): one start-up
of torch instead of one per file); the worker is restarted where a file kills it or rewrote the
harness's code in it. Small configs and the quick budget keep this cheap; the GPU version of
these runs is tests/gpu/test_bench_cheats_gpu.py. The pieces (fresh inputs, the CPU cross-check,
the protocol's refusals) are tested on their own at the end, without a worker."""
from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_package import ROOT  # noqa: E402,F401  (kbench.bench importable without the C core)

from kbench.bench import compare, harness, runner, worker  # noqa: E402
from kbench.bench.tasks import TASKS  # noqa: E402
from kbench.tune import timing  # noqa: E402

CHEATS = Path(__file__).resolve().parent / "bench_cheats"
CONFIGS = ["n16_h64", "n37_h1000"]   # softmax: checked on both, timed on the larger


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    log = tmp_path_factory.mktemp("cheat_log")
    old_log, old_threads = os.environ.get("KBENCH_CHEAT_LOG"), torch.get_num_threads()
    os.environ["KBENCH_CHEAT_LOG"] = str(log)   # the worker inherits it when it starts
    torch.set_num_threads(1)                     # and the worker takes the same count
    e = harness.Env("cpu", "quick", share_worker=True)
    e.cheat_log = log
    yield e
    e.close()
    torch.set_num_threads(old_threads)
    if old_log is None:
        os.environ.pop("KBENCH_CHEAT_LOG", None)
    else:
        os.environ["KBENCH_CHEAT_LOG"] = old_log


def score(env, name, baselines=("eager",)):
    return harness.score(TASKS["softmax"], name, str(CHEATS / f"{name}.py"), dtype="float32",
                         backward=False, env=env, baselines=baselines, configs=CONFIGS)


def reasons(row):
    return " | ".join(row["failures"] + row["task_problems"] + row["flags"])


def fired(env, name) -> bool:
    """Did the cheat take its shortcut at least once (it logs each time)?"""
    return (env.cheat_log / f"{name}.py.log").exists()


def flagged(row) -> bool:
    return row["status"] in ("FAIL", "FLAGGED")


# ------------------------------------------------------------------ honest, in the worker

def test_honest_file_passes_in_the_worker(env):
    row = score(env, "honest")
    assert row["status"] == "PASS", reasons(row)
    t = row["timings"][0]["impls"]["honest"]
    assert t["input_sets"] == timing.MIN_ARG_SETS and t["samples_checked"] == t["reps"]
    assert t["runner_wall_ms"] > 0 and not t["hidden_work"], t
    assert "honest" in row["timings"][0]["impls"] and "eager" in row["timings"][0]["impls"]


# ------------------------------------------------------------------ the cheats

@pytest.mark.parametrize("name", ["identity_cache", "seen_empty", "seen_thread"])
def test_identity_shortcuts_never_fire_or_are_caught(env, name):
    """Caches and 'seen it before' tricks keyed by the input object: every timed call gets a new
    object, so the shortcut is never there to take; where an allocator hands a freed address or
    id() back, the copy it holds is one of another input set, and the sampled output is wrong."""
    row = score(env, name)
    assert flagged(row) or not fired(env, name), reasons(row)
    if fired(env, name):
        assert "timed call" in reasons(row), reasons(row)


def test_thread_finishing_later_is_caught(env):
    """Returns an empty output from timed calls (it finds the timer up its stack) and fills it
    on a thread a millisecond later: outputs are copied the moment a call returns."""
    row = score(env, "thread_later")
    assert fired(env, "thread_later")
    assert row["status"] == "FAIL", reasons(row)
    assert "timed call" in reasons(row)


def test_crashing_worker_fails_the_row_and_the_next_row_runs(env):
    row = score(env, "crash")
    assert row["status"] == "FAIL" and "exit code 3" in reasons(row), reasons(row)
    row = score(env, "honest")   # a new worker
    assert row["status"] == "PASS", reasons(row)


@pytest.mark.parametrize("name", ["patch_compare", "patch_torch"])
def test_patching_the_checker_is_caught(env, name):
    """The file patches the comparisons (the benchmark's, or torch's own) in the process that
    loads it, then returns zeros. That process is the worker: this one's checks are untouched,
    and the worker reports that its harness code was replaced."""
    saved = (compare.close, torch.equal, torch.allclose, torch.linalg.vector_norm,
             torch.Tensor.abs)
    row = score(env, name)
    assert row["status"] == "FAIL", reasons(row)
    assert "replaced the harness's code" in reasons(row), reasons(row)
    assert saved == (compare.close, torch.equal, torch.allclose, torch.linalg.vector_norm,
                     torch.Tensor.abs)   # the file never ran in this process


# ------------------------------------------------------------------ the pieces, in-process

def test_fresh_args_are_new_objects_rotating_sets():
    sets = [[torch.full((64,), float(i))] for i in range(3)]
    src = timing.FreshArgs(sets)
    handed, seen_sets = [], set()
    for _ in range(40):
        s, (x,) = src.next()
        assert torch.equal(x, sets[s][0]) and all(x is not y for y in handed + sets[s])
        handed.append(x)
        seen_sets.add(s)
    assert seen_sets == {0, 1, 2}
    with pytest.raises(ValueError, match="at least 3"):
        timing.time_fn(lambda x: x, sets[:2], device="cpu", fresh=True)


def test_recycled_memory_holds_another_set():
    """A copy landing where an earlier copy was never gets the set that address first held."""
    sets = [[torch.full((256,), float(i))] for i in range(3)]
    src = timing.FreshArgs(sets)
    first_at = {}
    for _ in range(60):
        s, (x,) = src.take(1)[0]
        ptr = x.data_ptr()
        if ptr in first_at:
            assert s != first_at[ptr]
        first_at.setdefault(ptr, s)
        del x


def test_time_fn_fresh_samples_outside_the_window():
    sets = [[torch.randn(8, 8)] for _ in range(3)]
    seen_ids, kept = [], []

    def fn(x):
        seen_ids.append(id(x))
        return x * 2

    t = timing.time_fn(fn, sets, device="cpu", reps=6, warmup=2, fresh=True,
                       after_call=lambda s, args, out: kept.append((s, args[0], out)))
    assert len(kept) == 6 and t.input_sets == 3 and t.wall_calls >= 10
    for s, x, out in kept:
        assert torch.equal(out, sets[s][0] * 2)
    assert len(set(seen_ids[:8])) == 8   # warm-up and timed calls: a new object each


def test_cpu_cross_check_flags_work_left_to_a_thread():
    """A call that hands its work (matmuls, about 0.5 ms on this machine) to a thread it started
    once, and returns at once: cheap per call, dear per loop (the loop waits for that thread)."""
    a, jobs = torch.randn(128, 128), queue.SimpleQueue()
    t0 = time.perf_counter()
    for _ in range(5):
        a @ a
    n = max(1, round(0.5e-3 / ((time.perf_counter() - t0) / 5)))

    def serve():
        while jobs.get() is not None:
            for _ in range(n):
                a @ a
    th = threading.Thread(target=serve)
    th.start()

    def leaves_work(x):
        jobs.put(x)
        return x
    try:
        t = timing.time_fn(leaves_work, [(torch.ones(4),)], device="cpu", reps=5, warmup=1)
    finally:
        jobs.put(None)
        th.join()
    assert t.hidden_work and t.wall_over_event > timing.WALL_OVER_EVENT_LIMIT, t
    honest = timing.time_fn(lambda x: x.sum(), [(torch.ones(4),)], device="cpu", reps=5,
                            warmup=1)
    assert not honest.hidden_work, honest


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/kbench-evil-unpickled",))


class _FakeProc:
    pid, exitcode = 0, None

    def is_alive(self):
        return True

    def join(self, timeout=None):
        pass

    def kill(self):
        self.exitcode = -9


def _fake_worker(timeouts=None):
    w = runner.Worker("cpu", timeouts)
    w.conn, theirs = multiprocessing.Pipe()
    w.proc, w.arena = _FakeProc(), None
    return w, theirs


def test_worker_replies_are_never_unpickled():
    w, theirs = _fake_worker()
    theirs.send_bytes(pickle.dumps(_Evil()))
    with pytest.raises(runner.WorkerError, match="not JSON"):
        w.request({"op": "state", "key": "k"})
    assert not os.path.exists("/tmp/kbench-evil-unpickled")


def test_a_silent_worker_is_stopped_after_its_timeout():
    w, theirs = _fake_worker({"call": 0.2})
    t0 = time.monotonic()
    with pytest.raises(runner.WorkerError, match="did not answer a 'call' request in 0.2 s"):
        w.request({"op": "call"})
    assert time.monotonic() - t0 < 5 and w.proc is None


def test_arena_refuses_descriptions_outside_it(tmp_path):
    p = tmp_path / "arena"
    p.write_bytes(bytes(1 << 12))
    a = worker.Arena(str(p), 1 << 12)
    d, end = a.write(torch.arange(6, dtype=torch.float32).view(2, 3), 0)
    assert torch.equal(a.read(d), torch.arange(6, dtype=torch.float32).view(2, 3))
    for bad in ({"off": 4096, "dtype": "torch.float32", "shape": [1]},
                {"off": 0, "dtype": "torch.float32", "shape": [2000]},
                {"off": 3, "dtype": "torch.float32", "shape": [1]},
                {"off": 0, "dtype": "os.system", "shape": [1]},
                {"off": 0, "dtype": "torch.float32", "shape": [-1]},
                "rm -rf /"):
        with pytest.raises(worker.ProtocolError):
            a.read(bad)
