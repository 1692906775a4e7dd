/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * gemm.c -- the one single-precision GEMM behind every projection.
 *
 * Goto/BLIS structure: op(B) is packed in KC x NC panels of NR-column
 * slivers, and a 6x16 register-tiled micro-kernel runs over them, the B
 * sliver staying in L1 while the A slivers of an MC x KC block stream from
 * L2. For narrow tiles (N <= NPACK, the LoRA shapes) op(A) is read in
 * place -- six row pointers, or a k-stride when transposed -- because each
 * A element meets only a few B slivers and packing it would cost as much
 * as the arithmetic; wider tiles pack it (a vectorised 6x8 transpose, or a
 * contiguous copy when transposed). Transposes are absorbed by the packing
 * and the A addressing, so one micro-kernel serves A.B, A^T.B and A.B^T.
 *
 * Kernels are picked at run time: AVX2+FMA where the CPU has it, portable C
 * elsewhere.
 *
 * Threading: the C matrix is cut into a pm x pn grid of tiles, one per
 * thread, each tile a complete serial GEMM with its own packing buffers, so
 * threads never synchronise inside a call. The grid minimises the slowest
 * tile's arithmetic plus the packing it repeats.
 */
#include <string.h>

#include "rx_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RX_X86 1
#endif

#define MR 6
#define NR 16
#define KC 256   /* a KC x NR B sliver is 16 KiB: half of L1 */
#define MC 144   /* multiple of MR; the MC x KC A block stays in L2 */
#define NC 4096  /* multiple of NR; the packed B panel lives in L3 */
#define NPACK 128 /* op(A) is packed only for wider tiles, see sgemm_tile */
#define PF_K 48   /* k steps ahead the micro-kernel prefetches a k-strided A */

/* C[MR,NR] (+)= op(A)[MR,kc] . Bp[kc][NR], Bp a packed sliver. Element (i, p)
 * of the A sliver is A[i*rs + p*cs]: cs == 1 reads MR rows of a row-major
 * matrix in place, rs == 1 a packed (or transposed) sliver with k-stride cs. */
typedef void (*ukernel_fn)(size_t kc, const float *A, size_t rs, size_t cs,
                           const float *Bp, float *C, size_t ldc, int acc);
/* Packs op(B) rows [p0,p0+kc) x cols [j0,j0+nc) of a B stored [N,K] (the
 * transposed case) into NR-column slivers. */
typedef void (*packbt_fn)(const float *B, size_t ldb, size_t p0, size_t kc,
                          size_t j0, size_t nc, float *Bp);

/* Packs rows [i0,i0+mc) x cols [p0,p0+kc) of a row-major A into MR-row
 * slivers, k-major, zero-padded; may write MR floats past the last sliver. */
typedef void (*packan_fn)(const float *A, size_t lda, size_t i0, size_t mc,
                          size_t p0, size_t kc, float *Ap);

