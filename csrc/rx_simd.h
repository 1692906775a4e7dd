/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * rx_simd.h -- AVX-512 helpers shared by the GEMMs (gemm.c, gemm_bf16.c).
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
#endif

#endif /* RWKVX_SIMD_H */
