/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * model.c -- the whole RWKV-X model run (docs/maths.md): its activations and
 * the forward / backward over B sequences at once, on the model that
 * model_layout.c lays out.
 *
 *     x0 = emb[tokens] (then ln0(x0) when the model has ln0);
 *     x = block_L(x) in model order; h = ln_out(x);
 *     logits = h . head; loss = mean CE over the valid targets
 */
#include <stddef.h>
#include <string.h>

#include "rx_model.h"

/* ---- activations --------------------------------------------------------- */

/* a*b into *out, 0 on size_t overflow */
static int mul_ok(size_t a, size_t b, size_t *out) {
    if (b && a > SIZE_MAX / b) return 0;
    *out = a * b;
    return 1;
}

/* The blocks' kept forward intermediates: one set per block, or under
 * recompute one set shared by every RWKV block and one by every attention
 * block, both carved from one region (only one block's are live at a
 * time), holding the block held_r / held_a last ran forward into. */
struct rx_pt_saved {
    int n, na;
    rx_block_acts *rwkv;   /* [n] */
    rx_attn_acts **attn;   /* [na] */
    float *work;           /* scratch for any block's backward: the largest
                            * rx_block_work or RX_ATTN_WORK */
    float *wkv_work;       /* the RWKV blocks' one WKV chunk scratch (the largest
                            * rx_wkv7_work_floats; recompute: the lean set's own) */
    float *s, *ds;         /* [B][H][N][N] each when the model has initial states:
                            * one block's broadcast state (advanced in place by
                            * its forward), and the grad on it per sequence */
    int recompute;
    int held_r, held_a;    /* recompute: the blocks the shared sets hold, -1 none */
    int held_g;            /* recompute: the row group held_r's rows are (rx_pt_acts.group) */
    rx_block_acts view0;   /* recompute: rwkv[0] as RWKV block 0 sees it */
    float *shared;         /* recompute: the region rwkv[0] and attn[0] share */
    int lnout_stale;       /* recompute: a backward used lnout as scratch since the forward */
    float *kept;           /* recompute: [n_attn_layer][kept_n] each attention block's
                            * core products (rx_attn_kept_floats), never recomputed */
    size_t kept_n;
};

/* The intermediates of RWKV block i. Under recompute the shared set is
 * sized for a block after the first (a superset: block 0 has no value
 * residual), and block 0 reads it through view0, whose v-residual buffers
 * are block 0's: vmod the same buffer as v, no vg, no tv. */
static rx_block_acts *rwkv_acts(struct rx_pt_saved *s, int i) {
    if (!s->recompute) return &s->rwkv[i];
    return i == 0 ? &s->view0 : &s->rwkv[0];
}

/* The intermediates of attention block i; under recompute the shared set,
 * pointed at block i's kept core products. */
static rx_attn_acts *attn_acts(struct rx_pt_saved *s, const rx_ptmodel *m, int i) {
    if (!s->recompute) return s->attn[i];
    rx_attn_acts_bind(s->attn[0], &m->attn[i], s->kept + (size_t)i * s->kept_n);
    return s->attn[0];
}

static void saved_free(struct rx_pt_saved *s) {
    if (!s) return;
    for (int i = 0; i < s->n; i++) rx_block_acts_free(&s->rwkv[i]);
    for (int i = 0; i < s->na; i++) rx_attn_acts_free(s->attn[i]);
    free(s->rwkv);
    free(s->attn);
    free(s->work);
    free(s->wkv_work);
    free(s->s);
    free(s->ds);
    free(s->shared);
    free(s->kept);
    free(s);
}

/* Floats of the largest RWKV block backward's scratch over BT rows (its
 * lean form under recompute) */
static size_t rwkv_work(const rx_ptmodel *m, size_t BT, int recompute) {
    size_t nwork = 0;
    for (int i = 0; i < m->cfg.n_rwkv_layer; i++) {
        const size_t w = (recompute ? rx_block_work_lean : rx_block_work)(&m->rwkv[i], BT);
        if (w > nwork) nwork = w;
    }
    return nwork;
}

