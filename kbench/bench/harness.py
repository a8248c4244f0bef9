"""The robust harness: scores one implementation of one task (docs/benchmarking.md, "The robust
harness") so that the known loopholes fail loudly instead of winning.

This module is the checker: it builds the task's model and the float64 reference, draws inputs,
and decides. The implementation runs elsewhere (runner.py): an implementation file in a worker
process it cannot reach from there, a trusted callable through the same code in this process.
What comes back are facts, copies of outputs and timings, checked here against references of
this process's own.

For every (input config, init config) the implementation, built once per model, is run as
candidate -> reference -> candidate on private copies of two input sets:
  - memory the caching allocator is about to hand out is poisoned before each candidate call
    (NaN the first time, random bytes the second), so an output element the kernel never
    writes holds garbage, not a previous correct answer;
  - outputs are copied the moment the call returns (on CUDA: next on the current stream); an
    output that changes afterwards was still being written on another stream or thread;
  - outputs (and, for backward, gradients of every floating input and parameter) must be
    exactly torch.Tensor of the right dtype/shape/device, not alias an input, match the float64
    reference within per-dtype tolerances widened to EAGER_SLACK x eager's own error, and have
    NaN/Inf where the reference has them;
  - inputs must be bit-for-bit unchanged afterwards, and so must the model's parameters;
  - the output must change when the inputs change (a cached or input-independent result);
  - a reference that zeros, a constant or an input would match is reported (the case cannot
    discriminate);
  - parameters are re-initialised IN PLACE between init configs, so values baked in at build
    time are caught, and batch sizes other than the example's are checked with the same build.
Timing (kbench/tune/timing.py) gives every call fresh input tensors rotating among
timing.MIN_ARG_SETS sets, samples timed calls' outputs (each checked here against the reference
of its set), times with events on the current stream and the L2 flushed, cross-checks against
wall-clock time (the worker's and this process's own clock) and flags results beyond the
memory/compute roofline as impossible.
"""
from __future__ import annotations

import dataclasses
import math
import traceback
from typing import Callable, Dict, List, Optional, Union

import torch

from ..tune import timing
from . import compare
from . import impls as impl_mod
from .compare import flatten, to_f64
from .runner import LocalRunner, Tampered, WorkerError, WorkerRunner
from .tasks import Task, dtype_name, parse_dtype
from .worker import CaseFailure, poison, run_call  # noqa: F401 - poison, CaseFailure: public here

CHANGE_REL_MIN = 1e-3   # the reference "changed" between input sets
SAME_REL_MAX = 1e-6     # ...but the candidate did not
MAX_REASONS = 12


@dataclasses.dataclass(frozen=True)
class Budget:
    name: str
    reps: int
    warmup: int
    perf_configs: bool      # check and time the large configs (on a GPU)
    time_all: bool          # time every config, not only the perf one(s)
    kbench_budget: str      # passed to kbench.optimize


BUDGETS = {
    "quick": Budget("quick", reps=10, warmup=2, perf_configs=False, time_all=False,
                    kbench_budget="fast"),
    "default": Budget("default", reps=50, warmup=5, perf_configs=True, time_all=False,
                      kbench_budget="default"),
    "full": Budget("full", reps=200, warmup=10, perf_configs=True, time_all=True,
                   kbench_budget="max"),
}


