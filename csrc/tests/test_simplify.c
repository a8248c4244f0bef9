/* test_simplify.c — kb_graph_simplify: the row sum of a one-hot (cross-entropy's backward) becomes
 * per-row work, and the interpreter gives the same outputs before and after for targets in range
 * and out of it (negative, the row length, far past it), NaN and inf values, pinned and varying
 * row lengths, either axis, i64 and i32 targets, linear maps between the where and the sum; near
 * misses are left alone; dead nodes go, inputs stay; OOM at every allocation; kb_graph_grad. */
#include <stdint.h>
#include <stdlib.h>

#include "tests/check.h"
#include "tests/tgraph.h"

static kb_ctx *ctx;

/* A graph around sum_a f(where(iota_a == T, D, 0)), with one knob per way of (not) matching. */
typedef struct spec {
    const char *name;
    int fire;            /* the sum must be gone after simplify */
    int axis;            /* the one-hot's axis (and the sum's): 1, or 0 for a transposed row */
    int pinned;          /* the row length is 5, not the symbol s1 */
    kb_dtype tdt;        /* the target's dtype */
    int swap_eq;         /* eq(T, iota) */
    int ne_form;         /* where(iota != T, 0, D) */
    double zero;         /* the where's other branch */
    int t_full, d_full;  /* T / D a full-size input, not a broadcast */
    int iota_axis;       /* -1: the one-hot's axis */
    int chain;           /* 0 none, 1 neg, 2 cast to f32 * 2.5 / -4 then neg, 3 * an input, 4 * inf */
    int keepdim;
    int two_sums;        /* a second sum of another one-hot of the same target */
} spec;

static const spec SPECS[] = {
    {"cross-entropy (neg, keepdim, s1)", 1, 1, 0, KB_I64, 0, 0, 0.0, 0, 0, -1, 1, 1, 0},
    {"pinned row, no map", 1, 1, 1, KB_I64, 0, 0, 0.0, 0, 0, -1, 0, 1, 0},
    {"i32 target, eq(T, iota), no keepdim", 1, 1, 0, KB_I32, 1, 0, 0.0, 0, 0, -1, 1, 0, 0},
    {"axis 0, ne form", 1, 0, 0, KB_I64, 0, 1, 0.0, 0, 0, -1, 1, 0, 0},
    {"cast, mul and div by constants", 1, 1, 0, KB_I64, 0, 0, -0.0, 0, 0, -1, 2, 1, 0},
    {"two one-hots of one target", 1, 1, 0, KB_I64, 0, 0, 0.0, 0, 0, -1, 1, 1, 1},
    {"no: T varies along the row", 0, 1, 0, KB_I64, 0, 0, 0.0, 1, 0, -1, 1, 1, 0},
    {"no: D varies along the row", 0, 1, 0, KB_I64, 0, 0, 0.0, 0, 1, -1, 1, 1, 0},
    {"no: the other branch is 1", 0, 1, 0, KB_I64, 0, 0, 1.0, 0, 0, -1, 1, 1, 0},
    {"no: iota on another axis", 0, 1, 0, KB_I64, 0, 0, 0.0, 0, 0, 0, 1, 1, 0},
    {"no: a float target", 0, 1, 0, KB_F64, 0, 0, 0.0, 0, 0, -1, 1, 1, 0},
    {"no: times a value", 0, 1, 0, KB_I64, 0, 0, 0.0, 0, 0, -1, 3, 1, 0},
    {"no: times inf", 0, 1, 0, KB_I64, 0, 0, 0.0, 0, 0, -1, 4, 1, 0},
};

static tg new_graph(void)
{
    tg t = {NULL, KB_OK};
    int32_t id;
    t.st = kb_graph_new(ctx, &t.g);
    if (t.st == KB_OK) t.st = kb_graph_add_symbol(t.g, "s0", 3, &id);
    if (t.st == KB_OK) t.st = kb_graph_add_symbol(t.g, "s1", 4, &id);
    return t;
}

static int32_t tg_iota(tg *t, kb_dtype dt, const char *dims, int axis)
{
    kb_node n = tg_tmpl(KB_OP_IOTA, dt, dims);
    n.axis = axis;
    return tg_add(t, &n);
}

