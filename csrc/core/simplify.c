/* simplify.c — whole-graph rewrites (kb_graph_simplify): algebra that takes a pass over a row
 * out of a kernel before the partitioner sees the graph, then dead nodes dropped. Every backward
 * goes through it (grad/grad.c); any graph may. A rule matches on the graph being rebuilt and emits
 * its replacement there, with the replaced value's dtype and shape. */
#include "core/internal.h"

#include <math.h>

#define MAX_LINEAR_STEPS 8

static const kb_node *N(const kb_graph *w, int32_t v) { return kb_graph_node(w, v); }

static int is_one(kb_dim d) { return d.coef == 1 && d.nsym == 0; }

static int has_dims(const kb_node *n, int32_t rank, const kb_dim *dims)
{
    if (n->rank != rank) return 0;
    for (int d = 0; d < rank; d++)
        if (!kb_dim_equal(n->dims[d], dims[d])) return 0;
    return 1;
}

static kb_node tmpl(kb_op op, kb_dtype dt, int32_t rank, const kb_dim *dims) {
    return kb_node_template(op, dt, rank, dims);
}

/* Does existing node a compute what template t does? Only the ops rules emit are compared
 * (anything else is never merged, which is merely a missed sharing). */
static int same_value(const kb_node *a, const kb_node *t)
{
    if (a->op != t->op || a->dtype != t->dtype || a->ninputs != t->ninputs || a->nograd != t->nograd ||
        !has_dims(a, t->rank, t->dims))
        return 0;
    for (int i = 0; i < t->ninputs; i++)
        if (a->inputs[i] != t->inputs[i]) return 0;
    switch (t->op) {
    case KB_OP_CONST: return memcmp(&a->scalar[0], &t->scalar[0], sizeof(double)) == 0; /* keeps -0 apart */
    case KB_OP_IOTA: return a->axis == t->axis;
    case KB_OP_SLICE: return a->axis == t->axis && a->start == t->start && a->step == t->step;
    case KB_OP_RESHAPE: case KB_OP_EXPAND: case KB_OP_NEG: case KB_OP_CAST: case KB_OP_MUL: case KB_OP_DIV:
    case KB_OP_GE: case KB_OP_LT: case KB_OP_AND: case KB_OP_WHERE:
        return 1;
    default: return 0;
    }
}

/* Adds t to w, or finds the node of w that computes it already: two sums of one-hots of one
 * target share one range test. A linear scan: rules fire rarely. */
static kb_status put(kb_graph *w, const kb_node *t, int32_t *id)
{
    for (int32_t v = kb_graph_nnodes(w) - 1; v >= 0; v--)
        if (same_value(N(w, v), t)) {
            *id = v;
            return KB_OK;
        }
    return kb_graph_add(w, t, id);
}

static kb_status put_op(kb_graph *w, kb_op op, kb_dtype dt, int32_t rank, const kb_dim *dims, int32_t x, int32_t y,
                        int32_t z, int32_t *id)
{
    kb_node t = tmpl(op, dt, rank, dims);
    int32_t args[3] = {x, y, z};
    for (int i = 0; i < 3 && args[i] >= 0; i++) t.inputs[t.ninputs++] = args[i];
    return put(w, &t, id);
}

static kb_status put_const(kb_graph *w, kb_dtype dt, int32_t rank, const kb_dim *dims, double v, int32_t *id)
{
    kb_node t = tmpl(KB_OP_CONST, dt, rank, dims);
    t.scalar[0] = v;
    return put(w, &t, id);
}

/* ---------------------------------------------------------------- the sum of a one-hot row */

/* sum_a where(iota_a == T, D, 0) with T and D the same all along axis a is D where 0 <= T <
 * size_a and 0 elsewhere: the one-hot has at most one nonzero, at T. Linear maps with f(0) = 0
 * between the where and the sum commute with it. Cross-entropy's backward has one (the sum_to
 * of the gather's adjoint); as a sum it is a whole extra pass over a 32k-wide row, rewritten it
 * is a few operations per row. Exact for every integer T, in range or not; for size_a = 0 the
 * interpreter reports the read of the size (below) out of range. */

