/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * test_base.c -- the frozen base (csrc/base.c) through the C API, under the
 * sanitizers: bad requests refused, a forward before the base is filled
 * refused, the bf16 and Q8_0 stores (the block projections and the
 * embedding, whose rows are gathered) decoding to what was put in (within
 * bf16 rounding; Q8_0 within half a step of its scale and the scale's own
 * fp16 rounding), a base model's loss and initial-state grads equal to the
 * float32 model of the decoded weights under recompute and the chunked
 * head (and at bf16 precision, the bf16 base then held in the GEMM's packed
 * layout, the Q8_0 one decoded into it), inference refused while a base is
 * held, and the release to float32.
 * Returns nonzero on any failure.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rx_pretrain.h"
#include "check.h"
#include "projections.h"

static const rx_pt_config CFG = {
    .n_embd = 64, .n_head = 2, .head_size = 32, .n_rwkv_layer = 2, .n_attn_layer = 1,
    .vocab_size = 19, .Dw = 8, .Da = 8, .Dg = 8, .Dv = 8, .ffn_dim = 96,
    .chunk_size = 4, .moba_top_k = 3,
};
enum { B = 2, T = 9, MAXP = 64 };

/* m's block projections into a base of dtype, filled from src's values;
 * the decoded weights written into ref's arena; both frozen */
static void make_pair(rx_ptmodel *src, rx_ptmodel *m, rx_ptmodel *ref, int dtype, int *idx,
                      int n) {
    int64_t np;
    rx_ptmodel_param_arena(m, &np);
    memcpy(rx_ptmodel_param_arena(m, NULL), rx_ptmodel_param_arena(src, NULL),
           (size_t)np * sizeof(float));
    memcpy(rx_ptmodel_param_arena(ref, NULL), rx_ptmodel_param_arena(src, NULL),
           (size_t)np * sizeof(float));
    CHECK(rx_ptmodel_set_base(m, dtype, idx, n) == RX_OK, "set_base: %s", rx_last_error());
    for (int i = 0; i < n; i++) {
        float *w, *r;
        int cnt;
        rx_ptmodel_param(src, idx[i], NULL, &w, NULL, &cnt);
        rx_ptmodel_param(ref, idx[i], NULL, &r, NULL, NULL);
        CHECK(rx_ptmodel_base_fill(m, idx[i], w, RX_BASE_FP32, 0) == RX_OK, "fill");
        CHECK(rx_ptmodel_base_read(m, idx[i], r) == RX_OK, "read");
        double worst = 0.0, amax = 0.0;
        for (int e = 0; e < cnt; e++) {
            worst = fmax(worst, fabs((double)r[e] - w[e]));
            amax = fmax(amax, fabs(w[e]));
        }
        /* bf16: half an ulp of 8 bits; Q8_0: half a step of amax / 127, plus
         * the scale's fp16 rounding (2^-11 relative) over 127 steps */
        const double bound = dtype == RX_BASE_BF16 ? amax * 0x1p-8
                                                   : amax * (1.0 / 254.0 + 0x1p-11) * 1.01;
        CHECK(worst <= bound, "tensor %d decodes %g from its value (bound %g)", idx[i], worst,
              bound);
    }
    CHECK(rx_ptmodel_set_frozen(m, 1) == RX_OK && rx_ptmodel_set_frozen(ref, 1) == RX_OK,
          "freeze");
    CHECK(rx_ptmodel_enable_state(m) == RX_OK && rx_ptmodel_enable_state(ref) == RX_OK, "state");
}

