/* program.cpp — kbench._fast.Program: an OptimizedModule's whole forward call in C++ for the
 * common case (tensors in, a signature already bound, every region a generated kernel), the
 * guards runtime.OptimizedModule.forward and _run make included. Anything else it declines
 * (returns NotImplemented) before any launch, and the Python path runs as it always did. */
#include "fast/fast.h"

#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <structmember.h>

#include <algorithm>
#include <cstring>
#include <utility>

namespace kbfast {

namespace {

/* A strong reference that an Entry owns (entries are shared with calls in flight, which keep
 * one alive after a clear(); they are created and dropped with the GIL held). */
struct Ref {
    PyObject *o = nullptr;
    Ref() = default;
    explicit Ref(PyObject *x) : o(Py_XNewRef(x)) {}
    Ref(const Ref &) = delete;
    Ref(Ref &&r) noexcept : o(r.o) { r.o = nullptr; }
    Ref &operator=(Ref &&r) noexcept {
        std::swap(o, r.o);
        return *this;
    }
    ~Ref() { Py_XDECREF(o); }
};

/* One step of a bound call: a KERNEL step whose launches are kbench._fast's, or a step whose
 * values the parameter cache holds (runtime/param_cache.py: computed from parameters alone). */
struct StepSpec {
    Ref step;                 /* runtime.Step: step.run(ins) when the launch refuses the inputs */
    Ref launch;               /* Launch: step.launch_nograd or step.launch, what step.run runs (null: cached only) */
    Ref region;               /* Region: step.fast, where gradients flow through the region */
    std::vector<int> ins;     /* slots it reads */
    size_t nouts = 0;         /* slots it appends (its outputs, statistics included) */
    std::vector<int> release; /* slots no later step reads and no output is: dropped after it */
    Py_ssize_t cache = -1;    /* its values' index in the cache's lists (-1: not cached) */
};

/* One input signature (sizes, dtype, device per input) bound by OptimizedModule._bind. */
struct Entry {
    uint64_t hash = 0;
    std::vector<at::ScalarType> dtypes;
    std::vector<size_t> ndims;
    std::vector<int64_t> sizes;   /* every input's sizes, one after another */
    c10::Device device = c10::Device(c10::DeviceType::CPU);
    std::vector<StepSpec> steps;
    std::vector<int> outputs;     /* slots of the graph outputs */
    Ref build;                    /* None: outputs[0] alone (one) or a tuple; else build(list) */
    bool one = false;
    size_t nslots = 0;
    Ref cache;                    /* param_cache.BoundCache, or null */
    bool needs_cache = false;     /* a step only the cache (or the Python path) can run */
};

/* A parameter, buffer or constant input, read through the live module dicts at every call. */
struct ParamChain {
    std::vector<Ref> path;        /* submodule names from the root (empty: the root itself) */
    Ref table;                    /* "_parameters" or "_buffers"; null: a captured constant */
    Ref leaf;
    at::ScalarType dtype = at::kFloat;
    std::vector<int64_t> shape;
};

struct ProgramState {
    std::vector<ParamChain> params;
    std::vector<std::shared_ptr<const Entry>> entries;
    size_t ninputs = 0;
};

struct Program {
    PyObject_HEAD
    PyObject *orig;               /* the original module: the root of every parameter chain */
    PyObject *captured;           /* its .constants hold the lifted constants */
    PyObject *training;           /* the mode the graph was captured in (compared by identity) */
    PyObject *apply_region;       /* runtime.apply_region: a region its Region refuses */
    PyObject *guards;             /* Guards: the Python state the forward read (NULL: none) */
    int grad_ok;                  /* gradients may flow here (no joint program could apply) */
    int autocast_cuda, autocast_cpu; /* the autocast dtype captured under per device type, -1: off */
    Py_ssize_t served, declined;
    const char *why;              /* why the last declined call was declined */
    ProgramState s;
};

PyObject *str_modules, *str_training, *str_constants, *str_run, *str_take;

/* The autocast dtype in force for a device type (its ScalarType), -1 where autocast is off. */
int autocast_now(at::DeviceType device) {
    return at::autocast::is_autocast_enabled(device) ? (int)at::autocast::get_autocast_dtype(device) : -1;
}

uint64_t mix(uint64_t h, uint64_t v) { return (h ^ v) * 0x100000001b3ull; }

/* The tensor behind a Python object, where the object is a plain tensor (or a Parameter): a
 * subclass may give .shape or .device its own meaning, so the Python path decides. */
const at::Tensor *plain_tensor(PyObject *o) {
    if (!THPVariable_CheckExact(o)) return nullptr;
    const at::Tensor &t = THPVariable_Unpack(o);
    if (!t.defined() || t.layout() != c10::kStrided || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides())
        return nullptr;
    return &t;
}

/* obj[key] for a dict (the common case, no exception object made for a miss) or any mapping.
 * New reference, or NULL with no exception set where the key is missing or the lookup fails. */
PyObject *lookup(PyObject *obj, PyObject *key) {
    PyObject *v;
    if (PyDict_CheckExact(obj)) {
        v = PyDict_GetItemWithError(obj, key);
        Py_XINCREF(v);
    } else {
        v = PyObject_GetItem(obj, key);
    }
    if (!v) PyErr_Clear();
    return v;
}

/* What _params() reads for one chain: m = orig; m = m._modules[part] ...; getattr(m, table)[leaf]
 * (or captured.constants[leaf]). New reference, or NULL (no exception set) where Python would
 * raise or fall back: the Python path then does, with its own message. */
PyObject *fetch(Program *self, const ParamChain &c) {
    if (!c.table.o) {
        THPObjectPtr constants(PyObject_GetAttr(self->captured, str_constants));
        if (!constants) {
            PyErr_Clear();
            return nullptr;
        }
        return lookup(constants.get(), c.leaf.o);
    }
    THPObjectPtr m(Py_NewRef(self->orig));
    for (const Ref &part : c.path) {
        THPObjectPtr modules(PyObject_GetAttr(m.get(), str_modules));
        if (!modules) {
            PyErr_Clear();
            return nullptr;
        }
        m = lookup(modules.get(), part.o);
        if (!m) return nullptr;
    }
    THPObjectPtr table(PyObject_GetAttr(m.get(), c.table.o));
    if (!table) {
        PyErr_Clear();
        return nullptr;
    }
    return lookup(table.get(), c.leaf.o);
}

bool same_sizes(const at::Tensor &t, const int64_t *sizes, size_t ndim) {
    if ((size_t)t.dim() != ndim) return false;
    c10::IntArrayRef have = t.sizes();
    for (size_t d = 0; d < ndim; d++)
        if (have[d] != sizes[d]) return false;
    return true;
}

uint64_t signature_hash(const at::Tensor *const *ts, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) {
        h = mix(h, (uint64_t)ts[i]->scalar_type());
        for (int64_t d : ts[i]->sizes()) h = mix(h, (uint64_t)d);
        h = mix(h, (uint64_t)ts[i]->dim());
    }
    return h;
}

bool matches(const Entry &e, uint64_t hash, const at::Tensor *const *ts, size_t n) {
    if (e.hash != hash) return false;
    const int64_t *sizes = e.sizes.data();
    for (size_t i = 0; i < n; i++) {
        if (ts[i]->scalar_type() != e.dtypes[i] || ts[i]->device() != e.device ||
            !same_sizes(*ts[i], sizes, e.ndims[i]))
            return false;
        sizes += e.ndims[i];
    }
    return true;
}

PyObject *decline(Program *self, const char *why) {
    self->declined++;
    self->why = why;
    Py_RETURN_NOTIMPLEMENTED;
}

/* A Python fallback's outputs appended to slots (None: undefined); -1 with an exception set. */
int append_outputs(PyObject *got, size_t want, std::vector<at::Tensor> &slots) {
    THPObjectPtr fast(PySequence_Fast(got, "kbench: a region's fallback must return a sequence"));
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast.get());
    if ((size_t)n > want) {
        PyErr_Format(PyExc_RuntimeError, "kbench: a region's fallback returned %zd outputs for %zu slots", n, want);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(fast.get(), i);
        if (o == Py_None) {
            slots.emplace_back();
        } else if (THPVariable_Check(o)) {
            slots.push_back(THPVariable_Unpack(o));
        } else {
            PyErr_SetString(PyExc_TypeError, "kbench: a region's fallback returned a non-tensor");
            return -1;
        }
    }
    /* the statistics slots apply_region's outputs leave out (runtime: step.no_stats) */
    for (size_t i = (size_t)n; i < want; i++) slots.emplace_back();
    return 0;
}

