/* int.c — integer index arithmetic, half of the expression layer of code generation (with
 * expr.c, which it calls back for float work). Gather indices and comparisons of coordinates
 * are evaluated as long long (never through float, which is exact only below 2^24), each with
 * the range of values it can take. A where() on a coordinate test generates each branch under a
 * guard: the branch's loads read only where it is selected, and clamps the guard implies drop
 * out. x.chunk(2)'s backward, where(a1 < H, g0[min(a1, H-1)], g1[max(a1 - H, 0)]), so reads g0
 * at a1 and g1 at a1 - H, contiguous along the chunk: vector loads. */
#include "codegen/codegen.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

static const kb_node *NODE(const cg *c, int32_t v) { return kb_graph_node(c->g, v); }

static int64_t sat(int64_t x) { return x > CG_BIG ? CG_BIG : x < -CG_BIG ? -CG_BIG : x; }
/* |a|, |b| <= 2^60: the sum cannot overflow before it saturates */
static int64_t add_sat(int64_t a, int64_t b) { return sat(a + b); }

static int is_int_dtype(kb_dtype t) { return t == KB_I64 || t == KB_I32; }

static void set_unknown(cg_int *r) {
    r->lo = -CG_BIG;
    r->hi = CG_BIG;
    r->var[0] = '\0';
    r->off = 0;
}

/* e = var + off, spelled as vector_base() reads it: "a1" or "(a1 + -4096)" */
static void spell_affine(cg *c, cg_int *r) {
    if (r->off == 0) cg_fmt(c, r->e, EXPR_LEN, "%s", r->var);
    else cg_fmt(c, r->e, EXPR_LEN, "(%s + %" PRId64 ")", r->var, r->off);
}

/* The variable guards test: the chunk's last coordinate a<last>, or its first element's a<last>_0 */
static void guard_var(const cg *c, int chunk_first, char *out) {
    snprintf(out, NAME_LEN, chunk_first ? "a%d_0" : "a%d", c->last);
}

/* the guard's variable ranges over [lo, hi) */
static void clip_to_guard(const cg *c, cg_int *r) {
    char gv[NAME_LEN];
    guard_var(c, 0, gv);
    if (!c->guard.on || strcmp(r->var, gv) != 0) return;
    int64_t lo = add_sat(c->guard.lo, r->off), hi = add_sat(c->guard.hi - 1, r->off);
    if (lo > r->lo) r->lo = lo;
    if (hi < r->hi) r->hi = hi;
}

static void int_binary(cg *c, const kb_node *nd, const cg_int *a, const cg_int *b, cg_int *r) {
    set_unknown(r);
    r->mask = a->mask | b->mask;
    int a_const = a->lo == a->hi, b_const = b->lo == b->hi;
    switch (nd->op) {
    case KB_OP_ADD:
    case KB_OP_SUB: {
        int sub = nd->op == KB_OP_SUB;
        r->lo = sub ? add_sat(a->lo, -b->hi) : add_sat(a->lo, b->lo);
        r->hi = sub ? add_sat(a->hi, -b->lo) : add_sat(a->hi, b->hi);
        if (a->var[0] && b_const) { /* affine stays affine: the spelling vector loads look for */
            snprintf(r->var, NAME_LEN, "%s", a->var);
            r->off = a->off + (sub ? -b->lo : b->lo);
            spell_affine(c, r);
        } else if (b->var[0] && a_const && !sub) {
            snprintf(r->var, NAME_LEN, "%s", b->var);
            r->off = b->off + a->lo;
            spell_affine(c, r);
        } else {
            cg_fmt(c, r->e, EXPR_LEN, "(%s %c %s)", a->e, sub ? '-' : '+', b->e);
        }
        return;
    }
    case KB_OP_MUL:
        if (a_const || b_const) { /* by a constant: the bounds scale where they are known */
            int64_t k = a_const ? a->lo : b->lo;
            const cg_int *x = a_const ? b : a;
            if (llabs(k) < (1 << 20) && x->lo > -CG_BIG && x->hi < CG_BIG && llabs(x->lo) < CG_BIG >> 20 &&
                llabs(x->hi) < CG_BIG >> 20) {
                int64_t p = x->lo * k, q = x->hi * k;
                r->lo = p < q ? p : q;
                r->hi = p < q ? q : p;
            }
        }
        cg_fmt(c, r->e, EXPR_LEN, "(%s * %s)", a->e, b->e);
        return;
    case KB_OP_MIN:
    case KB_OP_MAX: {
        int mn = nd->op == KB_OP_MIN;
        /* the range settles it: min(a1, 4095) where a1 < 4096 is a1 */
        if (mn ? a->hi <= b->lo : a->lo >= b->hi) {
            *r = *a;
            return;
        }
        if (mn ? b->hi <= a->lo : b->lo >= a->hi) {
            *r = *b;
            return;
        }
        r->lo = mn ? (a->lo < b->lo ? a->lo : b->lo) : (a->lo > b->lo ? a->lo : b->lo);
        r->hi = mn ? (a->hi < b->hi ? a->hi : b->hi) : (a->hi > b->hi ? a->hi : b->hi);
        cg_fmt(c, r->e, EXPR_LEN, "%s(%s, %s)", mn ? "min" : "max", a->e, b->e);
        return;
    }
    default:
        break;
    }
}

