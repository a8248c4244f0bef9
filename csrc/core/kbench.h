/* kbench.h — the C core's one public header: context, IR, regions, genomes, interpreter,
 * CUDA code generation and the CUDA/NVRTC runtime. No libtorch, no CUDA headers: tensors
 * are raw pointers whose shapes the graph knows, streams and functions are opaque handles.
 *
 * Its sections follow the pipeline's stages, one folder of csrc/ each: core (context, IR,
 * rewrites, interpreter, device defaults), fuse, grad, tune, codegen, cuda.
 *
 * Conventions (docs/DESIGN.md, "The IR"): public names start with kb_; fallible calls return
 * kb_status and write results through out-parameters; the message of the last failure is
 * kb_ctx_error(ctx); every pointer a function returns says who owns it; kb_X_free(NULL) is a
 * no-op. */
#ifndef KBENCH_H
#define KBENCH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KB_VERSION "0.1.0"

/* ---------------------------------------------------------------- status and context */

typedef enum kb_status {
    KB_OK = 0,
    KB_ERR_OOM,          /* the context's allocator said no */
    KB_ERR_INVALID,      /* bad argument: wrong arity, rank, dtype, axis, id, ... */
    KB_ERR_UNSUPPORTED,  /* valid, but not something this build can do (the caller falls back) */
    KB_ERR_CUDA,         /* a CUDA driver call failed; the message names the driver's error */
    KB_ERR_NVRTC,        /* NVRTC failed; the message holds its log */
    KB_ERR_NOT_FOUND,    /* a library (libcuda, libnvrtc) or a file is missing */
    KB_ERR_IO            /* the CUBIN cache could not be read or written */
} kb_status;

const char *kb_status_name(kb_status s);

/* One allocator hook, Lua style: nsize == 0 frees ptr and returns NULL; otherwise
 * (re)allocates ptr from osize to nsize bytes and returns NULL on failure. */
typedef void *(*kb_alloc_fn)(void *ud, void *ptr, size_t osize, size_t nsize);

typedef struct kb_ctx kb_ctx;

/* alloc may be NULL for malloc/realloc/free. The caller owns *out; free with kb_ctx_free. */
kb_status kb_ctx_new(kb_alloc_fn alloc, void *ud, kb_ctx **out);
void kb_ctx_free(kb_ctx *ctx);
/* The message of the last failure ("" if none); owned by ctx, valid until the next failure. */
const char *kb_ctx_error(const kb_ctx *ctx);

/* ---------------------------------------------------------------- dtypes and sizes */

typedef enum kb_dtype {
    KB_F32 = 0, KB_F16, KB_BF16, KB_F64, KB_I64, KB_I32, KB_BOOL, KB_DTYPE_COUNT
} kb_dtype;

const char *kb_dtype_name(kb_dtype t);             /* "f32", "bf16", ... */
int kb_dtype_from_name(const char *name);          /* -1 if unknown */
size_t kb_dtype_size(kb_dtype t);
int kb_dtype_is_float(kb_dtype t);

#define KB_MAX_RANK 8
#define KB_MAX_DIM_SYMS 4     /* symbols multiplied in one size expression */
#define KB_MAX_SYMS 16        /* symbols (sizes that may vary) in one graph */
#define KB_MAX_INPUTS 16      /* operands of one node (EXTERN may use them all) */

/* A size that may vary: coef * prod(symbol values). nsym == 0 means pinned (coef alone).
 * Symbols are the graph's; their values are bound at run time from the input shapes. */
typedef struct kb_dim {
    int64_t coef;
    uint8_t nsym;
    uint8_t sym[KB_MAX_DIM_SYMS];
} kb_dim;

/* d at these symbol values; INT64_MAX where the product overflows (kb_graph_check_symvals
 * refuses such values up front). */
int64_t kb_dim_eval(kb_dim d, const int64_t *symvals);
int kb_dim_equal(kb_dim a, kb_dim b);

/* ---------------------------------------------------------------- the IR */

typedef enum kb_op_kind {
    KB_KIND_LEAF, KB_KIND_UNARY, KB_KIND_BINARY, KB_KIND_TERNARY,
    KB_KIND_REDUCE, KB_KIND_VIEW, KB_KIND_GATHER, KB_KIND_EXTERN, KB_KIND_MATMUL
} kb_op_kind;

typedef enum kb_op {
#define X(name, arity, kind, printed, interp, cuda, da, db, dc) KB_OP_##name,
#include "core/ops.def"
#undef X
    KB_OP_COUNT
} kb_op;

typedef struct kb_op_info {
    const char *name;       /* printed form */
    int arity;              /* -1: variable (EXTERN) */
    kb_op_kind kind;
    const char *cuda;       /* pointwise template, "" otherwise */
    const char *grad[3];    /* derivative rules (see ops.def) */
} kb_op_info;

const kb_op_info *kb_op_get(kb_op op);
int kb_op_from_name(const char *name);  /* -1 if unknown */

typedef enum kb_input_kind { KB_INPUT_USER = 0, KB_INPUT_PARAM, KB_INPUT_BUFFER } kb_input_kind;

