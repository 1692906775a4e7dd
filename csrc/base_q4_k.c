/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * base_q4_k.c -- the q4_k frozen-base dtype's kernels (its row of
 * rx_base_types, base_types.c): W^T [out][in] in GGUF Q4_K super-blocks
 * along in (ggml's block_q4_K, 144 bytes per RX_Q4_K_BLOCK = 256 values):
 * fp16 d, fp16 dmin, 12 bytes packing eight 6-bit scales sc and eight
 * 6-bit mins m (get_scale_min below), then 128 bytes of 4-bit q (run r of
 * 64 values: its first 32 in bytes 32r.. low nibbles, the next 32 in their
 * high nibbles). Sub-block s (32 values) decodes as (d sc_s) q - (dmin m_s)
 * in float32, ggml's dequantize_row_q4_K; the products are exact (an
 * 11-bit d times 6 bits times 4 bits), so only the subtraction rounds. The
 * encoder is ggml's quantize_row_q4_K_ref (no importance matrix), step for
 * step, so the bytes are llama.cpp's. The decoder and the small-M
 * product have an AVX2 form (bit-identical: the same exact products, the
 * same subtraction; the small-M sums in the GEMM's order), the bf16 GEMM's
 * blocks and AMX tile rows an AVX512-BF16 one, the blocks with AVX-512
 * VBMI a byte-first one (rx_vbmi_block).
 */
#include <math.h>

#include "rx_base.h"
#include "rx_simd.h"

#define QK RX_Q4_K_BLOCK
#define QK_BYTES RX_Q4_K_BYTES
#define SUB 32                 /* values per sub-block: one 6-bit scale and min */
#define NSUB (QK / SUB)        /* 8 */
#define QS_OFF 16              /* d, dmin, the 12 scale bytes */
#define NMAX 15                /* the largest 4-bit q */
#define SC_MAX 63              /* the largest 6-bit scale or min */

/* ggml's nearest_int: round to nearest (ties to even) through the float32
 * sum's mantissa, as its bits give it for any input (a NaN or a value past
 * 2^22 gives what ggml's gives, not an error) */
static inline int nearest_int(float fval) {
    const float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

static inline int clamp_q(int l, int hi) { return l < 0 ? 0 : l > hi ? hi : l; }

/* sub-block j's 6-bit scale and min from the 12 bytes q (ggml's
 * get_scale_min_k4): j < 4 in the low 6 bits of bytes j and j + 4; j >= 4
 * in nibbles of bytes j + 4, their top 2 bits in the spare top bits of
 * bytes j - 4 and j */
static inline void get_scale_min(int j, const unsigned char *q, unsigned char *sc,
                                 unsigned char *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (unsigned char)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (unsigned char)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* ggml's make_qkx2_quants(32, 15, x, w, L, &the_min, Laux, -1, 0.1, 20,
 * false): an affine fit scale L + min (min <= 0) of the 32 values x with
 * weights w, the rounding's scale searched over 21 steps by weighted
 * least squares; returns the scale, *the_min = -min. Float32 throughout,
 * in ggml's order (no fused multiply-add: RX_NO_CONTRACT). */
RX_NO_CONTRACT static float fit_sub(const float *x, const float *w, unsigned char *L,
                                    float *the_min) {
    const float rmin = -1.f, rdelta = 0.1f;
    const int nstep = 20;
    unsigned char Laux[SUB];
    float min = x[0], max = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < SUB; ++i) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        for (int i = 0; i < SUB; ++i) L[i] = 0;
        *the_min = -min;
        return 0.f;
    }
    float iscale = NMAX / (max - min), scale = 1 / iscale, best_error = 0;
    for (int i = 0; i < SUB; ++i) {
        L[i] = (unsigned char)clamp_q(nearest_int(iscale * (x[i] - min)), NMAX);
        const float diff = scale * L[i] + min - x[i];
        best_error += w[i] * (diff * diff);
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * is + NMAX) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < SUB; ++i) {
            const int l = clamp_q(nearest_int(iscale * (x[i] - min)), NMAX);
            Laux[i] = (unsigned char)l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < SUB; ++i) {
                const float diff = this_scale * Laux[i] + this_min - x[i];
                cur_error += w[i] * (diff * diff);
            }
            if (cur_error < best_error) {
                memcpy(L, Laux, SUB);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

/* One super-block of 256 values into 144 bytes, as ggml's
 * quantize_row_q4_K_ref: each sub-block fitted (weights sqrt(mean x^2) +
 * |x|), its scale and min coded in 6 bits against the largest of each (d =
 * max scale / 63, dmin = max min / 63, as fp16), then every value
 * requantized against its coded scale and min */
RX_NO_CONTRACT static void quantize_block(const float *x, unsigned char *y) {
    unsigned char L[QK], *scl = y + 4;
    float w[SUB], mins[NSUB], scales[NSUB], max_scale = 0, max_min = 0;
    for (int j = 0; j < NSUB; ++j) {
        const float *xs = x + SUB * j;
        float sum_x2 = 0;
        for (int l = 0; l < SUB; ++l) sum_x2 += xs[l] * xs[l];
        const float av_x = sqrtf(sum_x2 / SUB);
        for (int l = 0; l < SUB; ++l) w[l] = av_x + fabsf(xs[l]);
        scales[j] = fit_sub(xs, w, L + SUB * j, &mins[j]);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? SC_MAX / max_scale : 0.f;
    const float inv_min = max_min > 0 ? SC_MAX / max_min : 0.f;
    for (int j = 0; j < NSUB; ++j) {
        /* ggml keeps the int's low byte, then clips at 63 */
        unsigned char ls = (unsigned char)nearest_int(inv_scale * scales[j]);
        unsigned char lm = (unsigned char)nearest_int(inv_min * mins[j]);
        ls = ls < SC_MAX ? ls : SC_MAX;
        lm = lm < SC_MAX ? lm : SC_MAX;
        if (j < 4) {
            scl[j] = ls;
            scl[j + 4] = lm;
        } else {
            scl[j + 4] = (unsigned char)((ls & 0xF) | ((lm & 0xF) << 4));
            scl[j - 4] |= (unsigned char)((ls >> 4) << 6);
            scl[j] |= (unsigned char)((lm >> 4) << 6);
        }
    }
    const uint16_t dh = to_f16(max_scale / SC_MAX), mh = to_f16(max_min / SC_MAX);
    memcpy(y, &dh, 2);
    memcpy(y + 2, &mh, 2);
    for (int j = 0; j < NSUB; ++j) {
        unsigned char sc, m;
        get_scale_min(j, scl, &sc, &m);
        const float d = f16_f32(dh) * sc;
        if (!d) continue;   /* the fit's own q stay (ggml's) */
        const float dm = f16_f32(mh) * m;
        for (int i = 0; i < SUB; ++i)
            L[SUB * j + i] = (unsigned char)clamp_q(nearest_int((x[SUB * j + i] + dm) / d), NMAX);
    }
    unsigned char *q = y + QS_OFF;
    for (int j = 0; j < QK; j += 2 * SUB, q += SUB)
        for (int l = 0; l < SUB; ++l) q[l] = (unsigned char)(L[j + l] | (L[j + l + SUB] << 4));
}

void rx_q4_k_from_float(const float *x, size_t n, unsigned char *dst) {
    for (size_t b = 0; b < n; b += QK, dst += QK_BYTES) quantize_block(x + b, dst);
}

/* sub-block s of super-block blk: its d sc and dmin m, float32 (exact) */
static inline void sub_scale(const unsigned char *blk, size_t s, float *d1, float *m1) {
    uint16_t dh, mh;
    memcpy(&dh, blk, 2);
    memcpy(&mh, blk + 2, 2);
    unsigned char sc, m;
    get_scale_min((int)s, blk + 4, &sc, &m);
    *d1 = f16_f32(dh) * sc;
    *m1 = f16_f32(mh) * m;
}

#ifdef RX_BASE_X86
/* the 32 values of sub-block s: d1 q - m1 over the nibbles (low for an
 * even s, high for an odd one) of its run's 32 bytes, as the scalar loop */
RX_BASE_AVX2 static void sub_avx2(const unsigned char *blk, size_t s, float *dst) {
    float d1, m1;
    sub_scale(blk, s, &d1, &m1);
    const unsigned char *run = blk + QS_OFF + s / 2 * SUB;
    const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)run);
    const __m256i q = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0f));
    const __m256 dv = _mm256_set1_ps(d1), mv = _mm256_set1_ps(m1);
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int p = 0; p < 4; p++) {
        const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part[p]));
        _mm256_storeu_ps(dst + 8 * p, _mm256_sub_ps(_mm256_mul_ps(f, dv), mv));
    }
}

