"""The maintained benchmark tools as a user runs them, without a GPU: each answers --help, each
GPU tool run here says so in one line on stderr and exits non-zero (no traceback), and
plot_results.py draws the committed results file. Most runs call the tool's main() in this
process (a subprocess would spend seconds importing torch and kbench again); one runs it as the
README does, as a script."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TOOLS = ["bench_ops.py", "bench_tune.py", "bench_genomes.py", "bench_models.py", "bench_guards.py", "sass_counts.py",
         "plot_results.py", "suite_sweep.py", "bench_ddp.py", "arch_sweep.py", "profile_model.py",
         "bench_cublaslt.py", "bench_gemm.py"]
# a plain run of each GPU tool: the arguments it needs, none of which asks for the CPU
GPU_RUNS = {
    "bench_ops.py": ["bench_ops.py"],
    "bench_ops.py --device cuda": ["bench_ops.py", "--device", "cuda"],
    "bench_tune.py": ["bench_tune.py"],
    "bench_genomes.py": ["bench_genomes.py", "softmax"],
    "bench_models.py": ["bench_models.py"],
    "bench_ddp.py": ["bench_ddp.py"],
    "profile_model.py": ["profile_model.py", "--model", "gpt2"],
    "bench_cublaslt.py": ["bench_cublaslt.py"],
    "bench_gemm.py": ["bench_gemm.py"],
}
no_gpu_here = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU says")


def _main(tool: str, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the tool's main(args), loaded from its file as a module."""
    spec = importlib.util.spec_from_file_location(f"tool_{tool[:-3]}", BENCH / tool)
    mod = importlib.util.module_from_spec(spec)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            spec.loader.exec_module(mod)
            rc = mod.main(list(args))
        except SystemExit as e:   # argparse's --help and usage errors
            rc = e.code
    return rc or 0, out.getvalue(), err.getvalue()


def test_the_maintained_tools_are_all_there():
    assert sorted(p.name for p in BENCH.glob("*.py")) == sorted(TOOLS)


@pytest.mark.parametrize("tool", TOOLS)
def test_help(tool):
    rc, out, err = _main(tool, "--help")
    assert rc == 0, err
    assert "usage:" in out and "Traceback" not in err


@no_gpu_here
@pytest.mark.parametrize("run", sorted(GPU_RUNS))
def test_gpu_tool_without_a_gpu_says_so_in_one_line(run):
    rc, _, err = _main(*GPU_RUNS[run])
    assert rc != 0
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0], err


