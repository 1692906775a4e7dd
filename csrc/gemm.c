/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * gemm.c -- the one single-precision GEMM behind every projection.
 *
 * Goto/BLIS structure: op(B) is packed in KC x NC panels, op(A) in MC x KC
 * blocks, and a 6x16 register-tiled micro-kernel runs over the packed
 * slivers. Transposes are absorbed by the packing, so one micro-kernel
 * serves A.B, A^T.B and A.B^T. The micro-kernel is picked at run time:
 * AVX2+FMA where the CPU has it, a portable C kernel elsewhere.
 *
 * Threading: the C matrix is cut into a pm x pn grid of tiles, one per
 * thread, each tile a complete serial GEMM with its own packing buffers, so
 * threads never synchronise inside a call.
 */
#include <string.h>

#include "rx_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RX_X86 1
#endif

#define MR 6
#define NR 16
#define KC 256
#define MC 120   /* multiple of MR; MC*KC floats stay in L2 */
#define NC 3072  /* multiple of NR */

typedef void (*ukernel_fn)(size_t kc, const float *Ap, const float *Bp,
                           float *C, size_t ldc, int acc);

/* C[MR,NR] (+)= Ap[kc][MR]^T . Bp[kc][NR] */
static void ukernel_generic(size_t kc, const float *Ap, const float *Bp,
                            float *C, size_t ldc, int acc) {
    float t[MR][NR];
    memset(t, 0, sizeof t);
    for (size_t p = 0; p < kc; p++) {
        const float *a = Ap + p * MR, *b = Bp + p * NR;
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NR; j++) t[i][j] += a[i] * b[j];
    }
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++)
            C[i * ldc + j] = acc ? C[i * ldc + j] + t[i][j] : t[i][j];
}

