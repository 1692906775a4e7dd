/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * block.c -- the RWKV-7 residual block (docs/maths.md §Blocks):
 *     h1 = ln1(x); x1 = x + TM(h1); h2 = ln2(x1); out = x1 + CM(h2)
 * The time-mix carry is over h1, the channel-mix carry over h2. The forward
 * can keep its intermediates (rx_block_acts) for the backward, as the whole
 * model does; the standalone rx_block_backward recomputes them first.
 */
#include <string.h>

#include "rx_internal.h"

/* A chunk of add_rows (omp simd: dst may alias a or b element for element) */
RX_HOT static void add_chunk(float *dst, const float *a, const float *b, size_t n) {
#pragma omp simd
    for (size_t i = 0; i < n; i++) dst[i] = a[i] + b[i];
}

/* dst[i] = a[i] + b[i] (dst may alias a or b) */
static void add_rows(float *dst, const float *a, const float *b, size_t n) {
#pragma omp parallel for schedule(static) if (!rx_in_parallel() && n >= RX_EW_MIN_PAR)
    for (size_t i0 = 0; i0 < n; i0 += RX_EW_CHUNK)
        add_chunk(dst + i0, a + i0, b + i0, rx_ew_len(i0, n));
}

static int block_params_ok(const rx_block_params *P) {
    return rx_tm_params_ok(&P->tm) && rx_cm_params_ok(&P->cm) && P->cm.c == P->tm.c && P->ln1_w &&
           P->ln1_b && P->ln2_w && P->ln2_b;
}

/* The RX_EINVAL of a non-NULL P that block_params_ok rejects */
static int block_params_fail(const char *fn, const rx_block_params *P) {
    return rx_fail(RX_EINVAL, "%s: P has a NULL tensor or sizes that disagree (c = %d, "
                   "n_head = %d, head_size = %d, cm.c = %d)", fn, P->tm.c, P->tm.n_head,
                   P->tm.head_size, P->cm.c);
}

/* the time-mix's floats; shared: less its WKV scratch (rx_tm_acts_floats_shared) */
static size_t tm_floats(const rx_block_params *P, size_t B, size_t T, int shared) {
    return (shared ? rx_tm_acts_floats_shared : rx_tm_acts_floats)(&P->tm, B, T);
}

static size_t block_acts_floats(const rx_block_params *P, size_t B, size_t T, int shared) {
    const size_t BT = B * T, C = (size_t)P->tm.c, F = (size_t)P->cm.ffn_dim;
    return tm_floats(P, B, T, shared) + 4 * rx_lines(BT * C) + rx_lines(BT * F);
}

size_t rx_block_acts_floats(const rx_block_params *P, size_t B, size_t T) {
    return block_acts_floats(P, B, T, 0);
}

/* the time-mix's buffers (its WKV scratch wkv_work when not NULL), then
 * h1 | x1 | h2 | xk | hid, each a whole number of 64-byte lines; owns
 * nothing */
static void block_acts_carve(rx_block_acts *S, const rx_block_params *P, size_t B, size_t T,
                             float *mem, float *wkv_work) {
    const size_t BT = B * T, C = (size_t)P->tm.c;
    memset(S, 0, sizeof *S);
    rx_tm_acts_carve_shared(&S->tm, &P->tm, B, T, mem, wkv_work);
    const size_t rc_ = rx_lines(BT * C);
    S->h1 = mem + tm_floats(P, B, T, wkv_work != NULL);
    S->x1 = S->h1 + rc_;
    S->h2 = S->x1 + rc_;
    S->xk = S->h2 + rc_;
    S->hid = S->xk + rc_;
}

void rx_block_acts_carve(rx_block_acts *S, const rx_block_params *P, size_t B, size_t T,
                         float *mem) {
    block_acts_carve(S, P, B, T, mem, NULL);
}

/* The lean set: the time-mix's lean buffers, then h1 | x1 in mem; h2 | xk |
 * hid in the block backward's scratch (work, rx_block_work_lean floats),
 * past the channel-mix backward's own dxk | dh there: they are written by
 * the forward, read by the channel-mix backward, and overwritten by the
 * time-mix backward after it. The time-mix's zg, which only the forward
 * reads, in the scratch's first buffer (t, written by the backward). */
