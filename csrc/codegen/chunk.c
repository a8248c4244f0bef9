/* chunk.c — the chunk layer of code generation: one chunk's element loop (vector loads in front,
 * the elements, vector stores after), per-row statistics and outputs, the row cache plan (what
 * lives in registers or shared memory between passes), loads one row ahead, and a ROW region's
 * column sums. */
#include "codegen/codegen.h"

static const kb_node *NODE(const cg *c, int32_t v) { return kb_graph_node(c->g, v); }

/* ---------------------------------------------------------------- chunks, statistics, stores */

/* A store of output v was written (generate.c checks every output has one). */
static void wrote(cg *c, int32_t v) {
    if (!c->dry) c->written[v] = 1;
}

static void full_index(cg *c, idx *x) { cg_set_lin(x, c->full_lin, cg_all_bits(c)); }

static void stat_index(cg *c, idx *x) { cg_set_lin(x, c->stat_lin, cg_all_bits(c) & ~c->red); }

/* Is this vector load of the row (the first pass's, contiguous along the row) one that
 * cg_prefetch_rows issues a row ahead? Registers it as such. */
static int prefetched(cg *c, const cg_vreq *r) {
    if (!c->prefetch || c->pass != c->pf_pass || strcmp(r->base, c->full_lin0) != 0) return 0;
    for (int j = 0; j < c->npf; j++)
        if (c->pf[j] == r->v) return 1;
    if (c->npf == (int)(sizeof c->pf / sizeof c->pf[0])) return 0;
    c->pf[c->npf++] = r->v;
    return 1;
}

/* pf<v> holds the vector as 32-bit words where it is a whole number of them (kb_bits): how many,
 * else 0 (it keeps its element type). */
static int prefetch_words(const cg *c, int32_t v) {
    int bytes = c->vec * (int)kb_dtype_size(NODE(c, v)->dtype);
    return bytes % 4 == 0 ? bytes / 4 : 0;
}

void cg_prefetch_type(cg *c, int32_t v, char *T, size_t n) {
    int words = prefetch_words(c, v);
    if (words) snprintf(T, n, "kb_vec<unsigned, %d>", words);
    else snprintf(T, n, "kb_vec<%s, %d>", cg_storage(NODE(c, v)->dtype), c->vec);
}

/* The loads of row `row` (an expression) into pf<v>[u], for every prefetched input. */
void cg_prefetch_rows(cg *c, const char *row, const char *why) {
    cg_line(c, "{  // %s", why);
    c->ind++;
    cg_line(c, "const long long prow = %s;", row);
    cg_line(c, "if (prow < O) {");
    cg_line(c, "    #pragma unroll");
    cg_line(c, "    for (int u = 0; u < %d; ++u) {", c->U);
    cg_line(c, "        const long long c0 = ((long long)u * %d + lane) * %d;", c->G, c->vec);
    cg_line(c, "        if (c0 < R) {");
    for (int j = 0; j < c->npf; j++) {
        int32_t v = c->pf[j];
        const char *T = cg_storage(NODE(c, v)->dtype);
        int words = prefetch_words(c, v);
        if (words)
            cg_line(c, "            pf%d[u] = kb_ld<unsigned, %d>(reinterpret_cast<const unsigned *>(p%d + (prow * R + c0)));", (int)v,
                    words, (int)v);
        else
            cg_line(c, "            pf%d[u] = kb_ld<%s, %d>(p%d + (prow * R + c0));", (int)v, T, c->vec, (int)v);
    }
    cg_line(c, "        }");
    cg_line(c, "    }");
    for (int j = 0; j < c->nps; j++)
        cg_line(c, "    pfs%d = p%d[prow];", (int)c->ps[j], (int)c->ps[j]);
    cg_line(c, "}");
    c->ind--;
    cg_line(c, "}");
}

