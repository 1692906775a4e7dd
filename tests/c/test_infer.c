/* Sanitizer test of csrc/infer.c: a random-init model (docs/layout.md §Parameters) run over T
 * tokens by rx_pretrain_forward and again by rx_infer_forward, one token per
 * call and then prompt + tail; the logits must agree (and equal bit for bit
 * when the whole prompt is one call). MoBA selection is active (T > (top_k
 * + 1) * chunk_size). Returns nonzero on failure. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rx_pretrain.h"

static double max_err(const float *a, const float *b, size_t n, double *scale) {
    double e = 0.0, s = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > e) e = d;
        if (fabs(b[i]) > s) s = fabs(b[i]);
    }
    *scale = s;
    return e;
}

int main(void) {
    rx_pt_config c = {.n_embd = 16, .n_head = 2, .head_size = 8, .n_rwkv_layer = 3,
                      .n_attn_layer = 2, .vocab_size = 40, .Dw = 4, .Da = 4, .Dg = 4, .Dv = 4,
                      .ffn_dim = 24, .chunk_size = 3, .moba_top_k = 1};
    enum { T = 23 };
    int tokens[T], fail = 0;
    for (int t = 0; t < T; t++) tokens[t] = (t * 7 + 3) % c.vocab_size;
    rx_ptmodel *m = NULL;
    rx_pt_acts *acts = NULL;
    rx_infer_state *s = NULL, *none;
    float *steps = malloc(sizeof(float) * T * c.vocab_size);
    if (rx_model_create(&c, 0, 11, &m) != RX_OK || rx_pt_acts_create(m, 1, T, &acts) != RX_OK ||
        rx_infer_create(m, T, &s) != RX_OK || !steps)
        return 100;
    if (rx_pretrain_forward(m, tokens, T, acts) != RX_OK) fail |= 1;
    for (int t = 0; t < T; t++)
        if (rx_infer_forward(s, tokens + t, 1, steps + (size_t)t * c.vocab_size) != RX_OK)
            fail |= 2;
    double scale, e = max_err(steps, acts->logits, (size_t)T * c.vocab_size, &scale);
    if (!(e <= 1e-5 * scale)) fail |= 4;
    rx_infer_reset(s);
    if (rx_infer_pos(s) != 0) fail |= 8;
    if (rx_infer_forward(s, tokens, 10, steps) != RX_OK ||
        rx_infer_forward(s, tokens + 10, T - 10, steps + 10 * c.vocab_size) != RX_OK)
        fail |= 16;
    e = max_err(steps, acts->logits, (size_t)T * c.vocab_size, &scale);
    if (!(e <= 1e-5 * scale)) fail |= 32;
    /* the prompt in one call at position 0: every block runs the training
     * forward's own function, so the forward's bits */
    rx_infer_reset(s);
    if (rx_infer_forward(s, tokens, T, steps) != RX_OK ||
        memcmp(steps, acts->logits, sizeof(float) * T * c.vocab_size) != 0)
        fail |= 1024;
    /* past max_len, bad tokens, bad sizes: refused, state unchanged */
    if (rx_infer_forward(s, tokens, 1, steps) != RX_EINVAL) fail |= 64;
    int bad = c.vocab_size;
    rx_infer_reset(s);
    if (rx_infer_forward(s, &bad, 1, steps) != RX_EINVAL || rx_infer_pos(s) != 0) fail |= 128;
    if (rx_infer_forward(s, tokens, 0, steps) != RX_EINVAL) fail |= 256;
    if (rx_infer_create(m, 0, &none) != RX_EINVAL || rx_infer_create(NULL, 4, &none) != RX_EINVAL)
        fail |= 512;
    rx_infer_free(s);
    rx_pt_acts_free(acts);
    rx_ptmodel_free(m);
    free(steps);
    if (fail) fprintf(stderr, "test_infer: failure mask %d (max err %g of %g)\n", fail, e, scale);
    return fail;
}
