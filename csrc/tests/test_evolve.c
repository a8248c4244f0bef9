/* test_evolve.c — the schedule search (tune/evolve.c) with made-up fitness functions: legality
 * rules and the default genome, asks legal and never repeated, a known optimum found, seeded
 * repeatability, failures never re-asked nor parents, an exhausted space, told-from-elsewhere
 * genomes, and OOM at every allocation (a failed ask or tell leaves the search unchanged:
 * retried, it goes on as if nothing had failed). */
#include <stdint.h>
#include <stdlib.h>

#include "tests/check.h"
#include "tests/tgraph.h"

/* ---------------------------------------------------------------- one region over a whole graph */

/* The whole graph as one region (every non-input node; its inputs and outputs), so a test picks
 * the kind, anchor and reduce axes itself instead of depending on the partitioner's choices. */
typedef struct fixture {
    kb_ctx *ctx;
    tg t;
    kb_region reg;
    kb_partition part;
    int32_t nodes[256], ins[KB_MAX_INPUTS], outs[16], region_of[256];
    int64_t symvals[KB_MAX_SYMS];
} fixture;

static kb_status fx_region(fixture *f, kb_region_kind kind, int32_t anchor, uint32_t red) {
    if (f->t.st != KB_OK) return f->t.st;
    const kb_graph *g = f->t.g;
    int32_t n = 0;
    for (int32_t v = 0; v < kb_graph_nnodes(g); v++) {
        f->region_of[v] = -1;
        if (kb_graph_node(g, v)->op != KB_OP_INPUT) f->region_of[v] = 0, f->nodes[n++] = v;
    }
    for (int32_t i = 0; i < kb_graph_ninputs(g); i++) f->ins[i] = kb_graph_input(g, i);
    for (int32_t j = 0; j < kb_graph_noutputs(g); j++) f->outs[j] = kb_graph_output(g, j);
    f->reg = (kb_region){kind, n, f->nodes, kb_graph_ninputs(g), f->ins, kb_graph_noutputs(g), f->outs, anchor, red, 0, 0, {0, {0, 0}, {KB_GEMM_ROW, KB_GEMM_ROW}, {0, 0}, {0, 0}, 0, NULL}};
    f->part = (kb_partition){g, 1, &f->reg, f->region_of, 0};
    return KB_OK;
}

static kb_status fx_begin(fixture *f, kb_alloc_fn alloc, void *ud, int64_t s0) {
    memset(f, 0, sizeof *f);
    kb_status st = kb_ctx_new(alloc, ud, &f->ctx);
    if (st != KB_OK) return st;
    if ((st = kb_graph_new(f->ctx, &f->t.g)) != KB_OK) return st;
    int32_t id;
    f->symvals[0] = s0;
    return kb_graph_add_symbol(f->t.g, "s0", s0, &id);
}

static void fx_end(fixture *f) {
    kb_graph_free(f->t.g);
    kb_ctx_free(f->ctx);
}

/* layer_norm of x[s0, n] (ROW, anchor x) */
static kb_status fx_layernorm(fixture *f, kb_alloc_fn alloc, void *ud, kb_dtype dt, int64_t s0, const char *n) {
    kb_status st = fx_begin(f, alloc, ud, s0);
    if (st != KB_OK) return st;
    char full[32], row[32];
    snprintf(full, sizeof full, "s0,%s", n);
    snprintf(row, sizeof row, "%s", n);
    int32_t x = tg_input(&f->t, "x", dt, full), w = tg_input(&f->t, "w", dt, row), b = tg_input(&f->t, "b", dt, row);
    tg_output(&f->t, tg_layernorm(&f->t, dt, "s0", n, x, w, b, 1e-5));
    return fx_region(f, KB_REGION_ROW, x, 2);
}

/* softmax over the last dim of x[s0, n] (ROW) */
static kb_status fx_softmax(fixture *f, kb_dtype dt, int64_t s0, const char *n) {
    kb_status st = fx_begin(f, NULL, NULL, s0);
    if (st != KB_OK) return st;
    char full[32];
    snprintf(full, sizeof full, "s0,%s", n);
    int32_t x = tg_input(&f->t, "x", dt, full);
    tg_output(&f->t, tg_softmax(&f->t, dt, "s0", n, x));
    return fx_region(f, KB_REGION_ROW, x, 2);
}

/* op(x) for x[dims] (POINTWISE) */
static kb_status fx_pointwise(fixture *f, kb_op op, kb_dtype dt, int64_t s0, const char *dims) {
    kb_status st = fx_begin(f, NULL, NULL, s0);
    if (st != KB_OK) return st;
    int32_t x = tg_input(&f->t, "x", dt, dims);
    int32_t y = op == KB_OP_ADD ? tg_op(&f->t, op, dt, dims, x, x, -1) : tg_op(&f->t, op, dt, dims, x, -1, -1);
    tg_output(&f->t, y);
    return fx_region(f, KB_REGION_POINTWISE, y, 0);
}

/* column sums of x[s0, n] (COL); with center, x minus its column mean too (a second pass) */
static kb_status fx_colsum(fixture *f, kb_dtype dt, int64_t s0, const char *n, int center) {
    kb_status st = fx_begin(f, NULL, NULL, s0);
    if (st != KB_OK) return st;
    char full[32], col[32];
    snprintf(full, sizeof full, "s0,%s", n);
    snprintf(col, sizeof col, "1,%s", n);
    int32_t x = tg_input(&f->t, "x", dt, full);
    int32_t s = tg_reduce(&f->t, KB_OP_SUM, dt, col, x, 1);
    tg_output(&f->t, s);
    if (center) tg_output(&f->t, tg_op(&f->t, KB_OP_SUB, dt, full, x, tg_op(&f->t, KB_OP_EXPAND, dt, full, s, -1, -1), -1));
    return fx_region(f, KB_REGION_COL, x, 1);
}