/* One node = one value (SSA). Attributes used per op:
 *   CONST               scalar[0] = the value (the node's shape is a broadcast of it)
 *   IOTA                axis: each element's value is its coordinate along that axis
 *   LEAKY_RELU          scalar[0] = negative slope;  SOFTPLUS: scalar[0] = beta, scalar[1] = threshold
 *   SUM MEAN RMAX RMIN  axes = bitmask over the operand's dims; keepdim iff rank == operand rank
 *   PERMUTE             perm[i] = operand dim that output dim i reads
 *   SLICE               axis, start, step (the length is the output's size on axis)
 *   GATHER              axis
 *   RESHAPE EXPAND      nothing: the output's dims say it all
 *   MATMUL              nothing: a [*b,M,K] . b [*b,K,N] -> [*b,M,N]; a transposed operand is a
 *                       PERMUTE feeding it, a broadcast batch an EXPAND
 *   INPUT               input_kind, index (position among the graph's inputs), name
 *   EXTERN              index (the Python-side callable), axis (which of its outputs) */
typedef struct kb_node {
    kb_op op;
    kb_dtype dtype;
    int32_t rank;
    int32_t ninputs;
    int32_t inputs[KB_MAX_INPUTS];
    kb_dim dims[KB_MAX_RANK];
    double scalar[2];
    uint32_t axes;
    int8_t perm[KB_MAX_RANK];
    int32_t axis;
    int64_t start, step;
    int32_t index;
    int32_t nograd;         /* its gradient is zero by construction (the max a softmax subtracts
                               for stability): autodiff sends none through it */
    kb_input_kind input_kind;
    const char *name;       /* source name (parameter path, FX node name): any length, any bytes
                               but NUL; "" if none. In a graph it is the graph's own copy (never
                               NULL, valid while the graph lives); kb_graph_add copies a
                               template's (NULL counts as ""). Names never become code: generated
                               sources spell them escaped (kb_name_ident, kb_name_comment). */
} kb_node;

typedef struct kb_graph kb_graph;

/* The caller owns *out (kb_graph_free). The graph keeps ctx for allocation and errors. */
kb_status kb_graph_new(kb_ctx *ctx, kb_graph **out);
void kb_graph_free(kb_graph *g);
kb_ctx *kb_graph_ctx(const kb_graph *g);

/* A symbol (a size that may vary); example = its value at capture. Returns its id. */
kb_status kb_graph_add_symbol(kb_graph *g, const char *name, int64_t example, int32_t *id);
int32_t kb_graph_nsymbols(const kb_graph *g);
const char *kb_graph_symbol_name(const kb_graph *g, int32_t sym);
int64_t kb_graph_symbol_example(const kb_graph *g, int32_t sym);

/* Adds a node from a filled template (op, dtype, rank, dims, inputs, attributes); checks
 * arity, operand ids, shapes and attributes, and returns the new value's id. */
kb_status kb_graph_add(kb_graph *g, const kb_node *tmpl, int32_t *id);
kb_status kb_graph_add_output(kb_graph *g, int32_t value);
/* a [*batch, M, K] . b [*batch, K, N] as a MATMUL node of dtype dt (shape [*batch, M, N] from
 * the operands'): kb_graph_add's checks, named here for the one op whose shape is derived. */
kb_status kb_graph_add_matmul(kb_graph *g, int32_t a, int32_t b, kb_dtype dt, int32_t *id);

int32_t kb_graph_nnodes(const kb_graph *g);
const kb_node *kb_graph_node(const kb_graph *g, int32_t id);      /* owned by g */
int32_t kb_graph_ninputs(const kb_graph *g);
int32_t kb_graph_input(const kb_graph *g, int32_t i);              /* node id of input i */
int32_t kb_graph_noutputs(const kb_graph *g);
int32_t kb_graph_output(const kb_graph *g, int32_t i);

/* Concrete sizes of value v for bound symbol values; returns numel, or -1 where a size or the
 * count overflows int64. */
int64_t kb_value_sizes(const kb_graph *g, int32_t v, const int64_t *symvals, int64_t sizes[KB_MAX_RANK]);
/* Are these symbol values (one per symbol) sizes g can run at? Each >= 0, and every value's
 * size, element count and bytes (8 per element, as the interpreter holds it; a size 0 counted
 * as 1, so any product of its sizes is bounded), summed over the graph, fit in int64: no size
 * arithmetic downstream overflows. KB_ERR_INVALID with the reason in g's context otherwise.
 * Every entry point taking symbol values from outside checks. */
kb_status kb_graph_check_symvals(const kb_graph *g, const int64_t *symvals);

/* Stable text form; *out is allocated with the ctx allocator, free with kb_string_free. */
kb_status kb_graph_dump(const kb_graph *g, char **out);
void kb_string_free(kb_ctx *ctx, char *s);

/* ---------------------------------------------------------------- regions (fuse/) */

typedef enum kb_region_kind {
    KB_REGION_POINTWISE = 0, KB_REGION_ROW, KB_REGION_COL, KB_REGION_EXTERN, KB_REGION_GEMM
} kb_region_kind;

const char *kb_region_kind_name(kb_region_kind k);

