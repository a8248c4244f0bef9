/* module_graph.c — kbench._C's Graph and Partition heap types over the C IR: building a graph
 * node by node (names and sizes as Python gives them), reading it back, autodiff, rewrites, and
 * the partition's regions. */
#include "python/module.h"

#include <string.h>

#include "core/internal.h"

/* ---------------------------------------------------------------- dims <-> Python */

/* A dim is an int (pinned) or (coef, (sym, ...)). */
int kb_py_dim_from(PyObject *o, kb_dim *d) {
    memset(d, 0, sizeof *d);
    if (PyLong_Check(o)) {
        d->coef = PyLong_AsLongLong(o);
        return d->coef == -1 && PyErr_Occurred() ? -1 : 0;
    }
    PyObject *syms;
    long long coef;
    if (!PyTuple_Check(o)) { /* PyArg_ParseTuple takes nothing else (SystemError) */
        PyErr_Format(PyExc_TypeError, "a dim is an int or (coef, (sym ids...)), not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    if (!PyArg_ParseTuple(o, "LO;a dim is an int or (coef, (sym ids...))", &coef, &syms)) return -1;
    d->coef = coef;
    int64_t ids[KB_MAX_DIM_SYMS];
    Py_ssize_t n = PySequence_Size(syms);
    if (n < 0) return -1;
    if (n > KB_MAX_DIM_SYMS) {
        PyErr_Format(PyExc_ValueError, "a size may multiply at most %d symbols", KB_MAX_DIM_SYMS);
        return -1;
    }
    if (kb_py_int64s(syms, ids, n, "dim symbols") < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) { /* keep symbols sorted: the IR compares dims by value */
        if (ids[i] < 0 || ids[i] >= KB_MAX_SYMS) {
            PyErr_SetString(PyExc_ValueError, "symbol id out of range");
            return -1;
        }
        Py_ssize_t j = i;
        while (j > 0 && d->sym[j - 1] > ids[i]) {
            d->sym[j] = d->sym[j - 1];
            j--;
        }
        d->sym[j] = (uint8_t)ids[i];
    }
    d->nsym = (uint8_t)n;
    return 0;
}

PyObject *kb_py_dim(kb_dim d) {
    if (d.nsym == 0) return PyLong_FromLongLong(d.coef);
    PyObject *syms = PyTuple_New(d.nsym);
    if (!syms) return NULL;
    for (int i = 0; i < d.nsym; i++) PyTuple_SET_ITEM(syms, i, PyLong_FromLong(d.sym[i]));
    return Py_BuildValue("(LN)", (long long)d.coef, syms);
}

static int dims_from_py(PyObject *seq, kb_node *t) {
    PyObject *fast = kb_py_tuple(seq, "dims");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > KB_MAX_RANK) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "rank %zd exceeds the IR's limit of %d", n, KB_MAX_RANK);
        return -1;
    }
    t->rank = (int32_t)n;
    for (Py_ssize_t i = 0; i < n; i++)
        if (kb_py_dim_from(PySequence_Fast_GET_ITEM(fast, i), &t->dims[i]) < 0) {
            Py_DECREF(fast);
            return -1;
        }
    Py_DECREF(fast);
    return 0;
}

static int dtype_from_py(const char *name, kb_dtype *out) {
    int t = kb_dtype_from_name(name);
    if (t < 0) {
        PyErr_Format(PyExc_TypeError, "unsupported dtype '%s' (f32, f16, bf16, f64, i64, i32, bool)", name);
        return -1;
    }
    *out = (kb_dtype)t;
    return 0;
}

/* ---------------------------------------------------------------- Graph */

