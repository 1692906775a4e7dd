/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * lora.c -- LoRA adapters on the projection weights (docs/maths.md §LoRA,
 * docs/layout.md §Adapters), in factored form: W_eff = W + s A^T B^T in the
 * arena's [in][out] orientation (s = alpha / r, A [r][in], B [out][r]),
 * never materialised in a step.
 *
 * The adapters stay out of every kernel. The model sets its adapter table
 * for the span of its forward and backward (rx_gemm_set_lora), and
 * rx_pgemm_batch hands each batch, after its base products, to
 * rx_lora_apply, which recognises the products of an adapted weight W by
 * its pointers:
 *
 *     forward   y  = x W           (B operand W, no transposes)  y  += (s x A^T) B^T
 *     dx        dx = dy W^T        (B operand W, tb = 1)          dx += (s dy B) A
 *     weight    dW = x^T dy        (C the grad of W, ta = 1)      dB  = dy^T (s x A^T)
 *                                                                 dA  = (s dy B)^T x
 *
 * The base's weight-grad product is skipped by its frozen span; the dA, dB
 * products overwrite the adapter grads (each weight has one weight-grad
 * product per backward), or add to them for a row group after the first
 * (rx_lora_accumulate). A batch's adapter work runs as two batches of
 * GEMMs in the projections' precision: first every h = s x A^T and
 * g = s dy B (one g when a weight's dx and weight-grad products share a
 * batch), then every product that reads them. Each is one rx_pgemm-class
 * GEMM, so the result has the same bits at any thread count.
 *
 * DoRA (docs/maths.md §DoRA) scales each output column o of the adapted
 * product by c[o] = M[o] / n[o], n the column norms of W + s A^T B^T over
 * the input, held constant in the backward (detached, as peft does). The
 * norms and c are computed once per forward and once per backward
 * (rx_lora_prepare: one GEMM D^T = B A and a pass over W, read from the
 * frozen base's rows when it holds W), so both see the same bits. Around
 * the base products of a batch:
 *
 *     forward   y = c (x W + s x A^T B^T)      the columns scaled after
 *     dx, dW    dz = c dy read in place of dy  (the base dx product too)
 *     dM        dM[o] = sum_t dy[t][o] z[t][o] / n[o],  z = x W + s x A^T B^T
 *
 * z is recomputed in the weight-grad job (one product through the base).
 */
#include <math.h>
#include <string.h>

#include "rx_internal.h"

typedef struct {
    const float *W, *GW;   /* base weight [in][out] and its grad: the keys */
    float *A, *B, *dA, *dB;
    float *M, *dM;         /* DoRA: magnitudes [out] and their grads, else NULL */
    float *norm, *c;       /* DoRA: column norms of W + s A^T B^T and M / norm [out] */
    size_t in, out;
    int param;
} adapter;

struct rx_lora {
    int r, n, dora;
    double alpha;
    float s;               /* alpha / r */
    size_t n_elems;
    float *arena, *grads;  /* [n_elems] each: per adapter A [r][in], B [out][r], DoRA's M [out] */
    float *scales;         /* DoRA: per adapter norm [out] then c [out] */
    adapter *ad;
    /* DoRA: every adapter's A, B as the kept norms read them ([sum r (in +
     * out)]), and the source of W and its version then; kept: the norms
     * hold for those (rx_lora_prepare) */
    float *seen;
    const void *seen_src;
    uint64_t seen_version;
    int kept;
    int acc;               /* rx_lora_accumulate: weight-grad products add (beta 1) */
};

/* ---- the adapters' arena (rx_internal.h) -------------------------------- */

void rx_lora_free(rx_lora *L) {
    if (!L) return;
    free(L->arena);
    free(L->grads);
    free(L->ad);
    free(L->scales);
    free(L->seen);
    free(L);
}

/* the outputs of targets t[0..i) */
static size_t outs_before(const rx_lora_target *t, int i) {
    size_t n = 0;
    for (int k = 0; k < i; k++) n += t[k].out;
    return n;
}

/* t [n] targets -> *out, the adapters zeroed in target order */
int rx_lora_create(int r, double alpha, int dora, const rx_lora_target *t, int n,
                   rx_lora **out) {
    static const char *const fn = "rx_ptmodel_enable_lora";
    *out = NULL;
    rx_lora *L = calloc(1, sizeof *L);
    if (!L) return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    L->r = r;
    L->n = n;
    L->dora = dora != 0;
    L->alpha = alpha;
    L->s = (float)(alpha / r);
    L->ad = calloc((size_t)n, sizeof *L->ad);
    size_t outs = 0, ab = 0;
    for (int i = 0; i < n; i++) {
        L->n_elems += (size_t)r * (t[i].in + t[i].out) + (L->dora ? t[i].out : 0);
        outs += t[i].out;
        ab += (size_t)r * (t[i].in + t[i].out);
    }
    L->arena = rx_fcalloc(L->n_elems);
    L->grads = rx_fcalloc(L->n_elems);
    if (L->dora) {
        L->scales = rx_fcalloc(2 * outs);
        L->seen = rx_falloc(ab);
    }
    if (!L->ad || !L->arena || !L->grads || (L->dora && (!L->scales || !L->seen))) {
        rx_lora_free(L);
        return rx_fail(RX_ENOMEM, "%s: out of memory for %d adapters", fn, n);
    }
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        adapter *a = &L->ad[i];
        a->W = t[i].W;
        a->GW = t[i].GW;
        a->in = t[i].in;
        a->out = t[i].out;
        a->param = t[i].param;
        a->A = L->arena + off;
        a->dA = L->grads + off;
        off += (size_t)r * a->in;
        a->B = L->arena + off;
        a->dB = L->grads + off;
        off += a->out * (size_t)r;
        if (L->dora) {
            a->M = L->arena + off;
            a->dM = L->grads + off;
            off += a->out;
            a->norm = L->scales + 2 * outs_before(t, i);
            a->c = a->norm + a->out;
        }
    }
    *out = L;
    return RX_OK;
}

