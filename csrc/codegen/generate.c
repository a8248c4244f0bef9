/* generate.c — the top of code generation's source layer: kb_kernel_generate sets the generator
 * up, checks the genome against the region, runs the kernel skeleton (kernel.c) dry to plan the
 * row cache and then for real, and assembles the source: the kernel's text (signatures, body,
 * entry points; params.c), the preamble it needs (preamble.c) in front, its parameters named
 * last (params.c); plus the launch geometry of the result (grid units, the grid's cap). */
#include "codegen/codegen.h"


static const kb_node *NODE(const cg *c, int32_t v) { return kb_graph_node(c->g, v); }

static const renderer CUDA_RENDERER = {
    .kernel_prefix = "extern \"C\" __global__ void",
    .launch_bounds = "__launch_bounds__(%d)",
    .barrier = "__syncthreads()",
    .shfl_xor = "__shfl_xor_sync(0xffffffffu, %s, o)",
    .restrict_kw = "__restrict__",
    .smem_decl = "extern __shared__ __align__(16) unsigned char kb_smem[];",
};

/* ---------------------------------------------------------------- the generator's state */

static kb_status dims_product(cg *c, uint32_t mask, int64_t mul, kb_dim *out) {
    kb_dim d = {mul, 0, {0}};
    for (int i = 0; i < c->arank; i++) {
        if (!(mask & (1u << i))) continue;
        d.coef *= c->adims[i].coef;
        for (int s = 0; s < c->adims[i].nsym; s++) {
            if (d.nsym == KB_MAX_DIM_SYMS)
                return KB_FAIL(c->ctx, KB_ERR_UNSUPPORTED, "codegen: the grid size multiplies more than %d symbols",
                               KB_MAX_DIM_SYMS);
            int j = d.nsym++;
            while (j > 0 && d.sym[j - 1] > c->adims[i].sym[s]) {
                d.sym[j] = d.sym[j - 1];
                j--;
            }
            d.sym[j] = c->adims[i].sym[s];
        }
    }
    *out = d;
    return KB_OK;
}

static kb_status cg_grid_units(cg *c, kb_dim *units, int64_t *per_block) {
    uint32_t all = cg_all_bits(c);
    switch (c->rg->kind) {
    case KB_REGION_POINTWISE:
        *per_block = (int64_t)c->gn.threads * c->gn.vec * c->gn.items;
        return dims_product(c, all, 1, units);
    case KB_REGION_ROW: /* a split row: (row, part) units, a block each */
        *per_block = c->gn.rows;
        return dims_product(c, all & ~c->red, c->split, units);
    default:
        *per_block = (int64_t)c->gn.threads * c->gn.vec;
        return dims_product(c, all & ~c->red, c->col_split, units);
    }
}

static kb_status cg_status(cg *c) { return c->st; }

static void cg_reset(cg *c) {
    c->nents = 0;
    c->scope = 0;
    c->counter = 0;
    c->nvr = 0;
    c->pass = 0;
    c->in_element = 0;
    c->ind = 1;
}

void cg_done(cg *c) {
    if (!c->ctx) return;
    size_t n = (size_t)(c->n ? c->n : 1);
    kb_free(c->ctx, c->member, n);
    kb_free(c->ctx, c->in_slot, sizeof(int32_t) * n);
    kb_free(c->ctx, c->dp, n);
    kb_free(c->ctx, c->pure, n);
    kb_free(c->ctx, c->written, n);
    kb_free(c->ctx, c->uses, sizeof(uint32_t) * n);
    kb_free(c->ctx, c->reads, sizeof(uint32_t) * n);
    kb_free(c->ctx, c->cached, n);
    kb_free(c->ctx, c->fill_pass, n);
    kb_free(c->ctx, c->smem_off, sizeof(int32_t) * n);
    kb_free(c->ctx, c->partner, sizeof(int32_t) * n);
    kb_free(c->ctx, c->online_of, sizeof(int32_t) * n);
    kb_free(c->ctx, c->colsum, n);
    kb_free(c->ctx, c->ents, sizeof(cg_ent) * (size_t)c->capents);
    c->ctx = NULL;
}

