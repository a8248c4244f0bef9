/* module.h — what the binding's files (module.c, module_graph.c, module_cuda.c, module_evolve.c)
 * share: the module state, the kb_status -> exception mapping, the Graph and Partition objects
 * and the argument converters. */
#ifndef KBENCH_MODULE_H
#define KBENCH_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "core/kbench.h"

typedef struct kb_module_state {
    PyTypeObject *graph_type;
    PyTypeObject *partition_type;
    PyObject *compile_error;   /* kbench._C.CompileError(RuntimeError): NVRTC said no, with its log */
    PyObject *cuda_error;      /* kbench._C.CudaError(RuntimeError): a driver call failed */
} kb_module_state;

kb_module_state *kb_py_state(PyObject *module);

/* Raises the exception for st with ctx's message (and prefix, if not NULL); returns NULL. */
PyObject *kb_py_raise(PyObject *module, kb_ctx *ctx, kb_status st, const char *prefix);

/* The Graph object: owns its graph, and its context unless `owner` is set — a graph derived
 * from another (a gradient, a region's subgraph) shares that one's context and keeps it alive. */
typedef struct kb_py_graph {
    PyObject_HEAD
    kb_ctx *ctx;
    kb_graph *graph;
    PyObject *owner;
} kb_py_graph;

/* The Partition object: owns the partition, keeps its Graph alive. */
typedef struct kb_py_partition {
    PyObject_HEAD
    kb_py_graph *graph;
    kb_partition *part;
} kb_py_partition;

/* Reads a sequence of Python ints into out[0..n); returns -1 with an exception set. */
int kb_py_int64s(PyObject *seq, int64_t *out, Py_ssize_t n, const char *what);

/* symvals: a sequence of one int per symbol of g. -1 with an exception set. */
int kb_py_symvals(const kb_graph *g, PyObject *seq, int64_t *out);

/* A kb_dim as Python sees it: an int (pinned) or (coef, (sym, ...)). New reference. */
PyObject *kb_py_dim(kb_dim d);

/* The Graph and Partition types (module_graph.c), made at exec. */
extern PyType_Spec kb_graph_spec, kb_partition_spec;

/* The device a dev argument names: None for the default device, else a mapping with any of
 * device_info()'s keys (the rest from the default device). -1 with an exception set. */
int kb_py_devinfo(PyObject *dev, kb_device_info *out);

#endif
