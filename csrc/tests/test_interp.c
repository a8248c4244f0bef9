/* test_interp.c — the CPU interpreter against hand-computed values: composite ops as capture
 * decomposes them (layernorm, softmax, rms norm), every index map, gather, casts to bf16/f16
 * (bit patterns), NaN through max, symbols bound at two values, and regions of a partition. */
#include <stdint.h>
#include <stdlib.h>

#include "tests/check.h"
#include "tests/tgraph.h"

static kb_ctx *ctx;

static tg new_graph(void)
{
    tg t = {NULL, KB_OK};
    t.st = kb_graph_new(ctx, &t.g);
    return t;
}

/* Runs a graph that must build and interpret cleanly. */
static void run_ok(tg *t, const int64_t *symvals, const void *const *ins, void *const *outs)
{
    CHECK_MSG(t->st == KB_OK, "build failed: %s", kb_ctx_error(ctx));
    if (t->st == KB_OK) CHECK_STATUS(ctx, kb_interp_graph(ctx, t->g, symvals, ins, outs), KB_OK);
}

static void test_layernorm(void)
{
    const double x[8] = {1, 2, 3, 4, -1, 0, 5, 2}, w[4] = {1, 0.5, 2, -1}, b[4] = {0, 1, 0, 0.5};
    const double eps = 1e-5;
    double want[8];
    for (int r = 0; r < 2; r++) {  /* the textbook formula, written out */
        double mean = 0, var = 0;
        for (int c = 0; c < 4; c++) mean += x[4 * r + c] / 4;
        for (int c = 0; c < 4; c++) var += (x[4 * r + c] - mean) * (x[4 * r + c] - mean) / 4;
        for (int c = 0; c < 4; c++) want[4 * r + c] = (x[4 * r + c] - mean) / sqrt(var + eps) * w[c] + b[c];
    }
    CHECK_NEAR(want[0], -1.5 / sqrt(1.25 + 1e-5), 1e-15);  /* row 0: mean 2.5, var 1.25 */

    /* f64 end to end: as exact as double allows */
    tg t = new_graph();
    int32_t xi = tg_input(&t, "x", KB_F64, "2,4"), wi = tg_input(&t, "w", KB_F64, "4"), bi = tg_input(&t, "b", KB_F64, "4");
    tg_output(&t, tg_layernorm(&t, KB_F64, "2", "4", xi, wi, bi, eps));
    double y[8];
    run_ok(&t, NULL, (const void *[]){x, w, b}, (void *[]){y});
    for (int i = 0; i < 8; i++) CHECK_NEAR(y[i], want[i], 1e-14);
    kb_graph_free(t.g);

    /* f32 in and out: loaded, computed in double, rounded once on store */
    float xf[8], wf[4], bf[4], yf[8];
    for (int i = 0; i < 8; i++) xf[i] = (float)x[i];
    for (int i = 0; i < 4; i++) wf[i] = (float)w[i], bf[i] = (float)b[i];
    t = new_graph();
    xi = tg_input(&t, "x", KB_F32, "2,4"), wi = tg_input(&t, "w", KB_F32, "4"), bi = tg_input(&t, "b", KB_F32, "4");
    tg_output(&t, tg_layernorm(&t, KB_F32, "2", "4", xi, wi, bi, eps));
    run_ok(&t, NULL, (const void *[]){xf, wf, bf}, (void *[]){yf});
    for (int i = 0; i < 8; i++) CHECK(yf[i] == (float)want[i]);
    kb_graph_free(t.g);
}

static void test_softmax(void)
{
    const double x[6] = {1, 2, 3, 1000, 1000, 1000};  /* row 1 overflows exp without the max */
    const double want[6] = {0.09003057317038045, 0.2447284710547976, 0.6652409557748218, 1.0 / 3, 1.0 / 3, 1.0 / 3};
    tg t = new_graph();
    int32_t xi = tg_input(&t, "x", KB_F64, "2,3");
    tg_output(&t, tg_softmax(&t, KB_F64, "2", "3", xi));
    double y[6];
    run_ok(&t, NULL, (const void *[]){x}, (void *[]){y});
    for (int i = 0; i < 6; i++) CHECK_NEAR(y[i], want[i], 1e-15);
    kb_graph_free(t.g);
}

