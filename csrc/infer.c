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
 *                 each) and the channel-mix carry. A new query selects its
 *                 chunks from the cached keys with the training forward's
 *                 own selection and softmax code (rx_attn_decode in attn.c).
 * v_first is per token and needs no carry. The arithmetic is the training
 * forward's, kernel for kernel, so the logits match a full-sequence forward
 * to float32 rounding (tests/test_infer.py).
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
    /* the recurrent steps know no adapters: a tuned model runs merged */
    if (rx_ptmodel_lora_count(m, NULL, NULL))
        return rx_fail(RX_EINVAL, "%s: the model has LoRA adapters; merge them into its "
                       "weights first", fn);
    /* the recurrent steps read the arena: a frozen base is not there */
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

static void add_rows(float *x, const float *o, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] += o[i];
}

/* x [T][C] through RWKV block ri, carries and WKV state advanced. h, o:
 * scratch [T][C]; vf [T][C] v_first (written at layer 0, read later). */
static int rwkv_step(rx_infer_state *s, int ri, float *x, float *h, float *o, float *vf,
                     rx_tm_acts *A, size_t T) {
    const rx_block_params *P = rx_ptmodel_rwkv(s->m, ri);
    const size_t C = (size_t)s->cfg.n_embd, N = (size_t)s->cfg.head_size;
    float *tmc = s->tm_carry + (size_t)ri * C, *S = s->wkv + (size_t)ri * C * N;
    rx_rownorm_forward(x, P->ln1_w, P->ln1_b, h, NULL, NULL, T, C, 1, (float)s->ctx.ln_eps);
    int first = P->tm.layer_id == 0;
    int rc = rx_tm_forward_state(&s->ctx,
                                 &P->tm, h, tmc, first ? NULL : vf, first ? vf : NULL, S, A, o);
    if (rc != RX_OK) return rc;
    memcpy(tmc, h + (T - 1) * C, C * sizeof(float));
    add_rows(x, o, T * C);
    return RX_OK;
}

/* x [T][C] through attention block ai: keys and values appended to the
 * cache at pos. q, y: scratch [T][C]. */
static int attn_step(rx_infer_state *s, int ai, float *x, float *h, float *o, float *q,
                     float *y, size_t T) {
    const rx_attn_params *P = rx_ptmodel_attn(s->m, ai);
    const size_t C = (size_t)s->cfg.n_embd, L = (size_t)s->max_len, pos = (size_t)s->pos;
    float *kc = s->kc + (size_t)ai * L * C, *vc = s->vc + (size_t)ai * L * C;
    rx_rownorm_forward(x, P->ln1_w, P->ln1_b, h, NULL, NULL, T, C, 1, (float)s->ctx.ln_eps);
    int rc = rx_sgemm(0, 0, T, C, C, h, C, P->receptance_w, C, 0.0f, q, C);
    if (rc == RX_OK) rc = rx_sgemm(0, 0, T, C, C, h, C, P->key_w, C, 0.0f, kc + pos * C, C);
    if (rc == RX_OK) rc = rx_sgemm(0, 0, T, C, C, h, C, P->value_w, C, 0.0f, vc + pos * C, C);
    if (rc == RX_OK) rc = rx_attn_decode(P, q, kc, vc, (int)pos, (int)T, y);
    if (rc == RX_OK) rc = rx_sgemm(0, 0, T, C, C, y, C, P->output_w, C, 0.0f, o, C);
    if (rc != RX_OK) return rc;
    add_rows(x, o, T * C);
    return RX_OK;
}

/* The channel-mix half of block b (either kind): x += CM(ln2(x)). */
static int cm_step(rx_infer_state *s, int b, const rx_cm_params *cm, const float *ln2_w,
                   const float *ln2_b, float *x, float *h, float *o, size_t T) {
    const size_t C = (size_t)s->cfg.n_embd;
    float *cmc = s->cm_carry + (size_t)b * C;
    rx_rownorm_forward(x, ln2_w, ln2_b, h, NULL, NULL, T, C, 1, (float)s->ctx.ln_eps);
    int rc = rx_channelmix_forward_seq(cm, h, cmc, o, 1, (int)T);
    if (rc != RX_OK) return rc;
    memcpy(cmc, h + (T - 1) * C, C * sizeof(float));
    add_rows(x, o, T * C);
    return RX_OK;
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
    float *buf = rx_falloc(6 * TT * C);
    if (!buf) {
        free(tok);
        return rx_fail(RX_ENOMEM, "%s: out of memory for T = %d", fn, T);
    }
    float *x = buf, *h = x + TT * C, *o = h + TT * C, *vf = o + TT * C, *q = vf + TT * C;
    float *y = q + TT * C;
    /* time-mix intermediates: one set for layer 0, one shared by the later
     * layers (their layout has the value-residual buffers) */
    rx_tm_acts A[2];
    memset(A, 0, sizeof A);
    const int nr = s->cfg.n_rwkv_layer;
    int rc = rx_tm_acts_alloc(&A[0], &rx_ptmodel_rwkv(s->m, 0)->tm, 1, TT);
    if (rc == RX_OK && nr > 1) rc = rx_tm_acts_alloc(&A[1], &rx_ptmodel_rwkv(s->m, 1)->tm, 1, TT);
    if (rc == RX_OK) {
        if (s->ln0_w) {
            rc = rx_embedding_gather(s->emb, tok, T, (int)C, (int)V, h);
            rx_rownorm_forward(h, s->ln0_w, s->ln0_b, x, NULL, NULL, TT, C, 1,
                               (float)s->ctx.ln_eps);
        } else {
            rc = rx_embedding_gather(s->emb, tok, T, (int)C, (int)V, x);
        }
        int ri = 0, ai = 0;
        for (int b = 0; b < s->n_blocks && rc == RX_OK; b++) {
            if (s->layers[b] == 'R') {
                const rx_block_params *P = rx_ptmodel_rwkv(s->m, ri);
                rc = rwkv_step(s, ri, x, h, o, vf, &A[ri > 0], TT);
                ri++;
                if (rc == RX_OK) rc = cm_step(s, b, &P->cm, P->ln2_w, P->ln2_b, x, h, o, TT);
            } else {
                const rx_attn_params *P = rx_ptmodel_attn(s->m, ai);
                rc = attn_step(s, ai++, x, h, o, q, y, TT);
                if (rc == RX_OK) rc = cm_step(s, b, &P->cm, P->ln2_w, P->ln2_b, x, h, o, TT);
            }
        }
    }
    if (rc == RX_OK) {
        rx_rownorm_forward(x, s->ln_out_w, s->ln_out_b, h, NULL, NULL, TT, C, 1,
                           (float)s->ctx.ln_eps);
        rc = rx_head_logits(h, s->head, T, (int)C, (int)V, logits);
    }
    if (rc == RX_OK) {
        s->pos += T;
    }
    rx_tm_acts_free(&A[0]);
    rx_tm_acts_free(&A[1]);
    free(buf);
    free(tok);
    return rc;
}
