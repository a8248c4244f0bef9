"""nn.Module + example inputs -> torch.export (non-strict) -> kbench's IR. Validates the inputs,
exports with every user-input dim dynamic (Dim.AUTO), fixes at their example sizes the input dims
behind any size the IR cannot write (s0 - 1, s0 // 2) and re-exports; the ATen -> IR lowering
itself is lower.py (the driver) and ops.py (the op table); what eager raises for the inputs'
dtypes is raised here too (eager_rules.py). The result is a types.Captured."""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import inspect
import io
import logging
import operator
import sys
import warnings
from typing import Any, Optional

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ..dtypes import TORCH_TO_IR
from ..errors import CaptureError
from . import eager_rules
from . import guards as state_guards
from . import lower as lowering
from .types import Captured

_log = logging.getLogger("kbench.capture")

# ---------------------------------------------------------------------------- validation


def validate(model, example_inputs):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(example_inputs, torch.Tensor):
        inputs = (example_inputs,)
    elif isinstance(example_inputs, (tuple, list)):
        inputs = tuple(example_inputs)
    else:
        raise TypeError("example_inputs must be a tensor or a tuple/list of tensors, got "
                        f"{type(example_inputs).__name__}")
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"example_inputs[{i}] must be a tensor, got {type(t).__name__}")
        if t.is_complex():
            raise TypeError(f"example_inputs[{i}] has complex dtype {t.dtype}; kbench supports "
                            "real floating, int32/int64 and bool inputs")
        if t.dtype not in TORCH_TO_IR:
            raise TypeError(f"example_inputs[{i}] has dtype {t.dtype}; kbench supports "
                            + ", ".join(str(d) for d in TORCH_TO_IR))
        if t.layout != torch.strided:
            raise TypeError(f"example_inputs[{i}] has layout {t.layout}; only dense tensors")
    devices = {t.device for t in inputs}
    if len(devices) > 1:
        raise ValueError("example_inputs are on several devices: "
                         + ", ".join(sorted(str(d) for d in devices)))
    state = [t.device for t in _model_tensors(model)]
    if inputs and state and any(d != inputs[0].device for d in state):
        other = next(d for d in state if d != inputs[0].device)
        raise ValueError(f"example_inputs are on {inputs[0].device} but the model has tensors "
                         f"on {other}")
    try:
        inspect.signature(model.forward).bind(*inputs)
    except TypeError as e:
        raise TypeError(f"example_inputs do not fit {type(model).__name__}.forward: {e}") from None
    return inputs


def _model_tensors(model):
    yield from model.parameters()
    yield from model.buffers()


# ---------------------------------------------------------------------------- export

