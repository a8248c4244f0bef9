/* module_evolve.c — kbench._C's schedule search functions over tune/evolve.c: a search per
 * region as a capsule (it keeps its Partition alive), asked and told in Genome objects, and the
 * legality test of one genome. kbench/tune/search.py drives them. */
#include "python/module.h"

#include "python/module_evolve.h"

#define EVOLVE_CAPSULE "kbench._C.evolve"

typedef struct {
    kb_evolve *ev;
    kb_py_partition *part; /* owns the partition the search borrows, and its context */
} evolve_handle;

static void evolve_capsule_free(PyObject *cap) {
    evolve_handle *h = PyCapsule_GetPointer(cap, EVOLVE_CAPSULE);
    if (!h) return;
    kb_evolve_free(h->ev);
    Py_XDECREF(h->part);
    PyMem_Free(h);
}

static evolve_handle *handle_of(PyObject *cap) {
    return PyCapsule_GetPointer(cap, EVOLVE_CAPSULE); /* sets TypeError/ValueError on a wrong object */
}

/* The common head of evolve_new and genome_legal: partition, region index, symbol values, device. */
static int region_args(PyObject *module, PyObject *part, int r, PyObject *symseq, PyObject *dev, int64_t *symvals,
                       kb_device_info *info) {
    kb_module_state *state = kb_py_state(module);
    if (!PyObject_TypeCheck(part, state->partition_type)) {
        PyErr_Format(PyExc_TypeError, "expected a kbench._C.Partition, got %s", Py_TYPE(part)->tp_name);
        return -1;
    }
    const kb_partition *p = ((kb_py_partition *)part)->part;
    if (r < 0 || r >= p->nregions) {
        PyErr_Format(PyExc_IndexError, "region %d out of range", r);
        return -1;
    }
    if (kb_py_symvals(p->graph, symseq, symvals) < 0) return -1;
    return kb_py_devinfo(dev, info);
}

/* evolve_new(partition, r, symvals, dev_or_None, seed, population) -> capsule */
static PyObject *py_evolve_new(PyObject *module, PyObject *args) {
    PyObject *part, *symseq, *dev;
    int r, population;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "OiOOKi:evolve_new", &part, &r, &symseq, &dev, &seed, &population)) return NULL;
    int64_t symvals[KB_MAX_SYMS];
    kb_device_info info;
    if (region_args(module, part, r, symseq, dev, symvals, &info) < 0) return NULL;
    kb_py_partition *pp = (kb_py_partition *)part;
    evolve_handle *h = PyMem_Calloc(1, sizeof *h);
    if (!h) return PyErr_NoMemory();
    kb_status st = kb_evolve_new(pp->part, r, symvals, &info, (uint64_t)seed, population, &h->ev);
    if (st != KB_OK) {
        PyMem_Free(h);
        return kb_py_raise(module, pp->graph->ctx, st, "evolve_new");
    }
    h->part = (kb_py_partition *)Py_NewRef(part);
    PyObject *cap = PyCapsule_New(h, EVOLVE_CAPSULE, evolve_capsule_free);
    if (!cap) {
        kb_evolve_free(h->ev);
        Py_DECREF(h->part);
        PyMem_Free(h);
    }
    return cap;
}

/* evolve_ask(h, max) -> [Genome, ...] (empty: the legal space is exhausted) */
static PyObject *py_evolve_ask(PyObject *module, PyObject *args) {
    PyObject *cap;
    int max;
    if (!PyArg_ParseTuple(args, "Oi:evolve_ask", &cap, &max)) return NULL;
    evolve_handle *h = handle_of(cap);
    if (!h) return NULL;
    if (max <= 0) return PyList_New(0);
    if (max > 4096) max = 4096;
    kb_genome *out = PyMem_Malloc((size_t)max * sizeof *out);
    if (!out) return PyErr_NoMemory();
    int n = 0;
    kb_status st = kb_evolve_ask(h->ev, out, max, &n);
    if (st != KB_OK) {
        PyMem_Free(out);
        return kb_py_raise(module, h->part->graph->ctx, st, "evolve_ask");
    }
    kb_module_state *state = kb_py_state(module);
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        PyObject *g = kb_py_genome_new(state, &out[i]);
        if (!g) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, g);
    }
    PyMem_Free(out);
    return list;
}

