/* region.cpp — kbench._fast.Region: a compute region as an autograd node in C++.
 * apply() runs the region's forward kernel and, where gradients are wanted, records a
 * RegionNode holding the region's inputs (saved as torch saves them, version-checked) and the
 * row statistics the forward wrote. The node's backward runs the region's generated backward
 * kernels from C++ on autograd's device thread, with no Python and no GIL, once Python has
 * built, checked and registered that backward for the set of inputs that want gradients.
 * Anything else (the first backward of a pattern, create_graph, an eager region, a check a
 * launch refuses) goes through the Python backward the region was made with. */
#include "fast/fast.h"

#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>

namespace kbfast {

namespace ag = torch::autograd;

namespace {

#if PY_VERSION_HEX >= 0x030D0000
#define KB_FINALIZING() Py_IsFinalizing()
#else
#define KB_FINALIZING() _Py_IsFinalizing()
#endif

/* A region's generated backward for one pattern of inputs wanting gradients, bound to the
 * forward's sizes: the steps over value slots (inputs, statistics, upstream gradients, then
 * each step's outputs), the slots holding the gradients, and which gradients torch gives as
 * None (inputs the outputs do not depend on). */
struct BackwardProgram {
    struct Step {
        const LaunchSpec *launch;   /* owned by a Launch the Region keeps alive */
        std::vector<int> ins;
    };
    std::vector<Step> steps;
    std::vector<int> outputs;       /* one per input that wants a gradient, in input order */
    std::vector<bool> drop;         /* per input */
};

/* A Region's C++ state, constructed in place in the Python object (as Launch's LaunchSpec). */
struct RegionState {
    int ninputs = 0, nsaved = 0;
    std::vector<bool> float_in;     /* per input: may get a gradient */
    std::vector<OutSpec> outs;      /* the real outputs (statistics excluded): zero gradients */
    std::vector<int> reads;         /* the real outputs the backward reads (after the statistics) */
    std::mutex lock;                /* programs are registered under the GIL, read without it */
    /* by the inputs that want a gradient (one flag per input, however many: std::hash has them) */
    std::unordered_map<std::vector<bool>, std::shared_ptr<const BackwardProgram>> programs;
};

struct Region {
    PyObject_HEAD
    PyObject *launch;               /* Launch: writes the row statistics the backward reads */
    PyObject *launch_nograd;        /* Launch without them (no backward follows), or None */
    PyObject *py_backward;          /* (saved, grads, need) -> gradients; registers programs */
    PyObject *keep;                 /* list: the Launch objects the programs point into */
    RegionState s;
};

const LaunchSpec &spec_of(PyObject *launch) { return ((Launch *)launch)->spec; }

/* The pending Python exception as a C++ one: autograd's engine hands it to the thread that
 * called backward, where torch raises it again as it was. Needs the GIL. */
[[noreturn]] void rethrow_python() {
    python_error e;
    e.persist();
    throw std::move(e);
}

/* Drops a Python reference from a thread that may not hold the GIL. */
void decref_anywhere(PyObject *o) {
    if (!o || !Py_IsInitialized() || KB_FINALIZING()) return;
    PyGILState_STATE g = PyGILState_Ensure();
    Py_DECREF(o);
    PyGILState_Release(g);
}

/* The node: one per forward call that wants gradients. */
struct RegionNode final : ag::Node {
    Region *region;                          /* strong reference */
    std::vector<ag::SavedVariable> saved;    /* the region's inputs */
    std::vector<at::Tensor> stats;           /* the row statistics the forward wrote */
    /* the outputs the backward reads, detached (no cycle through this node; the version counter
     * is shared) with their versions then: changed in place since, they fail the backward as a
     * saved output does in torch */
    std::vector<std::pair<at::Tensor, uint32_t>> outs_read;
    std::vector<int> grad_slot;              /* per real output: its gradient's index, or -1 */
    bool released = false;

    explicit RegionNode(Region *r) : region(r) { Py_INCREF(r); }
    ~RegionNode() override { decref_anywhere((PyObject *)region); }
    std::string name() const override { return "KbenchRegionBackward"; }
    void release_variables() override {
        for (auto &s : saved) s.reset_data();
        stats.clear();
        outs_read.clear();
        released = true;
    }
    ag::variable_list apply(ag::variable_list &&grads) override;

