/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * base_q8_0.c -- the q8_0 frozen-base dtype's kernels (its row of
 * rx_base_types, base_types.c): W^T [out][in] in GGUF Q8_0 blocks along in,
 * per RX_Q8_0_BLOCK values one fp16 scale d, then the int8 q
 * (RX_Q8_0_BYTES bytes), value = q * d; the bytes are those of
 * gguf.quants.quantize(W^T, Q8_0). q * d is exact in float32.
 */
#include <math.h>

#include "rx_base.h"
#include "rx_simd.h"

#define Q8_BLOCK RX_Q8_0_BLOCK
#define Q8_BYTES RX_Q8_0_BYTES

/* One row of n values into a Q8_0 row, as gguf's Q8_0.quantize_blocks
 * (float32 throughout: d = amax / 127, id = 1 / d or 0, q = roundf(x id)) */
void rx_q8_0_from_float(const float *x, size_t n, unsigned char *dst) {
    for (size_t b = 0; b < n; b += Q8_BLOCK, dst += Q8_BYTES) {
        float amax = 0.0f;
        for (size_t i = 0; i < Q8_BLOCK; i++) amax = fmaxf(amax, fabsf(x[b + i]));
        const float d = amax / 127.0f, id = d == 0.0f ? 0.0f : 1.0f / d;
        const uint16_t dh = to_f16(d);
        memcpy(dst, &dh, 2);
        for (size_t i = 0; i < Q8_BLOCK; i++) {
            const float q = roundf(x[b + i] * id);
            dst[2 + i] = (unsigned char)(int8_t)q;
        }
    }
}

void rx_q8_0_decode(const unsigned char *row, size_t k0, size_t n, float *dst) {
    for (size_t k = k0; k < k0 + n;) {
        const unsigned char *blk = row + k / Q8_BLOCK * Q8_BYTES;
        uint16_t dh;
        memcpy(&dh, blk, 2);
        const float d = f16_f32(dh);
        const size_t e = (k / Q8_BLOCK + 1) * Q8_BLOCK < k0 + n ? (k / Q8_BLOCK + 1) * Q8_BLOCK
                                                                : k0 + n;
        const int8_t *q = (const int8_t *)(blk + 2);
        for (size_t i = k; i < e; i++) *dst++ = (float)q[i % Q8_BLOCK] * d;
        k = e;
    }
}

#ifdef RX_BASE_X86
/* The same from a Q8_0 base: column c's 32 k are one block, q * d rounded
 * by vcvtne2ps2bf16, the GEMM's own operand rounding */
RX_BASE_BF16V static void block_q8_512(const unsigned char *const blks[16], uint16_t *dst) {
    __m512i v[16];
    for (int c = 0; c < 16; c++) {
        uint16_t dh;
        memcpy(&dh, blks[c], 2);
        const __m512 d = _mm512_set1_ps(f16_f32(dh));
        const __m256i q = _mm256_loadu_si256((const __m256i *)(blks[c] + 2));
        const __m512 x0 = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), d);
        const __m512 x1 = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), d);
        v[c] = rx_pairs32(x0, x1);
    }
    rx_transpose16(v);
    for (int p = 0; p < 16; p++) _mm512_storeu_si512(dst + p * 32, v[p]);
}

/* block_q8_512's block from bytes (rx_vbmi_block: a third of its
 * shuffles, which bind on the shuffle pipes: 52 ns a block hot in L1 on
 * Zen 4, against 36), for columns [j0, j0+16) at k0: q flipped to q + 128 */
RX_BASE_BF16VB static void block_q8_vbmi(const unsigned char *data, size_t rb, size_t j0,
                                         size_t k0, uint16_t *dst) {
    const unsigned char *blk = data + j0 * rb + k0 / Q8_BLOCK * Q8_BYTES;
    __m512 D[2];
    rx_vbmi_scales(blk, rb, D);
    __m512i L[8];
    rx_vbmi_rows32(blk + 2, rb, L);
    for (int i = 0; i < 8; i++) L[i] = _mm512_xor_si512(L[i], _mm512_set1_epi8((char)0x80));
    rx_vbmi_block(L, D, NULL, 128.0f, dst);
}

