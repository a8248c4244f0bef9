/* module_gemm.c — kbench._C's tensor-core GEMM generator (codegen/gemm.c): a spec (a dict of
 * typed fields), a genome (7 ints: tile_m, tile_n, tile_k, warps_m, warps_n, stages, min_blocks)
 * and an architecture in, the source and its launch geometry out; the genome's legality, default
 * and candidates. METH_FASTCALL; kbench/runtime/gemm.py compiles and launches. */
#include "python/module.h"

#include <string.h>

#include "core/internal.h"
#include "python/module_gemm.h"

static const char *const GENES[7] = {"tile_m", "tile_n", "tile_k", "warps_m", "warps_n", "stages", "min_blocks"};

static int genome_from(PyObject *o, kb_gemm_genome *g) {
    int32_t *f[7] = {&g->tile_m, &g->tile_n, &g->tile_k, &g->warps_m, &g->warps_n, &g->stages, &g->min_blocks};
    int64_t v[7];
    if (kb_py_int64s(o, v, 7, "gemm genome (tile_m, tile_n, tile_k, warps_m, warps_n, stages, min_blocks)") < 0)
        return -1;
    for (int i = 0; i < 7; i++) {
        if (v[i] < 1 || v[i] > 4096) {
            PyErr_Format(PyExc_ValueError, "gemm genome: %s = %lld is out of range", GENES[i], (long long)v[i]);
            return -1;
        }
        *f[i] = (int32_t)v[i];
    }
    return 0;
}

static PyObject *genome_to(const kb_gemm_genome *g) {
    return Py_BuildValue("(iiiiiii)", g->tile_m, g->tile_n, g->tile_k, g->warps_m, g->warps_n, g->stages,
                         g->min_blocks);
}

/* spec[key]: missing -> *present = 0; else a new reference */
static PyObject *spec_item(PyObject *spec, const char *key) {
    PyObject *v = PyMapping_GetItemString(spec, key);
    if (!v && PyErr_ExceptionMatches(PyExc_KeyError)) PyErr_Clear();
    return v;
}

/* a dtype name ("bf16") or None (-1 where none_ok); -2 with an exception set */
static int spec_dtype(PyObject *spec, const char *key, int none_ok, int dflt) {
    PyObject *v = spec_item(spec, key);
    if (!v) return PyErr_Occurred() ? -2 : dflt;
    int t = -2;
    if (v == Py_None && none_ok) t = -1;
    else if (PyUnicode_Check(v)) {
        const char *s = PyUnicode_AsUTF8(v);
        t = s ? kb_dtype_from_name(s) : -2;
        if (s && t < 0) PyErr_Format(PyExc_ValueError, "gemm spec: %s: unknown dtype %R", key, v), t = -2;
    } else {
        PyErr_Format(PyExc_TypeError, "gemm spec: %s must be a dtype name ('bf16', 'f16', 'f32')%s, not %.100s", key,
                     none_ok ? " or None" : "", Py_TYPE(v)->tp_name);
    }
    Py_DECREF(v);
    return t;
}

static int spec_bool(PyObject *spec, const char *key) {
    PyObject *v = spec_item(spec, key);
    if (!v) return PyErr_Occurred() ? -1 : 0;
    int b = PyObject_IsTrue(v);
    Py_DECREF(v);
    return b;
}

static const char *const SPEC_KEYS[] = {"ab",     "out",    "a_transposed", "b_transposed", "a_broadcast",
                                        "b_broadcast", "alpha", "bias_n", "bias_m", "residual", "act",
                                        "act_scalars", NULL};