static PyObject *graph_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwds && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "Graph() takes no arguments");
        return NULL;
    }
    kb_py_graph *self = (kb_py_graph *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    if (kb_ctx_new(NULL, NULL, &self->ctx) != KB_OK || kb_graph_new(self->ctx, &self->graph) != KB_OK) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void graph_dealloc(kb_py_graph *self) {
    PyTypeObject *tp = Py_TYPE(self);
    kb_graph_free(self->graph);
    if (self->owner)
        Py_DECREF(self->owner);
    else
        kb_ctx_free(self->ctx);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *graph_raise(kb_py_graph *self, kb_status st) {
    return kb_py_raise(PyType_GetModule(Py_TYPE(self)), self->ctx, st, NULL);
}

/* -1 with RuntimeError where the graph may no longer grow (kb_py_graph.frozen). */
static int graph_unfrozen(kb_py_graph *self, const char *call) {
    if (!self->frozen) return 0;
    PyErr_Format(PyExc_RuntimeError, "Graph.%s: the graph is frozen (a Partition or the interpreter has read it); "
                 "build a new Graph", call);
    return -1;
}

/* Wraps a graph made with owner's context (kb_graph_grad, kb_region_graph). */
static PyObject *graph_wrap_derived(kb_py_graph *owner, kb_graph *g) {
    PyTypeObject *tp = kb_py_state(PyType_GetModule(Py_TYPE(owner)))->graph_type;
    kb_py_graph *self = (kb_py_graph *)tp->tp_alloc(tp, 0);
    if (!self) {
        kb_graph_free(g);
        return NULL;
    }
    self->ctx = owner->ctx;
    self->graph = g;
    self->owner = Py_NewRef(owner->owner ? owner->owner : (PyObject *)owner);
    return (PyObject *)self;
}

static PyObject *graph_grad(kb_py_graph *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"wrt", "saved", "joint", "outputs", NULL};
    PyObject *arg, *reads = NULL;
    int saved = 0, joint = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|$ipO:grad", kwlist, &arg, &saved, &joint, &reads)) return NULL;
    if (joint && saved)
        return PyErr_Format(PyExc_ValueError, "grad: joint=True keeps no statistics (saved=%d)", saved);
    if (saved < 0 || saved > kb_graph_noutputs(self->graph))
        return PyErr_Format(PyExc_ValueError, "grad: saved=%d, but the graph has %d outputs", saved,
                            (int)kb_graph_noutputs(self->graph));
    uint32_t reuse = 0;
    if (reads && reads != Py_None) {
        PyObject *ks = kb_py_tuple(reads, "grad(outputs=): output indices");
        if (!ks) return NULL;
        long nreal = (long)kb_graph_noutputs(self->graph) - saved;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(ks); i++) {
            long k = PyLong_AsLong(PySequence_Fast_GET_ITEM(ks, i));
            if (k == -1 && PyErr_Occurred()) {
                Py_DECREF(ks);
                return NULL;
            }
            if (k < 0 || k >= nreal || k >= 32) {
                Py_DECREF(ks);
                return PyErr_Format(PyExc_ValueError, "grad(outputs=): %ld is not one of the %ld outputs "
                                    "(below 32) the backward can read", k, nreal);
            }
            reuse |= 1u << k;
        }
        Py_DECREF(ks);
    }
    if (joint && reuse) return PyErr_Format(PyExc_ValueError, "grad: joint=True reads no outputs");
    int32_t n = kb_graph_ninputs(self->graph);
    PyObject *fast = kb_py_tuple(arg, "grad(wrt): one bool per input");
    if (!fast) return NULL;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        Py_DECREF(fast);
        return PyErr_Format(PyExc_ValueError, "grad(wrt): %d inputs, got %zd flags", n, PySequence_Fast_GET_SIZE(fast));
    }
    uint8_t *wrt = PyMem_Malloc((size_t)(n ? n : 1)); /* one flag per input, however many */
    if (!wrt) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    for (int32_t i = 0; i < n; i++) {
        int t = PyObject_IsTrue(PySequence_Fast_GET_ITEM(fast, i));
        if (t < 0) {
            Py_DECREF(fast);
            PyMem_Free(wrt);
            return NULL;
        }
        wrt[i] = (uint8_t)t;
    }
    Py_DECREF(fast);
    kb_graph *out = NULL;
    kb_status st = joint ? kb_graph_grad_joint(self->graph, wrt, &out)
                         : kb_graph_grad_saved(self->graph, wrt, (int32_t)saved, reuse, &out);
    PyMem_Free(wrt);
    if (st != KB_OK) return graph_raise(self, st);
    return graph_wrap_derived(self, out);
}

