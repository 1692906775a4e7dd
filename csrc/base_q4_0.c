/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * base_q4_0.c -- the q4_0 frozen-base dtype's kernels (its row of
 * rx_base_types, base_types.c): W^T [out][in] in GGUF Q4_0 blocks along in,
 * per RX_Q4_0_BLOCK values one fp16 scale d, then 16 bytes of 4-bit q
 * (value i < 16 in byte i's low nibble, value 16 + i in its high nibble),
 * value = (q - 8) * d; the bytes are those of gguf.quants.quantize(W^T,
 * Q4_0). (q - 8) * d is exact in float32 (an 11-bit d times a 4-bit int).
 * The decoders have an AVX2 form and the bf16 GEMM's blocks and AMX tile
 * rows an AVX512-BF16 one, the blocks byte-first with AVX-512 VBMI
 * (bit-identical: the same exact products and the same rounding to bf16),
 * picked at run time.
 */
#include <math.h>

#include "rx_base.h"
#include "rx_simd.h"

#define Q4_BLOCK RX_Q4_0_BLOCK
#define Q4_BYTES RX_Q4_0_BYTES
#define Q4_HALF (RX_Q4_0_BLOCK / 2)

/* gguf rounds x * id + 8.5 to float32 before truncating: no fused
 * multiply-add may merge the two (RX_NO_CONTRACT) */

/* numpy's trunc(t).astype(uint8).clip(0, 15) for t = x id + 8.5: t lies in
 * (0, 16.5] for a finite id; NaN and infinities (an id of inf: a subnormal
 * d) cast to 0 as numpy's x86 cast gives them */
static inline unsigned char q4_of(float t) {
    if (!isfinite(t)) return 0;
    const unsigned char q = (unsigned char)(int)truncf(t);
    return q > 15 ? 15 : q;
}

/* One row of n values into a Q4_0 row, as gguf's Q4_0.quantize_blocks
 * (float32 throughout: the first value of largest magnitude m (a NaN
 * first), d = m / -8, id = 1 / d or 0, q = trunc(x id + 8.5) clipped) */
RX_NO_CONTRACT void rx_q4_0_from_float(const float *x, size_t n, unsigned char *dst) {
    for (size_t b = 0; b < n; b += Q4_BLOCK, dst += Q4_BYTES) {
        float m = x[b], amax = fabsf(x[b]);
        for (size_t i = 1; i < Q4_BLOCK && !isnan(amax); i++)
            if (fabsf(x[b + i]) > amax || isnan(x[b + i])) m = x[b + i], amax = fabsf(m);
        const float d = m / -8.0f, id = d == 0.0f ? 0.0f : 1.0f / d;
        const uint16_t dh = to_f16(d);
        memcpy(dst, &dh, 2);
        for (size_t i = 0; i < Q4_HALF; i++) {
            const float lo = x[b + i] * id, hi = x[b + Q4_HALF + i] * id;
            dst[2 + i] = (unsigned char)(q4_of(lo + 8.5f) | q4_of(hi + 8.5f) << 4);
        }
    }
}

#ifdef RX_BASE_X86
/* 16 values of a block: half h (0: bytes' low nibbles, 1: high) of the 16
 * bytes qs, (q - 8) * d as the portable loop computes them */
RX_BASE_AVX2 static void half_avx2(const unsigned char *qs, int h, float d, float *dst) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)qs);
    const __m128i q = _mm_and_si128(h ? _mm_srli_epi16(v, 4) : v, _mm_set1_epi8(0x0f));
    const __m256i eight = _mm256_set1_epi32(8);
    const __m256 dv = _mm256_set1_ps(d);
    const __m256i q0 = _mm256_sub_epi32(_mm256_cvtepu8_epi32(q), eight);
    const __m256i q1 = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)), eight);
    _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtepi32_ps(q0), dv));
    _mm256_storeu_ps(dst + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(q1), dv));
}

/* 16 decoded values (finite, zero or at least 2^-24 in magnitude: never a
 * float32 subnormal or NaN) rounded to bf16 as operand_bf16 rounds them,
 * in order */
RX_BASE_AVX2 static __m256i round16_avx2(const float *x) {
    __m256i r[2];
    for (int h = 0; h < 2; h++) {
        const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + 8 * h));
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        r[h] = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    }
    /* packus keeps 128-bit lanes: 0-3, 8-11 | 4-7, 12-15; the permute orders them */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xd8);
}

/* rx_q4_0_block_bf16 for 16 x 32 blocks of a finite-scaled base: each run
 * decoded and rounded in vectors; forward, column c's 16 k pairs stored
 * apart (a transpose); dX, two rows' 16 values interleaved per k pair */
