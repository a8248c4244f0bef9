/* module.c — the CPython extension kbench._C: the module (multi-phase init with module state,
 * CPython's _bisectmodule.c is the model), the kb_status -> exception mapping, the per-thread
 * context and the argument converters the binding's files share, and the interpreter and code
 * generation entry points. The Graph and Partition types are module_graph.c's, Genome and
 * KernelInfo module_types.c's, the CUDA runtime's functions module_cuda.c's, the search's
 * module_evolve.c's, the GEMM generator's module_gemm.c's; all are added to the module at exec time. */
#include "python/module.h"

#include <pthread.h>
#include <string.h>

#include "core/internal.h"
#include "python/module_cuda.h"
#include "python/module_evolve.h"
#include "python/module_gemm.h"

kb_module_state *kb_py_state(PyObject *module) { return (kb_module_state *)PyModule_GetState(module); }

PyObject *kb_py_raise(PyObject *module, kb_ctx *ctx, kb_status st, const char *prefix) {
    kb_module_state *state = module ? kb_py_state(module) : NULL;
    PyObject *type;
    switch (st) {
    case KB_ERR_OOM: type = PyExc_MemoryError; break;
    case KB_ERR_INVALID: type = PyExc_ValueError; break;
    case KB_ERR_UNSUPPORTED: type = PyExc_NotImplementedError; break;
    case KB_ERR_CUDA: type = state ? state->cuda_error : PyExc_RuntimeError; break;
    case KB_ERR_NVRTC: type = state ? state->compile_error : PyExc_RuntimeError; break;
    case KB_ERR_NOT_FOUND: type = PyExc_FileNotFoundError; break;
    case KB_ERR_IO: type = PyExc_OSError; break;
    default: type = PyExc_RuntimeError; break;
    }
    const char *msg = ctx ? kb_ctx_error(ctx) : "";
    if (!*msg) msg = kb_status_name(st);
    if (prefix)
        PyErr_Format(type, "%s: %s", prefix, msg);
    else
        PyErr_SetString(type, msg);
    return NULL;
}

/* One kb_ctx per calling thread, made on first use, freed by pthread at thread exit. */
static pthread_key_t tls_key;
static pthread_once_t tls_once = PTHREAD_ONCE_INIT;
static int tls_ok;

static void tls_free(void *p) { kb_ctx_free(p); }
static void tls_init(void) { tls_ok = pthread_key_create(&tls_key, tls_free) == 0; }

kb_ctx *kb_py_thread_ctx_raw(void) {
    pthread_once(&tls_once, tls_init);
    if (!tls_ok) return NULL;
    kb_ctx *ctx = pthread_getspecific(tls_key);
    if (!ctx) {
        if (kb_ctx_new(NULL, NULL, &ctx) != KB_OK || pthread_setspecific(tls_key, ctx) != 0) {
            kb_ctx_free(ctx);
            return NULL;
        }
    }
    return ctx;
}

kb_ctx *kb_py_thread_ctx(void) {
    kb_ctx *ctx = kb_py_thread_ctx_raw();
    if (!ctx) PyErr_SetString(PyExc_MemoryError, "kbench: no thread-local context (key or memory)");
    return ctx;
}

PyObject *kb_py_tuple(PyObject *seq, const char *what) {
    PyObject *t = PySequence_Tuple(seq);
    if (!t && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: expected a sequence, got %.100s", what, Py_TYPE(seq)->tp_name);
    }
    return t;
}

int kb_py_int64s(PyObject *seq, int64_t *out, Py_ssize_t n, const char *what) {
    PyObject *fast = kb_py_tuple(seq, what);
    if (!fast) return -1;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd values, got %zd", what, n, PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return 0;
}

/* symvals: one int per symbol of g, sizes g can be computed at (kb_graph_check_symvals) */
int kb_py_symvals(const kb_graph *g, PyObject *seq, int64_t *out) {
    if (kb_py_int64s(seq, out, kb_graph_nsymbols(g), "symvals") < 0) return -1;
    if (kb_graph_check_symvals(g, out) != KB_OK) {
        PyErr_Format(PyExc_ValueError, "symvals: %s", kb_ctx_error(kb_graph_ctx(g)));
        return -1;
    }
    return 0;
}

