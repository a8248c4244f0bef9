/* check.h — the C tests' tiny harness: CHECK(cond) prints file:line and counts a failure
 * instead of stopping, and check_report() prints the closing "N passed, M failed" line and
 * gives main's exit status. Include once per test binary. */
#ifndef KB_TEST_CHECK_H
#define KB_TEST_CHECK_H

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kbench.h"

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

#endif /* KB_TEST_CHECK_H */
