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

/* The hint of the prefetches that stream a frozen base's next rows (a
 * column block or a group ahead) while the small-M kernels decode: into
 * L2. Into L1 (prefetcht0) the lines for tens of KiB ahead found L1 full
 * of the rows being decoded and their requests waited on its full miss
 * queue. Batch-1 decode on Zen 4 (2 cores), prefetcht1 against prefetcht0:
 * exact Q8_0 at bf16 precision 1.5B 84 against 95 ms a token (best steps);
 * at fp32 precision (the AVX2 kernels) 62 against 88; a bf16 base at fp32
 * precision 102 against 139; the AVX2 fast decode 56 against 83. */
#define RX_PREFETCH_AHEAD _MM_HINT_T1

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

/* ---- a frozen base's bf16 operands (AVX512-BF16) ------------------------
 * A dtype's AVX-512 decoder gives a row's 32 values from k as two halves
 * x0 (k..k+15) and x1 (k+16..); these round them as the bf16 GEMM rounds
 * its operands (vcvtne2ps2bf16, rx_bf16_operand) into its layouts. */
#define RX_BF16V_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline))

/* 32 values as 16 k pairs, in order: a row of AMX's A tile */
RX_BF16V_TARGET static inline __m512i rx_pairs32(__m512 x0, __m512 x1) {
    return (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
}

/* Row h of a pair of a 4-bit format's tile rows: its 32 values (words, in
 * k order) picked by its 32 4-bit codes (idx, one a byte) from tab, the
 * pair's tables (rx_pairs32 of each row's 16 possible values as floats:
 * row 2i's in words 0..15, 2i + 1's in 16..31). Each possible value is
 * computed and rounded once, as the decoders compute and round it, so the
 * same bits, and a row takes one word permute where widening, converting,
 * scaling and rounding each value took eight shuffle-port and arithmetic
 * operations. */
RX_BF16V_TARGET static inline __m512i rx_pick16(__m512i tab, __m256i idx, int h) {
    const __m512i w = _mm512_cvtepu8_epi16(idx);
    return _mm512_permutexvar_epi16(h ? _mm512_add_epi16(w, _mm512_set1_epi16(16)) : w, tab);
}

/* After a block's 16 scales are stored to an array: keeps them there, so a
 * row's _mm512_set1_ps is a broadcast load and not a register permute
 * (vpbroadcastd and vpermd) on the shuffle port the rows' widening binds
 * (a Q8_0 tile, 16 rows: 38 -> 35 ns hot on one Sapphire Rapids core). */
#define RX_SCALES_IN_MEMORY() __asm__ volatile("" ::: "memory")

/* rows 2p (r0) and 2p + 1 (r1) of 16 columns as row p of a packed block:
 * word 2c row 2p's value c, word 2c + 1 row 2p + 1's */
RX_BF16V_TARGET static inline __m512i rx_pair_rows(__m512 r0, __m512 r1) {
    const __m512i mix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    return _mm512_permutexvar_epi16(mix, (__m512i)_mm512_cvtne2ps_pbh(r1, r0));
}

/* ---- AVX-512 VBMI beside AVX512-BF16: a block from bytes -----------------
 * A block of 16 columns by 32 k whose values are small integers times a
 * column scale (Q8_0: q * d; Q4_0: (q - 8) * d), less a column min where
 * it has one (Q4_K: q (d sc) - dmin m), is built with its bytes
 * transposed first and widened last: 8 registers of 64 bytes where
 * widening first (vpmovsxbd, then a transpose of 16 rows of words) moves
 * 16, and no int-to-float conversion. L[4h + g], 128-bit lane s: column
 * 4g + s's values 16h..16h+15 as unsigned bytes u, value = u - off. Three
 * two-source permutes (the caller's load order, qwords, dwords) give O(t):
 * column c's 4 bytes k 4t..4t+3 in dword c. Each output row, k pair
 * 2t + k1, is two vectors of 16 lanes, (c, k0) for columns 0..7 and 8..15:
 * one vpermt2b puts lane (c, k0)'s byte under the exponent 0x4B of a
 * constant second source, the float 2^23 + u, whose minus (2^23 + off) is
 * the integer exactly, then times its column's scale (exact: a few bits
 * times an 11-bit half, or Q4_K's 17-bit d sc), less its min in the same
 * fused operation (one rounding, as the decoders' exact product and
 * rounded subtraction), and rounded by vcvtne2ps2bf16, as the decoders
 * that widen first round: the same bits. */
#define RX_BF16VB_TARGET                                                                      \
    __attribute__((target("avx512f,avx512bw,avx512bf16,avx512vbmi"), always_inline))

/* v's lane c, column c's value, as V[e], lane 2c' + k0 holding column
 * 8e + c''s */
RX_BF16VB_TARGET static inline void rx_vbmi_lanes(__m512 v, __m512 V[2]) {
    const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    V[0] = _mm512_permutexvar_ps(twice, v);
    V[1] = _mm512_permutexvar_ps(_mm512_add_epi32(twice, _mm512_set1_epi32(8)), v);
}

/* the fp16 scales that open the 16 columns' blocks (column c's at blk +
 * c rb) as D (rx_vbmi_lanes; vcvtph2ps: f16_f32's values) */
RX_BF16VB_TARGET static inline void rx_vbmi_scales(const unsigned char *blk, size_t rb,
                                                   __m512 D[2]) {
    uint16_t dh[16];
    for (int c = 0; c < 16; c++) memcpy(&dh[c], blk + (size_t)c * rb, 2);
    rx_vbmi_lanes(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)dh)), D);
}

