"""kbench._fast (csrc/fast/, C++), the CUDA backend's hot path: region launches, their autograd
nodes and an optimized module's usual call without Python. Loaded once, here; None where it was
not built (no torch at build time) or KBENCH_FAST=0 asks for the Python path."""
from __future__ import annotations

import logging
import os

import torch

from .. import _C
from .plan import Fallback, RegionFallback

log = logging.getLogger("kbench")

_module = None
_loaded = False


def module():
    """The initialized kbench._fast, or None (launches and calls then run in Python)."""
    global _module, _loaded
    if not _loaded:
        _loaded = True
        _module = _load()
    return _module


def _load():
    if os.environ.get("KBENCH_FAST", "1") == "0":
        return None
    try:
        from .. import _fast
    except ImportError as e:
        log.warning("kbench: kbench._fast is not available (%s); launches run in Python "
                    "(rebuild with pip install --no-build-isolation -e .)", e)
        return None
    _fast.init(_C.launch_api(), Fallback, RegionFallback, _C.CudaError)
    return _fast


def guards_type():
    """kbench._fast.Guards (the Python-state checks in C++, capture/guards.py's entries), or None:
    the Python loop checks them, and calls take the Python path."""
    return getattr(module(), "Guards", None)


def launch_of(launcher):
    """The kbench._fast.Launch behind a launcher (its bound .run), or None (a Python closure)."""
    launch = getattr(launcher, "__self__", None)
    kind = type(launch)
    return launch if kind.__module__ == "kbench._fast" and kind.__name__ == "Launch" else None


def install_module_call(cls, enabled: bool = True) -> None:
    """cls.__call__ from kbench._fast (csrc/fast/call.cpp): torch's nn.Module.__call__ wherever a
    hook, a compiled call, a JIT trace or a keyword argument needs it, else forward()'s C++ path
    without the Python frames of __call__ and forward in between. OptimizedModule installs it
    when its first instance is built; without kbench._fast (or enabled=False) torch's own
    __call__, looked up on nn.Module where FX patches it, is the one."""
    make = getattr(module(), "module_call", None) if enabled else None
    if make is None:
        if "__call__" in vars(cls):
            del cls.__call__
        return
    if "__call__" not in vars(cls):
        cls.__call__ = make(torch.nn.Module, vars(torch.nn.modules.module))
