/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * attn.c -- the MoBA-sparse attention block (docs/maths.md §Blocks):
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
 * plus the gates, O(T^2 C / chunk_size); extra memory is O(T top_k C). No
 * T x T matrix exists outside the score_av test hook.
 *
 * Selection: chunk means and gates are computed in double by one code path,
 * the forward's; the backward holds fixed the selection that forward kept
 * (rx_attn_acts: q, k, v, selection and log-sum-exp, so the model's
 * backward runs no forward again). Double gates keep the choice as close
 * as possible to a float64 evaluation of the same q and k.
 *
 * Work is done in tiles of at most 64 queries x 64 keys through rx_sgemm
 * (scores q.k^T, weights.v and their grads; on AVX-512 it runs such tiles
 * on the operands in place, gemm.c "tiles"), split by how a (query, key
 * chunk) pair arises, so that every tile is full where the work is:
 *   - dense pairs, the own chunk and every earlier chunk of a query that
 *     does not choose, are shared by all queries of a chunk: query-major
 *     tiles over contiguous rows;
 *   - chosen pairs: queries of one chunk choose different chunks, so these
 *     are key-major, as in MoBA's reference implementation: each key chunk
 *     gathers every query that chose it, and leaves a partial softmax
 *     (max, sum, unnormalised output) per (query, rank of the chunk in its
 *     selection) that the query-major pass merges by log-sum-exp.
 * Softmax is online (running max; per tile a float sum in vector lanes,
 * running sums in double; a call-free exp so the tile loops vectorise) and
 * the forward keeps each query's log-sum-exp, so the backward recovers
 * p = exp(score - lse).
 * The backward runs key-major over every pair for dk, dv (plus the dq of
 * chosen pairs, per rank), then query-major for the dq of dense pairs. No
 * two threads ever write the same row, so results do not depend on the
 * thread count.
 */
#include <string.h>

#include "rx_internal.h"

#define ATTN_TILE 64   /* queries or keys per tile: a 64 x 64 score tile stays in cache */

/* Geometry of one call. */
typedef struct {
    size_t B, T, H, N, C;
    size_t cs;      /* chunk_size */
    size_t nck;     /* complete chunks, T / cs: the only gate candidates */
    size_t nch;     /* all chunks, ceil(T / cs) */
    size_t cw;      /* min(cs, T): the most rows a chunk holds */
    size_t kk;      /* chunks a choosing query keeps; 0 when no query chooses */
    float scale;    /* 1 / sqrt(N) */
    int nt;         /* threads for this call's parallel loops */
} attn_dims;

/* Scratch of one call (standalone entry points) or of one block's acts
 * (the model: allocated with them, sel and lse kept for the backward). */
typedef struct {
    double *kmean;  /* [B*H][nck][N] mean key of every complete chunk */
    int *sel;       /* [B*H][T][kk] chosen chunks of each choosing query, ascending */
    float *lse;     /* [B*H][T] log-sum-exp of each query's scaled scores */
    float *dd;      /* [B*H][T] D_t = dy_t . y_t (backward only) */
    float *part;    /* [B*H][T][kk][N] per chosen chunk: unnormalised output
                     * (forward), dq contribution (backward) */
    float *pm, *pl; /* [B*H][T][kk] per chosen chunk: max and sum of the forward */
    size_t nt;      /* threads the per-thread arrays below hold */
    double *gates;  /* [nt][nck] per-thread gate row */
    size_t *idx;    /* [nt][2][TILE] per-thread tile rows: query, rank */
    double *l;      /* [nt][TILE] */
    float *tile;    /* [nt][ATTN_TILE_FLOATS] see attn_tile */
    int carved;     /* kmean .. pl carved from the acts' memory, not owned */
} attn_work;

#define ATTN_TILE_FLOATS(N) (3 * ATTN_TILE * (N) + 2 * ATTN_TILE * ATTN_TILE + 2 * ATTN_TILE)

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
    d->cw = d->cs < d->T ? d->cs : d->T;
    d->kk = P->moba_top_k > 0 && (size_t)P->moba_top_k < d->nck ? (size_t)P->moba_top_k : 0;
    d->scale = (float)(1.0 / sqrt((double)P->head_size));
    /* the team also runs small calls: rx_sgemm on a tile stays serial only
     * inside an active parallel region */
    d->nt = rx_in_parallel() ? 1 : rx_max_threads();
    return 1;
}

static void attn_work_free(attn_work *w) {
    if (!w->carved) {
        free(w->kmean);
        free(w->sel);
        free(w->lse);
        free(w->dd);
        free(w->part);
        free(w->pm);
        free(w->pl);
    }
    free(w->gates);
    free(w->idx);
    free(w->l);
    free(w->tile);
}

/* The per-thread arrays for d->nt threads; kept when they already hold as
 * many, so acts reallocate only if the thread count grows after them. */
static int attn_work_threads(const attn_dims *d, attn_work *w) {
    const size_t nt = (size_t)d->nt;
    if (nt <= w->nt) return RX_OK;
    free(w->gates);
    free(w->idx);
    free(w->l);
    free(w->tile);
    w->gates = (double *)rx_alloc(nt * d->nck, sizeof(double));
    w->idx = (size_t *)rx_alloc(nt * 2 * ATTN_TILE, sizeof(size_t));
    w->l = (double *)rx_alloc(nt * ATTN_TILE, sizeof(double));
    w->tile = rx_falloc(nt * ATTN_TILE_FLOATS(d->N));
    w->nt = w->gates && w->idx && w->l && w->tile ? nt : 0;
    return w->nt ? RX_OK : RX_ENOMEM;
}

/* The RX_EINVAL of a P that attn_dims_init (or attn_block_ok) rejects with
 * B, T: names the NULL P, the size below 1 or P's sizes. */
static int attn_params_fail(const char *fn, const rx_attn_params *P, int B, int T) {
    if (!P) return rx_fail(RX_EINVAL, "%s: P is NULL", fn);
    if (rx_seq_check(fn, B, T, -1, NULL) != RX_OK) return RX_EINVAL;
    return rx_fail(RX_EINVAL, "%s: P has a NULL tensor or sizes that disagree (c = %d, "
                   "n_head = %d, head_size = %d, chunk_size = %d, cm.c = %d, cm.ffn_dim = %d)",
                   fn, P->c, P->n_head, P->head_size, P->chunk_size, P->cm.c, P->cm.ffn_dim);
}

/* Floats of the model's (backward) scratch kmean .. pl carved in one
 * piece, each a whole number of 64-byte lines (kmean as doubles, sel as
 * ints: 2 and 1 floats an element); 0 past the address space. */
static size_t attn_work_floats(const attn_dims *d) {
    const size_t BH = d->B * d->H, BHT = BH * d->T;
    if (BHT > SIZE_MAX / 64 / (d->kk + 1) / (d->N + 1) || BH * d->nck > SIZE_MAX / 64 / d->N)
        return 0;
    return rx_lines(2 * BH * d->nck * d->N) + 3 * rx_lines(BHT * d->kk) + 2 * rx_lines(BHT) +
           rx_lines(BHT * d->kk * d->N);
}

/* Everything zeroed first, so attn_work_free is safe after a failure.
 * mem: attn_work_floats floats that kmean .. pl are carved from (a
 * backward's), or NULL (each its own allocation). */
