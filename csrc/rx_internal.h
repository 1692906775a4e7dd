/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * rx_internal.h -- helpers shared by the C core; not part of the public API.
 */
#ifndef RWKVX_INTERNAL_H
#define RWKVX_INTERNAL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "rx_pretrain.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Hot per-row kernels are compiled for baseline x86-64 and for x86-64-v3
 * (AVX2+FMA); the loader picks one at run time, so a default build runs on
 * any x86-64 and still uses wide vectors where the CPU has them. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(RX_NO_CLONES)
#define RX_HOT __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define RX_HOT
#endif

static inline int rx_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static inline int rx_thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int rx_in_parallel(void) {
#ifdef _OPENMP
    return omp_in_parallel();
#else
    return 1;
#endif
}

/* Array allocation with the n*size product checked for overflow. Returns
 * NULL on overflow or failure; n == 0 allocates one element so callers can
 * treat NULL as failure only. 64-byte aligned for vector loads. */
static inline void *rx_alloc(size_t n, size_t size) {
    if (n == 0) n = 1;
    if (size != 0 && n > SIZE_MAX / size) return NULL;
    size_t bytes = n * size;
    bytes = (bytes + 63) & ~(size_t)63;
    return aligned_alloc(64, bytes);
}

static inline float *rx_falloc(size_t n) { return (float *)rx_alloc(n, sizeof(float)); }

static inline float *rx_fcalloc(size_t n) {
    float *p = rx_falloc(n);
    if (p) for (size_t i = 0; i < n; i++) p[i] = 0.0f;
    return p;
}

static inline void rx_fzero(float *p, size_t n) {
    if (p) for (size_t i = 0; i < n; i++) p[i] = 0.0f;
}

/* Marks an output of a void API function that got invalid arguments. */
static inline void rx_fnan(float *p, size_t n) {
    if (p) for (size_t i = 0; i < n; i++) p[i] = NAN;
}

static inline float rx_sigmoidf(float x) { return 1.0f / (1.0f + expf(x < -88.0f ? 88.0f : -x)); }

/* The row a token shift reads at (b, t) of x [B][T][C]: x[b][t-1], at t = 0
 * the carry row init[b] (NULL init: zero, returned as NULL). */
static inline const float *rx_shift_src(const float *x, const float *init,
                                        size_t b, size_t t, size_t T, size_t C) {
    if (t > 0) return x + (b * T + t - 1) * C;
    return init ? init + b * C : NULL;
}

/* ---- runtime.c: per-kernel self time (rx_profile_*) ---------------------
 * A kernel brackets its work with rx_prof_push(slot) / rx_prof_pop(); time
 * outside every bracket is RX_PROF_OTHER. No-ops unless profiling is on. */
enum { RX_PROF_OTHER, RX_PROF_GEMM, RX_PROF_WKV7, RX_PROF_ATTN, RX_PROF_NORM, RX_PROF_CE,
       RX_PROF_N };
void rx_prof_push(int slot);
void rx_prof_pop(void);

/* ---- gemm.c ------------------------------------------------------------
 * C[M,N] = beta*C + op(A)[M,K] . op(B)[K,N], all row-major. op(A) is A
 * ([M,K], row stride lda) or, with ta, A^T for A stored [K,M]; likewise B.
 * beta is 0 (overwrite) or 1 (accumulate). Threads itself with OpenMP when
 * called outside a parallel region; inside one it runs on the calling
 * thread. Every projection and its backward goes through here. */
void rx_sgemm(int ta, int tb, size_t M, size_t N, size_t K,
              const float *A, size_t lda, const float *B, size_t ldb,
              float beta, float *C, size_t ldc);
/* Test hook: force the named micro-kernel ("generic", "avx2-fma") for every
 * later call, NULL to pick by CPU again. RX_EINVAL when the name is unknown
 * or the CPU cannot run it. Not thread-safe against concurrent GEMMs. */
int rx_sgemm_use_kernel(const char *name);

/* ---- layernorm.c -------------------------------------------------------
 * Row normalisation shared by LayerNorm (period 1) and the time-mix group
 * norm (period H): rows of length D; row r uses affine w/b at offset
 * (r % period)*D. mean/rstd (may be NULL) receive the per-row statistics. */
