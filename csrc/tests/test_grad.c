/* test_grad.c — reverse-mode autodiff (kb_graph_grad) checked against central finite differences
 * of the forward, both run by the interpreter in double: every pointwise op with a rule, every
 * reduction and index map, composites (layernorm, softmax, log_softmax, rms norm, activation
 * chains), second order, symbols at two values; errors, OOM at every allocation, kb_region_graph.
 * One binary past 800 lines: its cases share the finite-difference harness, and split they
 * would each build it again. */
#include <stdint.h>
#include <stdlib.h>

#include "tests/check.h"
#include "tests/tgraph.h"

static kb_ctx *ctx;

/* ---------------------------------------------------------------- a failing allocator */

static long alloc_count, alloc_fail_at = -1;
static long long alloc_bytes;

static void *test_alloc(void *ud, void *ptr, size_t osize, size_t nsize)
{
    (void)ud;
    if (nsize == 0) {
        alloc_bytes -= (long long)osize;
        free(ptr);
        return NULL;
    }
    if (alloc_count++ == alloc_fail_at) return NULL;
    void *p = realloc(ptr, nsize);
    if (p) alloc_bytes += (long long)nsize - (long long)(ptr ? osize : 0);
    return p;
}

/* ---------------------------------------------------------------- inputs and the finite-difference check */

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static double urand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}

/* Where inputs are drawn: float elements in [lo, hi], at least 0.05 from each kink (so the
 * finite differences never straddle one), or, with distinct, spread over the range at least
 * (hi-lo)/(2N) apart (max, min, where and comparisons then see no near-ties). */
typedef struct domain {
    double lo, hi;
    int distinct;
    int nkinks;
    double kinks[4];
} domain;

static const domain DEF = {-2, 2, 0, 0, {0}};

#define MAXIO 24

typedef struct io {
    int n;
    void *p[MAXIO];
    int64_t numel[MAXIO];
} io;

static void io_free(io *b)
{
    for (int i = 0; i < b->n; i++) free(b->p[i]);
    b->n = 0;
}

static void *alloc_value(const kb_graph *g, int32_t v, const int64_t *sv, int64_t *numel)
{
    int64_t sz[KB_MAX_RANK];
    *numel = kb_value_sizes(g, v, sv, sz);
    return calloc((size_t)(*numel > 0 ? *numel : 1), kb_dtype_size(kb_graph_node(g, v)->dtype));
}

static void fill_inputs(const kb_graph *g, const int64_t *sv, const domain *dom, io *in)
{
    int64_t total = 0;
    in->n = kb_graph_ninputs(g);
    for (int i = 0; i < in->n; i++) {
        int32_t v = kb_graph_input(g, i);
        in->p[i] = alloc_value(g, v, sv, &in->numel[i]);
        if (kb_graph_node(g, v)->dtype == KB_F64) total += in->numel[i];
    }
    /* distinct: a random permutation of a jittered grid over all f64 elements */
    int64_t *perm = malloc(sizeof(int64_t) * (size_t)(total > 0 ? total : 1)), k = 0;
    for (int64_t j = 0; j < total; j++) perm[j] = j;
    for (int64_t j = total - 1; j > 0; j--) {
        int64_t r = (int64_t)(urand() * (double)(j + 1)), t = perm[j];
        perm[j] = perm[r], perm[r] = t;
    }
    for (int i = 0; i < in->n; i++) {
        const kb_node *nd = kb_graph_node(g, kb_graph_input(g, i));
        for (int64_t j = 0; j < in->numel[i]; j++) {
            if (nd->dtype == KB_BOOL) {
                ((uint8_t *)in->p[i])[j] = urand() < 0.5;
            } else if (nd->dtype == KB_I64) {
                ((int64_t *)in->p[i])[j] = (int64_t)(urand() * 3);
            } else if (nd->dtype == KB_F64 || nd->dtype == KB_F32) {
                double x;
                if (dom->distinct && nd->dtype == KB_F64) {
                    x = dom->lo + (dom->hi - dom->lo) * ((double)perm[k++] + 0.25 + 0.5 * urand()) / (double)total;
                } else {
                    int far;
                    do {
                        x = dom->lo + (dom->hi - dom->lo) * urand();
                        far = 1;
                        for (int q = 0; q < dom->nkinks; q++) far &= fabs(x - dom->kinks[q]) > 0.05;
                    } while (!far);
                }
                if (nd->dtype == KB_F64) ((double *)in->p[i])[j] = x;
                else ((float *)in->p[i])[j] = (float)x;
            }
        }
    }
    free(perm);
}

/* L = sum_k <gout_k, out_k> over the f64 outputs: the scalar whose gradient the VJP is. */
static double loss(const kb_graph *g, const int64_t *sv, const io *in, const io *gout)
{
    io out = {0};
    double L = 0;
    out.n = kb_graph_noutputs(g);
    for (int k = 0; k < out.n; k++) out.p[k] = alloc_value(g, kb_graph_output(g, k), sv, &out.numel[k]);
    kb_status st = kb_interp_graph(ctx, g, sv, (const void *const *)in->p, out.p);
    CHECK_STATUS(ctx, st, KB_OK);
    for (int k = 0; k < out.n; k++)
        if (kb_graph_node(g, kb_graph_output(g, k))->dtype == KB_F64)
            for (int64_t j = 0; j < out.numel[k]; j++)
                L += ((double *)gout->p[k])[j] * ((double *)out.p[k])[j];
    io_free(&out);
    return st == KB_OK ? L : NAN;
}

/* d L / d x[j] by central differences with one Richardson step (error O(h^4)). */
static double fd(const kb_graph *g, const int64_t *sv, io *in, int i, int64_t j, const io *gout)
{
    double *x = in->p[i], x0 = x[j], d[2];
    for (int r = 0; r < 2; r++) {
        double h = (r ? 5e-4 : 1e-3) * (fabs(x0) > 1 ? fabs(x0) : 1);
        x[j] = x0 + h;
        double up = loss(g, sv, in, gout);
        x[j] = x0 - h;
        double dn = loss(g, sv, in, gout);
        d[r] = (up - dn) / (2 * h);
    }
    x[j] = x0;
    return (4 * d[1] - d[0]) / 3;
}

static int graph_has_op(const kb_graph *g, kb_op op)
{
    for (int32_t v = 0; v < kb_graph_nnodes(g); v++)
        if (kb_graph_node(g, v)->op == op) return 1;
    return 0;
}

