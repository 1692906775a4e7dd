/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * base_bf16.c -- the bf16 frozen-base dtype's kernels (its row of
 * rx_base_types, base_types.c): W^T [out][in] as bfloat16, 2 bytes a value,
 * torch's rounding (round to nearest even). A bf16 is a float32's upper
 * half, so every decode is a shift and a stored row is read in place.
 */
#include "rx_base.h"
#include "rx_simd.h"

void rx_bf16_from_float(const float *x, size_t n, unsigned char *dst) {
    for (size_t k = 0; k < n; k++) {
        const uint16_t v = to_bf16(x[k]);
        memcpy(dst + 2 * k, &v, 2);
    }
}

/* bf16 in, bf16 kept: a copy */
void rx_bf16_from_bf16(const uint16_t *h, size_t n, unsigned char *dst) { memcpy(dst, h, 2 * n); }

void rx_bf16_decode(const unsigned char *row, size_t k0, size_t n, float *dst) {
    const uint16_t *h = (const uint16_t *)(const void *)row + k0;
    for (size_t i = 0; i < n; i++) dst[i] = bits_f32((uint32_t)h[i] << 16);
}

#ifdef RX_BASE_X86
/* 16 words (32 bf16) with each subnormal half made a signed zero */
RX_BASE512 static inline __m512i flush16(__m512i v) {
    const __mmask32 sub = _mm512_testn_epi16_mask(v, _mm512_set1_epi16(0x7f80));
    return _mm512_mask_mov_epi16(v, sub, _mm512_and_si512(v, _mm512_set1_epi16((short)0x8000)));
}

/* The forward sliver of 16 bf16 rows (columns j) over k [p0, p0+kc), as
 * float32 k rows of 16: 16 k at a time, one transpose each */
RX_BASE512 static void sliver_bf16_512(const uint16_t *const rows[16], size_t p0, size_t kc,
                                        float *Bp) {
    size_t p = 0;
    for (; p + 16 <= kc; p += 16) {
        __m512i v[16];
        for (int j = 0; j < 16; j++)
            v[j] = _mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(rows[j] + p0 + p))),
                16);
        rx_transpose16(v);
        for (int q = 0; q < 16; q++) _mm512_storeu_si512(Bp + (p + q) * 16, v[q]);
    }
    for (; p < kc; p++) {
        uint32_t *dst = (uint32_t *)(void *)(Bp + p * 16);
        for (int j = 0; j < 16; j++) dst[j] = (uint32_t)rows[j][p0 + p] << 16;
    }
}

/* The forward sliver of 16 bf16 rows on AVX2, 16 k at a time: each half
 * of the rows (8 x 16 words, k 0..7 in the low lane, 8..15 in the high)
 * transposed per lane by three unpack stages (each rotates the 6-bit
 * (register, word) index left by one: register k then holds k's 8 rows,
 * k + 8's in the high lane), each word then made a float32's upper half */
RX_BASE_AVX2 static void sliver_bf16_avx2(const uint16_t *const rows[16], size_t kc, float *Bp) {
    const __m256i zero = _mm256_setzero_si256();
    size_t p = 0;
    for (; p + 16 <= kc; p += 16)
        for (int h = 0; h < 2; h++) {   /* rows 8h..8h+7: Bp columns 8h.. */
            __m256i r[8];
            for (int j = 0; j < 8; j++)
                r[j] = _mm256_loadu_si256((const __m256i *)(const void *)(rows[8 * h + j] + p));
            rx_transpose8_lanes(r, 1);
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {   /* (0, word) pairs: rows 0-3, 4-7 per lane */
                const __m256i lo = _mm256_unpacklo_epi16(zero, r[k]);
                const __m256i hi = _mm256_unpackhi_epi16(zero, r[k]);
                float *dst = Bp + (p + (size_t)k) * 16 + 8 * h;
                _mm256_storeu_si256((__m256i *)(void *)dst,
                                    _mm256_permute2x128_si256(lo, hi, 0x20));
                _mm256_storeu_si256((__m256i *)(void *)(dst + 8 * 16),
                                    _mm256_permute2x128_si256(lo, hi, 0x31));
            }
        }
    for (; p < kc; p++) {
        uint32_t *dst = (uint32_t *)(void *)(Bp + p * 16);
        for (size_t j = 0; j < 16; j++) dst[j] = (uint32_t)rows[j][p] << 16;
    }
}

