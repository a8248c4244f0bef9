/* save.c — the forward's save policy (the saved-tensor policy's C half, kb_partition_save_stats):
 * what a forward's ROW regions keep for their backward, row statistics or their own outputs. It
 * builds each region's backward both ways to decide, so it lives with autodiff: fusion makes the
 * partition and never calls autodiff. */
#include "core/internal.h"

/* ---------------------------------------------------------------- row statistics */

enum { KB_MAX_SAVED = 4 };

/* A row's bytes at the graph's example sizes, 4 per element (the kernels reduce in f32). */
static int64_t row_bytes(const kb_graph *g, const kb_node *red)
{
    int64_t symvals[KB_MAX_SYMS] = {0}, n = 4;
    for (int32_t s = 0; s < kb_graph_nsymbols(g) && s < KB_MAX_SYMS; s++) symvals[s] = kb_graph_symbol_example(g, s);
    const kb_node *in = kb_graph_node(g, red->inputs[0]);
    for (int32_t d = 0; d < in->rank; d++)
        if (red->axes & (1u << d)) n *= kb_dim_eval(in->dims[d], symvals);
    return n;
}

/* Is statistic v broadcast back over the row (an expand reads it, or per-row work on it):
 * are the row's elements computed from it? Then a backward needs it per element, and without
 * it would reduce the row again. A sum that only feeds a per-row result (a mean loss) is not. */
static int broadcast_back(const kb_partition *p, const kb_region *rg, int32_t v)
{
    const kb_graph *g = p->graph;
    const kb_node *stat = kb_graph_node(g, v);
    int32_t n = kb_graph_nnodes(g);
    uint8_t *from = kb_calloc(kb_graph_ctx(g), (size_t)(n ? n : 1), 1);
    if (!from) return 1; /* out of memory: saving is the safe answer (never wrong, at most idle) */
    from[v] = 1;
    int found = 0;
    for (int32_t k = 0; k < rg->nnodes && !found; k++) {
        int32_t u = rg->nodes[k];
        const kb_node *nd = kb_graph_node(g, u);
        int reads = 0;
        for (int i = 0; i < nd->ninputs; i++) reads |= from[nd->inputs[i]];
        if (!reads || u == v) continue;
        if (nd->op == KB_OP_EXPAND) found = 1;
        else if (nd->rank == stat->rank) {
            int same = 1;
            for (int d = 0; d < nd->rank; d++) same &= kb_dim_equal(nd->dims[d], stat->dims[d]);
            from[u] = (uint8_t)same;
        }
    }
    kb_free(kb_graph_ctx(g), from, (size_t)(n ? n : 1));
    return found;
}

/* Bytes bwd reads: its inputs that a node or an output uses, at the example sizes; *uses gets bit
 * k set where input first + k is used (k < 32). */
static int64_t bytes_read(const kb_graph *bwd, int32_t first, uint32_t *uses)
{
    int64_t symvals[KB_MAX_SYMS] = {0}, sizes[KB_MAX_RANK], total = 0;
    for (int32_t s = 0; s < kb_graph_nsymbols(bwd) && s < KB_MAX_SYMS; s++) symvals[s] = kb_graph_symbol_example(bwd, s);
    *uses = 0;
    for (int32_t i = 0; i < kb_graph_ninputs(bwd); i++) {
        int32_t in = kb_graph_input(bwd, i), used = 0;
        for (int32_t v = 0; v < kb_graph_nnodes(bwd) && !used; v++) {
            const kb_node *nd = kb_graph_node(bwd, v);
            for (int k = 0; k < nd->ninputs; k++) used |= nd->inputs[k] == in;
        }
        for (int32_t j = 0; j < kb_graph_noutputs(bwd); j++) used |= kb_graph_output(bwd, j) == in;
        if (!used) continue;
        total += kb_value_sizes(bwd, in, symvals, sizes) * (int64_t)kb_dtype_size(kb_graph_node(bwd, in)->dtype);
        if (i >= first && i - first < 32) *uses |= 1u << (i - first);
    }
    return total;
}

/* Does region r's backward read its outputs (rg->saved_outputs), and then still its statistics?
 * Where the backward needs a value an output holds (a log_softmax's: its output, which simplify
 * writes it in terms of), reading it can replace reading the region's inputs and statistics.
 * The backward of every float input is built both ways; the outputs are read where that reads
 * fewer bytes, and the statistics are not saved where it reads none of them (then what the
 * backward keeps is what eager's keeps). A backward that cannot be built is left to the runtime,
 * which says why. */
