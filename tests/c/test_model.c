/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * test_model.c -- the whole model through the C API, under the sanitizers:
 * config validation, arena layout and introspection, the splitmix64 init
 * against an independent double-precision loop, forward logits and loss
 * against double loops over the cached activations, the gradient along
 * itself against a central difference of the loss, batches against single
 * sequences, and rejection of bad tokens, targets and sizes. Returns
 * nonzero on any failure.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rx_pretrain.h"
#include "check.h"

static const rx_pt_config BASE = {
    .n_embd = 16, .n_head = 2, .head_size = 8, .n_rwkv_layer = 3, .n_attn_layer = 1,
    .vocab_size = 23, .Dw = 4, .Da = 4, .Dg = 6, .Dv = 3, .ffn_dim = 24,
    .chunk_size = 4, .moba_top_k = 1,
};
#define SEQ 11   /* tokens per sequence */

static void test_configs(void) {
    rx_pt_config bad[16];
    int n = 0;
    for (int i = 0; i < 16; i++) bad[i] = BASE;
    bad[n++].n_head = 3;            /* n_head*head_size != n_embd */
    bad[n++].n_attn_layer = 4;      /* more attention than RWKV blocks */
    bad[n++].n_attn_layer = -1;
    bad[n++].n_rwkv_layer = 0;
    bad[n++].n_embd = 0;
    bad[n++].vocab_size = -5;
    bad[n++].Dw = 0;
    bad[n++].Da = 0;
    bad[n++].Dg = -1;
    bad[n++].Dv = 0;
    bad[n++].ffn_dim = 0;
    bad[n++].chunk_size = 0;
    bad[n].n_head = -2;             /* the product matches, the sizes do not */
    bad[n++].head_size = -8;
    bad[n++].vocab_size = 1 << 28;  /* emb would exceed 2^31 - 1 elements */
    for (int i = 0; i < n; i++) {
        CHECK(rx_pt_config_validate(&bad[i]) == RX_ECONFIG, "bad config %d validated", i);
        rx_ptmodel *m = NULL;
        CHECK(rx_model_create(&bad[i], 0, 1, &m) == RX_ECONFIG && m == NULL,
              "bad config %d built a model", i);
        rx_ptmodel_free(m);
    }
    CHECK(rx_pt_config_validate(&BASE) == RX_OK, "BASE rejected");
    rx_ptmodel *m = NULL;
    CHECK(rx_model_create(NULL, 0, 1, &m) == RX_EINVAL && m == NULL, "NULL config built a model");
    rx_pt_config no_attn = BASE;
    no_attn.n_attn_layer = 0;
    CHECK(rx_model_create(&no_attn, 0, 1, &m) == RX_OK, "n_attn 0 model");
    CHECK(m && strcmp(rx_ptmodel_layers(m), "RRR") == 0, "n_attn 0 layers");
    CHECK(m && rx_ptmodel_attn(m, 0) == NULL, "attention block of an RWKV-only model");
    rx_ptmodel_free(m);
    rx_ptmodel_free(NULL);
}

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void test_layout_and_init(rx_ptmodel *m, uint64_t seed) {
    int n_t = rx_ptmodel_num_params(m);
    CHECK(n_t == 4 + 30 + 33 + 33 + 11, "tensor count %d", n_t);
    CHECK(strcmp(rx_ptmodel_layers(m), "RRRA") == 0, "layers %s", rx_ptmodel_layers(m));
    int64_t n_elems, n_grad;
    float *params = rx_ptmodel_param_arena(m, &n_elems), *grads = rx_ptmodel_grad_arena(m, &n_grad);
    CHECK(params && grads && n_elems == n_grad && n_elems > 0, "arenas");
    /* tensors lie back to back in both arenas; shapes match counts */
    int64_t off = 0;
    const char *name;
    float *data, *grad;
    int n, shape[2];
    for (int i = 0; i < n_t; i++) {
        CHECK(rx_ptmodel_param(m, i, &name, &data, &grad, &n) == RX_OK, "param %d", i);
        CHECK(data == params + off && grad == grads + off, "tensor %d (%s) not contiguous", i, name);
        int nd = rx_ptmodel_param_shape(m, i, shape);
        CHECK((nd == 1 && shape[0] == n) || (nd == 2 && shape[0] * shape[1] == n),
              "shape of %s", name);
        off += n;
    }
    CHECK(off == n_elems, "arena size %lld != sum %lld", (long long)n_elems, (long long)off);
    CHECK(rx_ptmodel_param(m, n_t, &name, &data, &grad, &n) == RX_EINVAL, "index past end");
    CHECK(rx_ptmodel_param(m, -1, &name, &data, &grad, &n) == RX_EINVAL, "negative index");
    CHECK(rx_ptmodel_param_shape(m, n_t, shape) == RX_EINVAL, "shape past end");
    rx_ptmodel_param(m, 0, &name, NULL, NULL, &n);
    CHECK(strcmp(name, "emb") == 0 && n == 23 * 16, "tensor 0 is %s", name);
    rx_ptmodel_param(m, 1, &name, NULL, NULL, NULL);
    CHECK(strcmp(name, "blocks.0.ln1_w") == 0, "tensor 1 is %s", name);
    rx_ptmodel_param(m, 1 + 30, &name, NULL, NULL, NULL);   /* emb, block 0, then block 1 */
    CHECK(strcmp(name, "blocks.1.ln1_w") == 0, "block 1 starts with %s", name);
    rx_ptmodel_param(m, n_t - 1, &name, NULL, NULL, NULL);
    CHECK(strcmp(name, "head") == 0, "last tensor is %s", name);

    /* the views the block kernels get are the arena tensors */
    const rx_block_params *b1 = rx_ptmodel_rwkv(m, 1);
    const rx_attn_params *a0 = rx_ptmodel_attn(m, 0);
    CHECK(b1 && b1->tm.layer_id == 1 && b1->tm.v0 && b1->tm.c == 16, "rwkv 1 view");
    CHECK(rx_ptmodel_rwkv(m, 0)->tm.v0 == NULL, "rwkv 0 has v0");
    CHECK(a0 && a0->chunk_size == 4 && a0->moba_top_k == 1 && a0->cm.ffn_dim == 24, "attn view");
    CHECK(rx_ptmodel_rwkv(m, 3) == NULL && rx_ptmodel_attn(m, 1) == NULL, "views past end");
    rx_pt_config c = rx_ptmodel_config(m);
    CHECK(memcmp(&c, &BASE, sizeof c) == 0, "config round trip");

    /* init: the docs/layout.md §Init scheme in double, element by element */
    uint64_t s = seed;
    off = 0;
    for (int i = 0; i < n_t; i++) {
        rx_ptmodel_param(m, i, &name, &data, NULL, &n);
        int nd = rx_ptmodel_param_shape(m, i, shape);
        const char *last = strrchr(name, '.') ? strrchr(name, '.') + 1 : name;
        int is_ln = strncmp(last, "ln", 2) == 0, len = (int)strlen(last);
        for (int e = 0; e < n; e++) {
            double d = (double)(splitmix64(&s) >> 40) / 16777216.0 - 0.5, want;
            if (i == 0) want = d * 0.5;
            else if (nd == 2) want = d * 0.3;
            else if (is_ln && last[len - 1] == 'w') { volatile double p = 0.2 * d; want = 1.0 + p; }
            else if (is_ln && last[len - 1] == 'b') want = 0.2 * d;
            else want = d * 0.5;
            float wf = (float)want;
            if (memcmp(&wf, &data[e], sizeof wf) != 0) {
                CHECK(0, "init of %s[%d]: %.9g != %.9g", name, e, data[e], wf);
                break;
            }
        }
    }
    for (int64_t i = 0; i < n_grad; i++)
        if (grads[i] != 0.0f) {
            CHECK(0, "grad arena not zero at creation");
            break;
        }
}

