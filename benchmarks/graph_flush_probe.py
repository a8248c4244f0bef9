#!/usr/bin/env python
"""Why are kbench's kernels slower inside the benchmark's forward+backward CUDA graph (GPU)?
One task, kbench (default genomes) and torch.compile side by side: the kernels of a replay of
a graph of 4 calls, forward+backward with and without the L2 flush between calls, and forward
only (no grad, and grad wanted); then 2 s of back-to-back replays with nvidia-smi polled
(clocks, power, throttle reasons). benchmarks/NOTES.md, session 12, has what it showed.

    python benchmarks/graph_flush_probe.py bias_gelu_tanh float32
"""
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import torch, kbench
from kbench.bench import timing
from kbench.bench.tasks import parse_dtype
from bench_ops import task_model, timed_fn

task, dt = sys.argv[1], sys.argv[2]
model, inputs = task_model(task, parse_dtype(dt))
dev = inputs[0].device
xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
opt = kbench.optimize(model, tuple(inputs), backend="cuda", budget="none", verbose=False)
comp = torch.compile(model)
params = [p for p in model.parameters() if p.requires_grad]
with torch.no_grad():
    o = model(*xs)
gouts = [torch.randn_like(o)]

def kernels_of(g, n):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        g.replay(); torch.cuda.synchronize()
    ks = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start)
    return " ".join(f"{e.name[:12]}:{e.device_time:.0f}" for e in ks[:n])

def graph(fn, calls=4, flush=True):
    timing._warm_on_side_stream(fn, [xs], dev, 3, "write" if flush else None)
    return timing._capture(fn, [xs], dev, calls, "write" if flush else None, "x")

def poll(stop, out):
    while not stop.is_set():
        r = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                            "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        out.append(r); time.sleep(0.2)

def sustained(label, g, seconds=2.0):
    out, stop = [], threading.Event()
    th = threading.Thread(target=poll, args=(stop, out)); th.start()
    t0 = time.time(); n = 0
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    while time.time() - t0 < seconds:
        s.record(); g.replay(); e.record(); e.synchronize(); times.append(s.elapsed_time(e)); n += 1
    stop.set(); th.join()
    print(f"{label}: {n} replays, ms per replay median {statistics.median(times):.3f} min {min(times):.3f}; smi: {out[len(out)//2] if out else ''}")

for name, m in (("kbench", opt), ("compile", comp)):
    fb = timed_fn(m, params, gouts, True)
    fw = timed_fn(m, params, gouts, False)
    def fwd_grad(*a, m=m):
        return m(*a)  # grad enabled, no backward
    for label, fn, flush in ((f"{name} fwdbwd flush", fb, True), (f"{name} fwdbwd noflush", fb, False),
                             (f"{name} fwd nograd flush", fw, True), (f"{name} fwd withgrad flush", fwd_grad, True)):
        g = graph(fn, 4, flush)
        g.replay(); torch.cuda.synchronize()
        print(f"{label}: {kernels_of(g, 9)}")
        if "fwdbwd flush" in label:
            sustained(label, g)
        del g
