/* expr.c — the expression layer of code generation (with int.c): a value of the region at an
 * index becomes a named C variable (v12), computed once per scope (a small CSE cache keyed by
 * value and index). Views never move data: they rewrite the index (index.c), so a view of an
 * input becomes strided load addressing. Loads become 16-byte vector loads when the index is
 * contiguous along the chunk, and come from the row cache where the plan says so. */
#include "codegen/codegen.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>

static const kb_node *NODE(const cg *c, int32_t v) { return kb_graph_node(c->g, v); }

/* ---------------------------------------------------------------- the value cache */

static void make_key(cg *c, int32_t v, const idx *x, char *key) {
    size_t len = (size_t)snprintf(key, KEY_LEN, "%d:%c", (int)v, x->lin ? 'L' : 'C');
    int n = x->lin ? 1 : x->rank;
    for (int d = 0; d < n && len < KEY_LEN; d++) len += (size_t)snprintf(key + len, KEY_LEN - len, "|%s", x->e[d]);
    if (c->guard.on && len < KEY_LEN) /* a value under a guard may be a stand-in outside it */
        len += (size_t)snprintf(key + len, KEY_LEN - len, "|G%" PRId64 ":%" PRId64, c->guard.lo, c->guard.hi);
    if (len >= KEY_LEN) key[0] = '\0'; /* too long to key: compute it again where needed */
}

static const char *lookup(cg *c, int32_t v, const char *key) {
    if (!key[0]) return NULL;
    for (int i = c->nents - 1; i >= 0; i--)
        if (c->ents[i].v == v && strcmp(c->ents[i].key, key) == 0) return c->ents[i].var;
    return NULL;
}

static void insert(cg *c, int32_t v, const char *key, const char *var) {
    if (!key[0] || c->st != KB_OK) return;
    if (c->nents == c->capents) {
        int ncap = c->capents ? c->capents * 2 : 64;
        cg_ent *p = kb_realloc(c->ctx, c->ents, sizeof(cg_ent) * (size_t)c->capents, sizeof(cg_ent) * (size_t)ncap);
        if (!p) {
            c->st = KB_ERR_OOM;
            return;
        }
        c->ents = p;
        c->capents = ncap;
    }
    cg_ent *e = &c->ents[c->nents++];
    e->v = v;
    e->scope = c->scope;
    snprintf(e->key, KEY_LEN, "%s", key);
    snprintf(e->var, NAME_LEN, "%s", var);
}

static int is_canonical(const cg *c, const idx *x) {
    return x->lin && ((c->in_element && strcmp(x->e[0], c->full_lin) == 0) || (c->stat_lin[0] && strcmp(x->e[0], c->stat_lin) == 0));
}

/* a fresh name for v at x: v12 at its canonical index, v12_3 elsewhere */
static void var_name(cg *c, int32_t v, const idx *x, char *name) {
    int keep;
    const kb_node *nd = NODE(c, v);
    int both = cg_same_dims(nd, c->arank, c->adims) && cg_stat_shape(c, nd, &keep);
    if (is_canonical(c, x) && !both && !c->guard.on) snprintf(name, NAME_LEN, "v%d", (int)v);
    else snprintf(name, NAME_LEN, "v%d_%d", (int)v, ++c->counter);
}

/* ---------------------------------------------------------------- literals and templates */

static void literal(cg *c, double x, char *out) {
    if (isnan(x)) {
        cg_fmt(c, out, EXPR_LEN, c->dbl ? "(double)KB_NAN" : "KB_NAN");
    } else if (isinf(x)) {
        cg_fmt(c, out, EXPR_LEN, "%s%sKB_INF%s", x < 0 ? "(-" : "", c->dbl ? "(double)" : "", x < 0 ? ")" : "");
    } else {
        char num[64];
        snprintf(num, sizeof num, c->dbl ? "%.17g" : "%.9g", x);
        if (!strpbrk(num, ".e")) strcat(num, ".0");
        cg_fmt(c, out, EXPR_LEN, "%s%s%s%s", x < 0 ? "(" : "", num, c->dbl ? "" : "f", x < 0 ? ")" : "");
    }
}

