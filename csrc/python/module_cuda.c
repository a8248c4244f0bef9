/* module_cuda.c — kbench._C's CUDA runtime functions over cuda/: NVRTC (open, compile to a
 * CUBIN through the disk cache), the driver (device info, modules, functions) and launch, the
 * hot path: METH_FASTCALL, arguments packed on the stack, the GIL released around the launch. */
#include "python/module.h"

#include <string.h>

#include "core/internal.h"
#include "cuda/launch_api.h"
#include "python/module_cuda.h"

#define NVRTC_CAPSULE "kbench._C.nvrtc"
#define CUDA_CAPSULE "kbench._C.cuda"
#define MODULE_CAPSULE "kbench._C.cuda_module"
#define FUNCTION_CAPSULE "kbench._C.cuda_function"
#define MAX_DIRS 64
/* kernel arguments in one launch: as many as CUDA's parameter space holds (4 bytes the smallest) */
#define MAX_ARGS (KB_MAX_PARAM_BYTES / 4)
_Static_assert(KB_LAUNCH_MAX_PARAM_BYTES == KB_MAX_PARAM_BYTES, "launch_api.h and kbench.h agree on the parameter space");

/* ---------------------------------------------------------------- handles */

typedef struct { kb_ctx *ctx; kb_nvrtc *nvrtc; } nvrtc_handle;  /* ctx allocated the handle */
typedef struct { kb_ctx *ctx; kb_cuda *cuda; } cuda_handle;
typedef struct {
    kb_ctx *ctx;              /* this module's own: it may outlive the thread that loaded it */
    PyObject *owner;          /* the cuda capsule, kept alive while the module is */
    kb_cuda *cuda;
    kb_cuda_module *module;
} module_handle;

/* A kernel of a loaded module, as get_function returns it: launch and kbench._fast take this
 * object, never an address, and it keeps its module loaded for as long as it lives. */
typedef struct {
    void *fn;        /* the CUfunction */
    kb_cuda *cuda;   /* the driver handle it was loaded through */
    PyObject *owner; /* its module capsule */
} function_handle;

static void nvrtc_capsule_free(PyObject *cap) {
    nvrtc_handle *h = PyCapsule_GetPointer(cap, NVRTC_CAPSULE);
    if (!h) return;
    kb_nvrtc_close(h->nvrtc);
    kb_ctx_free(h->ctx);
    PyMem_Free(h);
}

static void cuda_capsule_free(PyObject *cap) {
    cuda_handle *h = PyCapsule_GetPointer(cap, CUDA_CAPSULE);
    if (!h) return;
    kb_cuda_close(h->cuda);
    kb_ctx_free(h->ctx);
    PyMem_Free(h);
}

static void module_capsule_free(PyObject *cap) {
    module_handle *h = PyCapsule_GetPointer(cap, MODULE_CAPSULE);
    if (!h) return;
    kb_cuda_module_unload(h->cuda, h->module);
    kb_ctx_free(h->ctx);
    Py_XDECREF(h->owner);
    PyMem_Free(h);
}

static void function_capsule_free(PyObject *cap) {
    function_handle *h = PyCapsule_GetPointer(cap, FUNCTION_CAPSULE);
    if (!h) return;
    Py_XDECREF(h->owner);
    PyMem_Free(h);
}

/* PyLong_AsInt is public only from 3.13 */
static int as_int(PyObject *o, int *out) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "value does not fit in an int");
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* The pointer in a capsule of the given kind, or NULL with TypeError. */
static void *handle_of(PyObject *o, const char *kind) {
    if (!PyCapsule_IsValid(o, kind)) {
        PyErr_Format(PyExc_TypeError, "expected a %s handle, got %.100s", kind, Py_TYPE(o)->tp_name);
        return NULL;
    }
    return PyCapsule_GetPointer(o, kind);
}

static nvrtc_handle *get_nvrtc(PyObject *o) { return handle_of(o, NVRTC_CAPSULE); }
static cuda_handle *get_cuda(PyObject *o) { return handle_of(o, CUDA_CAPSULE); }

/* ---------------------------------------------------------------- NVRTC */