/* the spec dict -> *spec and *b (the built-in epilogue: none of its terms -> no epilogue) */
static int spec_from(PyObject *d, kb_gemm_spec *spec, kb_gemm_builtin *b, int *has_epilogue) {
    if (!PyDict_Check(d)) {
        PyErr_Format(PyExc_TypeError, "gemm spec must be a dict, not %.100s", Py_TYPE(d)->tp_name);
        return -1;
    }
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(d, &pos, &key, &value)) {
        const char *k = PyUnicode_Check(key) ? PyUnicode_AsUTF8(key) : NULL;
        int known = 0;
        for (int i = 0; k && SPEC_KEYS[i]; i++) known |= strcmp(k, SPEC_KEYS[i]) == 0;
        if (!known) {
            PyErr_Format(PyExc_TypeError, "gemm spec: unknown key %R", key);
            return -1;
        }
    }
    memset(spec, 0, sizeof *spec);
    memset(b, 0, sizeof *b);
    int ab = spec_dtype(d, "ab", 0, KB_BF16), out = spec_dtype(d, "out", 0, ab);
    int at = spec_bool(d, "a_transposed"), bt = spec_bool(d, "b_transposed");
    int abc = spec_bool(d, "a_broadcast"), bbc = spec_bool(d, "b_broadcast");
    int alpha = spec_bool(d, "alpha");
    int bn = spec_dtype(d, "bias_n", 1, -1), bm = spec_dtype(d, "bias_m", 1, -1), res = spec_dtype(d, "residual", 1, -1);
    if (ab < -1 || out < -1 || at < 0 || bt < 0 || abc < 0 || bbc < 0 || alpha < 0 || bn < -1 || bm < -1 || res < -1) return -1;
    int act = -1;
    PyObject *v = spec_item(d, "act");
    if (!v && PyErr_Occurred()) return -1;
    if (v && v != Py_None) {
        const char *s = PyUnicode_Check(v) ? PyUnicode_AsUTF8(v) : NULL;
        act = s ? kb_op_from_name(s) : -1;
        if (act < 0) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "gemm spec: act: unknown op %R", v);
            Py_DECREF(v);
            return -1;
        }
    }
    Py_XDECREF(v);
    double p[2] = {0, 0};
    v = spec_item(d, "act_scalars");
    if (!v && PyErr_Occurred()) return -1;
    if (v) {
        PyObject *t = kb_py_tuple(v, "gemm spec: act_scalars");
        Py_DECREF(v);
        if (!t) return -1;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t) && i < 2; i++) {
            p[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(t, i));
            if (p[i] == -1.0 && PyErr_Occurred()) {
                Py_DECREF(t);
                return -1;
            }
        }
        Py_DECREF(t);
    }
    spec->ab = (kb_dtype)ab;
    spec->out = (kb_dtype)out;
    spec->a_transposed = at, spec->b_transposed = bt, spec->a_broadcast = abc, spec->b_broadcast = bbc;
    b->has_alpha = alpha, b->bias_n = bn, b->bias_m = bm, b->residual = res, b->act = act;
    b->act_p0 = p[0], b->act_p1 = p[1];
    *has_epilogue = alpha || bn >= 0 || bm >= 0 || res >= 0 || act >= 0;
    return 0;
}

/* gemm_generate(spec, genome, sm, dev=None) -> (source, name, block, smem_bytes, tile_m, tile_n) */
static PyObject *py_gemm_generate(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "gemm_generate(spec, genome, sm, dev=None)");
        return NULL;
    }
    kb_gemm_spec spec;
    kb_gemm_builtin b;
    kb_gemm_genome g;
    kb_gemm_epilogue epi;
    kb_device_info dev;
    int has_epi;
    long sm = PyLong_AsLong(args[2]);
    if (sm == -1 && PyErr_Occurred()) return NULL;
    if (spec_from(args[0], &spec, &b, &has_epi) < 0 || genome_from(args[1], &g) < 0) return NULL;
    if (kb_py_devinfo(nargs > 3 ? args[3] : Py_None, &dev) < 0) return NULL;
    kb_ctx *ctx = kb_py_thread_ctx();
    if (!ctx) return NULL;
    kb_status st = kb_gemm_genome_check(ctx, &g, &dev);
    if (st == KB_OK && has_epi) st = kb_gemm_builtin_epilogue(ctx, &b, &epi);
    if (st != KB_OK) return kb_py_raise(module, ctx, st, NULL);
    spec.epilogue = has_epi ? &epi : NULL;
    kb_sb sb;
    kb_sb_init(&sb, ctx);
    kb_gemm_launch L;
    st = kb_gemm_generate(ctx, &spec, &g, (int)sm, &sb, &L);
    char *src = NULL;
    if (st == KB_OK) st = kb_sb_finish(&sb, &src);
    else kb_sb_discard(&sb);
    if (st != KB_OK) return kb_py_raise(module, ctx, st, NULL);
    PyObject *r = Py_BuildValue("(ssiiii)", src, L.name, L.block, L.smem_bytes, L.tile_m, L.tile_n);
    kb_string_free(ctx, src);
    return r;
}

