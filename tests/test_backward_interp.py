"""The backward contract on the CPU (interp backend): torch.autograd.gradcheck on small f64
cases; retain_graph and a second backward; no_grad; inputs that need no gradient; gradients
accumulating into the original parameters' .grad; an input read by several regions; and the
region backward running the generated backward program, not eager autograd."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kbench
from kbench.runtime.interp import run_graph


class Mixed(nn.Module):
    """x feeds a LayerNorm region and a softmax region; a bias is shared by both branches."""

    def __init__(self, h=6):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.b = nn.Parameter(torch.randn(h))

    def forward(self, x):
        return F.gelu(self.ln(x) + self.b) * torch.softmax(x + self.b, dim=-1)


class CE(nn.Module):
    def __init__(self, v=7):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(v))

    def forward(self, x, t):
        return F.cross_entropy(x * self.scale, t)


class Swiglu(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b


CASES = [
    ("mixed", Mixed, lambda: (torch.randn(3, 6, dtype=torch.float64, requires_grad=True),)),
    ("cross_entropy", CE, lambda: (torch.randn(4, 7, dtype=torch.float64, requires_grad=True),
                                   torch.randint(0, 7, (4,)))),
    ("swiglu", Swiglu, lambda: (torch.randn(3, 8, dtype=torch.float64, requires_grad=True),)),
]


@pytest.mark.parametrize("name,factory,inputs", CASES, ids=[c[0] for c in CASES])
def test_gradcheck(name, factory, inputs):
    model = factory().double()
    args = inputs()
    # the per-region backward programs (a loss's joint forward+backward: tests/test_joint.py)
    fast = kbench.optimize(model, tuple(a.detach() for a in args), backend="interp", grad_in_forward=False)
    assert torch.autograd.gradcheck(lambda *xs: fast(*xs), args, eps=1e-6, atol=1e-7)
    # the regions' backward ran as generated backward programs (interp), not eager autograd
    notes = [info.backward for info in fast._kbench_plan.regions if info.backward]
    assert notes and all(n.startswith("interp") for n in notes), notes
    assert "saved for backward: each region's inputs, and the row statistics" in str(fast.kbench_report)
    assert not fast._kbench_reasons


def test_retain_graph_second_backward_and_accumulation():
    torch.manual_seed(0)
    model = Mixed().double()
    x = torch.randn(5, 6, dtype=torch.float64)
    fast = kbench.optimize(model, (x,), backend="interp")
    ref = Mixed().double()
    ref.load_state_dict(model.state_dict())
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = fast(xa), ref(xb)
    g = torch.randn_like(ya)
    for _ in range(2):                         # twice through the same graph
        ya.backward(g, retain_graph=True)
        yb.backward(g, retain_graph=True)
    for p, q in zip(model.parameters(), ref.parameters()):   # accumulated into the original's .grad
        assert p.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-9, atol=1e-12)
    assert torch.allclose(xa.grad, xb.grad, rtol=1e-9, atol=1e-12)


def test_no_grad_and_inputs_without_grad():
    model = Mixed().double()
    x = torch.randn(4, 6, dtype=torch.float64)
    fast = kbench.optimize(model, (x,), backend="interp")
    with torch.no_grad():
        y = fast(x)
    assert not y.requires_grad and y.grad_fn is None
    # x needs no gradient, the parameters do: only they receive one
    model.zero_grad()
    fast(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    # nothing needs a gradient: no graph is built
    for p in model.parameters():
        p.requires_grad_(False)
    assert fast(x).grad_fn is None


def test_wrong_gradient_shape_raises_like_torch():
    model = Mixed().double()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    fast = kbench.optimize(model, (x.detach(),), backend="interp")
    y = fast(x)
    with pytest.raises(RuntimeError):
        y.backward(torch.ones(3, 3, dtype=torch.float64))


def test_backward_checked_against_autograd_before_use():
    torch.manual_seed(0)
    model = Mixed()
    x = torch.randn(5, 6, requires_grad=True)
    opt = kbench.optimize(model, (x,), backend="interp")
    opt(x).sum().backward()
    report = str(opt.kbench_report)
    assert "gradients match torch.autograd at" in report, report
    assert not opt._kbench_reasons


def test_backward_failing_its_check_runs_eager(monkeypatch):
    """A generated backward that gives a wrong gradient is never used: the region's backward is
    eager autograd (with a one-time reason) and the gradients are still right."""
    torch.manual_seed(0)
    model = CE()
    x, t = torch.randn(4, 7, requires_grad=True), torch.randint(0, 7, (4,))
    ref_model = CE()
    ref_model.load_state_dict(model.state_dict())
    opt = kbench.optimize(model, (x, t), backend="interp", grad_in_forward=False)
    real = type(opt)._run_backward

    def wrong(self, *args):
        return [None if g is None else g * 1.5 for g in real(self, *args)]

    monkeypatch.setattr(type(opt), "_run_backward", wrong)
    opt(x, t).backward()
    assert any("gradient check failed" in r for r in opt._kbench_reasons), opt._kbench_reasons
    x2 = x.detach().clone().requires_grad_(True)
    ref_model(x2, t).backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(model.scale.grad, ref_model.scale.grad)


def test_out_of_memory_in_the_gradient_check_runs_the_backward_in_eager(monkeypatch):
    """A backward whose check ran out of device memory is unchecked, so never used: eager autograd
    runs it (with the reason), and the user's backward call does not raise."""
    torch.manual_seed(0)
    model = Mixed()
    x = torch.randn(5, 6, requires_grad=True)
    opt = kbench.optimize(model, (x,), backend="interp")

    def oom(self, r, need, seed=0):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB (test)")
    monkeypatch.setattr(type(opt), "_check_backward", oom)
    opt(x).sum().backward()
    assert any("gradient check failed: out of GPU memory (CUDA out of memory" in r for r in opt._kbench_reasons), \
        opt._kbench_reasons
    x2 = x.detach().clone().requires_grad_(True)
    model(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_a_gradient_check_that_raises_leaves_no_unchecked_backward_behind(monkeypatch):
    """A check interrupted by an error (inside a caller's CUDA-graph capture, say) must not leave
    its backward cached as if checked: the next backward builds and checks it again."""
    torch.manual_seed(0)
    model = Mixed()
    x = torch.randn(5, 6, requires_grad=True)
    opt = kbench.optimize(model, (x,), backend="interp", verbose=False)
    real, calls = type(opt)._check_backward, []

    def interrupted(self, r, need, seed=0):
        calls.append(r)
        if len(calls) == 1:
            raise RuntimeError("operation not permitted when stream is capturing (test)")
        return real(self, r, need, seed)
    monkeypatch.setattr(type(opt), "_check_backward", interrupted)
    with pytest.raises(RuntimeError, match="stream is capturing"):
        opt(x).sum().backward()
    n = len(calls)
    opt(x).sum().backward()                  # checked this time, then used
    assert calls[n] == calls[0] and not opt._kbench_reasons
    x2 = x.detach().clone().requires_grad_(True)
    model(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_double_backward_differentiates_the_gradient():
    """create_graph=True (a gradient penalty): the first backward must itself be differentiable,
    so it runs through torch; the second-order gradients match eager's."""
    torch.manual_seed(0)
    model = Mixed().double()
    ref = Mixed().double()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    fast = kbench.optimize(model, (x.detach(),), backend="interp")
    fast(x).sum().backward()          # the generated backward is built and used once
    for p in model.parameters():
        p.grad = None
    x.grad = None
    results = []
    for m, params in ((fast, list(model.parameters())), (ref, list(ref.parameters()))):
        xx = x.detach().clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(m(xx).pow(2).sum(), xx, create_graph=True)
        gx.pow(2).sum().backward()
        results.append([xx.grad] + [p.grad for p in params])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


class Chunks(nn.Module):
    """A GLU-like split into three pieces along the last dim, each used differently."""

    def forward(self, x):
        a, b, c = x.chunk(3, dim=-1)
        return F.silu(a) * b + torch.tanh(c)


@pytest.mark.parametrize("factory,width", [(Swiglu, 8), (Chunks, 12)], ids=["swiglu", "chunk3"])
def test_chunked_input_backward_is_one_pointwise_kernel(factory, width):
    """The adjoint of x.chunk(k) is one select on the column index, computed by one POINTWISE
    backward region over x's shape (no zero-padded copy per chunk summed by further kernels);
    gradients still match torch.autograd (gradcheck, f64) at two batch sizes."""
    torch.manual_seed(0)
    model = factory().double()
    x = torch.randn(3, width, dtype=torch.float64, requires_grad=True)
    fast = kbench.optimize(model, (x.detach(),), backend="interp")
    for rows in (3, 5):
        xs = torch.randn(rows, width, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda t: fast(t), (xs,), eps=1e-6, atol=1e-7)
    notes = [info.backward for info in fast._kbench_plan.regions]
    assert notes == [notes[0]] and notes[0].startswith("interp: 1 region(s) POINTWISE"), notes
    assert not fast._kbench_reasons


def test_repeated_blocks_check_their_backward_once(monkeypatch):
    """Identical regions of a repeated block share one gradient check (the check draws random
    inputs and a float64 reference at several sizes: seconds per region on a large model), and
    every block's gradients still match eager."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU())
                            for _ in range(3)]).double()
    x = torch.randn(4, 16, dtype=torch.float64)
    opt = kbench.optimize(model, (x,), backend="interp")
    calls = []
    real = type(opt)._check_backward

    def counted(self, r, need, seed=0):
        calls.append(r)
        return real(self, r, need, seed)

    monkeypatch.setattr(type(opt), "_check_backward", counted)
    xs = x.clone().requires_grad_(True)
    opt(xs).square().sum().backward()
    ref = x.clone().requires_grad_(True)
    model(ref).square().sum().backward()
    regions = [i for i in opt._kbench_plan.regions if i.kind != "EXTERN"]
    assert len(regions) == 3 and len(calls) == 1, (len(regions), calls)
    assert all(", gradients match torch.autograd" in i.backward for i in regions)
    torch.testing.assert_close(xs.grad, ref.grad)
    for p, q in zip(opt.parameters(), model.parameters()):
        assert p is q and p.grad is not None


@pytest.mark.parametrize("vocab", [20000, 1000])
def test_rows_save_their_statistics(vocab):
    """Saved-tensor policy: a row's max and sum are written by the forward and read by the
    backward, which then has no reduction over the row's values left (a long row's logits are
    read once, a short one's are not reduced twice). Gradients match eager, also through
    retain_graph and a second backward, and the statistics never reach the caller."""
    saved = 2
    torch.manual_seed(1)
    x = torch.randn(5, vocab)
    t = torch.randint(0, vocab, (5,))
    model = CE(vocab)
    opt = kbench.optimize(model, (x, t), backend="interp", grad_in_forward=False)
    region = opt._kbench_plan.regions[0]
    assert region.kind == "ROW" and region.saved == saved
    out = opt(x, t)
    assert out.shape == () and torch.allclose(out, model(x, t), rtol=1e-5, atol=1e-6)

    xs, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    loss = opt(xs, t)
    loss.backward(retain_graph=True)
    loss.backward()
    ref = model(xr, t)
    ref.backward(retain_graph=True)
    ref.backward()
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(opt.scale.grad, model.scale.grad, rtol=1e-5, atol=1e-6)

    prog = next(p for (r, _), p in opt._kbench_backward.items() if r == 0)
    names = [prog.plan.nodes[v]["name"] for v in prog.plan.graph.inputs]
    assert sum(n.startswith("saved") for n in names) == saved, names
    ops = " ".join(i.ops for i in prog.plan.regions)
    assert "max" not in ops, ops   # the statistics are read, not recomputed


class LogSoftmaxThenScale(nn.Module):
    """A log_softmax and its output read again (one row region, two outputs)."""

    def forward(self, x):
        y = F.log_softmax(x, dim=-1)
        return y, y * 2.0


def test_log_softmax_backward_reads_its_output():
    """Saved-tensor policy, the other way: a log_softmax's backward needs only its output (dx =
    dy - exp(y) * sum(dy), what eager's backward reads), which moves fewer bytes than its input
    and statistics, so the region keeps no statistics and its backward reads the output. The
    backward graph reads neither x nor a statistic, and its kernels are checked on outputs the
    forward makes; gradients match eager (f64) through retain_graph and a second backward, with
    the output also read by more work; an output changed in place before the backward fails it,
    as eager's does."""
    torch.manual_seed(2)
    x = torch.randn(6, 50, dtype=torch.float64)
    model = LogSoftmaxThenScale()
    opt = kbench.optimize(model, (x,), backend="interp", verbose=False)
    first = opt._kbench_plan.regions[0]
    assert first.kind == "ROW" and first.saved == 0 and first.saved_outputs == (0,), first

    xs, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    g1, g2 = torch.randn_like(x), torch.randn_like(x)
    got, want = opt(xs), model(xr)
    torch.autograd.backward(got, [g1, g2], retain_graph=True)
    torch.autograd.backward(got, [g1, g2])
    torch.autograd.backward(want, [g1, g2], retain_graph=True)
    torch.autograd.backward(want, [g1, g2])
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-12, atol=1e-12)

    prog = opt._kbench_backward[(0, (True,))]
    graph = prog.plan.graph
    names = [prog.plan.nodes[v]["name"] for v in graph.inputs]
    assert names == ["x", "out0", "grad_out0", "grad_out1"], names   # y and 2y: one region
    read = {v for info in prog.plan.regions for v in info.inputs}
    assert graph.inputs[0] not in read and graph.inputs[1] in read, str(prog.plan.partition)
    assert "max" not in " ".join(i.ops for i in prog.plan.regions)
    assert "they read the region's outputs instead (region 0: output 0)" in str(opt.kbench_report)
    # the backward's kernels are checked on outputs the forward makes: log-probabilities (<= 0),
    # not free draws ("large" ones would send exp(y) past f32's range where no forward can)
    for dist in ("normal", "large", "uniform"):
        ins = prog.executor.region_inputs(0, [6, 50][:len(graph.symbols)], dist, torch.Generator().manual_seed(0))
        ys = ins[prog.plan.regions[0].inputs.index(graph.inputs[1])]
        assert torch.isfinite(ys).all() and (ys <= 0).all() and ys.shape == (6, 50), (dist, ys)

    y, _ = opt(x.clone().requires_grad_(True))
    y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(g1)


def test_grad_reading_outputs_at_the_graph_level():
    """Graph.grad(outputs=...) on a log_softmax graph: the backward reads out0 (f32 as it is; a
    bf16 output widened, as eager reads its bf16 output), and without outputs= the same graph
    recomputes from x, with no exp of an output; bad indices are refused."""
    from kbench.capture import capture

    x = torch.randn(4, 9, dtype=torch.float64)
    cap = capture(nn.LogSoftmax(dim=-1), (x,))
    g = cap.graph
    plain, reading = g.grad([True]), g.grad([True], outputs=[0])
    assert '"out0"' not in str(plain) and '"out0"' in str(reading), str(reading)
    assert "max" not in str(reading) and "max" in str(plain), str(reading)
    xr = x.clone().requires_grad_(True)
    y = F.log_softmax(xr, dim=-1)
    up = torch.randn_like(y)
    want, = torch.autograd.grad(y, [xr], up)
    for bwd, ins in ((plain, [x, up]), (reading, [x, y.detach(), up])):
        got = torch.empty_like(x)
        run_graph(bwd, cap.example_symvals, ins, [got])
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    text = str(capture(nn.LogSoftmax(dim=-1), (x.to(torch.bfloat16),)).graph.grad([True], outputs=[0]))
    assert '%1 = input user "out0" : bf16' in text and "= cast %1 : f32" in text, text
    for bad in ([1], [-1], [40]):
        with pytest.raises(ValueError, match="outputs"):
            g.grad([True], outputs=bad)


def test_autocast_cast_rounding_keeps_the_generated_backward():
    """Under bf16 autocast a Linear's bias is cast to bf16 before the ReLU: the float64 reference
    the backward is checked against must round at that cast as eager does, or ReLU masks differ
    near zero and a correct backward fails its check and runs in eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    x = torch.randn(64, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        opt = kbench.optimize(model, (x,), backend="interp", verbose=False)
        out = opt(x)
        ref = model(x)
    out.float().sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref.float().sum().backward()
    backward = [n for n in opt.kbench_report.notes if n.startswith("region") and "backward" in n]
    assert backward and all("gradients match torch.autograd" in n for n in backward), backward
    for g, p in zip(got, model.parameters()):
        assert torch.allclose(g.float(), p.grad.float(), rtol=2e-2, atol=2e-2 * float(p.grad.abs().max()))
