/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * optim.c -- AdamW over the flat parameter arena, and the global grad norm
 * that gradient clipping needs.
 *
 * The update is decoupled AdamW (Loshchilov & Hutter), as torch.optim.AdamW:
 *     p  <- p - lr*wd*p                     (only inside the decay ranges)
 *     m  <- b1*m + (1-b1)*g                 g = grad_scale * grad
 *     v  <- b2*v + (1-b2)*g^2
 *     p  <- p - lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
 * Every element is independent, so threads split the arena into contiguous
 * slices; the result does not depend on the thread count.
 *
 * The grad norm sums squares in double, per thread over a fixed slice, and
 * adds the partial sums in thread order: at a given thread count it is the
 * same number on every run, which bit-exact resumption relies on.
 */
#include "rx_internal.h"

#define RX_OPTIM_MAX_PARTS 256 /* the grad norm's partial sums (ranges of >= RX_EW_MIN_PAR) */

static int optim_threads(size_t n) {
    if (rx_in_parallel() || n < RX_EW_MIN_PAR) return 1;
    return rx_max_threads();
}

/* p, g, m, v: [n]; the AdamW update of elements [0, n), with decay when wd_on */
RX_HOT static void adamw_span(float *p, const float *g, float *m, float *v, size_t n,
                              float lr, float b1, float b2, float eps, float decay,
                              float gscale, float bc1, float rbc2) {
    /* decay is 1 - lr*wd inside decay ranges and exactly 1 elsewhere */
#pragma omp simd
    for (size_t i = 0; i < n; i++) {
        float gi = g[i] * gscale;
        float mi = b1 * m[i] + (1.0f - b1) * gi;
        float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] * decay - lr * (mi / bc1) / (sqrtf(vi * rbc2) + eps);
    }
}

/* params, grads, m, v: [n]; decay_ranges: [n_ranges][2] sorted half-open
 * [begin, end) element ranges, non-overlapping, within [0, n) */
int rx_adamw_step(float *params, const float *grads, float *m, float *v, size_t n,
                  const int64_t *decay_ranges, int n_ranges,
                  float lr, float beta1, float beta2, float eps, float weight_decay,
                  float grad_scale, int64_t step) {
    static const char *const fn = "rx_adamw_step";
    if (!params || !grads || !m || !v || (n_ranges > 0 && !decay_ranges))
        return rx_fail(RX_EINVAL, "%s: a buffer or decay_ranges is NULL", fn);
    if (n < 1 || n_ranges < 0 || step < 1)
        return rx_fail(RX_EINVAL, "%s: n = %zu, n_ranges = %d, step = %lld out of range", fn, n,
                       n_ranges, (long long)step);
    if (!(beta1 >= 0.0f && beta1 < 1.0f) || !(beta2 >= 0.0f && beta2 < 1.0f))
        return rx_fail(RX_EINVAL, "%s: betas (%g, %g) must lie in [0, 1)", fn, beta1, beta2);
    if (!(eps >= 0.0f) || !(lr >= 0.0f) || !(weight_decay >= 0.0f) || !isfinite(grad_scale))
        return rx_fail(RX_EINVAL, "%s: lr = %g, eps = %g, weight_decay = %g must be >= 0 and "
                       "grad_scale = %g finite", fn, lr, eps, weight_decay, grad_scale);
    rx_spans in = {.n = 0}, out = {.n = 0};
    RX_SPAN_ADD(&in, "grads", grads, n);
    RX_SPAN_ADD(&in, "decay_ranges", decay_ranges, 2 * (size_t)n_ranges);
    RX_SPAN_ADD(&out, "params", params, n);
    RX_SPAN_ADD(&out, "m", m, n);
    RX_SPAN_ADD(&out, "v", v, n);
    int rc = rx_spans_check(fn, &out, &in);
    if (rc != RX_OK) return rc;
    int64_t prev = 0;
    for (int r = 0; r < n_ranges; r++) {
        int64_t b = decay_ranges[2 * (size_t)r], e = decay_ranges[2 * (size_t)r + 1];
        if (b < prev || e < b || (uint64_t)e > (uint64_t)n)
            return rx_fail(RX_EINVAL, "%s: decay range %d [%lld, %lld) is unsorted, overlapping "
                           "or outside [0, %zu)", fn, r, (long long)b, (long long)e, n);
        prev = e;
    }
    /* bias corrections in double: beta^step underflows gracefully there */
    const float bc1 = (float)(1.0 - pow((double)beta1, (double)step));
    const float rbc2 = (float)(1.0 / (1.0 - pow((double)beta2, (double)step)));
    const float decay_on = 1.0f - lr * weight_decay;
    int nt = optim_threads(n);
    /* parts by index, not thread id: OpenMP may grant fewer threads */
#pragma omp parallel for schedule(static, 1) num_threads(nt) if (nt > 1)
    for (int id = 0; id < nt; id++) {
        size_t lo = n * (size_t)id / (size_t)nt, hi = n * ((size_t)id + 1) / (size_t)nt;
        /* walk the alternating no-decay / decay segments, clipped to [lo, hi) */
        size_t at = lo;
        for (int r = 0; r <= n_ranges && at < hi; r++) {
            size_t b = r < n_ranges ? (size_t)decay_ranges[2 * (size_t)r] : hi;
            size_t e = r < n_ranges ? (size_t)decay_ranges[2 * (size_t)r + 1] : hi;
            if (b > hi) b = hi;
            if (e > hi) e = hi;
            if (b > at) {
                adamw_span(params + at, grads + at, m + at, v + at, b - at, lr, beta1, beta2,
                           eps, 1.0f, grad_scale, bc1, rbc2);
                at = b;
            }
            if (e > at) {
                adamw_span(params + at, grads + at, m + at, v + at, e - at, lr, beta1, beta2,
                           eps, decay_on, grad_scale, bc1, rbc2);
                at = e;
            }
        }
    }
    return RX_OK;
}

