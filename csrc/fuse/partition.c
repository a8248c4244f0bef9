/* partition.c — the kb_partition: assembled from fuse.c's per-node assignment (each region's
 * nodes, the values it reads and the values it writes), regions split until each kernel's
 * parameters fit CUDA's parameter space, its text form (kb_partition_dump), and
 * one region as a standalone graph (kb_region_graph), what a region's backward is built from and
 * what the runtime's cache keys and gradient checks compare. */
#include "fuse/fuse.h"

/* ---------------------------------------------------------------- assembling the regions */

static kb_status fill_list(kb_ctx *ctx, int32_t **arr, int32_t *count, const int32_t *src, int32_t n) {
    *count = n;
    *arr = kb_malloc(ctx, sizeof(int32_t) * (size_t)(n ? n : 1));
    if (!*arr) return KB_ERR_OOM;
    if (n) memcpy(*arr, src, sizeof(int32_t) * (size_t)n);
    return KB_OK;
}

/* Marks the floating operands (and their chains) a region member reads. */
static void mark_floating(const fuse_build *b, uint8_t *mark, int32_t v) {
    const kb_node *nd = kb_graph_node(b->g, v);
    for (int i = 0; i < nd->ninputs; i++) {
        int32_t u = nd->inputs[i];
        if (b->floating[u] && !mark[u]) {
            mark[u] = 1;
            mark_floating(b, mark, u);
        }
    }
}

void kb_partition_free(kb_partition *p) {
    if (!p) return;
    kb_ctx *ctx = kb_graph_ctx(p->graph);
    for (int32_t r = 0; r < p->nregions; r++) {
        kb_region *rg = &p->regions[r];
        kb_free(ctx, rg->nodes, sizeof(int32_t) * (size_t)(rg->nnodes ? rg->nnodes : 1));
        kb_free(ctx, rg->inputs, sizeof(int32_t) * (size_t)(rg->ninputs ? rg->ninputs : 1));
        kb_free(ctx, rg->outputs, sizeof(int32_t) * (size_t)(rg->noutputs ? rg->noutputs : 1));
        kb_free(ctx, rg->gemm.epilogue, sizeof(int32_t) * (size_t)(rg->gemm.nepilogue ? rg->gemm.nepilogue : 1));
    }
    kb_free(ctx, p->regions, sizeof(kb_region) * (size_t)(p->nregions ? p->nregions : 1));
    kb_free(ctx, p->region_of, sizeof(int32_t) * (size_t)(p->nnodes ? p->nnodes : 1));
    kb_free(ctx, p, sizeof *p);
}

/* How MATMUL operand k reaches it from its source: back through the floating index maps (PERMUTE,
 * EXPAND, RESHAPE that keeps the trailing dims) and cheap prologue work, tracking where the
 * operand's dims sit in each value (-1: merged away by a reshape), to the first value computed in
 * some region or read from outside. Its layout is where the operand's last two dims sit in the
 * source; its broadcast, the batch dims an EXPAND grew. */
static void gemm_operand(const fuse_build *b, int32_t mm, int k, kb_gemm_info *gi) {
    const kb_graph *g = b->g;
    int32_t u = kb_graph_node(g, mm)->inputs[k];
    int rank = kb_graph_node(g, mm)->rank;
    int pos[KB_MAX_RANK]; /* operand dim d is dim pos[d] of u */
    for (int d = 0; d < rank; d++) pos[d] = d;
    gi->bcast[k] = 0;
    gi->prologue[k] = 0;
    while (b->floating[u] && kb_graph_node(g, u)->op != KB_OP_INPUT) {
        const kb_node *nd = kb_graph_node(g, u);
        const kb_node *a = nd->ninputs > 0 ? kb_graph_node(g, nd->inputs[0]) : NULL;
        if (nd->op == KB_OP_PERMUTE) {
            for (int d = 0; d < rank; d++)
                if (pos[d] >= 0) pos[d] = nd->perm[pos[d]];
        } else if (nd->op == KB_OP_EXPAND) {
            for (int d = 0; d < rank - 2; d++)
                if (pos[d] >= 0 && !kb_dim_equal(a->dims[pos[d]], nd->dims[pos[d]])) gi->bcast[k] |= 1u << d;
        } else if (nd->op == KB_OP_RESHAPE) {
            /* dims counted from the end keep their place while both shapes agree there */
            int keep = 0;
            while (keep < nd->rank && keep < a->rank &&
                   kb_dim_equal(nd->dims[nd->rank - 1 - keep], a->dims[a->rank - 1 - keep]))
                keep++;
            for (int d = 0; d < rank; d++)
                if (pos[d] >= 0) pos[d] = pos[d] >= nd->rank - keep ? pos[d] - nd->rank + a->rank : -1;
        } else if (kb_op_get(nd->op)->kind != KB_KIND_VIEW && fuse_cheap_prologue(g, u)) {
            gi->prologue[k] = 1; /* follow the tensor operand, not the constant */
            int32_t t = nd->inputs[0], w = t;
            while (kb_op_get(kb_graph_node(g, w)->op)->kind == KB_KIND_VIEW) w = kb_graph_node(g, w)->inputs[0];
            if (nd->ninputs > 1 && kb_graph_node(g, w)->op == KB_OP_CONST) t = nd->inputs[1];
            u = t;
            continue;
        } else {
            break;
        }
        u = nd->inputs[0];
    }
    int last = kb_graph_node(g, u)->rank - 1;
    gi->source[k] = u;
    gi->layout[k] = pos[rank - 1] == last ? KB_GEMM_ROW : pos[rank - 2] == last ? KB_GEMM_TRANS : KB_GEMM_STRIDED;
}

