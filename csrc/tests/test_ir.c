/* test_ir.c — the graph builder (every malformed node refused with KB_ERR_INVALID and a message
 * saying why), symbolic dims and kb_value_sizes, the dtype/op tables, and the text dump of a
 * small graph against its expected form (golden: a change to the dump format shows here). */
#include <stdint.h>

#include "core/internal.h" /* kb_name_ident, kb_name_comment */
#include "tests/check.h"
#include "tests/tgraph.h"

static kb_ctx *ctx;

/* Adds n to g, expecting a refusal whose message mentions `why`. */
static void check_refused(kb_graph *g, const kb_node *n, const char *why, int line)
{
    int32_t id = -7, before = kb_graph_nnodes(g);
    kb_status st = kb_graph_add(g, n, &id);
    CHECK_MSG(st == KB_ERR_INVALID, "line %d: status %s", line, kb_status_name(st));
    CHECK_MSG(strstr(kb_ctx_error(ctx), why) != NULL, "line %d: message \"%s\" lacks \"%s\"", line,
              kb_ctx_error(ctx), why);
    CHECK_MSG(id == -7 && kb_graph_nnodes(g) == before, "line %d: a refused node was added", line);
}
#define REFUSED(g, n, why) check_refused((g), (n), (why), __LINE__)

