/* test_nvrtc.c — NVRTC through kb_nvrtc_* on the CPU (no GPU needed): library search and the
 * not-found message, CUBIN output for sm_80/sm_90 (with and without bf16/fp16 headers), the
 * compile-error log, the on-disk cache (hit; corrupted, swapped or foreign-signed file replaced),
 * its SHA-256 / HMAC against published vectors, allocation failures. */
#define _GNU_SOURCE
#include "core/internal.h"
#include "cuda/cuda.h"

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

/* the cache's secret in these tests, and another user's */
static const unsigned char KEY[32] = "kbench test key, thirty-two b.";
static const unsigned char OTHER_KEY[32] = "someone else's key, 32 bytes...";

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
            kb_status st = kb_nvrtc_compile(ctx, nv, *sources[s], archs[a], NULL, NULL, 0, &cubin, &size, &log);
            CHECK(st == KB_OK, "compile %s source %d: %s", archs[a], s, kb_ctx_error(ctx));
            CHECK(st != KB_OK || is_elf(cubin, size), "not an ELF CUBIN (%zu bytes)", size);
            kb_blob_free(ctx, cubin, size);
            kb_string_free(ctx, log);
        }
    }
    void *cubin = (void *)1;
    size_t size = 7;
    char *log = NULL;
    kb_status st = kb_nvrtc_compile(ctx, nv, BROKEN, "sm_90", NULL, NULL, 0, &cubin, &size, &log);
    CHECK(st == KB_ERR_NVRTC, "broken source gave %s", kb_status_name(st));
    CHECK(cubin == NULL && size == 0, "outputs not cleared on failure");
    CHECK(log && strstr(log, "undefined_thing_kb"), "log does not name the error: %s", log ? log : "(null)");
    CHECK(strstr(kb_ctx_error(ctx), "undefined_thing_kb"), "ctx error lacks the log: %s", kb_ctx_error(ctx));
    kb_string_free(ctx, log);
    st = kb_nvrtc_compile(ctx, nv, SAXPY, "compute_90", NULL, NULL, 0, &cubin, &size, NULL);
    CHECK(st == KB_ERR_INVALID, "bad arch gave %s", kb_status_name(st));
}

static int same(const void *a, size_t na, const void *b, size_t nb) { return na == nb && memcmp(a, b, na) == 0; }

