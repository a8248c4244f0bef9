/* genome.c — a region's schedule: the default genome (chosen from the region's facts at the
 * example sizes and the device, tune/facts.c), the table of genes (name, field, range) and the
 * canonical text form that names a genome in the cache and in reports ("threads=256 vec=4
 * rows=1 items=1 cache=regs two_pass=1 fast_math=0 persistent=0 col_split=1", then " row_split=N"
 * where N > 1). The search's legality is evolve.c's; codegen refuses what it cannot generate
 * (KB_ERR_INVALID). */
#include "tune/tune.h"

#include <stdlib.h>

static const char *const cache_names[] = {"regs", "smem", "reread"};

static const kb_genome BASE = {256, 1, 1, 1, KB_CACHE_REGS, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0};

/* The genes of the text form, in kb_genome field order: name, where it lives, its range. */
static const kb_gene GENES[KB_NGENES] = {
    {"threads", offsetof(kb_genome, threads), 1, 1024},
    {"vec", offsetof(kb_genome, vec), 1, 16},
    {"rows", offsetof(kb_genome, rows), 1, 1024},
    {"items", offsetof(kb_genome, items), 1, 64},
    {"cache", offsetof(kb_genome, cache), 0, 2},
    {"two_pass", offsetof(kb_genome, two_pass), 0, 1},
    {"fast_math", offsetof(kb_genome, fast_math), 0, 1},
    {"persistent", offsetof(kb_genome, persistent), 0, 1},
    {"col_split", offsetof(kb_genome, col_split), 1, 4096},
    {"row_split", offsetof(kb_genome, row_split), 1, 4096},
};

const kb_gene *kb_genome_genes(void) { return GENES; }

const kb_genome *kb_genome_base(void) { return &BASE; }

const char *kb_cache_where_name(int32_t where) {
    return where >= 0 && where < 3 ? cache_names[where] : NULL;
}

int32_t kb_cache_where_of(const char *name, size_t n) {
    for (int32_t c = 0; c < 3; c++)
        if (strlen(cache_names[c]) == n && strncmp(cache_names[c], name, n) == 0) return c;
    return -1;
}

static int32_t gene_value(const kb_genome *gn, const kb_gene *gene) {
    return *(const int32_t *)((const char *)gn + gene->offset);
}

kb_status kb_genome_check(kb_ctx *ctx, const kb_genome *gn) {
    if (!gn) return KB_FAIL(ctx, KB_ERR_INVALID, "genome is NULL");
    for (int i = 0; i < KB_NGENES; i++) {
        int32_t v = gene_value(gn, &GENES[i]);
        if (v < GENES[i].lo || v > GENES[i].hi)
            return KB_FAIL(ctx, KB_ERR_INVALID, "genome: bad value %d for %s (%d..%d)", (int)v, GENES[i].name,
                           (int)GENES[i].lo, (int)GENES[i].hi);
    }
    return KB_OK;
}

static int64_t pow2_ceil(int64_t x) {
    int64_t p = 1;
    while (p < x) p <<= 1;
    return p;
}

static int64_t pow2_floor(int64_t x) {
    int64_t p = 1;
    while (p * 2 <= x) p <<= 1;
    return p;
}

static int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

/* The widest vector (elements) whose accesses stay 16 bytes and divide the last dim. A last dim
 * that varies is taken at the example's size: where vec > 1 divides it, the kernel requires that
 * it stays a multiple of vec (kb_kernel.last_multiple) and a launch at a size that breaks this
 * runs the region in eager; a reduction read in 4-byte loads is slower by far at every size
 * (KernelBench's tasks without parameters have every dim varying). */
static int pick_vec(const tune_facts *f, int need_last) {
    int vec = (int)clamp64(16 / f->maxsz, 1, 8);
    if (need_last)
        while (vec > 1 && (f->last == 0 || f->last % vec != 0)) vec /= 2;
    return vec;
}