static int attn_work_alloc(const attn_dims *d, attn_work *w, int backward, float *mem) {
    const size_t BHT = d->B * d->H * d->T;
    memset(w, 0, sizeof *w);
    if (mem) {
        w->carved = 1;
        w->kmean = (double *)(void *)rx_carve(&mem, 2 * d->B * d->H * d->nck * d->N);
        w->sel = (int *)(void *)rx_carve(&mem, BHT * d->kk);
        w->lse = rx_carve(&mem, BHT);
        w->dd = rx_carve(&mem, BHT);
        w->part = rx_carve(&mem, BHT * d->kk * d->N);
        w->pm = rx_carve(&mem, BHT * d->kk);
        w->pl = rx_carve(&mem, BHT * d->kk);
    } else {
        w->kmean = (double *)rx_alloc(d->B * d->H * d->nck * d->N, sizeof(double));
        w->sel = (int *)rx_alloc(BHT * d->kk, sizeof(int));
        w->lse = rx_falloc(BHT);
        w->dd = backward ? rx_falloc(BHT) : NULL;
        w->part = (float *)rx_alloc(BHT * d->kk, d->N * sizeof(float));
        w->pm = rx_falloc(BHT * d->kk);
        w->pl = rx_falloc(BHT * d->kk);
    }
    if (!w->kmean || !w->sel || !w->lse || (backward && !w->dd) || !w->part || !w->pm ||
        !w->pl || attn_work_threads(d, w) != RX_OK) {
        attn_work_free(w);
        return rx_fail(RX_ENOMEM, "rx_attn: out of memory for the attention scratch");
    }
    return RX_OK;
}

/* 1 when query t keeps a chosen subset of the earlier chunks, 0 when it
 * attends all of them; the queries that choose are exactly t >= (kk+1)*cs. */
static inline int attn_chooses(const attn_dims *d, size_t t) {
    return d->kk > 0 && d->kk < t / d->cs;
}

/* Position of chunk j among the kk ascending entries of sel_t, kk if absent. */
static inline size_t attn_rank(const int *sel_t, size_t kk, size_t j) {
    size_t lo = 0, hi = kk;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if ((size_t)sel_t[mid] < j) lo = mid + 1;
        else hi = mid;
    }
    return lo < kk && (size_t)sel_t[lo] == j ? lo : kk;
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

/* g [ct] = q_t . km_j for j < ct, ATTN_GATES chunks at a time: that many
 * independent sums, where one sum per chunk waited on its own adds (a
 * query has T / chunk_size gates, the one cost of the block that grows
 * faster than T). A last group short of ATTN_GATES repeats its last chunk,
 * so every gate comes out of the same loop. */
#define ATTN_GATES 8
RX_HOT static void attn_gates(const float *qt, const double *km, size_t ct, size_t N,
                              double *g) {
    for (size_t j0 = 0; j0 < ct; j0 += ATTN_GATES) {
        const double *m[ATTN_GATES];
        for (size_t u = 0; u < ATTN_GATES; u++) m[u] = km + (j0 + u < ct ? j0 + u : ct - 1) * N;
        double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0, s4 = 0.0, s5 = 0.0, s6 = 0.0, s7 = 0.0;
#pragma omp simd reduction(+ : s0, s1, s2, s3, s4, s5, s6, s7)
        for (size_t n = 0; n < N; n++) {
            const double q = (double)qt[n];
            s0 += q * m[0][n];
            s1 += q * m[1][n];
            s2 += q * m[2][n];
            s3 += q * m[3][n];
            s4 += q * m[4][n];
            s5 += q * m[5][n];
            s6 += q * m[6][n];
            s7 += q * m[7][n];
        }
        const double s[ATTN_GATES] = {s0, s1, s2, s3, s4, s5, s6, s7};
        for (size_t u = 0; u < ATTN_GATES && j0 + u < ct; u++) g[j0 + u] = s[u];
    }
}

/* qt [N]; km [ct][N]; sel [kk] receives the kk chunks of largest gate
 * q_t . km_j (equal gates: the smaller j), in ascending order; g: scratch [ct] */