static void test_rmsnorm(void)
{
    const double x[4] = {1, 2, 3, 4}, w[4] = {2, 2, 1, 1}, eps = 1e-6;
    tg t = new_graph();
    int32_t xi = tg_input(&t, "x", KB_F64, "1,4"), wi = tg_input(&t, "w", KB_F64, "4");
    int32_t ms = tg_reduce(&t, KB_OP_MEAN, KB_F64, "1,1", tg_op(&t, KB_OP_MUL, KB_F64, "1,4", xi, xi, -1), 2);
    int32_t rs = tg_op(&t, KB_OP_RSQRT, KB_F64, "1,1", tg_op(&t, KB_OP_ADD, KB_F64, "1,1", ms, tg_const(&t, KB_F64, "1,1", eps), -1), -1, -1);
    int32_t xn = tg_op(&t, KB_OP_MUL, KB_F64, "1,4", xi, tg_op(&t, KB_OP_EXPAND, KB_F64, "1,4", rs, -1, -1), -1);
    int32_t y = tg_op(&t, KB_OP_MUL, KB_F64, "1,4", xn, tg_op(&t, KB_OP_RESHAPE, KB_F64, "1,4", wi, -1, -1), -1);
    tg_output(&t, y);
    double out[4];
    run_ok(&t, NULL, (const void *[]){x, w}, (void *[]){out});
    for (int i = 0; i < 4; i++) CHECK_NEAR(out[i], x[i] * w[i] / sqrt(7.5 + eps), 1e-15);  /* mean(x^2) = 7.5 */
    kb_graph_free(t.g);
}

static void test_activations(void)
{
    const double x[4] = {-1, 0, 1, 3};
    static const struct { kb_op op; double want[4]; } cases[] = {
        {KB_OP_GELU, {-0.15865525393145702, 0.0, 0.841344746068543, 2.99595030590511}},
        {KB_OP_GELU_TANH, {-0.15880800939172324, 0.0, 0.8411919906082768, 2.996362607918227}},
        {KB_OP_SILU, {-0.2689414213699951, 0.0, 0.7310585786300049, 2.8577223804672998}},
        {KB_OP_MISH, {-0.30340146137410895, 0.0, 0.8650983882673103, 2.9865350049679575}},
        {KB_OP_RELU, {0, 0, 1, 3}},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        tg t = new_graph();
        tg_output(&t, tg_op(&t, cases[k].op, KB_F64, "4", tg_input(&t, "x", KB_F64, "4"), -1, -1));
        double y[4];
        run_ok(&t, NULL, (const void *[]){x}, (void *[]){y});
        for (int i = 0; i < 4; i++) CHECK_NEAR(y[i], cases[k].want[i], 1e-14);
        kb_graph_free(t.g);
    }
    /* attributes reach the INTERP column: leaky_relu's slope, softplus's beta and threshold */
    tg t = new_graph();
    int32_t xi = tg_input(&t, "x", KB_F64, "4");
    kb_node n = tg_tmpl(KB_OP_LEAKY_RELU, KB_F64, "4");
    n.ninputs = 1, n.inputs[0] = xi, n.scalar[0] = 0.1;
    tg_output(&t, tg_add(&t, &n));
    n = tg_tmpl(KB_OP_SOFTPLUS, KB_F64, "4");
    n.ninputs = 1, n.inputs[0] = xi, n.scalar[0] = 2.0, n.scalar[1] = 5.0;
    tg_output(&t, tg_add(&t, &n));
    /* where(x > 0, x, 7) and a bool output */
    int32_t gt = tg_op(&t, KB_OP_GT, KB_BOOL, "4", xi, tg_const(&t, KB_F64, "4", 0.0), -1);
    tg_output(&t, tg_op(&t, KB_OP_WHERE, KB_F64, "4", gt, xi, tg_const(&t, KB_F64, "4", 7.0)));
    tg_output(&t, gt);
    double lr[4], sp[4], wh[4];
    uint8_t bo[4];
    run_ok(&t, NULL, (const void *[]){x}, (void *[]){lr, sp, wh, bo});
    CHECK_NEAR(lr[0], -0.1, 1e-15);
    CHECK_NEAR(lr[3], 3, 1e-15);
    CHECK_NEAR(sp[0], log1p(exp(-2.0)) / 2, 1e-15);
    CHECK_NEAR(sp[2], log1p(exp(2.0)) / 2, 1e-15);
    CHECK_NEAR(sp[3], 3, 0);  /* beta*x = 6 > threshold 5: identity */
    CHECK(wh[0] == 7 && wh[1] == 7 && wh[2] == 1 && wh[3] == 3);
    CHECK(bo[0] == 0 && bo[1] == 0 && bo[2] == 1 && bo[3] == 1);
    kb_graph_free(t.g);
}

