/* internal.h — what the core's .c files share and nobody else sees: the context's layout,
 * allocation through its hook, error recording, and a small growable string builder. */
#ifndef KBENCH_INTERNAL_H
#define KBENCH_INTERNAL_H

#include "core/kbench.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

struct kb_ctx {
    kb_alloc_fn alloc;
    void *ud;
    char error[4096];
};

void *kb_malloc(kb_ctx *ctx, size_t n);                       /* NULL + error set on failure */
void *kb_calloc(kb_ctx *ctx, size_t count, size_t size);
void *kb_realloc(kb_ctx *ctx, void *p, size_t osize, size_t nsize);
void kb_free(kb_ctx *ctx, void *p, size_t size);
char *kb_strdup(kb_ctx *ctx, const char *s);                  /* free with kb_string_free */

/* Records "file:line: message" as the context's error and returns status. */
kb_status kb_fail(kb_ctx *ctx, kb_status status, const char *file, int line, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 5, 6)))
#endif
    ;

#define KB_FAIL(ctx, status, ...) kb_fail((ctx), (status), __FILE__, __LINE__, __VA_ARGS__)

/* On a false condition: record the error, set `st` and jump to `cleanup`. Functions using it
 * declare `kb_status st = KB_OK;` and end with `cleanup: ... return st;`. */
#define KB_CHECK(ctx, cond, status, ...)                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            st = kb_fail((ctx), (status), __FILE__, __LINE__, __VA_ARGS__); \
            goto cleanup;                                                  \
        }                                                                  \
    } while (0)

/* Propagate a failed call (its error is already recorded). */
#define KB_TRY(call)                  \
    do {                              \
        st = (call);                  \
        if (st != KB_OK) goto cleanup; \
    } while (0)

/* A growable NUL-terminated string built with the ctx allocator. On OOM it stops growing and
 * remembers the failure, so callers may append freely and check sb.oom once at the end. */
typedef struct kb_sb {
    kb_ctx *ctx;
    char *buf;
    size_t len, cap;
    int oom;
} kb_sb;

