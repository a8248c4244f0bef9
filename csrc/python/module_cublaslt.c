/* module_cublaslt.c — kbench._C's cuBLASLt functions over cuda/cublaslt.c: open the library (a
 * handle), check a matmul's arguments, run it. Tensors are read through torch's TensorBase
 * descriptors (module_cuda.c says why): their sizes, strides, dtype and data pointer, never a
 * number from Python; the GIL is released around cuBLASLt. */
#include "python/module.h"

#include <string.h>

#include "python/module_cuda.h"

#define LT_CAPSULE "kbench._C.cublaslt"
#define MAX_NAMES 16

typedef struct { kb_ctx *ctx; kb_lt *lt; } lt_handle;   /* ctx allocated the handle */

static void lt_capsule_free(PyObject *cap) {
    lt_handle *h = PyCapsule_GetPointer(cap, LT_CAPSULE);
    if (!h) return;
    kb_lt_close(h->lt);
    kb_ctx_free(h->ctx);
    PyMem_Free(h);
}

/* lt_open(names) -> handle: the first of names that opens ([]: the sonames) */
static PyObject *py_lt_open(PyObject *self, PyObject *arg) {
    PyObject *t = kb_py_tuple(arg, "lt_open: names must be a list of str");
    if (!t) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    const char *names[MAX_NAMES];
    lt_handle *h = NULL;
    PyObject *cap = NULL;
    if (n > MAX_NAMES) {
        PyErr_Format(PyExc_ValueError, "lt_open: at most %d names", MAX_NAMES);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyTuple_GET_ITEM(t, i);
        if (!PyUnicode_Check(s)) {
            PyErr_SetString(PyExc_TypeError, "lt_open: names must be a list of str");
            goto done;
        }
        if (!(names[i] = PyUnicode_AsUTF8(s))) goto done;
    }
    h = PyMem_Calloc(1, sizeof *h);
    if (!h || kb_ctx_new(NULL, NULL, &h->ctx) != KB_OK) {
        PyErr_NoMemory();
        goto done;
    }
    kb_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kb_lt_open(h->ctx, names, (int)n, &h->lt);
    Py_END_ALLOW_THREADS
    if (st != KB_OK) {
        kb_py_raise(self, h->ctx, st, NULL);
        goto done;
    }
    if ((cap = PyCapsule_New(h, LT_CAPSULE, lt_capsule_free))) h = NULL;
done:
    if (h) {
        kb_lt_close(h->lt);
        kb_ctx_free(h->ctx);
        PyMem_Free(h);
    }
    Py_DECREF(t);
    return cap;
}

static PyObject *py_lt_info(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyCapsule_IsValid(arg, LT_CAPSULE))
        return PyErr_Format(PyExc_TypeError, "expected a %s handle, got %.100s", LT_CAPSULE, Py_TYPE(arg)->tp_name);
    lt_handle *h = PyCapsule_GetPointer(arg, LT_CAPSULE);
    return Py_BuildValue("(sn)", kb_lt_path(h->lt), (Py_ssize_t)kb_lt_version(h->lt));
}

/* ---------------------------------------------------------------- reading tensors */

/* What lt_matmul reads of one tensor argument. */
typedef struct {
    int ndim;
    int64_t size[3], stride[3];
    kb_dtype dtype;   /* KB_DTYPE_COUNT: none cuBLASLt's entry takes (uint8 is KB_BOOL here) */
    void *ptr;
} tensor_view;

/* -1 with an exception naming `what`. check_only: any device (the data pointer is read as is);
 * otherwise a CUDA tensor on *device (see kb_py_tensor_pointer). */
