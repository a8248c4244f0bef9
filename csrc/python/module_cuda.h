/* module_cuda.h — the CUDA runtime's Python functions (module_cuda.c, module_cublaslt.c), added to
 * kbench._C at exec, and the torch objects both read tensors and streams through. */
#ifndef KBENCH_MODULE_CUDA_H
#define KBENCH_MODULE_CUDA_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
extern PyMethodDef kb_cuda_methods[];
extern PyMethodDef kb_cublaslt_methods[];   /* module_cublaslt.c */

/* torch's objects the CUDA functions read tensors and streams through (module_cuda.c says why),
 * a tuple in the module state made on first use (torch is imported then), indexed by T_*. */
enum {
    T_TENSOR, T_PARAMETER,                 /* the tensor types taken */
    T_DATA_PTR, T_IS_CUDA, T_GET_DEVICE,   /* TensorBase's descriptors */
    T_STREAM, T_CUDA_STREAM, T_DEVICE_INDEX, /* torch._C._CudaStreamBase and its descriptors */
    T_CURRENT_STREAM,                      /* torch._C._cuda_getCurrentRawStream */
    T_SIZE, T_STRIDE, T_DTYPE,             /* TensorBase's size(), stride() and dtype */
    T_F16, T_BF16, T_F32, T_U8,            /* the dtypes cuBLASLt's entry takes */
    T_COUNT
};
PyObject *const *kb_py_torch_objects(PyObject *module);   /* NULL with an exception set */

/* The data pointer of o, a CUDA tensor on *device (or, where *device < 0, the first one seen,
 * which then sets it). -1 with ValueError naming `what`. */
int kb_py_tensor_pointer(PyObject *const *T, PyObject *o, const char *what, int *device, uint64_t *out);

/* The driver's handle of stream, a torch CUDA stream, or of torch's current stream on device
 * for None; -1 with an exception set. */
int kb_py_stream_handle(PyObject *const *T, PyObject *stream, int device, void **out);
#endif
