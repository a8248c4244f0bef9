"""optimize(backend="interp") end to end on the CPU: every test model's regions run through the C
interpreter (not through eager: a fallback fails the test) and match eager on the example shape
and on other shapes, forward and backward; parameters are shared, the original untouched."""
import copy

import pytest
import torch

import kbench
from models import MODELS


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def as_list(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def cast_inputs(inputs, dtype):
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)


def check_no_fallback(fast):
    assert not fast._kbench_reasons, f"fell back to eager: {fast._kbench_reasons}"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 1e-9)], ids=["f32", "f64"])
@pytest.mark.parametrize("entry", MODELS, ids=[m[0] for m in MODELS])
def test_interp_matches_eager(entry, dtype, tol):
    name, factory, example, other = entry
    torch.manual_seed(0)
    model = factory().to(dtype).eval()
    ex = cast_inputs(example(), dtype)
    fast = kbench.optimize(model, ex, backend="interp")
    kinds = [r.kind for r in fast.kbench_report.rows]
    for inputs in (ex, cast_inputs(other(), dtype)):
        with torch.no_grad():
            want, got = as_list(model(*inputs)), as_list(fast(*inputs))
        assert len(want) == len(got)
        for w, g in zip(want, got):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert rel_err(g, w) <= tol, f"{name}: regions {kinds}"
    check_no_fallback(fast)


@pytest.mark.parametrize("entry", MODELS[:12], ids=[m[0] for m in MODELS[:12]])
def test_interp_bf16_rounds_on_store(entry):
    name, factory, example, _ = entry
    torch.manual_seed(0)
    model = factory().to(torch.bfloat16).eval()
    ex = cast_inputs(example(), torch.bfloat16)
    fast = kbench.optimize(model, ex, backend="interp")
    ref_model = copy.deepcopy(model).double()
    with torch.no_grad():
        ref = as_list(ref_model(*cast_inputs(ex, torch.float64)))
        got = as_list(fast(*ex))
        eager = as_list(model(*ex))
    for g, r, e in zip(got, ref, eager):
        assert g.dtype == e.dtype
        if g.is_floating_point():
            # computed in f32/f64 and rounded once: at least as close to f64 as eager bf16 is, within slack
            assert rel_err(g, r) <= max(2 * rel_err(e, r), 1e-2), name
    check_no_fallback(fast)


@pytest.mark.parametrize("entry", MODELS[:20], ids=[m[0] for m in MODELS[:20]])
def test_interp_gradients_match_eager(entry):
    name, factory, example, other = entry
    torch.manual_seed(0)
    model = factory().double()
    ex = cast_inputs(example(), torch.float64)
    fast = kbench.optimize(model, ex, backend="interp")
    inputs = [x.clone().requires_grad_(x.is_floating_point()) for x in cast_inputs(other(), torch.float64)]
    inputs2 = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    outs = as_list(model(*inputs))
    grads_out = [torch.randn_like(o) for o in outs if o.is_floating_point() and o.requires_grad]
    if not grads_out:
        pytest.skip("no differentiable output")
    want = torch.autograd.grad([o for o in outs if o.is_floating_point() and o.requires_grad], 
                               [x for x in inputs if x.requires_grad] + [p for p in model.parameters()],
                               grads_out, allow_unused=True)
    fouts = as_list(fast(*inputs2))
    got = torch.autograd.grad([o for o in fouts if o.is_floating_point() and o.requires_grad],
                              [x for x in inputs2 if x.requires_grad] + [p for p in fast.parameters()],
                              grads_out, allow_unused=True)
    for w, g in zip(want, got):
        assert (w is None) == (g is None), name
        if w is not None:
            assert rel_err(g, w) <= 1e-9, name
    check_no_fallback(fast)


def test_parameters_shared_and_original_untouched():
    factory, example = MODELS[0][1], MODELS[0][2]
    model = factory()
    before = copy.deepcopy(model.state_dict())
    fast = kbench.optimize(model, example(), backend="interp")
    assert list(fast.state_dict().keys()) == list(model.state_dict().keys())
    for p, q in zip(fast.parameters(), model.parameters()):
        assert p is q
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    # an update through the original is seen by the optimized module
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    x = example()
    assert rel_err(as_list(fast(*x))[0], as_list(model(*x))[0]) <= 2e-5


