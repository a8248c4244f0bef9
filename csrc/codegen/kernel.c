/* kernel.c — the kernel layer of code generation: the skeleton of each region kind (POINTWISE
 * grid-stride, ROW block- or warp-per-row with its passes (a row split over blocks: split.c),
 * COL column sweeps with an optional split and finishing kernel), planning a
 * ROW / COL region's passes; the chunks inside come from chunk.c. Deterministic: the same region
 * and genome give the same text.
 *
 * Runtime contract (what the launcher must guarantee): pointers do not alias one another, every
 * tensor is dense and contiguous, and when genome.vec > 1 every pointer is 16-byte aligned
 * (Python: data_ptr() % 16 == 0) — vector kernels issue 16-byte loads and stores. */
#include "codegen/codegen.h"

static const struct cg_red_render RED[] = {
    {KB_OP_SUM, "0", "%s + %s", "kb_warp_sum"},
    {KB_OP_MEAN, "0", "%s + %s", "kb_warp_sum"},
    {KB_OP_RMAX, "-KB_INF", "kb_maxf(%s, %s)", "kb_warp_max"},
    {KB_OP_RMIN, "KB_INF", "kb_minf(%s, %s)", "kb_warp_min"},
};

const struct cg_red_render *cg_red_of(kb_op op) {
    for (size_t i = 0; i < sizeof RED / sizeof RED[0]; i++)
        if (RED[i].op == op) return &RED[i];
    return &RED[0];
}

/* ---------------------------------------------------------------- passes (ROW / COL) */

/* dp[v]: the latest reduction pass v depends on (-1: none); a reduction runs one pass after
 * the latest one its operand depends on. */
/* two_pass=0: S = sum(exp(y - expand(M))) with M = max(y) over the same axes is computed in
 * M's pass with an online normalizer (one read of the row instead of two). */
static int32_t online_max_of(cg *c, int32_t s) {
    const kb_node *S = kb_graph_node(c->g, s);
    if (S->op != KB_OP_SUM || !c->member[S->inputs[0]]) return -1;
    const kb_node *E = kb_graph_node(c->g, S->inputs[0]);
    if (E->op != KB_OP_EXP || !c->member[E->inputs[0]]) return -1;
    const kb_node *D = kb_graph_node(c->g, E->inputs[0]);
    if (D->op != KB_OP_SUB || !c->member[D->inputs[1]]) return -1;
    const kb_node *X = kb_graph_node(c->g, D->inputs[1]);
    if (X->op != KB_OP_EXPAND || !c->member[X->inputs[0]]) return -1;
    int32_t m = X->inputs[0];
    const kb_node *M = kb_graph_node(c->g, m);
    if (M->op != KB_OP_RMAX || M->axes != S->axes || M->inputs[0] != D->inputs[0] || c->partner[m] >= 0) return -1;
    return m;
}

void cg_plan_passes(cg *c) {
    c->npasses = 0;
    for (int32_t k = 0; k < c->rg->nnodes; k++) {
        int32_t v = c->rg->nodes[k];
        const kb_node *nd = kb_graph_node(c->g, v);
        int d = -1;
        for (int i = 0; i < nd->ninputs; i++)
            if (c->member[nd->inputs[i]] && c->dp[nd->inputs[i]] > d) d = c->dp[nd->inputs[i]];
        if (kb_op_get(nd->op)->kind == KB_KIND_REDUCE && !c->colsum[v]) {
            /* a split row merges its parts' (max, sum) pairs: online whatever two_pass says */
            int32_t m = c->gn.two_pass == 0 || c->split > 1 ? online_max_of(c, v) : -1;
            if (m >= 0) {
                c->partner[m] = v;
                c->online_of[v] = m;
                c->has_online = 1;
                d = c->dp[m];
            } else {
                d = d + 1;
            }
            if (d + 1 > c->npasses) c->npasses = d + 1;
        }
        c->dp[v] = (int8_t)d;
    }
    c->online_local = c->has_online && c->rg->kind == KB_REGION_ROW && c->gn.cache == KB_CACHE_REGS;
}

/* A FULL output is written in the first pass after the reductions it depends on. */
int cg_pass_of_output(const cg *c, int32_t v) { return c->dp[v] + 1; }

/* ROW: the loop over a row's chunks (a split row's: over the block's part [cb, ce)); each
 * thread of the row's group takes every G-th chunk. */
