"""Implementations the harness can score. An implementation is a factory
    factory(model: nn.Module, example_inputs: list) -> callable(*inputs) -> output(s)
built once per model (so it is then checked across batch sizes and parameter values it was
not built for). Built in: eager, compile (torch.compile, default mode), kbench
(kbench.optimize). From a file:

  FILE.py   defines make(model, example_inputs) -> callable, or KernelBench's ModelNew (built
            with the task Model's constructor arguments, see model_new), or kernel functions;
  FILE.cu   (or .cpp; or a folder holding kernel.cu) a pybind11 extension that defines kernel
            functions, compiled with torch.utils.cpp_extension.load (load_extension).

Kernel functions follow the contract of the task's format:
  kbench's own tasks (and KernelBench's):
    forward(*inputs, *state) -> Tensor or tuple of Tensors
    backward(*grad_outputs, *inputs, *state) -> list with one gradient (or None) per input
             and per state tensor, in that order          (only for backward tasks)
  where `state` is model.state_dict(keep_vars=True).values(): parameters and buffers in
  state_dict order. The harness wraps them in an autograd.Function; parameter values are
  passed on every call, so a kernel cannot bake them in.
  robust-kbench's tasks: its kernel.cu contract (RobustKernelCall): forward takes forward_fn's
  arguments as the task's Model passes them to its `fn`; backward stands in for the task's
  AutogradFunction.backward_fn.

from_file loads a file into the calling process. The harness gives an implementation file to a
worker process instead (runner.WorkerRunner), which calls resolve() there: the file never runs
where the checks and the verdict are made.
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import re
from typing import Callable, Optional, Tuple

import torch

from .suite_formats import ROBUST

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


def compile_max_autotune(model, example_inputs):
    """torch.compile with mode="max-autotune": Inductor benchmarks its Triton templates (GEMMs with
    fused epilogues among them) against the library kernels at the first call, which the harness
    makes during warm-up; the competitor where a user would spend compile time for speed."""
    import torch._dynamo
    torch._dynamo.reset()
    return torch.compile(model, mode="max-autotune")


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


# robust-kbench compiles its candidates with these (robust_kbench/primitives/*/cuda_correct.py);
# every extension file is compiled so, and its timings are of the binary robust-kbench times
CUDA_FLAGS = ("-O3", "--use_fast_math")
CXX_FLAGS = ("-O3",)
KERNEL_CU = "kernel.cu"   # robust-kbench's candidate file, one per <task>/<forward|backward>/


class CompileError(RuntimeError):
    """An extension file that does not compile (or its build does not import): the compiler's
    error lines, and where the whole log is."""


def kernel_path(spec: str) -> str:
    """The file an implementation path names: a folder stands for the kernel.cu it holds."""
    if os.path.isdir(spec):
        path = os.path.join(spec, KERNEL_CU)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{spec} is a folder without a {KERNEL_CU}")
        return path
    return spec


def file_name(spec: str) -> str:
    """An implementation file's name in reports and result file names: its base name, and for a
    kernel.cu its two parent folders too (highlighted/layernorm/forward/kernel.cu ->
    layernorm-forward-kernel.cu): robust-kbench names every candidate so."""
    path = os.path.abspath(kernel_path(spec))
    base = os.path.basename(path)
    if base != KERNEL_CU:
        return base
    parents = [p for p in os.path.dirname(path).split(os.sep)[-2:] if p]
    return "-".join(parents + [base])


def extension_name(path: str, src: bytes) -> str:
    """The module name (and build folder) of an extension: a hash of its source, the flags and
    the torch it is built against, so an unchanged file reuses its build and a changed one never
    does."""
    h = hashlib.sha256(src)
    h.update(repr((CUDA_FLAGS, CXX_FLAGS, os.path.splitext(path)[1], torch.__version__,
                   torch.version.cuda)).encode())
    return "kbench_ext_" + h.hexdigest()[:16]


def compile_errors(log: str, limit: int = 6) -> str:
    """The error lines of a build log (nvcc's `file(12): error: ...`, gcc's `file:1:2: error:`),
    else its last lines: the part of a failed build a results row can hold."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    noise = ("[", "FAILED:", "ninja:", "Error building extension", "subprocess.")
    errs = [ln for ln in lines if re.search(r"\berror\b", ln, re.I) and not ln.startswith(noise)
            and not re.search(r"errors? detected in the compilation", ln)]
    picked = errs[:limit] or [ln for ln in lines if not ln.startswith(noise)][-3:] or lines[:1]
    return "; ".join(ln[:300] for ln in picked)


def _load_ext(path: str):
    """Compile the extension file at `path` with torch.utils.cpp_extension.load and import it: one
    build folder per extension_name under kbench's cache folder (extensions/), the compiler's
    output kept out of the terminal. CompileError where it does not build or import."""
    from torch.utils import cpp_extension
    from .. import keyfile
    with open(path, "rb") as f:
        src = f.read()
    name = extension_name(path, src)
    build = os.path.join(keyfile.cache_root(), "extensions", name)
    os.makedirs(build, mode=0o700, exist_ok=True)
    try:
        return cpp_extension.load(name=name, sources=[os.path.abspath(path)],
                                  build_directory=build, extra_cflags=list(CXX_FLAGS),
                                  extra_cuda_cflags=list(CUDA_FLAGS), verbose=False)
    except Exception as e:  # noqa: BLE001 - nvcc, ninja, CUDA_HOME, the import: all say why
        text = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
        log = os.path.join(build, "build-error.log")
        with open(log, "w") as f:
            f.write(text)
        where = os.path.dirname(os.path.abspath(path)) + os.sep
        errors = compile_errors(text).replace(where, "")
        raise CompileError(f"{os.path.basename(path)} does not compile: {errors} "
                           f"(whole log: {log})") from None


def _task_global(model: torch.nn.Module, name: str):
    """A name of the module the task's Model class was defined in (its func_*.py)."""
    return getattr(type(model).forward, "__globals__", {}).get(name)


class RobustKernelCall:
    """robust-kbench's kernel contract (robust_kbench/sandbox/correct_*_fn.py) on one of its
    tasks' models. The task's Model calls the `fn` it is given with forward_fn's arguments, in
    forward_fn's order (its inputs, then its own parameters and constants: `fn(x, self.weight,
    self.bias, self.eps)`), so the candidate is model(*inputs, fn=module.forward). On a backward
    task (func_backward.py) the module's backward stands in for AutogradFunction.backward_fn, which
    the task's AutogradFunction.backward calls with the upstream gradient and what its forward
    saved; wherever gradients are taken the candidate is model(*inputs,
    fn=AutogradFunction.apply), whose forward pass is the task's own, as in robust-kbench. Without
    gradients, the module's forward runs where it has one."""

    def __init__(self, mod, model: torch.nn.Module, mode: str, name: str):
        self.mod, self.model, self.name = mod, model, name
        self.params = list(model.parameters())   # the harness sets their values in place
        self.autograd_fn = None
        if mode == "backward":
            self.autograd_fn = _task_global(model, "AutogradFunction")
            if self.autograd_fn is None:
                raise AttributeError("the task's func_backward.py defines no AutogradFunction "
                                     "(robust-kbench's backward contract)")
        elif not hasattr(mod, "forward"):
            raise AttributeError(f"{name} defines no forward() (the forward task's kernel)")

    def _no_backward(self, *args):
        raise RuntimeError(f"{self.name} defines no backward() (the task's "
                           f"AutogradFunction.backward_fn)")

    def __call__(self, *inputs):
        fn = self.autograd_fn
        grads = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad
            for t in (*inputs, *self.params))
        if fn is not None and (grads or not hasattr(self.mod, "forward")):
            # the task's backward calls it by its class name: set at every call, as several
            # kernels may be scored one after another in this process
            fn.backward_fn = getattr(self.mod, "backward", self._no_backward)
            return self.model(*inputs, fn=fn.apply)
        return self.model(*inputs, fn=self.mod.forward)


