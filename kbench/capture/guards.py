"""Guards on the Python state a forward reads, as torch.compile guards it: the plain attributes of
the model's modules (and of the plain objects they hold, a config), the submodules it reaches and
the globals its code names. recording() notes what one capture's forward really read; a capture
keeps it as descriptions (plain data, stored with it); bind() turns them into live checks."""
from __future__ import annotations

import contextlib
import enum
import hashlib
import inspect
import sys
import sysconfig
import threading
import types

import torch

from .signature import FlatCall

# what every nn.Module has in its __dict__: its tensors, submodules and hooks, guarded elsewhere
# (parameters by the runtime's own checks) or fixed; `training` is a plain flag the forward reads
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) - {"training"}
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
MAX_ITEMS = 64      # a container longer than this is guarded by identity, not by value
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)
MAX_CHAIN = 2       # plain objects followed below a module: module.config.sub, no deeper

# how a live check reads its value (the bits kbench._fast.Guards takes): by getattr (else as an
# item of a dict: the owner's __dict__, _modules, a module's globals), and compared by identity
# (else by type and ==); ABSENT: the entry holds while the key is missing
GETATTR, IDENTITY, ABSENT = 1, 2, 4
_MISSING = object()   # what a check reads where the value is not there


class Stale(Exception):
    """The live state differs from what the capture read: the capture does not describe it."""


def guardable(v, depth: int = 0) -> bool:
    """A value the capture may have specialized on and that compares by value: plain scalars,
    strings, dtypes, devices, enums, and small tuples, lists, sets and dicts of them (exact types:
    a subclass may compare as it likes)."""
    t = type(v)
    if t in _PLAIN or isinstance(v, enum.Enum):
        return True
    if depth < 3 and t in (tuple, list, set, frozenset) and len(v) <= MAX_ITEMS:
        return all(guardable(x, depth + 1) for x in v)
    if depth < 3 and t is dict and len(v) <= MAX_ITEMS:
        return all(guardable(k, depth + 1) and guardable(x, depth + 1) for k, x in v.items())
    return False


def _canon(v) -> str:
    t = type(v)
    if isinstance(v, enum.Enum):
        return f"{t.__module__}.{t.__qualname__}.{v.name}"
    if t in (tuple, list):
        return f"{t.__name__}(" + ",".join(map(_canon, v)) + ")"
    if t in (set, frozenset):
        return f"{t.__name__}(" + ",".join(sorted(map(_canon, v))) + ")"
    if t is dict:
        return "dict(" + ",".join(sorted(f"{_canon(k)}:{_canon(x)}" for k, x in v.items())) + ")"
    return f"{t.__name__}:{v!r}"


def digest(v) -> str:
    """A guardable value's stable digest (its type included: 1, 1.0 and True trace apart)."""
    return hashlib.sha256(_canon(v).encode()).hexdigest()[:20]


def _snapshot(v):
    """A guardable value as compared later: containers copied, so that an update in place shows."""
    t = type(v)
    if t in (list, set):
        return t(_snapshot(x) for x in v)
    if t is dict:
        return {k: _snapshot(x) for k, x in v.items()}
    return v


def is_library(cls) -> bool:
    mod = getattr(cls, "__module__", None) or ""
    return cls is object or mod == "builtins" or mod == "torch" or mod.startswith("torch.")


