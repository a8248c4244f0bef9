/* codegen.h — private to codegen/: the generator's state, the renderer (target descriptor, in the
 * spirit of tinygrad's cstyle renderer), and each layer's functions. Nothing here is public API.
 *
 * The files are layered; a file calls functions of its own layer and of the layers below it,
 * never of one above (tests/test_c_core.py reads the layer lines below and checks the calls):
 *   emit -> index -> expression -> chunk -> kernel -> source
 * where emit writes text, index rewrites indices through views, expression makes a value at an
 * index into a C variable (loads, arithmetic, integer indices and guards), chunk is the element
 * loop of one chunk with its per-row statistics and the row cache plan, kernel the skeleton of a
 * POINTWISE / ROW / COL kernel (or a tensor-core GEMM, gemm.c), and source assembles the file (preamble, parameters, entry
 * points). */
#ifndef KBENCH_CODEGEN_H
#define KBENCH_CODEGEN_H

#include "core/internal.h"

#define EXPR_LEN 512
#define NAME_LEN 64
#define KEY_LEN 1200
#define CG_DATA (1u << 31) /* an index component that depends on loaded data (gather) */
#define CG_BIG ((int64_t)1 << 60) /* an unknown bound of an integer's range */

typedef struct renderer {
    const char *kernel_prefix; /* extern "C" __global__ void */
    const char *launch_bounds; /* printf format over the block size */
    const char *barrier;
    const char *shfl_xor;      /* printf format over the value; the lane offset is o */
    const char *restrict_kw;
    const char *smem_decl;     /* the dynamic shared memory array kb_smem */
} renderer;

/* An index into a value: either one linear (row-major) index, or one component per dim.
 * mask: which anchor dims (bit d = variable a<d>) a component depends on, CG_DATA for loaded
 * data; for the linear form mask[0] covers the whole expression. */
typedef struct idx {
    int lin;
    int rank;
    uint32_t mask[KB_MAX_RANK];
    char e[KB_MAX_RANK][EXPR_LEN];
} idx;

typedef struct cg_ent { /* a value already computed at an index, visible in scopes >= scope */
    int32_t v;
    int scope;
    char key[KEY_LEN];
    char var[NAME_LEN];
} cg_ent;

typedef struct cg_vreq { /* a vector load hoisted in front of the element loop of a chunk */
    int32_t v;
    int smem;     /* read from the row cache in shared memory */
    int fill;     /* also store the vector into the row cache */
    char base[EXPR_LEN];
    char guard[EXPR_LEN]; /* read only where this holds for the chunk (zeros elsewhere); "" always */
    char name[NAME_LEN];
} cg_vreq;

/* An integer at an index (int.c): a long long expression, the range [lo, hi] it lies in
 * (CG_BIG: unknown), what it depends on, and var + off when it is a coordinate plus a constant. */
typedef struct cg_int {
    char e[EXPR_LEN];
    int64_t lo, hi;
    uint32_t mask;
    char var[NAME_LEN];
    int64_t off;
} cg_int;

/* The where() branch being generated is selected only where the chunk's last coordinate
 * a<last> lies in [lo, hi) (int.c); loads outside it read nothing. */
typedef struct cg_guard {
    int on;
    int64_t lo, hi;
} cg_guard;

