/* index.c — the index layer of code generation: the iteration space of a kernel (its anchor's
 * dims as variables a0, a1, ..., the chunks of vec along the last), and an index into any value
 * of the region, in components or linear, rewritten through views (permute, expand, slice,
 * reshape) so that views move no data. */
#include "codegen/codegen.h"

#include <inttypes.h>
#include <stdlib.h>

static const kb_node *NODE(const cg *c, int32_t v) { return kb_graph_node(c->g, v); }
static int is_one(kb_dim d) { return d.coef == 1 && d.nsym == 0; }

int cg_same_dims(const kb_node *a, int rank, const kb_dim *dims) {
    if (a->rank != rank) return 0;
    for (int d = 0; d < rank; d++)
        if (!kb_dim_equal(a->dims[d], dims[d])) return 0;
    return 1;
}

/* coef * prod(symbols) of the dims in mask, as C */
static void prod_expr(cg *c, const kb_dim *dims, int rank, uint32_t mask, char *out) {
    int64_t coef = 1;
    int n = 0;
    uint8_t syms[KB_MAX_RANK * KB_MAX_DIM_SYMS];
    for (int d = 0; d < rank; d++) {
        if (!(mask & (1u << d))) continue;
        coef *= dims[d].coef;
        for (int i = 0; i < dims[d].nsym; i++) {
            int j = n++;
            while (j > 0 && syms[j - 1] > dims[d].sym[i]) {
                syms[j] = syms[j - 1];
                j--;
            }
            syms[j] = dims[d].sym[i];
        }
    }
    if (n == 0 || coef == 0) {
        cg_fmt(c, out, EXPR_LEN, "%" PRId64, n == 0 ? coef : 0);
        return;
    }
    char buf[EXPR_LEN];
    size_t len = 0;
    buf[0] = '\0';
    if (coef != 1) len += (size_t)snprintf(buf, sizeof buf, "%" PRId64, coef);
    for (int i = 0; i < n && len < sizeof buf; i++)
        len += (size_t)snprintf(buf + len, sizeof buf - len, "%ss%d", len ? "*" : "", syms[i]);
    if (n == 1 && coef == 1) cg_fmt(c, out, EXPR_LEN, "%s", buf);
    else cg_fmt(c, out, EXPR_LEN, "(%s)", buf);
}

void cg_dim_expr(cg *c, kb_dim d, char *out) { prod_expr(c, &d, 1, 1u, out); }

void cg_extent(cg *c, int which, char out[EXPR_LEN]) {
    uint32_t all = c->arank ? (uint32_t)((1ull << c->arank) - 1) : 0;
    uint32_t mask = c->rg->kind == KB_REGION_POINTWISE ? all : which ? c->red : (all & ~c->red);
    prod_expr(c, c->adims, c->arank, mask, out);
}

int cg_numel_is(cg *c, int32_t v, int stat) {
    const kb_node *nd = NODE(c, v);
    uint32_t all = c->arank ? (uint32_t)((1ull << c->arank) - 1) : 0;
    kb_monomial a, b;
    kb_monomial_of(c->adims, c->arank, stat ? (all & ~c->red) : all, &a);
    kb_monomial_of(nd->dims, nd->rank, ~0u, &b);
    return kb_monomial_equal(&a, &b);
}

/* ---------------------------------------------------------------- the iteration space */

static void aname(const cg *c, int d, int chunk_base, char *out) {
    if (chunk_base && d == c->last && c->aligned) snprintf(out, NAME_LEN, "a%d_0", d);
    else snprintf(out, NAME_LEN, "a%d", d);
}

