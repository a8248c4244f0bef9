"""A captured model kept between processes, so that optimizing the same model
again does not run torch.export (fake-tensor tracing and its imports are most of a warm optimize).

The key fingerprints what a capture depends on: the module tree (classes, the source files that
define them, their forwards' code, plain attributes, parameter and buffer shapes and dtypes), the
globals the forwards may read (guards.global_reads), the example inputs' dtypes, shapes and
strides, the backend, grad and autocast modes, and the torch, kbench and Python versions. A key
cannot see everything forward may read (a helper function in another file), so a hit is checked
before it is trusted: the Python state its capture read must hold (capture/guards.py), and
api.optimize runs the optimized module on the example inputs and compares with eager
(`matches_eager`); a mismatch drops the entry and captures afresh. Models whose forward mutates
state or draws random numbers are not kept, since that check would not be repeatable for them."""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import inspect
import logging
import sys
import types

import torch
import torch.utils._pytree as pytree

from ..tune import cache as store
from ..version import __version__
from . import guards as state_guards
from . import stored
from .modes import autocast_mode
from .types import Captured

log = logging.getLogger("kbench.capture.cache")

FORMAT = 3   # bump when the stored layout changes: older entries then simply miss (3: data only, no pickle)

# ops whose result changes from call to call: a capture holding one cannot be checked against eager
_RANDOM = ("rand", "dropout", "bernoulli", "normal", "uniform", "multinomial", "poisson", "exponential")

# what every nn.Module has in its __dict__: the parts covered separately (parameters, buffers,
# submodules) or checked for emptiness (hooks)
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) - {"training"}


class Uncacheable(Exception):
    """This model (or its capture) is not kept; the message says why, for the debug log."""


# ------------------------------------------------------------------------------- fingerprint

@functools.lru_cache(maxsize=None)
def _lowering_digest() -> str:
    """The capture package's own source (export, lowering, the op table): a stored capture is the
    lowering's output, so a change to the lowering (a new op, a fixed rule) must miss, even
    within one version number (an editable install between commits)."""
    import pathlib
    h = hashlib.sha256()
    for f in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def fingerprint(model: torch.nn.Module, args: tuple, backend: str, call_key: str = "", gemm: bool = False) -> str:
    """The capture's cache key (a sha256 hex digest); Uncacheable when forward hooks or the like
    make the module tree an incomplete description of what forward does. args: the call's
    tensors; call_key: the rest of the call (signature.CallSpec.key), "" for tensors passed
    positionally; gemm: matrix products lowered to MATMUL (a capture of its own, keyed only when on,
    so the keys of captures without it stay as they were)."""
    h = _Hasher()
    h.add("kbench-capture", FORMAT, __version__, _lowering_digest(), torch.__version__, sys.version_info[:2], backend,
          torch.is_grad_enabled(), autocast_mode(), call_key)
    if gemm:
        h.add("gemm")
    classes: dict = {}   # the module classes of the tree, in order
    for a in args:
        h.add("input", a.dtype, tuple(a.shape), a.stride(), a.device.type, a.requires_grad)
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        raise Uncacheable("global forward hooks are registered")
    for name, m in model.named_modules():
        h.add("module", name, _qualname(type(m)))
        for key, value in m.__dict__.items():
            if key in _MODULE_INTERNALS:
                if key.endswith("hooks") and value:
                    raise Uncacheable(f"module {name or type(m).__name__!r} has {key.strip('_')}")
                continue
            h.add("attr", key)
            h.value(value)
        for pname, p in m._parameters.items():
            h.add("param", pname, None if p is None else (p.dtype, tuple(p.shape), p.device.type, p.requires_grad))
        for bname, b in m._buffers.items():
            h.add("buffer", bname, bname in m._non_persistent_buffers_set,
                  None if b is None else (b.dtype, tuple(b.shape), b.device.type))
        for cls in type(m).__mro__:
            if not _is_library(cls):
                h.add("class", _qualname(cls), _class_source(cls))
        classes.setdefault(type(m), None)
    # what the runtime guards besides the attributes above (capture/guards.py): the code of every
    # forward (a class may be given another forward than its file defines), the plain values its
    # classes hold, and the globals the forwards may read (a flag, a helper function)
    for cls in classes:
        h.add("forward", _qualname(cls), state_guards.forward_digest(cls))
        for klass in cls.__mro__:
            if not _is_library(klass):
                h.add("class-values", _qualname(klass), sorted(
                    (k, state_guards.digest(v)) for k, v in vars(klass).items()
                    if not k.startswith("__") and state_guards.guardable(v)))
    for (where, name), v in sorted(state_guards.global_reads(list(classes)).items()):
        h.add("global", where, name, state_guards.state_key(v))
    return h.hexdigest()


