#!/usr/bin/env python
"""The GPU kernels of one forward+backward call, eager and kbench side by side (torch.profiler,
CUDA activity): which kernels run, and how long each takes, at a benchmark task's timed size.
Where the device-time roofline of a row is low, this says which kernel holds the time.

    python benchmarks/kernel_trace.py swiglu_two --dtype bfloat16
    python benchmarks/kernel_trace.py swiglu_two --dtype bfloat16 --graph 4

--graph N: also the kernels of N calls captured in one CUDA graph, each after an L2 flush, as
the benchmark's device timing (kbench.bench.timing.time_graph) replays them, per call: where the
device time of a row is longer than its calls timed one by one, this says which kernel grows.
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


def graph_trace(label, model, inputs, calls):
    """The kernels of one replay of a graph of `calls` forward+backward calls, each after an L2
    flush: the benchmark's own device timing (timed_fn, time_graph's warm-up and capture)."""
    from kbench.bench import timing
    from bench_ops import timed_fn
    dev = inputs[0].device
    xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        outs = model(*xs)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    gouts = [torch.randn_like(o) for o in outs]
    tfn = timed_fn(model, params, gouts, True)
    timing._warm_on_side_stream(tfn, [xs], dev, 3, "write")
    g = timing._capture(tfn, [xs], dev, calls, "write", "the calls")
    g.replay()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        g.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    total = sum(e.device_time for e in kernels)
    t0 = kernels[0].time_range.start if kernels else 0
    span = (kernels[-1].time_range.end - t0) if kernels else 0
    print(f"\n{label}, {calls} calls in a CUDA graph: {len(kernels)} kernel(s), {total / calls:.1f} us per call "
          f"of kernels, {span / calls:.1f} us per call from the first start to the last end")
    print("      start       end   duration")   # overlapping ranges: kernels that ran at once
    for e in kernels:
        print(f"  {e.time_range.start - t0:9.1f} {e.time_range.end - t0:9.1f} {e.device_time:9.1f} us  {e.name[:90]}")
    del g


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
    ap.add_argument("--graph", type=int, default=0, metavar="N", help="also N calls replayed from a CUDA graph")
    a = ap.parse_args(argv)
    model, inputs = task_model(a.task, parse_dtype(a.dtype))
    trace("eager", model, inputs)
    if a.graph:
        graph_trace("eager", model, inputs, a.graph)
    opt = kbench.optimize(model, tuple(inputs), backend="cuda", budget=a.budget, verbose=False)
    trace("kbench", opt, inputs)
    if a.graph:
        graph_trace("kbench", opt, inputs, a.graph)


if __name__ == "__main__":
    main()