typedef struct {
    const char *name;
    ukernel_fn kern;
    packbt_fn pack_bt;
    packan_fn pack_an;
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

static void pack_an_generic(const float *A, size_t lda, size_t i0, size_t mc,
                            size_t p0, size_t kc, float *Ap) {
    for (size_t s = 0; s < mc; s += MR) {
        size_t mr = mc - s < MR ? mc - s : MR;
        for (size_t p = 0; p < kc; p++)
            for (size_t i = 0; i < MR; i++)
                Ap[p * MR + i] = i < mr ? A[(i0 + s + i) * lda + p0 + p] : 0.0f;
        Ap += MR * kc;
    }
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

/* Six rows of eight k values, transposed as an 8x8 block with two zero
 * rows: k column q lands at Ap[(p+q)*MR] as eight floats whose last two the
 * next store overwrites (the last ones spill into the buffer's slack). */
RX_AVX2 static void pack_an_avx2(const float *A, size_t lda, size_t i0, size_t mc,
                                 size_t p0, size_t kc, float *Ap) {
    for (size_t s = 0; s < mc; s += MR, Ap += MR * kc) {
        if (mc - s < MR) {
            pack_an_generic(A, lda, i0 + s, mc - s, p0, kc, Ap);
            continue;
        }
        const float *src = A + (i0 + s) * lda + p0;
        size_t p = 0;
        for (; p + 8 <= kc; p += 8) {
            __m256 r[8];
            for (size_t i = 0; i < MR; i++) r[i] = _mm256_loadu_ps(src + i * lda + p);
            r[6] = r[7] = _mm256_setzero_ps();
            transpose8(r);
            for (size_t q = 0; q < 8; q++) _mm256_storeu_ps(Ap + (p + q) * MR, r[q]);
        }
        for (; p < kc; p++)
            for (size_t i = 0; i < MR; i++) Ap[p * MR + i] = src[i * lda + p];
    }
}
#endif

static const gemm_impl impl_generic = {"generic", ukernel_generic, pack_bt_generic,
                                       pack_an_generic};
#ifdef RX_X86
static const gemm_impl impl_avx2 = {"avx2-fma", ukernel_avx2, pack_bt_avx2, pack_an_avx2};
#endif

/* Set by rx_sgemm_use_kernel (tests); NULL: pick by CPU. */
static const gemm_impl *forced_impl;

static const gemm_impl *pick_impl(void) {
    if (forced_impl) return forced_impl;
#ifdef RX_X86
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return &impl_avx2;
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
    if (!strcmp(name, impl_avx2.name) && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma")) {
        forced_impl = &impl_avx2;
        return RX_OK;
    }
#endif
    return RX_EINVAL;
}

/* op(B) rows [p0,p0+kc) x cols [j0,j0+nc) into NR-column slivers, k-major,
 * zero-padded to a whole sliver. Untransposed B is read a row at a time so
 * the reads run sequentially through memory (sliver by sliver, every one of
 * kc rows would be a new page). */
static void pack_b(const gemm_impl *im, int tb, const float *B, size_t ldb, size_t p0,
                   size_t kc, size_t j0, size_t nc, float *Bp) {
    if (tb) {
        im->pack_bt(B, ldb, p0, kc, j0, nc, Bp);
        return;
    }
    const size_t full = nc / NR * NR;
    for (size_t p = 0; p < kc; p++) {
        const float *src = B + (p0 + p) * ldb + j0;
        float *dst = Bp + p * NR;
        for (size_t s = 0; s < full; s += NR) memcpy(dst + s * kc, src + s, NR * sizeof(float));
        if (full < nc)
            for (size_t j = 0; j < NR; j++)
                dst[full * kc + j] = full + j < nc ? src[full + j] : 0.0f;
    }
}

/* op(A) rows [i0,i0+mc) x cols [p0,p0+kc) into MR-row slivers, k-major,
 * zero-padded to a whole sliver. */
static void pack_a(const gemm_impl *im, int ta, const float *A, size_t lda, size_t i0,
                   size_t mc, size_t p0, size_t kc, float *Ap) {
    if (!ta) {
        im->pack_an(A, lda, i0, mc, p0, kc, Ap);
        return;
    }
    for (size_t s = 0; s < mc; s += MR) {
        size_t mr = mc - s < MR ? mc - s : MR;
        for (size_t p = 0; p < kc; p++) {
            const float *src = A + (p0 + p) * lda + i0 + s;
            float *dst = Ap + p * MR;
            if (mr == MR) {
                memcpy(dst, src, MR * sizeof(float));
                continue;
            }
            for (size_t i = 0; i < MR; i++) dst[i] = i < mr ? src[i] : 0.0f;
        }
        Ap += MR * kc;
    }
}

/* Packing buffers live for the thread's lifetime: a training step calls the
 * GEMM hundreds of times and must not allocate in it. */
static _Thread_local float *tl_apack, *tl_bpack;

/* C[M,N] = beta*C + op(A).op(B) in double, no buffers: the out-of-memory path. */
static void sgemm_plain(int ta, int tb, size_t M, size_t N, size_t K, const float *A,
                        size_t lda, const float *B, size_t ldb, float beta, float *C,
                        size_t ldc) {
    for (size_t i = 0; i < M; i++)
        for (size_t j = 0; j < N; j++) {
            double s = beta != 0.0f ? C[i * ldc + j] : 0.0;
            for (size_t p = 0; p < K; p++)
                s += (double)(ta ? A[p * lda + i] : A[i * lda + p]) *
                     (tb ? B[j * ldb + p] : B[p * ldb + j]);
            C[i * ldc + j] = (float)s;
        }
}

/* The tile C[0:M,0:N] of a serial GEMM (A, B, C already offset to it). */
static void sgemm_tile(const gemm_impl *im, int ta, int tb, size_t M, size_t N, size_t K,
                       const float *A, size_t lda, const float *B, size_t ldb,
                       float beta, float *C, size_t ldc) {
    if (!tl_apack) tl_apack = rx_falloc((size_t)MC * KC + MR); /* + pack_an slack */
    if (!tl_bpack) tl_bpack = rx_falloc((size_t)KC * NC);
    float *Ap = tl_apack, *Bp = tl_bpack;
    if (!Ap || !Bp) {
        sgemm_plain(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    const ukernel_fn kern = im->kern;
    /* Reused over more than NPACK/NR B slivers, a packed A block pays for
     * its packing: the micro-kernel then streams one contiguous sliver
     * instead of six rows (or kc strided lines) from L2. Measured on Zen3. */
    const int pack_all = N > NPACK;
    float edge[MR * NR];
    for (size_t jc = 0; jc < N; jc += NC) {
        size_t nc = N - jc < NC ? N - jc : NC;
        for (size_t pc = 0; pc < K; pc += KC) {
            size_t kc = K - pc < KC ? K - pc : KC;
            int acc = pc > 0 || beta != 0.0f;
            pack_b(im, tb, B, ldb, pc, kc, jc, nc, Bp);
            for (size_t ic = 0; ic < M; ic += MC) {
                size_t mc = M - ic < MC ? M - ic : MC;
                /* A in place: only a ragged last sliver is packed (zero rows
                 * would otherwise be read past the matrix). */
                size_t full = pack_all ? 0 : mc / MR * MR;
                if (full < mc) pack_a(im, ta, A, lda, ic + full, mc - full, pc, kc, Ap);
                for (size_t jr = 0; jr < nc; jr += NR) {
                    size_t nr = nc - jr < NR ? nc - jr : NR;
                    const float *bp = Bp + jr * kc;
                    for (size_t ir = 0; ir < mc; ir += MR) {
                        size_t mr = mc - ir < MR ? mc - ir : MR;
                        float *c = C + (ic + ir) * ldc + jc + jr;
                        const float *ap;
                        size_t rs, cs;
                        if (ir < full && !ta) {
                            ap = A + (ic + ir) * lda + pc, rs = lda, cs = 1;
                        } else if (ir < full) {
                            ap = A + pc * lda + ic + ir, rs = 1, cs = lda;
                        } else {
                            ap = Ap + (ir - full) * kc, rs = 1, cs = MR;
                        }
                        if (mr == MR && nr == NR) {
                            kern(kc, ap, rs, cs, bp, c, ldc, acc);
                            continue;
                        }
                        kern(kc, ap, rs, cs, bp, edge, NR, 0);
                        for (size_t i = 0; i < mr; i++)
                            for (size_t j = 0; j < nr; j++)
                                c[i * ldc + j] = acc ? c[i * ldc + j] + edge[i * NR + j]
                                                     : edge[i * NR + j];
                    }
                }
            }
        }
    }
}

/* Relative time of one thread's tile: tm x tn padded to whole slivers, plus
 * the packing every thread repeats for its own columns (and rows when A is
 * transposed), in units of one micro-kernel FMA step per 16 MACs. */
static double tile_cost(size_t tm, size_t tn, size_t K, int ta, int tb) {
    double m = (double)tm * MR, n = (double)tn * NR, k = (double)K;
    return m * n * k / 16.0 + k * n * (tb ? 0.5 : 0.25) + (ta ? k * m * 0.25 : 0.0);
}

void rx_sgemm(int ta, int tb, size_t M, size_t N, size_t K,
              const float *A, size_t lda, const float *B, size_t ldb,
              float beta, float *C, size_t ldc) {
    const gemm_impl *im = pick_impl();
    if (M == 0 || N == 0) return;
    if (K == 0) {
        if (beta == 0.0f)
            for (size_t i = 0; i < M; i++) memset(C + i * ldc, 0, N * sizeof(float));
        return;
    }
    int nt = rx_in_parallel() ? 1 : rx_max_threads();
    /* below ~10 us of work a fork/join costs more than it saves */
    if ((double)M * N * K < 262144.0) nt = 1;
    rx_prof_push(RX_PROF_GEMM);
    if (nt <= 1) {
        sgemm_tile(im, ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
        rx_prof_pop();
        return;
    }
    size_t mb = (M + MR - 1) / MR, nb = (N + NR - 1) / NR;
    int pm = 1;
    double best = -1.0;
    for (int d = 1; d <= nt; d++) {
        if (nt % d) continue;
        size_t tm = (mb + d - 1) / d, tn = (nb + (nt / d) - 1) / (nt / d);
        double cost = tile_cost(tm, tn, K, ta, tb);
        if (best < 0 || cost < best) {
            best = cost;
            pm = d;
        }
    }
    int pn = nt / pm;
    /* tiles by index, not by thread id: OpenMP may grant fewer threads than
     * asked (OMP_THREAD_LIMIT, OMP_DYNAMIC) and every tile must still run */
#pragma omp parallel for schedule(static, 1) num_threads(nt)
    for (int id = 0; id < nt; id++) {
        int im_ = id / pn, in = id % pn;
        size_t i0 = mb * im_ / pm * MR, i1 = mb * (im_ + 1) / pm * MR;
        size_t j0 = nb * in / pn * NR, j1 = nb * (in + 1) / pn * NR;
        if (i1 > M) i1 = M;
        if (j1 > N) j1 = N;
        if (i0 < i1 && j0 < j1) {
            const float *a = ta ? A + i0 : A + i0 * lda;
            const float *b = tb ? B + j0 * ldb : B + j0;
            sgemm_tile(im, ta, tb, i1 - i0, j1 - j0, K, a, lda, b, ldb, beta,
                       C + i0 * ldc + j0, ldc);
        }
    }
    rx_prof_pop();
}
