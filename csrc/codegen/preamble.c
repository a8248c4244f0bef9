/* preamble.c — part of the source layer of code generation: what a generated kernel starts with,
 * the region as comments, the headers its types need and the device helpers it uses (vector
 * loads and stores, NaN-propagating max/min, fast-math exp, bf16 element reads, warp reductions,
 * the online softmax normalizer, Chan's merge of squares) — only those the kernel's text names,
 * with the helpers they use in turn. */
#include "codegen/codegen.h"

/* ---------------------------------------------------------------- the helpers */

/* One helper: the identifier the kernel names it by, the helpers its text uses (indices into
 * HELPERS), and its text. Listed in the order they are emitted, each after what it uses. A
 * helper whose text depends on the kernel (fast math, the renderer's shuffle) is written by
 * helper_text. */
enum {
    H_INF, H_NAN, H_VEC, H_LD, H_ST, H_BITS, H_MAXF, H_MINF, H_MAXD, H_MIND, H_FEXP, H_BF16_AT,
    H_WARP_SUM, H_WARP_MAX, H_WARP_MIN, H_EXP, H_ONLINE_ADD, H_ONLINE_MERGE, H_WARP_ONLINE, H_CHAN_M2, NHELPERS
};

static const struct helper {
    const char *ident;
    int deps[4]; /* -1 ends the list */
    const char *text;
} HELPERS[NHELPERS] = {
    [H_INF] = {"KB_INF", {-1}, "#define KB_INF __int_as_float(0x7f800000)\n"},
    [H_NAN] = {"KB_NAN", {-1}, "#define KB_NAN __int_as_float(0x7fffffff)\n"},
    [H_VEC] = {"kb_vec", {-1}, "template <typename T, int N> struct alignas(sizeof(T) * N) kb_vec { T v[N]; };\n"},
    [H_LD] = {"kb_ld", {H_VEC, -1},
              "// N elements at p in accesses of at most 16 bytes (p is 16-byte aligned, or N*sizeof(T)-aligned)\n"
              "template <typename T, int N> __device__ __forceinline__ kb_vec<T, N> kb_ld(const T *p) {\n"
              "    constexpr int C = sizeof(T) * N > 16 ? 16 / (int)sizeof(T) : N;\n"
              "    kb_vec<T, N> r;\n"
              "#pragma unroll\n"
              "    for (int j = 0; j < N; j += C) *reinterpret_cast<kb_vec<T, C> *>(&r.v[j]) = *reinterpret_cast<const kb_vec<T, C> *>(p + j);\n"
              "    return r;\n"
              "}\n"},
    [H_ST] = {"kb_st", {H_VEC, -1},
              "template <typename T, int N> __device__ __forceinline__ void kb_st(T *p, const kb_vec<T, N> &r) {\n"
              "    constexpr int C = sizeof(T) * N > 16 ? 16 / (int)sizeof(T) : N;\n"
              "#pragma unroll\n"
              "    for (int j = 0; j < N; j += C) *reinterpret_cast<kb_vec<T, C> *>(p + j) = *reinterpret_cast<const kb_vec<T, C> *>(&r.v[j]);\n"
              "}\n"},
    [H_BITS] = {"kb_bits", {H_VEC, -1},
                "// the same bytes as another vector type: registers carried from one row to the next stay\n"
                "// whole 32-bit words (16-bit elements would be unpacked and packed again with byte permutes)\n"
                "template <typename T, int N, typename W, int M> __device__ __forceinline__ kb_vec<T, N> kb_bits(const kb_vec<W, M> &w) {\n"
                "    return *reinterpret_cast<const kb_vec<T, N> *>(&w);\n"
                "}\n"},
    [H_MAXF] = {"kb_maxf", {-1},
                "__device__ __forceinline__ float kb_maxf(float a, float b) {\n"
                "#if __CUDA_ARCH__ >= 800\n"
                "    float r;\n"
                "    asm(\"max.NaN.f32 %0, %1, %2;\" : \"=f\"(r) : \"f\"(a), \"f\"(b));\n"
                "    return r;\n"
                "#else\n"
                "    return (a > b || a != a) ? a : b;\n"
                "#endif\n"
                "}\n"},
    [H_MINF] = {"kb_minf", {-1},
                "__device__ __forceinline__ float kb_minf(float a, float b) {\n"
                "#if __CUDA_ARCH__ >= 800\n"
                "    float r;\n"
                "    asm(\"min.NaN.f32 %0, %1, %2;\" : \"=f\"(r) : \"f\"(a), \"f\"(b));\n"
                "    return r;\n"
                "#else\n"
                "    return (a < b || a != a) ? a : b;\n"
                "#endif\n"
                "}\n"},
    [H_MAXD] = {"kb_maxf", {-1},
                "__device__ __forceinline__ double kb_maxf(double a, double b) { return (a > b || a != a) ? a : b; }\n"},
    [H_MIND] = {"kb_minf", {-1},
                "__device__ __forceinline__ double kb_minf(double a, double b) { return (a < b || a != a) ? a : b; }\n"},
    [H_FEXP] = {"kb_fexp", {-1},
                "// fast-math exp: ex2.approx with denormal results flushed to zero, two instructions (__expf\n"
                "// without -ftz wraps the same approximation in a denormal fix-up)\n"
                "__device__ __forceinline__ float kb_fexp(float x) {\n"
                "    float y;\n"
                "    asm(\"ex2.approx.ftz.f32 %0, %1;\" : \"=f\"(y) : \"f\"(x * 1.44269504088896341f));\n"
                "    return y;\n"
                "}\n"},
    [H_BF16_AT] = {"kb_bf16_at", {H_VEC, -1},
                   "// element k of a bf16 vector as float, from its 32-bit word: the upper element is one mask (a\n"
                   "// byte permute and a shift otherwise)\n"
                   "template <int N> __device__ __forceinline__ float kb_bf16_at(const kb_vec<__nv_bfloat16, N> &x, int k) {\n"
                   "    const unsigned w = *reinterpret_cast<const unsigned *>(&x.v[k & ~1]);\n"
                   "    return __uint_as_float(k & 1 ? w & 0xffff0000u : w << 16);\n"
                   "}\n"},
    [H_WARP_SUM] = {"kb_warp_sum", {-1}, NULL},
    [H_WARP_MAX] = {"kb_warp_max", {H_MAXF, H_MAXD, -1}, NULL},
    [H_WARP_MIN] = {"kb_warp_min", {H_MINF, H_MIND, -1}, NULL},
    [H_EXP] = {"kb_exp", {-1}, NULL},
    [H_ONLINE_ADD] = {"kb_online_add", {H_EXP, H_INF, H_NAN, -1},
                      "template <typename T> __device__ __forceinline__ void kb_online_add(T &m, T &s, T x) {\n"
                      "    if (x != x) { m = x; s = x; }\n"
                      "    else if (x > m) { s = x == (T)KB_INF ? (T)KB_NAN : s * kb_exp(m - x) + (T)1; m = x; }  // inf - inf\n"
                      "    else if (x != -(T)KB_INF) s += kb_exp(x - m);\n"
                      "}\n"},
    [H_ONLINE_MERGE] = {"kb_online_merge", {H_EXP, H_MAXF, H_MAXD, -1},
                        "// branch-free, one exp: the smaller max's sum is scaled by exp(min - max); equal maxima (±inf\n"
                        "// included, where min - max is NaN) need no factor; a NaN max makes the sum NaN. Lanes l and\n"
                        "// l^o compute the same fma of the same values, so a butterfly leaves equal bits everywhere.\n"
                        "template <typename T> __device__ __forceinline__ void kb_online_merge(T &m, T &s, T m2, T s2) {\n"
                        "    const bool first = m >= m2;\n"
                        "    const T mx = kb_maxf(m, m2), mn = first ? m2 : m;\n"
                        "    const T e = mn == mx ? (T)1 : kb_exp(mn - mx);\n"
                        "    s = first ? s + s2 * e : s * e + s2;\n"
                        "    m = mx;\n"
                        "}\n"},
    [H_WARP_ONLINE] = {"kb_warp_online", {H_ONLINE_MERGE, -1}, NULL},
    [H_CHAN_M2] = {"kb_chan_m2", {-1},
                   "// Chan et al.'s merge of two parts' squares about their own means: parts of n and n2 elements,\n"
                   "// with sums s and s2 and squares m2 and m22, give the squares about the mean of both (an empty\n"
                   "// part adds nothing)\n"
                   "template <typename T> __device__ __forceinline__ T kb_chan_m2(T n, T s, T m2, T n2, T s2, T m22) {\n"
                   "    if (n2 == (T)0) return m2;\n"
                   "    if (n == (T)0) return m22;\n"
                   "    const T d = s2 / n2 - s / n;\n"
                   "    return m2 + m22 + d * d * (n * n2 / (n + n2));\n"
                   "}\n"},
};