/* loss of the model on tokens/targets through forward + CE on the logits */
/* The exported time-mix schema: one pointer slot per field, in order, ending
 * each struct; the model's blocks 0 and 1 hold exactly its fields in its
 * order (block 0 without the at_layer0 = 0 ones), and the pointer at each
 * offset of the live views is that tensor's data and grad. */
static void test_tm_schema(rx_ptmodel *m) {
    const int nf = rx_tm_num_fields();
    CHECK(nf > 0, "no time-mix fields");
    CHECK(rx_tm_field(nf, NULL, NULL, NULL, NULL, NULL) == RX_EINVAL &&
              rx_tm_field(-1, NULL, NULL, NULL, NULL, NULL) == RX_EINVAL,
          "field index out of range");
    const size_t p0 = offsetof(rx_tm_params, x_r);
    for (int blk = 0; blk < 2; blk++) {
        const rx_block_params *P = rx_ptmodel_rwkv(m, blk);
        const int first = blk == 0 ? 3 : 3 + 30;   /* emb, [block 0,] ln1_w, ln1_b */
        int t = first;
        for (int i = 0; i < nf; i++) {
            const char *fname, *dims[2], *name;
            size_t p_off, g_off;
            int at0, n;
            float *data, *grad;
            CHECK(rx_tm_field(i, &fname, &p_off, &g_off, dims, &at0) == RX_OK, "field %d", i);
            CHECK(p_off == p0 + (size_t)i * sizeof(float *) && g_off == (size_t)i * sizeof(float *),
                  "field %s at offsets %zu, %zu", fname, p_off, g_off);
            CHECK(dims[0] != NULL, "field %s has no rows", fname);
            const float *view = *(const float *const *)((const char *)&P->tm + p_off);
            if (blk == 0 && !at0) {
                CHECK(view == NULL, "block 0 has %s", fname);
                continue;
            }
            rx_ptmodel_param(m, t++, &name, &data, &grad, &n);
            char want[64];
            snprintf(want, sizeof want, "blocks.%d.tm.%s", blk, fname);
            CHECK(strcmp(name, want) == 0, "tensor %d is %s, the schema says %s", t - 1, name,
                  want);
            CHECK(view == data, "%s: view at its offset is not its data", want);
        }
        const char *next;
        rx_ptmodel_param(m, t, &next, NULL, NULL, NULL);
        char want[64];
        snprintf(want, sizeof want, "blocks.%d.ln2_w", blk);
        CHECK(strcmp(next, want) == 0, "block %d: %s follows the time-mix", blk, next);
    }
    CHECK(p0 + (size_t)nf * sizeof(float *) == sizeof(rx_tm_params) &&
              (size_t)nf * sizeof(float *) == sizeof(rx_tm_grads),
          "the schema does not cover the structs");
}

