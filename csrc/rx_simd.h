/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * rx_simd.h -- SIMD helpers shared by the GEMMs (gemm.c, gemm_bf16.c) and
 * the frozen base's decoders (base_<dtype>.c).
 * Each carries its own target attribute, so it inlines into any caller
 * compiled for a superset (the runtime dispatch picks those callers only
 * on CPUs that have it).
 */
#ifndef RWKVX_SIMD_H
#define RWKVX_SIMD_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* In-register 16x16 transpose of 32-bit elements: r[q] lane i becomes r[i]
 * lane q. */
__attribute__((target("avx512f"))) static inline void rx_transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int q = 0; q < 16; q += 2) {
        t[q] = _mm512_unpacklo_epi32(r[q], r[q + 1]);
        t[q + 1] = _mm512_unpackhi_epi32(r[q], r[q + 1]);
    }
    /* u[4g+c]: column c (+4 per 128-bit lane) of rows 4g..4g+3 */
    for (int g = 0; g < 16; g += 4) {
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
        __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
        __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
        r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        r[c + 8] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
        r[c + 4] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        r[c + 12] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
    }
}

/* Lanes of a 16-wide access inside [0, n - from) */
static inline __mmask16 rx_lanes(size_t from, size_t n) {
    return from >= n ? 0 : n - from >= 16 ? 0xffff : (__mmask16)((1u << (n - from)) - 1u);
}

/* The forward sliver of 16 stored rows over one 32-value block of an int8
 * quantised dtype (Q8_0's q, Q4_0's q - 8): r[j] row j's 32 q (k 0..15 in
 * the low 128-bit lane, 16..31 in the high), dh[j] its fp16 scale; out k
 * rows of 16 float32 q * d, k-major, at Bp [32][16]. q * d is exact (an
 * 8-bit q times an 11-bit d; vcvtph2ps's d is f16_f32's, a signalling NaN
 * quieted as the product quiets it), so these are the scalar decoder's
 * bits (tests/test_base_sliver.py). Each half of the rows is byte
 * transposed per lane: three unpack stages of rows i and i + 4, each
 * rotating the 7-bit (register, byte) index left by one, leave in register
 * m the 8 rows' bytes of k = 2m (bytes 0..7) and 2m + 1 (8..15), +16 in
 * the high lane; each run of 8 is then widened, converted and scaled.
 * (Eight registers a half, not sixteen: no spills, fewer shuffles.) */
__attribute__((target("avx2,f16c"))) static inline void
rx_sliver_q32_block(__m256i r[16], const uint16_t dh[16], float *Bp) {
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)dh));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(dh + 8)));
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {   /* rows 8h..8h+7: Bp's columns 8h.. */
        __m256i v[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) v[i] = r[8 * h + i];
#pragma GCC unroll 3
        for (int s = 0; s < 3; s++) {
            __m256i t[8];
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                t[2 * i] = _mm256_unpacklo_epi8(v[i], v[i + 4]);
                t[2 * i + 1] = _mm256_unpackhi_epi8(v[i], v[i + 4]);
            }
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) v[i] = t[i];
        }
        const __m256 d = h ? d1 : d0;
#pragma GCC unroll 8
        for (int m = 0; m < 8; m++)
#pragma GCC unroll 2
            for (int l = 0; l < 2; l++) {   /* k = 2m + 16 l, then k + 1 */
                const __m128i x =
                    l ? _mm256_extracti128_si256(v[m], 1) : _mm256_castsi256_si128(v[m]);
                const __m256i q0 = _mm256_cvtepi8_epi32(x);
                const __m256i q1 = _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(x, x));
                float *dst = Bp + (size_t)(2 * m + 16 * l) * 16 + 8 * h;
                _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtepi32_ps(q0), d));
                _mm256_storeu_ps(dst + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(q1), d));
            }
    }
}

/* The forward sliver of the 16 stored rows [j0, j0+16) of rb bytes over k
 * [p0, p0+kc) (whole 32-value blocks) of a dtype whose block is its fp16
 * scale, then its q in blk_bytes - 2 bytes, load(q) reading them as 32
 * int8 (lanes as rx_sliver_q32_block takes them; a constant, inlined) */
__attribute__((target("avx2,f16c"), always_inline)) static inline void
rx_sliver_q32(const unsigned char *data, size_t rb, size_t j0, size_t p0, size_t kc,
              size_t blk_bytes, __m256i (*load)(const unsigned char *q), float *Bp) {
    for (size_t p = 0; p < kc; p += 32, Bp += 32 * 16) {
        const unsigned char *blk = data + j0 * rb + (p0 + p) / 32 * blk_bytes;
        __m256i q[16];
        uint16_t dh[16];
        for (int j = 0; j < 16; j++, blk += rb) {
            /* the row 64 on (the GEMM's next group of slivers, the
             * sliver after next): 16 to 64 short runs at once are too many
             * streams for the hardware's prefetchers (a block's start lies
             * in each 64-byte line) */
            _mm_prefetch((const char *)(blk + 64 * rb), _MM_HINT_T0);
            memcpy(&dh[j], blk, 2);
            q[j] = load(blk + 2);
        }
        rx_sliver_q32_block(q, dh, Bp);
    }
}
#endif

#endif /* RWKVX_SIMD_H */