/* One KERNEL step, as _run runs it. A launch refuses (RegionFallback) before it allocates or
 * launches anything, so the Python fallback that then runs (step.run, which tries the same
 * launch, is refused the same way, notes why and runs the region in eager; or apply_region,
 * RegionFunction's node around the same) starts from exactly the state the Python path has. */
bool run_step(Program *self, const StepSpec &st, bool grad, std::vector<at::Tensor> &ins,
              std::vector<at::Tensor> &slots) {
    bool wants = false;
    if (grad)
        for (const at::Tensor &x : ins) wants |= x.requires_grad();
    bool ok = wants ? region_forward(st.region.o, ins, slots) : run_from_python(((Launch *)st.launch.o)->spec, ins, slots);
    if (ok) return true;
    if (!PyErr_ExceptionMatches(RegionFallbackError)) return false;   /* Fallback, CudaError: as Python */
    PyErr_Clear();
    THPObjectPtr got;
    if (wants) {   /* apply_region(step, *ins) */
        if (!self->apply_region) {
            PyErr_SetString(PyExc_RuntimeError, "kbench: the Program was cleared");
            return false;
        }
        THPObjectPtr call(PyTuple_New((Py_ssize_t)ins.size() + 1));
        if (!call) return false;
        PyTuple_SET_ITEM(call.get(), 0, Py_NewRef(st.step.o));
        for (size_t i = 0; i < ins.size(); i++) {
            PyObject *x = THPVariable_Wrap(ins[i]);   /* the very object, where it has one */
            if (!x) return false;
            PyTuple_SET_ITEM(call.get(), (Py_ssize_t)i + 1, x);
        }
        got = PyObject_Call(self->apply_region, call.get(), nullptr);
    } else {       /* step.run(ins) */
        std::vector<at::Tensor> copy(ins);
        THPObjectPtr list(wrap_tensors(copy, copy.size(), true));
        if (!list) return false;
        got = PyObject_CallMethodOneArg(st.step.o, str_run, list.get());
    }
    return got && append_outputs(got.get(), st.nouts, slots) == 0;
}

