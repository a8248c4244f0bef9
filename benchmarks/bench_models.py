#!/usr/bin/env python
"""Whole models (GPU): the zoo (tests/models/zoo.py at its "real" size: Hugging Face GPT-2, BERT,
Mistral, torchvision ResNet-50 and MobileNetV3, timm ViT, MNIST MLP and CNN, a U-Net), each in
inference and as a training step (forward, loss, backward), in f32 and under autocast bf16;
eager, torch.compile (default, and reduce-overhead with --compile-modes) and kbench timed in the
same process on the same GPU, per call (CUDA events around each call, L2 flushed) and, for
inference, in device time (the calls replayed from a CUDA graph); peak memory of one call;
kbench's optimize time on a cold cache and again from the cache; kbench's outputs and gradients
against eager's. Writes <out>/models-<gpu>-<date>-<commit>.{json,md} after every row (a run that
stops can be resumed with --resume) and a chart.

    python benchmarks/bench_models.py [--models gpt2,resnet50] [--modes infer,train]
                                      [--dtypes f32,bf16] [--compile-modes default,reduce-overhead]
                                      [--budget fast] [--reps 20] [--out DIR] [--resume FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("infer", "train")
ROUNDS = 5   # interleaved timing rounds per row
DTYPES = ("f32", "bf16")
DTYPE_NAMES = {"f32": "f32", "float32": "f32", "fp32": "f32", "bf16": "bf16", "bfloat16": "bf16"}


def load_zoo():
    spec = importlib.util.spec_from_file_location("kbench_zoo", ROOT / "tests" / "models" / "zoo.py")
    zoo = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = zoo   # dataclasses look their module up there (Python 3.12)
    spec.loader.exec_module(zoo)
    return zoo


def leaves(out):
    import torch
    import torch.utils._pytree as pytree
    if hasattr(out, "to_tuple"):   # a Hugging Face ModelOutput
        out = out.to_tuple()
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def rel_err(got, want, floor=1e-6) -> float:
    """Max abs difference over the reference's max abs (at least `floor`)."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(floor))


def max_error(got, got_grads, want, want_grads, mode) -> float | None:
    """The largest relative error of the outputs and, for a training step, of every gradient."""
    errs = [rel_err(a, b) for a, b in zip(leaves(got), leaves(want)) if a.is_floating_point()]
    if mode == "train":
        # a gradient that is zero in exact arithmetic (a bias before BatchNorm, an unused
        # embedding row) is rounding noise, different from run to run even in eager: judged
        # on the model's gradient scale, as the tests judge it
        scale = max((float(g.abs().max()) for g in want_grads.values()), default=0.0)
        errs += [rel_err(got_grads[n], g, floor=max(1e-6, 1e-2 * scale))
                 for n, g in want_grads.items() if n in got_grads]
    return max(errs) if errs else None


TOLERANCE = {"f32": 1e-4, "bf16": 2e-2}   # kbench against eager in the same dtype
BF16_SLACK = 1.25   # or, in bf16: kbench against f32 within this factor of eager bf16's own error


def correct(kbench_cell, eager_cell, dtype) -> bool | None:
    """Whether kbench's outputs and gradients are eager's: within TOLERANCE of eager in the same
    dtype, or, in bf16, no further from f32 eager than eager bf16 is (times BF16_SLACK)."""
    err = kbench_cell.get("max_rel_err")
    if err is None:
        return None
    if err <= TOLERANCE[dtype]:
        return True
    ours, theirs = kbench_cell.get("err_vs_f32"), eager_cell.get("err_vs_f32")
    return bool(dtype == "bf16" and ours is not None and theirs is not None and ours <= BF16_SLACK * theirs)


class Case:
    """One (model, mode, dtype): the model at its real size on the GPU and a step function."""

    def __init__(self, zoo, name, mode, dtype):
        import torch
        self.torch, self.entry, self.mode, self.dtype = torch, zoo.BY_NAME[name], mode, dtype
        torch.manual_seed(0)
        self.model = self.entry.make("real").cuda()
        self.model.train(mode == "train")
        self.args, self.kwargs = self.entry.call("real", torch.Generator().manual_seed(1), "cuda")
        if mode == "infer":
            self.kwargs = {k: v for k, v in self.kwargs.items() if k != "labels"}

    def autocast(self, enabled=True):
        return self.torch.autocast("cuda", dtype=self.torch.bfloat16, enabled=enabled and self.dtype == "bf16")

    def step(self, module, autocast=True):
        """One call as the benchmark times it: a forward (no autograd) for inference; forward,
        loss and backward (gradients set to None first) for a training step. autocast=False: the
        same call in f32 (the reference a bf16 row's rounding is judged against)."""
        torch = self.torch
        if self.mode == "infer":
            with torch.no_grad(), self.autocast(autocast):
                return module(*self.args, **self.kwargs)
        for p in self.model.parameters():
            p.grad = None
        with self.autocast(autocast):
            out = module(*self.args, **self.kwargs)
            loss = self.entry.loss(out, self.args, self.kwargs)
        loss.backward()
        return loss