/* gemm_genome_check(genome, dev=None) -> None; ValueError naming the rule broken */
static PyObject *py_gemm_genome_check(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "gemm_genome_check(genome, dev=None)");
        return NULL;
    }
    kb_gemm_genome g;
    kb_device_info dev;
    if (genome_from(args[0], &g) < 0 || kb_py_devinfo(nargs > 1 ? args[1] : Py_None, &dev) < 0) return NULL;
    kb_ctx *ctx = kb_py_thread_ctx();
    if (!ctx) return NULL;
    kb_status st = kb_gemm_genome_check(ctx, &g, &dev);
    if (st != KB_OK) return kb_py_raise(module, ctx, st, NULL);
    Py_RETURN_NONE;
}

static int sizes_from(PyObject *const *args, int64_t v[4]) {
    for (int i = 0; i < 4; i++) {
        v[i] = PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) return -1;
        if (v[i] < 0) {
            PyErr_SetString(PyExc_ValueError, "gemm sizes must be >= 0");
            return -1;
        }
    }
    return 0;
}

/* gemm_genomes(M, N, K, batch, dev=None) -> [genome, ...], the default first */
static PyObject *py_gemm_genomes(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 4 || nargs > 5) {
        PyErr_SetString(PyExc_TypeError, "gemm_genomes(M, N, K, batch, dev=None)");
        return NULL;
    }
    int64_t v[4];
    kb_device_info dev;
    if (sizes_from(args, v) < 0 || kb_py_devinfo(nargs > 4 ? args[4] : Py_None, &dev) < 0) return NULL;
    kb_gemm_genome out[32];
    int n = kb_gemm_genome_candidates(v[0], v[1], v[2], v[3], &dev, out, 32);
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        PyObject *t = genome_to(&out[i]);
        if (!t) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, t);
    }
    return list;
}

PyMethodDef kb_gemm_methods[] = {
    {"gemm_generate", (PyCFunction)(void (*)(void))py_gemm_generate, METH_FASTCALL,
     "gemm_generate(spec, genome, sm, dev=None) -> (source, name, block, smem_bytes, tile_m, tile_n): a tensor-core "
     "GEMM kernel (grid: (ceil(M / tile_m) * ceil(N / tile_n), 1, batch)). spec: a dict of ab, out (dtype names), "
     "a_transposed, b_transposed, a_broadcast, b_broadcast, alpha (bools), bias_n, bias_m, residual (dtype names "
     "or None), act "
     "(a unary op's name or None), act_scalars; genome: (tile_m, tile_n, tile_k, warps_m, warps_n, stages, min_blocks). "
     "NotImplementedError for what the generator cannot do, ValueError for an illegal genome"},
    {"gemm_genome_check", (PyCFunction)(void (*)(void))py_gemm_genome_check, METH_FASTCALL,
     "gemm_genome_check(genome, dev=None): ValueError naming the rule an illegal genome breaks on dev"},
    {"gemm_genomes", (PyCFunction)(void (*)(void))py_gemm_genomes, METH_FASTCALL,
     "gemm_genomes(M, N, K, batch, dev=None) -> [genome]: candidates to time, the default first"},
    {NULL, NULL, 0, NULL},
};
