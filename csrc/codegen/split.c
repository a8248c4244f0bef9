/* split.c — the ROW kernel for a row split over blocks (row_split > 1): the main kernel reduces
 * each block's part of a row to partials in the workspace, the finishing kernel merges a row's
 * partials in a fixed order and writes its part's outputs. Shares kernel.c's row machinery. */
#include "codegen/codegen.h"

/* ---------------------------------------------------------------- ROW split over blocks */

/* row_split = S > 1: a row of R elements is S parts of `span` elements in whole vectors (the last
 * ones shorter, or empty), one per block: the grid is rows * S blocks, both kernels loop over the
 * (row, part) units. The main kernel reduces its part to partials in the workspace; the finishing
 * kernel, on the same grid, merges the row's S partials and writes the outputs of its part, so
 * the elementwise pass runs on the whole grid too. Every row reduction is of the first pass and
 * merges by its own operator (a sum, a mean's sum, a max or min, softmax's (max, sum of exp) pair),
 * or sums the squares about such a mean (cg_split_center): the main kernel sums them about its
 * part's own mean and the merge is Chan's, so no variance comes from a difference of large sums. */

int32_t cg_split_center(const cg *c, int32_t v) {
    const kb_node *V = kb_graph_node(c->g, v);
    if ((V->op != KB_OP_SUM && V->op != KB_OP_MEAN) || c->colsum[v] || !c->member[V->inputs[0]]) return -1;
    const kb_node *Q = kb_graph_node(c->g, V->inputs[0]);
    if (Q->op != KB_OP_MUL || Q->inputs[0] != Q->inputs[1] || !c->member[Q->inputs[0]]) return -1;
    const kb_node *D = kb_graph_node(c->g, Q->inputs[0]);
    if (D->op != KB_OP_SUB || !c->member[D->inputs[1]]) return -1;
    const kb_node *X = kb_graph_node(c->g, D->inputs[1]);
    if (X->op != KB_OP_EXPAND || !c->member[X->inputs[0]]) return -1;
    int32_t m = X->inputs[0], y = D->inputs[0];
    const kb_node *M = kb_graph_node(c->g, m);
    if (M->op != KB_OP_MEAN || M->axes != V->axes || M->inputs[0] != y || c->dp[m] != 0) return -1;
    return c->member[y] && c->dp[y] >= 0 ? -1 : m;
}

static int is_row_reduction(const cg *c, int32_t v) {
    return kb_op_get(kb_graph_node(c->g, v)->op)->kind == KB_KIND_REDUCE && !c->colsum[v];
}

/* The workspace slot of row reduction v among a unit's partials (node order), or with v < 0 the
 * number of slots. */
static int split_slot(const cg *c, int32_t v) {
    int j = 0;
    for (int32_t k = 0; k < c->rg->nnodes; k++) {
        int32_t w = c->rg->nodes[k];
        if (!is_row_reduction(c, w)) continue;
        if (w == v) return j;
        j++;
    }
    return j;
}

static int is_center(const cg *c, int32_t m) {
    for (int32_t k = 0; k < c->rg->nnodes; k++)
        if (cg_split_center(c, c->rg->nodes[k]) == m) return 1;
    return 0;
}

static void split_open(cg *c) {
    char Oexpr[EXPR_LEN], Rexpr[EXPR_LEN];
    cg_extent(c, 0, Oexpr);
    cg_extent(c, 1, Rexpr);
    int S = c->split, V = c->vec;
    cg_line(c, "const long long O = %s;  // rows", Oexpr);
    cg_line(c, "const long long R = %s;  // row length", Rexpr);
    if (V > 1)
        cg_line(c, "const long long span = ((R + %d) / %d + %d) / %d * %d;  // a part: 1/%d of the row, in whole vectors", S - 1, S,
                V - 1, V, V, S);
    else
        cg_line(c, "const long long span = (R + %d) / %d;  // a part: 1/%d of the row", S - 1, S, S);
    cg_line(c, "const int lane = threadIdx.x, grp = 0;  // one part of a row per block");
}

