/* grad.c — reverse-mode autodiff on the IR (kb_graph_grad). Pointwise derivatives are read from
 * ops.def's d/da d/db d/dc strings (the rule language of grad_build.c); reductions and index maps
 * have one builder each (a table). */
#include "grad/grad_build.h"

#include <math.h>
#include <stdlib.h>

/* ---------------------------------------------------------------- autodiff */

typedef struct gradctx {
    gb_builder b;
    const kb_graph *fg;   /* the forward graph */
    int32_t *map;         /* forward id -> work id */
    int32_t *adj;         /* forward id -> work id of its accumulated adjoint, -1 = none yet */
    uint8_t *req;         /* forward id -> a wrt input reaches it through differentiable edges */
    /* slice adjoints not yet added to their operand's adjoint (see rule_pad_slice) */
    struct pending_slice *pend;
    int32_t npend, cappend;
    int32_t *pend_head;   /* forward id -> its first pending slice adjoint, -1 = none */
} gradctx;

/* The adjoint g of a slice (step 1, pinned length) of a value, kept until every adjoint of the
 * value is in: then slices that tile an axis (a chunk, a split) become one select on the
 * coordinate instead of a sum of zero-padded copies of each g. */
typedef struct pending_slice {
    int32_t next;         /* the value's next pending slice adjoint, -1 */
    int32_t g;            /* the slice's adjoint (work id) */
    int32_t axis;
    int64_t start, len;
} pending_slice;

/* The operand's dims with the reduced axes set to 1: a reduction's keepdim shape. */
static void keepdim_dims(const kb_node *a, uint32_t axes, kb_dim *out)
{
    for (int d = 0; d < a->rank; d++) {
        if (axes >> d & 1u) out[d] = (kb_dim){1, 0, {0}};
        else out[d] = a->dims[d];
    }
}

/* x (a reduction's output shape, keepdim or not) reshaped to keepdim, then broadcast to a's. */
static kb_status expand_back(gb_builder *b, int32_t x, const kb_node *a, uint32_t axes, int32_t *out)
{
    kb_status st = KB_OK;
    kb_dim kd[KB_MAX_RANK];
    int32_t k;
    keepdim_dims(a, axes, kd);
    KB_TRY(gb_shaped(b, KB_OP_RESHAPE, x, a->rank, kd, 0, NULL, &k));
    KB_TRY(gb_shaped(b, KB_OP_EXPAND, k, a->rank, a->dims, 0, NULL, out));
cleanup:
    return st;
}

/* A non-pointwise rule: node v (nd) with operand a, its adjoint gadj; out = a's contribution. */
typedef kb_status (*struct_rule)(gradctx *gc, int32_t v, const kb_node *nd, const kb_node *a, int32_t gadj,
                                int32_t *out);

/* SUM: every element of the reduced block receives g. */
static kb_status rule_expand(gradctx *gc, int32_t v, const kb_node *nd, const kb_node *a, int32_t gadj, int32_t *out)
{
    (void)v;
    return expand_back(&gc->b, gadj, a, nd->axes, out);
}

/* MEAN: expand(g) / N, N the reduced element count. Pinned dims give N as a literal; a symbol
 * among them gives N = sum of a CONST 1 over just the reduced dims, so it is right for every
 * bound value (a fused kernel folds it: it reads nothing). */
static kb_status rule_expand_mean(gradctx *gc, int32_t v, const kb_node *nd, const kb_node *a, int32_t gadj, int32_t *out)
{
    kb_status st = KB_OK;
    gb_builder *b = &gc->b;
    kb_dtype dt = gb_node(b, gadj)->dtype;
    int32_t e, n;
    (void)v;
    int pinned = 1;
    double count = 1;
    KB_TRY(expand_back(b, gadj, a, nd->axes, &e));
    for (int d = 0; d < a->rank; d++)
        if (nd->axes >> d & 1u) {
            pinned &= a->dims[d].nsym == 0;
            count *= (double)a->dims[d].coef;
        }
    if (pinned) {
        KB_TRY(gb_const(b, dt, a->rank, a->dims, count, &n));
    } else {
        kb_dim only[KB_MAX_RANK], ones[KB_MAX_RANK];
        int32_t c, s;
        for (int d = 0; d < a->rank; d++) {
            ones[d] = (kb_dim){1, 0, {0}};
            only[d] = (nd->axes >> d & 1u) ? a->dims[d] : ones[d];
        }
        KB_TRY(gb_const(b, dt, a->rank, only, 1.0, &c));
        KB_TRY(gb_shaped(b, KB_OP_SUM, c, a->rank, ones, nd->axes, NULL, &s));
        KB_TRY(gb_shaped(b, KB_OP_EXPAND, s, a->rank, a->dims, 0, NULL, &n));
    }
    KB_TRY(gb_bin(b, KB_OP_DIV, dt, e, n, out));
cleanup:
    return st;
}

/* RMAX / RMIN, as torch.amax / amin: g split evenly among the positions equal to the result,
 * (g / count(a == y)) * (a == y). */
