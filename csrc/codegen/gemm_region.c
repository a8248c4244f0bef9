/* gemm_region.c — part of the source layer of code generation: a GEMM region's kernel. The tile is
 * kb_gemm_generate's (gemm.c) as a __device__ body whose epilogue hook renders the region's own
 * nodes over the product's iteration space (the expression layer, as a POINTWISE kernel renders
 * them) and stores every region output; a __global__ entry in the region ABI (inputs, outputs,
 * symbols) derives M, N, K, the batch, leading dims and batch strides from the symbols and loops
 * over the tiles. */
#include "codegen/codegen.h"

#include <inttypes.h>
#include <math.h>

static const kb_node *NODE(const cg *c, int32_t v) { return kb_graph_node(c->g, v); }

/* ---------------------------------------------------------------- an operand's strides */

/* A size or stride of a contiguous source as a monomial: coef times symbols (coef 0: a broadcast). */
typedef kb_monomial mono;

static mono mono_of(kb_dim d) {
    mono m;
    kb_monomial_of(&d, 1, 1u, &m);
    return m;
}

static int mono_mul(const mono *a, const mono *b, mono *out) {
    if (a->nsym + b->nsym > (int)sizeof out->sym) return 0;
    mono m = {a->coef * b->coef, 0, {0}};
    int i = 0, j = 0;
    while (i < a->nsym || j < b->nsym)
        m.sym[m.nsym++] = (j >= b->nsym || (i < a->nsym && a->sym[i] <= b->sym[j])) ? a->sym[i++] : b->sym[j++];
    if (m.coef == 0) m.nsym = 0;
    *out = m;
    return 1;
}

static int mono_is(const mono *a, int64_t coef) { return a->nsym == 0 && a->coef == coef; }

/* a divides b for every binding: its coefficient divides b's and its symbols are among b's */
static int mono_divides(const mono *a, const mono *b) {
    if (a->coef == 0 || b->coef % a->coef) return 0;
    int j = 0;
    for (int i = 0; i < a->nsym; i++) {
        while (j < b->nsym && b->sym[j] < a->sym[i]) j++;
        if (j == b->nsym || b->sym[j] != a->sym[i]) return 0;
        j++;
    }
    return 1;
}

static void mono_expr(const mono *m, char *out, size_t n) {
    size_t len = (size_t)snprintf(out, n, "(%" PRId64, m->coef);
    for (int i = 0; i < m->nsym && len < n; i++) len += (size_t)snprintf(out + len, n - len, " * s%d", (int)m->sym[i]);
    if (len < n) snprintf(out + len, n - len, ")");
}

typedef struct view_dims {
    int rank;
    mono size[KB_MAX_RANK], stride[KB_MAX_RANK];
    int64_t ex[KB_MAX_RANK]; /* sizes at the example */
} view_dims;

static void dims_of(const kb_node *nd, const int64_t *ex, view_dims *v) {
    v->rank = nd->rank;
    for (int d = 0; d < nd->rank; d++) {
        v->size[d] = mono_of(nd->dims[d]);
        v->ex[d] = kb_dim_eval(nd->dims[d], ex);
    }
}

/* A reshape of strided dims (torch's view rule, on monomials): dims group from the end where
 * the element counts agree; a group of several input dims must be contiguous among themselves.
 * 0 where it is not a view of the input's memory. */
