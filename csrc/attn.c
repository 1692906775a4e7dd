/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * attn.c -- the MoBA-sparse attention block (SPEC §6):
 *     h1 = ln1(x);  q, k, v = h1 . {receptance_w, key_w, value_w}
 *     per (b, head, query t), ct = t / chunk_size:
 *         gate_j  = q_t . (mean key of chunk j)          for complete chunks j < ct
 *         keys(t) = the moba_top_k chunks of largest gate (all of them when
 *                   moba_top_k <= 0 or >= ct; ties to the smaller j)
 *                   plus the own chunk causally, ct*chunk_size <= s <= t
 *         y_t     = softmax_{s in keys(t)}(q_t . k_s / sqrt(N)) . v
 *     x1 = x + y . output_w;  h2 = ln2(x1);  out = x1 + CM(h2)
 *
 * Cost follows the keys actually attended, O(T (top_k+1) chunk_size C),
 * plus the gates, O(T^2 C / chunk_size). No T x T matrix exists outside the
 * score_av test hook: every query walks its own key ranges.
 *
 * Selection: chunk means and gates are computed in double by one code path
 * that the forward and the backward share; the backward recomputes q and k
 * bit-identically (same GEMM on the same inputs), so the selection it holds
 * fixed is exactly the forward's. Double gates also keep the choice as close
 * as possible to a float64 evaluation of the same q and k.
 *
 * Softmax: two passes over a query's keys (scores into a per-thread row,
 * then exp(score - max) with the sum in double); the forward keeps the
 * per-query log-sum-exp so the backward recovers p = exp(score - lse).
 * The backward runs in two race-free passes: per query (dq and
 * D_t = dy_t . y_t), then per key chunk (dk, dv, gathering every query that
 * attends the chunk), so both parallelise over B*H*T, not just B*H.
 */
#include <string.h>

#include "rx_internal.h"

/* Geometry of one call. */
typedef struct {
    size_t B, T, H, N, C;
    size_t cs;      /* chunk_size */
    size_t nck;     /* complete chunks, T / cs: the only gate candidates */
    size_t nch;     /* all chunks, ceil(T / cs): the key blocks of the backward */
    size_t kk;      /* chunks a choosing query keeps; 0 when no query chooses */
    float scale;    /* 1 / sqrt(N) */
    int nt;         /* threads for this call's parallel loops */
} attn_dims;

/* Scratch of one call, allocated once. */
typedef struct {
    double *kmean;  /* [B*H][nck][N] mean key of every complete chunk */
    double *gates;  /* [nt][nck] per-thread gate row */
    int *sel;       /* [B*H][T][kk] chosen chunks of each choosing query, ascending */
    float *lse;     /* [B*H][T] log-sum-exp of each query's scaled scores */
    float *dd;      /* [B*H][T] D_t = dy_t . y_t (backward only) */
    float *sc;      /* [nt][T] per-thread score row */
} attn_work;

static int attn_dims_init(const rx_attn_params *P, int B, int T, attn_dims *d) {
    if (!P || B < 1 || T < 1 || P->n_head < 1 || P->head_size < 1 || P->chunk_size < 1 ||
        (int64_t)P->n_head * P->head_size != (int64_t)P->c)
        return 0;
    d->B = (size_t)B;
    d->T = (size_t)T;
    d->H = (size_t)P->n_head;
    d->N = (size_t)P->head_size;
    d->C = (size_t)P->c;
    d->cs = (size_t)P->chunk_size;
    d->nck = d->T / d->cs;
    d->nch = (d->T + d->cs - 1) / d->cs;
    d->kk = P->moba_top_k > 0 && (size_t)P->moba_top_k < d->nck ? (size_t)P->moba_top_k : 0;
    d->scale = (float)(1.0 / sqrt((double)P->head_size));
    d->nt = rx_in_parallel() || d->B * d->T * d->C < 4096 ? 1 : rx_max_threads();
    return 1;
}

static void attn_work_free(attn_work *w) {
    free(w->kmean);
    free(w->gates);
    free(w->sel);
    free(w->lse);
    free(w->dd);
    free(w->sc);
}

