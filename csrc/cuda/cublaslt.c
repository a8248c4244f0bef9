/* cublaslt.c — cuBLASLt (libcublasLt), dlopen'ed at run time (never linked, no CUDA headers):
 * D = epilogue(A B + bias) for kbench's row-major matrices, one cuBLASLt handle per device made
 * on first use, the heuristic's algorithm cached per problem. */
#include "cuda/cuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>

/* ---------------------------------------------------------------- cuBLASLt's ABI
 * Types and values as declared by cublasLt.h, cublas_api.h and library_types.h of CUDA 12.6
 * (cuBLAS 12.6.4); cuBLAS keeps them across 12.x and 13.x (new values are appended, none
 * renumbered), and torch's aten/src/ATen/cuda/CUDABlas.cpp passes the same names to both. An
 * enum parameter is an int in the ABI. */
typedef int lt_status;                        /* cublasStatus_t */
enum {
    LT_STATUS_SUCCESS = 0,                    /* CUBLAS_STATUS_SUCCESS */
    LT_STATUS_NOT_SUPPORTED = 15,             /* CUBLAS_STATUS_NOT_SUPPORTED */
};
typedef struct lt_context *lt_handle;         /* cublasLtHandle_t */
typedef struct lt_desc_st *lt_desc;           /* cublasLtMatmulDesc_t (opaque to us) */
typedef struct lt_layout_st *lt_layout;       /* cublasLtMatrixLayout_t */
typedef struct lt_pref_st *lt_pref;           /* cublasLtMatmulPreference_t */
typedef struct { uint64_t data[8]; } lt_algo; /* cublasLtMatmulAlgo_t */
typedef struct {                              /* cublasLtMatmulHeuristicResult_t */
    lt_algo algo;
    size_t workspaceSize;
    lt_status state;
    float wavesCount;
    int reserved[4];
} lt_heuristic;

enum {
    /* cudaDataType_t (library_types.h) */
    CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14,
    /* cublasComputeType_t (cublas_api.h) */
    CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
    /* cublasOperation_t */
    CUBLAS_OP_N = 0, CUBLAS_OP_T = 1,
    /* cublasLtMatrixLayoutAttribute_t: BATCH_COUNT int32_t, STRIDED_BATCH_OFFSET int64_t */
    CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6,
    /* cublasLtMatmulDescAttributes_t: TRANSA/B int32_t, EPILOGUE uint32_t, the pointers void *,
     * the leading dimension and batch strides int64_t */
    CUBLASLT_MATMUL_DESC_TRANSA = 3, CUBLASLT_MATMUL_DESC_TRANSB = 4, CUBLASLT_MATMUL_DESC_EPILOGUE = 7,
    CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE = 10,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE = 13,
    /* cublasLtMatmulPreferenceAttributes_t: MAX_WORKSPACE_BYTES uint64_t, MIN_ALIGNMENT_* uint32_t */
    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8,
    /* cublasLtEpilogue_t: RELU 2, BIAS 4, GELU 32, AUX 128, DGELU 64|128, BGRAD 16 */
    CUBLASLT_EPILOGUE_DEFAULT = 1, CUBLASLT_EPILOGUE_BIAS = 4, CUBLASLT_EPILOGUE_RELU_BIAS = 6,
    CUBLASLT_EPILOGUE_GELU_BIAS = 36, CUBLASLT_EPILOGUE_GELU_AUX_BIAS = 164, CUBLASLT_EPILOGUE_DGELU = 192,
    CUBLASLT_EPILOGUE_DGELU_BGRAD = 208, CUBLASLT_EPILOGUE_BGRADB = 512,
};

/* the oldest cuBLASLt with every epilogue used here (DGELU_BGRAD, BGRADB): 11.4 */
#define LT_MIN_VERSION 110400
#define LT_MAX_DEVICES 64
/* an algorithm cache key: the problem as kb_lt_matmul describes it to cuBLASLt (see key_of) */
#define LT_KEY_WORDS 24