#ifdef RX_X86
__attribute__((target("avx2,fma")))
static void ukernel_avx2(size_t kc, const float *Ap, const float *Bp,
                         float *C, size_t ldc, int acc) {
    __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps();
    __m256 c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
    __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps();
    __m256 c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
    __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps();
    __m256 c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
    for (size_t p = 0; p < kc; p++) {
        __m256 b0 = _mm256_load_ps(Bp), b1 = _mm256_load_ps(Bp + 8);
        __m256 a;
        a = _mm256_broadcast_ss(Ap + 0); c00 = _mm256_fmadd_ps(a, b0, c00); c01 = _mm256_fmadd_ps(a, b1, c01);
        a = _mm256_broadcast_ss(Ap + 1); c10 = _mm256_fmadd_ps(a, b0, c10); c11 = _mm256_fmadd_ps(a, b1, c11);
        a = _mm256_broadcast_ss(Ap + 2); c20 = _mm256_fmadd_ps(a, b0, c20); c21 = _mm256_fmadd_ps(a, b1, c21);
        a = _mm256_broadcast_ss(Ap + 3); c30 = _mm256_fmadd_ps(a, b0, c30); c31 = _mm256_fmadd_ps(a, b1, c31);
        a = _mm256_broadcast_ss(Ap + 4); c40 = _mm256_fmadd_ps(a, b0, c40); c41 = _mm256_fmadd_ps(a, b1, c41);
        a = _mm256_broadcast_ss(Ap + 5); c50 = _mm256_fmadd_ps(a, b0, c50); c51 = _mm256_fmadd_ps(a, b1, c51);
        Ap += MR;
        Bp += NR;
    }
    __m256 r[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
    for (int i = 0; i < MR; i++) {
        float *c = C + i * ldc;
        if (acc) {
            r[i][0] = _mm256_add_ps(r[i][0], _mm256_loadu_ps(c));
            r[i][1] = _mm256_add_ps(r[i][1], _mm256_loadu_ps(c + 8));
        }
        _mm256_storeu_ps(c, r[i][0]);
        _mm256_storeu_ps(c + 8, r[i][1]);
    }
}
#endif

static ukernel_fn pick_ukernel(void) {
#ifdef RX_X86
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ukernel_avx2;
#endif
    return ukernel_generic;
}

const char *rx_sgemm_kernel(void) {
    return pick_ukernel() == ukernel_generic ? "generic" : "avx2-fma";
}

/* op(A) rows [i0,i0+mc) x cols [p0,p0+kc) into MR-row slivers, k-major,
 * zero-padded to a whole sliver. */
static void pack_a(int ta, const float *A, size_t lda, size_t i0, size_t mc,
                   size_t p0, size_t kc, float *Ap) {
    for (size_t s = 0; s < mc; s += MR) {
        size_t mr = mc - s < MR ? mc - s : MR;
        for (size_t p = 0; p < kc; p++) {
            for (size_t i = 0; i < mr; i++) {
                size_t row = i0 + s + i, col = p0 + p;
                Ap[p * MR + i] = ta ? A[col * lda + row] : A[row * lda + col];
            }
            for (size_t i = mr; i < MR; i++) Ap[p * MR + i] = 0.0f;
        }
        Ap += MR * kc;
    }
}

/* op(B) rows [p0,p0+kc) x cols [j0,j0+nc) into NR-column slivers. */
static void pack_b(int tb, const float *B, size_t ldb, size_t p0, size_t kc,
                   size_t j0, size_t nc, float *Bp) {
    for (size_t s = 0; s < nc; s += NR) {
        size_t nr = nc - s < NR ? nc - s : NR;
        for (size_t p = 0; p < kc; p++) {
            size_t row = p0 + p;
            float *dst = Bp + p * NR;
            if (!tb && nr == NR) {
                memcpy(dst, B + row * ldb + j0 + s, NR * sizeof(float));
                continue;
            }
            for (size_t j = 0; j < nr; j++) {
                size_t col = j0 + s + j;
                dst[j] = tb ? B[col * ldb + row] : B[row * ldb + col];
            }
            for (size_t j = nr; j < NR; j++) dst[j] = 0.0f;
        }
        Bp += NR * kc;
    }
}

/* Packing buffers live for the thread's lifetime: a training step calls the
 * GEMM hundreds of times and must not allocate in it. */
static _Thread_local float *tl_apack, *tl_bpack;

/* The tile C[0:M,0:N] of a serial GEMM (A, B, C already offset to it). */
static void sgemm_tile(ukernel_fn kern, int ta, int tb, size_t M, size_t N, size_t K,
                       const float *A, size_t lda, const float *B, size_t ldb,
                       float beta, float *C, size_t ldc) {
    if (!tl_apack) tl_apack = rx_falloc((size_t)MC * KC);
    if (!tl_bpack) tl_bpack = rx_falloc((size_t)KC * NC);
    float *Ap = tl_apack, *Bp = tl_bpack;
    if (!Ap || !Bp) {
        /* Out of memory for 1.6 MB of packing: still give the right answer. */
        for (size_t i = 0; i < M; i++)
            for (size_t j = 0; j < N; j++) {
                double s = beta != 0.0f ? C[i * ldc + j] : 0.0;
                for (size_t p = 0; p < K; p++)
                    s += (double)(ta ? A[p * lda + i] : A[i * lda + p]) *
                         (tb ? B[j * ldb + p] : B[p * ldb + j]);
                C[i * ldc + j] = (float)s;
            }
        return;
    }
    float edge[MR * NR];
    for (size_t jc = 0; jc < N; jc += NC) {
        size_t nc = N - jc < NC ? N - jc : NC;
        for (size_t pc = 0; pc < K; pc += KC) {
            size_t kc = K - pc < KC ? K - pc : KC;
            int acc = pc > 0 || beta != 0.0f;
            pack_b(tb, B, ldb, pc, kc, jc, nc, Bp);
            for (size_t ic = 0; ic < M; ic += MC) {
                size_t mc = M - ic < MC ? M - ic : MC;
                pack_a(ta, A, lda, ic, mc, pc, kc, Ap);
                for (size_t jr = 0; jr < nc; jr += NR) {
                    size_t nr = nc - jr < NR ? nc - jr : NR;
                    const float *bp = Bp + jr * kc;
                    for (size_t ir = 0; ir < mc; ir += MR) {
                        size_t mr = mc - ir < MR ? mc - ir : MR;
                        const float *ap = Ap + ir * kc;
                        float *c = C + (ic + ir) * ldc + jc + jr;
                        if (mr == MR && nr == NR) {
                            kern(kc, ap, bp, c, ldc, acc);
                        } else {
                            kern(kc, ap, bp, edge, NR, 0);
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
}

void rx_sgemm(int ta, int tb, size_t M, size_t N, size_t K,
              const float *A, size_t lda, const float *B, size_t ldb,
              float beta, float *C, size_t ldc) {
    ukernel_fn kern = pick_ukernel();
    if (M == 0 || N == 0) return;
    if (K == 0) {
        if (beta == 0.0f)
            for (size_t i = 0; i < M; i++) memset(C + i * ldc, 0, N * sizeof(float));
        return;
    }
    int nt = rx_in_parallel() ? 1 : rx_max_threads();
    if ((double)M * N * K < 65536.0) nt = 1;
    if (nt <= 1) {
        sgemm_tile(kern, ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    /* Grid pm x pn = nt minimising the padded tile a thread computes. */
    size_t mb = (M + MR - 1) / MR, nb = (N + NR - 1) / NR;
    int pm = 1;
    double best = -1.0;
    for (int d = 1; d <= nt; d++) {
        if (nt % d) continue;
        size_t tm = (mb + d - 1) / d, tn = (nb + (nt / d) - 1) / (nt / d);
        double cost = (double)tm * MR * tn * NR + 0.5 * (double)(tm * MR + tn * NR) * K / 16.0;
        if (best < 0 || cost < best) { best = cost; pm = d; }
    }
    int pn = nt / pm;
#pragma omp parallel num_threads(nt)
    {
        int id = rx_thread_id(), im = id / pn, in = id % pn;
        size_t i0 = mb * im / pm * MR, i1 = mb * (im + 1) / pm * MR;
        size_t j0 = nb * in / pn * NR, j1 = nb * (in + 1) / pn * NR;
        if (i1 > M) i1 = M;
        if (j1 > N) j1 = N;
        if (i0 < i1 && j0 < j1) {
            const float *a = ta ? A + i0 : A + i0 * lda;
            const float *b = tb ? B + j0 * ldb : B + j0;
            sgemm_tile(kern, ta, tb, i1 - i0, j1 - j0, K, a, lda, b, ldb, beta,
                       C + i0 * ldc + j0, ldc);
        }
    }
}