/* L (as above) from the 16 rows' 32 bytes at p + r rb, as stored (the
 * caller maps them to u after, byte by byte): two rows a register as
 * loaded (rows 2i, 2i + 1), then of registers 2g and 2g + 1 the lanes 0
 * and 2 (bytes 0..15) as L[g], 1 and 3 (bytes 16..31) as L[4 + g] */
RX_BF16VB_TARGET static inline void rx_vbmi_rows32(const unsigned char *p, size_t rb,
                                                   __m512i L[8]) {
    __m512i R[8];
    for (int i = 0; i < 8; i++)
        R[i] = _mm512_inserti64x4(
            _mm512_castsi256_si512(
                _mm256_loadu_si256((const __m256i *)(const void *)(p + (size_t)(2 * i) * rb))),
            _mm256_loadu_si256((const __m256i *)(const void *)(p + (size_t)(2 * i + 1) * rb)), 1);
    for (int g = 0; g < 4; g++) {
        L[g] = _mm512_shuffle_i64x2(R[2 * g], R[2 * g + 1], 0x88);
        L[4 + g] = _mm512_shuffle_i64x2(R[2 * g], R[2 * g + 1], 0xDD);
    }
}

/* L (as above) and D into the packed block at dst (row p: k pair 2p,
 * 2p + 1; word 2c + k0 column c's). Mn (NULL: none), lanes as D's: each
 * column's min m negated, for (u - off) d - m, the exact product less m
 * in one rounding by a fused multiply-add (Q4_K's value); NULL or not at
 * each use, a constant. */
