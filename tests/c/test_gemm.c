/* rx_sgemm against a plain double-precision triple loop on random inputs:
 * every transpose combination, beta 0 and 1, sizes crossing every block
 * edge of csrc/gemm.c, leading dimensions past the row length, each
 * available micro-kernel; and rx_sgemm_batch on mixed batches at several
 * thread counts (more threads than cores, so units get stolen). Returns
 * nonzero on failure. Built with csrc/*.c under -fsanitize=address,undefined. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rx_internal.h"

static uint64_t rng_state = 12345;
static float frand(void) {
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((rng_state >> 40) * (1.0 / 16777216.0)) - 0.5f;
}

/* One GEMM under test: exact-size operands (so the sanitizer catches any
 * read or write past them), C prefilled, and the double reference. */
typedef struct {
    rx_gemm_op op;
    size_t nc, pad;
    double *R, amax;
} gcase;

/* pad: extra floats at the end of every row of A, B and C (lda > columns) */
static void make(gcase *g, int ta, int tb, size_t M, size_t N, size_t K, float beta, size_t pad) {
    if (!M || !N || !K) pad = 0; /* empty operands: nothing to pad */
    size_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
    size_t na = (ta ? K : M) * lda - pad, nb = (tb ? N : K) * ldb - pad, nc = M * ldc - pad;
    float *A = malloc(na * sizeof(float) + 1), *B = malloc(nb * sizeof(float) + 1);
    float *C = malloc(nc * sizeof(float) + 1);
    double *R = malloc(nc * sizeof(double) + 1);
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
    *g = (gcase){{ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc}, nc, pad, R, amax};
}

/* Compares and frees; nonzero on a mismatch. */
static int verify(gcase *g, const char *what) {
    const rx_gemm_op *o = &g->op;
    double tol = 1e-5 * (g->amax > 1.0 ? g->amax : 1.0);
    int bad = 0;
    /* the padding of C must come back untouched: it holds R's values too */
    for (size_t i = 0; i < g->nc && !bad; i++)
        if (!(fabs(o->C[i] - g->R[i]) <= tol)) {
            fprintf(stderr, "%s %s ta=%d tb=%d M=%zu N=%zu K=%zu beta=%g pad=%zu: "
                    "C[%zu]=%g want %g\n", what, rx_sgemm_kernel(), o->ta, o->tb, o->M, o->N,
                    o->K, o->beta, g->pad, i, o->C[i], g->R[i]);
            bad = 1;
        }
    free((void *)o->A);
    free((void *)o->B);
    free(o->C);
    free(g->R);
    return bad;
}

static int check(int ta, int tb, size_t M, size_t N, size_t K, float beta, size_t pad) {
    gcase g;
    make(&g, ta, tb, M, N, K, beta, pad);
    const rx_gemm_op *o = &g.op;
    rx_sgemm(ta, tb, M, N, K, o->A, o->lda, o->B, o->ldb, beta, o->C, o->ldc);
    return verify(&g, "gemm");
}

/* A batch of n ops cycling through shapes that take every unit path: one
 * op big enough to be split by columns, N past the 512-column unit block,
 * K past a packing panel, empty and K == 0 ops, tiny ops. n > 16 crosses
 * the batch chunking. */
static int check_batch(size_t n, int threads) {
    static const size_t shapes[][3] = {{300, 260, 515}, {3, 1100, 40},  {97, 515, 130},
                                       {1, 1, 1},       {512, 16, 258}, {0, 5, 5},
                                       {7, 9, 0},       {38, 48, 259},  {150, 33, 257}};
    const size_t ns = sizeof shapes / sizeof shapes[0];
    gcase g[24];
    rx_gemm_op ops[24];
    for (size_t k = 0; k < n; k++) {
        const size_t *sh = shapes[k % ns];
        make(&g[k], (int)(k & 1), (int)((k >> 1) & 1), sh[0], sh[1], sh[2],
             (k >> 2) & 1 ? 1.0f : 0.0f, (k % 3 == 0) * 3);
        ops[k] = g[k].op;
    }
    rx_set_num_threads(threads);
    rx_sgemm_batch(ops, n);
    rx_set_num_threads(0);
    int fails = 0;
    for (size_t k = 0; k < n; k++) fails += verify(&g[k], "batch");
    return fails;
}

