"""A loss's gradient computed in its forward pass. For a module whose output is one scalar (a
loss), forward and backward are one graph (csrc/grad/, kb_graph_grad_joint) with the upstream
gradient taken as 1, partitioned as a whole: the row kernel that reduces a cross-entropy's logits
writes their gradient in the same pass, so forward + backward read the logits once instead of
twice. The backward then only scales the gradients by the real upstream gradient, which
loss.backward() gives as exactly 1: the backend's scale finds that on the device and moves
nothing (an upstream gradient other than 1 — a loss scale, 1/accumulation steps — costs one pass
over the gradients). Liger-Kernel's cross-entropy makes the same trade.

Used only for graphs without EXTERN regions or input mutations, only after the loss and the
gradients match torch.autograd on the sweep sizes, and only where it moves fewer bytes than the
forward plus each region's own backward and — where the backend times its kernels — is no slower
than them even with the scaling pass (build(); the report gives the decision and both counts).
"""
from __future__ import annotations

import torch

from .. import verify
from ..dtypes import torch_dtype
from . import torch_eval
from .plan import Plan, Program

# The joint program is used while its kernels (and the scaling pass an upstream gradient other
# than 1 adds) take at most this much longer than the forward's and the per-region backward's
# together: it saves the backward's autograd nodes and launches.
JOINT_SLACK = 1.05


def scalar_output(plan, captured) -> str:
    """'' when the graph is a loss this mode can take, else why not (for the report)."""
    graph = plan.graph
    if len(graph.outputs) != 1:
        return f"{len(graph.outputs)} outputs"
    nd = plan.nodes[graph.outputs[0]]
    if not torch_dtype(nd["dtype"]).is_floating_point:
        return "the output is not floating point"
    if any(d != 1 for d in nd["dims"]):
        return "the output is not a scalar"
    if any(info.kind == "EXTERN" for info in plan.regions):
        return "torch computes part of it (EXTERN regions)"
    if captured.mutations:
        return "it mutates its inputs"
    return ""


def region_bytes(plan, symvals) -> int:
    """Bytes the compute regions of a plan read and write at these sizes (each region's inputs
    and outputs once)."""
    total = 0
    for info in plan.regions:
        if info.kind == "EXTERN":
            continue
        for v in {*info.inputs, *info.outputs}:
            n = 1
            for s in plan.graph.sizes(v, symvals):
                n *= s
            total += n * torch_dtype(plan.nodes[v]["dtype"]).itemsize
    return total


def region_wants(plan, need) -> list:
    """(region, which of its inputs want gradients) for each compute region some input of which
    does, as the forward's autograd nodes see it: a region's outputs want them where any of its
    inputs does (RegionFunction), whatever the values depend on."""
    req = {v: bool(n) for v, n in zip(plan.graph.inputs, need)}
    out = []
    for info in plan.regions:
        wrt = tuple(req.get(v, False) and torch_dtype(plan.nodes[v]["dtype"]).is_floating_point
                    for v in info.inputs)
        for v in info.outputs:
            req[v] = any(wrt)
        if info.kind != "EXTERN" and any(wrt):
            out.append((info, wrt))
    return out


def separate_bytes(plan, need, make_plan) -> int:
    """Bytes of the forward plus every region's own backward (the other way to train it)."""
    total = region_bytes(plan, plan.example_symvals)
    for info, wrt in region_wants(plan, need):
        graph = plan.partition.region_graph(info.index).grad(list(wrt), saved=info.saved,
                                                             outputs=info.saved_outputs)
        total += region_bytes(make_plan(graph), plan.example_symvals)
    return total


def kernels_ms(plans):
    """The backend's timings of every compute region of these plans, summed (its kernel, or
    torch where it stayed eager); None where a region has no timing (the interpreter)."""
    total = 0.0
    for p in plans:
        for info in p.regions:
            if info.kind == "EXTERN":
                continue
            ms = info.kernel_ms if info.kernel_ms is not None else info.eager_ms
            if ms is None:
                return None
            total += ms
    return total


def graph_inputs(plan, symvals, gen, device) -> list:
    """Random inputs of the whole graph at these sizes; an integer input that indexes a gather
    is drawn below the gathered axis's size."""
    bounds = {}
    for nd in plan.nodes:
        if nd["op"] != "gather":
            continue
        axis_size = plan.graph.sizes(nd["inputs"][0], symvals)[nd["axis"]]
        stack, seen = [nd["inputs"][1]], set()
        while stack:
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            bounds.setdefault(u, axis_size)
            stack.extend(plan.nodes[u]["inputs"])
    if gen.device.type != device.type:
        gen = torch.Generator(device=device).manual_seed(gen.initial_seed())
    return [verify.fill(torch.empty(plan.graph.sizes(v, symvals), dtype=torch_dtype(plan.nodes[v]["dtype"]),
                                    device=device), "normal", gen, high=bounds.get(v))
            for v in plan.graph.inputs]