static PyObject *py_nvrtc_open(PyObject *self, PyObject *arg) {
    PyObject *fast = PySequence_Fast(arg, "nvrtc_open: extra_dirs must be a list of str");
    if (!fast) return NULL;
    Py_ssize_t nd = PySequence_Fast_GET_SIZE(fast);
    const char *dirs[MAX_DIRS];
    nvrtc_handle *h = NULL;
    PyObject *cap = NULL;
    if (nd > MAX_DIRS) {
        PyErr_Format(PyExc_ValueError, "nvrtc_open: at most %d folders", MAX_DIRS);
        goto done;
    }
    for (Py_ssize_t i = 0; i < nd; i++) {
        PyObject *d = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyUnicode_Check(d)) {
            PyErr_SetString(PyExc_TypeError, "nvrtc_open: extra_dirs must be a list of str");
            goto done;
        }
        if (!(dirs[i] = PyUnicode_AsUTF8(d))) goto done;
    }
    h = PyMem_Calloc(1, sizeof *h);
    if (!h) {
        PyErr_NoMemory();
        goto done;
    }
    if (kb_ctx_new(NULL, NULL, &h->ctx) != KB_OK) {
        PyErr_NoMemory();
        goto done;
    }
    kb_status st = kb_nvrtc_open(h->ctx, dirs, (int)nd, &h->nvrtc);
    if (st != KB_OK) {
        kb_py_raise(self, h->ctx, st, NULL);
        goto done;
    }
    cap = PyCapsule_New(h, NVRTC_CAPSULE, nvrtc_capsule_free);
    if (cap) h = NULL;
done:
    if (h) {
        kb_nvrtc_close(h->nvrtc);
        kb_ctx_free(h->ctx);
        PyMem_Free(h);
    }
    Py_DECREF(fast);
    return cap;
}

static PyObject *py_nvrtc_info(PyObject *self, PyObject *arg) {
    (void)self;
    nvrtc_handle *h = get_nvrtc(arg);
    if (!h) return NULL;
    return Py_BuildValue("(si)", kb_nvrtc_path(h->nvrtc), kb_nvrtc_version(h->nvrtc));
}

static PyObject *py_nvrtc_include_dir(PyObject *self, PyObject *arg) {
    (void)self;
    nvrtc_handle *h = get_nvrtc(arg);
    if (!h) return NULL;
    const char *d = kb_nvrtc_include_dir(h->nvrtc);
    if (!d[0]) Py_RETURN_NONE;
    return PyUnicode_FromString(d);
}

static PyObject *py_nvrtc_compile(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "nvrtc_compile(handle, source, arch, cache_dir_or_None, key=None)");
        return NULL;
    }
    nvrtc_handle *h = get_nvrtc(args[0]);
    if (!h) return NULL;
    const char *source = PyUnicode_AsUTF8(args[1]);
    const char *arch = source ? PyUnicode_AsUTF8(args[2]) : NULL;
    if (!arch) return NULL;
    const char *cache_dir = NULL;
    PyObject *dir_str = NULL; /* str or os.PathLike */
    if (args[3] != Py_None) {
        if (!(dir_str = PyOS_FSPath(args[3]))) return NULL;
        if (!PyUnicode_Check(dir_str) || !(cache_dir = PyUnicode_AsUTF8(dir_str))) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "nvrtc_compile: cache_dir must be a str path");
            Py_DECREF(dir_str);
            return NULL;
        }
    }
    /* the cache's secret (bytes): copied, so nothing the caller does while the GIL is out moves it */
    unsigned char key[KB_CUBIN_KEY_MAX];
    Py_ssize_t key_len = 0;
    if (nargs == 5 && args[4] != Py_None) {
        char *kp;
        if (!PyBytes_Check(args[4]) || PyBytes_AsStringAndSize(args[4], &kp, &key_len) < 0 ||
            key_len > KB_CUBIN_KEY_MAX) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "nvrtc_compile: key must be bytes of at most %d", KB_CUBIN_KEY_MAX);
            Py_XDECREF(dir_str);
            return NULL;
        }
        memcpy(key, kp, (size_t)key_len);
    }
    kb_ctx *ctx = kb_py_thread_ctx();
    if (!ctx) {
        Py_XDECREF(dir_str);
        return NULL;
    }
    void *cubin = NULL;
    size_t size = 0;
    char *log = NULL;
    kb_status st;
    /* the str objects stay alive (the caller holds them) while the GIL is released */
    Py_BEGIN_ALLOW_THREADS
    st = kb_nvrtc_compile(ctx, h->nvrtc, source, arch, cache_dir, key_len ? key : NULL, (size_t)key_len, &cubin,
                          &size, &log);
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    if (st == KB_OK) {
        out = PyBytes_FromStringAndSize(cubin, (Py_ssize_t)size);
    } else if (st == KB_ERR_NVRTC && log) {
        kb_module_state *state = kb_py_state(self);
        PyErr_SetString(state ? state->compile_error : PyExc_RuntimeError, log); /* the message is the log */
    } else {
        kb_py_raise(self, ctx, st, NULL);
    }
    kb_blob_free(ctx, cubin, size);
    kb_string_free(ctx, log);
    Py_XDECREF(dir_str);
    return out;
}

