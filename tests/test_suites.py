"""Public suites as benchmark tasks (`python -m kbench bench --suite`): format detection, the
configs read from KernelBench files and robust-kbench config files, --list, --filters, CPU runs
of a tiny task of each format, a broken task file as an error row, and fast_p."""
from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_package import ROOT  # noqa: E402,F401

from kbench.bench import cli, results, suite_formats, suites  # noqa: E402

S = Path(__file__).resolve().parent / "suites"
KB, RK = S / "kernelbench" / "level1", S / "robust-kbench" / "tasks"


def test_detect_formats(tmp_path):
    assert [t["name"] for t in suite_formats.detect(str(KB))] == ["kb:19_ReLU", "kb:40_LayerNorm"]
    assert suite_formats.detect(str(KB / "40_LayerNorm.py"))[0]["format"] == "kernelbench"
    # KernelBench's root, its levels' folders inside (and a candidate file beside them, no task)
    assert [t["name"] for t in suite_formats.detect(str(KB.parent))] == \
        ["kb:level1/19_ReLU", "kb:level1/40_LayerNorm"]
    assert [t["path"] for t in suite_formats.detect(str(KB.parent))] == [t["path"] for t in suite_formats.detect(str(KB))]
    rk = suite_formats.detect(str(RK))
    assert [t["name"] for t in rk] == ["rk:layernorm_small", "rk:layernorm_small:bwd",
                                       "rk:linear_relu_small"]
    assert {t["format"] for t in rk} == {"robust-kbench"}
    assert [t["mode"] for t in suite_formats.detect(str(RK / "layernorm_small"))] == \
        ["forward", "backward"]
    (tmp_path / "notes.txt").write_text("no tasks here")
    with pytest.raises(ValueError):
        suite_formats.detect(str(tmp_path))


def test_kernelbench_second_shape():
    # batch_size is not read by get_init_inputs: a second config at batch_size // 2 + 1
    cfgs = suite_formats.kernelbench_configs(str(KB / "40_LayerNorm.py"))
    assert cfgs == [{"name": "base", "set": {}},
                    {"name": "batch_size_4", "set": {"batch_size": 4}}]
    t = suites.load(str(KB / "40_LayerNorm.py"))[0]
    assert t.group_key(t.input_configs[0]) == t.group_key(t.input_configs[1])   # one build