    ag::variable_list python_backward(const std::vector<at::Tensor> &inputs, const ag::variable_list &grads,
                                      const std::vector<bool> &need);
    void check_outs_read() const;
};

/* torch's message for a saved output changed in place. Sizes are written out by hand: streaming
 * an IntArrayRef from this extension crashed on the GPU machine's torch (2.11). */
void RegionNode::check_outs_read() const {
    for (size_t k = 0; k < outs_read.size(); k++) {
        const at::Tensor &t = outs_read[k].first;
        if (t._version() == (int64_t)outs_read[k].second) continue;
        std::string sizes;
        for (int64_t d = 0; d < t.dim(); d++) sizes += (d ? ", " : "") + std::to_string(t.size(d));
        TORCH_CHECK(false, "one of the variables needed for gradient computation has been modified by an inplace "
                           "operation: [" + t.toString() + " [" + sizes + "]], which is output " +
                           std::to_string(region->s.reads[k]) + " of KbenchRegionBackward, is at version " +
                           std::to_string(t._version()) + "; expected version " +
                           std::to_string(outs_read[k].second) + " instead.");
    }
}

/* Nodes are shared_ptr (torch <= 2.12) or intrusive_ptr (2.13+): whichever an Edge holds. */
using NodePtr = decltype(ag::Edge::function);

template <typename T>
auto make_node(std::shared_ptr<ag::Node> *, Region *r) { return std::shared_ptr<T>(new T(r)); }
template <typename T>
auto make_node(c10::intrusive_ptr<ag::Node> *, Region *r) { return c10::make_intrusive<T>(r); }

ag::variable_list RegionNode::apply(ag::variable_list &&grads) {
    Region *r = region;
    size_t nin = (size_t)r->s.ninputs;
    std::vector<bool> need(nin);
    bool any = false;
    for (size_t i = 0; i < nin; i++) {
        need[i] = r->s.float_in[i] && task_should_compute_output(i);
        any |= need[i];
    }
    ag::variable_list result(nin);
    if (!any) return result;
    TORCH_CHECK(!released, "Trying to backward through the graph a second time (or directly access saved tensors "
                           "after they have already been freed). Specify retain_graph=True if you need to backward "
                           "a second time or access saved tensors after calling backward.");
    std::vector<at::Tensor> inputs;
    inputs.reserve(nin);
    for (auto &s : saved) inputs.push_back(s.unpack());
    check_outs_read();

    std::shared_ptr<const BackwardProgram> prog;
    if (!c10::GradMode::is_enabled()) {   /* create_graph: Python, differentiably */
        std::lock_guard<std::mutex> g(r->s.lock);
        auto it = r->s.programs.find(need);
        if (it != r->s.programs.end()) prog = it->second;
    }
    if (!prog) return python_backward(inputs, grads, need);

    std::vector<at::Tensor> slots(inputs);
    slots.insert(slots.end(), stats.begin(), stats.end());
    for (const auto &o : outs_read) slots.push_back(o.first);
    for (size_t k = 0; k < grad_slot.size(); k++) {
        const OutSpec &o = r->s.outs[k];
        at::Tensor g = grad_slot[k] >= 0 ? grads[(size_t)grad_slot[k]] : at::Tensor();
        if (!g.defined())
            g = at::zeros(o.shape, inputs[0].options().dtype(o.dtype));
        else if (!g.is_contiguous())
            g = g.contiguous();
        slots.push_back(std::move(g));
    }
    std::vector<at::Tensor> ins;
    std::string why;
    for (const auto &step : prog->steps) {
        ins.clear();
        for (int s : step.ins) ins.push_back(slots[(size_t)s]);
        if (run_launch(*step.launch, ins, slots, why) != RAN)
            return python_backward(inputs, grads, need);   /* it notes why and runs eager */
    }
    for (size_t i = 0, k = 0; i < nin; i++)
        if (need[i]) {
            at::Tensor g = slots[(size_t)prog->outputs[k++]];
            if (!prog->drop[i]) result[i] = std::move(g);
        }
    return result;
}

ag::variable_list RegionNode::python_backward(const std::vector<at::Tensor> &inputs, const ag::variable_list &grads,
                                              const std::vector<bool> &need) {
    pybind11::gil_scoped_acquire gil;
    if (!region->py_backward) throw std::runtime_error("kbench: the region's module is gone (collected)");
    size_t nin = inputs.size(), nkept = stats.size() + outs_read.size();
    THPObjectPtr saved_t(PyTuple_New((Py_ssize_t)(nin + nkept)));
    THPObjectPtr grads_t(PyTuple_New((Py_ssize_t)grad_slot.size()));
    THPObjectPtr need_t(PyTuple_New((Py_ssize_t)nin));
    if (!saved_t || !grads_t || !need_t) rethrow_python();
    for (size_t i = 0; i < nin + nkept; i++) {   /* inputs, statistics, outputs read */
        const at::Tensor &x = i < nin ? inputs[i] : i < nin + stats.size() ? stats[i - nin]
                                                                           : outs_read[i - nin - stats.size()].first;
        PyObject *t = THPVariable_Wrap(x);
        if (!t) rethrow_python();
        PyTuple_SET_ITEM(saved_t.get(), (Py_ssize_t)i, t);
    }
    for (size_t k = 0; k < grad_slot.size(); k++) {
        PyObject *t = THPVariable_Wrap(grad_slot[k] >= 0 ? grads[(size_t)grad_slot[k]] : at::Tensor());
        if (!t) rethrow_python();
        PyTuple_SET_ITEM(grads_t.get(), (Py_ssize_t)k, t);
    }
    for (size_t i = 0; i < nin; i++) PyTuple_SET_ITEM(need_t.get(), (Py_ssize_t)i, PyBool_FromLong(need[i]));
    THPObjectPtr got(PyObject_CallFunctionObjArgs(region->py_backward, saved_t.get(), grads_t.get(), need_t.get(),
                                                  nullptr));
    if (!got) rethrow_python();
    THPObjectPtr fast(PySequence_Fast(got.get(), "kbench: a region's backward must return a sequence"));
    if (!fast) rethrow_python();
    TORCH_CHECK((size_t)PySequence_Fast_GET_SIZE(fast.get()) == nin, "kbench: a region's backward returned ",
                PySequence_Fast_GET_SIZE(fast.get()), " gradients for ", nin, " inputs");
    ag::variable_list result(nin);
    for (size_t i = 0; i < nin; i++) {
        PyObject *g = PySequence_Fast_GET_ITEM(fast.get(), (Py_ssize_t)i);
        if (g != Py_None) {
            TORCH_CHECK(THPVariable_Check(g), "kbench: a region's backward returned a non-tensor gradient");
            result[i] = THPVariable_Unpack(g);
        }
    }
    return result;
}

/* ---------------------------------------------------------------- the Python type */

PyObject *region_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static const char *kwlist[] = {"launch", "launch_nograd", "float_in", "nsaved", "outs", "py_backward", "reads",
                                   nullptr};
    PyObject *launch, *launch_nograd, *float_in, *outs, *py_backward, *reads = nullptr;
    int nsaved;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OOiOO|O", (char **)kwlist, LaunchType, &launch, &launch_nograd,
                                     &float_in, &nsaved, &outs, &py_backward, &reads))
        return nullptr;
    if (launch_nograd != Py_None && !PyObject_TypeCheck(launch_nograd, LaunchType)) {
        PyErr_SetString(PyExc_TypeError, "Region: launch_nograd must be a Launch or None");
        return nullptr;
    }
    if (!PyCallable_Check(py_backward) || nsaved < 0) {
        PyErr_SetString(PyExc_TypeError, "Region: py_backward must be callable and nsaved >= 0");
        return nullptr;
    }
    Region *self = (Region *)type->tp_alloc(type, 0);
    if (!self) return nullptr;
    new (&self->s) RegionState();
    self->launch = Py_NewRef(launch);
    self->launch_nograd = Py_NewRef(launch_nograd);
    self->py_backward = Py_NewRef(py_backward);
    self->keep = PyList_New(0);
    self->s.nsaved = nsaved;
    PyObject *fl = PySequence_Fast(float_in, "Region: float_in must be a sequence of bools");
    if (!fl || !self->keep) goto fail;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fl); i++)
        self->s.float_in.push_back(PyObject_IsTrue(PySequence_Fast_GET_ITEM(fl, i)) == 1);
    Py_DECREF(fl);
    self->s.ninputs = (int)self->s.float_in.size();
    {
        /* outs: [(shape, dtype)] of the real outputs; like = -1 */
        PyObject *fo = PySequence_Fast(outs, "Region: outs must be a sequence of (shape, dtype)");
        if (!fo) goto fail;
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fo); i++) {
            PyObject *shape, *dtype;
            OutSpec o;
            o.like = -1;
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fo, i), "OO", &shape, &dtype) || !THPDtype_Check(dtype)) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "Region: outs needs (shape, torch.dtype)");
                Py_DECREF(fo);
                goto fail;
            }
            if (as_ints(shape, o.shape, "Region: a shape must be a sequence of ints") < 0) {
                Py_DECREF(fo);
                goto fail;
            }
            o.dtype = ((THPDtype *)dtype)->scalar_type;
            self->s.outs.push_back(std::move(o));
        }
        Py_DECREF(fo);
        if (PyErr_Occurred()) goto fail;
    }
    if (reads && reads != Py_None) {   /* reads: indices of real outputs the backward reads */
        std::vector<int64_t> ks;
        if (as_ints(reads, ks, "Region: reads must be a sequence of output indices") < 0) goto fail;
        for (int64_t k : ks) {
            if (k < 0 || (size_t)k >= self->s.outs.size()) {
                PyErr_Format(PyExc_ValueError, "Region: reads names output %lld of %zu", (long long)k,
                             self->s.outs.size());
                goto fail;
            }
            self->s.reads.push_back((int)k);
        }
    }
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return nullptr;
}