static void test_reduce_middle(void)
{
    double x[48], s[4], m[4], mx[4], sk[4];
    for (int i = 0; i < 48; i++) x[i] = i % 7 - 3.0 + i * 0.25;
    tg t = new_graph();
    int32_t xi = tg_input(&t, "x", KB_F64, "2,3,4,2");
    tg_output(&t, tg_reduce(&t, KB_OP_SUM, KB_F64, "2,2", xi, 6));       /* axes 1 and 2 */
    tg_output(&t, tg_reduce(&t, KB_OP_MEAN, KB_F64, "2,2", xi, 6));
    tg_output(&t, tg_reduce(&t, KB_OP_RMAX, KB_F64, "2,2", xi, 6));
    tg_output(&t, tg_reduce(&t, KB_OP_SUM, KB_F64, "2,1,1,2", xi, 6));   /* keepdim */
    run_ok(&t, NULL, (const void *[]){x}, (void *[]){s, m, mx, sk});
    for (int a = 0; a < 2; a++)
        for (int d = 0; d < 2; d++) {
            double ws = 0, wm = -INFINITY;
            for (int b = 0; b < 3; b++)
                for (int c = 0; c < 4; c++) {
                    double v = x[((a * 3 + b) * 4 + c) * 2 + d];
                    ws += v;
                    wm = v > wm ? v : wm;
                }
            CHECK_NEAR(s[a * 2 + d], ws, 1e-14);
            CHECK_NEAR(m[a * 2 + d], ws / 12, 1e-14);
            CHECK(mx[a * 2 + d] == wm);
            CHECK_NEAR(sk[a * 2 + d], ws, 1e-14);
        }
    kb_graph_free(t.g);
}

static void test_views(void)
{
    double x[6] = {0, 1, 2, 3, 4, 5}, e[24], q[24], x3[24];
    tg t = new_graph();
    int32_t xi = tg_input(&t, "x", KB_F64, "2,3");
    int32_t p = tg_permute(&t, KB_F64, "3,2", xi, (const int8_t[]){1, 0});
    int32_t r = tg_op(&t, KB_OP_RESHAPE, KB_F64, "3,1,2", p, -1, -1);
    tg_output(&t, tg_op(&t, KB_OP_EXPAND, KB_F64, "3,4,2", r, -1, -1));
    /* a rank-3 permute: out[i][j][k] = y[j][k][i] with y = [2,3,4] */
    int32_t y = tg_input(&t, "y", KB_F64, "2,3,4");
    tg_output(&t, tg_permute(&t, KB_F64, "4,2,3", y, (const int8_t[]){2, 0, 1}));
    for (int i = 0; i < 24; i++) x3[i] = i;
    run_ok(&t, NULL, (const void *[]){x, x3}, (void *[]){e, q});
    for (int i = 0; i < 3; i++)
        for (int k = 0; k < 4; k++)
            for (int j = 0; j < 2; j++) CHECK(e[(i * 4 + k) * 2 + j] == x[j * 3 + i]);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 2; j++)
            for (int k = 0; k < 3; k++) CHECK(q[(i * 2 + j) * 3 + k] == x3[(j * 3 + k) * 4 + i]);
    kb_graph_free(t.g);
}