/* The text of helper h where it depends on the kernel. */
static void helper_text(const cg *c, int h, kb_sb *sb) {
    if (HELPERS[h].text) {
        kb_sb_puts(sb, HELPERS[h].text);
        return;
    }
    char shv[96], shm[96], shs[96];
    snprintf(shv, sizeof shv, c->rd->shfl_xor, "v");
    snprintf(shm, sizeof shm, c->rd->shfl_xor, "m");
    snprintf(shs, sizeof shs, c->rd->shfl_xor, "s");
    /* warp reductions over W lanes (xor butterflies stay inside aligned groups of W) */
    static const char *const combine[] = {[H_WARP_SUM] = "v + w", [H_WARP_MAX] = "kb_maxf(v, w)", [H_WARP_MIN] = "kb_minf(v, w)"};
    switch (h) {
    case H_WARP_SUM:
    case H_WARP_MAX:
    case H_WARP_MIN:
        kb_sb_printf(sb,
                     "template <int W, typename T> __device__ __forceinline__ T %s(T v) {\n"
                     "#pragma unroll\n"
                     "    for (int o = W / 2; o > 0; o >>= 1) { const T w = %s; v = %s; }\n"
                     "    return v;\n"
                     "}\n",
                     HELPERS[h].ident, shv, combine[h]);
        break;
    case H_EXP:
        kb_sb_printf(sb,
                     "// online softmax normalizer: (max m, sum s of exp(x - m)), rescaled as m grows (NaN and inf as torch)\n"
                     "__device__ __forceinline__ float kb_exp(float x) { return %s(x); }\n"
                     "__device__ __forceinline__ double kb_exp(double x) { return exp(x); }\n",
                     c->gn.fast_math ? "kb_fexp" : "expf");
        break;
    case H_WARP_ONLINE:
        kb_sb_printf(sb,
                     "template <int W, typename T> __device__ __forceinline__ void kb_warp_online(T &m, T &s) {\n"
                     "#pragma unroll\n"
                     "    for (int o = W / 2; o > 0; o >>= 1) { const T m2 = %s; const T s2 = %s; kb_online_merge(m, s, m2, s2); }\n"
                     "}\n",
                     shm, shs);
        break;
    default:
        break;
    }
}