static double loss_of(rx_ptmodel *m, rx_pt_acts *a, const int *tok, const int *tgt, int ign) {
    double loss;
    if (rx_pretrain_forward(m, tok, SEQ, a) != RX_OK ||
        rx_cross_entropy(a->logits, tgt, SEQ, a->vocab, ign, NULL, &loss) != RX_OK)
        return NAN;
    return loss;
}

static void test_forward_backward(rx_ptmodel *m) {
    const int V = BASE.vocab_size, C = BASE.n_embd, ign = 4;
    int tok[SEQ], tgt[SEQ];
    for (int t = 0; t < SEQ; t++) {
        tok[t] = (5 * t + 2) % V;
        tgt[t] = (3 * t + 1) % V;
    }
    tgt[3] = ign;
    rx_pt_acts *a = NULL;
    CHECK(rx_pt_acts_create(m, 1, SEQ, &a) == RX_OK, "acts");
    CHECK(a && a->B == 1 && a->T == SEQ && a->n_blocks == 4, "acts");
    if (!a) return;
    double loss = -1.0, l2;
    CHECK(rx_pretrain_backward_loss(m, a, tgt, 1, SEQ, ign, &loss) == RX_EINVAL && loss == -1.0,
          "backward before forward");
    CHECK(rx_pretrain_forward(m, tok, SEQ, a) == RX_OK, "forward");

    /* logits = lnout . head and the loss, in double */
    float *head;
    int n_t = rx_ptmodel_num_params(m);
    rx_ptmodel_param(m, n_t - 1, NULL, &head, NULL, NULL);
    double err = 0.0, scale = 0.0, want_loss = 0.0;
    int n_valid = 0;
    for (int t = 0; t < SEQ; t++) {
        double mx = -INFINITY, se = 0.0;
        for (int v = 0; v < V; v++) {
            double y = 0.0;
            for (int c = 0; c < C; c++) y += (double)a->lnout[t * C + c] * head[c * V + v];
            err = fmax(err, fabs(y - a->logits[t * V + v]));
            scale = fmax(scale, fabs(y));
            mx = fmax(mx, a->logits[t * V + v]);
        }
        for (int v = 0; v < V; v++) se += exp(a->logits[t * V + v] - mx);
        if (tgt[t] != ign) {
            want_loss += mx + log(se) - a->logits[t * V + tgt[t]];
            n_valid++;
        }
    }
    want_loss /= n_valid;
    CHECK(err <= 1e-5 * scale, "logits vs double: %g (scale %g)", err, scale);
    CHECK(rx_pretrain_backward_loss(m, a, tgt, 1, SEQ, ign, &loss) == RX_OK, "backward");
    CHECK(isfinite(loss) && fabs(loss - want_loss) <= 1e-5 * want_loss, "loss %.9g vs %.9g",
          loss, want_loss);

    /* the gradient along itself: (L(p + h g/|g|) - L(p - h g/|g|)) / 2h ~ |g|.
     * h is small enough that no MoBA selection flips (a hard choice the
     * gradient does not see) and large enough for fp32 losses */
    int64_t n;
    float *p = rx_ptmodel_param_arena(m, &n), *g = rx_ptmodel_grad_arena(m, &n);
    float *p0 = malloc((size_t)n * sizeof(float)), *g0 = malloc((size_t)n * sizeof(float));
    double gn = 0.0;
    for (int64_t i = 0; i < n; i++) {
        CHECK(isfinite(g[i]), "grad %lld not finite", (long long)i);
        gn += (double)g[i] * g[i];
    }
    gn = sqrt(gn);
    memcpy(p0, p, (size_t)n * sizeof(float));
    memcpy(g0, g, (size_t)n * sizeof(float));
    const double h = 1e-3;
    for (int64_t i = 0; i < n; i++) p[i] = (float)(p0[i] + h * g0[i] / gn);
    double lp = loss_of(m, a, tok, tgt, ign);
    for (int64_t i = 0; i < n; i++) p[i] = (float)(p0[i] - h * g0[i] / gn);
    double lm = loss_of(m, a, tok, tgt, ign);
    memcpy(p, p0, (size_t)n * sizeof(float));
    double fd = (lp - lm) / (2 * h);
    CHECK(gn > 0.0 && fabs(fd - gn) <= 1e-3 * gn, "directional derivative %.6g vs |g| %.6g", fd,
          gn);

    /* bad input: rejected, nothing written */
    rx_pretrain_forward(m, tok, SEQ, a);
    int bad[SEQ];
    memcpy(bad, tok, sizeof bad);
    bad[SEQ - 1] = V;
    CHECK(rx_pretrain_forward(m, bad, SEQ, a) == RX_EINVAL, "token == vocab");
    bad[SEQ - 1] = -1;
    CHECK(rx_pretrain_forward(m, bad, SEQ, a) == RX_EINVAL, "token < 0");
    CHECK(rx_pretrain_forward(m, tok, SEQ - 1, a) == RX_EINVAL, "SEQ != acts SEQ");
    CHECK(rx_pretrain_forward(m, NULL, SEQ, a) == RX_EINVAL, "NULL tokens");
    CHECK(rx_pretrain_forward(m, tok, SEQ, NULL) == RX_EINVAL, "NULL acts");
    CHECK(rx_pretrain_forward(NULL, tok, SEQ, a) == RX_EINVAL, "NULL model");
    CHECK(a->ready, "a rejected forward must leave the previous one intact");
    memcpy(bad, tgt, sizeof bad);
    bad[0] = V;
    memset(g, 0, (size_t)n * sizeof(float));
    CHECK(rx_pretrain_backward_loss(m, a, bad, 1, SEQ, ign, &l2) == RX_EINVAL, "target == vocab");
    bad[0] = -2;
    CHECK(rx_pretrain_backward_loss(m, a, bad, 1, SEQ, ign, &l2) == RX_EINVAL, "target < 0");
    bad[0] = -1;
    CHECK(rx_pretrain_backward_loss(m, a, bad, 1, SEQ, -1, &l2) == RX_EINVAL,
          "target -1 with ignore_index -1");
    CHECK(rx_pretrain_backward_loss(m, a, tgt, 1, SEQ - 1, ign, &l2) == RX_EINVAL,
          "SEQ != acts SEQ");
    CHECK(rx_pretrain_backward_loss(m, a, NULL, 1, SEQ, ign, &l2) == RX_EINVAL, "NULL targets");
    for (int64_t i = 0; i < n; i++)
        if (g[i] != 0.0f) {
            CHECK(0, "a rejected backward wrote grads");
            break;
        }
    for (int t = 0; t < SEQ; t++) bad[t] = ign;
    CHECK(rx_pretrain_backward_loss(m, a, bad, 1, SEQ, ign, &l2) == RX_OK && l2 == 0.0,
          "no valid target: loss 0");
    CHECK(rx_pretrain_backward_loss(m, a, tgt, 1, SEQ, ign, &l2) == RX_OK && l2 == loss,
          "backward is repeatable");
    for (int64_t i = 0; i < n; i++)
        if (g[i] != g0[i]) {
            CHECK(0, "repeated backward differs at %lld", (long long)i);
            break;
        }
    rx_ptmodel_zero_grad(m);
    CHECK(g[0] == 0.0f && g[n - 1] == 0.0f, "zero_grad");
    free(p0);
    free(g0);
    rx_pt_acts_free(a);
}