static struct rx_pt_saved *saved_new(const rx_ptmodel *m, size_t B, size_t T, int recompute) {
    struct rx_pt_saved *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    const int n = recompute ? 1 : m->cfg.n_rwkv_layer;
    const int na = recompute && m->cfg.n_attn_layer ? 1 : m->cfg.n_attn_layer;
    s->recompute = recompute;
    s->held_r = s->held_a = -1;
    /* the shared RWKV set is sized as the last block's (a block after the
     * first when there is one) */
    const rx_block_params *shape_of = &m->rwkv[recompute ? m->cfg.n_rwkv_layer - 1 : 0];
    const size_t BT = B * T, C = (size_t)m->cfg.n_embd, F = (size_t)m->cfg.ffn_dim;
    const size_t na_work = na ? RX_ATTN_WORK(BT, C, F) : 0, nr_work = rwkv_work(m, BT, recompute);
    const size_t nwork = na_work > nr_work ? na_work : nr_work;
    s->rwkv = calloc((size_t)n, sizeof *s->rwkv);
    s->attn = calloc((size_t)(na ? na : 1), sizeof *s->attn);
    s->work = rx_falloc(nwork);
    const size_t nstate = B * (size_t)m->cfg.n_head * (size_t)m->cfg.head_size *
                          (size_t)m->cfg.head_size;
    if (m->state0) {
        s->s = rx_falloc(nstate);
        s->ds = rx_falloc(nstate);
    }
    if (!s->rwkv || !s->attn || !s->work || (m->state0 && (!s->s || !s->ds))) {
        free(s->rwkv);
        free(s->attn);
        free(s->work);
        free(s->s);
        free(s->ds);
        free(s);
        return NULL;
    }
    if (recompute) {
        /* the lean set: part of it in the blocks' backward scratch */
        size_t nr = rx_block_acts_floats_lean(shape_of, B, T);
        const size_t nat = na ? rx_attn_acts_floats(&m->attn[0], B, T) : 0;
        s->shared = rx_falloc(nr > nat ? nr : nat);
        if (s->shared) rx_block_acts_carve_lean(&s->rwkv[0], shape_of, B, T, s->shared, s->work);
        s->n = s->shared ? 1 : 0;
        s->attn[0] = s->shared && na ? rx_attn_acts_new_in(&m->attn[0], B, T, s->shared) : NULL;
        s->na = s->attn[0] ? 1 : 0;
        s->kept_n = na ? rx_attn_kept_floats(&m->attn[0], B, T) : 0;
        s->kept = s->kept_n ? rx_falloc((size_t)m->cfg.n_attn_layer * s->kept_n) : NULL;
        if (!s->shared || s->na != na || (s->kept_n && !s->kept)) {
            saved_free(s);
            return NULL;
        }
    }
    /* Every set's WKV scratch is this one: the forward and the backward of
     * the recurrence each write it before reading it (the backward starts
     * from the checkpoints, kept per block), and the blocks run one at a
     * time, so one block's does not outlive its call (a set of its own
     * would add a thread's 1.1 MB chunk of states at N = 64 a block) */
    size_t nwkv = 0;
    for (int i = 0; i < m->cfg.n_rwkv_layer && !recompute; i++) {
        const rx_tm_params *P = &m->rwkv[i].tm;
        const size_t w = rx_wkv7_work_floats(B * (size_t)P->n_head, (size_t)P->head_size);
        if (w > nwkv) nwkv = w;
    }
    if (nwkv && !(s->wkv_work = rx_falloc(nwkv))) {
        saved_free(s);
        return NULL;
    }
    for (; s->n < n; s->n++)
        if (rx_block_acts_alloc_shared(&s->rwkv[s->n], &m->rwkv[s->n], B, T, s->wkv_work) !=
            RX_OK) {
            s->n++;   /* a partial allocation is freed with the rest */
            saved_free(s);
            return NULL;
        }
    for (; s->na < na; s->na++)
        if (!(s->attn[s->na] = rx_attn_acts_new(&m->attn[s->na], B, T))) {
            saved_free(s);
            return NULL;
        }
    if (recompute) {
        s->view0 = s->rwkv[0];
        s->view0.tm.vmod = s->view0.tm.v;
        s->view0.tm.vg = NULL;
        s->view0.tm.tv = NULL;
    }
    return s;
}

void rx_pt_acts_free(rx_pt_acts *a) {
    if (!a) return;
    saved_free(a->saved);
    free(a->tokens);
    free(a->block_in);   /* the start of the one float allocation */
    free(a);
}

/* Floats of the backward's first residual-grad buffer (work's first):
 * the head's grad on lnout [BT][C], then a row group's summed v_first
 * grad and one block's, [2][rowg] */
static size_t grad_head_floats(size_t rowc, size_t rowg) {
    return rowc > 2 * rowg ? rowc : 2 * rowg;
}

/* One float allocation carved into block_in | v_first | lnout | work |
 * logits | dlogits: BT*((n_blocks+7)*C + 2*vocab) floats, or with the
 * chunked head BT*(n_blocks+7)*C + 2*rows*vocab (logits NULL, dlogits the
 * head's scratch); the blocks' kept intermediates and a block backward's
 * scratch beside it. work is the backward's residual grads: the head's
 * grad, then a row group's v_first grads (grad_head_floats) | the grad
 * leaving the last block, [BT][C] | a row group's other residual grad
 * [group*T][C] (with one group: 4 [BT][C]; with more, 2 [BT][C] and 1 or
 * 2 groups' rows). Under recompute lnout is work's second buffer (written
 * only after the head has read lnout), one [BT][C] less: the backward and
 * rx_pretrain_loss make it again from the last block's output when a
 * backward has used it. */