static void test_slice(void)
{
    double x[30], y[9], z[20];
    for (int r = 0; r < 3; r++)
        for (int c = 0; c < 10; c++) x[r * 10 + c] = 10 * r + c;
    tg t = new_graph();
    int32_t xi = tg_input(&t, "x", KB_F64, "3,10");
    tg_output(&t, tg_slice(&t, KB_F64, "3,3", xi, 1, 1, 3));
    tg_output(&t, tg_slice(&t, KB_F64, "2,10", xi, 0, 1, 1));
    run_ok(&t, NULL, (const void *[]){x}, (void *[]){y, z});
    const double want[9] = {1, 4, 7, 11, 14, 17, 21, 24, 27};
    for (int i = 0; i < 9; i++) CHECK(y[i] == want[i]);
    for (int i = 0; i < 20; i++) CHECK(z[i] == x[10 + i]);
    kb_graph_free(t.g);

    /* a symbolic operand: the builder cannot see the overrun, the interpreter must */
    int32_t sym;
    t = new_graph();
    CHECK_STATUS(ctx, kb_graph_add_symbol(t.g, "s0", 8, &sym), KB_OK);
    xi = tg_input(&t, "x", KB_F64, "s0");
    tg_output(&t, tg_slice(&t, KB_F64, "3", xi, 0, 2, 2));  /* reads 2, 4, 6 */
    double xs[8] = {0, 1, 2, 3, 4, 5, 6, 7}, ys[3];
    run_ok(&t, (const int64_t[]){8}, (const void *[]){xs}, (void *[]){ys});
    CHECK(ys[0] == 2 && ys[1] == 4 && ys[2] == 6);
    CHECK_STATUS(ctx, kb_interp_graph(ctx, t.g, (const int64_t[]){6}, (const void *[]){xs}, (void *[]){ys}),
                 KB_ERR_INVALID);
    CHECK(strstr(kb_ctx_error(ctx), "overrun") != NULL);
    kb_graph_free(t.g);

    /* one element with a step of 2^62 (found by the fuzz target): the stride along the axis,
     * never taken, was computed anyway and overflowed (UBSan) */
    t = new_graph();
    xi = tg_input(&t, "x", KB_F64, "3,10");
    tg_output(&t, tg_slice(&t, KB_F64, "1,10", xi, 0, 1, (int64_t)1 << 62));   /* row 1 */
    run_ok(&t, NULL, (const void *[]){x}, (void *[]){z});
    for (int i = 0; i < 10; i++) CHECK(z[i] == x[10 + i]);
    kb_graph_free(t.g);
}

static void test_gather(void)
{
    const double x[6] = {10, 11, 12, 20, 21, 22};
    int64_t idx1[4] = {2, 0, 1, 1};
    const int32_t idx0[3] = {1, 0, 1};
    double y1[4], y0[3];
    tg t = new_graph();
    int32_t xi = tg_input(&t, "x", KB_F64, "2,3");
    int32_t i1 = tg_input(&t, "i1", KB_I64, "2,2"), i0 = tg_input(&t, "i0", KB_I32, "1,3");
    tg_output(&t, tg_gather(&t, KB_F64, "2,2", xi, i1, 1));
    tg_output(&t, tg_gather(&t, KB_F64, "1,3", xi, i0, 0));
    run_ok(&t, NULL, (const void *[]){x, idx1, idx0}, (void *[]){y1, y0});
    CHECK(y1[0] == 12 && y1[1] == 10 && y1[2] == 21 && y1[3] == 21);
    CHECK(y0[0] == 20 && y0[1] == 11 && y0[2] == 22);
    const int64_t bad[2] = {3, -1};
    for (int k = 0; k < 2; k++) {
        idx1[3] = bad[k];
        CHECK_STATUS(ctx, kb_interp_graph(ctx, t.g, NULL, (const void *[]){x, idx1, idx0}, (void *[]){y1, y0}),
                     KB_ERR_INVALID);
        CHECK_MSG(strstr(kb_ctx_error(ctx), "out of range") != NULL, "%s", kb_ctx_error(ctx));
    }
    kb_graph_free(t.g);
}

