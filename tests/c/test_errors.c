/* The C error convention (rx_pretrain.h, "Errors"): every int-returning
 * function gives RX_ECONFIG for a bad model config, RX_EINVAL for a bad
 * argument and RX_ENOMEM when memory runs out, each with an rx_last_error()
 * message naming the problem (the legacy NULL / NaN forms beside them:
 * tests/c/test_legacy.c). Returns nonzero (a line per failed check) on
 * failure. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "rx_pretrain.h"

/* An absurd size must come back as NULL from the sanitizer's allocator
 * too (it would abort by default), as it does from malloc. */
const char *__asan_default_options(void) { return "allocator_may_return_null=1"; }

static int n_checks, n_failed;

/* rc must be want and rx_last_error() must contain needle */
static void expect(const char *what, int rc, int want, const char *needle) {
    n_checks++;
    if (rc == want && (!needle || strstr(rx_last_error(), needle))) return;
    n_failed++;
    fprintf(stderr, "test_errors: %s: got %d (%s) \"%s\", want %d (%s) containing \"%s\"\n", what,
            rc, rx_strerror(rc), rx_last_error(), want, rx_strerror(want), needle ? needle : "");
}

int main(void) {
    const rx_pt_config good = {.n_embd = 16, .n_head = 2, .head_size = 8, .n_rwkv_layer = 2,
                               .n_attn_layer = 1, .vocab_size = 256, .Dw = 4, .Da = 4, .Dg = 4,
                               .Dv = 4, .ffn_dim = 32, .chunk_size = 4, .moba_top_k = 1};
    enum { B = 2, T = 8, V = 256 };

    expect("no failure yet", strcmp(rx_last_error(), ""), 0, NULL);
    expect("strerror", strcmp(rx_strerror(RX_ECONFIG), "invalid model config"), 0, NULL);

    /* config: RX_ECONFIG naming the field, RX_EINVAL for NULL */
    rx_pt_config c = good;
    c.n_head = 3;
    expect("validate n_head", rx_pt_config_validate(&c), RX_ECONFIG, "n_head * head_size");
    c = good;
    c.chunk_size = 0;
    expect("validate chunk_size", rx_pt_config_validate(&c), RX_ECONFIG, "chunk_size = 0");
    c = good;
    c.vocab_size = 1 << 30;
    expect("validate too large", rx_pt_config_validate(&c), RX_ECONFIG, "too large");
    expect("validate NULL", rx_pt_config_validate(NULL), RX_EINVAL, "NULL");
    expect("validate good", rx_pt_config_validate(&good), RX_OK, NULL);

    /* model creation */
    rx_ptmodel *m = (rx_ptmodel *)&c;   /* must be reset to NULL on failure */
    c = good;
    c.n_attn_layer = 3;
    expect("create bad config", rx_model_create(&c, 0, 1, &m), RX_ECONFIG, "n_attn_layer = 3");
    expect("create leaves NULL", m == NULL, 1, NULL);
    expect("create NULL out", rx_model_create(&good, 0, 1, NULL), RX_EINVAL, "out is NULL");
    expect("create bad flags", rx_model_create(&good, 1 << 7, 1, &m), RX_EINVAL, "flag");
    expect("create", rx_model_create(&good, 0, 7, &m), RX_OK, NULL);
    if (!m) return 100;

    /* acts: bad sizes are RX_EINVAL; sizes no memory holds are RX_ENOMEM */
    rx_pt_acts *a = (rx_pt_acts *)&c;
    expect("acts B = 0", rx_pt_acts_create(m, 0, T, &a), RX_EINVAL, "B = 0");
    expect("acts leaves NULL", a == NULL, 1, NULL);
    expect("acts NULL model", rx_pt_acts_create(NULL, B, T, &a), RX_EINVAL, "model is NULL");
    expect("acts B*T past int", rx_pt_acts_create(m, 1 << 16, 1 << 16, &a), RX_EINVAL, "B*T");
    /* 2**31 - 1 tokens of 2*16384 logits each: 256 TiB, past the 128 TiB a
     * 64-bit process can map, so it fails whatever the overcommit policy */
    c = good;
    c.vocab_size = 16384;
    rx_ptmodel *wide;
    expect("create wide", rx_model_create(&c, 0, 1, &wide), RX_OK, NULL);
    if (!wide) return 100;
    expect("acts out of memory", rx_pt_acts_create(wide, 1, 2147483647, &a), RX_ENOMEM,
           "out of memory");
    rx_ptmodel_free(wide);
    expect("acts", rx_pt_acts_create(m, B, T, &a), RX_OK, NULL);
    if (!a) return 101;

    /* forward: the token out of range is named with its position */
    int tok[B * T], tgt[B * T];
    for (int i = 0; i < B * T; i++) tok[i] = tgt[i] = (i * 37 + 5) % V;
    double loss = -1.0;
    expect("backward before forward",
           rx_pretrain_backward_loss(m, a, tgt, B, T, -1, &loss), RX_EINVAL, "no forward");
    tok[5] = 300;
    expect("forward bad token", rx_pretrain_forward_batch(m, tok, B, T, a), RX_EINVAL,
           "rx_pretrain_forward_batch: token 300 at position 5 is outside [0, 256)");
    tok[5] = 1;
    expect("forward wrong shape", rx_pretrain_forward_batch(m, tok, 1, T, a), RX_EINVAL,
           "made for B = 2, T = 8");
    expect("forward", rx_pretrain_forward_batch(m, tok, B, T, a), RX_OK, NULL);

    /* backward: a refused call leaves *loss as it was */
    tgt[9] = 999;
    expect("backward bad target", rx_pretrain_backward_loss(m, a, tgt, B, T, -1, &loss),
           RX_EINVAL, "target 999 at position 9");
    expect("backward loss untouched", loss == -1.0, 1, NULL);
    expect("backward ignored target", rx_pretrain_backward_loss(m, a, tgt, B, T, 999, &loss),
           RX_OK, NULL);
    expect("backward loss", loss > 0.0 && isfinite(loss), 1, NULL);
    expect("backward NULL loss", rx_pretrain_backward_loss(m, a, tgt, B, T, 999, NULL),
           RX_EINVAL, "loss is NULL");

    /* the loss, embedding and head on their own */
    float logits[T * V], dlogits[T * V], x[T * 16], emb[V * 16], demb[V * 16];
    for (int i = 0; i < T * V; i++) logits[i] = (float)(i % 7) * 0.25f;
    for (int i = 0; i < V * 16; i++) emb[i] = (float)(i % 5);
    tgt[3] = V;
    expect("ce bad target", rx_cross_entropy(logits, tgt, T, V, -1, dlogits, &loss), RX_EINVAL,
           "target 256 at position 3 is outside [0, 256)");
    tgt[3] = 0;
    expect("ce T = 0", rx_cross_entropy(logits, tgt, 0, V, -1, NULL, &loss), RX_EINVAL, "T = 0");
    expect("ce", rx_cross_entropy(logits, tgt, T, V, -1, dlogits, &loss), RX_OK, NULL);
    tok[2] = V;
    expect("gather bad token", rx_embedding_gather(emb, tok, T, 16, V, x), RX_EINVAL,
           "token 256 at position 2");
    expect("scatter bad token", rx_embedding_scatter(tok, T, 16, V, x, demb), RX_EINVAL,
           "token 256 at position 2");
    tok[2] = 3;
    expect("gather", rx_embedding_gather(emb, tok, T, 16, V, x), RX_OK, NULL);
    expect("gathered row", x[2 * 16 + 1] == emb[3 * 16 + 1], 1, NULL);
    expect("scatter", rx_embedding_scatter(tok, T, 16, V, x, demb), RX_OK, NULL);
    expect("head NULL", rx_head_logits(x, NULL, T, 16, V, logits), RX_EINVAL, "head is NULL");
    expect("head grads C = 0", rx_head_grads(x, emb, dlogits, T, 0, V, x, demb), RX_EINVAL,
           "C = 0");
    expect("head grads dx on dlogits", rx_head_grads(x, emb, dlogits, T, 16, V, dlogits, demb),
           RX_EINVAL, "overlaps the input A");
    expect("head", rx_head_logits(x, emb, T, 16, V, logits), RX_OK, NULL);

    /* the kernels name the NULL argument or the size below 1 */
    expect("layernorm NULL w", rx_layernorm_forward_seq(x, NULL, emb, x, 1, T, 16), RX_EINVAL,
           "rx_layernorm_forward_seq: w is NULL");
    expect("wkv7 T = 0", rx_wkv7_forward_seq(x, x, x, x, x, x, NULL, NULL, NULL, 1, 0, 2, 8),
           RX_EINVAL, "T = 0, n_head = 2");
    expect("timemix NULL P", rx_timemix_forward_seq(NULL, x, NULL, NULL, x, 1, T), RX_EINVAL,
           "rx_timemix_forward_seq: P is NULL");
    expect("attn B = 0", rx_attn_forward_seq(rx_ptmodel_attn(m, 0), x, NULL, x, 0, T), RX_EINVAL,
           "rx_attn_forward_seq: B = 0, T = 8");
    expect("block v_first", rx_block_forward_seq(rx_ptmodel_rwkv(m, 1), x, NULL, NULL, NULL, x, 1,
                                                 T), RX_EINVAL, "v_first is NULL at layer 1");

    /* optimiser */
    double norm = -1.0;
    expect("norm n = 0", rx_grad_norm_l2(x, 0, &norm), RX_EINVAL, "n < 1");
    expect("norm NULL", rx_grad_norm_l2(NULL, 4, &norm), RX_EINVAL, "NULL");
    expect("norm", rx_grad_norm_l2(x, 16, &norm), RX_OK, NULL);
    float p[4] = {0}, g[4] = {0}, mm[4] = {0}, vv[4] = {0};
    expect("adamw betas", rx_adamw_step(p, g, mm, vv, 4, NULL, 0, 1e-3f, 1.5f, 0.9f, 1e-8f, 0.0f,
                                        1.0f, 1), RX_EINVAL, "betas");

    /* inference */
    rx_infer_state *s = (rx_infer_state *)&c;
    expect("infer max_len 0", rx_infer_create(m, 0, &s), RX_EINVAL, "max_len = 0");
    expect("infer leaves NULL", s == NULL, 1, NULL);
    expect("infer NULL model", rx_infer_create(NULL, 4, &s), RX_EINVAL, "model is NULL");
    expect("infer", rx_infer_create(m, T, &s), RX_OK, NULL);
    if (!s) return 102;
    tok[1] = -7;
    expect("infer bad token", rx_infer_forward(s, tok, 2, logits), RX_EINVAL,
           "token -7 at position 1");
    expect("infer past max_len", rx_infer_forward(s, tok, T + 1, logits), RX_EINVAL,
           "max_len = 8");

    /* a success leaves the last failure's message as it was */
    expect("message kept", rx_infer_forward(s, tok + 2, 2, logits), RX_OK, "max_len = 8");

    rx_infer_free(s);
    rx_pt_acts_free(a);
    rx_ptmodel_free(m);
    if (n_failed) fprintf(stderr, "test_errors: %d of %d checks failed\n", n_failed, n_checks);
    return n_failed != 0;
}