/* ---------------------------------------------------------------- the driver */

static PyObject *py_cuda_open(PyObject *self, PyObject *unused) {
    (void)unused;
    cuda_handle *h = PyMem_Calloc(1, sizeof *h);
    if (!h) return PyErr_NoMemory();
    PyObject *cap = NULL;
    if (kb_ctx_new(NULL, NULL, &h->ctx) != KB_OK) {
        PyErr_NoMemory();
    } else {
        kb_status st = kb_cuda_open(h->ctx, &h->cuda);
        if (st != KB_OK) kb_py_raise(self, h->ctx, st, NULL);
        else if ((cap = PyCapsule_New(h, CUDA_CAPSULE, cuda_capsule_free))) return cap;
    }
    kb_cuda_close(h->cuda);
    kb_ctx_free(h->ctx);
    PyMem_Free(h);
    return NULL;
}

static PyObject *py_device_info(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "device_info(handle, device)");
        return NULL;
    }
    cuda_handle *h = get_cuda(args[0]);
    if (!h) return NULL;
    int device;
    if (as_int(args[1], &device) < 0) return NULL;
    kb_ctx *ctx = kb_py_thread_ctx();
    if (!ctx) return NULL;
    kb_device_info info;
    kb_status st = kb_cuda_device_info(ctx, h->cuda, device, &info);
    if (st != KB_OK) return kb_py_raise(self, ctx, st, NULL);
    return Py_BuildValue("{sisisisisisi}", "sm", info.sm, "num_sms", info.num_sms, "max_smem_per_block",
                         info.max_smem_per_block, "regs_per_sm", info.regs_per_sm, "l2_bytes", info.l2_bytes,
                         "driver_version", kb_cuda_driver_version(h->cuda));
}

static PyObject *py_module_load(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "module_load(handle, cubin)");
        return NULL;
    }
    cuda_handle *ch = get_cuda(args[0]);
    if (!ch) return NULL;
    Py_buffer buf;
    if (PyObject_GetBuffer(args[1], &buf, PyBUF_SIMPLE) < 0) return NULL;
    module_handle *h = PyMem_Calloc(1, sizeof *h);
    PyObject *cap = NULL;
    if (!h || kb_ctx_new(NULL, NULL, &h->ctx) != KB_OK) {
        PyErr_NoMemory();
        goto done;
    }
    kb_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kb_cuda_module_load(h->ctx, ch->cuda, buf.buf, (size_t)buf.len, &h->module);
    Py_END_ALLOW_THREADS
    if (st != KB_OK) {
        kb_py_raise(self, h->ctx, st, NULL);
        goto done;
    }
    h->cuda = ch->cuda;
    h->owner = Py_NewRef(args[0]);
    if ((cap = PyCapsule_New(h, MODULE_CAPSULE, module_capsule_free))) h = NULL;
done:
    if (h) {
        kb_cuda_module_unload(ch->cuda, h->module);
        kb_ctx_free(h->ctx);
        Py_XDECREF(h->owner);
        PyMem_Free(h);
    }
    PyBuffer_Release(&buf);
    return cap;
}

