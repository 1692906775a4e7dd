/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * test_recompute.c -- activation recompute and the chunked head through the
 * C API, under the sanitizers: acts with RX_ACTS_RECOMPUTE and
 * RX_ACTS_CHUNKED_HEAD give the plain acts' loss and grads bit for bit
 * with L2Wrap on, twice per forward, and 7-row chunks, which cut the row
 * blocks, the same loss;
 * rx_pretrain_loss equals the backward's loss; bad flags and rows are
 * refused. Row groups (rx_pt_acts_create_groups) of a LoRA tune give the
 * whole batch's loss and adapter grads bit for bit; groups that would
 * change a grad, or that the acts cannot hold, are refused. Returns
 * nonzero on any failure.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rx_pretrain.h"
#include "check.h"
#include "projections.h"

static const rx_pt_config CFG = {
    .n_embd = 16, .n_head = 2, .head_size = 8, .n_rwkv_layer = 3, .n_attn_layer = 1,
    .vocab_size = 23, .Dw = 4, .Da = 4, .Dg = 6, .Dv = 3, .ffn_dim = 24,
    .chunk_size = 4, .moba_top_k = 1,
};
#define B 2
#define T 11

/* loss and a copy of the grads of one forward and two backwards */
static int run(rx_ptmodel *m, int flags, int rows, const int *tok, const int *tgt, double *loss,
               float *grads, size_t n) {
    rx_pt_acts *acts = NULL;
    double again = 0.0, eval = 0.0;
    int rc = rx_pt_acts_create_opts(m, B, T, flags, rows, &acts);
    if (rc == RX_OK) rc = rx_pretrain_forward_batch(m, tok, B, T, acts);
    if (rc == RX_OK) rc = rx_pretrain_backward_loss(m, acts, tgt, B, T, 5, loss);
    if (rc == RX_OK) rc = rx_pretrain_backward_loss(m, acts, tgt, B, T, 5, &again);
    if (rc == RX_OK) rc = rx_pretrain_loss(m, acts, tgt, B, T, 5, &eval);
    CHECK(rc != RX_OK || (again == *loss && eval == *loss), "flags %d: repeated loss differs",
          flags);
    if (rc == RX_OK) memcpy(grads, rx_ptmodel_grad_arena(m, NULL), n * sizeof(float));
    rx_pt_acts_free(acts);
    return rc;
}

/* RWKV blocks only (an attention block runs the whole batch) and 64-token
 * sequences: groups of 4 make 256 rows, one k range of the GEMMs */
#define GB 8
#define GT 64

/* loss and adapter grads of a LoRA tune's step (forward, backward) in
 * groups of group sequences */
static int group_step(rx_ptmodel *m, int group, const int *tok, double *loss, float *grads,
                      size_t n) {
    rx_pt_acts *acts = NULL;
    int rc = rx_pt_acts_create_groups(m, GB, GT, RX_ACTS_RECOMPUTE | RX_ACTS_CHUNKED_HEAD, 0,
                                      group, &acts);
    if (rc == RX_OK) rc = rx_pretrain_forward_batch(m, tok, GB, GT, acts);
    if (rc == RX_OK) rc = rx_pretrain_backward_loss(m, acts, tok, GB, GT, 5, loss);
    if (rc == RX_OK) memcpy(grads, rx_ptmodel_lora_grad_arena(m, NULL), n * sizeof(float));
    rx_pt_acts_free(acts);
    return rc;
}

