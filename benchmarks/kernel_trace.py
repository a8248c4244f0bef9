#!/usr/bin/env python
"""The GPU kernels of one forward+backward call, eager and kbench side by side (torch.profiler,
CUDA activity): which kernels run, and how long each takes, at a benchmark task's timed size.
Where the device-time roofline of a row is low, this says which kernel holds the time.

    python benchmarks/kernel_trace.py swiglu_two --dtype bfloat16
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import kbench  # noqa: E402
from kbench.bench.tasks import parse_dtype  # noqa: E402

from bench_ops import OPS, task_model  # noqa: E402


def fwd_bwd(model, inputs):
    xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    out = model(*xs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    grads = [torch.ones_like(o) for o in outs if o.requires_grad]
    torch.autograd.backward([o for o in outs if o.requires_grad], grads)


def trace(label, model, inputs):
    for _ in range(3):
        fwd_bwd(model, inputs)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fwd_bwd(model, inputs)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels)
    print(f"\n{label}: {len(kernels)} kernel(s), {total:.1f} us on the device")
    for e in kernels:
        print(f"  {e.device_time:9.1f} us  {e.name[:110]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("task", choices=sorted(OPS))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--budget", default="fast")
    a = ap.parse_args(argv)
    model, inputs = task_model(a.task, parse_dtype(a.dtype))
    trace("eager", model, inputs)
    opt = kbench.optimize(model, tuple(inputs), backend="cuda", budget=a.budget, verbose=False)
    trace("kbench", opt, inputs)


if __name__ == "__main__":
    main()
