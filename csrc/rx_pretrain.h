/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * rx_pretrain.h -- public C API of rwkvx_c, a CPU pretraining engine for
 * RWKV-X language models (RWKV-7 blocks interleaved with MoBA-sparse causal
 * attention blocks).
 *
 * The numerical contract (maths, layouts, parameter order, init) is docs/;
 * this header carries the same functions, structs and layouts as the original
 * rx_pretrain.h API. The WKV7 backward-through-time follows the recurrence
 * of BlinkDL's RWKV-LM wkv7 CUDA kernel (Apache-2.0); see NOTICE.
 *
 * Conventions shared by every function below
 *   - Dimension names: B batch, T time, C = n_head*head_size channels,
 *     H heads, N head size.
 *   - Per-token tensors are [B][T][C] row-major, which is the same memory as
 *     [B][T][H][N]. WKV7 state is [B][H][N][N]: row i is the value/output
 *     dimension, column j the key dimension.
 *   - Matrices are row-major [in,out]: y[o] = sum_i x[i] * W[i*out + o].
 *   - Output gradient buffers are written (=); parameter-gradient buffers are
 *     zeroed by the function and then accumulated over all B*T tokens.
 *   - Optional pointers may be NULL: a NULL carry or initial state means zero,
 *     a NULL output means "not wanted".
 *   - Outputs must not overlap inputs or each other unless the function
 *     says so: threads read the inputs while others already write. Every
 *     function checks this before it writes anything and refuses with
 *     RX_EINVAL naming both buffers ("rx_layernorm_backward: the output dx
 *     overlaps the input x"; the GEMMs: "... overlaps the input A of GEMM
 *     0"); a block's P and G tensors are checked too. The in-place calls
 *     allowed are exact ones: LayerNorm's out = x and dx = dy, WKV7's
 *     s_final = s_init.
 *   - Errors: every function that can fail returns an int code, results
 *     through pointers: RX_OK (0), RX_ENOMEM (-1) allocation failure,
 *     RX_EINVAL (-2) invalid argument (size < 1, NULL where required, token
 *     or target out of range, acts of another shape), RX_ECONFIG (-3) an
 *     invalid model config. rx_last_error() then describes the failure,
 *     naming the function and the bad argument. Nothing falls back silently:
 *     an allocation that fails anywhere, scratch included, is RX_ENOMEM.
 *     The original API's functions that return a pointer, a loss or void
 *     (NULL, NaN, NaN-filled outputs on failure) are kept, all together in
 *     the legacy section at the end of this header, each marked deprecated
 *     with the name of the int-returning form that replaces it.
 *   - Sizes are int at the API; every offset inside is size_t / int64_t.
 */
#ifndef RWKVX_PRETRAIN_H
#define RWKVX_PRETRAIN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define RX_OK 0
#define RX_ENOMEM (-1)
#define RX_EINVAL (-2)
#define RX_ECONFIG (-3)

/* The message of the last failure of an rx_ call on the calling thread
 * ("rx_pretrain_forward_batch: token 300 at position 5 is outside
 * [0, 256)"); "" before any. Valid until the thread's next failing call. */
const char *rx_last_error(void);
/* A static name for a code ("out of memory"), "unknown error code" else. */
const char *rx_strerror(int code);

/* ====================================================================
 * WKV7 recurrence, per (b, h), state S starting at s_init (or zero):
 *     sa[i]   = sum_j a_t[j] * S[i][j]
 *     S[i][j] = S[i][j]*w_t[j] + v_t[i]*k_t[j] + sa[i]*b_t[j]
 *     y_t[i]  = sum_j S[i][j] * r_t[j]
 * ==================================================================== */

/* r,w,k,v,a,b: [B][T][H][N]. s_init, s_final: [B][H][N][N] (NULL: zero / not
 * wanted); s_final may be s_init itself (the state advanced in place).
 * y_out: [B][T][H][N] or NULL. */
int rx_wkv7_forward_seq(
    const float *r, const float *w, const float *k, const float *v,
    const float *a, const float *b, const float *s_init,
    float *y_out, float *s_final,
    int B, int T, int n_head, int head_size);

/* Backward through time. dy: [B][T][H][N]. Writes dr..db [B][T][H][N] (dw is
 * the grad w.r.t. the effective decay w itself; chaining it through the decay
 * parameterisation is the time-mix's job) and, if dS_out is not NULL, the
 * grad w.r.t. the initial state [B][H][N][N]. The forward is recomputed
 * internally from state checkpoints, so memory stays O(B*H*N*N*T/16). */
int rx_wkv7_backward(
    const float *r, const float *w, const float *k, const float *v,
    const float *a, const float *b, const float *dy, const float *s_init,
    float *dr, float *dw, float *dk, float *dv, float *da, float *db,
    float *dS_out,
    int B, int T, int n_head, int head_size);

/* ====================================================================
 * RWKV-7 time-mix: token shift and lerps, R/K/V/O projections, the w/a/g/v
 * LoRA gates, key normalisation and modification, the value residual through
 * v_first, WKV7, per-head group norm, the r*k*r_k bonus and the g gate.
 * Input is the ln1 output; the result feeds the residual (docs/maths.md §Time-mix).
 * ==================================================================== */
typedef struct {
    int c;                  /* n_head*head_size */
    int n_head, head_size;
    int Dw, Da, Dg, Dv;     /* LoRA inner sizes (Dv unused at layer 0) */
    int layer_id;           /* 0 writes v_first, > 0 reads it */
    const float *x_r, *x_k, *x_v, *x_w, *x_a, *x_g;        /* [c] lerps */
    const float *receptance_w, *key_w, *value_w, *output_w; /* [c,c] */
    const float *w0, *w1, *w2;   /* [c], [c,Dw], [Dw,c] */
    const float *a0, *a1, *a2;   /* [c], [c,Da], [Da,c] */
    const float *g1, *g2;        /* [c,Dg], [Dg,c] */
    const float *v0, *v1, *v2;   /* [c], [c,Dv], [Dv,c]; layer_id > 0 only */
    const float *k_k, *k_a;      /* [c] */
    const float *r_k;            /* [c] */
    const float *ln_x_w, *ln_x_b;/* [c] group-norm affine */
} rx_tm_params;

/* Gradients, same shapes as rx_tm_params. Zeroed by rx_timemix_backward; the
 * v0/v1/v2 pointers may be NULL at layer 0. */
typedef struct {
    float *x_r, *x_k, *x_v, *x_w, *x_a, *x_g;
    float *receptance_w, *key_w, *value_w, *output_w;
    float *w0, *w1, *w2;
    float *a0, *a1, *a2;
    float *g1, *g2;
    float *v0, *v1, *v2;
    float *k_k, *k_a;
    float *r_k;
    float *ln_x_w, *ln_x_b;
} rx_tm_grads;

/* x: [B][T][c]; x_prev_init: [B][c] token-shift carry or NULL;
 * v_first: [B][T][c], written at layer 0, read at layer > 0; out: [B][T][c]. */
int rx_timemix_forward_seq(
    const rx_tm_params *P, const float *x, const float *x_prev_init,
    float *v_first, float *out, int B, int T);

/* dy: [B][T][c]. Writes dx [B][T][c], every grad in G, and optionally
 * d_xprev_init [B][c]. d_v_first [B][T][c]: at layer > 0 an output (grad
 * w.r.t. the v_first input); at layer 0 an optional input carrying the
 * downstream grad on the v_first this layer produced. */
int rx_timemix_backward(
    const rx_tm_params *P, const float *x, const float *x_prev_init,
    const float *v_first, const float *dy,
    rx_tm_grads *G, float *dx, float *d_xprev_init, float *d_v_first,
    int B, int T);

/* ====================================================================
 * RWKV-7 channel-mix: out = relu(xk . ffn_key_w)^2 . ffn_value_w with
 * xk = x + (x_prev - x)*ffn_x_k (docs/maths.md §Channel-mix). Input is the ln2 output.
 * ==================================================================== */
typedef struct {
    int c;
    int ffn_dim;
    const float *ffn_x_k;      /* [c] */
    const float *ffn_key_w;    /* [c,ffn_dim] */
    const float *ffn_value_w;  /* [ffn_dim,c] */
} rx_cm_params;

typedef struct {
    float *ffn_x_k;
    float *ffn_key_w;
    float *ffn_value_w;
} rx_cm_grads;

/* x, out: [B][T][c]; x_prev_init: [B][c] or NULL. */
int rx_channelmix_forward_seq(
    const rx_cm_params *P, const float *x, const float *x_prev_init,
    float *out, int B, int T);

/* dy: [B][T][c]. Writes dx, the grads in G (zeroed here) and optionally
 * d_xprev_init [B][c]. */
int rx_channelmix_backward(
    const rx_cm_params *P, const float *x, const float *x_prev_init,
    const float *dy, rx_cm_grads *G, float *dx, float *d_xprev_init,
    int B, int T);

/* ====================================================================
 * The model's numeric settings, named once: the defaults of rx_model_ctx
 * (below), which every kernel of a model reads, in training and in
 * inference. RX_DEFAULT_LN_EPS: every LayerNorm of the model (ln0, ln1,
 * ln2, ln_out); RX_DEFAULT_GN_EPS: the time-mix group norm (ln_x),
 * official RWKV-7's head_size * 1e-5 at head size 64; RX_DEFAULT_LN0: no
 * embedding LayerNorm (a model made before it existed); RX_DEFAULT_L2WRAP:
 * no L2Wrap.
 * ==================================================================== */
#define RX_DEFAULT_LN_EPS 1e-5
#define RX_DEFAULT_GN_EPS 64e-5
#define RX_DEFAULT_LN0 0
#define RX_DEFAULT_L2WRAP 0.0
/* The floor of the time-mix key normalisation: each head's kk is divided by
 * max(||kk||, RX_KK_FLOOR) (docs/maths.md §Time-mix), in training and in
 * inference. A constant of the maths, not a setting. */
#define RX_KK_FLOOR 1e-12f

/* ====================================================================
 * LayerNorm over the C channels, eps RX_LN_EPS, biased variance; mean and
 * variance accumulate in double (docs/maths.md §LayerNorm). A model's
 * LayerNorms (ln0, ln1, ln2, ln_out) use its context's ln_eps, whose
 * default this is.
 * ==================================================================== */
#define RX_LN_EPS ((float)RX_DEFAULT_LN_EPS)

/* x, out: [B][T][C]; w, b: [C]. out may be x itself (in place). */
int rx_layernorm_forward_seq(
    const float *x, const float *w, const float *b, float *out,
    int B, int T, int C);

/* dy, dx: [B][T][C]; dw, db: [C], zeroed then accumulated. dx may be dy
 * itself (in place). */
int rx_layernorm_backward(
    const float *x, const float *w, const float *b, const float *dy,
    float *dx, float *dw, float *db, int B, int T, int C);

/* ====================================================================
 * RWKV-7 residual block (docs/maths.md §Blocks):
 *     h1 = ln1(x); x1 = x + TM(h1); h2 = ln2(x1); out = x1 + CM(h2)
 * ==================================================================== */
typedef struct {
    rx_tm_params tm;
    rx_cm_params cm;
    const float *ln1_w, *ln1_b;   /* [c] */
    const float *ln2_w, *ln2_b;   /* [c] */
} rx_block_params;

typedef struct {
    rx_tm_grads tm;
    rx_cm_grads cm;
    float *ln1_w, *ln1_b, *ln2_w, *ln2_b;
} rx_block_grads;

/* x, out: [B][T][c]; tm_xprev_init / cm_xprev_init: [B][c] carries over h1
 * and h2, or NULL; v_first as in rx_timemix_forward_seq. */
int rx_block_forward_seq(
    const rx_block_params *P, const float *x,
    const float *tm_xprev_init, const float *cm_xprev_init,
    float *v_first, float *out, int B, int T);

/* dy: [B][T][c]. Writes dx, every grad in G, the optional carry grads [B][c]
 * and d_v_first with the same two roles as in rx_timemix_backward. */
int rx_block_backward(
    const rx_block_params *P, const float *x,
    const float *tm_xprev_init, const float *cm_xprev_init,
    const float *v_first, const float *dy,
    rx_block_grads *G, float *dx,
    float *d_tm_xprev_init, float *d_cm_xprev_init, float *d_v_first,
    int B, int T);

/* ====================================================================
 * MoBA-sparse attention block (docs/maths.md §Blocks):
 *     h1 = ln1(x); q,k,v = h1 . {receptance_w, key_w, value_w}
 *     y = sparse causal softmax attention, scale 1/sqrt(head_size)
 *     x1 = x + y . output_w; h2 = ln2(x1); out = x1 + CM(h2)
 * Each query attends its own chunk causally plus the moba_top_k earlier
 * chunks whose mean key scores highest against it (ties: smaller chunk
 * index). moba_top_k <= 0 or >= the number of earlier chunks keeps all.
 * The selection is hard: the backward holds it fixed.
 * ==================================================================== */
typedef struct {
    int c;                        /* n_head*head_size */
    int n_head, head_size;
    int chunk_size;               /* >= 1 */
    int moba_top_k;               /* earlier chunks kept; <= 0 keeps all */
    const float *ln1_w, *ln1_b;   /* [c] */
    const float *receptance_w;    /* [c,c] query projection */
    const float *key_w;           /* [c,c] */
    const float *value_w;         /* [c,c] */
    const float *output_w;        /* [c,c] */
    const float *ln2_w, *ln2_b;   /* [c] */
    rx_cm_params cm;
} rx_attn_params;

typedef struct {
    float *ln1_w, *ln1_b;
    float *receptance_w, *key_w, *value_w, *output_w;
    float *ln2_w, *ln2_b;
    rx_cm_grads cm;
} rx_attn_grads;

/* x, out: [B][T][c]; cm_xprev_init: [B][c] or NULL. */
int rx_attn_forward_seq(
    const rx_attn_params *P, const float *x, const float *cm_xprev_init,
    float *out, int B, int T);

/* dy: [B][T][c]. Writes dx, every grad in G (zeroed here) and optionally
 * d_cm_xprev_init [B][c]. The selection is recomputed and held fixed. */
int rx_attn_backward_full(
    const rx_attn_params *P, const float *x, const float *cm_xprev_init,
    const float *dy, rx_attn_grads *G, float *dx, float *d_cm_xprev_init,
    int B, int T);

/* Test hooks for the attention core alone. q, k, v, y, dy, dq, dk, dv:
 * [B][T][c]. p: [B][H][T][T] softmax weights, exactly zero on keys that are
 * not attended (this is the only place a T x T matrix is materialised).
 * Only c, n_head, head_size, chunk_size and moba_top_k of P are read. */
int rx_attn_score_av_forward(const rx_attn_params *P, const float *q, const float *k,
                             const float *v, int B, int T, float *p, float *y);
int rx_attn_score_av_backward(const rx_attn_params *P, const float *q, const float *k,
                              const float *v, const float *dy, int B, int T,
                              float *dq, float *dk, float *dv);

/* ====================================================================
 * Whole model, single sequence (docs/maths.md §Whole model):
 *     x0 = emb[token]; blocks in RWKV-X order; h = ln_out(x);
 *     logits = h . head; loss = mean cross-entropy over valid targets.
 * ==================================================================== */

/* emb: [vocab][C]; tokens: [T]; out: [T][C] = emb[tokens]. RX_EINVAL on
 * NULL, a size < 1 or a token outside [0, vocab) (out then unspecified). */
int rx_embedding_gather(const float *emb, const int *tokens, int T, int C, int vocab,
                        float *out);
/* tokens: [T]; d_out: [T][C]; d_emb: [vocab][C], zeroed then scatter-added.
 * RX_EINVAL on NULL, a size < 1 or a token outside [0, vocab). */
int rx_embedding_scatter(const int *tokens, int T, int C, int vocab,
                         const float *d_out, float *d_emb);

/* x: [T][C]; head: [C][vocab]; logits: [T][vocab] = x . head. RX_EINVAL on
 * NULL or a size < 1, RX_ENOMEM. */
int rx_head_logits(const float *x, const float *head, int T, int C, int vocab,
                   float *logits);
/* x: [T][C]; head: [C][vocab]; dlogits: [T][vocab]; dx: [T][C] written;
 * d_head: [C][vocab] zeroed then accumulated. RX_EINVAL on NULL or a size
 * < 1, RX_ENOMEM. */
int rx_head_grads(const float *x, const float *head, const float *dlogits,
                  int T, int C, int vocab, float *dx, float *d_head);

/* logits: [T][vocab]; targets: [T]. *loss = the mean over valid positions
 * of -log softmax(logits_t)[target_t], a position being valid when
 * ignore_index < 0 or target_t != ignore_index (no valid position: 0).
 * dlogits: [T][vocab] = (softmax - onehot) / n_valid, zero rows for ignored
 * positions, or NULL for the loss alone. RX_EINVAL on NULL, a size < 1 or a
 * valid target outside [0, vocab); RX_ENOMEM. Non-finite logits are no
 * error: the loss is NaN. */
int rx_cross_entropy(const float *logits, const int *targets, int T, int vocab,
                     int ignore_index, float *dlogits, double *loss);

typedef struct {
    int n_embd, n_head, head_size;   /* n_head*head_size == n_embd */
    int n_rwkv_layer, n_attn_layer;
    int vocab_size;
    int Dw, Da, Dg, Dv;              /* time-mix LoRA inner sizes */
    int ffn_dim;                     /* channel-mix hidden size */
    int chunk_size, moba_top_k;      /* MoBA attention */
} rx_pt_config;

typedef struct rx_ptmodel rx_ptmodel;   /* owns the parameter and grad arenas */

/* *out: a model with every parameter drawn by the docs/layout.md §Init
 * splitmix64 scheme (a gradient-check init, bit-identical everywhere) and
 * the options in flags (RX_PT_* bits below, 0 for none); NULL on failure.
 * RX_ECONFIG on a config rx_pt_config_validate rejects, RX_EINVAL on a NULL
 * out or an unknown flag bit, RX_ENOMEM. */
int rx_model_create(const rx_pt_config *pc, int flags, uint64_t seed, rx_ptmodel **out);
void rx_ptmodel_free(rx_ptmodel *m);

/* Number of parameter tensors. */
int rx_ptmodel_num_params(const rx_ptmodel *m);
/* Tensor i in docs/layout.md §Parameters order: its name, its data and grad (views into the
 * arenas) and its element count. RX_EINVAL if i is out of range. */
int rx_ptmodel_param(rx_ptmodel *m, int i, const char **name,
                     float **data, float **grad, int *n);
rx_pt_config rx_ptmodel_config(const rx_ptmodel *m);
/* Live views of the idx-th RWKV / attention block's parameters, or NULL. */
const rx_block_params* rx_ptmodel_rwkv(rx_ptmodel *m, int idx);
const rx_attn_params* rx_ptmodel_attn(rx_ptmodel *m, int idx);

/* Activations a forward leaves for the backward, for B sequences of T tokens
 * (rx_pt_acts_create). Every [T] below is [B][T] with sequence b at rows
 * b*T .. b*T+T-1. The fields after logits extend the original struct; acts
 * come only from rx_pt_acts_create (or its legacy forms), which sizes all
 * of it once, so neither forward nor backward allocates here. */
typedef struct {
    int T, C, vocab, n_blocks;
    int *tokens;      /* [T] */
    float *block_in;  /* [n_blocks+1][T][C]: residual entering each block, then the last */
    float *v_first;   /* [T][C] */
    float *lnout;     /* [T][C] ln_out output */
    float *logits;    /* [T][vocab] */
    int B;            /* sequences; T above is the length of each */
    int ready;        /* 1 after a successful forward into these acts */
    float *dlogits;   /* [T][vocab] backward scratch */
    float *work;      /* backward scratch (rx_pt_acts_create_groups): the
                         residual grads, the summed v_first grad, one block's */
    struct rx_pt_saved *saved;  /* internal: the RWKV blocks' forward
                                   intermediates, reused by the backward */
    int flags;        /* RX_ACTS_* bits of rx_pt_acts_create_opts (0: none) */
    int head_rows;    /* RX_ACTS_CHUNKED_HEAD: rows per head chunk */
    int group;        /* sequences per row group (rx_pt_acts_create_groups; B: one) */
} rx_pt_acts;

/* *out: acts for B sequences of T tokens of model m (NULL on failure).
 * RX_EINVAL on NULL, B or T < 1 or B*T past an int; RX_ENOMEM. */
int rx_pt_acts_create(const rx_ptmodel *m, int B, int T, rx_pt_acts **out);
void rx_pt_acts_free(rx_pt_acts *a);

/* tokens: [T], each in [0, vocab). acts must come from
 * rx_pt_acts_create(m, 1, T, ...) for this T. Fills acts, logits included. */
int rx_pretrain_forward(rx_ptmodel *m, const int *tokens, int T,
                        rx_pt_acts *acts);

/* targets: [B][T], each in [0, vocab) or equal to ignore_index (when >= 0).
 * Needs a forward (rx_pretrain_forward, _batch) into acts with the same B
 * and T. *loss: the mean loss over the batch's valid positions (NaN only
 * from non-finite logits). Writes the grad of that mean for every parameter
 * into the model's grad arena (the arena is overwritten, not accumulated).
 * Every block reuses the intermediates its forward kept in acts (so the
 * backward may run more than once per forward): change no parameter
 * between the two calls. RX_EINVAL on NULL, a target out of range or acts
 * holding no forward of this B and T; RX_ENOMEM. */
int rx_pretrain_backward_loss(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets,
                              int B, int T, int ignore_index, double *loss);

/* Cannot fail: a NULL model is a no-op. */
void rx_ptmodel_zero_grad(rx_ptmodel *m);

/* ====================================================================
 * Extensions beyond the original API
 * ==================================================================== */

/* ---- model.c, model_layout.c, runtime.c: batches, the model context,
 * validation and the arenas ------------------------------------------
 * A batch is B independent sequences of T tokens ([B][T] row-major); every
 * block kernel runs them together (OpenMP over B*H and over rows). The
 * single-sequence functions above are the B = 1 case. */

/* tokens: [B][T], each in [0, vocab); acts from rx_pt_acts_create(m, B, T,
 * ...). RX_EINVAL on a token out of range or acts of another shape or
 * model. The backward of a batch is rx_pretrain_backward_loss. */
int rx_pretrain_forward_batch(rx_ptmodel *m, const int *tokens, int B, int T,
                              rx_pt_acts *acts);

/* Options beside rx_pt_config (whose layout stays the original's), as bits
 * of one flags int. RX_PT_LN0: x0 = LayerNorm(emb[token]; ln0_w, ln0_b),
 * eps RX_LN_EPS, with ln0_w, ln0_b [C] right after emb in the arenas (docs/maths.md,
 * docs/layout.md), as official RWKV-7's blocks.0.ln0. */
#define RX_PT_LN0 1
/* RX_PT_NO_INIT: the arenas start zero, mapped lazily (a page never written
 * takes no memory), and no init runs: for a model whose weights come from
 * elsewhere, a frozen base's above all (rx_ptmodel_set_base). */
#define RX_PT_NO_INIT 2
/* RX_PT_DENSE, with RX_PT_NO_INIT: the caller writes every parameter (a
 * whole model read from a file, no frozen base), so the lazily mapped
 * parameter arena asks for transparent huge pages, which a decode step's
 * read of every weight streams faster (a model made with init always
 * does). Without it a lazy arena keeps 4 KiB pages: a frozen base's slots
 * are never written, and a huge page would take 2 MiB at a small
 * tensor's first write. */
#define RX_PT_DENSE 4
#define RX_PT_FLAGS_ALL (RX_PT_LN0 | RX_PT_NO_INIT | RX_PT_DENSE)
/* The flags the model was made with; -1 for NULL. */
int rx_ptmodel_flags(const rx_ptmodel *m);

/* The model context: the model's numeric settings beside rx_pt_config
 * (whose layout stays the original's), which the model hands to every
 * kernel it runs, training and inference alike (docs/maths.md). ln0 is
 * RX_PT_LN0 as a field; l2wrap is rx_ptmodel_set_l2wrap's factor. */
typedef struct {
    double ln_eps;    /* every LayerNorm: ln0, ln1, ln2, ln_out; finite, > 0 */
    double gn_eps;    /* the time-mix group norm ln_x; finite, > 0 */
    int ln0;          /* 1: x0 = LayerNorm(emb[token]; ln0_w, ln0_b); 0: none */
    double l2wrap;    /* L2Wrap factor of every backward; finite, >= 0 (0: off) */
} rx_model_ctx;
/* The defaults, field by field (rx_model_ctx_default's): a new field is added
 * here by name, never by position. */
#define RX_MODEL_CTX_DEFAULT {.ln_eps = RX_DEFAULT_LN_EPS, .gn_eps = RX_DEFAULT_GN_EPS, \
                              .ln0 = RX_DEFAULT_LN0, .l2wrap = RX_DEFAULT_L2WRAP}