static PyObject *py_get_function(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "get_function(handle, module, name, smem)");
        return NULL;
    }
    cuda_handle *ch = get_cuda(args[0]);
    module_handle *mh = ch ? handle_of(args[1], MODULE_CAPSULE) : NULL;
    const char *name = mh ? PyUnicode_AsUTF8(args[2]) : NULL;
    if (!name) return NULL;
    int smem;
    if (as_int(args[3], &smem) < 0) return NULL;
    if (mh->cuda != ch->cuda) {
        PyErr_SetString(PyExc_ValueError, "get_function: the module was loaded through another handle");
        return NULL;
    }
    kb_ctx *ctx = kb_py_thread_ctx();
    if (!ctx) return NULL;
    void *fn = NULL;
    int regs = 0, spills = 0;
    kb_status st = kb_cuda_function(ctx, ch->cuda, mh->module, name, smem, &fn, &regs, &spills);
    if (st != KB_OK) return kb_py_raise(self, ctx, st, NULL);
    function_handle *fh = PyMem_Calloc(1, sizeof *fh);
    if (!fh) return PyErr_NoMemory();
    *fh = (function_handle){fn, ch->cuda, Py_NewRef(args[1])};
    PyObject *cap = PyCapsule_New(fh, FUNCTION_CAPSULE, function_capsule_free);
    if (!cap) {
        Py_DECREF(fh->owner);
        PyMem_Free(fh);
        return NULL;
    }
    return Py_BuildValue("(Nii)", cap, regs, spills);
}

/* ---------------------------------------------------------------- torch's tensors and streams */

/* launch and synchronize take tensors and torch streams, never addresses: a kernel's pointer
 * is a tensor's own data pointer, its stream torch's stream object's handle. Each is read
 * through torch's base-type descriptor, so neither an instance attribute nor a subclass's
 * property can hand over another value; tensors must be exactly torch.Tensor or Parameter
 * (a subclass's __torch_function__ could answer data_ptr itself). torch is imported on the
 * first call: the rest of kbench._C does not need it. */
/* Where each of torch's objects is found: an attribute of torch, torch.nn, torch._C,
 * torch._C.TensorBase or torch._C._CudaStreamBase. A CPU-only torch lacks the CUDA ones: they
 * are None there, and kb_py_stream_handle says so (lt_check still reads CPU tensors). */
enum { O_TORCH, O_NN, O_C, O_BASE, O_STREAM };
static const struct { int owner; const char *name; int cuda; } torch_names[T_COUNT] = {
    [T_TENSOR] = {O_TORCH, "Tensor", 0},         [T_PARAMETER] = {O_NN, "Parameter", 0},
    [T_DATA_PTR] = {O_BASE, "data_ptr", 0},      [T_IS_CUDA] = {O_BASE, "is_cuda", 0},
    [T_GET_DEVICE] = {O_BASE, "get_device", 0},  [T_STREAM] = {O_C, "_CudaStreamBase", 1},
    [T_CUDA_STREAM] = {O_STREAM, "cuda_stream", 1}, [T_DEVICE_INDEX] = {O_STREAM, "device_index", 1},
    [T_CURRENT_STREAM] = {O_C, "_cuda_getCurrentRawStream", 1},
    [T_SIZE] = {O_BASE, "size", 0},              [T_STRIDE] = {O_BASE, "stride", 0},
    [T_DTYPE] = {O_BASE, "dtype", 0},            [T_F16] = {O_TORCH, "float16", 0},
    [T_BF16] = {O_TORCH, "bfloat16", 0},         [T_F32] = {O_TORCH, "float32", 0},
    [T_U8] = {O_TORCH, "uint8", 0},
};

