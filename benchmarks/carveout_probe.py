#!/usr/bin/env python
"""Does the kernel before a graph set how fast the graph runs (GPU)? The L2 flushes alone, kbench's
and torch.compile's LayerNorm bf16 forward, each graph replayed right after a matmul (a kernel with
a large shared-memory carveout), a small add, or kbench's forward+backward.
benchmarks/NOTES.md, session 13, has what it showed (no: the flushes ran bimodal, 0.665 or 0.77 ms,
whatever came first).

    python benchmarks/carveout_probe.py
"""
import torch, kbench
from kbench.bench import timing
dev = "cuda"
a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
x = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
small = torch.randn(1024, device=dev)
ln = torch.nn.LayerNorm(4096).to(dev, torch.bfloat16)
opt = kbench.optimize(ln, (x,), backend="cuda", budget="none", verbose=False)
comp = torch.compile(ln)
with torch.no_grad():
    opt(x); comp(x); comp(x); a @ a
timing.flush_l2(dev, "read")
def cap(fn):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    return g
import sys; sys.path.insert(0, "benchmarks")
from bench_ops import timed_fn
xg = x.clone().requires_grad_()
gout = torch.randn_like(x)
fb = timed_fn(opt, list(ln.parameters()), [gout], True)
side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):
        fb(xg)
torch.cuda.current_stream().wait_stream(side)
prev = {"matmul (big smem)": cap(lambda: a @ a), "small add": cap(lambda: small.add_(1.0)),
        "kbench LN fwd+bwd": cap(lambda: fb(xg))}
def flushes():
    for _ in range(16):
        timing.flush_l2(dev, "read")
def kb():
    with torch.no_grad():
        for _ in range(8):
            timing.flush_l2(dev, "read"); opt(x)
def co():
    with torch.no_grad():
        for _ in range(8):
            timing.flush_l2(dev, "read"); comp(x)
tests = {"16 read flushes": cap(flushes), "8x (flush + kbench LN fwd)": cap(kb), "8x (flush + compile LN fwd)": cap(co)}
for tname, tg in tests.items():
    for pname, pg in prev.items():
        ts = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            pg.replay(); s.record(); tg.replay(); e.record(); e.synchronize()
            ts.append(s.elapsed_time(e))
        ts.sort()
        print(f"{tname:30s} after {pname:20s}: {ts[10]:.4f} ms (min {ts[0]:.4f})")
