/* nvrtc.c — NVRTC, dlopen'ed at first use (no CUDA headers at build time: the few types and
 * entry points used are declared below): finding the library and the CUDA headers it needs, and
 * compiling a kernel to a CUBIN with an on-disk cache. The driver is driver.c. */
#define _GNU_SOURCE /* dlinfo, RTLD_DI_LINKMAP */
#include "cuda/cuda.h"

#include <dlfcn.h>
#include <errno.h>
#include <glob.h>
#include <limits.h>
#include <link.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef PATH_MAX
#define PATH_MAX 4096
#endif

/* out = a + b; 0 if it did not fit (the caller then skips that candidate) */
static int pjoin(char *out, size_t n, const char *a, const char *b) {
    int k = snprintf(out, n, "%s%s", a, b);
    return k >= 0 && (size_t)k < n;
}

static int file_exists(const char *path) { return access(path, F_OK) == 0; }

static int is_dir(const char *path) {
    struct stat s;
    return stat(path, &s) == 0 && S_ISDIR(s.st_mode);
}

/* ================================================================ NVRTC */

typedef int nvrtcResult; /* NVRTC_SUCCESS = 0 */
typedef struct _nvrtcProgram *nvrtcProgram;

struct kb_nvrtc {
    kb_ctx *ctx;            /* allocated this struct */
    void *lib;
    void *builtins;         /* libnvrtc-builtins from the same folder, preloaded (see open_at) */
    int version;            /* major*1000 + minor*10 */
    char path[PATH_MAX];
    char include_dir[PATH_MAX]; /* "" when no folder with cuda_fp16.h and cuda_bf16.h was found */
    char *include_looked;   /* kb_string: where headers were searched, for error hints */
    nvrtcResult (*Version)(int *, int *);
    const char *(*GetErrorString)(nvrtcResult);
    nvrtcResult (*CreateProgram)(nvrtcProgram *, const char *, const char *, int,
                                 const char *const *, const char *const *);
    nvrtcResult (*DestroyProgram)(nvrtcProgram *);
    nvrtcResult (*CompileProgram)(nvrtcProgram, int, const char *const *);
    nvrtcResult (*GetCUBINSize)(nvrtcProgram, size_t *);
    nvrtcResult (*GetCUBIN)(nvrtcProgram, char *);
    nvrtcResult (*GetProgramLogSize)(nvrtcProgram, size_t *);
    nvrtcResult (*GetProgramLog)(nvrtcProgram, char *);
};

static const struct { size_t off; const char *name; } nvrtc_syms[] = {
    {offsetof(kb_nvrtc, Version), "nvrtcVersion"},
    {offsetof(kb_nvrtc, GetErrorString), "nvrtcGetErrorString"},
    {offsetof(kb_nvrtc, CreateProgram), "nvrtcCreateProgram"},
    {offsetof(kb_nvrtc, DestroyProgram), "nvrtcDestroyProgram"},
    {offsetof(kb_nvrtc, CompileProgram), "nvrtcCompileProgram"},
    {offsetof(kb_nvrtc, GetCUBINSize), "nvrtcGetCUBINSize"},   /* NVRTC >= 11.1 */
    {offsetof(kb_nvrtc, GetCUBIN), "nvrtcGetCUBIN"},
    {offsetof(kb_nvrtc, GetProgramLogSize), "nvrtcGetProgramLogSize"},
    {offsetof(kb_nvrtc, GetProgramLog), "nvrtcGetProgramLog"},
};

/* Tries one library file (a path with a '/', or a bare soname for the loader's path). On
 * success fills n and returns 1; otherwise appends why to looked and returns 0. */
