/* module.h — what the binding's files (module.c, module_cuda.c) share: the module state and
 * the one function that turns a kb_status into the right Python exception. */
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

/* The device a dev argument names: None for the default device, else a mapping with any of
 * device_info()'s keys (the rest from the default device). -1 with an exception set. */
int kb_py_devinfo(PyObject *dev, kb_device_info *out);

#endif