int rx_pt_acts_create_groups(const rx_ptmodel *m, int B, int T, int flags, int head_rows,
                             int group, rx_pt_acts **out) {
    static const char *const fn = "rx_pt_acts_create";
    if (!out) return rx_fail(RX_EINVAL, "%s: out is NULL", fn);
    *out = NULL;
    if (!m) return rx_fail(RX_EINVAL, "%s: model is NULL", fn);
    if (flags & ~RX_ACTS_FLAGS_ALL)
        return rx_fail(RX_EINVAL, "%s: unknown flag bits 0x%x", fn, flags & ~RX_ACTS_FLAGS_ALL);
    if (head_rows < 0) return rx_fail(RX_EINVAL, "%s: head_rows = %d is < 0", fn, head_rows);
    if (B < 1 || T < 1 || (int64_t)B * T > INT32_MAX)
        return rx_fail(RX_EINVAL, "%s: B = %d, T = %d: each must be >= 1 and B*T <= 2**31 - 1",
                       fn, B, T);
    if (group < 1 || group > B || B % group)
        return rx_fail(RX_EINVAL, "%s: group = %d must divide B = %d", fn, group, B);
    if (group < B && (!(flags & RX_ACTS_RECOMPUTE) || m->cfg.n_attn_layer))
        return rx_fail(RX_EINVAL, "%s: row groups (group = %d < B = %d) need RX_ACTS_RECOMPUTE "
                       "and a model without attention blocks", fn, group, B);
    const size_t BT = (size_t)B * (size_t)T, C = (size_t)m->cfg.n_embd;
    const size_t V = (size_t)m->cfg.vocab_size, nb = (size_t)m->n_blocks;
    const int chunked = (flags & RX_ACTS_CHUNKED_HEAD) != 0;
    const size_t lean = (flags & RX_ACTS_RECOMPUTE) != 0;
    const int rows = head_rows ? head_rows : rx_head_chunk_rows((int)V, 0);
    size_t rowc, rowv, total;
    /* sizes that do not fit the address space cannot be allocated either
     * (the residual grads take at most 4 [BT][C]) */
    if (!mul_ok(BT, C, &rowc) ||
        !mul_ok(chunked ? ((size_t)rows < BT ? (size_t)rows : BT) : BT, V, &rowv) ||
        !mul_ok(rowc, nb + 7 - lean, &total) ||
        total > SIZE_MAX - 2 * rowv || rowv > SIZE_MAX / 2)
        return rx_fail(RX_ENOMEM, "%s: acts for B = %d, T = %d exceed the address space", fn, B,
                       T);
    const size_t rowg = (size_t)group * (size_t)T * C, w1 = grad_head_floats(rowc, rowg);
    total = rowc * (nb + 3 - lean) + w1 + rowc + rowg + 2 * rowv;
    rx_pt_acts *a = calloc(1, sizeof *a);
    if (!a) return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    float *f = rx_fcalloc(total);   /* zeroed: nothing is ever read uninitialised */
    a->tokens = f ? rx_alloc(BT, sizeof(int)) : NULL;
    /* the blocks' sets hold one row group */
    a->saved = a->tokens ? saved_new(m, (size_t)group, (size_t)T, flags & RX_ACTS_RECOMPUTE)
                         : NULL;
    if (!a->tokens || !f || !a->saved) {
        saved_free(a->saved);
        free(a->tokens);
        free(f);
        free(a);
        return rx_fail(RX_ENOMEM, "%s: out of memory for B = %d, T = %d (%zu floats of "
                       "activations, besides the blocks' own)", fn, B, T, total);
    }
    a->B = B;
    a->T = T;
    a->C = (int)C;
    a->vocab = (int)V;
    a->n_blocks = (int)nb;
    a->block_in = f;
    a->v_first = a->block_in + (nb + 1) * rowc;
    a->work = a->v_first + (2 - lean) * rowc;
    a->lnout = lean ? a->work + w1 : a->v_first + rowc;
    a->logits = chunked ? NULL : a->work + w1 + rowc + rowg;
    a->dlogits = a->work + w1 + rowc + rowg + (chunked ? 0 : rowv);
    a->flags = flags;
    a->head_rows = chunked ? rows : 0;
    a->group = group;
    *out = a;
    return RX_OK;
}

int rx_pt_acts_create_opts(const rx_ptmodel *m, int B, int T, int flags, int head_rows,
                           rx_pt_acts **out) {
    return rx_pt_acts_create_groups(m, B, T, flags, head_rows, B, out);
}

size_t rx_pt_acts_group_floats(const rx_ptmodel *m, int B, int T, int group) {
    if (!m || group < 1 || group > B || T < 1 || !m->cfg.n_rwkv_layer) return 0;
    const size_t GT = (size_t)group * (size_t)T, C = (size_t)m->cfg.n_embd;
    const rx_block_params *shape_of = &m->rwkv[m->cfg.n_rwkv_layer - 1];
    /* saved_new's lean set and scratch, and the residual grads that depend
     * on the group (create's work) */
    return rx_block_acts_floats_lean(shape_of, (size_t)group, (size_t)T) + rwkv_work(m, GT, 1) +
           grad_head_floats((size_t)B * T * C, GT * C) + GT * C;
}

int rx_ptmodel_groups_exact(const rx_ptmodel *m) {
    return m && m->lora_on && m->lora && rx_lora_magnitude(m->lora, 0) < 0 && !m->state0 &&
           !m->cfg.n_attn_layer && rx_ptmodel_frozen(m) == 1;
}

int rx_pt_acts_create(const rx_ptmodel *m, int B, int T, rx_pt_acts **out) {
    return rx_pt_acts_create_opts(m, B, T, 0, 0, out);
}

rx_pt_acts *rx_pt_acts_new_batch(const rx_ptmodel *m, int B, int T) {
    rx_pt_acts *a;
    rx_pt_acts_create(m, B, T, &a);
    return a;
}

rx_pt_acts *rx_pt_acts_new(const rx_ptmodel *m, int T) {
    rx_pt_acts *a;
    rx_pt_acts_create(m, 1, T, &a);
    return a;
}

