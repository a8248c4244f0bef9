#!/usr/bin/env python
"""Where the spread of a forward+backward call's time comes from: many calls of one benchmark
task, each timed with CUDA events after an L2 flush (as the benchmark does), eager and kbench,
with Python's garbage collector on and off, and the threads alive during the calls.

    python benchmarks/host_jitter.py bias_gelu_erf --dtype float32
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import kbench  # noqa: E402
from kbench.bench import timing  # noqa: E402
from kbench.bench.tasks import parse_dtype  # noqa: E402

from bench_ops import OPS, task_model  # noqa: E402


def calls_ms(model, inputs, n):
    xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    out = model(*xs)
    up = [torch.randn_like(o) for o in (out if isinstance(out, (tuple, list)) else (out,))]
    times = []
    for i in range(n + 5):
        timing.flush_l2(xs[0].device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        o = model(*xs)
        torch.autograd.backward(list(o) if isinstance(o, (tuple, list)) else [o], up)
        b.record()
        b.synchronize()
        if i >= 5:
            times.append(a.elapsed_time(b))
    return times


def show(label, t):
    t = sorted(t)
    q = lambda f: t[min(len(t) - 1, int(f * len(t)))]  # noqa: E731
    print(f"  {label:<28} median {statistics.median(t):.4f}  p10 {q(0.1):.4f}  p90 {q(0.9):.4f}  max {t[-1]:.4f} ms")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("task", choices=sorted(OPS))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args(argv)
    model, inputs = task_model(a.task, parse_dtype(a.dtype))
    opt = kbench.optimize(model, tuple(inputs), backend="cuda", budget="fast", verbose=False)
    print(f"{a.task} {a.dtype}: threads alive: {[t.name for t in threading.enumerate()]}")
    for name, m in (("eager", model), ("kbench", opt)):
        show(f"{name}", calls_ms(m, inputs, a.calls))
        gc.disable()
        try:
            show(f"{name}, gc off", calls_ms(m, inputs, a.calls))
        finally:
            gc.enable()
        show(f"{name} again", calls_ms(m, inputs, a.calls))


if __name__ == "__main__":
    main()