void cg_chunk(cg *c, const int32_t *reds, int nred, const int32_t *outs, int nout, const int32_t *csums, int ncs) {
    kb_region_kind kind = c->rg->kind;
    int V = c->vec;
    /* chunk scope: the anchor position of the chunk's first element */
    if (kind == KB_REGION_POINTWISE && V > 1 && c->aligned) cg_decl_vars(c, c->base, cg_all_bits(c), 1);
    if (kind == KB_REGION_ROW && V > 1) cg_decl_vars(c, "c0", c->red, 1);
    kb_sb *outer = c->out, body;
    kb_sb_init(&body, c->ctx);
    int ind0 = c->ind;
    c->out = &body;
    c->ind = ind0 + 1;
    c->nvr = 0;
    cg_scope_push(c);
    c->in_element = 1;
    const char *pos = kind == KB_REGION_POINTWISE ? "i" : kind == KB_REGION_ROW ? "c" : "col";
    if (V > 1) cg_line(c, "const long long %s = %s + k;", pos, c->base);
    else cg_line(c, "const long long %s = %s;", pos, c->base);
    if (V > 1 && c->aligned) cg_line(c, "const long long a%d = a%d_0 + k;", c->last, c->last);
    else if (kind == KB_REGION_POINTWISE) cg_decl_vars(c, "i", cg_all_bits(c), 0);
    else if (kind == KB_REGION_ROW) cg_decl_vars(c, "c", c->red, 0);
    idx full;
    full_index(c, &full);
    char val[EXPR_LEN];
    for (int j = 0; j < nred; j++) {
        const kb_node *nd = NODE(c, reds[j]);
        if (c->online_of[reds[j]] >= 0) continue; /* folded into its max */
        cg_ev(c, nd->inputs[0], &full, val);
        char acc[NAME_LEN], comb[EXPR_LEN * 2];
        if (kind == KB_REGION_COL) snprintf(acc, sizeof acc, "acc%d[%s]", (int)reds[j], c->kvar);
        else snprintf(acc, sizeof acc, "acc%d", (int)reds[j]);
        if (c->partner[reds[j]] >= 0) {
            char accs[NAME_LEN];
            if (kind == KB_REGION_COL) snprintf(accs, sizeof accs, "acc%d[%s]", (int)c->partner[reds[j]], c->kvar);
            else snprintf(accs, sizeof accs, "acc%d", (int)c->partner[reds[j]]);
            if (c->online_local) { /* the max here, the sum after the loop (online_local_sums) */
                cg_line(c, "%s = kb_maxf(%s, %s);", acc, acc, val);
                cg_line(c, "ol%d[u][%s] = %s;", (int)c->partner[reds[j]], c->kvar, val);
            } else {
                cg_line(c, "kb_online_add(%s, %s, %s);", acc, accs, val);
            }
            continue;
        }
        const char *f = (nd->op == KB_OP_RMAX) ? "kb_maxf(%s, %s)" : (nd->op == KB_OP_RMIN) ? "kb_minf(%s, %s)" : "%s + %s";
        cg_fmt(c, comb, sizeof comb, f, acc, val);
        cg_line(c, "%s = %s;", acc, comb);
    }
    for (int j = 0; j < ncs; j++) { /* column sums: this thread's columns, summed over its rows */
        cg_ev(c, NODE(c, csums[j])->inputs[0], &full, val);
        cg_line(c, "cs%d[u][%s] += %s;", (int)csums[j], c->kvar, val);
    }
    const int vstore = c->full_vec_ok; /* every output of the chunk as one vector, or element by element */
    for (int j = 0; j < nout; j++) {
        const kb_node *nd = NODE(c, outs[j]);
        cg_ev_store(c, outs[j], &full, val);
        char st[EXPR_LEN * 2];
        cg_fmt(c, st, sizeof st, cg_store_fmt(nd->dtype), val);
        if (vstore) cg_line(c, "y%d.v[k] = %s;", (int)outs[j], st);
        else cg_line(c, "p%d[%s] = %s;", (int)outs[j], c->full_lin, st);
        wrote(c, outs[j]);
    }
    c->in_element = 0;
    cg_scope_pop(c);
    c->out = outer;
    c->ind = ind0;
    /* the chunk: vector loads first (all in flight together), the elements, vector stores */
    for (int i = 0; i < c->nvr; i++) {
        const cg_vreq *r = &c->vr[i];
        const char *T = cg_storage(NODE(c, r->v)->dtype);
        if (r->smem) cg_line(c, "const kb_vec<%s, %d> %s = kb_ld<%s, %d>(sm%d + %s);", T, V, r->name, T, V, (int)r->v, r->base);
        else if (prefetched(c, r))
            cg_line(c, "const kb_vec<%s, %d> %s = kb_bits<%s, %d>(pf%d[u]);  // loaded a row ahead", T, V, r->name, T, V, (int)r->v);
        else if (r->guard[0]) /* a where() branch's read: only chunks it selects load */
            cg_line(c, "const kb_vec<%s, %d> %s = %s ? kb_ld<%s, %d>(p%d + %s) : kb_vec<%s, %d>{};", T, V, r->name, r->guard,
                    T, V, (int)r->v, r->base, T, V);
        else cg_line(c, "const kb_vec<%s, %d> %s = kb_ld<%s, %d>(p%d + %s);", T, V, r->name, T, V, (int)r->v, r->base);
        if (r->fill) cg_line(c, "kb_st<%s, %d>(sm%d + c0, %s);  // into the row cache", T, V, (int)r->v, r->name);
    }
    for (int j = 0; j < nout && vstore; j++)
        cg_line(c, "kb_vec<%s, %d> y%d;", cg_storage(NODE(c, outs[j])->dtype), V, (int)outs[j]);
    if (V > 1) {
        cg_line(c, "#pragma unroll");
        cg_line(c, "for (int k = 0; k < %d; ++k) {", V);
    } else {
        cg_line(c, "{");
    }
    if (!c->dry && body.buf) kb_sb_puts(c->out, body.buf);
    if (body.oom) c->st = KB_FAIL(c->ctx, KB_ERR_OOM, "out of memory");
    kb_sb_discard(&body);
    cg_line(c, "}");
    for (int j = 0; j < nout && vstore; j++) {
        const char *T = cg_storage(NODE(c, outs[j])->dtype);
        cg_line(c, "kb_st<%s, %d>(p%d + %s, y%d);", T, V, (int)outs[j], c->full_lin0, (int)outs[j]);
    }
}