static void test_batch(rx_ptmodel *m) {
    const int V = BASE.vocab_size, B = 2, ign = 4;
    int tok[B * SEQ], tgt[B * SEQ];
    for (int i = 0; i < B * SEQ; i++) {
        tok[i] = (7 * i + 1) % V;
        tgt[i] = (11 * i + 5) % V;
    }
    tgt[2] = tgt[3] = tgt[SEQ + 5] = ign;
    rx_pt_acts *ab = NULL, *a1 = NULL, *z = NULL;
    CHECK(rx_pt_acts_create(m, B, SEQ, &ab) == RX_OK && rx_pt_acts_create(m, 1, SEQ, &a1) == RX_OK,
          "acts");
    if (!ab || !a1) goto done;
    CHECK(rx_pretrain_forward(m, tok, SEQ, ab) == RX_EINVAL, "B=1 forward into B=2 acts");
    CHECK(rx_pretrain_forward_batch(m, tok, B, SEQ, ab) == RX_OK, "batched forward");
    double loss = NAN, lb;
    CHECK(rx_pretrain_backward_loss(m, ab, tgt, B, SEQ, ign, &loss) == RX_OK, "batched backward");
    CHECK(rx_pretrain_backward_loss(m, ab, tgt, 1, 2 * SEQ, ign, &lb) == RX_EINVAL,
          "B*SEQ split differs");
    int64_t n;
    float *g = rx_ptmodel_grad_arena(m, &n);
    double *gsum = calloc((size_t)n, sizeof(double));
    float *gb = malloc((size_t)n * sizeof(float));
    memcpy(gb, g, (size_t)n * sizeof(float));
    double lsum = 0.0;
    int nv_all = 0;
    for (int b = 0; b < B; b++) {
        int nv = 0;
        for (int t = 0; t < SEQ; t++) nv += tgt[b * SEQ + t] != ign;
        rx_pretrain_forward(m, tok + b * SEQ, SEQ, a1);
        lb = NAN;
        CHECK(rx_pretrain_backward_loss(m, a1, tgt + b * SEQ, 1, SEQ, ign, &lb) == RX_OK,
              "backward of sequence %d", b);
        lsum += nv * lb;
        for (int64_t i = 0; i < n; i++) gsum[i] += (double)nv * g[i];
        nv_all += nv;
    }
    CHECK(fabs(loss - lsum / nv_all) <= 1e-6 * loss, "batch loss %.9g vs %.9g", loss,
          lsum / nv_all);
    double err = 0.0, scale = 0.0;
    for (int64_t i = 0; i < n; i++) {
        err = fmax(err, fabs(gb[i] - gsum[i] / nv_all));
        scale = fmax(scale, fabs(gsum[i] / nv_all));
    }
    CHECK(err <= 1e-5 * scale, "batch grads: %g (scale %g)", err, scale);
    free(gsum);
    free(gb);
done:
    rx_pt_acts_free(ab);
    rx_pt_acts_free(a1);
    CHECK(rx_pt_acts_create(m, 1, 0, &z) == RX_EINVAL &&
              rx_pt_acts_create(m, 0, 4, &z) == RX_EINVAL,
          "size 0 acts");
    CHECK(rx_pt_acts_create(m, 1 << 20, 1 << 20, &z) == RX_EINVAL, "B*SEQ past int");
    CHECK(rx_pt_acts_create(NULL, 1, 4, &z) == RX_EINVAL && z == NULL, "acts of no model");
}