static int open_at(kb_nvrtc *n, const char *file, kb_sb *looked) {
    void *lib = dlopen(file, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *e = dlerror();
        if (e && strstr(e, file)) kb_sb_printf(looked, "\n  %s", e); /* dlerror names the file */
        else kb_sb_printf(looked, "\n  %s: %s", file, e ? e : "dlopen failed");
        return 0;
    }
    for (size_t i = 0; i < sizeof nvrtc_syms / sizeof nvrtc_syms[0]; i++) {
        if (!load_sym(lib, (char *)n + nvrtc_syms[i].off, nvrtc_syms[i].name, NULL)) {
            kb_sb_printf(looked, "\n  %s: has no %s (NVRTC older than 11.2?)", file, nvrtc_syms[i].name);
            dlclose(lib);
            return 0;
        }
    }
    int major = 0, minor = 0;
    if (n->Version(&major, &minor) != 0) {
        kb_sb_printf(looked, "\n  %s: nvrtcVersion failed", file);
        dlclose(lib);
        return 0;
    }
    n->lib = lib;
    n->version = major * 1000 + minor * 10;
    /* the real path of what was loaded (the loader's path gives only a soname) */
    struct link_map *lm = NULL;
    const char *real = (dlinfo(lib, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name && lm->l_name[0])
                           ? lm->l_name : file;
    snprintf(n->path, sizeof n->path, "%s", real);
    /* NOTE: NVRTC dlopens libnvrtc-builtins.so.M.m by bare name at its first compile. The pip
     * wheels carry it beside libnvrtc but on no loader path, so that dlopen fails unless the
     * builtins are already loaded: preload them from the same folder (a loaded object's soname
     * satisfies a later dlopen of that name). */
    char dir[PATH_MAX], b[PATH_MAX + 64];
    snprintf(dir, sizeof dir, "%s", n->path);
    char *slash = strrchr(dir, '/');
    if (slash) {
        *slash = '\0';
        snprintf(b, sizeof b, "%s/libnvrtc-builtins.so.%d.%d", dir, major, minor);
        if (file_exists(b)) n->builtins = dlopen(b, RTLD_NOW | RTLD_LOCAL);
    }
    return 1;
}

/* Tries the usual sonames in one folder, then any other libnvrtc.so.* there. */
static int open_in_dir(kb_nvrtc *n, const char *dir, kb_sb *looked) {
    static const char *const names[] = {"libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2"};
    char path[PATH_MAX];
    if (!is_dir(dir)) {
        kb_sb_printf(looked, "\n  %s: no such directory", dir);
        return 0;
    }
    int seen = 0;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (snprintf(path, sizeof path, "%s/%s", dir, names[i]) >= (int)sizeof path) continue;
        if (!file_exists(path)) continue;
        seen = 1;
        if (open_at(n, path, looked)) return 1;
    }
    if (snprintf(path, sizeof path, "%s/libnvrtc.so.*", dir) < (int)sizeof path) {
        glob_t gl;
        if (glob(path, 0, NULL, &gl) == 0) {
            for (size_t i = gl.gl_pathc; i-- > 0;) { /* newest first: glob sorts ascending */
                seen = 1;
                if (open_at(n, gl.gl_pathv[i], looked)) {
                    globfree(&gl);
                    return 1;
                }
            }
            globfree(&gl);
        }
    }
    if (!seen) kb_sb_printf(looked, "\n  %s: no libnvrtc.so*", dir);
    return 0;
}

/* Where cuda_fp16.h / cuda_bf16.h live. NVRTC 13.0 has no built-in copies of them (checked:
 * "could not open source file cuda_bf16.h (no directories in search list)"), so generated code
 * that includes them needs -I: first beside the loaded library (the toolkit's lib64/../include,
 * the cu13 wheel's nvidia/cu13/include), then beside the caller's folders (the cu12 wheels put
 * them in nvidia/cuda_runtime/include), then $CUDA_HOME/include, /usr/local/cuda/include. */