/* ---- small M (decoding) ------------------------------------------------
 * C[M][j, j+8V) (+)= A[M][K] . W^T[j, j+8V)^T for M <= RX_SMALLQ_MAXM rows
 * read in place from W^T's bf16 rows, rx_small_q32's walk (rx_simd.h) 16 k
 * a step: per 8 rows the 8 x 32 bytes (8 k pairs a row) are transposed as
 * 32-bit lanes in registers (rx_transpose8x8: register m holds the 8 rows'
 * pair 2m, 2m + 1), and each pair becomes two float32 vectors without a
 * shuffle: k 2m the low words shifted up, k 2m + 1 the high words masked
 * (a bf16 under 16 zero bits: the decode's exact value). 24 shuffles per
 * 128 weights, where a sliver's word transpose and widening take 56 and
 * store and reload every float. Each C element is one FMA chain from zero
 * over each kcb-deep block of k, in k order, then added to C (stored in
 * the first block without acc0): the packed path's bits. */
#define SMALL_STEP 16   /* k a step: 32 bytes of a row */

__attribute__((target("avx2,fma"), always_inline)) static inline void
small_bf16_group(size_t M, size_t V, const unsigned char *data, size_t rb, const float *A,
                 size_t lda, size_t K, size_t kcb, size_t j, size_t j1, int acc0, float *C,
                 size_t ldc) {
    /* the next group's rows (up to j1), prefetched a slice a step, as
     * rx_small_q32_group does */
    const size_t nj = j + 16 * V <= j1 ? 8 * V : j + 8 * V < j1 ? j1 - j - 8 * V : 0;
    const char *pf = (const char *)data + (j + 8 * V) * rb;
    const size_t pf_step = (nj * rb / (K / SMALL_STEP) + 63) / 64 * 64;
    const char *pf_end = pf + nj * rb;
    const __m256 high = _mm256_castsi256_ps(_mm256_set1_epi32((int)0xFFFF0000u));
    for (size_t pc = 0; pc < K; pc += kcb) {
        const size_t kc = K - pc < kcb ? K - pc : kcb;
        __m256 c[8];   /* row i, columns 8v..: c[i V + v] */
#pragma GCC unroll 8
        for (size_t u = 0; u < M * V; u++) c[u] = _mm256_setzero_ps();
        for (size_t p = pc; p < pc + kc; p += SMALL_STEP) {
            for (const char *e = pf + pf_step; pf < e && pf < pf_end; pf += 64)
                _mm_prefetch(pf, RX_PREFETCH_AHEAD);
            const float *a = A + p;
#pragma GCC unroll 4
            for (size_t v = 0; v < V; v++) {
                const unsigned char *r0 = data + (j + 8 * v) * rb + 2 * p;
                __m256 r[8];
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++)
                    r[i] = _mm256_loadu_ps((const float *)(const void *)(r0 + i * rb));
                rx_transpose8x8(r);
#pragma GCC unroll 8
                for (int m = 0; m < 8; m++) {
                    const __m256 w0 =
                        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(r[m]), 16));
                    const __m256 w1 = _mm256_and_ps(r[m], high);
                    rx_small_fma(M, V, v, a, lda, 2 * (size_t)m, w0, c);
                    rx_small_fma(M, V, v, a, lda, 2 * (size_t)m + 1, w1, c);
                }
            }
        }
        rx_small_store(M, V, c, pc > 0 || acc0, C, ldc, j);
    }
}

/* small_bf16_group over columns [j0, j1): the columns done from j0 (a
 * multiple of 8), 0 past RX_SMALLQ_MAXM rows or a K not of whole steps */
__attribute__((target("avx2,fma"))) static size_t
small_bf16_avx2(const unsigned char *data, size_t rb, size_t M, const float *A, size_t lda,
                size_t K, size_t kcb, size_t j0, size_t j1, int acc0, float *C, size_t ldc) {
    size_t j = j0;
    if (M < 1 || M > RX_SMALLQ_MAXM || kcb % SMALL_STEP || K % SMALL_STEP) return 0;
#define SMALL_GROUP(m, vv) small_bf16_group(m, vv, data, rb, A, lda, K, kcb, j, j1, acc0, C, ldc)
    RX_SMALL_BY_M(M, j, j1, SMALL_GROUP);
#undef SMALL_GROUP
    return j - j0;
}

/* A forward block of rx_bgemm's op(B) from a bf16 base: column c's 32 k
 * are 64 bytes of its stored row; one transpose of the 16 runs */
RX_BASE512 static void block_bf16_512(const unsigned char *const rows[16], uint16_t *dst) {
    __m512i v[16];
    for (int c = 0; c < 16; c++) v[c] = flush16(_mm512_loadu_si512(rows[c]));
    rx_transpose16(v);
    for (int p = 0; p < 16; p++) _mm512_storeu_si512(dst + p * 32, v[p]);
}

