/* rx_bgemm (csrc/gemm_bf16.c) against a double-precision triple loop over
 * operands rounded to bf16 here (nearest even, by integer arithmetic of
 * its own): every transpose combination, beta 0 and 1, sizes crossing the
 * 16 / 32 / 64 / 128 block edges, leading dimensions past the row length,
 * each bf16 kernel this CPU runs; and rx_bgemm_batch on a mixed batch at
 * several thread counts, bitwise the same at each; K = 0. Built with the
 * csrc sources under -fsanitize=address,undefined; returns nonzero on
 * failure. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rx_internal.h"

static uint64_t rng_state = 777;
static float frand(void) {
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((rng_state >> 40) * (1.0 / 16777216.0)) - 0.5f;
}

/* finite x to the nearest bf16 (ties to even), subnormal inputs to signed 0
 * (as vcvtne2ps2bf16) */
static double to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint32_t low = u & 0xffffu, r = u >> 16;
    if (low > 0x8000u || (low == 0x8000u && (r & 1u))) r++;
    if (!(u & 0x7f800000u)) r = (u >> 16) & 0x8000u;
    u = r << 16;
    memcpy(&x, &u, sizeof x);
    return x;
}

static int failures;

/* One case: C (+)= op(A).op(B) checked element-wise against the double
 * product of the rounded operands, within (K + 2) 2^-24 (P + |C_old|) +
 * K 2^-125, P the sum of |a_k b_k| (gemm_bf16.c's bound for one kernel). */