int rx_lora_count(const rx_lora *L, int *r, double *alpha) {
    if (r) *r = L ? L->r : 0;
    if (alpha) *alpha = L ? L->alpha : 0.0;
    return L ? L->n : 0;
}

int rx_lora_adapter(const rx_lora *L, int i, int *param, int64_t *a_off, int64_t *b_off) {
    const adapter *a = &L->ad[i];
    if (param) *param = a->param;
    if (a_off) *a_off = (int64_t)(a->A - L->arena);
    if (b_off) *b_off = (int64_t)(a->B - L->arena);
    return RX_OK;
}

int64_t rx_lora_magnitude(const rx_lora *L, int i) {
    return L->dora ? (int64_t)(L->ad[i].M - L->arena) : -1;
}

void rx_lora_accumulate(rx_lora *L, int on) {
    if (L) L->acc = on;
}

float *rx_lora_arena(rx_lora *L, int64_t *n) {
    if (n) *n = L ? (int64_t)L->n_elems : 0;
    return L ? L->arena : NULL;
}

float *rx_lora_grad_arena(rx_lora *L, int64_t *n) {
    if (n) *n = L ? (int64_t)L->n_elems : 0;
    return L ? L->grads : NULL;
}

/* ---- the hook ------------------------------------------------------------ */

enum { J_FWD, J_DX, J_WGRAD };

typedef struct {
    int kind;
    const adapter *a;
    const float *x, *dy;   /* x [rows][in] (ld ldx), dy [rows][out] (ld ldy) */
    size_t ldx, ldy, rows;
    float *C;              /* y or dx, ld ldc (J_FWD, J_DX) */
    size_t ldc;
    float *h, *g;          /* [rows][r] scratch: s x A^T, s dy B */
    int g_from;            /* J_DX: index of the J_WGRAD job whose g it shares, else -1 */
} job;

#define LORA_OPS 16

/* the adapter on the weight at p, or NULL */
static const adapter *by_weight(const rx_lora *L, const float *p) {
    for (int i = 0; i < L->n; i++)
        if (L->ad[i].W == p) return &L->ad[i];
    return NULL;
}

/* the adapter whose weight's grad is at p, or NULL */
static const adapter *by_grad(const rx_lora *L, const float *p) {
    for (int i = 0; i < L->n; i++)
        if (L->ad[i].GW == p) return &L->ad[i];
    return NULL;
}

/* The adapter job of base product o, if it is one (kind < 0: none);
 * RX_EINVAL when a product reads an adapted weight in a form the adapter
 * does not know (a new kernel calling a projection differently). */
