"""No silent limits on a region's inputs and outputs: a region of any width optimizes, runs and
differentiates like eager, its kernel stores every output it declares, and the partitioner splits
what a kernel's 4 KB of parameters (KB_MAX_PARAM_BYTES) could not take."""
import re

import torch

import kbench
from kbench import _C
from kbench.runtime import interp

from test_names import kernels_of, signature

N = 70
PARAM_BYTES = 4096   # csrc/core/kbench.h, KB_MAX_PARAM_BYTES


class Wide(torch.nn.Module):
    """70 inputs summed, the sum centred on its mean, then scaled by each of 70 parameters and
    returned: one ROW region of 140 inputs and 70 outputs (and a saved mean). The inputs are 1-D:
    torch.export's work grows with the dims it keeps symbolic."""

    def __init__(self):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(8)) for _ in range(N)])

    def forward(self, *xs):
        s = xs[0]
        for x in xs[1:]:
            s = s + x
        c = s - s.mean(-1, keepdim=True)
        return tuple(c * p for p in self.ps)


def stores(src, name):
    """Does src store into the kernel parameter called name (element by element or a vector)?"""
    return re.search(rf"\b{name}\[[^\]]*\] = |kb_st<[^>]*>\({name} \+", src) is not None


def test_seventy_inputs_and_outputs(compile_once):
    torch.manual_seed(0)
    model = Wide()
    xs = tuple(torch.randn(8, requires_grad=True) for _ in range(N))
    om = kbench.optimize(model, xs, backend="interp", verbose=False)
    ys, refs = om(*xs), model(*xs)
    assert len(ys) == N
    for y, ref in zip(ys, refs):
        torch.testing.assert_close(y, ref)
    gys = [torch.randn_like(r) for r in refs]
    wrt = [*xs, *model.parameters()]
    for a, b in zip(torch.autograd.grad(ys, wrt, gys), torch.autograd.grad(refs, wrt, gys)):
        torch.testing.assert_close(a, b)
    part = om._kbench_plan.partition
    wide = [part.region(r) for r in range(len(part))]
    assert len(part) == 1 and wide[0]["kind"] == "ROW", wide
    nin, nout = len(wide[0]["inputs"]), len(wide[0]["outputs"])
    assert nin == 2 * N and nout >= N
    # the default schedule, and one that NVRTC compiles in a fifth of the time (no unrolled vectors)
    for genome in (None, _C.Genome.parse("threads=32 vec=1 rows=1 items=1 cache=regs")):
        k = _C.generate(part, 0, 90, genome)
        outs = signature(k.source)[nin:nin + nout]
        assert len(outs) == nout and all(stores(k.source, o) for o in outs), \
            [o for o in outs if not stores(k.source, o)]
    cubin, = compile_once([(k.source, "sm_90", "the 70-output region")])
    assert kernels_of(cubin) == sorted([k.name] + [k.name + "_nostats"] * k.nostats)


def region_bytes(g, part, r):
    d = part.region(r)
    return 8 * (len(d["inputs"]) + len(d["outputs"]) + len(g.symbols) + 1)


def run_regions(g, part, inputs):
    """The partition run region by region on the interpreter: {value id: tensor}."""
    vals = dict(zip(g.inputs, inputs))
    for r in range(len(part)):
        d = part.region(r)
        vals.update(zip(d["outputs"], interp.run_region(part, r, [], [vals[v] for v in d["inputs"]])))
    return vals


def test_partition_splits_past_the_parameter_space():
    """600 inputs summed; 300 parameters each scaling an input and returned; 600 parameters summed
    (work on parameters alone floats into its reader) and scaling an input: each would be one
    region whose kernel takes more than 4 KB of parameters. Each is split into regions that fit,
    and they compute the same."""
    torch.manual_seed(0)
    cases = []
    g = _C.Graph()
    xs = [g.add_input(f"x{i}", "user", "f32", [4]) for i in range(600)]
    y = xs[0]
    for x in xs[1:]:
        y = g.add_node("add", [y, x], "f32", [4])
    g.add_output(y)
    cases.append((g, lambda t: [sum(t)]))
    g = _C.Graph()
    x = g.add_input("x", "user", "f32", [4])
    ps = [g.add_input(f"p{i}", "param", "f32", [4]) for i in range(300)]
    for p in ps:
        g.add_output(g.add_node("mul", [x, p], "f32", [4]))
    cases.append((g, lambda t: [t[0] * p for p in t[1:]]))
    g = _C.Graph()
    x = g.add_input("x", "user", "f32", [4])
    ps = [g.add_input(f"p{i}", "param", "f32", [4]) for i in range(600)]
    y = ps[0]
    for p in ps[1:]:
        y = g.add_node("add", [y, p], "f32", [4])
    g.add_output(g.add_node("mul", [x, y], "f32", [4]))
    cases.append((g, lambda t: [t[0] * sum(t[1:])]))
    for g, expect in cases:
        part = g.partition()
        assert len(part) > 1
        assert all(region_bytes(g, part, r) <= PARAM_BYTES for r in range(len(part))), \
            [region_bytes(g, part, r) for r in range(len(part))]
        inputs = [torch.randn(4, dtype=torch.float64).float() for _ in g.inputs]
        vals = run_regions(g, part, inputs)
        for v, want in zip(g.outputs, expect(inputs)):
            torch.testing.assert_close(vals[v], want, rtol=1e-5, atol=1e-4)