RX_BF16VB_TARGET static inline void rx_vbmi_block(const __m512i L[8], const __m512 D[2],
                                                  const __m512 *Mn, float off, uint16_t *dst) {
    /* M: columns 4g + s of g and g + 2 (c3 0, 1), 8 k from 8 k3, in qwords */
    const __m512i by_k3[2] = {_mm512_set_epi64(14, 12, 10, 8, 6, 4, 2, 0),
                              _mm512_set_epi64(15, 13, 11, 9, 7, 5, 3, 1)};
    /* O(t), t = 4h + 2 k3 + k2: dword c from M of c2 */
    const __m512i by_k2[2] = {
        _mm512_set_epi32(30, 28, 26, 24, 14, 12, 10, 8, 22, 20, 18, 16, 6, 4, 2, 0),
        _mm512_set_epi32(31, 29, 27, 25, 15, 13, 11, 9, 23, 21, 19, 17, 7, 5, 3, 1)};
    /* the vpermt2b index of output half (k1, e): lane l = 2c' + k0 takes
     * byte 4 (8e + c') + 2 k1 + k0 of O(t), then bytes 1, 1 and 3 of the
     * constant (64 + i: the second source); (k1, e) adds 2 k1 + 32 e to
     * byte 0 alone */
#define RX_VBMI_PICK(l) (int)(0x43414100u | (4u * ((l) / 2u) + (l) % 2u))
    const __m512i pick0 = _mm512_set_epi32(
        RX_VBMI_PICK(15), RX_VBMI_PICK(14), RX_VBMI_PICK(13), RX_VBMI_PICK(12), RX_VBMI_PICK(11),
        RX_VBMI_PICK(10), RX_VBMI_PICK(9), RX_VBMI_PICK(8), RX_VBMI_PICK(7), RX_VBMI_PICK(6),
        RX_VBMI_PICK(5), RX_VBMI_PICK(4), RX_VBMI_PICK(3), RX_VBMI_PICK(2), RX_VBMI_PICK(1),
        RX_VBMI_PICK(0));
#undef RX_VBMI_PICK
    __m512i pick[4];
    for (int i = 0; i < 4; i++)
        pick[i] = _mm512_add_epi32(pick0, _mm512_set1_epi32(2 * (i / 2) + 32 * (i % 2)));
    const __m512i exponent = _mm512_set1_epi32(0x4B000000);
    const __m512 bias = _mm512_set1_ps(8388608.0f + off);   /* 2^23 + off, exact */
    for (int h = 0; h < 2; h++)
        for (int k3 = 0; k3 < 2; k3++) {
            const __m512i m0 = _mm512_permutex2var_epi64(L[4 * h], by_k3[k3], L[4 * h + 2]);
            const __m512i m1 = _mm512_permutex2var_epi64(L[4 * h + 1], by_k3[k3], L[4 * h + 3]);
            for (int k2 = 0; k2 < 2; k2++) {
                const __m512i o = _mm512_permutex2var_epi32(m0, by_k2[k2], m1);
                const int t = 4 * h + 2 * k3 + k2;
                for (int k1 = 0; k1 < 2; k1++) {
                    __m512 x[2];
                    for (int e = 0; e < 2; e++) {
                        const __m512 u = _mm512_sub_ps(
                            _mm512_castsi512_ps(
                                _mm512_permutex2var_epi8(o, pick[2 * k1 + e], exponent)),
                            bias);
                        x[e] = Mn ? _mm512_fmadd_ps(u, D[e], Mn[e]) : _mm512_mul_ps(u, D[e]);
                    }
                    _mm512_storeu_si512(dst + (2 * t + k1) * 32, rx_pairs32(x[0], x[1]));
                }
            }
        }
}

/* Slice c of the 16 stored rows from pj (rows of rb bytes, one contiguous
 * run of 16 rb bytes; RX_NO_ROWS: none) into cache: slice c is the run's
 * bytes [16 c sb, 16 (c + 1) sb), sb the bytes a row gives a call, so the
 * calls walking a row's rb / sb pieces fetch the whole run once
 * (RX_PREFETCH_AHEAD). */
__attribute__((always_inline)) static inline void rx_prefetch_rows(const unsigned char *data,
                                                                   size_t rb, size_t pj, size_t c,
                                                                   size_t sb) {
    if (pj == (size_t)-1) return;
    const char *pf = (const char *)data + pj * rb + c * 16 * sb;
    for (size_t l = 0; l < 16 * sb; l += 64) _mm_prefetch(pf + l, RX_PREFETCH_AHEAD);
}

/* Lanes of a 16-wide access inside [0, n - from) */
static inline __mmask16 rx_lanes(size_t from, size_t n) {
    return from >= n ? 0 : n - from >= 16 ? 0xffff : (__mmask16)((1u << (n - from)) - 1u);
}