static void fmt(const kb_genome *g, char *buf) { kb_genome_format(g, buf, 256); }

static kb_genome parse(const char *text) {
    kb_genome g;
    kb_ctx *ctx;
    kb_ctx_new(NULL, NULL, &ctx);
    kb_status st = kb_genome_parse(ctx, text, &g);
    CHECK_MSG(st == KB_OK, "parse \"%s\": %s", text, kb_ctx_error(ctx));
    kb_ctx_free(ctx);
    return g;
}

static int legal(fixture *f, const char *text) {
    kb_genome g = parse(text);
    return kb_genome_legal(&f->part, 0, f->symvals, kb_device_default(), &g);
}

/* ---------------------------------------------------------------- legality */

static void test_default_is_legal(void) {
    static const kb_dtype dts[] = {KB_F32, KB_BF16, KB_F64};
    static const char *const rows[] = {"1", "7", "8", "64", "100", "768", "1000", "1024", "1025", "3000", "4096",
                                       "5120", "12288", "65536", "s0"};
    static const int64_t s0s[] = {1, 3, 64, 4096};
    int checked = 0;
    for (size_t d = 0; d < 3; d++)
        for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
            for (size_t k = 0; k < 4; k++)
                for (int kind = 0; kind < 4; kind++) {
                    fixture f;
                    kb_status st = kind == 0 ? fx_layernorm(&f, NULL, NULL, dts[d], s0s[k], rows[i])
                                   : kind == 1 ? fx_softmax(&f, dts[d], s0s[k], rows[i])
                                   : kind == 2 ? fx_colsum(&f, dts[d], s0s[k], rows[i], (int)(i & 1))
                                               : fx_pointwise(&f, KB_OP_GELU, dts[d], s0s[k], rows[i]);
                    CHECK_STATUS(f.ctx, st, KB_OK);
                    for (int dev = 0; dev < 2 && st == KB_OK; dev++) {
                        kb_genome gn;
                        const kb_device_info *di = dev ? kb_device_default() : NULL;
                        CHECK_STATUS(f.ctx, kb_genome_default(&f.part, 0, f.symvals, di, &gn), KB_OK);
                        char text[256];
                        fmt(&gn, text);
                        CHECK_MSG(kb_genome_legal(&f.part, 0, f.symvals, di, &gn), "kind %d dtype %s rows %s s0 %lld: %s",
                                  kind, kb_dtype_name(dts[d]), rows[i], (long long)s0s[k], text);
                        /* the default is what the search asks first, unchanged */
                        kb_evolve *ev = NULL;
                        CHECK_STATUS(f.ctx, kb_evolve_new(&f.part, 0, f.symvals, di, 1, 4, &ev), KB_OK);
                        kb_genome first;
                        int n = 0;
                        CHECK_STATUS(f.ctx, kb_evolve_ask(ev, &first, 1, &n), KB_OK);
                        char ftext[256];
                        fmt(&first, ftext);
                        CHECK_MSG(n == 1 && strcmp(ftext, text) == 0, "first ask %s, default %s", ftext, text);
                        kb_evolve_free(ev);
                        checked++;
                    }
                    fx_end(&f);
                }
    CHECK(checked == 3 * 15 * 4 * 4 * 2);
}

#define REST "two_pass=1 fast_math=0 persistent=0 col_split=1"

/* Found by the fuzz target: a COL region whose columns number 0 at these sizes (a symbol bound
 * to 0) divided by its zero column blocks choosing the default genome. */
static void test_default_with_no_columns(void) {
    fixture f;
    CHECK_STATUS(NULL, fx_begin(&f, NULL, NULL, 0), KB_OK);
    int32_t x = tg_input(&f.t, "x", KB_F32, "64,s0");
    tg_output(&f.t, tg_reduce(&f.t, KB_OP_SUM, KB_F32, "s0", x, 1));
    CHECK_STATUS(f.ctx, fx_region(&f, KB_REGION_COL, x, 1), KB_OK);
    kb_genome gn;
    CHECK_STATUS(f.ctx, kb_genome_default(&f.part, 0, f.symvals, kb_device_default(), &gn), KB_OK);
    CHECK(gn.threads >= 32 && gn.col_split >= 1);
    fx_end(&f);
}

