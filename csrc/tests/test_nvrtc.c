/* test_nvrtc.c — NVRTC through kb_nvrtc_* on the CPU (no GPU needed): library search and the
 * not-found message, CUBIN output for sm_80/sm_90 (with and without bf16/fp16 headers), the
 * compile-error log, the on-disk cache (hit, corrupted file replaced), allocation failures. */
#define _GNU_SOURCE
#include "core/internal.h"

#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/cuda_check.h"

static const char *SAXPY =
    "extern \"C\" __global__ void saxpy(float *y, const float *x, float a, long long n) {\n"
    "    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
    "    if (i < n) y[i] = a * x[i] + y[i];\n"
    "}\n";

static const char *HALVES =
    "#include <cuda_bf16.h>\n"
    "#include <cuda_fp16.h>\n"
    "extern \"C\" __global__ void halves(__nv_bfloat16 *b, __half *h, float *f, long long n) {\n"
    "    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
    "    if (i >= n) return;\n"
    "    float v = __bfloat162float(b[i]) + __half2float(h[i]);\n"
    "    f[i] = v;\n"
    "    b[i] = __float2bfloat16_rn(v * 2.0f);\n"
    "    h[i] = __float2half_rn(v * 0.5f);\n"
    "}\n";

static const char *BROKEN =
    "extern \"C\" __global__ void broken(float *y) {\n"
    "    y[threadIdx.x] = undefined_thing_kb + 1.0f;\n"
    "}\n";

/* The dirs to search: $KB_TEST_NVRTC_DIRS (colon-separated; the Makefile puts the pip wheels'
 * nvidia/<pkg>/lib folders there) and the toolkit's. */
static int test_dirs(char *buf, size_t n, const char **dirs, int max) {
    int nd = 0;
    const char *env = getenv("KB_TEST_NVRTC_DIRS");
    snprintf(buf, n, "%s", env ? env : "");
    for (char *s = strtok(buf, ":"); s && nd < max - 1; s = strtok(NULL, ":")) dirs[nd++] = s;
    dirs[nd++] = "/usr/local/cuda/lib64";
    return nd;
}

static int is_elf(const void *p, size_t n) { return n > 64 && memcmp(p, "\x7f" "ELF", 4) == 0; }

static void *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *p = malloc(len > 0 ? (size_t)len : 1);
    *n = fread(p, 1, (size_t)len, f);
    fclose(f);
    return p;
}

static void write_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fwrite(p, 1, n, f);
    fclose(f);
}

/* The one *.cubin in dir (the test's cache holds one entry at a time); 1 if found. */
static int find_cubin(const char *dir, char *out, size_t n, int *count) {
    DIR *d = opendir(dir);
    *count = 0;
    if (!d) return 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (len > 6 && strcmp(e->d_name + len - 6, ".cubin") == 0) {
            snprintf(out, n, "%s/%s", dir, e->d_name);
            (*count)++;
        }
    }
    closedir(d);
    return *count > 0;
}

static void test_compile(kb_ctx *ctx, kb_nvrtc *nv) {
    static const char *const archs[] = {"sm_80", "sm_90"};
    static const char *const *const sources[] = {&SAXPY, &HALVES};
    for (int a = 0; a < 2; a++) {
        for (int s = 0; s < 2; s++) {
            void *cubin = NULL;
            size_t size = 0;
            char *log = NULL;
            kb_status st = kb_nvrtc_compile(ctx, nv, *sources[s], archs[a], NULL, &cubin, &size, &log);
            CHECK(st == KB_OK, "compile %s source %d: %s", archs[a], s, kb_ctx_error(ctx));
            CHECK(st != KB_OK || is_elf(cubin, size), "not an ELF CUBIN (%zu bytes)", size);
            kb_blob_free(ctx, cubin, size);
            kb_string_free(ctx, log);
        }
    }
    void *cubin = (void *)1;
    size_t size = 7;
    char *log = NULL;
    kb_status st = kb_nvrtc_compile(ctx, nv, BROKEN, "sm_90", NULL, &cubin, &size, &log);
    CHECK(st == KB_ERR_NVRTC, "broken source gave %s", kb_status_name(st));
    CHECK(cubin == NULL && size == 0, "outputs not cleared on failure");
    CHECK(log && strstr(log, "undefined_thing_kb"), "log does not name the error: %s", log ? log : "(null)");
    CHECK(strstr(kb_ctx_error(ctx), "undefined_thing_kb"), "ctx error lacks the log: %s", kb_ctx_error(ctx));
    kb_string_free(ctx, log);
    st = kb_nvrtc_compile(ctx, nv, SAXPY, "compute_90", NULL, &cubin, &size, NULL);
    CHECK(st == KB_ERR_INVALID, "bad arch gave %s", kb_status_name(st));
}

static int same(const void *a, size_t na, const void *b, size_t nb) { return na == nb && memcmp(a, b, na) == 0; }