RX_BASE_AVX2 static int block_avx2(const unsigned char *data, size_t rb, int tb, size_t j0,
                                 size_t k0, uint16_t *dst) {
    float run[2][32];
    uint32_t w[16];
    if (!tb) {
        uint32_t *d32 = (uint32_t *)(void *)dst;   /* word (p, c): the k pair 2p, 2p+1 */
        for (int c = 0; c < 16; c++) {
            const unsigned char *blk = data + (j0 + (size_t)c) * rb + k0 / Q4_BLOCK * Q4_BYTES;
            uint16_t dh;
            memcpy(&dh, blk, 2);
            const float d = f16_f32(dh);
            if (!isfinite(d)) return 0;
            half_avx2(blk + 2, 0, d, run[0]);
            half_avx2(blk + 2, 1, d, run[0] + Q4_HALF);
            _mm256_storeu_si256((__m256i *)(void *)w, round16_avx2(run[0]));
            _mm256_storeu_si256((__m256i *)(void *)(w + 8), round16_avx2(run[0] + 16));
            for (int p = 0; p < 16; p++) d32[p * 16 + c] = w[p];
        }
        return 1;
    }
    const size_t h = j0 % Q4_BLOCK / Q4_HALF, off = j0 / Q4_BLOCK * Q4_BYTES;
    for (size_t p = 0; p < 16; p++) {
        __m256i r[2];
        for (size_t e = 0; e < 2; e++) {   /* rows k0 + 2p, k0 + 2p + 1 */
            const unsigned char *blk = data + (k0 + 2 * p + e) * rb + off;
            uint16_t dh;
            memcpy(&dh, blk, 2);
            const float d = f16_f32(dh);
            if (!isfinite(d)) return 0;
            half_avx2(blk + 2, (int)h, d, run[e]);
            r[e] = round16_avx2(run[e]);
        }
        /* word c: row 2p's value c, then row 2p+1's */
        const __m256i lo = _mm256_unpacklo_epi16(r[0], r[1]);
        const __m256i hi = _mm256_unpackhi_epi16(r[0], r[1]);
        _mm256_storeu_si256((__m256i *)(void *)(dst + p * 32),
                            _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256((__m256i *)(void *)(dst + p * 32 + 16),
                            _mm256_permute2x128_si256(lo, hi, 0x31));
    }
    return 1;
}

/* ---- AVX512-BF16: the bf16 GEMM's operands ------------------------------
 * Half h of a block (values 16h..16h+15: nibble h of its 16 bytes) as
 * (q - 8) * d, the decoder's exact values, rounded by vcvtne2ps2bf16 (the
 * GEMM's rounding, NaN and infinity included, so no scale is declined). */
RX_BASE_BF16V static inline __m512 half_512(const unsigned char *blk, int h) {
    uint16_t dh;
    memcpy(&dh, blk, 2);
    const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(blk + 2));
    const __m128i q = _mm_and_si128(h ? _mm_srli_epi16(v, 4) : v, _mm_set1_epi8(0x0f));
    const __m512i qi = _mm512_sub_epi32(_mm512_cvtepu8_epi32(q), _mm512_set1_epi32(8));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(qi), _mm512_set1_ps(f16_f32(dh)));
}

/* 16 stored rows' blocks at k0: row-major [16][32] (rows_bf16), or (tr)
 * transposed into the packed forward block's k pairs (block_bf16); the 16
 * rows from pj prefetched a slice a call, as rows_q8_512 does. A row's
 * values are its 16 possible (q - 8) d picked by nibble (rx_pick16). */
RX_BASE_BF16V static void rows_q4_512(const unsigned char *data, size_t rb, size_t j0, size_t k0,
                                      int tr, size_t pj, uint16_t *dst) {
    __m512i v[16];
    const unsigned char *blk = data + j0 * rb + k0 / Q4_BLOCK * Q4_BYTES;
    rx_prefetch_rows(data, rb, pj, k0 / Q4_BLOCK, Q4_BYTES);
    /* the 16 scales by one vcvtph2ps (f16_f32's values) */
    uint16_t dh[16];
    _Alignas(64) float D[16];
    for (int r = 0; r < 16; r++) memcpy(&dh[r], blk + (size_t)r * rb, 2);
    _mm512_store_ps(D, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)dh)));
    RX_SCALES_IN_MEMORY();
    const __m512 qm8 = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
    /* a row's 16 bytes in both lanes, the high lane's shifted by 4: its
     * 32 nibbles in order after one mask (a variable shift where a shift,
     * two masks and a lane insert on the shuffle port were: 34.5 -> 30 ns
     * a block hot on one Sapphire Rapids core) */
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i by4 = _mm256_set_epi16(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int r = 0; r < 16; r += 2, blk += 2 * rb) {
        const __m512i tab = rx_pairs32(_mm512_mul_ps(qm8, _mm512_set1_ps(D[r])),
                                       _mm512_mul_ps(qm8, _mm512_set1_ps(D[r + 1])));
        for (int h = 0; h < 2; h++) {
            const __m256i b = _mm256_broadcastsi128_si256(
                _mm_loadu_si128((const __m128i *)(const void *)(blk + h * rb + 2)));
            v[r + h] = rx_pick16(tab, _mm256_and_si256(_mm256_srlv_epi16(b, by4), low), h);
        }
    }
    if (tr) rx_transpose16(v);
    for (int r = 0; r < 16; r++) _mm512_storeu_si512(dst + 32 * r, v[r]);
}