static void test_legality_rules(void) {
    fixture f;
    /* layer_norm rows of 770 f32: vec 2 divides them, vec 4 does not */
    CHECK_STATUS(f.ctx, fx_layernorm(&f, NULL, NULL, KB_F32, 64, "770"), KB_OK);
    CHECK(legal(&f, "threads=256 vec=2 rows=1 items=1 cache=regs " REST));
    CHECK(!legal(&f, "threads=256 vec=4 rows=1 items=1 cache=regs " REST));
    CHECK(!legal(&f, "threads=256 vec=2 rows=1 items=1 cache=regs two_pass=1 fast_math=0 persistent=0 col_split=2"));
    CHECK(!legal(&f, "threads=256 vec=2 rows=512 items=1 cache=reread " REST));  /* rows > threads */
    CHECK(!legal(&f, "threads=1024 vec=2 rows=1 items=1 cache=reread " REST));   /* 1024 lanes for 385 vectors */
    CHECK(legal(&f, "threads=512 vec=2 rows=1 items=1 cache=reread " REST));
    CHECK(!legal(&f, "threads=96 vec=1 rows=1 items=1 cache=reread " REST));     /* not a power of two */
    CHECK(!legal(&f, "threads=256 vec=2 rows=1 items=3 cache=reread " REST));
    CHECK(legal(&f, "threads=256 vec=1 rows=1 items=8 cache=smem " REST));
    fx_end(&f);
    /* a row length that may vary: only re-read, and only vec 1 */
    CHECK_STATUS(f.ctx, fx_layernorm(&f, NULL, NULL, KB_F32, 64, "s0"), KB_OK);
    CHECK(legal(&f, "threads=64 vec=1 rows=1 items=4 cache=reread " REST));
    CHECK(!legal(&f, "threads=128 vec=1 rows=1 items=4 cache=reread " REST));   /* 128 lanes, 64 elements */
    CHECK(!legal(&f, "threads=64 vec=1 rows=1 items=1 cache=regs " REST));
    CHECK(!legal(&f, "threads=64 vec=1 rows=1 items=1 cache=smem " REST));
    CHECK(!legal(&f, "threads=64 vec=2 rows=1 items=1 cache=reread " REST));
    fx_end(&f);
    /* shared memory bounded by the device: 16 rows of 8192 f32 = 512 KiB */
    CHECK_STATUS(f.ctx, fx_layernorm(&f, NULL, NULL, KB_F32, 64, "8192"), KB_OK);
    CHECK(legal(&f, "threads=1024 vec=4 rows=1 items=1 cache=smem " REST));
    CHECK(!legal(&f, "threads=1024 vec=4 rows=16 items=1 cache=smem " REST));
    CHECK(legal(&f, "threads=128 vec=4 rows=1 items=1 cache=regs " REST));       /* 16 vectors of 4 a lane: 64 */
    CHECK(!legal(&f, "threads=64 vec=4 rows=1 items=1 cache=regs " REST));       /* 128 floats a lane */
    CHECK(legal(&f, "threads=1024 vec=4 rows=1 items=1 cache=regs " REST));      /* 8 <= 32 at 1024 threads */
    fx_end(&f);
    /* POINTWISE: ROW and COL genes stay at 1; vec bounded by 16-byte accesses of the narrowest */
    CHECK_STATUS(f.ctx, fx_pointwise(&f, KB_OP_GELU, KB_F32, 4096, "s0,1024"), KB_OK);
    CHECK(legal(&f, "threads=256 vec=4 rows=1 items=4 cache=regs " REST));
    CHECK(!legal(&f, "threads=256 vec=8 rows=1 items=4 cache=regs " REST));
    CHECK(!legal(&f, "threads=256 vec=4 rows=2 items=4 cache=regs " REST));
    CHECK(!legal(&f, "threads=256 vec=4 rows=1 items=4 cache=regs two_pass=1 fast_math=0 persistent=0 col_split=4"));
    fx_end(&f);
    CHECK_STATUS(f.ctx, fx_pointwise(&f, KB_OP_GELU, KB_BF16, 4096, "s0,1024"), KB_OK);
    CHECK(legal(&f, "threads=256 vec=8 rows=1 items=4 cache=regs " REST));
    fx_end(&f);
    /* a tiny POINTWISE region: no 1024 threads for 64 elements */
    CHECK_STATUS(f.ctx, fx_pointwise(&f, KB_OP_ADD, KB_F64, 1, "8,8"), KB_OK);
    CHECK(legal(&f, "threads=256 vec=2 rows=1 items=1 cache=regs " REST));
    CHECK(!legal(&f, "threads=1024 vec=2 rows=1 items=1 cache=regs " REST));
    CHECK(!legal(&f, "threads=32 vec=2 rows=1 items=2 cache=regs " REST));
    CHECK(legal(&f, "threads=32 vec=1 rows=1 items=2 cache=regs " REST));
    fx_end(&f);
    /* COL: split only with a single pass, and only for a tall enough column */
    CHECK_STATUS(f.ctx, fx_colsum(&f, KB_F32, 4096, "256", 0), KB_OK);
    CHECK(legal(&f, "threads=64 vec=4 rows=1 items=4 cache=reread two_pass=1 fast_math=0 persistent=0 col_split=32"));
    CHECK(legal(&f, "threads=64 vec=4 rows=1 items=4 cache=reread two_pass=1 fast_math=0 persistent=0 col_split=64"));
    CHECK(!legal(&f, "threads=64 vec=4 rows=1 items=4 cache=reread two_pass=1 fast_math=0 persistent=0 col_split=128"));
    CHECK(!legal(&f, "threads=128 vec=4 rows=1 items=4 cache=reread " REST));   /* 64 vectors of columns */
    CHECK(!legal(&f, "threads=64 vec=4 rows=2 items=4 cache=reread " REST));
    fx_end(&f);
    CHECK_STATUS(f.ctx, fx_colsum(&f, KB_F32, 4096, "256", 1), KB_OK);
    CHECK(!legal(&f, "threads=64 vec=4 rows=1 items=4 cache=reread two_pass=1 fast_math=0 persistent=0 col_split=2"));
    CHECK(legal(&f, "threads=64 vec=4 rows=1 items=4 cache=reread " REST));
    fx_end(&f);
    CHECK_STATUS(f.ctx, fx_colsum(&f, KB_F32, 64, "256", 0), KB_OK);          /* 64 rows: split <= 8 */
    CHECK(legal(&f, "threads=64 vec=4 rows=1 items=4 cache=reread two_pass=1 fast_math=0 persistent=0 col_split=8"));
    CHECK(!legal(&f, "threads=64 vec=4 rows=1 items=4 cache=reread two_pass=1 fast_math=0 persistent=0 col_split=16"));
    fx_end(&f);
}