/* The backward's interface as kbench.h specifies it. */
static void check_interface(const char *name, const kb_graph *g, const uint8_t *wrt, const kb_graph *gg)
{
    int32_t ni = kb_graph_ninputs(g), no = kb_graph_noutputs(g), nw = 0;
    CHECK_MSG(kb_graph_ninputs(gg) == ni + no, "%s: %d inputs", name, kb_graph_ninputs(gg));
    for (int32_t i = 0; i < ni + no && i < kb_graph_ninputs(gg); i++) {
        const kb_node *a = kb_graph_node(gg, kb_graph_input(gg, i));
        const kb_node *b = kb_graph_node(g, i < ni ? kb_graph_input(g, i) : kb_graph_output(g, i - ni));
        char want[48];
        if (i < ni) snprintf(want, sizeof want, "%s", b->name);
        else snprintf(want, sizeof want, "grad_out%d", (int)(i - ni));
        CHECK_MSG(a->dtype == b->dtype && a->rank == b->rank && strcmp(a->name, want) == 0 &&
                      a->input_kind == (i < ni ? b->input_kind : KB_INPUT_USER),
                  "%s: input %d is %s", name, (int)i, a->name);
    }
    for (int32_t i = 0; i < ni; i++) {
        if (!wrt[i]) continue;
        const kb_node *in = kb_graph_node(g, kb_graph_input(g, i));
        const kb_node *o = kb_graph_node(gg, kb_graph_output(gg, nw++));
        int same = o->dtype == in->dtype && o->rank == in->rank;
        for (int d = 0; same && d < in->rank; d++) same = kb_dim_equal(o->dims[d], in->dims[d]);
        CHECK_MSG(same, "%s: gradient %d has the wrong type", name, (int)nw - 1);
    }
    CHECK_MSG(kb_graph_noutputs(gg) == nw, "%s: %d outputs, want %d", name, kb_graph_noutputs(gg), nw);
}

static const int64_t SYMSETS[2][2] = {{3, 2}, {1, 4}};

/* Differentiates g (wrt: every f64 input when NULL) and compares the VJP with finite
 * differences at two symbol bindings: max |fd - grad| <= 1e-6 * max |grad| per input. */
static void check_grad(const char *name, const kb_graph *g, const uint8_t *wrt_in, const domain *dom)
{
    uint8_t wrt[MAXIO] = {0};
    int32_t ni = kb_graph_ninputs(g), no = kb_graph_noutputs(g);
    for (int32_t i = 0; i < ni; i++)
        wrt[i] = wrt_in ? wrt_in[i] : kb_graph_node(g, kb_graph_input(g, i))->dtype == KB_F64;
    kb_graph *gg = NULL;
    kb_status st = kb_graph_grad(g, wrt, &gg);
    CHECK_MSG(st == KB_OK, "%s: grad failed: %s", name, kb_ctx_error(ctx));
    if (st != KB_OK) return;
    check_interface(name, g, wrt, gg);
    for (int s = 0; s < 2; s++) {
        const int64_t *sv = SYMSETS[s];
        io in = {0}, gout = {0}, grads = {0}, bin = {0};
        fill_inputs(g, sv, dom, &in);
        gout.n = no;
        for (int k = 0; k < no; k++) {
            int32_t o = kb_graph_output(g, k);
            gout.p[k] = alloc_value(g, o, sv, &gout.numel[k]);
            if (kb_graph_node(g, o)->dtype == KB_F64)
                for (int64_t j = 0; j < gout.numel[k]; j++) ((double *)gout.p[k])[j] = 2 * urand() - 1;
        }
        bin.n = ni + no;  /* borrowed pointers: the backward's inputs */
        for (int i = 0; i < ni; i++) bin.p[i] = in.p[i];
        for (int k = 0; k < no; k++) bin.p[ni + k] = gout.p[k];
        grads.n = kb_graph_noutputs(gg);
        for (int k = 0; k < grads.n; k++) grads.p[k] = alloc_value(gg, kb_graph_output(gg, k), sv, &grads.numel[k]);
        st = kb_interp_graph(ctx, gg, sv, (const void *const *)bin.p, grads.p);
        CHECK_MSG(st == KB_OK, "%s: backward failed: %s", name, kb_ctx_error(ctx));
        for (int i = 0, k = 0; st == KB_OK && i < ni; i++) {
            if (!wrt[i]) continue;
            const double *an = grads.p[k++];
            double maxan = 0, maxerr = 0;
            int64_t worst = 0;
            for (int64_t j = 0; j < in.numel[i]; j++) {
                double f = fd(g, sv, &in, i, j, &gout), e = fabs(f - an[j]);
                if (fabs(an[j]) > maxan) maxan = fabs(an[j]);
                if (!(e <= maxerr)) maxerr = e, worst = j;
            }
            CHECK_MSG(maxerr <= 1e-6 * (maxan > 1e-12 ? maxan : 1e-12),
                      "%s (s0=%lld s1=%lld): input %d: max error %.3g (element %lld) against max |grad| %.3g",
                      name, (long long)sv[0], (long long)sv[1], i, maxerr, (long long)worst, maxan);
        }
        io_free(&in);
        io_free(&gout);
        io_free(&grads);
    }
    kb_graph_free(gg);
}

/* The grad of the grad: the backward is itself a graph, so it has a VJP too. */
static void check_grad2(const char *name, const kb_graph *g, const domain *dom)
{
    uint8_t wrt[MAXIO] = {0};
    for (int32_t i = 0; i < kb_graph_ninputs(g); i++) wrt[i] = kb_graph_node(g, kb_graph_input(g, i))->dtype == KB_F64;
    kb_graph *gg = NULL;
    CHECK_STATUS(ctx, kb_graph_grad(g, wrt, &gg), KB_OK);
    if (gg) check_grad(name, gg, NULL, dom);
    kb_graph_free(gg);
}

static tg new_graph(int nsyms)
{
    tg t = {NULL, KB_OK};
    t.st = kb_graph_new(ctx, &t.g);
    static const char *const names[] = {"s0", "s1"};
    for (int s = 0; s < nsyms && t.st == KB_OK; s++) {
        int32_t id;
        t.st = kb_graph_add_symbol(t.g, names[s], 3 - s, &id);
    }
    return t;
}

static int built(const char *name, tg *t)
{
    CHECK_MSG(t->st == KB_OK, "%s: build failed: %s", name, kb_ctx_error(ctx));
    return t->st == KB_OK;
}

/* ---------------------------------------------------------------- pointwise */

/* Domains for ops whose derivative needs positive operands, has kinks or compares operands. */
static const struct { kb_op op; domain dom; } op_domains[] = {
    {KB_OP_LOG, {0.3, 2.5, 0, 0, {0}}},   {KB_OP_LOG1P, {-0.5, 2.5, 0, 0, {0}}},
    {KB_OP_SQRT, {0.3, 2.5, 0, 0, {0}}},  {KB_OP_RSQRT, {0.3, 2.5, 0, 0, {0}}},
    {KB_OP_RECIP, {0.4, 2.5, 0, 0, {0}}}, {KB_OP_DIV, {0.4, 2.5, 0, 0, {0}}},
    {KB_OP_POW, {0.3, 2.5, 0, 0, {0}}},   {KB_OP_ABS, {-2, 2, 0, 1, {0}}},
    {KB_OP_RELU, {-2, 2, 0, 1, {0}}},     {KB_OP_LEAKY_RELU, {-2, 2, 0, 1, {0}}},
    {KB_OP_HARDSWISH, {-4, 4, 0, 2, {-3, 3}}}, {KB_OP_SOFTPLUS, {-2, 2, 0, 1, {0.75}}},
    {KB_OP_MAX, {-2, 2, 1, 0, {0}}},      {KB_OP_MIN, {-2, 2, 1, 0, {0}}},
    {KB_OP_MISH, {-3, 3, 0, 0, {0}}},
};

