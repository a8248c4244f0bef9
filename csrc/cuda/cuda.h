/* cuda.h — private to cuda/ (nvrtc.c, driver.c): loading entry points from a dlopen'ed library,
 * and the check a CUBIN passes before the driver sees it. */
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

#endif /* KBENCH_CUDA_H */
