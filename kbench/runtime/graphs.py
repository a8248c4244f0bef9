"""CUDA-graph mode of an optimized module (optimize(..., cuda_graphs="auto" | True | False)): a
call whose signature kbench already runs on its own path is captured once into a
torch.cuda.CUDAGraph and replayed from then on — one graph launch for the whole forward instead of
a host round trip per region. Here: which modules and calls are safe to graph and why not, the
guards checked before every replay, the capture, the replay and what it pins."""
from __future__ import annotations

import functools
import logging
import operator
import threading

import torch
import torch.utils._pytree as pytree

from . import train_graphs
from .train_graphs import Unsafe, capture_failed
from .cuda import stream_getter
from .plan import Fallback, Status

log = logging.getLogger("kbench")

OPTIONS = ("auto", True, False, "inference")
WARMUP = 2           # un-graphed calls of a signature before it is captured (kernels loaded,
                     # cuBLAS handles and workspaces made, lazy state settled)
MAX_GRAPHS = 8       # signatures graphed per module: each pins its own outputs in the pool
MAX_ENTRIES = 256    # signatures tracked (their warm-up counts) before the uncaptured are forgotten
MAX_DROPS = 3        # times the parameters may change under the graphs before graphs are off

WANTS_GRAD = "the call wants gradients (cuda_graphs='inference' graphs calls without gradients only)"

_NO = object()       # "not replayed": the un-graphed path runs the call
_deferred = []       # graphs of runners collected during someone's capture, destroyed after it


def check_option(value):
    """cuda_graphs as given, or ValueError with the values it takes."""
    if value is True or value is False or (isinstance(value, str) and value in ("auto", "inference")):
        return value
    raise ValueError(f"cuda_graphs must be 'auto', True, False or 'inference', got {value!r}")


# ---------------------------------------------------------------------------- the decision

def _tag(name):
    return getattr(torch.Tag, name, None)


_SYNC_TAG, _SHAPE_TAG, _RANDOM_TAG = _tag("data_dependent_output"), _tag("dynamic_output_shape"), \
    _tag("nondeterministic_seeded")
# ops tagged with a data-dependent output shape that have a static one when no index is a mask
_INDEX_OPS = {op for op in (getattr(torch.ops.aten.index, "Tensor", None),
                            getattr(getattr(torch.ops.aten, "_unsafe_index", None), "Tensor", None)) if op is not None}
_HOST_CONTROL_FLOW = ("cond", "while_loop")   # a predicate read on the host


def _static_index(fn, args, dtypes) -> bool:
    """aten.index with integer index tensors only (operands of the EXTERN node): its output's shape
    is the indices' shape, no mask is counted on the host."""
    if fn not in _INDEX_OPS or dtypes is None or len(args) < 2 or not isinstance(args[1], (list, tuple)):
        return False
    for ix in args[1]:
        if ix is None:
            continue
        k = getattr(ix, "k", None)   # a TensorSlot: the node's k-th operand
        if type(ix).__name__ != "TensorSlot" or k is None or k >= len(dtypes) or dtypes[k] in ("bool", "u8"):
            return False
    return True


def step_blocker(fn, args, kwargs, dtypes=None) -> str:
    """Why one step of an extern (a torch call between kernels) cannot be captured: it reads a
    value on the host, makes a shape from values, draws from a generator of its own, holds a CPU
    tensor. "" where it can."""
    tags = getattr(fn, "tags", ()) or ()
    if _SYNC_TAG is not None and _SYNC_TAG in tags:
        return "reads a tensor's value on the host (a sync a capture cannot hold)"
    if _SHAPE_TAG is not None and _SHAPE_TAG in tags and not _static_index(fn, args, dtypes):
        return "its output's shape depends on the values"
    if isinstance(fn, torch._ops.HigherOrderOperator) and fn.name() in _HOST_CONTROL_FLOW:
        return f"{fn.name()} branches on a value read on the host"
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Generator):
            return "draws from a generator of its own (a capture registers only torch's default one)"
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "cuda":
            return f"holds a tensor on {leaf.device}"
    return ""


