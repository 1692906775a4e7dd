/* Buffers that share memory (rx_pretrain.h, "Outputs must not overlap"):
 * every entry point refuses an output that overlaps an input or another
 * output with RX_EINVAL naming both, before it writes anything, and still
 * runs the in-place calls it documents (LayerNorm out = x and dx = dy,
 * WKV7 s_final = s_init). The GEMMs' own check is tests/c/test_gemm.c; the
 * legacy forms' answer to an overlap, tests/c/test_legacy.c.
 * Returns nonzero (with a line per failed check) on failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rx_pretrain.h"

static int n_checks, n_failed;

static void expect(const char *what, int rc, int want, const char *needle) {
    n_checks++;
    if (rc == want && (!needle || strstr(rx_last_error(), needle))) return;
    n_failed++;
    fprintf(stderr, "test_overlap: %s: got %d \"%s\", want %d containing \"%s\"\n", what, rc,
            rx_last_error(), want, needle ? needle : "");
}

#define SENTINEL 12345.0f

static void fill(float *p, size_t n, float v) {
    for (size_t i = 0; i < n; i++) p[i] = v;
}

/* the n floats at p still hold SENTINEL: a refused call wrote nothing */
static void untouched(const char *what, const float *p, size_t n) {
    n_checks++;
    for (size_t i = 0; i < n; i++)
        if (p[i] != SENTINEL) {
            n_failed++;
            fprintf(stderr, "test_overlap: %s: element %zu written (%g)\n", what, i, p[i]);
            return;
        }
}

/* Elements of time-mix field i of P (dims named by the schema) */
static size_t tm_elems(const rx_tm_params *P, int i, size_t *g_off) {
    const char *dims[2];
    rx_tm_field(i, NULL, NULL, g_off, dims, NULL);
    size_t e = 1;
    for (int d = 0; d < 2 && dims[d]; d++) {
        const char *n = dims[d];
        e *= (size_t)(!strcmp(n, "C") ? P->c : !strcmp(n, "Dw") ? P->Dw : !strcmp(n, "Da") ? P->Da
                      : !strcmp(n, "Dg") ? P->Dg : P->Dv);
    }
    return e;
}

/* Fresh grads for a block of the test model: one zeroed arena cut in
 * field order, the time-mix fields from the schema */
static float *block_grads(const rx_block_params *P, rx_block_grads *G) {
    const size_t C = (size_t)P->tm.c, F = (size_t)P->cm.ffn_dim;
    size_t n = 5 * C + 2 * C * F, g_off;
    for (int i = 0; i < rx_tm_num_fields(); i++) n += tm_elems(&P->tm, i, &g_off);
    float *arena = calloc(n, sizeof(float)), *p = arena;
    if (!arena) return NULL;
    for (int i = 0; i < rx_tm_num_fields(); i++) {
        const size_t e = tm_elems(&P->tm, i, &g_off);
        memcpy((char *)&G->tm + g_off, &p, sizeof p);
        p += e;
    }
    G->cm.ffn_x_k = p, p += C;
    G->cm.ffn_key_w = p, p += C * F;
    G->cm.ffn_value_w = p, p += F * C;
    G->ln1_w = p, p += C;
    G->ln1_b = p, p += C;
    G->ln2_w = p, p += C;
    G->ln2_b = p;
    return arena;
}