static void test_pointwise(void)
{
    int tested = 0;
    for (int op = 0; op < KB_OP_COUNT; op++) {
        const kb_op_info *info = kb_op_get((kb_op)op);
        if (info->kind != KB_KIND_UNARY && info->kind != KB_KIND_BINARY && info->kind != KB_KIND_TERNARY) continue;
        if (!info->grad[0][0] && !info->grad[1][0] && !info->grad[2][0]) continue;
        domain dom = DEF;
        for (size_t d = 0; d < sizeof op_domains / sizeof op_domains[0]; d++)
            if (op_domains[d].op == (kb_op)op) dom = op_domains[d].dom;
        tg t = new_graph(1);
        kb_node n = tg_tmpl((kb_op)op, KB_F64, "s0,3");
        if (info->kind == KB_KIND_TERNARY) n.inputs[n.ninputs++] = tg_input(&t, "c", KB_BOOL, "s0,3");
        n.inputs[n.ninputs++] = tg_input(&t, "x", KB_F64, "s0,3");
        if (info->kind != KB_KIND_UNARY) n.inputs[n.ninputs++] = tg_input(&t, "y", KB_F64, "s0,3");
        if (op == KB_OP_LEAKY_RELU) n.scalar[0] = 0.1;
        if (op == KB_OP_SOFTPLUS) n.scalar[0] = 2.0, n.scalar[1] = 1.5;  /* the switch at x = 0.75 */
        tg_output(&t, tg_add(&t, &n));
        if (built(info->name, &t)) check_grad(info->name, t.g, NULL, &dom);
        kb_graph_free(t.g);
        tested++;
    }
    CHECK_MSG(tested >= 31, "only %d pointwise ops have rules", tested);

    /* mish past its softplus threshold (20) takes the other branch */
    tg t = new_graph(1);
    tg_output(&t, tg_op(&t, KB_OP_MISH, KB_F64, "s0,3", tg_input(&t, "x", KB_F64, "s0,3"), -1, -1));
    domain big = {15, 25, 0, 1, {20}};
    if (built("mish large", &t)) check_grad("mish large", t.g, NULL, &big);
    kb_graph_free(t.g);
}

/* ---------------------------------------------------------------- reductions and index maps */

static void dims_str(char *buf, size_t n, const char *const *dims, int rank, uint32_t axes, int keep)
{
    size_t len = 0;
    buf[0] = '\0';
    for (int d = 0; d < rank; d++) {
        if ((axes >> d & 1u) && !keep) continue;
        len += (size_t)snprintf(buf + len, n - len, "%s%s", len ? "," : "", (axes >> d & 1u) ? "1" : dims[d]);
    }
}

static void test_reductions(void)
{
    static const char *const full[3] = {"s0", "3", "s1"};
    static const kb_op ops[4] = {KB_OP_SUM, KB_OP_MEAN, KB_OP_RMAX, KB_OP_RMIN};
    for (int o = 0; o < 4; o++)
        for (uint32_t axes = 1; axes < 8; axes++)
            for (int keep = 0; keep < 2; keep++) {
                char name[64], dims[64];
                snprintf(name, sizeof name, "%s axes=%u keepdim=%d", kb_op_get(ops[o])->name, axes, keep);
                dims_str(dims, sizeof dims, full, 3, axes, keep);
                tg t = new_graph(2);
                int32_t x = tg_input(&t, "x", KB_F64, "s0,3,s1");
                /* sin before: the adjoint reaching x is not a plain broadcast of g */
                tg_output(&t, tg_reduce(&t, ops[o], KB_F64, dims, tg_op(&t, KB_OP_SIN, KB_F64, "s0,3,s1", x, -1, -1), axes));
                domain dom = {-1.4, 1.4, ops[o] == KB_OP_RMAX || ops[o] == KB_OP_RMIN, 0, {0}};
                if (built(name, &t)) check_grad(name, t.g, NULL, &dom);
                kb_graph_free(t.g);
            }
}

/* amax/amin split the gradient evenly among ties, like torch. */
static void test_max_ties(void)
{
    tg t = new_graph(0);
    int32_t x = tg_input(&t, "x", KB_F64, "2,4");
    tg_output(&t, tg_reduce(&t, KB_OP_RMAX, KB_F64, "2", x, 2));
    tg_output(&t, tg_reduce(&t, KB_OP_RMIN, KB_F64, "2,1", x, 2));
    uint8_t wrt[1] = {1};
    kb_graph *gg = NULL;
    if (built("ties", &t)) CHECK_STATUS(ctx, kb_graph_grad(t.g, wrt, &gg), KB_OK);
    if (gg) {
        const double xv[8] = {1, 3, 3, 0, 5, 5, 5, 5}, g0[2] = {2, 8}, g1[2] = {10, 100};
        const double want[8] = {0, 1, 1, 10, 2 + 25, 2 + 25, 2 + 25, 2 + 25};
        double got[8];
        CHECK_STATUS(ctx, kb_interp_graph(ctx, gg, NULL, (const void *[]){xv, g0, g1}, (void *[]){got}), KB_OK);
        for (int i = 0; i < 8; i++) CHECK_NEAR(got[i], want[i], 1e-15);
    }
    kb_graph_free(gg);
    kb_graph_free(t.g);
}

static void test_views(void)
{
    static const int8_t perm[3] = {2, 0, 1};
    tg t = new_graph(1);
    int32_t x = tg_input(&t, "x", KB_F64, "s0,1,3"), z = tg_input(&t, "z", KB_F64, "s0,4,3");
    tg_output(&t, tg_op(&t, KB_OP_MUL, KB_F64, "s0,4,3", tg_op(&t, KB_OP_EXPAND, KB_F64, "s0,4,3", x, -1, -1), z, -1));
    if (built("expand middle", &t)) check_grad("expand middle", t.g, NULL, &DEF);
    kb_graph_free(t.g);

    t = new_graph(1);
    x = tg_input(&t, "w", KB_F64, "1,3");
    tg_output(&t, tg_op(&t, KB_OP_SIN, KB_F64, "s0,3", tg_op(&t, KB_OP_EXPAND, KB_F64, "s0,3", x, -1, -1), -1, -1));
    if (built("expand symbolic", &t)) check_grad("expand symbolic", t.g, NULL, &DEF);
    kb_graph_free(t.g);

    t = new_graph(1);
    x = tg_input(&t, "x", KB_F64, "s0,6");
    int32_t r = tg_op(&t, KB_OP_RESHAPE, KB_F64, "s0,2,3", x, -1, -1);
    int32_t r2 = tg_op(&t, KB_OP_RESHAPE, KB_F64, "2*s0,3", tg_op(&t, KB_OP_EXP, KB_F64, "s0,2,3", r, -1, -1), -1, -1);
    tg_output(&t, tg_op(&t, KB_OP_MUL, KB_F64, "2*s0,3", r2, r2, -1));
    if (built("reshape", &t)) check_grad("reshape", t.g, NULL, &DEF);
    kb_graph_free(t.g);

    t = new_graph(1);
    x = tg_input(&t, "x", KB_F64, "s0,2,3");
    int32_t p = tg_permute(&t, KB_F64, "3,s0,2", x, perm);
    tg_output(&t, tg_op(&t, KB_OP_TANH, KB_F64, "3,s0,2", p, -1, -1));
    if (built("permute", &t)) check_grad("permute", t.g, NULL, &DEF);
    kb_graph_free(t.g);

    /* scalar through reshape and expand: the bias of a whole tensor */
    t = new_graph(1);
    x = tg_input(&t, "b", KB_F64, "");
    int32_t y = tg_input(&t, "y", KB_F64, "s0,2");
    int32_t be = tg_op(&t, KB_OP_EXPAND, KB_F64, "s0,2", tg_op(&t, KB_OP_RESHAPE, KB_F64, "1,1", x, -1, -1), -1, -1);
    tg_output(&t, tg_op(&t, KB_OP_MUL, KB_F64, "s0,2", tg_op(&t, KB_OP_ADD, KB_F64, "s0,2", be, y, -1), y, -1));
    if (built("scalar bias", &t)) check_grad("scalar bias", t.g, NULL, &DEF);
    kb_graph_free(t.g);
}