@contextlib.contextmanager
def _model_untouched(model):
    """Export must leave no trace: requires_grad is put back, and so is every module attribute the
    forward binds while export runs it (the train/eval flag, an RNN's `self.hidden = ...`, a cache
    made on the first call): export's forward computes fake tensors, and one left on the model
    breaks the eager call that follows a failed capture."""
    grads = [(p, p.requires_grad) for p in model.parameters()]
    bound = [(m, dict(vars(m)), dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in model.modules()]
    try:
        yield
    finally:
        for p, rg in grads:
            p.requires_grad_(rg)
        for m, attrs, params, buffers, modules in bound:
            _rebind(vars(m), attrs)
            for store, was in ((m._parameters, params), (m._buffers, buffers), (m._modules, modules)):
                _rebind(store, was)


def _rebind(now: dict, was: dict) -> None:
    """now's entries bound to what was holds again (the same objects), those added dropped."""
    for k in [k for k in now if k not in was]:
        del now[k]
    for k, v in was.items():
        if k not in now or now[k] is not v:
            now[k] = v


@contextlib.contextmanager
def _inputs_unmarked(inputs):
    """torch.export with Dim.AUTO marks the example tensors themselves (`_dynamo_weak_dynamic_indices`
    and its kin) and leaves the marks when it fails: the static export tried next then reads the
    tensors as dynamic and fails the same way, and a later torch.compile of the user's tensors
    would see them. Each export starts from the tensors as the user gave them and leaves them so."""
    tensors = [t for t in torch.utils._pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    saved = [{a: getattr(t, a) for a in _DYNAMO_MARKS if hasattr(t, a)} for t in tensors]
    try:
        yield
    finally:
        for t, had in zip(tensors, saved):
            for a in _DYNAMO_MARKS:
                if a in had:
                    setattr(t, a, had[a])
                elif hasattr(t, a):
                    delattr(t, a)


_DYNAMO_MARKS = ("_dynamo_dynamic_indices", "_dynamo_dynamic_range", "_dynamo_static_indices",
                 "_dynamo_unbacked_indices", "_dynamo_weak_dynamic_indices", "_dynamo_shape_ids",
                 "_dynamo_strict_unbacked_indices", "_has_dynamo_dim_marking")


@contextlib.contextmanager
def _gc_paused():
    """No cyclic garbage collection while capturing: torch.export allocates hundreds of thousands
    of objects, and the full collections that triggers walk all of them (about a quarter of a
    second each, ~0.8 s of a 12-block transformer's capture). Everything is collected as usual
    afterwards; reference counting frees most of it at once."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _first_line(e: BaseException) -> str:
    for line in str(e).splitlines():
        if line.strip():
            return f"{type(e).__name__}: {line.strip()}"
    return type(e).__name__


def _export(model, inputs, dynamic: bool, fixed=frozenset()):
    """Returns (ExportedProgram, static_reason); `fixed` lists user-input dims (input, dim) to
    keep at their example size."""
    reason = None
    if dynamic:
        auto = getattr(getattr(torch.export, "Dim", None), "AUTO", None)
        if auto is None:
            reason = f"torch {torch.__version__} has no Dim.AUTO (needs >= 2.6)"
        else:
            shapes = _dynamic_spec(model, inputs, auto, fixed)
            try:
                return _export_once(model, inputs, shapes), None
            except Exception as e:  # noqa: BLE001 - any failure: try the static export
                reason = f"dynamic export failed ({_first_line(e)})"
    else:
        reason = "dynamic=False"
    return _export_once(model, inputs, None), reason


def _dynamic_spec(model, inputs, auto, fixed):
    """Every dim of every user input Dim.AUTO (but the fixed ones), keyed by forward's
    parameter names (so that forward(self, *xs) works too)."""
    pos = iter(range(len(inputs)))
    static = getattr(torch.export.Dim, "STATIC", None)

    def one(t):
        i = next(pos)
        return tuple(static if (i, d) in fixed else auto for d in range(t.dim())) if t.dim() else None

    sig = inspect.signature(model.forward)
    spec = {}
    for name, val in sig.bind(*inputs).arguments.items():
        if sig.parameters[name].kind == inspect.Parameter.VAR_POSITIONAL:
            spec[name] = tuple(one(t) for t in val)
        else:
            spec[name] = one(val)
    return spec


@contextlib.contextmanager
def _quiet_export():
    """An export that fails on a data-dependent branch has torch log a warning and print the
    partial graph to stderr (torch/export/_trace.py); the failure reaches the user as one line
    (CaptureError), and the graph goes to kbench's debug log. What an export that succeeds
    prints is passed on. A fake kernel that raises (an op eager rejects for its dtypes or an empty
    dim) has torch's fake tensors log the whole traceback at ERROR level: the exception itself
    reaches the user."""
    loggers = [(logging.getLogger(name), lvl) for name, lvl in (("torch.fx.experimental.symbolic_shapes", logging.ERROR),
                                                                ("torch._subclasses.fake_tensor", logging.CRITICAL))]
    levels = [logger.level for logger, _ in loggers]
    for logger, lvl in loggers:
        logger.setLevel(lvl)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            yield
    except BaseException:
        if printed.getvalue():
            _log.debug("torch.export printed:\n%s", printed.getvalue())
        raise
    else:
        sys.stderr.write(printed.getvalue())
    finally:
        for (logger, _), level in zip(loggers, levels):
            logger.setLevel(level)


def _register_output_types(model) -> None:
    """Output types torch.export cannot flatten until told how: Hugging Face's KV caches (a
    decoder returns its DynamicCache with use_cache=True), registered with torch's pytree by
    transformers' own export support where the model comes from transformers."""
    if not any(type(m).__module__.startswith("transformers.") for m in model.modules()):
        return
    try:
        from transformers.integrations.executorch import register_dynamic_cache_export_support
        register_dynamic_cache_export_support()
        _register_encoder_decoder_cache()
    except Exception as e:  # noqa: BLE001 - an older transformers: export says what it cannot flatten
        _log.debug("kbench: transformers' cache types not registered for export: %s", e)


def _register_encoder_decoder_cache() -> None:
    """An encoder-decoder's cache (T5, BART with use_cache=True): its two DynamicCaches, which
    transformers registers, as children. The is_updated flags start afresh when rebuilt, as they
    do in the cache a new forward makes."""
    import torch.fx._pytree as fx_pytree
    import torch.utils._pytree as pytree
    from transformers.cache_utils import EncoderDecoderCache
    if EncoderDecoderCache in pytree.SUPPORTED_NODES:
        return

    def flatten(cache):
        return [cache.self_attention_cache, cache.cross_attention_cache], None

    pytree.register_pytree_node(
        EncoderDecoderCache, flatten, lambda children, _: EncoderDecoderCache(*children),
        serialized_type_name=f"{EncoderDecoderCache.__module__}.{EncoderDecoderCache.__name__}",
        flatten_with_keys_fn=lambda cache: ([(pytree.GetAttrKey(k), getattr(cache, k))
                                             for k in ("self_attention_cache", "cross_attention_cache")], None))
    fx_pytree.register_pytree_flatten_spec(EncoderDecoderCache, lambda cache, spec: flatten(cache)[0])


def _export_once(model, inputs, shapes):
    """torch.export's graph, functional: in-place ops on intermediate values are rewritten to
    their functional forms; a real mutation (a buffer, an input, a view, BatchNorm running
    statistics) makes torch functionalize the graph with run_decompositions({}) instead (the
    empty table keeps the composite ops whole)."""
    _register_output_types(model)
    with warnings.catch_warnings(), _quiet_export(), _inputs_unmarked(inputs):
        warnings.simplefilter("ignore")
        ep = torch.export.export(model, inputs, strict=False, dynamic_shapes=shapes)
        writes = _input_writes(ep)
        _inline_context_blocks(ep)
        if _make_functional(ep):
            ep.graph_module.meta[lowering.INPUT_WRITES] = writes
            return ep
        before = {n.name: (n.target, _shape_key(n)) for n in ep.graph.nodes}
        ep = ep.run_decompositions({})
    _refresh_metas(ep, before)
    ep.graph_module.meta[lowering.INPUT_WRITES] = writes
    return ep


def _shape_key(n):
    v = n.meta.get("val")
    vs = v if isinstance(v, (list, tuple)) else [v]
    return tuple(tuple(str(s) for s in t.shape) if isinstance(t, torch.Tensor) else None for t in vs)


def _refresh_metas(ep, before):
    """run_decompositions can leave wrong shapes on the composite ops it keeps (torch 2.13:
    cross_entropy_loss / nll_loss with reduction='none' and varying sizes get shape []), and
    the lowering trusts node.meta['val']: when a node's shape differs from the one it had
    before, propagate the fake tensors through the graph again. That must not fix any varying
    size (torch 2.11's matmul meta does): then the export fails and capture goes static."""
    if all(before.get(n.name, (None,))[0] != n.target or before[n.name][1] == _shape_key(n)
           for n in ep.graph.nodes):
        return
    phs = [n for n in ep.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in phs]
    mode = next((getattr(v, "fake_mode", None) for v in vals if isinstance(v, torch.Tensor)), None)
    if mode is None:
        return
    keys = [_shape_key(n) for n in phs]
    FakeTensorProp(ep.graph_module, mode).propagate_dont_convert_inputs(*vals)
    if keys != [_shape_key(n) for n in phs]:
        raise RuntimeError("re-propagating shapes after functionalization fixed varying sizes")


# ---------------------------------------------------------------------------- in-place ops

_STATEFUL = {"batch_norm", "native_batch_norm", "_native_batch_norm_legit", "cudnn_batch_norm",
             "instance_norm", "_batch_norm_with_update", "_batch_norm_impl_index"}


def _is_view(n):
    t = n.target
    if t is operator.getitem:
        return isinstance(n.args[0], fx.Node) and _is_view(n.args[0])
    if not isinstance(t, torch._ops.OpOverload):
        return False
    rets = t._schema.returns
    return bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write


def _input_writes(ep) -> dict:
    """{user input name: (how many in-place ops write it, whether the first writes a view of it)},
    read from export's graph as traced, before functionalization folds them into one update: eager
    moves an input's version counter once per in-place op, and names a view in its error for a
    leaf that requires grad. Writes inside a torch.no_grad() block (its own submodule) are not
    counted: eager checks nothing there, and its update carries no gradient."""
    users = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    writes = {}
    for n in ep.graph.nodes:
        t = n.target
        if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or not t._schema.is_mutable:
            continue
        for k, a in enumerate(t._schema.arguments):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            x, via_view = n.args[k] if k < len(n.args) else n.kwargs.get(a.name), False
            while isinstance(x, fx.Node) and (_is_view(x) or _is_inplace(x)):
                via_view |= _is_view(x)
                x = x.args[0]
            if isinstance(x, fx.Node) and x.op == "placeholder" and x.name in users:
                count, first = writes.get(x.name, (0, via_view))
                writes[x.name] = (count + 1, first)
    return writes


def _is_inplace(n):
    """An in-place op's result: the tensor it wrote (x.mul_(2).add_(1) writes x twice)."""
    t = n.target
    if not isinstance(t, torch._ops.OpOverload):
        return False
    rets = t._schema.returns
    return bool(rets) and rets[0].alias_info is not None and rets[0].alias_info.is_write


def _inline_context_blocks(ep):
    """Context managers inside a forward export as higher-order blocks: `with torch.no_grad():`
    (Hugging Face's rotary embeddings) as wrap_with_set_grad_enabled, `with torch.autocast(...):`
    (the same embeddings computed in float32 under an outer autocast) as wrap_with_autocast.
    Their bodies are inlined here. Each value leaving a no-grad block is detached — a
    stop-gradient kbench's backward honours — so the gradients stay eager's. Each node of an
    autocast block is marked with the block's mode (meta "kbench_autocast"), and the torch calls
    made from it run in that mode (capture/types.py, Extern.autocast); kbench's own kernels
    carry the dtypes export recorded. (run_decompositions would inline both but drop the modes,
    and fails on such blocks in a training graph.)"""
    grad_hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    autocast_hop = getattr(torch.ops.higher_order, "wrap_with_autocast", None)
    hops = {h for h in (grad_hop, autocast_hop) if h is not None}
    if not hops:
        return
    gm, graph = ep.graph_module, ep.graph
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in hops]:
        outer = node.meta.get("kbench_autocast")   # a block nested in an autocast block
        if node.target is autocast_hop:
            device_type, dtype, enabled, cache, sub_node, *operands = node.args
            mode, grad_enabled = (device_type, dtype, bool(enabled), bool(cache)), True
        else:
            grad_enabled, sub_node, *operands = node.args
            mode = outer
        sub = getattr(gm, sub_node.target)
        env = dict(zip([p for p in sub.graph.nodes if p.op == "placeholder"], operands))
        results = None
        with graph.inserting_before(node):
            for inner in sub.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    results = [env[r] if isinstance(r, fx.Node) else r for r in inner.args[0]]
                    break
                if inner.op == "get_attr":   # a nested block's submodule: moved to the top
                    name = f"{sub_node.target}_{inner.target}"
                    setattr(gm, name, getattr(sub, inner.target))
                    env[inner] = graph.get_attr(name)
                    continue
                copy = env[inner] = graph.node_copy(inner, lambda a: env[a])
                if mode is not None and "kbench_autocast" not in copy.meta:
                    copy.meta["kbench_autocast"] = mode
            if not grad_enabled:
                results = [graph.call_function(torch.ops.aten.detach.default, (r,))
                           if isinstance(r, fx.Node) else r for r in results]
                for r in results:
                    if isinstance(r, fx.Node):
                        r.meta["val"] = r.args[0].meta.get("val")
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(results[user.args[1]])
                graph.erase_node(user)
        if node.users:
            raise CaptureError("a torch.no_grad() or torch.autocast block's outputs are used as a tuple")
        graph.erase_node(node)
        if not sub_node.users:
            graph.erase_node(sub_node)
            delattr(gm, sub_node.target)
    # nested blocks were moved up: inline them too
    if any(n.op == "call_function" and n.target in hops for n in graph.nodes):
        _inline_context_blocks(ep)
    graph.lint()
    gm.recompile()