static void find_include_dir(kb_nvrtc *n, const char *const *extra_dirs, int ndirs, kb_sb *looked) {
    char cand[PATH_MAX], probe[PATH_MAX], lib_dir[PATH_MAX];
    snprintf(lib_dir, sizeof lib_dir, "%s", n->path);
    char *slash = strrchr(lib_dir, '/');
    if (slash) *slash = '\0';
    const char *env = getenv("KBENCH_CUDA_INCLUDE");
    const char *cuda_home = getenv("CUDA_HOME");
    for (int step = 0; step < 4 + 2 * ndirs; step++) {
        int ok = 0;
        if (step == 0) ok = env && *env && pjoin(cand, sizeof cand, env, "");
        else if (step == 1) ok = slash && pjoin(cand, sizeof cand, lib_dir, "/../include");
        else if (step < 2 + 2 * ndirs) {
            const char *d = extra_dirs[(step - 2) / 2];
            ok = d && *d && pjoin(cand, sizeof cand, d, (step % 2) ? "/../../cuda_runtime/include" : "/../include");
        } else if (step == 2 + 2 * ndirs) ok = cuda_home && *cuda_home && pjoin(cand, sizeof cand, cuda_home, "/include");
        else ok = pjoin(cand, sizeof cand, "/usr/local/cuda/include", "");
        if (!ok) continue;
        kb_sb_printf(looked, "%s%s", looked->len ? ", " : "", cand);
        if (!pjoin(probe, sizeof probe, cand, "/cuda_fp16.h") || !file_exists(probe)) continue;
        if (!pjoin(probe, sizeof probe, cand, "/cuda_bf16.h") || !file_exists(probe)) continue;
        if (!realpath(cand, n->include_dir)) snprintf(n->include_dir, sizeof n->include_dir, "%s", cand);
        return;
    }
}

kb_status kb_nvrtc_open(kb_ctx *ctx, const char *const *extra_dirs, int ndirs, kb_nvrtc **out) {
    kb_status st = KB_OK;
    kb_sb looked, inc;
    kb_sb_init(&looked, ctx);
    kb_sb_init(&inc, ctx);
    kb_nvrtc *n = NULL;
    KB_CHECK(ctx, out && (ndirs == 0 || extra_dirs) && ndirs >= 0, KB_ERR_INVALID, "kb_nvrtc_open: bad arguments");
    *out = NULL;
    n = kb_calloc(ctx, 1, sizeof *n);
    KB_CHECK(ctx, n, KB_ERR_OOM, "out of memory");
    n->ctx = ctx;
    int found = 0;
    const char *env = getenv("KBENCH_NVRTC");
    if (env && *env) {
        /* an explicit choice is authoritative: falling back elsewhere would hide that it failed */
        found = open_at(n, env, &looked);
        KB_CHECK(ctx, found, KB_ERR_NOT_FOUND,
                 "NVRTC not found: KBENCH_NVRTC is set, so only it was tried:%s",
                 looked.buf ? looked.buf : "");
    }
    for (int i = 0; !found && i < ndirs; i++)
        if (extra_dirs[i] && *extra_dirs[i]) found = open_in_dir(n, extra_dirs[i], &looked);
    const char *cuda_home = getenv("CUDA_HOME");
    if (!found && cuda_home && *cuda_home) {
        char d[PATH_MAX];
        snprintf(d, sizeof d, "%s/lib64", cuda_home);
        found = open_in_dir(n, d, &looked);
    } else if (!found) {
        kb_sb_puts(&looked, "\n  $CUDA_HOME/lib64: CUDA_HOME is not set");
    }
    if (!found) found = open_in_dir(n, "/usr/local/cuda/lib64", &looked);
    if (!found) {
        static const char *const sonames[] = {"libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2"};
        for (size_t i = 0; !found && i < sizeof sonames / sizeof sonames[0]; i++) {
            kb_sb sink; /* "cannot open shared object file" four times says nothing more */
            kb_sb_init(&sink, ctx);
            found = open_at(n, sonames[i], &sink);
            kb_sb_discard(&sink);
        }
        if (!found)
            kb_sb_puts(&looked, "\n  the loader's path (LD_LIBRARY_PATH, ld.so.cache): no libnvrtc.so, "
                                "libnvrtc.so.13, libnvrtc.so.12 or libnvrtc.so.11.2");
    }
    KB_CHECK(ctx, !looked.oom, KB_ERR_OOM, "out of memory");
    KB_CHECK(ctx, found, KB_ERR_NOT_FOUND,
             "NVRTC not found (install the nvidia-cuda-nvrtc wheel or a CUDA toolkit, or set "
             "KBENCH_NVRTC to the library's path); looked in:%s", looked.buf ? looked.buf : "");
    find_include_dir(n, extra_dirs, ndirs, &inc);
    KB_TRY(kb_sb_finish(&inc, &n->include_looked));
    *out = n;
    n = NULL;
cleanup:
    kb_sb_discard(&looked);
    kb_sb_discard(&inc);
    kb_nvrtc_close(n);
    return st;
}

