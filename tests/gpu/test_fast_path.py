"""kbench._fast (csrc/fast/): a region's launch and its autograd node in C++. The node's
backward runs the generated backward kernels from C++ once Python has built and checked them;
it must give the Python path's exact bits and behave as a torch node does (retain_graph, a
second backward, create_graph, inputs without gradients, in-place changes to saved inputs,
upstream gradients that are misaligned or not contiguous, a model dropped before backward).
Every module here has cuda_graphs=False: these are the un-graphed path's tests (a graphed call
never reaches the Program; tests/gpu/test_cuda_graphs.py tests that mode)."""
import gc
import os
import weakref

import pytest
import torch

import kbench
from kbench.runtime import fast as fastmod
from kbench.runtime import module as runtime

pytestmark = pytest.mark.gpu

def _fast_built(program=False):
    """kbench._fast is built with kbench (setup.py): its absence fails, unless KBENCH_FAST=0 asks
    for the Python path."""
    m = fastmod.module()
    if m is None or (program and not hasattr(m, "Program")):
        if os.environ.get("KBENCH_FAST", "1") == "0":
            pytest.skip("KBENCH_FAST=0: the Python path was asked for")
        pytest.fail("kbench._fast%s is not there: it was not built, or does not load (rebuild with "
                    "pip install --no-build-isolation -e .)" % (".Program" if program else ""), pytrace=False)


@pytest.fixture
def fast_built():
    _fast_built()


@pytest.fixture
def fast_program_built():
    _fast_built(program=True)


needs_fast = pytest.mark.usefixtures("fast_built")


def layer_norm(n=1024):
    torch.manual_seed(0)
    model = torch.nn.LayerNorm(n).cuda()
    with torch.no_grad():
        model.weight.uniform_(0.5, 1.5)
        model.bias.uniform_(-0.5, 0.5)
    return model


def grads(m, x, g, **kw):
    return torch.autograd.grad(m(x), [x, *m.parameters()], g, **kw)


def assert_close(got, want, tol=1e-4):
    for h, w in zip(got, want):
        assert ((h - w).abs().max() / w.abs().max()).item() <= tol


@needs_fast
def test_backward_runs_from_cpp_after_the_first(monkeypatch):
    model = layer_norm()
    # gate=False: the gate's timed backward (parameters only) would add a need pattern of its own
    fast = kbench.optimize(model, (torch.randn(256, 1024, device="cuda"),), budget="none", verbose=False,
                           gate=False, cuda_graphs=False)
    calls = []
    orig = runtime.OptimizedModule._fast_backward

    def counted(self, *a):
        calls.append(1)
        return orig(self, *a)
    monkeypatch.setattr(runtime.OptimizedModule, "_fast_backward", counted)
    for i in range(4):
        x = torch.randn(256, 1024, device="cuda", requires_grad=True)
        g = torch.randn(256, 1024, device="cuda")
        out = fast(x)
        assert out.grad_fn.name() == "KbenchRegionBackward"
        assert_close(torch.autograd.grad(out, [x, *fast.parameters()], g), grads(model, x, g))
    assert len(calls) == 1   # the first builds, checks and hands over the program; the rest are C++
    (bound,) = fast._kbench_sigs.values()
    assert [s.fast.backward_patterns() for s in bound.steps if s.fast is not None] == [1]


@needs_fast
def test_same_bits_as_the_python_path(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.LayerNorm(512), torch.nn.GELU()).cuda()
    example = (torch.randn(128, 512, device="cuda"),)
    x = torch.randn(128, 512, device="cuda", requires_grad=True)
    g = torch.randn(128, 512, device="cuda")
    fast = kbench.optimize(model, example, budget="none", verbose=False, cuda_graphs=False)
    grads(fast, x, g)   # launches are bound at the first call of a size: before the patch
    monkeypatch.setattr(fastmod, "module", lambda: None)
    slow = kbench.optimize(model, example, budget="none", verbose=False, cuda_graphs=False)
    for _ in range(2):   # the second: the C++ program
        a, b = fast(x), slow(x)
        assert torch.equal(a, b)
        for h, w in zip(grads(fast, x, g), grads(slow, x, g)):
            assert torch.equal(h, w)
    assert any(s.fast is not None for bd in fast._kbench_sigs.values() for s in bd.steps)
    assert all(s.fast is None for bd in slow._kbench_sigs.values() for s in bd.steps)


