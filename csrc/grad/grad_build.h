/* grad_build.h — private to grad.c and grad_build.c: the graph builder autodiff emits through
 * (hash-consed, so asking twice for a value gives the existing node) and the small language of
 * ops.def's derivative rules. Nothing here is public API. */
#ifndef KBENCH_GRAD_BUILD_H
#define KBENCH_GRAD_BUILD_H

#include "core/internal.h"

/* Every node of the work graph goes through gb_emit(), which hash-conses it: a rule that asks for
 * sigmoid(a) twice, or for a forward value that exists already, gets the existing node. */
typedef struct gb_builder {
    kb_ctx *ctx;
    kb_graph *g;
    int32_t *table;   /* open addressing over node ids, -1 = empty */
    int32_t tcap;     /* a power of two */
    int32_t tcount;
} gb_builder;

void gb_done(gb_builder *b);
kb_status gb_emit(gb_builder *b, const kb_node *tmpl, int32_t *id);
kb_node gb_tmpl(kb_op op, kb_dtype dt, int32_t rank, const kb_dim *dims);
const kb_node *gb_node(const gb_builder *b, int32_t id);
kb_status gb_const(gb_builder *b, kb_dtype dt, int32_t rank, const kb_dim *dims, double v, int32_t *id);
kb_status gb_cast(gb_builder *b, int32_t x, kb_dtype dt, int32_t *id);
kb_status gb_shaped(gb_builder *b, kb_op op, int32_t x, int32_t rank, const kb_dim *dims, uint32_t axes,
                    const int8_t *perm, int32_t *id);
/* pointwise op on operands of one shape, folding identities (x * 1, x + 0) */
kb_status gb_pw(gb_builder *b, kb_op op, kb_dtype fd, const int32_t *args, int nargs, int32_t *id);
kb_status gb_bin(gb_builder *b, kb_op op, kb_dtype fd, int32_t x, int32_t y, int32_t *id);

/* One rule of ops.def evaluated for one node: its operands, output and upstream adjoint. */
typedef struct gb_rule_env {
    gb_builder *b;
    kb_dtype fd;          /* compute dtype: the differentiated node's */
    int32_t rank;         /* shape of every value in a pointwise rule: the node's */
    const kb_dim *dims;
    int32_t g, y;         /* upstream adjoint, node output (-1 inside a helper body) */
    int32_t opd[3];       /* a, b, c */
    double p[2];          /* p0, p1 */
    const char *rule;     /* the whole rule, for messages */
    int depth;
} gb_rule_env;

void gb_skip_ws(const char **s);
kb_status gb_rule_error(gb_rule_env *e, const char *at, const char *what);
/* the value of the rule text at *s (advanced past it) */
kb_status gb_eval_expr(gb_rule_env *e, const char **s, int32_t *out);

#endif /* KBENCH_GRAD_BUILD_H */