typedef struct cg {
    kb_ctx *ctx;
    const kb_partition *p;
    const kb_graph *g;
    const kb_region *rg;
    int32_t r;
    kb_genome gn;
    const renderer *rd;
    kb_status st;
    char name[64];
    int dbl;            /* compute in double (the region touches f64) */
    const char *ct;     /* "float" / "double" */
    int use_bf16, use_f16;
    /* the iteration space: the anchor's dims, reduced axes, how chunks of vec map onto it */
    int arank, last;
    kb_dim adims[KB_MAX_RANK];
    uint32_t red;
    int trailing;       /* ROW: reduced dims are the trailing ones; COL: the leading ones */
    int red_pinned;
    int vec, aligned, full_vec_ok;
    int guard_last;     /* aligned over a varying last dim: launches check it is a multiple of vec */
    const char *base;   /* chunk's first position ("i0", "c0", "col0") */
    const char *kvar;   /* element index inside a chunk: "k", or "0" when vec == 1 */
    char full_lin[EXPR_LEN], full_lin0[EXPR_LEN], stat_lin[16];
    int in_element;
    /* membership, by value id */
    int32_t n;
    uint8_t *member;
    int32_t *in_slot;
    int8_t *dp;         /* latest reduction pass a value depends on */
    uint8_t *pure;      /* a function of reductions and constants only (no loads) */
    uint8_t *written;   /* per value: the kernel's text stores it (an output with none fails) */
    /* passes and the row cache */
    int npasses, pass, maxred, nred_total, col_split;
    /* ROW with row_split > 1: blocks per row (1: none). The main kernel reduces one part of a row
     * per block to partials (kernel.c's emit_row_split_body), the finishing kernel merges a row's
     * partials and writes its outputs, each block its part (cg_emit_row_split_finish) */
    int split;
    int G, U;
    int dry;
    uint32_t *uses;     /* per value: passes that evaluate it at the canonical element */
    uint32_t *reads;    /* per value: passes that read it back from the row cache */
    int8_t *cached;     /* per value: held in the row cache from its first pass on */
    int8_t *fill_pass;
    int32_t *smem_off;
    int inputs_only;    /* registers hold inputs only (intermediates did not fit) */
    int replan;         /* the plan asks for another round with inputs_only */
    int saving;         /* a ROW region with saved statistics: one body, two entry points */
    /* two_pass=0: max M and sum(exp(y - M)) S in one pass (online softmax normalizer) */
    int32_t *partner;   /* M -> S, else -1 */
    int32_t *online_of; /* S -> M, else -1 */
    int has_online;
    /* ... and with the row in registers (cache=regs), each thread first takes the max of its own
     * elements, then exp(y - that max) once per element into ol<S>[u][k] (kept: a later pass
     * reads exp(y - M) as ol<S> * olc<S>), and the pairs merge once per row (online_local) */
    int online_local;
    /* ROW: column sums (sums over the rows, COLSUM in fuse/fuse.c) kept as per-thread partials */
    uint8_t *colsum;    /* 1: a column sum; 2: a reshape of one (same elements) */
    int32_t colsums[KB_MAX_COLSUMS];
    int ncolsum;
    int smem_bytes;
    /* ROW with a capped grid (each block loops over many rows): the first pass's loads of a row
     * are issued one row ahead into registers pf<v>[u], so they are in flight while the block
     * reduces the row before (cg_prefetch_rows) */
    int prefetch;       /* pipelining on for this kernel */
    int pf_pass;        /* the pass that reads pf (the first one emitted); -1 until known */
    int32_t pf[16];     /* the inputs loaded ahead */
    int npf;
    /* ... and the per-row inputs the first pass reads (a backward's saved mean and rstd): pfs<v>
     * holds the next row's value, rs<v> this row's (a load of them at the start of each row
     * would stall its first pass on a DRAM round trip) */
    int32_t ps[16];
    int nps;
    /* emission */
    kb_sb *out;
    int ind, scope, counter;
    cg_ent *ents;
    int nents, capents;
    cg_vreq vr[64];
    int nvr;
    cg_guard guard;     /* POINTWISE: the where() branch being generated (off outside one) */
} cg;

/* ================================ layer 0: emit (emit.c) */