static kb_status rule_expand_argext(gradctx *gc, int32_t v, const kb_node *nd, const kb_node *a, int32_t gadj, int32_t *out)
{
    kb_status st = KB_OK;
    gb_builder *b = &gc->b;
    kb_dtype dt = gb_node(b, gadj)->dtype;
    kb_dim kd[KB_MAX_RANK];
    int32_t ye, eq, mask, cnt, gk, q, qe;
    int32_t av = gc->map[nd->inputs[0]], yv = gc->map[v];
    keepdim_dims(a, nd->axes, kd);
    KB_TRY(expand_back(b, yv, a, nd->axes, &ye));
    KB_TRY(gb_bin(b, KB_OP_EQ, gb_node(b, av)->dtype, av, ye, &eq));
    KB_TRY(gb_cast(b, eq, dt, &mask));
    KB_TRY(gb_shaped(b, KB_OP_SUM, mask, a->rank, kd, nd->axes, NULL, &cnt));
    KB_TRY(gb_shaped(b, KB_OP_RESHAPE, gadj, a->rank, kd, 0, NULL, &gk));
    KB_TRY(gb_bin(b, KB_OP_DIV, dt, gk, cnt, &q));
    KB_TRY(gb_shaped(b, KB_OP_EXPAND, q, a->rank, a->dims, 0, NULL, &qe));
    KB_TRY(gb_bin(b, KB_OP_MUL, dt, qe, mask, out));
cleanup:
    return st;
}

static kb_status rule_reshape(gradctx *gc, int32_t v, const kb_node *nd, const kb_node *a, int32_t gadj, int32_t *out)
{
    (void)v, (void)nd;
    return gb_shaped(&gc->b, KB_OP_RESHAPE, gadj, a->rank, a->dims, 0, NULL, out);
}

static kb_status rule_permute_inv(gradctx *gc, int32_t v, const kb_node *nd, const kb_node *a, int32_t gadj, int32_t *out)
{
    int8_t inv[KB_MAX_RANK];
    (void)v;
    for (int d = 0; d < nd->rank; d++) inv[nd->perm[d]] = (int8_t)d;
    return gb_shaped(&gc->b, KB_OP_PERMUTE, gadj, a->rank, a->dims, 0, inv, out);
}

/* EXPAND: sum g over the dims that grew, keeping them (size 1, the operand's shape). */
static kb_status rule_sum_to(gradctx *gc, int32_t v, const kb_node *nd, const kb_node *a, int32_t gadj, int32_t *out)
{
    uint32_t axes = 0;
    (void)v;
    for (int d = 0; d < a->rank; d++)
        if (!kb_dim_equal(a->dims[d], nd->dims[d])) axes |= 1u << d;
    if (!axes) {
        *out = gadj;
        return KB_OK;
    }
    return gb_shaped(&gc->b, KB_OP_SUM, gadj, a->rank, a->dims, axes, NULL, out);
}

static kb_status unsupported(gradctx *gc, int32_t v, const kb_node *nd, const char *why)
{
    return KB_FAIL(gc->b.ctx, KB_ERR_UNSUPPORTED, "grad: the gradient of %s (node %d) %s",
                   kb_op_get(nd->op)->name, (int)v, why);
}

static kb_status emit_iota(gb_builder *b, kb_dtype dt, const kb_node *shape, int32_t axis, int32_t *id)
{
    kb_node n = gb_tmpl(KB_OP_IOTA, dt, shape->rank, shape->dims);
    n.axis = axis;
    return gb_emit(b, &n, id);
}

/* GATHER with one index per row along its axis (cross-entropy's pick of the target's logit):
 * the adjoint puts g where the coordinate equals the index, where(iota == index, g, 0), a
 * pointwise mask that fuses into the backward's row kernel. Other gathers need a scatter. */
static kb_status rule_scatter_add(gradctx *gc, int32_t v, const kb_node *nd, const kb_node *a, int32_t gadj, int32_t *out)
{
    kb_status st = KB_OK;
    gb_builder *b = &gc->b;
    const kb_node *ix = kb_graph_node(gc->fg, nd->inputs[1]);
    int one = ix->dims[nd->axis].nsym == 0 && ix->dims[nd->axis].coef == 1;
    for (int d = 0; d < a->rank && one; d++) one = d == nd->axis || kb_dim_equal(ix->dims[d], a->dims[d]);
    if (!one) return unsupported(gc, v, nd, "needs a scatter (more than one index per row)");
    kb_dtype dt = gb_node(b, gadj)->dtype;
    int32_t ge, ie, io, mask, zero;
    int32_t args[3];
    KB_TRY(gb_shaped(b, KB_OP_EXPAND, gadj, a->rank, a->dims, 0, NULL, &ge));
    KB_TRY(gb_shaped(b, KB_OP_EXPAND, gc->map[nd->inputs[1]], a->rank, a->dims, 0, NULL, &ie));
    KB_TRY(emit_iota(b, ix->dtype, a, nd->axis, &io));
    KB_TRY(gb_bin(b, KB_OP_EQ, ix->dtype, io, ie, &mask));
    KB_TRY(gb_const(b, dt, a->rank, a->dims, 0.0, &zero));
    args[0] = mask, args[1] = ge, args[2] = zero;
    KB_TRY(gb_pw(b, KB_OP_WHERE, dt, args, 3, out));
cleanup:
    return st;
}