/* Size 1 on every axis of the mask? */
static int ones_on(const kb_node *n, uint32_t axes)
{
    for (int d = 0; d < n->rank; d++)
        if (axes >> d & 1u && !is_one(n->dims[d])) return 0;
    return 1;
}

/* Is v the same all along the axes of the mask: size 1 there, a constant, a broadcast along
 * them, or pointwise work on such values (a per-row statistic's arithmetic, -0.5 * rstd^3 / n)? */
#define MAX_ALONG_DEPTH 8
static int along_const_d(const kb_graph *w, int32_t v, uint32_t axes, int depth)
{
    const kb_node *n = N(w, v);
    if (ones_on(n, axes) || n->op == KB_OP_CONST) return 1;
    if (n->op == KB_OP_EXPAND) return ones_on(N(w, n->inputs[0]), axes);
    kb_op_kind kind = kb_op_get(n->op)->kind;
    if (depth == 0 || (kind != KB_KIND_UNARY && kind != KB_KIND_BINARY && kind != KB_KIND_TERNARY)) return 0;
    for (int i = 0; i < n->ninputs; i++)
        if (!along_const_d(w, n->inputs[i], axes, depth - 1)) return 0;
    return 1;
}

static int along_const(const kb_graph *w, int32_t v, uint32_t axes) { return along_const_d(w, v, axes, MAX_ALONG_DEPTH); }

/* v (along_const) at the keepdim shape kd: the same values with size 1 on the summed axes. */
static kb_status keep_along(kb_graph *w, int32_t v, int32_t rank, const kb_dim *kd, int32_t *out)
{
    kb_status st = KB_OK;
    kb_node n = *N(w, v); /* a copy: w's node array moves as nodes are put */
    if (has_dims(&n, rank, kd)) {
        *out = v;
        return KB_OK;
    }
    if (n.op == KB_OP_CONST) return put_const(w, n.dtype, rank, kd, n.scalar[0], out);
    if (n.op == KB_OP_EXPAND) { /* an expand of u, which has size 1 on a */
        int32_t u = n.inputs[0];
        if (has_dims(N(w, u), rank, kd)) {
            *out = u;
            return KB_OK;
        }
        return put_op(w, KB_OP_EXPAND, N(w, u)->dtype, rank, kd, u, -1, -1, out);
    }
    /* pointwise work: the same op per row */
    for (int i = 0; i < n.ninputs; i++) KB_TRY(keep_along(w, n.inputs[i], rank, kd, &n.inputs[i]));
    n.rank = rank;
    for (int d = 0; d < rank; d++) n.dims[d] = kd[d];
    KB_TRY(kb_graph_add(w, &n, out));
cleanup:
    return st;
}

/* A constant zero, maybe broadcast; *value keeps its sign. */
static int is_zero(const kb_graph *w, int32_t v, double *value)
{
    const kb_node *n = N(w, v);
    if (n->op == KB_OP_EXPAND) n = N(w, n->inputs[0]);
    *value = n->scalar[0];
    return n->op == KB_OP_CONST && n->scalar[0] == 0.0;
}

/* The coordinate along a (an integer iota, maybe broadcast along other axes). A float iota
 * is left alone: torch_eval rounds it to its dtype. */
static int is_iota(const kb_graph *w, int32_t v, int a)
{
    const kb_node *n = N(w, v);
    if (n->op == KB_OP_EXPAND && kb_dim_equal(N(w, n->inputs[0])->dims[a], n->dims[a])) n = N(w, n->inputs[0]);
    return n->op == KB_OP_IOTA && n->axis == a && (n->dtype == KB_I64 || n->dtype == KB_I32);
}

typedef struct onehot {
    int32_t t, d;         /* the target index, the value put there */
    double zero;          /* the value elsewhere: 0 or -0 */
} onehot;

/* where(iota_a == T, D, 0) (T on either side of eq), or where(iota_a != T, 0, D). T must be an
 * integer, so that the only coordinate it can equal is itself. */
