/* grad_build.c — the graph builder autodiff emits through (nodes hash-consed on op, operands and
 * fields) and a tiny recursive-descent evaluator for ops.def's derivative rules ("mul(g,y)"),
 * whose helpers expand in the same language. */
#include "grad/grad_build.h"

#include <math.h>
#include <stdlib.h>

/* ---------------------------------------------------------------- a graph builder with CSE */

/* Ops whose scalars mean something (their CUDA template reads $p0 / $p1). */
static int uses_scalar(kb_op op, int k)
{
    return strstr(kb_op_get(op)->cuda, k ? "$p1" : "$p0") != NULL;
}

/* Zeroes every field the op does not read, so equal nodes compare equal field by field. */
static void canonicalize(kb_node *n)
{
    kb_op_kind kind = kb_op_get(n->op)->kind;
    for (int d = 0; d < KB_MAX_RANK; d++) {
        if (d >= n->rank) memset(&n->dims[d], 0, sizeof n->dims[d]);
        else
            for (int i = n->dims[d].nsym; i < KB_MAX_DIM_SYMS; i++) n->dims[d].sym[i] = 0;
        if (n->op != KB_OP_PERMUTE || d >= n->rank) n->perm[d] = 0;
    }
    for (int i = n->ninputs; i < KB_MAX_INPUTS; i++) n->inputs[i] = 0;
    for (int k = 0; k < 2; k++)
        if (!uses_scalar(n->op, k)) n->scalar[k] = 0.0;
    if (kind != KB_KIND_REDUCE) n->axes = 0;
    if (n->op != KB_OP_SLICE && n->op != KB_OP_GATHER && n->op != KB_OP_IOTA) n->axis = 0;
    if (n->op != KB_OP_SLICE) n->start = 0, n->step = 1;
}

static uint64_t mix(uint64_t h, uint64_t v)
{
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h;
}

static uint64_t node_hash(const kb_node *n)
{
    uint64_t h = mix((uint64_t)n->op, (uint64_t)n->dtype), bits;
    h = mix(h, (uint64_t)n->rank);
    for (int i = 0; i < n->ninputs; i++) h = mix(h, (uint64_t)(uint32_t)n->inputs[i]);
    for (int d = 0; d < n->rank; d++) {
        h = mix(h, (uint64_t)n->dims[d].coef);
        for (int i = 0; i < n->dims[d].nsym; i++) h = mix(h, n->dims[d].sym[i]);
        h = mix(h, (uint64_t)(uint8_t)n->perm[d]);
    }
    for (int k = 0; k < 2; k++) {
        memcpy(&bits, &n->scalar[k], sizeof bits);
        h = mix(h, bits);
    }
    h = mix(h, n->axes);
    h = mix(h, (uint64_t)n->axis);
    h = mix(h, (uint64_t)n->start);
    return mix(h, (uint64_t)n->step);
}

/* Both canonical: compare what canonicalize() kept (names and INPUT fields are not keys). */
static int node_same(const kb_node *a, const kb_node *b)
{
    if (a->op != b->op || a->dtype != b->dtype || a->rank != b->rank || a->ninputs != b->ninputs ||
        a->axes != b->axes || a->axis != b->axis || a->start != b->start || a->step != b->step)
        return 0;
    if (memcmp(a->inputs, b->inputs, sizeof(int32_t) * (size_t)a->ninputs) != 0) return 0;
    if (memcmp(a->scalar, b->scalar, sizeof a->scalar) != 0) return 0;  /* bitwise: NaN == NaN */
    for (int d = 0; d < a->rank; d++)
        if (!kb_dim_equal(a->dims[d], b->dims[d]) || a->perm[d] != b->perm[d]) return 0;
    return 1;
}