static int reads_colsum(const cg *c, const kb_node *nd) {
    for (int i = 0; i < nd->ninputs; i++)
        if (c->member[nd->inputs[i]] && c->colsum[nd->inputs[i]]) return 1;
    return 0;
}

kb_status cg_init(cg *c, const kb_partition *p, int32_t r, const kb_region *rg, const kb_genome *gn,
                  const kb_device_info *dev) {
    (void)dev;
    memset(c, 0, sizeof *c);
    c->ctx = kb_graph_ctx(p->graph);
    c->p = p;
    c->g = p->graph;
    c->rg = rg;
    c->r = r;
    c->gn = *gn;
    c->rd = &CUDA_RENDERER;
    c->n = kb_graph_nnodes(c->g);
    size_t n = (size_t)(c->n ? c->n : 1);
    c->member = kb_calloc(c->ctx, n, 1);
    c->in_slot = kb_malloc(c->ctx, sizeof(int32_t) * n);
    c->dp = kb_calloc(c->ctx, n, 1);
    c->pure = kb_calloc(c->ctx, n, 1);
    c->written = kb_calloc(c->ctx, n, 1);
    c->uses = kb_calloc(c->ctx, n, sizeof(uint32_t));
    c->reads = kb_calloc(c->ctx, n, sizeof(uint32_t));
    c->cached = kb_calloc(c->ctx, n, 1);
    c->fill_pass = kb_calloc(c->ctx, n, 1);
    c->smem_off = kb_calloc(c->ctx, n, sizeof(int32_t));
    c->partner = kb_malloc(c->ctx, sizeof(int32_t) * n);
    c->online_of = kb_malloc(c->ctx, sizeof(int32_t) * n);
    c->colsum = kb_calloc(c->ctx, n, 1);
    if (!c->colsum || !c->member || !c->in_slot || !c->dp || !c->pure || !c->written || !c->uses || !c->reads || !c->cached ||
        !c->fill_pass || !c->smem_off || !c->partner || !c->online_of)
        return KB_ERR_OOM;
    for (int32_t v = 0; v < c->n; v++) c->in_slot[v] = c->partner[v] = c->online_of[v] = -1;
    for (int32_t i = 0; i < c->rg->ninputs; i++) c->in_slot[c->rg->inputs[i]] = i;
    /* dtypes: compute in double when f64 is involved; headers only when used */
    for (int32_t k = 0; k < c->rg->nnodes + c->rg->ninputs; k++) {
        int32_t v = k < c->rg->nnodes ? c->rg->nodes[k] : c->rg->inputs[k - c->rg->nnodes];
        if (k < c->rg->nnodes) c->member[v] = 1;
        kb_dtype t = NODE(c, v)->dtype;
        c->dbl |= t == KB_F64;
        c->use_bf16 |= t == KB_BF16;
        c->use_f16 |= t == KB_F16;
    }
    c->ct = c->dbl ? "double" : "float";
    /* the space */
    const kb_node *a = NODE(c, c->rg->anchor);
    c->arank = a->rank;
    c->last = a->rank - 1;
    memcpy(c->adims, a->dims, sizeof(kb_dim) * (size_t)a->rank);
    c->red = c->rg->kind == KB_REGION_POINTWISE ? 0 : c->rg->reduce_axes;
    int nred = kb_popcount32(c->red);
    uint32_t all = cg_all_bits(c);
    uint32_t trail = nred ? (all & ~((1u << (c->arank - nred)) - 1)) : 0, lead = (1u << nred) - 1;
    c->trailing = (c->rg->kind == KB_REGION_ROW && c->red == trail) || (c->rg->kind == KB_REGION_COL && c->red == lead);
    c->red_pinned = 1;
    int64_t R = 1;
    for (int d = 0; d < c->arank; d++)
        if (c->red & (1u << d)) {
            if (c->adims[d].nsym) c->red_pinned = 0;
            R *= c->adims[d].coef;
        }
    static const char *const kinds[] = {"pointwise", "row", "col", "extern", "gemm"};
    snprintf(c->name, sizeof c->name, "kb_r%d_%s", (int)r, kinds[c->rg->kind]);
    c->col_split = c->rg->kind == KB_REGION_COL ? gn->col_split : 1;
    c->split = c->rg->kind == KB_REGION_ROW && gn->row_split > 1 ? gn->row_split : 1;
    c->G = c->rg->kind == KB_REGION_ROW ? gn->threads / (gn->rows > 0 ? gn->rows : 1) : gn->threads;
    if (c->G < 1) c->G = 1;
    c->vec = gn->vec;
    if (c->split > 1) { /* a block holds one part of the row (kernel.c's span) */
        int64_t v = c->vec > 0 ? c->vec : 1;
        R = ((R + c->split - 1) / c->split + v - 1) / v * v;
    }
    int64_t per = (int64_t)c->G * (c->vec > 0 ? c->vec : 1), U = R / per + (R % per != 0);
    /* a row's share per thread is a loop bound and the size of register arrays: bounded, so
       no count made from it overflows an int */
    if (U > (1 << 20))
        return KB_FAIL(c->ctx, KB_ERR_UNSUPPORTED, "codegen: rows of %lld elements, %lld a thread (at most 2^20)",
                       (long long)R, (long long)U);
    c->U = U < 1 ? 1 : (int)U;
    c->base = c->rg->kind == KB_REGION_POINTWISE ? "i0" : c->rg->kind == KB_REGION_ROW ? "c0" : "col0";
    cg_set_space_vec(c);
    /* values that are functions of reductions and constants alone */
    for (int32_t k = 0; k < c->rg->nnodes; k++) {
        int32_t v = c->rg->nodes[k];
        const kb_node *nd = NODE(c, v);
        kb_op_kind kind = kb_op_get(nd->op)->kind;
        if (kind == KB_KIND_REDUCE && c->rg->kind == KB_REGION_ROW && nd->axes != c->red) {
            if (c->ncolsum == (int)(sizeof c->colsums / sizeof c->colsums[0]))
                return KB_FAIL(c->ctx, KB_ERR_UNSUPPORTED, "codegen: more than %d column sums in one region",
                               KB_MAX_COLSUMS);
            c->colsum[v] = 1;
            c->colsums[c->ncolsum++] = v;
        } else if (kind != KB_KIND_REDUCE && kind != KB_KIND_GATHER && reads_colsum(c, nd)) {
            c->colsum[v] = 2; /* pointwise work on column sums: the finishing kernel's */
        } else if (kind == KB_KIND_REDUCE) {
            c->nred_total++;
            c->pure[v] = 1;
        } else if (nd->op == KB_OP_CONST) {
            c->pure[v] = 1;
        } else if (kind == KB_KIND_UNARY || kind == KB_KIND_BINARY || kind == KB_KIND_TERNARY || kind == KB_KIND_VIEW) {
            int ok = 1;
            for (int i = 0; i < nd->ninputs; i++) ok &= c->member[nd->inputs[i]] && c->pure[nd->inputs[i]];
            c->pure[v] = (uint8_t)ok;
        }
    }
    c->ind = 1;
    return KB_OK;
}