/* One region = one kernel (or one torch call for EXTERN). Arrays are owned by the partition.
 * Iteration space: the anchor value's shape. POINTWISE: one element of the anchor per work
 * item. ROW: the anchor's reduce_axes are its trailing dims (the row); one row per work item.
 * COL: the anchor's reduce_axes are its leading dims; one column per work item. */
/* How a GEMM region's operand reaches its MATMUL from the region input it reads (through
 * floating PERMUTE / EXPAND / RESHAPE index maps): ROW, the operand's last dim is the input's
 * contiguous last dim (A [M,K] as stored; B [K,N]); TRANS, its second-to-last dim is (A stored
 * [K,M]; B stored [N,K], a Linear's weight); STRIDED, neither (a kernel would gather it). */
typedef enum kb_gemm_layout { KB_GEMM_ROW = 0, KB_GEMM_TRANS, KB_GEMM_STRIDED } kb_gemm_layout;

/* The facts of a GEMM region (kind KB_REGION_GEMM; zero elsewhere): its one MATMUL (the anchor),
 * each operand's source (the region input or computed value it is read from), layout and batch
 * broadcast (bit d: operand dim d < rank-2 is an EXPAND of size 1), whether the operand carries
 * pointwise prologue work (a cast), and its epilogue: the region's nodes over the product's
 * iteration space that read it, directly or through each other (bias add, activation, residual
 * add, scale, clamp, casts), in node order. */
typedef struct kb_gemm_info {
    int32_t matmul;
    int32_t source[2];
    kb_gemm_layout layout[2];
    uint32_t bcast[2];
    uint8_t prologue[2];
    int32_t nepilogue;
    int32_t *epilogue;      /* owned by the partition */
} kb_gemm_info;

typedef struct kb_region {
    kb_region_kind kind;
    int32_t nnodes;   int32_t *nodes;     /* in topological order */
    int32_t ninputs;  int32_t *inputs;    /* values the region reads from outside it */
    int32_t noutputs; int32_t *outputs;   /* values read outside it or returned by the graph */
    int32_t anchor;
    uint32_t reduce_axes;
    int32_t nsaved;   /* the last nsaved outputs are row statistics kept for the backward only */
    uint32_t saved_outputs; /* bit k: the backward reads output k (kb_graph_grad_saved's reuse) */
    kb_gemm_info gemm;      /* GEMM regions only */
} kb_region;

typedef struct kb_partition {
    const kb_graph *graph;  /* borrowed: must outlive the partition, and not grow */
    int32_t nregions;
    kb_region *regions;     /* in execution order */
    int32_t *region_of;     /* node id -> region index, -1 for nodes no region needs */
    int32_t nnodes;         /* the graph's node count when partitioned: region_of's length */
} kb_partition;

/* A kernel's parameters: CUDA gives them 4 KB on every driver and architecture (32 KB only with
 * CUDA 12.1+ drivers on Volta and later; kbench assumes the 4 KB everywhere). A region's kernel
 * takes 8 bytes for each input, output and graph symbol, and one workspace pointer. */
#define KB_MAX_PARAM_BYTES 4096
int64_t kb_region_param_bytes(const kb_partition *p, int32_t r);

/* The greedy pass (fuse/fuse.c) into regions, none whose kernel's parameters would pass
 * KB_MAX_PARAM_BYTES: such a region is split (at its middle node, in node order, again until each
 * part fits); KB_ERR_UNSUPPORTED where one cannot be split. */
kb_status kb_partition_new(const kb_graph *g, kb_partition **out);
void kb_partition_free(kb_partition *p);
kb_status kb_partition_dump(const kb_partition *p, char **out);
/* Region r of p as a standalone graph: its inputs become INPUT nodes in region->inputs order
 * (a graph input keeps its kind and name, anything else is kind user, named "in<k>"), its
 * outputs the graph's outputs (region->outputs order); symbols are copied so sizes keep their
 * meaning. The caller owns *out (kb_graph_free); same ctx as p's graph. */
kb_status kb_region_graph(const kb_partition *p, int32_t r, kb_graph **out);

/* ---------------------------------------------------------------- autodiff (grad/) */

/* Reverse mode: a graph computing the vector-Jacobian product of g. Its inputs are g's inputs
 * (same order, kinds, names), then the values of g's last nsaved outputs (kind user, named
 * "saved<k>": statistics the forward kept, see kb_partition_save_stats), then the values of the
 * other outputs k with bit k of reuse set (kind user, named "out<k>": where the backward needs the
 * value such an output holds, it reads it there instead of recomputing it; an output narrowed
 * from f32 to f16/bf16 stands for the f32 value, as eager's backward reads its narrowed outputs),
 * then one upstream gradient per other output of g (same dtype and shape, kind user, named
 * "grad_out<k>"). Its
 * outputs are the gradients of the inputs i with wrt[i] != 0, in input order (same dtype and
 * shape as the input). The other forward values the backward needs are recomputed inside it
 * from g's inputs (saved-tensor policy: keep the region inputs and row statistics, recompute the
 * rest — the partitioner fuses recomputation into the backward kernels). Integer and bool
 * inputs get no gradient (wrt must be 0 for them). The caller owns *out (kb_graph_free).
 * KB_ERR_UNSUPPORTED for a graph with EXTERN nodes. kb_graph_grad is nsaved = 0, reuse = 0. */