/* acts were made for this model's sizes and this B, T */
static int acts_fit(const rx_ptmodel *m, const rx_pt_acts *a, int B, int T) {
    return a && a->B == B && a->T == T && a->C == m->cfg.n_embd &&
           a->vocab == m->cfg.vocab_size && a->n_blocks == m->n_blocks;
}

/* ---- forward ------------------------------------------------------------- */

/* the arena's elements [off, off + n) lie inside one frozen range */
static int is_frozen(const rx_ptmodel *m, size_t off, size_t n) {
    for (int r = 0; r < m->n_frozen; r++)
        if ((int64_t)off >= m->frozen[2 * r] && (int64_t)(off + n) <= m->frozen[2 * r + 1])
            return 1;
    return 0;
}

/* out [BT][C] = the embedding's rows of acts->tokens, from the arena or,
 * when the embedding is in the frozen base, decoded from it */
static int emb_gather(const rx_ptmodel *m, const rx_pt_acts *acts, int BT, float *out) {
    const rx_base_mat *b = rx_base_find(m->base, m->emb);
    const int V = m->cfg.vocab_size, C = m->cfg.n_embd;
    return b ? rx_embedding_gather_base(b, acts->tokens, BT, C, V, out)
             : rx_embedding_gather(m->emb, acts->tokens, BT, C, V, out);
}

/* The initial state of RWKV block i for each of the B sequences into s
 * [B][H][N][N] (a trainable state is one for all sequences) */
static void broadcast_state(const rx_ptmodel *m, int i, int B, float *s) {
    const size_t n = (size_t)m->cfg.n_head * (size_t)m->cfg.head_size * (size_t)m->cfg.head_size;
    for (int b = 0; b < B; b++)
        memcpy(s + (size_t)b * n, m->state0 + (size_t)i * n, n * sizeof(float));
}

/* g_state0 of RWKV block i = the sum over the B sequences of ds
 * [B][H][N][N], in sequence order (the same bits at any thread count) */
static void reduce_state_grad(rx_ptmodel *m, int i, int B, const float *ds) {
    const size_t n = (size_t)m->cfg.n_head * (size_t)m->cfg.head_size * (size_t)m->cfg.head_size;
    float *g = m->g_state0 + (size_t)i * n;
    memcpy(g, ds, n * sizeof(float));
    for (int b = 1; b < B; b++)
        for (size_t e = 0; e < n; e++) g[e] += ds[(size_t)b * n + e];
}

/* Block L forward over row group g (sequences g*group .. g*group+group-1
 * of acts) from block_in[L] into block_in[L+1] (its intermediates alone
 * when !out), keeping its intermediates (the shared set under recompute,
 * which then holds L's group g); RWKV block 0 writes v_first when write_vf. */
static int block_forward_vf(rx_ptmodel *m, const rx_pt_acts *acts, int L, int g, int out,
                            int write_vf) {
    struct rx_pt_saved *s = acts->saved;
    const size_t rowc = (size_t)acts->B * acts->T * acts->C;
    const size_t off = (size_t)g * acts->group * acts->T * acts->C;
    const float *x = acts->block_in + (size_t)L * rowc + off;
    float *y = out ? acts->block_in + (size_t)(L + 1) * rowc + off : NULL;
    float *vf = acts->v_first + off;
    const int i = m->block_idx[L];
    /* under recompute both sets share one region: one kind's forward
     * overwrites what the other held */
    if (m->layers[L] == 'A') {
        s->held_a = i;
        s->held_r = -1;
        /* a recompute (out NULL) finds the core's products kept */
        return y ? rx_attn_forward_acts(&m->ctx, &m->attn[i], x, NULL, attn_acts(s, m, i), y)
                 : rx_attn_forward_kept(&m->ctx, &m->attn[i], x, NULL, attn_acts(s, m, i));
    }
    s->held_r = i;
    s->held_g = g;
    s->held_a = -1;
    /* a trainable initial state, broadcast to every sequence (the forward
     * advances it in place, so each forward of the block, a recompute's
     * too, starts from a fresh copy) */
    float *st = m->state0 ? s->s : NULL;
    if (st) broadcast_state(m, i, acts->group, st);
    return rx_block_forward_state(&m->ctx, &m->rwkv[i], x, NULL, NULL, i > 0 ? vf : NULL,
                                  i > 0 || !write_vf ? NULL : vf, st, rwkv_acts(s, i), y);
}

/* Under recompute, block L's intermediates of row group g back in the
 * shared set unless it holds them already: its forward again from its
 * kept input (the same inputs and kernels, so the same bits), without the
 * block output (and the channel-mix value projection that only it reads),
 * v_first left as it is. */
static int block_recompute(rx_ptmodel *m, const rx_pt_acts *acts, int L, int g) {
    const struct rx_pt_saved *s = acts->saved;
    const int i = m->block_idx[L];
    if (!s->recompute ||
        (m->layers[L] == 'A' ? s->held_a == i : s->held_r == i && s->held_g == g))
        return RX_OK;
    return block_forward_vf(m, acts, L, g, 0, 0);
}

