#!/usr/bin/env python
"""GEMM benchmark: kbench's generated tensor-core kernel (csrc/codegen/gemm.c, the best of the
candidate genomes) against cuBLAS through torch, bf16 in, f32 accumulation, bf16 out:

    mm 4096^3, mm 8192^3        a @ b (b row-major)          vs torch.mm
    linear 8192x1024->4096      x @ w.T (w a Linear's weight) vs F.linear
    linear+bias+gelu_tanh       x [8192, 768] @ w.T [768 -> 3072], + bias, GELU(tanh) in the
                                kernel's epilogue            vs eager F.gelu(F.linear(x, w, b))

TFLOP/s count 2 M N K per call. Each implementation is timed with timing.time_fn (CUDA events
per call, L2 flushed between calls: docs/benchmarking.md), median of --reps calls; the generated
kernel's result is checked against torch's (norm-wise relative error in the JSON). Every
candidate genome is timed and the best is reported beside the default.

    python benchmarks/bench_gemm.py                # the table, about 30-60 s on an H100
    python benchmarks/bench_gemm.py --quick        # small sizes, few reps (smoke test)

Writes benchmarks/results/gemm-<gpu>-<date>-<commit>.json and prints a markdown table last.
Without a GPU it says so in one line and exits 1.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kbench.bench import results  # noqa: E402
from kbench.runtime import gemm as kg  # noqa: E402
from kbench.tune import timing  # noqa: E402

# name -> (M, N, K, kind, quick sizes)
CASES = {
    "mm 4096^3": (4096, 4096, 4096, "mm", (512, 512, 512)),
    "mm 8192^3": (8192, 8192, 8192, "mm", (1024, 1024, 1024)),
    "linear 8192x1024->4096": (8192, 4096, 1024, "linear", (1024, 512, 256)),
    "linear+bias+gelu_tanh 8192x768->3072": (8192, 3072, 768, "linear_gelu", (1024, 384, 256)),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, few reps (smoke test)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--reps", type=int, default=None, help="timed reps per implementation (default 30; quick 5)")
    p.add_argument("--genomes", type=int, default=6, help="candidate genomes timed per case (default 6)")
    a = p.parse_args(argv)
    a.reps = a.reps or (5 if a.quick else 30)
    a.warmup = 2 if a.quick else 5
    return a


def setup(M, N, K, kind):
    """(torch's callable, its args, the kwargs of kg.launcher beyond a and b) for one case."""
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = torch.bfloat16
    x = (torch.randn(M, K, device="cuda", generator=g) / K ** 0.25).to(dt)
    if kind == "mm":
        b = (torch.randn(K, N, device="cuda", generator=g) / K ** 0.25).to(dt)
        return torch.mm, (x, b), {}
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.25).to(dt)
    if kind == "linear":
        return F.linear, (x, w), {"b_transposed": True}
    bias = torch.randn(N, device="cuda", generator=g).to(dt)

    def eager(x, w, bias):
        return F.gelu(F.linear(x, w, bias), approximate="tanh")
    return eager, (x, w, bias), {"b_transposed": True, "bias": bias, "act": "gelu_tanh"}


def bench_case(name, M, N, K, kind, args) -> dict:
    torch_fn, xs, kw = setup(M, N, K, kind)
    flops = 2.0 * M * N * K
    row = {"case": name, "M": M, "N": N, "K": K, "kind": kind}
    t = timing.time_fn(torch_fn, [xs], device="cuda", reps=args.reps, warmup=args.warmup)
    row["torch_ms"] = t.median_ms
    ref = torch_fn(*xs).float()
    genomes = kg.genomes(M, N, K, 1, "cuda")[:args.genomes]
    kg.precompile(kg.operands(xs[0], xs[1], **kw).spec, genomes, "cuda")
    row["default_genome"] = list(genomes[0])
    row["genomes"] = []
    for genome in genomes:
        entry = {"genome": list(genome)}
        try:
            # bound once (checks, kernel, arguments): each timed call is an allocation and a launch
            run = kg.launcher(xs[0], xs[1], genome=genome, **kw)
            out = run()
            entry["rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
            entry["ms"] = timing.time_fn(run, [()], device="cuda", reps=args.reps, warmup=args.warmup).median_ms
        except Exception as e:  # noqa: BLE001 - one genome failing is a cell, not the run
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["genomes"].append(entry)
        print(f"  {name} {genome}: {entry.get('ms', float('nan')):.3f} ms  err {entry.get('rel_err', float('nan')):.2e}"
              f"{'  ' + entry['error'] if 'error' in entry else ''}", file=sys.stderr)
    timed = [e for e in row["genomes"] if "ms" in e]
    if timed:
        best = min(timed, key=lambda e: e["ms"])
        row.update(best_genome=best["genome"], best_ms=best["ms"], best_rel_err=best["rel_err"],
                   default_ms=row["genomes"][0].get("ms"))
        row["tflops_torch"] = flops / row["torch_ms"] / 1e9
        row["tflops_kbench"] = flops / best["ms"] / 1e9
        row["kbench_over_torch"] = row["torch_ms"] / best["ms"]
    return row


def table(rows) -> str:
    out = []
    for r in rows:
        g = r.get("best_genome")
        out.append([r["case"], results.fmt(r.get("torch_ms"), ".3f"), results.fmt(r.get("best_ms"), ".3f"),
                    results.fmt(r.get("tflops_torch"), ".0f"), results.fmt(r.get("tflops_kbench"), ".0f"),
                    results.fmt(r.get("kbench_over_torch"), ".2f") + "×",
                    "x".join(map(str, g[:3])) + f" w{g[3]}x{g[4]} s{g[5]} b{g[6]}" if g else "—",
                    results.fmt(r.get("best_rel_err"), ".1e")])
    return results.markdown_table(["case", "torch ms", "kbench ms", "torch TFLOP/s", "kbench TFLOP/s",
                                   "kbench / torch speed", "best genome", "rel err"], out)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm.py: no CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    torch.backends.cuda.matmul.allow_tf32 = False
    meta = results.metadata("cuda")
    print(f"device {meta['gpu']}; torch {meta['torch']}", file=sys.stderr)
    path = results.results_path(args.out, meta, prefix="gemm-")
    rows = []
    for name, (M, N, K, kind, quick) in CASES.items():
        if args.quick:
            M, N, K = quick
        rows.append(bench_case(name, M, N, K, kind, args))
        results.write_json(path, {"schema": "kbench-bench-gemm/1", "meta": meta,
                                  "options": {"quick": args.quick, "reps": args.reps, "warmup": args.warmup,
                                              "genomes": args.genomes, "dtype": "bfloat16", "tf32": False},
                                  "total_s": time.perf_counter() - t0, "rows": rows})
    print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
