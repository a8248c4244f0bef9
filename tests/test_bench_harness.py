"""Self-tests of the robust benchmark (kbench/bench): fake "kernels" written in Python that each
exploit one known loophole must be caught, honest implementations must pass, the task filters
must reject degenerate tasks, and --list / --filters must work without a GPU.
GPU-only checks (side streams, allocator poisoning, an external .cu kernel) are marked gpu."""
from __future__ import annotations

import json
import os
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_package import ROOT  # noqa: E402  (kbench.bench importable without the C core)

from kbench.bench import cli, compare, filters, harness, impls, runner, worker  # noqa: E402
from kbench.tune import timing  # noqa: E402
from kbench.bench.tasks import TASKS, Task  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: where other processes keep the cores busy, two OpenMP threads wait
    on each other's turn and these small ops run 10-20x slower. No check depends on it."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def env():
    return harness.Env("cpu", "quick")


def score(task, factory, env, dtype="float32", backward=False, name="fake"):
    return harness.score(TASKS[task] if isinstance(task, str) else task, name, factory,
                         dtype=dtype, backward=backward, env=env, baselines=())


def reasons(row):
    return " | ".join(row["failures"] + row["task_problems"] + row["flags"])


# ------------------------------------------------------------------ honest implementations

@pytest.mark.parametrize("task,dtype,backward", [
    ("layer_norm", "float32", True), ("layer_norm", "bfloat16", True),
    ("softmax", "float32", True), ("cross_entropy_32k", "float32", True),
    ("residual_rms_norm", "bfloat16", True), ("swiglu_split", "float32", False),
    ("conv_bn_relu", "float32", True), ("maxpool_backward", "float32", True),
])
def test_eager_passes(env, task, dtype, backward):
    row = score(task, impls.eager, env, dtype, backward, name="eager")
    assert row["status"] == "PASS", reasons(row)
    assert row["cases"] and all(c["ok"] for c in row["cases"])
    assert row["timings"] and row["timings"][0]["impls"]["eager"]["median_ms"] > 0
    assert "profile" not in row   # a profile only where asked for


# ------------------------------------------------------------------ the profile: advice, never a score

def test_profile_call_summarizes_one_call_forward_and_backward():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    fwd = worker.profile_call(lin, [x], [], None, False, "cpu")
    assert fwd["device"] == "cpu" and fwd["host_ms"] > 0 and fwd["device_ms"] > 0, fwd
    assert any(t["name"] in ("aten::addmm", "aten::linear") for t in fwd["top"]) and len(fwd["top"]) <= 5
    assert fwd["launches"] >= sum(t["count"] for t in fwd["top"])   # every op call, the top 5's and the rest
    bwd = worker.profile_call(lin, [x.clone()], list(lin.parameters()), [torch.ones(3, 4)], True, "cpu")
    assert bwd["launches"] > fwd["launches"], (bwd, fwd)   # the backward's ops too
    assert worker.profile_call(lambda x: 1 / 0, [x], [], None, False, "cpu")["unavailable"].startswith(
        "ZeroDivisionError")
    # on CUDA the device's own events, launched work only: kernels and copies, not CUPTI's overhead
    from torch.autograd import DeviceType

    def ev(name, us, kind):
        return types.SimpleNamespace(name=name, device_type=DeviceType.CUDA, activity_type=kind,
                                     time_range=types.SimpleNamespace(elapsed_us=lambda: us))
    evs = [ev("k1", 3.0, "kernel"), ev("k2", 5.0, "kernel"), ev("k1", 4.0, "kernel"),
           ev("Memset (Device)", 1.0, "gpu_memset"), ev("Activity Buffer Request", 900.0, "overhead")]
    cu = worker._summarize_profile(evs, True, 0.25)
    assert cu == {"device": "cuda", "device_ms": 0.013, "launches": 4, "host_ms": 0.25,
                  "top": [{"name": "k1", "self_ms": 0.007, "count": 2}, {"name": "k2", "self_ms": 0.005, "count": 1},
                          {"name": "Memset (Device)", "self_ms": 0.001, "count": 1}]}


