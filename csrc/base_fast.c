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
 * Each row is quantised once a call. The AVX2 kernels (the stored blocks
 * read in place at one or two rows; from FAST_PANEL_M rows a transposed
 * panel of them), the AVX512-VNNI ones (16 columns a group: in place at
 * one or two rows, a panel from FAST_PANEL_M) and the portable one compute
 * exactly these operations
 * (no fused multiply-add: none is compiled to contract them), so they
 * give the same bits.
 */
#include <math.h>

#include "rx_base.h"
#include "rx_simd.h"

#define QBLK 32              /* values a block, of x as of the weights */
#define FAST_KMAX 16384      /* the widest K */
#define FAST_ROWS 4          /* rows of a tile of the in-place and portable kernels */
#define FAST_GROUP 8         /* columns of one AVX2 accumulator */
/* From this many rows the AVX2 kernel repacks a group's weight blocks once
 * (a panel) and sweeps every row tile over it; fewer rows read the blocks
 * in place. Either gives the same bits. */
#define FAST_PANEL_M 3
#define PANEL_ROWS 3         /* rows of the panel kernel's register tile */
#define FAST_PANEL_UNIT 4    /* groups a parallel unit, from FAST_PANEL_M rows */
#define FAST_STRIPE (128 * 1024)   /* bytes of quantised rows swept a pass */
#define STRIPE_ROWS 24       /* a stripe's rows: a multiple of both panel tiles' */
/* a panel's block: 16 (Q8_0; Q4_0 the first 8) vectors of 32 bytes, then
 * the 8 columns' scales */
#define PANEL_BLK (16 * 32 + FAST_GROUP * 4)

int rx_base_fast_ok(const void *src, const rx_gemm_op *g) {
    const rx_base_mat *b = src;
    return b && !b->packed && !b->rows && !g->ta && !g->tb && g->K % QBLK == 0 &&
           g->K <= FAST_KMAX && (b->ty->id == RX_BASE_Q8_0 || b->ty->id == RX_BASE_Q4_0);
}

/* A call's activation rows, each quantised once (the calling thread's
 * buffer, rx_thread_buffer): row i's K int8 at q + i K, its blocks' scales
 * at d + i nb and their sums of q at sx + i nb (Q4_0's offset of 8) */
typedef struct {
    const int8_t *q;
    const float *d;
    const int32_t *sx;
} fast_rows;

/* row x [K] into qx [K] int8, dx [K/32] scales and sx [K/32] sums of qx,
 * as the header says */
