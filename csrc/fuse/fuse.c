/* fuse.c — the partitioner: one greedy pass over the topological node list groups nodes into
 * regions (one kernel each): POINTWISE, ROW (reduce dims including the last one), COL (reduce
 * dims that leave the last one), GEMM (one MATMUL and its pointwise epilogue) and EXTERN. Whether a node may join a region is a table of
 * (node class, region kind, predicate) rules (docs/DESIGN.md, "Regions and genomes"), not a
 * nest of ifs.
 *
 * Vocabulary. A value computed in a region has a *level*: FULL (one per element of the
 * anchor, the iteration space) or STAT (one per row of a ROW region / column of a COL region,
 * i.e. the kept dims of the reduction) or, in a ROW region, COLSUM (a sum over the rows, one per
 * element of a row: the region's kernel keeps per-block partials, a finishing kernel adds them;
 * nothing in the region can read it). Views and constants that codegen can fold into load
 * addressing are *floating*: they belong to no region of their own and are copied into every
 * region that reads them; the INPUTs and other regions' outputs they read are what the region
 * actually reads. Pointwise work floats too where recomputing it in each reader is cheaper
 * than a full write and read (FLOAT_RULES). Regions only ever read regions with a smaller
 * index, so the list is an execution order. The pass's result, each node's region and level, is
 * a fuse_build (fuse.h), which partition.c assembles into the kb_partition; the facts about
 * each value's readers that the float rules and GEMM gates consult come from prepass.c. */
#include "fuse/fuse.h"

/* What a floating value reads: FL_PARAMS, parameters, buffers and constants alone; FL_SMALL,
 * fewer elements than it has (constants, iotas, broadcasts of per-row values and work on
 * those), so recomputing it costs less than reading it back; FL_PER_ROW, graph inputs shaped
 * like a kept-dim reduction (a backward's saved row statistics), parameters and constants. */
enum { FL_PARAMS = 1, FL_SMALL = 2, FL_PER_ROW = 4 };

/* ROW regions carry column sums (a parameter's gradient summed over the rows) as per-block
 * partials while the rows stream by; their registers bound the row length. */
#define COLSUM_MAX_ROW 16384

#define ANY_KIND (-1)

enum { UP_REDUCE = 1, UP_COLSUM = 2 };

/* ---------------------------------------------------------------- symbolic sizes */

static const kb_node *N(const fuse_build *b, int32_t v) { return kb_graph_node(b->g, v); }

static int same_dims(const kb_node *a, const kb_node *c) {
    if (a->rank != c->rank) return 0;
    for (int d = 0; d < a->rank; d++)
        if (!kb_dim_equal(a->dims[d], c->dims[d])) return 0;
    return 1;
}

static int is_one(kb_dim d) { return d.coef == 1 && d.nsym == 0; }

/* numel of v equals the number of elements (lv FULL), rows/columns (lv STAT) or elements of a
 * row (lv COLSUM) of region r */
static int numel_matches(const fuse_build *b, int32_t v, int32_t r, int lv) {
    const kb_node *a = N(b, b->regs[r].anchor), *x = N(b, v);
    kb_dim kept[KB_MAX_RANK];
    int nk = 0;
    for (int d = 0; d < a->rank; d++) {
        int in_row = (b->regs[r].red >> d) & 1;
        if (lv == LV_FULL || (lv == LV_STAT && !in_row) || (lv == LV_COLSUM && in_row)) kept[nk++] = a->dims[d];
    }
    kb_monomial ma, mx;
    kb_monomial_of(kept, nk, ~0u, &ma);
    kb_monomial_of(x->dims, x->rank, ~0u, &mx);
    return kb_monomial_equal(&ma, &mx);
}

/* v has the shape of a keepdim reduction of region r's anchor: 1 on reduced axes */
static int is_keepdim_stat(const fuse_build *b, int32_t v, int32_t r) {
    const kb_node *a = N(b, b->regs[r].anchor), *x = N(b, v);
    if (x->rank != a->rank) return 0;
    for (int d = 0; d < a->rank; d++) {
        if (b->regs[r].red & (1u << d)) {
            if (!is_one(x->dims[d])) return 0;
        } else if (!kb_dim_equal(x->dims[d], a->dims[d])) {
            return 0;
        }
    }
    return 1;
}

/* level of operand u as seen from region r: LV_NONE if u is not computed in r */
static int level_in(const fuse_build *b, int32_t u, int32_t r) {
    return (!b->floating[u] && b->reg[u] == r) ? b->lvl[u] : LV_NONE;
}