/* An integer value at x, as a long long expression with its range. */
void cg_ev_int(cg *c, int32_t v, const idx *x, cg_int *r) {
    const kb_node *nd = NODE(c, v);
    const kb_op_info *info = kb_op_get(nd->op);
    set_unknown(r);
    r->mask = 0;
    if (c->st != KB_OK) {
        snprintf(r->e, EXPR_LEN, "0LL");
        return;
    }
    if (nd->op == KB_OP_CONST && nd->scalar[0] == floor(nd->scalar[0]) && fabs(nd->scalar[0]) < (double)CG_BIG) {
        r->lo = r->hi = (int64_t)nd->scalar[0];
        cg_fmt(c, r->e, EXPR_LEN, "%" PRId64 "LL", r->lo);
        return;
    }
    if (nd->op == KB_OP_IOTA) {
        idx y;
        cg_to_comps(c, nd, x, &y);
        kb_dim d = nd->dims[nd->axis];
        r->mask = y.mask[nd->axis];
        r->lo = 0;
        r->hi = d.nsym ? CG_BIG : d.coef - 1;
        if (cg_parse_affine(y.e[nd->axis], r->var, &r->off)) {
            /* the coordinate is var + off: the guard on var bounds it */
            clip_to_guard(c, r);
            spell_affine(c, r);
        } else {
            cg_fmt(c, r->e, EXPR_LEN, "%s", y.e[nd->axis]);
        }
        return;
    }
    if (c->member[v] && info->kind == KB_KIND_VIEW) {
        idx u;
        cg_view_map(c, nd, x, &u);
        cg_ev_int(c, nd->inputs[0], &u, r);
        return;
    }
    if (!c->member[v] && c->in_slot[v] >= 0) { /* an index tensor read from memory */
        char lin[EXPR_LEN], ref[EXPR_LEN];
        uint32_t m = 0;
        cg_to_lin(c, nd, x, lin, &m);
        cg_guarded_ref(c, v, lin, ref);
        cg_fmt(c, r->e, EXPR_LEN, "(long long)%s", ref);
        r->mask = m | CG_DATA;
        return;
    }
    if (c->member[v] && is_int_dtype(nd->dtype)) {
        if ((info->kind == KB_KIND_BINARY && (nd->op == KB_OP_ADD || nd->op == KB_OP_SUB || nd->op == KB_OP_MUL ||
                                              nd->op == KB_OP_MIN || nd->op == KB_OP_MAX)) ||
            nd->op == KB_OP_NEG || nd->op == KB_OP_CAST) {
            const kb_node *in0 = NODE(c, nd->inputs[0]);
            int ints = is_int_dtype(in0->dtype);
            if (info->kind == KB_KIND_BINARY) ints = ints && is_int_dtype(NODE(c, nd->inputs[1])->dtype);
            if (ints) {
                cg_int a, b;
                cg_ev_int(c, nd->inputs[0], x, &a);
                if (nd->op == KB_OP_CAST) {
                    *r = a;
                    return;
                }
                if (nd->op == KB_OP_NEG) {
                    r->mask = a.mask;
                    r->lo = -a.hi;
                    r->hi = -a.lo;
                    cg_fmt(c, r->e, EXPR_LEN, "(-%s)", a.e);
                    return;
                }
                cg_ev_int(c, nd->inputs[1], x, &b);
                int_binary(c, nd, &a, &b, r);
                return;
            }
        }
    }
    /* anything else (float work, a cast from float): through the float evaluator */
    char e[EXPR_LEN];
    cg_ev(c, v, x, e);
    cg_fmt(c, r->e, EXPR_LEN, "(long long)(%s)", e);
    r->mask = cg_all_bits(c) | CG_DATA;
}

/* ---------------------------------------------------------------- comparisons and guards */

static int is_compare(kb_op op) {
    return op == KB_OP_LT || op == KB_OP_LE || op == KB_OP_GT || op == KB_OP_GE || op == KB_OP_EQ || op == KB_OP_NE;
}

/* A comparison of two integers as a float 0/1 expression, settled by the ranges where they do
 * (a1 < 4096 under a guard a1 < 4096 is 1). 0 if the operands are not integers. */