static void test_builder_errors(void)
{
    tg t = {NULL, KB_OK};
    CHECK_STATUS(ctx, kb_graph_new(ctx, &t.g), KB_OK);
    int32_t s0;
    CHECK_STATUS(ctx, kb_graph_add_symbol(t.g, "s0", 4, &s0), KB_OK);
    int32_t a = tg_input(&t, "a", KB_F32, "2,3"), b = tg_input(&t, "b", KB_F32, "3,2");
    int32_t c = tg_input(&t, "c", KB_F32, "s0,3");
    CHECK(t.st == KB_OK && a == 0 && b == 1 && c == 2);

    kb_node n = tg_tmpl(KB_OP_ADD, KB_F32, "2,3");     /* arity */
    n.ninputs = 1, n.inputs[0] = a;
    REFUSED(t.g, &n, "operand");
    n = tg_tmpl(KB_OP_WHERE, KB_F32, "2,3");
    n.ninputs = 2, n.inputs[0] = a, n.inputs[1] = a;
    REFUSED(t.g, &n, "operand");
    n = tg_tmpl(KB_OP_ADD, KB_F32, "2,3");             /* operand ids */
    n.ninputs = 2, n.inputs[0] = a, n.inputs[1] = 99;
    REFUSED(t.g, &n, "does not exist");
    n.inputs[1] = -1;
    REFUSED(t.g, &n, "does not exist");
    n.inputs[1] = b;                                   /* shapes of a binary op */
    REFUSED(t.g, &n, "shape");
    n.inputs[1] = c;                                   /* a symbol is not 2 */
    REFUSED(t.g, &n, "shape");
    n = tg_tmpl(KB_OP_SUM, KB_F32, "2");
    n.ninputs = 1, n.inputs[0] = a, n.axes = 4;        /* axis 2 of a rank-2 operand */
    REFUSED(t.g, &n, "axes");
    n.axes = 0;
    REFUSED(t.g, &n, "axes");
    n.axes = 2, n.rank = 2;                            /* keepdim must keep the reduced dim as 1 */
    REFUSED(t.g, &n, "size 1");
    n = tg_tmpl(KB_OP_PERMUTE, KB_F32, "3,2");
    n.ninputs = 1, n.inputs[0] = a, n.perm[0] = 0, n.perm[1] = 0;
    REFUSED(t.g, &n, "perm");
    n.perm[0] = 1, n.perm[1] = 2;
    REFUSED(t.g, &n, "perm");
    n.perm[0] = 0, n.perm[1] = 1;                      /* a permutation, but dims do not follow it */
    REFUSED(t.g, &n, "permute");
    n = tg_tmpl(KB_OP_EXPAND, KB_F32, "4,3");
    n.ninputs = 1, n.inputs[0] = a;
    REFUSED(t.g, &n, "expand");
    n = tg_tmpl(KB_OP_RESHAPE, KB_F32, "7");
    n.ninputs = 1, n.inputs[0] = a;
    REFUSED(t.g, &n, "element count");
    n = tg_tmpl(KB_OP_SLICE, KB_F32, "2,2");
    n.ninputs = 1, n.inputs[0] = a, n.axis = 1, n.start = 1, n.step = 2;
    REFUSED(t.g, &n, "past the end");
    n.axis = 2;
    REFUSED(t.g, &n, "axis");
    n = tg_tmpl(KB_OP_GATHER, KB_F32, "2,3");
    n.ninputs = 2, n.inputs[0] = a, n.inputs[1] = a;
    REFUSED(t.g, &n, "index");
    n = tg_tmpl(KB_OP_NEG, KB_F32, "2,3");
    n.ninputs = 1, n.inputs[0] = a, n.dtype = (kb_dtype)42;
    REFUSED(t.g, &n, "dtype");
    n.dtype = KB_F32, n.rank = 9;
    REFUSED(t.g, &n, "rank");
    n = tg_tmpl(KB_OP_NEG, KB_F32, "s1,3");            /* no symbol 1 */
    n.ninputs = 1, n.inputs[0] = c;
    REFUSED(t.g, &n, "symbol");
    n.op = (kb_op)KB_OP_COUNT;
    REFUSED(t.g, &n, "op");

    /* symbols and outputs */
    int32_t id;
    CHECK_STATUS(ctx, kb_graph_add_symbol(t.g, "s0", 2, &id), KB_ERR_INVALID);
    CHECK(strstr(kb_ctx_error(ctx), "twice") != NULL);
    CHECK_STATUS(ctx, kb_graph_add_symbol(t.g, "a_name_far_too_long", 2, &id), KB_ERR_INVALID);
    CHECK_STATUS(ctx, kb_graph_add_symbol(t.g, "s9", -1, &id), KB_ERR_INVALID);
    for (int i = 1; i < KB_MAX_SYMS; i++) {
        char name[16];
        snprintf(name, sizeof name, "t%d", i);
        CHECK_STATUS(ctx, kb_graph_add_symbol(t.g, name, i, &id), KB_OK);
        CHECK(id == i);
    }
    CHECK_STATUS(ctx, kb_graph_add_symbol(t.g, "one_more", 1, &id), KB_ERR_UNSUPPORTED);
    CHECK(kb_graph_nsymbols(t.g) == KB_MAX_SYMS && strcmp(kb_graph_symbol_name(t.g, 3), "t3") == 0);
    CHECK(kb_graph_symbol_example(t.g, 0) == 4);
    CHECK_STATUS(ctx, kb_graph_add_output(t.g, 3), KB_ERR_INVALID);
    CHECK(kb_ctx_error(ctx)[0] != '\0');
    CHECK(kb_graph_nnodes(t.g) == 3 && kb_graph_noutputs(t.g) == 0);
    CHECK(kb_graph_ninputs(t.g) == 3 && kb_graph_input(t.g, 2) == c && kb_graph_node(t.g, c)->index == 2);
    kb_graph_free(t.g);
}

