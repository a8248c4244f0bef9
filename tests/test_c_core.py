"""The C core's own tests (csrc/tests), built and run plain and under AddressSanitizer +
UndefinedBehaviorSanitizer, from pytest so that the README's one test command covers them."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_make = pytest.mark.skipif(shutil.which("make") is None or shutil.which("cc") is None,
                                reason="needs make and a C compiler")


def run_make(*args):
    proc = subprocess.run(["make", *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@needs_make
def test_core_unit_tests_plain_and_sanitized():
    out = run_make("-C", "csrc", "check")
    assert "(asan+ubsan)" in out and " 0 failed" in out


@needs_make
def test_nvrtc_unit_tests_sanitized():
    out = run_make("-C", "csrc/tests", "-f", "Makefile.cuda", "check")
    if "skipped" in out.lower() and "passed" not in out:
        pytest.skip("no NVRTC on this machine")
    assert " 0 failed" in out
