/* module_evolve.h — the schedule search's Python functions (module_evolve.c), added to kbench._C at exec. */
#ifndef KBENCH_MODULE_EVOLVE_H
#define KBENCH_MODULE_EVOLVE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
extern PyMethodDef kb_evolve_methods[];
#endif
