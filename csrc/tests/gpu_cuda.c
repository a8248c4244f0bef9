/* gpu_cuda.c — the CUDA driver (cuda/driver.c) on a real GPU (skips where libcuda is missing):
 * device info, compile for the device's arch, load, launch, read back; a launch from a thread
 * with no current context; refused launches reported with the driver's error name. */
#define _GNU_SOURCE
#include "core/internal.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "tests/cuda_check.h"

static const char *SAXPY =
    "extern \"C\" __global__ void saxpy(float *y, const float *x, long long n, float a) {\n"
    "    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
    "    if (i < n) y[i] = a * x[i] + y[i];\n"
    "}\n";

typedef struct {
    kb_cuda *cuda;
    void *fn;
    uint64_t y, x;
    long long n;
    kb_status st;
    char error[512];
} job;

/* a pthread has no current context: kb_cuda_launch must give it one */
static void *launch_in_thread(void *arg) {
    job *j = arg;
    kb_ctx *ctx = NULL;
    if (kb_ctx_new(NULL, NULL, &ctx) != KB_OK) return NULL;
    float a = 1.0f;
    void *args[] = {&j->y, &j->x, &j->n, &a};
    uint32_t grid[3] = {(uint32_t)((j->n + 255) / 256), 1, 1};
    j->st = kb_cuda_launch(ctx, j->cuda, j->fn, grid, 256, 0, NULL, args);
    if (j->st == KB_OK) j->st = kb_cuda_synchronize(ctx, j->cuda, NULL);
    snprintf(j->error, sizeof j->error, "%s", kb_ctx_error(ctx));
    kb_ctx_free(ctx);
    return NULL;
}