static PyObject *graph_simplify(kb_py_graph *self, PyObject *unused) {
    (void)unused;
    kb_graph *out = NULL;
    kb_status st = kb_graph_simplify(self->graph, &out);
    if (st != KB_OK) return graph_raise(self, st);
    return graph_wrap_derived(self, out);
}

static PyObject *graph_add_symbol(kb_py_graph *self, PyObject *args) {
    const char *name;
    long long example;
    if (!PyArg_ParseTuple(args, "sL:add_symbol", &name, &example)) return NULL;
    if (graph_unfrozen(self, "add_symbol") < 0) return NULL;
    int32_t id;
    kb_status st = kb_graph_add_symbol(self->graph, name, example, &id);
    return st == KB_OK ? PyLong_FromLong(id) : graph_raise(self, st);
}

static PyObject *graph_add_input(kb_py_graph *self, PyObject *args) {
    static const char *const kinds[] = {"user", "param", "buffer"};
    const char *name, *kind, *dtype;
    PyObject *dims;
    if (!PyArg_ParseTuple(args, "sssO:add_input", &name, &kind, &dtype, &dims)) return NULL;
    if (graph_unfrozen(self, "add_input") < 0) return NULL;
    kb_node t;
    memset(&t, 0, sizeof t);
    t.op = KB_OP_INPUT;
    int k = -1;
    for (int i = 0; i < 3; i++)
        if (strcmp(kind, kinds[i]) == 0) k = i;
    if (k < 0) return PyErr_Format(PyExc_ValueError, "input kind must be user, param or buffer, not '%s'", kind);
    t.input_kind = (kb_input_kind)k;
    t.name = name; /* any length: the graph keeps its own copy */
    if (dtype_from_py(dtype, &t.dtype) < 0 || dims_from_py(dims, &t) < 0) return NULL;
    int32_t id;
    kb_status st = kb_graph_add(self->graph, &t, &id);
    return st == KB_OK ? PyLong_FromLong(id) : graph_raise(self, st);
}

static PyObject *graph_add_node(kb_py_graph *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"op", "inputs", "dtype", "dims", "scalars", "axes", "perm", "axis",
                             "start", "step", "index", "name", "nograd", NULL};
    const char *op, *dtype, *name = "";
    PyObject *inputs, *dims, *perm = Py_None;
    double s0 = 0, s1 = 0;
    unsigned long axes = 0;
    int axis = 0, index = 0, nograd = 0;
    long long start = 0, step = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sOsO|$(dd)kOiLLisp:add_node", kwlist, &op, &inputs, &dtype,
                                     &dims, &s0, &s1, &axes, &perm, &axis, &start, &step, &index, &name,
                                     &nograd))
        return NULL;
    if (graph_unfrozen(self, "add_node") < 0) return NULL;
    kb_node t;
    memset(&t, 0, sizeof t);
    int o = kb_op_from_name(op);
    if (o < 0 || o == KB_OP_INPUT) return PyErr_Format(PyExc_ValueError, "unknown op '%s'", op);
    t.op = (kb_op)o;
    if (dtype_from_py(dtype, &t.dtype) < 0 || dims_from_py(dims, &t) < 0) return NULL;
    Py_ssize_t n = PySequence_Size(inputs);
    if (n < 0) return NULL;
    /* "max"/"min" print the same for the binary op and the reduction: one operand = reduction */
    if (n == 1 && (o == KB_OP_MAX || o == KB_OP_MIN)) t.op = o == KB_OP_MAX ? KB_OP_RMAX : KB_OP_RMIN;
    if (n > KB_MAX_INPUTS) return PyErr_Format(PyExc_ValueError, "%s: at most %d operands", op, KB_MAX_INPUTS);
    int64_t ids[KB_MAX_INPUTS];
    if (kb_py_int64s(inputs, ids, n, "inputs") < 0) return NULL;
    t.ninputs = (int32_t)n;
    for (Py_ssize_t i = 0; i < n; i++) t.inputs[i] = ids[i] < 0 || ids[i] > INT32_MAX ? -1 : (int32_t)ids[i];
    if (perm != Py_None) {
        Py_ssize_t pn = PySequence_Size(perm);
        if (pn < 0) return NULL;
        int64_t p[KB_MAX_RANK];
        if (pn != t.rank) return PyErr_Format(PyExc_ValueError, "perm has %zd entries for rank %d", pn, t.rank);
        if (kb_py_int64s(perm, p, pn, "perm") < 0) return NULL;
        for (Py_ssize_t i = 0; i < pn; i++) t.perm[i] = (int8_t)(p[i] >= 0 && p[i] < KB_MAX_RANK ? p[i] : -1);
    }
    t.scalar[0] = s0;
    t.scalar[1] = s1;
    if (axes > UINT32_MAX) return PyErr_Format(PyExc_ValueError, "%s: axes 0x%lx is not a mask of dims", op, axes);
    t.axes = (uint32_t)axes;
    t.axis = axis;
    t.start = start;
    t.step = step;
    t.index = index;
    t.nograd = nograd;
    t.name = name;
    int32_t id;
    kb_status st = kb_graph_add(self->graph, &t, &id);
    return st == KB_OK ? PyLong_FromLong(id) : graph_raise(self, st);
}