void cg_row_chunk_loop_open(cg *c) {
    const char *from = c->split > 1 ? "cb + " : "", *end = c->split > 1 ? "ce" : "Rl";
    if (c->gn.cache == KB_CACHE_REGS || c->ncolsum) { /* unrolled: chunk u is a register index */
        cg_line(c, "#pragma unroll");
        cg_line(c, "for (int u = 0; u < %d; ++u) {", c->U);
        c->ind++;
        cg_line(c, "const long long c0 = %s((long long)u * %d + lane) * %d;", from, c->G, c->vec);
        cg_line(c, "if (c0 < %s) {", end);
    } else {
        cg_line(c, "#pragma unroll %d", c->gn.items);
        cg_line(c, "for (long long c0 = %s(long long)lane * %d; c0 < %s; c0 += %d) {", from, c->vec, end, c->G * c->vec);
    }
    c->ind++;
}

void cg_row_chunk_loop_close(cg *c) {
    c->ind--;
    cg_line(c, "}");
    if (c->gn.cache == KB_CACHE_REGS || c->ncolsum) {
        c->ind--;
        cg_line(c, "}");
    }
}

/* Combines each thread's partial results across the threads of its row (ROW). */
void cg_row_group_reduce(cg *c, const int32_t *reds, int nred) {
    if (nred == 0) return;
    int W = c->G < 32 ? c->G : 32;
    if (W > 1)
        for (int j = 0; j < nred; j++) {
            if (c->online_of[reds[j]] >= 0) continue;
            if (c->partner[reds[j]] >= 0)
                cg_line(c, "kb_warp_online<%d>(acc%d, acc%d);", W, reds[j], c->partner[reds[j]]);
            else
                cg_line(c, "acc%d = %s<%d>(acc%d);", reds[j], cg_red_of(kb_graph_node(c->g, reds[j])->op)->warp, W, reds[j]);
        }
    if (c->G <= 32) return;
    int nw = c->G / 32;
    /* kb_red has two halves used in turn: the next reduction writes the other half, so no
     * barrier is needed after the reads (the next one's barrier orders them before a rewrite) */
    cg_line(c, "// across the %d warps of the row: the same butterfly, in every warp (deterministic)", nw);
    cg_line(c, "if ((threadIdx.x & 31) == 0) {");
    for (int j = 0; j < nred; j++) cg_line(c, "    kb_red[kb_half][%d][threadIdx.x >> 5] = acc%d;", j, reds[j]);
    cg_line(c, "}");
    cg_line(c, "%s;", c->rd->barrier);
    /* each warp takes the nw partials into its lanes (lane l holds partial l mod nw; nw is a
       power of two, as G is) and combines them with the warp's butterfly: lanes l and l^o combine
       the same two values (a + b == b + a exactly), so every thread ends with the same result,
       in a fixed order, after log2(nw) shuffles instead of nw shared-memory reads */
    for (int j = 0; j < nred; j++) {
        if (c->online_of[reds[j]] >= 0) continue;
        if (c->partner[reds[j]] >= 0) {
            int js = 0;
            while (js < nred && reds[js] != c->partner[reds[j]]) js++;
            cg_line(c, "acc%d = kb_red[kb_half][%d][grp * %d + (threadIdx.x & %d)];", reds[j], j, nw, nw - 1);
            cg_line(c, "acc%d = kb_red[kb_half][%d][grp * %d + (threadIdx.x & %d)];", reds[js], js, nw, nw - 1);
            cg_line(c, "kb_warp_online<%d>(acc%d, acc%d);", nw, reds[j], reds[js]);
            continue;
        }
        cg_line(c, "acc%d = kb_red[kb_half][%d][grp * %d + (threadIdx.x & %d)];", reds[j], j, nw, nw - 1);
        cg_line(c, "acc%d = %s<%d>(acc%d);", reds[j], cg_red_of(kb_graph_node(c->g, reds[j])->op)->warp, nw, reds[j]);
    }
    cg_line(c, "kb_half ^= 1;");
}

/* online_local: after the chunk loop has taken each thread's max of y and kept y in ol<S>, the
 * thread's share of S = sum(exp(y - M)) relative to its own max (one exp per element, none per
 * merge step); row_group_reduce then merges the (max, sum) pairs once per row. */