static void test_cache(kb_ctx *ctx, kb_nvrtc *nv) {
    char root[] = "/tmp/kb_test_nvrtc_XXXXXX", dir[128], file[512], file2[600];
    if (!mkdtemp(root)) {
        CHECK(0, "mkdtemp failed");
        return;
    }
    snprintf(dir, sizeof dir, "%s/a/b", root); /* missing parents: mkdir -p */
    void *c1 = NULL, *c2 = NULL, *c3 = NULL, *other = NULL;
    size_t n1 = 0, n2 = 0, n3 = 0, nother = 0, nf = 0;
    int count = 0;
    kb_status st = kb_nvrtc_compile(ctx, nv, SAXPY, "sm_90", dir, &c1, &n1, NULL);
    CHECK(st == KB_OK, "cached compile: %s", kb_ctx_error(ctx));
    CHECK(find_cubin(dir, file, sizeof file, &count) && count == 1, "expected one cache file, found %d", count);

    /* a hit returns the file's content: swap in another kernel's entry and get it back */
    st = kb_nvrtc_compile(ctx, nv, HALVES, "sm_90", dir, &other, &nother, NULL);
    CHECK(st == KB_OK, "second kernel: %s", kb_ctx_error(ctx));
    find_cubin(dir, file2, sizeof file2, &count);
    CHECK(count == 2, "expected two cache files, found %d", count);
    if (strcmp(file, file2) == 0) { /* readdir order: file2 may be the first entry */
        DIR *d = opendir(dir);
        struct dirent *e;
        while ((e = readdir(d)))
            if (strstr(e->d_name, ".cubin") && !strstr(file, e->d_name)) snprintf(file2, sizeof file2, "%s/%s", dir, e->d_name);
        closedir(d);
    }
    size_t nsaxpy_file = 0, nother_file = 0;
    void *saxpy_file = read_file(file, &nsaxpy_file), *other_file = read_file(file2, &nother_file);
    CHECK(saxpy_file && other_file && strcmp(file, file2) != 0, "cache files unreadable");
    write_file(file, other_file, nother_file);
    st = kb_nvrtc_compile(ctx, nv, SAXPY, "sm_90", dir, &c2, &n2, NULL);
    CHECK(st == KB_OK && same(c2, n2, other, nother), "second compile was not served from the cache");
    kb_blob_free(ctx, c2, n2);
    c2 = NULL;
    write_file(file, saxpy_file, nsaxpy_file);
    st = kb_nvrtc_compile(ctx, nv, SAXPY, "sm_90", dir, &c2, &n2, NULL);
    CHECK(st == KB_OK && same(c1, n1, c2, n2), "cached result differs from the compiled one");

    /* a corrupted entry (one flipped byte) and a truncated one are recompiled and replaced */
    for (int mode = 0; mode < 2; mode++) {
        unsigned char *bad = malloc(nsaxpy_file);
        memcpy(bad, saxpy_file, nsaxpy_file);
        if (mode == 0) bad[nsaxpy_file / 2] ^= 0x5a;
        write_file(file, bad, mode == 0 ? nsaxpy_file : nsaxpy_file / 3);
        free(bad);
        st = kb_nvrtc_compile(ctx, nv, SAXPY, "sm_90", dir, &c3, &n3, NULL);
        CHECK(st == KB_OK && same(c1, n1, c3, n3), "mode %d: corrupted entry was used", mode);
        kb_blob_free(ctx, c3, n3);
        c3 = NULL;
        void *fixed = read_file(file, &nf);
        CHECK(fixed && same(fixed, nf, saxpy_file, nsaxpy_file), "mode %d: corrupted entry not rewritten", mode);
        free(fixed);
    }
    /* no temporary files left behind */
    DIR *d = opendir(dir);
    struct dirent *e;
    int tmp = 0;
    while (d && (e = readdir(d))) tmp += strstr(e->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    CHECK(tmp == 0, "%d temporary files left in the cache", tmp);
    /* a cache_dir that cannot be created is an I/O error */
    snprintf(file2, sizeof file2, "%s/sub", file); /* a folder under a regular file */
    st = kb_nvrtc_compile(ctx, nv, SAXPY, "sm_80", file2, &c3, &n3, NULL);
    CHECK(st == KB_ERR_IO && c3 == NULL, "cache dir under a file gave %s", kb_status_name(st));

    free(saxpy_file);
    free(other_file);
    kb_blob_free(ctx, c1, n1);
    kb_blob_free(ctx, c2, n2);
    kb_blob_free(ctx, other, nother);
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    CHECK(system(cmd) == 0, "cleanup failed");
}

static void test_not_found(kb_ctx *ctx) {
    kb_nvrtc *nv = (kb_nvrtc *)1;
    setenv("KBENCH_NVRTC", "/nonexistent/kb/libnvrtc.so.99", 1);
    kb_status st = kb_nvrtc_open(ctx, NULL, 0, &nv);
    CHECK(st == KB_ERR_NOT_FOUND && nv == NULL, "bad KBENCH_NVRTC gave %s", kb_status_name(st));
    CHECK(strstr(kb_ctx_error(ctx), "/nonexistent/kb/libnvrtc.so.99"), "message: %s", kb_ctx_error(ctx));
    unsetenv("KBENCH_NVRTC");

    const char *old_home = getenv("CUDA_HOME");
    char *saved = old_home ? strdup(old_home) : NULL;
    setenv("CUDA_HOME", "/nonexistent/kb/cuda", 1);
    const char *dirs[] = {"/nonexistent/kb/wheel/lib"};
    st = kb_nvrtc_open(ctx, dirs, 1, &nv);
    if (st == KB_OK) {
        printf("note: NVRTC is on this machine's default paths (%s); the listing check is skipped\n",
               kb_nvrtc_path(nv));
        kb_nvrtc_close(nv);
    } else {
        const char *msg = kb_ctx_error(ctx);
        CHECK(st == KB_ERR_NOT_FOUND, "gave %s", kb_status_name(st));
        CHECK(strstr(msg, "/nonexistent/kb/wheel/lib") && strstr(msg, "/nonexistent/kb/cuda/lib64") &&
                  strstr(msg, "/usr/local/cuda/lib64") && strstr(msg, "loader"),
              "message does not list every place: %s", msg);
    }
    if (saved) setenv("CUDA_HOME", saved, 1);
    else unsetenv("CUDA_HOME");
    free(saved);
}

/* An allocator that fails after `budget` allocations and tracks the bytes outstanding. */
typedef struct { long budget; long long live; } failing;

static void *failing_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
    failing *f = ud;
    if (nsize == 0) {
        if (ptr) f->live -= (long long)osize;
        free(ptr);
        return NULL;
    }
    if (f->budget-- <= 0) return NULL;
    void *q = realloc(ptr, nsize);
    if (q) f->live += (long long)nsize - (long long)(ptr ? osize : 0);
    return q;
}