/* The forward's result for module(*inputs), or NotImplemented where the Python path must run.
 * The checks, in _run's order: the inputs (plain tensors, as many as captured, a bound
 * signature), the train/eval mode, the Python state the forward read (Guards), each parameter or buffer (present, a plain tensor, its
 * captured dtype and shape, on the inputs' device), whether gradients are wanted where only
 * the joint program may run them. Nothing is launched before all of them pass. */
PyObject *run(Program *self, PyObject *module, PyObject *const *inputs, size_t n) {
    HANDLE_TH_ERRORS
    if (n == 0 || n != self->s.ninputs) return decline(self, "not as many inputs as captured");
    const at::Tensor *few[64], **ts = few;   /* on the stack for the usual few inputs, any number on the heap */
    std::vector<const at::Tensor *> many;
    if (n > 64) many.resize(n), ts = many.data();
    for (size_t i = 0; i < n; i++)
        if (!(ts[i] = plain_tensor(inputs[i]))) return decline(self, "an input is not a plain tensor");
    /* a copy of the entry's pointer: a launch releases the GIL, and another thread may clear
     * or replace the entries meanwhile */
    std::shared_ptr<const Entry> held;
    uint64_t hash = signature_hash(ts, n);
    for (const auto &e : self->s.entries)
        if (matches(*e, hash, ts, n)) {
            held = e;
            break;
        }
    if (!held) return decline(self, "no bound signature matches");
    const Entry &e = *held;
    {
        THPObjectPtr training(PyObject_GetAttr(module, str_training));
        if (!training) {
            PyErr_Clear();
            return decline(self, "the module has no training flag");
        }
        if (training.get() != self->training) return decline(self, "the train/eval mode differs from the captured one");
    }
    if (self->guards && guards_failing(self->guards) >= 0)
        return decline(self, "the Python state the forward read changed");
    if (autocast_now(at::kCUDA) != self->autocast_cuda || autocast_now(at::kCPU) != self->autocast_cpu)
        return decline(self, "autocast differs from the captured one");
    std::vector<at::Tensor> slots;
    slots.reserve(e.nslots);
    for (size_t i = 0; i < n; i++) slots.push_back(*ts[i]);
    for (const ParamChain &c : self->s.params) {
        THPObjectPtr t(fetch(self, c));
        const at::Tensor *p = t ? plain_tensor(t.get()) : nullptr;
        if (!p) return decline(self, "a parameter or buffer is gone, None or not a plain tensor");
        if (p->scalar_type() != c.dtype || p->device() != e.device || !same_sizes(*p, c.shape.data(), c.shape.size()))
            return decline(self, "a parameter or buffer changed dtype, shape or device");
        slots.push_back(*p);
    }
    bool grad = false;
    if (c10::GradMode::is_enabled())
        for (const at::Tensor &t : slots) grad |= t.requires_grad();
    if (grad && !self->grad_ok) return decline(self, "gradients wanted where a joint program may apply");

    /* a call that records no history reads the values computed from parameters alone from the
     * cache: cache.take(params) computes those whose parameters changed, and gives the lists of
     * values (None: this call computes them itself, inside a caller's CUDA-graph capture) */
    THPObjectPtr lists;
    if (e.cache.o && !grad) {
        size_t np = self->s.params.size();
        THPObjectPtr params(PyTuple_New((Py_ssize_t)np));
        if (!params) return nullptr;
        for (size_t i = 0; i < np; i++) {
            PyObject *p = THPVariable_Wrap(slots[n + i]);
            if (!p) return nullptr;
            PyTuple_SET_ITEM(params.get(), (Py_ssize_t)i, p);
        }
        THPObjectPtr got(PyObject_CallMethodOneArg(e.cache.o, str_take, params.get()));
        if (!got) return nullptr;
        if (got.get() != Py_None) {
            if (!PyList_Check(got.get())) {
                PyErr_SetString(PyExc_TypeError, "kbench: a parameter cache's take() must return a list or None");
                return nullptr;
            }
            lists = std::move(got);
        }
    }
    if (e.needs_cache && !lists)
        return decline(self, "values computed from parameters alone are computed by the Python path here");

    std::vector<at::Tensor> ins;
    for (const StepSpec &st : e.steps) {
        if (lists && st.cache >= 0) {
            if (st.cache >= PyList_GET_SIZE(lists.get())) {
                PyErr_SetString(PyExc_RuntimeError, "kbench: a parameter cache holds fewer values than its steps");
                return nullptr;
            }
            if (append_outputs(PyList_GET_ITEM(lists.get(), st.cache), st.nouts, slots) < 0) return nullptr;
        } else {
            ins.clear();
            for (int i : st.ins) ins.push_back(slots[(size_t)i]);
            if (!run_step(self, st, grad, ins, slots)) return nullptr;
            ins.clear();
        }
        for (int i : st.release) slots[(size_t)i].reset();
    }
    self->served++;
    if (e.one) return THPVariable_Wrap(slots[(size_t)e.outputs[0]]);
    std::vector<at::Tensor> outs;
    outs.reserve(e.outputs.size());
    for (int i : e.outputs) outs.push_back(slots[(size_t)i]);
    if (e.build.o == Py_None) return wrap_tensors(outs, outs.size(), false);
    THPObjectPtr list(wrap_tensors(outs, outs.size(), true));
    return list ? PyObject_CallOneArg(e.build.o, list.get()) : nullptr;
    END_HANDLE_TH_ERRORS
}

