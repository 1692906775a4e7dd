/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * wkv7.c -- the RWKV-7 WKV recurrence, forward and backward through time.
 *
 * The backward equations are those of the wkv7 CUDA kernel of BlinkDL's
 * RWKV-LM (Apache-2.0, see NOTICE), restated for a row-major state:
 *     dS_t    += dy_t r_t^T                       (grad entering S_t)
 *     dr_t[j]  = sum_i S_t[i][j] dy_t[i]
 *     dw_t[j]  = sum_i dS[i][j] S_{t-1}[i][j]
 *     dk_t[j]  = sum_i dS[i][j] v_t[i]      dv_t[i] = sum_j dS[i][j] k_t[j]
 *     db_t[j]  = sum_i dS[i][j] sa[i]      dsa[i]  = sum_j dS[i][j] b_t[j]
 *     da_t[j]  = sum_i dsa[i] S_{t-1}[i][j]
 *     dS_{t-1} = dS diag(w_t) + dsa a_t^T
 * Unlike the CUDA kernel, dw is w.r.t. the effective decay w itself.
 *
 * Memory: the backward keeps the state only every RX_WKV7_CHUNK steps and
 * recomputes the states inside a chunk from its checkpoint, so a head costs
 * ceil(T/RX_WKV7_CHUNK)*N*N saved floats instead of T*N*N. The model's forward keeps
 * these checkpoints (rx_wkv7_forward_cp) so its backward does not run the
 * forward again. Recomputation repeats the forward arithmetic exactly, so
 * the states match the forward's bit for bit.
 *
 * Each (b, h) pair is independent: OpenMP runs over B*H (the forward gives
 * each thread a group of heads that it runs 16 steps at a time, see
 * wkv7_forward), or, when those are too few for the team, over 16-row
 * tiles of every head (below, "Splitting a head"); every row operation
 * runs over the key dimension j, contiguous in memory.
 *
 * Speed: a head's state (16 KiB at N = 64) stays in L1 and its chunk of
 * recomputed states in L2. When N is a multiple of 16 and the CPU has
 * AVX-512F, or a multiple of 8 and it has AVX2+FMA, hand-vectorised steps
 * run instead of the portable ones (wkv7_simd.h, written once for both
 * widths; for N = 64 compiled with N a constant):
 *   - forward: four rows at a time, their y row sums reduced together
 *     (one horizontal add tree per four rows, not one per row); then the
 *     next step's sa from the new state, so a chunk's recomputation can
 *     start from a checkpoint and keep every step's sa;
 *   - backward: the row sums dv = dS k + dy (r.k), dsa = dS b + dy (r.b)
 *     first, four rows at a time; then one pass over vector-wide column blocks that
 *     keeps the column sums in registers and rewrites dS in place, so no
 *     per-column accumulator goes through memory per row. It reads only
 *     S_{t-1}: dr_{t-1} = S_{t-1}^T dy_{t-1} takes the place of dr_t, and
 *     only a sequence's last step needs its dr from S_t.
 * Both forms follow the same equations; they differ only in the order of
 * float additions.
 */
#include <string.h>

#include "rx_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RX_X86 1
#endif

/* One step for one head: S [N][N] updated in place; y [N] or NULL. */
RX_HOT static void wkv7_step(float *S, const float *r, const float *w, const float *k,
                             const float *v, const float *a, const float *b, float *y,
                             size_t N) {
    for (size_t i = 0; i < N; i++) {
        float *Si = S + i * N;
        float sa = 0.0f, yi = 0.0f, vi = v[i];
#pragma omp simd reduction(+ : sa)
        for (size_t j = 0; j < N; j++) sa += a[j] * Si[j];
#pragma omp simd reduction(+ : yi)
        for (size_t j = 0; j < N; j++) {
            float s = Si[j] * w[j] + vi * k[j] + sa * b[j];
            Si[j] = s;
            yi += s * r[j];
        }
        if (y) y[i] = yi;
    }
}

/* One reverse step for one head. S0 = state before the step, S1 after it;
 * dS [N][N] enters as the grad on S1 (without this step's dy) and leaves as
 * the grad on S0. dr..db receive this step's per-token grads. */
RX_HOT static void wkv7_step_back(const float *S0, const float *S1, float *dS,
                                  const float *r, const float *w, const float *k,
                                  const float *v, const float *a, const float *b,
                                  const float *dy, float *dr, float *dw, float *dk,
                                  float *dv, float *da, float *db, size_t N) {
    for (size_t j = 0; j < N; j++) dr[j] = dw[j] = dk[j] = da[j] = db[j] = 0.0f;
    for (size_t i = 0; i < N; i++) {
        const float *S0i = S0 + i * N, *S1i = S1 + i * N;
        float *dSi = dS + i * N;
        float dyi = dy[i], vi = v[i], sa = 0.0f, dvi = 0.0f, dsa = 0.0f;
#pragma omp simd reduction(+ : sa, dvi, dsa)
        for (size_t j = 0; j < N; j++) {
            float g = dSi[j] + dyi * r[j];
            dSi[j] = g;
            dr[j] += dyi * S1i[j];
            sa += a[j] * S0i[j];
            dvi += g * k[j];
            dsa += g * b[j];
        }
        dv[i] = dvi;
#pragma omp simd
        for (size_t j = 0; j < N; j++) {
            float g = dSi[j];
            dw[j] += g * S0i[j];
            dk[j] += g * vi;
            db[j] += g * sa;
            da[j] += dsa * S0i[j];
            dSi[j] = g * w[j] + dsa * a[j];
        }
    }
}