def _make_functional(ep):
    """True when export's graph can be lowered as it is: every in-place op writes an intermediate
    value that nothing else aliases (x = relu(y); x += 1), directly or through a chain of views
    of it (T5's shifted = ids.new_zeros(...); shifted[..., 1:] = ids[..., :-1]), and is rewritten
    here to its functional form (_ViewWrites). False when something is really mutated (a
    parameter, buffer or input, a view whose aliasing cannot be followed, BatchNorm's running
    statistics) or a higher-order op needs inlining: the caller then functionalizes with
    run_decompositions. The graph is changed only when True."""
    for n in ep.graph.nodes:
        t = n.target
        if n.op == "call_function" and isinstance(t, torch._ops.HigherOrderOperator):
            return False
        if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
            continue
        name = t._schema.name.split("::")[-1]
        if name in _STATEFUL:
            args = {a.name: (n.args[k] if k < len(n.args) else n.kwargs.get(a.name, a.default_value
                                                                          if a.has_default_value() else None))
                    for k, a in enumerate(t._schema.arguments)}
            if (args.get("training") or args.get("use_input_stats") or name == "_batch_norm_with_update") \
                    and args.get("running_mean") is not None:
                return False
    writes = _ViewWrites(ep.graph)
    if writes.refused is not None:
        _log.debug("kbench: in-place ops left to run_decompositions: %s", writes.refused)
        return False
    writes.apply()
    return True


