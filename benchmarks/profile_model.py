#!/usr/bin/env python
"""Where a zoo model's step spends its time (GPU): eager, kbench (the optimized module itself, the
model gate off, so it runs even where the gate would run the original) and optionally
torch.compile, each profiled over a few steps with torch.profiler. Per implementation: the step's
wall time, the GPU's busy time (kernels and copies, overlaps merged), the gap between them (host
time the GPU waited for), kernels per step, and the GPU time by kind of kernel (kbench's
generated kernels, GEMMs, convolutions, attention, torch's elementwise/reduction kernels,
copies, ...) with the top kernels by name and the torch ops behind them by input shape. Writes <out>/profile-<model>-<mode>-<dtype>-<gpu>-<date>-<commit>.{json,md}.

    python benchmarks/profile_model.py --model gpt2 [--mode train] [--dtype bf16]
                                       [--impls eager,kbench,compile] [--steps 5] [--top 12] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# (kind, pattern over the kernel's name): the first that matches names its kind
KINDS = [
    ("kbench", r"^kb_r\d+_"),
    ("attention", r"flash|fmha|attention|sdpa|efficient_attention"),
    ("gemm", r"gemm|cutlass|xmma|cublas|s\d+gemm|sm\d+_.*_(tn|nt|nn|tt)|ampere_|hopper_|nvjet|splitK"),
    ("conv", r"conv|cudnn|implicit_gemm|winograd|fft"),
    ("norm", r"batch_norm|layer_norm|group_norm|bn_|welford|rms_norm"),
    ("softmax / loss", r"softmax|nll_loss|cross_entropy|log_softmax"),
    ("reduce", r"reduce_kernel|reduction"),
    ("copy", r"^Memcpy|^Memset|copy_kernel|CatArrayBatched|cat_|direct_copy|index_put|scatter|gather"),
    ("elementwise", r"elementwise|vectorized_|unrolled_|pointwise"),
    ("triton", r"^triton_"),
]


def kind_of(name: str) -> str:
    for kind, pat in KINDS:
        if re.search(pat, name, re.IGNORECASE):
            return kind
    return "other"


def busy_ms(spans) -> float:
    """The union of (start, end) intervals (µs), in ms: overlapping kernels counted once."""
    total, end = 0.0, None
    for s, e in sorted(spans):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def summarize(events, steps: int, wall_ms: float, top: int) -> dict:
    """events: (name, start µs, duration µs) of the GPU's kernels and copies over `steps` steps
    that took wall_ms each: the per-step summary."""
    by_kind, by_name = {}, {}
    for name, _, dur in events:
        k = kind_of(name)
        by_kind[k] = by_kind.get(k, 0.0) + dur
        n = by_name.setdefault(name, [0.0, 0])
        n[0] += dur
        n[1] += 1
    gpu = busy_ms([(s, s + d) for _, s, d in events]) / steps
    names = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"wall_ms": wall_ms, "gpu_busy_ms": gpu, "gpu_idle_ms": max(0.0, wall_ms - gpu),
            "kernels_per_step": len(events) / steps,
            "by_kind_ms": {k: v / 1e3 / steps for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:120], "kind": kind_of(n), "ms": t / 1e3 / steps, "calls": c / steps}
                    for n, (t, c) in names]}


def table(model, mode, dtype, results: dict) -> str:
    impls = list(results)
    lines = [f"## {model} {mode} {dtype}: per step", "",
             "| | " + " | ".join(impls) + " |", "|---|" + "---|" * len(impls)]
    for key, label in (("wall_ms", "wall ms"), ("gpu_busy_ms", "GPU busy ms"), ("gpu_idle_ms", "GPU idle ms"),
                       ("kernels_per_step", "kernels")):
        lines.append(f"| {label} | " + " | ".join(f"{results[i].get(key, float('nan')):.2f}" for i in impls) + " |")
    kinds = sorted({k for r in results.values() for k in r.get("by_kind_ms", {})},
                   key=lambda k: -max(r.get("by_kind_ms", {}).get(k, 0.0) for r in results.values()))
    for k in kinds:
        lines.append(f"| {k} ms | " + " | ".join(f"{results[i].get('by_kind_ms', {}).get(k, 0.0):.2f}"
                                                 for i in impls) + " |")
    for impl, r in results.items():
        if "error" in r:
            lines += ["", f"{impl}: {r['error']}"]
            continue
        lines += ["", f"### {impl}: top kernels", "", "| ms | calls | kind | kernel |", "|---|---|---|---|"]
        lines += [f"| {t['ms']:.3f} | {t['calls']:.0f} | {t['kind']} | `{t['name']}` |" for t in r["top"]]
        if r.get("torch_ops"):
            lines += ["", f"### {impl}: torch ops by input shape", "", "| ms | calls | op | input shapes |",
                      "|---|---|---|---|"]
            lines += [f"| {t['ms']:.3f} | {t['calls']:.0f} | {t['op']} | `{t['shapes']}` |" for t in r["torch_ops"]]
        if r.get("notes"):
            lines += [""] + [f"- {n}" for n in r["notes"]]
    return "\n".join(lines) + "\n"


def profile(case, module, steps: int, top: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile as tprofile
    from kbench.runtime import graphs
    for _ in range(graphs.WARMUP + 3):   # past kbench's CUDA-graph warm-up and capture
        case.step(module)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        case.step(module)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(steps):
            case.step(module)
        torch.cuda.synchronize()
    events = [(e.name, e.time_range.start, e.time_range.end - e.time_range.start)
              for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    out = summarize(events, steps, wall, top)
    # the torch ops behind the GPU time, by input shape (a graph replay's kernels have none)
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.key.startswith("aten::") and e.self_device_time_total > 0]
    out["torch_ops"] = [{"op": e.key, "shapes": str(e.input_shapes)[:160], "calls": e.count / steps,
                         "ms": e.self_device_time_total / 1e3 / steps}
                        for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:top]]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a zoo name (tests/models/zoo.py)")
    p.add_argument("--mode", default="train", choices=("infer", "train"))
    p.add_argument("--dtype", default="bf16", choices=("f32", "bf16"))
    p.add_argument("--impls", default="eager,kbench", help="of eager, kbench, kbench-ungraphed (CUDA graphs off), compile")
    p.add_argument("--budget", default="fast")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("profile_model.py: no CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    import bench_models

    import kbench
    zoo = bench_models.load_zoo()
    if args.model not in zoo.BY_NAME:
        print(f"profile_model.py: unknown model {args.model!r}; the zoo has {sorted(zoo.BY_NAME)}", file=sys.stderr)
        return 2
    case = bench_models.Case(zoo, args.model, args.mode, args.dtype)
    results = {}
    for impl in [i for i in args.impls.split(",") if i]:
        try:
            notes = []
            if impl == "eager":
                module = case.model
            elif impl == "compile":
                module = torch.compile(case.model)
            elif impl in ("kbench", "kbench-ungraphed"):   # ungraphed: the torch ops a replay hides
                with case.autocast():
                    module = kbench.optimize(case.model, case.args, case.kwargs, budget=args.budget, gate=False,
                                             verbose=False, cuda_graphs=impl == "kbench" and "auto")
                report = module.kbench_report
                notes = [f"{len(report.rows)} regions, {report.kernels} kernels"] + \
                        [n for n in report.notes if n.startswith(("fallback", "cuda graphs", "capture"))][:8]
            else:
                raise ValueError(f"unknown implementation {impl!r}")
            results[impl] = profile(case, module, args.steps, args.top)
            results[impl]["notes"] = notes
        except Exception as e:  # noqa: BLE001 - recorded, the other implementations still run
            results[impl] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        print(f"{impl}: {results[impl].get('wall_ms', float('nan')):.2f} ms/step", flush=True)
    gpu = torch.cuda.get_device_name().replace(" ", "-")
    commit = os.environ.get("KBENCH_COMMIT", "unknown")
    stem = Path(args.out) / f"profile-{args.model}-{args.mode}-{args.dtype}-{gpu}-{time.strftime('%Y%m%d-%H%M%S')}-{commit}"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    md = table(args.model, args.mode, args.dtype, results)
    stem.with_suffix(".json").write_text(json.dumps({"schema": "kbench-profile-1", "model": args.model,
                                                     "mode": args.mode, "dtype": args.dtype,
                                                     "gpu": torch.cuda.get_device_name(), "commit": commit,
                                                     "results": results}, indent=1))
    stem.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