/* The vectorised steps (wkv7_simd.h) of one vector width. */
typedef struct {
    const char *name;
    size_t width;
    void (*rowdots)(const float *S, const float *a, float *sa, size_t R, size_t N);
    void (*step)(const float *Si, float *So, const float *r, const float *w, const float *k,
                 const float *v, const float *b, const float *sa, const float *an, float *y,
                 float *san, size_t R, size_t N);
    void (*coldots)(const float *S, const float *x, float *out, size_t R, size_t N);
    void (*step_back)(const float *S0, float *dS, const float *r, const float *w,
                      const float *k, const float *v, const float *a, const float *b,
                      const float *dy, const float *dyp, const float *sa, float *dsa,
                      float *drp, float *dw, float *dk, float *dv, float *da, float *db,
                      size_t R, size_t N);
} wkv_simd;

/* Rows per tile of the vectorised backward's column sums: 16 rows of S0
 * and dS are 8 KiB at N = 64, so a tile stays in L1 across its column
 * blocks (whole columns would map 64 rows x 2 arrays onto 16 cache sets).
 * Also the unit of a split head (below). */
#define WKV_BACK_ROWS 16

#ifdef RX_X86

#define RX_AVX2 __attribute__((target("avx2,fma")))
#define RX_AVX512 __attribute__((target("avx512f,avx2,fma")))

/* Sums of four 8-lane vectors: lane q of the result is sum(a_q). */
RX_AVX2 static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

