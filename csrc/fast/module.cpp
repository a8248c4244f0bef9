/* module.cpp — kbench._fast's module: its types (launch.cpp, region.cpp, program.cpp, guards.cpp, keys.cpp), module_call
 * (call.cpp) and init(), which kbench.cuda_backend calls once with kbench._C's launch API and the
 * exceptions to raise. */
#include "fast/fast.h"

namespace kbfast {

const kb_launch_api *api;
PyObject *FallbackError, *RegionFallbackError, *CudaError;

namespace {

/* init(launch_api_capsule, Fallback, RegionFallback, CudaError) */
PyObject *fast_init(PyObject *, PyObject *args) {
    PyObject *capsule, *fallback, *region_fallback, *cuda_error;
    if (!PyArg_ParseTuple(args, "OOOO", &capsule, &fallback, &region_fallback, &cuda_error)) return nullptr;
    auto *a = (const kb_launch_api *)PyCapsule_GetPointer(capsule, KB_LAUNCH_API_CAPSULE);
    if (!a) return nullptr;
    if (a->version != KB_LAUNCH_API_VERSION || a->size < sizeof(kb_launch_api)) {
        PyErr_Format(PyExc_ImportError, "kbench._fast was built for launch API %d; kbench._C has %d (rebuild kbench)",
                     KB_LAUNCH_API_VERSION, a->version);
        return nullptr;
    }
    for (PyObject *e : {fallback, region_fallback, cuda_error})
        if (!PyExceptionClass_Check(e)) {
            PyErr_SetString(PyExc_TypeError, "init: expected exception classes");
            return nullptr;
        }
    api = a;
    Py_XSETREF(FallbackError, Py_NewRef(fallback));
    Py_XSETREF(RegionFallbackError, Py_NewRef(region_fallback));
    Py_XSETREF(CudaError, Py_NewRef(cuda_error));
    Py_RETURN_NONE;
}

PyMethodDef fast_methods[] = {
    {"init", fast_init, METH_VARARGS,
     "init(launch_api, Fallback, RegionFallback, CudaError): before any Launch is made"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef fast_module = {PyModuleDef_HEAD_INIT, "kbench._fast",
                           "The CUDA backend's hot path in C++: launches and autograd nodes.", -1, fast_methods};

}  // namespace
}  // namespace kbfast

PyMODINIT_FUNC PyInit__fast(void) {
    PyObject *m = PyModule_Create(&kbfast::fast_module);
    if (!m) return nullptr;
    if (kbfast::init_launch(m) < 0 || kbfast::init_region(m) < 0 || kbfast::init_program(m) < 0 ||
        kbfast::init_guards(m) < 0 || kbfast::init_keys(m) < 0 ||
        kbfast::init_call(m) < 0) {
        Py_DECREF(m);
        return nullptr;
    }
    return m;
}