PyObject *const *kb_py_torch_objects(PyObject *module) {
    kb_module_state *state = kb_py_state(module);
    if (state->torch_objects) return &PyTuple_GET_ITEM(state->torch_objects, 0);
    PyObject *owners[5] = {PyImport_ImportModule("torch"), NULL, NULL, NULL, NULL};
    PyObject *objs = owners[O_TORCH] ? PyTuple_New(T_COUNT) : NULL;
    int ok = objs != NULL;
    if (ok) ok = (owners[O_NN] = PyImport_ImportModule("torch.nn")) && (owners[O_C] = PyObject_GetAttrString(owners[O_TORCH], "_C")) &&
                 (owners[O_BASE] = PyObject_GetAttrString(owners[O_C], "TensorBase"));
    if (ok && !(owners[O_STREAM] = PyObject_GetAttrString(owners[O_C], "_CudaStreamBase"))) {
        ok = PyErr_ExceptionMatches(PyExc_AttributeError);
        PyErr_Clear();
    }
    /* one lookup at a time, none with an exception pending */
    for (int i = 0; ok && i < T_COUNT; i++) {
        PyObject *owner = owners[torch_names[i].owner];
        PyObject *v = owner ? PyObject_GetAttrString(owner, torch_names[i].name) : NULL;
        if (!v && torch_names[i].cuda && (!owner || PyErr_ExceptionMatches(PyExc_AttributeError))) {
            PyErr_Clear();
            v = Py_NewRef(Py_None);
        }
        if (v) PyTuple_SET_ITEM(objs, i, v);
        else ok = 0;
    }
    PyObject *const *T = ok ? &PyTuple_GET_ITEM(objs, 0) : NULL;
    int cuda = T && T[T_STREAM] != Py_None && T[T_CUDA_STREAM] != Py_None && T[T_DEVICE_INDEX] != Py_None &&
               T[T_CURRENT_STREAM] != Py_None;
    if (ok && !(PyType_Check(T[T_TENSOR]) && PyType_Check(T[T_PARAMETER]) && Py_TYPE(T[T_IS_CUDA])->tp_descr_get &&
                Py_TYPE(T[T_DTYPE])->tp_descr_get &&
                (!cuda || (PyType_Check(T[T_STREAM]) && Py_TYPE(T[T_CUDA_STREAM])->tp_descr_get &&
                           Py_TYPE(T[T_DEVICE_INDEX])->tp_descr_get)))) {
        PyErr_SetString(PyExc_RuntimeError, "kbench: torch's tensor and stream types are not as expected");
        ok = 0;
    }
    if (ok && !cuda)   /* all CUDA objects or none */
        for (int i = 0; i < T_COUNT; i++)
            if (torch_names[i].cuda) {
                PyObject *old = PyTuple_GET_ITEM(objs, i);
                PyTuple_SET_ITEM(objs, i, Py_NewRef(Py_None));
                Py_DECREF(old);
            }
    if (ok) state->torch_objects = Py_NewRef(objs);
    Py_XDECREF(objs);
    for (int i = 0; i < 5; i++) Py_XDECREF(owners[i]);
    return state->torch_objects ? &PyTuple_GET_ITEM(state->torch_objects, 0) : NULL;
}

/* descr's value on o, as the base type defines it; -1 with an exception set */
static int long_of(PyObject *descr, PyObject *o, long long *out) {
    PyObject *v = Py_TYPE(descr)->tp_descr_get ? Py_TYPE(descr)->tp_descr_get(descr, o, (PyObject *)Py_TYPE(o))
                                               : NULL;
    if (!v) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "kbench: not a descriptor");
        return -1;
    }
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