void cg_bind_stat(cg *c, int32_t reduce) {
    idx x;
    stat_index(c, &x);
    char var[NAME_LEN];
    if (c->rg->kind == KB_REGION_COL) snprintf(var, sizeof var, "v%d[%s]", (int)reduce, c->kvar);
    else snprintf(var, sizeof var, "v%d", (int)reduce);
    cg_bind(c, reduce, &x, var);
}

/* Per-row values that follow from finished reductions alone (rstd = rsqrt(var + eps)):
 * computed once per row rather than once per element. */
void cg_eager_stats(cg *c, int pass) {
    if (c->rg->kind != KB_REGION_ROW) return;
    idx x;
    stat_index(c, &x);
    char val[EXPR_LEN];
    for (int32_t k = 0; k < c->rg->nnodes; k++) {
        int32_t v = c->rg->nodes[k];
        const kb_node *nd = NODE(c, v);
        kb_op_kind kind = kb_op_get(nd->op)->kind;
        int keep;
        if (!c->pure[v] || c->dp[v] < 0 || c->dp[v] > pass || nd->op == KB_OP_CONST) continue;
        if (kind != KB_KIND_UNARY && kind != KB_KIND_BINARY && kind != KB_KIND_TERNARY) continue;
        if (!cg_stat_shape(c, nd, &keep)) continue;
        cg_ev(c, v, &x, val);
    }
}

int cg_out_full(cg *c, int32_t v) {
    if (c->rg->kind == KB_REGION_POINTWISE) return 1;
    if (c->colsum[v]) return 0;
    int full = cg_numel_is(c, v, 0), stat = cg_numel_is(c, v, 1);
    if (full && stat) return c->dp[v] < 0 || kb_op_get(NODE(c, v)->op)->kind != KB_KIND_REDUCE;
    return full;
}

/* Is output v one of the region's saved statistics (the last nsaved outputs)? */
static int saved_output(const cg *c, int32_t v) {
    for (int32_t j = c->rg->noutputs - c->rg->nsaved; j < c->rg->noutputs; j++)
        if (c->rg->outputs[j] == v) return 1;
    return 0;
}

