"""`python -m kbench bench`: list the tasks, run the task filters, or score an implementation
(eager, compile, kbench, or a .py/.cu file) on the robust harness. Exits non-zero when any row
fails (a wrong result, a flagged timing, a task that cannot discriminate). A file is loaded and
run only in the harness's worker process (one for the whole run), never in this one."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from . import filters as filters_mod
from . import harness, impls, results, suites
from .runner import TIMEOUTS, WorkerError
from .tasks import dtype_name, parse_dtype, select


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kbench bench",
        description="Robust kernel benchmark: score an implementation against eager PyTorch "
                    "and torch.compile on tasks that cannot be gamed.")
    p.add_argument("--list", action="store_true", help="list the tasks and exit")
    p.add_argument("--filters", action="store_true",
                   help="run the task filters (5 seeds) and write filters.json")
    p.add_argument("--tasks", default=None, help="comma-separated task names (default: all)")
    p.add_argument("--suite", default=None,
                   help="score a public suite's tasks instead of kbench's: a KernelBench level "
                        "folder or file, or robust-kbench's tasks/ folder or one task folder")
    p.add_argument("--dtypes", default=None,
                   help="comma-separated dtypes (default: each task's own list)")
    p.add_argument("--backward", action="store_true",
                   help="also score forward+backward, for tasks that have one")
    p.add_argument("--impl", default="kbench",
                   help="eager | compile | compile-max-autotune | kbench | path to a .py or .cu "
                        "implementation (or a "
                        "folder holding a kernel.cu)")
    p.add_argument("--kernel", default=None, help="same as --impl FILE")
    p.add_argument("--budget", default="default", choices=sorted(harness.BUDGETS),
                   help="repetitions, which configs are timed, kbench's search budget")
    p.add_argument("--baselines", default="eager,compile",
                   help="comma-separated baselines timed beside the implementation: eager, compile, "
                        "compile-max-autotune")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--out", default="benchmarks/results", help="directory for result files")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", metavar="RESULTS_JSON",
                   help="keep the rows of an earlier run's results file (same implementation) and "
                        "run only the others; the file is rewritten after every row")
    p.add_argument("--task-timeout", type=float, metavar="SECONDS",
                   help="bound every request to the implementation's worker (build, call, timing) to "
                        "SECONDS: a task past it fails with the reason and the run goes on")
    return p


class _Progress:
    """tqdm when installed, else one line per step."""

    def __init__(self, total: int, desc: str):
        self.total, self.n, self.desc = total, 0, desc
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
        except ImportError:
            self.bar = None

    def step(self, label: str, status: str = "") -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"{label} {status}".strip())
            self.bar.update(1)
        else:
            print(f"[{self.n}/{self.total}] {self.desc} {label} {status}".rstrip(),
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _tasks(args):
    """The tasks a run covers: kbench's own, or those of the suite at --suite."""
    if getattr(args, "suite", None):
        return suites.select(suites.load(args.suite), args.tasks)
    return select(args.tasks)


def list_tasks(names=None, tasks=None) -> str:
    rows = []
    for t in tasks if tasks is not None else select(names):
        perf = [c["name"] for c in t.configs(perf=True)]
        rows.append((t.name, ",".join(t.dtypes), "yes" if t.backward else "no",
                     len(t.input_configs), ",".join(perf) or "—", len(t.init_configs),
                     t.description))
    return results.markdown_table(
        ("task", "dtypes", "backward", "configs", "perf config", "inits", "description"), rows)


def _device(arg: Optional[str]) -> str:
    import torch
    if arg:
        return arg
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_filters(args) -> int:
    tasks = _tasks(args)
    prog = _Progress(len(tasks), "filters")
    res = filters_mod.run_filters(device=args.device or "cpu", progress=lambda n: prog.step(n),
                                  tasks=tasks)
    prog.close()
    path = filters_mod.write_filters(res, args.out,
                                     name="suite-filters.json" if args.suite else "filters.json")
    print("\n".join(filters_mod.summary_lines(res)))
    print(f"wrote {path}")
    return 1 if filters_mod.failing(res) else 0


SUMMARY_HEADER = ("task", "dtype", "mode", "eager ms", "compile ms", "{impl} ms", "vs eager", "vs compile",
                  "roofline e/c/i", "correctness")