def _class_attr(cls, name):
    """(defining class, raw value) of name in cls's MRO, or None."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass, vars(klass)[name]
    return None


def _code_digest(code: types.CodeType) -> str:
    consts = tuple(_code_digest(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    return hashlib.sha256(repr((code.co_code, consts, code.co_names)).encode()).hexdigest()[:20]


def state_key(v) -> str:
    """A global's value as the capture cache's key sees it, stable between processes: a guardable
    value by value, a function by its code, a class by name, anything else by its type."""
    if guardable(v):
        return "eq:" + digest(v)
    fn = inspect.unwrap(v) if isinstance(v, types.FunctionType) else v
    if isinstance(fn, types.FunctionType):
        return f"fn:{fn.__module__}.{fn.__qualname__}:{_code_digest(fn.__code__)}"
    if isinstance(v, type):
        return f"class:{v.__module__}.{v.__qualname__}"
    return f"object:{type(v).__module__}.{type(v).__qualname__}"


def forward_digest(cls) -> str:
    """The code of cls's forward (unwrapped from its decorators): a class may get another forward
    than its file defines."""
    found = _class_attr(cls, "forward")
    fn = inspect.unwrap(found[1]) if found and isinstance(found[1], types.FunctionType) else None
    return _code_digest(fn.__code__) if fn is not None else ""


# ----------------------------------------------------------------------------------- globals

def _own_modules(classes) -> set:
    return {k.__module__ for cls in classes for k in cls.__mro__ if not is_library(k)}


_LIBRARY_DIRS = tuple({p for k, p in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib",
                                                                             "platlib")})


def _user_module(mod) -> bool:
    """A Python module of the user's (a settings file), not one installed or of the standard library,
    whose values a forward may read as module.NAME."""
    path = getattr(mod, "__file__", None)
    return (isinstance(path, str) and isinstance(getattr(mod, "__name__", None), str)
            and sys.modules.get(mod.__name__) is mod and not path.startswith(_LIBRARY_DIRS))


def global_reads(classes) -> dict:
    """(module name, global name) -> value for every global the forwards of `classes` may read:
    the names their code (and nested code) uses that resolve in its globals, following the
    functions and methods it calls that live in the model's own modules, and the plain values of a
    user's module it names (settings.SCALE). By the code, not by a run: a name on a branch not
    taken is included (a guard too many costs a check)."""
    own = _own_modules(classes)
    out: dict = {}
    seen: set = set()

    def walk(fn, cls):
        fn = inspect.unwrap(fn) if isinstance(fn, types.FunctionType) else fn
        if not isinstance(fn, types.FunctionType):
            return
        stack = [fn.__code__]
        globs = fn.__globals__
        modname = globs.get("__name__")
        named = isinstance(modname, str) and getattr(sys.modules.get(modname), "__dict__", None) is globs
        while stack:
            code = stack.pop()
            if code in seen:
                continue
            seen.add(code)
            stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
            for name in code.co_names:
                if name in globs:
                    v = globs[name]
                    if isinstance(v, types.ModuleType):
                        if _user_module(v):   # settings.SCALE: the plain values of a module of the user's
                            for attr in code.co_names:
                                if guardable(vars(v).get(attr, _MISSING)):
                                    out[(v.__name__, attr)] = vars(v)[attr]
                        continue
                    if named:
                        out[(modname, name)] = v
                    if isinstance(v, types.FunctionType) and v.__module__ in own:
                        walk(v, None)
                if cls is not None:   # self.helper(...): a method of the module's own class
                    found = _class_attr(cls, name)
                    if found is not None and not is_library(found[0]):
                        raw = found[1]
                        for f in (raw.fget, raw.fset) if isinstance(raw, property) else \
                                (getattr(raw, "__func__", raw),):
                            walk(f, cls)

    for cls in classes:
        if not is_library(cls):
            found = _class_attr(cls, "forward")
            if found is not None:
                walk(found[1], cls)
    return out


# --------------------------------------------------------------------------------- recording

_active = None          # the Recorder of the capture in progress (one at a time: _lock)
_lock = threading.RLock()
_subclasses: dict = {}  # original class -> its recording subclass
_origin: dict = {}      # recording subclass -> its original class


def _recording_class(cls):
    """cls with attribute reads reported to the active Recorder: given to an instance for a
    capture only (restored after), so the class the user sees is never changed."""
    sub = _subclasses.get(cls)
    if sub is not None:
        return sub
    ns = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__slots__": ()}

    has_getattr = hasattr(cls, "__getattr__")

    def recorded(lookup: str, note_missing: bool):
        """cls's `lookup` (__getattribute__ or __getattr__), with each read (and, where
        note_missing, each miss) told to the active recorder."""
        base = getattr(cls, lookup)   # sub's only base is cls: what super(sub, self) would find

        def get(self, name):
            try:
                v = base(self, name)
            except AttributeError:
                rec = _active
                if note_missing and rec is not None and rec.depth:
                    rec.missed(self, name)
                raise
            rec = _active
            if rec is not None and rec.depth:
                rec.read(self, name, v)
            return v
        get.__name__ = lookup
        return get
    # a miss is __getattr__'s to note where the class has one (nn.Module's: parameters, buffers,
    # submodules), else __getattribute__'s
    ns["__getattribute__"] = recorded("__getattribute__", not has_getattr)

    def __setattr__(self, name, value):
        rec = _active
        if rec is not None and rec.depth:
            rec.wrote(self, name)
        super(sub, self).__setattr__(name, value)
    ns["__setattr__"] = __setattr__

    def __delattr__(self, name):
        rec = _active
        if rec is not None and rec.depth:
            rec.wrote(self, name)
        super(sub, self).__delattr__(name)
    ns["__delattr__"] = __delattr__
    if has_getattr:
        ns["__getattr__"] = recorded("__getattr__", True)
    sub = _subclasses[cls] = type(cls.__name__, (cls,), ns)
    _origin[sub] = cls
    return sub


def _wrappable(v) -> bool:
    """A plain object whose own attribute reads can be recorded (a config): an instance of a
    Python class of the model's, not a module, tensor, function, class or library object."""
    t = type(v)
    return (hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, torch.Tensor, type, types.FunctionType,
                                                          types.MethodType, types.ModuleType, enum.Enum))
            and not is_library(t) and t.__module__ not in ("builtins", "abc") and not t.__module__.startswith("_"))