/* evolve_tell(h, genome, ms): ms < 0 for a failed candidate */
static PyObject *py_evolve_tell(PyObject *module, PyObject *args) {
    PyObject *cap, *genome;
    double ms;
    if (!PyArg_ParseTuple(args, "OOd:evolve_tell", &cap, &genome, &ms)) return NULL;
    evolve_handle *h = handle_of(cap);
    if (!h) return NULL;
    kb_genome gn;
    if (kb_py_genome_of(kb_py_state(module), genome, &gn, "evolve_tell: genome") < 0) return NULL;
    kb_status st = kb_evolve_tell(h->ev, &gn, ms);
    if (st != KB_OK) return kb_py_raise(module, h->part->graph->ctx, st, "evolve_tell");
    Py_RETURN_NONE;
}

/* evolve_best(h) -> (Genome, ms) or None when nothing succeeded */
static PyObject *py_evolve_best(PyObject *module, PyObject *cap) {
    evolve_handle *h = handle_of(cap);
    if (!h) return NULL;
    kb_genome gn;
    double ms;
    if (!kb_evolve_best(h->ev, &gn, &ms)) Py_RETURN_NONE;
    PyObject *g = kb_py_genome_new(kb_py_state(module), &gn);
    return g ? Py_BuildValue("(Nd)", g, ms) : NULL;
}

static PyObject *py_evolve_generation(PyObject *Py_UNUSED(module), PyObject *cap) {
    evolve_handle *h = handle_of(cap);
    if (!h) return NULL;
    return PyLong_FromLong(kb_evolve_generation(h->ev));
}

/* evolve_domains(h) -> {gene: [values]} (cache values by name) */
static PyObject *py_evolve_domains(PyObject *Py_UNUSED(module), PyObject *cap) {
    const kb_gene *genes = kb_genome_genes();
    evolve_handle *h = handle_of(cap);
    if (!h) return NULL;
    PyObject *d = PyDict_New();
    for (int g = 0; d && g < KB_NGENES; g++) {
        int32_t vals[64];
        int n = kb_evolve_domain(h->ev, g, vals, 64);
        if (n > 64) n = 64;
        int cache = genes[g].offset == offsetof(kb_genome, cache);
        PyObject *list = PyList_New(n);
        for (int i = 0; list && i < n; i++) {
            const char *name = cache ? kb_cache_where_name(vals[i]) : NULL;
            PyObject *v = name ? PyUnicode_FromString(name) : PyLong_FromLong(vals[i]);
            if (!v) {
                Py_CLEAR(list);
                break;
            }
            PyList_SET_ITEM(list, i, v);
        }
        if (!list || PyDict_SetItemString(d, genes[g].name, list) < 0) Py_CLEAR(d);
        Py_XDECREF(list);
    }
    return d;
}

/* genome_legal(partition, r, symvals, dev_or_None, genome) -> bool */
static PyObject *py_genome_legal(PyObject *module, PyObject *args) {
    PyObject *part, *symseq, *dev, *genome;
    int r;
    if (!PyArg_ParseTuple(args, "OiOOO:genome_legal", &part, &r, &symseq, &dev, &genome)) return NULL;
    int64_t symvals[KB_MAX_SYMS];
    kb_device_info info;
    if (region_args(module, part, r, symseq, dev, symvals, &info) < 0) return NULL;
    kb_genome gn;
    if (kb_py_genome_of(kb_py_state(module), genome, &gn, "genome_legal: genome") < 0) return NULL;
    return PyBool_FromLong(kb_genome_legal(((kb_py_partition *)part)->part, r, symvals, &info, &gn));
}

PyMethodDef kb_evolve_methods[] = {
    {"evolve_new", py_evolve_new, METH_VARARGS,
     "evolve_new(partition, r, symvals, dev_or_None, seed, population) -> search handle (population <= 0: 12)"},
    {"evolve_ask", py_evolve_ask, METH_VARARGS,
     "evolve_ask(h, max) -> list of up to max Genomes of the current generation (the first of the first ask is "
     "the default genome; [] once the legal space is exhausted)"},
    {"evolve_tell", py_evolve_tell, METH_VARARGS,
     "evolve_tell(h, genome, ms): the candidate's time in ms, or a negative number if it failed"},
    {"evolve_best", py_evolve_best, METH_O, "evolve_best(h) -> (Genome, ms) of the fastest success, or None"},
    {"evolve_generation", py_evolve_generation, METH_O, "evolve_generation(h) -> the latest batch's generation"},
    {"evolve_domains", py_evolve_domains, METH_O, "evolve_domains(h) -> {gene: [values the search draws from]}"},
    {"genome_legal", py_genome_legal, METH_VARARGS,
     "genome_legal(partition, r, symvals, dev_or_None, genome) -> bool: whether the region can run the Genome"},
    {NULL, NULL, 0, NULL},
};
