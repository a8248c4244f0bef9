"""CUDA graphs for training calls (a call that wants gradients) of an optimized module: per input
signature, the forward and its backward captured into two graphs over one memory pool of their own
and replayed through one autograd node (TrainStep), whose inputs are the call's tensors and the
parameters that want gradients. The five ways a graphed training step goes silently wrong
(docs/DESIGN.md, "Training graphs") each have their guard here: a forward replayed while an earlier
replay's backward is pending, a backward after a newer replay or with create_graph, gradients that
alias the graph's buffers, a capture before the backward programs exist, and the memory pinned."""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.utils._pytree as pytree

MAX_TRAIN_GRAPHS = 4   # training signatures graphed per module: each pins its saved activations
MAX_PATTERNS = 4       # backward graphs per signature, one per set of outputs given a gradient

PENDING = "a graphed forward's backward is still pending (two forwards before one backward run un-graphed)"


class Unsafe(Exception):
    """A capture found something that makes this signature unsafe to replay (the message says what)."""


def capture_failed(e) -> str:
    """The report's reason for a capture that raised e."""
    return f"capture failed ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]})"


def blockers(live) -> str:
    """Why no training call of a module with these parameters, buffers and constants can be graphed;
    "" where one can be (each call still passes the per-call checks)."""
    for t in live:
        if not isinstance(t, torch.Tensor):
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            return f"a parameter is a {type(t).__name__} (a tensor subclass: FSDP's or another wrapper's)"
        if t.requires_grad and not t.is_leaf:
            return "a parameter that wants gradients is computed in the forward (not a leaf)"
        if t.requires_grad and getattr(t, "_backward_hooks", None):
            # a captured backward would apply the hook, and the real one again on the gradient
            return "a parameter has a gradient hook (Tensor.register_hook)"
    return ""


def wanting(live) -> list:
    """The parameters among live that want gradients, each once (a tied weight is read twice)."""
    out, seen = [], set()
    for t in live:
        if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


class _Backward:
    """One captured backward: for the outputs given a gradient (the pattern), the graph, the static
    upstream gradients it reads and the gradients it writes (None: autograd gives none)."""

    __slots__ = ("graph", "upstream", "results")

    def __init__(self, graph, upstream, results):
        self.graph, self.upstream, self.results = graph, upstream, results


class _Token:
    """Lives as long as a replayed forward's autograd node: while it does and its backward has not
    run, the graph's activations are that forward's."""

    __slots__ = ("__weakref__",)


class TrainEntry:
    """One training signature: its warm-up count, its forward graph once captured, its backward
    graphs, the replay generation and the pending forward; or why it is not graphed."""

    def __init__(self, key, label):
        self.key, self.label, self.warm, self.reason = key, label, 0, ""
        self.fwd = None            # the forward's graph
        self.pool = None
        self.static_inputs = None  # the call's inputs as the graph reads them
        self.leaves = None   # the graph's outputs as captured (static; the model's structure is built per replay)
        self.diff = []             # positions of the leaves autograd differentiates
        self.tensor_at = []        # positions of the tensor leaves (TrainStep's outputs)
        self.wrt = []              # static inputs and parameters that want gradients, in TrainStep's order
        self.input_wrt = []        # per call input: its position in wrt, or None
        self.backward = {}         # pattern (a bool per differentiable leaf) -> _Backward or a reason
        self.wanted = set()        # patterns a backward met without a graph: captured at the next call
        self.bound = None          # the steps the graph was captured from (their launches own buffers)
        self.gen = 0               # forward replays so far: a backward of an older one recomputes
        self.pending = None        # weakref to the last replay's _Token until its backward runs
        self.replays = self.backward_replays = 0
        self.autocast = None

    def drop_graphs(self):
        """The graphs go (before the kernels they launch); the rest with the entry."""
        self.fwd = None
        self.backward = {}

    def outputs(self):
        """The captured outputs as a replay leaves them. A stand-in graph (the CPU tests') has no
        memory to rewrite and hands its replay's outputs as `.outputs`."""
        fresh = getattr(self.fwd, "outputs", None)
        return pytree.tree_leaves(fresh) if fresh is not None else self.leaves


