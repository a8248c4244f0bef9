/* test_codegen.c — fusion, default genomes and CUDA generation without a GPU: each graph's
 * partition, run region by region through the interpreter, must compute what the whole graph
 * computes; every region generates deterministic source for its default genome and a sweep of
 * others (illegal ones are refused with KB_ERR_INVALID, never crash); genomes round-trip
 * through text. With KB_CODEGEN_OUT=<dir> the kernels are written there as .cu files
 * (tests/compile_kernels.sh compiles them with nvcc for sm_80 and sm_90). */
#include <stdint.h>
#include <stdlib.h>

#include "tests/check.h"
#include "tests/tgraph.h"

static kb_ctx *ctx;
static const char *outdir;
static int nwritten, ninvalid;

static tg new_graph(void) {
    tg t = {NULL, KB_OK};
    t.st = kb_graph_new(ctx, &t.g);
    return t;
}

/* ---------------------------------------------------------------- host values */

static uint64_t rng = 88172645463325252ull;
static double rnd(void) { /* xorshift, roughly N(0,1) from the sum of four uniforms */
    double s = 0;
    for (int i = 0; i < 4; i++) {
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        s += (double)(rng >> 11) / 9007199254740992.0;
    }
    return (s - 2) * 1.7;
}

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static float from_f16(uint16_t h) {
    int e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? ldexpf((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexpf((float)(m | 1024), e - 25);
    return (h & 0x8000) ? -v : v;
}
static uint16_t to_f16(float f) { /* fine for test data of modest range */
    uint16_t s = f < 0 ? 0x8000 : 0;
    f = fabsf(f);
    if (f < 6.1e-5f) return s;
    int e;
    float m = frexpf(f, &e);
    int mant = (int)lrintf((m * 2 - 1) * 1024);
    if (mant == 1024) mant = 0, e++;
    return (uint16_t)(s | ((e + 14) << 10) | mant);
}

static double get(kb_dtype t, const void *p, int64_t i) {
    switch (t) {
    case KB_F32: return ((const float *)p)[i];
    case KB_F64: return ((const double *)p)[i];
    case KB_BF16: return from_bf16(((const uint16_t *)p)[i]);
    case KB_F16: return from_f16(((const uint16_t *)p)[i]);
    case KB_I64: return (double)((const int64_t *)p)[i];
    case KB_I32: return ((const int32_t *)p)[i];
    default: return ((const uint8_t *)p)[i];
    }
}

static void set(kb_dtype t, void *p, int64_t i, double v) {
    switch (t) {
    case KB_F32: ((float *)p)[i] = (float)v; break;
    case KB_F64: ((double *)p)[i] = v; break;
    case KB_BF16: ((uint16_t *)p)[i] = to_bf16((float)v); break;
    case KB_F16: ((uint16_t *)p)[i] = to_f16((float)v); break;
    case KB_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    case KB_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    default: ((uint8_t *)p)[i] = v != 0; break;
    }
}

static void *alloc_value(const kb_graph *g, int32_t v, const int64_t *sv, int64_t *numel) {
    int64_t sizes[KB_MAX_RANK];
    *numel = kb_value_sizes(g, v, sv, sizes);
    return calloc((size_t)(*numel ? *numel : 1), kb_dtype_size(kb_graph_node(g, v)->dtype));
}

/* ---------------------------------------------------------------- the checks */

/* Runs the partition region by region through the interpreter and compares the graph's
 * outputs with a whole-graph run. int_bound: integer inputs are drawn from [0, int_bound). */
static void check_partition(const char *name, kb_graph *g, const kb_partition *p, const int64_t *sv, int int_bound) {
    int32_t n = kb_graph_nnodes(g);
    void **buf = calloc((size_t)n, sizeof *buf);
    int32_t ni = kb_graph_ninputs(g), no = kb_graph_noutputs(g);
    const void **gin = calloc((size_t)ni + 1, sizeof *gin);
    void **gout = calloc((size_t)no + 1, sizeof *gout);
    int64_t numel;
    for (int32_t i = 0; i < ni; i++) {
        int32_t v = kb_graph_input(g, i);
        kb_dtype t = kb_graph_node(g, v)->dtype;
        buf[v] = alloc_value(g, v, sv, &numel);
        for (int64_t e = 0; e < numel; e++)
            set(t, buf[v], e, kb_dtype_is_float(t) ? rnd() : (double)(e * 7 % int_bound));
        gin[i] = buf[v];
    }
    for (int32_t j = 0; j < no; j++) gout[j] = alloc_value(g, kb_graph_output(g, j), sv, &numel);
    CHECK_STATUS(ctx, kb_interp_graph(ctx, g, sv, gin, gout), KB_OK);
    for (int32_t r = 0; r < p->nregions; r++) {
        const kb_region *rg = &p->regions[r];
        CHECK_MSG(rg->kind != KB_REGION_EXTERN, "%s: unexpected EXTERN region", name);
        const void *ins[64];
        void *outs[64];
        for (int32_t i = 0; i < rg->ninputs && i < 64; i++) {
            CHECK_MSG(buf[rg->inputs[i]] != NULL, "%s: region %d reads %%%d before it exists", name, r, rg->inputs[i]);
            ins[i] = buf[rg->inputs[i]];
        }
        for (int32_t j = 0; j < rg->noutputs && j < 64; j++) {
            if (!buf[rg->outputs[j]]) buf[rg->outputs[j]] = alloc_value(g, rg->outputs[j], sv, &numel);
            outs[j] = buf[rg->outputs[j]];
        }
        CHECK_STATUS(ctx, kb_interp_region(ctx, p, r, sv, ins, outs), KB_OK);
    }
    for (int32_t j = 0; j < no; j++) {
        int32_t v = kb_graph_output(g, j);
        kb_dtype t = kb_graph_node(g, v)->dtype;
        double tol = t == KB_BF16 ? 2e-2 : t == KB_F16 ? 2e-3 : t == KB_F32 ? 1e-5 : 1e-12;
        int64_t sizes[KB_MAX_RANK];
        numel = kb_value_sizes(g, v, sv, sizes);
        int bad = 0;
        for (int64_t e = 0; e < numel && buf[v]; e++)
            if (!check_close(get(t, buf[v], e), get(t, gout[j], e), tol)) bad++;
        CHECK_MSG(buf[v] && bad == 0, "%s: output %d (%%%d): %d of %lld elements differ between the regions and the graph",
                  name, j, v, bad, (long long)numel);
    }
    for (int32_t v = 0; v < n; v++) free(buf[v]);
    for (int32_t j = 0; j < no; j++) free(gout[j]);
    free(buf);
    free(gin);
    free(gout);
}

static void write_kernel(const char *name, int r, const char *tag, const char *src) {
    if (!outdir) return;
    char path[512];
    snprintf(path, sizeof path, "%s/%s_r%d_%s.cu", outdir, name, r, tag);
    FILE *f = fopen(path, "w");
    CHECK_MSG(f != NULL, "cannot write %s", path);
    if (!f) return;
    fputs(src, f);
    fclose(f);
    nwritten++;
}


/* Generates one genome twice (determinism) and writes it. Returns the status. */
static kb_status gen_one(const char *name, const kb_partition *p, int r, const kb_genome *gn, int must) {
    kb_kernel *k1 = NULL, *k2 = NULL;
    kb_status s = kb_kernel_generate(p, r, gn, kb_device_default(), &k1);
    char text[256], tag[112], rs[16] = "";
    kb_genome_format(gn, text, sizeof text);
    if (gn->row_split > 1) snprintf(rs, sizeof rs, "_rs%d", gn->row_split);
    snprintf(tag, sizeof tag, "t%d_v%d_r%d_i%d_%s_tp%d_fm%d_p%d_cs%d%s", gn->threads, gn->vec, gn->rows, gn->items,
             gn->cache == KB_CACHE_REGS ? "regs" : gn->cache == KB_CACHE_SMEM ? "smem" : "reread", gn->two_pass,
             gn->fast_math, gn->persistent, gn->col_split, rs);
    if (s == KB_ERR_INVALID && !must) {
        ninvalid++;
        return s;
    }
    CHECK_MSG(s == KB_OK, "%s region %d [%s]: %s", name, r, text, kb_ctx_error(ctx));
    if (s != KB_OK) return s;
    CHECK_STATUS(ctx, kb_kernel_generate(p, r, gn, kb_device_default(), &k2), KB_OK);
    if (k2) CHECK_MSG(strcmp(k1->source, k2->source) == 0, "%s region %d: generation is not deterministic", name, r);
    CHECK(strstr(k1->source, k1->name) != NULL);
    CHECK(k1->block == gn->threads);
    CHECK(k1->units_per_block > 0);
    uint32_t grid[3];
    int64_t sv[KB_MAX_SYMS];
    for (int i = 0; i < KB_MAX_SYMS; i++) sv[i] = 37;
    kb_kernel_grid(k1, sv, kb_device_default(), grid);
    CHECK(grid[0] >= 1 && grid[1] == 1 && grid[2] == 1);
    write_kernel(name, r, tag, k1->source);
    kb_kernel_free(ctx, k1);
    kb_kernel_free(ctx, k2);
    return s;
}

/* The default genome, then a sweep of the genes that matter for the region's kind. */
static void check_codegen(const char *name, const kb_partition *p, const int64_t *sv) {
    for (int32_t r = 0; r < p->nregions; r++) {
        if (p->regions[r].kind == KB_REGION_EXTERN) continue;
        kb_genome gn;
        CHECK_STATUS(ctx, kb_genome_default(p, r, sv, kb_device_default(), &gn), KB_OK);
        char text[256];
        kb_genome_format(&gn, text, sizeof text);
        kb_genome back;
        CHECK_MSG(kb_genome_legal(p, r, sv, kb_device_default(), &gn), "%s region %d: the default genome is illegal for the search: %s",
                  name, r, text);
        CHECK_STATUS(ctx, kb_genome_parse(ctx, text, &back), KB_OK);
        CHECK_MSG(memcmp(&back, &gn, sizeof gn) == 0, "genome text does not round-trip: %s", text);
        gen_one(name, p, r, &gn, 1);
        static const int vecs[] = {1, 2, 4, 8};
        for (int vi = 0; vi < 4; vi++) {
            kb_genome v = gn;
            v.vec = vecs[vi];
            switch (p->regions[r].kind) {
            case KB_REGION_POINTWISE:
                for (int items = 1; items <= 2; items++)
                    for (int pers = 0; pers <= 1; pers++) {
                        v.items = items, v.persistent = pers;
                        gen_one(name, p, r, &v, 0);
                    }
                break;
            case KB_REGION_ROW: {
                static const int shapes[][2] = {{128, 1}, {1024, 1}, {256, 8}, {64, 8}};
                for (int si = 0; si < 4; si++)
                    for (int cache = 0; cache < 3; cache++) {
                        v.threads = shapes[si][0], v.rows = shapes[si][1], v.cache = cache, v.items = cache == 2 ? 4 : 1;
                        for (int tp = 0; tp <= 1; tp++) {
                            v.two_pass = tp;
                            gen_one(name, p, r, &v, 0);
                        }
                    }
                /* rows split over blocks (refused where a reduction does not merge from parts) */
                v.threads = 128, v.rows = 1, v.persistent = 0, v.two_pass = 1;
                for (int rs = 2; rs <= 32; rs *= 16)
                    for (int cache = 0; cache < 3; cache += 2) {
                        v.row_split = rs, v.cache = cache, v.items = cache == 2 ? 4 : 1;
                        gen_one(name, p, r, &v, 0);
                    }
                v.row_split = gn.row_split;
                break;
            }
            case KB_REGION_COL:
                for (int cs = 1; cs <= 8; cs *= 8) {
                    v.col_split = cs, v.threads = 128, v.items = 4;
                    gen_one(name, p, r, &v, 0);
                }
                break;
            default: break;
            }
        }
    }
}

static void check_graph(const char *name, tg *t, const int64_t *sv, int int_bound, const char *expect) {
    CHECK_MSG(t->st == KB_OK, "%s: build failed: %s", name, kb_ctx_error(ctx));
    if (t->st != KB_OK) return;
    kb_partition *p = NULL;
    CHECK_STATUS(ctx, kb_partition_new(t->g, &p), KB_OK);
    if (!p) return;
    char kinds[256] = "";
    for (int32_t r = 0; r < p->nregions; r++) {
        strcat(kinds, r ? " " : "");
        strcat(kinds, kb_region_kind_name(p->regions[r].kind));
    }
    CHECK_MSG(strcmp(kinds, expect) == 0, "%s: regions \"%s\", want \"%s\"", name, kinds, expect);
    if (getenv("KB_CODEGEN_DUMP")) {
        char *text = NULL;
        if (kb_partition_dump(p, &text) == KB_OK) printf("== %s\n%s", name, text);
        kb_string_free(ctx, text);
    }
    check_partition(name, t->g, p, sv, int_bound);
    check_codegen(name, p, sv);
    kb_partition_free(p);
}

/* ---------------------------------------------------------------- the graphs */

static const kb_dtype DTYPES[] = {KB_F32, KB_BF16, KB_F16};
static const char *const DTN[] = {"f32", "bf16", "f16"};

static void test_norms(void) {
    for (int di = 0; di < 3; di++) {
        kb_dtype dt = DTYPES[di];
        char name[64];
        int64_t sv[1] = {6};
        tg t = new_graph();
        int32_t s;
        kb_graph_add_symbol(t.g, "s0", 6, &s);
        int32_t x = tg_input(&t, "x", dt, "s0,1024"), w = tg_input(&t, "w", dt, "1024"), b = tg_input(&t, "b", dt, "1024");
        tg_output(&t, tg_layernorm(&t, dt, "s0", "1024", x, w, b, 1e-5));
        snprintf(name, sizeof name, "layernorm_%s", DTN[di]);
        check_graph(name, &t, sv, 1, "ROW");
        kb_graph_free(t.g);

        /* residual + layernorm; the sum is an output too (the residual stream) */
        t = new_graph();
        kb_graph_add_symbol(t.g, "s0", 6, &s);
        x = tg_input(&t, "x", dt, "s0,768");
        int32_t res = tg_input(&t, "res", dt, "s0,768");
        w = tg_input(&t, "w", dt, "768"), b = tg_input(&t, "b", dt, "768");
        int32_t h = tg_op(&t, KB_OP_ADD, dt, "s0,768", x, res, -1);
        tg_output(&t, h);
        tg_output(&t, tg_layernorm(&t, dt, "s0", "768", h, w, b, 1e-5));
        snprintf(name, sizeof name, "res_layernorm_%s", DTN[di]);
        check_graph(name, &t, sv, 1, "ROW");
        kb_graph_free(t.g);

        /* rms norm with the per-row statistic as a second output */
        t = new_graph();
        kb_graph_add_symbol(t.g, "s0", 6, &s);
        x = tg_input(&t, "x", dt, "s0,4096");
        w = tg_input(&t, "w", dt, "4096");
        int32_t ms = tg_reduce(&t, KB_OP_MEAN, KB_F32, "s0,1",
                               tg_op(&t, KB_OP_MUL, KB_F32, "s0,4096", tg_op(&t, KB_OP_CAST, KB_F32, "s0,4096", x, -1, -1),
                                     tg_op(&t, KB_OP_CAST, KB_F32, "s0,4096", x, -1, -1), -1), 2);
        int32_t rs = tg_op(&t, KB_OP_RSQRT, KB_F32, "s0,1", tg_op(&t, KB_OP_ADD, KB_F32, "s0,1", ms, tg_const(&t, KB_F32, "s0,1", 1e-6), -1), -1, -1);
        int32_t xn = tg_op(&t, KB_OP_MUL, KB_F32, "s0,4096", tg_op(&t, KB_OP_CAST, KB_F32, "s0,4096", x, -1, -1),
                           tg_op(&t, KB_OP_EXPAND, KB_F32, "s0,4096", rs, -1, -1), -1);
        int32_t we = tg_op(&t, KB_OP_EXPAND, dt, "s0,4096", tg_op(&t, KB_OP_RESHAPE, dt, "1,4096", w, -1, -1), -1, -1);
        int32_t y = tg_op(&t, KB_OP_MUL, dt, "s0,4096", tg_op(&t, KB_OP_CAST, dt, "s0,4096", xn, -1, -1), we, -1);
        tg_output(&t, y);
        tg_output(&t, rs);
        snprintf(name, sizeof name, "rmsnorm_%s", DTN[di]);
        check_graph(name, &t, sv, 1, "ROW");
        kb_graph_free(t.g);
    }
}

static void test_softmax_family(void) {
    for (int di = 0; di < 3; di++) {
        kb_dtype dt = DTYPES[di];
        char name[64];
        int64_t sv[2] = {5, 300};
        tg t = new_graph();
        int32_t s;
        kb_graph_add_symbol(t.g, "s0", 5, &s);
        int32_t x = tg_input(&t, "x", dt, "s0,1000");
        tg_output(&t, tg_softmax(&t, dt, "s0", "1000", x));
        snprintf(name, sizeof name, "softmax_%s", DTN[di]);
        check_graph(name, &t, sv, 1, "ROW");
        kb_graph_free(t.g);

        /* a row length that varies: only the re-reading schedule applies */
        t = new_graph();
        kb_graph_add_symbol(t.g, "s0", 5, &s);
        kb_graph_add_symbol(t.g, "s1", 300, &s);
        x = tg_input(&t, "x", dt, "s0,s1");
        tg_output(&t, tg_softmax(&t, dt, "s0", "s1", x));
        snprintf(name, sizeof name, "softmax_dyn_%s", DTN[di]);
        check_graph(name, &t, sv, 1, "ROW");
        kb_graph_free(t.g);

        /* cross-entropy: log_softmax, pick the target's logit, mean over the batch */
        t = new_graph();
        kb_graph_add_symbol(t.g, "s0", 5, &s);
        x = tg_input(&t, "logits", dt, "s0,1000");
        int32_t tgt = tg_input(&t, "target", KB_I64, "s0");
        int32_t xf = tg_op(&t, KB_OP_CAST, KB_F32, "s0,1000", x, -1, -1);
        int32_t m = tg_reduce(&t, KB_OP_RMAX, KB_F32, "s0,1", xf, 2);
        int32_t sh = tg_op(&t, KB_OP_SUB, KB_F32, "s0,1000", xf, tg_op(&t, KB_OP_EXPAND, KB_F32, "s0,1000", m, -1, -1), -1);
        int32_t se = tg_reduce(&t, KB_OP_SUM, KB_F32, "s0,1", tg_op(&t, KB_OP_EXP, KB_F32, "s0,1000", sh, -1, -1), 2);
        int32_t lse = tg_op(&t, KB_OP_LOG, KB_F32, "s0,1", se, -1, -1);
        int32_t logp = tg_op(&t, KB_OP_SUB, KB_F32, "s0,1000", sh, tg_op(&t, KB_OP_EXPAND, KB_F32, "s0,1000", lse, -1, -1), -1);
        int32_t ti = tg_op(&t, KB_OP_RESHAPE, KB_I64, "s0,1", tgt, -1, -1);
        int32_t picked = tg_gather(&t, KB_F32, "s0,1", logp, ti, 1);
        int32_t nll = tg_op(&t, KB_OP_NEG, KB_F32, "s0,1", picked, -1, -1);
        int32_t loss = tg_reduce(&t, KB_OP_MEAN, KB_F32, "", tg_op(&t, KB_OP_RESHAPE, KB_F32, "s0", nll, -1, -1), 1);
        tg_output(&t, loss);
        tg_output(&t, lse);
        snprintf(name, sizeof name, "cross_entropy_%s", DTN[di]);
        check_graph(name, &t, sv, 1000, "ROW ROW");
        kb_graph_free(t.g);
    }
}

/* Vectors along a row length that varies: the default takes them where the example's row is a
 * multiple of them, and the kernel records that it runs only where the row stays one. */
static void test_varying_last_dim_vectors(void) {
    tg t = new_graph();
    int32_t s;
    kb_graph_add_symbol(t.g, "s0", 5, &s);
    kb_graph_add_symbol(t.g, "s1", 300, &s);
    int32_t x = tg_input(&t, "x", KB_F32, "s0,s1");
    tg_output(&t, tg_softmax(&t, KB_F32, "s0", "s1", x));
    CHECK_STATUS(ctx, t.st, KB_OK);
    kb_partition *p = NULL;
    CHECK_STATUS(ctx, kb_partition_new(t.g, &p), KB_OK);
    if (!p) {
        kb_graph_free(t.g);
        return;
    }
    int64_t even[2] = {5, 300}, odd[2] = {5, 301};
    kb_genome gn;
    kb_kernel *k = NULL;
    CHECK_STATUS(ctx, kb_genome_default(p, 0, even, kb_device_default(), &gn), KB_OK);
    CHECK(gn.vec == 4);
    CHECK_STATUS(ctx, kb_kernel_generate(p, 0, &gn, kb_device_default(), &k), KB_OK);
    if (k) {
        CHECK(k->last_multiple == 4 && k->last_dim.coef == 1 && k->last_dim.nsym == 1 && k->last_dim.sym[0] == 1);
        CHECK(kb_kernel_admits(k, even) && !kb_kernel_admits(k, odd));
        CHECK(strstr(k->source, "s1 (the last dim) % 4 == 0") != NULL);
    }
    kb_kernel_free(ctx, k);
    k = NULL;
    CHECK_STATUS(ctx, kb_genome_default(p, 0, odd, kb_device_default(), &gn), KB_OK);
    CHECK(gn.vec == 1); /* 301: no vector divides it */
    CHECK_STATUS(ctx, kb_kernel_generate(p, 0, &gn, kb_device_default(), &k), KB_OK);
    if (k) CHECK(k->last_multiple == 1 && kb_kernel_admits(k, odd) && kb_kernel_admits(k, even));
    kb_kernel_free(ctx, k);
    kb_partition_free(p);
    kb_graph_free(t.g);
}

static void test_pointwise(void) {
    for (int di = 0; di < 3; di++) {
        kb_dtype dt = DTYPES[di];
        char name[64];
        int64_t sv[1] = {7};
        tg t = new_graph();
        int32_t s;
        kb_graph_add_symbol(t.g, "s0", 7, &s);
        int32_t x = tg_input(&t, "x", dt, "s0,768"), b = tg_input(&t, "b", dt, "768");
        int32_t be = tg_op(&t, KB_OP_EXPAND, dt, "s0,768", tg_op(&t, KB_OP_RESHAPE, dt, "1,768", b, -1, -1), -1, -1);
        tg_output(&t, tg_op(&t, KB_OP_GELU_TANH, dt, "s0,768", tg_op(&t, KB_OP_ADD, dt, "s0,768", x, be, -1), -1, -1));
        snprintf(name, sizeof name, "bias_gelu_%s", DTN[di]);
        check_graph(name, &t, sv, 1, "POINTWISE");
        kb_graph_free(t.g);

        /* swiglu from one projection: the two halves are slices (strided loads) */
        t = new_graph();
        kb_graph_add_symbol(t.g, "s0", 7, &s);
        x = tg_input(&t, "x", dt, "s0,1024");
        int32_t a = tg_slice(&t, dt, "s0,512", x, 1, 0, 1), g = tg_slice(&t, dt, "s0,512", x, 1, 512, 1);
        tg_output(&t, tg_op(&t, KB_OP_MUL, dt, "s0,512", tg_op(&t, KB_OP_SILU, dt, "s0,512", a, -1, -1), g, -1));
        snprintf(name, sizeof name, "swiglu_%s", DTN[di]);
        check_graph(name, &t, sv, 1, "POINTWISE");
        kb_graph_free(t.g);

        /* a transposed read, a where with a comparison, an odd size (tails) */
        t = new_graph();
        kb_graph_add_symbol(t.g, "s0", 7, &s);
        x = tg_input(&t, "x", dt, "37,s0");
        int8_t perm[2] = {1, 0};
        int32_t xt = tg_permute(&t, dt, "s0,37", x, perm);
        int32_t y = tg_input(&t, "y", dt, "s0,37");
        int32_t gt = tg_op(&t, KB_OP_GT, KB_BOOL, "s0,37", xt, y, -1);
        tg_output(&t, tg_op(&t, KB_OP_WHERE, dt, "s0,37", gt, xt, tg_op(&t, KB_OP_MUL, dt, "s0,37", y, tg_const(&t, dt, "s0,37", -0.5), -1)));
        tg_output(&t, gt);
        snprintf(name, sizeof name, "transpose_where_%s", DTN[di]);
        check_graph(name, &t, sv, 1, "POINTWISE");
        kb_graph_free(t.g);
    }
    /* f64 and integer arithmetic */
    int64_t sv[1] = {9};
    tg t = new_graph();
    int32_t s;
    kb_graph_add_symbol(t.g, "s0", 9, &s);
    int32_t x = tg_input(&t, "x", KB_F64, "s0,3"), k = tg_input(&t, "k", KB_I64, "s0,3");
    int32_t kf = tg_op(&t, KB_OP_CAST, KB_F64, "s0,3", k, -1, -1);
    tg_output(&t, tg_op(&t, KB_OP_ADD, KB_F64, "s0,3", tg_op(&t, KB_OP_GELU, KB_F64, "s0,3", x, -1, -1), kf, -1));
    tg_output(&t, tg_op(&t, KB_OP_ADD, KB_I64, "s0,3", k, k, -1));
    check_graph("f64_int", &t, sv, 5, "POINTWISE");
    kb_graph_free(t.g);
}

static void test_columns(void) {
    for (int di = 0; di < 3; di++) {
        kb_dtype dt = DTYPES[di];
        char name[64];
        int64_t sv[2] = {3, 11};
        tg t = new_graph();
        int32_t s;
        kb_graph_add_symbol(t.g, "s0", 3, &s);
        kb_graph_add_symbol(t.g, "s1", 11, &s);
        /* bias gradient: sum over the batch dims; and the sum of squares beside it (one pass of
           sums over the leading dims: a ROW region whose column sums stream the rows) */
        int32_t gy = tg_input(&t, "gy", dt, "s0,s1,256");
        int32_t gf = tg_op(&t, KB_OP_CAST, KB_F32, "s0,s1,256", gy, -1, -1);
        tg_output(&t, tg_op(&t, KB_OP_CAST, dt, "256", tg_reduce(&t, KB_OP_SUM, KB_F32, "256", gf, 3), -1, -1));
        tg_output(&t, tg_reduce(&t, KB_OP_SUM, KB_F32, "256", tg_op(&t, KB_OP_MUL, KB_F32, "s0,s1,256", gf, gf, -1), 3));
        snprintf(name, sizeof name, "col_sum_%s", DTN[di]);
        check_graph(name, &t, sv, 1, "ROW");
        kb_graph_free(t.g);

        /* a reduction over a middle axis (a COL whose columns are strided) and over axes 0 and 2
           (a ROW whose row is strided): batch-norm-like statistics */
        t = new_graph();
        kb_graph_add_symbol(t.g, "s0", 3, &s);
        int32_t x = tg_input(&t, "x", dt, "4,s0,64");
        tg_output(&t, tg_reduce(&t, KB_OP_RMAX, dt, "4,64", x, 2));
        int32_t y = tg_input(&t, "y", dt, "s0,8,16");
        int32_t mean = tg_reduce(&t, KB_OP_MEAN, KB_F32, "1,8,1", tg_op(&t, KB_OP_CAST, KB_F32, "s0,8,16", y, -1, -1), 5);
        tg_output(&t, mean);
        snprintf(name, sizeof name, "strided_reduce_%s", DTN[di]);
        check_graph(name, &t, sv, 1, "COL ROW");
        kb_graph_free(t.g);
    }
}

/* Found by the fuzz target: a reduced dim of a huge coefficient whose symbol's example is 0 (the
 * builder's size checks see 0 elements) made the per-thread share of a row overflow int64. Now
 * codegen refuses rows of more than 2^20 elements a thread. */
static void test_huge_rows_refused(void) {
    tg t = new_graph();
    int32_t s;
    kb_graph_add_symbol(t.g, "s0", 0, &s);
    int32_t x = tg_input(&t, "x", KB_F32, "2,288230376151711744*s0");   /* 2^58 * s0 */
    tg_output(&t, tg_reduce(&t, KB_OP_SUM, KB_F32, "2", x, 2));
    CHECK_MSG(t.st == KB_OK, "%s", kb_ctx_error(ctx));
    kb_partition *p = NULL;
    CHECK_STATUS(ctx, kb_partition_new(t.g, &p), KB_OK);
    kb_genome gn;
    kb_device_info dev = *kb_device_default();
    CHECK_STATUS(ctx, kb_genome_default(p, 0, (const int64_t[]){0}, &dev, &gn), KB_OK);
    kb_kernel *k = NULL;
    CHECK_STATUS(ctx, kb_kernel_generate(p, 0, &gn, &dev, &k), KB_ERR_UNSUPPORTED);
    CHECK(k == NULL && strstr(kb_ctx_error(ctx), "2^20") != NULL);
    kb_partition_free(p);
    kb_graph_free(t.g);
}

static void test_genome_text(void) {
    kb_genome g;
    CHECK_STATUS(ctx, kb_genome_parse(ctx, "threads=128 vec=4 cache=smem rows=2", &g), KB_OK);
    CHECK(g.threads == 128 && g.vec == 4 && g.cache == KB_CACHE_SMEM && g.rows == 2 && g.col_split == 1);
    char buf[256];
    int n = kb_genome_format(&g, buf, sizeof buf);
    CHECK(n == (int)strlen(buf));
    CHECK(strcmp(buf, "threads=128 vec=4 rows=2 items=1 cache=smem two_pass=1 fast_math=0 persistent=0 col_split=1") == 0);
    CHECK_STATUS(ctx, kb_genome_parse(ctx, "threads=128 warp=4", &g), KB_ERR_INVALID);
    CHECK_STATUS(ctx, kb_genome_parse(ctx, "cache=disk", &g), KB_ERR_INVALID);
    CHECK_STATUS(ctx, kb_genome_parse(ctx, "vec=x", &g), KB_ERR_INVALID);
    CHECK_STATUS(ctx, kb_genome_parse(ctx, "vec", &g), KB_ERR_INVALID);
    char tiny[8];
    kb_genome_format(&g, tiny, sizeof tiny);
    CHECK(strlen(tiny) == 7);
    /* a gene given twice takes its last value; the empty text is the base genome */
    CHECK_STATUS(ctx, kb_genome_parse(ctx, "threads=128 vec=2 threads=64", &g), KB_OK);
    CHECK(g.threads == 64 && g.vec == 2);
    CHECK_STATUS(ctx, kb_genome_parse(ctx, "", &g), KB_OK);
    CHECK(memcmp(&g, kb_genome_base(), sizeof g) == 0);
}

/* The gene table: names and fields in kb_genome order, the ranges the parser and the check apply. */
static void test_genome_genes(void) {
    const kb_gene *genes = kb_genome_genes();
    static const char *const names[KB_NGENES] = {"threads",  "vec",       "rows",       "items",     "cache",
                                                 "two_pass", "fast_math", "persistent", "col_split", "row_split"};
    for (int i = 0; i < KB_NGENES; i++) {
        CHECK(strcmp(genes[i].name, names[i]) == 0);
        CHECK(genes[i].offset == (size_t)i * sizeof(int32_t) && genes[i].lo <= genes[i].hi);
    }
    CHECK(strcmp(kb_cache_where_name(KB_CACHE_REREAD), "reread") == 0 && kb_cache_where_name(3) == NULL &&
          kb_cache_where_name(-1) == NULL);
    CHECK(kb_cache_where_of("smem", 4) == KB_CACHE_SMEM && kb_cache_where_of("smemx", 4) == KB_CACHE_SMEM &&
          kb_cache_where_of("sme", 3) == -1 && kb_cache_where_of("", 0) == -1);
    kb_genome g = *kb_genome_base();
    CHECK_STATUS(ctx, kb_genome_check(ctx, &g), KB_OK);
    for (int i = 0; i < KB_NGENES; i++) {
        kb_genome bad = g;
        int32_t *v = (int32_t *)((char *)&bad + genes[i].offset);
        *v = genes[i].hi + 1;
        CHECK_STATUS(ctx, kb_genome_check(ctx, &bad), KB_ERR_INVALID);
        CHECK(strstr(kb_ctx_error(ctx), genes[i].name) != NULL);
        *v = genes[i].lo - 1;
        CHECK_STATUS(ctx, kb_genome_check(ctx, &bad), KB_ERR_INVALID);
        *v = genes[i].lo;
        CHECK_STATUS(ctx, kb_genome_check(ctx, &bad), KB_OK);
    }
}


/* ---------------------------------------------------------------- GEMM regions */

/* gelu(x [s0,64] . W^T + bias) with W [128,64] (a Linear): a GEMM region with its epilogue */
static int32_t tg_gemm_bias_gelu(tg *t, int32_t x) {
    const int8_t perm[2] = {1, 0};
    int32_t w = tg_input(t, "W", KB_BF16, "128,64"), bias = tg_input(t, "bias", KB_BF16, "128");
    int32_t wt = tg_permute(t, KB_BF16, "64,128", w, perm), mm = -1;
    if (t->st == KB_OK) t->st = kb_graph_add_matmul(t->g, x, wt, KB_BF16, &mm);
    int32_t be = tg_op(t, KB_OP_EXPAND, KB_BF16, "s0,128", tg_op(t, KB_OP_RESHAPE, KB_BF16, "1,128", bias, -1, -1), -1, -1);
    int32_t y = tg_op(t, KB_OP_GELU, KB_BF16, "s0,128", tg_op(t, KB_OP_ADD, KB_BF16, "s0,128", mm, be, -1), -1, -1);
    tg_output(t, y);
    return y;
}

/* A GEMM region's kernel: the default genome carries the gemm gene (its text round trips), the
 * entry is in the region ABI with the tile as a __device__ body, the epilogue reads the bias */
static void test_gemm_region(void) {
    tg t = new_graph();
    int32_t s;
    kb_graph_add_symbol(t.g, "s0", 40, &s);
    tg_gemm_bias_gelu(&t, tg_input(&t, "x", KB_BF16, "s0,64"));
    CHECK(t.st == KB_OK);
    kb_partition *p = NULL;
    CHECK_STATUS(ctx, kb_partition_new(t.g, &p), KB_OK);
    if (!p) goto done;
    CHECK(p->nregions == 1 && p->regions[0].kind == KB_REGION_GEMM);
    int64_t sv = 40;
    kb_genome gn, back;
    CHECK_STATUS(ctx, kb_genome_default(p, 0, &sv, kb_device_default(), &gn), KB_OK);
    char text[256];
    kb_genome_format(&gn, text, sizeof text);
    CHECK(strstr(text, " gemm=") != NULL && gn.vec == 8 && gn.threads == 32 * gn.gemm_warps_m * gn.gemm_warps_n);
    CHECK_STATUS(ctx, kb_genome_parse(ctx, text, &back), KB_OK);
    CHECK(memcmp(&back, &gn, sizeof gn) == 0);
    kb_kernel *k = NULL;
    CHECK_STATUS(ctx, kb_kernel_generate(p, 0, &gn, kb_device_default(), &k), KB_OK);
    if (k) {
        CHECK(strcmp(k->name, "kb_r0_gemm") == 0 && k->block == gn.threads && k->last_multiple == 1);
        CHECK(strstr(k->source, "__device__ __forceinline__ void kb_gemm_bf16_nt_") != NULL);
        CHECK_MSG(strstr(k->source, "= __bfloat162float(bias[") != NULL && strstr(k->source, "t += gridDim.x") != NULL,
                  "%s", k->source);
        CHECK(k->units_per_block == (int64_t)gn.gemm_tile_m * gn.gemm_tile_n);
        kb_kernel_free(ctx, k);
    }
    /* a genome without the gemm gene is refused, not generated wrong */
    kb_genome plain = *kb_genome_base();
    CHECK_STATUS(ctx, kb_kernel_generate(p, 0, &plain, kb_device_default(), &k), KB_ERR_INVALID);
done:
    kb_partition_free(p);
    kb_graph_free(t.g);
}

/* ---------------------------------------------------------------- failing allocations */


/* Partition, default genome, generation (dump too): the Nth allocation fails, for every N. */
static kb_status alloc_run(books *b) {
    kb_ctx *c = NULL;
    kb_status st = kb_ctx_new(failing_alloc, b, &c);
    if (st != KB_OK) return st;
    kb_ctx *saved = ctx;
    ctx = c;
    tg t = new_graph();
    kb_partition *p = NULL;
    char *text = NULL;
    int32_t s;
    if (t.st == KB_OK) t.st = kb_graph_add_symbol(t.g, "s0", 6, &s);
    int32_t x = tg_input(&t, "x", KB_BF16, "s0,64"), w = tg_input(&t, "w", KB_BF16, "64");
    int32_t b2 = tg_input(&t, "b", KB_BF16, "64");
    int32_t y = tg_layernorm(&t, KB_BF16, "s0", "64", x, w, b2, 1e-5);
    tg_output(&t, tg_softmax(&t, KB_BF16, "s0", "64", y));
    tg_output(&t, tg_reduce(&t, KB_OP_SUM, KB_BF16, "64", y, 1));
    tg_gemm_bias_gelu(&t, y);
    if ((st = t.st) != KB_OK) goto done;
    if ((st = kb_partition_new(t.g, &p)) != KB_OK) goto done;
    if ((st = kb_partition_dump(p, &text)) != KB_OK) goto done;
    for (int32_t r = 0; r < p->nregions; r++) {
        int64_t sv = 6;
        kb_genome gn;
        kb_kernel *k = NULL;
        if ((st = kb_genome_default(p, r, &sv, kb_device_default(), &gn)) != KB_OK) goto done;
        st = kb_kernel_generate(p, r, &gn, kb_device_default(), &k);
        kb_kernel_free(c, k);
        if (st != KB_OK) goto done;
    }
done:
    kb_string_free(c, text);
    kb_partition_free(p);
    kb_graph_free(t.g);
    ctx = saved;
    kb_ctx_free(c);
    return st;
}

static void test_failing_alloc(void) {
    for (long n = 1;; n++) {
        books b = {0, n, 0, 0, 0};
        kb_status st = alloc_run(&b);
        CHECK_MSG(st == KB_OK || st == KB_ERR_OOM, "allocation %ld failed: status %s", n, kb_status_name(st));
        CHECK_MSG(b.blocks == 0 && b.bytes == 0 && !b.bad_size, "allocation %ld failed: %ld blocks, %lld bytes left%s", n,
                  b.blocks, b.bytes, b.bad_size ? ", a wrong size freed" : "");
        if (st == KB_OK || n > 100000) {
            CHECK(st == KB_OK);
            break;
        }
    }
}

int main(void) {
    if (kb_ctx_new(NULL, NULL, &ctx) != KB_OK) return 1;
    outdir = getenv("KB_CODEGEN_OUT");
    test_genome_text();
    test_genome_genes();
    test_pointwise();
    test_norms();
    test_softmax_family();
    test_varying_last_dim_vectors();
    test_columns();
    test_huge_rows_refused();
    test_gemm_region();
    test_failing_alloc();
    printf("kernels written: %d, genomes refused as illegal: %d\n", nwritten, ninvalid);
    kb_ctx_free(ctx);
    return check_report();
}