/* Inputs t, d (and v for chain 3); outputs the sum (or sums) and the one-hot itself. */
static tg build(const spec *s)
{
    tg t = new_graph();
    const char *len = s->pinned ? "5" : "s1";
    char full[32], keep[32], red[32];
    snprintf(full, sizeof full, s->axis ? "s0,%s" : "%s,s0", len);
    snprintf(keep, sizeof keep, s->axis ? "s0,1" : "1,s0");
    snprintf(red, sizeof red, "%s", s->keepdim ? keep : "s0");
    int32_t ti = tg_input(&t, "t", s->tdt, s->t_full ? full : keep);
    int32_t di = tg_input(&t, "d", KB_F64, s->d_full ? full : keep);
    int32_t vi = s->chain == 3 ? tg_input(&t, "v", KB_F64, full) : -1;
    int32_t te = s->t_full ? ti : tg_op(&t, KB_OP_EXPAND, s->tdt, full, ti, -1, -1);
    int32_t de = s->d_full ? di : tg_op(&t, KB_OP_EXPAND, KB_F64, full, di, -1, -1);
    int32_t io = tg_iota(&t, KB_I64, full, s->iota_axis >= 0 ? s->iota_axis : s->axis);
    int32_t m = s->swap_eq ? tg_op(&t, s->ne_form ? KB_OP_NE : KB_OP_EQ, KB_BOOL, full, te, io, -1)
                           : tg_op(&t, s->ne_form ? KB_OP_NE : KB_OP_EQ, KB_BOOL, full, io, te, -1);
    int32_t z = tg_const(&t, KB_F64, full, s->zero);
    int32_t w = s->ne_form ? tg_op(&t, KB_OP_WHERE, KB_F64, full, m, z, de) : tg_op(&t, KB_OP_WHERE, KB_F64, full, m, de, z);
    kb_dtype sdt = KB_F64;
    int32_t x = w;
    if (s->chain == 1) x = tg_op(&t, KB_OP_NEG, KB_F64, full, x, -1, -1);
    if (s->chain == 2) {
        sdt = KB_F32;
        x = tg_op(&t, KB_OP_CAST, KB_F32, full, x, -1, -1);
        x = tg_op(&t, KB_OP_MUL, KB_F32, full, tg_const(&t, KB_F32, full, 2.5), x, -1);
        x = tg_op(&t, KB_OP_DIV, KB_F32, full, x, tg_const(&t, KB_F32, full, -4.0), -1);
        x = tg_op(&t, KB_OP_NEG, KB_F32, full, x, -1, -1);
    }
    if (s->chain == 3) x = tg_op(&t, KB_OP_MUL, KB_F64, full, x, vi, -1);
    if (s->chain == 4) x = tg_op(&t, KB_OP_MUL, KB_F64, full, x, tg_const(&t, KB_F64, full, INFINITY), -1);
    tg_output(&t, tg_reduce(&t, KB_OP_SUM, sdt, red, x, 1u << s->axis));
    tg_output(&t, w);
    if (s->two_sums) { /* the same target, another value and a reversed eq: one range test for both */
        int32_t m2 = tg_op(&t, KB_OP_EQ, KB_BOOL, full, te, io, -1);
        int32_t d2 = tg_op(&t, KB_OP_EXPAND, KB_F64, full, tg_op(&t, KB_OP_EXP, KB_F64, keep, di, -1, -1), -1, -1);
        int32_t w2 = tg_op(&t, KB_OP_WHERE, KB_F64, full, m2, d2, z);
        tg_output(&t, tg_reduce(&t, KB_OP_SUM, KB_F64, red, w2, 1u << s->axis));
    }
    return t;
}

static int count_op(const kb_graph *g, kb_op op)
{
    int n = 0;
    for (int32_t v = 0; v < kb_graph_nnodes(g); v++) n += kb_graph_node(g, v)->op == op;
    return n;
}

/* Targets in and out of range for a row of length L: what row r, trial k gets. */
static int64_t target(int64_t L, int r, int k)
{
    const int64_t picks[] = {0, L - 1, -1, L, 1, -7, L + 3, (int64_t)1 << 40, L / 2, -((int64_t)1 << 35)};
    return picks[(r * 3 + k) % (int)(sizeof picks / sizeof picks[0])];
}

/* Both graphs in the interpreter on the same inputs at several bindings: the same outputs, with
 * NaN equal to NaN (and -0 to 0: the sum starts from +0). */