static void split_loop_open(cg *c) {
    cg_line(c, "for (long long unit = blockIdx.x; unit < O * %d; unit += gridDim.x) {", c->split);
    c->ind++;
    cg_scope_push(c);
    cg_line(c, "const long long row = unit / %d, part = unit %% %d;", c->split, c->split);
    cg_line(c, "const long long cb = part * span, ce = cb + span < R ? cb + span : R;  // the part: [cb, ce) of the row");
    cg_decl_vars(c, "row", ~c->red, 0);
    if (c->trailing) cg_line(c, "const long long rb = row * R;");
}

static void split_loop_close(cg *c) {
    cg_scope_pop(c);
    c->ind--;
    cg_line(c, "}");
}

static void split_pass_lists(cg *c, int pass, const int32_t *reds, int nred, const int32_t *outs, int nout);

/* A pass of the main kernel over its part: the first pass's reductions and the outputs that read
 * none, or (pass 1) the squares about the part's own means. */
static void split_pass(cg *c, int pass) {
    int32_t *reds, *outs;
    int nred, nout;
    if (cg_pass_lists(c, pass, 1, &reds, &nred, &outs, &nout)) {
        if (pass > 0) nout = 0; /* an output that reads a statistic is the finishing kernel's */
        if (nred > 0 || nout > 0) split_pass_lists(c, pass, reds, nred, outs, nout);
    }
    cg_free_pass_lists(c, reds, outs);
}

static void split_pass_lists(cg *c, int pass, const int32_t *reds, int nred, const int32_t *outs, int nout) {
    if (nred > c->maxred) c->maxred = nred;
    c->pass = pass;
    kb_sb_printf(c->out, "\n");
    cg_line(c, "// pass %d over this block's part of the row:%s", pass + 1, nred ? "" : " write the outputs");
    for (int j = 0; j < nred; j++) {
        const kb_node *nd = kb_graph_node(c->g, reds[j]);
        if (c->online_of[reds[j]] >= 0)
            cg_line(c, "//   %s of %%%d, online with %%%d", kb_op_get(nd->op)->name, nd->inputs[0], c->online_of[reds[j]]);
        else if (cg_split_center(c, reds[j]) >= 0)
            cg_line(c, "//   %s of %%%d about this part's own mean", kb_op_get(nd->op)->name, nd->inputs[0]);
        else
            cg_line(c, "//   %s of %%%d", kb_op_get(nd->op)->name, nd->inputs[0]);
    }
    for (int j = 0; j < nout; j++) cg_line(c, "//   write %%%d", outs[j]);
    for (int j = 0; j < nred; j++)
        cg_line(c, "%s acc%d = %s;", c->ct, reds[j], cg_red_of(kb_graph_node(c->g, reds[j])->op)->init);
    cg_row_chunk_loop_open(c);
    cg_chunk(c, reds, nred, outs, nout, NULL, 0);
    cg_row_chunk_loop_close(c);
    if (c->online_local) cg_online_local_sums(c, reds, nred);
    cg_row_group_reduce(c, reds, nred);
    for (int j = 0; j < nred; j++) {
        if (!is_center(c, reds[j])) continue;
        cg_line(c, "const %s v%d = acc%d / (%s)(ce > cb ? ce - cb : 1);  // this part's own mean: pass 2's squares are about it",
                c->ct, reds[j], reds[j], c->ct);
        cg_bind_stat(c, reds[j]);
    }
}

