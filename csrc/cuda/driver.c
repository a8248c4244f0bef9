/* driver.c — the CUDA driver (libcuda.so.1), dlopen'ed at first use (no CUDA headers at build
 * time: the few types and entry points used are declared below): device attributes, the
 * primary context, module loading, function attributes, kernel launch, streams and memory. */
#include "cuda/cuda.h"

#include <dlfcn.h>
#include <stdatomic.h>
#include <stdlib.h>

typedef int CUresult; /* CUDA_SUCCESS = 0 */
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
enum { CU_STREAM_CAPTURE_MODE_RELAXED = 2 }; /* CUstreamCaptureMode: GLOBAL 0, THREAD_LOCAL 1, RELAXED 2 */

/* values from cuda.h (stable across CUDA 11-13) */
enum {
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
    CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
    CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR = 82,
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97,
    CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1,
    CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3,
    CU_FUNC_ATTRIBUTE_NUM_REGS = 4,
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
};

struct kb_cuda {
    kb_ctx *ctx;                 /* allocated this struct */
    void *lib;
    int driver_version;          /* e.g. 12080 */
    int device;                  /* whose primary context is used when a thread has none */
    _Atomic(CUcontext) primary;  /* retained by us (released in close), or NULL */
    CUresult (*Init)(unsigned);
    CUresult (*DriverGetVersion)(int *);
    CUresult (*GetErrorName)(CUresult, const char **);
    CUresult (*GetErrorString)(CUresult, const char **);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DeviceGetAttribute)(int *, int, CUdevice);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*CtxSynchronize)(void);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*DevicePrimaryCtxRelease)(CUdevice);
    CUresult (*ModuleLoadData)(CUmodule *, const void *);
    CUresult (*ModuleUnload)(CUmodule);
    CUresult (*ThreadExchangeStreamCaptureMode)(int *);
    CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*FuncGetAttribute)(int *, int, CUfunction);
    CUresult (*FuncSetAttribute)(CUfunction, int, int);
    CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void **, void **);
    CUresult (*StreamSynchronize)(CUstream);
    CUresult (*StreamIsCapturing)(CUstream, int *);
    CUresult (*EventCreate)(CUevent *, unsigned);
    CUresult (*EventRecord)(CUevent, CUstream);
    CUresult (*EventSynchronize)(CUevent);
    CUresult (*EventElapsedTime)(float *, CUevent, CUevent);
    CUresult (*EventDestroy)(CUevent);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*MemcpyHtoD)(CUdeviceptr, const void *, size_t);
    CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
};

/* The names cuda.h maps each call to (its #define cuX cuX_v2 lines), with the older name as a
 * fallback for drivers that predate the newer one (cuEventElapsedTime_v2 is 12.8+). The
 * default-stream ("legacy") variants are the plain names; kbench always passes its stream. */