static int classify(const rx_lora *L, const rx_gemm_op *o, job *j) {
    const adapter *a;
    j->kind = -1;
    j->g_from = -1;
    if (o->M == 0 || o->N == 0 || o->K == 0) return RX_OK;
    if ((a = by_weight(L, o->B)) != NULL) {
        if (o->ta || (o->tb ? o->N != a->in || o->K != a->out : o->K != a->in || o->N != a->out))
            return rx_fail(RX_EINVAL, "rx_pgemm: a product reads an adapted weight [%zu, %zu] "
                           "as ta = %d, tb = %d, %zu x %zu x %zu", a->in, a->out, o->ta, o->tb,
                           o->M, o->N, o->K);
        j->kind = o->tb ? J_DX : J_FWD;
        j->a = a;
        j->rows = o->M;
        if (o->tb) j->dy = o->A, j->ldy = o->lda;
        else j->x = o->A, j->ldx = o->lda;
        j->C = o->C;
        j->ldc = o->ldc;
        return RX_OK;
    }
    if ((a = by_grad(L, o->C)) != NULL) {
        if (!o->ta || o->tb || o->M != a->in || o->N != a->out || o->beta != 0.0f)
            return rx_fail(RX_EINVAL, "rx_pgemm: a weight-grad product of an adapted weight "
                           "[%zu, %zu] as ta = %d, tb = %d, %zu x %zu x %zu, beta %g", a->in,
                           a->out, o->ta, o->tb, o->M, o->N, o->K, (double)o->beta);
        j->kind = J_WGRAD;
        j->a = a;
        j->rows = o->K;
        j->x = o->A, j->ldx = o->lda;
        j->dy = o->B, j->ldy = o->ldb;
    }
    return RX_OK;
}

/* p [n] *= s */
static void scale(float *p, size_t n, float s) {
    for (size_t i = 0; i < n; i++) p[i] *= s;
}

/* The adapter products of up to LORA_OPS base products ops[0..n), run
 * after those, on run */
static int apply_chunk(const rx_lora *L, const rx_gemm_op *ops, size_t n, rx_gemm_runner run) {
    job jb[LORA_OPS];
    size_t nj = 0, need = 0;
    const size_t r = (size_t)L->r;
    for (size_t i = 0; i < n; i++) {
        int rc = classify(L, &ops[i], &jb[nj]);
        if (rc != RX_OK) return rc;
        if (jb[nj].kind >= 0) nj++;
    }
    if (!nj) return RX_OK;
    /* a dx job shares the g of its weight's weight-grad job over the same dy */
    for (size_t i = 0; i < nj; i++) {
        if (jb[i].kind != J_DX) continue;
        for (size_t k = 0; k < nj; k++)
            if (jb[k].kind == J_WGRAD && jb[k].a == jb[i].a && jb[k].dy == jb[i].dy &&
                jb[k].ldy == jb[i].ldy && jb[k].rows == jb[i].rows)
                jb[i].g_from = (int)k;
    }
    for (size_t i = 0; i < nj; i++)
        need += jb[i].rows * r * (jb[i].kind == J_WGRAD ? 2 : 1);
    float *buf = rx_thread_buffer(RX_BUF_LORA, need * sizeof(float));
    if (!buf) return rx_fail(RX_ENOMEM, "rx_pgemm: out of memory for the adapters' scratch");
    rx_gemm_op p1[2 * LORA_OPS], p2[2 * LORA_OPS];
    size_t n1 = 0, n2 = 0;
    const float beta = L->acc ? 1.0f : 0.0f;
    for (size_t i = 0; i < nj; i++) {
        job *j = &jb[i];
        const adapter *a = j->a;
        const size_t rows = j->rows;
        if (j->kind != J_DX) {   /* h = x A^T [rows][r] */
            j->h = buf, buf += rows * r;
            p1[n1++] = (rx_gemm_op){0, 1, rows, r, a->in, j->x, j->ldx, a->A, a->in, 0.0f, j->h, r};
        }
        if (j->kind != J_FWD && j->g_from < 0) {   /* g = dy B [rows][r] */
            j->g = buf, buf += rows * r;
            p1[n1++] = (rx_gemm_op){0, 0, rows, r, a->out, j->dy, j->ldy, a->B, r, 0.0f, j->g, r};
        }
    }
    int rc = run(p1, n1);
    if (rc != RX_OK) return rc;
    for (size_t i = 0; i < nj; i++) {
        job *j = &jb[i];
        if (j->kind != J_DX) scale(j->h, j->rows * r, L->s);
        if (j->kind != J_FWD && j->g_from < 0) scale(j->g, j->rows * r, L->s);
    }
    for (size_t i = 0; i < nj; i++) {
        job *j = &jb[i];
        const adapter *a = j->a;
        const size_t rows = j->rows;
        if (j->g_from >= 0) j->g = jb[j->g_from].g;
        switch (j->kind) {
        case J_FWD:   /* y += h B^T */
            p2[n2++] = (rx_gemm_op){0, 1, rows, a->out, r, j->h, r, a->B, r, 1.0f, j->C, j->ldc};
            break;
        case J_DX:    /* dx += g A */
            p2[n2++] = (rx_gemm_op){0, 0, rows, a->in, r, j->g, r, a->A, a->in, 1.0f, j->C, j->ldc};
            break;
        default:      /* dB (+)= dy^T h, dA (+)= g^T x */
            p2[n2++] = (rx_gemm_op){1, 0, a->out, r, rows, j->dy, j->ldy, j->h, r, beta, a->dB,
                                    r};
            p2[n2++] = (rx_gemm_op){1, 0, r, a->in, rows, j->g, r, j->x, j->ldx, beta, a->dA,
                                    a->in};
        }
    }
    return run(p2, n2);
}

