/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * gemm.c -- the one single-precision GEMM behind every projection.
 *
 * Goto/BLIS structure: op(B) is packed in KC x NC panels of NR-column
 * slivers, and an MR x 16 register-tiled micro-kernel runs over them, the B
 * sliver staying in L1 while the A slivers of an MC x KC block stream from
 * L2. For narrow tiles (N <= the kernel's npack, the LoRA shapes) op(A) is read in
 * place -- MR row pointers, or a k-stride when transposed -- because each
 * A element meets only a few B slivers and packing it would cost as much
 * as the arithmetic; wider tiles pack it (a vectorised 6x8 transpose, or a
 * contiguous copy when transposed). Transposes are absorbed by the packing
 * and the A addressing, so one micro-kernel serves A.B, A^T.B and A.B^T.
 *
 * Kernels are picked at run time by CPU vendor and family: AVX-512 where
 * the CPU and OS have it (a 12x32 tile on Intel, 8x32 on Zen 5 and later
 * AMD, 8x16 elsewhere, see ukernel_avx512), AVX2+FMA
 * (6x16) where they have that, portable C (6x16) elsewhere. All share the
 * packed B layout (NR-column slivers; the 32-column tile reads two side by
 * side); the height MR of an A sliver is the kernel's. Every
 * SIMD kernel sums each C element over k in the same order, one FMA per
 * step, so they give bit-identical results and the choice never changes
 * a training run.
 *
 * Threading: rx_sgemm_batch runs a batch of independent GEMMs (a single
 * rx_sgemm is a batch of one) in one parallel region; each thread owns its
 * share of every op's rows and steals leftover units from the others at
 * the end (see "parallel batches" below), so a layer's projections cost
 * one fork/join and a slow core does not hold the others.
 */
#include <string.h>

#include "rx_internal.h"
#include "rx_simd.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RX_X86 1
#endif

#define MR 6       /* tile rows of the AVX2 and portable kernels */
#define MR512 8    /* tile rows of the AVX-512 kernel for AMD */
#define MR_WIDE 12 /* tile rows of the 32-column AVX-512 kernel for Intel */
#define MR_MAX MR_WIDE /* the largest MR: scratch sizes */
#define NR 16
#define KC 256   /* a KC x NR B sliver is 16 KiB: half of L1 */
#define MC 144   /* multiple of every MR; the MC x KC A block stays in L2 */
_Static_assert(MC % MR == 0 && MC % MR512 == 0 && MC % MR_WIDE == 0, "MC: whole slivers");
/* multiple of NR. The 1 MiB KC x NC panel of B stays in a 2 MiB L2 (Intel
 * server cores): at NC = 4096 (4 MiB, streamed from L3) the 1-thread head
 * projection (512 x 4096 x 512) ran at 80-87 GFLOP/s on Sapphire Rapids,
 * at 1024 at 92-97. Parallel units are narrower still (UNIT_W). */
#define NC 1024
/* Zen 5's panel: its L2 is 1 MiB, which the 1 MiB panel above would fill
 * (the A block and C need room too); 512 columns are 512 KiB */
#define NC_ZEN5 512
/* op(A) is packed only for tiles wider than this (see sgemm_block): 128
 * for the 6- and 8-row kernels; 32 for Intel's tall one, whose rows read
 * in place are more streams than an Intel core's L2 prefetcher follows
 * (Sapphire Rapids, 1 thread, paired, with the 16-row tile it replaced:
 * packing at N = 64 and 128 made the LoRA GEMMs 5-22% faster, at N = 16
 * and 32 no different). */
#define NPACK 128
#define NPACK_TALL 32
#define PF_K 48   /* k steps ahead the micro-kernel prefetches a k-strided A */

/* C[MR,NR] (+)= op(A)[MR,kc] . Bp[kc][NR], Bp a packed sliver, MR the
 * kernel's tile rows. Element (i, p) of the A sliver is A[i*rs + p*cs]:
 * cs == 1 reads MR rows of a row-major matrix in place, rs == 1 a packed
 * (or transposed) sliver with k-stride cs. */
typedef void (*ukernel_fn)(size_t kc, const float *A, size_t rs, size_t cs,
                           const float *Bp, float *C, size_t ldc, int acc);
/* Packs op(B) rows [p0,p0+kc) x cols [j0,j0+nc) of a B stored [N,K] (the
 * transposed case) into NR-column slivers. */
typedef void (*packbt_fn)(const float *B, size_t ldb, size_t p0, size_t kc,
                          size_t j0, size_t nc, float *Bp);

/* Packs rows [i0,i0+mc) x cols [p0,p0+kc) of a row-major A into the
 * kernel's MR-row slivers, k-major, zero-padded; may write MR floats past
 * the last sliver. */
typedef void (*packan_fn)(const float *A, size_t lda, size_t i0, size_t mc,
                          size_t p0, size_t kc, float *Ap);

typedef struct {
    const char *name;
    size_t mr;          /* tile rows: the height of a packed A sliver */
    ukernel_fn kern;
    ukernel_fn narrow;  /* NR columns, for a last single sliver (nw > NR) */
    size_t nw;          /* columns of one kern call: NR or 2 * NR */
    packbt_fn pack_bt;
    packan_fn pack_an;
    size_t npack;       /* widest tile that reads op(A) in place */
    size_t nc;          /* columns of a packed op(B) panel (sgemm_serial) */
} gemm_impl;

static void ukernel_generic(size_t kc, const float *A, size_t rs, size_t cs,
                            const float *Bp, float *C, size_t ldc, int acc) {
    float t[MR][NR];
    memset(t, 0, sizeof t);
    for (size_t p = 0; p < kc; p++) {
        const float *b = Bp + p * NR;
        for (size_t i = 0; i < MR; i++) {
            float ai = A[i * rs + p * cs];
            for (size_t j = 0; j < NR; j++) t[i][j] += ai * b[j];
        }
    }
    for (size_t i = 0; i < MR; i++)
        for (size_t j = 0; j < NR; j++)
            C[i * ldc + j] = acc ? C[i * ldc + j] + t[i][j] : t[i][j];
}

static void pack_bt_generic(const float *B, size_t ldb, size_t p0, size_t kc,
                            size_t j0, size_t nc, float *Bp) {
    for (size_t s = 0; s < nc; s += NR) {
        size_t nr = nc - s < NR ? nc - s : NR;
        for (size_t j = 0; j < NR; j++) {
            const float *src = B + (j0 + s + j) * ldb + p0;
            for (size_t p = 0; p < kc; p++) Bp[p * NR + j] = j < nr ? src[p] : 0.0f;
        }
        Bp += NR * kc;
    }
}

/* pack_an for R-row slivers: the portable kernel's, and the vectorised
 * packers' ragged last sliver. */
static void pack_an_rows(size_t R, const float *A, size_t lda, size_t i0, size_t mc,
                         size_t p0, size_t kc, float *Ap) {
    for (size_t s = 0; s < mc; s += R) {
        size_t mr = mc - s < R ? mc - s : R;
        for (size_t p = 0; p < kc; p++)
            for (size_t i = 0; i < R; i++)
                Ap[p * R + i] = i < mr ? A[(i0 + s + i) * lda + p0 + p] : 0.0f;
        Ap += R * kc;
    }
}

static void pack_an_generic(const float *A, size_t lda, size_t i0, size_t mc,
                            size_t p0, size_t kc, float *Ap) {
    pack_an_rows(MR, A, lda, i0, mc, p0, kc, Ap);
}

#ifdef RX_X86
#define RX_AVX2 __attribute__((target("avx2,fma")))

/* In-register 8x8 transpose: r[q][i] becomes r[i][q]. */
RX_AVX2 static inline void transpose8(__m256 r[8]) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* One k step of the 6x16 tile: row i of op(A) broadcast from a##i. */
#define UK_STEP(a0, a1, a2, a3, a4, a5)                                              \
    do {                                                                             \
        __m256 b0 = _mm256_load_ps(Bp), b1 = _mm256_load_ps(Bp + 8), x;              \
        x = _mm256_broadcast_ss(a0); c00 = _mm256_fmadd_ps(x, b0, c00); c01 = _mm256_fmadd_ps(x, b1, c01); \
        x = _mm256_broadcast_ss(a1); c10 = _mm256_fmadd_ps(x, b0, c10); c11 = _mm256_fmadd_ps(x, b1, c11); \
        x = _mm256_broadcast_ss(a2); c20 = _mm256_fmadd_ps(x, b0, c20); c21 = _mm256_fmadd_ps(x, b1, c21); \
        x = _mm256_broadcast_ss(a3); c30 = _mm256_fmadd_ps(x, b0, c30); c31 = _mm256_fmadd_ps(x, b1, c31); \
        x = _mm256_broadcast_ss(a4); c40 = _mm256_fmadd_ps(x, b0, c40); c41 = _mm256_fmadd_ps(x, b1, c41); \
        x = _mm256_broadcast_ss(a5); c50 = _mm256_fmadd_ps(x, b0, c50); c51 = _mm256_fmadd_ps(x, b1, c51); \
        Bp += NR;                                                                    \
    } while (0)

RX_AVX2 static void ukernel_avx2(size_t kc, const float *A, size_t rs, size_t cs,
                                 const float *Bp, float *C, size_t ldc, int acc) {
    __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
    __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
    __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
    __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
    __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
    __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
    for (size_t i = 0; i < MR; i++) _mm_prefetch((const char *)(C + i * ldc), _MM_HINT_T0);
    if (cs == 1) {
        const float *a0 = A, *a1 = A + rs, *a2 = A + 2 * rs;
        const float *a3 = A + 3 * rs, *a4 = A + 4 * rs, *a5 = A + 5 * rs;
        /* unrolled by 4: fewer loop µops between the FMAs (0-15% per core on
         * a shared Zen3, within its noise in a training step) */
#pragma GCC unroll 4
        for (size_t p = 0; p < kc; p++) UK_STEP(a0 + p, a1 + p, a2 + p, a3 + p, a4 + p, a5 + p);
    } else {
        /* A transposed in place starts a new line every step, rows a page
         * apart where the hardware prefetcher gives up, and arrives cold in
         * a training step; a packed A (in L2) walks on into the next sliver */
#pragma GCC unroll 4
        for (size_t p = 0; p < kc; p++, A += cs) {
            _mm_prefetch((const char *)(A + PF_K * cs), _MM_HINT_T0);
            UK_STEP(A, A + 1, A + 2, A + 3, A + 4, A + 5);
        }
    }
    __m256 r[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (size_t i = 0; i < MR; i++) {
        float *c = C + i * ldc;
        if (acc) {
            r[i][0] = _mm256_add_ps(r[i][0], _mm256_loadu_ps(c));
            r[i][1] = _mm256_add_ps(r[i][1], _mm256_loadu_ps(c + 8));
        }
        _mm256_storeu_ps(c, r[i][0]);
        _mm256_storeu_ps(c + 8, r[i][1]);
    }
}
#undef UK_STEP

/* 8x8 transposes: eight B rows (output columns) of eight k values each
 * become eight k rows of one half of a sliver. */
RX_AVX2 static void pack_bt_avx2(const float *B, size_t ldb, size_t p0, size_t kc,
                                 size_t j0, size_t nc, float *Bp) {
    for (size_t s = 0; s < nc; s += NR) {
        size_t nr = nc - s < NR ? nc - s : NR;
        if (nr < NR) {
            pack_bt_generic(B, ldb, p0, kc, j0 + s, nr, Bp);
            Bp += NR * kc;
            continue;
        }
        for (size_t h = 0; h < NR; h += 8) {
            const float *src = B + (j0 + s + h) * ldb + p0;
            size_t p = 0;
            for (; p + 8 <= kc; p += 8) {
                __m256 r[8];
                for (size_t q = 0; q < 8; q++) r[q] = _mm256_loadu_ps(src + q * ldb + p);
                transpose8(r);
                for (size_t q = 0; q < 8; q++) _mm256_store_ps(Bp + (p + q) * NR + h, r[q]);
            }
            for (; p < kc; p++)
                for (size_t j = 0; j < 8; j++) Bp[p * NR + h + j] = src[j * ldb + p];
        }
        Bp += NR * kc;
    }
}

#define RX_AVX512 __attribute__((target("avx512f,avx2,fma")))

/* The R x 16 tile: one zmm of B per k step, each of the R A values
 * broadcast into its row's FMA; R independent accumulators. Two 512-bit
 * FMA ports of 4-cycle latency (Intel server cores) need at least 8 FMAs
 * in flight; 8 leave no slack for the loads, and the 8x16 tile ran at 89%
 * of the 16x16's rate in L1 on a Sapphire Rapids core (121 against 136
 * GFLOP/s), so Intel runs a taller tile, now 12 rows by 32 columns
 * (V = 2 below; with V = 1 it takes a last single sliver). Zen 4 runs 512-bit FMAs at the AVX2 rate and has a 32 KiB L1;
 * there a 12-row tile measured 4-7% slower than the AVX2 kernel on wide
 * projections (its A sliver crowds the B sliver out of L1), the 8-row one
 * 0-12% faster (bench_gemm.py --kernel) and 1-2% faster in a training
 * step, so AMD and other vendors keep R = 8. R is a constant at each use,
 * so the loops unroll into registers. */
RX_AVX512 static inline __attribute__((always_inline)) void
ukernel_avx512_body(size_t R, size_t V, size_t kc, const float *A, size_t rs, size_t cs,
                    const float *Bp, float *C, size_t ldc, int acc) {
    /* V (1 or 2) adjacent NR-column slivers: V B loads per k step, each
     * broadcast A value feeding V FMAs */
    __m512 c[MR_MAX][2];
#pragma GCC unroll 16
    for (size_t i = 0; i < R; i++) {
        c[i][0] = c[i][1] = _mm512_setzero_ps();
        _mm_prefetch((const char *)(C + i * ldc), _MM_HINT_T0);
        _mm_prefetch((const char *)(C + i * ldc + V * NR - 1), _MM_HINT_T0);
    }
    /* the second sliver's k row p sits NR * kc floats after the first's */
    const size_t bq = NR * kc;
    if (cs == 1) {
        for (size_t p = 0; p < kc; p++, A++, Bp += NR) {
            __m512 b0 = _mm512_load_ps(Bp), b1 = V > 1 ? _mm512_load_ps(Bp + bq) : b0;
#pragma GCC unroll 16
            for (size_t i = 0; i < R; i++) {
                __m512 a = _mm512_set1_ps(A[i * rs]);
                c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
                if (V > 1) c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
            }
        }
    } else {
        /* as in the AVX2 kernel: a k-strided A is prefetched ahead; a
         * sliver may span two lines */
#pragma GCC unroll 2
        for (size_t p = 0; p < kc; p++, A += cs, Bp += NR) {
            _mm_prefetch((const char *)(A + PF_K * cs), _MM_HINT_T0);
            _mm_prefetch((const char *)(A + PF_K * cs + R - 1), _MM_HINT_T0);
            __m512 b0 = _mm512_load_ps(Bp), b1 = V > 1 ? _mm512_load_ps(Bp + bq) : b0;
#pragma GCC unroll 16
            for (size_t i = 0; i < R; i++) {
                __m512 a = _mm512_set1_ps(A[i]);
                c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
                if (V > 1) c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
            }
        }
    }
#pragma GCC unroll 16
    for (size_t i = 0; i < R; i++)
        for (size_t v = 0; v < V; v++) {
            float *ci = C + i * ldc + v * NR;
            _mm512_storeu_ps(ci, acc ? _mm512_add_ps(c[i][v], _mm512_loadu_ps(ci)) : c[i][v]);
        }
}

RX_AVX512 static void ukernel_avx512(size_t kc, const float *A, size_t rs, size_t cs,
                                     const float *Bp, float *C, size_t ldc, int acc) {
    ukernel_avx512_body(MR512, 1, kc, A, rs, cs, Bp, C, ldc, acc);
}

/* The 12 x 32 tile (two adjacent slivers): per k, two B loads and 12
 * broadcasts feed 24 FMAs, where an R x 16 tile spends a load (its
 * broadcast) per FMA and its loads set the pace. In L1 on a Sapphire
 * Rapids core 12x32 ran at 220 GFLOP/s against 204-212 for 16x16 (8x32
 * and 14x32 within 3% of 12x32); 12 rows x 2 zmm are 24 accumulators, and
 * MC = 144 holds whole 12-row slivers. Over the S and M projections at 1
 * thread it took rx_sgemm from 0.99x / 0.94x OpenBLAS's rate to 1.07x /
 * 1.02x (bench_gemm.py --cpu-time) and an fp32 training step to 0.946x
 * (S) and 0.934x (M) of its time at 2 threads (bench_ab.py, both launch
 * orders). Each C element is still one FMA chain over k in order: the
 * same bits as every other kernel. */
RX_AVX512 static void ukernel_avx512_12w(size_t kc, const float *A, size_t rs, size_t cs,
                                        const float *Bp, float *C, size_t ldc, int acc) {
    ukernel_avx512_body(MR_WIDE, 2, kc, A, rs, cs, Bp, C, ldc, acc);
}

/* its last single sliver */
RX_AVX512 static void ukernel_avx512_12(size_t kc, const float *A, size_t rs, size_t cs,
                                       const float *Bp, float *C, size_t ldc, int acc) {
    ukernel_avx512_body(MR_WIDE, 1, kc, A, rs, cs, Bp, C, ldc, acc);
}

/* The 8 x 32 tile for Zen 5 (two adjacent slivers, 16 accumulators):
 * per k, two B loads and 8 broadcasts feed 16 FMAs. Zen 5 runs two full
 * 512-bit FMA pipes and keeps the 8x16 tile's loads (one per FMA, nine
 * per eight FMAs) as the pace; its 48 KiB L1 holds the 32 KiB B sliver
 * pair and the 8 KiB A sliver together, where the 12x32 tile's 12 KiB A
 * sliver crowds it, and 8 rows divide the LoRA weight grads' 16-64 rows
 * without a ragged sliver. Over the S and M projections at 1 thread, with
 * NC_ZEN5, it ran at 1.2x the 8x16 tile's rate and 1.01-1.02x the 12x32's
 * (docs/performance.md §fp32 GEMM). Each C element is still one FMA chain
 * over k in order: the same bits as every other kernel. */
RX_AVX512 static void ukernel_avx512_8w(size_t kc, const float *A, size_t rs, size_t cs,
                                       const float *Bp, float *C, size_t ldc, int acc) {
    ukernel_avx512_body(MR512, 2, kc, A, rs, cs, Bp, C, ldc, acc);
}

/* R rows of eight k values, transposed as 8x8 blocks of eight rows each
 * (the last over zero rows when R is not a multiple of 8): k column q of
 * rows [h, h+8) lands at Ap[(p+q)*R + h] as eight floats, of which those
 * past row R the next k's stores overwrite (the last ones spill into the
 * buffer's slack). R is a constant at each use, so the loops unroll. */
RX_AVX2 static inline __attribute__((always_inline)) void
pack_an_body(size_t R, const float *A, size_t lda, size_t i0, size_t mc, size_t p0, size_t kc,
             float *Ap) {
    for (size_t s = 0; s < mc; s += R, Ap += R * kc) {
        if (mc - s < R) {
            pack_an_rows(R, A, lda, i0 + s, mc - s, p0, kc, Ap);
            continue;
        }
        const float *src = A + (i0 + s) * lda + p0;
        size_t p = 0;
        for (; p + 8 <= kc; p += 8) {
            __m256 r[(MR_MAX + 7) / 8][8];
            for (size_t h = 0; h < R; h += 8) {
                for (size_t i = 0; i < 8; i++)
                    r[h / 8][i] = h + i < R ? _mm256_loadu_ps(src + (h + i) * lda + p)
                                            : _mm256_setzero_ps();
                transpose8(r[h / 8]);
            }
            /* k by k, each k's blocks in row order: a block's spill past row
             * R lands on the next k, whose own stores come after it */
            for (size_t q = 0; q < 8; q++)
                for (size_t h = 0; h < R; h += 8)
                    _mm256_storeu_ps(Ap + (p + q) * R + h, r[h / 8][q]);
        }
        for (; p < kc; p++)
            for (size_t i = 0; i < R; i++) Ap[p * R + i] = src[i * lda + p];
    }
}

RX_AVX2 static void pack_an_avx2(const float *A, size_t lda, size_t i0, size_t mc,
                                 size_t p0, size_t kc, float *Ap) {
    pack_an_body(MR, A, lda, i0, mc, p0, kc, Ap);
}

/* the AVX-512 kernels' 8- and 12-row slivers: AVX2 code is as fast for a copy */
RX_AVX2 static void pack_an_8(const float *A, size_t lda, size_t i0, size_t mc,
                              size_t p0, size_t kc, float *Ap) {
    pack_an_body(MR512, A, lda, i0, mc, p0, kc, Ap);
}

RX_AVX2 static void pack_an_12(const float *A, size_t lda, size_t i0, size_t mc,
                               size_t p0, size_t kc, float *Ap) {
    pack_an_body(MR_WIDE, A, lda, i0, mc, p0, kc, Ap);
}
#endif

#ifdef RX_X86
/* ---- tiles -------------------------------------------------------------
 * The attention's score and value products are tiles of at most 64 x 64
 * over k <= 64, one call each (tens of thousands a step). Packing both
 * operands cost as much as the arithmetic there (a 64^3 product ran at
 * 98-143 GFLOP/s on a Sapphire Rapids core against 240 for its FMAs), so
 * an AVX-512 CPU runs them unpacked: TILE_R rows by four 16-column
 * vectors of C per pass, op(A) broadcast a value at a time where it lies,
 * op(B) copied into a contiguous 64-wide block first (transposed 16 x 16
 * at a time when stored transposed; see tile_gemm). 64^3 on one core:
 * A.B 3.9 -> 2.9 us, A.B^T 5.3 -> 3.4, A^T.B 3.7 -> 2.9. Each C element
 * is the same single chain of FMAs over k from zero, added to C at the
 * end, as in the packed kernels: the same bits, so the choice of path
 * changes no result. */
#define TILE_MAX 64   /* the largest M, N and K of a tile */
#define TILE_R 6      /* rows per pass: 24 accumulators of the 32 zmm */

RX_AVX512 static inline __attribute__((always_inline)) void
tile_rows(size_t R, size_t K, const float *A, size_t rs, size_t cs, const float *B,
          const __mmask16 m[4], float *C, size_t ldc, int acc) {
    __m512 c[TILE_R][4];
#pragma GCC unroll 6
    for (size_t i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) c[i][v] = _mm512_setzero_ps();
    for (size_t k = 0; k < K; k++) {
        const float *b = B + k * TILE_MAX;
        __m512 bv[4];
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) bv[v] = _mm512_load_ps(b + 16 * v);
#pragma GCC unroll 6
        for (size_t i = 0; i < R; i++) {
            const __m512 a = _mm512_set1_ps(A[i * rs + k * cs]);
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) c[i][v] = _mm512_fmadd_ps(a, bv[v], c[i][v]);
        }
    }
#pragma GCC unroll 6
    for (size_t i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            float *ci = C + i * ldc + 16 * v;
            __m512 x = acc ? _mm512_add_ps(c[i][v], _mm512_maskz_loadu_ps(m[v], ci)) : c[i][v];
            _mm512_mask_storeu_ps(ci, m[v], x);
        }
}