/* ---------------------------------------------------------------- column sums in row kernels */

/* Column sums region r carries (a ROW region's reductions at LV_COLSUM). */
static int32_t colsums_in(const fuse_build *b, int32_t r) {
    int32_t n = 0;
    for (int32_t v = 0; v < b->n; v++)
        n += !b->floating[v] && b->reg[v] == r && b->lvl[v] == LV_COLSUM &&
             kb_op_get(N(b, v)->op)->kind == KB_KIND_REDUCE;
    return n;
}

/* A single-pass COL region that sums over the leading dims (a bias gradient: db = sum over rows
 * of dy * act'(x)) streams better as a ROW region with column sums: whole rows in 16-byte
 * vectors, partials in registers, no barriers, a small finishing kernel; the COL kernel walks
 * down columns with a split. Single pass: no full-size value reads a per-column statistic. */
static int colsum_ok(const fuse_build *b, int32_t r) {
    const kb_node *a = N(b, b->regs[r].anchor);
    uint32_t red = b->regs[r].red, all = (uint32_t)((1ull << a->rank) - 1);
    if (b->regs[r].kind != KB_REGION_COL || red == 0 || (red & (red + 1)) != 0 || red == all) return 0;
    int64_t row = 1;
    for (int d = 0; d < a->rank; d++)
        if (!(red & (1u << d))) {
            if (a->dims[d].nsym) return 0;
            row *= a->dims[d].coef;
        }
    if (row > COLSUM_MAX_ROW) return 0;
    int32_t nsums = 0;
    for (int32_t v = 0; v < b->n; v++) {
        if (b->floating[v] || b->reg[v] != r) continue;
        const kb_node *nd = N(b, v);
        int reduce = kb_op_get(nd->op)->kind == KB_KIND_REDUCE, reads_stat = 0;
        if (reduce && ++nsums > KB_MAX_COLSUMS) return 0; /* each would be a column sum */
        for (int i = 0; i < nd->ninputs; i++) reads_stat |= level_in(b, nd->inputs[i], r) == LV_STAT;
        if (reduce && ((nd->op != KB_OP_SUM && nd->op != KB_OP_MEAN) || nd->axes != red || reads_stat)) return 0;
        if (b->lvl[v] == LV_FULL && reads_stat) return 0;      /* a second pass */
        if (b->lvl[v] == LV_STAT && !reduce && !reads_stat) return 0; /* per-column work of its own */
    }
    return 1;
}

/* Region r (colsum_ok) becomes a ROW region over the rest of its anchor's axes; its column
 * statistics become column sums. */
static void make_row_colsum(fuse_build *b, int32_t r) {
    const kb_node *a = N(b, b->regs[r].anchor);
    uint32_t all = (uint32_t)((1ull << a->rank) - 1);
    b->regs[r].kind = KB_REGION_ROW;
    b->regs[r].red = all & ~b->regs[r].red;
    for (int32_t v = 0; v < b->n; v++)
        if (!b->floating[v] && b->reg[v] == r && b->lvl[v] == LV_STAT) b->lvl[v] = LV_COLSUM;
}

/* ---------------------------------------------------------------- join rules */

/* A rule says node v may join region r (whose kind matched the row) and at which level. */
typedef int (*rule_fn)(const fuse_build *b, int32_t v, int32_t r, int *lv);

/* Pointwise: every operand computed in r has one level; v then has it too. An operand not
 * computed in r (an input, a floating view) is read at whatever index v needs. */
static int pw_join(const fuse_build *b, int32_t v, int32_t r, int *lv) {
    const kb_node *nd = N(b, v);
    int want = LV_NONE;
    for (int i = 0; i < nd->ninputs; i++) {
        int l = level_in(b, nd->inputs[i], r);
        if (l == LV_NONE) continue;
        if (want != LV_NONE && l != want) return 0;
        want = l;
    }
    if (want == LV_NONE) { /* nothing from r: a horizontal join, FULL first, then STAT */
        if (numel_matches(b, v, r, LV_FULL)) want = LV_FULL;
        else if (b->regs[r].kind != KB_REGION_POINTWISE && numel_matches(b, v, r, LV_STAT)) want = LV_STAT;
        else return 0;
    }
    if (!numel_matches(b, v, r, want)) return 0;
    *lv = want;
    return 1;
}