/* ---------------------------------------------------------------- unused declarations */

/* The skeletons declare every index variable a scope might need; this drops the `const`
 * declarations nothing reads (to a fixpoint: dropping a1 may orphan a1_0), so the kernel
 * compiles without warnings and reads without noise. Comments are not searched. */
static int has_token(const char *s, const char *e, const char *name, size_t n) {
    for (const char *p = s; p + n <= e; p++) {
        if (p[0] == '/' && p[1] == '/') {
            while (p < e && *p != '\n') p++;
            continue;
        }
        if (memcmp(p, name, n) != 0) continue;
        char before = p > s ? p[-1] : ' ', after = p + n < e ? p[n] : ' ';
        int id_b = (before >= 'a' && before <= 'z') || (before >= 'A' && before <= 'Z') || (before >= '0' && before <= '9') || before == '_';
        int id_a = (after >= 'a' && after <= 'z') || (after >= 'A' && after <= 'Z') || (after >= '0' && after <= '9') || after == '_';
        if (!id_b && !id_a) return 1;
    }
    return 0;
}

void cg_prune_unused(char *src) {
    for (int changed = 1; changed;) {
        changed = 0;
        for (char *line = src; *line;) {
            char *eol = strchr(line, '\n');
            if (!eol) break;
            char *p = line;
            while (*p == ' ') p++;
            char *eq = strstr(p, " = "), *code_end = strstr(p, "//");
            if (!code_end || code_end > eol) code_end = eol;
            while (code_end > p && code_end[-1] == ' ') code_end--;
            if (strncmp(p, "const ", 6) == 0 && eq && eq < code_end && code_end[-1] == ';' &&
                !memchr(p, '(', (size_t)(eq - p))) {
                char *name = eq;
                while (name > p && name[-1] != ' ' && name[-1] != '*') name--;
                size_t n = (size_t)(eq - name);
                /* the rest of the enclosing block */
                int depth = 0;
                char *end = eol + 1;
                for (; *end; end++) {
                    if (*end == '{') depth++;
                    if (*end == '}' && --depth < 0) break;
                }
                if (n > 0 && !has_token(eol + 1, end, name, n)) {
                    memmove(line, eol + 1, strlen(eol + 1) + 1);
                    changed = 1;
                    continue;
                }
            }
            line = eol + 1;
        }
    }
}