/* ---------------------------------------------------------------- identifiers in code */

static int ident_char(char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_';
}

const char *cg_next_ident(const char *s, size_t *len) {
    while (*s) {
        if (s[0] == '/' && s[1] == '/') {
            while (*s && *s != '\n') s++;
        } else if (s[0] == '/' && s[1] == '*') {
            const char *e = strstr(s + 2, "*/");
            s = e ? e + 2 : s + strlen(s);
        } else if (*s == '"' || *s == '\'') {
            char q = *s++;
            while (*s && *s != q) s += s[0] == '\\' && s[1] ? 2 : 1;
            if (*s) s++;
        } else if (*s >= '0' && *s <= '9') { /* a number, suffixes and exponents included */
            while (ident_char(*s) || *s == '.') s++;
        } else if (ident_char(*s)) {
            const char *b = s;
            while (ident_char(*s)) s++;
            *len = (size_t)(s - b);
            return b;
        } else {
            s++;
        }
    }
    return NULL;
}

int cg_code_names(const char *code, const char *name) {
    size_t n = strlen(name), len;
    for (const char *s = code; code && (s = cg_next_ident(s, &len)) != NULL; s += len) {
        int member = s > code && (s[-1] == '.' || (s[-1] == '>' && s - 1 > code && s[-2] == '-')); /* threadIdx.x */
        if (len == n && memcmp(s, name, n) == 0 && !member) return 1;
    }
    return 0;
}

