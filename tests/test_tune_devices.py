"""Tuning across the GPUs of one host (optimize(devices=), kbench/tune/spread.py), the parts the
CPU can check: the option's validation and its errors; the scheduling (each region searched once,
on one GPU, by a thread per GPU; the results merged in region order whatever order the threads
finish in; a GPU whose context may be unusable takes no more; an error raised once all stop); the
tuner's choice of what to search elsewhere; and the re-timing of a winner against the default on
the model's GPU (search.confirm). The GPUs themselves: tests/gpu/test_distributed_nccl.py."""
import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

import kbench
from kbench.tune import search, spread, tuner
from test_cache_times import key

H100 = "NVIDIA H100 80GB HBM3 (sm_90)"


def resolve(devices, target="cuda:0", count=2, models=None):
    models = models or {}
    return spread.resolve(devices, torch.device(target), count=count, model=lambda i: models.get(i, H100))


# ---------------------------------------------------------------------------------------- the option

def test_devices_are_resolved_to_distinct_visible_indices():
    assert resolve(None) is None                     # today's behaviour: no spreading at all
    assert resolve("all", count=3) == (0, 1, 2)
    assert resolve([1, "cuda:0"]) == (1, 0)
    assert resolve((torch.device("cuda", 1),), target="cuda:0") == (1,)   # the target need not search


@pytest.mark.parametrize("devices, error, match", [
    ([], ValueError, "devices is empty"),
    ([0, 0], ValueError, "more than once"),
    ([0, 2], ValueError, "GPU 2 is not visible \\(2 GPU\\(s\\) visible: 0, 1\\)"),
    ([-1], ValueError, "GPU -1 is not visible"),
    ([True], TypeError, "a GPU is an index"),
    ([0.0], TypeError, "a GPU is an index"),
    (["cpu"], ValueError, "not a numbered CUDA device"),
    (["cuda"], ValueError, "not a numbered CUDA device"),
    ("every", ValueError, "None, 'all' or a list"),
    (1, TypeError, "None, 'all' or a list"),
])
def test_bad_devices_are_refused_with_the_reason(devices, error, match):
    with pytest.raises(error, match=match):
        resolve(devices)


def test_no_gpu_visible_and_a_cpu_model_are_refused():
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        resolve("all", count=0)
    with pytest.raises(ValueError, match="backend 'interp'"):
        resolve([0], target="cpu")


def test_gpus_of_another_model_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"GPU 1 is a NVIDIA A100.* the model runs on GPU 0, a NVIDIA H100"):
        resolve([0, 1], models={1: "NVIDIA A100-SXM4-80GB (sm_80)"})
    # the target is compared too, where it does not search itself
    with pytest.raises(ValueError, match="GPU 1 is a NVIDIA H200"):
        resolve([1], target="cuda:0", models={1: "NVIDIA H200 (sm_90)"})


def test_optimize_refuses_devices_before_capturing_on_the_cpu():
    model = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match="devices= spreads the cuda backend's search"):
        kbench.optimize(model, (torch.randn(2, 4),), devices=[0, 1], verbose=False)


# ---------------------------------------------------------------------------------------- scheduling

def _fake_search(delays, log, stop_on=None):
    """A per-device runner: the 'winner' depends on the job only (as a search seeded per region);
    each call sleeps as `delays` says, so threads finish in another order each run."""
    lock = threading.Lock()

    def work(device, job):
        with lock:
            log.append((job, device, threading.current_thread().name))
        time.sleep(delays(device, job))
        return SimpleNamespace(winner=f"genome-of-{job}", poisoned=(device, job) == stop_on)
    return work


def test_each_region_is_searched_once_on_one_gpu_and_merged_in_region_order():
    jobs = [f"region{i}" for i in range(10)]
    seen = []
    for run in range(4):
        rng = random.Random(run)
        log = []
        table = {(d, j): rng.uniform(0, 0.01) for d in (0, 1) for j in jobs}
        got = spread.spread(jobs, (0, 1), _fake_search(lambda d, j: table[(d, j)], log))
        assert sorted(j for j, _, _ in log) == jobs                       # each searched exactly once
        assert {d for _, d, _ in log} == {0, 1}, log                      # both GPUs took regions
        assert all(name == f"kbench-search-gpu{d}" for _, d, name in log)  # one thread per GPU
        by_job = {j: d for j, d, _ in log}
        assert [d for d, _ in got] == [by_job[j] for j in jobs]            # each result names its GPU
        seen.append([res.winner for _, res in got])
    assert all(s == [f"genome-of-{j}" for j in jobs] for s in seen)       # the same winners, in order


