/* launch.cpp — kbench._fast.Launch: one region's kernel bound to one set of sizes, run from C++.
 * Per call only what depends on the tensors is done: the device of the first checked input,
 * contiguity of the inputs not known contiguous, the last dim a multiple of vec where the kernel
 * requires it, 16-byte alignment where the kernel uses vector loads, one allocation per output from torch's caching allocator, and the launch on
 * torch's current stream. The same code serves the Python forward and the autograd backward. */
#include "fast/fast.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <exception>

namespace kbfast {

namespace {

/* kernel arguments in one launch, 8 bytes each: as many as CUDA's parameter space holds (the
 * partitioner keeps every region's kernel within it) */
constexpr int MAX_ARGS = KB_LAUNCH_MAX_PARAM_BYTES / 8;

/* torch's current stream on device, as the driver takes it (NULL: the legacy default). */
void *current_stream(int device) {
    const c10::impl::DeviceGuardImplInterface *impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    return impl->getStream(c10::Device(c10::DeviceType::CUDA, (c10::DeviceIndex)device)).native_handle();
}

std::string region_says(const LaunchSpec &l, int input, const char *what) {
    return "region " + std::to_string(l.region) + ": input " + std::to_string(input) + " " + what;
}

}  // namespace

Outcome run_launch(const LaunchSpec &l, const std::vector<at::Tensor> &in, std::vector<at::Tensor> &outs,
                   std::string &why) {
    // every checked input: a kernel handed a host (or another GPU's) pointer would fault
    for (int j : l.check) {
        const at::Tensor &x = in[j];
        if (!x.is_cuda() || x.get_device() != l.device) {
            why = "the model was optimized for cuda:" + std::to_string(l.device) + "; got a tensor on " +
                  x.device().str() + " (region " + std::to_string(l.region) + ", input " + std::to_string(j) + ")";
            return FALLBACK;
        }
    }
    for (int j : l.check)
        if (!in[j].is_contiguous()) {
            why = region_says(l, j, "is not contiguous");
            return REGION_FALLBACK;
        }
    if (l.last_multiple > 1 && l.last_size % l.last_multiple != 0) {
        why = "region " + std::to_string(l.region) + ": last dim " + std::to_string(l.last_size) +
              " is not a multiple of " + std::to_string(l.last_multiple) + " (kernel uses vec=" + std::to_string(l.vec) +
              ")";
        return REGION_FALLBACK;
    }
    size_t nin = in.size(), nout = l.outs.size();
    size_t nargs = nin + nout + (size_t)l.skipped + l.ints.size() + (l.workspace_bytes ? 1 : 0);
    if (nargs > MAX_ARGS) {
        why = "region " + std::to_string(l.region) + ": more than " + std::to_string(MAX_ARGS) + " kernel arguments";
        return CUDA_FAILED;
    }
    /* each argument in its own 8-byte slot: the driver reads as many bytes as the parameter has */
    uint64_t vals[MAX_ARGS];
    void *argp[MAX_ARGS + 1];
    size_t k = 0;
    for (size_t j = 0; j < nin; j++) {
        uintptr_t p = (uintptr_t)in[j].data_ptr();
        if (l.vec > 1 && (p & 15)) {
            why = region_says(l, (int)j, "is not 16-byte aligned") + " (kernel uses vec=" + std::to_string(l.vec) + ")";
            return REGION_FALLBACK;
        }
        vals[k++] = p;
    }
    size_t first = outs.size();
    at::TensorOptions opts = at::TensorOptions().device(at::Device(at::kCUDA, (c10::DeviceIndex)l.device));
    for (const OutSpec &o : l.outs) {
        outs.push_back(o.like >= 0 ? at::empty_like(in[o.like]) : at::empty(o.shape, opts.dtype(o.dtype)));
        vals[k++] = (uintptr_t)outs.back().data_ptr();
    }
    for (int j = 0; j < l.skipped; j++)
        vals[k++] = (size_t)j < l.scratch.size() ? (uintptr_t)l.scratch[(size_t)j].data_ptr() : 0;
    for (int64_t v : l.ints) vals[k++] = (uint64_t)v;
    void *stream = current_stream(l.device);
    char err[512];
    /* The column-sum partials the finishing kernel adds: one workspace per kernel and stream,
     * kept (launches on one stream run in order, so the next cannot overwrite partials the
     * finishing kernel has yet to read; the lock keeps another thread's pair from coming in
     * between). Under CUDA-graph capture each launch gets its own, from the graph's pool: a
     * replay may overlap work outside the graph. */
    at::Tensor workspace;
    std::unique_lock<std::mutex> held;
    if (l.workspace_bytes) {
        int capturing = api->capturing(l.cuda, stream, err, sizeof err);
        if (capturing < 0) {
            outs.resize(first);
            why = err;
            return CUDA_FAILED;
        }
        if (!capturing) {
            held = std::unique_lock<std::mutex>(l.workspaces->lock);
            for (auto &[s, w] : l.workspaces->by_stream)
                if (s == stream) workspace = w;
        }
        if (!workspace.defined()) {
            workspace = at::empty({l.workspace_bytes}, opts.dtype(at::kByte));
            if (!capturing) l.workspaces->by_stream.emplace_back(stream, workspace);
        }
        vals[k++] = (uintptr_t)workspace.data_ptr();
    }
    for (size_t j = 0; j < k; j++) argp[j] = &vals[j];
    argp[k] = nullptr;
    if (api->launch(l.cuda, l.fn, l.grid, l.block, l.smem, stream, argp, err, sizeof err) != 0 ||
        (l.finish && api->launch(l.cuda, l.finish, l.grid, l.block, 0, stream, argp, err, sizeof err) != 0)) {
        outs.resize(first);
        why = err;
        return CUDA_FAILED;
    }
    for (int j = 0; j < l.skipped; j++) outs.emplace_back();
    return RAN;
}

bool run_from_python(const LaunchSpec &l, const std::vector<at::Tensor> &in, std::vector<at::Tensor> &outs) {
    std::string why;
    Outcome o = RAN;
    std::exception_ptr failed;
    Py_BEGIN_ALLOW_THREADS
    try {
        o = run_launch(l, in, outs, why);
    } catch (...) {
        failed = std::current_exception();
    }
    Py_END_ALLOW_THREADS
    if (failed) std::rethrow_exception(failed);   /* the caller's HANDLE_TH_ERRORS translates it */
    if (o == RAN) return true;
    PyObject *type = o == FALLBACK ? FallbackError : o == REGION_FALLBACK ? RegionFallbackError : CudaError;
    PyErr_SetString(type, why.c_str());
    return false;
}

bool unpack_tensors(PyObject *const *items, Py_ssize_t n, std::vector<at::Tensor> &in, const char *what) {
    in.reserve((size_t)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!THPVariable_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "%s: input %zd is a %.80s, not a tensor", what, i, Py_TYPE(items[i])->tp_name);
            return false;
        }
        in.push_back(THPVariable_Unpack(items[i]));
    }
    return true;
}