def draws_random(externs) -> bool:
    """An extern draws random numbers (dropout in training mode): through torch's default CUDA
    generator, whose state torch.cuda.graph registers, so each replay draws new ones."""
    return any(_RANDOM_TAG is not None and _RANDOM_TAG in (getattr(fn, "tags", ()) or ())
               for ext in externs for fn, _, _ in ext.steps)


def extern_operand_dtypes(plan) -> dict:
    """extern index -> the IR dtypes of its EXTERN node's operands."""
    out = {}
    for nd in plan.nodes:
        if nd["op"] == "extern":
            out.setdefault(nd["index"], [plan.nodes[u]["dtype"] for u in nd["inputs"]])
    return out


def module_blockers(module) -> list:
    """Why no call of this optimized module can be graphed, one reason a line (empty: calls may be,
    each under the per-call guards). Computed from the plan alone: no GPU is needed to ask."""
    why = []
    executor, device = module._kbench_executor, module._kbench_device
    plan, captured = module._kbench_plan, module._kbench_captured
    if executor.name != "cuda":
        why.append(f"backend {executor.name!r} runs its regions on the CPU (graphs capture CUDA work)")
    elif device.type != "cuda":
        why.append(f"the module runs on {device}, not a CUDA device")
    if executor.name == "cuda":
        interp = [info.index for info in plan.regions if info.status is Status.INTERP]
        if interp:
            why.append(f"region(s) {interp} run on the C interpreter, on the CPU")
    cpu = sorted(k for k, v in module._kbench_constants.items()
                 if isinstance(v, torch.Tensor) and v.device.type != "cuda")
    if cpu:
        why.append(f"constant(s) {', '.join(cpu)} are held on the CPU")
    users = [name for _, kind, name in captured.mutations if kind == "user"]
    if users:
        why.append(f"the forward updates its input(s) {', '.join(users)} in place (a replay would update "
                   "the graph's copy, not the caller's tensor)")
    dtypes = extern_operand_dtypes(plan)
    for i, ext in enumerate(captured.externs):
        for fn, args, kwargs in ext.steps:
            reason = step_blocker(fn, args, kwargs, dtypes.get(i))
            if reason:
                why.append(f"extern {ext.name}: {reason}")
                break
    return why


# ---------------------------------------------------------------------------- guards

_is = operator.is_
_getitem = operator.getitem
_requires_grad = operator.attrgetter("requires_grad")
_ptrs_equal_c = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)   # CUDA builds of torch


class ParamGuard:
    """The module's parameters, buffers and constants as the graph read them, found through the
    live modules' dicts as OptimizedModule._params does, but resolved once: per call, an identity
    check of each submodule on the way (a replaced submodule) and one dict lookup per tensor."""

    def __init__(self, module):
        root, constants = module._kbench_orig, module._kbench_constants
        hop_dicts, hop_keys, hop_mods, seen = [], [], [], set()
        self.dicts, self.keys = [], []
        for path, table, leaf in module._kbench_param_chains + written_only(module):
            if path is None:   # a captured constant: never replaced
                self.dicts.append(constants)
                self.keys.append(leaf)
                continue
            m = root
            for i, part in enumerate(path):
                child = m._modules[part]
                if path[:i + 1] not in seen:
                    seen.add(path[:i + 1])
                    hop_dicts.append(m._modules)
                    hop_keys.append(part)
                    hop_mods.append(child)
                m = child
            self.dicts.append(getattr(m, table))
            self.keys.append(leaf)
        self.hops = (hop_dicts, hop_keys, hop_mods)

    def live(self):
        """The tensors now (a list), or None where a submodule on the way was replaced or a
        tensor is gone: the guard must be built again."""
        dicts, keys, mods = self.hops
        if not all(map(_is, map(dict.get, dicts, keys), mods)):
            return None
        try:
            return list(map(_getitem, self.dicts, self.keys))
        except KeyError:
            return None