def test_bad_input():
    model, example = MODELS[0][1](), MODELS[0][2]()
    with pytest.raises(TypeError, match="model"):
        kbench.optimize(lambda x: x, example, backend="interp")
    with pytest.raises(ValueError, match="backend"):
        kbench.optimize(model, example, backend="tpu")
    fast = kbench.optimize(model, example, backend="interp")
    # a call that does not fit the capture runs in eager, with the reason; eager raises what it raises
    with pytest.raises(TypeError, match="positional argument"):
        fast(*example, example[0])
    assert any("this call passes 2" in r for r in fast._kbench_reasons), fast._kbench_reasons


def test_outside_envelope_falls_back_with_one_time_reason(caplog):
    model = torch.nn.GELU()
    fast = kbench.optimize(model, (torch.randn(4, 8),), backend="interp")
    x = torch.randn(4, 8, dtype=torch.float64)
    with caplog.at_level("WARNING", logger="kbench"):
        for _ in range(3):
            out = fast(x)
    assert out.dtype == torch.float64 and torch.allclose(out, model(x))
    msgs = [r.getMessage() for r in caplog.records if "dtype" in r.getMessage()]
    assert len(msgs) == 1, msgs   # once, not per call
    # inside the envelope (any batch size) it runs on kbench's regions, no new reason
    fast._kbench_reasons.clear()
    y = torch.randn(3, 8)
    assert rel_err(fast(y), model(y)) <= 2e-5
    assert not fast._kbench_reasons


def test_parameter_dtype_changed_in_place_falls_back():
    """module.double() rewrites each Parameter's .data in place (same object, new dtype): the
    optimized module must notice and run eager, not read f64 memory as f32."""
    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16))

        def forward(self, x):
            return torch.tanh(x * self.w)

    model = Scale()
    x = torch.randn(4, 16)
    fast = kbench.optimize(model, (x,), backend="interp")
    assert rel_err(fast(x), model(x)) <= 2e-5 and not fast._kbench_reasons
    weight = model.w
    model.double()
    assert model.w is weight and weight.dtype == torch.float64
    out = fast(x)                       # an f32 input, now with an f64 parameter
    assert out.dtype == torch.float64 and torch.allclose(out, model(x))
    assert any("w is now torch.float64" in r for r in fast._kbench_reasons), fast._kbench_reasons


def test_optimize_without_example_inputs_captures_on_first_call():
    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.GELU())
    fast = kbench.optimize(model, backend="interp")
    with pytest.raises(RuntimeError, match="not captured yet"):
        fast.kbench_report
    assert [p for p in fast.parameters()] == [p for p in model.parameters()]
    x, y = torch.randn(3, 8), torch.randn(5, 8)
    assert rel_err(fast(x), model(x)) <= 2e-5 and rel_err(fast(y), model(y)) <= 2e-5
    assert "interp" in str(fast.kbench_report)
    assert not fast._kbench_impl._kbench_reasons


class _Scaled(torch.nn.Module):
    def forward(self, x):
        return x * 2


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("kernel_reads", [False, True], ids=["output", "read"])
def test_a_16_bit_linear_with_unaligned_rows_runs_on_padded_weights(monkeypatch, tmp_path, bias, kernel_reads):
    """A bf16 Linear whose out_features is not a multiple of 8 (a vocabulary of 50257) is one torch
    call on a weight padded to the next multiple of 8, sliced back: the same values and gradients
    as eager's; below the size it pays off, and in f32, it stays linear. The slice is made
    contiguous where a kernel reads it, and is the result where the caller alone does (an LM
    head's logits: the copy would cost as much as the product)."""
    from kbench.capture import ops_matmul
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(tmp_path / "first"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1001, bias=bias),
                                *([_Scaled()] if kernel_reads else []))
    x = torch.randn(6, 32)

    def padded_steps(fast):
        # a cache directory of its own for the next optimize: its capture is not this one, stored
        monkeypatch.setenv("KBENCH_CACHE_DIR", str(tmp_path / str(len(list(tmp_path.iterdir())))))
        return [len(e.steps) for e in fast._kbench_captured.externs if
                any(fn is torch.ops.aten.constant_pad_nd.default for fn, _, _ in e.steps)]

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not padded_steps(kbench.optimize(model, (x,), backend="interp"))   # too small to pay
    monkeypatch.setattr(ops_matmul, "PAD_GEMM_MIN_MACS", 1)
    assert not padded_steps(kbench.optimize(model, (x,), backend="interp"))       # f32: aligned anyway
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = kbench.optimize(model, (x,), backend="interp")
        assert padded_steps(fast) == [(5 if bias else 4) - (not kernel_reads)]
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        got, want = fast(xs[0]), model(xs[1])
    assert got.shape == want.shape == (6, 1001) and got.dtype == torch.bfloat16
    assert got.is_contiguous() == kernel_reads
    assert rel_err(got, want) < 1e-2
    up = torch.randn_like(want, dtype=torch.float32)
    params = list(model.parameters())
    g_got = torch.autograd.grad(got, [xs[0], *params], up.to(got.dtype))
    g_want = torch.autograd.grad(want, [xs[1], *params], up.to(want.dtype))
    for a, b in zip(g_got, g_want):
        assert a.shape == b.shape and rel_err(a, b) < 2e-2