RX_NO_CONTRACT static void quantise_row(const float *x, size_t K, int8_t *qx, float *dx,
                                        int32_t *sx) {
    for (size_t b = 0; b < K / QBLK; b++) {
        const float *v = x + b * QBLK;
        float amax = 0.0f;
        int nan = 0;
        for (size_t t = 0; t < QBLK; t++) {
            nan |= isnan(v[t]);
            amax = fmaxf(amax, fabsf(v[t]));
        }
        const float d = nan ? NAN : amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        dx[b] = d;
        for (size_t t = 0; t < QBLK; t++) {
            const float q = rintf(v[t] * id);
            /* a q past int8 (a scale 1 / d overflowed) or NaN (x or d not
             * finite: s then carries the NaN or infinity) counts 0 */
            qx[b * QBLK + t] = (int8_t)(fabsf(q) <= 127.0f ? (int)q : 0);
            sum += qx[b * QBLK + t];
        }
        sx[b] = sum;
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

/* C[i][j0, j1) for the R <= FAST_ROWS rows from i0 (portable) */
RX_NO_CONTRACT static void fast_cols_c(const rx_base_mat *bm, const rx_gemm_op *g,
                                       const fast_rows *x, size_t i0, size_t R, size_t j0,
                                       size_t j1) {
    const size_t K = g->K, nb = K / QBLK, rb = rx_base_type_row_bytes(bm->ty, K);
    int8_t q[QBLK];
    for (size_t j = j0; j < j1; j++) {
        float acc[FAST_ROWS] = {0};
        for (size_t b = 0; b < nb; b++) {
            const float dw = weight_block(bm, rb, j, b, q);
            for (size_t r = 0; r < R; r++) {
                const int8_t *xq = x->q + (i0 + r) * K + b * QBLK;
                int32_t isum = 0;
                for (size_t t = 0; t < QBLK; t++) isum += (int32_t)q[t] * xq[t];
                const float s = dw * x->d[(i0 + r) * nb + b];
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
/* a Q8_0 block's q as they are; a Q4_0 block's nibbles made bytes, k 0..15
 * the low nibbles, 16..31 the high (less the offset 8 when off8) */
RX_BASE_AVX2 static inline __m256i fast_q(int q4, int off8, const unsigned char *q) {
    if (!q4) return _mm256_loadu_si256((const __m256i *)(const void *)q);
    const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)q), low = _mm_set1_epi8(0x0f);
    const __m256i n =
        _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
    return off8 ? _mm256_sub_epi8(n, _mm256_set1_epi8(8)) : n;
}

/* row tile's float sums [R] of 8 columns into C[i0 .. i0+R)[j .. j+8) */
RX_BASE_AVX2 static inline __attribute__((always_inline)) void
fast_store(const rx_gemm_op *g, size_t i0, size_t R, size_t j, const __m256 *acc) {
    for (size_t r = 0; r < R; r++) {
        float *c = g->C + (i0 + r) * g->ldc + j;
        _mm256_storeu_ps(c, g->beta != 0.0f ? _mm256_add_ps(_mm256_loadu_ps(c), acc[r]) : acc[r]);
    }
}

/* The 8 columns [j, j+8) for R rows from i0, the blocks read in place: per
 * block, each column's 32 products summed exactly (vpmaddubsw of |q| and x
 * with q's sign, pairs of int16 at most 2 * 128 * 127, then vpmaddwd), the
 * 8 columns' sums reduced to one vector (vphaddd), converted, then scaled
 * and added as the portable kernel does, lane by lane. No FMA in this
 * target: no contraction. */
RX_BASE_AVX2 static inline __attribute__((always_inline)) void
fast_group(int q4, size_t R, const rx_base_mat *bm, size_t rb, const rx_gemm_op *g,
           const fast_rows *x, size_t i0, size_t j, const char *pf, size_t pf_step,
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
            w[c] = fast_q(q4, 1, blk + 2);
        }
        for (const char *e = pf + pf_step; pf < e && pf < pf_end; pf += 64)
            _mm_prefetch(pf, RX_PREFETCH_AHEAD);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)dh));
        for (size_t r = 0; r < R; r++) {
            const __m256i xv = _mm256_loadu_si256(
                (const __m256i *)(const void *)(x->q + (i0 + r) * K + b * QBLK));
            __m256i p[FAST_GROUP];
            for (int c = 0; c < FAST_GROUP; c++)
                p[c] = _mm256_madd_epi16(
                    _mm256_maddubs_epi16(_mm256_abs_epi8(w[c]), _mm256_sign_epi8(xv, w[c])),
                    ones);
            /* lane c of the result: column c's 32 products, summed */
            const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
            const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
            const __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);
            const __m256i isum = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                                                  _mm256_permute2x128_si256(lo, hi, 0x31));
            const __m256 s = _mm256_mul_ps(dw, _mm256_set1_ps(x->d[(i0 + r) * nb + b]));
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(s, _mm256_cvtepi32_ps(isum)));
        }
    }
    fast_store(g, i0, R, j, acc);
}

/* ---- AVX512-VNNI: 16 columns read in place -------------------------------
 * fast_group's sums over 16 columns with vpdpbusd (unsigned bytes times
 * signed bytes, 4 products a lane): two columns' blocks side by side in a
 * 512-bit vector, times the row's block of x in both halves. Q8_0: |q|
 * times x with q's sign (x at most 127 in magnitude: -x fits); Q4_0: the
 * nibbles times x, less 8 sx. Each lane sums 4 exact products (at most 4
 * 128 127), and the 8 pairs' vectors are reduced to one lane a column
 * (FAST_LANE order), so every column's isum is fast_group's exact integer;
 * the scales are gathered in the same order and the float ops are the
 * portable kernel's, lane by lane: the same bits. */
