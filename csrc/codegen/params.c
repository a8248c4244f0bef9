/* params.c — part of the source layer of code generation: a kernel's parameters, declared in its
 * signatures and passed on by its entry points, and named after the model's values. The body is
 * generated with p<value id> for each region input and output; cg_name_params renames them in
 * the finished source (comments included), so that the names never change what is generated.
 * The ABI stays as it is: the same parameters in the same order and types (kbench.h, kb_kernel),
 * the same entry points; the launchers pass arguments by position. */
#include "codegen/codegen.h"

#include <stdlib.h>

/* The kernel's parameters, declared (decl=1) or passed on (decl=0: a call's arguments). */
void cg_emit_params(cg *c, kb_sb *sb, int decl) {
    const kb_region *rg = c->rg;
    int first = 1;
    for (int32_t i = 0; i < rg->ninputs; i++, first = 0) {
        kb_sb_puts(sb, first ? "" : ", ");
        if (decl) kb_sb_printf(sb, "const %s *%s ", cg_storage(kb_graph_node(c->g, rg->inputs[i])->dtype), c->rd->restrict_kw);
        kb_sb_printf(sb, "p%d", rg->inputs[i]);
    }
    for (int32_t j = 0; j < rg->noutputs; j++, first = 0) {
        kb_sb_puts(sb, first ? "" : ", ");
        if (decl) kb_sb_printf(sb, "%s *%s ", cg_storage(kb_graph_node(c->g, rg->outputs[j])->dtype), c->rd->restrict_kw);
        kb_sb_printf(sb, "p%d", rg->outputs[j]);
    }
    for (int32_t s = 0; s < kb_graph_nsymbols(c->g); s++, first = 0) kb_sb_printf(sb, "%s%ss%d", first ? "" : ", ", decl ? "long long " : "", s);
    if (c->col_split > 1 || c->ncolsum || c->split > 1) {
        if (decl) kb_sb_printf(sb, "%svoid *%s kb_ws", first ? "" : ", ", c->rd->restrict_kw);
        else kb_sb_printf(sb, "%skb_ws", first ? "" : ", ");
    }
}

void cg_emit_signature(cg *c, kb_sb *sb, const char *suffix) {
    char lb[64];
    snprintf(lb, sizeof lb, c->rd->launch_bounds, c->gn.threads);
    kb_sb_printf(sb, "%s %s %s%s(", c->rd->kernel_prefix, lb, c->name, suffix);
    cg_emit_params(c, sb, 1);
    kb_sb_puts(sb, ")\n");
}

/* A ROW region with saved statistics is one body, two entry points: <name> writes them (a
 * forward a backward will follow), <name>_nostats does not (inference: no buffer, and the
 * stores compiled out, so its registers and schedule are the plain kernel's). */
void cg_emit_saving_entries(cg *c, kb_sb *sb) {
    char lb[64];
    snprintf(lb, sizeof lb, c->rd->launch_bounds, c->gn.threads);
    for (int save = 1; save >= 0; save--) {
        kb_sb_printf(sb, "\n%s %s %s%s(", c->rd->kernel_prefix, lb, c->name, save ? "" : KB_ENTRY_NOSTATS);
        cg_emit_params(c, sb, 1);
        kb_sb_printf(sb, ")\n{\n    %s_body<%s>(", c->name, save ? "true" : "false");
        cg_emit_params(c, sb, 0);
        kb_sb_puts(sb, ");\n}\n");
    }
}

/* ---------------------------------------------------------------- naming */

/* Names a parameter may not take though the kernel's text does not name them: C and C++
 * keywords, CUDA's built-in variables, the macros cuda_fp16.h, cuda_bf16.h and libc may
 * define. Names starting with kb_, KB_, CUDART_ or "__" are refused by rule (is_reserved). */
static const char *const RESERVED[] = {
    "alignas", "alignof", "and", "and_eq", "asm", "auto", "bitand", "bitor", "bool", "break", "case", "catch",
    "char", "char8_t", "char16_t", "char32_t", "class", "compl", "concept", "const", "consteval", "constexpr",
    "constinit", "const_cast", "continue", "co_await", "co_return", "co_yield", "decltype", "default", "delete",
    "do", "double", "dynamic_cast", "else", "enum", "explicit", "export", "extern", "false", "float", "for",
    "friend", "goto", "if", "inline", "int", "long", "mutable", "namespace", "new", "noexcept", "not", "not_eq",
    "nullptr", "operator", "or", "or_eq", "private", "protected", "public", "register", "reinterpret_cast",
    "requires", "restrict", "return", "short", "signed", "sizeof", "static", "static_assert", "static_cast",
    "struct", "switch", "template", "this", "thread_local", "throw", "true", "try", "typedef", "typeid",
    "typename", "union", "unsigned", "using", "virtual", "void", "volatile", "wchar_t", "while", "xor", "xor_eq",
    "threadIdx", "blockIdx", "blockDim", "gridDim", "warpSize", "NULL", "INFINITY", "NAN", "HUGE_VAL",
    "HUGE_VALF", "EOF", "assert", "errno", "main",
};

static int reserved_prefix(const char *name) {
    return strncmp(name, "kb_", 3) == 0 || strncmp(name, "KB_", 3) == 0 || strncmp(name, "CUDART_", 7) == 0 ||
           strncmp(name, "__", 2) == 0;
}