static void test_casts(void)
{
    /* f32 values with known bf16 and f16 encodings (torch's .to(), round to nearest even) */
    const float x[] = {1.0f / 3, 1 + 0x1p-8f, 1 + 3 * 0x1p-8f, 65504, 65520, 3e-8f, 1e-8f, -INFINITY, -0.0f, 1e-40f,
                       70000, 1.5f * 0x1p-24f, 1 + 0x1p-11f, 1 + 3 * 0x1p-11f, NAN};
    const uint16_t want_bf[] = {0x3eab, 0x3f80, 0x3f82, 0x4780, 0x4780, 0x3301, 0x322c, 0xff80, 0x8000, 0x0001,
                                0x4789, 0x33c0, 0x3f80, 0x3f80, 0x7fc0};
    const uint16_t want_h[] = {0x3555, 0x3c04, 0x3c0c, 0x7bff, 0x7c00, 0x0001, 0x0000, 0xfc00, 0x8000, 0x0000,
                               0x7c00, 0x0002, 0x3c00, 0x3c02, 0x7e00};
    enum { N = sizeof x / sizeof x[0] };
    uint16_t bf[N], h[N], bf_direct[N];
    double back[N];
    tg t = new_graph();
    int32_t xi = tg_input(&t, "x", KB_F32, "15");
    int32_t cb = tg_op(&t, KB_OP_CAST, KB_BF16, "15", xi, -1, -1);
    tg_output(&t, cb);
    tg_output(&t, tg_op(&t, KB_OP_CAST, KB_F16, "15", xi, -1, -1));
    tg_output(&t, tg_op(&t, KB_OP_CAST, KB_F64, "15", cb, -1, -1));  /* the CAST itself rounds */
    tg_output(&t, tg_op(&t, KB_OP_NEG, KB_BF16, "15", tg_op(&t, KB_OP_NEG, KB_BF16, "15", xi, -1, -1), -1, -1));
    run_ok(&t, NULL, (const void *[]){x}, (void *[]){bf, h, back, bf_direct});
    for (int i = 0; i < N; i++) {
        CHECK_MSG(bf[i] == want_bf[i], "bf16 of %g: 0x%04x, want 0x%04x", (double)x[i], bf[i], want_bf[i]);
        CHECK_MSG(h[i] == want_h[i], "f16 of %g: 0x%04x, want 0x%04x", (double)x[i], h[i], want_h[i]);
        CHECK_MSG(bf_direct[i] == want_bf[i], "stored bf16 of %g: 0x%04x", (double)x[i], bf_direct[i]);
    }
    CHECK(back[0] == 0.333984375 && back[1] == 1.0 && back[2] == 1.015625 && isnan(back[N - 1]));
    kb_graph_free(t.g);

    /* no rounding between nodes of a bf16 graph: (x + 2^-9 - x) * 512 is 1, not 0 */
    t = new_graph();
    xi = tg_input(&t, "x", KB_BF16, "1");
    int32_t sum = tg_op(&t, KB_OP_ADD, KB_BF16, "1", xi, tg_const(&t, KB_BF16, "1", 0x1p-9), -1);
    tg_output(&t, sum);
    tg_output(&t, tg_op(&t, KB_OP_MUL, KB_F32, "1", tg_op(&t, KB_OP_SUB, KB_BF16, "1", sum, xi, -1),
                        tg_const(&t, KB_F32, "1", 512), -1));
    const uint16_t one = 0x3f80;
    uint16_t s;
    float d;
    run_ok(&t, NULL, (const void *[]){&one}, (void *[]){&s, &d});
    CHECK(s == 0x3f80);  /* 1 + 2^-9 rounds to 1 on store */
    CHECK(d == 1.0f);
    kb_graph_free(t.g);

    /* to integers: truncation toward zero; NaN and overflow give the minimum (as torch on x86) */
    const double xd[5] = {-2.7, 2.7, -0.5, 1e10, NAN};
    int64_t l[5];
    int32_t w[5];
    uint8_t bo[5];
    t = new_graph();
    xi = tg_input(&t, "x", KB_F64, "5");
    tg_output(&t, tg_op(&t, KB_OP_CAST, KB_I64, "5", xi, -1, -1));
    tg_output(&t, tg_op(&t, KB_OP_CAST, KB_I32, "5", xi, -1, -1));
    tg_output(&t, tg_op(&t, KB_OP_CAST, KB_BOOL, "5", xi, -1, -1));
    run_ok(&t, NULL, (const void *[]){xd}, (void *[]){l, w, bo});
    CHECK(l[0] == -2 && l[1] == 2 && l[2] == 0 && l[3] == 10000000000LL && l[4] == INT64_MIN);
    CHECK(w[0] == -2 && w[1] == 2 && w[2] == 0 && w[3] == INT32_MIN && w[4] == INT32_MIN);
    CHECK(bo[0] == 1 && bo[1] == 1 && bo[2] == 1 && bo[3] == 1 && bo[4] == 1);
    kb_graph_free(t.g);
}