static const struct { size_t off; const char *name, *alt; } cuda_syms[] = {
    {offsetof(kb_cuda, Init), "cuInit", NULL},
    {offsetof(kb_cuda, DriverGetVersion), "cuDriverGetVersion", NULL},
    {offsetof(kb_cuda, GetErrorName), "cuGetErrorName", NULL},
    {offsetof(kb_cuda, GetErrorString), "cuGetErrorString", NULL},
    {offsetof(kb_cuda, DeviceGet), "cuDeviceGet", NULL},
    {offsetof(kb_cuda, DeviceGetAttribute), "cuDeviceGetAttribute", NULL},
    {offsetof(kb_cuda, CtxGetCurrent), "cuCtxGetCurrent", NULL},
    {offsetof(kb_cuda, CtxSetCurrent), "cuCtxSetCurrent", NULL},
    {offsetof(kb_cuda, CtxSynchronize), "cuCtxSynchronize", NULL},
    {offsetof(kb_cuda, DevicePrimaryCtxRetain), "cuDevicePrimaryCtxRetain", NULL},
    {offsetof(kb_cuda, DevicePrimaryCtxRelease), "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"},
    {offsetof(kb_cuda, ModuleLoadData), "cuModuleLoadData", NULL},
    {offsetof(kb_cuda, ModuleUnload), "cuModuleUnload", NULL},
    {offsetof(kb_cuda, ThreadExchangeStreamCaptureMode), "cuThreadExchangeStreamCaptureMode", NULL},
    {offsetof(kb_cuda, ModuleGetFunction), "cuModuleGetFunction", NULL},
    {offsetof(kb_cuda, FuncGetAttribute), "cuFuncGetAttribute", NULL},
    {offsetof(kb_cuda, FuncSetAttribute), "cuFuncSetAttribute", NULL},
    {offsetof(kb_cuda, LaunchKernel), "cuLaunchKernel", NULL},
    {offsetof(kb_cuda, StreamSynchronize), "cuStreamSynchronize", NULL},
    {offsetof(kb_cuda, StreamIsCapturing), "cuStreamIsCapturing", NULL},
    {offsetof(kb_cuda, EventCreate), "cuEventCreate", NULL},
    {offsetof(kb_cuda, EventRecord), "cuEventRecord", NULL},
    {offsetof(kb_cuda, EventSynchronize), "cuEventSynchronize", NULL},
    {offsetof(kb_cuda, EventElapsedTime), "cuEventElapsedTime_v2", "cuEventElapsedTime"},
    {offsetof(kb_cuda, EventDestroy), "cuEventDestroy_v2", "cuEventDestroy"},
    {offsetof(kb_cuda, MemAlloc), "cuMemAlloc_v2", NULL},
    {offsetof(kb_cuda, MemFree), "cuMemFree_v2", NULL},
    {offsetof(kb_cuda, MemcpyHtoD), "cuMemcpyHtoD_v2", NULL},
    {offsetof(kb_cuda, MemcpyDtoH), "cuMemcpyDtoH_v2", NULL},
};

static kb_status cu_fail(kb_ctx *ctx, const kb_cuda *c, CUresult r, const char *call, const char *file, int line) {
    const char *name = NULL, *desc = NULL;
    if (c->GetErrorName(r, &name) != 0 || !name) name = "CUDA_ERROR_UNKNOWN_CODE";
    if (c->GetErrorString(r, &desc) != 0 || !desc) desc = "no description";
    return kb_fail(ctx, KB_ERR_CUDA, file, line, "%s failed: %s (%d: %s)", call, name, r, desc);
}

/* Calls a driver function; on failure records "<call> failed: CUDA_ERROR_X (n: text)". */
#define CU_TRY(ctx, c, name, call)                                    \
    do {                                                              \
        CUresult r_ = (call);                                         \
        if (r_ != 0) {                                                \
            st = cu_fail((ctx), (c), r_, (name), __FILE__, __LINE__); \
            goto cleanup;                                             \
        }                                                             \
    } while (0)

kb_status kb_cuda_open(kb_ctx *ctx, kb_cuda **out) {
    kb_status st = KB_OK;
    kb_cuda *c = NULL;
    KB_CHECK(ctx, out, KB_ERR_INVALID, "kb_cuda_open: NULL argument");
    *out = NULL;
    c = kb_calloc(ctx, 1, sizeof *c);
    KB_CHECK(ctx, c, KB_ERR_OOM, "out of memory");
    c->ctx = ctx;
    atomic_init(&c->primary, NULL);
    c->lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!c->lib) {
        const char *e = dlerror();
        KB_CHECK(ctx, 0, KB_ERR_NOT_FOUND, "libcuda.so.1 (the NVIDIA driver) not found: %s", e ? e : "dlopen failed");
    }
    for (size_t i = 0; i < sizeof cuda_syms / sizeof cuda_syms[0]; i++)
        KB_CHECK(ctx, load_sym(c->lib, (char *)c + cuda_syms[i].off, cuda_syms[i].name, cuda_syms[i].alt),
                 KB_ERR_NOT_FOUND, "libcuda.so.1 has no %s (driver too old?)", cuda_syms[i].name);
    CU_TRY(ctx, c, "cuInit", c->Init(0));
    CU_TRY(ctx, c, "cuDriverGetVersion", c->DriverGetVersion(&c->driver_version));
    *out = c;
    c = NULL;