static ino_t inode_of(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 ? st.st_ino : 0;
}

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
    /* a cache without a key is refused: an unsigned file could not be told from a planted one */
    kb_status st = kb_nvrtc_compile(ctx, nv, SAXPY, "sm_90", dir, NULL, 0, &c1, &n1, NULL);
    CHECK(st == KB_ERR_INVALID && !c1 && strstr(kb_ctx_error(ctx), "key"), "no key gave %s", kb_status_name(st));
    st = kb_nvrtc_compile(ctx, nv, SAXPY, "sm_90", dir, KEY, 8, &c1, &n1, NULL);
    CHECK(st == KB_ERR_INVALID && !c1, "an 8-byte key gave %s", kb_status_name(st));

    st = kb_nvrtc_compile(ctx, nv, SAXPY, "sm_90", dir, KEY, sizeof KEY, &c1, &n1, NULL);
    CHECK(st == KB_OK, "cached compile: %s", kb_ctx_error(ctx));
    CHECK(find_cubin(dir, file, sizeof file, &count) && count == 1, "expected one cache file, found %d", count);

    /* a hit reads the file and leaves it alone (a miss would rename a fresh one over it) */
    ino_t ino = inode_of(file);
    st = kb_nvrtc_compile(ctx, nv, SAXPY, "sm_90", dir, KEY, sizeof KEY, &c2, &n2, NULL);
    CHECK(st == KB_OK && same(c1, n1, c2, n2), "cached result differs from the compiled one");
    CHECK(ino && inode_of(file) == ino, "a hit rewrote the cache file");
    kb_blob_free(ctx, c2, n2);
    c2 = NULL;

    /* another kernel's entry (well formed, signed with the key) under this one's name: its claims
     * (source hash) do not match, so it is recompiled and replaced, not returned */
    st = kb_nvrtc_compile(ctx, nv, HALVES, "sm_90", dir, KEY, sizeof KEY, &other, &nother, NULL);
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
    st = kb_nvrtc_compile(ctx, nv, SAXPY, "sm_90", dir, KEY, sizeof KEY, &c2, &n2, NULL);
    CHECK(st == KB_OK && same(c1, n1, c2, n2), "a swapped entry was served from the cache");
    void *fixed = read_file(file, &nf);
    CHECK(fixed && same(fixed, nf, saxpy_file, nsaxpy_file), "a swapped entry was not rewritten");
    free(fixed);

    /* the same entry read under another key (a cache another user wrote, or copied from elsewhere):
     * recompiled, and rewritten signed with this key */
    st = kb_nvrtc_compile(ctx, nv, SAXPY, "sm_90", dir, OTHER_KEY, sizeof OTHER_KEY, &c3, &n3, NULL);
    CHECK(st == KB_OK && same(c1, n1, c3, n3), "other key: %s", kb_ctx_error(ctx));
    kb_blob_free(ctx, c3, n3);
    c3 = NULL;
    fixed = read_file(file, &nf);
    CHECK(fixed && nf == nsaxpy_file && !same(fixed, nf, saxpy_file, nsaxpy_file) &&
              memcmp(fixed, saxpy_file, n1) == 0, "an entry signed with another key was not re-signed");
    free(fixed);
    write_file(file, saxpy_file, nsaxpy_file);

    /* a corrupted entry (one flipped byte in the CUBIN, or in the trailer's claims) and a truncated
     * one are recompiled and replaced */
    for (int mode = 0; mode < 3; mode++) {
        unsigned char *bad = malloc(nsaxpy_file);
        memcpy(bad, saxpy_file, nsaxpy_file);
        if (mode == 0) bad[n1 / 2] ^= 0x5a;
        if (mode == 1) bad[n1 + 20] ^= 0x01; /* the NVRTC version */
        write_file(file, bad, mode == 2 ? nsaxpy_file / 3 : nsaxpy_file);
        free(bad);
        st = kb_nvrtc_compile(ctx, nv, SAXPY, "sm_90", dir, KEY, sizeof KEY, &c3, &n3, NULL);
        CHECK(st == KB_OK && same(c1, n1, c3, n3), "mode %d: corrupted entry was used", mode);
        kb_blob_free(ctx, c3, n3);
        c3 = NULL;
        fixed = read_file(file, &nf);
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
    st = kb_nvrtc_compile(ctx, nv, SAXPY, "sm_80", file2, KEY, sizeof KEY, &c3, &n3, NULL);
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

static void hex32(const unsigned char *d, char out[65]) {
    for (int i = 0; i < 32; i++) snprintf(out + 2 * i, 3, "%02x", d[i]);
}

/* SHA-256 (FIPS 180-4 examples) and HMAC-SHA256 (RFC 4231 cases 2 and 6) */
static void test_hashes(void) {
    unsigned char d[32];
    char hex[65];
    cuda_sha256 s;
    cuda_sha256_init(&s);
    cuda_sha256_update(&s, "abc", 3);
    cuda_sha256_final(&s, d);
    hex32(d, hex);
    CHECK(strcmp(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad") == 0, "sha256(abc) %s", hex);
    static char chunk[997];
    memset(chunk, 'a', sizeof chunk);
    cuda_sha256_init(&s);
    size_t left = 1000000;
    for (size_t k = 1; left; k = k % 997 + 1) { /* uneven pieces: the block buffering */
        size_t take = k < left ? k : left;
        cuda_sha256_update(&s, chunk, take);
        left -= take;
    }
    cuda_sha256_final(&s, d);
    hex32(d, hex);
    CHECK(strcmp(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0") == 0, "sha256(a*1e6) %s",
          hex);
    const char *msg = "what do ya want ", *msg2 = "for nothing?";
    const void *parts[2] = {msg, msg2};
    size_t lens[2] = {strlen(msg), strlen(msg2)};
    cuda_hmac_sha256("Jefe", 4, parts, lens, 2, d);
    hex32(d, hex);
    CHECK(strcmp(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843") == 0, "hmac case 2 %s", hex);
    unsigned char big[131];
    memset(big, 0xaa, sizeof big);
    const char *m6 = "Test Using Larger Than Block-Size Key - Hash Key First";
    const void *p6[1] = {m6};
    size_t l6[1] = {strlen(m6)};
    cuda_hmac_sha256(big, sizeof big, p6, l6, 1, d);
    hex32(d, hex);
    CHECK(strcmp(hex, "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54") == 0, "hmac case 6 %s", hex);
    unsigned char e[32];
    memcpy(e, d, 32);
    CHECK(cuda_digest_equal(d, e, 32), "equal digests compare unequal");
    e[31] ^= 1;
    CHECK(!cuda_digest_equal(d, e, 32), "different digests compare equal");
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
            if (st == KB_OK) st = kb_nvrtc_compile(ctx, nv, SAXPY, "sm_80", root, KEY, sizeof KEY, &cubin, &size, &log);
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
    test_hashes();
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
