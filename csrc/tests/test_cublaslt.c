/* test_cublaslt.c — cuda/cublaslt.c without a GPU: a library that is missing or is not
 * cuBLASLt gives KB_ERR_NOT_FOUND with a message naming it; kb_lt_check refuses every bad
 * argument kb_lt_matmul would otherwise hand to cuBLASLt (sizes, strides, the epilogue's
 * operands, aux's leading dimension); and kb_lt_matmul, run against a stand-in library
 * (fake_cublaslt.c: cuBLASLt's column-major semantics on host memory), gives the row-major
 * results computed here directly, for each epilogue, layout and a batch, with one handle per
 * device and one heuristic per problem and alignment. */
#include <dlfcn.h>
#include <math.h>
#include <string.h>

#include "tests/check.h"

static char buf[4][64];   /* stand-in device buffers: only their addresses are read */

/* D[5,7] = A[5,3] B[3,7], bf16, all row-major */
static kb_lt_args plain(void) {
    kb_lt_args a;
    memset(&a, 0, sizeof a);
    a.dtype = KB_BF16;
    a.batch = 1;
    a.a = (kb_lt_matrix){buf[0], 5, 3, 3, 1, 0};
    a.b = (kb_lt_matrix){buf[1], 3, 7, 7, 1, 0};
    a.d = (kb_lt_matrix){buf[2], 5, 7, 7, 1, 0};
    return a;
}

static void test_open(kb_ctx *ctx) {
    kb_lt *lt = (kb_lt *)1;
    const char *missing[] = {"/nonexistent/libcublasLt.so.13"};
    CHECK_STATUS(ctx, kb_lt_open(ctx, missing, 1, &lt), KB_ERR_NOT_FOUND);
    CHECK(lt == NULL);
    CHECK(strstr(kb_ctx_error(ctx), "cuBLASLt (libcublasLt) not found"));
    CHECK(strstr(kb_ctx_error(ctx), "/nonexistent/libcublasLt.so.13"));
    /* a library that opens but is not cuBLASLt: the first entry point it lacks */
    const char *not_lt[] = {"/nonexistent/libcublasLt.so.12", "libm.so.6"};
    CHECK_STATUS(ctx, kb_lt_open(ctx, not_lt, 2, &lt), KB_ERR_NOT_FOUND);
    CHECK_MSG(strstr(kb_ctx_error(ctx), "libm.so.6 has no cublasLtCreate"), "%s", kb_ctx_error(ctx));
    CHECK_STATUS(ctx, kb_lt_open(ctx, NULL, 1, &lt), KB_ERR_INVALID);
    kb_lt_close(NULL);
    CHECK_STATUS(ctx, kb_lt_matmul(ctx, NULL, NULL), KB_ERR_INVALID);
    CHECK(kb_lt_path(NULL)[0] == 0 && kb_lt_version(NULL) == 0);
}

static void test_names(void) {
    CHECK(!strcmp(kb_lt_epilogue_name(KB_LT_NONE), "none"));
    CHECK(!strcmp(kb_lt_epilogue_name(KB_LT_GELU_AUX_BIAS), "gelu_aux_bias"));
    CHECK(!strcmp(kb_lt_epilogue_name(KB_LT_BGRADB), "bgradb"));
    CHECK(kb_lt_epilogue_name(KB_LT_EPILOGUE_COUNT) == NULL);
}

/* args refused with a message holding `want` */
#define REFUSED(ctx, args, want)                                                            \
    do {                                                                                    \
        kb_lt_args x_ = (args);                                                             \
        CHECK_STATUS(ctx, kb_lt_check(ctx, &x_), KB_ERR_INVALID);                           \
        CHECK_MSG(strstr(kb_ctx_error(ctx), want), "'%s' not in '%s'", want, kb_ctx_error(ctx)); \
    } while (0)