static void check(const char *kern, int ta, int tb, size_t M, size_t N, size_t K, float beta,
                  size_t pad) {
    size_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
    size_t na = (ta ? K : M) * lda, nb = (tb ? N : K) * ldb, nc = M * ldc;
    float *A = malloc(na * sizeof(float) + 4), *B = malloc(nb * sizeof(float) + 4);
    float *C = malloc(nc * sizeof(float) + 4), *C0 = malloc(nc * sizeof(float) + 4);
    for (size_t i = 0; i < na; i++) A[i] = frand() * 8.0f;
    for (size_t i = 0; i < nb; i++) B[i] = frand();
    for (size_t i = 0; i < nc; i++) C[i] = C0[i] = frand();
    rx_bgemm(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
    for (size_t i = 0; i < M; i++)
        for (size_t j = 0; j < N; j++) {
            double s = 0.0, P = 0.0;
            for (size_t p = 0; p < K; p++) {
                double t = to_bf16(ta ? A[p * lda + i] : A[i * lda + p]) *
                           to_bf16(tb ? B[j * ldb + p] : B[p * ldb + j]);
                s += t;
                P += fabs(t);
            }
            double old = beta != 0.0f ? C0[i * ldc + j] : 0.0;
            double err = fabs(C[i * ldc + j] - (s + old));
            double tol = (double)(K + 2) * 0x1p-24 * (P + fabs(old)) + (double)K * 0x1p-125;
            if (!(err <= tol) && failures < 10) {
                fprintf(stderr, "%s ta=%d tb=%d %zux%zux%zu beta=%g: C[%zu,%zu]=%.9g want %.9g\n",
                        kern, ta, tb, M, N, K, beta, i, j, C[i * ldc + j], s + old);
                failures++;
            }
        }
    for (size_t i = 0; i < M; i++) /* padding columns untouched */
        for (size_t j = N; j < ldc; j++)
            if (C[i * ldc + j] != C0[i * ldc + j] && failures < 10) {
                fprintf(stderr, "%s wrote padding at [%zu,%zu]\n", kern, i, j);
                failures++;
            }
    free(A), free(B), free(C), free(C0);
}

/* A mixed batch computed at 1, 2 and 3 threads: bitwise equal results. */
static void batch_threads(const char *kern) {
    enum { NOPS = 3 };
    const size_t dims[NOPS][3] = {{70, 33, 45}, {129, 16, 300}, {5, 200, 64}};
    float *A[NOPS], *B[NOPS], *C[3][NOPS];
    rx_gemm_op ops[NOPS];
    for (int r = 0; r < 3; r++) {
        for (int k = 0; k < NOPS; k++) {
            size_t M = dims[k][0], N = dims[k][1], K = dims[k][2];
            if (r == 0) {
                A[k] = malloc(M * K * sizeof(float));
                B[k] = malloc(N * K * sizeof(float));
                for (size_t i = 0; i < M * K; i++) A[k][i] = frand();
                for (size_t i = 0; i < N * K; i++) B[k][i] = frand();
            }
            C[r][k] = calloc(M * N, sizeof(float));
            ops[k] = (rx_gemm_op){k == 1, k == 2, M, N, K, A[k], k == 1 ? M : K, B[k],
                                  k == 2 ? K : N, 0.0f, C[r][k], N};
        }
        rx_set_num_threads(r + 1);
        rx_bgemm_batch(ops, NOPS);
    }
    rx_set_num_threads(0);
    for (int k = 0; k < NOPS; k++) {
        for (int r = 1; r < 3; r++)
            if (memcmp(C[0][k], C[r][k], dims[k][0] * dims[k][1] * sizeof(float))) {
                fprintf(stderr, "%s: op %d differs at %d threads\n", kern, k, r + 1);
                failures++;
            }
        for (int r = 0; r < 3; r++) free(C[r][k]);
        free(A[k]), free(B[k]);
    }
}

int main(void) {
    const char *kernels[] = {"generic-bf16", "avx512-bf16", "amx-bf16"};
    const size_t sizes[][3] = {{1, 1, 1}, {7, 13, 5}, {16, 16, 32}, {17, 33, 31}, {32, 32, 64},
                               {65, 129, 33}, {100, 40, 257}, {3, 300, 2}};
    int ran = 0;
    for (size_t q = 0; q < sizeof kernels / sizeof kernels[0]; q++) {
        if (rx_bgemm_use_kernel(kernels[q]) != RX_OK) {
            printf("%s: not on this CPU, skipped\n", kernels[q]);
            continue;
        }
        ran++;
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
            for (int t = 0; t < 4; t++)
                for (int b = 0; b < 2; b++)
                    check(kernels[q], t & 1, t >> 1, sizes[s][0], sizes[s][1], sizes[s][2],
                          (float)b, (s + t) % 3);
        batch_threads(kernels[q]);
        check(kernels[q], 0, 0, 9, 5, 0, 0.0f, 1); /* K = 0: C = 0, or unchanged */
        check(kernels[q], 1, 1, 9, 5, 0, 1.0f, 0);
        printf("%s: checked\n", kernels[q]);
    }
    rx_bgemm_use_kernel(NULL);
    if (rx_bgemm_use_kernel("no-such-kernel") != RX_EINVAL) {
        fprintf(stderr, "an unknown kernel name was accepted\n");
        failures++;
    }
    /* a batch whose second op reads the first one's output is refused
     * before either is written (gemm.c, "independence") */
    float buf[64], keep[64], W[16];
    for (int i = 0; i < 64; i++) buf[i] = keep[i] = (float)i;
    for (int i = 0; i < 16; i++) W[i] = 1.0f;
    const rx_gemm_op dep[2] = {{0, 0, 4, 4, 4, buf + 32, 4, W, 4, 0.0f, buf, 4},
                               {0, 0, 4, 4, 4, buf + 12, 4, W, 4, 0.0f, buf + 48, 4}};
    if (rx_bgemm_batch(dep, 2) != RX_EINVAL ||
        !strstr(rx_last_error(), "rx_bgemm: the output C of GEMM 0 of 2 overlaps the input A of "
                                 "GEMM 1") ||
        memcmp(buf, keep, sizeof buf)) {
        fprintf(stderr, "a dependent batch ran: \"%s\"\n", rx_last_error());
        failures++;
    }
    if (!ran) failures++;
    return failures ? 1 : 0;
}
