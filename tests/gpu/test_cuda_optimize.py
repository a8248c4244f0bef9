"""optimize() with the cuda backend on a GPU: every test model's regions run as generated,
verified kernels and match eager on fresh inputs and on other batch sizes, in f32, bf16 and f16.
A region that stayed eager must say why; most regions must be kernels."""
import copy
import os
import re
import sys

import pytest
import torch

import kbench
from kbench.runtime import joint as joint_mod

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from models import MODELS  # noqa: E402

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def as_list(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def to(inputs, dtype):
    return tuple((x.to(dtype) if x.is_floating_point() else x).cuda() for x in inputs)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("entry", MODELS, ids=[m[0] for m in MODELS])
def test_cuda_matches_eager(entry, dtype):
    name, factory, example, other = entry
    torch.manual_seed(0)
    model = factory().to(dtype).cuda().eval()
    ex = to(example(), dtype)
    fast = kbench.optimize(model, ex, budget="none", verbose=False)
    report = fast.kbench_report
    for row in report.rows:
        assert row.status.startswith(("kernel", "torch")) or "(" in row.status, row  # eager rows say why (report text)
    ref_model = copy.deepcopy(model).double() if dtype != torch.float32 else model  # not in place: params are shared
    for inputs in (to(example(), dtype), to(other(), dtype)):
        with torch.no_grad():
            got = as_list(fast(*inputs))
            want = as_list(ref_model(*to(inputs, torch.float64))) if dtype != torch.float32 else as_list(model(*inputs))
        for g, w in zip(got, want):
            assert g.shape == w.shape
            if g.is_floating_point():
                assert rel_err(g, w) <= TOL[dtype], f"{name}\n{report}"
            else:
                assert torch.equal(g, w.to(g.dtype))
    plan = fast._kbench_plan
    if plan.static_reason is None and plan.graph.num_symbols > 0:  # sizes vary: the other shape ran on kernels,
        # but for a kernel with vectors over a varying last dim the other shape's does not divide
        # (that call runs the region in torch, and says so)
        refused = [why for why in fast._kbench_reasons if re.search(r"last dim \d+ is not a multiple of \d+", why)]
        assert set(fast._kbench_reasons) == set(refused), fast._kbench_reasons


def test_report_and_kernel_count():
    name, factory, example, _ = MODELS[0]
    model = factory().cuda()
    fast = kbench.optimize(model, to(example(), torch.float32), budget="none", verbose=False)
    text = str(fast.kbench_report)
    assert "kernel" in text and "NVRTC" in text


def test_cpu_input_falls_back_with_reason(caplog):
    model = torch.nn.GELU()
    x = torch.randn(64, 128, device="cuda")
    fast = kbench.optimize(model, (x,), budget="none", verbose=False)
    with caplog.at_level("WARNING", logger="kbench"):
        out = fast(x.cpu())
    assert out.device.type == "cpu" and torch.allclose(out, model(x.cpu()))
    assert any("cpu" in r.getMessage() for r in caplog.records)


def test_noncontiguous_and_misaligned_inputs_stay_correct():
    model = torch.nn.LayerNorm(256).cuda()
    x = torch.randn(64, 256, device="cuda")
    fast = kbench.optimize(model, (x,), budget="none", verbose=False)
    xt = torch.randn(256, 64, device="cuda").t()          # non-contiguous
    assert rel_err(fast(xt), model(xt)) <= 1e-4
    buf = torch.randn(64 * 256 + 1, device="cuda")
    xm = buf[1:].view(64, 256)                             # 4-byte offset: misaligned for 16-byte vectors
    assert rel_err(fast(xm), model(xm)) <= 1e-4
    # and their gradients: the forward fell back, so the backward's kernels check for themselves
    for x in (xt, xm):
        x = x.detach().requires_grad_(True)
        g = torch.randn(64, 256, device="cuda")
        want = torch.autograd.grad(model(x), [x, model.weight, model.bias], g)
        got = torch.autograd.grad(fast(x), [x, model.weight, model.bias], g)
        for w, h in zip(want, got):
            assert rel_err(h, w) <= 1e-4


@pytest.mark.parametrize("collect_during", [False, True], ids=["plain", "model_freed_mid_capture"])
def test_cuda_graph_capture(collect_during):
    """A forward captured into a CUDA graph and replayed on new data. collect_during: another
    optimized model is dropped and collected inside the capture — Python's collector frees
    kernel modules at any moment, and unloading them must not invalidate the capture (a module
    unload is a "potentially unsafe" call in the default, global capture mode)."""
    import gc

    model = torch.nn.Sequential(torch.nn.LayerNorm(512), torch.nn.GELU()).cuda()
    x = torch.randn(128, 512, device="cuda")
    fast = kbench.optimize(model, (x,), budget="none", verbose=False)
    dropped = kbench.optimize(torch.nn.Softmax(dim=-1).cuda(), (x,), budget="none", verbose=False)
    dropped(x)
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fast(static_x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fast(static_x)
        if collect_during:
            del dropped
            gc.collect()      # the dropped model's modules are unloaded here, mid-capture
    static_x.copy_(torch.randn_like(static_x))
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(out, model(static_x)) <= 1e-4


def test_autograd_through_kernels_matches_eager():
    model = torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.GELU()).cuda()
    x = torch.randn(32, 256, device="cuda", requires_grad=True)
    fast = kbench.optimize(model, (x.detach(),), budget="none", verbose=False)
    g = torch.randn(32, 256, device="cuda")
    want = torch.autograd.grad(model(x), [x, *model.parameters()], g)
    got = torch.autograd.grad(fast(x), [x, *fast.parameters()], g)
    for w, h in zip(want, got):
        assert rel_err(h, w) <= 1e-4


def test_column_sum_workspace_reused_safely():
    """LayerNorm's backward adds its weight and bias gradients through a workspace kept per
    kernel and stream: repeated calls, a side stream and a captured CUDA graph of forward and
    backward all give eager's gradients."""
    torch.manual_seed(0)
    model = torch.nn.LayerNorm(1024).cuda()
    fast = kbench.optimize(model, (torch.randn(256, 1024, device="cuda"),), budget="none", verbose=False)

    def grads(m, x, g):
        return torch.autograd.grad(m(x), [x, model.weight, model.bias], g)

    def check(x, g, got):
        want = grads(model, x, g)
        for w, h in zip(want, got):
            assert rel_err(h, w) <= 1e-4

    for _ in range(3):
        x = torch.randn(256, 1024, device="cuda", requires_grad=True)
        g = torch.randn(256, 1024, device="cuda")
        check(x, g, grads(fast, x, g))
    assert all(i.backward.startswith("cuda") for i in fast._kbench_plan.regions), \
        [i.backward for i in fast._kbench_plan.regions]   # generated kernels, not eager
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = grads(fast, x, g)
    torch.cuda.current_stream().wait_stream(side)
    check(x, g, got)

    static_x = torch.randn(256, 1024, device="cuda", requires_grad=True)
    static_g = torch.randn(256, 1024, device="cuda")
    with torch.cuda.stream(side):   # warm-up off the default stream, as torch's docs ask
        grads(fast, static_x, static_g)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grads(fast, static_x, static_g)
    for _ in range(2):
        with torch.no_grad():
            static_x.copy_(torch.randn_like(static_x))
            static_g.copy_(torch.randn_like(static_g))
        graph.replay()
        torch.cuda.synchronize()
        check(static_x, static_g, [o.clone() for o in out])


def test_long_row_cross_entropy_reads_saved_statistics():
    """A 20k-class cross-entropy (80 KB rows, too long to stay on chip): the forward kernel
    writes each row's max and sum, the backward kernels read them (none re-reduces the logits'
    row), pass their verification (saved statistics drawn as a forward makes them, not freely),
    and give eager's gradients, also with ignored targets."""
    torch.manual_seed(0)
    model = torch.nn.CrossEntropyLoss(ignore_index=-100).cuda()
    x = torch.randn(64, 20000, device="cuda")
    t = torch.randint(0, 20000, (64,), device="cuda")
    t[::7] = -100
    # the per-region backward (a loss's gradient in its forward: the next test)
    fast = kbench.optimize(model, (x, t), budget="none", verbose=False, grad_in_forward=False)
    assert fast._kbench_plan.regions[0].saved == 2
    xs, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    g = torch.rand((), device="cuda") + 0.5
    (got,) = torch.autograd.grad(fast(xs, t), [xs], g)
    (want,) = torch.autograd.grad(model(xr, t), [xr], g)
    assert rel_err(got, want) <= 1e-4
    progs = [p for (r, _), p in fast._kbench_backward.items() if r == 0 and p is not None]
    assert progs, fast._kbench_plan.regions[0].backward
    for info in progs[0].plan.regions:
        assert info.status.kernel, info.status_text   # verified, not eager
        assert "max" not in info.ops.split(), info.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_loss_gradient_computed_in_the_forward(dtype, monkeypatch):
    """A 32k-class cross-entropy, mean over rows, some targets ignored: with gradients wanted,
    the forward computes the loss and d loss / d logits with one kernel over the rows (kbench/
    joint.py); the backward scales the gradient on the device (nothing to do for 1, one pass
    otherwise). Matches eager for upstream gradients 1 and 0.37, through a second backward,
    and at another batch size. The joint program is forced here (it is used only where its
    kernels are no slower than the forward's and the per-region backward's together; the report
    gives both times)."""
    monkeypatch.setattr(joint_mod, "JOINT_SLACK", float("inf"))
    torch.manual_seed(0)
    model = torch.nn.CrossEntropyLoss().cuda()
    tol = 1e-4 if dtype == torch.float32 else 3e-2

    def inputs(n):
        x = torch.randn(n, 32000, device="cuda", dtype=dtype)
        t = torch.randint(0, 32000, (n,), device="cuda")
        t[1::5] = -100
        return x, t

    x, t = inputs(256)
    fast = kbench.optimize(model, (x, t), budget="none", verbose=False)
    for n in (256, 37):
        x, t = inputs(n)
        xs, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        loss, ref = fast(xs, t), model(xr, t)
        assert type(loss.grad_fn).__name__ == "LossFunctionBackward"
        assert rel_err(loss, ref) <= tol
        (want,) = torch.autograd.grad(ref, [xr], retain_graph=True)
        loss.backward(retain_graph=True)            # upstream gradient 1: the forward's gradient as is
        assert rel_err(xs.grad, want) <= tol
        g = torch.tensor(0.37, device="cuda", dtype=dtype)
        (got,) = torch.autograd.grad(loss, [xs], g)  # a second backward: the joint kernels again, scaled
        assert rel_err(got, want * g) <= tol
    joint = fast._kbench_joint[(True, False)]
    assert joint is not None, fast._kbench_loss
    regions = joint.program.plan.regions
    assert [r.kind for r in regions] == ["ROW", "ROW", "ROW"], [r.kind for r in regions]
    assert all(r.status.kernel for r in regions), [r.status_text for r in regions]
    x_id, dx_id = joint.program.plan.graph.inputs[0], joint.program.plan.graph.outputs[1]
    assert [r.index for r in regions if x_id in r.inputs] == [r.index for r in regions if dx_id in r.outputs] == [1]
    assert "loss gradients in the forward (gradients wanted: " in str(fast.kbench_report)
    # the decision's timings: the joint kernels, the scaling pass, the forward and backward's
    assert re.search(r"kernels \S+ ms, \+\S+ ms to scale .* vs \S+ ms", fast._kbench_loss["input"]), fast._kbench_loss


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "softmax"])
def test_saved_statistics_train_and_inference_entry_points(kind):
    """A row region saves its statistics for the backward: a training forward runs the entry
    point that writes them and the backward is one row kernel that reads them (no reduction pass
    for them); a no-grad forward runs the `_nostats` entry point (no buffers allocated, nothing
    stored), gated by itself, unless it times slower than the entry that writes them (both are
    timed at the example size; the report's extra says which runs; that one writes into scratch
    buffers kept by its launcher). All of it matches eager, bf16 rows of 4096 as in the benchmark."""
    torch.manual_seed(0)
    if kind == "layer_norm":
        model = torch.nn.LayerNorm(4096)
    elif kind == "rms_norm":
        model = torch.nn.RMSNorm(4096)
    else:
        model = _Softmax()
    model = model.to(torch.bfloat16).cuda()
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    fast = kbench.optimize(model, (x,), budget="none", verbose=False)
    info = fast._kbench_plan.regions[0]
    assert info.kind == "ROW" and info.saved >= 1 and info.status.kernel, (info.saved, info.status_text)
    kernel = fast._kbench_executor.kernels[0]
    assert "KB_SAVE" in kernel.source
    timed = info.extra["inference_entry"]   # 256 x 4096 elements: large enough to time both entries
    assert (kernel.fn_nostats is None) == timed.endswith("the one with statistics runs"), timed

    with torch.no_grad():
        y = fast(x)
    step = next(iter(fast._kbench_sigs.values())).steps[0]
    assert step.launch_nograd is not None
    slots = [x, *fast._params()]
    outs = step.launch_nograd([slots[i] for i in step.ins])
    assert list(outs[len(outs) - step.nsaved:]) == [None] * step.nsaved   # none allocated per call
    assert rel_err(y, model(x)) <= 3e-2
    # the other entry, as if it had timed faster: it writes the statistics into scratch buffers
    # its launcher keeps, and returns None for them as well
    nostats, kernel.fn_nostats = kernel.fn_nostats, None
    try:
        run = fast._kbench_executor.launcher(0, list(fast._kbench_plan.example_symvals), stats=False)
        outs = run([slots[i] for i in step.ins])
    finally:
        kernel.fn_nostats = nostats
    assert list(outs[len(outs) - step.nsaved:]) == [None] * step.nsaved
    assert rel_err(outs[0], model(x)) <= 3e-2

    xs, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    g = torch.randn_like(x)
    params = list(model.parameters())
    got = torch.autograd.grad(fast(xs), [xs, *params], g)
    want = torch.autograd.grad(model(xr), [xr, *params], g)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 5e-2
    progs = [p for (r, _), p in fast._kbench_backward.items() if r == 0 and p is not None]
    assert progs and len(progs[0].plan.regions) == 1, fast._kbench_plan.regions[0].backward
    bwd = progs[0].plan.regions[0]
    assert bwd.kind == "ROW" and bwd.status.kernel, bwd.status_text
    assert sum(op in ("max", "mean") for op in bwd.ops.split()) == 0, bwd.ops


