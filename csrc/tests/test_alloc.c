/* test_alloc.c — every allocation the core makes can fail: for N = 1, 2, ... the Nth request
 * fails while a graph is built, dumped and interpreted (whole and as a region). Each run must
 * end in KB_OK or KB_ERR_OOM, never crash, and give back every byte (checked here by the
 * allocator's own books, which also catch a wrong size passed to kb_free; LeakSanitizer in
 * the asan build catches the rest). */
#include <stdint.h>
#include <stdlib.h>

#include "tests/check.h"
#include "tests/tgraph.h"


static int ok_or_oom(kb_status st) { return st == KB_OK || st == KB_ERR_OOM; }

/* One full pass with the books' current fail_at; returns the first status that was not OK. */
static kb_status one_run(books *b, int *finished)
{
    kb_ctx *ctx = NULL;
    kb_status st = kb_ctx_new(failing_alloc, b, &ctx);
    *finished = 0;
    if (st != KB_OK) return st;
    tg t = {NULL, KB_OK};
    char *text = NULL;
    float x[6 * 8], w[8], bias[8], y[6 * 8], p[6 * 8];
    int64_t idx[6] = {0, 7, 3, 3, 1, 6};
    for (int i = 0; i < 48; i++) x[i] = (float)(i % 5) - 1.5f;
    for (int i = 0; i < 8; i++) w[i] = 1.0f + 0.1f * (float)i, bias[i] = 0.5f;

    st = kb_graph_new(ctx, &t.g);
    if (st != KB_OK) goto done;
    int32_t s0;
    st = kb_graph_add_symbol(t.g, "s0", 6, &s0);
    if (st != KB_OK) goto done;
    /* enough nodes that the node array, the input list and the output list all grow */
    int32_t xi = tg_input(&t, "x", KB_F32, "s0,8"), wi = tg_input(&t, "w", KB_F32, "8");
    int32_t bi = tg_input(&t, "b", KB_F32, "8"), ii = tg_input(&t, "i", KB_I64, "s0,1");
    int32_t ln = tg_layernorm(&t, KB_F32, "s0", "8", xi, wi, bi, 1e-5);
    int32_t sm = tg_softmax(&t, KB_F32, "s0", "8", ln);
    for (int k = 0; k < 6; k++) sm = tg_op(&t, KB_OP_GELU, KB_F32, "s0,8", sm, -1, -1);
    int32_t g = tg_gather(&t, KB_F32, "s0,1", ln, ii, 1);
    tg_output(&t, ln);
    tg_output(&t, sm);
    tg_output(&t, g);
    for (int k = 0; k < 8; k++) tg_output(&t, g);
    if ((st = t.st) != KB_OK) goto done;
    if ((st = kb_graph_dump(t.g, &text)) != KB_OK) goto done;

    const int64_t sv = 6;
    float gathered[6 * 9];
    void *outs[11] = {y, p};
    for (int k = 0; k < 9; k++) outs[2 + k] = gathered + 6 * k;
    st = kb_interp_graph(ctx, t.g, &sv, (const void *[]){x, w, bias, idx}, outs);
    if (st != KB_OK) goto done;
    /* the softmax as one region fed by the layernorm output */
    {
        int32_t nodes[64], n = 0;
        for (int32_t v = ln + 1; v <= sm; v++) nodes[n++] = v;
        int32_t rin[1] = {ln}, rout[1] = {sm}, region_of[64];
        kb_region reg = {KB_REGION_ROW, n, nodes, 1, rin, 1, rout, sm, 2, 0, 0, {0, {0, 0}, {KB_GEMM_ROW, KB_GEMM_ROW}, {0, 0}, {0, 0}, 0, NULL}};
        kb_partition part = {t.g, 1, &reg, region_of, 0};
        float p2[48];
        st = kb_interp_region(ctx, &part, 0, &sv, (const void *[]){y}, (void *[]){p2});
        if (st != KB_OK) goto done;
        /* the region read the layernorm as stored (f32), the graph kept it in double */
        for (int i = 0; i < 48; i++) CHECK_NEAR(p2[i], p[i], 1e-5);
    }
    *finished = 1;
done:
    CHECK_MSG(ok_or_oom(st), "fail_at %ld: status %s: %s", b->fail_at, kb_status_name(st), kb_ctx_error(ctx));
    if (st == KB_ERR_OOM) CHECK_MSG(kb_ctx_error(ctx)[0] != '\0', "fail_at %ld: OOM without a message", b->fail_at);
    kb_string_free(ctx, text);
    kb_graph_free(t.g);
    kb_ctx_free(ctx);
    return st;
}

int main(void)
{
    long runs = 0, oom = 0;
    for (long n = 1;; n++) {
        books b = {0, n, 0, 0, 0};
        int finished;
        kb_status st = one_run(&b, &finished);
        runs++;
        oom += st == KB_ERR_OOM;
        CHECK_MSG(b.blocks == 0 && b.bytes == 0, "fail_at %ld: %ld blocks, %lld bytes left", n, b.blocks, b.bytes);
        CHECK_MSG(!b.bad_size, "fail_at %ld: a block was freed with the wrong size", n);
        if (b.requests < n) {  /* nothing failed: the run allocated fewer than n times */
            CHECK_MSG(st == KB_OK && finished, "fail_at %ld: a run without a failure did not succeed", n);
            break;
        }
        CHECK_MSG(st == KB_ERR_OOM, "fail_at %ld: a failed allocation was not reported as OOM", n);
        if (n > 100000) {
            CHECK_MSG(0, "no run completed");
            break;
        }
    }
    CHECK(runs > 20 && oom == runs - 1);
    printf("%ld runs, %ld ended in KB_ERR_OOM\n", runs, oom);
    return check_report();
}
