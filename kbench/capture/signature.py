"""How a call's arguments become the graph's user inputs. torch.export takes tensors; models take
keyword arguments, Python scalars, None, nested tuples and dicts. A CallSpec records the pytree
structure of an example call's (args, kwargs): every tensor leaf is a graph input (in order), and
every other leaf is a constant the capture specializes on and each later call is checked against
(as torch.compile guards a Python scalar it specialized). FlatCall is the model as torch.export
sees it: a forward of the tensors alone that rebuilds the example's call around them."""
from __future__ import annotations

import math

import torch
import torch.utils._pytree as pytree


class CallSpec:
    """The structure of one call: which leaves are tensors (graph inputs) and the value of every
    other leaf. `plain` when the call is tensors passed positionally, nothing else (the common
    call, which needs no flattening)."""

    def __init__(self, args: tuple, kwargs: dict):
        leaves, self.spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        self.tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.constants = {i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)}
        self.nleaves = len(leaves)
        self.plain = not kwargs and not self.constants and all(isinstance(a, torch.Tensor) for a in args)
        self.names = self._names(args, kwargs)
        for i, x in self.constants.items():
            if not isinstance(x, (bool, int, float, str, type(None), torch.dtype, torch.device)):
                raise TypeError(f"argument {self.where(i)} is a {type(x).__name__}; kbench captures tensors, "
                                "Python scalars, strings, None, dtypes and devices, and tuples, lists and "
                                "dicts of them")

    @staticmethod
    def _names(args, kwargs):
        """A readable path per leaf: args[1], kwargs['mask'], args[0][2]."""
        paths, _ = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
        names = []
        for path, _ in paths:
            head, rest = path[0], path[1:]
            text = "args" if getattr(head, "idx", None) == 0 else "kwargs"
            for k in rest:
                text += f"[{k.key!r}]" if hasattr(k, "key") else f"[{getattr(k, 'idx', k)}]"
            names.append(text)
        return names

    def where(self, leaf: int) -> str:
        return self.names[leaf] if leaf < len(self.names) else f"leaf {leaf}"

    def tensors(self, args, kwargs):
        """The graph's user inputs for this call, or the one-line reason it does not fit the
        capture (another structure, another constant)."""
        if self.plain and not kwargs:
            if len(args) != len(self.tensor_at):
                return f"the capture takes {len(self.tensor_at)} input(s); this call passes {len(args)}"
            for i, a in enumerate(args):
                if not isinstance(a, torch.Tensor):
                    return f"args[{i}] is a {type(a).__name__}; the capture has a tensor there"
            return list(args)
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if spec != self.spec:
            return "the call's arguments are structured differently from the captured call's"
        for i, want in self.constants.items():
            got = leaves[i]
            if not _same_constant(got, want):
                return (f"{self.where(i)} is {_show(got)}; the capture specialized it to {_show(want)}")
        out = []
        for i in self.tensor_at:
            if not isinstance(leaves[i], torch.Tensor):
                return f"{self.where(i)} is a {type(leaves[i]).__name__}; the capture has a tensor there"
            out.append(leaves[i])
        return out

    def rebuild(self, tensors):
        """(args, kwargs) of the captured call with these tensors in the tensors' places."""
        leaves = [None] * self.nleaves
        for i, v in self.constants.items():
            leaves[i] = v
        for i, t in zip(self.tensor_at, tensors):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return args, kwargs

    def describe(self) -> list:
        """The report's lines on what was specialized."""
        return [f"{self.where(i)} = {_show(v)} specialized (another value runs in eager)"
                for i, v in self.constants.items() if v is not None]

    def key(self) -> str:
        """What of the call a capture's cache key must see beyond the tensors' metadata."""
        return repr((str(self.spec), sorted((i, type(v).__name__, repr(v)) for i, v in self.constants.items())))


def _same_constant(got, want) -> bool:
    if type(got) is not type(want):    # True is not 1, 1 is not 1.0: each may trace differently
        return False
    if isinstance(want, float) and math.isnan(want):
        return math.isnan(got)
    return got == want


def _show(x) -> str:
    return f"{type(x).__name__} {x!r}"


class FlatCall(torch.nn.Module):
    """`model` called as the example call was, its tensors passed positionally: what torch.export
    captures when a call has keyword arguments or non-tensor arguments. It shares the model's
    parameters, buffers and submodules (the same dicts), so the capture names them as the model
    does."""

    def __init__(self, model: torch.nn.Module, spec: CallSpec):
        super().__init__()
        self._parameters, self._buffers, self._modules = model._parameters, model._buffers, model._modules
        self.training = model.training
        self.__dict__.update(_kbench_inner=model, _kbench_spec=spec)

    def forward(self, *tensors):
        args, kwargs = self._kbench_spec.rebuild(tensors)
        return self._kbench_inner(*args, **kwargs)

    def train(self, mode: bool = True):
        self._kbench_inner.train(mode)
        return super().train(mode)