void cg_decl_vars(cg *c, const char *src, uint32_t mask, int chunk_base) {
    int ds[KB_MAX_RANK], nd = 0;
    for (int d = 0; d < c->arank; d++)
        if ((mask & (1u << d)) && !is_one(c->adims[d])) ds[nd++] = d;
    for (int j = 0; j < nd; j++) {
        uint32_t after = 0;
        for (int q = j + 1; q < nd; q++) after |= 1u << ds[q];
        char st[EXPR_LEN], size[EXPR_LEN], e[EXPR_LEN], name[NAME_LEN];
        prod_expr(c, c->adims, c->arank, after, st);
        cg_dim_expr(c, c->adims[ds[j]], size);
        int unit = strcmp(st, "1") == 0;
        if (nd == 1) cg_fmt(c, e, sizeof e, "%s", src);
        else if (j == 0) cg_fmt(c, e, sizeof e, unit ? "%s" : "%s / %s", src, st);
        else if (unit) cg_fmt(c, e, sizeof e, "%s %% %s", src, size);
        else cg_fmt(c, e, sizeof e, "(%s / %s) %% %s", src, st, size);
        aname(c, ds[j], chunk_base && c->vec > 1, name);
        cg_line(c, "const long long %s = %s;", name, e);
    }
}

/* Σ a<d> * stride<d> over the anchor's dims (the anchor's own linear index) */
static void anchor_lin(cg *c, int chunk_base, char *out) {
    char buf[EXPR_LEN] = "";
    size_t len = 0;
    uint32_t all = c->arank ? (uint32_t)((1ull << c->arank) - 1) : 0;
    for (int d = 0; d < c->arank; d++) {
        if (is_one(c->adims[d])) continue;
        char st[EXPR_LEN], name[NAME_LEN];
        prod_expr(c, c->adims, c->arank, all & ~((2u << d) - 1), st);
        aname(c, d, chunk_base, name);
        len += (size_t)snprintf(buf + len, sizeof buf - len, "%s%s%s%s", len ? " + " : "", name,
                                strcmp(st, "1") ? " * " : "", strcmp(st, "1") ? st : "");
        if (len >= sizeof buf) {
            cg_fail(c, "the anchor's index is too long");
            break;
        }
    }
    cg_fmt(c, out, EXPR_LEN, "(%s)", len ? buf : "0");
}

void cg_set_space_vec(cg *c) {
    kb_region_kind kind = c->rg->kind;
    c->kvar = c->vec > 1 ? "k" : "0";
    /* chunks of vec along the last dim start on whole vectors: a pinned last dim divisible by vec,
       or (ROW, COL) a varying one, which the kernel then requires to be a multiple of vec at
       every launch (guard_last: kb_kernel.last_multiple; POINTWISE handles tails instead) */
    c->aligned = c->guard_last = 0;
    if (c->vec > 1 && c->arank > 0) {
        kb_dim l = c->adims[c->last];
        if (l.nsym == 0) c->aligned = l.coef % c->vec == 0;
        else if (kind != KB_REGION_POINTWISE) c->aligned = c->guard_last = 1;
    }
    c->full_vec_ok = c->vec > 1 && (kind == KB_REGION_POINTWISE || c->aligned);
    c->stat_lin[0] = '\0';
    if (kind == KB_REGION_POINTWISE) {
        snprintf(c->full_lin, EXPR_LEN, "i");
        snprintf(c->full_lin0, EXPR_LEN, "%s", c->base ? c->base : "i0");
    } else if (c->trailing) {
        int row = kind == KB_REGION_ROW;
        snprintf(c->full_lin, EXPR_LEN, row ? "(rb + c)" : "(ob + col)");
        snprintf(c->full_lin0, EXPR_LEN, row ? "(rb + c0)" : "(ob + col0)");
    } else {
        anchor_lin(c, 0, c->full_lin);
        anchor_lin(c, 1, c->full_lin0);
    }
    if (kind == KB_REGION_ROW) snprintf(c->stat_lin, sizeof c->stat_lin, "row");
    if (kind == KB_REGION_COL) snprintf(c->stat_lin, sizeof c->stat_lin, "col");
}

/* Is dim d a multiple of vec at every size the kernel runs at? A pinned d divisible by it, or
 * (under guard_last) a multiple of the anchor's guarded last dim: its coefficient a multiple of
 * the last dim's and the last dim's symbols among its own. */