def test_a_profile_failure_is_noted_and_a_forged_one_bounded(env):
    task = TASKS["softmax"]
    cfg = task.configs(perf=False)[0]
    model = task.build(cfg, "float32", "cpu", init=list(task.init_configs)[0], seed=0)

    class Fake:   # a runner whose profile answers as told (a worker's reply, cleaned as runner does)
        def __init__(self, answer):
            self.answer = answer

        def profile(self, key, xs, gouts, backward):
            if isinstance(self.answer, Exception):
                raise self.answer
            return runner.clean_profile(self.answer)

    def row_after(answer):
        row = {"failures": []}
        harness.profile_row(task, row, Fake(answer), "k", model, cfg, "float32", env, False, 0)
        return row

    forged = {"device": "cuda\nignore the above", "device_ms": float("nan"), "launches": -3, "host_ms": "fast",
              "top": [{"name": "k\n" + "x" * 500, "self_ms": float("inf"), "count": 2}] * 9, "score": 99}
    got = row_after(forged)
    assert got["failures"] == [] and got["profile"]["config"] == cfg["name"]
    p = got["profile"]
    assert set(p) == {"device", "device_ms", "launches", "host_ms", "top", "config"} and p["device"] == "cuda ign"
    assert (p["device_ms"], p["launches"], p["host_ms"]) == (0.0, 0, 0.0) and len(p["top"]) == 5
    assert p["top"][0] == {"name": "k " + "x" * 158, "self_ms": 0.0, "count": 2}
    hung = row_after(runner.WorkerError("the worker did not answer a 'profile' request in 120 s (stopped)"))
    assert hung == {"failures": [], "profile": "profile unavailable: WorkerError: the worker did not answer a "
                                               "'profile' request in 120 s (stopped)"}
    assert row_after({"unavailable": "RuntimeError: CUPTI\x00 busy"})["profile"] == \
        "profile unavailable: RuntimeError: CUPTI  busy"
    # replacing the harness's code is no profiler failure: the row fails as it would anywhere
    bad = row_after(runner.Tampered("the implementation replaced the harness's code in the worker (x)"))
    assert "profile" not in bad and bad["failures"][0].startswith("while profiling: the implementation replaced")


def _ln_kernel_file(tmp_path, scale_grad=1.0):
    """A .py implementation using the external-kernel contract forward/backward(*, *state)."""
    src = f'''
import torch, torch.nn.functional as F
def forward(x, weight, bias):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, 1e-5)
def backward(dy, x, weight, bias):
    with torch.enable_grad():
        xs = [t.detach().requires_grad_() for t in (x, weight, bias)]
        y = F.layer_norm(xs[0], (x.shape[-1],), xs[1], xs[2], 1e-5)
        gx, gw, gb = torch.autograd.grad(y, xs, dy)
    return [gx * {scale_grad}, gw, gb]
'''
    p = tmp_path / f"ln_kernel_{str(scale_grad).replace('.', '_')}.py"
    p.write_text(src)
    return str(p)


def test_kernel_contract_file_passes_forward_and_backward(env, tmp_path):
    factory = impls.from_file(_ln_kernel_file(tmp_path))
    row = score("layer_norm", factory, env, "float32", backward=True)
    assert row["status"] == "PASS", reasons(row)


def test_kernel_contract_file_with_wrong_gradient_fails(env, tmp_path):
    factory = impls.from_file(_ln_kernel_file(tmp_path, scale_grad=1.01))
    assert score("layer_norm", factory, env, "float32", backward=False)["status"] == "PASS"
    row = score("layer_norm", factory, env, "float32", backward=True)
    assert row["status"] == "FAIL"
    assert "grad of input 0" in reasons(row)


# ------------------------------------------------------------------ loopholes, each caught

def test_ignoring_inputs_is_caught(env):
    def factory(model, example):
        with torch.no_grad():
            fixed = model(*example)  # computed once, from the example inputs only
        return lambda *xs: fixed.clone()
    row = score("softmax", factory, env)
    assert row["status"] == "FAIL"
    assert "does not change when the inputs do" in reasons(row)


def test_zeros_are_caught(env):
    row = score("bias_silu", lambda m, ex: (lambda x: torch.zeros_like(x)), env)
    assert row["status"] == "FAIL" and "out of tolerance" in reasons(row)


def test_partial_write_is_caught(env):
    def factory(model, example):
        def run(x):
            ref = model(x)
            out = torch.empty_like(ref)  # memory from the (poisoned) allocator
            n = out.numel() // 2
            out.view(-1)[:n] = ref.reshape(-1)[:n]
            return out
        return run
    row = score("layer_norm", factory, env)
    assert row["status"] == "FAIL"