static kb_status choose_reads(kb_partition *p, int32_t r, int32_t *keep_stats)
{
    kb_ctx *ctx = kb_graph_ctx(p->graph);
    kb_status st = KB_OK;
    kb_region *rg = &p->regions[r];
    int32_t nreal = rg->noutputs - rg->nsaved, nin = rg->ninputs, any = 0;
    uint32_t all = 0, outs_read = 0, plain_reads = 0, reads = 0;
    *keep_stats = 1;
    for (int32_t k = 0; k < nreal && k < 32; k++)
        if (kb_dtype_is_float(kb_graph_node(p->graph, rg->outputs[k])->dtype)) all |= 1u << k;
    kb_graph *fg = NULL, *plain = NULL, *reading = NULL;
    uint8_t *wrt = kb_calloc(ctx, (size_t)(nin ? nin : 1), 1);
    KB_CHECK(ctx, wrt != NULL, KB_ERR_OOM, "save_stats: out of memory");
    for (int32_t i = 0; i < nin; i++) any |= wrt[i] = (uint8_t)kb_dtype_is_float(kb_graph_node(p->graph, rg->inputs[i])->dtype);
    if (!all || !any) goto cleanup;
    KB_TRY(kb_region_graph(p, r, &fg));
    st = kb_graph_grad_saved(fg, wrt, rg->nsaved, 0, &plain);
    if (st == KB_OK) st = kb_graph_grad_saved(fg, wrt, rg->nsaved, all, &reading);
    if (st != KB_OK) {
        st = st == KB_ERR_OOM ? st : KB_OK;
        goto cleanup;
    }
    if (bytes_read(reading, nin, &reads) >= bytes_read(plain, nin, &plain_reads)) goto cleanup;
    for (int32_t k = 0, j = 0; k < nreal && k < 32; k++) /* out<k> inputs follow the statistics */
        if (all >> k & 1u) outs_read |= (reads >> (rg->nsaved + j++) & 1u) << k;
    rg->saved_outputs = outs_read;
    *keep_stats = rg->nsaved < 32 && (reads & ((1u << rg->nsaved) - 1u)) != 0;
cleanup:
    kb_free(ctx, wrt, (size_t)(nin ? nin : 1));
    kb_graph_free(fg);
    kb_graph_free(plain);
    kb_graph_free(reading);
    return st;
}

/* MATMUL nodes of region r's backward (its graph's float inputs differentiated), or -1 where it
 * cannot be built. */
static kb_status backward_products(kb_partition *p, int32_t r, int32_t *count)
{
    kb_ctx *ctx = kb_graph_ctx(p->graph);
    kb_status st = KB_OK;
    const kb_region *rg = &p->regions[r];
    kb_graph *fg = NULL, *bwd = NULL;
    uint8_t *wrt = kb_calloc(ctx, (size_t)(rg->ninputs ? rg->ninputs : 1), 1);
    KB_CHECK(ctx, wrt != NULL, KB_ERR_OOM, "save_stats: out of memory");
    for (int32_t i = 0; i < rg->ninputs; i++) wrt[i] = (uint8_t)kb_dtype_is_float(kb_graph_node(p->graph, rg->inputs[i])->dtype);
    *count = -1;
    KB_TRY(kb_region_graph(p, r, &fg));
    st = kb_graph_grad_saved(fg, wrt, rg->nsaved, 0, &bwd);
    if (st != KB_OK) {
        st = st == KB_ERR_OOM ? st : KB_OK;
        goto cleanup;
    }
    *count = 0;
    for (int32_t v = 0; v < kb_graph_nnodes(bwd); v++) *count += kb_graph_node(bwd, v)->op == KB_OP_MATMUL;
cleanup:
    kb_free(ctx, wrt, (size_t)(rg->ninputs ? rg->ninputs : 1));
    kb_graph_free(fg);
    kb_graph_free(bwd);
    return st;
}

/* Undo a trial save: the region's outputs without its last rg->nsaved (the saved values). */
static kb_status drop_saved(kb_ctx *ctx, kb_region *rg)
{
    kb_status st = KB_OK;
    int32_t nown = rg->noutputs - rg->nsaved;
    int32_t *own = kb_malloc(ctx, sizeof(int32_t) * (size_t)(nown ? nown : 1));
    KB_CHECK(ctx, own != NULL, KB_ERR_OOM, "save_stats: out of memory");
    if (nown) memcpy(own, rg->outputs, sizeof(int32_t) * (size_t)nown);
    kb_free(ctx, rg->outputs, sizeof(int32_t) * (size_t)rg->noutputs);
    rg->outputs = own;
    rg->noutputs = nown;
    rg->nsaved = 0;
cleanup:
    return st;
}