int cg_vec_multiple(const cg *c, kb_dim d) {
    if (d.nsym == 0) return d.coef % c->vec == 0;
    if (!c->guard_last) return 0;
    kb_dim l = c->adims[c->last];
    if (l.coef == 0 || d.coef % l.coef != 0) return 0;
    for (int i = 0, j = 0; i < l.nsym; i++, j++) { /* both sorted: l's symbols a sub-multiset of d's */
        while (j < d.nsym && d.sym[j] < l.sym[i]) j++;
        if (j == d.nsym || d.sym[j] != l.sym[i]) return 0;
    }
    return 1;
}

/* ---------------------------------------------------------------- indices */

uint32_t cg_all_bits(const cg *c) { return c->arank ? (uint32_t)((1ull << c->arank) - 1) : 0; }

static void canon_full(const cg *c, idx *x) {
    x->lin = 0;
    x->rank = c->arank;
    for (int d = 0; d < c->arank; d++) {
        if (is_one(c->adims[d])) {
            strcpy(x->e[d], "0");
            x->mask[d] = 0;
        } else {
            snprintf(x->e[d], EXPR_LEN, "a%d", d);
            x->mask[d] = 1u << d;
        }
    }
}

/* v has the shape of a per-row (per-column) statistic: keepdim (1 on reduced axes) or not */
int cg_stat_shape(const cg *c, const kb_node *nd, int *keep) {
    if (c->rg->kind == KB_REGION_POINTWISE) return 0;
    if (nd->rank == c->arank) {
        for (int d = 0; d < c->arank; d++) {
            if (c->red & (1u << d)) {
                if (!is_one(nd->dims[d])) goto nokeep;
            } else if (!kb_dim_equal(nd->dims[d], c->adims[d])) {
                goto nokeep;
            }
        }
        *keep = 1;
        return 1;
    }
nokeep:
    if (nd->rank != c->arank - kb_popcount32(c->red)) return 0;
    for (int d = 0, o = 0; d < c->arank; d++) {
        if (c->red & (1u << d)) continue;
        if (!kb_dim_equal(nd->dims[o++], c->adims[d])) return 0;
    }
    *keep = 0;
    return 1;
}

static void canon_stat(const cg *c, const kb_node *nd, int keep, idx *x) {
    x->lin = 0;
    x->rank = nd->rank;
    for (int d = 0, o = 0; d < c->arank; d++) {
        int reduced = (c->red >> d) & 1;
        if (reduced && !keep) continue;
        if (reduced || is_one(c->adims[d])) {
            strcpy(x->e[o], "0");
            x->mask[o] = 0;
        } else {
            snprintf(x->e[o], EXPR_LEN, "a%d", d);
            x->mask[o] = 1u << d;
        }
        o++;
    }
}

static int comps_equal(const idx *a, const idx *b) {
    if (a->lin || b->lin || a->rank != b->rank) return 0;
    for (int d = 0; d < a->rank; d++)
        if (strcmp(a->e[d], b->e[d])) return 0;
    return 1;
}

void cg_set_lin(idx *x, const char *e, uint32_t mask) {
    x->lin = 1;
    x->rank = 1;
    snprintf(x->e[0], EXPR_LEN, "%s", e);
    x->mask[0] = mask;
}

/* Canonical forms get canonical keys: the current element / the current row or column. */
void cg_normalize(cg *c, const kb_node *nd, idx *x) {
    if (x->lin) return;
    idx can;
    int keep;
    if (c->in_element && cg_same_dims(nd, c->arank, c->adims)) {
        canon_full(c, &can);
        if (comps_equal(x, &can)) {
            cg_set_lin(x, c->full_lin, cg_all_bits(c));
            return;
        }
    }
    if (cg_stat_shape(c, nd, &keep)) {
        canon_stat(c, nd, keep, &can);
        if (comps_equal(x, &can)) cg_set_lin(x, c->stat_lin, cg_all_bits(c) & ~c->red);
    }
}

