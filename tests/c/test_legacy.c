/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * test_legacy.c -- the legacy forms, the last section of rx_pretrain.h: on
 * success each gives the same bits as the int-returning form it names; on
 * failure it answers NULL, NaN or NaN-filled outputs (an output that would
 * overlap an input left as it is) with the rx_last_error() message the
 * header promises. The one test program that calls them, hence the one
 * that opts out of their deprecation warnings. Built with
 * -fsanitize=address,undefined by tests/test_sanitizers.py. Returns nonzero
 * (a line per failed check) on failure.
 */
#define RX_NO_DEPRECATION_WARNINGS
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rx_pretrain.h"

/* An absurd size must come back as NULL from the sanitizer's allocator
 * too (it would abort by default), as it does from malloc. */
const char *__asan_default_options(void) { return "allocator_may_return_null=1"; }

static int n_checks, n_failed;

/* ok must hold and rx_last_error() must contain needle (NULL: any) */
static void expect(const char *what, int ok, const char *needle) {
    n_checks++;
    if (ok && (!needle || strstr(rx_last_error(), needle))) return;
    n_failed++;
    fprintf(stderr, "test_legacy: %s: %s, last error \"%s\", want one containing \"%s\"\n", what,
            ok ? "holds" : "does not hold", rx_last_error(), needle ? needle : "");
}

static int same_bits(const void *a, const void *b, size_t n_floats) {
    return memcmp(a, b, n_floats * sizeof(float)) == 0;
}

static int all_nan(const float *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isnan(p[i])) return 0;
    return 1;
}

static void fill(float *p, size_t n, float v) {
    for (size_t i = 0; i < n; i++) p[i] = v;
}

static const rx_pt_config BASE = {
    .n_embd = 16, .n_head = 2, .head_size = 8, .n_rwkv_layer = 2, .n_attn_layer = 1,
    .vocab_size = 23, .Dw = 4, .Da = 4, .Dg = 4, .Dv = 4, .ffn_dim = 24,
    .chunk_size = 4, .moba_top_k = 1,
};
enum { SEQ = 9, B = 2, V = 23, C = 16 };

/* the parameter arenas of two models hold the same bits */
static int same_arena(rx_ptmodel *a, rx_ptmodel *b) {
    int64_t na, nb;
    const float *pa = rx_ptmodel_param_arena(a, &na), *pb = rx_ptmodel_param_arena(b, &nb);
    return na == nb && same_bits(pa, pb, (size_t)na);
}

static void test_constructors(void) {
    const uint64_t seed = 31;
    rx_pt_config c = BASE;
    c.n_attn_layer = -1;
    expect("new_random bad config", rx_model_new_random(&c, 1) == NULL, "n_attn_layer = -1");
    expect("new_random NULL config", rx_model_new_random(NULL, 1) == NULL, "NULL");
    expect("new_random_flags unknown flag", rx_model_new_random_flags(&BASE, 1 << 5, 1) == NULL,
           "flag");

    rx_ptmodel *plain = rx_model_new_random(&BASE, seed);
    rx_ptmodel *zero = rx_model_new_random_flags(&BASE, 0, seed);
    rx_ptmodel *ln0 = rx_model_new_random_flags(&BASE, RX_PT_LN0, seed);
    rx_ptmodel *ref = NULL, *ref_ln0 = NULL;
    expect("create", rx_model_create(&BASE, 0, seed, &ref) == RX_OK, NULL);
    expect("create ln0", rx_model_create(&BASE, RX_PT_LN0, seed, &ref_ln0) == RX_OK, NULL);
    expect("models", plain && zero && ln0 && ref && ref_ln0, NULL);
    if (plain && zero && ln0 && ref && ref_ln0) {
        expect("new_random is create with flags 0", same_arena(plain, ref), NULL);
        expect("new_random_flags 0 is create", same_arena(zero, ref), NULL);
        expect("new_random_flags ln0 is create ln0",
               same_arena(ln0, ref_ln0) && rx_ptmodel_flags(ln0) == RX_PT_LN0, NULL);
    }
    rx_ptmodel_free(plain);
    rx_ptmodel_free(zero);
    rx_ptmodel_free(ln0);
    rx_ptmodel_free(ref_ln0);

    if (ref) {
        rx_pt_acts *a1 = rx_pt_acts_new(ref, SEQ), *ab = rx_pt_acts_new_batch(ref, B, SEQ);
        expect("acts_new", a1 && a1->B == 1 && a1->T == SEQ && !a1->ready, NULL);
        expect("acts_new_batch", ab && ab->B == B && ab->T == SEQ && !ab->ready, NULL);
        rx_pt_acts_free(a1);
        rx_pt_acts_free(ab);
        expect("acts_new T = 0", rx_pt_acts_new(ref, 0) == NULL, "T = 0");
        expect("acts_new_batch B = 0", rx_pt_acts_new_batch(ref, 0, 4) == NULL, "B = 0");
        expect("acts_new_batch B*T past int", rx_pt_acts_new_batch(ref, 1 << 20, 1 << 20) == NULL,
               "B*T");
        rx_infer_state *s = rx_infer_new(ref, SEQ);
        expect("infer_new", s && rx_infer_pos(s) == 0, NULL);
        rx_infer_free(s);
        expect("infer_new max_len 0", rx_infer_new(ref, 0) == NULL, "max_len = 0");
    }
    expect("acts_new NULL model", rx_pt_acts_new(NULL, 4) == NULL, "model is NULL");
    expect("infer_new NULL model", rx_infer_new(NULL, 4) == NULL, "model is NULL");
    rx_ptmodel_free(ref);

    /* 2**31 - 1 tokens of 2*16384 logits each: 256 TiB, past the 128 TiB a
     * 64-bit process can map, so it fails whatever the overcommit policy */
    c = BASE;
    c.vocab_size = 16384;
    rx_ptmodel *wide = rx_model_new_random(&c, 1);
    expect("wide model", wide != NULL, NULL);
    if (wide)
        expect("acts_new out of memory", rx_pt_acts_new(wide, 2147483647) == NULL,
               "out of memory");
    rx_ptmodel_free(wide);
}

