/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * tokenshift.c -- the token-shift lerp shared by time-mix and channel-mix:
 *     out = x + (x_prev - x) * mix,   x_prev(t) = x[t-1], at t = 0 the carry
 * Time-mix takes six lerps of the same x; they run as one pass over x (and,
 * backward, over the six grads), not six.
 */
#include "rx_internal.h"


/* One token row, C columns: out = x + (xp - x) * mix; xp NULL: zero. */
RX_HOT static void lerp_row(const float *restrict x, const float *restrict xp,
                            const float *restrict mix, float *restrict out, size_t C) {
    if (xp)
        for (size_t c = 0; c < C; c++) out[c] = x[c] + (xp[c] - x[c]) * mix[c];
    else
        for (size_t c = 0; c < C; c++) out[c] = x[c] - x[c] * mix[c];
}

/* mix[n]: [C] each; x: [B][T][C]; out[n]: [B][T][C] each; init: [B][C] or NULL */
void rx_shift_lerp_forward(int n, const float *const *mix, const float *x, const float *init,
                           float *const *out, size_t B, size_t T, size_t C) {
#pragma omp parallel for schedule(static) if (!rx_in_parallel() && B * T * C * n >= 65536)
    for (size_t bt = 0; bt < B * T; bt++) {
        const float *xr = x + bt * C, *xp = rx_shift_src(x, init, bt / T, bt % T, T, C);
        for (int i = 0; i < n; i++) lerp_row(xr, xp, mix[i], out[i] + bt * C, C);
    }
}

/* One lerp's grads over a column block of one token: g the grad on its
 * output there, which reaches x at this token (dx) and at the one before
 * (dxp: the previous dx row, the carry's grad, or NULL: not wanted); xp
 * NULL: a zero carry. */
static inline void lerp_back_cols(const float *restrict x, const float *restrict xp,
                                  const float *restrict g, const float *restrict mix,
                                  float *restrict dx, float *restrict dxp,
                                  float *restrict dmix, size_t nc) {
    for (size_t c = 0; c < nc; c++) dx[c] += g[c] * (1.0f - mix[c]);
    if (dxp)
        for (size_t c = 0; c < nc; c++) dxp[c] += g[c] * mix[c];
    if (xp)
        for (size_t c = 0; c < nc; c++) dmix[c] += g[c] * (xp[c] - x[c]);
    else
        for (size_t c = 0; c < nc; c++) dmix[c] -= g[c] * x[c];
}

/* Columns [c0, c1) of rx_shift_lerp_backward, all tokens in order. Each
 * token reads only its own row of every grad: with six grads, reading the
 * next row too would hold twelve lines of one cache set. The pass over x
 * is split in three loops so that each stays one vector loop. */
RX_HOT static void lerp_back_block(int n, const float *const *mix, const float *x,
                                   const float *init, const float *const *dout, float *dx,
                                   float *const *dmix, float *d_init, size_t B, size_t T,
                                   size_t C, size_t c0, size_t c1) {
    const size_t nc = c1 - c0;
    for (int i = 0; i < n; i++)
        for (size_t c = c0; c < c1; c++) dmix[i][c] = 0.0f;
    for (size_t b = 0; b < B; b++)
        for (size_t t = 0; t < T; t++) {
            const size_t o = (b * T + t) * C + c0;
            const float *xp = rx_shift_src(x, init, b, t, T, C);
            float *o_dx = dx + o, *o_dxp = t > 0 ? o_dx - C : d_init ? d_init + b * C + c0 : NULL;
            xp = xp ? xp + c0 : NULL;
            for (size_t c = 0; c < nc; c++) o_dx[c] = 0.0f;
            if (t == 0 && o_dxp)
                for (size_t c = 0; c < nc; c++) o_dxp[c] = 0.0f;
            for (int i = 0; i < n; i++)
                lerp_back_cols(x + o, xp, dout[i] + o, mix[i] + c0, o_dx, o_dxp, dmix[i] + c0, nc);
        }
}

/* mix[n], dmix[n]: [C] each; x, dx: [B][T][C]; dout[n]: [B][T][C] each, the
 * grads on the n lerps' outputs; init, d_init: [B][C] or NULL. Writes dx,
 * dmix and d_init (not wanted: NULL). out = x (1 - mix) + x_prev mix, so
 * x[t] receives dout[t] (1 - mix) and dout[t+1] mix. Columns are split
 * across threads and each column is summed in token order, so dmix does not
 * depend on the thread count. */
void rx_shift_lerp_backward(int n, const float *const *mix, const float *x, const float *init,
                            const float *const *dout, float *dx, float *const *dmix,
                            float *d_init, size_t B, size_t T, size_t C) {
    /* one block of columns per thread, in whole 64-byte lines (threads never
     * write the same line of dx): wide blocks let the prefetcher stream rows */
    const int par = !rx_in_parallel() && B * T * C * n >= 65536;
    const size_t nth = par ? (size_t)rx_max_threads() : 1;
    const size_t width = ((C + nth - 1) / nth + 15) & ~(size_t)15;
    const size_t nblk = (C + width - 1) / width;
#pragma omp parallel for schedule(static) if (par)
    for (size_t blk = 0; blk < nblk; blk++) {
        size_t c0 = blk * width, c1 = c0 + width < C ? c0 + width : C;
        lerp_back_block(n, mix, x, init, dout, dx, dmix, d_init, B, T, C, c0, c1);
    }
}