/* A GEMM region's facts (kb_gemm_info): operands and the epilogue, the region's own nodes after
 * its MATMUL in node order. */
static kb_status gemm_facts(const fuse_build *b, int32_t r, kb_region *rg) {
    kb_gemm_info *gi = &rg->gemm;
    gi->matmul = b->regs[r].anchor;
    gemm_operand(b, gi->matmul, 0, gi);
    gemm_operand(b, gi->matmul, 1, gi);
    int32_t n = 0;
    for (int32_t v = gi->matmul + 1; v < b->n; v++) n += !b->floating[v] && b->reg[v] == r;
    gi->epilogue = kb_malloc(b->ctx, sizeof(int32_t) * (size_t)(n ? n : 1));
    if (!gi->epilogue) return KB_ERR_OOM;
    gi->nepilogue = n;
    n = 0;
    for (int32_t v = gi->matmul + 1; v < b->n; v++)
        if (!b->floating[v] && b->reg[v] == r) gi->epilogue[n++] = v;
    return KB_OK;
}

/* The greedy pass (with the nodes flagged in cut starting regions) assembled into a partition. */
static kb_status assemble(const kb_graph *g, const uint8_t *cut, kb_partition **out) {
    *out = NULL;
    kb_ctx *ctx = kb_graph_ctx(g);
    kb_status st = KB_OK;
    fuse_build b;
    memset(&b, 0, sizeof b);
    uint8_t *mark = NULL, *is_out = NULL;
    int32_t *tmp = NULL, *tmp2 = NULL;
    kb_partition *p = NULL;
    size_t n1 = (size_t)(kb_graph_nnodes(g) ? kb_graph_nnodes(g) : 1);
    KB_TRY(fuse_assign(g, cut, &b));
    mark = kb_calloc(ctx, n1, 1);
    is_out = kb_calloc(ctx, n1, 1);
    tmp = kb_malloc(ctx, sizeof(int32_t) * n1);
    tmp2 = kb_malloc(ctx, sizeof(int32_t) * n1);
    KB_CHECK(ctx, mark && is_out && tmp && tmp2, KB_ERR_OOM, "out of memory");

    p = kb_calloc(ctx, 1, sizeof *p);
    KB_CHECK(ctx, p != NULL, KB_ERR_OOM, "out of memory");
    p->graph = g;
    p->nnodes = kb_graph_nnodes(g);
    p->regions = kb_calloc(ctx, (size_t)(b.nreg ? b.nreg : 1), sizeof(kb_region));
    if (p->regions) p->nregions = b.nreg; /* kb_partition_free frees by this count */
    p->region_of = kb_malloc(ctx, sizeof(int32_t) * n1);
    KB_CHECK(ctx, p->regions && p->region_of, KB_ERR_OOM, "out of memory");
    for (int32_t v = 0; v < b.n; v++) p->region_of[v] = b.floating[v] ? -1 : b.reg[v];

    /* nodes: each region's own, and the floating values they read (copied into every region
     * that reads them); outputs: graph outputs, and values a node of another region reads,
     * directly or through floating values */
    for (int32_t i = 0; i < kb_graph_noutputs(g); i++) is_out[kb_graph_output(g, i)] = 1;
    for (int32_t r = 0; r < b.nreg; r++) {
        kb_region *rg = &p->regions[r];
        rg->kind = b.regs[r].kind;
        rg->anchor = b.regs[r].anchor;
        rg->reduce_axes = b.regs[r].red;
        if (rg->kind == KB_REGION_GEMM) KB_TRY(gemm_facts(&b, r, rg));
        memset(mark, 0, n1);
        for (int32_t v = 0; v < b.n; v++)
            if (b.reg[v] == r) {
                mark[v] = 1;
                mark_floating(&b, mark, v);
            }
        if (b.floating[rg->anchor]) mark[rg->anchor] = 1, mark_floating(&b, mark, rg->anchor);
        int32_t nn = 0;
        for (int32_t v = 0; v < b.n; v++)
            if (mark[v]) tmp[nn++] = v;
        KB_TRY(fill_list(ctx, &rg->nodes, &rg->nnodes, tmp, nn));
        for (int32_t k = 0; k < nn; k++) {
            const kb_node *nd = kb_graph_node(g, tmp[k]);
            for (int i = 0; i < nd->ninputs; i++) {
                int32_t u = nd->inputs[i];
                if (!b.floating[u] && b.reg[u] >= 0 && b.reg[u] != r) is_out[u] = 1;
            }
        }
    }
    for (int32_t r = 0; r < b.nreg; r++) {
        kb_region *rg = &p->regions[r];
        int32_t nn = rg->nnodes, ni = 0, no = 0;
        memset(mark, 0, n1);
        for (int32_t k = 0; k < nn; k++) mark[rg->nodes[k]] = 1;
        /* inputs: operands outside the region, in id order */
        for (int32_t k = 0; k < nn; k++) {
            const kb_node *nd = kb_graph_node(g, rg->nodes[k]);
            for (int i = 0; i < nd->ninputs; i++) {
                int32_t u = nd->inputs[i];
                if (!mark[u]) mark[u] = 2;
            }
        }
        if (mark[rg->anchor] == 0) mark[rg->anchor] = 2; /* an INPUT anchor is read */
        for (int32_t v = 0; v < b.n; v++)
            if (mark[v] == 2) tmp2[ni++] = v;
        KB_TRY(fill_list(ctx, &rg->inputs, &rg->ninputs, tmp2, ni));
        for (int32_t k = 0; k < nn; k++) {
            int32_t v = rg->nodes[k];
            if (is_out[v] && b.reg[v] == r) tmp2[no++] = v;
        }
        KB_TRY(fill_list(ctx, &rg->outputs, &rg->noutputs, tmp2, no));
        /* a floating node lives in several regions; region_of names the first one */
        for (int32_t k = 0; k < nn; k++)
            if (p->region_of[rg->nodes[k]] < 0) p->region_of[rg->nodes[k]] = r;
    }
    *out = p;
    p = NULL;
cleanup:
    kb_partition_free(p);
    fuse_build_free(&b);
    kb_free(ctx, mark, n1);
    kb_free(ctx, is_out, n1);
    kb_free(ctx, tmp, sizeof(int32_t) * n1);
    kb_free(ctx, tmp2, sizeof(int32_t) * n1);
    return st;
}

