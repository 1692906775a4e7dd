/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * gen.c -- batched recurrent generation: n_slots sequences, each with its
 * own carried state, advanced together. One step takes any subset of the
 * slots, each by one token (decoding) or a chunk of its prompt (a request
 * joining while the others decode), and stacks their rows:
 *
 *     rows = slot s0's counts[0] tokens | slot s1's counts[1] tokens | ...
 *
 * so every projection of an RWKV block is one GEMM of M = sum(counts)
 * rows. The parts that belong to one sequence run per sequence over its
 * own rows: the token shift (its carry), the WKV recurrence (its state),
 * an attention block's core (its key/value cache). Every block runs the
 * training forward's own functions over a ragged rx_seqs layout
 * (rx_block_step; rx_attn_step_seqs, made of rx_attn_step's parts), the
 * projections through the projection entry with the model's precision,
 * frozen base and adapter table set as rx_pretrain_forward_batch sets
 * them, the embedding gathered from the arena or the frozen base.
 *
 * State per slot (docs/layout.md §Generation state):
 *   RWKV block i:      WKV state [H][N][N], the ln1 and ln2 carries [C];
 *   attention block j: keys and values [max_len][C], the ln2 carry [C];
 *   its position.
 * Every buffer a step uses is sized at create from max_tokens: a step
 * allocates nothing of its own.
 */
#include <string.h>

#include "rx_internal.h"

struct rx_gen {
    rx_ptmodel *m;
    rx_pt_config cfg;
    rx_model_ctx ctx;          /* the model's settings, as training reads them */
    rx_model_ends e;           /* embedding, ln0, ln_out, head (arena slots) */
    const char *layers;        /* block kinds in model order */
    int n_blocks, n_slots, max_len, max_tokens;
    int fast;                  /* rx_gen_set_fast */
    int *pos;                  /* [n_slots] */
    float *tm_carry;           /* [n_rwkv][n_slots][C] last ln1 output */
    float *cm_carry;           /* [n_blocks][n_slots][C] last ln2 output */
    float *wkv;                /* [n_rwkv][n_slots][H][N][N] */
    float *kc, *vc;            /* [n_attn][n_slots][max_len][C] */
    /* a step's scratch, max_tokens rows */
    float *x, *y, *vf;         /* [max_tokens][C] the blocks' in/out, v_first */
    float *wkv_work;           /* RX_WKV7_SEQS_WORK(n_slots*H, N) */
    int *tok, *off, *seq, *slot;   /* [max_tokens], [n_slots+1], [max_tokens], [n_slots] */
    unsigned char *seen;       /* [n_slots] distinct-slot check */
    rx_block_acts r[2];        /* RWKV block 0's and the later blocks' (value residual) */
    rx_attn_acts *a;           /* one attention set for every attention block */
};

void rx_gen_free(rx_gen *g) {
    if (!g) return;
    rx_block_acts_free(&g->r[0]);
    rx_block_acts_free(&g->r[1]);
    rx_attn_acts_free(g->a);
    float *f[] = {g->tm_carry, g->cm_carry, g->wkv, g->kc, g->vc, g->x, g->y, g->vf,
                  g->wkv_work};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) free(f[i]);
    free(g->pos);
    free(g->tok);
    free(g->off);
    free(g->seq);
    free(g->slot);
    free(g->seen);
    free(g);
}

static int slot_ok(const rx_gen *g, int slot) { return g && slot >= 0 && slot < g->n_slots; }

int rx_gen_reset(rx_gen *g, int slot) {
    if (!slot_ok(g, slot))
        return rx_fail(RX_EINVAL, "rx_gen_reset: %s", g ? "slot out of range" : "state is NULL");
    const size_t C = (size_t)g->cfg.n_embd, NN = (size_t)g->cfg.head_size * g->cfg.head_size;
    const size_t S = (size_t)g->n_slots, s = (size_t)slot, HNN = (size_t)g->cfg.n_head * NN;
    const float *s0 = rx_ptmodel_state_arena(g->m, NULL);
    for (size_t i = 0; i < (size_t)g->cfg.n_rwkv_layer; i++) {
        rx_fzero(g->tm_carry + (i * S + s) * C, C);
        /* a state tune's initial states are every sequence's start */
        float *st = g->wkv + (i * S + s) * HNN;
        if (s0) memcpy(st, s0 + i * HNN, HNN * sizeof(float));
        else rx_fzero(st, HNN);
    }
    for (size_t b = 0; b < (size_t)g->n_blocks; b++) rx_fzero(g->cm_carry + (b * S + s) * C, C);
    g->pos[slot] = 0;
    return RX_OK;
}