static void attn_select_query(const float *qt, const double *km, size_t ct, size_t N,
                              size_t kk, double *g, int *sel) {
    attn_gates(qt, km, ct, N, g);
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

/* a [n] . b [n], accumulated in double */
RX_HOT static double attn_dot(const float *a, const float *b, size_t n) {
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (size_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

/* Query-major work items: (head, chunk, tile within the chunk), so a chunk
 * longer than a tile still splits. Item i covers rows [*lo, *hi) of chunk
 * *c of head *bh; returns 0 for the empty tail tiles of a short last chunk. */
static int attn_item(const attn_dims *d, size_t i, size_t *bh, size_t *c, size_t *lo,
                     size_t *hi) {
    const size_t per = (d->cw + ATTN_TILE - 1) / ATTN_TILE;
    *bh = i / (d->nch * per);
    *c = i / per % d->nch;
    *lo = *c * d->cs + i % per * ATTN_TILE;
    size_t end = (*c + 1) * d->cs < d->T ? (*c + 1) * d->cs : d->T;
    *hi = *lo + ATTN_TILE < end ? *lo + ATTN_TILE : end;
    return *lo < *hi;
}

static size_t attn_n_items(const attn_dims *d) {
    return d->B * d->H * d->nch * ((d->cw + ATTN_TILE - 1) / ATTN_TILE);
}

/* One head: rows of the [B][T][C] tensors offset to (b, h), stride C; its
 * per-query rows of the work arrays. */
typedef struct {
    const float *q, *k, *v, *y, *dy;
    float *yo, *dq, *dk, *dv;
    const int *sel;     /* [T][kk] */
    float *lse, *dd;    /* [T] */
    float *part;        /* [T][kk][N] */
    float *pm, *pl;     /* [T][kk] */
} attn_head;

static attn_head attn_head_of(const attn_dims *d, attn_work *w, size_t bh, const float *q,
                              const float *k, const float *v, const float *y, const float *dy,
                              float *yo, float *dq, float *dk, float *dv) {
    const size_t off = bh / d->H * d->T * d->C + bh % d->H * d->N, pt = bh * d->T;
    attn_head h = {q + off, k + off, v + off, y ? y + off : NULL, dy ? dy + off : NULL,
                   yo ? yo + off : NULL, dq ? dq + off : NULL, dk ? dk + off : NULL,
                   dv ? dv + off : NULL, w->sel + pt * d->kk, w->lse + pt,
                   w->dd ? w->dd + pt : NULL, w->part + pt * d->kk * d->N,
                   w->pm + pt * d->kk, w->pl + pt * d->kk};
    return h;
}

/* One thread's tile scratch. */
typedef struct {
    size_t *idx, *rank;   /* [TILE] query of each row; rank of the key chunk in its selection */
    float *qg, *dyg, *og; /* [TILE][N] gathered q and dy rows; a GEMM result */
    float *s, *ds;        /* [TILE][TILE] scores, then weights; their grads */
    float *m, *rs;        /* [TILE] running max; factor rescaling the sums so far */
    double *l;            /* [TILE] running sum */
} attn_tile;

static attn_tile attn_tile_of(const attn_dims *d, attn_work *w) {
    const size_t id = (size_t)rx_thread_id(), N = d->N, TL = ATTN_TILE;
    float *f = w->tile + id * ATTN_TILE_FLOATS(N);
    attn_tile t = {w->idx + id * 2 * TL, w->idx + id * 2 * TL + TL,
                   f, f + TL * N, f + 2 * TL * N, f + 3 * TL * N, f + 3 * TL * N + TL * TL,
                   f + 3 * TL * N + 2 * TL * TL, f + 3 * TL * N + 2 * TL * TL + TL,
                   w->l + id * TL};
    return t;
}

/* How many of the n keys from klo in chunk j query t attends: all of a
 * chunk before its own, in its own chunk those up to t. */
static inline size_t attn_lim(const attn_dims *d, size_t t, size_t j, size_t klo, size_t n) {
    size_t hi = t / d->cs == j ? t + 1 : (j + 1) * d->cs;
    return hi <= klo ? 0 : hi - klo < n ? hi - klo : n;
}

/* End of the key tile from klo in chunk j for queries up to tmax. */
static inline size_t attn_kend(const attn_dims *d, size_t j, size_t klo, size_t tmax) {
    size_t end = (j + 1) * d->cs;
    if (end > tmax + 1) end = tmax + 1;
    return klo + ATTN_TILE < end ? klo + ATTN_TILE : end;
}

/* Online softmax step over one key tile (keys [klo, klo+n) of chunk j):
 * rows r < M of tl->s hold raw scores q . k. Scales them, updates the
 * running max and sum, leaves the weights exp(score - max) (zero on keys
 * not attended) in tl->s and the factor for the sums so far in tl->rs. */
RX_HOT static void attn_online(const attn_dims *d, size_t j, size_t klo, size_t n, size_t M,
                               attn_tile *tl) {
    const float scale = d->scale;
    for (size_t r = 0; r < M; r++) {
        const size_t lim = attn_lim(d, tl->idx[r], j, klo, n);
        float *restrict sr = tl->s + r * ATTN_TILE, m = tl->m[r], cm = -INFINITY;
#pragma omp simd reduction(max : cm)
        for (size_t s = 0; s < lim; s++) {
            sr[s] *= scale;
            cm = sr[s] > cm ? sr[s] : cm;
        }
        tl->rs[r] = 1.0f;
        if (lim && cm > m) {
            tl->rs[r] = expf(m - cm);
            tl->l[r] *= tl->rs[r];
            tl->m[r] = m = cm;
        }
        /* a float sum of at most a tile of weights in [0, 1], in vector
         * lanes of a few terms each, before the running sum in double */
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (size_t s = 0; s < lim; s++) {
            sr[s] = rx_expf(sr[s] - m);
            sum += sr[s];
        }
        for (size_t s = lim; s < n; s++) sr[s] = 0.0f;
        tl->l[r] += sum;
    }
}

/* acc rows r < M (stride ld) = acc * rs[r] + weights . v over keys [klo, klo+n) */
static void attn_accumulate(const attn_dims *d, const attn_head *h, size_t klo, size_t n,
                            size_t M, attn_tile *tl, float *acc, size_t ld) {
    for (size_t r = 0; r < M; r++)
        if (tl->rs[r] != 1.0f)
            for (size_t i = 0; i < d->N; i++) acc[r * ld + i] *= tl->rs[r];
    rx_sgemm(0, 0, M, d->N, n, tl->s, ATTN_TILE, h->v + klo * d->C, d->C, 1.0f, acc, ld);
}

/* Chosen pairs of key chunk j < nck (forward): every query that chose j,
 * a tile at a time, leaves its partial softmax over the chunk in its slot. */
static void attn_chosen_forward(const attn_dims *d, const attn_head *h, size_t j,
                                attn_tile *tl) {
    const size_t N = d->N, C = d->C, T = d->T, kk = d->kk, TL = ATTN_TILE;
    size_t M = 0;
    /* queries after chunk j that choose */
    for (size_t t = ((kk > j ? kk : j) + 1) * d->cs; t < T; t++) {
        size_t r = attn_rank(h->sel + t * kk, kk, j);
        if (r < kk) {
            tl->idx[M] = t;
            tl->rank[M] = r;
            memcpy(tl->qg + M * N, h->q + t * C, N * sizeof(float));
            M++;
        }
        if (M == TL || (M && t + 1 == T)) {
            for (size_t i = 0; i < M; i++) {
                tl->m[i] = -INFINITY;
                tl->l[i] = 0.0;
            }
            memset(tl->og, 0, M * N * sizeof(float));
            for (size_t klo = j * d->cs; klo < (j + 1) * d->cs; klo += TL) {
                const size_t n = attn_kend(d, j, klo, T) - klo;
                rx_sgemm(0, 1, M, n, N, tl->qg, N, h->k + klo * C, C, 0.0f, tl->s, TL);
                attn_online(d, j, klo, n, M, tl);
                attn_accumulate(d, h, klo, n, M, tl, tl->og, N);
            }
            for (size_t i = 0; i < M; i++) {
                size_t slot = tl->idx[i] * kk + tl->rank[i];
                memcpy(h->part + slot * N, tl->og + i * N, N * sizeof(float));
                h->pm[slot] = tl->m[i];
                h->pl[slot] = (float)tl->l[i];
            }
            M = 0;
        }
    }
}

/* Queries [t0, t1) of chunk c (one tile): online softmax over their dense
 * pairs, then their chosen chunks' partials merged in; writes y and lse. */
static void attn_dense_forward(const attn_dims *d, const attn_head *h, size_t c, size_t t0,
                               size_t t1, attn_tile *tl) {
    const size_t N = d->N, C = d->C, M = t1 - t0, kk = d->kk, TL = ATTN_TILE;
    const int chooses = attn_chooses(d, t0);
    float *y = h->yo + t0 * C;
    for (size_t r = 0; r < M; r++) {
        tl->idx[r] = t0 + r;
        tl->m[r] = -INFINITY;
        tl->l[r] = 0.0;
        memset(y + r * C, 0, N * sizeof(float));
    }
    for (size_t j = chooses ? c : 0; j <= c; j++)
        for (size_t klo = j * d->cs, n; klo < t1 && klo < (j + 1) * d->cs; klo += n) {
            n = attn_kend(d, j, klo, t1 - 1) - klo;
            rx_sgemm(0, 1, M, n, N, h->q + t0 * C, C, h->k + klo * C, C, 0.0f, tl->s, TL);
            attn_online(d, j, klo, n, M, tl);
            attn_accumulate(d, h, klo, n, M, tl, y, C);
        }
    for (size_t r = 0; r < M; r++) {
        float *yt = y + r * C, m = tl->m[r];
        double l = tl->l[r];
        for (size_t i = 0; chooses && i < kk; i++) {
            const size_t slot = (t0 + r) * kk + i;
            const float *o = h->part + slot * N, pm = h->pm[slot];
            const float nm = pm > m ? pm : m, a = expf(m - nm), b = expf(pm - nm);
            for (size_t n = 0; n < N; n++) yt[n] = yt[n] * a + o[n] * b;
            l = l * a + (double)h->pl[slot] * b;
            m = nm;
        }
        const float inv = (float)(1.0 / l);
        for (size_t n = 0; n < N; n++) yt[n] *= inv;
        h->lse[t0 + r] = (float)((double)m + log(l));
    }
}

/* Rows [t0, t1) (chunk c) of p_h [T][T]: the softmax weights, exactly zero
 * off the attended keys. Test hook only. */
static void attn_block_p(const attn_dims *d, const attn_head *h, size_t c, size_t t0,
                         size_t t1, float *p_h) {
    const size_t T = d->T, C = d->C, N = d->N;
    memset(p_h + t0 * T, 0, (t1 - t0) * T * sizeof(float));
    for (size_t t = t0; t < t1; t++)
        for (size_t j = 0; j <= c; j++) {
            if (j < c && attn_chooses(d, t) && attn_rank(h->sel + t * d->kk, d->kk, j) == d->kk)
                continue;
            for (size_t s = j * d->cs, n = attn_lim(d, t, j, s, d->cs); n--; s++) {
                float a = 0.0f;
                for (size_t i = 0; i < N; i++) a += h->q[t * C + i] * h->k[s * C + i];
                p_h[t * T + s] = rx_expf(a * d->scale - h->lse[t]);
            }
        }
}

/* The tile GEMMs of the attention core run on each team thread alone: with
 * its packing buffers reserved at the start of the region they cannot fail
 * (rx_sgemm), so only the reservation is checked, and reported once. */
static int attn_tiles_fail(void) {
    return rx_fail(RX_ENOMEM, "rx_attn: out of memory for a thread's GEMM packing buffers");
}

/* q, k, v, y: [B][T][C]; p: [B][H][T][T] or NULL. Selects (w->kmean,
 * w->sel), then writes y and w->lse. RX_OK or RX_ENOMEM. */
static int attn_core_forward(const attn_dims *d, const float *q, const float *k,
                             const float *v, attn_work *w, float *y, float *p) {
    const size_t n_items = attn_n_items(d), n_chosen = d->kk ? d->B * d->H * d->nck : 0;
    int fail = 0;
    rx_prof_push(RX_PROF_ATTN);
    attn_select(d, q, k, w);
#pragma omp parallel num_threads(d->nt) if (d->nt > 1) reduction(| : fail)
    {
        fail |= rx_gemm_reserve() != RX_OK;
        attn_tile tl = attn_tile_of(d, w);
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < n_chosen; i++) {
            attn_head h = attn_head_of(d, w, i / d->nck, q, k, v, NULL, NULL, y, NULL, NULL, NULL);
            attn_chosen_forward(d, &h, i % d->nck, &tl);
        }
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < n_items; i++) {
            size_t bh, c, t0, t1;
            if (!attn_item(d, i, &bh, &c, &t0, &t1)) continue;
            attn_head h = attn_head_of(d, w, bh, q, k, v, NULL, NULL, y, NULL, NULL, NULL);
            attn_dense_forward(d, &h, c, t0, t1, &tl);
            if (p) attn_block_p(d, &h, c, t0, t1, p + bh * d->T * d->T);
        }
    }
    rx_prof_pop();
    return fail ? attn_tiles_fail() : RX_OK;
}

/* The decoding core: queries q [T][C] at positions pos..pos+T-1 of one
 * sequence against its keys and values k, v [pos+T][C], every earlier
 * position included; y [T][C]. Chunk means, gates and selection are the
 * training core's own code, so each query attends exactly the keys it
 * attends there; its softmax runs over them with the same online tiles,
 * one query at a time. Serial: T is one token, or one chunk of a prompt.
 * RX_OK or RX_ENOMEM. */
static int attn_core_decode(const rx_attn_params *P, const float *q, const float *k,
                            const float *v, size_t pos, size_t T, float *y) {
    attn_dims d;
    /* the caller checked P at (1, T), and pos + T against INT32_MAX */
    attn_dims_init(P, 1, (int)(pos + T), &d);
    d.nt = 1;
    const size_t H = d.H, N = d.N, C = d.C, L = d.T, nck = d.nck, kk = d.kk, p0 = pos;
    attn_work w;
    memset(&w, 0, sizeof w);
    w.kmean = (double *)rx_alloc(kk ? H * nck * N : 0, sizeof(double));
    w.sel = (int *)rx_alloc(kk, sizeof(int));
    if (!w.kmean || !w.sel || attn_work_threads(&d, &w) != RX_OK) {
        attn_work_free(&w);
        return rx_fail(RX_ENOMEM, "rx_attn_step: out of memory for the decoding scratch");
    }
    attn_tile tl = attn_tile_of(&d, &w);
    for (size_t i = 0; kk && i < H * nck; i++)
        attn_chunk_mean(&d, k + i / nck * N, i % nck, w.kmean + i * N);
    for (size_t t = p0; t < L; t++)
        for (size_t h = 0; h < H; h++) {
            const float *qt = q + (t - p0) * C + h * N;
            float *yt = y + (t - p0) * C + h * N;
            const attn_head hd = {.k = k + h * N, .v = v + h * N};
            const int chooses = attn_chooses(&d, t);
            if (chooses) attn_select_query(qt, w.kmean + h * nck * N, t / d.cs, N, kk, w.gates, w.sel);
            tl.idx[0] = t;
            tl.m[0] = -INFINITY;
            tl.l[0] = 0.0;
            memset(yt, 0, N * sizeof(float));
            for (size_t j = 0; j <= t / d.cs; j++) {
                if (chooses && j < t / d.cs && attn_rank(w.sel, kk, j) == kk) continue;
                for (size_t klo = j * d.cs, n; klo <= t && klo < (j + 1) * d.cs; klo += n) {
                    n = attn_kend(&d, j, klo, t) - klo;
                    if (rx_sgemm(0, 1, 1, n, N, qt, N, hd.k + klo * C, C, 0.0f, tl.s,
                                 ATTN_TILE) != RX_OK) {
                        attn_work_free(&w);
                        return RX_ENOMEM;
                    }
                    attn_online(&d, j, klo, n, 1, &tl);
                    attn_accumulate(&d, &hd, klo, n, 1, &tl, yt, C);
                }
            }
            const float inv = (float)(1.0 / tl.l[0]);
            for (size_t n = 0; n < N; n++) yt[n] *= inv;
        }
    attn_work_free(&w);
    return RX_OK;
}

/* Rows r < M of a tile (query idx[r]) against keys [klo, klo+n) of chunk j,
 * selection fixed: from q . k^T in tl->s and dy . v^T in tl->ds, leaves the
 * weights p in tl->s and the score grads p (dp - D) / sqrt(N) in tl->ds,
 * both zero on keys not attended. */
RX_HOT static void attn_tile_grads(const attn_dims *d, const attn_head *h, size_t j,
                                   size_t klo, size_t n, size_t M, attn_tile *tl) {
    const float scale = d->scale;
    for (size_t r = 0; r < M; r++) {
        const size_t t = tl->idx[r], lim = attn_lim(d, t, j, klo, n);
        const float lse = h->lse[t], dd = h->dd[t];
        float *restrict sr = tl->s + r * ATTN_TILE, *restrict gr = tl->ds + r * ATTN_TILE;
#pragma omp simd
        for (size_t s = 0; s < lim; s++) {
            const float p = rx_expf(sr[s] * scale - lse);
            sr[s] = p;
            gr[s] = p * (gr[s] - dd) * scale;
        }
        for (size_t s = lim; s < n; s++) sr[s] = gr[s] = 0.0f;
    }
}

/* M queries (rows of Q, DY with stride ld; tl->idx) against all of key
 * chunk j: dk, dv of the chunk accumulated; with slots, each row's dq
 * contribution stored at its (query, rank) slot. */
static void attn_kv_tile(const attn_dims *d, const attn_head *h, size_t j, const float *Q,
                         const float *DY, size_t ld, size_t M, int slots, attn_tile *tl) {
    const size_t N = d->N, C = d->C, TL = ATTN_TILE, tmax = tl->idx[M - 1];
    for (size_t klo = j * d->cs, n; klo <= tmax && klo < (j + 1) * d->cs; klo += n) {
        n = attn_kend(d, j, klo, tmax) - klo;
        rx_sgemm(0, 1, M, n, N, Q, ld, h->k + klo * C, C, 0.0f, tl->s, TL);
        rx_sgemm(0, 1, M, n, N, DY, ld, h->v + klo * C, C, 0.0f, tl->ds, TL);
        attn_tile_grads(d, h, j, klo, n, M, tl);
        rx_sgemm(1, 0, n, N, M, tl->ds, TL, Q, ld, 1.0f, h->dk + klo * C, C);
        rx_sgemm(1, 0, n, N, M, tl->s, TL, DY, ld, 1.0f, h->dv + klo * C, C);
        if (slots)
            rx_sgemm(0, 0, M, N, n, tl->ds, TL, h->k + klo * C, C, klo > j * d->cs ? 1.0f : 0.0f,
                     tl->og, N);
    }
    for (size_t r = 0; slots && r < M; r++)
        memcpy(h->part + (tl->idx[r] * d->kk + tl->rank[r]) * N, tl->og + r * N,
               N * sizeof(float));
}

/* Keys of chunk j: dk, dv rows from every query that attends them -- the
 * dense ones (own chunk, then every later query that does not choose) as
 * contiguous tiles, then those that chose j, gathered -- and the dq
 * contribution of each chosen pair. */
static void attn_kv_backward(const attn_dims *d, const attn_head *h, size_t j, attn_tile *tl) {
    const size_t N = d->N, C = d->C, T = d->T, kk = d->kk, TL = ATTN_TILE, lo = j * d->cs;
    const size_t hi = lo + d->cs < T ? lo + d->cs : T;
    for (size_t s = lo; s < hi; s++) {
        memset(h->dk + s * C, 0, N * sizeof(float));
        memset(h->dv + s * C, 0, N * sizeof(float));
    }
    size_t dend = kk ? (kk + 1) * d->cs : T;
    dend = dend < hi ? hi : dend > T ? T : dend;
    for (size_t t0 = lo, M; t0 < dend; t0 += M) {
        M = dend - t0 < TL ? dend - t0 : TL;
        for (size_t r = 0; r < M; r++) tl->idx[r] = t0 + r;
        attn_kv_tile(d, h, j, h->q + t0 * C, h->dy + t0 * C, C, M, 0, tl);
    }
    size_t M = 0;
    for (size_t t = dend; j < d->nck && t < T; t++) {
        size_t r = attn_rank(h->sel + t * kk, kk, j);
        if (r < kk) {
            tl->idx[M] = t;
            tl->rank[M] = r;
            memcpy(tl->qg + M * N, h->q + t * C, N * sizeof(float));
            memcpy(tl->dyg + M * N, h->dy + t * C, N * sizeof(float));
            M++;
        }
        if (M == TL || (M && t + 1 == T)) {
            attn_kv_tile(d, h, j, tl->qg, tl->dyg, N, M, 1, tl);
            M = 0;
        }
    }
}

/* Queries [t0, t1) of chunk c (one tile): dq from their dense pairs, plus
 * the chosen pairs' contributions from their slots. */
static void attn_q_backward(const attn_dims *d, const attn_head *h, size_t c, size_t t0,
                            size_t t1, attn_tile *tl) {
    const size_t N = d->N, C = d->C, M = t1 - t0, kk = d->kk, TL = ATTN_TILE;
    const int chooses = attn_chooses(d, t0);
    float *dq = h->dq + t0 * C;
    for (size_t r = 0; r < M; r++) {
        tl->idx[r] = t0 + r;
        memset(dq + r * C, 0, N * sizeof(float));
        for (size_t i = 0; chooses && i < kk; i++) {
            const float *o = h->part + ((t0 + r) * kk + i) * N;
            for (size_t n = 0; n < N; n++) dq[r * C + n] += o[n];
        }
    }
    for (size_t j = chooses ? c : 0; j <= c; j++)
        for (size_t klo = j * d->cs, n; klo < t1 && klo < (j + 1) * d->cs; klo += n) {
            n = attn_kend(d, j, klo, t1 - 1) - klo;
            rx_sgemm(0, 1, M, n, N, h->q + t0 * C, C, h->k + klo * C, C, 0.0f, tl->s, TL);
            rx_sgemm(0, 1, M, n, N, h->dy + t0 * C, C, h->v + klo * C, C, 0.0f, tl->ds, TL);
            attn_tile_grads(d, h, j, klo, n, M, tl);
            rx_sgemm(0, 0, M, N, n, tl->ds, TL, h->k + klo * C, C, 1.0f, dq, C);
        }
}

/* q, k, v, y, dy, dq, dk, dv: [B][T][C]; w as left by attn_core_forward on
 * the same q, k, v (selection and lse). RX_OK or RX_ENOMEM. */
static int attn_core_backward(const attn_dims *d, const float *q, const float *k,
                              const float *v, const float *y, const float *dy, attn_work *w,
                              float *dq, float *dk, float *dv) {
    const size_t H = d->H, T = d->T, C = d->C, N = d->N, BHT = d->B * H * T;
    const size_t n_items = attn_n_items(d), n_chunks = d->B * H * d->nch;
    int fail = 0;
    rx_prof_push(RX_PROF_ATTN);
#pragma omp parallel num_threads(d->nt) if (d->nt > 1) reduction(| : fail)
    {
        fail |= rx_gemm_reserve() != RX_OK;
        attn_tile tl = attn_tile_of(d, w);
#pragma omp for schedule(static)
        for (size_t i = 0; i < BHT; i++) {
            const size_t o = (i / (H * T) * T + i % T) * C + i / T % H * N;
            w->dd[i] = (float)attn_dot(dy + o, y + o, N);
        }
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < n_chunks; i++) {
            attn_head h = attn_head_of(d, w, i / d->nch, q, k, v, y, dy, NULL, NULL, dk, dv);
            attn_kv_backward(d, &h, i % d->nch, &tl);
        }
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < n_items; i++) {
            size_t bh, c, t0, t1;
            if (!attn_item(d, i, &bh, &c, &t0, &t1)) continue;
            attn_head h = attn_head_of(d, w, bh, q, k, v, y, dy, NULL, dq, NULL, NULL);
            attn_q_backward(d, &h, c, t0, t1, &tl);
        }
    }
    rx_prof_pop();
    return fail ? attn_tiles_fail() : RX_OK;
}

