"""Soft verification (kbench/agent/soft.py, cubin.py): planted bugs are found before any GPU —
a missing barrier, a shared read before any write, a constant slot one thread writes and all
read, a host call in device code — and correct kernels pass, kbench's own generated kernels
among them; ptxas's resource use is read from the CUBIN."""
import pytest

from kbench import _C
from kbench.agent import cubin, soft

REDUCE = r'''
extern "C" __global__ void reduce(float *y, const float *x, int n) {
    __shared__ float s[256];
    int tid = threadIdx.x;
    s[tid] = x[blockIdx.x * 256 + tid];
    __syncthreads();
    for (int k = 128; k > 0; k >>= 1) {
        if (tid < k) s[tid] += s[tid + k];
        __syncthreads();
    }
    if (tid == 0) y[blockIdx.x] = s[0];
}'''
BROADCAST = r'''
extern "C" __global__ void center(float *y, const float *x) {
    __shared__ float m[1];
    if (threadIdx.x == 0) m[0] = x[0];
    __syncthreads();
    y[threadIdx.x] = x[threadIdx.x] - m[0];
}'''
TRANSPOSE = r'''
extern "C" __global__ void __launch_bounds__(1024) transpose(float *out, const float *in, int n) {
    __shared__ float tile[32][33];   // padded: no bank conflicts
    int x = blockIdx.x * 32 + threadIdx.x, y = blockIdx.y * 32 + threadIdx.y;
    if (x < n && y < n) tile[threadIdx.y][threadIdx.x] = in[y * n + x];
    __syncthreads();
    x = blockIdx.y * 32 + threadIdx.x; y = blockIdx.x * 32 + threadIdx.y;
    if (x < n && y < n) out[y * n + x] = tile[threadIdx.x][threadIdx.y];
}'''
WARP_SYNCHRONOUS = r'''
__device__ void warp_reduce(volatile float *s, int tid) { s[tid] += s[tid + 32]; s[tid] += s[tid + 16]; }
extern "C" __global__ void legacy(float *y, const float *x) {
    __shared__ volatile float s[64];
    s[threadIdx.x] = x[threadIdx.x];
    if (threadIdx.x < 32) { s[threadIdx.x] += s[threadIdx.x + 32]; }
    y[0] = s[0];
}'''

PLANTED = [
    ("missing barrier", REDUCE.replace("    __syncthreads();\n    for", "    for"), "s[tid + k]"),
    ("missing barrier", BROADCAST.replace("    __syncthreads();\n", ""), "m[0]"),
    ("missing barrier", TRANSPOSE.replace("    __syncthreads();\n", ""), "tile[threadIdx.x][threadIdx.y]"),
    ("shared read before write", r'''
extern "C" __global__ void k(float *y) { __shared__ float t[32]; y[threadIdx.x] = t[threadIdx.x]; }''', "t[threadIdx.x]"),
    ("shared read before write", r'''
extern "C" __global__ void k(float *y, const float *x) {
    __shared__ float t[64];
    y[threadIdx.x] = t[63 - threadIdx.x];   // read first
    t[threadIdx.x] = x[threadIdx.x];
}''', "t[63 - threadIdx.x]"),
    ("host call", r'''
#include <torch/extension.h>
__global__ void k(float *y, torch::Tensor x) { y[0] = x.item<float>(); }
torch::Tensor forward(torch::Tensor x) { return x; }''', ".item<"),
    ("host call", r'''
extern "C" __global__ void k(float *y) { float *p; cudaMalloc(&p, 4); y[0] = p[0]; }''', "cudaMalloc("),
]


@pytest.mark.parametrize("kind,src,what", PLANTED, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(PLANTED)])
def test_planted_bugs_are_found(kind, src, what):
    findings = soft.analyze(src)
    assert findings and findings[0].kind == kind and what in findings[0].detail, findings


@pytest.mark.parametrize("src", [REDUCE, BROADCAST, TRANSPOSE, WARP_SYNCHRONOUS])
def test_correct_kernels_pass(src):
    assert soft.analyze(src) == []


def test_kbench_generated_kernels_pass():
    """No finding on kbench's own kernels: row, column and split schedules, shared-memory
    caches and cross-warp reductions (sources only: nothing compiled)."""
    from test_codegen import CASES, build
    seen = 0
    for name, dt in CASES[::2]:
        g, symvals, _, _ = build(name, dt)
        p = g.partition()
        for r in range(len(p)):
            base = _C.genome_default(p, r, symvals)
            for genome in (base, base.replace(cache="smem"), base.replace(row_split=4, rows=1, persistent=0)):
                try:
                    src = _C.generate(p, r, 90, genome).source
                except ValueError:
                    continue
                seen += "__shared__" in src
                assert soft.analyze(src) == [], (name, dt, r, str(genome))
    assert seen >= 10


def test_resources_from_the_cubin(nvrtc):
    src = REDUCE + r'''
extern "C" __global__ void spill(float *y, const float *x, int n, int k) {
    float a[256];
    for (int j = 0; j < 256; j++) a[j] = x[j * n];
    y[0] = a[k];
}'''
    for arch in ("sm_80", "sm_90"):
        res = cubin.resources(_C.nvrtc_compile(nvrtc, src, arch, None))
        assert res["reduce"]["shared_bytes"] == 1024 and 0 < res["reduce"]["registers"] <= 255
        assert res["reduce"]["local_bytes"] == 0 and res["spill"]["local_bytes"] >= 1024, res
    v = soft.check(src, compile_fn=lambda s, a: _C.nvrtc_compile(nvrtc, s, a, None), max_shared_bytes=512)
    assert not v.passed and {f.kind for f in v.findings} == {"resources"}, v.describe()
    assert any("local memory" in f.detail and not f.fatal for f in v.findings)
    bad = soft.check("extern \"C\" __global__ void k(float *y) { y[0] = undefined_name; }",
                     compile_fn=lambda s, a: _C.nvrtc_compile(nvrtc, s, a, None))
    assert not bad.passed and bad.findings[0].kind == "compile" and "undefined" in bad.findings[0].detail


def test_not_a_cubin_is_refused():
    with pytest.raises(ValueError, match="ELF"):
        cubin.resources(b"not an elf")
    with pytest.raises(ValueError, match="section table"):
        cubin.resources(b"\x7fELF\x02\x01" + b"\0" * 34 + b"\xff" * 8 + b"\0" * 14 + b"\x40\x00\x10\x00\x00\x00")