def test_node_semantics_as_torch():
    model = layer_norm()
    fast = kbench.optimize(model, (torch.randn(64, 1024, device="cuda"),), budget="none", verbose=False, cuda_graphs=False)
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    g = torch.randn(64, 1024, device="cuda")
    want = grads(model, x, g)
    for _ in range(2):   # warm: the C++ program is registered after the first
        out = fast(x)
        first = torch.autograd.grad(out, [x, *fast.parameters()], g, retain_graph=True)
        second = torch.autograd.grad(out, [x, *fast.parameters()], g)   # retain_graph: same bits
        assert_close(first, want)
        for a, b in zip(first, second):
            assert torch.equal(a, b)
        with pytest.raises(RuntimeError, match="second time"):
            torch.autograd.grad(out, [x], g)

    # create_graph: differentiable gradients (through torch), double backward as eager's
    xg = x.detach().requires_grad_()
    (dx,) = torch.autograd.grad(fast(xg), [xg], g, create_graph=True)
    (ddx,) = torch.autograd.grad(dx.square().sum(), [xg])
    xe = x.detach().requires_grad_()
    (dxe,) = torch.autograd.grad(model(xe), [xe], g, create_graph=True)
    (ddxe,) = torch.autograd.grad(dxe.square().sum(), [xe])
    assert_close([dx, ddx], [dxe, ddxe], 1e-3)

    # an input without gradients: the parameters' still arrive, accumulated into .grad
    model.zero_grad(set_to_none=True)   # the same parameters as fast's
    xn = x.detach()
    fast(xn).backward(g)
    assert model.weight.grad is not None and xn.grad is None
    w_fast = model.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    model(xn).backward(g)
    assert_close([w_fast], [model.weight.grad])

    # an input changed in place after the forward: torch's version check, not a wrong gradient
    xi = torch.randn(64, 1024, device="cuda", requires_grad=True)
    y = xi * 1.0
    out = fast(y)
    with torch.no_grad():
        y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(g)


def test_awkward_upstream_gradients():
    model = layer_norm()
    fast = kbench.optimize(model, (torch.randn(64, 1024, device="cuda"),), budget="none", verbose=False, cuda_graphs=False)
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    g = torch.randn(64, 1024, device="cuda")
    grads(fast, x, g)   # the C++ program registered
    misaligned = torch.empty(64 * 1024 + 1, device="cuda")[1:].view(64, 1024).copy_(g)
    strided = g.t().contiguous().t()
    for up in (misaligned, strided):
        assert_close(grads(fast, x, up), grads(model, x, g))
    with pytest.raises(RuntimeError, match="shape"):
        torch.autograd.grad(fast(x), [x], g[:32])


def test_model_dropped_before_backward_and_collected_after():
    model = layer_norm()
    fast = kbench.optimize(model, (torch.randn(64, 1024, device="cuda"),), budget="none", verbose=False, cuda_graphs=False)
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    g = torch.randn(64, 1024, device="cuda")
    grads(fast, x, g)
    out = fast(x)
    ref = weakref.ref(fast)
    del fast
    gc.collect()
    assert ref() is not None   # the pending node keeps its regions' module alive
    (dx,) = torch.autograd.grad(out, [x], g)
    assert_close([dx], grads(model, x, g)[:1])
    del out
    gc.collect()
    assert ref() is None       # and nothing keeps it after: the cycles through C++ are collectable


# ------------------------------------------------------------------ kbench._fast.Program
# The whole forward call in C++ (csrc/fast/program.cpp) where it is the common case; every other
# call, and every call with the Program switched off (python_path), takes the runtime's Python path.
# Each test runs the same module both ways and wants the same bits, the same exceptions and the
# same notes.

needs_program = pytest.mark.usefixtures("fast_program_built")


class python_path:
    """Within: the module's calls take the runtime's Python prologue (kbench._fast's launches and
    nodes still run)."""

    def __init__(self, opt):
        self.opt = opt

    def __enter__(self):
        self.program = self.opt.__dict__["_kbench_fast_program"]
        self.opt.__dict__["_kbench_fast_program"] = None

    def __exit__(self, *exc):
        self.opt.__dict__["_kbench_fast_program"] = self.program


def outcome(f):
    """What a call gives: its outputs (a tuple of tensors) or the exception it raised."""
    try:
        out = f()
    except Exception as e:  # noqa: BLE001 - compared, not swallowed
        return ("raised", type(e), str(e))
    return ("ok", out if isinstance(out, tuple) else (out,))


def same_outcome(a, b):
    assert a[0] == b[0], (a, b)
    if a[0] == "raised":
        assert a[1:] == b[1:]
        return
    assert len(a[1]) == len(b[1])
    for x, y in zip(a[1], b[1]):
        assert type(x) is type(y) and x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y) and x.requires_grad == y.requires_grad


def both_ways(opt, *args, served):
    """Calls opt(*args) through the Program, then through the Python path; the same outcome, and
    the Program served the first call iff `served`."""
    program = opt._kbench_fast_program
    before = program.served
    got = outcome(lambda: opt(*args))
    assert program.served == before + served, program.why
    with python_path(opt):
        want = outcome(lambda: opt(*args))
    same_outcome(got, want)
    return got