/* The slice [start, start + len) of a's axis, read back at a's coordinates: g at the coordinate
 * minus start, clamped into the slice so that every read is in range wherever the coordinate
 * lies (a select picks the positions where it is meant). end_is_edge: the slice ends at the
 * axis' end, so no coordinate lies past it. */
static kb_status emit_slice_read(gb_builder *b, const kb_node *a, const pending_slice *s, int32_t io, int end_is_edge,
                                 int32_t *out)
{
    kb_status st = KB_OK;
    int32_t idx = io, c, g;
    if (s->start > 0) {
        KB_TRY(gb_const(b, KB_I64, a->rank, a->dims, (double)s->start, &c));
        KB_TRY(gb_bin(b, KB_OP_SUB, KB_I64, idx, c, &idx));
        KB_TRY(gb_const(b, KB_I64, a->rank, a->dims, 0.0, &c));
        KB_TRY(gb_bin(b, KB_OP_MAX, KB_I64, idx, c, &idx));
    }
    if (!end_is_edge) {
        KB_TRY(gb_const(b, KB_I64, a->rank, a->dims, (double)(s->len - 1), &c));
        KB_TRY(gb_bin(b, KB_OP_MIN, KB_I64, idx, c, &idx));
    }
    KB_TRY(gb_cast(b, s->g, a->dtype, &g));
    kb_node gt = gb_tmpl(KB_OP_GATHER, a->dtype, a->rank, a->dims);
    gt.inputs[0] = g, gt.inputs[1] = idx, gt.ninputs = 2, gt.axis = s->axis;
    KB_TRY(gb_emit(b, &gt, out));
cleanup:
    return st;
}

/* The adjoint of a from n disjoint slices along one axis, sorted by start: one select on the
 * coordinate, where(in_0, g_0[..], where(in_1, g_1[..], ... 0)), so that a pointwise kernel
 * computes each element of a's adjoint from the one slice covering it. A test is left out where
 * the earlier branches settle it: slices tiling [0, end) need only "iota < end", and when they
 * tile the whole axis the last one needs no test and no zero (x.chunk(2) gives
 * where(iota < H, g_0[iota], g_1[iota - H])). */
static kb_status emit_select(gb_builder *b, const kb_node *a, const pending_slice *s, int n, int32_t *out)
{
    kb_status st = KB_OK;
    int32_t axis = s[0].axis, io, acc = -1;
    kb_dim size = a->dims[axis];
    int64_t tiled_to = 0;  /* [0, tiled_to) is covered by the slices before the current one */
    int covered[KB_MAX_INPUTS];
    KB_CHECK(b->ctx, n >= 1 && n <= KB_MAX_INPUTS, KB_ERR_INVALID, "grad: select over %d slices", n);
    for (int i = 0; i < n; i++) {
        covered[i] = tiled_to == s[i].start;
        if (covered[i]) tiled_to = s[i].start + s[i].len;
    }
    KB_TRY(emit_iota(b, KB_I64, a, axis, &io));
    for (int i = n - 1; i >= 0; i--) {
        int64_t end = s[i].start + s[i].len;
        int at_edge = size.nsym == 0 && end == size.coef;
        int32_t gi, cond = -1, c, args[3];
        KB_TRY(emit_slice_read(b, a, &s[i], io, at_edge, &gi));
        if (acc < 0) {
            if (covered[i] && at_edge) { /* the slices tile the axis: the rest is this one */
                acc = gi;
                continue;
            }
            KB_TRY(gb_const(b, a->dtype, a->rank, a->dims, 0.0, &acc));
        }
        if (!covered[i]) {
            KB_TRY(gb_const(b, KB_I64, a->rank, a->dims, (double)s[i].start, &c));
            KB_TRY(gb_bin(b, KB_OP_GE, KB_I64, io, c, &cond));
        }
        if (!at_edge) {
            int32_t hi;
            KB_TRY(gb_const(b, KB_I64, a->rank, a->dims, (double)end, &c));
            KB_TRY(gb_bin(b, KB_OP_LT, KB_I64, io, c, &hi));
            if (cond < 0) cond = hi;
            else KB_TRY(gb_bin(b, KB_OP_AND, KB_I64, cond, hi, &cond));
        }
        if (cond < 0) { /* a slice that is the whole axis */
            acc = gi;
            continue;
        }
        args[0] = cond, args[1] = gi, args[2] = acc;
        KB_TRY(gb_pw(b, KB_OP_WHERE, a->dtype, args, 3, &acc));
    }
    *out = acc;
cleanup:
    return st;
}

/* SLICE with step 1 and a pinned length (a chunk, a split half): the adjoint is g at the
 * coordinate minus start inside the slice and 0 elsewhere. It is deferred (*out = -1): the
 * operand's other slices may tile the axis with it, and flush_slices() then emits one select
 * for all of them. */