static void test_bad_arguments(void) {
    fixture f;
    CHECK_STATUS(f.ctx, fx_softmax(&f, KB_F32, 8, "128"), KB_OK);
    kb_evolve *ev = NULL;
    CHECK_STATUS(f.ctx, kb_evolve_new(&f.part, 1, f.symvals, NULL, 0, 8, &ev), KB_ERR_INVALID);
    CHECK_STATUS(f.ctx, kb_evolve_new(&f.part, -1, f.symvals, NULL, 0, 8, &ev), KB_ERR_INVALID);
    CHECK_STATUS(f.ctx, kb_evolve_new(&f.part, 0, NULL, NULL, 0, 8, &ev), KB_ERR_INVALID);
    CHECK_STATUS(f.ctx, kb_evolve_new(&f.part, 0, f.symvals, NULL, 0, 1, &ev), KB_ERR_INVALID);
    CHECK(ev == NULL);
    f.reg.kind = KB_REGION_EXTERN;
    CHECK_STATUS(f.ctx, kb_evolve_new(&f.part, 0, f.symvals, NULL, 0, 8, &ev), KB_ERR_INVALID);
    kb_genome g = parse("threads=256");
    CHECK(!kb_genome_legal(&f.part, 0, f.symvals, NULL, &g));
    f.reg.kind = KB_REGION_ROW;
    CHECK_STATUS(f.ctx, kb_evolve_new(&f.part, 0, f.symvals, NULL, 0, 0, &ev), KB_OK); /* 0: the default population */
    kb_genome out[64];
    int n = -1;
    CHECK_STATUS(f.ctx, kb_evolve_ask(ev, out, 64, &n), KB_OK);
    CHECK(n == 12);
    CHECK(kb_evolve_generation(ev) == 0);
    CHECK(!kb_evolve_best(ev, NULL, NULL));
    CHECK_STATUS(f.ctx, kb_evolve_tell(ev, &out[0], NAN), KB_ERR_INVALID);
    kb_genome bad = parse("threads=256 vec=4 rows=1 items=1 cache=regs two_pass=1 fast_math=0 persistent=0 col_split=2");
    CHECK_STATUS(f.ctx, kb_evolve_tell(ev, &bad, 1.0), KB_ERR_INVALID);
    CHECK(strstr(kb_ctx_error(f.ctx), "not legal") != NULL);
    CHECK_STATUS(f.ctx, kb_evolve_ask(ev, out, 0, &n), KB_OK);
    CHECK(n == 0);
    kb_evolve_free(ev);
    kb_evolve_free(NULL);
    fx_end(&f);
}

/* ---------------------------------------------------------------- the search */

static double log2d(double x) { return log(x) / log(2.0); }

/* A made-up time for a layer_norm genome, smallest (1.0) at one legal genome far from the
 * default: threads=128 vec=4 rows=1 cache=regs persistent=1 (layer_norm has no op fast math changes
 * nor softmax's max and sum(exp): fast_math and two_pass are pinned, their terms only constants). */
static double ln_cost(const kb_genome *g) {
    return 1.0 + 0.10 * fabs(log2d(g->threads) - 7) + 0.15 * fabs(log2d(g->vec) - 2) + 0.08 * log2d(g->rows) +
           0.04 * log2d(g->items) + (g->cache == KB_CACHE_REGS ? 0 : g->cache == KB_CACHE_SMEM ? 0.2 : 0.3) +
           (g->two_pass ? 0.05 : 0) + (g->fast_math ? 0 : 0.05) + (g->persistent ? 0 : 0.03);
}

static const char *const LN_BEST = "threads=128 vec=4 rows=1 items=1 cache=regs two_pass=1 fast_math=0 persistent=1 col_split=1";

typedef struct seen_set {
    char (*text)[256];
    int n, cap;
} seen_set;

static int seen_add(seen_set *s, const kb_genome *g) { /* 0 if already there */
    char t[256];
    fmt(g, t);
    for (int i = 0; i < s->n; i++)
        if (strcmp(s->text[i], t) == 0) return 0;
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 256;
        s->text = realloc(s->text, (size_t)s->cap * sizeof *s->text);
    }
    snprintf(s->text[s->n++], 256, "%s", t);
    return 1;
}

/* Runs gens generations of the layer_norm search; fails every genome with fail_vec (0: none). */
static int run_ln(fixture *f, uint64_t seed, int pop, int gens, int fail_vec, seen_set *seen, int *found_at) {
    kb_evolve *ev = NULL;
    CHECK_STATUS(f->ctx, kb_evolve_new(&f->part, 0, f->symvals, kb_device_default(), seed, pop, &ev), KB_OK);
    if (!ev) return 0;
    kb_genome out[64];
    int total = 0, bad = 0;
    *found_at = -1;
    for (int gen = 0; gen < gens; gen++) {
        int n = 0;
        CHECK_STATUS(f->ctx, kb_evolve_ask(ev, out, 64, &n), KB_OK);
        CHECK(n == pop);
        CHECK(kb_evolve_generation(ev) == gen);
        for (int i = 0; i < n; i++) {
            char t[256];
            fmt(&out[i], t);
            if (!kb_genome_legal(&f->part, 0, f->symvals, kb_device_default(), &out[i])) bad++;
            CHECK_MSG(seen_add(seen, &out[i]), "asked twice: %s", t);
            if (strcmp(t, LN_BEST) == 0 && *found_at < 0) *found_at = gen;
            double ms = fail_vec && out[i].vec == fail_vec ? -1.0 : ln_cost(&out[i]);
            CHECK_STATUS(f->ctx, kb_evolve_tell(ev, &out[i], ms), KB_OK);
            total++;
        }
    }
    CHECK_MSG(bad == 0, "%d illegal asks", bad);
    kb_genome best;
    double ms = 0;
    CHECK(kb_evolve_best(ev, &best, &ms));
    CHECK(ms == ln_cost(&best));
    if (fail_vec) CHECK(best.vec != fail_vec);
    kb_evolve_free(ev);
    return total;
}

