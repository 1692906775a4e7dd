/* rx_sgemm against a plain double-precision triple loop on random inputs:
 * every transpose combination, beta 0 and 1, sizes crossing every block
 * edge of csrc/gemm.c, leading dimensions past the row length, each
 * available micro-kernel. Returns nonzero on
 * failure. Built with csrc/*.c under -fsanitize=address,undefined. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "rx_internal.h"

static uint64_t rng_state = 12345;
static float frand(void) {
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((rng_state >> 40) * (1.0 / 16777216.0)) - 0.5f;
}

/* pad: extra floats at the end of every row of A, B and C (lda > columns) */
static int check(int ta, int tb, size_t M, size_t N, size_t K, float beta, size_t pad) {
    size_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
    size_t na = (ta ? K : M) * lda - pad, nb = (tb ? N : K) * ldb - pad, nc = M * ldc - pad;
    /* exact-size buffers so the sanitizer catches any read or write past them */
    float *A = malloc(na * sizeof(float)), *B = malloc(nb * sizeof(float));
    float *C = malloc(nc * sizeof(float));
    double *R = malloc(nc * sizeof(double));
    int bad = 0;
    for (size_t i = 0; i < na; i++) A[i] = frand();
    for (size_t i = 0; i < nb; i++) B[i] = frand();
    for (size_t i = 0; i < nc; i++) C[i] = R[i] = frand();
    double amax = 0.0;
    for (size_t i = 0; i < M; i++)
        for (size_t j = 0; j < N; j++) {
            double s = beta != 0.0f ? R[i * ldc + j] : 0.0;
            for (size_t p = 0; p < K; p++)
                s += (double)(ta ? A[p * lda + i] : A[i * lda + p]) *
                     (double)(tb ? B[j * ldb + p] : B[p * ldb + j]);
            R[i * ldc + j] = s;
            if (fabs(s) > amax) amax = fabs(s);
        }
    rx_sgemm(ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc);
    double tol = 1e-5 * (amax > 1.0 ? amax : 1.0);
    /* the padding of C must come back untouched: it holds R's values too */
    for (size_t i = 0; i < nc && !bad; i++)
        if (!(fabs(C[i] - R[i]) <= tol)) {
            fprintf(stderr, "gemm %s ta=%d tb=%d M=%zu N=%zu K=%zu beta=%g pad=%zu: "
                    "C[%zu]=%g want %g\n", rx_sgemm_kernel(), ta, tb, M, N, K, beta, pad, i,
                    C[i], R[i]);
            bad = 1;
        }
    free(A);
    free(B);
    free(C);
    free(R);
    return bad;
}

int main(void) {
    static const size_t shapes[][3] = {{1, 1, 1},    {7, 13, 5},    {6, 16, 1},   {5, 17, 3},
                                       {13, 129, 9}, {13, 128, 9},  {150, 33, 257},
                                       {145, 200, 300}, {3, 4100, 2}, {64, 64, 64},
                                       /* model shapes: M % 6 == 2, K one past a kc
                                        * block and k % 4 == 2 and 3 (the unrolled
                                        * micro-kernel's remainders) */
                                       {512, 16, 258}, {20, 260, 515}, {38, 48, 259}};
    static const char *kernels[] = {"generic", "avx2-fma"};
    int fails = 0;
    for (size_t kk = 0; kk < 2; kk++) {
        if (rx_sgemm_use_kernel(kernels[kk]) != RX_OK) continue;  /* CPU lacks it */
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (int t = 0; t < 8; t++)
                /* padded rows on every other combination: each shape, each
                 * transpose of it, sees both */
                fails += check(t & 1, (t >> 1) & 1, shapes[s][0], shapes[s][1], shapes[s][2],
                               (t >> 2) ? 1.0f : 0.0f, ((s + t + (t >> 2)) & 1) * 3);
    }
    if (rx_sgemm_use_kernel("no-such-kernel") != RX_EINVAL) fails++;
    rx_sgemm_use_kernel(NULL);
    if (fails) fprintf(stderr, "test_gemm: %d failures\n", fails);
    return fails != 0;
}