/* ---- AVX512-BF16: the bf16 GEMM's operands ------------------------------
 * Half h (16 values) of sub-block s of super-block blk as (d sc) q - dmin m,
 * the decoder's values (an exact product, one rounded subtraction), rounded
 * by vcvtne2ps2bf16 (the GEMM's rounding) */
RX_BASE_BF16V static inline __m512 half_of(const unsigned char *blk, size_t s, int h, __m512 d1,
                                           __m512 m1) {
    const __m128i v = _mm_loadu_si128(
        (const __m128i *)(const void *)(blk + QS_OFF + s / 2 * SUB + 16 * (size_t)h));
    const __m128i q = _mm_and_si128(s % 2 ? _mm_srli_epi16(v, 4) : v, _mm_set1_epi8(0x0f));
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
    return _mm512_sub_ps(_mm512_mul_ps(f, d1), m1);
}

RX_BASE_BF16V static inline __m512 half_512(const unsigned char *blk, size_t s, int h) {
    float d1, m1;
    sub_scale(blk, s, &d1, &m1);
    return half_of(blk, s, h, _mm512_set1_ps(d1), _mm512_set1_ps(m1));
}

/* the whole sub-block s as 16 k pairs (its scale and min read once) */
RX_BASE_BF16V static inline __m512i sub_pairs_512(const unsigned char *blk, size_t s) {
    float d1, m1;
    sub_scale(blk, s, &d1, &m1);
    const __m512 d = _mm512_set1_ps(d1), m = _mm512_set1_ps(m1);
    return rx_pairs32(half_of(blk, s, 0, d, m), half_of(blk, s, 1, d, m));
}