class Recorder:
    """What one capture's forward read, as descriptions: (kind, owner, name, check) with kind
    "attr" (owner's __dict__[name]), "getattr" (getattr(owner, name)), "child"
    (owner._modules[name]) or "global" (the globals of the Python module named owner); owner is a
    module path and the attribute chain below it ((path,), (path, "config")), a module name for a
    global; check is "id" (the same object) or "eq:<digest>" (an equal value). Kind "absent": the
    forward looked for the attribute and did not find it; kind "write": the forward sets it (no
    capture of it holds)."""

    def __init__(self, root):
        self.root = root
        self.thread = threading.get_ident()
        self.depth = 0
        self.busy = False
        self.owners: dict = {}      # id(object) -> owner tuple
        self.held: list = []        # the objects owners names (kept alive while recording)
        self.swapped: list = []     # (object, its own class)
        self.found: dict = {}       # (kind, owner, name) -> check, in reading order
        self.called: dict = {}      # id(class) -> class, of every module whose forward ran
        self.unrecorded: list = []  # (path, module) whose class could not be swapped

    # -- the forward's calls

    def enter(self, module, *_):
        if threading.get_ident() == self.thread:
            self.depth += 1
            cls = _origin.get(type(module), type(module))
            self.called[id(cls)] = cls

    def leave(self, *_):
        if threading.get_ident() == self.thread and self.depth:
            self.depth -= 1

    # -- reads

    def own(self, obj, owner) -> bool:
        if id(obj) in self.owners:
            return False
        cls = type(obj)
        try:
            object.__setattr__(obj, "__class__", _recording_class(cls))
        except TypeError:
            return False
        self.owners[id(obj)] = owner
        self.held.append(obj)
        self.swapped.append((obj, cls))
        return True

    def read(self, obj, name, v):
        if self.busy or threading.get_ident() != self.thread or name.startswith("__") or name.startswith("_kbench"):
            return
        owner = self.owners.get(id(obj))
        if owner is None:
            return
        self.busy = True
        try:
            self._read(obj, owner, name, v)
        finally:
            self.busy = False

    def _read(self, obj, owner, name, v):
        is_module = isinstance(obj, torch.nn.Module)
        if is_module and name in _MODULE_INTERNALS:
            return
        d = object.__getattribute__(obj, "__dict__")
        if name in d:
            kind = "attr"
        elif is_module and name in d["_modules"]:
            self.found.setdefault(("child", owner, name), "id")
            if isinstance(v, _CONTAINERS):   # iterated or indexed inside: each entry is read
                path = f"{owner[0]}.{name}" if owner[0] else name
                for key in object.__getattribute__(v, "_modules"):
                    self.found.setdefault(("child", (path,), key), "id")
            return
        elif is_module and (name in d["_parameters"] or name in d["_buffers"]):
            return   # tensors: the runtime checks them (_checked_params, the fast path's chains)
        else:
            found = _class_attr(type(obj), name)
            if found is not None and (is_library(found[0]) or not guardable(found[1])):
                return   # a method, a property (its own reads are recorded), torch's class constants
            if found is None and not guardable(v):
                return   # made by a custom __getattr__: compared by value only
            alias = getattr(type(obj), "attribute_map", None)   # a Hugging Face config's aliases
            if found is None and type(alias) is dict and alias.get(name) in d:
                name, kind = alias[name], "attr"     # num_hidden_layers is n_layer: a dict lookup, not
            else:                                    # the config's Python __getattribute__ per call
                kind = "getattr"
        if guardable(v):
            self.found.setdefault((kind, owner, name), "eq:" + digest(v))
            return
        self.found.setdefault((kind, owner, name), "id")
        if len(owner) <= MAX_CHAIN and _wrappable(v):
            self.own(v, owner + (name,))

    def missed(self, obj, name):
        """An attribute the forward looked for and did not find (getattr(self, "flag", None),
        hasattr): the capture took the branch for its absence."""
        if self.busy or threading.get_ident() != self.thread or name.startswith("__") or name.startswith("_kbench"):
            return
        owner = self.owners.get(id(obj))
        if owner is not None and not (isinstance(obj, torch.nn.Module) and name in _MODULE_INTERNALS):
            self.found.setdefault(("absent", owner, name), "")

    def wrote(self, obj, name):
        """An attribute set inside the forward: the capture does not replay it (a call counter, a
        cache kept on the module), so no capture of this forward is trusted."""
        if self.busy or threading.get_ident() != self.thread or name.startswith("__"):
            return
        owner = self.owners.get(id(obj))
        if owner is None:
            return
        if isinstance(obj, torch.nn.Module):
            d = object.__getattribute__(obj, "__dict__")
            if name in _MODULE_INTERNALS or any(name in d.get(t, ()) for t in ("_parameters", "_buffers", "_modules")):
                return   # tensors and submodules: export sees what the forward does to them
        self.found.setdefault(("write", owner, name), "")

    # -- the result

    def descriptions(self) -> tuple:
        for path, m in self.unrecorded:   # reads not seen: every plain attribute, conservatively
            for name, v in vars(m).items():
                if name not in _MODULE_INTERNALS and not name.startswith("_kbench") and guardable(v):
                    self.found.setdefault(("attr", (path,), name), "eq:" + digest(v))
        out = [(kind, owner, name, check) for (kind, owner, name), check in self.found.items()]
        for (modname, name), v in global_reads(list(self.called.values())).items():
            out.append(("global", modname, name, "eq:" + digest(v) if guardable(v) else "id"))
        return tuple(out)