class _Softmax(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, -1)


class _LogSoftmax(torch.nn.Module):
    def forward(self, x):
        return torch.log_softmax(x, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_log_softmax_backward_reads_its_output_on_the_gpu(dtype):
    """A log_softmax's backward reads its output, not its input and statistics (what eager's
    reads): through the C++ autograd node (the first backward registers the generated program,
    the second runs it from C++; retain_graph), gradients match eager's; no statistics are
    written or kept; the peak memory of a forward+backward is eager's, not more; an output
    changed in place fails the backward as eager's does."""
    torch.manual_seed(0)
    model = _LogSoftmax()
    x = torch.randn(2048, 4096, device="cuda", dtype=dtype)
    fast = kbench.optimize(model, (x,), budget="none", verbose=False)
    info = fast._kbench_plan.regions[0]
    assert info.kind == "ROW" and info.saved == 0 and info.saved_outputs == (0,), info
    assert info.status.kernel, info.status_text
    g = torch.randn_like(x)
    xr = x.clone().requires_grad_(True)
    want, = torch.autograd.grad(model(xr), [xr], g)
    for _ in range(2):
        xs = x.clone().requires_grad_(True)
        y = fast(xs)
        y.backward(g, retain_graph=True)
        y.backward(g)
        assert rel_err(xs.grad, 2 * want) <= TOL[dtype], rel_err(xs.grad, 2 * want)
    step = next(iter(fast._kbench_sigs.values())).steps[0]
    assert step.fast is not None and step.fast.backward_patterns() == 1   # ran from C++

    def peak(fn):
        xs = x.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.autograd.grad(fn(xs), [xs], g)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    peak(fast)
    assert peak(fast) <= peak(model), (peak(fast), peak(model))

    y = fast(x.clone().requires_grad_(True))
    y.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(g)