void cg_online_local_sums(cg *c, const int32_t *reds, int nred) {
    for (int j = 0; j < nred; j++) {
        int32_t s = reds[j], m = c->online_of[s];
        if (m < 0) continue;
        cg_line(c, "// %%%d: this thread's exp(%%%d - its own max), kept for the passes after", kb_graph_node(c->g, s)->inputs[0],
                kb_graph_node(c->g, m)->inputs[0]);
        cg_line(c, "const %s olm%d = acc%d;", c->ct, s, m);
        cg_line(c, "const %s olr%d = olm%d == -KB_INF ? 0 : olm%d;  // all -inf: exp(-inf - 0) = 0", c->ct, s, s, s);
        cg_row_chunk_loop_open(c);
        if (c->vec > 1) {
            cg_line(c, "#pragma unroll");
            cg_line(c, "for (int k = 0; k < %d; ++k) {", c->vec);
        } else {
            cg_line(c, "{");
        }
        cg_line(c, "    ol%d[u][%s] = kb_exp(ol%d[u][%s] - olr%d);", s, c->kvar, s, c->kvar, s);
        cg_line(c, "    acc%d += ol%d[u][%s];", s, s, c->kvar);
        cg_line(c, "}");
        cg_row_chunk_loop_close(c);
    }
}

/* The reductions and FULL outputs of a pass, as arrays of the region's own size (no output
 * is left out, however many the region has); 0 with c->st set when out of memory. */
int cg_pass_lists(cg *c, int pass, int row, int32_t **reds, int *nred, int32_t **outs, int *nout) {
    *reds = kb_malloc(c->ctx, sizeof(int32_t) * (size_t)(c->rg->nnodes ? c->rg->nnodes : 1));
    *outs = kb_malloc(c->ctx, sizeof(int32_t) * (size_t)(c->rg->noutputs ? c->rg->noutputs : 1));
    *nred = *nout = 0;
    if (!*reds || !*outs) {
        if (c->st == KB_OK) c->st = KB_FAIL(c->ctx, KB_ERR_OOM, "out of memory");
        return 0;
    }
    for (int32_t k = 0; k < c->rg->nnodes; k++) {
        int32_t v = c->rg->nodes[k];
        if (kb_op_get(kb_graph_node(c->g, v)->op)->kind == KB_KIND_REDUCE && !(row && c->colsum[v]) && c->dp[v] == pass)
            (*reds)[(*nred)++] = v;
    }
    for (int32_t j = 0; j < c->rg->noutputs; j++) {
        int32_t v = c->rg->outputs[j];
        if (cg_out_full(c, v) && cg_pass_of_output(c, v) == pass) (*outs)[(*nout)++] = v;
    }
    return 1;
}

void cg_free_pass_lists(cg *c, int32_t *reds, int32_t *outs) {
    kb_free(c->ctx, reds, sizeof(int32_t) * (size_t)(c->rg->nnodes ? c->rg->nnodes : 1));
    kb_free(c->ctx, outs, sizeof(int32_t) * (size_t)(c->rg->noutputs ? c->rg->noutputs : 1));
}

static void row_pass_lists(cg *c, int pass, int32_t *reds, int nred, int32_t *outs, int nout);

static void row_pass(cg *c, int pass) {
    int32_t *reds, *outs;
    int nred, nout;
    if (cg_pass_lists(c, pass, 1, &reds, &nred, &outs, &nout)) row_pass_lists(c, pass, reds, nred, outs, nout);
    cg_free_pass_lists(c, reds, outs);
}

