#!/usr/bin/env python
"""Fused-op benchmark: eager vs torch.compile vs kbench on the memory-bound ops kbench fuses,
each at a working set >= 64 MB, forward and forward+backward, against the memory roofline (a
device-to-device copy measured in the same run). Every result is checked against a float64
reference; kbench's against eager's too. The method is docs/benchmarking.md.

Each cell is timed two ways (TIMING_METHODS, also in the JSON): "per-call", CUDA events around
each call, which counts the host overhead wherever the GPU waits on the host (the autograd
engine between kernels), and "device", the same calls replayed from a CUDA graph, which leaves
the kernels alone. For kbench, each region's search result (the default genome's kernel time
against the winner's) is reported beside them.

    python benchmarks/bench_ops.py                      # forward, f32 and bf16, on the GPU
    python benchmarks/bench_ops.py --backward           # also forward+backward
    python benchmarks/bench_ops.py --quick --device cpu # smoke test (small sizes, few reps)

Writes benchmarks/results/<gpu>-<date>-<commit>.json and prints a markdown table last
(benchmarks/plot_results.py draws a chart from the JSON). Models, inputs and the bytes-moved
formulas come from kbench.bench.tasks (each task's bytes_moved docstring is copied into the
JSON). kbench failing to import or optimize is recorded in its cells; the other columns still
run. Without a GPU it says so in one line and exits 1, unless --device cpu asks for the CPU.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KBENCH_IMPORT_ERROR = None
try:
    import kbench  # noqa: F401
except Exception as _e:  # noqa: BLE001 - kbench's core may not be built; the rest still runs
    KBENCH_IMPORT_ERROR = f"{type(_e).__name__}: {_e}"
    for _k in [k for k in sys.modules if k == "kbench" or k.startswith("kbench.")]:
        del sys.modules[_k]
    _pkg = types.ModuleType("kbench")  # the bench helpers are pure Python: load them alone
    _pkg.__path__ = [str(ROOT / "kbench")]
    sys.modules["kbench"] = _pkg

from kbench.bench import compare, impls, results  # noqa: E402
from kbench.tune import timing  # noqa: E402
from kbench.bench.compare import flatten, to_f64  # noqa: E402
from kbench.bench.tasks import TASKS, dtype_name, parse_dtype  # noqa: E402

# name -> (registry task, full-size config, --quick config, dtypes)
OPS = {
    "layer_norm": ("layer_norm", dict(shape=(8192, 4096)), dict(shape=(64, 256)), None),
    "rms_norm": ("rms_norm", dict(shape=(8192, 4096)), dict(shape=(64, 256)), None),
    "softmax": ("softmax", dict(shape=(8192, 4096)), dict(shape=(64, 256)), None),
    "log_softmax": ("log_softmax", dict(shape=(8192, 4096)), dict(shape=(64, 256)), None),
    "bias_gelu_tanh": ("bias_gelu_tanh", dict(shape=(8192, 4096)), dict(shape=(64, 256)), None),
    "bias_gelu_erf": ("bias_gelu_erf", dict(shape=(8192, 4096)), dict(shape=(64, 256)), None),
    "swiglu_split": ("swiglu_split", dict(shape=(8192, 8192)), dict(shape=(64, 512)), None),
    "swiglu_two": ("swiglu_two", dict(shape=(8192, 4096)), dict(shape=(64, 256)), None),
    "residual_layer_norm": ("residual_layer_norm", dict(shape=(8192, 4096)),
                            dict(shape=(64, 256)), None),
    "cross_entropy": ("cross_entropy_32k", dict(N=8192, V=32000), dict(N=16, V=1000),
                      ("float32",)),
    # few, long rows: a block per row would leave most SMs idle
    "layer_norm_wide": ("layer_norm_wide", dict(shape=(8, 32, 128, 256)), dict(shape=(2, 4, 8, 16)), None),
    "frobenius_norm": ("frobenius_norm", dict(shape=(28, 64, 512, 512)), dict(shape=(4, 3, 5, 7)),
                       ("float32",)),
    "cross_entropy_50k": ("cross_entropy_32k", dict(N=8192, V=50257), dict(N=16, V=1001),
                          ("float32",)),
}
def task_model(op: str, dtype, cfg=None, device="cuda"):
    """The model of benchmark op `op` and its inputs at the timed size (or at cfg), seeded: the
    setup bench_genomes.py and sass_counts.py share."""
    task_name, perf_cfg, _, _ = OPS[op]
    mod = TASKS[task_name].module
    cfg = perf_cfg if cfg is None else cfg
    model = (mod.Model(**mod.model_args(cfg)) if hasattr(mod, "model_args") else mod.Model()).to(dtype).to(device)
    return model, mod.make_inputs(cfg, dtype, device, torch.Generator(device=device).manual_seed(0))


IMPLS = ("eager", "compile", "kbench")
TIMING_BLOCKS = 2   # per call: the reps run twice, the block with the least median reported
TIMING_METHODS = {
    "per-call": "timing.time_fn: CUDA events around each call on the current stream, L2 flushed "
                "between calls; host overhead included wherever the GPU waits on the host "
                "(autograd engine, Python autograd.Function); the reps run in 2 blocks, the one "
                "with the least median reported (block_medians_ms has both). Fields median_ms, "
                "roofline_fraction; table columns '<impl> ms' and 'roofline'.",
    "device": "timing.time_graph: one CUDA graph of graph_calls calls, each between two L2 "
              "flushes, minus a graph of the flushes alone, per call, median of graph_replays "
              "replays after 0.1 s of untimed ones; host overhead removed. Fields graph_ms, "
              "graph_roofline_fraction (or graph_error when the call cannot be captured); table "
              "column 'device-time roofline'.",
}
# a "searched vs default" gain at or above this counts as the search paying off
SEARCH_GAIN_GOOD = 1.10


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(OPS), help="comma-separated, from: "
                   + ", ".join(OPS))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--backward", action="store_true", help="also time forward+backward")
    p.add_argument("--quick", action="store_true", help="small sizes, few reps (smoke test)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--impls", default=",".join(IMPLS), help="subset of eager,compile,kbench")
    p.add_argument("--reps", type=int, default=None, help="timed reps (default 100; quick 20)")
    p.add_argument("--kbench-budget", default="fast", help="budget passed to kbench.optimize")
    a = p.parse_args(argv)
    a.tasks = [t for t in a.tasks.split(",") if t]
    unknown = [t for t in a.tasks if t not in OPS]
    if unknown:
        p.error(f"unknown task(s) {unknown}; known: {list(OPS)}")
    a.dtypes = [dtype_name(parse_dtype(d)) for d in a.dtypes.split(",") if d]
    a.impls = [i for i in a.impls.split(",") if i]
    a.device = a.device or ("cuda" if torch.cuda.is_available() else None)
    a.reps = a.reps or (20 if a.quick else 100)
    a.warmup = 2 if a.quick else 10
    # a few replays of a short graph: the device time is stable, and the run stays ~as fast
    a.graph_calls = 4 if a.quick else 16
    a.graph_replays = 3 if a.quick else 5
    return a


# --------------------------------------------------------------------------- building

def build_impl(name, model, example, device, budget):
    """(callable, seconds to build, error). torch.compile compiles lazily, at the first call."""
    t0 = time.perf_counter()
    try:
        if name == "eager":
            fn = model
        elif name == "compile":
            import torch._dynamo
            torch._dynamo.reset()
            fn = torch.compile(model)
        elif name == "kbench":
            if KBENCH_IMPORT_ERROR:
                raise ImportError(f"kbench did not import: {KBENCH_IMPORT_ERROR}")
            # backend "cuda" on a GPU, "interp" on the CPU; the budget if optimize() takes one
            fn = impls.kbench_factory(budget=budget)(model, list(example))
        else:
            raise ValueError(name)
        return fn, time.perf_counter() - t0, None
    except Exception as e:  # noqa: BLE001
        return None, time.perf_counter() - t0, f"{type(e).__name__}: {e}"


def region_count(fn):
    """Regions in kbench's report, if it says (tolerates any shape of report, or none)."""
    rep = getattr(fn, "kbench_report", None)
    if callable(rep):
        try:
            rep = rep()
        except Exception:  # noqa: BLE001
            return None
    for attr in ("regions", "num_regions", "n_regions", "rows"):  # Report.rows: one per region
        v = rep.get(attr) if isinstance(rep, dict) else getattr(rep, attr, None)
        if isinstance(v, int):
            return v
        if v is not None and hasattr(v, "__len__"):
            return len(v)
    return None