/* A ROW region's saved statistic, stored as soon as its reduction is done (KB_SAVE: the entry
 * point a backward will follow; see emit_saving_entries). */
void cg_saved_stat_store(cg *c, int32_t v) {
    if (!c->saving || !saved_output(c, v)) return;
    cg_line(c, "if (KB_SAVE && lane == 0 && row < O) p%d[row] = v%d;  // saved for the backward", (int)v, (int)v);
    wrote(c, v);
}

void cg_stat_outputs(cg *c) {
    int any = 0;
    for (int32_t j = 0; j < c->rg->noutputs; j++) {
        int32_t v = c->rg->outputs[j];
        any |= !cg_out_full(c, v) && !c->colsum[v] && !(c->saving && saved_output(c, v));
    }
    if (!any) return;
    idx x;
    char val[EXPR_LEN], st[EXPR_LEN * 2];
    kb_sb_puts(c->out, c->dry ? "" : "\n");
    if (c->rg->kind == KB_REGION_ROW && c->split > 1) { /* every part's block has them: the first writes */
        cg_line(c, "// per-row outputs, by the row's first part");
        cg_line(c, "if (lane == 0 && part == 0) {");
    } else if (c->rg->kind == KB_REGION_ROW) {
        cg_line(c, "// per-row outputs");
        cg_line(c, "if (lane == 0 && row < O) {");
    } else {
        cg_line(c, "// per-column outputs");
        if (c->vec > 1) cg_line(c, "for (int k = 0; k < %d; ++k) {", c->vec);
        else cg_line(c, "{");
    }
    c->ind++;
    cg_scope_push(c);
    if (c->rg->kind == KB_REGION_COL) {
        cg_line(c, "const long long col = col0%s;", c->vec > 1 ? " + k" : "");
        if (c->vec > 1 && c->aligned) cg_line(c, "const long long a%d = a%d_0 + k;", c->last, c->last);
    }
    stat_index(c, &x);
    for (int32_t j = 0; j < c->rg->noutputs; j++) {
        int32_t v = c->rg->outputs[j];
        if (cg_out_full(c, v) || c->colsum[v] || (c->saving && saved_output(c, v))) continue;
        cg_ev_store(c, v, &x, val);
        cg_fmt(c, st, sizeof st, cg_store_fmt(NODE(c, v)->dtype), val);
        cg_line(c, "p%d[%s] = %s;", (int)v, c->stat_lin, st);
        wrote(c, v);
    }
    cg_scope_pop(c);
    c->ind--;
    cg_line(c, "}");
}

/* ---------------------------------------------------------------- the row cache */

void cg_smem_pointers(cg *c) {
    cg_line(c, "%s", c->rd->smem_decl);
    for (int32_t i = 0; i < c->rg->ninputs; i++) {
        int32_t v = c->rg->inputs[i];
        if (!c->cached[v]) continue;
        const char *T = cg_storage(NODE(c, v)->dtype);
        cg_line(c, "%s *sm%d = reinterpret_cast<%s *>(kb_smem + %d) + (long long)grp * R;  // row cache of p%d", T, (int)v, T,
                (int)c->smem_off[v], (int)v);
    }
}

void cg_regs_arrays(cg *c) {
    for (int32_t v = 0; v < c->n; v++) {
        if (c->cached[v])
            cg_line(c, "%s rc%d[%d][%d];  // %%%d's share of the row, in registers", c->ct, (int)v, c->U, c->vec, (int)v);
        if (c->online_local && c->online_of[v] >= 0)
            cg_line(c, "%s ol%d[%d][%d];  // %%%d's operand, this thread's share", c->ct, (int)v, c->U, c->vec, (int)v);
    }
}

/* Registers may hold any value a later pass reads again (softmax keeps exp(x - max), not x);
 * shared memory holds inputs, in their storage type. A cache no later pass reads is dropped. */