/* 16 stored rows' sub-block at k0: row-major [16][32] (rows_bf16), or (tr)
 * transposed into the packed forward block's k pairs (block_bf16); the 16
 * rows from pj prefetched a slice a call (a sub-block's share of the
 * super-block's bytes), as rows_q8_512 does */
RX_BASE_BF16V static void rows_q4k_512(const unsigned char *data, size_t rb, size_t j0, size_t k0,
                                       int tr, size_t pj, uint16_t *dst) {
    __m512i v[16];
    const size_t s = k0 % QK / SUB;
    const unsigned char *blk = data + j0 * rb + k0 / QK * QK_BYTES;
    rx_prefetch_rows(data, rb, pj, k0 / SUB, QK_BYTES / NSUB);
    for (int r = 0; r < 16; r++, blk += rb) v[r] = sub_pairs_512(blk, s);
    if (tr) rx_transpose16(v);
    for (int r = 0; r < 16; r++) _mm512_storeu_si512(dst + 32 * r, v[r]);
}

/* The 16 columns' (column c's super-block at blk + c rb) sub-block s d sc
 * and dmin m, lane c column c's: sub_scale's exact products, the halves by
 * vcvtph2ps (f16_f32's values). Each column's 16-byte head (d, dmin, the
 * 12 scale bytes) is loaded; one vpermt2b per 8 columns gathers, into a
 * dword a column, d and dmin, another the two or three bytes that hold
 * its sc and m (get_scale_min's), cut out by shifts and masks. */
RX_BASE_BF16VB static inline void q4k_scales16(const unsigned char *blk, size_t rb, size_t s,
                                               __m512 *dsc, __m512 *dmm) {
    __m512i Z[4];
    for (int g = 0; g < 4; g++) {
        const unsigned char *h = blk + (size_t)(4 * g) * rb;
#define RX_Q4K_HEAD(u) _mm_loadu_si128((const __m128i *)(const void *)(h + (size_t)(u) * rb))
        /* the lane an immediate: written out, as an unoptimised build needs */
        Z[g] = _mm512_inserti32x4(
            _mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(RX_Q4K_HEAD(0)),
                                                  RX_Q4K_HEAD(1), 1),
                               RX_Q4K_HEAD(2), 2),
            RX_Q4K_HEAD(3), 3);