static kb_status rule_pad_slice(gradctx *gc, int32_t v, const kb_node *nd, const kb_node *a, int32_t gadj, int32_t *out)
{
    kb_dim len = nd->dims[nd->axis];
    (void)a;
    if (nd->step != 1 || len.nsym != 0 || len.coef < 1)
        return unsupported(gc, v, nd, "needs a scatter (a strided or varying-length slice)");
    if (gc->npend == gc->cappend) {
        int32_t ncap = gc->cappend ? gc->cappend * 2 : 16;
        pending_slice *p = kb_realloc(gc->b.ctx, gc->pend, sizeof *p * (size_t)gc->cappend, sizeof *p * (size_t)ncap);
        if (!p) return KB_FAIL(gc->b.ctx, KB_ERR_OOM, "grad: out of memory for slice adjoints");
        gc->pend = p;
        gc->cappend = ncap;
    }
    int32_t u = nd->inputs[0], k = gc->npend++;
    gc->pend[k] = (pending_slice){gc->pend_head[u], gadj, nd->axis, nd->start, len.coef};
    gc->pend_head[u] = k;
    *out = -1;
    return KB_OK;
}

/* x with its last two dims swapped: a transposed operand is a PERMUTE view, as in the forward. */
static kb_status transpose_last(gb_builder *b, int32_t x, int32_t *out)
{
    const kb_node *nx = gb_node(b, x);
    int r = nx->rank;
    int8_t perm[KB_MAX_RANK];
    kb_dim dims[KB_MAX_RANK];
    for (int d = 0; d < r; d++) perm[d] = (int8_t)d, dims[d] = nx->dims[d];
    perm[r - 2] = (int8_t)(r - 1), perm[r - 1] = (int8_t)(r - 2);
    dims[r - 2] = nx->dims[r - 1], dims[r - 1] = nx->dims[r - 2];
    return gb_shaped(b, KB_OP_PERMUTE, x, r, dims, 0, perm, out);
}

/* x . y as a MATMUL of dtype dt, x cast to y's dtype first (the upstream gradient of a product
 * whose output dtype is not its operands'). */
static kb_status emit_matmul(gb_builder *b, int32_t x, int32_t y, kb_dtype dt, int32_t *out)
{
    kb_status st = KB_OK;
    int32_t xc;
    KB_TRY(gb_cast(b, x, gb_node(b, y)->dtype, &xc));
    const kb_node *nx = gb_node(b, xc), *ny = gb_node(b, y);
    kb_node t = gb_tmpl(KB_OP_MATMUL, dt, nx->rank, nx->dims);
    t.dims[nx->rank - 1] = ny->dims[ny->rank - 1];
    t.inputs[0] = xc;
    t.inputs[1] = y;
    t.ninputs = 2;
    KB_TRY(gb_emit(b, &t, out));
cleanup:
    return st;
}

/* MATMUL, y = a . b: dA = g . b^T and dB = a^T . g, each in its operand's dtype (rounded once, as
 * torch's backward GEMMs are). A batch dim an operand was broadcast along is an EXPAND before the
 * MATMUL, whose own rule (sum_to) sums it back. */
static kb_status rule_matmul_da(gradctx *gc, int32_t v, const kb_node *nd, const kb_node *a, int32_t gadj, int32_t *out)
{
    kb_status st = KB_OK;
    int32_t bt;
    (void)v;
    KB_TRY(transpose_last(&gc->b, gc->map[nd->inputs[1]], &bt));
    KB_TRY(emit_matmul(&gc->b, gadj, bt, a->dtype, out));
cleanup:
    return st;
}

static kb_status rule_matmul_db(gradctx *gc, int32_t v, const kb_node *nd, const kb_node *a, int32_t gadj, int32_t *out)
{
    kb_status st = KB_OK;
    int32_t at, gc_;
    (void)v;
    KB_TRY(transpose_last(&gc->b, gc->map[nd->inputs[0]], &at));
    KB_TRY(gb_cast(&gc->b, gadj, gb_node(&gc->b, at)->dtype, &gc_));
    KB_TRY(emit_matmul(&gc->b, at, gc_, a->dtype, out));
cleanup:
    return st;
}

/* The non-pointwise rule names of ops.def, each with its builder. */
static const struct { const char *name; struct_rule fn; } struct_rules[] = {
    {"expand(g)", rule_expand},           {"expand_mean(g)", rule_expand_mean},
    {"expand_argext(g)", rule_expand_argext}, {"reshape(g)", rule_reshape},
    {"permute_inv(g)", rule_permute_inv}, {"sum_to(g)", rule_sum_to},
    {"pad_slice(g)", rule_pad_slice},     {"scatter_add(g)", rule_scatter_add},
    {"matmul_da(g)", rule_matmul_da},     {"matmul_db(g)", rule_matmul_db},
};