int cg_int_compare(cg *c, const kb_node *nd, const idx *x, char *out) {
    if (!is_compare(nd->op) || !is_int_dtype(NODE(c, nd->inputs[0])->dtype) ||
        !is_int_dtype(NODE(c, nd->inputs[1])->dtype))
        return 0;
    cg_int a, b;
    cg_ev_int(c, nd->inputs[0], x, &a);
    cg_ev_int(c, nd->inputs[1], x, &b);
    int known = -1; /* -1 unknown, else the answer */
    switch (nd->op) {
    case KB_OP_LT: known = a.hi < b.lo ? 1 : a.lo >= b.hi ? 0 : -1; break;
    case KB_OP_LE: known = a.hi <= b.lo ? 1 : a.lo > b.hi ? 0 : -1; break;
    case KB_OP_GT: known = a.lo > b.hi ? 1 : a.hi <= b.lo ? 0 : -1; break;
    case KB_OP_GE: known = a.lo >= b.hi ? 1 : a.hi < b.lo ? 0 : -1; break;
    case KB_OP_EQ: known = (a.hi < b.lo || b.hi < a.lo) ? 0 : -1; break;
    case KB_OP_NE: known = (a.hi < b.lo || b.hi < a.lo) ? 1 : -1; break;
    default: break;
    }
    const char *sym = nd->op == KB_OP_LT ? "<" : nd->op == KB_OP_LE ? "<=" : nd->op == KB_OP_GT ? ">" :
                      nd->op == KB_OP_GE ? ">=" : nd->op == KB_OP_EQ ? "==" : "!=";
    if (known >= 0 && !(a.mask & CG_DATA) && !(b.mask & CG_DATA)) cg_fmt(c, out, EXPR_LEN * 4, "%s", known ? "1.0f" : "0.0f");
    else cg_fmt(c, out, EXPR_LEN * 4, "(%s)(%s %s %s)", c->ct, a.e, sym, b.e);
    return 1;
}

/* The value as a constant (lo == hi) or a coordinate plus a constant (var set), read from the
 * graph alone (nothing emitted, no guard applied); 0 for anything else. */
static int int_form(cg *c, int32_t v, const idx *x, cg_int *r) {
    const kb_node *nd = NODE(c, v);
    set_unknown(r);
    if (nd->op == KB_OP_CONST) {
        if (nd->scalar[0] != floor(nd->scalar[0]) || fabs(nd->scalar[0]) >= (double)CG_BIG) return 0;
        r->lo = r->hi = (int64_t)nd->scalar[0];
        return 1;
    }
    if (nd->op == KB_OP_IOTA) {
        idx y;
        cg_to_comps(c, nd, x, &y);
        return cg_parse_affine(y.e[nd->axis], r->var, &r->off);
    }
    if (!c->member[v]) return 0;
    if (kb_op_get(nd->op)->kind == KB_KIND_VIEW) {
        idx u;
        cg_view_map(c, nd, x, &u);
        return int_form(c, nd->inputs[0], &u, r);
    }
    if (nd->op == KB_OP_CAST && is_int_dtype(nd->dtype) && is_int_dtype(NODE(c, nd->inputs[0])->dtype))
        return int_form(c, nd->inputs[0], x, r);
    if ((nd->op == KB_OP_ADD || nd->op == KB_OP_SUB) && is_int_dtype(nd->dtype)) {
        cg_int a, b;
        if (!int_form(c, nd->inputs[0], x, &a) || !int_form(c, nd->inputs[1], x, &b)) return 0;
        int sub = nd->op == KB_OP_SUB;
        if (a.var[0] && !b.var[0]) {
            *r = a;
            r->off = a.off + (sub ? -b.lo : b.lo);
            return 1;
        }
        if (!a.var[0] && b.var[0] && !sub) {
            *r = b;
            r->off = b.off + a.lo;
            return 1;
        }
        if (!a.var[0] && !b.var[0]) {
            r->lo = r->hi = sub ? a.lo - b.lo : a.lo + b.lo;
            return 1;
        }
    }
    return 0;
}

/* cond is "var + off  <op>  K" (or K <op> var + off) with var the chunk's last coordinate:
 * the interval of var where it holds, and where it does not; 0 otherwise. */
