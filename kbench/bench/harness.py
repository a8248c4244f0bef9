"""The robust harness: scores one implementation of one task (docs/DESIGN.md: "Verification",
"Timing") so that the known loopholes fail loudly instead of winning.

For every (input config, init config) the implementation, built once per model, is run as
candidate -> reference -> candidate on private clones of two input sets:
  - memory the caching allocator is about to hand out is poisoned before each candidate call
    (NaN the first time, random bytes the second), so an output element the kernel never
    writes holds garbage, not a previous correct answer;
  - outputs (and, for backward, gradients of every floating input and parameter) must be
    exactly torch.Tensor of the right dtype/shape/device, not alias an input, match the float64
    reference within per-dtype tolerances widened to EAGER_SLACK x eager's own error, and have
    NaN/Inf where the reference has them;
  - inputs must be bit-for-bit unchanged afterwards;
  - the output must change when the inputs change (a cached or input-independent result);
  - a reference that zeros, a constant or an input would match is reported (the case cannot
    discriminate);
  - parameters are re-initialised IN PLACE between init configs, so values baked in at build
    time are caught, and batch sizes other than the example's are checked with the same build.
Timing (kbench/tune/timing.py) uses events on the current stream with the L2 flushed and inputs rotated,
cross-checked against wall-clock time (work on a side stream shows up as wall >> events), and
results beyond the memory/compute roofline are flagged impossible.
"""
from __future__ import annotations

import dataclasses
import math
import time
import traceback
from typing import Callable, Dict, List, Optional

import torch

from ..tune import timing
from . import compare
from . import impls as impl_mod
from .compare import flatten, to_f64
from .tasks import Task, dtype_name, parse_dtype

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
    """What one harness run shares: device, budget, and roofs measured in this same run."""

    def __init__(self, device="cuda", budget: str | Budget = "default"):
        self.device = torch.device(device)
        self.budget = BUDGETS[budget] if isinstance(budget, str) else budget
        self._copy: Optional[dict] = None
        self._mm: Dict[str, dict] = {}

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

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


class CaseFailure(Exception):
    """A candidate call that cannot even be compared (raised, or broke the protocol)."""


# ------------------------------------------------------------------------- running one call

def _clone(xs: list) -> list:
    return [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in xs]


def _grad_outputs(model, xs, seed: int, device) -> list:
    """Random upstream gradients shaped like the model's outputs (None for non-float ones)."""
    with torch.no_grad():
        outs = flatten(model(*_clone(xs)))
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(o.shape, generator=g, device=device).to(o.dtype)
            if isinstance(o, torch.Tensor) and o.is_floating_point() else None for o in outs]


def _call(fn, xs: list, params: list, grad_outs: Optional[list], backward: bool):
    """fn(*xs) and, for backward, the gradients of sum(out * grad_out) with respect to the
    floating inputs and `params`. xs must be private copies (they become autograd leaves)."""
    if not backward:
        with torch.no_grad():
            return flatten(fn(*xs)), []
    leaves = [x.requires_grad_() for x in xs
              if isinstance(x, torch.Tensor) and x.is_floating_point()]
    with torch.enable_grad():
        outs = flatten(fn(*xs))
    if len(outs) != len(grad_outs):
        raise CaseFailure(f"returned {len(outs)} outputs, expected {len(grad_outs)}")
    pairs = [(o, g) for o, g in zip(outs, grad_outs) if g is not None]
    for i, (o, _) in enumerate(pairs):
        if not isinstance(o, torch.Tensor) or not o.requires_grad:
            raise CaseFailure(f"output {i} does not require grad (no backward)")
    wrt = leaves + list(params)
    grads = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                allow_unused=True)
    return [o.detach() for o in outs], list(grads)


_POISON_MAX_BLOCKS = 64  # per size, when draining the CUDA cache of blocks that fit