/* ---------------------------------------------------------------- composites */

static int32_t log_softmax(tg *t, int32_t x)
{
    int32_t m = tg_op(t, KB_OP_EXPAND, KB_F64, "s0,5", tg_reduce(t, KB_OP_RMAX, KB_F64, "s0,1", x, 2), -1, -1);
    int32_t xs = tg_op(t, KB_OP_SUB, KB_F64, "s0,5", x, m, -1);
    int32_t s = tg_reduce(t, KB_OP_SUM, KB_F64, "s0,1", tg_op(t, KB_OP_EXP, KB_F64, "s0,5", xs, -1, -1), 2);
    int32_t lse = tg_op(t, KB_OP_EXPAND, KB_F64, "s0,5", tg_op(t, KB_OP_LOG, KB_F64, "s0,1", s, -1, -1), -1, -1);
    return tg_op(t, KB_OP_SUB, KB_F64, "s0,5", xs, lse, -1);
}

static int32_t rms_norm(tg *t, int32_t x, int32_t w)
{
    int32_t ms = tg_reduce(t, KB_OP_MEAN, KB_F64, "s0,1", tg_op(t, KB_OP_MUL, KB_F64, "s0,5", x, x, -1), 2);
    int32_t r = tg_op(t, KB_OP_RSQRT, KB_F64, "s0,1", tg_op(t, KB_OP_ADD, KB_F64, "s0,1", ms, tg_const(t, KB_F64, "s0,1", 1e-6), -1), -1, -1);
    int32_t xn = tg_op(t, KB_OP_MUL, KB_F64, "s0,5", x, tg_op(t, KB_OP_EXPAND, KB_F64, "s0,5", r, -1, -1), -1);
    int32_t we = tg_op(t, KB_OP_EXPAND, KB_F64, "s0,5", tg_op(t, KB_OP_RESHAPE, KB_F64, "1,5", w, -1, -1), -1, -1);
    return tg_op(t, KB_OP_MUL, KB_F64, "s0,5", xn, we, -1);
}

/* gelu(x) * silu(x) + mish(softplus(gelu_tanh(x))) - leaky_relu-free smooth chain */
static int32_t act_chain(tg *t, int32_t x)
{
    kb_node sp = tg_tmpl(KB_OP_SOFTPLUS, KB_F64, "s0,5");
    sp.scalar[0] = 1.0, sp.scalar[1] = 20.0;
    sp.inputs[sp.ninputs++] = tg_op(t, KB_OP_GELU_TANH, KB_F64, "s0,5", x, -1, -1);
    int32_t m = tg_op(t, KB_OP_MISH, KB_F64, "s0,5", tg_add(t, &sp), -1, -1);
    int32_t gs = tg_op(t, KB_OP_MUL, KB_F64, "s0,5", tg_op(t, KB_OP_GELU, KB_F64, "s0,5", x, -1, -1),
                       tg_op(t, KB_OP_SILU, KB_F64, "s0,5", x, -1, -1), -1);
    return tg_op(t, KB_OP_ADD, KB_F64, "s0,5", gs, m, -1);
}

typedef enum { C_LAYERNORM, C_SOFTMAX, C_LOG_SOFTMAX, C_RMS_NORM, C_CHAIN, C_THRICE, C_WHERE_CMP, C_COUNT } composite;
static const char *const composite_names[C_COUNT] = {"layernorm", "softmax", "log_softmax", "rms_norm",
                                                     "activation chain", "used three times", "where(gt)"};

static tg build_composite(composite c)
{
    tg t = new_graph(1);
    int32_t x = tg_input(&t, "x", KB_F64, "s0,5");
    switch (c) {
    case C_LAYERNORM: {
        int32_t w = tg_input(&t, "weight", KB_F64, "5"), b = tg_input(&t, "bias", KB_F64, "5");
        tg_output(&t, tg_layernorm(&t, KB_F64, "s0", "5", x, w, b, 1e-5));
        break;
    }
    case C_SOFTMAX: tg_output(&t, tg_softmax(&t, KB_F64, "s0", "5", x)); break;
    case C_LOG_SOFTMAX: tg_output(&t, log_softmax(&t, x)); break;
    case C_RMS_NORM: tg_output(&t, rms_norm(&t, x, tg_input(&t, "weight", KB_F64, "5"))); break;
    case C_CHAIN: tg_output(&t, act_chain(&t, x)); break;
    case C_THRICE: {  /* x*x + x, and a second output sharing x */
        int32_t xx = tg_op(&t, KB_OP_MUL, KB_F64, "s0,5", x, x, -1);
        tg_output(&t, tg_op(&t, KB_OP_ADD, KB_F64, "s0,5", xx, x, -1));
        tg_output(&t, tg_op(&t, KB_OP_SIN, KB_F64, "s0,5", xx, -1, -1));
        break;
    }
    case C_WHERE_CMP: {
        int32_t y = tg_input(&t, "y", KB_F64, "s0,5");
        int32_t c0 = tg_op(&t, KB_OP_GT, KB_BOOL, "s0,5", x, y, -1);
        tg_output(&t, tg_op(&t, KB_OP_WHERE, KB_F64, "s0,5", c0, tg_op(&t, KB_OP_MUL, KB_F64, "s0,5", x, x, -1),
                            tg_op(&t, KB_OP_EXP, KB_F64, "s0,5", y, -1, -1)));
        break;
    }
    default: break;
    }
    return t;
}

static void test_composites(void)
{
    for (int c = 0; c < C_COUNT; c++) {
        domain dom = DEF;
        dom.distinct = c == C_SOFTMAX || c == C_LOG_SOFTMAX || c == C_WHERE_CMP;
        tg t = build_composite((composite)c);
        if (built(composite_names[c], &t)) check_grad(composite_names[c], t.g, NULL, &dom);
        kb_graph_free(t.g);
    }
}

static void test_second_order(void)
{
    static const composite cs[] = {C_LAYERNORM, C_SOFTMAX, C_RMS_NORM, C_CHAIN};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        char name[64];
        snprintf(name, sizeof name, "grad of grad: %s", composite_names[cs[i]]);
        domain dom = DEF;
        dom.distinct = cs[i] == C_SOFTMAX;
        tg t = build_composite(cs[i]);
        if (built(name, &t)) check_grad2(name, t.g, &dom);
        kb_graph_free(t.g);
    }
}

