#!/usr/bin/env python
"""Host (CPU) time of one optimized forward and forward+backward call at a size where the GPU
work is negligible, and a cProfile of the calls: where kbench's per-call overhead goes.

    python benchmarks/host_profile.py layer_norm --dtype bfloat16
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import kbench  # noqa: E402
from kbench.bench.tasks import parse_dtype  # noqa: E402

from bench_ops import OPS, task_model  # noqa: E402


def per_call_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("task", choices=sorted(OPS))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--shape", default="64,4096")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    dtype = parse_dtype(a.dtype)
    model, xs = task_model(a.task, dtype, dict(shape=tuple(int(s) for s in a.shape.split(","))))
    opt = kbench.optimize(model, tuple(xs), backend="cuda", budget="none", verbose=False)
    xg = [x.detach().requires_grad_(x.is_floating_point()) for x in xs]
    gy = torch.randn_like(opt(*xs))

    def fwd():
        with torch.no_grad():
            opt(*xs)

    def eager_fwd():
        with torch.no_grad():
            model(*xs)

    def fwdbwd(m=opt):
        m(*xg).backward(gy)

    rows = [("eager forward", per_call_us(eager_fwd)), ("kbench forward", per_call_us(fwd)),
            ("eager forward+backward", per_call_us(lambda: fwdbwd(model))),
            ("kbench forward+backward", per_call_us(fwdbwd))]
    for name, us in rows:
        print(f"{name:<26} {us:8.1f} us per call (host-bound at {a.shape})")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        for _ in range(20):
            fwdbwd()
        torch.cuda.synchronize()
    print(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        fwdbwd()
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