/* q, k, v, y: [B][T][C]; p: [B][H][T][T] or NULL */
int rx_attn_score_av_forward(const rx_attn_params *P, const float *q, const float *k,
                             const float *v, int B, int T, float *p, float *y) {
    attn_dims d;
    attn_work w;
    static const char *const fn = "rx_attn_score_av_forward";
    const char *nul = rx_first_null(RX_NULLS(q, k, v, y), RX_NAMES("q", "k", "v", "y"), 4);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (!attn_dims_init(P, B, T, &d)) return attn_params_fail(fn, P, B, T);
    const size_t BTC = d.B * d.T * d.C;
    rx_spans in = {.n = 0}, out = {.n = 0};
    RX_SPAN_ADD(&in, "q", q, BTC);
    RX_SPAN_ADD(&in, "k", k, BTC);
    RX_SPAN_ADD(&in, "v", v, BTC);
    RX_SPAN_ADD(&out, "p", p, d.B * d.H * d.T * d.T);
    RX_SPAN_ADD(&out, "y", y, BTC);
    int rc = rx_spans_check(fn, &out, &in);
    if (rc != RX_OK) return rc;
    if (attn_work_alloc(&d, &w, 0, NULL) != RX_OK) return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    rc = attn_core_forward(&d, q, k, v, &w, y, p);
    attn_work_free(&w);
    return rc;
}