/* *ctx = the defaults (RX_DEFAULT_*). */
void rx_model_ctx_default(rx_model_ctx *ctx);
/* RX_OK when every field of ctx is in its range, RX_EINVAL for a NULL ctx,
 * else RX_ECONFIG (rx_last_error names the field). */
int rx_model_ctx_validate(const rx_model_ctx *ctx);
/* rx_model_create with the settings of ctx (rx_model_create(pc, flags, ...)
 * is this with the defaults and ln0 = flags & RX_PT_LN0); flags: 0 or
 * RX_PT_NO_INIT (ln0 is the context's). RX_ECONFIG on a ctx
 * rx_model_ctx_validate rejects; otherwise as rx_model_create. */
int rx_model_create_ctx(const rx_pt_config *pc, const rx_model_ctx *ctx, int flags,
                        uint64_t seed, rx_ptmodel **out);
/* *out = the model's context; RX_EINVAL on NULL. */
int rx_ptmodel_ctx(const rx_ptmodel *m, rx_model_ctx *out);

/* ---- model.c, head.c: bounded memory for long contexts and large
 * vocabularies (docs/maths.md §Recompute, §Chunked head) ---------------
 * RX_ACTS_RECOMPUTE: the acts keep only each block's input (block_in); the
 * forward runs every block through one shared set of intermediates and the
 * backward runs each block's forward again, just before its backward, from
 * its kept input. The loss and every grad have the same bits as without.
 * lnout then shares the backward's scratch: after a backward it holds
 * other values until rx_pretrain_loss or the next backward makes it again.
 * RX_ACTS_CHUNKED_HEAD: no [B*T][vocab] buffer: logits is NULL, the forward
 * stops at lnout, and the backward (and rx_pretrain_loss) run the head and
 * the loss head_rows rows at a time through a [2][head_rows][vocab]
 * scratch (dlogits points at it); see rx_head_loss for what stays bitwise. */
