/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * gemm_bf16.c -- the projections' GEMM in bf16 mixed precision.
 *
 *     C[M,N] = beta*C + op(A)[M,K] . op(B)[K,N]      (rx_sgemm's arguments)
 *
 * computed on operands rounded to bfloat16 (round to nearest even;
 * results in the bf16 subnormal range flush to signed zero, as the bf16
 * dot-product instructions treat subnormal inputs) with fp32 accumulation
 * and an fp32 C. The product of two bf16 numbers is exact in fp32, so every
 * kernel below adds the same exact products: they differ only in the order
 * of the fp32 additions, and at most in products below 2^-126 that the
 * hardware flushes to zero. For a dot product of length K with P = the sum
 * of |a_k b_k| over the rounded operands, any two kernels therefore agree
 * within 2 * K * 2^-24 * (P + |C_old|) + K * 2^-125 (Higham's gamma_K bound
 * for each ordering, plus the flushed products); tests/test_gemm_bf16.py
 * holds them to that.
 *
 * Both operands are converted once per call into a packed bf16 copy:
 *   op(A): 16-row x 32-k blocks, each 16 rows of 64 bytes (an AMX A tile);
 *   op(B): 16-column x 32-k blocks, each 16 rows of k pairs x 16 columns
 *          (the "VNNI" layout of an AMX B tile, and one zmm per k pair).
 * M and N are padded with zeros to multiples of 32, K to a multiple of 32.
 * One layout serves every kernel:
 *   "amx-bf16"    2x2 AMX tiles (_tile_dpbf16ps), a 32x32 C block per pass;
 *   "avx512-bf16" 8x32 register tiles of vdpbf16ps (16 accumulators);
 *   "generic-bf16" portable C over the same packed operands, so a machine
 *          without bf16 hardware computes the same products.
 * The kernel is picked at run time (AMX where the CPU has AMX-BF16 and Linux
 * grants the tile-data state, else AVX512-BF16, else generic); everything
 * bf16-specific is compiled with per-function target attributes, so a
 * default build runs on any x86-64.
 *
 * Threading: a batch of independent GEMMs (as rx_sgemm_batch) packs all its
 * operands in one parallel pass, then computes C in 64 x 128 units. Each C
 * element is summed over all of K by one thread in a fixed order, so the
 * result does not depend on the thread count.
 */
#include <string.h>

#include "rx_internal.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define RX_BF16_X86 1
#endif

#define BT_R 16              /* rows of a packed block (an AMX tile's rows) */
#define BT_K 32              /* k values of a packed block row: 64 bytes */
#define BT_E (BT_R * BT_K)   /* bf16 elements of one packed block (1 KiB) */
#define BLK 32               /* C block of one kernel call: 2x2 tiles */
#define UNIT_M 64            /* rows of a parallel compute unit */
#define UNIT_N 128           /* columns of a parallel compute unit */
#define PACK_BLKS 4          /* 16-row (or -column) blocks per packing task */
#define MAX_OPS 16           /* ops of one pass (rx_sgemm_batch's batch size) */

typedef uint16_t bf16;

/* ---- rounding ------------------------------------------------------------ */

/* fp32 -> bf16, round to nearest even; NaN stays a (quiet) NaN; a result in
 * the bf16 subnormal range becomes a signed zero. */
static inline bf16 bf16_round(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    if (!(r & 0x7f80u)) r &= 0x8000u;
    return (bf16)r;
}

static inline float bf16_float(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* ---- one GEMM's packed operands ------------------------------------------ */

typedef struct {
    const rx_gemm_op *g;
    size_t mp, np, nkc;   /* M, N padded to BLK; K in BT_K chunks */
    bf16 *ap, *bp;        /* [mp/16][nkc][16][32], [np/16][nkc][16][32] */
} bop;

static inline float opa(const rx_gemm_op *g, size_t i, size_t k) {
    return g->ta ? g->A[k * g->lda + i] : g->A[i * g->lda + k];
}

static inline float opb(const rx_gemm_op *g, size_t k, size_t j) {
    return g->tb ? g->B[j * g->ldb + k] : g->B[k * g->ldb + j];
}

/* Packs the 16-row blocks [b0,b1) of op(A). */
static void pack_a_generic(const bop *o, size_t b0, size_t b1) {
    const rx_gemm_op *g = o->g;
    for (size_t rb = b0; rb < b1; rb++)
        for (size_t kc = 0; kc < o->nkc; kc++) {
            bf16 *dst = o->ap + (rb * o->nkc + kc) * BT_E;
            for (size_t r = 0; r < BT_R; r++)
                for (size_t q = 0; q < BT_K; q++) {
                    size_t i = rb * BT_R + r, k = kc * BT_K + q;
                    dst[r * BT_K + q] = i < g->M && k < g->K ? bf16_round(opa(g, i, k)) : 0;
                }
        }
}

/* Packs the 16-column blocks [b0,b1) of op(B): row p of a block holds the
 * k pair (2p, 2p+1) of its 16 columns interleaved. */
static void pack_b_generic(const bop *o, size_t b0, size_t b1) {
    const rx_gemm_op *g = o->g;
    for (size_t cb = b0; cb < b1; cb++)
        for (size_t kc = 0; kc < o->nkc; kc++) {
            bf16 *dst = o->bp + (cb * o->nkc + kc) * BT_E;
            for (size_t q = 0; q < BT_K; q++)
                for (size_t c = 0; c < BT_R; c++) {
                    size_t k = kc * BT_K + q, j = cb * BT_R + c;
                    dst[q / 2 * BT_K + 2 * c + q % 2] =
                        j < g->N && k < g->K ? bf16_round(opb(g, k, j)) : 0;
                }
        }
}

/* Adds (acc) or writes the mr x nr valid part of a BLK x BLK result t. */
static void store_block(const float *t, float *C, size_t ldc, size_t mr, size_t nr, int acc) {
    for (size_t i = 0; i < mr; i++)
        for (size_t j = 0; j < nr; j++)
            C[i * ldc + j] = acc ? C[i * ldc + j] + t[i * BLK + j] : t[i * BLK + j];
}

/* C block [mr<=32][nr<=32] (+)= Ap[32 rows] . Bp[32 columns] over nkc
 * chunks; Ap, Bp point at the first of two consecutive row / column blocks
 * (the second is nkc blocks further on). */
typedef void (*bkernel_fn)(const bf16 *Ap, const bf16 *Bp, size_t nkc, float *C, size_t ldc,
                           size_t mr, size_t nr, int acc);

/* Sums in the order vdpbf16ps documents: per k pair the odd product, then
 * the even one, each added to the fp32 accumulator. */
static void kernel_generic(const bf16 *Ap, const bf16 *Bp, size_t nkc, float *C, size_t ldc,
                           size_t mr, size_t nr, int acc) {
    float t[BLK * BLK];
    for (size_t i = 0; i < BLK; i++) {
        const bf16 *a = Ap + (i / BT_R) * nkc * BT_E + (i % BT_R) * BT_K;
        float s[BLK] = {0};
        for (size_t kc = 0; kc < nkc; kc++)
            for (size_t p = 0; p < BT_K / 2; p++) {
                float a0 = bf16_float(a[kc * BT_E + 2 * p]), a1 = bf16_float(a[kc * BT_E + 2 * p + 1]);
                for (size_t j = 0; j < BLK; j++) {
                    const bf16 *b = Bp + (j / BT_R) * nkc * BT_E + kc * BT_E + p * BT_K + 2 * (j % BT_R);
                    s[j] += a1 * bf16_float(b[1]);
                    s[j] += a0 * bf16_float(b[0]);
                }
            }
        memcpy(t + i * BLK, s, sizeof s);
    }
    store_block(t, C, ldc, mr, nr, acc);
}

#ifdef RX_BF16_X86
#define RX_PACK512 __attribute__((target("avx512f,avx512bw")))
#define RX_DPBF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define RX_AMX __attribute__((target("avx512f,avx512bw,amx-tile,amx-bf16")))

/* bf16_round on 16 lanes, each result in the low half of its 32-bit lane. */
RX_PACK512 static inline __m512i round16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)),
                                                     _mm512_set1_epi32(0x7fff)));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
    const __mmask16 sub = _mm512_testn_epi32_mask(r, _mm512_set1_epi32(0x7f80));
    return _mm512_mask_and_epi32(r, sub, r, _mm512_set1_epi32(0x8000));
}

