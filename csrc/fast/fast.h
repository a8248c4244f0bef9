/* fast.h — kbench._fast, the C++ hot path of the CUDA backend: a region's launch (checks,
 * allocations, cuLaunchKernel through kbench._C's launch_api.h), the autograd node whose
 * backward runs the region's generated backward kernels with no Python and no GIL, and a
 * module's whole call (nn.Module's, its guards and every region) where it needs no Python.
 * C++ only because torch's autograd Node and allocator are C++; the core stays C. */
#pragma once
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/launch_api.h"

namespace kbfast {

/* What a launch that did not run says: the call goes to eager for this region (a
 * non-contiguous or misaligned input), to eager for the whole call (a tensor on another
 * device), or the driver failed. */
enum Outcome { RAN = 0, REGION_FALLBACK = 1, FALLBACK = 2, CUDA_FAILED = 3 };

struct OutSpec {
    int like;                    /* allocate as empty_like(inputs[like]); -1: from shape/dtype */
    std::vector<int64_t> shape;
    at::ScalarType dtype;
};

/* Column-sum workspaces kept per stream, as torch keeps nothing else of ours between calls. */
struct WorkspaceCache {
    std::mutex lock;             /* held from taking the workspace to the finishing launch */
    std::vector<std::pair<void *, at::Tensor>> by_stream;
};

/* One kernel (and its finishing kernel, if any) bound to one set of sizes: what the Python path
 * (cuda_backend.CudaExecutor.launcher) resolves in a closure, once per signature. */
struct LaunchSpec {
    void *cuda = nullptr;        /* the kb_cuda behind the capsule */
    void *fn = nullptr;          /* CUfunction */
    void *finish = nullptr;      /* the finishing kernel (column sums), or NULL */
    uint32_t grid[3] = {1, 1, 1};
    int block = 0, smem = 0, device = 0, region = -1, vec = 1;
    /* the kernel runs only where last_size (its vectors' last dim at these sizes) is a multiple of
       last_multiple (1: any size); the Python launcher's check, with the same reason */
    int64_t last_size = 0;
    int last_multiple = 1;
    int skipped = 0;             /* trailing outputs this entry point does not write (None) */
    std::vector<at::Tensor> scratch; /* ... or writes into these buffers, which nothing reads */
    int64_t workspace_bytes = 0;
    std::vector<int> check;      /* inputs checked for contiguity (the others are trusted) */
    std::vector<int64_t> ints;   /* the int64 arguments after the pointers */
    std::vector<OutSpec> outs;   /* the outputs it writes */
    std::unique_ptr<WorkspaceCache> workspaces = std::make_unique<WorkspaceCache>();
};

/* kbench._fast.Launch: a LaunchSpec as a Python object, callable as .run(inputs). */
struct Launch {
    PyObject_HEAD
    PyObject *keep;              /* what keeps fn loaded: the cuda capsule, the kernel object */
    LaunchSpec spec;
};

extern PyTypeObject *LaunchType;
extern const kb_launch_api *api;
extern PyObject *FallbackError, *RegionFallbackError, *CudaError;

/* Run l on inputs: device, contiguity and alignment checks, one allocation per output (appended
 * to outs; undefined for skipped ones), the launch. Not RAN: why says why. Touches no Python
 * object: callable from autograd's device threads without the GIL. */
Outcome run_launch(const LaunchSpec &l, const std::vector<at::Tensor> &inputs, std::vector<at::Tensor> &outs,
                   std::string &why);
/* run_launch from a Python call: the GIL released around it, a C++ exception from torch (out
 * of memory) rethrown once it is held again, a launch that did not run as the Python exception
 * its outcome names. false: that exception is set. */
bool run_from_python(const LaunchSpec &l, const std::vector<at::Tensor> &inputs, std::vector<at::Tensor> &outs);

/* Python helpers (the GIL held): items that must be tensors into in (false: TypeError naming
 * what), ints of a sequence appended to out (-1: the error is set), the first n tensors as a
 * tuple or a list (undefined ones as None). */
bool unpack_tensors(PyObject *const *items, Py_ssize_t n, std::vector<at::Tensor> &in, const char *what);
int as_ints(PyObject *seq, std::vector<int64_t> &out, const char *what);
PyObject *wrap_tensors(std::vector<at::Tensor> &ts, size_t n, bool as_list);

/* kbench._fast.Region (region.cpp), as program.cpp drives it. */
extern PyTypeObject *RegionType;
/* Region.apply on tensors (the GIL held): the launch and, where gradients are wanted, the node.
 * outs gets the region's real outputs, then one undefined tensor per row statistic (the slots
 * runtime.py fills with None). false: a Python exception is set (RegionFallback, Fallback,
 * kbench.CudaError), nothing was recorded and outs is as it was. */
bool region_forward(PyObject *region, const std::vector<at::Tensor> &in, std::vector<at::Tensor> &outs);
/* A Region's inputs, real outputs and row statistics. */
void region_arity(PyObject *region, size_t &ninputs, size_t &nreal, size_t &nsaved);

/* kbench._fast.Program (program.cpp), as call.cpp drives it: module(*inputs)'s result, or
 * NotImplemented where the Python path must run (NULL: an exception is set). */
extern PyTypeObject *ProgramType;
PyObject *program_run(PyObject *program, PyObject *module, PyObject *const *inputs, size_t n);

/* kbench._fast.Guards (guards.cpp): the first entry of a Guards object that no longer holds, or -1
 * (a read or a comparison that raises is one that fails; no exception is left set). */
extern PyTypeObject *GuardsType;
Py_ssize_t guards_failing(PyObject *guards);

int init_launch(PyObject *module);
int init_guards(PyObject *module);
int init_keys(PyObject *module);
int init_region(PyObject *module);
int init_program(PyObject *module);
int init_call(PyObject *module);

}  // namespace kbfast