static int match_onehot(const kb_graph *w, int32_t v, int a, onehot *m)
{
    const kb_node *n = N(w, v);
    if (n->op != KB_OP_WHERE || !kb_dtype_is_float(n->dtype)) return 0;
    const kb_node *c = N(w, n->inputs[0]);
    int hot = c->op == KB_OP_EQ ? 1 : c->op == KB_OP_NE ? 2 : 0;  /* where's operand at T */
    if (!hot) return 0;
    if (is_iota(w, c->inputs[0], a)) m->t = c->inputs[1];
    else if (is_iota(w, c->inputs[1], a)) m->t = c->inputs[0];
    else return 0;
    m->d = n->inputs[hot];
    kb_dtype tt = N(w, m->t)->dtype;
    return (tt == KB_I64 || tt == KB_I32) && along_const(w, m->t, 1u << a) && along_const(w, m->d, 1u << a) &&
           is_zero(w, n->inputs[3 - hot], &m->zero);
}

static int finite_const(const kb_graph *w, int32_t v, int nonzero)
{
    const kb_node *n = N(w, v);
    return n->op == KB_OP_CONST && isfinite(n->scalar[0]) && (!nonzero || n->scalar[0] != 0.0);
}

/* One float map f with f(0) = +-0 exactly, so that f of the one nonzero term summed with zeros
 * is the sum of f of each term, bit for bit: neg, a cast between floats, a product with a
 * finite constant (inf * 0 would be NaN), a quotient by a finite nonzero one. */
typedef struct linear_step {
    kb_node f;            /* a copy: w's node array moves as rules add to it */
    int32_t inner;        /* f's operand on the way to the one-hot */
    int cslot;            /* mul / div: the constant's operand slot */
} linear_step;

static int match_linear(const kb_graph *w, int32_t v, linear_step *s)
{
    const kb_node *n = N(w, v);
    if (!kb_dtype_is_float(n->dtype)) return 0;
    s->f = *n;
    s->inner = n->inputs[0];
    s->cslot = -1;
    switch (n->op) {
    case KB_OP_NEG: return 1;
    case KB_OP_CAST: return kb_dtype_is_float(N(w, s->inner)->dtype);
    case KB_OP_MUL:
        for (int k = 0; k < 2; k++)
            if (finite_const(w, n->inputs[k], 0)) {
                s->cslot = k;
                s->inner = n->inputs[1 - k];
                return 1;
            }
        return 0;
    case KB_OP_DIV: s->cslot = 1; return finite_const(w, n->inputs[1], 1);
    default: return 0;
    }
}

/* The size of a dim as an i64 value of shape kd. A pinned size is a constant; a varying one
 * has no literal, so it is read off an iota over twice the size, at the first coordinate of its
 * second half: views only, which a kernel folds into index arithmetic (no load, no reduction). */
static kb_status size_value(kb_graph *w, kb_dim size, int32_t rank, const kb_dim *kd, int32_t *out)
{
    kb_status st = KB_OK;
    if (size.nsym == 0) return put_const(w, KB_I64, rank, kd, (double)size.coef, out);
    kb_dim two = size, halves[2] = {{2, 0, {0}}, size}, ones[KB_MAX_RANK];
    int32_t v;
    two.coef *= 2;
    for (int d = 0; d < KB_MAX_RANK; d++) ones[d] = (kb_dim){1, 0, {0}};
    kb_node t = tmpl(KB_OP_IOTA, KB_I64, 1, &two);
    KB_TRY(put(w, &t, &v));
    KB_TRY(put_op(w, KB_OP_RESHAPE, KB_I64, 2, halves, v, -1, -1, &v));
    for (int axis = 0; axis < 2; axis++) { /* row 1 of [2, size], then its column 0 */
        halves[axis] = ones[0];
        t = tmpl(KB_OP_SLICE, KB_I64, 2, halves);
        t.inputs[0] = v, t.ninputs = 1, t.axis = axis, t.start = axis == 0;
        KB_TRY(put(w, &t, &v));
    }
    if (rank != 2) KB_TRY(put_op(w, KB_OP_RESHAPE, KB_I64, rank, ones, v, -1, -1, &v));
    if (!has_dims(N(w, v), rank, kd)) KB_TRY(put_op(w, KB_OP_EXPAND, KB_I64, rank, kd, v, -1, -1, &v));
    *out = v;
cleanup:
    return st;
}

/* The axes of s where s is a differentiable sum (over one axis or several: a LayerNorm over the
 * last three dims) of an operand of its own dtype, with the operand's dims kept at size 1 there
 * in kd; else 0. */
