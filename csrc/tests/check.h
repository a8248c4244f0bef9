/* check.h — the C tests' tiny harness: CHECK(cond) prints file:line and counts a failure
 * instead of stopping, and check_report() prints the closing "N passed, M failed" line and
 * gives main's exit status. Include once per test binary. */
#ifndef KB_TEST_CHECK_H
#define KB_TEST_CHECK_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/kbench.h"

static int check_passed, check_failed;

#define CHECK_MSG(cond, ...)                                              \
    do {                                                                  \
        if (cond) {                                                       \
            check_passed++;                                               \
        } else {                                                          \
            check_failed++;                                               \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                 \
            fputc('\n', stderr);                                          \
        }                                                                 \
    } while (0)

#define CHECK(cond) CHECK_MSG(cond, "%s", "")

/* |got - want| <= tol * max(1, |want|); NaN matches NaN. */
static inline int check_close(double got, double want, double tol)
{
    if (want != want) return got != got;
    if (isinf(want)) return got == want;
    return fabs(got - want) <= tol * (fabs(want) > 1 ? fabs(want) : 1);
}

#define CHECK_NEAR(got, want, tol)                                        \
    do {                                                                  \
        double g_ = (got), w_ = (want);                                   \
        CHECK_MSG(check_close(g_, w_, (tol)), "got %.17g, want %.17g", g_, w_); \
    } while (0)

/* A call's status, printing the context's message when it is not the one expected. */
#define CHECK_STATUS(ctx, call, want)                                     \
    do {                                                                  \
        kb_status s_ = (call);                                            \
        CHECK_MSG(s_ == (want), "status %s, want %s: %s", kb_status_name(s_), \
                  kb_status_name(want), kb_ctx_error(ctx));               \
    } while (0)

static inline int check_report(void)
{
    printf("%d passed, %d failed\n", check_passed, check_failed);
    return check_failed != 0;
}

/* ---------------------------------------------------------------- a failing allocator
 * Counts requests and fails the fail_at-th (0 = none); keeps books of live blocks and bytes,
 * with each block's size in front of it so a wrong osize given to kb_free is caught. */
typedef struct books {
    long requests;     /* allocation requests so far (frees excluded) */
    long fail_at;      /* the request that fails; 0 = none */
    long blocks;       /* live blocks */
    long long bytes;   /* live bytes, by the sizes the core reports */
    int bad_size;      /* a free or realloc named a size other than the block's */
} books;

static inline void *failing_alloc(void *ud, void *ptr, size_t osize, size_t nsize)
{
    books *b = ud;
    size_t *block = ptr ? (size_t *)ptr - 1 : NULL;
    if (block && block[0] != osize) b->bad_size = 1;
    if (nsize == 0) {
        if (block) {
            b->blocks--;
            b->bytes -= (long long)block[0];
            free(block);
        }
        return NULL;
    }
    if (++b->requests == b->fail_at) return NULL;
    size_t *nb = realloc(block, sizeof(size_t) + nsize);
    if (!nb) return NULL;
    if (!block) b->blocks++;
    b->bytes += (long long)nsize - (long long)(block ? nb[0] : 0);
    nb[0] = nsize;
    return nb + 1;
}


#endif /* KB_TEST_CHECK_H */