int kb_py_tensor_pointer(PyObject *const *T, PyObject *o, const char *what, int *device, uint64_t *out) {
    long long is_cuda, dev;
    if (long_of(T[T_IS_CUDA], o, &is_cuda) < 0) return -1;
    if (!is_cuda) {
        PyErr_Format(PyExc_ValueError, "%s is not a CUDA tensor", what);
        return -1;
    }
    PyObject *v = PyObject_CallOneArg(T[T_GET_DEVICE], o);
    dev = v ? PyLong_AsLongLong(v) : -1;
    Py_XDECREF(v);
    if (dev == -1 && PyErr_Occurred()) return -1;
    if (*device < 0) *device = (int)dev;
    if (dev != *device) {
        PyErr_Format(PyExc_ValueError, "%s is on cuda:%lld, the call on cuda:%d", what, dev, *device);
        return -1;
    }
    v = PyObject_CallOneArg(T[T_DATA_PTR], o);
    unsigned long long p = v ? PyLong_AsUnsignedLongLong(v) : (unsigned long long)-1;
    Py_XDECREF(v);
    if (p == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = p;
    return 0;
}

int kb_py_stream_handle(PyObject *const *T, PyObject *stream, int device, void **out) {
    long long h;
    if (T[T_STREAM] == Py_None) {
        PyErr_SetString(PyExc_RuntimeError, "kbench: this torch has no CUDA (torch._C._CudaStreamBase is missing)");
        return -1;
    }
    if (stream == Py_None) {
        if (device < 0) {
            PyErr_SetString(PyExc_TypeError, "launch: stream=None needs a tensor argument to name the device");
            return -1;
        }
        PyObject *dev = PyLong_FromLong(device);
        PyObject *v = dev ? PyObject_CallOneArg(T[T_CURRENT_STREAM], dev) : NULL;
        Py_XDECREF(dev);
        h = v ? PyLong_AsLongLong(v) : -1;
        Py_XDECREF(v);
        if (h == -1 && PyErr_Occurred()) return -1;
        *out = (void *)(intptr_t)h;
        return 0;
    }
    if (!PyObject_TypeCheck(stream, (PyTypeObject *)T[T_STREAM])) {
        PyErr_Format(PyExc_TypeError, "stream must be a torch.cuda.Stream or None, not %.100s", Py_TYPE(stream)->tp_name);
        return -1;
    }
    long long index;
    if (long_of(T[T_DEVICE_INDEX], stream, &index) < 0 || long_of(T[T_CUDA_STREAM], stream, &h) < 0) return -1;
    if (device >= 0 && index != device) {
        PyErr_Format(PyExc_ValueError, "launch: the stream is on cuda:%lld, the tensors on cuda:%d", index, device);
        return -1;
    }
    *out = (void *)(intptr_t)h;
    return 0;
}

/* ---------------------------------------------------------------- launch */

/* The grid: an int or 1 to 3 ints; -1 with an exception set. */
static int grid_of(PyObject *o, uint32_t grid[3]) {
    grid[0] = grid[1] = grid[2] = 1;
    PyObject *t = PyLong_Check(o) ? PyTuple_Pack(1, o) : kb_py_tuple(o, "launch: grid must be an int or a sequence");
    if (!t) return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    int rc = 0;
    if (n < 1 || n > 3) {
        PyErr_SetString(PyExc_ValueError, "launch: grid has 1 to 3 entries");
        rc = -1;
    }
    for (Py_ssize_t i = 0; rc == 0 && i < n; i++) {
        unsigned long g = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(t, i));
        if (g == (unsigned long)-1 && PyErr_Occurred()) rc = -1;
        else if (g > UINT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "launch: grid entry over 2^32-1");
            rc = -1;
        } else grid[i] = (uint32_t)g;
    }
    Py_DECREF(t);
    return rc;
}