static uint32_t sum_axes(const kb_graph *w, const kb_node *s, kb_dim *kd)
{
    if (s->op != KB_OP_SUM || s->nograd || s->axes == 0) return 0;
    const kb_node *x = N(w, s->inputs[0]);
    if (s->dtype != x->dtype || s->axes >> x->rank) return 0;
    for (int k = 0; k < x->rank; k++) kd[k] = s->axes >> k & 1u ? (kb_dim){1, 0, {0}} : x->dims[k];
    return s->axes;
}

/* The axis of s where s is such a sum over one axis (the sums of one-hots below), with kd as
 * sum_axes gives it; else -1. */
static int one_axis_sum(const kb_graph *w, const kb_node *s, kb_dim *kd)
{
    uint32_t axes = sum_axes(w, s, kd);
    return kb_popcount32(axes) == 1 ? __builtin_ctz(axes) : -1;
}

/* s: a node about to be added to w (operands already w's). *out = its replacement, or -1 when
 * s is not a sum over one axis of a linear map of a one-hot. */
static kb_status onehot_sum(kb_graph *w, const kb_node *s, int32_t *out)
{
    kb_status st = KB_OK;
    kb_dim kd[KB_MAX_RANK];
    *out = -1;
    int a = one_axis_sum(w, s, kd);
    if (a < 0) return KB_OK;
    const kb_node *x = N(w, s->inputs[0]);
    linear_step steps[MAX_LINEAR_STEPS];
    int32_t nsteps = 0, v = s->inputs[0];
    while (nsteps < MAX_LINEAR_STEPS && match_linear(w, v, &steps[nsteps])) v = steps[nsteps++].inner;
    onehot m;
    if (!match_onehot(w, v, a, &m)) return KB_OK;

    int32_t rank = x->rank, t, zero, lo, n, hi, in, d, r;
    kb_dim size = x->dims[a];  /* x and other node pointers die at the first put */
    kb_dtype wdt = N(w, v)->dtype;
    /* in range: 0 <= T < size, compared in i64 */
    KB_TRY(keep_along(w, m.t, rank, kd, &t));
    if (N(w, t)->dtype != KB_I64) KB_TRY(put_op(w, KB_OP_CAST, KB_I64, rank, kd, t, -1, -1, &t));
    KB_TRY(put_const(w, KB_I64, rank, kd, 0.0, &zero));
    KB_TRY(put_op(w, KB_OP_GE, KB_BOOL, rank, kd, t, zero, -1, &lo));
    KB_TRY(size_value(w, size, rank, kd, &n));
    KB_TRY(put_op(w, KB_OP_LT, KB_BOOL, rank, kd, t, n, -1, &hi));
    KB_TRY(put_op(w, KB_OP_AND, KB_BOOL, rank, kd, lo, hi, -1, &in));
    KB_TRY(keep_along(w, m.d, rank, kd, &d));
    KB_TRY(put_const(w, wdt, rank, kd, m.zero, &zero));
    KB_TRY(put_op(w, KB_OP_WHERE, wdt, rank, kd, in, d, zero, &r));
    /* the linear maps, innermost first, now per row */
    for (int32_t k = nsteps - 1; k >= 0; k--) {
        const kb_node *f = &steps[k].f;
        int32_t ops[2] = {r, -1}, ck = steps[k].cslot;
        if (ck >= 0) {
            kb_node c = *N(w, f->inputs[ck]);
            KB_TRY(put_const(w, c.dtype, rank, kd, c.scalar[0], &ops[ck]));
            ops[1 - ck] = r;
        }
        KB_TRY(put_op(w, f->op, f->dtype, rank, kd, ops[0], ops[1], -1, &r));
    }
    if (s->rank != rank) KB_TRY(put_op(w, KB_OP_RESHAPE, s->dtype, s->rank, s->dims, r, -1, -1, &r));
    *out = r;
cleanup:
    return st;
}

/* ---------------------------------------------------------------- deviations from a mean */

/* sum_a(x - mean_a(x)) is 0: deviations from a row's mean add up to nothing (a computed sum of
 * them holds only rounding). LayerNorm's backward has k * sum(x - mean), the variance's adjoint
 * through the mean: as a sum it is a third row reduction (an add per element and a shuffle chain
 * per row); torch's LayerNorm backward has no such term. A mean is a MEAN node, or a value the
 * caller knows to hold one (grad/grad.c: a statistic the forward saved is an input of the backward). */
