"""On a GPU: a region whose kernel loses to eager (the tuner's verdict forced here) goes back to
torch as its op's own ATen call — one kernel launch for a LayerNorm, not its decomposition's
several — next to kbench's kernels for the rest, and the module computes eager's result and
gradients. The eager column's program launches what eager launches."""
import pytest
import torch
import torch.nn as nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import kbench
from kbench.capture import Extern
from kbench.runtime.plan import Status
from kbench.tune import tuner as tuner_mod
from kbench.tune.tuner import Tuner

pytestmark = pytest.mark.gpu


def kernels(fn) -> list:
    """The names of the CUDA kernels fn() launches (CUPTI sees kbench's driver-API launches too)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset"))]


def layer_norm_kernels(names) -> list:
    return [n for n in names if "layer_norm" in n.lower() and not n.startswith("kb_")]


def ours(names) -> list:
    return [n for n in names if n.startswith("kb_")]


def force_loss(monkeypatch, picks):
    """Tuner.verdict says the regions `picks(info)` chooses lost to eager, whatever the times."""
    forced = []

    def verdict(self, info):
        if picks(info):
            forced.append(info.fx_nodes)
            return f"its kernel did not beat eager's {info.eager.ops or 'ops'} (forced by the test)"
        return ""
    monkeypatch.setattr(Tuner, "verdict", verdict)
    return forced


def model_and_input():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(1024), nn.Linear(1024, 1024), nn.GELU()).cuda()
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
        model[0].bias.uniform_(-0.5, 0.5)
    return model, torch.randn(64, 1024, device="cuda")


def check_forward_and_backward(model, opt, x, tol=1e-4):
    with torch.no_grad():
        want, got = model(x), opt(x)
    assert ((got - want).abs().max() / want.abs().max()).item() <= tol
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    g = torch.randn_like(want)
    params = list(model.parameters())
    gw = torch.autograd.grad(model(xa), [xa, *params], g)
    gg = torch.autograd.grad(opt(xb), [xb, *params], g)
    for w, h in zip(gw, gg):
        assert ((h - w).abs().max() / w.abs().max().clamp_min(1e-12)).item() <= tol


def test_a_layer_norm_that_loses_is_one_torch_launch(monkeypatch):
    model, x = model_and_input()
    forced = force_loss(monkeypatch, lambda info: "layer_norm" in info.fx_nodes)
    opt = kbench.optimize(model, (x,), budget="none", verbose=False, gate=False)
    assert forced and forced[0] == ("layer_norm",), forced
    plan = opt._kbench_plan
    assert opt._kbench_captured.kept.keys() == {"layer_norm"}
    (ln,) = [info for info in plan.regions if "layer_norm" in info.fx_nodes]
    assert ln.kind == "EXTERN" and ln.status is Status.TORCH
    assert ln.status_text.startswith("torch (kept: its kernel did not beat eager's layer_norm"), ln.status_text
    externs = [v for v in ln.nodes if plan.nodes[v]["op"] == "extern"]
    assert len(externs) == 1 and plan.externs[plan.nodes[externs[0]]["index"]].fn is torch.ops.aten.layer_norm.default
    # the Linear's bias add and the GELU still run as kbench's kernel
    (rest,) = [info for info in plan.regions if info.kind != "EXTERN"]
    assert rest.status.kernel and rest.fx_nodes == ("linear", "gelu"), (rest.fx_nodes, rest.status_text)

    # the kept op's extern is called once a forward (counted without the profiler too)
    calls = []

    class Counted(Extern):
        __slots__ = ()

        def call(self, *args, **kwargs):
            calls.append(1)
            return super().call(*args, **kwargs)
    index = plan.nodes[externs[0]]["index"]
    kept = plan.externs[index]
    plan.externs[index] = Counted(kept.steps, kept.name, kept.noperands)
    with torch.no_grad():
        opt(x)                                            # bound, warm
        calls.clear()
        opt(x)
        assert len(calls) == 1
        names = kernels(lambda: opt(x))
        eager_names = kernels(lambda: model(x))
    assert len(layer_norm_kernels(names)) == 1, names     # the op's own kernel, launched once
    assert layer_norm_kernels(names) == layer_norm_kernels(eager_names), (names, eager_names)
    assert len(ours(names)) == 1, names                   # kbench's bias add + GELU, nothing for the norm
    check_forward_and_backward(model, opt, x)
    check_forward_and_backward(model, opt, torch.randn(37, 1024, device="cuda"))   # another batch size


def test_a_model_whose_every_region_loses_launches_no_kernel_of_ours(monkeypatch):
    model, x = model_and_input()
    force_loss(monkeypatch, lambda info: True)
    opt = kbench.optimize(model, (x,), budget="none", verbose=False, gate=False)
    assert all(info.kind == "EXTERN" for info in opt._kbench_plan.regions), \
        [(info.kind, info.ops) for info in opt._kbench_plan.regions]
    assert opt.kbench_report.kernels == 0
    with torch.no_grad():
        opt(x)
        names = kernels(lambda: opt(x))
    assert not ours(names) and len(layer_norm_kernels(names)) == 1, names
    check_forward_and_backward(model, opt, x)


def test_the_eager_column_times_the_one_aten_call():
    """A LayerNorm region at ViT sizes: its eager time is aten.layer_norm's (one launch), not its
    decomposition's (mean, sub, mul, rsqrt, ... one launch each)."""
    torch.manual_seed(0)
    model = nn.LayerNorm(768).cuda()
    x = torch.randn(8, 197, 768, device="cuda")
    opt = kbench.optimize(model, (x,), budget="none", verbose=False, gate=False)
    plan = opt._kbench_plan
    (info,) = plan.regions
    assert info.eager.ops == "layer_norm" and info.eager_ms is not None and info.kernel_ms is not None
    ex = opt._kbench_executor
    gen = torch.Generator(device="cuda").manual_seed(0)
    ins = ex.region_inputs(0, plan.example_symvals, "normal", gen)
    call = tuner_mod.eager_call(plan, 0, ins, plan.example_symvals, ex.device, gen)
    with torch.no_grad():
        call()
        names = kernels(call)
    assert len(names) == 1 and layer_norm_kernels(names), names
    print(f"LayerNorm 8x197x768: eager (aten.layer_norm) {info.eager_ms:.4f} ms, kernel {info.kernel_ms:.4f} ms")
