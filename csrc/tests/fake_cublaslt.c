/* fake_cublaslt.c — a stand-in libcublasLt for test_cublaslt.c, built as a shared object beside
 * it: the entry points cuda/cublaslt.c calls, on host memory, f32 only, with cuBLASLt's
 * column-major semantics as its documentation states them (D = epilogue(op(A) op(B) + bias),
 * element (i, j) of a matrix at i + j*ld). Each attribute setter checks the size of the value
 * it is given, as the real one does. Counters let the test see handles, heuristics and calls. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define OK 0
#define INVALID 7        /* CUBLAS_STATUS_INVALID_VALUE */
#define NOT_SUPPORTED 15

typedef struct { int compute, scale; int32_t transa, transb; uint32_t epilogue; void *bias, *aux;
                 int64_t aux_ld, aux_bs, bias_bs; } desc;
typedef struct { int type; uint64_t rows, cols; int64_t ld; int32_t batch; int64_t bs; } layout;
typedef struct { uint64_t ws; uint32_t align[4]; } pref;
typedef struct { uint64_t data[8]; } algo;
typedef struct { algo a; size_t ws; int state; float waves; int reserved[4]; } heuristic;

/* what the test reads back (fake_lt_stats) */
static int creates, destroys, heuristics, matmuls, last_compute;
static uint32_t last_align[4];

void fake_lt_stats(int *out) {
    out[0] = creates, out[1] = destroys, out[2] = heuristics, out[3] = matmuls, out[4] = last_compute;
    for (int i = 0; i < 4; i++) out[5 + i] = (int)last_align[i];
}

int cublasLtCreate(void **h) { *h = malloc(1); creates++; return OK; }
int cublasLtDestroy(void *h) { free(h); destroys++; return OK; }
const char *cublasLtGetStatusName(int s) { return s == INVALID ? "CUBLAS_STATUS_INVALID_VALUE" : "CUBLAS_STATUS_X"; }
const char *cublasLtGetStatusString(int s) { (void)s; return "fake"; }
size_t cublasLtGetVersion(void) { return 120604; }

int cublasLtMatmulDescCreate(desc **d, int compute, int scale) {
    *d = calloc(1, sizeof **d);
    (*d)->compute = compute, (*d)->scale = scale, (*d)->epilogue = 1;
    return OK;
}
int cublasLtMatmulDescDestroy(desc *d) { free(d); return OK; }

#define TAKE(field, type) \
    if (n != sizeof(type)) return INVALID; \
    memcpy(&d->field, v, sizeof(type)); \
    return OK
int cublasLtMatmulDescSetAttribute(desc *d, int attr, const void *v, size_t n) {
    switch (attr) {
    case 3: TAKE(transa, int32_t);
    case 4: TAKE(transb, int32_t);
    case 7: TAKE(epilogue, uint32_t);
    case 8: TAKE(bias, void *);
    case 10: TAKE(bias_bs, int64_t);
    case 11: TAKE(aux, void *);
    case 12: TAKE(aux_ld, int64_t);
    case 13: TAKE(aux_bs, int64_t);
    default: return INVALID;
    }
}

int cublasLtMatrixLayoutCreate(layout **l, int type, uint64_t rows, uint64_t cols, int64_t ld) {
    if (ld < (int64_t)rows || rows == 0 || cols == 0) return INVALID;
    *l = calloc(1, sizeof **l);
    **l = (layout){type, rows, cols, ld, 1, 0};
    return OK;
}
int cublasLtMatrixLayoutDestroy(layout *l) { free(l); return OK; }
int cublasLtMatrixLayoutSetAttribute(layout *d, int attr, const void *v, size_t n) {
    switch (attr) {
    case 5: TAKE(batch, int32_t);
    case 6: TAKE(bs, int64_t);
    default: return INVALID;
    }
}

int cublasLtMatmulPreferenceCreate(pref **p) { *p = calloc(1, sizeof **p); return OK; }
int cublasLtMatmulPreferenceDestroy(pref *p) { free(p); return OK; }
int cublasLtMatmulPreferenceSetAttribute(pref *d, int attr, const void *v, size_t n) {
    switch (attr) {
    case 1: TAKE(ws, uint64_t);
    case 5: TAKE(align[0], uint32_t);
    case 6: TAKE(align[1], uint32_t);
    case 7: TAKE(align[2], uint32_t);
    case 8: TAKE(align[3], uint32_t);
    default: return INVALID;
    }
}