# Views a write may go through, each with how its base's new value is made from the view's:
# the new value scattered back into the base (slice, select) or reshaped/permuted back to it.
_aten = torch.ops.aten
_SLICES = {_aten.slice.Tensor, _aten.narrow.default}
_SELECTS = {_aten.select.int}
_RESHAPES = {_aten.view.default, _aten._unsafe_view.default, _aten.unsqueeze.default, _aten.squeeze.default,
             _aten.squeeze.dim, _aten.squeeze.dims, _aten.flatten.using_ints, _aten.unflatten.int,
             _aten.view_as.default, _aten.alias.default, _aten.reshape.default, _aten.reshape_as.default}
_PERMUTES = {_aten.permute.default, _aten.transpose.int}


def _arg(n, k, name, default=None):
    return n.args[k] if k < len(n.args) else n.kwargs.get(name, default)


class _ViewWrites:
    """The in-place ops of an export's graph as functional ones. A write's target is a chain of
    views (_SLICES, _SELECTS, _RESHAPES, _PERMUTES; none for a write to the value itself) of a
    base: a value an op made afresh (new_zeros, empty, clone, an arithmetic result), not an input,
    parameter, buffer or constant. The write becomes its functional op on the view, and the
    base's new value that view scattered back through the chain (slice_scatter, select_scatter,
    reshape, permute); every later read of the base, or of an in-place op's result on it, reads
    the newest value. Refused (self.refused says why) where aliasing cannot be followed: a view
    of the base taken before a write and read after it, a view used by anything but the next link
    of its write's chain, a write through a view whose result is read, a reshape that may copy,
    any other view op, a base that is no fresh value, an op with no functional form."""

    def __init__(self, graph):
        self.graph = graph
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.plan = []          # (write node, functional op, chain of views base-first, base)
        self.refused = None
        try:
            self._analyse()
        except _Refuse as e:
            self.refused = str(e)

    def _analyse(self):
        order, writes_of = self.order, {}
        for n in self.graph.nodes:
            t = n.target
            if n.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or not t._schema.is_mutable:
                continue
            name = t._schema.name.split("::")[-1]
            written = [k for k, a in enumerate(t._schema.arguments)
                       if a.alias_info is not None and a.alias_info.is_write]
            functional = getattr(getattr(_aten, name[:-1], None), t._overloadname, None)
            if written != [0] or not name.endswith("_") or functional is None or not n.args:
                raise _Refuse(f"{n.name}: {t} has no functional form kbench rewrites")
            chain, base = self._chain(n.args[0], n)
            if chain and n.users:
                raise _Refuse(f"{n.name}: the result of a write through a view is read")
            for k, v in enumerate(chain):
                nxt = chain[k + 1] if k + 1 < len(chain) else n
                if set(v.users) != {nxt}:
                    raise _Refuse(f"{n.name}: the view {v.name} it writes through is read elsewhere")
            self.plan.append((n, functional, chain, base))
            writes_of.setdefault(base, []).append(n)
        # a view of a written base taken before a write must not be read after it
        # (a write's own chain included: a view taken before another write reads the old value)
        for base, ws in writes_of.items():
            for v in self._views_of(base):
                last = max(order[u] for u in self._readers(v)) if v.users else -1
                if any(order[v] < order[w] < last for w in ws):
                    raise _Refuse(f"the view {v.name} of {base.name} is read after {base.name} is written")

    def _chain(self, x, n):
        """(views from the base up to x, base) for a write n to x."""
        chain = []
        while True:
            if not isinstance(x, fx.Node):
                raise _Refuse(f"{n.name} writes a non-tensor")
            if x.op != "call_function":
                raise _Refuse(f"{n.name} writes {x.name}, an input, parameter, buffer or constant")
            if _is_inplace(x):              # x.mul_(2).add_(1), x.mul_(2)[0]: the value x.mul_ wrote
                x = x.args[0]
                continue
            if not _is_view(x):
                return chain[::-1], x
            t = x.target
            if t not in _SLICES | _SELECTS | _RESHAPES | _PERMUTES:
                raise _Refuse(f"{n.name} writes through {t}, a view kbench does not follow")
            if t is _aten.narrow.default and not all(isinstance(_arg(x, k, a), int)
                                                      for k, a in ((2, "start"), (3, "length"))):
                raise _Refuse(f"{n.name} writes through a narrow of varying bounds")
            if t in (_aten.reshape.default, _aten.reshape_as.default):
                src = x.args[0].meta.get("val") if isinstance(x.args[0], fx.Node) else None
                if not isinstance(src, torch.Tensor) or not src.is_contiguous():
                    raise _Refuse(f"{n.name} writes through a reshape that may copy")
            chain.append(x)
            x = x.args[0]

    def _views_of(self, base):
        """Every view of base, at any depth, through in-place results on it too."""
        out, todo = [], [base]
        while todo:
            x = todo.pop()
            for u in x.users:
                if u.op == "call_function" and (_is_view(u) or (_is_inplace(u) and u.args[0] is x)):
                    if _is_view(u) and u.args[0] is x:
                        out.append(u)
                    todo.append(u)
        return out

    def _readers(self, v):
        """The nodes that read v's data: its users, through views of it."""
        out, todo = [], [v]
        while todo:
            x = todo.pop()
            for u in x.users:
                out.append(u)
                if u.op == "call_function" and _is_view(u) and u.args[0] is x:
                    todo.append(u)
        return out

    def apply(self):
        """Rewrites the graph: nodes in order, each read of a written base (or of an in-place
        result on it) pointed at its newest value."""
        graph, plan = self.graph, {n: (f, chain, base) for n, f, chain, base in self.plan}
        newest, alias = {}, {}        # base -> its newest value; node -> the base it stands for
        for n in list(graph.nodes):
            if alias:
                n.args = fx.map_arg(n.args, lambda a: newest.get(alias.get(a), a))
                n.kwargs = fx.map_arg(n.kwargs, lambda a: newest.get(alias.get(a), a))
            if n not in plan:
                continue
            f, chain, base = plan[n]
            n.target = f
            alias.setdefault(base, base)
            value = n
            for v in reversed(chain):
                with graph.inserting_after(value):
                    value = self._scatter(v, value)
            newest[base] = value
            if not chain:
                alias[n] = base
        graph.lint()

    def _scatter(self, view, value):
        """The value of view's operand with view's elements replaced by value (a node inserted
        at the graph's insertion point, with the operand's fake tensor)."""
        base, t = view.args[0], view.target
        if t in _SLICES:
            dim = _arg(view, 1, "dim", 0)
            if t is _aten.narrow.default:
                start = _arg(view, 2, "start")
                args = (base, value, dim, start, start + _arg(view, 3, "length"), 1)
            else:
                args = (base, value, dim, _arg(view, 2, "start"), _arg(view, 3, "end"), _arg(view, 4, "step", 1))
            node = self.graph.call_function(_aten.slice_scatter.default, args)
        elif t in _SELECTS:
            node = self.graph.call_function(_aten.select_scatter.default,
                                            (base, value, _arg(view, 1, "dim"), _arg(view, 2, "index")))
        elif t in _PERMUTES:
            rank = base.meta["val"].dim()
            if t is _aten.transpose.int:
                node = self.graph.call_function(t, (value, view.args[1], view.args[2]))
            else:
                perm = [d % rank for d in view.args[1]]
                node = self.graph.call_function(t, (value, [perm.index(i) for i in range(rank)]))
        else:
            node = self.graph.call_function(_aten.reshape_as.default, (value, base))
        node.meta["val"] = base.meta.get("val")
        if "kbench_autocast" in view.meta:
            node.meta["kbench_autocast"] = view.meta["kbench_autocast"]
        return node