class Env:
    """What one harness run shares: device, budget, roofs measured in this same run, and the
    worker processes implementation files run in (one per file; close() or `with` ends them).

    share_worker=True: every file scored in this Env runs in one worker, loaded one after another
    (a test suite saves the worker's start-up so). What one file patched there stays patched for
    the next; the verdicts do not depend on anything in the worker, but its timings could."""

    def __init__(self, device="cuda", budget: str | Budget = "default", *,
                 share_worker: bool = False, timeouts: Optional[dict] = None):
        self.device = torch.device(device)
        self.budget = BUDGETS[budget] if isinstance(budget, str) else budget
        self.share_worker, self.timeouts = share_worker, timeouts
        self._copy: Optional[dict] = None
        self._mm: Dict[str, dict] = {}
        self._workers: Dict[str, WorkerRunner] = {}

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def runner(self, impl: Union[Callable, str]):
        """Where `impl` runs: a callable in this process, a spec (a file, or a built-in's name)
        in a worker process."""
        if callable(impl):
            return LocalRunner(impl, self.device)
        if impl not in self._workers:
            shared = next(iter(self._workers.values()), None) if self.share_worker else None
            self._workers[impl] = (shared.with_spec(impl) if shared is not None else
                                   WorkerRunner(impl, self.device,
                                                budget=self.budget.kbench_budget,
                                                timeouts=self.timeouts))
        return self._workers[impl]

    def close(self) -> None:
        for w in self._workers.values():
            w.close()
        self._workers.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def copy(self) -> dict:
        if self._copy is None:
            nbytes = (1 << 30) if self.cuda else (16 << 20)
            self._copy = timing.copy_bandwidth(self.device, nbytes)
        return self._copy

    def matmul(self, dtype) -> dict:
        key = dtype_name(parse_dtype(dtype))
        if key not in self._mm:
            self._mm[key] = timing.matmul_flops(self.device, parse_dtype(dtype))
        return self._mm[key]

    def describe(self) -> dict:
        d = {"device": str(self.device), "budget": self.budget.name,
             "copy": self._copy, "matmul": self._mm}
        if self.cuda:
            d["gpu"] = torch.cuda.get_device_name(self.device)
            d["l2_bytes"] = timing.l2_bytes(self.device)
        return d


# ------------------------------------------------------------------------- references

def _clone(xs: list) -> list:
    return [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in xs]


def _grad_outputs(model, xs, seed: int, device) -> list:
    """Random upstream gradients shaped like the model's outputs (None for non-float ones)."""
    with torch.no_grad():
        outs = flatten(model(*_clone(xs)))
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(o.shape, generator=g, device=device).to(o.dtype)
            if isinstance(o, torch.Tensor) and o.is_floating_point() else None for o in outs]


def _expected(model, ref_model, xs, gouts, backward):
    """Eager's outputs and gradients on xs (in the task's dtype) and the float64 reference's:
    (eager outputs, eager outputs + gradients, reference outputs + gradients)."""
    e_out, _, e_gr = run_call(model, _clone(xs), list(model.parameters()), gouts, backward)
    r_out, _, r_gr = run_call(ref_model, [to_f64(x) for x in xs], list(ref_model.parameters()),
                              [to_f64(g) for g in gouts] if backward else None, backward)
    return e_out, e_out + list(e_gr), r_out + list(r_gr)


def _labels(model, xs, n_out: int) -> List[str]:
    n_in = sum(1 for x in xs if isinstance(x, torch.Tensor) and x.is_floating_point())
    return ([f"output {i}" for i in range(n_out)] + [f"grad of input {i}" for i in range(n_in)]
            + [f"grad of {n}" for n, _ in model.named_parameters()])


def _tolerances(expect, refs) -> list:
    return [None if e is None or r is None or not r.is_floating_point()
            else compare.tolerance(e.dtype, r, compare.errors(e, r))
            for e, r in zip(expect, refs)]


def _same_inputs(xs: list, pristine: list) -> str:
    for i, (a, b) in enumerate(zip(xs, pristine)):
        if isinstance(a, torch.Tensor) and not torch.equal(a.detach(), b):
            return f"modified input {i} in place"
    return ""


def _state_problem(got: list, model) -> str:
    """'' if the implementation's copy of the model's state (state_dict order) still holds the
    values it was given."""
    names = list(model.state_dict(keep_vars=True))
    want = list(model.state_dict(keep_vars=True).values())
    if len(got) != len(want):
        return f"the model's state has {len(got)} tensors, expected {len(want)}"
    for n, g, w in zip(names, got, want):
        if g is None or g.shape != w.shape or g.dtype != w.dtype or not torch.equal(g, w.detach()):
            return f"modified the model's {n}"
    return ""