def summary_data(rows: List[dict], impl_name: str):
    """Per row: (label, eager ms, compile ms, impl ms, vs eager, vs compile, roofline by impl)."""
    data = []
    for r in rows:
        ms, roof = {}, {}
        for t in r["timings"]:
            for name, e in t.get("impls", {}).items():
                if e.get("median_ms") is not None and name not in ms:
                    ms[name] = e["median_ms"]
                    roof[name] = (e.get("roofline") or {}).get("fraction")
        data.append((f"{r['task']} {r['dtype']} {r['mode']}", ms.get("eager"), ms.get("compile"), ms.get(impl_name),
                     r.get("speedup_vs_eager"), r.get("speedup_vs_compile"), roof))
    return data


def write_outputs(path_json: str, rows: List[dict], impl_name: str) -> List[str]:
    """Beside the JSON: the summary as CSV and markdown, and PNG plots (when matplotlib is there)."""
    base = path_json[:-5] if path_json.endswith(".json") else path_json
    header = [h.format(impl=impl_name) for h in SUMMARY_HEADER]
    csv_rows = [(r["task"], r["dtype"], r["mode"], *d[1:6],
                 " / ".join(str(d[6].get(k)) for k in ("eager", "compile", impl_name)), r["status"])
                for r, d in zip(rows, summary_data(rows, impl_name))]
    written = [results.write_csv(base + ".csv", header, csv_rows)]
    fp = results.fast_p(rows)
    written.append(results.write_csv(base + "-fast_p.csv", *results.fast_p_table(fp)))
    with open(base + ".md", "w") as f:
        f.write(summary_table(rows, impl_name) + "\n\n"
                + results.markdown_table(*results.fast_p_table(fp)) + "\n")
    written.append(base + ".md")
    data = summary_data(rows, impl_name)
    labels = [d[0] for d in data]
    series = {f"{impl_name} vs eager": [d[4] for d in data], f"{impl_name} vs compile": [d[5] for d in data]}
    roofline = {k: [d[6].get(k) for d in data] for k in ("eager", "compile", impl_name)}
    written += results.write_plots(base, labels, series, roofline)
    return written


def summary_table(rows: List[dict], impl_name: str) -> str:
    out = []
    for r in rows:
        ms = {}
        roof = {}
        for t in r["timings"]:
            for name, e in t.get("impls", {}).items():
                if e.get("median_ms") is not None and name not in ms:
                    ms[name] = e["median_ms"]
                    roof[name] = (e.get("roofline") or {}).get("fraction")
        reason = (r["failures"] or r["task_problems"] or r["flags"] or [""])[0]
        out.append((r["task"], r["dtype"], r["mode"],
                    results.fmt(ms.get("eager")), results.fmt(ms.get("compile")),
                    results.fmt(ms.get(impl_name)),
                    results.fmt(r.get("speedup_vs_eager"), ".2f") + "×",
                    results.fmt(r.get("speedup_vs_compile"), ".2f") + "×",
                    " / ".join(results.fmt(roof.get(k), ".0%")
                               for k in ("eager", "compile", impl_name)),
                    r["status"] + (f": {reason[:70]}" if reason else "")))
    return results.markdown_table(
        ("task", "dtype", "mode", "eager ms", "compile ms", f"{impl_name} ms",
         "vs eager", "vs compile", "roofline e/c/i", "correctness"), out)