void rx_rownorm_forward(const float *x, const float *w, const float *b,
                        float *out, float *mean, float *rstd,
                        size_t rows, size_t D, size_t period, float eps);
/* dx written (may alias dy); dw/db [period*D] accumulated (+=), not zeroed.
 * Returns RX_OK or RX_ENOMEM (per-thread partial sums are allocated). */
int rx_rownorm_backward(const float *x, const float *w, const float *dy,
                        float *dx, float *dw, float *db,
                        size_t rows, size_t D, size_t period, float eps);

/* ---- tokenshift.c ------------------------------------------------------
 * out [B][T][C] = x + (x_prev - x) * mix, x_prev the token-shifted x with
 * the carry init [B][C] (NULL: zero) at t = 0. */
void rx_shift_lerp_forward(const float *mix, const float *x, const float *init, float *out,
                           size_t B, size_t T, size_t C);
/* Its backward for the grad dout on out: accumulates (+=) into dx
 * [B][T][C], dmix [C] and d_init [B][C] (NULL: not wanted). */
void rx_shift_lerp_backward(const float *mix, const float *x, const float *init,
                            const float *dout, float *dx, float *dmix, float *d_init,
                            size_t B, size_t T, size_t C);

/* ---- channelmix.c ------------------------------------------------------ */
int rx_cm_params_ok(const rx_cm_params *P);
/* Forward keeping xk [BT][C], pre (NULL: not kept) and h [BT][F] for the
 * backward; out may be NULL. The backward's scratch dh [BT][F] and dxk
 * [BT][C] may alias h and xk, consuming them. */
void rx_cm_forward_acts(const rx_cm_params *P, const float *x, const float *x_prev_init,
                        float *xk, float *pre, float *h, float *out, size_t B, size_t T);
void rx_cm_backward_acts(const rx_cm_params *P, const float *x, const float *x_prev_init,
                         const float *xk, const float *pre, const float *h, const float *dy,
                         rx_cm_grads *G, float *dx, float *d_xprev_init, size_t B, size_t T,
                         float *dh, float *dxk);

/* ---- timemix.c ---------------------------------------------------------
 * The time-mix forward intermediates, computed once by rx_tm_forward_acts
 * and consumed by rx_tm_backward_acts; the block keeps them alive across
 * the channel-mix backward so its backward runs the time-mix forward once.
 * Rows are the B*T tokens; every [BT][C] buffer is 64-byte aligned. */
typedef struct {
    size_t B, T;
    float *xr, *xw, *xk, *xv, *xa, *xg; /* [BT][C] token-shift lerps */
    float *r, *k, *v;                   /* [BT][C] projections, k and v unmodified */
    float *kmod, *vmod;                 /* [BT][C] k, v entering WKV7 (vmod == v at layer 0) */
    float *w, *wsig;                    /* [BT][C] decay, sigmoid inside it */
    float *a, *g, *vg;                  /* [BT][C] gates (vg NULL at layer 0) */
    float *aw, *bw;                     /* [BT][C] WKV7 a = -kk and b = kk*a */
    float *y, *z, *zg;                  /* [BT][C] WKV7 out, group norm + bonus, z*g */
    float *tw, *ta, *tg, *tv;           /* [BT][D*] LoRA hiddens after activation */
    float *bonus;                       /* [BT][H] sum over the head of r*kmod*r_k */
    float *mem;
} rx_tm_acts;

/* Every size and pointer of P valid (v0/v1/v2 and Dv only at layer > 0). */
int rx_tm_params_ok(const rx_tm_params *P);
int rx_tm_grads_ok(const rx_tm_params *P, const rx_tm_grads *G);
/* RX_OK or RX_ENOMEM; rx_tm_acts_free(A) is safe after either. */
int rx_tm_acts_alloc(rx_tm_acts *A, const rx_tm_params *P, size_t B, size_t T);
void rx_tm_acts_free(rx_tm_acts *A);
/* x: [B][T][C]. Layer 0 writes v (v_first_out may be NULL); layer > 0
 * reads v_first_in. out [B][T][C] may be NULL (backward recompute). */
int rx_tm_forward_acts(const rx_tm_params *P, const float *x, const float *x_prev_init,
                       const float *v_first_in, float *v_first_out, rx_tm_acts *A,
                       float *out);