RX_AVX2 static inline float hsum1(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The same over 16 lanes: each vector's halves added first. */
RX_AVX512 static inline __m256 half_sum(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

RX_AVX512 static inline __m128 hsum4_512(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    return hsum4(half_sum(a0), half_sum(a1), half_sum(a2), half_sum(a3));
}

RX_AVX512 static inline float hsum1_512(__m512 a) { return hsum1(half_sum(a)); }

#define WKV_W 8
#define WKV_JU 1   /* 16 ymm registers: no room for two column vectors' sums */
#define WKV_T RX_AVX2
#define WKV_FN(name) name##_avx2
#define WKV_V __m256
#define WKV_LOAD _mm256_loadu_ps
#define WKV_STORE _mm256_storeu_ps
#define WKV_FMA _mm256_fmadd_ps
#define WKV_MUL _mm256_mul_ps
#define WKV_ADD _mm256_add_ps
#define WKV_ZERO _mm256_setzero_ps
#define WKV_BCAST _mm256_broadcast_ss
#define WKV_HSUM4 hsum4
#define WKV_HSUM1 hsum1
#include "wkv7_simd.h"
#undef WKV_W
#undef WKV_JU
#undef WKV_T
#undef WKV_FN
#undef WKV_V
#undef WKV_LOAD
#undef WKV_STORE
#undef WKV_FMA
#undef WKV_MUL
#undef WKV_ADD
#undef WKV_ZERO
#undef WKV_BCAST
#undef WKV_HSUM4
#undef WKV_HSUM1

#define WKV_W 16
#define WKV_JU 2
#define WKV_T RX_AVX512
#define WKV_FN(name) name##_avx512
#define WKV_V __m512
#define WKV_LOAD _mm512_loadu_ps
#define WKV_STORE _mm512_storeu_ps
#define WKV_FMA _mm512_fmadd_ps
#define WKV_MUL _mm512_mul_ps
#define WKV_ADD _mm512_add_ps
#define WKV_ZERO _mm512_setzero_ps
#define WKV_BCAST(p) _mm512_set1_ps(*(p))
#define WKV_HSUM4 hsum4_512
#define WKV_HSUM1 hsum1_512
#include "wkv7_simd.h"

static const wkv_simd wkv_avx2 = {"avx2", 8, rowdots_avx2, step_avx2, coldots_avx2,
                                  step_back_avx2};
/* Measured on a Sapphire Rapids (README, WKV7): twice the lanes per
 * instruction, in a recurrence bound by its arithmetic (a head's state stays
 * in L1). */
static const wkv_simd wkv_avx512 = {"avx512f", 16, rowdots_avx512, step_avx512, coldots_avx512,
                                    step_back_avx512};
static const wkv_simd *const wkv_simds[] = {&wkv_avx512, &wkv_avx2};

static int wkv_simd_runs(const wkv_simd *k) {
    if (k == &wkv_avx512) return __builtin_cpu_supports("avx512f");
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#define WKV_NSIMD (sizeof wkv_simds / sizeof wkv_simds[0])
#else
static const wkv_simd *const wkv_simds[1] = {NULL};
static int wkv_simd_runs(const wkv_simd *k) { return k != NULL && 0; }
#define WKV_NSIMD 0
#endif

/* Set by rx_wkv7_use_kernel; NULL: the widest this CPU runs. */
static const wkv_simd *forced_wkv;
static int wkv_forced_portable;

int rx_wkv7_use_kernel(const char *name) {
    forced_wkv = NULL;
    wkv_forced_portable = 0;
    if (!name) return RX_OK;
    if (!strcmp(name, "portable")) {
        wkv_forced_portable = 1;
        return RX_OK;
    }
    for (size_t i = 0; i < WKV_NSIMD; i++)
        if (!strcmp(name, wkv_simds[i]->name) && wkv_simd_runs(wkv_simds[i])) {
            forced_wkv = wkv_simds[i];
            return RX_OK;
        }
    return rx_fail(RX_EINVAL, "rx_wkv7_use_kernel: kernel \"%s\" is unknown or cannot run here",
                   name);
}

/* The vectorised steps for head size N, or NULL for the portable ones. */
static const wkv_simd *wkv7_simd(size_t N) {
    if (wkv_forced_portable) return NULL;
    if (forced_wkv) return N % forced_wkv->width == 0 ? forced_wkv : NULL;
    for (size_t i = 0; i < WKV_NSIMD; i++)
        if (N % wkv_simds[i]->width == 0 && wkv_simd_runs(wkv_simds[i])) return wkv_simds[i];
    return NULL;
}

const char *rx_wkv7_kernel(int head_size) {
    const wkv_simd *k = head_size > 0 ? wkv7_simd((size_t)head_size) : NULL;
    return k ? k->name : "portable";
}

/* A head's per-token rows sit C floats apart, two or more per 4 KiB page,
 * which defeats the hardware prefetchers: fetch a step's rows (N floats at
 * p[o] for each array) while an earlier step computes. A tile of a split
 * head fetches only its own part of the row-indexed arrays (v, y, dy, dv):
 * the other tiles' threads write theirs, and a line fetched into a second
 * core must be taken back from it for every write. */
static inline void prefetch_rows(const float *const *p, size_t n, size_t o, size_t N) {
    for (size_t q = 0; q < n; q++)
        for (size_t j = 0; j < N; j += 16) __builtin_prefetch(p[q] + o + j);
}

#define WKV_AHEAD 2   /* steps prefetched ahead */
/* steps a head runs before the next head of its thread's group (even: the
 * sa scratch swaps back) */
#define WKV_FWD_BLOCK 16
_Static_assert(WKV_FWD_BLOCK % 2 == 0, "forward_head's sa pair must swap back");

/* RX_OK, or RX_EINVAL naming the NULL input or the size below 1 */
static int wkv7_args(const char *fn, const float *r, const float *w, const float *k,
                     const float *v, const float *a, const float *b, int B, int T, int H, int N) {
    const char *nul = rx_first_null(RX_NULLS(r, w, k, v, a, b),
                                    RX_NAMES("r", "w", "k", "v", "a", "b"), 6);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (B < 1 || T < 1 || H < 1 || N < 1)
        return rx_fail(RX_EINVAL, "%s: B = %d, T = %d, n_head = %d, head_size = %d must be >= 1",
                       fn, B, T, H, N);
    return RX_OK;
}

/* The inputs r..b (and dy: NULL in the forward) [B][T][H][N] and s_init
 * [B][H][N][N] in in, each with its name */
static void wkv7_in_spans(rx_spans *in, const float *r, const float *w, const float *k,
                          const float *v, const float *a, const float *b, const float *dy,
                          const float *s_init, size_t BTC, size_t BHNN) {
    const float *const p[7] = {r, w, k, v, a, b, dy};
    static const char *const name[7] = {"r", "w", "k", "v", "a", "b", "dy"};
    for (int i = 0; i < 7; i++) RX_SPAN_ADD(in, name[i], p[i], BTC);
    RX_SPAN_ADD(in, "s_init", s_init, BHNN);
}

/* Splitting a head. Every row i of the state (a value index) evolves on
 * its own: S[i] <- S[i] diag(w) + (S[i].a) b^T + v[i] k^T, y[i] = S[i].r,
 * and the backward's dS[i], dv[i] and dsa[i] stay in row i too; only the
 * column sums dr, dw, dk, da, db add over rows. So when B*H heads are too
 * few for the team, the vectorised kernels give each thread a tile of
 * WKV_BACK_ROWS rows of a head instead of a whole head. A tile's column
 * sums go to a scratch row (the first tile's straight to the output) and
 * are added afterwards, tile by tile in row order: exactly the additions
 * the unsplit kernel makes as it walks the tiles, so a split head gives the
 * same bits and results stay independent of the thread count. The forward
 * needs no scratch; the backward's is 5 (T + 1) N floats per extra tile
 * (the calling thread's RX_BUF_WKV_PART, grown once), taken only when
 * splitting shortens the pass. */

/* Units per head: 1, or its G row tiles when the team finishes sooner that
 * way. A split costs work: on one Sapphire Rapids core (T = 512, N = 64,
 * the tiles run one after another), a split backward took 1.22x (B*H = 1)
 * to 1.48x (B*H = 4 and 8: its scratch past L2) the time of the whole
 * heads, the forward 1.01-1.19x. So split only when
 * WKV_SPLIT_COST * ceil(BH*G/nt) tile rounds beat G * ceil(BH/nt): B*H = 1
 * at 2 threads or more, B*H = 32 at 64. */
#define WKV_SPLIT_COST_NUM 8   /* WKV_SPLIT_COST = 1.6 */
#define WKV_SPLIT_COST_DEN 5
/* And not for short sequences, whose heads take little more than a fork
 * of the team: the backward from 64 steps, the forward (a quarter of the
 * work) from 1024 (at B*H = 1, T = 512, 2 threads, the split forward took
 * 1.3x the whole head's time on the Sapphire Rapids VM, at T = 4096
 * 0.92-1.10x). */
#define WKV_SPLIT_MIN_T_BWD 64
#define WKV_SPLIT_MIN_T_FWD 1024
static size_t wkv7_units_per_head(const wkv_simd *fast, size_t BH, size_t TT, size_t min_t,
                                  size_t N, int nt) {
    const size_t G = (N + WKV_BACK_ROWS - 1) / WKV_BACK_ROWS, t = (size_t)nt;
    if (!fast || nt < 2 || G < 2 || TT < min_t) return 1;
    return WKV_SPLIT_COST_NUM * ((BH * G + t - 1) / t) <
                   WKV_SPLIT_COST_DEN * G * ((BH + t - 1) / t)
               ? G
               : 1;
}

/* Rows [i0, i0+R) of one (b, h) of the forward over [B][T][H][N] rows,
 * steps [t0, t1): S [N][N] (those rows) enters as the state before step t0
 * and leaves as the state after step t1 - 1; y_out (NULL: not wanted); cpb
 * [ceil(T/RX_WKV7_CHUNK)][N][N] receives those rows of the checkpoints
 * (NULL: not kept); sa [2][N] scratch (those entries), which carries the
 * next step's sa from one range to the next (t1 - t0 even, but for the
 * last range). The portable step takes whole heads only (i0 = 0, R = N). */
static void forward_head(const float *r, const float *w, const float *k, const float *v,
                         const float *a, const float *b, float *y_out, float *S, float *cpb,
                         float *sa, size_t bi, size_t h, size_t i0, size_t R, size_t t0,
                         size_t t1, size_t TT, size_t C, size_t N, const wkv_simd *fast) {
    const size_t NN = N * N;
    float *san = sa + N + i0;
    const float *cols[5] = {r, w, k, a, b}, *rows[2] = {v, y_out};
    S += i0 * N;
    sa += i0;
#define OFF(t) ((bi * TT + (t)) * C + h * N)
    if (fast && t0 == 0) fast->rowdots(S, a + OFF(0), sa, R, N);
    for (size_t t = t0; t < t1; t++) {
        size_t o = OFF(t);
        float *y = y_out ? y_out + o + i0 : NULL;
        if (cpb && t % RX_WKV7_CHUNK == 0)
            memcpy(cpb + t / RX_WKV7_CHUNK * NN + i0 * N, S, R * N * sizeof(float));
        if (t + WKV_AHEAD < TT) {
            prefetch_rows(cols, 5, o + WKV_AHEAD * C, N);
            prefetch_rows(rows, y_out ? 2 : 1, o + WKV_AHEAD * C + i0, R);
        }
        if (fast) {
            fast->step(S, S, r + o, w + o, k + o, v + o + i0, b + o, sa,
                       t + 1 < TT ? a + OFF(t + 1) : NULL, y, san, R, N);
            float *tmp = sa;
            sa = san;
            san = tmp;
            continue;
        }
        wkv7_step(S, r + o, w + o, k + o, v + o, a + o, b + o, y, N);
    }
#undef OFF
}

size_t rx_wkv7_slots(size_t BH) {
    /* the CPUs at the first call, kept (the first of racing callers wins):
     * every later sizing agrees */
    static int procs;
    int n = __atomic_load_n(&procs, __ATOMIC_ACQUIRE);
    if (!n) {
        int first = 0;
#ifdef _OPENMP
        n = omp_get_num_procs();
#endif
        if (n < 1) n = 1;
        if (!__atomic_compare_exchange_n(&procs, &first, n, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            n = first;
    }
    return BH < (size_t)n ? BH : (size_t)n;
}

size_t rx_wkv7_work_floats(size_t BH, size_t N) {
    return BH * RX_WKV7_FWD_WORK(N) + rx_wkv7_slots(BH) * RX_WKV7_BWD_WORK(N);
}

/* r..b, y_out: [B][T][H][N]; s_init, s_final: [B][H][N][N]; cp as in
 * rx_internal.h; work [B*H][wstride >= RX_WKV7_FWD_WORK(N)] (NULL: one slot
 * per thread allocated here) */
static int wkv7_forward(const float *r, const float *w, const float *k, const float *v,
                        const float *a, const float *b, const float *s_init, float *y_out,
                        float *s_final, float *cp, float *work, size_t wstride, int B, int T,
                        int n_head, int head_size) {
    int rc = wkv7_args("rx_wkv7_forward", r, w, k, v, a, b, B, T, n_head, head_size);
    if (rc != RX_OK) return rc;
    const size_t H = (size_t)n_head, N = (size_t)head_size, NN = N * N;
    const size_t BH = (size_t)B * H, TT = (size_t)T;
    rx_spans in = {.n = 0}, out = {.n = 0};
    /* s_final may be s_init itself: each head copies nothing then */
    wkv7_in_spans(&in, r, w, k, v, a, b, NULL, s_init == s_final ? NULL : s_init, BH * TT * N,
                  BH * NN);
    RX_SPAN_ADD(&out, "y_out", y_out, BH * TT * N);
    RX_SPAN_ADD(&out, "s_final", s_final, BH * NN);
    rc = rx_spans_check("rx_wkv7_forward", &out, &in);
    if (rc != RX_OK) return rc;
    const size_t ncp = (TT + RX_WKV7_CHUNK - 1) / RX_WKV7_CHUNK;
    const wkv_simd *fast = wkv7_simd(N);
    int nt = rx_in_parallel() ? 1 : rx_max_threads();
    const size_t G = wkv7_units_per_head(fast, BH, TT, WKV_SPLIT_MIN_T_FWD, N, nt);
    const size_t RT = G > 1 ? WKV_BACK_ROWS : N;
    if ((size_t)nt > BH * G) nt = (int)(BH * G);
    /* whole heads run in lockstep (below), each with its own scratch */
    const int lockstep = G == 1;
    float *own = NULL;
    if (!work) {
        wstride = RX_WKV7_FWD_WORK(N);
        work = own = rx_falloc((lockstep ? BH : (size_t)nt) * wstride);
        if (!own) return rx_fail(RX_ENOMEM, "rx_wkv7_forward: out of memory");
    }
    rx_prof_push(RX_PROF_WKV7);
    if (lockstep) {
        /* Each thread takes a contiguous group of heads and runs them
         * WKV_FWD_BLOCK steps at a time, head after head. A head's rows are
         * N floats of every C, and the hardware prefetchers fetch the rest
         * of each row's lines too: run a whole head alone and those lines
         * are fetched again for every head (8 heads, 2 threads: the
         * forward took 1.75x the time of heads in separate arrays); in
         * lockstep the group uses them while they are in L2. */
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
            const size_t p = (size_t)rx_thread_id(), n = (size_t)rx_team_size();
            const size_t h0 = BH * p / n, h1 = BH * (p + 1) / n;
            for (size_t bh = h0; bh < h1; bh++) {
                float *S = s_final ? s_final + bh * NN : work + bh * wstride;
                if (!s_init) memset(S, 0, NN * sizeof(float));
                else if (S != s_init + bh * NN) memcpy(S, s_init + bh * NN, NN * sizeof(float));
            }
            for (size_t t0 = 0; t0 < TT; t0 += WKV_FWD_BLOCK) {
                const size_t t1 = t0 + WKV_FWD_BLOCK < TT ? t0 + WKV_FWD_BLOCK : TT;
                for (size_t bh = h0; bh < h1; bh++) {
                    float *wk = work + bh * wstride, *S = s_final ? s_final + bh * NN : wk;
                    forward_head(r, w, k, v, a, b, y_out, S, cp ? cp + bh * ncp * NN : NULL,
                                 wk + NN, bh / H, bh % H, 0, N, t0, t1, TT, H * N, N, fast);
                }
            }
        }
    } else {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
        for (size_t u = 0; u < BH * G; u++) {
            size_t bh = u / G, i0 = u % G * RT, R = N - i0 < RT ? N - i0 : RT;
            float *wk = work + (own ? (size_t)rx_thread_id() : bh) * wstride;
            float *S = s_final ? s_final + bh * NN : wk;
            if (!s_init) memset(S + i0 * N, 0, R * N * sizeof(float));
            else if (S != s_init + bh * NN)
                memcpy(S + i0 * N, s_init + bh * NN + i0 * N, R * N * sizeof(float));
            forward_head(r, w, k, v, a, b, y_out, S, cp ? cp + bh * ncp * NN : NULL, wk + NN,
                         bh / H, bh % H, i0, R, 0, TT, TT, H * N, N, fast);
        }
    }
    rx_prof_pop();
    free(own);
    return RX_OK;
}

/* r..b, y_out: [B][T][H][N]; s_init, s_final: [B][H][N][N] */
int rx_wkv7_forward_seq(const float *r, const float *w, const float *k, const float *v,
                        const float *a, const float *b, const float *s_init,
                        float *y_out, float *s_final, int B, int T, int n_head, int head_size) {
    return wkv7_forward(r, w, k, v, a, b, s_init, y_out, s_final, NULL, NULL, 0, B, T, n_head,
                        head_size);
}

/* As rx_wkv7_forward_seq, also keeping the checkpoints cp; work
 * [rx_wkv7_work_floats(B*H, N)] */
int rx_wkv7_forward_cp(const float *r, const float *w, const float *k, const float *v,
                       const float *a, const float *b, const float *s_init, float *y_out,
                       float *s_final, float *cp, float *work, int B, int T, int n_head,
                       int head_size) {
    return wkv7_forward(r, w, k, v, a, b, s_init, y_out, s_final, cp, work,
                        work ? RX_WKV7_FWD_WORK((size_t)head_size) : 0, B, T, n_head,
                        head_size);
}

/* Unit u = (sequence u / H, head u % H) of a step laid out as sq says:
 * its first row and its row count */
static void seqs_unit(const rx_seqs *sq, size_t H, size_t u, size_t *o, size_t *T) {
    const size_t bi = u / H;
    *o = sq->off ? (size_t)sq->off[bi] : bi * sq->T;
    *T = sq->off ? (size_t)sq->off[bi + 1] - *o : sq->T;
}

/* Below this many state-row updates (rows * H * N, each N multiply-adds)
 * a step's WKV runs on the calling thread: a decoding step of a few slots
 * takes microseconds, less than waking the team (and far less on a busy
 * machine, where a team member may not be running) */
#define WKV_SEQS_MIN_PAR ((size_t)4096)

/* r..b, y_out: [rows][H][N] laid out as sq says; state: [slots][H][N][N]
 * (rx_internal.h); work: RX_WKV7_SEQS_WORK(B*H, N). Each (sequence, head)
 * is a unit run in place by forward_head; as in wkv7_forward, each thread
 * takes a contiguous group of units and runs them WKV_FWD_BLOCK steps at
 * a time, unit after unit (their rows shared in L2). The groups split the
 * rows, not the units, evenly: a prompt's units beside single tokens. */
int rx_wkv7_forward_seqs(const float *r, const float *w, const float *k, const float *v,
                         const float *a, const float *b, float *state, float *y_out,
                         const rx_seqs *sq, int n_head, int head_size, float *work) {
    int rc = wkv7_args("rx_wkv7_forward_seqs", r, w, k, v, a, b, 1, 1, n_head, head_size);
    if (rc != RX_OK) return rc;
    if (!state || !y_out || !sq || !work)
        return rx_fail(RX_EINVAL, "rx_wkv7_forward_seqs: state, y_out, sq or work is NULL");
    const size_t H = (size_t)n_head, N = (size_t)head_size, C = H * N, NN = N * N;
    const size_t BH = sq->B * H, rows = rx_seqs_rows(sq);
    const wkv_simd *fast = wkv7_simd(N);
    int nt = rx_in_parallel() || rows * C < WKV_SEQS_MIN_PAR ? 1 : rx_max_threads();
    if ((size_t)nt > BH) nt = (int)BH;
    rx_prof_push(RX_PROF_WKV7);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const size_t p = (size_t)rx_thread_id(), n = (size_t)rx_team_size();
        /* units [u0, u1): those whose first row (of rows * H in all) lies in
         * this thread's share */
        size_t u0 = 0, u1 = 0, at = 0, tmax = 0;
        const size_t lo = rows * H * p / n, hi = rows * H * (p + 1) / n;
        for (size_t u = 0; u < BH; u++) {
            size_t o, T;
            seqs_unit(sq, H, u, &o, &T);
            if (at < lo) u0 = u + 1;
            if (at < hi) u1 = u + 1;
            at += T;
        }
        for (size_t u = u0; u < u1; u++) {
            size_t o, T;
            seqs_unit(sq, H, u, &o, &T);
            if (T > tmax) tmax = T;
        }
        for (size_t t0 = 0; t0 < tmax; t0 += WKV_FWD_BLOCK)
            for (size_t u = u0; u < u1; u++) {
                size_t o, T;
                seqs_unit(sq, H, u, &o, &T);
                if (t0 >= T) continue;
                const size_t t1 = t0 + WKV_FWD_BLOCK < T ? t0 + WKV_FWD_BLOCK : T, oc = o * C;
                float *S = state + (rx_seqs_slot(sq, u / H) * H + u % H) * NN;
                forward_head(r + oc, w + oc, k + oc, v + oc, a + oc, b + oc, y_out + oc, S,
                             NULL, work + u * 2 * N, 0, u % H, 0, N, t0, t1, T, C, N, fast);
            }
    }
    rx_prof_pop();
    return RX_OK;
}

/* The column sums of a split backward: the outputs dr, dw, dk, da, db in
 * that order, and the extra tiles' scratch part [G-1][5][BH][T+1][N], whose
 * row t+1 holds a tile's sum for the output row of step t (row 0: the dr
 * "of step -1" that a sequence's first step computes and nobody reads). */
enum { WKV_DR, WKV_DW, WKV_DK, WKV_DA, WKV_DB, WKV_NCOL };
typedef struct {
    float *out[WKV_NCOL], *part;
    size_t BH, TT, C, H, N;
} wkv_cols;

/* Tile g > 0's scratch row for column sum q of head bh at step -1. */
static inline float *part_row(const wkv_cols *c, size_t g, size_t q, size_t bh) {
    return c->part + (((g - 1) * WKV_NCOL + q) * c->BH + bh) * (c->TT + 1) * c->N;
}

/* out += each extra tile's sums, tile by tile: the unsplit kernel's order. */
static void add_tile_sums(const wkv_cols *c, size_t G) {
    const size_t n = WKV_NCOL * c->BH * c->TT, N = c->N;
#pragma omp parallel for schedule(static) if (!rx_in_parallel() && n * N >= RX_EW_MIN_PAR)
    for (size_t e = 0; e < n; e++) {
        size_t q = e / (c->BH * c->TT), bh = e / c->TT % c->BH, t = e % c->TT;
        float *restrict o = c->out[q] + (bh / c->H * c->TT + t) * c->C + bh % c->H * N;
        for (size_t g = 1; g < G; g++) {
            const float *restrict p = part_row(c, g, q, bh) + (t + 1) * N;
#pragma omp simd
            for (size_t j = 0; j < N; j++) o[j] += p[j];
        }
    }
}

/* r..b, dy, dr..db: [B][T][H][N]; s_init, dS_out: [B][H][N][N]; cp, work as
 * in rx_internal.h */
int rx_wkv7_backward_cp(const float *r, const float *w, const float *k, const float *v,
                        const float *a, const float *b, const float *dy, const float *s_init,
                        const float *cp, float *work, float *dr, float *dw, float *dk,
                        float *dv, float *da, float *db, float *dS_out, int B, int T,
                        int n_head, int head_size) {
    static const char *const fn = "rx_wkv7_backward";
    int rc = wkv7_args(fn, r, w, k, v, a, b, B, T, n_head, head_size);
    if (rc != RX_OK) return rc;
    const char *nul = rx_first_null(RX_NULLS(dy, dr, dw, dk, dv, da, db),
                                    RX_NAMES("dy", "dr", "dw", "dk", "dv", "da", "db"), 7);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    const size_t H = (size_t)n_head, N = (size_t)head_size, C = H * N, NN = N * N;
    const size_t BH = (size_t)B * H, TT = (size_t)T;
    rx_spans in = {.n = 0}, out = {.n = 0};
    wkv7_in_spans(&in, r, w, k, v, a, b, dy, s_init, BH * TT * N, BH * NN);
    float *const o[7] = {dr, dw, dk, dv, da, db, dS_out};
    static const char *const oname[7] = {"dr", "dw", "dk", "dv", "da", "db", "dS_out"};
    for (int i = 0; i < 7; i++) RX_SPAN_ADD(&out, oname[i], o[i], i < 6 ? BH * TT * N : BH * NN);
    rc = rx_spans_check(fn, &out, &in);
    if (rc != RX_OK) return rc;
    const size_t ncp = (TT + RX_WKV7_CHUNK - 1) / RX_WKV7_CHUNK;
    const size_t per = RX_WKV7_BWD_WORK(N);
    const wkv_simd *fast = wkv7_simd(N);
    int nt = rx_in_parallel() ? 1 : rx_max_threads();
    size_t G = wkv7_units_per_head(fast, BH, TT, WKV_SPLIT_MIN_T_BWD, N, nt);
    wkv_cols cols = {{dr, dw, dk, da, db}, NULL, BH, TT, C, H, N};
    if (G > 1) {
        /* no scratch (out of memory): whole heads, the same result */
        size_t n = (G - 1) * WKV_NCOL * BH * (TT + 1) * N;
        cols.part = n <= SIZE_MAX / sizeof(float) ? rx_thread_buffer(RX_BUF_WKV_PART,
                                                                     n * sizeof(float))
                                                  : NULL;
        if (!cols.part) G = 1;
    }
    const size_t RT = G > 1 ? WKV_BACK_ROWS : N;
    if ((size_t)nt > BH * G) nt = (int)(BH * G);
    /* the caller's scratch has rx_wkv7_slots threads' chunks after the
     * forward's part: more threads than that (set after it was sized) run
     * in fewer, to the same bits */
    if (work && (size_t)nt > rx_wkv7_slots(BH)) nt = (int)rx_wkv7_slots(BH);
    /* standalone: scratch and checkpoints per thread, each head's made by
     * its own forward just before its backward */
    float *own = work ? NULL : rx_falloc((size_t)nt * per);
    float *chunks = work ? work + BH * RX_WKV7_FWD_WORK(N) : own;
    float *own_cp = cp ? NULL : rx_falloc((size_t)nt * ncp * NN);
    if ((!work && !own) || (!cp && !own_cp)) {
        free(own);
        free(own_cp);
        return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    }
    rx_prof_push(RX_PROF_WKV7);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (size_t u = 0; u < BH * G; u++) {
        size_t bh = u / G, g = u % G, bi = bh / H, h = bh % H, tid = (size_t)rx_thread_id();
        size_t i0 = g * RT, R = N - i0 < RT ? N - i0 : RT;
        /* buf [RX_WKV7_CHUNK][N][N]: the state after each step of a chunk;
         * dS [N][N]; sab [RX_WKV7_CHUNK + 1][N]: each step's sa; dsa, and a
         * zero dy and a discarded dr for the step before a sequence [N];
         * a tile uses its rows of each (the discarded dr: tile 0's only) */
        float *buf = chunks + tid * per, *dS = buf + RX_WKV7_CHUNK * NN;
        float *sab = dS + NN, *dsa = sab + (RX_WKV7_CHUNK + 1) * N, *zero = dsa + N;
        /* this tile's column sums: step t's at cb[q] + t*cs (tile 0: the
         * outputs, and step -1's dr into junk; the others: scratch rows) */
        float *junk = zero + N, *cb[WKV_NCOL];
        const ptrdiff_t cs = g ? (ptrdiff_t)N : (ptrdiff_t)C;
        for (size_t q = 0; q < WKV_NCOL; q++)
            cb[q] = g ? part_row(&cols, g, q, bh) + N : cols.out[q] + (bi * TT * C + h * N);
        const float *cpb = own_cp ? own_cp + tid * ncp * NN : cp + bh * ncp * NN;
        if (own_cp) {
            if (s_init) memcpy(buf + i0 * N, s_init + bh * NN + i0 * N, R * N * sizeof(float));
            else memset(buf + i0 * N, 0, R * N * sizeof(float));
            forward_head(r, w, k, v, a, b, NULL, buf, own_cp + tid * ncp * NN, sab, bi, h, i0, R,
                         0, TT, TT, C, N, fast);
        }
        buf += i0 * N;
        dS += i0 * N;
        sab += i0;
        dsa += i0;
        zero += i0;
        cpb += i0 * N;
#define OFF(t) ((bi * TT + (t)) * C + h * N)
#define COL(q, t) (g == 0 && (ptrdiff_t)(t) < 0 ? junk : cb[q] + (ptrdiff_t)(t) * cs)
        const float *cols[5] = {w, k, a, b, r}, *rows[3] = {v, dy, dv};
        const float *outs[WKV_NCOL] = {dr, dw, dk, da, db};
        memset(dS, 0, R * N * sizeof(float));
        memset(zero, 0, R * sizeof(float));
        for (size_t c = ncp; c-- > 0;) {
            size_t t0 = c * RX_WKV7_CHUNK, t1 = t0 + RX_WKV7_CHUNK < TT ? t0 + RX_WKV7_CHUNK : TT;
            const float *Sc = cpb + c * NN;
#define STATE(t) ((t) > t0 ? buf + ((t) - t0 - 1) * NN : Sc) /* state entering step t */
            if (fast) fast->rowdots(Sc, a + OFF(t0), sab, R, N);
            for (size_t t = t0; t < t1; t++) {
                float *Sn = buf + (t - t0) * NN;
                size_t o = OFF(t);
                if (t + WKV_AHEAD < t1) {
                    prefetch_rows(cols, 4, o + WKV_AHEAD * C, N);
                    prefetch_rows(rows, 1, o + WKV_AHEAD * C + i0, R);
                }
                if (fast) {
                    fast->step(STATE(t), Sn, NULL, w + o, k + o, v + o + i0, b + o,
                               sab + (t - t0) * N, t + 1 < t1 ? a + OFF(t + 1) : NULL, NULL,
                               sab + (t - t0 + 1) * N, R, N);
                    continue;
                }
                memcpy(Sn, STATE(t), NN * sizeof(float));
                wkv7_step(Sn, r + o, w + o, k + o, v + o, a + o, b + o, NULL, N);
            }
            if (fast && t1 == TT)
                fast->coldots(STATE(TT), dy + OFF(TT - 1) + i0, COL(WKV_DR, TT - 1), R, N);
            for (size_t t = t1; t-- > t0;) {
                size_t o = OFF(t);
                /* (a tile > 0 writes its sums to scratch rows, which the
                 * prefetchers follow) */
                if (t >= t0 + WKV_AHEAD) {
                    prefetch_rows(cols, 5, o - WKV_AHEAD * C, N);
                    prefetch_rows(rows, 3, o - WKV_AHEAD * C + i0, R);
                    if (g == 0) prefetch_rows(outs, WKV_NCOL, o - WKV_AHEAD * C, N);
                }
                /* and a chunk's share of the checkpoint the next chunk starts from */
                const size_t part = R * N / RX_WKV7_CHUNK;
                if (c > 0)
                    for (size_t q = 0; q < part; q += 16)
                        __builtin_prefetch(cpb + (c - 1) * NN + (t1 - 1 - t) * part + q);
                if (fast) {
                    fast->step_back(STATE(t), dS, r + o, w + o, k + o, v + o + i0, a + o, b + o,
                                    dy + o + i0, t > 0 ? dy + o - C + i0 : zero,
                                    sab + (t - t0) * N, dsa, COL(WKV_DR, (ptrdiff_t)t - 1),
                                    COL(WKV_DW, t), COL(WKV_DK, t), dv + o + i0, COL(WKV_DA, t),
                                    COL(WKV_DB, t), R, N);
                    continue;
                }
                wkv7_step_back(STATE(t), STATE(t + 1), dS, r + o, w + o, k + o, v + o, a + o,
                               b + o, dy + o, dr + o, dw + o, dk + o, dv + o, da + o, db + o, N);
            }
#undef STATE
        }
        if (dS_out) memcpy(dS_out + bh * NN + i0 * N, dS, R * N * sizeof(float));
#undef COL
#undef OFF
    }
    if (G > 1) add_tile_sums(&cols, G);
    rx_prof_pop();
    free(own);
    free(own_cp);
    return RX_OK;
}

/* r..b, dy, dr..db: [B][T][H][N]; s_init, dS_out: [B][H][N][N] */
int rx_wkv7_backward(const float *r, const float *w, const float *k, const float *v,
                     const float *a, const float *b, const float *dy, const float *s_init,
                     float *dr, float *dw, float *dk, float *dv, float *da, float *db,
                     float *dS_out, int B, int T, int n_head, int head_size) {
    return rx_wkv7_backward_cp(r, w, k, v, a, b, dy, s_init, NULL, NULL, dr, dw, dk, dv, da, db,
                               dS_out, B, T, n_head, head_size);
}
