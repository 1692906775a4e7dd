/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * infer.c -- recurrent inference for generation: the model advanced over
 * the next T tokens of one sequence from a carried state, T = the prompt
 * length once, then T = 1 per generated token.
 *
 * State per block, enough to continue exactly where the last call stopped:
 *   RWKV-7 block: the WKV state [H][N][N] and the two token-shift carries
 *                 (the last token's ln1 and ln2 outputs, [C] each);
 *   attention block: every earlier position's key and value ([max_len][C]
 *                 each) and the channel-mix carry.
 * v_first is per token and needs no carry. Each block advances through its
 * step function (rx_block_step, rx_attn_step), the training forward's own
 * code taking the model's context, so a call at position 0 gives the
 * training forward's bits, and later calls its logits to float32 rounding
 * (tests/test_infer.py). This file holds the state, the embedding (and
 * ln0), the blocks in model order, ln_out and the head.
 *
 * The state reads the model's parameters live (through the public param
 * structs); it must not outlive the model.
 */
#include <string.h>

#include "rx_internal.h"

struct rx_infer_state {
    rx_ptmodel *m;
    rx_pt_config cfg;
    rx_model_ctx ctx;          /* the model's settings (its eps), as training reads them */
    const char *layers;        /* block kinds in model order */
    int n_blocks, max_len, pos;
    const float *emb, *ln0_w, *ln0_b, *ln_out_w, *ln_out_b, *head;   /* ln0: NULL without */
    float *tm_carry;           /* [n_rwkv][C] last ln1 output */
    float *cm_carry;           /* [n_blocks][C] last ln2 output */
    float *wkv;                /* [n_rwkv][H][N][N] */
    float *kc, *vc;            /* [n_attn][max_len][C] key / value cache */
};

static const float *param_named(rx_ptmodel *m, const char *want) {
    for (int i = 0; i < rx_ptmodel_num_params(m); i++) {
        const char *name;
        float *data, *grad;
        int n;
        if (rx_ptmodel_param(m, i, &name, &data, &grad, &n) == RX_OK && strcmp(name, want) == 0)
            return data;
    }
    return NULL;
}

void rx_infer_free(rx_infer_state *s) {
    if (!s) return;
    free(s->tm_carry);
    free(s->cm_carry);
    free(s->wkv);
    free(s->kc);
    free(s->vc);
    free(s);
}

void rx_infer_reset(rx_infer_state *s) {
    if (!s) return;
    const size_t C = (size_t)s->cfg.n_embd, N = (size_t)s->cfg.head_size;
    const size_t nr = (size_t)s->cfg.n_rwkv_layer;
    rx_fzero(s->tm_carry, nr * C);
    rx_fzero(s->cm_carry, (size_t)s->n_blocks * C);
    /* a model with trainable initial states starts every sequence from them */
    const float *s0 = rx_ptmodel_state_arena(s->m, NULL);
    if (s0) memcpy(s->wkv, s0, nr * C * N * sizeof(float));
    else rx_fzero(s->wkv, nr * C * N);
    s->pos = 0;
}

