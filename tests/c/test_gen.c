/* Sanitizer test of csrc/gen.c: three sequences of a hybrid model (MoBA
 * selection active) and of a pure RWKV one advanced together by
 * rx_gen_step -- prompts joining while others decode -- against each
 * sequence alone in a one-slot state (bit for bit) and the training
 * forward (rx_pretrain_forward: bit for bit without attention, else within
 * the forward tolerance); reset, copy, the max_len refusal that moves no
 * slot, and bad arguments. Returns nonzero on failure. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "rx_pretrain.h"

enum { S = 3, T = 21, V = 40 };
static const int PROMPT[S] = {6, 1, 9}, JOIN[S] = {0, 0, 4};

static int within(const float *a, const float *b, size_t n) {
    double e = 0.0, s = 0.0;
    for (size_t i = 0; i < n; i++) {
        e = fmax(e, fabs((double)a[i] - b[i]));
        s = fmax(s, fabs((double)b[i]));
    }
    return e <= 1e-5 * s;
}

/* seq k's logits at every position, the slots stepping together by the plan */
static int run_batched(rx_gen *g, int tok[S][T], float *out[S]) {
    int done[S] = {0}, slots[S], counts[S], rows[S * T];
    static float logits[S * T * V];
    for (int step = 0; step < 64; step++) {
        int n = 0, r = 0;
        for (int k = 0; k < S; k++) {
            if (step < JOIN[k] || done[k] >= T) continue;
            const int c = done[k] ? 1 : PROMPT[k];
            slots[n] = 2 - k;   /* slots in another order than the sequences */
            counts[n++] = c;
            memcpy(rows + r, tok[k] + done[k], (size_t)c * sizeof(int));
            r += c;
        }
        if (!n) return RX_OK;
        const int rc = rx_gen_step(g, n, slots, counts, rows, 1, logits);
        if (rc != RX_OK) return rc;
        for (int i = 0, o = 0; i < n; o += counts[i++]) {
            const int k = 2 - slots[i];
            memcpy(out[k] + (size_t)done[k] * V, logits + (size_t)o * V,
                   (size_t)counts[i] * V * sizeof(float));
            done[k] += counts[i];
        }
    }
    return RX_OK;
}