/* ---- DoRA ------------------------------------------------------------------ */

/* Whether the kept norms hold for the arena's A, B now and W in src:
 * each adapter's A and B (contiguous, A [r][in] then B [out][r]) bit for
 * bit those the norms read, and src the same at the same version (a held
 * base changes only by a fill). A float32 W in the arena is never kept:
 * its NumPy view can be written unseen. */
static int norms_hold(const rx_lora *L, const rx_weight_columns *cols, const void *src) {
    if (!L->kept || !src || src != L->seen_src || cols->version(src) != L->seen_version)
        return 0;
    const float *seen = L->seen;
    for (int k = 0; k < L->n; k++) {
        const size_t n = (size_t)L->r * (L->ad[k].in + L->ad[k].out);
        if (memcmp(seen, L->ad[k].A, n * sizeof(float))) return 0;
        seen += n;
    }
    return 1;
}

/* c = M / norm for every adapter (a zero column has no direction: c 0) */
static void magnitudes_over_norms(rx_lora *L) {
    for (int k = 0; k < L->n; k++) {
        adapter *a = &L->ad[k];
        for (size_t o = 0; o < a->out; o++)
            a->c[o] = a->norm[o] > 0.0f ? a->M[o] / a->norm[o] : 0.0f;
    }
}

/* Every adapter's norm[o] = ||W[:, o] + s (A^T B^T)[:, o]|| over in (the
 * squares summed in double) and c = M / norm, W read through cols where
 * it is held outside the arena (src: a frozen base). D^T = B A [out][in]
 * is one fp32 GEMM in a scratch that grows once; a held W's columns are
 * decoded one at a time into each thread's row scratch, so a quantised
 * base is never expanded whole. The norms are the forward's, the
 * backward's and every generation step's: kept while they hold
 * (norms_hold), they cost r * in * out multiply-adds per adapter once per
 * change of A or B, not per call. */
static int compute_norms(rx_lora *L, const rx_weight_columns *cols, const void *src);

int rx_lora_prepare(rx_lora *L, const rx_weight_columns *cols, const void *src) {
    if (!L || !L->dora) return RX_OK;
    if (norms_hold(L, cols, src)) {
        magnitudes_over_norms(L);   /* M trains: only c moves */
        return RX_OK;
    }
    rx_prof_push(RX_PROF_DORA);
    const int rc = compute_norms(L, cols, src);
    rx_prof_pop();
    return rc;
}