/* AVX-512 has FMA: no contraction of the scale's product into the add */
#define RX_FAST512 \
    __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,f16c"), optimize("fp-contract=off")))
#define FAST_WIDE 16   /* columns of the AVX-512 group */

/* the column of lane l after fast_sums512's reduction */
static const unsigned char FAST_LANE[FAST_WIDE] = {0, 2, 4, 6, 1, 3, 5, 7,
                                                   8, 10, 12, 14, 9, 11, 13, 15};

/* d[p] (p < 8: lanes 0-7 column 2p's partial sums, 8-15 column 2p+1's)
 * summed into one lane a column, in FAST_LANE order */
RX_FAST512 static inline __m512i fast_sums512(const __m512i d[8]) {
    __m512i e[4], f[2];
    for (int p = 0; p < 4; p++)
        e[p] = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2 * p], d[2 * p + 1]),
                                _mm512_unpackhi_epi32(d[2 * p], d[2 * p + 1]));
    for (int h = 0; h < 2; h++)
        f[h] = _mm512_add_epi32(_mm512_unpacklo_epi64(e[2 * h], e[2 * h + 1]),
                                _mm512_unpackhi_epi64(e[2 * h], e[2 * h + 1]));
    /* f[h]'s 128-bit lanes: pairs 4h.. first columns' two halves, then
     * their second columns' two halves */
    return _mm512_add_epi32(_mm512_shuffle_i32x4(f[0], f[1], 0x88),
                            _mm512_shuffle_i32x4(f[0], f[1], 0xdd));
}

/* fast_group over the 16 columns [j, j+16) for R rows from i0 */
RX_FAST512 static inline __attribute__((always_inline)) void
fast_wide(int q4, size_t R, const rx_base_mat *bm, size_t rb, const rx_gemm_op *g,
          const fast_rows *x, size_t i0, size_t j, const char *pf, size_t pf_step,
          const char *pf_end) {
    const size_t K = g->K, nb = K / QBLK, bb = bm->ty->blk_bytes;
    __m512 acc[FAST_ROWS];
    for (size_t r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const unsigned char *row0 = bm->data + j * rb;
    for (size_t b = 0; b < nb; b++) {
        __m512i w[8];
        __mmask64 neg[8];
        uint16_t dh[FAST_WIDE];
        for (int l = 0; l < FAST_WIDE; l++) memcpy(&dh[l], row0 + FAST_LANE[l] * rb + b * bb, 2);
        for (int p = 0; p < 8; p++) {
            const unsigned char *b0 = row0 + 2 * (size_t)p * rb + b * bb;
            w[p] = _mm512_inserti64x4(_mm512_castsi256_si512(fast_q(q4, 0, b0 + 2)),
                                      fast_q(q4, 0, b0 + rb + 2), 1);
            if (!q4) {
                neg[p] = _mm512_movepi8_mask(w[p]);
                w[p] = _mm512_abs_epi8(w[p]);
            }
        }
        for (const char *e = pf + pf_step; pf < e && pf < pf_end; pf += 64)
            _mm_prefetch(pf, RX_PREFETCH_AHEAD);
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)dh));
        for (size_t r = 0; r < R; r++) {
            const __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                (const __m256i *)(const void *)(x->q + (i0 + r) * K + b * QBLK)));
            __m512i d[8];
            for (int p = 0; p < 8; p++)
                d[p] = _mm512_dpbusd_epi32(
                    _mm512_setzero_si512(), w[p],
                    q4 ? xv : _mm512_mask_sub_epi8(xv, neg[p], _mm512_setzero_si512(), xv));
            __m512i isum = fast_sums512(d);
            if (q4) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(8 * x->sx[(i0 + r) * nb + b]));
            const __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(x->d[(i0 + r) * nb + b]));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(sc, _mm512_cvtepi32_ps(isum)));
        }
    }
    for (size_t r = 0; r < R; r++) {
        float t[FAST_WIDE], *c = g->C + (i0 + r) * g->ldc + j;
        _mm512_storeu_ps(t, acc[r]);
        for (int l = 0; l < FAST_WIDE; l++)
            c[FAST_LANE[l]] = g->beta != 0.0f ? c[FAST_LANE[l]] + t[l] : t[l];
    }
}

