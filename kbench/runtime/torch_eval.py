"""Runs IR nodes with plain torch ops: the reference evaluator of a captured
graph, the per-region eager fallback, and (being pure, out-of-place torch) differentiable, so the
backward can go through it with torch.autograd. Values are computed in the node's dtype, or in
float64 for every floating value when dtype=torch.float64 is asked. It also finds where a
gradient check's inputs sit on a point where an op's derivative jumps (away_from_kinks)."""
from __future__ import annotations

import functools

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

# Where each op's derivative jumps (the IR's ops; ops.def's rules and torch's agree on where, not
# always on the value there). Unary: the operand values; a softplus at beta*x = threshold.
# Binary: a == b (a max/min's tie, a comparison's switch); a max/min reduction: a tie for the
# extreme; a cast to an integer or bool: at integers.
_KINK_AT = {"relu": (0.0,), "leaky_relu": (0.0,), "abs": (0.0,), "sign": (0.0,), "hardswish": (-3.0, 3.0)}
_KINK_BINARY = frozenset(("max", "min", "lt", "le", "gt", "ge", "eq", "ne"))
# An operand within this much of a kink, relative to the operands' largest magnitude, counts as
# on it: a float32 kernel's value and the float64 reference's must not fall on different sides.
KINK_REL = 1e-5
# Rounds of redrawing the inputs that put a value on a kink (each leaves ~1e-4 of the last).
KINK_ROUNDS = 4


def _axes(mask, rank):
    return [d for d in range(rank) if mask >> d & 1]


def evaluate(graph, captured, inputs_by_value: dict, symvals, *, nodes=None, dtype=None, device=None, kinks=None):
    """Runs the IR nodes (all of the graph's, or `nodes`, a topologically ordered list of ids)
    on torch tensors. inputs_by_value maps value ids (graph inputs, or a region's inputs) to
    tensors; returns a dict value id -> tensor holding those and every value computed.
    dtype=torch.float64 computes every floating value in float64 (a reference). Values are made
    on the inputs' device; device says where, for nodes with no tensor input at all (a constant
    region of a loss's joint graph), else the CPU. kinks (a list, float64 only) gets, per node
    whose operand sits on a point where its derivative jumps, a scalar whose gradient reaches the
    inputs that put it there (_kink)."""
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
        elif op == "matmul":
            # in the output's dtype where the operands' differs (rounded once there, as the IR's)
            a, b = args
            y = torch.matmul(a.to(want), b.to(want)) if a.dtype != want else torch.matmul(a, b)
        else:
            raise NotImplementedError(f"torch_eval: op {op}")
        if isinstance(y, torch.Tensor) and y.dtype != want:
            y = y.to(want)
        if n.get("nograd"):   # a stability shift (softmax's max): no gradient flows through it
            y = y.detach()
        elif kinks is not None and args and _jumps(n):
            on = _kink(op, n, args, i)
            if on is not None:
                kinks.append(on)
        env[i] = y
    return env


def _near(a, c, size):
    """Where a is within KINK_REL * size of c (finite values only: an infinite bound is no kink)."""
    return ((a - c).abs_() <= KINK_REL * size) & a.isfinite()


def _top(t) -> float:
    """The largest finite magnitude in t (0 for none)."""
    t = t.detach().abs()
    return float(torch.where(t.isfinite(), t, 0).max()) if t.numel() else 0.0