int main(void) {
    int tok[B * T], tgt[B * T], idx[MAXP];
    for (int i = 0; i < B * T; i++) tok[i] = (5 * i + 2) % CFG.vocab_size;
    for (int i = 0; i < B * T; i++) tgt[i] = (3 * i + 1) % CFG.vocab_size;
    rx_ptmodel *src = NULL;
    CHECK(rx_model_create(&CFG, RX_PT_LN0, 7, &src) == RX_OK, "create: %s", rx_last_error());
    /* the embedding (tensor 0) and every block projection */
    idx[0] = 0;
    const int n = 1 + block_projections(src, idx + 1, MAXP - 1);

    /* refusals */
    rx_ptmodel *m = NULL;
    CHECK(rx_model_create(&CFG, RX_PT_LN0 | RX_PT_NO_INIT, 0, &m) == RX_OK, "create lazy");
    const int ln0_w = 1, twice[2] = {idx[0], idx[0]};
    CHECK(rx_ptmodel_set_base(m, RX_BASE_BF16, &ln0_w, 1) == RX_EINVAL, "a vector refused");
    CHECK(rx_ptmodel_set_base(m, 7, idx, n) == RX_EINVAL, "dtype refused");
    CHECK(rx_ptmodel_set_base(m, RX_BASE_BF16, twice, 2) == RX_EINVAL, "twice refused");
    CHECK(rx_ptmodel_set_base(m, RX_BASE_BF16, idx, 0) == RX_EINVAL, "none refused");
    CHECK(rx_ptmodel_base_fill(m, idx[0], tok, RX_BASE_FP32, 0) == RX_EINVAL, "no base");
    CHECK(rx_ptmodel_set_base(m, RX_BASE_Q8_0, idx, n) == RX_OK, "set: %s", rx_last_error());
    CHECK(rx_ptmodel_set_base(m, RX_BASE_Q8_0, idx, n) == RX_EINVAL, "a second base");
    rx_pt_acts *a = NULL;
    CHECK(rx_pt_acts_create(m, B, T, &a) == RX_OK, "acts");
    CHECK(rx_pretrain_forward_batch(m, tok, B, T, a) == RX_EINVAL &&
              strstr(rx_last_error(), "not filled"), "forward before the fill");
    rx_pt_acts_free(a);
    rx_ptmodel_free(m);

    /* bf16 rows, Q8_0, bf16 in the bf16 GEMM's packed layout (a base set
     * at bf16 precision), and Q8_0 at bf16 precision (its blocks decoded
     * straight into the bf16 GEMM's layout) */
    for (int v = 0; v < 4; v++) {
        const int dtype = v % 2 ? RX_BASE_Q8_0 : RX_BASE_BF16;
        rx_ptmodel *ref = NULL;
        m = NULL;
        CHECK(rx_model_create(&CFG, RX_PT_LN0 | RX_PT_NO_INIT, 0, &m) == RX_OK, "create");
        CHECK(rx_model_create(&CFG, RX_PT_LN0, 0, &ref) == RX_OK, "create ref");
        if (v >= 2)
            CHECK(rx_ptmodel_set_precision(m, RX_PRECISION_BF16) == RX_OK &&
                      rx_ptmodel_set_precision(ref, RX_PRECISION_BF16) == RX_OK, "bf16");
        make_pair(src, m, ref, dtype, idx, n);
        int dt, cnt;
        int64_t bytes;
        rx_ptmodel_base_info(m, &dt, &cnt, &bytes);
        CHECK(dt == dtype && cnt == n && bytes > 0, "info %d %d %lld", dt, cnt, (long long)bytes);
        int64_t ns;
        for (int flags = 0; flags <= 3; flags += 3) {
            const double want = train_step(ref, B, T, flags, tok, tgt);
            const float *gref = rx_ptmodel_state_grad_arena(ref, &ns);
            float *keep = malloc((size_t)ns * sizeof(float));
            memcpy(keep, gref, (size_t)ns * sizeof(float));
            CHECK(train_step(m, B, T, flags, tok, tgt) == want,
                  "dtype %d flags %d: the float32 loss", dtype, flags);
            CHECK(!memcmp(rx_ptmodel_state_grad_arena(m, NULL), keep, (size_t)ns * sizeof(float)),
                  "dtype %d flags %d: the state grads", dtype, flags);
            free(keep);
        }
        rx_infer_state *s = NULL;
        CHECK(rx_infer_create(m, 8, &s) == RX_EINVAL, "inference refused with a base");
        CHECK(rx_ptmodel_base_release(m) == RX_OK, "release");
        rx_ptmodel_base_info(m, &dt, &cnt, &bytes);
        CHECK(dt == RX_BASE_NONE && cnt == 0 && bytes == 0, "released");
        for (int i = 0; i < n; i++) {
            float *w, *r;
            int c;
            rx_ptmodel_param(m, idx[i], NULL, &w, NULL, &c);
            rx_ptmodel_param(ref, idx[i], NULL, &r, NULL, NULL);
            CHECK(!memcmp(w, r, (size_t)c * sizeof(float)), "released tensor %d", idx[i]);
        }
        CHECK(rx_infer_create(m, 8, &s) == RX_OK, "inference after the release");
        rx_infer_free(s);
        rx_ptmodel_free(m);
        rx_ptmodel_free(ref);
    }
    rx_ptmodel_free(src);
    if (failures) fprintf(stderr, "%d failures\n", failures);
    return failures != 0;
}