#define RX_ACTS_RECOMPUTE 1
#define RX_ACTS_CHUNKED_HEAD 2
#define RX_ACTS_FLAGS_ALL 3
/* rx_pt_acts_create with the RX_ACTS_* options in flags; head_rows: rows
 * per head chunk (0: rx_head_chunk_rows(vocab, 0); ignored without
 * RX_ACTS_CHUNKED_HEAD). RX_EINVAL on an unknown flag or head_rows < 0. */
int rx_pt_acts_create_opts(const rx_ptmodel *m, int B, int T, int flags, int head_rows,
                           rx_pt_acts **out);
/* Row groups (docs/maths.md §Row groups): rx_pt_acts_create_opts whose
 * blocks run group sequences at a time (group divides B; B: the whole
 * batch at once), so one block's recomputed intermediates and backward
 * scratch, and all but one of the backward's residual-grad buffers, are
 * sized for group x T tokens instead of B x T. The forward runs each
 * block over every group before the next block, the backward each group
 * through every block, in row order; the forward, the loss and every grad
 * on rows are the same bits (each row's products do not depend on the
 * other rows). A backward over groups takes an adapter's weight grads group by
 * group, adding each group's k ranges in the order one product over every
 * row takes them: the same bits when group x T is a multiple of 256 (the
 * GEMMs' k range). Other grads (those summed over rows outside a GEMM)
 * would come group by group, so that backward is refused (RX_EINVAL)
 * unless rx_ptmodel_groups_exact. group < B needs RX_ACTS_RECOMPUTE and
 * a model without attention blocks (RX_EINVAL). */