static int coord_test(cg *c, int32_t cond, const idx *x, cg_guard *t, cg_guard *f) {
    const kb_node *nd = NODE(c, cond);
    char gv[NAME_LEN];
    guard_var(c, 0, gv);
    if (nd->op == KB_OP_AND) {
        cg_guard t1, f1, t2, f2;
        if (!coord_test(c, nd->inputs[0], x, &t1, &f1) || !coord_test(c, nd->inputs[1], x, &t2, &f2)) return 0;
        *t = (cg_guard){1, t1.lo > t2.lo ? t1.lo : t2.lo, t1.hi < t2.hi ? t1.hi : t2.hi};
        *f = (cg_guard){0, -CG_BIG, CG_BIG}; /* not an interval: the false side is not guarded */
        return 1;
    }
    if (!is_compare(nd->op) || nd->op == KB_OP_EQ || nd->op == KB_OP_NE) return 0;
    if (!is_int_dtype(NODE(c, nd->inputs[0])->dtype) || !is_int_dtype(NODE(c, nd->inputs[1])->dtype)) return 0;
    cg_int a, b;
    if (!int_form(c, nd->inputs[0], x, &a) || !int_form(c, nd->inputs[1], x, &b)) return 0;
    kb_op op = nd->op;
    if (b.var[0] && a.lo == a.hi && !a.var[0]) { /* K op x  ->  x op' K */
        cg_int s = a;
        a = b, b = s;
        op = op == KB_OP_LT ? KB_OP_GT : op == KB_OP_LE ? KB_OP_GE : op == KB_OP_GT ? KB_OP_LT : KB_OP_LE;
    }
    if (strcmp(a.var, gv) != 0 || b.lo != b.hi || b.var[0]) return 0;
    int64_t k = b.lo - a.off; /* var op k */
    int64_t split = op == KB_OP_LT ? k : op == KB_OP_LE ? k + 1 : op == KB_OP_GT ? k + 1 : k;
    int below = op == KB_OP_LT || op == KB_OP_LE; /* true for var < split */
    cg_guard lo_side = {1, -CG_BIG, split}, hi_side = {1, split, CG_BIG};
    *t = below ? lo_side : hi_side;
    *f = below ? hi_side : lo_side;
    return 1;
}

static cg_guard meet(cg_guard a, cg_guard b) {
    if (!a.on) return b;
    if (!b.on) return a;
    return (cg_guard){1, a.lo > b.lo ? a.lo : b.lo, a.hi < b.hi ? a.hi : b.hi};
}

/* Where-branch guards for where(cond, ...) at x: 1 with the guards of the true and the false
 * branch (meets with the guard already in force) where cond tests the chunk's last coordinate
 * of a POINTWISE kernel; else 0 and both branches are generated as they are. */
int cg_where_guards(cg *c, int32_t cond, const idx *x, cg_guard *t, cg_guard *f) {
    if (c->rg->kind != KB_REGION_POINTWISE || !c->in_element || c->arank == 0) return 0;
    if (!coord_test(c, cond, x, t, f)) return 0;
    *t = meet(c->guard, *t);
    *f = meet(c->guard, *f);
    return 1;
}

int cg_guard_empty(const cg_guard *g) { return g->on && g->lo >= g->hi; }

/* The guard as a C condition over the coordinate var (a1) or the chunk's first (a1_0). */
static void guard_expr(cg *c, const char *var, char *out) {
    const cg_guard *g = &c->guard;
    if (g->lo > -CG_BIG && g->hi < CG_BIG)
        cg_fmt(c, out, EXPR_LEN, "(%s >= %" PRId64 " && %s < %" PRId64 ")", var, g->lo, var, g->hi);
    else if (g->lo > -CG_BIG) cg_fmt(c, out, EXPR_LEN, "(%s >= %" PRId64 ")", var, g->lo);
    else if (g->hi < CG_BIG) cg_fmt(c, out, EXPR_LEN, "(%s < %" PRId64 ")", var, g->hi);
    else cg_fmt(c, out, EXPR_LEN, "true");
}

/* The condition a whole chunk shares (its bounds are whole vectors), or 0. */
int cg_chunk_guard(cg *c, char *out) {
    const cg_guard *g = &c->guard;
    if (!g->on || !c->aligned || c->vec <= 1) return 0;
    if ((g->lo > -CG_BIG && g->lo % c->vec) || (g->hi < CG_BIG && g->hi % c->vec)) return 0;
    char var[NAME_LEN];
    guard_var(c, 1, var);
    guard_expr(c, var, out);
    return 1;
}

/* p<v>[lin], read only where the guard holds (element 0, always there, elsewhere) */
void cg_guarded_ref(cg *c, int32_t v, const char *lin, char *out) {
    if (!c->guard.on) {
        cg_fmt(c, out, EXPR_LEN, "p%d[%s]", (int)v, lin);
        return;
    }
    char var[NAME_LEN], ge[EXPR_LEN];
    guard_var(c, 0, var);
    guard_expr(c, var, ge);
    cg_fmt(c, out, EXPR_LEN, "p%d[%s ? %s : 0]", (int)v, ge, lin);
}