/* float spelling → double spelling (expf → exp, 0.5f → 0.5), or fast-math intrinsics */
static const char *const FLOAT_FUNCS[] = {"expf", "logf", "log1pf", "expm1f", "sqrtf", "rsqrtf", "sinf", "cosf",
                                          "tanhf", "erff", "fabsf", "fmaxf", "fminf", "powf"};
static const char *const FAST[][2] = {{"expf", "kb_fexp"}, {"logf", "__logf"}, {"sinf", "__sinf"}, {"cosf", "__cosf"},
                                      {"powf", "__powf"}};
static const char *const EXACT[][2] = {{"0.70710678", "0.70710678118654752"}, {"0.79788456", "0.79788456080286536"},
                                       {"1.5957691216", "1.5957691216057308"}};

static void respell(cg *c, const char *t, char *out, size_t n) {
    size_t len = 0;
    out[0] = '\0';
#define PUT(...) (len += (size_t)snprintf(out + len, len < n ? n - len : 0, __VA_ARGS__))
    while (*t && len < n) {
        if (*t == '$') {
            const char *s = t++;
            while (*t == 'a' || *t == 'b' || *t == 'c' || *t == 'p' || (*t >= '0' && *t <= '9')) t++;
            PUT("%.*s", (int)(t - s), s);
        } else if ((*t >= 'a' && *t <= 'z') || (*t >= 'A' && *t <= 'Z') || *t == '_') {
            const char *s = t;
            while ((*t >= 'a' && *t <= 'z') || (*t >= 'A' && *t <= 'Z') || *t == '_' || (*t >= '0' && *t <= '9')) t++;
            int k = (int)(t - s);
            const char *rep = NULL;
            if (c->dbl) {
                for (size_t i = 0; i < sizeof FLOAT_FUNCS / sizeof *FLOAT_FUNCS; i++)
                    if ((int)strlen(FLOAT_FUNCS[i]) == k && strncmp(s, FLOAT_FUNCS[i], (size_t)k) == 0) {
                        PUT("%.*s", k - 1, s);
                        rep = "";
                    }
                if (k == 5 && strncmp(s, "float", 5) == 0) rep = "double";
            } else if (c->gn.fast_math) {
                for (size_t i = 0; i < sizeof FAST / sizeof *FAST; i++)
                    if ((int)strlen(FAST[i][0]) == k && strncmp(s, FAST[i][0], (size_t)k) == 0) rep = FAST[i][1];
            }
            if (!rep) PUT("%.*s", k, s);
            else PUT("%s", rep);
        } else if ((*t >= '0' && *t <= '9') || (*t == '.' && t[1] >= '0' && t[1] <= '9')) {
            const char *s = t;
            while ((*t >= '0' && *t <= '9') || *t == '.') t++;
            if ((*t == 'e' || *t == 'E') && (t[1] == '-' || t[1] == '+' || (t[1] >= '0' && t[1] <= '9'))) {
                t += 2;
                while (*t >= '0' && *t <= '9') t++;
            }
            int k = (int)(t - s);
            if (*t == 'f' && c->dbl) {
                t++;
                const char *rep = NULL;
                for (size_t i = 0; i < sizeof EXACT / sizeof *EXACT; i++)
                    if ((int)strlen(EXACT[i][0]) == k && strncmp(s, EXACT[i][0], (size_t)k) == 0) rep = EXACT[i][1];
                if (rep) PUT("%s", rep);
                else if (s[k - 1] == '.') PUT("%.*s0", k, s);
                else PUT("%.*s", k, s);
            } else {
                PUT("%.*s", k, s);
            }
        } else {
            PUT("%c", *t++);
        }
    }
#undef PUT
    if (len >= n) cg_failf(c, KB_ERR_UNSUPPORTED, "a pointwise template is too long");
}

