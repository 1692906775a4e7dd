/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * channelmix.c -- the RWKV-7 squared-ReLU FFN with its token shift (docs/maths.md §Channel-mix):
 *     xk  = x + (x_prev - x) * ffn_x_k
 *     out = relu(xk . ffn_key_w)^2 . ffn_value_w
 */
#include <string.h>

#include "rx_internal.h"

int rx_cm_params_ok(const rx_cm_params *P) {
    return P && P->c >= 1 && P->ffn_dim >= 1 && P->ffn_x_k && P->ffn_key_w && P->ffn_value_w;
}

/* A chunk of the relu^2 hidden, in place: h [n] = relu(h)^2 (omp simd:
 * each element is read before it is written). */
RX_HOT static void relu2(float *h, size_t n) {
#pragma omp simd
    for (size_t i = 0; i < n; i++) h[i] = rx_selectf(h[i] > 0.0f, h[i] * h[i], 0.0f);
}

/* Its backward on the grad dh [n], in place, from the hidden h =
 * relu(pre)^2 alone (the key projection pre is not kept, so the model
 * stores one [BT][F] buffer per block instead of two): dh = 2 relu(pre)
 * dh, where relu(pre) = sqrt(h) exactly, since in binary floating point
 * sqrt(fl(x*x)) == x for every x > 0 whose square neither overflows nor
 * underflows (below ~1e-19 the term 2 x dh is far under any fp32
 * resolution of the other grads). */
RX_HOT static void relu2_back_h(const float *restrict h, float *restrict dh, size_t n) {
    for (size_t i = 0; i < n; i++) dh[i] = 2.0f * sqrtf(h[i]) * dh[i];
}

/* x, xk, out: [B][T][C]; h: [B][T][F]. Keeps the lerp xk and the hidden
 * h = relu(xk . ffn_key_w)^2 for rx_cm_backward_acts; out may be NULL
 * (recompute). */
void rx_cm_spans(const rx_cm_params *P, const rx_cm_grads *G, const char *pp, const char *gp,
                 rx_spans *in, rx_spans *out) {
    const size_t C = (size_t)P->c, F = (size_t)P->ffn_dim;
    rx_spans_add(in, pp, "ffn_x_k", P->ffn_x_k, C, sizeof(float));
    rx_spans_add(in, pp, "ffn_key_w", P->ffn_key_w, C * F, sizeof(float));
    rx_spans_add(in, pp, "ffn_value_w", P->ffn_value_w, F * C, sizeof(float));
    if (!G) return;
    rx_spans_add(out, gp, "ffn_x_k", G->ffn_x_k, C, sizeof(float));
    rx_spans_add(out, gp, "ffn_key_w", G->ffn_key_w, C * F, sizeof(float));
    rx_spans_add(out, gp, "ffn_value_w", G->ffn_value_w, F * C, sizeof(float));
}

int rx_cm_forward_acts(const rx_cm_params *P, const float *x, const float *x_prev_init,
                       float *xk, float *h, float *out, size_t B, size_t T) {
    const rx_seqs sq = {B, T, NULL, NULL, NULL};
    return rx_cm_forward_seqs(P, x, x_prev_init, xk, h, out, &sq);
}

/* x, xk, out: [rows][C]; h: [rows][F]; rows laid out as sq says */
int rx_cm_forward_seqs(const rx_cm_params *P, const float *x, const float *x_prev_init,
                       float *xk, float *h, float *out, const rx_seqs *sq) {
    const size_t C = (size_t)P->c, F = (size_t)P->ffn_dim, BT = rx_seqs_rows(sq), n = BT * F;
    rx_shift_lerp_seqs(1, &P->ffn_x_k, x, x_prev_init, &xk, sq, C);
    int rc = rx_pgemm(0, 0, BT, F, C, xk, C, P->ffn_key_w, F, 0.0f, h, F);
    if (rc != RX_OK) return rc;
#pragma omp parallel for schedule(static) if (!rx_in_parallel() && n >= RX_EW_MIN_PAR)
    for (size_t i0 = 0; i0 < n; i0 += RX_EW_CHUNK) relu2(h + i0, rx_ew_len(i0, n));
    return out ? rx_pgemm(0, 0, BT, C, F, h, F, P->ffn_value_w, C, 0.0f, out, C) : RX_OK;
}

/* The backward from rx_cm_forward_acts's xk and h; dh [BT][F] and dxk
 * [BT][C] are scratch and must not alias h or xk: each GEMM batch computes
 * a weight grad, which reads h or xk, at the same time as the grad that is
 * written into dh or dxk. Other arguments as in rx_channelmix_backward. */
int rx_cm_backward_acts(const rx_cm_params *P, const float *x, const float *x_prev_init,
                        const float *xk, const float *h, const float *dy,
                        rx_cm_grads *G, float *dx, float *d_xprev_init, size_t B, size_t T,
                        float *dh, float *dxk) {
    const size_t C = (size_t)P->c, F = (size_t)P->ffn_dim, BT = B * T, n = BT * F;
    /* value projection: dWv = h^T dy, dh = dy Wv^T */
    const rx_gemm_op value[2] = {{1, 0, F, C, BT, h, F, dy, C, 0.0f, G->ffn_value_w, C},
                                 {0, 1, BT, F, C, dy, C, P->ffn_value_w, C, 0.0f, dh, F}};
    int rc = rx_pgemm_batch(value, 2);
    if (rc != RX_OK) return rc;
#pragma omp parallel for schedule(static) if (!rx_in_parallel() && n >= RX_EW_MIN_PAR)
    for (size_t i0 = 0; i0 < n; i0 += RX_EW_CHUNK) relu2_back_h(h + i0, dh + i0, rx_ew_len(i0, n));
    /* key projection */
    const rx_gemm_op key[2] = {{1, 0, C, F, BT, xk, C, dh, F, 0.0f, G->ffn_key_w, F},
                               {0, 1, BT, C, F, dh, F, P->ffn_key_w, F, 0.0f, dxk, C}};
    rc = rx_pgemm_batch(key, 2);
    if (rc != RX_OK) return rc;
    /* dh is free now: it holds the lerp's per-block sums when large enough */
    const float *dxk_c = dxk;
    float *part = RX_SHIFT_PART(1, BT, C) <= n ? dh : NULL;
    rx_shift_lerp_backward(1, &P->ffn_x_k, x, x_prev_init, &dxk_c, dx, &G->ffn_x_k, d_xprev_init,
                           B, T, C, part);
    return RX_OK;
}