static kb_status table_grow(gb_builder *b)
{
    int32_t ncap = b->tcap ? b->tcap * 2 : 256;
    int32_t *t = kb_malloc(b->ctx, sizeof(int32_t) * (size_t)ncap);
    if (!t) return KB_ERR_OOM;
    for (int32_t i = 0; i < ncap; i++) t[i] = -1;
    for (int32_t i = 0; i < b->tcap; i++) {
        int32_t id = b->table[i];
        if (id < 0) continue;
        uint32_t s = (uint32_t)node_hash(kb_graph_node(b->g, id)) & (uint32_t)(ncap - 1);
        while (t[s] >= 0) s = (s + 1) & (uint32_t)(ncap - 1);
        t[s] = id;
    }
    kb_free(b->ctx, b->table, sizeof(int32_t) * (size_t)b->tcap);
    b->table = t;
    b->tcap = ncap;
    return KB_OK;
}

void gb_done(gb_builder *b)
{
    kb_free(b->ctx, b->table, sizeof(int32_t) * (size_t)b->tcap);
    kb_graph_free(b->g);
    memset(b, 0, sizeof *b);
}

/* Adds tmpl (or finds its twin). INPUT nodes are never merged: each is a distinct argument. */
kb_status gb_emit(gb_builder *b, const kb_node *tmpl, int32_t *id)
{
    kb_node n = *tmpl;
    if (n.op == KB_OP_INPUT) return kb_graph_add(b->g, &n, id);
    canonicalize(&n);
    if ((b->tcount + 1) * 2 > b->tcap) {
        kb_status st = table_grow(b);
        if (st != KB_OK) return st;
    }
    uint32_t mask = (uint32_t)(b->tcap - 1), s = (uint32_t)node_hash(&n) & mask;
    for (; b->table[s] >= 0; s = (s + 1) & mask)
        if (node_same(kb_graph_node(b->g, b->table[s]), &n)) {
            *id = b->table[s];
            return KB_OK;
        }
    kb_status st = kb_graph_add(b->g, &n, id);
    if (st != KB_OK) return st;
    b->table[s] = *id;
    b->tcount++;
    return KB_OK;
}

kb_node gb_tmpl(kb_op op, kb_dtype dt, int32_t rank, const kb_dim *dims) {
    return kb_node_template(op, dt, rank, dims);
}

const kb_node *gb_node(const gb_builder *b, int32_t id) { return kb_graph_node(b->g, id); }

kb_status gb_const(gb_builder *b, kb_dtype dt, int32_t rank, const kb_dim *dims, double v, int32_t *id)
{
    kb_node n = gb_tmpl(KB_OP_CONST, dt, rank, dims);
    n.scalar[0] = v;
    return gb_emit(b, &n, id);
}

kb_status gb_cast(gb_builder *b, int32_t x, kb_dtype dt, int32_t *id)
{
    const kb_node *nx = gb_node(b, x);
    if (nx->dtype == dt) {
        *id = x;
        return KB_OK;
    }
    kb_node n = gb_tmpl(KB_OP_CAST, dt, nx->rank, nx->dims);
    n.inputs[0] = x;
    n.ninputs = 1;
    return gb_emit(b, &n, id);
}

/* Does perm swap the last two of rank dims and keep the others? */
static int swaps_last_two(const int8_t *perm, int32_t rank)
{
    if (rank < 2 || perm[rank - 2] != rank - 1 || perm[rank - 1] != rank - 2) return 0;
    for (int d = 0; d < rank - 2; d++)
        if (perm[d] != d) return 0;
    return 1;
}

/* A permute of x, where x is itself a permute (the two compose into one, the identity into none)
 * or a MATMUL whose last two dims it swaps ((a . b)^T = b^T . a^T: a weight's gradient, dW^T,
 * computed as a product of transposed operands instead of a product copied into a transpose). */