static void test_sizes(void)
{
    kb_dim d = {3, 2, {0, 2}};
    const int64_t sv[3] = {5, 100, 7};
    CHECK(kb_dim_eval(d, sv) == 105);
    CHECK(kb_dim_equal(d, (kb_dim){3, 2, {0, 2}}) && !kb_dim_equal(d, (kb_dim){3, 2, {0, 1}}));
    CHECK(!kb_dim_equal(d, (kb_dim){105, 0, {0}}));

    tg t = {NULL, KB_OK};
    CHECK_STATUS(ctx, kb_graph_new(ctx, &t.g), KB_OK);
    int32_t s0, s1;
    CHECK_STATUS(ctx, kb_graph_add_symbol(t.g, "s0", 8, &s0), KB_OK);
    CHECK_STATUS(ctx, kb_graph_add_symbol(t.g, "s1", 3, &s1), KB_OK);
    int32_t x = tg_input(&t, "x", KB_F32, "s0,s1,64");
    int32_t r = tg_op(&t, KB_OP_RESHAPE, KB_F32, "s0*s1,64", x, -1, -1);
    int32_t r2 = tg_op(&t, KB_OP_RESHAPE, KB_F32, "64*s0*s1", r, -1, -1);
    int32_t r3 = tg_op(&t, KB_OP_RESHAPE, KB_F32, "2*s1,s0,32", r2, -1, -1);  /* symbols regroup */
    CHECK_MSG(t.st == KB_OK, "%s", kb_ctx_error(ctx));
    kb_node bad = tg_tmpl(KB_OP_RESHAPE, KB_F32, "64*s0");
    bad.ninputs = 1, bad.inputs[0] = r;
    REFUSED(t.g, &bad, "element count");
    bad = tg_tmpl(KB_OP_NEG, KB_F32, "");         /* symbols of one dim must be sorted */
    bad.rank = 1, bad.dims[0] = (kb_dim){1, 2, {1, 0}}, bad.ninputs = 1, bad.inputs[0] = r2;
    REFUSED(t.g, &bad, "sorted");

    int64_t sz[KB_MAX_RANK];
    const int64_t syms[2] = {5, 7};
    CHECK(kb_value_sizes(t.g, x, syms, sz) == 5 * 7 * 64 && sz[0] == 5 && sz[1] == 7 && sz[2] == 64);
    CHECK(kb_value_sizes(t.g, r, syms, sz) == 2240 && sz[0] == 35 && sz[1] == 64);
    CHECK(kb_value_sizes(t.g, r2, syms, sz) == 2240 && sz[0] == 2240);
    CHECK(kb_value_sizes(t.g, r3, syms, sz) == 2240 && sz[0] == 14 && sz[1] == 5 && sz[2] == 32);
    CHECK(kb_graph_node(t.g, r2)->dims[0].coef == 64 && kb_graph_node(t.g, r2)->dims[0].nsym == 2);
    kb_graph_free(t.g);
}

/* Size and index arithmetic of the checks never overflows into a pass: a slice whose last read
 * wraps int64, sizes whose products wrap, a gather whose index outgrows its operand off the axis,
 * an i32 iota too long for its dtype; and symbol values too large to compute with. */