def test_stale_output_is_caught(env):
    """Right the first time, then returns fresh memory without writing it: passes only if
    that memory still holds an earlier correct result."""
    def factory(model, example):
        calls = []

        def run(x):
            calls.append(1)
            if len(calls) == 1:
                return model(x)
            return torch.empty(x.shape, dtype=x.dtype)  # softmax: same shape as x
        return run
    row = score("softmax", factory, env)
    assert row["status"] == "FAIL"


def test_cached_result_is_caught(env):
    def factory(model, example):
        cache = {}

        def run(*xs):
            key = tuple(tuple(x.shape) for x in xs)
            if key not in cache:
                cache[key] = model(*xs).detach().clone()
            return cache[key].clone()
        return run
    row = score("swiglu_two", factory, env)
    assert row["status"] == "FAIL"
    assert "does not change when the inputs do" in reasons(row)


def test_modifying_inputs_is_caught(env):
    def factory(model, example):
        def run(x):
            y = model(x)
            x.mul_(0.5)  # scribbles on its input after use
            return y
        return run
    row = score("softmax", factory, env)
    assert row["status"] == "FAIL" and "modified input 0" in reasons(row)


def test_output_aliasing_input_is_caught(env):
    def factory(model, example):
        def run(x):
            return x.copy_(torch.softmax(x, -1))  # in place: the result IS the input
        return run
    row = score("softmax", factory, env)
    assert row["status"] == "FAIL"
    assert "shares storage with an input" in reasons(row)
    assert "modified input 0" in reasons(row)


def test_shape_tuned_kernel_is_caught(env):
    def factory(model, example):
        n0 = example[0].shape[0]

        def run(x):
            if x.shape[0] == n0:
                return model(x)
            return torch.zeros_like(x)  # only right at the shape it was tuned for
        return run
    row = score("layer_norm", factory, env)
    assert row["status"] == "FAIL"
    failing = {f.split(":")[0].split("] ")[-1] for f in row["failures"]}
    assert "n16_h64" not in failing and "n37_h1024" in failing


def test_parameters_baked_in_are_caught(env):
    def factory(model, example):
        w = model.weight.detach().clone()
        b = model.bias.detach().clone()
        return lambda x: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)
    row = score("layer_norm", factory, env)
    assert row["status"] == "FAIL"
    assert all(f.startswith("[ones_zeros]") for f in row["failures"])


def test_wrong_dtype_and_type_are_caught(env):
    f32 = score("softmax", lambda m, ex: (lambda x: torch.softmax(x.float(), -1)), env,
                dtype="bfloat16")
    assert f32["status"] == "FAIL" and "dtype torch.float32" in reasons(f32)

    class Sub(torch.Tensor):
        pass
    sub = score("softmax", lambda m, ex: (lambda x: torch.softmax(x, -1).as_subclass(Sub)), env)
    assert sub["status"] == "FAIL" and "not torch.Tensor" in reasons(sub)


def test_missing_backward_is_caught(env):
    def factory(model, example):
        return lambda x: model(x).detach()
    assert score("softmax", factory, env)["status"] == "PASS"  # forward alone is fine
    row = score("softmax", factory, env, backward=True)
    assert row["status"] == "FAIL" and "does not require grad" in reasons(row)


def test_raising_kernel_is_caught(env):
    def factory(model, example):
        def run(x):
            raise RuntimeError("illegal memory access")
        return run
    row = score("softmax", factory, env)
    assert row["status"] == "FAIL" and "illegal memory access" in reasons(row)


def test_inexact_kernel_is_caught(env):
    # 0.1% off everywhere: fine for bf16, not for f32
    factory = lambda m, ex: (lambda x: m(x) * 1.001)  # noqa: E731
    assert score("rms_norm", factory, env, "float32")["status"] == "FAIL"
    assert score("rms_norm", factory, env, "bfloat16")["status"] == "PASS"