static void substitute(cg *c, const char *t, const char ops[3][EXPR_LEN], const kb_node *nd, char *out) {
    char p0[EXPR_LEN], p1[EXPR_LEN];
    literal(c, nd->scalar[0], p0);
    literal(c, nd->scalar[1], p1);
    size_t len = 0, n = EXPR_LEN * 4;
    char buf[EXPR_LEN * 4];
    buf[0] = '\0';
    while (*t && len < n) {
        const char *rep = NULL;
        if (t[0] == '$') {
            if (t[1] == 'a' || t[1] == 'b' || t[1] == 'c') rep = ops[t[1] - 'a'], t += 2;
            else if (t[1] == 'p' && t[2] == '0') rep = p0, t += 3;
            else if (t[1] == 'p' && t[2] == '1') rep = p1, t += 3;
        }
        if (rep) len += (size_t)snprintf(buf + len, n - len, "%s", rep);
        else buf[len++] = *t++, buf[len] = '\0';
    }
    if (len >= n) cg_failf(c, KB_ERR_UNSUPPORTED, "a pointwise expression is too long");
    cg_fmt(c, out, EXPR_LEN * 4, "%s", buf);
}

/* ---------------------------------------------------------------- values at an index */

static void ev(cg *c, int32_t v, const idx *ix, char *out);

static void declare(cg *c, int32_t v, const idx *x, const char *key, const char *expr, char *out) {
    char name[NAME_LEN];
    var_name(c, v, x, name);
    cg_line(c, "const %s %s = %s;", c->ct, name, expr);
    insert(c, v, key, name);
    cg_fmt(c, out, EXPR_LEN, "%s", name);
}

/* A value the row cache keeps (registers) is stored there in the pass that first computes it;
 * later passes read it back (ev), whatever kind of node computed it. */
static void fill_row_cache(cg *c, int32_t v, int canon, const char *var) {
    if (canon && c->cached[v] && c->pass == c->fill_pass[v]) cg_line(c, "rc%d[u][%s] = %s;", (int)v, c->kvar, var);
}

static void convert_load(cg *c, kb_dtype t, const char *raw, char *out) {
    char conv[EXPR_LEN * 2];
    cg_fmt(c, conv, sizeof conv, cg_load_fmt(t), raw);
    int native = (t == KB_F64 && c->dbl) || ((t == KB_F32 || t == KB_F16 || t == KB_BF16) && !c->dbl);
    if (native) cg_fmt(c, out, EXPR_LEN * 2, "%s", conv);
    else cg_fmt(c, out, EXPR_LEN * 2, "(%s)%s", c->ct, conv);
}

/* Vector access along the chunk: the index is the chunk's canonical element (rule 1), or the
 * value's last component is the anchor's last variable, which moves by one along the chunk,
 * and nothing else depends on it (rule 2: a broadcast row such as a weight). */
static int vector_base(cg *c, const kb_node *nd, const idx *x, char *base) {
    if (!c->in_element || c->vec <= 1) return 0;
    if (x->lin && strcmp(x->e[0], c->full_lin) == 0) {
        if (!c->full_vec_ok) return 0;
        cg_fmt(c, base, EXPR_LEN, "%s", c->full_lin0);
        return 1;
    }
    if (!c->aligned || nd->rank == 0) return 0;
    if (!cg_vec_multiple(c, nd->dims[nd->rank - 1])) return 0;
    idx y;
    cg_to_comps(c, nd, x, &y);
    char lastvar[NAME_LEN], shifted[NAME_LEN];
    snprintf(lastvar, sizeof lastvar, "a%d", c->last);
    snprintf(shifted, sizeof shifted, "(a%d + ", c->last);
    const char *e = y.e[nd->rank - 1];
    long long off = 0;
    if (strcmp(e, lastvar) != 0) { /* a slice at a whole number of vectors: (a1 + 512) */
        char *end;
        if (strncmp(e, shifted, strlen(shifted)) != 0) return 0;
        off = strtoll(e + strlen(shifted), &end, 10);
        if (strcmp(end, ")") != 0 || off % c->vec != 0) return 0;
    }
    for (int d = 0; d + 1 < nd->rank; d++)
        if (y.mask[d] & ((1u << c->last) | CG_DATA)) return 0;
    if (off) snprintf(y.e[nd->rank - 1], EXPR_LEN, "(a%d_0 + %lld)", c->last, off);
    else snprintf(y.e[nd->rank - 1], EXPR_LEN, "a%d_0", c->last);
    cg_to_lin(c, nd, &y, base, NULL);
    return 1;
}

