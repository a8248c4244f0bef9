/* module_cuda.h — the CUDA runtime's Python functions (module_cuda.c), added to kbench._C at exec. */
#ifndef KBENCH_MODULE_CUDA_H
#define KBENCH_MODULE_CUDA_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
extern PyMethodDef kb_cuda_methods[];
#endif
