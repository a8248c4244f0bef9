"""GPU tests check kbench's own path. Two timing decisions would take it away from a test at
random: the model-level gate (kbench/tune/gate.py), which runs the original module wherever a
tiny test model is not faster on kbench's kernels, and the tuner's verdict (a region whose kernel
is slower than eager's calls goes back to torch). Both keep kbench's choice in every test here;
the tests of the gate and of demotion set their thresholds (or the verdict) themselves."""
import pytest

from kbench.tune import gate, tuner


@pytest.fixture(autouse=True)
def kbench_path_kept(monkeypatch):
    monkeypatch.setattr(gate, "KEEP_BELOW", float("inf"))
    monkeypatch.setattr(tuner, "TORCH_ABOVE", float("inf"))