class _WindowMerge(torch.nn.Module):
    """Swin's window merge: windows permuted back, made contiguous, viewed as the image, then a
    residual add and a LayerNorm in the same region (its eager program ran the view on the
    permuted tensor: the contiguous() is an identity in the IR)."""

    def __init__(self, c=8):
        super().__init__()
        self.norm = torch.nn.LayerNorm(c)

    def forward(self, windows, shortcut):
        b, nh, nw, w, _, c = windows.shape
        x = windows.permute(0, 1, 3, 2, 4, 5).contiguous().view(b, nh * w * nw * w, c)
        return self.norm(shortcut + x)


class _RotaryPassThrough(torch.nn.Module):
    """Phi-3's partial rotary with the rotary part the whole head: the pass-through slice is empty
    (a size fixed at 0), and the cat joins it back."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.lin(x)
        rot, rest = h[..., :16], h[..., 16:]
        return torch.cat([rot.sin() * 2, rest], dim=-1) + 1


@pytest.mark.parametrize("name", ["window_merge", "empty_slice"])
def test_real_model_patterns_optimize_and_match_eager(name):
    torch.manual_seed(0)
    if name == "window_merge":
        model, inputs = _WindowMerge(), (torch.randn(2, 2, 2, 4, 4, 8), torch.randn(2, 64, 8))
    else:
        model, inputs = _RotaryPassThrough(), (torch.randn(4, 16),)
    fast = kbench.optimize(model, inputs, backend="interp", verbose=False)
    assert type(fast).__name__ == "OptimizedModule" and fast.kbench_report.kernels > 0, fast.kbench_report
    xs = [x.clone().requires_grad_() for x in inputs]
    got, want = fast(*xs), model(*inputs)
    assert rel_err(got, want) < 1e-5
    got.square().sum().backward()
    assert all(x.grad is not None for x in xs)


def test_a_fixed_index_into_a_varying_dim_is_a_size_guard():
    """x[:, 1] needs that dim at 2 or more; export keeps that only as every varying size's default
    range, so the capture guards it itself: no check runs the graph at 1 there (the backward's
    gradient check did, and crashed), and a call at 1 is eager's (its IndexError)."""
    class Second(torch.nn.Module):
        def forward(self, x):
            return (x[:, 1] * 2).sum(-1)

    x = torch.randn(4, 3, 5)
    opt = kbench.optimize(Second(), (x,), backend="interp", budget="none", verbose=False)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    opt(xa).square().sum().backward()
    Second()(xb).square().sum().backward()
    assert torch.allclose(xa.grad, xb.grad, rtol=1e-6, atol=1e-6)
    assert "gradients match torch.autograd" in str(opt.kbench_report)
    with pytest.raises(IndexError):
        opt(torch.randn(4, 1, 5))


def test_the_reports_eager_column_times_each_region_without_the_wall_clock_loop(monkeypatch):
    """The interp backend's eager column (tuner.time_eager_regions) is a per-call median: each
    region's eager program runs its warm-up and timed calls only, not the benchmark's wall-clock
    loop (a call count several times larger, most of a warm optimize())."""
    from kbench.tune import tuner
    calls = {}
    real = tuner.eager_call

    def counted(plan, r, *a):
        fn = real(plan, r, *a)
        if fn is None:
            return None

        def call():
            calls[r] = calls.get(r, 0) + 1
            return fn()
        return call
    monkeypatch.setattr(tuner, "eager_call", counted)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16)).eval()
    opt = kbench.optimize(model, (torch.randn(4, 8),), backend="interp", budget="none", verbose=False)
    assert calls and set(calls.values()) == {1 + 5}, calls   # warm-up 1, reps 5
    assert all(r.eager_ms is not None for r in opt.kbench_report.rows if r.kind != "EXTERN")