size_t rx_block_acts_floats_lean(const rx_block_params *P, size_t B, size_t T) {
    return rx_tm_acts_floats_lean(&P->tm, B, T) + 2 * rx_lines(B * T * (size_t)P->tm.c);
}

void rx_block_acts_carve_lean(rx_block_acts *S, const rx_block_params *P, size_t B, size_t T,
                              float *mem, float *work) {
    const size_t BT = B * T, C = (size_t)P->tm.c, F = (size_t)P->cm.ffn_dim;
    memset(S, 0, sizeof *S);
    rx_tm_acts_carve_lean(&S->tm, &P->tm, B, T, mem);
    float *p = mem + rx_tm_acts_floats_lean(&P->tm, B, T);
    S->h1 = rx_carve(&p, BT * C);
    S->x1 = rx_carve(&p, BT * C);
    S->tm.zg = work;
    p = work + 3 * rx_lines(BT * C) + rx_lines(BT * F);   /* past t | dx1 | dxk | dh */
    S->h2 = rx_carve(&p, BT * C);
    S->xk = rx_carve(&p, BT * C);
    S->hid = rx_carve(&p, BT * F);
}

/* rx_block_acts_alloc, with the caller's WKV scratch when wkv_work is not NULL */
static int block_acts_alloc(rx_block_acts *S, const rx_block_params *P, size_t B, size_t T,
                            float *wkv_work) {
    memset(S, 0, sizeof *S);
    float *mem = rx_falloc(block_acts_floats(P, B, T, wkv_work != NULL));
    if (!mem) return rx_fail(RX_ENOMEM, "rx_block_acts_alloc: out of memory");
    block_acts_carve(S, P, B, T, mem, wkv_work);
    S->mem = mem;
    return RX_OK;
}

int rx_block_acts_alloc(rx_block_acts *S, const rx_block_params *P, size_t B, size_t T) {
    return block_acts_alloc(S, P, B, T, NULL);
}

int rx_block_acts_alloc_shared(rx_block_acts *S, const rx_block_params *P, size_t B, size_t T,
                               float *wkv_work) {
    return block_acts_alloc(S, P, B, T, wkv_work);
}

void rx_block_acts_free(rx_block_acts *S) {
    rx_tm_acts_free(&S->tm);
    free(S->mem);
    S->mem = NULL;
}

int rx_block_forward_acts(const rx_model_ctx *ctx, const rx_block_params *P, const float *x,
                          const float *tm_xprev_init, const float *cm_xprev_init,
                          const float *v_first_in, float *v_first_out, rx_block_acts *S,
                          float *out) {
    return rx_block_forward_state(ctx, P, x, tm_xprev_init, cm_xprev_init, v_first_in, v_first_out,
                                  NULL, S, out);
}

/* state: [B][H][N][N] or NULL, advanced in place */
int rx_block_forward_state(const rx_model_ctx *ctx, const rx_block_params *P, const float *x,
                           const float *tm_xprev_init, const float *cm_xprev_init,
                           const float *v_first_in, float *v_first_out, float *state,
                           rx_block_acts *S, float *out) {
    const rx_seqs u = {S->tm.B, S->tm.T, NULL, NULL, NULL};
    const rx_seqs *sq = S->tm.seqs ? S->tm.seqs : &u;
    const size_t BT = rx_seqs_rows(sq), C = (size_t)P->tm.c;
    /* x1 holds TM(h1) until x is added (x + TM(h1), as an add commutes);
     * out holds CM(h2), then the block output */
    rx_rownorm_forward(x, P->ln1_w, P->ln1_b, S->h1, NULL, NULL, BT, C, 1, (float)ctx->ln_eps);
    int rc = rx_tm_forward_state(ctx, &P->tm, S->h1, tm_xprev_init, v_first_in, v_first_out, state,
                                 &S->tm, S->x1);
    if (rc != RX_OK) return rc;
    add_rows(S->x1, x, S->x1, BT * C);
    rx_rownorm_forward(S->x1, P->ln2_w, P->ln2_b, S->h2, NULL, NULL, BT, C, 1, (float)ctx->ln_eps);
    /* out NULL (a backward's recompute): no value projection, whose product
     * only the block output reads */
    rc = rx_cm_forward_seqs(&P->cm, S->h2, cm_xprev_init, S->xk, S->hid, out, sq);
    if (rc != RX_OK) return rc;
    if (out) add_rows(out, S->x1, out, BT * C);
    return RX_OK;
}