static PyObject *graph_add_output(kb_py_graph *self, PyObject *arg) {
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred()) return NULL;
    if (graph_unfrozen(self, "add_output") < 0) return NULL;
    if (v < 0 || v >= kb_graph_nnodes(self->graph)) return PyErr_Format(PyExc_ValueError, "output %%%ld does not exist", v);
    kb_status st = kb_graph_add_output(self->graph, (int32_t)v);
    if (st != KB_OK) return graph_raise(self, st);
    Py_RETURN_NONE;
}

static PyObject *ids_to_list(const int32_t *ids, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    if (!list) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) PyList_SET_ITEM(list, i, PyLong_FromLong(ids[i]));
    return list;
}

static PyObject *graph_node(kb_py_graph *self, PyObject *arg) {
    static const char *const kinds[] = {"user", "param", "buffer"};
    long id = PyLong_AsLong(arg);
    if (id == -1 && PyErr_Occurred()) return NULL;
    const kb_node *nd = id >= 0 && id <= INT32_MAX ? kb_graph_node(self->graph, (int32_t)id) : NULL;
    if (!nd) return PyErr_Format(PyExc_IndexError, "node %%%ld does not exist", id);
    PyObject *dims = PyList_New(nd->rank), *perm = PyList_New(nd->op == KB_OP_PERMUTE ? nd->rank : 0);
    if (!dims || !perm) goto fail;
    for (int d = 0; d < nd->rank; d++) {
        PyObject *dim = kb_py_dim(nd->dims[d]);
        if (!dim) goto fail;
        PyList_SET_ITEM(dims, d, dim);
    }
    for (Py_ssize_t d = 0; d < PyList_GET_SIZE(perm); d++) PyList_SET_ITEM(perm, d, PyLong_FromLong(nd->perm[d]));
    return Py_BuildValue("{s:s,s:s,s:N,s:N,s:(dd),s:k,s:N,s:i,s:L,s:L,s:i,s:s,s:s,s:O}", "op", kb_op_get(nd->op)->name,
                         "dtype", kb_dtype_name(nd->dtype), "dims", dims, "inputs",
                         ids_to_list(nd->inputs, nd->ninputs), "scalars", nd->scalar[0], nd->scalar[1], "axes",
                         (unsigned long)nd->axes, "perm", perm, "axis", nd->axis, "start", (long long)nd->start,
                         "step", (long long)nd->step, "index", nd->index, "name", nd->name, "input_kind",
                         nd->op == KB_OP_INPUT ? kinds[nd->input_kind] : "", "nograd",
                         nd->nograd ? Py_True : Py_False);
fail:
    Py_XDECREF(dims);
    Py_XDECREF(perm);
    return NULL;
}