def timed(case, fn, reps):
    """Per-call time (ms) and peak memory (MB above what was allocated before) of fn()."""
    from kbench.tune import timing
    torch = case.torch
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    t = timing.time_fn(lambda: fn(), [()], device="cuda", reps=reps, warmup=3, blocks=2)
    return t.median_ms, peak


def device_ms(case, fn):
    """Inference's device time: the calls replayed from one CUDA graph (None where fn cannot be
    captured in a graph)."""
    from kbench.tune import timing
    try:
        g = timing.time_graph(lambda: fn(), [()], device="cuda", reps=5)
    except Exception:  # noqa: BLE001 - not every call can be captured; the per-call time stands
        return None
    return g.median_ms if g is not None else None


def one_row(zoo, name, mode, dtype, args) -> dict:
    import torch

    import kbench
    row = {"model": name, "mode": mode, "dtype": dtype, "impls": {}}
    case = Case(zoo, name, mode, dtype)
    ref_model = copy.deepcopy(case.model)
    impls = {}
    # eager
    impls["eager"] = case.model
    # torch.compile
    for cmode in args.compile_modes:
        key = "compile" if cmode == "default" else f"compile-{cmode}"
        t0 = time.perf_counter()
        try:
            compiled = torch.compile(case.model, mode=None if cmode == "default" else cmode)
            case.step(compiled)
            torch.cuda.synchronize()
            impls[key] = compiled
            row["impls"][key] = {"build_s": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row["impls"][key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    # kbench: cold (a cache directory of its own), then again from that cache
    with tempfile.TemporaryDirectory() as cache_dir:
        os.environ["KBENCH_CACHE_DIR"] = cache_dir
        try:
            with case.autocast():
                t0 = time.perf_counter()
                opt = kbench.optimize(case.model, case.args, case.kwargs, budget=args.budget, verbose=False)
                cold = time.perf_counter() - t0
                case.step(opt)   # the first call binds (and, training, prepares the backward)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0 - cold
                t0 = time.perf_counter()
                warm = kbench.optimize(case.model, case.args, case.kwargs, budget=args.budget, verbose=False)
                warm_s = time.perf_counter() - t0
                del warm
            impls["kbench"] = opt
            report = opt.kbench_report
            row["impls"]["kbench"] = {"optimize_cold_s": cold, "first_call_s": first, "optimize_warm_s": warm_s,
                                      "regions": len(report.rows), "kernels": report.kernels,
                                      "notes": [n for n in report.notes if n.startswith(("model gate", "fallback",
                                                                                           "capture", "input"))]}
        except Exception as e:  # noqa: BLE001
            row["impls"]["kbench"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                                      "trace": traceback.format_exc()[-2000:]}
        finally:
            os.environ.pop("KBENCH_CACHE_DIR", None)
    # correctness: kbench against eager on the same weights and inputs (a fresh copy for eager);
    # a bf16 row is also judged against f32 eager: two bf16 computations of one model differ by
    # their rounding, so kbench's error against f32 is set beside eager bf16's own
    if "kbench" in impls:
        torch.manual_seed(123)   # dropout (torchvision's classifiers) draws the same masks for both
        got = case.step(impls["kbench"])
        got_grads = {n: p.grad.clone() for n, p in case.model.named_parameters() if p.grad is not None}
        ref_case = copy.copy(case)
        ref_case.model = ref_model
        torch.manual_seed(123)
        want = ref_case.step(ref_model)
        want_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters() if p.grad is not None}
        cell = row["impls"]["kbench"]
        cell["max_rel_err"] = max_error(got, got_grads, want, want_grads, mode)
        if dtype == "bf16":
            torch.manual_seed(123)
            exact = ref_case.step(ref_model, autocast=False)
            exact_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters() if p.grad is not None}
            cell["err_vs_f32"] = max_error(got, got_grads, exact, exact_grads, mode)
            row["impls"].setdefault("eager", {})["err_vs_f32"] = max_error(want, want_grads, exact, exact_grads, mode)
        cell["correct"] = correct(cell, row["impls"].get("eager", {}), dtype)
    del ref_model
    # timing: ROUNDS rounds, each timing every implementation in turn, and the median of each
    # one's round medians: a drift of the clocks or of the host over the row hits all alike
    per_round = max(3, args.reps // ROUNDS)
    times = {key: [] for key in impls}
    for _ in range(ROUNDS):
        for key, module in impls.items():
            cell = row["impls"].setdefault(key, {})
            try:
                ms, peak = timed(case, lambda m=module: case.step(m), per_round)
                times[key].append(ms)
                cell["peak_mb"] = max(cell.get("peak_mb", 0.0), peak)
            except Exception as e:  # noqa: BLE001
                cell["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    for key, module in impls.items():
        cell = row["impls"][key]
        if times[key]:
            cell["ms"] = statistics.median(times[key])
            cell["ms_rounds"] = times[key]
        if mode == "infer" and "error" not in cell:
            cell["device_ms"] = device_ms(case, lambda m=module: case.step(m))
    eager_ms = row["impls"]["eager"].get("ms")
    for key, cell in row["impls"].items():
        if cell.get("ms") and eager_ms:
            cell["vs_eager"] = eager_ms / cell["ms"]
    k = row["impls"].get("kbench", {})
    for key in [k_ for k_ in row["impls"] if k_.startswith("compile")]:
        if k.get("ms") and row["impls"][key].get("ms"):
            k[f"vs_{key}"] = row["impls"][key]["ms"] / k["ms"]
    if "kbench" in impls:   # after the timed calls: what the graphs served
        try:
            row["impls"]["kbench"]["graphs"] = [n for n in impls["kbench"].kbench_report.notes
                                                if n.startswith("CUDA graphs")]
        except Exception:  # noqa: BLE001 - a report that cannot be made costs only this field
            pass
    del impls, case
    gc.collect()
    torch.cuda.empty_cache()
    return row


def table(rows) -> str:
    keys = sorted({k for r in rows for k in r["impls"] if k.startswith("compile")})
    head = (["model", "mode", "dtype", "eager ms"] + [f"{k} ms" for k in keys]
            + ["kbench ms", "kbench vs eager"] + [f"kbench vs {k}" for k in keys]
            + ["device ms e / k", "peak MB e / k", "optimize s cold / warm", "max rel err", "err vs f32 k / e", "correct", "gate"])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(x, spec=".4g"):
        return format(x, spec) if isinstance(x, (int, float)) else "-"
    for r in rows:
        e, k = r["impls"].get("eager", {}), r["impls"].get("kbench", {})
        gate = next((n for n in k.get("notes", []) if n.startswith("model gate")), "")
        cells = [r["model"], r["mode"], r["dtype"], f(e.get("ms"))]
        cells += [f(r["impls"].get(c, {}).get("ms")) for c in keys]
        cells += [f(k.get("ms")), f(k.get("vs_eager"), ".2f") + "×" if k.get("vs_eager") else k.get("error", "-")[:60]]
        cells += [f(k.get(f"vs_{c}"), ".2f") + "×" if k.get(f"vs_{c}") else "-" for c in keys]
        cells += [f"{f(e.get('device_ms'))} / {f(k.get('device_ms'))}", f"{f(e.get('peak_mb'), '.0f')} / "
                  f"{f(k.get('peak_mb'), '.0f')}", f"{f(k.get('optimize_cold_s'), '.1f')} / "
                  f"{f(k.get('optimize_warm_s'), '.1f')}", f(k.get("max_rel_err"), ".2g"),
                  f"{f(k.get('err_vs_f32'), '.2g')} / {f(e.get('err_vs_f32'), '.2g')}" if "err_vs_f32" in k else "-",
                  {True: "yes", False: "NO", None: "-"}[k.get("correct")],
                  "original runs" if "original module runs" in gate else ("kbench" if gate else "-")]
        out.append("| " + " | ".join(cells) + " |")
    ratios = [r["impls"]["kbench"]["vs_eager"] for r in rows if r["impls"].get("kbench", {}).get("vs_eager")]
    if ratios:
        gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
        out.append(f"\ngeometric mean kbench vs eager: {gm:.2f}× over {len(ratios)} rows; least {min(ratios):.2f}×")
    for key in keys:
        ratios = [r["impls"]["kbench"][f"vs_{key}"] for r in rows if r["impls"].get("kbench", {}).get(f"vs_{key}")]
        if ratios:
            gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
            out.append(f"geometric mean kbench vs {key}: {gm:.2f}× over {len(ratios)} rows; least {min(ratios):.2f}×")
    wrong = [f"{r['model']} {r['mode']} {r['dtype']}" for r in rows if r["impls"].get("kbench", {}).get("correct") is False]
    if wrong:
        out.append(f"NOT within tolerance of eager: {', '.join(wrong)}")
    return "\n".join(out)


def chart(rows, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in rows if r["impls"].get("kbench", {}).get("vs_eager")]
    if not rows:
        return None
    labels = [f"{r['model']} {r['mode']} {r['dtype']}" for r in rows]
    series = {"vs eager": [r["impls"]["kbench"]["vs_eager"] for r in rows],
              "vs torch.compile": [r["impls"]["kbench"].get("vs_compile") or 0 for r in rows]}
    fig, ax = plt.subplots(figsize=(max(8, 0.5 * len(rows) + 3), 5))
    width = 0.4
    for i, (name, vals) in enumerate(series.items()):
        xs = [j + (i - 0.5) * width for j in range(len(rows))]
        bars = ax.bar(xs, vals, width, label=f"kbench {name}")
        for b, v in zip(bars, vals):
            if v:
                ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("speed relative (×, per call)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="", help="comma-separated zoo names (default: all)")
    p.add_argument("--modes", default="infer,train")
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--compile-modes", default="default", help="torch.compile modes: default, reduce-overhead, "
                                                                "max-autotune (comma-separated; '' for none)")
    p.add_argument("--budget", default="fast", help="kbench's search budget")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--resume", default="", help="a results JSON of an earlier run: rows in it are kept, not rerun")
    args = p.parse_args(argv)
    modes, dtypes = [m for m in args.modes.split(",") if m], [DTYPE_NAMES.get(d, d) for d in args.dtypes.split(",") if d]
    bad = [m for m in modes if m not in MODES] + [d for d in dtypes if d not in DTYPES]
    if bad:
        print(f"bench_models.py: unknown mode(s) or dtype(s) {bad}; modes are {list(MODES)}, dtypes "
              f"{sorted(DTYPE_NAMES)}", file=sys.stderr)
        return 2
    import torch
    if not torch.cuda.is_available():
        print("bench_models.py: no CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    zoo = load_zoo()
    names = [n for n in args.models.split(",") if n] or [m.name for m in zoo.ZOO]
    unknown = [n for n in names if n not in zoo.BY_NAME]
    if unknown:
        print(f"bench_models.py: unknown model(s) {unknown}; the zoo has {[m.name for m in zoo.ZOO]}", file=sys.stderr)
        return 2
    args.compile_modes = [m for m in args.compile_modes.split(",") if m]
    from kbench.bench import results
    meta = results.environment(torch.device("cuda")) if hasattr(results, "environment") else {}
    rows = json.loads(Path(args.resume).read_text())["rows"] if args.resume else []
    done = {(r["model"], r["mode"], r["dtype"]) for r in rows}
    gpu = torch.cuda.get_device_name().replace(" ", "-")
    commit = os.environ.get("KBENCH_COMMIT", "unknown")
    stem = Path(args.out) / f"models-{gpu}-{time.strftime('%Y%m%d-%H%M%S')}-{commit}"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    todo = [(n, m, d) for n in names for m in modes for d in dtypes
            if (n, m, d) not in done]
    for i, (name, mode, dtype) in enumerate(todo):
        t0 = time.perf_counter()
        print(f"[{i + 1}/{len(todo)}] {name} {mode} {dtype} ...", flush=True)
        try:
            row = one_row(zoo, name, mode, dtype, args)
        except Exception as e:  # noqa: BLE001 - an out-of-memory or a failing model is a row, not the end
            row = {"model": name, "mode": mode, "dtype": dtype, "impls": {},
                   "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            torch.cuda.empty_cache()
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        k = row["impls"].get("kbench", {})
        print(f"    kbench {k.get('vs_eager', 0):.2f}× eager, err {k.get('max_rel_err')}, correct "
              f"{k.get('correct')}, "
              f"{row['seconds']:.0f} s {row.get('error', '')}", flush=True)
        doc = {"schema": "kbench-models-1", "meta": {"gpu": torch.cuda.get_device_name(), "commit": commit,
                                                      "torch": torch.__version__, **meta},
               "options": {"budget": args.budget, "reps": args.reps, "compile_modes": args.compile_modes},
               "rows": rows}
        stem.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
        stem.with_suffix(".md").write_text(table(rows) + "\n")
    print(table(rows))
    png = chart(rows, str(stem) + ".png", f"kbench on whole models, {torch.cuda.get_device_name()}, {commit}")
    print(f"wrote {stem}.json" + (f", {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
