/* test_cublaslt.c — cuda/cublaslt.c without a GPU: a library that is missing or is not
 * cuBLASLt gives KB_ERR_NOT_FOUND with a message naming it, and kb_lt_check refuses every bad
 * argument kb_lt_matmul would otherwise hand to cuBLASLt (sizes, strides, the epilogue's
 * operands, aux's leading dimension). The pointers are never dereferenced. */
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
    REFUSED(ctx, a, "d: batch stride 34 under its matrix's 35 elements");

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

int main(void) {
    kb_ctx *ctx = NULL;
    if (kb_ctx_new(NULL, NULL, &ctx) != KB_OK) return 1;
    test_open(ctx);
    test_names();
    test_check(ctx);
    kb_ctx_free(ctx);
    return check_report();
}
