/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * block.c -- the RWKV-7 residual block (SPEC §6):
 *     h1 = ln1(x); x1 = x + TM(h1); h2 = ln2(x1); out = x1 + CM(h2)
 * The time-mix carry is over h1, the channel-mix carry over h2. The
 * backward recomputes the forward with the time-mix intermediates kept
 * (rx_tm_acts), so the time-mix forward runs once per backward.
 */
#include "rx_internal.h"

/* dst[i] = a[i] + b[i] (dst may alias a or b) */
static void add_rows(float *dst, const float *a, const float *b, size_t n) {
#pragma omp parallel for schedule(static) if (!rx_in_parallel() && n >= 65536)
    for (size_t i = 0; i < n; i++) dst[i] = a[i] + b[i];
}

static int block_params_ok(const rx_block_params *P, int B, int T) {
    return P && B >= 1 && T >= 1 && rx_tm_params_ok(&P->tm) && rx_cm_params_ok(&P->cm) &&
           P->cm.c == P->tm.c && P->ln1_w && P->ln1_b && P->ln2_w && P->ln2_b;
}

/* x, out, v_first: [B][T][C]; tm_xprev_init, cm_xprev_init: [B][C] or NULL */
int rx_block_forward_seq(const rx_block_params *P, const float *x,
                         const float *tm_xprev_init, const float *cm_xprev_init,
                         float *v_first, float *out, int B, int T) {
    if (!block_params_ok(P, B, T) || !x || !out) return RX_EINVAL;
    const int vres = P->tm.layer_id > 0;
    if (vres && !v_first) return RX_EINVAL;
    const size_t BT = (size_t)B * T, C = (size_t)P->tm.c;
    rx_tm_acts A;
    float *h = rx_falloc(BT * C), *t = rx_falloc(BT * C);
    int rc = rx_tm_acts_alloc(&A, &P->tm, (size_t)B, (size_t)T);
    if (rc == RX_OK && (!h || !t)) rc = RX_ENOMEM;
    if (rc == RX_OK) {
        rx_rownorm_forward(x, P->ln1_w, P->ln1_b, h, NULL, NULL, BT, C, 1, RX_LN_EPS);
        rc = rx_tm_forward_acts(&P->tm, h, tm_xprev_init, vres ? v_first : NULL,
                                vres ? NULL : v_first, &A, t);
    }
    if (rc == RX_OK) {
        add_rows(out, x, t, BT * C);
        rx_rownorm_forward(out, P->ln2_w, P->ln2_b, h, NULL, NULL, BT, C, 1, RX_LN_EPS);
        rc = rx_channelmix_forward_seq(&P->cm, h, cm_xprev_init, t, B, T);
    }
    if (rc == RX_OK) add_rows(out, out, t, BT * C);
    rx_tm_acts_free(&A);
    free(h);
    free(t);
    return rc;
}

/* x, dy, dx, v_first, d_v_first: [B][T][C]; carries and their grads: [B][C] */
int rx_block_backward(const rx_block_params *P, const float *x,
                      const float *tm_xprev_init, const float *cm_xprev_init,
                      const float *v_first, const float *dy, rx_block_grads *G, float *dx,
                      float *d_tm_xprev_init, float *d_cm_xprev_init, float *d_v_first,
                      int B, int T) {
    if (!block_params_ok(P, B, T) || !G || !rx_tm_grads_ok(&P->tm, &G->tm) || !G->cm.ffn_x_k ||
        !G->cm.ffn_key_w || !G->cm.ffn_value_w || !G->ln1_w || !G->ln1_b || !G->ln2_w ||
        !G->ln2_b || !x || !dy || !dx)
        return RX_EINVAL;
    const int vres = P->tm.layer_id > 0;
    if (vres && !v_first) return RX_EINVAL;
    const size_t BT = (size_t)B * T, C = (size_t)P->tm.c;
    rx_tm_acts A;
    float *mem = rx_falloc(5 * BT * C);
    int rc = rx_tm_acts_alloc(&A, &P->tm, (size_t)B, (size_t)T);
    if (rc == RX_OK && !mem) rc = RX_ENOMEM;
    if (rc != RX_OK) {
        rx_tm_acts_free(&A);
        free(mem);
        return rc;
    }
    float *h1 = mem, *x1 = h1 + BT * C, *h2 = x1 + BT * C, *t = h2 + BT * C, *dx1 = t + BT * C;
    const float *vf_in = vres ? v_first : NULL;

    /* recompute the forward up to h2, keeping the time-mix intermediates */
    rx_rownorm_forward(x, P->ln1_w, P->ln1_b, h1, NULL, NULL, BT, C, 1, RX_LN_EPS);
    rc = rx_tm_forward_acts(&P->tm, h1, tm_xprev_init, vf_in, NULL, &A, t);
    if (rc == RX_OK) {
        add_rows(x1, x, t, BT * C);
        rx_rownorm_forward(x1, P->ln2_w, P->ln2_b, h2, NULL, NULL, BT, C, 1, RX_LN_EPS);
        /* out = x1 + CM(ln2(x1)) */
        rc = rx_channelmix_backward(&P->cm, h2, cm_xprev_init, dy, &G->cm, t, d_cm_xprev_init,
                                    B, T);
    }
    if (rc == RX_OK)
        rc = rx_layernorm_backward(x1, P->ln2_w, P->ln2_b, t, dx1, G->ln2_w, G->ln2_b, B, T,
                                   (int)C);
    if (rc == RX_OK) {
        add_rows(dx1, dx1, dy, BT * C);
        /* x1 = x + TM(ln1(x)) */
        rc = rx_tm_backward_acts(&P->tm, &A, h1, tm_xprev_init, vf_in, dx1, &G->tm, t,
                                 d_tm_xprev_init, d_v_first);
    }
    if (rc == RX_OK)
        rc = rx_layernorm_backward(x, P->ln1_w, P->ln1_b, t, dx, G->ln1_w, G->ln1_b, B, T,
                                   (int)C);
    if (rc == RX_OK) add_rows(dx, dx, dx1, BT * C);
    rx_tm_acts_free(&A);
    free(mem);
    return rc;
}