/* fast_wide over whole groups of 16 from j (rows every FAST_ROWS), the
 * next group's rows prefetched a slice a block into L2 (RX_PREFETCH_AHEAD;
 * into L1, 1.5B batch-1 fast decode 13.2 against 14.2-14.5 tokens/s on
 * Sapphire Rapids); returns the columns done */
RX_FAST512 static size_t fast_cols_512(const rx_base_mat *bm, const rx_gemm_op *g,
                                       const fast_rows *x, size_t rb, size_t j, size_t j1) {
    const size_t j0 = j, nb = g->K / QBLK;
    const int q4 = bm->ty->id == RX_BASE_Q4_0;
    for (; j + FAST_WIDE <= j1; j += FAST_WIDE) {
        const size_t nj = j + 2 * FAST_WIDE <= j1 ? FAST_WIDE : 0;
        const char *pf = (const char *)bm->data + (j + FAST_WIDE) * rb;
        const size_t step = (nj * rb / nb + 63) / 64 * 64;
        for (size_t i = 0; i < g->M; i += FAST_ROWS) {
            const size_t R = g->M - i < FAST_ROWS ? g->M - i : FAST_ROWS;
            if (q4) fast_wide(1, R, bm, rb, g, x, i, j, pf, step, pf + nj * rb);
            else fast_wide(0, R, bm, rb, g, x, i, j, pf, step, pf + nj * rb);
        }
    }
    return j - j0;
}

/* ---- AVX512-VNNI panel: 16 columns repacked, from FAST_PANEL_M rows -------
 * fast_panel over 16 columns: per block, vector t's lane c holds column
 * j+c's bytes at k 4t .. 4t+3, made unsigned (Q8_0: q + 128, as q ^ 0x80;
 * Q4_0: the nibbles), so that one vpdpbusd of vector t by row r's word t
 * (broadcast) sums 4 exact products a lane. Less off * sx (off 128 or 8,
 * the unsigned offset, times the row's block sum of qx) the lane holds
 * fast_group's isum (each product at most 255 * 127, a block's 32 well
 * inside int32); the float ops are the portable kernel's, lane by lane,
 * so the bits are the AVX2 panel's. */
#define WIDE_BLK (8 * 64 + FAST_WIDE * 4)   /* 8 vectors of 64 bytes, then 16 scales */
#define WIDE_ROWS 8                         /* rows of the register tile */

RX_FAST512 static void fast_panel512(int q4, const rx_base_mat *bm, size_t rb, size_t nb,
                                     size_t j, unsigned char *pan) {
    const size_t bb = bm->ty->blk_bytes;
    const unsigned char *row0 = bm->data + j * rb;
    /* 64-bit lanes of the two halves' words t (t < 4) and t + 4 */
    const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
    const __m512i hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    for (size_t b = 0; b < nb; b++) {
        __m512i w[8], u[8];
        uint16_t dh[FAST_WIDE];
        /* w[c]: column c's 32 bytes, then column c + 8's */
        for (int c = 0; c < 8; c++) {
            const unsigned char *b0 = row0 + (size_t)c * rb + b * bb;
            const unsigned char *b1 = b0 + 8 * rb;
            memcpy(&dh[c], b0, 2);
            memcpy(&dh[c + 8], b1, 2);
            w[c] = _mm512_inserti64x4(_mm512_castsi256_si512(fast_q(q4, 0, b0 + 2)),
                                      fast_q(q4, 0, b1 + 2), 1);
            if (!q4) w[c] = _mm512_xor_si512(w[c], _mm512_set1_epi8((char)0x80));
        }
        for (int c = 0; c < 8; c += 2) {
            u[c] = _mm512_unpacklo_epi32(w[c], w[c + 1]);
            u[c + 1] = _mm512_unpackhi_epi32(w[c], w[c + 1]);
        }
        for (int c = 0; c < 8; c += 4)
            for (int h = 0; h < 2; h++) {
                w[c + 2 * h] = _mm512_unpacklo_epi64(u[c + h], u[c + h + 2]);
                w[c + 2 * h + 1] = _mm512_unpackhi_epi64(u[c + h], u[c + h + 2]);
            }
        /* w[t] (t < 4), by 128-bit lane: words t of columns 0..3, t + 4 of
         * them, t of columns 8..11, t + 4 of them; w[t + 4] alike for
         * columns 4..7 and 12..15 */
        __m512i *o = (__m512i *)(void *)(pan + b * WIDE_BLK);
        for (int t = 0; t < 4; t++) {
            _mm512_storeu_si512(o + t, _mm512_permutex2var_epi64(w[t], lo, w[t + 4]));
            _mm512_storeu_si512(o + t + 4, _mm512_permutex2var_epi64(w[t], hi, w[t + 4]));
        }
        _mm512_storeu_ps((float *)(void *)(o + 8),
                         _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)dh)));
    }
}

