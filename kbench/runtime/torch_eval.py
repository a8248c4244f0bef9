"""Runs IR nodes with plain torch ops: the reference evaluator of a captured
graph, the per-region eager fallback, and (being pure, out-of-place torch) differentiable, so the
backward can go through it with torch.autograd. Values are computed in the node's dtype, or in
float64 for every floating value when dtype=torch.float64 is asked."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..dtypes import IR_TO_TORCH

__all__ = ["evaluate", "run_graph"]

_UNARY = {
    "neg": torch.neg, "abs": torch.abs, "sign": torch.sign, "exp": torch.exp, "log": torch.log,
    "log1p": torch.log1p, "expm1": torch.expm1, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
    "recip": torch.reciprocal, "sin": torch.sin, "cos": torch.cos, "tanh": torch.tanh,
    "erf": torch.erf, "sigmoid": torch.sigmoid, "relu": torch.relu, "gelu": F.gelu,
    "gelu_tanh": lambda a: F.gelu(a, approximate="tanh"), "silu": F.silu, "mish": F.mish,
    "hardswish": F.hardswish, "not": torch.logical_not,
}
_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "max": torch.maximum, "min": torch.minimum, "pow": torch.pow,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "and": torch.logical_and, "or": torch.logical_or,
}
_REDUCE = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}


def _axes(mask, rank):
    return [d for d in range(rank) if mask >> d & 1]


def evaluate(graph, captured, inputs_by_value: dict, symvals, *, nodes=None, dtype=None, device=None):
    """Runs the IR nodes (all of the graph's, or `nodes`, a topologically ordered list of ids)
    on torch tensors. inputs_by_value maps value ids (graph inputs, or a region's inputs) to
    tensors; returns a dict value id -> tensor holding those and every value computed.
    dtype=torch.float64 computes every floating value in float64 (a reference). Values are made
    on the inputs' device; device says where, for nodes with no tensor input at all (a constant
    region of a loss's joint graph), else the CPU."""
    symvals = list(symvals)
    f64 = dtype == torch.float64
    env = {}
    first = None
    for v, t in inputs_by_value.items():
        if f64 and t.is_floating_point():
            t = t.to(torch.float64)
        env[v] = t
        first = first or t.device
    device = first or device or torch.device("cpu")
    ids = range(graph.num_nodes) if nodes is None else nodes
    extern_cache = {}
    for i in ids:
        if i in env:
            continue
        n = graph.node(i)
        op = n["op"]
        if op == "input":
            raise ValueError(f"graph input %{i} ({n['name']}) was not given")
        want = IR_TO_TORCH[n["dtype"]]
        if f64 and want.is_floating_point:
            want = torch.float64
        args = [env[j] for j in n["inputs"]]
        if op == "const":
            y = torch.full(tuple(graph.sizes(i, symvals)), n["scalars"][0], dtype=want, device=device)
        elif op == "iota":
            sizes = tuple(graph.sizes(i, symvals))
            ax = n["axis"]
            shape = [1] * len(sizes)
            shape[ax] = sizes[ax]
            y = torch.arange(sizes[ax], device=device).reshape(shape).expand(sizes).to(want)
        elif op == "extern":
            key = n["index"]
            if key not in extern_cache:
                extern_cache[key] = captured.externs[key].call(args, symvals, device)
            y = extern_cache[key]
            if isinstance(y, (tuple, list)):
                y = y[n["axis"]]
        elif op == "cast":
            y = args[0]
            narrow = IR_TO_TORCH[n["dtype"]]
            if f64 and narrow.is_floating_point and narrow != torch.float64 and y.is_floating_point():
                # the reference rounds where torch does (autocast's cast of a weight to bf16): a
                # relu or a comparison downstream must see the rounded value, or its mask and
                # so its gradient differ from eager's. The gradient flows straight through.
                y = y + (y.to(narrow).to(torch.float64) - y).detach()
        elif op in _UNARY and len(args) == 1 and op not in _REDUCE:
            y = _UNARY[op](args[0])
        elif op == "leaky_relu":
            y = F.leaky_relu(args[0], n["scalars"][0])
        elif op == "softplus":
            y = F.softplus(args[0], beta=n["scalars"][0], threshold=n["scalars"][1])
        elif op in _REDUCE and len(args) == 1:
            a = args[0]
            axes = _axes(n["axes"], a.dim())
            y = _REDUCE[op](a, dim=axes, keepdim=len(n["dims"]) == a.dim())
        elif op in _BINARY:
            a, b = args
            if op in ("add", "sub", "mul", "div", "max", "min", "pow") and a.dtype != b.dtype:
                b = b.to(a.dtype)
            y = _BINARY[op](a, b)
        elif op == "where":
            y = torch.where(args[0].bool() if args[0].dtype != torch.bool else args[0], args[1], args[2])
        elif op == "reshape":
            y = args[0].reshape(graph.sizes(i, symvals))
        elif op == "permute":
            y = args[0].permute(n["perm"])
        elif op == "expand":
            y = args[0].expand(graph.sizes(i, symvals))
        elif op == "slice":
            length = graph.sizes(i, symvals)[n["axis"]]
            start, step = n["start"], n["step"]
            y = args[0].narrow(n["axis"], start, (length - 1) * step + 1 if length else 0)
            if step > 1:
                y = y[(slice(None),) * n["axis"] + (slice(None, None, step),)]
        elif op == "gather":
            y = torch.gather(args[0], n["axis"], args[1].long())
        else:
            raise NotImplementedError(f"torch_eval: op {op}")
        if isinstance(y, torch.Tensor) and y.dtype != want:
            y = y.to(want)
        if n.get("nograd"):   # a stability shift (softmax's max): no gradient flows through it
            y = y.detach()
        env[i] = y
    return env


def run_graph(captured, model, user_inputs, *, dtype=None, apply_mutations=True):
    """The model's forward computed through the captured IR with torch ops: binds the symbols
    from the inputs' shapes, fetches the live parameters, rebuilds the output structure."""
    g = captured.graph
    symvals = captured.bind(user_inputs)
    tensors = captured.graph_inputs(model, user_inputs)
    env = evaluate(g, captured, dict(zip(g.inputs, tensors)), symvals, dtype=dtype)
    outs = [env[v] for v in g.outputs]
    if apply_mutations and captured.mutations:
        captured.apply_mutations(model, user_inputs, outs)
    return captured.build_outputs(outs, symvals)


def autograd_of(compute, inputs, need, grads, *, dtype=None, create_graph=False):
    """torch.autograd through compute(xs), a torch recomputation of IR values from the tensors
    xs: (its outputs, a gradient or None per input) for the upstream gradients `grads` (None:
    that output gets none). dtype=torch.float64 computes in float64 (a reference to check
    generated gradients against); create_graph keeps the gradients attached to the inputs
    (double backward)."""
    with torch.enable_grad():
        if create_graph:
            xs = [x if n else x.detach() for x, n in zip(inputs, need)]
        else:
            xs = [(x.detach().to(dtype) if dtype is not None and x.is_floating_point() else x.detach())
                  .requires_grad_(bool(n)) for x, n in zip(inputs, need)]
        outs = compute(xs)
        pairs = [(o, g if dtype is None else g.to(dtype)) for o, g in zip(outs, grads)
                 if g is not None and o.requires_grad]
        wrt = [x for x in xs if x.requires_grad]
        if not pairs or not wrt:
            return outs, [None] * len(inputs)
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True,
                                  create_graph=create_graph)
    it = iter(got)
    return outs, [next(it) if x.requires_grad else None for x in xs]