def test_a_gpu_whose_search_may_have_poisoned_it_takes_no_more():
    jobs = list(range(6))
    log = []
    work = _fake_search(lambda d, j: 0.02 if d == 0 else 0.0, log)   # GPU 1 is poisoned at its first job

    def poisoned_on_1(device, job):
        res = work(device, job)
        res.poisoned = device == 1
        return res
    got = spread.spread(jobs, (0, 1), poisoned_on_1, stop=lambda res: res.poisoned)
    assert [d for _, d, _ in log].count(1) == 1 and all(g is not None for g in got)
    # every GPU stopped: what is left comes back as None (searched on the model's GPU instead)
    got = spread.spread(jobs, (0,), lambda d, j: SimpleNamespace(poisoned=True), stop=lambda res: res.poisoned)
    assert got[0] is not None and got[1:] == [None] * 5


def test_an_error_stops_every_gpu_and_the_first_in_region_order_is_raised():
    started = []

    def work(device, job):
        started.append(job)
        time.sleep(0.01 if job == 1 else 0.0)
        if job in (1, 2):
            raise RuntimeError(f"job {job}")
        return job
    with pytest.raises(RuntimeError, match="job 1"):
        spread.spread(list(range(20)), (0, 1), work)
    assert len(started) < 20        # no GPU took another job after the error


# ---------------------------------------------------------------------------------------- the tuner's part

def test_the_tuner_searches_each_distinct_uncached_region_once_across_its_gpus(monkeypatch):
    # regions 0..5: 0 and 3 identical (a repeated block), 4 has a winner in the cache, 5 fits nowhere
    sigs = {0: "a", 1: "b", 2: "c", 3: "a", 4: "cached", 5: "huge"}
    t = tuner.Tuner(budget="fast", verbose=False, devices=(0, 1))
    t.by_source[key(region_sig="tuned-before")] = None
    sigs[6] = "tuned-before"
    monkeypatch.setattr(t, "cache_key", lambda ex, r: key(region_sig=sigs[r]))
    monkeypatch.setattr(t, "points", lambda ex, r, s: ([] if sigs[r] == "huge" else [[8]], ""))
    store = SimpleNamespace(lookup=lambda k: SimpleNamespace(cubin=b"x") if k.region_sig == "cached" else None)
    monkeypatch.setattr(t, "store", lambda: store)
    made, calls = [], []

    class Ex:
        plan = SimpleNamespace(example_symvals=[8])

        def sibling(self, device):
            made.append(device)
            return ("sibling", device.index)
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())

    def fake_search(ex, r, symvals, **kw):
        calls.append((ex, r))
        time.sleep(0.01)
        return SimpleNamespace(poisoned=False, r=r)
    monkeypatch.setattr(search, "search_region", fake_search)
    compute = [SimpleNamespace(index=r, kind="ROW") for r in sigs]
    t.search_spread(Ex(), compute)
    assert sorted(r for _, r in calls) == [0, 1, 2]                  # 3 is 0's twin; 4 cached; 5, 6 not
    for ex, r in calls:                                                # each found on the GPU that searched it
        assert t.found[key(region_sig=sigs[r])][0] == ex[1] and t.found[key(region_sig=sigs[r])][1].r == r
    assert len(t.found) == 3 and len(made) == len(set(made)) and {d.index for d in made} <= {0, 1}
    # rank 0 left "b" to torch: a receiving rank does not search it
    t.found.clear()
    calls.clear()
    with tuner.sharing(skip=[key(region_sig="b")]):
        t.search_spread(Ex(), compute)
    assert sorted(r for _, r in calls) == [0, 2]


# ---------------------------------------------------------------------------------------- re-timing

class _Bench:
    """load/time/time_each of a CudaRegionBench, on costs by kernel (with a little noise)."""

    def __init__(self, cost, noise=0.02, seed=0):
        self.cost, self.noise, self.rng, self.loads = cost, noise, random.Random(seed), 0

    def load(self, k):
        self.loads += 1
        return k

    def time(self, kernel, reps):
        return [self.cost[kernel]] * max(reps, 1)

    def time_each(self, kernels, n):
        return [self.cost[k] * (1 + self.noise * (self.rng.random() - 0.5)) for k in kernels]


@pytest.mark.parametrize("winner_ms, keep", [(0.8, True), (1.0, False), (0.97, False)])
def test_a_winner_from_another_gpu_is_kept_only_where_it_beats_the_default_here(winner_ms, keep, monkeypatch):
    monkeypatch.setattr(search, "RETIME_EXTRA_S", float("inf"))   # the rounds' count alone decides
    bench = _Bench({"default": 1.0, "winner": winner_ms})
    kept, d_ms, w_ms, rounds = search.confirm(bench, "default", "winner", "fast")
    assert kept is keep
    assert abs(d_ms - 1.0) < 0.02 and abs(w_ms - winner_ms) < 0.02
    assert bench.loads == 2 * search.LOADS                        # each loaded as many times as a finalist
    assert rounds >= search.BUDGETS["fast"].rounds