static int attn_work_alloc(const attn_dims *d, attn_work *w, int backward) {
    const size_t BHT = d->B * d->H * d->T, nt = (size_t)d->nt;
    w->kmean = (double *)rx_alloc(d->B * d->H * d->nck * d->N, sizeof(double));
    w->gates = (double *)rx_alloc(nt * d->nck, sizeof(double));
    w->sel = (int *)rx_alloc(BHT * d->kk, sizeof(int));
    w->lse = rx_falloc(BHT);
    w->dd = backward ? rx_falloc(BHT) : NULL;
    w->sc = rx_falloc(nt * d->T);
    if (!w->kmean || !w->gates || !w->sel || !w->lse || (backward && !w->dd) || !w->sc) {
        attn_work_free(w);
        return RX_ENOMEM;
    }
    return RX_OK;
}

/* 1 when query t keeps a chosen subset of the earlier chunks, 0 when it
 * attends all of them. */
static inline int attn_chooses(const attn_dims *d, size_t t) {
    return d->kk > 0 && d->kk < t / d->cs;
}

/* Query t attends nranges key ranges: its chosen chunks in ascending order,
 * then its own chunk up to t; a query that does not choose has the single
 * range [0, t]. */
static inline size_t attn_nranges(const attn_dims *d, size_t t) {
    return attn_chooses(d, t) ? d->kk + 1 : 1;
}

/* The r-th range [lo, *hi) of query t; sel_t: its chosen chunks. */
static inline size_t attn_range(const attn_dims *d, size_t t, const int *sel_t, size_t r,
                                size_t *hi) {
    if (r + 1 < attn_nranges(d, t)) {
        size_t lo = (size_t)sel_t[r] * d->cs;
        *hi = lo + d->cs;
        return lo;
    }
    *hi = t + 1;
    return attn_chooses(d, t) ? t / d->cs * d->cs : 0;
}

/* 1 when chunk j is among the kk ascending entries of sel_t. */
static inline int attn_selected(const int *sel_t, size_t kk, size_t j) {
    size_t lo = 0, hi = kk;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if ((size_t)sel_t[mid] < j) lo = mid + 1;
        else hi = mid;
    }
    return lo < kk && (size_t)sel_t[lo] == j;
}

static inline float attn_dot(const float *a, const float *b, size_t N) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (size_t n = 0; n < N; n++) s += a[n] * b[n];
    return s;
}

static inline void attn_axpy(float a, const float *x, float *y, size_t N) {
#pragma omp simd
    for (size_t n = 0; n < N; n++) y[n] += a * x[n];
}

/* ---- selection ----------------------------------------------------------- */

/* kb: one head's key rows (stride C); km [nck][N] = mean key of each complete
 * chunk, accumulated in double */
static void attn_chunk_mean(const attn_dims *d, const float *kb, size_t j, double *km) {
    for (size_t n = 0; n < d->N; n++) km[n] = 0.0;
    for (size_t s = j * d->cs; s < (j + 1) * d->cs; s++) {
        const float *ks = kb + s * d->C;
        for (size_t n = 0; n < d->N; n++) km[n] += ks[n];
    }
    for (size_t n = 0; n < d->N; n++) km[n] /= (double)d->cs;
}

/* qt [N]; km [ct][N]; sel [kk] receives the kk chunks of largest gate
 * q_t . km_j (equal gates: the smaller j), in ascending order; g: scratch [ct] */
RX_HOT static void attn_select_query(const float *qt, const double *km, size_t ct, size_t N,
                                     size_t kk, double *g, int *sel) {
    for (size_t j = 0; j < ct; j++) {
        const double *m = km + j * N;
        double s = 0.0;
#pragma omp simd reduction(+ : s)
        for (size_t n = 0; n < N; n++) s += (double)qt[n] * m[n];
        g[j] = s;
    }
    /* sel[0..n) ordered by gate, descending; a later j needs a strictly
     * larger gate to move ahead, which settles ties toward the smaller j */
    size_t n = 0;
    for (size_t j = 0; j < ct; j++) {
        if (n == kk && !(g[j] > g[sel[kk - 1]])) continue;
        size_t pos = n < kk ? n++ : kk - 1;
        while (pos > 0 && g[j] > g[sel[pos - 1]]) {
            sel[pos] = sel[pos - 1];
            pos--;
        }
        sel[pos] = (int)j;
    }
    for (size_t i = 1; i < kk; i++) {
        int v = sel[i];
        size_t p = i;
        for (; p > 0 && sel[p - 1] > v; p--) sel[p] = sel[p - 1];
        sel[p] = v;
    }
}