class _Hasher:
    def __init__(self):
        self._h = hashlib.sha256()
        self._seen: set = set()

    def add(self, *parts):
        self._h.update(repr(parts).encode())
        self._h.update(b"\0")

    def hexdigest(self) -> str:
        return self._h.hexdigest()

    def value(self, v, depth=0):
        """A module attribute: plain values by repr, containers recursively, functions by their
        code, tensors by content; other objects by type and (shallowly) their own attributes."""
        if v is None or isinstance(v, (bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                                       torch.Size, enum.Enum)):
            self.add(type(v).__name__, v)
        elif isinstance(v, torch.nn.Module):
            self.add("module-ref")        # a submodule (covered by named_modules) or a shared one
        elif isinstance(v, torch.Tensor):
            data = v.detach().cpu().contiguous()
            self.add("tensor", v.dtype, tuple(v.shape),
                     hashlib.sha256(data.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest())
        elif isinstance(v, (list, tuple, set, frozenset)):
            items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
            self.add(type(v).__name__, len(items))
            for x in items:
                self.value(x, depth + 1)
        elif isinstance(v, dict):
            self.add("dict", len(v))
            for k in sorted(v, key=repr):
                self.add("key", repr(k))
                self.value(v[k], depth + 1)
        elif isinstance(v, (types.FunctionType, types.MethodType)):
            fn = v.__func__ if isinstance(v, types.MethodType) else v
            self.add("function", _qualname(fn), _code_digest(fn.__code__))
            # what the code reads besides its globals: closure cells and defaults (lambda: f(x, n))
            cells = [c.cell_contents for c in fn.__closure__ or () if _cell_is_set(c)]
            self.value((cells, fn.__defaults__, fn.__kwdefaults__), depth + 1)
        elif isinstance(v, functools.partial):
            self.add("partial")
            self.value((v.func, v.args, v.keywords), depth + 1)
        elif isinstance(v, type):
            self.add("class", _qualname(v))
        elif callable(v) and not hasattr(v, "__dict__"):
            self.add("builtin", getattr(v, "__module__", None), getattr(v, "__qualname__", repr(v)))
        else:
            self.add("object", _qualname(type(v)))
            if id(v) in self._seen or depth > 3:
                return
            self._seen.add(id(v))
            if dataclasses.is_dataclass(v) or hasattr(v, "__dict__"):
                self.value(vars(v), depth + 1)
            elif type(v).__repr__ is not object.__repr__:
                self.add("repr", repr(v))


def _qualname(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"


def _is_library(cls) -> bool:
    mod = cls.__module__ or ""
    return cls is object or mod == "builtins" or mod == "torch" or mod.startswith("torch.")


_file_digests: dict = {}


def _class_source(cls) -> str:
    """The digest of the file that defines cls (which covers the helper functions beside it), or
    of its methods' code where there is no file (a class typed into a REPL)."""
    try:
        path = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        path = None
    if path:
        if path not in _file_digests:
            try:
                with open(path, "rb") as f:
                    _file_digests[path] = hashlib.sha256(f.read()).hexdigest()
            except OSError:
                _file_digests[path] = None
        if _file_digests[path]:
            return _file_digests[path]
    parts = []
    for name, v in sorted(vars(cls).items()):
        fn = getattr(v, "__func__", v)
        if isinstance(fn, types.FunctionType):
            parts.append((name, _code_digest(fn.__code__)))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _cell_is_set(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:   # an empty cell (a name not yet bound)
        return False


def _code_digest(code: types.CodeType) -> str:
    consts = tuple(_code_digest(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    return hashlib.sha256(repr((code.co_code, consts, code.co_names)).encode()).hexdigest()


# ----------------------------------------------------------------------------- serialization

def dumps(captured) -> bytes:
    """A Captured as bytes: data only (stored.py), never pickled, so that reading an entry runs
    nothing. Uncacheable for state a later process could not check (mutations, random ops) or
    that the data format cannot hold (a GraphModule, a custom class, a namedtuple output)."""
    if captured.mutations:
        raise Uncacheable("forward updates buffers or inputs in place")
    for ext in captured.externs:
        if any(word in ext.name.lower() for word in _RANDOM):
            raise Uncacheable(f"forward draws random numbers ({ext.name})")
    try:
        return stored.dumps(captured)
    except (ValueError, TypeError, RuntimeError) as e:   # NotData, or a value torch cannot give as bytes
        raise Uncacheable(f"the capture holds something that is not stored: {e}") from None


def loads(blob: bytes):
    """The Captured that dumps() stored; any failure raises (the caller drops the entry). An
    entry in another format (a pickled one from an older kbench) is not read, only refused."""
    return stored.loads(blob)


# ------------------------------------------------------------------------------------- store

def lookup(model, args, backend, call_key: str = "", gemm: bool = False):
    """(key, Captured or None). key is None when this model's capture is not kept (the reason
    goes to the debug log); a stored entry that cannot be rebuilt is dropped with a warning."""
    try:
        key = fingerprint(model, args, backend, call_key, gemm)
    except Uncacheable as e:
        log.debug("kbench: capture not cached: %s", e)
        return None, None
    except Exception as e:  # noqa: BLE001 - a fingerprint that fails only costs the cache
        log.debug("kbench: capture not cached: fingerprint failed (%s: %s)", type(e).__name__, e)
        return None, None
    try:
        with contextlib.closing(store.open_cache()) as db:
            blob = db.load_capture(key)
            if blob is None:
                return key, None
            try:
                return key, loads(blob)
            except Exception as e:  # noqa: BLE001 - never trusted when it does not rebuild cleanly
                log.warning("kbench: a stored capture is unusable (%s: %s); capturing again", type(e).__name__, e)
                db.drop_capture(key)
                return key, None
    except Exception as e:  # noqa: BLE001 - the cache is an optimization; optimize() goes on
        log.warning("kbench: capture cache unavailable (%s)", e)
        return None, None


def remember(key: str, captured) -> None:
    try:
        blob = dumps(captured)
    except Uncacheable as e:
        log.debug("kbench: capture not cached: %s", e)
        return
    try:
        with contextlib.closing(store.open_cache()) as db:
            db.store_capture(key, blob)
    except Exception as e:  # noqa: BLE001
        log.warning("kbench: could not keep the capture in the cache (%s)", e)


def forget(key: str) -> None:
    try:
        with contextlib.closing(store.open_cache()) as db:
            db.drop_capture(key)
    except Exception as e:  # noqa: BLE001
        log.warning("kbench: could not drop a stored capture (%s)", e)


# ----------------------------------------------------------------------------------- checking

def matches_eager(model, optimized, args, kwargs=None) -> str:
    """'' when the optimized module's outputs on the call match the model's (the check a cached
    capture passes before it is used), else what differs. Runs without autograd."""
    kwargs = kwargs or {}
    with torch.no_grad():
        want = model(*args, **kwargs)
        got = optimized(*args, **kwargs)
    want_leaves, want_spec = pytree.tree_flatten(want)
    got_leaves, got_spec = pytree.tree_flatten(got)
    if want_spec != got_spec:
        return f"output structure {got_spec} != eager's {want_spec}"
    low_precision = bool(autocast_mode())
    for i, (w, g) in enumerate(zip(want_leaves, got_leaves)):
        if not isinstance(w, torch.Tensor):
            if w != g:
                return f"output {i}: {g!r} != eager's {w!r}"
            continue
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            return f"output {i}: {_desc(g)} != eager's {_desc(w)}"
        if not (w.is_floating_point() or w.is_complex()):
            if not torch.equal(g, w):
                return f"output {i}: values differ from eager's"
            continue
        w64, g64 = w.double(), g.double()
        finite, inf = torch.isfinite(w64), torch.isinf(w64)
        if not torch.equal(torch.isnan(w64), torch.isnan(g64)) or not torch.equal(w64[inf], g64[inf]):
            return f"output {i}: non-finite values differ from eager's"
        if finite.any():
            scale = float(w64[finite].abs().max().clamp_min(1e-30))
            err = float((g64[finite] - w64[finite]).abs().max()) / scale
            # under autocast a float32 output was computed through 16-bit matmuls
            tol = 1e-3 if w.dtype in (torch.float32, torch.float64) and not low_precision else 5e-2
            if not err <= tol:
                return f"output {i}: differs from eager's by {err:.2g} of its largest value (allowed {tol:g})"
    return ""


def _desc(x) -> str:
    return f"{x.dtype}{list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
