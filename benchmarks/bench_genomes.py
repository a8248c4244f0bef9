#!/usr/bin/env python
"""Schedules of one task's kernels side by side (GPU): every forward and backward region of a
benchmark task at its timed size, the default genome and a sweep of variants, each gated
against the float64 reference, then timed (CUDA events, L2 flushed, median). Prints registers,
spills, grid, time and the bandwidth of the region's own inputs and outputs, so a default
genome can be checked against its neighbours in one call.

    python benchmarks/bench_genomes.py layer_norm --dtype bfloat16
    python benchmarks/bench_genomes.py layer_norm --genome "threads=256 vec=8 rows=1 cache=reread"
    python benchmarks/bench_genomes.py layer_norm --shape 16384,2048 --no-forward --no-sweep
    python benchmarks/bench_genomes.py cross_entropy --joint   # a loss's forward+backward graph
    ncu --profile-from-start off --section WarpStateStats \
        python benchmarks/bench_genomes.py layer_norm --dtype bfloat16 --profile --no-forward

--profile: no sweep; the default genome (and any --genome) of each region runs once between
cudaProfilerStart and cudaProfilerStop, after its gate and timing, for a profiler to capture.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import kbench  # noqa: E402
from kbench import _C  # noqa: E402
from kbench.dtypes import torch_dtype  # noqa: E402
from kbench.tune import search  # noqa: E402
from kbench.bench.tasks import parse_dtype  # noqa: E402

from bench_ops import OPS, task_model  # noqa: E402

SWEEP = {
    "ROW": [dict(threads=t, rows=rw, cache=c) for t, rw in ((128, 1), (256, 1), (512, 1), (1024, 1), (256, 8))
            for c in ("regs", "smem", "reread")] + [dict(persistent=1), dict(persistent=1, threads=256)],
    "COL": [dict(col_split=s, threads=t) for s in (1, 4, 16, 64) for t in (128, 256)],
    "POINTWISE": [dict(items=i, threads=t) for i in (1, 2, 4) for t in (128, 256, 512)],
}


def variants(p, r, symvals, extra, no_sweep=False):
    """The default genome, then the sweep of the region's kind and the extra texts ('key=value ...')
    over it, each once."""
    base = _C.genome_default(p, r, symvals)
    out = [base]
    sweep = [base.replace(**s) for s in ([] if no_sweep else SWEEP.get(p.region(r)["kind"], []))]
    for genome in sweep + [_C.Genome.parse(f"{base} {text}") for text in extra]:   # a gene given twice: the last
        if genome not in out:
            out.append(genome)
    return out


def region_bytes(plan, r, symvals):
    g = plan.graph
    vals = plan.regions[r].inputs + plan.regions[r].outputs
    return sum(math.prod(g.sizes(v, symvals)) * torch_dtype(plan.nodes[v]["dtype"]).itemsize for v in vals)


def sweep(label, executor, plan, symvals, extra, reps, profile=False, no_sweep=False):
    p = plan.partition
    for r, info in enumerate(plan.regions):
        if info.kind == "EXTERN":
            continue
        nbytes = region_bytes(plan, r, symvals)
        print(f"\n{label} region {r} {info.kind}: {info.ops}  ({nbytes / 1e6:.1f} MB moved)")
        bench = search.CudaRegionBench(executor, r, symvals)
        rows = []
        for genome in variants(p, r, symvals, extra, profile or no_sweep):
            text = str(genome)
            try:
                k = bench.generate(genome)
                bench.compile(k)
                kernel = bench.load(k)
            except Exception as e:  # noqa: BLE001 - a refused genome is a row, not a stop
                print(f"  {text:<95} refused: {str(e).splitlines()[0][:80]}")
                continue
            why = bench.gate(kernel)
            if why:
                print(f"  {text:<95} WRONG: {why[:80]}")
                continue
            ms = statistics.median(bench.time(kernel, reps))
            if profile:  # one launch in the profiler's window
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStart()
                bench.time(kernel, 1, warmup=0)
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
            grid = kernel.grid(symvals)
            rows.append((ms, text))
            print(f"  {text:<95} regs {kernel.regs:>3} spills {kernel.spills:>3} grid {grid:>6}  "
                  f"{ms * 1e3:8.1f} us  {nbytes / ms / 1e6:7.0f} GB/s")
        if rows:
            best = min(rows)
            print(f"  best: {best[1]} ({best[0] * 1e3:.1f} us; default {rows[0][0] * 1e3:.1f} us)")


def status(model, inputs, budget):
    opt = kbench.optimize(model, tuple(inputs), backend="cuda", budget=budget, verbose=False)
    xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    out = opt(*xs)
    out = out if isinstance(out, (tuple, list)) else (out,)
    torch.autograd.backward([o for o in out if o.requires_grad],
                            [torch.randn_like(o) for o in out if o.requires_grad])
    torch.cuda.synchronize()
    print(opt.kbench_report)
    for key, prog in opt._kbench_backward.items():
        if prog is None:
            print(f"backward {key}: eager")
            continue
        for info in prog.plan.regions:
            print(f"backward {key} region {info.index} {info.kind}: {info.status} | {info.genome} | "
                  f"kernel {info.kernel_ms} ms eager {info.eager_ms} ms | {info.extra}")
    print("fallback reasons:", sorted(opt._kbench_reasons))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("task", choices=sorted(OPS))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--genome", action="append", default=[], help="extra variant: 'key=value ...' over the default")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--shape", default=None, metavar="R,C",
                    help="another size than the benchmark's (tasks sized by shape), e.g. 16384,2048")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--no-forward", action="store_true")
    ap.add_argument("--joint", action="store_true",
                    help="a loss: the regions of its joint forward+backward graph (kbench/joint.py) instead")
    ap.add_argument("--profile", action="store_true", help="no sweep; each genome once in a profiler window")
    ap.add_argument("--no-sweep", action="store_true", help="the default genome and the --genome variants only")
    ap.add_argument("--status", default=None, metavar="BUDGET",
                    help="no sweep: optimize with BUDGET, run forward+backward once, print what runs each region")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():   # one line, not a traceback from the first CUDA call
        print("bench_genomes.py: no CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    cfg = None if a.shape is None else dict(shape=tuple(int(d) for d in a.shape.split(",")))
    model, inputs = task_model(a.task, parse_dtype(a.dtype), cfg)
    extra = a.genome
    if a.status:
        return status(model, inputs, a.status)
    opt = kbench.optimize(model, tuple(inputs), backend="cuda", budget="none", verbose=False)
    plan, executor = opt._kbench_plan, opt._kbench_executor
    symvals = list(plan.example_symvals)
    with torch.cuda.device(inputs[0].device):
        if a.joint:
            xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
            opt(*xs)   # a forward with gradients wanted builds the joint program
            for need, jp in opt._kbench_joint.items():
                print(f"joint {need}: {opt._kbench_loss}")
                if jp is not None:
                    sweep("joint", jp.program.executor, jp.program.plan, symvals, extra, a.reps, a.profile, a.no_sweep)
            return
        if not a.no_forward:
            sweep("forward", executor, plan, symvals, extra, a.reps, a.profile, a.no_sweep)
        if a.no_backward:
            return
        for r, info in enumerate(plan.regions):
            if info.kind == "EXTERN":
                continue
            # as in training: every floating input of the region needs its gradient
            need = tuple(torch_dtype(plan.nodes[v]["dtype"]).is_floating_point for v in info.inputs)
            prog = opt._backward_program(r, need)
            if prog is None:
                print(f"\nbackward of region {r}: eager")
                continue
            sweep(f"backward of {r}:", prog.executor, prog.plan, symvals, extra, a.reps, a.profile, a.no_sweep)


if __name__ == "__main__":
    sys.exit(main())