/* dev: None (the default device, kb_device_default) or a mapping with any of the keys of
 * _C.device_info()'s dict; a missing key keeps the default device's figure. -1 with an exception
 * set for a value that is not an int, or a dev that is not a mapping. */
int kb_py_devinfo(PyObject *dev, kb_device_info *out) {
    *out = *kb_device_default();
    if (dev == NULL || dev == Py_None) return 0;
    static const char *const keys[] = {"sm", "num_sms", "max_smem_per_block", "regs_per_sm", "l2_bytes"};
    int32_t *fields[] = {&out->sm, &out->num_sms, &out->max_smem_per_block, &out->regs_per_sm, &out->l2_bytes};
    for (int i = 0; i < 5; i++) {
        PyObject *v = PyMapping_GetItemString(dev, keys[i]);
        if (!v) {
            if (!PyErr_ExceptionMatches(PyExc_KeyError)) return -1;
            PyErr_Clear();
            continue;
        }
        long x = PyLong_AsLong(v);
        Py_DECREF(v);
        if (x == -1 && PyErr_Occurred()) return -1;
        if (x < INT32_MIN || x > INT32_MAX) {
            PyErr_Format(PyExc_OverflowError, "dev['%s'] = %ld does not fit in an int32", keys[i], x);
            return -1;
        }
        *fields[i] = (int32_t)x;
    }
    return 0;
}

/* ---------------------------------------------------------------- interpreter */

/* The interpreter's buffers are objects with the buffer protocol (bytearray, array.array,
 * memoryview; bytes as an input), never addresses: a number cannot name memory here. Each holds
 * exactly the bytes its value has at these sizes, contiguous and aligned to its element size;
 * an output is writable and overlaps no other buffer (the interpreter loads a graph's inputs as
 * it goes: an output written over one would change what it reads). The views stay held while
 * the interpreter runs without the GIL, so their exporters can neither resize nor free them. */
static int get_view(PyObject *obj, int writable, const kb_graph *g, int32_t v, const int64_t *symvals,
                    const char *what, Py_ssize_t j, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s[%zd]: expected a %sbuffer (bytearray, array.array, memoryview), got %.100s",
                     what, j, writable ? "writable " : "", Py_TYPE(obj)->tp_name);
        return -1;
    }
    const kb_node *nd = kb_graph_node(g, v);
    int64_t sizes[KB_MAX_RANK];
    int64_t want = kb_value_sizes(g, v, symvals, sizes) * (int64_t)kb_dtype_size(nd->dtype); /* checked sizes */
    size_t align = kb_dtype_size(nd->dtype);
    if ((int64_t)view->len != want)
        PyErr_Format(PyExc_ValueError, "%s[%zd] holds %zd bytes; value %%%d (%s) needs %lld at these sizes", what, j,
                     view->len, (int)v, kb_dtype_name(nd->dtype), (long long)want);
    else if (want > 0 && (uintptr_t)view->buf % align != 0)
        PyErr_Format(PyExc_ValueError, "%s[%zd] is not aligned to its %s elements (%zu bytes)", what, j,
                     kb_dtype_name(nd->dtype), align);
    else
        return 0;
    PyBuffer_Release(view);
    return -1;
}

static int overlaps(const Py_buffer *a, const Py_buffer *b) {
    uintptr_t a0 = (uintptr_t)a->buf, b0 = (uintptr_t)b->buf;
    return a->len > 0 && b->len > 0 && a0 < b0 + (uintptr_t)b->len && b0 < a0 + (uintptr_t)a->len;
}

/* Runs the graph (p NULL) or region r of p over ins and outs, sequences of buffers. The graph
 * is frozen first: its nodes are read without the GIL, and an exporter's code (a __buffer__
 * method, from Python 3.12) could otherwise grow it between the checks; the sequences are
 * copied into tuples for the same reason. */
