/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * layernorm.c -- LayerNorm over C channels and, with the same row kernel,
 * the time-mix per-head group norm (rows of N, affine indexed by head).
 *
 * Statistics are two-pass in double: a row of 1000 + noise has a variance
 * eight orders of magnitude below its squared mean, which a one-pass fp32
 * E[x^2] - E[x]^2 cannot resolve.
 */
#include <string.h>

#include "rx_internal.h"

/* Row sums are kept in LANES independent double accumulators combined in a
 * fixed order at the end: a single chained accumulator waits on the add
 * latency at every element, separate lanes vectorise. The order is written
 * out, so no -ffast-math reassociation is involved. */
#define LANES 8

static inline double lanes_total(const double acc[LANES]) {
    double t = 0.0;
    for (size_t l = 0; l < LANES; l++) t += acc[l];
    return t;
}

/* The backward's two sums as LANES / 4 vectors of 4 lanes each (GCC/Clang
 * vector extensions, lowered to the widths each clone has). Written as
 * arrays of lanes, GCC 12 kept the accumulators in memory and added one
 * element at a time through a store and a reload: the norms of a training
 * step took 15-20% longer. Lane l still adds elements l, l + LANES, ... in
 * order, so the bits are those of the scalar loop. */
typedef float f4 __attribute__((vector_size(4 * sizeof(float))));
typedef double d4 __attribute__((vector_size(4 * sizeof(double))));

