"""robust-kbench's kernel.cu candidates (`--impl path/kernel.cu` on a robust-kbench suite), on the
CPU: everything around compilation. The compiled extension's place is taken by a module written
in torch (impls.from_file's `compile` seam), and the harness runs in this process on the task's
real module (suite_formats.LocalSuiteTask), so what is checked is the contract itself: forward in
forward_fn's argument order, backward as the task's AutogradFunction.backward_fn, the gradient
key sets, and a kernel that does not compile as an ERROR row (through the CLI and its worker).
tests/gpu/test_suite_kernel_cu.py compiles a real one."""
from __future__ import annotations

import glob
import json
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_package import ROOT  # noqa: E402,F401

from kbench.bench import cli, harness, impls, suite_formats  # noqa: E402

S = Path(__file__).resolve().parent / "suites"
RK = S / "robust-kbench" / "tasks"
KERNELS = S / "robust-kbench" / "kernels"
LN_KERNEL = KERNELS / "layernorm_small" / "forward" / "kernel.cu"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)   # tiny ops: a second OpenMP thread only waits for its turn
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def env():
    return harness.Env("cpu", "quick")


def _task(d: Path, mode: str) -> suite_formats.LocalSuiteTask:
    name = f"rk:{d.name}" + (":bwd" if mode == "backward" else "")
    return suite_formats.LocalSuiteTask({"format": suite_formats.ROBUST, "path": str(d),
                                         "mode": mode, "name": name})


def _score(task, mod, env, backward=False, configs=None):
    factory = impls.from_file(str(LN_KERNEL), compile=lambda path: mod)
    return harness.score(task, "kernel.cu", factory, dtype="float32", backward=backward,
                         env=env, baselines=(), configs=configs)


def _reasons(row) -> str:
    return " | ".join(row["failures"] + row["task_problems"] + row["flags"])


def test_paths_names_and_build_names(tmp_path):
    assert impls.kernel_path(str(LN_KERNEL.parent)) == str(LN_KERNEL)
    with pytest.raises(FileNotFoundError, match="without a kernel.cu"):
        impls.kernel_path(str(tmp_path))
    assert impls.file_name(str(LN_KERNEL.parent)) == "layernorm_small-forward-kernel.cu"
    assert impls.file_name("some/dir/silu.cu") == "silu.cu"
    a, b = impls.extension_name("k.cu", b"x"), impls.extension_name("k.cu", b"y")
    assert a != b and a == impls.extension_name("other/k.cu", b"x") and a.isidentifier()
    log = ("Error building extension 'kbench_ext_1': [1/2] /usr/bin/nvcc -c /w/kernel.cu -o k.o\n"
           "FAILED: k.o\n/w/kernel.cu(7): error: identifier \"foo\" is undefined\n"
           "1 error detected in the compilation of \"/w/kernel.cu\".\n"
           "ninja: build stopped: subcommand failed.\n")
    assert impls.compile_errors(log) == '/w/kernel.cu(7): error: identifier "foo" is undefined'


def test_forward_gets_forward_fns_arguments_in_order(env):
    """The candidate is Model(*inputs, fn=module.forward): forward_fn's arguments (x, weight, bias,
    eps), the eps float included, on every config and init config; kbench's own contract (inputs,
    then the state tensors) would have left eps out."""
    seen = []

    def forward(x, weight, bias, eps):
        seen.append((x.dim(), tuple(weight.shape), tuple(bias.shape), eps))
        return F.layer_norm(x, tuple(weight.shape), weight, bias, eps)

    task = _task(RK / "layernorm_small", "forward")
    row = _score(task, types.SimpleNamespace(forward=forward), env)
    assert row["status"] == "PASS", _reasons(row)
    assert {c["config"] for c in row["cases"]} == {c["name"] for c in task.input_configs}
    assert {s[3] for s in seen} == {1e-05}
    assert {s[1] for s in seen} == {(3, 8, 8), (1, 4, 16)} and {s[0] for s in seen} == {4}
    # bias and weight swapped: wrong wherever the init is random
    swapped = _score(task, types.SimpleNamespace(
        forward=lambda x, w, b, eps: F.layer_norm(x, tuple(w.shape), b, w, eps)), env,
        configs=[task.input_configs[0]["name"]])
    assert swapped["status"] == "FAIL" and "output 0" in _reasons(swapped)


def _ln_backward(grad_output, x, weight, bias, eps, normalized_shape):
    with torch.enable_grad():
        xs = [t.detach().requires_grad_() for t in (x, weight, bias)]
        y = F.layer_norm(xs[0], normalized_shape, xs[1], xs[2], eps)
        return torch.autograd.grad(y, xs, grad_output)