/* 16 floats of row k and 16 of row k+1 (either may be masked to zero) as 16
 * k pairs, the row-k value in the low half. */
RX_PACK512 static inline __m512i pair16(__m512 lo, __m512 hi) {
    return _mm512_or_si512(round16(lo), _mm512_slli_epi32(round16(hi), 16));
}

/* 32 consecutive floats (k in order) as 16 k pairs. */
RX_PACK512 static inline __m512i run32(__m512 x0, __m512 x1) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(round16(x0))),
                              _mm512_cvtepi32_epi16(round16(x1)), 1);
}

/* In-register 16x16 transpose of 32-bit elements: r[q] lane i becomes r[i]
 * lane q. */
RX_PACK512 static inline void transpose16(__m512i r[16]) {
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

/* Lanes of a 16-wide load inside [0, n - from) */
static inline __mmask16 lanes(size_t from, size_t n) {
    return from >= n ? 0 : n - from >= 16 ? 0xffff : (__mmask16)((1u << (n - from)) - 1u);
}

/* A run of 16 k values starting at k of a row whose valid k are < K,
 * zero past K (and everywhere for a row past the matrix: row NULL). */
RX_PACK512 static inline __m512 load16(const float *row, size_t k, size_t K) {
    return row ? _mm512_maskz_loadu_ps(lanes(k, K), row + k) : _mm512_setzero_ps();
}

/* pack_a_generic with AVX-512: rows of an untransposed A are 32-float
 * runs; a transposed A is read as k-rows of 16 floats, paired and
 * transposed in registers. */
RX_PACK512 static void pack_a_512(const bop *o, size_t b0, size_t b1) {
    const rx_gemm_op *g = o->g;
    const size_t M = g->M, K = g->K;
    for (size_t rb = b0; rb < b1; rb++)
        for (size_t kc = 0; kc < o->nkc; kc++) {
            bf16 *dst = o->ap + (rb * o->nkc + kc) * BT_E;
            const size_t i0 = rb * BT_R, k0 = kc * BT_K;
            if (!g->ta) {
                for (size_t r = 0; r < BT_R; r++) {
                    const float *row = i0 + r < M ? g->A + (i0 + r) * g->lda : NULL;
                    _mm512_storeu_si512(dst + r * BT_K,
                                        run32(load16(row, k0, K), load16(row, k0 + 16, K)));
                }
                continue;
            }
            __m512i v[16];
            const __mmask16 mi = lanes(i0, M);
            for (size_t p = 0; p < 16; p++) {
                size_t k = k0 + 2 * p;
                __m512 lo = k < K ? _mm512_maskz_loadu_ps(mi, g->A + k * g->lda + i0)
                                  : _mm512_setzero_ps();
                __m512 hi = k + 1 < K ? _mm512_maskz_loadu_ps(mi, g->A + (k + 1) * g->lda + i0)
                                      : _mm512_setzero_ps();
                v[p] = pair16(lo, hi);
            }
            transpose16(v);
            for (size_t r = 0; r < BT_R; r++) _mm512_storeu_si512(dst + r * BT_K, v[r]);
        }
}

/* pack_b_generic with AVX-512: an untransposed B pairs two k-rows of 16
 * columns; a transposed one reads each column's 32-float k run and
 * transposes. */
RX_PACK512 static void pack_b_512(const bop *o, size_t b0, size_t b1) {
    const rx_gemm_op *g = o->g;
    const size_t N = g->N, K = g->K;
    for (size_t cb = b0; cb < b1; cb++)
        for (size_t kc = 0; kc < o->nkc; kc++) {
            bf16 *dst = o->bp + (cb * o->nkc + kc) * BT_E;
            const size_t j0 = cb * BT_R, k0 = kc * BT_K;
            if (!g->tb) {
                const __mmask16 mj = lanes(j0, N);
                for (size_t p = 0; p < 16; p++) {
                    size_t k = k0 + 2 * p;
                    __m512 lo = k < K ? _mm512_maskz_loadu_ps(mj, g->B + k * g->ldb + j0)
                                      : _mm512_setzero_ps();
                    __m512 hi = k + 1 < K ? _mm512_maskz_loadu_ps(mj, g->B + (k + 1) * g->ldb + j0)
                                          : _mm512_setzero_ps();
                    _mm512_storeu_si512(dst + p * BT_K, pair16(lo, hi));
                }
                continue;
            }
            __m512i v[16];
            for (size_t c = 0; c < 16; c++) {
                const float *row = j0 + c < N ? g->B + (j0 + c) * g->ldb : NULL;
                v[c] = run32(load16(row, k0, K), load16(row, k0 + 16, K));
            }
            transpose16(v);
            for (size_t p = 0; p < 16; p++) _mm512_storeu_si512(dst + p * BT_K, v[p]);
        }
}

/* 8 rows x 32 columns of C from rows [0,8) of the 16-row A blocks at a
 * (stride nkc blocks: Ap of kernel_avx512bf16 plus a row offset). */
RX_DPBF16 static inline void dp8x32(const bf16 *a, const bf16 *b0, const bf16 *b1, size_t nkc,
                                    float *t) {
    __m512 c[8][2];
    for (int i = 0; i < 8; i++) c[i][0] = c[i][1] = _mm512_setzero_ps();
    for (size_t kc = 0; kc < nkc; kc++, a += BT_E, b0 += BT_E, b1 += BT_E)
        for (size_t p = 0; p < BT_K / 2; p++) {
            const __m512bh x0 = (__m512bh)_mm512_load_si512(b0 + p * BT_K);
            const __m512bh x1 = (__m512bh)_mm512_load_si512(b1 + p * BT_K);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                int32_t w;
                memcpy(&w, a + i * BT_K + 2 * p, sizeof w);
                const __m512bh y = (__m512bh)_mm512_set1_epi32(w);
                c[i][0] = _mm512_dpbf16_ps(c[i][0], y, x0);
                c[i][1] = _mm512_dpbf16_ps(c[i][1], y, x1);
            }
        }
    for (int i = 0; i < 8; i++) {
        _mm512_storeu_ps(t + i * BLK, c[i][0]);
        _mm512_storeu_ps(t + i * BLK + 16, c[i][1]);
    }
}