/* The panel's 16 columns for R rows from i0 (fast_panel512) */
RX_FAST512 static inline __attribute__((always_inline)) void
fast_tile512(int q4, size_t R, const unsigned char *pan, const rx_gemm_op *g,
             const fast_rows *x, size_t i0, size_t j) {
    const size_t K = g->K, nb = K / QBLK;
    const int32_t off = q4 ? 8 : 128;
    __m512 acc[WIDE_ROWS];
    for (size_t r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (size_t b = 0; b < nb; b++) {
        const __m512i *p = (const __m512i *)(const void *)(pan + b * WIDE_BLK);
        const int8_t *xq = x->q + i0 * K + b * QBLK;
        __m512i s[WIDE_ROWS];
        for (size_t r = 0; r < R; r++) s[r] = _mm512_setzero_si512();
        for (int t = 0; t < 8; t++) {
            const __m512i w = _mm512_loadu_si512(p + t);
            for (size_t r = 0; r < R; r++) {
                int32_t word;
                memcpy(&word, xq + r * K + 4 * t, 4);
                s[r] = _mm512_dpbusd_epi32(s[r], w, _mm512_set1_epi32(word));
            }
        }
        const __m512 dw = _mm512_loadu_ps((const float *)(const void *)(p + 8));
        for (size_t r = 0; r < R; r++) {
            const __m512i isum =
                _mm512_sub_epi32(s[r], _mm512_set1_epi32(off * x->sx[(i0 + r) * nb + b]));
            const __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(x->d[(i0 + r) * nb + b]));
            acc[r] = _mm512_add_ps(acc[r], _mm512_mul_ps(sc, _mm512_cvtepi32_ps(isum)));
        }
    }
    for (size_t r = 0; r < R; r++) {
        float *c = g->C + (i0 + r) * g->ldc + j;
        _mm512_storeu_ps(c, g->beta != 0.0f ? _mm512_add_ps(_mm512_loadu_ps(c), acc[r]) : acc[r]);
    }
}

/* rows [i, i1) over the 16-column panel, WIDE_ROWS at a time (R a
 * constant in each instance: the tile's sums stay in registers) */
RX_FAST512 static void fast_panel_rows512(int q4, const unsigned char *pan, const rx_gemm_op *g,
                                          const fast_rows *x, size_t i, size_t i1, size_t j) {
    for (; i + WIDE_ROWS <= i1; i += WIDE_ROWS) {
        if (q4) fast_tile512(1, WIDE_ROWS, pan, g, x, i, j);
        else fast_tile512(0, WIDE_ROWS, pan, g, x, i, j);
    }
    for (; i + 4 <= i1; i += 4) {
        if (q4) fast_tile512(1, 4, pan, g, x, i, j);
        else fast_tile512(0, 4, pan, g, x, i, j);
    }
    for (; i < i1; i++) {
        if (q4) fast_tile512(1, 1, pan, g, x, i, j);
        else fast_tile512(0, 1, pan, g, x, i, j);
    }
}

/* rows [i, i1) over whole groups of 16 columns from j, each group's panel
 * built once; returns the columns done */