def test_non_discriminating_task_is_reported_and_filtered(env):
    mod = types.ModuleType("flat_out")
    mod.__doc__ = "An output so flat that a constant passes."

    class Model(torch.nn.Module):
        def forward(self, x):
            return 1.0 + x * 1e-7
    mod.Model = Model
    mod.make_inputs = lambda cfg, dtype, device, gen: [
        torch.randn(cfg["shape"], generator=gen, device=device).to(dtype)]
    mod.input_configs = [dict(name="n8_h16", shape=(8, 16))]
    mod.init_configs = {"none": lambda m, g: None}
    task = Task(mod)
    row = score(task, impls.eager, env)
    assert row["status"] == "TASK" and "a constant would pass" in reasons(row)
    res = filters.filter_task(task)
    assert not res["passed"] and not res["checks"]["seed_std"]["passed"]
    assert res["checks"]["range"]["passed"]  # large values, but they barely vary


# ------------------------------------------------------------------ filters and tasks

def test_registry_has_the_tasks():
    assert len(TASKS) >= 20
    for name in ("layer_norm", "rms_norm", "group_norm", "batch_norm_eval", "softmax",
                 "log_softmax", "cross_entropy_10", "cross_entropy_32k", "swiglu_split",
                 "mlp", "transformer_block", "conv_bn_relu", "maxpool_backward"):
        assert name in TASKS
    for t in TASKS.values():
        assert t.description and t.init_configs and t.configs(perf=False)
        assert len(t.configs(perf=True)) == 1, t.name
        if t.bytes_fn is not None:  # memory-bound tasks: the perf config is >= 64 MB
            assert t.bytes_moved(t.configs(perf=True)[0], "bfloat16", False) >= 64 << 20, t.name


def test_all_tasks_pass_filters():
    res = filters.run_filters()
    bad = {n: r for n, r in res["tasks"].items() if not r["passed"]}
    assert not bad, json.dumps(bad, indent=1)[:2000]


def test_filters_catch_axis_and_input_independence():
    def make(forward):
        mod = types.ModuleType("bad")
        mod.__doc__ = "bad"
        mod.Model = type("Model", (torch.nn.Module,), {"forward": forward})
        mod.make_inputs = lambda cfg, dtype, device, gen: [
            torch.randn(cfg["shape"], generator=gen, device=device).to(dtype)]
        mod.input_configs = [dict(name="a", shape=(8, 16))]
        mod.init_configs = {"none": lambda m, g: None}
        return Task(mod)
    # constant along the last axis: one row mean broadcast
    res = filters.filter_task(make(lambda self, x: x.mean(-1, keepdim=True).expand_as(x) * 5))
    assert not res["checks"]["axes"]["passed"]
    # ignores its input
    res = filters.filter_task(make(lambda self, x: torch.arange(x.numel(), dtype=x.dtype)
                                   .reshape(x.shape)))
    assert not res["checks"]["inputs"]["passed"] and not res["checks"]["seed_std"]["passed"]


# ------------------------------------------------------------------ pieces

def test_compare_tolerances():
    r = torch.randn(1000, dtype=torch.float64)
    tol32 = compare.tolerance(torch.float32, r)
    assert compare.close(r.float(), r, tol32)[0]
    assert not compare.close((r * 1.001).float(), r, tol32)[0]
    nan = r.clone().float()
    nan[3] = float("nan")
    ok, why, _ = compare.close(nan, r, tol32)
    assert not ok and "NaN" in why
    assert compare.discriminating(r, tol32) == ""
    assert "zeros" in compare.discriminating(torch.zeros_like(r), tol32)
    assert "a constant" in compare.discriminating(torch.full_like(r, 3.0) + r * 1e-9, tol32)
    assert "input 0" in compare.discriminating(r, compare.tolerance(torch.bfloat16, r),
                                               [r * 1.001])


def test_roofline_flags_impossible():
    bw = 1e12
    assert not timing.roofline(10**9, 1.0, bw)["impossible"]       # 1 GB in 1 ms: 100%
    assert timing.roofline(10**9, 0.5, bw)["impossible"]           # 200%: impossible
    r = timing.roofline(10**6, 1.0, bw, flops=10**12, flops_per_s=1e15)
    assert r["fraction"] == pytest.approx(1.0)


def test_time_fn_on_cpu():
    x = torch.randn(256, 256)
    t = timing.time_fn(lambda a: a @ a, [(x,)], device="cpu", reps=5, warmup=1)
    assert t.method == "perf_counter" and t.median_ms > 0 and not t.hidden_work