static PyObject *graph_sizes(kb_py_graph *self, PyObject *args) {
    long v;
    PyObject *symseq;
    if (!PyArg_ParseTuple(args, "lO:sizes", &v, &symseq)) return NULL;
    if (v < 0 || v >= kb_graph_nnodes(self->graph)) return PyErr_Format(PyExc_IndexError, "no value %%%ld", v);
    int64_t symvals[KB_MAX_SYMS], sizes[KB_MAX_RANK];
    if (kb_py_symvals(self->graph, symseq, symvals) < 0) return NULL;
    kb_value_sizes(self->graph, (int32_t)v, symvals, sizes);
    int rank = kb_graph_node(self->graph, (int32_t)v)->rank;
    PyObject *t = PyTuple_New(rank);
    if (!t) return NULL;
    for (int d = 0; d < rank; d++) PyTuple_SET_ITEM(t, d, PyLong_FromLongLong(sizes[d]));
    return t;
}

static PyObject *graph_str(kb_py_graph *self) {
    char *text;
    kb_status st = kb_graph_dump(self->graph, &text);
    if (st != KB_OK) return graph_raise(self, st);
    PyObject *s = PyUnicode_FromString(text);
    kb_string_free(self->ctx, text);
    return s;
}

static PyObject *graph_partition(kb_py_graph *self, PyObject *Py_UNUSED(ignored)) {
    kb_module_state *state = kb_py_state(PyType_GetModule(Py_TYPE(self)));
    kb_py_partition *p = (kb_py_partition *)state->partition_type->tp_alloc(state->partition_type, 0);
    if (!p) return NULL;
    Py_INCREF(self);
    p->graph = self;
    kb_status st = kb_partition_new(self->graph, &p->part);
    if (st != KB_OK) {
        Py_DECREF(p);
        return graph_raise(self, st);
    }
    self->frozen = 1; /* the partition's arrays are sized by the nodes there are now */
    return (PyObject *)p;
}

static PyObject *graph_get_int(kb_py_graph *self, void *which) {
    switch ((intptr_t)which) {
    case 0: return PyLong_FromLong(kb_graph_nnodes(self->graph));
    case 1: return PyLong_FromLong(kb_graph_ninputs(self->graph));
    case 2: return PyLong_FromLong(kb_graph_noutputs(self->graph));
    case 3: return PyLong_FromLong(kb_graph_nsymbols(self->graph));
    default: return PyBool_FromLong(self->frozen);
    }
}

static PyObject *graph_get_inputs(kb_py_graph *self, void *Py_UNUSED(c)) {
    const kb_graph *g = self->graph;
    PyObject *list = PyList_New(kb_graph_ninputs(g));
    for (int i = 0; list && i < kb_graph_ninputs(g); i++) PyList_SET_ITEM(list, i, PyLong_FromLong(kb_graph_input(g, i)));
    return list;
}

static PyObject *graph_get_outputs(kb_py_graph *self, void *Py_UNUSED(c)) {
    const kb_graph *g = self->graph;
    PyObject *list = PyList_New(kb_graph_noutputs(g));
    for (int i = 0; list && i < kb_graph_noutputs(g); i++) PyList_SET_ITEM(list, i, PyLong_FromLong(kb_graph_output(g, i)));
    return list;
}

static PyObject *graph_get_symbols(kb_py_graph *self, void *Py_UNUSED(c)) {
    const kb_graph *g = self->graph;
    PyObject *list = PyList_New(kb_graph_nsymbols(g));
    for (int s = 0; list && s < kb_graph_nsymbols(g); s++)
        PyList_SET_ITEM(list, s, Py_BuildValue("(sL)", kb_graph_symbol_name(g, s), (long long)kb_graph_symbol_example(g, s)));
    return list;
}