static inline f4 f4_load(const float *p) {
    f4 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The mean comes back as mean + mean_lo (two floats): rounded to one float
 * it is off by up to half an ulp of the offset (3e-5 at 1000), an error
 * that (x - mean) would carry into every normalised value. */
RX_HOT static void row_stats(const float *restrict x, size_t D, float eps, float *mean,
                             float *mean_lo, float *rstd) {
    double acc[LANES] = {0};
    size_t n = 0;
    for (; n + LANES <= D; n += LANES)
        for (size_t l = 0; l < LANES; l++) acc[l] += x[n + l];
    for (; n < D; n++) acc[0] += x[n];
    const double mu = lanes_total(acc) / (double)D;
    for (size_t l = 0; l < LANES; l++) acc[l] = 0.0;
    for (n = 0; n + LANES <= D; n += LANES)
        for (size_t l = 0; l < LANES; l++) {
            double d = x[n + l] - mu;
            acc[l] += d * d;
        }
    for (; n < D; n++) {
        double d = x[n] - mu;
        acc[0] += d * d;
    }
    *mean = (float)mu;
    *mean_lo = (float)(mu - (double)*mean);
    *rstd = (float)(1.0 / sqrt(lanes_total(acc) / (double)D + (double)eps));
}

/* rows [r0,r1) of x, out: [rows][D]; w, b: [period][D]; mean, rstd: [rows] or NULL */
RX_HOT static void rownorm_forward_rows(const float *x, const float *w, const float *b,
                                        float *out, float *mean, float *rstd,
                                        size_t r0, size_t r1, size_t D, size_t period,
                                        float eps) {
    for (size_t r = r0; r < r1; r++) {
        const float *xr = x + r * D;
        const float *wr = w + (r % period) * D, *br = b + (r % period) * D;
        float *o = out + r * D, mu, mlo, rs;
        row_stats(xr, D, eps, &mu, &mlo, &rs);
        if (mean) mean[r] = mu;
        if (rstd) rstd[r] = rs;
        for (size_t n = 0; n < D; n++) o[n] = ((xr[n] - mu) - mlo) * rs * wr[n] + br[n];
    }
}

void rx_rownorm_forward(const float *x, const float *w, const float *b,
                        float *out, float *mean, float *rstd,
                        size_t rows, size_t D, size_t period, float eps) {
    rx_prof_push(RX_PROF_NORM);
    int nt = (rx_in_parallel() || rows * D < RX_ROW_MIN_PAR) ? 1 : rx_max_threads();
    /* nt fixed row ranges, not one per thread id: the runtime may grant fewer
     * threads than asked (OMP_THREAD_LIMIT, OMP_DYNAMIC). */
#pragma omp parallel for schedule(static, 1) num_threads(nt) if (nt > 1)
    for (int p = 0; p < nt; p++)
        rownorm_forward_rows(x, w, b, out, mean, rstd, rows * p / nt, rows * (p + 1) / nt, D,
                             period, eps);
    rx_prof_pop();
}

/* x, dy, dx: [rows][D] (dx may alias dy); w, dw, db: [period][D]. */
RX_HOT static void rownorm_backward_rows(const float *x, const float *w, const float *dy,
                                         float *dx, float *dw, float *db,
                                         size_t r0, size_t r1, size_t D, size_t period,
                                         float eps) {
    for (size_t r = r0; r < r1; r++) {
        const float *xr = x + r * D, *g = dy + r * D, *wr = w + (r % period) * D;
        float *restrict dwr = dw + (r % period) * D, *restrict dbr = db + (r % period) * D;
        float *o = dx + r * D;
        float mu, mlo, rs;
        row_stats(xr, D, eps, &mu, &mlo, &rs);
        /* xh and g*w are fp32 as in the output; their sums in double lanes */
        d4 vg[LANES / 4] = {{0}}, vgx[LANES / 4] = {{0}};
        size_t n = 0;
        for (; n + LANES <= D; n += LANES)
            for (size_t h = 0; h < LANES / 4; h++) {
                const size_t i = n + 4 * h;
                const f4 gw = f4_load(g + i) * f4_load(wr + i);
                const f4 gwx = gw * (((f4_load(xr + i) - mu) - mlo) * rs);
                vg[h] += __builtin_convertvector(gw, d4);
                vgx[h] += __builtin_convertvector(gwx, d4);
            }
        double sg[LANES], sgx[LANES];
        memcpy(sg, vg, sizeof sg);
        memcpy(sgx, vgx, sizeof sgx);
        for (; n < D; n++) {
            float xh = ((xr[n] - mu) - mlo) * rs, gw = g[n] * wr[n];
            sg[0] += gw;
            sgx[0] += gw * xh;
        }
        for (n = 0; n < D; n++) {
            dwr[n] += g[n] * (((xr[n] - mu) - mlo) * rs);
            dbr[n] += g[n];
        }
        float mg = (float)(lanes_total(sg) / (double)D);
        float mgx = (float)(lanes_total(sgx) / (double)D);
        for (size_t n = 0; n < D; n++) {
            float xh = ((xr[n] - mu) - mlo) * rs;
            o[n] = rs * (g[n] * wr[n] - mg - xh * mgx);
        }
    }
}

int rx_rownorm_backward(const float *x, const float *w, const float *dy,
                        float *dx, float *dw, float *db,
                        size_t rows, size_t D, size_t period, float eps) {
    /* dw/db sum over rows: each fixed block of rows (rx_block_rows tokens
     * of period rows) sums into its own partial rows, added in block order,
     * so the result does not depend on the thread count, or on whether the
     * pass is threaded at all. The partials live in the calling thread's
     * scratch: a step runs this some 20 times. */
    if (rows == 0) return RX_OK;
    const size_t PD = period * D, brows = rx_block_rows((rows + period - 1) / period) * period;
    const size_t nblk = (rows + brows - 1) / brows;
    float *part = PD <= SIZE_MAX / sizeof(float) / 2 / nblk
                      ? rx_thread_buffer(RX_BUF_NORM_PART, nblk * 2 * PD * sizeof(float))
                      : NULL;
    if (!part) return rx_fail(RX_ENOMEM, "rx_rownorm_backward: out of memory");
    const int nt = (rx_in_parallel() || rows * D < RX_ROW_MIN_PAR) ? 1 : rx_max_threads();
    rx_prof_push(RX_PROF_NORM);
    float *const sums[2] = {dw, db};
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(static)
        for (size_t b = 0; b < nblk; b++) {
            float *mine = part + b * 2 * PD;   /* zeroed by the thread that sums into it */
            rx_fzero(mine, 2 * PD);
            rownorm_backward_rows(x, w, dy, dx, mine, mine + PD, b * brows,
                                  (b + 1) * brows < rows ? (b + 1) * brows : rows, D, period,
                                  eps);
        }
        rx_block_sums(part, nblk, 2 * PD, PD, 2, sums, 1);
    }
    rx_prof_pop();
    return RX_OK;
}