/* ---------------------------------------------------------------- driver */

static kb_status check_genome(cg *c) {
    const kb_genome *gn = &c->gn;
    kb_ctx *ctx = c->ctx;
    if (gn->threads < 32 || gn->threads > 1024 || gn->threads % 32)
        return KB_FAIL(ctx, KB_ERR_INVALID, "genome: threads=%d (32..1024, a multiple of 32)", gn->threads);
    if (gn->vec != 1 && gn->vec != 2 && gn->vec != 4 && gn->vec != 8 && gn->vec != 16)
        return KB_FAIL(ctx, KB_ERR_INVALID, "genome: vec=%d (1, 2, 4, 8 or 16)", gn->vec);
    if (gn->items < 1 || gn->items > 64) return KB_FAIL(ctx, KB_ERR_INVALID, "genome: items=%d (1..64)", gn->items);
    if (gn->vec > 1 && c->rg->kind != KB_REGION_POINTWISE && !c->aligned)
        return KB_FAIL(ctx, KB_ERR_INVALID, "genome: vec=%d needs the last dim a multiple of it", gn->vec);
    if (c->rg->kind == KB_REGION_ROW) {
        if (gn->rows < 1 || gn->threads % gn->rows) return KB_FAIL(ctx, KB_ERR_INVALID, "genome: rows=%d must divide threads", gn->rows);
        int G = gn->threads / gn->rows;
        if (G & (G - 1)) return KB_FAIL(ctx, KB_ERR_INVALID, "genome: threads/rows=%d must be a power of two", G);
        if (gn->cache != KB_CACHE_REREAD && !c->red_pinned)
            return KB_FAIL(ctx, KB_ERR_INVALID, "genome: cache=%s needs a pinned row length", gn->cache == KB_CACHE_REGS ? "regs" : "smem");
        if (c->ncolsum && !c->red_pinned) return KB_FAIL(ctx, KB_ERR_INVALID, "column sums need a pinned row length");
        if ((int64_t)c->ncolsum * c->U * c->vec > 128)
            return KB_FAIL(ctx, KB_ERR_INVALID, "genome: %d column sums need %d registers per thread (more threads per row)",
                           c->ncolsum, c->ncolsum * c->U * c->vec);
    } else if (gn->rows != 1) {
        return KB_FAIL(ctx, KB_ERR_INVALID, "genome: rows=%d applies to ROW regions only", gn->rows);
    }
    const kb_gene *rs = &kb_genome_genes()[KB_NGENES - 1]; /* row_split, the last gene */
    if (gn->row_split < rs->lo || gn->row_split > rs->hi)
        return KB_FAIL(ctx, KB_ERR_INVALID, "genome: row_split=%d (%d..%d)", gn->row_split, rs->lo, rs->hi);
    if (gn->row_split > 1) {
        if (c->rg->kind != KB_REGION_ROW)
            return KB_FAIL(ctx, KB_ERR_INVALID, "genome: row_split=%d applies to ROW regions only", gn->row_split);
        if (gn->rows != 1 || gn->persistent || gn->cache == KB_CACHE_SMEM || c->ncolsum)
            return KB_FAIL(ctx, KB_ERR_INVALID,
                           "genome: row_split>1 takes rows=1, persistent=0, cache regs or reread and no column sums");
        for (int32_t k = 0; k < c->rg->nnodes; k++) { /* each row reduction merges from its parts' partials */
            int32_t v = c->rg->nodes[k];
            if (kb_op_get(NODE(c, v)->op)->kind != KB_KIND_REDUCE || c->colsum[v] || c->dp[v] == 0 ||
                (c->dp[v] == 1 && cg_split_center(c, v) >= 0))
                continue;
            return KB_FAIL(ctx, KB_ERR_INVALID,
                           "genome: row_split>1 with %%%d, a row reduction of another's result (only squares about a "
                           "mean and softmax's sum of exp merge from a split row's parts)", (int)v);
        }
    }
    if (c->rg->kind == KB_REGION_COL && gn->col_split > 1) {
        if (c->npasses > 1) return KB_FAIL(ctx, KB_ERR_INVALID, "genome: col_split>1 with reductions in sequence");
        for (int32_t j = 0; j < c->rg->noutputs; j++)
            if (cg_out_full(c, c->rg->outputs[j]) && cg_pass_of_output(c, c->rg->outputs[j]) > 0)
                return KB_FAIL(ctx, KB_ERR_INVALID, "genome: col_split>1 with a full-size output after the reduction");
    } else if (c->rg->kind != KB_REGION_COL && gn->col_split != 1) {
        return KB_FAIL(ctx, KB_ERR_INVALID, "genome: col_split=%d applies to COL regions only", gn->col_split);
    }
    return KB_OK;
}