/* The reductions and FULL outputs of one pass, and the statistics it finishes. */
static void row_pass_lists(cg *c, int pass, int32_t *reds, int nred, int32_t *outs, int nout) {
    int32_t csums[KB_MAX_COLSUMS];
    int ncs = 0;
    for (int j = 0; j < c->ncolsum; j++) /* added up where its operand is ready, like an output */
        if (cg_pass_of_output(c, c->colsums[j]) == pass) csums[ncs++] = c->colsums[j];
    if (nred == 0 && nout == 0 && ncs == 0) return;
    if (nred > c->maxred) c->maxred = nred;
    c->pass = pass;
    if (c->prefetch && c->pf_pass < 0) c->pf_pass = pass;
    kb_sb_printf(c->out, "\n");
    cg_line(c, "// pass %d over the row:%s", pass + 1, nred ? "" : " write the outputs");
    for (int j = 0; j < nred; j++) {
        const kb_node *nd = kb_graph_node(c->g, reds[j]);
        if (c->online_of[reds[j]] >= 0)
            cg_line(c, "//   %s of %%%d, online with %%%d (%s)", kb_op_get(nd->op)->name, nd->inputs[0], c->online_of[reds[j]],
                    c->online_local ? "each thread's own max first, merged once per row" : "rescaled as the max grows");
        else
            cg_line(c, "//   %s of %%%d", kb_op_get(nd->op)->name, nd->inputs[0]);
    }
    for (int j = 0; j < ncs; j++)
        cg_line(c, "//   add %%%d to the column sum %%%d", kb_graph_node(c->g, csums[j])->inputs[0], csums[j]);
    for (int j = 0; j < nout; j++) cg_line(c, "//   write %%%d", outs[j]);
    for (int j = 0; j < nred; j++)
        cg_line(c, "%s acc%d = %s;", c->ct, reds[j], cg_red_of(kb_graph_node(c->g, reds[j])->op)->init);
    cg_row_chunk_loop_open(c);
    cg_chunk(c, reds, nred, outs, nout, csums, ncs);
    cg_row_chunk_loop_close(c);
    if (c->prefetch && pass == c->pf_pass && (c->npf || c->nps)) {
        char next[EXPR_LEN];
        snprintf(next, sizeof next, "row + (long long)gridDim.x * %d", c->gn.rows);
        cg_prefetch_rows(c, next, "the next row's loads: in flight while this row is reduced");
    }
    if (c->online_local) cg_online_local_sums(c, reds, nred);
    cg_row_group_reduce(c, reds, nred);
    for (int j = 0; j < nred; j++) {
        const kb_node *nd = kb_graph_node(c->g, reds[j]);
        if (nd->op == KB_OP_MEAN)
            cg_line(c, "const %s v%d = acc%d / (%s)R;", c->ct, reds[j], reds[j], c->ct);
        else
            cg_line(c, "const %s v%d = acc%d;", c->ct, reds[j], reds[j]);
        cg_bind_stat(c, reds[j]);
        cg_saved_stat_store(c, reds[j]);
    }
    if (c->online_local)
        for (int j = 0; j < nred; j++) {
            int32_t s = reds[j], m = c->online_of[s];
            if (m < 0) continue;
            /* the factor that takes this thread's exp(y - its max) to exp(y - M), inf and NaN as
               exp(y - M) itself: a thread whose elements are all -inf holds zeros (NaN where M is
               -inf too), and a thread that holds M (+inf included) needs no factor */
            cg_line(c, "const %s olc%d = olm%d == -KB_INF ? (v%d == -KB_INF ? KB_NAN : 0) : olm%d == v%d ? 1 : kb_exp(olm%d - v%d);",
                    c->ct, s, s, m, s, m, s, m);
        }
    /* statistics derived only from finished reductions: once per row, not per element */
    if (nred) cg_eager_stats(c, pass);
}