@contextlib.contextmanager
def recording(model):
    """Records the reads of `model`'s forward while the block runs (torch.export calls it): each
    module of the tree given a recording subclass, global forward hooks counting the depth of
    forward calls (only reads inside a forward count, not the exporter's own). Yields the
    Recorder; every class is restored on leaving."""
    global _active
    root = model.__dict__["_kbench_inner"] if isinstance(model, FlatCall) else model
    with _lock:
        rec = Recorder(root)
        for path, m in root.named_modules():
            if not rec.own(m, (path,)):
                rec.unrecorded.append((path, m))
        mm = torch.nn.modules.module
        pre = mm.register_module_forward_pre_hook(rec.enter)
        post = mm.register_module_forward_hook(rec.leave, always_call=True)
        outer, _active = _active, rec
        try:
            yield rec
        finally:
            _active = outer
            pre.remove()
            post.remove()
            for obj, cls in reversed(rec.swapped):
                object.__setattr__(obj, "__class__", cls)
            rec.held.clear()


# ------------------------------------------------------------------------------------- binding

class Bound:
    """A capture's guards on a live module tree: entries (table, key, expected, how) for
    kbench._fast.Guards or the Python loop here, and a label per entry for the reason."""

    def __init__(self, entries, labels, native=None):
        self.entries = tuple(entries)
        self.labels = labels
        self.native = native(self.entries) if native is not None and self.entries else None

    def __len__(self):
        return len(self.entries)

    def failing(self) -> int:
        """The first entry that no longer holds, or -1."""
        if self.native is not None:
            return self.native.check()
        return check(self.entries)

    def now(self) -> tuple:
        """The values the entries read now (containers copied): a state to recognize later."""
        return tuple(_snapshot(_read(table, key, how)) for table, key, _, how in self.entries)

    def holds_at(self, values) -> bool:
        """Whether the state now is the one now() gave then."""
        return check([(table, key, v, how & ~ABSENT | (IDENTITY if v is _MISSING else 0))
                      for (table, key, _, how), v in zip(self.entries, values)]) < 0

    def why(self, i: int) -> str:
        table, key, want, how = self.entries[i]
        got = _read(table, key, how)
        if how & ABSENT:
            change = "set, where the capture found none"
        elif got is _MISSING:
            change = "gone"
        elif how & IDENTITY:
            change = "another object"
        else:
            change = f"{_short(want)} -> {_short(got)}"
        return f"{self.labels[i]} changed ({change})"