/* rx_lora_prepare's norms taken again */
static int compute_norms(rx_lora *L, const rx_weight_columns *cols, const void *src) {
    enum { NB = 16 };
    L->kept = 0;
    int all_held = src != NULL;
    const size_t r = (size_t)L->r;
    for (int k = 0; k < L->n; k++) {
        adapter *a = &L->ad[k];
        const size_t in = a->in, out = a->out;
        float *DT = rx_thread_buffer(RX_BUF_DORA, in * out * sizeof(float));
        if (!DT) return rx_fail(RX_ENOMEM, "rx_lora_prepare: out of memory for DoRA's norms");
        const rx_gemm_op op = {0, 0, out, in, r, a->B, r, a->A, in, 0.0f, DT, in};
        int rc = rx_sgemm_batch(&op, 1);
        if (rc != RX_OK) return rc;
        const void *b = src ? cols->find(src, a->W) : NULL;
        all_held &= b != NULL;
        const double s = L->s;
        int nomem = 0;
        /* columns in blocks of NB: a float32 W is read a cache line of a row at a time */
#pragma omp parallel for schedule(static) reduction(| : nomem)
        for (size_t o0 = 0; o0 < out; o0 += NB) {
            const size_t nb = out - o0 < NB ? out - o0 : NB;
            float *w = b ? rx_thread_buffer(RX_BUF_DORA_ROW, NB * in * sizeof(float)) : NULL;
            if (b && !w) {
                nomem = 1;
                continue;
            }
            for (size_t k = 0; b && k < nb; k++) cols->column(b, o0 + k, w + k * in);
            double acc[NB] = {0};
            for (size_t i = 0; i < in; i++)
                for (size_t k = 0; k < nb; k++) {
                    const double v = (double)(b ? w[k * in + i] : a->W[i * out + o0 + k]) +
                                     s * DT[(o0 + k) * in + i];
                    acc[k] += v * v;
                }
            for (size_t k = 0; k < nb; k++) a->norm[o0 + k] = (float)sqrt(acc[k]);
        }
        if (nomem) return rx_fail(RX_ENOMEM, "rx_lora_prepare: out of memory for a base row");
    }
    magnitudes_over_norms(L);
    if (all_held) {   /* what these norms read, to keep them while it stays */
        float *seen = L->seen;
        for (int k = 0; k < L->n; k++) {
            const size_t n = r * (L->ad[k].in + L->ad[k].out);
            memcpy(seen, L->ad[k].A, n * sizeof(float));
            seen += n;
        }
        L->seen_src = src;
        L->seen_version = cols->version(src);
        L->kept = 1;
    }
    return RX_OK;
}

int rx_lora_norms(const rx_lora *L, int i, float *out) {
    if (!L->dora) return rx_fail(RX_EINVAL, "rx_ptmodel_lora_norms: the adapters are not DoRA");
    memcpy(out, L->ad[i].norm, L->ad[i].out * sizeof(float));
    return RX_OK;
}

/* y [rows][out] (ld ldy) = beta y + c z column by column, z [rows][out]
 * (ld ldz; z may be y, when beta is 0) */
static void scale_columns(const float *z, size_t ldz, float beta, float *y, size_t ldy,
                          size_t rows, size_t out, const float *c) {
#pragma omp parallel for schedule(static)
    for (size_t t = 0; t < rows; t++)
        for (size_t o = 0; o < out; o++)
            y[t * ldy + o] = (beta != 0.0f ? beta * y[t * ldy + o] : 0.0f) + c[o] * z[t * ldz + o];
}

/* dM[o] = sum_t dy[t][o] z[t][o] / norm[o] (0 for a zero column), the sum
 * in double over t in order (columns in blocks of 16 across threads: the same bits at any
 * thread count) */
static void magnitude_grad(const adapter *a, const float *dy, size_t ldy, const float *z,
                           size_t rows) {
    enum { CB = 16 };
    const size_t out = a->out;
#pragma omp parallel for schedule(static)
    for (size_t o0 = 0; o0 < out; o0 += CB) {
        const size_t o1 = o0 + CB < out ? o0 + CB : out;
        double acc[CB] = {0};
        for (size_t t = 0; t < rows; t++)
            for (size_t o = o0; o < o1; o++)
                acc[o - o0] += (double)dy[t * ldy + o] * z[t * out + o];
        for (size_t o = o0; o < o1; o++)
            a->dM[o] = a->norm[o] > 0.0f ? (float)(acc[o - o0] / a->norm[o]) : 0.0f;
    }
}

/* A DoRA chunk of up to LORA_OPS products: the base products with dz = c dy
 * in place of each adapted weight's dy, LoRA's products over the same
 * (apply_chunk), then the forward's columns scaled and dM. */