/* x, out: [B][T][C]; w, b: [C]; eps: the model's (rx_model_ctx.ln_eps) */
int rx_layernorm_forward_eps(const float *x, const float *w, const float *b, float *out,
                             int B, int T, int C, float eps) {
    static const char *const fn = "rx_layernorm_forward_seq";
    const char *nul = rx_first_null(RX_NULLS(x, w, b, out), RX_NAMES("x", "w", "b", "out"), 4);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (B < 1 || T < 1 || C < 1)
        return rx_fail(RX_EINVAL, "%s: B = %d, T = %d, C = %d must be >= 1", fn, B, T, C);
    const size_t BTC = (size_t)B * T * C;
    rx_spans in = {.n = 0}, o = {.n = 0};
    /* out may be x itself: a row is read whole before it is written */
    RX_SPAN_ADD(&in, "x", x == out ? NULL : x, BTC);
    RX_SPAN_ADD(&in, "w", w, (size_t)C);
    RX_SPAN_ADD(&in, "b", b, (size_t)C);
    RX_SPAN_ADD(&o, "out", out, BTC);
    int rc = rx_spans_check(fn, &o, &in);
    if (rc != RX_OK) return rc;
    rx_rownorm_forward(x, w, b, out, NULL, NULL, (size_t)B * T, (size_t)C, 1, eps);
    return RX_OK;
}

int rx_layernorm_forward_seq(const float *x, const float *w, const float *b, float *out,
                             int B, int T, int C) {
    return rx_layernorm_forward_eps(x, w, b, out, B, T, C, RX_LN_EPS);
}

/* x, dy, dx: [B][T][C]; w, dw, db: [C] (dw, db zeroed here) */
int rx_layernorm_backward_eps(const float *x, const float *w, const float *b, const float *dy,
                              float *dx, float *dw, float *db, int B, int T, int C, float eps) {
    (void)b; /* the bias does not enter the input gradient */
    static const char *const fn = "rx_layernorm_backward";
    const char *nul = rx_first_null(RX_NULLS(x, w, dy, dx, dw, db),
                                    RX_NAMES("x", "w", "dy", "dx", "dw", "db"), 6);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (B < 1 || T < 1 || C < 1)
        return rx_fail(RX_EINVAL, "%s: B = %d, T = %d, C = %d must be >= 1", fn, B, T, C);
    const size_t BTC = (size_t)B * T * C;
    rx_spans in = {.n = 0}, out = {.n = 0};
    RX_SPAN_ADD(&in, "x", x, BTC);
    RX_SPAN_ADD(&in, "w", w, (size_t)C);
    RX_SPAN_ADD(&in, "b", b, (size_t)C);
    /* dx may be dy itself: a row of dy is read whole before dx's is written */
    RX_SPAN_ADD(&in, "dy", dy == dx ? NULL : dy, BTC);
    RX_SPAN_ADD(&out, "dx", dx, BTC);
    RX_SPAN_ADD(&out, "dw", dw, (size_t)C);
    RX_SPAN_ADD(&out, "db", db, (size_t)C);
    int rc = rx_spans_check(fn, &out, &in);
    if (rc != RX_OK) return rc;
    rx_fzero(dw, (size_t)C);
    rx_fzero(db, (size_t)C);
    return rx_rownorm_backward(x, w, dy, dx, dw, db, (size_t)B * T, (size_t)C, 1, eps);
}

int rx_layernorm_backward(const float *x, const float *w, const float *b, const float *dy,
                          float *dx, float *dw, float *db, int B, int T, int C) {
    return rx_layernorm_backward_eps(x, w, b, dy, dx, dw, db, B, T, C, RX_LN_EPS);
}