class TrainStep(torch.autograd.Function):
    """A graphed training call as one autograd node: forward replays the forward graph; backward
    replays the backward graph for the outputs given gradients (or, where the graph's activations
    are no longer this forward's or the gradients must be differentiable, recomputes)."""

    @staticmethod
    def forward(ctx, run, *args):
        ctx.set_materialize_grads(False)
        return run.forward(ctx, args)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *ctx.run.backward(ctx, grads))


class TrainGraphs:
    """The training half of a GraphRunner: its entries and their capture, replay and backward."""

    def __init__(self, runner):
        self.runner = runner
        self.entries = {}

    # -- the call

    def call(self, module, inputs, live, sig, autocast):
        """(True, the replay's result), or (False, why not or None): the un-graphed path runs it."""
        runner = self.runner
        key = (sig, tuple(x.requires_grad for x in inputs), tuple(t.requires_grad for t in live), autocast)
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= 4 * MAX_TRAIN_GRAPHS:
                self.entries = {k: e for k, e in self.entries.items() if e.fwd is not None}
            entry = self.entries[key] = TrainEntry(key, _label(sig, key[1], autocast))
            entry.autocast = autocast
        if entry.reason:
            return False, None
        if entry.fwd is not None:
            token = entry.pending() if entry.pending is not None else None
            if token is not None:
                return False, PENDING
            for pattern in entry.wanted:   # met in a backward, captured here (a capture cannot run in one)
                if pattern not in entry.backward and len(entry.backward) < MAX_PATTERNS:
                    self.capture_backward(entry, pattern, inputs[0].device)
            entry.wanted = set()
            return True, self.replay(module, entry, inputs, live)
        if entry.warm < runner.warmup or sig not in module._kbench_sigs:
            entry.warm += 1
            return False, None
        if sum(e.fwd is not None for e in self.entries.values()) >= MAX_TRAIN_GRAPHS:
            entry.reason = f"{MAX_TRAIN_GRAPHS} training signatures are graphed already (each pins its activations)"
            runner._tell(entry.reason)
            return False, None
        why = blockers(live)
        if why:
            entry.reason = why
            runner._tell(f"{entry.label}: {why}")
            return False, None
        try:
            self.capture(module, entry, inputs, live, sig)
        except Exception as e:  # noqa: BLE001 - this signature trains un-graphed, and the report says why
            self._forget(entry)
            entry.reason = e.args[0] if isinstance(e, Unsafe) else capture_failed(e)
            if runner.cuda:
                torch.cuda.synchronize(runner.device)   # raises here if the failure broke the device itself
            runner._tell(f"{entry.label}: {entry.reason}")
            return False, None
        return True, self.replay(module, entry, inputs, live)

    # -- capture

    def capture(self, module, entry, inputs, live, sig):
        """The forward graph (grad mode, static inputs that want gradients as the call's do), then the
        backward graph for every differentiable output given a gradient; both run nothing."""
        runner = self.runner
        device = inputs[0].device
        checked = module._checked_params(device)
        bound = module._kbench_sigs[sig]
        static = [torch.empty_like(x).requires_grad_(x.requires_grad) for x in inputs]
        # The graph differentiates aliases of the parameters (the same memory, new leaves): a
        # parameter's own AccumulateGrad node, kept alive by an autocast cache or DDP since the
        # warm-up, lives on the caller's stream, and a capture cannot wait on that stream. Every
        # tensor the graph reads is a `.data` alias, with a version counter of its own: a tracked
        # write between steps (an optimizer's step, the model gate putting BatchNorm's statistics
        # back, a user's `buf.copy_`) would otherwise fail every later backward capture's version
        # check on the retained autograd graph.
        alias = {id(p): p.data.requires_grad_() for p in wanting(live)}
        params = [alias[id(p)] for p in wanting(live)]
        reads = [(alias[id(t)] if id(t) in alias else t.data) if isinstance(t, torch.Tensor) else t for t in checked]
        entry.pool = torch.cuda.graph_pool_handle() if runner.cuda else None
        stream = runner.side_stream()
        graph, out = runner.capture(_autocast_run(entry.autocast, lambda: module._run(bound, static, reads, built=False)),
                                    entry.pool, device, stream)
        leaves = list(out)   # the graph's outputs, flat (_run(built=False))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        seen, forbidden = set(), {t.untyped_storage().data_ptr() for t in [*static, *live]
                                  if isinstance(t, torch.Tensor)}
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr in forbidden:
                raise Unsafe("an output shares memory with an input, a parameter or a buffer")
            if ptr in seen:
                raise Unsafe("two outputs share memory (views of one tensor)")
            seen.add(ptr)
        entry.fwd, entry.static_inputs, entry.leaves, entry.bound = graph, static, leaves, bound
        entry.diff = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
        entry.tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        if not entry.diff:
            raise Unsafe("no output wants a gradient")
        entry.wrt = [s for s in static if s.requires_grad] + params
        k = iter(range(len(entry.wrt)))
        entry.input_wrt = [next(k) if s.requires_grad else None for s in static]
        every = tuple(True for _ in entry.diff)
        self.capture_backward(entry, every, device)
        if isinstance(entry.backward[every], str):
            raise Unsafe(f"its backward: {entry.backward[every]}")
        runner.note_capture(live)

    def capture_backward(self, entry, pattern, device):
        """The backward graph for the differentiable outputs flagged in pattern (kept in
        entry.backward, or the reason it failed). Retains the forward's autograd graph: its saved
        activations stay where they are, so no backward overwrites them (a second backward with
        retain_graph=True reads them again) and a later pattern can still be captured."""
        runner = self.runner
        def roots():
            leaves = entry.outputs()
            return [leaves[i] for i, on in zip(entry.diff, pattern) if on]
        upstream = [torch.zeros_like(t) for t in roots()]

        def run():
            return torch.autograd.grad(roots(), entry.wrt, upstream, retain_graph=True, allow_unused=True)
        try:
            graph, results = runner.capture(run, entry.pool, device, runner.side_stream())
        except Exception as e:  # noqa: BLE001 - this pattern runs un-graphed on the captured graph
            entry.backward[pattern] = capture_failed(e)
            if runner.cuda:
                torch.cuda.synchronize(runner.device)
            return
        # an input no output given a gradient reaches gets None from torch.autograd.grad, as from
        # the un-graphed backward: one graph per pattern keeps that
        entry.backward[pattern] = _Backward(graph, upstream, list(results))

    # -- replay

    def replay(self, module, entry, inputs, live):
        run = _Run(self, module, entry)
        params = wanting(live)
        got = TrainStep.apply(run, *inputs, *params)
        vals, k = list(entry.leaves), iter(got)
        for i, x in enumerate(entry.leaves):
            if isinstance(x, torch.Tensor):
                vals[i] = next(k)
        # the graph's outputs, flat (captured so): the model's structure is built here, outside it
        return module._kbench_captured.build_outputs(vals, entry.bound.symvals, fresh=True)   # clones, TrainStep's

    # -- memory and the report

    def _forget(self, entry):
        entry.fwd = entry.static_inputs = entry.leaves = entry.bound = entry.pool = None
        entry.wrt, entry.backward, entry.pending, entry.wanted = [], {}, None, set()

    def free(self):
        for e in self.entries.values():
            self._forget(e)
            e.warm = 0

    def graphed(self):
        return [e for e in self.entries.values() if e.fwd is not None]

    def pool_bytes(self, measure):
        return sum(measure(e.pool) or 0 for e in self.graphed() if e.pool is not None)

    def static_bytes(self):
        total = 0
        for e in self.graphed():
            tensors = list(e.static_inputs)
            for b in e.backward.values():
                if isinstance(b, _Backward):
                    tensors += b.upstream
            total += sum(t.numel() * t.element_size() for t in tensors)
        return total

    def describe(self) -> list:
        lines = []
        for e in self.graphed():
            bw = sum(isinstance(b, _Backward) for b in e.backward.values())
            lines.append(f"CUDA graphs: training {e.label}: graphed (forward + {bw} backward graph(s)); "
                         f"{e.replays} replay(s), {e.backward_replays} backward replay(s)")
            for pattern, b in e.backward.items():
                if isinstance(b, str):
                    lines.append(f"CUDA graphs: training {e.label}: the backward for outputs "
                                 f"{[i for i, on in zip(e.diff, pattern) if on]} runs un-graphed: {b}")
        for e in self.entries.values():
            if e.reason:
                lines.append(f"CUDA graphs: training {e.label} not graphed: {e.reason}")
        return lines