/* lnout = ln_out(the last block's output) */
static int lnout_forward(const rx_ptmodel *m, const rx_pt_acts *acts) {
    const size_t rowc = (size_t)acts->B * (size_t)acts->T * (size_t)acts->C;
    acts->saved->lnout_stale = 0;
    return rx_layernorm_forward_eps(acts->block_in + (size_t)m->n_blocks * rowc, m->ln_out_w,
                                    m->ln_out_b, acts->lnout, acts->B, acts->T, acts->C,
                                    (float)m->ctx.ln_eps);
}

/* tokens: [B][T]; fills acts: block_in, v_first, lnout, logits */
static int forward_batch(rx_ptmodel *m, const int *tokens, int B, int T, rx_pt_acts *acts) {
    static const char *const fn = "rx_pretrain_forward_batch";
    if (!m || !tokens || !acts)
        return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, !m ? "model" : !tokens ? "tokens" : "acts");
    if (!acts_fit(m, acts, B, T))
        return rx_fail(RX_EINVAL, "%s: acts were made for B = %d, T = %d (or another model), "
                       "called with B = %d, T = %d", fn, acts->B, acts->T, B, T);
    if (m->state0 && !acts->saved->s)
        return rx_fail(RX_EINVAL, "%s: acts were made before rx_ptmodel_enable_state; make "
                       "them again", fn);
    const int V = m->cfg.vocab_size, C = m->cfg.n_embd, BT = B * T;
    /* copy into the backward's scratch (work), check the copy, then keep
     * it: a caller's thread writing to tokens meanwhile cannot slip an id
     * past the check into the embedding, and a rejected call leaves the
     * previous forward intact */
    unsigned char *copy = (unsigned char *)acts->work;
    memcpy(copy, tokens, (size_t)BT * sizeof(int));
    for (int i = 0; i < BT; i++) {
        int t;
        memcpy(&t, copy + (size_t)i * sizeof(int), sizeof t);
        if (t < 0 || t >= V)
            return rx_fail(RX_EINVAL, "%s: token %d at position %d is outside [0, %d)", fn, t, i,
                           V);
    }
    acts->ready = 0;
    memcpy(acts->tokens, copy, (size_t)BT * sizeof(int));
    int rc;
    if (m->ln0_w) {
        /* the raw rows go through scratch; the backward gathers them again */
        rc = emb_gather(m, acts, BT, acts->work);
        if (rc == RX_OK)
            rx_rownorm_forward(acts->work, m->ln0_w, m->ln0_b, acts->block_in, NULL, NULL,
                               (size_t)BT, (size_t)C, 1, (float)m->ctx.ln_eps);
    } else {
        rc = emb_gather(m, acts, BT, acts->block_in);
    }
    /* every row group through a block before the next block: the shared
     * set holds one group's intermediates at a time. The groups run last
     * to first, so that the set ends holding group 0's, which the backward
     * takes first without running it again. */
    const int groups = B / acts->group;
    for (int L = 0; L < m->n_blocks && rc == RX_OK; L++)
        for (int g = groups - 1; g >= 0 && rc == RX_OK; g--)
            rc = block_forward_vf(m, acts, L, g, 1, 1);
    if (rc == RX_OK) rc = lnout_forward(m, acts);
    if (rc == RX_OK && acts->logits)
        rc = rx_head_logits(acts->lnout, m->head, BT, C, V, acts->logits);
    if (rc != RX_OK) return rc;
    acts->ready = 1;
    return RX_OK;
}

int rx_ptmodel_lora_prepare(rx_ptmodel *m) {
    return m && m->lora_on ? rx_lora_prepare(m->lora, &rx_base_columns, m->base) : RX_OK;
}

/* forward_batch with the projections in the model's precision */
int rx_pretrain_forward_batch(rx_ptmodel *m, const int *tokens, int B, int T, rx_pt_acts *acts) {
    if (m && m->base && !rx_base_loaded(m->base))
        return rx_fail(RX_EINVAL, "rx_pretrain_forward_batch: the model's base is not filled");
    int rc = rx_ptmodel_lora_prepare(m);   /* DoRA's norms of this step's adapters */
    if (rc != RX_OK) return rc;
    const int old = rx_gemm_set_precision(m ? m->precision : RX_PRECISION_FP32);
    const rx_lora *was = rx_gemm_set_lora(m && m->lora_on ? m->lora : NULL);
    const rx_base *was_base = rx_gemm_set_base(m ? m->base : NULL);
    rc = forward_batch(m, tokens, B, T, acts);
    rx_gemm_set_base(was_base);
    rx_gemm_set_lora(was);
    rx_gemm_set_precision(old);
    return rc;
}

int rx_pretrain_forward(rx_ptmodel *m, const int *tokens, int T, rx_pt_acts *acts) {
    return rx_pretrain_forward_batch(m, tokens, 1, T, acts);
}

/* ---- backward ------------------------------------------------------------ */

/* RX_OK when a loss call's arguments are there and its acts hold a forward
 * of this model at B x T; else RX_EINVAL through rx_fail, naming fn. */
static int check_loss_call(const char *fn, const rx_ptmodel *m, const rx_pt_acts *acts,
                           const int *targets, const double *loss, int B, int T) {
    if (!m || !acts || !targets || !loss)
        return rx_fail(RX_EINVAL, "%s: %s is NULL", fn,
                       !m ? "model" : !acts ? "acts" : !targets ? "targets" : "loss");
    if (!acts_fit(m, acts, B, T))
        return rx_fail(RX_EINVAL, "%s: acts were made for B = %d, T = %d (or another model), "
                       "called with B = %d, T = %d", fn, acts->B, acts->T, B, T);
    if (!acts->ready) return rx_fail(RX_EINVAL, "%s: acts hold no forward", fn);
    return RX_OK;
}