/* The contribution of node v's adjoint to its operand slot k, in the operand's dtype. */
static kb_status contribution(gradctx *gc, int32_t v, int k, int32_t *out)
{
    kb_status st = KB_OK;
    const kb_node *nd = kb_graph_node(gc->fg, v);
    const kb_node *a = kb_graph_node(gc->fg, nd->inputs[k]);
    const kb_op_info *info = kb_op_get(nd->op);
    const char *rule = info->grad[k];
    int32_t c = -1;
    if (info->kind == KB_KIND_UNARY || info->kind == KB_KIND_BINARY || info->kind == KB_KIND_TERNARY) {
        gb_rule_env e = {&gc->b, nd->dtype, nd->rank, nd->dims, gc->adj[v], gc->map[v], {-1, -1, -1},
                      {nd->scalar[0], nd->scalar[1]}, rule, 0};
        for (int i = 0; i < nd->ninputs && i < 3; i++) e.opd[i] = gc->map[nd->inputs[i]];
        const char *s = rule;
        KB_TRY(gb_eval_expr(&e, &s, &c));
        gb_skip_ws(&s);
        if (*s) return gb_rule_error(&e, s, "trailing text");
    } else {
        size_t r = 0, nr = sizeof struct_rules / sizeof struct_rules[0];
        while (r < nr && strcmp(struct_rules[r].name, rule) != 0) r++;
        KB_CHECK(gc->b.ctx, r < nr, KB_ERR_INVALID, "grad: no builder for rule \"%s\" of %s", rule, info->name);
        KB_TRY(struct_rules[r].fn(gc, v, nd, a, gc->adj[v], &c));
        if (c < 0) { /* deferred: the rule keeps it until the operand's adjoints are all in */
            *out = -1;
            return KB_OK;
        }
    }
    KB_TRY(gb_cast(&gc->b, c, a->dtype, out));
cleanup:
    return st;
}

static kb_status accumulate(gradctx *gc, int32_t u, int32_t c)
{
    if (gc->adj[u] < 0) {
        gc->adj[u] = c;
        return KB_OK;
    }
    return gb_bin(&gc->b, KB_OP_ADD, gb_node(&gc->b, c)->dtype, gc->adj[u], c, &gc->adj[u]);
}

static int slice_before(const pending_slice *x, const pending_slice *y)
{
    return x->axis != y->axis ? x->axis < y->axis : x->start < y->start;
}

/* Adds the pending slice adjoints of forward value u to its adjoint: per axis, slices that do
 * not overlap become one select (emit_select); overlapping ones are each a select of one slice
 * (zero elsewhere), summed. Called once u's consumers have all been differentiated. */
static kb_status flush_slices(gradctx *gc, int32_t u)
{
    kb_status st = KB_OK;
    kb_ctx *ctx = gc->b.ctx;
    const kb_node *a = kb_graph_node(gc->fg, u);
    int32_t n = 0, r;
    pending_slice *s = NULL;
    for (int32_t k = gc->pend_head[u]; k >= 0; k = gc->pend[k].next) n++;
    if (n == 0) return KB_OK;
    s = kb_malloc(ctx, sizeof *s * (size_t)n);
    KB_CHECK(ctx, s != NULL, KB_ERR_OOM, "grad: out of memory for %d slice adjoints", (int)n);
    n = 0;
    for (int32_t k = gc->pend_head[u]; k >= 0; k = gc->pend[k].next) { /* insertion sort: few */
        int32_t j = n++;
        while (j > 0 && slice_before(&gc->pend[k], &s[j - 1])) s[j] = s[j - 1], j--;
        s[j] = gc->pend[k];
    }
    gc->pend_head[u] = -1;
    for (int32_t i = 0, j; i < n; i = j) {
        int disjoint = 1;
        for (j = i + 1; j < n && s[j].axis == s[i].axis; j++)
            disjoint &= s[j].start >= s[j - 1].start + s[j - 1].len;
        if (disjoint && j - i <= KB_MAX_INPUTS) {
            KB_TRY(emit_select(&gc->b, a, &s[i], (int)(j - i), &r));
            KB_TRY(accumulate(gc, u, r));
        } else {
            for (int32_t k = i; k < j; k++) {
                KB_TRY(emit_select(&gc->b, a, &s[k], 1, &r));
                KB_TRY(accumulate(gc, u, r));
            }
        }
    }
cleanup:
    kb_free(ctx, s, sizeof *s * (size_t)n);
    return st;
}

/* Which forward values carry a gradient: float values reached from a wrt input through
 * operand slots that have a derivative rule. */
static void mark_required(gradctx *gc, const uint8_t *wrt)
{
    const kb_graph *g = gc->fg;
    for (int32_t v = 0; v < kb_graph_nnodes(g); v++) {
        const kb_node *nd = kb_graph_node(g, v);
        uint8_t r = 0;
        if (nd->op == KB_OP_INPUT) r = wrt[nd->index] != 0;
        for (int i = 0; i < nd->ninputs && i < 3; i++)
            r |= gc->req[nd->inputs[i]] && kb_op_get(nd->op)->grad[i][0] != '\0';
        gc->req[v] = r && kb_dtype_is_float(nd->dtype) && !nd->nograd;
    }
}

static kb_status grad_build(const kb_graph *g, const uint8_t *wrt, int32_t nsaved, uint32_t reuse, int joint,
                            kb_graph **out);

/* g with its nodes reordered: inputs, then the work that does not read the largest input
 * (largest at the symbols' example values), then the rest, each in id order. The partitioner
 * makes regions in node order, so per-row and whole-tensor work on the small inputs (a
 * cross-entropy's count of valid targets, which its gradient divides by) gets regions that run
 * before the row kernel over the large one, which can then write the gradient in the same pass
 * that reduces the rows. */