int64_t kb_region_param_bytes(const kb_partition *p, int32_t r) {
    const kb_region *rg = &p->regions[r];
    return 8 * ((int64_t)rg->ninputs + rg->noutputs + kb_graph_nsymbols(p->graph) + 1);
}

/* Can a region be split at node v: work that may start a region (not an input, a constant, an
 * iota, a view folded into loads or a torch call)? */
static int splits_at(const kb_graph *g, int32_t v) {
    const kb_node *nd = kb_graph_node(g, v);
    kb_op_kind kind = kb_op_get(nd->op)->kind;
    return kind == KB_KIND_UNARY || kind == KB_KIND_BINARY || kind == KB_KIND_TERNARY || kind == KB_KIND_REDUCE ||
           kind == KB_KIND_GATHER;
}

/* Regions whose kernels' parameters would pass CUDA's KB_MAX_PARAM_BYTES (a sum of 600 inputs,
 * hundreds of parameters each scaled) would build and then never launch: such a region is cut at
 * its middle node that may start a region (splits_at), which then starts one, and the greedy pass
 * runs again; each part that still does not fit is cut again. Each round flags at least one more
 * node, so this ends; a region left with nothing to cut at fails. Graphs that fit (nearly all)
 * take one pass, as before. */
kb_status kb_partition_new(const kb_graph *g, kb_partition **out) {
    if (!g || !out) return KB_ERR_INVALID;
    *out = NULL;
    kb_ctx *ctx = kb_graph_ctx(g);
    kb_status st = KB_OK;
    size_t n1 = (size_t)(kb_graph_nnodes(g) ? kb_graph_nnodes(g) : 1);
    uint8_t *cut = NULL;
    int32_t *cand = NULL;
    kb_partition *p = NULL;
    for (;;) {
        KB_TRY(assemble(g, cut, &p));
        int over = 0;
        for (int32_t r = 0; r < p->nregions; r++) {
            const kb_region *rg = &p->regions[r];
            int64_t bytes = kb_region_param_bytes(p, r);
            if (rg->kind == KB_REGION_EXTERN || bytes <= KB_MAX_PARAM_BYTES) continue;
            if (!cut) {
                cut = kb_calloc(ctx, n1, 1);
                cand = kb_malloc(ctx, sizeof(int32_t) * n1);
                KB_CHECK(ctx, cut && cand, KB_ERR_OOM, "partition: out of memory");
            }
            int32_t nc = 0;
            for (int32_t k = 0; k < rg->nnodes; k++)
                if (!cut[rg->nodes[k]] && splits_at(g, rg->nodes[k])) cand[nc++] = rg->nodes[k];
            KB_CHECK(ctx, nc > 0, KB_ERR_UNSUPPORTED,
                     "partition: region %d reads %d values and writes %d: its kernel's parameters take %lld bytes, "
                     "more than CUDA's %d, and it has no node left to split it at",
                     (int)r, (int)rg->ninputs, (int)rg->noutputs, (long long)bytes, KB_MAX_PARAM_BYTES);
            cut[cand[nc / 2]] = 1;
            over = 1;
        }
        if (!over) break;
        kb_partition_free(p);
        p = NULL;
    }
    *out = p;
    p = NULL;
cleanup:
    kb_partition_free(p);
    kb_free(ctx, cut, n1);
    kb_free(ctx, cand, sizeof(int32_t) * n1);
    return st;
}