RX_DPBF16 static void kernel_avx512bf16(const bf16 *Ap, const bf16 *Bp, size_t nkc, float *C,
                                        size_t ldc, size_t mr, size_t nr, int acc) {
    float t[BLK * BLK] __attribute__((aligned(64)));
    const bf16 *b1 = Bp + nkc * BT_E;
    for (size_t i = 0; i < BLK; i += 8)
        if (i < mr)
            dp8x32(Ap + (i / BT_R) * nkc * BT_E + (i % BT_R) * BT_K, Bp, b1, nkc, t + i * BLK);
    if (mr == BLK && nr == BLK) {
        for (size_t i = 0; i < BLK; i++)
            for (size_t h = 0; h < BLK; h += 16) {
                __m512 x = _mm512_load_ps(t + i * BLK + h);
                float *c = C + i * ldc + h;
                _mm512_storeu_ps(c, acc ? _mm512_add_ps(_mm512_loadu_ps(c), x) : x);
            }
        return;
    }
    store_block(t, C, ldc, mr, nr, acc);
}

/* The AMX tile configuration: palette 1, every tile 16 rows of 64 bytes. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

/* ldtilecfg by hand: GCC 12's _tile_loadconfig tells the compiler it reads
 * only 8 bytes of the configuration, which lets it drop the stores to the
 * rest (the instruction then faults on garbage). */
