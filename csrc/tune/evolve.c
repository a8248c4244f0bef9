/* evolve.c — the schedule search of one region (docs/DESIGN.md, "Regions and genomes"): each
 * gene's domain and the legality of a genome, from the region's facts (tune/facts.c) and the
 * device, and an ask/tell genetic search over them (tournament selection, crossover, mutation,
 * elitism, dedup by canonical form, seeded PRNG). It measures nothing: the caller compiles,
 * times and tells (kbench/search.py on the GPU). */
#include "tune/tune.h"

#include <math.h>

enum { G_THREADS, G_VEC, G_ROWS, G_ITEMS, G_CACHE, G_TWO_PASS, G_FAST_MATH, G_PERSISTENT, G_COL_SPLIT, G_ROW_SPLIT, NGENES };

#define MAX_VALUES 16
#define DEFAULT_POPULATION 12
#define TOURNAMENT 3
#define ELITES 2
#define CHILD_TRIES 32    /* GA children tried before a child is drawn from the unseen rest */
#define RANDOM_TRIES 64   /* random draws before the domain product is walked */

/* ordinal genes mutate mostly to a neighbouring value (256 -> 128 or 512): small steps in a
 * landscape that is smooth along them; the others (cache, flags) jump. */
static const struct gene {
    size_t off;
    int ordinal;
} GENE[NGENES] = {
    {offsetof(kb_genome, threads), 1},   {offsetof(kb_genome, vec), 1},       {offsetof(kb_genome, rows), 1},
    {offsetof(kb_genome, items), 1},     {offsetof(kb_genome, cache), 0},     {offsetof(kb_genome, two_pass), 0},
    {offsetof(kb_genome, fast_math), 0}, {offsetof(kb_genome, persistent), 0}, {offsetof(kb_genome, col_split), 1},
    {offsetof(kb_genome, row_split), 1},
};

static int32_t *gene_at(kb_genome *g, int i) { return (int32_t *)((char *)g + GENE[i].off); }
static int32_t gene_get(const kb_genome *g, int i) { return *(const int32_t *)((const char *)g + GENE[i].off); }

static int is_pow2(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }
static int64_t pow2_ceil(int64_t x) {
    int64_t p = 1;
    while (p < x) p <<= 1;
    return p;
}
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* ---------------------------------------------------------------- legality and canonical form */

/* Legal: codegen accepts it, the device can run it, and it wastes no thread by construction at
 * the example sizes. See kbench.h for the list. */
