"""Result files and tables: run metadata (GPU, torch/CUDA/kbench versions, git commit), the
results path benchmarks/results/<gpu>-<date>-<commit>.json, and markdown tables.
Imports only torch and the standard library."""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
from typing import List, Optional, Sequence


def git_commit(cwd: Optional[str] = None) -> str:
    """$KBENCH_COMMIT when set (a copy of the tree, as on the GPU machine, may carry a stale
    .git), else `git rev-parse HEAD` of the repository holding this file (or cwd), else
    'unknown'."""
    if os.environ.get("KBENCH_COMMIT"):
        return os.environ["KBENCH_COMMIT"]
    here = cwd or os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def kbench_version() -> dict:
    """{"version": ..., "error": ...}: kbench may fail to import (no built core)."""
    try:
        import kbench
        return {"version": getattr(kbench, "__version__", None), "error": None}
    except Exception as e:  # noqa: BLE001
        return {"version": None, "error": f"{type(e).__name__}: {e}"}


def metadata(device) -> dict:
    import torch
    dev = torch.device(device)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "kbench": kbench_version(),
        "commit": git_commit(),
        "argv": sys.argv,
    }
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        meta["gpu_sm"] = f"{p.major}.{p.minor}"
        meta["gpu_memory_bytes"] = p.total_memory
    return meta


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", s).strip("-") or "unknown"


def results_path(out_dir: str, meta: dict, prefix: str = "") -> str:
    """<out_dir>/<prefix><gpu>-<YYYYmmdd-HHMMSS>-<commit[:12]>.json"""
    name = meta.get("gpu") or f"cpu-{meta.get('cpu') or 'unknown'}"
    stamp = meta["date"][:19].replace(":", "").replace("-", "").replace("T", "-")
    fname = f"{prefix}{_slug(name)}-{stamp}-{_slug(meta.get('commit', 'unknown'))[:12]}.json"
    return os.path.join(out_dir, fname)


def write_json(path: str, obj) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(clean(obj), f, indent=1, default=str)
    return path


def clean(obj):
    """NaN/Inf floats to None (strict JSON), tuples to lists, recursively."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def fmt(x, spec: str = ".3f", none: str = "—") -> str:
    if x is None or (isinstance(x, float) and x != x):
        return none
    return format(x, spec)


def markdown_table(header: Sequence[str], rows: List[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


def write_csv(path: str, header: Sequence[str], rows: List[Sequence]) -> str:
    """The summary table as CSV (one row per task, dtype and mode)."""
    import csv
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def write_plots(path_prefix: str, labels: List[str], series: dict, roofline: dict) -> List[str]:
    """PNG bar charts: speedups per task (series: name -> values, e.g. "vs eager") and the
    fraction of the memory roofline per implementation. Needs matplotlib (optional): without it
    nothing is written and [] is returned."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    for name, data, ylabel, ref in (("speedup", series, "speedup (×)", 1.0),
                                    ("roofline", roofline, "fraction of the copy roofline", None)):
        if not labels or not data:
            continue
        fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(labels) * len(data)), 4))
        width = 0.8 / len(data)
        for k, (key, values) in enumerate(data.items()):
            xs = [i + k * width for i in range(len(labels))]
            ax.bar(xs, [v if v is not None else 0 for v in values], width, label=key)
        if ref is not None:
            ax.axhline(ref, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))])
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = f"{path_prefix}-{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


# fast_p (KernelBench's metric, with p the margin): the share of rows that are correct (status
# PASS) and faster than the baseline by more than p, i.e. speedup > 1 + p. KernelBench's own
# fast_p counts speedup > p, so its fast_1 is fast_0 here. Rows whose task cannot discriminate
# (status TASK) are not scored: they are counted apart, not in the share.
FAST_P = (0.0, 0.05, 0.5, 1.0)


def fast_p(rows: List[dict], baselines=None, ps=FAST_P) -> dict:
    """{"rows": scored rows, "not_scored": TASK rows, "correct": share PASS,
    "vs_<baseline>": {"<p>": share}}; baselines: eager, compile and any other a row was timed
    against (compile-max-autotune), unless given."""
    if baselines is None:
        found = {k[len("speedup_vs_"):] for r in rows for k in r
                 if k.startswith("speedup_vs_") and not k.endswith("_mean_based")}
        baselines = ("eager", "compile", *sorted(found - {"eager", "compile"}))
    scored = [r for r in rows if r.get("status") != "TASK"]
    n = len(scored)
    out = {"rows": n, "not_scored": len(rows) - n,
           "correct": sum(r.get("status") == "PASS" for r in scored) / n if n else None}
    for bl in baselines:
        out[f"vs_{bl}"] = {
            f"{p:g}": (sum(1 for r in scored if r.get("status") == "PASS"
                           and (r.get(f"speedup_vs_{bl}") or 0.0) > 1.0 + p) / n) if n else None
            for p in ps}
    return out


def fast_p_table(fp: dict):
    """(header, rows) of fast_p for the CSV and markdown summaries."""
    ps = list(next((v for k, v in fp.items() if k.startswith("vs_")), {}))
    header = ["baseline", "rows scored", "not scored (task)", "correct"] + [f"fast_{p}" for p in ps]
    rows = [(k[3:], fp["rows"], fp["not_scored"], fmt(fp["correct"], ".3f"),
             *(fmt(v[p], ".3f") for p in ps)) for k, v in fp.items() if k.startswith("vs_")]
    return header, rows