static void test_backward(void) {
    const int ign = 4;
    rx_ptmodel *m = rx_model_new_random(&BASE, 5);
    rx_pt_acts *a = m ? rx_pt_acts_new(m, SEQ) : NULL;
    rx_pt_acts *ab = m ? rx_pt_acts_new_batch(m, B, SEQ) : NULL;
    int64_t n = 0;
    float *g = m ? rx_ptmodel_grad_arena(m, &n) : NULL;
    float *g0 = malloc((size_t)n * sizeof(float));
    expect("backward setup", m && a && ab && g0, NULL);
    if (!m || !a || !ab || !g0) goto done;
    int tok[B * SEQ], tgt[B * SEQ], bad[SEQ];
    for (int i = 0; i < B * SEQ; i++) {
        tok[i] = (5 * i + 2) % V;
        tgt[i] = (3 * i + 1) % V;
    }
    tgt[3] = ign;

    expect("backward before forward", isnan(rx_pretrain_backward(m, a, tgt, SEQ, ign)),
           "no forward");
    expect("forward", rx_pretrain_forward(m, tok, SEQ, a) == RX_OK, NULL);
    double loss = rx_pretrain_backward(m, a, tgt, SEQ, ign), want = -1.0;
    memcpy(g0, g, (size_t)n * sizeof(float));
    expect("backward_loss", rx_pretrain_backward_loss(m, a, tgt, 1, SEQ, ign, &want) == RX_OK,
           NULL);
    expect("backward is backward_loss with B = 1",
           isfinite(loss) && loss == want && same_bits(g0, g, (size_t)n), NULL);

    /* refused: NaN, the grads left as they were */
    memset(g, 0, (size_t)n * sizeof(float));
    memcpy(bad, tgt, sizeof bad);
    bad[0] = V;
    expect("backward target == vocab", isnan(rx_pretrain_backward(m, a, bad, SEQ, ign)),
           "target 23 at position 0");
    bad[0] = -1;
    expect("backward target -1, ignore_index -1", isnan(rx_pretrain_backward(m, a, bad, SEQ, -1)),
           "target -1");
    expect("backward SEQ != acts SEQ", isnan(rx_pretrain_backward(m, a, tgt, SEQ - 1, ign)),
           NULL);
    expect("backward NULL targets", isnan(rx_pretrain_backward(m, a, NULL, SEQ, ign)), "NULL");
    int written = 0;
    for (int64_t i = 0; i < n; i++) written |= g[i] != 0.0f;
    expect("a refused backward writes no grad", !written, NULL);

    expect("forward batch", rx_pretrain_forward_batch(m, tok, B, SEQ, ab) == RX_OK, NULL);
    loss = rx_pretrain_backward_batch(m, ab, tgt, B, SEQ, ign);
    memcpy(g0, g, (size_t)n * sizeof(float));
    expect("backward_loss batch",
           rx_pretrain_backward_loss(m, ab, tgt, B, SEQ, ign, &want) == RX_OK, NULL);
    expect("backward_batch is backward_loss",
           isfinite(loss) && loss == want && same_bits(g0, g, (size_t)n), NULL);
    expect("backward_batch B*T split differs",
           isnan(rx_pretrain_backward_batch(m, ab, tgt, 1, B * SEQ, ign)), NULL);
    tgt[SEQ + 2] = 999;
    expect("backward_batch bad target", isnan(rx_pretrain_backward_batch(m, ab, tgt, B, SEQ, -1)),
           "target 999 at position 11");
done:
    free(g0);
    rx_pt_acts_free(a);
    rx_pt_acts_free(ab);
    rx_ptmodel_free(m);
}