/* ---------------------------------------------------------------- text */

const char *kb_region_kind_name(kb_region_kind k) {
    static const char *const names[] = {"POINTWISE", "ROW", "COL", "EXTERN", "GEMM"};
    return (unsigned)k < 5 ? names[k] : "?";
}

static void id_list(kb_sb *sb, const int32_t *ids, int32_t n) {
    kb_sb_puts(sb, "(");
    for (int32_t i = 0; i < n; i++) kb_sb_printf(sb, "%s%%%d", i ? "," : "", ids[i]);
    kb_sb_puts(sb, ")");
}

kb_status kb_partition_dump(const kb_partition *p, char **out) {
    kb_sb sb;
    kb_sb_init(&sb, kb_graph_ctx(p->graph));
    for (int32_t r = 0; r < p->nregions; r++) {
        const kb_region *rg = &p->regions[r];
        kb_sb_printf(&sb, "region %d %s anchor=%%%d", r, kb_region_kind_name(rg->kind), rg->anchor);
        if (rg->kind == KB_REGION_ROW || rg->kind == KB_REGION_COL) {
            kb_sb_puts(&sb, " reduce=[");
            for (int d = 0, first = 1; d < 32; d++)
                if (rg->reduce_axes & (1u << d)) {
                    kb_sb_printf(&sb, "%s%d", first ? "" : ",", d);
                    first = 0;
                }
            kb_sb_puts(&sb, "]");
        }
        if (rg->kind == KB_REGION_GEMM) {
            static const char *const layouts[] = {"row", "trans", "strided"};
            const kb_gemm_info *gi = &rg->gemm;
            for (int k = 0; k < 2; k++) {
                kb_sb_printf(&sb, " %s=%%%d:%s", k ? "b" : "a", gi->source[k], layouts[gi->layout[k]]);
                if (gi->bcast[k]) kb_sb_printf(&sb, ":bcast=0x%x", (unsigned)gi->bcast[k]);
                if (gi->prologue[k]) kb_sb_puts(&sb, ":prologue");
            }
            kb_sb_puts(&sb, " epilogue=");
            id_list(&sb, gi->epilogue, gi->nepilogue);
        }
        kb_sb_puts(&sb, " in=");
        id_list(&sb, rg->inputs, rg->ninputs);
        kb_sb_puts(&sb, " out=");
        id_list(&sb, rg->outputs, rg->noutputs);
        if (rg->nsaved) kb_sb_printf(&sb, " saved=%d", (int)rg->nsaved);
        for (int k = 0; k < 32; k++)
            if (rg->saved_outputs >> k & 1u) kb_sb_printf(&sb, " reads_out%d", k);
        kb_sb_puts(&sb, "\n");
        for (int32_t k = 0; k < rg->nnodes; k++) {
            kb_sb_puts(&sb, "  ");
            kb_node_dump(&sb, p->graph, rg->nodes[k], KB_NAME_IR);
            kb_sb_puts(&sb, "\n");
        }
    }
    return kb_sb_finish(&sb, out);
}