RX_AMX static void amx_configure(void) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

RX_AMX static void amx_release(void) { _tile_release(); }

/* Tiles 0-3 hold C (rows 0-15 / 16-31 x columns 0-15 / 16-31), 4-5 the two
 * A blocks, 6-7 the two B blocks of the current k chunk. Accumulates from
 * zero and adds the old C after, as the other kernels do. */
RX_AMX static void kernel_amx(const bf16 *Ap, const bf16 *Bp, size_t nkc, float *C, size_t ldc,
                              size_t mr, size_t nr, int acc) {
    const bf16 *a1 = Ap + nkc * BT_E, *b1 = Bp + nkc * BT_E;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (size_t kc = 0; kc < nkc; kc++) {
        _tile_loadd(4, Ap + kc * BT_E, 64);
        _tile_loadd(6, Bp + kc * BT_E, 64);
        _tile_loadd(7, b1 + kc * BT_E, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a1 + kc * BT_E, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    if (mr == BLK && nr == BLK && !acc) {
        const size_t s = ldc * sizeof(float);
        _tile_stored(0, C, s);
        _tile_stored(1, C + 16, s);
        _tile_stored(2, C + 16 * ldc, s);
        _tile_stored(3, C + 16 * ldc + 16, s);
        return;
    }
    float t[BLK * BLK] __attribute__((aligned(64)));
    const size_t s = BLK * sizeof(float);
    _tile_stored(0, t, s);
    _tile_stored(1, t + 16, s);
    _tile_stored(2, t + 16 * BLK, s);
    _tile_stored(3, t + 16 * BLK + 16, s);
    if (mr == BLK && nr == BLK) {
        for (size_t i = 0; i < BLK; i++)
            for (size_t h = 0; h < BLK; h += 16) {
                float *c = C + i * ldc + h;
                _mm512_storeu_ps(c, _mm512_add_ps(_mm512_loadu_ps(c), _mm512_load_ps(t + i * BLK + h)));
            }
        return;
    }
    store_block(t, C, ldc, mr, nr, acc);
}

/* CPUID / XCR0 checks the compiler's __builtin_cpu_supports may not know. */
static int cpuid_bit(unsigned leaf, unsigned sub, int reg, int bit) {
    unsigned r[4];
    if (!__get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3])) return 0;
    return (r[reg] >> bit) & 1;
}

