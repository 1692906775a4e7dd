/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * runtime.c -- error reporting, thread control, shared by the Python and the
 * C front ends, the fixed row blocks' ordered sums (rx_block_sums), and the
 * per-kernel time accounting of the benchmarks, and the model context's
 * defaults and checks (rx_model_ctx), which every kernel reads.
 */
#include <float.h>
#include <stdarg.h>
#include <stdio.h>
#include <time.h>

#include "rx_internal.h"

/* The last failure's message, per calling thread: rx_fail writes it, every
 * failing rx_ function goes through rx_fail, rx_last_error reads it. */
static _Thread_local char last_error[RX_ERROR_MAX];

int rx_fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return code;
}

const char *rx_last_error(void) { return last_error; }

const char *rx_first_null(const void *const *p, const char *const *names, int n) {
    for (int i = 0; i < n; i++)
        if (!p[i]) return names[i];
    return NULL;
}

int rx_seq_check(const char *fn, int B, int T, int layer_id, const float *v_first) {
    if (B < 1 || T < 1) return rx_fail(RX_EINVAL, "%s: B = %d, T = %d must be >= 1", fn, B, T);
    if (layer_id > 0 && !v_first)
        return rx_fail(RX_EINVAL, "%s: v_first is NULL at layer %d", fn, layer_id);
    return RX_OK;
}

void rx_spans_add(rx_spans *l, const char *prefix, const char *name, const void *p, size_t n,
                  size_t elem) {
    if (!p || !n) return;
    if (l->n >= RX_SPANS_MAX) {
        l->full = 1;
        return;
    }
    l->s[l->n++] = (rx_span){prefix, name, p, n * elem};
}

static int spans_meet(const rx_span *a, const rx_span *b) {
    uintptr_t a0 = (uintptr_t)a->p, b0 = (uintptr_t)b->p;
    return a0 < b0 + b->bytes && b0 < a0 + a->bytes;
}

int rx_spans_check(const char *fn, const rx_spans *out, const rx_spans *in) {
    /* every caller adds a fixed list, far below the capacity */
    if (out->full || in->full)
        return rx_fail(RX_EINVAL, "%s: more than %d buffers to check", fn, RX_SPANS_MAX);
    for (int i = 0; i < out->n; i++) {
        const rx_span *o = &out->s[i], *hit = NULL;
        const char *what = "input";
        for (int j = 0; j < in->n && !hit; j++)
            if (spans_meet(o, &in->s[j])) hit = &in->s[j];
        for (int j = 0; j < i && !hit; j++)
            if (spans_meet(o, &out->s[j])) hit = &out->s[j], what = "output";
        if (hit)
            return rx_fail(RX_EINVAL, "%s: the output %s%s overlaps the %s %s%s (outputs must "
                           "not share memory with inputs or other outputs)", fn, o->prefix,
                           o->name, what, hit->prefix, hit->name);
    }
    return RX_OK;
}

void rx_fnan_apart(float *out, size_t n, const rx_spans *in) {
    const rx_span o = {"", "", out, n * sizeof(float)};
    for (int j = 0; j < in->n; j++)
        if (spans_meet(&o, &in->s[j])) return;
    rx_fnan(out, n);
}

void rx_block_sums(const float *part, size_t nblk, size_t stride, size_t n, int nvec,
                   float *const *dst, int acc) {
    enum { W = 16 };   /* columns per work item: one vector, one cache line */
    const size_t nch = (n + W - 1) / W, items = (size_t)nvec * nch;
#pragma omp for schedule(static)
    for (size_t it = 0; it < items; it++) {
        const size_t v = it / nch, i0 = it % nch * W, w = n - i0 < W ? n - i0 : W;
        float *d = dst[v], s[W];
        if (!d) continue;
        const float *p = part + v * n + i0;
        for (size_t i = 0; i < w; i++) s[i] = acc ? d[i0 + i] : 0.0f;
        for (size_t b = 0; b < nblk; b++)
            for (size_t i = 0; i < w; i++) s[i] += p[b * stride + i];
        for (size_t i = 0; i < w; i++) d[i0 + i] = s[i];
    }
}

const char *rx_strerror(int code) {
    switch (code) {
    case RX_OK: return "success";
    case RX_ENOMEM: return "out of memory";
    case RX_EINVAL: return "invalid argument";
    case RX_ECONFIG: return "invalid model config";
    default: return "unknown error code";
    }
}

#ifdef _OPENMP
static int rx_default_threads;   /* omp_get_max_threads() before any override */

