#!/usr/bin/env python
"""Does the device-time column depend on how the L2 is flushed between the calls of its graph (GPU)?
For each task: eager, torch.compile and kbench forward+backward (and forward), and a copy of the
task's bytes, timed by timing.time_graph with a written flush (zeroing twice the L2) and with a
read one (summing it), alternated twice; then kbench's kernels in one replay of each graph.
benchmarks/NOTES.md, session 13, has what it showed.

    python benchmarks/flush_kind_probe.py bias_gelu_tanh:bfloat16 layer_norm:bfloat16
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

dev = "cuda"
copy = timing.copy_bandwidth(dev, 1 << 30)["bytes_per_s"]
print(f"copy (per call, written flush) {copy / 1e9:.0f} GB/s")


def kernels(tfn, arg_sets, kind, n=8):
    timing._warm_on_side_stream(tfn, arg_sets, dev, 2, kind)
    g = timing._capture(tfn, arg_sets, dev, 4, kind, "x")
    g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    ks = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                key=lambda e: e.time_range.start)
    del g
    return " ".join(f"{e.name[:10]}:{e.device_time:.0f}" for e in ks[:n])


def graph_ms(tfn, arg_sets, kind):
    return timing.time_graph(tfn, arg_sets, device=dev, calls=16, reps=5, flush_kind=kind).median_ms


for spec in sys.argv[1:]:
    op, dt = spec.split(":")
    dtype = parse_dtype(dt)
    task, cfg, model, params, arg_sets, gouts = probe_setup(op, dtype, dev)
    built = {name: build_impl(name, model, arg_sets[0], dev, "fast")[0] for name in ("eager", "compile", "kbench")}
    for backward in (True, False):
        nbytes = task.bytes_moved(cfg, dtype, backward)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        fns = {"copy": lambda *a: dst.copy_(src)}
        fns.update({name: timed_fn(fn, params, gouts, backward) for name, fn in built.items()})
        mode = "fwdbwd" if backward else "fwd"
        for name, tfn in fns.items():
            res = {"write": [], "read": []}
            for _ in range(2):
                for kind in ("write", "read"):
                    res[kind].append(graph_ms(tfn, arg_sets, kind))
            w, r = min(res["write"]), min(res["read"])
            print(f"{op} {dt} {mode} {name:8s} written {w:.4f} ms ({nbytes / w / 1e-3 / copy:.1%})  "
                  f"read {r:.4f} ms ({nbytes / r / 1e-3 / copy:.1%})  read/written {r / w:.3f}  "
                  f"[{' '.join(f'{v:.4f}' for v in res['write'])} | {' '.join(f'{v:.4f}' for v in res['read'])}]")
            if name == "kbench" or (name == "compile" and backward):
                for kind in ("write", "read"):
                    print(f"    kernels, {kind} flush: {kernels(tfn, arg_sets, kind)}")
        del src, dst, fns
    del built, model, arg_sets
    torch._dynamo.reset()
    torch.cuda.empty_cache()