/* rows_q4_512's transposed block from bytes (rx_vbmi_block), for columns
 * [j0, j0+16) at k0: nibble h of a row's 16 bytes are its values 16h.. */
RX_BASE_BF16VB static void block_q4_vbmi(const unsigned char *data, size_t rb, size_t j0,
                                         size_t k0, uint16_t *dst) {
    const unsigned char *blk = data + j0 * rb + k0 / Q4_BLOCK * Q4_BYTES;
    __m512 D[2];
    rx_vbmi_scales(blk, rb, D);
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512i L[8];
    for (int g = 0; g < 4; g++) {
        __m256i two[2];
        for (int u = 0; u < 2; u++) {
            const unsigned char *r = blk + (size_t)(4 * g + 2 * u) * rb + 2;
            two[u] = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)r)),
                _mm_loadu_si128((const __m128i *)(const void *)(r + rb)), 1);
        }
        const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(two[0]), two[1], 1);
        L[g] = _mm512_and_si512(z, low);
        L[4 + g] = _mm512_and_si512(_mm512_srli_epi16(z, 4), low);
    }
    rx_vbmi_block(L, D, NULL, 8.0f, dst);
}

/* A dX block: k row q is stored row k0 + q, whose 16 j from j0 are half
 * of one block */
RX_BASE_BF16V static void block_q4_t_512(const unsigned char *data, size_t rb, size_t k0,
                                         size_t j0, uint16_t *dst) {
    const size_t off = j0 / Q4_BLOCK * Q4_BYTES;
    const int h = (int)(j0 % Q4_BLOCK / Q4_HALF);
    for (size_t p = 0; p < 16; p++) {
        const unsigned char *b0 = data + (k0 + 2 * p) * rb + off;
        _mm512_storeu_si512(dst + p * 32, rx_pair_rows(half_512(b0, h), half_512(b0 + rb, h)));
    }
}

/* a Q4_0 block's 16 bytes as its 32 q - 8 (low nibbles: values 0..15, the
 * low lane; high nibbles: 16..31, the high lane) */
RX_BASE_AVX2 static inline __m256i q4_bytes(const unsigned char *q) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)q), low = _mm_set1_epi8(0x0f);
    return _mm256_sub_epi8(
        _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low)),
        _mm256_set1_epi8(8));
}

/* rx_small_q32 over Q4_0 rows (its AVX2 frame: the loader inlines) */
__attribute__((target("avx2,fma,f16c"))) static size_t
small_q4_avx2(const unsigned char *data, size_t rb, size_t M, const float *A, size_t lda,
             size_t K, size_t kcb, size_t j0, size_t j1, int acc0, float *C, size_t ldc) {
    return rx_small_q32(data, rb, Q4_BYTES, q4_bytes, M, A, lda, K, kcb, j0, j1, acc0, C, ldc);
}

/* rx_sliver_q32 over Q4_0 rows (its AVX2 frame: the loader inlines) */
RX_BASE_AVX2 static void sliver_q4_avx2(const unsigned char *data, size_t rb, size_t j0,
                                        size_t p0, size_t kc, float *Bp) {
    rx_sliver_q32(data, rb, j0, p0, kc, Q4_BYTES, q4_bytes, Bp);
}
#endif