/* x, out: [B][T][C] (T: S's); tm_carry, cm_carry: [B][C] or NULL; state:
 * [B][H][N][N] or NULL. A ragged step (S->tm.seqs): x, out [rows][C], the
 * carries [slots][C] and state [slots][H][N][N], row slot[b] sequence b's. */
int rx_block_step(const rx_model_ctx *ctx, const rx_block_params *P, const float *x,
                  float *tm_carry, float *cm_carry, const float *v_first_in, float *v_first_out,
                  float *state, rx_block_acts *S, float *out) {
    const rx_seqs u = {S->tm.B, S->tm.T, NULL, NULL, NULL};
    const rx_seqs *sq = S->tm.seqs ? S->tm.seqs : &u;
    const size_t C = (size_t)P->tm.c;
    int rc = rx_block_forward_state(ctx, P, x, tm_carry, cm_carry, v_first_in, v_first_out, state,
                                    S, out);
    if (rc != RX_OK) return rc;
    /* read above as the carries in, so overwritten only now */
    if (tm_carry) rx_shift_carry_seqs(tm_carry, S->h1, sq, C);
    if (cm_carry) rx_shift_carry_seqs(cm_carry, S->h2, sq, C);
    return RX_OK;
}

/* t | dx1 | then the channel-mix dxk | dh (and in the lean set h2 | xk |
 * hid after them), later the time-mix scratch */
static size_t block_work(const rx_block_params *P, size_t BT, int lean) {
    const size_t C = (size_t)P->tm.c, F = (size_t)P->cm.ffn_dim;
    const size_t cm = (lean ? 3 : 1) * rx_lines(BT * C) + (lean ? 2 : 1) * rx_lines(BT * F);
    const size_t tm = rx_tm_backward_work(&P->tm, BT);
    return 2 * rx_lines(BT * C) + (cm > tm ? cm : tm);
}

size_t rx_block_work(const rx_block_params *P, size_t BT) { return block_work(P, BT, 0); }

size_t rx_block_work_lean(const rx_block_params *P, size_t BT) { return block_work(P, BT, 1); }

int rx_block_backward_acts(const rx_model_ctx *ctx,
                           const rx_block_params *P, const rx_block_acts *S, const float *x,
                           const float *tm_xprev_init, const float *cm_xprev_init,
                           const float *v_first, const float *dy, rx_block_grads *G,
                           float *dx, float *d_tm_xprev_init, float *d_cm_xprev_init,
                           float *d_v_first, float *work) {
    return rx_block_backward_state(ctx, P, S, x, tm_xprev_init, cm_xprev_init, v_first, dy, G, dx,
                                   d_tm_xprev_init, d_cm_xprev_init, d_v_first, NULL, work);
}

