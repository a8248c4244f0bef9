"""NVRTC through kbench._C on the CPU: compile to CUBIN (sm_80, sm_90, with bf16/fp16 headers),
CompileError carrying NVRTC's log, the disk cache, parallel compiles, and the not-found message.
Skipped where no NVRTC can be found (install the nvidia-cuda-nvrtc wheel to run them), failed
instead where KBENCH_REQUIRE_NVRTC=1 (CI)."""
import glob
import os
import sys
import threading

import pytest

from kbench import _C
from conftest import nvrtc_missing

SAXPY = r"""
extern "C" __global__ void saxpy(float *y, const float *x, float a, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""

HALVES = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
extern "C" __global__ void halves(__nv_bfloat16 *b, __half *h, float *f, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = __bfloat162float(b[i]) + __half2float(h[i]);
    f[i] = v;
    b[i] = __float2bfloat16_rn(v * 2.0f);
    h[i] = __float2half_rn(v * 0.5f);
}
"""


def _wheel_dirs():
    dirs = []
    for base in sys.path:
        dirs += sorted(glob.glob(os.path.join(base or ".", "nvidia", "*", "lib")))
    return dirs


@pytest.fixture(scope="module")
def nvrtc():
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("KBENCH_NVRTC", raising=False)   # these tests search the usual places
            return _C.nvrtc_open(_wheel_dirs())
    except FileNotFoundError as e:
        nvrtc_missing(f"no NVRTC here: {str(e).splitlines()[0]}")


def test_info(nvrtc):
    path, version = _C.nvrtc_info(nvrtc)
    assert os.path.isfile(path) and "nvrtc" in os.path.basename(path)
    assert version >= 11020


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", [SAXPY, HALVES], ids=["saxpy", "bf16_fp16"])
def test_compile_to_cubin(nvrtc, arch, source):
    if "cuda_bf16.h" in source and _C.nvrtc_include_dir(nvrtc) is None:
        nvrtc_missing("no CUDA include folder with cuda_bf16.h on this machine")   # bf16 kernels need it
    cubin = _C.nvrtc_compile(nvrtc, source, arch, None)
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF" and len(cubin) > 512


def test_compile_error_carries_the_log(nvrtc):
    bad = 'extern "C" __global__ void k(float *y) { y[0] = undefined_thing_kb; }'
    with pytest.raises(_C.CompileError) as info:
        _C.nvrtc_compile(nvrtc, bad, "sm_90", None)
    assert "undefined_thing_kb" in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_bad_arguments(nvrtc):
    with pytest.raises(ValueError, match="arch"):
        _C.nvrtc_compile(nvrtc, SAXPY, "compute_90", None)
    with pytest.raises(TypeError):
        _C.nvrtc_compile(nvrtc, SAXPY, "sm_90")
    with pytest.raises(TypeError):
        _C.nvrtc_compile(object(), SAXPY, "sm_90", None)


def test_cache_hit_and_repair(nvrtc, tmp_path):
    cache = tmp_path / "nested" / "cubin"  # created on demand (mkdir -p)
    first = _C.nvrtc_compile(nvrtc, SAXPY, "sm_80", str(cache))
    files = list(cache.glob("*.cubin"))
    assert len(files) == 1
    stored = files[0].read_bytes()
    assert stored.startswith(first)  # the CUBIN, then a small integrity trailer
    assert _C.nvrtc_compile(nvrtc, SAXPY, "sm_80", str(cache)) == first
    files[0].write_bytes(stored[: len(stored) // 2])  # truncated: recompiled and rewritten
    assert _C.nvrtc_compile(nvrtc, SAXPY, "sm_80", str(cache)) == first
    assert files[0].read_bytes() == stored
    # another arch is another entry (and cache_dir may be any os.PathLike)
    _C.nvrtc_compile(nvrtc, SAXPY, "sm_90", cache)
    assert len(list(cache.glob("*.cubin"))) == 2
    assert not list(cache.glob("*.tmp.*"))


def test_cache_dir_that_cannot_exist(nvrtc, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError):
        _C.nvrtc_compile(nvrtc, SAXPY, "sm_80", str(blocker / "cubin"))


def test_parallel_compiles(nvrtc, tmp_path):
    # the GIL is released while NVRTC works; each thread has its own error context
    results, errors = {}, []

    def work(i):
        try:
            src = SAXPY.replace("saxpy", f"saxpy{i}")
            results[i] = _C.nvrtc_compile(nvrtc, src, "sm_80", str(tmp_path) if i % 2 else None)
            if i == 0:
                _C.nvrtc_compile(nvrtc, "this is not C++", "sm_80", None)
        except _C.CompileError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0, 1, 2, 3]
    assert all(c[:4] == b"\x7fELF" for c in results.values())
    assert len(errors) == 1 and "error" in errors[0]


def test_not_found_lists_the_places(monkeypatch):
    monkeypatch.setenv("KBENCH_NVRTC", "/nonexistent/kb/libnvrtc.so.99")
    with pytest.raises(FileNotFoundError, match="/nonexistent/kb/libnvrtc.so.99"):
        _C.nvrtc_open([])
    monkeypatch.delenv("KBENCH_NVRTC")
    monkeypatch.setenv("CUDA_HOME", "/nonexistent/kb/cuda")
    try:
        h = _C.nvrtc_open(["/nonexistent/kb/wheel/lib"])
    except FileNotFoundError as e:
        msg = str(e)
        for place in ("/nonexistent/kb/wheel/lib", "/nonexistent/kb/cuda/lib64", "/usr/local/cuda/lib64", "loader"):
            assert place in msg
    else:
        assert "/nonexistent" not in _C.nvrtc_info(h)[0]  # found on a default path instead


def test_open_argument_types():
    with pytest.raises(TypeError):
        _C.nvrtc_open([1, 2])
    with pytest.raises(TypeError):
        _C.nvrtc_open(None)


def test_cuda_open_without_a_driver():
    import ctypes.util

    if ctypes.util.find_library("cuda"):
        pytest.skip("this machine has libcuda (tests/gpu covers the driver)")
    with pytest.raises(FileNotFoundError, match="libcuda.so.1"):
        _C.cuda_open()