static void check_same(const spec *s, const kb_graph *a, const kb_graph *b)
{
    static const int64_t SV[3][2] = {{3, 4}, {2, 7}, {4, 1}};
    for (int si = 0; si < 3; si++) {
        for (int k = 0; k < 4; k++) {
            void *ins[3] = {0}, *oa[3] = {0}, *ob[3] = {0};
            int ni = kb_graph_ninputs(a), no = kb_graph_noutputs(a);
            int64_t L = s->pinned ? 5 : SV[si][1], sz[KB_MAX_RANK];
            for (int i = 0; i < ni; i++) {
                int32_t v = kb_graph_input(a, i);
                const kb_node *nd = kb_graph_node(a, v);
                int64_t n = kb_value_sizes(a, v, SV[si], sz);
                ins[i] = calloc((size_t)n + 1, kb_dtype_size(nd->dtype));
                for (int64_t j = 0; j < n; j++) {
                    int64_t tv = target(L, (int)j, k);
                    double dv = j % 5 == 3 && k == 1 ? NAN : j % 7 == 2 && k == 2 ? -INFINITY : 0.25 + (double)(j * 7 % 11) - 5;
                    if (nd->dtype == KB_I64) ((int64_t *)ins[i])[j] = tv;
                    else if (nd->dtype == KB_I32) ((int32_t *)ins[i])[j] = (int32_t)(tv > INT32_MAX || tv < INT32_MIN ? -3 : tv);
                    else if (i == 0) ((double *)ins[i])[j] = (double)tv; /* a float target */
                    else ((double *)ins[i])[j] = dv;
                }
            }
            for (int j = 0; j < no; j++) {
                int32_t va = kb_graph_output(a, j);
                size_t bytes = (size_t)kb_value_sizes(a, va, SV[si], sz) * kb_dtype_size(kb_graph_node(a, va)->dtype);
                oa[j] = calloc(bytes + 8, 1);
                ob[j] = calloc(bytes + 8, 1);
            }
            CHECK_STATUS(ctx, kb_interp_graph(ctx, a, SV[si], (const void *const *)ins, oa), KB_OK);
            CHECK_STATUS(ctx, kb_interp_graph(ctx, b, SV[si], (const void *const *)ins, ob), KB_OK);
            for (int j = 0; j < no; j++) {
                int32_t va = kb_graph_output(a, j);
                int64_t n = kb_value_sizes(a, va, SV[si], sz), bad = -1;
                for (int64_t e = 0; e < n && bad < 0; e++) {
                    double x, y;
                    if (kb_graph_node(a, va)->dtype == KB_F32) x = ((float *)oa[j])[e], y = ((float *)ob[j])[e];
                    else x = ((double *)oa[j])[e], y = ((double *)ob[j])[e];
                    if (!(x == y || (x != x && y != y))) bad = e;
                }
                CHECK_MSG(bad < 0, "%s: output %d differs at element %lld (s0=%lld s1=%lld, trial %d)", s->name, j,
                          (long long)bad, (long long)SV[si][0], (long long)SV[si][1], k);
            }
            for (int i = 0; i < 3; i++) free(ins[i]), free(oa[i]), free(ob[i]);
        }
    }
}

static void test_rule(void)
{
    for (size_t i = 0; i < sizeof SPECS / sizeof SPECS[0]; i++) {
        const spec *s = &SPECS[i];
        tg t = build(s);
        CHECK_MSG(t.st == KB_OK, "%s: build failed: %s", s->name, kb_ctx_error(ctx));
        if (t.st != KB_OK) continue;
        kb_graph *out = NULL;
        CHECK_STATUS(ctx, kb_graph_simplify(t.g, &out), KB_OK);
        if (out) {
            int sums = count_op(out, KB_OP_SUM);
            CHECK_MSG(s->fire ? sums == 0 : sums == count_op(t.g, KB_OP_SUM), "%s: %d sums left", s->name, sums);
            if (!s->fire)
                CHECK_MSG(kb_graph_nnodes(out) == kb_graph_nnodes(t.g), "%s: %d nodes, was %d", s->name,
                          kb_graph_nnodes(out), kb_graph_nnodes(t.g));
            /* the one-hot stays for its other reader; two sums of one target share their test */
            CHECK_MSG(count_op(out, KB_OP_WHERE) >= 1 && count_op(out, KB_OP_IOTA) >= 1, "%s", s->name);
            if (s->fire) CHECK_MSG(count_op(out, KB_OP_GE) == 1, "%s: %d range tests", s->name, count_op(out, KB_OP_GE));
            CHECK(kb_graph_ninputs(out) == kb_graph_ninputs(t.g) && kb_graph_noutputs(out) == kb_graph_noutputs(t.g));
            check_same(s, t.g, out);
        }
        kb_graph_free(out);
        kb_graph_free(t.g);
    }
}

/* The rewrite as text: the per-row where that replaces the sum, the row length read off an iota
 * over twice it (a varying length has no literal). */