void rx_q4_0_decode(const unsigned char *row, size_t k0, size_t n, float *dst) {
    for (size_t k = k0; k < k0 + n;) {
        const unsigned char *blk = row + k / Q4_BLOCK * Q4_BYTES;
        uint16_t dh;
        memcpy(&dh, blk, 2);
        const float d = f16_f32(dh);
        const size_t end = (k / Q4_BLOCK + 1) * Q4_BLOCK;
        const size_t e = end < k0 + n ? end : k0 + n;
#ifdef RX_BASE_X86
        /* whole halves of the block: the AVX2 decoder's 16 at a time */
        if (k % Q4_HALF == 0 && e - k >= Q4_HALF && rx_cpu_base_avx2()) {
            for (; k + Q4_HALF <= e; k += Q4_HALF, dst += Q4_HALF)
                half_avx2(blk + 2, (int)(k % Q4_BLOCK / Q4_HALF), d, dst);
            continue;
        }
#endif
        for (size_t i = k; i < e; i++) {
            const size_t t = i % Q4_BLOCK;
            const int q = t < Q4_HALF ? blk[2 + t] & 15 : blk[2 + t - Q4_HALF] >> 4;
            *dst++ = (float)(q - 8) * d;
        }
        k = e;
    }
}

/* AVX2 where the CPU has it and the sliver is 16 rows of whole blocks;
 * else 0: the packer decodes row by row (the same bits) */
int rx_q4_0_sliver_f32(const unsigned char *data, size_t rb, size_t j0, size_t p0, size_t kc,
                       size_t nr, float *Bp) {
#ifdef RX_BASE_X86
    if (nr == 16 && p0 % Q4_BLOCK == 0 && kc % Q4_BLOCK == 0 && rx_cpu_base_avx2()) {
        sliver_q4_avx2(data, rb, j0, p0, kc, Bp);
        return 1;
    }
#endif
    (void)data, (void)rb, (void)j0, (void)p0, (void)kc, (void)nr, (void)Bp;
    return 0;
}

/* rx_bgemm's packed block: forward, column c's 32 k are one Q4_0 block of
 * stored row j0 + c (k0 is a multiple of 32); dX, k row q is stored row
 * k0 + q, whose 16 j from j0 are one half of a block (j0 a multiple of
 * 16). AVX512-BF16, else AVX2, where the CPU has it; else 0, and the
 * packer decodes and rounds each value itself (the same bits). */
int rx_q4_0_block_bf16(const unsigned char *data, size_t rb, int tb, size_t j0, size_t k0,
                       size_t bt_r, size_t bt_k, uint16_t *dst) {
#ifdef RX_BASE_X86
    const int lv = bt_r == 16 ? rx_cpu_base_simd() : 0;
    if (lv >= 3 && !tb) {
        block_q4_vbmi(data, rb, j0, k0, dst);
        return 1;
    }
    if (lv >= 2) {
        if (tb) block_q4_t_512(data, rb, k0, j0, dst);
        else rows_q4_512(data, rb, j0, k0, 1, RX_NO_ROWS, dst);
        return 1;
    }
    /* AVX2: an infinite scale (a value past 2^19) takes the packer's loops */
    if (bt_r == 16 && rx_cpu_base_avx2() && block_avx2(data, rb, tb, j0, k0, dst)) return 1;
#endif
    (void)data, (void)rb, (void)tb, (void)j0, (void)k0, (void)bt_r, (void)bt_k, (void)dst;
    return 0;   /* the packer's own loops: decode, then the GEMM's operand rounding */
}

/* AVX512-BF16 where the CPU has it; else 0 */
int rx_q4_0_rows_bf16(const unsigned char *data, size_t rb, size_t j0, size_t k0, size_t pj,
                      int pairs, uint16_t *dst) {
#ifdef RX_BASE_X86
    const int lv = rx_cpu_base_simd();
    if (pairs && lv >= 3) {
        rx_prefetch_rows(data, rb, pj, k0 / Q4_BLOCK, Q4_BYTES);
        block_q4_vbmi(data, rb, j0, k0, dst);
        return RX_ROWS_PAIRS;
    }
    if (lv >= 2) {
        rows_q4_512(data, rb, j0, k0, 0, pj, dst);
        return RX_ROWS_TILE;
    }
#endif
    (void)data, (void)rb, (void)j0, (void)k0, (void)pj, (void)pairs, (void)dst;
    return RX_ROWS_NONE;
}

/* AVX2 with FMA where the CPU has them; else 0: the GEMM packs slivers */
size_t rx_q4_0_small_f32(const unsigned char *data, size_t rb, size_t M, const float *A,
                        size_t lda, size_t K, size_t kcb, size_t j0, size_t j1, int acc0,
                        float *C, size_t ldc) {
#ifdef RX_BASE_X86
    if (rx_cpu_base_avx2() && __builtin_cpu_supports("fma"))
        return small_q4_avx2(data, rb, M, A, lda, K, kcb, j0, j1, acc0, C, ldc);
#endif
    (void)data, (void)rb, (void)M, (void)A, (void)lda, (void)K, (void)kcb, (void)j0, (void)j1;
    (void)acc0, (void)C, (void)ldc;
    return 0;
}
