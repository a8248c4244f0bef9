/* tgraph.h — terse graph building for the C tests: dims as text ("s0,4", "2*s0*s1", "" for a
 * scalar), and a builder that remembers its first failure so a test can add many nodes and
 * check once (the failing-allocator test relies on that). */
#ifndef KB_TEST_TGRAPH_H
#define KB_TEST_TGRAPH_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/kbench.h"

typedef struct tg {
    kb_graph *g;
    kb_status st;   /* first failure, KB_OK while all went well */
} tg;

/* Parses "4,s0,2*s0*s1" into n->rank and n->dims (symbols listed in id order). */
static inline void tg_dims(kb_node *n, const char *spec)
{
    n->rank = 0;
    const char *p = spec;
    while (*p) {
        kb_dim d = {1, 0, {0}};
        for (;;) {
            if (*p == 's') {
                long s = strtol(p + 1, (char **)&p, 10);
                d.sym[d.nsym++] = (uint8_t)s;
            } else {
                d.coef *= strtoll(p, (char **)&p, 10);
            }
            if (*p != '*') break;
            p++;
        }
        n->dims[n->rank++] = d;
        if (*p == ',') p++;
    }
}

static inline kb_node tg_tmpl(kb_op op, kb_dtype dt, const char *dims)
{
    kb_node n;
    memset(&n, 0, sizeof n);
    n.op = op;
    n.dtype = dt;
    n.step = 1;
    tg_dims(&n, dims);
    return n;
}

static inline int32_t tg_add(tg *t, const kb_node *n)
{
    int32_t id = -1;
    if (t->st == KB_OK) t->st = kb_graph_add(t->g, n, &id);
    return t->st == KB_OK ? id : -1;
}

static inline int32_t tg_input(tg *t, const char *name, kb_dtype dt, const char *dims)
{
    kb_node n = tg_tmpl(KB_OP_INPUT, dt, dims);
    n.name = name;
    return tg_add(t, &n);
}

/* A node with up to three operands (pass -1 for the unused ones). */
static inline int32_t tg_op(tg *t, kb_op op, kb_dtype dt, const char *dims, int32_t a, int32_t b, int32_t c)
{
    kb_node n = tg_tmpl(op, dt, dims);
    int32_t ops[3] = {a, b, c};
    for (int i = 0; i < 3 && ops[i] >= 0; i++) n.inputs[n.ninputs++] = ops[i];
    return tg_add(t, &n);
}

static inline int32_t tg_const(tg *t, kb_dtype dt, const char *dims, double v)
{
    kb_node n = tg_tmpl(KB_OP_CONST, dt, dims);
    n.scalar[0] = v;
    return tg_add(t, &n);
}

static inline int32_t tg_reduce(tg *t, kb_op op, kb_dtype dt, const char *dims, int32_t a, uint32_t axes)
{
    kb_node n = tg_tmpl(op, dt, dims);
    n.ninputs = 1;
    n.inputs[0] = a;
    n.axes = axes;
    return tg_add(t, &n);
}

static inline int32_t tg_permute(tg *t, kb_dtype dt, const char *dims, int32_t a, const int8_t *perm)
{
    kb_node n = tg_tmpl(KB_OP_PERMUTE, dt, dims);
    n.ninputs = 1;
    n.inputs[0] = a;
    memcpy(n.perm, perm, (size_t)n.rank);
    return tg_add(t, &n);
}

static inline int32_t tg_slice(tg *t, kb_dtype dt, const char *dims, int32_t a, int axis, int64_t start, int64_t step)
{
    kb_node n = tg_tmpl(KB_OP_SLICE, dt, dims);
    n.ninputs = 1;
    n.inputs[0] = a;
    n.axis = axis;
    n.start = start;
    n.step = step;
    return tg_add(t, &n);
}

static inline int32_t tg_gather(tg *t, kb_dtype dt, const char *dims, int32_t a, int32_t index, int axis)
{
    kb_node n = tg_tmpl(KB_OP_GATHER, dt, dims);
    n.ninputs = 2;
    n.inputs[0] = a;
    n.inputs[1] = index;
    n.axis = axis;
    return tg_add(t, &n);
}

static inline void tg_output(tg *t, int32_t v)
{
    if (t->st == KB_OK) t->st = kb_graph_add_output(t->g, v);
}

/* layer_norm over the last dim of x[rows, n] with weight and bias [n], decomposed the way
 * capture does it: mean, centre, mean of squares, rsqrt, scale, shift. Returns y's id. */
static inline int32_t tg_layernorm(tg *t, kb_dtype dt, const char *rows, const char *n, int32_t x,
                                   int32_t w, int32_t b, double eps)
{
    char full[64], keep[64], row1[64];
    snprintf(full, sizeof full, "%s,%s", rows, n);
    snprintf(keep, sizeof keep, "%s,1", rows);
    snprintf(row1, sizeof row1, "1,%s", n);
    int32_t mean = tg_reduce(t, KB_OP_MEAN, dt, keep, x, 2);
    int32_t xc = tg_op(t, KB_OP_SUB, dt, full, x, tg_op(t, KB_OP_EXPAND, dt, full, mean, -1, -1), -1);
    int32_t var = tg_reduce(t, KB_OP_MEAN, dt, keep, tg_op(t, KB_OP_MUL, dt, full, xc, xc, -1), 2);
    int32_t rs = tg_op(t, KB_OP_RSQRT, dt, keep, tg_op(t, KB_OP_ADD, dt, keep, var, tg_const(t, dt, keep, eps), -1), -1, -1);
    int32_t xn = tg_op(t, KB_OP_MUL, dt, full, xc, tg_op(t, KB_OP_EXPAND, dt, full, rs, -1, -1), -1);
    int32_t we = tg_op(t, KB_OP_EXPAND, dt, full, tg_op(t, KB_OP_RESHAPE, dt, row1, w, -1, -1), -1, -1);
    int32_t be = tg_op(t, KB_OP_EXPAND, dt, full, tg_op(t, KB_OP_RESHAPE, dt, row1, b, -1, -1), -1, -1);
    return tg_op(t, KB_OP_ADD, dt, full, tg_op(t, KB_OP_MUL, dt, full, xn, we, -1), be, -1);
}

/* softmax over the last dim of x[rows, n]: max, exp(x - max), sum, divide. */
static inline int32_t tg_softmax(tg *t, kb_dtype dt, const char *rows, const char *n, int32_t x)
{
    char full[64], keep[64];
    snprintf(full, sizeof full, "%s,%s", rows, n);
    snprintf(keep, sizeof keep, "%s,1", rows);
    int32_t m = tg_op(t, KB_OP_EXPAND, dt, full, tg_reduce(t, KB_OP_RMAX, dt, keep, x, 2), -1, -1);
    int32_t e = tg_op(t, KB_OP_EXP, dt, full, tg_op(t, KB_OP_SUB, dt, full, x, m, -1), -1, -1);
    int32_t s = tg_op(t, KB_OP_EXPAND, dt, full, tg_reduce(t, KB_OP_SUM, dt, keep, e, 2), -1, -1);
    return tg_op(t, KB_OP_DIV, dt, full, e, s, -1);
}

#endif /* KB_TEST_TGRAPH_H */