int rx_infer_create(rx_ptmodel *m, int max_len, rx_infer_state **out) {
    static const char *const fn = "rx_infer_create";
    if (!out) return rx_fail(RX_EINVAL, "%s: out is NULL", fn);
    *out = NULL;
    if (!m) return rx_fail(RX_EINVAL, "%s: model is NULL", fn);
    if (max_len < 1) return rx_fail(RX_EINVAL, "%s: max_len = %d must be >= 1", fn, max_len);
    /* the steps' projections run without the model's adapter table: a
     * tuned model runs merged */
    if (rx_ptmodel_lora_count(m, NULL, NULL))
        return rx_fail(RX_EINVAL, "%s: the model has LoRA adapters; merge them into its "
                       "weights first", fn);
    /* the embedding, the head and the steps read the arena: a frozen base
     * is not there */
    if (rx_ptmodel_base_store(m))
        return rx_fail(RX_EINVAL, "%s: the model holds a frozen base; release it "
                       "(rx_ptmodel_base_release) first", fn);
    rx_infer_state *s = calloc(1, sizeof *s);
    if (!s) return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    s->m = m;
    s->cfg = rx_ptmodel_config(m);
    rx_ptmodel_ctx(m, &s->ctx);
    s->layers = rx_ptmodel_layers(m);
    s->n_blocks = s->cfg.n_rwkv_layer + s->cfg.n_attn_layer;
    s->max_len = max_len;
    s->emb = param_named(m, "emb");
    s->ln0_w = param_named(m, "ln0_w");
    s->ln0_b = param_named(m, "ln0_b");
    s->ln_out_w = param_named(m, "ln_out_w");
    s->ln_out_b = param_named(m, "ln_out_b");
    s->head = param_named(m, "head");
    const size_t C = (size_t)s->cfg.n_embd, N = (size_t)s->cfg.head_size;
    const size_t nr = (size_t)s->cfg.n_rwkv_layer, na = (size_t)s->cfg.n_attn_layer;
    s->tm_carry = rx_falloc(nr * C);
    s->cm_carry = rx_falloc((size_t)s->n_blocks * C);
    s->wkv = rx_falloc(nr * C * N);
    s->kc = rx_falloc(na * (size_t)max_len * C);
    s->vc = rx_falloc(na * (size_t)max_len * C);
    /* every model has its named tensors: only the buffers can be missing */
    if (!s->tm_carry || !s->cm_carry || !s->wkv || !s->kc || !s->vc) {
        rx_infer_free(s);
        return rx_fail(RX_ENOMEM, "%s: out of memory for max_len = %d", fn, max_len);
    }
    rx_infer_reset(s);
    *out = s;
    return RX_OK;
}

rx_infer_state *rx_infer_new(rx_ptmodel *m, int max_len) {
    rx_infer_state *s;
    rx_infer_create(m, max_len, &s);
    return s;
}

int rx_infer_pos(const rx_infer_state *s) { return s ? s->pos : -1; }

/* Block acts for one call of T tokens: RWKV block 0's and the later RWKV
 * blocks' (their layout has the value-residual buffers), one attention
 * set; each shared by the blocks of its kind, which run one at a time */
typedef struct {
    rx_block_acts r[2];
    rx_attn_acts *a;
} step_acts;

static void step_acts_free(step_acts *A) {
    rx_block_acts_free(&A->r[0]);
    rx_block_acts_free(&A->r[1]);
    rx_attn_acts_free(A->a);
}

static int step_acts_alloc(const rx_infer_state *s, size_t T, step_acts *A) {
    memset(A, 0, sizeof *A);
    const int nr = s->cfg.n_rwkv_layer;
    int rc = RX_OK;
    for (int i = 0; i < 2 && i < nr && rc == RX_OK; i++)
        rc = rx_block_acts_alloc(&A->r[i], rx_ptmodel_rwkv(s->m, i), 1, T);
    if (rc == RX_OK && s->cfg.n_attn_layer > 0 &&
        !(A->a = rx_attn_acts_new(rx_ptmodel_attn(s->m, 0), 1, T)))
        rc = RX_ENOMEM;
    return rc;
}

/* x [T][C] through every block in model order, y [T][C] the other buffer;
 * *out: which of the two holds the result. vf [T][C]: v_first. */