/* A reshape keeps the row-major order, so FULL stays FULL and STAT stays STAT. */
static int reshape_join(const fuse_build *b, int32_t v, int32_t r, int *lv) {
    int l = level_in(b, N(b, v)->inputs[0], r);
    if (l == LV_COLSUM) { /* the same row-major elements, written by the finishing kernel */
        *lv = LV_COLSUM;
        return 1;
    }
    if (l == LV_NONE || !numel_matches(b, v, r, l)) return 0;
    *lv = l;
    return 1;
}

/* A per-row (per-column) statistic broadcast back over the reduced axes: stays inside. */
static int expand_stat_join(const fuse_build *b, int32_t v, int32_t r, int *lv) {
    int32_t u = N(b, v)->inputs[0];
    if (level_in(b, u, r) != LV_STAT || !is_keepdim_stat(b, u, r)) return 0;
    if (!same_dims(N(b, v), N(b, b->regs[r].anchor))) return 0;
    *lv = LV_FULL;
    return 1;
}

/* The first reduction turns a POINTWISE region into ROW / COL over the reduced operand. */
static int reduce_upgrade(const fuse_build *b, int32_t v, int32_t r, int *lv) {
    int32_t u = N(b, v)->inputs[0];
    if (level_in(b, u, r) == LV_STAT) return 0;
    if (level_in(b, u, r) == LV_NONE && !b->floating[u] && N(b, u)->op != KB_OP_INPUT) return 0;
    if (!numel_matches(b, u, r, LV_FULL)) return 0;
    *lv = LV_STAT;
    return 1;
}

/* Further reductions join when they reduce the same space over the same axes. */
static int reduce_same(const fuse_build *b, int32_t v, int32_t r, int *lv) {
    const kb_node *nd = N(b, v);
    int32_t u = nd->inputs[0];
    int l = level_in(b, u, r);
    if (l == LV_STAT) return 0;
    if (l == LV_NONE && !b->floating[u] && N(b, u)->op != KB_OP_INPUT) return 0;
    if (!same_dims(N(b, u), N(b, b->regs[r].anchor)) || nd->axes != b->regs[r].red) return 0;
    *lv = LV_STAT;
    return 1;
}

/* A sum over all the rows of a ROW region (LayerNorm's dweight = sum over rows of dy * xhat)
 * joins it as a column sum when its operand is a full element of the region (or an input of
 * the anchor's shape) and the row length is a constant small enough for per-thread partials. */
static int reduce_cols(const fuse_build *b, int32_t v, int32_t r, int *lv) {
    const kb_node *nd = N(b, v), *a = N(b, b->regs[r].anchor);
    int32_t u = nd->inputs[0];
    uint32_t red = b->regs[r].red, all = (uint32_t)((1ull << a->rank) - 1);
    if (nd->op != KB_OP_SUM && nd->op != KB_OP_MEAN) return 0;
    int l = level_in(b, u, r);
    if (l != LV_FULL && (l != LV_NONE || (!b->floating[u] && N(b, u)->op != KB_OP_INPUT))) return 0;
    if (!same_dims(N(b, u), a) || nd->axes != (all & ~red) || nd->axes == 0) return 0;
    int64_t row = 1;
    for (int d = 0; d < a->rank; d++)
        if (red & (1u << d)) {
            if (a->dims[d].nsym) return 0;
            row *= a->dims[d].coef;
        }
    if (row > COLSUM_MAX_ROW || colsums_in(b, r) >= KB_MAX_COLSUMS) return 0;
    *lv = LV_COLSUM;
    return 1;
}

/* A row reduction over a COL region's full elements, where the region is sums over the rows
 * alone (colsum_ok): the region becomes a ROW region carrying those sums as column sums, and
 * the reduction joins it. A backward that reads saved statistics meets dbias = sum(dy) over the
 * rows before its first row reduction; without this the rows would be read twice. */
static int reduce_rows_of_colsums(const fuse_build *b, int32_t v, int32_t r, int *lv) {
    const kb_node *nd = N(b, v), *a = N(b, b->regs[r].anchor);
    int32_t u = nd->inputs[0];
    uint32_t all = (uint32_t)((1ull << a->rank) - 1);
    int l = level_in(b, u, r);
    if (l != LV_FULL && (l != LV_NONE || (!b->floating[u] && N(b, u)->op != KB_OP_INPUT))) return 0;
    if (!same_dims(N(b, u), a) || nd->axes != (all & ~b->regs[r].red) || !colsum_ok(b, r)) return 0;
    *lv = LV_STAT;
    return 1;
}