kb_status kb_graph_grad_saved(const kb_graph *g, const uint8_t *wrt, int32_t nsaved, uint32_t reuse,
                              kb_graph **out);
kb_status kb_graph_grad(const kb_graph *g, const uint8_t *wrt, kb_graph **out);
/* Forward and backward as one graph: g's inputs, then g's outputs followed by the gradients of
 * the wrt inputs, each upstream gradient taken as 1 (for a scalar loss the true gradients are
 * these times the upstream gradient, known only when the backward runs). */
kb_status kb_graph_grad_joint(const kb_graph *g, const uint8_t *wrt, kb_graph **out);

/* The forward's save policy (grad/save.c, which builds each ROW region's backward both ways to
 * decide). Row statistics for the backward (a forward partition's choice; a backward's is not
 * differentiated again): in each ROW region whose rows hold at least min_row_bytes (4 per
 * element at the example sizes), the row reductions no other region reads and that the row's
 * elements are computed from (a softmax's max and sum, a LayerNorm's mean and variance; not a
 * mean loss's sum) become extra outputs after its own, counted by nsaved. The forward writes one
 * value per row; the backward reads them rather than reducing the row again: a pass fewer per
 * statistic, and for a row too long to keep on chip (a 32k-vocabulary cross-entropy) no second
 * read of the whole input. Where the region's backward reads fewer bytes reading the region's
 * own outputs (a log_softmax: its output y alone, as eager's), those are marked in
 * saved_outputs, and statistics that backward does not read are not kept. */
kb_status kb_partition_save_stats(kb_partition *p, int64_t min_row_bytes);

/* ---------------------------------------------------------------- rewrites (core/simplify.c) */

/* g rebuilt with rewrites that take work out of its kernels, and without the nodes its outputs
 * do not need: same inputs (all of them, in order, first), same outputs, same values. The
 * rewrite so far: a sum over one axis of a one-hot, sum_a f(where(iota_a == T, D, 0)) with T
 * (integer) and D the same all along a and f a chain of neg, float casts, products with finite
 * constants and quotients by finite nonzero ones, becomes f(where(0 <= T < size_a, D, 0)) per
 * row, exactly, for any T (a backward's cross-entropy loses a pass over the row; an axis of
 * length 0 aside, see core/simplify.c); a sum over one axis of per-row multiples of terms is split into
 * per-row multiples of the terms' sums where that nests reductions less deeply, and a term that
 * is a deviation from its own mean along that axis, x - mean_a(x), sums to 0 and is dropped.
 * kb_graph_grad's result has been through it (knowing which saved statistics are means). The caller owns
 * *out (kb_graph_free); same ctx as g. */
kb_status kb_graph_simplify(const kb_graph *g, kb_graph **out);

/* ---------------------------------------------------------------- CPU interpreter (core/interp.c) */

/* Runs region r on host buffers, computing in double. ins[i] is region input i, outs[j]
 * region output j: dense, contiguous, in their value's dtype, caller-allocated, sized for
 * symvals. bf16/f16 outputs are rounded on store (round to nearest even). */
kb_status kb_interp_region(kb_ctx *ctx, const kb_partition *p, int32_t r, const int64_t *symvals,
                           const void *const *ins, void *const *outs);
/* Runs a whole graph that has no EXTERN node: ins are the graph inputs, outs its outputs. */
kb_status kb_interp_graph(kb_ctx *ctx, const kb_graph *g, const int64_t *symvals,
                          const void *const *ins, void *const *outs);

/* ---------------------------------------------------------------- schedules (tune/) */

typedef enum kb_cache_where { KB_CACHE_REGS = 0, KB_CACHE_SMEM, KB_CACHE_REREAD } kb_cache_where;

/* The schedule of one region. Canonical text ("threads=256 vec=4 rows=1 ...") is its identity. */
typedef struct kb_genome {
    int32_t threads;        /* threads per block */
    int32_t vec;            /* elements per vector access: 1, 2, 4, 8 */
    int32_t rows;           /* ROW: rows per block (1 = a block per row; >1 = a warp per row) */
    int32_t items;          /* POINTWISE: elements per thread; ROW: unroll of the row loop */
    int32_t cache;          /* kb_cache_where: where a row lives between passes */
    int32_t two_pass;       /* ROW statistics: 1 = two passes, 0 = one pass (Welford / online) */
    int32_t fast_math;      /* __expf and friends */
    int32_t persistent;     /* grid = a few blocks per SM looping over work items */
    int32_t col_split;      /* COL: blocks along the reduced dim (partials, then a finishing kernel) */
    int32_t row_split;      /* ROW: blocks per row (1 = the row in one block; > 1: each block reduces a
                               contiguous part of the row to partials, a finishing kernel merges them
                               and writes the row's outputs, each block its part) */
    /* GEMM regions only (all 0 elsewhere): the tensor-core kernel's schedule (kb_gemm_genome,
     * codegen/gemm.c), written in the text as one gene "gemm=TMxTNxTK/WMxWN/sS/bB" only where set;
     * the genes above keep kb_genome_base()'s values but threads (the kernel's block) and vec 8
     * (its 16-byte loads: the launchers then check every input pointer's alignment) */
    int32_t gemm_tile_m, gemm_tile_n, gemm_tile_k, gemm_warps_m, gemm_warps_n, gemm_stages, gemm_min_blocks;
} kb_genome;