def written_only(module) -> list:
    """(path, table, leaf) of the buffers and parameters the forward updates in place without
    reading them: the graph writes them at their captured addresses, so they are guarded too."""
    read = {".".join(path + (leaf,)) for path, _, leaf in module._kbench_param_chains if path is not None}
    chains = []
    for _, kind, name in module._kbench_captured.mutations:
        if kind == "user" or name in read:
            continue
        *path, leaf = name.split(".")
        owner = module._kbench_orig.get_submodule(".".join(path)) if path else module._kbench_orig
        chains.append((tuple(path), "_buffers" if leaf in owner._buffers else "_parameters", leaf))
        read.add(name)
    return chains


def same_tensors(live, held, ptrs, indices=None) -> bool:
    """The very tensors the graph was captured with, at the same addresses: an optimizer's step
    (in place) keeps both and the replay reads the new values; a replaced tensor or a .data
    swap (module.to(), .half()) changes one and the graph would read freed memory. indices:
    list(range(len(held))), made once by the caller."""
    if len(live) != len(held) or not all(map(_is, live, held)):
        return False
    if _ptrs_equal_c is not None:
        return _ptrs_equal_c(live, ptrs, indices if indices is not None else list(range(len(live))))
    return [t.data_ptr() for t in live] == ptrs


def _autocast_state(cuda: bool):
    """None where autocast is off on CUDA, else (dtype,): a graph is captured with autocast's
    weight cache off whatever the caller's setting (_without_autocast_cache), so the setting does
    not key it."""
    if not cuda or not torch.is_autocast_enabled("cuda"):
        return None
    return (torch.get_autocast_dtype("cuda"),)


def _without_autocast_cache(fn):
    """fn, run with autocast's weight cache off. With it on, a cast the cache already holds (made
    by an earlier call in the caller's autocast region) is read by the graph from memory that is
    freed when that region exits, and a cast made in the capture would enter the cache from the
    graph's pool. Off, every cast is a kernel in the graph: a replay recasts the current weights,
    as eager does once per autocast region."""
    def run():
        was = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            return fn()
        finally:
            torch.set_autocast_cache_enabled(was)
    return run


# ---------------------------------------------------------------------------- capture and outputs

def capture_cuda_graph(fn, pool, device, stream):
    """(graph, fn()'s result) with fn's CUDA work captured into a torch.cuda.CUDAGraph on `stream`
    (a side stream), in the memory pool `pool`. Nothing runs: the caller replays it."""
    graph = torch.cuda.CUDAGraph()
    prev = torch.cuda.current_stream(device)
    generator = _generator_state(device)
    try:
        # thread_local: another thread's CUDA calls meanwhile (a DataLoader pinning memory) are
        # not ours to fail, as torch.compile's graphs leave them alone too
        with torch.cuda.device(device), torch.cuda.graph(graph, pool=pool, stream=stream,
                                                         capture_error_mode="thread_local"):
            out = fn()
    except BaseException:
        # torch.cuda.graph's exit does not restore the stream when ending the capture raises, nor
        # take the CUDA generator out of capture mode (every later draw would then raise)
        torch.cuda.set_stream(prev)
        _restore_generator(generator)
        raise
    return graph, out


def _generator_state(device):
    """(the default CUDA generator of device, a copy of its state) for _restore_generator, or None
    where this torch cannot swap a generator's state."""
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        gen = torch.cuda.default_generators[index]
        return gen, gen.clone_state()
    except (AttributeError, RuntimeError, IndexError):
        return None


def _restore_generator(saved) -> None:
    if saved is not None:
        gen, state = saved
        gen.graphsafe_set_state(state)