static void test_dump(void)
{
    tg t = build(&SPECS[0]);
    kb_graph *out = NULL;
    char *text = NULL;
    if (t.st == KB_OK) CHECK_STATUS(ctx, kb_graph_simplify(t.g, &out), KB_OK);
    if (out) CHECK_STATUS(ctx, kb_graph_dump(out, &text), KB_OK);
    const char *want =
        "graph(s0=3, s1=4) {\n"
        "  %0 = input user \"t\" : i64[s0,1]\n"
        "  %1 = input user \"d\" : f64[s0,1]\n"
        "  %2 = expand %0 : i64[s0,s1]\n"
        "  %3 = expand %1 : f64[s0,s1]\n"
        "  %4 = iota axis=1 : i64[s0,s1]\n"
        "  %5 = eq %4, %2 : bool[s0,s1]\n"
        "  %6 = const 0 : f64[s0,s1]\n"
        "  %7 = where %5, %3, %6 : f64[s0,s1]\n"
        "  %8 = const 0 : i64[s0,1]\n"
        "  %9 = ge %0, %8 : bool[s0,1]\n"
        "  %10 = iota axis=0 : i64[2*s1]\n"
        "  %11 = reshape %10 : i64[2,s1]\n"
        "  %12 = slice %11 axis=0 start=1 step=1 : i64[1,s1]\n"
        "  %13 = slice %12 axis=1 start=0 step=1 : i64[1,1]\n"
        "  %14 = expand %13 : i64[s0,1]\n"
        "  %15 = lt %0, %14 : bool[s0,1]\n"
        "  %16 = and %9, %15 : bool[s0,1]\n"
        "  %17 = const 0 : f64[s0,1]\n"
        "  %18 = where %16, %1, %17 : f64[s0,1]\n"
        "  %19 = neg %18 : f64[s0,1]\n"
        "  return %19, %7\n"
        "}\n";
    CHECK_MSG(text && strcmp(text, want) == 0, "dump differs:\n%s", text ? text : "(null)");
    kb_string_free(ctx, text);
    kb_graph_free(out);
    kb_graph_free(t.g);
}

/* Without a rule to apply: dead nodes go, every input stays in its place, outputs keep order. */
static void test_prune_and_errors(void)
{
    tg t = new_graph();
    int32_t x = tg_input(&t, "x", KB_F32, "s0");
    tg_op(&t, KB_OP_EXP, KB_F32, "s0", x, -1, -1); /* dead */
    int32_t y = tg_input(&t, "unused", KB_F32, "s0");
    int32_t s = tg_op(&t, KB_OP_SIN, KB_F32, "s0", x, -1, -1);
    (void)y;
    tg_output(&t, s);
    tg_output(&t, x);
    kb_graph *out = NULL;
    if (t.st == KB_OK) CHECK_STATUS(ctx, kb_graph_simplify(t.g, &out), KB_OK);
    if (out) {
        CHECK(kb_graph_nnodes(out) == 3 && kb_graph_ninputs(out) == 2 && count_op(out, KB_OP_EXP) == 0);
        CHECK(strcmp(kb_graph_node(out, kb_graph_input(out, 1))->name, "unused") == 0);
        CHECK(kb_graph_node(out, kb_graph_output(out, 0))->op == KB_OP_SIN && kb_graph_output(out, 1) == kb_graph_input(out, 0));
        CHECK(kb_graph_nsymbols(out) == 2 && strcmp(kb_graph_symbol_name(out, 1), "s1") == 0);
    }
    kb_graph_free(out);
    out = (kb_graph *)&t;  /* reset on failure */
    CHECK(kb_graph_simplify(NULL, &out) == KB_ERR_INVALID && out == NULL);
    CHECK(kb_graph_simplify(t.g, NULL) == KB_ERR_INVALID);
    kb_graph_free(t.g);
}

/* Every allocation simplify makes, failed in turn: OOM, nothing returned, nothing leaked. */
static void test_oom(void)
{
    books bk = {0};
    kb_ctx *c2 = NULL, *saved = ctx;
    if (kb_ctx_new(failing_alloc, &bk, &c2) != KB_OK) return;
    ctx = c2;
    tg t = build(&SPECS[4]);
    ctx = saved;
    int ok = 0, fails = 0;
    for (long k = 1; t.st == KB_OK && k < 100000 && !ok; k++) {
        kb_graph *out = (kb_graph *)&bk;
        long blocks = bk.blocks;
        long long bytes = bk.bytes;
        bk.requests = 0;
        bk.fail_at = k;
        kb_status st = kb_graph_simplify(t.g, &out);
        bk.fail_at = 0;
        if (st == KB_OK) {
            ok = 1;
            CHECK(count_op(out, KB_OP_SUM) == 0);
            kb_graph_free(out);
        } else {
            fails++;
            CHECK_MSG(st == KB_ERR_OOM && out == NULL, "fail at %ld: %s", k, kb_status_name(st));
        }
        CHECK_MSG(bk.blocks == blocks && bk.bytes == bytes, "fail at %ld: %ld blocks leaked", k, bk.blocks - blocks);
    }
    CHECK(ok && fails > 5 && !bk.bad_size);
    kb_graph_free(t.g);
    kb_ctx_free(c2);
}

