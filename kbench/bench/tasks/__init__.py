"""The benchmark's tasks: one Python module per task, collected into the registry TASKS.

A task module defines
  Model            an nn.Module class whose forward is functional (F.* and tensor ops);
  make_inputs(cfg, dtype, device, gen) -> list of input tensors (floats in `dtype`);
  input_configs    list of dicts, each with a "name" and the sizes make_inputs/model_args read;
                   "perf": True marks the large (>= 64 MB) config that is timed, "filter": True
                   the one the task filters use (default: the first);
  init_configs     {name: fn(model, generator)} (random and structured, see _common);
and optionally
  model_args(cfg) -> dict   Model(**model_args(cfg)); configs with equal args share one
                            built implementation, so it is checked across batch sizes;
  backward         whether the task is also scored forward+backward (default True);
  dtypes           default ("float32", "bfloat16");
  bytes_moved(cfg, itemsize, backward) -> int   the least bytes the work must move; if absent
                   the harness counts inputs, parameters and outputs read/written once (and for
                   backward, gradients of the outputs read and of the inputs/parameters written);
  flops(cfg, backward) -> int    for GEMM/conv tasks, the compute roof.
The float64 reference is the same module converted to float64 (Task.reference).
"""
from __future__ import annotations

import copy
import importlib
import pkgutil
import types
from typing import Callable, Dict, List, Optional

import torch

from ..compare import flatten

_DTYPES = {"float32": torch.float32, "f32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "f16": torch.float16,
           "float64": torch.float64, "f64": torch.float64}


def parse_dtype(name) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class Task:
    """A task module wrapped with the operations the harness and the filters need."""

    def __init__(self, module: types.ModuleType, name: Optional[str] = None):
        self.module = module
        self.name = name or getattr(module, "NAME", module.__name__.rsplit(".", 1)[-1])
        self.Model = module.Model
        self.make_inputs_fn: Callable = module.make_inputs
        self.input_configs: List[dict] = list(module.input_configs)
        self.init_configs: Dict[str, Callable] = dict(module.init_configs)
        self.backward: bool = bool(getattr(module, "backward", True))
        self.dtypes = tuple(dtype_name(parse_dtype(d)) for d in
                            getattr(module, "dtypes", ("float32", "bfloat16")))
        self.model_args_fn: Callable = getattr(module, "model_args", lambda cfg: {})
        self.bytes_fn: Optional[Callable] = getattr(module, "bytes_moved", None)
        self.flops_fn: Optional[Callable] = getattr(module, "flops", None)
        # the docstring's first paragraph, on one line
        self.description = " ".join((module.__doc__ or "").strip().split("\n\n")[0].split())
        names = [c["name"] for c in self.input_configs]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"task {self.name}: input config names must be unique, non-empty")
        if not self.init_configs:
            raise ValueError(f"task {self.name}: needs at least one init config")

    def __repr__(self) -> str:
        return f"Task({self.name})"

    # -- configs -------------------------------------------------------------------------
    def configs(self, perf: Optional[bool] = None) -> List[dict]:
        """All input configs, or only the perf (timed) ones, or only the others."""
        if perf is None:
            return list(self.input_configs)
        return [c for c in self.input_configs if bool(c.get("perf")) == perf]

    def config(self, name: str) -> dict:
        for c in self.input_configs:
            if c["name"] == name:
                return c
        raise KeyError(f"task {self.name} has no input config {name!r}")

    def filter_config(self) -> dict:
        for c in self.input_configs:
            if c.get("filter"):
                return c
        return self.configs(perf=False)[0] if self.configs(perf=False) else self.input_configs[0]

    def model_args(self, cfg: dict) -> dict:
        return dict(self.model_args_fn(cfg))

    def group_key(self, cfg: dict) -> tuple:
        """Configs with equal keys build the same model, so one implementation serves them."""
        return tuple(sorted(self.model_args(cfg).items()))

    # -- building ------------------------------------------------------------------------
    def build(self, cfg: dict, dtype, device, init: Optional[str] = None,
              seed: int = 0) -> torch.nn.Module:
        """The task's model for `cfg`, initialised by init config `init` from `seed`, in eval
        mode (BatchNorm uses running statistics, nothing updates buffers), on device/dtype."""
        init = init or next(iter(self.init_configs))
        gen = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.Model(**self.model_args(cfg))
        self.init_configs[init](model, gen)
        return model.to(device=device, dtype=parse_dtype(dtype)).eval()

    def inputs(self, cfg: dict, dtype, device, seed: int = 0) -> list:
        gen = torch.Generator(device=device).manual_seed(seed)
        return list(self.make_inputs_fn(cfg, parse_dtype(dtype), torch.device(device), gen))

    @staticmethod
    def reference(model: torch.nn.Module) -> torch.nn.Module:
        """The float64 reference: the same module, same (already rounded) values, in float64."""
        return copy.deepcopy(model).to(torch.float64)

    # -- roofline ------------------------------------------------------------------------
    def bytes_moved(self, cfg: dict, dtype, backward: bool, model=None, inputs=None,
                    outputs=None) -> int:
        if self.bytes_fn is not None:
            return int(self.bytes_fn(cfg, parse_dtype(dtype).itemsize, backward))
        if model is None or inputs is None or outputs is None:
            raise ValueError(f"task {self.name}: bytes_moved needs model/inputs/outputs")
        return auto_bytes(model, inputs, outputs, backward)

    def flops(self, cfg: dict, backward: bool) -> int:
        return int(self.flops_fn(cfg, backward)) if self.flops_fn is not None else 0


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))


def auto_bytes(model, inputs, outputs, backward: bool) -> int:
    """A lower bound on the bytes moved: inputs, parameters and buffers read once, outputs
    written once; backward adds the output gradients read and the gradients of floating inputs
    and parameters written. Activations re-read by the backward are NOT counted (a kernel may
    save a smaller residue), so this never exceeds what any implementation must move."""
    outs = [o for o in flatten(outputs) if isinstance(o, torch.Tensor)]
    state = list(model.parameters()) + list(model.buffers())
    fwd = _nbytes(inputs) + _nbytes(state) + _nbytes(outs)
    if not backward:
        return fwd
    fl_in = [t for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point()]
    fl_out = [o for o in outs if o.is_floating_point()]
    return fwd + _nbytes(fl_out) + _nbytes(fl_in) + _nbytes(list(model.parameters()))


def _discover() -> Dict[str, Task]:
    tasks = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        task = Task(mod)
        tasks[task.name] = task
    return tasks


TASKS: Dict[str, Task] = _discover()


def select(names=None) -> List[Task]:
    """Tasks by name (comma-separated string or list; None for all); unknown names raise."""
    if names is None or names == "" or names == ["all"]:
        return list(TASKS.values())
    if isinstance(names, str):
        names = [n for n in names.split(",") if n]
    flat = [n.strip() for part in names for n in str(part).split(",") if n.strip()]
    missing = [n for n in flat if n not in TASKS]
    if missing:
        raise KeyError(f"unknown task(s) {missing}; known: {sorted(TASKS)}")
    return [TASKS[n] for n in flat]