int rx_pt_acts_create_groups(const rx_ptmodel *m, int B, int T, int flags, int head_rows,
                             int group, rx_pt_acts **out);
/* Floats of the part of recompute acts for B sequences of T tokens that
 * their row groups of group sequences size (one RWKV block's lean set and
 * backward scratch, and the residual grads but one [B*T][C]), for an
 * RWKV-only model; 0 on NULL, T < 1 or group outside [1, B]. */
size_t rx_pt_acts_group_floats(const rx_ptmodel *m, int B, int T, int group);
/* 1 when a backward over row groups gives m's grads: its LoRA adapters
 * (not DoRA) are on, every other parameter is frozen, it has no
 * trainable initial states and no attention blocks; else 0. */
int rx_ptmodel_groups_exact(const rx_ptmodel *m);
/* The mean loss of the forward held in acts against targets, as
 * rx_pretrain_backward_loss computes it, without any grad (evaluation).
 * Errors as rx_pretrain_backward_loss. */
int rx_pretrain_loss(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets, int B, int T,
                     int ignore_index, double *loss);
/* Per-position losses and weighted grads (docs/maths.md §Preference
 * tuning): the summed log-probabilities a preference objective reads, and
 * its grad entering through the same cross-entropy. targets, weight,
 * row_loss: [B][T]. rx_pretrain_row_losses writes row_loss[t] =
 * -log softmax(logits[t])[targets[t]] of the forward held in acts (0 at
 * an ignored position), no grad. rx_pretrain_backward_rows writes the same
 * row_loss and the grads of sum_t weight[t] * row_loss[t] (plus L2Wrap)
 * into the grad arena: the cross-entropy grad of row t scaled by weight[t]
 * instead of 1/n_valid. Errors as rx_pretrain_backward_loss, and RX_EINVAL
 * for a NULL weight or row_loss. */
int rx_pretrain_row_losses(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets, int B,
                           int T, int ignore_index, double *row_loss);
int rx_pretrain_backward_rows(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets, int B,
                              int T, int ignore_index, const double *weight, double *row_loss);
/* The same of the logits divided by temperature (GRPO's log-probabilities
 * of completions sampled at that temperature, docs/maths.md §GRPO):
 * row_loss[t] = -log softmax(logits[t] / temperature)[targets[t]] and its
 * grads (the L2Wrap term reads the logits themselves). temperature 1: the
 * forms above, bit for bit. RX_EINVAL, too, for a temperature that is not
 * finite and > 0 (or whose inverse is not a finite float). */
int rx_pretrain_row_losses_temp(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets,
                                int B, int T, int ignore_index, double temperature,
                                double *row_loss);
int rx_pretrain_backward_rows_temp(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets,
                                   int B, int T, int ignore_index, double temperature,
                                   const double *weight, double *row_loss);
/* L2Wrap (RWKV-LM's; docs/maths.md §L2Wrap): every later backward adds
 * factor * max_v logits[t][v] / (B*T) to the grad of the first largest
 * logit of each of the B*T positions (ignored ones too); the loss is
 * unchanged. 0 (the default) turns it off; RWKV-LM uses 1e-4. RX_EINVAL on
 * NULL or a factor that is negative or not finite. */
int rx_ptmodel_set_l2wrap(rx_ptmodel *m, double factor);
double rx_ptmodel_l2wrap(const rx_ptmodel *m);

/* The head and loss over row chunks. x: [T][C] (ln_out's output); head:
 * [C][vocab]; targets: [T] as rx_cross_entropy's. *loss: rx_cross_entropy's
 * loss of x . head, with the same bits. dx: [T][C] written and d_head:
 * [C][vocab] overwritten with the grads of that loss plus the L2Wrap term
 * of factor l2wrap (0: none) over the T positions; both NULL for the loss
 * alone. scratch: 2*min(rows, T)*vocab floats. dx's and the logits' rows
 * are those of the unchunked product; d_head sums its chunks in order,
 * which in fp32 with rows a multiple of 256 is the unchunked product's
 * order too. RX_EINVAL on NULL (dx, d_head aside), a size < 1, an l2wrap
 * that is negative or not finite, overlapping outputs or a valid target
 * outside [0, vocab); RX_ENOMEM. */
