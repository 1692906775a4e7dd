/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * base_fast.c -- the fast decode's products over a Q8_0 or Q4_0 frozen base
 * (rx_gemm_set_fast, docs/training.md §Fast decode): each row of the
 * activations quantised alone to Q8_0-like blocks, integer dot products
 * with the stored blocks, as llama.cpp's vec_dot_type does. Not the exact
 * path's arithmetic (that one multiplies the float32 activations by the
 * decoded weights), but still a function of each row alone, whatever the
 * batch, the column cut or the thread count. For row i, column j, block b
 * of 32 k (docs/training.md §Fast decode; tests/test_base_fast.py holds its
 * float64 reference):
 *
 *     amax = max |x[i, 32b .. 32b+31]|       (NaN if one is NaN)
 *     dx   = amax / 127                      float32
 *     qx   = rint(x * (dx ? 1 / dx : 0))     float32 product, nearest even
 *     isum = sum qw[j, 32b + t] qx[t]        exact, in int32
 *     s    = dw[j, b] * dx                   float32
 *     acc  = acc + s * (float)isum           two float32 roundings
 *
 * acc from zero over the blocks in order, then C = acc (beta 0) or C + acc.
 * The AVX2 kernel and the portable one compute exactly these operations
 * (no fused multiply-add: neither is compiled to contract them), so they
 * give the same bits.
 */
#include <math.h>

#include "rx_base.h"
#include "rx_simd.h"

#define QBLK 32              /* values a block, of x as of the weights */
#define FAST_KMAX 16384      /* the widest K (the quantised rows' stack buffer) */
#define FAST_ROWS 4          /* rows quantised and multiplied at once */
#define FAST_GROUP 8         /* columns of one AVX2 accumulator */

int rx_base_fast_ok(const void *src, const rx_gemm_op *g) {
    const rx_base_mat *b = src;
    return b && !b->packed && !b->rows && !g->ta && !g->tb && g->K % QBLK == 0 &&
           g->K <= FAST_KMAX && (b->ty->id == RX_BASE_Q8_0 || b->ty->id == RX_BASE_Q4_0);
}

/* row x [K] into qx [K] int8 and dx [K/32] scales, as the header says */
RX_NO_CONTRACT static void quantise_row(const float *x, size_t K, int8_t *qx, float *dx) {
    for (size_t b = 0; b < K / QBLK; b++) {
        const float *v = x + b * QBLK;
        float amax = 0.0f;
        int nan = 0;
        for (size_t t = 0; t < QBLK; t++) {
            nan |= isnan(v[t]);
            amax = fmaxf(amax, fabsf(v[t]));
        }
        const float d = nan ? NAN : amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        dx[b] = d;
        for (size_t t = 0; t < QBLK; t++) {
            const float q = rintf(v[t] * id);
            /* a q past int8 (a scale 1 / d overflowed) or NaN (x or d not
             * finite: s then carries the NaN or infinity) counts 0 */
            qx[b * QBLK + t] = (int8_t)(fabsf(q) <= 127.0f ? (int)q : 0);
        }
    }
}

/* stored block b of row j: its 32 q as int8 (Q4_0: nibble - 8), its scale */
static float weight_block(const rx_base_mat *bm, size_t rb, size_t j, size_t b, int8_t q[QBLK]) {
    const unsigned char *blk = bm->data + j * rb + b * bm->ty->blk_bytes;
    uint16_t dh;
    memcpy(&dh, blk, 2);
    if (bm->ty->id == RX_BASE_Q8_0) {
        memcpy(q, blk + 2, QBLK);
    } else {
        for (size_t t = 0; t < QBLK / 2; t++) {
            q[t] = (int8_t)((blk[2 + t] & 0x0f) - 8);
            q[t + QBLK / 2] = (int8_t)((blk[2 + t] >> 4) - 8);
        }
    }
    return f16_f32(dh);
}

/* C[i][j0, j1) for the R quantised rows (portable) */
RX_NO_CONTRACT static void fast_cols_c(const rx_base_mat *bm, const rx_gemm_op *g, size_t i0,
                                       size_t R, const int8_t *qx, const float *dx, size_t j0,
                                       size_t j1) {
    const size_t K = g->K, nb = K / QBLK, rb = rx_base_type_row_bytes(bm->ty, K);
    int8_t q[QBLK];
    for (size_t j = j0; j < j1; j++) {
        float acc[FAST_ROWS] = {0};
        for (size_t b = 0; b < nb; b++) {
            const float dw = weight_block(bm, rb, j, b, q);
            for (size_t r = 0; r < R; r++) {
                const int8_t *x = qx + r * K + b * QBLK;
                int32_t isum = 0;
                for (size_t t = 0; t < QBLK; t++) isum += (int32_t)q[t] * x[t];
                const float s = dw * dx[r * nb + b];
                const float p = s * (float)isum;
                acc[r] = acc[r] + p;
            }
        }
        for (size_t r = 0; r < R; r++) {
            float *c = g->C + (i0 + r) * g->ldc + j;
            *c = g->beta != 0.0f ? *c + acc[r] : acc[r];
        }
    }
}

#ifdef RX_BASE_X86
/* a Q8_0 block's q as they are; a Q4_0 block's nibbles made bytes q - 8
 * (k 0..15 the low nibbles, 16..31 the high) */
RX_BASE_AVX2 static inline __m256i fast_q(int q4, const unsigned char *q) {
    if (!q4) return _mm256_loadu_si256((const __m256i *)(const void *)q);
    const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)q), low = _mm_set1_epi8(0x0f);
    return _mm256_sub_epi8(
        _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low)),
        _mm256_set1_epi8(8));
}