/* A batch of small-M ops that stream B (gemm.c sgemm_rows: the team cuts
 * the ops' k blocks laid end to end, mid-block and mid-op) gives each op
 * the bits it has alone on the packed path, at every thread count, and
 * checks against the double reference; then the same with a transposed
 * op in the batch (the column-unit path). */
static int check_small_batch(int threads, int with_tb) {
    static const size_t shapes[][3] = {{1, 768, 768}, {1, 64, 768}, {1, 13, 257},
                                       {2, 100, 1000}, {1, 1, 300},  {3, 7, 2000},
                                       {1, 515, 40},   {8, 768, 300}};
    enum { NS = sizeof shapes / sizeof shapes[0] };
    gcase g[NS];
    rx_gemm_op ops[NS];
    float *alone[NS];
    for (size_t k = 0; k < NS; k++) {
        make(&g[k], 0, with_tb && k == 2, shapes[k][0], shapes[k][1], shapes[k][2],
             (k & 1) ? 1.0f : 0.0f, (k % 3 == 0) * 3);
        ops[k] = g[k].op;
        alone[k] = malloc(g[k].nc * sizeof(float));
        memcpy(alone[k], ops[k].C, g[k].nc * sizeof(float));
    }
    const size_t was = rx_sgemm_small_m(0);
    for (size_t k = 0; k < NS; k++) {
        rx_gemm_op one = ops[k];
        one.C = alone[k];
        rx_sgemm_batch(&one, 1);
    }
    rx_sgemm_small_m(was);
    rx_set_num_threads(threads);
    rx_sgemm_batch(ops, NS);
    rx_set_num_threads(0);
    int fails = 0;
    for (size_t k = 0; k < NS; k++) {
        if (memcmp(alone[k], ops[k].C, g[k].nc * sizeof(float))) {
            fprintf(stderr, "small batch, %d threads%s: op %zu (M=%zu N=%zu K=%zu) is not the "
                    "packed path's bits\n", threads, with_tb ? " (one op tb)" : "", k,
                    ops[k].M, ops[k].N, ops[k].K);
            fails++;
        }
        free(alone[k]);
        fails += verify(&g[k], "small batch");
    }
    return fails;
}

/* A batch whose outputs share memory with its inputs or with each other
 * is refused before anything is written (gemm.c, "independence"); outputs
 * and inputs that only interleave, or only touch, run. */