int rx_head_loss(const float *x, const float *head, const int *targets, int T, int C,
                 int vocab, int ignore_index, double l2wrap, int rows, float *scratch,
                 float *dx, float *d_head, double *loss);
/* rx_cross_entropy and rx_head_loss per row: row_loss [T] gets each
 * position's loss (0 when ignored) and the grads (dlogits, or dx and
 * d_head) are those of sum_t weight[t] * row_loss[t], weight [T]; with
 * the grads NULL, weight may be NULL. RX_EINVAL as the mean forms, and for
 * a NULL row_loss or a grad asked without weight. */
int rx_cross_entropy_rows(const float *logits, const int *targets, int T, int vocab,
                          int ignore_index, const double *weight, float *dlogits,
                          double *row_loss);
int rx_head_loss_rows(const float *x, const float *head, const int *targets, int T, int C,
                      int vocab, int ignore_index, double l2wrap, const double *weight,
                      int rows, float *scratch, float *dx, float *d_head, double *row_loss);
/* Rows per chunk of a scratch budget of budget_floats floats per buffer
 * (<= 0: RX_HEAD_CHUNK_FLOATS): budget / vocab, rounded down to a multiple
 * of 256 when at least 256, and at least 1. */
#define RX_HEAD_CHUNK_FLOATS (1 << 23)   /* 32 MiB per buffer */
int rx_head_chunk_rows(int vocab, int budget_floats);

/* RX_OK when rx_model_create accepts pc (docs/maths.md §Whole model, and every tensor's
 * element count fits an int), RX_EINVAL for a NULL pc, else RX_ECONFIG
 * (rx_last_error names the field). */
int rx_pt_config_validate(const rx_pt_config *pc);
/* Shape of tensor i: returns its ndim (1 or 2) and fills shape[0..ndim-1];
 * RX_EINVAL if i is out of range. */
int rx_ptmodel_param_shape(const rx_ptmodel *m, int i, int shape[2]);
/* The parameter / gradient arena: the tensors of rx_ptmodel_param back to
 * back in order, no padding. *n (may be NULL) receives the element count. */
float *rx_ptmodel_param_arena(rx_ptmodel *m, int64_t *n);
float *rx_ptmodel_grad_arena(rx_ptmodel *m, int64_t *n);
/* Trainable initial WKV states (docs/maths.md §Initial state): one
 * [H][N][N] state per RWKV block, [n_rwkv_layer][H][N][N] in RWKV-block
 * order, S[i][j] with i the value and j the key index, from which every
 * sequence of a batch starts (zero until set). rx_ptmodel_enable_state
 * allocates them zeroed (RX_OK if already there, RX_ENOMEM); acts made
 * before it are refused by the forward (make them again). The backward
 * then also writes the grad arena of the states: the sum over the batch's
 * sequences of the grad on each sequence's initial state. Both arenas are
 * NULL (n = 0) until enabled. */
int rx_ptmodel_enable_state(rx_ptmodel *m);
float *rx_ptmodel_state_arena(rx_ptmodel *m, int64_t *n);
float *rx_ptmodel_state_grad_arena(rx_ptmodel *m, int64_t *n);
/* Frozen tensors: ranges [n][2], element ranges [begin, end) of the
 * parameter arena (copied; n = 0 unfreezes all) whose weight grads the
 * backward does not compute: no weight-gradient GEMM writes into them and
 * an emb inside one gets no scatter (their grads are then unspecified),
 * while the grads on the activations, so on every other tensor and on the
 * initial states, are the same bits as unfrozen. Vector grads (norms,
 * lerps) inside a range may still be written. RX_EINVAL for NULL or a
 * range outside the arena, RX_ENOMEM. rx_ptmodel_set_frozen(m, 1): the
 * whole arena (a state tune), 0: none. rx_ptmodel_frozen: 1 when the
 * whole arena is frozen, 2 when some of it, 0 when none (or NULL). */
int rx_ptmodel_set_frozen_ranges(rx_ptmodel *m, const int64_t *ranges, int n);
int rx_ptmodel_set_frozen(rx_ptmodel *m, int frozen);
int rx_ptmodel_frozen(const rx_ptmodel *m);
/* LoRA adapters (docs/maths.md §LoRA, docs/layout.md §Adapters): on each
 * weight W [in][out] of params [n] (tensor indices of block projections:
 * receptance_w, key_w, value_w, output_w, ffn_key_w, ffn_value_w, each at
 * most once) an adapter A [r][in], B [out][r], zero until set, with
 * W_eff = W + (alpha / r) A^T B^T (PEFT's W + s B A in torch's [out][in]).
 * The forward and backward then compute y = x W + s (x A^T) B^T and
 * dx = dy W^T + s (dy B) A without forming W_eff, and the backward writes
 * dA = s (dy B)^T x, dB = s dy^T (x A^T) into the adapters' grad arena; W
 * gets no weight grad when its range is frozen (a LoRA tune freezes the
 * base). rx_ptmodel_enable_lora: RX_OK, RX_ENOMEM, RX_EINVAL (r or n < 1,
 * alpha not finite > 0, a tensor that is not a block projection or named
 * twice, the model has adapters, or had others). rx_ptmodel_disable_lora
 * stops applying them (RX_OK; their memory stays until the model is freed,
 * so a binding's views stay valid; the model then reports none); enabling
 * the same r, alpha and params again applies them again, from the same
 * arena and its contents. rx_ptmodel_lora_count: the adapter count (0: none, or NULL), *r
 * and *alpha (may be NULL). rx_ptmodel_lora_adapter: adapter i's tensor
 * index and its A and B element offsets in the arena (RX_EINVAL when i is
 * out of range). The arenas: every adapter's A then B, in params order, no
 * padding; NULL (n = 0) without adapters. */
int rx_ptmodel_enable_lora(rx_ptmodel *m, int r, double alpha, const int *params, int n);
int rx_ptmodel_disable_lora(rx_ptmodel *m);
int rx_ptmodel_lora_count(const rx_ptmodel *m, int *r, double *alpha);
int rx_ptmodel_lora_adapter(const rx_ptmodel *m, int i, int *param, int64_t *a_off,
                            int64_t *b_off);
float *rx_ptmodel_lora_arena(rx_ptmodel *m, int64_t *n);
float *rx_ptmodel_lora_grad_arena(rx_ptmodel *m, int64_t *n);
/* DoRA (docs/maths.md §DoRA): rx_ptmodel_enable_lora's adapters, each with
 * a magnitude M [out] after its B in the arena (zero until set), the
 * adapted product y = (M / n) (x W + s (x A^T) B^T) column by column, n the
 * norms of W_eff's columns over in, held constant in the backward (peft's
 * detached norm); the backward writes dA, dB from dy scaled by M / n and
 * dM = sum over rows of dy (x W_eff) / n. rx_ptmodel_enable_dora: as
 * rx_ptmodel_enable_lora. rx_ptmodel_lora_magnitude: adapter i's M element
 * offset in the arena, -1 for plain LoRA adapters (RX_EINVAL when i is out
 * of range). rx_ptmodel_lora_norms: adapter i's n [out] from the arena
 * now, into out (RX_EINVAL: i out of range, not DoRA, the base unfilled;
 * RX_ENOMEM). */
