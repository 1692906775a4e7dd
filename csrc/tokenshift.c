/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * tokenshift.c -- the token-shift lerp shared by time-mix and channel-mix:
 *     out = x + (x_prev - x) * mix,   x_prev(t) = x[t-1], at t = 0 the carry
 */
#include "rx_internal.h"

/* Columns a thread owns in the backward: whole 64-float lines, so threads
 * never write the same cache line of dx. */
#define SHIFT_COLS 64

/* mix: [C]; x, out: [B][T][C]; init: [B][C] or NULL */
void rx_shift_lerp_forward(const float *mix, const float *x, const float *init, float *out,
                           size_t B, size_t T, size_t C) {
#pragma omp parallel for schedule(static) if (!rx_in_parallel() && B * T * C >= 65536)
    for (size_t bt = 0; bt < B * T; bt++) {
        size_t b = bt / T, t = bt % T;
        const float *xr = x + bt * C, *xp = rx_shift_src(x, init, b, t, T, C);
        float *o = out + bt * C;
        for (size_t c = 0; c < C; c++) o[c] = xr[c] + ((xp ? xp[c] : 0.0f) - xr[c]) * mix[c];
    }
}

/* mix, dmix: [C]; x, dout, dx: [B][T][C]; init, d_init: [B][C] or NULL.
 * out = x (1 - mix) + x_prev mix, so x[t] receives dout[t] (1 - mix) and
 * dout[t+1] mix. Columns are split across threads and each column is summed
 * in token order, so dmix does not depend on the thread count. */
void rx_shift_lerp_backward(const float *mix, const float *x, const float *init,
                            const float *dout, float *dx, float *dmix, float *d_init,
                            size_t B, size_t T, size_t C) {
    const size_t nblk = (C + SHIFT_COLS - 1) / SHIFT_COLS;
#pragma omp parallel for schedule(static) if (!rx_in_parallel() && B * T * C >= 65536)
    for (size_t blk = 0; blk < nblk; blk++) {
        size_t c0 = blk * SHIFT_COLS, c1 = c0 + SHIFT_COLS < C ? c0 + SHIFT_COLS : C;
        for (size_t b = 0; b < B; b++)
            for (size_t t = 0; t < T; t++) {
                size_t bt = b * T + t;
                const float *xr = x + bt * C, *xp = rx_shift_src(x, init, b, t, T, C);
                const float *g = dout + bt * C, *gn = t + 1 < T ? g + C : NULL;
                float *o = dx + bt * C;
                for (size_t c = c0; c < c1; c++) {
                    dmix[c] += g[c] * ((xp ? xp[c] : 0.0f) - xr[c]);
                    o[c] += g[c] * (1.0f - mix[c]) + (gn ? gn[c] * mix[c] : 0.0f);
                }
                if (t == 0 && d_init)
                    for (size_t c = c0; c < c1; c++) d_init[b * C + c] += g[c] * mix[c];
            }
    }
}