static const struct {
    const char *name;
    uint32_t value;       /* cublasLtEpilogue_t */
    unsigned bias : 1, aux : 1, bgrad : 1;
} epilogues[KB_LT_EPILOGUE_COUNT] = {
    [KB_LT_NONE] = {"none", CUBLASLT_EPILOGUE_DEFAULT, 0, 0, 0},
    [KB_LT_BIAS] = {"bias", CUBLASLT_EPILOGUE_BIAS, 1, 0, 0},
    [KB_LT_RELU_BIAS] = {"relu_bias", CUBLASLT_EPILOGUE_RELU_BIAS, 1, 0, 0},
    [KB_LT_GELU_BIAS] = {"gelu_bias", CUBLASLT_EPILOGUE_GELU_BIAS, 1, 0, 0},
    [KB_LT_GELU_AUX_BIAS] = {"gelu_aux_bias", CUBLASLT_EPILOGUE_GELU_AUX_BIAS, 1, 1, 0},
    [KB_LT_DGELU] = {"dgelu", CUBLASLT_EPILOGUE_DGELU, 0, 1, 0},
    [KB_LT_DGELU_BGRAD] = {"dgelu_bgrad", CUBLASLT_EPILOGUE_DGELU_BGRAD, 0, 1, 1},
    [KB_LT_BGRADB] = {"bgradb", CUBLASLT_EPILOGUE_BGRADB, 0, 0, 1},
};

typedef struct {
    uint64_t key[LT_KEY_WORDS];
    lt_algo algo;
    int used;
} lt_entry;

struct kb_lt {
    kb_ctx *ctx;     /* allocated this struct and the cache */
    void *lib;
    char *path;
    size_t version;
    pthread_mutex_t lock;  /* handles[] and the cache */
    lt_handle handles[LT_MAX_DEVICES];
    lt_entry *cache;       /* open addressing, cap a power of 2 (0: none yet) */
    size_t cap, count;
    lt_status (*Create)(lt_handle *);
    lt_status (*Destroy)(lt_handle);
    const char *(*GetStatusName)(lt_status);
    const char *(*GetStatusString)(lt_status);
    size_t (*GetVersion)(void);
    lt_status (*MatmulDescCreate)(lt_desc *, int, int);
    lt_status (*MatmulDescDestroy)(lt_desc);
    lt_status (*MatmulDescSetAttribute)(lt_desc, int, const void *, size_t);
    lt_status (*MatrixLayoutCreate)(lt_layout *, int, uint64_t, uint64_t, int64_t);
    lt_status (*MatrixLayoutDestroy)(lt_layout);
    lt_status (*MatrixLayoutSetAttribute)(lt_layout, int, const void *, size_t);
    lt_status (*MatmulPreferenceCreate)(lt_pref *);
    lt_status (*MatmulPreferenceDestroy)(lt_pref);
    lt_status (*MatmulPreferenceSetAttribute)(lt_pref, int, const void *, size_t);
    lt_status (*MatmulAlgoGetHeuristic)(lt_handle, lt_desc, lt_layout, lt_layout, lt_layout, lt_layout, lt_pref, int,
                                        lt_heuristic *, int *);
    lt_status (*Matmul)(lt_handle, lt_desc, const void *, const void *, lt_layout, const void *, lt_layout,
                        const void *, const void *, lt_layout, void *, lt_layout, const lt_algo *, void *, size_t,
                        void *);
};