int rx_ptmodel_enable_dora(rx_ptmodel *m, int r, double alpha, const int *params, int n);
int rx_ptmodel_lora_magnitude(const rx_ptmodel *m, int i, int64_t *m_off);
int rx_ptmodel_lora_norms(rx_ptmodel *m, int i, float *out);
/* The frozen base (docs/layout.md §Frozen base): the matrices params [n]
 * (distinct tensor indices of 2-D parameters other than emb, in any order)
 * are held only in a store of dtype RX_BASE_BF16 (bfloat16), RX_BASE_Q8_0 or
 * RX_BASE_Q4_0 (GGUF Q8_0 / Q4_0 blocks of 32 along each row of W^T
 * [out][in], which needs in % 32 == 0) or RX_BASE_NF4 (QLoRA's NF4 blocks
 * of 64, bitsandbytes' quantize_4bit: in % 64 == 0) or RX_BASE_Q4_K (GGUF
 * Q4_K super-blocks of 256, ggml's quantize_row_q4_K_ref: in % 256 == 0), read by the projection GEMMs; their arena slots and grad slots
 * are released (address space only: they read zero) and must not be
 * written. Nothing computes their weight grads; dX flows through them. The
 * store starts unfilled: rx_ptmodel_base_fill each tensor from src, W^T
 * [out][in] (transposed = 1, torch's orientation) or W [in][out], float32
 * (kind RX_BASE_FP32) or bf16 bits (RX_BASE_BF16), encoded exactly as
 * torch rounds to bf16 (nearest even) or as gguf (bitsandbytes, NF4)
 * quantizes; or, kind the store's block dtype (RX_BASE_Q8_0 / RX_BASE_Q4_0
 * / RX_BASE_NF4 / RX_BASE_Q4_K) and transposed = 1, its
 * stored rows as rx_ptmodel_base_rows writes them (a GGUF file's blocks),
 * copied as they are. A forward
 * before every tensor is filled is refused. The embedding (tensor "emb",
 * [vocab][C]) may be in the base too: held by its rows as they are
 * (Q8_0 / Q4_0 blocks along C, which needs C % 32 == 0; NF4: C % 64; Q4_K:
 * C % 256), decoded as they are
 * gathered; it is [vocab][C] in both orientations. A bf16 base set while
 * the model's precision is RX_PRECISION_BF16 is stored in the bf16 GEMM's
 * packed layout (docs/layout.md §Frozen base), which its forward products
 * read in place; a subnormal bf16 is then held as the GEMM reads it, a
 * signed zero. rx_ptmodel_base_read decodes
 * tensor param into dst [in][out] (exact); rx_ptmodel_base_data hands its
 * store (in its layout) and byte count; rx_ptmodel_base_rows writes its
 * values as rows of W^T [out][in] into dst (bf16 bits, or the bytes of
 * gguf's Q8_0 / Q4_0 of W^T; the embedding's own rows), out * 2 * in bytes
 * for bf16, out * in / 32 * 34 for Q8_0, out * in / 32 * 18 for Q4_0, out * in / 64 * 36
 * for NF4, out * in / 256 * 144 for Q4_K; rx_ptmodel_base_info the dtype (RX_BASE_NONE: no base),
 * count and bytes; rx_ptmodel_base_param the tensor index of base tensor i
 * (arena order). rx_ptmodel_base_release decodes every base tensor into its
 * arena slot and frees the store: the model is plain float32 again (the
 * base-unfreeze). RX_EINVAL on bad arguments, RX_ENOMEM. */
#define RX_BASE_NONE 0
#define RX_BASE_FP32 0
#define RX_BASE_BF16 1
#define RX_BASE_Q8_0 2
#define RX_BASE_Q4_0 3
#define RX_BASE_NF4 4
#define RX_BASE_Q4_K 5
int rx_ptmodel_set_base(rx_ptmodel *m, int dtype, const int *params, int n);
int rx_ptmodel_base_fill(rx_ptmodel *m, int param, const void *src, int kind, int transposed);
int rx_ptmodel_base_read(const rx_ptmodel *m, int param, float *dst);
const void *rx_ptmodel_base_data(const rx_ptmodel *m, int param, int64_t *bytes);
int rx_ptmodel_base_rows(const rx_ptmodel *m, int param, void *dst);
int rx_ptmodel_base_info(const rx_ptmodel *m, int *dtype, int *n, int64_t *bytes);
int rx_ptmodel_base_param(const rx_ptmodel *m, int i);
int rx_ptmodel_base_release(rx_ptmodel *m);
/* The frozen-base dtypes as data, so a binding lists them from the library
 * instead of by name: dtype i in [0, rx_base_num_dtypes()) has a name
 * ("bf16", "q8_0", "q4_0", "nf4", "q4_k"), its RX_BASE_* id, and its block: a stored row of W^T is
 * whole blocks of block_elems values in block_bytes bytes each (the row's
 * size must be a multiple of block_elems). Outputs may be NULL. RX_EINVAL
 * if i is out of range. */
int rx_base_num_dtypes(void);
int rx_base_dtype_info(int i, const char **name, int *id, int *block_elems, int *block_bytes);
/* One row of n float32 values x (n a multiple of the dtype's block_elems)
 * into dst, the stored row a base of dtype (RX_BASE_*) holds of it (n /
 * block_elems * block_bytes bytes), as rx_ptmodel_base_fill encodes;
 * rx_base_dequantize decodes such a row back into n float32 (exact).
 * RX_EINVAL: not a dtype, or n not whole blocks. */
int rx_base_quantize(int dtype, const float *x, size_t n, void *dst);
int rx_base_dequantize(int dtype, const void *src, size_t n, float *dst);
/* Block kinds in model order, one 'R' (RWKV-7) or 'A' (attention) per
 * block, NUL-terminated: "RRARRAR" for n_rwkv = 5, n_attn = 2. */
const char *rx_ptmodel_layers(const rx_ptmodel *m);
/* The time-mix schema: the fields of rx_tm_params / rx_tm_grads as data,
 * so a binding can fill them by table instead of by name (the list is
 * csrc/rx_internal.h's RX_TM_FIELDS, checked against both structs when the
 * library is built). Field i in [0, rx_tm_num_fields()), in declaration
 * order: its name, the byte offset of its pointer in rx_tm_params and in
 * rx_tm_grads, the names of its dimensions (dims[0] one of "C", "Dw", "Da",
 * "Dg", "Dv"; dims[1] too, or NULL for a vector) and whether RWKV block 0
 * has it (0 for the value residual v0, v1, v2). Outputs may be NULL.
 * RX_EINVAL if i is out of range. */
int rx_tm_num_fields(void);
int rx_tm_field(int i, const char **name, size_t *p_off, size_t *g_off, const char *dims[2],
                int *at_layer0);

/* Threads used by every rx_ call made from the calling thread afterwards
 * (n < 1 restores the default, OMP_NUM_THREADS or the core count; n above
 * RX_MAX_THREADS is taken as RX_MAX_THREADS). A build without OpenMP
 * ignores it and reports 1. The thread count changes no result: every sum
 * over rows runs over blocks set by the sizes alone, added in a fixed
 * order, so each kernel, and a model's step, gives the same bits on any
 * number of threads. */
#define RX_MAX_THREADS 1024
void rx_set_num_threads(int n);
int rx_get_num_threads(void);
/* 1 when the library was compiled with OpenMP. */
int rx_has_openmp(void);
/* Name of the GEMM micro-kernel chosen for this CPU ("avx512f-12x32" on
 * Intel, "avx512f-8x32" on AMD Zen 5 and later, "avx512f", "avx2-fma",
 * "generic"). */
const char *rx_sgemm_kernel(void);

/* Per-kernel wall-time accounting (a benchmark hook) of the rx_ calls made
 * from the calling thread: rx_profile_enable(1) zeroes the counters and
 * starts counting, 0 stops; rx_profile_read copies up to n per-slot self
 * times in seconds (time in no kernel is slot 0, "other") and returns the
 * number of slots; rx_profile_name(i) names slot i (NULL out of range). */
void rx_profile_enable(int on);
int rx_profile_read(double *seconds, int n);
const char *rx_profile_name(int i);

/* ---- optim.c: AdamW over flat arenas ---------------------------------
 * params, grads, m, v: [n] (the model's parameter and grad arenas and two
 * optimiser-state buffers of the same size, m and v zero before step 1).
 * One decoupled-AdamW step in place, as torch.optim.AdamW:
 *     g = grad_scale*grad;  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g^2
 *     p = p*(1 - lr*wd [inside decay ranges only])
 *         - lr*(m/(1-b1^step)) / (sqrt(v/(1-b2^step)) + eps)
 * decay_ranges: [n_ranges][2] half-open element ranges [begin, end) that get
 * weight decay, sorted and non-overlapping (n_ranges 0: no decay anywhere).
 * grad_scale carries gradient clipping (min(1, max_norm/norm)) without
 * touching the grads. step >= 1 is the 1-based step count. Elements are
 * independent, so the result is the same at every thread count.
 * RX_EINVAL on NULL, n < 1, step < 1, betas outside [0,1), negative lr, eps
 * or weight_decay, a non-finite grad_scale, or bad ranges. */
