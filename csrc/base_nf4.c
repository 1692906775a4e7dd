/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * base_nf4.c -- the nf4 frozen-base dtype's kernels (its row of
 * rx_base_types, base_types.c): W^T [out][in] in QLoRA's NF4 blocks
 * (Dettmers et al. 2023, bitsandbytes' quantize_4bit, quant_type "nf4",
 * blocksize 64) along in: per RX_NF4_BLOCK values one float32 absmax, then
 * 32 bytes of 4-bit codes q (value 2i in byte i's high nibble, 2i + 1 in
 * its low nibble, bitsandbytes' packing), value = level[q] * absmax in
 * float32, the product bitsandbytes' dequantize_4bit computes. It has no
 * vector form (its row's sliver_f32 and block_bf16 are NULL): the GEMMs'
 * packers decode row by row through rx_nf4_decode.
 */
#include <math.h>

#include "rx_base.h"

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

void rx_nf4_decode(const unsigned char *row, size_t k0, size_t n, float *dst) {
    for (size_t k = k0; k < k0 + n;) {
        const unsigned char *blk = row + k / NF4_BLOCK * NF4_BYTES;
        float amax;
        memcpy(&amax, blk, 4);
        const size_t end = (k / NF4_BLOCK + 1) * NF4_BLOCK;
        const size_t e = end < k0 + n ? end : k0 + n;
        for (size_t i = k; i < e; i++) {
            const size_t t = i % NF4_BLOCK;
            const unsigned char byte = blk[4 + t / 2];
            *dst++ = level[t % 2 ? byte & 15 : byte >> 4] * amax;
        }
        k = e;
    }
}
