"""Implementations the harness can score. An implementation is a factory
    factory(model: nn.Module, example_inputs: list) -> callable(*inputs) -> output(s)
built once per model (so it is then checked across batch sizes and parameter values it was
not built for). Built in: eager, compile (torch.compile, default mode), kbench
(kbench.optimize). From a file:

  FILE.py   defines make(model, example_inputs) -> callable, or KernelBench's ModelNew (built
            with the task Model's constructor arguments, see model_new), or the kernel
            functions below;
  FILE.cu   (or .cpp) a pybind11 extension built with torch.utils.cpp_extension.load that
            defines the kernel functions:
    forward(*inputs, *state) -> Tensor or tuple of Tensors
    backward(*grad_outputs, *inputs, *state) -> list with one gradient (or None) per input
             and per state tensor, in that order          (only for backward tasks)
  where `state` is model.state_dict(keep_vars=True).values(): parameters and buffers in
  state_dict order. The harness wraps them in an autograd.Function; parameter values are
  passed on every call, so a kernel cannot bake them in.

from_file loads a file into the calling process. The harness gives an implementation file to a
worker process instead (runner.WorkerRunner), which calls resolve() there: the file never runs
where the checks and the verdict are made.
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
from typing import Callable, Optional, Tuple

import torch

Factory = Callable[[torch.nn.Module, list], Callable]


def eager(model, example_inputs):
    return model


def compile_default(model, example_inputs):
    """torch.compile with the default mode. Compilation happens at the first call, which the
    harness makes during warm-up (outside any timed window)."""
    import torch._dynamo
    # A fresh cache per model: each task config is a new graph, and the recompile limit
    # would otherwise silently send later configs to eager.
    torch._dynamo.reset()
    return torch.compile(model)


def kbench_factory(budget: Optional[str] = None, backend: Optional[str] = None) -> Factory:
    """kbench.optimize with the given budget, backend 'cuda' on a GPU and 'interp' on the CPU.
    Keyword arguments optimize() does not accept are dropped (its API is still growing)."""

    def factory(model, example_inputs):
        import kbench
        dev = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)),
                   torch.device("cpu"))
        kw = {"backend": backend or ("cuda" if dev.type == "cuda" else "interp"), "verbose": False}
        if budget is not None:
            kw["budget"] = budget
        try:
            params = inspect.signature(kbench.optimize).parameters
            if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
                kw = {k: v for k, v in kw.items() if k in params}
        except (TypeError, ValueError):
            pass
        return kbench.optimize(model, list(example_inputs), **kw)

    return factory


class KernelFunction(torch.autograd.Function):
    """forward/backward of an external kernel module as one autograd node."""

    @staticmethod
    def forward(ctx, mod, n_inputs, *args):
        ctx.mod, ctx.n_inputs = mod, n_inputs
        ctx.save_for_backward(*args)
        out = mod.forward(*args)
        return tuple(out) if isinstance(out, (list, tuple)) else out

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not hasattr(ctx.mod, "backward"):
            raise RuntimeError("the kernel module defines no backward()")
        args = ctx.saved_tensors
        grads = list(ctx.mod.backward(*grad_outputs, *args))
        if len(grads) != len(args):
            raise RuntimeError(f"backward() returned {len(grads)} gradients, expected "
                               f"{len(args)} (one per input and state tensor)")
        # only where autograd asked (integer targets, buffers get None whatever was returned)
        grads = [g if need else None for g, need in zip(grads, ctx.needs_input_grad[2:])]
        return (None, None, *grads)


class KernelCall:
    """The callable the harness scores for an external kernel module."""

    def __init__(self, mod, model: torch.nn.Module):
        self.mod, self.model = mod, model

    def __call__(self, *inputs):
        state = list(self.model.state_dict(keep_vars=True).values())
        args = list(inputs) + state
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                           for a in args):
            return KernelFunction.apply(self.mod, len(inputs), *args)
        with torch.no_grad():
            return self.mod.forward(*args)


def model_new(cls, model: torch.nn.Module) -> torch.nn.Module:
    """A KernelBench candidate: ModelNew built with the task Model's constructor arguments
    (which a suite task's model carries), its parameters and buffers then replaced by the
    model's own tensors (the same names are required), so the values the harness sets in place
    are the ones it computes with."""
    args, kwargs = getattr(model, "_kbench_init_args", ((), {}))
    new = cls(*args, **kwargs)
    mine = dict(new.state_dict(keep_vars=True))
    theirs = model.state_dict(keep_vars=True)
    if set(mine) != set(theirs):
        raise ValueError(f"ModelNew's parameters and buffers {sorted(mine)} are not Model's "
                         f"{sorted(theirs)}")
    for name, t in theirs.items():
        *path, leaf = name.split(".")
        owner = new.get_submodule(".".join(path)) if path else new
        if leaf in owner._parameters:
            owner._parameters[leaf] = t
        else:
            owner._buffers[leaf] = t
    return new.eval()


def _load_py(path: str):
    name = "kbench_impl_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load_ext(path: str):
    from torch.utils import cpp_extension
    src = open(path, "rb").read()
    stem = os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    name = f"kbench_ext_{stem}_{hashlib.sha1(src).hexdigest()[:10]}"
    return cpp_extension.load(name=name, sources=[path], extra_cuda_cflags=["-O3"],
                              extra_cflags=["-O3"], verbose=False)


def from_file(path: str) -> Factory:
    """A factory for an implementation file (.py, .cu, .cpp); the file is loaded once."""
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    mod = _load_py(path) if path.endswith(".py") else _load_ext(path)
    if hasattr(mod, "ModelNew"):
        return lambda model, example_inputs: model_new(mod.ModelNew, model)
    if hasattr(mod, "make"):
        return lambda model, example_inputs: mod.make(model, example_inputs)
    if not hasattr(mod, "forward"):
        raise AttributeError(f"{path} defines neither make() nor forward()")
    return lambda model, example_inputs: KernelCall(mod, model)


BUILTIN = ("eager", "compile", "kbench")


def is_builtin(spec: str) -> bool:
    return spec in BUILTIN


def resolve(spec: str, budget: Optional[str] = None) -> Tuple[str, Factory]:
    """'eager' | 'compile' | 'kbench' | a file path -> (name, factory)."""
    if spec == "eager":
        return "eager", eager
    if spec == "compile":
        return "compile", compile_default
    if spec == "kbench":
        return "kbench", kbench_factory(budget=budget)
    return os.path.basename(spec), from_file(spec)