static const struct { size_t off; const char *name; } lt_syms[] = {
    {offsetof(kb_lt, Create), "cublasLtCreate"},
    {offsetof(kb_lt, Destroy), "cublasLtDestroy"},
    {offsetof(kb_lt, GetStatusName), "cublasLtGetStatusName"},
    {offsetof(kb_lt, GetStatusString), "cublasLtGetStatusString"},
    {offsetof(kb_lt, GetVersion), "cublasLtGetVersion"},
    {offsetof(kb_lt, MatmulDescCreate), "cublasLtMatmulDescCreate"},
    {offsetof(kb_lt, MatmulDescDestroy), "cublasLtMatmulDescDestroy"},
    {offsetof(kb_lt, MatmulDescSetAttribute), "cublasLtMatmulDescSetAttribute"},
    {offsetof(kb_lt, MatrixLayoutCreate), "cublasLtMatrixLayoutCreate"},
    {offsetof(kb_lt, MatrixLayoutDestroy), "cublasLtMatrixLayoutDestroy"},
    {offsetof(kb_lt, MatrixLayoutSetAttribute), "cublasLtMatrixLayoutSetAttribute"},
    {offsetof(kb_lt, MatmulPreferenceCreate), "cublasLtMatmulPreferenceCreate"},
    {offsetof(kb_lt, MatmulPreferenceDestroy), "cublasLtMatmulPreferenceDestroy"},
    {offsetof(kb_lt, MatmulPreferenceSetAttribute), "cublasLtMatmulPreferenceSetAttribute"},
    {offsetof(kb_lt, MatmulAlgoGetHeuristic), "cublasLtMatmulAlgoGetHeuristic"},
    {offsetof(kb_lt, Matmul), "cublasLtMatmul"},
};

const char *kb_lt_epilogue_name(kb_lt_epilogue e) {
    return (unsigned)e < KB_LT_EPILOGUE_COUNT ? epilogues[e].name : NULL;
}

/* ---------------------------------------------------------------- open and close */

kb_status kb_lt_open(kb_ctx *ctx, const char *const *names, int n, kb_lt **out) {
    static const char *const sonames[] = {"libcublasLt.so.13", "libcublasLt.so.12"};
    kb_status st = KB_OK;
    kb_lt *lt = NULL;
    char tried[2048] = "";   /* each attempt's dlerror, for the message */
    size_t used = 0;
    KB_CHECK(ctx, out && (names || n == 0) && n >= 0, KB_ERR_INVALID, "kb_lt_open: bad arguments");
    *out = NULL;
    if (n == 0) names = sonames, n = (int)(sizeof sonames / sizeof sonames[0]);
    lt = kb_calloc(ctx, 1, sizeof *lt);
    KB_CHECK(ctx, lt, KB_ERR_OOM, "out of memory");
    lt->ctx = ctx;
    for (int i = 0; i < n && !lt->lib; i++) {
        KB_CHECK(ctx, names[i], KB_ERR_INVALID, "kb_lt_open: names[%d] is NULL", i);
        if ((lt->lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL))) {
            lt->path = kb_strdup(ctx, names[i]);
            KB_CHECK(ctx, lt->path, KB_ERR_OOM, "out of memory");
        } else {
            const char *e = dlerror();
            int w = e ? snprintf(tried + used, sizeof tried - used, "\n  %s", e)
                      : snprintf(tried + used, sizeof tried - used, "\n  %s: dlopen failed", names[i]);
            if (w > 0) used = (size_t)w < sizeof tried - used ? used + (size_t)w : sizeof tried - 1;
        }
    }
    KB_CHECK(ctx, lt->lib, KB_ERR_NOT_FOUND, "cuBLASLt (libcublasLt) not found; tried:%s", tried);
    for (size_t i = 0; i < sizeof lt_syms / sizeof lt_syms[0]; i++)
        KB_CHECK(ctx, load_sym(lt->lib, (char *)lt + lt_syms[i].off, lt_syms[i].name, NULL), KB_ERR_NOT_FOUND,
                 "%s has no %s: not cuBLASLt, or older than 11.4", lt->path, lt_syms[i].name);
    lt->version = lt->GetVersion();
    KB_CHECK(ctx, lt->version >= LT_MIN_VERSION, KB_ERR_NOT_FOUND,
             "%s is cuBLASLt %zu.%zu: the GELU and bias-gradient epilogues need 11.4 or later", lt->path,
             lt->version / 10000, lt->version / 100 % 100);
    KB_CHECK(ctx, pthread_mutex_init(&lt->lock, NULL) == 0, KB_ERR_OOM, "kb_lt_open: no mutex");
    *out = lt;
    lt = NULL;
