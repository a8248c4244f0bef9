/* ir.c — the context (allocator hook, error message), dtype and op tables, and the graph:
 * a builder that checks every node as it is added (so later stages can trust the IR),
 * symbolic sizes, and the stable text dump that golden tests and bug reports rely on. */
#include "core/internal.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

/* ---------------------------------------------------------------- status, context, memory */

const char *kb_status_name(kb_status s) {
    static const char *const names[] = {"ok", "out of memory", "invalid argument", "unsupported",
                                        "CUDA error", "NVRTC error", "not found", "I/O error"};
    return (unsigned)s < sizeof names / sizeof names[0] ? names[s] : "unknown status";
}

static void *default_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
    (void)ud;
    (void)osize;
    if (nsize == 0) {
        free(ptr);
        return NULL;
    }
    return realloc(ptr, nsize);
}

kb_status kb_ctx_new(kb_alloc_fn alloc, void *ud, kb_ctx **out) {
    if (!out) return KB_ERR_INVALID;
    *out = NULL;
    if (!alloc) alloc = default_alloc;
    kb_ctx *ctx = alloc(ud, NULL, 0, sizeof *ctx);
    if (!ctx) return KB_ERR_OOM;
    ctx->alloc = alloc;
    ctx->ud = ud;
    ctx->error[0] = '\0';
    *out = ctx;
    return KB_OK;
}

void kb_ctx_free(kb_ctx *ctx) {
    if (ctx) ctx->alloc(ctx->ud, ctx, sizeof *ctx, 0);
}

const char *kb_ctx_error(const kb_ctx *ctx) { return ctx ? ctx->error : "no context"; }

kb_status kb_fail(kb_ctx *ctx, kb_status status, const char *file, int line, const char *fmt, ...) {
    if (!ctx) return status;
    const char *base = strrchr(file, '/');
    int n = snprintf(ctx->error, sizeof ctx->error, "%s:%d: ", base ? base + 1 : file, line);
    if (n < 0 || (size_t)n >= sizeof ctx->error) n = 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->error + n, sizeof ctx->error - (size_t)n, fmt, ap);
    va_end(ap);
    return status;
}

void *kb_malloc(kb_ctx *ctx, size_t n) {
    void *p = ctx->alloc(ctx->ud, NULL, 0, n ? n : 1);
    if (!p) KB_FAIL(ctx, KB_ERR_OOM, "out of memory (%zu bytes)", n);
    return p;
}

void *kb_calloc(kb_ctx *ctx, size_t count, size_t size) {
    if (size && count > SIZE_MAX / size) {
        KB_FAIL(ctx, KB_ERR_OOM, "allocation size overflows (%zu x %zu)", count, size);
        return NULL;
    }
    size_t bytes = count * size;
    void *p = kb_malloc(ctx, bytes);
    if (p) memset(p, 0, bytes > 0 ? bytes : 1);
    return p;
}

void *kb_realloc(kb_ctx *ctx, void *p, size_t osize, size_t nsize) {
    void *q = ctx->alloc(ctx->ud, p, p ? osize : 0, nsize ? nsize : 1);
    if (!q) KB_FAIL(ctx, KB_ERR_OOM, "out of memory (%zu bytes)", nsize);
    return q;
}

void kb_free(kb_ctx *ctx, void *p, size_t size) {
    if (p) ctx->alloc(ctx->ud, p, size, 0);
}

/* Strings carry their allocation size in front so kb_string_free needs no length. */
static char *string_alloc(kb_ctx *ctx, size_t len) {
    size_t *block = kb_malloc(ctx, sizeof(size_t) + len + 1);
    if (!block) return NULL;
    block[0] = sizeof(size_t) + len + 1;
    return (char *)(block + 1);
}

char *kb_strdup(kb_ctx *ctx, const char *s) {
    size_t len = strlen(s);
    char *out = string_alloc(ctx, len);
    if (out) memcpy(out, s, len + 1);
    return out;
}

void kb_string_free(kb_ctx *ctx, char *s) {
    if (!s) return;
    size_t *block = (size_t *)s - 1;
    kb_free(ctx, block, block[0]);
}

/* ---------------------------------------------------------------- string builder */

void kb_sb_init(kb_sb *sb, kb_ctx *ctx) {
    sb->ctx = ctx;
    sb->buf = NULL;
    sb->len = sb->cap = 0;
    sb->oom = 0;
}