class _Refuse(Exception):
    """A write _ViewWrites does not rewrite (the message says why)."""


# ---------------------------------------------------------------------------- capture


def capture(model, example_inputs, *, dynamic: bool = True, pin=(), pin_reason: str = "", keep=(),
            gemm: bool = False) -> Captured:
    """Captures model's forward on example_inputs as a kbench IR graph. Sizes of the user inputs
    may vary at run time (dynamic=True) unless the graph needs them fixed (static_reason says
    why) or `pin` lists them ((input, dim) pairs kept at their example size, for pin_reason).
    Unsupported ops become EXTERN nodes, as do the FX nodes named in `keep` (lower.lower);
    gemm=True lowers matrix products to MATMUL nodes (GEMM regions) instead of torch calls.
    A model torch.export cannot capture raises CaptureError. The model is not modified."""
    return capture_exported(model, example_inputs, dynamic=dynamic, pin=pin, pin_reason=pin_reason, keep=keep,
                            gemm=gemm)[0]


@dataclasses.dataclass
class Exported:
    """The export behind a Captured, kept so that the same program can be lowered again with more
    user-input dims pinned (capture.repin) without running torch.export again. `fixed` lists the
    input dims kept at their example sizes (with `why`): by the export, or, those in `pinned`, by
    lowering the export with them pinned; `dynamic` is False when the export is wholly static
    (then nothing is left to pin). relower lowers it again with more ops kept in torch."""
    ep: Any
    model: Any
    inputs: tuple
    fixed: frozenset
    why: Optional[str]
    dynamic: bool
    pinned: frozenset = frozenset()
    static_reason: Optional[str] = None   # what the capture lowered from it says of its sizes
    python_state: tuple = ()              # what the exported forward read (capture/guards.py)
    gemm: bool = False                    # matrix products lowered to MATMUL (capture(gemm=True))


