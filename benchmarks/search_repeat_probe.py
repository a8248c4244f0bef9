#!/usr/bin/env python
"""Repeat one region's search with the same seed and show what its decisions saw: per search, the
finalists, their rounds and standings, and each one's paired median ratio (and interval) over the
default. Tells threshold noise (the ratio moves within its interval) from a level that moves
between searches (intervals that do not overlap).

    python benchmarks/search_repeat_probe.py --model layernorm --dtype bfloat16 --repeats 6
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kbench  # noqa: E402
from kbench import search  # noqa: E402


class Softmax(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=-1)


MODELS = {   # the shapes of tests/gpu/test_search.py
    "layernorm": (lambda: nn.LayerNorm(768), (16384, 768)),
    "layernorm_4096": (lambda: nn.LayerNorm(4096), (4096, 4096)),
    "softmax": (Softmax, (8192, 1000)),
}


def row_region(factory, shape, dtype):
    """(executor, example sizes, region) of the first ROW region of factory()'s model optimized at
    shape and dtype without a search (the probes time that region's kernels themselves)."""
    torch.manual_seed(0)
    model = factory().to(dtype).cuda().eval()
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    fast = kbench.optimize(model, (x,), backend="cuda", budget="none", verbose=False)
    ex, plan = fast._kbench_executor, fast._kbench_plan
    return ex, list(plan.captured.example_symvals), [i.index for i in plan.regions if i.kind == "ROW"][0]


def sm_clock(fields="clocks.sm"):
    import subprocess
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


CLOCKS = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_event_reasons.active"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="layernorm")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--budget", default="fast")
    ap.add_argument("--warm", type=float, default=0.0,
                    help="seconds of the default kernel run before the finalists' rounds (clocks up)")
    ap.add_argument("--reuse-bench", action="store_true",
                    help="every search times on the first search's buffers (tells placement from time)")
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    factory, shape = MODELS[a.model]
    ex, symvals, r = row_region(factory, shape, dtype)

    seen = {}
    orig = search._Search.standings

    def standings(self, names, samples):   # keep the last samples each search decided on
        seen["names"], seen["samples"], seen["default"] = list(names), samples, self.default_genome
        return orig(self, names, samples)

    search._Search.standings = standings
    retime = search._Search.retime

    def warm_retime(self, names):
        import time
        k, t = self.kernels.get(self.default_genome), time.perf_counter()
        while k is not None and time.perf_counter() - t < a.warm:
            self.bench.time(k, 20, warmup=0)
        seen["clock0"] = sm_clock(CLOCKS)
        seen["bench"] = self.bench
        return retime(self, names)

    search._Search.retime = warm_retime
    winners = []
    print(f"{a.model} {shape} {a.dtype} region {r}, budget {a.budget}, seed 0")
    bench = search.CudaRegionBench(ex, r, symvals) if a.reuse_bench else None
    for i in range(a.repeats):
        res = search.search_region(ex, r, symvals, budget=a.budget, seed=0, bench=bench)
        winners.append(res.best_genome)
        names, samples, d = seen["names"], seen["samples"], seen["default"]
        by = {c["genome"]: c for c in res.candidates}
        bench_used = seen["bench"]
        arena = bench_used.arena.data_ptr() % (1 << 40) if getattr(bench_used.arena, "data_ptr", None) else 0
        print(f"search {i}: winner {res.best_genome!r} ({res.seconds:.1f} s; clocks {seen.get('clock0')} "
              f"at the rounds' start, {sm_clock(CLOCKS)} after; arena at {arena:#x}, "
              f"flush at {bench_used.flush.data_ptr() % (1 << 40):#x})")
        for g in names:
            c = by[g]
            lo, hi = search._ratio_interval(samples[g], samples[d]) if g != d else (1.0, 1.0)
            common = samples[g].keys() & samples[d].keys()
            med = statistics.median(samples[g][k] / samples[d][k] for k in common) if g != d and common else 1.0
            print(f"  {'D' if g == d else ' '}{'W' if g == res.best_genome else ' '} {c['tie']:<28} "
                  f"rounds {c['final_rounds']:4d}  {c['final_ms'] * 1e3:7.2f} us  /default {med:.4f} "
                  f"[{lo:.4f}, {hi:.4f}]  gen {c['time_ms'] * 1e3:7.2f} us  {g}")
            if g != d and len(common) > 40:   # does the ratio drift over the rounds?
                ks = sorted(common)
                parts = [ks[:20], ks[20:60], ks[60:200], ks[200:]]
                print("      by rounds " + "  ".join(
                    f"{p[0]}-{p[-1]}: {statistics.median(samples[g][k] / samples[d][k] for k in p):.4f}"
                    for p in parts if p))
    print("distinct winners:", len(set(winners)), "of", len(winners))


if __name__ == "__main__":
    main()
