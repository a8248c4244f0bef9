#!/usr/bin/env python
"""The floor under kbench's per-call host time (GPU machine): what the pieces a region call is
made of cost on this host, timed without a profiler (perf_counter loops, no sync inside), next to
eager LayerNorm and kbench's LayerNorm (kbench._fast's C++ node, and the Python path) at a size
where the GPU work is negligible. Then the forward's host time per call (kbench.bench.timing's
host_overhead_us, the issue's measure) of LayerNorm f32 and residual LayerNorm f32 on tiny
inputs with the call's prologue in C++ (kbench._fast.Program) and in Python (runtime.py's
forward and _run, the same kbench._fast launches and nodes), without and with gradients.

    python benchmarks/host_floor.py --shape 64,4096 --dtype bfloat16
    python benchmarks/host_floor.py --prologue-only
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kbench  # noqa: E402
from kbench.bench.tasks import parse_dtype  # noqa: E402


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


class Nop(torch.autograd.Function):
    """The least a Python autograd node doing a region's allocations can cost: one output in the
    forward, three gradients in the backward, no kernels."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w, b)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, g):
        x, w, b = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="64,4096")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prologue-only", action="store_true", help="only the C++ vs Python prologue rows")
    ap.add_argument("--prologue-shape", default="8,1024", help="the tiny inputs of the prologue rows")
    a = ap.parse_args(argv)
    if not a.prologue_only:
        floor(a)
    prologue(tuple(int(s) for s in a.prologue_shape.split(",")))


def floor(a):
    shape = tuple(int(s) for s in a.shape.split(","))
    dtype, dev = parse_dtype(a.dtype), "cuda"
    model = torch.nn.LayerNorm(shape[-1]).to(dtype).to(dev)
    x = torch.randn(shape, dtype=dtype, device=dev)
    opt = kbench.optimize(model, (x,), backend="cuda", budget="none", verbose=False)
    xg = x.clone().requires_grad_()
    gy = torch.randn_like(x)
    w, b = model.weight, model.bias
    opt(xg).backward(gy)   # bind at this size with kbench._fast, before the Python-path twin
    from kbench import cuda_backend
    fast_module, cuda_backend._fast = cuda_backend._fast, None
    slow = kbench.optimize(model, (x,), backend="cuda", budget="none", verbose=False)
    slow(xg).backward(gy)
    cuda_backend._fast = fast_module

    def nograd(f):
        def run():
            with torch.no_grad():
                f(x)
        return run

    rows = [
        ("torch.empty(shape, dtype, device)", lambda: torch.empty(shape, dtype=dtype, device=dev)),
        ("torch.empty_like(x)", lambda: torch.empty_like(x)),
        ("x.add_(0) (one tiny kernel)", lambda: x.add_(0)),
        ("eager LayerNorm forward, no grad", nograd(model)),
        ("kbench LayerNorm forward, no grad", nograd(opt)),
        ("eager LayerNorm forward with grad", lambda: model(xg)),
        ("kbench LayerNorm forward with grad", lambda: opt(xg)),
        ("Nop Function forward+backward", lambda: Nop.apply(xg, w, b).backward(gy)),
        ("eager LayerNorm forward+backward", lambda: model(xg).backward(gy)),
        ("kbench LayerNorm forward+backward", lambda: opt(xg).backward(gy)),
        ("kbench (Python path) forward, no grad", nograd(slow)),
        ("kbench (Python path) forward+backward", lambda: slow(xg).backward(gy)),
        ("Nop autograd.grad", lambda: torch.autograd.grad(Nop.apply(xg, w, b), [xg, w, b], gy)),
        ("eager autograd.grad", lambda: torch.autograd.grad(model(xg), [xg, w, b], gy)),
        ("kbench autograd.grad", lambda: torch.autograd.grad(opt(xg), [xg, w, b], gy)),
        ("kbench (Python path) autograd.grad", lambda: torch.autograd.grad(slow(xg), [xg, w, b], gy)),
    ]
    for name, fn in rows:
        on = per_call_us(fn)
        gc.disable()
        off = per_call_us(fn)
        gc.enable()
        print(f"{name:<40} {on:8.1f} us   (gc off {off:8.1f} us)", flush=True)
    where_time(slow, lambda: slow(xg).backward(gy))


