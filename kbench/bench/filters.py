"""Task filters: a task whose outputs barely depend on its inputs or parameters cannot tell a
real kernel from one that returns a constant, so it must not be in the benchmark. Each task is
run on its filter config over 5 seeds (inputs and parameters both reseeded) and checked for:

  range        some output element exceeds 0.01 in magnitude, for every seed;
  seed_std     the per-element standard deviation across seeds, averaged over elements, is at
               least 0.01;
  axes         along every axis of size > 1 the output varies (mean std along the axis is at
               least 1% of the output's overall std): an output constant along an axis lets a
               kernel compute one slice and broadcast it;
  init         some output changes with the init config (or, with one init config, with its
               seed) on the same inputs; not applicable to parameter-free tasks;
  inputs       every output changes when only the inputs change.

Results go to benchmarks/results/filters.json (see run_filters / write_filters).
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Dict, List, Optional

import torch

from .compare import flatten
from .tasks import Task, select

SEEDS = 5
RANGE_MIN = 0.01
SEED_STD_MIN = 0.01
AXIS_REL_MIN = 0.01
CHANGE_REL_MIN = 1e-3  # relative-to-norm change that counts as "the output changed"


def _outputs(task: Task, cfg: dict, device, dtype, init: str, model_seed: int,
             input_seed: int) -> List[torch.Tensor]:
    model = task.build(cfg, dtype, device, init=init, seed=model_seed)
    xs = task.inputs(cfg, dtype, device, seed=input_seed)
    with torch.no_grad():
        outs = flatten(model(*xs))
    return [o.detach().to(torch.float64) for o in outs if o.is_floating_point()]


def _rel_change(a: torch.Tensor, b: torch.Tensor) -> float:
    den = max(torch.linalg.vector_norm(a).item(), torch.linalg.vector_norm(b).item(), 1e-30)
    return torch.linalg.vector_norm(a - b).item() / den


def _check(passed: bool, value, detail: str = "") -> dict:
    return {"passed": bool(passed), "value": value, "detail": detail}


def filter_task(task: Task, device="cpu", dtype="float32", seeds: int = SEEDS) -> dict:
    """Run the five filters on one task; returns {"passed", "config", "checks": {...}}."""
    cfg = task.filter_config()
    inits = list(task.init_configs)
    init0 = inits[0]
    runs = [_outputs(task, cfg, device, dtype, init0, s, 1000 + s) for s in range(seeds)]
    n_out = len(runs[0])
    checks: Dict[str, dict] = {}

    # range: for every seed, every output has an element beyond ±RANGE_MIN
    worst = min(o.abs().max().item() if o.numel() else 0.0 for run in runs for o in run)
    checks["range"] = _check(worst > RANGE_MIN, worst,
                             f"smallest max|output| over seeds and outputs; need > {RANGE_MIN}")

    # seed_std: mean over elements of the std across seeds, for each output
    stds = []
    for k in range(n_out):
        stacked = torch.stack([run[k] for run in runs])
        finite = torch.isfinite(stacked).all(0)
        s = stacked.std(0, unbiased=False)[finite]
        stds.append(s.mean().item() if s.numel() else 0.0)
    checks["seed_std"] = _check(min(stds) >= SEED_STD_MIN, min(stds),
                                f"mean per-element std across {seeds} seeds; need >= "
                                f"{SEED_STD_MIN}")

    # axes: variation along every axis of size > 1, for every output of every seed
    bad_axes = []
    for si, run in enumerate(runs):
        for k, o in enumerate(run):
            overall = o.std(unbiased=False).item() if o.numel() > 1 else 0.0
            for ax, size in enumerate(o.shape):
                if size <= 1:
                    continue
                along = o.std(dim=ax, unbiased=False).mean().item()
                if not along > AXIS_REL_MIN * overall or along == 0.0:
                    bad_axes.append(f"seed {si} output {k} axis {ax} (size {size})")
    checks["axes"] = _check(not bad_axes, len(bad_axes),
                            "; ".join(bad_axes[:4]) or "varies along every axis")

    # init: same inputs, another init config (or the same config reseeded)
    has_params = any(True for _ in task.build(cfg, dtype, device, init=init0).parameters())
    if not has_params:
        checks["init"] = _check(True, None, "not applicable: no parameters")
    else:
        if len(inits) > 1:
            others = [(i, 0) for i in inits[1:]]
        else:
            others = [(init0, 1)]
        changes = []
        for init, mseed in others:
            alt = _outputs(task, cfg, device, dtype, init, mseed, 1000)
            # any output: residual+norm returns x + r, which no parameter touches
            changes.append(max(_rel_change(a, b) for a, b in zip(runs[0], alt)))
        checks["init"] = _check(min(changes) >= CHANGE_REL_MIN, min(changes),
                                f"relative change of the output with the init config; need >= "
                                f"{CHANGE_REL_MIN}")

    # inputs: same model (seed 0), other inputs
    alt = _outputs(task, cfg, device, dtype, init0, 0, 2000)
    change = min(_rel_change(a, b) for a, b in zip(runs[0], alt))
    checks["inputs"] = _check(change >= CHANGE_REL_MIN, change,
                              f"relative change of the output with the inputs alone; need >= "
                              f"{CHANGE_REL_MIN}")
    return {"config": cfg["name"], "init": init0, "dtype": dtype,
            "passed": all(c["passed"] for c in checks.values()), "checks": checks}


def run_filters(names=None, device="cpu", dtype="float32", progress=None,
                tasks=None) -> dict:
    """Filters for the named tasks (all by default), or for `tasks` (Task objects, a suite's).
    `progress(task_name)` is called per task."""
    results = {}
    for task in tasks if tasks is not None else select(names):
        if progress is not None:
            progress(task.name)
        try:
            results[task.name] = filter_task(task, device=device, dtype=dtype)
        except Exception as e:  # a task that cannot even run fails its filters, visibly
            results[task.name] = {"passed": False, "error": f"{type(e).__name__}: {e}",
                                  "checks": {}}
    return {"schema": "kbench-bench-filters/1",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "device": str(device), "dtype": dtype, "seeds": SEEDS,
            "thresholds": {"range": RANGE_MIN, "seed_std": SEED_STD_MIN,
                           "axis_rel": AXIS_REL_MIN, "change_rel": CHANGE_REL_MIN},
            "tasks": results}


def write_filters(result: dict, out_dir: str, merge: bool = True,
                  name: str = "filters.json") -> str:
    """Write `name` under out_dir; with merge, tasks not re-run keep their old entry."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    if merge and os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f)
            tasks = dict(old.get("tasks", {}))
            tasks.update(result["tasks"])
            result = dict(result, tasks=tasks)
        except (OSError, ValueError):
            pass
    with open(path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    return path


def summary_lines(result: dict) -> List[str]:
    lines = []
    for name, r in sorted(result["tasks"].items()):
        if "error" in r:
            lines.append(f"{name:34s} FAIL  {r['error']}")
            continue
        failed = [k for k, c in r["checks"].items() if not c["passed"]]
        lines.append(f"{name:34s} {'PASS' if r['passed'] else 'FAIL'}"
                     + (f"  failed: {', '.join(failed)}" if failed else ""))
    return lines


def failing(result: dict) -> Optional[List[str]]:
    return [n for n, r in result["tasks"].items() if not r["passed"]]