/* A dX block from a bf16 base: k pair p is stored rows 2p, 2p+1 at j0 */
RX_BASE512 static void block_bf16_t_512(const unsigned char *data, size_t rb, size_t k0,
                                         size_t j0, uint16_t *dst) {
    for (int p = 0; p < 16; p++) {
        const uint16_t *r0 = (const uint16_t *)(const void *)(data + (k0 + 2 * p) * rb) + j0;
        const uint16_t *r1 = (const uint16_t *)(const void *)(data + (k0 + 2 * p + 1) * rb) + j0;
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)r0));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)r1));
        _mm512_storeu_si512(dst + p * 32, flush16(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16))));
    }
}
#endif

/* k-major over the sliver's nr stored rows: each Bp row written whole */
int rx_bf16_sliver_f32(const unsigned char *data, size_t rb, size_t j0, size_t p0, size_t kc,
                       size_t nr, float *Bp) {
    const uint16_t *rows[64];
    for (size_t j = 0; j < nr; j++)
        rows[j] = (const uint16_t *)(const void *)(data + (j0 + j) * rb) + p0;
#ifdef RX_BASE_X86
    if (nr == 16 && rx_cpu_base_simd() >= 1) {
        sliver_bf16_512(rows, 0, kc, Bp);
        return 1;
    }
    if (nr == 16 && rx_cpu_base_avx2()) {
        sliver_bf16_avx2(rows, kc, Bp);
        return 1;
    }
#endif
    for (size_t p = 0; p < kc; p++) {
        uint32_t *dst = (uint32_t *)(void *)(Bp + p * nr);
        for (size_t j = 0; j < nr; j++) dst[j] = (uint32_t)rows[j][p] << 16;
    }
    return 1;
}

/* Two bf16 (a 32-bit word) as the GEMM's operand rounding leaves them:
 * a subnormal becomes a signed zero (a stored bf16 is finite) */
static inline uint32_t flush_pair(uint32_t v) {
    const uint32_t lo = (v & 0x7f80u) ? 0xffffu : 0x8000u;
    const uint32_t hi = (v & 0x7f800000u) ? 0xffff0000u : 0x80000000u;
    return v & (lo | hi);
}

int rx_bf16_block_bf16(const unsigned char *data, size_t rb, int tb, size_t j0, size_t k0,
                       size_t bt_r, size_t bt_k, uint16_t *dst) {
    uint32_t *d32 = (uint32_t *)(void *)dst;   /* word (p, c): the k pair 2p, 2p+1 */
#ifdef RX_BASE_X86
    const int lv = bt_r == 16 ? rx_cpu_base_simd() : 0;
    if (lv >= 1 && !tb) {
        const unsigned char *rows[16];
        for (int c = 0; c < 16; c++) rows[c] = data + (j0 + c) * rb + 2 * k0;
        block_bf16_512(rows, dst);
        return 1;
    }
    if (lv >= 1 && tb) {
        block_bf16_t_512(data, rb, k0, j0, dst);
        return 1;
    }
#endif
    if (!tb) {
        /* column c's k pairs are its stored row's 32-bit words */
        for (size_t c = 0; c < bt_r; c++) {
            const unsigned char *row = data + (j0 + c) * rb + 2 * k0;
            for (size_t p = 0; p < bt_k / 2; p++) {
                uint32_t v;
                memcpy(&v, row + 4 * p, 4);
                d32[p * bt_r + c] = flush_pair(v);
            }
        }
        return 1;
    }
    for (size_t p = 0; p < bt_k / 2; p++) {   /* two stored rows make a k pair */
        const uint16_t *r0 = (const uint16_t *)(const void *)(data + (k0 + 2 * p) * rb) + j0;
        const uint16_t *r1 = (const uint16_t *)(const void *)(data + (k0 + 2 * p + 1) * rb) + j0;
        for (size_t c = 0; c < bt_r; c++)
            d32[p * bt_r + c] = flush_pair((uint32_t)r0[c] | (uint32_t)r1[c] << 16);
    }
    return 1;
}

/* AVX2 with FMA where the CPU has them; else 0: the GEMM packs slivers */
size_t rx_bf16_small_f32(const unsigned char *data, size_t rb, size_t M, const float *A,
                         size_t lda, size_t K, size_t kcb, size_t j0, size_t j1, int acc0,
                         float *C, size_t ldc) {
#ifdef RX_BASE_X86
    if (rx_cpu_base_avx2() && __builtin_cpu_supports("fma"))
        return small_bf16_avx2(data, rb, M, A, lda, K, kcb, j0, j1, acc0, C, ldc);
#endif
    (void)data, (void)rb, (void)M, (void)A, (void)lda, (void)K, (void)kcb, (void)j0, (void)j1;
    (void)acc0, (void)C, (void)ldc;
    return 0;
}
