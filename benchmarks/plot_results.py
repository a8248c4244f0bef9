#!/usr/bin/env python
"""Chart of a bench_ops.py results file (no GPU needed): kbench's speed relative to eager and to
torch.compile for every op and dtype, forward and forward+backward side by side, each bar
labelled with its value. The README's results chart and table come from this script.

    python benchmarks/plot_results.py benchmarks/results/NVIDIA-H100-80GB-HBM3-<date>-<commit>.json \
        -o docs/img/results-h100.png
    python benchmarks/plot_results.py RESULTS.json --device-time   # graph-replay times instead
    python benchmarks/plot_results.py RESULTS.json --table         # the README's markdown table

Needs matplotlib (`pip install matplotlib`); without it, or given a file that is not a
bench_ops.py result, it says so in one line and exits 1.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

SCHEMA = "kbench-bench-ops/1"
MODES = (("fwd", "forward"), ("fwdbwd", "forward + backward"))
BASELINES = (("eager", "vs eager", "#4c72b0"), ("compile", "vs torch.compile", "#dd8452"))
DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}


def speedups(doc: dict, field: str) -> dict:
    """{mode: [(label, {baseline: baseline time / kbench time})]} in the file's row order. A
    baseline missing from a row (an error, an impl not run) leaves that bar out."""
    out = {mode: [] for mode, _ in MODES}
    for row in doc["rows"]:
        cells = row.get("impls", {})
        k = cells.get("kbench", {}).get(field)
        if row.get("mode") not in out or not k:
            continue
        ratios = {b: cells[b][field] / k for b, _, _ in BASELINES if cells.get(b, {}).get(field)}
        out[row["mode"]].append((f"{row['task']} {DTYPES.get(row['dtype'], row['dtype'])}", ratios))
    return out


def title(doc: dict, device_time: bool) -> str:
    meta = doc.get("meta", {})
    argv, skip = [], False
    for arg in meta.get("argv", []):   # the command as run, less where it wrote its files
        if arg.startswith("--out="):
            continue
        if skip or arg == "--out":
            skip = not skip
            continue
        argv.append(arg)
    argv = " ".join(argv)
    how = ("device time (CUDA-graph replay, host removed)" if device_time
           else "per call (CUDA events around each call, host included)")
    return (f"kbench speedup on {meta.get('gpu') or meta.get('device', '?')}, commit "
            f"{meta.get('commit', '?')}: {how}\n"
            f"python {argv or 'benchmarks/bench_ops.py'}  ·  bars: baseline time / kbench time, "
            f"> 1 is kbench faster")


def table(doc: dict) -> str:
    """Markdown: per op and dtype, forward then forward+backward, kbench's per-call speed over
    eager and torch.compile and its device-time roofline fraction; geometric means last."""
    cells, order = {}, []
    for row in doc["rows"]:
        c = row.get("impls", {})
        k = c.get("kbench", {})
        key = (row["task"], DTYPES.get(row["dtype"], row["dtype"]))
        if key not in cells:
            cells[key] = {}
            order.append(key)

        def over(base):
            b = c.get(base, {}).get("median_ms")
            return b / k["median_ms"] if b and k.get("median_ms") else None
        cells[key][row["mode"]] = (over("eager"), over("compile"), k.get("graph_roofline_fraction"))

    def fmt(x, kind):
        return "—" if x is None else (f"{x:.2f}×" if kind == "x" else f"{x:.0%}")

    head = ("| op | dtype | fwd vs eager | fwd vs compile | fwd device roofline "
            "| fwd+bwd vs eager | fwd+bwd vs compile | fwd+bwd device roofline |")
    lines = [head, "|" + "---|" * 8]
    for key in order:
        parts = []
        for mode, _ in MODES:
            e, cmp_, roof = cells[key].get(mode, (None, None, None))
            parts += [fmt(e, "x"), fmt(cmp_, "x"), fmt(roof, "%")]
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(parts) + " |")
    geo = []
    for mode, _ in MODES:
        for i in range(2):
            xs = [cells[k][mode][i] for k in order if mode in cells[k] and cells[k][mode][i]]
            geo.append(fmt(math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None, "x"))
        roofs = [cells[k][mode][2] for k in order if mode in cells[k] and cells[k][mode][2]]
        geo.append(f"≥ {min(roofs):.0%}" if roofs else "—")
    lines.append("| **geometric mean** (roofline: least) | | " + " | ".join(geo) + " |")
    return "\n".join(lines)


def plot(doc: dict, out: Path, device_time: bool = False) -> Path:
    import matplotlib
    matplotlib.use("Agg")   # files only: no display on a server
    import matplotlib.pyplot as plt

    data = speedups(doc, "graph_ms" if device_time else "median_ms")
    rows = max(len(v) for v in data.values()) or 1
    fig, axes = plt.subplots(1, len(MODES), figsize=(15, 1.2 + 0.36 * rows), sharex=True)
    values = [r for v in data.values() for _, ratios in v for r in ratios.values()]
    hi = max(values, default=2.0) * 1.6   # room for the labels right of the longest bar
    lo = min(min(values, default=1.0), 1.0) / 1.6   # and left of the slowest
    height = 0.38
    for ax, (mode, name) in zip(axes, MODES):
        entries = data[mode]
        for j, (base, label, color) in enumerate(BASELINES):
            ys = [i + (j - 0.5) * height for i in range(len(entries))]
            xs = [ratios.get(base, math.nan) for _, ratios in entries]
            # bars grow from 1×: a slower row points left of the line
            ax.barh(ys, [x - 1 for x in xs], height=height, color=color, label=label, left=1)
            for y, x in zip(ys, xs):
                if not math.isnan(x):
                    right = x >= 1
                    ax.text(x * (1.03 if right else 1 / 1.03), y, f"{x:.2f}×", va="center",
                            ha="left" if right else "right", fontsize=7.5)
        ax.set_yticks(range(len(entries)))
        ax.set_yticklabels([lab for lab, _ in entries], fontsize=8.5)
        ax.invert_yaxis()   # the file's first row on top
        ax.set_xscale("log")
        ax.set_xlim(lo, hi)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(name, fontsize=11)
        ax.set_xlabel("speedup (log scale)")
        ticks = [t for t in (0.5, 1, 2, 4, 8, 16) if lo <= t <= hi]
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}×" for t in ticks])
        ax.grid(axis="x", linewidth=0.3)
    axes[0].legend(loc="lower right", fontsize=8.5)
    fig.suptitle(title(doc, device_time), fontsize=10.5)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def read(path: str):
    """The results document, or None after one line on stderr saying why not."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        print(f"plot_results.py: cannot read {path}: {e}", file=sys.stderr)
        return None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        print(f"plot_results.py: {path} is not a bench_ops.py result (schema {SCHEMA})", file=sys.stderr)
        return None
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a JSON file written by benchmarks/bench_ops.py")
    ap.add_argument("-o", "--out", default=None, help="PNG to write (default: the results file's name, .png)")
    ap.add_argument("--device-time", action="store_true",
                    help="plot device time (graph_ms) instead of per-call time (median_ms)")
    ap.add_argument("--table", action="store_true",
                    help="print the README's markdown table instead of drawing (no matplotlib needed)")
    a = ap.parse_args(argv)
    doc = read(a.results)
    if doc is None:
        return 1
    if a.table:
        print(table(doc))
        return 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_results.py: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return 1
    out = plot(doc, Path(a.out) if a.out else Path(a.results).with_suffix(".png"), a.device_time)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