/* ---------------------------------------------------------------- a region as a graph */

static int in_region(const kb_region *reg, int32_t v)
{
    for (int32_t k = 0; k < reg->nnodes; k++)
        if (reg->nodes[k] == v) return 1;
    return 0;
}

kb_status kb_region_graph(const kb_partition *p, int32_t r, kb_graph **out)
{
    if (!out) return KB_ERR_INVALID;
    *out = NULL;
    if (!p || !p->graph) return KB_ERR_INVALID;
    const kb_graph *g = p->graph;
    kb_ctx *ctx = kb_graph_ctx(g);
    kb_status st = KB_OK;
    int32_t n = kb_graph_nnodes(g);
    size_t cnt = n > 0 ? (size_t)n : 1;
    kb_graph *rg = NULL;
    int32_t *map = NULL;
    KB_CHECK(ctx, r >= 0 && r < p->nregions, KB_ERR_INVALID, "region %d of %d", (int)r, (int)p->nregions);
    const kb_region *reg = &p->regions[r];
    map = kb_malloc(ctx, cnt * sizeof(int32_t));
    KB_CHECK(ctx, map != NULL, KB_ERR_OOM, "region_graph: out of memory");
    for (int32_t v = 0; v < n; v++) map[v] = -1;
    KB_TRY(kb_graph_new(ctx, &rg));
    KB_TRY(kb_graph_copy_symbols(g, rg));
    for (int32_t k = 0; k < reg->ninputs; k++) {
        int32_t v = reg->inputs[k];
        KB_CHECK(ctx, v >= 0 && v < n && map[v] < 0, KB_ERR_INVALID,
                 "region %d: input %d is a bad or repeated value (%d)", (int)r, (int)k, (int)v);
        const kb_node *src = kb_graph_node(g, v);
        kb_node t = kb_node_template(KB_OP_INPUT, src->dtype, src->rank, src->dims);
        /* a parameter stays one: fusion floats parameter-only work (a weight's cast) into readers */
        t.input_kind = src->op == KB_OP_INPUT ? src->input_kind : KB_INPUT_USER;
        char name[32];
        snprintf(name, sizeof name, "in%d", (int)k);
        t.name = src->op == KB_OP_INPUT && src->name[0] ? src->name : name;
        KB_TRY(kb_graph_add(rg, &t, &map[v]));
    }
    /* Nodes in id order, except that a node with no operands (a constant, an iota) comes just
     * before its first reader: one that repeated blocks share sits before the first block only,
     * and the same region of every block must read the same (cache keys, gradient checks). */
    for (int32_t pass = 0; pass < 2; pass++) {
        for (int32_t k = 0; k < reg->nnodes; k++) {
            int32_t v = reg->nodes[k];
            KB_CHECK(ctx, v >= 0 && v < n, KB_ERR_INVALID, "region %d: node %d is a bad value (%d)", (int)r, (int)k, (int)v);
            if (map[v] >= 0) continue; /* one of the region's inputs, or emitted */
            const kb_node *src = kb_graph_node(g, v);
            KB_CHECK(ctx, src->op != KB_OP_INPUT, KB_ERR_INVALID,
                     "region %d holds graph input %d without listing it among its inputs", (int)r, (int)v);
            if (src->ninputs == 0 && pass == 0) continue; /* placed by its first reader (or pass 1) */
            kb_node t = *src;
            for (int i = 0; i < t.ninputs; i++) {
                int32_t u = t.inputs[i];
                if (map[u] < 0 && kb_graph_node(g, u)->ninputs == 0 && kb_graph_node(g, u)->op != KB_OP_INPUT &&
                    in_region(reg, u))
                    KB_TRY(kb_graph_add(rg, kb_graph_node(g, u), &map[u]));
                KB_CHECK(ctx, map[u] >= 0, KB_ERR_INVALID,
                         "region %d: node %d reads %d, which is neither in the region (before it) nor an input",
                         (int)r, (int)v, (int)u);
                t.inputs[i] = map[u];
            }
            KB_TRY(kb_graph_add(rg, &t, &map[v]));
        }
    }
    for (int32_t j = 0; j < reg->noutputs; j++) {
        int32_t v = reg->outputs[j];
        KB_CHECK(ctx, v >= 0 && v < n && map[v] >= 0, KB_ERR_INVALID,
                 "region %d: output %d (value %d) is not computed by the region", (int)r, (int)j, (int)v);
        KB_TRY(kb_graph_add_output(rg, map[v]));
    }
    *out = rg;
    rg = NULL;
cleanup:
    kb_free(ctx, map, cnt * sizeof(int32_t));
    kb_graph_free(rg);
    return st;
}