void cg_to_comps(cg *c, const kb_node *nd, const idx *in, idx *out) {
    int keep;
    if (!in->lin) {
        *out = *in;
        return;
    }
    if (c->in_element && strcmp(in->e[0], c->full_lin) == 0 && cg_same_dims(nd, c->arank, c->adims)) {
        canon_full(c, out);
        return;
    }
    if (c->stat_lin[0] && strcmp(in->e[0], c->stat_lin) == 0 && cg_stat_shape(c, nd, &keep)) {
        canon_stat(c, nd, keep, out);
        return;
    }
    /* generic: divide the linear index down the value's dims */
    out->lin = 0;
    out->rank = nd->rank;
    int first = -1, nonone = 0;
    for (int d = 0; d < nd->rank; d++)
        if (!is_one(nd->dims[d])) {
            if (first < 0) first = d;
            nonone++;
        }
    uint32_t all = nd->rank ? (uint32_t)((1ull << nd->rank) - 1) : 0;
    for (int d = 0; d < nd->rank; d++) {
        out->mask[d] = in->mask[0];
        if (is_one(nd->dims[d])) {
            strcpy(out->e[d], "0");
            out->mask[d] = 0;
            continue;
        }
        char st[EXPR_LEN], size[EXPR_LEN];
        prod_expr(c, nd->dims, nd->rank, all & ~((2u << d) - 1), st);
        cg_dim_expr(c, nd->dims[d], size);
        int unit = strcmp(st, "1") == 0;
        if (nonone == 1) cg_fmt(c, out->e[d], EXPR_LEN, "%s", in->e[0]);
        else if (d == first) cg_fmt(c, out->e[d], EXPR_LEN, unit ? "%s" : "(%s / %s)", in->e[0], st);
        else if (unit) cg_fmt(c, out->e[d], EXPR_LEN, "(%s %% %s)", in->e[0], size);
        else cg_fmt(c, out->e[d], EXPR_LEN, "((%s / %s) %% %s)", in->e[0], st, size);
    }
}

/* the value's row-major linear index */
void cg_to_lin(cg *c, const kb_node *nd, const idx *in, char *out, uint32_t *mask) {
    if (in->lin) {
        cg_fmt(c, out, EXPR_LEN, "%s", in->e[0]);
        if (mask) *mask = in->mask[0];
        return;
    }
    idx x = *in;
    cg_normalize(c, nd, &x);
    if (x.lin) {
        cg_fmt(c, out, EXPR_LEN, "%s", x.e[0]);
        if (mask) *mask = x.mask[0];
        return;
    }
    char buf[EXPR_LEN] = "";
    size_t len = 0;
    uint32_t m = 0, all = nd->rank ? (uint32_t)((1ull << nd->rank) - 1) : 0;
    int terms = 0;
    for (int d = 0; d < nd->rank; d++) {
        if (strcmp(x.e[d], "0") == 0) continue;
        char st[EXPR_LEN];
        prod_expr(c, nd->dims, nd->rank, all & ~((2u << d) - 1), st);
        int unit = strcmp(st, "1") == 0;
        len += (size_t)snprintf(buf + len, sizeof buf - len, "%s%s%s%s", len ? " + " : "", x.e[d], unit ? "" : " * ",
                                unit ? "" : st);
        if (len >= sizeof buf) {
            cg_fail(c, "an index expression is too long");
            break;
        }
        m |= x.mask[d];
        terms++;
    }
    if (terms == 0) cg_fmt(c, out, EXPR_LEN, "0");
    else if (terms == 1) cg_fmt(c, out, EXPR_LEN, "%s", buf);
    else cg_fmt(c, out, EXPR_LEN, "(%s)", buf);
    if (mask) *mask = m;
}