def poison(like: List[torch.Tensor], kind: str, device) -> None:
    """Fill the memory the caching allocator will hand out next with garbage, so an output
    element a kernel never writes cannot hold an earlier (correct) result.

    On CUDA the cache is first emptied (whole free segments go back to the driver); then, for
    each expected output size, blocks of that size are allocated and filled until the
    allocator has to reserve new memory (so every cached free block that could serve that size
    is poisoned), plus one block as large as all outputs together; all are then freed. The
    allocator splits blocks from the front, so the next allocations land on poisoned bytes.
    kind 'nan' fills with 0xFF bytes (NaN in every float format, -1 in integers), 'random'
    with random bytes. This reaches external kernels too, as long as they allocate through
    torch (torch::empty); the CPU allocator gives no such guarantee (best effort there)."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sizes = sorted({t.numel() * t.element_size() for t in like
                    if isinstance(t, torch.Tensor)})
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
    bufs = []

    def grab(nbytes: int) -> None:
        b = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=dev)
        if kind == "nan":
            b.fill_(0xFF)
        else:
            b.random_(0, 256)
        bufs.append(b)

    for nbytes in sizes:
        for i in range(_POISON_MAX_BLOCKS if cuda else 2):
            before = torch.cuda.memory_reserved(dev) if cuda else 0
            grab(nbytes)
            if cuda and i >= 1 and torch.cuda.memory_reserved(dev) > before:
                break  # the cache had no more free blocks of this size: all are poisoned
    grab(2 * sum(sizes))
    del bufs
    timing.sync(dev)


def _same_inputs(xs: list, pristine: list) -> str:
    for i, (a, b) in enumerate(zip(xs, pristine)):
        if isinstance(a, torch.Tensor) and not torch.equal(a.detach(), b):
            return f"modified input {i} in place"
    return ""


# ------------------------------------------------------------------------- correctness

def check_config(task: Task, impl: Callable, model: torch.nn.Module, cfg: dict, dtype,
                 device, backward: bool, seed: int = 0) -> dict:
    """Candidate -> reference -> candidate on two input sets of one config. Returns
    {"config", "ok", "failures", "task_problems", "max_rel_norm", "deterministic"}."""
    ref_model = task.reference(model)
    params = list(model.parameters())
    ref_params = list(ref_model.parameters())
    pnames = [n for n, _ in model.named_parameters()]
    failures: List[str] = []
    task_problems: List[str] = []
    worst = 0.0
    deterministic = True
    firsts = []  # (candidate forward outputs, reference forward outputs) per input set

    for s in (seed, seed + 7919):
        xs = task.inputs(cfg, dtype, device, seed=s)
        pristine = _clone(xs)
        gouts = _grad_outputs(model, xs, s + 1, device) if backward else None
        e_out, e_gr = _call(model, _clone(xs), params, gouts, backward)
        r_out, r_gr = _call(ref_model, [to_f64(x) for x in xs], ref_params,
                            [to_f64(g) for g in gouts] if backward else None, backward)
        n_in = sum(1 for x in xs if isinstance(x, torch.Tensor) and x.is_floating_point())
        labels = ([f"output {i}" for i in range(len(e_out))]
                  + [f"grad of input {i}" for i in range(n_in)] + [f"grad of {n}" for n in pnames])
        expect = e_out + list(e_gr)
        refs = r_out + list(r_gr)
        tols = []
        for lab, e, r in zip(labels, expect, refs):
            if e is None or r is None or not r.is_floating_point():
                tols.append(None)
                continue
            tol = compare.tolerance(e.dtype, r, compare.errors(e, r))
            tols.append(tol)
            why = compare.discriminating(r, tol, xs if lab.startswith("output") else ())
            if why:
                task_problems.append(f"{cfg['name']}: {lab}: {why}")

        runs = []
        for k, kind in enumerate(("nan", "random")):
            if k == 1:  # the reference between the two candidate calls (same dtype as the
                # candidate, so its freed blocks are what a stale output would pick up)
                _call(model, _clone(xs), params, gouts, backward)
            poison([t for t in expect if t is not None], kind, device)
            cx = _clone(xs)
            try:
                c_out, c_gr = _call(impl, cx, params, gouts, backward)
                timing.sync(device)
            except CaseFailure as e:
                failures.append(f"{cfg['name']}: {e}")
                break
            except Exception as e:  # noqa: BLE001 - any exception is this candidate's failure
                failures.append(f"{cfg['name']}: raised {type(e).__name__}: {e}")
                break
            why = _same_inputs(cx, pristine)
            if why:
                failures.append(f"{cfg['name']}: {why}")
            why = compare.check_structure(c_out, e_out, cx)
            if why:
                failures.append(f"{cfg['name']}: {why}")
                break
            got = c_out + list(c_gr)
            for lab, c, e, r, tol in zip(labels, got, expect, refs, tols):
                if e is None:
                    continue
                if c is None:
                    failures.append(f"{cfg['name']}: {lab} missing")
                    continue
                if lab.startswith("grad"):
                    why = compare.check_structure([c], [e])
                    if why:
                        failures.append(f"{cfg['name']}: {lab}: {why}")
                        continue
                if tol is None:
                    ok, why = torch.equal(c.cpu(), r.cpu()), "differs"
                else:
                    ok, why, err = compare.close(c, r, tol)
                    worst = max(worst, err.get("rel_norm", 0.0) if err else 0.0)
                if not ok:
                    failures.append(f"{cfg['name']}: {lab} ({kind}-poisoned run): {why}")
            runs.append(got)
        if len(runs) == 2:
            deterministic &= all(a is None or b is None or torch.equal(a, b)
                                 for a, b in zip(*runs))
            firsts.append((runs[0][:len(e_out)], r_out))
        else:
            break

    if len(firsts) == 2:
        (ca, ra), (cb, rb) = firsts
        for i, (a, b, x, y) in enumerate(zip(ca, cb, ra, rb)):
            if not x.is_floating_point():
                continue
            if (_rel_change(x, y) >= CHANGE_REL_MIN and a.shape == b.shape
                    and _rel_change(a.double(), b.double()) <= SAME_REL_MAX):
                failures.append(f"{cfg['name']}: output {i} does not change when the inputs "
                                f"do (cached or input-independent result)")
    return {"config": cfg["name"], "ok": not failures and not task_problems,
            "failures": failures, "task_problems": task_problems, "max_rel_norm": worst,
            "deterministic": deterministic}


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


# ------------------------------------------------------------------------- timing

def _timed_fn(f: Callable, params: list, gouts: Optional[list], backward: bool) -> Callable:
    if not backward:
        def fwd(*xs):
            with torch.no_grad():
                return f(*xs)
        return fwd

    def fwd_bwd(*xs):
        outs = flatten(f(*xs))
        leaves = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
        pairs = [(o, g) for o, g in zip(outs, gouts) if g is not None]
        return torch.autograd.grad([o for o, _ in pairs], leaves + params,
                                   [g for _, g in pairs], allow_unused=True)
    return fwd_bwd


def time_config(task: Task, impls: Dict[str, Callable], model, cfg: dict, dtype, env: Env,
                backward: bool) -> dict:
    """Time each of `impls` on the same rotated inputs of one config, in this run."""
    device, b = env.device, env.budget
    arg_sets = [task.inputs(cfg, dtype, device, seed=100 + i) for i in range(2)]
    pristine = [_clone(a) for a in arg_sets]
    params = list(model.parameters())
    gouts = _grad_outputs(model, arg_sets[0], 99, device) if backward else None
    if backward:
        for a in arg_sets:
            for x in a:
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    x.requires_grad_()
    with torch.no_grad():
        outs = model(*arg_sets[0])
    nbytes = task.bytes_moved(cfg, dtype, backward, model, arg_sets[0], outs)
    del outs
    flops = task.flops(cfg, backward)
    res = {"config": cfg["name"], "bytes": nbytes, "flops": flops, "impls": {}}
    for name, f in impls.items():
        entry: dict = {}
        modified: List[str] = []

        def verify_inputs():
            # outside the timed window, before every call: the inputs the next call sees are
            # the pristine ones (a call that scribbled on them is recorded, then undone)
            for a, p in zip(arg_sets, pristine):
                why = _same_inputs(a, p)
                if why:
                    modified.append(why)
                    with torch.no_grad():
                        for x, y in zip(a, p):
                            if isinstance(x, torch.Tensor):
                                x.copy_(y)
        try:
            fn = _timed_fn(f, params, gouts, backward)
            t0 = time.perf_counter()
            fn(*arg_sets[0])  # the first call (torch.compile compiles here): not timed
            timing.sync(device)
            entry["first_call_s"] = time.perf_counter() - t0
            t = timing.time_fn(fn, arg_sets, device=device, reps=b.reps, warmup=b.warmup,
                               before_each=verify_inputs)
            verify_inputs()
            entry.update(t.as_dict())
            mm = env.matmul(dtype)["flops_per_s"] if flops else 0.0
            roof = timing.roofline(nbytes, t.median_ms, env.copy()["bytes_per_s"], flops, mm)
            # Outputs smaller than L2 can finish in cache before reaching DRAM, so only a
            # working set well beyond L2 makes "faster than the roofline" impossible.
            if not env.cuda or nbytes < 2 * timing.l2_bytes(device):
                roof["impossible"] = False
            entry["roofline"] = roof
            if modified:
                entry["error"] = f"while timing: {modified[0]}"
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {e}"
        res["impls"][name] = entry
    return res


# ------------------------------------------------------------------------- scoring

def _perf_cfgs(task: Task, env: Env) -> List[dict]:
    return task.configs(perf=True) if (env.cuda and env.budget.perf_configs) else []


def timed_configs(task: Task, env: Env) -> List[str]:
    if env.budget.time_all:
        return [c["name"] for c in task.configs(perf=False) + _perf_cfgs(task, env)]
    perf = _perf_cfgs(task, env)
    if perf:
        return [c["name"] for c in perf]
    # no perf config here (CPU, quick budget): the largest of the small ones
    def size(c):
        return sum(x.numel() for x in task.inputs(c, "float32", "cpu", 0)
                   if isinstance(x, torch.Tensor))
    return [max(task.configs(perf=False), key=size)["name"]]


def score(task: Task, impl_name: str, factory: Callable, *, dtype, backward: bool, env: Env,
          baselines=("eager", "compile"), seed: int = 0) -> dict:
    """One row: `impl_name` on `task` in `dtype`, forward (or forward+backward), every config
    and init config checked, the timed configs timed against the baselines."""
    dtype = dtype_name(parse_dtype(dtype))
    device = env.device
    configs = task.configs(perf=False) + _perf_cfgs(task, env)
    to_time = set(timed_configs(task, env))
    groups: Dict[tuple, List[dict]] = {}
    for c in configs:
        groups.setdefault(task.group_key(c), []).append(c)

    row = {"task": task.name, "dtype": dtype, "mode": "fwdbwd" if backward else "fwd",
           "impl": impl_name, "cases": [], "timings": [], "failures": [],
           "task_problems": [], "flags": []}
    inits = list(task.init_configs)
    for group in groups.values():
        model = task.build(group[0], dtype, device, init=inits[0], seed=seed)
        try:
            impl = factory(model, task.inputs(group[0], dtype, device, seed=seed))
        except Exception as e:  # noqa: BLE001
            row["failures"].append(f"building the implementation failed: "
                                   f"{type(e).__name__}: {e}")
            row["traceback"] = traceback.format_exc(limit=6)
            continue
        for ii, init in enumerate(inits):
            if ii:
                _reinit_in_place(task, model, group[0], dtype, device, init, seed)
            for cfg in group:
                case = check_config(task, impl, model, cfg, dtype, device, backward, seed)
                case["init"] = init
                row["cases"].append(case)
                row["failures"] += [f"[{init}] {f}" for f in case["failures"]]
                row["task_problems"] += case["task_problems"]
        # time with the first init config's values, the candidate beside the baselines
        _reinit_in_place(task, model, group[0], dtype, device, inits[0], seed)
        for cfg in group:
            if cfg["name"] not in to_time:
                continue
            contenders = {impl_name: impl}
            for bl in baselines:
                if bl == impl_name:
                    continue
                try:
                    contenders[bl] = impl_mod.resolve(bl)[1](model, task.inputs(cfg, dtype,
                                                                               device))
                except Exception as e:  # noqa: BLE001
                    row["timings"].append({"config": cfg["name"], "baseline": bl,
                                           "error": f"{type(e).__name__}: {e}"})
            row["timings"].append(time_config(task, contenders, model, cfg, dtype, env,
                                              backward))
    _summarize(row, impl_name)
    return row


def _summarize(row: dict, impl_name: str) -> None:
    ratios = {"eager": [], "compile": []}
    for t in row["timings"]:
        me = t.get("impls", {}).get(impl_name, {})
        if "impls" not in t:
            continue
        if me.get("error"):
            row["failures"].append(f"{t['config']}: {me['error']}")
            continue
        if me.get("hidden_work"):
            row["flags"].append(f"{t['config']}: wall-clock {me['wall_over_event']:.1f}x the "
                                f"event time: work outside the current stream")
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
