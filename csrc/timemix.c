/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * timemix.c -- the RWKV-7 time-mix (docs/maths.md §Time-mix), forward and exact backward.
 *
 * rx_tm_forward_acts computes every intermediate the backward needs into an
 * rx_tm_acts; the forward entry point and the backward (which gets only x,
 * and so recomputes) share it. Rows are the B*T tokens: projections and
 * LoRAs are single GEMMs over all rows, and the elementwise passes run
 * OpenMP over rows; the backward's parameter-vector grads are summed per
 * fixed block of tokens and then across blocks in order, so the result
 * does not depend on the thread count.
 */
#include <string.h>

#include "rx_internal.h"

#define TM_DECAY_SCALE 0.6065306597126334f /* e^{-1/2} */
#define TM_KK_FLOOR RX_KK_FLOOR               /* floor of the kk L2 norm (rx_pretrain.h) */

enum { ACT_NONE, ACT_TANH, ACT_SIGMOID };

int rx_tm_params_ok(const rx_tm_params *P) {
    if (!P || P->c < 1 || P->n_head < 1 || P->head_size < 1 || P->layer_id < 0) return 0;
    if ((int64_t)P->n_head * P->head_size != P->c) return 0;
    if (P->Dw < 1 || P->Da < 1 || P->Dg < 1 || (P->layer_id > 0 && P->Dv < 1)) return 0;
    /* every field this layer has is set; block 0's value residual is not read */
#define TM_SET(f, rows, cols, init, layer0) \
    if (!P->f && ((layer0) || P->layer_id > 0)) return 0;
    RX_TM_FIELDS(TM_SET)
#undef TM_SET
    return 1;
}