/* What schedules and launches need to know of a device (kb_cuda_device_info reads it from the
 * driver). Where a function takes a kb_device_info pointer, NULL means no device is known:
 * schedule decisions (kb_genome_default, kb_genome_legal, kb_evolve_new) then assume the
 * default device's SM count but only KB_SMEM_PORTABLE of shared memory, so what they choose
 * runs anywhere; code generation checks no shared memory limit, and the grid takes no cap
 * (kb_kernel_max_blocks is 0). A field <= 0 counts as not said, field by field. */
typedef struct kb_device_info {
    int32_t sm;             /* 80, 90, ... */
    int32_t num_sms;
    int32_t max_smem_per_block;  /* with opt-in (cuFuncSetAttribute) */
    int32_t regs_per_sm;
    int32_t l2_bytes;
} kb_device_info;

/* Shared memory a block gets on every device without opting in: a kernel asking for more must
 * opt in (kb_cuda_function does), and a schedule chosen without a device stays within it. */
#define KB_SMEM_PORTABLE (48 * 1024)

/* The device a caller who knows none targets (generate() without a GPU, the Python binding's
 * dev=None and its missing keys): an H100 SXM, the one table of device defaults (core/device.c).
 * Static storage. */
const kb_device_info *kb_device_default(void);

kb_status kb_genome_default(const kb_partition *p, int32_t r, const int64_t *symvals,
                            const kb_device_info *dev, kb_genome *out);
/* Writes the canonical text into buf (always NUL-terminated); returns its length. */
int kb_genome_format(const kb_genome *gn, char *buf, size_t n);
/* The text's genes ("key=value" separated by blanks, any order) over kb_genome_base(); a gene
 * given twice takes its last value. KB_ERR_INVALID for an unknown gene or a value out of its
 * range (kb_genome_genes). The canonical text (kb_genome_format) lists every gene in field order
 * but row_split, which it appends only where it is not 1: a genome without a split keeps the
 * text (its name in caches and reports) it had before the gene existed, and such a text parses
 * back with row_split=1. */
kb_status kb_genome_parse(kb_ctx *ctx, const char *text, kb_genome *out);

/* The genes of a kb_genome in field order (kb_evolve_domain numbers them the same way): each
 * one's name in the text form, the offset of its int32_t, and the values the text may give it
 * (cache: a kb_cache_where, written by its name). Static storage, KB_NGENES entries. */
#define KB_NGENES 10
typedef struct kb_gene {
    const char *name;
    size_t offset;
    int32_t lo, hi;
} kb_gene;
const kb_gene *kb_genome_genes(void);
/* The genes a text leaves out ("threads=256 vec=1 rows=1 items=1 cache=regs two_pass=1
 * fast_math=0 persistent=0 col_split=1", row_split=1). Static storage. */
const kb_genome *kb_genome_base(void);
/* A kb_cache_where's name in the text ("regs", "smem", "reread"); NULL out of range. */
const char *kb_cache_where_name(int32_t where);
/* The kb_cache_where named by the n bytes at name (not NUL-terminated), or -1. */
int32_t kb_cache_where_of(const char *name, size_t n);
/* KB_OK when every gene is within its range (what kb_genome_parse accepts), else
 * KB_ERR_INVALID naming the first that is not. Whether a region can run it is
 * kb_genome_legal's question. */
kb_status kb_genome_check(kb_ctx *ctx, const kb_genome *gn);

/* ---------------------------------------------------------------- code generation (codegen/) */

/* A generated kernel. Arguments, in order: one pointer per region input, one per region
 * output, then one int64 per graph symbol (every symbol, in id order), then, for COL regions
 * with col_split > 1, ROW regions with row_split > 1 and ROW regions with column sums, a
 * workspace pointer. The pointers are
 * named after the model's values (a parameter path's last component, a user input's name, out,
 * out1, ..., the saved statistics' names or stat0, ...), made safe C identifiers; launchers
 * pass arguments by position. The source's preamble holds only the helpers the kernel uses.
 * All owned by the kernel (kb_kernel_free). */
typedef struct kb_kernel {
    char *source;           /* CUDA C, NUL-terminated */
    char name[64];          /* entry point */
    int32_t block;          /* threads per block */
    int32_t smem_bytes;     /* dynamic shared memory */
    int64_t workspace_bytes_per_unit; /* COL split: bytes of workspace per (column, split) unit; ROW
                                         split: per (row, part) unit (0 if none) */
    int64_t workspace_bytes_per_block; /* ROW column sums: partials per block of the grid */
    int32_t max_blocks_per_sm; /* grid cap (with the device's SM count); 0: none unless persistent */
    int32_t nkernels;       /* 1, or 2 when a finishing kernel follows (name KB_ENTRY_FINISH) */
    int32_t nostats;        /* 1: also name KB_ENTRY_NOSTATS, the same kernel without the saved statistics */
    kb_genome genome;
    kb_dim grid_units;      /* work items: grid.x = ceil(units / units_per_block) (or capped) */
    int64_t units_per_block;
    /* A ROW or COL kernel with vectors along a last dim that varies runs only where that dim (at
     * the launch's sizes: kb_kernel_admits) is a multiple of last_multiple (its vec); 1 (and
     * last_dim 1) where it runs at every size. The launcher checks it per call and runs the region
     * in eager where it fails, as for a misaligned pointer. */
    int32_t last_multiple;
    kb_dim last_dim;
} kb_kernel;