/* q, k, v, dy, dq, dk, dv: [B][T][C] */
int rx_attn_score_av_backward(const rx_attn_params *P, const float *q, const float *k,
                              const float *v, const float *dy, int B, int T,
                              float *dq, float *dk, float *dv) {
    attn_dims d;
    attn_work w;
    static const char *const fn = "rx_attn_score_av_backward";
    const char *nul = rx_first_null(RX_NULLS(q, k, v, dy, dq, dk, dv),
                                    RX_NAMES("q", "k", "v", "dy", "dq", "dk", "dv"), 7);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (!attn_dims_init(P, B, T, &d)) return attn_params_fail(fn, P, B, T);
    const size_t BTC = d.B * d.T * d.C;
    rx_spans in = {.n = 0}, out = {.n = 0};
    const float *const i4[4] = {q, k, v, dy};
    float *const o3[3] = {dq, dk, dv};
    static const char *const iname[4] = {"q", "k", "v", "dy"}, *const oname[3] = {"dq", "dk", "dv"};
    for (int i = 0; i < 4; i++) RX_SPAN_ADD(&in, iname[i], i4[i], BTC);
    for (int i = 0; i < 3; i++) RX_SPAN_ADD(&out, oname[i], o3[i], BTC);
    int rc = rx_spans_check(fn, &out, &in);
    if (rc != RX_OK) return rc;
    float *y = rx_falloc(BTC);
    if (!y || attn_work_alloc(&d, &w, 1, NULL) != RX_OK) {
        free(y);
        return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    }
    rc = attn_core_forward(&d, q, k, v, &w, y, NULL);
    if (rc == RX_OK) rc = attn_core_backward(&d, q, k, v, y, dy, &w, dq, dk, dv);
    attn_work_free(&w);
    free(y);
    return rc;
}

