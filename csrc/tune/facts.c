/* facts.c — the one analysis of a region that schedules are chosen from: its shape at the
 * example sizes, its bulk values, how often it reads its rows, and what fast math would change
 * (tune.h's tune_facts). genome.c picks the default genome from it, evolve.c the search's
 * domains and legality, so the default is always legal for the search. */
#include "tune/tune.h"

/* dep[] bits of the walk: the value reads a row reduction (column sums aside: multipass), a
 * reduction of any kind (rereads), or is computed in the region; a max already paired with a sum
 * of exp (online_pattern) */
enum { DEP_ROW_RED = 1, DEP_ANY_RED = 2, DEP_MEMBER = 4, DEP_PAIRED = 8 };

/* sum(exp(y - expand(max(y)))) over the same axes, all inside the region: what two_pass=0 turns
 * into one pass with an online normalizer (mirrors codegen/kernel.c's online_max_of). Returns the
 * max's id, or -1. */
static int32_t online_pattern(const kb_graph *g, const uint8_t *dep, const kb_node *S) {
    int32_t e = S->inputs[0];
    const kb_node *E = kb_graph_node(g, e);
    if (!(dep[e] & DEP_MEMBER) || E->op != KB_OP_EXP || !(dep[E->inputs[0]] & DEP_MEMBER)) return -1;
    const kb_node *D = kb_graph_node(g, E->inputs[0]);
    if (D->op != KB_OP_SUB || !(dep[D->inputs[1]] & DEP_MEMBER)) return -1;
    const kb_node *X = kb_graph_node(g, D->inputs[1]);
    if (X->op != KB_OP_EXPAND || !(dep[X->inputs[0]] & DEP_MEMBER)) return -1;
    const kb_node *M = kb_graph_node(g, X->inputs[0]);
    return M->op == KB_OP_RMAX && M->axes == S->axes && M->inputs[0] == D->inputs[0] ? X->inputs[0] : -1;
}

/* sum or mean of (y - expand(mean(y)))^2 over the same axes, all but y inside the region: the
 * squares about the mean, which a split row merges from each part's (count, sum, squares about
 * the part's own mean) (mirrors codegen/kernel.c's split_center). Returns the mean's id, or -1. */
static int32_t chan_pattern(const kb_graph *g, const uint8_t *dep, const kb_node *V) {
    if (V->op != KB_OP_SUM && V->op != KB_OP_MEAN) return -1;
    int32_t q = V->inputs[0];
    const kb_node *Q = kb_graph_node(g, q);
    if (!(dep[q] & DEP_MEMBER) || Q->op != KB_OP_MUL || Q->inputs[0] != Q->inputs[1] || !(dep[Q->inputs[0]] & DEP_MEMBER))
        return -1;
    const kb_node *D = kb_graph_node(g, Q->inputs[0]);
    if (D->op != KB_OP_SUB || !(dep[D->inputs[1]] & DEP_MEMBER)) return -1;
    const kb_node *X = kb_graph_node(g, D->inputs[1]);
    if (X->op != KB_OP_EXPAND || !(dep[X->inputs[0]] & DEP_MEMBER)) return -1;
    const kb_node *M = kb_graph_node(g, X->inputs[0]);
    return M->op == KB_OP_MEAN && M->axes == V->axes && M->inputs[0] == D->inputs[0] ? X->inputs[0] : -1;
}