# ------------------------------------------------------------------------- correctness

def check_config(task: Task, run, key: str, model: torch.nn.Module, cfg: dict, dtype,
                 device, backward: bool, seed: int = 0) -> dict:
    """Candidate -> reference -> candidate on two input sets of one config; `run` (a runner,
    runner.py) holds the candidate built under `key`. Returns {"config", "ok", "failures",
    "task_problems", "max_rel_norm", "deterministic"}."""
    ref_model = task.reference(model)
    failures: List[str] = []
    task_problems: List[str] = []
    worst = 0.0
    deterministic = True
    firsts = []  # (candidate forward outputs, reference forward outputs) per input set
    name = cfg["name"]

    for s in (seed, seed + 7919):
        xs = task.inputs(cfg, dtype, device, seed=s)
        gouts = _grad_outputs(model, xs, s + 1, device) if backward else None
        e_out, expect, refs = _expected(model, ref_model, xs, gouts, backward)
        labels = _labels(model, xs, len(e_out))
        tols = _tolerances(expect, refs)
        for lab, r, tol in zip(labels, refs, tols):
            why = tol and compare.discriminating(r, tol, xs if lab.startswith("output") else ())
            if why:
                task_problems.append(f"{name}: {lab}: {why}")

        runs = []
        for k, kind in enumerate(("nan", "random")):
            try:
                # the second call runs the task's module first, in the candidate's process:
                # its freed blocks are what a stale output would pick up, and poison covers them
                res = run.call(key, xs, gouts, backward, kind,
                               [t for t in expect if t is not None], model_first=k == 1)
            except WorkerError as e:
                failures.append(f"{name}: {e}")
                break
            if "error" in res:
                failures.append(f"{name}: {res['error']}")
                break
            why = _same_inputs(res["inputs_after"], xs)
            if why:
                failures.append(f"{name}: {why}")
            why = compare.structure_problem(res["facts"], e_out)
            if why:
                failures.append(f"{name}: {why}")
                break
            for i in res["late"]:
                failures.append(f"{name}: output {i} changed after the call returned (work "
                                f"still running on another stream or thread when it returned)")
            got = res["outs"] + res["grads"]
            gfacts = [None] * len(e_out) + res["grad_facts"]
            why = _grad_key_sets(labels[len(e_out):], got[len(e_out):], expect[len(e_out):])
            if why:
                failures.append(f"{name}: {why} ({kind}-poisoned run)")
            for j, (lab, c, e, r, tol) in enumerate(zip(labels, got, expect, refs, tols)):
                if e is None or (c is None and j >= len(e_out)):   # gradients: just above
                    continue
                if c is None:
                    failures.append(f"{name}: {lab} missing")
                    continue
                if gfacts[j] is not None:
                    why = compare.structure_problem([gfacts[j]], [e])
                    if why:
                        failures.append(f"{name}: {lab}: {why}")
                        continue
                if tol is None:
                    ok, why = torch.equal(c.cpu(), r.cpu()), "differs"
                else:
                    ok, why, err = compare.close(c, r, tol)
                    worst = max(worst, err.get("rel_norm", 0.0) if err else 0.0)
                if not ok:
                    failures.append(f"{name}: {lab} ({kind}-poisoned run): {why}")
            runs.append(got)
        if len(runs) == 2:
            deterministic &= all(a is None or b is None or torch.equal(a, b)
                                 for a, b in zip(*runs))
            firsts.append((runs[0][:len(e_out)], refs[:len(e_out)]))
        else:
            break

    if len(firsts) == 2:
        (ca, ra), (cb, rb) = firsts
        for i, (a, b, x, y) in enumerate(zip(ca, cb, ra, rb)):
            if not x.is_floating_point():
                continue
            if (_rel_change(x, y) >= CHANGE_REL_MIN and a.shape == b.shape
                    and _rel_change(a.double(), b.double()) <= SAME_REL_MAX):
                failures.append(f"{name}: output {i} does not change when the inputs "
                                f"do (cached or input-independent result)")
    return {"config": name, "ok": not failures and not task_problems,
            "failures": failures, "task_problems": task_problems, "max_rel_norm": worst,
            "deterministic": deterministic}