def fresh_copies(tensors) -> list:
    """Copies of the backward graph's gradients (None stays None): a later replay rewrites the graph's,
    and AccumulateGrad may keep what it gets. One allocation per dtype and device, the copies views
    of it (as DDP's gradient-as-bucket-view), written by one multi-tensor copy: a clone per
    parameter was a launch and an allocation each, 148 for GPT-2."""
    out = [None] * len(tensors)
    groups = {}
    for i, g in enumerate(tensors):
        if g is not None:
            groups.setdefault((g.dtype, g.device), []).append(i)
    for (dtype, device), idx in groups.items():
        dense = [i for i in idx if tensors[i].is_contiguous()]
        # each view starts 64 bytes aligned: the optimizers' vectorized kernels want it
        align = max(1, 64 // tensors[idx[0]].element_size())
        starts, at = {}, 0
        for i in dense:
            starts[i] = at
            at += -(-tensors[i].numel() // align) * align
        flat = torch.empty(at, dtype=dtype, device=device) if dense else None
        for i in idx:
            g = tensors[i]
            out[i] = flat[starts[i]:starts[i] + g.numel()].view(g.shape) if i in starts else torch.empty_like(g)
        torch._foreach_copy_([out[i] for i in idx], [tensors[i] for i in idx])
    return out


class _Run:
    """One graphed training call: what TrainStep's forward and backward need (the autograd node
    holds it as ctx.run)."""

    __slots__ = ("graphs", "module", "entry", "gen", "token", "args", "versions", "rng", "ninputs",
                 "diff", "tensor_at", "input_wrt", "nwrt")

    def __init__(self, graphs, module, entry):
        self.graphs, self.module, self.entry = graphs, module, entry
        self.ninputs = len(entry.static_inputs)
        # the layout, kept: the entry's may be dropped (new parameters) before this backward runs
        self.diff, self.tensor_at, self.input_wrt, self.nwrt = entry.diff, entry.tensor_at, entry.input_wrt, \
            len(entry.wrt)

    def forward(self, ctx, args):
        ctx.run = self
        entry, runner = self.entry, self.graphs.runner
        # checked at the backward: a tensor changed in place in between (eager raises for most)
        self.args, self.versions = args, [a._version for a in args]
        if runner.cuda:
            runner._order_streams()
        for s, x in zip(entry.static_inputs, args):
            s.data.copy_(x)   # untracked: the retained autograd graph saved these at their capture version
        # the state a recomputation must draw the same random numbers from
        self.rng = torch.cuda.get_rng_state(runner.device) if runner.random and runner.cuda else None
        entry.fwd.replay()
        entry.gen += 1
        entry.replays += 1
        runner.replays += 1
        self.gen = entry.gen
        self.token = _Token()
        entry.pending = weakref.ref(self.token)
        outs, nondiff = [], []
        for i, x in enumerate(entry.outputs()):
            if isinstance(x, torch.Tensor):
                y = x.detach().clone()
                outs.append(y)
                if not x.requires_grad:
                    nondiff.append(y)
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        return tuple(outs)

    def backward(self, ctx, grads):
        entry, runner = self.entry, self.graphs.runner
        for a, v in zip(self.args, self.versions):
            if a._version != v:
                raise RuntimeError(
                    "kbench: a tensor of a CUDA-graphed training call (an input or a parameter) was changed in "
                    "place between its forward and its backward; eager PyTorch raises for most such changes and "
                    "kbench cannot give eager's gradient. Call backward before the update, or optimize(..., "
                    "cuda_graphs='inference')")
        # the gradients of the tensor outputs, in order, then those of the differentiable leaves
        by_leaf = dict(zip(self.tensor_at, grads))
        upstream = [by_leaf[i] for i in self.diff]
        with runner.lock:
            got = None
            if not torch.is_grad_enabled() and self.gen == entry.gen and entry.fwd is not None:
                got = self.replay_backward(upstream)
            if got is None:
                got = self.recompute(upstream)
            if self.gen == entry.gen:
                entry.pending = None
        return self.to_inputs(got)

    def to_inputs(self, got):
        """Per TrainStep input (the call's tensors, then the parameters that want gradients): its
        gradient, from the gradients of entry.wrt."""
        out = [got[j] if j is not None else None for j in self.input_wrt]
        nin = sum(j is not None for j in self.input_wrt)
        out += list(got[nin:])
        return tuple(out)

    def replay_backward(self, upstream):
        """The backward graph's gradients for this pattern of upstream gradients, or None where
        there is none to replay (the caller recomputes)."""
        entry, runner = self.entry, self.graphs.runner
        pattern = tuple(g is not None for g in upstream)
        if not any(pattern):
            return [None] * self.nwrt
        if runner.moved():
            return None   # the parameters' memory moved since the capture (FSDP's regather)
        bw = entry.backward.get(pattern)
        if bw is None:
            entry.wanted.add(pattern)
        if not isinstance(bw, _Backward):
            return None
        if runner.cuda:
            runner._order_streams()
        for s, g in zip(bw.upstream, [g for g in upstream if g is not None]):
            s.copy_(g)
        bw.graph.replay()
        entry.backward_replays += 1
        return fresh_copies(bw.results)

    def recompute(self, upstream):
        """The backward of a forward whose activations the graph no longer holds (a newer replay ran,
        or the graphs were dropped), whose gradients must be differentiable (create_graph=True), or
        with no backward graph for its pattern of upstream gradients (captured at the next call):
        the forward again, un-graphed, from this call's own tensors, drawing the random numbers its
        replay drew, with the buffers it updates put back after; then torch.autograd."""
        module, entry = self.module, self.entry
        if module.training != module._kbench_captured_training:
            raise RuntimeError("kbench: this backward must recompute its CUDA-graphed forward (a newer call "
                               "replayed the graph, or create_graph=True), but the module has since switched "
                               "train/eval mode; call backward before switching")
        inputs, params = self.args[:self.ninputs], self.args[self.ninputs:]
        wrt = [x for x in inputs if x.requires_grad] + list(params)
        buffers = [(b, b.detach().clone()) for b in module._kbench_orig.buffers()]
        device = self.graphs.runner.device
        fork = torch.random.fork_rng(devices=[device]) if self.rng is not None else contextlib.nullcontext()
        try:
            with fork, torch.enable_grad():
                if self.rng is not None:
                    torch.cuda.set_rng_state(self.rng, device)
                bound = module._kbench_sigs.get(entry.key[0])
                if bound is None:
                    raise RuntimeError("kbench: the signature this backward must recompute is gone")
                out = _autocast_run(entry.autocast, lambda: module._run(bound, list(inputs), built=False))()
        finally:
            # through .data: the recomputed autograd graph saved some of these (BERT's position ids)
            # at their version, which a tracked write would bump
            for b, saved in buffers:
                b.data.copy_(saved)
        roots = [out[i] for i, g in zip(self.diff, upstream) if g is not None]   # out: the graph's outputs, flat
        if not roots:
            return [None] * self.nwrt
        return list(torch.autograd.grad(roots, wrt, [g for g in upstream if g is not None], allow_unused=True,
                                        create_graph=torch.is_grad_enabled()))


def _autocast_run(autocast, fn):
    """fn, run under the autocast the signature was captured in (a recomputation runs at backward
    time, outside the caller's autocast region), with the weight cache off as every capture is."""
    def run():
        ctx = torch.autocast("cuda", dtype=autocast[0]) if autocast is not None else contextlib.nullcontext()
        was = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
        try:
            with ctx:
                return fn()
        finally:
            torch.set_autocast_cache_enabled(was)
    return run


def _label(sig, wants, autocast) -> str:
    shapes = ", ".join(f"{tuple(s)} {str(d).replace('torch.', '')}{' (grad)' if w else ''}"
                       for (s, d, _), w in zip(sig, wants))
    mode = f", autocast {str(autocast[0]).replace('torch.', '')}" if autocast is not None else ""
    return f"[{shapes}]{mode}"
