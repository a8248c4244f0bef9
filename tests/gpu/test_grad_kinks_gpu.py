"""MobileNetV3's bf16 hardswish backwards on a GPU (issue 29): their gradient checks draw inputs
away from the points where an op's derivative jumps (torch_eval.away_from_kinks). Every hardswish
region of mobilenet_v3_small at batch 64 failed the check under torch 2.11 on an H200 ("gradient
of input 0 at sizes [64]: error 0.04-0.34 of the norm"): one element on the other side of a jump
is a max error of the jump's size. torch 2.11's CUDA derivative at -3 and 3 is 0 and 1, as
ops.def's, so the other way there is likelier (a value the float32 kernel and the float64
reference put on different sides of +-3); it was not shown which. `[closed]` plants a reference
with the other convention at +-3."""
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kbench
from kbench.runtime import torch_eval

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from test_grad_kinks import ClosedHardswish  # noqa: E402  (the reference with the other convention)

pytestmark = pytest.mark.gpu


class Stem(nn.Module):
    """mobilenet_v3_small's stem: conv 3x3 stride 2, BatchNorm (training), hardswish."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, 2, 1, bias=False)
        self.bn = nn.BatchNorm2d(16, eps=0.001, momentum=0.01)

    def forward(self, x):
        return F.hardswish(self.bn(self.conv(x)))


@pytest.mark.parametrize("reference", ["torch", "closed"])
def test_bf16_hardswish_backward_passes_its_gradient_check(reference, monkeypatch):
    """"torch": the installed torch's own hardswish derivative as the reference (under torch 2.11
    on an H200 the check failed without the fix; the closed-interval convention reproduces those
    failures region for region on the CPU, so that is presumably its CUDA kernel's); "closed":
    that convention forced, so the test fails without the fix whatever torch is installed."""
    if reference == "closed":
        monkeypatch.setitem(torch_eval._UNARY, "hardswish", ClosedHardswish.apply)
    torch.manual_seed(0)
    model = Stem().cuda()
    x = torch.randn(64, 3, 224, 224, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            opt = kbench.optimize(model, (x,), budget="none", verbose=False)
            out = opt(x)
        out.float().square().mean().backward()
    regions = [i for i in opt._kbench_plan.regions if i.kind != "EXTERN" and "hardswish" in i.ops]
    assert regions, opt.kbench_report
    for info in regions:
        assert info.backward and info.backward.startswith("cuda") and "gradients match" in info.backward, \
            info.backward
    # and the gradient it gives is eager's (up to bf16, and the convention at +-3)
    twin = Stem().cuda()
    twin.load_state_dict(model.state_dict())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = twin(x)
    want.float().square().mean().backward()
    got, ref = model.conv.weight.grad.double(), twin.conv.weight.grad.double()
    assert float((got - ref).abs().max() / ref.abs().max()) < 3e-2