static int read_tensor(PyObject *const *T, PyObject *o, const char *what, int check_only, int *device,
                       tensor_view *v) {
    if (!Py_IS_TYPE(o, (PyTypeObject *)T[T_TENSOR]) && !Py_IS_TYPE(o, (PyTypeObject *)T[T_PARAMETER])) {
        PyErr_Format(PyExc_TypeError, "%s must be a torch.Tensor (or Parameter), not %.100s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    PyObject *dt = Py_TYPE(T[T_DTYPE])->tp_descr_get(T[T_DTYPE], o, (PyObject *)Py_TYPE(o));
    if (!dt) return -1;
    v->dtype = dt == T[T_BF16] ? KB_BF16 : dt == T[T_F16] ? KB_F16 : dt == T[T_F32] ? KB_F32
             : dt == T[T_U8] ? KB_BOOL : KB_DTYPE_COUNT;
    Py_DECREF(dt);
    PyObject *size = PyObject_CallOneArg(T[T_SIZE], o);
    PyObject *stride = size ? PyObject_CallOneArg(T[T_STRIDE], o) : NULL;
    int rc = -1;
    if (!stride) goto done;
    if (!PyTuple_Check(size) || !PyTuple_Check(stride) || PyTuple_GET_SIZE(size) != PyTuple_GET_SIZE(stride)) {
        PyErr_Format(PyExc_TypeError, "%s: size() and stride() are not as torch gives them", what);
        goto done;
    }
    v->ndim = (int)PyTuple_GET_SIZE(size);
    if (v->ndim < 1 || v->ndim > 3) {
        PyErr_Format(PyExc_ValueError, "%s has %d dimensions: 1 to 3 are taken", what, v->ndim);
        goto done;
    }
    for (int i = 0; i < v->ndim; i++) {
        v->size[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(size, i));
        v->stride[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(stride, i));
        if (PyErr_Occurred()) goto done;
    }
    uint64_t p = 0;
    if (check_only) {
        PyObject *r = PyObject_CallOneArg(T[T_DATA_PTR], o);
        p = r ? PyLong_AsUnsignedLongLong(r) : 0;
        Py_XDECREF(r);
        if (PyErr_Occurred()) goto done;
    } else if (kb_py_tensor_pointer(T, o, what, device, &p) < 0) {
        goto done;
    }
    v->ptr = (void *)(uintptr_t)p;
    rc = 0;
done:
    Py_XDECREF(size);
    Py_XDECREF(stride);
    return rc;
}

/* A matrix operand from a 2-D or 3-D (batched) tensor; transposed: its last two dims swapped.
 * *batch: 1 until a 3-D operand sets it; every 3-D operand must then agree. */
static int matrix_of(const tensor_view *v, const char *what, int transposed, int64_t *batch, kb_lt_matrix *out) {
    if (v->ndim < 2) {
        PyErr_Format(PyExc_ValueError, "%s has 1 dimension: a matrix (2-D) or a batch of them (3-D) is taken", what);
        return -1;
    }
    int r = v->ndim - 2, c = v->ndim - 1;
    if (transposed) r = v->ndim - 1, c = v->ndim - 2;
    *out = (kb_lt_matrix){v->ptr, v->size[r], v->size[c], v->stride[r], v->stride[c], 0};
    if (v->ndim == 3) {
        if (*batch > 1 && v->size[0] != *batch) {
            PyErr_Format(PyExc_ValueError, "%s has a batch of %lld, another operand %lld", what, (long long)v->size[0],
                         (long long)*batch);
            return -1;
        }
        *batch = v->size[0];
        out->batch_stride = v->size[0] == 1 ? 0 : v->stride[0];
    }
    return 0;
}

/* A vector (bias, bias gradient) of len elements, contiguous. */
static int vector_of(const tensor_view *v, const char *what, int64_t len, void **out) {
    if (v->ndim != 1 || v->size[0] != len || (len > 1 && v->stride[0] != 1)) {
        PyErr_Format(PyExc_ValueError, "%s must be a contiguous vector of %lld elements, got %d dimensions of [%lld, ...]",
                     what, (long long)len, v->ndim, (long long)v->size[0]);
        return -1;
    }
    *out = v->ptr;
    return 0;
}

/* ---------------------------------------------------------------- lt_check and lt_matmul */

enum { A_A, A_B, A_BT, A_D, A_EPI, A_BIAS, A_AUX, A_BGRAD, A_TF32, A_NCHECK, A_WS = A_NCHECK, A_STREAM, A_NRUN };

/* args[A_A..] as kb_lt_args, checked (kb_lt_check); -1 with an exception set. */
static int parse(PyObject *self, PyObject *const *T, PyObject *const *args, int check_only, kb_lt_args *out) {
    static const char *const names[] = {"a", "b", NULL, "d", NULL, "bias", "aux", "bgrad"};
    tensor_view v[A_BGRAD + 1];
    int device = -1;
    memset(out, 0, sizeof *out);
    for (int i = A_A; i <= A_BGRAD; i++) {
        if (!names[i] || (i >= A_BIAS && args[i] == Py_None)) continue;
        if (read_tensor(T, args[i], names[i], check_only, &device, &v[i]) < 0) return -1;
    }
    const char *ep = PyUnicode_AsUTF8(args[A_EPI]);
    if (!ep) return -1;
    out->epilogue = KB_LT_EPILOGUE_COUNT;
    for (int e = 0; e < KB_LT_EPILOGUE_COUNT; e++)
        if (!strcmp(ep, kb_lt_epilogue_name((kb_lt_epilogue)e))) out->epilogue = (kb_lt_epilogue)e;
    if (out->epilogue == KB_LT_EPILOGUE_COUNT) {
        PyErr_Format(PyExc_ValueError, "unknown epilogue '%.50s': none, bias, relu_bias, gelu_bias, gelu_aux_bias, "
                     "dgelu, dgelu_bgrad or bgradb", ep);
        return -1;
    }
    int bt = PyObject_IsTrue(args[A_BT]), tf32 = PyObject_IsTrue(args[A_TF32]);
    if (bt < 0 || tf32 < 0) return -1;
    out->dtype = v[A_A].dtype;
    out->tf32 = tf32;
    out->device = device < 0 ? 0 : device;
    for (int i = A_A; i <= A_BGRAD; i++) {
        if (!names[i] || (i >= A_BIAS && args[i] == Py_None)) continue;
        if (v[i].dtype != out->dtype || v[i].dtype == KB_DTYPE_COUNT || v[i].dtype == KB_BOOL) {
            PyErr_Format(PyExc_ValueError, "%s: every operand must be one dtype of bf16, f16 or f32 (a is %s, %s is %s)",
                         names[i], v[A_A].dtype < KB_BOOL ? kb_dtype_name(v[A_A].dtype) : "another", names[i],
                         v[i].dtype < KB_BOOL ? kb_dtype_name(v[i].dtype) : "another");
            return -1;
        }
    }
    out->batch = 1;
    if (matrix_of(&v[A_A], "a", 0, &out->batch, &out->a) < 0 || matrix_of(&v[A_B], "b", bt, &out->batch, &out->b) < 0 ||
        matrix_of(&v[A_D], "d", 0, &out->batch, &out->d) < 0)
        return -1;
    int batched = v[A_A].ndim == 3 || v[A_B].ndim == 3;
    if (batched != (v[A_D].ndim == 3)) {
        PyErr_SetString(PyExc_ValueError, "d must be 3-D (a batch) exactly where a or b is");
        return -1;
    }
    const int64_t m = out->a.rows, n = out->b.cols;
    if (args[A_BIAS] != Py_None && vector_of(&v[A_BIAS], "bias", n, &out->bias) < 0) return -1;
    if (args[A_BGRAD] != Py_None &&
        vector_of(&v[A_BGRAD], "bgrad", out->epilogue == KB_LT_BGRADB ? m : n, &out->bgrad) < 0)
        return -1;
    if (args[A_AUX] != Py_None) {
        const tensor_view *x = &v[A_AUX];
        int r = x->ndim - 2;
        if (x->ndim != v[A_D].ndim || x->size[r] != m || x->size[r + 1] != n || (x->ndim == 3 && x->size[0] != out->batch) ||
            (n > 1 && x->stride[r + 1] != 1)) {
            PyErr_Format(PyExc_ValueError, "aux must be shaped like d ([..., %lld, %lld]) with contiguous rows",
                         (long long)m, (long long)n);
            return -1;
        }
        out->aux = x->ptr;
        out->aux_ld = m == 1 ? (n + 7) / 8 * 8 : x->stride[r];
        out->aux_batch_stride = x->ndim == 3 ? x->stride[0] : 0;
    }
    kb_ctx *ctx = kb_py_thread_ctx();
    if (!ctx) return -1;
    kb_status st = kb_lt_check(ctx, out);
    if (st != KB_OK) {
        kb_py_raise(self, ctx, st, NULL);
        return -1;
    }
    return 0;
}

/* lt_check(a, b, b_transposed, d, epilogue, bias, aux, bgrad, tf32): every check lt_matmul
 * makes but the device's; tensors on any device */
static PyObject *py_lt_check(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != A_NCHECK) {
        PyErr_SetString(PyExc_TypeError, "lt_check(a, b, b_transposed, d, epilogue, bias, aux, bgrad, tf32)");
        return NULL;
    }
    PyObject *const *T = kb_py_torch_objects(self);
    kb_lt_args la;
    if (!T || parse(self, T, args, 1, &la) < 0) return NULL;
    Py_RETURN_NONE;
}

/* lt_matmul(handle, a, b, b_transposed, d, epilogue, bias, aux, bgrad, tf32, workspace, stream) */
static PyObject *py_lt_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != A_NRUN + 1) {
        PyErr_SetString(PyExc_TypeError, "lt_matmul(handle, a, b, b_transposed, d, epilogue, bias, aux, bgrad, tf32, "
                                         "workspace, stream)");
        return NULL;
    }
    if (!PyCapsule_IsValid(args[0], LT_CAPSULE))
        return PyErr_Format(PyExc_TypeError, "expected a %s handle, got %.100s", LT_CAPSULE, Py_TYPE(args[0])->tp_name);
    lt_handle *h = PyCapsule_GetPointer(args[0], LT_CAPSULE);
    args++;
    PyObject *const *T = kb_py_torch_objects(self);
    kb_lt_args la;
    if (!T || parse(self, T, args, 0, &la) < 0) return NULL;
    if (args[A_WS] != Py_None) {
        tensor_view w;
        int device = la.device;
        if (read_tensor(T, args[A_WS], "workspace", 0, &device, &w) < 0) return NULL;
        if (w.dtype != KB_BOOL || w.ndim != 1 || (w.size[0] > 1 && w.stride[0] != 1)) {
            PyErr_SetString(PyExc_ValueError, "workspace must be a contiguous 1-D uint8 tensor");
            return NULL;
        }
        la.workspace = w.ptr;
        la.workspace_bytes = (size_t)w.size[0];
    }
    if (kb_py_stream_handle(T, args[A_STREAM], la.device, &la.stream) < 0) return NULL;
    kb_ctx *ctx = kb_py_thread_ctx();
    if (!ctx) return NULL;
    kb_status st;
    /* the tensors stay alive (the caller holds them) while the GIL is released */
    Py_BEGIN_ALLOW_THREADS
    st = kb_lt_matmul(ctx, h->lt, &la);
    Py_END_ALLOW_THREADS
    if (st != KB_OK) return kb_py_raise(self, ctx, st, NULL);
    Py_RETURN_NONE;
}

