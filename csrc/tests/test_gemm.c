/* test_gemm.c — the GEMM generator (codegen/gemm.c) in C, plain and under ASan+UBSan: the same
 * spec, genome and sm give the same bytes; every candidate genome generates; refusals carry their
 * status; a caller's epilogue hook lands in the kernel and a failing one leaves the buffer as it
 * was; every allocation failing in turn ends in KB_ERR_OOM with nothing leaked. */
#include <stdint.h>
#include <stdlib.h>

#include "core/internal.h"
#include "tests/check.h"

static kb_status gen(kb_ctx *ctx, const kb_gemm_spec *spec, const kb_gemm_genome *g, int sm, char **src,
                     kb_gemm_launch *L) {
    kb_sb sb;
    kb_sb_init(&sb, ctx);
    kb_status st = kb_gemm_generate(ctx, spec, g, sm, &sb, L);
    if (st != KB_OK) {
        kb_sb_discard(&sb);
        return st;
    }
    return kb_sb_finish(&sb, src);
}

/* a caller's hook: one parameter and a scale by it */
static kb_status hook_params(kb_ctx *ctx, void *ud, kb_sb *sb) {
    (void)ctx, (void)ud;
    kb_sb_puts(sb, ",\n    const float my_scale");
    return KB_OK;
}
static kb_status hook_element(kb_ctx *ctx, void *ud, kb_sb *sb, const kb_gemm_site *s) {
    if (ud) return KB_FAIL(ctx, KB_ERR_UNSUPPORTED, "hook says no");
    kb_sb_printf(sb, "%s = %s * my_scale + (float)(%s + %s + %s);  // region hook\n", s->acc, s->acc, s->batch, s->row,
                 s->col);
    return KB_OK;
}

static void test_generate(void) {
    kb_ctx *ctx = NULL;
    CHECK(kb_ctx_new(NULL, NULL, &ctx) == KB_OK);
    kb_gemm_builtin b = {1, KB_BF16, KB_F32, KB_BF16, KB_OP_GELU_TANH, 0, 0, ""};
    kb_gemm_epilogue epi;
    CHECK_STATUS(ctx, kb_gemm_builtin_epilogue(ctx, &b, &epi), KB_OK);
    kb_gemm_spec spec = {KB_BF16, KB_BF16, 1, 0, 1, &epi, 0, 0, 0};
    kb_gemm_genome g;
    kb_gemm_genome_default(4096, 4096, 4096, 1, NULL, &g);
    CHECK(g.tile_m == 128 && g.tile_n == 128 && g.tile_k == 32 && g.warps_m == 2 && g.warps_n == 4 && g.stages == 4 &&
          g.min_blocks == 2);
    char *s1 = NULL, *s2 = NULL;
    kb_gemm_launch L1, L2;
    CHECK_STATUS(ctx, gen(ctx, &spec, &g, 90, &s1, &L1), KB_OK);
    CHECK_STATUS(ctx, gen(ctx, &spec, &g, 90, &s2, &L2), KB_OK);
    CHECK(s1 && s2 && strcmp(s1, s2) == 0);
    CHECK(L1.block == 256 && L1.smem_bytes == 65536 && strcmp(L1.name, "kb_gemm_bf16_nt_128x128x32_w2x4_s4_b2") == 0);
    CHECK(s1 && strstr(s1, "bias_m[row]") && strstr(s1, "residual[(bz * M + row) * N + col]"));
    uint32_t grid[3];
    kb_gemm_grid(&L1, 300, 17, 3, grid);
    CHECK(grid[0] == 3 && grid[1] == 1 && grid[2] == 3);
    kb_string_free(ctx, s1);
    kb_string_free(ctx, s2);

    /* every candidate of a few sizes generates, both layouts, every output dtype */
    static const int64_t sizes[][4] = {{1, 17, 8, 1}, {300, 300, 4096, 4}, {8192, 8192, 8192, 1}};
    for (int i = 0; i < 3; i++) {
        kb_gemm_genome c[16];
        int n = kb_gemm_genome_candidates(sizes[i][0], sizes[i][1], sizes[i][2], sizes[i][3], NULL, c, 16);
        CHECK(n >= (i ? 4 : 1));
        for (int k = 0; k < n; k++) {
            kb_gemm_spec sp = {k % 2 ? KB_F16 : KB_BF16, (kb_dtype)(k % 3 == 0 ? KB_F32 : k % 3 == 1 ? KB_F16 : KB_BF16),
                               k % 2, 0, 0, NULL, k % 3 == 1, 0, 0};
            char *src = NULL;
            kb_gemm_launch L;
            CHECK_STATUS(ctx, kb_gemm_genome_check(ctx, &c[k], NULL), KB_OK);
            CHECK_STATUS(ctx, gen(ctx, &sp, &c[k], 80, &src, &L), KB_OK);
            CHECK(src && strstr(src, "stride_a") && strstr(src, "stride_b"));
            CHECK(src && (strstr(src, "kb_ldmatrix_x4_trans(a[i]") != NULL) == (k % 3 == 1));
            kb_string_free(ctx, src);
        }
    }
    kb_ctx_free(ctx);
}