typedef struct known_means {
    const kb_mean_fact *facts;   /* in the caller's graph's ids */
    int nfacts;
    const int32_t *map;          /* the caller's ids -> the graph being rebuilt's (-1: not yet) */
} known_means;

/* Is m (size 1 along the axes) the mean of x along those axes, and only those? */
static int is_mean_of(const kb_graph *w, const known_means *km, int32_t m, int32_t x, uint32_t axes)
{
    const kb_node *mn = N(w, m);
    if (mn->op == KB_OP_MEAN) return mn->inputs[0] == x && mn->axes == axes;
    for (int i = 0; km && i < km->nfacts; i++) {
        const kb_mean_fact *f = &km->facts[i];
        if (f->axes == axes && km->map[f->value] == m && km->map[f->of] == x) return 1;
    }
    return 0;
}

/* Is v = x - expand(mean_axes(x)), x full along the axes? */
static int deviation_from_mean(const kb_graph *w, const known_means *km, int32_t v, uint32_t axes)
{
    const kb_node *n = N(w, v);
    if (n->op != KB_OP_SUB) return 0;
    const kb_node *x = N(w, n->inputs[0]), *e = N(w, n->inputs[1]);
    if (e->op != KB_OP_EXPAND || !has_dims(x, n->rank, n->dims)) return 0;
    int32_t m = e->inputs[0];
    const kb_node *mn = N(w, m);
    if (mn->rank != n->rank || !ones_on(mn, axes) || mn->dtype != x->dtype) return 0;
    return is_mean_of(w, km, m, n->inputs[0], axes);
}

/* ---------------------------------------------------------------- sums of row-constant multiples */

/* sum_a(c * X + d * Y ...) with c, d the same all along a is c * sum_a(X) + d * sum_a(Y): the
 * sum no longer waits for c and d. LayerNorm's backward has sum_a(-(g * rstd + 2 * k * xc))
 * with k from the sum before it: as written it is a third reduction pass over every row; split,
 * sum(g) and sum(xc) join the passes of the mean and the variance (one barrier fewer per row,
 * no third pass). Rewritten only where that lowers the nesting of reductions or drops a
 * deviation from a mean (above), since it changes rounding (by a few ulps: products by a per-row
 * value, sums regrouped). */

#define MAX_TERMS 6
#define MAX_FACTORS 4

typedef struct lin_term {
    int32_t atom;                /* the part summed along a */
    int32_t fac[MAX_FACTORS];    /* per-row multipliers (divisors where div[i]) */
    uint8_t div[MAX_FACTORS];
    int nfac;
    double k;                    /* a count: +-1, or 2 where a term appears twice */
} lin_term;

typedef struct lin_sum {
    const kb_graph *w;
    const known_means *means;
    uint32_t axes;               /* the summed axes */
    kb_dtype dt;
    lin_term t[MAX_TERMS];
    int n;
    int zeros;                   /* terms dropped as sums of deviations from a mean */
} lin_sum;

static int same_factors(const lin_term *x, const lin_term *y)
{
    if (x->atom != y->atom || x->nfac != y->nfac) return 0;
    for (int i = 0; i < x->nfac; i++)
        if (x->fac[i] != y->fac[i] || x->div[i] != y->div[i]) return 0;
    return 1;
}