def capture_exported(model, example_inputs, *, dynamic: bool = True, pin=(), pin_reason: str = "", keep=(),
                     gemm: bool = False):
    """capture(), returning (Captured, Exported): the export it lowered, for repin. The Exported
    holds torch's whole ExportedProgram (fake tensors, shape environment): drop it when done.
    Both carry the Python state the forward read while exported (python_state), which the
    runtime guards."""
    inputs = validate(model, example_inputs)
    with state_guards.recording(model) as recorder:
        captured, exported = _capture_exported(model, inputs, dynamic, pin, pin_reason, keep, gemm)
    exported.python_state = captured.python_state = recorder.descriptions()
    return captured, exported


def _capture_exported(model, inputs, dynamic, pin, pin_reason, keep, gemm=False):
    name = type(model).__name__
    with _model_untouched(model), _gc_paused():
        # A size the IR cannot write (x[:, 1:] gives s1 - 1, pooling s2 // 2) fixes the input
        # dims it comes from and the export is redone; the other dims stay free.
        fixed, why = set(pin), (pin_reason or None) if pin else None
        ep, reason = _export_checked(model, inputs, dynamic, fixed)
        eager_rules.check_graph(ep)   # what eager raises for these dtypes, kbench raises
        pinned = set()   # dims fixed by lowering this export again with them pinned (no re-export)
        for _ in range(4):
            text = reason
            if reason is None and fixed:
                text = (f"input dims {sorted(fixed)} fixed at their example sizes ({why}); "
                        "the others may vary")
            exported = Exported(ep, model, inputs, frozenset(fixed), why, reason is None, frozenset(pinned), text,
                                gemm=gemm)
            try:
                return lowering.lower(ep, inputs, text, model, pin=sorted(pinned), keep=keep, gemm=gemm), exported
            except lowering.NeedStatic as e:
                if reason is not None and not fixed:    # already static: a genuine limitation
                    raise CaptureError(f"cannot capture {name}: {e}") from None
                why = f"size not expressible as coef*symbols: {e}"
                if not set(e.dims) - fixed:
                    break
                fixed |= set(e.dims)
                if reason is None:   # a dynamic export: the same program, those dims pinned
                    pinned |= set(e.dims)
                else:
                    ep, reason = _export_checked(model, inputs, dynamic, fixed)
                    pinned = set()
        ep = _export_checked(model, inputs, False, ())[0]
        try:
            return (lowering.lower(ep, inputs, why, model, keep=keep, gemm=gemm),
                    Exported(ep, model, inputs, frozenset(), why, False, static_reason=why, gemm=gemm))
        except lowering.NeedStatic as e:
            raise CaptureError(f"cannot capture {name}: {e}") from None