/* A GEMM region's schedule: the base genes (threads the kernel's block) and the tensor-core
 * kernel's genome for its product at these sizes (kb_gemm_genome_default). */
static kb_status gemm_default(const kb_partition *p, int32_t r, const int64_t *symvals, const kb_device_info *dev,
                              kb_genome *out) {
    kb_ctx *ctx = kb_graph_ctx(p->graph);
    const kb_node *mm = kb_graph_node(p->graph, p->regions[r].gemm.matmul);
    const kb_node *a = kb_graph_node(p->graph, mm->inputs[0]);
    kb_status st = kb_graph_check_symvals(p->graph, symvals);
    if (st != KB_OK) return st;
    int64_t batch = 1;
    for (int d = 0; d < mm->rank - 2; d++) batch *= kb_dim_eval(mm->dims[d], symvals);
    kb_gemm_genome g;
    kb_gemm_genome_default(kb_dim_eval(mm->dims[mm->rank - 2], symvals), kb_dim_eval(mm->dims[mm->rank - 1], symvals),
                           kb_dim_eval(a->dims[a->rank - 1], symvals), batch, dev, &g);
    kb_genome gn = BASE;
    gn.threads = 32 * g.warps_m * g.warps_n;
    gn.vec = 8; /* 16-byte loads: the launchers check every pointer's alignment where vec > 1 */
    gn.gemm_tile_m = g.tile_m, gn.gemm_tile_n = g.tile_n, gn.gemm_tile_k = g.tile_k;
    gn.gemm_warps_m = g.warps_m, gn.gemm_warps_n = g.warps_n, gn.gemm_stages = g.stages;
    gn.gemm_min_blocks = g.min_blocks;
    (void)ctx;
    *out = gn;
    return KB_OK;
}