/* Lanes of sumsq_span's sums: with one vector of sums every add waits for
 * the one before (4 cycles), 1 float per cycle, a third of what memory
 * delivers; 16 sums keep four vectors of adds in flight. */
#define SUMSQ_LANES 16

RX_HOT static double sumsq_span(const float *g, size_t n) {
    double acc[SUMSQ_LANES] = {0.0};
    size_t i = 0;
    for (; i + SUMSQ_LANES <= n; i += SUMSQ_LANES)
        for (size_t l = 0; l < SUMSQ_LANES; l++) acc[l] += (double)g[i + l] * (double)g[i + l];
    for (size_t l = 0; i < n; i++, l++) acc[l] += (double)g[i] * (double)g[i];
    /* pairwise, in a fixed order */
    for (size_t w = SUMSQ_LANES / 2; w > 0; w /= 2)
        for (size_t l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

/* g: [n]. *norm = sqrt(sum g^2) (NaN for a NaN grad). */
int rx_grad_norm_l2(const float *g, size_t n, double *norm) {
    if (!g || !norm || n < 1)
        return rx_fail(RX_EINVAL, "rx_grad_norm_l2: %s", n < 1 ? "n < 1" : "g or norm is NULL");
    /* a part count set by n alone, not by the team: the same bits at any
     * thread count */
    size_t np = n / RX_EW_MIN_PAR;
    np = np < 1 ? 1 : np > RX_OPTIM_MAX_PARTS ? RX_OPTIM_MAX_PARTS : np;
    double part[RX_OPTIM_MAX_PARTS];
    int nt = optim_threads(n);
    (void)nt; /* read only by the OpenMP pragma */
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (size_t id = 0; id < np; id++) {
        size_t lo = n * id / np, hi = n * (id + 1) / np;
        part[id] = sumsq_span(g + lo, hi - lo);
    }
    double s = 0.0;
    for (size_t t = 0; t < np; t++) s += part[t];
    *norm = sqrt(s);
    return RX_OK;
}

/* x, y: [n]. y = a*x + b*y (b == 0: y = a*x, y not read). */
int rx_axpby(size_t n, float a, const float *x, float b, float *y) {
    if (!x || !y || n < 1)
        return rx_fail(RX_EINVAL, "rx_axpby: %s", n < 1 ? "n < 1" : "x or y is NULL");
    if (!isfinite(a) || !isfinite(b))
        return rx_fail(RX_EINVAL, "rx_axpby: a and b must be finite");
    rx_spans out = {0}, in = {0};
    RX_SPAN_ADD(&out, "y", y, n);
    RX_SPAN_ADD(&in, "x", x, n);
    int rc = rx_spans_check("rx_axpby", &out, &in);
    if (rc != RX_OK) return rc;
    int nt = optim_threads(n);
    (void)nt; /* read only by the OpenMP pragma */
    if (b == 0.0f) {
#pragma omp parallel for simd schedule(static) num_threads(nt) if (nt > 1)
        for (size_t i = 0; i < n; i++) y[i] = a * x[i];
    } else {
#pragma omp parallel for simd schedule(static) num_threads(nt) if (nt > 1)
        for (size_t i = 0; i < n; i++) y[i] = a * x[i] + b * y[i];
    }
    return RX_OK;
}

double rx_grad_norm(const float *g, size_t n) {
    double norm;
    return rx_grad_norm_l2(g, n, &norm) == RX_OK ? norm : NAN;
}
