/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * channelmix.c -- the RWKV-7 squared-ReLU FFN with its token shift (SPEC §4):
 *     xk  = x + (x_prev - x) * ffn_x_k
 *     out = relu(xk . ffn_key_w)^2 . ffn_value_w
 */
#include <string.h>

#include "rx_internal.h"

int rx_cm_params_ok(const rx_cm_params *P) {
    return P && P->c >= 1 && P->ffn_dim >= 1 && P->ffn_x_k && P->ffn_key_w && P->ffn_value_w;
}

/* x, out: [B][T][C]; x_prev_init: [B][C] or NULL */
int rx_channelmix_forward_seq(const rx_cm_params *P, const float *x, const float *x_prev_init,
                              float *out, int B, int T) {
    if (!rx_cm_params_ok(P) || B < 1 || T < 1 || !x || !out) return RX_EINVAL;
    const size_t C = (size_t)P->c, F = (size_t)P->ffn_dim, BT = (size_t)B * T;
    float *xk = rx_falloc(BT * C), *h = rx_falloc(BT * F);
    if (!xk || !h) {
        free(xk);
        free(h);
        return RX_ENOMEM;
    }
    rx_shift_lerp_forward(P->ffn_x_k, x, x_prev_init, xk, (size_t)B, (size_t)T, C);
    rx_sgemm(0, 0, BT, F, C, xk, C, P->ffn_key_w, F, 0.0f, h, F);
    for (size_t i = 0; i < BT * F; i++) {
        float r = h[i] > 0.0f ? h[i] : 0.0f;
        h[i] = r * r;
    }
    rx_sgemm(0, 0, BT, C, F, h, F, P->ffn_value_w, C, 0.0f, out, C);
    free(xk);
    free(h);
    return RX_OK;
}

/* x, dy, dx: [B][T][C]; x_prev_init, d_xprev_init: [B][C] or NULL */
int rx_channelmix_backward(const rx_cm_params *P, const float *x, const float *x_prev_init,
                           const float *dy, rx_cm_grads *G, float *dx, float *d_xprev_init,
                           int B, int T) {
    if (!rx_cm_params_ok(P) || B < 1 || T < 1 || !x || !dy || !G || !G->ffn_x_k || !G->ffn_key_w ||
        !G->ffn_value_w || !dx)
        return RX_EINVAL;
    const size_t C = (size_t)P->c, F = (size_t)P->ffn_dim, BT = (size_t)B * T;
    const size_t TT = (size_t)T;
    float *xk = rx_falloc(BT * C), *pre = rx_falloc(BT * F), *h = rx_falloc(BT * F);
    float *dxk = rx_falloc(BT * C);
    if (!xk || !pre || !h || !dxk) {
        free(xk);
        free(pre);
        free(h);
        free(dxk);
        return RX_ENOMEM;
    }
    /* recompute the forward up to the hidden activation */
    rx_shift_lerp_forward(P->ffn_x_k, x, x_prev_init, xk, (size_t)B, TT, C);
    rx_sgemm(0, 0, BT, F, C, xk, C, P->ffn_key_w, F, 0.0f, pre, F);
    for (size_t i = 0; i < BT * F; i++) {
        float r = pre[i] > 0.0f ? pre[i] : 0.0f;
        h[i] = r * r;
    }
    /* value projection: dWv = h^T dy, then h becomes d(h) = dy Wv^T */
    rx_sgemm(1, 0, F, C, BT, h, F, dy, C, 0.0f, G->ffn_value_w, C);
    rx_sgemm(0, 1, BT, F, C, dy, C, P->ffn_value_w, C, 0.0f, h, F);
    for (size_t i = 0; i < BT * F; i++) h[i] = pre[i] > 0.0f ? 2.0f * pre[i] * h[i] : 0.0f;
    /* key projection */
    rx_sgemm(1, 0, C, F, BT, xk, C, h, F, 0.0f, G->ffn_key_w, F);
    rx_sgemm(0, 1, BT, C, F, h, F, P->ffn_key_w, F, 0.0f, dxk, C);
    rx_fzero(G->ffn_x_k, C);
    rx_fzero(dx, BT * C);
    rx_fzero(d_xprev_init, (size_t)B * C);
    rx_shift_lerp_backward(P->ffn_x_k, x, x_prev_init, dxk, dx, G->ffn_x_k, d_xprev_init,
                           (size_t)B, TT, C);
    free(xk);
    free(pre);
    free(h);
    free(dxk);
    return RX_OK;
}