/* v * sign * (the product cur) as terms of L; 0 where v is not such a sum (too many terms). */
static int decompose(lin_sum *L, int32_t v, double sign, const lin_term *cur, int depth)
{
    const kb_node *n = N(L->w, v);
    lin_term t = *cur;
    if (along_const(L->w, v, L->axes)) return 0; /* a per-row term: left as it is */
    if (n->dtype != L->dt || depth == 0) goto atom;
    switch (n->op) {
    case KB_OP_NEG: return decompose(L, n->inputs[0], -sign, cur, depth - 1);
    case KB_OP_ADD:
    case KB_OP_SUB:
        /* x - mean stays whole: sum(x) - n * mean would cancel where |mean| >> the spread */
        if (along_const(L->w, n->inputs[0], L->axes) || along_const(L->w, n->inputs[1], L->axes)) goto atom;
        return decompose(L, n->inputs[0], sign, cur, depth - 1) &&
               decompose(L, n->inputs[1], n->op == KB_OP_SUB ? -sign : sign, cur, depth - 1);
    case KB_OP_MUL:
    case KB_OP_DIV:
        for (int k = n->op == KB_OP_DIV; k < 2; k++) { /* a per-row operand (the divisor only) */
            if (!along_const(L->w, n->inputs[k], L->axes)) continue;
            if (t.nfac == MAX_FACTORS) return 0;
            t.fac[t.nfac] = n->inputs[k], t.div[t.nfac++] = n->op == KB_OP_DIV;
            return decompose(L, n->inputs[1 - k], sign, &t, depth - 1);
        }
        break;
    default: break;
    }
atom:
    if (deviation_from_mean(L->w, L->means, v, L->axes)) { /* its sum is 0 */
        L->zeros++;
        return 1;
    }
    t.atom = v;
    t.k = sign;
    for (int i = 0; i < L->n; i++)
        if (same_factors(&L->t[i], &t)) {
            L->t[i].k += sign;
            return 1;
        }
    if (L->n == MAX_TERMS) return 0;
    L->t[L->n++] = t;
    return 1;
}

/* How deeply reductions nest under v (a reduction of a reduction's result is 2), in w. */
static kb_status reduce_depth(const kb_graph *w, const int32_t *vs, int nv, int *out)
{
    kb_ctx *ctx = kb_graph_ctx(w);
    int32_t n = kb_graph_nnodes(w);
    size_t cnt = n > 0 ? (size_t)n : 1;
    int *d = kb_calloc(ctx, cnt, sizeof(int));
    if (!d) return KB_FAIL(ctx, KB_ERR_OOM, "simplify: out of memory for %d nodes", (int)n);
    for (int32_t v = 0; v < n; v++) { /* operands come first in id order */
        const kb_node *nd = N(w, v);
        for (int i = 0; i < nd->ninputs; i++)
            if (d[nd->inputs[i]] > d[v]) d[v] = d[nd->inputs[i]];
        if (kb_op_get(nd->op)->kind == KB_KIND_REDUCE) d[v]++;
    }
    *out = 0;
    for (int i = 0; i < nv; i++)
        if (vs[i] >= 0 && d[vs[i]] > *out) *out = d[vs[i]];
    kb_free(ctx, d, cnt * sizeof(int));
    return KB_OK;
}

/* s: a node about to be added to w. *out = c * sum(X) + ..., or -1 where that does not lower
 * the reduction's nesting. */