/* The suffixes of a kernel's other entry points, after its name: the finishing kernel
 * (nkernels == 2) and the entry without the saved statistics (nostats). */
#define KB_ENTRY_FINISH "_finish"
#define KB_ENTRY_NOSTATS "_nostats"

kb_status kb_kernel_generate(const kb_partition *p, int32_t r, const kb_genome *gn,
                             const kb_device_info *dev, kb_kernel **out);
void kb_kernel_free(kb_ctx *ctx, kb_kernel *k);
/* The grid's cap on the device: blocks that fit at once, for a persistent genome or a grid
   sized for its partials; 0 when the grid follows the work alone. */
int64_t kb_kernel_max_blocks(const kb_kernel *k, const kb_device_info *dev);
/* 1 where k may run at bound symbols symvals (its last dim a multiple of last_multiple), else 0 */
int kb_kernel_admits(const kb_kernel *k, const int64_t *symvals);
/* grid for bound symbols: ceil(units / units_per_block), capped as above and at 2^31 - 1 */
void kb_kernel_grid(const kb_kernel *k, const int64_t *symvals, const kb_device_info *dev,
                    uint32_t grid[3]);

/* ---------------------------------------------------------------- CUDA runtime (cuda/) */

/* NVRTC (cuda/nvrtc.c), dlopen'ed on first use; searched in order: $KBENCH_NVRTC, the
 * nvidia/<pkg>/lib folders given by the caller (the torch wheel's), $CUDA_HOME/lib64,
 * /usr/local/cuda/lib64, the loader's path. Owned by the caller: kb_nvrtc_close. */
typedef struct kb_nvrtc kb_nvrtc;
kb_status kb_nvrtc_open(kb_ctx *ctx, const char *const *extra_dirs, int ndirs, kb_nvrtc **out);
void kb_nvrtc_close(kb_nvrtc *n);
const char *kb_nvrtc_path(const kb_nvrtc *n);   /* the library that was loaded */
int kb_nvrtc_version(const kb_nvrtc *n);        /* major*1000 + minor*10 */
/* The folder passed as -I for cuda_fp16.h / cuda_bf16.h ("" if none was found): NVRTC 13 has
 * no built-in copies. Searched: $KBENCH_CUDA_INCLUDE, <libnvrtc's folder>/../include, beside
 * each extra dir (../include, ../../cuda_runtime/include), $CUDA_HOME/include,
 * /usr/local/cuda/include. */
const char *kb_nvrtc_include_dir(const kb_nvrtc *n);
/* Compiles source for arch ("sm_90") to a CUBIN; *cubin is allocated with the ctx allocator
 * (kb_blob_free). With cache_dir != NULL, looks up / stores <cache_dir>/<hash>.cubin keyed by
 * source, arch, options and NVRTC version, signed with key (a secret of KB_CUBIN_KEY_MIN to
 * KB_CUBIN_KEY_MAX bytes, required with a cache_dir): a file whose claims (source hash, arch,
 * NVRTC version) or HMAC do not match is recompiled and replaced. On failure the ctx error holds
 * NVRTC's log. *log (if log != NULL) is set whenever NVRTC printed something (warnings on
 * success, the errors on KB_ERR_NVRTC), else NULL; free with kb_string_free. A cache hit leaves
 * it NULL. */
#define KB_CUBIN_KEY_MIN 16
#define KB_CUBIN_KEY_MAX 64
kb_status kb_nvrtc_compile(kb_ctx *ctx, kb_nvrtc *n, const char *source, const char *arch,
                           const char *cache_dir, const void *key, size_t key_len, void **cubin, size_t *size,
                           char **log);
void kb_blob_free(kb_ctx *ctx, void *blob, size_t size);

/* The driver (cuda/driver.c), dlopen'ed once ("libcuda.so.1"). Owned by the caller:
 * kb_cuda_close. */
typedef struct kb_cuda kb_cuda;
kb_status kb_cuda_open(kb_ctx *ctx, kb_cuda **out);
void kb_cuda_close(kb_cuda *c);
int kb_cuda_driver_version(const kb_cuda *c);   /* cuDriverGetVersion: 12080 = 12.8 */
kb_status kb_cuda_device_info(kb_ctx *ctx, kb_cuda *c, int device, kb_device_info *out);

typedef struct kb_cuda_module kb_cuda_module;  /* a loaded CUBIN in the current context */
kb_status kb_cuda_module_load(kb_ctx *ctx, kb_cuda *c, const void *cubin, size_t size,
                              kb_cuda_module **out);
void kb_cuda_module_unload(kb_cuda *c, kb_cuda_module *m);
/* An entry point; *fn is an opaque CUfunction owned by the module. Above KB_SMEM_PORTABLE of
 * shared memory (static and smem_bytes dynamic together) it opts the function in. */