/* d_state: [B][H][N][N] or NULL, written */
int rx_block_backward_state(const rx_model_ctx *ctx,
                            const rx_block_params *P, const rx_block_acts *S, const float *x,
                            const float *tm_xprev_init, const float *cm_xprev_init,
                            const float *v_first, const float *dy, rx_block_grads *G,
                            float *dx, float *d_tm_xprev_init, float *d_cm_xprev_init,
                            float *d_v_first, float *d_state, float *work) {
    const int vres = P->tm.layer_id > 0;
    const size_t B = S->tm.B, T = S->tm.T, BT = B * T, C = (size_t)P->tm.c;
    float *p = work, *t = rx_carve(&p, BT * C), *dx1 = rx_carve(&p, BT * C), *rest = p;
    float *dxk = rx_carve(&p, BT * C), *dh = p;
    /* out = x1 + CM(ln2(x1)) */
    int rc = rx_cm_backward_acts(&P->cm, S->h2, cm_xprev_init, S->xk, S->hid, dy, &G->cm,
                                 t, d_cm_xprev_init, B, T, dh, dxk);
    if (rc == RX_OK)
        rc = rx_layernorm_backward_eps(S->x1, P->ln2_w, P->ln2_b, t, dx1, G->ln2_w, G->ln2_b,
                                       (int)B, (int)T, (int)C, (float)ctx->ln_eps);
    if (rc == RX_OK) {
        add_rows(dx1, dx1, dy, BT * C);
        /* x1 = x + TM(ln1(x)) */
        rc = rx_tm_backward_state(ctx, &P->tm, &S->tm, S->h1, tm_xprev_init, vres ? v_first : NULL,
                                  dx1, &G->tm, t, d_tm_xprev_init, d_v_first, d_state, rest);
    }
    if (rc == RX_OK)
        rc = rx_layernorm_backward_eps(x, P->ln1_w, P->ln1_b, t, dx, G->ln1_w, G->ln1_b,
                                       (int)B, (int)T, (int)C, (float)ctx->ln_eps);
    if (rc == RX_OK) add_rows(dx, dx, dx1, BT * C);
    return rc;
}

/* A sequence entry point's own buffers: the forward leaves dy and the
 * grads NULL, and y is its out; the backward's y is dx. */
typedef struct {
    const float *x, *tm_xprev, *cm_xprev, *v_first, *dy;   /* read */
    const float *y, *d_tm_xprev, *d_cm_xprev, *d_v_first;  /* written (d_v_first: below) */
} block_io;

/* rx_spans_check of P (and G) and io: v_first is read at a later layer and
 * written by the forward at layer 0; d_v_first is the backward's output at
 * a later layer and its input (the downstream grad) at layer 0. A block's
 * norms are [C] vectors. */
static int block_spans_check(const char *fn, const rx_block_params *P, const rx_block_grads *G,
                             const block_io *io, int B, int T) {
    const size_t C = (size_t)P->tm.c, BTC = (size_t)B * T * C, BC = (size_t)B * C;
    const int later = P->tm.layer_id > 0;
    rx_spans in = {.n = 0}, out = {.n = 0};
    rx_tm_spans(&P->tm, G ? &G->tm : NULL, "P->tm.", "G->tm.", &in, &out);
    rx_cm_spans(&P->cm, G ? &G->cm : NULL, "P->cm.", "G->cm.", &in, &out);
    const float *const p[4] = {P->ln1_w, P->ln1_b, P->ln2_w, P->ln2_b};
    float *const g[4] = {G ? G->ln1_w : NULL, G ? G->ln1_b : NULL, G ? G->ln2_w : NULL,
                         G ? G->ln2_b : NULL};
    static const char *const name[4] = {"ln1_w", "ln1_b", "ln2_w", "ln2_b"};
    for (int i = 0; i < 4; i++) {
        rx_spans_add(&in, "P->", name[i], p[i], C, sizeof(float));
        rx_spans_add(&out, "G->", name[i], g[i], C, sizeof(float));
    }
    RX_SPAN_ADD(&in, "x", io->x, BTC);
    RX_SPAN_ADD(&in, "tm_xprev_init", io->tm_xprev, BC);
    RX_SPAN_ADD(&in, "cm_xprev_init", io->cm_xprev, BC);
    if (later || !io->dy) RX_SPAN_ADD(later ? &in : &out, "v_first", io->v_first, BTC);
    RX_SPAN_ADD(&in, "dy", io->dy, BTC);
    RX_SPAN_ADD(later ? &out : &in, "d_v_first", io->d_v_first, BTC);
    RX_SPAN_ADD(&out, io->dy ? "dx" : "out", io->y, BTC);
    RX_SPAN_ADD(&out, "d_tm_xprev_init", io->d_tm_xprev, BC);
    RX_SPAN_ADD(&out, "d_cm_xprev_init", io->d_cm_xprev, BC);
    return rx_spans_check(fn, &out, &in);
}