cleanup:
    kb_cuda_close(c);
    return st;
}

void kb_cuda_close(kb_cuda *c) {
    if (!c) return;
    CUcontext pc = atomic_load(&c->primary);
    CUdevice dev;
    if (pc && c->DeviceGet(&dev, c->device) == 0) c->DevicePrimaryCtxRelease(dev);
    /* NOTE: libcuda stays loaded (the loader refcounts it; torch holds it too, and unloading a
     * driver under live modules of other handles is never worth the saving). */
    kb_free(c->ctx, c, sizeof *c);
}

int kb_cuda_driver_version(const kb_cuda *c) { return c ? c->driver_version : 0; }

/* Makes a context current on this thread if none is: torch's threads already have the device's
 * primary context current (cuCtxGetCurrent returns it); a thread of our own has none, and gets
 * the primary context of c->device, retained once for the handle's lifetime. Lock-free: two
 * threads racing to retain keep one reference and drop the other. */
static kb_status ensure_context(kb_ctx *ctx, kb_cuda *c) {
    kb_status st = KB_OK;
    CUcontext cur = NULL, pc;
    CUdevice dev;
    CU_TRY(ctx, c, "cuCtxGetCurrent", c->CtxGetCurrent(&cur));
    if (cur) return KB_OK;
    pc = atomic_load(&c->primary);
    if (!pc) {
        CUcontext mine = NULL, expected = NULL;
        CU_TRY(ctx, c, "cuDeviceGet", c->DeviceGet(&dev, c->device));
        CU_TRY(ctx, c, "cuDevicePrimaryCtxRetain", c->DevicePrimaryCtxRetain(&mine, dev));
        if (atomic_compare_exchange_strong(&c->primary, &expected, mine)) {
            pc = mine;
        } else {
            c->DevicePrimaryCtxRelease(dev);
            pc = expected;
        }
    }
    CU_TRY(ctx, c, "cuCtxSetCurrent", c->CtxSetCurrent(pc));
cleanup:
    return st;
}