def _grad_key_sets(labels: list, got: list, expect: list) -> str:
    """'' where the candidate has a gradient for exactly the inputs and parameters eager has one
    for (robust-kbench's check: the gradient key sets are equal); else which are missing and
    which are extra (a gradient where eager's is None: the input or parameter does not reach
    the output, or cannot be differentiated)."""
    missing = [lab for lab, c, e in zip(labels, got, expect) if e is not None and c is None]
    extra = [lab for lab, c, e in zip(labels, got, expect) if e is None and c is not None]
    if not missing and not extra:
        return ""
    parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
        ([f"extra {', '.join(extra)} (the reference has none)"] if extra else [])
    return "the gradient key sets differ: " + "; ".join(parts)


def _rel_change(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    fin = torch.isfinite(a) & torch.isfinite(b)
    a, b = a[fin], b[fin]
    den = max(torch.linalg.vector_norm(a).item(), torch.linalg.vector_norm(b).item(), 1e-30)
    return torch.linalg.vector_norm(a - b).item() / den


def _reinit_in_place(task: Task, model, cfg, dtype, device, init: str, seed: int) -> None:
    """Give `model` the values of init config `init` without replacing its tensors."""
    fresh = task.build(cfg, dtype, device, init=init, seed=seed)
    with torch.no_grad():
        for (_, dst), (_, src) in zip(model.state_dict(keep_vars=True).items(),
                                      fresh.state_dict(keep_vars=True).items()):
            dst.copy_(src)


def _state(model) -> list:
    return [t.detach() for t in model.state_dict(keep_vars=True).values()]


# ------------------------------------------------------------------------- timing

def _check_samples(samples: list, per_set: list, n_expect: int) -> List[str]:
    """The sampled timed calls' outputs against the reference of each call's input set."""
    bad = []
    for call, s, got in samples:
        labels, expect, refs, tols = per_set[s]
        if len(got) != n_expect:
            bad.append(f"timed call {call}: returned {len(got)} outputs and gradients, "
                       f"expected {n_expect}")
            continue
        for lab, c, e, r, tol in zip(labels, got, expect, refs, tols):
            if e is None:
                continue
            if c is None:
                bad.append(f"timed call {call} (input set {s}): {lab} missing")
            elif c.dtype != e.dtype or tuple(c.shape) != tuple(e.shape):
                bad.append(f"timed call {call} (input set {s}): {lab} has "
                           f"{c.dtype} {tuple(c.shape)}, expected {e.dtype} {tuple(e.shape)}")
            else:
                ok, why = ((torch.equal(c.cpu(), r.cpu()), "differs") if tol is None
                           else compare.close(c, r, tol)[:2])
                if not ok:
                    bad.append(f"timed call {call} (input set {s}): {lab}: {why}")
    return bad


# What the wall-clock loop's two marks may add to the runner's clock of a worker's loop (ms):
# each is a message between processes.
RUNNER_MARK_SLACK_MS = 2.0


def _runner_clock(entry: dict, loops: list, cuda: bool) -> None:
    """The wall-clock cross-check on the runner's own clock (for a worker: this process's clock
    and the worker's CPU time as the kernel counts it), beside the one the timer made."""
    per_call = entry.get("loop_event_ms")
    n = entry.get("wall_calls") or 0
    if not loops or not n or not per_call:
        return
    # CPU: the lesser of wall and CPU time (a busy machine stretches the wall clock only);
    # CUDA: the wall clock (the device's work is not CPU time)
    best = min(w if cuda or c is None else min(w, c) for w, c in loops) * 1e3 / n
    entry["runner_wall_ms"] = best
    entry["runner_wall_over_event"] = best / max(per_call, 1e-9)
    # the loop's marks cross between processes: their round trips are in this clock's loop
    # time and not in the timer's, so a loop of microsecond calls must exceed by more than that
    if timing.is_hidden_work(best, per_call, "cuda" if cuda else "cpu") \
            and (best - per_call) * n > RUNNER_MARK_SLACK_MS:
        entry["hidden_work"] = True


def time_config(task: Task, contenders: Dict[str, tuple], model, cfg: dict, dtype, env: Env,
                backward: bool) -> dict:
    """Time each of `contenders` ({name: (runner, key)}) on fresh copies of the same rotated
    input sets of one config, in this run; check the timed calls' sampled outputs."""
    device, b = env.device, env.budget
    arg_sets = [task.inputs(cfg, dtype, device, seed=100 + i)
                for i in range(timing.MIN_ARG_SETS)]
    gouts = _grad_outputs(model, arg_sets[0], 99, device) if backward else None
    ref_model = task.reference(model)
    per_set = []
    for a in arg_sets:
        e_out, expect, refs = _expected(model, ref_model, a, gouts, backward)
        per_set.append((_labels(model, a, len(e_out)), expect, refs, _tolerances(expect, refs)))
    with torch.no_grad():
        outs = model(*arg_sets[0])
    nbytes = task.bytes_moved(cfg, dtype, backward, model, arg_sets[0], outs)
    del outs
    flops = task.flops(cfg, backward)
    res = {"config": cfg["name"], "bytes": nbytes, "flops": flops, "impls": {}}
    for name, (run, key) in contenders.items():
        entry: dict = {}
        try:
            r = run.time(key, arg_sets, gouts, backward, reps=b.reps, warmup=b.warmup)
            entry.update(r["timing"])
            _runner_clock(entry, r["marks"], env.cuda)
            bad = r["problems"] + _check_samples(r["samples"], per_set, len(per_set[0][1]))
            entry["samples_checked"] = len(r["samples"])
            if not r["samples"]:   # the timer keeps at least one: its code did not run
                bad.append("no timed call's output came back to be checked")
            if not r["marks"]:
                bad.append("the timer's wall-clock loop never reported (its marks are missing)")
            if bad:
                entry["sample_failures"] = bad
            mm = env.matmul(dtype)["flops_per_s"] if flops else 0.0
            roof = timing.roofline(nbytes, entry["median_ms"], env.copy()["bytes_per_s"],
                                   flops, mm)
            # Outputs smaller than L2 can finish in cache before reaching DRAM, so only a
            # working set well beyond L2 makes "faster than the roofline" impossible.
            if not env.cuda or nbytes < 2 * timing.l2_bytes(device):
                roof["impossible"] = False
            entry["roofline"] = roof
        except WorkerError as e:
            entry["error"] = str(e)
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {e}"
        res["impls"][name] = entry
    return res


# ------------------------------------------------------------------------- scoring

def _perf_cfgs(task: Task, env: Env) -> List[dict]:
    return task.configs(perf=True) if (env.cuda and env.budget.perf_configs) else []


def timed_configs(task: Task, env: Env, only: Optional[List[str]] = None) -> List[str]:
    if env.budget.time_all:
        return [c["name"] for c in task.configs(perf=False) + _perf_cfgs(task, env)
                if only is None or c["name"] in only]
    perf = [c for c in _perf_cfgs(task, env) if only is None or c["name"] in only]
    if perf:
        return [c["name"] for c in perf]
    # no perf config here (CPU, quick budget): the largest of the small ones
    def size(c):
        return sum(x.numel() for x in task.inputs(c, "float32", "cpu", 0)
                   if isinstance(x, torch.Tensor))
    small = [c for c in task.configs(perf=False) if only is None or c["name"] in only]
    return [max(small, key=size)["name"]] if small else []


def score(task: Task, impl_name: str, factory: Union[Callable, str], *, dtype, backward: bool,
          env: Env, baselines=("eager", "compile"), seed: int = 0,
          configs: Optional[List[str]] = None, profile: bool = False) -> dict:
    """One row: `impl_name` on `task` in `dtype`, forward (or forward+backward), every config
    (or those named in `configs`) and init config checked, the timed configs timed against the
    baselines. `factory` is a callable (run in this process) or a spec, an implementation file
    or a built-in's name (run in env's worker process). profile: an implementation that passed
    its checks gets one more call, at the first config, under the profiler, where it runs:
    row["profile"] (see profile_row); feedback, not part of the verdict."""
    dtype = dtype_name(parse_dtype(dtype))
    device = env.device
    all_cfgs = task.configs(perf=False) + _perf_cfgs(task, env)
    chosen = [c for c in all_cfgs if configs is None or c["name"] in configs]
    to_time = set(timed_configs(task, env, configs))
    groups: Dict[tuple, List[dict]] = {}
    for c in chosen:
        groups.setdefault(task.group_key(c), []).append(c)

    row = {"task": task.name, "dtype": dtype, "mode": "fwdbwd" if backward else "fwd",
           "impl": impl_name, "cases": [], "timings": [], "failures": [],
           "task_problems": [], "flags": []}
    if configs is not None and not chosen:
        raise KeyError(f"task {task.name} has none of the configs {configs}")
    run = env.runner(factory)
    inits = list(task.init_configs)
    for gi, group in enumerate(groups.values()):
        model = task.build(group[0], dtype, device, init=inits[0], seed=seed)
        key = f"{task.name}/{dtype}/{row['mode']}/{gi}"
        try:
            run.build(key, task, group[0], dtype, inits[0], seed, model)
        except Exception as e:  # noqa: BLE001
            why = str(e) if isinstance(e, WorkerError) else f"{type(e).__name__}: {e}"
            row["failures"].append(f"building the implementation failed: {why}")
            row["traceback"] = traceback.format_exc(limit=6)
            continue
        try:
            _score_group(task, row, run, key, model, group, to_time, dtype, env, backward,
                         baselines, impl_name, seed, inits)
            if profile and gi == 0 and not row["failures"] and not row["task_problems"]:
                profile_row(task, row, run, key, model, group[0], dtype, env, backward, seed)
        finally:
            try:
                run.drop(key)
            except WorkerError:
                pass
    _summarize(row, impl_name, baselines)
    return row


def profile_row(task, row, run, key, model, cfg, dtype, env, backward, seed) -> None:
    """row["profile"]: one call of the implementation built under `key` on cfg's inputs under
    the profiler, in the implementation's process (worker.profile_call), as plain data with the
    config's name; or "profile unavailable: <reason>" where the profiler, the call or the worker
    failed (the candidate's verdict stays as it is). The worker wrote the summary: it is advice
    for the next proposal, never a time the harness reports. The one exception is a worker that
    replaced the harness's code meanwhile: that fails the row as it would anywhere."""
    xs = task.inputs(cfg, dtype, env.device, seed=seed)
    gouts = _grad_outputs(model, xs, seed + 1, env.device) if backward else None
    try:
        p = run.profile(key, xs, gouts, backward)
    except Tampered as e:
        row["failures"].append(f"while profiling: {e}")
        return
    except Exception as e:  # noqa: BLE001 - a profile is advisory: its failure is only noted
        p = {"unavailable": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    row["profile"] = (f"profile unavailable: {p['unavailable']}" if "unavailable" in p
                      else dict(p, config=cfg["name"]))


def _score_group(task, row, run, key, model, group, to_time, dtype, env, backward, baselines,
                 impl_name, seed, inits) -> None:
    device = env.device
    for ii, init in enumerate(inits):
        try:
            if ii:
                _reinit_in_place(task, model, group[0], dtype, device, init, seed)
                run.set_state(key, _state(model))
            for cfg in group:
                case = check_config(task, run, key, model, cfg, dtype, device, backward, seed)
                case["init"] = init
                row["cases"].append(case)
                row["failures"] += [f"[{init}] {f}" for f in case["failures"]]
                row["task_problems"] += case["task_problems"]
            why = _state_problem(run.state(key), model)
            if why:
                row["failures"].append(f"[{init}] {why}")
        except WorkerError as e:
            row["failures"].append(f"[{init}] {e}")
            return
    # time with the first init config's values, the candidate beside the baselines
    _reinit_in_place(task, model, group[0], dtype, device, inits[0], seed)
    try:
        run.set_state(key, _state(model))
    except WorkerError as e:
        row["failures"].append(str(e))
        return
    for cfg in group:
        if cfg["name"] not in to_time:
            continue
        contenders = {impl_name: (run, key)}
        local = []
        for bl in baselines:
            if bl == impl_name:
                continue
            try:
                # a suite task's model is code we did not write: its baselines run in workers
                lr = env.runner(bl if getattr(task, "remote", False) else impl_mod.resolve(bl)[1])
                lr.build(f"{key}/{bl}", task, cfg, dtype, inits[0], seed, model)
                contenders[bl] = (lr, f"{key}/{bl}")
                local.append(lr)
            except Exception as e:  # noqa: BLE001
                row["timings"].append({"config": cfg["name"], "baseline": bl,
                                       "error": f"{type(e).__name__}: {e}"})
        row["timings"].append(time_config(task, contenders, model, cfg, dtype, env, backward))
        for lr in local:
            lr.close()
    try:
        why = _state_problem(run.state(key), model)
    except WorkerError as e:
        why = str(e)
    if why:
        row["failures"].append(f"while timing: {why}")


def _summarize(row: dict, impl_name: str, baselines=("eager", "compile")) -> None:
    ratios = {bl: [] for bl in dict.fromkeys(("eager", "compile", *baselines))}
    for t in row["timings"]:
        me = t.get("impls", {}).get(impl_name, {})
        if "impls" not in t:
            continue
        if me.get("error"):
            row["failures"].append(f"{t['config']}: {me['error']}")
            continue
        row["failures"] += [f"{t['config']}: {f}" for f in me.get("sample_failures", [])]
        if me.get("hidden_work"):
            ratio = max(me.get("wall_over_event") or 0.0, me.get("runner_wall_over_event") or 0.0)
            where = ("the current stream" if me.get("method") == "cuda-events"
                     else "the calling thread")
            left = (f"; {me['threads_left']} thread(s) the calls started still ran"
                    if me.get("threads_left") else "")
            row["flags"].append(f"{t['config']}: wall-clock {ratio:.1f}x the "
                                f"{'event' if where == 'the current stream' else 'per-call'} "
                                f"time: work outside {where}{left}")
        if (me.get("roofline") or {}).get("impossible"):
            row["flags"].append(f"{t['config']}: {me['roofline']['fraction']:.2f}x the "
                                f"roofline: impossible")
        for bl in ratios:
            other = t["impls"].get(bl) if bl != impl_name else me
            if other and not other.get("error") and me.get("median_ms"):
                ratios[bl].append((other["median_ms"] / me["median_ms"],
                                   other["mean_ms"] / me["mean_ms"]))
    for bl, rs in ratios.items():
        if rs:  # geometric means over the timed configs
            row[f"speedup_vs_{bl}"] = math.exp(sum(math.log(r[0]) for r in rs) / len(rs))
            row[f"speedup_vs_{bl}_mean_based"] = math.exp(sum(math.log(r[1]) for r in rs)
                                                          / len(rs))
    row["max_rel_norm"] = max((c["max_rel_norm"] for c in row["cases"]), default=None)
    row["deterministic"] = all(c["deterministic"] for c in row["cases"])
    for k in ("failures", "task_problems", "flags"):
        if len(row[k]) > MAX_REASONS:
            row[f"{k}_total"] = len(row[k])
            row[k] = row[k][:MAX_REASONS]
    if row["failures"]:
        row["status"] = "FAIL"
    elif row["task_problems"]:
        row["status"] = "TASK"   # the task cannot discriminate here: a benchmark bug
    elif row["flags"]:
        row["status"] = "FLAGGED"
    else:
        row["status"] = "PASS"