/* ---------------------------------------------------------------- dtypes, special inputs and outputs */

/* An f32 graph differentiates in f32: the same gradients as the f64 graph, rounded once. */
static void test_dtypes(void)
{
    tg t64 = new_graph(0), t32 = new_graph(0);
    tg_output(&t64, tg_softmax(&t64, KB_F64, "2", "4", tg_input(&t64, "x", KB_F64, "2,4")));
    tg_output(&t32, tg_softmax(&t32, KB_F32, "2", "4", tg_input(&t32, "x", KB_F32, "2,4")));
    uint8_t wrt[1] = {1};
    kb_graph *g64 = NULL, *g32 = NULL;
    if (built("f64", &t64) && built("f32", &t32)) {
        CHECK_STATUS(ctx, kb_graph_grad(t64.g, wrt, &g64), KB_OK);
        CHECK_STATUS(ctx, kb_graph_grad(t32.g, wrt, &g32), KB_OK);
    }
    if (g64 && g32) {
        float xf[8] = {0.5f, -1, 2, 0.25f, 3, 1, -2, 0}, gf[8] = {1, -0.5f, 0.25f, 2, -1, 0.5f, 1.5f, -2}, r32[8];
        double xd[8], gd[8], r64[8];
        for (int i = 0; i < 8; i++) xd[i] = xf[i], gd[i] = gf[i];
        int has_f64 = 0;  /* no value is widened (only the bool mask of max is cast, to f32) */
        for (int32_t v = 0; v < kb_graph_nnodes(g32); v++) has_f64 |= kb_graph_node(g32, v)->dtype == KB_F64;
        CHECK(!has_f64 && graph_has_op(g32, KB_OP_CAST) && kb_graph_node(g32, kb_graph_output(g32, 0))->dtype == KB_F32);
        CHECK_STATUS(ctx, kb_interp_graph(ctx, g64, NULL, (const void *[]){xd, gd}, (void *[]){r64}), KB_OK);
        CHECK_STATUS(ctx, kb_interp_graph(ctx, g32, NULL, (const void *[]){xf, gf}, (void *[]){r32}), KB_OK);
        for (int i = 0; i < 8; i++) CHECK(r32[i] == (float)r64[i]);
    }
    kb_graph_free(g64);
    kb_graph_free(g32);
    kb_graph_free(t64.g);
    kb_graph_free(t32.g);

    /* CAST's adjoint casts back: x f32 -> f64 -> exp; d/dx = (float)(g * exp(x)) */
    tg t = new_graph(0);
    tg_output(&t, tg_op(&t, KB_OP_EXP, KB_F64, "3", tg_op(&t, KB_OP_CAST, KB_F64, "3", tg_input(&t, "x", KB_F32, "3"), -1, -1), -1, -1));
    kb_graph *gg = NULL;
    if (built("cast", &t)) CHECK_STATUS(ctx, kb_graph_grad(t.g, wrt, &gg), KB_OK);
    if (gg) {
        float x[3] = {0.5f, -1.25f, 2}, got[3];
        double g[3] = {1, -3, 0.5};
        CHECK(kb_graph_node(gg, kb_graph_output(gg, 0))->dtype == KB_F32);
        CHECK_STATUS(ctx, kb_interp_graph(ctx, gg, NULL, (const void *[]){x, g}, (void *[]){got}), KB_OK);
        for (int i = 0; i < 3; i++) CHECK(got[i] == (float)(g[i] * exp((double)x[i])));
    }
    kb_graph_free(gg);
    kb_graph_free(t.g);
}

static void test_special_io(void)
{
    /* an unused input gets zeros; an input returned as is gets grad_out; a bool output and an
     * integer input take no part; a non-wrt input gets no output */
    tg t = new_graph(1);
    int32_t x = tg_input(&t, "x", KB_F64, "s0,2"), u = tg_input(&t, "unused", KB_F64, "3");
    int32_t k = tg_input(&t, "k", KB_I64, "s0,2"), y = tg_input(&t, "y", KB_F64, "s0,2");
    tg_output(&t, tg_op(&t, KB_OP_GT, KB_BOOL, "s0,2", x, y, -1));
    tg_output(&t, x);
    tg_output(&t, tg_op(&t, KB_OP_MUL, KB_F64, "s0,2", tg_op(&t, KB_OP_CAST, KB_F64, "s0,2", k, -1, -1), tg_op(&t, KB_OP_MUL, KB_F64, "s0,2", x, y, -1), -1));
    uint8_t wrt[4] = {1, 1, 0, 0};
    (void)u;
    if (built("special io", &t)) check_grad("special io", t.g, wrt, &DEF);
    kb_graph *gg = NULL;
    if (t.st == KB_OK) CHECK_STATUS(ctx, kb_graph_grad(t.g, wrt, &gg), KB_OK);
    if (gg) {
        CHECK(kb_graph_noutputs(gg) == 2 && kb_graph_node(gg, kb_graph_output(gg, 1))->op == KB_OP_CONST);
        CHECK(kb_graph_node(gg, kb_graph_input(gg, 4))->dtype == KB_BOOL);
    }
    kb_graph_free(gg);
    kb_graph_free(t.g);
}

/* ---------------------------------------------------------------- the graph itself */

static void check_dump(const char *name, const kb_graph *g, const char *want)
{
    char *text = NULL;
    CHECK_STATUS(ctx, kb_graph_dump(g, &text), KB_OK);
    CHECK_MSG(text && strcmp(text, want) == 0, "%s: dump differs:\n%s", name, text ? text : "(null)");
    kb_string_free(ctx, text);
}