@pytest.mark.parametrize("exponent", [2, 3, -2])
def test_the_powers_torch_spells_out_are_products_not_powf(exponent):
    """x**3 (GELU-tanh's) and x**-2 lower as torch's CUDA kernel computes them, (x*x)*x and 1/(x*x),
    with no pow left for the kernel (a powf per value made GELU-tanh's kernel compute-bound)."""
    x = torch.randn(64, 32).clamp_min(0.05) * torch.randn(64, 32).sign()

    class Power(torch.nn.Module):
        def forward(self, x):
            return torch.pow(x, float(exponent)) + 1

    opt = kbench.optimize(Power(), (x,), backend="interp", budget="none", verbose=False)
    torch.testing.assert_close(opt(x), Power()(x), rtol=1e-5, atol=1e-6)   # CPU eager: std::pow
    assert not any("pow" in info.ops.split() for info in opt._kbench_plan.regions)


class CacheUpdate(torch.nn.Module):
    """A key-value cache's first update: the step's keys joined to an empty cache."""

    def __init__(self, empty):
        super().__init__()
        self.empty = empty

    def forward(self, x):
        k = x.transpose(1, 2) * 2
        return torch.cat([self.empty.to(x.device), k], dim=-2), torch.cat([k[:, :, :0], k], dim=2)


@pytest.mark.parametrize("empty, joined", [(torch.tensor([]), False), (torch.zeros(2, 8, 0, 4), False),
                                           (torch.tensor([], dtype=torch.float64), True)])
def test_a_cat_onto_nothing_is_a_copy_of_its_operand(empty, joined):
    """cat([empty, k]) is a fresh contiguous copy of k, written by a kernel, not torch's cat; an
    empty operand of a wider dtype still promotes the result, and that cat stays."""
    x = torch.randn(2, 3, 8, 4)
    model = CacheUpdate(empty)
    opt = kbench.optimize(model, (x,), backend="interp", budget="none", verbose=False)
    for got, want in zip(opt(x), model(x)):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        assert got.stride() == want.stride()
    cats = [str(e) for e in opt._kbench_captured.externs if "cat" in str(e)]
    assert bool(cats) == joined, cats


class HeadsIntoCache(torch.nn.Module):
    """GPT-2's attention prologue: one product for q, k and v, split, heads transposed, and the
    keys and values joined to an empty cache before attention."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).split(16, dim=2)
        q, k, v = (t.view(2, 8, 4, 4).transpose(1, 2) for t in (q, k, v))
        empty = torch.tensor([], device=x.device)
        k, v = torch.cat([empty, k], dim=-2), torch.cat([empty, v], dim=-2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v), k, v


def test_cached_keys_are_written_by_a_kernel_from_the_product():
    """The keys and values a cache keeps are read straight from the product's output by a kernel
    (through the split's slices and the heads' transpose) and come back contiguous, as eager's
    cat makes them; the split is no torch call, and gradients flow through the copies."""
    torch.manual_seed(0)
    model = HeadsIntoCache()
    x = torch.randn(2, 8, 16, requires_grad=True)
    opt = kbench.optimize(model, (x,), backend="interp", budget="none", verbose=False)
    externs = " ".join(str(e) for e in opt._kbench_captured.externs)
    assert "cat" not in externs and "split" not in externs, externs
    got, want = opt(x), model(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        assert g.stride() == w.stride()
    gx, = torch.autograd.grad(sum(t.sum() * (i + 1) for i, t in enumerate(got)), x)
    wx, = torch.autograd.grad(sum(t.sum() * (i + 1) for i, t in enumerate(want)), x)
    torch.testing.assert_close(gx, wx, rtol=1e-5, atol=1e-6)


def test_the_cached_keys_backward_is_one_kernel(compile_once):
    """The copies' backward scatters both gradients back into the product's layout through the
    heads' transpose and the split's offsets: one POINTWISE kernel whose gather indices nest
    several views deep (longer than codegen's expressions once allowed: it then ran in torch, op
    by op, a dozen full-size launches)."""
    from kbench import _C
    from kbench.runtime.plan import Plan
    model = HeadsIntoCache()
    x = torch.randn(2, 8, 16, requires_grad=True)
    plan = kbench.optimize(model, (x,), backend="interp", budget="none", verbose=False)._kbench_plan
    copy, = [info for info in plan.regions if info.ops.split().count("cast") == 2]
    graph = plan.partition.region_graph(copy.index).grad([True] * len(copy.inputs), saved=copy.saved,
                                                          outputs=copy.saved_outputs)
    backward = Plan(graph, (), plan.example_symvals, None, plan.guards)
    assert [info.kind for info in backward.regions] == ["POINTWISE"]
    src = _C.generate(graph.partition(), 0, 90, None).source
    assert compile_once([(src, "sm_90")])[0][:4] == b"\x7fELF"