#undef RX_Q4K_HEAD
    }
    /* lane c: column c % 8's head, 16 (c % 8) in each byte of the pair Z[2 (c / 8)..] */
    const __m512i head = _mm512_set_epi32(
        0x70707070, 0x60606060, 0x50505050, 0x40404040, 0x30303030, 0x20202020, 0x10101010, 0,
        0x70707070, 0x60606060, 0x50505050, 0x40404040, 0x30303030, 0x20202020, 0x10101010, 0);
    /* the head's bytes: q = head + 4; s < 4: q[s], q[s + 4]; else q[s + 4], q[s - 4], q[s] */
    const int pick = s < 4 ? (int)((4 + s) | (8 + s) << 8)
                           : (int)((8 + s) | s << 8 | (4 + s) << 16);
    __m512i v[2];
    for (int i = 0; i < 2; i++) {
        const __m512i idx = _mm512_add_epi8(head, _mm512_set1_epi32(i ? pick : 0x03020100));
        v[i] = _mm512_mask_blend_epi32(0xFF00, _mm512_permutex2var_epi8(Z[0], idx, Z[1]),
                                       _mm512_permutex2var_epi8(Z[2], idx, Z[3]));
    }
    const __m512i w = v[1];
    __m512i sc, m;
    if (s < 4) {
        sc = _mm512_and_si512(w, _mm512_set1_epi32(63));
        m = _mm512_and_si512(_mm512_srli_epi32(w, 8), _mm512_set1_epi32(63));
    } else {
        const __m512i f = _mm512_set1_epi32(0xF), t = _mm512_set1_epi32(0x30);
        sc = _mm512_or_si512(_mm512_and_si512(w, f), _mm512_and_si512(_mm512_srli_epi32(w, 10), t));
        m = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w, 4), f),
                            _mm512_and_si512(_mm512_srli_epi32(w, 18), t));
    }
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v[0]));
    const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v[0], 16)));
    *dsc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
    *dmm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m));
}

/* rows_q4k_512's transposed block from bytes (rx_vbmi_block), for columns
 * [j0, j0+16) at k0: sub-block s's nibbles of a row's 32-byte run are its
 * values, each column's d sc and dmin m (q4k_scales16) in lanes */
RX_BASE_BF16VB static void block_q4k_vbmi(const unsigned char *data, size_t rb, size_t j0,
                                          size_t k0, uint16_t *dst) {
    const size_t s = k0 % QK / SUB;
    const unsigned char *blk = data + j0 * rb + k0 / QK * QK_BYTES;
    __m512 dsc, dmm, D[2], Mn[2];
    q4k_scales16(blk, rb, s, &dsc, &dmm);
    rx_vbmi_lanes(dsc, D);
    /* minus dmin m by its sign bit: exact, a zero's sign as the subtraction gives it */
    rx_vbmi_lanes(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dmm),
                                                       _mm512_set1_epi32((int)0x80000000u))),
                  Mn);
    /* the run's bytes, then sub-block s's nibbles of them */
    __m512i L[8];
    rx_vbmi_rows32(blk + QS_OFF + s / 2 * SUB, rb, L);
    for (int i = 0; i < 8; i++)
        L[i] = _mm512_and_si512(s % 2 ? _mm512_srli_epi16(L[i], 4) : L[i], _mm512_set1_epi8(0x0f));
    rx_vbmi_block(L, D, Mn, 0.0f, dst);
}

/* rows_q4k_512's row-major tile (the AMX small path's A): the 16 columns'
 * d sc and dmin m from q4k_scales16, and a row's values its 16 possible
 * (d sc) q - dmin m picked by nibble (rx_pick16) */
RX_BASE_BF16VB static void tile_q4k_vbmi(const unsigned char *data, size_t rb, size_t j0,
                                         size_t k0, size_t pj, uint16_t *dst) {
    const size_t s = k0 % QK / SUB;
    const unsigned char *blk = data + j0 * rb + k0 / QK * QK_BYTES;
    rx_prefetch_rows(data, rb, pj, k0 / SUB, QK_BYTES / NSUB);
    __m512 dsc, dmm;
    q4k_scales16(blk, rb, s, &dsc, &dmm);
    _Alignas(64) float D[16], Mn[16];
    _mm512_store_ps(D, dsc);
    _mm512_store_ps(Mn, dmm);
    RX_SCALES_IN_MEMORY();
    const __m512 q = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int r = 0; r < 16; r += 2, blk += 2 * rb) {
        /* half_of's value: the exact product less the min, one rounding */
        const __m512i tab = rx_pairs32(
            _mm512_sub_ps(_mm512_mul_ps(q, _mm512_set1_ps(D[r])), _mm512_set1_ps(Mn[r])),
            _mm512_sub_ps(_mm512_mul_ps(q, _mm512_set1_ps(D[r + 1])), _mm512_set1_ps(Mn[r + 1])));
        for (int h = 0; h < 2; h++) {
            const __m256i b = _mm256_loadu_si256(
                (const __m256i *)(const void *)(blk + h * rb + QS_OFF + s / 2 * SUB));
            _mm512_storeu_si512(dst + 32 * (r + h),
                                rx_pick16(tab, _mm256_and_si256(s % 2 ? _mm256_srli_epi16(b, 4) : b,
                                                                low), h));
        }
    }
}