cleanup:
    if (lt) {
        /* NOTE: a library that opened stays loaded (see kb_lt_close) */
        kb_string_free(ctx, lt->path);
        kb_free(ctx, lt, sizeof *lt);
    }
    return st;
}

void kb_lt_close(kb_lt *lt) {
    if (!lt) return;
    for (int d = 0; d < LT_MAX_DEVICES; d++)
        if (lt->handles[d]) lt->Destroy(lt->handles[d]);
    if (lt->cache) kb_free(lt->ctx, lt->cache, lt->cap * sizeof *lt->cache);
    pthread_mutex_destroy(&lt->lock);
    kb_string_free(lt->ctx, lt->path);
    /* NOTE: libcublasLt stays loaded: torch holds the same copy, and cuBLAS registers its own
     * teardown, which must not find its code unmapped at exit. */
    kb_free(lt->ctx, lt, sizeof *lt);
}

const char *kb_lt_path(const kb_lt *lt) { return lt ? lt->path : ""; }
size_t kb_lt_version(const kb_lt *lt) { return lt ? lt->version : 0; }

/* ---------------------------------------------------------------- checks */

/* The layout of x as cuBLAS sees it: 0 row-major (*ld = its row stride), 1 column-major (a
 * transposed view: *ld = its column stride), -1 neither. A size-1 dimension's stride is never
 * used, so it does not decide; where both fit (a single row or column), row-major. */
static int layout_of(const kb_lt_matrix *x, int64_t *ld) {
    if ((x->cols == 1 || x->col_stride == 1) && (x->rows == 1 || x->row_stride >= x->cols)) {
        *ld = x->rows == 1 ? x->cols : x->row_stride;
        return 0;
    }
    if ((x->rows == 1 || x->row_stride == 1) && (x->cols == 1 || x->col_stride >= x->rows)) {
        *ld = x->cols == 1 ? x->rows : x->col_stride;
        return 1;
    }
    return -1;
}

/* sizes and strides stay below 2^40: a stride times an element size never overflows, and the
 * batch strides are compared by division, not against a product of two */
#define LT_LIMIT ((int64_t)1 << 40)

static kb_status check_matrix(kb_ctx *ctx, const kb_lt_matrix *x, const char *what, int64_t rows, int64_t cols) {
    kb_status st = KB_OK;
    int64_t ld;
    KB_CHECK(ctx, x->ptr, KB_ERR_INVALID, "%s: no data pointer", what);
    KB_CHECK(ctx, x->rows == rows && x->cols == cols, KB_ERR_INVALID, "%s is [%lld, %lld]; [%lld, %lld] expected",
             what, (long long)x->rows, (long long)x->cols, (long long)rows, (long long)cols);
    KB_CHECK(ctx, rows >= 1 && cols >= 1 && rows < LT_LIMIT && cols < LT_LIMIT, KB_ERR_INVALID,
             "%s: sizes [%lld, %lld] out of range (1 to 2^40)", what, (long long)rows, (long long)cols);
    KB_CHECK(ctx, x->row_stride >= 0 && x->col_stride >= 0 && x->batch_stride >= 0 && x->row_stride < LT_LIMIT &&
                      x->col_stride < LT_LIMIT && x->batch_stride < LT_LIMIT,
             KB_ERR_INVALID, "%s: strides (%lld, %lld, batch %lld) out of range (0 to 2^40)", what,
             (long long)x->row_stride, (long long)x->col_stride, (long long)x->batch_stride);
    KB_CHECK(ctx, layout_of(x, &ld) >= 0, KB_ERR_INVALID,
             "%s: strides (%lld, %lld) for [%lld, %lld]: cuBLASLt needs its rows or its columns contiguous", what,
             (long long)x->row_stride, (long long)x->col_stride, (long long)rows, (long long)cols);
cleanup:
    return st;
}