static void test_cross_entropy(void) {
    enum { T = 6 };
    float l[T * V], d[T * V], d_ref[T * V];
    int tg[T];
    for (int i = 0; i < T * V; i++) l[i] = (float)((i * 37) % 11) * 0.3f - 1.5f;
    for (int t = 0; t < T; t++) tg[t] = (7 * t + 2) % V;
    for (int ii = -1; ii <= 0; ii++) {
        const int ign = ii < 0 ? -1 : tg[1];
        double want = -1.0, want_d = -1.0;
        expect("cross_entropy", rx_cross_entropy(l, tg, T, V, ign, NULL, &want) == RX_OK &&
                                    rx_cross_entropy(l, tg, T, V, ign, d_ref, &want_d) == RX_OK,
               NULL);
        expect("ce_forward is cross_entropy", rx_cross_entropy_forward(l, tg, T, V, ign) == want,
               NULL);
        expect("ce_backward is cross_entropy",
               rx_cross_entropy_backward(l, tg, T, V, ign, d) == want_d &&
                   same_bits(d, d_ref, T * V),
               NULL);
    }
    /* a valid target outside [0, vocab): NaN, dlogits NaN */
    tg[2] = V;
    expect("ce_forward target == vocab", isnan(rx_cross_entropy_forward(l, tg, T, V, -1)),
           "target 23 at position 2");
    tg[2] = -1;
    fill(d, T * V, 1.0f);
    expect("ce_backward negative target",
           isnan(rx_cross_entropy_backward(l, tg, T, V, -1, d)) && all_nan(d, T * V), "target -1");
    tg[2] = 0;
    expect("ce_forward NULL logits", isnan(rx_cross_entropy_forward(NULL, tg, T, V, -1)),
           "logits is NULL");
    expect("ce_forward T = 0", isnan(rx_cross_entropy_forward(l, tg, 0, V, -1)), "T = 0");
    expect("ce_backward NULL dlogits", isnan(rx_cross_entropy_backward(l, tg, T, V, -1, NULL)),
           "dlogits is NULL");
    expect("ce_backward vocab = 0", isnan(rx_cross_entropy_backward(l, tg, T, 0, -1, d)),
           "vocab = 0");
    /* dlogits overlapping logits: refused, the logits not NaN-filled */
    float keep[T * V];
    memcpy(keep, l, sizeof l);
    expect("ce_backward dlogits on logits",
           isnan(rx_cross_entropy_backward(l, tg, T - 1, V, -1, l + 1)), "overlaps");
    expect("ce_backward overlap leaves logits", same_bits(keep, l, T * V), NULL);
}

static void test_grad_norm(void) {
    float x[37];
    for (int i = 0; i < 37; i++) x[i] = (float)(i % 9) - 4.0f;
    double want = -1.0;
    expect("grad_norm_l2", rx_grad_norm_l2(x, 37, &want) == RX_OK, NULL);
    expect("grad_norm is grad_norm_l2", rx_grad_norm(x, 37) == want, NULL);
    expect("grad_norm NULL", isnan(rx_grad_norm(NULL, 4)), "NULL");
    expect("grad_norm n = 0", isnan(rx_grad_norm(x, 0)), "n < 1");
}