static void test_row_groups(rx_ptmodel *with_attn) {
    rx_pt_config cfg = CFG;
    cfg.n_attn_layer = 0;
    rx_ptmodel *m = NULL;
    int idx[16], tok[GB * GT];
    for (int i = 0; i < GB * GT; i++) tok[i] = (11 * i + 2) % CFG.vocab_size;
    int rc = rx_model_create(&cfg, RX_PT_LN0, 3, &m);
    if (rc == RX_OK) rc = rx_ptmodel_enable_lora(m, 2, 4.0, idx, block_projections(m, idx, 16));
    int64_t n = 0;
    float *a = rc == RX_OK ? rx_ptmodel_lora_arena(m, &n) : NULL;
    for (int64_t i = 0; i < n; i++) a[i] = (float)((i * 37) % 11 - 5) * 0.05f;
    if (rc == RX_OK) rc = rx_ptmodel_set_frozen(m, 1);
    float *g0 = malloc((size_t)n * sizeof(float)), *g1 = malloc((size_t)n * sizeof(float));
    CHECK(rc == RX_OK && g0 && g1 && rx_ptmodel_groups_exact(m) == 1, "row groups set-up: %s",
          rx_last_error());
    double l0 = 0.0, l1 = 0.0;
    if (rc == RX_OK && g0 && g1) {
        CHECK(group_step(m, GB, tok, &l0, g0, (size_t)n) == RX_OK, "whole: %s", rx_last_error());
        /* 4 sequences are whole k ranges: every bit; 2 and 1 cut a range,
         * whose grads then differ by rounding, and keep the loss */
        for (int group = 4; group >= 1; group /= 2) {
            CHECK(group_step(m, group, tok, &l1, g1, (size_t)n) == RX_OK, "group %d: %s", group,
                  rx_last_error());
            CHECK(l1 == l0, "group %d: loss %.17g != %.17g", group, l1, l0);
            CHECK(group < 4 || !memcmp(g0, g1, (size_t)n * sizeof(float)),
                  "group %d: grads differ", group);
        }
        /* a trainable parameter beside the adapters: its grad would come group by group */
        rx_ptmodel_set_frozen(m, 0);
        CHECK(rx_ptmodel_groups_exact(m) == 0, "an unfrozen model called exact");
        CHECK(group_step(m, 4, tok, &l1, g1, (size_t)n) == RX_EINVAL, "an unfrozen model's "
              "backward in groups accepted");
    }
    rx_pt_acts *acts = NULL;
    CHECK(rx_pt_acts_create_groups(m, GB, GT, RX_ACTS_RECOMPUTE, 0, 3, &acts) == RX_EINVAL &&
          !acts, "group 3 of 8 accepted");
    CHECK(rx_pt_acts_create_groups(m, GB, GT, 0, 0, 4, &acts) == RX_EINVAL && !acts,
          "groups without recompute accepted");
    CHECK(rx_pt_acts_create_groups(with_attn, GB, GT, RX_ACTS_RECOMPUTE, 0, 4, &acts) ==
          RX_EINVAL && !acts, "groups of a model with attention blocks accepted");
    free(g0);
    free(g1);
    rx_ptmodel_free(m);
}

int main(void) {
    rx_ptmodel *m = NULL;
    int tok[B * T], tgt[B * T];
    for (int i = 0; i < B * T; i++) tok[i] = (7 * i + 3) % CFG.vocab_size;
    for (int i = 0; i < B * T; i++) tgt[i] = (5 * i + 1) % CFG.vocab_size;
    int rc = rx_model_create(&CFG, RX_PT_LN0, 1, &m);
    if (rc == RX_OK) rc = rx_ptmodel_set_l2wrap(m, 0.01);
    int64_t n = 0;
    rx_ptmodel_grad_arena(m, &n);
    float *g0 = malloc((size_t)n * sizeof(float)), *g1 = malloc((size_t)n * sizeof(float));
    if (rc != RX_OK || !g0 || !g1) {
        fprintf(stderr, "set-up failed: %s\n", rx_last_error());
        return 2;
    }
    double l0 = 0.0, l1 = 0.0;
    CHECK(run(m, 0, 0, tok, tgt, &l0, g0, (size_t)n) == RX_OK, "plain: %s", rx_last_error());
    const int flags[3] = {RX_ACTS_RECOMPUTE, RX_ACTS_CHUNKED_HEAD,
                          RX_ACTS_RECOMPUTE | RX_ACTS_CHUNKED_HEAD};
    for (int f = 0; f < 3; f++) {
        /* the default rows (all 22 here): d_head's sum keeps its order too */
        CHECK(run(m, flags[f], 0, tok, tgt, &l1, g1, (size_t)n) == RX_OK, "flags %d: %s",
              flags[f], rx_last_error());
        CHECK(l1 == l0, "flags %d: loss %.17g != %.17g", flags[f], l1, l0);
        CHECK(!memcmp(g0, g1, (size_t)n * sizeof(float)), "flags %d: grads differ", flags[f]);
    }
    /* 7-row chunks cut the 8-row blocks: the loss keeps its bits (d_head
     * sums in chunk order: rounding only, tests/test_recompute.py) */
    CHECK(run(m, RX_ACTS_CHUNKED_HEAD, 7, tok, tgt, &l1, g1, (size_t)n) == RX_OK, "rows 7: %s",
          rx_last_error());
    CHECK(l1 == l0, "rows 7: loss %.17g != %.17g", l1, l0);
    rx_pt_acts *acts = NULL;
    CHECK(rx_pt_acts_create_opts(m, B, T, 8, 0, &acts) == RX_EINVAL && !acts, "flag 8 accepted");
    CHECK(rx_pt_acts_create_opts(m, B, T, 0, -1, &acts) == RX_EINVAL && !acts, "rows -1 accepted");
    CHECK(rx_ptmodel_set_l2wrap(m, -1.0) == RX_EINVAL, "a negative l2wrap accepted");
    test_row_groups(m);
    free(g0);
    free(g1);
    rx_ptmodel_free(m);
    return failures != 0;
}