/* call(module, args): run() on a tuple of inputs. */
PyObject *program_call(Program *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "call(module, args): args must be a tuple");
        return nullptr;
    }
    return run(self, args[0], PySequence_Fast_ITEMS(args[1]), (size_t)PyTuple_GET_SIZE(args[1]));
}

/* ---------------------------------------------------------------- building */

int parse_ints(PyObject *seq, std::vector<int> &out, const char *what) {
    std::vector<int64_t> v;
    if (as_ints(seq, v, what) < 0) return -1;
    for (int64_t x : v) out.push_back((int)x);
    return 0;
}

/* add(args, steps, outputs, build, cache=None) -> True, or False where this call's shape of program
 * is not one it runs (the entry is not added; the Python path keeps serving the signature).
 * args: the inputs the signature is taken from; steps: [(step, launch, region, ins, nouts[, c])],
 * c the step's index in the cache's lists (launch and region None: only the cache runs it);
 * outputs: the graph outputs' slots; build: "one" (outputs[0] itself), "tuple", or a callable
 * making the result from the list of outputs; cache: the bound's param_cache.BoundCache. */
PyObject *program_add(Program *self, PyObject *a) {
    HANDLE_TH_ERRORS
    PyObject *args, *steps, *outputs, *build, *cache = Py_None;
    if (!PyArg_ParseTuple(a, "O!OOO|O", &PyTuple_Type, &args, &steps, &outputs, &build, &cache)) return nullptr;
    auto e = std::make_shared<Entry>();
    size_t n = (size_t)PyTuple_GET_SIZE(args);
    if (n == 0 || n != self->s.ninputs) Py_RETURN_FALSE;
    std::vector<const at::Tensor *> ts(n);
    for (size_t i = 0; i < n; i++) {
        if (!(ts[i] = plain_tensor(PyTuple_GET_ITEM(args, (Py_ssize_t)i)))) Py_RETURN_FALSE;
        if (ts[i]->device() != ts[0]->device()) Py_RETURN_FALSE;   /* _run falls back: Python says why */
        e->dtypes.push_back(ts[i]->scalar_type());
        e->ndims.push_back((size_t)ts[i]->dim());
        for (int64_t d : ts[i]->sizes()) e->sizes.push_back(d);
    }
    e->hash = signature_hash(ts.data(), n);
    e->device = ts[0]->device();
    /* slots: inputs, parameters, then each step's outputs; a statistic's slot may be left
     * undefined, so nothing may read one */
    size_t nslots = n + self->s.params.size();
    std::vector<bool> maybe_empty(nslots, false);
    THPObjectPtr fsteps(PySequence_Fast(steps, "steps must be a sequence"));
    if (!fsteps) return nullptr;
    for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(fsteps.get()); k++) {
        PyObject *step, *launch, *region, *ins;
        Py_ssize_t nouts, cached = -1;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fsteps.get(), k), "OOOOn|n", &step, &launch, &region, &ins,
                              &nouts, &cached))
            return nullptr;
        bool only_cached = launch == Py_None && region == Py_None;
        if (only_cached ? cached < 0 || cache == Py_None
                        : Py_TYPE(launch) != LaunchType || Py_TYPE(region) != RegionType) {
            PyErr_SetString(PyExc_TypeError, "add: a step is (step, Launch, Region, ins, nouts[, cache index]), or "
                                             "(step, None, None, ins, nouts, cache index) with a cache");
            return nullptr;
        }
        StepSpec st;
        st.step = Ref(step), st.nouts = (size_t)nouts, st.cache = cache == Py_None ? -1 : cached;
        if (parse_ints(ins, st.ins, "a step's slots must be a sequence of ints") < 0) return nullptr;
        if (nouts < 0) {
            PyErr_SetString(PyExc_ValueError, "add: a step's slot count is negative");
            return nullptr;
        }
        size_t empty_from = st.nouts;
        if (only_cached) {
            e->needs_cache = true;
        } else {
            st.launch = Ref(launch), st.region = Ref(region);
            size_t rin, rreal, rsaved;
            region_arity(region, rin, rreal, rsaved);
            const LaunchSpec &l = ((Launch *)launch)->spec;
            if (rin != st.ins.size() || rreal + rsaved != st.nouts || l.outs.size() + (size_t)l.skipped != st.nouts) {
                PyErr_SetString(PyExc_ValueError, "add: a step's launch, region and slot counts disagree");
                return nullptr;
            }
            /* the trailing outputs a launch skips, or a Region keeps for its node, stay empty */
            empty_from = st.nouts - std::max((size_t)l.skipped, rsaved);
        }
        for (int i : st.ins)
            if (i < 0 || (size_t)i >= nslots || maybe_empty[(size_t)i]) Py_RETURN_FALSE;
        for (size_t j = 0; j < st.nouts; j++) maybe_empty.push_back(j >= empty_from);
        nslots += st.nouts;
        e->steps.push_back(std::move(st));
    }
    if (parse_ints(outputs, e->outputs, "outputs must be a sequence of slots") < 0) return nullptr;
    if (e->outputs.empty()) Py_RETURN_FALSE;
    for (int i : e->outputs)
        if (i < 0 || (size_t)i >= nslots || maybe_empty[(size_t)i]) Py_RETURN_FALSE;
    if (PyUnicode_Check(build) && PyUnicode_CompareWithASCIIString(build, "one") == 0) {
        e->one = true;
        e->build = Ref(Py_None);
    } else if (PyUnicode_Check(build) && PyUnicode_CompareWithASCIIString(build, "tuple") == 0) {
        e->build = Ref(Py_None);
    } else if (PyCallable_Check(build)) {
        e->build = Ref(build);
    } else {
        PyErr_SetString(PyExc_TypeError, "add: build must be 'one', 'tuple' or a callable");
        return nullptr;
    }
    e->nslots = nslots;
    if (cache != Py_None) e->cache = Ref(cache);
    /* a call holds only live values: each slot is dropped after its last reader (autograd keeps
     * what a backward needs by itself) */
    std::vector<int> last(nslots, -1);
    size_t made = n + self->s.params.size();
    for (size_t k = 0; k < e->steps.size(); k++) {
        /* a value nothing reads (a statistic only a backward wants) goes right after its step */
        for (size_t j = 0; j < e->steps[k].nouts; j++) last[made++] = (int)k;
        for (int i : e->steps[k].ins) last[(size_t)i] = (int)k;
    }
    for (int i : e->outputs) last[(size_t)i] = -1;
    for (size_t i = 0; i < nslots; i++)
        if (last[i] >= 0) e->steps[(size_t)last[i]].release.push_back((int)i);
    /* a signature bound again (after the Python table was cleared) replaces the old entry */
    auto &entries = self->s.entries;
    for (auto it = entries.begin(); it != entries.end(); ++it)
        if (matches(**it, e->hash, ts.data(), n)) {
            entries.erase(it);
            break;
        }
    entries.push_back(std::move(e));
    Py_RETURN_TRUE;
    END_HANDLE_TH_ERRORS
}