RX_FAST512 static size_t fast_panels512(const rx_base_mat *bm, const rx_gemm_op *g,
                                        const fast_rows *x, size_t rb, unsigned char *pan,
                                        size_t i, size_t i1, size_t j, size_t j1) {
    const size_t j0 = j, nb = g->K / QBLK;
    const int q4 = bm->ty->id == RX_BASE_Q4_0;
    for (; j + FAST_WIDE <= j1; j += FAST_WIDE) {
        fast_panel512(q4, bm, rb, nb, j, pan);
        fast_panel_rows512(q4, pan, g, x, i, i1, j);
    }
    return j - j0;
}

/* The panel of the 8 columns [j, j+8): per block, vector t's lane c holds
 * column j+c's q at k 4t .. 4t+3 (the 8 x 8 transpose of the blocks'
 * 32-bit words), so that one broadcast word of x times vector t sums, in
 * each lane, 4 products of its own column: no horizontal sums. Q8_0: |q|
 * then q (its sign); Q4_0: the nibbles, unsigned (the offset 8 is taken
 * off the sums, as 8 sx). */
RX_BASE_AVX2 static void fast_panel(int q4, const rx_base_mat *bm, size_t rb, size_t nb,
                                    size_t j, unsigned char *pan) {
    const size_t bb = bm->ty->blk_bytes;
    const unsigned char *row0 = bm->data + j * rb;
    for (size_t b = 0; b < nb; b++) {
        __m256i w[FAST_GROUP], u[FAST_GROUP];
        uint16_t dh[FAST_GROUP];
        for (int c = 0; c < FAST_GROUP; c++) {
            const unsigned char *blk = row0 + c * rb + b * bb;
            memcpy(&dh[c], blk, 2);
            w[c] = fast_q(q4, 0, blk + 2);
        }
        for (int c = 0; c < FAST_GROUP; c += 2) {
            u[c] = _mm256_unpacklo_epi32(w[c], w[c + 1]);
            u[c + 1] = _mm256_unpackhi_epi32(w[c], w[c + 1]);
        }
        for (int c = 0; c < FAST_GROUP; c += 4)
            for (int h = 0; h < 2; h++) {
                w[c + 2 * h] = _mm256_unpacklo_epi64(u[c + h], u[c + h + 2]);
                w[c + 2 * h + 1] = _mm256_unpackhi_epi64(u[c + h], u[c + h + 2]);
            }
        /* w[c] lanes: words c of columns 0..3, then c + 4 of them (c < 4);
         * columns 4..7 alike in w[c + 4] */
        __m256i *o = (__m256i *)(void *)(pan + b * PANEL_BLK);
        for (int t = 0; t < 4; t++) {
            const __m256i lo = _mm256_permute2x128_si256(w[t], w[t + 4], 0x20);
            const __m256i hi = _mm256_permute2x128_si256(w[t], w[t + 4], 0x31);
            if (q4) {
                _mm256_storeu_si256(o + t, lo);
                _mm256_storeu_si256(o + t + 4, hi);
            } else {
                _mm256_storeu_si256(o + t, _mm256_abs_epi8(lo));
                _mm256_storeu_si256(o + t + 4, _mm256_abs_epi8(hi));
                _mm256_storeu_si256(o + t + 8, lo);
                _mm256_storeu_si256(o + t + 12, hi);
            }
        }
        _mm256_storeu_ps((float *)(void *)(o + 16),
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)dh)));
    }
}

/* The panel's 8 columns for R rows from i0: per block and word t, row r's
 * word broadcast, times vector t. Q8_0: vpmaddubsw of |q| and x with q's
 * sign (pairs at most 2 * 128 * 127), vpmaddwd, summed in int32. Q4_0:
 * vpmaddubsw of the nibbles and x (pairs at most 2 * 15 * 127), the 8
 * words summed in int16 (at most 30480), then vpmaddwd, less 8 sx. Each
 * lane then holds its column's exact isum; scaled and added as the
 * portable kernel does. */