int rx_adamw_step(float *params, const float *grads, float *m, float *v, size_t n,
                  const int64_t *decay_ranges, int n_ranges,
                  float lr, float beta1, float beta2, float eps, float weight_decay,
                  float grad_scale, int64_t step);
/* g: [n]. *norm: the global L2 norm sqrt(sum g^2), accumulated in double
 * over ranges set by n alone, added in order: the same bits at any thread
 * count. RX_EINVAL on NULL or n < 1. */
int rx_grad_norm_l2(const float *g, size_t n, double *norm);
/* x, y: [n]. y = a*x + b*y in place (gradient accumulation over
 * micro-batches); b == 0 writes y = a*x without reading y, so a y holding
 * NaN is overwritten. Elements are independent: the same bits at any thread
 * count. RX_EINVAL on NULL, n < 1, non-finite a or b, or x and y
 * overlapping. */
int rx_axpby(size_t n, float a, const float *x, float b, float *y);

/* ---- infer.c: recurrent inference for generation ---------------------
 * One sequence advanced a few tokens at a time from a carried state: the
 * prompt in one call, then one token per call. RWKV-7 blocks carry their
 * WKV state and both token-shift carries; attention blocks keep every
 * earlier key and value (up to max_len positions) and select chunks
 * exactly as the training forward does. Each block runs the training
 * forward's own code, so the logits equal those of a full-sequence
 * rx_pretrain_forward over the same tokens to float32 rounding, bit for
 * bit for a call at position 0 (and, without attention, for every call);
 * the projections are fp32. The state reads the model's parameters live:
 * free it before the model. */
typedef struct rx_infer_state rx_infer_state;
/* *out: a fresh state of model m at position 0 (NULL on failure); max_len
 * bounds the attention cache. RX_EINVAL on NULL, max_len < 1 or a model
 * with LoRA adapters (rx_ptmodel_enable_lora: merge them first), RX_ENOMEM. */
int rx_infer_create(rx_ptmodel *m, int max_len, rx_infer_state **out);
void rx_infer_free(rx_infer_state *s);
/* Back to position 0 (zero carries, empty cache; WKV states zero, or the
 * model's initial states as they are now when it has them:
 * rx_ptmodel_enable_state; rx_infer_create resets too). Cannot fail: a
 * NULL s is a no-op. */
void rx_infer_reset(rx_infer_state *s);
/* Tokens consumed so far; -1 for NULL. */
int rx_infer_pos(const rx_infer_state *s);
/* tokens: [T], each in [0, vocab), continuing the sequence; logits:
 * [T][vocab] for those positions. RX_EINVAL on bad arguments or when an
 * attention cache would pass max_len (the state is then unchanged);
 * after RX_ENOMEM the state is undefined until rx_infer_reset. */
int rx_infer_forward(rx_infer_state *s, const int *tokens, int T, float *logits);

/* ---- gen.c: batched generation -----------------------------------------
 * n_slots sequences of one model, each with its own carried state (RWKV
 * blocks: WKV state and token-shift carries; attention blocks: a key/value
 * cache of max_len positions and the channel-mix carry; a position),
 * advanced together: a step takes any n distinct slots, slot slots[i] by
 * counts[i] tokens (one to decode, or a chunk of a prompt), their rows
 * stacked so every projection is one GEMM of sum(counts) rows; the token
 * shift, WKV recurrence and attention core run per slot. Every
 * block is the training forward's own function, the projections in the
 * model's precision with its frozen base (read in place) and LoRA adapters
 * (unmerged) as rx_pretrain_forward_batch applies them. A slot's logits
 * do not depend on the other slots of its step (bit for bit while a GEMM
 * row's result depends on that row alone) and equal the training
 * forward's over its sequence to float32 rounding (bit for bit without
 * attention: docs/layout.md §Generation state). The state reads the
 * model's parameters live: free it before the model. */
typedef struct rx_gen rx_gen;
/* A state for n_slots sequences over model m. max_len: positions each slot
 * may reach (bounds the attention caches; ignored by a model without
 * attention); max_tokens: the most tokens one step may advance in all
 * (sizes every scratch buffer once: a step allocates nothing of its own).
 * Every slot starts reset. RX_EINVAL on NULL or a size < 1, RX_ENOMEM. */
int rx_gen_create(rx_ptmodel *m, int n_slots, int max_len, int max_tokens, rx_gen **out);
void rx_gen_free(rx_gen *g);
/* slot back to the model's start: position 0, zero carries, WKV states the
 * state tune's initial states as they are now (rx_ptmodel_enable_state),
 * else zero. RX_EINVAL on NULL or a bad slot. */
int rx_gen_reset(rx_gen *g, int slot);
/* dst's whole state (WKV, carries, cache up to its position, position) :=
 * src's. RX_EINVAL on NULL or a bad slot. */
int rx_gen_copy(rx_gen *g, int dst, int src);
/* slot's position (tokens consumed since its reset); -1 for NULL or a bad slot */
int rx_gen_pos(const rx_gen *g, int slot);
/* slots, counts: [n], distinct slots in [0, n_slots), counts >= 1 with
 * sum <= max_tokens; tokens: [sum counts], each slot's in order, each in
 * [0, vocab). all = 0: logits [n][vocab], each slot's last token's; all =
 * 1: [sum counts][vocab], every token's. RX_EINVAL on a bad argument, a
 * base not filled, or a slot whose attention cache would pass max_len: no
 * slot has moved then. After RX_ENOMEM the step's slots are undefined
 * until reset. */
int rx_gen_step(rx_gen *g, int n, const int *slots, const int *counts, const int *tokens,
                int all, float *logits);
/* The fast decode (docs/training.md §Fast decode), on = 1 (0: the exact
 * path, the default): every later step multiplies the products over a Q8_0
 * or Q4_0 frozen base by each row's activations quantised to 32-value int8
 * blocks, in integer dot products (csrc/base_fast.c), as llama.cpp does. A
 * slot's logits still do not depend on the other slots of its step, but
 * are no longer the training forward's to float32 rounding. A model
 * without such a base computes as ever. RX_EINVAL on NULL or on not 0/1. */
int rx_gen_set_fast(rx_gen *g, int on);

/* ---- sample.c: drawing each row's next token ----------------------------
 * Rows r < R of x and raw ([R][V], rows ld floats apart): raw the model's
 * logits, x the logits the token is drawn from (raw after penalties and
 * banned ids, or raw itself). ids[r]: the id drawn from softmax(x / t)
 * (t = temperature) kept to the top_k most likely ids (0: all), then to the
 * fewest most likely whose mass reaches top_p (1: all), ties ordered by id,
 * renormalised; by u[r] in [0, 1): the first id whose running mass in id
 * order exceeds u[r] of the whole (numpy's Generator.choice). t = 0 takes
 * the first largest x. logprob[r]: log_softmax(raw)[ids[r]]. In float64,
 * each row alone (docs/training.md §Drawing a token): a row's results do
 * not depend on the other rows. ids[r] = -1 for a row with a raw logit not
 * finite, or no finite x. RX_EINVAL on NULL, R < 0, V < 1, ld < V, t not
 * a finite value >= 0, top_p outside [0, 1], top_k < 0 or a u outside
 * [0, 1); RX_ENOMEM. */
int rx_sample_rows(int R, int V, const float *x, const float *raw, size_t ld, const double *u,
                   double temperature, double top_p, int top_k, int32_t *ids, double *logprob);