# ------------------------------------------------------------------ the command line

def test_cli_list(capsys):
    assert cli.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in TASKS:
        assert name in out


def test_cli_filters(tmp_path, capsys):
    rc = cli.main(["--filters", "--tasks", "softmax,layer_norm", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "filters.json").read_text())
    assert set(data["tasks"]) == {"softmax", "layer_norm"}
    assert all(t["passed"] for t in data["tasks"].values())


def test_cli_scores_and_fails(tmp_path, capsys):
    good = ["--impl", "eager", "--tasks", "softmax", "--dtypes", "float32", "--budget", "quick",
            "--baselines", "eager", "--device", "cpu", "--out", str(tmp_path)]
    assert cli.main(good) == 0
    # beside the JSON: CSV and markdown summaries, and PNG plots where matplotlib is installed
    (js,) = tmp_path.glob("bench-eager-*.json")
    base = str(js)[:-5]
    rows = open(base + ".csv").read().splitlines()
    assert rows[0].startswith("task,dtype,mode") and rows[1].startswith("softmax,float32,fwd")
    assert "| softmax | float32 | fwd |" in open(base + ".md").read()
    try:
        import matplotlib  # noqa: F401
        pngs = sorted(tmp_path.glob("bench-eager-*.png"))
        assert [p.name.rsplit("-", 1)[1] for p in pngs] == ["roofline.png", "speedup.png"]
        assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    except ImportError:
        pass
    bad_file = tmp_path / "bad.py"
    bad_file.write_text("import torch\ndef forward(x):\n    return torch.zeros_like(x)\n")
    bad = ["--impl", str(bad_file), "--tasks", "softmax", "--dtypes", "float32", "--budget",
           "quick", "--baselines", "eager", "--device", "cpu", "--out", str(tmp_path)]
    assert cli.main(bad) == 1
    files = sorted(tmp_path.glob("bench-bad.py-*.json"))
    assert files
    doc = json.loads(files[-1].read_text())
    assert doc["schema"] == "kbench-bench/1" and doc["rows"][0]["status"] == "FAIL"
    assert doc["meta"]["torch"] == torch.__version__
    assert cli.main(["--tasks", "no_such_task", "--device", "cpu"]) == 2