/* clear(): forget every bound signature (OptimizedModule._bind clears its own table too). */
PyObject *program_clear_entries(Program *self, PyObject *) {
    self->s.entries.clear();
    Py_RETURN_NONE;
}

PyObject *program_entries(Program *self, void *) { return PyLong_FromSize_t(self->s.entries.size()); }

PyObject *program_why(Program *self, void *) {
    if (!self->why) Py_RETURN_NONE;
    return PyUnicode_FromString(self->why);
}

/* Program(orig, captured, ninputs, chains, meta, training, grad_ok, apply_region, guards=None, autocast=())
 * chains: per parameter/buffer/constant input, (path, table, leaf) as
 * OptimizedModule._param_chains gives them (path None: captured.constants[leaf]);
 * meta: (name, dtype, shape) per chain as captured; guards: a Guards, checked per call;
 * autocast: ((device type, dtype), ...) as capture/modes.py's autocast_mode() gave it at capture. */
PyObject *program_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static const char *kwlist[] = {"orig", "captured", "ninputs", "chains", "meta", "training", "grad_ok",
                                   "apply_region", "guards", "autocast", nullptr};
    PyObject *orig, *captured, *chains, *meta, *training, *apply_region, *guards = Py_None, *autocast = nullptr;
    Py_ssize_t ninputs;
    int grad_ok;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOnOOOpO|OO", (char **)kwlist, &orig, &captured, &ninputs, &chains,
                                     &meta, &training, &grad_ok, &apply_region, &guards, &autocast))
        return nullptr;
    if (guards != Py_None && Py_TYPE(guards) != GuardsType) {
        PyErr_SetString(PyExc_TypeError, "Program: guards must be a kbench._fast.Guards or None");
        return nullptr;
    }
    int autocast_cuda = -1, autocast_cpu = -1;
    if (autocast) {
        THPObjectPtr modes(PySequence_Fast(autocast, "Program: autocast must be a sequence"));
        if (!modes) return nullptr;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(modes.get()); i++) {
            const char *device;
            PyObject *dtype;
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(modes.get(), i), "sO!", &device, &THPDtypeType, &dtype))
                return nullptr;
            int code = (int)((THPDtype *)dtype)->scalar_type;
            if (strcmp(device, "cuda") == 0) autocast_cuda = code;
            else if (strcmp(device, "cpu") == 0) autocast_cpu = code;
            else {
                PyErr_Format(PyExc_ValueError, "Program: autocast on device type %s", device);
                return nullptr;
            }
        }
    }
    if (!PyCallable_Check(apply_region) || ninputs < 0) {
        PyErr_SetString(PyExc_TypeError, "Program: apply_region must be callable and ninputs >= 0");
        return nullptr;
    }
    THPObjectPtr fchains(PySequence_Fast(chains, "Program: chains must be a sequence"));
    THPObjectPtr fmeta(PySequence_Fast(meta, "Program: meta must be a sequence"));
    if (!fchains || !fmeta) return nullptr;
    Py_ssize_t np = PySequence_Fast_GET_SIZE(fchains.get());
    if (PySequence_Fast_GET_SIZE(fmeta.get()) != np) {
        PyErr_SetString(PyExc_ValueError, "Program: one meta entry per chain");
        return nullptr;
    }
    Program *self = (Program *)type->tp_alloc(type, 0);
    if (!self) return nullptr;
    new (&self->s) ProgramState();
    self->orig = Py_NewRef(orig);
    self->captured = Py_NewRef(captured);
    self->training = Py_NewRef(training);
    self->apply_region = Py_NewRef(apply_region);
    self->guards = guards == Py_None ? nullptr : Py_NewRef(guards);
    self->grad_ok = grad_ok;
    self->autocast_cuda = autocast_cuda;
    self->autocast_cpu = autocast_cpu;
    self->s.ninputs = (size_t)ninputs;
    for (Py_ssize_t i = 0; i < np; i++) {
        PyObject *path, *table, *leaf, *name, *dtype, *shape;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fchains.get(), i), "OOU", &path, &table, &leaf) ||
            !PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fmeta.get(), i), "OOO", &name, &dtype, &shape))
            goto fail;
        if (!THPDtype_Check(dtype) || (path == Py_None) != (table == Py_None) ||
            (table != Py_None && !PyUnicode_Check(table))) {
            PyErr_SetString(PyExc_TypeError, "Program: a chain is (path, table, leaf) with path and table both "
                                             "None or a tuple of names and a name; meta has a torch.dtype");
            goto fail;
        }
        ParamChain c;
        c.leaf = Ref(leaf);
        if (table != Py_None) {
            c.table = Ref(table);
            THPObjectPtr fpath(PySequence_Fast(path, "Program: a chain's path must be a sequence of names"));
            if (!fpath) goto fail;
            for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(fpath.get()); k++) {
                PyObject *part = PySequence_Fast_GET_ITEM(fpath.get(), k);
                if (!PyUnicode_Check(part)) {
                    PyErr_SetString(PyExc_TypeError, "Program: a chain's path must be a sequence of names");
                    goto fail;
                }
                c.path.emplace_back(part);
            }
        }
        c.dtype = ((THPDtype *)dtype)->scalar_type;
        if (as_ints(shape, c.shape, "Program: a shape must be a sequence of ints") < 0) goto fail;
        self->s.params.push_back(std::move(c));
    }
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return nullptr;
}

