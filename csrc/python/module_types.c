/* module_types.c — the typed data kbench._C hands to Python and takes back: Genome (one region's
 * schedule: its genes as attributes, its canonical text as str(), equal and hashed by value,
 * immutable) and KernelInfo (a generated kernel: source, entry points, launch geometry; read-only,
 * made by generate() or from stored launch data). Both are heap types of the module. */
#include "python/module.h"

#include <stddef.h>
#include <string.h>

#include "structmember.h"

/* ---------------------------------------------------------------- Genome */

static const char GENOME_DOC[] =
    "Genome(*, threads=256, vec=1, rows=1, items=1, cache='regs', two_pass=1, fast_math=0, persistent=0, "
    "col_split=1, row_split=1)\n"
    "--\n\n"
    "One region's schedule. Genes left out take the values above (those of a text that leaves them out);\n"
    "each must be within its range (ValueError). Genome.parse(text) reads the canonical text, str() writes\n"
    "it: the genome's identity in the kernel cache and in reports (row_split only where it is not 1, so a\n"
    "genome without a split keeps the text it had before the gene). Immutable; equal and hashed by value.\n"
    "Whether a region can run it is genome_legal()'s question, and generate() refuses what codegen cannot do.";

static int32_t *gene_field(kb_genome *gn, int i) { return (int32_t *)((char *)gn + kb_genome_genes()[i].offset); }

static int32_t gene_get(const kb_genome *gn, int i) {
    return *(const int32_t *)((const char *)gn + kb_genome_genes()[i].offset);
}

static int is_cache(int i) { return kb_genome_genes()[i].offset == offsetof(kb_genome, cache); }

/* The gene called name, or -1. */
static int gene_index(PyObject *name) {
    const char *s = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
    if (!s) {
        PyErr_Clear();
        return -1;
    }
    for (int i = 0; i < KB_NGENES; i++)
        if (strcmp(kb_genome_genes()[i].name, s) == 0) return i;
    return -1;
}

/* Gene i of gn from a Python value: an int (cache: its name). The range is checked later
 * (kb_genome_check), but for values no int32 holds. -1 with an exception set. */
static int gene_set(kb_genome *gn, int i, PyObject *v) {
    const kb_gene *gene = &kb_genome_genes()[i];
    if (is_cache(i)) {
        Py_ssize_t n;
        const char *s = PyUnicode_Check(v) ? PyUnicode_AsUTF8AndSize(v, &n) : NULL;
        if (!s) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "Genome: cache is a str ('regs', 'smem' or 'reread'), not %.100s",
                             Py_TYPE(v)->tp_name);
            return -1;
        }
        int32_t c = kb_cache_where_of(s, (size_t)n);
        if (c < 0 || (size_t)n != strlen(s)) {
            PyErr_Format(PyExc_ValueError, "genome: bad value %R for cache (regs, smem, reread)", v);
            return -1;
        }
        *gene_field(gn, i) = c;
        return 0;
    }
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "Genome: %s is an int, not %.100s", gene->name, Py_TYPE(v)->tp_name);
        return -1;
    }
    int overflow;
    long x = PyLong_AsLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (overflow || x < INT32_MIN || x > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "genome: bad value %R for %s (%d..%d)", v, gene->name, (int)gene->lo,
                     (int)gene->hi);
        return -1;
    }
    *gene_field(gn, i) = (int32_t)x;
    return 0;
}

/* The keyword genes of kwds over *gn, then the range check. -1 with an exception set. */
static int genes_from_kwds(PyObject *module, const char *fname, PyObject *args, PyObject *kwds, kb_genome *gn) {
    if (args && PyTuple_GET_SIZE(args) > 0) {
        PyErr_Format(PyExc_TypeError, "%s takes genes by keyword only (Genome.parse reads a text)", fname);
        return -1;
    }
    if (kwds) {
        PyObject *key, *value;
        Py_ssize_t pos = 0;
        while (PyDict_Next(kwds, &pos, &key, &value)) {
            int i = gene_index(key);
            if (i < 0) {
                PyErr_Format(PyExc_TypeError, "%s got an unexpected keyword argument %R (genes: threads, vec, rows, "
                             "items, cache, two_pass, fast_math, persistent, col_split, row_split)", fname, key);
                return -1;
            }
            if (gene_set(gn, i, value) < 0) return -1;
        }
    }
    kb_ctx *ctx = kb_py_thread_ctx();
    if (!ctx) return -1;
    kb_status st = kb_genome_check(ctx, gn);
    if (st != KB_OK) {
        kb_py_raise(module, ctx, st, NULL);
        return -1;
    }
    return 0;
}