static int legal_facts(const tune_facts *f, const kb_genome *g) {
    if (!is_pow2(g->threads) || g->threads < 32 || g->threads > 1024) return 0;
    if (g->vec != 1 && g->vec != 2 && g->vec != 4 && g->vec != 8) return 0;
    if (g->items != 1 && g->items != 2 && g->items != 4 && g->items != 8) return 0;
    if (g->cache < KB_CACHE_REGS || g->cache > KB_CACHE_REREAD) return 0;
    if ((uint32_t)g->two_pass > 1 || (uint32_t)g->fast_math > 1 || (uint32_t)g->persistent > 1) return 0;
    /* one vector access of the narrowest element is at most 16 bytes */
    if ((int64_t)g->vec * f->minsz > 16) return 0;
    /* ROW and COL step along the last dim in whole vectors (a varying one at the example's size:
       the kernel then runs only where it stays a multiple of vec, kb_kernel.last_multiple) */
    if (f->kind != KB_REGION_POINTWISE && g->vec > 1 && (f->last == 0 || f->last % g->vec != 0)) return 0;
    if (g->row_split < 1 || g->row_split > KB_ROW_SPLIT_MAX) return 0;
    if (g->row_split > 1) { /* a row split over blocks: each reduces a part of at least KB_ROW_PART_MIN */
        if (f->kind != KB_REGION_ROW || !f->splittable || g->rows != 1 || g->persistent || g->cache == KB_CACHE_SMEM ||
            cdiv(f->red, g->row_split) < KB_ROW_PART_MIN)
            return 0;
    }
    if (f->kind == KB_REGION_ROW) {
        if (!is_pow2(g->rows) || g->rows > 256 || g->rows > g->threads) return 0;
        int64_t G = g->threads / g->rows;             /* threads sharing one row */
        int64_t chunks = cdiv(cdiv(f->red, g->row_split), g->vec); /* vectors in a row (its part, split) */
        if (G > max64(32, pow2_ceil(chunks))) return 0;
        if (g->cache != KB_CACHE_REREAD && !f->red_pinned) return 0;
        if (g->cache == KB_CACHE_REGS) {
            int64_t per_thread = cdiv(chunks, G) * g->vec * (f->nbulk_in ? f->nbulk_in : 1);
            if (per_thread > (g->threads >= 1024 ? 32 : 64)) return 0;
        }
        if (g->cache == KB_CACHE_SMEM && (int64_t)g->rows * f->red * f->bulk_in_bytes > f->smem_cap) return 0;
    } else if (g->rows != 1) {
        return 0;
    }
    if (f->kind == KB_REGION_COL) {
        if (g->col_split < 1 || g->col_split > 64) return 0;
        if (g->col_split > 1 && (f->rereads || (int64_t)g->col_split * 8 > f->red)) return 0;
        if (g->threads > max64(32, pow2_ceil(cdiv(f->kept, g->vec)))) return 0;
    } else if (g->col_split != 1) {
        return 0;
    }
    if (f->kind == KB_REGION_POINTWISE) {
        if (g->threads > 256 && (int64_t)g->threads * g->vec > f->full) return 0;
        if (g->items > 1 && (int64_t)g->threads * g->vec * g->items > f->full) return 0;
    }
    return 1;
}

/* Genes a region ignores take the default genome's value, so that two genomes that give the same
 * kernel have the same text and the search does not try both. */
static void canonical(const tune_facts *f, const kb_genome *d, kb_genome *g) {
    if (f->kind != KB_REGION_ROW) g->rows = d->rows;
    if (f->kind != KB_REGION_COL) g->col_split = d->col_split;
    if (f->kind != KB_REGION_ROW) g->row_split = d->row_split;
    if (!f->transcendental) g->fast_math = d->fast_math;
    if (!f->online || g->row_split > 1) g->two_pass = d->two_pass; /* split: the pairs are online anyway */
    if (f->kind != KB_REGION_ROW) {
        g->cache = d->cache; /* where a row lives between passes: ROW only */
    } else {
        if (!f->rereads && g->cache == KB_CACHE_SMEM) g->cache = KB_CACHE_REREAD; /* nothing is re-read */
        if (g->cache == KB_CACHE_REGS) g->items = 1; /* the register loop is unrolled in full */
    }
}

static kb_status check_region(const kb_partition *p, int32_t r) {
    if (!p) return KB_ERR_INVALID;
    kb_ctx *ctx = kb_graph_ctx(p->graph);
    if (r < 0 || r >= p->nregions) return KB_FAIL(ctx, KB_ERR_INVALID, "evolve: region %d of %d", (int)r, (int)p->nregions);
    if (p->regions[r].kind == KB_REGION_EXTERN)
        return KB_FAIL(ctx, KB_ERR_INVALID, "evolve: region %d is EXTERN: torch runs it, it has no schedule", (int)r);
    if (p->regions[r].kind == KB_REGION_GEMM)
        return KB_FAIL(ctx, KB_ERR_UNSUPPORTED,
                       "evolve: region %d is a GEMM region: it runs its default genome (the GEMM kernel's), no genes "
                       "to search", (int)r);
    return KB_OK;
}

int kb_genome_legal(const kb_partition *p, int32_t r, const int64_t *symvals, const kb_device_info *dev,
                    const kb_genome *gn) {
    tune_facts f;
    if (!gn || check_region(p, r) != KB_OK || tune_facts_of(p, r, symvals, dev, &f) != KB_OK) return 0;
    return legal_facts(&f, gn);
}