/* rx_spans_check of a sequence entry point: P (and G), x [B][T][c],
 * x_prev_init [B][c], dy (NULL in the forward), y (out, or dx) and
 * d_xprev_init [B][c] */
static int cm_spans_check(const char *fn, const rx_cm_params *P, const rx_cm_grads *G, int B,
                          int T, const float *x, const float *x_prev_init, const float *dy,
                          const float *y, const float *d_xprev_init) {
    const size_t BTC = (size_t)B * T * P->c, BC = (size_t)B * P->c;
    rx_spans in = {.n = 0}, out = {.n = 0};
    rx_cm_spans(P, G, "P->", "G->", &in, &out);
    RX_SPAN_ADD(&in, "x", x, BTC);
    RX_SPAN_ADD(&in, "x_prev_init", x_prev_init, BC);
    RX_SPAN_ADD(&in, "dy", dy, BTC);
    RX_SPAN_ADD(&out, dy ? "dx" : "out", y, BTC);
    RX_SPAN_ADD(&out, "d_xprev_init", d_xprev_init, BC);
    return rx_spans_check(fn, &out, &in);
}

/* x, out: [B][T][C]; x_prev_init: [B][C] or NULL */
int rx_channelmix_forward_seq(const rx_cm_params *P, const float *x, const float *x_prev_init,
                              float *out, int B, int T) {
    static const char *const fn = "rx_channelmix_forward_seq";
    const char *nul = rx_first_null(RX_NULLS(P, x, out), RX_NAMES("P", "x", "out"), 3);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (!rx_cm_params_ok(P))
        return rx_fail(RX_EINVAL, "%s: P has a NULL tensor or c = %d, ffn_dim = %d below 1", fn,
                       P->c, P->ffn_dim);
    int rc = rx_seq_check(fn, B, T, -1, NULL);
    if (rc != RX_OK) return rc;
    const size_t C = (size_t)P->c, F = (size_t)P->ffn_dim, BT = (size_t)B * T;
    rc = cm_spans_check(fn, P, NULL, B, T, x, x_prev_init, NULL, out, NULL);
    if (rc != RX_OK) return rc;
    float *xk = rx_falloc(BT * C), *h = rx_falloc(BT * F);
    if (!xk || !h) {
        free(xk);
        free(h);
        return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    }
    rc = rx_cm_forward_acts(P, x, x_prev_init, xk, h, out, (size_t)B, (size_t)T);
    free(xk);
    free(h);
    return rc;
}

/* x, dy, dx: [B][T][C]; x_prev_init, d_xprev_init: [B][C] or NULL */
int rx_channelmix_backward(const rx_cm_params *P, const float *x, const float *x_prev_init,
                           const float *dy, rx_cm_grads *G, float *dx, float *d_xprev_init,
                           int B, int T) {
    static const char *const fn = "rx_channelmix_backward";
    const char *nul = rx_first_null(RX_NULLS(P, x, dy, G, dx), RX_NAMES("P", "x", "dy", "G", "dx"),
                                    5);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (!rx_cm_params_ok(P))
        return rx_fail(RX_EINVAL, "%s: P has a NULL tensor or c = %d, ffn_dim = %d below 1", fn,
                       P->c, P->ffn_dim);
    if (!G->ffn_x_k || !G->ffn_key_w || !G->ffn_value_w)
        return rx_fail(RX_EINVAL, "%s: G has a NULL grad", fn);
    int rc = rx_seq_check(fn, B, T, -1, NULL);
    if (rc != RX_OK) return rc;
    const size_t C = (size_t)P->c, F = (size_t)P->ffn_dim, BT = (size_t)B * T;
    rc = cm_spans_check(fn, P, G, B, T, x, x_prev_init, dy, dx, d_xprev_init);
    if (rc != RX_OK) return rc;
    /* the scratch apart from the activations: with dh = h and dxk = xk, as
     * here before, a threaded batch overwrote h and xk while their weight
     * grads still read them (wrong ffn_key_w and ffn_value_w grads) */
    float *xk = rx_falloc(BT * C), *h = rx_falloc(BT * F), *dh = rx_falloc(BT * F);
    float *dxk = rx_falloc(BT * C);
    if (!xk || !h || !dh || !dxk) {
        free(xk);
        free(h);
        free(dh);
        free(dxk);
        return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    }
    rc = rx_cm_forward_acts(P, x, x_prev_init, xk, h, NULL, (size_t)B, (size_t)T);
    if (rc == RX_OK)
        rc = rx_cm_backward_acts(P, x, x_prev_init, xk, h, dy, G, dx, d_xprev_init,
                                 (size_t)B, (size_t)T, dh, dxk);
    free(xk);
    free(h);
    free(dh);
    free(dxk);
    return rc;
}