static int sb_reserve(kb_sb *sb, size_t extra) {
    if (sb->oom) return 0;
    if (sb->len + extra + 1 <= sb->cap) return 1;
    size_t cap = sb->cap ? sb->cap : 256;
    while (cap < sb->len + extra + 1) cap *= 2;
    /* the buffer becomes a kb_string: keep the size header in front */
    size_t *old = sb->buf ? (size_t *)sb->buf - 1 : NULL;
    size_t *block = kb_realloc(sb->ctx, old, old ? old[0] : 0, sizeof(size_t) + cap);
    if (!block) {
        sb->oom = 1;
        return 0;
    }
    block[0] = sizeof(size_t) + cap;
    sb->buf = (char *)(block + 1);
    sb->cap = cap;
    return 1;
}

void kb_sb_printf(kb_sb *sb, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || !sb_reserve(sb, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(sb->buf + sb->len, sb->cap - sb->len, fmt, ap);
    va_end(ap);
    sb->len += (size_t)n;
}

void kb_sb_puts(kb_sb *sb, const char *s) {
    size_t n = strlen(s);
    if (!sb_reserve(sb, n)) return;
    memcpy(sb->buf + sb->len, s, n + 1);
    sb->len += n;
}

kb_status kb_sb_finish(kb_sb *sb, char **out) {
    *out = NULL;
    if (!sb->oom && !sb->buf) sb_reserve(sb, 0);
    if (sb->oom) {
        kb_sb_discard(sb);
        return KB_FAIL(sb->ctx, KB_ERR_OOM, "out of memory while building text");
    }
    sb->buf[sb->len] = '\0';
    *out = sb->buf;
    sb->buf = NULL;
    sb->len = sb->cap = 0;
    return KB_OK;
}

void kb_sb_discard(kb_sb *sb) {
    kb_string_free(sb->ctx, sb->buf);
    sb->buf = NULL;
    sb->len = sb->cap = 0;
}

/* ---------------------------------------------------------------- dtypes and ops */

static const struct {
    const char *name;
    size_t size;
    int is_float;
} dtype_table[KB_DTYPE_COUNT] = {
    [KB_F32] = {"f32", 4, 1},  [KB_F16] = {"f16", 2, 1}, [KB_BF16] = {"bf16", 2, 1},
    [KB_F64] = {"f64", 8, 1},  [KB_I64] = {"i64", 8, 0}, [KB_I32] = {"i32", 4, 0},
    [KB_BOOL] = {"bool", 1, 0},
};

const char *kb_dtype_name(kb_dtype t) { return (unsigned)t < KB_DTYPE_COUNT ? dtype_table[t].name : "?"; }
size_t kb_dtype_size(kb_dtype t) { return (unsigned)t < KB_DTYPE_COUNT ? dtype_table[t].size : 0; }
int kb_dtype_is_float(kb_dtype t) { return (unsigned)t < KB_DTYPE_COUNT && dtype_table[t].is_float; }

int kb_dtype_from_name(const char *name) {
    for (int t = 0; t < KB_DTYPE_COUNT; t++)
        if (strcmp(dtype_table[t].name, name) == 0) return t;
    return -1;
}

static const kb_op_info op_table[KB_OP_COUNT] = {
#define X(name, arity, kind, printed, interp, cuda, da, db, dc) \
    [KB_OP_##name] = {printed, arity, kind, cuda, {da, db, dc}},
#include "core/ops.def"
#undef X
};

const kb_op_info *kb_op_get(kb_op op) { return (unsigned)op < KB_OP_COUNT ? &op_table[op] : NULL; }

int kb_op_from_name(const char *name) {
    for (int op = 0; op < KB_OP_COUNT; op++)
        if (strcmp(op_table[op].name, name) == 0) return op;
    return -1;
}

/* ---------------------------------------------------------------- symbolic sizes */

/* d at these symbol values into *out; 0 where a product overflows int64. */
static int dim_eval_checked(kb_dim d, const int64_t *symvals, int64_t *out) {
    int64_t v = d.coef;
    for (int i = 0; i < d.nsym; i++)
        if (__builtin_mul_overflow(v, symvals[d.sym[i]], &v)) return 0;
    *out = v;
    return 1;
}

int64_t kb_dim_eval(kb_dim d, const int64_t *symvals) {
    int64_t v;
    return dim_eval_checked(d, symvals, &v) ? v : INT64_MAX;
}

int kb_dim_equal(kb_dim a, kb_dim b) {
    if (a.coef != b.coef || a.nsym != b.nsym) return 0;
    for (int i = 0; i < a.nsym; i++)
        if (a.sym[i] != b.sym[i]) return 0;
    return 1;
}

void kb_monomial_of(const kb_dim *dims, int rank, uint32_t mask, kb_monomial *m) {
    m->coef = 1;
    m->nsym = 0;
    for (int d = 0; d < rank; d++) {
        if (!(mask & (1u << d))) continue;
        m->coef *= dims[d].coef;
        for (int i = 0; i < dims[d].nsym; i++) { /* insertion: a handful of symbols */
            int j = m->nsym++;
            while (j > 0 && m->sym[j - 1] > dims[d].sym[i]) {
                m->sym[j] = m->sym[j - 1];
                j--;
            }
            m->sym[j] = dims[d].sym[i];
        }
    }
}

int kb_monomial_equal(const kb_monomial *a, const kb_monomial *b) {
    return a->coef == b->coef && a->nsym == b->nsym && memcmp(a->sym, b->sym, (size_t)a->nsym) == 0;
}

const char *kb_dim_str(const kb_graph *g, kb_dim d, char *buf, size_t n) {
    size_t len = 0;
    buf[0] = '\0';
    if (d.nsym == 0 || d.coef != 1) len += (size_t)snprintf(buf, n, "%" PRId64, d.coef);
    for (int i = 0; i < d.nsym && len < n; i++)
        len += (size_t)snprintf(buf + len, n - len, "%s%s", len ? "*" : "", g->sym_names[d.sym[i]]);
    return buf;
}

const char *kb_type_str(const kb_graph *g, const kb_node *nd, char *buf, size_t n) {
    size_t len = (size_t)snprintf(buf, n, "%s[", kb_dtype_name(nd->dtype));
    for (int d = 0; d < nd->rank && len < n; d++) {
        char dim[64];
        len += (size_t)snprintf(buf + len, n - len, "%s%s", d ? "," : "", kb_dim_str(g, nd->dims[d], dim, sizeof dim));
    }
    if (len < n) snprintf(buf + len, n - len, "]");
    return buf;
}

/* ---------------------------------------------------------------- graph */

kb_status kb_graph_new(kb_ctx *ctx, kb_graph **out) {
    if (!ctx || !out) return KB_ERR_INVALID;
    *out = NULL;
    kb_graph *g = kb_calloc(ctx, 1, sizeof *g);
    if (!g) return KB_ERR_OOM;
    g->ctx = ctx;
    *out = g;
    return KB_OK;
}

void kb_graph_free(kb_graph *g) {
    if (!g) return;
    kb_ctx *ctx = g->ctx;
    kb_free(ctx, g->nodes, sizeof(kb_node) * (size_t)g->cap);
    kb_free(ctx, g->inputs, sizeof(int32_t) * (size_t)g->inputs_cap);
    kb_free(ctx, g->outputs, sizeof(int32_t) * (size_t)g->outputs_cap);
    kb_graph_free_names(g);
    kb_free(ctx, g, sizeof *g);
}

kb_ctx *kb_graph_ctx(const kb_graph *g) { return g->ctx; }

kb_status kb_graph_add_symbol(kb_graph *g, const char *name, int64_t example, int32_t *id) {
    if (g->nsyms >= KB_MAX_SYMS)
        return KB_FAIL(g->ctx, KB_ERR_UNSUPPORTED, "more than %d varying sizes in one graph", KB_MAX_SYMS);
    if (!name || !*name || strlen(name) >= sizeof g->sym_names[0])
        return KB_FAIL(g->ctx, KB_ERR_INVALID, "symbol name must have 1 to %zu characters",
                       sizeof g->sym_names[0] - 1);
    /* a C identifier: symbol names are printed as they are into the dump and into generated
     * sources' comments (the types of the values), so no name may end a comment or a line */
    for (const char *c = name; *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || *c == '_' || (c > name && *c >= '0' && *c <= '9')))
            return KB_FAIL(g->ctx, KB_ERR_INVALID, "symbol name must be an identifier (letters, digits, '_'), got byte 0x%02x",
                           (unsigned)(unsigned char)*c);
    if (example < 0) return KB_FAIL(g->ctx, KB_ERR_INVALID, "symbol %s: negative example size", name);
    for (int s = 0; s < g->nsyms; s++)
        if (strcmp(g->sym_names[s], name) == 0)
            return KB_FAIL(g->ctx, KB_ERR_INVALID, "symbol %s defined twice", name);
    strcpy(g->sym_names[g->nsyms], name);
    g->sym_examples[g->nsyms] = example;
    *id = g->nsyms++;
    return KB_OK;
}

kb_status kb_graph_copy_symbols(const kb_graph *from, kb_graph *to) {
    for (int32_t s = 0; s < from->nsyms; s++) {
        int32_t id;
        kb_status st = kb_graph_add_symbol(to, from->sym_names[s], from->sym_examples[s], &id);
        if (st != KB_OK) return st;
    }
    return KB_OK;
}

kb_status kb_graph_rebuild(const kb_graph *g, const int32_t *order, int32_t norder, kb_graph **out) {
    kb_status st = KB_OK;
    kb_ctx *ctx = g->ctx;
    size_t cnt = g->nnodes > 0 ? (size_t)g->nnodes : 1;
    kb_graph *w = NULL;
    int32_t *map = kb_malloc(ctx, cnt * sizeof(int32_t));
    KB_CHECK(ctx, map, KB_ERR_OOM, "out of memory rebuilding a graph of %d nodes", (int)g->nnodes);
    KB_TRY(kb_graph_new(ctx, &w));
    KB_TRY(kb_graph_copy_symbols(g, w));
    for (int32_t i = 0; i < g->ninputs; i++) KB_TRY(kb_graph_add(w, &g->nodes[g->inputs[i]], &map[g->inputs[i]]));
    for (int32_t k = 0; k < norder; k++) {
        kb_node t = g->nodes[order[k]];
        for (int i = 0; i < t.ninputs; i++) t.inputs[i] = map[t.inputs[i]];
        KB_TRY(kb_graph_add(w, &t, &map[order[k]]));
    }
    for (int32_t j = 0; j < g->noutputs; j++) KB_TRY(kb_graph_add_output(w, map[g->outputs[j]]));
    *out = w;
    w = NULL;
cleanup:
    kb_free(ctx, map, cnt * sizeof(int32_t));
    kb_graph_free(w);
    return st;
}

int32_t kb_graph_nsymbols(const kb_graph *g) { return g->nsyms; }
const char *kb_graph_symbol_name(const kb_graph *g, int32_t s) { return s >= 0 && s < g->nsyms ? g->sym_names[s] : NULL; }
int64_t kb_graph_symbol_example(const kb_graph *g, int32_t s) { return s >= 0 && s < g->nsyms ? g->sym_examples[s] : -1; }
int32_t kb_graph_nnodes(const kb_graph *g) { return g->nnodes; }
const kb_node *kb_graph_node(const kb_graph *g, int32_t id) { return id >= 0 && id < g->nnodes ? &g->nodes[id] : NULL; }
int32_t kb_graph_ninputs(const kb_graph *g) { return g->ninputs; }
int32_t kb_graph_input(const kb_graph *g, int32_t i) { return i >= 0 && i < g->ninputs ? g->inputs[i] : -1; }
int32_t kb_graph_noutputs(const kb_graph *g) { return g->noutputs; }
int32_t kb_graph_output(const kb_graph *g, int32_t i) { return i >= 0 && i < g->noutputs ? g->outputs[i] : -1; }

int64_t kb_value_sizes(const kb_graph *g, int32_t v, const int64_t *symvals, int64_t sizes[KB_MAX_RANK]) {
    const kb_node *nd = &g->nodes[v];
    int64_t numel = 1;
    int ok = 1;
    for (int d = 0; d < nd->rank; d++) {
        ok &= dim_eval_checked(nd->dims[d], symvals, &sizes[d]);
        if (!ok) sizes[d] = INT64_MAX;
        ok = ok && !__builtin_mul_overflow(numel, sizes[d], &numel);
    }
    return ok ? numel : -1;
}

kb_status kb_graph_check_symvals(const kb_graph *g, const int64_t *symvals) {
    for (int32_t s = 0; s < g->nsyms; s++)
        if (symvals[s] < 0)
            return KB_FAIL(g->ctx, KB_ERR_INVALID, "symbol %s bound to a negative size (%" PRId64 ")",
                           g->sym_names[s], symvals[s]);
    /* every value's bytes as the interpreter holds it (a double per element), with a size 0
     * counted as 1 (so a product of any of its sizes is bounded too: a region's row and column
     * counts), and their sum: no size, count, byte count or sum of them downstream overflows */
    int64_t total = 0;
    for (int32_t v = 0; v < g->nnodes; v++) {
        const kb_node *nd = &g->nodes[v];
        int64_t bytes = (int64_t)sizeof(double), s;
        int ok = 1;
        for (int d = 0; ok && d < nd->rank; d++)
            ok = dim_eval_checked(nd->dims[d], symvals, &s) && !__builtin_mul_overflow(bytes, s > 1 ? s : 1, &bytes);
        if (!ok || __builtin_add_overflow(total, bytes, &total))
            return KB_FAIL(g->ctx, KB_ERR_INVALID, "sizes too large: value %%%d at these symbol values "
                           "overflows 2^63 bytes (with the values before it)", (int)v);
    }
    return KB_OK;
}

static kb_status push_id(kb_ctx *ctx, int32_t **arr, int32_t *n, int32_t *cap, int32_t v) {
    if (*n == *cap) {
        int32_t ncap = *cap ? *cap * 2 : 8;
        int32_t *p = kb_realloc(ctx, *arr, sizeof(int32_t) * (size_t)*cap, sizeof(int32_t) * (size_t)ncap);
        if (!p) return KB_ERR_OOM;
        *arr = p;
        *cap = ncap;
    }
    (*arr)[(*n)++] = v;
    return KB_OK;
}

static int same_symbols(kb_dim a, kb_dim b) {
    return a.nsym == b.nsym && memcmp(a.sym, b.sym, a.nsym) == 0;
}

/* d at the graph's example sizes (check_sizes has made sure it fits). */
static int64_t at_example(const kb_graph *g, kb_dim d) { return kb_dim_eval(d, g->sym_examples); }

/* A node's sizes are safe to multiply: the product of its size coefficients (a zero counts as
 * one, so every sub-product is bounded too: kb_monomial_of, reshape's and fusion's checks, a
 * row's length in codegen) and its element count at the graph's example sizes, both in bytes of
 * a double, fit in int64. Run-time sizes are checked by kb_graph_check_symvals. */
static const char *check_sizes(const kb_graph *g, const kb_node *t) {
    int64_t coefs = 8, numel = 8;
    for (int d = 0; d < t->rank; d++) {
        int64_t s;
        if (__builtin_mul_overflow(coefs, t->dims[d].coef > 1 ? t->dims[d].coef : 1, &coefs))
            return "sizes: the product of the size coefficients overflows int64";
        if (!dim_eval_checked(t->dims[d], g->sym_examples, &s) ||
            __builtin_mul_overflow(numel, s > 1 ? s : 1, &numel))
            return "sizes: the element count overflows int64 at the example sizes";
    }
    return NULL;
}

/* The last element a slice reads, start + (len - 1) * step, lies inside the operand (len > 0).
 * Where the length and the operand's size are multiples of one product of symbols M (or both
 * pinned: M = 1), for every M >= 1: len = cl*M, size = ca*M, and start + (cl*M - 1)*step <
 * ca*M for all M exactly when it holds at M = 1 and cl*step <= ca. Otherwise (a slice of a
 * size that varies to a pinned length, as `pe[:seq_len]`) at the example sizes: the capture's
 * guards keep the run-time sizes to those where torch's slice is in bounds. */
static const char *check_slice(const kb_graph *g, const kb_node *t, const kb_node *a) {
    kb_dim ld = t->dims[t->axis], ad = a->dims[t->axis];
    int64_t len = ld.coef, size = ad.coef, last, span;
    int provable = same_symbols(ld, ad);
    if (provable && ld.nsym > 0 && len > 0 && (__builtin_mul_overflow(len, t->step, &span) || span > size))
        return "slice: runs past the end of the operand at larger sizes";
    if (!provable) {
        len = at_example(g, ld);
        size = at_example(g, ad);
    }
    if (len <= 0) return NULL;
    if (__builtin_mul_overflow(len - 1, t->step, &last) || __builtin_add_overflow(last, t->start, &last) ||
        last >= size)
        return provable ? "slice: runs past the end of the operand"
                        : "slice: runs past the end of the operand at the example sizes";
    return NULL;
}

/* MATMUL: a [*batch, M, K] . b [*batch, K, N] -> [*batch, M, N]; batch dims equal (a broadcast is
 * an explicit EXPAND), float operands of one dtype, a float output. */
static const char *check_matmul(const kb_graph *g, const kb_node *t, char *msg, size_t n) {
    const kb_node *a = &g->nodes[t->inputs[0]], *b = &g->nodes[t->inputs[1]];
    int r = t->rank;
    if (r < 2 || a->rank != r || b->rank != r) {
        snprintf(msg, n, "matmul: operands and output need one rank >= 2 (got %d, %d -> %d)", (int)a->rank,
                 (int)b->rank, r);
        return msg;
    }
    if (!kb_dtype_is_float(a->dtype) || !kb_dtype_is_float(t->dtype)) return "matmul: float operands and output only";
    if (a->dtype != b->dtype) {
        snprintf(msg, n, "matmul: operands of one dtype (got %s and %s)", kb_dtype_name(a->dtype),
                 kb_dtype_name(b->dtype));
        return msg;
    }
    for (int d = 0; d < r - 2; d++)
        if (!kb_dim_equal(a->dims[d], b->dims[d]) || !kb_dim_equal(a->dims[d], t->dims[d])) {
            snprintf(msg, n, "matmul: batch dim %d differs (broadcast with expand first)", d);
            return msg;
        }
    if (!kb_dim_equal(a->dims[r - 1], b->dims[r - 2])) return "matmul: a's last dim (K) must be b's second-to-last";
    if (!kb_dim_equal(t->dims[r - 2], a->dims[r - 2]) || !kb_dim_equal(t->dims[r - 1], b->dims[r - 1]))
        return "matmul: the output must be [*batch, M, N] (a's M, b's N)";
    return NULL;
}

/* Checks a node template against its operands; returns a message or NULL when it is fine. */
static const char *check_node(const kb_graph *g, const kb_node *t, char *msg, size_t n) {
    const kb_op_info *info = kb_op_get(t->op);
    if (!info) return "unknown op";
    if ((unsigned)t->dtype >= KB_DTYPE_COUNT) return "unknown dtype";
    if (t->rank < 0 || t->rank > KB_MAX_RANK) return "rank out of range (0..8)";
    if (info->arity >= 0 ? t->ninputs != info->arity : (t->ninputs < 0 || t->ninputs > KB_MAX_INPUTS)) {
        snprintf(msg, n, "%s takes %d operand(s), got %d", info->name, info->arity, t->ninputs);
        return msg;
    }
    for (int i = 0; i < t->ninputs; i++)
        if (t->inputs[i] < 0 || t->inputs[i] >= g->nnodes) {
            snprintf(msg, n, "operand %d of %s is %%%d, which does not exist yet", i, info->name, t->inputs[i]);
            return msg;
        }
    for (int d = 0; d < t->rank; d++) {
        const kb_dim *dm = &t->dims[d];
        if (dm->coef < 0 || dm->nsym > KB_MAX_DIM_SYMS) return "size with a negative coefficient or too many symbols";
        for (int i = 0; i < dm->nsym; i++) {
            if (dm->sym[i] >= g->nsyms) return "size refers to an undefined symbol";
            if (i && dm->sym[i - 1] > dm->sym[i]) return "symbols of a size must be sorted";
        }
    }
    const char *why = check_sizes(g, t);
    if (why) return why;
    if (t->op == KB_OP_INPUT && (unsigned)t->input_kind > KB_INPUT_BUFFER) return "unknown input kind";
    const kb_node *a = t->ninputs > 0 ? &g->nodes[t->inputs[0]] : NULL;
    switch (info->kind) {
    case KB_KIND_LEAF:
        if (t->op == KB_OP_IOTA) {
            if (t->axis < 0 || t->axis >= t->rank) return "iota: axis out of range";
            /* its largest value is the axis size - 1, stored in the node's dtype */
            if (t->dtype == KB_I32 && at_example(g, t->dims[t->axis]) - 1 > INT32_MAX)
                return "iota: an i32 iota longer than 2^31 (at the example sizes)";
        }
        return NULL;
    case KB_KIND_EXTERN:
        return NULL;
    case KB_KIND_MATMUL:
        return check_matmul(g, t, msg, n);
    case KB_KIND_UNARY:
    case KB_KIND_BINARY:
    case KB_KIND_TERNARY:
        for (int i = 0; i < t->ninputs; i++) {
            const kb_node *o = &g->nodes[t->inputs[i]];
            if (o->rank != t->rank) goto shape_mismatch;
            for (int d = 0; d < t->rank; d++)
                if (!kb_dim_equal(o->dims[d], t->dims[d])) goto shape_mismatch;
        }
        return NULL;
    shape_mismatch:
        snprintf(msg, n, "%s: operands must have the output's shape (broadcast with expand first)", info->name);
        return msg;
    case KB_KIND_REDUCE: {
        if (t->axes == 0 || (a->rank < 32 && (t->axes >> a->rank) != 0)) return "reduce axes out of range";
        int keep = t->rank == a->rank;
        if (!keep && t->rank != a->rank - kb_popcount32(t->axes)) return "reduce output rank must be the operand's (keepdim) or fewer by the reduced axes";
        for (int d = 0, o = 0; d < a->rank; d++) {
            if (t->axes & (1u << d)) {
                if (keep && !(t->dims[o].coef == 1 && t->dims[o].nsym == 0)) return "keepdim reduce: reduced dims must have size 1";
                o += keep;
            } else {
                if (!kb_dim_equal(t->dims[o], a->dims[d])) return "reduce: kept dims must match the operand";
                o++;
            }
        }
        return NULL;
    }
    case KB_KIND_VIEW:
        if (t->op == KB_OP_PERMUTE) {
            if (t->rank != a->rank) return "permute: rank must not change";
            unsigned seen = 0;
            for (int d = 0; d < t->rank; d++) {
                int p = t->perm[d];
                if (p < 0 || p >= t->rank || (seen & (1u << p))) return "permute: perm is not a permutation";
                seen |= 1u << p;
                if (!kb_dim_equal(t->dims[d], a->dims[p])) return "permute: output dims must be the permuted operand dims";
            }
        } else if (t->op == KB_OP_EXPAND) {
            if (t->rank != a->rank) return "expand: rank must not change (reshape first)";
            for (int d = 0; d < t->rank; d++) {
                int one = a->dims[d].coef == 1 && a->dims[d].nsym == 0;
                if (!one && !kb_dim_equal(a->dims[d], t->dims[d])) return "expand: only size-1 dims may grow";
            }
        } else if (t->op == KB_OP_RESHAPE) {
            kb_monomial ma, mt;
            kb_monomial_of(a->dims, a->rank, ~0u, &ma);
            kb_monomial_of(t->dims, t->rank, ~0u, &mt);
            if (!kb_monomial_equal(&ma, &mt)) return "reshape: element count differs";
        } else if (t->op == KB_OP_SLICE) {
            if (t->rank != a->rank || t->axis < 0 || t->axis >= t->rank) return "slice: bad axis or rank";
            if (t->start < 0 || t->step < 1) return "slice: start must be >= 0 and step >= 1";
            for (int d = 0; d < t->rank; d++)
                if (d != t->axis && !kb_dim_equal(t->dims[d], a->dims[d])) return "slice: only the sliced axis may change";
            return check_slice(g, t, a);
        }
        return NULL;
    case KB_KIND_GATHER: {
        const kb_node *idx = &g->nodes[t->inputs[1]];
        if (idx->dtype != KB_I64 && idx->dtype != KB_I32) return "gather: index must be i64 or i32";
        if (idx->rank != a->rank || t->rank != a->rank) return "gather: operand, index and output must have one rank";
        if (t->axis < 0 || t->axis >= t->rank) return "gather: axis out of range";
        for (int d = 0; d < t->rank; d++) {
            if (!kb_dim_equal(t->dims[d], idx->dims[d])) return "gather: output has the index's shape";
            /* torch.gather: index.size(d) <= input.size(d) off the axis, where the output reads
             * the operand at the index's own coordinates: for every binding of the symbols */
            if (d != t->axis && !kb_dim_equal(idx->dims[d], a->dims[d]) &&
                !(same_symbols(idx->dims[d], a->dims[d]) && idx->dims[d].coef <= a->dims[d].coef)) {
                snprintf(msg, n, "gather: the index is larger than the operand on dim %d (not the axis)", d);
                return msg;
            }
        }
        return NULL;
    }
    }
    return "unknown op kind";
}

kb_status kb_graph_add(kb_graph *g, const kb_node *tmpl, int32_t *id) {
    char msg[160];
    const char *why = check_node(g, tmpl, msg, sizeof msg);
    if (why) return KB_FAIL(g->ctx, KB_ERR_INVALID, "%s", why);
    const char *name = kb_graph_keep_name(g, tmpl->name);
    if (!name) return KB_ERR_OOM;
    if (g->nnodes == g->cap) {
        int32_t ncap = g->cap ? g->cap * 2 : 32;
        kb_node *p = kb_realloc(g->ctx, g->nodes, sizeof(kb_node) * (size_t)g->cap, sizeof(kb_node) * (size_t)ncap);
        if (!p) return KB_ERR_OOM;
        g->nodes = p;
        g->cap = ncap;
    }
    kb_node *nd = &g->nodes[g->nnodes];
    *nd = *tmpl;
    nd->name = name;
    if (nd->op == KB_OP_INPUT) {
        nd->index = g->ninputs;
        kb_status st = push_id(g->ctx, &g->inputs, &g->ninputs, &g->inputs_cap, g->nnodes);
        if (st != KB_OK) return st;
    }
    *id = g->nnodes++;
    return KB_OK;
}

kb_status kb_graph_add_matmul(kb_graph *g, int32_t a, int32_t b, kb_dtype dt, int32_t *id) {
    if (a < 0 || a >= g->nnodes || b < 0 || b >= g->nnodes)
        return KB_FAIL(g->ctx, KB_ERR_INVALID, "matmul: operand %%%d or %%%d does not exist", (int)a, (int)b);
    const kb_node *na = &g->nodes[a], *nb = &g->nodes[b];
    if (na->rank < 2 || nb->rank < 2) return KB_FAIL(g->ctx, KB_ERR_INVALID, "matmul: operands need rank >= 2");
    kb_node t = kb_node_template(KB_OP_MATMUL, dt, na->rank, na->dims);
    t.dims[na->rank - 1] = nb->dims[nb->rank - 1];
    t.ninputs = 2;
    t.inputs[0] = a;
    t.inputs[1] = b;
    return kb_graph_add(g, &t, id);
}

kb_status kb_graph_add_output(kb_graph *g, int32_t v) {
    if (v < 0 || v >= g->nnodes) return KB_FAIL(g->ctx, KB_ERR_INVALID, "output %%%d does not exist", v);
    return push_id(g->ctx, &g->outputs, &g->noutputs, &g->outputs_cap, v);
}

/* ---------------------------------------------------------------- text dump */

static void dump_attrs(kb_sb *sb, const kb_graph *g, const kb_node *nd, kb_name_style names) {
    static const char *const input_kinds[] = {"user", "param", "buffer"};
    switch (nd->op) {
    case KB_OP_INPUT:
        kb_sb_printf(sb, " %s ", input_kinds[nd->input_kind]);
        kb_sb_put_name(sb, nd->name, names);
        break;
    case KB_OP_CONST:
        kb_sb_printf(sb, " %.9g", nd->scalar[0]);
        break;
    case KB_OP_LEAKY_RELU:
        kb_sb_printf(sb, " slope=%.9g", nd->scalar[0]);
        break;
    case KB_OP_SOFTPLUS:
        kb_sb_printf(sb, " beta=%.9g threshold=%.9g", nd->scalar[0], nd->scalar[1]);
        break;
    case KB_OP_PERMUTE:
        kb_sb_puts(sb, " perm=[");
        for (int d = 0; d < nd->rank; d++) kb_sb_printf(sb, "%s%d", d ? "," : "", nd->perm[d]);
        kb_sb_puts(sb, "]");
        break;
    case KB_OP_SLICE:
        kb_sb_printf(sb, " axis=%d start=%" PRId64 " step=%" PRId64, nd->axis, nd->start, nd->step);
        break;
    case KB_OP_IOTA:
    case KB_OP_GATHER:
        kb_sb_printf(sb, " axis=%d", nd->axis);
        break;
    case KB_OP_EXTERN:
        kb_sb_printf(sb, " #%d.%d", nd->index, nd->axis);
        if (nd->name[0]) {
            kb_sb_puts(sb, " ");
            kb_sb_put_name(sb, nd->name, names);
        }
        break;
    default:
        break;
    }
    if (nd->nograd) kb_sb_puts(sb, " nograd");
    if (kb_op_get(nd->op)->kind == KB_KIND_REDUCE) {
        const kb_node *a = &g->nodes[nd->inputs[0]];
        kb_sb_puts(sb, " axes=[");
        for (int d = 0, first = 1; d < a->rank; d++)
            if (nd->axes & (1u << d)) {
                kb_sb_printf(sb, "%s%d", first ? "" : ",", d);
                first = 0;
            }
        kb_sb_puts(sb, "]");
    }
}

/* One node as "%3 = op %1, %2 attrs : f32[s0,64]" (no newline). */
void kb_node_dump(kb_sb *sb, const kb_graph *g, int32_t id, kb_name_style names) {
    const kb_node *nd = &g->nodes[id];
    char type[256];
    kb_sb_printf(sb, "%%%d = %s", id, kb_op_get(nd->op)->name);
    for (int i = 0; i < nd->ninputs; i++) kb_sb_printf(sb, "%s %%%d", i ? "," : "", nd->inputs[i]);
    dump_attrs(sb, g, nd, names);
    kb_sb_printf(sb, " : %s", kb_type_str(g, nd, type, sizeof type));
}

kb_status kb_graph_dump(const kb_graph *g, char **out) {
    kb_sb sb;
    kb_sb_init(&sb, g->ctx);
    kb_sb_puts(&sb, "graph(");
    for (int s = 0; s < g->nsyms; s++)
        kb_sb_printf(&sb, "%s%s=%" PRId64, s ? ", " : "", g->sym_names[s], g->sym_examples[s]);
    kb_sb_puts(&sb, ") {\n");
    for (int32_t i = 0; i < g->nnodes; i++) {
        kb_sb_puts(&sb, "  ");
        kb_node_dump(&sb, g, i, KB_NAME_IR);
        kb_sb_puts(&sb, "\n");
    }
    kb_sb_puts(&sb, "  return");
    for (int i = 0; i < g->noutputs; i++) kb_sb_printf(&sb, "%s %%%d", i ? "," : "", g->outputs[i]);
    kb_sb_puts(&sb, "\n}\n");
    return kb_sb_finish(&sb, out);
}

/* A node with op, dtype and shape set and everything else zero (step 1): what rewrites fill in. */
kb_node kb_node_template(kb_op op, kb_dtype dt, int32_t rank, const kb_dim *dims) {
    kb_node n;
    memset(&n, 0, sizeof n);
    n.op = op;
    n.dtype = dt;
    n.rank = rank;
    n.step = 1;
    n.name = "";
    if (rank > 0) memcpy(n.dims, dims, sizeof(kb_dim) * (size_t)rank);
    return n;
}