static uint64_t xcr0(void) {
    if (!cpuid_bit(1, 0, 2, 27)) return 0;   /* OSXSAVE */
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (uint64_t)hi << 32 | lo;
}

static int have_avx512bf16(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           cpuid_bit(7, 1, 0, 5);
}

/* AMX-BF16 and AMX-TILE in CPUID, the tile state enabled in XCR0, and
 * Linux's per-process permission for the tile data (ARCH_REQ_XCOMP_PERM
 * for XFEATURE_XTILEDATA), asked once. A refusal (an old kernel, a
 * seccomp filter) leaves AMX off and the AVX512-BF16 kernel in use. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
static int have_amx(void) {
    static int ok = -1;
    int v = __atomic_load_n(&ok, __ATOMIC_ACQUIRE);
    if (v >= 0) return v;
    v = have_avx512bf16() && cpuid_bit(7, 0, 3, 22) && cpuid_bit(7, 0, 3, 24) &&
        (xcr0() & (3u << 17)) == (3u << 17) &&
        syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    __atomic_store_n(&ok, v, __ATOMIC_RELEASE);
    return v;
}
#endif

typedef struct {
    const char *name;
    bkernel_fn kern;
    void (*pack_a)(const bop *, size_t, size_t);
    void (*pack_b)(const bop *, size_t, size_t);
    int amx;   /* tile configuration around the kernel calls */
} bgemm_impl;

static const bgemm_impl bimpl_generic = {"generic-bf16", kernel_generic, pack_a_generic,
                                         pack_b_generic, 0};
#ifdef RX_BF16_X86
static const bgemm_impl bimpl_avx512 = {"avx512-bf16", kernel_avx512bf16, pack_a_512, pack_b_512,
                                        0};
static const bgemm_impl bimpl_amx = {"amx-bf16", kernel_amx, pack_a_512, pack_b_512, 1};
#endif

static const bgemm_impl *const bimpls[] = {
#ifdef RX_BF16_X86
    &bimpl_amx, &bimpl_avx512,
#endif
    &bimpl_generic};

static int bimpl_runs(const bgemm_impl *im) {
#ifdef RX_BF16_X86
    if (im == &bimpl_amx) return have_amx();
    if (im == &bimpl_avx512) return have_avx512bf16();
#endif
    return im == &bimpl_generic;
}

/* Set by rx_bgemm_use_kernel or RWKVX_BF16_KERNEL; NULL: pick by CPU. */
static const bgemm_impl *forced_bimpl;

int rx_bgemm_use_kernel(const char *name) {
    if (!name) {
        forced_bimpl = NULL;
        return RX_OK;
    }
    for (size_t i = 0; i < sizeof bimpls / sizeof bimpls[0]; i++)
        if (!strcmp(name, bimpls[i]->name) && bimpl_runs(bimpls[i])) {
            forced_bimpl = bimpls[i];
            return RX_OK;
        }
    return rx_fail(RX_EINVAL, "rx_bgemm_use_kernel: kernel \"%s\" is unknown or cannot run here",
                   name);
}