void kb_nvrtc_close(kb_nvrtc *n) {
    if (!n) return;
    /* NOTE: the libraries stay loaded (no dlclose): NVRTC is LLVM-based and registers exit
     * handlers, and unloading such a library is a known source of crashes at process exit;
     * a process opens NVRTC a handful of times at most. */
    kb_string_free(n->ctx, n->include_looked);
    kb_free(n->ctx, n, sizeof *n);
}

const char *kb_nvrtc_path(const kb_nvrtc *n) { return n ? n->path : ""; }
int kb_nvrtc_version(const kb_nvrtc *n) { return n ? n->version : 0; }
const char *kb_nvrtc_include_dir(const kb_nvrtc *n) { return n ? n->include_dir : ""; }

void kb_blob_free(kb_ctx *ctx, void *blob, size_t size) { kb_free(ctx, blob, size); }

/* ---------------------------------------------------------------- the CUBIN cache */

/* A cache file's name: two independent 64-bit hashes of the compile (FNV-1a, and a rotate-multiply
 * hash with a splitmix64 finish). 128 bits keep accidental collisions out of reach for any cache
 * size we will see; a deliberate one only finds a trailer whose claims do not match. */
typedef struct { uint64_t a, b; } hash2;

static void hash_bytes(hash2 *h, const void *data, size_t n) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) {
        h->a = (h->a ^ p[i]) * 0x100000001b3ull;
        h->b = ((h->b ^ p[i]) << 23 | (h->b ^ p[i]) >> 41) * 0x9e3779b97f4a7c15ull;
    }
}

static void hash_str(hash2 *h, const char *s) { hash_bytes(h, s, strlen(s) + 1); /* NUL separates */ }