static kb_status permute_of(gb_builder *b, int32_t x, int32_t rank, const kb_dim *dims, const int8_t *perm,
                            int32_t *id)
{
    const kb_node *nx = gb_node(b, x);
    if (nx->op == KB_OP_PERMUTE) {
        int8_t both[KB_MAX_RANK];
        int ident = 1;
        for (int d = 0; d < rank; d++) {
            both[d] = nx->perm[perm[d]];
            ident &= both[d] == d;
        }
        int32_t src = nx->inputs[0];
        if (ident) {
            *id = src;
            return KB_OK;
        }
        return gb_shaped(b, KB_OP_PERMUTE, src, rank, dims, 0, both, id);
    }
    if (nx->op == KB_OP_MATMUL && swaps_last_two(perm, rank)) {
        kb_status st = KB_OK;
        int32_t xa = nx->inputs[0], xb = nx->inputs[1], at, bt;
        kb_dtype dt = nx->dtype;
        const kb_node *na = gb_node(b, xa), *nb = gb_node(b, xb);
        kb_dim ad[KB_MAX_RANK], bd[KB_MAX_RANK];
        memcpy(ad, na->dims, sizeof ad);
        memcpy(bd, nb->dims, sizeof bd);
        ad[rank - 2] = na->dims[rank - 1], ad[rank - 1] = na->dims[rank - 2];
        bd[rank - 2] = nb->dims[rank - 1], bd[rank - 1] = nb->dims[rank - 2];
        KB_TRY(gb_shaped(b, KB_OP_PERMUTE, xb, rank, bd, 0, perm, &bt));
        KB_TRY(gb_shaped(b, KB_OP_PERMUTE, xa, rank, ad, 0, perm, &at));
        kb_node t = gb_tmpl(KB_OP_MATMUL, dt, rank, dims);
        t.inputs[0] = bt;
        t.inputs[1] = at;
        t.ninputs = 2;
        KB_TRY(gb_emit(b, &t, id));
    cleanup:
        return st;
    }
    kb_node n = gb_tmpl(KB_OP_PERMUTE, nx->dtype, rank, dims);
    n.inputs[0] = x;
    n.ninputs = 1;
    memcpy(n.perm, perm, (size_t)rank);
    return gb_emit(b, &n, id);
}

/* An index map or reduction of x to the given shape; dims equal to x's make it a no-op. */
kb_status gb_shaped(gb_builder *b, kb_op op, int32_t x, int32_t rank, const kb_dim *dims, uint32_t axes,
                    const int8_t *perm, int32_t *id)
{
    const kb_node *nx = gb_node(b, x);
    if (op == KB_OP_PERMUTE && perm) return permute_of(b, x, rank, dims, perm, id);
    if ((op == KB_OP_RESHAPE || op == KB_OP_EXPAND) && nx->rank == rank) {
        int same = 1;
        for (int d = 0; d < rank; d++) same &= kb_dim_equal(nx->dims[d], dims[d]);
        if (same) {
            *id = x;
            return KB_OK;
        }
    }
    kb_node n = gb_tmpl(op, nx->dtype, rank, dims);
    n.inputs[0] = x;
    n.ninputs = 1;
    n.axes = axes;
    if (perm) memcpy(n.perm, perm, (size_t)rank);
    return gb_emit(b, &n, id);
}

/* Comparisons and logic produce bool in the IR; everything else produces the compute dtype. */
static int is_predicate(kb_op op)
{
    return op == KB_OP_LT || op == KB_OP_LE || op == KB_OP_GT || op == KB_OP_GE || op == KB_OP_EQ ||
           op == KB_OP_NE || op == KB_OP_AND || op == KB_OP_OR || op == KB_OP_NOT;
}

/* x op CONST(value) == x (or CONST op x == x for slot 0): rewrites kept as a table. Only exact
 * identities: mul by 0 is not one (NaN, Inf), and -0 + 0 differs only in the sign of zero. */
static const struct { kb_op op; int const_slot; double value; } identities[] = {
    {KB_OP_MUL, 0, 1.0}, {KB_OP_MUL, 1, 1.0}, {KB_OP_ADD, 0, 0.0},
    {KB_OP_ADD, 1, 0.0}, {KB_OP_SUB, 1, 0.0}, {KB_OP_DIV, 1, 1.0},
};