/* ---- the block ------------------------------------------------------------- */

/* x: [B][T][C] -> h1 = ln1(x), q, k, v = h1 . {receptance_w, key_w, value_w} */
static int attn_qkv(const rx_model_ctx *ctx,
                    const rx_attn_params *P, const attn_dims *d, const float *x, float *h1,
                    float *q, float *k, float *v) {
    const size_t BT = d->B * d->T, C = d->C;
    rx_rownorm_forward(x, P->ln1_w, P->ln1_b, h1, NULL, NULL, BT, C, 1, (float)ctx->ln_eps);
    const rx_gemm_op qkv[3] = {{0, 0, BT, C, C, h1, C, P->receptance_w, C, 0.0f, q, C},
                               {0, 0, BT, C, C, h1, C, P->key_w, C, 0.0f, k, C},
                               {0, 0, BT, C, C, h1, C, P->value_w, C, 0.0f, v, C}};
    return rx_pgemm_batch(qkv, 3);
}

/* x, y: [B][T][C] -> x1 = x + y . output_w, h2 = ln2(x1) */
static int attn_residual(const rx_model_ctx *ctx,
                         const rx_attn_params *P, const attn_dims *d, const float *x,
                         const float *y, float *x1, float *h2) {
    const size_t BT = d->B * d->T, C = d->C;
    memcpy(x1, x, BT * C * sizeof(float));
    int rc = rx_pgemm(0, 0, BT, C, C, y, C, P->output_w, C, 1.0f, x1, C);
    if (rc == RX_OK)
        rx_rownorm_forward(x1, P->ln2_w, P->ln2_b, h2, NULL, NULL, BT, C, 1, (float)ctx->ln_eps);
    return rc;
}

/* The block's forward intermediates, everything its backward reads: kept
 * by rx_attn_forward_acts, only read by rx_attn_backward_acts (so it runs
 * more than once per forward), the core's scratch allocated with them. */
struct rx_attn_acts {
    size_t B, T;
    size_t T0;                                /* the T it was made for (rx_attn_acts_rows) */
    float *h1, *q, *k, *v, *y, *x1, *h2, *xk; /* [BT][C] ln1 out, projections, attention
                                               * out, residual, ln2 out, CM lerp */
    float *hid;                               /* [BT][F] CM relu^2 (the backward recovers
                                               * relu of the key projection from it) */
    attn_work w;                              /* sel and lse kept; the rest scratch */
    float *mem;
};

void rx_attn_acts_free(rx_attn_acts *S) {
    if (!S) return;
    attn_work_free(&S->w);
    free(S->mem);
    free(S);
}

/* the [BT] buffers: 8 of C and one of F, each a whole number of 64-byte
 * lines, then the core's scratch (attn_work_floats); 0 on bad sizes */
size_t rx_attn_acts_floats(const rx_attn_params *P, size_t B, size_t T) {
    attn_dims d;
    if (B > INT32_MAX || T > INT32_MAX || !attn_dims_init(P, (int)B, (int)T, &d) ||
        P->cm.ffn_dim < 1)
        return 0;
    const size_t rc = (B * T * d.C + 15) & ~(size_t)15;
    const size_t rf = (B * T * (size_t)P->cm.ffn_dim + 15) & ~(size_t)15;
    const size_t nw = attn_work_floats(&d);
    return !nw || rc > SIZE_MAX / 32 || rf > SIZE_MAX / 8 || nw > SIZE_MAX / 4 ? 0
                                                                                : 8 * rc + rf + nw;
}

/* mem NULL: the buffers in an allocation of its own */
static rx_attn_acts *attn_acts_make(const rx_attn_params *P, size_t B, size_t T, float *mem) {
    attn_dims d;
    const size_t n = rx_attn_acts_floats(P, B, T);
    if (!n || !attn_dims_init(P, (int)B, (int)T, &d)) return NULL;
    rx_attn_acts *S = calloc(1, sizeof *S);
    if (!S) return NULL;
    S->B = B;
    S->T = S->T0 = T;
    S->mem = mem ? NULL : rx_falloc(n);
    const size_t rc = (B * T * d.C + 15) & ~(size_t)15;
    const size_t rf = (B * T * (size_t)P->cm.ffn_dim + 15) & ~(size_t)15;
    float *f = mem ? mem : S->mem;
    /* the core's scratch follows the buffers */
    if (!f || attn_work_alloc(&d, &S->w, 1, f + 8 * rc + rf) != RX_OK) {
        free(S->mem);
        free(S);
        return NULL;
    }
    float **bufs[] = {&S->h1, &S->q, &S->k, &S->v, &S->y, &S->x1, &S->h2, &S->xk};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++, f += rc) *bufs[i] = f;
    S->hid = f;
    return S;
}

rx_attn_acts *rx_attn_acts_new(const rx_attn_params *P, size_t B, size_t T) {
    return attn_acts_make(P, B, T, NULL);
}

rx_attn_acts *rx_attn_acts_new_in(const rx_attn_params *P, size_t B, size_t T, float *mem) {
    return mem ? attn_acts_make(P, B, T, mem) : NULL;
}

/* Every buffer and the core's scratch (its chunk counts and top-k fall
 * with T) made for T0 hold a smaller T's in their leading floats */
int rx_attn_acts_rows(rx_attn_acts *S, size_t T) {
    if (!S || S->B != 1 || T < 1 || T > S->T0)
        return rx_fail(RX_EINVAL, "rx_attn_acts_rows: T = %zu outside [1, %zu] (or S NULL, "
                       "or made for B > 1)", T, S ? S->T0 : 0);
    S->T = T;
    return RX_OK;
}

static int attn_block_ok(const rx_attn_params *P, int B, int T, attn_dims *d) {
    return attn_dims_init(P, B, T, d) && P->ln1_w && P->ln1_b && P->receptance_w &&
           P->key_w && P->value_w && P->output_w && P->ln2_w && P->ln2_b &&
           P->cm.c == P->c && P->cm.ffn_dim >= 1 && P->cm.ffn_x_k && P->cm.ffn_key_w &&
           P->cm.ffn_value_w;
}

static int attn_grads_ok(const rx_attn_grads *G) {
    return G && G->ln1_w && G->ln1_b && G->receptance_w && G->key_w && G->value_w &&
           G->output_w && G->ln2_w && G->ln2_b && G->cm.ffn_x_k && G->cm.ffn_key_w &&
           G->cm.ffn_value_w;
}