/* Whether g is a tile this path takes: every size at most TILE_MAX, and
 * N over 32 (narrower, most of the four vectors would be idle). */
static int tile_fits(const rx_gemm_op *g) {
    return !g->bsrc && g->M <= TILE_MAX && g->N > 32 && g->N <= TILE_MAX && g->K <= TILE_MAX;
}

RX_AVX512 static void tile_gemm(const rx_gemm_op *g) {
    const size_t M = g->M, N = g->N, K = g->K;
    const __mmask16 m[4] = {rx_lanes(0, N), rx_lanes(16, N), rx_lanes(32, N), rx_lanes(48, N)};
    float bt[TILE_MAX * TILE_MAX] __attribute__((aligned(64)));
    if (!g->tb) {
        /* a contiguous copy: rows of the model's matrices lie a power of two
         * apart (C floats), so read in place they share a few L1 sets and
         * evict each other (in place ran at 0.9x the packed path's rate) */
        for (size_t k = 0; k < K; k++)
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++)
                _mm512_store_ps(bt + k * TILE_MAX + 16 * v,
                                _mm512_maskz_loadu_ps(m[v], g->B + k * g->ldb + 16 * v));
    } else {
        /* op(B)[k][j] = B[j][k]: rows k of bt, 16 x 16 blocks at a time */
        for (size_t j0 = 0; j0 < TILE_MAX; j0 += 16)
            for (size_t k0 = 0; k0 < K; k0 += 16) {
                const __mmask16 mk = rx_lanes(k0, K);
                __m512i r[16];
                for (size_t q = 0; q < 16; q++)
                    r[q] = j0 + q < N ? _mm512_maskz_loadu_epi32(mk, g->B + (j0 + q) * g->ldb + k0)
                                      : _mm512_setzero_si512();
                rx_transpose16(r);
                for (size_t q = 0; q < 16 && k0 + q < K; q++)
                    _mm512_store_si512(bt + (k0 + q) * TILE_MAX + j0, r[q]);
            }
    }
    /* bt: op(B) as K rows of TILE_MAX floats, zero past column N */
    const float *B = bt;
    const size_t rs = g->ta ? 1 : g->lda, cs = g->ta ? g->lda : 1;
    const int acc = g->beta != 0.0f;
    size_t i = 0;
    for (; i + TILE_R <= M; i += TILE_R)
        tile_rows(TILE_R, K, g->A + i * rs, rs, cs, B, m, g->C + i * g->ldc, g->ldc, acc);
    /* the last rows, with R a constant in each copy */
    const float *A = g->A + i * rs;
    float *C = g->C + i * g->ldc;
    switch (M - i) {
    case 5: tile_rows(5, K, A, rs, cs, B, m, C, g->ldc, acc); break;
    case 4: tile_rows(4, K, A, rs, cs, B, m, C, g->ldc, acc); break;
    case 3: tile_rows(3, K, A, rs, cs, B, m, C, g->ldc, acc); break;
    case 2: tile_rows(2, K, A, rs, cs, B, m, C, g->ldc, acc); break;
    case 1: tile_rows(1, K, A, rs, cs, B, m, C, g->ldc, acc); break;
    default: break;
    }
}
#endif

