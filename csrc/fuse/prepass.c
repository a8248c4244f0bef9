/* prepass.c — the partitioner's pre-passes: facts about how each value is read, settled over the
 * whole graph before the greedy pass (fuse.c) places any node, which its float rules and GEMM
 * gates then consult (fuse_build's index_read, lone_read, input_work, gemm_read). */
#include "fuse/fuse.h"

static const kb_node *N(const fuse_build *b, int32_t v) { return kb_graph_node(b->g, v); }

static int is_one(kb_dim d) { return d.coef == 1 && d.nsym == 0; }

/* The pre-pass behind float_prologue and the GEMM gates in assign: which values a MATMUL reads as
 * an operand, directly or through views (GR_SOME), and of those, which nothing else reads and no
 * graph output is (GR_ONLY); the views on the way are marked too. Readers have larger ids, so one
 * backward sweep settles each value after all of its readers. */
static kb_status mark_gemm_reads(fuse_build *b) {
    size_t n1 = (size_t)(b->n ? b->n : 1);
    uint8_t *other = kb_calloc(b->ctx, n1, 1);
    if (!other) return KB_ERR_OOM;
    for (int32_t i = 0; i < kb_graph_noutputs(b->g); i++) other[kb_graph_output(b->g, i)] = 1;
    for (int32_t v = b->n - 1; v >= 0; v--) {
        const kb_node *nd = N(b, v);
        if (b->gemm_read[v] && other[v]) b->gemm_read[v] = GR_SOME;
        int view = kb_op_get(nd->op)->kind == KB_KIND_VIEW;
        for (int i = 0; i < nd->ninputs; i++) {
            int32_t u = nd->inputs[i];
            if (nd->op == KB_OP_MATMUL || (view && b->gemm_read[v])) {
                if (!b->gemm_read[u]) b->gemm_read[u] = GR_ONLY;
                if (view && b->gemm_read[v] == GR_SOME) other[u] = 1;
            } else {
                other[u] = 1;
            }
        }
    }
    for (int32_t v = 0; v < b->n; v++)
        if (b->gemm_read[v] && other[v]) b->gemm_read[v] = GR_SOME;
    kb_free(b->ctx, other, n1);
    return KB_OK;
}

/* The pre-pass behind float_input_work: pointwise work whose every operand is, through pointwise
 * work and views, a graph input, a constant or an iota, reading at most two full-size user
 * inputs (a per-row statistic or a parameter does not count), not a graph output, and read only
 * by pointwise work and reductions. Recomputed in each region that reads it, it costs the reads
 * of those inputs, which the region mostly makes anyway; materialized, a full write and a read
 * per reading region. A backward that reads its saved statistics is such work throughout: x -
 * mean, dy * w, dy * w * xhat, read by the column sums for dw and db and by the row sums for dx.
 * Joined to the first region that reads it (the column sums), four full-size values were
 * written there and read back by the row kernel, which had no inputs of its own to recompute
 * them from. */