def test_robust_config_cross_product(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    (d / "func_forward.py").write_text("")
    (d / "config_forward.json").write_text(json.dumps({
        "single_input_configs": [{"b": 1}], "single_init_configs": [{"m": "r"}],
        "single_shared_configs": [{"f": 2}],
        "multi_input_configs": [{"b": 1}, {"b": 3}], "multi_init_configs": [{"m": "r"}, {"m": "s"}],
        "multi_shared_configs": [{"f": 2}, {"f": 5, "b": 9}]}))
    cfgs = suite_formats.robust_configs(str(d), "forward")
    pairs = [(c["init"], c["inputs"]) for c in cfgs]
    # single first; 2 x 2 x 2 multi, the duplicate of single dropped, and shared overrides
    # both the init config and the input config (b: 9 wins over the input's b)
    assert pairs[0] == ({"m": "r", "f": 2}, {"b": 1, "f": 2})
    # of the 8 multi ones, (x, b1, f5b9) and (x, b3, f5b9) coincide for each init x
    assert len(pairs) == 1 + 8 - 1 - 2
    assert ({"m": "s", "f": 5, "b": 9}, {"b": 9, "f": 5}) in pairs
    assert cfgs[0]["name"] == "m_r_f_2_b_1_f_2"
    assert len({c["name"] for c in cfgs}) == len(cfgs)


def test_robust_config_without_multi_setting(tmp_path):
    (tmp_path / "config_backward.json").write_text(json.dumps({
        "single_input_configs": [{"b": 2}], "single_init_configs": [{}],
        "single_shared_configs": [{"f": 3}]}))
    cfgs = suite_formats.robust_configs(str(tmp_path), "backward")
    assert [(c["init"], c["inputs"]) for c in cfgs] == [({"f": 3}, {"b": 2, "f": 3})]


def test_list_reads_without_importing(capsys):
    assert cli.main(["--suite", str(RK), "--list"]) == 0
    out = capsys.readouterr().out
    assert "rk:layernorm_small:bwd | float32 | yes | 1 |" in out
    assert "rk:linear_relu_small | float32 | no | 3 |" in out
    assert not [m for m in sys.modules if m.startswith("kbench_suite_")]


def test_filters_on_suite(tmp_path, capsys):
    assert cli.main(["--suite", str(RK / "linear_relu_small"), "--filters",
                     "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "suite-filters.json").read_text())
    checks = res["tasks"]["rk:linear_relu_small"]["checks"]
    assert set(checks) == {"range", "seed_std", "axes", "init", "inputs"}
    assert all(c["passed"] for c in checks.values())
    assert not (tmp_path / "filters.json").exists()
    assert not [m for m in sys.modules if m.startswith("kbench_suite_")]   # worker only


def _run(tmp_path, *argv):
    rc = cli.main(["--device", "cpu", "--budget", "quick", "--baselines", "eager",
                   "--out", str(tmp_path), *argv])
    path, = glob.glob(str(tmp_path / "*.json"))
    return rc, json.load(open(path)), path


def test_cpu_run_kernelbench_model_new(tmp_path):
    rc, doc, path = _run(tmp_path, "--suite", str(KB / "19_ReLU.py"),
                         "--impl", str(S / "kernelbench" / "ModelNew_relu.py"))
    row, = doc["rows"]
    assert rc == 0 and row["status"] == "PASS", row["failures"]
    assert {c["config"] for c in row["cases"]} == {"base", "batch_size_3"}
    assert {c["init"] for c in row["cases"]} == {"seed0", "seed1"}
    assert doc["fast_p"]["rows"] == 1 and doc["fast_p"]["correct"] == 1.0
    assert set(doc["fast_p"]["vs_eager"]) == {"0", "0.05", "0.5", "1"}
    base = path[:-5]
    assert "fast_0.05" in open(base + "-fast_p.csv").read()
    assert "fast_1" in open(base + ".md").read()
    assert not [m for m in sys.modules if m.startswith("kbench_suite_")]


def test_cpu_run_robust_kbench(tmp_path):
    rc, doc, _ = _run(tmp_path, "--suite", str(RK / "linear_relu_small"), "--impl", "eager")
    row, = doc["rows"]
    assert rc == 0 and row["status"] == "PASS", row["failures"]
    assert len({c["config"] for c in row["cases"]}) == 3


def test_broken_task_files_are_error_rows(tmp_path):
    rc, doc, _ = _run(tmp_path, "--suite", str(S / "broken"), "--impl", "eager")
    rows = {r["task"]: r for r in doc["rows"]}
    assert rc == 1 and set(rows) == {"kb:1_raises", "kb:2_noimport"}
    assert rows["kb:1_raises"]["status"] == "ERROR"
    assert "no inputs today" in rows["kb:1_raises"]["failures"][0]
    assert "a_module_that_does_not_exist" in rows["kb:2_noimport"]["failures"][0]
    assert doc["fast_p"]["correct"] == 0.0


def test_fast_p_arithmetic():
    rows = [{"status": "PASS", "speedup_vs_eager": 2.5, "speedup_vs_compile": 1.02},
            {"status": "PASS", "speedup_vs_eager": 1.04, "speedup_vs_compile": 0.5},
            {"status": "PASS", "speedup_vs_eager": 0.9},
            {"status": "FAIL", "speedup_vs_eager": 9.0, "speedup_vs_compile": 9.0},
            {"status": "TASK", "speedup_vs_eager": 9.0}]
    fp = results.fast_p(rows)
    assert fp["rows"] == 4 and fp["not_scored"] == 1 and fp["correct"] == 0.75
    assert fp["vs_eager"] == {"0": 0.5, "0.05": 0.25, "0.5": 0.25, "1": 0.25}
    assert fp["vs_compile"] == {"0": 0.25, "0.05": 0.0, "0.5": 0.0, "1": 0.0}
    header, table = results.fast_p_table(fp)
    assert header[-4:] == ["fast_0", "fast_0.05", "fast_0.5", "fast_1"]
    assert table[0][:4] == ("eager", 4, 1, "0.750")


def test_max_autotune_is_a_baseline_scored_like_the_others():
    """--baselines eager,compile,compile-max-autotune: the row's speedup against each timed
    baseline (a geometric mean over configs), and fast_p over every baseline the rows carry."""
    from kbench.bench import harness, impls
    name, factory = impls.resolve("compile-max-autotune")
    assert name == "compile-max-autotune" and factory is impls.compile_max_autotune
    assert impls.is_builtin(name)
    t = lambda cfg, ms: {"config": cfg, "impls": {   # noqa: E731
        "mine": {"median_ms": 1.0, "mean_ms": 1.0},
        "eager": {"median_ms": ms[0], "mean_ms": ms[0]},
        "compile-max-autotune": {"median_ms": ms[1], "mean_ms": ms[1]}}}
    row = {"timings": [t("a", (2.0, 0.5)), t("b", (8.0, 2.0))], "failures": [], "flags": [],
           "task_problems": [], "cases": []}
    harness._summarize(row, "mine", ("eager", "compile-max-autotune"))
    assert row["speedup_vs_eager"] == pytest.approx(4.0)
    assert row["speedup_vs_compile-max-autotune"] == pytest.approx(1.0)
    assert "speedup_vs_compile" not in row and row["status"] == "PASS"
    fp = results.fast_p([row])
    assert fp["vs_compile-max-autotune"]["0"] == 0.0 and fp["vs_eager"]["1"] == 1.0


def test_inputs_are_drawn_on_the_target_device():
    """get_inputs runs with the target device as torch's default device: a KernelBench task's
    torch.randn(...) of GBs is made on the GPU, not drawn on the host and copied ('meta' stands in
    for the GPU here); the values are the seed's, whatever the default device was before."""
    t = suites.load(str(KB / "19_ReLU.py"))[0]
    local = suite_formats.local_task(t.suite_spec)
    cfg = t.input_configs[0]
    seen = []
    real = local.module.get_inputs

    def spy(*a, **k):
        seen.append(torch.empty(1).device.type)
        return real(*a, **k)

    local.module.get_inputs = spy
    try:
        xs = local.inputs(cfg, "float32", "meta")
        assert seen == ["meta"] and all(x.device.type == "meta" for x in xs if isinstance(x, torch.Tensor))
        a, b = local.inputs(cfg, "float32", "cpu", seed=3), local.inputs(cfg, "float32", "cpu", seed=3)
        assert seen[-1] == "cpu" and torch.equal(a[0], b[0])
        assert torch.empty(1).device.type == "cpu"   # the default device is restored
    finally:
        local.module.get_inputs = real


def test_a_worker_lets_go_of_the_previous_tasks_models():
    """The task side of a suite keeps one task's models at a time: a level served by one worker
    does not hold every task's parameters at once."""
    t1, t2 = suites.load(str(KB / "40_LayerNorm.py"))[0], suites.load(str(RK / "linear_relu_small"))[0]
    suite_formats._MODELS.clear()
    for t in (t1, t2):
        local = suite_formats.local_task(t.suite_spec)
        req = {"cfg": t.input_configs[0], "init": next(iter(suite_formats.INIT_SEEDS)), "seed": 0}
        suite_formats._model(local, req, "cpu")
        assert {k[0] for k in suite_formats._MODELS} == {local.name}
    suite_formats._MODELS.clear()
