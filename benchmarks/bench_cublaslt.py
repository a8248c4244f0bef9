#!/usr/bin/env python
"""cuBLASLt's fused epilogues against eager and torch.compile: Linear + bias + GELU (tanh) in bf16
at a transformer MLP's shapes, forward and backward.

Forward, y = gelu_tanh(x·wᵀ + b):
  lt        cuBLASLt GELU_AUX_BIAS (one GEMM; writes y and the pre-activation h a backward needs)
  lt_noaux  cuBLASLt GELU_BIAS (inference: y only)
  eager     F.gelu(F.linear(x, w, b), approximate="tanh")
  compile   torch.compile of the same function
Backward of that layer, the gradient arriving through the next layer (z = y·w2ᵀ, given dz):
  lt        DGELU_BGRAD (dH = (dz·w2)·gelu'(h) and db in one GEMM), then dX = dH·w, dW = dHᵀ·x
  eager     torch.autograd.grad of the eager forward for (x, w, b) (w2 frozen)

    python benchmarks/bench_cublaslt.py                 # about 40 s on an H100
    python benchmarks/bench_cublaslt.py --impls lt,eager --reps 20

Times are CUDA events per call (kbench.tune.timing.time_fn: L2 flushed between calls), median of
--reps. Each cell records its largest difference from eager's result relative to eager's largest
magnitude. Writes benchmarks/results/cublaslt-<gpu>-<date>-<commit>.json and prints a markdown table.
Without a GPU it says so and exits 1.
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
from kbench.runtime import cublaslt  # noqa: E402
from kbench.tune import timing  # noqa: E402

# (tokens M, in features K, out features N)
SHAPES = [(8192, 768, 3072), (8192, 3072, 768), (4096, 4096, 11008)]
IMPLS = ("lt", "lt_noaux", "eager", "compile")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", default=",".join(IMPLS), help="subset of " + ",".join(IMPLS))
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--no-backward", dest="backward", action="store_false")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = p.parse_args(argv)
    a.impls = [i for i in a.impls.split(",") if i]
    return a


def eager_fwd(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def rel_diff(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


def ms(fn, args, dev, reps) -> float:
    return timing.time_fn(fn, [args], device=dev, reps=reps, warmup=5).median_ms


def bench_shape(m, k, n, args, dev):
    torch.manual_seed(0)
    bf = dict(device=dev, dtype=torch.bfloat16)
    x, w, b = torch.randn(m, k, **bf), torch.randn(n, k, **bf) * k ** -0.5, torch.randn(n, **bf)
    w2, dz = torch.randn(k, n, **bf) * n ** -0.5, torch.randn(m, k, **bf)
    flops = 2 * m * n * k
    row = {"shape": {"M": m, "K": k, "N": n}, "forward": {}, "backward": {}}
    want = eager_fwd(x, w, b)
    fwd = {
        "lt": lambda x, w, b: cublaslt.matmul(x, w, b_transposed=True, bias=b, epilogue="gelu_aux_bias")[0],
        "lt_noaux": lambda x, w, b: cublaslt.matmul(x, w, b_transposed=True, bias=b, epilogue="gelu_bias"),
        "eager": eager_fwd,
        "compile": torch.compile(eager_fwd, dynamic=False) if "compile" in args.impls else None,
    }
    for name in args.impls:
        try:
            t = ms(fwd[name], (x, w, b), dev, args.reps)
            row["forward"][name] = {"median_ms": t, "tflops": flops / t / 1e9,
                                    "rel_diff_vs_eager": rel_diff(fwd[name](x, w, b), want)}
        except Exception as e:  # noqa: BLE001 - one failing cell is recorded, the rest still run
            row["forward"][name] = {"error": f"{type(e).__name__}: {e}"}
    if not args.backward:
        return row

    # backward: the gradient of y·w2ᵀ arriving as dz; dx, dw, db of the GELU layer
    xg, wg, bg = (t.detach().clone().requires_grad_() for t in (x, w, b))
    z = eager_fwd(xg, wg, bg) @ w2.t()
    _, h = cublaslt.matmul(x, w, b_transposed=True, bias=b, epilogue="gelu_aux_bias")

    def eager_bwd(dz):
        return torch.autograd.grad(z, (xg, wg, bg), dz, retain_graph=True)

    def lt_bwd(dz):
        dh, db = cublaslt.matmul(dz, w2, b_transposed=False, epilogue="dgelu_bgrad", aux=h)
        return (cublaslt.matmul(dh, w, b_transposed=False), cublaslt.matmul(dh.t(), x, b_transposed=False), db)

    ref = eager_bwd(dz)
    bwd_flops = 3 * flops   # dz·w2, then dX and dW: three GEMMs of the forward's size
    for name, fn in (("lt", lt_bwd), ("eager", eager_bwd)):
        if name not in args.impls:
            continue
        try:
            t = ms(fn, (dz,), dev, args.reps)
            got = fn(dz)
            row["backward"][name] = {"median_ms": t, "tflops": bwd_flops / t / 1e9,
                                     "rel_diff_vs_eager": {g: rel_diff(a, r) for g, a, r in zip("xwb", got, ref)}}
        except Exception as e:  # noqa: BLE001
            row["backward"][name] = {"error": f"{type(e).__name__}: {e}"}
    return row


def table(rows, impls):
    def cell(c):
        return f"{c['median_ms']:.3f}" if "median_ms" in c else "err"
    head = ["M×K→N"] + [f"fwd {i} ms" for i in impls] + [f"bwd {i} ms" for i in ("lt", "eager") if i in impls]
    body = []
    for r in rows:
        s = r["shape"]
        body.append([f"{s['M']}×{s['K']}→{s['N']}"] + [cell(r["forward"].get(i, {})) for i in impls]
                    + [cell(r["backward"].get(i, {})) for i in ("lt", "eager") if i in impls])
    return results.markdown_table(head, body)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cublaslt.py: no CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    ok, why = cublaslt.available()
    if not ok:
        print(f"bench_cublaslt.py: {why}", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    meta = results.metadata(dev)
    meta["cublaslt"] = why
    t0 = time.perf_counter()
    rows = []
    path = results.results_path(args.out, meta, prefix="cublaslt-")
    for m, k, n in SHAPES:
        rows.append(bench_shape(m, k, n, args, dev))
        results.write_json(path, {"schema": "kbench-bench-cublaslt/1", "meta": meta,
                                  "options": {"impls": args.impls, "reps": args.reps, "backward": args.backward,
                                              "timing": "cuda-events per call, L2 flushed, median"},
                                  "total_s": time.perf_counter() - t0, "rows": rows})
    print(table(rows, args.impls))
    print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