static void test_check(kb_ctx *ctx) {
    kb_lt_args a = plain();
    CHECK_STATUS(ctx, kb_lt_check(ctx, &a), KB_OK);
    CHECK_STATUS(ctx, kb_lt_check(ctx, NULL), KB_ERR_INVALID);
    /* b as a Linear weight [7, 3] seen transposed; a as a transposed view; one row or column */
    a.b = (kb_lt_matrix){buf[1], 3, 7, 1, 3, 0};
    a.a = (kb_lt_matrix){buf[0], 5, 3, 1, 5, 0};
    CHECK_STATUS(ctx, kb_lt_check(ctx, &a), KB_OK);
    a = plain(), a.a = (kb_lt_matrix){buf[0], 1, 3, 99, 1, 0}, a.d = (kb_lt_matrix){buf[2], 1, 7, 0, 1, 0};
    CHECK_STATUS(ctx, kb_lt_check(ctx, &a), KB_OK);
    a = plain(), a.b = (kb_lt_matrix){buf[1], 3, 1, 1, 1, 0}, a.d = (kb_lt_matrix){buf[2], 5, 1, 1, 1, 0};
    CHECK_STATUS(ctx, kb_lt_check(ctx, &a), KB_OK);

    a = plain(), a.dtype = KB_F64;
    REFUSED(ctx, a, "bf16, f16 or f32 operands, not f64");
    a = plain(), a.tf32 = 1;
    REFUSED(ctx, a, "tf32 is for f32");
    a.dtype = KB_F32;
    CHECK_STATUS(ctx, kb_lt_check(ctx, &a), KB_OK);
    a = plain(), a.epilogue = KB_LT_EPILOGUE_COUNT;
    REFUSED(ctx, a, "unknown epilogue");
    a = plain(), a.b.rows = 4;
    REFUSED(ctx, a, "b is [4, 7]; [3, 7] expected");
    a = plain(), a.d.cols = 6;
    REFUSED(ctx, a, "d is [5, 6]");
    a = plain(), a.a = (kb_lt_matrix){buf[0], 0, 3, 3, 1, 0}, a.d.rows = 0;
    REFUSED(ctx, a, "out of range");
    a = plain(), a.a.col_stride = 2, a.a.row_stride = 6;   /* every other element: neither contiguous */
    REFUSED(ctx, a, "a: strides (6, 2) for [5, 3]: cuBLASLt needs its rows or its columns contiguous");
    a = plain(), a.b.row_stride = 5;                        /* rows overlap */
    REFUSED(ctx, a, "b: strides (5, 1)");
    a = plain(), a.d = (kb_lt_matrix){buf[2], 5, 7, 1, 5, 0};
    REFUSED(ctx, a, "the output must be row-major");
    a = plain(), a.a.ptr = NULL;
    REFUSED(ctx, a, "a: no data pointer");
    a = plain(), a.a.row_stride = -3;
    REFUSED(ctx, a, "out of range");
    a = plain(), a.batch = 0;
    REFUSED(ctx, a, "batch 0 out of range");
    a = plain(), a.device = -1;
    REFUSED(ctx, a, "device -1");
    a = plain(), a.workspace_bytes = 1 << 20;
    REFUSED(ctx, a, "workspace");

    /* batches: a and b may repeat one matrix, d's must not overlap */
    a = plain(), a.batch = 4, a.a.batch_stride = 15, a.d.batch_stride = 35;
    CHECK_STATUS(ctx, kb_lt_check(ctx, &a), KB_OK);
    a.d.batch_stride = 34;
    REFUSED(ctx, a, "d: batch stride 34 under its matrix's 5 rows of 7 elements");

    /* each epilogue's operands, present where needed and absent elsewhere */
    a = plain(), a.epilogue = KB_LT_BIAS;
    REFUSED(ctx, a, "epilogue bias needs a bias");
    a.bias = buf[3];
    CHECK_STATUS(ctx, kb_lt_check(ctx, &a), KB_OK);
    a.epilogue = KB_LT_NONE;
    REFUSED(ctx, a, "epilogue none takes no bias");
    a = plain(), a.epilogue = KB_LT_GELU_AUX_BIAS, a.bias = buf[3];
    REFUSED(ctx, a, "epilogue gelu_aux_bias needs an aux matrix");
    a.aux = buf[3], a.aux_ld = 8;
    CHECK_STATUS(ctx, kb_lt_check(ctx, &a), KB_OK);
    a.aux_ld = 7;   /* n = 7 but not a multiple of 8 */
    REFUSED(ctx, a, "aux: leading dimension 7: cuBLASLt needs a multiple of 8 of at least n = 7");
    a.aux_ld = 12;
    REFUSED(ctx, a, "leading dimension 12");
    a.aux_ld = 16, a.batch = 2, a.d.batch_stride = 35, a.aux_batch_stride = 80;
    CHECK_STATUS(ctx, kb_lt_check(ctx, &a), KB_OK);
    a.aux_batch_stride = 84;
    REFUSED(ctx, a, "aux: batch stride 84");
    a.aux_batch_stride = 72;   /* a multiple of 8, but under 5 rows of 16 */
    REFUSED(ctx, a, "at least m = 5 rows of 16");
    /* strides near the limit: the overlap check must not overflow */
    a.aux_batch_stride = 80, a.d.batch_stride = ((int64_t)1 << 40) - 1, a.d.row_stride = ((int64_t)1 << 40) - 1;
    CHECK_STATUS(ctx, kb_lt_check(ctx, &a), KB_ERR_INVALID);
    a = plain(), a.epilogue = KB_LT_DGELU, a.aux = buf[3], a.aux_ld = 8;
    CHECK_STATUS(ctx, kb_lt_check(ctx, &a), KB_OK);
    a.bgrad = buf[3];
    REFUSED(ctx, a, "epilogue dgelu takes no bias gradient");
    a.epilogue = KB_LT_DGELU_BGRAD;
    CHECK_STATUS(ctx, kb_lt_check(ctx, &a), KB_OK);
    a.batch = 2, a.d.batch_stride = 35;
    REFUSED(ctx, a, "epilogue dgelu_bgrad: no batch");
    a = plain(), a.epilogue = KB_LT_BGRADB;
    REFUSED(ctx, a, "epilogue bgradb needs a bias gradient");
    a.bgrad = buf[3];
    CHECK_STATUS(ctx, kb_lt_check(ctx, &a), KB_OK);
    a.aux = buf[3], a.aux_ld = 8;
    REFUSED(ctx, a, "epilogue bgradb takes no aux matrix");
}

