"""Autograd for an optimized module: each compute region is one node (RegionFunction here, or
kbench._fast.Region in C++) whose backward is the region's own generated backward program —
the vector-Jacobian product built by csrc/grad/, partitioned and prepared by the same backend,
checked against torch.autograd before it is trusted — or, where autodiff cannot handle the
region, torch.autograd through the region's recomputation (the report says which)."""
from __future__ import annotations

import torch

from .. import verify
from ..dtypes import torch_dtype
from . import fast, torch_eval
from .plan import KERNEL, Plan, Program


class RegionFunction(torch.autograd.Function):
    """One compute region as an autograd node: forward through the backend; backward through the
    region's generated backward program (or, where there is none, torch's recomputation)."""

    @staticmethod
    def forward(ctx, step, *inputs):
        outs, ctx.checked = step.run_kernel(inputs)
        ctx.step = step
        # the outputs its backward reads are saved as torch saves a node's outputs (no cycle, and
        # changed in place after this they fail the backward, as eager's would)
        ctx.save_for_backward(*inputs, *[outs[k] for k in step.saved_outputs])
        ns = step.nsaved
        if ns:
            # the row statistics are the node's own (the backward reads them instead of reducing
            # the rows again), not outputs: no autograd bookkeeping for them, and the caller's
            # slots get None in their place (nothing in the forward reads them)
            ctx.stats = outs[len(outs) - ns:]
            outs = outs[:len(outs) - ns]
        if step.int_outs:
            ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        step = ctx.step
        need = tuple(a and b for a, b in zip(ctx.needs_input_grad[1:], step.float_in))
        saved, nin = ctx.saved_tensors, len(step.ins)
        if step.nsaved:  # the backward's order: inputs, statistics, outputs read
            saved = saved[:nin] + tuple(ctx.stats) + saved[nin:]
        return (None,) + tuple(step.owner._region_backward(step, saved, grads, need, ctx.checked))


def _fast_apply():
    """RegionFunction.apply without the Python wrapper's per-call work (binding default
    arguments, unwrapping dead functorch wrappers), which only matters under functorch
    transforms: those take the full path."""
    raw = getattr(torch._C, "_FunctionBase", None)
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if raw is None or active is None or "apply" not in vars(raw):
        return RegionFunction.apply
    direct = vars(raw)["apply"].__get__(None, RegionFunction)
    full = RegionFunction.apply
    return lambda *args: full(*args) if active() else direct(*args)


apply_region = _fast_apply()