static PyObject *run_interp(PyObject *module, kb_py_graph *gobj, const kb_partition *p, int32_t r, PyObject *symseq,
                            PyObject *ins, PyObject *outs) {
    const kb_graph *g = gobj->graph;
    int64_t symvals[KB_MAX_SYMS];
    if (kb_py_symvals(g, symseq, symvals) < 0) return NULL;
    gobj->frozen = 1;
    Py_ssize_t nin = p ? p->regions[r].ninputs : kb_graph_ninputs(g);
    Py_ssize_t nout = p ? p->regions[r].noutputs : kb_graph_noutputs(g);
    PyObject *fin = PySequence_Tuple(ins);
    PyObject *fout = fin ? PySequence_Tuple(outs) : NULL;
    Py_buffer *views = fout ? PyMem_Calloc((size_t)(nin + nout) + 1, sizeof *views) : NULL;
    void **ptrs = views ? PyMem_Calloc((size_t)(nin + nout) + 1, sizeof *ptrs) : NULL;
    Py_ssize_t held = 0;
    PyObject *result = NULL;
    if (fout && !ptrs) PyErr_NoMemory();
    if (!ptrs) goto done;
    if (PyTuple_GET_SIZE(fin) != nin || PyTuple_GET_SIZE(fout) != nout) {
        PyErr_Format(PyExc_ValueError, "%s takes %zd inputs and %zd outputs, got %zd and %zd", p ? "the region" : "the graph",
                     nin, nout, PyTuple_GET_SIZE(fin), PyTuple_GET_SIZE(fout));
        goto done;
    }
    for (Py_ssize_t k = 0; k < nin + nout; k++, held++) {
        int out = k >= nin;
        Py_ssize_t j = out ? k - nin : k;
        int32_t v = p ? (out ? p->regions[r].outputs[j] : p->regions[r].inputs[j])
                      : (out ? kb_graph_output(g, (int32_t)j) : kb_graph_input(g, (int32_t)j));
        PyObject *obj = PyTuple_GET_ITEM(out ? fout : fin, j);
        if (get_view(obj, out, g, v, symvals, out ? "outputs" : "inputs", j, &views[k]) < 0) goto done;
        ptrs[k] = views[k].buf;
        for (Py_ssize_t o = 0; out && o < k; o++)
            if (overlaps(&views[k], &views[o])) {
                PyErr_Format(PyExc_ValueError, "outputs[%zd] overlaps %s[%zd]", j, o < nin ? "inputs" : "outputs",
                             o < nin ? o : o - nin);
                held++; /* views[k] too */
                goto done;
            }
    }
    /* A context per call: the interpreter runs without the GIL, and errors stay this call's. */
    kb_ctx *ctx;
    if (kb_ctx_new(NULL, NULL, &ctx) != KB_OK) {
        PyErr_NoMemory();
        goto done;
    }
    kb_status st;
    Py_BEGIN_ALLOW_THREADS
    st = p ? kb_interp_region(ctx, p, r, symvals, (const void *const *)ptrs, ptrs + nin)
           : kb_interp_graph(ctx, g, symvals, (const void *const *)ptrs, ptrs + nin);
    Py_END_ALLOW_THREADS
    result = st == KB_OK ? Py_NewRef(Py_None) : kb_py_raise(module, ctx, st, "interpreter");
    kb_ctx_free(ctx);
done:
    for (Py_ssize_t k = 0; k < held; k++) PyBuffer_Release(&views[k]);
    PyMem_Free(views);
    PyMem_Free(ptrs);
    Py_XDECREF(fin);
    Py_XDECREF(fout);
    return result;
}

static PyObject *py_interp_region(PyObject *module, PyObject *args) {
    kb_module_state *state = kb_py_state(module);
    kb_py_partition *p;
    int r;
    PyObject *symseq, *ins, *outs;
    if (!PyArg_ParseTuple(args, "O!iOOO:interp_region", state->partition_type, &p, &r, &symseq, &ins, &outs))
        return NULL;
    if (r < 0 || r >= p->part->nregions) return PyErr_Format(PyExc_IndexError, "region %d out of range", r);
    p->frozen = 1; /* save_stats would rewrite the regions the interpreter reads */
    return run_interp(module, p->graph, p->part, r, symseq, ins, outs);
}

static PyObject *py_interp_graph(PyObject *module, PyObject *args) {
    kb_module_state *state = kb_py_state(module);
    kb_py_graph *g;
    PyObject *symseq, *ins, *outs;
    if (!PyArg_ParseTuple(args, "O!OOO:interp_graph", state->graph_type, &g, &symseq, &ins, &outs)) return NULL;
    return run_interp(module, g, NULL, 0, symseq, ins, outs);
}