static int reshape_strides(const view_dims *in, view_dims *out) {
    int i = in->rank - 1, j = out->rank - 1;
    for (;;) {
        while (i >= 0 && mono_is(&in->size[i], 1)) i--;
        while (j >= 0 && mono_is(&out->size[j], 1)) out->stride[j] = (mono){0, 0, {0}}, j--;
        if (i < 0 && j < 0) return 1;
        if (i < 0 || j < 0) return 0;
        int i0 = i, j0 = j;
        mono pi = in->size[i], pj = out->size[j];
        int64_t ei = in->ex[i], ej = out->ex[j];
        while (!kb_monomial_equal(&pi, &pj)) {
            if (ei <= ej && i > 0) {
                i--;
                if (!mono_mul(&pi, &in->size[i], &pi)) return 0;
                ei *= in->ex[i];
            } else if (j > 0) {
                j--;
                if (!mono_mul(&pj, &out->size[j], &pj)) return 0;
                ej *= out->ex[j];
            } else {
                return 0;
            }
        }
        for (int q = i0; q > i; q--) { /* contiguous within the group (or all broadcast) */
            mono want;
            if (!mono_mul(&in->stride[q], &in->size[q], &want)) return 0;
            if (!mono_is(&in->size[q - 1], 1) && !kb_monomial_equal(&want, &in->stride[q - 1])) return 0;
        }
        mono st = in->stride[i0];
        for (int q = j0; q >= j; q--) {
            out->stride[q] = st;
            if (!mono_mul(&st, &out->size[q], &st)) return 0;
        }
        i--, j--;
    }
}

/* v's value where it is a constant seen through views (a CONST broadcast), else 0 */
static int const_value(cg *c, int32_t v, double *x) {
    while (kb_op_get(NODE(c, v)->op)->kind == KB_KIND_VIEW) v = NODE(c, v)->inputs[0];
    *x = NODE(c, v)->scalar[0];
    return NODE(c, v)->op == KB_OP_CONST && isfinite(*x);
}

/* The strides of MATMUL operand k in the memory of the region input it reads (contiguous), through
 * the views between them; -1 (error set) where the chain holds other work or is no strided view.
 * A prologue that scales the operand by a constant (a multiply, a divide, a negation: an attention
 * score's gradient) commutes with the product: its factor is multiplied into *scale, applied to
 * the accumulator. */
static int operand_strides(cg *c, int k, int32_t *source, view_dims *out, double *scale) {
    const kb_gemm_info *gi = &c->rg->gemm;
    int32_t chain[64], n = 0, u = NODE(c, gi->matmul)->inputs[k];
    int64_t ex[KB_MAX_SYMS];
    for (int32_t s = 0; s < kb_graph_nsymbols(c->g); s++) ex[s] = kb_graph_symbol_example(c->g, s);
    while (c->in_slot[u] < 0) {
        const kb_node *nd = NODE(c, u);
        double f;
        if (nd->op == KB_OP_NEG) {
            *scale = -*scale;
            u = nd->inputs[0];
            continue;
        }
        if ((nd->op == KB_OP_MUL || nd->op == KB_OP_DIV) && const_value(c, nd->inputs[1], &f) && f != 0) {
            *scale *= nd->op == KB_OP_MUL ? f : 1.0 / f;
            u = nd->inputs[0];
            continue;
        }
        if (nd->op == KB_OP_MUL && const_value(c, nd->inputs[0], &f)) {
            *scale *= f;
            u = nd->inputs[1];
            continue;
        }
        if ((nd->op != KB_OP_PERMUTE && nd->op != KB_OP_EXPAND && nd->op != KB_OP_RESHAPE) || n == 64) {
            cg_failf(c, KB_ERR_UNSUPPORTED, "GEMM operand %c carries prologue work (%s): the kernel loads operands as "
                     "stored", k ? 'B' : 'A', kb_op_get(nd->op)->name);
            return -1;
        }
        chain[n++] = u;
        u = nd->inputs[0];
    }
    *source = u;
    view_dims v;
    dims_of(NODE(c, u), ex, &v);
    mono st = {1, 0, {0}};
    for (int d = v.rank - 1; d >= 0; d--) {
        v.stride[d] = st;
        if (!mono_mul(&st, &v.size[d], &st)) goto strided;
    }
    for (int q = n - 1; q >= 0; q--) {
        const kb_node *nd = NODE(c, chain[q]);
        view_dims w;
        dims_of(nd, ex, &w);
        if (nd->op == KB_OP_PERMUTE) {
            for (int d = 0; d < w.rank; d++) w.stride[d] = v.stride[nd->perm[d]];
        } else if (nd->op == KB_OP_EXPAND) { /* aligned at the end; grown dims read one element */
            for (int d = 0; d < w.rank; d++) {
                int e = d - (w.rank - v.rank);
                w.stride[d] = (e < 0 || !kb_monomial_equal(&v.size[e], &w.size[d])) ? (mono){0, 0, {0}} : v.stride[e];
            }
        } else if (!reshape_strides(&v, &w)) {
            goto strided;
        }
        v = w;
    }
    *out = v;
    return 0;
strided:
    cg_failf(c, KB_ERR_UNSUPPORTED, "GEMM operand %c is a strided view of its input (no row-major or "
             "transposed matrix)", k ? 'B' : 'A');
    return -1;
}