def test_saved_statistics_stay_within_the_parameter_space():
    """A ROW region (a LayerNorm's statistics, then 254 scaled copies) that just fits: the
    statistics saved for its backward are outputs too, and are kept only as far as they fit."""
    g = _C.Graph()
    g.add_symbol("s0", 8)
    full, keep = [(1, (0,)), 64], [(1, (0,)), 1]
    x = g.add_input("x", "user", "f32", full)
    ps = [g.add_input(f"p{i}", "param", "f32", [64]) for i in range(254)]
    mean = g.add_node("mean", [x], "f32", keep, axes=2)
    xc = g.add_node("sub", [x, g.add_node("expand", [mean], "f32", full)], "f32", full)
    var = g.add_node("mean", [g.add_node("mul", [xc, xc], "f32", full)], "f32", keep, axes=2)
    eps = g.add_node("const", [], "f32", keep, scalars=(1e-5, 0.0))
    rstd = g.add_node("rsqrt", [g.add_node("add", [var, eps], "f32", keep)], "f32", keep)
    y = g.add_node("mul", [xc, g.add_node("expand", [rstd], "f32", full)], "f32", full)
    for p in ps:
        pe = g.add_node("expand", [g.add_node("reshape", [p], "f32", [1, 64])], "f32", full)
        g.add_output(g.add_node("mul", [y, pe], "f32", full))
    part = g.partition()
    assert len(part) == 1 and region_bytes(g, part, 0) == 4088
    part.save_stats(0)
    assert part.region(0)["saved"] == 1 and region_bytes(g, part, 0) == PARAM_BYTES


def test_backward_of_seventy_parameters_generates():
    """x * p_i for 70 parameters p_i: the backward sums 70 parameter gradients over the rows, as
    column sums of row kernels. A row kernel carries at most 16 (a register partial each): the
    partitioner spreads them over regions, and every region's kernel generates, storing every
    output."""
    g = _C.Graph()
    g.add_symbol("s0", 4)
    rows = [(1, (0,)), 8]
    x = g.add_input("x", "user", "f32", rows)
    for i in range(N):
        p = g.add_input(f"p{i}", "param", "f32", [8])
        pe = g.add_node("expand", [g.add_node("reshape", [p], "f32", [1, 8])], "f32", rows)
        g.add_output(g.add_node("mul", [x, pe], "f32", rows))
    bwd = g.grad([True] * (N + 1))
    part = bwd.partition()
    written = set()
    for r in range(len(part)):
        d = part.region(r)
        k = _C.generate(part, r, 90, None)
        outs = signature(k.source)[len(d["inputs"]):len(d["inputs"]) + len(d["outputs"])]
        assert all(stores(k.source, o) for o in outs), (r, outs)
        written |= set(d["outputs"])
    assert set(bwd.outputs) <= written


def test_grad_of_any_number_of_inputs():
    """A graph's gradient with respect to 300 inputs (a model's parameters, for the joint loss
    program): one flag per input, however many."""
    g = _C.Graph()
    xs = [g.add_input(f"x{i}", "param", "f32", [4]) for i in range(300)]
    y = xs[0]
    for x in xs[1:]:
        y = g.add_node("add", [y, g.add_node("mul", [x, x], "f32", [4])], "f32", [4])
    g.add_output(y)
    bwd = g.grad([True] * 300)
    assert len(bwd.outputs) == 300
    assert len(g.grad([True] * 300, joint=True).outputs) == 301