static kb_status mark_input_work(fuse_build *b) {
    enum { IMPURE = 3 };
    size_t n1 = (size_t)(b->n ? b->n : 1);
    int32_t(*src)[2] = kb_malloc(b->ctx, sizeof *src * n1);
    uint8_t *cnt = kb_calloc(b->ctx, n1, 1), *bad_reader = kb_calloc(b->ctx, n1, 1);
    if (!src || !cnt || !bad_reader) {
        kb_free(b->ctx, src, sizeof *src * n1);
        kb_free(b->ctx, cnt, n1);
        kb_free(b->ctx, bad_reader, n1);
        return KB_ERR_OOM;
    }
    for (int32_t v = 0; v < b->n; v++) {
        const kb_node *nd = N(b, v);
        enum node_class cls = fuse_classify(nd);
        if (nd->op == KB_OP_INPUT) {
            int per_row = 0;
            for (int d = 0; d < nd->rank && nd->rank >= 2; d++) per_row |= is_one(nd->dims[d]);
            if (nd->input_kind == KB_INPUT_USER && !per_row) src[v][0] = v, cnt[v] = 1;
        } else if (nd->op == KB_OP_CONST || nd->op == KB_OP_IOTA) {
            cnt[v] = 0;
        } else if (cls == C_POINTWISE || cls == C_RESHAPE || cls == C_EXPAND || cls == C_VIEW) {
            for (int i = 0; i < nd->ninputs && cnt[v] != IMPURE; i++) {
                int32_t u = nd->inputs[i];
                if (cnt[u] == IMPURE) cnt[v] = IMPURE;
                for (int k = 0; k < cnt[u] && cnt[v] != IMPURE; k++) {
                    int seen = 0;
                    for (int j = 0; j < cnt[v]; j++) seen |= src[v][j] == src[u][k];
                    if (seen) continue;
                    if (cnt[v] == 2) cnt[v] = IMPURE;
                    else src[v][cnt[v]++] = src[u][k];
                }
            }
        } else {
            cnt[v] = IMPURE;
        }
        for (int i = 0; i < nd->ninputs; i++)
            if (cls != C_POINTWISE && cls != C_REDUCE) bad_reader[nd->inputs[i]] = 1;
    }
    for (int32_t i = 0; i < kb_graph_noutputs(b->g); i++) bad_reader[kb_graph_output(b->g, i)] = 1;
    for (int32_t v = 0; v < b->n; v++)
        b->input_work[v] = fuse_classify(N(b, v)) == C_POINTWISE && cnt[v] >= 1 && cnt[v] <= 2 && !bad_reader[v];
    kb_free(b->ctx, src, sizeof *src * n1);
    kb_free(b->ctx, cnt, n1);
    kb_free(b->ctx, bad_reader, n1);
    return KB_OK;
}

/* The pre-pass behind float_lone_read: a chain of pointwise work, each link read once, on graph
 * inputs, constants and iotas (through views), not a graph output, whose last link's reader is
 * pointwise work on another region's result. The one region that reads it recomputes it from
 * inputs it reads in its place; materialized, it would cost a full write and read (a backward's
 * exp(x - saved max) in a kernel of its own, read back by the kernel that scales it by a per-row
 * value). A broadcast of computed work (that per-row value) is another region's result, or
 * another level of the same region. A chain that reads other computed work is left where that
 * work is: floated, it would depend on that work's region and could not join it (a row kernel's
 * per-row arithmetic on its targets). */
static kb_status mark_lone_reads(fuse_build *b) {
    enum { FROM = 1, LEAF = 2, PURE = 4 };
    size_t n1 = (size_t)(b->n ? b->n : 1);
    uint8_t *f = kb_calloc(b->ctx, n1, 1), *readers = kb_calloc(b->ctx, n1, 1);
    int32_t *reader = kb_malloc(b->ctx, sizeof(int32_t) * n1);
    if (!f || !readers || !reader) {
        kb_free(b->ctx, f, n1);
        kb_free(b->ctx, readers, n1);
        kb_free(b->ctx, reader, sizeof(int32_t) * n1);
        return KB_ERR_OOM;
    }
    for (int32_t v = 0; v < b->n; v++) reader[v] = -1;
    for (int32_t v = 0; v < b->n; v++) {
        const kb_node *nd = N(b, v);
        enum node_class cls = fuse_classify(nd);
        if (nd->op == KB_OP_INPUT || nd->op == KB_OP_CONST || nd->op == KB_OP_IOTA) {
            f[v] = FROM | LEAF;
        } else if (cls == C_RESHAPE || cls == C_EXPAND || cls == C_VIEW) {
            const kb_node *a = N(b, nd->inputs[0]);
            f[v] = f[nd->inputs[0]] & (FROM | LEAF);
            if (cls == C_EXPAND && !(f[v] & LEAF))
                for (int d = 0; d < nd->rank; d++)
                    if (!kb_dim_equal(a->dims[d], nd->dims[d])) f[v] = 0; /* a broadcast of work */
        } else if (cls == C_POINTWISE) {
            f[v] = FROM;
            for (int i = 0; i < nd->ninputs; i++) f[v] &= f[nd->inputs[i]];
        }
        for (int i = 0; i < nd->ninputs; i++) { /* 2: more than one reader, or one needing it whole */
            int32_t u = nd->inputs[i];
            readers[u] = cls == C_POINTWISE && readers[u] == 0 ? 1 : 2;
            reader[u] = v;
        }
    }
    for (int32_t i = 0; i < kb_graph_noutputs(b->g); i++) readers[kb_graph_output(b->g, i)] = 2;
    /* PURE: pointwise work on leaves and on PURE work read once (the links of a chain) */
    for (int32_t v = 0; v < b->n; v++) {
        const kb_node *nd = N(b, v);
        if (fuse_classify(nd) != C_POINTWISE) continue;
        int pure = 1;
        for (int i = 0; i < nd->ninputs; i++) {
            uint8_t fu = f[nd->inputs[i]];
            pure &= (fu & LEAF) || ((fu & PURE) && readers[nd->inputs[i]] == 1);
        }
        if (pure) f[v] |= PURE;
    }
    /* readers before the values they read: a chain floats link by link into the region whose
     * result its last link reads (not into work on inputs alone: that chain fuses as it is) */
    for (int32_t v = b->n - 1; v >= 0; v--) {
        int32_t w = reader[v];
        b->lone_read[v] = (f[v] & PURE) && readers[v] == 1 && (!(f[w] & FROM) || b->lone_read[w]);
    }
    kb_free(b->ctx, f, n1);
    kb_free(b->ctx, readers, n1);
    kb_free(b->ctx, reader, sizeof(int32_t) * n1);
    return KB_OK;
}