/* q, k: [B][T][C]. Fills w->kmean and w->sel. */
static void attn_select(const attn_dims *d, const float *q, const float *k, attn_work *w) {
    if (!d->kk) return;
    const size_t H = d->H, T = d->T, C = d->C, N = d->N, nck = d->nck;
    const size_t n_means = d->B * H * nck, n_queries = d->B * H * T;
#pragma omp parallel for schedule(static) num_threads(d->nt) if (d->nt > 1)
    for (size_t i = 0; i < n_means; i++) {
        size_t bh = i / nck, b = bh / H, h = bh % H;
        attn_chunk_mean(d, k + b * T * C + h * N, i % nck, w->kmean + i * N);
    }
#pragma omp parallel for schedule(dynamic, 64) num_threads(d->nt) if (d->nt > 1)
    for (size_t i = 0; i < n_queries; i++) {
        size_t bh = i / T, t = i % T, b = bh / H, h = bh % H;
        if (!attn_chooses(d, t)) continue;
        attn_select_query(q + (b * T + t) * C + h * N, w->kmean + bh * nck * N, t / d->cs, N,
                          d->kk, w->gates + (size_t)rx_thread_id() * nck, w->sel + i * d->kk);
    }
}

/* ---- attention core -------------------------------------------------------- */

/* Query t of one head. qt, yt [N]; kb, vb: the head's rows (stride C);
 * sel_t: its chosen chunks. Writes y_t and returns the log-sum-exp of its
 * scaled scores; pt [T] (NULL: not wanted) receives the weights, exactly zero
 * off the attended keys. sc: scratch [T]. */
RX_HOT static float attn_query_forward(const attn_dims *d, const float *qt, const float *kb,
                                       const float *vb, size_t t, const int *sel_t, float *yt,
                                       float *pt, float *sc) {
    const size_t N = d->N, C = d->C, nr = attn_nranges(d, t);
    size_t n = 0, hi;
    float m = -INFINITY;
    for (size_t r = 0; r < nr; r++)
        for (size_t s = attn_range(d, t, sel_t, r, &hi); s < hi; s++) {
            float a = attn_dot(qt, kb + s * C, N) * d->scale;
            sc[n++] = a;
            if (a > m) m = a;
        }
    for (size_t i = 0; i < N; i++) yt[i] = 0.0f;
    double sum = 0.0;
    n = 0;
    for (size_t r = 0; r < nr; r++)
        for (size_t s = attn_range(d, t, sel_t, r, &hi); s < hi; s++) {
            float e = expf(sc[n] - m);
            sc[n++] = e;
            sum += e;
            attn_axpy(e, vb + s * C, yt, N);
        }
    float inv = (float)(1.0 / sum);
    for (size_t i = 0; i < N; i++) yt[i] *= inv;
    if (pt) {
        memset(pt, 0, d->T * sizeof(float));
        n = 0;
        for (size_t r = 0; r < nr; r++)
            for (size_t s = attn_range(d, t, sel_t, r, &hi); s < hi; s++) pt[s] = sc[n++] * inv;
    }
    return (float)((double)m + log(sum));
}

/* q, k, v, y: [B][T][C]; p: [B][H][T][T] or NULL. Selects (w->kmean,
 * w->sel), then writes y and w->lse. */
static void attn_core_forward(const attn_dims *d, const float *q, const float *k,
                              const float *v, attn_work *w, float *y, float *p) {
    const size_t H = d->H, T = d->T, C = d->C, N = d->N, n_queries = d->B * H * T;
    attn_select(d, q, k, w);
#pragma omp parallel for schedule(dynamic, 16) num_threads(d->nt) if (d->nt > 1)
    for (size_t i = 0; i < n_queries; i++) {
        size_t bh = i / T, t = i % T, b = bh / H, h = bh % H;
        size_t head = b * T * C + h * N, o = head + t * C;
        w->lse[i] = attn_query_forward(d, q + o, k + head, v + head, t, w->sel + i * d->kk,
                                       y + o, p ? p + i * T : NULL,
                                       w->sc + (size_t)rx_thread_id() * T);
    }
}

/* Query t of one head, selection fixed: dq_t [N], returns D_t = dy_t . y_t.
 * lse: its forward log-sum-exp. */