class RegionBackward:
    """OptimizedModule's backward half (a mixin: the state it reads, _kbench_plan, _kbench_executor,
    _kbench_backward and the rest, is the module's)."""

    def _fast_region(self, step):
        """The step as a kbench._fast.Region (its autograd node in C++), where its launches are
        kbench._fast's; else None and RegionFunction (Python) is the node."""
        launch = fast.launch_of(step.launch)
        if launch is None:
            return None
        nograd = fast.launch_of(step.launch_nograd)

        def backward(saved, grads, need):
            return self._fast_backward(step, saved, grads, need)
        nreal = len(step.out_meta) - step.nsaved
        return fast.module().Region(launch, nograd, step.float_in, step.nsaved, step.out_meta[:nreal], backward,
                            step.saved_outputs)

    def _fast_backward(self, step, saved, grads, need):
        """The C++ node's backward where it has no program of its own for `need` (or create_graph,
        or a launch refused an input): the Python backward, and then, if that is all generated
        kernels, the program handed to the node, which runs it from C++ from the next call on."""
        got = self._region_backward(step, saved, grads, need, True)
        bwd = step.backward.get((need, True))
        if bwd and not torch.is_grad_enabled():
            steps = []
            for s in bwd.steps:
                launch = fast.launch_of(s.launch_nograd or s.launch) if s.kind == KERNEL else None
                if launch is None:
                    return got
                steps.append((launch, s.ins))
            unused, drop, k = self._kbench_unused_grads.get((step.r, need), ()), [], -1
            for n in need:
                k += bool(n)
                drop.append(bool(n) and k in unused)
            step.fast.set_backward(need, steps, bwd.outputs, drop)
        return got

    def _backward_program(self, r, need):
        """The generated backward of region r for the inputs flagged in need (cached), or None
        where autodiff cannot handle the region (the caller recomputes through torch)."""
        key = (r, need)
        if key in self._kbench_backward:
            return self._kbench_backward[key]
        plan, info = self._kbench_plan, self._kbench_plan.regions[r]
        prog = None
        try:
            graph = plan.partition.region_graph(r).grad(list(need), saved=info.saved, outputs=info.saved_outputs)
            bplan = Plan(graph, (), plan.example_symvals, None, plan.guards)
            first_out = len(info.inputs) + info.saved
            bplan.stat_inputs = set(graph.inputs[len(info.inputs):first_out])
            bplan.output_inputs = dict(zip(graph.inputs[first_out:first_out + len(info.saved_outputs)],
                                           info.saved_outputs))
            fwd = self._kbench_executor
            bplan.forward_outputs = lambda sv, dist, gen: plan.eager_region(r, sv, fwd.region_inputs(r, sv, dist, gen))
            executor = self._kbench_executor.fresh()
            executor.prepare(bplan, self._kbench_device)
            prog = Program(bplan, executor, self._note)
            kinds = sorted({x.kind for x in bplan.regions})
            info.backward = f"{executor.name}: {len(bplan.regions)} region(s) {'/'.join(kinds)}"
            info.extra.setdefault("backward_genomes", {})["".join("1" if n else "0" for n in need)] = \
                [f"{x.kind} {x.genome or x.status_text}" for x in bplan.regions]
        except NotImplementedError as e:
            info.backward = f"eager (autodiff: {str(e).splitlines()[0][:80]})"
        self._kbench_backward[key] = prog
        if prog is not None:
            # identical regions (a repeated block) with the same backward kernels check the same
            memo_key = (plan.region_text(r), need, tuple(x.genome or x.status_text for x in prog.plan.regions))
            memo = self._kbench_grad_checks.get(memo_key)
            if memo is None:
                try:
                    why, checked = self._check_backward(r, need)
                except torch.cuda.OutOfMemoryError as e:   # unchecked is untrusted: the backward runs in torch
                    torch.cuda.empty_cache()
                    why, checked = f"out of GPU memory ({str(e).splitlines()[0][:120]})", 0
                except BaseException:
                    # a check that raised (inside a caller's CUDA-graph capture, say) leaves nothing
                    # trusted behind: the next backward builds and checks it again
                    del self._kbench_backward[key]
                    raise
                memo = self._kbench_grad_checks[memo_key] = (why, checked, self._kbench_unused_grads.get((r, need)))
            why, checked, unused = memo
            if not why:
                self._kbench_unused_grads[(r, need)] = unused
            if why:
                self._kbench_backward[key] = prog = None
                info.backward = f"eager (gradient check failed: {why})"
                self._note(f"region {r}: backward runs in eager PyTorch (gradient check failed: {why})")
            else:
                info.backward += f", gradients match torch.autograd at {checked} size(s)"
        return prog

    def _check_backward(self, r, need, seed=0):
        """Before a generated backward is trusted: at the forward's sweep sizes that are no larger
        than the example, with random inputs (none on a point where an op's derivative jumps:
        torch_eval.away_from_kinks) and a random upstream gradient, every gradient it gives must
        match torch.autograd of the region's float64 recomputation, and the same
        inputs must get gradients (an input autograd leaves at None gets None). Returns
        (why not or "", sizes checked)."""
        plan, info = self._kbench_plan, self._kbench_plan.regions[r]
        example = plan.example_symvals
        points = [sv for sv in verify.sweep_symvals(example)
                  if all(a <= b for a, b in zip(sv, example)) and plan.admits(sv)]
        unused = None
        for n, sv in enumerate(points):
            gen = torch.Generator().manual_seed(seed + 7919 * (r + 1) + n)
            ins = self._kbench_executor.region_inputs(r, sv, "normal", gen)
            device = ins[0].device if ins else self._kbench_device
            if torch_eval.may_kink(plan.graph, info.nodes):
                # nowhere an op's derivative jumps: there the gradient is a convention (torch_eval)
                kgen = torch.Generator(device=device).manual_seed(gen.initial_seed() + 1)
                ins = torch_eval.away_from_kinks(
                    lambda xs, kinks: plan.eager_region(r, sv, xs, dtype=torch.float64, kinks=kinks), ins,
                    lambda i, x: verify.fill(torch.empty_like(x), "normal", kgen))
            real = info.outputs[:len(info.outputs) - info.saved]
            metas = [(torch.Size(plan.graph.sizes(v, sv)), torch_dtype(plan.nodes[v]["dtype"])) for v in real]
            # the statistics and the outputs the backward reads as the forward (its kernel, where it
            # runs) writes them
            stats = []
            if info.saved or info.saved_outputs:
                fwd = self._kbench_program.run_region(r, sv, ins)
                stats = list(fwd[len(real):]) + [fwd[k] for k in info.saved_outputs]
            # drawn where they are used: a CPU float64 draw of a large gradient costs seconds
            dgen = torch.Generator(device=device).manual_seed(gen.initial_seed())
            grads = [torch.randn(shape, generator=dgen, dtype=torch.float64, device=device).to(dt)
                     if dt.is_floating_point else None for shape, dt in metas]
            ref = self._eager_backward(r, sv, ins, grads, need, dtype=torch.float64)
            got = self._run_backward(self._kbench_backward[(r, need)], sv, ins, grads, need, metas, stats)
            ref, got = [g for g, k in zip(ref, need) if k], [g for g, k in zip(got, need) if k]
            reduction = plan.reduction(r, sv, backward=True)
            why, point_unused = verify.compare_grads(got, ref, sv, plan.precision(r), reduction)
            if why:   # no worse than torch's own ops on these inputs (verify.BASELINE_FACTOR)
                own = self._eager_backward(r, sv, ins, grads, need)
                why, point_unused = verify.compare_grads(got, ref, sv, plan.precision(r), reduction,
                                                         baseline=[g for g, k in zip(own, need) if k])
            if why:
                return why, n
            unused = point_unused if unused is None else unused & point_unused
        self._kbench_unused_grads[(r, need)] = unused or set()
        return "", len(points)

    def _region_backward(self, step, saved, grads, need, checked=False):
        """saved: the region's inputs, its row statistics (step.nsaved), the outputs its backward
        reads (step.saved_outputs). checked: the forward's kernel ran on these inputs, so they are
        contiguous (and the upstream gradients are made so here): the backward's kernels need not
        check again."""
        inputs, stats = saved[:len(step.ins)], saved[len(step.ins):]
        nreal = len(step.out_meta) - step.nsaved
        grads = grads[:nreal]
        if not any(need):
            return [None] * len(inputs)
        r, symvals = step.r, step.symvals
        if torch.is_grad_enabled():  # create_graph=True: the gradients must be differentiable
            return self._eager_backward(r, symvals, inputs, grads, need, create_graph=True)
        bwd = step.backward.get((need, checked))
        if bwd is None:
            prog = self._backward_program(r, need)
            trusted = range(len(inputs) + len(stats) + len(grads)) if checked else ()
            bwd = step.backward[(need, checked)] = prog.bind(symvals, trusted) if prog is not None else False
        if bwd is False:
            return self._eager_backward(r, symvals, inputs, grads, need)
        slots = [*inputs, *stats]
        for g, (shape, dtype) in zip(grads, step.out_meta):
            slots.append(torch.zeros(shape, dtype=dtype, device=inputs[0].device) if g is None
                         else g if g.is_contiguous() else g.contiguous())
        outs = iter(bwd.run(slots))
        got = [next(outs) if n else None for n in need]
        unused = self._kbench_unused_grads.get((r, need), ())
        if unused:  # as torch.autograd: an input the outputs do not depend on gets no gradient
            k = -1
            for i, n in enumerate(need):
                k += bool(n)
                if n and k in unused:
                    got[i] = None
        return got

    def _run_backward(self, prog, symvals, inputs, grads, need, out_meta, stats=()):
        grads = [g if g is not None else torch.zeros(s, dtype=d, device=inputs[0].device)
                 for g, (s, d) in zip(grads, out_meta)]
        graph = prog.plan.graph
        values = dict(zip(graph.inputs, [*inputs, *stats, *[g.contiguous() for g in grads]]))
        outs = iter(prog.run(symvals, values))
        result = []
        for x, n in zip(inputs, need):
            result.append(next(outs) if n else None)
        return result

    def _eager_backward(self, r, symvals, inputs, grads, need, dtype=None, create_graph=False):
        """torch.autograd through the region's torch recomputation (dtype=torch.float64: the
        reference the generated backward is checked against): a gradient or None per input.
        create_graph: the gradients stay attached to the inputs (double backward)."""
        plan = self._kbench_plan
        return torch_eval.autograd_of(lambda xs: plan.eager_region(r, symvals, xs, dtype=dtype), inputs, need,
                                      grads, dtype=dtype, create_graph=create_graph)[1]