int main(void) {
    const rx_pt_config cfg = {.n_embd = 16, .n_head = 2, .head_size = 8, .n_rwkv_layer = 2,
                              .n_attn_layer = 1, .vocab_size = 32, .Dw = 4, .Da = 4, .Dg = 4,
                              .Dv = 4, .ffn_dim = 32, .chunk_size = 4, .moba_top_k = 1};
    enum { B = 2, T = 8, C = 16, H = 2, N = 8, V = 32 };
    enum { BTC = B * T * C, BC = B * C, S = B * H * N * N };
    rx_ptmodel *m = NULL;
    if (rx_model_create(&cfg, 0, 3, &m) != RX_OK) return 100;
    /* a[k]: the k-th BTC-float tensor of one arena, so that pointers at
     * any offset stay inside it */
    float *mem = malloc(16 * BTC * sizeof(float)), *a[16];
    float *st = malloc(2 * S * sizeof(float));
    if (!mem || !st) return 101;
    for (int k = 0; k < 16; k++) a[k] = mem + k * BTC;
    for (size_t i = 0; i < 16 * (size_t)BTC; i++) mem[i] = 0.01f * (float)(i % 97) - 0.4f;
    for (size_t i = 0; i < 2 * (size_t)S; i++) st[i] = 0.0f;
    float lw[C], lb[C], *dw = a[13], *db = a[14];
    fill(lw, C, 1.0f);
    fill(lb, C, 0.0f);
    int tok[T] = {1, 2, 3, 4, 5, 6, 7, 8};

    /* LayerNorm: exactly in place runs, a shifted out is refused untouched */
    expect("layernorm in place", rx_layernorm_forward_seq(a[0], lw, lb, a[0], B, T, C), RX_OK,
           NULL);
    fill(a[1] + 3, BTC, SENTINEL);
    expect("layernorm out one row on", rx_layernorm_forward_seq(a[1], lw, lb, a[1] + 3, B, T, C),
           RX_EINVAL, "rx_layernorm_forward_seq: the output out overlaps the input x");
    untouched("layernorm refused", a[1] + 3, BTC);
    expect("layernorm out on w", rx_layernorm_forward_seq(a[0], a[1], lb, a[1] + C - 1, B, T, C),
           RX_EINVAL, "the output out overlaps the input w");
    expect("layernorm backward dx = dy",
           rx_layernorm_backward(a[0], lw, lb, a[2], a[2], dw, db, B, T, C), RX_OK, NULL);
    expect("layernorm backward dx on x",
           rx_layernorm_backward(a[0], lw, lb, a[2], a[0], dw, db, B, T, C), RX_EINVAL,
           "the output dx overlaps the input x");
    expect("layernorm backward dw on db",
           rx_layernorm_backward(a[0], lw, lb, a[2], a[3], dw, dw + 1, B, T, C), RX_EINVAL,
           "the output db overlaps the output dw");

    /* WKV7: s_final = s_init runs; outputs on inputs or on each other do not */
    const float *r = a[0], *w = a[1], *k = a[2], *v = a[3], *aa = a[4], *bb = a[5];
    expect("wkv7 state in place",
           rx_wkv7_forward_seq(r, w, k, v, aa, bb, st, a[6], st, B, T, H, N), RX_OK, NULL);
    fill(a[7], BTC, SENTINEL);
    expect("wkv7 y on v", rx_wkv7_forward_seq(r, w, k, v, aa, bb, NULL, a[3] + 1, NULL, B, T, H, N),
           RX_EINVAL, "rx_wkv7_forward: the output y_out overlaps the input v");
    expect("wkv7 s_final partly on s_init",
           rx_wkv7_forward_seq(r, w, k, v, aa, bb, st, a[7], st + N, B, T, H, N), RX_EINVAL,
           "the output s_final overlaps the input s_init");
    untouched("wkv7 refused", a[7], BTC);
    expect("wkv7 backward dk on dr",
           rx_wkv7_backward(r, w, k, v, aa, bb, a[6], NULL, a[7], a[8], a[7] + BTC / 2, a[9],
                            a[10], a[11], NULL, B, T, H, N), RX_EINVAL,
           "rx_wkv7_backward: the output dk overlaps the output dr");
    expect("wkv7 backward dS on dy",
           rx_wkv7_backward(r, w, k, v, aa, bb, a[6], NULL, a[7], a[8], a[9], a[10], a[11],
                            a[12], a[6], B, T, H, N), RX_EINVAL,
           "the output dS_out overlaps the input dy");

    /* the blocks: their outputs against the sequence, P and the other grads */
    const rx_block_params *P0 = rx_ptmodel_rwkv(m, 0), *P1 = rx_ptmodel_rwkv(m, 1);
    const rx_attn_params *PA = rx_ptmodel_attn(m, 0);
    if (!P0 || !P1 || !PA) return 102;
    rx_block_grads G, G1;
    float *ga = block_grads(P0, &G), *ga1 = block_grads(P1, &G1);
    if (!ga || !ga1) return 103;
    expect("timemix", rx_timemix_forward_seq(&P0->tm, a[0], NULL, a[1], a[2], B, T), RX_OK, NULL);
    expect("timemix out on v_first", rx_timemix_forward_seq(&P0->tm, a[0], NULL, a[1], a[1], B, T),
           RX_EINVAL, "rx_timemix_forward_seq: the output out overlaps the output v_first");
    expect("timemix later out on v_first",
           rx_timemix_forward_seq(&P1->tm, a[0], NULL, a[1], a[1], B, T), RX_EINVAL,
           "the output out overlaps the input v_first");
    expect("timemix out on a weight",
           rx_timemix_forward_seq(&P0->tm, a[0], NULL, a[1], (float *)P0->tm.key_w, 1, 1),
           RX_EINVAL, "the output out overlaps the input P->key_w");
    expect("timemix backward",
           rx_timemix_backward(&P1->tm, a[0], NULL, a[1], a[2], &G1.tm, a[3], NULL, a[4], B, T),
           RX_OK, NULL);
    rx_tm_grads Gb = G1.tm;
    Gb.w2 = G1.tm.w1 + 1;
    expect("timemix grads overlap",
           rx_timemix_backward(&P1->tm, a[0], NULL, a[1], a[2], &Gb, a[3], NULL, a[4], B, T),
           RX_EINVAL, "the output G->w2 overlaps the output G->w1");
    Gb = G1.tm;
    Gb.key_w = (float *)P1->tm.value_w;
    expect("timemix grad on a weight",
           rx_timemix_backward(&P1->tm, a[0], NULL, a[1], a[2], &Gb, a[3], NULL, a[4], B, T),
           RX_EINVAL, "the output G->key_w overlaps the input P->value_w");
    expect("timemix d_v_first on dy",
           rx_timemix_backward(&P1->tm, a[0], NULL, a[1], a[2], &G1.tm, a[3], NULL, a[2], B, T),
           RX_EINVAL, "the output d_v_first overlaps the input dy");

    expect("channelmix", rx_channelmix_forward_seq(&P0->cm, a[0], a[5], a[1], B, T), RX_OK, NULL);
    expect("channelmix out on carry",
           rx_channelmix_forward_seq(&P0->cm, a[0], a[5], a[5] + BC - 1, B, T), RX_EINVAL,
           "rx_channelmix_forward_seq: the output out overlaps the input x_prev_init");
    expect("channelmix backward d carry on dx",
           rx_channelmix_backward(&P0->cm, a[0], NULL, a[1], &G.cm, a[2], a[2] + BTC - 1, B, T),
           RX_EINVAL, "the output d_xprev_init overlaps the output dx");

    expect("block", rx_block_forward_seq(P1, a[0], NULL, NULL, a[1], a[2], B, T), RX_OK, NULL);
    expect("block out on x", rx_block_forward_seq(P1, a[0], NULL, NULL, a[1], a[0] + 5, B, T),
           RX_EINVAL, "rx_block_forward_seq: the output out overlaps the input x");
    rx_block_grads Gc = G1;
    Gc.ln2_b = G1.cm.ffn_x_k;
    expect("block ln grad on cm grad",
           rx_block_backward(P1, a[0], NULL, NULL, a[1], a[2], &Gc, a[3], NULL, NULL, a[4], B, T),
           RX_EINVAL, "the output G->ln2_b overlaps the output G->cm.ffn_x_k");
    expect("block backward",
           rx_block_backward(P1, a[0], NULL, NULL, a[1], a[2], &G1, a[3], NULL, NULL, a[4], B, T),
           RX_OK, NULL);

    rx_attn_grads GA = {G.ln1_w, G.ln1_b, G.tm.receptance_w, G.tm.key_w, G.tm.value_w,
                        G.tm.output_w, G.ln2_w, G.ln2_b, G.cm};
    expect("attn", rx_attn_forward_seq(PA, a[0], NULL, a[1], B, T), RX_OK, NULL);
    expect("attn out on a weight",
           rx_attn_forward_seq(PA, a[0], NULL, (float *)PA->output_w + C, 1, 1), RX_EINVAL,
           "rx_attn_forward_seq: the output out overlaps the input P->output_w");
    expect("attn backward", rx_attn_backward_full(PA, a[0], NULL, a[1], &GA, a[2], NULL, B, T),
           RX_OK, NULL);
    GA.value_w = GA.key_w + C;
    expect("attn grads overlap",
           rx_attn_backward_full(PA, a[0], NULL, a[1], &GA, a[2], NULL, B, T), RX_EINVAL,
           "the output G->value_w overlaps the output G->key_w");
    expect("attn core y on q",
           rx_attn_score_av_forward(PA, a[0], a[1], a[2], B, T, NULL, a[0]), RX_EINVAL,
           "rx_attn_score_av_forward: the output y overlaps the input q");
    expect("attn core dv on dk",
           rx_attn_score_av_backward(PA, a[0], a[1], a[2], a[3], B, T, a[4], a[5], a[5] + 7),
           RX_EINVAL, "the output dv overlaps the output dk");

    /* the model's ends and the optimiser */
    expect("gather out on emb", rx_embedding_gather(a[0], tok, T, C, V, a[0] + V * C - 1),
           RX_EINVAL, "rx_embedding_gather: the output out overlaps the input emb");
    expect("scatter d_emb on d_out", rx_embedding_scatter(tok, T, C, V, a[0], a[0] + 3),
           RX_EINVAL, "rx_embedding_scatter: the output d_emb overlaps the input d_out");
    double loss = 0.0;
    expect("cross-entropy dlogits on logits",
           rx_cross_entropy(a[0], tok, T, V, -1, a[0] + V, &loss), RX_EINVAL,
           "rx_cross_entropy: the output dlogits overlaps the input logits");
    expect("cross-entropy", rx_cross_entropy(a[0], tok, T, V, -1, a[1], &loss), RX_OK, NULL);
    fill(a[9], 64, SENTINEL);
    expect("adamw m on v", rx_adamw_step(a[9], a[8], a[9] + 16, a[9] + 40, 32, NULL, 0, 1e-3f,
                                         0.9f, 0.99f, 1e-8f, 0.0f, 1.0f, 1), RX_EINVAL,
           "rx_adamw_step: the output m overlaps the output params");
    untouched("adamw refused", a[9], 64);
    expect("adamw params on grads", rx_adamw_step(a[8], a[8], a[10], a[11], 32, NULL, 0, 1e-3f,
                                                  0.9f, 0.99f, 1e-8f, 0.0f, 1.0f, 1),
           RX_EINVAL, "the output params overlaps the input grads");

    free(ga);
    free(ga1);
    free(st);
    free(mem);
    rx_ptmodel_free(m);
    if (n_failed) fprintf(stderr, "test_overlap: %d of %d checks failed\n", n_failed, n_checks);
    return n_failed != 0;
}
