/* launch_api.h — what kbench._C lends kbench._fast (C++, csrc/fast/): a kernel launch with no
 * Python objects and no GIL, so a region's forward and its autograd backward can run from C++.
 * Handed over as a capsule: kbench._C.launch_api(). Plain C, read by both sides. */
#ifndef KBENCH_LAUNCH_API_H
#define KBENCH_LAUNCH_API_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KB_LAUNCH_API_CAPSULE "kbench._C.launch_api"
#define KB_LAUNCH_API_VERSION 2
/* CUDA's kernel parameter space as kbench assumes it: KB_MAX_PARAM_BYTES of kbench.h (checked
 * there), for the C++ side, which does not include it */
#define KB_LAUNCH_MAX_PARAM_BYTES 4096

typedef struct kb_launch_api {
    int version;           /* KB_LAUNCH_API_VERSION */
    size_t size;           /* sizeof(kb_launch_api) as kbench._C was built */
    /* The driver behind a cuda handle (kbench._C.cuda_open()'s capsule), or NULL if `capsule`
     * is not one. Borrowed: the caller keeps the capsule alive while it uses the result. Needs
     * the GIL. */
    void *(*cuda_of)(void *capsule);
    /* cuLaunchKernel(fn) on stream (a CUstream; NULL: the legacy default stream) with args
     * pointing at each argument's value. 0, or -1 with the driver's error in err (errlen bytes).
     * Any thread, GIL or not. */
    int (*launch)(void *cuda, void *fn, const uint32_t grid[3], int block, int smem, void *stream,
                  void **args, char *err, size_t errlen);
    /* 1 if stream is being captured into a CUDA graph, 0 if not, -1 with err. Any thread. */
    int (*capturing)(void *cuda, void *stream, char *err, size_t errlen);
    /* The CUfunction behind a function object (kbench._C.get_function's), or NULL if `capsule`
     * is not one, or was loaded through another driver than `cuda`. Borrowed: the caller keeps
     * the object alive (it keeps its module loaded) while it launches the result. Needs the GIL. */
    void *(*function_of)(void *capsule, void *cuda);
} kb_launch_api;

#ifdef __cplusplus
}
#endif
#endif