static void emit_row_body(cg *c) {
    char Oexpr[EXPR_LEN], Rexpr[EXPR_LEN];
    cg_extent(c, 0, Oexpr);
    cg_extent(c, 1, Rexpr);
    cg_line(c, "const long long O = %s;  // rows", Oexpr);
    cg_line(c, "const long long R = %s;  // row length", Rexpr);
    if (c->gn.rows > 1) {
        cg_line(c, "const int lane = threadIdx.x %% %d, grp = threadIdx.x / %d;  // %d rows per block, %d threads per row",
                c->G, c->G, c->gn.rows, c->G);
    } else {
        cg_line(c, "const int lane = threadIdx.x, grp = 0;  // one row per block");
    }
    if (c->G > 32 && c->npasses > 0) {
        cg_line(c, "__shared__ %s kb_red[2][KB_NRED][%d];  // the warps' partials, two halves in turn", c->ct,
                c->gn.threads / 32);
        cg_line(c, "int kb_half = 0;");
    }
    if (c->gn.cache == KB_CACHE_SMEM) cg_smem_pointers(c);
    cg_colsum_decl(c);
    /* a grid capped for the column sums' partials, or a persistent one: each block visits many
     * rows, one after the other, and its loads would wait behind the reductions of the row before
     * (the loads ahead go to registers indexed by chunk: the unrolled chunk loop) */
    c->prefetch = c->trailing && (c->ncolsum > 0 || (c->gn.persistent && c->gn.cache == KB_CACHE_REGS));
    c->pf_pass = -1;
    c->npf = c->nps = 0;
    kb_sb *outer = c->out, loop;   /* the loop first: which inputs are loaded ahead is known after it */
    kb_sb_init(&loop, c->ctx);
    c->out = &loop;
    cg_line(c, "for (long long rowbase = (long long)blockIdx.x * %d; rowbase < O; rowbase += (long long)gridDim.x * %d) {",
            c->gn.rows, c->gn.rows);
    c->ind++;
    cg_scope_push(c);
    cg_line(c, "const long long row = rowbase + grp;");
    cg_line(c, "const long long Rl = row < O ? R : 0;  // idle row slots still join the reductions");
    cg_decl_vars(c, "row", ~c->red, 0);
    if (c->trailing) cg_line(c, "const long long rb = row * R;");
    kb_sb passes;   /* the passes apart: the per-row inputs loaded ahead are known after them */
    kb_sb_init(&passes, c->ctx);
    c->out = &passes;
    if (c->gn.cache == KB_CACHE_REGS) cg_regs_arrays(c);
    int last = c->npasses;
    for (int p = 0; p <= last; p++) row_pass(c, p);
    cg_stat_outputs(c);
    c->out = &loop;
    for (int j = 0; j < c->nps; j++)
        cg_line(c, "const %s rs%d = pfs%d;  // this row's, loaded ahead", cg_storage(kb_graph_node(c->g, c->ps[j])->dtype),
                (int)c->ps[j], (int)c->ps[j]);
    if (passes.oom) c->st = KB_FAIL(c->ctx, KB_ERR_OOM, "out of memory");
    else if (passes.buf) kb_sb_puts(&loop, passes.buf);
    kb_sb_discard(&passes);
    cg_scope_pop(c);
    c->ind--;
    cg_line(c, "}");
    c->out = outer;
    if (c->npf || c->nps) {
        cg_line(c, "// the first pass's loads, one row ahead of the row being reduced");
        for (int j = 0; j < c->npf; j++) {
            char T[40];
            cg_prefetch_type(c, c->pf[j], T, sizeof T);
            cg_line(c, "%s pf%d[%d];", T, (int)c->pf[j], c->U);
        }
        for (int j = 0; j < c->nps; j++)
            cg_line(c, "%s pfs%d;", cg_storage(kb_graph_node(c->g, c->ps[j])->dtype), (int)c->ps[j]);
        char first[EXPR_LEN];
        snprintf(first, sizeof first, "(long long)blockIdx.x * %d + grp", c->gn.rows);
        cg_prefetch_rows(c, first, "this block's first row");
    }
    if (loop.oom) c->st = KB_FAIL(c->ctx, KB_ERR_OOM, "out of memory");
    else if (loop.buf) kb_sb_puts(c->out, loop.buf);
    kb_sb_discard(&loop);
    cg_colsum_store(c);
}

/* ---------------------------------------------------------------- COL */

static void col_o_loop_open(cg *c, const char *begin, const char *end) {
    cg_line(c, "#pragma unroll %d", c->gn.items);
    cg_line(c, "for (long long o = %s; o < %s; ++o) {", begin, end);
    c->ind++;
}

static void col_pass_lists(cg *c, int pass, int partial, int32_t *reds, int nred, int32_t *outs, int nout);

static void col_pass(cg *c, int pass, int partial) {
    int32_t *reds, *outs;
    int nred, nout;
    if (cg_pass_lists(c, pass, 0, &reds, &nred, &outs, &nout)) col_pass_lists(c, pass, partial, reds, nred, outs, nout);
    cg_free_pass_lists(c, reds, outs);
}