PyMethodDef kb_cublaslt_methods[] = {
    {"lt_open", py_lt_open, METH_O,
     "lt_open(names: list[str]) -> handle: cuBLASLt from the first name that opens ([]: libcublasLt.so.13, .so.12); "
     "FileNotFoundError names every attempt"},
    {"lt_info", py_lt_info, METH_O, "lt_info(handle) -> (path, cublasLtGetVersion())"},
    {"lt_check", (PyCFunction)(void (*)(void))py_lt_check, METH_FASTCALL,
     "lt_check(a, b, b_transposed, d, epilogue, bias, aux, bgrad, tf32): ValueError for anything lt_matmul would "
     "refuse but the device (tensors on any device)"},
    {"lt_matmul", (PyCFunction)(void (*)(void))py_lt_matmul, METH_FASTCALL,
     "lt_matmul(handle, a, b, b_transposed, d, epilogue, bias, aux, bgrad, tf32, workspace, stream): "
     "d = epilogue(a @ b + bias) through cuBLASLt on stream (None: torch's current one); a [m,k] or [B,m,k], "
     "b [k,n] or, b_transposed, [n,k] (2-D: shared by the batch), d, aux like d, bias [n], bgrad [n] or [m] "
     "(bgradb); the tensors' device must be current"},
    {NULL, NULL, 0, NULL},
};