static void test_golden(void)
{
    tg t = new_graph(1);
    int32_t x = tg_input(&t, "x", KB_F32, "s0,4"), y = tg_input(&t, "y", KB_F32, "s0,4");
    tg_output(&t, tg_op(&t, KB_OP_MUL, KB_F32, "s0,4", x, y, -1));
    tg_output(&t, tg_op(&t, KB_OP_RELU, KB_F32, "s0,4", x, -1, -1));
    uint8_t wrt[2] = {1, 1};
    kb_graph *gg = NULL;
    if (built("golden", &t)) CHECK_STATUS(ctx, kb_graph_grad(t.g, wrt, &gg), KB_OK);
    if (gg)
        check_dump("mul+relu", gg,
                   "graph(s0=3) {\n"
                   "  %0 = input user \"x\" : f32[s0,4]\n"
                   "  %1 = input user \"y\" : f32[s0,4]\n"
                   "  %2 = input user \"grad_out0\" : f32[s0,4]\n"
                   "  %3 = input user \"grad_out1\" : f32[s0,4]\n"
                   "  %4 = const 0 : f32[s0,4]\n"
                   "  %5 = gt %0, %4 : bool[s0,4]\n"
                   "  %6 = cast %5 : f32[s0,4]\n"
                   "  %7 = mul %3, %6 : f32[s0,4]\n"
                   "  %8 = mul %2, %1 : f32[s0,4]\n"
                   "  %9 = add %7, %8 : f32[s0,4]\n"
                   "  %10 = mul %2, %0 : f32[s0,4]\n"
                   "  return %9, %10\n"
                   "}\n");
    kb_graph_free(gg);
    kb_graph_free(t.g);

    /* the backward of sum(exp(x)) keeps exp(x) and drops the sum; mean over a symbol divides by
     * a sum of ones, over pinned dims by a literal */
    t = new_graph(1);
    x = tg_input(&t, "x", KB_F64, "s0,4");
    int32_t e = tg_op(&t, KB_OP_EXP, KB_F64, "s0,4", x, -1, -1);
    tg_output(&t, tg_reduce(&t, KB_OP_SUM, KB_F64, "s0", e, 2));
    tg_output(&t, tg_reduce(&t, KB_OP_MEAN, KB_F64, "4", e, 1));
    gg = NULL;
    if (built("sum exp", &t)) CHECK_STATUS(ctx, kb_graph_grad(t.g, wrt, &gg), KB_OK);
    if (gg)
        check_dump("sum/mean of exp", gg,
                   "graph(s0=3) {\n"
                   "  %0 = input user \"x\" : f64[s0,4]\n"
                   "  %1 = input user \"grad_out0\" : f64[s0]\n"
                   "  %2 = input user \"grad_out1\" : f64[4]\n"
                   "  %3 = exp %0 : f64[s0,4]\n"
                   "  %4 = reshape %2 : f64[1,4]\n"
                   "  %5 = expand %4 : f64[s0,4]\n"
                   "  %6 = const 1 : f64[s0,1]\n"
                   "  %7 = sum %6 axes=[0] : f64[1,1]\n"
                   "  %8 = expand %7 : f64[s0,4]\n"
                   "  %9 = div %5, %8 : f64[s0,4]\n"
                   "  %10 = reshape %1 : f64[s0,1]\n"
                   "  %11 = expand %10 : f64[s0,4]\n"
                   "  %12 = add %9, %11 : f64[s0,4]\n"
                   "  %13 = mul %12, %3 : f64[s0,4]\n"
                   "  return %13\n"
                   "}\n");
    kb_graph_free(gg);
    kb_graph_free(t.g);
}

static void test_errors(void)
{
    uint8_t wrt[3] = {1, 1, 1};
    kb_graph *gg = (kb_graph *)&wrt;  /* must be reset to NULL on failure */
    tg t = new_graph(0);
    int32_t x = tg_input(&t, "x", KB_F64, "2,3"), k = tg_input(&t, "k", KB_I64, "2,1");
    tg_output(&t, tg_op(&t, KB_OP_EXP, KB_F64, "2,3", x, -1, -1));
    CHECK_STATUS(ctx, kb_graph_grad(t.g, wrt, &gg), KB_ERR_INVALID);  /* wrt an integer input */
    CHECK(gg == NULL);
    CHECK_STATUS(ctx, kb_graph_grad(t.g, NULL, &gg), KB_ERR_INVALID);
    CHECK(kb_graph_grad(NULL, wrt, &gg) == KB_ERR_INVALID && kb_graph_grad(t.g, wrt, NULL) == KB_ERR_INVALID);

    /* gather of one index per row: a where(iota == index) mask; more per row needs a scatter */
    int32_t ga = tg_gather(&t, KB_F64, "2,1", tg_op(&t, KB_OP_SIN, KB_F64, "2,3", x, -1, -1), k, 1);
    tg_output(&t, ga);
    uint8_t only_none[2] = {0, 0};
    CHECK_STATUS(ctx, kb_graph_grad(t.g, only_none, &gg), KB_OK);
    kb_graph_free(gg);
    uint8_t wrt_x[2] = {1, 0};
    CHECK_STATUS(ctx, kb_graph_grad(t.g, wrt_x, &gg), KB_OK);
    kb_graph_free(gg);
    kb_graph_free(t.g);
    t = new_graph(0);
    x = tg_input(&t, "x", KB_F64, "2,3");
    k = tg_input(&t, "k", KB_I64, "2,2");
    tg_output(&t, tg_gather(&t, KB_F64, "2,2", x, k, 1));
    CHECK_STATUS(ctx, kb_graph_grad(t.g, wrt_x, &gg), KB_ERR_UNSUPPORTED);
    CHECK(gg == NULL && strstr(kb_ctx_error(ctx), "gather") != NULL);
    kb_graph_free(t.g);

    /* slice: step 1 reads g back through a clamped gather; a strided slice needs a scatter */
    t = new_graph(0);
    x = tg_input(&t, "x", KB_F64, "6");
    int32_t y = tg_input(&t, "y", KB_F64, "6");
    tg_output(&t, tg_op(&t, KB_OP_MUL, KB_F64, "3", tg_slice(&t, KB_F64, "3", y, 0, 1, 2), tg_slice(&t, KB_F64, "3", x, 0, 0, 1), -1));
    uint8_t wrt_s[2] = {0, 1};
    CHECK_STATUS(ctx, kb_graph_grad(t.g, wrt_s, &gg), KB_ERR_UNSUPPORTED);
    wrt_s[0] = 1, wrt_s[1] = 0;
    CHECK_STATUS(ctx, kb_graph_grad(t.g, wrt_s, &gg), KB_OK);
    kb_graph_free(gg);
    kb_graph_free(t.g);

    /* extern */
    t = new_graph(0);
    x = tg_input(&t, "x", KB_F64, "2,3");
    kb_node ex = tg_tmpl(KB_OP_EXTERN, KB_F64, "2,3");
    ex.inputs[ex.ninputs++] = x;
    tg_output(&t, tg_op(&t, KB_OP_EXP, KB_F64, "2,3", tg_add(&t, &ex), -1, -1));
    CHECK_STATUS(ctx, kb_graph_grad(t.g, wrt, &gg), KB_ERR_UNSUPPORTED);
    kb_graph_free(t.g);
}

/* Every allocation kb_graph_grad makes, failed in turn: OOM, nothing returned, nothing leaked. */
static void test_oom(void)
{
    kb_ctx *c2;
    if (kb_ctx_new(test_alloc, NULL, &c2) != KB_OK) return;
    kb_ctx *saved = ctx;
    ctx = c2;
    tg t = build_composite(C_LAYERNORM);
    uint8_t wrt[3] = {1, 1, 1};
    int ok = 0, fails = 0;
    for (long k = 0; t.st == KB_OK && k < 100000 && !ok; k++) {
        kb_graph *gg = (kb_graph *)&wrt;
        long long before = alloc_bytes;
        alloc_count = 0;
        alloc_fail_at = k;
        kb_status st = kb_graph_grad(t.g, wrt, &gg);
        alloc_fail_at = -1;
        if (st == KB_OK) {
            ok = 1;
            kb_graph_free(gg);
        } else {
            fails++;
            CHECK_MSG(st == KB_ERR_OOM && gg == NULL, "fail at %ld: %s", k, kb_status_name(st));
        }
        CHECK_MSG(alloc_bytes == before, "fail at %ld: %lld bytes leaked", k, alloc_bytes - before);
    }
    CHECK(ok && fails > 5);
    kb_graph_free(t.g);
    ctx = saved;
    kb_ctx_free(c2);
}

/* ---------------------------------------------------------------- slices of one value */