static kb_status linear_sum(kb_graph *w, const known_means *km, const kb_node *s, int32_t *out)
{
    kb_status st = KB_OK;
    kb_dim kd[KB_MAX_RANK];
    *out = -1;
    uint32_t axes = sum_axes(w, s, kd);
    if (!axes) return KB_OK;
    const kb_node *x = N(w, s->inputs[0]);
    if (!kb_dtype_is_float(x->dtype)) return KB_OK;
    lin_sum L = {w, km, axes, x->dtype, {{0}}, 0, 0};
    lin_term one = {-1, {0}, {0}, 0, 1.0};  /* the empty product */
    if (!decompose(&L, s->inputs[0], 1.0, &one, MAX_LINEAR_STEPS)) return KB_OK;
    int32_t atoms[MAX_TERMS];
    int natoms = 0, before, after;
    for (int i = 0; i < L.n; i++) {
        int seen = 0;
        for (int j = 0; j < natoms; j++) seen |= atoms[j] == L.t[i].atom;
        if (!seen) atoms[natoms++] = L.t[i].atom;
    }
    if ((natoms == 0 && !L.zeros) || natoms > 3) return KB_OK;
    KB_TRY(reduce_depth(w, &s->inputs[0], 1, &before));
    KB_TRY(reduce_depth(w, atoms, natoms, &after));
    if (after >= before && !L.zeros) return KB_OK; /* the sum would wait as long as before */

    int32_t rank = x->rank, r = -1;
    kb_dtype dt = x->dtype;  /* x dies at the first put */
    int32_t sums[MAX_TERMS];
    for (int j = 0; j < natoms; j++) { /* one sum per atom, whatever multiplies it */
        kb_node sum = tmpl(KB_OP_SUM, dt, rank, kd);
        sum.inputs[0] = atoms[j], sum.ninputs = 1, sum.axes = s->axes;
        KB_TRY(kb_graph_add(w, &sum, &sums[j]));
    }
    for (int i = 0; i < L.n; i++) {
        const lin_term *t = &L.t[i];
        int32_t term = -1;
        if (t->k == 0.0) continue;
        for (int j = 0; j < natoms; j++)
            if (atoms[j] == t->atom) term = sums[j];
        for (int f = 0; f < t->nfac; f++) {
            int32_t c;
            KB_TRY(keep_along(w, t->fac[f], rank, kd, &c));
            KB_TRY(put_op(w, t->div[f] ? KB_OP_DIV : KB_OP_MUL, dt, rank, kd, term, c, -1, &term));
        }
        if (t->k != 1.0 && t->k != -1.0) {
            int32_t c;
            KB_TRY(put_const(w, dt, rank, kd, fabs(t->k), &c));
            KB_TRY(put_op(w, KB_OP_MUL, dt, rank, kd, term, c, -1, &term));
        }
        if (r < 0) {
            r = term;
            if (t->k < 0) KB_TRY(put_op(w, KB_OP_NEG, dt, rank, kd, r, -1, -1, &r));
        } else {
            KB_TRY(put_op(w, t->k < 0 ? KB_OP_SUB : KB_OP_ADD, dt, rank, kd, r, term, -1, &r));
        }
    }
    if (r < 0) KB_TRY(put_const(w, dt, rank, kd, 0.0, &r));
    if (s->rank != rank) KB_TRY(put_op(w, KB_OP_RESHAPE, s->dtype, s->rank, s->dims, r, -1, -1, &r));
    *out = r;
cleanup:
    return st;
}

/* ---------------------------------------------------------------- a softmax through its log */

/* The node of w that is op of (x) or (x, y) with the shape of `like`, or -1. */
static int32_t find_node(const kb_graph *w, kb_op op, int32_t x, int32_t y, const kb_node *like)
{
    for (int32_t v = kb_graph_nnodes(w) - 1; v >= 0; v--) {
        const kb_node *n = N(w, v);
        if (n->op == op && n->ninputs == (y < 0 ? 1 : 2) && n->inputs[0] == x && (y < 0 || n->inputs[1] == y) &&
            n->dtype == like->dtype && has_dims(n, like->rank, like->dims))
            return v;
    }
    return -1;
}

/* exp(a) * expand(k / s), where w also has y = a - expand(log s), is expand(k) * exp(y): the
 * same value, e^a / s = e^(a - log s). A log_softmax's backward has the first (log s's adjoint
 * reaching the row through the exponentials); its forward output is y, so written the second way
 * the backward can read that output alone, as eager's does, where it is at hand (grad/grad.c's
 * reused outputs), instead of the row and its statistics. */
static kb_status exp_over_sum(kb_graph *w, const kb_node *t, int32_t *out)
{
    kb_status st = KB_OK;
    *out = -1;
    for (int side = 0; side < 2 && t->ninputs == 2; side++) {
        const kb_node *e = N(w, t->inputs[side]), *x = N(w, t->inputs[1 - side]);
        if (e->op != KB_OP_EXP || x->op != KB_OP_EXPAND || e->dtype != t->dtype || x->dtype != t->dtype) continue;
        const kb_node *d = N(w, x->inputs[0]);
        if (d->op != KB_OP_DIV) continue;
        int32_t a = e->inputs[0], k = d->inputs[0], s = d->inputs[1];
        int32_t lg = find_node(w, KB_OP_LOG, s, -1, N(w, s));
        int32_t wide = lg < 0 ? -1 : find_node(w, KB_OP_EXPAND, lg, -1, N(w, a));
        int32_t y = wide < 0 ? -1 : find_node(w, KB_OP_SUB, a, wide, N(w, a));
        if (y < 0) continue;
        int32_t ey = find_node(w, KB_OP_EXP, y, -1, t), ek;
        if (ey < 0) KB_TRY(put_op(w, KB_OP_EXP, t->dtype, t->rank, t->dims, y, -1, -1, &ey));
        KB_TRY(put_op(w, KB_OP_EXPAND, t->dtype, t->rank, t->dims, k, -1, -1, &ek));
        KB_TRY(put_op(w, KB_OP_MUL, t->dtype, t->rank, t->dims, ek, ey, -1, out));
        return KB_OK;
    }
cleanup:
    return st;
}