/* targets: [B][T]; returns the mean loss over the valid positions of the
 * batch and writes the grads of that mean into the grad arena. With w
 * [B][T] (the rows form, fn names it) the grads are those of
 * sum_t w[t] * loss[t] instead, and row_loss [B][T] gets each loss[t], of
 * the logits times k (rx_cross_entropy_rows_k; 1 in the mean form). */
static int backward_batch(const char *fn, rx_ptmodel *m, const rx_pt_acts *acts,
                          const int *targets, int B, int T, int ignore_index, const double *w,
                          float k, double *row_loss, double *loss_out) {
    int rc = check_loss_call(fn, m, acts, targets, loss_out, B, T);
    if (rc != RX_OK) return rc;
    if (acts->group < B && !rx_ptmodel_groups_exact(m))
        return rx_fail(RX_EINVAL, "%s: acts in row groups (group = %d < B = %d) take a backward "
                       "only for LoRA adapters (not DoRA) on an otherwise frozen model without "
                       "trainable states: make them with group = B", fn, acts->group, B);
    const int V = m->cfg.vocab_size, C = m->cfg.n_embd, BT = B * T;
    for (int i = 0; i < BT; i++) {
        int t = targets[i];
        if ((ignore_index < 0 || t != ignore_index) && (t < 0 || t >= V))
            return rx_fail(RX_EINVAL, "%s: target %d at position %d is outside [0, %d) and is "
                           "not ignore_index %d", fn, t, i, V, ignore_index);
    }
    const size_t rowc = (size_t)BT * (size_t)C;
    const int groups = B / acts->group;
    const size_t rowg = (size_t)acts->group * (size_t)T * (size_t)C;
    /* work (rx_pt_acts_create_groups): the head's grad on lnout, later a
     * group's v_first grads | the grad leaving the last block (lnout under
     * recompute, which the head has read by then) | a group's other grad */
    float *dhead = acts->work, *dlast = acts->work + grad_head_floats(rowc, rowg);
    float *dvf_sum = dhead, *dvf_one = dhead + rowg, *dother = dlast + rowc;
    float *bwork = acts->saved->work;
    /* the same call as the forward's: the same bits */
    if (acts->saved->lnout_stale && (rc = lnout_forward(m, acts)) != RX_OK) return rc;

    /* targets are valid here, so a NaN loss means non-finite logits: the
     * NaN grads still go through, as the grads of this call */
    double loss;
    if (w && acts->logits) {
        rc = rx_cross_entropy_rows_k(acts->logits, targets, BT, V, ignore_index, w, k,
                                     acts->dlogits, row_loss);
        loss = 0.0;
        if (rc == RX_OK)
            rx_l2wrap_rows(acts->logits, acts->dlogits, (size_t)BT, (size_t)V,
                           m->ctx.l2wrap / (double)BT);
        if (rc == RX_OK)
            rc = rx_head_grads(acts->lnout, m->head, acts->dlogits, BT, C, V, dhead, m->g_head);
    } else if (w) {
        rc = rx_head_loss_rows_k(acts->lnout, m->head, targets, BT, C, V, ignore_index,
                                 m->ctx.l2wrap, w, k, acts->head_rows, acts->dlogits, dhead,
                                 m->g_head, row_loss);
        loss = 0.0;
    } else if (acts->logits) {
        rc = rx_cross_entropy(acts->logits, targets, BT, V, ignore_index, acts->dlogits, &loss);
        if (rc == RX_OK)
            rx_l2wrap_rows(acts->logits, acts->dlogits, (size_t)BT, (size_t)V,
                           m->ctx.l2wrap / (double)BT);
        if (rc == RX_OK)
            rc = rx_head_grads(acts->lnout, m->head, acts->dlogits, BT, C, V, dhead, m->g_head);
    } else {
        rc = rx_head_loss(acts->lnout, m->head, targets, BT, C, V, ignore_index, m->ctx.l2wrap,
                          acts->head_rows, acts->dlogits, dhead, m->g_head, &loss);
    }
    if (rc == RX_OK)
        rc = rx_layernorm_backward_eps(acts->block_in + (size_t)m->n_blocks * rowc,
                                       m->ln_out_w, m->ln_out_b, dhead, dlast, m->g_ln_out_w,
                                       m->g_ln_out_b, B, T, C, (float)m->ctx.ln_eps);
    acts->saved->lnout_stale = acts->saved->recompute;   /* dlast is lnout */
    /* Row group by row group (one: the whole batch), each through every
     * block from the last: dcur, the grad on the residual leaving block L,
     * starts as the group's rows of dlast. Every RWKV block after the first
     * reads v_first; their grads on it are summed into dvf_sum and handed
     * to RWKV block 0 (always the first block), which produced it. A group
     * after the first adds its adapters' weight grads to the groups' before
     * (rx_lora_accumulate): each product's k ranges in the order one
     * product over every row takes them. */
    float *ds = m->state0 ? acts->saved->ds : NULL;   /* the initial states' grads, or none */
    float *dcur = dlast, *dnext = dother;
    for (int g = 0; g < groups && rc == RX_OK; g++) {
        const size_t o = (size_t)g * rowg;
        int have_dvf = 0;
        dcur = dlast + o;
        dnext = dother;
        if (g > 0) rx_lora_accumulate(m->lora, 1);
        for (int L = m->n_blocks - 1; L >= 0 && rc == RX_OK; L--) {
            const float *x = acts->block_in + (size_t)L * rowc + o;
            const int i = m->block_idx[L];
            rc = block_recompute(m, acts, L, g);
            /* a block's backward takes the scratch that holds part of the lean
             * set and overwrites the rest of it: the shared sets hold no block */
            acts->saved->held_r = acts->saved->held_a = -1;
            if (rc != RX_OK) break;
            if (m->layers[L] == 'A') {
                rc = rx_attn_backward_acts(&m->ctx, &m->attn[i], attn_acts(acts->saved, m, i), x,
                                           NULL, dcur, &m->attn_g[i], dnext, NULL, bwork);
            } else if (i > 0) {
                float *dvf = have_dvf ? dvf_one : dvf_sum;
                rc = rx_block_backward_state(&m->ctx, &m->rwkv[i], rwkv_acts(acts->saved, i), x,
                                             NULL, NULL, acts->v_first + o, dcur, &m->rwkv_g[i],
                                             dnext, NULL, NULL, dvf, ds, bwork);
                if (have_dvf)
                    for (size_t e = 0; e < rowg; e++) dvf_sum[e] += dvf_one[e];
                have_dvf = 1;
            } else {
                rc = rx_block_backward_state(&m->ctx, &m->rwkv[0], rwkv_acts(acts->saved, 0), x,
                                             NULL, NULL, acts->v_first + o, dcur, &m->rwkv_g[0],
                                             dnext, NULL, NULL, have_dvf ? dvf_sum : NULL, ds,
                                             bwork);
            }
            if (rc == RX_OK && ds && m->layers[L] == 'R') reduce_state_grad(m, i, B, ds);
            float *t = dcur;
            dcur = dnext;
            dnext = t;
        }
        if (g > 0) rx_lora_accumulate(m->lora, 0);
    }
    /* with emb (and ln0) frozen, nothing below is wanted */
    const size_t emb_off = (size_t)(m->emb - m->params), V_C = (size_t)V * (size_t)C;
    const int emb_frozen = is_frozen(m, emb_off, V_C) || rx_base_find(m->base, m->emb);
    if (groups > 1 || (emb_frozen && (!m->ln0_w || is_frozen(m, emb_off + V_C, 2 * (size_t)C)))) {
        if (rc == RX_OK) *loss_out = loss;
        return rc;
    }
    if (rc == RX_OK && m->ln0_w) {
        /* dcur is the grad on ln0's output (one group: the whole batch's);
         * the raw rows are gathered again into the free dnext, and the grad
         * on them overwrites dcur */
        rc = emb_gather(m, acts, BT, dnext);
        if (rc == RX_OK)
            rc = rx_layernorm_backward_eps(dnext, m->ln0_w, m->ln0_b, dcur, dcur, m->g_ln0_w,
                                           m->g_ln0_b, B, T, C, (float)m->ctx.ln_eps);
    }
    if (rc == RX_OK && !emb_frozen)
        rc = rx_embedding_scatter(acts->tokens, BT, C, V, dcur, m->g_emb);
    if (rc == RX_OK) *loss_out = loss;
    return rc;
}