static void test_nan_max(void)
{
    const double x[9] = {1, NAN, 3, -INFINITY, 2, 5, NAN, 1, 2};
    double mx[3], mn[3], bm[9];
    tg t = new_graph();
    int32_t xi = tg_input(&t, "x", KB_F64, "3,3");
    tg_output(&t, tg_reduce(&t, KB_OP_RMAX, KB_F64, "3", xi, 2));
    tg_output(&t, tg_reduce(&t, KB_OP_RMIN, KB_F64, "3", xi, 2));
    tg_output(&t, tg_op(&t, KB_OP_MAX, KB_F64, "3,3", xi, tg_const(&t, KB_F64, "3,3", 0), -1));
    run_ok(&t, NULL, (const void *[]){x}, (void *[]){mx, mn, bm});
    CHECK(isnan(mx[0]) && mx[1] == 5 && isnan(mx[2]));
    CHECK(isnan(mn[0]) && mn[1] == -INFINITY && isnan(mn[2]));
    CHECK(bm[0] == 1 && isnan(bm[1]) && bm[3] == 0 && isnan(bm[6]));
    kb_graph_free(t.g);
}

static void test_symbols(void)
{
    tg t = new_graph();
    int32_t s0;
    CHECK_STATUS(ctx, kb_graph_add_symbol(t.g, "s0", 4, &s0), KB_OK);
    int32_t xi = tg_input(&t, "x", KB_F64, "s0,3");
    int32_t sum = tg_reduce(&t, KB_OP_SUM, KB_F64, "3", xi, 1);
    tg_output(&t, sum);
    tg_output(&t, tg_op(&t, KB_OP_RESHAPE, KB_F64, "3*s0", xi, -1, -1));
    tg_output(&t, tg_reduce(&t, KB_OP_MEAN, KB_F64, "1,1", xi, 3));
    double x[15], y[3], flat[15], mean;
    for (int i = 0; i < 15; i++) x[i] = i;
    for (int64_t n = 2; n <= 5; n += 3) {
        run_ok(&t, &n, (const void *[]){x}, (void *[]){y, flat, &mean});
        for (int c = 0; c < 3; c++) {
            double want = 0;
            for (int r = 0; r < n; r++) want += x[r * 3 + c];
            CHECK_NEAR(y[c], want, 0);
        }
        for (int i = 0; i < 3 * n; i++) CHECK(flat[i] == x[i]);
        CHECK_NEAR(mean, (3 * n - 1) / 2.0, 1e-15);
    }
    /* a graph with symbols needs their values */
    CHECK_STATUS(ctx, kb_interp_graph(ctx, t.g, NULL, (const void *[]){x}, (void *[]){y, flat, &mean}), KB_ERR_INVALID);
    kb_graph_free(t.g);
}

/* Regions of a hand-made partition (fuse.c is tested on its own): one region for all of a
 * layernorm, then the same split in two, then malformed regions. */