static void test_oom(const char *const *dirs, int nd) {
    char root[] = "/tmp/kb_test_oom_XXXXXX";
    if (!mkdtemp(root)) return;
    int ok_at = -1;
    for (long k = 1; k < 200 && ok_at < 0; k++) {
        for (int pass = 0; pass < 2; pass++) { /* pass 0 compiles and writes, pass 1 hits the cache */
            failing f = {k, 0};
            kb_ctx *ctx = NULL;
            if (kb_ctx_new(failing_alloc, &f, &ctx) != KB_OK) continue;
            kb_nvrtc *nv = NULL;
            void *cubin = NULL;
            size_t size = 0;
            char *log = NULL;
            kb_status st = kb_nvrtc_open(ctx, dirs, nd, &nv);
            if (st == KB_OK) st = kb_nvrtc_compile(ctx, nv, SAXPY, "sm_80", root, &cubin, &size, &log);
            CHECK(st == KB_OK || st == KB_ERR_OOM, "budget %ld: %s (%s)", k, kb_status_name(st), kb_ctx_error(ctx));
            if (st == KB_OK && pass == 1) ok_at = (int)k;
            kb_blob_free(ctx, cubin, size);
            kb_string_free(ctx, log);
            kb_nvrtc_close(nv);
            kb_ctx_free(ctx);
            CHECK(f.live == 0, "budget %ld: %lld bytes leaked", k, f.live);
        }
    }
    CHECK(ok_at > 0, "never succeeded under the failing allocator");
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    CHECK(system(cmd) == 0, "cleanup failed");
}

int main(void) {
    kb_ctx *ctx = NULL;
    if (kb_ctx_new(NULL, NULL, &ctx) != KB_OK) return 1;
    unsetenv("KBENCH_NVRTC");
    test_not_found(ctx);

    char buf[4096];
    const char *dirs[16];
    int nd = test_dirs(buf, sizeof buf, dirs, 16);
    kb_nvrtc *nv = NULL;
    kb_status st = kb_nvrtc_open(ctx, dirs, nd, &nv);
    if (st != KB_OK) {
        printf("test_nvrtc: SKIPPED the compile tests, no NVRTC: %s\n", kb_ctx_error(ctx));
    } else {
        printf("NVRTC %d from %s; headers: %s\n", kb_nvrtc_version(nv), kb_nvrtc_path(nv),
               kb_nvrtc_include_dir(nv)[0] ? kb_nvrtc_include_dir(nv) : "(none)");
        CHECK(kb_nvrtc_version(nv) >= 11020, "version %d", kb_nvrtc_version(nv));
        test_compile(ctx, nv);
        test_cache(ctx, nv);
        kb_nvrtc_close(nv);
        test_oom(dirs, nd);
    }
    kb_ctx_free(ctx);
    printf("test_nvrtc: %d checks, %d failed\n", checks, failures);
    printf("%d passed, %d failed\n", checks - failures, failures);
    return failures ? 1 : 0;
}