static void test_embedding(void) {
    enum { T = 7 };
    float emb[V * C], d_out[T * C], out[T * C], ref[V * C], d_emb[V * C];
    int tok[T];
    for (int i = 0; i < V * C; i++) emb[i] = (float)((i * 13) % 17) - 8.0f;
    for (int i = 0; i < T * C; i++) d_out[i] = (float)((i * 7) % 5) * 0.5f;
    for (int t = 0; t < T; t++) tok[t] = (3 * t + 1) % V;
    tok[T - 1] = tok[0];   /* a repeat */

    float got[T * C];
    expect("gather", rx_embedding_gather(emb, tok, T, C, V, got) == RX_OK, NULL);
    rx_embedding_forward(emb, tok, T, C, out);
    expect("embedding_forward is gather", same_bits(out, got, T * C), NULL);
    fill(ref, V * C, 7.0f);
    fill(d_emb, V * C, 7.0f);   /* both must be zeroed */
    expect("scatter", rx_embedding_scatter(tok, T, C, V, d_out, ref) == RX_OK, NULL);
    rx_embedding_backward(tok, T, C, V, d_out, d_emb);
    expect("embedding_backward is scatter", same_bits(d_emb, ref, V * C), NULL);

    /* a negative token gives a NaN row, the others are still gathered */
    const int keep = tok[0];
    tok[0] = -3;
    rx_embedding_forward(emb, tok, T, C, out);
    expect("embedding_forward negative token -> NaN row", all_nan(out, C), NULL);
    expect("embedding_forward rows after it", same_bits(out + C, got + C, (T - 1) * C), NULL);
    rx_embedding_forward(NULL, tok, T, C, out);
    expect("embedding_forward NULL emb -> NaN", all_nan(out, T * C), NULL);
    fill(out, T * C, 3.0f);
    rx_embedding_forward(emb, tok, 0, C, out);
    expect("embedding_forward T = 0 writes nothing", out[0] == 3.0f, NULL);

    /* tokens outside [0, vocab) are skipped: the scatter of the others */
    expect("scatter of the rest", rx_embedding_scatter(tok + 1, T - 1, C, V, d_out + C, ref) ==
                                      RX_OK, NULL);
    for (int bad = -1; bad <= V; bad += V + 1) {
        tok[0] = bad;
        rx_embedding_backward(tok, T, C, V, d_out, d_emb);
        expect("embedding_backward skips a token outside [0, vocab)",
               same_bits(d_emb, ref, V * C), NULL);
    }
    tok[0] = keep;
    rx_embedding_backward(tok, T, C, V, NULL, d_emb);
    expect("embedding_backward NULL d_out -> NaN", all_nan(d_emb, V * C), NULL);
    fill(d_emb, V * C, 3.0f);
    rx_embedding_backward(tok, T, 0, V, d_out, d_emb);
    expect("embedding_backward C = 0 writes nothing", d_emb[0] == 3.0f, NULL);
    /* d_emb overlapping d_out: refused, neither zeroed nor NaN-filled */
    float both[V * C + C], both0[V * C + C];
    fill(both, V * C + C, 2.0f);
    memcpy(both0, both, sizeof both);
    rx_embedding_backward(tok, 1, C, V, both, both + C - 1);
    expect("embedding_backward d_emb on d_out", same_bits(both0, both, V * C + C), "overlaps");
}

static void test_head(void) {
    enum { T = 5 };
    float x[T * C], hw[C * V], g[T * V], l[T * V], dx[T * C], dh[C * V];
    float l_ref[T * V], dx_ref[T * C], dh_ref[C * V];
    for (int i = 0; i < T * C; i++) x[i] = (float)((i * 5) % 7) * 0.25f - 0.75f;
    for (int i = 0; i < C * V; i++) hw[i] = (float)((i * 11) % 13) * 0.05f - 0.3f;
    for (int i = 0; i < T * V; i++) g[i] = (float)((i * 3) % 4) - 1.5f;
    expect("head_logits", rx_head_logits(x, hw, T, C, V, l_ref) == RX_OK, NULL);
    rx_head_forward(x, hw, T, C, V, l);
    expect("head_forward is head_logits", same_bits(l, l_ref, T * V), NULL);
    expect("head_grads", rx_head_grads(x, hw, g, T, C, V, dx_ref, dh_ref) == RX_OK, NULL);
    rx_head_backward(x, hw, g, T, C, V, dx, dh);
    expect("head_backward is head_grads",
           same_bits(dx, dx_ref, T * C) && same_bits(dh, dh_ref, C * V), NULL);

    rx_head_forward(x, NULL, T, C, V, l);
    expect("head_forward NULL head -> NaN logits", all_nan(l, T * V), "head is NULL");
    rx_head_backward(x, hw, NULL, T, C, V, dx, dh);
    expect("head_backward NULL dlogits -> NaN grads", all_nan(dx, T * C) && all_nan(dh, C * V),
           "dlogits is NULL");
    fill(l, T * V, 3.0f);
    rx_head_forward(x, hw, T, 0, V, l);
    expect("head_forward C = 0 writes nothing", l[0] == 3.0f, "C = 0");
    /* logits overlapping x: refused, x not NaN-filled */
    float keep[T * C];
    memcpy(keep, x, sizeof x);
    rx_head_forward(x, hw, 2, C, 2, x + C);
    expect("head_forward logits on x", same_bits(keep, x, T * C), "overlaps");
}

int main(void) {
    test_constructors();
    test_backward();
    test_cross_entropy();
    test_grad_norm();
    test_embedding();
    test_head();
    if (n_failed) fprintf(stderr, "test_legacy: %d of %d checks failed\n", n_failed, n_checks);
    else printf("test_legacy: %d checks ok\n", n_checks);
    return n_failed != 0;
}