static const bgemm_impl *pick_bimpl(void) {
    if (forced_bimpl) return forced_bimpl;
    static const bgemm_impl *picked;
    const bgemm_impl *im = __atomic_load_n(&picked, __ATOMIC_ACQUIRE);
    if (im) return im;
    /* the environment may name a kernel (tests, benchmarks); one this CPU
     * cannot run is ignored */
    const char *env = getenv("RWKVX_BF16_KERNEL");
    for (size_t i = 0; i < sizeof bimpls / sizeof bimpls[0] && !im; i++)
        if (env && !strcmp(env, bimpls[i]->name) && bimpl_runs(bimpls[i])) im = bimpls[i];
    for (size_t i = 0; i < sizeof bimpls / sizeof bimpls[0] && !im; i++)
        if (bimpl_runs(bimpls[i])) im = bimpls[i];
    __atomic_store_n(&picked, im, __ATOMIC_RELEASE);
    return im;
}

const char *rx_bgemm_kernel(void) { return pick_bimpl()->name; }

int rx_bgemm_hw(void) { return pick_bimpl() != &bimpl_generic; }

/* ---- the batch driver ---------------------------------------------------- */

/* The calling thread's packed operands, grown to the largest batch seen: a
 * training step must not allocate. */
static _Thread_local bf16 *tl_pack;
static _Thread_local size_t tl_pack_n;

static void compute_unit(const bgemm_impl *im, const bop *o, size_t i0, size_t j0) {
    const rx_gemm_op *g = o->g;
    const int acc = g->beta != 0.0f;
    const size_t i1 = i0 + UNIT_M < o->mp ? i0 + UNIT_M : o->mp;
    const size_t j1 = j0 + UNIT_N < o->np ? j0 + UNIT_N : o->np;
    for (size_t i = i0; i < i1; i += BLK)
        for (size_t j = j0; j < j1; j += BLK) {
            size_t mr = g->M - i < BLK ? g->M - i : BLK, nr = g->N - j < BLK ? g->N - j : BLK;
            im->kern(o->ap + i / BT_R * o->nkc * BT_E, o->bp + j / BT_R * o->nkc * BT_E, o->nkc,
                     g->C + i * g->ldc + j, g->ldc, mr, nr, acc);
        }
}

/* Work item w of a phase: op, and the block / unit within it. */
typedef struct {
    size_t pa[MAX_OPS + 1], pb[MAX_OPS + 1];   /* prefix counts of packing tasks */
    size_t cu[MAX_OPS + 1], cun[MAX_OPS];       /* prefix counts of compute units; units per row */
} bplan;

static size_t find_op(const size_t *prefix, size_t n, size_t w) {
    size_t k = 0;
    while (k + 1 < n && prefix[k + 1] <= w) k++;
    return k;
}

static void pack_task(const bgemm_impl *im, const bop *o, const bplan *pl, size_t n, size_t w) {
    if (w < pl->pa[n]) {
        size_t k = find_op(pl->pa, n + 1, w), b0 = (w - pl->pa[k]) * PACK_BLKS;
        size_t nb = o[k].mp / BT_R;
        im->pack_a(&o[k], b0, b0 + PACK_BLKS < nb ? b0 + PACK_BLKS : nb);
        return;
    }
    w -= pl->pa[n];
    size_t k = find_op(pl->pb, n + 1, w), b0 = (w - pl->pb[k]) * PACK_BLKS;
    size_t nb = o[k].np / BT_R;
    im->pack_b(&o[k], b0, b0 + PACK_BLKS < nb ? b0 + PACK_BLKS : nb);
}

static void compute_task(const bgemm_impl *im, const bop *o, const bplan *pl, size_t n, size_t w) {
    size_t k = find_op(pl->cu, n + 1, w), u = w - pl->cu[k];
    compute_unit(im, &o[k], u / pl->cun[k] * UNIT_M, u % pl->cun[k] * UNIT_N);
}

/* Up to MAX_OPS live ops (M, N, K >= 1) in one pass; RX_ENOMEM (C
 * untouched) when the packing buffer cannot be allocated. */