/* Gather in a POINTWISE region: the table is recomputed at the gathered index. */
static int gather_pw(const fuse_build *b, int32_t v, int32_t r, int *lv) {
    const kb_node *nd = N(b, v);
    if (level_in(b, nd->inputs[1], r) == LV_STAT) return 0;
    if (!numel_matches(b, v, r, LV_FULL)) return 0;
    *lv = LV_FULL;
    return 1;
}

/* Gather along the single reduced axis of a ROW region, one pick per row (cross-entropy's
 * logp[target]): the picked element is recomputed from the row's statistics. */
static int gather_row(const fuse_build *b, int32_t v, int32_t r, int *lv) {
    const kb_node *nd = N(b, v);
    int32_t a = nd->inputs[0], ix = nd->inputs[1];
    if (b->regs[r].red != (1u << nd->axis)) return 0;
    if (level_in(b, a, r) == LV_STAT || !same_dims(N(b, a), N(b, b->regs[r].anchor))) return 0;
    if (level_in(b, ix, r) == LV_FULL || !is_keepdim_stat(b, v, r)) return 0;
    *lv = LV_STAT;
    return 1;
}

/* A GEMM region's epilogue: pointwise work over the product's iteration space that reads the
 * product or earlier epilogue work (bias add, activation, residual add, scale, clamp, casts); its
 * other operands are inputs or floating values (a bias through an EXPAND), read at the element's
 * index. No horizontal join: work that reads nothing of the region is no epilogue. Reductions
 * have no GEMM rule: a norm after the product is a ROW region of its own. */
static int gemm_epilogue(const fuse_build *b, int32_t v, int32_t r, int *lv) {
    const kb_node *nd = N(b, v);
    int reads = 0;
    for (int i = 0; i < nd->ninputs; i++) {
        int l = level_in(b, nd->inputs[i], r);
        if (l != LV_NONE && l != LV_FULL) return 0;
        reads |= l == LV_FULL;
    }
    if (!reads || !numel_matches(b, v, r, LV_FULL)) return 0;
    *lv = LV_FULL;
    return 1;
}

/* EXTERN nodes of one torch call (same callable, several outputs) share a region. */
static int extern_join(const fuse_build *b, int32_t v, int32_t r, int *lv) {
    if (b->regs[r].extern_index != N(b, v)->index) return 0;
    *lv = LV_NONE;
    return 1;
}

static const struct join_rule {
    enum node_class cls;
    int kind;            /* kb_region_kind or ANY_KIND */
    rule_fn fn;
    int upgrades;        /* UP_REDUCE: the region becomes ROW / COL over the node's operand;
                          * UP_COLSUM: a COL region becomes ROW (make_row_colsum) */
} RULES[] = {
    {C_POINTWISE, KB_REGION_POINTWISE, pw_join, 0},
    {C_POINTWISE, KB_REGION_ROW, pw_join, 0},
    {C_POINTWISE, KB_REGION_COL, pw_join, 0},
    {C_RESHAPE, KB_REGION_POINTWISE, reshape_join, 0},
    {C_RESHAPE, KB_REGION_ROW, reshape_join, 0},
    {C_RESHAPE, KB_REGION_COL, reshape_join, 0},
    {C_EXPAND, KB_REGION_ROW, expand_stat_join, 0},
    {C_EXPAND, KB_REGION_COL, expand_stat_join, 0},
    {C_REDUCE, KB_REGION_POINTWISE, reduce_upgrade, UP_REDUCE},
    {C_REDUCE, KB_REGION_ROW, reduce_same, 0},
    {C_REDUCE, KB_REGION_ROW, reduce_cols, 0},
    {C_REDUCE, KB_REGION_COL, reduce_same, 0},
    {C_REDUCE, KB_REGION_COL, reduce_rows_of_colsums, UP_COLSUM},
    {C_GATHER, KB_REGION_POINTWISE, gather_pw, 0},
    {C_GATHER, KB_REGION_ROW, gather_row, 0},
    {C_EXTERN, KB_REGION_EXTERN, extern_join, 0},
    {C_POINTWISE, KB_REGION_GEMM, gemm_epilogue, 0},
    {C_RESHAPE, KB_REGION_GEMM, reshape_join, 0},
};