void rx_set_num_threads(int n) {
    if (!rx_default_threads) rx_default_threads = omp_get_max_threads();
    /* far above any core count: OpenMP would try to start every thread */
    if (n > RX_MAX_THREADS) n = RX_MAX_THREADS;
    omp_set_num_threads(n >= 1 ? n : rx_default_threads);
}
int rx_get_num_threads(void) { return omp_get_max_threads(); }
int rx_has_openmp(void) { return 1; }
#else
void rx_set_num_threads(int n) { (void)n; }
int rx_get_num_threads(void) { return 1; }
int rx_has_openmp(void) { return 0; }
#endif

/* Self time per slot: a slot's clock runs from its push to its pop, paused
 * while a nested slot runs. State is per calling thread, and only calls made
 * outside every parallel region count: kernels nested in a region run inside
 * their caller's slot, also when the region has one thread (the attention
 * core's tile GEMMs are attention time at any thread count). */
static const char *const prof_names[RX_PROF_N] = {
    "other (elementwise, glue)", "gemm", "wkv7", "attention core", "norms",
    "cross-entropy", "dora norms"};
static _Thread_local int prof_on, prof_depth, prof_cur;
static _Thread_local int prof_stack[16];
static _Thread_local double prof_acc[RX_PROF_N], prof_t;

static int prof_nested(void) {
#ifdef _OPENMP
    return omp_get_level() > 0;
#else
    return 0;
#endif
}

static double prof_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void rx_prof_push(int slot) {
    if (!prof_on || prof_nested()) return;
    double now = prof_now();
    prof_acc[prof_cur] += now - prof_t;
    prof_t = now;
    if (prof_depth < (int)(sizeof prof_stack / sizeof prof_stack[0]))
        prof_stack[prof_depth] = prof_cur;
    prof_depth++;
    prof_cur = slot;
}

void rx_prof_pop(void) {
    if (!prof_on || prof_nested() || prof_depth == 0) return;
    double now = prof_now();
    prof_acc[prof_cur] += now - prof_t;
    prof_t = now;
    prof_depth--;
    prof_cur = prof_depth < (int)(sizeof prof_stack / sizeof prof_stack[0])
                   ? prof_stack[prof_depth] : RX_PROF_OTHER;
}

void rx_profile_enable(int on) {
    for (int i = 0; i < RX_PROF_N; i++) prof_acc[i] = 0.0;
    prof_depth = 0;
    prof_cur = RX_PROF_OTHER;
    prof_on = on != 0;
    prof_t = prof_now();
}

int rx_profile_read(double *seconds, int n) {
    if (prof_on && prof_depth == 0) {   /* charge the time since the last call to "other" */
        double now = prof_now();
        prof_acc[prof_cur] += now - prof_t;
        prof_t = now;
    }
    for (int i = 0; seconds && i < n && i < RX_PROF_N; i++) seconds[i] = prof_acc[i];
    return RX_PROF_N;
}

const char *rx_profile_name(int i) { return i >= 0 && i < RX_PROF_N ? prof_names[i] : NULL; }

/* ---- the model context: its defaults and checks --------------------------- */

const rx_model_ctx rx_ctx_default = RX_MODEL_CTX_DEFAULT;

void rx_model_ctx_default(rx_model_ctx *ctx) {
    if (ctx) *ctx = rx_ctx_default;
}

int rx_model_ctx_validate(const rx_model_ctx *ctx) {
    static const char *const fn = "rx_model_ctx_validate";
    if (!ctx) return rx_fail(RX_EINVAL, "%s: ctx is NULL", fn);
    /* an eps is rounded to float for the kernels: it must stay > 0 there */
    if (!(isfinite(ctx->ln_eps) && (float)ctx->ln_eps > 0.0f && ctx->ln_eps <= FLT_MAX))
        return rx_fail(RX_ECONFIG, "%s: ln_eps %g must be finite and > 0", fn, ctx->ln_eps);
    if (!(isfinite(ctx->gn_eps) && (float)ctx->gn_eps > 0.0f && ctx->gn_eps <= FLT_MAX))
        return rx_fail(RX_ECONFIG, "%s: gn_eps %g must be finite and > 0", fn, ctx->gn_eps);
    if (ctx->ln0 != 0 && ctx->ln0 != 1)
        return rx_fail(RX_ECONFIG, "%s: ln0 %d must be 0 or 1", fn, ctx->ln0);
    if (!(isfinite(ctx->l2wrap) && ctx->l2wrap >= 0.0))
        return rx_fail(RX_ECONFIG, "%s: l2wrap %g must be finite and >= 0", fn, ctx->l2wrap);
    return RX_OK;
}