static int is_const(const gb_builder *b, int32_t id, double v)
{
    const kb_node *n = gb_node(b, id);
    return n->op == KB_OP_CONST && n->scalar[0] == v;
}

/* A pointwise op over operands of one shape, computed in the float dtype fd. Convention: every
 * arithmetic operand (all but where's condition and the operands of and/or/not) is cast to fd
 * first, so a bool comparison multiplied into a gradient becomes cast(bool -> fd). */
kb_status gb_pw(gb_builder *b, kb_op op, kb_dtype fd, const int32_t *args, int nargs, int32_t *id)
{
    kb_status st = KB_OK;
    int32_t x[3];
    int logic = op == KB_OP_AND || op == KB_OP_OR || op == KB_OP_NOT;
    for (int i = 0; i < nargs; i++) {
        if (logic || (op == KB_OP_WHERE && i == 0)) x[i] = args[i];
        else KB_TRY(gb_cast(b, args[i], fd, &x[i]));
    }
    for (size_t r = 0; r < sizeof identities / sizeof identities[0]; r++)
        if (identities[r].op == op && nargs == 2 && is_const(b, x[identities[r].const_slot], identities[r].value)) {
            *id = x[1 - identities[r].const_slot];
            return KB_OK;
        }
    if (op == KB_OP_NEG && gb_node(b, x[0])->op == KB_OP_NEG &&
        gb_node(b, gb_node(b, x[0])->inputs[0])->dtype == fd) {
        *id = gb_node(b, x[0])->inputs[0];
        return KB_OK;
    }
    const kb_node *shape = gb_node(b, x[nargs > 1 ? 1 : 0]);
    kb_node n = gb_tmpl(op, is_predicate(op) ? KB_BOOL : fd, shape->rank, shape->dims);
    memcpy(n.inputs, x, sizeof(int32_t) * (size_t)nargs);
    n.ninputs = nargs;
    st = gb_emit(b, &n, id);
cleanup:
    return st;
}

kb_status gb_bin(gb_builder *b, kb_op op, kb_dtype fd, int32_t x, int32_t y, int32_t *id)
{
    int32_t args[2] = {x, y};
    return gb_pw(b, op, fd, args, 2, id);
}

/* ---------------------------------------------------------------- the rule language */

/* Helpers named in ops.def rules, expanded in the same language; `a` is the helper's argument.
 * Repeated sub-terms cost nothing: gb_emit() merges them. */
static const struct { const char *name; const char *body; } helpers[] = {
    /* tanh(sqrt(2/pi) * (x + 0.044715 x^3)), the inner term of the tanh approximation */
    {"gelu_tanh_t", "tanh(mul(0.7978845608028654,add(a,mul(0.044715,mul(a,mul(a,a))))))"},
    /* d/dx 0.5 x (1 + t) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3*0.044715 x^2) (torch's) */
    {"gelu_tanh_grad", "add(mul(0.5,add(1,gelu_tanh_t(a))),mul(mul(mul(0.5,a),sub(1,mul(gelu_tanh_t(a),"
                       "gelu_tanh_t(a)))),mul(0.7978845608028654,add(1,mul(0.134145,mul(a,a))))))"},
    /* tanh(softplus(x)) with the forward's threshold at 20 */
    {"mish_t", "tanh(where(gt(a,20),a,log1p(exp(a))))"},
    /* d/dx x tanh(sp(x)) = t + x sigmoid(x) (1 - t^2), as torch computes it */
    {"mish_grad", "add(mish_t(a),mul(mul(a,sigmoid(a)),sub(1,mul(mish_t(a),mish_t(a)))))"},
};


void gb_skip_ws(const char **s)
{
    while (**s == ' ') (*s)++;
}

kb_status gb_rule_error(gb_rule_env *e, const char *at, const char *what)
{
    return KB_FAIL(e->b->ctx, KB_ERR_INVALID, "grad rule \"%s\" at offset %d: %s", e->rule,
                   (int)(at - e->rule), what);
}