void cg_failf(cg *c, kb_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
void cg_fail(cg *c, const char *what); /* KB_ERR_UNSUPPORTED */
/* snprintf that turns truncation into a failure instead of wrong code */
void cg_fmt(cg *c, char *dst, size_t n, const char *f, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
/* one indented line of the kernel (nothing in a dry run) */
void cg_line(cg *c, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void cg_scope_push(cg *c);
void cg_scope_pop(cg *c);
/* a dtype in memory ("__nv_bfloat16"), and the formats converting it to and from compute */
const char *cg_storage(kb_dtype t);
const char *cg_load_fmt(kb_dtype t);
const char *cg_store_fmt(kb_dtype t);

/* ================================ layer 1: index (index.c) */

uint32_t cg_all_bits(const cg *c);
int cg_same_dims(const kb_node *a, int rank, const kb_dim *dims);
void cg_dim_expr(cg *c, kb_dim d, char *out);
/* which = 0: full extent (POINTWISE) / kept extent (ROW rows, COL columns); 1: reduced extent */
void cg_extent(cg *c, int which, char out[EXPR_LEN]);
/* numel of v equals the kept extent (stat=1) or the full extent (stat=0) symbolically */
int cg_numel_is(cg *c, int32_t v, int stat);
/* declares a<d> for the anchor dims in mask, decomposed from the linear position src */
void cg_decl_vars(cg *c, const char *src, uint32_t mask, int chunk_base);
void cg_set_space_vec(cg *c);
/* d is a multiple of vec wherever the kernel runs (pinned, or a multiple of the guarded last dim) */
int cg_vec_multiple(const cg *c, kb_dim d);
int cg_stat_shape(const cg *c, const kb_node *nd, int *keep);
void cg_set_lin(idx *x, const char *e, uint32_t mask);
/* canonical forms (the current element, row or column) to their linear spelling */
void cg_normalize(cg *c, const kb_node *nd, idx *x);
void cg_to_comps(cg *c, const kb_node *nd, const idx *in, idx *out);
void cg_to_lin(cg *c, const kb_node *nd, const idx *in, char *out, uint32_t *mask);
/* a component "a1" or "(a1 + 12)" as var + off; 0 if it is anything else */
int cg_parse_affine(const char *e, char *var, int64_t *off);
void cg_view_map(cg *c, const kb_node *nd, const idx *ix, idx *out);

/* ================================ layer 2: expression (expr.c, int.c) */

/* expr.c: a value at an index as a C variable, and the pieces around it */
void cg_ev(cg *c, int32_t v, const idx *ix, char *out);
/* the value an output stores, before the store's own conversion */
void cg_ev_store(cg *c, int32_t v, const idx *ix, char *out);
void cg_bind(cg *c, int32_t v, const idx *x, const char *var);
/* int.c: integer indices with ranges, and where() branches under guards */
void cg_ev_int(cg *c, int32_t v, const idx *x, cg_int *r);
int cg_int_compare(cg *c, const kb_node *nd, const idx *x, char *out);
int cg_where_guards(cg *c, int32_t cond, const idx *x, cg_guard *t, cg_guard *f);
int cg_guard_empty(const cg_guard *g);
int cg_chunk_guard(cg *c, char *out);
void cg_guarded_ref(cg *c, int32_t v, const char *lin, char *out);

/* ================================ layer 3: chunk (chunk.c) */

/* one chunk: vector loads, the element loop (reductions, FULL outputs), vector stores */
void cg_chunk(cg *c, const int32_t *reds, int nred, const int32_t *outs, int nout, const int32_t *csums, int ncs);
void cg_bind_stat(cg *c, int32_t reduce);
void cg_eager_stats(cg *c, int pass);
void cg_stat_outputs(cg *c);
void cg_saved_stat_store(cg *c, int32_t v);
/* an output written per element (else per row / column) */
int cg_out_full(cg *c, int32_t v);
void cg_prefetch_rows(cg *c, const char *row, const char *why);
void cg_prefetch_type(cg *c, int32_t v, char *T, size_t n);
/* the row cache: stage 0 after a dry run without caching; stage 1 after one with it (drops
 * unread caches) */
kb_status cg_plan_cache(cg *c, int stage);
void cg_smem_pointers(cg *c);
void cg_regs_arrays(cg *c);
/* ROW column sums: the register partials, the per-block write-out, the finishing kernel */
void cg_colsum_decl(cg *c);
void cg_colsum_store(cg *c);
void cg_colsum_finish(cg *c);

/* ================================ layer 4: kernel (kernel.c, split.c, gemm.c) */

/* gemm.c: the tensor-core GEMM kernels (kb_gemm_generate, core/internal.h); its epilogue is a hook
 * the source layer fills for a GEMM region */

/* dp[v] and the passes of a ROW / COL region (and its online normalizers) */
void cg_plan_passes(cg *c);
/* the pass that writes FULL output v: the first one after the reductions it depends on */
int cg_pass_of_output(const cg *c, int32_t v);
/* the kernel's body for the region's kind (into c->out) */
void cg_emit_body(cg *c);
/* the finishing kernel's body of a COL region with col_split > 1 */
void cg_emit_col_finish(cg *c);
/* row_split > 1: the mean m whose squares about it reduction v sums (v = sum or mean of
 * (y - m)^2 with m = mean(y) of the first pass), which a split row merges with Chan's formula;
 * -1 for any other v */
int32_t cg_split_center(const cg *c, int32_t v);
/* split.c: the main kernel's body (cg_emit_body calls it) and the finishing kernel's body of a
 * ROW region with row_split > 1 */
void cg_emit_row_split_body(cg *c);
void cg_emit_row_split_finish(cg *c);

/* kernel.c's row machinery, shared with split.c: how each reduction starts, combines and
 * reduces across a warp; the loop over a row's chunks; the cross-thread reduction of a pass;
 * online softmax's local sums; the reductions and FULL outputs of a pass (freed by
 * cg_free_pass_lists; 0 where there are none) */
struct cg_red_render {
    kb_op op;
    const char *init;    /* identity, as a function of the compute type */
    const char *combine; /* %s = accumulator, %s = value */
    const char *warp;    /* helper name */
};
const struct cg_red_render *cg_red_of(kb_op op);
void cg_row_chunk_loop_open(cg *c);
void cg_row_chunk_loop_close(cg *c);
void cg_row_group_reduce(cg *c, const int32_t *reds, int nred);
void cg_online_local_sums(cg *c, const int32_t *reds, int nred);
int cg_pass_lists(cg *c, int pass, int row, int32_t **reds, int *nred, int32_t **outs, int *nout);
void cg_free_pass_lists(cg *c, int32_t *reds, int32_t *outs);

/* ================================ layer 5: source (generate.c, gemm_region.c, params.c, preamble.c) */

/* generate.c: the generator's state for region r read as rg (p->regions[r], or a GEMM region's
 * epilogue read as POINTWISE) with genome gn, and its release; prune_unused drops the `const`
 * declarations nothing reads */
kb_status cg_init(cg *c, const kb_partition *p, int32_t r, const kb_region *rg, const kb_genome *gn,
                  const kb_device_info *dev);
void cg_done(cg *c);
void cg_prune_unused(char *src);
/* gemm_region.c: a GEMM region's kernel: kb_gemm_generate's tile as a __device__ body, the
 * region's epilogue nodes as its hook, a __global__ entry in the region ABI looping over tiles */
kb_status cg_gemm_region_generate(const kb_partition *p, int32_t r, const kb_genome *gn, const kb_device_info *dev,
                                  kb_kernel **out);

/* params.c: the kernel's parameters, declared (decl=1) or passed on (decl=0: a call's arguments) */
void cg_emit_params(cg *c, kb_sb *sb, int decl);
void cg_emit_signature(cg *c, kb_sb *sb, const char *suffix);
/* a ROW region with saved statistics: the two entry points around its one body */
void cg_emit_saving_entries(cg *c, kb_sb *sb);
/* src (the whole source) with the parameters named after the model's values, none a name code
 * (the kernel's text: signatures, bodies, entry points) already uses: *out is a new string
 * (kb_string_free) */
kb_status cg_name_params(cg *c, const char *src, const char *code, char **out);

/* preamble.c: the header comments, then the headers and device helpers that kernel (the text
 * after the preamble: signatures, bodies, entry points) names, with the helpers they use */
void cg_emit_preamble(cg *c, kb_sb *sb, const char *kernel);
/* the next identifier of C source at or after s (comments, string literals and numbers
 * skipped) and its length, NULL at the end */
const char *cg_next_ident(const char *s, size_t *len);
/* does code (NULL: none) name identifier name outside comments and string literals (a member
 * after '.' or '->' aside)? */
int cg_code_names(const char *code, const char *name);

#endif /* KBENCH_CODEGEN_H */