/* The pre-pass behind float_index_read: pointwise values computed from graph inputs by
 * pointwise work and views alone, and read only as the table of gathers whose index is
 * arithmetic on iotas and constants (a slice's adjoint read back at coordinate - start) or by
 * other such values. Materialized, one costs a full write and read; recomputed at the index the
 * gather reads, it costs what computing it costs. So the two half gradients of x.chunk(2)
 * (swiglu) are computed inside the one kernel that writes dx. */
static kb_status mark_index_reads(fuse_build *b) {
    enum { PURE_INDEX = 1, FROM_INPUTS = 2, USED = 4, NEEDED = 8 };
    size_t n1 = (size_t)(b->n ? b->n : 1);
    uint8_t *f = kb_calloc(b->ctx, n1, 1);
    if (!f) return KB_ERR_OOM;
    for (int32_t v = 0; v < b->n; v++) {
        const kb_node *nd = N(b, v);
        enum node_class cls = fuse_classify(nd);
        if (nd->op == KB_OP_INPUT) {
            f[v] = FROM_INPUTS;
        } else if (nd->op == KB_OP_CONST || nd->op == KB_OP_IOTA) {
            f[v] = PURE_INDEX | FROM_INPUTS;
        } else if (cls == C_POINTWISE || cls == C_RESHAPE || cls == C_EXPAND || cls == C_VIEW) {
            uint8_t all = PURE_INDEX | FROM_INPUTS;
            for (int i = 0; i < nd->ninputs; i++) all &= f[nd->inputs[i]];
            f[v] = all;
        }
    }
    for (int32_t i = 0; i < kb_graph_noutputs(b->g); i++) f[kb_graph_output(b->g, i)] |= NEEDED;
    for (int32_t w = b->n - 1; w >= 0; w--) { /* every consumer of w is settled before w */
        const kb_node *nd = N(b, w);
        enum node_class cls = fuse_classify(nd);
        b->index_read[w] = (cls == C_POINTWISE || cls == C_RESHAPE || cls == C_EXPAND || cls == C_VIEW) &&
                           (f[w] & (FROM_INPUTS | USED | NEEDED)) == (FROM_INPUTS | USED);
        for (int i = 0; i < nd->ninputs; i++) {
            int32_t u = nd->inputs[i];
            int by_index = nd->op == KB_OP_GATHER && i == 0 && (f[nd->inputs[1]] & PURE_INDEX);
            f[u] |= USED;
            if (!b->index_read[w] && !by_index) f[u] |= NEEDED;
        }
    }
    kb_free(b->ctx, f, n1);
    return KB_OK;
}

kb_status fuse_mark_reads(fuse_build *b) {
    kb_status st;
    if ((st = mark_index_reads(b)) != KB_OK) return st;
    if ((st = mark_lone_reads(b)) != KB_OK) return st;
    if ((st = mark_input_work(b)) != KB_OK) return st;
    return mark_gemm_reads(b);
}