/* ---------------------------------------------------------------- against the stand-in */

#define M 5
#define K 3
#define N 7
#define LD 8   /* aux's leading dimension */

static double gelu_ref(double x) { return 0.5 * x * (1 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
static double dgelu_ref(double x) {
    double t = tanh(0.7978845608028654 * (x + 0.044715 * x * x * x));
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * x * x);
}

static float X[2 * M * K], XT[K * M], W[N * K], WT[K * N], B[N], D[2 * M * N], AUX[2 * M * LD], G[N + M];

static void fill(void) {
    for (int i = 0; i < 2 * M * K; i++) X[i] = (float)((i * 7 % 11) - 5) / 4;
    for (int i = 0; i < M; i++)
        for (int k = 0; k < K; k++) XT[k * M + i] = X[i * K + k];
    for (int i = 0; i < N * K; i++) W[i] = (float)((i * 5 % 9) - 4) / 3;
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) WT[k * N + n] = W[n * K + k];
    for (int n = 0; n < N; n++) B[n] = (float)n / 4 - 0.5f;
}

/* h[i][n] = x[i]·w[n] (+ b[n]) for batch bt: the row-major reference */
static double pre(int bt, int i, int n, int with_bias) {
    double s = with_bias ? B[n] : 0;
    for (int k = 0; k < K; k++) s += (double)X[bt * M * K + i * K + k] * W[n * K + k];
    return s;
}

/* D = epilogue(X Wᵀ + b) with W as a Linear weight [N, K] (b_transposed) */
static kb_lt_args linear(kb_lt_epilogue e) {
    kb_lt_args a;
    memset(&a, 0, sizeof a);
    a.dtype = KB_F32;
    a.batch = 1;
    a.epilogue = e;
    a.a = (kb_lt_matrix){X, M, K, K, 1, 0};
    a.b = (kb_lt_matrix){W, K, N, 1, K, 0};   /* [K, N] seen through W's strides */
    a.d = (kb_lt_matrix){D, M, N, N, 1, 0};
    return a;
}

static void *fake_lib;   /* the stand-in, opened again here to read its counters */

static int stats(int i) {
    void (*get)(int *) = NULL;
    void *p = fake_lib ? dlsym(fake_lib, "fake_lt_stats") : NULL;
    int out[9];
    memcpy(&get, &p, sizeof p);
    if (!get) return -1;
    get(out);
    return out[i];
}
enum { CREATES, DESTROYS, HEURISTICS, MATMULS, COMPUTE, ALIGN_A, ALIGN_B, ALIGN_C, ALIGN_D };