static void test_overflow_checks(void)
{
    tg t = {NULL, KB_OK};
    CHECK_STATUS(ctx, kb_graph_new(ctx, &t.g), KB_OK);
    int32_t s0, s1;
    CHECK_STATUS(ctx, kb_graph_add_symbol(t.g, "s0", 4, &s0), KB_OK);
    CHECK_STATUS(ctx, kb_graph_add_symbol(t.g, "s1", 6, &s1), KB_OK);
    int32_t x = tg_input(&t, "x", KB_F32, "8");
    int32_t v = tg_input(&t, "v", KB_F32, "2*s0,5");
    int32_t w = tg_input(&t, "w", KB_F32, "s1");
    int32_t ix = tg_input(&t, "ix", KB_I64, "2*s0,7");
    CHECK_MSG(t.st == KB_OK, "%s", kb_ctx_error(ctx));

    kb_node n = tg_tmpl(KB_OP_SLICE, KB_F32, "3");     /* 2^62 + 2 * 2^62 wraps negative */
    n.ninputs = 1, n.inputs[0] = x, n.start = (int64_t)1 << 62, n.step = (int64_t)1 << 62;
    REFUSED(t.g, &n, "past the end");
    n.start = 0;                                       /* 2 * 2^62 = 2^63 */
    REFUSED(t.g, &n, "past the end");
    n.start = INT64_MAX, n.step = 1, n.dims[0].coef = 1;  /* one element, far past the end */
    REFUSED(t.g, &n, "past the end");
    n.start = 5, n.step = 1, n.dims[0].coef = 3;       /* reads 5, 6, 7: fine */
    CHECK_STATUS(ctx, kb_graph_add(t.g, &n, &(int32_t){0}), KB_OK);
    n = tg_tmpl(KB_OP_SLICE, KB_F32, "s0,5");          /* every 2nd of 2*s0 rows, from row 1: fine */
    n.ninputs = 1, n.inputs[0] = v, n.start = 1, n.step = 2;
    CHECK_STATUS(ctx, kb_graph_add(t.g, &n, &(int32_t){0}), KB_OK);
    n.start = 2;                                       /* row 2*s0 at the last: past the end */
    REFUSED(t.g, &n, "past the end");
    n.start = 0, n.step = 3;                           /* 3*s0 > 2*s0 rows once s0 grows */
    REFUSED(t.g, &n, "larger sizes");
    n = tg_tmpl(KB_OP_SLICE, KB_F32, "s0");            /* pe[:s0] of a pinned 8: at the example (4) */
    n.ninputs = 1, n.inputs[0] = x, n.start = 4;
    CHECK_STATUS(ctx, kb_graph_add(t.g, &n, &(int32_t){0}), KB_OK);
    n.start = 5;
    REFUSED(t.g, &n, "example");
    n = tg_tmpl(KB_OP_SLICE, KB_F32, "s0");            /* s1 (6 at the example) to s0 from 3: past */
    n.ninputs = 1, n.inputs[0] = w, n.start = 3;
    REFUSED(t.g, &n, "example");

    n = tg_tmpl(KB_OP_NEG, KB_F32, "4294967296,4294967296");  /* 2^64 elements */
    n.ninputs = 0, n.op = KB_OP_CONST;
    REFUSED(t.g, &n, "overflows");
    n = tg_tmpl(KB_OP_CONST, KB_F32, "0,4294967296,4294967296");  /* 0 elements, but 2^64 after a reshape */
    REFUSED(t.g, &n, "coefficients");
    n = tg_tmpl(KB_OP_CONST, KB_F32, "288230376151711744*s0");    /* 2^58 * 4 at the example, 8 bytes each */
    REFUSED(t.g, &n, "example");

    n = tg_tmpl(KB_OP_GATHER, KB_F32, "2*s0,7");       /* index 7 wide, operand 5: off the axis */
    n.ninputs = 2, n.inputs[0] = v, n.inputs[1] = ix, n.axis = 0;
    REFUSED(t.g, &n, "larger than the operand");
    n.axis = 1;                                        /* along dim 1 any width is fine */
    CHECK_STATUS(ctx, kb_graph_add(t.g, &n, &(int32_t){0}), KB_OK);
    int32_t iy = tg_input(&t, "iy", KB_I64, "3*s0,2");
    n = tg_tmpl(KB_OP_GATHER, KB_F32, "3*s0,2");       /* 3*s0 rows of index, 2*s0 of operand */
    n.ninputs = 2, n.inputs[0] = v, n.inputs[1] = iy, n.axis = 1;
    REFUSED(t.g, &n, "larger than the operand");
    int32_t iz = tg_input(&t, "iz", KB_I64, "s1,2");
    n = tg_tmpl(KB_OP_GATHER, KB_F32, "s1,2");         /* s1 against 2*s0: not provable */
    n.ninputs = 2, n.inputs[0] = v, n.inputs[1] = iz, n.axis = 1;
    REFUSED(t.g, &n, "larger than the operand");
    CHECK(t.st == KB_OK);

    n = tg_tmpl(KB_OP_IOTA, KB_I32, "4294967296");
    REFUSED(t.g, &n, "iota");
    n.dtype = KB_I64;
    CHECK_STATUS(ctx, kb_graph_add(t.g, &n, &(int32_t){0}), KB_OK);

    /* run-time symbol values: negative, or too large to hold, are refused; kb_value_sizes and
     * kb_dim_eval report an overflow instead of wrapping */
    int64_t sz[KB_MAX_RANK];
    const int64_t ok[2] = {3, 5}, neg[2] = {-1, 5}, huge[2] = {(int64_t)1 << 61, 5};
    CHECK_STATUS(ctx, kb_graph_check_symvals(t.g, ok), KB_OK);
    CHECK_STATUS(ctx, kb_graph_check_symvals(t.g, neg), KB_ERR_INVALID);
    CHECK(strstr(kb_ctx_error(ctx), "negative") != NULL);
    CHECK_STATUS(ctx, kb_graph_check_symvals(t.g, huge), KB_ERR_INVALID);
    CHECK(strstr(kb_ctx_error(ctx), "too large") != NULL);
    CHECK(kb_value_sizes(t.g, v, huge, sz) == -1 && sz[0] == (int64_t)1 << 62);
    CHECK(kb_dim_eval((kb_dim){4, 1, {0}}, huge) == INT64_MAX);
    /* no elements, but a product of two of its sizes (a region's column count) past 2^63 */
    int32_t z = tg_input(&t, "z", KB_F32, "s0,s1,s1");
    CHECK(t.st == KB_OK && z >= 0);
    const int64_t zero_huge[2] = {0, (int64_t)1 << 33};
    CHECK(kb_value_sizes(t.g, z, zero_huge, sz) == 0);
    CHECK_STATUS(ctx, kb_graph_check_symvals(t.g, zero_huge), KB_ERR_INVALID);
    kb_graph_free(t.g);
}

