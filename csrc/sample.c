/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * sample.c -- drawing each row's next token from its logits (rx_sample_rows;
 * docs/training.md §Drawing a token).
 *
 * A row is drawn alone, by one thread, from its own logits and uniform, so
 * its id and log-probability do not depend on the other rows of the call.
 * Everything runs in float64. The exponentials are exp_neg's: one sequence
 * of correctly rounded operations (explicit fmas, a rounding constant, an
 * exponent built from integer bits) that the vectorised and the scalar
 * builds of a loop carry out alike, so the bits are the same on every CPU.
 * Whole-row sums run in eight interleaved lanes, then lane_total's fixed
 * tree, for the same reason. The cumulative sums that place a cut or a
 * draw run in order, one element after another, as a cumulative sum is
 * defined.
 *
 * The cut of top-k / top-p needs the likeliest ids in order (weight down,
 * id up among ties) and the running sum of their weights. A row's weights
 * are bucketed by binade (a double's exponent bits); walking the binades
 * from the top gives the fewest whole binades whose mass reaches the cut
 * with a margin. Only those ids are sorted (a stable LSD radix sort of the
 * weights' bits, ids entering in increasing order): every id left out is
 * less likely than each id sorted, so the sorted ids are the head of the
 * whole order. A peaked row (its mass in a few ids) sorts few; a flat row
 * sorts most of the vocabulary. The draw then walks the kept ids alone.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rx_internal.h"
#include "rx_pretrain.h"

#define LANES 8                 /* a whole-row sum's interleaved partial sums */
#define EXP_FLOOR (-708.0)      /* exp_neg below: 0 (2^-1021 and under taken as 0) */
#define BINADES 1024            /* exponent fields of doubles in [0, 1] */
#define CUT_MARGIN 1e-9         /* relative mass past top_p the binade walk collects */
#define RADIX_BITS 11           /* six passes at most over 64-bit keys */
#define RADIX (1 << RADIX_BITS)
#define RADIX_PASSES ((64 + RADIX_BITS - 1) / RADIX_BITS)
#define KEPT_SCAN 64            /* kept ids past V / this: put in id order by a scan */

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define RX_SAMPLE_X86 1
#endif

/* exp(x) for x <= 0: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its Taylor
 * series to r^13 (remainder under 2^-56) in Horner's fmas, times 2^n from
 * the exponent bits: within 1 ulp of glibc's exp over [-708, 0] (968,537
 * points, docs/training.md). exp_neg4 is the same operations on four lanes. */
#define EXP_SHIFT 0x1.8p52   /* k = x log2e + this holds n in its low mantissa bits */
#define LOG2E 0x1.71547652b82fep0
#define LN2_HI 0x1.62e42fefa39efp-1
#define LN2_LO 0x1.abc9e3b39803fp-56
#define EXP_TERMS 14         /* 1/13! ... 1/1!, 1/0! */
static const double exp_coef[EXP_TERMS] = {
    1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0,
    1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};

static inline double exp_neg(double x) {
    const double k = fma(x, LOG2E, EXP_SHIFT);
    const double n = k - EXP_SHIFT;
    const double r = fma(-n, LN2_LO, fma(-n, LN2_HI, x));
    double p = exp_coef[0];
    for (int j = 1; j < EXP_TERMS; j++) p = fma(p, r, exp_coef[j]);
    uint64_t kb;
    memcpy(&kb, &k, sizeof kb);
    const uint64_t sb = (kb + 1023) << 52;   /* 2^n: n >= -1021 above the floor */
    double s;
    memcpy(&s, &sb, sizeof s);
    return x < EXP_FLOOR ? 0.0 : p * s;
}

static double lane_total(const double acc[LANES]) {
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* p[i] = exp_neg((x[i] - m) / t) from i = i0 on, each added to lane i % 8 */
static void exp_tail(const float *x, size_t i0, size_t V, double m, double t, double *p,
                     double acc[LANES]) {
    for (size_t i = i0; i < V; i++) {
        p[i] = exp_neg(((double)x[i] - m) / t);
        acc[i % LANES] += p[i];
    }
}

#ifdef RX_SAMPLE_X86
#define RX_AVX2_FMA __attribute__((target("avx2,fma")))
RX_AVX2_FMA static inline __m256d exp_neg4(__m256d x) {
    const __m256d shift = _mm256_set1_pd(EXP_SHIFT);
    const __m256d k = _mm256_fmadd_pd(x, _mm256_set1_pd(LOG2E), shift);
    const __m256d nn = _mm256_sub_pd(shift, k);   /* -n, exactly */
    const __m256d r = _mm256_fmadd_pd(nn, _mm256_set1_pd(LN2_LO),
                                      _mm256_fmadd_pd(nn, _mm256_set1_pd(LN2_HI), x));
    __m256d p = _mm256_set1_pd(exp_coef[0]);
    for (int j = 1; j < EXP_TERMS; j++) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(exp_coef[j]));
    const __m256i sb = _mm256_slli_epi64(
        _mm256_add_epi64(_mm256_castpd_si256(k), _mm256_set1_epi64x(1023)), 52);
    const __m256d y = _mm256_mul_pd(p, _mm256_castsi256_pd(sb));
    const __m256d under = _mm256_cmp_pd(x, _mm256_set1_pd(EXP_FLOOR), _CMP_LT_OQ);
    return _mm256_blendv_pd(y, _mm256_setzero_pd(), under);
}

RX_AVX2_FMA static double exp_row_avx2(const float *x, size_t V, double m, double t, double *p) {
    const __m256d vm = _mm256_set1_pd(m), vt = _mm256_set1_pd(t);
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    size_t i = 0;
    for (; i + LANES <= V; i += LANES) {
        const __m256d y0 = exp_neg4(_mm256_div_pd(
            _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i)), vm), vt));
        const __m256d y1 = exp_neg4(_mm256_div_pd(
            _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i + 4)), vm), vt));
        _mm256_storeu_pd(p + i, y0);
        _mm256_storeu_pd(p + i + 4, y1);
        a0 = _mm256_add_pd(a0, y0);
        a1 = _mm256_add_pd(a1, y1);
    }
    double acc[LANES];
    _mm256_storeu_pd(acc, a0);
    _mm256_storeu_pd(acc + 4, a1);
    exp_tail(x, i, V, m, t, p, acc);
    return lane_total(acc);
}