# --------------------------------------------------------------------------- running

def clone(xs):
    return [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in xs]


def leaves_of(xs):
    return [x for x in xs if isinstance(x, torch.Tensor) and x.is_floating_point()]


def run_once(fn, xs, params, gouts, backward):
    """Outputs (and gradients w.r.t. floating inputs and params) of fn on private copies."""
    xs = clone(xs)
    if not backward:
        with torch.no_grad():
            return [o.detach() for o in flatten(fn(*xs))], []
    for x in leaves_of(xs):
        x.requires_grad_()
    outs = flatten(fn(*xs))
    pairs = [(o, g) for o, g in zip(outs, gouts) if g is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], leaves_of(xs) + list(params),
                                [g for _, g in pairs], allow_unused=True)
    return [o.detach() for o in outs], list(grads)


def peak_mb(fn, xs, dev):
    """Memory one call allocates at its peak beyond what was allocated before it (activations
    saved for backward, workspaces, the gradients it returns), in MB."""
    timing.sync(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    out = fn(*xs)
    timing.sync(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del out
    return peak / 1e6


def timed_fn(fn, params, gouts, backward):
    if not backward:
        def fwd(*xs):
            with torch.no_grad():
                return fn(*xs)
        return fwd

    def fwd_bwd(*xs):
        outs = flatten(fn(*xs))
        pairs = [(o, g) for o, g in zip(outs, gouts) if g is not None]
        return torch.autograd.grad([o for o, _ in pairs], leaves_of(xs) + list(params),
                                   [g for _, g in pairs], allow_unused=True)
    return fwd_bwd


def check(got, eager, ref):
    """Compare each tensor of `got` with the float64 `ref`, tolerances widened by eager's own
    error; returns (ok, summary dict)."""
    tensors, ok = [], True
    for i, (g, e, r) in enumerate(zip(got, eager, ref)):
        if r is None or e is None:
            continue
        if g is None:
            tensors.append({"i": i, "ok": False, "reason": "missing"})
            ok = False
            continue
        if tuple(g.shape) != tuple(r.shape) or g.dtype != e.dtype:
            tensors.append({"i": i, "ok": False, "reason": f"shape/dtype {tuple(g.shape)} "
                            f"{g.dtype}, expected {tuple(e.shape)} {e.dtype}"})
            ok = False
            continue
        tol = compare.tolerance(e.dtype, r, compare.errors(e, r))
        good, why, err = compare.close(g, r, tol)
        tensors.append({"i": i, "ok": good, "reason": why, **err})
        ok &= good
    return ok, {"rel_norm": max((t.get("rel_norm", 0.0) for t in tensors), default=None),
                "max_abs": max((t.get("max_abs", 0.0) for t in tensors), default=None),
                "tensors": tensors}


def max_abs_diff(a_list, b_list):
    m = 0.0
    for a, b in zip(a_list, b_list):
        if a is None or b is None or a.shape != b.shape:
            continue
        m = max(m, (a.double() - b.double()).abs().max().item() if a.numel() else 0.0)
    return m


def bench_task(op, dtype, args, env):
    """Rows (fwd, and fwdbwd with --backward) for one op in one dtype."""
    task_name, full, quick, _ = OPS[op]
    task = TASKS[task_name]
    cfg = dict(quick if args.quick else full, name=op)
    dev = args.device
    model = task.build(cfg, dtype, dev, seed=0)  # the first init config: random
    params = list(model.parameters())
    arg_sets = [task.inputs(cfg, dtype, dev, seed=1 + i) for i in range(2)]
    pristine = [clone(a) for a in arg_sets]  # to check that no implementation writes its inputs
    ref_model = task.reference(model)
    modes = [False] + ([True] if args.backward and task.backward else [])

    with torch.no_grad():
        out0 = flatten(model(*arg_sets[0]))
    g = torch.Generator(device=dev).manual_seed(7)
    gouts = [torch.randn(o.shape, generator=g, device=dev).to(o.dtype)
             if o.is_floating_point() else None for o in out0]
    del out0

    built = {}
    for name in args.impls:
        built[name] = build_impl(name, model, arg_sets[0], dev, args.kbench_budget)

    rows = []
    for backward in modes:
        mode = "fwdbwd" if backward else "fwd"
        r_out, r_gr = run_once(ref_model, [to_f64(x) for x in arg_sets[0]],
                               list(ref_model.parameters()),
                               [to_f64(x) for x in gouts], backward)
        refs = r_out + r_gr
        e_out, e_gr = run_once(model, arg_sets[0], params, gouts, backward)
        eager_all = e_out + e_gr
        nbytes = task.bytes_moved(cfg, dtype, backward)
        row = {"task": op, "dtype": dtype, "mode": mode, "shape": {k: v for k, v in cfg.items()
                                                                   if k != "name"},
               "registry_task": task_name, "bytes": nbytes,
               "bytes_formula": " ".join((task.bytes_fn.__doc__ or "").split()),
               "impls": {}, "notes": []}
        if backward:
            for x in arg_sets:
                for t in leaves_of(x):
                    t.requires_grad_()
        for name in args.impls:
            fn, build_s, err = built[name]
            cell = {"build_s": build_s, "error": err}
            row["impls"][name] = cell
            if fn is None:
                continue
            try:
                t0 = time.perf_counter()
                got_out, got_gr = run_once(fn, arg_sets[0], params, gouts, backward)
                timing.sync(dev)
                cell["first_call_s"] = time.perf_counter() - t0  # includes compilation
                ok, cell["err_vs_f64"] = check(got_out + got_gr, eager_all, refs)
                cell["correct"] = ok
                if name == "kbench":
                    cell["max_abs_vs_eager"] = max_abs_diff(got_out, e_out)
                    cell["schedules"] = schedules(fn)
                    cell.update(search_summary(fn, backward))  # after run_once built the backward
                    if backward:
                        cell["grad_max_abs_vs_eager"] = max_abs_diff(got_gr, e_gr)
                del got_out, got_gr
                tfn = timed_fn(fn, params, gouts, backward)
                t = timing.time_fn(tfn, arg_sets, device=dev, reps=args.reps, warmup=args.warmup,
                                  blocks=TIMING_BLOCKS)
                cell.update(t.as_dict())
                if backward and torch.device(dev).type == "cuda":
                    cell["peak_mb"] = peak_mb(tfn, arg_sets[0], dev)
                # after peak_mb, which its graphs' memory must not reach; before the input check,
                # which then covers the replays too
                device_time(cell, tfn, arg_sets, nbytes, env, args)
                for a, p in zip(arg_sets, pristine):
                    if any(isinstance(x, torch.Tensor) and not torch.equal(x.detach(), y)
                           for x, y in zip(a, p)):
                        cell["correct"] = False
                        row["notes"].append(f"{name}: modified its inputs in place")
                        with torch.no_grad():
                            for x, y in zip(a, p):
                                x.copy_(y)
                roof = timing.roofline(nbytes, t.median_ms, env["copy"]["bytes_per_s"])
                cell["roofline_fraction"] = roof["fraction"]
                cell["achieved_gb_per_s"] = (roof["achieved_bytes_per_s"] or 0) / 1e9
                if t.hidden_work:
                    row["notes"].append(f"{name}: wall-clock {t.wall_over_event:.1f}x event "
                                        f"time (work outside the current stream?)")
            except Exception as e:  # noqa: BLE001
                cell["error"] = f"{type(e).__name__}: {e}"
                cell["traceback"] = traceback.format_exc(limit=4)
        if "kbench" in built and built["kbench"][0] is not None:
            host_overhead(task, cfg, dtype, dev, built["kbench"][0], model, row, params, backward)
        finish_row(row)
        rows.append(row)
        del refs, eager_all, r_out, r_gr, e_out, e_gr
    del built, arg_sets, pristine, model, ref_model
    gc.collect()
    if torch.device(dev).type == "cuda":
        torch.cuda.empty_cache()
    return rows


def device_time(cell, tfn, arg_sets, nbytes, env, args):
    """The call's device time from CUDA-graph replay, host overhead removed: graph_ms and
    graph_roofline_fraction (the per-call roofline's formula), or graph_error when it cannot be
    captured (it syncs, reads a value on the host...), which leaves the rest of the cell as it
    was. Nothing on the CPU, where host time is device time."""
    try:
        t = timing.time_graph(tfn, arg_sets, device=args.device, calls=args.graph_calls,
                              reps=args.graph_replays)
    except Exception as e:  # noqa: BLE001 - a failed capture is this cell's note, not the run's end
        cell["graph_error"] = f"{type(e).__name__}: {e}"
        return
    if t is None:
        return
    cell["graph_ms"] = t.median_ms
    cell["graph_timing"] = t.as_dict()
    cell["graph_roofline_fraction"] = timing.roofline(nbytes, t.median_ms,
                                                      env["copy"]["bytes_per_s"])["fraction"]


def schedules(fn):
    """What ran: each region's genome (or why it stayed eager), and each backward program's
    regions and genomes, from the optimized module (the JSON says which kernels were timed)."""
    plan = getattr(getattr(fn, "_kbench_impl", None) or fn, "_kbench_plan", None)
    if plan is None:
        return None
    return [{"region": i.index, "kind": i.kind, "genome": i.genome or i.status, "backward": i.backward,
             "backward_genomes": i.extra.get("backward_genomes")} for i in plan.regions]


def search_regions(fn, directions=("fwd", "bwd")):
    """Each generated region's search result, forward regions first, then each backward
    program's in the order they were built: the default genome's and the winner's kernel time
    (ms), candidates tried, and what the cache said ("hit", "miss", "same as region N"). Only
    regions searched in this process carry both times."""
    mod = getattr(fn, "_kbench_impl", None) or fn  # kbench_factory may wrap the module
    plan = getattr(mod, "_kbench_plan", None)
    out = []
    if plan is not None and "fwd" in directions:
        out += [_search_entry(i, "fwd") for i in plan.regions if i.kind != "EXTERN"]
    if "bwd" in directions:
        for (r, need), prog in (getattr(mod, "_kbench_backward", None) or {}).items():
            if prog is None:  # this region's backward runs in torch
                continue
            flags = "".join("1" if n else "0" for n in need)
            out += [dict(_search_entry(i, "bwd"), forward_region=r, need=flags)
                    for i in prog.plan.regions if i.kind != "EXTERN"]
    return out


def _search_entry(info, direction):
    x = info.extra or {}
    return {"region": info.index, "direction": direction, "kind": info.kind,
            "default_ms": x.get("default_ms"), "best_ms": x.get("best_ms"),
            "candidates": x.get("candidates"), "cache": x.get("cache")}


def search_gain(entries):
    """(sum of default_ms / sum of best_ms, regions counted) over the entries where both are
    known; (None, 0) when none are. Above 1 the search beat the default genome."""
    known = [e for e in entries if e.get("default_ms") and e.get("best_ms")]
    if not known:
        return None, 0
    return sum(e["default_ms"] for e in known) / sum(e["best_ms"] for e in known), len(known)


def search_summary(fn, backward):
    """The kbench cell's search fields for a row: forward regions, and backward ones too for a
    forward+backward row."""
    try:
        entries = search_regions(fn, ("fwd", "bwd") if backward else ("fwd",))
    except Exception as e:  # noqa: BLE001 - the plan's shape may change; the timings still count
        return {"search_error": f"{type(e).__name__}: {e}"}
    gain, n = search_gain(entries)
    return {"search": entries, "search_gain": gain, "search_regions": n,
            "search_cache_hits": sum(1 for e in entries if e.get("cache") == "hit")}


def search_label(cell):
    """The table's "searched vs default": "1.12× (3 regions)" (", 2 cached" when some regions
    came from the cache), "cached" when none was searched because the cache answered, "—" when
    nothing was searched (the interpreter, budget "none", no kbench)."""
    gain, n, hits = cell.get("search_gain"), cell.get("search_regions"), cell.get("search_cache_hits")
    if gain is None:
        return "cached" if hits else "—"
    label = f"{gain:.2f}× ({n} region{'' if n == 1 else 's'}"
    return label + (f", {hits} cached)" if hits else ")")


def search_line(rows):
    """One line under the table: in how many rows the search paid off, or lost to the default."""
    gains = [r["impls"]["kbench"].get("search_gain") for r in rows
             if "kbench" in r.get("impls", {})]
    known = [g for g in gains if g is not None]
    return (f"searched vs default genome: {sum(g >= SEARCH_GAIN_GOOD for g in known)} of "
            f"{len(gains)} kbench rows (task, dtype, mode) gain >= {SEARCH_GAIN_GOOD:.2f}×; "
            f"{sum(g < 1.0 for g in known)} searched slower than the default (< 1.00×); "
            f"{len(gains) - len(known)} with no searched region")


HOST_REPEATS = 5   # host time: the least of this many runs of 200 calls (a run that another
                   # process interrupts reads high, never low)


def host_us(kfn, efn, xs, dev):
    """kbench's and eager's host time per call, runs of the two alternated: a stretch of slow
    host (another process busy) lands on both, and the least of runs spread over it can be past
    it (back to back, eager's residual LayerNorm read 23, 30 and 54 µs in three runs)."""
    mine, theirs = [], []
    for _ in range(HOST_REPEATS):
        mine.append(timing.host_overhead_us(kfn, xs, device=dev))
        theirs.append(timing.host_overhead_us(efn, xs, device=dev))
    return min(mine), min(theirs)


def host_overhead(task, cfg, dtype, dev, kfn, model, row, params, backward):
    """Host time per kbench call on a small input (no sync), per region if the report says;
    with backward, of one forward+backward (the launch path of both, no device work to wait on)."""
    small = dict(cfg)
    if "shape" in small:
        small["shape"] = (8,) + tuple(small["shape"][1:])
    else:
        small["N"] = 8
    xs = task.inputs(small, dtype, dev, seed=5)
    cell = row["impls"]["kbench"]
    try:
        if backward:
            for x in leaves_of(xs):
                x.requires_grad_()
            with torch.no_grad():
                outs = flatten(model(*xs))
            gouts = [torch.randn_like(o) if o.is_floating_point() else None for o in outs]
            cell["host_overhead_us"], cell["eager_host_overhead_us"] = host_us(
                timed_fn(kfn, params, gouts, True), timed_fn(model, params, gouts, True), xs, dev)
            return
        with torch.no_grad():
            cell["host_overhead_us"], cell["eager_host_overhead_us"] = host_us(kfn, model, xs, dev)
        n = region_count(kfn)
        cell["regions"] = n
        notes = getattr(getattr(kfn, "kbench_report", None), "notes", None)
        if notes:  # e.g. which inputs made kbench fall back to eager
            cell["kbench_notes"] = [str(x)[:200] for x in list(notes)[:10]]
        cell["host_overhead_us_per_region"] = (cell["host_overhead_us"] / n) if n else None
    except Exception as e:  # noqa: BLE001
        cell["host_overhead_error"] = f"{type(e).__name__}: {e}"


def finish_row(row):
    cells = row["impls"]
    wrong = [n for n, c in cells.items() if c.get("correct") is False]
    errors = [n for n, c in cells.items() if c.get("error")]
    hidden = [n for n, c in cells.items() if c.get("hidden_work")]
    row["status"] = ("FAIL" if wrong else "ERROR" if errors else "FLAGGED" if hidden
                     else "PASS")
    if wrong:
        row["notes"].append("wrong result: " + ", ".join(wrong))
    k = cells.get("kbench", {})
    for base in ("eager", "compile"):
        b = cells.get(base, {})
        if k.get("median_ms") and b.get("median_ms"):
            row[f"speedup_kbench_vs_{base}"] = b["median_ms"] / k["median_ms"]


# --------------------------------------------------------------------------- output

def table(rows, impls):
    out = []
    for r in rows:
        c = r["impls"]

        def ms(n):
            return results.fmt(c.get(n, {}).get("median_ms"), ".4f") if n in impls else "n/a"

        def roof(n):
            return results.fmt(c.get(n, {}).get("roofline_fraction"), ".0%")

        def droof(n):
            cell = c.get(n, {})
            return "err" if cell.get("graph_error") else results.fmt(
                cell.get("graph_roofline_fraction"), ".0%")

        corr = r["status"]
        k = c.get("kbench", {})
        if k.get("error"):
            corr += f" (kbench: {k['error'][:60]})"
        elif k.get("max_abs_vs_eager") is not None:
            corr += f" (kbench−eager max {k['max_abs_vs_eager']:.2g}"
            if k.get("grad_max_abs_vs_eager") is not None:
                corr += f", grad {k['grad_max_abs_vs_eager']:.2g}"
            corr += ")"
        if r["status"] == "FAIL":
            corr += " " + "; ".join(r["notes"])[:80]
        def peak(n):
            return results.fmt(c.get(n, {}).get("peak_mb"), ".0f")

        peaks = f"{peak('eager')} / {peak('compile')} / {peak('kbench')}" if r["mode"] == "fwdbwd" else ""
        host = (f"{results.fmt(k.get('eager_host_overhead_us'), '.0f')} / {results.fmt(k.get('host_overhead_us'), '.0f')}"
                if k.get("host_overhead_us") is not None else "")
        out.append((r["task"], r["dtype"], r["mode"], ms("eager"), ms("compile"), ms("kbench"),
                    results.fmt(r.get("speedup_kbench_vs_eager"), ".2f") + "×",
                    results.fmt(r.get("speedup_kbench_vs_compile"), ".2f") + "×",
                    f"{roof('eager')} / {roof('compile')} / {roof('kbench')}",
                    f"{droof('eager')} / {droof('compile')} / {droof('kbench')}", peaks, host,
                    search_label(k), corr))
    return results.markdown_table(
        ("task", "dtype", "mode", "eager ms", "compile ms", "kbench ms", "kbench vs eager",
         "kbench vs compile", "roofline eager / compile / kbench", "device-time roofline e / c / k",
         "peak MB e / c / k", "host µs e / k", "searched vs default", "correctness"), out)


def no_gpu(device) -> bool:
    """True, after one line on stderr, where the run would need a GPU this machine lacks."""
    if device is not None and not str(device).startswith("cuda"):
        return False
    if device is not None and torch.cuda.is_available():
        return False
    print("bench_ops.py: no CUDA GPU (torch.cuda.is_available() is False); "
          "--device cpu runs the CPU smoke test", file=sys.stderr)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    if no_gpu(args.device):
        return 1
    dev = args.device
    t_start = time.perf_counter()
    meta = results.metadata(dev)
    if KBENCH_IMPORT_ERROR:
        meta["kbench"] = {"version": None, "error": KBENCH_IMPORT_ERROR}
    copy_bytes = (16 << 20) if args.quick else (1 << 30)
    env = {"copy": timing.copy_bandwidth(dev, copy_bytes), "l2_bytes": timing.l2_bytes(dev)}
    print(f"device {meta['gpu'] or dev}; copy {env['copy']['bytes_per_s'] / 1e9:.0f} GB/s; "
          f"torch {meta['torch']}; kbench {meta['kbench']['version'] or meta['kbench']['error']}",
          file=sys.stderr)
    rows = []
    path = results.results_path(args.out, meta)

    def save():
        """The JSON is rewritten after every task, so a run cut short keeps what it measured."""
        doc = {"schema": "kbench-bench-ops/1", "meta": meta,
               "options": {"tasks": args.tasks, "dtypes": args.dtypes, "backward": args.backward,
                           "quick": args.quick, "reps": args.reps, "warmup": args.warmup,
                           "impls": args.impls, "kbench_budget": args.kbench_budget,
                           "l2_flush_bytes": 2 * env["l2_bytes"], "input_sets_rotated": 2,
                           "timing_methods": TIMING_METHODS, "graph_calls": args.graph_calls,
                           "graph_replays": args.graph_replays,
                           "search_gain": "kbench cells: sum(default_ms) / sum(best_ms) over the "
                                          "row's regions searched in this run (forward; and "
                                          "backward for fwdbwd); none for cache hits"},
               "copy": env["copy"], "l2_bytes": env["l2_bytes"],
               "total_s": time.perf_counter() - t_start, "rows": rows}
        results.write_json(path, doc)
        return doc

    for op in args.tasks:
        for dtype in args.dtypes:
            allowed = OPS[op][3]
            if allowed and dtype not in allowed:
                continue
            t0 = time.perf_counter()
            try:
                new = bench_task(op, dtype, args, env)
            except Exception as e:  # noqa: BLE001 - one broken task must not stop the run
                new = [{"task": op, "dtype": dtype, "mode": "fwd", "impls": {},
                        "status": "ERROR", "notes": [f"{type(e).__name__}: {e}"],
                        "traceback": traceback.format_exc(limit=6)}]
            rows += new
            print(f"  {op} {dtype}: {', '.join(r['status'] for r in new)} "
                  f"({time.perf_counter() - t0:.1f}s)", file=sys.stderr, flush=True)
            save()
    doc = save()
    print(f"wrote {path} in {doc['total_s']:.0f}s", file=sys.stderr)
    print(table(rows, args.impls))
    if "kbench" in args.impls:
        print(search_line(rows))
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