int rx_gen_copy(rx_gen *g, int dst, int src) {
    if (!slot_ok(g, dst) || !slot_ok(g, src))
        return rx_fail(RX_EINVAL, "rx_gen_copy: %s", g ? "slot out of range" : "state is NULL");
    if (dst == src) return RX_OK;
    const size_t C = (size_t)g->cfg.n_embd, NN = (size_t)g->cfg.head_size * g->cfg.head_size;
    const size_t S = (size_t)g->n_slots, d = (size_t)dst, s = (size_t)src;
    const size_t HNN = (size_t)g->cfg.n_head * NN, L = (size_t)g->max_len;
    for (size_t i = 0; i < (size_t)g->cfg.n_rwkv_layer; i++) {
        memcpy(g->tm_carry + (i * S + d) * C, g->tm_carry + (i * S + s) * C, C * sizeof(float));
        memcpy(g->wkv + (i * S + d) * HNN, g->wkv + (i * S + s) * HNN, HNN * sizeof(float));
    }
    for (size_t b = 0; b < (size_t)g->n_blocks; b++)
        memcpy(g->cm_carry + (b * S + d) * C, g->cm_carry + (b * S + s) * C, C * sizeof(float));
    const size_t used = (size_t)g->pos[src] * C;
    for (size_t j = 0; j < (size_t)g->cfg.n_attn_layer; j++) {
        memcpy(g->kc + (j * S + d) * L * C, g->kc + (j * S + s) * L * C, used * sizeof(float));
        memcpy(g->vc + (j * S + d) * L * C, g->vc + (j * S + s) * L * C, used * sizeof(float));
    }
    g->pos[dst] = g->pos[src];
    return RX_OK;
}

int rx_gen_pos(const rx_gen *g, int slot) { return slot_ok(g, slot) ? g->pos[slot] : -1; }

int rx_gen_set_fast(rx_gen *g, int on) {
    if (!g || (on != 0 && on != 1))
        return rx_fail(RX_EINVAL, "rx_gen_set_fast: %s", g ? "on must be 0 or 1" : "state is NULL");
    g->fast = on;
    return RX_OK;
}

/* Every buffer of g for its sizes; RX_OK or RX_ENOMEM */
static int gen_alloc(rx_gen *g) {
    const size_t C = (size_t)g->cfg.n_embd, N = (size_t)g->cfg.head_size;
    const size_t H = (size_t)g->cfg.n_head, S = (size_t)g->n_slots, MT = (size_t)g->max_tokens;
    const size_t nr = (size_t)g->cfg.n_rwkv_layer, na = (size_t)g->cfg.n_attn_layer;
    g->pos = rx_alloc(S, sizeof(int));
    g->tm_carry = rx_falloc(nr * S * C);
    g->cm_carry = rx_falloc((size_t)g->n_blocks * S * C);
    g->wkv = rx_falloc(nr * S * H * N * N);
    g->kc = rx_falloc(na * S * (size_t)g->max_len * C);
    g->vc = rx_falloc(na * S * (size_t)g->max_len * C);
    g->x = rx_falloc(MT * C);
    g->y = rx_falloc(MT * C);
    g->vf = rx_falloc(MT * C);
    g->wkv_work = rx_falloc(RX_WKV7_SEQS_WORK(S * H, N));
    g->tok = rx_alloc(MT, sizeof(int));
    g->off = rx_alloc(S + 1, sizeof(int));
    g->seq = rx_alloc(MT, sizeof(int));
    g->slot = rx_alloc(S, sizeof(int));
    g->seen = rx_alloc(S, 1);
    int rc = RX_OK;
    for (int i = 0; i < 2 && i < (int)nr && rc == RX_OK; i++) {
        /* a ragged step's WKV runs in place: its scratch is the sa pairs */
        rc = rx_block_acts_alloc_shared(&g->r[i], rx_ptmodel_rwkv(g->m, i), 1, MT, g->wkv_work);
        g->r[i].tm.wkv_cp = NULL;
    }
    if (rc == RX_OK && na && !(g->a = rx_attn_acts_new(rx_ptmodel_attn(g->m, 0), 1, MT)))
        rc = RX_ENOMEM;
    if (rc == RX_OK && na)
        rc = rx_attn_acts_reserve(g->a, rx_ptmodel_attn(g->m, 0), (size_t)g->max_len);
    /* every model has its named tensors: only the buffers can be missing */
    if (rc != RX_OK || !g->pos || !g->tm_carry || !g->cm_carry || !g->wkv || !g->kc || !g->vc ||
        !g->x || !g->y || !g->vf || !g->wkv_work || !g->tok || !g->off || !g->seq || !g->slot ||
        !g->seen)
        return RX_ENOMEM;
    return RX_OK;
}