kb_status kb_genome_default(const kb_partition *p, int32_t r, const int64_t *symvals, const kb_device_info *dev,
                            kb_genome *out) {
    if (!p || !out || r < 0 || r >= p->nregions) return KB_ERR_INVALID;
    kb_ctx *ctx = kb_graph_ctx(p->graph);
    const kb_region *rg = &p->regions[r];
    if (rg->kind == KB_REGION_EXTERN)
        return KB_FAIL(ctx, KB_ERR_INVALID, "region %d is EXTERN: torch runs it, it has no schedule", (int)r);
    if (rg->kind == KB_REGION_GEMM) return gemm_default(p, r, symvals, dev, out);
    tune_facts f;
    kb_status st = tune_facts_of(p, r, symvals, dev, &f);
    if (st != KB_OK) return st;
    int num_sms = f.num_sms;
    int64_t smem_cap = f.smem_cap;
    kb_genome gn = BASE;
    gn.fast_math = f.fast_exp_log;

    if (rg->kind == KB_REGION_POINTWISE) {
        /* 16-byte accesses, one per thread, 128 threads a block: a memory-bound body wants
           many small blocks in flight, and one vector a thread beats four (H100, 8192x4096:
           bias+GELU(tanh) bf16 46.7 us against 44.1 with four; benchmarks/bench_genomes.py
           bias_gelu_tanh --dtype bfloat16). Several vectors per thread only where the body is
           heavy, a precise transcendental on eight 16-bit elements a vector (erff is some 30
           instructions an element), so the kernel is issue-bound and the per-thread setup is
           worth sharing, and where the grid has waves to spare (bias+GELU(erf) bf16: 48.4 us
           with four vectors a thread, 51.2 with one; bench_genomes.py bias_gelu_erf --dtype
           bfloat16). */
        gn.vec = pick_vec(&f, 0);
        int64_t waves = f.full / ((int64_t)num_sms * 2048 * gn.vec);
        int heavy = f.precise_math && gn.vec >= 8;
        gn.items = !heavy ? 1 : waves >= 8 ? 4 : waves >= 2 ? 2 : 1;
        gn.threads = gn.items == 1 ? 128 : 256;
    } else if (rg->kind == KB_REGION_ROW) {
        /* few long rows (fewer than two an SM): each row split over blocks, about four blocks an
           SM in all but no part under KB_ROW_PART_DEFAULT elements, so the whole GPU reduces and
           writes (one block per row leaves most SMs idle: 8 rows of 1M elements are 8 blocks).
           The rest of the schedule is chosen for one block's part as if it were the row. */
        int64_t split = 1, most = clamp64(f.red / KB_ROW_PART_DEFAULT, 1, KB_ROW_SPLIT_MAX);
        if (f.splittable && f.kept > 0 && f.kept < 2 * (int64_t)num_sms && most > 1)
            split = clamp64((4 * (int64_t)num_sms + f.kept - 1) / f.kept, 1, most);
        gn.row_split = (int32_t)split;
        f.red = (f.red + split - 1) / split;
        gn.vec = pick_vec(&f, 1);
        int64_t chunks = (f.red + gn.vec - 1) / gn.vec;
        int64_t group;
        int short_colsum = f.red <= 1024 && f.ncolsum > 0;
        if (f.red <= 1024) { /* short rows: several rows per block */
            int64_t block = 256;
            if (short_colsum) {
                /* with column sums a thread keeps a partial per column it visits, so the row
                   takes many threads, about two chunks of 2 elements each, 512 threads a block
                   and 2048 an SM (persistent). A warp per row would hold 24 columns' partials a
                   thread at 768 columns: 114-167 registers, one block an SM (H100, LayerNorm f32
                   backward at 2048x768: 36.4 us a warp per row, 17.5 this way;
                   benchmarks/bench_genomes.py layer_norm --shape 2048,768 --no-forward). */
                if (gn.vec > 2) gn.vec = 2;
                chunks = (f.red + gn.vec - 1) / gn.vec;
                group = clamp64(pow2_ceil((chunks + 1) / 2), 1, 512);
                block = 512;
            } else { /* a warp (or less) per row */
                group = clamp64(pow2_ceil(chunks), 1, 32);
            }
            int64_t rows = clamp64(pow2_ceil(f.kept), 1, block / group);
            if (rows * group < 32) rows = 32 / group;
            gn.rows = (int32_t)rows;
            gn.threads = (int32_t)(rows * group);
        } else { /* a block per row, ~16 elements per thread (never more threads than vectors); with
                    column sums one 16-byte vector per thread, whose partials also live in
                    registers: more threads, fewer partials each (H100, LayerNorm f32 backward
                    at 8192x4096: 152 us with 512 threads of 8, 143 with 1024 of 4;
                    benchmarks/bench_genomes.py layer_norm --no-forward). */
            group = clamp64(pow2_floor(f.red / (f.ncolsum ? 16 / f.maxsz : 16)), 128, 1024);
            if (group > pow2_ceil(chunks)) group = pow2_ceil(chunks);
            /* a part of a split row: 256 threads, twice the blocks an SM of 512 (H200, LayerNorm
               f32 over 8 rows of 1M, 66 parts a row: forward 37.4 us against 46.5, backward's
               row kernel 52.8 against 58.3; bench_genomes.py layer_norm_wide --dtype float32) */
            if (split > 1 && group > 256) group = 256;
            gn.threads = (int32_t)group;
            gn.rows = 1;
        }
        /* where the row lives between passes: registers, else shared memory, else re-read.
           On a block per row, registers win while a thread holds at most 16 values (inputs and
           column-sum partials); past that they cost more in occupancy than shared memory costs
           in traffic (H100, rows of 4096, bf16 softmax backward: 156 us in registers, 123 in
           shared memory; benchmarks/bench_genomes.py softmax --dtype bfloat16 --no-forward).
           Short rows (a warp or less per row, GPT-2's 768 the case in mind) hold up to 64. */
        int64_t nbulk = f.nbulk_in ? f.nbulk_in : 1;
        int64_t per_thread = (chunks + group - 1) / group * gn.vec * (nbulk + f.ncolsum);
        int64_t reg_budget = gn.rows > 1 || f.red <= 1024 ? (gn.threads >= 1024 ? 32 : 64) : 16;
        int64_t smem = (int64_t)gn.rows * f.red * f.bulk_in_bytes;
        if (f.red_pinned && per_thread <= reg_budget) {
            gn.cache = KB_CACHE_REGS;
            gn.items = 1;
        } else if (f.red_pinned && f.multipass && smem <= smem_cap / 2 && split == 1) { /* (not for a part) */
            gn.cache = KB_CACHE_SMEM;
            gn.items = 4;
            if (gn.rows == 1 && gn.threads > 256 && !f.ncolsum) gn.threads = 256;
        } else {
            gn.cache = KB_CACHE_REREAD;
            gn.items = 4;
            /* a re-read row is read twice; one pass with column sums reads it once */
            if (gn.rows == 1 && gn.threads > 512 && (f.multipass || !f.ncolsum)) gn.threads = 512;
        }
        /* re-reading the row: fold max and sum(exp) into one pass where the region has them
           (codegen's online normalizer; no effect elsewhere). Variance keeps two passes. */
        gn.two_pass = gn.cache == KB_CACHE_REREAD && f.multipass ? 0 : 1;
        /* column sums of a single pass (a bias gradient), or of short rows (above): a streaming
           kernel, twice the blocks */
        if ((f.ncolsum && !f.multipass) || short_colsum) gn.persistent = 1;
    } else { /* COL: threads across columns, a loop down them; split the height to fill the GPU
                with many small blocks (about 8 column blocks x up to 64 splits, 8-byte vectors,
                8 rows in flight a thread), which keep more loads in flight than few wide ones. */
        gn.vec = pick_vec(&f, 1);
        if (gn.vec > 4 && f.last % 4 == 0) gn.vec = 4;
        int64_t cols = (f.kept + gn.vec - 1) / gn.vec;
        gn.threads = (int32_t)clamp64(pow2_floor(cols / 8), 32, 256);
        int64_t colblocks = cols > 0 ? (cols + gn.threads - 1) / gn.threads : 1; /* no columns: one block */
        int64_t split = (4 * (int64_t)num_sms + colblocks - 1) / colblocks;
        split = clamp64(split, 1, 64);
        split = clamp64(split, 1, f.red / 32 > 0 ? f.red / 32 : 1);
        gn.col_split = f.multipass ? 1 : (int32_t)split;
        gn.items = 8;
        gn.cache = KB_CACHE_REREAD;
    }
    *out = gn;
    return KB_OK;
}