kb_status kb_cuda_device_info(kb_ctx *ctx, kb_cuda *c, int device, kb_device_info *out) {
    kb_status st = KB_OK;
    CUdevice dev;
    int major = 0, minor = 0, v = 0;
    KB_CHECK(ctx, c && out, KB_ERR_INVALID, "kb_cuda_device_info: NULL argument");
    memset(out, 0, sizeof *out);
    CU_TRY(ctx, c, "cuDeviceGet", c->DeviceGet(&dev, device));
#define ATTR(field, attr)                                                                         \
    CU_TRY(ctx, c, "cuDeviceGetAttribute(" #attr ")", c->DeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_##attr, dev)); \
    field = v
    ATTR(major, COMPUTE_CAPABILITY_MAJOR);
    ATTR(minor, COMPUTE_CAPABILITY_MINOR);
    ATTR(out->num_sms, MULTIPROCESSOR_COUNT);
    ATTR(out->max_smem_per_block, MAX_SHARED_MEMORY_PER_BLOCK_OPTIN);
    ATTR(out->regs_per_sm, MAX_REGISTERS_PER_MULTIPROCESSOR);
    ATTR(out->l2_bytes, L2_CACHE_SIZE);
#undef ATTR
    out->sm = major * 10 + minor;
cleanup:
    return st;
}

struct kb_cuda_module {
    kb_ctx *ctx;       /* allocated this struct */
    CUmodule mod;
    CUcontext owner;   /* the context it was loaded into */
};

kb_status kb_cuda_module_load(kb_ctx *ctx, kb_cuda *c, const void *cubin, size_t size, kb_cuda_module **out) {
    kb_status st = KB_OK;
    kb_cuda_module *m = NULL;
    KB_CHECK(ctx, c && cubin && out, KB_ERR_INVALID, "kb_cuda_module_load: NULL argument");
    *out = NULL;
    /* the driver takes no size: never hand it a truncated ELF it would read past */
    KB_CHECK(ctx, cuda_cubin_ok(cubin, size), KB_ERR_INVALID, "not a CUBIN (a 64-bit ELF) of %zu bytes", size);
    KB_TRY(ensure_context(ctx, c));
    m = kb_calloc(ctx, 1, sizeof *m);
    KB_CHECK(ctx, m, KB_ERR_OOM, "out of memory");
    m->ctx = ctx;
    CU_TRY(ctx, c, "cuCtxGetCurrent", c->CtxGetCurrent(&m->owner));
    CU_TRY(ctx, c, "cuModuleLoadData", c->ModuleLoadData(&m->mod, cubin));
    *out = m;
    m = NULL;
cleanup:
    if (m) kb_free(ctx, m, sizeof *m);
    return st;
}

void kb_cuda_module_unload(kb_cuda *c, kb_cuda_module *m) {
    if (!m) return;
    if (c && m->mod) {
        /* unload from the module's own context, whatever this thread has current */
        CUcontext prev = NULL;
        int have_prev = c->CtxGetCurrent(&prev) == 0;
        int switched = have_prev && prev != m->owner && c->CtxSetCurrent(m->owner) == 0;
        /* Python's collector frees a dropped model's modules at any moment, also while a stream
         * is being captured into a CUDA graph; in the (default) global capture mode the unload,
         * a "potentially unsafe" call, would invalidate that capture. Relaxed mode allows it (the
         * capture in progress holds no reference to a module that is being freed). */
        int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        int relaxed = c->ThreadExchangeStreamCaptureMode(&mode) == 0;
        c->ModuleUnload(m->mod); /* an error here (a context already torn down) leaves nothing to free */
        if (relaxed) c->ThreadExchangeStreamCaptureMode(&mode);
        if (switched) c->CtxSetCurrent(prev);
    }
    kb_free(m->ctx, m, sizeof *m);
}

kb_status kb_cuda_function(kb_ctx *ctx, kb_cuda *c, kb_cuda_module *m, const char *name, int smem_bytes,
                           void **fn, int *regs, int *spill_bytes) {
    kb_status st = KB_OK;
    CUfunction f = NULL;
    int v = 0;
    KB_CHECK(ctx, c && m && name && fn, KB_ERR_INVALID, "kb_cuda_function: NULL argument");
    KB_CHECK(ctx, smem_bytes >= 0, KB_ERR_INVALID, "negative shared memory size %d", smem_bytes);
    *fn = NULL;
    KB_TRY(ensure_context(ctx, c));
    {
        char call[128];
        snprintf(call, sizeof call, "cuModuleGetFunction(\"%.80s\")", name);
        CU_TRY(ctx, c, call, c->ModuleGetFunction(&f, m->mod, name));
    }
    /* above KB_SMEM_PORTABLE (48 KiB) of shared memory, static (the reductions' partials) and dynamic (a row cache)
     * together, a kernel must opt in, once per function: a 48 KiB row cache alone fits, but
     * not with the partials next to it (the launch fails with CUDA_ERROR_INVALID_VALUE) */
    if (smem_bytes > 0) {
        CU_TRY(ctx, c, "cuFuncGetAttribute(SHARED_SIZE_BYTES)",
               c->FuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, f));
        if (smem_bytes + v > KB_SMEM_PORTABLE)
            CU_TRY(ctx, c, "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
                   c->FuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes));
    }
    if (regs) {
        CU_TRY(ctx, c, "cuFuncGetAttribute(NUM_REGS)", c->FuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_NUM_REGS, f));
        *regs = v;
    }
    if (spill_bytes) {
        CU_TRY(ctx, c, "cuFuncGetAttribute(LOCAL_SIZE_BYTES)",
               c->FuncGetAttribute(&v, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f));
        *spill_bytes = v;
    }
    *fn = f;
cleanup:
    return st;
}