static uint64_t mix64(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* A cache file is the CUBIN followed by this trailer: what the CUBIN claims to be (the SHA-256
 * of its source, the arch, the NVRTC version that compiled it) and the HMAC-SHA256, under the
 * caller's secret key, of the CUBIN and those claims. A read checks every claim against the
 * compile asked for and the HMAC against the key, so a truncated, corrupted, swapped or planted
 * file (anyone who can write the folder, a cache copied from elsewhere) is recompiled and
 * replaced, never handed to the driver. */
#define TRAILER_MAGIC "KBCUBIN2"
#define ARCH_BYTES 16
/* magic, u64 CUBIN size, u32 NVRTC version, u32 zero, arch (NUL-padded), source SHA-256, HMAC */
#define TRAILER_BYTES (8 + 8 + 4 + 4 + ARCH_BYTES + 32 + 32)
#define TRAILER_SIGNED (TRAILER_BYTES - 32)

static uint64_t rd_u64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static uint16_t rd_u16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* A 64-bit little-endian ELF whose program and section header tables lie inside size bytes. */
int cuda_cubin_ok(const void *data, size_t size) {
    const unsigned char *p = data;
    if (size < 64 || memcmp(p, "\x7f" "ELF", 4) != 0 || p[4] != 2 || p[5] != 1) return 0;
    uint64_t phoff = rd_u64(p + 0x20), shoff = rd_u64(p + 0x28);
    uint64_t phend = phoff + (uint64_t)rd_u16(p + 0x36) * rd_u16(p + 0x38);
    uint64_t shend = shoff + (uint64_t)rd_u16(p + 0x3a) * rd_u16(p + 0x3c);
    return phoff <= size && phend <= size && shoff <= size && shend <= size;
}

/* What a cache entry for this compile must say of itself, and the key that signs it. */
typedef struct {
    const unsigned char *key;
    size_t key_len;
    int version;
    char arch[ARCH_BYTES];
    unsigned char source_sha[32];
} cache_claims;

/* The trailer for cubin under claims c: everything but the HMAC, then the HMAC. */
static void make_trailer(const cache_claims *c, const void *cubin, size_t size, unsigned char t[TRAILER_BYTES]) {
    uint64_t n64 = size;
    uint32_t ver = (uint32_t)c->version, zero = 0;
    memcpy(t, TRAILER_MAGIC, 8);
    memcpy(t + 8, &n64, 8);
    memcpy(t + 16, &ver, 4);
    memcpy(t + 20, &zero, 4);
    memcpy(t + 24, c->arch, ARCH_BYTES);
    memcpy(t + 24 + ARCH_BYTES, c->source_sha, 32);
    const void *parts[2] = {cubin, t};
    size_t lens[2] = {size, TRAILER_SIGNED};
    cuda_hmac_sha256(c->key, c->key_len, parts, lens, 2, t + TRAILER_SIGNED);
}

/* Returns KB_OK with *hit set, or KB_ERR_OOM. A missing, bad or unsigned file is a miss, not an error. */
static kb_status cache_read(kb_ctx *ctx, const char *path, const cache_claims *c, void **cubin, size_t *size,
                            int *hit) {
    *hit = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return KB_OK;
    kb_status st = KB_OK;
    unsigned char *buf = NULL;
    size_t fsize = 0;
    struct stat s;
    if (fstat(fileno(f), &s) != 0 || !S_ISREG(s.st_mode) || s.st_size < 64 + TRAILER_BYTES ||
        s.st_size > (1 << 30))
        goto cleanup;
    fsize = (size_t)s.st_size;
    buf = kb_malloc(ctx, fsize);
    KB_CHECK(ctx, buf, KB_ERR_OOM, "out of memory reading %s", path);
    if (fread(buf, 1, fsize, f) != fsize) goto cleanup;
    size_t csize = fsize - TRAILER_BYTES;
    unsigned char want[TRAILER_BYTES];
    make_trailer(c, buf, csize, want);
    /* the claims are compared in the clear (they are not secret), the HMAC in constant time */
    if (memcmp(buf + csize, want, TRAILER_SIGNED) != 0 ||
        !cuda_digest_equal(buf + csize + TRAILER_SIGNED, want + TRAILER_SIGNED, 32) || !cuda_cubin_ok(buf, csize))
        goto cleanup;
    unsigned char *exact = kb_realloc(ctx, buf, fsize, csize);
    KB_CHECK(ctx, exact, KB_ERR_OOM, "out of memory reading %s", path);
    *cubin = exact;
    *size = csize;
    *hit = 1;
    buf = NULL;
cleanup:
    kb_free(ctx, buf, fsize);
    fclose(f);
    return st;
}

static kb_status mkdir_p(kb_ctx *ctx, const char *dir) {
    char p[PATH_MAX];
    if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p)
        return KB_FAIL(ctx, KB_ERR_IO, "cache directory path too long: %s", dir);
    for (char *s = p + 1;; s++) {
        if (*s == '/' || *s == '\0') {
            char c = *s;
            *s = '\0';
            if (mkdir(p, 0777) != 0 && errno != EEXIST)
                return KB_FAIL(ctx, KB_ERR_IO, "cannot create cache directory %s: %s", p, strerror(errno));
            *s = c;
            if (!c) break;
        }
    }
    if (!is_dir(dir)) return KB_FAIL(ctx, KB_ERR_IO, "cache path %s is not a directory", dir);
    return KB_OK;
}

static int write_all(int fd, const void *data, size_t n) {
    const char *p = data;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return 0;
        p += w;
        n -= (size_t)w;
    }
    return 1;
}

/* Writes to a temporary file in the same folder and renames it over path: rename is atomic,
 * so a concurrent reader (another thread or process compiling the same kernel) sees either no
 * file or a whole one, and two writers just replace one good copy by another. */
