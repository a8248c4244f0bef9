"""CPU sweep of a KernelBench-style folder: each task file with its module-level sizes shrunk
(integer literals in top-level assignments divided, so sizes derived from them follow), its Model
optimized with the interp backend and called once, the result compared with eager's. Reports the
tasks kbench crashes on, refuses (runs in eager) or answers differently: what a whole level would
meet on a GPU, found on any machine. One subprocess per task, with a time bound.

    python benchmarks/suite_sweep.py path/to/KernelBench/level1 [--shrink 16] [--out sweep.jsonl]
"""
from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import subprocess
import sys
import types

RESULT = "SWEEP-RESULT "


def shrink_source(source: str, factor: int) -> ast.Module:
    """The module with every integer literal >= 256 in a top-level assignment divided by factor
    (at least 8), and, for factor >= 64, those from 32 to 255 divided by 4 (channels, hidden sizes):
    kernel sizes, strides and small counts stay."""
    tree = ast.parse(source)

    class Shrink(ast.NodeTransformer):
        def visit_Constant(self, n):
            v = n.value
            if isinstance(v, int) and not isinstance(v, bool):
                if v >= 256:
                    return ast.copy_location(ast.Constant(max(v // factor, 8)), n)
                if v >= 32 and factor >= 64:
                    return ast.copy_location(ast.Constant(max(v // 4, 8)), n)
            return n

    tree.body = [Shrink().visit(node) if isinstance(node, ast.Assign) else node for node in tree.body]
    return ast.fix_missing_locations(tree)


def run_one(path: str, factor: int, res: dict) -> dict:
    """In the subprocess: build, call eager, optimize (interp), call, compare; res["stage"] says
    how far it got."""
    import warnings

    import torch
    mod = types.ModuleType("sweep_task")
    mod.__file__ = path
    sys.modules["sweep_task"] = mod
    exec(compile(shrink_source(open(path).read(), factor), path, "exec"), mod.__dict__)   # noqa: S102 - the user's suite
    torch.manual_seed(0)
    model = mod.Model(*mod.get_init_inputs()).eval()   # eval: dropout would make eager and kbench differ
    inputs = mod.get_inputs()
    res["inputs"] = [list(x.shape) if isinstance(x, torch.Tensor) else repr(x) for x in inputs]
    res["stage"] = "eager"
    with torch.no_grad():
        want = model(*inputs)
    res["stage"] = "optimize"
    import kbench
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = kbench.optimize(model, tuple(inputs), backend="interp", verbose=False)
    res["stage"] = "call"
    with torch.no_grad():
        got = opt(*inputs)
    res["module"] = type(opt).__name__
    reasons = sorted(getattr(opt, "_kbench_reasons", ()) or ())
    if hasattr(opt, "_kbench_reason"):
        reasons.append(str(opt._kbench_reason))
    res["eager_reasons"] = [r[:300] for r in reasons]
    flat = lambda o: list(o) if isinstance(o, (tuple, list)) else [o]   # noqa: E731
    errs = []
    for a, b in zip(flat(got), flat(want)):
        if not isinstance(b, torch.Tensor):
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            errs.append(f"{list(a.shape)} {a.dtype} where eager gives {list(b.shape)} {b.dtype}")
        elif b.is_floating_point() and b.numel():
            d = (a.double() - b.double()).abs().nan_to_num(0.0).max().item()
            scale = b.double().abs().nan_to_num(0.0).max().item()
            if d > 1e-4 * max(scale, 1.0) or not torch.equal(a.isnan(), b.isnan()):
                errs.append(f"max error {d:.3g} (scale {scale:.3g})")
        elif not b.is_floating_point() and not torch.equal(a, b):
            errs.append("integer output differs")
    res["errors"] = errs
    res["stage"] = "done"
    return res


def verdict(r: dict) -> str:
    if r.get("exception"):
        return "setup" if r.get("stage") in ("load", "eager") else "crash" if r["stage"] != "timeout" else "timeout"
    if r.get("errors"):
        return "wrong"
    return "eager" if r.get("module") != "OptimizedModule" or r.get("eager_reasons") else "ok"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", help="a KernelBench level folder (or any folder of such task files)")
    p.add_argument("--shrink", type=int, default=16, help="divide sizes >= 256 by this (default 16)")
    p.add_argument("--timeout", type=float, default=120, help="seconds per task")
    p.add_argument("--out", default=None, help="JSON lines, one per task")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        res = {"task": os.path.basename(args.one), "stage": "load"}
        try:
            run_one(args.one, args.shrink, res)
        except Exception as e:  # noqa: BLE001 - the row says what failed, and where
            res["exception"] = f"{type(e).__name__}: {str(e)[:400]}"
        print(RESULT + json.dumps(res), flush=True)
        return 0
    files = sorted(glob.glob(os.path.join(args.folder, "*.py")))
    rows, counts = [], {}
    out = open(args.out, "w") if args.out else None
    for i, f in enumerate(files):
        try:
            cp = subprocess.run([sys.executable, __file__, args.folder, "--one", f, "--shrink", str(args.shrink)],
                                capture_output=True, text=True, timeout=args.timeout)
            line = next((ln for ln in cp.stdout.splitlines() if ln.startswith(RESULT)), None)
            r = json.loads(line[len(RESULT):]) if line else {
                "task": os.path.basename(f), "stage": "crash",
                "exception": f"exit {cp.returncode}: {(cp.stderr.strip().splitlines() or [''])[-1][:300]}"}
        except subprocess.TimeoutExpired:
            r = {"task": os.path.basename(f), "stage": "timeout", "exception": f"over {args.timeout:g} s"}
        r["verdict"] = verdict(r)
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
        rows.append(r)
        if out:
            out.write(json.dumps(r) + "\n")
            out.flush()
        if r["verdict"] != "ok":
            why = r.get("exception") or "; ".join(r.get("errors") or r.get("eager_reasons") or [])
            print(f"[{i + 1}/{len(files)}] {r['task']}: {r['verdict']}: {why[:200]}", flush=True)
    print(f"{len(rows)} tasks: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 0 if all(r["verdict"] in ("ok", "setup", "timeout") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