/* Does code name an identifier that starts with "__" and contains part? (__nv_bfloat16,
 * __bfloat162float; __half, __float2half_rn: the types and conversions of cuda_bf16.h and
 * cuda_fp16.h, not a variable that happens to contain the word) */
static int code_names_cuda(const char *code, const char *part) {
    size_t len, n = strlen(part);
    for (const char *s = code; code && (s = cg_next_ident(s, &len)) != NULL; s += len) {
        if (len < 2 || s[0] != '_' || s[1] != '_') continue;
        for (size_t i = 2; i + n <= len; i++)
            if (memcmp(s + i, part, n) == 0) return 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- the preamble */

static void need(const cg *c, int h, uint8_t *on) {
    if (on[h]) return;
    on[h] = 1;
    for (int i = 0; i < 4 && HELPERS[h].deps[i] >= 0; i++) need(c, HELPERS[h].deps[i], on);
    if (h == H_EXP && c->gn.fast_math) need(c, H_FEXP, on);
}

void cg_emit_preamble(cg *c, kb_sb *sb, const char *kernel) {
    const kb_region *rg = c->rg;
    kb_sb_printf(sb, "// kbench: region %d (%s), %s compute\n", c->r, kb_region_kind_name(rg->kind), c->ct);
    char gtext[256];
    kb_genome_format(&c->gn, gtext, sizeof gtext);
    kb_sb_printf(sb, "// genome: %s\n", gtext);
    if (c->guard_last) { /* vectors along a varying last dim: the launchers check it per call */
        char last[EXPR_LEN];
        cg_dim_expr(c, c->adims[c->last], last);
        kb_sb_printf(sb, "// runs only where %s (the last dim) %% %d == 0: the launch checks it, eager elsewhere\n", last,
                     c->vec);
    }
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
    for (int32_t j = 0; j < rg->noutputs; j++)
        kb_sb_printf(sb, "// out p%d = %%%d\n", rg->outputs[j], rg->outputs[j]);
    for (int32_t s = 0; s < kb_graph_nsymbols(c->g); s++) {
        char sym[KB_NAME_COMMENT_MAX + 4];
        kb_name_comment(kb_graph_symbol_name(c->g, s), sym, sizeof sym);
        kb_sb_printf(sb, "// s%d = %s\n", s, sym);
    }
    /* the helpers the kernel names, and what they use */
    uint8_t on[NHELPERS] = {0};
    for (int h = 0; h < NHELPERS; h++)
        if (cg_code_names(kernel, HELPERS[h].ident)) need(c, h, on);
    if (!c->dbl) on[H_MAXD] = on[H_MIND] = 0; /* the double overloads serve double compute only */
    kb_sb helpers;
    kb_sb_init(&helpers, c->ctx);
    for (int h = 0; h < NHELPERS; h++) {
        if (!on[h]) continue;
        if (h == H_MAXF || (h == H_MINF && !on[H_MAXF]))
            kb_sb_puts(&helpers, "// max / min that propagate NaN like torch (sm_80+: one instruction)\n");
        helper_text(c, h, &helpers);
    }
    /* the headers the kernel's and its helpers' types need */
    if (code_names_cuda(kernel, "bfloat16") || code_names_cuda(helpers.buf, "bfloat16"))
        kb_sb_puts(sb, "#include <cuda_bf16.h>\n");
    if (code_names_cuda(kernel, "half") || code_names_cuda(helpers.buf, "half")) kb_sb_puts(sb, "#include <cuda_fp16.h>\n");
    kb_sb_puts(sb, "\n");
    if (helpers.oom) sb->oom = 1;
    else if (helpers.buf) kb_sb_puts(sb, helpers.buf);
    kb_sb_discard(&helpers);
    kb_sb_puts(sb, "\n");
}