static void test_tables(void)
{
    for (int t = 0; t < KB_DTYPE_COUNT; t++)
        CHECK(kb_dtype_from_name(kb_dtype_name((kb_dtype)t)) == t);
    CHECK(kb_dtype_from_name("f8") == -1);
    CHECK(kb_dtype_size(KB_BF16) == 2 && kb_dtype_size(KB_I64) == 8 && kb_dtype_size(KB_BOOL) == 1);
    CHECK(kb_dtype_is_float(KB_F16) && !kb_dtype_is_float(KB_I32));
    int named = 0;
    for (int op = 0; op < KB_OP_COUNT; op++) {
        const kb_op_info *info = kb_op_get((kb_op)op);
        CHECK(info && info->name && info->name[0]);
        /* "max"/"min" name both the binary op and the reduction; lookup finds the first */
        int back = kb_op_from_name(info->name);
        named += back == op;
        CHECK(back >= 0 && back <= op);
        if (info->kind >= KB_KIND_UNARY && info->kind <= KB_KIND_TERNARY && op != KB_OP_CAST)
            CHECK_MSG(info->cuda[0] != '\0', "op %s has no CUDA form", info->name);
    }
    CHECK(named == KB_OP_COUNT - 2);
    CHECK(kb_op_get(KB_OP_COUNT) == NULL && kb_op_from_name("conv2d") == -1 && kb_op_from_name("matmul") == KB_OP_MATMUL);
    CHECK(kb_op_get(KB_OP_WHERE)->arity == 3 && kb_op_get(KB_OP_EXTERN)->arity == -1);
    CHECK(strcmp(kb_status_name(KB_OK), "ok") == 0 && strcmp(kb_status_name(KB_ERR_OOM), "out of memory") == 0);
}