static int blocks_forward(rx_infer_state *s, step_acts *A, float *x, float *y, float *vf,
                          float **out) {
    const size_t C = (size_t)s->cfg.n_embd, N = (size_t)s->cfg.head_size;
    const size_t L = (size_t)s->max_len;
    int rc = RX_OK, ri = 0, ai = 0;
    for (int b = 0; b < s->n_blocks && rc == RX_OK; b++) {
        float *cmc = s->cm_carry + (size_t)b * C;
        if (s->layers[b] == 'R') {
            const size_t i = (size_t)ri++;
            rc = rx_block_step(&s->ctx, rx_ptmodel_rwkv(s->m, (int)i), x, s->tm_carry + i * C,
                               cmc, i ? vf : NULL, i ? NULL : vf, s->wkv + i * C * N,
                               &A->r[i > 0], y);
        } else {
            const size_t i = (size_t)ai++;
            rc = rx_attn_step(&s->ctx, rx_ptmodel_attn(s->m, (int)i), x, cmc,
                              s->kc + i * L * C, s->vc + i * L * C, s->pos, A->a, y);
        }
        float *t = x;
        x = y;
        y = t;
    }
    *out = x;
    return rc;
}

/* tokens [T], each in [0, vocab); logits [T][vocab] */
int rx_infer_forward(rx_infer_state *s, const int *tokens, int T, float *logits) {
    static const char *const fn = "rx_infer_forward";
    if (!s || !tokens || !logits)
        return rx_fail(RX_EINVAL, "%s: %s is NULL", fn,
                       !s ? "state" : !tokens ? "tokens" : "logits");
    if (T < 1) return rx_fail(RX_EINVAL, "%s: T = %d must be >= 1", fn, T);
    if (s->cfg.n_attn_layer > 0 && (int64_t)s->pos + T > s->max_len)
        return rx_fail(RX_EINVAL, "%s: %d tokens at position %d would pass max_len = %d", fn, T,
                       s->pos, s->max_len);
    const size_t C = (size_t)s->cfg.n_embd, TT = (size_t)T, V = (size_t)s->cfg.vocab_size;
    /* the ids are copied, then checked: a caller's thread writing to tokens
     * meanwhile cannot slip an id past the check into the embedding */
    int *tok = rx_alloc(TT, sizeof(int));
    if (!tok) return rx_fail(RX_ENOMEM, "%s: out of memory for T = %d", fn, T);
    memcpy(tok, tokens, TT * sizeof(int));
    for (size_t t = 0; t < TT; t++)
        if (tok[t] < 0 || tok[t] >= s->cfg.vocab_size) {
            const int bad = tok[t];
            free(tok);
            return rx_fail(RX_EINVAL, "%s: token %d at position %zu is outside [0, %d)", fn, bad,
                           t, s->cfg.vocab_size);
        }
    float *buf = rx_falloc(3 * TT * C);
    step_acts A;
    int rc = step_acts_alloc(s, TT, &A);
    if (rc != RX_OK || !buf) {
        step_acts_free(&A);
        free(buf);
        free(tok);
        return rx_fail(RX_ENOMEM, "%s: out of memory for T = %d", fn, T);
    }
    float *x = buf, *y = x + TT * C, *vf = y + TT * C;
    /* the projections in fp32 whatever the thread had set (rx_pretrain.h) */
    const int old = rx_gemm_set_precision(RX_PRECISION_FP32);
    if (s->ln0_w) {
        rc = rx_embedding_gather(s->emb, tok, T, (int)C, (int)V, y);
        rx_rownorm_forward(y, s->ln0_w, s->ln0_b, x, NULL, NULL, TT, C, 1, (float)s->ctx.ln_eps);
    } else {
        rc = rx_embedding_gather(s->emb, tok, T, (int)C, (int)V, x);
    }
    if (rc == RX_OK) rc = blocks_forward(s, &A, x, y, vf, &x);
    if (rc == RX_OK) {
        y = x == buf ? buf + TT * C : buf;
        rx_rownorm_forward(x, s->ln_out_w, s->ln_out_b, y, NULL, NULL, TT, C, 1,
                           (float)s->ctx.ln_eps);
        rc = rx_head_logits(y, s->head, T, (int)C, (int)V, logits);
    }
    rx_gemm_set_precision(old);
    if (rc == RX_OK) s->pos += T;
    step_acts_free(&A);
    free(buf);
    free(tok);
    return rc;
}
