/* Sanitizer test of csrc/optim.c: AdamW and the grad norm against plain
 * double loops, plus the invalid-argument paths. Returns nonzero on failure. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "rx_pretrain.h"

static unsigned long long rng = 88172645463325252ULL;
static float frand(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 11) * (1.0 / 9007199254740992.0)) - 0.5f;
}

int main(void) {
    const size_t n = 100003;
    const int64_t ranges[4] = {0, 1000, 50000, 100003};
    float *p = malloc(n * sizeof *p), *g = malloc(n * sizeof *g);
    float *m = calloc(n, sizeof *m), *v = calloc(n, sizeof *v);
    double *rp = malloc(n * sizeof *rp), *rm = calloc(n, sizeof *rm), *rv = calloc(n, sizeof *rv);
    int fail = 0;
    for (size_t i = 0; i < n; i++) rp[i] = p[i] = frand();
    for (int step = 1; step <= 3; step++) {
        double ss = 0.0;
        for (size_t i = 0; i < n; i++) {
            g[i] = frand() * 0.1f;
            ss += (double)g[i] * g[i];
        }
        double norm = NAN;
        if (rx_grad_norm_l2(g, n, &norm) != RX_OK || !(fabs(norm - sqrt(ss)) <= 1e-12 * sqrt(ss)))
            fail |= 1;
        const double lr = 1e-2, b1 = 0.9, b2 = 0.99, eps = 1e-8, wd = 0.1, gs = 0.5;
        if (rx_adamw_step(p, g, m, v, n, ranges, 2, (float)lr, (float)b1, (float)b2,
                          (float)eps, (float)wd, (float)gs, step) != RX_OK)
            fail |= 2;
        double maxerr = 0.0, maxref = 0.0;
        for (size_t i = 0; i < n; i++) {
            int dec = i < 1000 || i >= 50000;
            double gi = gs * g[i];
            rm[i] = b1 * rm[i] + (1 - b1) * gi;
            rv[i] = b2 * rv[i] + (1 - b2) * gi * gi;
            double mh = rm[i] / (1 - pow(b1, step)), vh = rv[i] / (1 - pow(b2, step));
            rp[i] = rp[i] * (dec ? 1 - lr * wd : 1.0) - lr * mh / (sqrt(vh) + eps);
            double e = fabs(rp[i] - p[i]);
            if (e > maxerr) maxerr = e;
            if (fabs(rp[i]) > maxref) maxref = fabs(rp[i]);
            rp[i] = p[i]; /* follow the fp32 trajectory so errors do not compound */
            rm[i] = m[i];
            rv[i] = v[i];
        }
        if (maxerr > 1e-5 * maxref) fail |= 4;
    }
    const int64_t bad[4] = {10, 5, 0, 0};
    if (rx_adamw_step(NULL, g, m, v, n, NULL, 0, 1e-3f, 0.9f, 0.99f, 1e-8f, 0.f, 1.f, 1) != RX_EINVAL)
        fail |= 8;
    if (rx_adamw_step(p, g, m, v, n, bad, 1, 1e-3f, 0.9f, 0.99f, 1e-8f, 0.f, 1.f, 1) != RX_EINVAL)
        fail |= 16;
    if (rx_adamw_step(p, g, m, v, 0, NULL, 0, 1e-3f, 0.9f, 0.99f, 1e-8f, 0.f, 1.f, 1) != RX_EINVAL)
        fail |= 32;
    if (rx_adamw_step(p, g, m, v, n, NULL, 0, 1e-3f, 0.9f, 0.99f, 1e-8f, 0.f, 1.f, 0) != RX_EINVAL)
        fail |= 64;
    double norm;
    if (rx_grad_norm_l2(NULL, 3, &norm) != RX_EINVAL || rx_grad_norm_l2(g, 0, &norm) != RX_EINVAL ||
        rx_grad_norm_l2(g, n, NULL) != RX_EINVAL)
        fail |= 128;
    free(p); free(g); free(m); free(v); free(rp); free(rm); free(rv);
    if (fail) fprintf(stderr, "test_optim: failure mask %d\n", fail);
    return fail;
}