/* ---------------------------------------------------------------- schedules and codegen */

static PyObject *py_genome_default(PyObject *module, PyObject *args) {
    kb_module_state *state = kb_py_state(module);
    kb_py_partition *p;
    int r;
    PyObject *symseq, *dev = Py_None;
    if (!PyArg_ParseTuple(args, "O!iO|O:genome_default", state->partition_type, &p, &r, &symseq, &dev)) return NULL;
    if (r < 0 || r >= p->part->nregions) return PyErr_Format(PyExc_IndexError, "region %d out of range", r);
    int64_t symvals[KB_MAX_SYMS];
    kb_device_info info;
    if (kb_py_symvals(p->graph->graph, symseq, symvals) < 0 || kb_py_devinfo(dev, &info) < 0) return NULL;
    kb_genome gn;
    kb_status st = kb_genome_default(p->part, r, symvals, &info, &gn);
    if (st != KB_OK) return kb_py_raise(module, p->graph->ctx, st, "genome_default");
    return kb_py_genome_new(state, &gn);
}

/* generate(p, r, sm, genome_or_None, dev=None) -> KernelInfo */
static PyObject *py_generate(PyObject *module, PyObject *args) {
    kb_module_state *state = kb_py_state(module);
    kb_py_partition *p;
    int r, sm;
    PyObject *genome_obj, *dev = Py_None;
    if (!PyArg_ParseTuple(args, "O!iiO|O:generate", state->partition_type, &p, &r, &sm, &genome_obj, &dev))
        return NULL;
    if (r < 0 || r >= p->part->nregions) return PyErr_Format(PyExc_IndexError, "region %d out of range", r);
    kb_genome gn;
    if (genome_obj != Py_None && kb_py_genome_of(state, genome_obj, &gn, "generate: genome") < 0) return NULL;
    kb_device_info info;
    if (kb_py_devinfo(dev, &info) < 0) return NULL;
    info.sm = sm; /* the architecture compiled for, whatever dev says */
    kb_ctx *ctx = p->graph->ctx;
    const kb_graph *g = p->graph->graph;
    if (genome_obj == Py_None) {
        int64_t symvals[KB_MAX_SYMS];
        for (int s = 0; s < kb_graph_nsymbols(g); s++) symvals[s] = kb_graph_symbol_example(g, s);
        kb_status st = kb_graph_check_symvals(g, symvals);
        if (st == KB_OK) st = kb_genome_default(p->part, r, symvals, &info, &gn);
        if (st != KB_OK) return kb_py_raise(module, ctx, st, "genome");
    }
    kb_kernel *k = NULL;
    kb_status st = kb_kernel_generate(p->part, r, &gn, &info, &k);
    if (st != KB_OK) return kb_py_raise(module, ctx, st, "codegen");
    /* max_blocks: the cap kb_kernel_grid applies (0 = none), so Python computes the same grid
       without a Kernel object. Not read off a grid at huge sizes: there the 2^31 - 1 clamp of a
       region with two dynamic dims looked like a cap, and the loader made it one wave. */
    PyObject *result = kb_py_kernel_info_new(state, k, kb_kernel_max_blocks(k, &info));
    kb_kernel_free(ctx, k);
    return result;
}

