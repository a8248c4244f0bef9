/* tune.h — private to tune/: the facts about a region that both the default genome (genome.c)
 * and the search's domains and legality (evolve.c) are decided from, computed once by one
 * analysis (facts.c). Nothing here is public API. */
#ifndef KBENCH_TUNE_H
#define KBENCH_TUNE_H

#include "core/internal.h"

/* Region r's facts at the example sizes symvals, on dev. Bulk values are the region's inputs and
 * outputs with as many elements as the iteration space (when there are none, every input and
 * output stands in for them in minsz and maxsz). */
typedef struct tune_facts {
    kb_region_kind kind;
    int64_t full;        /* elements of the iteration space */
    int64_t red;         /* reduced extent (ROW: row length, COL: column height) */
    int64_t kept;        /* rows (ROW) / columns (COL) */
    int red_pinned;      /* every reduced dim is pinned */
    int64_t last;        /* the anchor's last dim at the example sizes (1 for a scalar anchor) */
    int last_varies;     /* ... and it is a symbol's: vec > 1 on ROW / COL then makes a kernel that
                            runs only where it stays a multiple of vec (eager elsewhere) */
    int minsz, maxsz;    /* narrowest and widest element of the bulk values (4 if none) */
    int nbulk_in;        /* bulk inputs: what a row cache holds */
    int bulk_in_bytes;   /* their element sizes summed */
    int ncolsum;         /* ROW: reductions over other axes than the row's (column sums, kept as
                            per-thread partials: no pass of their own) */
    /* Does the region read its rows (columns) more than once? Two rules, one walk:
     * multipass  a row reduction, or a full-size output, reads a row reduction; column sums
     *            neither count as reductions nor pass a dependence on (the default genome's
     *            rule, genome.c: its cache, two_pass, thread and persistence choices);
     * rereads    the same with column sums counted as reductions too: a column sum that reads
     *            a reduction is added up in a later pass over the row, so smem is worth
     *            offering (the search's rule, evolve.c: the domains, legality and canonical
     *            form). They differ only for a column sum that reads a reduction or feeds one. */
    int multipass, rereads;
    int online;          /* softmax's max and sum(exp) over the same axes: two_pass=0 computes them
                            in one pass (codegen's online normalizer, kernel.c's online_max_of) */
    int splittable;      /* ROW: a row may be split over blocks (row_split > 1): no column sums, and
                            every row reduction merges from the partials of the row's parts — it
                            reads no other row reduction (sum, mean, max, min), or it is softmax's
                            sum of exp(y - max) beside its max (an online pair), or the sum of
                            squares about a mean of the same values (Chan's merge); codegen/kernel.c
                            decides the same (split_center, online_max_of) */
    /* fast math (codegen/expr.c's FAST table: expf, logf, sinf, cosf, powf become intrinsics) */
    int transcendental;  /* an op fast math changes, computed in float: the gene matters */
    int fast_exp_log;    /* it changes only exp/log, and every float output is 16-bit: on by default */
    int precise_math;    /* a transcendental stays precise: erf, tanh, sin, cos, pow, or exp/log where
                            fast math is not the default */
    int num_sms;         /* the device's (kb_device_for_schedule: the default device's if unsaid) */
    int64_t smem_cap;    /* shared memory per block (kb_device_for_schedule: KB_SMEM_PORTABLE if unsaid) */
} tune_facts;

/* row_split's limits: the most blocks per row, and the fewest elements one block's part may hold
 * (kb_genome_legal); the default splits only rows of at least two parts of KB_ROW_PART_DEFAULT */
#define KB_ROW_SPLIT_MAX 4096
#define KB_ROW_PART_MIN 1024
#define KB_ROW_PART_DEFAULT 8192

kb_status tune_facts_of(const kb_partition *p, int32_t r, const int64_t *symvals, const kb_device_info *dev,
                        tune_facts *f);

#endif /* KBENCH_TUNE_H */