static void test_refusals_and_hook(void) {
    kb_ctx *ctx = NULL;
    CHECK(kb_ctx_new(NULL, NULL, &ctx) == KB_OK);
    kb_gemm_genome g = {128, 128, 32, 2, 4, 4, 1};
    kb_gemm_spec f32 = {KB_F32, KB_F32, 0, 0, 0, NULL, 0, 0, 0}, ok = {KB_F16, KB_F32, 0, 0, 0, NULL, 0, 0, 0};
    char *src = NULL;
    kb_gemm_launch L;
    CHECK_STATUS(ctx, gen(ctx, &f32, &g, 90, &src, &L), KB_ERR_UNSUPPORTED);
    CHECK_STATUS(ctx, gen(ctx, &ok, &g, 75, &src, &L), KB_ERR_UNSUPPORTED);
    kb_gemm_genome bad = {128, 128, 32, 2, 4, 1, 1};
    CHECK_STATUS(ctx, gen(ctx, &ok, &bad, 90, &src, &L), KB_ERR_INVALID);
    CHECK(strstr(kb_ctx_error(ctx), "stages") != NULL);
    kb_gemm_builtin b = {0, -1, -1, -1, KB_OP_ADD, 0, 0, ""};
    kb_gemm_epilogue epi;
    CHECK_STATUS(ctx, kb_gemm_builtin_epilogue(ctx, &b, &epi), KB_ERR_UNSUPPORTED);
    b.act = KB_OP_RELU, b.bias_n = KB_I64;
    CHECK_STATUS(ctx, kb_gemm_builtin_epilogue(ctx, &b, &epi), KB_ERR_UNSUPPORTED);

    /* a caller's hook: its parameter and statements are in the kernel */
    kb_gemm_epilogue hook = {NULL, "acc * my_scale + (b + row + col)", hook_params, hook_element};
    kb_gemm_spec hs = {KB_BF16, KB_F32, 1, 1, 1, &hook, 0, 0, 0};
    CHECK_STATUS(ctx, gen(ctx, &hs, &g, 90, &src, &L), KB_OK);
    CHECK(src && strstr(src, "const float my_scale) {") && strstr(src, "v1 = v1 * my_scale + (float)(bz + row + col1)"));
    CHECK(src && strstr(src, "//   epilogue: acc * my_scale + (b + row + col)"));
    kb_string_free(ctx, src);
    /* a failing hook: its status, and the buffer as it was before the call */
    hook.ud = &hook;
    kb_sb sb;
    kb_sb_init(&sb, ctx);
    kb_sb_puts(&sb, "// before\n");
    CHECK_STATUS(ctx, kb_gemm_generate(ctx, &hs, &g, 90, &sb, &L), KB_ERR_UNSUPPORTED);
    CHECK(sb.buf && strcmp(sb.buf, "// before\n") == 0);
    kb_sb_discard(&sb);
    kb_ctx_free(ctx);
}

static void test_oom(void) {
    kb_gemm_genome g = {64, 64, 32, 2, 2, 4, 2};
    for (long fail = 1; fail < 200; fail++) {
        books bk = {0, fail, 0, 0, 0};
        kb_ctx *ctx = NULL;
        if (kb_ctx_new(failing_alloc, &bk, &ctx) != KB_OK) continue;
        kb_gemm_builtin b = {1, KB_BF16, -1, -1, KB_OP_SILU, 0, 0, ""};
        kb_gemm_epilogue epi;
        kb_status st = kb_gemm_builtin_epilogue(ctx, &b, &epi);
        kb_gemm_spec spec = {KB_BF16, KB_BF16, 0, 0, 0, &epi, 0, 0, 0};
        char *src = NULL;
        kb_gemm_launch L;
        if (st == KB_OK) st = gen(ctx, &spec, &g, 80, &src, &L);
        CHECK_MSG(st == KB_OK || st == KB_ERR_OOM, "fail_at %ld: %s", fail, kb_status_name(st));
        kb_string_free(ctx, src);
        kb_ctx_free(ctx);
        CHECK_MSG(bk.blocks == 0 && bk.bytes == 0 && !bk.bad_size, "fail_at %ld leaks", fail);
        if (st == KB_OK) break;
    }
}

int main(void) {
    test_generate();
    test_refusals_and_hook();
    test_oom();
    return check_report();
}
