/* emit.c — the bottom layer of code generation: how generated text is written (indented lines,
 * bounded expressions whose overflow is a failure rather than wrong code, the scopes the value
 * cache follows) and how each dtype is stored, loaded and converted in CUDA C. */
#include "codegen/codegen.h"

/* ---------------------------------------------------------------- type map */

static const struct dtype_render {
    const char *storage;
    const char *load;  /* storage → float (or the value itself) */
    const char *store; /* compute type → storage */
} DT[KB_DTYPE_COUNT] = {
    [KB_F32] = {"float", "%s", "(float)(%s)"},
    [KB_F16] = {"__half", "__half2float(%s)", "__float2half_rn((float)(%s))"},
    [KB_BF16] = {"__nv_bfloat16", "__bfloat162float(%s)", "__float2bfloat16_rn((float)(%s))"},
    [KB_F64] = {"double", "%s", "(double)(%s)"},
    [KB_I64] = {"long long", "%s", "(long long)(%s)"},
    [KB_I32] = {"int", "%s", "(int)(%s)"},
    [KB_BOOL] = {"unsigned char", "%s", "(unsigned char)((%s) != 0)"},
};

const char *cg_storage(kb_dtype t) { return (unsigned)t < KB_DTYPE_COUNT ? DT[t].storage : "float"; }
const char *cg_load_fmt(kb_dtype t) { return (unsigned)t < KB_DTYPE_COUNT ? DT[t].load : "%s"; }
const char *cg_store_fmt(kb_dtype t) { return (unsigned)t < KB_DTYPE_COUNT ? DT[t].store : "%s"; }

/* ---------------------------------------------------------------- small helpers */

void cg_failf(cg *c, kb_status s, const char *fmt, ...) {
    if (c->st != KB_OK) return;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    c->st = KB_FAIL(c->ctx, s, "codegen: region %d: %s", (int)c->r, msg);
}

/* snprintf that turns truncation into a failure instead of wrong code */
void cg_fmt(cg *c, char *dst, size_t n, const char *f, ...) {
    va_list ap;
    va_start(ap, f);
    int k = vsnprintf(dst, n, f, ap);
    va_end(ap);
    if (k < 0 || (size_t)k >= n) {
        cg_failf(c, KB_ERR_UNSUPPORTED, "an index expression is too long (views nested too deeply)");
        if (n) snprintf(dst, n, "0");
    }
}

void cg_line(cg *c, const char *f, ...) {
    if (c->dry) return;
    for (int i = 0; i < c->ind; i++) kb_sb_puts(c->out, "    ");
    char buf[2048];
    va_list ap;
    va_start(ap, f);
    int k = vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    if (k < 0 || (size_t)k >= sizeof buf) cg_failf(c, KB_ERR_UNSUPPORTED, "a generated line is too long");
    kb_sb_puts(c->out, buf);
    kb_sb_puts(c->out, "\n");
}

void cg_scope_push(cg *c) { c->scope++; }

void cg_scope_pop(cg *c) {
    c->scope--;
    while (c->nents > 0 && c->ents[c->nents - 1].scope > c->scope) c->nents--;
}

void cg_fail(cg *c, const char *what) { cg_failf(c, KB_ERR_UNSUPPORTED, "%s", what); }
