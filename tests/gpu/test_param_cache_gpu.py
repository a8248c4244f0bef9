"""The parameter cache on a GPU (kbench/runtime/param_cache.py): a transformer block under bf16
autocast, with CUDA graphs and without, casts its weights once per parameter version (the
profiler sees no weight cast on a later call, the graph holds none), reads an optimizer's step
at the next call, and gives the bits of kbench's uncached path and eager's values; the C++ fast
path serves a kernel computed from parameters alone from the cache. On the CPU:
tests/test_param_cache.py."""
import copy
import os
import sys

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import kbench
from kbench.runtime import graphs

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from models import Block  # noqa: E402

pytestmark = pytest.mark.gpu

BF16 = dict(device_type="cuda", dtype=torch.bfloat16)
WEIGHTS = 5          # the weights of qkv, proj, fc1 and fc2, and qkv's bias (it stays in its GEMM)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def kernels(fn) -> list:
    """The names of the CUDA kernels fn() launches (a graph replay's included)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]


def casts(names) -> int:
    """f32 -> bf16 casts: autocast's of the weights (and of activations, which stay)."""
    return sum("bfloat16_copy" in n for n in names)


def block():
    torch.manual_seed(0)
    model = Block(dim=64, heads=4).cuda().eval()
    return model, torch.randn(4, 32, 64, device="cuda")


def make(model, x, graphs_on):
    with torch.autocast(**BF16):
        return kbench.optimize(model, (x,), budget="none", verbose=False, gate=False, cuda_graphs=graphs_on)


def call(opt, x):
    with torch.no_grad(), torch.autocast(**BF16):
        return opt(x)


def uncached(opt, x):
    bound = next(iter(opt._kbench_sigs.values()))
    with torch.no_grad(), torch.autocast(**BF16):
        return opt._run(bound, (x,), cached=False)


@pytest.mark.parametrize("graphs_on", [False, True], ids=["ungraphed", "graphed"])
def test_a_block_under_autocast_casts_its_weights_once_per_version(graphs_on):
    model, x = block()
    twin = copy.deepcopy(model)
    opt = make(model, x, graphs_on)
    for _ in range(graphs.WARMUP + 1):
        call(opt, x)                             # warmed up, and (graphed) captured
    if graphs_on:
        r = opt._kbench_graphs
        assert r.captures == 1, r.describe()
    opt.kbench_refresh()
    first = casts(kernels(lambda: call(opt, x)))   # the weights cast again, outside any graph
    steady = casts(kernels(lambda: call(opt, x)))
    assert first - steady == WEIGHTS, (first, steady)
    got = call(opt, x)
    assert torch.equal(got, uncached(opt, x))
    with torch.autocast(**BF16), torch.no_grad():
        assert rel_err(got, twin(x)) <= 3e-2
    # an optimizer's step between calls: in place, seen by the next call
    for m in (model, twin):
        sgd = torch.optim.SGD(m.parameters(), lr=0.5)
        with torch.autocast(**BF16):
            m(x).float().square().mean().backward()
        sgd.step()
    after = casts(kernels(lambda: call(opt, x)))
    assert after == first, (after, first)          # recomputed: every weight moved
    got = call(opt, x)
    assert torch.equal(got, uncached(opt, x))
    with torch.autocast(**BF16), torch.no_grad():
        assert rel_err(got, twin(x)) <= 3e-2
    if graphs_on:
        assert r.captures == 1 and r.drops == 0 and r.replays >= 4, r.describe()
    line = [n for n in opt.kbench_report.notes if n.startswith("parameter cache:")]
    assert line and "pinned" in line[0], opt.kbench_report.notes


class Scaled(torch.nn.Module):
    """x times a weight normalized by its norm: the norm is a kernel reading the parameter alone."""

    def __init__(self, dim=1024):
        super().__init__()
        self.g = torch.nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        return torch.relu(x * (self.g / self.g.norm()))


def test_the_fast_path_takes_a_kernel_of_parameters_alone_from_the_cache():
    torch.manual_seed(0)
    model = Scaled().cuda()
    x = torch.randn(64, 1024, device="cuda")
    opt = kbench.optimize(model, (x,), budget="none", verbose=False, gate=False, cuda_graphs=False)
    program = opt._kbench_fast_program
    assert program is not None
    with torch.no_grad():
        opt(x)
        served = program.served
        ours = lambda: [n for n in kernels(lambda: opt(x)) if n.startswith("kb_")]   # noqa: E731
        steady = ours()
        opt.kbench_refresh()
        refreshed = ours()
        assert program.served == served + 2, program.why
        assert len(refreshed) == len(steady) + 1, (refreshed, steady)
        model.g.mul_(2.0).add_(0.25)             # in place: the next call recomputes
        got = opt(x)
    assert torch.allclose(got, model(x), rtol=1e-5, atol=1e-6)