/* The main kernel: each unit's partials, one per row reduction, at workspace slot unit * np + j. */
void cg_emit_row_split_body(cg *c) {
    split_open(c);
    if (c->G > 32 && c->npasses > 0) {
        cg_line(c, "__shared__ %s kb_red[2][KB_NRED][%d];  // the warps' partials, two halves in turn", c->ct, c->gn.threads / 32);
        cg_line(c, "int kb_half = 0;");
    }
    split_loop_open(c);
    if (c->gn.cache == KB_CACHE_REGS) cg_regs_arrays(c);
    for (int p = 0; p < 2; p++) split_pass(c, p);
    kb_sb_printf(c->out, "\n");
    cg_line(c, "// this part's partials, merged by %s%s", c->name, KB_ENTRY_FINISH);
    cg_line(c, "if (threadIdx.x == 0) {");
    c->ind++;
    int np = split_slot(c, -1);
    cg_line(c, "%s *ws = static_cast<%s *>(kb_ws) + unit * %d;", c->ct, c->ct, np);
    for (int32_t k = 0; k < c->rg->nnodes; k++) {
        int32_t v = c->rg->nodes[k];
        if (!is_row_reduction(c, v)) continue;
        const kb_node *nd = kb_graph_node(c->g, v);
        int32_t m = cg_split_center(c, v);
        if (m >= 0)
            cg_line(c, "ws[%d] = acc%d;  // squares of %%%d about the part's mean", split_slot(c, v), v,
                    kb_graph_node(c->g, m)->inputs[0]);
        else
            cg_line(c, "ws[%d] = acc%d;  // %s of %%%d", split_slot(c, v), v, nd->op == KB_OP_MEAN ? "sum" : kb_op_get(nd->op)->name,
                    nd->inputs[0]);
    }
    c->ind--;
    cg_line(c, "}");
    split_loop_close(c);
}

/* One merge step of the finishing kernel: the running statistics t<j> (of n elements) with a
 * part's u (its slot j spelled by fmt, of n2 elements). The squares first: Chan's formula reads
 * the sums before they take the part's. */
static void split_merge_step(cg *c, const char *fmt) {
    char u[32], um[32];
    for (int32_t k = 0; k < c->rg->nnodes; k++) {
        int32_t v = c->rg->nodes[k], m = is_row_reduction(c, c->rg->nodes[k]) ? cg_split_center(c, v) : -1;
        if (m < 0) continue;
        int jv = split_slot(c, v), jm = split_slot(c, m);
        snprintf(u, sizeof u, fmt, jv);
        snprintf(um, sizeof um, fmt, jm);
        cg_line(c, "t%d = kb_chan_m2(n, t%d, t%d, n2, %s, %s);", jv, jm, jv, um, u);
    }
    for (int32_t k = 0; k < c->rg->nnodes; k++) {
        int32_t v = c->rg->nodes[k];
        if (!is_row_reduction(c, v) || c->online_of[v] >= 0 || cg_split_center(c, v) >= 0) continue;
        int j = split_slot(c, v);
        snprintf(u, sizeof u, fmt, j);
        if (c->partner[v] >= 0) {
            int js = split_slot(c, c->partner[v]);
            snprintf(um, sizeof um, fmt, js);
            cg_line(c, "kb_online_merge(t%d, t%d, %s, %s);", j, js, u, um);
            continue;
        }
        char comb[96], acc[16];
        snprintf(acc, sizeof acc, "t%d", j);
        snprintf(comb, sizeof comb, cg_red_of(kb_graph_node(c->g, v)->op)->combine, acc, u);
        cg_line(c, "t%d = %s;", j, comb);
    }
}

/* The row's partials into kb_rs: its first warp merges them in a fixed order (lane l takes parts l,
 * l + 32, ... in turn, then a butterfly over the lanes whose lane 0 is a fixed tree), so every
 * block of the row gets the same bits, run after run; no serial sum is longer than S / 32. */