static PyMethodDef graph_methods[] = {
    {"add_symbol", (PyCFunction)graph_add_symbol, METH_VARARGS, "add_symbol(name, example) -> symbol id"},
    {"add_input", (PyCFunction)graph_add_input, METH_VARARGS, "add_input(name, kind, dtype, dims) -> value id"},
    {"add_node", (PyCFunction)(void (*)(void))graph_add_node, METH_VARARGS | METH_KEYWORDS,
     "add_node(op, inputs, dtype, dims, *, scalars, axes, perm, axis, start, step, index, name, nograd) -> value id"},
    {"add_output", (PyCFunction)graph_add_output, METH_O, "add_output(value id)"},
    {"node", (PyCFunction)graph_node, METH_O, "node(id) -> dict of the node's fields"},
    {"sizes", (PyCFunction)graph_sizes, METH_VARARGS, "sizes(value id, symvals) -> concrete sizes"},
    {"partition", (PyCFunction)graph_partition, METH_NOARGS, "partition() -> Partition (the fused regions)"},
    {"grad", (PyCFunction)(void (*)(void))graph_grad, METH_VARARGS | METH_KEYWORDS,
     "grad(wrt, *, saved=0, joint=False, outputs=()) -> Graph: inputs = this graph's inputs + the values of its "
     "last `saved` outputs (statistics the forward kept) + the outputs listed in `outputs` (indices; the backward "
     "reads a value they hold instead of recomputing it) + one upstream gradient per other output; outputs = the gradients of "
     "the inputs flagged in wrt. joint=True: forward and backward in one graph, upstream gradients taken as "
     "1: inputs = this graph's inputs; outputs = its outputs, then the gradients"},
    {"simplify", (PyCFunction)graph_simplify, METH_NOARGS,
     "simplify() -> Graph: the same inputs, outputs and values, rewritten to take work out of its kernels "
     "(a one-hot's row sum becomes per-row work), without dead nodes; grad() results have been through it"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef graph_getset[] = {
    {"num_nodes", (getter)graph_get_int, NULL, NULL, (void *)0},
    {"num_inputs", (getter)graph_get_int, NULL, NULL, (void *)1},
    {"num_outputs", (getter)graph_get_int, NULL, NULL, (void *)2},
    {"num_symbols", (getter)graph_get_int, NULL, NULL, (void *)3},
    {"inputs", (getter)graph_get_inputs, NULL, "node ids of the graph inputs", NULL},
    {"outputs", (getter)graph_get_outputs, NULL, "node ids of the graph outputs", NULL},
    {"symbols", (getter)graph_get_symbols, NULL, "[(name, example size)] per symbol", NULL},
    {"frozen", (getter)graph_get_int, NULL, "True once a Partition or the interpreter has read the graph: it "
     "no longer grows", (void *)4},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot graph_slots[] = {
    {Py_tp_new, graph_new},           {Py_tp_dealloc, graph_dealloc}, {Py_tp_str, graph_str},
    {Py_tp_methods, graph_methods},   {Py_tp_getset, graph_getset},
    {Py_tp_doc, "Graph() — a kbench IR graph, built node by node (see kbench.capture)."},
    {0, NULL},
};

PyType_Spec kb_graph_spec = {"kbench._C.Graph", sizeof(kb_py_graph), 0,
                                 Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE, graph_slots};

/* ---------------------------------------------------------------- Partition */

static void partition_dealloc(kb_py_partition *self) {
    PyTypeObject *tp = Py_TYPE(self);
    kb_partition_free(self->part);
    Py_XDECREF(self->graph);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static Py_ssize_t partition_len(kb_py_partition *self) { return self->part->nregions; }

static PyObject *partition_region(kb_py_partition *self, PyObject *arg) {
    long r = PyLong_AsLong(arg);
    if (r == -1 && PyErr_Occurred()) return NULL;
    if (r < 0 || r >= self->part->nregions) return PyErr_Format(PyExc_IndexError, "region %ld out of range", r);
    const kb_region *rg = &self->part->regions[r];
    int32_t reads[32], nreads = 0;
    for (int32_t k = 0; k < 32; k++)
        if (rg->saved_outputs >> k & 1u) reads[nreads++] = k;
    return Py_BuildValue("{s:s,s:N,s:N,s:N,s:i,s:N,s:i,s:k}", "kind", kb_region_kind_name(rg->kind), "nodes",
                         ids_to_list(rg->nodes, rg->nnodes), "inputs", ids_to_list(rg->inputs, rg->ninputs),
                         "outputs", ids_to_list(rg->outputs, rg->noutputs), "saved", rg->nsaved,
                         "saved_outputs", ids_to_list(reads, nreads), "anchor", rg->anchor,
                         "reduce_axes", (unsigned long)rg->reduce_axes);
}

static PyObject *partition_save_stats(kb_py_partition *self, PyObject *arg) {
    long long min_row_bytes = PyLong_AsLongLong(arg);
    if (min_row_bytes == -1 && PyErr_Occurred()) return NULL;
    if (self->frozen)
        return PyErr_Format(PyExc_RuntimeError, "Partition.save_stats: the interpreter has read this partition; "
                            "save statistics before running it");
    kb_status st = kb_partition_save_stats(self->part, (int64_t)min_row_bytes);
    if (st != KB_OK) return kb_py_raise(PyType_GetModule(Py_TYPE(self)), self->graph->ctx, st, NULL);
    long total = 0;
    for (int32_t r = 0; r < self->part->nregions; r++) total += self->part->regions[r].nsaved;
    return PyLong_FromLong(total);
}

static PyObject *partition_region_graph(kb_py_partition *self, PyObject *arg) {
    long r = PyLong_AsLong(arg);
    if (r == -1 && PyErr_Occurred()) return NULL;
    if (r < 0 || r >= self->part->nregions) return PyErr_Format(PyExc_IndexError, "region %ld out of range", r);
    kb_graph *out = NULL;
    kb_status st = kb_region_graph(self->part, (int32_t)r, &out);
    if (st != KB_OK) return kb_py_raise(PyType_GetModule(Py_TYPE(self)), self->graph->ctx, st, NULL);
    return graph_wrap_derived(self->graph, out);
}

static PyObject *partition_str(kb_py_partition *self) {
    char *text;
    kb_status st = kb_partition_dump(self->part, &text);
    if (st != KB_OK) return kb_py_raise(PyType_GetModule(Py_TYPE(self)), self->graph->ctx, st, NULL);
    PyObject *s = PyUnicode_FromString(text);
    kb_string_free(self->graph->ctx, text);
    return s;
}

static PyObject *partition_get_graph(kb_py_partition *self, void *Py_UNUSED(c)) {
    return Py_NewRef((PyObject *)self->graph);
}

static PyMethodDef partition_methods[] = {
    {"region", (PyCFunction)partition_region, METH_O,
     "region(i) -> dict(kind, nodes, inputs, outputs, saved, saved_outputs, anchor, reduce_axes); the last "
     "`saved` outputs are row statistics kept for the backward, which also reads the outputs (indices) in "
     "saved_outputs"},
    {"save_stats", (PyCFunction)partition_save_stats, METH_O,
     "save_stats(min_row_bytes) -> int: each ROW region whose rows hold at least min_row_bytes also outputs "
     "its row reductions (for its backward); how many in all"},
    {"region_graph", (PyCFunction)partition_region_graph, METH_O,
     "region_graph(i) -> Graph: region i alone, its inputs as graph inputs, its outputs as graph outputs"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef partition_getset[] = {
    {"graph", (getter)partition_get_graph, NULL, "the partitioned Graph", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot partition_slots[] = {
    {Py_tp_dealloc, partition_dealloc}, {Py_tp_str, partition_str},     {Py_sq_length, partition_len},
    {Py_tp_methods, partition_methods}, {Py_tp_getset, partition_getset},
    {Py_tp_doc, "The regions (kernels) of a Graph, from Graph.partition()."},
    {0, NULL},
};

PyType_Spec kb_partition_spec = {"kbench._C.Partition", sizeof(kb_py_partition), 0,
                                     Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
                                     partition_slots};