void kb_kernel_free(kb_ctx *ctx, kb_kernel *k) {
    if (!k) return;
    kb_string_free(ctx, k->source);
    kb_free(ctx, k, sizeof *k);
}

kb_status kb_kernel_generate(const kb_partition *p, int32_t r, const kb_genome *gn, const kb_device_info *dev,
                             kb_kernel **out) {
    if (!p || !gn || !out) return KB_ERR_INVALID;
    *out = NULL;
    kb_ctx *ctx = kb_graph_ctx(p->graph);
    kb_status st = KB_OK;
    kb_sb src, body, finish, scratch, kernel;
    char *text = NULL;
    kb_sb_init(&src, ctx);
    kb_sb_init(&kernel, ctx);
    kb_sb_init(&body, ctx);
    kb_sb_init(&finish, ctx);
    kb_sb_init(&scratch, ctx);
    kb_kernel *k = NULL;
    cg c;
    memset(&c, 0, sizeof c);
    KB_CHECK(ctx, r >= 0 && r < p->nregions, KB_ERR_INVALID, "codegen: region %d of %d", (int)r, (int)p->nregions);
    KB_CHECK(ctx, p->regions[r].kind != KB_REGION_EXTERN, KB_ERR_INVALID, "codegen: region %d is EXTERN", (int)r);
    /* a GEMM region's kernel is the GEMM generator's with the region's epilogue (gemm_region.c) */
    if (p->regions[r].kind == KB_REGION_GEMM) return cg_gemm_region_generate(p, r, gn, dev, out);
    KB_TRY(cg_init(&c, p, r, &p->regions[r], gn, dev));
    cg_plan_passes(&c);
    KB_TRY(check_genome(&c));
    /* a split row's statistics are the finishing kernel's, written like any per-row output: one
       entry point (inference writes them into the launcher's scratch) */
    c.saving = c.rg->kind == KB_REGION_ROW && c.rg->nsaved > 0 && c.split == 1;

    /* dry runs: which values several passes evaluate (those a row cache holds), then which of
       those caches a later pass actually reads */
    c.out = &scratch;
    c.dry = 1;
    for (int round = 0; round < 2; round++) {
        size_t n = (size_t)(c.n ? c.n : 1);
        memset(c.uses, 0, sizeof(uint32_t) * n);
        memset(c.reads, 0, sizeof(uint32_t) * n);
        memset(c.cached, 0, n);
        for (int stage = 0; stage < 2; stage++) {
            cg_emit_body(&c);
            KB_TRY(cg_status(&c));
            kb_sb_discard(&scratch);
            KB_TRY(cg_plan_cache(&c, stage));
            cg_reset(&c);
        }
        if (!c.replan) break;
        c.replan = 0;
        c.inputs_only = 1;
    }
    c.dry = 0;
    c.out = &body;
    cg_emit_body(&c);
    if (c.col_split > 1 || c.ncolsum || c.split > 1) {
        c.out = &finish;
        kb_sb_puts(&finish, "\n");
        cg_emit_signature(&c, &finish, KB_ENTRY_FINISH);
        kb_sb_puts(&finish, "{\n");
        cg_reset(&c);
        if (c.ncolsum) cg_colsum_finish(&c);
        else if (c.split > 1) cg_emit_row_split_finish(&c);
        else cg_emit_col_finish(&c);
        kb_sb_puts(&finish, "}\n");
    }
    KB_TRY(cg_status(&c));
    KB_CHECK(ctx, !body.oom && !finish.oom, KB_ERR_OOM, "out of memory");
    /* a kernel that leaves an output unwritten is never handed out as a result */
    for (int32_t j = 0; j < c.rg->noutputs; j++)
        KB_CHECK(ctx, c.written[c.rg->outputs[j]], KB_ERR_UNSUPPORTED,
                 "codegen: region %d: output %d of %d (%%%d) has no store in the kernel", (int)r, (int)j,
                 (int)c.rg->noutputs, (int)c.rg->outputs[j]);
    if (body.buf) cg_prune_unused(body.buf);
    if (finish.buf) cg_prune_unused(finish.buf);

    /* the kernel's text first: the preamble holds what it names */
    if (c.maxred > 0 && c.G > 32) kb_sb_printf(&kernel, "#define KB_NRED %d\n", c.maxred);
    if (c.saving) {
        kb_sb_printf(&kernel, "template <bool KB_SAVE>\n__device__ __forceinline__ void %s_body(", c.name);
        cg_emit_params(&c, &kernel, 1);
        kb_sb_puts(&kernel, ")\n");
    } else {
        cg_emit_signature(&c, &kernel, "");
    }
    kb_sb_puts(&kernel, "{\n");
    if (body.buf) kb_sb_puts(&kernel, body.buf);
    kb_sb_puts(&kernel, "}\n");
    if (c.saving) cg_emit_saving_entries(&c, &kernel);
    if (finish.buf) kb_sb_puts(&kernel, finish.buf);
    KB_CHECK(ctx, !kernel.oom, KB_ERR_OOM, "out of memory");
    cg_emit_preamble(&c, &src, kernel.buf);
    if (kernel.buf) kb_sb_puts(&src, kernel.buf);
    KB_TRY(kb_sb_finish(&src, &text));

    k = kb_calloc(ctx, 1, sizeof *k);
    KB_CHECK(ctx, k != NULL, KB_ERR_OOM, "out of memory");
    KB_TRY(cg_name_params(&c, text, kernel.buf, &k->source));
    snprintf(k->name, sizeof k->name, "%s", c.name);
    k->block = gn->threads;
    k->smem_bytes = c.smem_bytes;
    k->genome = *gn;
    k->nkernels = c.col_split > 1 || c.ncolsum || c.split > 1 ? 2 : 1;
    k->nostats = c.saving;
    /* grid_units of a split COL region count (column, split) pairs, of a split ROW region (row,
       part) pairs: one partial per reduction */
    k->workspace_bytes_per_unit = c.col_split > 1 || c.split > 1 ? (int64_t)c.nred_total * (c.dbl ? 8 : 4) : 0;
    if (c.ncolsum) { /* a partial row per column sum and row slot of each block: few blocks, about 1024
                        threads per SM (persistent=1: 2048, twice the partials) */
        int64_t R = 1;
        for (int d = 0; d < c.arank; d++)
            if (c.red & (1u << d)) R *= c.adims[d].coef;
        k->workspace_bytes_per_block = (int64_t)gn->rows * c.ncolsum * R * (c.dbl ? 8 : 4);
        int per_sm = (gn->persistent ? 2048 : 1024) / gn->threads;
        k->max_blocks_per_sm = per_sm > 1 ? per_sm : 1;
    }
    KB_TRY(cg_grid_units(&c, &k->grid_units, &k->units_per_block));
    k->last_multiple = c.guard_last ? c.vec : 1;
    k->last_dim = c.guard_last ? c.adims[c.last] : (kb_dim){1, 0, {0}};
    /* the block's limit covers the static arrays too (the reductions' partials, under 4 KiB) */
    KB_CHECK(ctx, dev == NULL || dev->max_smem_per_block <= 0 || k->smem_bytes + 4096 <= dev->max_smem_per_block,
             KB_ERR_INVALID, "genome: %d bytes of shared memory, the device allows %d with the static arrays",
             k->smem_bytes, dev ? dev->max_smem_per_block - 4096 : 0);
    *out = k;
    k = NULL;
cleanup:
    kb_kernel_free(ctx, k);
    kb_sb_discard(&src);
    kb_sb_discard(&kernel);
    kb_string_free(ctx, text);
    kb_sb_discard(&body);
    kb_sb_discard(&finish);
    kb_sb_discard(&scratch);
    cg_done(&c);
    return st;
}