def _read(table, key, how):
    try:
        return getattr(table, key, _MISSING) if how & GETATTR else table.get(key, _MISSING)
    except Exception:  # noqa: BLE001 - a read that fails is a guard that fails
        return _MISSING


def check(entries) -> int:
    """The Python twin of kbench._fast.Guards.check: the first entry whose value is not the one
    expected (identity, else the same type and ==), or -1."""
    for i, (table, key, want, how) in enumerate(entries):
        if how & GETATTR:
            got = _read(table, key, how)
        else:   # a dict's own get: no call through _read for the common entry
            got = table.get(key, _MISSING)
        if how & ABSENT:
            if got is not _MISSING:
                return i
            continue
        if got is want:
            continue
        if how & IDENTITY or type(got) is not type(want):
            return i
        try:
            if not (got == want):
                return i
        except Exception:  # noqa: BLE001
            return i
    return -1


def _short(x) -> str:
    s = repr(x)
    return s if len(s) <= 60 else s[:57] + "..."


def _label(kind, owner, name) -> str:
    """What a check is of, for the reason a change gives."""
    if kind == "global":
        return f"global {name} (in {owner})"
    path = ".".join(p for p in owner if p)
    return f"{'submodule' if kind == 'child' else 'attribute'} {path + '.' if path else ''}{name}"


def bind(model, descriptions, native=None) -> Bound:
    """The live checks of a capture's descriptions on `model` (the module the capture read, now).
    Stale when the state already differs from what the capture read (the forward changes what it
    reads, or a stored capture met another state)."""
    entries, labels = [], []
    for kind, owner, name, chk in descriptions:
        label = _label(kind, owner, name)
        if kind == "write":
            raise Stale(f"it sets {label}, which a capture does not repeat")
        if kind == "global":
            mod = sys.modules.get(owner)
            if mod is None:
                raise Stale(f"{label}: the module is not loaded")
            table, how = vars(mod), 0
        else:
            try:
                obj = model.get_submodule(owner[0])
                for attr in owner[1:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                raise Stale(f"{label}: its owner is gone") from None
            if kind == "absent":   # a module's attribute may come from any of its dicts
                tables = [vars(obj)] + ([obj._parameters, obj._buffers, obj._modules]
                                        if isinstance(obj, torch.nn.Module) else [])
                for table in tables:
                    if name in table:
                        raise Stale(f"{label} exists, where the capture found none")
                    entries.append((table, name, None, ABSENT))
                    labels.append(label)
                continue
            if kind == "child":
                table, how = obj._modules, 0
            elif kind == "attr":
                table, how = vars(obj), 0
            else:
                table, how = obj, GETATTR
        got = _read(table, name, how)
        if got is _MISSING:
            raise Stale(f"{label} is gone")
        if chk == "id":
            entries.append((table, name, got, how | IDENTITY))
        else:
            if not guardable(got) or "eq:" + digest(got) != chk:
                raise Stale(f"{label} is {_short(got)}, not the value the capture read")
            entries.append((table, name, _snapshot(got), how))
        labels.append(label)
    return Bound(entries, labels, native)


def stale(model, descriptions) -> str:
    """Why the descriptions do not hold on `model` now ("" where they do)."""
    try:
        bind(model, descriptions)
    except Stale as e:
        return str(e)
    return ""
