/* call.cpp — kbench._fast.module_call: OptimizedModule.__call__ in C++. With no keyword
 * argument, no hook (the module's or a global one), no compiled call and no JIT trace, torch's
 * nn.Module.__call__ does nothing but forward(*args); this makes the same checks and runs the
 * forward's fast path (Program) without the three Python frames in between. Anything else
 * goes to torch's own __call__, and a call the Program declines to the Python forward. */
#include "fast/fast.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/utils/object_ptr.h>

namespace kbfast {

namespace {

PyObject *nn_module;     /* torch.nn.Module: its __call__ is looked up per call (FX patches it) */
PyObject *hook_globals;  /* torch.nn.modules.module's namespace, where the global hook dicts live */

/* What _call_impl and _wrapped_call_impl read (torch 2.x): the module's hook dicts, the global
 * ones, and the compiled call module.compile() sets. */
const char *const module_hook_names[] = {"_backward_hooks", "_backward_pre_hooks", "_forward_hooks",
                                         "_forward_pre_hooks"};
const char *const global_hook_names[] = {"_global_backward_pre_hooks", "_global_backward_hooks",
                                         "_global_forward_hooks", "_global_forward_pre_hooks"};
PyObject *module_hooks[4], *global_hooks[4];
PyObject *str_compiled, *str_program, *str_call, *str_dunder_call, *str_forward, *str_forward_python,
    *str_fallback;

/* true: torch's __call__ would call forward(*args) and nothing else; false: it would do more (or
 * something is not as torch 2.x has it, and torch's own code decides). Never raises. */
bool plain_call(PyObject *self, PyObject *kwnames) {
    if (kwnames && PyTuple_GET_SIZE(kwnames)) return false;
    if (torch::jit::tracer::isTracing()) return false;   /* _call_impl takes _slow_forward */
    for (PyObject *name : module_hooks) {
        PyObject *hooks = PyObject_GenericGetAttr(self, name);   /* nn.Module.__getattr__ is not wanted */
        int any = hooks ? PyObject_IsTrue(hooks) : -1;
        Py_XDECREF(hooks);
        if (any != 0) {
            PyErr_Clear();
            return false;
        }
    }
    PyObject *compiled = PyObject_GenericGetAttr(self, str_compiled);
    Py_XDECREF(compiled);
    if (compiled != Py_None) {
        PyErr_Clear();
        return false;
    }
    for (PyObject *name : global_hooks) {
        PyObject *hooks = PyDict_GetItemWithError(hook_globals, name);   /* borrowed */
        int any = hooks ? PyObject_IsTrue(hooks) : -1;
        if (any != 0) {
            PyErr_Clear();
            return false;
        }
    }
    return true;
}

PyObject *args_tuple(PyObject *const *args, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    if (!t) return nullptr;
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(t, i, Py_NewRef(args[i]));
    return t;
}

/* str() of the exception being raised, which is cleared: the reason a fallback notes. */
PyObject *take_message() {
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *exc = PyErr_GetRaisedException();
#else
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
#endif
    PyObject *msg = exc ? PyObject_Str(exc) : nullptr;
    Py_XDECREF(exc);
    return msg;
}

/* self.name(args, {}) */
PyObject *call_python(PyObject *self, PyObject *name, PyObject *first, PyObject *args) {
    THPObjectPtr kwargs(PyDict_New());
    if (!kwargs) return nullptr;
    return first ? PyObject_CallMethodObjArgs(self, name, first, args, kwargs.get(), nullptr)
                 : PyObject_CallMethodObjArgs(self, name, args, kwargs.get(), nullptr);
}

/* __call__(self, *args, **kwargs), self an OptimizedModule (the descriptor checks it is an
 * nn.Module). What forward() does, minus its frame: Program.call, a Fallback to self._fallback
 * with its reason, NotImplemented to self._forward_python. */
PyObject *module_call(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (!plain_call(self, kwnames)) {   /* torch's nn.Module.__call__(self, *args, **kwargs) */
        THPObjectPtr torch_call(PyObject_GetAttr(nn_module, str_dunder_call));
        if (!torch_call) return nullptr;
        std::vector<PyObject *> all(args, args + nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0));
        all.insert(all.begin(), self);
        return PyObject_Vectorcall(torch_call.get(), all.data(), (size_t)nargs + 1, kwnames);
    }
    PyObject *program = PyObject_GenericGetAttr(self, str_program);
    if (!program) return nullptr;
    THPObjectPtr held(program);
    PyObject *out;
    if (program == Py_None) {   /* the interpreter's, or a build without Program: forward() */
        THPObjectPtr forward(PyObject_GetAttr(self, str_forward));
        return forward ? PyObject_Vectorcall(forward.get(), args, (size_t)nargs, nullptr) : nullptr;
    }
    THPObjectPtr tuple;
    if (Py_TYPE(program) == ProgramType) {
        out = program_run(program, self, args, (size_t)nargs);
    } else {   /* a stand-in with .call(module, args), as tests make */
        if (!(tuple = args_tuple(args, nargs))) return nullptr;
        out = PyObject_CallMethodObjArgs(program, str_call, self, tuple.get(), nullptr);
    }
    if (out && out != Py_NotImplemented) return out;
    if (!out && !PyErr_ExceptionMatches(FallbackError)) return nullptr;
    if (!tuple && !(tuple = args_tuple(args, nargs))) {
        Py_XDECREF(out);
        return nullptr;
    }
    if (out) {   /* declined: the Python path binds, or runs what C++ does not */
        Py_DECREF(out);
        return call_python(self, str_forward_python, nullptr, tuple.get());
    }
    THPObjectPtr why(take_message());
    return why ? call_python(self, str_fallback, why.get(), tuple.get()) : nullptr;
}

PyMethodDef module_call_def = {
    "__call__", (PyCFunction)(void (*)(void))module_call, METH_FASTCALL | METH_KEYWORDS,
    "Call the optimized module: its C++ forward where torch's __call__ would only call forward()"};

/* module_call(torch.nn.Module, torch.nn.modules.module.__dict__) -> the descriptor for
 * OptimizedModule.__call__ */
PyObject *make_module_call(PyObject *, PyObject *args) {
    PyObject *type, *globals;
    if (!PyArg_ParseTuple(args, "O!O!", &PyType_Type, &type, &PyDict_Type, &globals)) return nullptr;
    Py_XSETREF(nn_module, Py_NewRef(type));
    Py_XSETREF(hook_globals, Py_NewRef(globals));
    return PyDescr_NewMethod((PyTypeObject *)type, &module_call_def);
}

PyMethodDef call_methods[] = {
    {"module_call", make_module_call, METH_VARARGS,
     "module_call(torch.nn.Module, torch.nn.modules.module.__dict__) -> a descriptor for OptimizedModule.__call__"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

int init_call(PyObject *module) {
    for (size_t i = 0; i < 4; i++)
        if (!(module_hooks[i] = PyUnicode_InternFromString(module_hook_names[i])) ||
            !(global_hooks[i] = PyUnicode_InternFromString(global_hook_names[i])))
            return -1;
    for (auto [ptr, name] : {std::pair{&str_compiled, "_compiled_call_impl"}, {&str_program, "_kbench_fast_program"},
                             {&str_call, "call"}, {&str_dunder_call, "__call__"}, {&str_forward, "forward"},
                             {&str_forward_python, "_forward_python"}, {&str_fallback, "_fallback"}})
        if (!(*ptr = PyUnicode_InternFromString(name))) return -1;
    return PyModule_AddFunctions(module, call_methods);
}

}  // namespace kbfast
