/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * base_nf4.c -- the nf4 frozen-base dtype's kernels (its row of
 * rx_base_types, base_types.c): W^T [out][in] in QLoRA's NF4 blocks
 * (Dettmers et al. 2023, bitsandbytes' quantize_4bit, quant_type "nf4",
 * blocksize 64) along in: per RX_NF4_BLOCK values one float32 absmax, then
 * 32 bytes of 4-bit codes q (value 2i in byte i's high nibble, 2i + 1 in
 * its low nibble, bitsandbytes' packing), value = level[q] * absmax in
 * float32, the product bitsandbytes' dequantize_4bit computes. Its row's
 * sliver_f32 and block_bf16 are NULL: the GEMMs' packers decode row by row
 * through rx_nf4_decode, whose AVX2 form (the same products, bit for bit)
 * is picked at run time.
 */
#include <math.h>

#include "rx_base.h"
#include "rx_simd.h"

#define NF4_BLOCK RX_NF4_BLOCK
#define NF4_BYTES RX_NF4_BYTES
#define NF4_LEVELS 16

/* bitsandbytes' NF4 code (functional.get_4bit_type("nf4")), as float32:
 * the quantiles of N(0, 1) scaled to [-1, 1], with an exact 0 */
static const float level[NF4_LEVELS] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

/* bitsandbytes clamps absmax to this before taking 1 / absmax (a zero block's
 * scale stays finite: its values scale to 0, the code of level 0) */
#define NF4_MIN_ABSMAX 1e-38f

/* t's code, as torch.bucketize(t, bounds) with the float32 midpoints
 * bounds[i] = (level[i] + level[i + 1]) / 2: the bounds below t (a t on a
 * midpoint takes the lower level; a NaN none: code 0) */
static inline unsigned char nf4_code(float t) {
    unsigned char q = 0;
    for (int i = 0; i + 1 < NF4_LEVELS; i++) q += (level[i] + level[i + 1]) / 2.0f < t;
    return q;
}

/* One row of n values into an NF4 row, as bitsandbytes' quantize_4bit
 * (float32 throughout: absmax = max |x| (a NaN propagates), each value
 * scaled by 1 / max(absmax, 1e-38) and coded by the nearest level) */
void rx_nf4_from_float(const float *x, size_t n, unsigned char *dst) {
    for (size_t b = 0; b < n; b += NF4_BLOCK, dst += NF4_BYTES) {
        float amax = 0.0f;
        for (size_t i = 0; i < NF4_BLOCK; i++) {
            const float a = fabsf(x[b + i]);
            if (a > amax || isnan(a)) amax = a;
            if (isnan(a)) break;
        }
        const float s = 1.0f / (amax < NF4_MIN_ABSMAX ? NF4_MIN_ABSMAX : amax);
        memcpy(dst, &amax, 4);
        for (size_t i = 0; i < NF4_BLOCK / 2; i++)
            dst[4 + i] = (unsigned char)(nf4_code(x[b + 2 * i] * s) << 4 |
                                         nf4_code(x[b + 2 * i + 1] * s));
    }
}

#ifdef RX_BASE_X86
#define NF4_RUN 8   /* values the AVX2 decoder gives at a time: 4 bytes of codes */

/* values 2i, 2i + 1 of the 4 bytes q (i < 4): level[code] * amax, the
 * level picked from the two 8-level halves by the code's bit 3 */
RX_BASE_AVX2 static void run_avx2(const unsigned char *q, float amax, float *dst) {
    uint32_t w;
    memcpy(&w, q, 4);
    const __m128i b = _mm_cvtsi32_si128((int)w);
    const __m256i bb = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));   /* b0 b0 b1 b1 .. */
    const __m256i c = _mm256_and_si256(
        _mm256_srlv_epi32(bb, _mm256_setr_epi32(4, 0, 4, 0, 4, 0, 4, 0)), _mm256_set1_epi32(15));
    const __m256 lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(level), c);
    const __m256 hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(level + 8), c);
    const __m256 v = _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
    _mm256_storeu_ps(dst, _mm256_mul_ps(v, _mm256_set1_ps(amax)));
}
#endif

void rx_nf4_decode(const unsigned char *row, size_t k0, size_t n, float *dst) {
    for (size_t k = k0; k < k0 + n;) {
        const unsigned char *blk = row + k / NF4_BLOCK * NF4_BYTES;
        float amax;
        memcpy(&amax, blk, 4);
        const size_t end = (k / NF4_BLOCK + 1) * NF4_BLOCK;
        const size_t e = end < k0 + n ? end : k0 + n;
#ifdef RX_BASE_X86
        /* whole runs of 8 from a run's start: the AVX2 decoder's */
        if (k % NF4_RUN == 0 && e - k >= NF4_RUN && rx_cpu_base_avx2())
            for (; k + NF4_RUN <= e; k += NF4_RUN, dst += NF4_RUN)
                run_avx2(blk + 4 + k % NF4_BLOCK / 2, amax, dst);
#endif
        for (size_t i = k; i < e; i++) {
            const size_t t = i % NF4_BLOCK;
            const unsigned char byte = blk[4 + t / 2];
            *dst++ = level[t % 2 ? byte & 15 : byte >> 4] * amax;
        }
        k = e;
    }
}
