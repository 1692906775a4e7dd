/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * tokenshift.c -- the token-shift lerp shared by time-mix and channel-mix:
 *     out = x + (x_prev - x) * mix,   x_prev(t) = x[t-1], at t = 0 the carry
 * Time-mix takes six lerps of the same x; they run as one pass over x (and,
 * backward, over the six grads), not six.
 */
#include <string.h>

#include "rx_internal.h"

/* One token row, C columns: out = x + (xp - x) * mix; xp NULL: zero. */
RX_HOT static void lerp_row(const float *restrict x, const float *restrict xp,
                            const float *restrict mix, float *restrict out, size_t C) {
    if (xp)
        for (size_t c = 0; c < C; c++) out[c] = x[c] + (xp[c] - x[c]) * mix[c];
    else
        for (size_t c = 0; c < C; c++) out[c] = x[c] - x[c] * mix[c];
}

/* mix[n]: [C] each; x, out[n]: [rows][C] each, rows laid out as sq says;
 * init: [B][C] (a ragged step's: [slots][C]) or NULL */
void rx_shift_lerp_seqs(int n, const float *const *mix, const float *x, const float *init,
                        float *const *out, const rx_seqs *sq, size_t C) {
    const size_t rows = rx_seqs_rows(sq);
#pragma omp parallel for schedule(static) if (!rx_in_parallel() && rows * C * n >= RX_EW_MIN_PAR)
    for (size_t bt = 0; bt < rows; bt++) {
        const float *xr = x + bt * C, *xp = rx_seqs_prev(sq, x, init, bt, C);
        for (int i = 0; i < n; i++) lerp_row(xr, xp, mix[i], out[i] + bt * C, C);
    }
}

/* mix[n]: [C] each; x: [B][T][C]; out[n]: [B][T][C] each; init: [B][C] or NULL */
void rx_shift_lerp_forward(int n, const float *const *mix, const float *x, const float *init,
                           float *const *out, size_t B, size_t T, size_t C) {
    const rx_seqs sq = {B, T, NULL, NULL, NULL};
    rx_shift_lerp_seqs(n, mix, x, init, out, &sq, C);
}

/* Token rows [r0, r1) of rx_shift_lerp_backward: writes their dx rows
 * (and d_init at t = 0) and sums each lerp's dmix over them into dm(i):
 * part + i*C, or dmix[i] when part is NULL. x[t] receives dout[t] (1 - mix)
 * and dout[t+1] mix, so every row is written by the one block owning it. */
RX_HOT static void lerp_back_rows(int n, const float *const *mix, const float *x,
                                  const float *init, const float *const *dout, float *dx,
                                  float *part, float *const *dmix, float *d_init, size_t T,
                                  size_t C, size_t r0, size_t r1) {
    for (int i = 0; i < n; i++) {
        float *dm = part ? part + (size_t)i * C : dmix[i];
        for (size_t c = 0; c < C; c++) dm[c] = 0.0f;
    }
    for (size_t bt = r0; bt < r1; bt++) {
        const size_t b = bt / T, t = bt % T;
        const float *restrict xr = x + bt * C;
        const float *restrict xp = rx_shift_src(x, init, b, t, T, C);
        float *restrict o = dx + bt * C;
        float *restrict di = t == 0 && d_init ? d_init + b * C : NULL;
        for (size_t c = 0; c < C; c++) o[c] = 0.0f;
        if (di)
            for (size_t c = 0; c < C; c++) di[c] = 0.0f;
        for (int i = 0; i < n; i++) {
            const float *restrict g = dout[i] + bt * C, *restrict m = mix[i];
            float *restrict dm = part ? part + (size_t)i * C : dmix[i];
            for (size_t c = 0; c < C; c++) o[c] += g[c] * (1.0f - m[c]);
            if (t + 1 < T)
                for (size_t c = 0; c < C; c++) o[c] += g[c + C] * m[c];
            if (di)
                for (size_t c = 0; c < C; c++) di[c] += g[c] * m[c];
            if (xp)
                for (size_t c = 0; c < C; c++) dm[c] += g[c] * (xp[c] - xr[c]);
            else
                for (size_t c = 0; c < C; c++) dm[c] -= g[c] * xr[c];
        }
    }
}

/* mix[n], dmix[n]: [C] each; x, dx: [B][T][C]; dout[n]: [B][T][C] each, the
 * grads on the n lerps' outputs; init, d_init: [B][C] or NULL; part:
 * RX_SHIFT_PART(n, B*T, C) floats of scratch, or NULL. Writes dx, dmix and
 * d_init (not wanted: NULL). Threads take whole token rows, in fixed blocks
 * (rx_block_rows) whose dmix sums (in part) are added in block order, so
 * dmix depends on B*T but not on the thread count; without part one
 * thread runs all rows as one block. */
void rx_shift_lerp_backward(int n, const float *const *mix, const float *x, const float *init,
                            const float *const *dout, float *dx, float *const *dmix,
                            float *d_init, size_t B, size_t T, size_t C, float *part) {
    const size_t BT = B * T, rows = part ? rx_block_rows(BT) : BT, nblk = (BT + rows - 1) / rows;
    const size_t stride = (size_t)n * C;
#pragma omp parallel if (part && !rx_in_parallel() && BT * stride >= RX_EW_MIN_PAR)
    {
#pragma omp for schedule(static)
        for (size_t blk = 0; blk < nblk; blk++)
            lerp_back_rows(n, mix, x, init, dout, dx, part ? part + blk * stride : NULL, dmix,
                           d_init, T, C, blk * rows,
                           blk * rows + rows < BT ? blk * rows + rows : BT);
        if (part) rx_block_sums(part, nblk, stride, C, n, dmix, 0);
    }
}

/* x: [B][T][C] -> carry [B][C] = each sequence's last row, the x_prev of
 * the token after it (recurrent inference continues from it) */
void rx_shift_carry(float *carry, const float *x, size_t B, size_t T, size_t C) {
    for (size_t b = 0; b < B; b++)
        memcpy(carry + b * C, x + (b * T + T - 1) * C, C * sizeof(float));
}

/* carry [slots][C]: each sequence's last row of x [rows][C] (laid out as sq
 * says) into its slot's row */
void rx_shift_carry_seqs(float *carry, const float *x, const rx_seqs *sq, size_t C) {
    if (!sq->off) {
        rx_shift_carry(carry, x, sq->B, sq->T, C);
        return;
    }
    for (size_t b = 0; b < sq->B; b++)
        memcpy(carry + (size_t)sq->slot[b] * C, x + ((size_t)sq->off[b + 1] - 1) * C,
               C * sizeof(float));
}