static kb_status light_first(const kb_graph *g, kb_graph **out)
{
    kb_ctx *ctx = kb_graph_ctx(g);
    kb_status st = KB_OK;
    int32_t n = kb_graph_nnodes(g), norder = 0;
    size_t cnt = n > 0 ? (size_t)n : 1;
    int64_t ex[KB_MAX_SYMS] = {0}, most = -1, sizes[KB_MAX_RANK];
    uint8_t *heavy = kb_calloc(ctx, cnt, 1);
    int32_t *order = kb_malloc(ctx, cnt * sizeof(int32_t));
    KB_CHECK(ctx, heavy && order, KB_ERR_OOM, "grad: out of memory for %d nodes", (int)n);
    for (int32_t s = 0; s < kb_graph_nsymbols(g) && s < KB_MAX_SYMS; s++) ex[s] = kb_graph_symbol_example(g, s);
    for (int32_t i = 0; i < kb_graph_ninputs(g); i++) {
        int64_t e = kb_value_sizes(g, kb_graph_input(g, i), ex, sizes);
        if (e > most) most = e;
    }
    for (int32_t v = 0; v < n; v++) {
        const kb_node *nd = kb_graph_node(g, v);
        heavy[v] = nd->op == KB_OP_INPUT && kb_value_sizes(g, v, ex, sizes) == most;
        for (int i = 0; i < nd->ninputs; i++) heavy[v] |= heavy[nd->inputs[i]];
    }
    for (int pass = 0; pass < 2; pass++) /* the light work, then the heavy */
        for (int32_t v = 0; v < n; v++)
            if (kb_graph_node(g, v)->op != KB_OP_INPUT && heavy[v] == pass) order[norder++] = v;
    st = kb_graph_rebuild(g, order, norder, out);
cleanup:
    kb_free(ctx, heavy, cnt);
    kb_free(ctx, order, cnt * sizeof(int32_t));
    return st;
}

kb_status kb_graph_grad(const kb_graph *g, const uint8_t *wrt, kb_graph **out)
{
    return grad_build(g, wrt, 0, 0, 0, out);
}

kb_status kb_graph_grad_saved(const kb_graph *g, const uint8_t *wrt, int32_t nsaved, uint32_t reuse, kb_graph **out)
{
    return grad_build(g, wrt, nsaved, reuse, 0, out);
}

kb_status kb_graph_grad_joint(const kb_graph *g, const uint8_t *wrt, kb_graph **out)
{
    return grad_build(g, wrt, 0, 0, 1, out);
}

/* The forward value output o stands for in a backward that reads o: o's own, or where o is an
 * f32 value narrowed to f16/bf16, that f32 value (read back widened from o, as eager's backward
 * reads a narrowed output: a rounding of the value it recomputed). -1 where o is an input. */
static int32_t reused_value(const kb_graph *g, int32_t o)
{
    const kb_node *on = kb_graph_node(g, o);
    if (on->op == KB_OP_INPUT) return -1;
    if (on->op == KB_OP_CAST && (on->dtype == KB_F16 || on->dtype == KB_BF16)) {
        int32_t v = on->inputs[0];
        const kb_node *vn = kb_graph_node(g, v);
        if (vn->dtype == KB_F32 && vn->op != KB_OP_INPUT) return v;
    }
    return o;
}

/* bwd with the values of its reused outputs (its last nreused outputs, placeholders simplify
 * kept alive) read from the inputs that hold those outputs (input first_out on, one per reused
 * output), widened back where the output was narrowed; the placeholders dropped, and then what
 * nothing reads any more: the forward work that recomputed those values. */
static kb_status read_reused(const kb_graph *bwd, int32_t nreused, int32_t first_out, kb_graph **out)
{
    kb_status st = KB_OK;
    kb_ctx *ctx = kb_graph_ctx(bwd);
    int32_t n = kb_graph_nnodes(bwd), nkeep = kb_graph_noutputs(bwd) - nreused;
    size_t cnt = n > 0 ? (size_t)n : 1;
    kb_graph *w = NULL;
    int32_t *map = kb_malloc(ctx, cnt * sizeof(int32_t));
    KB_CHECK(ctx, map != NULL, KB_ERR_OOM, "grad: out of memory for %d nodes", (int)n);
    KB_TRY(kb_graph_new(ctx, &w));
    KB_TRY(kb_graph_copy_symbols(bwd, w));
    for (int32_t v = 0; v < n; v++) map[v] = -1;
    for (int32_t i = 0; i < kb_graph_ninputs(bwd); i++) /* inputs first, in order (ids are topological) */
        KB_TRY(kb_graph_add(w, kb_graph_node(bwd, kb_graph_input(bwd, i)), &map[kb_graph_input(bwd, i)]));
    for (int32_t v = 0; v < n; v++) {
        const kb_node *nd = kb_graph_node(bwd, v);
        if (nd->op == KB_OP_INPUT) continue;
        int32_t held = -1;
        for (int32_t k = 0; k < nreused && held < 0; k++)
            if (kb_graph_output(bwd, nkeep + k) == v) held = map[kb_graph_input(bwd, first_out + k)];
        if (held >= 0 && kb_graph_node(w, held)->dtype == nd->dtype) {
            map[v] = held;
        } else if (held >= 0) {
            kb_node c = kb_node_template(KB_OP_CAST, nd->dtype, nd->rank, nd->dims);
            c.inputs[0] = held, c.ninputs = 1;
            KB_TRY(kb_graph_add(w, &c, &map[v]));
        } else {
            kb_node t = *nd;
            for (int i = 0; i < t.ninputs; i++) t.inputs[i] = map[t.inputs[i]];
            KB_TRY(kb_graph_add(w, &t, &map[v]));
        }
    }
    for (int32_t j = 0; j < nkeep; j++) KB_TRY(kb_graph_add_output(w, map[kb_graph_output(bwd, j)]));
    KB_TRY(kb_graph_simplify(w, out));
cleanup:
    kb_free(ctx, map, cnt * sizeof(int32_t));
    kb_graph_free(w);
    return st;
}