kb_status cg_plan_cache(cg *c, int stage) {
    if (c->rg->kind != KB_REGION_ROW || c->gn.cache == KB_CACHE_REREAD) {
        memset(c->cached, 0, (size_t)(c->n ? c->n : 1));
        return KB_OK;
    }
    int regs = c->gn.cache == KB_CACHE_REGS;
    if (stage == 0) {
        for (int32_t v = 0; v < c->n; v++) {
            int input = !c->member[v] && c->in_slot[v] >= 0;
            c->cached[v] = kb_popcount32(c->uses[v]) >= 2 && ((regs && !c->inputs_only) || input);
            c->fill_pass[v] = c->uses[v] ? (int8_t)__builtin_ctz(c->uses[v]) : 0;
            c->reads[v] = 0;
        }
        return KB_OK;
    }
    int64_t R = 1;
    for (int d = 0; d < c->arank; d++)
        if (c->red & (1u << d)) R *= c->adims[d].coef;
    int n = 0;
    c->smem_bytes = 0;
    for (int32_t v = 0; v < c->n; v++) {
        if (c->cached[v] && !c->reads[v]) c->cached[v] = 0;
        if (!c->cached[v]) continue;
        n++;
        if (!regs) {
            c->smem_off[v] = c->smem_bytes;
            int64_t bytes = (int64_t)c->gn.rows * R * (int64_t)kb_dtype_size(NODE(c, v)->dtype);
            bytes = (bytes + 15) / 16 * 16;
            if (c->smem_bytes + bytes > 0x7fffffff)
                return KB_FAIL(c->ctx, KB_ERR_INVALID, "codegen: the row cache needs more than 2 GiB of shared memory");
            c->smem_bytes += (int)bytes;
        }
    }
    if (regs && !c->inputs_only) {
        /* caches live from their first pass to their last read: if the peak does not fit the
           register budget, keep inputs only and recompute the rest (exp is cheaper than a spill) */
        int peak = 0;
        for (int p = 0; p < 32; p++) {
            int live = 0;
            for (int32_t v = 0; v < c->n; v++)
                if (c->cached[v] && c->fill_pass[v] <= p && p <= 31 - __builtin_clz(c->reads[v])) live++;
            if (live > peak) peak = live;
        }
        int budget = (c->gn.threads >= 1024 ? 32 : 64) - c->ncolsum * c->U * c->vec / 2; /* column sums hold registers too */
        if ((int64_t)peak * c->U * c->vec > budget && peak > 1) {
            c->replan = 1;
            return KB_OK;
        }
    }
    if (regs && (int64_t)n * c->U * c->vec > 256)
        return KB_FAIL(c->ctx, KB_ERR_INVALID, "genome: cache=regs needs %d registers per thread for the row",
                       n * c->U * c->vec);
    return KB_OK;
}

/* ---------------------------------------------------------------- ROW column sums */

/* A column sum of a ROW region (dweight = sum over rows of dy * xhat) never leaves the chip
 * per row: each thread adds its columns of every row it visits into registers cs<v>[u][k],
 * the block writes them once as its partial (workspace slot blockIdx.x * rows + grp), and a
 * finishing kernel adds the partials in slot order (deterministic, no atomics). */
void cg_colsum_decl(cg *c) {
    if (!c->ncolsum) return;
    cg_line(c, "// column sums: this thread's columns (u * %d + lane) * %d + k, over every row the block visits", c->G,
            c->vec);
    for (int j = 0; j < c->ncolsum; j++) cg_line(c, "%s cs%d[%d][%d] = {};", c->ct, (int)c->colsums[j], c->U, c->vec);
}

void cg_colsum_store(cg *c) {
    if (!c->ncolsum) return;
    cg_line(c, "{  // this block's partial column sums, added up by %s_finish", c->name);
    c->ind++;
    cg_line(c, "%s *ws = static_cast<%s *>(kb_ws) + ((long long)blockIdx.x * %d + grp) * %d * R;", c->ct, c->ct, c->gn.rows,
            c->ncolsum);
    cg_line(c, "#pragma unroll");
    cg_line(c, "for (int u = 0; u < %d; ++u) {", c->U);
    cg_line(c, "    const long long c0 = ((long long)u * %d + lane) * %d;", c->G, c->vec);
    cg_line(c, "    if (c0 < R) {");
    cg_line(c, "#pragma unroll");
    cg_line(c, "        for (int k = 0; k < %d; ++k) {", c->vec);
    for (int j = 0; j < c->ncolsum; j++) cg_line(c, "            ws[%d * R + c0 + k] = cs%d[u][k];", j, (int)c->colsums[j]);
    cg_line(c, "        }");
    cg_line(c, "    }");
    cg_line(c, "}");
    c->ind--;
    cg_line(c, "}");
}