/* The core's products the backward reads, kept per block under recompute:
 * y [BT][C], sel [B*H][T][kk] (as ints), lse [B*H][T], each a whole number
 * of 64-byte lines; 0 on bad sizes */
size_t rx_attn_kept_floats(const rx_attn_params *P, size_t B, size_t T) {
    attn_dims d;
    if (B > INT32_MAX || T > INT32_MAX || !attn_dims_init(P, (int)B, (int)T, &d)) return 0;
    const size_t BT = B * T, BHT = BT * d.H;
    if (BT > SIZE_MAX / 64 / d.C || BHT > SIZE_MAX / 64 / (d.kk + 1)) return 0;
    return rx_lines(BT * d.C) + rx_lines(BHT * d.kk) + rx_lines(BHT);
}

void rx_attn_acts_bind(rx_attn_acts *S, const rx_attn_params *P, float *kept) {
    attn_dims d;
    if (!attn_dims_init(P, (int)S->B, (int)S->T, &d)) return;
    const size_t BT = S->B * S->T, BHT = BT * d.H;
    S->y = rx_carve(&kept, BT * d.C);
    S->w.sel = (int *)(void *)rx_carve(&kept, BHT * d.kk);
    S->w.lse = rx_carve(&kept, BHT);
}

/* Everything but the core's y, sel and lse, which S holds from a forward
 * of the same x (rx_attn_acts_bind): the projections, the residual and the
 * channel-mix hidden, no block output. */
int rx_attn_forward_kept(const rx_model_ctx *ctx,
                         const rx_attn_params *P, const float *x, const float *cm_xprev_init,
                         rx_attn_acts *S) {
    attn_dims d;
    static const char *const fn = "rx_attn_forward_kept";
    const char *nul = rx_first_null(RX_NULLS(S, x), RX_NAMES("S", "x"), 2);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (!attn_block_ok(P, (int)S->B, (int)S->T, &d))
        return attn_params_fail(fn, P, (int)S->B, (int)S->T);
    int rc = attn_qkv(ctx, P, &d, x, S->h1, S->q, S->k, S->v);
    if (rc == RX_OK) rc = attn_residual(ctx, P, &d, x, S->y, S->x1, S->h2);
    if (rc == RX_OK)
        rc = rx_cm_forward_acts(&P->cm, S->h2, cm_xprev_init, S->xk, S->hid, NULL, d.B, d.T);
    return rc;
}

/* The block over x [B][T][C] (d: S's sizes), its queries at positions
 * pos.. of their sequences: ln1 and q into S, the window's keys and values
 * into rows pos.. of kc, vc [B][pos+T][C], the attention over every key up
 * to each query -- at pos 0 the training core over the window's own keys,
 * keeping selection and lse in S for the backward; after it (B = 1) the
 * decoding core over the earlier keys in kc, vc too -- then the residual,
 * ln2 and the channel mix from cm_xprev_init [B][C] (NULL: zero). out
 * [B][T][C] or NULL (intermediates only). cm_next [B][C] (may be
 * cm_xprev_init; NULL: not wanted) receives each sequence's last ln2 row,
 * the next call's carry. The training forward is pos 0 with kc, vc = S's
 * own k, v; every projection is an rx_pgemm. */
static int attn_block_run(const rx_model_ctx *ctx, const rx_attn_params *P, const attn_dims *d,
                          const float *x, const float *cm_xprev_init, float *cm_next,
                          size_t pos, float *kc, float *vc, rx_attn_acts *S, float *out) {
    const size_t BTC = d->B * d->T * d->C;
    int rc = attn_qkv(ctx, P, d, x, S->h1, S->q, kc + pos * d->C, vc + pos * d->C);
    if (rc == RX_OK)
        rc = pos ? attn_core_decode(P, S->q, kc, vc, pos, d->T, S->y)
                 : attn_core_forward(d, S->q, kc, vc, &S->w, S->y, NULL);
    if (rc == RX_OK) rc = attn_residual(ctx, P, d, x, S->y, S->x1, S->h2);
    if (rc == RX_OK)
        rc = rx_cm_forward_acts(&P->cm, S->h2, cm_xprev_init, S->xk, S->hid, out, d->B, d->T);
    if (rc != RX_OK) return rc;
    if (out)
        for (size_t i = 0; i < BTC; i++) out[i] += S->x1[i];
    if (cm_next) rx_shift_carry(cm_next, S->h2, d->B, d->T, d->C);
    return RX_OK;
}

/* x: [B][T][C]; cm_xprev_init: [B][C] or NULL; out: [B][T][C] or NULL
 * (intermediates only). P and S for the same sizes. */
int rx_attn_forward_acts(const rx_model_ctx *ctx,
                         const rx_attn_params *P, const float *x, const float *cm_xprev_init,
                         rx_attn_acts *S, float *out) {
    attn_dims d;
    static const char *const fn = "rx_attn_forward_acts";
    const char *nul = rx_first_null(RX_NULLS(S, x), RX_NAMES("S", "x"), 2);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (!attn_block_ok(P, (int)S->B, (int)S->T, &d))
        return attn_params_fail(fn, P, (int)S->B, (int)S->T);
    if (attn_work_threads(&d, &S->w) != RX_OK) return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    return attn_block_run(ctx, P, &d, x, cm_xprev_init, NULL, 0, S->k, S->v, S, out);
}

/* x, out: [T][C] (S for B = 1 and T); kc, vc: [pos+T][C]; cm_carry: [C] */
int rx_attn_step(const rx_model_ctx *ctx, const rx_attn_params *P, const float *x,
                 float *cm_carry, float *kc, float *vc, int pos, rx_attn_acts *S, float *out) {
    attn_dims d;
    static const char *const fn = "rx_attn_step";
    const char *nul = rx_first_null(RX_NULLS(S, x, kc, vc, out),
                                    RX_NAMES("S", "x", "kc", "vc", "out"), 5);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (S->B != 1 || pos < 0 || (int64_t)pos + (int64_t)S->T > INT32_MAX)
        return rx_fail(RX_EINVAL, "%s: B = %zu, pos = %d, T = %zu out of range", fn, S->B, pos,
                       S->T);
    if (!attn_block_ok(P, 1, (int)S->T, &d)) return attn_params_fail(fn, P, 1, (int)S->T);
    if (attn_work_threads(&d, &S->w) != RX_OK) return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    return attn_block_run(ctx, P, &d, x, cm_carry, cm_carry, (size_t)pos, kc, vc, S, out);
}

/* S from rx_attn_forward_acts on the same x and carry; dy, dx: [B][T][C];
 * d_cm_xprev_init: [B][C] or NULL; G overwritten; work: RX_ATTN_WORK floats */