class Wrapped(torch.nn.Module):
    def __init__(self, n=1024):
        super().__init__()
        self.ln = torch.nn.LayerNorm(n)

    def forward(self, x):
        return self.ln(x)


class ResidualLN(torch.nn.Module):
    def __init__(self, n=1024):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(n) + 0.5)
        self.bias = torch.nn.Parameter(torch.rand(n) - 0.5)

    def forward(self, x, r):
        h = x + r
        return torch.nn.functional.layer_norm(h, (h.shape[-1],), self.weight, self.bias, 1e-5), h


def optimized_wrapped():
    """(model, x, its optimized module): a LayerNorm of 64 x 1024, default genomes."""
    model = Wrapped().cuda()
    x = torch.randn(64, 1024, device="cuda")
    return model, x, kbench.optimize(model, (x,), budget="none", verbose=False, cuda_graphs=False)


@needs_program
def test_program_serves_forward_and_grad_calls_with_the_python_paths_bits():
    model, x, opt = optimized_wrapped()
    program = opt._kbench_fast_program
    opt(x)   # binds the signature: Python
    assert program.entries == 1
    with torch.no_grad():
        (y,) = both_ways(opt, x, served=1)[1]
    assert y.grad_fn is None
    both_ways(opt, x, served=1)   # the parameters want gradients: through the C++ node
    xg = x.clone().requires_grad_()
    g = torch.randn_like(x)
    for _ in range(3):   # the first backward builds the C++ backward; the rest use it
        before = program.served
        out = opt(xg)
        assert program.served == before + 1 and out.grad_fn.name() == "KbenchRegionBackward"
        got = torch.autograd.grad(out, [xg, *opt.parameters()], g)
        with python_path(opt):
            want = torch.autograd.grad(opt(xg), [xg, *opt.parameters()], g)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    assert not opt._kbench_reasons


@needs_program
def test_program_residual_layer_norm_returns_the_tuple():
    model = ResidualLN().cuda()
    x, r = torch.randn(64, 1024, device="cuda"), torch.randn(64, 1024, device="cuda")
    opt = kbench.optimize(model, (x, r), budget="none", verbose=False, cuda_graphs=False)
    opt(x, r)
    with torch.no_grad():
        got = both_ways(opt, x, r, served=1)[1]
    assert len(got) == 2
    xg, rg = x.clone().requires_grad_(), r.clone().requires_grad_()
    gy, gh = torch.randn_like(x), torch.randn_like(x)
    y, h = opt(xg, rg)
    got = torch.autograd.grad((y, h), [xg, rg, *opt.parameters()], (gy, gh))
    with python_path(opt):
        y, h = opt(xg, rg)
        want = torch.autograd.grad((y, h), [xg, rg, *opt.parameters()], (gy, gh))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@needs_program
def test_program_reads_replaced_parameters_and_submodules():
    model, x, opt = optimized_wrapped()
    opt(x)
    with torch.no_grad():
        model.ln.weight = torch.nn.Parameter(torch.rand(1024, device="cuda") + 0.5)
        (y,) = both_ways(opt, x, served=1)[1]
        assert torch.allclose(y, model(x), atol=1e-4)
        original_ln = model.ln
        model.ln = torch.nn.LayerNorm(1024).cuda()   # another submodule: the Python state guard declines
        torch.nn.init.uniform_(model.ln.bias, -1, 1)
        (y,) = both_ways(opt, x, served=0)[1]
        assert torch.allclose(y, model(x), atol=1e-4)
        assert "Python state" in opt._kbench_fast_program.why
        model.ln = original_ln
        (y,) = both_ways(opt, x, served=1)[1]
        assert torch.allclose(y, model(x), atol=1e-4)
        model.ln.weight = torch.nn.Parameter(torch.ones(512, device="cuda"))   # resized: eager's error
        both_ways(opt, x, served=0)
        model.ln.weight = torch.nn.Parameter(torch.ones(1024, device="cuda"))
        both_ways(opt, x, served=1)
        del model.ln
        both_ways(opt, x, served=0)   # gone: the Python path's fallback and its error
    assert any("gone" in r or "changed since the capture" in r for r in opt._kbench_reasons)   # the guard sees it first