/* 16 stored rows' blocks at k0 into a row-major [16][32] tile: block_q8_512's
 * values (q * d rounded by vcvtne2ps2bf16), not transposed. The caller's
 * next 16 rows (from pj: one contiguous run) are prefetched a 16-block
 * slice a call (rx_prefetch_rows), so they are in cache when it walks them
 * (16 rows stepping along k are more streams than the hardware prefetchers
 * follow: 39-44 tokens/s without it, 95-97 with it, 0.1B batch-1 decode on
 * a 2-core Sapphire Rapids). */
RX_BASE_BF16V static void rows_q8_512(const unsigned char *data, size_t rb, size_t j0, size_t k0,
                                      size_t pj, uint16_t *dst) {
    const unsigned char *blk = data + j0 * rb + k0 / Q8_BLOCK * Q8_BYTES;
    rx_prefetch_rows(data, rb, pj, k0 / Q8_BLOCK, Q8_BYTES);
    /* the 16 scales by one vcvtph2ps (f16_f32's values, as rx_small_q32_group's) */
    uint16_t dh[16];
    _Alignas(64) float D[16];
    for (int r = 0; r < 16; r++) memcpy(&dh[r], blk + (size_t)r * rb, 2);
    _mm512_store_ps(D, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)dh)));
    RX_SCALES_IN_MEMORY();
    for (int r = 0; r < 16; r++, blk += rb) {
        const __m512 d = _mm512_set1_ps(D[r]);
        const __m512 x0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                            _mm_loadu_si128((const __m128i *)(const void *)(blk + 2)))), d);
        const __m512 x1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                            _mm_loadu_si128((const __m128i *)(const void *)(blk + 18)))), d);
        _mm512_storeu_si512(dst + 32 * r, rx_pairs32(x0, x1));
    }
}

/* A dX block from a Q8_0 base: k row q is stored row k0 + q, whose 16 j
 * from j0 lie in one Q8_0 block; rows 2p, 2p+1 decoded (q * d, exact) and
 * rounded as the GEMM rounds its operands, then interleaved into k pairs */
RX_BASE_BF16V static void block_q8_t_512(const unsigned char *data, size_t rb, size_t k0,
                                         size_t j0, uint16_t *dst) {
    const size_t off = j0 / Q8_BLOCK * Q8_BYTES + 2 + j0 % Q8_BLOCK;
    for (int p = 0; p < 16; p++) {
        __m512 x[2];
        for (int h = 0; h < 2; h++) {
            const unsigned char *q = data + (k0 + 2 * (size_t)p + (size_t)h) * rb + off;
            uint16_t dh;
            memcpy(&dh, q - 2 - j0 % Q8_BLOCK, 2);
            const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)q);
            x[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)),
                                 _mm512_set1_ps(f16_f32(dh)));
        }
        _mm512_storeu_si512(dst + p * 32, rx_pair_rows(x[0], x[1]));
    }
}

/* a Q8_0 block's q: its 32 int8 as they are */
RX_BASE_AVX2 static inline __m256i q8_bytes(const unsigned char *q) {
    return _mm256_loadu_si256((const __m256i *)(const void *)q);
}

/* rx_small_q32 over Q8_0 rows (its AVX2 frame: the loader inlines) */
__attribute__((target("avx2,fma,f16c"))) static size_t
small_q8_avx2(const unsigned char *data, size_t rb, size_t M, const float *A, size_t lda,
             size_t K, size_t kcb, size_t j0, size_t j1, int acc0, float *C, size_t ldc) {
    return rx_small_q32(data, rb, Q8_BYTES, q8_bytes, M, A, lda, K, kcb, j0, j1, acc0, C, ldc);
}

/* rx_sliver_q32 over Q8_0 rows (its AVX2 frame: the loader inlines) */
RX_BASE_AVX2 static void sliver_q8_avx2(const unsigned char *data, size_t rb, size_t j0,
                                        size_t p0, size_t kc, float *Bp) {
    rx_sliver_q32(data, rb, j0, p0, kc, Q8_BYTES, q8_bytes, Bp);
}
#endif

/* AVX2 where the CPU has it and the sliver is 16 rows of whole blocks;
 * else 0: the packer decodes row by row (the same bits) */
