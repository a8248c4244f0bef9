#!/usr/bin/env python
"""Is the GPU slower for a while after kbench builds (and searches) a backward (GPU)?
A graph of L2 flushes alone (torch kernels only) is timed every few ms before and after the first
forward+backward of a kbench-optimized LayerNorm, with nvidia-smi sampling clocks and power, and
the process's threads counted. benchmarks/NOTES.md, session 13, has what it showed.

    python benchmarks/slow_state_probe.py fast   # the budget passed to optimize()
"""
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import torch
import kbench
from kbench.bench import timing
from bench_ops import timed_fn

budget = sys.argv[1] if len(sys.argv) > 1 else "fast"
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 6.0
dev = "cuda"
torch.manual_seed(0)
model = torch.nn.LayerNorm(4096).to(dev, torch.bfloat16)
x = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
gout = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
opt = kbench.optimize(model, (x,), backend="cuda", budget=budget, verbose=False)
fb = timed_fn(opt, list(model.parameters()), [gout], True)

timing.flush_l2(dev, "read")
g = timing._capture(None, [()], dev, 16, "read", "the flushes")
g.replay()
torch.cuda.synchronize()


def flush_graph_ms():
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); g.replay(); b.record(); b.synchronize()
    return a.elapsed_time(b) / 17


smi_log = tempfile.NamedTemporaryFile("w+", suffix=".csv", delete=False).name
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,"
                        "temperature.memory,clocks_throttle_reasons.active", "--format=csv,noheader", "-lms", "50"],
                       stdout=open(smi_log, "w"), stderr=subprocess.DEVNULL)
time.sleep(0.5)
base = sorted(flush_graph_ms() for _ in range(20))
print(f"budget {budget}: flushes alone before, ms per flush: median {base[10]:.4f} min {base[0]:.4f} max {base[-1]:.4f}")
t0 = time.time()
fb(x)                      # the first forward+backward: builds (and searches) the backward
torch.cuda.synchronize()
print(f"first forward+backward: {time.time() - t0:.2f} s; threads {threading.active_count()} "
      f"(os: {len(os.listdir('/proc/self/task'))})")
t1 = time.time()
last = None
while time.time() - t1 < seconds:
    ms = flush_graph_ms()
    slow = ms > base[10] * 1.05
    if slow != last:
        print(f"  t={time.time() - t1:7.3f} s  {ms:.4f} ms  {'SLOW' if slow else 'normal'}  "
              f"threads {len(os.listdir('/proc/self/task'))}")
        last = slow
    time.sleep(0.005)
print(f"  t={time.time() - t1:7.3f} s  {flush_graph_ms():.4f} ms at the end")
# and with forward+backward calls in between, as the benchmark's per-call timing does
for i in range(5):
    for _ in range(50):
        fb(x)
    torch.cuda.synchronize()
    print(f"  after {50 * (i + 1)} more calls: flushes {flush_graph_ms():.4f} ms")
t = timing.time_fn(fb, [(x,)], device=dev, reps=50, warmup=10)
print(f"  per-call timing as the benchmark's: {t.median_ms:.4f} ms; then flushes {flush_graph_ms():.4f} ms")
gt = timing.time_graph(fb, [(x,)], device=dev, calls=16, reps=5)
print(f"  device timing as the benchmark's: {gt.median_ms:.4f} ms, its flushes {gt.flush_ms:.4f}; then flushes "
      f"{flush_graph_ms():.4f} ms")
smi.terminate()
smi.wait()
lines = open(smi_log).read().splitlines()
print(f"nvidia-smi, {len(lines)} samples; every 10th:")
for ln in lines[::10]:
    print("  ", ln)