static kb_status cache_write(kb_ctx *ctx, const char *dir, const char *path, const cache_claims *c,
                             const void *cubin, size_t size) {
    kb_status st = mkdir_p(ctx, dir);
    if (st != KB_OK) return st;
    char tmp[PATH_MAX + 16];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.XXXXXX", path) >= (int)sizeof tmp)
        return KB_FAIL(ctx, KB_ERR_IO, "cache file path too long: %s", path);
    int fd = mkstemp(tmp);
    if (fd < 0) return KB_FAIL(ctx, KB_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
    unsigned char trailer[TRAILER_BYTES];
    make_trailer(c, cubin, size, trailer);
    int ok = fchmod(fd, 0644) == 0 && write_all(fd, cubin, size) && write_all(fd, trailer, sizeof trailer);
    int err = errno;
    if (close(fd) != 0 && ok) {
        ok = 0;
        err = errno;
    }
    if (ok && rename(tmp, path) != 0) {
        ok = 0;
        err = errno;
    }
    if (!ok) {
        unlink(tmp);
        return KB_FAIL(ctx, KB_ERR_IO, "cannot write cache file %s: %s", path, strerror(err));
    }
    return KB_OK;
}

/* ---------------------------------------------------------------- compile */

static int arch_ok(const char *arch) {
    if (strncmp(arch, "sm_", 3) != 0) return 0;
    const char *p = arch + 3;
    if (*p < '1' || *p > '9') return 0;
    while (*p >= '0' && *p <= '9') p++;
    if (*p == 'a' || *p == 'f') p++; /* sm_90a, sm_100f */
    return *p == '\0' && p - arch <= 8;
}

static void trim_right(char *s) {
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == '\n' || s[n - 1] == ' ' || s[n - 1] == '\r' || s[n - 1] == '\t')) s[--n] = '\0';
}