RX_HOT static float attn_query_backward(const attn_dims *d, const float *qt, const float *kb,
                                        const float *vb, size_t t, const int *sel_t,
                                        const float *yt, const float *dyt, float lse,
                                        float *dqt) {
    const size_t N = d->N, C = d->C, nr = attn_nranges(d, t);
    double dd = 0.0;
    for (size_t i = 0; i < N; i++) dd += (double)dyt[i] * yt[i];
    const float D = (float)dd;
    size_t hi;
    for (size_t i = 0; i < N; i++) dqt[i] = 0.0f;
    for (size_t r = 0; r < nr; r++)
        for (size_t s = attn_range(d, t, sel_t, r, &hi); s < hi; s++) {
            const float *ks = kb + s * C;
            float p = expf(attn_dot(qt, ks, N) * d->scale - lse);
            float ds = p * (attn_dot(dyt, vb + s * C, N) - D);
            attn_axpy(ds * d->scale, ks, dqt, N);
        }
    return D;
}

/* Keys of chunk j of one head: dk, dv rows [j*cs, min((j+1)*cs, T)),
 * gathered from every query that attends them (its own chunk causally, each
 * later query that keeps chunk j). qb..dvb: the head's rows (stride C);
 * sel_h, lse_h, dd_h: the head's per-query [T] rows. */
RX_HOT static void attn_chunk_backward(const attn_dims *d, const float *qb, const float *kb,
                                       const float *vb, const float *dyb, const int *sel_h,
                                       const float *lse_h, const float *dd_h, size_t j,
                                       float *dkb, float *dvb) {
    const size_t N = d->N, C = d->C, T = d->T, lo = j * d->cs;
    const size_t hi = lo + d->cs < T ? lo + d->cs : T;
    for (size_t s = lo; s < hi; s++)
        for (size_t n = 0; n < N; n++) dkb[s * C + n] = dvb[s * C + n] = 0.0f;
    for (size_t t = lo; t < T; t++) {
        if (t >= hi && attn_chooses(d, t) && !attn_selected(sel_h + t * d->kk, d->kk, j))
            continue;
        const float *qt = qb + t * C, *dyt = dyb + t * C;
        const size_t end = t < hi ? t + 1 : hi;
        for (size_t s = lo; s < end; s++) {
            const float *ks = kb + s * C, *vs = vb + s * C;
            float p = expf(attn_dot(qt, ks, N) * d->scale - lse_h[t]);
            float ds = p * (attn_dot(dyt, vs, N) - dd_h[t]);
            attn_axpy(ds * d->scale, qt, dkb + s * C, N);
            attn_axpy(p, dyt, dvb + s * C, N);
        }
    }
}

/* q, k, v, y, dy, dq, dk, dv: [B][T][C]; w as left by attn_core_forward on
 * the same q, k, v (selection and lse). */
