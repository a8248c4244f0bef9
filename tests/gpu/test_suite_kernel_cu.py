"""robust-kbench's kernel.cu format on the GPU, through `python -m kbench bench --suite`: one real
extension (tests/suites/robust-kbench/kernels/layernorm_small/forward/kernel.cu) compiled once for
the module and scored on every config of tasks/layernorm_small; a kernel.cu that does not compile
is an ERROR row on every task and the run goes on. The contract around the compile (argument
order, backward, gradient key sets) is tested on the CPU in tests/test_suite_kernel_cu.py."""
from __future__ import annotations

import glob
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _bench_package import ROOT  # noqa: E402,F401

from kbench.bench import cli, impls, suite_formats  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available()
                                 or not (shutil.which("nvcc") or os.environ.get("CUDA_HOME")),
                                 reason="needs CUDA and nvcc")]

S = Path(__file__).resolve().parents[1] / "suites"
RK = S / "robust-kbench" / "tasks"
KERNELS = S / "robust-kbench" / "kernels"
LN_KERNEL = KERNELS / "layernorm_small" / "forward" / "kernel.cu"


@pytest.fixture(scope="module")
def compiled():
    """The one extension these tests build (30-40 s of nvcc), into the session's cache folder: the
    worker of the CLI run below finds that build (its name is a hash of the source) and imports
    it."""
    return impls._load_ext(str(LN_KERNEL))


def _run(tmp_path, *argv):
    rc = cli.main(["--budget", "quick", "--baselines", "eager", "--out", str(tmp_path), *argv])
    path, = glob.glob(str(tmp_path / "*.json"))
    with open(path) as f:
        return rc, json.load(f)


def test_kernel_cu_scored_forward_on_every_config(compiled, tmp_path):
    x = torch.randn(2, 3, 8, 8, device="cuda")
    w, b = torch.randn(3, 8, 8, device="cuda"), torch.randn(3, 8, 8, device="cuda")
    torch.testing.assert_close(compiled.forward(x, w, b, 1e-5),
                               F.layer_norm(x, (3, 8, 8), w, b, 1e-5), rtol=1e-4, atol=1e-4)
    # the folder stands for its kernel.cu; forward gets (x, weight, bias, eps), as Model passes
    rc, doc = _run(tmp_path, "--suite", str(RK / "layernorm_small"), "--tasks",
                   "rk:layernorm_small", "--impl", str(LN_KERNEL.parent))
    row, = doc["rows"]
    assert row["status"] == "PASS", row["failures"] + row["flags"]
    assert rc == 0 and doc["impl"] == "layernorm_small-forward-kernel.cu"
    cfgs = suite_formats.robust_configs(str(RK / "layernorm_small"), "forward")
    assert {c["config"] for c in row["cases"]} == {c["name"] for c in cfgs}
    assert {c["init"] for c in row["cases"]} == {"seed0", "seed1"}
    assert row["speedup_vs_eager"] > 0


def test_kernel_cu_that_does_not_compile_is_an_error_row(tmp_path):
    rc, doc = _run(tmp_path, "--suite", str(RK), "--impl", str(KERNELS / "broken" / "kernel.cu"))
    assert rc == 1
    assert [(r["task"], r["status"]) for r in doc["rows"]] == [
        ("rk:layernorm_small", "ERROR"), ("rk:layernorm_small:bwd", "ERROR"),
        ("rk:linear_relu_small", "ERROR")]
    why = doc["rows"][0]["failures"][0]
    assert "kernel.cu does not compile" in why and "this candidate does not compile" in why
