/* module.h — what the binding's files (module.c, module_graph.c, module_types.c, module_cuda.c,
 * module_evolve.c) share: the module state, the kb_status -> exception mapping, the per-thread
 * context, the Graph, Partition, Genome and KernelInfo objects and the argument converters. */
#ifndef KBENCH_MODULE_H
#define KBENCH_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "core/kbench.h"

typedef struct kb_module_state {
    PyTypeObject *graph_type;
    PyTypeObject *partition_type;
    PyTypeObject *genome_type;      /* kbench._C.Genome */
    PyTypeObject *kernel_info_type; /* kbench._C.KernelInfo */
    PyObject *compile_error;   /* kbench._C.CompileError(RuntimeError): NVRTC said no, with its log */
    PyObject *cuda_error;      /* kbench._C.CudaError(RuntimeError): a driver call failed */
    PyObject *torch_objects;   /* what launch reads tensors and streams through (module_cuda.c),
                                  a tuple made on the first launch: torch is imported then */
} kb_module_state;

kb_module_state *kb_py_state(PyObject *module);

/* Raises the exception for st with ctx's message (and prefix, if not NULL); returns NULL. */
PyObject *kb_py_raise(PyObject *module, kb_ctx *ctx, kb_status st, const char *prefix);

/* The calling thread's own kb_ctx, for error messages of calls that have no graph's context at
 * hand (compiles run in parallel threads with the GIL released: a shared ctx would race on its
 * error buffer). Freed at thread exit. _raw: NULL with no Python error set (callable without the
 * GIL); the other: NULL with MemoryError. */
kb_ctx *kb_py_thread_ctx_raw(void);
kb_ctx *kb_py_thread_ctx(void);

/* The Graph object: owns its graph, and its context unless `owner` is set — a graph derived
 * from another (a gradient, a region's subgraph) shares that one's context and keeps it alive.
 * frozen: a Partition or the interpreter has read it, so the builder calls refuse to grow it (a
 * partition's arrays are sized by its nodes; the interpreter reads them without the GIL). */
typedef struct kb_py_graph {
    PyObject_HEAD
    kb_ctx *ctx;
    kb_graph *graph;
    PyObject *owner;
    int frozen;
} kb_py_graph;

/* The Partition object: owns the partition, keeps its Graph alive. frozen: the interpreter has
 * read it (without the GIL), so save_stats no longer rewrites its regions. */
typedef struct kb_py_partition {
    PyObject_HEAD
    kb_py_graph *graph;
    kb_partition *part;
    int frozen;
} kb_py_partition;

/* The Genome object: one region's schedule, immutable (module_types.c). */
typedef struct kb_py_genome {
    PyObject_HEAD
    kb_genome gn;
} kb_py_genome;

/* A new Genome holding *gn (trusted: every gene within its range). */
PyObject *kb_py_genome_new(kb_module_state *state, const kb_genome *gn);

/* *out = the genes of obj, a Genome; -1 with TypeError naming `what` for anything else. */
int kb_py_genome_of(kb_module_state *state, PyObject *obj, kb_genome *out, const char *what);

/* A new KernelInfo describing k (max_blocks: kb_kernel_max_blocks on the device generated for). */
PyObject *kb_py_kernel_info_new(kb_module_state *state, const kb_kernel *k, int64_t max_blocks);

/* A tuple of seq's items (new reference), or NULL with TypeError naming `what`. Sequences are
 * read through one: converting an item (__index__, __bool__) runs Python code, which could
 * shrink a list under a loop over it. The PySequence_Fast_GET_* macros read it. */
PyObject *kb_py_tuple(PyObject *seq, const char *what);

/* Reads a sequence of Python ints into out[0..n); returns -1 with an exception set. */
int kb_py_int64s(PyObject *seq, int64_t *out, Py_ssize_t n, const char *what);

/* symvals: a sequence of one int per symbol of g. -1 with an exception set. */
int kb_py_symvals(const kb_graph *g, PyObject *seq, int64_t *out);

/* A kb_dim as Python sees it: an int (pinned) or (coef, (sym, ...)). New reference. */
PyObject *kb_py_dim(kb_dim d);
/* The inverse: an int or a (coef, (sym, ...)) tuple; -1 with an exception set. */
int kb_py_dim_from(PyObject *o, kb_dim *d);

/* The Graph and Partition types (module_graph.c), Genome and KernelInfo (module_types.c), made
 * at exec. */
extern PyType_Spec kb_graph_spec, kb_partition_spec, kb_genome_spec, kb_kernel_info_spec;

/* The device a dev argument names: None for the default device, else a mapping with any of
 * device_info()'s keys (the rest from the default device). -1 with an exception set. */
int kb_py_devinfo(PyObject *dev, kb_device_info *out);

#endif
