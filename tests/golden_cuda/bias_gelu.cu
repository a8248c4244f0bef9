// kbench: region 0 (POINTWISE), float compute
// genome: threads=128 vec=8 rows=1 items=1 cache=regs two_pass=1 fast_math=1 persistent=0 col_split=1
// in  x = %0 = input user "x" : bf16[s0,768]
// in  bias = %1 = input param "bias" : bf16[768]
//   %2 = reshape %1 : bf16[1,768]
//   %3 = expand %2 : bf16[s0,768]
//   %4 = add %0, %3 : bf16[s0,768]
//   %5 = gelu_tanh %4 : bf16[s0,768]
// out out = %5
// s0 = s0
#include <cuda_bf16.h>

template <typename T, int N> struct alignas(sizeof(T) * N) kb_vec { T v[N]; };
// N elements at p in accesses of at most 16 bytes (p is 16-byte aligned, or N*sizeof(T)-aligned)
template <typename T, int N> __device__ __forceinline__ kb_vec<T, N> kb_ld(const T *p) {
    constexpr int C = sizeof(T) * N > 16 ? 16 / (int)sizeof(T) : N;
    kb_vec<T, N> r;
#pragma unroll
    for (int j = 0; j < N; j += C) *reinterpret_cast<kb_vec<T, C> *>(&r.v[j]) = *reinterpret_cast<const kb_vec<T, C> *>(p + j);
    return r;
}
template <typename T, int N> __device__ __forceinline__ void kb_st(T *p, const kb_vec<T, N> &r) {
    constexpr int C = sizeof(T) * N > 16 ? 16 / (int)sizeof(T) : N;
#pragma unroll
    for (int j = 0; j < N; j += C) *reinterpret_cast<kb_vec<T, C> *>(p + j) = *reinterpret_cast<const kb_vec<T, C> *>(&r.v[j]);
}
// fast-math exp: ex2.approx with denormal results flushed to zero, two instructions (__expf
// without -ftz wraps the same approximation in a denormal fix-up)
__device__ __forceinline__ float kb_fexp(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.44269504088896341f));
    return y;
}
// element k of a bf16 vector as float, from its 32-bit word: the upper element is one mask (a
// byte permute and a shift otherwise)
template <int N> __device__ __forceinline__ float kb_bf16_at(const kb_vec<__nv_bfloat16, N> &x, int k) {
    const unsigned w = *reinterpret_cast<const unsigned *>(&x.v[k & ~1]);
    return __uint_as_float(k & 1 ? w & 0xffff0000u : w << 16);
}

extern "C" __global__ void __launch_bounds__(128) kb_r0_pointwise(const __nv_bfloat16 *__restrict__ x, const __nv_bfloat16 *__restrict__ bias, __nv_bfloat16 *__restrict__ out, long long s0)
{
    const long long n = (768*s0);
    // 128 threads x 1 chunk(s) of 8 element(s) per block, grid-stride
    for (long long q0 = (long long)blockIdx.x * 128; q0 * 8 < n; q0 += (long long)gridDim.x * 128) {
        #pragma unroll
        for (int it = 0; it < 1; ++it) {
            const long long i0 = (q0 + it * 128 + threadIdx.x) * 8;
            if (i0 + 8 <= n) {
                const long long a1_0 = i0 % 768;
                const kb_vec<__nv_bfloat16, 8> x0_1 = kb_ld<__nv_bfloat16, 8>(x + i0);
                const kb_vec<__nv_bfloat16, 8> x1_3 = kb_ld<__nv_bfloat16, 8>(bias + a1_0);
                kb_vec<__nv_bfloat16, 8> y5;
                #pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const float v0 = kb_bf16_at(x0_1, k);
                    const float v1_2 = kb_bf16_at(x1_3, k);
                    const float v4 = (v0 + v1_2);
                    const float v5 = (v4 / (1.f + kb_fexp(-1.5957691216f * (v4 + 0.044715f * v4 * v4 * v4))));
                    y5.v[k] = __float2bfloat16_rn((float)(v5));
                }
                kb_st<__nv_bfloat16, 8>(out + i0, y5);
            } else {
                for (long long i1 = i0; i1 < n; ++i1) {  // the tail: one element at a time
                    {
                        const long long i = i1;
                        const long long a1 = i % 768;
                        const float v0 = __bfloat162float(x[i]);
                        const float v1_4 = __bfloat162float(bias[a1]);
                        const float v4 = (v0 + v1_4);
                        const float v5 = (v4 / (1.f + kb_fexp(-1.5957691216f * (v4 + 0.044715f * v4 * v4 * v4))));
                        out[i] = __float2bfloat16_rn((float)(v5));
                    }
                }
            }
        }
    }
}