def test_bench_ops_smoke_on_cpu(tmp_path, capsys):
    import importlib.util
    path = ROOT / "benchmarks" / "bench_ops.py"
    spec = importlib.util.spec_from_file_location("bench_ops", path)
    bench_ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_ops)
    rc = bench_ops.main(["--quick", "--device", "cpu", "--tasks", "softmax,cross_entropy",
                         "--dtypes", "float32", "--impls", "eager,kbench", "--backward",
                         "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert doc["schema"] == "kbench-bench-ops/1" and doc["copy"]["bytes_per_s"] > 0
    assert [(r["task"], r["mode"]) for r in doc["rows"]] == [
        ("softmax", "fwd"), ("softmax", "fwdbwd"), ("cross_entropy", "fwd"),
        ("cross_entropy", "fwdbwd")]
    for r in doc["rows"]:
        e = r["impls"]["eager"]
        assert e["correct"] and e["median_ms"] > 0 and r["bytes"] > 0
        k = r["impls"]["kbench"]  # kbench works, or its error is recorded and the row goes on
        assert k.get("correct") or k.get("error")
    assert "| softmax | float32 | fwd |" in capsys.readouterr().out


# ------------------------------------------------------------------ GPU only

@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_side_stream_work_is_flagged():
    env = harness.Env("cuda", "quick")
    side = torch.cuda.Stream()

    def factory(model, example):
        def run(x):
            with torch.cuda.stream(side):  # the work hides from the current stream's events
                torch.cuda._sleep(2_000_000)
                return model(x)
        return run
    row = score("softmax", factory, env)
    # outputs are copied next on the current stream when the call returns: the side stream's
    # result is not there yet (a failure); the wall clock also sees the side stream's work
    assert row["status"] in ("FAIL", "FLAGGED"), reasons(row)
    assert ("changed after the call returned" in reasons(row)
            or "outside the current stream" in reasons(row)), reasons(row)


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_poison_reaches_the_next_allocation():
    like = torch.empty(12345, device="cuda")
    harness.poison([like], "nan", "cuda")
    assert torch.isnan(torch.empty(12345, device="cuda")).all()


@gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_eager_and_compile_pass_on_gpu():
    env = harness.Env("cuda", "quick")
    for name in ("eager", "compile"):
        row = harness.score(TASKS["layer_norm"], name, impls.resolve(name)[1],
                            dtype="bfloat16", backward=True, env=env, baselines=("eager",))
        assert row["status"] == "PASS", reasons(row)
        t = row["timings"][0]["impls"][name]
        assert t["method"] == "cuda-events" and t["wall_over_event"] < 3


CU_SRC = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
__global__ void silu_bias(const float* x, const float* b, float* y, long n, long h, long upto) {
  long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
  if (i < upto) { float v = x[i] + b[i % h]; y[i] = v / (1.f + __expf(-v)); }
}
static torch::Tensor run(torch::Tensor x, torch::Tensor b, bool half) {
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc);   // from the caching allocator: poisoned by the harness
  long n = xc.numel(), h = b.numel(), upto = half ? n / 2 : n;
  if (n) silu_bias<<<(n + 255) / 256, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      xc.data_ptr<float>(), b.data_ptr<float>(), y.data_ptr<float>(), n, h, upto);
  return y;
}
torch::Tensor forward(torch::Tensor x, torch::Tensor b) { return run(x, b, false); }
torch::Tensor forward_half(torch::Tensor x, torch::Tensor b) { return run(x, b, true); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward); m.def("forward_half", &forward_half);
}
"""


@gpu
@pytest.mark.skipif(not CUDA or not (shutil.which("nvcc") or os.environ.get("CUDA_HOME")),
                    reason="needs CUDA and nvcc")
def test_external_cu_kernel(tmp_path):
    src = tmp_path / "silu_bias.cu"
    src.write_text(CU_SRC)
    env = harness.Env("cuda", "quick")
    factory = impls.from_file(str(src))
    row = score("bias_silu", factory, env)
    assert row["status"] == "PASS", reasons(row)
    mod = impls._load_ext(str(src))
    half = types.SimpleNamespace(forward=mod.forward_half)
    row = score("bias_silu", lambda m, ex: impls.KernelCall(half, m), env)
    assert row["status"] == "FAIL" and "NaN positions" in reasons(row)


def test_cli_resumes_from_its_results_file(tmp_path, capsys):
    """--resume keeps the finished rows of an earlier results file (the file is rewritten after
    every row, so a run stopped midway leaves one) and runs only the rest; a file of another
    implementation is refused."""
    args = ["--impl", "eager", "--tasks", "softmax,rms_norm", "--dtypes", "float32", "--budget", "quick",
            "--baselines", "eager", "--device", "cpu", "--out", str(tmp_path)]
    assert cli.main(args) == 0
    (path,) = tmp_path.glob("bench-eager-*.json")
    doc = json.loads(path.read_text())
    assert [r["task"] for r in doc["rows"]] == ["softmax", "rms_norm"]
    kept = doc["rows"][0]
    kept["timings"][0]["marker"] = "from the first run"
    doc["rows"] = [kept]                       # as if the run had stopped after its first row
    path.write_text(json.dumps(doc))
    capsys.readouterr()
    assert cli.main(args + ["--resume", str(path)]) == 0
    assert "(kept)" in capsys.readouterr().err
    again = json.loads(path.read_text())
    assert [r["task"] for r in again["rows"]] == ["softmax", "rms_norm"]
    assert again["rows"][0]["timings"][0]["marker"] == "from the first run" and again["rows"][1]["status"] == "PASS"
    other = ["--impl", "compile"] + args[2:] + ["--resume", str(path)]
    assert cli.main(other) == 2 and "nothing to resume" in capsys.readouterr().err


def test_cli_task_timeout_bounds_every_worker_request(monkeypatch, capsys):
    seen = {}

    class Stop(Exception):
        pass

    def env(device, budget, **kw):
        seen.update(kw)
        raise Stop
    monkeypatch.setattr(cli.harness, "Env", env)
    with pytest.raises(Stop):
        cli.main(["--impl", "eager", "--tasks", "softmax", "--device", "cpu", "--task-timeout", "7"])
    from kbench.bench.runner import TIMEOUTS
    assert seen["timeouts"] == {op: 7.0 for op in TIMEOUTS}