/* ---------------------------------------------------------------- PRNG (xoshiro256**, seeded by splitmix64) */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t next_u64(uint64_t s[4]) {
    uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

static uint64_t below(uint64_t s[4], uint64_t n) { return n ? next_u64(s) % n : 0; } /* bias < n / 2^64 */
static double unit(uint64_t s[4]) { return (double)(next_u64(s) >> 11) * 0x1.0p-53; }

/* ---------------------------------------------------------------- the search */

typedef struct rec {
    kb_genome g;    /* canonical */
    double ms;      /* told fitness; < 0: failed */
    int32_t gen;
    int32_t told;
} rec;

struct kb_evolve {
    kb_ctx *ctx;
    tune_facts f;
    kb_genome dflt;
    int32_t dom[NGENES][MAX_VALUES];
    int ndom[NGENES];
    uint64_t rng[4];
    int population;
    int generation;           /* of the latest batch; -1 before the first ask */
    rec *recs;                /* every genome asked or told, in order */
    int32_t nrecs, caprecs;
    int32_t *table;           /* open addressing over recs: index + 1, 0 = empty */
    int32_t tcap;
    int32_t *batch, nbatch, next; /* the current generation and how much of it was handed out */
    int32_t *pool;            /* parents of the next generation (scratch, population + ELITES) */
};

static uint64_t genome_hash(const kb_genome *g) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < NGENES; i++) {
        uint32_t v = (uint32_t)gene_get(g, i);
        for (int b = 0; b < 4; b++) h = (h ^ ((v >> (8 * b)) & 0xff)) * 0x100000001b3ull;
    }
    return h;
}

static int genome_eq(const kb_genome *a, const kb_genome *b) {
    for (int i = 0; i < NGENES; i++)
        if (gene_get(a, i) != gene_get(b, i)) return 0;
    return 1;
}

/* index of g among the records, -1 if never seen */
static int32_t find(const kb_evolve *ev, const kb_genome *g) {
    if (!ev->tcap) return -1;
    for (uint64_t i = genome_hash(g) & (uint64_t)(ev->tcap - 1);; i = (i + 1) & (uint64_t)(ev->tcap - 1)) {
        int32_t e = ev->table[i];
        if (!e) return -1;
        if (genome_eq(&ev->recs[e - 1].g, g)) return e - 1;
    }
}

static void table_put(int32_t *table, int32_t tcap, const kb_genome *g, int32_t idx) {
    uint64_t i = genome_hash(g) & (uint64_t)(tcap - 1);
    while (table[i]) i = (i + 1) & (uint64_t)(tcap - 1);
    table[i] = idx + 1;
}

/* Room for k more records, so that adding them cannot fail: every allocation happens before
 * the search draws a random number or changes state, and an OOM leaves the search as it was. */
static kb_status reserve(kb_evolve *ev, int32_t k) {
    int32_t need = ev->nrecs + k;
    if (need > ev->caprecs) {
        int32_t cap = ev->caprecs ? ev->caprecs : 64;
        while (cap < need) cap *= 2;
        rec *nr = kb_realloc(ev->ctx, ev->recs, (size_t)ev->caprecs * sizeof *nr, (size_t)cap * sizeof *nr);
        if (!nr) return KB_ERR_OOM;
        ev->recs = nr;
        ev->caprecs = cap;
    }
    if ((int64_t)need * 2 > ev->tcap) {
        int32_t cap = ev->tcap ? ev->tcap : 128;
        while ((int64_t)need * 2 > cap) cap *= 2;
        int32_t *nt = kb_calloc(ev->ctx, (size_t)cap, sizeof *nt);
        if (!nt) return KB_ERR_OOM;
        for (int32_t i = 0; i < ev->nrecs; i++) table_put(nt, cap, &ev->recs[i].g, i);
        kb_free(ev->ctx, ev->table, (size_t)ev->tcap * sizeof *ev->table);
        ev->table = nt;
        ev->tcap = cap;
    }
    return KB_OK;
}