void kb_sb_init(kb_sb *sb, kb_ctx *ctx);
void kb_sb_printf(kb_sb *sb, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void kb_sb_puts(kb_sb *sb, const char *s);
/* Hands the buffer to the caller (kb_string_free) or returns KB_ERR_OOM. */
kb_status kb_sb_finish(kb_sb *sb, char **out);
void kb_sb_discard(kb_sb *sb);

/* Bits and graphs */
static inline int kb_popcount32(uint32_t x) { return __builtin_popcount(x); }

/* The graph's storage: nodes in a growable array (ids are indices, topological by
 * construction: a node's inputs always have smaller ids). */
struct kb_graph {
    kb_ctx *ctx;
    kb_node *nodes;
    int32_t nnodes, cap;
    int32_t *inputs;
    int32_t ninputs, inputs_cap;
    int32_t *outputs;
    int32_t noutputs, outputs_cap;
    int32_t nsyms;
    char sym_names[KB_MAX_SYMS][16];
    int64_t sym_examples[KB_MAX_SYMS];
    struct kb_name_block *names; /* the nodes' names, in blocks freed with the graph */
};

/* Gives `to` (a graph with no symbols yet) from's symbols: same ids, names and examples, so
 * copied sizes keep their meaning. */
kb_status kb_graph_copy_symbols(const kb_graph *from, kb_graph *to);
/* g's inputs (in input order), then the nodes in `order` (no inputs; each after its operands),
 * then g's outputs, as a new graph with g's symbols: a reordered or pruned copy. */
kb_status kb_graph_rebuild(const kb_graph *g, const int32_t *order, int32_t norder, kb_graph **out);
/* Prints a dim ("128", "s0", "2*s0*s1") into buf; returns buf. */
const char *kb_dim_str(const kb_graph *g, kb_dim d, char *buf, size_t n);
/* Names as text. In the IR's text (KB_NAME_IR) a name is quoted, with '"', '\\' and every byte
 * outside printable ASCII written \xNN: one line, lossless, no quote inside the quotes. In a
 * comment of generated source (KB_NAME_COMMENT) it is kb_name_comment's spelling. */
typedef enum kb_name_style { KB_NAME_IR, KB_NAME_COMMENT } kb_name_style;
void kb_sb_put_name(kb_sb *sb, const char *name, kb_name_style style);
/* The graph's copy of name (names.c): "" for NULL or "", NULL when out of memory (error set). */
const char *kb_graph_keep_name(kb_graph *g, const char *name);
void kb_graph_free_names(kb_graph *g);
/* Appends one node as "%3 = op %1, %2 attrs : f32[s0,64]" (no newline) — the dump's line format. */
void kb_node_dump(kb_sb *sb, const kb_graph *g, int32_t id, kb_name_style names);
/* A name as it may appear in a // comment of generated source: letters, digits and " ._-:,=+#@()[]<>"
 * kept, every other byte '_' (so no newline, backslash, quote, '?', '/' or '*': nothing ends the
 * comment, splices a line or forms a trigraph), cut to KB_NAME_COMMENT_MAX characters with "..."
 * after. out holds n bytes (n > KB_NAME_COMMENT_MAX + 3 takes any name whole or cut). */
#define KB_NAME_COMMENT_MAX 64
void kb_name_comment(const char *name, char *out, size_t n);
/* A C identifier made from a name, for generated source: the last dotted component (a parameter
 * path's "weight"), or the one before joined with '_' where that one does not start with a letter
 * ("layers.0" -> "layers_0"), other bytes '_', no leading '_' or digit (prefix "v"), cut to
 * KB_NAME_IDENT_MAX characters; "" for a name with no letter or digit. Not checked against
 * keywords or other names: the caller does that (codegen/params.c). */
#define KB_NAME_IDENT_MAX 24
void kb_name_ident(const char *name, char *out, size_t n);
/* Prints "f32[s0,128]" into buf; returns buf. */
const char *kb_type_str(const kb_graph *g, const kb_node *nd, char *buf, size_t n);

/* Column sums one ROW region's kernel carries (codegen keeps a register partial per sum and
 * thread); the partitioner gives no region more, so codegen never refuses one for it. */
#define KB_MAX_COLSUMS 16

/* Does the op's CUDA spelling contain any of marks ("expf(", ...)? What fast math respells
 * (codegen/expr.c's FAST table) is read this way by the default genome and the search. */
static inline int kb_op_spelled_with(const kb_op_info *info, const char *const *marks, size_t n) {
    if (info->kind != KB_KIND_UNARY && info->kind != KB_KIND_BINARY) return 0;
    for (size_t i = 0; i < n; i++)
        if (strstr(info->cuda, marks[i])) return 1;
    return 0;
}

kb_node kb_node_template(kb_op op, kb_dtype dt, int32_t rank, const kb_dim *dims);

/* The device a schedule decision assumes for dev (NULL: none known): dev's figures where it
 * gives them (> 0), else the default device's (kb_device_default), but KB_SMEM_PORTABLE of
 * shared memory (see kb_device_info). */
kb_device_info kb_device_for_schedule(const kb_device_info *dev);

/* Node `value` of a graph holds the mean of node `of` along axes (keepdim), though it is not a
 * MEAN node there: a saved statistic, an input of the backward (grad/grad.c tells simplify.c). */
typedef struct kb_mean_fact {
    int32_t value, of;
    uint32_t axes;
} kb_mean_fact;

/* kb_graph_simplify, knowing these means too (sum_a(x - mean_a(x)) is 0; simplify.c), and with
 * toward_forward also writing values in terms of forward values a backward may read instead
 * (exp_over_sum: only where it does read them, for elsewhere it moves work, not bytes). */
kb_status kb_graph_simplify_means(const kb_graph *g, const kb_mean_fact *means, int nmeans, int toward_forward,
                                  kb_graph **out);

/* The element count of the dims whose bit is in mask, as one monomial: coef times a sorted
 * multiset of symbols. Two shapes hold as many elements for every binding of the symbols exactly
 * when their monomials are equal (ir.c; reshape checks, fusion, codegen). */
typedef struct kb_monomial {
    int64_t coef;
    int nsym;
    uint8_t sym[KB_MAX_RANK * KB_MAX_DIM_SYMS];
} kb_monomial;
void kb_monomial_of(const kb_dim *dims, int rank, uint32_t mask, kb_monomial *m);
int kb_monomial_equal(const kb_monomial *a, const kb_monomial *b);

/* ---------------------------------------------------------------- GEMM kernels (codegen/gemm.c)
 * out[b] = epilogue(A[b] @ B[b]) on tensor cores (mma.sync m16n8k16, f32 accumulation), sm_80+.
 * A [batch, M, K] row-major or, a_transposed, [batch, K, M] (row stride lda); B [batch, K, N]
 * row-major or, b_transposed, [batch,
 * N, K] (a Linear's weight), row stride ldb; out [batch, M, N] contiguous. M, N, K, lda, ldb and
 * the batch strides are kernel arguments (long long), so one kernel serves every size. */

/* Where one output element's epilogue runs: the names of the kernel's variables it may read. All
 * are in range (row < M, col < N). The kernel's own names (A, B, out, M, N, K, lda, ldb,
 * stride_a, stride_b, and everything starting with kb_ or a capital letter) are taken: an
 * epilogue's parameters and locals use names of their own. */
typedef struct kb_gemm_site {
    const char *acc;        /* a float lvalue: the accumulator on entry, the value stored on exit */
    const char *batch;      /* long long: the batch index */
    const char *row, *col;  /* long long: the element's row (< M) and column (< N) */
    int indent;             /* the statements' indentation, in levels of 4 spaces */
} kb_gemm_site;

/* The epilogue hook: the region codegen (or kb_gemm_builtin) fills it. params appends the kernel
 * parameters it reads, each written ",\n    <declaration>" (NULL: none); element appends the
 * statements of one output element at site (they may also store to outputs of their own). what
 * is one line for the kernel's header comment. Each returns KB_OK or records its error. */
typedef struct kb_gemm_epilogue {
    void *ud;
    const char *what;
    kb_status (*params)(kb_ctx *ctx, void *ud, kb_sb *sb);
    kb_status (*element)(kb_ctx *ctx, void *ud, kb_sb *sb, const kb_gemm_site *site);
} kb_gemm_epilogue;

typedef struct kb_gemm_spec {
    kb_dtype ab;                 /* A and B: KB_BF16 or KB_F16 */
    kb_dtype out;                /* KB_BF16, KB_F16 or KB_F32 */
    int32_t b_transposed;        /* 0: B is [batch, K, N]; 1: [batch, N, K] */
    int32_t a_broadcast;         /* 1: one A for every batch (batch stride 0: no stride_a argument) */
    int32_t b_broadcast;         /* 1: one B for every batch (a weight) */
    const kb_gemm_epilogue *epilogue; /* NULL: out = acc */
    int32_t a_transposed;        /* 1: A is stored [batch, K, M] (row stride lda), read as its transpose */
    /* 1: the kernel is a __device__ function computing one tile, (const long long kb_pid, const long
     * long kb_bz, <the parameters>) for tile kb_pid of batch kb_bz, which a region's __global__
     * entry calls in a loop over the tiles (codegen/gemm_region.c); the caller keeps the block's
     * threads together and syncs them between tiles */
    int32_t device_body;
    /* 1: no out parameter and no store: the epilogue stores every value itself (a region's outputs) */
    int32_t no_out;
} kb_gemm_spec;

/* One GEMM kernel's schedule: a block computes a tile_m x tile_n tile of out, stepping K by
 * tile_k through a ring of `stages` shared-memory buffers filled by cp.async; warps_m x warps_n
 * warps split the tile, each a (tile_m / warps_m) x (tile_n / warps_n) warp tile of m16n8 mmas.
 * min_blocks (1 or 2): blocks an SM must hold at once (__launch_bounds__' second argument: ptxas
 * keeps registers within 64K / (2 * threads) a thread), so one block's epilogue and pipeline
 * fill overlap another's main loop. */
typedef struct kb_gemm_genome {
    int32_t tile_m, tile_n, tile_k;
    int32_t warps_m, warps_n;
    int32_t stages;
    int32_t min_blocks;
} kb_gemm_genome;

/* What a launch needs: grid = (ceil(M / tile_m) * ceil(N / tile_n), 1, batch) (kb_gemm_grid),
 * block threads, dynamic shared memory (above KB_SMEM_PORTABLE: kb_cuda_function opts in). */
typedef struct kb_gemm_launch {
    char name[64];
    int32_t block;
    int32_t smem_bytes;
    int32_t tile_m, tile_n;
} kb_gemm_launch;

/* The built-in epilogue vocabulary, applied in this order:
 *   acc = alpha * acc + bias_n[col] + bias_m[row];  acc = act(acc);  acc += residual[b, row, col]
 * A dtype of -1 leaves that term out; alpha (a float kernel parameter) only where has_alpha; act
 * is any unary op of ops.def with its "cuda" template (scalars act_p0, act_p1), -1 for none. */
typedef struct kb_gemm_builtin {
    int32_t has_alpha;
    int32_t bias_n;      /* kb_dtype of a [N] vector, or -1 */
    int32_t bias_m;      /* kb_dtype of a [M] vector, or -1 */
    int32_t residual;    /* kb_dtype of a [batch, M, N] contiguous tensor, or -1 */
    int32_t act;         /* kb_op, or -1 */
    double act_p0, act_p1;
    char what[160];      /* filled by kb_gemm_builtin_epilogue */
} kb_gemm_builtin;

/* The hook for b (borrowed: b outlives the hook). KB_ERR_UNSUPPORTED names a term it cannot do. */
kb_status kb_gemm_builtin_epilogue(kb_ctx *ctx, kb_gemm_builtin *b, kb_gemm_epilogue *out);
/* KB_OK, or KB_ERR_UNSUPPORTED saying why spec cannot be generated (dtypes, sm < 80). */
kb_status kb_gemm_spec_check(kb_ctx *ctx, const kb_gemm_spec *spec, int sm);
/* KB_OK when g is legal on dev (NULL: the default device, kb_device_default): tiles multiples
 * of the mma shape per warp, at most 8 warps, tile_k 16/32/64, 2..8 stages, shared memory within
 * the device's opt-in limit (min_blocks times over), registers plausible (for min_blocks blocks
 * an SM); else KB_ERR_INVALID naming the first rule broken. */
kb_status kb_gemm_genome_check(kb_ctx *ctx, const kb_gemm_genome *g, const kb_device_info *dev);
/* The default for an M x N x K problem of `batch` products on dev (NULL: kb_device_default):
 * 128x128x32 on 2x4 warps, 4 stages, 2 blocks an SM, where that grid fills the SMs; smaller tiles
 * where it would not. */
void kb_gemm_genome_default(int64_t M, int64_t N, int64_t K, int64_t batch, const kb_device_info *dev,
                            kb_gemm_genome *out);
/* Candidates a caller can time, the default first, all legal on dev, none twice; returns how many
 * were written (at most max). */
int kb_gemm_genome_candidates(int64_t M, int64_t N, int64_t K, int64_t batch, const kb_device_info *dev,
                              kb_gemm_genome *out, int max);
/* Appends the kernel's CUDA source to sb and fills *launch. Deterministic: the same spec (and
 * epilogue text), genome and sm give the same bytes. g must pass kb_gemm_genome_check's shape
 * rules; its shared memory is checked against the caller's device there, not here. The kernel requires (the launcher checks; a
 * call that breaks it goes to cuBLAS): K, lda, ldb and the batch strides multiples of 8 elements,
 * N too where B is not transposed, M where A is, A, B and out 16-byte aligned, ceil(M / tile_m) *
 * ceil(N / tile_n) < 2^31 and batch < 65536. */
kb_status kb_gemm_generate(kb_ctx *ctx, const kb_gemm_spec *spec, const kb_gemm_genome *g, int sm, kb_sb *sb,
                           kb_gemm_launch *launch);
/* The grid of launch at these sizes. */
void kb_gemm_grid(const kb_gemm_launch *launch, int64_t M, int64_t N, int64_t batch, uint32_t grid[3]);

#endif /* KBENCH_INTERNAL_H */