int kb_genome_format(const kb_genome *gn, char *buf, size_t n) {
    const char *cache = kb_cache_where_name(gn->cache);
    if (!cache) cache = "?";
    /* row_split last and only where it splits: a genome without one keeps the text it always had */
    char split[32] = "";
    if (gn->row_split != 1) snprintf(split, sizeof split, " row_split=%d", gn->row_split);
    /* the GEMM kernel's genes last, only in a GEMM region's genome */
    char gemm[96] = "";
    if (gn->gemm_tile_m)
        snprintf(gemm, sizeof gemm, " gemm=%dx%dx%d/%dx%d/s%d/b%d", gn->gemm_tile_m, gn->gemm_tile_n, gn->gemm_tile_k,
                 gn->gemm_warps_m, gn->gemm_warps_n, gn->gemm_stages, gn->gemm_min_blocks);
    int len = snprintf(buf, n,
                       "threads=%d vec=%d rows=%d items=%d cache=%s two_pass=%d fast_math=%d persistent=%d "
                       "col_split=%d%s%s",
                       gn->threads, gn->vec, gn->rows, gn->items, cache, gn->two_pass, gn->fast_math,
                       gn->persistent, gn->col_split, split, gemm);
    if (n > 0 && len >= 0 && (size_t)len >= n) buf[n - 1] = '\0';
    return len < 0 ? 0 : len;
}