static const gemm_impl impl_generic = {"generic", MR, ukernel_generic, ukernel_generic, NR,
                                       pack_bt_generic, pack_an_generic, NPACK, NC};
#ifdef RX_X86
static const gemm_impl impl_avx2 = {"avx2-fma", MR, ukernel_avx2, ukernel_avx2, NR, pack_bt_avx2,
                                    pack_an_avx2, NPACK, NC};
static const gemm_impl impl_avx512 = {"avx512f", MR512, ukernel_avx512, ukernel_avx512, NR,
                                      pack_bt_avx2, pack_an_8, NPACK, NC};
static const gemm_impl impl_avx512_w = {"avx512f-12x32", MR_WIDE, ukernel_avx512_12w,
                                        ukernel_avx512_12, 2 * NR, pack_bt_avx2, pack_an_12,
                                        NPACK_TALL, NC};
static const gemm_impl impl_avx512_zen5 = {"avx512f-8x32", MR512, ukernel_avx512_8w,
                                           ukernel_avx512, 2 * NR, pack_bt_avx2, pack_an_8, NPACK,
                                           NC_ZEN5};

/* libgcc's test includes the OS's saving of the zmm state (XCR0). */
static int have_avx512(void) { return __builtin_cpu_supports("avx512f"); }
/* The vendor, not a timing, picks the AVX-512 tile: a calibration run at
 * start-up would measure a shared or throttled core as often as the
 * kernel, and could pick differently from run to run. */
