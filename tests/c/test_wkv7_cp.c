/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * test_wkv7_cp.c -- the model's WKV7 path (rx_wkv7_forward_cp keeping the
 * state checkpoints, rx_wkv7_backward_cp starting from them, scratch from
 * the caller) against the standalone entry points, which recompute the
 * checkpoints and allocate their scratch. Both run the same arithmetic, so
 * every output must match bit for bit; the standalone ones are checked
 * against double loops in test_kernels.c and tests/test_wkv7.py. Built with
 * -fsanitize=address,undefined: cp and work are exactly their documented
 * sizes (work: rx_wkv7_work_floats, its backward part a thread's chunk for
 * each of rx_wkv7_slots threads), so an overrun is a sanitizer error.
 *
 * Exit status: 0 when every check passes.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rx_internal.h"

static int failures;
static uint64_t rng_state = 0x2545F4914F6CDD1Dull;

static float urand(void) { /* xorshift64 -> [0, 1) */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)(rng_state >> 40) * 0x1.0p-24f;
}

static float *frand(size_t n, float lo, float hi) {
    float *p = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = lo + (hi - lo) * urand();
    return p;
}

static void same(const char *what, const float *got, const float *want, size_t n, int B, int T,
                 int H, int N) {
    if (memcmp(got, want, n * sizeof(float)) != 0) {
        printf("FAIL %s differs (B=%d T=%d H=%d N=%d)\n", what, B, T, H, N);
        failures++;
    }
}