/* "TMxTNxTK/WMxWN/sS/bB" (kb_genome_format's) into gn's GEMM genes, checked by the GEMM
 * generator's shape rules (kb_gemm_genome_check, any device's shared memory) */
static kb_status parse_gemm(kb_ctx *ctx, const char *val, size_t n, kb_genome *gn) {
    char text[64];
    kb_gemm_genome g;
    int used = 0;
    if (n >= sizeof text) return KB_FAIL(ctx, KB_ERR_INVALID, "genome: gemm=%.20s... is too long", val);
    memcpy(text, val, n);
    text[n] = '\0';
    if (sscanf(text, "%dx%dx%d/%dx%d/s%d/b%d%n", &g.tile_m, &g.tile_n, &g.tile_k, &g.warps_m, &g.warps_n, &g.stages,
               &g.min_blocks, &used) != 7 || (size_t)used != n)
        return KB_FAIL(ctx, KB_ERR_INVALID, "genome: bad value \"%s\" for gemm (TMxTNxTK/WMxWN/sS/bB)", text);
    const kb_device_info any_smem = {80, 0, 1 << 30, 0, 0};
    kb_status st = kb_gemm_genome_check(ctx, &g, &any_smem);
    if (st != KB_OK) return st;
    gn->gemm_tile_m = g.tile_m, gn->gemm_tile_n = g.tile_n, gn->gemm_tile_k = g.tile_k;
    gn->gemm_warps_m = g.warps_m, gn->gemm_warps_n = g.warps_n, gn->gemm_stages = g.stages;
    gn->gemm_min_blocks = g.min_blocks;
    return KB_OK;
}

kb_status kb_genome_parse(kb_ctx *ctx, const char *text, kb_genome *out) {
    if (!text || !out) return KB_FAIL(ctx, KB_ERR_INVALID, "genome text is NULL");
    kb_genome gn = BASE;
    const char *s = text;
    for (;;) {
        while (*s == ' ' || *s == '\t' || *s == '\n') s++;
        if (!*s) break;
        const char *eq = s;
        while (*eq && *eq != '=' && *eq != ' ') eq++;
        if (*eq != '=') return KB_FAIL(ctx, KB_ERR_INVALID, "genome: expected key=value at \"%.20s\"", s);
        size_t klen = (size_t)(eq - s);
        const char *val = eq + 1, *end = val;
        while (*end && *end != ' ' && *end != '\t' && *end != '\n') end++;
        if (klen == 4 && strncmp(s, "gemm", 4) == 0) {
            kb_status st = parse_gemm(ctx, val, (size_t)(end - val), &gn);
            if (st != KB_OK) return st;
            s = end;
            continue;
        }
        const kb_gene *gene = NULL;
        for (int i = 0; i < KB_NGENES; i++)
            if (strlen(GENES[i].name) == klen && strncmp(GENES[i].name, s, klen) == 0) gene = &GENES[i];
        if (!gene) return KB_FAIL(ctx, KB_ERR_INVALID, "genome: unknown gene \"%.*s\"", (int)klen, s);
        long v = -1;
        if (gene->offset == offsetof(kb_genome, cache)) {
            v = kb_cache_where_of(val, (size_t)(end - val));
        } else {
            char *stop;
            v = strtol(val, &stop, 10);
            if (stop != end || end == val) v = -1;
        }
        if (v < gene->lo || v > gene->hi)
            return KB_FAIL(ctx, KB_ERR_INVALID, "genome: bad value \"%.*s\" for %s (%d..%d)", (int)(end - val), val,
                           gene->name, gene->lo, gene->hi);
        *(int32_t *)((char *)&gn + gene->offset) = (int32_t)v;
        s = end;
    }
    *out = gn;
    return KB_OK;
}