/* The first rule of the table that lets v join r; -1 if none. */
static int find_rule(const fuse_build *b, int32_t v, int32_t r, int *lv) {
    enum node_class cls = fuse_classify(N(b, v));
    /* a column sum is complete only after every row: in r, only pointwise work on column sums
       (the finishing kernel's: dweight's cast to bf16) and reshapes read it */
    for (int i = 0; i < N(b, v)->ninputs && cls != C_RESHAPE && cls != C_POINTWISE; i++)
        if (level_in(b, N(b, v)->inputs[i], r) == LV_COLSUM) return -1;
    for (size_t i = 0; i < sizeof RULES / sizeof RULES[0]; i++) {
        if (RULES[i].cls != cls) continue;
        if (RULES[i].kind != ANY_KIND && RULES[i].kind != (int)b->regs[r].kind) continue;
        if (RULES[i].fn(b, v, r, lv)) return (int)i;
    }
    return -1;
}

/* ---------------------------------------------------------------- the greedy pass */

static kb_status new_region(fuse_build *b, kb_region_kind kind, int32_t anchor, uint32_t red, int32_t *out) {
    if (b->nreg == b->capreg) {
        int32_t ncap = b->capreg ? b->capreg * 2 : 8;
        fuse_region *p = kb_realloc(b->ctx, b->regs, sizeof(fuse_region) * (size_t)b->capreg, sizeof(fuse_region) * (size_t)ncap);
        if (!p) return KB_ERR_OOM;
        b->regs = p;
        b->capreg = ncap;
    }
    fuse_region *r = &b->regs[b->nreg];
    r->kind = kind;
    r->anchor = anchor;
    r->red = red;
    r->extern_index = -1;
    *out = b->nreg++;
    return KB_OK;
}

/* ROW when the last dim of the reduced operand is reduced (rows are contiguous), else COL. */
static kb_region_kind reduce_kind(const fuse_build *b, int32_t v) {
    const kb_node *nd = N(b, v), *a = N(b, nd->inputs[0]);
    return (nd->axes & (1u << (a->rank - 1))) ? KB_REGION_ROW : KB_REGION_COL;
}

/* What joining reduction v does to region r (a rule's `upgrades`). */
static void upgrade(fuse_build *b, int32_t r, int32_t v, int how) {
    const kb_node *nd = N(b, v);
    if (how == UP_REDUCE) {
        b->regs[r].kind = reduce_kind(b, v);
        b->regs[r].anchor = nd->inputs[0];
        b->regs[r].red = nd->axes;
    } else if (how == UP_COLSUM) {
        make_row_colsum(b, r);
    }
}

static void place(fuse_build *b, int32_t v, int32_t r, int lv) {
    b->reg[v] = r;
    b->lvl[v] = (int8_t)lv;
}

/* Is u a parameter or buffer, a constant, or something floating computed from those alone? */
static int from_params(const fuse_build *b, int32_t u) {
    const kb_node *nd = N(b, u);
    if (nd->op == KB_OP_INPUT) return nd->input_kind != KB_INPUT_USER;
    return b->floating[u] && (b->fl[u] & FL_PARAMS);
}

/* Does u read fewer elements than it has (a floating broadcast, iota or constant)? */
static int is_small(const fuse_build *b, int32_t u) { return b->floating[u] && (b->fl[u] & FL_SMALL); }

/* Is u one value per row: a graph input with a size-1 dim (the kept dim of a reduction, as the
 * forward's saved statistics are), or floating work on such inputs, parameters and constants? */
static int is_per_row(const fuse_build *b, int32_t u) {
    const kb_node *nd = N(b, u);
    if (nd->op == KB_OP_INPUT) {
        if (nd->input_kind != KB_INPUT_USER || nd->rank < 2) return 0;
        for (int d = 0; d < nd->rank; d++)
            if (is_one(nd->dims[d])) return 1;
        return 0;
    }
    return b->floating[u] && (b->fl[u] & (FL_PER_ROW | FL_PARAMS | FL_SMALL));
}

/* v's operands are all per-row (is_per_row), and one of them is an input or work on one. */
static int reads_per_row(const fuse_build *b, int32_t v) {
    const kb_node *nd = N(b, v);
    int rows = 0;
    for (int i = 0; i < nd->ninputs; i++) {
        int32_t u = nd->inputs[i];
        if (!is_per_row(b, u)) return 0;
        rows |= N(b, u)->op == KB_OP_INPUT || (b->floating[u] && (b->fl[u] & FL_PER_ROW));
    }
    return rows;
}