#define KB_MAX_SAVED_MEANS 8 /* a region saves a statistic or two per row */

/* joint: the upstream gradients are constants 1 instead of inputs, and g's outputs come first
 * among the outputs (forward and backward in one graph, for the partitioner to fuse). */
static kb_status grad_build(const kb_graph *g, const uint8_t *wrt, int32_t nsaved, uint32_t reuse, int joint,
                            kb_graph **out)
{
    if (!out) return KB_ERR_INVALID;
    *out = NULL;
    if (!g || nsaved < 0 || nsaved > kb_graph_noutputs(g)) return KB_ERR_INVALID;
    int32_t nreal = kb_graph_noutputs(g) - nsaved, nreused = 0, first_out = kb_graph_ninputs(g) + nsaved;
    if (nreal < 32 && reuse >> nreal) return KB_ERR_INVALID; /* a bit past the real outputs */
    kb_graph *reading = NULL;
    kb_status st = KB_OK;
    kb_ctx *ctx = kb_graph_ctx(g);
    int32_t n = kb_graph_nnodes(g);
    size_t cnt = n > 0 ? (size_t)n : 1;
    gradctx gc;
    memset(&gc, 0, sizeof gc);
    gc.fg = g;
    gc.b.ctx = ctx;
    KB_CHECK(ctx, wrt || kb_graph_ninputs(g) == 0, KB_ERR_INVALID, "grad: wrt is NULL");
    for (int32_t v = 0; v < n; v++)
        KB_CHECK(ctx, kb_graph_node(g, v)->op != KB_OP_EXTERN, KB_ERR_UNSUPPORTED,
                 "grad: node %d is EXTERN (torch differentiates it; differentiate the regions around it)", (int)v);
    for (int32_t i = 0; i < kb_graph_ninputs(g); i++) {
        const kb_node *in = kb_graph_node(g, kb_graph_input(g, i));
        KB_CHECK(ctx, !wrt[i] || kb_dtype_is_float(in->dtype), KB_ERR_INVALID,
                 "grad: input %d (\"%s\") is %s, which has no gradient", (int)i, in->name, kb_dtype_name(in->dtype));
    }
    gc.map = kb_malloc(ctx, cnt * sizeof(int32_t));
    gc.adj = kb_malloc(ctx, cnt * sizeof(int32_t));
    gc.req = kb_calloc(ctx, cnt, 1);
    gc.pend_head = kb_malloc(ctx, cnt * sizeof(int32_t));
    KB_CHECK(ctx, gc.map && gc.adj && gc.req && gc.pend_head, KB_ERR_OOM, "grad: out of memory for %d nodes", (int)n);
    for (int32_t v = 0; v < n; v++) gc.adj[v] = gc.pend_head[v] = -1;
    KB_TRY(kb_graph_new(ctx, &gc.b.g));
    KB_TRY(kb_graph_copy_symbols(g, gc.b.g));

    /* the forward, re-emitted: the backward reads its values (simplify drops what it does not);
     * g's inputs first, then the saved statistics as inputs in their place */
    for (int32_t i = 0; i < kb_graph_ninputs(g); i++) {
        int32_t v = kb_graph_input(g, i);
        KB_TRY(gb_emit(&gc.b, kb_graph_node(g, v), &gc.map[v]));
    }
    for (int32_t k = nreal; k < kb_graph_noutputs(g); k++) {
        int32_t o = kb_graph_output(g, k);
        const kb_node *on = kb_graph_node(g, o);
        KB_CHECK(ctx, on->op != KB_OP_INPUT, KB_ERR_INVALID, "grad: saved output %d is an input", (int)k);
        kb_node t = gb_tmpl(KB_OP_INPUT, on->dtype, on->rank, on->dims);
        t.input_kind = KB_INPUT_USER;
        char name[32];
        snprintf(name, sizeof name, "saved%d", (int)(k - nreal));
        t.name = name;
        KB_TRY(gb_emit(&gc.b, &t, &gc.map[o]));
    }
    /* then the reused outputs: a value the backward needs that one holds is read, not recomputed */
    int32_t out_inputs[32];
    for (int32_t k = 0; k < nreal && k < 32; k++) {
        if (!(reuse >> k & 1u)) continue;
        const kb_node *on = kb_graph_node(g, kb_graph_output(g, k));
        kb_node t = gb_tmpl(KB_OP_INPUT, on->dtype, on->rank, on->dims);
        t.input_kind = KB_INPUT_USER;
        char name[32];
        snprintf(name, sizeof name, "out%d", (int)k);
        t.name = name;
        KB_TRY(gb_emit(&gc.b, &t, &out_inputs[nreused++]));
    }
    /* a saved row mean stays known as one (simplify: the deviations from it sum to 0) */
    kb_mean_fact means[KB_MAX_SAVED_MEANS];
    int nmeans = 0;
    for (int32_t k = nreal; k < kb_graph_noutputs(g) && nmeans < KB_MAX_SAVED_MEANS; k++) {
        const kb_node *on = kb_graph_node(g, kb_graph_output(g, k));
        if (on->op == KB_OP_MEAN && on->rank == kb_graph_node(g, on->inputs[0])->rank)
            means[nmeans++] = (kb_mean_fact){gc.map[kb_graph_output(g, k)], on->inputs[0], on->axes};
    }
    for (int32_t v = 0; v < n; v++) {
        kb_node t = *kb_graph_node(g, v);
        if (t.op == KB_OP_INPUT) continue;
        int saved = 0;
        for (int32_t k = nreal; k < kb_graph_noutputs(g); k++) saved |= kb_graph_output(g, k) == v;
        if (saved) continue;
        for (int i = 0; i < t.ninputs; i++) t.inputs[i] = gc.map[t.inputs[i]];
        KB_TRY(gb_emit(&gc.b, &t, &gc.map[v]));
    }
    mark_required(&gc, wrt);
    /* one upstream gradient per output; seeds only where a gradient can flow */
    for (int32_t k = 0; k < nreal; k++) {
        int32_t o = kb_graph_output(g, k), gid;
        const kb_node *on = kb_graph_node(g, o);
        if (joint) {
            KB_TRY(gb_const(&gc.b, on->dtype, on->rank, on->dims, 1.0, &gid));
            KB_TRY(kb_graph_add_output(gc.b.g, gc.map[o]));
        } else {
            kb_node t = gb_tmpl(KB_OP_INPUT, on->dtype, on->rank, on->dims);
            t.input_kind = KB_INPUT_USER;
            char name[32];
            snprintf(name, sizeof name, "grad_out%d", (int)k);
            t.name = name;
            KB_TRY(gb_emit(&gc.b, &t, &gid));
        }
        if (gc.req[o]) KB_TRY(accumulate(&gc, o, gid));
    }
    /* reverse topological order: ids are topological by construction */
    for (int32_t v = n - 1; v >= 0; v--) {
        KB_TRY(flush_slices(&gc, v)); /* every consumer of v is done: its slices' adjoints are in */
        if (gc.adj[v] < 0) continue;
        const kb_node *nd = kb_graph_node(g, v);
        for (int k = 0; k < nd->ninputs && k < 3; k++) {
            int32_t u = nd->inputs[k], c;
            if (!gc.req[u] || kb_op_get(nd->op)->grad[k][0] == '\0') continue;
            KB_TRY(contribution(&gc, v, k, &c));
            if (c >= 0) KB_TRY(accumulate(&gc, u, c));
        }
    }
    for (int32_t i = 0; i < kb_graph_ninputs(g); i++) {
        if (!wrt[i]) continue;
        int32_t v = kb_graph_input(g, i), r = gc.adj[v];
        const kb_node *in = kb_graph_node(g, v);
        if (r < 0) KB_TRY(gb_const(&gc.b, in->dtype, in->rank, in->dims, 0.0, &r)); /* unused input */
        KB_TRY(kb_graph_add_output(gc.b.g, r));
    }
    for (int i = 0; i < nmeans; i++) means[i].of = gc.map[means[i].of]; /* emitted by now */
    /* each reused output's value as a placeholder output: simplify rewrites the backward towards
     * the forward's values (exp_over_sum) and keeps these, and then read_reused reads them */
    for (int32_t k = 0, j = 0; k < nreal && k < 32; k++) {
        if (!(reuse >> k & 1u)) continue;
        int32_t v = reused_value(g, kb_graph_output(g, k));
        /* an input (or a saved statistic) is at hand already: its placeholder is a stand-in */
        KB_TRY(kb_graph_add_output(gc.b.g, v >= 0 && gc.map[v] >= 0 ? gc.map[v] : out_inputs[j]));
        j++;
    }
    if (nreused == 0) {
        KB_TRY(kb_graph_simplify_means(gc.b.g, means, nmeans, 0, out)); /* rewrites, dead nodes dropped */
    } else {
        KB_TRY(kb_graph_simplify_means(gc.b.g, means, nmeans, 1, &reading));
        KB_TRY(read_reused(reading, nreused, first_out, out));
    }
    if (joint) {
        kb_graph *simple = *out;
        *out = NULL;
        st = light_first(simple, out);
        kb_graph_free(simple);
    }
cleanup:
    kb_graph_free(reading);
    gb_done(&gc.b);
    kb_free(ctx, gc.map, cnt * sizeof(int32_t));
    kb_free(ctx, gc.adj, cnt * sizeof(int32_t));
    kb_free(ctx, gc.req, cnt);
    kb_free(ctx, gc.pend_head, cnt * sizeof(int32_t));
    kb_free(ctx, gc.pend, sizeof(pending_slice) * (size_t)gc.cappend);
    return st;
}