static const char golden[] =
    "graph(s0=8, s1=3) {\n"
    "  %0 = input user \"x\" : f32[s0,s1,64]\n"
    "  %1 = input param \"ln.weight\" : bf16[64]\n"
    "  %2 = reshape %0 : f32[s0*s1,64]\n"
    "  %3 = max %2 axes=[1] : f32[s0*s1,1]\n"
    "  %4 = expand %3 : f32[s0*s1,64]\n"
    "  %5 = sub %2, %4 : f32[s0*s1,64]\n"
    "  %6 = cast %1 : f32[64]\n"
    "  %7 = reshape %6 : f32[1,64]\n"
    "  %8 = expand %7 : f32[s0*s1,64]\n"
    "  %9 = const 0.5 : f32[s0*s1,64]\n"
    "  %10 = gt %5, %9 : bool[s0*s1,64]\n"
    "  %11 = where %10, %5, %8 : f32[s0*s1,64]\n"
    "  %12 = permute %11 perm=[1,0] : f32[64,s0*s1]\n"
    "  %13 = slice %12 axis=0 start=1 step=2 : f32[32,s0*s1]\n"
    "  %14 = leaky_relu %13 slope=0.01 : f32[32,s0*s1]\n"
    "  %15 = sum %14 axes=[0,1] : f32[]\n"
    "  return %13, %3, %15\n"
    "}\n";

static void test_dump(void)
{
    tg t = {NULL, KB_OK};
    CHECK_STATUS(ctx, kb_graph_new(ctx, &t.g), KB_OK);
    int32_t s0, s1;
    CHECK_STATUS(ctx, kb_graph_add_symbol(t.g, "s0", 8, &s0), KB_OK);
    CHECK_STATUS(ctx, kb_graph_add_symbol(t.g, "s1", 3, &s1), KB_OK);
    int32_t x = tg_input(&t, "x", KB_F32, "s0,s1,64");
    kb_node n = tg_tmpl(KB_OP_INPUT, KB_BF16, "64");
    n.input_kind = KB_INPUT_PARAM;
    n.name = "ln.weight";
    int32_t w = tg_add(&t, &n);
    int32_t r = tg_op(&t, KB_OP_RESHAPE, KB_F32, "s0*s1,64", x, -1, -1);
    int32_t m = tg_reduce(&t, KB_OP_RMAX, KB_F32, "s0*s1,1", r, 2);
    int32_t d = tg_op(&t, KB_OP_SUB, KB_F32, "s0*s1,64", r, tg_op(&t, KB_OP_EXPAND, KB_F32, "s0*s1,64", m, -1, -1), -1);
    int32_t c = tg_op(&t, KB_OP_CAST, KB_F32, "64", w, -1, -1);
    int32_t ce = tg_op(&t, KB_OP_EXPAND, KB_F32, "s0*s1,64", tg_op(&t, KB_OP_RESHAPE, KB_F32, "1,64", c, -1, -1), -1, -1);
    int32_t k = tg_const(&t, KB_F32, "s0*s1,64", 0.5);
    int32_t y = tg_op(&t, KB_OP_WHERE, KB_F32, "s0*s1,64", tg_op(&t, KB_OP_GT, KB_BOOL, "s0*s1,64", d, k, -1), d, ce);
    int32_t pm = tg_permute(&t, KB_F32, "64,s0*s1", y, (const int8_t[]){1, 0});
    int32_t sl = tg_slice(&t, KB_F32, "32,s0*s1", pm, 0, 1, 2);
    n = tg_tmpl(KB_OP_LEAKY_RELU, KB_F32, "32,s0*s1");
    n.ninputs = 1, n.inputs[0] = sl, n.scalar[0] = 0.01;
    int32_t total = tg_reduce(&t, KB_OP_SUM, KB_F32, "", tg_add(&t, &n), 3);
    tg_output(&t, sl);
    tg_output(&t, m);
    tg_output(&t, total);
    CHECK_MSG(t.st == KB_OK, "%s", kb_ctx_error(ctx));
    char *text = NULL;
    CHECK_STATUS(ctx, kb_graph_dump(t.g, &text), KB_OK);
    CHECK_MSG(text && strcmp(text, golden) == 0, "dump differs:\n%s", text ? text : "(null)");
    kb_string_free(ctx, text);
    kb_string_free(ctx, NULL);
    kb_graph_free(t.g);
    kb_graph_free(NULL);
}

/* Names: any length and any bytes in the IR (the graph keeps its own copy), escaped in the dump,
 * and spelled safely for generated source (a comment, an identifier). */