/* v floats: copied into each region that reads it. dep and fl follow from its operands. */
static void make_floating(fuse_build *b, int32_t v) {
    const kb_node *nd = N(b, v);
    int32_t dep = -1;
    uint8_t fl = FL_PARAMS | FL_SMALL;
    for (int i = 0; i < nd->ninputs; i++) {
        int32_t u = nd->inputs[i], d = b->floating[u] ? b->dep[u] : b->reg[u];
        if (d > dep) dep = d;
        if (!from_params(b, u)) fl &= (uint8_t)~FL_PARAMS;
        if (!is_small(b, u)) fl &= (uint8_t)~FL_SMALL;
    }
    if (reads_per_row(b, v)) fl |= FL_PER_ROW;
    if (nd->op == KB_OP_EXPAND) { /* a broadcast reads fewer elements than it has */
        const kb_node *a = N(b, nd->inputs[0]);
        for (int d = 0; d < nd->rank; d++)
            if (!kb_dim_equal(a->dims[d], nd->dims[d])) fl |= FL_SMALL;
    }
    b->floating[v] = 1;
    b->dep[v] = dep;
    b->fl[v] = fl;
}

/* ---------------------------------------------------------------- float rules */

/* Pointwise work that floats instead of joining a region: recomputed by every region that
 * reads it, at the index it reads it at. A table, as the join rules are: the first rule that
 * holds. */
typedef int (*float_fn)(const fuse_build *b, int32_t v);

/* On parameters alone (a bf16 weight cast to f32, a scale made of weights): a few flops on
 * data already in L2, instead of a parameter-sized region of its own whose result the big
 * region would read back through an expand it could not fuse. */
static int float_params(const fuse_build *b, int32_t v) {
    const kb_node *nd = N(b, v);
    for (int i = 0; i < nd->ninputs; i++)
        if (!from_params(b, nd->inputs[i])) return 0;
    return 1;
}

/* On iotas, constants and broadcasts alone (the one-hot mask iota == target of a gather's
 * adjoint): what it reads is smaller than it is, so a reader recomputes it from a few values
 * per row instead of reading back a materialized full-size mask. */
static int float_broadcast(const fuse_build *b, int32_t v) {
    const kb_node *nd = N(b, v);
    for (int i = 0; i < nd->ninputs; i++)
        if (!is_small(b, nd->inputs[i])) return 0;
    return 1;
}

/* On per-row inputs (is_per_row), at least one of them read: a backward's rstd = rsqrt(saved
 * variance + eps). A few flops per row, recomputed by each region that reads them, instead of
 * a per-row kernel of its own that the row kernel would have to run after: the row kernel then
 * could not compute x - saved mean before it, and the backward fell apart into five kernels. */
static int float_per_row(const fuse_build *b, int32_t v) { return reads_per_row(b, v); }

/* Read only through static index maps (mark_index_reads). */
static int float_index_read(const fuse_build *b, int32_t v) { return b->index_read[v]; }

/* From graph inputs alone, with a single reader (mark_lone_reads). */
static int float_lone_read(const fuse_build *b, int32_t v) { return b->lone_read[v]; }

/* Pointwise work on at most two full-size graph inputs (mark_input_work), whose operands did
 * float or are inputs: work on a value that joined a region stays with it. */
static int float_input_work(const fuse_build *b, int32_t v) {
    if (!b->input_work[v]) return 0;
    const kb_node *nd = N(b, v);
    for (int i = 0; i < nd->ninputs; i++) {
        int32_t u = nd->inputs[i];
        if (N(b, u)->op != KB_OP_INPUT && (!b->floating[u] || b->dep[u] >= 0)) return 0;
    }
    return 1;
}

/* Cheap prologue work (fuse_cheap_prologue) on inputs, constants and other such floating work
 * alone, through views: an activation before the cast keeps the chain a region of its own. */
static int prologue_chain(const fuse_build *b, int32_t v, int depth) {
    if (depth > 8 || !fuse_cheap_prologue(b->g, v)) return 0;
    const kb_node *nd = N(b, v);
    for (int i = 0; i < nd->ninputs; i++) {
        int32_t u = nd->inputs[i];
        while (b->floating[u] && kb_op_get(N(b, u)->op)->kind == KB_KIND_VIEW) u = N(b, u)->inputs[0];
        kb_op op = N(b, u)->op;
        if (op != KB_OP_INPUT && op != KB_OP_CONST && !(b->floating[u] && prologue_chain(b, u, depth + 1))) return 0;
    }
    return 1;
}

/* A cheap prologue read only by matrix products (through views): a cast or a scale by a constant
 * of an input (prologue_chain), applied as the GEMM loads its operand (autocast's x.to(bf16)),
 * instead of a kernel that writes the cast copy for the GEMM to read back. */
