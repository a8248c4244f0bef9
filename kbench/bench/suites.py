"""Public suites (`python -m kbench bench --suite PATH`) as kbench Tasks: KernelBench files and
robust-kbench task folders (suite_formats.py reads them), scored by the same harness, filters and
result files as kbench's own tasks. A suite's task file is code we did not write: it is imported
only in worker processes, never here. This process gets its models as ProxyModules whose forward
(and gradients) run in a task worker of their own, one in which no implementation is loaded, so
the references the verdict rests on come from the task's code alone."""
from __future__ import annotations

import threading
from typing import Dict, List, Optional

import torch

from . import suite_formats
from .runner import Worker, WorkerError
from .tasks import Task, parse_dtype

_WORKERS: Dict[str, Worker] = {}
_LOCK = threading.Lock()


def _task_worker(device) -> Worker:
    """One task worker per device for the whole process, restarted if it died (a task file
    that kills its process fails that task's row, not the next task's)."""
    key = str(torch.device(device))
    with _LOCK:
        w = _WORKERS.get(key)
        if w is None:
            w = _WORKERS[key] = Worker(device)
        w.start()
        return w


def _ask(device, req: dict, groups: list, extra: int) -> tuple:
    """Send req with tensor groups written to the exchange file; grow it and ask again where the
    answer did not fit. (worker, reply, descriptions of the groups)."""
    w = _task_worker(device)
    for _ in range(4):
        descs, start = w.put_all(groups, extra)
        r = w.request(dict(req, out_start=start, **{k: d for k, d in zip(req.get("_keys", ()),
                                                                         descs)}))
        if not r.get("full"):
            return w, r
        extra = 4 * extra + (16 << 20)
    raise WorkerError("the task's outputs did not fit the exchange file")


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


class _ProxyFn(torch.autograd.Function):
    """The task model's forward in the task worker as one autograd node; its backward asks the
    worker for the gradients of the same forward (recomputed there)."""

    @staticmethod
    def forward(ctx, remote, n_in, *args):
        ctx.remote, ctx.n_in = remote, n_in
        ctx.save_for_backward(*[a for a in args if isinstance(a, torch.Tensor)])
        ctx.args = [None if isinstance(a, torch.Tensor) else a for a in args]
        outs, as_tuple = _remote_forward(remote, list(args[:n_in]), list(args[n_in:]), None)
        ctx.n_out = len(outs)
        return tuple(outs) if as_tuple or len(outs) != 1 else outs[0]

    @staticmethod
    def backward(ctx, *gouts):
        saved = iter(ctx.saved_tensors)
        args = [next(saved) if a is None else a for a in ctx.args]
        grads = _remote_forward(ctx.remote, args[:ctx.n_in], args[ctx.n_in:], list(gouts))
        return (None, None, *grads)


def _remote_forward(remote: dict, xs: list, state: list, gouts: Optional[list]):
    device = next((t.device for t in xs + state if isinstance(t, torch.Tensor)),
                  torch.device("cpu"))
    tensors = [x.detach() for x in xs if isinstance(x, torch.Tensor)]
    py = [None if isinstance(x, torch.Tensor) else {"py": x} for x in xs]
    req = dict(remote, op="suite_forward", py_inputs=py, gouts=None,
               _keys=("inputs", "state") + (("gouts",) if gouts is not None else ()))
    groups = [tensors, [s.detach() for s in state]]
    if gouts is not None:
        groups.append([None if g is None else g.detach() for g in gouts])
    extra = 4 * (_nbytes(tensors) + _nbytes(state)) + (1 << 20)
    w, r = _ask(device, req, groups, extra)
    if gouts is None:
        return [w.get(d).to(device) for d in r["outs"]], bool(r.get("tuple"))
    return [None if d is None else w.get(d).to(device) for d in r["grads"]]


class ProxyModule(torch.nn.Module):
    """A suite task's model as this process holds it: its parameters and buffers (the same
    names, in the same state_dict order as the task's model) and a forward that runs the task's
    code in the task worker on these values. deepcopy and .to() work as for any module."""

    def __init__(self, remote: dict, names: list, values: list):
        super().__init__()
        self._remote = remote
        for (name, kind), v in zip(names, values):
            *path, leaf = name.split(".")
            mod = self
            for p in path:
                if p not in mod._modules:
                    mod.add_module(p, torch.nn.Module())
                mod = mod._modules[p]
            if kind == "param":
                mod.register_parameter(leaf, torch.nn.Parameter(v, requires_grad=v.is_floating_point()))
            else:
                mod.register_buffer(leaf, v)

    def forward(self, *xs):
        state = list(self.state_dict(keep_vars=True).values())
        return _ProxyFn.apply(self._remote, len(xs), *xs, *state)


class SuiteTask(Task):
    """A suite task as the harness sees it (see the module's docstring)."""

    remote = True   # baselines run in workers too: the model's code may not run here

    def __init__(self, spec: dict):
        self.suite_spec = spec
        self.name = spec["name"]
        self.module = None
        self.load_error: Optional[str] = None
        try:
            info = suite_formats.describe(spec)
        except Exception as e:  # noqa: BLE001 - shown in --list, recorded as the task's row
            self.load_error = f"{type(e).__name__}: {e}"
            info = {"configs": [{"name": "base", "set": {}}], "backward": False,
                    "description": f"cannot be read: {self.load_error}"}
        self.input_configs: List[dict] = info["configs"]
        self.init_configs = {k: None for k in suite_formats.INIT_SEEDS}
        self.backward, self.dtypes = info["backward"], ("float32",)
        self.model_args_fn = lambda cfg: suite_formats.model_args(spec, cfg)
        self.bytes_fn = self.flops_fn = None
        self.description = info["description"]

    def _check(self) -> None:
        if self.load_error:
            raise ValueError(f"task {self.name} cannot be read: {self.load_error}")

    def _remote(self, cfg, init, seed) -> dict:
        return {"suite": self.suite_spec, "cfg": cfg, "init": init, "seed": seed}

    def build(self, cfg: dict, dtype, device, init: Optional[str] = None,
              seed: int = 0) -> torch.nn.Module:
        self._check()
        init = init or next(iter(self.init_configs))
        req = dict(self._remote(cfg, init, seed), op="suite_build", dtype=str(dtype))
        w, r = _ask(device, req, [], 1 << 20)
        values = [w.get(d).to(device) for d in r["state"]]
        model = ProxyModule(self._remote(cfg, init, seed), r["names"], values)
        return model.to(device=device, dtype=parse_dtype(dtype)).eval()

    def inputs(self, cfg: dict, dtype, device, seed: int = 0) -> list:
        self._check()
        req = dict(suite=self.suite_spec, cfg=cfg, op="suite_inputs", dtype=str(dtype), seed=seed)
        w, r = _ask(device, req, [], 1 << 20)
        return [d["py"] if isinstance(d, dict) and "py" in d else w.get(d).to(device)
                for d in r["inputs"]]


def load(path: str) -> List[SuiteTask]:
    """The tasks of the suite at `path` (format detected from the path; see suite_formats)."""
    return [SuiteTask(s) for s in suite_formats.detect(path)]


def select(tasks: List[SuiteTask], names=None) -> List[SuiteTask]:
    if not names:
        return list(tasks)
    want = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n]
    by = {t.name: t for t in tasks}
    missing = [n for n in want if n not in by]
    if missing:
        raise KeyError(f"unknown task(s) {missing}; in this suite: {sorted(by)}")
    return [by[n] for n in want]