int as_ints(PyObject *seq, std::vector<int64_t> &out, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        out.push_back(v);
    }
    Py_DECREF(fast);
    return 0;
}

PyObject *wrap_tensors(std::vector<at::Tensor> &ts, size_t n, bool as_list) {
    PyObject *seq = as_list ? PyList_New((Py_ssize_t)n) : PyTuple_New((Py_ssize_t)n);
    if (!seq) return nullptr;
    for (size_t i = 0; i < n; i++) {
        PyObject *t = THPVariable_Wrap(std::move(ts[i]));   /* None for an undefined one */
        if (!t) {
            Py_DECREF(seq);
            return nullptr;
        }
        if (as_list)
            PyList_SET_ITEM(seq, (Py_ssize_t)i, t);
        else
            PyTuple_SET_ITEM(seq, (Py_ssize_t)i, t);
    }
    return seq;
}

/* ---------------------------------------------------------------- the Python type */

namespace {

/* outs: [(like index or -1, shape, torch.dtype), ...] */
int as_outs(PyObject *seq, std::vector<OutSpec> &out) {
    PyObject *fast = PySequence_Fast(seq, "outs must be a sequence of (like, shape, dtype)");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i), *like, *shape, *dtype;
        if (!PyArg_ParseTuple(item, "OOO", &like, &shape, &dtype)) break;
        if (!THPDtype_Check(dtype)) {
            PyErr_Format(PyExc_TypeError, "outs[%zd]: expected a torch.dtype, got %.80s", i, Py_TYPE(dtype)->tp_name);
            break;
        }
        OutSpec o;
        o.like = (int)PyLong_AsLong(like);
        if (o.like == -1 && PyErr_Occurred()) break;
        if (as_ints(shape, o.shape, "an output's shape must be a sequence of ints") < 0) break;
        o.dtype = ((THPDtype *)dtype)->scalar_type;
        out.push_back(std::move(o));
    }
    Py_DECREF(fast);
    return PyErr_Occurred() ? -1 : 0;
}