static kb_status eval_call(gb_rule_env *e, const char *name, size_t len, const char **s, int32_t *out)
{
    kb_status st = KB_OK;
    int32_t args[3];
    int nargs = 0;
    (*s)++; /* '(' */
    for (;;) {
        if (nargs == 3) return gb_rule_error(e, *s, "more than 3 arguments");
        KB_TRY(gb_eval_expr(e, s, &args[nargs++]));
        gb_skip_ws(s);
        if (**s == ')') break;
        if (**s != ',') return gb_rule_error(e, *s, "expected ',' or ')'");
        (*s)++;
    }
    (*s)++;
    char nm[32];
    if (len >= sizeof nm) return gb_rule_error(e, *s, "name too long");
    memcpy(nm, name, len);
    nm[len] = '\0';
    for (size_t h = 0; h < sizeof helpers / sizeof helpers[0]; h++) {
        if (strcmp(helpers[h].name, nm) != 0) continue;
        if (nargs != 1) return gb_rule_error(e, *s, "helpers take one argument");
        if (e->depth > 16) return gb_rule_error(e, *s, "helpers nest too deeply");
        gb_rule_env inner = *e;
        inner.g = inner.y = -1;
        inner.opd[0] = args[0];
        inner.opd[1] = inner.opd[2] = -1;
        inner.rule = helpers[h].body;
        inner.depth = e->depth + 1;
        const char *body = helpers[h].body;
        KB_TRY(gb_eval_expr(&inner, &body, out));
        if (*body) return gb_rule_error(&inner, body, "trailing text");
        return KB_OK;
    }
    int op = kb_op_from_name(nm);
    if (op < 0) return gb_rule_error(e, name, "unknown op or helper");
    kb_op_kind kind = kb_op_get((kb_op)op)->kind;
    if ((kind != KB_KIND_UNARY && kind != KB_KIND_BINARY && kind != KB_KIND_TERNARY) ||
        kb_op_get((kb_op)op)->arity != nargs || uses_scalar((kb_op)op, 0))
        return gb_rule_error(e, name, "not a scalar-free pointwise op with that many operands");
    st = gb_pw(e->b, (kb_op)op, e->fd, args, nargs, out);
cleanup:
    return st;
}

/* expr := number | g | y | a | b | c | p0 | p1 | name '(' expr (',' expr)* ')' */
kb_status gb_eval_expr(gb_rule_env *e, const char **s, int32_t *out)
{
    gb_skip_ws(s);
    const char *at = *s;
    if ((*at >= '0' && *at <= '9') || *at == '-' || *at == '.') {
        char *end;
        double v = strtod(at, &end);
        if (end == at) return gb_rule_error(e, at, "bad number");
        *s = end;
        return gb_const(e->b, e->fd, e->rank, e->dims, v, out);
    }
    size_t len = 0;
    while ((at[len] >= 'a' && at[len] <= 'z') || (at[len] >= '0' && at[len] <= '9') || at[len] == '_') len++;
    if (len == 0) return gb_rule_error(e, at, "expected a name or a number");
    *s = at + len;
    if (**s == '(') return eval_call(e, at, len, s, out);
    int32_t v = -2;
    if (len == 1) {
        switch (at[0]) {
        case 'g': v = e->g; break;
        case 'y': v = e->y; break;
        case 'a': v = e->opd[0]; break;
        case 'b': v = e->opd[1]; break;
        case 'c': v = e->opd[2]; break;
        default: break;
        }
    } else if (len == 2 && at[0] == 'p' && (at[1] == '0' || at[1] == '1')) {
        return gb_const(e->b, e->fd, e->rank, e->dims, e->p[at[1] - '0'], out);
    }
    if (v == -2) return gb_rule_error(e, at, "unknown variable");
    if (v < 0) return gb_rule_error(e, at, "variable not available here");
    *out = v;
    return KB_OK;
}