/* x.chunk(3) along the last dim: silu(a) * b + sin(c) */
static tg build_chunks(void)
{
    tg t = new_graph(1);
    int32_t x = tg_input(&t, "x", KB_F64, "s0,6");
    int32_t a = tg_slice(&t, KB_F64, "s0,2", x, 1, 0, 1), b = tg_slice(&t, KB_F64, "s0,2", x, 1, 2, 1);
    int32_t c = tg_slice(&t, KB_F64, "s0,2", x, 1, 4, 1);
    int32_t ab = tg_op(&t, KB_OP_MUL, KB_F64, "s0,2", tg_op(&t, KB_OP_SILU, KB_F64, "s0,2", a, -1, -1), b, -1);
    tg_output(&t, tg_op(&t, KB_OP_ADD, KB_F64, "s0,2", ab, tg_op(&t, KB_OP_SIN, KB_F64, "s0,2", c, -1, -1), -1));
    return t;
}

/* Slices that tile an axis differentiate into one select (dx = where(iota < 2, .., where(iota <
 * 4, .., ..))), one POINTWISE region when partitioned; slices with a gap or an overlap, or on
 * two axes, still match finite differences. */
static void test_slices(void)
{
    tg t = build_chunks();
    if (built("chunks", &t)) {
        check_grad("chunks", t.g, NULL, &DEF);
        uint8_t wrt[1] = {1};
        kb_graph *gg = NULL;
        kb_partition *p = NULL;
        CHECK_STATUS(ctx, kb_graph_grad(t.g, wrt, &gg), KB_OK);
        if (gg) {
            const kb_node *dx = kb_graph_node(gg, kb_graph_output(gg, 0));
            CHECK(dx->op == KB_OP_WHERE && kb_graph_node(gg, dx->inputs[2])->op == KB_OP_WHERE);
            CHECK_STATUS(ctx, kb_partition_new(gg, &p), KB_OK);
            CHECK(p && p->nregions == 1 && p->regions[0].kind == KB_REGION_POINTWISE &&
                  p->regions[0].noutputs == 1 && p->regions[0].ninputs == 2);
        }
        kb_partition_free(p);
        kb_graph_free(gg);
    }
    kb_graph_free(t.g);

    /* x: [0,2) and [4,7) leave a gap (one select, zero there) and rows 1..2 cut axis 0;
     * y: [1,5) overlaps a slice like x's first (zero-padded each, summed) */
    t = new_graph(1);
    int32_t x = tg_input(&t, "x", KB_F64, "4,s0,7"), y = tg_input(&t, "y", KB_F64, "4,s0,7");
    int32_t a = tg_slice(&t, KB_F64, "4,s0,2", x, 2, 0, 1), b = tg_slice(&t, KB_F64, "4,s0,3", x, 2, 4, 1);
    int32_t d = tg_slice(&t, KB_F64, "2,s0,7", x, 0, 1, 1), ya = tg_slice(&t, KB_F64, "4,s0,2", y, 2, 0, 1);
    int32_t c = tg_slice(&t, KB_F64, "4,s0,4", y, 2, 1, 1);
    tg_output(&t, tg_op(&t, KB_OP_COS, KB_F64, "4,s0,2", ya, -1, -1));
    tg_output(&t, tg_reduce(&t, KB_OP_SUM, KB_F64, "4,s0,1", tg_op(&t, KB_OP_EXP, KB_F64, "4,s0,2", a, -1, -1), 4));
    tg_output(&t, tg_reduce(&t, KB_OP_SUM, KB_F64, "4,s0,1", tg_op(&t, KB_OP_MUL, KB_F64, "4,s0,3", b, b, -1), 4));
    tg_output(&t, tg_op(&t, KB_OP_SIN, KB_F64, "4,s0,4", c, -1, -1));
    tg_output(&t, tg_op(&t, KB_OP_TANH, KB_F64, "2,s0,7", d, -1, -1));
    if (built("gap, overlap, two axes", &t)) check_grad("gap, overlap, two axes", t.g, NULL, &DEF);
    kb_graph_free(t.g);
}

/* The chunks' backward, built and partitioned with every allocation failed in turn. */
static void test_slices_oom(void)
{
    kb_ctx *c2;
    if (kb_ctx_new(test_alloc, NULL, &c2) != KB_OK) return;
    kb_ctx *saved = ctx;
    ctx = c2;
    tg t = build_chunks();
    uint8_t wrt[1] = {1};
    int ok = 0, fails = 0;
    for (long k = 0; t.st == KB_OK && k < 100000 && !ok; k++) {
        kb_graph *gg = NULL;
        kb_partition *p = NULL;
        long long before = alloc_bytes;
        alloc_count = 0;
        alloc_fail_at = k;
        kb_status st = kb_graph_grad(t.g, wrt, &gg);
        if (st == KB_OK) st = kb_partition_new(gg, &p);
        alloc_fail_at = -1;
        if (st == KB_OK) ok = 1;
        else fails++;
        CHECK_MSG(st == KB_OK || st == KB_ERR_OOM, "fail at %ld: %s", k, kb_status_name(st));
        kb_partition_free(p);
        kb_graph_free(gg);
        CHECK_MSG(alloc_bytes == before, "fail at %ld: %lld bytes leaked", k, alloc_bytes - before);
    }
    CHECK(ok && fails > 5);
    kb_graph_free(t.g);
    ctx = saved;
    kb_ctx_free(c2);
}

/* ---------------------------------------------------------------- kb_region_graph */