static int32_t add_rec(kb_evolve *ev, const kb_genome *g, int32_t gen) { /* after reserve() */
    int32_t i = ev->nrecs++;
    ev->recs[i] = (rec){*g, -1.0, gen, 0};
    table_put(ev->table, ev->tcap, g, i);
    return i;
}

static void dom_add(kb_evolve *ev, int gi, int32_t v) {
    int n = ev->ndom[gi];
    for (int i = 0; i < n; i++)
        if (ev->dom[gi][i] == v) return;
    if (n == MAX_VALUES) return;
    int i = n;
    while (i > 0 && ev->dom[gi][i - 1] > v) {
        ev->dom[gi][i] = ev->dom[gi][i - 1];
        i--;
    }
    ev->dom[gi][i] = v;
    ev->ndom[gi] = n + 1;
}

/* Each gene's values for this region: what legality allows on its own, with the ignored genes
 * pinned to their canonical value, and the default's value always among them. */
static void build_domains(kb_evolve *ev) {
    const tune_facts *f = &ev->f;
    kb_genome c = ev->dflt;
    for (int t = 32; t <= 1024; t *= 2) dom_add(ev, G_THREADS, t);
    for (int v = 1; v <= 8; v *= 2) {
        if ((int64_t)v * f->minsz > 16) continue;
        if (f->kind != KB_REGION_POINTWISE && v > 1 && (f->last == 0 || f->last % v)) continue;
        dom_add(ev, G_VEC, v);
    }
    if (f->kind == KB_REGION_ROW)
        for (int r = 1; r <= 256; r *= 2) dom_add(ev, G_ROWS, r);
    for (int i = 1; i <= 8; i *= 2) dom_add(ev, G_ITEMS, i);
    if (f->kind == KB_REGION_ROW) {
        if (f->red_pinned) dom_add(ev, G_CACHE, KB_CACHE_REGS);
        if (f->red_pinned && f->rereads) dom_add(ev, G_CACHE, KB_CACHE_SMEM);
        dom_add(ev, G_CACHE, KB_CACHE_REREAD);
    }
    for (int v = 0; v <= 1; v++) {
        if (f->online) dom_add(ev, G_TWO_PASS, v);
        if (f->transcendental) dom_add(ev, G_FAST_MATH, v);
    }
    dom_add(ev, G_PERSISTENT, 0);
    dom_add(ev, G_PERSISTENT, 1);
    dom_add(ev, G_COL_SPLIT, 1);
    if (f->kind == KB_REGION_COL && !f->rereads)
        for (int s = 2; s <= 64 && (int64_t)s * 8 <= f->red; s *= 2) dom_add(ev, G_COL_SPLIT, s);
    /* row_split where rows are few next to the SMs (and long enough for parts): up to about 16
       blocks an SM in all */
    dom_add(ev, G_ROW_SPLIT, 1);
    if (f->kind == KB_REGION_ROW && f->splittable && f->kept > 0 && f->kept < 2 * (int64_t)f->num_sms)
        for (int s = 2; s <= KB_ROW_SPLIT_MAX && cdiv(f->red, s) >= KB_ROW_PART_MIN && (int64_t)s * f->kept <= 16 * (int64_t)f->num_sms;
             s *= 2)
            dom_add(ev, G_ROW_SPLIT, s);
    for (int i = 0; i < NGENES; i++) dom_add(ev, i, gene_get(&c, i));
}