int rx_gen_create(rx_ptmodel *m, int n_slots, int max_len, int max_tokens, rx_gen **out) {
    static const char *const fn = "rx_gen_create";
    if (!out) return rx_fail(RX_EINVAL, "%s: out is NULL", fn);
    *out = NULL;
    if (!m) return rx_fail(RX_EINVAL, "%s: model is NULL", fn);
    if (n_slots < 1 || max_len < 1 || max_tokens < 1)
        return rx_fail(RX_EINVAL, "%s: n_slots = %d, max_len = %d, max_tokens = %d must be >= 1",
                       fn, n_slots, max_len, max_tokens);
    rx_gen *g = calloc(1, sizeof *g);
    if (!g) return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    g->m = m;
    g->cfg = rx_ptmodel_config(m);
    rx_ptmodel_ctx(m, &g->ctx);
    g->e = rx_ptmodel_ends(m);
    g->layers = rx_ptmodel_layers(m);
    g->n_blocks = g->cfg.n_rwkv_layer + g->cfg.n_attn_layer;
    g->n_slots = n_slots;
    g->max_len = max_len;
    g->max_tokens = max_tokens;
    if (gen_alloc(g) != RX_OK) {
        rx_gen_free(g);
        return rx_fail(RX_ENOMEM, "%s: out of memory for n_slots = %d, max_len = %d, "
                       "max_tokens = %d", fn, n_slots, max_len, max_tokens);
    }
    for (int s = 0; s < n_slots; s++) rx_gen_reset(g, s);
    *out = g;
    return RX_OK;
}

/* The step's arguments copied into g's scratch (tok, off, slot) and
 * checked there, so a caller's thread writing to them meanwhile cannot
 * slip a bad value past the check; RX_OK or RX_EINVAL, nothing moved */
static int step_args(rx_gen *g, int n, const int *slots, const int *counts, const int *tokens) {
    static const char *const fn = "rx_gen_step";
    if (n < 1 || n > g->n_slots)
        return rx_fail(RX_EINVAL, "%s: n = %d must be in [1, %d]", fn, n, g->n_slots);
    memcpy(g->slot, slots, (size_t)n * sizeof(int));
    memset(g->seen, 0, (size_t)g->n_slots);
    g->off[0] = 0;
    for (int i = 0; i < n; i++) {
        const int s = g->slot[i];
        int c;
        memcpy(&c, counts + i, sizeof c);
        if (s < 0 || s >= g->n_slots)
            return rx_fail(RX_EINVAL, "%s: slots[%d] = %d is outside [0, %d)", fn, i, s,
                           g->n_slots);
        if (g->seen[s]) return rx_fail(RX_EINVAL, "%s: slot %d appears twice", fn, s);
        g->seen[s] = 1;
        if (c < 1 || c > g->max_tokens - g->off[i])
            return rx_fail(RX_EINVAL, "%s: counts[%d] = %d: each must be >= 1 and their sum "
                           "<= max_tokens = %d", fn, i, c, g->max_tokens);
        if (g->cfg.n_attn_layer > 0 && c > g->max_len - g->pos[s])
            return rx_fail(RX_EINVAL, "%s: %d tokens at position %d of slot %d would pass "
                           "max_len = %d", fn, c, g->pos[s], s, g->max_len);
        g->off[i + 1] = g->off[i] + c;
        for (int r = g->off[i]; r < g->off[i + 1]; r++) g->seq[r] = i;
    }
    const int rows = g->off[n];
    memcpy(g->tok, tokens, (size_t)rows * sizeof(int));
    for (int r = 0; r < rows; r++)
        if (g->tok[r] < 0 || g->tok[r] >= g->cfg.vocab_size)
            return rx_fail(RX_EINVAL, "%s: token %d at row %d is outside [0, %d)", fn, g->tok[r],
                           r, g->cfg.vocab_size);
    return RX_OK;
}

/* x [rows][C] through every block in model order, y the other buffer;
 * *out: which of the two holds the result */
