/* cuda.h — private to cuda/ (nvrtc.c, driver.c, sha256.c): loading entry points from a dlopen'ed
 * library, the check a CUBIN passes before the driver sees it, and the CUBIN cache's hashes. */
#ifndef KBENCH_CUDA_H
#define KBENCH_CUDA_H

#include "core/internal.h"

#include <dlfcn.h>

/* Resolves name (or, if absent, alt) from lib into *slot. dlsym returns void *; copying it into
 * the function-pointer slot with memcpy is the POSIX-sanctioned way round ISO C's cast rule. */
static inline int load_sym(void *lib, void *slot, const char *name, const char *alt) {
    void *p = dlsym(lib, name);
    if (!p && alt) p = dlsym(lib, alt);
    memcpy(slot, &p, sizeof p);
    return p != NULL;
}

/* A 64-bit little-endian ELF whose program and section header tables lie inside size bytes: a
 * CUBIN worth handing to the driver (nvrtc.c, for the cache's files and driver.c's loads). */
int cuda_cubin_ok(const void *data, size_t size);

/* SHA-256 and HMAC-SHA256 (sha256.c), for the CUBIN cache's trailer. */
typedef struct {
    uint32_t h[8];
    uint64_t len;
    unsigned char buf[64];
    size_t nbuf;
} cuda_sha256;
void cuda_sha256_init(cuda_sha256 *s);
void cuda_sha256_update(cuda_sha256 *s, const void *data, size_t n);
void cuda_sha256_final(cuda_sha256 *s, unsigned char out[32]);
/* HMAC-SHA256(key, parts[0] || parts[1] || ...) */
void cuda_hmac_sha256(const void *key, size_t key_len, const void *const *parts, const size_t *lens, int nparts,
                      unsigned char out[32]);
/* 1 if the n bytes match, in time that does not depend on where they differ */
int cuda_digest_equal(const unsigned char *a, const unsigned char *b, size_t n);

#endif /* KBENCH_CUDA_H */