static void col_pass_lists(cg *c, int pass, int partial, int32_t *reds, int nred, int32_t *outs, int nout) {
    if (nred == 0 && nout == 0) return;
    c->pass = pass;
    kb_sb_printf(c->out, "\n");
    cg_line(c, "// pass %d down the columns:%s", pass + 1, nred ? "" : " write the outputs");
    for (int j = 0; j < nred; j++) {
        const kb_node *nd = kb_graph_node(c->g, reds[j]);
        cg_line(c, "//   %s of %%%d", kb_op_get(nd->op)->name, nd->inputs[0]);
        cg_line(c, "%s acc%d[%d];", c->ct, reds[j], c->vec);
        cg_line(c, "for (int k = 0; k < %d; ++k) acc%d[k] = %s;", c->vec, reds[j], cg_red_of(nd->op)->init);
    }
    for (int j = 0; j < nout; j++) cg_line(c, "//   write %%%d", outs[j]);
    col_o_loop_open(c, partial ? "o_begin" : "0", partial ? "o_end" : "Ored");
    cg_scope_push(c);
    cg_decl_vars(c, "o", c->red, 0);
    if (c->trailing) cg_line(c, "const long long ob = o * C;");
    cg_chunk(c, reds, nred, outs, nout, NULL, 0);
    cg_scope_pop(c);
    c->ind--;
    cg_line(c, "}");
    if (partial) {
        cg_line(c, "// partial results of this split, finished by %s_finish", c->name);
        cg_line(c, "%s *ws = static_cast<%s *>(kb_ws);", c->ct, c->ct);
        for (int j = 0; j < nred; j++)
            cg_line(c, "for (int k = 0; k < %d; ++k) ws[(split * %d + %d) * C + col0 + k] = acc%d[k];", c->vec, c->nred_total,
                    j, reds[j]);
        return;
    }
    for (int j = 0; j < nred; j++) {
        const kb_node *nd = kb_graph_node(c->g, reds[j]);
        cg_line(c, "%s v%d[%d];", c->ct, reds[j], c->vec);
        cg_line(c, "for (int k = 0; k < %d; ++k) v%d[k] = acc%d[k]%s;", c->vec, reds[j], reds[j],
                nd->op == KB_OP_MEAN ? (c->dbl ? " / (double)Ored" : " / (float)Ored") : "");
        cg_bind_stat(c, reds[j]);
    }
}

static void col_prologue(cg *c, int finish) {
    char Cexpr[EXPR_LEN], Oexpr[EXPR_LEN];
    cg_extent(c, 0, Cexpr);
    cg_extent(c, 1, Oexpr);
    cg_line(c, "const long long C = %s;  // columns", Cexpr);
    cg_line(c, "const long long Ored = %s;  // reduced extent (rows summed down each column)", Oexpr);
    cg_line(c, "const long long ncb = (C + %d) / %d;  // column blocks of %d threads x %d columns", c->gn.threads * c->vec - 1,
            c->gn.threads * c->vec, c->gn.threads, c->vec);
    int split = c->col_split > 1 && !finish;
    cg_line(c, "for (long long b = blockIdx.x; b < ncb * %d; b += gridDim.x) {", split ? c->col_split : 1);
    c->ind++;
    cg_scope_push(c);
    if (split) {
        cg_line(c, "const long long split = b / ncb;");
        cg_line(c, "const long long span = (Ored + %d) / %d;", c->col_split - 1, c->col_split);
        cg_line(c, "const long long o_begin = split * span, o_end = o_begin + span < Ored ? o_begin + span : Ored;");
    }
    cg_line(c, "const long long col0 = ((b %% ncb) * %d + threadIdx.x) * %d;", c->gn.threads, c->vec);
    cg_line(c, "if (col0 >= C) continue;");
    cg_decl_vars(c, "col0", ~c->red, 1);
}

static void col_epilogue(cg *c) {
    cg_scope_pop(c);
    c->ind--;
    cg_line(c, "}");
}

static void emit_col_body(cg *c) {
    col_prologue(c, 0);
    if (c->col_split > 1) {
        col_pass(c, 0, 1);
    } else {
        for (int p = 0; p <= c->npasses; p++) col_pass(c, p, 0);
        cg_stat_outputs(c);
    }
    col_epilogue(c);
}

static void fail_unsupported(cg *c, const char *what) {
    if (c->st == KB_OK) c->st = KB_FAIL(c->ctx, KB_ERR_INVALID, "genome: %s", what);
}

/* The finishing kernel of a split COL region: partials summed in split order, then the
 * per-column statistics and outputs. */