/* kb_graph_grad simplifies its result: the backward of logp[target] (log_softmax, then a gather
 * of one index per row) has no sum of the one-hot left, only the forward's max and sum(exp). */
static void test_grad(void)
{
    tg t = new_graph();
    int32_t x = tg_input(&t, "x", KB_F64, "s0,s1"), k = tg_input(&t, "k", KB_I64, "s0,1");
    kb_node rmax = tg_tmpl(KB_OP_RMAX, KB_F64, "s0,1");
    rmax.inputs[rmax.ninputs++] = x, rmax.axes = 2, rmax.nograd = 1;  /* the stability shift */
    int32_t m = tg_op(&t, KB_OP_EXPAND, KB_F64, "s0,s1", tg_add(&t, &rmax), -1, -1);
    int32_t c = tg_op(&t, KB_OP_SUB, KB_F64, "s0,s1", x, m, -1);
    int32_t l = tg_op(&t, KB_OP_LOG, KB_F64, "s0,1",
                      tg_reduce(&t, KB_OP_SUM, KB_F64, "s0,1", tg_op(&t, KB_OP_EXP, KB_F64, "s0,s1", c, -1, -1), 2), -1, -1);
    int32_t lp = tg_op(&t, KB_OP_SUB, KB_F64, "s0,s1", c, tg_op(&t, KB_OP_EXPAND, KB_F64, "s0,s1", l, -1, -1), -1);
    tg_output(&t, tg_op(&t, KB_OP_NEG, KB_F64, "s0,1", tg_gather(&t, KB_F64, "s0,1", lp, k, 1), -1, -1));
    uint8_t wrt[2] = {1, 0};
    kb_graph *gg = NULL;
    if (t.st == KB_OK) CHECK_STATUS(ctx, kb_graph_grad(t.g, wrt, &gg), KB_OK);
    if (gg) {
        int sums = 0;
        for (int32_t v = 0; v < kb_graph_nnodes(gg); v++) {
            const kb_node *nd = kb_graph_node(gg, v);
            if (nd->op != KB_OP_SUM) continue;
            sums++;
            CHECK_MSG(kb_graph_node(gg, nd->inputs[0])->op == KB_OP_EXP, "sum %d reads %s", (int)v,
                      kb_op_get(kb_graph_node(gg, nd->inputs[0])->op)->name);
        }
        CHECK(sums == 1 && count_op(gg, KB_OP_LT) == 1);
        /* dx = softmax * sum(g) - onehot * g with sum(g) = g where the target is in range */
        const int64_t sv[2] = {2, 3};
        double xs[6] = {0.5, -1, 2, 0, 0.25, 1}, gout[2] = {0.75, -2}, dx[6], p[6];
        int64_t ks[2] = {2, 3};  /* row 1's target is out of range: it picks nothing */
        CHECK_STATUS(ctx, kb_interp_graph(ctx, gg, sv, (const void *[]){xs, ks, gout}, (void *[]){dx}), KB_OK);
        for (int r = 0; r < 2; r++) {
            double mx = fmax(fmax(xs[3 * r], xs[3 * r + 1]), xs[3 * r + 2]), z = 0;
            for (int j = 0; j < 3; j++) z += exp(xs[3 * r + j] - mx);
            for (int j = 0; j < 3; j++) {
                p[3 * r + j] = exp(xs[3 * r + j] - mx) / z;
                double want = ks[r] < 3 ? -gout[r] * ((j == ks[r]) - p[3 * r + j]) : 0.0;
                CHECK_NEAR(dx[3 * r + j], want, 1e-12);
            }
        }
    }
    kb_graph_free(gg);
    kb_graph_free(t.g);
}

int main(void)
{
    if (kb_ctx_new(NULL, NULL, &ctx) != KB_OK) return 1;
    test_rule();
    test_dump();
    test_prune_and_errors();
    test_oom();
    test_grad();
    kb_ctx_free(ctx);
    return check_report();
}
