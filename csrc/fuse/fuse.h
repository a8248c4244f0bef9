/* fuse.h — private to fuse/: the greedy pass's per-node assignment (fuse.c, after the pre-passes
 * of prepass.c), which partition.c assembles into a kb_partition (each region's nodes, inputs and
 * outputs). Nothing here is public API. */
#ifndef KBENCH_FUSE_H
#define KBENCH_FUSE_H

#include "core/internal.h"

enum { GR_NONE = 0, GR_SOME, GR_ONLY };

/* What a node is to the partitioner: the class its join rules (fuse.c) and pre-passes
 * (prepass.c) go by. */
enum node_class { C_POINTWISE, C_RESHAPE, C_EXPAND, C_VIEW, C_REDUCE, C_GATHER, C_EXTERN, C_LEAF, C_MATMUL };

static inline enum node_class fuse_classify(const kb_node *nd) {
    switch (kb_op_get(nd->op)->kind) {
    case KB_KIND_LEAF: return C_LEAF;
    case KB_KIND_UNARY:
    case KB_KIND_BINARY:
    case KB_KIND_TERNARY: return C_POINTWISE;
    case KB_KIND_REDUCE: return C_REDUCE;
    case KB_KIND_GATHER: return C_GATHER;
    case KB_KIND_EXTERN: return C_EXTERN;
    case KB_KIND_MATMUL: return C_MATMUL;
    case KB_KIND_VIEW:
        return nd->op == KB_OP_RESHAPE ? C_RESHAPE : nd->op == KB_OP_EXPAND ? C_EXPAND : C_VIEW;
    }
    return C_LEAF;
}

/* Pointwise work a GEMM applies as it loads an operand (a cast, a negation, a scale by a
 * constant): what may float into a GEMM region as its prologue (fuse.c, partition.c). */
int fuse_cheap_prologue(const kb_graph *g, int32_t v);

/* A value's level in its region (see fuse.c): none, one per element of the anchor, one per row
 * or column (a reduction's kept dims), or a ROW region's column sum. */
enum { LV_NONE = 0, LV_FULL, LV_STAT, LV_COLSUM };

typedef struct fuse_region {
    kb_region_kind kind;
    int32_t anchor;       /* value whose shape is the iteration space */
    uint32_t red;         /* reduce axes over the anchor's dims (ROW / COL) */
    int32_t extern_index; /* EXTERN: the Python callable */
} fuse_region;

/* The greedy pass's state and result: for each node, its region and level there, or floating
 * (copied into every region that reads it). */
typedef struct fuse_build {
    const kb_graph *g;
    kb_ctx *ctx;
    int32_t n;
    int32_t *reg;      /* region of each computed node, -1 */
    int8_t *lvl;       /* its level there */
    int8_t *floating;  /* 1: folded view / const / recomputed work, copied into its readers */
    int32_t *dep;      /* floating: the latest region whose output it reads (-1: inputs only) */
    uint8_t *fl;       /* floating: FL_* facts about what it reads */
    uint8_t *index_read; /* read only through static index maps (mark_index_reads) */
    uint8_t *lone_read;  /* from graph inputs alone, with one reader (mark_lone_reads) */
    uint8_t *input_work; /* pointwise work on at most two full-size graph inputs (mark_input_work) */
    uint8_t *gemm_read;  /* GR_*: read as a MATMUL's operand (through views), only so (mark_gemm_reads) */
    const uint8_t *cut;  /* NULL, or per node: 1 starts a region of its own (neither floats nor
                          * joins one): how partition.c splits a region past KB_MAX_PARAM_BYTES */
    fuse_region *regs;
    int32_t nreg, capreg;
} fuse_build;

/* Runs the greedy pass over g into *b (zeroed first; free with fuse_build_free, also after a
 * failure), with the nodes flagged in cut (NULL: none) each starting a region. Every region in
 * b->regs has at least one node or a floating anchor. */
kb_status fuse_assign(const kb_graph *g, const uint8_t *cut, fuse_build *b);
void fuse_build_free(fuse_build *b);

/* The pre-passes (prepass.c), over b's graph into b->index_read, lone_read, input_work and
 * gemm_read; KB_ERR_OOM if their scratch cannot be allocated. */
kb_status fuse_mark_reads(fuse_build *b);

#endif /* KBENCH_FUSE_H */