static int blocks_forward(rx_gen *g, const rx_seqs *sq, float *x, float *y, float **out) {
    const size_t C = (size_t)g->cfg.n_embd, S = (size_t)g->n_slots, L = (size_t)g->max_len;
    const size_t HNN = (size_t)g->cfg.n_head * g->cfg.head_size * g->cfg.head_size;
    const size_t rows = rx_seqs_rows(sq);
    int rc = RX_OK, ri = 0, ai = 0;
    for (int b = 0; b < g->n_blocks && rc == RX_OK; b++) {
        float *cmc = g->cm_carry + (size_t)b * S * C;
        if (g->layers[b] == 'R') {
            const size_t i = (size_t)ri++;
            rx_block_acts *A = &g->r[i > 0];
            A->tm.B = 1;
            A->tm.T = rows;
            A->tm.seqs = sq;
            rc = rx_block_step(&g->ctx, rx_ptmodel_rwkv(g->m, (int)i), x,
                               g->tm_carry + i * S * C, cmc, i ? g->vf : NULL, i ? NULL : g->vf,
                               g->wkv + i * S * HNN, A, y);
        } else {
            /* the projections over all rows, each slot against its own cache */
            const size_t j = (size_t)ai++;
            rc = rx_attn_step_seqs(&g->ctx, rx_ptmodel_attn(g->m, (int)j), x, cmc,
                                   g->kc + j * S * L * C, g->vc + j * S * L * C, L, g->pos, sq,
                                   g->a, y);
        }
        float *t = x;
        x = y;
        y = t;
    }
    *out = x;
    return rc;
}

/* The step once its arguments are in g: embedding (and ln0), the blocks,
 * ln_out and the head over each slot's last row (all: every row) */
static int step_run(rx_gen *g, const rx_seqs *sq, int all, float *logits) {
    const int C = g->cfg.n_embd, V = g->cfg.vocab_size, rows = (int)rx_seqs_rows(sq);
    const float eps = (float)g->ctx.ln_eps;
    const rx_base_mat *eb = rx_base_find(rx_ptmodel_base_store(g->m), g->e.emb);
    float *x = g->x, *y = g->y, *dst = g->e.ln0_w ? y : x;
    int rc = eb ? rx_embedding_gather_base(eb, g->tok, rows, C, V, dst)
                : rx_embedding_gather(g->e.emb, g->tok, rows, C, V, dst);
    if (rc == RX_OK && g->e.ln0_w)
        rx_rownorm_forward(y, g->e.ln0_w, g->e.ln0_b, x, NULL, NULL, (size_t)rows, (size_t)C, 1,
                           eps);
    if (rc == RX_OK) rc = blocks_forward(g, sq, x, y, &x);
    if (rc != RX_OK) return rc;
    y = x == g->x ? g->y : g->x;
    int n = rows;
    if (!all) {
        /* the last row of each slot, gathered: the head's M is n */
        n = (int)sq->B;
        for (size_t k = 0; k < sq->B; k++)
            memcpy(y + k * (size_t)C, x + ((size_t)sq->off[k + 1] - 1) * (size_t)C,
                   (size_t)C * sizeof(float));
        float *t = x;
        x = y;
        y = t;
    }
    rx_rownorm_forward(x, g->e.ln_out_w, g->e.ln_out_b, y, NULL, NULL, (size_t)n, (size_t)C, 1,
                       eps);
    return rx_head_logits(y, g->e.head, n, C, V, logits);
}

int rx_gen_step(rx_gen *g, int n, const int *slots, const int *counts, const int *tokens,
                int all, float *logits) {
    static const char *const fn = "rx_gen_step";
    const char *nul = rx_first_null(RX_NULLS(g, slots, counts, tokens, logits),
                                    RX_NAMES("state", "slots", "counts", "tokens", "logits"), 5);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (all != 0 && all != 1) return rx_fail(RX_EINVAL, "%s: all = %d must be 0 or 1", fn, all);
    const rx_base *base = rx_ptmodel_base_store(g->m);
    if (base && !rx_base_loaded(base))
        return rx_fail(RX_EINVAL, "%s: the model's base is not filled", fn);
    int rc = step_args(g, n, slots, counts, tokens);
    if (rc == RX_OK) rc = rx_ptmodel_lora_prepare(g->m);   /* DoRA's norms, as a forward's */
    if (rc != RX_OK) return rc;
    const rx_seqs sq = {(size_t)n, 0, g->off, g->seq, g->slot};
    /* the model's tables for the span of the step, as its forward sets them */
    const int old = rx_gemm_set_precision(rx_ptmodel_precision(g->m));
    const rx_lora *was = rx_gemm_set_lora(rx_ptmodel_lora_table(g->m));
    const rx_base *was_base = rx_gemm_set_base(base);
    const int was_fast = rx_gemm_set_fast(g->fast);
    rc = step_run(g, &sq, all, logits);
    rx_gemm_set_fast(was_fast);
    rx_gemm_set_base(was_base);
    rx_gemm_set_lora(was);
    rx_gemm_set_precision(old);
    if (rc != RX_OK) return rc;
    for (int i = 0; i < n; i++) g->pos[g->slot[i]] += g->off[i + 1] - g->off[i];
    return RX_OK;
}
