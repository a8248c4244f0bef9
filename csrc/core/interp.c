/* interp.c — the CPU interpreter: runs a whole graph or one region of a partition on host
 * buffers, every value a dense row-major array of doubles. It is the reference CI runs without
 * a GPU (docs/DESIGN.md, "Verification"), so it rounds only where torch does: on CAST and on
 * storing an output. */
#include "core/internal.h"

#include <limits.h>
#include <math.h>

/* ---------------------------------------------------------------- dtype conversion */

/* NOTE: the f16/bf16 helpers reproduce c10's conversions bit for bit (round to nearest even,
 * NaN -> the canonical quiet NaN), so an output stored here equals torch's .to(dtype). */
static uint16_t f16_from_float(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);      /* NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);     /* >= 65520 (or Inf) -> Inf */
    if (ax < 0x38800000u) {                                       /* below 2^-14: subnormal half */
        uint32_t e = ax >> 23;
        if (e < 102) return sign;                                 /* <= 2^-25 rounds to zero */
        uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e;                                 /* 14 .. 24 */
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t v = ax - 0x38000000u;                                /* rebias exponent 127 -> 15 */
    uint32_t r = v >> 13, rem = v & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) r++;        /* a carry bumps the exponent */
    return (uint16_t)(sign | r);
}

static double f16_to_double(uint16_t h)
{
    int e = (h >> 10) & 0x1f;
    int m = h & 0x3ff;
    double v;
    if (e == 0) v = ldexp((double)m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = ldexp((double)(m | 0x400), e - 25);
    return (h & 0x8000) ? -v : v;
}

static uint16_t bf16_from_float(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;          /* c10 returns this for any NaN */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);    /* Inf stays Inf */
}