/* rx_tm_forward_acts continuing from the WKV state [B][H][N][N] in state,
 * which it advances in place (NULL: zero initial state, nothing kept); the
 * recurrent-inference form (infer.c). */
int rx_tm_forward_state(const rx_tm_params *P, const float *x, const float *x_prev_init,
                        const float *v_first_in, float *v_first_out, float *state,
                        rx_tm_acts *A, float *out);
/* A filled by rx_tm_forward_acts on the same inputs; arguments as in
 * rx_timemix_backward. */
int rx_tm_backward_acts(const rx_tm_params *P, const rx_tm_acts *A, const float *x,
                        const float *x_prev_init, const float *v_first, const float *dy,
                        rx_tm_grads *G, float *dx, float *d_xprev_init, float *d_v_first);

/* ---- block.c -----------------------------------------------------------
 * An RWKV block's forward intermediates, kept by rx_block_forward_acts so
 * the backward need not run the forward again (it only reads them, so it
 * can run more than once per forward). */
typedef struct {
    rx_tm_acts tm;
    float *h1, *x1, *h2, *xk;   /* [BT][C] ln1 out, residual after TM, ln2 out, CM lerp */
    float *pre, *hid;           /* [BT][F] CM key projection and relu^2 hidden */
    float *mem;
} rx_block_acts;

/* RX_OK or RX_ENOMEM; rx_block_acts_free(S) is safe after either. */
int rx_block_acts_alloc(rx_block_acts *S, const rx_block_params *P, size_t B, size_t T);
void rx_block_acts_free(rx_block_acts *S);
/* rx_block_forward_seq's arguments (validated by the caller), filling S;
 * v_first as in rx_tm_forward_acts (read at layer > 0, written at 0). */
int rx_block_forward_acts(const rx_block_params *P, const float *x,
                          const float *tm_xprev_init, const float *cm_xprev_init,
                          const float *v_first_in, float *v_first_out, rx_block_acts *S,
                          float *out);
/* rx_block_backward's arguments (validated by the caller) with S from
 * rx_block_forward_acts on the same inputs; work: RX_BLOCK_WORK floats. */
#define RX_BLOCK_WORK(BT, C, F) (3 * (BT) * (C) + (BT) * (F))
int rx_block_backward_acts(const rx_block_params *P, const rx_block_acts *S, const float *x,
                           const float *tm_xprev_init, const float *cm_xprev_init,
                           const float *v_first, const float *dy, rx_block_grads *G,
                           float *dx, float *d_tm_xprev_init, float *d_cm_xprev_init,
                           float *d_v_first, float *work);

/* ---- attn.c ------------------------------------------------------------
 * An attention block's forward intermediates and its core's scratch, all
 * allocated once by rx_attn_acts_new for B, T (NULL: bad sizes or no
 * memory), kept by rx_attn_forward_acts so the backward need not run the
 * forward again: rx_attn_backward_acts only reads them (it may run more
 * than once per forward). Arguments as in rx_attn_forward_seq /
 * rx_attn_backward_full; out may be NULL; work: RX_ATTN_WORK floats. */
typedef struct rx_attn_acts rx_attn_acts;
rx_attn_acts *rx_attn_acts_new(const rx_attn_params *P, size_t B, size_t T);
void rx_attn_acts_free(rx_attn_acts *S);
int rx_attn_forward_acts(const rx_attn_params *P, const float *x, const float *cm_xprev_init,
                         rx_attn_acts *S, float *out);
#define RX_ATTN_WORK(BT, C, F) (5 * (BT) * (C) + (BT) * (F))
int rx_attn_backward_acts(const rx_attn_params *P, rx_attn_acts *S, const float *x,
                          const float *cm_xprev_init, const float *dy, rx_attn_grads *G,
                          float *dx, float *d_cm_xprev_init, float *work);
/* Decoding: queries q [T][C] at positions pos..pos+T-1 of one sequence
 * against its keys and values k, v [pos+T][C]; y [T][C]. The forward's
 * selection and softmax kernels, one query at a time (infer.c). */
int rx_attn_decode(const rx_attn_params *P, const float *q, const float *k, const float *v,
                   int pos, int T, float *y);

#define RX_LN_EPS 1e-5f
#define RX_GN_EPS 64e-5f

#endif /* RWKVX_INTERNAL_H */