/* ---------------------------------------------------------------- the epilogue hook */

typedef struct region_epi {
    cg *c;
    kb_dtype mm;   /* the product's dtype: acc is rounded to it first, as torch stores the product */
    double scale;  /* the operands' constant prologue factors, applied to acc */
} region_epi;

static kb_status epi_params(kb_ctx *ctx, void *ud, kb_sb *sb) {
    (void)ctx;
    region_epi *e = ud;
    kb_sb_puts(sb, ",\n    ");
    cg_emit_params(e->c, sb, 1);
    return KB_OK;
}

/* One element: the product (rounded to its dtype) bound at the element, then every region output
 * computed from it through the expression layer and stored at the element's linear index. */
static kb_status epi_element(kb_ctx *ctx, void *ud, kb_sb *sb, const kb_gemm_site *s) {
    region_epi *e = ud;
    cg *c = e->c;
    kb_sb text;
    kb_sb_init(&text, ctx);
    kb_sb *outer = c->out;
    c->out = &text;
    c->ind = s->indent;
    cg_line(c, "// the region's epilogue at (%s, %s, %s); i is the element's position in the output", s->batch, s->row,
            s->col);
    if (e->scale != 1.0) {
        char lit[48];
        snprintf(lit, sizeof lit, "%.9g", e->scale);
        if (!strpbrk(lit, ".e")) strcat(lit, ".0");
        cg_line(c, "const float kb_acc = %s * %sf;  // the operands' constant prologue factors", s->acc, lit);
    } else {
        cg_line(c, "const float kb_acc = %s;", s->acc);
    }
    cg_line(c, "{");
    c->ind++;
    cg_scope_push(c);
    c->in_element = 1;
    cg_line(c, "const long long i = (%s * M + %s) * N + %s;", s->batch, s->row, s->col);
    cg_decl_vars(c, "i", cg_all_bits(c), 0);
    char rounded[EXPR_LEN], stored[EXPR_LEN];
    cg_fmt(c, stored, sizeof stored, cg_store_fmt(e->mm), "kb_acc");
    cg_fmt(c, rounded, sizeof rounded, cg_load_fmt(e->mm), stored);
    cg_line(c, "const float kb_mm = %s;  // the product in %s", rounded, kb_dtype_name(e->mm));
    idx full;
    cg_set_lin(&full, c->full_lin, cg_all_bits(c));
    cg_bind(c, c->rg->gemm.matmul, &full, "kb_mm");
    for (int32_t j = 0; j < c->rg->noutputs; j++) {
        int32_t v = c->rg->outputs[j];
        char val[EXPR_LEN], st[EXPR_LEN * 2];
        cg_ev_store(c, v, &full, val);
        cg_fmt(c, st, sizeof st, cg_store_fmt(NODE(c, v)->dtype), val);
        cg_line(c, "p%d[i] = %s;", (int)v, st);
        c->written[v] = 1;
    }
    c->in_element = 0;
    cg_scope_pop(c);
    c->ind--;
    cg_line(c, "}");
    c->out = outer;
    kb_status st = c->st;
    if (st == KB_OK && text.oom) st = KB_FAIL(ctx, KB_ERR_OOM, "out of memory");
    if (st == KB_OK && text.buf) {
        cg_prune_unused(text.buf);
        kb_sb_puts(sb, text.buf);
    }
    kb_sb_discard(&text);
    return st;
}