int cublasLtMatmulAlgoGetHeuristic(void *h, desc *d, layout *a, layout *b, layout *c, layout *dd, pref *p, int want,
                                   heuristic *out, int *count) {
    (void)h, (void)a, (void)b, (void)c, (void)dd;
    heuristics++;
    memcpy(last_align, p->align, sizeof last_align);
    if (want < 1) return INVALID;
    memset(out, 0, sizeof *out);
    out->a.data[0] = 42 + d->epilogue;
    *count = 1;
    return OK;
}

static double gelu(double x) { return 0.5 * x * (1 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))); }
static double dgelu(double x) {
    double t = tanh(0.7978845608028654 * (x + 0.044715 * x * x * x));
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * 0.7978845608028654 * (1 + 3 * 0.044715 * x * x);
}

int cublasLtMatmul(void *h, desc *d, const float *alpha, const float *A, layout *la, const float *B, layout *lb,
                   const float *beta, const float *C, layout *lc, float *D, layout *ld, const algo *al, void *ws,
                   size_t ws_bytes, void *stream) {
    (void)h, (void)ws, (void)ws_bytes, (void)stream;
    matmuls++;
    last_compute = d->compute;
    if (*alpha != 1.0f || *beta != 0.0f || C != D || lc->ld != ld->ld || al->data[0] != 42 + d->epilogue) return INVALID;
    if (la->type != 0 || lb->type != 0 || ld->type != 0 || d->scale != 0) return NOT_SUPPORTED;   /* f32 only */
    const uint64_t m = ld->rows, n = ld->cols, k = d->transa ? la->rows : la->cols;
    if ((d->transa ? la->cols : la->rows) != m || (d->transb ? lb->cols : lb->rows) != k ||
        (d->transb ? lb->rows : lb->cols) != n || la->batch != ld->batch || lb->batch != ld->batch)
        return INVALID;
    const uint32_t e = d->epilogue;
    const int bias_in = (e & 4) != 0, relu = e == 6, gelu_on = (e & 32) != 0, aux_out = (e & 128) && gelu_on;
    const int dgelu_on = (e & 64) != 0, bgrad = (e & 16) != 0, bgradb = e == 512;
    if ((e != 1 && e != 4 && e != 6 && e != 36 && e != 164 && e != 192 && e != 208 && e != 512) ||
        ((bias_in || bgrad || bgradb) && !d->bias) || ((aux_out || dgelu_on) && (!d->aux || d->aux_ld < (int64_t)m)))
        return INVALID;
    for (int32_t bt = 0; bt < ld->batch; bt++) {
        const float *a = A + bt * la->bs, *b = B + bt * lb->bs;
        float *dst = D + bt * ld->bs, *aux = d->aux ? (float *)d->aux + bt * d->aux_bs : NULL;
        for (uint64_t i = 0; i < m; i++)
            for (uint64_t j = 0; j < n; j++) {
                double acc = 0;
                for (uint64_t l = 0; l < k; l++) {
                    double x = d->transa ? a[l + i * la->ld] : a[i + l * la->ld];
                    double y = d->transb ? b[j + l * lb->ld] : b[l + j * lb->ld];
                    acc += x * y;
                }
                if (bias_in) acc += ((const float *)d->bias)[i];
                if (aux_out) aux[i + j * d->aux_ld] = (float)acc;
                if (relu) acc = acc > 0 ? acc : 0;
                if (gelu_on) acc = gelu(acc);
                if (dgelu_on) acc *= dgelu(aux[i + j * d->aux_ld]);
                dst[i + j * ld->ld] = (float)acc;
            }
        if (bgrad)   /* the sum over D's columns: one per row */
            for (uint64_t i = 0; i < m; i++) {
                double s = 0;
                for (uint64_t j = 0; j < n; j++) s += dst[i + j * ld->ld];
                ((float *)d->bias)[i] = (float)s;
            }
        if (bgradb)  /* op(B) is k x n: one sum over k per column of D */
            for (uint64_t j = 0; j < n; j++) {
                double s = 0;
                for (uint64_t l = 0; l < k; l++) s += d->transb ? b[j + l * lb->ld] : b[l + j * lb->ld];
                ((float *)d->bias)[j] = (float)s;
            }
    }
    return OK;
}