static void test_finds_the_optimum(void) {
    fixture f;
    CHECK_STATUS(f.ctx, fx_layernorm(&f, NULL, NULL, KB_F32, 4096, "768"), KB_OK);
    CHECK(legal(&f, LN_BEST));
    int worst = 0;
    for (uint64_t seed = 1; seed <= 8; seed++) {
        seen_set seen = {0};
        int found_at;
        run_ln(&f, seed, 12, 20, 0, &seen, &found_at);
        CHECK_MSG(found_at >= 0, "seed %llu: the optimum was not found in 20 generations", (unsigned long long)seed);
        if (found_at > worst) worst = found_at;
        free(seen.text);
    }
    printf("layer_norm optimum found by generation %d at worst (8 seeds, 12 a generation)\n", worst);
    fx_end(&f);
}

static void test_failures_never_asked_again(void) {
    fixture f;
    CHECK_STATUS(f.ctx, fx_layernorm(&f, NULL, NULL, KB_F32, 4096, "768"), KB_OK);
    seen_set seen = {0};
    int found_at;
    /* every vec=2 genome fails; the asks stay unique over 30 generations (run_ln checks) */
    CHECK(run_ln(&f, 3, 10, 30, 2, &seen, &found_at) == 300);
    free(seen.text);
    fx_end(&f);
}

static void record_asks(fixture *f, uint64_t seed, char (*texts)[256], int count) {
    kb_evolve *ev = NULL;
    CHECK_STATUS(f->ctx, kb_evolve_new(&f->part, 0, f->symvals, kb_device_default(), seed, 8, &ev), KB_OK);
    int k = 0;
    while (ev && k < count) {
        kb_genome out[8];
        int n = 0;
        CHECK_STATUS(f->ctx, kb_evolve_ask(ev, out, 3, &n), KB_OK); /* asks of 3 across batches of 8 */
        if (n == 0) break;
        for (int i = 0; i < n && k < count; i++, k++) {
            fmt(&out[i], texts[k]);
            kb_evolve_tell(ev, &out[i], i == 1 ? -1.0 : ln_cost(&out[i]));
        }
    }
    kb_evolve_free(ev);
}

static void test_same_seed_same_asks(void) {
    fixture f;
    CHECK_STATUS(f.ctx, fx_layernorm(&f, NULL, NULL, KB_F32, 4096, "768"), KB_OK);
    static char a[80][256], b[80][256], c[80][256];
    record_asks(&f, 42, a, 80);
    record_asks(&f, 42, b, 80);
    record_asks(&f, 43, c, 80);
    int same = 1, differ = 0;
    for (int i = 0; i < 80; i++) {
        same &= strcmp(a[i], b[i]) == 0;
        differ |= strcmp(a[i], c[i]) != 0;
    }
    CHECK(same);
    CHECK(differ);
    CHECK(strcmp(a[0], c[0]) == 0); /* both start at the default */
    fx_end(&f);
}

static int genes_differ(const kb_genome *a, const kb_genome *b) {
    return (a->threads != b->threads) + (a->vec != b->vec) + (a->rows != b->rows) + (a->items != b->items) +
           (a->cache != b->cache) + (a->two_pass != b->two_pass) + (a->fast_math != b->fast_math) +
           (a->persistent != b->persistent) + (a->col_split != b->col_split) + (a->row_split != b->row_split);
}

/* With every seed candidate but the default failed, the next generation can only come from the
 * default: each child is the default with one or two genes changed. */
static void test_failures_never_parents(void) {
    fixture f;
    CHECK_STATUS(f.ctx, fx_pointwise(&f, KB_OP_GELU, KB_F32, 4096, "s0,1024"), KB_OK);
    for (uint64_t seed = 0; seed < 6; seed++) {
        kb_evolve *ev = NULL;
        CHECK_STATUS(f.ctx, kb_evolve_new(&f.part, 0, f.symvals, kb_device_default(), seed, 10, &ev), KB_OK);
        kb_genome out[10], dflt;
        int n = 0;
        CHECK_STATUS(f.ctx, kb_evolve_ask(ev, out, 10, &n), KB_OK);
        CHECK(n == 10);
        dflt = out[0];
        for (int i = 0; i < n; i++) kb_evolve_tell(ev, &out[i], i == 0 ? 2.0 : -1.0);
        CHECK_STATUS(f.ctx, kb_evolve_ask(ev, out, 10, &n), KB_OK);
        CHECK(n == 10);
        for (int i = 0; i < n; i++) {
            int d = genes_differ(&out[i], &dflt);
            CHECK_MSG(d >= 1 && d <= 2, "seed %llu child %d differs from the only parent in %d genes",
                      (unsigned long long)seed, i, d);
        }
        kb_genome best;
        double ms;
        CHECK(kb_evolve_best(ev, &best, &ms) && ms == 2.0 && genes_differ(&best, &dflt) == 0);
        kb_evolve_free(ev);
    }
    fx_end(&f);
}

/* Which genes a region lets vary: two_pass only with softmax's max and sum(exp), fast_math only
 * with an op fast math changes (not in f64), cache only in ROW, col_split only in COL; the others
 * stay at the default's value, and a genome differing from an asked one only there is the same. */