void cg_emit_col_finish(cg *c) {
    col_prologue(c, 1);
    c->pass = 1;
    cg_line(c, "const %s *ws = static_cast<const %s *>(kb_ws);", c->ct, c->ct);
    int j = 0;
    for (int32_t k = 0; k < c->rg->nnodes; k++) {
        int32_t v = c->rg->nodes[k];
        const kb_node *nd = kb_graph_node(c->g, v);
        if (kb_op_get(nd->op)->kind != KB_KIND_REDUCE) continue;
        const struct cg_red_render *rr = cg_red_of(nd->op);
        char comb[160], acc[32], part[96];
        snprintf(acc, sizeof acc, "v%d[k]", v);
        snprintf(part, sizeof part, "ws[(s * %d + %d) * C + col0 + k]", c->nred_total, j);
        snprintf(comb, sizeof comb, rr->combine, acc, part);
        if (c->online_of[v] >= 0 || c->partner[v] >= 0) {
            fail_unsupported(c, "an online normalizer with col_split > 1");
            return;
        }
        cg_line(c, "%s v%d[%d];", c->ct, v, c->vec);
        cg_line(c, "for (int k = 0; k < %d; ++k) {", c->vec);
        cg_line(c, "    v%d[k] = ws[(%d) * C + col0 + k];", v, j);
        cg_line(c, "    for (int s = 1; s < %d; ++s) v%d[k] = %s;", c->col_split, v, comb);
        if (nd->op == KB_OP_MEAN) cg_line(c, "    v%d[k] = v%d[k] / (%s)Ored;", v, v, c->ct);
        cg_line(c, "}");
        cg_bind_stat(c, v);
        j++;
    }
    cg_stat_outputs(c);
    col_epilogue(c);
}

/* ---------------------------------------------------------------- POINTWISE */

static void emit_pointwise_body(cg *c) {
    char nexpr[EXPR_LEN];
    cg_extent(c, 0, nexpr);
    int T = c->gn.threads, V = c->gn.vec, I = c->gn.items;
    const int32_t *outs = c->rg->outputs;   /* every output, each element */
    int nout = c->rg->noutputs;
    cg_line(c, "const long long n = %s;", nexpr);
    cg_line(c, "// %d threads x %d chunk(s) of %d element(s) per block, grid-stride", T, I, V);
    cg_line(c, "for (long long q0 = (long long)blockIdx.x * %d; q0 * %d < n; q0 += (long long)gridDim.x * %d) {", T * I, V,
            T * I);
    c->ind++;
    cg_line(c, "#pragma unroll");
    cg_line(c, "for (int it = 0; it < %d; ++it) {", I);
    c->ind++;
    cg_line(c, "const long long i0 = (q0 + it * %d + threadIdx.x) * %d;", T, V);
    if (V > 1) {
        cg_line(c, "if (i0 + %d <= n) {", V);
        c->ind++;
        cg_scope_push(c);
        cg_chunk(c, NULL, 0, outs, nout, NULL, 0);
        cg_scope_pop(c);
        c->ind--;
        cg_line(c, "} else {");
        c->ind++;
        cg_line(c, "for (long long i1 = i0; i1 < n; ++i1) {  // the tail: one element at a time");
        c->ind++;
        int saved = c->vec;
        c->vec = 1;
        c->base = "i1";
        cg_scope_push(c);
        cg_set_space_vec(c);
        cg_chunk(c, NULL, 0, outs, nout, NULL, 0);
        cg_scope_pop(c);
        c->vec = saved;
        c->base = "i0";
        cg_set_space_vec(c);
        c->ind--;
        cg_line(c, "}");
        c->ind--;
        cg_line(c, "}");
    } else {
        cg_line(c, "if (i0 < n) {");
        c->ind++;
        cg_scope_push(c);
        cg_chunk(c, NULL, 0, outs, nout, NULL, 0);
        cg_scope_pop(c);
        c->ind--;
        cg_line(c, "}");
    }
    c->ind--;
    cg_line(c, "}");
    c->ind--;
    cg_line(c, "}");
}

/* ---------------------------------------------------------------- the body of the kernel */

void cg_emit_body(cg *c) {
    c->ind = 1;
    switch (c->rg->kind) {
    case KB_REGION_POINTWISE: emit_pointwise_body(c); break;
    case KB_REGION_ROW:
        if (c->split > 1) cg_emit_row_split_body(c);
        else emit_row_body(c);
        break;
    case KB_REGION_COL: emit_col_body(c); break;
    default: break;
    }
}