static int check_overlap(void) {
    enum { M = 5, N = 7, K = 6 };
    float buf[2 * M * (N + K)], B[K * N], R[M * N], keep[2 * M * (N + K)];
    for (size_t i = 0; i < sizeof buf / sizeof buf[0]; i++) buf[i] = frand();
    for (size_t i = 0; i < K * N; i++) B[i] = frand();
    memcpy(keep, buf, sizeof buf);
    int fails = 0;
    struct {
        const char *what, *msg;
        rx_gemm_op ops[2];
        size_t n;
    } refused[] = {
        {"C is A", "output C of GEMM 0 of 1 overlaps the input A of GEMM 0",
         {{0, 0, M, K, K, buf, K, B, N, 0.0f, buf, K}}, 1},
        {"C's last float is B's first", "overlaps the input B of GEMM 0",
         {{0, 0, M, N, K, buf + 100, K, buf + M * N - 1, N, 0.0f, buf, N}}, 1},
        {"C meets a transposed A", "overlaps the input A of GEMM 0",
         {{1, 0, M, N, K, buf + M * N - (K - 1) * M - 1, M, B, N, 0.0f, buf, N}}, 1},
        {"two outputs share a float", "output C of GEMM 1 of 2 overlaps the output C of GEMM 0",
         {{0, 0, M, N, K, buf + 100, K, B, N, 0.0f, buf, N},
          {0, 0, 1, 1, K, buf + 100, K, B, N, 0.0f, buf + (M - 1) * N + N - 1, N}}, 2},
        {"an op reads another's output", "output C of GEMM 0 of 2 overlaps the input A of GEMM 1",
         {{0, 0, M, N, K, buf + 100, K, B, N, 0.0f, buf, N},
          {0, 0, M, N, K, buf + 3, K, B, N, 0.0f, R, N}}, 2},
    };
    for (size_t q = 0; q < sizeof refused / sizeof refused[0]; q++) {
        int rc = rx_sgemm_batch(refused[q].ops, refused[q].n);
        if (rc != RX_EINVAL || !strstr(rx_last_error(), refused[q].msg) ||
            memcmp(buf, keep, sizeof buf)) {
            fprintf(stderr, "overlap %s: rc %d, \"%s\"\n", refused[q].what, rc, rx_last_error());
            fails++;
        }
    }
    /* C in columns [0, N) and A in columns [N, N+K) of the same rows, and a
     * second 1x1 C on the float right after that A's last one */
    const size_t ld = N + K;
    for (size_t i = 0; i < M; i++)
        for (size_t j = 0; j < N; j++) {
            double acc = 0.0;
            for (size_t p = 0; p < K; p++) acc += (double)buf[i * ld + N + p] * B[p * N + j];
            R[i * N + j] = (float)acc;
        }
    const rx_gemm_op ok[2] = {{0, 0, M, N, K, buf + N, ld, B, N, 0.0f, buf, ld},
                              {0, 0, 1, 1, 1, B, 1, B, 1, 0.0f, buf + M * ld, 1}};
    if (rx_sgemm_batch(ok, 2) != RX_OK || buf[M * ld] != B[0] * B[0]) {
        fprintf(stderr, "interleaved and adjacent: refused or wrong: %s\n", rx_last_error());
        fails++;
    }
    for (size_t i = 0; i < M; i++)
        for (size_t j = 0; j < N; j++)
            if (fabsf(buf[i * ld + j] - R[i * N + j]) > 1e-5f * (1.0f + fabsf(R[i * N + j]))) {
                fprintf(stderr, "interleaved: C[%zu][%zu] = %g, want %g\n", i, j,
                        buf[i * ld + j], R[i * N + j]);
                fails++;
            }
    return fails;
}

int main(void) {
    static const size_t shapes[][3] = {{1, 1, 1},    {7, 13, 5},    {6, 16, 1},   {5, 17, 3},
                                       {13, 129, 9}, {13, 128, 9},  {150, 33, 257},
                                       {145, 200, 300}, {3, 4100, 2}, {64, 64, 64},
                                       /* model shapes: M % 6 == 2, K one past a kc
                                        * block and k % 4 == 2 and 3 (the unrolled
                                        * micro-kernel's remainders) */
                                       {512, 16, 258}, {20, 260, 515}, {38, 48, 259},
                                       /* crossing the AVX-512 kernel's 8-row tile */
                                       {8, 16, 8}, {17, 31, 17}, {36, 129, 40},
                                       /* crossing the 16-row tile, MC and NC = 1024 */
                                       {16, 16, 16}, {33, 47, 19}, {161, 1030, 40},
                                       /* crossing Zen 5's NC = 512 */
                                       {24, 530, 300}};
    static const char *kernels[] = {"generic", "avx2-fma", "avx512f", "avx512f-12x32",
                                    "avx512f-8x32"};
    int fails = 0;
    for (size_t kk = 0; kk < sizeof kernels / sizeof kernels[0]; kk++) {
        if (rx_sgemm_use_kernel(kernels[kk]) != RX_OK) continue;  /* CPU lacks it */
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (int t = 0; t < 8; t++)
                /* padded rows on every other combination: each shape, each
                 * transpose of it, sees both */
                fails += check(t & 1, (t >> 1) & 1, shapes[s][0], shapes[s][1], shapes[s][2],
                               (t >> 2) ? 1.0f : 0.0f, ((s + t + (t >> 2)) & 1) * 3);
    }
    static const int threads[] = {1, 2, 3, 5};
    for (size_t t = 0; t < 4; t++) {
        fails += check_batch(9, threads[t]);
        fails += check_batch(19, threads[t]);
        fails += check_small_batch(threads[t], 0) + check_small_batch(threads[t], 1);
    }
    fails += check_overlap();
    if (rx_sgemm_use_kernel("no-such-kernel") != RX_EINVAL) fails++;
    rx_sgemm_use_kernel(NULL);
    if (fails) fprintf(stderr, "test_gemm: %d failures\n", fails);
    return fails != 0;
}