static void attn_core_backward(const attn_dims *d, const float *q, const float *k,
                               const float *v, const float *y, const float *dy, attn_work *w,
                               float *dq, float *dk, float *dv) {
    const size_t H = d->H, T = d->T, C = d->C, N = d->N, kk = d->kk;
    const size_t n_queries = d->B * H * T, n_blocks = d->B * H * d->nch;
#pragma omp parallel for schedule(dynamic, 16) num_threads(d->nt) if (d->nt > 1)
    for (size_t i = 0; i < n_queries; i++) {
        size_t bh = i / T, t = i % T, b = bh / H, h = bh % H;
        size_t head = b * T * C + h * N, o = head + t * C;
        w->dd[i] = attn_query_backward(d, q + o, k + head, v + head, t, w->sel + i * kk, y + o,
                                       dy + o, w->lse[i], dq + o);
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(d->nt) if (d->nt > 1)
    for (size_t i = 0; i < n_blocks; i++) {
        size_t bh = i / d->nch, b = bh / H, h = bh % H, head = b * T * C + h * N;
        attn_chunk_backward(d, q + head, k + head, v + head, dy + head, w->sel + bh * T * kk,
                            w->lse + bh * T, w->dd + bh * T, i % d->nch, dk + head, dv + head);
    }
}

/* q, k, v, y: [B][T][C]; p: [B][H][T][T] or NULL */
int rx_attn_score_av_forward(const rx_attn_params *P, const float *q, const float *k,
                             const float *v, int B, int T, float *p, float *y) {
    attn_dims d;
    attn_work w;
    if (!attn_dims_init(P, B, T, &d) || !q || !k || !v || !y) return RX_EINVAL;
    if (attn_work_alloc(&d, &w, 0) != RX_OK) return RX_ENOMEM;
    attn_core_forward(&d, q, k, v, &w, y, p);
    attn_work_free(&w);
    return RX_OK;
}

/* q, k, v, dy, dq, dk, dv: [B][T][C] */
int rx_attn_score_av_backward(const rx_attn_params *P, const float *q, const float *k,
                              const float *v, const float *dy, int B, int T,
                              float *dq, float *dk, float *dv) {
    attn_dims d;
    attn_work w;
    if (!attn_dims_init(P, B, T, &d) || !q || !k || !v || !dy || !dq || !dk || !dv)
        return RX_EINVAL;
    float *y = rx_falloc(d.B * d.T * d.C);
    if (!y || attn_work_alloc(&d, &w, 1) != RX_OK) {
        free(y);
        return RX_ENOMEM;
    }
    attn_core_forward(&d, q, k, v, &w, y, NULL);
    attn_core_backward(&d, q, k, v, y, dy, &w, dq, dk, dv);
    attn_work_free(&w);
    free(y);
    return RX_OK;
}

/* ---- the block ------------------------------------------------------------- */

static int attn_block_ok(const rx_attn_params *P, int B, int T, attn_dims *d) {
    return attn_dims_init(P, B, T, d) && P->ln1_w && P->ln1_b && P->receptance_w &&
           P->key_w && P->value_w && P->output_w && P->ln2_w && P->ln2_b &&
           P->cm.c == P->c && P->cm.ffn_dim >= 1 && P->cm.ffn_x_k && P->cm.ffn_key_w &&
           P->cm.ffn_value_w;
}

/* x: [B][T][C] -> h1 = ln1(x), q, k, v, y = attention (w: selection, lse),
 * all [B][T][C]; y may alias h1, which is dead once q, k, v exist. */
static void attn_front(const rx_attn_params *P, const attn_dims *d, const float *x, float *h1,
                       float *q, float *k, float *v, float *y, attn_work *w) {
    const size_t BT = d->B * d->T, C = d->C;
    rx_rownorm_forward(x, P->ln1_w, P->ln1_b, h1, NULL, NULL, BT, C, 1, RX_LN_EPS);
    rx_sgemm(0, 0, BT, C, C, h1, C, P->receptance_w, C, 0.0f, q, C);
    rx_sgemm(0, 0, BT, C, C, h1, C, P->key_w, C, 0.0f, k, C);
    rx_sgemm(0, 0, BT, C, C, h1, C, P->value_w, C, 0.0f, v, C);
    attn_core_forward(d, q, k, v, w, y, NULL);
}

/* x, y: [B][T][C] -> x1 = x + y . output_w, h2 = ln2(x1) */
static void attn_residual(const rx_attn_params *P, const attn_dims *d, const float *x,
                          const float *y, float *x1, float *h2) {
    const size_t BT = d->B * d->T, C = d->C;
    memcpy(x1, x, BT * C * sizeof(float));
    rx_sgemm(0, 0, BT, C, C, y, C, P->output_w, C, 1.0f, x1, C);
    rx_rownorm_forward(x1, P->ln2_w, P->ln2_b, h2, NULL, NULL, BT, C, 1, RX_LN_EPS);
}

/* x, out: [B][T][C]; cm_xprev_init: [B][C] or NULL */
int rx_attn_forward_seq(const rx_attn_params *P, const float *x, const float *cm_xprev_init,
                        float *out, int B, int T) {
    attn_dims d;
    attn_work w;
    if (!attn_block_ok(P, B, T, &d) || !x || !out) return RX_EINVAL;
    const size_t BTC = d.B * d.T * d.C;
    float *buf = rx_alloc(BTC, 5 * sizeof(float));
    if (!buf || attn_work_alloc(&d, &w, 0) != RX_OK) {
        free(buf);
        return RX_ENOMEM;
    }
    float *h1 = buf, *q = h1 + BTC, *k = q + BTC, *v = k + BTC, *x1 = v + BTC;
    float *y = h1, *h2 = q;
    attn_front(P, &d, x, h1, q, k, v, y, &w);
    attn_residual(P, &d, x, y, x1, h2);
    int rc = rx_channelmix_forward_seq(&P->cm, h2, cm_xprev_init, out, B, T);
    if (rc == RX_OK)
        for (size_t i = 0; i < BTC; i++) out[i] += x1[i];
    attn_work_free(&w);
    free(buf);
    return rc;
}

/* x, dy, dx: [B][T][C]; cm_xprev_init, d_cm_xprev_init: [B][C] or NULL */
int rx_attn_backward_full(const rx_attn_params *P, const float *x, const float *cm_xprev_init,
                          const float *dy, rx_attn_grads *G, float *dx, float *d_cm_xprev_init,
                          int B, int T) {
    attn_dims d;
    attn_work w;
    if (!attn_block_ok(P, B, T, &d) || !x || !dy || !dx || !G || !G->ln1_w || !G->ln1_b ||
        !G->receptance_w || !G->key_w || !G->value_w || !G->output_w || !G->ln2_w ||
        !G->ln2_b || !G->cm.ffn_x_k || !G->cm.ffn_key_w || !G->cm.ffn_value_w)
        return RX_EINVAL;
    const size_t BT = d.B * d.T, C = d.C, BTC = BT * C;
    float *buf = rx_alloc(BTC, 10 * sizeof(float));
    if (!buf || attn_work_alloc(&d, &w, 1) != RX_OK) {
        free(buf);
        return RX_ENOMEM;
    }
    float *h1 = buf, *q = h1 + BTC, *k = q + BTC, *v = k + BTC, *y = v + BTC;
    float *x1 = y + BTC, *h2 = x1 + BTC, *g1 = h2 + BTC, *dk = g1 + BTC, *dv = dk + BTC;
    /* buffers reused once their first content is dead */
    float *dya = h2, *dq = x1, *dh1 = h2;
    attn_front(P, &d, x, h1, q, k, v, y, &w);
    attn_residual(P, &d, x, y, x1, h2);
    /* channel-mix, then ln2: g1 = d x1 = dy + ln2'(dCM/dh2) */
    int rc = rx_channelmix_backward(&P->cm, h2, cm_xprev_init, dy, &G->cm, g1,
                                    d_cm_xprev_init, B, T);
    if (rc != RX_OK) goto done;
    rx_fzero(G->ln2_w, C);
    rx_fzero(G->ln2_b, C);
    rc = rx_rownorm_backward(x1, P->ln2_w, g1, g1, G->ln2_w, G->ln2_b, BT, C, 1, RX_LN_EPS);
    if (rc != RX_OK) goto done;
    for (size_t i = 0; i < BTC; i++) g1[i] += dy[i];
    /* output projection */
    rx_sgemm(1, 0, C, C, BT, y, C, g1, C, 0.0f, G->output_w, C);
    rx_sgemm(0, 1, BT, C, C, g1, C, P->output_w, C, 0.0f, dya, C);
    attn_core_backward(&d, q, k, v, y, dya, &w, dq, dk, dv);
    /* q, k, v projections */
    rx_sgemm(1, 0, C, C, BT, h1, C, dq, C, 0.0f, G->receptance_w, C);
    rx_sgemm(1, 0, C, C, BT, h1, C, dk, C, 0.0f, G->key_w, C);
    rx_sgemm(1, 0, C, C, BT, h1, C, dv, C, 0.0f, G->value_w, C);
    rx_sgemm(0, 1, BT, C, C, dq, C, P->receptance_w, C, 0.0f, dh1, C);
    rx_sgemm(0, 1, BT, C, C, dk, C, P->key_w, C, 1.0f, dh1, C);
    rx_sgemm(0, 1, BT, C, C, dv, C, P->value_w, C, 1.0f, dh1, C);
    /* ln1 and the residual */
    rx_fzero(G->ln1_w, C);
    rx_fzero(G->ln1_b, C);
    rc = rx_rownorm_backward(x, P->ln1_w, dh1, dx, G->ln1_w, G->ln1_b, BT, C, 1, RX_LN_EPS);
    if (rc != RX_OK) goto done;
    for (size_t i = 0; i < BTC; i++) dx[i] += g1[i];
done:
    attn_work_free(&w);
    free(buf);
    return rc;
}