static const char *vector_request(cg *c, int32_t v, int smem, int fill, const char *base, const char *guard) {
    for (int i = 0; i < c->nvr; i++)
        if (c->vr[i].v == v && c->vr[i].smem == smem && strcmp(c->vr[i].base, base) == 0 &&
            strcmp(c->vr[i].guard, guard) == 0) {
            c->vr[i].fill |= fill;
            return c->vr[i].name;
        }
    if (c->nvr == (int)(sizeof c->vr / sizeof c->vr[0])) return NULL;
    cg_vreq *r = &c->vr[c->nvr++];
    r->v = v;
    r->smem = smem;
    r->fill = fill;
    snprintf(r->base, EXPR_LEN, "%s", base);
    snprintf(r->guard, EXPR_LEN, "%s", guard);
    snprintf(r->name, NAME_LEN, "x%d_%d", (int)v, ++c->counter);
    return r->name;
}

/* Is this per-row input (read at the row's own index) one loaded a row ahead into pfs<v>, read
 * as rs<v>? Registers it where the first pass's elements read it; later passes find it there. */
static int row_stat_ahead(cg *c, int32_t v) {
    if (!c->prefetch || c->guard.on) return 0;
    for (int j = 0; j < c->nps; j++)
        if (c->ps[j] == v) return 1;
    if (c->pass != c->pf_pass || !c->in_element || c->nps == (int)(sizeof c->ps / sizeof c->ps[0])) return 0;
    c->ps[c->nps++] = v;
    return 1;
}

static void load(cg *c, int32_t v, const idx *x, const char *key, char *out) {
    const kb_node *nd = NODE(c, v);
    int canon = c->in_element && x->lin && strcmp(x->e[0], c->full_lin) == 0;
    int cached = canon && c->cached[v];
    int regs = c->gn.cache == KB_CACHE_REGS;
    char name[NAME_LEN], raw[EXPR_LEN], conv[EXPR_LEN * 2], base[EXPR_LEN];
    var_name(c, v, x, name);
    const char *vn = NULL;   /* the vector the element comes from, if it does */
    if (cached && c->pass > c->fill_pass[v]) { /* shared-memory row cache (registers: see ev) */
        if (c->pass < 32) c->reads[v] |= 1u << c->pass;
        if (c->vec > 1 && (vn = vector_request(c, v, 1, 0, "c0", "")) != NULL) cg_fmt(c, raw, sizeof raw, "%s.v[k]", vn);
        else cg_fmt(c, raw, sizeof raw, "sm%d[c]", (int)v);
    } else {
        int fill = cached && !regs;
        char guard[EXPR_LEN] = "";
        int vec_ok = !c->guard.on || cg_chunk_guard(c, guard); /* guarded: whole chunks in or out */
        if (vec_ok && vector_base(c, nd, x, base) && (vn = vector_request(c, v, 0, fill, base, guard)) != NULL) {
            cg_fmt(c, raw, sizeof raw, "%s.v[k]", vn);
        } else if (!fill && x->lin && c->stat_lin[0] && strcmp(x->e[0], c->stat_lin) == 0 && row_stat_ahead(c, v)) {
            cg_fmt(c, raw, sizeof raw, "rs%d", (int)v);  /* loaded a row ahead */
        } else {
            char lin[EXPR_LEN];
            cg_to_lin(c, nd, x, lin, NULL);
            cg_guarded_ref(c, v, lin, raw);
            if (fill) { /* scalar fill of the shared-memory cache */
                char r[NAME_LEN];
                snprintf(r, sizeof r, "r%d_%d", (int)v, ++c->counter);
                cg_line(c, "const %s %s = %s;", cg_storage(nd->dtype), r, raw);
                cg_line(c, "sm%d[c] = %s;", (int)v, r);
                cg_fmt(c, raw, sizeof raw, "%s", r);
            }
        }
    }
    if (nd->dtype == KB_BF16 && vn) /* from its 32-bit word (kb_bf16_at in the preamble) */
        cg_fmt(c, conv, sizeof conv, c->dbl ? "(double)kb_bf16_at(%s, k)" : "kb_bf16_at(%s, k)", vn);
    else
        convert_load(c, nd->dtype, raw, conv);
    cg_line(c, "const %s %s = %s;", c->ct, name, conv);
    if (cached && regs && c->pass == c->fill_pass[v]) cg_line(c, "rc%d[u][%s] = %s;", (int)v, c->kvar, name);
    insert(c, v, key, name);
    cg_fmt(c, out, EXPR_LEN, "%s", name);
}

