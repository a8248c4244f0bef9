/* gemm.c — tensor-core GEMM kernels: (spec, genome, sm) -> CUDA C source + launch geometry for
 * out[b] = epilogue(A[b] @ B[b]) with mma.sync m16n8k16 (bf16/f16 in, f32 accumulation), a cp.async
 * pipeline into XOR-swizzled shared memory and ldmatrix fragments. The epilogue is a hook
 * (kb_gemm_epilogue, core/internal.h) that the region codegen or the built-in vocabulary fills. */
#include "codegen/codegen.h"

#include <math.h>

/* ---------------------------------------------------------------- writing lines */

typedef struct gw {
    kb_sb *sb;
    int ind;
} gw;

static void gl(gw *w, const char *f, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void gl(gw *w, const char *f, ...) {
    for (int i = 0; i < w->ind; i++) kb_sb_puts(w->sb, "    ");
    va_list ap;
    va_start(ap, f);
    char buf[1024];
    vsnprintf(buf, sizeof buf, f, ap); /* every line here is short and fixed in shape */
    va_end(ap);
    kb_sb_puts(w->sb, buf);
    kb_sb_puts(w->sb, "\n");
}

static void indent(kb_sb *sb, int n) {
    for (int i = 0; i < n; i++) kb_sb_puts(sb, "    ");
}

/* ---------------------------------------------------------------- the built-in epilogue */

static int float_dtype(int32_t t) { return t == KB_F32 || t == KB_F16 || t == KB_BF16; }

/* x as a float literal of C ("0.5f", "(-2.0f)"); 0 for NaN or infinity */
static int float_literal(double x, char *out, size_t n) {
    if (isnan(x) || isinf(x)) return 0;
    char num[48];
    snprintf(num, sizeof num, "%.9g", x);
    if (!strpbrk(num, ".e")) strcat(num, ".0");
    snprintf(out, n, "%s%sf%s", x < 0 ? "(" : "", num, x < 0 ? ")" : "");
    return 1;
}

/* ops.def's cuda template of op over operand a and the op's scalars: $a, $p0, $p1 replaced */
static kb_status act_expr(kb_ctx *ctx, int32_t op, const char *a, double p0, double p1, char *out, size_t n) {
    const kb_op_info *info = (op >= 0 && op < KB_OP_COUNT) ? kb_op_get((kb_op)op) : NULL;
    if (!info || info->kind != KB_KIND_UNARY || !info->cuda[0])
        return KB_FAIL(ctx, KB_ERR_UNSUPPORTED, "gemm: the epilogue's activation must be a unary pointwise op (op %d)",
                       (int)op);
    char l0[48], l1[48];
    if (!float_literal(p0, l0, sizeof l0) || !float_literal(p1, l1, sizeof l1))
        return KB_FAIL(ctx, KB_ERR_UNSUPPORTED, "gemm: the activation's scalars must be finite");
    size_t len = 0;
    for (const char *t = info->cuda; *t;) {
        const char *rep = NULL;
        if (t[0] == '$' && t[1] == 'a') rep = a, t += 2;
        else if (t[0] == '$' && t[1] == 'p' && t[2] == '0') rep = l0, t += 3;
        else if (t[0] == '$' && t[1] == 'p' && t[2] == '1') rep = l1, t += 3;
        size_t k = rep ? strlen(rep) : 1;
        if (len + k + 1 > n) return KB_FAIL(ctx, KB_ERR_UNSUPPORTED, "gemm: the activation's template is too long");
        memcpy(out + len, rep ? rep : t, k);
        len += k;
        if (!rep) t++;
    }
    out[len] = '\0';
    return KB_OK;
}

static kb_status builtin_params(kb_ctx *ctx, void *ud, kb_sb *sb) {
    (void)ctx;
    const kb_gemm_builtin *b = ud;
    if (b->has_alpha) kb_sb_puts(sb, ",\n    const float alpha");
    if (b->bias_n >= 0) kb_sb_printf(sb, ",\n    const %s *__restrict__ bias_n", cg_storage((kb_dtype)b->bias_n));
    if (b->bias_m >= 0) kb_sb_printf(sb, ",\n    const %s *__restrict__ bias_m", cg_storage((kb_dtype)b->bias_m));
    if (b->residual >= 0) kb_sb_printf(sb, ",\n    const %s *__restrict__ residual", cg_storage((kb_dtype)b->residual));
    return KB_OK;
}

/* one line "<acc> += <load of ptr[index]>;" */
static void add_load(kb_sb *sb, int ind, const char *acc, int32_t dt, const char *ref) {
    char load[160];
    snprintf(load, sizeof load, cg_load_fmt((kb_dtype)dt), ref);
    indent(sb, ind);
    kb_sb_printf(sb, "%s += %s;\n", acc, load);
}

static kb_status builtin_element(kb_ctx *ctx, void *ud, kb_sb *sb, const kb_gemm_site *s) {
    const kb_gemm_builtin *b = ud;
    char ref[160];
    if (b->has_alpha) {
        indent(sb, s->indent);
        kb_sb_printf(sb, "%s *= alpha;\n", s->acc);
    }
    if (b->bias_n >= 0) {
        snprintf(ref, sizeof ref, "bias_n[%s]", s->col);
        add_load(sb, s->indent, s->acc, b->bias_n, ref);
    }
    if (b->bias_m >= 0) {
        snprintf(ref, sizeof ref, "bias_m[%s]", s->row);
        add_load(sb, s->indent, s->acc, b->bias_m, ref);
    }
    if (b->act >= 0) {
        char e[512];
        kb_status st = act_expr(ctx, b->act, "x", b->act_p0, b->act_p1, e, sizeof e);
        if (st != KB_OK) return st;
        indent(sb, s->indent);
        kb_sb_printf(sb, "{ const float x = %s; %s = %s; }  // %s, ops.def's template\n", s->acc, s->acc, e,
                     kb_op_get((kb_op)b->act)->name);
    }
    if (b->residual >= 0) {
        snprintf(ref, sizeof ref, "residual[(%s * M + %s) * N + %s]", s->batch, s->row, s->col);
        add_load(sb, s->indent, s->acc, b->residual, ref);
    }
    return KB_OK;
}

kb_status kb_gemm_builtin_epilogue(kb_ctx *ctx, kb_gemm_builtin *b, kb_gemm_epilogue *out) {
    const int32_t terms[3] = {b->bias_n, b->bias_m, b->residual};
    for (int i = 0; i < 3; i++)
        if (terms[i] != -1 && !float_dtype(terms[i]))
            return KB_FAIL(ctx, KB_ERR_UNSUPPORTED, "gemm: an epilogue tensor's dtype must be f32, f16 or bf16 (%d)",
                           (int)terms[i]);
    if (b->act >= 0) {
        char e[512];
        kb_status st = act_expr(ctx, b->act, "x", b->act_p0, b->act_p1, e, sizeof e);
        if (st != KB_OK) return st;
    } else if (b->act != -1) {
        return KB_FAIL(ctx, KB_ERR_UNSUPPORTED, "gemm: bad activation op %d", (int)b->act);
    }
    /* the header's line: "acc * alpha + bias_n[col] -> gelu_tanh -> + residual" */
    size_t n = sizeof b->what, len = 0;
    b->what[0] = '\0';
#define PUT(...) (len += (size_t)snprintf(b->what + len, len < n ? n - len : 0, __VA_ARGS__))
    PUT("acc%s", b->has_alpha ? " * alpha" : "");
    if (b->bias_n >= 0) PUT(" + bias_n[col] (%s)", kb_dtype_name((kb_dtype)b->bias_n));
    if (b->bias_m >= 0) PUT(" + bias_m[row] (%s)", kb_dtype_name((kb_dtype)b->bias_m));
    if (b->act >= 0) PUT(" -> %s", kb_op_get((kb_op)b->act)->name);
    if (b->residual >= 0) PUT(" -> + residual[b, row, col] (%s)", kb_dtype_name((kb_dtype)b->residual));
#undef PUT
    *out = (kb_gemm_epilogue){b, b->what, builtin_params, builtin_element};
    return KB_OK;
}

/* ---------------------------------------------------------------- spec and genome */

kb_status kb_gemm_spec_check(kb_ctx *ctx, const kb_gemm_spec *spec, int sm) {
    if (spec->ab != KB_BF16 && spec->ab != KB_F16)
        return KB_FAIL(ctx, KB_ERR_UNSUPPORTED, "gemm: A and B must be bf16 or f16, not %s", kb_dtype_name(spec->ab));
    if (!float_dtype(spec->out))
        return KB_FAIL(ctx, KB_ERR_UNSUPPORTED, "gemm: the output must be f32, f16 or bf16, not %s",
                       kb_dtype_name(spec->out));
    if (sm < 80)
        return KB_FAIL(ctx, KB_ERR_UNSUPPORTED, "gemm: mma.sync m16n8k16 with bf16/f16 and cp.async need sm_80+, not sm_%d",
                       sm);
    if (spec->epilogue && !spec->epilogue->element)
        return KB_FAIL(ctx, KB_ERR_INVALID, "gemm: an epilogue hook without its element callback");
    return KB_OK;
}

static int pow2(int32_t x) { return x > 0 && (x & (x - 1)) == 0; }

static int64_t smem_bytes(const kb_gemm_genome *g) {
    return (int64_t)g->stages * ((int64_t)g->tile_m + g->tile_n) * g->tile_k * 2;
}

/* A thread's registers, roughly: the accumulators, one k-step's A and B fragments, and ~40 for
 * addresses, indices and the epilogue. ptxas may use fewer; more spills. */
static int64_t regs_estimate(const kb_gemm_genome *g) {
    int64_t mi = g->tile_m / g->warps_m / 16, ni = g->tile_n / g->warps_n / 8;
    return mi * ni * 4 + mi * 4 + ni * 2 + 40;
}

kb_status kb_gemm_genome_check(kb_ctx *ctx, const kb_gemm_genome *g, const kb_device_info *dev) {
    const kb_device_info *d0 = kb_device_default();
    int32_t smem_max = dev && dev->max_smem_per_block > 0 ? dev->max_smem_per_block : d0->max_smem_per_block;
    int32_t regs_sm = dev && dev->regs_per_sm > 0 ? dev->regs_per_sm : d0->regs_per_sm;
    if (!pow2(g->warps_m) || !pow2(g->warps_n) || g->warps_m * g->warps_n > 8)
        return KB_FAIL(ctx, KB_ERR_INVALID, "gemm genome: warps_m x warps_n (%dx%d) must be powers of two, at most 8 warps",
                       (int)g->warps_m, (int)g->warps_n);
    if (g->tile_m < 16 || g->tile_m > 256 || g->tile_m % (16 * g->warps_m))
        return KB_FAIL(ctx, KB_ERR_INVALID, "gemm genome: tile_m %d must be 16..256 and a multiple of 16 * warps_m",
                       (int)g->tile_m);
    /* a warp tile's columns: whole pairs of n8 mmas (one ldmatrix.x4 loads two n8 B fragments) */
    if (g->tile_n < 16 || g->tile_n > 256 || g->tile_n % (16 * g->warps_n))
        return KB_FAIL(ctx, KB_ERR_INVALID, "gemm genome: tile_n %d must be 16..256 and a multiple of 16 * warps_n",
                       (int)g->tile_n);
    if (g->tile_k != 16 && g->tile_k != 32 && g->tile_k != 64)
        return KB_FAIL(ctx, KB_ERR_INVALID, "gemm genome: tile_k %d must be 16, 32 or 64", (int)g->tile_k);
    if (g->stages < 2 || g->stages > 8)
        return KB_FAIL(ctx, KB_ERR_INVALID, "gemm genome: stages %d must be 2..8", (int)g->stages);
    if (g->min_blocks != 1 && g->min_blocks != 2)
        return KB_FAIL(ctx, KB_ERR_INVALID, "gemm genome: min_blocks %d must be 1 or 2", (int)g->min_blocks);
    if (smem_bytes(g) * g->min_blocks > smem_max)
        return KB_FAIL(ctx, KB_ERR_INVALID, "gemm genome: %d x %lld bytes of shared memory exceed the device's %d",
                       (int)g->min_blocks, (long long)smem_bytes(g), (int)smem_max);
    int64_t regs = regs_estimate(g), threads = 32LL * g->warps_m * g->warps_n;
    if (regs > 255 || regs * threads * g->min_blocks > regs_sm)
        return KB_FAIL(ctx, KB_ERR_INVALID,
                       "gemm genome: about %lld registers a thread (%lld threads, %d blocks an SM) do not fit",
                       (long long)regs, (long long)threads, (int)g->min_blocks);
    return KB_OK;
}

/* Largest first: the default takes the first whose grid fills the device, the candidates are all. */
static const kb_gemm_genome GENOMES[] = {
    {128, 128, 32, 2, 4, 4, 2}, {128, 128, 32, 2, 4, 4, 1}, {128, 256, 32, 2, 4, 3, 1}, {256, 128, 32, 4, 2, 3, 1},
    {128, 128, 64, 2, 4, 3, 1}, {128, 64, 32, 2, 2, 4, 2},  {64, 128, 32, 2, 2, 4, 2},  {64, 64, 32, 2, 2, 4, 2},
    {64, 64, 64, 2, 2, 3, 2},   {32, 64, 64, 1, 2, 4, 2},   {16, 64, 64, 1, 2, 4, 2},
};
#define NGENOMES ((int)(sizeof GENOMES / sizeof *GENOMES))

/* ceil(x / d) for x >= 0 (negative: 0), without overflow */
static int64_t ceil_div(int64_t x, int64_t d) { return x <= 0 ? 0 : x / d + (x % d != 0); }

/* a * b, saturated at INT64_MAX (a, b >= 0) */
static int64_t mul_sat(int64_t a, int64_t b) { return a && b > INT64_MAX / a ? INT64_MAX : a * b; }

static int64_t blocks_of(const kb_gemm_genome *g, int64_t M, int64_t N, int64_t batch) {
    return mul_sat(mul_sat(ceil_div(M, g->tile_m), ceil_div(N, g->tile_n)), batch > 0 ? batch : 1);
}

void kb_gemm_genome_default(int64_t M, int64_t N, int64_t K, int64_t batch, const kb_device_info *dev,
                            kb_gemm_genome *out) {
    (void)K;
    int32_t sms = dev && dev->num_sms > 0 ? dev->num_sms : kb_device_default()->num_sms;
    /* 128x128 where it gives a full wave; else the largest of the square-ish tiles that gives
     * about one block per SM (an SM holds several small blocks), down to 16x64 */
    static const int order[] = {0, 5, 6, 7, 9, 10};
    const kb_gemm_genome *pick = &GENOMES[10];
    for (size_t i = 0; i < sizeof order / sizeof *order; i++) {
        const kb_gemm_genome *g = &GENOMES[order[i]];
        if (kb_gemm_genome_check(NULL, g, dev) == KB_OK && blocks_of(g, M, N, batch) >= sms) {
            pick = g;
            break;
        }
    }
    *out = *pick;
}

int kb_gemm_genome_candidates(int64_t M, int64_t N, int64_t K, int64_t batch, const kb_device_info *dev,
                              kb_gemm_genome *out, int max) {
    int n = 0;
    if (max <= 0) return 0;
    kb_gemm_genome_default(M, N, K, batch, dev, &out[n++]);
    for (int i = 0; i < NGENOMES && n < max; i++) {
        const kb_gemm_genome *g = &GENOMES[i];
        if (memcmp(g, &out[0], sizeof *g) == 0 || kb_gemm_genome_check(NULL, g, dev) != KB_OK) continue;
        /* a tile more than twice the problem along M or N only multiplies idle lanes */
        if ((g->tile_m - 16) / 2 > M || (g->tile_n - 16) / 2 > N) continue;
        out[n++] = *g;
    }
    return n;
}

void kb_gemm_grid(const kb_gemm_launch *launch, int64_t M, int64_t N, int64_t batch, uint32_t grid[3]) {
    int64_t tiles = mul_sat(ceil_div(M, launch->tile_m), ceil_div(N, launch->tile_n));
    grid[0] = (uint32_t)(tiles < 1 ? 1 : tiles > 0x7FFFFFFF ? 0x7FFFFFFF : tiles);
    grid[1] = 1;
    grid[2] = (uint32_t)(batch < 1 ? 1 : batch > 65535 ? 65535 : batch);
}

/* ---------------------------------------------------------------- the kernel's source */

/* The device helpers every GEMM kernel uses: PTX for cp.async, ldmatrix and mma, and the
 * shared-memory swizzle. */
static void emit_helpers(gw *w, const char *mma_type) {
    static const char *const text[] = {
        "// cp.async of one 16-byte chunk global -> shared; src_size 0 reads nothing and fills zeros,",
        "// which is how rows past M or N and columns past K enter the tile (the tails are exact).",
        "__device__ __forceinline__ void kb_cp_async16(unsigned dst, const void *src, bool valid) {",
        "    asm volatile(\"cp.async.cg.shared.global [%0], [%1], 16, %2;\\n\" :: \"r\"(dst), \"l\"(src), \"r\"(valid ? 16 : 0));",
        "}",
        "__device__ __forceinline__ void kb_cp_async_commit() { asm volatile(\"cp.async.commit_group;\\n\" ::); }",
        "// wait until at most N of this thread's committed groups are still in flight",
        "template <int N> __device__ __forceinline__ void kb_cp_async_wait() {",
        "    asm volatile(\"cp.async.wait_group %0;\\n\" :: \"n\"(N));",
        "}",
        "",
        "// Four 8x8 b16 matrices: lanes 8i..8i+7 give the row addresses of matrix i, register i of",
        "// every lane receives its part of matrix i (lane l: row l/4, columns 2(l%4), 2(l%4)+1; with",
        "// .trans the matrix is read transposed: row 2(l%4)+{0,1}, column l/4).",
        "__device__ __forceinline__ void kb_ldmatrix_x4(unsigned (&r)[4], unsigned addr) {",
        "    asm volatile(\"ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\\n\"",
        "                 : \"=r\"(r[0]), \"=r\"(r[1]), \"=r\"(r[2]), \"=r\"(r[3]) : \"r\"(addr));",
        "}",
        "__device__ __forceinline__ void kb_ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {",
        "    asm volatile(\"ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\\n\"",
        "                 : \"=r\"(r[0]), \"=r\"(r[1]), \"=r\"(r[2]), \"=r\"(r[3]) : \"r\"(addr));",
        "}",
        "",
        "// d += a @ b on one m16n8k16 tile. Per lane (g = lane / 4, t = lane % 4), each register two",
        "// 16-bit values, low half first:",
        "//   a[0] = A[g][2t..2t+1]  a[1] = A[g+8][2t..]  a[2] = A[g][2t+8..]  a[3] = A[g+8][2t+8..]",
        "//   b[0] = B[2t..2t+1][g]  b[1] = B[2t+8..2t+9][g]       (B is k x n, read down a column)",
        "//   d[0], d[1] = D[g][2t], D[g][2t+1]    d[2], d[3] = D[g+8][2t], D[g+8][2t+1]",
        "__device__ __forceinline__ void kb_mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {",
        NULL,
    };
    for (int i = 0; text[i]; i++) gl(w, "%s", text[i]);
    gl(w, "    asm volatile(\"mma.sync.aligned.m16n8k16.row.col.f32.%s.%s.f32 {%%0, %%1, %%2, %%3}, {%%4, %%5, %%6, %%7}, "
          "{%%8, %%9}, {%%0, %%1, %%2, %%3};\\n\"", mma_type, mma_type);
    gl(w, "                 : \"+f\"(d[0]), \"+f\"(d[1]), \"+f\"(d[2]), \"+f\"(d[3])");
    gl(w, "                 : \"r\"(a[0]), \"r\"(a[1]), \"r\"(a[2]), \"r\"(a[3]), \"r\"(b[0]), \"r\"(b[1]));");
    gl(w, "}");
    static const char *const swz[] = {
        "",
        "// The byte offset of 16-byte chunk c of row r in a tile of CPR chunks a row. Within each",
        "// 128-byte line (8 chunks, all 32 banks) the chunk index is XORed with a key that differs",
        "// between the 8 rows one ldmatrix reads at the same logical chunk (the line's index where a",
        "// line holds several short rows, the row's index mod 8 where a row spans lines): its eight",
        "// 16-byte reads then fall in eight distinct bank groups, and the eight chunks of a line",
        "// that eight consecutive threads fill with cp.async stay in that line, also conflict-free.",
        "template <int CPR> __device__ __forceinline__ unsigned kb_swizzle(int r, int c) {",
        "    const int q = r * CPR + c;",
        "    const int key = CPR >= 8 ? (r & 7) : ((q >> 3) & 7);",
        "    return (unsigned)(q ^ key) * 16u;",
        "}",
        NULL,
    };
    for (int i = 0; swz[i]; i++) gl(w, "%s", swz[i]);
}

/* the cp.async loop filling one operand tile of ROWS x CPR chunks at stage buffer `buf` */
static void emit_tile_load(gw *w, const char *what, int rows, int cpr, int threads, const char *buf,
                           const char *grow, const char *gcol, const char *rlimit, const char *climit, const char *base,
                           const char *ld, const char *ptr) {
    int chunks = rows * cpr, iters = (chunks + threads - 1) / threads;
    gl(w, "// %s: %d x %d chunks of 16 bytes, %d per thread", what, rows, cpr, iters);
    gl(w, "#pragma unroll");
    gl(w, "for (int j = 0; j < %d; j++) {", iters);
    w->ind++;
    gl(w, "const int i = tid + j * %d;", threads);
    if (chunks % threads) gl(w, "if (i < %d) {", chunks), w->ind++;
    gl(w, "const int r = i / %d, c = i %% %d;", cpr, cpr);
    gl(w, "const long long gr = %s, gc = %s;", grow, gcol);
    gl(w, "const bool ok = gr < %s && gc < %s;", rlimit, climit);
    gl(w, "kb_cp_async16(%s + kb_swizzle<%d>(r, c), ok ? %s + gr * %s + gc : %s, ok);", buf, cpr, base, ld, ptr);
    if (chunks % threads) w->ind--, gl(w, "}");
    w->ind--;
    gl(w, "}");
}

static kb_status emit_epilogue_element(kb_ctx *ctx, gw *w, const kb_gemm_spec *spec, const char *acc,
                                       const char *col) {
    if (!spec->epilogue) return KB_OK;
    kb_gemm_site site = {acc, "bz", "row", col, w->ind};
    return spec->epilogue->element(ctx, spec->epilogue->ud, w->sb, &site);
}

static const char *pair_store(kb_dtype t) {
    switch (t) {
    case KB_BF16: return "*reinterpret_cast<__nv_bfloat162 *>(orow + col) = __floats2bfloat162_rn(v0, v1);";
    case KB_F16: return "*reinterpret_cast<__half2 *>(orow + col) = __floats2half2_rn(v0, v1);";
    default: return "*reinterpret_cast<float2 *>(orow + col) = make_float2(v0, v1);";
    }
}

kb_status kb_gemm_generate(kb_ctx *ctx, const kb_gemm_spec *spec, const kb_gemm_genome *g, int sm, kb_sb *sb,
                           kb_gemm_launch *launch) {
    kb_status st = kb_gemm_spec_check(ctx, spec, sm);
    if (st != KB_OK) return st;
    /* the genome's shape rules; whether its shared memory fits is the caller's device's question
       (kb_gemm_genome_check with that device), not the default device's */
    const kb_device_info any_smem = {sm, 0, 1 << 30, 0, 0};
    if ((st = kb_gemm_genome_check(ctx, g, &any_smem)) != KB_OK) return st;
    const int BM = g->tile_m, BN = g->tile_n, BK = g->tile_k, S = g->stages, WM = g->warps_m, WN = g->warps_n;
    const int threads = 32 * WM * WN, WTM = BM / WM, WTN = BN / WN, MI = WTM / 16, NI = WTN / 8;
    const int at = spec->a_transposed, bt = spec->b_transposed;
    const int a_cpr = at ? BM / 8 : BK / 8, b_cpr = bt ? BK / 8 : BN / 8;
    const int a_bytes = BM * BK * 2, b_bytes = BK * BN * 2;
    const char *T = cg_storage(spec->ab), *TO = cg_storage(spec->out);
    const char *mma_type = spec->ab == KB_BF16 ? "bf16" : "f16";
    const char *lay = at ? (bt ? "tt" : "tn") : (bt ? "nt" : "nn");

    kb_gemm_launch L = {{0}, threads, (int32_t)smem_bytes(g), BM, BN};
    snprintf(L.name, sizeof L.name, "kb_gemm_%s_%s_%dx%dx%d_w%dx%d_s%d_b%d", mma_type, lay, BM, BN, BK, WM, WN, S,
             (int)g->min_blocks);

    size_t start = sb->len;
    gw w = {sb, 0};
    /* ---- the header */
    gl(&w, "// %s: out[b] = epilogue(A[b] @ B%s[b]) on tensor cores (kbench codegen/gemm.c, sm_%d).", L.name,
       bt ? "^T" : "", sm);
    gl(&w, "//   A   %s %s, row stride lda%s", at ? "[batch, K, M] (read transposed)" : "[batch, M, K]", mma_type,
       spec->a_broadcast ? ", one for every batch" : "");
    gl(&w, "//   B   %s %s, row stride ldb%s", bt ? "[batch, N, K] (a Linear's weight)" : "[batch, K, N]", mma_type,
       spec->b_broadcast ? ", one for every batch" : "");
    gl(&w, "//   out [batch, M, N] %s, contiguous; f32 accumulation", kb_dtype_name(spec->out));
    gl(&w, "//   epilogue: %s", spec->epilogue && spec->epilogue->what ? spec->epilogue->what : "acc");
    gl(&w, "// Block tile %dx%d, K in steps of %d; %d warps as %d (M) x %d (N), each a %dx%d warp tile of", BM, BN, BK,
       WM * WN, WM, WN, WTM, WTN);
    gl(&w, "// %dx%d mma.sync m16n8k16. A %d-stage cp.async ring (%d bytes of shared memory) keeps %d k-tiles in", MI, NI,
       S, (int)L.smem_bytes, S - 1);
    gl(&w, "// flight while the warps multiply the oldest, %d block%s an SM at once; fragments come from", (int)g->min_blocks,
       g->min_blocks > 1 ? "s" : "");
    gl(&w, "// XOR-swizzled shared memory by ldmatrix%s. Blocks run in groups of 8 tile rows (grid.x), so a",
       at && !bt ? " (.trans for A and B, whose rows run along M and N)"
       : at      ? " (.trans for A, whose rows run along M)"
       : !bt     ? " (.trans for B, whose rows run along N)" : "");
    gl(&w, "// wave's tiles share A and B in L2.");
    gl(&w, "// Requires (the launcher checks): K, lda, ldb%s%s and the batch strides multiples of 8 elements,",
       at ? ", M" : "", bt ? "" : ", N");
    gl(&w, "// A, B and out 16-byte aligned. Edges: zero-filled loads, predicated stores (pairs where N is even).");
    /* both 16-bit headers: an epilogue may read tensors of either type */
    gl(&w, "#include <cuda_bf16.h>");
    gl(&w, "#include <cuda_fp16.h>");
    gl(&w, "%s", "");
    emit_helpers(&w, mma_type);
    gl(&w, "%s", "");

    /* ---- the signature */
    if (spec->device_body) {
        kb_sb_printf(sb, "__device__ __forceinline__ void %s(\n    const long long kb_pid, const long long kb_bz,\n", L.name);
    } else {
        kb_sb_printf(sb, "extern \"C\" __global__ void __launch_bounds__(%d, %d) %s(\n", threads, (int)g->min_blocks,
                     L.name);
    }
    if (!spec->no_out) kb_sb_printf(sb, "    %s *__restrict__ out,\n", TO);
    kb_sb_printf(sb, "    const %s *__restrict__ A,\n    const %s *__restrict__ B,\n", T, T);
    kb_sb_puts(sb, "    const long long M, const long long N, const long long K,\n");
    kb_sb_puts(sb, "    const long long lda, const long long ldb");
    if (!spec->a_broadcast) kb_sb_puts(sb, ",\n    const long long stride_a");
    if (!spec->b_broadcast) kb_sb_puts(sb, ",\n    const long long stride_b");
    if (spec->epilogue && spec->epilogue->params)
        if ((st = spec->epilogue->params(ctx, spec->epilogue->ud, sb)) != KB_OK) goto fail;
    kb_sb_puts(sb, ") {\n");
    w.ind = 1;
    gl(&w, "constexpr int BM = %d, BN = %d, BK = %d, STAGES = %d;", BM, BN, BK, S);
    gl(&w, "constexpr int WARPS_M = %d, WTM = %d, WTN = %d, MI = %d, NI = %d;", WM, WTM, WTN, MI, NI);
    gl(&w, "constexpr unsigned A_STAGE = %d, B_STAGE = %d;  // bytes of one stage's A and B tiles", a_bytes, b_bytes);
    gl(&w, "extern __shared__ __align__(128) unsigned char kb_smem[];");
    gl(&w, "// stage s: A tile at s * A_STAGE, B tile at STAGES * A_STAGE + s * B_STAGE");
    gl(&w, "const unsigned smem = (unsigned)__cvta_generic_to_shared(kb_smem);");
    gl(&w, "const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;");
    gl(&w, "const int warp_m = warp %% WARPS_M, warp_n = warp / WARPS_M;");
    gl(&w, "%s", "");
    gl(&w, "// this block's tile: block ids walk down groups of 8 tile rows, column by column");
    gl(&w, "const long long tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;");
    gl(&w, "const long long pid = %s, group = 8 * tiles_n, first_m = pid / group * 8;",
       spec->device_body ? "kb_pid" : "blockIdx.x");
    gl(&w, "const long long group_m = tiles_m - first_m < 8 ? tiles_m - first_m : 8;");
    gl(&w, "const long long m0 = (first_m + pid %% group %% group_m) * BM, n0 = (pid %% group / group_m) * BN;");
    gl(&w, "if (m0 >= M || n0 >= N) return;");
    gl(&w, "const long long bz = %s;", spec->device_body ? "kb_bz" : "blockIdx.z");
    gl(&w, "const %s *Ab = A%s;", T, spec->a_broadcast ? "" : " + bz * stride_a");
    gl(&w, "const %s *Bb = B%s;", T, spec->b_broadcast ? "" : " + bz * stride_b");
    gl(&w, "const long long ktiles = (K + BK - 1) / BK;");
    gl(&w, "%s", "");
    /* ---- the loads of one k-tile */
    gl(&w, "// k-tile kt into stage s; out-of-range chunks are zeros");
    gl(&w, "auto load_tile = [&](int s, long long kt) {");
    w.ind++;
    gl(&w, "const long long k0 = kt * BK;");
    gl(&w, "const unsigned sa = smem + s * A_STAGE, sb = smem + STAGES * A_STAGE + s * B_STAGE;");
    if (at)
        emit_tile_load(&w, "A tile, BK rows (k) x BM columns (m)", BK, a_cpr, threads, "sa", "k0 + r", "m0 + c * 8", "K",
                       "M", "Ab", "lda", "A");
    else
        emit_tile_load(&w, "A tile, BM rows (m) x BK columns (k)", BM, a_cpr, threads, "sa", "m0 + r", "k0 + c * 8", "M",
                       "K", "Ab", "lda", "A");
    if (bt)
        emit_tile_load(&w, "B tile, BN rows (n) x BK columns (k)", BN, b_cpr, threads, "sb", "n0 + r", "k0 + c * 8", "N",
                       "K", "Bb", "ldb", "B");
    else
        emit_tile_load(&w, "B tile, BK rows (k) x BN columns (n)", BK, b_cpr, threads, "sb", "k0 + r", "n0 + c * 8", "K",
                       "N", "Bb", "ldb", "B");
    w.ind--;
    gl(&w, "};");
    gl(&w, "%s", "");
    gl(&w, "float acc[MI][NI][4];");
    gl(&w, "#pragma unroll");
    gl(&w, "for (int i = 0; i < MI; i++)");
    gl(&w, "#pragma unroll");
    gl(&w, "    for (int j = 0; j < NI; j++)");
    gl(&w, "#pragma unroll");
    gl(&w, "        for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;");
    gl(&w, "%s", "");
    gl(&w, "// prologue: k-tiles 0 .. STAGES-2 in flight, one commit group each (empty past the end, so");
    gl(&w, "// group g always holds k-tile g and wait_group counts stay exact)");
    gl(&w, "#pragma unroll");
    gl(&w, "for (int s = 0; s < STAGES - 1; s++) {");
    gl(&w, "    if (s < ktiles) load_tile(s, s);");
    gl(&w, "    kb_cp_async_commit();");
    gl(&w, "}");
    gl(&w, "for (long long kt = 0; kt < ktiles; kt++) {");
    w.ind++;
    gl(&w, "// k-tile kt has landed (at most STAGES-2 younger groups pending) and every warp is done with");
    gl(&w, "// the stage computed last iteration, which the load below refills");
    gl(&w, "kb_cp_async_wait<STAGES - 2>();");
    gl(&w, "__syncthreads();");
    gl(&w, "if (kt + STAGES - 1 < ktiles) load_tile((int)((kt + STAGES - 1) %% STAGES), kt + STAGES - 1);");
    gl(&w, "kb_cp_async_commit();");
    gl(&w, "const int s = (int)(kt %% STAGES);");
    gl(&w, "const unsigned sa = smem + s * A_STAGE, sb = smem + STAGES * A_STAGE + s * B_STAGE;");
    gl(&w, "#pragma unroll");
    gl(&w, "for (int kk = 0; kk < BK / 16; kk++) {");
    w.ind++;
    if (at) {
        gl(&w, "// A tile rows are k: matrices (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15)");
        gl(&w, "// read transposed give each lane A[g][2t..2t+1], A[g+8][..], A[g][2t+8..], A[g+8][2t+8..] -> a[0..3]");
    } else {
        gl(&w, "// A fragments: matrix q of ldmatrix.x4 (lanes 8q..8q+7 address it) is rows (q & 1) * 8 + 0..7,");
        gl(&w, "// k chunk q >> 1 of this 16x16 block: lane l addresses row l & 15, chunk l >> 4 -> a[0..3]");
    }
    gl(&w, "unsigned a[MI][4], b[NI][2];");
    gl(&w, "#pragma unroll");
    gl(&w, "for (int i = 0; i < MI; i++)");
    if (at)
        gl(&w, "    kb_ldmatrix_x4_trans(a[i], sa + kb_swizzle<%d>(kk * 16 + (lane & 7) + ((lane >> 4) << 3), "
              "(warp_m * WTM + i * 16) / 8 + ((lane >> 3) & 1)));", a_cpr);
    else
        gl(&w, "    kb_ldmatrix_x4(a[i], sa + kb_swizzle<%d>(warp_m * WTM + i * 16 + (lane & 15), kk * 2 + (lane >> 4)));",
           a_cpr);
    gl(&w, "#pragma unroll");
    gl(&w, "for (int j = 0; j < NI; j += 2) {");
    w.ind++;
    gl(&w, "unsigned r[4];");
    if (bt) {
        gl(&w, "// B^T tile rows are n: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)");
        gl(&w, "// read as stored give each lane B[2t..2t+1][g]: b[j] = r[0], r[1]; b[j + 1] = r[2], r[3]");
        gl(&w, "kb_ldmatrix_x4(r, sb + kb_swizzle<%d>(warp_n * WTN + j * 8 + (lane & 7) + ((lane >> 4) << 3),", b_cpr);
        gl(&w, "                                      kk * 2 + ((lane >> 3) & 1)));");
    } else {
        gl(&w, "// B tile rows are k: matrices (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15)");
        gl(&w, "// read transposed give each lane B[2t..2t+1][g]: b[j] = r[0], r[1]; b[j + 1] = r[2], r[3]");
        gl(&w, "kb_ldmatrix_x4_trans(r, sb + kb_swizzle<%d>(kk * 16 + (lane & 15), (warp_n * WTN + j * 8) / 8 + (lane >> 4)));",
           b_cpr);
    }
    gl(&w, "b[j][0] = r[0], b[j][1] = r[1], b[j + 1][0] = r[2], b[j + 1][1] = r[3];");
    w.ind--;
    gl(&w, "}");
    gl(&w, "#pragma unroll");
    gl(&w, "for (int i = 0; i < MI; i++)");
    gl(&w, "#pragma unroll");
    gl(&w, "    for (int j = 0; j < NI; j++) kb_mma_16816(acc[i][j], a[i], b[j]);");
    w.ind--;
    gl(&w, "}");
    w.ind--;
    gl(&w, "}");
    gl(&w, "kb_cp_async_wait<0>();  // no copy outlives the block (the last groups are empty)");
    gl(&w, "%s", "");
    /* ---- the epilogue and the stores */
    gl(&w, "// epilogue: lane (g, t) holds rows g and g + 8, columns 2t and 2t + 1 of each m16n8 tile");
    gl(&w, "#pragma unroll");
    gl(&w, "for (int i = 0; i < MI; i++) {");
    w.ind++;
    gl(&w, "#pragma unroll");
    gl(&w, "for (int h = 0; h < 2; h++) {");
    w.ind++;
    gl(&w, "const long long row = m0 + warp_m * WTM + i * 16 + h * 8 + (lane >> 2);");
    gl(&w, "if (row >= M) continue;");
    if (!spec->no_out) gl(&w, "%s *orow = out + (bz * M + row) * N;", TO);
    gl(&w, "#pragma unroll");
    gl(&w, "for (int j = 0; j < NI; j++) {");
    w.ind++;
    gl(&w, "const long long col = n0 + warp_n * WTN + j * 8 + (lane & 3) * 2;");
    gl(&w, "if (col >= N) continue;");
    gl(&w, "float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];");
    if (spec->epilogue) {
        gl(&w, "{");
        w.ind++;
        if ((st = emit_epilogue_element(ctx, &w, spec, "v0", "col")) != KB_OK) goto fail;
        w.ind--;
        gl(&w, "}");
        gl(&w, "if (col + 1 < N) {");
        w.ind++;
        gl(&w, "const long long col1 = col + 1;");
        if ((st = emit_epilogue_element(ctx, &w, spec, "v1", "col1")) != KB_OK) goto fail;
        w.ind--;
        gl(&w, "}");
    }
    if (!spec->no_out) {
        gl(&w, "if (col + 1 < N && (N & 1) == 0) {  // an even N keeps (row * N + col) even: an aligned pair");
        gl(&w, "    %s", pair_store(spec->out));
        gl(&w, "} else {");
        char s0[96], s1[96];
        snprintf(s0, sizeof s0, cg_store_fmt(spec->out), "v0");
        snprintf(s1, sizeof s1, cg_store_fmt(spec->out), "v1");
        gl(&w, "    orow[col] = %s;", s0);
        gl(&w, "    if (col + 1 < N) orow[col + 1] = %s;", s1);
        gl(&w, "}");
    }
    w.ind--;
    gl(&w, "}");
    w.ind--;
    gl(&w, "}");
    w.ind--;
    gl(&w, "}");
    kb_sb_puts(sb, "}\n");
    if (sb->oom) return KB_FAIL(ctx, KB_ERR_OOM, "gemm: out of memory writing the source");
    *launch = L;
    return KB_OK;
fail:
    sb->len = start;
    if (sb->buf) sb->buf[start] = '\0';
    return st;
}