static void test_cp(int B, int T, int H, int N, int with_state) {
    const size_t n = (size_t)B * T * H * N, ns = (size_t)B * H * N * N, BH = (size_t)B * H;
    float *r = frand(n, -1, 1), *w = frand(n, 0.55f, 1), *k = frand(n, -1, 1);
    float *v = frand(n, -1, 1), *a = frand(n, -0.3f, 0), *b = frand(n, 0, 0.3f);
    float *dy = frand(n, -1, 1), *s0 = with_state ? frand(ns, -0.5f, 0.5f) : NULL;
    float *cp = malloc(RX_WKV7_CP(BH, (size_t)T, (size_t)N) * sizeof(float));
    float *work = malloc(rx_wkv7_work_floats(BH, (size_t)N) * sizeof(float));
    float *y0 = malloc(n * sizeof(float)), *y1 = malloc(n * sizeof(float));
    float *sf0 = malloc(ns * sizeof(float)), *sf1 = malloc(ns * sizeof(float));
    float *g0 = malloc(6 * n * sizeof(float)), *g1 = malloc(6 * n * sizeof(float));
    float *dS0 = malloc(ns * sizeof(float)), *dS1 = malloc(ns * sizeof(float));
    static const char *names[6] = {"dr", "dw", "dk", "dv", "da", "db"};
    char what[64];

    if (rx_wkv7_forward_seq(r, w, k, v, a, b, s0, y0, sf0, B, T, H, N) != RX_OK ||
        rx_wkv7_backward(r, w, k, v, a, b, dy, s0, g0, g0 + n, g0 + 2 * n, g0 + 3 * n,
                         g0 + 4 * n, g0 + 5 * n, dS0, B, T, H, N) != RX_OK) {
        printf("FAIL standalone rc (B=%d T=%d H=%d N=%d)\n", B, T, H, N);
        failures++;
    }
    if (rx_wkv7_forward_cp(r, w, k, v, a, b, s0, y1, sf1, cp, work, B, T, H, N) != RX_OK) {
        printf("FAIL forward_cp rc\n");
        failures++;
    }
    same("forward_cp y", y1, y0, n, B, T, H, N);
    same("forward_cp s_final", sf1, sf0, ns, B, T, H, N);
    /* given checkpoints, twice (it must leave them intact); then each of
     * cp and work allocated by the call instead */
    for (int pass = 0; pass < 4; pass++) {
        memset(g1, 0xff, 6 * n * sizeof(float));
        memset(dS1, 0xff, ns * sizeof(float));
        if (rx_wkv7_backward_cp(r, w, k, v, a, b, dy, s0, pass < 3 ? cp : NULL,
                                pass == 2 ? NULL : work, g1, g1 + n, g1 + 2 * n, g1 + 3 * n,
                                g1 + 4 * n, g1 + 5 * n, dS1, B, T, H, N) != RX_OK) {
            printf("FAIL backward_cp rc (pass %d)\n", pass);
            failures++;
        }
        for (int q = 0; q < 6; q++) {
            snprintf(what, sizeof what, "backward_cp %s (pass %d)", names[q], pass);
            same(what, g1 + q * n, g0 + q * n, n, B, T, H, N);
        }
        snprintf(what, sizeof what, "backward_cp dS_init (pass %d)", pass);
        same(what, dS1, dS0, ns, B, T, H, N);
    }
#ifdef _OPENMP
    /* more threads than the scratch was sized for (set after it was): the
     * backward runs in the threads it has room for, to the same bits */
    const int threads = omp_get_max_threads();
    omp_set_num_threads(2 * (int)rx_wkv7_slots(BH) + 1);
    memset(g1, 0xff, 6 * n * sizeof(float));
    if (rx_wkv7_backward_cp(r, w, k, v, a, b, dy, s0, cp, work, g1, g1 + n, g1 + 2 * n,
                            g1 + 3 * n, g1 + 4 * n, g1 + 5 * n, NULL, B, T, H, N) != RX_OK) {
        printf("FAIL backward_cp rc past its slots\n");
        failures++;
    }
    omp_set_num_threads(threads);
    same("backward_cp past its slots", g1, g0, 6 * n, B, T, H, N);
#endif
    /* the forward without y or s_final still keeps the checkpoints */
    memset(cp, 0, RX_WKV7_CP(BH, (size_t)T, (size_t)N) * sizeof(float));
    if (rx_wkv7_forward_cp(r, w, k, v, a, b, s0, NULL, NULL, cp, work, B, T, H, N) != RX_OK ||
        rx_wkv7_backward_cp(r, w, k, v, a, b, dy, s0, cp, work, g1, g1 + n, g1 + 2 * n,
                            g1 + 3 * n, g1 + 4 * n, g1 + 5 * n, NULL, B, T, H, N) != RX_OK) {
        printf("FAIL forward_cp without outputs rc\n");
        failures++;
    }
    same("backward_cp after a forward without outputs", g1, g0, 6 * n, B, T, H, N);
    if (rx_wkv7_backward_cp(r, w, k, v, a, b, NULL, s0, cp, work, g1, g1 + n, g1 + 2 * n,
                            g1 + 3 * n, g1 + 4 * n, g1 + 5 * n, NULL, B, T, H, N) != RX_EINVAL ||
        rx_wkv7_forward_cp(r, w, k, v, a, NULL, s0, y1, sf1, cp, work, B, T, H, N) != RX_EINVAL) {
        printf("FAIL NULL argument not rejected\n");
        failures++;
    }
    free(r); free(w); free(k); free(v); free(a); free(b); free(dy); free(s0); free(cp);
    free(work); free(y0); free(y1); free(sf0); free(sf1); free(g0); free(g1); free(dS0);
    free(dS1);
}

int main(void) {
    test_cp(1, 1, 1, 64, 0);   /* T = 1: no step before or after the only one */
    test_cp(1, 1, 2, 8, 1);
    test_cp(2, 16, 2, 8, 1);   /* exactly one chunk; B > 1 */
    test_cp(1, 37, 2, 64, 1);  /* T not a multiple of 16, nonzero initial state */
    test_cp(2, 33, 1, 16, 0);
    test_cp(2, 21, 3, 5, 1);   /* N % 8 != 0: the portable steps */
    test_cp(1, 18, 1, 1, 0);
    /* one head: from 2 threads the backward (T >= 64) and the forward
     * (T >= 1024) split it into row tiles, N = 24 with a ragged one */
    test_cp(1, 70, 1, 64, 1);
    test_cp(1, 1030, 1, 24, 1);
    if (failures) {
        printf("%d check(s) failed\n", failures);
        return 1;
    }
    printf("all wkv7 checkpoint checks passed\n");
    return 0;
}