kb_status kb_cuda_launch(kb_ctx *ctx, kb_cuda *c, void *fn, const uint32_t grid[3], int block, int smem_bytes,
                         void *stream, void **args) {
    kb_status st = KB_OK;
    KB_CHECK(ctx, c && fn && grid, KB_ERR_INVALID, "kb_cuda_launch: NULL argument");
    KB_CHECK(ctx, block > 0 && smem_bytes >= 0, KB_ERR_INVALID, "bad launch: block %d, smem %d", block, smem_bytes);
    CUresult r = c->LaunchKernel((CUfunction)fn, grid[0], grid[1], grid[2], (unsigned)block, 1, 1,
                                 (unsigned)smem_bytes, (CUstream)stream, args, NULL);
    if (r == CUDA_ERROR_INVALID_CONTEXT) {
        /* a thread with no current context (not torch's): give it one and retry. Checking
         * first would cost every launch a driver call for the sake of a rare thread. */
        KB_TRY(ensure_context(ctx, c));
        r = c->LaunchKernel((CUfunction)fn, grid[0], grid[1], grid[2], (unsigned)block, 1, 1,
                            (unsigned)smem_bytes, (CUstream)stream, args, NULL);
    }
    CU_TRY(ctx, c, "cuLaunchKernel", r);
cleanup:
    return st;
}

kb_status kb_cuda_stream_capturing(kb_ctx *ctx, kb_cuda *c, void *stream, int *capturing) {
    kb_status st = KB_OK;
    int status = 0;   /* CU_STREAM_CAPTURE_STATUS_NONE */
    KB_CHECK(ctx, c && capturing, KB_ERR_INVALID, "kb_cuda_stream_capturing: NULL argument");
    CU_TRY(ctx, c, "cuStreamIsCapturing", c->StreamIsCapturing((CUstream)stream, &status));
    *capturing = status != 0;   /* active, or invalidated: either way not a plain launch */
cleanup:
    return st;
}

kb_status kb_cuda_synchronize(kb_ctx *ctx, kb_cuda *c, void *stream) {
    kb_status st = KB_OK;
    KB_CHECK(ctx, c, KB_ERR_INVALID, "kb_cuda_synchronize: NULL argument");
    KB_TRY(ensure_context(ctx, c));
    if (stream) CU_TRY(ctx, c, "cuStreamSynchronize", c->StreamSynchronize((CUstream)stream));
    else CU_TRY(ctx, c, "cuCtxSynchronize", c->CtxSynchronize());
cleanup:
    return st;
}

kb_status kb_cuda_mem_alloc(kb_ctx *ctx, kb_cuda *c, size_t bytes, uint64_t *dptr) {
    kb_status st = KB_OK;
    CUdeviceptr p = 0;
    KB_CHECK(ctx, c && dptr, KB_ERR_INVALID, "kb_cuda_mem_alloc: NULL argument");
    *dptr = 0;
    KB_TRY(ensure_context(ctx, c));
    CU_TRY(ctx, c, "cuMemAlloc", c->MemAlloc(&p, bytes ? bytes : 1));
    *dptr = p;
cleanup:
    return st;
}

void kb_cuda_mem_free(kb_cuda *c, uint64_t dptr) {
    if (c && dptr) c->MemFree((CUdeviceptr)dptr);
}

kb_status kb_cuda_copy_to_device(kb_ctx *ctx, kb_cuda *c, uint64_t dst, const void *src, size_t bytes) {
    kb_status st = KB_OK;
    KB_CHECK(ctx, c && (src || !bytes), KB_ERR_INVALID, "kb_cuda_copy_to_device: NULL argument");
    KB_TRY(ensure_context(ctx, c));
    if (bytes) CU_TRY(ctx, c, "cuMemcpyHtoD", c->MemcpyHtoD((CUdeviceptr)dst, src, bytes));
cleanup:
    return st;
}

kb_status kb_cuda_copy_to_host(kb_ctx *ctx, kb_cuda *c, void *dst, uint64_t src, size_t bytes) {
    kb_status st = KB_OK;
    KB_CHECK(ctx, c && (dst || !bytes), KB_ERR_INVALID, "kb_cuda_copy_to_host: NULL argument");
    KB_TRY(ensure_context(ctx, c));
    if (bytes) CU_TRY(ctx, c, "cuMemcpyDtoH", c->MemcpyDtoH(dst, (CUdeviceptr)src, bytes));
cleanup:
    return st;
}
