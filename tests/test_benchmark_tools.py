"""The maintained benchmark tools as a user runs them, without a GPU: each answers --help, each
GPU tool run here says so in one line on stderr and exits non-zero (no traceback), and
plot_results.py draws the committed results file."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
TOOLS = ["bench_ops.py", "bench_tune.py", "bench_genomes.py", "sass_counts.py", "plot_results.py"]
# a plain run of each GPU tool: the arguments it needs, none of which asks for the CPU
GPU_RUNS = {
    "bench_ops.py": [],
    "bench_ops.py --device cuda": ["--device", "cuda"],
    "bench_tune.py": [],
    "bench_genomes.py": ["softmax"],
}


def _run(tool: str, *args: str) -> subprocess.CompletedProcess:
    # from the repository root, as the README says to run them
    return subprocess.run([sys.executable, str(BENCH / tool), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))


def test_the_maintained_tools_are_all_there():
    assert sorted(p.name for p in BENCH.glob("*.py")) == sorted(TOOLS)


@pytest.mark.parametrize("tool", TOOLS)
def test_help(tool):
    done = _run(tool, "--help")
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and "Traceback" not in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
@pytest.mark.parametrize("run", sorted(GPU_RUNS))
def test_gpu_tool_without_a_gpu_says_so_in_one_line(run):
    done = _run(run.split()[0], *GPU_RUNS[run])
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0], done.stderr


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
    done = _run("plot_results.py", str(results[-1]), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = _run("plot_results.py", str(results[-1]), "--table")
    assert table.returncode == 0 and table.stdout.startswith("| op | dtype | fwd vs eager")
    rows = json.loads(results[-1].read_text())["rows"]
    assert len(table.stdout.strip().splitlines()) == 2 + len({(r["task"], r["dtype"]) for r in rows}) + 1


def test_plot_results_refuses_other_json_in_one_line(tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "kbench-tune/1"}))
    done = _run("plot_results.py", str(other), "--table")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1
