"""The CUDA runtime through kbench._C on a GPU: device info against torch's, compile → load →
launch on torch's current stream with tensors' data_ptr(), bf16/fp16 kernels, dynamic shared
memory above 48 KiB, a launch from a thread torch never touched, and CudaError on bad launches."""
import gc
import glob
import os
import sys
import threading
import time

import pytest
import torch

from kbench import _C

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

SAXPY = r"""
extern "C" __global__ void saxpy(float *y, const float *x, long long n, float a) {
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

# reverses each block's chunk through dynamic shared memory (smem = block * 4 * per_thread bytes)
SMEM = r"""
extern "C" __global__ void reverse_chunks(float *y, const float *x, long long per_thread) {
    extern __shared__ float buf[];
    long long chunk = (long long)blockDim.x * per_thread, base = (long long)blockIdx.x * chunk;
    for (long long j = threadIdx.x; j < chunk; j += blockDim.x) buf[j] = x[base + j];
    __syncthreads();
    for (long long j = threadIdx.x; j < chunk; j += blockDim.x) y[base + j] = buf[chunk - 1 - j];
}
"""


def _wheel_dirs():
    dirs = []
    for base in sys.path:
        dirs += sorted(glob.glob(os.path.join(base or ".", "nvidia", "*", "lib")))
    return dirs


@pytest.fixture(scope="module")
def rt():
    torch.zeros(1, device="cuda")  # torch creates (and makes current) the primary context first
    cuda = _C.cuda_open()
    try:
        nv = _C.nvrtc_open(_wheel_dirs())
    except FileNotFoundError as e:
        pytest.fail(f"no NVRTC on a GPU machine (kbench compiles every kernel with it): {e}", pytrace=False)
    dev = _C.device_info(cuda, torch.cuda.current_device())
    return cuda, nv, dev, f"sm_{dev['sm']}"


def _load(rt, source, name, smem=0):
    cuda, nv, _, arch = rt
    cubin = _C.nvrtc_compile(nv, source, arch, None)
    module = _C.module_load(cuda, cubin)
    fn, regs, spills = _C.get_function(cuda, module, name, smem)
    return module, fn, regs, spills


def test_device_info_matches_torch(rt):
    _, _, dev, _ = rt
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert dev["sm"] == props.major * 10 + props.minor
    assert dev["num_sms"] == props.multi_processor_count
    assert dev["l2_bytes"] == props.L2_cache_size
    assert dev["max_smem_per_block"] >= 48 * 1024
    assert dev["regs_per_sm"] >= 65536
    assert dev["driver_version"] >= 11000


def test_saxpy_on_current_stream(rt):
    cuda = rt[0]
    module, fn, regs, spills = _load(rt, SAXPY, "saxpy")
    assert regs > 0 and spills == 0
    n = 100_003
    x = torch.randn(n, device="cuda")
    y = torch.randn(n, device="cuda")
    want = 2.5 * x + y
    _C.launch(cuda, fn, ((n + 255) // 256, 1, 1), 256, 0, None, (y, x, n, 2.5))
    torch.cuda.synchronize()
    torch.testing.assert_close(y, want)
    del module


def test_saxpy_on_a_side_stream(rt):
    cuda = rt[0]
    module, fn, _, _ = _load(rt, SAXPY, "saxpy")
    n = 4097
    x = torch.randn(n, device="cuda")
    y = torch.zeros(n, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _C.launch(cuda, fn, (n + 127) // 128, 128, 0, side, [y, x, n, -1.0])
    side.synchronize()
    torch.testing.assert_close(y, -x)
    del module


def test_bf16_fp16_kernel(rt):
    cuda = rt[0]
    module, fn, _, _ = _load(rt, HALVES, "halves")
    n = 1000
    b = torch.randn(n, device="cuda").to(torch.bfloat16)
    h = torch.randn(n, device="cuda").to(torch.float16)
    f = torch.empty(n, device="cuda")
    v = b.float() + h.float()
    _C.launch(cuda, fn, (4, 1, 1), 256, 0, torch.cuda.current_stream(), (b, h, f, n))
    torch.cuda.synchronize()
    torch.testing.assert_close(f, v)
    torch.testing.assert_close(b, (v * 2).to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(h, (v * 0.5).to(torch.float16), rtol=0, atol=0)
    del module


def test_dynamic_shared_memory_above_48k(rt):
    cuda, _, dev, _ = rt
    block, per_thread = 256, 64  # 64 KiB of shared memory
    smem = block * per_thread * 4
    assert smem <= dev["max_smem_per_block"]
    stream = torch.cuda.current_stream()
    x = torch.randn(3 * block * per_thread, device="cuda")
    y = torch.empty_like(x)
    # without the opt-in the driver refuses the launch
    module0, fn0, _, _ = _load(rt, SMEM, "reverse_chunks", 0)
    with pytest.raises(_C.CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        _C.launch(cuda, fn0, 3, block, smem, stream, (y, x, per_thread))
    module, fn, _, _ = _load(rt, SMEM, "reverse_chunks", smem)
    _C.launch(cuda, fn, 3, block, smem, stream, (y, x, per_thread))
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x.view(3, -1).flip(1).reshape(-1))
    del module, module0


def test_launch_from_a_fresh_thread(rt):
    # a thread torch never touched has no current context: the launch must still work
    cuda = rt[0]
    module, fn, _, _ = _load(rt, SAXPY, "saxpy")
    n = 1024
    x = torch.ones(n, device="cuda")
    y = torch.zeros(n, device="cuda")
    torch.cuda.synchronize()
    errors = []

    def work():
        try:
            _C.launch(cuda, fn, 4, 256, 0, None, (y, x, n, 3.0))
            _C.synchronize(cuda)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not errors, errors
    torch.testing.assert_close(y, torch.full_like(y, 3.0))
    del module


def test_bad_launches_raise_cuda_error(rt):
    cuda = rt[0]
    module, fn, _, _ = _load(rt, SAXPY, "saxpy")
    x = torch.ones(16, device="cuda")
    stream = torch.cuda.current_stream()
    with pytest.raises(_C.CudaError, match="cuLaunchKernel.*CUDA_ERROR_INVALID_VALUE"):
        _C.launch(cuda, fn, 1, 4096, 0, stream, (x, x, 16, 1.0))
    with pytest.raises(_C.CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        _C.launch(cuda, fn, (0, 1, 1), 32, 0, stream, (x, x, 16, 1.0))
    with pytest.raises(_C.CudaError, match="CUDA_ERROR_NOT_FOUND"):
        _C.get_function(cuda, module, "no_such_kernel", 0)
    with pytest.raises(ValueError, match="CUBIN"):
        _C.module_load(cuda, b"\x7fELF" + b"\0" * 10)
    with pytest.raises(TypeError):
        _C.launch(cuda, fn, 1, 32, 0, stream, None)
    with pytest.raises(TypeError):   # an address is not a function
        _C.launch(cuda, 0, 1, 32, 0, stream, ())
    # the context is still usable after refused launches
    _C.launch(cuda, fn, 1, 32, 0, stream, (x, x, 16, 1.0))
    torch.cuda.synchronize()
    torch.testing.assert_close(x, torch.full_like(x, 2.0))
    del module



def test_launch_takes_tensors_never_addresses(rt):
    """A pointer argument is a CUDA tensor's own data pointer and a stream torch's stream object:
    an address in either place, a host tensor, a tensor subclass and a forged data_ptr are
    refused or ignored before anything reaches the driver."""
    cuda = rt[0]
    module, fn, _, _ = _load(rt, SAXPY, "saxpy")
    x = torch.ones(16, device="cuda")
    y = torch.zeros(16, device="cuda")
    with pytest.raises(ValueError, match="not a CUDA tensor"):
        _C.launch(cuda, fn, 1, 32, 0, None, (y, torch.ones(16), 16, 1.0))
    with pytest.raises(TypeError, match="torch.cuda.Stream"):   # a raw stream handle
        _C.launch(cuda, fn, 1, 32, 0, torch.cuda.current_stream().cuda_stream, (y, x, 16, 1.0))
    with pytest.raises(TypeError, match="torch.cuda.Stream"):
        _C.synchronize(cuda, 0)

    class Sub(torch.Tensor):
        pass
    with pytest.raises(TypeError, match="args\\[1\\]"):
        _C.launch(cuda, fn, 1, 32, 0, None, (y, x.as_subclass(Sub), 16, 1.0))
    with pytest.raises(TypeError, match="args\\[0\\]"):
        _C.launch(cuda, fn, 1, 32, 0, None, (True, x, 16, 1.0))
    with pytest.raises(TypeError, match="needs a tensor"):
        _C.launch(cuda, fn, 1, 32, 0, None, (16, 1.0))
    y.data_ptr = lambda: 0xdead0000   # an instance attribute: launch reads torch's own pointer
    _C.launch(cuda, fn, 1, 32, 0, None, [y, x, 16, 2.0])
    _C.synchronize(cuda, torch.cuda.current_stream())
    torch.testing.assert_close(y, torch.full_like(y, 2.0))
    del module

# a module whose __device__ array takes 64 MiB of device memory while it is loaded
BIG = r"""
__device__ float kb_big[16 << 20];
extern "C" __global__ void touch_big(float *y) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    kb_big[i * 4096] = (float)i;
    y[i] = kb_big[i * 4096];
}
"""


def test_modules_unload_when_collected(rt):
    """A module handle unloads its CUmodule when Python drops it: a loaded module with a 64 MiB
    __device__ array holds that much device memory (checked, so the measure can see a module),
    gives it back once its handle is gone, and 50 such modules loaded and dropped one after
    another leave the free memory where it was (a leak would hold 3.2 GiB)."""
    cuda, nv, _, arch = rt
    big = 64 << 20
    cubin = _C.nvrtc_compile(nv, BIG, arch, None)
    y = torch.zeros(4096, device="cuda")   # torch's memory, taken before the baseline
    stream = torch.cuda.current_stream()

    def load_and_touch():
        module = _C.module_load(cuda, cubin)
        fn, _, _ = _C.get_function(cuda, module, "touch_big", 0)
        _C.launch(cuda, fn, 16, 256, 0, stream, (y,))   # the array is in use
        torch.cuda.synchronize()
        return module

    def free_bytes():
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    free0 = free_bytes()
    module = load_and_touch()
    held = free0 - free_bytes()
    assert held >= big // 2, f"a loaded module with a 64 MiB array took {held >> 20} MiB of device memory"
    assert torch.equal(y[:8].cpu(), torch.arange(8, dtype=torch.float32))
    del module
    back = free0 - free_bytes()
    assert back < big // 2, f"{back >> 20} MiB still held after the module's handle was dropped"
    for _ in range(50):
        module = load_and_touch()
        del module
    lost = free0 - free_bytes()
    assert lost < 2 * big, f"{lost >> 20} MiB of device memory held after 50 modules were loaded and dropped"


def test_launch_overhead_is_reported(rt, capsys):
    cuda = rt[0]
    module, fn, _, _ = _load(rt, SAXPY, "saxpy")
    x = torch.ones(256, device="cuda")
    stream = torch.cuda.current_stream()
    args = (x, x, 256, 0.0)
    for _ in range(100):
        _C.launch(cuda, fn, 1, 256, 0, stream, args)
    torch.cuda.synchronize()
    reps = 500  # below the launch queue depth, so this is host time, not GPU time
    t0 = time.perf_counter()
    for _ in range(reps):
        _C.launch(cuda, fn, 1, 256, 0, stream, args)
    host_us = (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    with capsys.disabled():
        print(f"\n_C.launch: {host_us:.2f} us per launch (host side, queue not full)")
    assert torch.all(x == 1.0)
    del module