RX_BASE_AVX2 static inline __attribute__((always_inline)) void
fast_tile(int q4, size_t R, const unsigned char *pan, const rx_gemm_op *g, const fast_rows *x,
          size_t i0, size_t j) {
    const size_t K = g->K, nb = K / QBLK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[FAST_ROWS];
    for (size_t r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (size_t b = 0; b < nb; b++) {
        const __m256i *p = (const __m256i *)(const void *)(pan + b * PANEL_BLK);
        const int8_t *xq = x->q + i0 * K + b * QBLK;
        __m256i s[FAST_ROWS];
        for (size_t r = 0; r < R; r++) s[r] = _mm256_setzero_si256();
        /* not unrolled: GCC would otherwise regroup the 8 words' integer
         * sums and spill their products */
#pragma GCC unroll 1
        for (int t = 0; t < 8; t++) {
            const __m256i w = _mm256_loadu_si256(p + t);
            const __m256i sg = q4 ? w : _mm256_loadu_si256(p + t + 8);
            for (size_t r = 0; r < R; r++) {
                int32_t word;
                memcpy(&word, xq + r * K + 4 * t, 4);
                const __m256i xv = _mm256_set1_epi32(word);
                if (q4) {
                    s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(w, xv));
                } else {
                    const __m256i pr = _mm256_maddubs_epi16(w, _mm256_sign_epi8(xv, sg));
                    s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(pr, ones));
                }
            }
        }
        const __m256 dw = _mm256_loadu_ps((const float *)(const void *)(p + 16));
        for (size_t r = 0; r < R; r++) {
            __m256i isum = s[r];
            if (q4)
                isum = _mm256_sub_epi32(_mm256_madd_epi16(isum, ones),
                                        _mm256_set1_epi32(8 * x->sx[(i0 + r) * nb + b]));
            const __m256 sc = _mm256_mul_ps(dw, _mm256_set1_ps(x->d[(i0 + r) * nb + b]));
            acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(sc, _mm256_cvtepi32_ps(isum)));
        }
    }
    fast_store(g, i0, R, j, acc);
}

/* rows [i, i1) over the panel, PANEL_ROWS at a time (R a constant in
 * each instance, so the tile's sums stay in registers) */
RX_BASE_AVX2 static void fast_panel_rows(int q4, const unsigned char *pan, const rx_gemm_op *g,
                                         const fast_rows *x, size_t i, size_t i1, size_t j) {
    for (; i + PANEL_ROWS <= i1; i += PANEL_ROWS) {
        if (q4) fast_tile(1, PANEL_ROWS, pan, g, x, i, j);
        else fast_tile(0, PANEL_ROWS, pan, g, x, i, j);
    }
    for (; i < i1; i++) {
        if (q4) fast_tile(1, 1, pan, g, x, i, j);
        else fast_tile(0, 1, pan, g, x, i, j);
    }
}

/* fast_cols_c's columns for every row, whole groups of 8 here; returns the
 * columns done */
RX_BASE_AVX2 static size_t fast_cols_avx2(const rx_base_mat *bm, const rx_gemm_op *g,
                                          const fast_rows *x, size_t j0, size_t j1) {
    const size_t rb = rx_base_type_row_bytes(bm->ty, g->K), nb = g->K / QBLK, M = g->M;
    const int q4 = bm->ty->id == RX_BASE_Q4_0;
    /* the worker's panel (none: the blocks read in place, the same bits) */
    const size_t pan_bytes = nb * (WIDE_BLK > PANEL_BLK ? WIDE_BLK : PANEL_BLK);
    unsigned char *pan = M >= FAST_PANEL_M ? rx_thread_buffer(RX_BUF_FAST_PANEL, pan_bytes) : NULL;
    /* AVX512-VNNI where the CPU has it: 16 columns a group */
    const int vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                     rx_cpu_base_simd() >= 1;
    size_t j = j0;
    if (pan) {
        /* rows a stripe of at most FAST_STRIPE bytes of quantised x, so that
         * it stays in L2 over the unit's groups (the panels are rebuilt
         * for each stripe: a few % of its products) */
        const size_t mc = (FAST_STRIPE / g->K / STRIPE_ROWS + 1) * STRIPE_ROWS;
        for (size_t i = 0; i < M; i += mc) {
            const size_t i1 = M - i < mc ? M : i + mc;
            j = j0 + (vnni ? fast_panels512(bm, g, x, rb, pan, i, i1, j0, j1) : 0);
            for (; j + FAST_GROUP <= j1; j += FAST_GROUP) {
                fast_panel(q4, bm, rb, nb, j, pan);
                fast_panel_rows(q4, pan, g, x, i, i1, j);
            }
        }
        return j - j0;
    }
    if (vnni) j += fast_cols_512(bm, g, x, rb, j, j1);
    for (; j + FAST_GROUP <= j1; j += FAST_GROUP) {
        /* the next group's rows, one contiguous run, a slice a block:
         * eight rows stepping along k are more streams than the hardware
         * prefetchers follow */
        const size_t nj = j + 2 * FAST_GROUP <= j1 ? FAST_GROUP : 0;
        const char *pf = (const char *)bm->data + (j + FAST_GROUP) * rb;
        const size_t step = (nj * rb / nb + 63) / 64 * 64;
        for (size_t i = 0; i < M; i += FAST_ROWS) {
            const size_t R = M - i < FAST_ROWS ? M - i : FAST_ROWS;
            if (q4) fast_group(1, R, bm, rb, g, x, i, j, pf, step, pf + nj * rb);
            else fast_group(0, R, bm, rb, g, x, i, j, pf, step, pf + nj * rb);
        }
    }
    return j - j0;
}
#endif