def eager_grads(plan, symvals, inputs, need, grad_out, *, dtype=None, create_graph=False):
    """(loss, gradients or None per input) through torch autograd of the graph's torch
    recomputation; dtype=torch.float64 gives the reference the joint program is checked against."""
    def loss(xs):
        values = torch_eval.evaluate(plan.graph, plan, dict(zip(plan.graph.inputs, xs)), symvals, dtype=dtype,
                                     device=plan.device)
        return [values[plan.graph.outputs[0]]]
    outs, got = torch_eval.autograd_of(loss, inputs, need, [grad_out], dtype=dtype, create_graph=create_graph)
    return outs[0], got


class Joint:
    """The joint program of one `need` pattern (which graph inputs want gradients), bound to
    sizes on demand."""

    def __init__(self, owner, program, need, unused):
        self.owner, self.program, self.need = owner, program, need
        self.unused = unused          # positions (among the needed) whose gradient torch leaves None
        self.bounds = {}

    def bound(self, symvals):
        b = self.bounds.get(symvals)
        if b is None:
            if len(self.bounds) > 64:
                self.bounds.clear()
            b = self.bounds[symvals] = self.program.bind(symvals)
        return b

    def place(self, grads) -> tuple:
        """The needed inputs' gradients in input order, None elsewhere (and where unused)."""
        out, it, k = [], iter(grads), -1
        for n in self.need:
            if not n:
                out.append(None)
                continue
            k += 1
            g = next(it)
            out.append(None if k in self.unused else g)
        return tuple(out)


class LossFunction(torch.autograd.Function):
    """A loss and its gradients in one forward; the backward scales them by the upstream
    gradient (in place: they are this node's alone). A second backward (retain_graph) runs the
    joint program again on the saved inputs (the same kernels: the same bits); a differentiable
    one (create_graph) goes through torch autograd of the recomputation."""

    @staticmethod
    def forward(ctx, joint, symvals, *inputs):
        outs = joint.bound(symvals).run(list(inputs))
        ctx.joint, ctx.symvals, ctx.grads = joint, symvals, outs[1:]
        ctx.save_for_backward(*inputs)
        return outs[0]

    @staticmethod
    def backward(ctx, grad_out):
        joint, grads = ctx.joint, ctx.grads
        ctx.grads = None
        if torch.is_grad_enabled():
            _, got = eager_grads(joint.owner._kbench_plan, ctx.symvals, ctx.saved_tensors, joint.need, grad_out,
                                 create_graph=True)
            return (None, None) + tuple(got)
        if grads is None:
            grads = joint.bound(ctx.symvals).run(list(ctx.saved_tensors))[1:]
        joint.program.executor.scale(grads, grad_out)
        return (None, None) + joint.place(grads)