kb_status kb_cuda_function(kb_ctx *ctx, kb_cuda *c, kb_cuda_module *m, const char *name,
                           int smem_bytes, void **fn, int *regs, int *spill_bytes);
/* cuLaunchKernel on stream (a CUstream; NULL = the legacy default stream). args: pointers to
 * each argument's value, as the driver takes them. */
kb_status kb_cuda_launch(kb_ctx *ctx, kb_cuda *c, void *fn, const uint32_t grid[3], int block,
                         int smem_bytes, void *stream, void **args);
/* Whether stream is being captured into a CUDA graph (cuStreamIsCapturing). */
kb_status kb_cuda_stream_capturing(kb_ctx *ctx, kb_cuda *c, void *stream, int *capturing);
/* cuStreamSynchronize(stream), or cuCtxSynchronize when stream is NULL. */
kb_status kb_cuda_synchronize(kb_ctx *ctx, kb_cuda *c, void *stream);
/* Device memory in the current (or primary) context, for tests and scratch buffers. */
kb_status kb_cuda_mem_alloc(kb_ctx *ctx, kb_cuda *c, size_t bytes, uint64_t *dptr);
void kb_cuda_mem_free(kb_cuda *c, uint64_t dptr);
kb_status kb_cuda_copy_to_device(kb_ctx *ctx, kb_cuda *c, uint64_t dst, const void *src, size_t bytes);
kb_status kb_cuda_copy_to_host(kb_ctx *ctx, kb_cuda *c, void *dst, uint64_t src, size_t bytes);

/* cuBLASLt (cuda/cublaslt.c), dlopen'ed (never linked): the first of names[0..n) that opens
 * (n == 0: "libcublasLt.so.13", then ".so.12"); the caller passes the copy torch loaded.
 * KB_ERR_NOT_FOUND names every attempt, or the entry point a library lacks. Owned by the
 * caller: kb_lt_close (which destroys its per-device handles; the library stays loaded). */
typedef struct kb_lt kb_lt;
kb_status kb_lt_open(kb_ctx *ctx, const char *const *names, int n, kb_lt **out);
void kb_lt_close(kb_lt *lt);
const char *kb_lt_path(const kb_lt *lt);   /* the name that opened */
size_t kb_lt_version(const kb_lt *lt);     /* cublasLtGetVersion: 130100 = 13.1.0 */

/* What follows the product, in kbench's row-major terms (D[m,n] = A[m,k] B[k,n]):
 * bias is [n] (BIAS..GELU_AUX_BIAS read it); GELU_AUX_BIAS writes the pre-activation to aux;
 * DGELU reads aux (h) and writes D = (A B) * gelu'(h); DGELU_BGRAD also writes the column sums
 * of that D to bgrad [n]; BGRADB writes the row sums of A (sum over k) to bgrad [m], the bias
 * gradient of a weight-gradient GEMM dW = dYᵀ X with A = dYᵀ. cuBLASLt's GELU is the tanh
 * approximation (torch's gelu(approximate='tanh')). */
typedef enum kb_lt_epilogue {
    KB_LT_NONE = 0, KB_LT_BIAS, KB_LT_RELU_BIAS, KB_LT_GELU_BIAS, KB_LT_GELU_AUX_BIAS, KB_LT_DGELU,
    KB_LT_DGELU_BGRAD, KB_LT_BGRADB, KB_LT_EPILOGUE_COUNT
} kb_lt_epilogue;
const char *kb_lt_epilogue_name(kb_lt_epilogue e);   /* "none", "bias", ..., "bgradb"; NULL if bad */

/* One matrix operand: element [i, j] of batch b at ptr + (b*batch_stride + i*row_stride +
 * j*col_stride) elements; row_stride or col_stride must be 1 (a row-major matrix or a transposed
 * view of one). A size-1 dimension's stride is ignored. batch_stride 0: one matrix for all. */
typedef struct kb_lt_matrix {
    void *ptr;
    int64_t rows, cols, row_stride, col_stride, batch_stride;
} kb_lt_matrix;

typedef struct kb_lt_args {
    int device;          /* the caller makes it current; one handle and algorithm cache each */
    void *stream;        /* a cudaStream_t (NULL: the legacy default stream) */
    kb_dtype dtype;      /* of a, b, d, bias, aux and bgrad: KB_BF16, KB_F16 (f32 compute) or KB_F32 */
    int tf32;            /* f32 only: compute in TF32 (CUBLAS_COMPUTE_32F_FAST_TF32) */
    int64_t batch;       /* >= 1 */
    kb_lt_matrix a, b, d;  /* [m, k], [k, n], [m, n]; d must be row-major (col_stride 1) */
    kb_lt_epilogue epilogue;
    void *bias;          /* [n], read: BIAS, RELU_BIAS, GELU_BIAS, GELU_AUX_BIAS (one for all batches) */
    void *bgrad;         /* written: [n] for DGELU_BGRAD, [m] for BGRADB (batch 1 only) */
    void *aux;           /* [m, n] rows aux_ld elements apart, batches aux_batch_stride apart */
    int64_t aux_ld, aux_batch_stride;
    void *workspace;     /* device memory for cuBLASLt; 32 MiB lets it pick any algorithm */
    size_t workspace_bytes;
} kb_lt_args;

