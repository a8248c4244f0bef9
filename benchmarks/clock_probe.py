#!/usr/bin/env python
"""Is it the SM clock (GPU)? The benchmark's device timing of one forward+backward (a graph of 16
calls between read flushes, and a graph of the flushes alone) replayed interleaved with a third
graph that spins a known number of cycles (torch.cuda._sleep): cycles / its time is the SM clock
at that moment. kbench and torch.compile, LayerNorm bf16 8192x4096.
benchmarks/NOTES.md, session 13, has what it showed.

    python benchmarks/clock_probe.py layer_norm bfloat16
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import torch
from bench_ops import build_impl, probe_setup, timed_fn
from kbench.bench import timing
from kbench.bench.tasks import parse_dtype

CYCLES = 400_000
op, dt = sys.argv[1], sys.argv[2]
dev = "cuda"
task, cfg, model, params, arg_sets, gouts = probe_setup(op, parse_dtype(dt), dev)


def spin():
    torch.cuda._sleep(CYCLES)


for name in ("kbench", "compile", "kbench"):
    fn = build_impl(name, model, arg_sets[0], dev, "fast")[0]
    tfn = timed_fn(fn, params, gouts, True)
    t = timing.time_fn(tfn, arg_sets, device=dev, reps=50, warmup=10)
    timing._warm_on_side_stream(tfn, arg_sets, dev, 3, "read")
    timing._warm_on_side_stream(lambda *a: spin(), arg_sets, dev, 1, None)
    graphs = [timing._capture(tfn, arg_sets, dev, 16, "read", "calls"),
              timing._capture(None, arg_sets, dev, 16, "read", "flushes"),
              timing._capture(lambda *a: spin(), arg_sets, dev, 1, None, "spin")]
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    ev = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in graphs]
          for _ in range(12)]
    for row in ev:
        for g, (a, b) in zip(graphs, row):
            a.record(); g.replay(); b.record()
    torch.cuda.synchronize()
    print(f"{name}: per call (events) {t.median_ms:.4f} ms")
    for row in ev:
        c, f, s = (a.elapsed_time(b) for a, b in row)
        print(f"  calls {c / 16:.4f}  flushes {f / 17:.4f}  per call {(c - f) / 16:.4f} ms  "
              f"spin {s:.4f} ms = {CYCLES / s / 1e3:.0f} MHz")
    del graphs, fn, tfn
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