kb_status kb_nvrtc_compile(kb_ctx *ctx, kb_nvrtc *n, const char *source, const char *arch,
                           const char *cache_dir, const void *key, size_t key_len, void **cubin, size_t *size,
                           char **log) {
    kb_status st = KB_OK;
    nvrtcProgram prog = NULL;
    char *text = NULL, *blob = NULL;
    size_t text_size = 0, blob_size = 0;
    if (log) *log = NULL;
    KB_CHECK(ctx, n && source && arch && cubin && size, KB_ERR_INVALID, "kb_nvrtc_compile: NULL argument");
    *cubin = NULL;
    *size = 0;
    KB_CHECK(ctx, arch_ok(arch), KB_ERR_INVALID, "bad arch \"%s\" (expected sm_<digits>, e.g. sm_90)", arch);
    KB_CHECK(ctx, !cache_dir || (key && key_len >= KB_CUBIN_KEY_MIN && key_len <= KB_CUBIN_KEY_MAX), KB_ERR_INVALID,
             "a CUBIN cache needs a secret key of %d to %d bytes (got %zu)", KB_CUBIN_KEY_MIN, KB_CUBIN_KEY_MAX,
             key ? key_len : 0);

    char arch_opt[32], inc_opt[PATH_MAX + 4];
    const char *opts[4];
    int nopts = 0;
    snprintf(arch_opt, sizeof arch_opt, "--gpu-architecture=%s", arch); /* straight to SASS: a CUBIN */
    opts[nopts++] = arch_opt;
    opts[nopts++] = "--std=c++17";
    opts[nopts++] = "-default-device";
    if (n->include_dir[0]) {
        snprintf(inc_opt, sizeof inc_opt, "-I%s", n->include_dir);
        opts[nopts++] = inc_opt;
    }

    char path[PATH_MAX];
    cache_claims claims;
    memset(&claims, 0, sizeof claims);
    if (cache_dir) {
        claims.key = key;
        claims.key_len = key_len;
        claims.version = n->version;
        memcpy(claims.arch, arch, strlen(arch)); /* arch_ok: at most 8 characters */
        cuda_sha256 sh;
        cuda_sha256_init(&sh);
        cuda_sha256_update(&sh, source, strlen(source));
        cuda_sha256_final(&sh, claims.source_sha);
        hash2 h = {0xcbf29ce484222325ull, 0x6a09e667f3bcc909ull};
        char ver[16];
        snprintf(ver, sizeof ver, "%d", n->version);
        hash_str(&h, "kbench-cubin-2");
        hash_str(&h, source);
        for (int i = 0; i < nopts; i++) hash_str(&h, opts[i]);
        hash_str(&h, ver);
        KB_CHECK(ctx, snprintf(path, sizeof path, "%s/%016llx%016llx.cubin", cache_dir, (unsigned long long)h.a,
                               (unsigned long long)mix64(h.b)) < (int)sizeof path,
                 KB_ERR_IO, "cache directory path too long: %s", cache_dir);
        int hit = 0;
        KB_TRY(cache_read(ctx, path, &claims, cubin, size, &hit));
        if (hit) return KB_OK;
    }

    nvrtcResult r = n->CreateProgram(&prog, source, "kbench.cu", 0, NULL, NULL);
    KB_CHECK(ctx, r == 0, r == 1 ? KB_ERR_OOM : KB_ERR_NVRTC, "nvrtcCreateProgram: %s", n->GetErrorString(r));
    nvrtcResult rc = n->CompileProgram(prog, nopts, opts);
    r = n->GetProgramLogSize(prog, &text_size);
    KB_CHECK(ctx, r == 0, KB_ERR_NVRTC, "nvrtcGetProgramLogSize: %s", n->GetErrorString(r));
    text = kb_malloc(ctx, text_size + 1);
    KB_CHECK(ctx, text, KB_ERR_OOM, "out of memory");
    text[0] = '\0';
    if (text_size > 0) {
        r = n->GetProgramLog(prog, text);
        KB_CHECK(ctx, r == 0, KB_ERR_NVRTC, "nvrtcGetProgramLog: %s", n->GetErrorString(r));
    }
    text[text_size] = '\0';
    trim_right(text);
    /* a failure for want of the fp16/bf16 headers says where they were looked for */
    int no_headers = rc != 0 && !n->include_dir[0] && (strstr(text, "cuda_fp16.h") || strstr(text, "cuda_bf16.h"));
    const char *hint_head = no_headers ? "\n(kbench: no folder with cuda_fp16.h and cuda_bf16.h was found; looked in: " : "";
    const char *hint_tail = no_headers ? "; set KBENCH_CUDA_INCLUDE to a CUDA include folder)" : "";
    const char *hint_dirs = no_headers ? n->include_looked : "";
    if (log && text[0]) {
        kb_sb sb;
        kb_sb_init(&sb, ctx);
        kb_sb_printf(&sb, "%s%s%s%s", text, hint_head, hint_dirs, hint_tail);
        KB_TRY(kb_sb_finish(&sb, log));
    }
    KB_CHECK(ctx, rc == 0, KB_ERR_NVRTC, "NVRTC %d.%d (%s) failed for %s: %s\n%s%s%s%s", n->version / 1000,
             n->version % 1000 / 10, n->path, arch, n->GetErrorString(rc), text, hint_head, hint_dirs, hint_tail);
    r = n->GetCUBINSize(prog, &blob_size);
    KB_CHECK(ctx, r == 0 && blob_size > 0, KB_ERR_NVRTC, "nvrtcGetCUBINSize: %s", n->GetErrorString(r));
    blob = kb_malloc(ctx, blob_size);
    KB_CHECK(ctx, blob, KB_ERR_OOM, "out of memory (CUBIN of %zu bytes)", blob_size);
    r = n->GetCUBIN(prog, blob);
    KB_CHECK(ctx, r == 0, KB_ERR_NVRTC, "nvrtcGetCUBIN: %s", n->GetErrorString(r));
    if (cache_dir) KB_TRY(cache_write(ctx, cache_dir, path, &claims, blob, blob_size));
    *cubin = blob;
    *size = blob_size;
    blob = NULL;
cleanup:
    if (prog) n->DestroyProgram(&prog);
    kb_free(ctx, text, text_size + 1);
    kb_free(ctx, blob, blob_size);
    if (st != KB_OK && st != KB_ERR_NVRTC && log && *log) {
        kb_string_free(ctx, *log); /* the log goes with NVRTC failures only */
        *log = NULL;
    }
    return st;
}
