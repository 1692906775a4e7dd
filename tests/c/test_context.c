/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * test_context.c -- the model context (rx_model_ctx) through the C API,
 * under the sanitizers: the defaults, validation of every field by name,
 * rx_model_create as rx_model_create_ctx with the defaults (same weights,
 * same loss bits), rx_ptmodel_ctx and the L2Wrap setter reading it back,
 * and a model's own eps reaching the forward, the backward and recurrent
 * inference (other logits than the defaults', and inference equal to the
 * full forward). Returns nonzero on any failure.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rx_pretrain.h"
#include "check.h"

static const rx_pt_config CFG = {
    .n_embd = 16, .n_head = 2, .head_size = 8, .n_rwkv_layer = 2, .n_attn_layer = 1,
    .vocab_size = 19, .Dw = 4, .Da = 4, .Dg = 6, .Dv = 3, .ffn_dim = 24,
    .chunk_size = 4, .moba_top_k = 1,
};
#define SEQ 9

/* logits [SEQ][vocab] of the full forward and the loss of one backward */
static int run(rx_ptmodel *m, const int *tok, const int *tgt, float *logits, double *loss) {
    rx_pt_acts *a = NULL;
    int rc = rx_pt_acts_create(m, 1, SEQ, &a);
    if (rc == RX_OK) rc = rx_pretrain_forward(m, tok, SEQ, a);
    if (rc == RX_OK) memcpy(logits, a->logits, sizeof(float) * SEQ * CFG.vocab_size);
    if (rc == RX_OK) rc = rx_pretrain_backward_loss(m, a, tgt, 1, SEQ, -1, loss);
    rx_pt_acts_free(a);
    return rc;
}

static double max_diff(const float *x, const float *y, size_t n) {
    double d = 0.0;
    for (size_t i = 0; i < n; i++) d = fmax(d, fabs((double)x[i] - y[i]));
    return d;
}

