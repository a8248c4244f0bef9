"""Eager's dtype rules at capture. torch.export traces on fake tensors, whose kernels check shapes
but mostly not dtypes: softmax or gelu of an int64 tensor, a float64 LayerNorm weight on float32
input trace fine, and eager raises. Each op whose operands could break such a rule (an integer or
bool operand, floats of several dtypes, an empty operand) is run for real on tensors of its
operands' dtypes and shapes; where eager raises, capture raises the same exception type, naming
the op."""
from __future__ import annotations

import logging

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .ops import LOWER


class _Unknown(Exception):
    """An operand the probe cannot make real (a size with no example value)."""


def _concrete(x, fill):
    """x with every tensor (fake, meta or real) replaced by a real one of its dtype, shape and
    device filled with `fill`, and every symbolic size by its example value."""
    if isinstance(x, fx.Node):
        x = x.meta.get("val")
        if x is None:
            raise _Unknown()
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            raise _Unknown()
        shape = [_concrete(s, fill) for s in x.shape]
        return torch.full(shape, fill if x.dtype != torch.bool else bool(fill), dtype=x.dtype, device=x.device)
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = x.node.hint
        if hint is None:
            raise _Unknown()
        return hint
    return x


def _tensors(args):
    for x in pytree.tree_leaves(args):
        if isinstance(x, fx.Node):
            x = x.meta.get("val")
        if isinstance(x, torch.Tensor):
            yield x


def suspect(func, args) -> bool:
    """Could eager reject this call for its operands' dtypes? Operands of one floating dtype are
    what every float op takes; an integer or bool operand, or two float dtypes, may not be. Views
    check no dtype, and ops that draw random numbers must not draw them here."""
    if not isinstance(func, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in func.tags:
        return False
    rets = func._schema.returns
    if rets and rets[0].alias_info is not None and not rets[0].alias_info.is_write:
        return False
    tensors = list(_tensors(args))
    dtypes = {t.dtype for t in tensors}
    # an empty operand: eager's reductions over an empty dim raise (max) where fake kernels raise
    # other errors or none (sizes 0 are plain ints: export fixes them)
    empty = any(any(type(s) is int and s == 0 for s in t.shape) for t in tensors)
    return empty or any(not d.is_floating_point for d in dtypes) or len(dtypes) > 1


def probe(func, args, kwargs):
    """func run for real on operands like these, filled with zeros and then with ones (a value
    error, an index out of range or an integer division by zero, passes one of them; a dtype
    error fails both). Returns eager's exception where both raise, else None."""
    errors = []
    for fill in (0, 1):
        try:
            a, k = pytree.tree_map(lambda x: _concrete(x, fill), (args, kwargs))
        except Exception:  # noqa: BLE001 - _Unknown, or a dtype torch.full cannot make: no verdict
            return None
        try:
            with torch.no_grad():
                func(*a, **k)
            return None
        except Exception as e:  # noqa: BLE001 - any exception eager raises is the answer
            errors.append(e)
    return errors[0]


def same_error(e: BaseException, where: str) -> BaseException:
    """An exception of e's own type saying where eager raises it (e itself where its type takes
    no message)."""
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    try:
        return type(e)(f"{where}: eager PyTorch raises {type(e).__name__} for these operands, and so "
                       f"does kbench: {first}")
    except Exception:  # noqa: BLE001 - an exception type with another constructor
        return e


def _describe(func, node_name, args):
    operands = ", ".join(f"{str(t.dtype).replace('torch.', '')}{[_size(s) for s in t.shape]}"
                         for t in _tensors(args))
    return f"{func} ({node_name}) on {operands}"


def _size(s):
    return s if type(s) is int else (s.node.hint if s.node.hint is not None else str(s))


def check_graph(ep) -> None:
    """Every op of the exported graph that kbench computes (ops.LOWER; the others stay torch calls
    and raise eager's errors as they run) is probed where its dtypes are suspect; raises eager's
    exception for the first one eager rejects. Each distinct call is run once."""
    seen = set()
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target not in LOWER or not suspect(node.target, (node.args, node.kwargs)):
            continue
        key = (node.target, repr(pytree.tree_map(_signature, (node.args, node.kwargs))))
        if key in seen:
            continue
        seen.add(key)
        err = probe(node.target, node.args, node.kwargs)
        if err is not None:
            _raise(err, _describe(node.target, node.name, (node.args, node.kwargs)))


def _signature(x):
    x = x.meta.get("val") if isinstance(x, fx.Node) else x
    return (x.dtype, tuple(x.shape), x.device) if isinstance(x, torch.Tensor) else x


def _raise(err, where):
    new = same_error(err, where)
    if new is err:
        raise err
    raise new from err


class _Found(Exception):
    pass


def check_trace(model, inputs) -> None:
    """Where torch.export failed: the forward traced again on fake tensors, so that an error eager
    raises for these inputs reaches the user as eager's exception, not export's (a fake kernel
    may raise another type, a decomposition's RuntimeError where eager's kernel raises
    NotImplementedError, or nothing at all). Each suspect ATen op is probed as it comes; where the
    trace fails anyway, the torch call the forward was making is run for real on operands like
    its own, and eager's error is raised where that fails with zeros and with ones. Returns
    where neither finds one (the caller reports export's failure then)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    found, failed = [], []

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if suspect(func, (args, kwargs)):
                with _disable_current_modes():
                    err = probe(func, args, kwargs)
                if err is not None:
                    found.append((err, _describe(func, "in the forward", (args, kwargs))))
                    raise _Found()
            return func(*args, **kwargs)

    class Calls(TorchFunctionMode):
        """The forward's torch calls (the mode is off inside one: the calls it makes are not
        seen); the first that raises is kept."""
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            try:
                return func(*args, **kwargs)
            except _Found:
                raise
            except Exception:
                if not failed:
                    failed.append((func, args, kwargs))
                raise

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)   # a fake kernel that raises logs its traceback: ours to report
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [mode.from_tensor(t) for t in inputs]
        with mode, Probe(), Calls(), torch.no_grad():
            model(*fakes)
    except Exception:  # noqa: BLE001 - _Found, or a trace that fails: what eager does decides
        pass
    finally:
        logger.setLevel(level)
    if found:
        _raise(*found[0])
    if failed:
        func, args, kwargs = failed[0]
        devices = sorted({t.device.index or 0 for t in _tensors((args, kwargs)) if t.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices):   # a call that draws random numbers draws none of the user's
            err = probe(func, args, kwargs)
        if err is not None:
            name = getattr(func, "__qualname__", None) or str(func)
            _raise(err, _describe(name, "in the forward", (args, kwargs)))