/* ---------------------------------------------------------------- the kernel */

/* What the kernel requires of sizes: each of these a multiple of 8 elements. Pinned ones are
 * checked here; the varying ones must all be multiples of one of them, which the launch checks
 * (kb_kernel.last_multiple / last_dim), so that a call breaking it runs in torch. */
static kb_status multiples_of_8(cg *c, const mono *req, const char *const *what, int n, kb_kernel *k) {
    int guard = -1;
    for (int q = 0; q < n; q++) {
        if (req[q].coef % 8 == 0) continue;
        if (req[q].nsym == 0)
            return KB_FAIL(c->ctx, KB_ERR_UNSUPPORTED,
                           "codegen: GEMM region %d: %s = %" PRId64 " is not a multiple of 8 (the tensor-core kernel's "
                           "16-byte loads)", (int)c->r, what[q], req[q].coef);
        if (guard < 0) guard = q;
    }
    if (guard < 0) return KB_OK;
    /* a varying one every other varying one is a multiple of: its multiple of 8 is theirs */
    for (int g = 0; g < n; g++) {
        if (req[g].coef % 8 == 0 || req[g].nsym == 0 || req[g].nsym > KB_MAX_DIM_SYMS) continue;
        int all = 1;
        for (int q = 0; q < n && all; q++) all = req[q].coef % 8 == 0 || mono_divides(&req[g], &req[q]);
        if (!all) continue;
        kb_dim d = {req[g].coef, (uint8_t)req[g].nsym, {0}};
        for (int s = 0; s < req[g].nsym; s++) d.sym[s] = req[g].sym[s];
        k->last_multiple = 8;
        k->last_dim = d;
        return KB_OK;
    }
    return KB_FAIL(c->ctx, KB_ERR_UNSUPPORTED,
                   "codegen: GEMM region %d: the sizes that must be multiples of 8 (%s, ...) vary apart: no one guard "
                   "covers them", (int)c->r, what[guard]);
}

/* The batch dims of an operand as one stride: all broadcast (*bcast), or each the next one's
 * stride times its size (one flat batch index); 0 (error set) otherwise. */
static int batch_stride(cg *c, const view_dims *v, char which, mono *stride, int *bcast) {
    int last = -1, nzero = 0, n = 0;
    for (int d = 0; d < v->rank - 2; d++) {
        if (mono_is(&v->size[d], 1)) continue;
        n++;
        nzero += v->stride[d].coef == 0;
        last = d;
    }
    *bcast = n == 0 || nzero == n;
    if (*bcast) {
        *stride = (mono){0, 0, {0}};
        return 1;
    }
    if (nzero) {
        cg_failf(c, KB_ERR_UNSUPPORTED, "GEMM operand %c is broadcast along some batch dims only", which);
        return 0;
    }
    int prev = -1; /* each batch dim's stride: the next (inner) batch dim's stride times its size */
    for (int d = v->rank - 3; d >= 0; d--) {
        if (mono_is(&v->size[d], 1)) continue;
        if (prev >= 0) {
            mono want;
            if (!mono_mul(&v->stride[prev], &v->size[prev], &want) || !kb_monomial_equal(&want, &v->stride[d])) {
                cg_failf(c, KB_ERR_UNSUPPORTED, "GEMM operand %c's batch dims are not one strided batch", which);
                return 0;
            }
        }
        prev = d;
    }
    *stride = v->stride[last];
    return 1;
}