/* ---------------------------------------------------------------- rebuilding */

/* Rebuilds w keeping the nodes its outputs depend on: every INPUT first, in input order (so
 * the input list stays as specified even where one is unused), then the rest in id order. */
static kb_status prune(const kb_graph *w, kb_graph **out)
{
    kb_status st = KB_OK;
    kb_ctx *ctx = kb_graph_ctx(w);
    int32_t n = kb_graph_nnodes(w), nlive = 0;
    size_t cnt = n > 0 ? (size_t)n : 1;
    uint8_t *live = kb_calloc(ctx, cnt, 1);
    int32_t *order = kb_malloc(ctx, cnt * sizeof(int32_t));
    KB_CHECK(ctx, live && order, KB_ERR_OOM, "simplify: out of memory pruning %d nodes", (int)n);
    for (int32_t j = 0; j < kb_graph_noutputs(w); j++) live[kb_graph_output(w, j)] = 1;
    for (int32_t v = n - 1; v >= 0; v--) {
        const kb_node *nd = N(w, v);
        if (live[v])
            for (int i = 0; i < nd->ninputs; i++) live[nd->inputs[i]] = 1;
    }
    for (int32_t v = 0; v < n; v++)
        if (live[v] && N(w, v)->op != KB_OP_INPUT) order[nlive++] = v;
    st = kb_graph_rebuild(w, order, nlive, out);
cleanup:
    kb_free(ctx, live, cnt);
    kb_free(ctx, order, cnt * sizeof(int32_t));
    return st;
}

kb_status kb_graph_simplify(const kb_graph *g, kb_graph **out) { return kb_graph_simplify_means(g, NULL, 0, 0, out); }

kb_status kb_graph_simplify_means(const kb_graph *g, const kb_mean_fact *means, int nmeans, int toward_forward,
                                  kb_graph **out)
{
    if (!out) return KB_ERR_INVALID;
    *out = NULL;
    if (!g) return KB_ERR_INVALID;
    kb_status st = KB_OK;
    kb_ctx *ctx = kb_graph_ctx(g);
    int32_t n = kb_graph_nnodes(g);
    size_t cnt = n > 0 ? (size_t)n : 1;
    kb_graph *w = NULL;
    int32_t *map = kb_malloc(ctx, cnt * sizeof(int32_t));
    KB_CHECK(ctx, map != NULL, KB_ERR_OOM, "simplify: out of memory for %d nodes", (int)n);
    for (int32_t v = 0; v < n; v++) map[v] = -1;
    for (int i = 0; i < nmeans; i++)
        KB_CHECK(ctx, means[i].value >= 0 && means[i].value < n && means[i].of >= 0 && means[i].of < n,
                 KB_ERR_INVALID, "simplify: mean fact %d names a node outside the graph", i);
    known_means km = {means, nmeans, map};
    KB_TRY(kb_graph_new(ctx, &w));
    KB_TRY(kb_graph_copy_symbols(g, w));
    /* in id order, so the inputs keep theirs; a rule's replacement stands for the node */
    for (int32_t v = 0; v < n; v++) {
        kb_node t = *N(g, v);
        int32_t r = -1;
        for (int i = 0; i < t.ninputs; i++) t.inputs[i] = map[t.inputs[i]];
        if (t.op == KB_OP_SUM) KB_TRY(onehot_sum(w, &t, &r));
        if (t.op == KB_OP_SUM && r < 0) KB_TRY(linear_sum(w, &km, &t, &r));
        if (t.op == KB_OP_MUL && toward_forward) KB_TRY(exp_over_sum(w, &t, &r));
        if (r < 0) KB_TRY(kb_graph_add(w, &t, &r));
        map[v] = r;
    }
    for (int32_t j = 0; j < kb_graph_noutputs(g); j++) KB_TRY(kb_graph_add_output(w, map[kb_graph_output(g, j)]));
    KB_TRY(prune(w, out));
cleanup:
    kb_free(ctx, map, cnt * sizeof(int32_t));
    kb_graph_free(w);
    return st;
}
