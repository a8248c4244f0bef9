// kb_gemm_bf16_nt_128x128x32_w2x4_s4_b2: out[b] = epilogue(A[b] @ B^T[b]) on tensor cores (kbench codegen/gemm.c, sm_90).
//   A   [batch, M, K] bf16, row stride lda
//   B   [batch, N, K] (a Linear's weight) bf16, row stride ldb, one for every batch
//   out [batch, M, N] bf16, contiguous; f32 accumulation
//   epilogue: acc * alpha + bias_n[col] (bf16) -> gelu_tanh -> + residual[b, row, col] (bf16)
// Block tile 128x128, K in steps of 32; 8 warps as 2 (M) x 4 (N), each a 64x32 warp tile of
// 4x4 mma.sync m16n8k16. A 4-stage cp.async ring (65536 bytes of shared memory) keeps 3 k-tiles in
// flight while the warps multiply the oldest, 2 blocks an SM at once; fragments come from
// XOR-swizzled shared memory by ldmatrix. Blocks run in groups of 8 tile rows (grid.x), so a
// wave's tiles share A and B in L2.
// Requires (the launcher checks): K, lda, ldb and the batch strides multiples of 8 elements,
// A, B and out 16-byte aligned. Edges: zero-filled loads, predicated stores (pairs where N is even).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// cp.async of one 16-byte chunk global -> shared; src_size 0 reads nothing and fills zeros,
// which is how rows past M or N and columns past K enter the tile (the tails are exact).
__device__ __forceinline__ void kb_cp_async16(unsigned dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void kb_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// wait until at most N of this thread's committed groups are still in flight
template <int N> __device__ __forceinline__ void kb_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

// Four 8x8 b16 matrices: lanes 8i..8i+7 give the row addresses of matrix i, register i of
// every lane receives its part of matrix i (lane l: row l/4, columns 2(l%4), 2(l%4)+1; with
// .trans the matrix is read transposed: row 2(l%4)+{0,1}, column l/4).
__device__ __forceinline__ void kb_ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void kb_ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// d += a @ b on one m16n8k16 tile. Per lane (g = lane / 4, t = lane % 4), each register two
// 16-bit values, low half first:
//   a[0] = A[g][2t..2t+1]  a[1] = A[g+8][2t..]  a[2] = A[g][2t+8..]  a[3] = A[g+8][2t+8..]
//   b[0] = B[2t..2t+1][g]  b[1] = B[2t+8..2t+9][g]       (B is k x n, read down a column)
//   d[0], d[1] = D[g][2t], D[g][2t+1]    d[2], d[3] = D[g+8][2t], D[g+8][2t+1]
__device__ __forceinline__ void kb_mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The byte offset of 16-byte chunk c of row r in a tile of CPR chunks a row. Within each
// 128-byte line (8 chunks, all 32 banks) the chunk index is XORed with a key that differs
// between the 8 rows one ldmatrix reads at the same logical chunk (the line's index where a
// line holds several short rows, the row's index mod 8 where a row spans lines): its eight
// 16-byte reads then fall in eight distinct bank groups, and the eight chunks of a line
// that eight consecutive threads fill with cp.async stay in that line, also conflict-free.
template <int CPR> __device__ __forceinline__ unsigned kb_swizzle(int r, int c) {
    const int q = r * CPR + c;
    const int key = CPR >= 8 ? (r & 7) : ((q >> 3) & 7);
    return (unsigned)(q ^ key) * 16u;
}

extern "C" __global__ void __launch_bounds__(256, 2) kb_gemm_bf16_nt_128x128x32_w2x4_s4_b2(
    __nv_bfloat16 *__restrict__ out,
    const __nv_bfloat16 *__restrict__ A,
    const __nv_bfloat16 *__restrict__ B,
    const long long M, const long long N, const long long K,
    const long long lda, const long long ldb,
    const long long stride_a,
    const float alpha,
    const __nv_bfloat16 *__restrict__ bias_n,
    const __nv_bfloat16 *__restrict__ residual) {
    constexpr int BM = 128, BN = 128, BK = 32, STAGES = 4;
    constexpr int WARPS_M = 2, WTM = 64, WTN = 32, MI = 4, NI = 4;
    constexpr unsigned A_STAGE = 8192, B_STAGE = 8192;  // bytes of one stage's A and B tiles
    extern __shared__ __align__(128) unsigned char kb_smem[];
    // stage s: A tile at s * A_STAGE, B tile at STAGES * A_STAGE + s * B_STAGE
    const unsigned smem = (unsigned)__cvta_generic_to_shared(kb_smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int warp_m = warp % WARPS_M, warp_n = warp / WARPS_M;
    
    // this block's tile: block ids walk down groups of 8 tile rows, column by column
    const long long tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
    const long long pid = blockIdx.x, group = 8 * tiles_n, first_m = pid / group * 8;
    const long long group_m = tiles_m - first_m < 8 ? tiles_m - first_m : 8;
    const long long m0 = (first_m + pid % group % group_m) * BM, n0 = (pid % group / group_m) * BN;
    if (m0 >= M || n0 >= N) return;
    const long long bz = blockIdx.z;
    const __nv_bfloat16 *Ab = A + bz * stride_a;
    const __nv_bfloat16 *Bb = B;
    const long long ktiles = (K + BK - 1) / BK;
    
    // k-tile kt into stage s; out-of-range chunks are zeros
    auto load_tile = [&](int s, long long kt) {
        const long long k0 = kt * BK;
        const unsigned sa = smem + s * A_STAGE, sb = smem + STAGES * A_STAGE + s * B_STAGE;
        // A tile, BM rows (m) x BK columns (k): 128 x 4 chunks of 16 bytes, 2 per thread
        #pragma unroll
        for (int j = 0; j < 2; j++) {
            const int i = tid + j * 256;
            const int r = i / 4, c = i % 4;
            const long long gr = m0 + r, gc = k0 + c * 8;
            const bool ok = gr < M && gc < K;
            kb_cp_async16(sa + kb_swizzle<4>(r, c), ok ? Ab + gr * lda + gc : A, ok);
        }
        // B tile, BN rows (n) x BK columns (k): 128 x 4 chunks of 16 bytes, 2 per thread
        #pragma unroll
        for (int j = 0; j < 2; j++) {
            const int i = tid + j * 256;
            const int r = i / 4, c = i % 4;
            const long long gr = n0 + r, gc = k0 + c * 8;
            const bool ok = gr < N && gc < K;
            kb_cp_async16(sb + kb_swizzle<4>(r, c), ok ? Bb + gr * ldb + gc : B, ok);
        }
    };
    
    float acc[MI][NI][4];
    #pragma unroll
    for (int i = 0; i < MI; i++)
    #pragma unroll
        for (int j = 0; j < NI; j++)
    #pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
    
    // prologue: k-tiles 0 .. STAGES-2 in flight, one commit group each (empty past the end, so
    // group g always holds k-tile g and wait_group counts stay exact)
    #pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < ktiles) load_tile(s, s);
        kb_cp_async_commit();
    }
    for (long long kt = 0; kt < ktiles; kt++) {
        // k-tile kt has landed (at most STAGES-2 younger groups pending) and every warp is done with
        // the stage computed last iteration, which the load below refills
        kb_cp_async_wait<STAGES - 2>();
        __syncthreads();
        if (kt + STAGES - 1 < ktiles) load_tile((int)((kt + STAGES - 1) % STAGES), kt + STAGES - 1);
        kb_cp_async_commit();
        const int s = (int)(kt % STAGES);
        const unsigned sa = smem + s * A_STAGE, sb = smem + STAGES * A_STAGE + s * B_STAGE;
        #pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            // A fragments: matrix q of ldmatrix.x4 (lanes 8q..8q+7 address it) is rows (q & 1) * 8 + 0..7,
            // k chunk q >> 1 of this 16x16 block: lane l addresses row l & 15, chunk l >> 4 -> a[0..3]
            unsigned a[MI][4], b[NI][2];
            #pragma unroll
            for (int i = 0; i < MI; i++)
                kb_ldmatrix_x4(a[i], sa + kb_swizzle<4>(warp_m * WTM + i * 16 + (lane & 15), kk * 2 + (lane >> 4)));
            #pragma unroll
            for (int j = 0; j < NI; j += 2) {
                unsigned r[4];
                // B^T tile rows are n: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
                // read as stored give each lane B[2t..2t+1][g]: b[j] = r[0], r[1]; b[j + 1] = r[2], r[3]
                kb_ldmatrix_x4(r, sb + kb_swizzle<4>(warp_n * WTN + j * 8 + (lane & 7) + ((lane >> 4) << 3),
                                                      kk * 2 + ((lane >> 3) & 1)));
                b[j][0] = r[0], b[j][1] = r[1], b[j + 1][0] = r[2], b[j + 1][1] = r[3];
            }
            #pragma unroll
            for (int i = 0; i < MI; i++)
            #pragma unroll
                for (int j = 0; j < NI; j++) kb_mma_16816(acc[i][j], a[i], b[j]);
        }
    }
    kb_cp_async_wait<0>();  // no copy outlives the block (the last groups are empty)
    
    // epilogue: lane (g, t) holds rows g and g + 8, columns 2t and 2t + 1 of each m16n8 tile
    #pragma unroll
    for (int i = 0; i < MI; i++) {
        #pragma unroll
        for (int h = 0; h < 2; h++) {
            const long long row = m0 + warp_m * WTM + i * 16 + h * 8 + (lane >> 2);
            if (row >= M) continue;
            __nv_bfloat16 *orow = out + (bz * M + row) * N;
            #pragma unroll
            for (int j = 0; j < NI; j++) {
                const long long col = n0 + warp_n * WTN + j * 8 + (lane & 3) * 2;
                if (col >= N) continue;
                float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
                {
                    v0 *= alpha;
                    v0 += __bfloat162float(bias_n[col]);
                    { const float x = v0; v0 = (x / (1.f + expf(-1.5957691216f * (x + 0.044715f * x * x * x)))); }  // gelu_tanh, ops.def's template
                    v0 += __bfloat162float(residual[(bz * M + row) * N + col]);
                }
                if (col + 1 < N) {
                    const long long col1 = col + 1;
                    v1 *= alpha;
                    v1 += __bfloat162float(bias_n[col1]);
                    { const float x = v1; v1 = (x / (1.f + expf(-1.5957691216f * (x + 0.044715f * x * x * x)))); }  // gelu_tanh, ops.def's template
                    v1 += __bfloat162float(residual[(bz * M + row) * N + col1]);
                }
                if (col + 1 < N && (N & 1) == 0) {  // an even N keeps (row * N + col) even: an aligned pair
                    *reinterpret_cast<__nv_bfloat162 *>(orow + col) = __floats2bfloat162_rn(v0, v1);
                } else {
                    orow[col] = __float2bfloat16_rn((float)(v0));
                    if (col + 1 < N) orow[col + 1] = __float2bfloat16_rn((float)(v1));
                }
            }
        }
    }
}