class Outputs:
    """A captured call's outputs, given to each replay's caller as fresh tensors (a later replay
    writes the graph's; it must not change what a caller holds), with the sharing among them the
    un-graphed call gives (two views of one buffer stay views of one new buffer)."""

    def __init__(self, out, forbidden):
        """out: a call's outputs, a list of the graph's outputs (spec None: fresh() gives a list
        back) or any pytree of them."""
        leaves, self.spec = (list(out), None) if type(out) is list else pytree.tree_flatten(out)
        self.leaves = leaves
        self.clones, groups = [], {}
        for i, x in enumerate(leaves):
            if not isinstance(x, torch.Tensor):
                continue
            ptr = x.untyped_storage().data_ptr()
            if ptr and ptr in forbidden:
                raise Unsafe("an output shares memory with an input, a parameter or a buffer")
            groups.setdefault(ptr or -1 - i, []).append(i)
        self.groups = []
        for members in groups.values():
            t = leaves[members[0]]
            if len(members) == 1 and t.is_contiguous() and t.storage_offset() == 0 and \
                    t.untyped_storage().nbytes() == t.numel() * t.element_size():
                self.clones.append((members[0], t))
            else:
                self.groups.append((t.untyped_storage(), [(i, leaves[i]) for i in members]))
        one = len(leaves) == 1 and (self.spec is None or self.spec.is_leaf()) and len(self.clones) == 1
        self.one = self.clones[0][1] if one else None

    def fresh(self):
        if self.one is not None:
            return [self.one.clone()] if self.spec is None else self.one.clone()
        vals = list(self.leaves)
        for i, t in self.clones:
            vals[i] = t.clone()
        for storage, members in self.groups:
            new = storage.clone()
            for i, t in members:
                vals[i] = torch.empty((0,), dtype=t.dtype, device=t.device).set_(
                    new, t.storage_offset(), t.shape, t.stride())
        return vals if self.spec is None else pytree.tree_unflatten(vals, self.spec)

    def tensors(self):
        return [x for x in self.leaves if isinstance(x, torch.Tensor)]


def pool_bytes(pool, device):
    """Bytes the allocator holds for the graph memory pool `pool` on device (its segments), or
    None where this torch's snapshot does not name pools."""
    try:
        segments = torch.cuda.memory_snapshot()
    except Exception:  # noqa: BLE001 - an allocator without snapshots: the caller measures otherwise
        return None
    want, index, total = tuple(pool), device.index, 0
    for s in segments:
        if "segment_pool_id" not in s:
            return None
        if tuple(s["segment_pool_id"]) == want and s.get("device", index) == index:
            total += s["total_size"]
    return total


def _mb(n) -> str:
    return f"{n / 2**20:.2f} MiB"


# ---------------------------------------------------------------------------- the runner

class _Entry:
    """One call signature: its warm-up count, its graph once captured, or why it is not graphed."""

    __slots__ = ("key", "label", "warm", "reason", "graph", "static_inputs", "outputs", "replays", "bound", "build")

    def __init__(self, key, label):
        self.key, self.label, self.warm, self.reason = key, label, 0, ""
        # bound: the steps the graph was captured from, kept as long as it is: their launches own
        # buffers the kernels write (statistics no one reads) at addresses the graph holds
        self.graph = self.static_inputs = self.outputs = self.bound = self.build = None
        self.replays = 0


