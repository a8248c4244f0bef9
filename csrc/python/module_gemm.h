/* module_gemm.h — the GEMM generator's Python functions (module_gemm.c), added to kbench._C at exec. */
#ifndef KBENCH_MODULE_GEMM_H
#define KBENCH_MODULE_GEMM_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
extern PyMethodDef kb_gemm_methods[];
#endif
