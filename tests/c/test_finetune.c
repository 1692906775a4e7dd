/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * test_finetune.c -- fine-tuning through the C API, under the sanitizers:
 * trainable initial WKV states (enable, the grad written, acts made before
 * refused), frozen ranges (the same state grad with the whole base frozen,
 * a frozen head's grad left unwritten, bad ranges refused) and an
 * inference state starting from the states. Returns nonzero on any failure.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "rx_pretrain.h"
#include "check.h"

static const rx_pt_config CFG = {
    .n_embd = 15, .n_head = 3, .head_size = 5, .n_rwkv_layer = 2, .n_attn_layer = 1,
    .vocab_size = 19, .Dw = 4, .Da = 3, .Dg = 5, .Dv = 3, .ffn_dim = 21,
    .chunk_size = 4, .moba_top_k = 1,
};
enum { B = 2, T = 9 };

int main(void) {
    rx_ptmodel *m = NULL;
    CHECK(rx_model_create(&CFG, RX_PT_LN0, 7, &m) == RX_OK, "create: %s", rx_last_error());
    if (!m) return 1;
    int64_t n = -1;
    CHECK(rx_ptmodel_state_arena(m, &n) == NULL && n == 0, "a state before enabling");
    rx_pt_acts *early = NULL;
    CHECK(rx_pt_acts_create(m, B, T, &early) == RX_OK, "acts");
    CHECK(rx_ptmodel_enable_state(m) == RX_OK && rx_ptmodel_enable_state(m) == RX_OK,
          "enable twice");
    float *s = rx_ptmodel_state_arena(m, &n), *gs = rx_ptmodel_state_grad_arena(m, NULL);
    CHECK(s && gs && n == 2 * 3 * 5 * 5, "state arena of %lld", (long long)n);
    for (int64_t e = 0; e < n; e++) s[e] = (float)((e * 37 % 11) - 5) * 0.1f;
    int tok[B * T], tgt[B * T];
    for (int i = 0; i < B * T; i++) tok[i] = i * 7 % 19, tgt[i] = i * 5 % 19;
    CHECK(rx_pretrain_forward_batch(m, tok, B, T, early) == RX_EINVAL, "acts made before");
    rx_pt_acts_free(early);
    rx_pt_acts *a = NULL;
    CHECK(rx_pt_acts_create(m, B, T, &a) == RX_OK, "acts");
    double l1, l2;
    CHECK(rx_pretrain_forward_batch(m, tok, B, T, a) == RX_OK, "forward: %s", rx_last_error());
    CHECK(rx_pretrain_backward_loss(m, a, tgt, B, T, -1, &l1) == RX_OK, "backward");
    static float g1[2 * 3 * 5 * 5];
    memcpy(g1, gs, sizeof g1);
    float nz = 0;
    for (int64_t e = 0; e < n; e++) nz += g1[e] != 0.0f;
    CHECK(nz > 0, "the state grad is zero");
    int64_t ne;
    float *g = rx_ptmodel_grad_arena(m, &ne);
    CHECK(rx_ptmodel_set_frozen(m, 1) == RX_OK && rx_ptmodel_frozen(m) == 1, "freeze all");
    for (int64_t e = 0; e < ne; e++) g[e] = 5.0f;
    CHECK(rx_pretrain_backward_loss(m, a, tgt, B, T, -1, &l2) == RX_OK && l2 == l1, "frozen");
    CHECK(memcmp(g1, gs, sizeof g1) == 0, "the frozen state grad differs");
    CHECK(g[ne - 1] == 5.0f, "a frozen head's grad was written");
    const int64_t bad[2][2] = {{0, ne + 1}, {4, 4}};
    for (int i = 0; i < 2; i++)
        CHECK(rx_ptmodel_set_frozen_ranges(m, bad[i], 1) == RX_EINVAL, "bad range %d", i);
    CHECK(rx_ptmodel_set_frozen_ranges(NULL, bad[0], 1) == RX_EINVAL, "NULL model");
    CHECK(rx_ptmodel_set_frozen(m, 0) == RX_OK && rx_ptmodel_frozen(m) == 0, "unfreeze");
    rx_infer_state *inf = NULL;
    float lg[T * 19];
    CHECK(rx_infer_create(m, T, &inf) == RX_OK, "infer");
    CHECK(rx_infer_forward(inf, tok, T, lg) == RX_OK, "infer forward");
    float d = 0;
    for (int i = 0; i < T * 19; i++) {
        float e = lg[i] - a->logits[i];
        d = e > d ? e : -e > d ? -e : d;
    }
    CHECK(d < 1e-4f, "inference from the states differs from the forward by %g", d);
    rx_infer_free(inf);
    rx_pt_acts_free(a);
    rx_ptmodel_free(m);
    if (failures) fprintf(stderr, "%d failure(s)\n", failures);
    return failures != 0;
}