def _kernel_factory(mod, name: str) -> Factory:
    """Kernel functions scored on a task: robust-kbench's contract on its tasks (the suite marks
    their models), kbench's own elsewhere."""

    def factory(model, example_inputs):
        suite = getattr(model, "_kbench_suite", None) or {}
        if suite.get("format") == ROBUST:
            return RobustKernelCall(mod, model, suite.get("mode", "forward"), name)
        if not hasattr(mod, "forward"):
            raise AttributeError(f"{name} defines no forward()")
        return KernelCall(mod, model)

    return factory


def from_file(path: str, compile: Optional[Callable] = None) -> Factory:
    """A factory for an implementation file (.py, .cu, .cpp, or a folder holding kernel.cu); the
    file is loaded once. `compile` (path -> module) stands in for _load_ext: a test's module of
    forward/backward written in torch takes a compiled extension's place."""
    path = kernel_path(path)
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    mod = _load_py(path) if path.endswith(".py") else (compile or _load_ext)(path)
    if hasattr(mod, "ModelNew"):
        return lambda model, example_inputs: model_new(mod.ModelNew, model)
    if hasattr(mod, "make"):
        return lambda model, example_inputs: mod.make(model, example_inputs)
    if not hasattr(mod, "forward") and not hasattr(mod, "backward"):
        raise AttributeError(f"{path} defines none of make(), forward(), backward()")
    return _kernel_factory(mod, file_name(path))


BUILTIN = ("eager", "compile", "compile-max-autotune", "kbench")


def is_builtin(spec: str) -> bool:
    return spec in BUILTIN


def resolve(spec: str, budget: Optional[str] = None) -> Tuple[str, Factory]:
    """'eager' | 'compile' | 'compile-max-autotune' | 'kbench' | a file path -> (name, factory)."""
    if spec == "eager":
        return "eager", eager
    if spec == "compile":
        return "compile", compile_default
    if spec == "compile-max-autotune":
        return spec, compile_max_autotune
    if spec == "kbench":
        return "kbench", kbench_factory(budget=budget)
    return file_name(spec), from_file(spec)