static int is_intel(void) { return __builtin_cpu_is("intel"); }
static int have_avx2(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#endif

/* Set by rx_sgemm_use_kernel (tests); NULL: pick by CPU. */
static const gemm_impl *forced_impl;

static const gemm_impl *pick_impl(void) {
    if (forced_impl) return forced_impl;
#ifdef RX_X86
    if (have_avx512())
        return is_intel() ? &impl_avx512_w : rx_cpu_zen5_or_later() ? &impl_avx512_zen5 : &impl_avx512;
    if (have_avx2()) return &impl_avx2;
#endif
    return &impl_generic;
}

const char *rx_sgemm_kernel(void) { return pick_impl()->name; }

int rx_sgemm_use_kernel(const char *name) {
    if (!name) {
        forced_impl = NULL;
        return RX_OK;
    }
    if (!strcmp(name, impl_generic.name)) {
        forced_impl = &impl_generic;
        return RX_OK;
    }
#ifdef RX_X86
    if (!strcmp(name, impl_avx2.name) && have_avx2()) {
        forced_impl = &impl_avx2;
        return RX_OK;
    }
    if (!strcmp(name, impl_avx512.name) && have_avx512()) {
        forced_impl = &impl_avx512;
        return RX_OK;
    }
    if (!strcmp(name, impl_avx512_w.name) && have_avx512()) {
        forced_impl = &impl_avx512_w;
        return RX_OK;
    }
    if (!strcmp(name, impl_avx512_zen5.name) && have_avx512()) {
        forced_impl = &impl_avx512_zen5;
        return RX_OK;
    }
#endif
    return rx_fail(RX_EINVAL, "rx_sgemm_use_kernel: kernel \"%s\" is unknown or cannot run here",
                   name);
}

/* op(B) rows [p0,p0+kc) x cols [j0,j0+nc) into NR-column slivers, k-major,
 * zero-padded to a whole sliver. Untransposed B is read a row at a time so
 * the reads run sequentially through memory (sliver by sliver, every one of
 * kc rows would be a new page), and the row PACK_AHEAD further on is
 * prefetched meanwhile: the hardware prefetchers do not follow the jump
 * from one row's run to the next's
 * (64-sequence fp32 decode, whose steps pack every weight: 2-13% faster
 * over three sittings, Zen 4). */
#define PACK_AHEAD 4
static void pack_b(const gemm_impl *im, int tb, const float *B, size_t ldb, size_t p0,
                   size_t kc, size_t j0, size_t nc, float *Bp) {
    if (tb) {
        im->pack_bt(B, ldb, p0, kc, j0, nc, Bp);
        return;
    }
    const size_t full = nc / NR * NR;
    for (size_t p = 0; p < kc; p++) {
        const float *src = B + (p0 + p) * ldb + j0;
        if (p + PACK_AHEAD < kc)
            for (size_t j = 0; j < nc; j += 16) __builtin_prefetch(src + PACK_AHEAD * ldb + j);
        float *dst = Bp + p * NR;
        for (size_t s = 0; s < full; s += NR) memcpy(dst + s * kc, src + s, NR * sizeof(float));
        if (full < nc)
            for (size_t j = 0; j < NR; j++)
                dst[full * kc + j] = full + j < nc ? src[full + j] : 0.0f;
    }
}

/* pack_b of op g: by its source when B has one (a frozen base tensor) */
static void pack_op_b(const gemm_impl *im, const rx_gemm_op *g, size_t p0, size_t kc, size_t j0,
                      size_t nc, float *Bp) {
    if (g->bsrc) g->bsrc->pack_f32(g->bsrc_of, g->tb, g->bsrc_k0 + p0, kc, j0, nc, NR, Bp);
    else pack_b(im, g->tb, g->B, g->ldb, p0, kc, j0, nc, Bp);
}

/* op(A) rows [i0,i0+mc) x cols [p0,p0+kc) into slivers of the kernel's
 * MR rows, k-major, zero-padded to a whole sliver. */
static void pack_a(const gemm_impl *im, int ta, const float *A, size_t lda, size_t i0,
                   size_t mc, size_t p0, size_t kc, float *Ap) {
    if (!ta) {
        im->pack_an(A, lda, i0, mc, p0, kc, Ap);
        return;
    }
    const size_t R = im->mr;
    for (size_t s = 0; s < mc; s += R) {
        size_t mr = mc - s < R ? mc - s : R;
        for (size_t p = 0; p < kc; p++) {
            const float *src = A + (p0 + p) * lda + i0 + s;
            float *dst = Ap + p * R;
            /* constant sizes: the copies inline instead of calling memcpy */
            if (mr == R && R == MR_WIDE) {
                memcpy(dst, src, MR_WIDE * sizeof(float));
                continue;
            }
            if (mr == R && R == MR512) {
                memcpy(dst, src, MR512 * sizeof(float));
                continue;
            }
            if (mr == R && R == MR) {
                memcpy(dst, src, MR * sizeof(float));
                continue;
            }
            for (size_t i = 0; i < R; i++) dst[i] = i < mr ? src[i] : 0.0f;
        }
        Ap += R * kc;
    }
}

/* A parallel batch's work item (see "parallel batches" below). */
typedef struct {
    size_t k, jb, i0, i1, j0, j1;   /* op, column block, C tile */
} gunit;

/* Packing buffers are the thread's own (rx_thread_buffer), kept for its
 * lifetime: a training step calls the GEMM hundreds of times and must not
 * allocate in it. bfull holds op(B) packed over all of K for one column
 * block of a parallel unit, grown to the largest block seen; bkey names
 * what it holds (batch, op, column block) so consecutive units of the same
 * block skip the packing. units is the thread's unit table, grown to the
 * largest batch seen. */
typedef struct {
    float *apack, *bpack, *bfull;
    size_t bfull_n, bkey[3];
    gunit *units;
    size_t units_n;
} gemm_scratch;

/* the calling thread's views of its buffers */
static _Thread_local gemm_scratch tl;

/* The calling thread's scratch with its fixed-size packing buffers, the
 * only memory a GEMM on one thread needs; NULL on allocation failure. */
static gemm_scratch *scratch_packs(void) {
    if (!tl.apack)   /* + pack_an slack */
        tl.apack = rx_thread_buffer(RX_BUF_GEMM_A, ((size_t)MC * KC + MR_MAX) * sizeof(float));
    if (!tl.bpack) tl.bpack = rx_thread_buffer(RX_BUF_GEMM_B, (size_t)KC * NC * sizeof(float));
    return tl.apack && tl.bpack ? &tl : NULL;
}

int rx_gemm_reserve(void) {
    if (scratch_packs()) return RX_OK;
    return rx_fail(RX_ENOMEM, "rx_gemm_reserve: out of memory for a thread's GEMM packing "
                   "buffers");
}

/* C[i0:i0+mc, j0:j0+nc] (+)= op(A)[i0:i0+mc, pc:pc+kc] . Bp, Bp the packed
 * kc x nc panel of op(B); mc <= MC. Ap: MC*KC+MR_MAX floats of scratch. */
static void sgemm_block(const gemm_impl *im, const rx_gemm_op *g, size_t i0, size_t mc,
                        size_t pc, size_t kc, size_t j0, size_t nc, const float *Bp,
                        float *Ap, int acc) {
    const size_t R = im->mr;
    const int ta = g->ta;
    const size_t lda = g->lda, ldc = g->ldc;
    /* Reused over more than npack/NR B slivers, a packed A block pays for
     * its packing: the micro-kernel then streams one contiguous sliver
     * instead of MR rows (or kc strided lines) from L2. Measured on Zen 3;
     * on Zen 4 reading A in place up to N = 256 made a training step 2%
     * slower.
     * A in place: only a ragged last sliver is packed (zero rows would
     * otherwise be read past the matrix). */
    size_t full = nc > im->npack ? 0 : mc / R * R;
    if (full < mc) pack_a(im, ta, g->A, lda, i0 + full, mc - full, pc, kc, Ap);
    float edge[MR_MAX * 2 * NR];
    for (size_t jr = 0; jr < nc;) {
        /* the wide kernel wherever a second sliver exists (packed slivers
         * are zero-padded to NR columns), the narrow one for a last one */
        const int wide = im->nw > NR && nc - jr > NR;
        const size_t w = wide ? im->nw : NR, nr = nc - jr < w ? nc - jr : w;
        const ukernel_fn k = wide ? im->kern : im->narrow;
        const float *bp = Bp + jr * kc;
        for (size_t ir = 0; ir < mc; ir += R) {
            size_t mr = mc - ir < R ? mc - ir : R;
            float *c = g->C + (i0 + ir) * ldc + j0 + jr;
            const float *ap;
            size_t rs, cs;
            if (ir < full && !ta) {
                ap = g->A + (i0 + ir) * lda + pc, rs = lda, cs = 1;
            } else if (ir < full) {
                ap = g->A + pc * lda + i0 + ir, rs = 1, cs = lda;
            } else {
                ap = Ap + (ir - full) * kc, rs = 1, cs = R;
            }
            if (mr == R && nr == w) {
                k(kc, ap, rs, cs, bp, c, ldc, acc);
                continue;
            }
            k(kc, ap, rs, cs, bp, edge, w, 0);
            for (size_t i = 0; i < mr; i++)
                for (size_t j = 0; j < nr; j++)
                    c[i * ldc + j] = acc ? c[i * ldc + j] + edge[i * w + j] : edge[i * w + j];
        }
        jr += w;
    }
}

/* A whole GEMM on the calling thread; RX_ENOMEM (C untouched) when the
 * thread's packing buffers cannot be allocated. */
static int sgemm_serial(const gemm_impl *im, const rx_gemm_op *g) {
#ifdef RX_X86
    if ((im == &impl_avx512 || im == &impl_avx512_w || im == &impl_avx512_zen5) && tile_fits(g)) {
        tile_gemm(g);
        return RX_OK;
    }
#endif
    gemm_scratch *sc = scratch_packs();
    if (!sc) return RX_ENOMEM;
    for (size_t jc = 0; jc < g->N; jc += im->nc) {
        size_t nc = g->N - jc < im->nc ? g->N - jc : im->nc;
        for (size_t pc = 0; pc < g->K; pc += KC) {
            size_t kc = g->K - pc < KC ? g->K - pc : KC;
            pack_op_b(im, g, pc, kc, jc, nc, sc->bpack);
            for (size_t ic = 0; ic < g->M; ic += MC)
                sgemm_block(im, g, ic, g->M - ic < MC ? g->M - ic : MC, pc, kc, jc, nc,
                            sc->bpack, sc->apack, pc > 0 || g->beta != 0.0f);
        }
    }
    return RX_OK;
}

/* ---- parallel batches -------------------------------------------------
 * A batch of independent GEMMs runs in one parallel region. Thread t owns
 * rows [t*M/nt, (t+1)*M/nt) of every op (of an op with few rows,
 * by_columns: its t-th part of the column blocks), cut into units of at most MC rows
 * within column blocks of at most UNIT_W columns: the threads share op(B)
 * (one fetch from memory serves both), each reads only its own rows of
 * op(A), and each packs a column block of op(B) once (bfull, all of K)
 * for all its row units. A thread that finishes its units takes units from
 * the back of another's: a core slowed by a neighbour (or by more cache
 * misses) sheds work instead of holding the rest at the join. */
#define UNIT_W 512       /* column block width: a packed 256-deep block is 512 KiB */
#define MAX_BATCH 16
#define MAX_THREADS 256   /* a larger team is cut to this; 2 KiB of segments */
#define MIN_UNIT_W 64     /* narrowest column block split off for a wide team */
/* Floats of op(B) a thread packs for a unit at most (bfull): 8 MiB. An op
 * deeper than that at its widest unit runs in k windows (sgemm_windows),
 * so the buffer stays bounded whatever K: the head's dX at C 4,096 (K =
 * 65,536 by 512 columns) was 128 MiB a thread. */
#define FULL_BUDGET ((size_t)2 << 20)
static size_t full_budget = FULL_BUDGET;   /* rx_sgemm_full_budget's */

size_t rx_sgemm_full_budget(size_t floats) {
    return rx_gemm_set_budget(&full_budget, floats, FULL_BUDGET);
}


/* Packs op(B) over all of K, columns [j0,j0+nc), as consecutive KC-deep
 * panels of NR-column slivers: panel pc starts at pc * round_up(nc, NR). */
static void pack_b_full(const gemm_impl *im, const rx_gemm_op *g, size_t j0, size_t nc,
                        float *Bf) {
    const size_t ncp = (nc + NR - 1) / NR * NR;
    for (size_t pc = 0; pc < g->K; pc += KC)
        pack_op_b(im, g, pc, g->K - pc < KC ? g->K - pc : KC, j0, nc, Bf + pc * ncp);
}

/* Floats of packed op(B) a unit needs: its columns, padded to NR, over
 * the whole depth K padded to KC. */
static size_t unit_need(const rx_gemm_op *ops, const gunit *un) {
    const size_t nc = un->j1 - un->j0, ncp = (nc + NR - 1) / NR * NR;
    return ((ops[un->k].K + KC - 1) / KC * KC) * ncp;
}

/* The calling thread's scratch with apack and a bfull of at least `need`
 * floats; NULL when they cannot be allocated. */
static gemm_scratch *scratch_bfull(size_t need) {
    if (!tl.apack)
        tl.apack = rx_thread_buffer(RX_BUF_GEMM_A, ((size_t)MC * KC + MR_MAX) * sizeof(float));
    if (need > tl.bfull_n) {
        tl.bfull = need <= SIZE_MAX / sizeof(float)
                       ? rx_thread_buffer(RX_BUF_GEMM_FULL, need * sizeof(float)) : NULL;
        tl.bfull_n = tl.bfull ? need : 0;
        tl.bkey[0] = 0;
    }
    return tl.apack && tl.bfull ? &tl : NULL;
}

/* RX_ENOMEM when the thread's buffers cannot be allocated (the unit's C
 * is then untouched). */
static int run_unit(const gemm_impl *im, const rx_gemm_op *ops, const gunit *un, size_t batch) {
    const rx_gemm_op *g = &ops[un->k];
    const size_t nc = un->j1 - un->j0, ncp = (nc + NR - 1) / NR * NR;
    gemm_scratch *sc = scratch_bfull(unit_need(ops, un));
    if (!sc) return RX_ENOMEM;
    if (sc->bkey[0] != batch || sc->bkey[1] != un->k || sc->bkey[2] != un->jb) {
        pack_b_full(im, g, un->j0, nc, sc->bfull);
        sc->bkey[0] = batch, sc->bkey[1] = un->k, sc->bkey[2] = un->jb;
    }
    for (size_t pc = 0; pc < g->K; pc += KC)
        sgemm_block(im, g, un->i0, un->i1 - un->i0, pc, g->K - pc < KC ? g->K - pc : KC, un->j0,
                    nc, sc->bfull + pc * ncp, sc->apack, pc > 0 || g->beta != 0.0f);
    return RX_OK;
}

/* Segment state: next unit from the front (low half), end (high half). */
static int claim(uint64_t *seg, int back, size_t *u) {
    uint64_t w = __atomic_load_n(seg, __ATOMIC_ACQUIRE);
    for (;;) {
        uint32_t lo = (uint32_t)w, hi = (uint32_t)(w >> 32);
        if (lo >= hi) return 0;
        uint64_t nw = back ? ((uint64_t)(hi - 1) << 32 | lo) : ((uint64_t)hi << 32 | (lo + 1));
        if (__atomic_compare_exchange_n(seg, &w, nw, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            *u = back ? hi - 1 : lo;
            return 1;
        }
    }
}

/* Each op's unit rows R (multiple of the kernel's mr, <= MC) and columns W.
 * Aims at ~8 units per thread, so stealing can even out a slow core. An op
 * with few row slivers for the team (a weight gradient has M = C rows and
 * K = B*T deep: 16 slivers at C = 256) is cut into narrower column blocks
 * until it has two units per thread, else 48 of 64 threads would idle
 * through it. The cut never changes a result: each C element is summed
 * over k in the same order whatever its unit. */
static void unit_shape(const rx_gemm_op *g, size_t mr, int nt, double target, size_t *R,
                       size_t *W) {
    size_t nbj = (g->N + UNIT_W - 1) / UNIT_W;
    *W = ((g->N + nbj - 1) / nbj + NR - 1) / NR * NR;
    double rows = target / ((double)*W * (double)g->K);
    *R = rows >= MC ? MC : ((size_t)rows + mr - 1) / mr * mr;
    if (*R < mr) *R = mr;
    const size_t nbi = (g->M + *R - 1) / *R, want = 2 * (size_t)nt;
    if (nbi * nbj < want && *W > MIN_UNIT_W) {
        nbj = (want + nbi - 1) / nbi;
        *W = ((g->N + nbj - 1) / nbj + NR - 1) / NR * NR;
        if (*W < MIN_UNIT_W) *W = MIN_UNIT_W;
    }
}

/* Whether the team shares op g by columns rather than rows: g has fewer
 * rows than columns and they fit one unit (a decode step of many
 * sequences: M = 64 rows by a weight's thousands of columns). Shared by
 * rows, every thread would pack (for a frozen base: decode) all of op(B)
 * for its few rows; by columns, each packs its own part once. */
static int by_columns(const rx_gemm_op *g) { return g->M <= MC && g->M < g->N; }

/* Fills the calling thread's unit table (thread part by thread part) and
 * seg; returns the count, 0 when the units would not fit the 32-bit
 * segment bounds, SIZE_MAX when the table cannot be allocated. */
static size_t plan_units(const rx_gemm_op *ops, size_t nops, size_t mr, int nt,
                         double total, uint64_t *seg) {
    gemm_scratch *sc = &tl;
    const double target = total / (8.0 * nt);
    size_t nu = 0;
    for (int pass = 0; pass < 2; pass++) {
        nu = 0;
        for (int t = 0; t < nt; t++) {
            if (pass) seg[t] = nu;
            for (size_t k = 0; k < nops; k++) {
                const rx_gemm_op *g = &ops[k];
                size_t R, W, mb = (g->M + mr - 1) / mr;
                unit_shape(g, mr, nt, target, &R, &W);
                size_t r0 = mb * t / nt * mr, r1 = mb * (t + 1) / nt * mr;
                if (r1 > g->M) r1 = g->M;
                const size_t nbj = (g->N + W - 1) / W;
                size_t jb0 = 0, jb1 = nbj;   /* by rows: every column block */
                if (by_columns(g)) {
                    r0 = 0, r1 = g->M;
                    jb0 = nbj * t / nt, jb1 = nbj * (t + 1) / nt;
                }
                for (size_t jb = jb0, j0 = jb0 * W; jb < jb1; j0 += W, jb++)
                    for (size_t i0 = r0; i0 < r1; i0 += R, nu++)
                        if (pass)
                            sc->units[nu] = (gunit){k, jb, i0, i0 + R < r1 ? i0 + R : r1, j0,
                                                   j0 + W < g->N ? j0 + W : g->N};
            }
        }
        if (!pass && nu > UINT32_MAX - 1) return 0; /* segments count in 32 bits */
        if (!pass && nu > sc->units_n) {
            sc->units = rx_thread_buffer(RX_BUF_GEMM_UNITS, nu * sizeof *sc->units);
            sc->units_n = sc->units ? nu : 0;
            if (!sc->units) return SIZE_MAX;
        }
    }
    for (int t = 0; t < nt; t++) {
        uint64_t hi = t + 1 < nt ? seg[t + 1] : nu;
        seg[t] = hi << 32 | seg[t];
    }
    return nu;
}

/* The k window of op g (a multiple of KC) that keeps its widest unit's
 * bfull (unit_shape's W is at most UNIT_W, or N padded to NR) within the
 * budget; 0 when all of K does. */
static size_t k_window(const rx_gemm_op *g) {
    const size_t w = g->N < UNIT_W ? (g->N + NR - 1) / NR * NR : UNIT_W;
    if ((g->K + KC - 1) / KC * KC * w <= full_budget) return 0;
    const size_t kw = full_budget / w / KC * KC;
    return kw < KC ? KC : kw;
}

/* Op g over k [k0, k0 + kn): A and B (or the source's k) offset, and
 * added to C after the first window. Each C element is summed over the
 * same KC blocks in the same order as by the whole op (k0 a multiple of
 * KC), each block's sum added to C as the next block of the whole op
 * would be, so the windows one after another give its bits. */
static rx_gemm_op k_slice(const rx_gemm_op *g, size_t k0, size_t kn) {
    rx_gemm_op s = *g;
    s.K = kn;
    s.A = g->ta ? g->A + k0 * g->lda : g->A + k0;
    if (g->bsrc) s.bsrc_k0 = g->bsrc_k0 + k0;
    else s.B = g->tb ? g->B + k0 : g->B + k0 * g->ldb;
    if (k0) s.beta = 1.0f;
    return s;
}

static int sgemm_parallel(const gemm_impl *im, const rx_gemm_op *ops, size_t nops, int nt,
                          double total);

/* sgemm_parallel over the batch, each op too deep for the budget
 * (k_window) after the rest, alone, in its k windows in order. */
static int sgemm_windows(const gemm_impl *im, const rx_gemm_op *ops, size_t n, int nt,
                         double total) {
    rx_gemm_op whole[MAX_BATCH];
    size_t nw = 0;
    for (size_t k = 0; k < n; k++)
        if (!k_window(&ops[k])) whole[nw++] = ops[k];
        else total -= (double)ops[k].M * ops[k].N * ops[k].K;
    int rc = nw ? sgemm_parallel(im, whole, nw, nt, total) : RX_OK;
    for (size_t k = 0; k < n && rc == RX_OK; k++) {
        const size_t kw = k_window(&ops[k]), K = ops[k].K;
        for (size_t k0 = 0; kw && k0 < K && rc == RX_OK; k0 += kw) {
            const rx_gemm_op s = k_slice(&ops[k], k0, K - k0 < kw ? K - k0 : kw);
            rc = sgemm_parallel(im, &s, 1, nt, (double)s.M * s.N * s.K);
        }
    }
    return rc;
}

/* RX_OK or RX_ENOMEM (some units then not computed). */
static int sgemm_parallel(const gemm_impl *im, const rx_gemm_op *ops, size_t nops, int nt,
                          double total) {
    uint64_t seg[MAX_THREADS];
    const size_t nu = plan_units(ops, nops, im->mr, nt, total, seg);
    if (nu == SIZE_MAX) return RX_ENOMEM;
    if (nu == 0) {   /* more units than 32-bit segments count: a size limit, not memory */
        for (size_t k = 0; k < nops; k++)
            if (sgemm_serial(im, &ops[k]) != RX_OK) return RX_ENOMEM;
        return RX_OK;
    }
    const gunit *units = tl.units;
    /* Every thread sizes its packed-B buffer for the batch's widest unit
     * before it runs any: a thread may steal any unit, and which it steals
     * depends on the timing, so sizing by the units it happens to run would
     * let a step allocate long after the first one (tests/test_noalloc.py
     * saw it on a loaded machine). */
    size_t widest = 0;
    for (size_t u = 0; u < nu; u++) {
        const size_t need = unit_need(ops, &units[u]);
        if (need > widest) widest = need;
    }
    static size_t batches;
    const size_t batch = __atomic_add_fetch(&batches, 1, __ATOMIC_RELAXED);
    int fail = 0;
#pragma omp parallel num_threads(nt) reduction(| : fail)
    {
        /* OpenMP may grant fewer threads than asked (OMP_THREAD_LIMIT,
         * OMP_DYNAMIC): stealing then finishes every segment */
        const int t = rx_thread_id();
        size_t v;
        if (!scratch_bfull(widest)) fail = 1;
        while (claim(&seg[t], 0, &v)) fail |= run_unit(im, ops, &units[v], batch) != RX_OK;
        for (int d = 1; d < nt; d++)
            while (claim(&seg[(t + d) % nt], 1, &v))
                fail |= run_unit(im, ops, &units[v], batch) != RX_OK;
    }
    return fail ? RX_ENOMEM : RX_OK;
}

/* ---- small M -----------------------------------------------------------
 * Decoding multiplies a few rows (one per sequence) by every weight, so
 * op(B) is read once per call and packing it (a KC x NC panel written
 * then read back, far past L1) costs more memory traffic than the product.
 * Up to small_m rows, op(B) is read in place instead: an untransposed B
 * row by row (small_stream: a unit's columns of four k rows at a time
 * into every row's partial sums, kept in L1), a transposed B or a
 * source's B (a frozen base) packed one NR-column sliver at a time into
 * L1, where R x 16 register tiles of up to six rows use it (small_packed).
 * op(A) is read in place. The columns are cut into units the team shares.
 * Each C element is still one FMA chain over each KC-deep block of k from
 * zero, added to C in k order exactly as the packed kernels add it: the
 * same bits as the packed path at any M, any cut and any thread count,
 * so a row's result depends on that row alone (batch invariance for
 * generation) and training is unchanged. */
#define SMALL_T 4096  /* floats of a unit's row sums (16 KiB, half of L1) */
/* floats of the row sums of an op cut by rows of B (sgemm_rows): 32 KiB,
 * all of a 32 KiB L1, and still faster than the column cut (8 rows of 768
 * columns, below) */
#define ROWS_T 8192
_Static_assert(ROWS_T >= SMALL_T, "small_stream's sums hold either cut's");
/* the rows up to which a batch comes here: rx_gemm_small_bound (gemm_ops.c) */
_Static_assert(SMALL_T / RX_GEMM_SMALL_MAX >= 8 * NR, "a unit: at least 8 slivers wide");

#ifdef RX_X86
/* C[R, NR] (+)= op(A)[R, kc] . Bp[kc][NR], Bp a packed sliver, summed as
 * ukernel_avx2 sums (t from zero, one FMA per k, then C + t) with R <= MR
 * rows read in place, R a constant at each use. */
RX_AVX2 static inline __attribute__((always_inline)) void
small_tile(size_t R, size_t kc, const float *A, size_t rs, size_t cs, const float *Bp, float *C,
           size_t ldc, int acc) {
    __m256 c[MR][2];
#pragma GCC unroll 6
    for (size_t i = 0; i < R; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
    for (size_t p = 0; p < kc; p++, A += cs, Bp += NR) {
        const __m256 b0 = _mm256_load_ps(Bp), b1 = _mm256_load_ps(Bp + 8);
#pragma GCC unroll 6
        for (size_t i = 0; i < R; i++) {
            const __m256 x = _mm256_broadcast_ss(A + i * rs);
            c[i][0] = _mm256_fmadd_ps(x, b0, c[i][0]);
            c[i][1] = _mm256_fmadd_ps(x, b1, c[i][1]);
        }
    }
#pragma GCC unroll 6
    for (size_t i = 0; i < R; i++)
        for (size_t v = 0; v < 2; v++) {
            float *ci = C + i * ldc + 8 * v;
            _mm256_storeu_ps(ci, acc ? _mm256_add_ps(c[i][v], _mm256_loadu_ps(ci)) : c[i][v]);
        }
}

/* small_tile for R = 1..MR rows */
RX_AVX2 static void small_rows(size_t R, size_t kc, const float *A, size_t rs, size_t cs,
                               const float *Bp, float *C, size_t ldc, int acc) {
    switch (R) {
    case 1: small_tile(1, kc, A, rs, cs, Bp, C, ldc, acc); break;
    case 2: small_tile(2, kc, A, rs, cs, Bp, C, ldc, acc); break;
    case 3: small_tile(3, kc, A, rs, cs, Bp, C, ldc, acc); break;
    case 4: small_tile(4, kc, A, rs, cs, Bp, C, ldc, acc); break;
    case 5: small_tile(5, kc, A, rs, cs, Bp, C, ldc, acc); break;
    default: small_tile(MR, kc, A, rs, cs, Bp, C, ldc, acc); break;
    }
}

/* P (a constant) k steps of small_stream: t[i][0:W] += A[i][p..p+P) .
 * B[p..p+P)[0:W], one FMA per k in order, each partial sum loaded and
 * stored once per P steps; two rows at a time, so each B vector is loaded
 * once for both (the chains are each row's alone, as before). */
RX_AVX2 static inline __attribute__((always_inline)) void
small_steps(size_t P, size_t M, size_t W, const float *A, size_t rs, size_t cs, const float *B,
            size_t ldb, float *t) {
    const size_t W8 = W / 8 * 8;
    size_t i = 0;
    /* two rows a pass: each B vector loaded once for both */
    for (; i + 2 <= M; i += 2) {
        __m256 x[2][4];
        float *t0 = t + i * W, *t1 = t0 + W;
#pragma GCC unroll 4
        for (size_t q = 0; q < P; q++) {
            x[0][q] = _mm256_broadcast_ss(A + i * rs + q * cs);
            x[1][q] = _mm256_broadcast_ss(A + (i + 1) * rs + q * cs);
        }
        for (size_t v = 0; v < W8; v += 8) {
            __m256 c0 = _mm256_loadu_ps(t0 + v), c1 = _mm256_loadu_ps(t1 + v);
#pragma GCC unroll 4
            for (size_t q = 0; q < P; q++) {
                const __m256 b = _mm256_loadu_ps(B + q * ldb + v);
                c0 = _mm256_fmadd_ps(x[0][q], b, c0);
                c1 = _mm256_fmadd_ps(x[1][q], b, c1);
            }
            _mm256_storeu_ps(t0 + v, c0);
            _mm256_storeu_ps(t1 + v, c1);
        }
        for (size_t v = W8; v < W; v++)
            for (size_t q = 0; q < P; q++) {
                t0[v] = fmaf(A[i * rs + q * cs], B[q * ldb + v], t0[v]);
                t1[v] = fmaf(A[(i + 1) * rs + q * cs], B[q * ldb + v], t1[v]);
            }
    }
    for (; i < M; i++) {
        __m256 x[4];
        float *ti = t + i * W;
#pragma GCC unroll 4
        for (size_t q = 0; q < P; q++) x[q] = _mm256_broadcast_ss(A + i * rs + q * cs);
        for (size_t v = 0; v < W8; v += 8) {
            __m256 c = _mm256_loadu_ps(ti + v);
#pragma GCC unroll 4
            for (size_t q = 0; q < P; q++)
                c = _mm256_fmadd_ps(x[q], _mm256_loadu_ps(B + q * ldb + v), c);
            _mm256_storeu_ps(ti + v, c);
        }
        for (size_t v = W8; v < W; v++)
            for (size_t q = 0; q < P; q++) ti[v] = fmaf(A[i * rs + q * cs], B[q * ldb + v], ti[v]);
    }
}

/* Columns [j0, j1) (at most ROWS_T / M of them) of op g over k block
 * [pc, pc+kc), an untransposed B read in place row by row: four k rows of
 * the unit's columns at a time, contiguous runs the prefetchers follow,
 * multiplied into every row's partial sums t (in L1). The sums run from
 * zero, one FMA per k in order: the packed kernels' chain, element for
 * element. They are written to out[i][0:W] (row stride ldo), added to
 * what it holds if acc. */
RX_AVX2 static void small_stream(const rx_gemm_op *g, size_t pc, size_t kc, size_t j0,
                                 size_t j1, float *out, size_t ldo, int acc) {
    const size_t rs = g->ta ? 1 : g->lda, cs = g->ta ? g->lda : 1, ldb = g->ldb;
    const size_t M = g->M, W = j1 - j0;
    const float *A = g->A + pc * cs, *B = g->B + pc * ldb + j0;
    float t[ROWS_T];
    memset(t, 0, M * W * sizeof(float));
    size_t p = 0;
    for (; p + 4 <= kc; p += 4) small_steps(4, M, W, A + p * cs, rs, cs, B + p * ldb, ldb, t);
    for (; p < kc; p++) small_steps(1, M, W, A + p * cs, rs, cs, B + p * ldb, ldb, t);
    for (size_t i = 0; i < M; i++) {
        float *c = out + i * ldo;
        const float *ti = t + i * W;
        for (size_t v = 0; v < W; v++) c[v] = acc ? ti[v] + c[v] : ti[v];
    }
}

/* Columns [j0, j1) of op g over all of K, op(B) packed one NR-column
 * sliver of one KC-deep block at a time into Bp (KC * NR floats, L1) by
 * pack_op_b: a sliver's blocks in turn (each of its C elements summed in
 * k order as ever), so its B rows, a base's stored rows above all, are
 * read whole, from start to end, before the next sliver's. */
RX_AVX2 static void small_packed(const gemm_impl *im, const rx_gemm_op *g, size_t j0, size_t j1,
                                 float *Bp) {
    const size_t rs = g->ta ? 1 : g->lda, cs = g->ta ? g->lda : 1;
    float edge[MR * NR];
    for (size_t j = j0; j < j1; j += NR) {
        const size_t nr = j1 - j < NR ? j1 - j : NR;
        for (size_t pc = 0; pc < g->K; pc += KC) {
            const size_t kc = g->K - pc < KC ? g->K - pc : KC;
            const int acc = pc > 0 || g->beta != 0.0f;
            const float *A = g->A + pc * cs;
            pack_op_b(im, g, pc, kc, j, nr, Bp);
            for (size_t i = 0; i < g->M; i += MR) {
                const size_t R = g->M - i < MR ? g->M - i : MR;
                float *c = g->C + i * g->ldc + j;
                if (nr == NR) {
                    small_rows(R, kc, A + i * rs, rs, cs, Bp, c, g->ldc, acc);
                    continue;
                }
                small_rows(R, kc, A + i * rs, rs, cs, Bp, edge, NR, 0);
                for (size_t r = 0; r < R; r++)
                    for (size_t q = 0; q < nr; q++)
                        c[r * g->ldc + q] = acc ? edge[r * NR + q] + c[r * g->ldc + q]
                                                : edge[r * NR + q];
            }
        }
    }
}

/* One or two rows give a 16-column sliver's tile two or four FMA chains,
 * too few to cover the FMA's latency: small_group packs G slivers side by
 * side (G R >= 4: eight chains), SMALL_PK k of them at a time (G x 64 x
 * 16 floats, 16 KiB at G 4, in L1), the accumulators kept in registers
 * across the packs of a KC block, so each chain is still one FMA per k in
 * order from zero, added to C at the block's end. */
#define SMALL_PK 64
_Static_assert(KC % SMALL_PK == 0 && SMALL_PK % 32 == 0, "a pack: whole blocks of a base");

/* C[R, G NR] at columns j (+)= op(A)[R, kc] . op(B) over k block [pc,
 * pc+kc) of op g, R = g->M (1 or 2) and G constants at each use */
RX_AVX2 static inline __attribute__((always_inline)) void
small_group(size_t R, size_t G, const gemm_impl *im, const rx_gemm_op *g, size_t pc, size_t kc,
            size_t j, int acc, float *Bp) {
    const size_t rs = g->ta ? 1 : g->lda, cs = g->ta ? g->lda : 1;
    __m256 c[2][8];
#pragma GCC unroll 8
    for (size_t v = 0; v < 2 * G; v++) c[0][v] = c[1][v] = _mm256_setzero_ps();
    for (size_t p = 0; p < kc; p += SMALL_PK) {
        const size_t pk = kc - p < SMALL_PK ? kc - p : SMALL_PK;
        pack_op_b(im, g, pc + p, pk, j, G * NR, Bp);
        const float *A = g->A + (pc + p) * cs;
        for (size_t q = 0; q < pk; q++, A += cs) {
            __m256 x[2];
#pragma GCC unroll 2
            for (size_t i = 0; i < R; i++) x[i] = _mm256_broadcast_ss(A + i * rs);
#pragma GCC unroll 4
            for (size_t s = 0; s < G; s++) {
                const float *b = Bp + (s * pk + q) * NR;
                const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 2
                for (size_t i = 0; i < R; i++) {
                    c[i][2 * s] = _mm256_fmadd_ps(x[i], b0, c[i][2 * s]);
                    c[i][2 * s + 1] = _mm256_fmadd_ps(x[i], b1, c[i][2 * s + 1]);
                }
            }
        }
    }
#pragma GCC unroll 2
    for (size_t i = 0; i < R; i++)
#pragma GCC unroll 8
        for (size_t v = 0; v < 2 * G; v++) {
            float *ci = g->C + i * g->ldc + j + 8 * v;
            _mm256_storeu_ps(ci, acc ? _mm256_add_ps(c[i][v], _mm256_loadu_ps(ci)) : c[i][v]);
        }
}

/* Columns [j0, j1) of op g over all of K, g->M <= 2: whole groups of G
 * slivers by small_group, the rest by small_packed */
RX_AVX2 static void small_grouped(const gemm_impl *im, const rx_gemm_op *g, size_t j0, size_t j1,
                                  float *Bp) {
    const size_t G = g->M == 1 ? 4 : 2, w = G * NR;
    for (; j0 + w <= j1; j0 += w)
        for (size_t pc = 0; pc < g->K; pc += KC) {
            const size_t kc = g->K - pc < KC ? g->K - pc : KC;
            const int acc = pc > 0 || g->beta != 0.0f;
            if (g->M == 1) small_group(1, 4, im, g, pc, kc, j0, acc, Bp);
            else small_group(2, 2, im, g, pc, kc, j0, acc, Bp);
        }
    if (j0 < j1) small_packed(im, g, j0, j1, Bp);
}

/* Columns [j0, j1) of op g over all of K; RX_ENOMEM when a sliver needs
 * packing and the thread's buffer cannot be allocated (C untouched). */
static int small_unit(const gemm_impl *im, const rx_gemm_op *g, size_t j0, size_t j1) {
    /* a source's own small-M product (a Q8_0 or Q4_0 base's), else packed */
    if (g->bsrc && g->bsrc->small_f32) j0 += g->bsrc->small_f32(g->bsrc_of, g, j0, j1, KC);
    if (j0 >= j1) return RX_OK;
    if (g->tb || g->bsrc) {
        gemm_scratch *sc = scratch_packs();
        if (!sc) return RX_ENOMEM;
        /* MC * KC floats: room for a KC x NR sliver or 4 x SMALL_PK x NR */
        if (g->M <= 2) small_grouped(im, g, j0, j1, sc->apack);
        else small_packed(im, g, j0, j1, sc->apack);
        return RX_OK;
    }
    for (size_t pc = 0; pc < g->K; pc += KC) {
        const size_t kc = g->K - pc < KC ? g->K - pc : KC;
        small_stream(g, pc, kc, j0, j1, g->C + j0, g->ldc, pc > 0 || g->beta != 0.0f);
    }
    return RX_OK;
}

/* Whether every op of a batch of n streams its B (untransposed, read in
 * place) with all its row sums in small_stream's buffer (M N <= ROWS_T) */
static int stream_rows(const rx_gemm_op *ops, size_t n) {
    for (size_t k = 0; k < n; k++)
        if (ops[k].tb || ops[k].bsrc || ops[k].M * ops[k].N > ROWS_T) return 0;
    return 1;
}

/* The column at which position q of the line cuts a piece of kc k rows
 * by N columns that starts at s: 0 before it, N at or past its end, else
 * q's column rounded down to a multiple of 8 (the threads either side of
 * a cut compute the same column) */
static size_t line_col(size_t q, size_t s, size_t kc, size_t N) {
    if (q <= s) return 0;
    if (q - s >= kc * N) return N;
    return (q - s) / kc / 8 * 8;
}

/* A stream_rows batch with a team. Cut by columns (sgemm_small), each
 * thread reads a slice of every row of B, runs of a few KiB the
 * prefetchers follow poorly (one row by 3,072 x 768: 26 GB/s cut by
 * columns, 30 cut by rows, 2-core Zen 4; 8 rows by the 0.1B model's
 * projections, 24 KiB of sums: 5-20% faster decoding). Here the ops' k blocks are
 * laid end to end, op by op, each block's columns in order, and the line
 * is cut into nt runs of equal bytes of B, one a thread: each thread reads
 * whole rows front to back. A piece's sums (from zero over its k block,
 * as ever) go to part ([k block][M][N] an op, in turn); after the team's
 * barrier each thread adds its share of the columns into C in k-block
 * order. The same chains, added in the same order as a unit's: the same
 * bits. */
static void sgemm_rows(const rx_gemm_op *ops, size_t nops, int nt, float *part) {
    size_t total = 0, cols = 0;
    for (size_t k = 0; k < nops; k++) total += ops[k].K * ops[k].N, cols += ops[k].N;
#pragma omp parallel num_threads(nt)
    {
        const size_t t = (size_t)rx_thread_id(), T = (size_t)rx_team_size();
        const size_t lo = total * t / T, hi = total * (t + 1) / T;
        size_t at = 0;
        float *pk = part;
        for (size_t k = 0; k < nops; k++) {
            const rx_gemm_op *g = &ops[k];
            for (size_t pc = 0; pc < g->K; pc += KC, pk += g->M * g->N) {
                const size_t kc = g->K - pc < KC ? g->K - pc : KC, s = at + pc * g->N;
                const size_t j0 = line_col(lo, s, kc, g->N), j1 = line_col(hi, s, kc, g->N);
                if (j0 < j1) small_stream(g, pc, kc, j0, j1, pk + j0, g->N, 0);
            }
            at += g->K * g->N;
        }
#pragma omp barrier
        const size_t c0 = cols * t / T, c1 = cols * (t + 1) / T;
        size_t first = 0;
        pk = part;
        for (size_t k = 0; k < nops; k++) {
            const rx_gemm_op *g = &ops[k];
            const size_t M = g->M, N = g->N, nkb = (g->K + KC - 1) / KC;
            const size_t j0 = c0 > first ? c0 - first : 0, j1 = c1 - first < N ? c1 - first : N;
            for (size_t i = 0; i < M && c1 > first && j0 < j1; i++) {
                float *c = g->C + i * g->ldc;
                for (size_t j = j0; j < j1; j++) {
                    float v = pk[i * N + j];
                    if (g->beta != 0.0f) v += c[j];
                    for (size_t b = 1; b < nkb; b++) v = pk[(b * M + i) * N + j] + v;
                    c[j] = v;
                }
            }
            first += N;
            pk += nkb * M * N;
        }
    }
}

/* A batch whose ops all have M <= small_m: with a team, a stream_rows
 * batch cut by rows of B (sgemm_rows); else each op's columns cut into
 * units as wide as its row sums fit in SMALL_T floats allow (long runs of
 * each B row), in a multiple of nt units so the team shares them evenly;
 * taken in turn. Neither cut changes a bit. */
static int sgemm_small(const gemm_impl *im, const rx_gemm_op *ops, size_t nops, int nt) {
    if (nt > 1 && stream_rows(ops, nops)) {   /* else (no buffer) the column cut below */
        size_t floats = 0;
        for (size_t k = 0; k < nops; k++)
            floats += (ops[k].K + KC - 1) / KC * ops[k].M * ops[k].N;
        float *part = rx_thread_buffer(RX_BUF_GEMM_PART, floats * sizeof(float));
        if (part) {
            sgemm_rows(ops, nops, nt, part);
            return RX_OK;
        }
    }
    size_t first[MAX_BATCH + 1], width[MAX_BATCH];
    first[0] = 0;
    for (size_t k = 0; k < nops; k++) {
        const size_t N = ops[k].N, wmax = SMALL_T / ops[k].M / 8 * 8;
        size_t nb = (N + wmax - 1) / wmax;
        nb = (nb + (size_t)nt - 1) / (size_t)nt * (size_t)nt;
        width[k] = ((N + nb - 1) / nb + 7) / 8 * 8;
        first[k + 1] = first[k] + (N + width[k] - 1) / width[k];
    }
    const long nu = (long)first[nops];
    int fail = 0;
    if (nt <= 1) {   /* no team to fork: the attention's tiles come here by thousands */
        for (size_t k = 0; k < nops && !fail; k++)
            for (size_t j0 = 0; j0 < ops[k].N && !fail; j0 += width[k])
                fail = small_unit(im, &ops[k], j0, j0 + width[k] < ops[k].N ? j0 + width[k]
                                                                           : ops[k].N) != RX_OK;
        return fail ? RX_ENOMEM : RX_OK;
    }
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) reduction(| : fail)
    for (long u = 0; u < nu; u++) {
        size_t k = 0;
        while (first[k + 1] <= (size_t)u) k++;
        const size_t j0 = ((size_t)u - first[k]) * width[k];
        const size_t j1 = j0 + width[k] < ops[k].N ? j0 + width[k] : ops[k].N;
        fail |= small_unit(im, &ops[k], j0, j1) != RX_OK;
    }
    return fail ? RX_ENOMEM : RX_OK;
}

/* whether a batch takes the small-M path: an x86 SIMD kernel (they all
 * give small_tile's bits) and every op at most small_m rows */
static int small_batch(const gemm_impl *im, const rx_gemm_op *ops, size_t n) {
    if (im == &impl_generic || !have_avx2()) return 0;
    const size_t small_m = rx_gemm_small_bound();
    for (size_t k = 0; k < n; k++)
        if (ops[k].M > small_m) return 0;
    return n > 0;
}
#endif

int rx_sgemm_batch(const rx_gemm_op *ops, size_t n) {
    const gemm_impl *im = pick_impl();
    int rc = rx_gemm_check_batch("rx_sgemm", ops, n);
    if (rc != RX_OK) return rc;
    rx_prof_push(RX_PROF_GEMM);
    for (size_t b = 0; b < n && rc == RX_OK; b += MAX_BATCH) {
        rx_gemm_op live[MAX_BATCH];
        const size_t nl = rx_gemm_live_ops(ops + b, n - b < MAX_BATCH ? n - b : MAX_BATCH, live);
        double total = 0.0;
        for (size_t k = 0; k < nl; k++) total += (double)live[k].M * live[k].N * live[k].K;
        int nt = rx_in_parallel() ? 1 : rx_max_threads();
        if (nt > MAX_THREADS) nt = MAX_THREADS;
        if (total < RX_GEMM_MIN_PAR) nt = 1;
#ifdef RX_X86
        if (small_batch(im, live, nl)) {
            rc = sgemm_small(im, live, nl, nt);
            continue;
        }
#endif
        if (nt <= 1)
            for (size_t k = 0; k < nl && rc == RX_OK; k++) rc = sgemm_serial(im, &live[k]);
        else if (nl)
            rc = sgemm_windows(im, live, nl, nt, total);
    }
    rx_prof_pop();
    /* inside a team the message would land on a worker thread: the
     * caller that forked the team reports it */
    if (rc != RX_OK && !rx_in_parallel())
        rx_fail(rc, "rx_sgemm: out of memory for the GEMM packing buffers");
    return rc;
}

int rx_sgemm(int ta, int tb, size_t M, size_t N, size_t K,
             const float *A, size_t lda, const float *B, size_t ldb,
             float beta, float *C, size_t ldc) {
    const rx_gemm_op g = {ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc};
    return rx_sgemm_batch(&g, 1);
}