def prologue(shape, calls=2000, repeats=5):
    """Forward host us per call, the prologue in C++ (kbench._fast.Program) vs in Python (the
    same module with its Program switched off), for LayerNorm f32 and residual LayerNorm f32."""
    from kbench.bench import timing
    from kbench.bench.tasks.residual_layer_norm import Model as ResidualLayerNorm

    dev = "cuda"
    torch.manual_seed(0)
    cases = [("LayerNorm f32", torch.nn.LayerNorm(shape[-1]), 1),
             ("residual LayerNorm f32", ResidualLayerNorm(shape[-1]), 2)]
    print(f"\nforward host time per call at {shape} (host_overhead_us: {calls} calls, no sync, best of {repeats})")
    for name, model, nin in cases:
        model = model.to(dev)
        xs = [torch.randn(shape, device=dev) for _ in range(nin)]
        opt = kbench.optimize(model, tuple(xs), backend="cuda", budget="none", verbose=False)
        program = opt._kbench_fast_program
        if program is None:
            print(f"{name}: no kbench._fast.Program (KBENCH_FAST=0 or not built)")
            continue
        opt(*xs)   # binds the signature
        xg = [x.clone().requires_grad_() for x in xs]

        def host_us(fn, args, cpp):
            opt.__dict__["_kbench_fast_program"] = program if cpp else None
            try:
                return min(timing.host_overhead_us(fn, args, calls=calls, device=torch.device(dev))
                           for _ in range(repeats))
            finally:
                opt.__dict__["_kbench_fast_program"] = program

        def nograd(f):
            def run(*args):
                with torch.no_grad():
                    return f(*args)
            return run

        served = program.served
        rows = [("no grad", nograd(opt), xs), ("with grad", opt, xg)]
        for mode, fn, args in rows:
            eager = min(timing.host_overhead_us(nograd(model) if mode == "no grad" else model, args, calls=calls,
                                                device=torch.device(dev)) for _ in range(repeats))
            cpp, py = host_us(fn, args, True), host_us(fn, args, False)
            print(f"{name:<24} {mode:<10} eager {eager:7.1f} us   kbench C++ prologue {cpp:7.1f} us   "
                  f"Python prologue {py:7.1f} us", flush=True)
        if program.served == served:
            print(f"  (the Program served none of these calls: {program.why})")


def where_time(opt, fn, n=2000):
    """Where a kbench forward+backward's host time goes on the Python path (KBENCH_FAST=0): inside RegionFunction.forward and
    .backward (kbench's Python and what it calls) versus outside them (autograd's engine,
    handing the backward to its device thread and back)."""
    from kbench import runtime

    spent = {"forward": 0.0, "backward": 0.0, "launch (backward)": 0.0}
    fwd, bwd = runtime.RegionFunction.forward, runtime.RegionFunction.backward

    def timed(key, f):
        def run(*a):
            t = time.perf_counter()
            try:
                return f(*a)
            finally:
                spent[key] += time.perf_counter() - t
        return run

    runtime.RegionFunction.forward = staticmethod(timed("forward", fwd))
    runtime.RegionFunction.backward = staticmethod(timed("backward", bwd))
    steps = [st for b in opt._kbench_sigs.values() for s in b.steps for st in s.backward.values() if st]
    for bound in steps:
        for st in bound.steps:
            st.launch = timed("launch (backward)", st.launch)
    try:
        for _ in range(50):   # warm-up, then the timed loop starts from zero
            fn()
        torch.cuda.synchronize()
        for k in spent:
            spent[k] = 0.0
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        total = (time.perf_counter() - t) / n
    finally:
        runtime.RegionFunction.forward, runtime.RegionFunction.backward = staticmethod(fwd), staticmethod(bwd)
    print(f"kbench forward+backward {total * 1e6:.1f} us per call: " +
          ", ".join(f"in {k} {v / n * 1e6:.1f} us" for k, v in spent.items()) +
          f", elsewhere {(total - (spent['forward'] + spent['backward']) / n) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
