"""Rows split over blocks on the GPU (row_split, csrc/codegen/kernel.c): at few long rows the
default genome splits each row, and its two kernels (partials per part, then the merge and each
part's outputs) give the float64 reference's values within float32 tolerance at 8 x 2^20,
1 x 2^24 and an odd 3 x 1_000_003, the same bits run after run; softmax's merged (max, sum) pairs
keep torch's NaN and infinities; optimize() of a LayerNorm over (32, 128, 256) at batch 8 runs its
forward split and matches eager forward and backward."""
import math
import os
import sys

import pytest
import torch

import kbench
from kbench import _C, api
from kbench.runtime import nvrtc as nv
from kbench.runtime.interp import run_region
from kbench.verify import poison_like

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from test_codegen import DT, Builder, assert_close, launch, special_rows  # noqa: E402
from test_row_split import NormAndSquares, ln_graph, rms_graph, softmax_graph  # noqa: E402

pytestmark = pytest.mark.gpu

SIZES = [(8, 1 << 20), (1, 1 << 24), (3, 1_000_003)]


def norm_and_squares(n):
    """x / x.norm() and x.pow(2).sum() as kbench captures them (both dims vary: the sizes are
    the symbols' values)."""
    with torch.no_grad():
        return api._fresh_capture(NormAndSquares(), (torch.randn(4, 64),), "cuda").graph


# op -> (its graph at rows of n, whether the forward saves its statistics for a backward)
OPS = {
    "layernorm_f32": (lambda n: ln_graph("f32", n), False),     # y, mean and rstd as per-row outputs
    "layernorm_bf16": (lambda n: ln_graph("bf16", n), False),
    "layernorm_saved": (lambda n: ln_graph("f32", n, stats=False), True),   # mean, rstd saved
    "rms_norm": (lambda n: rms_graph("f32", n), False),
    "softmax": (lambda n: softmax_graph("f32", n), False),
    "norm_and_sum": (norm_and_squares, False),
}


class Split:
    """Region r's kernel on this GPU, loaded (main and finishing entry): the default genome at
    these sizes, with the genes in `replace` changed."""

    def __init__(self, p, r, symvals, **replace):
        self.cuda = _C.cuda_open()
        dev = _C.device_info(self.cuda, torch.cuda.current_device())
        self.genome = _C.genome_default(p, r, symvals, dev).replace(**replace)
        self.k = _C.generate(p, r, dev["sm"], self.genome, dev)
        self.module = _C.module_load(self.cuda, nv.compile(self.k.source, f"sm_{dev['sm']}"))  # kept: its functions
        self.fn = _C.get_function(self.cuda, self.module, self.k.name, self.k.smem)[0]
        self.finish = _C.get_function(self.cuda, self.module, self.k.finish_name, 0)[0] if self.k.finish_name else None

    def __call__(self, symvals, ins, shapes):
        outs = [poison_like(s, d, "cuda") for s, d in shapes]
        launch(self.cuda, self.k, self.fn, self.finish, symvals, ins, outs)
        return outs


def inputs_of(g, p, r, symvals, gen):
    """The region's inputs: rows of spread 2 about a ramp from 1 to 5 along the row (a variance
    from a difference of large sums, or parts merged as if their means were the row's, would
    show), parameters about 1."""
    out = []
    for v in p.region(r)["inputs"]:
        nd = g.node(v)
        x = torch.randn(g.sizes(v, symvals), generator=gen, dtype=torch.float64)
        if nd["input_kind"] == "user":
            x = x * 2 + torch.linspace(1.0, 5.0, x.shape[-1], dtype=torch.float64)
        out.append(x.to(DT[nd["dtype"]]))
    return out


@pytest.mark.parametrize("rows,n", SIZES, ids=["8x2^20", "1x2^24", "3x1000003"])
@pytest.mark.parametrize("op", list(OPS))
def test_split_kernel_matches_the_reference(op, rows, n):
    build, saved = OPS[op]
    g = build(n)
    p = g.partition()
    if saved:
        p.save_stats(0)
        assert p.region(0)["saved"] == 2
    symvals = [rows, n] if op == "norm_and_sum" else [rows]
    r = 0
    assert p.region(r)["kind"] == "ROW"
    split = Split(p, r, symvals)
    assert split.genome.row_split > 1 and split.k.nkernels == 2, split.genome
    ins = inputs_of(g, p, r, symvals, torch.Generator().manual_seed(0))
    want = run_region(p, r, symvals, ins)     # the interpreter: float64, rounded where torch rounds
    shapes = [(tuple(w.shape), w.dtype) for w in want]
    got = split(symvals, [x.cuda() for x in ins], shapes)
    again = split(symvals, [x.cuda() for x in ins], shapes)
    for j, (o, a, w) in enumerate(zip(got, again, want)):
        what = f"{op} at {rows}x{n} [{split.genome}] output {j}"
        assert not o.isnan().any(), f"{what}: unwritten or NaN"
        assert torch.equal(o, a), f"{what}: another run gave other bits"
        assert_close(o.cpu(), w, what)