static double bf16_to_double(uint16_t h)
{
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

/* Truncation toward zero like torch's casts; NaN and out-of-range values give the minimum,
 * which is what x86's cvttsd2si (and so torch on CPU) produces, instead of C's UB. */
static int64_t to_i64(double v)
{
    if (v >= -0x1p63 && v < 0x1p63) return (int64_t)v;
    return INT64_MIN;
}

static int32_t to_i32(double v)
{
    if (v > -2147483649.0 && v < 2147483648.0) return (int32_t)v;
    return INT32_MIN;
}

/* The value v takes once stored as dtype t (what CAST computes). bf16 and f16 go through f32,
 * as torch's conversions from double do. */
static double round_to(kb_dtype t, double v)
{
    switch (t) {
    case KB_F32: return (float)v;
    case KB_F16: return f16_to_double(f16_from_float((float)v));
    case KB_BF16: return bf16_to_double(bf16_from_float((float)v));
    case KB_F64: return v;
    case KB_I64: return (double)to_i64(v);
    case KB_I32: return (double)to_i32(v);
    case KB_BOOL: return v != 0;
    default: return v;
    }
}

static void load_buffer(double *y, kb_dtype t, const void *src, int64_t n)
{
    int64_t i;
    switch (t) {
    case KB_F32: for (i = 0; i < n; i++) y[i] = ((const float *)src)[i]; break;
    case KB_F16: for (i = 0; i < n; i++) y[i] = f16_to_double(((const uint16_t *)src)[i]); break;
    case KB_BF16: for (i = 0; i < n; i++) y[i] = bf16_to_double(((const uint16_t *)src)[i]); break;
    case KB_F64: memcpy(y, src, (size_t)n * sizeof(double)); break;
    case KB_I64: for (i = 0; i < n; i++) y[i] = (double)((const int64_t *)src)[i]; break;
    case KB_I32: for (i = 0; i < n; i++) y[i] = ((const int32_t *)src)[i]; break;
    case KB_BOOL: for (i = 0; i < n; i++) y[i] = ((const uint8_t *)src)[i] != 0; break;
    default: break;
    }
}

static void store_buffer(void *dst, kb_dtype t, const double *x, int64_t n)
{
    int64_t i;
    switch (t) {
    case KB_F32: for (i = 0; i < n; i++) ((float *)dst)[i] = (float)x[i]; break;
    case KB_F16: for (i = 0; i < n; i++) ((uint16_t *)dst)[i] = f16_from_float((float)x[i]); break;
    case KB_BF16: for (i = 0; i < n; i++) ((uint16_t *)dst)[i] = bf16_from_float((float)x[i]); break;
    case KB_F64: memcpy(dst, x, (size_t)n * sizeof(double)); break;
    case KB_I64: for (i = 0; i < n; i++) ((int64_t *)dst)[i] = to_i64(x[i]); break;
    case KB_I32: for (i = 0; i < n; i++) ((int32_t *)dst)[i] = to_i32(x[i]); break;
    case KB_BOOL: for (i = 0; i < n; i++) ((uint8_t *)dst)[i] = x[i] != 0; break;
    default: break;
    }
}

/* ---------------------------------------------------------------- pointwise ops (ops.def) */

/* One loop per op, expanded from the INTERP column, so adding an op is one row in ops.def.
 * Absent operands read as 0; non-pointwise rows expand to dead cases never dispatched here. */
static void pointwise(kb_op op, int64_t n, double *out, const double *A, const double *B,
                      const double *C, double p0, double p1)
{
    switch (op) {
#define X(name, arity, kind, printed, interp, cuda, da, db, dc)            \
    case KB_OP_##name:                                                     \
        for (int64_t i = 0; i < n; i++) {                                  \
            double a = A ? A[i] : 0.0, b = B ? B[i] : 0.0, c = C ? C[i] : 0.0; \
            (void)a; (void)b; (void)c; (void)p0; (void)p1;                 \
            out[i] = (double)(interp);                                     \
        }                                                                  \
        break;
#include "core/ops.def"
#undef X
    default: break;
    }
}

/* ---------------------------------------------------------------- the machine */

typedef struct interp {
    kb_ctx *ctx;
    const kb_graph *g;
    const int64_t *symvals;
    int32_t n;          /* graph nodes */
    double **buf;       /* per value: its dense array while some consumer still needs it */
    int64_t *numel;     /* per value: element count of buf (valid while buf != NULL) */
    int32_t *refs;      /* per value: consumers not yet run */
    int32_t *role;      /* per value: region membership flags (ROLE_*) or graph input position */
} interp;

enum { ROLE_NODE = 1, ROLE_INPUT = 2 };

static size_t buf_bytes(int64_t numel) { return (size_t)(numel > 0 ? numel : 1) * sizeof(double); }

static kb_status interp_init(interp *it, kb_ctx *ctx, const kb_graph *g, const int64_t *symvals)
{
    kb_status st = KB_OK;
    memset(it, 0, sizeof *it);
    it->ctx = ctx;
    it->g = g;
    it->symvals = symvals;
    it->n = kb_graph_nnodes(g);
    size_t n = it->n > 0 ? (size_t)it->n : 1;
    KB_CHECK(ctx, !(kb_graph_nsymbols(g) > 0 && !symvals), KB_ERR_INVALID,
             "interp: the graph has %d symbols but symvals is NULL", (int)kb_graph_nsymbols(g));
    for (int32_t k = 0; k < kb_graph_nsymbols(g); k++)
        KB_CHECK(ctx, symvals[k] >= 0, KB_ERR_INVALID, "interp: symbol %s bound to a negative size (%lld)",
                 kb_graph_symbol_name(g, k), (long long)symvals[k]);
    it->buf = kb_calloc(ctx, n, sizeof *it->buf);
    it->numel = kb_calloc(ctx, n, sizeof *it->numel);
    it->refs = kb_calloc(ctx, n, sizeof *it->refs);
    it->role = kb_calloc(ctx, n, sizeof *it->role);
    KB_CHECK(ctx, it->buf && it->numel && it->refs && it->role, KB_ERR_OOM,
             "interp: out of memory for %d values", (int)it->n);
cleanup:
    return st;
}

static void release(interp *it, int32_t v)
{
    if (it->buf[v]) kb_free(it->ctx, it->buf[v], buf_bytes(it->numel[v]));
    it->buf[v] = NULL;
}

static void interp_done(interp *it)
{
    size_t n = it->n > 0 ? (size_t)it->n : 1;
    if (it->buf)
        for (int32_t v = 0; v < it->n; v++) release(it, v);
    kb_free(it->ctx, it->buf, n * sizeof *it->buf);
    kb_free(it->ctx, it->numel, n * sizeof *it->numel);
    kb_free(it->ctx, it->refs, n * sizeof *it->refs);
    kb_free(it->ctx, it->role, n * sizeof *it->role);
}

/* Concrete sizes of v, like kb_value_sizes, but every product checked for overflow. */
static kb_status shape_of(interp *it, int32_t v, int64_t sz[KB_MAX_RANK], int64_t *numel)
{
    kb_status st = KB_OK;
    const kb_node *nd = kb_graph_node(it->g, v);
    int64_t n = 1;
    KB_CHECK(it->ctx, nd->rank >= 0 && nd->rank <= KB_MAX_RANK, KB_ERR_INVALID,
             "interp: value %d has rank %d", (int)v, (int)nd->rank);
    for (int d = 0; d < nd->rank; d++) {
        kb_dim dm = nd->dims[d];
        int64_t s = dm.coef;
        KB_CHECK(it->ctx, dm.nsym <= KB_MAX_DIM_SYMS, KB_ERR_INVALID,
                 "interp: value %d dim %d has %d symbols", (int)v, d, (int)dm.nsym);
        for (int k = 0; k < dm.nsym; k++) {
            KB_CHECK(it->ctx, dm.sym[k] < kb_graph_nsymbols(it->g), KB_ERR_INVALID,
                     "interp: value %d dim %d uses unknown symbol %d", (int)v, d, (int)dm.sym[k]);
            KB_CHECK(it->ctx, !__builtin_mul_overflow(s, it->symvals[dm.sym[k]], &s),
                     KB_ERR_INVALID, "interp: value %d dim %d overflows int64", (int)v, d);
        }
        KB_CHECK(it->ctx, s >= 0, KB_ERR_INVALID, "interp: value %d dim %d is negative (%lld)",
                 (int)v, d, (long long)s);
        sz[d] = s;
        KB_CHECK(it->ctx, !__builtin_mul_overflow(n, s, &n), KB_ERR_INVALID,
                 "interp: value %d has more than 2^63 elements", (int)v);
    }
    *numel = n;
cleanup:
    return st;
}

static kb_status alloc_value(interp *it, int32_t v, int64_t numel)
{
    kb_status st = KB_OK;
    KB_CHECK(it->ctx, (uint64_t)numel <= SIZE_MAX / sizeof(double), KB_ERR_OOM,
             "interp: value %d (%lld elements) does not fit in memory", (int)v, (long long)numel);
    it->buf[v] = kb_malloc(it->ctx, buf_bytes(numel));
    KB_CHECK(it->ctx, it->buf[v] != NULL, KB_ERR_OOM,
             "interp: out of memory for value %d (%lld elements)", (int)v, (long long)numel);
    it->numel[v] = numel;
cleanup:
    return st;
}

/* Row-major contiguous strides of sizes sz. */
static void contiguous_strides(int rank, const int64_t *sz, int64_t *str)
{
    int64_t s = 1;
    for (int d = rank - 1; d >= 0; d--) {
        str[d] = s;
        s *= sz[d];
    }
}

/* Advances a row-major multi-index over sz[0..rank) and the offset it maps to through str. */
static void step_index(int rank, const int64_t *sz, int64_t *idx, const int64_t *str, int64_t *off)
{
    for (int d = rank - 1; d >= 0; d--) {
        idx[d]++;
        *off += str[d];
        if (idx[d] < sz[d]) return;
        *off -= str[d] * sz[d];
        idx[d] = 0;
    }
}

/* out[i] = x[base + sum_d idx_d(i) * str[d]] for i over the row-major space osz: every index
 * map (permute, expand, slice) is one of these. */
static void strided_copy(double *out, const double *x, int rank, const int64_t *osz,
                         const int64_t *str, int64_t base, int64_t n)
{
    int64_t one = 1, zero = 0, idx[KB_MAX_RANK] = {0}, off = base;
    if (rank == 0) {
        rank = 1;
        osz = &one;
        str = &zero;
    }
    int64_t inner = osz[rank - 1], s = str[rank - 1];
    for (int64_t i = 0; i < n; i += inner) {
        for (int64_t j = 0; j < inner; j++) out[i + j] = x[off + j * s];
        step_index(rank - 1, osz, idx, str, &off);
    }
}

#define NODE_FAIL(st_, ...) KB_CHECK(it->ctx, 0, st_, __VA_ARGS__)

static kb_status eval_reduce(interp *it, int32_t v, const kb_node *nd, double *out, int64_t on)
{
    kb_status st = KB_OK;
    int32_t u = nd->inputs[0];
    const kb_node *src = kb_graph_node(it->g, u);
    int64_t isz[KB_MAX_RANK], in, ostr[KB_MAX_RANK], idx[KB_MAX_RANK] = {0}, count = 1, s = 1;
    KB_TRY(shape_of(it, u, isz, &in));
    int rank = src->rank;
    KB_CHECK(it->ctx, (nd->axes >> rank) == 0, KB_ERR_INVALID,
             "interp: node %d reduces axes 0x%x of a rank-%d operand", (int)v, (unsigned)nd->axes, rank);
    int kept = rank - kb_popcount32(nd->axes);
    KB_CHECK(it->ctx, nd->rank == rank || nd->rank == kept, KB_ERR_INVALID,
             "interp: node %d has rank %d, expected %d or %d", (int)v, (int)nd->rank, rank, kept);
    for (int d = rank - 1; d >= 0; d--) {
        if (nd->axes >> d & 1u) {
            ostr[d] = 0;
            count *= isz[d];
        } else {
            ostr[d] = s;
            s *= isz[d];
        }
    }
    KB_CHECK(it->ctx, s == on, KB_ERR_INVALID, "interp: node %d has %lld elements, its reduction %lld",
             (int)v, (long long)on, (long long)s);
    KB_CHECK(it->ctx, count > 0 || on == 0 || nd->op == KB_OP_SUM || nd->op == KB_OP_MEAN,
             KB_ERR_INVALID, "interp: node %d takes the %s of an empty dim", (int)v,
             kb_op_get(nd->op)->name);

    double init = nd->op == KB_OP_RMAX ? -INFINITY : nd->op == KB_OP_RMIN ? INFINITY : 0.0;
    for (int64_t i = 0; i < on; i++) out[i] = init;
    const double *x = it->buf[u];
    int64_t off = 0;
    if (rank == 0) { /* a reduction of a scalar is the scalar */
        if (in == 1) out[0] = x[0];
        goto cleanup;
    }
    int64_t inner = isz[rank - 1], os = ostr[rank - 1];
    for (int64_t i = 0; i < in; i += inner) {
        const double *row = x + i;
        switch (nd->op) {
        case KB_OP_SUM:
        case KB_OP_MEAN:
            for (int64_t j = 0; j < inner; j++) out[off + j * os] += row[j];
            break;
        case KB_OP_RMAX: /* NaN wins, as in torch.amax */
            for (int64_t j = 0; j < inner; j++) {
                double *o = &out[off + j * os];
                if (*o == *o && (row[j] != row[j] || row[j] > *o)) *o = row[j];
            }
            break;
        case KB_OP_RMIN:
            for (int64_t j = 0; j < inner; j++) {
                double *o = &out[off + j * os];
                if (*o == *o && (row[j] != row[j] || row[j] < *o)) *o = row[j];
            }
            break;
        default:
            NODE_FAIL(KB_ERR_INVALID, "interp: node %d is not a reduction", (int)v);
        }
        step_index(rank - 1, isz, idx, ostr, &off);
    }
    if (nd->op == KB_OP_MEAN)
        for (int64_t i = 0; i < on; i++) out[i] /= (double)count;  /* 0/0 = NaN, as torch */
cleanup:
    return st;
}

static kb_status eval_view(interp *it, int32_t v, const kb_node *nd, double *out,
                           const int64_t *osz, int64_t on)
{
    kb_status st = KB_OK;
    int32_t u = nd->inputs[0];
    const kb_node *src = kb_graph_node(it->g, u);
    int64_t isz[KB_MAX_RANK], in, istr[KB_MAX_RANK], str[KB_MAX_RANK], base = 0;
    KB_TRY(shape_of(it, u, isz, &in));
    contiguous_strides(src->rank, isz, istr);
    int rank = nd->rank;
    if (nd->op == KB_OP_RESHAPE) {
        KB_CHECK(it->ctx, in == on, KB_ERR_INVALID, "interp: reshape node %d: %lld elements into %lld",
                 (int)v, (long long)in, (long long)on);
        if (on > 0) memcpy(out, it->buf[u], (size_t)on * sizeof(double));
        goto cleanup;
    }
    KB_CHECK(it->ctx, src->rank == rank, KB_ERR_INVALID, "interp: %s node %d: rank %d, operand rank %d",
             kb_op_get(nd->op)->name, (int)v, rank, (int)src->rank);
    switch (nd->op) {
    case KB_OP_PERMUTE: {
        unsigned seen = 0;
        for (int i = 0; i < rank; i++) {
            int q = nd->perm[i];
            KB_CHECK(it->ctx, q >= 0 && q < rank && !(seen >> q & 1u) && osz[i] == isz[q],
                     KB_ERR_INVALID, "interp: permute node %d: bad perm[%d] = %d", (int)v, i, q);
            seen |= 1u << q;
            str[i] = istr[q];
        }
        break;
    }
    case KB_OP_EXPAND:
        for (int d = 0; d < rank; d++) {
            KB_CHECK(it->ctx, isz[d] == osz[d] || isz[d] == 1, KB_ERR_INVALID,
                     "interp: expand node %d: dim %d of size %lld cannot become %lld", (int)v, d,
                     (long long)isz[d], (long long)osz[d]);
            str[d] = isz[d] == osz[d] ? istr[d] : 0;
        }
        break;
    case KB_OP_SLICE: {
        int ax = nd->axis;
        KB_CHECK(it->ctx, ax >= 0 && ax < rank, KB_ERR_INVALID, "interp: slice node %d: axis %d", (int)v, ax);
        for (int d = 0; d < rank; d++) {
            KB_CHECK(it->ctx, d == ax || isz[d] == osz[d], KB_ERR_INVALID,
                     "interp: slice node %d: dim %d changes size", (int)v, d);
            str[d] = istr[d];
        }
        KB_CHECK(it->ctx, nd->step >= 1 && nd->start >= 0, KB_ERR_INVALID,
                 "interp: slice node %d: start %lld step %lld", (int)v, (long long)nd->start,
                 (long long)nd->step);
        /* the last element read, start + (len-1)*step, must lie inside the operand */
        KB_CHECK(it->ctx, on == 0 || (nd->start < isz[ax] && osz[ax] - 1 <= (isz[ax] - 1 - nd->start) / nd->step),
                 KB_ERR_INVALID, "interp: slice node %d: %lld elements from %lld step %lld overrun size %lld",
                 (int)v, (long long)osz[ax], (long long)nd->start, (long long)nd->step, (long long)isz[ax]);
        str[ax] = osz[ax] > 1 ? istr[ax] * nd->step : 0;  /* < the operand's size by the check above */
        base = on > 0 ? nd->start * istr[ax] : 0;
        break;
    }
    default:
        NODE_FAIL(KB_ERR_INVALID, "interp: node %d is not a view", (int)v);
    }
    strided_copy(out, it->buf[u], rank, osz, str, base, on);
cleanup:
    return st;
}

/* torch.gather: out[i..,j,..] = a[i..,index[i..,j,..],..] along nd->axis; out has the index's
 * shape. Every index is checked before it is used. */
static kb_status eval_gather(interp *it, int32_t v, const kb_node *nd, double *out,
                             const int64_t *osz_in, int64_t on)
{
    kb_status st = KB_OK;
    int32_t ua = nd->inputs[0], ux = nd->inputs[1];
    const kb_node *na = kb_graph_node(it->g, ua), *nx = kb_graph_node(it->g, ux);
    int64_t asz[KB_MAX_RANK] = {1}, xsz[KB_MAX_RANK] = {1}, osz[KB_MAX_RANK] = {1}, an, xn;
    int64_t astr[KB_MAX_RANK], str[KB_MAX_RANK], idx[KB_MAX_RANK] = {0}, off = 0;
    KB_TRY(shape_of(it, ua, asz, &an));
    KB_TRY(shape_of(it, ux, xsz, &xn));
    KB_CHECK(it->ctx, nx->dtype == KB_I64 || nx->dtype == KB_I32, KB_ERR_INVALID,
             "interp: gather node %d: index dtype %s (want i64 or i32)", (int)v, kb_dtype_name(nx->dtype));
    int rank = nd->rank, ax = nd->axis;
    KB_CHECK(it->ctx, na->rank == rank && nx->rank == rank, KB_ERR_INVALID,
             "interp: gather node %d: ranks %d, %d, %d differ", (int)v, rank, (int)na->rank, (int)nx->rank);
    KB_CHECK(it->ctx, (ax >= 0 && ax < rank) || (rank == 0 && ax == 0), KB_ERR_INVALID,
             "interp: gather node %d: axis %d out of range", (int)v, ax);
    for (int d = 0; d < rank; d++) {
        osz[d] = osz_in[d];
        KB_CHECK(it->ctx, osz[d] == xsz[d] && (d == ax || osz[d] <= asz[d]), KB_ERR_INVALID,
                 "interp: gather node %d: dim %d: output %lld, index %lld, input %lld", (int)v, d,
                 (long long)osz[d], (long long)xsz[d], (long long)asz[d]);
    }
    if (rank == 0) rank = 1;  /* a 0-d gather reads the one element at index 0 */
    contiguous_strides(rank, asz, astr);
    for (int d = 0; d < rank; d++) str[d] = d == ax ? 0 : astr[d];
    const double *a = it->buf[ua], *x = it->buf[ux];
    int64_t inner = osz[rank - 1], s = str[rank - 1], lim = asz[ax];
    for (int64_t i = 0; i < on; i += inner) {
        for (int64_t j = 0; j < inner; j++) {
            double k = x[i + j];
            KB_CHECK(it->ctx, k >= 0 && k < (double)lim, KB_ERR_INVALID,
                     "interp: gather node %d: index %.17g at element %lld is out of range [0, %lld) on axis %d",
                     (int)v, k, (long long)(i + j), (long long)lim, ax);
            out[i + j] = a[off + j * s + (int64_t)k * astr[ax]];
        }
        step_index(rank - 1, osz, idx, str, &off);
    }
cleanup:
    return st;
}

/* MATMUL: out[b,m,n] = sum_k a[b,m,k] * b[b,k,n] over dense operands, summed in double in k order
 * and rounded once to the node's dtype, as torch rounds a bf16 (or f32) product once at its
 * output. */
static kb_status eval_matmul(interp *it, int32_t v, const kb_node *nd, double *out, const int64_t *osz, int64_t on)
{
    kb_status st = KB_OK;
    int32_t ua = nd->inputs[0], ub = nd->inputs[1];
    int64_t asz[KB_MAX_RANK], bsz[KB_MAX_RANK], an, bn;
    KB_TRY(shape_of(it, ua, asz, &an));
    KB_TRY(shape_of(it, ub, bsz, &bn));
    int r = nd->rank;
    KB_CHECK(it->ctx, r >= 2 && kb_graph_node(it->g, ua)->rank == r && kb_graph_node(it->g, ub)->rank == r,
             KB_ERR_INVALID, "interp: matmul node %d: ranks differ or are below 2", (int)v);
    int64_t M = osz[r - 2], N = osz[r - 1], K = asz[r - 1], batch = 1;
    for (int d = 0; d < r - 2; d++) {
        KB_CHECK(it->ctx, asz[d] == osz[d] && bsz[d] == osz[d], KB_ERR_INVALID,
                 "interp: matmul node %d: batch dim %d differs", (int)v, d);
        batch *= osz[d];
    }
    KB_CHECK(it->ctx, asz[r - 2] == M && bsz[r - 2] == K && bsz[r - 1] == N, KB_ERR_INVALID,
             "interp: matmul node %d: [%lld,%lld] . [%lld,%lld] -> [%lld,%lld]", (int)v, (long long)asz[r - 2],
             (long long)K, (long long)bsz[r - 2], (long long)bsz[r - 1], (long long)M, (long long)N);
    const double *A = it->buf[ua], *B = it->buf[ub];
    for (int64_t i = 0; i < on; i++) out[i] = 0.0;
    for (int64_t q = 0; q < batch; q++) {
        const double *a = A + q * M * K, *b = B + q * K * N;
        double *o = out + q * M * N;
        for (int64_t m = 0; m < M; m++)
            for (int64_t k = 0; k < K; k++) {
                double x = a[m * K + k];
                for (int64_t j = 0; j < N; j++) o[m * N + j] += x * b[k * N + j];
            }
    }
    for (int64_t i = 0; i < on; i++) out[i] = round_to(nd->dtype, out[i]);
cleanup:
    return st;
}

static kb_status eval_node(interp *it, int32_t v)
{
    kb_status st = KB_OK;
    const kb_node *nd = kb_graph_node(it->g, v);
    int64_t osz[KB_MAX_RANK], on;
    KB_CHECK(it->ctx, (int)nd->op >= 0 && nd->op < KB_OP_COUNT, KB_ERR_INVALID,
             "interp: node %d has unknown op %d", (int)v, (int)nd->op);
    const kb_op_info *info = kb_op_get(nd->op);
    KB_CHECK(it->ctx, info->kind != KB_KIND_EXTERN, KB_ERR_INVALID,
             "interp: node %d is EXTERN (torch runs it, not the interpreter)", (int)v);
    KB_CHECK(it->ctx, nd->op != KB_OP_INPUT, KB_ERR_INVALID, "interp: input node %d has no data", (int)v);
    KB_CHECK(it->ctx, nd->ninputs == info->arity, KB_ERR_INVALID, "interp: %s node %d has %d operands",
             info->name, (int)v, (int)nd->ninputs);
    const double *opd[3] = {NULL, NULL, NULL};
    for (int k = 0; k < nd->ninputs; k++) {
        int32_t u = nd->inputs[k];
        KB_CHECK(it->ctx, u >= 0 && u < v, KB_ERR_INVALID, "interp: node %d reads bad value id %d",
                 (int)v, (int)u);
        KB_CHECK(it->ctx, it->buf[u] != NULL, KB_ERR_INVALID,
                 "interp: node %d reads value %d before it is computed", (int)v, (int)u);
        if (k < 3) opd[k] = it->buf[u];
    }
    KB_TRY(shape_of(it, v, osz, &on));
    KB_TRY(alloc_value(it, v, on));
    double *out = it->buf[v];
    switch (info->kind) {
    case KB_KIND_LEAF:
    case KB_KIND_UNARY:
    case KB_KIND_BINARY:
    case KB_KIND_TERNARY:
        for (int k = 0; k < nd->ninputs; k++)
            KB_CHECK(it->ctx, it->numel[nd->inputs[k]] == on, KB_ERR_INVALID,
                     "interp: %s node %d: operand %d has %lld elements, the output %lld", info->name,
                     (int)v, k, (long long)it->numel[nd->inputs[k]], (long long)on);
        if (nd->op == KB_OP_IOTA) { /* coordinate along axis: (i / stride) % size */
            int64_t inner = 1;
            for (int d = nd->rank - 1; d > nd->axis; d--) inner *= osz[d];
            for (int64_t i = 0; i < on; i++) out[i] = (double)((i / inner) % osz[nd->axis]);
            break;
        }
        pointwise(nd->op, on, out, opd[0], opd[1], opd[2], nd->scalar[0], nd->scalar[1]);
        if (nd->op == KB_OP_CAST)
            for (int64_t i = 0; i < on; i++) out[i] = round_to(nd->dtype, out[i]);
        break;
    case KB_KIND_REDUCE: KB_TRY(eval_reduce(it, v, nd, out, on)); break;
    case KB_KIND_VIEW: KB_TRY(eval_view(it, v, nd, out, osz, on)); break;
    case KB_KIND_GATHER: KB_TRY(eval_gather(it, v, nd, out, osz, on)); break;
    case KB_KIND_MATMUL: KB_TRY(eval_matmul(it, v, nd, out, osz, on)); break;
    default: NODE_FAIL(KB_ERR_INVALID, "interp: node %d has kind %d", (int)v, (int)info->kind);
    }
cleanup:
    if (st != KB_OK) release(it, v);
    return st;
}

static kb_status load_value(interp *it, int32_t v, const void *src)
{
    kb_status st = KB_OK;
    int64_t sz[KB_MAX_RANK], n;
    KB_TRY(shape_of(it, v, sz, &n));
    KB_CHECK(it->ctx, src != NULL || n == 0, KB_ERR_INVALID, "interp: no buffer for input value %d", (int)v);
    KB_TRY(alloc_value(it, v, n));
    if (n > 0) load_buffer(it->buf[v], kb_graph_node(it->g, v)->dtype, src, n);
cleanup:
    return st;
}

/* Stores v into every output slot that names it (a value may be returned twice). */
static kb_status store_outputs(interp *it, int32_t v, const int32_t *ids, int32_t count, void *const *outs)
{
    kb_status st = KB_OK;
    for (int32_t j = 0; j < count; j++) {
        if (ids[j] != v) continue;
        int64_t n = it->numel[v];
        KB_CHECK(it->ctx, outs[j] != NULL || n == 0, KB_ERR_INVALID, "interp: no buffer for output %d", (int)j);
        if (n > 0) store_buffer(outs[j], kb_graph_node(it->g, v)->dtype, it->buf[v], n);
    }
cleanup:
    return st;
}

/* v has run: its operands lose a consumer (freed at zero), and v itself goes if unread. */
static void finish(interp *it, int32_t v)
{
    const kb_node *nd = kb_graph_node(it->g, v);
    for (int k = 0; k < nd->ninputs; k++)
        if (--it->refs[nd->inputs[k]] == 0) release(it, nd->inputs[k]);
    if (it->refs[v] == 0) release(it, v);
}

static kb_status check_operands(interp *it, int32_t v)
{
    kb_status st = KB_OK;
    const kb_node *nd = kb_graph_node(it->g, v);
    KB_CHECK(it->ctx, nd->ninputs >= 0 && nd->ninputs <= KB_MAX_INPUTS, KB_ERR_INVALID,
             "interp: node %d has %d operands", (int)v, (int)nd->ninputs);
    for (int k = 0; k < nd->ninputs; k++)
        KB_CHECK(it->ctx, nd->inputs[k] >= 0 && nd->inputs[k] < v, KB_ERR_INVALID,
                 "interp: node %d reads bad value id %d", (int)v, (int)nd->inputs[k]);
cleanup:
    return st;
}

kb_status kb_interp_graph(kb_ctx *ctx, const kb_graph *g, const int64_t *symvals,
                          const void *const *ins, void *const *outs)
{
    kb_status st = KB_OK;
    interp it;
    memset(&it, 0, sizeof it);
    it.ctx = ctx;
    if (!ctx) return KB_ERR_INVALID;
    KB_CHECK(ctx, g != NULL, KB_ERR_INVALID, "interp: graph is NULL");
    KB_TRY(interp_init(&it, ctx, g, symvals));
    KB_CHECK(ctx, (g->ninputs == 0 || ins) && (g->noutputs == 0 || outs), KB_ERR_INVALID,
             "interp: ins or outs is NULL");
    for (int32_t i = 0; i < g->ninputs; i++) {
        int32_t v = g->inputs[i];
        KB_CHECK(ctx, v >= 0 && v < it.n, KB_ERR_INVALID, "interp: graph input %d is value %d", (int)i, (int)v);
        it.role[v] = ROLE_INPUT | (i << 2);  /* the position rides above the flag bits */
    }
    for (int32_t v = 0; v < it.n; v++) {
        kb_op op = kb_graph_node(g, v)->op;
        KB_CHECK(ctx, (int)op >= 0 && op < KB_OP_COUNT, KB_ERR_INVALID, "interp: node %d has unknown op %d",
                 (int)v, (int)op);
        KB_CHECK(ctx, kb_op_get(op)->kind != KB_KIND_EXTERN, KB_ERR_INVALID,
                 "interp: node %d is EXTERN; run such a graph region by region", (int)v);
    }
    for (int32_t j = 0; j < g->noutputs; j++) {
        int32_t v = g->outputs[j];
        KB_CHECK(ctx, v >= 0 && v < it.n, KB_ERR_INVALID, "interp: graph output %d is value %d", (int)j, (int)v);
        it.role[v] |= ROLE_NODE;
    }
    /* only values an output depends on run; each counts its consumers */
    for (int32_t v = it.n - 1; v >= 0; v--) {
        if (!(it.role[v] & ROLE_NODE)) continue;
        KB_TRY(check_operands(&it, v));
        const kb_node *nd = kb_graph_node(g, v);
        for (int k = 0; k < nd->ninputs; k++) {
            it.role[nd->inputs[k]] |= ROLE_NODE;
            it.refs[nd->inputs[k]]++;
        }
    }
    for (int32_t v = 0; v < it.n; v++) {
        if (!(it.role[v] & ROLE_NODE)) continue;
        if (kb_graph_node(g, v)->op == KB_OP_INPUT) {
            KB_CHECK(ctx, it.role[v] & ROLE_INPUT, KB_ERR_INVALID,
                     "interp: input node %d is not among the graph's inputs", (int)v);
            KB_TRY(load_value(&it, v, ins[it.role[v] >> 2]));
        } else {
            KB_TRY(eval_node(&it, v));
        }
        KB_TRY(store_outputs(&it, v, g->outputs, g->noutputs, outs));
        finish(&it, v);
    }
cleanup:
    interp_done(&it);
    return st;
}

kb_status kb_interp_region(kb_ctx *ctx, const kb_partition *p, int32_t r, const int64_t *symvals,
                           const void *const *ins, void *const *outs)
{
    kb_status st = KB_OK;
    interp it;
    memset(&it, 0, sizeof it);
    it.ctx = ctx;
    if (!ctx) return KB_ERR_INVALID;
    KB_CHECK(ctx, p != NULL && p->graph != NULL, KB_ERR_INVALID, "interp: partition is NULL");
    KB_CHECK(ctx, r >= 0 && r < p->nregions, KB_ERR_INVALID, "interp: region %d of %d", (int)r, (int)p->nregions);
    const kb_region *reg = &p->regions[r];
    KB_CHECK(ctx, reg->kind != KB_REGION_EXTERN, KB_ERR_INVALID,
             "interp: region %d is EXTERN (torch runs it, not the interpreter)", (int)r);
    KB_TRY(interp_init(&it, ctx, p->graph, symvals));
    KB_CHECK(ctx, (reg->ninputs == 0 || ins) && (reg->noutputs == 0 || outs), KB_ERR_INVALID,
             "interp: ins or outs is NULL");
    for (int32_t i = 0; i < reg->ninputs; i++) {
        int32_t v = reg->inputs[i];
        KB_CHECK(ctx, v >= 0 && v < it.n && !(it.role[v] & ROLE_INPUT), KB_ERR_INVALID,
                 "interp: region %d input %d: bad or repeated value %d", (int)r, (int)i, (int)v);
        it.role[v] |= ROLE_INPUT;
    }
    for (int32_t k = 0; k < reg->nnodes; k++) {
        int32_t v = reg->nodes[k];
        KB_CHECK(ctx, v >= 0 && v < it.n && !(it.role[v] & ROLE_NODE), KB_ERR_INVALID,
                 "interp: region %d node %d: bad or repeated value %d", (int)r, (int)k, (int)v);
        it.role[v] |= ROLE_NODE;
    }
    for (int32_t k = 0; k < reg->nnodes; k++) {
        int32_t v = reg->nodes[k];
        if (it.role[v] & ROLE_INPUT) continue;  /* supplied by the caller, not computed here */
        KB_TRY(check_operands(&it, v));
        const kb_node *nd = kb_graph_node(it.g, v);
        for (int j = 0; j < nd->ninputs; j++) {
            int32_t u = nd->inputs[j];
            KB_CHECK(ctx, it.role[u] & (ROLE_NODE | ROLE_INPUT), KB_ERR_INVALID,
                     "interp: region %d: node %d reads value %d, which is neither in the region nor "
                     "one of its inputs", (int)r, (int)v, (int)u);
            it.refs[u]++;
        }
    }
    for (int32_t j = 0; j < reg->noutputs; j++) {
        int32_t v = reg->outputs[j];
        KB_CHECK(ctx, v >= 0 && v < it.n && (it.role[v] & (ROLE_NODE | ROLE_INPUT)), KB_ERR_INVALID,
                 "interp: region %d output %d (value %d) is not computed by the region", (int)r, (int)j, (int)v);
    }
    for (int32_t i = 0; i < reg->ninputs; i++) {
        int32_t v = reg->inputs[i];
        KB_TRY(load_value(&it, v, ins[i]));
        KB_TRY(store_outputs(&it, v, reg->outputs, reg->noutputs, outs));
        if (it.refs[v] == 0) release(&it, v);
    }
    for (int32_t k = 0; k < reg->nnodes; k++) {
        int32_t v = reg->nodes[k];
        if (it.role[v] & ROLE_INPUT) continue;
        KB_CHECK(ctx, kb_graph_node(it.g, v)->op != KB_OP_INPUT, KB_ERR_INVALID,
                 "interp: region %d holds graph input %d without listing it among its inputs", (int)r, (int)v);
        KB_TRY(eval_node(&it, v));
        KB_TRY(store_outputs(&it, v, reg->outputs, reg->noutputs, outs));
        finish(&it, v);
    }
cleanup:
    interp_done(&it);
    return st;
}