int64_t kb_kernel_max_blocks(const kb_kernel *k, const kb_device_info *dev) {
    if (!(k->genome.persistent || k->max_blocks_per_sm) || !dev || dev->num_sms <= 0) return 0;
    int64_t per_sm = k->max_blocks_per_sm ? k->max_blocks_per_sm : 2048 / (k->block > 0 ? k->block : 1);
    if (k->smem_bytes > 0 && dev->max_smem_per_block > 0) {
        int64_t by_smem = dev->max_smem_per_block / k->smem_bytes;
        if (by_smem < per_sm) per_sm = by_smem;
    }
    if (per_sm < 1) per_sm = 1;
    return per_sm * dev->num_sms;
}

int kb_kernel_admits(const kb_kernel *k, const int64_t *symvals) {
    return k->last_multiple <= 1 || kb_dim_eval(k->last_dim, symvals) % k->last_multiple == 0;
}

void kb_kernel_grid(const kb_kernel *k, const int64_t *symvals, const kb_device_info *dev, uint32_t grid[3]) {
    int64_t units = kb_dim_eval(k->grid_units, symvals);
    int64_t upb = k->units_per_block > 0 ? k->units_per_block : 1;
    int64_t g = (units + upb - 1) / upb;
    int64_t cap = kb_kernel_max_blocks(k, dev);
    if (g < 1) g = 1;
    if (cap > 0 && g > cap) g = cap;
    if (g > 0x7fffffff) g = 0x7fffffff; /* every kernel loops over its work, so a cap is safe */
    grid[0] = (uint32_t)g;
    grid[1] = grid[2] = 1;
}