kb_status kb_lt_check(kb_ctx *ctx, const kb_lt_args *a) {
    kb_status st = KB_OK;
    int64_t m, n, k, ld;
    KB_CHECK(ctx, a, KB_ERR_INVALID, "kb_lt_check: NULL argument");
    KB_CHECK(ctx, a->dtype == KB_BF16 || a->dtype == KB_F16 || a->dtype == KB_F32, KB_ERR_INVALID,
             "cuBLASLt matmul takes bf16, f16 or f32 operands, not %s", kb_dtype_name(a->dtype));
    KB_CHECK(ctx, !a->tf32 || a->dtype == KB_F32, KB_ERR_INVALID, "tf32 is for f32 operands only");
    KB_CHECK(ctx, (unsigned)a->epilogue < KB_LT_EPILOGUE_COUNT, KB_ERR_INVALID, "unknown epilogue %d", (int)a->epilogue);
    KB_CHECK(ctx, a->batch >= 1 && a->batch <= INT32_MAX, KB_ERR_INVALID, "batch %lld out of range (1 to 2^31-1)",
             (long long)a->batch);
    KB_CHECK(ctx, a->device >= 0 && a->device < LT_MAX_DEVICES, KB_ERR_INVALID, "device %d out of range", a->device);
    m = a->a.rows, k = a->a.cols, n = a->b.cols;
    KB_TRY(check_matrix(ctx, &a->a, "a", m, k));
    KB_TRY(check_matrix(ctx, &a->b, "b", k, n));
    KB_TRY(check_matrix(ctx, &a->d, "d", m, n));
    KB_CHECK(ctx, (n == 1 || a->d.col_stride == 1) && layout_of(&a->d, &ld) == 0, KB_ERR_INVALID,
             "d: strides (%lld, %lld): the output must be row-major (its rows contiguous)", (long long)a->d.row_stride,
             (long long)a->d.col_stride);
    /* batches of d are written: they must not overlap (a and b may repeat one matrix: stride 0) */
    KB_CHECK(ctx, a->batch == 1 || a->d.batch_stride / ld >= m, KB_ERR_INVALID,
             "d: batch stride %lld under its matrix's %lld rows of %lld elements", (long long)a->d.batch_stride,
             (long long)m, (long long)ld);
    const char *ep = epilogues[a->epilogue].name;
    KB_CHECK(ctx, !epilogues[a->epilogue].bias == !a->bias, KB_ERR_INVALID, "epilogue %s %s bias", ep,
             epilogues[a->epilogue].bias ? "needs a" : "takes no");
    KB_CHECK(ctx, !epilogues[a->epilogue].aux == !a->aux, KB_ERR_INVALID, "epilogue %s %s aux matrix", ep,
             epilogues[a->epilogue].aux ? "needs an" : "takes no");
    KB_CHECK(ctx, !epilogues[a->epilogue].bgrad == !a->bgrad, KB_ERR_INVALID, "epilogue %s %s bias gradient", ep,
             epilogues[a->epilogue].bgrad ? "needs a" : "takes no");
    KB_CHECK(ctx, !a->bgrad || a->batch == 1, KB_ERR_INVALID, "epilogue %s: no batch (one bias gradient)", ep);
    if (a->aux) {
        /* cublasLt.h, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: for GELU_AUX_BIAS and DGELU(_BGRAD)
         * "must be divisible by 8 and be no less than the number of rows in the output matrix"
         * (its rows are our columns: n); the batch stride "must be divisible by 8" */
        KB_CHECK(ctx, a->aux_ld >= n && a->aux_ld % 8 == 0 && a->aux_ld < LT_LIMIT, KB_ERR_INVALID,
                 "aux: leading dimension %lld: cuBLASLt needs a multiple of 8 of at least n = %lld",
                 (long long)a->aux_ld, (long long)n);
        KB_CHECK(ctx, a->batch == 1 || (a->aux_batch_stride % 8 == 0 && a->aux_batch_stride / a->aux_ld >= m &&
                                        a->aux_batch_stride < LT_LIMIT),
                 KB_ERR_INVALID, "aux: batch stride %lld: cuBLASLt needs a multiple of 8, at least m = %lld rows of %lld",
                 (long long)a->aux_batch_stride, (long long)m, (long long)a->aux_ld);
    }
    KB_CHECK(ctx, a->workspace || !a->workspace_bytes, KB_ERR_INVALID, "workspace: %zu bytes at NULL",
             a->workspace_bytes);
cleanup:
    return st;
}