/* The finishing kernel: per column, the partials of all slots, split over the block's warps
 * (slot s to warp s mod W, then the warps in order), written to every output that is the
 * column sum or a reshape of it. Runs on the main kernel's grid, so the slot count is known. */
void cg_colsum_finish(cg *c) {
    char Oexpr[EXPR_LEN], Rexpr[EXPR_LEN];
    cg_extent(c, 0, Oexpr);
    cg_extent(c, 1, Rexpr);
    int W = c->gn.threads / 32;
    cg_line(c, "const long long O = %s;  // rows", Oexpr);
    cg_line(c, "const long long R = %s;  // row length = columns summed", Rexpr);
    cg_line(c, "const long long P = (long long)gridDim.x * %d;  // partial slots the main kernel wrote", c->gn.rows);
    cg_line(c, "const %s *ws = static_cast<const %s *>(kb_ws);", c->ct, c->ct);
    cg_line(c, "__shared__ %s kb_fin[%d][%d][32];", c->ct, c->ncolsum, W);
    cg_line(c, "const int lane = threadIdx.x & 31, w0 = threadIdx.x >> 5;");
    cg_line(c, "for (long long cb = blockIdx.x; cb * 32 < R; cb += gridDim.x) {");
    c->ind++;
    cg_line(c, "const long long col = cb * 32 + lane;");
    for (int j = 0; j < c->ncolsum; j++) cg_line(c, "%s t%d = 0;", c->ct, j);
    cg_line(c, "if (col < R)");
    cg_line(c, "    for (long long s = w0; s < P; s += %d) {", W);
    for (int j = 0; j < c->ncolsum; j++) cg_line(c, "        t%d += ws[(s * %d + %d) * R + col];", j, c->ncolsum, j);
    cg_line(c, "    }");
    for (int j = 0; j < c->ncolsum; j++) cg_line(c, "kb_fin[%d][w0][lane] = t%d;", j, j);
    cg_line(c, "%s;", c->rd->barrier);
    cg_line(c, "if (w0 == 0 && col < R) {");
    c->ind++;
    for (int j = 0; j < c->ncolsum; j++) {
        int32_t v = c->colsums[j];
        cg_line(c, "%s v%d = kb_fin[%d][0][lane];", c->ct, (int)v, j);
        cg_line(c, "for (int w = 1; w < %d; ++w) v%d += kb_fin[%d][w][lane];", W, (int)v, j);
        if (NODE(c, v)->op == KB_OP_MEAN) cg_line(c, "v%d = v%d / (%s)O;", (int)v, (int)v, c->ct);
    }
    idx x; /* the column sums' own index: the position in the row */
    cg_set_lin(&x, "col", c->red);
    for (int j = 0; j < c->ncolsum; j++) {
        char var[NAME_LEN];
        snprintf(var, sizeof var, "v%d", (int)c->colsums[j]);
        cg_bind(c, c->colsums[j], &x, var);
    }
    for (int32_t j = 0; j < c->rg->noutputs; j++) {
        int32_t w = c->rg->outputs[j];
        if (!c->colsum[w]) continue;
        char val[EXPR_LEN], st[EXPR_LEN * 2];
        cg_ev(c, w, &x, val);
        cg_fmt(c, st, sizeof st, cg_store_fmt(NODE(c, w)->dtype), val);
        cg_line(c, "p%d[col] = %s;", (int)w, st);
        wrote(c, w);
    }
    c->ind--;
    cg_line(c, "}");
    cg_line(c, "%s;", c->rd->barrier);
    c->ind--;
    cg_line(c, "}");
}