/* The transpose of 8 rows per 128-bit lane, of bytes (words 0: 32 bytes a
 * row) or of 16-bit words (words 1: 16 a row): three unpack stages of rows
 * i and i + 4, each rotating the (register, element) index left by one,
 * leave in register m the 8 rows' bytes 2m (bytes 0..7 of it) and 2m + 1
 * (8..15), +16 in the high lane; or their words m, +8 in the high lane.
 * words is a constant at each use. */
__attribute__((target("avx2"), always_inline)) static inline void
rx_transpose8_lanes(__m256i v[8], int words) {
#pragma GCC unroll 3
    for (int s = 0; s < 3; s++) {
        __m256i t[8];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            t[2 * i] = words ? _mm256_unpacklo_epi16(v[i], v[i + 4])
                             : _mm256_unpacklo_epi8(v[i], v[i + 4]);
            t[2 * i + 1] = words ? _mm256_unpackhi_epi16(v[i], v[i + 4])
                                 : _mm256_unpackhi_epi8(v[i], v[i + 4]);
        }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) v[i] = t[i];
    }
}

/* In-register transpose of 8 rows of 8 32-bit lanes: r[i] lane m becomes
 * r[m] lane i (float shuffles move the bits as they are). */
__attribute__((target("avx2"), always_inline)) static inline void rx_transpose8x8(__m256 r[8]) {
    __m256 t[8], u[8];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {   /* rows 2i, 2i+1: lanes (0, 1 | 4, 5), (2, 3 | 6, 7) */
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {   /* rows 4h..4h+3: lane m | m + 4 in u[4h + m] */
        u[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
        u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
        u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
        u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
    }
#pragma GCC unroll 4
    for (int m = 0; m < 4; m++) {
        r[m] = _mm256_permute2f128_ps(u[m], u[m + 4], 0x20);
        r[m + 4] = _mm256_permute2f128_ps(u[m], u[m + 4], 0x31);
    }
}

/* The forward sliver of 16 stored rows over one 32-value block of an int8
 * quantised dtype (Q8_0's q, Q4_0's q - 8): r[j] row j's 32 q (k 0..15 in
 * the low 128-bit lane, 16..31 in the high), dh[j] its fp16 scale; out k
 * rows of 16 float32 q * d, k-major, at Bp [32][16]. q * d is exact (an
 * 8-bit q times an 11-bit d; vcvtph2ps's d is f16_f32's, a signalling NaN
 * quieted as the product quiets it), so these are the scalar decoder's
 * bits (tests/test_base_sliver.py). Each half of the rows is byte
 * transposed per lane (rx_transpose8_lanes: register m holds the 8 rows'
 * k = 2m and 2m + 1, +16 in the high lane); each run of 8 is then widened,
 * converted and scaled.
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
        rx_transpose8_lanes(v, 0);
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

/* ---- small M over a q32 dtype's stored rows (decoding) ----------------------
 * C[M][j, j+8V) (+)= A[M][K] . W^T[j, j+8V)^T for M <= 4 rows, W^T's rows of
 * rb bytes in 32-value blocks of blk_bytes (its fp16 scale d, then its q,
 * load(q) their 32 int8 as rx_sliver_q32_block takes them). Summed as every
 * rx_sgemm kernel sums: each C element one FMA chain from zero over each
 * kcb-deep block of k, in k order, then added to C (stored, in the first
 * block without acc0): the packed path's bits. What makes it cheaper than a
 * sliver packed then multiplied: per 8 rows and block the 8 x 32 bytes are
 * transposed in registers (rx_transpose8_lanes) into a
 * 256-byte L1 buffer T, never widened to floats there; each k then reads its
 * 8 rows' bytes back (vpmovsxbd), converts them and multiplies by the rows'
 * scales (q * d, exact, the sliver's value) just before its FMAs, so a
 * weight costs five vector instructions (load, widen, convert, scale, FMA)
 * and no float store, against the sliver's eight. V groups of 8 columns side
 * by side give M V FMA chains (4 at M 1, V 4: with V's scales and the
 * broadcasts that fills the 16 registers; V 8 spilled and was no faster).
 * From 5 rows the packed sliver, whose decode the rows share, is as fast
 * (768 x 3072, one thread, Zen 3). */
#define RX_SMALLQ_MAXM 4

/* A small-M kernel's walk over columns [j, j1) for M rows (1 to
 * RX_SMALLQ_MAXM): groups of 8 vv columns (vv by M: M vv <= 8 FMA chains),
 * then groups of 8; GROUP(m, vv) does the group at j, m and vv constants.
 * Leaves j past the columns done (the rest, fewer than 8, the caller's). */
#define RX_SMALL_BY_M(M, j, j1, GROUP)                                                           \
    do {                                                                                         \
        switch (M) {                                                                             \
            case 1:                                                                              \
                for (; (j) + 32 <= (j1); (j) += 32) GROUP(1, 4);                                 \
                for (; (j) + 8 <= (j1); (j) += 8) GROUP(1, 1);                                   \
                break;                                                                           \
            case 2:                                                                              \
                for (; (j) + 16 <= (j1); (j) += 16) GROUP(2, 2);                                 \
                for (; (j) + 8 <= (j1); (j) += 8) GROUP(2, 1);                                   \
                break;                                                                           \
            case 3:                                                                              \
                for (; (j) + 16 <= (j1); (j) += 16) GROUP(3, 2);                                 \
                for (; (j) + 8 <= (j1); (j) += 8) GROUP(3, 1);                                   \
                break;                                                                           \
            case 4:                                                                              \
                for (; (j) + 16 <= (j1); (j) += 16) GROUP(4, 2);                                 \
                for (; (j) + 8 <= (j1); (j) += 8) GROUP(4, 1);                                   \
                break;                                                                           \
            default: break;                                                                      \
        }                                                                                        \
    } while (0)

/* offset in a block's transposed bytes of k's 8 rows (register m = k % 16 /
 * 2 holds k = 2m and 2m + 1 in bytes 0..15, +16 in bytes 16..31) */
#define RX_SMALLQ_OFF(k) ((k) % 16 / 2 * 32 + (k) / 16 * 16 + (k) % 2 * 8)

/* k's FMAs of column group v: c[i V + v] += a[i][k] w for the M rows (of
 * stride lda) */
__attribute__((target("avx2,fma"), always_inline)) static inline void
rx_small_fma(size_t M, size_t V, size_t v, const float *a, size_t lda, size_t k, __m256 w,
             __m256 *c) {
#pragma GCC unroll 8
    for (size_t i = 0; i < M; i++)
        c[i * V + v] = _mm256_fmadd_ps(_mm256_broadcast_ss(a + i * lda + k), w, c[i * V + v]);
}

/* a kcb-deep block's sums c[i V + v] into C's rows i, columns j + 8v:
 * stored, or added to C's own where acc */
__attribute__((target("avx2"), always_inline)) static inline void
rx_small_store(size_t M, size_t V, const __m256 *c, int acc, float *C, size_t ldc, size_t j) {
#pragma GCC unroll 8
    for (size_t i = 0; i < M; i++)
#pragma GCC unroll 4
        for (size_t v = 0; v < V; v++) {
            float *ci = C + i * ldc + j + 8 * v;
            _mm256_storeu_ps(ci, acc ? _mm256_add_ps(c[i * V + v], _mm256_loadu_ps(ci))
                                     : c[i * V + v]);
        }
}

__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
rx_small_q32_group(size_t M, size_t V, const unsigned char *data, size_t rb, size_t blk_bytes,
                   __m256i (*load)(const unsigned char *q), const float *A, size_t lda,
                   size_t K, size_t kcb, size_t j, size_t j1, int acc0, float *C,
                   size_t ldc) {
    /* the next group's rows (up to j1), one contiguous run of memory,
     * prefetched a slice a block step: 8 V rows stepping along k at once
     * are more streams than the hardware prefetchers follow */
    const size_t nj = j + 16 * V <= j1 ? 8 * V : j + 8 * V < j1 ? j1 - j - 8 * V : 0;
    const char *pf = (const char *)data + (j + 8 * V) * rb;
    const size_t pf_step = (nj * rb / (K / 32) + 63) / 64 * 64;
    const char *pf_end = pf + nj * rb;
    /* + 16: each k's 8 bytes are read as 16 (a load vpmovsxbd takes in place) */
    _Alignas(32) unsigned char T[4 * 256 + 16];
    _Alignas(32) float D[4][8];
    for (size_t pc = 0; pc < K; pc += kcb) {
        const size_t kc = K - pc < kcb ? K - pc : kcb;
        __m256 c[8];   /* row i, columns 8v..: c[i V + v] */
#pragma GCC unroll 8
        for (size_t u = 0; u < M * V; u++) c[u] = _mm256_setzero_ps();
        for (size_t p = pc; p < pc + kc; p += 32) {
#pragma GCC unroll 4
            for (size_t v = 0; v < V; v++) {
                const unsigned char *blk = data + (j + 8 * v) * rb + p / 32 * blk_bytes;
                __m256i r[8];
                uint16_t dh[8];
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) {
                    memcpy(&dh[i], blk + i * rb, 2);
                    r[i] = load(blk + i * rb + 2);
                }
                rx_transpose8_lanes(r, 0);
#pragma GCC unroll 8
                for (int m = 0; m < 8; m++)
                    _mm256_store_si256((__m256i *)(void *)(T + 256 * v + 32 * m), r[m]);
                /* d: vcvtph2ps, f16_f32's value (as rx_sliver_q32_block) */
                _mm256_store_ps(D[v], _mm256_cvtph_ps(
                                          _mm_loadu_si128((const __m128i *)(const void *)dh)));
            }
            for (const char *e = pf + pf_step; pf < e && pf < pf_end; pf += 64)
                _mm_prefetch(pf, RX_PREFETCH_AHEAD);
            /* T read back from memory, not kept in registers: a load per k
             * is cheaper than the shuffles that would pick its bytes */
            __asm__ volatile("" ::: "memory");
            const float *a = A + p;
#pragma GCC unroll 32
            for (size_t k = 0; k < 32; k++) {
#pragma GCC unroll 4
                for (size_t v = 0; v < V; v++) {
                    const __m128i q = _mm_loadu_si128(
                        (const __m128i *)(const void *)(T + 256 * v + RX_SMALLQ_OFF(k)));
                    const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                                                   _mm256_load_ps(D[v]));
                    rx_small_fma(M, V, v, a, lda, k, w, c);
                }
            }
        }
        rx_small_store(M, V, c, pc > 0 || acc0, C, ldc, j);
    }
}

/* rx_small_q32_group over columns [j0, j1) of the forward product C[M][N]
 * (+)= A[M][K] . op(B), op(B) = W stored as rows of W^T: groups of 8V
 * columns (V by M: M V <= 8 chains), then groups of 8; returns the columns
 * done from j0 (a multiple of 8: the rest is the caller's), 0 when M is
 * past RX_SMALLQ_MAXM */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline size_t
rx_small_q32(const unsigned char *data, size_t rb, size_t blk_bytes,
             __m256i (*load)(const unsigned char *q), size_t M, const float *A, size_t lda,
             size_t K, size_t kcb, size_t j0, size_t j1, int acc0, float *C, size_t ldc) {
    size_t j = j0;
    if (M < 1 || M > RX_SMALLQ_MAXM || kcb % 32 || K % 32) return 0;
#define RX_SMALLQ_GROUP(m, vv)                                                                  \
    rx_small_q32_group(m, vv, data, rb, blk_bytes, load, A, lda, K, kcb, j, j1, acc0, C, ldc)
    RX_SMALL_BY_M(M, j, j1, RX_SMALLQ_GROUP);
#undef RX_SMALLQ_GROUP
    return j - j0;
}
#endif

#endif /* RWKVX_SIMD_H */