static int float_prologue(const fuse_build *b, int32_t v) {
    return b->gemm_read[v] == GR_ONLY && prologue_chain(b, v, 0);
}

static const float_fn FLOAT_RULES[] = {float_params, float_broadcast, float_per_row, float_index_read,
                                       float_lone_read, float_input_work, float_prologue};

/* Is v pointwise work a GEMM may apply as it loads an operand: a cast, a negation, or a product or
 * quotient by a constant? Anything more (an activation, a sum of two tensors) is a kernel of its
 * own whose result the GEMM reads. */
int fuse_cheap_prologue(const kb_graph *g, int32_t v) {
    const kb_node *nd = kb_graph_node(g, v);
    if (nd->op == KB_OP_CAST || nd->op == KB_OP_NEG) return 1;
    if (nd->op != KB_OP_MUL && nd->op != KB_OP_DIV) return 0;
    for (int i = 0; i < 2; i++) {
        int32_t u = nd->inputs[i];
        while (kb_op_get(kb_graph_node(g, u)->op)->kind == KB_KIND_VIEW) u = kb_graph_node(g, u)->inputs[0];
        if (kb_graph_node(g, u)->op == KB_OP_CONST && (i == 1 || nd->op == KB_OP_MUL)) return 1;
    }
    return 0;
}

static kb_status assign(fuse_build *b, int32_t v) {
    const kb_node *nd = N(b, v);
    enum node_class cls = fuse_classify(nd);
    if (nd->op == KB_OP_INPUT) return KB_OK;
    if (nd->op == KB_OP_CONST || nd->op == KB_OP_IOTA) { /* recomputed where read */
        make_floating(b, v);
        return KB_OK;
    }
    int cut = b->cut && b->cut[v]; /* a region of its own: no float, no join */
    /* what a GEMM reads as an operand floats into it only as a cheap prologue (a cast, a scale) */
    int gemm_blocked = b->gemm_read[v] != GR_NONE && !fuse_cheap_prologue(b->g, v);
    if (cls == C_POINTWISE && !cut && !gemm_blocked)
        for (size_t i = 0; i < sizeof FLOAT_RULES / sizeof FLOAT_RULES[0]; i++)
            if (FLOAT_RULES[i](b, v)) {
                make_floating(b, v);
                return KB_OK;
            }
    /* Dependencies: soft (an operand computed in a region: join it or come after it) and hard
     * (a floating value reading a region's output: that region must run first). */
    int32_t soft = -1, hard = -1;
    for (int i = 0; i < nd->ninputs; i++) {
        int32_t u = nd->inputs[i];
        if (b->floating[u]) {
            if (b->dep[u] > hard) hard = b->dep[u];
        } else if (b->reg[u] > soft) {
            soft = b->reg[u];
        }
    }
    int32_t r = soft > hard ? soft : hard;
    int lv = LV_NONE, rule;

    if (cls == C_RESHAPE || cls == C_EXPAND || cls == C_VIEW) {
        int32_t u = nd->inputs[0];
        /* an index map only products read is their operand's addressing (a Linear's flattening
           of its input), not a value of the region it reads */
        if (b->gemm_read[v] == GR_ONLY) {
            make_floating(b, v);
            return KB_OK;
        }
        if (!b->floating[u] && b->reg[u] >= 0 && b->regs[b->reg[u]].kind != KB_REGION_EXTERN &&
            find_rule(b, v, b->reg[u], &lv) >= 0) {
            place(b, v, b->reg[u], lv);
            return KB_OK;
        }
        /* folded into the load addressing of its readers */
        make_floating(b, v);
        return KB_OK;
    }
    if (!cut && r >= 0 && r == soft && r > hard && b->regs[r].kind != KB_REGION_EXTERN &&
        (rule = find_rule(b, v, r, &lv)) >= 0) {
        upgrade(b, r, v, RULES[rule].upgrades);
        place(b, v, r, lv);
        return KB_OK;
    }
    /* Nothing computed in a region (operands are inputs or floating): join the latest region that
     * fits and runs after every region the floating operands read. */
    if (soft < 0 && cls != C_EXTERN && !cut) {
        for (int32_t q = b->nreg - 1; q > hard; q--) {
            if (b->regs[q].kind == KB_REGION_EXTERN || (rule = find_rule(b, v, q, &lv)) < 0) continue;
            upgrade(b, q, v, RULES[rule].upgrades);
            place(b, v, q, lv);
            return KB_OK;
        }
    }
    if (cls == C_EXTERN && r >= 0 && b->regs[r].kind == KB_REGION_EXTERN && find_rule(b, v, r, &lv) >= 0) {
        place(b, v, r, LV_NONE);
        return KB_OK;
    }
    /* Another output of a torch call already placed (a split's pieces, read by different
     * regions): the same call, so the same region, which already runs after every operand. */
    if (cls == C_EXTERN) {
        for (int32_t q = b->nreg - 1; q > hard; q--) {
            if (b->regs[q].kind == KB_REGION_EXTERN && b->regs[q].extern_index == nd->index) {
                place(b, v, q, LV_NONE);
                return KB_OK;
            }
        }
    }
    /* a new region */
    kb_status st;
    int32_t q;
    if (cls == C_MATMUL) { /* each product starts a GEMM region, its epilogue joins it */
        st = new_region(b, KB_REGION_GEMM, v, 0, &q);
        lv = LV_FULL;
    } else if (cls == C_EXTERN) {
        st = new_region(b, KB_REGION_EXTERN, v, 0, &q);
        if (st == KB_OK) b->regs[q].extern_index = nd->index;
        lv = LV_NONE;
    } else if (cls == C_REDUCE) {
        st = new_region(b, reduce_kind(b, v), nd->inputs[0], nd->axes, &q);
        lv = LV_STAT;
    } else {
        st = new_region(b, KB_REGION_POINTWISE, v, 0, &q);
        lv = LV_FULL;
    }
    if (st != KB_OK) return st;
    place(b, v, q, lv);
    return KB_OK;
}

