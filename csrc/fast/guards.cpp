/* guards.cpp — kbench._fast.Guards: the Python state an optimized module's forward read (its
 * attributes, submodules and globals: kbench/capture/guards.py records and binds them), checked
 * per call in C++. An entry is (table, key, expected, how): the value is table[key] for a dict
 * (an object's __dict__, a module's _modules, a module's globals) or getattr(table, key) (how &
 * 1), compared by identity (how & 2) or else by the same type and ==; with how & 4 the entry holds
 * while the value is missing (an attribute the forward looked for and did not find). Program
 * checks them before any launch; the Python path (capture/guards.py check()) does the same. */
#include "fast/fast.h"

#include <torch/csrc/utils/object_ptr.h>

namespace kbfast {

namespace {

enum { GUARD_GETATTR = 1, GUARD_IDENTITY = 2, GUARD_ABSENT = 4 };

struct GuardSpec {
    PyObject *table, *key, *want;   /* borrowed from the entries tuple, which the object owns */
    int how;
};

struct Guards {
    PyObject_HEAD
    PyObject *entries;              /* a tuple of (table, key, expected, how) tuples */
    std::vector<GuardSpec> specs;
};

/* The value an entry reads now, a new reference; NULL (no exception set) where it is missing or
 * reading it raised: a guard that fails. */
PyObject *read_value(const GuardSpec &g) {
    PyObject *v;
    if (g.how & GUARD_GETATTR) {
        v = PyObject_GetAttr(g.table, g.key);
    } else if (PyDict_CheckExact(g.table)) {
        v = PyDict_GetItemWithError(g.table, g.key);
        Py_XINCREF(v);
    } else {
        v = PyObject_GetItem(g.table, g.key);
    }
    if (!v) PyErr_Clear();
    return v;
}

}  // namespace

Py_ssize_t guards_failing(PyObject *obj) {
    Guards *self = (Guards *)obj;
    for (size_t i = 0; i < self->specs.size(); i++) {
        const GuardSpec &g = self->specs[i];
        PyObject *got = read_value(g);
        if (g.how & GUARD_ABSENT) {
            if (!got) continue;
            Py_DECREF(got);
            return (Py_ssize_t)i;
        }
        if (!got) return (Py_ssize_t)i;
        bool same = got == g.want;
        if (!same && !(g.how & GUARD_IDENTITY) && Py_TYPE(got) == Py_TYPE(g.want)) {
            int eq = PyObject_RichCompareBool(got, g.want, Py_EQ);
            if (eq < 0) PyErr_Clear();
            same = eq == 1;
        }
        Py_DECREF(got);
        if (!same) return (Py_ssize_t)i;
    }
    return -1;
}

namespace {

/* Guards(entries) */
PyObject *guards_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static const char *kwlist[] = {"entries", nullptr};
    PyObject *entries;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!", (char **)kwlist, &PyTuple_Type, &entries)) return nullptr;
    std::vector<GuardSpec> specs;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(entries); i++) {
        PyObject *e = PyTuple_GET_ITEM(entries, i);
        GuardSpec g;
        if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 4) {
            PyErr_Format(PyExc_TypeError, "Guards: entry %zd is not a (table, key, expected, how) tuple", i);
            return nullptr;
        }
        g.table = PyTuple_GET_ITEM(e, 0), g.key = PyTuple_GET_ITEM(e, 1), g.want = PyTuple_GET_ITEM(e, 2);
        long how = PyLong_Check(PyTuple_GET_ITEM(e, 3)) ? PyLong_AsLong(PyTuple_GET_ITEM(e, 3)) : -1;
        if (how < 0 || how > (GUARD_GETATTR | GUARD_IDENTITY | GUARD_ABSENT) || !PyUnicode_Check(g.key)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "Guards: entry %zd needs a str key and how in 0..7", i);
            return nullptr;
        }
        g.how = (int)how;
        specs.push_back(g);
    }
    Guards *self = (Guards *)type->tp_alloc(type, 0);
    if (!self) return nullptr;
    new (&self->specs) std::vector<GuardSpec>(std::move(specs));
    self->entries = Py_NewRef(entries);
    return (PyObject *)self;
}

/* check() -> the index of the first entry that no longer holds, or -1 */
PyObject *guards_check(Guards *self, PyObject *) { return PyLong_FromSsize_t(guards_failing((PyObject *)self)); }

int guards_traverse(Guards *self, visitproc visit, void *arg) {
    Py_VISIT(self->entries);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

int guards_clear(Guards *self) {
    self->specs.clear();   /* borrowed from entries: gone with it */
    Py_CLEAR(self->entries);
    return 0;
}

void guards_dealloc(Guards *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    guards_clear(self);
    self->specs.~vector();
    tp->tp_free(self);
    Py_DECREF(tp);
}

PyObject *guards_len(Guards *self, void *) { return PyLong_FromSize_t(self->specs.size()); }

PyMethodDef guards_methods[] = {
    {"check", (PyCFunction)guards_check, METH_NOARGS, "check() -> the first entry that no longer holds, or -1"},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef guards_getset[] = {
    {"size", (getter)guards_len, nullptr, "how many entries", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyType_Slot guards_slots[] = {
    {Py_tp_doc, (void *)"The Python state a forward read, checked in C++ (kbench/capture/guards.py binds them)."},
    {Py_tp_new, (void *)guards_new},
    {Py_tp_dealloc, (void *)guards_dealloc},
    {Py_tp_traverse, (void *)guards_traverse},
    {Py_tp_clear, (void *)guards_clear},
    {Py_tp_methods, guards_methods},
    {Py_tp_getset, guards_getset},
    {0, nullptr},
};

PyType_Spec guards_spec = {"kbench._fast.Guards", sizeof(Guards), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
                           guards_slots};

}  // namespace

PyTypeObject *GuardsType;

int init_guards(PyObject *module) {
    GuardsType = (PyTypeObject *)PyType_FromSpec(&guards_spec);
    if (!GuardsType) return -1;
    Py_INCREF(GuardsType);
    return PyModule_AddObject(module, "Guards", (PyObject *)GuardsType) < 0 ? -1 : 0;
}

}  // namespace kbfast