/* scratch: CUDA tensors on l.device, contiguous, which the spec keeps alive (tensors, never
 * addresses: a buffer the kernel writes is one this process owns). -1 with an exception set. */
static int as_scratch(PyObject *seq, LaunchSpec &l) {
    THPObjectPtr fast(PySequence_Fast(seq, "Launch: scratch must be a sequence of tensors"));
    if (!fast) return -1;
    std::vector<at::Tensor> ts;
    if (!unpack_tensors(PySequence_Fast_ITEMS(fast.get()), PySequence_Fast_GET_SIZE(fast.get()), ts, "Launch scratch"))
        return -1;
    for (const at::Tensor &t : ts)
        if (!t.is_cuda() || !t.is_contiguous()) {
            PyErr_SetString(PyExc_ValueError, "Launch: a scratch buffer is not a contiguous CUDA tensor");
            return -1;
        }
    l.scratch = std::move(ts);
    return 0;
}

PyObject *launch_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static const char *kwlist[] = {"cuda", "keep", "fn", "finish", "grid", "block", "smem", "device", "region",
                                   "vec", "check", "ints", "workspace_bytes", "outs", "skipped", "scratch",
                                   "last_size", "last_multiple", nullptr};
    PyObject *cuda, *keep, *fn, *finish, *grid, *check, *ints, *outs, *scratch = nullptr;
    int block, smem, device, region, vec, skipped, last_multiple = 1;
    long long workspace_bytes, last_size = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOiiiiiOOLOi|OLi", (char **)kwlist, &cuda, &keep, &fn, &finish,
                                     &grid, &block, &smem, &device, &region, &vec, &check, &ints,
                                     &workspace_bytes, &outs, &skipped, &scratch, &last_size, &last_multiple))
        return nullptr;
    if (last_multiple < 1 || last_size < 0) {
        PyErr_SetString(PyExc_ValueError, "Launch: last_multiple must be >= 1 and last_size >= 0");
        return nullptr;
    }
    if (!api) {
        PyErr_SetString(PyExc_RuntimeError, "kbench._fast.init() has not been called");
        return nullptr;
    }
    Launch *self = (Launch *)type->tp_alloc(type, 0);
    if (!self) return nullptr;
    new (&self->spec) LaunchSpec();
    LaunchSpec &l = self->spec;
    self->keep = Py_BuildValue("(OOOO)", cuda, keep, fn, finish); /* the functions keep their module loaded */
    l.cuda = self->keep ? api->cuda_of(cuda) : nullptr;
    l.fn = l.cuda ? api->function_of(fn, l.cuda) : nullptr;
    l.finish = finish == Py_None || !l.cuda ? nullptr : api->function_of(finish, l.cuda);
    std::vector<int64_t> g, chk;
    if (l.cuda && (!l.fn || (finish != Py_None && !l.finish))) {
        PyErr_SetString(PyExc_TypeError, "Launch: fn and finish must be functions from kbench._C.get_function");
        goto fail;
    }
    if (PyErr_Occurred() || as_ints(grid, g, "grid must be a sequence of ints") < 0 ||
        (scratch && as_scratch(scratch, l) < 0) ||
        as_ints(check, chk, "check must be a sequence of ints") < 0 ||
        as_ints(ints, l.ints, "ints must be a sequence of ints") < 0 || as_outs(outs, l.outs) < 0)
        goto fail;
    if (!l.cuda || !l.fn || g.empty() || g.size() > 3 || block <= 0 || smem < 0 || skipped < 0 ||
        workspace_bytes < 0) {
        PyErr_SetString(PyExc_ValueError, "Launch: needs a cuda handle, a function, 1-3 grid sizes, block > 0, "
                                          "smem, skipped and workspace_bytes >= 0");
        goto fail;
    }
    for (size_t i = 0; i < g.size(); i++) {
        if (g[i] <= 0 || g[i] > UINT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "Launch: a grid size is out of range");
            goto fail;
        }
        l.grid[i] = (uint32_t)g[i];
    }
    for (int64_t c : chk) l.check.push_back((int)c);
    if (l.scratch.size() > (size_t)skipped) {
        PyErr_SetString(PyExc_ValueError, "Launch: more scratch buffers than skipped outputs");
        goto fail;
    }
    for (const at::Tensor &t : l.scratch)
        if (t.get_device() != device) {
            PyErr_SetString(PyExc_ValueError, "Launch: a scratch buffer is on another device than the launch");
            goto fail;
        }
    l.block = block, l.smem = smem, l.device = device, l.region = region, l.vec = vec, l.skipped = skipped;
    l.workspace_bytes = workspace_bytes;
    l.last_size = last_size, l.last_multiple = last_multiple;
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return nullptr;
}

