"""NVRTC through kbench._C on the CPU: compile to CUBIN (sm_80, sm_90, with bf16/fp16 headers),
CompileError carrying NVRTC's log, the disk cache (signed with the user's key: a tampered or
planted CUBIN is recompiled, not loaded), parallel compiles, and the not-found message.
Skipped where no NVRTC can be found (install the nvidia-cuda-nvrtc wheel to run them), failed
instead where KBENCH_REQUIRE_NVRTC=1 (CI)."""
import glob
import hashlib
import hmac
import os
import stat
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


KEY = bytes(range(32))   # the cache's secret in these tests


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
    first = _C.nvrtc_compile(nvrtc, SAXPY, "sm_80", str(cache), KEY)
    files = list(cache.glob("*.cubin"))
    assert len(files) == 1
    stored = files[0].read_bytes()
    assert stored.startswith(first)  # the CUBIN, then its signed trailer
    assert _C.nvrtc_compile(nvrtc, SAXPY, "sm_80", str(cache), KEY) == first
    files[0].write_bytes(stored[: len(stored) // 2])  # truncated: recompiled and rewritten
    assert _C.nvrtc_compile(nvrtc, SAXPY, "sm_80", str(cache), KEY) == first
    assert files[0].read_bytes() == stored
    # another arch is another entry (and cache_dir may be any os.PathLike)
    _C.nvrtc_compile(nvrtc, SAXPY, "sm_90", cache, KEY)
    assert len(list(cache.glob("*.cubin"))) == 2
    assert not list(cache.glob("*.tmp.*"))


def _trailer(stored: bytes, cubin: bytes) -> dict:
    t = stored[len(cubin):]
    return {"magic": t[:8], "size": int.from_bytes(t[8:16], "little"), "nvrtc": int.from_bytes(t[16:20], "little"),
            "arch": t[24:40].rstrip(b"\0").decode(), "source_sha256": t[40:72], "mac": t[72:]}


def test_cache_file_says_what_it_is_and_is_signed(nvrtc, tmp_path):
    """The trailer claims the source's hash, the arch and the NVRTC version, and carries the
    HMAC-SHA256 under the key of the CUBIN and those claims (checked here against Python's hmac)."""
    cubin = _C.nvrtc_compile(nvrtc, SAXPY, "sm_80", tmp_path, KEY)
    (f,) = tmp_path.glob("*.cubin")
    stored = f.read_bytes()
    t = _trailer(stored, cubin)
    assert t["magic"] == b"KBCUBIN2" and t["size"] == len(cubin) and t["arch"] == "sm_80"
    assert t["nvrtc"] == _C.nvrtc_info(nvrtc)[1]
    assert t["source_sha256"] == hashlib.sha256(SAXPY.encode()).digest()
    assert t["mac"] == hmac.new(KEY, stored[:-32], hashlib.sha256).digest()


def test_tampered_cubin_is_recompiled_not_loaded(nvrtc, tmp_path):
    """An attacker who can write the cache folder but does not hold the key: a CUBIN changed under
    a trailer made the old way (a checksum of the bytes) or with a key of their own, or another
    kernel's genuine entry put under this one's name, is recompiled and the file replaced."""
    good = _C.nvrtc_compile(nvrtc, SAXPY, "sm_80", tmp_path, KEY)
    (f,) = tmp_path.glob("*.cubin")
    stored = f.read_bytes()
    evil = bytearray(good)
    evil[len(evil) // 2] ^= 0xFF                      # "patched" code
    evil = bytes(evil)
    t = stored[len(good):-32]
    forged = [evil + t + hmac.new(b"attacker's own key, 32 bytes....", evil + t, hashlib.sha256).digest(),
              evil + t + stored[-32:]]                  # the genuine MAC does not cover other bytes
    other = _C.nvrtc_compile(nvrtc, SAXPY.replace("saxpy", "saxpy2"), "sm_80", tmp_path / "o", KEY)
    (of,) = (tmp_path / "o").glob("*.cubin")
    forged.append(of.read_bytes())                    # signed with the key, but for another source
    for planted in forged:
        f.write_bytes(planted)
        got = _C.nvrtc_compile(nvrtc, SAXPY, "sm_80", tmp_path, KEY)
        assert got == good and got != evil and got != other
        assert f.read_bytes() == stored               # replaced by the recompiled, signed entry


def test_cache_needs_a_key(nvrtc, tmp_path):
    with pytest.raises(ValueError, match="key"):
        _C.nvrtc_compile(nvrtc, SAXPY, "sm_80", str(tmp_path))
    with pytest.raises(ValueError, match="key"):
        _C.nvrtc_compile(nvrtc, SAXPY, "sm_80", str(tmp_path), b"short")
    assert not list(tmp_path.iterdir())


def test_compile_signs_with_the_users_key_file(nvrtc, tmp_path, monkeypatch):
    """kbench.runtime.nvrtc.compile: the key file is made 0600 in the cache folder on first use;
    a key file that is not private is not trusted, and then no CUBIN is read from disk."""
    from kbench import keyfile
    from kbench.runtime import nvrtc as nv
    monkeypatch.setenv("KBENCH_CACHE_DIR", str(tmp_path))
    cubin = nv.compile(SAXPY, "sm_80")
    key_file = tmp_path / keyfile.KEY_NAME
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(key_file.read_bytes()) == 32
    (f,) = (tmp_path / "cubin").glob("*.cubin")
    assert hmac.new(key_file.read_bytes(), f.read_bytes()[:-32], hashlib.sha256).digest() == f.read_bytes()[-32:]
    key_file.chmod(0o644)
    f.write_bytes(b"\x7fELF" + b"\0" * 500)           # a planted file: never read while the key is untrusted
    with pytest.warns(RuntimeWarning, match="readable or writable by others"):
        assert nv.compile(SAXPY, "sm_80") == cubin


def test_cache_dir_that_cannot_exist(nvrtc, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OSError):
        _C.nvrtc_compile(nvrtc, SAXPY, "sm_80", str(blocker / "cubin"), KEY)


def test_parallel_compiles(nvrtc, tmp_path):
    # the GIL is released while NVRTC works; each thread has its own error context
    results, errors = {}, []

    def work(i):
        try:
            src = SAXPY.replace("saxpy", f"saxpy{i}")
            results[i] = _C.nvrtc_compile(nvrtc, src, "sm_80", str(tmp_path) if i % 2 else None, KEY)
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