/* RX_PT_LN0: ln0_w, ln0_b right after emb; unknown flag bits are refused.
 * (Its maths: tests/test_ln0.py.) */
static void test_ln0_flag(uint64_t seed) {
    rx_ptmodel *plain = NULL, *ln0 = NULL;
    CHECK(rx_model_create(&BASE, 1 << 5, seed, &plain) == RX_EINVAL && plain == NULL,
          "unknown flag accepted");
    CHECK(rx_ptmodel_flags(NULL) == -1, "flags of no model");
    CHECK(rx_model_create(&BASE, 0, seed, &plain) == RX_OK &&
              rx_model_create(&BASE, RX_PT_LN0, seed, &ln0) == RX_OK,
          "models");
    if (plain && ln0) {
        int64_t n0, n2;
        rx_ptmodel_param_arena(plain, &n0);
        rx_ptmodel_param_arena(ln0, &n2);
        CHECK(n2 == n0 + 2 * 16, "ln0 arena %lld", (long long)n2);
        CHECK(rx_ptmodel_flags(ln0) == RX_PT_LN0 && rx_ptmodel_flags(plain) == 0, "flags");
        CHECK(rx_ptmodel_num_params(ln0) == rx_ptmodel_num_params(plain) + 2, "tensor count");
        const char *name;
        float *data, *grad;
        int n;
        rx_ptmodel_param(ln0, 1, &name, &data, &grad, &n);
        CHECK(strcmp(name, "ln0_w") == 0 && n == 16, "tensor 1 is %s", name);
        rx_ptmodel_param(ln0, 2, &name, &data, &grad, &n);
        CHECK(strcmp(name, "ln0_b") == 0 && n == 16, "tensor 2 is %s", name);
        rx_ptmodel_param(ln0, 3, &name, &data, &grad, &n);
        CHECK(strcmp(name, "blocks.0.ln1_w") == 0, "tensor 3 is %s", name);
    }
    rx_ptmodel_free(plain);
    rx_ptmodel_free(ln0);
}