static void cast_expr(cg *c, kb_dtype to, const char *a, char *out) {
    const char *ct = c->ct;
    switch (to) {
    case KB_F32: cg_fmt(c, out, EXPR_LEN * 4, c->dbl ? "(double)(float)(%s)" : "%s", a); break;
    case KB_F64: cg_fmt(c, out, EXPR_LEN * 4, "%s", a); break;
    case KB_F16: cg_fmt(c, out, EXPR_LEN * 4, "(%s)__half2float(__float2half_rn((float)(%s)))", ct, a); break;
    case KB_BF16: cg_fmt(c, out, EXPR_LEN * 4, "(%s)__bfloat162float(__float2bfloat16_rn((float)(%s)))", ct, a); break;
    case KB_BOOL: cg_fmt(c, out, EXPR_LEN * 4, "(%s)((%s) != 0)", ct, a); break;
    default: cg_fmt(c, out, EXPR_LEN * 4, "(%s)(long long)(%s)", ct, a); break;
    }
}

/* where(cond, a, b) with cond a test of the chunk's last coordinate: the selected branch alone
 * is computed (an if per element, the same way for a whole chunk where the split is at a whole
 * vector), each under its guard, so its loads read only where it is selected. A branch the
 * guards already settle is all that is generated. */
static void where_branches(cg *c, int32_t v, const kb_node *nd, const idx *x, const char *key, const cg_guard *t,
                           const cg_guard *f, char *out) {
    cg_guard saved = c->guard;
    char cond[EXPR_LEN], val[EXPR_LEN], name[NAME_LEN];
    int live[2] = {!cg_guard_empty(t), !cg_guard_empty(f)};
    if (live[0] && live[1]) {
        ev(c, nd->inputs[0], x, cond);
        if (strcmp(cond, "1.0f") == 0) live[1] = 0;
        else if (strcmp(cond, "0.0f") == 0) live[0] = 0;
    }
    var_name(c, v, x, name);
    if (!live[0] || !live[1]) { /* one side only */
        int i = live[0] ? 1 : 2;
        c->guard = i == 1 ? *t : *f;
        if (live[i - 1]) ev(c, nd->inputs[i], x, val);
        else cg_fmt(c, val, EXPR_LEN, "0.0f"); /* neither: never selected */
        c->guard = saved;
        declare(c, v, x, key, val, out);
        return;
    }
    cg_line(c, "%s %s;", c->ct, name);
    for (int i = 1; i < 3; i++) {
        cg_line(c, i == 1 ? "if (%s != 0.f) {" : "} else {", cond);
        c->ind++;
        cg_scope_push(c);
        c->guard = i == 1 ? *t : *f;
        ev(c, nd->inputs[i], x, val);
        cg_line(c, "%s = %s;", name, val);
        cg_scope_pop(c);
        c->ind--;
    }
    cg_line(c, "}");
    c->guard = saved;
    insert(c, v, key, name);
    cg_fmt(c, out, EXPR_LEN, "%s", name);
}