static PyObject *genome_wrap(PyTypeObject *tp, const kb_genome *gn) {
    kb_py_genome *self = (kb_py_genome *)tp->tp_alloc(tp, 0);
    if (self) self->gn = *gn;
    return (PyObject *)self;
}

PyObject *kb_py_genome_new(kb_module_state *state, const kb_genome *gn) { return genome_wrap(state->genome_type, gn); }

int kb_py_genome_of(kb_module_state *state, PyObject *obj, kb_genome *out, const char *what) {
    if (!PyObject_TypeCheck(obj, state->genome_type)) {
        PyErr_Format(PyExc_TypeError, "%s must be a kbench._C.Genome (Genome.parse(text) reads a text), not %.100s",
                     what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = ((kb_py_genome *)obj)->gn;
    return 0;
}

static PyObject *genome_new(PyTypeObject *tp, PyObject *args, PyObject *kwds) {
    kb_genome gn = *kb_genome_base();
    if (genes_from_kwds(PyType_GetModule(tp), "Genome()", args, kwds, &gn) < 0) return NULL;
    return genome_wrap(tp, &gn);
}

static void genome_dealloc(PyObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* Genome.parse(text): the canonical text (or any text kb_genome_parse reads) */
static PyObject *genome_parse(PyObject *cls, PyObject *text) {
    Py_ssize_t n;
    const char *s = PyUnicode_Check(text) ? PyUnicode_AsUTF8AndSize(text, &n) : NULL;
    if (!s) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "Genome.parse: the text must be a str, not %.100s", Py_TYPE(text)->tp_name);
        return NULL;
    }
    if ((size_t)n != strlen(s)) {
        PyErr_SetString(PyExc_ValueError, "Genome.parse: embedded null character");
        return NULL;
    }
    kb_ctx *ctx = kb_py_thread_ctx();
    if (!ctx) return NULL;
    kb_genome gn;
    kb_status st = kb_genome_parse(ctx, s, &gn);
    if (st != KB_OK) return kb_py_raise(PyType_GetModule((PyTypeObject *)cls), ctx, st, NULL);
    return genome_wrap((PyTypeObject *)cls, &gn);
}

/* g.replace(**genes): a copy with those genes changed */
static PyObject *genome_replace(PyObject *self, PyObject *args, PyObject *kwds) {
    kb_genome gn = ((kb_py_genome *)self)->gn;
    if (genes_from_kwds(PyType_GetModule(Py_TYPE(self)), "Genome.replace()", args, kwds, &gn) < 0) return NULL;
    return genome_wrap(Py_TYPE(self), &gn);
}

static PyObject *genome_str(PyObject *self) {
    char text[256];
    kb_genome_format(&((kb_py_genome *)self)->gn, text, sizeof text);
    return PyUnicode_FromString(text);
}

static PyObject *genome_repr(PyObject *self) {
    const kb_genome *g = &((kb_py_genome *)self)->gn;
    return PyUnicode_FromFormat("Genome(threads=%d, vec=%d, rows=%d, items=%d, cache='%s', two_pass=%d, fast_math=%d, "
                                "persistent=%d, col_split=%d, row_split=%d)",
                                (int)g->threads, (int)g->vec, (int)g->rows,
                                (int)g->items, kb_cache_where_name(g->cache), (int)g->two_pass, (int)g->fast_math,
                                (int)g->persistent, (int)g->col_split, (int)g->row_split);
}

/* pickle and copy: Genome.parse(str(g)) */
static PyObject *genome_reduce(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *parse = PyObject_GetAttrString((PyObject *)Py_TYPE(self), "parse");
    PyObject *text = parse ? genome_str(self) : NULL;
    PyObject *out = text ? Py_BuildValue("(O(O))", parse, text) : NULL;
    Py_XDECREF(parse);
    Py_XDECREF(text);
    return out;
}

static PyObject *genome_richcompare(PyObject *a, PyObject *b, int op) {
    if (!PyObject_TypeCheck(b, Py_TYPE(a)) || (op != Py_EQ && op != Py_NE)) Py_RETURN_NOTIMPLEMENTED;
    const kb_genome *x = &((kb_py_genome *)a)->gn, *y = &((kb_py_genome *)b)->gn;
    int eq = 1;
    for (int i = 0; i < KB_NGENES && eq; i++) eq = gene_get(x, i) == gene_get(y, i);
    /* a GEMM region's kernel genes (the hash leaves them out: equal genomes still hash alike) */
    eq = eq && x->gemm_tile_m == y->gemm_tile_m && x->gemm_tile_n == y->gemm_tile_n && x->gemm_tile_k == y->gemm_tile_k &&
         x->gemm_warps_m == y->gemm_warps_m && x->gemm_warps_n == y->gemm_warps_n && x->gemm_stages == y->gemm_stages &&
         x->gemm_min_blocks == y->gemm_min_blocks;
    return PyBool_FromLong(op == Py_EQ ? eq : !eq);
}

/* By value: the genes mixed as CPython mixes a tuple's items (xxHash's rounds). */
static Py_hash_t genome_hash(PyObject *self) {
    const kb_genome *g = &((kb_py_genome *)self)->gn;
    uint64_t acc = 0x27D4EB2F165667C5ULL;
    for (int i = 0; i < KB_NGENES; i++) {
        acc += (uint64_t)(uint32_t)gene_get(g, i) * 0xC2B2AE3D27D4EB4FULL;
        acc = (acc << 31) | (acc >> 33);
        acc *= 0x9E3779B185EBCA87ULL;
    }
    Py_hash_t h = (Py_hash_t)(acc ^ (acc >> 29));
    return h == -1 ? -2 : h;
}

static PyObject *genome_get(PyObject *self, void *closure) {
    int i = (int)(intptr_t)closure;
    int32_t v = gene_get(&((kb_py_genome *)self)->gn, i);
    if (is_cache(i)) return PyUnicode_FromString(kb_cache_where_name(v));
    return PyLong_FromLong(v);
}

static PyGetSetDef genome_getset[] = {
    {"threads", genome_get, NULL, "threads per block", (void *)0},
    {"vec", genome_get, NULL, "elements per vector access: 1, 2, 4, 8", (void *)1},
    {"rows", genome_get, NULL, "ROW: rows per block (1 = a block per row; >1 = a warp or less per row)", (void *)2},
    {"items", genome_get, NULL, "POINTWISE: vectors per thread; ROW: unroll of the row loop", (void *)3},
    {"cache", genome_get, NULL, "where a row lives between passes: 'regs', 'smem' or 'reread'", (void *)4},
    {"two_pass", genome_get, NULL, "ROW statistics: 1 = two passes, 0 = one (Welford / online)", (void *)5},
    {"fast_math", genome_get, NULL, "1: __expf and friends", (void *)6},
    {"persistent", genome_get, NULL, "1: a grid of a few blocks per SM looping over the work", (void *)7},
    {"col_split", genome_get, NULL, "COL: blocks along the reduced dim (partials, then a finishing kernel)",
     (void *)8},
    {"row_split", genome_get, NULL, "ROW: blocks per row (partials of each part, then a finishing kernel that "
     "merges them and writes each part's outputs)", (void *)9},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef genome_methods[] = {
    {"parse", genome_parse, METH_O | METH_CLASS,
     "Genome.parse(text) -> Genome: 'key=value ...' (the canonical text, str(g)); genes left out take the "
     "constructor's defaults, a gene given twice its last value; ValueError with the parser's message"},
    {"replace", (PyCFunction)(void (*)(void))genome_replace, METH_VARARGS | METH_KEYWORDS,
     "g.replace(**genes) -> Genome: a copy with the given genes changed (checked like the constructor's)"},
    {"__reduce__", genome_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot genome_slots[] = {
    {Py_tp_new, genome_new},
    {Py_tp_dealloc, genome_dealloc},
    {Py_tp_str, genome_str},
    {Py_tp_repr, genome_repr},
    {Py_tp_hash, genome_hash},
    {Py_tp_richcompare, genome_richcompare},
    {Py_tp_getset, genome_getset},
    {Py_tp_methods, genome_methods},
    {Py_tp_doc, (void *)GENOME_DOC},
    {0, NULL},
};

PyType_Spec kb_genome_spec = {"kbench._C.Genome", sizeof(kb_py_genome), 0,
                              Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, genome_slots};

/* ---------------------------------------------------------------- KernelInfo */

static const char KERNEL_INFO_DOC[] =
    "KernelInfo(*, name, genome, block, grid_units, units_per_block, source='', smem=0, max_blocks=0, nkernels=1, "
    "workspace_bytes_per_unit=0, workspace_bytes_per_block=0, nostats=False, last_multiple=1, last_dim=1)\n"
    "--\n\n"
    "A generated kernel, as generate() returns it, or rebuilt from stored launch data (a cached winner,\n"
    "launched from its CUBIN: source ''). Read-only. entries names every entry point: name, then\n"
    "name + '_finish' where nkernels == 2 (finish_name), then name + '_nostats' where nostats\n"
    "(nostats_name). The grid is ceil(units / units_per_block) blocks, units being grid_units at the\n"
    "sizes (an int, or (coef, (symbol, ...)): coef times those symbols), capped at max_blocks where that\n"
"is not 0; the workspace is workspace_bytes_per_unit x units + workspace_bytes_per_block x grid.\n"
    "A ROW or COL kernel with vectors along a last dim that varies runs only where last_dim (an int or\n"
    "(coef, (symbol, ...)), at the launch's sizes) is a multiple of last_multiple (its vec; 1: every size).";

typedef struct {
    int block, smem, nkernels, last_multiple;
    long long units_per_block, max_blocks, workspace_bytes_per_unit, workspace_bytes_per_block;
    char nostats;
} kernel_scalars;

typedef struct {
    PyObject_HEAD
    PyObject *name;       /* str: the main entry point */
    PyObject *source;     /* str: CUDA C ("" where launched from a stored CUBIN) */
    PyObject *genome;     /* Genome */
    PyObject *grid_units; /* int or (coef, (sym, ...)) */
    PyObject *last_dim;   /* int or (coef, (sym, ...)): a multiple of s.last_multiple at every launch */
    PyObject *entries;    /* tuple of str: name, [name_finish], [name_nostats] */
    kernel_scalars s;
} kernel_info;

/* A KernelInfo of these fields, its entries made from name, nkernels and nostats. Borrows the
 * objects (str, str, Genome, and an int or tuple of ints: no cycle can go through it). */
static PyObject *kernel_info_make(PyTypeObject *tp, PyObject *name, PyObject *source, PyObject *genome,
                                  PyObject *grid_units, PyObject *last_dim, const kernel_scalars *scalars) {
    PyObject *finish = NULL, *nostats = NULL;
    if (scalars->nkernels > 1 && !(finish = PyUnicode_FromFormat("%U%s", name, KB_ENTRY_FINISH))) return NULL;
    if (scalars->nostats && !(nostats = PyUnicode_FromFormat("%U%s", name, KB_ENTRY_NOSTATS))) {
        Py_XDECREF(finish);
        return NULL;
    }
    PyObject *entries = PyTuple_New(1 + (finish != NULL) + (nostats != NULL));
    if (!entries) {
        Py_XDECREF(finish);
        Py_XDECREF(nostats);
        return NULL;
    }
    Py_ssize_t n = 0;
    PyTuple_SET_ITEM(entries, n++, Py_NewRef(name));
    if (finish) PyTuple_SET_ITEM(entries, n++, finish);
    if (nostats) PyTuple_SET_ITEM(entries, n++, nostats);
    kernel_info *self = (kernel_info *)tp->tp_alloc(tp, 0);
    if (!self) {
        Py_DECREF(entries);
        return NULL;
    }
    self->name = Py_NewRef(name);
    self->source = Py_NewRef(source);
    self->genome = Py_NewRef(genome);
    self->grid_units = Py_NewRef(grid_units);
    self->last_dim = Py_NewRef(last_dim);
    self->entries = entries;
    self->s = *scalars;
    return (PyObject *)self;
}

PyObject *kb_py_kernel_info_new(kb_module_state *state, const kb_kernel *k, int64_t max_blocks) {
    kernel_scalars f;
    memset(&f, 0, sizeof f);
    f.block = k->block;
    f.smem = k->smem_bytes;
    f.nkernels = k->nkernels;
    f.units_per_block = k->units_per_block;
    f.max_blocks = max_blocks;
    f.workspace_bytes_per_unit = k->workspace_bytes_per_unit;
    f.workspace_bytes_per_block = k->workspace_bytes_per_block;
    f.nostats = k->nostats != 0;
    f.last_multiple = k->last_multiple > 1 ? k->last_multiple : 1;
    PyObject *name = PyUnicode_FromString(k->name);
    PyObject *source = name ? PyUnicode_FromString(k->source) : NULL;
    PyObject *genome = source ? kb_py_genome_new(state, &k->genome) : NULL;
    PyObject *grid_units = genome ? kb_py_dim(k->grid_units) : NULL;
    PyObject *last_dim = grid_units ? kb_py_dim(f.last_multiple > 1 ? k->last_dim : (kb_dim){1, 0, {0}}) : NULL;
    PyObject *out = last_dim ? kernel_info_make(state->kernel_info_type, name, source, genome, grid_units, last_dim, &f)
                             : NULL;
    Py_XDECREF(name);
    Py_XDECREF(source);
    Py_XDECREF(genome);
    Py_XDECREF(grid_units);
    Py_XDECREF(last_dim);
    return out;
}

/* An int keyword argument within [lo, hi]; -1 with an exception set. */
static int int_arg(PyObject *v, const char *what, long long lo, long long hi, long long *out) {
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "KernelInfo: %s is an int, not %.100s", what, Py_TYPE(v)->tp_name);
        return -1;
    }
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (overflow || x < lo || x > hi) {
        PyErr_Format(PyExc_ValueError, "KernelInfo: %s=%R out of range (%lld..%lld)", what, v, lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

/* A size as generate() gives it: an int, or (coef, (sym, ...)), also from a list (JSON); -1 with an
 * exception set. */
static int dim_arg(PyObject *v, const char *what, kb_dim *out) {
    PyObject *as_tuple = PyList_Check(v) ? PyList_AsTuple(v) : Py_NewRef(v);
    if (!as_tuple) return -1;
    int bad = !PyLong_Check(as_tuple) && !PyTuple_Check(as_tuple);
    if (bad) PyErr_Format(PyExc_TypeError, "KernelInfo: %s is an int or (coef, (symbol, ...)), not %.100s", what,
                          Py_TYPE(v)->tp_name);
    else bad = kb_py_dim_from(as_tuple, out) < 0;
    Py_DECREF(as_tuple);
    return bad ? -1 : 0;
}

static PyObject *kernel_info_new(PyTypeObject *tp, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"name", "genome", "block", "grid_units", "units_per_block", "source", "smem",
                             "max_blocks", "nkernels", "workspace_bytes_per_unit", "workspace_bytes_per_block",
                             "nostats", "last_multiple", "last_dim", NULL};
    PyObject *name = NULL, *genome = NULL, *block = NULL, *grid_units = NULL, *upb = NULL, *source = NULL,
             *smem = NULL, *max_blocks = NULL, *nkernels = NULL, *wsu = NULL, *wsb = NULL, *nostats = NULL,
             *lmul = NULL, *ldim = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OOOOOOOOOOOOOO:KernelInfo", kwlist, &name, &genome, &block,
                                     &grid_units, &upb, &source, &smem, &max_blocks, &nkernels, &wsu, &wsb, &nostats,
                                     &lmul, &ldim))
        return NULL;
    PyObject *required[] = {name, genome, block, grid_units, upb};
    for (int i = 0; i < 5; i++)
        if (!required[i]) return PyErr_Format(PyExc_TypeError, "KernelInfo() missing keyword argument '%s'", kwlist[i]);
    PyObject *module = PyType_GetModule(tp);
    kb_module_state *state = module ? kb_py_state(module) : NULL;
    if (!state) return NULL;
    if (!PyUnicode_Check(name) || PyUnicode_GET_LENGTH(name) == 0)
        return PyErr_Format(PyExc_TypeError, "KernelInfo: name is a non-empty str");
    if (source && !PyUnicode_Check(source))
        return PyErr_Format(PyExc_TypeError, "KernelInfo: source is a str, not %.100s", Py_TYPE(source)->tp_name);
    kb_genome gn;
    if (kb_py_genome_of(state, genome, &gn, "KernelInfo: genome") < 0) return NULL;
    kernel_scalars f;
    memset(&f, 0, sizeof f);
    long long v = 0;
    if (int_arg(block, "block", 1, INT32_MAX, &v) < 0) return NULL;
    f.block = (int)v;
    if (smem && int_arg(smem, "smem", 0, INT32_MAX, &v) < 0) return NULL;
    f.smem = smem ? (int)v : 0;
    if (nkernels && int_arg(nkernels, "nkernels", 1, 2, &v) < 0) return NULL;
    f.nkernels = nkernels ? (int)v : 1;
    if (int_arg(upb, "units_per_block", 1, INT64_MAX, &f.units_per_block) < 0) return NULL;
    if (max_blocks && int_arg(max_blocks, "max_blocks", 0, INT64_MAX, &f.max_blocks) < 0) return NULL;
    if (wsu && int_arg(wsu, "workspace_bytes_per_unit", 0, INT64_MAX, &f.workspace_bytes_per_unit) < 0) return NULL;
    if (wsb && int_arg(wsb, "workspace_bytes_per_block", 0, INT64_MAX, &f.workspace_bytes_per_block) < 0) return NULL;
    int ns = nostats ? PyObject_IsTrue(nostats) : 0;
    if (ns < 0) return NULL;
    f.nostats = (char)ns;
    if (lmul && int_arg(lmul, "last_multiple", 1, 16, &v) < 0) return NULL;
    f.last_multiple = lmul ? (int)v : 1;
    kb_dim d, ld = {1, 0, {0}};
    if (dim_arg(grid_units, "grid_units", &d) < 0 || (ldim && dim_arg(ldim, "last_dim", &ld) < 0)) return NULL;
    PyObject *units = kb_py_dim(d);
    PyObject *last = units ? kb_py_dim(ld) : NULL;
    PyObject *text = source ? PyUnicode_FromObject(source) : PyUnicode_FromString("");
    PyObject *nm = text && last ? PyUnicode_FromObject(name) : NULL;
    PyObject *out = nm ? kernel_info_make(tp, nm, text, genome, units, last, &f) : NULL;
    Py_XDECREF(units);
    Py_XDECREF(last);
    Py_XDECREF(text);
    Py_XDECREF(nm);
    return out;
}

static void kernel_info_dealloc(PyObject *op) {
    kernel_info *self = (kernel_info *)op;
    PyTypeObject *tp = Py_TYPE(op);
    Py_XDECREF(self->name);
    Py_XDECREF(self->source);
    Py_XDECREF(self->genome);
    Py_XDECREF(self->grid_units);
    Py_XDECREF(self->last_dim);
    Py_XDECREF(self->entries);
    tp->tp_free(op);
    Py_DECREF(tp);
}

static PyObject *kernel_info_repr(PyObject *op) {
    kernel_info *self = (kernel_info *)op;
    const kernel_scalars *f = &self->s;
    return PyUnicode_FromFormat("<KernelInfo %U block=%d smem=%d grid_units=%R units_per_block=%lld max_blocks=%lld "
                                "nkernels=%d nostats=%d [%S]>",
                                self->name, f->block, f->smem, self->grid_units, f->units_per_block, f->max_blocks,
                                f->nkernels, (int)f->nostats, self->genome);
}

/* finish_name and nostats_name: entries' second and last, where the kernel has them */
static PyObject *kernel_info_finish_name(PyObject *op, void *Py_UNUSED(closure)) {
    kernel_info *self = (kernel_info *)op;
    if (self->s.nkernels < 2) Py_RETURN_NONE;
    return Py_NewRef(PyTuple_GET_ITEM(self->entries, 1));
}

static PyObject *kernel_info_nostats_name(PyObject *op, void *Py_UNUSED(closure)) {
    kernel_info *self = (kernel_info *)op;
    if (!self->s.nostats) Py_RETURN_NONE;
    return Py_NewRef(PyTuple_GET_ITEM(self->entries, PyTuple_GET_SIZE(self->entries) - 1));
}

static PyMemberDef kernel_info_members[] = {
    {"name", T_OBJECT_EX, offsetof(kernel_info, name), READONLY, "the main entry point"},
    {"source", T_OBJECT_EX, offsetof(kernel_info, source), READONLY,
     "CUDA C ('' for a kernel rebuilt from stored launch data)"},
    {"genome", T_OBJECT_EX, offsetof(kernel_info, genome), READONLY, "the Genome it was generated from"},
    {"entries", T_OBJECT_EX, offsetof(kernel_info, entries), READONLY,
     "every entry point: (name, [name_finish], [name_nostats])"},
    {"grid_units", T_OBJECT_EX, offsetof(kernel_info, grid_units), READONLY,
     "work items: an int, or (coef, (symbol, ...))"},
    {"block", T_INT, offsetof(kernel_info, s.block), READONLY, "threads per block"},
    {"smem", T_INT, offsetof(kernel_info, s.smem), READONLY, "dynamic shared memory, bytes"},
    {"nkernels", T_INT, offsetof(kernel_info, s.nkernels), READONLY, "1, or 2 where a finishing kernel follows"},
    {"units_per_block", T_LONGLONG, offsetof(kernel_info, s.units_per_block), READONLY, "work items per block"},
    {"max_blocks", T_LONGLONG, offsetof(kernel_info, s.max_blocks), READONLY,
     "the grid's cap on the device generated for (0: none)"},
    {"workspace_bytes_per_unit", T_LONGLONG, offsetof(kernel_info, s.workspace_bytes_per_unit), READONLY,
     "workspace bytes per work item (a COL split's partials)"},
    {"workspace_bytes_per_block", T_LONGLONG, offsetof(kernel_info, s.workspace_bytes_per_block), READONLY,
     "workspace bytes per block of the grid (column sums' partials)"},
    {"nostats", T_BOOL, offsetof(kernel_info, s.nostats), READONLY,
     "whether it has an entry point without the saved statistics"},
    {"last_multiple", T_INT, offsetof(kernel_info, s.last_multiple), READONLY,
     "the kernel runs only where last_dim is a multiple of it (its vec along a varying last dim; 1: any size)"},
    {"last_dim", T_OBJECT_EX, offsetof(kernel_info, last_dim), READONLY,
     "the size last_multiple divides: an int, or (coef, (symbol, ...))"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef kernel_info_getset[] = {
    {"finish_name", kernel_info_finish_name, NULL, "the finishing kernel's entry point, or None", NULL},
    {"nostats_name", kernel_info_nostats_name, NULL, "the entry point without the saved statistics, or None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot kernel_info_slots[] = {
    {Py_tp_new, kernel_info_new},
    {Py_tp_dealloc, kernel_info_dealloc},
    {Py_tp_repr, kernel_info_repr},
    {Py_tp_members, kernel_info_members},
    {Py_tp_getset, kernel_info_getset},
    {Py_tp_doc, (void *)KERNEL_INFO_DOC},
    {0, NULL},
};

PyType_Spec kb_kernel_info_spec = {"kbench._C.KernelInfo", sizeof(kernel_info), 0,
                                   Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, kernel_info_slots};