kb_status tune_facts_of(const kb_partition *p, int32_t r, const int64_t *symvals, const kb_device_info *dev,
                        tune_facts *f) {
    const kb_graph *g = p->graph;
    kb_ctx *ctx = kb_graph_ctx(g);
    const kb_region *rg = &p->regions[r];
    const kb_node *a = kb_graph_node(g, rg->anchor);
    memset(f, 0, sizeof *f);
    if (rg->kind == KB_REGION_GEMM) /* the GEMM generator's schedule, not a genome of these genes */
        return KB_FAIL(ctx, KB_ERR_UNSUPPORTED, "facts: region %d is a GEMM region: its schedule is the GEMM kernel's",
                       (int)r);
    f->kind = rg->kind;
    f->full = f->red = f->kept = 1;
    f->red_pinned = 1;
    for (int d = 0; d < a->rank; d++) {
        int64_t s = kb_dim_eval(a->dims[d], symvals);
        f->full *= s;
        if (rg->reduce_axes & (1u << d)) {
            f->red *= s;
            if (a->dims[d].nsym) f->red_pinned = 0;
        } else {
            f->kept *= s;
        }
    }
    /* a varying last dim counts at the example's size: a ROW or COL kernel with vectors over it
       requires the size to stay a multiple of vec, which the launch checks (kb_kernel.last_multiple) */
    f->last = a->rank == 0 ? 1 : kb_dim_eval(a->dims[a->rank - 1], symvals);
    f->last_varies = a->rank > 0 && a->dims[a->rank - 1].nsym > 0;
    kb_device_info on = kb_device_for_schedule(dev);
    f->num_sms = on.num_sms;
    f->smem_cap = on.max_smem_per_block;

    /* bulk values first; all of them if none is */
    int64_t sizes[KB_MAX_RANK];
    int any = 0;
    for (int pass = 0; pass < 2 && !any; pass++) {
        for (int32_t i = 0; i < rg->ninputs + rg->noutputs; i++) {
            int32_t v = i < rg->ninputs ? rg->inputs[i] : rg->outputs[i - rg->ninputs];
            int bulk = kb_value_sizes(g, v, symvals, sizes) == f->full;
            if (!bulk && pass == 0) continue;
            int sz = (int)kb_dtype_size(kb_graph_node(g, v)->dtype);
            if (!any || sz < f->minsz) f->minsz = sz;
            if (sz > f->maxsz) f->maxsz = sz;
            any = 1;
            if (bulk && i < rg->ninputs) {
                f->nbulk_in++;
                f->bulk_in_bytes += sz;
            }
        }
    }
    if (f->minsz == 0) f->minsz = 4;
    if (f->maxsz == 0) f->maxsz = 4;

    /* Fast math by default where it cannot show: __expf/__logf are within ~1e-6 relative of
     * expf/logf over softmax's range, 1000x below a 16-bit output's rounding (bf16 2^-9), and the
     * precise expf is what keeps a bf16 softmax from the memory roofline (benchmarks/
     * bench_genomes.py softmax --dtype bfloat16 --genome fast_math=0 shows the difference).
     * __sinf/__cosf/__powf lose accuracy with the argument's size, so a region with them keeps
     * precise math. A saved sum of __expf terms is off by as little (the backward's gradient
     * checks see it), so saved outputs do not count. A region computed in double has no fast
     * forms at all. */
    static const char *const exp_log[] = {"expf(", "logf("}, *const trig_pow[] = {"sinf(", "cosf(", "powf("};
    static const char *const erf_tanh[] = {"erff(", "tanhf("};
    int has_exp_log = 0, has_trig_pow = 0, has_erf_tanh = 0, all16 = 1, dbl = 0;
    for (int32_t k = 0; k < rg->nnodes; k++) {
        const kb_node *nd = kb_graph_node(g, rg->nodes[k]);
        const kb_op_info *info = kb_op_get(nd->op);
        if (nd->dtype == KB_F64) all16 = 0, dbl = 1;
        has_exp_log |= kb_op_spelled_with(info, exp_log, 2);
        has_trig_pow |= kb_op_spelled_with(info, trig_pow, 3);
        has_erf_tanh |= kb_op_spelled_with(info, erf_tanh, 2);
    }
    for (int32_t i = 0; i < rg->ninputs; i++)
        if (kb_graph_node(g, rg->inputs[i])->dtype == KB_F64) dbl = 1;
    for (int32_t j = 0; j < rg->noutputs - rg->nsaved; j++) { /* saved statistics are f32 for the backward */
        kb_dtype t = kb_graph_node(g, rg->outputs[j])->dtype;
        if (kb_dtype_is_float(t) && t != KB_BF16 && t != KB_F16) all16 = 0;
    }
    f->transcendental = (has_exp_log || has_trig_pow) && !dbl;
    f->fast_exp_log = has_exp_log && !has_trig_pow && all16;
    f->precise_math = has_trig_pow || has_erf_tanh || (has_exp_log && !f->fast_exp_log);

    /* multipass and rereads: does a reduction (or a full-size output) depend on another one? And
       splittable: lvl[] is what a value waits for where the row is split over blocks, -1 nothing,
       0 the merge of its parts' partials; a row reduction that would wait for two cannot be split */
    int32_t n = kb_graph_nnodes(g);
    uint8_t *dep = kb_calloc(ctx, (size_t)(n ? n : 1), 1);
    int8_t *lvl = kb_malloc(ctx, (size_t)(n ? n : 1));
    if (!dep || !lvl) {
        kb_free(ctx, dep, (size_t)(n ? n : 1));
        kb_free(ctx, lvl, (size_t)(n ? n : 1));
        return KB_ERR_OOM;
    }
    memset(lvl, -1, (size_t)(n ? n : 1));
    f->splittable = rg->kind == KB_REGION_ROW;
    for (int32_t k = 0; k < rg->nnodes; k++) {
        int32_t v = rg->nodes[k];
        const kb_node *nd = kb_graph_node(g, v);
        int d = 0, l = -1;
        for (int i = 0; i < nd->ninputs; i++) {
            d |= dep[nd->inputs[i]] & (DEP_ROW_RED | DEP_ANY_RED);
            if (lvl[nd->inputs[i]] > l) l = lvl[nd->inputs[i]];
        }
        int32_t m = -1;
        if (kb_op_get(nd->op)->kind == KB_KIND_REDUCE) {
            if (d & DEP_ANY_RED) f->rereads = 1;
            d |= DEP_ANY_RED;
            if (rg->kind == KB_REGION_ROW && nd->axes != rg->reduce_axes) {
                f->ncolsum++; /* a column sum: no pass of its own */
                f->splittable = 0;
            } else {
                if (d & DEP_ROW_RED) f->multipass = 1;
                d |= DEP_ROW_RED;
                if (nd->op == KB_OP_SUM && (m = online_pattern(g, dep, nd)) >= 0 && !(dep[m] & DEP_PAIRED)) {
                    dep[m] |= DEP_PAIRED; /* one sum per max, as codegen pairs them */
                    l = lvl[m];
                } else if ((m = chan_pattern(g, dep, nd)) >= 0 && lvl[m] == 0 && lvl[kb_graph_node(g, m)->inputs[0]] < 0) {
                    l = 0;
                } else {
                    l++;
                }
                if (l != 0) f->splittable = 0;
            }
        }
        dep[v] = (uint8_t)(d | DEP_MEMBER);
        lvl[v] = (int8_t)(l > 1 ? 1 : l);
        if (nd->op == KB_OP_SUM && online_pattern(g, dep, nd) >= 0) f->online = 1;
    }
    for (int32_t j = 0; j < rg->noutputs; j++) {
        if (!(dep[rg->outputs[j]] & (DEP_ROW_RED | DEP_ANY_RED)) || f->red <= 1 ||
            kb_value_sizes(g, rg->outputs[j], symvals, sizes) != f->full)
            continue;
        if (dep[rg->outputs[j]] & DEP_ROW_RED) f->multipass = 1;
        if (dep[rg->outputs[j]] & DEP_ANY_RED) f->rereads = 1;
    }
    kb_free(ctx, dep, (size_t)(n ? n : 1));
    kb_free(ctx, lvl, (size_t)(n ? n : 1));
    return KB_OK;
}