/* backward_batch with the projections in the model's precision */
int rx_pretrain_backward_loss(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets, int B,
                              int T, int ignore_index, double *loss) {
    const int prc = rx_ptmodel_lora_prepare(m);   /* the forward's DoRA norms, again */
    if (prc != RX_OK) return prc;
    const int old = rx_gemm_set_precision(m ? m->precision : RX_PRECISION_FP32);
    const rx_frozen f = {m ? m->grads : NULL, m ? m->frozen : NULL, m ? m->n_frozen : 0};
    const rx_frozen was = rx_gemm_set_frozen(f);
    /* a recompute's forward and the dx and weight-grad products see the adapters */
    const rx_lora *was_lora = rx_gemm_set_lora(m && m->lora_on ? m->lora : NULL);
    const rx_base *was_base = rx_gemm_set_base(m ? m->base : NULL);
    const int rc = backward_batch("rx_pretrain_backward_loss", m, acts, targets, B, T,
                                  ignore_index, NULL, 1.0f, NULL, loss);
    rx_gemm_set_base(was_base);
    rx_gemm_set_lora(was_lora);
    rx_gemm_set_frozen(was);
    rx_gemm_set_precision(old);
    return rc;
}

/* k = 1 / temperature, or 0 (RX_EINVAL through rx_fail) for a temperature
 * that is not finite and > 0 or whose inverse is not a finite float */
static float inverse_temperature(const char *fn, double temperature) {
    const float k = (float)(1.0 / temperature);
    if (!(temperature > 0.0) || isinf(temperature) || !(k > 0.0f) || isinf(k)) {
        rx_fail(RX_EINVAL, "%s: temperature = %g must be finite and > 0 (and its inverse a "
                "finite float)", fn, temperature);
        return 0.0f;
    }
    return k;
}