/* ---------------------------------------------------------------- the pass */

void fuse_build_free(fuse_build *b) {
    kb_ctx *ctx = b->ctx;
    if (!ctx) return;
    size_t n1 = (size_t)(b->n ? b->n : 1);
    kb_free(ctx, b->reg, sizeof(int32_t) * n1);
    kb_free(ctx, b->dep, sizeof(int32_t) * n1);
    kb_free(ctx, b->lvl, n1);
    kb_free(ctx, b->floating, n1);
    kb_free(ctx, b->fl, n1);
    kb_free(ctx, b->index_read, n1);
    kb_free(ctx, b->lone_read, n1);
    kb_free(ctx, b->input_work, n1);
    kb_free(ctx, b->gemm_read, n1);
    kb_free(ctx, b->regs, sizeof(fuse_region) * (size_t)b->capreg);
    memset(b, 0, sizeof *b);
}

kb_status fuse_assign(const kb_graph *g, const uint8_t *cut, fuse_build *b) {
    kb_ctx *ctx = kb_graph_ctx(g);
    kb_status st = KB_OK;
    memset(b, 0, sizeof *b);
    b->g = g;
    b->ctx = ctx;
    b->cut = cut;
    b->n = kb_graph_nnodes(g);
    size_t n1 = (size_t)(b->n ? b->n : 1);
    b->reg = kb_malloc(ctx, sizeof(int32_t) * n1);
    b->dep = kb_malloc(ctx, sizeof(int32_t) * n1);
    b->lvl = kb_calloc(ctx, n1, 1);
    b->floating = kb_calloc(ctx, n1, 1);
    b->fl = kb_calloc(ctx, n1, 1);
    b->index_read = kb_calloc(ctx, n1, 1);
    b->lone_read = kb_calloc(ctx, n1, 1);
    b->input_work = kb_calloc(ctx, n1, 1);
    b->gemm_read = kb_calloc(ctx, n1, 1);
    KB_CHECK(ctx, b->reg && b->dep && b->lvl && b->floating && b->fl && b->index_read && b->lone_read && b->input_work &&
             b->gemm_read, KB_ERR_OOM,
             "out of memory");
    for (int32_t v = 0; v < b->n; v++) b->reg[v] = b->dep[v] = -1;

    KB_TRY(fuse_mark_reads(b));
    for (int32_t v = 0; v < b->n; v++) KB_TRY(assign(b, v));
    for (int32_t r = 0; r < b->nreg; r++)
        if (colsum_ok(b, r)) make_row_colsum(b, r);
    /* a graph output that is a constant or a folded view still needs a kernel to write it */
    for (int32_t i = 0; i < kb_graph_noutputs(g); i++) {
        int32_t v = kb_graph_output(g, i);
        if (!b->floating[v] || b->reg[v] >= 0) continue;
        int32_t q;
        KB_TRY(new_region(b, KB_REGION_POINTWISE, v, 0, &q));
        b->reg[v] = q;
        b->lvl[v] = LV_FULL;
    }
cleanup:
    return st;
}
