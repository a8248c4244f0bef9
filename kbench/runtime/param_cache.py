"""A forward's values that depend on parameters, buffers and constants alone (its pure steps,
plan.Step.pure: autocast's casts of the weights, a weight's transpose made contiguous, constants
made between regions), computed once per parameter version and reused by calls that record no
autograd history. A call that records history computes them as before: autograd must see them.

Validity: every parameter, buffer and constant the graph reads has a key — the tensor itself, its
storage, data pointer, sizes, strides, dtype and version counter (kbench._fast.TensorKeys, in
C++; ParamKeys here where that is missing) — observed at each call that uses the cache. A key
that moved (an optimizer's step, load_state_dict, p.copy_ under no_grad, p.data = ..., .to(), a
Parameter replaced) makes the values computed from that tensor stale: the next call that needs
them computes them again. Writes that bypass the version counter (through p.data, or memory
shared outside torch) are not seen: OptimizedModule.kbench_refresh() says so by hand. Autocast is
fixed per bound (a bound runs only in its capture's mode). Values are held outside autograd and
outside inference mode, and recomputed into the same tensors (a CUDA graph reads them there)."""
from __future__ import annotations

import torch

from . import fast
from .cuda import stream_getter
from .plan import EAGER, KERNEL

GIB = 1 << 30


def memory_bound(param_bytes: int) -> int:
    """The most a module's cached values may pin: half its parameters' bytes (autocast's bf16
    copies of f32 weights are exactly that) plus 1 GiB (padded and transposed copies, constants).
    Values past it are not cached: computed per call, as without the cache."""
    return param_bytes // 2 + GIB


class ParamKeys:
    """TensorKeys in Python (kbench._fast missing): the same keys, compared the same way. It holds
    each tensor and its storage as last seen (until the next observe()), so that an equal data
    pointer is the same storage, never a new one allocated where a freed one was."""

    def __init__(self, n):
        self.epoch = 0
        self.changed_at = [0] * n
        self._keys = [None] * n

    def observe(self, tensors) -> bool:
        """Compare each tensor's key with the last one seen; True where any moved (epoch moves
        on, and changed_at[i] is the new epoch for each position i that moved)."""
        moved = []
        for i, t in enumerate(tensors[:len(self._keys)]):
            key = self._keys[i]
            if key is None or not _same(key, t):
                self._keys[i] = _key(t)
                moved.append(i)
        if moved:
            self.epoch += 1
            for i in moved:
                self.changed_at[i] = self.epoch
        return bool(moved)

    def forget(self):
        """Every key unknown: the next observe() moves every position."""
        self._keys = [None] * len(self._keys)


def _key(t):
    if not isinstance(t, torch.Tensor) or t.is_inference() or t.layout != torch.strided:
        return None   # no version counter, or no storage: always moved
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (t, storage, t.data_ptr(), t.shape, t.stride(), t.dtype, t._version)


def _same(key, t) -> bool:
    return (key[0] is t and key[2] == t.data_ptr() and key[6] == t._version and key[3] == t.shape
            and key[4] == t.stride() and key[5] == t.dtype)


def make_keys(n):
    native = getattr(fast.module(), "TensorKeys", None)
    return native(n) if native is not None else ParamKeys(n)


class Entry:
    """One cached step's values, computed from the parameters at positions `reads`, last at
    keys epoch `at` (-1: never)."""

    __slots__ = ("values", "reads", "at", "nbytes", "owned")

    def __init__(self, n, reads, nbytes):
        self.values = [None] * n
        self.owned = [False] * n    # a value of its own (not a view of a parameter): refreshed in place
        self.reads, self.at, self.nbytes = reads, -1, nbytes

    def store(self, outs, ins, epoch):
        """New values: copied into the held ones where those are tensors of their own of the same
        layout (a graph reads them at their address), else held as they are (a view of an
        input, which stays where its input is)."""
        inputs = {t.untyped_storage().data_ptr() for t in ins if isinstance(t, torch.Tensor)}
        for j, new in enumerate(outs):
            old = self.values[j]
            own = isinstance(new, torch.Tensor) and new.untyped_storage().data_ptr() not in inputs
            if own and self.owned[j] and old.shape == new.shape and old.stride() == new.stride() \
                    and old.dtype == new.dtype and old.device == new.device:
                old.copy_(new)
            else:
                self.values[j] = new
                self.owned[j] = own
        self.at = epoch