int program_traverse(Program *self, visitproc visit, void *arg) {
    Py_VISIT(self->orig);
    Py_VISIT(self->captured);
    Py_VISIT(self->apply_region);
    Py_VISIT(self->guards);
    for (const auto &e : self->s.entries) {
        for (const StepSpec &st : e->steps) {
            Py_VISIT(st.step.o);
            Py_VISIT(st.launch.o);
            Py_VISIT(st.region.o);
        }
        Py_VISIT(e->build.o);
        Py_VISIT(e->cache.o);
    }
    Py_VISIT(Py_TYPE(self));
    return 0;
}

int program_clear(Program *self) {
    /* the entries hold the Steps, whose owner holds this Program: the cycle is broken here */
    self->s.entries.clear();
    Py_CLEAR(self->orig);
    Py_CLEAR(self->captured);
    Py_CLEAR(self->apply_region);
    Py_CLEAR(self->guards);
    return 0;
}

void program_dealloc(Program *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    program_clear(self);
    Py_CLEAR(self->training);
    self->s.~ProgramState();
    tp->tp_free(self);
    Py_DECREF(tp);
}

PyMethodDef program_methods[] = {
    {"call", (PyCFunction)(void (*)(void))program_call, METH_FASTCALL,
     "call(module, args) -> the forward's result, or NotImplemented where the Python path must run"},
    {"add", (PyCFunction)program_add, METH_VARARGS,
     "add(args, steps, outputs, build, cache=None) -> whether the signature of args is now served from C++"},
    {"clear", (PyCFunction)program_clear_entries, METH_NOARGS, "clear(): forget every bound signature"},
    {nullptr, nullptr, 0, nullptr},
};