def run_bench(args) -> int:
    device = _device(args.device)
    spec = args.kernel or args.impl
    tasks = _tasks(args)
    timeouts = {op: args.task_timeout for op in TIMEOUTS} if args.task_timeout else None
    load_error = None
    with harness.Env(device, args.budget, timeouts=timeouts) as env:
        try:
            # a suite's models are code we did not write: even eager runs in the worker
            if impls.is_builtin(spec) and not args.suite:
                impl_name, factory = impls.resolve(spec, budget=env.budget.kbench_budget)
            else:   # a file: loaded in the worker process, which the harness starts here
                factory = spec if impls.is_builtin(spec) else os.path.abspath(spec)
                if not impls.is_builtin(spec):
                    if not os.path.exists(factory):
                        raise FileNotFoundError(spec)
                    impls.kernel_path(factory)   # a folder must hold a kernel.cu
                try:
                    impl_name = env.runner(factory).start()
                except WorkerError as e:   # a kernel that does not compile: every row says so
                    load_error = str(e)
                    impl_name = spec if impls.is_builtin(spec) else impls.file_name(factory)
                    print(f"error: the implementation did not load: {load_error}",
                          file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - a path that is not there, an in-process load
            print(f"error: cannot load implementation {spec!r}: {type(e).__name__}: {e}",
                  file=sys.stderr)
            return 1
        return _run_units(args, env, device, spec, impl_name, factory, tasks, load_error)


def _error_row(t, dt: str, bw: bool, impl_name: str, why: str) -> dict:
    return {"task": t.name, "dtype": dt, "mode": "fwdbwd" if bw else "fwd", "impl": impl_name,
            "status": "ERROR", "cases": [], "timings": [], "failures": [why],
            "task_problems": [], "flags": []}


def _run_units(args, env, device, spec, impl_name, factory, tasks,
               load_error: Optional[str] = None) -> int:
    """Score every (task, dtype, mode) unit, one row each. Where the implementation did not load
    (load_error), every row is an ERROR row with that reason: the run still writes its files,
    and --resume tries those rows again."""
    import torch
    want = None if not args.dtypes else {dtype_name(parse_dtype(d))
                                         for d in args.dtypes.split(",") if d}
    units = []
    for t in tasks:
        for dt in t.dtypes:
            if want is not None and dt not in want:
                continue
            units.append((t, dt, False))
            if args.backward and t.backward:
                units.append((t, dt, True))
    baselines = tuple(b for b in args.baselines.split(",") if b)
    meta = results.metadata(device)
    if env.cuda:
        env.copy()  # measured up front, in the same run as everything it is compared with
    rows, kept, path = [], {}, None
    if args.resume:
        kept, path = _resumed(args.resume, spec)
    prog = _Progress(len(units), impl_name)

    def doc():
        return {"schema": "kbench-bench/1", "impl": impl_name, "impl_spec": spec,
                "budget": env.budget.name, "meta": meta, "env": env.describe(), "rows": rows,
                "suite": os.path.abspath(args.suite) if args.suite else None,
                "fast_p": results.fast_p(rows)}
    prefix = f"bench-{impl_name}-" + (f"{os.path.basename(os.path.normpath(args.suite))}-"
                                      if args.suite else "")
    path = path or results.results_path(args.out, meta, prefix=prefix)
    for t, dt, bw in units:
        label = f"{t.name} {dt} {'fwd+bwd' if bw else 'fwd'}"
        old = kept.get((t.name, dt, "fwdbwd" if bw else "fwd"))
        if old is not None:
            rows.append(old)
            prog.step(label, old["status"] + " (kept)")
            continue
        if load_error is not None:
            row = _error_row(t, dt, bw, impl_name, load_error)
        else:
            try:
                row = harness.score(t, impl_name, factory, dtype=dt, backward=bw, env=env,
                                    baselines=baselines, seed=args.seed)
            except Exception as e:  # noqa: BLE001 - a harness error must not hide other rows
                row = _error_row(t, dt, bw, impl_name,
                                 f"harness error: {type(e).__name__}: {e}")
        rows.append(row)
        results.write_json(path, doc())     # a run stopped here resumes from this file
        prog.step(label, row["status"])
        if env.cuda:
            torch.cuda.empty_cache()
    prog.close()
    path = results.write_json(path, doc())
    extra = write_outputs(path, rows, impl_name)
    print(summary_table(rows, impl_name))
    bad = [r for r in rows if r["status"] != "PASS"]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} rows pass; results in {path}"
          + (f" (and {', '.join(os.path.basename(x) for x in extra)})" if extra else ""))
    return 1 if bad else 0


def _resumed(path: str, spec: str) -> tuple:
    """({(task, dtype, mode): row}, path) of an earlier results file for the same implementation:
    its finished rows (PASS, FAIL, TASK; not ERROR: a harness error is tried again)."""
    import json
    with open(path) as f:
        doc = json.load(f)
    if doc.get("schema") != "kbench-bench/1":
        raise ValueError(f"{path} is not a kbench bench results file")
    if doc.get("impl_spec") != spec:
        raise ValueError(f"{path} scored {doc.get('impl_spec')!r}, not {spec!r}: nothing to resume")
    return {(r["task"], r["dtype"], r["mode"]): r for r in doc.get("rows", [])
            if r.get("status") != "ERROR"}, path


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.list:
            print(list_tasks(tasks=_tasks(args)))
            return 0
        if args.filters:
            return run_filters(args)
        return run_bench(args)
    except KeyError as e:  # unknown task names
        print(f"error: {e.args[0]}", file=sys.stderr)
        return 2
    except ValueError as e:  # a --suite path that is neither format
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