def _adopt_case(monkeypatch, *, gate="", keep=True, winner="threads=128", default_ok=True):
    """Tuner.adopt on a region searched on GPU 1 for a model on GPU 0, every device step faked:
    what it keeps, and what it ran (confirm, build)."""
    from kbench import _C, verify
    t = tuner.Tuner(budget="fast", verbose=False, devices=(0, 1))
    ran, stored = [], []
    ex = SimpleNamespace(device=torch.device("cuda", 0), plan=SimpleNamespace(partition=None), sm=90, dev={},
                         load=lambda k: ("loaded", k.genome))
    kernel_info = lambda g: SimpleNamespace(genome=g)   # noqa: E731
    monkeypatch.setattr(t, "gate", lambda ex, r, kernel, sizes: gate)
    monkeypatch.setattr(verify, "gate_nostats", lambda ex, r, kernel, sizes: "")
    monkeypatch.setattr(t, "envelope", lambda ex, verdict: "searched envelope")
    monkeypatch.setattr(_C, "generate", lambda *a: kernel_info("threads=256"))
    monkeypatch.setattr(search, "kernel_key", lambda k: k.genome)
    monkeypatch.setattr(search, "CudaRegionBench", lambda *a, **k: "bench")
    monkeypatch.setattr(search, "confirm", lambda bench, d, w, b: ran.append(("confirm", d.genome, w.genome))
                        or (keep, 1.0, 0.8, 20))
    monkeypatch.setattr(t, "build", lambda ex, k, r, points, note: ran.append(("build", k.genome))
                        or (("built", k.genome), (tuner.Status.KERNEL, ""), "default envelope"))
    monkeypatch.setattr(t, "remember", lambda ex, key, k, kernel, envelope, res: stored.append(k.genome))
    monkeypatch.setattr(t, "record", lambda key, res: stored.append("record"))
    cands = [{"genome": "threads=256", "time_ms": 1.0 if default_ok else None}, {"genome": winner, "time_ms": 0.8}]
    res = search.SearchResult(kernel_info(winner), 0.8, 1.0, cands, 2.0, best_genome=winner,
                              default_genome="threads=256", verdict=True)
    got = t.adopt(ex, 3, key(), (1, res), [[8]], "", {})
    return got, ran, stored


def test_a_winner_from_another_gpu_is_gated_and_retimed_here_before_it_is_kept(monkeypatch):
    (kernel, status, envelope, extra), ran, stored = _adopt_case(monkeypatch)
    assert kernel == ("loaded", "threads=128") and status[0] is tuner.Status.KERNEL
    assert ran == [("confirm", "threads=256", "threads=128")] and stored == ["threads=128"]
    assert extra["tuned_on"] == "cuda:1" and "on cuda:0" in extra["confirmed"] and "winner kept" in extra["confirmed"]
    assert envelope == "searched envelope"
    # not faster here: the default is built, sandboxed and verified here, and kept
    (kernel, status, envelope, extra), ran, stored = _adopt_case(monkeypatch, keep=False)
    assert kernel == ("built", "threads=256") and envelope == "default envelope" and stored == ["threads=256"]
    assert ran[-1] == ("build", "threads=256") and "the default stays" in extra["confirmed"]
    # the search's winner is the default, or the default never ran there: nothing to re-time
    for case in (dict(winner="threads=256"), dict(default_ok=False)):
        (kernel, status, _, extra), ran, _ = _adopt_case(monkeypatch, **case)
        assert ran == [] and status[0] is tuner.Status.KERNEL and "confirmed" not in extra
    # failing its check here: torch runs the region, and the reason names both GPUs
    (kernel, status, _, _), ran, stored = _adopt_case(monkeypatch, gate="output 0: off by 1e3")
    assert kernel is None and status[0] is tuner.Status.EAGER and ran == [] and stored == ["record"]
    assert "searched on cuda:1 fails its check on cuda:0: output 0" in status[1]


def test_a_gpu_whose_search_trapped_is_not_searched_on_again(monkeypatch):
    t = tuner.Tuner(budget="fast", verbose=False, devices=(0, 1))
    sigs = iter("abcdefgh")
    monkeypatch.setattr(t, "cache_key", lambda ex, r: key(region_sig=next(sigs)))
    monkeypatch.setattr(t, "points", lambda ex, r, s: ([[8]], ""))
    monkeypatch.setattr(t, "store", lambda: SimpleNamespace(lookup=lambda k: None))
    monkeypatch.setattr(torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    used = []

    def fake_search(ex, r, symvals, **kw):
        used.append(ex)
        time.sleep(0.05)    # long enough for both GPUs' threads to take a region
        return SimpleNamespace(poisoned=ex == 1)
    monkeypatch.setattr(search, "search_region", fake_search)
    ex = SimpleNamespace(plan=SimpleNamespace(example_symvals=[8]), sibling=lambda device: device.index)
    t.search_spread(ex, [SimpleNamespace(index=r, kind="ROW") for r in range(2)])
    assert t.lost == {1}
    used.clear()
    t.search_spread(ex, [SimpleNamespace(index=r, kind="ROW") for r in range(2, 6)])    # a backward's regions, later
    assert used == [0, 0, 0, 0]
