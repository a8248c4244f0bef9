#!/usr/bin/env python
"""Where a no-grad forward's host time goes, layer by layer, for a few one-region tasks at the
benchmark's host size (8 rows), under no_grad as bench_ops times it: the module call (what
bench_ops reports; kbench._fast.module_call), the same through torch's nn.Module.__call__ and
through forward(), Program.call alone, the region's kbench._fast.Launch alone, and torch's own
pieces (empty_like, a tiny kernel) for scale. Each the least of several alternated runs of
host_overhead_us.

    python benchmarks/host_split.py residual_layer_norm:bfloat16 layer_norm:bfloat16
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import kbench  # noqa: E402
from kbench.bench import timing  # noqa: E402
from kbench.bench.tasks import parse_dtype  # noqa: E402
from kbench.runtime import KERNEL, _fast_launch  # noqa: E402

from bench_ops import task_model  # noqa: E402

REPEATS = 7


def main(argv=None):
    specs = (argv or sys.argv[1:]) or ["residual_layer_norm:bfloat16", "residual_layer_norm:float32",
                                       "layer_norm:bfloat16"]
    dev = torch.device("cuda")
    for spec in specs:
        op, _, dt = spec.partition(":")
        dtype = parse_dtype(dt or "float32")
        model, xs = task_model(op, dtype, dict(shape=(8, 4096)))
        opt = kbench.optimize(model, tuple(xs), backend="cuda", budget="none", verbose=False)
        with torch.no_grad():
            opt(*xs)
        program = opt._kbench_fast_program
        bound = next(iter(opt._kbench_sigs.values()))
        kernels = [s for s in bound.steps if s.kind == KERNEL]
        launch = _fast_launch(kernels[0].launch_nograd or kernels[0].launch) if kernels else None
        step_ins = None
        if launch is not None:   # the region's inputs: slots are the graph inputs, then the parameters
            slots = [*xs, *(p.detach() for p in opt._params())]
            step_ins = [slots[i] for i in kernels[0].ins]

        # as bench_ops times them: no_grad around the whole timing, not each call
        rows = {"eager module": (model, xs), "kbench module": (opt, xs),
                "kbench via nn.Module.__call__": (lambda *a: torch.nn.Module.__call__(opt, *a), xs),
                "kbench forward()": (opt.forward, xs)}
        if program is not None:
            rows["Program.call"] = (lambda *a: program.call(opt, a), xs)
        if step_ins is not None:
            rows["Launch.run (the kernel)"] = (lambda *a: launch.run(list(a)), step_ins)
        rows["torch.empty_like(x)"] = (lambda x: torch.empty_like(x), xs[:1])
        rows["x.add_(0)"] = (lambda x: x.add_(0), [xs[0].clone()])
        best = {k: float("inf") for k in rows}
        with torch.no_grad():
            for _ in range(REPEATS):   # alternated: a slow stretch of host lands on every row
                for name, (fn, args) in rows.items():
                    best[name] = min(best[name], timing.host_overhead_us(fn, args, calls=500, device=dev))
        print(f"{op} {dt} (8, 4096), regions {len(kernels)}, Program served {getattr(program, 'served', None)}")
        for name, us in best.items():
            print(f"  {name:<26} {us:7.2f} us")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