void rx_tm_spans(const rx_tm_params *P, const rx_tm_grads *G, const char *pp, const char *gp,
                 rx_spans *in, rx_spans *out) {
    const size_t C = (size_t)P->c, Dw = (size_t)P->Dw, Da = (size_t)P->Da, Dg = (size_t)P->Dg;
    const size_t Dv = (size_t)P->Dv, NONE = 1;
#define TM_SPAN(f, rows, cols, init, layer0)                                   \
    if ((layer0) || P->layer_id > 0) {                                         \
        rx_spans_add(in, pp, #f, P->f, (rows) * (cols), sizeof(float));       \
        if (G) rx_spans_add(out, gp, #f, G->f, (rows) * (cols), sizeof(float)); \
    }
    RX_TM_FIELDS(TM_SPAN)
#undef TM_SPAN
}

/* The RX_EINVAL of a non-NULL P that rx_tm_params_ok rejects */
static int tm_params_fail(const char *fn, const rx_tm_params *P) {
    return rx_fail(RX_EINVAL, "%s: P has a NULL tensor or sizes that disagree (c = %d, "
                   "n_head = %d, head_size = %d, layer_id = %d)", fn, P->c, P->n_head,
                   P->head_size, P->layer_id);
}

int rx_tm_grads_ok(const rx_tm_params *P, const rx_tm_grads *G) {
    if (!G) return 0;
#define TM_SET(f, rows, cols, init, layer0) \
    if (!G->f && ((layer0) || P->layer_id > 0)) return 0;
    RX_TM_FIELDS(TM_SET)
#undef TM_SET
    return 1;
}

#define TM_ACTS_NBUFS 19   /* the [BT][C] buffers of every layer (bufs below) */

/* The lean set (rx_tm_acts_carve_lean) has no buffers of its own for the
 * six lerps: they share the six of kmod, wsig, aw, bw, y, z, which the
 * forward writes only after its projections have read the lerps, and the
 * backward reads only before it makes the lerps again. Nor for zg, which
 * the forward writes into the caller's scratch for its output projection
 * and the backward makes again (z*g, the same product) in its own. */
#define TM_LERPS 6

/* own_work: the set holds its own WKV scratch (else the caller's, shared) */
static size_t tm_acts_floats(const rx_tm_params *P, size_t B, size_t T, int lean, int own_work) {
    const size_t BT = B * T, C = (size_t)P->c, H = (size_t)P->n_head, N = (size_t)P->head_size;
    const int vres = P->layer_id > 0;
    const size_t Dv = vres ? (size_t)P->Dv : 0;
    /* plus vmod and vg at layer > 0 */
    return (TM_ACTS_NBUFS - (size_t)(lean ? TM_LERPS + 1 : 0) + (size_t)(2 * vres)) *
               rx_lines(BT * C) +
           rx_lines(BT * (size_t)P->Dw) + rx_lines(BT * (size_t)P->Da) +
           rx_lines(BT * (size_t)P->Dg) + rx_lines(BT * Dv) + rx_lines(BT * H) +
           rx_lines(RX_WKV7_CP(B * H, T, N)) +
           (own_work ? rx_lines(rx_wkv7_work_floats(B * H, N)) : 0);
}

size_t rx_tm_acts_floats(const rx_tm_params *P, size_t B, size_t T) {
    return tm_acts_floats(P, B, T, 0, 1);
}

size_t rx_tm_acts_floats_lean(const rx_tm_params *P, size_t B, size_t T) {
    return tm_acts_floats(P, B, T, 1, 1);
}

size_t rx_tm_acts_floats_shared(const rx_tm_params *P, size_t B, size_t T) {
    return tm_acts_floats(P, B, T, 0, 0);
}

/* wkv_work: the caller's WKV scratch, or NULL to carve the set's own */
static void tm_acts_carve(rx_tm_acts *A, const rx_tm_params *P, size_t B, size_t T, float *mem,
                          int lean, float *wkv_work) {
    const size_t BT = B * T, C = (size_t)P->c, H = (size_t)P->n_head, N = (size_t)P->head_size;
    const int vres = P->layer_id > 0;
    const size_t Dv = vres ? (size_t)P->Dv : 0;
    memset(A, 0, sizeof *A);
    A->B = B;
    A->T = T;
    /* the lerps first, so that the lean set skips them */
    float **bufs[] = {&A->xr, &A->xw, &A->xk, &A->xv, &A->xa, &A->xg, &A->r, &A->k,
                      &A->v,  &A->kmod, &A->w, &A->wsig, &A->a, &A->g, &A->aw, &A->bw,
                      &A->y,  &A->z, &A->zg};
    _Static_assert(sizeof bufs / sizeof bufs[0] == TM_ACTS_NBUFS, "TM_ACTS_NBUFS");
    float *p = mem;
    /* zg last: the lean set leaves it to the caller */
    for (size_t i = lean ? TM_LERPS : 0; i < TM_ACTS_NBUFS - (size_t)lean; i++)
        *bufs[i] = rx_carve(&p, BT * C);
    if (lean) {
        A->xr = A->kmod, A->xw = A->wsig, A->xk = A->aw;
        A->xv = A->bw, A->xa = A->y, A->xg = A->z;
        A->lean = 1;
    }
    if (vres) {
        A->vmod = rx_carve(&p, BT * C);
        A->vg = rx_carve(&p, BT * C);
    } else {
        A->vmod = A->v;
    }
    A->tw = rx_carve(&p, BT * (size_t)P->Dw);
    A->ta = rx_carve(&p, BT * (size_t)P->Da);
    A->tg = rx_carve(&p, BT * (size_t)P->Dg);
    A->tv = vres ? rx_carve(&p, BT * Dv) : NULL;
    A->bonus = rx_carve(&p, BT * H);
    A->wkv_cp = rx_carve(&p, RX_WKV7_CP(B * H, T, N));
    A->wkv_work = wkv_work ? wkv_work : rx_carve(&p, rx_wkv7_work_floats(B * H, N));
}

void rx_tm_acts_carve(rx_tm_acts *A, const rx_tm_params *P, size_t B, size_t T, float *mem) {
    tm_acts_carve(A, P, B, T, mem, 0, NULL);
}

void rx_tm_acts_carve_shared(rx_tm_acts *A, const rx_tm_params *P, size_t B, size_t T,
                             float *mem, float *wkv_work) {
    tm_acts_carve(A, P, B, T, mem, 0, wkv_work);
}

void rx_tm_acts_carve_lean(rx_tm_acts *A, const rx_tm_params *P, size_t B, size_t T,
                           float *mem) {
    tm_acts_carve(A, P, B, T, mem, 1, NULL);
}

int rx_tm_acts_alloc(rx_tm_acts *A, const rx_tm_params *P, size_t B, size_t T) {
    float *mem = rx_falloc(rx_tm_acts_floats(P, B, T));
    memset(A, 0, sizeof *A);
    if (!mem) return rx_fail(RX_ENOMEM, "rx_tm_acts_alloc: out of memory");
    rx_tm_acts_carve(A, P, B, T, mem);
    A->mem = mem;
    return RX_OK;
}

void rx_tm_acts_free(rx_tm_acts *A) {
    free(A->mem);
    A->mem = NULL;
}

/* A chunk of a LoRA hidden, in place: h [n] = act(h) */
RX_HOT static void activate_chunk(float *h, size_t n, int act) {
    if (act == ACT_TANH)
        for (size_t i = 0; i < n; i++) h[i] = rx_tanhf(h[i]);
    else
        for (size_t i = 0; i < n; i++) h[i] = rx_sigmoidf(h[i]);
}

/* Its backward on the grad dh [n] from the activated h: dh *= act'(h) */
RX_HOT static void activate_back_chunk(const float *restrict h, float *restrict dh, size_t n,
                                       int act) {
    if (act == ACT_TANH)
        for (size_t i = 0; i < n; i++) dh[i] *= 1.0f - h[i] * h[i];
    else
        for (size_t i = 0; i < n; i++) dh[i] *= h[i] * (1.0f - h[i]);
}

/* h [n] = act(h) */
static void activate(float *h, size_t n, int act) {
#pragma omp parallel for schedule(static) if (!rx_in_parallel() && n >= RX_EW_MIN_PAR)
    for (size_t i0 = 0; i0 < n; i0 += RX_EW_CHUNK) activate_chunk(h + i0, rx_ew_len(i0, n), act);
}

/* One LoRA, out [BT][C] = act(xin [BT][C] . W1 [C][D]) . W2 [D][C], with
 * its hidden h [BT][D]; backward: grads G1, G2 on W1, W2, dh [BT][D]
 * scratch, dxin [BT][C] written (beta 0) or accumulated (beta 1). */
typedef struct {
    const float *xin, *W1, *W2;
    int act;
    size_t D;
    float *h, *out;
    float *G1, *G2, *dh, *dxin;
    float beta;
} lora;

/* The up- and down-projections of every LoRA of a layer (and the extra
 * independent GEMMs in pre) run as two GEMM batches. A layer has at most
 * LORA_MAX LoRAs; its callers join at most PRE_MAX projections. */
#define LORA_MAX 4
#define PRE_MAX 6
static int lora_forward(const lora *L, size_t n, const rx_gemm_op *pre, size_t npre, size_t BT,
                         size_t C) {
    rx_gemm_op ops[PRE_MAX + LORA_MAX];
    size_t k = 0;
    for (size_t i = 0; i < npre; i++) ops[k++] = pre[i];
    for (size_t i = 0; i < n; i++)
        ops[k++] = (rx_gemm_op){0, 0, BT, L[i].D, C, L[i].xin, C, L[i].W1, L[i].D, 0.0f, L[i].h, L[i].D};
    int rc = rx_pgemm_batch(ops, k);
    if (rc != RX_OK) return rc;
    for (size_t i = 0; i < n; i++) {
        if (L[i].act != ACT_NONE) activate(L[i].h, BT * L[i].D, L[i].act);
        ops[i] = (rx_gemm_op){0, 0, BT, C, L[i].D, L[i].h, L[i].D, L[i].W2, C, 0.0f, L[i].out, C};
    }
    return rx_pgemm_batch(ops, n);
}

/* Backward of lora_forward for the grads dout [BT][C] on each out, in the
 * same two batches (pre joins the first). */
static int lora_backward(const lora *L, const float *const *dout, size_t n,
                         const rx_gemm_op *pre, size_t npre, size_t BT, size_t C) {
    rx_gemm_op ops[PRE_MAX + 2 * LORA_MAX];
    size_t k = 0;
    for (size_t i = 0; i < npre; i++) ops[k++] = pre[i];
    for (size_t i = 0; i < n; i++) {
        const size_t D = L[i].D;
        ops[k++] = (rx_gemm_op){1, 0, D, C, BT, L[i].h, D, dout[i], C, 0.0f, L[i].G2, C};
        ops[k++] = (rx_gemm_op){0, 1, BT, D, C, dout[i], C, L[i].W2, C, 0.0f, L[i].dh, D};
    }
    int rc = rx_pgemm_batch(ops, k);
    if (rc != RX_OK) return rc;
    k = 0;
    for (size_t i = 0; i < n; i++) {
        const size_t D = L[i].D, nh = BT * D;
        if (L[i].act != ACT_NONE) {
#pragma omp parallel for schedule(static) if (!rx_in_parallel() && nh >= RX_EW_MIN_PAR)
            for (size_t i0 = 0; i0 < nh; i0 += RX_EW_CHUNK)
                activate_back_chunk(L[i].h + i0, L[i].dh + i0, rx_ew_len(i0, nh), L[i].act);
        }
        ops[k++] = (rx_gemm_op){1, 0, C, D, BT, L[i].xin, C, L[i].dh, D, 0.0f, L[i].G1, D};
        ops[k++] = (rx_gemm_op){0, 1, BT, C, D, L[i].dh, D, L[i].W1, D, L[i].beta, L[i].dxin, C};
    }
    return rx_pgemm_batch(ops, k);
}

/* Backward scratch, [BT][C] each unless noted. After the fused passes the
 * WKV7 grads hold the grads of the quantities named on the right. */
typedef struct {
    float *dz;        /* grad on z; then on the v-residual gate pre-activation */
    float *dg;        /* grad on g */
    float *dyw;       /* grad on the WKV7 output y */
    float *dr, *dk, *dv;     /* WKV7 grads -> grads on r, k, v projections */
    float *dw, *da, *db;     /* WKV7 grads -> decay / a pre-activations; db: grad on kk */
    float *dxv;       /* grad on the v lerp output */
    float *dlo;       /* [BT][Dw+Da+Dg+Dv] LoRA hidden grads */
    float *ds;        /* [BT][H] grad on the bonus sum */
    float *part;      /* [blocks][TM_NVEC][C] per-block parameter-vector grads */
} tm_grad_scratch;

/* The LoRAs of a layer, in the order w, a, g, v (v used from layer 1 on):
 * inputs, weights, hiddens and forward outputs; with S, the backward's
 * hidden-grad scratch, the rest left for the caller. */
static void tm_loras(const rx_tm_params *P, const rx_tm_acts *A, tm_grad_scratch *S, lora L[4]) {
    const size_t BT = A->B * A->T, D[4] = {(size_t)P->Dw, (size_t)P->Da, (size_t)P->Dg,
                                          (size_t)P->Dv};
    const float *xin[4] = {A->xw, A->xa, A->xg, A->xv};
    const float *W1[4] = {P->w1, P->a1, P->g1, P->v1}, *W2[4] = {P->w2, P->a2, P->g2, P->v2};
    float *h[4] = {A->tw, A->ta, A->tg, A->tv}, *out[4] = {A->w, A->a, A->g, A->vg};
    const int act[4] = {ACT_TANH, ACT_NONE, ACT_SIGMOID, ACT_NONE};
    float *dh = S ? S->dlo : NULL;
    for (int i = 0; i < 4; i++) {
        L[i] = (lora){xin[i], W1[i], W2[i], act[i], D[i], h[i], out[i],
                      NULL, NULL, dh, NULL, 0.0f};
        if (dh) dh += BT * D[i];
    }
}

/* One token row (offset o = bt*C): the LoRA pre-activations already in w,
 * a, vg become the decay, the gates and the value residual; then kk and the
 * modified key, per head. vf: v_first row in (layer > 0) or out (layer 0,
 * may be NULL). */
RX_HOT static void gates_row(const rx_tm_params *P, const rx_tm_acts *A, size_t o,
                             const float *vf_in, float *vf_out) {
    const size_t C = (size_t)P->c, H = (size_t)P->n_head, N = (size_t)P->head_size;
    const float *k = A->k + o, *v = A->v + o;
    float *w = A->w + o, *ws = A->wsig + o, *a = A->a + o, *km = A->kmod + o;
    const float *w0 = P->w0, *a0 = P->a0, *ka = P->k_a;
#pragma omp simd
    for (size_t c = 0; c < C; c++) {
        float s = rx_sigmoidf(w0[c] + w[c]);
        ws[c] = s;
        w[c] = rx_expf(-TM_DECAY_SCALE * s);
        a[c] = rx_sigmoidf(a0[c] + a[c]);
        km[c] = k[c] * (1.0f + (a[c] - 1.0f) * ka[c]);
    }
    if (P->layer_id > 0) {
        const float *v0 = P->v0;
        float *vg = A->vg + o, *vm = A->vmod + o;
#pragma omp simd
        for (size_t c = 0; c < C; c++) {
            vg[c] = rx_sigmoidf(v0[c] + vg[c]);
            vm[c] = v[c] + (vf_in[c] - v[c]) * vg[c];
        }
    } else if (vf_out) {
        memcpy(vf_out, v, C * sizeof(float));
    }
    for (size_t h = 0; h < H; h++) {
        const float *kh = k + h * N, *kkw = P->k_k + h * N, *ah = a + h * N;
        float *aw = A->aw + o + h * N, *bw = A->bw + o + h * N, ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (size_t n = 0; n < N; n++) ss += (kh[n] * kkw[n]) * (kh[n] * kkw[n]);
        float nrm = sqrtf(ss), inv = 1.0f / (nrm > TM_KK_FLOOR ? nrm : TM_KK_FLOOR);
#pragma omp simd
        for (size_t n = 0; n < N; n++) {
            float kk = kh[n] * kkw[n] * inv;
            aw[n] = -kk;
            bw[n] = kk * ah[n];
        }
    }
}

/* One token row: the r*k*r_k bonus per head, added to the group-norm
 * output z, then zg = z*g. */
RX_HOT static void bonus_row(const rx_tm_params *P, const rx_tm_acts *A, size_t bt) {
    const size_t C = (size_t)P->c, H = (size_t)P->n_head, N = (size_t)P->head_size;
    const size_t o = bt * C;
    for (size_t h = 0; h < H; h++) {
        const size_t oh = o + h * N;
        const float *r = A->r + oh, *km = A->kmod + oh, *vm = A->vmod + oh, *rk = P->r_k + h * N;
        const float *g = A->g + oh;
        float *z = A->z + oh, *zg = A->zg + oh, s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (size_t n = 0; n < N; n++) s += r[n] * km[n] * rk[n];
        A->bonus[bt * H + h] = s;
#pragma omp simd
        for (size_t n = 0; n < N; n++) {
            z[n] += s * vm[n];
            zg[n] = z[n] * g[n];
        }
    }
}

/* The six token-shift lerps of x into A (the forward's, and the lean
 * backward's again: the same call, so the same bits) */
static void tm_lerps(const rx_tm_params *P, const rx_tm_acts *A, const float *x,
                     const float *x_prev_init) {
    const float *mix[6] = {P->x_r, P->x_w, P->x_k, P->x_v, P->x_a, P->x_g};
    float *xin[6] = {A->xr, A->xw, A->xk, A->xv, A->xa, A->xg};
    const rx_seqs u = {A->B, A->T, NULL, NULL, NULL};
    rx_shift_lerp_seqs(6, mix, x, x_prev_init, xin, A->seqs ? A->seqs : &u, (size_t)P->c);
}

int rx_tm_forward_state(const rx_model_ctx *ctx,
                        const rx_tm_params *P, const float *x, const float *x_prev_init,
                        const float *v_first_in, float *v_first_out, float *state,
                        rx_tm_acts *A, float *out) {
    const size_t B = A->B, T = A->T, C = (size_t)P->c;
    const size_t BT = A->seqs ? rx_seqs_rows(A->seqs) : B * T;
    const size_t H = (size_t)P->n_head, N = (size_t)P->head_size;
    tm_lerps(P, A, x, x_prev_init);
    const rx_gemm_op rkv[3] = {
        {0, 0, BT, C, C, A->xr, C, P->receptance_w, C, 0.0f, A->r, C},
        {0, 0, BT, C, C, A->xk, C, P->key_w, C, 0.0f, A->k, C},
        {0, 0, BT, C, C, A->xv, C, P->value_w, C, 0.0f, A->v, C}};
    /* pre-activations of the decay, a and v-residual gates; g is complete */
    lora L[4];
    tm_loras(P, A, NULL, L);
    int rc = lora_forward(L, P->layer_id > 0 ? 4 : 3, rkv, 3, BT, C);
    if (rc != RX_OK) return rc;
#pragma omp parallel for schedule(static) if (!rx_in_parallel() && BT * C >= RX_EW_MIN_PAR)
    for (size_t bt = 0; bt < BT; bt++)
        gates_row(P, A, bt * C, v_first_in ? v_first_in + bt * C : NULL,
                  v_first_out ? v_first_out + bt * C : NULL);
    rc = A->seqs ? rx_wkv7_forward_seqs(A->r, A->w, A->kmod, A->vmod, A->aw, A->bw, state, A->y,
                                        A->seqs, (int)H, (int)N, A->wkv_work)
                 : rx_wkv7_forward_cp(A->r, A->w, A->kmod, A->vmod, A->aw, A->bw, state, A->y,
                                      state, A->wkv_cp, A->wkv_work, (int)B, (int)T, (int)H,
                                      (int)N);
    if (rc != RX_OK) return rc;
    rx_rownorm_forward(A->y, P->ln_x_w, P->ln_x_b, A->z, NULL, NULL, BT * H, N, H,
                       (float)ctx->gn_eps);
#pragma omp parallel for schedule(static) if (!rx_in_parallel() && BT * C >= RX_EW_MIN_PAR)
    for (size_t bt = 0; bt < BT; bt++) bonus_row(P, A, bt);
    return out ? rx_pgemm(0, 0, BT, C, C, A->zg, C, P->output_w, C, 0.0f, out, C) : RX_OK;
}

int rx_tm_forward_acts(const rx_model_ctx *ctx,
                       const rx_tm_params *P, const float *x, const float *x_prev_init,
                       const float *v_first_in, float *v_first_out, rx_tm_acts *A,
                       float *out) {
    return rx_tm_forward_state(ctx, P, x, x_prev_init, v_first_in, v_first_out, NULL, A, out);
}


/* The per-(token, head) passes run over fixed blocks of tokens
 * (rx_block_rows), a thread taking a contiguous run of blocks: whole rows,
 * where a split by heads had two threads stream interleaved halves of
 * every row (measured at twice the thread time of one thread). Each block
 * sums its parameter-vector grads into its own rows of part, added in
 * block order afterwards, so the result depends on B*T but not on the
 * thread count. */
enum { TV_KA, TV_A0, TV_W0, TV_KK, TV_V0, TV_RK, TM_NVEC };

/* Floats of part: the passes' block sums, later the six lerps' */
static size_t tm_part(size_t BT, size_t C) {
    size_t a = rx_row_blocks(BT) * TM_NVEC * C, b = RX_SHIFT_PART(6, BT, C);
    return a > b ? a : b;
}

/* Pass over one (token, head) after the output projection: dz *= g, dg,
 * and the bonus-sum grad; dr_k accumulated into the block's part rows V. */
RX_HOT static void gate_bonus_back(const rx_tm_params *P, const rx_tm_acts *A,
                                   tm_grad_scratch *S, float *V, size_t bt, size_t h) {
    const size_t C = (size_t)P->c, H = (size_t)P->n_head, N = (size_t)P->head_size;
    const size_t oh = bt * C + h * N;
    const float *g = A->g + oh, *z = A->z + oh, *vm = A->vmod + oh, *r = A->r + oh;
    const float *km = A->kmod + oh;
    float *dz = S->dz + oh, *dg = S->dg + oh, *drk = V + TV_RK * C + h * N, ds = 0.0f;
#pragma omp simd reduction(+ : ds)
    for (size_t n = 0; n < N; n++) {
        dg[n] = dz[n] * z[n];
        dz[n] *= g[n];
        ds += dz[n] * vm[n];
    }
    S->ds[bt * H + h] = ds;
#pragma omp simd
    for (size_t n = 0; n < N; n++) drk[n] += ds * r[n] * km[n];
}

/* Pass over one (token, head) after the WKV7 backward: adds the bonus
 * grads, recombines a_wkv/b_wkv onto kk and a, undoes the key modification,
 * the kk normalisation, the value residual and the gate nonlinearities.
 * Three vectorised loops: the shared part, the value residual (layer > 0)
 * or the v_first grad (layer 0), and the kk normalisation. Parameter-vector
 * grads accumulate into the block's part rows V. */
RX_HOT static void wkv_inputs_back(const rx_tm_params *P, const rx_tm_acts *A,
                                   tm_grad_scratch *S, float *V, const float *vf,
                                   const float *dvf_in, float *dvf_out, size_t bt, size_t h) {
    const size_t C = (size_t)P->c, H = (size_t)P->n_head, N = (size_t)P->head_size;
    const size_t oh = bt * C + h * N, c0 = h * N;
    const float *r = A->r + oh, *k = A->k + oh, *v = A->v + oh, *km = A->kmod + oh;
    const float *a = A->a + oh, *w = A->w + oh, *ws = A->wsig + oh, *aw = A->aw + oh;
    const float *rk = P->r_k + c0, *kka = P->k_a + c0, *kkw = P->k_k + c0;
    const float ds = S->ds[bt * H + h], bon = A->bonus[bt * H + h];
    float *dz = S->dz + oh, *dr = S->dr + oh, *dk = S->dk + oh, *dv = S->dv + oh;
    float *dw = S->dw + oh, *da = S->da + oh, *dkk = S->db + oh;
    float *gka = V + TV_KA * C + c0, *ga0 = V + TV_A0 * C + c0, *gw0 = V + TV_W0 * C + c0;
    float *gkk = V + TV_KK * C + c0;
    float ss = 0.0f, dot = 0.0f;
#pragma omp simd reduction(+ : ss, dot)
    for (size_t n = 0; n < N; n++) {
        float dkm = dk[n] + ds * r[n] * rk[n]; /* grad on the modified key */
        dr[n] += ds * km[n] * rk[n];
        float kk = -aw[n];
        float dkkn = dkk[n] * a[n] - da[n];    /* b_wkv = kk*a, a_wkv = -kk */
        float dat = dkk[n] * kk + dkm * k[n] * kka[n];
        gka[n] += dkm * k[n] * (a[n] - 1.0f);
        dk[n] = dkm * (1.0f + (a[n] - 1.0f) * kka[n]);
        dkk[n] = dkkn;
        da[n] = dat * a[n] * (1.0f - a[n]);
        ga0[n] += da[n];
        dw[n] *= -TM_DECAY_SCALE * w[n] * ws[n] * (1.0f - ws[n]);
        gw0[n] += dw[n];
        dv[n] += dz[n] * bon;                  /* grad on the modified value */
        float u = k[n] * kkw[n];
        ss += u * u;
        dot += kk * dkkn;
    }
    if (P->layer_id > 0) {
        const float *vg = A->vg + oh;
        float *gv0 = V + TV_V0 * C + c0;
        if (dvf_out) {
#pragma omp simd
            for (size_t n = 0; n < N; n++) dvf_out[n] = dv[n] * vg[n];
        }
        /* dz becomes the grad on the v-residual gate pre-activation */
#pragma omp simd
        for (size_t n = 0; n < N; n++) {
            float dvm = dv[n];
            dv[n] = dvm * (1.0f - vg[n]);
            dz[n] = dvm * (vf[n] - v[n]) * vg[n] * (1.0f - vg[n]);
            gv0[n] += dz[n];
        }
    } else if (dvf_in) {
#pragma omp simd
        for (size_t n = 0; n < N; n++) dv[n] += dvf_in[n];
    }
    /* kk = u / max(|u|, floor), u = k*k_k: below the floor the scale is constant */
    float nrm = sqrtf(ss);
    const int scaled = nrm > TM_KK_FLOOR;
    const float inv = 1.0f / (scaled ? nrm : TM_KK_FLOOR), dotu = scaled ? dot : 0.0f;
#pragma omp simd
    for (size_t n = 0; n < N; n++) {
        float du = (dkk[n] + aw[n] * dotu) * inv;
        dk[n] += du * kkw[n];
        gkk[n] += du * k[n];
    }
}

/* A chunk of dst [n] = a * b: bonus_row's zg = z*g again */
RX_HOT static void mul_chunk(float *restrict dst, const float *restrict a,
                             const float *restrict b, size_t n) {
#pragma omp simd
    for (size_t i = 0; i < n; i++) dst[i] = a[i] * b[i];
}

/* The four LoRA hiddens side by side */
static size_t lora_dsum(const rx_tm_params *P) {
    return (size_t)P->Dw + (size_t)P->Da + (size_t)P->Dg + (size_t)P->Dv;
}

/* Floats of rx_tm_backward_acts's scratch (tm_grad_scratch): ten [BT][C]
 * grads, the LoRA hidden grads, the bonus-sum grad and the block parts. */
size_t rx_tm_backward_work(const rx_tm_params *P, size_t BT) {
    return 10 * rx_lines(BT * (size_t)P->c) + rx_lines(BT * lora_dsum(P)) +
           rx_lines(BT * (size_t)P->n_head) + rx_lines(tm_part(BT, (size_t)P->c));
}

int rx_tm_backward_state(const rx_model_ctx *ctx,
                         const rx_tm_params *P, const rx_tm_acts *A, const float *x,
                         const float *x_prev_init, const float *v_first, const float *dy,
                         rx_tm_grads *G, float *dx, float *d_xprev_init, float *d_v_first,
                         float *d_state, float *work) {
    const size_t B = A->B, T = A->T, BT = B * T, C = (size_t)P->c;
    const size_t H = (size_t)P->n_head, N = (size_t)P->head_size;
    const int vres = P->layer_id > 0;
    float *own = NULL;
    if (!work) {
        work = own = rx_falloc(rx_tm_backward_work(P, BT));
        if (!own) return rx_fail(RX_ENOMEM, "rx_tm_backward_acts: out of memory");
    }
    tm_grad_scratch S;
    float *p = work;
    float **bufs[] = {&S.dz, &S.dg, &S.dyw, &S.dr, &S.dk, &S.dv, &S.dw, &S.da, &S.db, &S.dxv};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) *bufs[i] = rx_carve(&p, BT * C);
    S.dlo = rx_carve(&p, BT * lora_dsum(P));
    S.ds = rx_carve(&p, BT * H);
    const size_t nblk = rx_row_blocks(BT), rows = rx_block_rows(BT);
    S.part = rx_carve(&p, tm_part(BT, C));

    /* the group norm's affine grads accumulate; everything else is written */
    rx_fzero(G->ln_x_w, C);
    rx_fzero(G->ln_x_b, C);

    /* out = zg . output_w; the lean set's zg again in dr, which the WKV7
     * backward writes only after the output projection's grads */
    const float *zg = A->zg;
    if (A->lean) {
        zg = S.dr;
#pragma omp parallel for schedule(static) if (!rx_in_parallel() && BT * C >= RX_EW_MIN_PAR)
        for (size_t i0 = 0; i0 < BT * C; i0 += RX_EW_CHUNK)
            mul_chunk(S.dr + i0, A->z + i0, A->g + i0, rx_ew_len(i0, BT * C));
    }
    const rx_gemm_op out[2] = {{1, 0, C, C, BT, zg, C, dy, C, 0.0f, G->output_w, C},
                               {0, 1, BT, C, C, dy, C, P->output_w, C, 0.0f, S.dz, C}};
    int rc = rx_pgemm_batch(out, 2);
    if (rc != RX_OK) {
        free(own);
        return rc;
    }
    const int par = !rx_in_parallel() && BT * C >= RX_EW_MIN_PAR;
    /* each block zeroes its own part rows: the thread that sums into them */
#pragma omp parallel for schedule(static) if (par)
    for (size_t blk = 0; blk < nblk; blk++) {
        rx_fzero(S.part + blk * TM_NVEC * C, TM_NVEC * C);
        for (size_t bt = blk * rows; bt < BT && bt < (blk + 1) * rows; bt++)
            for (size_t h = 0; h < H; h++)
                gate_bonus_back(P, A, &S, S.part + blk * TM_NVEC * C, bt, h);
    }

    rc = rx_rownorm_backward(A->y, P->ln_x_w, S.dz, S.dyw, G->ln_x_w, G->ln_x_b, BT * H, N, H,
                             (float)ctx->gn_eps);
    if (rc == RX_OK)
        rc = rx_wkv7_backward_cp(A->r, A->w, A->kmod, A->vmod, A->aw, A->bw, S.dyw, NULL,
                                 A->wkv_cp, A->wkv_work, S.dr, S.dw, S.dk, S.dv, S.da, S.db,
                                 d_state, (int)B, (int)T, (int)H, (int)N);
    if (rc != RX_OK) {
        free(own);
        return rc;
    }
    float *sums[TM_NVEC];
    sums[TV_KA] = G->k_a, sums[TV_A0] = G->a0, sums[TV_W0] = G->w0, sums[TV_KK] = G->k_k;
    sums[TV_V0] = vres ? G->v0 : NULL, sums[TV_RK] = G->r_k;
#pragma omp parallel if (par)
    {
#pragma omp for schedule(static)
        for (size_t blk = 0; blk < nblk; blk++)
            for (size_t bt = blk * rows; bt < BT && bt < (blk + 1) * rows; bt++)
                for (size_t h = 0; h < H; h++)
                    wkv_inputs_back(P, A, &S, S.part + blk * TM_NVEC * C,
                                    vres ? v_first + bt * C + h * N : NULL,
                                    !vres && d_v_first ? d_v_first + bt * C + h * N : NULL,
                                    vres && d_v_first ? d_v_first + bt * C + h * N : NULL, bt,
                                    h);
        rx_block_sums(S.part, nblk, TM_NVEC * C, C, TM_NVEC, sums, 0);
    }
    /* the lean set's lerps, over buffers nothing below reads */
    if (A->lean) tm_lerps(P, A, x, x_prev_init);

    /* projections and LoRAs back to their token-shift lerps: r, k, v and the
     * LoRA down-projections in one batch, their lerp grads into buffers
     * nothing in it reads; the v-residual LoRA then adds into dxv */
    float *dxr = S.dyw, *dxk = S.db, *dxv = S.dxv, *dxw = S.dv, *dxa = S.dw, *dxg = S.da;
    const rx_gemm_op rkv[6] = {
        {1, 0, C, C, BT, A->xr, C, S.dr, C, 0.0f, G->receptance_w, C},
        {0, 1, BT, C, C, S.dr, C, P->receptance_w, C, 0.0f, dxr, C},
        {1, 0, C, C, BT, A->xk, C, S.dk, C, 0.0f, G->key_w, C},
        {0, 1, BT, C, C, S.dk, C, P->key_w, C, 0.0f, dxk, C},
        {1, 0, C, C, BT, A->xv, C, S.dv, C, 0.0f, G->value_w, C},
        {0, 1, BT, C, C, S.dv, C, P->value_w, C, 0.0f, dxv, C}};
    lora L[4];
    tm_loras(P, A, &S, L);
    L[0].G1 = G->w1, L[0].G2 = G->w2, L[0].dxin = dxw;
    L[1].G1 = G->a1, L[1].G2 = G->a2, L[1].dxin = dxa;
    L[2].G1 = G->g1, L[2].G2 = G->g2, L[2].dxin = dxg;
    L[3].G1 = G->v1, L[3].G2 = G->v2, L[3].dxin = dxv, L[3].beta = 1.0f;
    const float *dlo[4] = {S.dw, S.da, S.dg, S.dz};
    rc = lora_backward(L, dlo, vres ? 4 : 3, rkv, 6, BT, C);
    if (rc == RX_OK) {
        const float *mix[6] = {P->x_r, P->x_k, P->x_v, P->x_w, P->x_a, P->x_g};
        const float *dxin[6] = {dxr, dxk, dxv, dxw, dxa, dxg};
        float *dmix[6] = {G->x_r, G->x_k, G->x_v, G->x_w, G->x_a, G->x_g};
        rx_shift_lerp_backward(6, mix, x, x_prev_init, dxin, dx, dmix, d_xprev_init, B, T, C,
                               S.part);
    }
    free(own);
    return rc;
}

int rx_tm_backward_acts(const rx_model_ctx *ctx,
                        const rx_tm_params *P, const rx_tm_acts *A, const float *x,
                        const float *x_prev_init, const float *v_first, const float *dy,
                        rx_tm_grads *G, float *dx, float *d_xprev_init, float *d_v_first,
                        float *work) {
    return rx_tm_backward_state(ctx, P, A, x, x_prev_init, v_first, dy, G, dx, d_xprev_init,
                                d_v_first, NULL, work);
}

/* rx_spans_check of a sequence entry point: P (and G) with x [B][T][c],
 * x_prev_init [B][c] and, in the backward (dy not NULL), dy; y is out in
 * the forward, dx in the backward, with d_xprev_init [B][c]. v_first is
 * read at a later layer and written by the forward at layer 0; d_v_first
 * is the backward's output at a later layer and its input at layer 0. */
static int tm_spans_check(const char *fn, const rx_tm_params *P, const rx_tm_grads *G, int B,
                          int T, const float *x, const float *x_prev_init, const float *v_first,
                          const float *dy, const float *y, const float *d_xprev_init,
                          const float *d_v_first) {
    const size_t BTC = (size_t)B * T * P->c, BC = (size_t)B * P->c;
    const int later = P->layer_id > 0;
    rx_spans in = {.n = 0}, out = {.n = 0};
    rx_tm_spans(P, G, "P->", "G->", &in, &out);
    RX_SPAN_ADD(&in, "x", x, BTC);
    RX_SPAN_ADD(&in, "x_prev_init", x_prev_init, BC);
    if (later || !dy) RX_SPAN_ADD(later ? &in : &out, "v_first", v_first, BTC);
    RX_SPAN_ADD(&in, "dy", dy, BTC);
    RX_SPAN_ADD(later ? &out : &in, "d_v_first", d_v_first, BTC);
    RX_SPAN_ADD(&out, dy ? "dx" : "out", y, BTC);
    RX_SPAN_ADD(&out, "d_xprev_init", d_xprev_init, BC);
    return rx_spans_check(fn, &out, &in);
}

/* x, out: [B][T][C]; x_prev_init: [B][C] or NULL; v_first: [B][T][C] */
int rx_timemix_forward_seq(const rx_tm_params *P, const float *x, const float *x_prev_init,
                           float *v_first, float *out, int B, int T) {
    static const char *const fn = "rx_timemix_forward_seq";
    const char *nul = rx_first_null(RX_NULLS(P, x, out), RX_NAMES("P", "x", "out"), 3);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (!rx_tm_params_ok(P))
        return tm_params_fail(fn, P);
    int rc = rx_seq_check(fn, B, T, P->layer_id, v_first);
    if (rc != RX_OK) return rc;
    const int later = P->layer_id > 0;   /* v_first an input, else an output */
    rc = tm_spans_check(fn, P, NULL, B, T, x, x_prev_init, v_first, NULL, out, NULL, NULL);
    if (rc != RX_OK) return rc;
    rx_tm_acts A;
    rc = rx_tm_acts_alloc(&A, P, (size_t)B, (size_t)T);
    if (rc == RX_OK)
        rc = rx_tm_forward_acts(&rx_ctx_default, P, x, x_prev_init, later ? v_first : NULL,
                                later ? NULL : v_first, &A, out);
    rx_tm_acts_free(&A);
    return rc;
}

/* x, dy, dx, v_first, d_v_first: [B][T][C]; x_prev_init, d_xprev_init: [B][C] */
int rx_timemix_backward(const rx_tm_params *P, const float *x, const float *x_prev_init,
                        const float *v_first, const float *dy, rx_tm_grads *G, float *dx,
                        float *d_xprev_init, float *d_v_first, int B, int T) {
    static const char *const fn = "rx_timemix_backward";
    const char *nul = rx_first_null(RX_NULLS(P, x, dy, G, dx), RX_NAMES("P", "x", "dy", "G", "dx"),
                                    5);
    if (nul) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, nul);
    if (!rx_tm_params_ok(P))
        return tm_params_fail(fn, P);
    if (!rx_tm_grads_ok(P, G))
        return rx_fail(RX_EINVAL, "%s: G has a NULL grad (v0, v1, v2 too at layer %d > 0)", fn,
                       P->layer_id);
    int rc = rx_seq_check(fn, B, T, P->layer_id, v_first);
    if (rc != RX_OK) return rc;
    const int later = P->layer_id > 0;
    rc = tm_spans_check(fn, P, G, B, T, x, x_prev_init, v_first, dy, dx, d_xprev_init,
                        d_v_first);
    if (rc != RX_OK) return rc;
    rx_tm_acts A;
    rc = rx_tm_acts_alloc(&A, P, (size_t)B, (size_t)T);
    if (rc == RX_OK)
        rc = rx_tm_forward_acts(&rx_ctx_default,
                                P, x, x_prev_init, later ? v_first : NULL, NULL, &A, NULL);
    if (rc == RX_OK)
        rc = rx_tm_backward_acts(&rx_ctx_default,
                                 P, &A, x, x_prev_init, v_first, dy, G, dx, d_xprev_init,
                                 d_v_first, NULL);
    rx_tm_acts_free(&A);
    return rc;
}
