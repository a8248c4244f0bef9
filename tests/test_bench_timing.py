"""Tests of the benchmark's two timings and its search report (benchmarks/bench_ops.py,
kbench/tune/timing.py): device time from CUDA-graph replay beside the per-call event time, and
kbench's searched-vs-default genome gain read from a plan. The CPU tests use fake plans and
synthetic rows; the gpu-marked ones (run with -m gpu) time real calls and failed captures."""
from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_package import ROOT  # noqa: E402  (kbench.bench importable without the C core)

from kbench.tune import timing  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def bench_ops():
    spec = importlib.util.spec_from_file_location("bench_ops_under_test",
                                                  ROOT / "benchmarks" / "bench_ops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------ searched vs default

def _region(index, kind="ROW", **extra):
    return SimpleNamespace(index=index, kind=kind, extra=extra)


def _fake_module(wrapped=True):
    """A kbench module as bench_ops sees it: forward regions (one searched twice over, one in
    torch, one a repeat of another) and two backward programs (one generated, one in torch)."""
    plan = SimpleNamespace(regions=[
        _region(0, default_ms=0.30, best_ms=0.20, candidates=40, cache="miss"),
        _region(1, "EXTERN"),
        _region(2, cache="same as region 0"),
        _region(3, default_ms=0.10, best_ms=0.10, candidates=12, cache="miss"),
    ])
    bwd_plan = SimpleNamespace(regions=[
        _region(0, default_ms=0.50, best_ms=0.25, candidates=30, cache="miss"),
        _region(1, "POINTWISE", cache="hit"),
    ])
    mod = SimpleNamespace(_kbench_plan=plan, _kbench_backward={
        (0, (True, False)): SimpleNamespace(plan=bwd_plan),
        (3, (True,)): None,  # this backward runs in torch: no program
    })
    return SimpleNamespace(_kbench_impl=mod) if wrapped else mod


def test_search_summary_forward_row(bench_ops):
    s = bench_ops.search_summary(_fake_module(), backward=False)
    assert [(e["direction"], e["region"]) for e in s["search"]] == [
        ("fwd", 0), ("fwd", 2), ("fwd", 3)]  # EXTERN runs in torch: no search to report
    assert s["search"][1]["cache"] == "same as region 0" and s["search"][1]["best_ms"] is None
    assert s["search_gain"] == pytest.approx(0.40 / 0.30)
    assert s["search_regions"] == 2 and s["search_cache_hits"] == 0
    assert bench_ops.search_label(s) == "1.33× (2 regions)"


def test_search_summary_forward_backward_row(bench_ops):
    # not wrapped: the plain optimized module works as well as impls.kbench_factory's wrapper
    s = bench_ops.search_summary(_fake_module(wrapped=False), backward=True)
    bwd = [e for e in s["search"] if e["direction"] == "bwd"]
    assert [(e["region"], e["forward_region"], e["need"], e["cache"]) for e in bwd] == [
        (0, 0, "10", "miss"), (1, 0, "10", "hit")]
    assert s["search_gain"] == pytest.approx(0.90 / 0.55)
    assert s["search_regions"] == 3 and s["search_cache_hits"] == 1
    assert bench_ops.search_label(s) == "1.64× (3 regions, 1 cached)"


def test_search_label_without_a_search(bench_ops):
    hits = SimpleNamespace(_kbench_plan=SimpleNamespace(regions=[
        _region(0, search_s=0.0, candidates=0, cache="hit")]), _kbench_backward={})
    assert bench_ops.search_label(bench_ops.search_summary(hits, backward=True)) == "cached"
    assert bench_ops.search_summary(lambda x: x, backward=False)["search"] == []  # eager
    assert bench_ops.search_label({}) == "—"
    # budget "none": the default genome, not searched, not from the cache
    off = SimpleNamespace(_kbench_plan=SimpleNamespace(regions=[_region(0, cache="off")]))
    assert bench_ops.search_label(bench_ops.search_summary(off, backward=False)) == "—"


def test_search_line_counts_rows(bench_ops):
    rows = [{"impls": {"kbench": {"search_gain": g}}} for g in (1.33, 1.10, 1.05, 0.9, None)]
    rows.append({"impls": {"eager": {}}})  # no kbench cell: not a kbench row
    line = bench_ops.search_line(rows)
    assert "2 of 5 kbench rows" in line
    assert "1 searched slower than the default" in line
    assert "1 with no searched region" in line


# ------------------------------------------------------------------ the table and the JSON

def _row(**kbench):
    return {"task": "layer_norm", "dtype": "bfloat16", "mode": "fwdbwd", "status": "PASS",
            "notes": [], "speedup_kbench_vs_eager": 1.5, "speedup_kbench_vs_compile": 1.1,
            "impls": {
                "eager": {"median_ms": 0.3, "roofline_fraction": 0.30,
                          "graph_roofline_fraction": 0.45},
                "compile": {"median_ms": 0.22, "roofline_fraction": 0.20,
                            "graph_error": "GraphTimingError: capturing the calls failed"},
                "kbench": dict({"median_ms": 0.2, "roofline_fraction": 0.50,
                                "graph_roofline_fraction": 0.80}, **kbench)}}


def test_table_has_both_rooflines_and_the_search(bench_ops):
    text = bench_ops.table([_row(search_gain=1.333, search_regions=2, search_cache_hits=0)],
                           list(bench_ops.IMPLS))
    header = [c.strip() for c in text.splitlines()[0].strip("|").split("|")]
    line = [c.strip() for c in text.splitlines()[2].strip("|").split("|")]
    cells = dict(zip(header, line))
    assert cells["roofline eager / compile / kbench"] == "30% / 20% / 50%"  # per call, as before
    assert cells["device-time roofline e / c / k"] == "45% / err / 80%"
    assert cells["searched vs default"] == "1.33× (2 regions)"
    assert header.index("device-time roofline e / c / k") == \
        header.index("roofline eager / compile / kbench") + 1
    cached = bench_ops.table([_row(search_gain=None, search_regions=0, search_cache_hits=2)],
                             list(bench_ops.IMPLS))
    assert "| cached |" in cached


def test_device_time_cell_fields(bench_ops, monkeypatch):
    args = SimpleNamespace(device="cuda", graph_calls=4, graph_replays=3)
    env = {"copy": {"bytes_per_s": 1e12}}

    def fails(*a, **k):
        raise timing.GraphTimingError("capturing the calls failed: syncs")
    monkeypatch.setattr(bench_ops.timing, "time_graph", fails)
    cell = {"median_ms": 1.0}
    bench_ops.device_time(cell, None, [()], 10**9, env, args)  # never raises
    assert cell["graph_error"] == "GraphTimingError: capturing the calls failed: syncs"
    assert "graph_ms" not in cell and cell["median_ms"] == 1.0

    t = timing.GraphTiming("cuda-graph", 4, 3, 2.0, 1.9, 2.1, 0.03)
    monkeypatch.setattr(bench_ops.timing, "time_graph", lambda *a, **k: t)
    cell = {}
    bench_ops.device_time(cell, None, [()], 10**9, env, args)
    assert cell["graph_ms"] == 2.0 and cell["graph_timing"]["calls"] == 4
    assert cell["graph_roofline_fraction"] == pytest.approx(0.5)  # 1 ms of copy in 2 ms

    monkeypatch.setattr(bench_ops.timing, "time_graph", lambda *a, **k: None)  # the CPU
    cell = {}
    bench_ops.device_time(cell, None, [()], 10**9, env, args)
    assert cell == {}


def test_bench_ops_json_describes_both_timings(bench_ops, tmp_path, capsys):
    rc = bench_ops.main(["--quick", "--device", "cpu", "--tasks", "softmax", "--dtypes",
                         "float32", "--impls", "eager,kbench", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    methods = doc["options"]["timing_methods"]
    assert set(methods) == {"per-call", "device"}
    assert "host overhead included" in methods["per-call"]
    assert "host overhead removed" in methods["device"]
    k = doc["rows"][0]["impls"]["kbench"]
    assert k.get("error") or ("search" in k and "search_gain" in k)
    out = capsys.readouterr().out
    assert "device-time roofline e / c / k" in out and "searched vs default genome:" in out


# ------------------------------------------------------------------ time_graph

def test_time_graph_on_cpu_returns_none():
    calls = []
    assert timing.time_graph(lambda x: calls.append(x), [(1,)], device="cpu") is None
    assert not calls  # nothing was run: there is no device time to measure on the CPU
    assert issubclass(timing.GraphTimingError, RuntimeError)


def test_flush_kinds():
    assert timing.FLUSH_KINDS == ("write", "read")
    timing.flush_l2("cpu", "read")   # nothing to flush on the CPU
    with pytest.raises(ValueError, match="flush kind 'clean'"):
        timing.flush_l2("cpu", "clean")


def _big(n_bytes=64 << 20):
    return torch.randn(n_bytes // 4, device="cuda")


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_time_graph_elementwise_is_below_per_call():
    xs = [(_big(),), (_big(),)]

    def op(x):
        return x * 2.0 + 1.0

    per_call = timing.time_fn(op, xs, device="cuda", reps=30, warmup=3)
    g = timing.time_graph(op, xs, device="cuda")
    assert g is not None and g.method == "cuda-graph"
    assert 0 < g.median_ms < per_call.median_ms * 1.2 + 0.005
    # 128 MB moved: not faster than 10 TB/s (no H100/H200 is), so the call was really timed
    assert g.median_ms > 128e6 / 10e12 * 1e3
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


class _CountedGraph:
    """Stands in for a CUDA graph in _replay_ms: one small kernel per replay, replays counted."""

    def __init__(self):
        self.x, self.replays = torch.zeros(1024, device="cuda"), 0

    def replay(self):
        self.x.add_(1.0)
        self.replays += 1


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_graph_replays_are_warm_before_they_are_timed():
    """The first milliseconds of replays after a capture can run slow (docs/learned.md): untimed
    rounds for GRAPH_WARM_S come first, then `replays` timed ones of each graph."""
    graphs = [_CountedGraph(), _CountedGraph()]
    t0 = time.perf_counter()
    times = timing._replay_ms(graphs, 3, "cuda")
    assert time.perf_counter() - t0 >= timing.GRAPH_WARM_S
    assert [len(t) for t in times] == [3, 3] and all(v > 0 for t in times for v in t)
    # the upload, the warm rounds (many: each is a few microseconds), the timed ones
    assert graphs[0].replays > 1 + 2 + 3 and graphs[0].replays + 1 == graphs[1].replays


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_time_graph_removes_host_overhead():
    x = _big(16 << 20)

    def host_bound(a):
        time.sleep(1e-3)  # the GPU waits on the host: counted per call, not in a graph
        return a + 1.0

    per_call = timing.time_fn(host_bound, [(x,)], device="cuda", reps=10, warmup=2)
    g = timing.time_graph(host_bound, [(x,)], device="cuda", calls=8, reps=3)
    assert per_call.median_ms > 0.8
    assert 0 < g.median_ms < 0.2


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_time_graph_forward_backward_and_memory(bench_ops):
    ln = torch.nn.LayerNorm(4096, device="cuda", dtype=torch.bfloat16)
    xs = [(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16).requires_grad_(),)
          for _ in range(2)]
    gouts = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)]
    fn = bench_ops.timed_fn(ln, list(ln.parameters()), gouts, backward=True)
    per_call = timing.time_fn(fn, xs, device="cuda", reps=20, warmup=3)
    timing.flush_l2("cuda")  # the flush buffer is the benchmark's, not the graph's
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    g = timing.time_graph(fn, xs, device="cuda", calls=16)
    peak = torch.cuda.max_memory_allocated() - base
    assert 0 < g.median_ms < per_call.median_ms * 1.2 + 0.005
    # one call's outputs and gradients are ~100 MB: 16 calls that kept theirs would take 1.6 GB
    assert peak < 6 * 4096 * 4096 * 2, peak
    assert torch.cuda.memory_allocated() == base  # the graphs' pools went back


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bad", ["item", "synchronize"])
def test_failed_capture_is_an_error_and_cuda_still_works(bad):
    x = _big(4 << 20)

    def not_capturable(a):
        y = a * 3.0
        if bad == "item":
            y.sum().item()          # a value read on the host
        else:
            torch.cuda.synchronize()
        return y

    with pytest.raises(timing.GraphTimingError, match="capturing the calls failed"):
        timing.time_graph(not_capturable, [(x,)], device="cuda")
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert (x * 0 + 2).sum().item() == 2 * x.numel()
    g = timing.time_graph(lambda a: a * 3.0, [(x,)], device="cuda")  # and capture works again
    assert g.median_ms > 0


def test_host_overhead_times_with_the_collector_off():
    """host_overhead_us times its calls with the garbage collector off (timeit's practice: a
    collection is the process's cost, not the call's), warm-up calls with it as it was, and
    leaves it as it found it, also when the call raises."""
    import gc

    seen = []
    assert gc.isenabled()
    us = timing.host_overhead_us(lambda: seen.append(gc.isenabled()), (), calls=5, warmup=2)
    assert seen == [True] * 2 + [False] * 5 and gc.isenabled() and us >= 0

    def boom():
        if not gc.isenabled():
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        timing.host_overhead_us(boom, (), calls=3, warmup=1)
    assert gc.isenabled()
    gc.disable()
    try:
        timing.host_overhead_us(lambda: None, (), calls=3, warmup=1)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_time_fn_reports_the_block_a_slow_host_stretch_missed():
    """time_fn(blocks=3): the host stalls 2 ms before every launch of the first block only (as a
    busy host would); the block reported is a later one, every block's median is kept, and
    blocks=1 keeps the stalled calls in."""
    x = torch.zeros(1 << 20, device="cuda")
    calls = [0]

    def stalls_at_first(t):
        calls[0] += 1
        if calls[0] <= 3 + 20:   # the warm-up calls, then the first block's
            time.sleep(2e-3)
        return t + 1.0

    t = timing.time_fn(stalls_at_first, [(x,)], device="cuda", reps=20, warmup=3, blocks=3)
    assert len(t.block_medians_ms) == 3 and t.block_medians_ms[0] > 1.5, t.block_medians_ms
    assert t.median_ms == min(t.block_medians_ms) < 1.0, t
    calls[0] = 0
    one = timing.time_fn(stalls_at_first, [(x,)], device="cuda", reps=20, warmup=3)
    assert one.block_medians_ms == [] and one.median_ms > 1.5, one
