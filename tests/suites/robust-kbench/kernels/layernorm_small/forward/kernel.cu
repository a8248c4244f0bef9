// A robust-kbench candidate in its kernel.cu format, for tests/gpu/test_suite_kernel_cu.py: the
// forward of tasks/layernorm_small (forward_fn(x, weight, bias, eps): LayerNorm over the trailing
// dims that weight has). PYBIND11_MODULE exposes `forward` with forward_fn's arguments.
//
// One block per row, three passes over it: the mean, then the squares about the mean (not a sum
// of squares minus a squared sum, which loses digits), then the output. The task's rows are
// short (at most 192 floats), so the simple schedule is all a test needs.
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

constexpr int THREADS = 256;

// The sum of one value per thread, in a fixed order (a tree over shared memory), known to all.
__device__ float block_sum(float v, float* smem) {
  smem[threadIdx.x] = v;
  __syncthreads();
  for (int s = THREADS / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) smem[threadIdx.x] += smem[threadIdx.x + s];
    __syncthreads();
  }
  float total = smem[0];
  __syncthreads();  // smem is written again by the next call
  return total;
}

__global__ void layernorm_rows(const float* __restrict__ x, const float* __restrict__ weight,
                               const float* __restrict__ bias, float* __restrict__ y, long n,
                               float eps) {
  __shared__ float smem[THREADS];
  const float* xr = x + (long)blockIdx.x * n;
  float* yr = y + (long)blockIdx.x * n;
  float s = 0.f;
  for (long i = threadIdx.x; i < n; i += THREADS) s += xr[i];
  const float mean = block_sum(s, smem) / (float)n;
  float q = 0.f;
  for (long i = threadIdx.x; i < n; i += THREADS) {
    const float d = xr[i] - mean;
    q += d * d;
  }
  const float rstd = rsqrtf(block_sum(q, smem) / (float)n + eps);
  for (long i = threadIdx.x; i < n; i += THREADS)
    yr[i] = (xr[i] - mean) * rstd * weight[i] + bias[i];
}

torch::Tensor forward(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, double eps) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat, "x: a float32 CUDA tensor");
  TORCH_CHECK(weight.sizes() == bias.sizes(), "weight and bias: one shape");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto bc = bias.contiguous();
  auto y = torch::empty_like(xc);
  const long n = wc.numel();
  const long rows = n ? xc.numel() / n : 0;
  if (rows > 0) {
    layernorm_rows<<<(unsigned)rows, THREADS, 0, c10::cuda::getCurrentCUDAStream()>>>(
        xc.data_ptr<float>(), wc.data_ptr<float>(), bc.data_ptr<float>(), y.data_ptr<float>(), n,
        (float)eps);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "LayerNorm over weight's trailing dims, one block per row (CUDA)");
}