static void test_regions(void)
{
    const double x[8] = {1, 2, 3, 4, -1, 0, 5, 2}, w[4] = {1, 0.5, 2, -1}, b[4] = {0, 1, 0, 0.5};
    tg t = new_graph();
    int32_t xi = tg_input(&t, "x", KB_F64, "2,4"), wi = tg_input(&t, "w", KB_F64, "4"), bi = tg_input(&t, "b", KB_F64, "4");
    int32_t y = tg_layernorm(&t, KB_F64, "2", "4", xi, wi, bi, 1e-5);
    tg_output(&t, y);
    double want[8], got[8];
    run_ok(&t, NULL, (const void *[]){x, w, b}, (void *[]){want});
    int32_t nodes[32], n = 0, ins[3] = {xi, wi, bi}, outs[1] = {y};
    for (int32_t v = 0; v < kb_graph_nnodes(t.g); v++)
        if (kb_graph_node(t.g, v)->op != KB_OP_INPUT) nodes[n++] = v;
    int32_t region_of[32];
    kb_region reg = {KB_REGION_ROW, n, nodes, 3, ins, 1, outs, y, 2, 0, 0, {0, {0, 0}, {KB_GEMM_ROW, KB_GEMM_ROW}, {0, 0}, {0, 0}, 0, NULL}};
    kb_partition p = {t.g, 1, &reg, region_of, 0};
    CHECK_STATUS(ctx, kb_interp_region(ctx, &p, 0, NULL, (const void *[]){x, w, b}, (void *[]){got}), KB_OK);
    for (int i = 0; i < 8; i++) CHECK(got[i] == want[i]);

    /* split after the centred x (node xc = the SUB): region A outputs it in f64, B reads it */
    int32_t xc = -1;
    for (int32_t v = 0; v < kb_graph_nnodes(t.g) && xc < 0; v++)
        if (kb_graph_node(t.g, v)->op == KB_OP_SUB) xc = v;
    int32_t na = 0;
    while (nodes[na] != xc) na++;
    na++;
    int32_t ins_b[3] = {xc, wi, bi}, outs_a[1] = {xc};
    kb_region two[2] = {{KB_REGION_ROW, na, nodes, 1, ins, 1, outs_a, xc, 2, 0, 0, {0, {0, 0}, {KB_GEMM_ROW, KB_GEMM_ROW}, {0, 0}, {0, 0}, 0, NULL}},
                        {KB_REGION_ROW, n - na, nodes + na, 3, ins_b, 1, outs, y, 2, 0, 0, {0, {0, 0}, {KB_GEMM_ROW, KB_GEMM_ROW}, {0, 0}, {0, 0}, 0, NULL}}};
    kb_partition p2 = {t.g, 2, two, region_of, 0};
    double mid[8];
    CHECK_STATUS(ctx, kb_interp_region(ctx, &p2, 0, NULL, (const void *[]){x}, (void *[]){mid}), KB_OK);
    CHECK_STATUS(ctx, kb_interp_region(ctx, &p2, 1, NULL, (const void *[]){mid, w, b}, (void *[]){got}), KB_OK);
    for (int i = 0; i < 8; i++) CHECK(got[i] == want[i]);

    /* region B without its input xc: a node reads a value from nowhere */
    two[1].ninputs = 2;
    two[1].inputs = ins_b + 1;
    CHECK_STATUS(ctx, kb_interp_region(ctx, &p2, 1, NULL, (const void *[]){w, b}, (void *[]){got}), KB_ERR_INVALID);
    CHECK(strstr(kb_ctx_error(ctx), "neither in the region") != NULL);
    /* a region input may be returned as is */
    two[1].inputs = ins_b, two[1].ninputs = 3, two[1].outputs = ins + 1;
    CHECK_STATUS(ctx, kb_interp_region(ctx, &p2, 1, NULL, (const void *[]){mid, w, b}, (void *[]){got}), KB_OK);
    CHECK(memcmp(got, w, sizeof w) == 0);
    /* an output the region does not compute (y belongs to region B) */
    two[0].outputs = outs;
    CHECK_STATUS(ctx, kb_interp_region(ctx, &p2, 0, NULL, (const void *[]){x}, (void *[]){got}), KB_ERR_INVALID);
    /* a graph input inside the region but not among its inputs */
    int32_t with_input[33] = {xi};
    memcpy(with_input + 1, nodes, sizeof(int32_t) * (size_t)na);
    two[0].outputs = outs_a, two[0].nodes = with_input, two[0].nnodes = na + 1, two[0].ninputs = 0;
    CHECK_STATUS(ctx, kb_interp_region(ctx, &p2, 0, NULL, NULL, (void *[]){mid}), KB_ERR_INVALID);
    CHECK(strstr(kb_ctx_error(ctx), "without listing it") != NULL);
    /* ... which is fine once it is listed: the caller supplies it */
    two[0].ninputs = 1;
    CHECK_STATUS(ctx, kb_interp_region(ctx, &p2, 0, NULL, (const void *[]){x}, (void *[]){got}), KB_OK);
    CHECK(memcmp(got, mid, sizeof mid) == 0);
    /* EXTERN regions and bad indices */
    two[0].kind = KB_REGION_EXTERN;
    CHECK_STATUS(ctx, kb_interp_region(ctx, &p2, 0, NULL, (const void *[]){x}, (void *[]){mid}), KB_ERR_INVALID);
    CHECK(strstr(kb_ctx_error(ctx), "EXTERN") != NULL);
    CHECK_STATUS(ctx, kb_interp_region(ctx, &p2, 2, NULL, (const void *[]){x}, (void *[]){mid}), KB_ERR_INVALID);
    kb_graph_free(t.g);
}