int rx_attn_backward_acts(const rx_model_ctx *ctx,
                          const rx_attn_params *P, rx_attn_acts *S, const float *x,
                          const float *cm_xprev_init, const float *dy, rx_attn_grads *G,
                          float *dx, float *d_cm_xprev_init, float *work) {
    attn_dims d;
    static const char *const fn = "rx_attn_backward_acts";
    const char *nul = rx_first_null(RX_NULLS(S, x, dy, dx, work),
                                    RX_NAMES("S", "x", "dy", "dx", "work"), 5);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (!attn_grads_ok(G)) return rx_fail(RX_EINVAL, "%s: G is NULL or has a NULL grad", fn);
    if (!attn_block_ok(P, (int)S->B, (int)S->T, &d))
        return attn_params_fail(fn, P, (int)S->B, (int)S->T);
    if (attn_work_threads(&d, &S->w) != RX_OK) return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    const size_t BT = d.B * d.T, C = d.C, BTC = BT * C;
    /* t: the channel-mix lerp grad, then d y, then d h1 */
    float *g1 = work, *dq = g1 + BTC, *dk = dq + BTC, *dv = dk + BTC, *t = dv + BTC;
    float *dh = t + BTC;
    /* channel-mix, then ln2: g1 = d x1 = dy + ln2'(dCM/dh2) */
    int rc = rx_cm_backward_acts(&P->cm, S->h2, cm_xprev_init, S->xk, S->hid, dy, &G->cm,
                                 g1, d_cm_xprev_init, d.B, d.T, dh, t);
    if (rc != RX_OK) return rc;
    rx_fzero(G->ln2_w, C);
    rx_fzero(G->ln2_b, C);
    rc = rx_rownorm_backward(S->x1, P->ln2_w, g1, g1, G->ln2_w, G->ln2_b, BT, C, 1,
                             (float)ctx->ln_eps);
    if (rc != RX_OK) return rc;
    for (size_t i = 0; i < BTC; i++) g1[i] += dy[i];
    /* output projection */
    const rx_gemm_op out[2] = {{1, 0, C, C, BT, S->y, C, g1, C, 0.0f, G->output_w, C},
                               {0, 1, BT, C, C, g1, C, P->output_w, C, 0.0f, t, C}};
    rc = rx_pgemm_batch(out, 2);
    if (rc == RX_OK) rc = attn_core_backward(&d, S->q, S->k, S->v, S->y, t, &S->w, dq, dk, dv);
    if (rc != RX_OK) return rc;
    /* q, k, v projections */
    /* the three grads on h1 add into one buffer: only the first joins the batch */
    const rx_gemm_op qkv[4] = {{1, 0, C, C, BT, S->h1, C, dq, C, 0.0f, G->receptance_w, C},
                               {1, 0, C, C, BT, S->h1, C, dk, C, 0.0f, G->key_w, C},
                               {1, 0, C, C, BT, S->h1, C, dv, C, 0.0f, G->value_w, C},
                               {0, 1, BT, C, C, dq, C, P->receptance_w, C, 0.0f, t, C}};
    rc = rx_pgemm_batch(qkv, 4);
    if (rc == RX_OK) rc = rx_pgemm(0, 1, BT, C, C, dk, C, P->key_w, C, 1.0f, t, C);
    if (rc == RX_OK) rc = rx_pgemm(0, 1, BT, C, C, dv, C, P->value_w, C, 1.0f, t, C);
    if (rc != RX_OK) return rc;
    /* ln1 and the residual */
    rx_fzero(G->ln1_w, C);
    rx_fzero(G->ln1_b, C);
    rc = rx_rownorm_backward(x, P->ln1_w, t, dx, G->ln1_w, G->ln1_b, BT, C, 1, (float)ctx->ln_eps);
    if (rc != RX_OK) return rc;
    for (size_t i = 0; i < BTC; i++) dx[i] += g1[i];
    return RX_OK;
}

/* P's tensors into in and G's (when not NULL) into out, for rx_spans_check,
 * with the sequence's own x, carry and dy (NULL in the forward) inputs and
 * y (out or dx) and carry-grad outputs */
static int attn_spans_check(const char *fn, const rx_attn_params *P, const rx_attn_grads *G,
                            const attn_dims *d, const float *x, const float *xprev,
                            const float *dy, const float *y, const float *dxprev) {
    const size_t C = d->C, BTC = d->B * d->T * C;
    rx_spans in = {.n = 0}, out = {.n = 0};
    const float *const p[8] = {P->ln1_w, P->ln1_b, P->receptance_w, P->key_w, P->value_w,
                               P->output_w, P->ln2_w, P->ln2_b};
    const float *const g[8] = {G ? G->ln1_w : NULL, G ? G->ln1_b : NULL,
                               G ? G->receptance_w : NULL, G ? G->key_w : NULL,
                               G ? G->value_w : NULL, G ? G->output_w : NULL,
                               G ? G->ln2_w : NULL, G ? G->ln2_b : NULL};
    static const char *const name[8] = {"ln1_w", "ln1_b", "receptance_w", "key_w", "value_w",
                                        "output_w", "ln2_w", "ln2_b"};
    for (int i = 0; i < 8; i++) {
        const size_t n = i >= 2 && i < 6 ? C * C : C;
        rx_spans_add(&in, "P->", name[i], p[i], n, sizeof(float));
        rx_spans_add(&out, "G->", name[i], g[i], n, sizeof(float));
    }
    rx_cm_spans(&P->cm, G ? &G->cm : NULL, "P->cm.", "G->cm.", &in, &out);
    RX_SPAN_ADD(&in, "x", x, BTC);
    RX_SPAN_ADD(&in, "cm_xprev_init", xprev, d->B * C);
    RX_SPAN_ADD(&in, "dy", dy, BTC);
    RX_SPAN_ADD(&out, dy ? "dx" : "out", y, BTC);
    RX_SPAN_ADD(&out, "d_cm_xprev_init", dxprev, d->B * C);
    return rx_spans_check(fn, &out, &in);
}

/* x, out: [B][T][C]; cm_xprev_init: [B][C] or NULL */
int rx_attn_forward_seq(const rx_attn_params *P, const float *x, const float *cm_xprev_init,
                        float *out, int B, int T) {
    attn_dims d;
    static const char *const fn = "rx_attn_forward_seq";
    const char *nul = rx_first_null(RX_NULLS(x, out), RX_NAMES("x", "out"), 2);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (!attn_block_ok(P, B, T, &d)) return attn_params_fail(fn, P, B, T);
    int rc = attn_spans_check(fn, P, NULL, &d, x, cm_xprev_init, NULL, out, NULL);
    if (rc != RX_OK) return rc;
    rx_attn_acts *S = rx_attn_acts_new(P, d.B, d.T);
    if (!S) return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    rc = rx_attn_forward_acts(&rx_ctx_default, P, x, cm_xprev_init, S, out);
    rx_attn_acts_free(S);
    return rc;
}

/* x, dy, dx: [B][T][C]; cm_xprev_init, d_cm_xprev_init: [B][C] or NULL */
int rx_attn_backward_full(const rx_attn_params *P, const float *x, const float *cm_xprev_init,
                          const float *dy, rx_attn_grads *G, float *dx, float *d_cm_xprev_init,
                          int B, int T) {
    attn_dims d;
    static const char *const fn = "rx_attn_backward_full";
    const char *nul = rx_first_null(RX_NULLS(x, dy, dx), RX_NAMES("x", "dy", "dx"), 3);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (!attn_grads_ok(G)) return rx_fail(RX_EINVAL, "%s: G is NULL or has a NULL grad", fn);
    if (!attn_block_ok(P, B, T, &d)) return attn_params_fail(fn, P, B, T);
    int rc = attn_spans_check(fn, P, G, &d, x, cm_xprev_init, dy, dx, d_cm_xprev_init);
    if (rc != RX_OK) return rc;
    rx_attn_acts *S = rx_attn_acts_new(P, d.B, d.T);
    float *work = rx_falloc(RX_ATTN_WORK(d.B * d.T, d.C, (size_t)P->cm.ffn_dim));
    rc = !S || !work ? rx_fail(RX_ENOMEM, "%s: out of memory", fn)
                     : rx_attn_forward_acts(&rx_ctx_default, P, x, cm_xprev_init, S, NULL);
    if (rc == RX_OK)
        rc = rx_attn_backward_acts(&rx_ctx_default,
                                   P, S, x, cm_xprev_init, dy, G, dx, d_cm_xprev_init, work);
    rx_attn_acts_free(S);
    free(work);
    return rc;
}