PyMemberDef program_members[] = {
    {"served", T_PYSSIZET, offsetof(Program, served), READONLY, "calls run from C++"},
    {"declined", T_PYSSIZET, offsetof(Program, declined), READONLY, "calls left to the Python path"},
    {nullptr, 0, 0, 0, nullptr},
};

PyGetSetDef program_getset[] = {
    {"entries", (getter)program_entries, nullptr, "bound signatures served from C++", nullptr},
    {"why", (getter)program_why, nullptr, "why the last declined call was declined (None: none was)", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyType_Slot program_slots[] = {
    {Py_tp_doc, (void *)"An OptimizedModule's forward call in C++ for its common case (kbench.runtime builds it)."},
    {Py_tp_new, (void *)program_new},
    {Py_tp_dealloc, (void *)program_dealloc},
    {Py_tp_traverse, (void *)program_traverse},
    {Py_tp_clear, (void *)program_clear},
    {Py_tp_methods, program_methods},
    {Py_tp_members, program_members},
    {Py_tp_getset, program_getset},
    {0, nullptr},
};

PyType_Spec program_spec = {"kbench._fast.Program", sizeof(Program), 0,
                            Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, program_slots};

}  // namespace

PyTypeObject *ProgramType;

PyObject *program_run(PyObject *program, PyObject *module, PyObject *const *inputs, size_t n) {
    return run((Program *)program, module, inputs, n);
}

int init_program(PyObject *module) {
    for (auto [ptr, name] : {std::pair{&str_modules, "_modules"}, {&str_training, "training"},
                             {&str_constants, "constants"}, {&str_run, "run"}, {&str_take, "take"}})
        if (!*ptr && !(*ptr = PyUnicode_InternFromString(name))) return -1;
    ProgramType = (PyTypeObject *)PyType_FromSpec(&program_spec);
    if (!ProgramType) return -1;
    Py_INCREF(ProgramType);
    return PyModule_AddObject(module, "Program", (PyObject *)ProgramType) < 0 ? -1 : 0;
}

}  // namespace kbfast