/* launch(handle, fn, grid, block, smem, stream, args) */
static PyObject *py_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "launch(handle, fn, grid, block, smem, stream, args)");
        return NULL;
    }
    function_handle *fh = handle_of(args[1], FUNCTION_CAPSULE);
    cuda_handle *h = fh ? get_cuda(args[0]) : NULL;
    if (!h) return NULL;
    /* a function loaded through another handle of this process is as good: every handle opens
     * the same libcuda and retains the same primary context, and the function keeps its module
     * loaded (executors share kernels: a backward's executor launches the forward's cubins) */
    void *fn = fh->fn;
    uint32_t grid[3];
    if (grid_of(args[2], grid) < 0) return NULL;
    long block = PyLong_AsLong(args[3]);
    if (block == -1 && PyErr_Occurred()) return NULL;
    long smem = PyLong_AsLong(args[4]);
    if (smem == -1 && PyErr_Occurred()) return NULL;
    if (block <= 0 || block > INT32_MAX || smem < 0 || smem > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "launch: bad block %ld or smem %ld", block, smem);
        return NULL;
    }
    PyObject *const *T = kb_py_torch_objects(self);
    if (!T) return NULL;
    /* a tuple of the arguments: reading a tensor's pointer runs torch's code, which must not
     * see a list shrink under this loop */
    PyObject *items = kb_py_tuple(args[6], "launch: args must be a sequence");
    if (!items) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    /* each argument's value in its own 8-byte slot; the driver reads as many bytes as the
     * kernel's parameter has: CUdeviceptr and int64 take 8, float32 takes 4 */
    union { uint64_t u; int64_t i; float f; } vals[MAX_ARGS];
    void *argp[MAX_ARGS + 1];
    size_t bytes = 0;
    int device = -1;
    void *stream = NULL;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *o = PyTuple_GET_ITEM(items, j);
        int is_float = PyFloat_Check(o);
        bytes += is_float ? 4 : 8;
        if (bytes > KB_MAX_PARAM_BYTES) {
            PyErr_Format(PyExc_ValueError, "launch: %zd arguments pass CUDA's %d bytes of kernel parameters", n,
                         KB_MAX_PARAM_BYTES);
            goto fail;
        }
        vals[j].u = 0;
        argp[j] = &vals[j];
        if (o == Py_None) continue;   /* a NULL pointer: an output the entry point does not write */
        if (Py_IS_TYPE(o, (PyTypeObject *)T[T_TENSOR]) || Py_IS_TYPE(o, (PyTypeObject *)T[T_PARAMETER])) {
            char what[48];
            snprintf(what, sizeof what, "launch: args[%zd]", j);
            if (kb_py_tensor_pointer(T, o, what, &device, &vals[j].u) < 0) goto fail;
        } else if (PyLong_CheckExact(o)) {
            vals[j].i = PyLong_AsLongLong(o);
            if (vals[j].i == -1 && PyErr_Occurred()) goto fail;
        } else if (is_float) {
            vals[j].f = (float)PyFloat_AS_DOUBLE(o);
        } else {
            PyErr_Format(PyExc_TypeError, "launch: args[%zd] is a %.100s: a torch.Tensor (its data pointer), None "
                         "(a null pointer), an int (int64) or a float (float32)", j, Py_TYPE(o)->tp_name);
            goto fail;
        }
    }
    argp[n] = NULL;
    if (kb_py_stream_handle(T, args[5], device, &stream) < 0) goto fail;
    Py_DECREF(items);
    kb_ctx *ctx = kb_py_thread_ctx();
    if (!ctx) return NULL;
    kb_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kb_cuda_launch(ctx, h->cuda, fn, grid, (int)block, (int)smem, stream, argp);
    Py_END_ALLOW_THREADS
    if (st != KB_OK) return kb_py_raise(self, ctx, st, NULL);
    Py_RETURN_NONE;
fail:
    Py_DECREF(items);
    return NULL;
}

static PyObject *py_synchronize(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1 && nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "synchronize(handle, stream=None)");
        return NULL;
    }
    cuda_handle *h = get_cuda(args[0]);
    if (!h) return NULL;
    void *stream = NULL;   /* NULL: the whole context */
    if (nargs == 2 && args[1] != Py_None) {
        PyObject *const *T = kb_py_torch_objects(self);
        if (!T || kb_py_stream_handle(T, args[1], -1, &stream) < 0) return NULL;
    }
    kb_ctx *ctx = kb_py_thread_ctx();
    if (!ctx) return NULL;
    kb_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kb_cuda_synchronize(ctx, h->cuda, stream);
    Py_END_ALLOW_THREADS
    if (st != KB_OK) return kb_py_raise(self, ctx, st, NULL);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- launch API (launch_api.h) */

static void *capi_cuda_of(void *capsule) {
    PyObject *o = capsule;
    if (!PyCapsule_IsValid(o, CUDA_CAPSULE)) return NULL;
    return ((cuda_handle *)PyCapsule_GetPointer(o, CUDA_CAPSULE))->cuda;
}

static void *capi_function_of(void *capsule, void *cuda) {
    PyObject *o = capsule;
    if (!PyCapsule_IsValid(o, FUNCTION_CAPSULE)) return NULL;
    function_handle *h = PyCapsule_GetPointer(o, FUNCTION_CAPSULE);
    (void)cuda;   /* any handle of this process (py_launch says why) */
    return h->fn;
}