int main(void) {
    rx_model_ctx ctx;
    rx_model_ctx_default(&ctx);
    CHECK(ctx.ln_eps == RX_DEFAULT_LN_EPS && ctx.gn_eps == RX_DEFAULT_GN_EPS &&
          ctx.ln0 == RX_DEFAULT_LN0 && ctx.l2wrap == RX_DEFAULT_L2WRAP, "defaults");
    CHECK((float)RX_DEFAULT_LN_EPS == RX_LN_EPS, "RX_LN_EPS is the default ln_eps");
    CHECK(rx_model_ctx_validate(&ctx) == RX_OK, "defaults rejected");
    CHECK(rx_model_ctx_validate(NULL) == RX_EINVAL, "NULL ctx");

    /* every field out of range, each refused by name */
    const char *names[] = {"ln_eps", "ln_eps", "gn_eps", "gn_eps", "ln0", "l2wrap"};
    for (int i = 0; i < 6; i++) {
        rx_model_ctx bad = ctx;
        switch (i) {
        case 0: bad.ln_eps = 0.0; break;
        case 1: bad.ln_eps = 1e-60; break;    /* 0 as a float */
        case 2: bad.gn_eps = -1.0; break;
        case 3: bad.gn_eps = NAN; break;
        case 4: bad.ln0 = 2; break;
        default: bad.l2wrap = INFINITY; break;
        }
        rx_ptmodel *m = NULL;
        CHECK(rx_model_ctx_validate(&bad) == RX_ECONFIG, "bad ctx %d validated", i);
        CHECK(strstr(rx_last_error(), names[i]) != NULL, "ctx %d: %s", i, rx_last_error());
        CHECK(rx_model_create_ctx(&CFG, &bad, 0, 1, &m) == RX_ECONFIG && m == NULL,
              "bad ctx %d built a model", i);
    }

    int tok[SEQ], tgt[SEQ];
    for (int t = 0; t < SEQ; t++) {
        tok[t] = (7 * t + 3) % CFG.vocab_size;
        tgt[t] = (5 * t + 1) % CFG.vocab_size;
    }
    const size_t NL = (size_t)SEQ * CFG.vocab_size;
    float *l_flags = malloc(NL * sizeof(float)), *l_ctx = malloc(NL * sizeof(float));
    float *l_eps = malloc(NL * sizeof(float)), *l_inf = malloc(NL * sizeof(float));
    double loss_flags = 0.0, loss_ctx = 0.0, loss_eps = 0.0;

    /* rx_model_create(pc, RX_PT_LN0) is rx_model_create_ctx with the defaults and ln0 */
    rx_ptmodel *a = NULL, *b = NULL, *c = NULL;
    ctx.ln0 = 1;
    CHECK(rx_model_create(&CFG, RX_PT_LN0, 5, &a) == RX_OK, "create");
    CHECK(rx_model_create_ctx(&CFG, &ctx, 0, 5, &b) == RX_OK, "create_ctx");
    rx_model_ctx got;
    CHECK(a && rx_ptmodel_ctx(a, &got) == RX_OK && got.ln0 == 1 &&
          got.ln_eps == RX_DEFAULT_LN_EPS && got.gn_eps == RX_DEFAULT_GN_EPS, "ctx of flags");
    CHECK(a && rx_ptmodel_flags(a) == RX_PT_LN0, "flags of a ctx model");
    CHECK(rx_ptmodel_ctx(NULL, &got) == RX_EINVAL && rx_ptmodel_ctx(a, NULL) == RX_EINVAL,
          "NULL arguments");
    CHECK(a && rx_ptmodel_set_l2wrap(a, 1e-4) == RX_OK && rx_ptmodel_ctx(a, &got) == RX_OK &&
          got.l2wrap == 1e-4 && rx_ptmodel_l2wrap(a) == 1e-4, "l2wrap in the ctx");
    CHECK(a && rx_ptmodel_set_l2wrap(a, 0.0) == RX_OK, "l2wrap off");
    if (a && b) {
        CHECK(run(a, tok, tgt, l_flags, &loss_flags) == RX_OK, "run flags");
        CHECK(run(b, tok, tgt, l_ctx, &loss_ctx) == RX_OK, "run ctx");
        CHECK(memcmp(l_flags, l_ctx, NL * sizeof(float)) == 0 && loss_flags == loss_ctx,
              "the same model: loss %.9g vs %.9g", loss_flags, loss_ctx);
    }

    /* other eps: other logits, and inference reads the same context */
    ctx.ln_eps = 0.25;
    ctx.gn_eps = 3.0;
    CHECK(rx_model_create_ctx(&CFG, &ctx, 0, 5, &c) == RX_OK, "create_ctx eps");
    rx_infer_state *s = NULL;
    if (c && rx_infer_create(c, SEQ, &s) == RX_OK) {
        CHECK(run(c, tok, tgt, l_eps, &loss_eps) == RX_OK, "run eps");
        for (int t = 0; t < SEQ; t++)
            CHECK(rx_infer_forward(s, tok + t, 1, l_inf + (size_t)t * CFG.vocab_size) == RX_OK,
                  "infer step %d", t);
        double scale = 0.0;
        for (size_t i = 0; i < NL; i++) scale = fmax(scale, fabs((double)l_eps[i]));
        CHECK(max_diff(l_inf, l_eps, NL) <= 1e-5 * scale, "inference vs forward: %g of %g",
              max_diff(l_inf, l_eps, NL), scale);
        CHECK(max_diff(l_eps, l_ctx, NL) > 1e-2 * scale, "the eps changed nothing: %g of %g",
              max_diff(l_eps, l_ctx, NL), scale);
        CHECK(isfinite(loss_eps) && loss_eps != loss_ctx, "loss %.9g", loss_eps);
    } else {
        CHECK(0, "infer_create");
    }
    rx_infer_free(s);
    rx_ptmodel_free(a);
    rx_ptmodel_free(b);
    rx_ptmodel_free(c);
    free(l_flags);
    free(l_ctx);
    free(l_eps);
    free(l_inf);
    if (failures) fprintf(stderr, "%d failures\n", failures);
    return failures != 0;
}