/* ---------------------------------------------------------------- the algorithm cache */

static uint64_t key_hash(const uint64_t *key) {
    uint64_t h = 1469598103934665603ull;   /* FNV-1a over the words */
    for (int i = 0; i < LT_KEY_WORDS; i++) h = (h ^ key[i]) * 1099511628211ull;
    return h;
}

/* The slot of key in the table (its own, or the empty one where it would go). */
static lt_entry *cache_slot(kb_lt *lt, const uint64_t *key) {
    size_t i = (size_t)key_hash(key) & (lt->cap - 1);
    while (lt->cache[i].used && memcmp(lt->cache[i].key, key, sizeof lt->cache[i].key) != 0) i = (i + 1) & (lt->cap - 1);
    return &lt->cache[i];
}

/* Adds key -> algo, doubling the table at 3/4 full. Under lt->lock. */
static kb_status cache_put(kb_ctx *ctx, kb_lt *lt, const uint64_t *key, const lt_algo *algo) {
    kb_status st = KB_OK;
    if (4 * (lt->count + 1) > 3 * lt->cap) {
        size_t cap = lt->cap ? 2 * lt->cap : 64, old_cap = lt->cap;
        lt_entry *fresh = kb_calloc(lt->ctx, cap, sizeof *fresh), *old = lt->cache;
        KB_CHECK(ctx, fresh, KB_ERR_OOM, "out of memory (cuBLASLt's algorithm cache)");
        lt->cache = fresh, lt->cap = cap;
        for (size_t i = 0; i < old_cap; i++)
            if (old[i].used) *cache_slot(lt, old[i].key) = old[i];
        if (old) kb_free(lt->ctx, old, old_cap * sizeof *old);
    }
    lt_entry *e = cache_slot(lt, key);
    memcpy(e->key, key, sizeof e->key);
    e->algo = *algo;
    e->used = 1;
    lt->count++;
cleanup:
    return st;
}

/* ---------------------------------------------------------------- matmul */

static kb_status lt_fail(kb_ctx *ctx, const kb_lt *lt, lt_status r, const char *call, const char *file, int line) {
    const char *name = lt->GetStatusName(r), *desc = lt->GetStatusString(r);
    return kb_fail(ctx, KB_ERR_CUDA, file, line, "%s failed: %s (%d: %s)", call, name ? name : "CUBLAS_STATUS_?", r,
                   desc ? desc : "no description");
}