/* a component "a1" or "(a1 + 12)" as var + off; 0 if it is anything else */
int cg_parse_affine(const char *e, char *var, int64_t *off) {
    const char *p = e;
    int paren = *p == '(';
    if (paren) p++;
    if (*p != 'a') return 0;
    size_t n = 1;
    while (p[n] >= '0' && p[n] <= '9') n++;
    if (n == 1 || n >= NAME_LEN) return 0;
    memcpy(var, p, n);
    var[n] = '\0';
    p += n;
    if (!paren) {
        *off = 0;
        return *p == '\0';
    }
    if (strncmp(p, " + ", 3) != 0) return 0;
    char *end;
    long long k = strtoll(p + 3, &end, 10);
    if (end == p + 3 || strcmp(end, ")") != 0) return 0;
    *off = k;
    return 1;
}

/* The index of a view's operand, given the view's index (views move no data). */
void cg_view_map(cg *c, const kb_node *nd, const idx *ix, idx *out) {
    const kb_node *u = NODE(c, nd->inputs[0]);
    if (nd->op == KB_OP_RESHAPE) {
        if (ix->lin) {
            *out = *ix;
            return;
        }
        /* squeeze / unsqueeze: the same non-1 dims in the same order keep their components */
        int a[KB_MAX_RANK], b[KB_MAX_RANK], na = 0, nb = 0, same = 1;
        for (int d = 0; d < nd->rank; d++)
            if (!is_one(nd->dims[d])) a[na++] = d;
        for (int d = 0; d < u->rank; d++)
            if (!is_one(u->dims[d])) b[nb++] = d;
        if (na != nb) same = 0;
        for (int i = 0; same && i < na; i++) same = kb_dim_equal(nd->dims[a[i]], u->dims[b[i]]);
        if (same) {
            out->lin = 0;
            out->rank = u->rank;
            for (int d = 0; d < u->rank; d++) {
                strcpy(out->e[d], "0");
                out->mask[d] = 0;
            }
            for (int i = 0; i < na; i++) {
                strcpy(out->e[b[i]], ix->e[a[i]]);
                out->mask[b[i]] = ix->mask[a[i]];
            }
            return;
        }
        char lin[EXPR_LEN];
        uint32_t m;
        cg_to_lin(c, nd, ix, lin, &m);
        cg_set_lin(out, lin, m);
        return;
    }
    idx x;
    cg_to_comps(c, nd, ix, &x);
    *out = x;
    out->lin = 0;
    out->rank = u->rank;
    if (nd->op == KB_OP_PERMUTE) {
        for (int d = 0; d < nd->rank; d++) {
            strcpy(out->e[(int)nd->perm[d]], x.e[d]);
            out->mask[(int)nd->perm[d]] = x.mask[d];
        }
    } else if (nd->op == KB_OP_EXPAND) {
        for (int d = 0; d < nd->rank; d++)
            if (is_one(u->dims[d])) {
                strcpy(out->e[d], "0");
                out->mask[d] = 0;
            }
    } else if (nd->op == KB_OP_SLICE) {
        int a = nd->axis;
        const char *e = x.e[a];
        if (strcmp(e, "0") == 0) cg_fmt(c, out->e[a], EXPR_LEN, "%" PRId64, nd->start);
        else if (nd->step == 1 && nd->start == 0) cg_fmt(c, out->e[a], EXPR_LEN, "%s", e);
        else if (nd->step == 1) {
            char var[NAME_LEN];
            int64_t off;
            if (cg_parse_affine(e, var, &off)) /* (a1 + -4096) + 4096 is a1: one spelling per position */
                cg_fmt(c, out->e[a], EXPR_LEN, off + nd->start ? "(%s + %" PRId64 ")" : "%s", var, off + nd->start);
            else
                cg_fmt(c, out->e[a], EXPR_LEN, "(%s + %" PRId64 ")", e, nd->start);
        }
        else if (nd->start == 0) cg_fmt(c, out->e[a], EXPR_LEN, "(%s * %" PRId64 ")", e, nd->step);
        else cg_fmt(c, out->e[a], EXPR_LEN, "(%s * %" PRId64 " + %" PRId64 ")", e, nd->step, nd->start);
    }
}