/* targets, weight, row_loss: [B][T]; backward_batch's rows form */
int rx_pretrain_backward_rows(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets, int B,
                              int T, int ignore_index, const double *weight, double *row_loss) {
    return rx_pretrain_backward_rows_temp(m, acts, targets, B, T, ignore_index, 1.0, weight,
                                          row_loss);
}

/* targets, weight, row_loss: [B][T] */
int rx_pretrain_backward_rows_temp(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets,
                                   int B, int T, int ignore_index, double temperature,
                                   const double *weight, double *row_loss) {
    static const char *const fn = "rx_pretrain_backward_rows";
    if (!weight || !row_loss)
        return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, !weight ? "weight" : "row_loss");
    const float k = inverse_temperature(fn, temperature);
    if (k == 0.0f) return RX_EINVAL;
    const int prc = rx_ptmodel_lora_prepare(m);   /* the forward's DoRA norms, again */
    if (prc != RX_OK) return prc;
    const int old = rx_gemm_set_precision(m ? m->precision : RX_PRECISION_FP32);
    const rx_frozen f = {m ? m->grads : NULL, m ? m->frozen : NULL, m ? m->n_frozen : 0};
    const rx_frozen was = rx_gemm_set_frozen(f);
    const rx_lora *was_lora = rx_gemm_set_lora(m && m->lora_on ? m->lora : NULL);
    const rx_base *was_base = rx_gemm_set_base(m ? m->base : NULL);
    double unused;
    const int rc = backward_batch(fn, m, acts, targets, B, T, ignore_index, weight, k, row_loss,
                                  &unused);
    rx_gemm_set_base(was_base);
    rx_gemm_set_lora(was_lora);
    rx_gemm_set_frozen(was);
    rx_gemm_set_precision(old);
    return rc;
}

double rx_pretrain_backward_batch(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets,
                                  int B, int T, int ignore_index) {
    double loss;
    int rc = rx_pretrain_backward_loss(m, acts, targets, B, T, ignore_index, &loss);
    return rc == RX_OK ? loss : NAN;
}

double rx_pretrain_backward(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets, int T,
                            int ignore_index) {
    double loss;
    int rc = rx_pretrain_backward_loss(m, acts, targets, 1, T, ignore_index, &loss);
    return rc == RX_OK ? loss : NAN;
}

/* the checks of backward_batch, then the loss alone (row_loss [B][T] not
 * NULL: each position's loss of the logits times k instead, as
 * rx_pretrain_row_losses_temp) */
static int loss_batch(const char *fn, rx_ptmodel *m, const rx_pt_acts *acts, const int *targets,
                      int B, int T, int ignore_index, float k, double *row_loss,
                      double *loss) {
    int rc = check_loss_call(fn, m, acts, targets, loss, B, T);
    if (rc != RX_OK) return rc;
    if (acts->saved->lnout_stale && (rc = lnout_forward(m, acts)) != RX_OK) return rc;
    const int V = m->cfg.vocab_size, C = m->cfg.n_embd, BT = B * T;
    if (row_loss && acts->logits)
        return rx_cross_entropy_rows_k(acts->logits, targets, BT, V, ignore_index, NULL, k, NULL,
                                       row_loss);
    if (row_loss)
        return rx_head_loss_rows_k(acts->lnout, m->head, targets, BT, C, V, ignore_index, 0.0,
                                   NULL, k, acts->head_rows, acts->dlogits, NULL, NULL,
                                   row_loss);
    if (acts->logits)
        return rx_cross_entropy(acts->logits, targets, BT, V, ignore_index, NULL, loss);
    return rx_head_loss(acts->lnout, m->head, targets, BT, C, V, ignore_index, 0.0,
                        acts->head_rows, acts->dlogits, NULL, NULL, loss);
}

int rx_pretrain_loss(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets, int B, int T,
                     int ignore_index, double *loss) {
    const int old = rx_gemm_set_precision(m ? m->precision : RX_PRECISION_FP32);
    const rx_base *was_base = rx_gemm_set_base(m ? m->base : NULL);
    const int rc = loss_batch("rx_pretrain_loss", m, acts, targets, B, T, ignore_index, 1.0f,
                              NULL, loss);
    rx_gemm_set_base(was_base);
    rx_gemm_set_precision(old);
    return rc;
}

int rx_pretrain_row_losses(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets, int B,
                           int T, int ignore_index, double *row_loss) {
    return rx_pretrain_row_losses_temp(m, acts, targets, B, T, ignore_index, 1.0, row_loss);
}

/* targets, row_loss: [B][T] */
int rx_pretrain_row_losses_temp(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets,
                                int B, int T, int ignore_index, double temperature,
                                double *row_loss) {
    static const char *const fn = "rx_pretrain_row_losses";
    if (!row_loss) return rx_fail(RX_EINVAL, "%s: row_loss is NULL", fn);
    const float k = inverse_temperature(fn, temperature);
    if (k == 0.0f) return RX_EINVAL;
    const int old = rx_gemm_set_precision(m ? m->precision : RX_PRECISION_FP32);
    const rx_base *was_base = rx_gemm_set_base(m ? m->base : NULL);
    double unused;
    const int rc = loss_batch(fn, m, acts, targets, B, T, ignore_index, k, row_loss, &unused);
    rx_gemm_set_base(was_base);
    rx_gemm_set_precision(old);
    return rc;
}