int region_traverse(Region *self, visitproc visit, void *arg) {
    Py_VISIT(self->launch);
    Py_VISIT(self->launch_nograd);
    Py_VISIT(self->py_backward);
    Py_VISIT(self->keep);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

int region_clear(Region *self) {
    /* only what cannot be in use: a live node holds a reference to this object, so the
     * collector clears it only once no node can run a backward through it */
    Py_CLEAR(self->py_backward);
    return 0;
}

void region_dealloc(Region *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->launch);
    Py_CLEAR(self->launch_nograd);
    Py_CLEAR(self->py_backward);
    self->s.programs.clear();   /* before keep: the programs point into its Launch objects */
    Py_CLEAR(self->keep);
    self->s.~RegionState();
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* apply(*inputs) -> the region's outputs (row statistics excluded). With gradients wanted they
 * carry a KbenchRegionBackward node. Raises RegionFallback / Fallback as Launch.run does, before
 * anything is recorded: the caller then runs the region its slower way. */
PyObject *region_apply(Region *self, PyObject *const *args, Py_ssize_t nargs) {
    HANDLE_TH_ERRORS
    if (nargs != self->s.ninputs) {
        PyErr_Format(PyExc_TypeError, "apply: expected %d inputs, got %zd", self->s.ninputs, nargs);
        return nullptr;
    }
    std::vector<at::Tensor> in, outs;
    if (!unpack_tensors(args, nargs, in, "apply") || !region_forward((PyObject *)self, in, outs)) return nullptr;
    return wrap_tensors(outs, outs.size() - (size_t)self->s.nsaved, false);
    END_HANDLE_TH_ERRORS
}

/* set_backward(need, steps, outputs, drop): the generated backward for the inputs flagged in
 * need (a tuple of bools, one per input), as steps [(Launch, [slot, ...]), ...] over the
 * slots (inputs, statistics, upstream gradients, then each step's outputs), outputs the slots
 * of the gradients (one per flagged input), drop the inputs torch gives None. */
PyObject *region_set_backward(Region *self, PyObject *args) {
    PyObject *need, *steps, *outputs, *drop;
    if (!PyArg_ParseTuple(args, "OOOO", &need, &steps, &outputs, &drop)) return nullptr;
    auto prog = std::make_shared<BackwardProgram>();
    std::vector<bool> key;
    THPObjectPtr fneed(PySequence_Fast(need, "need must be a sequence"));
    THPObjectPtr fdrop(PySequence_Fast(drop, "drop must be a sequence"));
    THPObjectPtr fsteps(PySequence_Fast(steps, "steps must be a sequence"));
    if (!fneed || !fdrop || !fsteps) return nullptr;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fneed.get());
    if (n != self->s.ninputs || PySequence_Fast_GET_SIZE(fdrop.get()) != n) {
        PyErr_SetString(PyExc_ValueError, "set_backward: need and drop need one entry per input");
        return nullptr;
    }
    Py_ssize_t nneed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        key.push_back(PyObject_IsTrue(PySequence_Fast_GET_ITEM(fneed.get(), i)) == 1);
        nneed += key.back();
        prog->drop.push_back(PyObject_IsTrue(PySequence_Fast_GET_ITEM(fdrop.get(), i)) == 1);
    }
    std::vector<int64_t> ints;
    if (as_ints(outputs, ints, "outputs must be a sequence of slots") < 0) return nullptr;
    prog->outputs.assign(ints.begin(), ints.end());
    if ((Py_ssize_t)prog->outputs.size() != nneed) {
        PyErr_SetString(PyExc_ValueError, "set_backward: one output slot per input that wants a gradient");
        return nullptr;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fsteps.get()); i++) {
        PyObject *launch, *ins;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fsteps.get(), i), "O!O", LaunchType, &launch, &ins))
            return nullptr;
        ints.clear();
        if (as_ints(ins, ints, "a step's slots must be a sequence of ints") < 0 ||
            PyList_Append(self->keep, launch) < 0)
            return nullptr;
        prog->steps.push_back({&spec_of(launch), std::vector<int>(ints.begin(), ints.end())});
    }
    std::lock_guard<std::mutex> g(self->s.lock);
    self->s.programs[key] = std::move(prog);
    Py_RETURN_NONE;
}