def _kink(op, n, args, i):
    """Where node i's operands sit on a point where its derivative jumps: the sum of those
    operand elements (a - b for a comparison or tie, whose common moves cannot break it: max(x, x)
    stays tied), each times a random weight so that no two cancel; its gradient is nonzero at the
    inputs that move them. None where none does, or nothing differentiable leads there."""
    a = args[0]
    if op in _KINK_AT or op == "softplus":
        if not a.is_floating_point() or not a.requires_grad:
            return None
        at = _KINK_AT.get(op) or (n["scalars"][1] / n["scalars"][0],)
        d, top = a.detach(), _top(a)
        mask = functools.reduce(torch.logical_or, [_near(d, c, top + abs(c)) for c in at])
        diff = a
    elif op in _KINK_BINARY and len(args) == 2:
        if not (a.requires_grad or args[1].requires_grad):
            return None
        a, b = (x if x.is_floating_point() else x.to(torch.float64) for x in args)
        mask = _near(a.detach(), b.detach(), _top(a) + _top(b)) & b.detach().isfinite()
        diff = a - b
    elif op in ("max", "min") and len(args) == 1 and a.is_floating_point() and a.requires_grad:
        axes = _axes(n["axes"], a.dim())
        ext = _REDUCE[op](a, dim=axes, keepdim=True)
        near = _near(a.detach(), ext.detach(), 2 * _top(a))
        mask, diff = near & (near.sum(dim=axes, keepdim=True) >= 2), a - ext
    elif op == "cast" and not IR_TO_TORCH[n["dtype"]].is_floating_point and a.is_floating_point() \
            and a.requires_grad:
        d = a.detach()
        mask, diff = _near(d, d.round(), 2 * _top(a) + 1), a
    else:
        return None
    if not diff.requires_grad or not bool(mask.any()):
        return None
    gen = torch.Generator(device=diff.device).manual_seed(i)
    weight = 1 + torch.rand(diff.shape, generator=gen, dtype=torch.float64, device=diff.device)
    return (torch.where(mask, diff.to(torch.float64), 0.0) * weight).sum()


def _jumps(n) -> bool:
    """Has node n's op a point where its derivative jumps (the ops _kink looks at)?"""
    op = n["op"]
    return op in _KINK_AT or op in _KINK_BINARY or op == "softplus" or \
        (op == "cast" and not IR_TO_TORCH[n["dtype"]].is_floating_point)


def may_kink(graph, nodes=None) -> bool:
    """Does any of these nodes (all the graph's: None) have a point where its derivative jumps?"""
    return any(_jumps(graph.node(i)) for i in (range(graph.num_nodes) if nodes is None else nodes))


def kink_inputs(compute, inputs) -> list:
    """Per input, a mask of its elements that put some value on a point where an op's derivative
    jumps (None where none does, and for a non-float input), computed in float64: compute(xs, kinks) evaluates the
    nodes with evaluate(..., kinks=kinks)."""
    with torch.enable_grad():
        xs = [x.detach().to(torch.float64).requires_grad_() if x.is_floating_point() else x for x in inputs]
        kinks = []
        compute(xs, kinks)
        wrt = [x for x in xs if x.requires_grad]
        if not kinks or not wrt:
            return [None] * len(inputs)
        got = iter(torch.autograd.grad(sum(kinks), wrt, allow_unused=True))
    masks = []
    for x in xs:
        g = next(got) if x.requires_grad else None
        masks.append(None if g is None else (g != 0) & ~g.isnan())
    return masks


def away_from_kinks(compute, inputs, redraw):
    """The inputs, with the elements that put a value on a point where an op's derivative jumps
    drawn again (redraw(i, x): fresh values for input i, shaped as x), for at most KINK_ROUNDS
    rounds. A gradient check needs this: there the derivative is a convention (hardswish at +-3: 1
    and 0 in torch and ops.def; 1.5 and -0.5 in code that takes x/3 + 1/2 on the closed [-3, 3]),
    and a value within rounding of a kink lands on different sides in a float32 kernel and the
    float64 reference. Either way one such element fails the max-norm comparison by the jump's
    size, and they are not rare: a bf16 value is exactly 3.0 with probability ~7e-5, so a
    hardswish over 12M activations meets ~1700 (MobileNetV3's bf16 hardswish backwards failed
    their checks on an H200, torch 2.11). Away from the kinks the gradient is unique and
    any correct backward matches it; what a backward gives at a kink is left unchecked."""
    inputs = list(inputs)
    for _ in range(KINK_ROUNDS):
        masks = kink_inputs(compute, inputs)
        hit = [i for i, m in enumerate(masks) if m is not None and bool(m.any())]
        if not hit:
            break
        for i in hit:
            inputs[i] = torch.where(masks[i], redraw(i, inputs[i]), inputs[i])
    return inputs


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