static int bgemm_pass(const bgemm_impl *im, const rx_gemm_op *ops, size_t n) {
    bop o[MAX_OPS];
    bplan pl;
    size_t need = 0;
    pl.pa[0] = pl.pb[0] = pl.cu[0] = 0;
    double total = 0.0;
    for (size_t k = 0; k < n; k++) {
        const rx_gemm_op *g = &ops[k];
        o[k].g = g;
        o[k].mp = (g->M + BLK - 1) / BLK * BLK;
        o[k].np = (g->N + BLK - 1) / BLK * BLK;
        o[k].nkc = (g->K + BT_K - 1) / BT_K;
        need += (o[k].mp + o[k].np) * o[k].nkc * BT_K;
        pl.pa[k + 1] = pl.pa[k] + (o[k].mp / BT_R + PACK_BLKS - 1) / PACK_BLKS;
        pl.pb[k + 1] = pl.pb[k] + (o[k].np / BT_R + PACK_BLKS - 1) / PACK_BLKS;
        pl.cun[k] = (o[k].np + UNIT_N - 1) / UNIT_N;
        pl.cu[k + 1] = pl.cu[k] + (o[k].mp + UNIT_M - 1) / UNIT_M * pl.cun[k];
        total += (double)g->M * g->N * g->K;
    }
    if (need > tl_pack_n) {
        free(tl_pack);
        tl_pack = rx_alloc(need, sizeof(bf16));
        tl_pack_n = tl_pack ? need : 0;
    }
    if (!tl_pack) return RX_ENOMEM;
    bf16 *p = tl_pack;
    for (size_t k = 0; k < n; k++) {
        o[k].ap = p;
        p += o[k].mp * o[k].nkc * BT_K;
        o[k].bp = p;
        p += o[k].np * o[k].nkc * BT_K;
    }
    const size_t npack = pl.pa[n] + pl.pb[n], ncomp = pl.cu[n];
    int nt = rx_in_parallel() ? 1 : rx_max_threads();
    if (total < RX_GEMM_MIN_PAR) nt = 1;
    (void)nt; /* read only by the OpenMP pragma */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (size_t w = 0; w < npack; w++) pack_task(im, o, &pl, n, w);
#ifdef RX_BF16_X86
        if (im->amx) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
        for (size_t w = 0; w < ncomp; w++) compute_task(im, o, &pl, n, w);
#ifdef RX_BF16_X86
        if (im->amx) amx_release();
#endif
    }
    return RX_OK;
}

int rx_bgemm_batch(const rx_gemm_op *ops, size_t n) {
    const bgemm_impl *im = pick_bimpl();
    int rc = RX_OK;
    rx_prof_push(RX_PROF_GEMM);
    for (size_t b = 0; b < n && rc == RX_OK; b += MAX_OPS) {
        rx_gemm_op live[MAX_OPS];
        const size_t nl = rx_gemm_live_ops(ops + b, n - b < MAX_OPS ? n - b : MAX_OPS, live);
        if (nl) rc = bgemm_pass(im, live, nl);
    }
    rx_prof_pop();
    if (rc != RX_OK && !rx_in_parallel())
        rx_fail(rc, "rx_bgemm: out of memory for the bf16 packing buffer");
    return rc;
}

int rx_bgemm(int ta, int tb, size_t M, size_t N, size_t K, const float *A, size_t lda,
             const float *B, size_t ldb, float beta, float *C, size_t ldc) {
    const rx_gemm_op g = {ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc};
    return rx_bgemm_batch(&g, 1);
}

/* ---- the projections' precision ------------------------------------------ */

static _Thread_local int tl_precision = RX_PRECISION_FP32;

int rx_gemm_set_precision(int precision) {
    int old = tl_precision;
    tl_precision = precision;
    return old;
}

int rx_pgemm_batch(const rx_gemm_op *ops, size_t n) {
    return tl_precision == RX_PRECISION_BF16 ? rx_bgemm_batch(ops, n) : rx_sgemm_batch(ops, n);
}

int rx_pgemm(int ta, int tb, size_t M, size_t N, size_t K, const float *A, size_t lda,
             const float *B, size_t ldb, float beta, float *C, size_t ldc) {
    const rx_gemm_op g = {ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc};
    return rx_pgemm_batch(&g, 1);
}
