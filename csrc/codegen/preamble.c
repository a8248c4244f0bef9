/* preamble.c — part of the source layer of code generation: what every generated kernel starts
 * with, the region as comments, the headers its types need and the device helpers (vector loads
 * and stores, NaN-propagating max/min, fast-math exp, bf16 element reads, warp reductions, the
 * online softmax normalizer). */
#include "codegen/codegen.h"

void cg_emit_preamble(cg *c, kb_sb *sb) {
    const kb_region *rg = c->rg;
    kb_sb_printf(sb, "// kbench: region %d (%s), %s compute\n", c->r, kb_region_kind_name(rg->kind), c->ct);
    char gtext[256];
    kb_genome_format(&c->gn, gtext, sizeof gtext);
    kb_sb_printf(sb, "// genome: %s\n", gtext);
    for (int32_t i = 0; i < rg->ninputs; i++) {
        kb_sb_printf(sb, "// in  p%d = ", rg->inputs[i]);
        kb_node_dump(sb, c->g, rg->inputs[i], KB_NAME_COMMENT);
        kb_sb_puts(sb, "\n");
    }
    for (int32_t k = 0; k < rg->nnodes; k++) {
        kb_sb_puts(sb, "//   ");
        kb_node_dump(sb, c->g, rg->nodes[k], KB_NAME_COMMENT);
        kb_sb_puts(sb, "\n");
    }
    kb_sb_puts(sb, "// out");
    for (int32_t j = 0; j < rg->noutputs; j++) kb_sb_printf(sb, " p%d", rg->outputs[j]);
    kb_sb_puts(sb, "\n");
    for (int32_t s = 0; s < kb_graph_nsymbols(c->g); s++) {
        char sym[KB_NAME_COMMENT_MAX + 4];
        kb_name_comment(kb_graph_symbol_name(c->g, s), sym, sizeof sym);
        kb_sb_printf(sb, "// s%d = %s\n", s, sym);
    }
    if (c->use_bf16) kb_sb_puts(sb, "#include <cuda_bf16.h>\n");
    if (c->use_f16) kb_sb_puts(sb, "#include <cuda_fp16.h>\n");
    kb_sb_puts(sb,
               "\n#define KB_INF __int_as_float(0x7f800000)\n"
               "#define KB_NAN __int_as_float(0x7fffffff)\n"
               "template <typename T, int N> struct alignas(sizeof(T) * N) kb_vec { T v[N]; };\n"
               "// N elements at p in accesses of at most 16 bytes (p is 16-byte aligned, or N*sizeof(T)-aligned)\n"
               "template <typename T, int N> __device__ __forceinline__ kb_vec<T, N> kb_ld(const T *p) {\n"
               "    constexpr int C = sizeof(T) * N > 16 ? 16 / (int)sizeof(T) : N;\n"
               "    kb_vec<T, N> r;\n"
               "#pragma unroll\n"
               "    for (int j = 0; j < N; j += C) *reinterpret_cast<kb_vec<T, C> *>(&r.v[j]) = *reinterpret_cast<const kb_vec<T, C> *>(p + j);\n"
               "    return r;\n"
               "}\n"
               "template <typename T, int N> __device__ __forceinline__ void kb_st(T *p, const kb_vec<T, N> &r) {\n"
               "    constexpr int C = sizeof(T) * N > 16 ? 16 / (int)sizeof(T) : N;\n"
               "#pragma unroll\n"
               "    for (int j = 0; j < N; j += C) *reinterpret_cast<kb_vec<T, C> *>(p + j) = *reinterpret_cast<const kb_vec<T, C> *>(&r.v[j]);\n"
               "}\n"
               "// the same bytes as another vector type: registers carried from one row to the next stay\n"
               "// whole 32-bit words (16-bit elements would be unpacked and packed again with byte permutes)\n"
               "template <typename T, int N, typename W, int M> __device__ __forceinline__ kb_vec<T, N> kb_bits(const kb_vec<W, M> &w) {\n"
               "    return *reinterpret_cast<const kb_vec<T, N> *>(&w);\n"
               "}\n"
               "// max / min that propagate NaN like torch (sm_80+: one instruction)\n"
               "__device__ __forceinline__ float kb_maxf(float a, float b) {\n"
               "#if __CUDA_ARCH__ >= 800\n"
               "    float r;\n"
               "    asm(\"max.NaN.f32 %0, %1, %2;\" : \"=f\"(r) : \"f\"(a), \"f\"(b));\n"
               "    return r;\n"
               "#else\n"
               "    return (a > b || a != a) ? a : b;\n"
               "#endif\n"
               "}\n"
               "__device__ __forceinline__ float kb_minf(float a, float b) {\n"
               "#if __CUDA_ARCH__ >= 800\n"
               "    float r;\n"
               "    asm(\"min.NaN.f32 %0, %1, %2;\" : \"=f\"(r) : \"f\"(a), \"f\"(b));\n"
               "    return r;\n"
               "#else\n"
               "    return (a < b || a != a) ? a : b;\n"
               "#endif\n"
               "}\n"
               "__device__ __forceinline__ double kb_maxf(double a, double b) { return (a > b || a != a) ? a : b; }\n"
               "__device__ __forceinline__ double kb_minf(double a, double b) { return (a < b || a != a) ? a : b; }\n");
    if (c->gn.fast_math && !c->dbl)
        kb_sb_puts(sb, "// fast-math exp: ex2.approx with denormal results flushed to zero, two instructions (__expf\n"
                       "// without -ftz wraps the same approximation in a denormal fix-up)\n"
                       "__device__ __forceinline__ float kb_fexp(float x) {\n"
                       "    float y;\n"
                       "    asm(\"ex2.approx.ftz.f32 %0, %1;\" : \"=f\"(y) : \"f\"(x * 1.44269504088896341f));\n"
                       "    return y;\n"
                       "}\n");
    if (c->use_bf16 && c->vec > 1) /* vector elements read from their words (expr.c load) */
        kb_sb_puts(sb, "// element k of a bf16 vector as float, from its 32-bit word: the upper element is one mask (a\n"
                       "// byte permute and a shift otherwise)\n"
                       "template <int N> __device__ __forceinline__ float kb_bf16_at(const kb_vec<__nv_bfloat16, N> &x, int k) {\n"
                       "    const unsigned w = *reinterpret_cast<const unsigned *>(&x.v[k & ~1]);\n"
                       "    return __uint_as_float(k & 1 ? w & 0xffff0000u : w << 16);\n"
                       "}\n");
    /* warp reductions over W lanes (xor butterflies stay inside aligned groups of W) */
    static const char *const warp_ops[][2] = {{"kb_warp_sum", "v + w"}, {"kb_warp_max", "kb_maxf(v, w)"},
                                              {"kb_warp_min", "kb_minf(v, w)"}};
    char shv[96], shm[96], shs[96];
    snprintf(shv, sizeof shv, c->rd->shfl_xor, "v");
    snprintf(shm, sizeof shm, c->rd->shfl_xor, "m");
    snprintf(shs, sizeof shs, c->rd->shfl_xor, "s");
    for (int i = 0; i < 3; i++)
        kb_sb_printf(sb,
                     "template <int W, typename T> __device__ __forceinline__ T %s(T v) {\n"
                     "#pragma unroll\n"
                     "    for (int o = W / 2; o > 0; o >>= 1) { const T w = %s; v = %s; }\n"
                     "    return v;\n"
                     "}\n",
                     warp_ops[i][0], shv, warp_ops[i][1]);
    if (c->has_online)
        kb_sb_printf(sb,
                     "// online softmax normalizer: (max m, sum s of exp(x - m)), rescaled as m grows (NaN and inf as torch)\n"
                     "__device__ __forceinline__ float kb_exp(float x) { return %s(x); }\n"
                     "__device__ __forceinline__ double kb_exp(double x) { return exp(x); }\n"
                     "template <typename T> __device__ __forceinline__ void kb_online_add(T &m, T &s, T x) {\n"
                     "    if (x != x) { m = x; s = x; }\n"
                     "    else if (x > m) { s = x == (T)KB_INF ? (T)KB_NAN : s * kb_exp(m - x) + (T)1; m = x; }  // inf - inf\n"
                     "    else if (x != -(T)KB_INF) s += kb_exp(x - m);\n"
                     "}\n"
                     "// branch-free, one exp: the smaller max's sum is scaled by exp(min - max); equal maxima (±inf\n"
                     "// included, where min - max is NaN) need no factor; a NaN max makes the sum NaN. Lanes l and\n"
                     "// l^o compute the same fma of the same values, so a butterfly leaves equal bits everywhere.\n"
                     "template <typename T> __device__ __forceinline__ void kb_online_merge(T &m, T &s, T m2, T s2) {\n"
                     "    const bool first = m >= m2;\n"
                     "    const T mx = kb_maxf(m, m2), mn = first ? m2 : m;\n"
                     "    const T e = mn == mx ? (T)1 : kb_exp(mn - mx);\n"
                     "    s = first ? s + s2 * e : s * e + s2;\n"
                     "    m = mx;\n"
                     "}\n"
                     "template <int W, typename T> __device__ __forceinline__ void kb_warp_online(T &m, T &s) {\n"
                     "#pragma unroll\n"
                     "    for (int o = W / 2; o > 0; o >>= 1) { const T m2 = %s; const T s2 = %s; kb_online_merge(m, s, m2, s2); }\n"
                     "}\n",
                     c->gn.fast_math ? "kb_fexp" : "expf", shm, shs);
    kb_sb_puts(sb, "\n");
}
