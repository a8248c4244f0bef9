"""kbench.generate without a GPU: every compute region of every test module gets a readable
CUDA kernel that NVRTC compiles for sm_80 and sm_90 (f32, and bf16 for the first modules); bad
arguments are refused; `python -m kbench info` runs. Without NVRTC the compile tests skip, or fail
where KBENCH_REQUIRE_NVRTC=1 (CI)."""
import subprocess
import sys

import pytest
import torch

import kbench
from conftest import session_dir
from models import MODELS


@pytest.fixture(autouse=True)
def cubin_cache(tmp_path_factory, monkeypatch):
    """One cache for the session (its xdist workers too): a region two modules share is compiled
    once per arch."""
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(session_dir(tmp_path_factory, "kbench-cache")))


def cases():
    for name, factory, example, _ in MODELS:
        yield pytest.param(name, factory, example, torch.float32, id=f"{name}-f32")
    for name, factory, example, _ in MODELS[:10]:
        yield pytest.param(name, factory, example, torch.bfloat16, id=f"{name}-bf16")


@pytest.mark.parametrize("name,factory,example,dtype", list(cases()))
def test_every_kernel_compiles_for_sm80_and_sm90(nvrtc, name, factory, example, dtype):
    model = factory().to(dtype).eval()
    args = tuple(x.to(dtype) if x.is_floating_point() else x for x in example())
    regions = kbench.capture(model, args).regions()
    compute = [i for i in range(len(regions)) if regions[i]["kind"] != "EXTERN"]
    for arch in ("sm_80", "sm_90"):
        kernels = kbench.generate(model, args, arch=arch)
        assert [k.region for k in kernels] == compute
        for k in kernels:
            assert k.ok, f"{name} region {k.region} ({arch}):\n{k.log}"
            assert k.cubin_bytes > 0 and k.name in k.source
            assert "// kbench: region" in k.source      # the readable header naming the region's ops


def test_generate_refuses_bad_arguments():
    model, example = MODELS[0][1](), MODELS[0][2]()
    with pytest.raises(ValueError, match="arch"):
        kbench.generate(model, example, arch="hopper")
    with pytest.raises(TypeError, match="model"):
        kbench.generate("not a module", example)


def test_info_command_runs():
    proc = subprocess.run([sys.executable, "-m", "kbench", "info"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "kbench" in proc.stdout and "NVRTC" in proc.stdout


class _Act(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("fn,dtype,fast", [
    (lambda x: torch.softmax(x, -1), torch.bfloat16, 1),       # exp, 16-bit output: fast math
    (lambda x: torch.log_softmax(x, -1), torch.float16, 1),
    (lambda x: torch.softmax(x, -1), torch.float32, 0),        # an f32 output would see it
    (lambda x: torch.sin(x) * torch.exp(x), torch.bfloat16, 0),  # __sinf degrades with |x|
    (lambda x: x * 2 + 1, torch.bfloat16, 0),                  # nothing for it to change
], ids=["softmax-bf16", "log_softmax-f16", "softmax-f32", "sin-exp-bf16", "affine-bf16"])
def test_default_fast_math_only_where_it_cannot_show(fn, dtype, fast):
    ks = kbench.generate(_Act(fn), (torch.randn(64, 256).to(dtype),), arch="sm_90", compile=False)
    assert ks and all(k.genome.fast_math == fast for k in ks), [str(k.genome) for k in ks]