/* the largest of x[0:i) into *m (a max is exact in any order) and whether
 * they are all finite into *ok, i the whole eights of V; returns i */
RX_AVX2_FMA static size_t argmax_avx2(const float *x, size_t V, float *m, int *ok) {
    __m256 mx = _mm256_set1_ps(x[0]), bad = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        mx = _mm256_max_ps(mx, v);
        /* v - v is 0 for a finite v, NaN for inf and NaN */
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(),
                                              _CMP_NEQ_UQ));
    }
    float l[8];
    _mm256_storeu_ps(l, mx);
    for (int k = 0; k < 8; k++) *m = l[k] > *m ? l[k] : *m;
    *ok = _mm256_movemask_ps(bad) == 0;
    return i;
}
#endif

/* whether exp_row takes the AVX2 lanes: an x86 CPU with AVX2 and FMA,
 * unless RWKVX_SAMPLE_PORTABLE=1 (a test hook: both give the same bits) */
static int use_avx2(void) {
#ifdef RX_SAMPLE_X86
    const char *env = getenv("RWKVX_SAMPLE_PORTABLE");
    return !(env && !strcmp(env, "1")) && __builtin_cpu_supports("avx2") &&
           __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* p[i] = exp_neg((x[i] - m) / t), i < V, in AVX2 lanes when avx2; returns
 * their lane sum (eight interleaved lanes, lane_total's tree) */
static double exp_row(int avx2, const float *x, size_t V, double m, double t, double *p) {
#ifdef RX_SAMPLE_X86
    if (avx2) return exp_row_avx2(x, V, m, t, p);
#else
    (void)avx2;
#endif
    double acc[LANES] = {0};
    exp_tail(x, 0, V, m, t, p, acc);
    return lane_total(acc);
}

/* the first index of x's largest value (np.argmax's, x without NaN), in
 * AVX2 lanes when avx2 (the max is exact either way); *all_finite: no inf
 * or NaN in x */
static size_t argmax_row(int avx2, const float *x, size_t V, int *all_finite) {
    float m = x[0];
    int ok = 1;
    size_t i = 0;
#ifdef RX_SAMPLE_X86
    if (avx2) i = argmax_avx2(x, V, &m, &ok);
#else
    (void)avx2;
#endif
    for (; i < V; i++) {
        ok &= isfinite(x[i]) != 0;
        m = x[i] > m ? x[i] : m;
    }
    *all_finite = ok;
    size_t best = 0;
    while (best + 1 < V && !(x[best] == m)) best++;
    return best;
}

/* A row's scratch: the weights e [V], keys and ids twice over [V] (the
 * radix sort's two buffers), and the binades' counts and masses in HIST
 * interleaved copies (consecutive ids never add to the same one, so the
 * adds do not wait on each other). */
#define HIST 4
typedef struct {
    int avx2;   /* exp_row's and argmax_row's lanes */
    double *e;
    uint64_t *key[2];
    int32_t *id[2];
    double mass[HIST][BINADES];
    uint32_t count[HIST][BINADES];
    uint32_t digits[RADIX_PASSES][RADIX];   /* radix_sort's counts (V < 2^31) */
} row_scratch;

static size_t scratch_bytes(size_t V) {
    return sizeof(row_scratch) + V * (sizeof(double) + 2 * sizeof(uint64_t) +
                                      2 * sizeof(int32_t)) + 64 * 5;
}

static row_scratch *scratch_of(void *buf, size_t V) {
    row_scratch *s = buf;
    char *at = (char *)(s + 1);
#define TAKE(ptr, n) (ptr = (void *)at, at += ((n) + 63) / 64 * 64)
    TAKE(s->e, V * sizeof(double));
    TAKE(s->key[0], V * sizeof(uint64_t));
    TAKE(s->key[1], V * sizeof(uint64_t));
    TAKE(s->id[0], V * sizeof(int32_t));
    TAKE(s->id[1], V * sizeof(int32_t));
#undef TAKE
    return s;
}

/* key[0][0:n), id[0][0:n) sorted by key up, stably (LSD radix, RADIX_BITS
 * a pass, every pass's counts from one read of the keys: a permutation
 * keeps each digit's counts; a digit that every key shares is skipped);
 * returns the buffer (0 or 1) that holds the result */
static int radix_sort(row_scratch *s, size_t n) {
    memset(s->digits, 0, sizeof s->digits);
    for (size_t i = 0; i < n; i++) {
        const uint64_t k = s->key[0][i];
        for (int p = 0; p < RADIX_PASSES; p++)
            s->digits[p][(k >> (p * RADIX_BITS)) & (RADIX - 1)]++;
    }
    int src = 0;
    for (int p = 0; p < RADIX_PASSES; p++) {
        const int shift = p * RADIX_BITS;
        uint32_t *cnt = s->digits[p];
        if (n == 0 || cnt[(s->key[src][0] >> shift) & (RADIX - 1)] == n) continue;
        uint32_t at = 0;
        for (int b = 0; b < RADIX; b++) {
            const uint32_t c = cnt[b];
            cnt[b] = at;
            at += c;
        }
        for (size_t i = 0; i < n; i++) {
            const size_t d = cnt[(s->key[src][i] >> shift) & (RADIX - 1)]++;
            s->key[1 - src][d] = s->key[src][i];
            s->id[1 - src][d] = s->id[src][i];
        }
        src = 1 - src;
    }
    return src;
}

/* The ids the cut keeps, in increasing order, at *kept (*n of them): of
 * the weights e [V] (summing to E in lanes), the top_k likeliest (0: all;
 * weight down, id up among ties), then the fewest of those from the top
 * whose running sum over `total` (the kept top_k's running sum, else E)
 * reaches top_p. */
static void cut_row(row_scratch *s, size_t V, double E, double top_p, size_t top_k,
                    const int32_t **kept, size_t *n) {
    memset(s->count, 0, sizeof s->count);
    memset(s->mass, 0, sizeof s->mass);
    for (size_t i = 0; i < V; i++) {
        uint64_t b;
        memcpy(&b, &s->e[i], sizeof b);
        s->count[i % HIST][b >> 52]++;
        s->mass[i % HIST][b >> 52] += s->e[i];
    }
    /* the fewest top binades holding top_k ids and top_p of the mass */
    const double want = top_p < 1.0 ? top_p * E * (1.0 + CUT_MARGIN) : 0.0;
    size_t have = 0, lo = BINADES;
    double got = 0.0;
    while (lo > 0 && (have < top_k || got < want || have == 0)) {
        lo--;
        for (int c = 0; c < HIST; c++) have += s->count[c][lo], got += s->mass[c][lo];
    }
    if (got < want) lo = 0;   /* rounding short of the margin: every id */
    size_t m = 0;
    for (size_t i = 0; i < V; i++) {
        uint64_t b;
        memcpy(&b, &s->e[i], sizeof b);
        if ((b >> 52) >= lo) s->key[0][m] = ~b, s->id[0][m++] = (int32_t)i;
    }
    const int32_t *order = s->id[radix_sort(s, m)];
    size_t keep = top_k && top_k < m ? top_k : m;
    double total = E;
    if (top_k) {
        total = 0.0;
        for (size_t j = 0; j < keep; j++) total += s->e[order[j]];
    }
    if (top_p < 1.0) {
        double cum = 0.0;
        for (size_t j = 0; j < keep; j++) {
            cum += s->e[order[j]];
            if (cum / total >= top_p) {
                keep = j + 1;
                break;
            }
        }
    }
    *n = keep;
    if (keep * KEPT_SCAN < V) {
        /* the few kept ids back in id order (an id is its own key) */
        for (size_t j = 0; j < keep; j++) {
            const int32_t i = order[j];
            s->key[0][j] = (uint64_t)i;
            s->id[0][j] = i;
        }
        *kept = s->id[radix_sort(s, keep)];
        return;
    }
    /* many: a flag an id, then the vocabulary in order (two radix passes
     * over a flat row's kept ids took longer than this scan) */
    unsigned char *flag = (unsigned char *)s->key[0];
    int32_t *ids = order == s->id[0] ? s->id[1] : s->id[0];
    memset(flag, 0, V);
    for (size_t j = 0; j < keep; j++) flag[order[j]] = 1;
    size_t at = 0;   /* branch-free: every id written, the kept ones kept */
    for (size_t i = 0; i < V; i++) {
        ids[at] = (int32_t)i;
        at += flag[i];
    }
    *kept = ids;
}

/* The id drawn by u from the weights e over ids (increasing; NULL: all n
 * ids 0..n-1): the first whose running sum over the total (the running sum
 * at the end) exceeds u. An id of weight 0 adds nothing to a sum, so
 * leaving it out changes no bit, and it is never drawn: its running sum is
 * the id's before it (or 0, which u >= 0 does not exceed). The last sum is
 * the total, and u < 1, so the walk always ends inside. */
static size_t draw_row(const double *e, const int32_t *ids, size_t n, double u) {
#define AT(j) (ids ? (size_t)ids[j] : (j))
    double total = 0.0;
    for (size_t j = 0; j < n; j++) total += e[AT(j)];
    double cum = 0.0;
    size_t j = 0;
    for (; j + 1 < n; j++) {
        cum += e[AT(j)];
        if (cum / total > u) break;
    }
    return AT(j);
#undef AT
}

static int32_t sample_row(const float *x, const float *raw, size_t V, double u, double t,
                          double top_p, size_t top_k, row_scratch *s, double *logprob) {
    int finite, x_finite;
    const size_t rmax = argmax_row(s->avx2, raw, V, &finite);
    const size_t xmax = x == raw ? rmax : argmax_row(s->avx2, x, V, &x_finite);
    if (!finite || !isfinite(x[xmax])) return -1;
    size_t id;
    double lse_sum = -1.0;   /* the raw row's sum of exp(raw - max raw), once known */
    if (t <= 0.0) {
        id = xmax;
    } else {
        const double E = exp_row(s->avx2, x, V, x[xmax], t, s->e);
        if (x == raw && t == 1.0) lse_sum = E;
        if (top_p < 1.0 || (top_k > 0 && top_k < V)) {
            const int32_t *kept;
            size_t n;
            cut_row(s, V, E, top_p, top_k < V ? top_k : 0, &kept, &n);
            id = draw_row(s->e, kept, n, u);
        } else {
            id = draw_row(s->e, NULL, V, u);
        }
    }
    if (lse_sum < 0.0) lse_sum = exp_row(s->avx2, raw, V, raw[rmax], 1.0, s->e);
    *logprob = (double)raw[id] - (log(lse_sum) + (double)raw[rmax]);
    return (int32_t)id;
}

int rx_sample_rows(int R, int V, const float *x, const float *raw, size_t ld, const double *u,
                   double temperature, double top_p, int top_k, int32_t *ids, double *logprob) {
    if (R < 0 || V < 1 || !x || !raw || (R > 0 && (!u || !ids || !logprob)) || ld < (size_t)V)
        return rx_fail(RX_EINVAL, "rx_sample_rows: NULL rows, R < 0, V < 1 or ld < V");
    if (!(temperature >= 0.0) || !isfinite(temperature))
        return rx_fail(RX_EINVAL, "rx_sample_rows: temperature %g is not a finite value >= 0",
                       temperature);
    if (!(top_p >= 0.0 && top_p <= 1.0) || top_k < 0)
        return rx_fail(RX_EINVAL, "rx_sample_rows: top_p %g outside [0, 1] or top_k %d < 0",
                       top_p, top_k);
    for (int r = 0; r < R; r++)
        if (!(u[r] >= 0.0 && u[r] < 1.0))
            return rx_fail(RX_EINVAL, "rx_sample_rows: u[%d] = %g is outside [0, 1)", r, u[r]);
    const size_t bytes = scratch_bytes((size_t)V);
    const int avx2 = use_avx2();
    const int nt = rx_in_parallel() || R < 2 ? 1 : (R < rx_max_threads() ? R : rx_max_threads());
    int fail = 0;
#pragma omp parallel num_threads(nt) reduction(| : fail)
    {
        void *buf = rx_thread_buffer(RX_BUF_SAMPLE, bytes);
        row_scratch *s = buf ? scratch_of(buf, (size_t)V) : NULL;
        if (s) s->avx2 = avx2;
#pragma omp for schedule(dynamic, 1)
        for (int r = 0; r < R; r++) {
            if (!s) {
                fail = 1;
                continue;
            }
            ids[r] = sample_row(x + (size_t)r * ld, raw + (size_t)r * ld, (size_t)V, u[r],
                                temperature, top_p, (size_t)top_k, s, &logprob[r]);
        }
    }
    return fail ? rx_fail(RX_ENOMEM, "rx_sample_rows: no memory for a row's %zu bytes", bytes)
                : RX_OK;
}