static PyObject *py_ops(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
    static const char *const kinds[] = {"leaf", "unary", "binary", "ternary", "reduce", "view", "gather", "extern", "matmul"};
    PyObject *d = PyDict_New();
    for (int op = 0; d && op < KB_OP_COUNT; op++) {
        const kb_op_info *info = kb_op_get((kb_op)op);
        PyObject *v = Py_BuildValue("{s:i,s:s}", "arity", info->arity, "kind", kinds[info->kind]);
        if (!v || PyDict_SetItemString(d, info->name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

static PyMethodDef module_methods[] = {
    {"interp_region", py_interp_region, METH_VARARGS,
     "interp_region(partition, r, symvals, inputs, outputs): run region r on host buffers: objects with the "
     "buffer protocol (bytearray, array.array, memoryview), each exactly its value's bytes, contiguous and "
     "aligned; outputs writable and apart. kbench.runtime.interp.run_region takes tensors"},
    {"interp_graph", py_interp_graph, METH_VARARGS,
     "interp_graph(graph, symvals, inputs, outputs): run a graph without EXTERN nodes on host buffers, as "
     "interp_region; the graph is frozen from then on. kbench.runtime.interp.run_graph takes tensors"},
    {"genome_default", py_genome_default, METH_VARARGS,
     "genome_default(partition, r, symvals, dev=None) -> Genome: region r's default schedule at these sizes"},
    {"generate", py_generate, METH_VARARGS,
     "generate(partition, r, sm, genome_or_None, dev=None) -> KernelInfo: region r's kernel for sm_<sm> "
     "(None: the default genome at the graph's example sizes); ValueError where codegen refuses the genome"},
    {"ops", py_ops, METH_NOARGS, "ops() -> {name: {arity, kind}} for every IR op"},
    {NULL, NULL, 0, NULL},
};

/* ---------------------------------------------------------------- module */

static int module_exec(PyObject *module) {
    kb_module_state *state = kb_py_state(module);
    state->graph_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &kb_graph_spec, NULL);
    if (!state->graph_type || PyModule_AddType(module, state->graph_type) < 0) return -1;
    state->partition_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &kb_partition_spec, NULL);
    if (!state->partition_type || PyModule_AddType(module, state->partition_type) < 0) return -1;
    state->genome_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &kb_genome_spec, NULL);
    if (!state->genome_type || PyModule_AddType(module, state->genome_type) < 0) return -1;
    state->kernel_info_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &kb_kernel_info_spec, NULL);
    if (!state->kernel_info_type || PyModule_AddType(module, state->kernel_info_type) < 0) return -1;
    state->compile_error = PyErr_NewExceptionWithDoc("kbench._C.CompileError",
                                                     "NVRTC could not compile a kernel; the message holds its log.",
                                                     PyExc_RuntimeError, NULL);
    if (!state->compile_error || PyModule_AddObjectRef(module, "CompileError", state->compile_error) < 0) return -1;
    state->cuda_error = PyErr_NewExceptionWithDoc("kbench._C.CudaError",
                                                  "A CUDA driver call failed; the message names the driver's error.",
                                                  PyExc_RuntimeError, NULL);
    if (!state->cuda_error || PyModule_AddObjectRef(module, "CudaError", state->cuda_error) < 0) return -1;
    if (PyModule_AddFunctions(module, kb_cuda_methods) < 0) return -1;
    if (PyModule_AddFunctions(module, kb_cublaslt_methods) < 0) return -1;
    if (PyModule_AddFunctions(module, kb_evolve_methods) < 0) return -1;
    if (PyModule_AddFunctions(module, kb_gemm_methods) < 0) return -1;
    if (PyModule_AddStringConstant(module, "CORE_VERSION", KB_VERSION) < 0) return -1;
    if (PyModule_AddIntConstant(module, "MAX_RANK", KB_MAX_RANK) < 0) return -1;
    return PyModule_AddIntConstant(module, "MAX_SYMS", KB_MAX_SYMS);
}

static int module_traverse(PyObject *module, visitproc visit, void *arg) {
    kb_module_state *state = kb_py_state(module);
    Py_VISIT(state->graph_type);
    Py_VISIT(state->partition_type);
    Py_VISIT(state->genome_type);
    Py_VISIT(state->kernel_info_type);
    Py_VISIT(state->compile_error);
    Py_VISIT(state->cuda_error);
    Py_VISIT(state->torch_objects);
    return 0;
}

static int module_clear(PyObject *module) {
    kb_module_state *state = kb_py_state(module);
    Py_CLEAR(state->graph_type);
    Py_CLEAR(state->partition_type);
    Py_CLEAR(state->genome_type);
    Py_CLEAR(state->kernel_info_type);
    Py_CLEAR(state->compile_error);
    Py_CLEAR(state->cuda_error);
    Py_CLEAR(state->torch_objects);
    return 0;
}

static void module_free(void *module) { module_clear((PyObject *)module); }

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef kbench_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kbench._C",
    .m_doc = "kbench's C core: IR, fusion, interpreter, CUDA code generation and runtime.",
    .m_size = sizeof(kb_module_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&kbench_module); }