def softmax_parts(n):
    """exp(x - max), softmax and log-softmax of rows of n: every consumer of the online pair."""
    b = Builder(s0=9)
    x = b.input("x", "f32", ["s0", n])
    full, keep = ["s0", n], ["s0", 1]
    m = b.op("expand", [b.op("max", [x], "f32", keep, axes=2)], "f32", full)
    d = b.op("sub", [x, m], "f32", full)
    e = b.op("exp", [d], "f32", full)
    s = b.op("sum", [e], "f32", keep, axes=2)
    b.g.add_output(e)
    b.g.add_output(b.op("div", [e, b.op("expand", [s], "f32", full)], "f32", full))
    b.g.add_output(b.op("sub", [d, b.op("expand", [b.op("log", [s], "f32", keep)], "f32", full)], "f32", full))
    return b.g


@pytest.mark.parametrize("cache", ["default", "regs"])
def test_split_online_pairs_keep_special_values(cache):
    """Rows of -inf (whole parts of them), +inf, NaN and underflow, split over blocks: the parts'
    (max, sum of exp) pairs merge to torch's values, NaN and infinities where torch has them."""
    n = 1 << 16
    g = softmax_parts(n)
    p = g.partition()
    x = special_rows(n, torch.Generator().manual_seed(3))
    x[2, : n // 2] = -math.inf               # the first parts all -inf, the row's max in a later one
    x = x.float()
    split = Split(p, 0, [9], **({"cache": "regs", "threads": 1024, "items": 1} if cache == "regs" else {}))
    assert split.genome.row_split > 1, split.genome
    xr = x.double()
    m = xr.max(dim=-1, keepdim=True).values
    e = torch.exp(xr - m)
    s = e.sum(-1, keepdim=True)
    wants = [e, e / s, xr - m - torch.log(s)]
    outs = split([9], [x.cuda()], [((9, n), torch.float32)] * 3)
    for j, (o, w) in enumerate(zip(outs, wants)):
        o, w = o.cpu().double(), w.float().double()
        what = f"[{split.genome}] output {j}"
        assert torch.equal(o.isnan(), w.isnan()), f"{what}: NaN at other places"
        inf = w.isinf()
        assert torch.equal(o.isinf(), inf) and torch.equal(o[inf], w[inf]), f"{what}: infinities differ"
        for i in range(9):
            ok = w[i].isfinite()
            assert_close(o[i][ok].float(), w[i][ok].float(), f"{what} row {i}")


def test_optimize_layernorm_of_few_long_rows_forward_and_backward():
    """LayerNorm over (32, 128, 256) at batch 8: 8 rows of 1M. optimize() gives its forward the
    split default (verified over its size sweep), and forward and backward match eager in
    float64."""
    torch.manual_seed(0)
    model = torch.nn.LayerNorm((32, 128, 256)).cuda()
    with torch.no_grad():
        model.weight.copy_(torch.randn_like(model.weight))
        model.bias.copy_(torch.randn_like(model.bias))
    x = torch.randn(8, 32, 128, 256, device="cuda") * 2 + 3
    fast = kbench.optimize(model, (x,), budget="none", verbose=False)
    info = fast._kbench_plan.regions[0]
    assert info.status.kernel and "row_split=" in info.genome, (info.genome, info.status_text)
    ref = torch.nn.LayerNorm((32, 128, 256)).double().cuda()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert_close(fast(x).cpu(), ref(x.double()).float().cpu(), "forward")
    xs, xr = x.clone().requires_grad_(True), x.double().requires_grad_(True)
    gy = torch.randn_like(x)
    got = torch.autograd.grad(fast(xs), [xs, *fast.parameters()], gy)
    want = torch.autograd.grad(ref(xr), [xr, *ref.parameters()], gy.double())
    for name, h, w in zip(("x", "weight", "bias"), got, want):
        rel = ((h.double() - w).abs().max() / w.abs().max()).item()
        assert rel <= 1e-4, f"d{name}: relative error {rel:.3g}"