static int capi_launch(void *cuda, void *fn, const uint32_t grid[3], int block, int smem, void *stream,
                       void **args, char *err, size_t errlen) {
    kb_ctx *ctx = kb_py_thread_ctx_raw();
    if (!ctx) {
        snprintf(err, errlen, "kbench: no thread-local context for a launch");
        return -1;
    }
    if (kb_cuda_launch(ctx, cuda, fn, grid, block, smem, stream, args) == KB_OK) return 0;
    snprintf(err, errlen, "%s", kb_ctx_error(ctx));
    return -1;
}

static int capi_capturing(void *cuda, void *stream, char *err, size_t errlen) {
    kb_ctx *ctx = kb_py_thread_ctx_raw();
    int capturing = 0;
    if (ctx && kb_cuda_stream_capturing(ctx, cuda, stream, &capturing) == KB_OK) return capturing;
    snprintf(err, errlen, "%s", ctx ? kb_ctx_error(ctx) : "kbench: no thread-local context");
    return -1;
}

static const kb_launch_api launch_api = {
    KB_LAUNCH_API_VERSION, sizeof(kb_launch_api), capi_cuda_of, capi_launch, capi_capturing, capi_function_of,
};

static PyObject *py_launch_api(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyCapsule_New((void *)&launch_api, KB_LAUNCH_API_CAPSULE, NULL);
}

PyMethodDef kb_cuda_methods[] = {
    {"launch_api", py_launch_api, METH_NOARGS,
     "launch_api() -> capsule of launch_api.h's kb_launch_api (for kbench._fast, the C++ hot path)"},
    {"nvrtc_open", py_nvrtc_open, METH_O,
     "nvrtc_open(extra_dirs: list[str]) -> handle; FileNotFoundError names every place looked"},
    {"nvrtc_info", py_nvrtc_info, METH_O, "nvrtc_info(handle) -> (path, version as major*1000 + minor*10)"},
    {"nvrtc_include_dir", py_nvrtc_include_dir, METH_O,
     "nvrtc_include_dir(handle) -> the folder passed as -I for cuda_fp16.h/cuda_bf16.h, or None"},
    {"nvrtc_compile", (PyCFunction)(void (*)(void))py_nvrtc_compile, METH_FASTCALL,
     "nvrtc_compile(handle, source, arch, cache_dir_or_None, key=None) -> CUBIN bytes; CompileError(log). "
     "A cache_dir needs key: the secret (16 to 64 bytes) that signs its files"},
    {"cuda_open", py_cuda_open, METH_NOARGS, "cuda_open() -> handle (libcuda.so.1, cuInit)"},
    {"device_info", (PyCFunction)(void (*)(void))py_device_info, METH_FASTCALL,
     "device_info(handle, device) -> dict(sm, num_sms, max_smem_per_block, regs_per_sm, l2_bytes, driver_version)"},
    {"module_load", (PyCFunction)(void (*)(void))py_module_load, METH_FASTCALL,
     "module_load(handle, cubin: bytes) -> module handle (unloaded when collected)"},
    {"get_function", (PyCFunction)(void (*)(void))py_get_function, METH_FASTCALL,
     "get_function(handle, module, name, smem) -> (fn, registers, spill bytes); fn is a function object that "
     "keeps its module loaded"},
    {"launch", (PyCFunction)(void (*)(void))py_launch, METH_FASTCALL,
     "launch(handle, fn, grid, block, smem, stream, args): cuLaunchKernel of fn (get_function's) on stream (a "
     "torch.cuda.Stream, or None: torch's current stream on the tensors' device); args in the kernel's order: a "
     "CUDA tensor passes its data pointer, None a null pointer, an int an int64, a float a float32"},
    {"synchronize", (PyCFunction)(void (*)(void))py_synchronize, METH_FASTCALL,
     "synchronize(handle, stream=None): the stream (a torch.cuda.Stream), or the whole context for None"},
    {NULL, NULL, 0, NULL},
};
