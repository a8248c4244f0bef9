/* keys.cpp — kbench._fast.TensorKeys: what a parameter cache (kbench/runtime/param_cache.py) knows
 * of the tensors its values were computed from — each one's identity, storage, data pointer,
 * layout, dtype and version counter — compared in C++ at every call that reads the cache (about
 * 150 tensors for a GPT-2: a few nanoseconds each, where Python would take a microsecond). */
#include "fast/fast.h"

#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include <optional>

namespace kbfast {

namespace {

/* One tensor as last seen. The weak references keep the TensorImpl and StorageImpl objects (not
 * the storage's memory) from being freed, so an equal address is the same object, never a new
 * one allocated where a replaced tensor was. */
struct Key {
    std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> impl;
    std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>> storage;
    const void *data = nullptr;
    int64_t offset = 0;
    std::vector<int64_t> sizes, strides;
    at::ScalarType dtype = at::kFloat;
    uint32_t version = 0;
};

/* The tensor behind a Python object where it can have a key: a strided tensor with a storage and
 * a version counter (not an inference tensor); else nullptr, and the position always moves. */
const at::Tensor *keyed(PyObject *o) {
    if (!THPVariable_Check(o)) return nullptr;
    const at::Tensor &t = THPVariable_Unpack(o);
    if (!t.defined() || t.layout() != c10::kStrided || t.is_inference() || !t.has_storage()) return nullptr;
    return &t;
}

bool same(const Key &k, const at::Tensor &t) {
    c10::TensorImpl *impl = t.unsafeGetTensorImpl();
    const c10::Storage &s = impl->unsafe_storage();
    return k.impl && k.impl->_unsafe_get_target() == impl && k.storage &&
           k.storage->_unsafe_get_target() == s.unsafeGetStorageImpl() && k.data == s.data() &&
           k.offset == impl->storage_offset() && k.version == impl->version_counter().current_version() &&
           k.dtype == t.scalar_type() && t.sizes().equals(k.sizes) && t.strides().equals(k.strides);
}

void remember(Key &k, const at::Tensor &t) {
    c10::TensorImpl *impl = t.unsafeGetTensorImpl();
    const c10::Storage &s = impl->unsafe_storage();
    k.impl.emplace(t.getIntrusivePtr());
    k.storage.emplace(s.getWeakStorageImpl());
    k.data = s.data();
    k.offset = impl->storage_offset();
    k.version = impl->version_counter().current_version();
    k.dtype = t.scalar_type();
    k.sizes.assign(t.sizes().begin(), t.sizes().end());
    k.strides.assign(t.strides().begin(), t.strides().end());
}

struct TensorKeys {
    PyObject_HEAD
    std::vector<Key> keys;
    std::vector<uint64_t> changed_at;   /* the epoch at which each position last moved */
    uint64_t epoch;
};

/* observe() on n Python objects: true where any position moved (the epoch then moves on). */
bool observe(TensorKeys *self, PyObject *const *items, size_t n) {
    n = std::min(n, self->keys.size());
    bool moved = false;
    for (size_t i = 0; i < n; i++) {
        const at::Tensor *t = keyed(items[i]);
        Key &k = self->keys[i];
        if (t && same(k, *t)) continue;
        if (!moved) self->epoch++, moved = true;
        self->changed_at[i] = self->epoch;
        if (t) remember(k, *t);
        else k = Key();
    }
    return moved;
}

/* TensorKeys(n) */
PyObject *keys_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static const char *kwlist[] = {"n", nullptr};
    Py_ssize_t n;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", (char **)kwlist, &n)) return nullptr;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "TensorKeys: n must be >= 0");
        return nullptr;
    }
    TensorKeys *self = (TensorKeys *)type->tp_alloc(type, 0);
    if (!self) return nullptr;
    new (&self->keys) std::vector<Key>((size_t)n);
    new (&self->changed_at) std::vector<uint64_t>((size_t)n, 0);
    self->epoch = 0;
    return (PyObject *)self;
}

/* observe(tensors) -> whether any of the first n moved since last seen */
PyObject *keys_observe(TensorKeys *self, PyObject *seq) {
    HANDLE_TH_ERRORS
    THPObjectPtr items(PySequence_Fast(seq, "TensorKeys.observe takes a sequence of tensors"));
    if (!items) return nullptr;
    bool moved = observe(self, PySequence_Fast_ITEMS(items.get()), (size_t)PySequence_Fast_GET_SIZE(items.get()));
    return PyBool_FromLong(moved);
    END_HANDLE_TH_ERRORS
}

/* forget(): every position moves at the next observe() */
PyObject *keys_forget(TensorKeys *self, PyObject *) {
    for (Key &k : self->keys) k = Key();
    Py_RETURN_NONE;
}

PyObject *keys_epoch(TensorKeys *self, void *) { return PyLong_FromUnsignedLongLong(self->epoch); }

PyObject *keys_changed_at(TensorKeys *self, void *) {
    PyObject *out = PyTuple_New((Py_ssize_t)self->changed_at.size());
    if (!out) return nullptr;
    for (size_t i = 0; i < self->changed_at.size(); i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(self->changed_at[i]);
        if (!v) {
            Py_DECREF(out);
            return nullptr;
        }
        PyTuple_SET_ITEM(out, (Py_ssize_t)i, v);
    }
    return out;
}

void keys_dealloc(TensorKeys *self) {
    PyTypeObject *tp = Py_TYPE(self);
    self->keys.~vector();
    self->changed_at.~vector();
    tp->tp_free(self);
    Py_DECREF(tp);
}

PyMethodDef keys_methods[] = {
    {"observe", (PyCFunction)keys_observe, METH_O,
     "observe(tensors) -> whether any of the first n moved since last seen (epoch moves on; changed_at says where)"},
    {"forget", (PyCFunction)keys_forget, METH_NOARGS, "forget(): every position moves at the next observe()"},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef keys_getset[] = {
    {"epoch", (getter)keys_epoch, nullptr, "how many observe() calls saw a position move", nullptr},
    {"changed_at", (getter)keys_changed_at, nullptr, "per position, the epoch at which it last moved", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyType_Slot keys_slots[] = {
    {Py_tp_doc, (void *)"The keys of the tensors a parameter cache's values were computed from (param_cache.py)."},
    {Py_tp_new, (void *)keys_new},
    {Py_tp_dealloc, (void *)keys_dealloc},
    {Py_tp_methods, keys_methods},
    {Py_tp_getset, keys_getset},
    {0, nullptr},
};

PyType_Spec keys_spec = {"kbench._fast.TensorKeys", sizeof(TensorKeys), 0, Py_TPFLAGS_DEFAULT, keys_slots};

}  // namespace

int init_keys(PyObject *module) {
    PyTypeObject *type = (PyTypeObject *)PyType_FromSpec(&keys_spec);
    if (!type) return -1;
    return PyModule_AddObject(module, "TensorKeys", (PyObject *)type) < 0 ? -1 : 0;
}

}  // namespace kbfast