static int is_reserved(const char *name) {
    if (reserved_prefix(name)) return 1;
    for (size_t i = 0; i < sizeof RESERVED / sizeof RESERVED[0]; i++)
        if (strcmp(name, RESERVED[i]) == 0) return 1;
    return 0;
}

/* Parameter k's name before it is made unique: inputs after their IR names (a parameter path's
 * last component, a user input's name) or in<i>; outputs out, out1, ...; saved statistics after
 * their IR names or stat0, stat1, ... */
static void base_name(const cg *c, int32_t k, char *out, size_t n) {
    const kb_region *rg = c->rg;
    int32_t nreal = rg->noutputs - rg->nsaved;
    if (k < rg->ninputs || k >= rg->ninputs + nreal) {
        int32_t v = k < rg->ninputs ? rg->inputs[k] : rg->outputs[k - rg->ninputs];
        kb_name_ident(kb_graph_node(c->g, v)->name, out, n);
        if (out[0]) return;
    }
    if (k < rg->ninputs) snprintf(out, n, "in%d", (int)k);
    else if (k < rg->ninputs + nreal) snprintf(out, n, k == rg->ninputs ? "out" : "out%d", (int)(k - rg->ninputs));
    else snprintf(out, n, "stat%d", (int)(k - rg->ninputs - nreal));
}

#define PNAME_LEN (KB_NAME_IDENT_MAX + 8)

/* Unique, not reserved and not named by the kernel's code: base, else base_1, base_2, ...
 * (the base cut so the whole stays within KB_NAME_IDENT_MAX characters). A base with a reserved
 * prefix ("kb_ws", a model's own "KB_SCALE") is reserved whatever its suffix: it takes a "v" in
 * front, so the search ends. */
static void unique_name(const char *code, char (*taken)[PNAME_LEN], int32_t ntaken, const char *base, char *out) {
    char own[PNAME_LEN + 1];
    if (reserved_prefix(base)) {
        snprintf(own, sizeof own, "v%s", base);
        base = own;
    }
    for (int i = 0;; i++) {
        char suffix[16] = "";
        if (i) snprintf(suffix, sizeof suffix, "_%d", i);
        int keep = (int)strlen(base), room = KB_NAME_IDENT_MAX - (int)strlen(suffix);
        if (keep > room) keep = room;
        snprintf(out, PNAME_LEN, "%.*s%s", keep, base, suffix);
        int clash = is_reserved(out) || cg_code_names(code, out);
        for (int32_t j = 0; j < ntaken && !clash; j++) clash = strcmp(taken[j], out) == 0;
        if (!clash) return;
    }
}

kb_status cg_name_params(cg *c, const char *src, const char *code, char **out) {
    const kb_region *rg = c->rg;
    int32_t np = rg->ninputs + rg->noutputs;
    kb_status st = KB_OK;
    kb_sb sb;
    kb_sb_init(&sb, c->ctx);
    char (*names)[PNAME_LEN] = kb_calloc(c->ctx, (size_t)(np ? np : 1), sizeof *names);
    int32_t *ids = kb_malloc(c->ctx, sizeof(int32_t) * (size_t)(np ? np : 1));
    KB_CHECK(c->ctx, names && ids, KB_ERR_OOM, "out of memory");
    for (int32_t k = 0; k < np; k++) {
        char base[PNAME_LEN];
        ids[k] = k < rg->ninputs ? rg->inputs[k] : rg->outputs[k - rg->ninputs];
        base_name(c, k, base, sizeof base);
        unique_name(code, names, k, base, names[k]);
    }
    /* p<id> tokens of the parameters take their names, everywhere (comments say what they are)
     * but in quotes: a name quoted in the header comments is the model's, whatever it spells */
    for (const char *s = src; *s;) {
        const char *t = s;
        while (*t && !((*t >= 'a' && *t <= 'z') || (*t >= 'A' && *t <= 'Z') || *t == '_' || (*t >= '0' && *t <= '9'))) {
            if (*t == '"') { /* to the closing quote (none inside: kb_name_comment, and code's strings have no p<id>) */
                const char *q = strchr(t + 1, '"');
                t = q ? q : t + strlen(t) - 1;
            }
            t++;
        }
        const char *e = t;
        while ((*e >= 'a' && *e <= 'z') || (*e >= 'A' && *e <= 'Z') || *e == '_' || (*e >= '0' && *e <= '9')) e++;
        kb_sb_printf(&sb, "%.*s", (int)(t - s), s);
        if (t == e) break;
        int32_t k = -1;
        if (*t == 'p' && e - t > 1 && e - t < 12) {
            const char *d = t + 1;
            while (d < e && *d >= '0' && *d <= '9') d++;
            if (d == e && (t[1] != '0' || e - t == 2)) {
                long v = strtol(t + 1, NULL, 10);
                for (int32_t j = 0; j < np && k < 0; j++)
                    if (ids[j] == v) k = j;
            }
        }
        if (k >= 0) kb_sb_puts(&sb, names[k]);
        else kb_sb_printf(&sb, "%.*s", (int)(e - t), t);
        s = e;
    }
    st = kb_sb_finish(&sb, out);
cleanup:
    kb_sb_discard(&sb);
    kb_free(c->ctx, names, sizeof *names * (size_t)(np ? np : 1));
    kb_free(c->ctx, ids, sizeof(int32_t) * (size_t)(np ? np : 1));
    return st;
}