/* Calls lt->name(...); on failure records "cublasLt<name> failed: CUBLAS_STATUS_X (n: text)". */
#define LT_TRY(name, ...)                                                          \
    do {                                                                           \
        lt_status r_ = lt->name(__VA_ARGS__);                                      \
        if (r_ != LT_STATUS_SUCCESS) {                                             \
            st = lt_fail(ctx, lt, r_, "cublasLt" #name, __FILE__, __LINE__);       \
            goto cleanup;                                                          \
        }                                                                          \
    } while (0)

/* The alignment cuBLASLt may assume of a matrix: the largest power of two (at most 256) that
 * divides its address and, in bytes, its leading dimension and batch stride. The preference's
 * default is 256: an algorithm chosen for that would read a less aligned operand wrong. */
static uint32_t alignment(const void *p, int64_t ld, int64_t batch_stride, size_t esize) {
    uint64_t bits = (uint64_t)(uintptr_t)p | (uint64_t)ld * esize | (uint64_t)batch_stride * esize | 256u;
    return (uint32_t)(bits & (~bits + 1));
}

static kb_status layout_new(kb_ctx *ctx, kb_lt *lt, int type, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                            int64_t batch_stride, lt_layout *out) {
    kb_status st = KB_OK;
    int32_t count = (int32_t)batch;
    LT_TRY(MatrixLayoutCreate, out, type, (uint64_t)rows, (uint64_t)cols, ld);
    if (batch > 1) {
        LT_TRY(MatrixLayoutSetAttribute, *out, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count);
        LT_TRY(MatrixLayoutSetAttribute, *out, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &batch_stride,
                                            sizeof batch_stride);
    }
cleanup:
    return st;
}

/* Sets a descriptor attribute from the variable holding its value (of the attribute's type). */
#define DESC_SET(attr, var) LT_TRY(MatmulDescSetAttribute, desc, CUBLASLT_MATMUL_DESC_##attr, &(var), sizeof(var))

kb_status kb_lt_matmul(kb_ctx *ctx, kb_lt *lt, const kb_lt_args *a) {
    kb_status st = KB_OK;
    lt_desc desc = NULL;
    lt_layout la = NULL, lb = NULL, ld_ = NULL;
    lt_pref pref = NULL;
    lt_handle handle = NULL;
    lt_algo algo;
    int locked = 0, found = 0;
    KB_CHECK(ctx, lt, KB_ERR_INVALID, "kb_lt_matmul: NULL handle");
    KB_TRY(kb_lt_check(ctx, a));
    const int64_t m = a->a.rows, k = a->a.cols, n = a->b.cols, batch = a->batch;
    const size_t es = kb_dtype_size(a->dtype);
    const int type = a->dtype == KB_BF16 ? CUDA_R_16BF : a->dtype == KB_F16 ? CUDA_R_16F : CUDA_R_32F;
    const int compute = a->tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    /* cuBLAS is column-major: a row-major [r, c] matrix is a column-major [c, r] one, so D = A B
     * is computed as Dᵀ = Bᵀ Aᵀ: cuBLAS's A is our b, its B our a, its m our n. An operand
     * given column-major (a transposed view) is the plain one under op T. */
    int64_t ldb, lda, ldd;
    const int tb = layout_of(&a->b, &ldb), ta = layout_of(&a->a, &lda);
    layout_of(&a->d, &ldd);
    const uint32_t align_b = alignment(a->b.ptr, ldb, a->b.batch_stride, es);
    const uint32_t align_a = alignment(a->a.ptr, lda, a->a.batch_stride, es);
    const uint32_t align_d = alignment(a->d.ptr, ldd, a->d.batch_stride, es);
    const void *vec = a->bias ? a->bias : a->bgrad;
    const uint64_t key[LT_KEY_WORDS] = {
        (uint64_t)a->device, (uint64_t)a->dtype, (uint64_t)a->tf32, (uint64_t)a->epilogue, (uint64_t)m, (uint64_t)n,
        (uint64_t)k, (uint64_t)batch, (uint64_t)ta, (uint64_t)tb, (uint64_t)lda, (uint64_t)ldb, (uint64_t)ldd,
        (uint64_t)a->a.batch_stride, (uint64_t)a->b.batch_stride, (uint64_t)a->d.batch_stride, (uint64_t)a->aux_ld,
        (uint64_t)a->aux_batch_stride, align_a, align_b, align_d, vec ? alignment(vec, 0, 0, es) : 0,
        a->aux ? alignment(a->aux, a->aux_ld, a->aux_batch_stride, es) : 0, (uint64_t)a->workspace_bytes,
    };

    const int32_t op_a = tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    const uint32_t epilogue = epilogues[a->epilogue].value;
    const int64_t no_stride = 0;   /* one bias for every batch */
    void *vec_ptr = (void *)vec, *aux_ptr = a->aux;
    LT_TRY(MatmulDescCreate, &desc, compute, CUDA_R_32F);
    DESC_SET(TRANSA, op_a);
    DESC_SET(TRANSB, op_b);
    DESC_SET(EPILOGUE, epilogue);
    if (vec) DESC_SET(BIAS_POINTER, vec_ptr);
    if (a->bias && batch > 1) DESC_SET(BIAS_BATCH_STRIDE, no_stride);
    if (a->aux) {
        DESC_SET(EPILOGUE_AUX_POINTER, aux_ptr);
        DESC_SET(EPILOGUE_AUX_LD, a->aux_ld);
        if (batch > 1) DESC_SET(EPILOGUE_AUX_BATCH_STRIDE, a->aux_batch_stride);
    }
    KB_TRY(tb ? layout_new(ctx, lt, type, k, n, ldb, batch, a->b.batch_stride, &la)
              : layout_new(ctx, lt, type, n, k, ldb, batch, a->b.batch_stride, &la));
    KB_TRY(ta ? layout_new(ctx, lt, type, m, k, lda, batch, a->a.batch_stride, &lb)
              : layout_new(ctx, lt, type, k, m, lda, batch, a->a.batch_stride, &lb));
    KB_TRY(layout_new(ctx, lt, type, n, m, ldd, batch, a->d.batch_stride, &ld_));

    KB_CHECK(ctx, pthread_mutex_lock(&lt->lock) == 0, KB_ERR_INVALID, "kb_lt_matmul: lock failed");
    locked = 1;
    if (!lt->handles[a->device]) LT_TRY(Create, &lt->handles[a->device]);
    handle = lt->handles[a->device];
    if (lt->cap) {
        lt_entry *e = cache_slot(lt, key);
        if (e->used) algo = e->algo, found = 1;
    }
    if (!found) {
        lt_heuristic h;
        int count = 0;
        uint64_t ws = a->workspace_bytes;
        LT_TRY(MatmulPreferenceCreate, &pref);
        LT_TRY(MatmulPreferenceSetAttribute, pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
        LT_TRY(MatmulPreferenceSetAttribute, pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_b, sizeof align_b);
        LT_TRY(MatmulPreferenceSetAttribute, pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_a, sizeof align_a);
        LT_TRY(MatmulPreferenceSetAttribute, pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d, sizeof align_d);
        LT_TRY(MatmulPreferenceSetAttribute, pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof align_d);
        lt_status r = lt->MatmulAlgoGetHeuristic(handle, desc, la, lb, ld_, ld_, pref, 1, &h, &count);
        KB_CHECK(ctx, r == LT_STATUS_SUCCESS || r == LT_STATUS_NOT_SUPPORTED, KB_ERR_CUDA,
                 "cublasLtMatmulAlgoGetHeuristic failed: %s (%d)", lt->GetStatusName(r), r);
        KB_CHECK(ctx, r == LT_STATUS_SUCCESS && count > 0, KB_ERR_UNSUPPORTED,
                 "cuBLASLt has no algorithm for %s [%lld, %lld] x [%lld, %lld] (%s, batch %lld, epilogue %s, "
                 "alignments a %u b %u d %u, workspace %zu bytes)",
                 kb_dtype_name(a->dtype), (long long)m, (long long)k, (long long)k, (long long)n, ta ? "a transposed" : "a",
                 (long long)batch, epilogues[a->epilogue].name, align_a, align_b, align_d, a->workspace_bytes);
        algo = h.algo;
        KB_TRY(cache_put(ctx, lt, key, &algo));
    }
    pthread_mutex_unlock(&lt->lock);
    locked = 0;
    {
        const float one = 1.0f, zero = 0.0f;   /* scale type f32: host scalars */
        LT_TRY(Matmul, handle, desc, &one, a->b.ptr, la, a->a.ptr, lb, &zero, a->d.ptr, ld_, a->d.ptr, ld_, &algo,
                          a->workspace, a->workspace_bytes, a->stream);
    }
cleanup:
    if (locked) pthread_mutex_unlock(&lt->lock);
    if (pref) lt->MatmulPreferenceDestroy(pref);
    if (ld_) lt->MatrixLayoutDestroy(ld_);
    if (lb) lt->MatrixLayoutDestroy(lb);
    if (la) lt->MatrixLayoutDestroy(la);
    if (desc) lt->MatmulDescDestroy(desc);
    return st;
}