static void test_extern_graph(void)
{
    tg t = new_graph();
    int32_t xi = tg_input(&t, "x", KB_F32, "2,2");
    kb_node n = tg_tmpl(KB_OP_EXTERN, KB_F32, "2,2");
    n.ninputs = 2, n.inputs[0] = xi, n.inputs[1] = xi;
    tg_output(&t, tg_add(&t, &n));
    float x[4] = {0}, y[4];
    CHECK(t.st == KB_OK);
    CHECK_STATUS(ctx, kb_interp_graph(ctx, t.g, NULL, (const void *[]){x}, (void *[]){y}), KB_ERR_INVALID);
    CHECK(strstr(kb_ctx_error(ctx), "EXTERN") != NULL);
    kb_graph_free(t.g);
}

/* Sizes bound at run time are checked: products that overflow int64, negative sizes, and
 * buffers no allocator can give end in an error, never in a short allocation. */
static void test_huge_sizes(void)
{
    tg t = new_graph();
    int32_t s0;
    CHECK_STATUS(ctx, kb_graph_add_symbol(t.g, "s0", 4, &s0), KB_OK);
    tg_output(&t, tg_op(&t, KB_OP_NEG, KB_F32, "s0,s0", tg_const(&t, KB_F32, "s0,s0", 1.0), -1, -1));
    float out[16];
    run_ok(&t, (const int64_t[]){4}, NULL, (void *[]){out});
    CHECK(out[0] == -1.0f && out[15] == -1.0f);
    CHECK_STATUS(ctx, kb_interp_graph(ctx, t.g, (const int64_t[]){INT64_C(1) << 32}, NULL, (void *[]){out}),
                 KB_ERR_INVALID);
    CHECK(strstr(kb_ctx_error(ctx), "2^63") != NULL);
    CHECK_STATUS(ctx, kb_interp_graph(ctx, t.g, (const int64_t[]){-3}, NULL, (void *[]){out}), KB_ERR_INVALID);
    CHECK(strstr(kb_ctx_error(ctx), "negative size") != NULL);
    /* 2^60 doubles: the size fits size_t's arithmetic only barely, the allocator says no */
    CHECK_STATUS(ctx, kb_interp_graph(ctx, t.g, (const int64_t[]){INT64_C(1) << 30}, NULL, (void *[]){out}),
                 KB_ERR_OOM);
    /* 2^62 elements: more bytes than size_t holds, refused before asking */
    CHECK_STATUS(ctx, kb_interp_graph(ctx, t.g, (const int64_t[]){INT64_C(1) << 31}, NULL, (void *[]){out}),
                 KB_ERR_OOM);
    CHECK(strstr(kb_ctx_error(ctx), "does not fit") != NULL);
    kb_graph_free(t.g);
}

int main(void)
{
    if (kb_ctx_new(NULL, NULL, &ctx) != KB_OK) return 2;
    test_layernorm();
    test_softmax();
    test_rmsnorm();
    test_activations();
    test_reduce_middle();
    test_views();
    test_slice();
    test_gather();
    test_casts();
    test_nan_max();
    test_symbols();
    test_regions();
    test_extern_graph();
    test_huge_sizes();
    kb_ctx_free(ctx);
    return check_report();
}
