// kbench: region 0 (ROW), float compute
// genome: threads=256 vec=8 rows=8 items=1 cache=regs two_pass=1 fast_math=0 persistent=0 col_split=1
// in  x = %0 = input user "x" : bf16[s0,1024]
// in  w = %1 = input param "w" : bf16[1024]
// in  b = %2 = input param "b" : bf16[1024]
//   %3 = mean %0 axes=[1] : bf16[s0,1]
//   %4 = expand %3 : bf16[s0,1024]
//   %5 = sub %0, %4 : bf16[s0,1024]
//   %6 = mul %5, %5 : bf16[s0,1024]
//   %7 = mean %6 axes=[1] : bf16[s0,1]
//   %8 = const 1e-05 : bf16[s0,1]
//   %9 = add %7, %8 : bf16[s0,1]
//   %10 = rsqrt %9 : bf16[s0,1]
//   %11 = expand %10 : bf16[s0,1024]
//   %12 = mul %5, %11 : bf16[s0,1024]
//   %13 = reshape %1 : bf16[1,1024]
//   %14 = expand %13 : bf16[s0,1024]
//   %15 = reshape %2 : bf16[1,1024]
//   %16 = expand %15 : bf16[s0,1024]
//   %17 = mul %12, %14 : bf16[s0,1024]
//   %18 = add %17, %16 : bf16[s0,1024]
// out out = %3
// out out1 = %10
// out out2 = %18
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
// element k of a bf16 vector as float, from its 32-bit word: the upper element is one mask (a
// byte permute and a shift otherwise)
template <int N> __device__ __forceinline__ float kb_bf16_at(const kb_vec<__nv_bfloat16, N> &x, int k) {
    const unsigned w = *reinterpret_cast<const unsigned *>(&x.v[k & ~1]);
    return __uint_as_float(k & 1 ? w & 0xffff0000u : w << 16);
}
template <int W, typename T> __device__ __forceinline__ T kb_warp_sum(T v) {
#pragma unroll
    for (int o = W / 2; o > 0; o >>= 1) { const T w = __shfl_xor_sync(0xffffffffu, v, o); v = v + w; }
    return v;
}

extern "C" __global__ void __launch_bounds__(256) kb_r0_row(const __nv_bfloat16 *__restrict__ x, const __nv_bfloat16 *__restrict__ w, const __nv_bfloat16 *__restrict__ b, __nv_bfloat16 *__restrict__ out, __nv_bfloat16 *__restrict__ out1, __nv_bfloat16 *__restrict__ out2, long long s0)
{
    const long long O = s0;  // rows
    const long long R = 1024;  // row length
    const int lane = threadIdx.x % 32, grp = threadIdx.x / 32;  // 8 rows per block, 32 threads per row
    for (long long rowbase = (long long)blockIdx.x * 8; rowbase < O; rowbase += (long long)gridDim.x * 8) {
        const long long row = rowbase + grp;
        const long long Rl = row < O ? R : 0;  // idle row slots still join the reductions
        const long long rb = row * R;
        float rc0[4][8];  // %0's share of the row, in registers
        float rc5[4][8];  // %5's share of the row, in registers

        // pass 1 over the row:
        //   mean of %0
        float acc3 = 0;
        #pragma unroll
        for (int u = 0; u < 4; ++u) {
            const long long c0 = ((long long)u * 32 + lane) * 8;
            if (c0 < Rl) {
                const kb_vec<__nv_bfloat16, 8> x0_1 = kb_ld<__nv_bfloat16, 8>(x + (rb + c0));
                #pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const float v0 = kb_bf16_at(x0_1, k);
                    rc0[u][k] = v0;
                    acc3 = acc3 + v0;
                }
            }
        }
        acc3 = kb_warp_sum<32>(acc3);
        const float v3 = acc3 / (float)R;

        // pass 2 over the row:
        //   mean of %6
        float acc7 = 0;
        #pragma unroll
        for (int u = 0; u < 4; ++u) {
            const long long c0 = ((long long)u * 32 + lane) * 8;
            if (c0 < Rl) {
                #pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const float v0 = rc0[u][k];  // from the row cache
                    const float v5 = (v0 - v3);
                    rc5[u][k] = v5;
                    const float v6 = (v5 * v5);
                    acc7 = acc7 + v6;
                }
            }
        }
        acc7 = kb_warp_sum<32>(acc7);
        const float v7 = acc7 / (float)R;
        const float v9 = (v7 + 1e-05f);
        const float v10 = rsqrtf(v9);

        // pass 3 over the row: write the outputs
        //   write %18
        #pragma unroll
        for (int u = 0; u < 4; ++u) {
            const long long c0 = ((long long)u * 32 + lane) * 8;
            if (c0 < Rl) {
                const long long a1_0 = c0;
                const kb_vec<__nv_bfloat16, 8> x1_3 = kb_ld<__nv_bfloat16, 8>(w + a1_0);
                const kb_vec<__nv_bfloat16, 8> x2_5 = kb_ld<__nv_bfloat16, 8>(b + a1_0);
                kb_vec<__nv_bfloat16, 8> y18;
                #pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const float v5 = rc5[u][k];  // from the row cache
                    const float v12 = (v5 * v10);
                    const float v1_2 = kb_bf16_at(x1_3, k);
                    const float v17 = (v12 * v1_2);
                    const float v2_4 = kb_bf16_at(x2_5, k);
                    const float v18 = (v17 + v2_4);
                    y18.v[k] = __float2bfloat16_rn((float)(v18));
                }
                kb_st<__nv_bfloat16, 8>(out2 + (rb + c0), y18);
            }
        }

        // per-row outputs
        if (lane == 0 && row < O) {
            out[row] = __float2bfloat16_rn((float)(v3));
            out1[row] = __float2bfloat16_rn((float)(v10));
        }
    }
}