/* The 8 columns [j, j+8) for R quantised rows: per block, each column's 32
 * products summed exactly (vpmaddubsw of |q| and x with q's sign, pairs of
 * int16 at most 2 * 128 * 127, then vpmaddwd), the 8 columns' sums reduced
 * to one vector (vphaddd), converted, then scaled and added as the
 * portable kernel does, lane by lane. No FMA in this target: no
 * contraction. */
RX_BASE_AVX2 static inline __attribute__((always_inline)) void
fast_group(int q4, size_t R, const rx_base_mat *bm, size_t rb, const rx_gemm_op *g, size_t i0,
           const int8_t *qx, const float *dx, size_t j, const char *pf, size_t pf_step,
           const char *pf_end) {
    const size_t K = g->K, nb = K / QBLK, bb = bm->ty->blk_bytes;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[FAST_ROWS];
    for (size_t r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const unsigned char *row0 = bm->data + j * rb;
    for (size_t b = 0; b < nb; b++) {
        __m256i w[FAST_GROUP];
        uint16_t dh[FAST_GROUP];
        for (int c = 0; c < FAST_GROUP; c++) {
            const unsigned char *blk = row0 + c * rb + b * bb;
            memcpy(&dh[c], blk, 2);
            w[c] = fast_q(q4, blk + 2);
        }
        for (const char *e = pf + pf_step; pf < e && pf < pf_end; pf += 64)
            _mm_prefetch(pf, _MM_HINT_T0);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)dh));
        for (size_t r = 0; r < R; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(const void *)(qx + r * K +
                                                                                 b * QBLK));
            __m256i p[FAST_GROUP];
            for (int c = 0; c < FAST_GROUP; c++)
                p[c] = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(_mm256_abs_epi8(w[c]), _mm256_sign_epi8(x, w[c])), ones);
            /* lane c of the result: column c's 32 products, summed */
            const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
            const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
            const __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);
            const __m256i isum = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                                                  _mm256_permute2x128_si256(lo, hi, 0x31));
            const __m256 s = _mm256_mul_ps(dw, _mm256_set1_ps(dx[r * nb + b]));
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(s, _mm256_cvtepi32_ps(isum)));
        }
    }
    for (size_t r = 0; r < R; r++) {
        float *c = g->C + (i0 + r) * g->ldc + j;
        _mm256_storeu_ps(c, g->beta != 0.0f ? _mm256_add_ps(_mm256_loadu_ps(c), acc[r]) : acc[r]);
    }
}

/* fast_cols_c's columns, whole groups of 8 here; returns the columns done */
RX_BASE_AVX2 static size_t fast_cols_avx2(const rx_base_mat *bm, const rx_gemm_op *g, size_t i0,
                                          size_t R, const int8_t *qx, const float *dx, size_t j0,
                                          size_t j1) {
    const size_t rb = rx_base_type_row_bytes(bm->ty, g->K), nb = g->K / QBLK;
    const int q4 = bm->ty->id == RX_BASE_Q4_0;
    size_t j = j0;
    for (; j + FAST_GROUP <= j1; j += FAST_GROUP) {
        /* the next group's rows, one contiguous run, a slice a block:
         * eight rows stepping along k are more streams than the hardware
         * prefetchers follow */
        const size_t nj = j + 2 * FAST_GROUP <= j1 ? FAST_GROUP : 0;
        const char *pf = (const char *)bm->data + (j + FAST_GROUP) * rb;
        const size_t step = (nj * rb / nb + 63) / 64 * 64;
        if (q4) fast_group(1, R, bm, rb, g, i0, qx, dx, j, pf, step, pf + nj * rb);
        else fast_group(0, R, bm, rb, g, i0, qx, dx, j, pf, step, pf + nj * rb);
    }
    return j - j0;
}
#endif

/* op g's columns [j0, j1), every row */
static void fast_unit(const rx_base_mat *bm, const rx_gemm_op *g, size_t j0, size_t j1) {
    int8_t qx[FAST_KMAX];   /* as many quantised rows as fit, up to FAST_ROWS */
    float dx[FAST_KMAX / QBLK];
    const size_t K = g->K, per = FAST_KMAX / K < FAST_ROWS ? FAST_KMAX / K : FAST_ROWS;
    for (size_t i = 0; i < g->M; i += per) {
        const size_t R = g->M - i < per ? g->M - i : per;
        for (size_t r = 0; r < R; r++)
            quantise_row(g->A + (i + r) * g->lda, K, qx + r * K, dx + r * (K / QBLK));
        size_t j = j0;
#ifdef RX_BASE_X86
        if (rx_cpu_base_avx2()) j += fast_cols_avx2(bm, g, i, R, qx, dx, j0, j1);
#endif
        fast_cols_c(bm, g, i, R, qx, dx, j, j1);
    }
}

int rx_base_fast_sgemm(const void *src, const rx_gemm_op *g) {
    const rx_base_mat *bm = src;
    int nt = rx_in_parallel() ? 1 : rx_max_threads();
    if ((double)g->M * (double)g->N * (double)g->K < RX_GEMM_MIN_PAR) nt = 1;
    /* two units a thread, whole groups: each unit quantises its rows
     * anew, so a unit is wide against the M x K of that */
    const size_t nu = 2 * (size_t)nt;
    const size_t w = (g->N / nu + FAST_GROUP - 1) / FAST_GROUP * FAST_GROUP;
    rx_prof_push(RX_PROF_GEMM);
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1)
    for (long u = 0; u < (long)nu; u++) {
        const size_t j0 = (size_t)u * w, j1 = u + 1 == (long)nu ? g->N : j0 + w;
        if (j0 < j1 && j0 < g->N) fast_unit(bm, g, j0, j1 < g->N ? j1 : g->N);
    }
    rx_prof_pop();
    return RX_OK;
}