/* op g's columns [j0, j1), every row */
static void fast_unit(const rx_base_mat *bm, const rx_gemm_op *g, const fast_rows *x, size_t j0,
                      size_t j1) {
    size_t j = j0;
#ifdef RX_BASE_X86
    if (rx_cpu_base_avx2()) j += fast_cols_avx2(bm, g, x, j0, j1);
#endif
    for (size_t i = 0; i < g->M && j < j1; i += FAST_ROWS)
        fast_cols_c(bm, g, x, i, g->M - i < FAST_ROWS ? g->M - i : FAST_ROWS, j, j1);
}

int rx_base_fast_sgemm(const void *src, const rx_gemm_op *g) {
    const rx_base_mat *bm = src;
    const size_t M = g->M, K = g->K, nb = K / QBLK;
    int nt = rx_in_parallel() ? 1 : rx_max_threads();
    if ((double)M * (double)g->N * (double)K < RX_GEMM_MIN_PAR) nt = 1;
    if (!M || !g->N) return RX_OK;
    /* every row quantised once, into the calling thread's buffer, which
     * every column unit then reads */
    unsigned char *buf = rx_thread_buffer(RX_BUF_FAST_ROWS, M * nb * (2 * 4 + QBLK));
    if (!buf)
        return rx_fail(RX_ENOMEM, "rx_base_fast_sgemm: out of memory for the quantised rows");
    float *dx = (float *)(void *)buf;
    int32_t *sx = (int32_t *)(void *)(buf + M * nb * 4);
    int8_t *qx = (int8_t *)(buf + M * nb * 8);
    const fast_rows x = {qx, dx, sx};
    /* whole groups: at few rows two units a thread (the in-place kernel
     * prefetches along a unit's run of rows), from FAST_PANEL_M rows units
     * of FAST_PANEL_UNIT groups, dealt out as threads come free (a thread
     * slowed by another job on its core then holds up less) */
    const size_t groups = (g->N + FAST_GROUP - 1) / FAST_GROUP;
    const size_t nu = M < FAST_PANEL_M || nt == 1 ? 2 * (size_t)nt
                      : (groups + FAST_PANEL_UNIT - 1) / FAST_PANEL_UNIT;
    const size_t w = (g->N / nu + FAST_GROUP - 1) / FAST_GROUP * FAST_GROUP;
    rx_prof_push(RX_PROF_GEMM);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(static)
        for (long i = 0; i < (long)M; i++)
            quantise_row(g->A + (size_t)i * g->lda, K, qx + (size_t)i * K, dx + (size_t)i * nb,
                         sx + (size_t)i * nb);
#pragma omp for schedule(dynamic, 1)
        for (long u = 0; u < (long)nu; u++) {
            const size_t j0 = (size_t)u * w, j1 = u + 1 == (long)nu ? g->N : j0 + w;
            if (j0 < j1 && j0 < g->N) fast_unit(bm, g, &x, j0, j1 < g->N ? j1 : g->N);
        }
    }
    rx_prof_pop();
    return RX_OK;
}