static void test_canonical_domains(void) {
    struct {
        int kind; /* 0 layer_norm, 1 softmax, 2 gelu, 3 silu, 4 colsum */
        kb_dtype dt;
        int two_pass, fast_math, cache, col_split;
    } cases[] = {
        {0, KB_F32, 1, 1, 3, 1}, {1, KB_F32, 2, 2, 3, 1}, {1, KB_F64, 2, 1, 3, 1},
        {2, KB_F32, 1, 1, 1, 1}, {3, KB_BF16, 1, 2, 1, 1}, {4, KB_F32, 1, 1, 1, 7},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fixture f;
        kb_dtype dt = cases[i].dt;
        kb_status st = cases[i].kind == 0 ? fx_layernorm(&f, NULL, NULL, dt, 4096, "768")
                       : cases[i].kind == 1 ? fx_softmax(&f, dt, 4096, "768")
                       : cases[i].kind == 2 ? fx_pointwise(&f, KB_OP_GELU, dt, 4096, "s0,768")
                       : cases[i].kind == 3 ? fx_pointwise(&f, KB_OP_SILU, dt, 4096, "s0,768")
                                            : fx_colsum(&f, dt, 4096, "768", 0);
        kb_evolve *ev = NULL;
        if (st == KB_OK) st = kb_evolve_new(&f.part, 0, f.symvals, kb_device_default(), 1, 8, &ev);
        CHECK_STATUS(f.ctx, st, KB_OK);
        int32_t v[16];
        CHECK_MSG(kb_evolve_domain(ev, 5, v, 16) == cases[i].two_pass, "case %zu two_pass", i);
        CHECK_MSG(kb_evolve_domain(ev, 6, v, 16) == cases[i].fast_math, "case %zu fast_math", i);
        CHECK_MSG(kb_evolve_domain(ev, 4, v, 16) == cases[i].cache, "case %zu cache", i);
        CHECK_MSG(kb_evolve_domain(ev, 8, v, 16) == cases[i].col_split, "case %zu col_split", i);
        kb_genome out[8], twin;
        int n = 0;
        CHECK_STATUS(f.ctx, kb_evolve_ask(ev, out, 8, &n), KB_OK);
        twin = out[1];
        if (cases[i].two_pass == 1) twin.two_pass ^= 1;
        if (cases[i].fast_math == 1) twin.fast_math ^= 1;
        CHECK_STATUS(f.ctx, kb_evolve_tell(ev, &twin, 0.5), KB_OK); /* the same as out[1] */
        kb_genome best;
        double ms;
        CHECK(kb_evolve_best(ev, &best, &ms) && ms == 0.5 && genes_differ(&best, &out[1]) == 0);
        kb_evolve_free(ev);
        fx_end(&f);
    }
}

/* A space small enough to enumerate: every legal genome is asked once, then asks return none. */
static void test_exhausted_space(void) {
    fixture f;
    CHECK_STATUS(f.ctx, fx_pointwise(&f, KB_OP_ADD, KB_F64, 1, "8,8"), KB_OK);
    kb_evolve *ev = NULL;
    CHECK_STATUS(f.ctx, kb_evolve_new(&f.part, 0, f.symvals, kb_device_default(), 5, 6, &ev), KB_OK);
    /* brute force over the domains */
    int32_t dom[10][16];
    int nd[10];
    for (int i = 0; i < 10; i++) nd[i] = kb_evolve_domain(ev, i, dom[i], 16);
    CHECK(nd[1] == 2 && nd[2] == 1 && nd[4] == 1 && nd[6] == 1 && nd[8] == 1 && nd[9] == 1); /* vec 1,2; the rest pinned */
    CHECK(kb_evolve_domain(ev, 10, dom[0], 16) == 0);
    int legal_count = 0;
    for (int a = 0; a < nd[0]; a++)
        for (int b = 0; b < nd[1]; b++)
            for (int c = 0; c < nd[3]; c++)
                for (int d = 0; d < nd[7]; d++) {
                    kb_genome g = {dom[0][a], dom[1][b], dom[2][0], dom[3][c], dom[4][0],
                                   dom[5][0], dom[6][0], dom[7][d], dom[8][0], dom[9][0], 0, 0, 0, 0, 0, 0, 0};
                    legal_count += kb_genome_legal(&f.part, 0, f.symvals, kb_device_default(), &g);
                }
    CHECK(legal_count == 18);
    seen_set seen = {0};
    int asked = 0, rounds = 0;
    for (;;) {
        kb_genome out[6];
        int n = 0;
        CHECK_STATUS(f.ctx, kb_evolve_ask(ev, out, 6, &n), KB_OK);
        if (n == 0 || ++rounds > 100) break;
        for (int i = 0; i < n; i++) {
            CHECK(seen_add(&seen, &out[i]));
            CHECK(kb_genome_legal(&f.part, 0, f.symvals, kb_device_default(), &out[i]));
            kb_evolve_tell(ev, &out[i], 1.0 + out[i].threads / 1024.0 + (i % 3 == 2 ? -3 : 0));
            asked++;
        }
    }
    CHECK_MSG(asked == legal_count, "asked %d of %d", asked, legal_count);
    int n = -1;
    kb_genome out[6];
    CHECK_STATUS(f.ctx, kb_evolve_ask(ev, out, 6, &n), KB_OK);
    CHECK(n == 0);
    CHECK(kb_evolve_best(ev, NULL, NULL));
    kb_evolve_free(ev);
    free(seen.text);
    fx_end(&f);
}