int main(void) {
    kb_ctx *ctx = NULL;
    kb_cuda *cuda = NULL;
    kb_nvrtc *nv = NULL;
    if (kb_ctx_new(NULL, NULL, &ctx) != KB_OK) return 1;
    kb_status st = kb_cuda_open(ctx, &cuda);
    if (st == KB_ERR_NOT_FOUND || (st == KB_ERR_CUDA && strstr(kb_ctx_error(ctx), "NO_DEVICE"))) {
        printf("gpu_cuda: SKIPPED, no GPU: %s\n", kb_ctx_error(ctx));
        kb_ctx_free(ctx);
        return 0;
    }
    CHECK(st == KB_OK, "%s", kb_ctx_error(ctx));
    if (st != KB_OK) return 1;
    kb_device_info dev;
    st = kb_cuda_device_info(ctx, cuda, 0, &dev);
    CHECK(st == KB_OK && dev.sm >= 50 && dev.num_sms > 0 && dev.l2_bytes > 0 && dev.max_smem_per_block >= 49152,
          "device info: %s", kb_ctx_error(ctx));
    printf("driver %d, sm_%d, %d SMs, %d B smem/block, %d regs/SM, %d B L2\n", kb_cuda_driver_version(cuda), dev.sm,
           dev.num_sms, dev.max_smem_per_block, dev.regs_per_sm, dev.l2_bytes);
    st = kb_cuda_device_info(ctx, cuda, 999, &dev);
    CHECK(st == KB_ERR_CUDA && strstr(kb_ctx_error(ctx), "CUDA_ERROR_INVALID_DEVICE"), "%s", kb_ctx_error(ctx));

    const char *dirs[8];
    int nd = 0;
    char buf[2048];
    const char *env = getenv("KB_TEST_NVRTC_DIRS");
    snprintf(buf, sizeof buf, "%s", env ? env : "");
    for (char *s = strtok(buf, ":"); s && nd < 7; s = strtok(NULL, ":")) dirs[nd++] = s;
    st = kb_nvrtc_open(ctx, dirs, nd, &nv);
    CHECK(st == KB_OK, "%s", kb_ctx_error(ctx));
    if (st != KB_OK) return 1;
    kb_cuda_device_info(ctx, cuda, 0, &dev);
    char arch[16];
    snprintf(arch, sizeof arch, "sm_%d", dev.sm);
    void *cubin = NULL;
    size_t size = 0;
    st = kb_nvrtc_compile(ctx, nv, SAXPY, arch, NULL, NULL, 0, &cubin, &size, NULL);
    CHECK(st == KB_OK, "%s", kb_ctx_error(ctx));

    kb_cuda_module *mod = NULL;
    st = kb_cuda_module_load(ctx, cuda, cubin, size, &mod);
    CHECK(st == KB_OK, "%s", kb_ctx_error(ctx));
    kb_cuda_module *none = NULL;
    st = kb_cuda_module_load(ctx, cuda, cubin, 63, &none); /* truncated: refused before the driver */
    CHECK(st == KB_ERR_INVALID && !none, "truncated CUBIN gave %s", kb_status_name(st));
    void *fn = NULL;
    int regs = -1, spills = -1;
    st = kb_cuda_function(ctx, cuda, mod, "saxpy", 0, &fn, &regs, &spills);
    CHECK(st == KB_OK && fn && regs > 0 && spills == 0, "%s (regs %d spills %d)", kb_ctx_error(ctx), regs, spills);
    st = kb_cuda_function(ctx, cuda, mod, "nope", 0, &fn, NULL, NULL);
    CHECK(st == KB_ERR_CUDA && strstr(kb_ctx_error(ctx), "CUDA_ERROR_NOT_FOUND"), "%s", kb_ctx_error(ctx));
    kb_cuda_function(ctx, cuda, mod, "saxpy", 0, &fn, NULL, NULL);

    long long n = 100003;
    float *hx = malloc(n * sizeof *hx), *hy = malloc(n * sizeof *hy), *out = malloc(n * sizeof *out);
    for (long long i = 0; i < n; i++) {
        hx[i] = (float)(i % 97) * 0.25f;
        hy[i] = (float)(i % 13) - 6.0f;
    }
    uint64_t dx = 0, dy = 0;
    CHECK(kb_cuda_mem_alloc(ctx, cuda, n * sizeof(float), &dx) == KB_OK, "%s", kb_ctx_error(ctx));
    CHECK(kb_cuda_mem_alloc(ctx, cuda, n * sizeof(float), &dy) == KB_OK, "%s", kb_ctx_error(ctx));
    kb_cuda_copy_to_device(ctx, cuda, dx, hx, n * sizeof(float));
    kb_cuda_copy_to_device(ctx, cuda, dy, hy, n * sizeof(float));
    float a = 2.5f;
    void *args[] = {&dy, &dx, &n, &a};
    uint32_t grid[3] = {(uint32_t)((n + 255) / 256), 1, 1};
    st = kb_cuda_launch(ctx, cuda, fn, grid, 256, 0, NULL, args);
    CHECK(st == KB_OK, "%s", kb_ctx_error(ctx));
    CHECK(kb_cuda_synchronize(ctx, cuda, NULL) == KB_OK, "%s", kb_ctx_error(ctx));
    kb_cuda_copy_to_host(ctx, cuda, out, dy, n * sizeof(float));
    int bad = 0;
    for (long long i = 0; i < n; i++) bad += fabsf(out[i] - (2.5f * hx[i] + hy[i])) > 1e-5f;
    CHECK(bad == 0, "%d wrong elements", bad);

    /* host cost of one launch through kb_cuda_launch (printed, never asserted) */
    {
        struct timespec t0, t1;
        int reps = 500; /* below the launch queue's depth, so this is host time */
        a = 0.0f;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (int i = 0; i < reps; i++) kb_cuda_launch(ctx, cuda, fn, grid, 256, 0, NULL, args);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        kb_cuda_synchronize(ctx, cuda, NULL);
        printf("kb_cuda_launch: %.2f us per launch (host side)\n",
               ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / reps / 1e3);
        a = 2.5f;
    }

    /* refused launches name the driver's error */
    st = kb_cuda_launch(ctx, cuda, fn, grid, 4096, 0, NULL, args);
    CHECK(st == KB_ERR_CUDA && strstr(kb_ctx_error(ctx), "CUDA_ERROR_INVALID_VALUE"), "%s", kb_ctx_error(ctx));

    /* another thread, no context of its own: y += x once more */
    job j = {cuda, fn, dy, dx, n, KB_ERR_INVALID, ""};
    pthread_t t;
    pthread_create(&t, NULL, launch_in_thread, &j);
    pthread_join(t, NULL);
    CHECK(j.st == KB_OK, "thread launch: %s", j.error);
    kb_cuda_copy_to_host(ctx, cuda, out, dy, n * sizeof(float));
    bad = 0;
    for (long long i = 0; i < n; i++) bad += fabsf(out[i] - (3.5f * hx[i] + hy[i])) > 1e-5f;
    CHECK(bad == 0, "%d wrong elements after the thread's launch", bad);

    kb_cuda_mem_free(cuda, dx);
    kb_cuda_mem_free(cuda, dy);
    kb_cuda_module_unload(cuda, mod);
    kb_blob_free(ctx, cubin, size);
    kb_nvrtc_close(nv);
    kb_cuda_close(cuda);
    kb_ctx_free(ctx);
    free(hx);
    free(hy);
    free(out);
    printf("gpu_cuda: %d checks, %d failed\n", checks, failures);
    printf("%d passed, %d failed\n", checks - failures, failures);
    return failures ? 1 : 0;
}