/* The checks kb_lt_matmul makes before it calls anything: sizes, strides, which operands the
 * epilogue needs and forbids, aux's leading dimension (cuBLASLt: a multiple of 8, >= n). */
kb_status kb_lt_check(kb_ctx *ctx, const kb_lt_args *args);
/* D = epilogue(A B (+ bias)) on args->stream, cuBLASLt's algorithm from its heuristic, kept per
 * (shapes, strides, dtypes, epilogue, alignments, workspace, device). Thread-safe. */
kb_status kb_lt_matmul(kb_ctx *ctx, kb_lt *lt, const kb_lt_args *args);

/* ---------------------------------------------------------------- search (tune/evolve.c) */

/* Legal for region r at the example sizes symvals on dev (NULL: KB_SMEM_PORTABLE, see
 * kb_device_info):
 *   threads  32..1024, a power of two
 *   vec      1, 2, 4, 8 with vec * (narrowest full-size element) <= 16 bytes; ROW and COL also
 *            need the anchor's last dim (at symvals, where it varies) a multiple of vec
 *   items    1, 2, 4, 8
 *   rows     ROW: a power of two <= 256 and <= threads; the threads per row (threads/rows) at
 *            most max(32, the row's vectors rounded up to a power of two); 1 elsewhere
 *   cache    ROW: regs or smem only with a pinned row length; regs when the row fits in
 *            registers (vectors per thread * vec * full-size inputs <= 64, 32 at 1024 threads);
 *            smem when rows * row * (full-size input bytes) <= the device's shared memory
 *   col_split COL: 1..64; > 1 only with no reduction or full-size output after a reduction, and
 *            col_split * 8 <= the column height; 1 elsewhere
 *   row_split ROW: 1..4096; > 1 only where every row reduction merges from partials (one that reads
 *            no other row reduction, softmax's sum of exp(y - max) with its max, the sum of squares
 *            about a mean of the same values), with no column sums, rows = 1, persistent = 0, cache
 *            regs or reread, and each part (the row / row_split) at least 1024 elements; the
 *            thread, vector and cache rules above then apply to the part instead of the row
 *   COL      threads at most max(32, columns / vec rounded up to a power of two)
 *   POINTWISE threads > 256 only when threads * vec <= elements; items > 1 only when
 *            threads * vec * items <= elements
 * Returns 0 for an illegal genome, an EXTERN or missing region, or when the scratch it needs
 * cannot be allocated (kb_ctx_error then says so). */
int kb_genome_legal(const kb_partition *p, int32_t r, const int64_t *symvals, const kb_device_info *dev,
                    const kb_genome *gn);

/* An ask/tell genetic search over the legal genomes of one region: a seed population (the
 * default genome, then random legal ones), then generations bred from the successes of the last
 * one plus the two best ever (elitism): tournament selection (k = 3), gene-wise uniform
 * crossover, one or two genes mutated. Genes a region ignores are pinned to one value (the
 * canonical form), and no canonical genome is asked twice in a search. Seeded (xoshiro256**):
 * the same seed and the same tells give the same asks. The partition is borrowed (it must
 * outlive the search); allocation and errors go through its graph's context. */
typedef struct kb_evolve kb_evolve;
/* population <= 0: the default (12). The caller owns *out (kb_evolve_free). */
kb_status kb_evolve_new(const kb_partition *p, int32_t r, const int64_t *symvals, const kb_device_info *dev,
                        uint64_t seed, int population, kb_evolve **out);
void kb_evolve_free(kb_evolve *ev);
/* Up to max candidates of the current generation not handed out yet; when it has all been
 * handed out, the next generation is bred first (from what was told so far). One call never
 * spans two generations. The first candidate of the first call is the default genome. *n == 0:
 * the legal space is exhausted. On KB_ERR_OOM the search is unchanged (the call may be retried). */
kb_status kb_evolve_ask(kb_evolve *ev, kb_genome *out, int max, int *n);
/* The fitness of a candidate: its time in ms, or a negative number for a failure (compile,
 * verification, trap); failures never become parents. A genome never asked is remembered as
 * seen (it will not be asked). KB_ERR_INVALID for an illegal genome or a NaN. */
kb_status kb_evolve_tell(kb_evolve *ev, const kb_genome *gn, double ms);
/* The fastest success so far (ties: the earliest); 0 if none succeeded. */
int kb_evolve_best(const kb_evolve *ev, kb_genome *out, double *ms);
/* The generation of the latest batch (0 for the seed population and before the first ask). */
int kb_evolve_generation(const kb_evolve *ev);
/* The values the search draws gene `gene` from (genes in kb_genome field order: 0 threads,
 * 1 vec, 2 rows, 3 items, 4 cache, 5 two_pass, 6 fast_math, 7 persistent, 8 col_split,
 * 9 row_split), sorted;
 * writes at most max of them and returns how many there are (0 for a bad gene). */
int kb_evolve_domain(const kb_evolve *ev, int gene, int32_t *values, int max);

#ifdef __cplusplus
}
#endif
#endif /* KBENCH_H */