/* A genome told without being asked (a cached result) is never asked, and may win. */
static void test_told_from_elsewhere(void) {
    fixture f;
    CHECK_STATUS(f.ctx, fx_layernorm(&f, NULL, NULL, KB_F32, 4096, "768"), KB_OK);
    kb_evolve *ev = NULL;
    CHECK_STATUS(f.ctx, kb_evolve_new(&f.part, 0, f.symvals, kb_device_default(), 9, 8, &ev), KB_OK);
    kb_genome ext = parse(LN_BEST), dflt;
    CHECK_STATUS(f.ctx, kb_genome_default(&f.part, 0, f.symvals, kb_device_default(), &dflt), KB_OK);
    CHECK_STATUS(f.ctx, kb_evolve_tell(ev, &ext, 0.5), KB_OK);
    CHECK_STATUS(f.ctx, kb_evolve_tell(ev, &dflt, 3.0), KB_OK); /* the default told early: not asked either */
    seen_set seen = {0};
    seen_add(&seen, &ext);
    seen_add(&seen, &dflt);
    for (int gen = 0; gen < 10; gen++) {
        kb_genome out[8];
        int n = 0;
        CHECK_STATUS(f.ctx, kb_evolve_ask(ev, out, 8, &n), KB_OK);
        CHECK(n == 8); /* the seed population is all random: the default was told */
        for (int i = 0; i < n; i++) {
            CHECK(seen_add(&seen, &out[i]));
            kb_evolve_tell(ev, &out[i], ln_cost(&out[i]));
        }
    }
    kb_genome best;
    double ms;
    CHECK(kb_evolve_best(ev, &best, &ms) && ms == 0.5 && genes_differ(&best, &ext) == 0);
    /* a later, better tell wins; a re-tell replaces the earlier time */
    CHECK_STATUS(f.ctx, kb_evolve_tell(ev, &ext, 7.0), KB_OK);
    CHECK(kb_evolve_best(ev, &best, &ms) && ms < 7.0 && genes_differ(&best, &ext) != 0);
    kb_evolve_free(ev);
    free(seen.text);
    fx_end(&f);
}

/* Codegen accepts every genome the search asks (legality is a subset of what it generates); the
 * last rows are few and long, so the search also asks rows split over blocks. */
static void test_codegen_accepts_asks(void) {
    static const char *const rows[] = {"8", "100", "768", "770", "4096", "5000", "s0", "65536", "40000"};
    int generated = 0, rejected = 0, split = 0;
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        for (int kind = 0; kind < 5; kind++) {
            fixture f;
            kb_dtype dt = i & 1 ? KB_BF16 : KB_F32;
            int64_t s0 = i >= 7 ? 5 : 300;
            kb_status st = kind == 0 ? fx_layernorm(&f, NULL, NULL, dt, s0, rows[i])
                           : kind == 1 ? fx_softmax(&f, dt, s0, rows[i])
                           : kind == 2 ? fx_colsum(&f, dt, s0, rows[i], 0)
                           : kind == 3 ? fx_colsum(&f, dt, s0, rows[i], 1)
                                       : fx_pointwise(&f, KB_OP_SILU, dt, s0, rows[i]);
            kb_evolve *ev = NULL;
            if (st == KB_OK) st = kb_evolve_new(&f.part, 0, f.symvals, kb_device_default(), i, 8, &ev);
            CHECK_STATUS(f.ctx, st, KB_OK);
            for (int gen = 0; ev && gen < 4; gen++) {
                kb_genome out[8];
                int n = 0;
                CHECK_STATUS(f.ctx, kb_evolve_ask(ev, out, 8, &n), KB_OK);
                for (int k = 0; k < n; k++) {
                    kb_kernel *kern = NULL;
                    kb_status gs = kb_kernel_generate(&f.part, 0, &out[k], kb_device_default(), &kern);
                    char t[256];
                    fmt(&out[k], t);
                    CHECK_MSG(gs == KB_OK, "kind %d rows %s: codegen rejects %s: %s", kind, rows[i], t, kb_ctx_error(f.ctx));
                    rejected += gs != KB_OK;
                    generated += gs == KB_OK;
                    split += gs == KB_OK && out[k].row_split > 1;
                    kb_kernel_free(f.ctx, kern);
                    kb_evolve_tell(ev, &out[k], out[k].threads * 0.01 + out[k].items);
                }
            }
            kb_evolve_free(ev);
            fx_end(&f);
        }
    printf("codegen generated %d asked genomes (%d with rows split), rejected %d\n", generated, split, rejected);
    CHECK(split > 0);
}

/* Regions from the real partitioner (layer_norm, softmax, then gelu of a column sum: one ROW
 * region whose column sum the genomes must keep in registers): a few generations each. */