/* RX_PT_DENSE: a flag of an RX_PT_NO_INIT model only, kept in its flags
 * (the huge pages it asks for: tests/test_hugepages.py) */
static void test_dense_flag(uint64_t seed) {
    rx_ptmodel *m = NULL;
    CHECK(rx_model_create(&BASE, RX_PT_DENSE, seed, &m) == RX_EINVAL && m == NULL,
          "RX_PT_DENSE with an init accepted");
    CHECK(rx_model_create(&BASE, RX_PT_NO_INIT | RX_PT_DENSE, seed, &m) == RX_OK, "dense model");
    CHECK(rx_ptmodel_flags(m) == (RX_PT_NO_INIT | RX_PT_DENSE), "flags %d", rx_ptmodel_flags(m));
    rx_ptmodel_free(m);
}

int main(void) {
    test_configs();
    test_ln0_flag(7);
    test_dense_flag(7);
    const uint64_t seed = 0x0123456789ABCDEFull;
    rx_ptmodel *m = NULL;
    CHECK(rx_model_create(&BASE, 0, seed, &m) == RX_OK, "model");
    if (m) {
        test_layout_and_init(m, seed);
        test_tm_schema(m);
        test_forward_backward(m);
        test_batch(m);
    }
    rx_ptmodel_free(m);
    if (failures) fprintf(stderr, "%d failure(s)\n", failures);
    else printf("test_model: ok\n");
    return failures != 0;
}