int rx_q8_0_sliver_f32(const unsigned char *data, size_t rb, size_t j0, size_t p0, size_t kc,
                       size_t nr, float *Bp) {
#ifdef RX_BASE_X86
    if (nr == 16 && p0 % Q8_BLOCK == 0 && kc % Q8_BLOCK == 0 && rx_cpu_base_avx2()) {
        sliver_q8_avx2(data, rb, j0, p0, kc, Bp);
        return 1;
    }
#endif
    (void)data, (void)rb, (void)j0, (void)p0, (void)kc, (void)nr, (void)Bp;
    return 0;
}

/* q * d (a Q8_0 value: finite, zero or at least 2^-24) rounded to bf16 as
 * operand_bf16 rounds it, without its branches for NaN and subnormals */
static inline uint16_t round_q8(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* AVX512-BF16 where the CPU has it (k0 a multiple of 32); else 0 */
int rx_q8_0_rows_bf16(const unsigned char *data, size_t rb, size_t j0, size_t k0, size_t pj,
                      int pairs, uint16_t *dst) {
#ifdef RX_BASE_X86
    const int lv = k0 % Q8_BLOCK == 0 ? rx_cpu_base_simd() : 0;
    if (pairs && lv >= 3) {
        rx_prefetch_rows(data, rb, pj, k0 / Q8_BLOCK, Q8_BYTES);
        block_q8_vbmi(data, rb, j0, k0, dst);
        return RX_ROWS_PAIRS;
    }
    if (lv >= 2) {
        rows_q8_512(data, rb, j0, k0, pj, dst);
        return RX_ROWS_TILE;
    }
#endif
    (void)data, (void)rb, (void)j0, (void)k0, (void)pj, (void)pairs, (void)dst;
    return RX_ROWS_NONE;
}

int rx_q8_0_block_bf16(const unsigned char *data, size_t rb, int tb, size_t j0, size_t k0,
                       size_t bt_r, size_t bt_k, uint16_t *dst) {
#ifdef RX_BASE_X86
    const int lv = bt_r == 16 ? rx_cpu_base_simd() : 0;
    if (lv >= 3 && !tb) {
        block_q8_vbmi(data, rb, j0, k0, dst);
        return 1;
    }
    if (lv >= 2 && !tb) {
        const unsigned char *blks[16];
        for (int c = 0; c < 16; c++) blks[c] = data + (j0 + c) * rb + k0 / Q8_BLOCK * Q8_BYTES;
        block_q8_512(blks, dst);
        return 1;
    }
    if (lv >= 2 && tb) {
        block_q8_t_512(data, rb, k0, j0, dst);
        return 1;
    }
#endif
    if (tb) return 0;   /* k row q is stored row k0 + q: the packer's decode of its 16 j */
    /* column c: one Q8_0 block (k0 is a multiple of 32) */
    uint32_t *d32 = (uint32_t *)(void *)dst;   /* word (p, c): the k pair 2p, 2p+1 */
    float run[64];
    for (size_t c = 0; c < bt_r; c++) {
        rx_q8_0_decode(data + (j0 + c) * rb, k0, bt_k, run);
        for (size_t p = 0; p < bt_k / 2; p++)
            d32[p * bt_r + c] = (uint32_t)round_q8(run[2 * p]) |
                                (uint32_t)round_q8(run[2 * p + 1]) << 16;
    }
    return 1;
}

/* AVX2 with FMA where the CPU has them; else 0: the GEMM packs slivers */
size_t rx_q8_0_small_f32(const unsigned char *data, size_t rb, size_t M, const float *A,
                        size_t lda, size_t K, size_t kcb, size_t j0, size_t j1, int acc0,
                        float *C, size_t ldc) {
#ifdef RX_BASE_X86
    if (rx_cpu_base_avx2() && __builtin_cpu_supports("fma"))
        return small_q8_avx2(data, rb, M, A, lda, K, kcb, j0, j1, acc0, C, ldc);
#endif
    (void)data, (void)rb, (void)M, (void)A, (void)lda, (void)K, (void)kcb, (void)j0, (void)j1;
    (void)acc0, (void)C, (void)ldc;
    return 0;
}