/* A dX block: k row q is stored row k0 + q, whose 16 j from j0 are half of
 * one sub-block */
RX_BASE_BF16V static void block_q4k_t_512(const unsigned char *data, size_t rb, size_t k0,
                                          size_t j0, uint16_t *dst) {
    const size_t off = j0 / QK * QK_BYTES, s = j0 % QK / SUB;
    const int h = (int)(j0 % SUB / 16);
    for (size_t p = 0; p < 16; p++) {
        const unsigned char *b0 = data + (k0 + 2 * p) * rb + off;
        _mm512_storeu_si512(dst + p * 32,
                            rx_pair_rows(half_512(b0, s, h), half_512(b0 + rb, s, h)));
    }
}

/* rx_small_q32_group (rx_simd.h) over Q4_K rows: the same sums in the same
 * order (each C element one FMA chain from zero over each kcb-deep block of
 * k, in k order, then added to C), so the packed path's bits; what differs
 * is a weight's value, (d sc) q - dmin m, with each of the 8 rows' sub-block
 * scale d1 and min m1 in lanes: the decoder's value, as the product is
 * exact (a contraction into a fused multiply-subtract rounds the same) */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
small_group(size_t M, size_t V, const unsigned char *data, size_t rb, const float *A,
            size_t lda, size_t K, size_t kcb, size_t j, int acc0, float *C, size_t ldc) {
    _Alignas(32) unsigned char T[4 * 256 + 16];   /* + 16: each k's 8 bytes read as 16 */
    _Alignas(32) float D[4][8], Mn[4][8];
    for (size_t pc = 0; pc < K; pc += kcb) {
        const size_t kc = K - pc < kcb ? K - pc : kcb;
        __m256 c[8];   /* row i, columns 8v..: c[i V + v] */
#pragma GCC unroll 8
        for (size_t u = 0; u < M * V; u++) c[u] = _mm256_setzero_ps();
        for (size_t p = pc; p < pc + kc; p += SUB) {
            const size_t s = p % QK / SUB;
#pragma GCC unroll 4
            for (size_t v = 0; v < V; v++) {
                const unsigned char *blk = data + (j + 8 * v) * rb + p / QK * QK_BYTES;
                __m256i r[8];
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) {
                    const unsigned char *b = blk + i * rb;
                    const __m256i x = _mm256_loadu_si256(
                        (const __m256i *)(const void *)(b + QS_OFF + s / 2 * SUB));
                    r[i] = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(x, 4) : x,
                                            _mm256_set1_epi8(0x0f));
                    sub_scale(b, s, &D[v][i], &Mn[v][i]);
                }
                rx_transpose8_lanes(r, 0);
#pragma GCC unroll 8
                for (int m = 0; m < 8; m++)
                    _mm256_store_si256((__m256i *)(void *)(T + 256 * v + 32 * m), r[m]);
            }
            __asm__ volatile("" ::: "memory");
            const float *a = A + p;
#pragma GCC unroll 32
            for (size_t k = 0; k < SUB; k++) {
#pragma GCC unroll 4
                for (size_t v = 0; v < V; v++) {
                    const __m128i q = _mm_loadu_si128(
                        (const __m128i *)(const void *)(T + 256 * v + RX_SMALLQ_OFF(k)));
                    const __m256 w = _mm256_sub_ps(
                        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                                      _mm256_load_ps(D[v])),
                        _mm256_load_ps(Mn[v]));
                    rx_small_fma(M, V, v, a, lda, k, w, c);
                }
            }
        }
        rx_small_store(M, V, c, pc > 0 || acc0, C, ldc, j);
    }
}

/* small_group over columns [j0, j1) as rx_small_q32 groups them (V by M);
 * returns the columns done from j0 */