/* A GEMM region whose backward needs its product (a GELU epilogue's derivative reads the
 * pre-activation) would recompute the whole product from the operands: the product is saved
 * instead (one extra output, counted by nsaved), where the backward then has fewer MATMULs. A
 * bias or residual epilogue needs no saved product, and a product that is an output already is
 * read as one. */
static kb_status save_gemm_product(kb_partition *p, int32_t r)
{
    kb_ctx *ctx = kb_graph_ctx(p->graph);
    kb_status st = KB_OK;
    kb_region *rg = &p->regions[r];
    int32_t mm = rg->gemm.matmul, before, after;
    for (int32_t j = 0; j < rg->noutputs; j++)
        if (rg->outputs[j] == mm) return KB_OK;
    if (rg->gemm.nepilogue == 0 || kb_region_param_bytes(p, r) + 8 > KB_MAX_PARAM_BYTES) return KB_OK;
    KB_TRY(backward_products(p, r, &before));
    if (before < 0) return KB_OK;
    int32_t *outs = kb_malloc(ctx, sizeof(int32_t) * (size_t)(rg->noutputs + 1));
    KB_CHECK(ctx, outs != NULL, KB_ERR_OOM, "save_stats: out of memory");
    if (rg->noutputs) memcpy(outs, rg->outputs, sizeof(int32_t) * (size_t)rg->noutputs);
    outs[rg->noutputs] = mm;
    kb_free(ctx, rg->outputs, sizeof(int32_t) * (size_t)(rg->noutputs ? rg->noutputs : 1));
    rg->outputs = outs;
    rg->noutputs++;
    rg->nsaved = 1;
    KB_TRY(backward_products(p, r, &after));
    if (after < 0 || after >= before) /* no product recomputed: keep the region's own outputs */
        KB_TRY(drop_saved(ctx, rg));
cleanup:
    return st;
}

kb_status kb_partition_save_stats(kb_partition *p, int64_t min_row_bytes)
{
    if (!p || !p->graph) return KB_ERR_INVALID;
    kb_ctx *ctx = kb_graph_ctx(p->graph);
    kb_status st = KB_OK;
    for (int32_t r = 0; r < p->nregions; r++) {
        kb_region *rg = &p->regions[r];
        if (rg->kind == KB_REGION_GEMM && rg->nsaved == 0) KB_TRY(save_gemm_product(p, r));
        if (rg->kind != KB_REGION_ROW || rg->nsaved > 0) continue;
        int32_t stats[KB_MAX_SAVED], ns = 0;
        for (int32_t k = 0; k < rg->nnodes && ns < KB_MAX_SAVED; k++) {
            int32_t v = rg->nodes[k], is_out = 0;
            const kb_node *nd = kb_graph_node(p->graph, v);
            /* a row's own reduction (not a column sum folded into the row kernel), in float */
            if (kb_op_get(nd->op)->kind != KB_KIND_REDUCE || !kb_dtype_is_float(nd->dtype) ||
                p->region_of[v] != r || nd->axes != rg->reduce_axes || row_bytes(p->graph, nd) < min_row_bytes ||
                !broadcast_back(p, rg, v))
                continue;
            for (int32_t j = 0; j < rg->noutputs; j++) is_out |= rg->outputs[j] == v;
            if (!is_out) stats[ns++] = v;
        }
        /* a statistic is a kernel parameter too: none past CUDA's parameter space (the
           backward then reduces the row again) */
        while (ns > 0 && kb_region_param_bytes(p, r) + 8 * (int64_t)ns > KB_MAX_PARAM_BYTES) ns--;
        if (ns == 0) continue;
        int32_t *outs = kb_malloc(ctx, sizeof(int32_t) * (size_t)(rg->noutputs + ns));
        KB_CHECK(ctx, outs != NULL, KB_ERR_OOM, "save_stats: out of memory");
        if (rg->noutputs) memcpy(outs, rg->outputs, sizeof(int32_t) * (size_t)rg->noutputs);
        memcpy(outs + rg->noutputs, stats, sizeof(int32_t) * (size_t)ns);
        kb_free(ctx, rg->outputs, sizeof(int32_t) * (size_t)(rg->noutputs ? rg->noutputs : 1));
        rg->outputs = outs;
        rg->noutputs += ns;
        rg->nsaved = ns;
        int32_t keep = 1;
        KB_TRY(choose_reads(p, r, &keep));
        if (!keep) /* the backward reads outputs instead: back to the region's own outputs */
            KB_TRY(drop_saved(ctx, rg));
    }
cleanup:
    return st;
}