/* exp(y - M) of an online pair, after its pass: the thread's kept exp(y - its max), rescaled
 * (online_local in codegen.h) — no second exp per element. */
static int online_kept(cg *c, int32_t v, const idx *x, const char *key, char *out) {
    for (int32_t k = 0; k < c->rg->nnodes; k++) {
        int32_t s = c->rg->nodes[k];
        if (c->online_of[s] < 0 || NODE(c, s)->inputs[0] != v || c->pass <= c->dp[s]) continue;
        char name[NAME_LEN];
        var_name(c, v, x, name);
        cg_line(c, "const %s %s = ol%d[u][%s] * olc%d;  // exp(y - M), kept from pass %d", c->ct, name, (int)s, c->kvar, (int)s,
                c->dp[s] + 1);
        insert(c, v, key, name);
        cg_fmt(c, out, EXPR_LEN, "%s", name);
        return 1;
    }
    return 0;
}

static void ev(cg *c, int32_t v, const idx *ix, char *out) {
    if (c->st != KB_OK) {
        snprintf(out, EXPR_LEN, "0");
        return;
    }
    const kb_node *nd = NODE(c, v);
    const kb_op_info *info = kb_op_get(nd->op);
    if (nd->op == KB_OP_CONST) {
        literal(c, nd->scalar[0], out);
        return;
    }
    if (nd->op == KB_OP_IOTA) { /* the index component along the axis, as a value */
        idx y;
        cg_to_comps(c, nd, ix, &y);
        cg_fmt(c, out, EXPR_LEN, "((%s)(%s))", c->ct, y.e[nd->axis]);
        return;
    }
    if (c->member[v] && info->kind == KB_KIND_VIEW) {
        idx u;
        cg_view_map(c, nd, ix, &u);
        ev(c, nd->inputs[0], &u, out);
        return;
    }
    idx x = *ix;
    cg_normalize(c, nd, &x);
    char key[KEY_LEN];
    make_key(c, v, &x, key);
    const char *hit = lookup(c, v, key);
    if (hit) {
        cg_fmt(c, out, EXPR_LEN, "%s", hit);
        return;
    }
    /* the row cache: a value evaluated in several passes is kept from its first one */
    int canon = c->in_element && x.lin && strcmp(x.e[0], c->full_lin) == 0;
    if (canon && c->online_local && nd->op == KB_OP_EXP && online_kept(c, v, &x, key, out)) return;
    if (canon && c->pass < 32) c->uses[v] |= 1u << c->pass;
    if (canon && c->cached[v] && c->pass > c->fill_pass[v] && c->gn.cache == KB_CACHE_REGS) {
        char name[NAME_LEN];
        var_name(c, v, &x, name);
        if (c->pass < 32) c->reads[v] |= 1u << c->pass;
        cg_line(c, "const %s %s = rc%d[u][%s];  // from the row cache", c->ct, name, (int)v, c->kvar);
        insert(c, v, key, name);
        cg_fmt(c, out, EXPR_LEN, "%s", name);
        return;
    }
    if (!c->member[v]) {
        if (c->in_slot[v] < 0) {
            cg_failf(c, KB_ERR_INVALID, "%%%d is neither computed in the region nor one of its inputs", (int)v);
            return;
        }
        load(c, v, &x, key, out);
        return;
    }
    char ops[3][EXPR_LEN], expr[EXPR_LEN * 4], tpl[EXPR_LEN * 2];
    switch (info->kind) {
    case KB_KIND_UNARY:
    case KB_KIND_BINARY:
    case KB_KIND_TERNARY: {
        cg_guard t, f;
        if (nd->op == KB_OP_WHERE && cg_where_guards(c, nd->inputs[0], &x, &t, &f)) {
            where_branches(c, v, nd, &x, key, &t, &f, out); /* POINTWISE: no row cache */
            return;
        }
        if (!cg_int_compare(c, nd, &x, expr)) { /* (coordinates compare as integers) */
            for (int i = 0; i < nd->ninputs; i++) ev(c, nd->inputs[i], &x, ops[i]);
            if (nd->op == KB_OP_CAST) {
                cast_expr(c, nd->dtype, ops[0], expr);
            } else {
                respell(c, info->cuda, tpl, sizeof tpl);
                substitute(c, tpl, ops, nd, expr);
            }
        }
        declare(c, v, &x, key, expr, out);
        fill_row_cache(c, v, canon, out);
        return;
    }
    case KB_KIND_GATHER: {
        idx y, a;
        cg_to_comps(c, nd, &x, &y);
        const kb_node *an = NODE(c, nd->inputs[0]);
        char size[EXPR_LEN];
        cg_int iv;
        cg_ev_int(c, nd->inputs[1], &y, &iv);
        kb_dim ad = an->dims[nd->axis];
        if (!(iv.mask & CG_DATA) && iv.lo >= 0 && ad.nsym == 0 && iv.hi < ad.coef) {
            /* an index of coordinates that stays in range: a view, read at that position */
            a = y;
            a.rank = an->rank;
            cg_fmt(c, a.e[nd->axis], EXPR_LEN, "%s", iv.e);
            a.mask[nd->axis] = iv.mask;
            ev(c, nd->inputs[0], &a, out);
            insert(c, v, key, out);
            fill_row_cache(c, v, canon, out);
            return;
        }
        cg_dim_expr(c, ad, size);
        int g = ++c->counter;
        cg_line(c, "const long long g%d = %s;", g, iv.e);
        cg_line(c, "const bool ok%d = g%d >= 0 && g%d < %s;  // out of range reads nothing, gives NaN", g, g, g, size);
        a = y;
        a.rank = an->rank;
        cg_fmt(c, a.e[nd->axis], EXPR_LEN, "(ok%d ? g%d : 0)", g, g);
        a.mask[nd->axis] = CG_DATA;
        ev(c, nd->inputs[0], &a, ops[0]);
        cg_fmt(c, expr, sizeof expr, "ok%d ? %s : %s", g, ops[0], c->dbl ? "(double)KB_NAN" : "KB_NAN");
        declare(c, v, &x, key, expr, out);
        fill_row_cache(c, v, canon, out);
        return;
    }
    case KB_KIND_REDUCE:
        cg_failf(c, KB_ERR_UNSUPPORTED, "%%%d (a reduction) is read before its pass ends or at another row's index", (int)v);
        return;
    default:
        cg_failf(c, KB_ERR_UNSUPPORTED, "%%%d: %s cannot be generated inside a kernel", (int)v, info->name);
        return;
    }
}

/* ---------------------------------------------------------------- for the layers above */

void cg_ev(cg *c, int32_t v, const idx *ix, char *out) { ev(c, v, ix, out); }

/* The value an output stores, before the store's own conversion: a cast to the 16-bit type
 * being stored is that conversion already, so its operand is stored (the same bits, without a
 * round trip through f32 per element). */
void cg_ev_store(cg *c, int32_t v, const idx *ix, char *out) {
    const kb_node *nd = NODE(c, v);
    if (nd->op == KB_OP_CAST && (nd->dtype == KB_F16 || nd->dtype == KB_BF16) &&
        kb_dtype_is_float(NODE(c, nd->inputs[0])->dtype))
        v = nd->inputs[0];
    ev(c, v, ix, out);
}

void cg_bind(cg *c, int32_t v, const idx *x, const char *var) {
    char key[KEY_LEN];
    make_key(c, v, x, key);
    insert(c, v, key, var);
}