__attribute__((target("avx2,fma,f16c"))) static size_t
small_avx2(const unsigned char *data, size_t rb, size_t M, const float *A, size_t lda, size_t K,
           size_t kcb, size_t j0, size_t j1, int acc0, float *C, size_t ldc) {
    size_t j = j0;
    if (M < 1 || M > RX_SMALLQ_MAXM || kcb % SUB || K % QK) return 0;
#define SMALLK_GROUP(m, vv) small_group(m, vv, data, rb, A, lda, K, kcb, j, acc0, C, ldc)
    RX_SMALL_BY_M(M, j, j1, SMALLK_GROUP);
#undef SMALLK_GROUP
    return j - j0;
}
#endif

/* rx_bgemm's packed block: forward, column c's 32 k are one sub-block of
 * stored row j0 + c; dX, k row q is stored row k0 + q, whose 16 j from j0
 * are half of one sub-block. AVX512-BF16 where the CPU has it; else 0, and
 * the packer decodes and rounds each value itself (the same bits). */
int rx_q4_k_block_bf16(const unsigned char *data, size_t rb, int tb, size_t j0, size_t k0,
                       size_t bt_r, size_t bt_k, uint16_t *dst) {
#ifdef RX_BASE_X86
    const int lv = bt_r == 16 ? rx_cpu_base_simd() : 0;
    if (lv >= 3 && !tb) {
        block_q4k_vbmi(data, rb, j0, k0, dst);
        return 1;
    }
    if (lv >= 2) {
        if (tb) block_q4k_t_512(data, rb, k0, j0, dst);
        else rows_q4k_512(data, rb, j0, k0, 1, RX_NO_ROWS, dst);
        return 1;
    }
#endif
    (void)data, (void)rb, (void)tb, (void)j0, (void)k0, (void)bt_r, (void)bt_k, (void)dst;
    return 0;
}

/* AVX512-BF16 where the CPU has it; else 0 */
int rx_q4_k_rows_bf16(const unsigned char *data, size_t rb, size_t j0, size_t k0, size_t pj,
                      int pairs, uint16_t *dst) {
#ifdef RX_BASE_X86
    const int lv = rx_cpu_base_simd();
    if (pairs && lv >= 3) {
        rx_prefetch_rows(data, rb, pj, k0 / SUB, QK_BYTES / NSUB);
        block_q4k_vbmi(data, rb, j0, k0, dst);
        return RX_ROWS_PAIRS;
    }
    if (lv >= 3) {
        tile_q4k_vbmi(data, rb, j0, k0, pj, dst);
        return RX_ROWS_TILE;
    }
    if (lv >= 2) {
        rows_q4k_512(data, rb, j0, k0, 0, pj, dst);
        return RX_ROWS_TILE;
    }
#endif
    (void)data, (void)rb, (void)j0, (void)k0, (void)pj, (void)pairs, (void)dst;
    return RX_ROWS_NONE;
}

/* AVX2 with FMA where the CPU has them; else 0: the GEMM packs slivers */
size_t rx_q4_k_small_f32(const unsigned char *data, size_t rb, size_t M, const float *A,
                         size_t lda, size_t K, size_t kcb, size_t j0, size_t j1, int acc0,
                         float *C, size_t ldc) {
#ifdef RX_BASE_X86
    if (rx_cpu_base_avx2() && __builtin_cpu_supports("fma"))
        return small_avx2(data, rb, M, A, lda, K, kcb, j0, j1, acc0, C, ldc);
#endif
    (void)data, (void)rb, (void)M, (void)A, (void)lda, (void)K, (void)kcb, (void)j0, (void)j1;
    (void)acc0, (void)C, (void)ldc;
    return 0;
}

RX_NO_CONTRACT void rx_q4_k_decode(const unsigned char *row, size_t k0, size_t n, float *dst) {
    for (size_t k = k0; k < k0 + n;) {
        const unsigned char *blk = row + k / QK * QK_BYTES;
        const size_t s = k % QK / SUB, end = k - k % SUB + SUB;
        const size_t e = end < k0 + n ? end : k0 + n;
#ifdef RX_BASE_X86
        /* a whole sub-block: the AVX2 decoder's 32 at a time */
        if (k % SUB == 0 && e == end && rx_cpu_base_avx2()) {
            sub_avx2(blk, s, dst);
            dst += SUB, k = e;
            continue;
        }
#endif
        float d1, m1;
        sub_scale(blk, s, &d1, &m1);
        const unsigned char *q = blk + QS_OFF + s / 2 * SUB;
        for (size_t i = k; i < e; i++) {
            const unsigned char byte = q[i % SUB];
            *dst++ = d1 * (float)(s % 2 ? byte >> 4 : byte & 15) - m1;
        }
        k = e;
    }
}