PyObject *region_backward_patterns(Region *self, PyObject *) {
    std::lock_guard<std::mutex> g(self->s.lock);
    return PyLong_FromSize_t(self->s.programs.size());
}

PyMethodDef region_methods[] = {
    {"apply", (PyCFunction)(void (*)(void))region_apply, METH_FASTCALL,
     "apply(*inputs) -> outputs, recorded for autograd where gradients are wanted"},
    {"set_backward", (PyCFunction)region_set_backward, METH_VARARGS,
     "set_backward(need, steps, outputs, drop): run this backward from C++ from now on"},
    {"backward_patterns", (PyCFunction)region_backward_patterns, METH_NOARGS,
     "how many backward programs run from C++"},
    {nullptr, nullptr, 0, nullptr},
};

PyType_Slot region_slots[] = {
    {Py_tp_doc, (void *)"A compute region as an autograd node run from C++ (kbench.runtime builds them)."},
    {Py_tp_new, (void *)region_new},
    {Py_tp_dealloc, (void *)region_dealloc},
    {Py_tp_traverse, (void *)region_traverse},
    {Py_tp_clear, (void *)region_clear},
    {Py_tp_methods, region_methods},
    {0, nullptr},
};

PyType_Spec region_spec = {"kbench._fast.Region", sizeof(Region), 0,
                           Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, region_slots};

}  // namespace