static void test_matmul(kb_ctx *ctx, const char *fake) {
    kb_lt *lt = NULL;
    const char *names[] = {fake};
    CHECK_STATUS(ctx, kb_lt_open(ctx, names, 1, &lt), KB_OK);
    if (!lt) return;
    fake_lib = dlopen(fake, RTLD_NOW);
    CHECK(kb_lt_version(lt) == 120604 && !strcmp(kb_lt_path(lt), fake));
    fill();
    const kb_lt_epilogue fwd[] = {KB_LT_NONE, KB_LT_BIAS, KB_LT_RELU_BIAS, KB_LT_GELU_BIAS, KB_LT_GELU_AUX_BIAS};
    for (size_t t = 0; t < sizeof fwd / sizeof fwd[0]; t++) {
        kb_lt_args a = linear(fwd[t]);
        if (fwd[t] != KB_LT_NONE) a.bias = B;
        if (fwd[t] == KB_LT_GELU_AUX_BIAS) a.aux = AUX, a.aux_ld = LD;
        memset(D, 0, sizeof D);
        CHECK_STATUS(ctx, kb_lt_matmul(ctx, lt, &a), KB_OK);
        int bad = 0;
        for (int i = 0; i < M; i++)
            for (int n = 0; n < N; n++) {
                double h = pre(0, i, n, fwd[t] != KB_LT_NONE), want = h;
                if (fwd[t] == KB_LT_RELU_BIAS) want = h > 0 ? h : 0;
                if (fwd[t] == KB_LT_GELU_BIAS || fwd[t] == KB_LT_GELU_AUX_BIAS) want = gelu_ref(h);
                bad += !check_close(D[i * N + n], want, 1e-5);
                if (fwd[t] == KB_LT_GELU_AUX_BIAS) bad += !check_close(AUX[i * LD + n], h, 1e-5);
            }
        CHECK_MSG(bad == 0, "epilogue %s: %d wrong values", kb_lt_epilogue_name(fwd[t]), bad);
    }
    CHECK(stats(COMPUTE) == 68);   /* CUBLAS_COMPUTE_32F */

    /* the same product from b row-major [K, N] and from a transposed view of X, with TF32 */
    kb_lt_args a = linear(KB_LT_NONE);
    a.b = (kb_lt_matrix){WT, K, N, N, 1, 0};
    a.a = (kb_lt_matrix){XT, M, K, 1, M, 0};
    a.tf32 = 1;
    memset(D, 0, sizeof D);
    CHECK_STATUS(ctx, kb_lt_matmul(ctx, lt, &a), KB_OK);
    int bad = 0;
    for (int i = 0; i < M; i++)
        for (int n = 0; n < N; n++) bad += !check_close(D[i * N + n], pre(0, i, n, 0), 1e-5);
    CHECK_MSG(bad == 0, "row-major b, transposed a: %d wrong values", bad);
    CHECK(stats(COMPUTE) == 77);   /* CUBLAS_COMPUTE_32F_FAST_TF32 */

    /* backward: dH = (dY w2)·gelu'(h), with dY = X (M x K) and w2 = WT (K x N): D = X WT, and
     * the bias gradient, the column sums of dH */
    for (int i = 0; i < M; i++)
        for (int n = 0; n < N; n++) AUX[i * LD + n] = (float)(pre(0, i, n, 1) / 2);
    a = linear(KB_LT_DGELU_BGRAD);
    a.b = (kb_lt_matrix){WT, K, N, N, 1, 0};
    a.aux = AUX, a.aux_ld = LD, a.bgrad = G;
    CHECK_STATUS(ctx, kb_lt_matmul(ctx, lt, &a), KB_OK);
    bad = 0;
    for (int n = 0; n < N; n++) {
        double col = 0;
        for (int i = 0; i < M; i++) {
            double want = pre(0, i, n, 0) * dgelu_ref(AUX[i * LD + n]);
            bad += !check_close(D[i * N + n], want, 1e-5);
            col += want;
        }
        bad += !check_close(G[n], col, 1e-5);
    }
    CHECK_MSG(bad == 0, "dgelu_bgrad: %d wrong values", bad);

    /* BGRADB, the weight gradient dW = dYᵀ X with a = dYᵀ a transposed view: here dY = X, so
     * a = Xᵀ (K x M) and b = X (M x K): D = Xᵀ X, bgrad[p] = Σ_i X[i][p] (a's sums over its k) */
    a = linear(KB_LT_BGRADB);
    a.a = (kb_lt_matrix){X, K, M, 1, K, 0};
    a.b = (kb_lt_matrix){X, M, K, K, 1, 0};
    a.d = (kb_lt_matrix){D, K, K, K, 1, 0};
    a.bgrad = G;
    CHECK_STATUS(ctx, kb_lt_matmul(ctx, lt, &a), KB_OK);
    bad = 0;
    for (int p = 0; p < K; p++) {
        double s = 0;
        for (int q = 0; q < K; q++) {
            double want = 0;
            for (int i = 0; i < M; i++) want += (double)X[i * K + p] * X[i * K + q];
            bad += !check_close(D[p * K + q], want, 1e-5);
        }
        for (int i = 0; i < M; i++) s += X[i * K + p];
        bad += !check_close(G[p], s, 1e-5);
    }
    CHECK_MSG(bad == 0, "bgradb: %d wrong values", bad);

    /* a batch of two X's against one W, with GELU_AUX_BIAS */
    a = linear(KB_LT_GELU_AUX_BIAS);
    a.batch = 2, a.a.batch_stride = M * K, a.d.batch_stride = M * N;
    a.bias = B, a.aux = AUX, a.aux_ld = LD, a.aux_batch_stride = M * LD;
    CHECK_STATUS(ctx, kb_lt_matmul(ctx, lt, &a), KB_OK);
    bad = 0;
    for (int bt = 0; bt < 2; bt++)
        for (int i = 0; i < M; i++)
            for (int n = 0; n < N; n++) {
                bad += !check_close(D[bt * M * N + i * N + n], gelu_ref(pre(bt, i, n, 1)), 1e-5);
                bad += !check_close(AUX[bt * M * LD + i * LD + n], pre(bt, i, n, 1), 1e-5);
            }
    CHECK_MSG(bad == 0, "batch: %d wrong values", bad);

    /* one heuristic per problem: a repeat is a cache hit; a less aligned operand is another
     * problem, and the heuristic hears its alignment (D [2, 8]: rows 32 bytes apart, then moved
     * by one float) */
    static _Alignas(256) float y[8 * 8], out[1 + 2 * 8];
    a = linear(KB_LT_NONE);
    a.a = (kb_lt_matrix){X, 2, 8, 8, 1, 0};
    a.b = (kb_lt_matrix){y, 8, 8, 8, 1, 0};
    a.d = (kb_lt_matrix){out, 2, 8, 8, 1, 0};
    int before = stats(HEURISTICS);
    CHECK_STATUS(ctx, kb_lt_matmul(ctx, lt, &a), KB_OK);
    CHECK(stats(HEURISTICS) == before + 1 && stats(ALIGN_C) == 32 && stats(ALIGN_D) == 32);
    CHECK_STATUS(ctx, kb_lt_matmul(ctx, lt, &a), KB_OK);
    CHECK(stats(HEURISTICS) == before + 1);
    a.d.ptr = out + 1;
    CHECK_STATUS(ctx, kb_lt_matmul(ctx, lt, &a), KB_OK);
    CHECK_MSG(stats(HEURISTICS) == before + 2 && stats(ALIGN_C) == 4 && stats(ALIGN_D) == 4,
              "%d heuristics (%d before), C/D alignment %d/%d", stats(HEURISTICS), before, stats(ALIGN_C),
              stats(ALIGN_D));
    CHECK_STATUS(ctx, kb_lt_matmul(ctx, lt, &a), KB_OK);
    CHECK(stats(HEURISTICS) == before + 2);

    /* one handle per device, made on first use, destroyed by kb_lt_close */
    CHECK(stats(CREATES) == 1);
    a.device = 1;
    CHECK_STATUS(ctx, kb_lt_matmul(ctx, lt, &a), KB_OK);
    CHECK(stats(CREATES) == 2 && stats(HEURISTICS) == before + 3);
    /* the library's own refusal reaches the message (the stand-in computes f32 only) */
    a.dtype = KB_BF16;
    CHECK_STATUS(ctx, kb_lt_matmul(ctx, lt, &a), KB_ERR_CUDA);
    CHECK_MSG(strstr(kb_ctx_error(ctx), "cublasLtMatmul failed: CUBLAS_STATUS_X (15: fake)"), "%s", kb_ctx_error(ctx));
    kb_lt_close(lt);
    CHECK(stats(DESTROYS) == 2);
    if (fake_lib) dlclose(fake_lib);
}

int main(int argc, char **argv) {
    kb_ctx *ctx = NULL;
    if (kb_ctx_new(NULL, NULL, &ctx) != KB_OK) return 1;
    test_open(ctx);
    test_names();
    test_check(ctx);
    /* the stand-in library lies beside this binary (csrc/Makefile builds it) */
    char fake[4096];
    const char *slash = argc > 0 ? strrchr(argv[0], '/') : NULL;
    snprintf(fake, sizeof fake, "%.*s/libfake_cublaslt.so", slash ? (int)(slash - argv[0]) : 1,
             slash ? argv[0] : ".");
    test_matmul(ctx, fake);
    kb_ctx_free(ctx);
    return check_report();
}