static void split_merge(cg *c, int np) {
    int chan = 0;
    for (int32_t k = 0; k < c->rg->nnodes; k++) chan |= is_row_reduction(c, c->rg->nodes[k]) && cg_split_center(c, c->rg->nodes[k]) >= 0;
    cg_line(c, "if (threadIdx.x < 32) {  // the row's %d partials, merged by the first warp", c->split);
    c->ind++;
    if (chan) cg_line(c, "%s n = 0;  // elements merged (Chan's formula weighs the parts by them)", c->ct);
    for (int32_t k = 0; k < c->rg->nnodes; k++) {
        int32_t v = c->rg->nodes[k];
        if (!is_row_reduction(c, v)) continue;
        const char *init = cg_split_center(c, v) >= 0 ? "0" : cg_red_of(kb_graph_node(c->g, v)->op)->init;
        cg_line(c, "%s t%d = %s;  // %%%d", c->ct, split_slot(c, v), init, v);
    }
    cg_line(c, "for (long long p = threadIdx.x; p < %d; p += 32) {", c->split);
    c->ind++;
    cg_line(c, "const %s *q = ws + (row * %d + p) * %d;", c->ct, c->split, np);
    if (chan) {
        cg_line(c, "const long long pb = p * span, pe = pb + span < R ? pb + span : R;");
        cg_line(c, "const %s n2 = pe > pb ? (%s)(pe - pb) : (%s)0;", c->ct, c->ct, c->ct);
    }
    split_merge_step(c, "q[%d]");
    if (chan) cg_line(c, "n += n2;");
    c->ind--;
    cg_line(c, "}");
    char sh[64], var[16];
    cg_line(c, "#pragma unroll");
    cg_line(c, "for (int o = 16; o > 0; o >>= 1) {");
    c->ind++;
    if (chan) {
        snprintf(sh, sizeof sh, c->rd->shfl_xor, "n");
        cg_line(c, "const %s n2 = %s;", c->ct, sh);
    }
    for (int j = 0; j < np; j++) {
        snprintf(var, sizeof var, "t%d", j);
        snprintf(sh, sizeof sh, c->rd->shfl_xor, var);
        cg_line(c, "const %s u%d = %s;", c->ct, j, sh);
    }
    split_merge_step(c, "u%d");
    if (chan) cg_line(c, "n += n2;");
    c->ind--;
    cg_line(c, "}");
    cg_line(c, "if (threadIdx.x == 0) {");
    for (int j = 0; j < np; j++) cg_line(c, "    kb_rs[%d] = t%d;", j, j);
    cg_line(c, "}");
    c->ind--;
    cg_line(c, "}");
}

void cg_emit_row_split_finish(cg *c) {
    int np = split_slot(c, -1), cache = c->gn.cache, nout = 0;
    int32_t *outs = kb_malloc(c->ctx, sizeof(int32_t) * (size_t)(c->rg->noutputs ? c->rg->noutputs : 1));
    if (!outs) {
        if (c->st == KB_OK) c->st = KB_FAIL(c->ctx, KB_ERR_OOM, "out of memory");
        return;
    }
    for (int32_t j = 0; j < c->rg->noutputs; j++) /* what reads a statistic: all but the first pass's */
        if (cg_out_full(c, c->rg->outputs[j]) && cg_pass_of_output(c, c->rg->outputs[j]) > 0) outs[nout++] = c->rg->outputs[j];
    /* the part is read again from memory: no row cache, nothing kept from the main kernel */
    c->gn.cache = KB_CACHE_REREAD;
    memset(c->cached, 0, (size_t)(c->n ? c->n : 1));
    c->online_local = 0;
    c->pass = c->npasses;
    split_open(c);
    cg_line(c, "const %s *ws = static_cast<const %s *>(kb_ws);", c->ct, c->ct);
    cg_line(c, "__shared__ %s kb_rs[%d];  // the row's statistics, merged", c->ct, np);
    split_loop_open(c);
    split_merge(c, np);
    cg_line(c, "%s;", c->rd->barrier);
    for (int32_t k = 0; k < c->rg->nnodes; k++) {
        int32_t v = c->rg->nodes[k];
        if (!is_row_reduction(c, v)) continue;
        if (kb_graph_node(c->g, v)->op == KB_OP_MEAN)
            cg_line(c, "const %s v%d = kb_rs[%d] / (%s)R;", c->ct, v, split_slot(c, v), c->ct);
        else
            cg_line(c, "const %s v%d = kb_rs[%d];", c->ct, v, split_slot(c, v));
        cg_bind_stat(c, v);
    }
    cg_eager_stats(c, c->npasses);
    if (nout) {
        kb_sb_printf(c->out, "\n");
        cg_line(c, "// the outputs over this block's part of the row:");
        for (int j = 0; j < nout; j++) cg_line(c, "//   write %%%d", outs[j]);
        cg_row_chunk_loop_open(c);
        cg_chunk(c, NULL, 0, outs, nout, NULL, 0);
        cg_row_chunk_loop_close(c);
    }
    kb_free(c->ctx, outs, sizeof(int32_t) * (size_t)(c->rg->noutputs ? c->rg->noutputs : 1));
    cg_stat_outputs(c);
    cg_line(c, "%s;  // before kb_rs takes the next unit's row", c->rd->barrier);
    split_loop_close(c);
    c->gn.cache = cache;
}