kb_status kb_evolve_new(const kb_partition *p, int32_t r, const int64_t *symvals, const kb_device_info *dev,
                        uint64_t seed, int population, kb_evolve **out) {
    if (!out) return KB_ERR_INVALID;
    *out = NULL;
    kb_status st = check_region(p, r);
    if (st != KB_OK) return st;
    kb_ctx *ctx = kb_graph_ctx(p->graph);
    int32_t nsyms = kb_graph_nsymbols(p->graph);
    if (nsyms > 0 && !symvals) return KB_FAIL(ctx, KB_ERR_INVALID, "evolve: the graph has %d symbols, symvals is NULL", (int)nsyms);
    if (population <= 0) population = DEFAULT_POPULATION;
    if (population < 2 || population > 4096)
        return KB_FAIL(ctx, KB_ERR_INVALID, "evolve: population %d (2..4096)", population);
    kb_evolve *ev = kb_calloc(ctx, 1, sizeof *ev);
    KB_CHECK(ctx, ev != NULL, KB_ERR_OOM, "out of memory");
    ev->ctx = ctx;
    ev->population = population;
    ev->generation = -1;
    KB_TRY(kb_genome_default(p, r, symvals, dev, &ev->dflt));
    KB_TRY(tune_facts_of(p, r, symvals, dev, &ev->f));
    canonical(&ev->f, &ev->dflt, &ev->dflt); /* a no-op for genome.c's defaults; kept so dedup holds regardless */
    build_domains(ev);
    ev->batch = kb_calloc(ctx, (size_t)population, sizeof *ev->batch);
    ev->pool = kb_calloc(ctx, (size_t)population + ELITES, sizeof *ev->pool);
    KB_CHECK(ctx, ev->batch && ev->pool, KB_ERR_OOM, "out of memory");
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) ev->rng[i] = splitmix64(&x);
    *out = ev;
    ev = NULL;
cleanup:
    kb_evolve_free(ev);
    return st;
}

void kb_evolve_free(kb_evolve *ev) {
    if (!ev) return;
    kb_ctx *ctx = ev->ctx;
    kb_free(ctx, ev->recs, (size_t)ev->caprecs * sizeof *ev->recs);
    kb_free(ctx, ev->table, (size_t)ev->tcap * sizeof *ev->table);
    kb_free(ctx, ev->batch, (size_t)ev->population * sizeof *ev->batch);
    kb_free(ctx, ev->pool, ((size_t)ev->population + ELITES) * sizeof *ev->pool);
    kb_free(ctx, ev, sizeof *ev);
}

/* new: legal, and neither asked nor told before (this batch included) */
static int fresh(const kb_evolve *ev, kb_genome *g) {
    canonical(&ev->f, &ev->dflt, g);
    return legal_facts(&ev->f, g) && find(ev, g) < 0;
}

/* Is gene gi drawn at random? row_split came last and is pinned for most regions: there it draws
 * no random number, so their searches ask what they asked before the gene existed. */
static int drawn(const kb_evolve *ev, int gi) { return gi != G_ROW_SPLIT || ev->ndom[gi] > 1; }

static int dom_index(const kb_evolve *ev, int gi, int32_t v) {
    for (int i = 0; i < ev->ndom[gi]; i++)
        if (ev->dom[gi][i] == v) return i;
    return -1;
}

/* A fresh genome drawn uniformly gene by gene; failing that, the first fresh one of the domain
 * product walked from a random start, so only an exhausted space yields nothing. */
static int draw_fresh(kb_evolve *ev, kb_genome *out) {
    for (int t = 0; t < RANDOM_TRIES; t++) {
        kb_genome g = ev->dflt;
        for (int i = 0; i < NGENES; i++)
            if (drawn(ev, i)) *gene_at(&g, i) = ev->dom[i][below(ev->rng, (uint64_t)ev->ndom[i])];
        if (fresh(ev, &g)) {
            *out = g;
            return 1;
        }
    }
    uint64_t total = 1;
    for (int i = 0; i < NGENES; i++) total *= (uint64_t)ev->ndom[i];
    uint64_t start = below(ev->rng, total);
    for (uint64_t k = 0; k < total; k++) {
        uint64_t x = (start + k) % total;
        kb_genome g = ev->dflt;
        for (int i = 0; i < NGENES; i++) {
            *gene_at(&g, i) = ev->dom[i][x % (uint64_t)ev->ndom[i]];
            x /= (uint64_t)ev->ndom[i];
        }
        if (fresh(ev, &g)) {
            *out = g;
            return 1;
        }
    }
    return 0;
}