PyTypeObject *RegionType;

bool region_forward(PyObject *region, const std::vector<at::Tensor> &in, std::vector<at::Tensor> &outs) {
    Region *self = (Region *)region;
    bool wants = false;
    for (size_t i = 0; i < in.size(); i++) wants |= self->s.float_in[i] && in[i].requires_grad();
    wants &= c10::GradMode::is_enabled();
    PyObject *which = wants || self->launch_nograd == Py_None ? self->launch : self->launch_nograd;
    bool with_stats = which == self->launch;
    size_t first = outs.size();
    if (!run_from_python(spec_of(which), in, outs)) return false;
    size_t nreal = outs.size() - first - (size_t)self->s.nsaved;
    if (wants) {
        auto node = make_node<RegionNode>((NodePtr *)nullptr, self);
        node->set_next_edges(ag::collect_next_edges(in));
        node->saved.reserve(in.size());
        for (const at::Tensor &x : in) node->saved.emplace_back(x, /*is_output=*/false);
        auto real_end = outs.begin() + (std::ptrdiff_t)(first + nreal);
        if (with_stats) node->stats.assign(real_end, outs.end());
        int k = 0;
        for (size_t j = first; j < first + nreal; j++) {
            if (at::isFloatingType(outs[j].scalar_type())) {
                ag::set_history(outs[j], node);
                node->grad_slot.push_back(k++);
            } else {
                node->grad_slot.push_back(-1);   /* integer outputs are not differentiable */
            }
        }
        for (int o : self->s.reads) {
            const at::Tensor &t = outs[first + (size_t)o];
            node->outs_read.emplace_back(t.detach(), t._version());
        }
    }
    /* the statistics are the node's (or nobody's): the caller's slots hold nothing for them */
    for (size_t j = first + nreal; j < outs.size(); j++) outs[j] = at::Tensor();
    return true;
}

void region_arity(PyObject *region, size_t &ninputs, size_t &nreal, size_t &nsaved) {
    Region *self = (Region *)region;
    ninputs = (size_t)self->s.ninputs;
    nreal = self->s.outs.size();
    nsaved = (size_t)self->s.nsaved;
}

int init_region(PyObject *module) {
    RegionType = (PyTypeObject *)PyType_FromSpec(&region_spec);
    if (!RegionType) return -1;
    Py_INCREF(RegionType);
    return PyModule_AddObject(module, "Region", (PyObject *)RegionType) < 0 ? -1 : 0;
}

}  // namespace kbfast
