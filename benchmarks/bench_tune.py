#!/usr/bin/env python
"""Schedule search and kernel cache at model scale (GPU): a 12-block GPT-2-small-sized model
(768 wide, 12 heads, MLP 3072) tuned with budget="fast" on a cold cache, forward and backward
(one training step builds the backward kernels); then the same model optimized again in a new
process, which must load every kernel from the cache. Prints per-region searched vs default
times and writes benchmarks/results/tune-<gpu>-<date>-<commit>.json.

--devices 0,1 (or all) spreads the searches over those GPUs (optimize(devices=)); with
--vs-one-gpu a cold run on the model's GPU alone comes first, in a cache of its own, and the two
optimize times are compared (what item 4 of issue 35 measures: --budget default).

    python benchmarks/bench_tune.py [--blocks 12] [--batch 8] [--ctx 256] [--out DIR]
    python benchmarks/bench_tune.py --budget default --devices 0,1 --vs-one-gpu
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(blocks, dim=768, heads=12):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
            q, k, v = (z.reshape(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(blocks)])


class _Profile:
    """cProfile of named sections of one run, written as text to `path` (no-op without a path)."""

    def __init__(self, path):
        self.path, self.parts = path, []

    @contextlib.contextmanager
    def section(self, name):
        if not self.path:
            yield
            return
        import cProfile
        import io
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text)
            stats.sort_stats("cumulative").print_stats(45)
            stats.sort_stats("tottime").print_stats(25)
            self.parts.append(f"===== {name}\n{text.getvalue()}")

    def write(self):
        if self.path:
            Path(self.path).write_text("\n".join(self.parts))


def one_run(args) -> dict:
    """Optimize (and take one training step) in this process; what it cost and what it chose."""
    import torch

    import kbench
    model = build(args.blocks).cuda()
    x = torch.randn(args.batch, args.ctx, 768, device="cuda")
    torch.cuda.synchronize()
    profiler = _Profile(args.profile)
    t0 = time.perf_counter()
    with profiler.section("optimize()"):
        fast = kbench.optimize(model, (x,), budget=args.budget, verbose=False, devices=_devices(args.devices))
    t1 = time.perf_counter()
    xg = x.clone().requires_grad_(True)
    with profiler.section("first forward+backward"):
        fast(xg).square().mean().backward()       # builds (searches, compiles) the backward kernels
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    profiler.write()
    with torch.no_grad():
        err = ((fast(x) - model(x)).abs().max() / model(x).abs().max()).item()
    plan = fast._kbench_plan
    regions = []
    for info in plan.regions:
        if info.kind == "EXTERN":
            continue
        x_ = info.extra
        regions.append({"region": info.index, "kind": info.kind, "status": info.status.value, "genome": info.genome,
                        "cache": x_.get("cache"), "candidates": x_.get("candidates"),
                        "search_s": x_.get("search_s"), "default_ms": x_.get("default_ms"),
                        "best_ms": x_.get("best_ms"), "tuned_on": x_.get("tuned_on"),
                        "confirmed": x_.get("confirmed")})
    backward = []
    for prog in fast._kbench_backward.values():
        if prog is None:
            continue
        for info in prog.plan.regions:
            if info.kind != "EXTERN":
                x_ = info.extra
                backward.append({"kind": info.kind, "status": info.status.value, "cache": x_.get("cache"),
                                 "candidates": x_.get("candidates"), "default_ms": x_.get("default_ms"),
                                 "best_ms": x_.get("best_ms")})
    return {"optimize_s": t1 - t0, "forward_backward_s": t2 - t1, "max_rel_err": err,
            "capture": [n for n in fast.kbench_report.notes if n.startswith("capture:")],
            "bytecode": {"write": not sys.dont_write_bytecode, "prefix": sys.pycache_prefix},
            "regions": regions, "backward_regions": backward}


def _devices(text):
    """--devices: "" (None: the model's GPU), "all", or GPU indices "0,1"."""
    if not text:
        return None
    return text if text == "all" else [int(d) for d in text.split(",")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--budget", default="fast")
    p.add_argument("--devices", default="", help="GPUs the searches spread over: 'all' or '0,1' (default: "
                                                 "the model's GPU alone)")
    p.add_argument("--vs-one-gpu", action="store_true", help="also a cold run on one GPU (its own cache), compared")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--profile-warm", default=None, metavar="FILE",
                   help="profile the warm process's optimize() (cProfile, top entries written to FILE)")
    p.add_argument("--profile", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():   # one line, not a traceback from the child's .cuda()
        print("bench_tune.py: no CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    if args.child:
        print(json.dumps(one_run(args)))
        return 0
    from kbench.bench import results
    cache = tempfile.mkdtemp(prefix="kbench-tune-")
    env = dict(os.environ, KBENCH_CACHE_DIR=cache)
    # where site-packages is read-only (the GPU host's), Python recompiles torch's modules from
    # source in every process (~5 s of torch.export's imports); a writable bytecode cache makes
    # the warm process see what it sees on an ordinary install
    env.setdefault("PYTHONPYCACHEPREFIX", os.path.join(cache, "pycache"))
    env.pop("PYTHONDONTWRITEBYTECODE", None)   # set on the GPU host: then no process ever writes it
    child = [sys.executable, __file__, "--child", "--blocks", str(args.blocks), "--batch", str(args.batch),
             "--ctx", str(args.ctx), "--budget", args.budget]
    runs = []
    labels = (["cold-1gpu"] if args.vs_one_gpu and args.devices else []) + ["cold", "warm"]
    for label in labels:
        extra = ["--profile", args.profile_warm] if label == "warm" and args.profile_warm else []
        run_env = env
        if label == "cold-1gpu":   # a cold cache of its own: the next run must search everything again
            one = tempfile.mkdtemp(prefix="kbench-tune-1gpu-")
            run_env = dict(env, KBENCH_CACHE_DIR=one)
        else:
            extra += ["--devices", args.devices] if args.devices else []
        proc = subprocess.run(child + extra, env=run_env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return 1
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        run["label"] = label
        runs.append(run)
        print(f"{label}: optimize {run['optimize_s']:.1f} s, first forward+backward {run['forward_backward_s']:.1f} s, "
              f"max rel err {run['max_rel_err']:.1e}", flush=True)
    if args.vs_one_gpu and args.devices:
        one, many = runs[0], runs[1]
        where = sorted({r["tuned_on"] for r in many["regions"] if r.get("tuned_on")})
        same = sum(1 for a, b in zip(one["regions"], many["regions"]) if a["genome"] == b["genome"])
        print(f"\noptimize, budget {args.budget}: {one['optimize_s']:.1f} s on one GPU, {many['optimize_s']:.1f} s "
              f"with devices={args.devices} ({one['optimize_s'] / many['optimize_s']:.2f}×; searched on "
              f"{', '.join(where) or 'none'}); the same genome in {same}/{len(one['regions'])} forward regions; "
              f"max rel err {one['max_rel_err']:.1e} / {many['max_rel_err']:.1e}")
    cold, warm = runs[-2:]
    searched = [r for r in cold["regions"] + cold["backward_regions"] if r.get("candidates")]
    print(f"\n{len(cold['regions'])} forward regions, {len(cold['backward_regions'])} backward regions; "
          f"searched {len(searched)} distinct ones (the others are the same kernel)")
    print("| region | kind | candidates | default ms | searched ms | gain |")
    print("|---|---|---|---|---|---|")
    for r in searched:
        d, b = r.get("default_ms"), r.get("best_ms")
        gain = f"{d / b:.2f}×" if d and b else "—"
        print(f"| {r.get('region', 'bwd')} | {r['kind']} | {r['candidates']} | {d or float('nan'):.4f} | "
              f"{b or float('nan'):.4f} | {gain} |")
    hits = sum(1 for r in warm["regions"] if r["status"] == "kernel (cached)" or str(r["cache"]).startswith("same"))
    print(f"\nwarm process: {hits}/{len(warm['regions'])} forward regions from the cache; "
          f"optimize {warm['optimize_s']:.2f} s; {'; '.join(warm['capture'])}; bytecode {warm['bytecode']}")
    meta = results.metadata(torch.device("cuda"))
    doc = {"schema": "kbench-tune/1", "meta": meta, "options": vars(args), "runs": runs}
    path = results.write_json(results.results_path(args.out, meta, prefix="tune-"), doc)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