static int dora_chunk(const rx_lora *L, const rx_gemm_op *ops, size_t n, rx_gemm_runner base,
                      rx_gemm_runner run) {
    rx_gemm_op live[LORA_OPS];
    job jb[LORA_OPS];
    float *dzs[LORA_OPS];
    size_t at[LORA_OPS], nj = 0, need = 0;
    const size_t r = (size_t)L->r;
    memcpy(live, ops, n * sizeof *ops);
    for (size_t i = 0; i < n; i++) {
        int rc = classify(L, &ops[i], &jb[nj]);
        if (rc != RX_OK) return rc;
        if (jb[nj].kind < 0) continue;
        /* dz, or an accumulating forward's own product before it is scaled */
        if (jb[nj].kind != J_FWD || ops[i].beta != 0.0f) need += jb[nj].rows * jb[nj].a->out;
        if (jb[nj].kind == J_WGRAD) need += jb[nj].rows * (jb[nj].a->out + r);
        at[nj++] = i;
    }
    float *buf = need ? rx_thread_buffer(RX_BUF_DORA, need * sizeof(float)) : NULL;
    if (need && !buf) return rx_fail(RX_ENOMEM, "rx_pgemm: out of memory for DoRA's scratch");
    /* dz = c dy [rows][out] once per (adapter, dy), read by the products in place of dy */
    for (size_t i = 0; i < nj; i++) {
        job *j = &jb[i];
        const adapter *a = j->a;
        if (j->kind == J_FWD) {   /* C = beta C + c (x W_eff): x W_eff apart first */
            if (live[at[i]].beta != 0.0f) {
                live[at[i]].C = buf, live[at[i]].ldc = a->out, live[at[i]].beta = 0.0f;
                buf += j->rows * a->out;
            }
            continue;
        }
        float *dz = NULL;
        for (size_t k = 0; k < i && !dz; k++)
            if (jb[k].kind != J_FWD && jb[k].a == a && jb[k].dy == j->dy &&
                jb[k].ldy == j->ldy && jb[k].rows == j->rows)
                dz = dzs[k];
        if (!dz) {
            dz = buf, buf += j->rows * a->out;
#pragma omp parallel for schedule(static)
            for (size_t t = 0; t < j->rows; t++)
                for (size_t o = 0; o < a->out; o++)
                    dz[t * a->out + o] = j->dy[t * j->ldy + o] * a->c[o];
        }
        dzs[i] = dz;
        if (j->kind == J_DX) live[at[i]].A = dz, live[at[i]].lda = a->out;
        else live[at[i]].B = dz, live[at[i]].ldb = a->out;
    }
    int rc = base(live, n);
    if (rc == RX_OK) rc = apply_chunk(L, live, n, run);
    for (size_t i = 0; i < nj && rc == RX_OK; i++) {
        const job *j = &jb[i];
        const adapter *a = j->a;
        if (j->kind == J_FWD) {
            scale_columns(live[at[i]].C, live[at[i]].ldc, ops[at[i]].beta, j->C, j->ldc, j->rows,
                          a->out, a->c);
        } else if (j->kind == J_WGRAD) {   /* z = x W + (s x A^T) B^T, then dM */
            float *z = buf, *h = buf + j->rows * a->out;
            buf += j->rows * (a->out + r);
            const rx_gemm_op zw = {0, 0, j->rows, a->out, a->in, j->x, j->ldx, a->W, a->out,
                                   0.0f, z, a->out};
            const rx_gemm_op hx = {0, 1, j->rows, r, a->in, j->x, j->ldx, a->A, a->in, 0.0f, h, r};
            rc = base(&zw, 1);
            if (rc == RX_OK) rc = run(&hx, 1);
            if (rc != RX_OK) break;
            scale(h, j->rows * r, L->s);
            const rx_gemm_op zb = {0, 1, j->rows, a->out, r, h, r, a->B, r, 1.0f, z, a->out};
            if ((rc = run(&zb, 1)) == RX_OK) magnitude_grad(a, j->dy, j->ldy, z, j->rows);
        }
    }
    return rc;
}

/* The base products of ops[0..n) on base, then the adapters' on run */
int rx_lora_apply(const rx_lora *L, const rx_gemm_op *ops, size_t n, rx_gemm_runner base,
                  rx_gemm_runner run) {
    int rc = RX_OK;
    if (L->dora) {
        for (size_t b = 0; b < n && rc == RX_OK; b += LORA_OPS)
            rc = dora_chunk(L, ops + b, n - b < LORA_OPS ? n - b : LORA_OPS, base, run);
        return rc;
    }
    rc = base(ops, n);
    for (size_t b = 0; b < n && rc == RX_OK; b += LORA_OPS)
        rc = apply_chunk(L, ops + b, n - b < LORA_OPS ? n - b : LORA_OPS, run);
    return rc;
}