int launch_traverse(Launch *self, visitproc visit, void *arg) {
    Py_VISIT(self->keep);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

int launch_clear(Launch *self) {
    Py_CLEAR(self->keep);
    return 0;
}

void launch_dealloc(Launch *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    launch_clear(self);
    self->spec.~LaunchSpec();
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* run(inputs) -> list of outputs (None for the ones this entry point skips). Raises
 * RegionFallback / Fallback where the call must go to eager, kbench.CudaError where the driver
 * refuses. The GIL is released around the allocations and the launch. */
PyObject *launch_run(Launch *self, PyObject *arg) {
    HANDLE_TH_ERRORS
    THPObjectPtr fast(PySequence_Fast(arg, "run(inputs): inputs must be a list of tensors"));
    std::vector<at::Tensor> in, outs;
    if (!fast || !unpack_tensors(PySequence_Fast_ITEMS(fast.get()), PySequence_Fast_GET_SIZE(fast.get()), in, "run") ||
        !run_from_python(self->spec, in, outs))
        return nullptr;
    return wrap_tensors(outs, outs.size(), true);
    END_HANDLE_TH_ERRORS
}

PyMethodDef launch_methods[] = {
    {"run", (PyCFunction)launch_run, METH_O,
     "run(inputs) -> outputs (a list): checks, allocates, launches on torch's current stream"},
    {nullptr, nullptr, 0, nullptr},
};

PyType_Slot launch_slots[] = {
    {Py_tp_doc, (void *)"A region's kernel bound to one set of sizes (kbench.cuda_backend builds them)."},
    {Py_tp_new, (void *)launch_new},
    {Py_tp_dealloc, (void *)launch_dealloc},
    {Py_tp_traverse, (void *)launch_traverse},
    {Py_tp_clear, (void *)launch_clear},
    {Py_tp_methods, launch_methods},
    {0, nullptr},
};

PyType_Spec launch_spec = {"kbench._fast.Launch", sizeof(Launch), 0,
                           Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, launch_slots};

}  // namespace

PyTypeObject *LaunchType;

int init_launch(PyObject *module) {
    LaunchType = (PyTypeObject *)PyType_FromSpec(&launch_spec);
    if (!LaunchType) return -1;
    Py_INCREF(LaunchType);
    return PyModule_AddObject(module, "Launch", (PyObject *)LaunchType) < 0 ? -1 : 0;
}

}  // namespace kbfast