static int32_t tournament(kb_evolve *ev, int np) {
    int32_t best = ev->pool[below(ev->rng, (uint64_t)np)];
    for (int k = 1; k < TOURNAMENT; k++) {
        int32_t c = ev->pool[below(ev->rng, (uint64_t)np)];
        if (ev->recs[c].ms < ev->recs[best].ms || (ev->recs[c].ms == ev->recs[best].ms && c < best)) best = c;
    }
    return best;
}

static void mutate_gene(kb_evolve *ev, kb_genome *g, int gi) {
    int n = ev->ndom[gi], at = dom_index(ev, gi, gene_get(g, gi)), to;
    if (at < 0) {
        to = (int)below(ev->rng, (uint64_t)n);
    } else if (GENE[gi].ordinal && unit(ev->rng) < 0.75) {
        to = at + (below(ev->rng, 2) ? 1 : -1);
        if (to < 0) to = 1;
        if (to >= n) to = n - 2;
    } else {
        to = (at + 1 + (int)below(ev->rng, (uint64_t)(n - 1))) % n;
    }
    *gene_at(g, gi) = ev->dom[gi][to];
}

/* One child of the pool: tournament parents, gene-wise uniform crossover (half the time), then
 * one gene mutated (two, 30% of the time). */
static void make_child(kb_evolve *ev, int np, kb_genome *child) {
    *child = ev->recs[tournament(ev, np)].g;
    if (np > 1 && unit(ev->rng) < 0.5) {
        const kb_genome *b = &ev->recs[tournament(ev, np)].g;
        for (int i = 0; i < NGENES; i++)
            if (drawn(ev, i) && below(ev->rng, 2)) *gene_at(child, i) = gene_get(b, i);
    }
    int mutable_genes[NGENES], nm = 0;
    for (int i = 0; i < NGENES; i++)
        if (ev->ndom[i] > 1) mutable_genes[nm++] = i;
    if (!nm) return;
    int first = mutable_genes[below(ev->rng, (uint64_t)nm)];
    mutate_gene(ev, child, first);
    if (nm > 1 && unit(ev->rng) < 0.3) {
        int second = first;
        while (second == first) second = mutable_genes[below(ev->rng, (uint64_t)nm)];
        mutate_gene(ev, child, second);
    }
}

static int better(const rec *a, int32_t ia, const rec *b, int32_t ib) {
    return a->ms < b->ms || (a->ms == b->ms && ia < ib);
}

/* Parents: the successes of the batch just evaluated, plus the ELITES best ever (elitism). */
static int build_pool(kb_evolve *ev) {
    int np = 0;
    for (int32_t k = 0; k < ev->nbatch; k++) {
        int32_t i = ev->batch[k];
        if (ev->recs[i].told && ev->recs[i].ms >= 0) ev->pool[np++] = i;
    }
    int32_t elite[ELITES];
    int ne = 0;
    for (int32_t i = 0; i < ev->nrecs; i++) {
        const rec *c = &ev->recs[i];
        if (!c->told || c->ms < 0) continue;
        int at = ne < ELITES ? ne++ : ELITES;
        while (at > 0 && better(c, i, &ev->recs[elite[at - 1]], elite[at - 1])) {
            if (at < ELITES) elite[at] = elite[at - 1];
            at--;
        }
        if (at < ELITES) elite[at] = i;
    }
    for (int e = 0; e < ne; e++) {
        int dup = 0;
        for (int k = 0; k < np; k++) dup |= ev->pool[k] == elite[e];
        if (!dup) ev->pool[np++] = elite[e];
    }
    return np;
}