@needs_program
def test_program_declines_double_train_eval_cpu_inputs_and_new_shapes():
    model, x, opt = optimized_wrapped()
    program = opt._kbench_fast_program
    opt(x)
    with torch.no_grad():
        opt.eval()   # captured in training mode
        both_ways(opt, x, served=0)
        assert "train/eval" in program.why
        opt.train()
        both_ways(opt, x, served=1)
        opt.double()
        both_ways(opt, x, served=0)            # float inputs, double parameters: eager's outcome
        both_ways(opt, x.double(), served=0)   # double inputs: not the captured signature
        opt.float()
        both_ways(opt, x, served=1)
        both_ways(opt, x.cpu(), served=0)      # a CPU input: eager's outcome, as before
        small = torch.randn(8, 1024, device="cuda")
        entries = program.entries
        opt(small)                             # a new shape: bound by Python, then served
        assert program.entries == entries + 1
        both_ways(opt, small, served=1)
        both_ways(opt, x, served=1)
        both_ways(opt, x, x, served=0)         # too many inputs: the Python path's TypeError
        both_ways(opt, "x", served=0)
    # eval mode was served by a capture of its own (not eager), built at the first eval call
    assert isinstance(opt._kbench_modes.get((False, ())), torch.nn.Module), opt._kbench_modes
    assert not any("train/eval" in r for r in opt._kbench_reasons)


@needs_program
def test_program_region_fallback_inside_the_loop():
    """A launch that refuses its inputs (not contiguous, misaligned) refuses before it does
    anything; the Program then runs the step as Python does: step.run (eager, noted) without
    gradients, apply_region (RegionFunction around eager) with them."""
    model, x, opt = optimized_wrapped()
    opt(x)
    strided = x.t().contiguous().t()
    misaligned = torch.empty(64 * 1024 + 1, device="cuda")[1:].view(64, 1024).copy_(x)
    with torch.no_grad():
        for awkward in (strided, misaligned):
            both_ways(opt, awkward, served=1)
    assert any("not contiguous" in r for r in opt._kbench_reasons)
    g = torch.randn_like(x)
    xg = strided.detach().requires_grad_()
    out = opt(xg)
    assert out.grad_fn.name() != "KbenchRegionBackward"   # RegionFunction's node, around eager
    got = torch.autograd.grad(out, [xg, *opt.parameters()], g)
    with python_path(opt):
        out2 = opt(xg)
        assert out2.grad_fn.name() == out.grad_fn.name()
        want = torch.autograd.grad(out2, [xg, *opt.parameters()], g)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@needs_program
def test_program_leaves_python_steps_and_losses_to_python():
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256)).cuda()
    x = torch.randn(32, 256, device="cuda")
    opt = kbench.optimize(mlp, (x,), budget="none", verbose=False, cuda_graphs=False)
    opt(x)
    assert opt._kbench_fast_program.entries == 0   # an EXTERN (the matmul) between the kernels
    with torch.no_grad():
        both_ways(opt, x, served=0)

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(1024)

        def forward(self, x):
            return self.ln(x).square().mean()

    loss = Loss().cuda()
    x = torch.randn(64, 1024, device="cuda")
    opt = kbench.optimize(loss, (x,), budget="none", verbose=False, cuda_graphs=False)
    assert not opt._kbench_loss_why   # a loss: its gradients may come from the joint program
    opt(x)
    program = opt._kbench_fast_program
    if program.entries:
        before = program.served
        out = opt(x)   # the parameters want gradients: Python's joint path
        assert program.served == before and "joint" in program.why
        with python_path(opt):
            assert torch.equal(out, opt(x))
        with torch.no_grad():
            both_ways(opt, x, served=1)


@needs_program
def test_module_call_serves_plain_calls_and_leaves_hooked_ones_to_torch():
    model, x, opt = optimized_wrapped()
    program = opt._kbench_fast_program
    opt(x)
    with torch.no_grad():
        both_ways(opt, x, served=1)   # nn.Module.__call__ skipped (kbench._fast.module_call)
        seen = []
        handle = opt.register_forward_hook(lambda m, args, out: seen.append(out) or out * 2)
        before = program.served
        y = opt(x)   # torch's __call__: the hook runs, forward() still gets the Program
        assert program.served == before + 1 and len(seen) == 1 and torch.equal(y, seen[0] * 2)
        handle.remove()
        both_ways(opt, x, served=1)
    assert not opt._kbench_reasons


@needs_program
def test_program_drops_each_value_after_its_last_reader():
    """An inference call through the C++ Program holds only live values: a chain of 8 regions
    peaks at a few activations, not at all 8 (csrc/fast/program.cpp: StepSpec.release)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.LayerNorm(4096), torch.nn.GELU())
                                  for _ in range(8)]).cuda()
    x = torch.randn(512, 4096, device="cuda")
    opt = kbench.optimize(model, (x,), budget="none", verbose=False, gate=False, cuda_graphs=False)
    program = opt._kbench_fast_program
    with torch.no_grad():
        want = model(x)
        opt(x)
        torch.cuda.synchronize()
        served = program.served
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = opt(x)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    assert program.served == served + 1, program.why
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    one = x.numel() * x.element_size()
    assert peak <= 3.5 * one, f"peak {peak / one:.1f} activations"