class GraphRunner:
    """An OptimizedModule's calls through CUDA graphs where that is safe: it stands where the
    module's kbench._fast.Program stands (module._kbench_fast_program, or _kbench_fast_flat for a
    flattened call), and hands every call it does not replay to that Program (`inner`; None: the
    module's Python path). Per signature: WARMUP un-graphed calls, then a capture, then replays
    under the guards (docs/DESIGN.md, "CUDA graphs")."""

    def __init__(self, module, inner, option, capture=None):
        self.inner = inner
        self.option = option
        self.ninputs = len(module._kbench_captured.input_names)
        self.device = module._kbench_device
        self.cuda = self.device.type == "cuda"
        self.random = draws_random(module._kbench_captured.externs)
        self.capture = capture or capture_cuda_graph
        self.entries = {}
        self.skipped = {}          # reason -> calls not graphed for it
        self.logged = set()
        self.guard = None          # ParamGuard, built at the first need
        self.held = self.ptrs = self.indices = None   # the parameters every live graph read, their addresses
        self.drops = 0
        self.off = ""              # graphs were switched off for good: why
        self.pool = self.stream = None
        self.pool_bytes = 0        # the graph pool's bytes, measured after each capture
        self.captures = self.replays = 0
        self.lock = threading.Lock()
        self.last_raw = self.last_stream = self.raw_stream = None
        self.paused = False        # the model gate times the un-graphed call (paused())
        self.warmup = WARMUP
        # calls that want gradients: graphed too, unless asked for inference only (train_graphs.py)
        self.train = train_graphs.TrainGraphs(self) if option != "inference" else None

    # -- what kbench._fast.Program offers its module (OptimizedModule._bind, tests, tools)

    def add(self, *args):
        return self.inner.add(*args) if self.inner is not None else False

    def clear(self):
        if self.inner is not None:
            self.inner.clear()

    def __getattr__(self, name):   # the Program's counters (served, declined, why, entries)
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    # -- the call

    def call(self, module, inputs):
        """kbench._fast.Program.call's contract: the call's result, NotImplemented (the Python
        path runs it) or Fallback (eager runs it, with the reason)."""
        if _deferred:
            _destroy_deferred()
        state = module.__dict__.get("_kbench_state")
        if state is not None and state.failing() >= 0:
            return NotImplemented   # the Python path serves the state as it is now (a capture of its own)
        got, why = _NO, None
        if module._in_captured_mode() and not self.off and not self.paused:
            if self.lock.acquire(False):   # another thread replaying: this call runs un-graphed
                try:
                    got, why = self._try(module, inputs)
                finally:
                    self.lock.release()
        if got is not _NO:
            return got
        if why:
            self._skip(why)
        return self.inner.call(module, inputs) if self.inner is not None else NotImplemented

    def _try(self, module, inputs):
        """(the replay's result, None), or (_NO, why not or None) for the un-graphed path."""
        if not inputs:
            return _NO, "the call passes no tensor"
        if len(inputs) != self.ninputs:
            return _NO, f"the call passes {len(inputs)} tensor(s), the capture reads {self.ninputs}"
        for x in inputs:
            if type(x) is not torch.Tensor:
                return _NO, f"an input is a {type(x).__name__}, not a plain tensor"
        grad = torch.is_grad_enabled()
        live = None
        train = False
        if grad:
            live = self._live(module)
            if live is None:
                return _NO, "a parameter or buffer the capture read is gone from the module"
            train = any(x.requires_grad for x in inputs) or any(map(_requires_grad, live))
            if train and self.train is None:
                return _NO, WANTS_GRAD
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return _NO, "the call is inside a CUDA-graph capture of the caller's (captured un-graphed into it)"
        autocast = _autocast_state(self.cuda)
        for x in inputs:
            if not x.is_contiguous() or x.data_ptr() & 15:
                return _NO, "an input is not contiguous or not 16-byte aligned"
        sig = tuple([(x.shape, x.dtype, x.device) for x in inputs])
        if train:
            if self.held is not None and not same_tensors(live, self.held, self.ptrs, self.indices):
                self._drop("a parameter or buffer was replaced, moved or changed dtype since the capture")
                if self.off:
                    return _NO, None
            served, got = self.train.call(module, inputs, live, sig, autocast)
            return (got, None) if served else (_NO, got)
        key = (sig, grad, torch.is_inference_mode_enabled(), autocast)
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= MAX_ENTRIES:
                self.entries = {k: e for k, e in self.entries.items() if e.graph is not None}
            entry = self.entries[key] = _Entry(key, _label(key))
        if entry.graph is not None:
            if live is None:
                live = self._live(module)
            if live is not None and same_tensors(live, self.held, self.ptrs, self.indices):
                return self._replay(entry, inputs, live), None
            self._drop("a parameter or buffer was replaced, moved or changed dtype since the capture")
            if self.off:
                return _NO, None
        if entry.reason:
            return _NO, None
        if entry.warm < WARMUP or sig not in module._kbench_sigs:
            entry.warm += 1    # a signature kbench does not bind (eager runs it) never gets here
            return _NO, None
        if sum(e.graph is not None for e in self.entries.values()) >= MAX_GRAPHS:
            entry.reason = f"{MAX_GRAPHS} signatures are graphed already (each pins its outputs)"
            self._tell(entry.reason)
            return _NO, None
        return self._capture(module, entry, inputs, sig), None

    def _live(self, module):
        live = self.guard.live() if self.guard is not None else None
        if live is None:
            try:
                self.guard = ParamGuard(module)
            except (KeyError, AttributeError):
                return None
            live = self.guard.live()
        return live

    def _capture(self, module, entry, inputs, sig):
        device = inputs[0].device
        try:
            module._checked_params(device)   # as the un-graphed call checks them (it says why)
        except Fallback:
            entry.warm = 0
            return _NO
        live = self._live(module)
        if live is None:
            return _NO
        if self.held is not None and not same_tensors(live, self.held, self.ptrs):
            self._drop("a parameter or buffer was replaced, moved or changed dtype since the capture")
            if self.off:
                return _NO
        bound = module._kbench_sigs[sig]
        if bound.cache is not None:   # the graph reads the cached values where they are: fresh first
            bound.cache.take(live)
        static = [torch.empty_like(x) for x in inputs]
        forbidden = {t.untyped_storage().data_ptr() for t in [*static, *live] if isinstance(t, torch.Tensor)}
        if self.cuda and self.pool is None:
            self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
        before = self._reserved(device)
        graph = None
        try:
            # the graph's outputs, flat: their structure is built after each replay (_replay)
            graph, out = self.capture(_without_autocast_cache(lambda: module._run(bound, static, built=False,
                                                                                  cached="held")),
                                      self.pool, device, self.stream)
            outputs = Outputs(out, forbidden)
        except Unsafe as e:
            graph = None
            entry.reason = str(e)
            self._tell(f"{entry.label}: {entry.reason}")
            return _NO
        except Exception as e:  # noqa: BLE001 - this signature runs un-graphed, and the report says why
            graph = None
            entry.reason = capture_failed(e)
            if self.cuda:
                torch.cuda.synchronize(device)   # raises here if the failure broke the device itself
            self._tell(f"{entry.label}: {entry.reason}")
            return _NO
        entry.graph, entry.static_inputs, entry.outputs, entry.bound = graph, static, outputs, bound
        entry.build = functools.partial(module._kbench_captured.build_outputs, symvals=bound.symvals, fresh=True)
        self.note_capture(live)
        if self.cuda:
            got = pool_bytes(self.pool, device)
            self.pool_bytes = got if got is not None else self.pool_bytes + max(0, self._reserved(device) - before)
        return self._replay(entry, inputs, live)

    # -- what the training graphs (train_graphs.py) share with the rest

    def note_capture(self, live):
        """A capture read these parameters, buffers and constants: every graph reads the same ones,
        and a replay is guarded by their identity and addresses."""
        if self.held is None:
            self.held, self.ptrs = live, [t.data_ptr() if isinstance(t, torch.Tensor) else 0 for t in live]
            self.indices = list(range(len(live)))
        self.captures += 1

    def side_stream(self):
        """The stream captures run on (one per runner)."""
        if self.cuda and self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        return self.stream

    def moved(self) -> bool:
        """The tensors the graphs read are no longer the captured ones at the captured addresses."""
        live = self.guard.live() if self.guard is not None else None
        return live is None or self.held is None or not same_tensors(live, self.held, self.ptrs, self.indices)

    def _reserved(self, device):
        if not self.cuda:
            return 0
        torch.cuda.synchronize(device)
        return torch.cuda.memory_reserved(device)

    def _replay(self, entry, inputs, live):
        if self.cuda:
            self._order_streams()
        cache = entry.bound.cache
        if cache is not None:
            # the values computed from parameters alone are not in the graph: it reads them from
            # the cache's tensors, recomputed there (same addresses) where a parameter changed
            cache.take(live)
        for s, x in zip(entry.static_inputs, inputs):
            s.copy_(x)
        entry.graph.replay()
        entry.replays += 1
        self.replays += 1
        return entry.build(entry.outputs.fresh())

    def _order_streams(self):
        """Replays share the graphs' memory: one on another stream than the last waits for it
        (what torch's allocator does for the un-graphed call's buffers)."""
        if self.raw_stream is None:
            self.raw_stream = stream_getter(self.device)
        raw = self.raw_stream()
        if raw != self.last_raw:
            current = torch.cuda.current_stream(self.device)
            if self.last_stream is not None:
                done = torch.cuda.Event()
                done.record(self.last_stream)
                current.wait_event(done)
            self.last_raw, self.last_stream = raw, current

    # -- dropping graphs

    def _drop(self, why):
        """Every graph goes (they all read the same parameters); the next calls warm up again and
        are captured with the new ones, unless that keeps happening."""
        self.drops += 1
        self._free()
        if self.drops >= MAX_DROPS:
            self.off = f"the parameters changed under the graphs {self.drops} times (last: {why}); graphs are off"
            self._tell(self.off)
        else:
            self._tell(f"graphs dropped, to be captured again: {why}")

    def _free(self):
        if self.cuda and (any(e.graph is not None for e in self.entries.values()) or
                          (self.train is not None and self.train.graphed())):
            torch.cuda.synchronize(self.device)   # no replay in flight reads what is freed
        for e in self.entries.values():
            e.graph = e.static_inputs = e.outputs = e.bound = e.build = None
            e.warm = 0
        if self.train is not None:
            self.train.free()
        self.held = self.ptrs = None
        self.pool_bytes = 0
        self.last_raw = self.last_stream = None
        # the pool goes with its last graph (torch frees a private pool when no graph uses it):
        # the next capture gets a pool of its own
        self.pool = None

    def __del__(self):
        """Graphs go before the kernels they launch; collected inside a capture (the caller's
        torch.cuda.graph around code that drops a model), after it: destroying a graph there
        could invalidate that capture."""
        try:
            entries = list(self.__dict__.get("entries", {}).values())
            train = self.__dict__.get("train")
            entries += train.graphed() if train is not None else []
            if not any(_holds_graph(e) for e in entries):
                return
            if self.cuda and torch.cuda.is_current_stream_capturing():
                _deferred.append(entries)   # with their steps: the kernels stay loaded until then
                return
            for e in entries:
                _drop_graph(e)
        except Exception:  # noqa: BLE001 - never raise from a finalizer (interpreter exit)
            pass

    def release(self, why: str) -> None:
        """No more graphs for this module (the model gate runs the original instead); their memory
        goes back to torch's allocator."""
        self._free()
        self.entries.clear()
        self.pool = self.stream = None
        self.off = why

    # -- the report

    def _skip(self, why):
        self.skipped[why] = self.skipped.get(why, 0) + 1
        if why not in self.logged:
            self._tell(why)

    def _tell(self, why):
        if why not in self.logged:
            self.logged.add(why)
            if self.option is True:   # asked for: say once why a call runs without
                log.warning("kbench: CUDA graphs: %s", why)

    def pinned(self):
        """(graph pool bytes, static input bytes) held now, the training graphs' included."""
        static = sum(t.numel() * t.element_size() for e in self.entries.values() if e.static_inputs
                     for t in e.static_inputs)
        pool = self.pool_bytes
        if self.train is not None:
            static += self.train.static_bytes()
            pool += self.train.pool_bytes(lambda p: pool_bytes(p, self.device) if self.cuda else 0)
        return pool, static

    def describe(self) -> list:
        """The report's lines."""
        graphed = [e for e in self.entries.values() if e.graph is not None]
        trained = self.train.graphed() if self.train is not None else []
        if self.off and not graphed and not trained:
            lines = [f"CUDA graphs: off ({self.off})"]
        elif graphed or trained:
            pool, static = self.pinned()
            labels = [e.label for e in graphed] + [f"training {e.label}" for e in trained]
            lines = [f"CUDA graphs: on, {len(labels)} signature(s) graphed ({'; '.join(labels)}); "
                     f"pinned {_mb(pool + static)} (graph pools {_mb(pool)}, static inputs and gradients "
                     f"{_mb(static)}); {self.replays} replay(s)"]
        else:
            what = "with or without gradients" if self.train is not None else "without gradients"
            lines = [f"CUDA graphs: on (nothing graphed yet: a signature is captured at its call {WARMUP + 1} "
                     f"{what})"]
        if self.random:
            lines.append("CUDA graphs: the forward draws random numbers through torch's default CUDA generator, "
                         "which each replay advances")
        for e in self.entries.values():
            if e.reason:
                lines.append(f"CUDA graphs: {e.label} not graphed: {e.reason}")
        if self.train is not None:
            lines += self.train.describe()
        for why, n in self.skipped.items():
            lines.append(f"CUDA graphs: {n} call(s) not graphed: {why}")
        return lines