static void test_names(void)
{
    tg t = {NULL, KB_OK};
    CHECK_STATUS(ctx, kb_graph_new(ctx, &t.g), KB_OK);
    char path[600], evil[] = "w\n__global__ void pwn(int*p){*p=1;}//\"\\";
    size_t len = 0;
    while (len + 50 < sizeof path) len += (size_t)snprintf(path + len, sizeof path - len, "m.model.layers.%zu.post_attention_layernorm", len);
    snprintf(path + len, sizeof path - len, ".weight");
    char scratch[sizeof path];
    strcpy(scratch, path);
    int32_t a = tg_input(&t, scratch, KB_F32, "64");
    memset(scratch, 'x', sizeof scratch - 1); /* the graph does not keep the caller's buffer */
    int32_t b = tg_input(&t, evil, KB_F32, "64");
    int32_t c = tg_input(&t, NULL, KB_F32, "64");
    tg_output(&t, tg_op(&t, KB_OP_ADD, KB_F32, "64", tg_op(&t, KB_OP_ADD, KB_F32, "64", a, b, -1), c, -1));
    CHECK_MSG(t.st == KB_OK, "%s", kb_ctx_error(ctx));
    CHECK(strcmp(kb_graph_node(t.g, a)->name, path) == 0 && strlen(path) > 500);
    CHECK(strcmp(kb_graph_node(t.g, b)->name, evil) == 0);
    CHECK(kb_graph_node(t.g, c)->name && kb_graph_node(t.g, c)->name[0] == '\0');
    char *text = NULL;
    CHECK_STATUS(ctx, kb_graph_dump(t.g, &text), KB_OK);
    CHECK_MSG(text && strstr(text, "input user \"w\\x0a__global__ void pwn(int*p){*p=1;}//\\x22\\x5c\" : f32[64]"), "%s", text);
    CHECK(text && strstr(text, path));
    kb_string_free(ctx, text);
    kb_graph_free(t.g);

    static const struct { const char *name, *ident; } idents[] = {
        {"x", "x"}, {"m.model.layers.0.post_attention_layernorm.weight", "weight"}, {"layers.0", "layers_0"},
        {"0", "v0"}, {"grad_out1", "grad_out1"}, {"_private", "private"}, {"a__b..c", "c"}, {"...", ""},
        {"", ""}, {"w\n__global__ void pwn(int*p){*p=1;}//", "w_global_void_pwn_int_p"},
        {"a_very_long_parameter_name_indeed_more_than_24", "a_very_long_parameter_na"},
    };
    for (size_t i = 0; i < sizeof idents / sizeof idents[0]; i++) {
        char out[64];
        kb_name_ident(idents[i].name, out, sizeof out);
        CHECK_MSG(strcmp(out, idents[i].ident) == 0, "kb_name_ident(\"%s\") = \"%s\", want \"%s\"", idents[i].name, out,
                  idents[i].ident);
    }
    char out[KB_NAME_COMMENT_MAX + 4];
    kb_name_comment(evil, out, sizeof out);
    CHECK_MSG(strcmp(out, "w___global__ void pwn(int_p)__p=1______") == 0, "%s", out);
    kb_name_comment(path, out, sizeof out);
    CHECK(strlen(out) == KB_NAME_COMMENT_MAX + 3 && strcmp(out + KB_NAME_COMMENT_MAX, "...") == 0);
    for (const char *p = out; *p; p++) CHECK(*p >= 0x20 && *p < 0x7f && *p != '/' && *p != '*' && *p != '\\');
}

int main(void)
{
    if (kb_ctx_new(NULL, NULL, &ctx) != KB_OK) return 2;
    CHECK(strcmp(kb_ctx_error(ctx), "") == 0);
    test_builder_errors();
    test_sizes();
    test_overflow_checks();
    test_tables();
    test_dump();
    test_names();
    kb_ctx_free(ctx);
    kb_ctx_free(NULL);
    return check_report();
}