static void one_model(int n_attn) {
    rx_pt_config c = {.n_embd = 16, .n_head = 2, .head_size = 8, .n_rwkv_layer = 3,
                      .n_attn_layer = n_attn, .vocab_size = V, .Dw = 4, .Da = 4, .Dg = 4,
                      .Dv = 4, .ffn_dim = 24, .chunk_size = 3, .moba_top_k = 1};
    int tok[S][T];
    for (int k = 0; k < S; k++)
        for (int t = 0; t < T; t++) tok[k][t] = (t * 7 + 3 + 11 * k) % V;
    rx_ptmodel *m = NULL;
    rx_pt_acts *acts = NULL;
    rx_gen *g = NULL, *one = NULL;
    float *got[S], *alone = malloc(sizeof(float) * T * V);
    for (int k = 0; k < S; k++) got[k] = malloc(sizeof(float) * T * V);
    if (rx_model_create(&c, 0, 11, &m) != RX_OK || rx_pt_acts_create(m, 1, T, &acts) != RX_OK ||
        rx_gen_create(m, S, T, 16, &g) != RX_OK || rx_gen_create(m, 1, T, 16, &one) != RX_OK ||
        !alone || !got[0] || !got[1] || !got[2]) {
        CHECK(0, "set-up: %s", rx_last_error());
        return;
    }
    CHECK(run_batched(g, tok, got) == RX_OK, "batched: %s", rx_last_error());
    for (int k = 0; k < S; k++) {
        CHECK(rx_gen_pos(g, 2 - k) == T, "slot %d at %d", 2 - k, rx_gen_pos(g, 2 - k));
        const int zero = 0, p = PROMPT[k];
        rx_gen_reset(one, 0);
        int rc = rx_gen_step(one, 1, &zero, &p, tok[k], 1, alone);
        for (int t = p; t < T && rc == RX_OK; t++)
            rc = rx_gen_step(one, 1, &zero, (const int[]){1}, tok[k] + t, 0, alone + (size_t)t * V);
        CHECK(rc == RX_OK && !memcmp(alone, got[k], sizeof(float) * T * V),
              "attn %d seq %d: batched != alone", n_attn, k);
        CHECK(rx_pretrain_forward(m, tok[k], T, acts) == RX_OK, "forward");
        if (n_attn)
            CHECK(!memcmp(acts->logits, got[k], sizeof(float) * p * V) &&
                  within(got[k], acts->logits, (size_t)T * V), "seq %d: != forward", k);
        else
            CHECK(!memcmp(acts->logits, got[k], sizeof(float) * T * V), "seq %d != forward", k);
    }
    /* the caches are full: one more token refused, no slot moved */
    const int sl[2] = {0, 1}, cn[2] = {1, 1};
    const int rc = rx_gen_step(g, 2, sl, cn, tok[0], 0, alone);
    CHECK(n_attn ? rc == RX_EINVAL && strstr(rx_last_error(), "max_len") : rc == RX_OK,
          "past max_len: %d %s", rc, rx_last_error());
    CHECK(rx_gen_pos(g, 0) == T + !n_attn && rx_gen_pos(g, 1) == T + !n_attn, "moved");
    /* copy, then reset */
    CHECK(rx_gen_copy(g, 0, 2) == RX_OK && rx_gen_pos(g, 0) == T, "copy");
    CHECK(rx_gen_reset(g, 0) == RX_OK && rx_gen_pos(g, 0) == 0, "reset");
    /* bad arguments: refused, nothing moved */
    const int two[2] = {1, 1}, bad_tok = V, big = 17, neg = -1;
    CHECK(rx_gen_step(g, 2, two, cn, tok[0], 0, alone) == RX_EINVAL, "duplicate slot");
    CHECK(rx_gen_step(g, 1, &neg, cn, tok[0], 0, alone) == RX_EINVAL, "slot -1");
    CHECK(rx_gen_step(g, 1, sl, &big, tok[0], 0, alone) == RX_EINVAL, "past max_tokens");
    CHECK(rx_gen_step(g, 1, sl, &neg, tok[0], 0, alone) == RX_EINVAL, "count -1");
    CHECK(rx_gen_step(g, 1, sl, cn, &bad_tok, 0, alone) == RX_EINVAL, "token");
    CHECK(rx_gen_step(g, 0, sl, cn, tok[0], 0, alone) == RX_EINVAL, "n 0");
    CHECK(rx_gen_step(g, S + 1, sl, cn, tok[0], 0, alone) == RX_EINVAL, "n > slots");
    CHECK(rx_gen_step(g, 1, sl, cn, tok[0], 2, alone) == RX_EINVAL, "all 2");
    CHECK(rx_gen_step(g, 1, sl, cn, NULL, 0, alone) == RX_EINVAL, "NULL tokens");
    CHECK(rx_gen_pos(g, 0) == 0 && rx_gen_pos(g, S) == -1 && rx_gen_pos(NULL, 0) == -1, "pos");
    CHECK(rx_gen_reset(g, S) == RX_EINVAL && rx_gen_copy(g, 0, -1) == RX_EINVAL, "bad slot");
    rx_gen *none = NULL;
    CHECK(rx_gen_create(m, 0, 4, 4, &none) == RX_EINVAL && !none, "n_slots 0");
    CHECK(rx_gen_create(NULL, 1, 4, 4, &none) == RX_EINVAL, "NULL model");
    CHECK(rx_gen_create(m, 1, 4, 0, &none) == RX_EINVAL, "max_tokens 0");
    rx_gen_free(g);
    rx_gen_free(one);
    rx_gen_free(NULL);
    rx_pt_acts_free(acts);
    rx_ptmodel_free(m);
    for (int k = 0; k < S; k++) free(got[k]);
    free(alone);
}

int main(void) {
    one_model(2);
    one_model(0);
    return failures != 0;
}