@no_gpu_here
def test_as_a_script_without_a_gpu():
    """The whole path a user sees: the interpreter, the imports, `sys.exit(main())`."""
    done = subprocess.run([sys.executable, "benchmarks/bench_genomes.py", "softmax"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == ["bench_genomes.py: no CUDA GPU (torch.cuda.is_available() is False)"]


def test_bench_models_refuses_an_unknown_dtype_before_anything_runs():
    """A dtype it does not know (bfloat16 is a name it takes, bfloat8 is not) is an error, never
    a row run in f32 under another label."""
    rc, _, err = _main("bench_models.py", "--dtypes", "bf16,bfloat8")
    assert rc == 2 and "bfloat8" in err and len(err.splitlines()) == 1


def _bench_models():
    spec = importlib.util.spec_from_file_location("bench_models_tool", BENCH / "bench_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_models_judges_bf16_against_f32_beside_eager_bf16():
    bm = _bench_models()
    assert bm.DTYPE_NAMES["bfloat16"] == "bf16"
    assert bm.correct({"max_rel_err": 1e-5}, {}, "f32") is True
    assert bm.correct({"max_rel_err": 1e-3}, {}, "f32") is False
    # bf16 off eager bf16 by more than the tolerance, but no further from f32 than eager bf16 is
    assert bm.correct({"max_rel_err": 0.07, "err_vs_f32": 0.29}, {"err_vs_f32": 0.291}, "bf16") is True
    assert bm.correct({"max_rel_err": 0.07, "err_vs_f32": 0.40}, {"err_vs_f32": 0.29}, "bf16") is False
    assert bm.correct({"max_rel_err": 0.07}, {}, "bf16") is False
    # the gradient floor: a gradient that is noise on the model's scale does not count
    got, want = torch.ones(3), torch.ones(3)
    grads = {"w": torch.tensor([1.0, 0.0]), "b": torch.tensor([1e-5])}
    near = {"w": torch.tensor([1.0, 0.0]), "b": torch.tensor([3e-5])}
    assert bm.max_error(got, near, want, grads, "train") < 1e-2   # 2.0 without the floor
    far = {"w": torch.tensor([1.1, 0.0]), "b": torch.tensor([1e-5])}
    assert abs(bm.max_error(got, far, want, grads, "train") - 0.1) < 1e-5


def test_sass_counts_names_a_missing_tool_in_one_line(monkeypatch, capsys):
    """sass_counts needs no GPU but nvcc and cuobjdump; where one is missing it says which."""
    spec = importlib.util.spec_from_file_location("sass_counts_tool", BENCH / "sass_counts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def missing(name):
        raise FileNotFoundError(f"{name} not found (pip install nvidia-cuda-{name})")
    monkeypatch.setattr(mod, "find_tool", missing)
    assert mod.main(["softmax"]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["sass_counts.py: nvcc not found (pip install nvidia-cuda-nvcc)"]


def test_plot_results_draws_the_committed_run(tmp_path):
    pytest.importorskip("matplotlib")
    results = sorted((BENCH / "results").glob("NVIDIA-*.json"))
    assert results, "benchmarks/results keeps the latest bench_ops.py run"
    out = tmp_path / "chart.png"
    rc, _, err = _main("plot_results.py", str(results[-1]), "-o", str(out))
    assert rc == 0, err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, table, _ = _main("plot_results.py", str(results[-1]), "--table")
    assert rc == 0 and table.startswith("| op | dtype | fwd vs eager")
    rows = json.loads(results[-1].read_text())["rows"]
    # the header, its rule, one line per (op, dtype), the geometric means
    assert len(table.strip().splitlines()) == 2 + len({(r["task"], r["dtype"]) for r in rows}) + 1


def test_plot_results_refuses_other_json_in_one_line(tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "kbench-tune/1"}))
    rc, _, err = _main("plot_results.py", str(other), "--table")
    assert rc != 0 and "Traceback" not in err
    assert len(err.splitlines()) == 1


def test_suite_sweep_shrinks_sizes_so_that_derived_ones_follow():
    """suite_sweep.py divides a task file's module-level sizes in its source, so a shape built from
    them (a bias of (out_channels, 1, 1)) shrinks with them; small numbers (kernel sizes) stay."""
    spec = importlib.util.spec_from_file_location("suite_sweep", BENCH / "suite_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = "batch_size = 1024\nout_channels = 128\nkernel_size = 3\nbias_shape = (out_channels, 1, 1)\n" \
          "def get_inputs():\n    return [4096]\n"
    ns = {}
    exec(compile(mod.shrink_source(src, 64), "t", "exec"), ns)
    assert (ns["batch_size"], ns["out_channels"], ns["kernel_size"], ns["bias_shape"]) == (16, 32, 3, (32, 1, 1))
    assert ns["get_inputs"]() == [4096]                 # only top-level assignments
    exec(compile(mod.shrink_source(src, 16), "t", "exec"), ns)
    assert (ns["batch_size"], ns["out_channels"]) == (64, 128)
    assert mod.verdict({"exception": "x", "stage": "eager"}) == "setup"
    assert mod.verdict({"exception": "x", "stage": "optimize"}) == "crash"
    assert mod.verdict({"stage": "done", "module": "OptimizedModule", "errors": ["max error 1"]}) == "wrong"


def test_arch_sweep_compares_an_encoder_with_its_dropout_off():
    """arch_sweep.py's encoders keep dropout in their configs (RoBERTa's hidden and attention
    dropout); its comparison with eager turns every dropout off, so the row measures kbench, not
    two random masks (with them, the gradients differed by 1.8 of their size)."""
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("arch_sweep", BENCH / "arch_sweep.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    factory, kind = mod.configs()["roberta"]
    row = mod.one("roberta", factory, kind, "cpu", False)
    assert row["module"] == "OptimizedModule"
    assert row["loss_err"] <= 1e-5 and row["grad_err"] <= 1e-4, row


def test_profile_model_sorts_kernels_into_kinds_and_merges_overlaps():
    spec = importlib.util.spec_from_file_location("profile_model", BENCH / "profile_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.kind_of("kb_r12_row") == "kbench"
    assert mod.kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert mod.kind_of("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"
    assert mod.kind_of("Memcpy DtoD (Device -> Device)") == "copy"
    assert mod.kind_of("pytorch_flash::flash_fwd_kernel") == "attention"
    # two steps: kernels of 10 + 20 µs overlapping by 5, one copy of 10 µs; wall 0.1 ms a step
    events = [("kb_r0_row", 0.0, 10.0), ("ampere_bf16_gemm", 5.0, 20.0), ("Memcpy DtoD", 100.0, 10.0)]
    got = mod.summarize(events, steps=2, wall_ms=0.1, top=2)
    assert got["gpu_busy_ms"] == pytest.approx((25 + 10) / 1e3 / 2)
    assert got["gpu_idle_ms"] == pytest.approx(0.1 - 0.0175)
    assert got["by_kind_ms"] == pytest.approx({"gemm": 0.01, "kbench": 0.005, "copy": 0.005})
    assert [t["name"] for t in got["top"]] == ["ampere_bf16_gemm", "kb_r0_row"]
    assert "| GPU busy ms | 0.02 |" in mod.table("m", "train", "bf16", {"eager": got})
    got["torch_ops"] = [{"op": "aten::cat", "shapes": "[[], []]", "calls": 24, "ms": 0.97}]
    assert "| 0.970 | 24 | aten::cat | `[[], []]` |" in mod.table("m", "train", "bf16", {"kbench": got})