def build(owner, need):
    """The checked joint program for this need pattern, or None (the reason is in the report)."""
    plan, info = owner._kbench_plan, owner._kbench_loss
    key = ", ".join(plan.nodes[v]["name"] for v, n in zip(plan.graph.inputs, need) if n) or "none"
    try:
        graph = plan.graph.grad(list(need), joint=True)
    except NotImplementedError as e:
        info[key] = f"no (autodiff: {str(e).splitlines()[0][:80]})"
        return None

    def make_plan(g):
        return Plan(g, (), plan.example_symvals, None, plan.guards)

    jplan = make_plan(graph)
    joint_bytes = region_bytes(jplan, plan.example_symvals)
    try:
        sep_bytes = separate_bytes(plan, need, make_plan)
    except NotImplementedError:
        sep_bytes = None
    sizes = f"{joint_bytes / 1e6:.3g} MB vs {sep_bytes / 1e6:.3g} MB" if sep_bytes else f"{joint_bytes / 1e6:.3g} MB"
    if sep_bytes is not None and joint_bytes >= sep_bytes:
        info[key] = f"no: forward + backward in one graph would move {sizes} at the example sizes"
        return None
    executor = owner._kbench_executor.fresh()
    executor.prepare(jplan, owner._kbench_device)
    eager = [r.index for r in jplan.regions if r.kind != "EXTERN" and not executor.can_run(r.index)]
    if eager:
        info[key] = f"no: region(s) {eager} of the joint graph stay eager ({jplan.regions[eager[0]].status_text})"
        return None
    program = Program(jplan, executor, owner._note)
    why, unused = check(plan, program, need, executor)
    if why:
        info[key] = f"no (gradient check failed: {why})"
        owner._note(f"loss gradients in the forward: gradient check failed: {why}")
        return None
    # where the backend times its kernels, the choice is made on time, for the worst upstream
    # gradient (not 1: a loss scale, 1/accumulation steps, costs the scaling pass), so that no
    # call is slower than the forward and each region's backward: fewer bytes need not mean
    # faster (a 32k-class row's second pass re-reads it from memory, not from L2)
    joint_ms = kernels_ms([jplan])
    separate_ms = scale_ms = None
    if joint_ms is not None:
        backwards = [owner._backward_program(i.index, wrt) for i, wrt in region_wants(plan, need)]
        separate_ms = kernels_ms([plan] + [b.plan for b in backwards if b is not None])
        if any(b is None for b in backwards):
            separate_ms = None      # a backward in eager autograd: not timed, the joint graph wins
        metas = [(torch.Size(jplan.graph.sizes(v, plan.example_symvals)), torch_dtype(jplan.nodes[v]["dtype"]))
                 for v in jplan.graph.outputs[1:]]
        scale_ms = executor.scale_ms(metas) or 0.0
    if separate_ms is not None:
        sizes += (f"; kernels {joint_ms:.3g} ms, +{scale_ms:.3g} ms to scale for an upstream gradient "
                  f"other than 1, vs {separate_ms:.3g} ms")
        if joint_ms + scale_ms > JOINT_SLACK * separate_ms:
            info[key] = f"no: the forward and each region's backward are faster ({sizes})"
            return None
    info[key] = (f"yes: {len(jplan.regions)} kernel(s) {'/'.join(r.kind for r in jplan.regions)} compute the loss "
                 f"and its gradients in the forward ({sizes}, forward + backward)")
    return Joint(owner, program, need, unused)


def check(plan, program, need, executor, seed=0):
    """(why not or '', unused): at the sweep sizes no larger than the example, the loss and the
    gradients (scaled by a random upstream gradient) match torch autograd of the float64
    recomputation, and inputs torch gives no gradient get zeros."""
    example = plan.example_symvals
    points = [sv for sv in verify.sweep_symvals(example)
              if all(a <= b for a, b in zip(sv, example)) and plan.admits(sv)]
    device = getattr(executor, "device", torch.device("cpu"))
    unused = None
    for n, sv in enumerate(points):
        gen = torch.Generator().manual_seed(seed + 104729 + n)
        inputs = graph_inputs(plan, sv, gen, device)
        if torch_eval.may_kink(plan.graph):
            # nowhere an op's derivative jumps: there the gradient is a convention (torch_eval)
            kgen = torch.Generator(device=device).manual_seed(gen.initial_seed() + 1)
            inputs = torch_eval.away_from_kinks(
                lambda xs, kinks: torch_eval.evaluate(plan.graph, plan, dict(zip(plan.graph.inputs, xs)), sv,
                                                      dtype=torch.float64, device=plan.device, kinks=kinks),
                inputs, lambda i, x: verify.fill(torch.empty_like(x), "normal", kgen))
        loss_dtype = torch_dtype(plan.nodes[plan.graph.outputs[0]]["dtype"])
        shape = plan.graph.sizes(plan.graph.outputs[0], sv)
        grad_out = (torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5).to(loss_dtype).to(device)
        ref_loss, ref = eager_grads(plan, sv, inputs, need, grad_out, dtype=torch.float64)
        outs = program.run(sv, dict(zip(program.plan.graph.inputs, inputs)))
        executor.scale(outs[1:], grad_out)
        ok, _, why = verify.compare(outs[0], ref_loss.detach(), plan.precision())
        if not ok:
            return f"loss at sizes {sv}: {why}", None
        ref = [r for r, wanted in zip(ref, need) if wanted]
        why, point_unused = verify.compare_grads(outs[1:], ref, sv, program.plan.precision())
        if why:   # no worse than torch's own ops on these inputs (verify.BASELINE_FACTOR)
            own = [g for g, wanted in zip(eager_grads(plan, sv, inputs, need, grad_out)[1], need) if wanted]
            why, point_unused = verify.compare_grads(outs[1:], ref, sv, program.plan.precision(),
                                                      baseline=own)
        if why:
            return why, None
        unused = point_unused if unused is None else unused & point_unused
    return "", unused or set()
