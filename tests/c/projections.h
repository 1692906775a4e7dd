/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * projections.h -- the tensor indices of a model's block projections
 * (receptance_w, key_w, value_w, output_w: the time-mix's and channel-mix's
 * key and value, the attention blocks' q/k/v/o), by their docs/layout.md
 * names: the targets the C programs put LoRA adapters on, or hold in a
 * frozen base; and one training step of such a model.
 */
#ifndef RX_TEST_PROJECTIONS_H
#define RX_TEST_PROJECTIONS_H

#include <string.h>

#include "rx_pretrain.h"
#include "check.h"

/* indices of m's block projections into idx [max]; returns the count */
static int block_projections(rx_ptmodel *m, int *idx, int max) {
    static const char *const ends[] = {"receptance_w", "key_w", "value_w", "output_w"};
    int n = 0;
    for (int i = 0; i < rx_ptmodel_num_params(m) && n < max; i++) {
        const char *name;
        rx_ptmodel_param(m, i, &name, NULL, NULL, NULL);
        const size_t len = strlen(name);
        for (int e = 0; e < 4 && n < max; e++) {
            const size_t k = strlen(ends[e]);
            if (len > k && strcmp(name + len - k, ends[e]) == 0) idx[n++] = i;
        }
    }
    return n;
}

/* forward + backward of B x T tokens with acts of RX_ACTS_* flags (any:
 * a chunked head of 5 rows); the loss */
static inline double train_step(rx_ptmodel *m, int B, int T, int flags, const int *tok,
                                 const int *tgt) {
    rx_pt_acts *a = NULL;
    double loss = -1.0;
    CHECK(rx_pt_acts_create_opts(m, B, T, flags, flags ? 5 : 0, &a) == RX_OK, "acts");
    CHECK(rx_pretrain_forward_batch(m, tok, B, T, a) == RX_OK, "forward: %s", rx_last_error());
    CHECK(rx_pretrain_backward_loss(m, a, tgt, B, T, -1, &loss) == RX_OK, "backward: %s",
          rx_last_error());
    rx_pt_acts_free(a);
    return loss;
}

#endif