static kb_status breed(kb_evolve *ev) {
    kb_status st = reserve(ev, ev->population);
    if (st != KB_OK) return KB_FAIL(ev->ctx, st, "out of memory");
    int np = ev->generation < 0 ? 0 : build_pool(ev);
    int32_t nb = 0;
    kb_genome child;
    if (ev->generation < 0 && find(ev, &ev->dflt) < 0) /* the seed population: the default first */
        ev->batch[nb++] = add_rec(ev, &ev->dflt, 0);
    while (nb < ev->population) {
        int ok = 0;
        for (int t = 0; np > 0 && t < CHILD_TRIES && !ok; t++) {
            make_child(ev, np, &child);
            ok = fresh(ev, &child);
        }
        if (!ok && !draw_fresh(ev, &child)) break; /* the space is exhausted */
        ev->batch[nb++] = add_rec(ev, &child, ev->generation + 1);
    }
    if (nb == 0) { /* keep the evaluated batch: it still names the parents */
        ev->next = ev->nbatch;
        return KB_OK;
    }
    ev->nbatch = nb;
    ev->next = 0;
    ev->generation++;
    return KB_OK;
}

kb_status kb_evolve_ask(kb_evolve *ev, kb_genome *out, int max, int *n) {
    if (!ev || !n || (max > 0 && !out)) return KB_ERR_INVALID;
    *n = 0;
    if (max <= 0) return KB_OK;
    if (ev->next >= ev->nbatch || ev->generation < 0) {
        kb_status st = breed(ev);
        if (st != KB_OK) return st;
    }
    while (*n < max && ev->next < ev->nbatch) out[(*n)++] = ev->recs[ev->batch[ev->next++]].g;
    return KB_OK;
}

kb_status kb_evolve_tell(kb_evolve *ev, const kb_genome *gn, double ms) {
    if (!ev || !gn) return KB_ERR_INVALID;
    if (isnan(ms)) return KB_FAIL(ev->ctx, KB_ERR_INVALID, "evolve: the fitness is NaN (a failure is a negative time)");
    kb_genome g = *gn;
    char text[256];
    if (!legal_facts(&ev->f, &g) && !genome_eq(&g, &ev->dflt)) {
        kb_genome_format(gn, text, sizeof text);
        return KB_FAIL(ev->ctx, KB_ERR_INVALID, "evolve: genome \"%s\" is not legal for this region", text);
    }
    canonical(&ev->f, &ev->dflt, &g);
    int32_t i = find(ev, &g);
    if (i < 0) { /* a result from elsewhere (a cache, a user): remembered, never asked */
        kb_status st = reserve(ev, 1);
        if (st != KB_OK) return KB_FAIL(ev->ctx, st, "out of memory");
        i = add_rec(ev, &g, ev->generation < 0 ? 0 : ev->generation);
    }
    ev->recs[i].ms = ms < 0 ? -1.0 : ms;
    ev->recs[i].told = 1;
    return KB_OK;
}

int kb_evolve_best(const kb_evolve *ev, kb_genome *out, double *ms) {
    if (!ev) return 0;
    int32_t best = -1;
    for (int32_t i = 0; i < ev->nrecs; i++) {
        const rec *c = &ev->recs[i];
        if (c->told && c->ms >= 0 && (best < 0 || better(c, i, &ev->recs[best], best))) best = i;
    }
    if (best < 0) return 0;
    if (out) *out = ev->recs[best].g;
    if (ms) *ms = ev->recs[best].ms;
    return 1;
}

int kb_evolve_generation(const kb_evolve *ev) { return ev && ev->generation > 0 ? ev->generation : 0; }

int kb_evolve_domain(const kb_evolve *ev, int gene, int32_t *values, int max) {
    if (!ev || gene < 0 || gene >= NGENES) return 0;
    int n = ev->ndom[gene] < max ? ev->ndom[gene] : max;
    for (int i = 0; i < n; i++) values[i] = ev->dom[gene][i];
    return ev->ndom[gene];
}