static void test_region_graph(void)
{
    /* softmax split by hand into two regions: exp(x - max) | sum, divide */
    tg t = new_graph(1);
    int32_t x = tg_input(&t, "x", KB_F64, "s0,4");
    int32_t mx = tg_reduce(&t, KB_OP_RMAX, KB_F64, "s0,1", x, 2);
    int32_t me = tg_op(&t, KB_OP_EXPAND, KB_F64, "s0,4", mx, -1, -1);
    int32_t e = tg_op(&t, KB_OP_EXP, KB_F64, "s0,4", tg_op(&t, KB_OP_SUB, KB_F64, "s0,4", x, me, -1), -1, -1);
    int32_t s = tg_reduce(&t, KB_OP_SUM, KB_F64, "s0,1", e, 2);
    int32_t y = tg_op(&t, KB_OP_DIV, KB_F64, "s0,4", e, tg_op(&t, KB_OP_EXPAND, KB_F64, "s0,4", s, -1, -1), -1);
    tg_output(&t, y);
    if (!built("region graph", &t)) return;
    int32_t nodes_a[4] = {mx, me, me + 1, e}, ins_a[1] = {x}, outs_a[1] = {e};
    int32_t nodes_b[3] = {s, s + 1, y}, ins_b[1] = {e}, outs_b[1] = {y};
    int32_t region_of[16];
    for (int i = 0; i < 16; i++) region_of[i] = -1;
    kb_region regs[2] = {{KB_REGION_ROW, 4, nodes_a, 1, ins_a, 1, outs_a, e, 2, 0, 0, {0, {0, 0}, {KB_GEMM_ROW, KB_GEMM_ROW}, {0, 0}, {0, 0}, 0, NULL}},
                         {KB_REGION_ROW, 3, nodes_b, 1, ins_b, 1, outs_b, y, 2, 0, 0, {0, {0, 0}, {KB_GEMM_ROW, KB_GEMM_ROW}, {0, 0}, {0, 0}, 0, NULL}}};
    kb_partition p = {t.g, 2, regs, region_of, 0};
    kb_graph *ra = NULL, *rb = NULL;
    CHECK_STATUS(ctx, kb_region_graph(&p, 0, &ra), KB_OK);
    CHECK_STATUS(ctx, kb_region_graph(&p, 1, &rb), KB_OK);
    if (ra && rb) {
        check_dump("region 1", rb,
                   "graph(s0=3) {\n"
                   "  %0 = input user \"in0\" : f64[s0,4]\n"
                   "  %1 = sum %0 axes=[1] : f64[s0,1]\n"
                   "  %2 = expand %1 : f64[s0,4]\n"
                   "  %3 = div %0, %2 : f64[s0,4]\n"
                   "  return %3\n"
                   "}\n");
        CHECK(strcmp(kb_graph_node(ra, kb_graph_input(ra, 0))->name, "x") == 0);
        /* the two region graphs chained equal the regions run by the interpreter */
        int64_t sv[1] = {3};
        double xv[12], ea[12], eb[12], ya[12], yb[12];
        for (int i = 0; i < 12; i++) xv[i] = sin(i * 1.7);
        CHECK_STATUS(ctx, kb_interp_graph(ctx, ra, sv, (const void *[]){xv}, (void *[]){ea}), KB_OK);
        CHECK_STATUS(ctx, kb_interp_graph(ctx, rb, sv, (const void *[]){ea}, (void *[]){ya}), KB_OK);
        CHECK_STATUS(ctx, kb_interp_region(ctx, &p, 0, sv, (const void *[]){xv}, (void *[]){eb}), KB_OK);
        CHECK_STATUS(ctx, kb_interp_region(ctx, &p, 1, sv, (const void *[]){eb}, (void *[]){yb}), KB_OK);
        for (int i = 0; i < 12; i++) CHECK(ya[i] == yb[i] && ea[i] == eb[i]);
        /* a region graph differentiates like any graph */
        check_grad("region 0 grad", ra, NULL, &(domain){-2, 2, 1, 0, {0}});
        check_grad("region 1 grad", rb, NULL, &(domain){0.5, 2, 0, 0, {0}});
    }
    kb_graph_free(ra);
    kb_graph_free(rb);

    /* a region reading a value that is neither inside it nor listed as an input */
    int32_t bad_ins[1] = {x};
    kb_region bad = {KB_REGION_ROW, 3, nodes_b, 1, bad_ins, 1, outs_b, y, 2, 0, 0, {0, {0, 0}, {KB_GEMM_ROW, KB_GEMM_ROW}, {0, 0}, {0, 0}, 0, NULL}};
    kb_partition pb = {t.g, 1, &bad, region_of, 0};
    kb_graph *rg = (kb_graph *)&bad;
    CHECK_STATUS(ctx, kb_region_graph(&pb, 0, &rg), KB_ERR_INVALID);
    CHECK(rg == NULL);
    CHECK_STATUS(ctx, kb_region_graph(&p, 2, &rg), KB_ERR_INVALID);
    kb_graph_free(t.g);
}

/* ---------------------------------------------------------------- forward and backward in one graph */

/* kb_graph_grad_joint on L = sum(exp(x)) / sum(c), x f64[s0,4] the large input, c f64[s0]: its
 * outputs are L, then dL/dx and dL/dc, equal to the forward's L and to kb_graph_grad's with the
 * upstream gradient 1; the work on c alone comes before every node that reads x (light_first). */
static void test_joint(void)
{
    tg t = new_graph(1);
    int32_t x = tg_input(&t, "x", KB_F64, "s0,4");
    int32_t c = tg_input(&t, "c", KB_F64, "s0");
    int32_t sx = tg_reduce(&t, KB_OP_SUM, KB_F64, "", tg_op(&t, KB_OP_EXP, KB_F64, "s0,4", x, -1, -1), 3);
    int32_t sc = tg_reduce(&t, KB_OP_SUM, KB_F64, "", c, 1);
    tg_output(&t, tg_op(&t, KB_OP_DIV, KB_F64, "", sx, sc, -1));
    if (!built("joint", &t)) return;
    uint8_t wrt[2] = {1, 1};
    kb_graph *joint = NULL, *grad = NULL;
    CHECK_STATUS(ctx, kb_graph_grad_joint(t.g, wrt, &joint), KB_OK);
    CHECK_STATUS(ctx, kb_graph_grad(t.g, wrt, &grad), KB_OK);
    if (joint && grad) {
        CHECK(kb_graph_ninputs(joint) == 2 && kb_graph_noutputs(joint) == 3);
        /* light first: once a node reads x, nothing after it is work on c alone */
        int seen_x = 0, order_ok = 1;
        uint8_t reads_x[64] = {0};
        for (int32_t v = 0; v < kb_graph_nnodes(joint) && v < 64; v++) {
            const kb_node *nd = kb_graph_node(joint, v);
            reads_x[v] = v == kb_graph_input(joint, 0);
            for (int i = 0; i < nd->ninputs; i++) reads_x[v] |= reads_x[nd->inputs[i]];
            if (nd->op == KB_OP_INPUT || nd->op == KB_OP_CONST) continue;
            if (reads_x[v]) seen_x = 1;
            else if (seen_x) order_ok = 0;
        }
        CHECK_MSG(order_ok, "work on the small input after work on the large one");
        int64_t sv[1] = {3};
        double xv[12], cv[3], one = 1.0, l_fwd, l_joint, dx[12], dc[3], gx[12], gc[3];
        for (int i = 0; i < 12; i++) xv[i] = sin(i * 0.7);
        for (int i = 0; i < 3; i++) cv[i] = 1.0 + i;
        CHECK_STATUS(ctx, kb_interp_graph(ctx, t.g, sv, (const void *[]){xv, cv}, (void *[]){&l_fwd}), KB_OK);
        CHECK_STATUS(ctx, kb_interp_graph(ctx, joint, sv, (const void *[]){xv, cv}, (void *[]){&l_joint, dx, dc}),
                     KB_OK);
        CHECK_STATUS(ctx, kb_interp_graph(ctx, grad, sv, (const void *[]){xv, cv, &one}, (void *[]){gx, gc}), KB_OK);
        CHECK(l_fwd == l_joint);
        for (int i = 0; i < 12; i++) CHECK_MSG(fabs(dx[i] - gx[i]) <= 1e-14 * fabs(gx[i]), "dx[%d]", i);
        for (int i = 0; i < 3; i++) CHECK_MSG(fabs(dc[i] - gc[i]) <= 1e-14 * fabs(gc[i]), "dc[%d]", i);
    }
    kb_graph_free(joint);
    kb_graph_free(grad);
    kb_graph_free(t.g);
}

int main(void)
{
    if (kb_ctx_new(NULL, NULL, &ctx) != KB_OK) return 1;
    test_pointwise();
    test_reductions();
    test_max_ties();
    test_views();
    test_composites();
    test_second_order();
    test_dtypes();
    test_special_io();
    test_golden();
    test_errors();
    test_oom();
    test_slices();
    test_slices_oom();
    test_region_graph();
    test_joint();
    kb_ctx_free(ctx);
    return check_report();
}
