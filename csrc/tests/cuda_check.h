/* cuda_check.h — the CUDA runtime tests' check macro: CHECK(cond, fmt, ...) counts checks and
 * failures and says why a check failed. One copy for test_nvrtc.c and gpu_cuda.c. */
#ifndef KB_CUDA_CHECK_H
#define KB_CUDA_CHECK_H

#include <stdio.h>

static int failures = 0, checks = 0;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        checks++;                                                          \
        if (!(cond)) {                                                     \
            failures++;                                                    \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                  \
            fputc('\n', stderr);                                           \
        }                                                                  \
    } while (0)

#endif