/* x, out, v_first: [B][T][C]; tm_xprev_init, cm_xprev_init: [B][C] or NULL */
int rx_block_forward_seq(const rx_block_params *P, const float *x,
                         const float *tm_xprev_init, const float *cm_xprev_init,
                         float *v_first, float *out, int B, int T) {
    static const char *const fn = "rx_block_forward_seq";
    const char *nul = rx_first_null(RX_NULLS(P, x, out), RX_NAMES("P", "x", "out"), 3);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (!block_params_ok(P))
        return block_params_fail(fn, P);
    int rc = rx_seq_check(fn, B, T, P->tm.layer_id, v_first);
    if (rc != RX_OK) return rc;
    const int vres = P->tm.layer_id > 0;
    const block_io io = {x, tm_xprev_init, cm_xprev_init, v_first, NULL, out, NULL, NULL, NULL};
    rc = block_spans_check(fn, P, NULL, &io, B, T);
    if (rc != RX_OK) return rc;
    rx_block_acts S;
    rc = rx_block_acts_alloc(&S, P, (size_t)B, (size_t)T);
    if (rc == RX_OK)
        rc = rx_block_forward_acts(&rx_ctx_default,
                                   P, x, tm_xprev_init, cm_xprev_init, vres ? v_first : NULL,
                                   vres ? NULL : v_first, &S, out);
    rx_block_acts_free(&S);
    return rc;
}

/* x, dy, dx, v_first, d_v_first: [B][T][C]; carries and their grads: [B][C] */
int rx_block_backward(const rx_block_params *P, const float *x,
                      const float *tm_xprev_init, const float *cm_xprev_init,
                      const float *v_first, const float *dy, rx_block_grads *G, float *dx,
                      float *d_tm_xprev_init, float *d_cm_xprev_init, float *d_v_first,
                      int B, int T) {
    static const char *const fn = "rx_block_backward";
    const char *nul = rx_first_null(RX_NULLS(P, x, dy, G, dx), RX_NAMES("P", "x", "dy", "G", "dx"),
                                    5);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (!block_params_ok(P))
        return block_params_fail(fn, P);
    if (!rx_tm_grads_ok(&P->tm, &G->tm) || !G->cm.ffn_x_k || !G->cm.ffn_key_w ||
        !G->cm.ffn_value_w || !G->ln1_w || !G->ln1_b || !G->ln2_w || !G->ln2_b)
        return rx_fail(RX_EINVAL, "%s: G has a NULL grad", fn);
    int rc = rx_seq_check(fn, B, T, P->tm.layer_id, v_first);
    if (rc != RX_OK) return rc;
    const int vres = P->tm.layer_id > 0;
    const size_t BT = (size_t)B * T;
    const block_io io = {x,  tm_xprev_init, cm_xprev_init,   v_first,  dy,
                         dx, d_tm_xprev_init, d_cm_xprev_init, d_v_first};
    rc = block_spans_check(fn, P, G, &io, B, T);
    if (rc != RX_OK) return rc;
    rx_block_acts S;
    float *work = rx_falloc(rx_block_work(P, BT));
    rc = rx_block_acts_alloc(&S, P, (size_t)B, (size_t)T);
    if (rc == RX_OK && !work)
        rc = rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    /* recompute the forward, keeping its intermediates (the block output
     * itself is not needed) */
    if (rc == RX_OK)
        rc = rx_block_forward_acts(&rx_ctx_default,
                                   P, x, tm_xprev_init, cm_xprev_init, vres ? v_first : NULL,
                                   NULL, &S, NULL);
    if (rc == RX_OK)
        rc = rx_block_backward_acts(&rx_ctx_default,
                                    P, &S, x, tm_xprev_init, cm_xprev_init, v_first, dy, G, dx,
                                    d_tm_xprev_init, d_cm_xprev_init, d_v_first, work);
    rx_block_acts_free(&S);
    free(work);
    return rc;
}