kb_status cg_gemm_region_generate(const kb_partition *p, int32_t r, const kb_genome *gn, const kb_device_info *dev,
                                  kb_kernel **out) {
    kb_ctx *ctx = kb_graph_ctx(p->graph);
    const kb_region *real = &p->regions[r];
    const kb_gemm_info *gi = &real->gemm;
    kb_status st = KB_OK;
    kb_sb kernel, src;
    kb_sb_init(&kernel, ctx);
    kb_sb_init(&src, ctx);
    char *text = NULL;
    kb_kernel *k = NULL;
    cg c;
    memset(&c, 0, sizeof c);
    /* the epilogue is the region's nodes over the product's iteration space: generated as a
       POINTWISE region's elements are, one element at a time */
    kb_region as_pointwise = *real;
    as_pointwise.kind = KB_REGION_POINTWISE;
    kb_genome pgn = *kb_genome_base();
    pgn.threads = 32 * (gn->gemm_warps_m > 0 ? gn->gemm_warps_m * gn->gemm_warps_n : 1);
    KB_CHECK(ctx, gn->gemm_tile_m > 0, KB_ERR_INVALID,
             "codegen: region %d is a GEMM region: its genome needs the gemm gene (kb_genome_default gives it)", (int)r);
    KB_TRY(cg_init(&c, p, r, &as_pointwise, &pgn, dev));
    snprintf(c.name, sizeof c.name, "kb_r%d_gemm", (int)r);
    KB_CHECK(ctx, !c.dbl, KB_ERR_UNSUPPORTED, "codegen: GEMM region %d touches f64: cuBLAS keeps it", (int)r);
    const kb_node *mm = NODE(&c, gi->matmul);
    const int rank = mm->rank;
    kb_dtype ab = NODE(&c, mm->inputs[0])->dtype;
    KB_CHECK(ctx, ab == KB_BF16 || ab == KB_F16, KB_ERR_UNSUPPORTED,
             "codegen: GEMM region %d multiplies %s: the tensor-core kernel takes bf16 or f16 (cuBLAS keeps it)", (int)r,
             kb_dtype_name(ab));
    for (int q = 0; q < 2; q++) { /* prologue work: operand_strides takes a constant scale, nothing else */
        KB_CHECK(ctx, gi->layout[q] != KB_GEMM_STRIDED, KB_ERR_UNSUPPORTED,
                 "codegen: GEMM region %d: operand %c is strided (neither row-major nor transposed)", (int)r, q ? 'B' : 'A');
    }
    for (int32_t j = 0; j < real->noutputs; j++)
        KB_CHECK(ctx, cg_numel_is(&c, real->outputs[j], 0), KB_ERR_UNSUPPORTED,
                 "codegen: GEMM region %d: output %%%d is not over the product's elements", (int)r, (int)real->outputs[j]);

    /* operands: strides in their inputs' memory */
    view_dims va, vb;
    int32_t sa = -1, sb = -1;
    double scale = 1.0;
    if (operand_strides(&c, 0, &sa, &va, &scale) < 0 || operand_strides(&c, 1, &sb, &vb, &scale) < 0) KB_TRY(c.st);
    KB_CHECK(ctx, NODE(&c, sa)->dtype == ab && NODE(&c, sb)->dtype == ab, KB_ERR_UNSUPPORTED,
             "codegen: GEMM region %d: an operand's input is not %s", (int)r, kb_dtype_name(ab));
    const mono one = {1, 0, {0}};
    int at, bt;
    mono lda = one, ldb = one, stride_a = one, stride_b = one;
    if (kb_monomial_equal(&va.stride[rank - 1], &one)) at = 0, lda = va.stride[rank - 2];
    else if (kb_monomial_equal(&va.stride[rank - 2], &one)) at = 1, lda = va.stride[rank - 1];
    else KB_CHECK(ctx, 0, KB_ERR_UNSUPPORTED, "codegen: GEMM region %d: operand A has no unit stride", (int)r);
    if (kb_monomial_equal(&vb.stride[rank - 1], &one)) bt = 0, ldb = vb.stride[rank - 2];
    else if (kb_monomial_equal(&vb.stride[rank - 2], &one)) bt = 1, ldb = vb.stride[rank - 1];
    else KB_CHECK(ctx, 0, KB_ERR_UNSUPPORTED, "codegen: GEMM region %d: operand B has no unit stride", (int)r);
    /* a dim of size 1 has no stride to speak of: its leading dim is the other one's extent */
    if (mono_is(&va.size[at ? rank - 1 : rank - 2], 1)) lda = va.size[at ? rank - 2 : rank - 1];
    if (mono_is(&vb.size[bt ? rank - 1 : rank - 2], 1)) ldb = vb.size[bt ? rank - 2 : rank - 1];
    int a_bcast, b_bcast;
    if (!batch_stride(&c, &va, 'A', &stride_a, &a_bcast) || !batch_stride(&c, &vb, 'B', &stride_b, &b_bcast)) KB_TRY(c.st);

    k = kb_calloc(ctx, 1, sizeof *k);
    KB_CHECK(ctx, k != NULL, KB_ERR_OOM, "out of memory");
    k->last_multiple = 1;
    k->last_dim = (kb_dim){1, 0, {0}};
    {
        mono req[7];
        const char *what[7];
        int n = 0;
        req[n] = va.size[rank - 1], what[n++] = "K";
        req[n] = lda, what[n++] = "lda";
        req[n] = ldb, what[n++] = "ldb";
        if (!a_bcast) req[n] = stride_a, what[n++] = "A's batch stride";
        if (!b_bcast) req[n] = stride_b, what[n++] = "B's batch stride";
        if (!bt) req[n] = mono_of(mm->dims[rank - 1]), what[n++] = "N";
        if (at) req[n] = mono_of(mm->dims[rank - 2]), what[n++] = "M";
        KB_TRY(multiples_of_8(&c, req, what, n, k));
    }

    /* the tile's body with the region's epilogue */
    region_epi epi = {&c, mm->dtype, scale};
    kb_gemm_epilogue hook = {&epi, "the region's nodes (below), every output stored", epi_params, epi_element};
    kb_gemm_spec spec = {ab, KB_F32, bt, a_bcast, b_bcast, &hook, at, 1, 1};
    kb_gemm_genome gg = {gn->gemm_tile_m, gn->gemm_tile_n, gn->gemm_tile_k, gn->gemm_warps_m,
                         gn->gemm_warps_n, gn->gemm_stages, gn->gemm_min_blocks};
    int sm = dev && dev->sm > 0 ? dev->sm : kb_device_default()->sm;
    kb_gemm_launch L;
    KB_TRY(kb_gemm_generate(ctx, &spec, &gg, sm, &kernel, &L));
    KB_TRY(c.st);
    if (dev && dev->max_smem_per_block > 0)
        KB_CHECK(ctx, L.smem_bytes <= dev->max_smem_per_block, KB_ERR_INVALID,
                 "genome: the GEMM tile's %d bytes of shared memory exceed the device's %d", (int)L.smem_bytes,
                 (int)dev->max_smem_per_block);
    for (int32_t j = 0; j < real->noutputs; j++)
        KB_CHECK(ctx, c.written[real->outputs[j]], KB_ERR_UNSUPPORTED,
                 "codegen: GEMM region %d: output %%%d has no store in the kernel", (int)r, (int)real->outputs[j]);

    /* the entry: sizes from the symbols, then the block's tiles */
    char e[8][EXPR_LEN];
    mono bm = {1, 0, {0}};
    for (int d = 0; d < rank - 2; d++) {
        mono t = mono_of(mm->dims[d]);
        KB_CHECK(ctx, mono_mul(&bm, &t, &bm), KB_ERR_UNSUPPORTED, "codegen: GEMM region %d: too many batch symbols", (int)r);
    }
    cg_dim_expr(&c, mm->dims[rank - 2], e[0]);
    cg_dim_expr(&c, mm->dims[rank - 1], e[1]);
    cg_dim_expr(&c, NODE(&c, mm->inputs[0])->dims[rank - 1], e[2]);
    mono_expr(&bm, e[3], EXPR_LEN);
    mono_expr(&lda, e[4], EXPR_LEN);
    mono_expr(&ldb, e[5], EXPR_LEN);
    mono_expr(&stride_a, e[6], EXPR_LEN);
    mono_expr(&stride_b, e[7], EXPR_LEN);
    kb_sb_printf(&kernel, "\n// region %d's entry: the sizes from the symbols; each block computes tiles blockIdx.x,\n"
                          "// blockIdx.x + gridDim.x, ... of the batch's tiles (any grid covers the work)\n", (int)r);
    kb_sb_printf(&kernel, "extern \"C\" __global__ void __launch_bounds__(%d, %d) %s(", L.block, (int)gg.min_blocks, c.name);
    cg_emit_params(&c, &kernel, 1);
    kb_sb_puts(&kernel, ")\n{\n");
    kb_sb_printf(&kernel, "    const long long M = %s, N = %s, K = %s, batch = %s;\n", e[0], e[1], e[2], e[3]);
    kb_sb_printf(&kernel, "    const long long lda = %s, ldb = %s;\n", e[4], e[5]);
    if (!a_bcast) kb_sb_printf(&kernel, "    const long long stride_a = %s;\n", e[6]);
    if (!b_bcast) kb_sb_printf(&kernel, "    const long long stride_b = %s;\n", e[7]);
    kb_sb_printf(&kernel, "    const long long tiles = ((M + %d - 1) / %d) * ((N + %d - 1) / %d);\n", L.tile_m, L.tile_m,
                 L.tile_n, L.tile_n);
    kb_sb_puts(&kernel, "    for (long long t = blockIdx.x; t < tiles * batch; t += gridDim.x) {\n");
    kb_sb_puts(&kernel, "        __syncthreads();  // the last tile's reads of shared memory are done before refilling\n");
    kb_sb_printf(&kernel, "        %s(t %% tiles, t / tiles, p%d, p%d, M, N, K, lda, ldb%s%s, ", L.name, (int)sa, (int)sb,
                 a_bcast ? "" : ", stride_a", b_bcast ? "" : ", stride_b");
    cg_emit_params(&c, &kernel, 0);
    kb_sb_puts(&kernel, ");\n    }\n}\n");
    KB_CHECK(ctx, !kernel.oom, KB_ERR_OOM, "out of memory");

    c.rg = real; /* the header names the region as it is */
    cg_emit_preamble(&c, &src, kernel.buf);
    kb_sb_puts(&src, kernel.buf);
    KB_TRY(kb_sb_finish(&src, &text));
    KB_TRY(cg_name_params(&c, text, kernel.buf, &k->source));
    snprintf(k->name, sizeof k->name, "%s", c.name);
    k->block = L.block;
    k->smem_bytes = L.smem_bytes;
    k->genome = *gn;
    k->nkernels = 1;
    /* grid.x = ceil(batch * M * N / (tile_m * tile_n)): at most the tiles (the kernel loops) */
    {
        mono all = bm, t = mono_of(mm->dims[rank - 2]), u = mono_of(mm->dims[rank - 1]);
        KB_CHECK(ctx, mono_mul(&all, &t, &all) && mono_mul(&all, &u, &all) && all.nsym <= KB_MAX_DIM_SYMS,
                 KB_ERR_UNSUPPORTED, "codegen: GEMM region %d: the grid size multiplies more than %d symbols", (int)r,
                 KB_MAX_DIM_SYMS);
        k->grid_units = (kb_dim){all.coef, (uint8_t)all.nsym, {0}};
        for (int s = 0; s < all.nsym; s++) k->grid_units.sym[s] = all.sym[s];
        k->units_per_block = (int64_t)L.tile_m * L.tile_n;
    }
    *out = k;
    k = NULL;
cleanup:
    kb_kernel_free(ctx, k);
    kb_sb_discard(&kernel);
    kb_sb_discard(&src);
    kb_string_free(ctx, text);
    cg_done(&c);
    return st;
}