static void test_real_partition(void) {
    fixture f;
    CHECK_STATUS(f.ctx, fx_begin(&f, NULL, NULL, 512), KB_OK);
    int32_t x = tg_input(&f.t, "x", KB_BF16, "s0,1024"), w = tg_input(&f.t, "w", KB_BF16, "1024");
    int32_t b = tg_input(&f.t, "b", KB_BF16, "1024");
    int32_t y = tg_layernorm(&f.t, KB_BF16, "s0", "1024", x, w, b, 1e-5);
    int32_t z = tg_softmax(&f.t, KB_BF16, "s0", "1024", tg_op(&f.t, KB_OP_EXP, KB_BF16, "s0,1024", y, -1, -1));
    tg_output(&f.t, y);
    tg_output(&f.t, tg_op(&f.t, KB_OP_GELU, KB_BF16, "1,1024", tg_reduce(&f.t, KB_OP_SUM, KB_BF16, "1,1024", z, 1), -1, -1));
    CHECK_STATUS(f.ctx, f.t.st, KB_OK);
    kb_partition *p = NULL;
    CHECK_STATUS(f.ctx, kb_partition_new(f.t.g, &p), KB_OK);
    int searched = 0;
    for (int32_t r = 0; p && r < p->nregions; r++) {
        if (p->regions[r].kind == KB_REGION_EXTERN) continue;
        kb_evolve *ev = NULL;
        CHECK_STATUS(f.ctx, kb_evolve_new(p, r, f.symvals, kb_device_default(), 1, 8, &ev), KB_OK);
        seen_set seen = {0};
        for (int gen = 0; ev && gen < 6; gen++) {
            kb_genome out[8];
            int n = 0;
            CHECK_STATUS(f.ctx, kb_evolve_ask(ev, out, 8, &n), KB_OK);
            for (int i = 0; i < n; i++) {
                CHECK(seen_add(&seen, &out[i]));
                CHECK(kb_genome_legal(p, r, f.symvals, kb_device_default(), &out[i]));
                kb_evolve_tell(ev, &out[i], out[i].threads / 256.0 + out[i].vec);
            }
        }
        CHECK(kb_evolve_best(ev, NULL, NULL));
        kb_evolve_free(ev);
        free(seen.text);
        searched++;
    }
    CHECK(searched >= 1);
    CHECK(p && p->nregions == 1 && p->regions[0].kind == KB_REGION_ROW);
    kb_partition_free(p);
    fx_end(&f);
}

/* ---------------------------------------------------------------- OOM */


#define OOM_ASKS 200

/* One search under the books' fail_at: graph, search, 12 generations of 8, and a genome told from
 * elsewhere just when the record is full (so tell allocates too). A failure before the search exists
 * ends the run; a failed ask or tell is retried with the allocator healed and must then give what
 * a run with no failure gives. Returns the number of asks written to texts. */
static int oom_run(books *b, char (*texts)[256], int *failed_in_search) {
    fixture f;
    int k = 0;
    *failed_in_search = 0;
    kb_evolve *ev = NULL;
    kb_status st = fx_layernorm(&f, failing_alloc, b, KB_F32, 4096, "768");
    if (st == KB_OK) st = kb_evolve_new(&f.part, 0, f.symvals, kb_device_default(), 11, 8, &ev);
    CHECK_MSG(st == KB_OK || st == KB_ERR_OOM, "fail_at %ld: %s", b->fail_at, kb_status_name(st));
    if (st == KB_ERR_OOM && f.ctx) CHECK_MSG(kb_ctx_error(f.ctx)[0] != '\0', "fail_at %ld: OOM without a message", b->fail_at);
    for (int gen = 0; st == KB_OK && gen < 12; gen++) {
        kb_genome out[8];
        int n = 0;
        st = kb_evolve_ask(ev, out, 8, &n);
        if (st == KB_ERR_OOM) {
            *failed_in_search = 1;
            b->fail_at = 0;
            st = kb_evolve_ask(ev, out, 8, &n);
        }
        CHECK_STATUS(f.ctx, st, KB_OK);
        for (int i = 0; st == KB_OK && i < n && k < OOM_ASKS; i++) {
            fmt(&out[i], texts[k++]);
            st = kb_evolve_tell(ev, &out[i], i == 4 ? -1 : ln_cost(&out[i]));
        }
        if (st == KB_OK && gen == 7) { /* 64 records: the record and its table grow in this tell */
            kb_genome ext = parse("threads=32 vec=1 rows=32 items=8 cache=reread two_pass=1 fast_math=0 persistent=1 col_split=1");
            for (int t = 0; t < 2; t++) {
                st = kb_evolve_tell(ev, &ext, 9.0);
                if (st != KB_ERR_OOM) break;
                *failed_in_search = 1;
                b->fail_at = 0;
            }
            CHECK_STATUS(f.ctx, st, KB_OK);
        }
    }
    kb_evolve_free(ev);
    fx_end(&f);
    return k;
}

static void test_oom(void) {
    static char want[OOM_ASKS][256], got[OOM_ASKS][256];
    books ref = {0, 0, 0, 0, 0};
    int in_search;
    int nwant = oom_run(&ref, want, &in_search);
    CHECK(nwant == 96 && ref.blocks == 0);
    long runs = 0, retried = 0;
    for (long n = 1; n < 100000; n++) {
        books b = {0, n, 0, 0, 0};
        memset(got, 0, sizeof got);
        int ngot = oom_run(&b, got, &in_search);
        runs++;
        CHECK_MSG(b.blocks == 0 && b.bytes == 0, "fail_at %ld: %ld blocks, %lld bytes left", n, b.blocks, b.bytes);
        CHECK_MSG(!b.bad_size, "fail_at %ld: a block was freed with the wrong size", n);
        if (in_search) {
            retried++;
            int same = ngot == nwant;
            for (int i = 0; same && i < nwant; i++) same = strcmp(got[i], want[i]) == 0;
            CHECK_MSG(same, "fail_at %ld: after a retried OOM the asks differ from a run without one", n);
        }
        if (b.fail_at != 0 && b.requests < n) break; /* nothing failed: every allocation was covered */
    }
    CHECK(retried >= 4);
    printf("%ld OOM runs, %ld failed inside the search and were retried\n", runs, retried);
}

int main(void) {
    test_default_is_legal();
    test_default_with_no_columns();
    test_legality_rules();
    test_bad_arguments();
    test_finds_the_optimum();
    test_failures_never_asked_again();
    test_same_seed_same_asks();
    test_failures_never_parents();
    test_canonical_domains();
    test_exhausted_space();
    test_told_from_elsewhere();
    test_real_partition();
    test_codegen_accepts_asks();
    test_oom();
    return check_report();
}
