/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * test_lora.c -- LoRA adapters through the C API, under the sanitizers:
 * bad arguments refused, the arenas laid out as docs/layout.md says, B = 0
 * the base model bit for bit, adapter grads written with the base frozen
 * (its grads untouched) and equal under recompute and the chunked head, an
 * inference state refused while adapters are on, disabling them, and
 * enabling the same ones again (only those).
 * Returns nonzero on any failure.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "rx_pretrain.h"
#include "check.h"
#include "projections.h"

static const rx_pt_config CFG = {
    .n_embd = 15, .n_head = 3, .head_size = 5, .n_rwkv_layer = 2, .n_attn_layer = 1,
    .vocab_size = 19, .Dw = 4, .Da = 3, .Dg = 5, .Dv = 3, .ffn_dim = 21,
    .chunk_size = 4, .moba_top_k = 1,
};
enum { B = 2, T = 9, R = 3, MAXP = 64 };

int main(void) {
    rx_ptmodel *m = NULL;
    CHECK(rx_model_create(&CFG, RX_PT_LN0, 7, &m) == RX_OK, "create: %s", rx_last_error());
    if (!m) return 1;
    int idx[MAXP], tok[B * T], tgt[B * T];
    const int np = block_projections(m, idx, MAXP);
    CHECK(np == 2 * 6 + 6, "%d projections", np);
    for (int i = 0; i < B * T; i++) tok[i] = i * 7 % 19, tgt[i] = i * 5 % 19;
    int w1 = -1;
    for (int i = 0; i < rx_ptmodel_num_params(m); i++) {
        const char *name;
        rx_ptmodel_param(m, i, &name, NULL, NULL, NULL);
        if (strcmp(name, "blocks.0.tm.w1") == 0) w1 = i;
    }
    CHECK(rx_ptmodel_enable_lora(m, 0, 1.0, idx, np) == RX_EINVAL, "r = 0");
    CHECK(rx_ptmodel_enable_lora(m, R, -1.0, idx, np) == RX_EINVAL, "alpha < 0");
    CHECK(rx_ptmodel_enable_lora(m, R, 1.0, &w1, 1) == RX_EINVAL, "w1 is no projection");
    CHECK(rx_ptmodel_enable_lora(NULL, R, 1.0, idx, np) == RX_EINVAL, "NULL model");
    CHECK(rx_ptmodel_lora_count(m, NULL, NULL) == 0, "no adapters yet");

    const double l0 = train_step(m, B, T, 0, tok, tgt);
    CHECK(rx_ptmodel_enable_lora(m, R, 5.0, idx, np) == RX_OK, "enable: %s", rx_last_error());
    CHECK(rx_ptmodel_enable_lora(m, R, 5.0, idx, np) == RX_EINVAL, "enable twice");
    int r = 0;
    double alpha = 0.0;
    CHECK(rx_ptmodel_lora_count(m, &r, &alpha) == np && r == R && alpha == 5.0, "count");
    int64_t n = 0, a_off, b_off;
    float *A = rx_ptmodel_lora_arena(m, &n), *G = rx_ptmodel_lora_grad_arena(m, NULL);
    int p0;
    CHECK(rx_ptmodel_lora_adapter(m, 0, &p0, &a_off, &b_off) == RX_OK && p0 == idx[0] &&
          a_off == 0 && b_off == R * 15, "adapter 0 at %lld, %lld", (long long)a_off,
          (long long)b_off);
    CHECK(rx_ptmodel_lora_adapter(m, np, NULL, NULL, NULL) == RX_EINVAL, "index out of range");
    CHECK(train_step(m, B, T, 0, tok, tgt) == l0, "B = 0 changes the loss");
    for (int64_t e = 0; e < n; e++) A[e] = (float)((e * 37 % 11) - 5) * 0.05f;
    CHECK(rx_ptmodel_set_frozen(m, 1) == RX_OK, "freeze");
    int64_t ng = 0;
    float *g = rx_ptmodel_grad_arena(m, &ng);
    for (int64_t e = 0; e < ng; e++) g[e] = 123.0f;
    const double l1 = train_step(m, B, T, 0, tok, tgt);
    CHECK(l1 != l0, "the adapters change nothing");
    int untouched = 1;
    for (int i = 0; i < np; i++) {
        float *gw;
        int cnt;
        rx_ptmodel_param(m, idx[i], NULL, NULL, &gw, &cnt);
        for (int e = 0; e < cnt; e++) untouched &= gw[e] == 123.0f;
    }
    CHECK(untouched, "a frozen projection's grad was written");
    static float g1[8192];
    CHECK(n <= 8192, "arena of %lld", (long long)n);
    memcpy(g1, G, (size_t)n * sizeof(float));
    int nz = 0;
    for (int64_t e = 0; e < n; e++) nz += g1[e] != 0.0f;
    CHECK(nz > n / 2, "%d of %lld adapter grads nonzero", nz, (long long)n);
    /* recompute (1) and the chunked head (2): the same bits */
    CHECK(train_step(m, B, T, 3, tok, tgt) == l1 &&
              memcmp(g1, G, (size_t)n * sizeof(float)) == 0,
          "recompute and the chunked head change the adapter grads");
    rx_infer_state *s = NULL;
    CHECK(rx_infer_create(m, 8, &s) == RX_EINVAL && !s, "inference with adapters on");
    CHECK(rx_ptmodel_disable_lora(m) == RX_OK && rx_ptmodel_lora_count(m, NULL, NULL) == 0,
          "disable");
    CHECK(train_step(m, B, T, 0, tok, tgt) == l0, "disabled adapters still act");
    CHECK(rx_infer_create(m, 8, &s) == RX_OK, "inference: %s", rx_last_error());
    rx_infer_free(s);
    /* the same adapters come back with their values; others are refused */
    CHECK(rx_ptmodel_enable_lora(m, R, 5.0, idx, np - 1) == RX_EINVAL, "fewer adapters back");
    CHECK(rx_ptmodel_enable_lora(m, R, 4.0, idx, np) == RX_EINVAL, "another alpha back");
    CHECK(rx_ptmodel_enable_lora(m, R, 5.0, idx, np) == RX_OK, "re-enable: %s", rx_last_error());
    CHECK(rx_ptmodel_lora_count(m, NULL, NULL) == np &&
              train_step(m, B, T, 0, tok, tgt) == l1,
          "the re-enabled adapters act as before");
    rx_ptmodel_free(m);
    if (failures) fprintf(stderr, "%d failures\n", failures);
    return failures != 0;
}