def repin(exported: Exported, pin, pin_reason: str = "", keep=()) -> Captured:
    """What capture(model, inputs, pin=pin, pin_reason=pin_reason, keep=keep) gives, from the
    export a first capture made: the program is lowered again with the pinned dims' symbols
    replaced by their example sizes (as a static export of those dims would have them), so
    torch.export runs once. Falls back to a fresh capture where the export cannot be reused."""
    pin = set(pin)
    if not pin:
        raise ValueError("repin needs at least one (input, dim) to pin")
    fixed = exported.fixed | pin
    if exported.dynamic and not exported.fixed & pin:
        # the reason capture(pin=...) gives: the pins' own, unless the export already had to fix
        # dims for a size the IR cannot write (that capture re-exports for the same size)
        why = exported.why if exported.fixed else (pin_reason or None)
        reason = f"input dims {sorted(fixed)} fixed at their example sizes ({why}); the others may vary"
        try:
            captured = lowering.lower(exported.ep, exported.inputs, reason, exported.model,
                                      pin=sorted(pin | exported.pinned), keep=keep, gemm=exported.gemm)
            captured.python_state = exported.python_state
            return captured
        except lowering.NeedStatic:
            pass
    return capture(exported.model, exported.inputs, pin=sorted(pin), pin_reason=pin_reason, keep=keep,
                   gemm=exported.gemm)


def relower(exported: Exported, keep, pin=(), pin_reason: str = "") -> Captured:
    """The capture `exported` gave (repinned with `pin` for pin_reason, where given, as repin),
    lowered again with the FX nodes named in keep (a dict: name -> why) left as one torch call
    each: the same export, torch.export does not run again."""
    if pin:
        return repin(exported, pin, pin_reason, keep=keep)
    captured = lowering.lower(exported.ep, exported.inputs, exported.static_reason, exported.model,
                              pin=sorted(exported.pinned), keep=keep, gemm=exported.gemm)
    captured.python_state = exported.python_state
    return captured


def _export_checked(model, inputs, dynamic, fixed):
    try:
        return _export(model, inputs, dynamic, frozenset(fixed))
    except Exception as e:  # noqa: BLE001
        with _quiet_export():
            eager_rules.check_trace(model, inputs)   # an error eager raises too: eager's exception
        raise CaptureError(f"torch.export could not capture {type(model).__name__}: "
                           f"{_first_line(e)}") from e