class ParamCache:
    """An OptimizedModule's cached values: an entry per pure step, keyed by the step's place and
    the sizes of everything it computes, so that the signatures whose steps compute the same
    share it; the keys of the parameters, buffers and constants (the graph's inputs after the
    user's, in order), observed at each call that uses it."""

    def __init__(self, nuser: int, meta, device: torch.device):
        """meta: (name, dtype, shape) per parameter, buffer or constant input, as captured."""
        self.nuser, self.nparams, self.cuda = nuser, len(meta), device.type == "cuda"
        # where the last recomputation was queued: (raw stream, event after it), for a call on
        # another stream to wait for (the values are written in place, not made anew)
        self.written, self.raw_stream = None, stream_getter(device) if self.cuda else None
        param_bytes = sum(dtype.itemsize * torch.Size(shape).numel() for _, dtype, shape in meta)
        self.limit = memory_bound(param_bytes)
        self.keys = make_keys(self.nparams)
        self.entries = {}
        self.reserved = 0       # bytes of the entries made (computed or not yet)
        self.over = 0           # pure values not cached: past the bound
        self.recomputed = 0     # entries computed again after a key moved

    def plan(self, bound) -> "BoundCache | None":
        """The cache of one bound signature: which of its steps are served from it (step.cache),
        or None where none is."""
        steps, outputs = bound.steps, set(bound.outputs)
        first, last = self.nuser, self.nuser + self.nparams
        reads, maker = {}, {}
        for i in range(first, last):
            reads[i] = frozenset((i - first,))
        chosen = []
        for k, step in enumerate(steps):
            for i in step.made:
                maker[i] = k
            if not step.pure:
                continue
            r = frozenset().union(*(reads[i] for i in step.ins))
            for i in step.made:
                reads[i] = r
            if step.views or outputs.intersection(step.made) or not step.made:
                continue
            key = (k, step.kind, step.sizes, bound.symvals if step.kind == EAGER else None)
            entry = self.entries.get(key)
            if entry is None:
                if self.reserved + step.nbytes > self.limit:
                    self.over += 1
                    continue
                entry = self.entries[key] = Entry(len(step.made), tuple(sorted(r)), step.nbytes)
                self.reserved += step.nbytes
            step.cache = len(chosen)
            chosen.append((k, entry))
        if not chosen:
            return None
        return BoundCache(self, bound, chosen, maker)

    def forget(self):
        """Every value stale (kbench_refresh): each is computed again at its next use."""
        self.keys.forget()

    def held_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values() if e.at >= 0)

    def describe(self) -> list:
        """The report's line."""
        if not self.entries and not self.over:
            return []
        values = sum(len(e.values) for e in self.entries.values())
        line = (f"parameter cache: {values} value(s) of {len(self.entries)} step(s) computed from parameters "
                f"alone, once per parameter version (calls without autograd history); pinned "
                f"{_mb(self.held_bytes())} of a {_mb(self.limit)} bound; {self.recomputed} step(s) recomputed "
                "after a change")
        if self.over:
            line += f"; {self.over} not cached (past the bound: computed per call)"
        return [line]


def _mb(n) -> str:
    return f"{n / 2**20:.2f} MiB"


class BoundCache:
    """The cached values one bound signature reads: `lists[c]` holds the values of the step whose
    step.cache is c, fresh as of keys epoch `seen`."""

    __slots__ = ("owner", "bound", "entries", "lists", "deps", "seen", "clone")

    def __init__(self, owner, bound, chosen, maker):
        self.owner, self.bound = owner, bound
        self.entries = [e for _, e in chosen]
        self.lists = [e.values for e in self.entries]
        # per cached value, the pure steps (indices, in order) that computing it runs: its own and
        # those of the uncached pure values it reads
        steps, deps = bound.steps, []
        for k, _ in chosen:
            need, stack = set(), [k]
            while stack:
                j = stack.pop()
                if j in need:
                    continue
                need.add(j)
                stack.extend(maker[i] for i in steps[j].ins if i in maker and steps[maker[i]].cache < 0)
            deps.append(need)
        self.deps = deps
        self.seen = -1
        self.clone = self._aliasing_outputs(maker)

    def _aliasing_outputs(self, maker) -> list:
        """Graph output positions that may be views of a cached value (made from one by a torch
        call that may return a view): a call served from the cache returns a copy of them, since
        the cache will write those values again."""
        may = {}
        for step in self.bound.steps:
            if step.cache >= 0:
                got = {step.cache}
            elif step.kind == KERNEL or step.fresh_outs:
                continue
            else:
                got = set().union(*(may.get(i, ()) for i in step.ins))
            if got:
                for i in step.made:
                    may[i] = got
        return [j for j, i in enumerate(self.bound.outputs) if may.get(i)]

    def take(self, params, check=True):
        """The cached values for a call (lists), computed where a key moved since they were; None
        where this call must compute them itself (inside a caller's CUDA-graph capture: its graph
        must compute them, as eager's would). check=False: as they are (a capture of kbench's own,
        the keys checked just before)."""
        if not check:
            return self.lists
        owner = self.owner
        if owner.cuda and torch.cuda.is_current_stream_capturing():
            return None
        keys = owner.keys
        keys.observe(params)
        if self.seen != keys.epoch:
            self.refresh(params)
        if owner.written is not None and owner.written[0] != owner.raw_stream():
            torch.cuda.current_stream().wait_event(owner.written[1])
        return self.lists

    def refresh(self, params) -> None:
        """Compute the values whose parameters' keys moved after they were computed (or that never
        were), in step order, reading the fresh cached values they need; others stay."""
        owner, steps = self.owner, self.bound.steps
        keys = owner.keys
        epoch, changed_at = keys.epoch, keys.changed_at
        stale = {c for c, e in enumerate(self.entries) if e.at < 0 or any(changed_at[p] > e.at for p in e.reads)}
        if stale:
            first, last = owner.nuser, owner.nuser + owner.nparams
            todo = sorted(set().union(*(self.deps[c] for c in stale)))
            env = {}
            # values of their own: no autograd history, and normal tensors even inside inference
            # mode (a later refresh writes them in place, maybe outside it)
            with torch.inference_mode(False), torch.no_grad():
                for k in todo:
                    step = steps[k]
                    c = step.cache
                    if c >= 0 and c not in stale:
                        outs = self.lists[c]
                    else:
                        ins = [params[i - first] if first <= i < last else env[i] for i in step.ins]
                        outs = step.run_pure(ins)
                        if c >= 0:
                            if self.entries[c].at >= 0:
                                owner.recomputed += 1
                            self.entries[c].store(outs, ins, epoch)
                    env.update(zip(step.made, outs))
            if owner.cuda:
                done = torch.cuda.Event()
                done.record()
                owner.written = (owner.raw_stream(), done)
        self.seen = epoch