def test_backward_replaces_the_tasks_backward_fn(env):
    """A backward kernel is the task's AutogradFunction.backward_fn, called as its backward calls
    it; its forward pass is the task's own. Every input and parameter gradient is checked."""
    calls = []

    def backward(*args):
        calls.append(len(args))
        return _ln_backward(*args)

    task = _task(RK / "layernorm_small", "backward")
    row = _score(task, types.SimpleNamespace(backward=backward), env, backward=True)
    assert row["status"] == "PASS", _reasons(row)
    assert calls and set(calls) == {6}
    fwd = _score(task, types.SimpleNamespace(backward=backward), env)   # the task's forward
    assert fwd["status"] == "PASS", _reasons(fwd)

    scaled = types.SimpleNamespace(
        backward=lambda *a: [g * 1.01 if i == 1 else g for i, g in enumerate(_ln_backward(*a))])
    bad = _score(task, scaled, env, backward=True)
    assert bad["status"] == "FAIL" and "grad of weight" in _reasons(bad)
    assert "key sets" not in _reasons(bad)


def test_forward_kernel_has_no_backward(env):
    task = _task(RK / "layernorm_small", "backward")
    row = _score(task, types.SimpleNamespace(forward=lambda x, w, b, eps: F.layer_norm(
        x, tuple(w.shape), w, b, eps)), env, backward=True)
    assert row["status"] == "FAIL" and "defines no backward()" in _reasons(row)
    row = _score(_task(RK / "layernorm_small", "forward"),   # a backward kernel, a forward task
                 types.SimpleNamespace(backward=_ln_backward), env)
    assert row["status"] == "FAIL" and "defines no forward()" in _reasons(row)


UNUSED_BIAS_TASK = '''
import torch


class AutogradFunction(torch.autograd.Function):
    backward_fn = None

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        return x * weight

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, bias = ctx.saved_tensors
        return AutogradFunction.backward_fn(grad_output, x, weight, bias)


def forward_fn(x, weight, bias):
    """x * weight: bias is passed and not used, so it has no gradient."""
    return x * weight


class Model(torch.nn.Module):
    def __init__(self, features: int = 4):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(features))
        self.bias = torch.nn.Parameter(torch.randn(features))

    def forward(self, x, fn=forward_fn):
        return fn(x, self.weight, self.bias)


def get_inputs(batch_size: int = 3, features: int = 4):
    return [torch.randn(batch_size, features)]


input_names = ["x"]
'''


def test_gradient_key_sets_must_be_equal(env, tmp_path):
    """A gradient the kernel leaves out (None for x) and one the reference does not have (zeros
    for the unused bias) are failures that name them, as robust-kbench's key-set check."""
    d = tmp_path / "unused_bias"
    d.mkdir()
    (d / "func_backward.py").write_text(UNUSED_BIAS_TASK)
    (d / "config_backward.json").write_text(json.dumps({
        "single_input_configs": [{"batch_size": 3}], "single_init_configs": [{}],
        "single_shared_configs": [{"features": 4}]}))
    task = _task(d, "backward")
    right = types.SimpleNamespace(
        backward=lambda g, x, w, b: (g * w, (g * x).sum(0), None))
    row = _score(task, right, env, backward=True)
    assert row["status"] == "PASS", _reasons(row)
    wrong = types.SimpleNamespace(
        backward=lambda g, x, w, b: (None, (g * x).sum(0), torch.zeros_like(b)))
    row = _score(task, wrong, env, backward=True)
    assert row["status"] == "FAIL"
    assert ("the gradient key sets differ: missing grad of input 0; extra grad of bias "
            "(the reference has none)") in _reasons(row)


def test_kernel_that_does_not_compile_is_an_error_row(tmp_path, capsys):
    """Through the CLI and its worker: the compile fails once (here for want of CUDA, on a GPU
    machine at the file's #error), every row records why, and the run still writes its files."""
    rc = cli.main(["--device", "cpu", "--budget", "quick", "--baselines", "eager",
                   "--out", str(tmp_path), "--suite", str(RK / "layernorm_small"),
                   "--impl", str(KERNELS / "broken")])
    path, = glob.glob(str(tmp_path / "*.json"))
    doc = json.load(open(path))
    assert rc == 1 and doc["impl"] == "kernels-broken-kernel.cu"
    assert [(r["task"], r["status"]) for r in doc["rows"]] == [
        ("rk:layernorm_small", "ERROR"), ("rk:layernorm_small:bwd", "ERROR")]
    why = {r["failures"][0] for r in doc["rows"]}
    assert len(why) == 1 and "kernel.cu does not compile: " in why.pop()
    assert "does not compile" in capsys.readouterr().err