/* ---- gemm_bf16.c, proj.c, model_layout.c: bf16 mixed precision -------
 * With RX_PRECISION_BF16 every projection GEMM of the model's forward and
 * backward -- time-mix R/K/V/O and its LoRAs, channel-mix key/value,
 * attention Q/K/V/O, the head -- multiplies operands rounded to bf16 (round
 * to nearest even, fp32 subnormals to signed zero: what vcvtne2ps2bf16 does)
 * and accumulates in fp32; weight grads are fp32 products
 * of bf16-rounded activations and output grads.
 * Kept fp32, and why:
 *   - parameters, gradients and AdamW state: a bf16 weight could not take an
 *     update smaller than 2^-8 of itself, so small learning rates would stall;
 *   - the WKV7 recurrence and its state: it sums over the whole sequence
 *     through a decay, and bf16's 8-bit mantissa would drift over T steps;
 *   - LayerNorm / group norm statistics, softmax, cross-entropy: reductions
 *     and exponentials whose error bf16 would multiply, at little cost;
 *   - attention's score and value tiles (64 x 64 x head_size): too small for
 *     the bf16 packing to pay, and the softmax reads their output;
 *   - token shift, gates and activations: elementwise, memory-bound.
 * Recurrent inference (rx_infer_*) runs in fp32 whatever the precision. */
#define RX_PRECISION_FP32 0
#define RX_PRECISION_BF16 1
/* Sets / reads the model's precision (default RX_PRECISION_FP32). Changing
 * it between a forward and its backward is allowed but mixes the two.
 * RX_EINVAL on a NULL model or an unknown value. */
int rx_ptmodel_set_precision(rx_ptmodel *m, int precision);
int rx_ptmodel_precision(const rx_ptmodel *m);
/* Name of the bf16 kernel chosen for this CPU ("amx-bf16", "avx512-bf16",
 * "generic-bf16": fp32 arithmetic on the same bf16-rounded operands). */
const char *rx_bgemm_kernel(void);
/* 1 when that kernel uses bf16 hardware. */
int rx_bgemm_hw(void);
/* 1 where that kernel makes a training step faster than fp32 on this CPU
 * (what precision "auto" asks): AMX tiles, or vdpbf16ps on a CPU that
 * issues it at the fp32 FMA's rate, so at twice its flops (AMD Zen 4 and
 * Zen 5); not where it issues at half that rate (Intel: Sapphire Rapids
 * without AMX's grant, Cooper Lake). */
int rx_bgemm_pays(void);

/* ====================================================================
 * Legacy forms (kept for compatibility)
 *
 * The original API's calls that cannot return an RX_* code, and the first
 * extensions made in their image. Each does the work of the int-returning
 * form named in its deprecation message, with the same results where that
 * one succeeds, but reports a failure only through its result: NULL from a
 * constructor, NaN from a loss or the grad norm, NaN-filled outputs from
 * the embedding and head (an output that would overlap an input is left as
 * it is instead). A caller has to test that result and cannot tell
 * RX_ENOMEM from RX_EINVAL; except where an embedding form fills NaN,
 * rx_last_error() then says why, as after the int form. New code should
 * call the int forms; these stay so that programs written against the
 * original header still build and link.
 *
 * Under GCC and Clang each is declared deprecated with a message naming
 * its replacement, so a call warns (-Wdeprecated-declarations, on by
 * default). Define RX_NO_DEPRECATION_WARNINGS before including this header
 * to declare them plainly, e.g. in code that tests these forms themselves.
 * ==================================================================== */
#if (defined(__GNUC__) || defined(__clang__)) && !defined(RX_NO_DEPRECATION_WARNINGS)
#define RX_DEPRECATED(msg) __attribute__((deprecated(msg)))
#else
#define RX_DEPRECATED(msg)
#endif

/* ---- NULL on failure ---- */
/* A model drawn as by rx_model_create, no options. */
RX_DEPRECATED("use rx_model_create(pc, 0, seed, &m)")
rx_ptmodel* rx_model_new_random(const rx_pt_config *pc, uint64_t seed);
/* The same with the RX_PT_* options in flags (an unknown bit: NULL). */
RX_DEPRECATED("use rx_model_create(pc, flags, seed, &m)")
rx_ptmodel *rx_model_new_random_flags(const rx_pt_config *pc, int flags, uint64_t seed);
/* Acts for one sequence of T tokens (B = 1). */
RX_DEPRECATED("use rx_pt_acts_create(m, 1, T, &acts)")
rx_pt_acts* rx_pt_acts_new(const rx_ptmodel *m, int T);
/* Acts for B sequences of T tokens; B*T must fit an int. */
RX_DEPRECATED("use rx_pt_acts_create(m, B, T, &acts)")
rx_pt_acts *rx_pt_acts_new_batch(const rx_ptmodel *m, int B, int T);
/* A fresh inference state at position 0; max_len bounds the attention
 * cache. */
RX_DEPRECATED("use rx_infer_create(m, max_len, &s)")
rx_infer_state *rx_infer_new(rx_ptmodel *m, int max_len);

/* ---- NaN on failure ---- */
/* targets: [T]; returns the loss, the grads written as by
 * rx_pretrain_backward_loss with B = 1. */
RX_DEPRECATED("use rx_pretrain_backward_loss(m, acts, targets, 1, T, ignore_index, &loss)")
double rx_pretrain_backward(rx_ptmodel *m, const rx_pt_acts *acts,
                            const int *targets, int T, int ignore_index);
/* targets: [B][T]; returns the mean loss over the batch's valid positions. */
RX_DEPRECATED("use rx_pretrain_backward_loss(m, acts, targets, B, T, ignore_index, &loss)")
double rx_pretrain_backward_batch(rx_ptmodel *m, const rx_pt_acts *acts,
                                  const int *targets, int B, int T, int ignore_index);
/* logits: [T][vocab]; targets: [T]; returns the loss of rx_cross_entropy. */
RX_DEPRECATED("use rx_cross_entropy(logits, targets, T, vocab, ignore_index, NULL, &loss)")
double rx_cross_entropy_forward(const float *logits, const int *targets,
                                int T, int vocab, int ignore_index);
/* The same loss and dlogits [T][vocab] (required here; NaN-filled on
 * failure). */
RX_DEPRECATED("use rx_cross_entropy(logits, targets, T, vocab, ignore_index, dlogits, &loss)")
double rx_cross_entropy_backward(const float *logits, const int *targets,
                                 int T, int vocab, int ignore_index,
                                 float *dlogits);
/* g: [n]; returns the norm of rx_grad_norm_l2. */
RX_DEPRECATED("use rx_grad_norm_l2(g, n, &norm)")
double rx_grad_norm(const float *g, size_t n);

/* ---- NaN-filled outputs ---- */
/* emb: [vocab][C]; tokens: [T]; out: [T][C] = emb[tokens]. This signature
 * carries no vocab, so only a negative token (or a NULL emb or tokens) is
 * caught: its row is NaN, never read out of bounds; nor can it check out
 * against emb, whose size it does not know. */
RX_DEPRECATED("use rx_embedding_gather(emb, tokens, T, C, vocab, out)")
void rx_embedding_forward(const float *emb, const int *tokens,
                          int T, int C, float *out);
/* tokens: [T]; d_out: [T][C]; d_emb: [vocab][C], zeroed then scatter-added.
 * Tokens outside [0, vocab) are skipped (the int form refuses them); a NULL
 * tokens or d_out, or T < 1, fills d_emb with NaN; a d_emb that overlaps
 * d_out or tokens is left as it is. */
RX_DEPRECATED("use rx_embedding_scatter(tokens, T, C, vocab, d_out, d_emb)")
void rx_embedding_backward(const int *tokens, int T, int C, int vocab,
                           const float *d_out, float *d_emb);
/* x: [T][C]; head: [C][vocab]; logits: [T][vocab]. */
RX_DEPRECATED("use rx_head_logits(x, head, T, C, vocab, logits)")
void rx_head_forward(const float *x, const float *head,
                     int T, int C, int vocab, float *logits);
/* dlogits: [T][vocab]; dx: [T][C] written; d_head: [C][vocab] zeroed then
 * accumulated. */
RX_DEPRECATED("use rx_head_grads(x, head, dlogits, T, C, vocab, dx, d_head)")
void rx_head_backward(const float *x, const float *head, const float *dlogits,
                      int T, int C, int vocab,
                      float *dx, float *d_head);

#ifdef __cplusplus
}
#endif

#endif /* RWKVX_PRETRAIN_H */