def _destroy_deferred():
    if torch.cuda.is_current_stream_capturing():
        return
    entries = [e for batch in _deferred for e in batch]
    _deferred.clear()
    for e in entries:    # each graph before the steps (and kernels) it launches
        _drop_graph(e)


def _holds_graph(e) -> bool:
    return (e.fwd if isinstance(e, train_graphs.TrainEntry) else e.graph) is not None


def _drop_graph(e) -> None:
    if isinstance(e, train_graphs.TrainEntry):
        e.drop_graphs()
    else:
        e.graph = None


def _label(key) -> str:
    sig, grad, inference, autocast = key
    shapes = ", ".join(f"{tuple(s)} {str(d).replace('torch.', '')}" for s, d, _ in sig)
    mode = "inference mode" if inference else "grad mode, nothing wants gradients" if grad else "no grad"
    if autocast is not None:
        mode += f", autocast {str(autocast[0]).replace('torch.', '')}"
    return f"[{shapes}] {mode}"


# ---------------------------------------------------------------------------- installing

def paused(module, runner):
    """module's call with its graphs paused (a callable): the un-graphed call, for the model gate
    to time against the graphed one. Paused calls do not count as a signature's warm-up."""
    def call(*args, **kwargs):
        runner.paused = True
        try:
            return module(*args, **kwargs)
        finally:
            runner.paused = False
    return call


def install(module, option) -> None:
    """Puts a GraphRunner where the module's fast program stands, where the option asks for graphs
    and the module is safe to graph; else records why not (module._kbench_graphs: a runner, or
    the reason as a string) and leaves the call path as it was."""
    option = check_option(option)
    if option is False:
        module.__dict__["_kbench_graphs"] = "cuda_graphs=False"
        return
    why = module_blockers(module)
    if why:
        module.__dict__["_kbench_graphs"] = "; ".join(why)
        if option is True:
            log.warning("kbench: CUDA graphs asked for, but the module runs without: %s", "; ".join(why))
        return
    slot = "_kbench_fast_program" if module._kbench_spec.plain else "_kbench_fast_flat"
    runner = GraphRunner(module, module.__dict__[slot], option)
    module.__dict__.update({"_kbench_graphs": runner, slot: runner})

