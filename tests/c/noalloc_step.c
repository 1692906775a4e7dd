/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * noalloc_step.c -- a training step allocates nothing once the first step
 * has grown its buffers. Linked against the package's shared library; this
 * program defines malloc, calloc, realloc, aligned_alloc and posix_memalign
 * itself (glibc: they forward to __libc_*), so the library's calls reach
 * them and are counted while a step runs. tests/test_noalloc.py builds and
 * runs it; not under the sanitizers, which replace the allocator too.
 *
 *   noalloc_step    -> prints "allocations fp32 N" and "allocations bf16 N"
 *                      for one forward + backward + grad norm + AdamW step
 *                      after a warm-up step of the same precision
 *   noalloc_step FLAGS HEAD_ROWS lora|dora
 *                   -> the same with LoRA (or DoRA) adapters on every
 *                      projection and the base frozen (a LoRA tune's step)
 *   noalloc_step FLAGS HEAD_ROWS lora|base rows
 *                   -> a preference step: the per-position losses, then
 *                      the row-weighted backward
 *   noalloc_step FLAGS HEAD_ROWS lora|dora|none bf16|q8_0
 *                   -> with every block projection and the head held in a
 *                      frozen base of that dtype (base.c)
 *   noalloc_step 0 0 - accum
 *                   -> two micro-batches summed into one step (--grad-accum)
 *   noalloc_step FLAGS HEAD_ROWS lora groups
 *                   -> a LoRA tune's step in row groups of one sequence
 *                      (rx_pt_acts_create_groups; FLAGS must hold
 *                      RX_ACTS_RECOMPUTE), on the model without its
 *                      attention block
 *   noalloc_step 0 0 lora|dora|none gen
 *                   -> batched generation (gen.c): a step of slots decoding
 *                      beside a slot joining with its prompt, then a
 *                      decoding step, after a first step of max_tokens rows
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rx_pretrain.h"
#include "projections.h"

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

static int counting;
static long count;

static void note(void) {
    if (__atomic_load_n(&counting, __ATOMIC_RELAXED)) __atomic_fetch_add(&count, 1, __ATOMIC_RELAXED);
}

void *malloc(size_t n) { note(); return __libc_malloc(n); }
void *calloc(size_t a, size_t b) { note(); return __libc_calloc(a, b); }
void *realloc(void *p, size_t n) { note(); return __libc_realloc(p, n); }
void *aligned_alloc(size_t al, size_t n) { note(); return __libc_memalign(al, n); }
int posix_memalign(void **p, size_t al, size_t n) {
    note();
    *p = __libc_memalign(al, n);
    return *p ? 0 : 12; /* ENOMEM */
}

#define B 2
#define T 128

static int rows_mode;
static double row_loss[B * T], weight[B * T];

/* acc: NULL, or a grad-sized buffer: then the step accumulates two
 * micro-batches (--grad-accum 2: the first's grads into acc, the second's
 * summed with them in the arena) */
static int step(rx_ptmodel *m, rx_pt_acts *acts, const int *tok, const int *tgt, float *mom,
                float *vel, int64_t t, float *acc) {
    int64_t n;
    float *p = rx_ptmodel_param_arena(m, &n);
    float *g = (float *)rx_ptmodel_grad_arena(m, &n);
    double loss, norm;
    int rc = RX_OK;
    if (acc) {
        rc = rx_pretrain_forward_batch(m, tok, B, T, acts);
        if (rc == RX_OK) rc = rx_pretrain_backward_loss(m, acts, tgt, B, T, -1, &loss);
        if (rc == RX_OK) rc = rx_axpby((size_t)n, 0.5f, g, 0.0f, acc);
    }
    if (rc == RX_OK) rc = rx_pretrain_forward_batch(m, tok, B, T, acts);
    if (rc == RX_OK && rows_mode) {
        rc = rx_pretrain_row_losses(m, acts, tgt, B, T, -1, row_loss);
        for (int i = 0; i < B * T; i++) weight[i] = (i / T ? -1e-3 : 1e-3) * (1.0 + row_loss[i]);
        if (rc == RX_OK) rc = rx_pretrain_backward_rows(m, acts, tgt, B, T, -1, weight, row_loss);
    } else if (rc == RX_OK) {
        rc = rx_pretrain_backward_loss(m, acts, tgt, B, T, -1, &loss);
    }
    if (rc == RX_OK && acc) rc = rx_axpby((size_t)n, 1.0f, acc, 0.5f, g);
    if (rc == RX_OK) rc = rx_grad_norm_l2(g, (size_t)n, &norm);
    if (rc == RX_OK)
        rc = rx_adamw_step(p, g, mom, vel, (size_t)n, NULL, 0, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f,
                           1.0f, t);
    return rc;
}

/* LoRA (dora: DoRA) adapters of rank 8 on every block projection of m, A
 * nonzero, the base frozen */
static int add_lora(rx_ptmodel *m, int dora) {
    int idx[64];
    const int n = block_projections(m, idx, 64);
    const int rc = dora ? rx_ptmodel_enable_dora(m, 8, 16.0, idx, n)
                        : rx_ptmodel_enable_lora(m, 8, 16.0, idx, n);
    int64_t na = 0;
    float *a = rc == RX_OK ? rx_ptmodel_lora_arena(m, &na) : NULL;
    for (int64_t i = 0; i < na; i++) a[i] = (float)((i * 37) % 11 - 5) * 0.01f;
    return rc == RX_OK ? rx_ptmodel_set_frozen(m, 1) : rc;
}

/* Every block projection and the head of m in a frozen base of dtype,
 * filled with the values they had */
static int add_base(rx_ptmodel *m, int dtype) {
    int idx[65];
    int n = block_projections(m, idx, 64);
    for (int i = 0; i < rx_ptmodel_num_params(m); i++) {
        const char *name;
        rx_ptmodel_param(m, i, &name, NULL, NULL, NULL);
        if (strcmp(name, "head") == 0) idx[n++] = i;
    }
    float *keep[65];
    int rc = RX_OK;
    for (int i = 0; i < n; i++) {
        float *w;
        int cnt;
        rx_ptmodel_param(m, idx[i], NULL, &w, NULL, &cnt);
        keep[i] = malloc((size_t)cnt * sizeof(float));
        if (!keep[i]) return RX_ENOMEM;
        memcpy(keep[i], w, (size_t)cnt * sizeof(float));
    }
    rc = rx_ptmodel_set_base(m, dtype, idx, n);
    for (int i = 0; i < n; i++) {
        if (rc == RX_OK) rc = rx_ptmodel_base_fill(m, idx[i], keep[i], RX_BASE_FP32, 0);
        free(keep[i]);
    }
    return rc == RX_OK ? rx_ptmodel_set_frozen(m, 1) : rc;
}

/* Generation steps on m (rx_gen_step), timed by the caller's counting:
 * *warm 1 runs the warm-up step of max_tokens rows */
#define GEN_SLOTS 4
#define GEN_TOKENS 48
static int gen_steps(rx_gen *g, const int *tok, int warm) {
    static float logits[GEN_TOKENS * 384];
    static const int wslots[2] = {0, 1}, wcounts[2] = {40, 8};
    static const int slots[3] = {1, 3, 0}, counts[3] = {1, 17, 1}, dslots[2] = {3, 0};
    static const int ones[3] = {1, 1, 1};
    if (warm) return rx_gen_step(g, 2, wslots, wcounts, tok, 1, logits);
    int rc = rx_gen_reset(g, 3);
    if (rc == RX_OK) rc = rx_gen_step(g, 3, slots, counts, tok, 0, logits);
    if (rc == RX_OK) rc = rx_gen_step(g, 2, dslots, ones, tok + 5, 0, logits);
    if (rc == RX_OK) rc = rx_gen_step(g, 3, slots, counts, tok + 9, 1, logits);
    return rc;
}

/* argv: [RX_ACTS_* flags [head_rows [lora|dora|base|none|-
 * [rows|accum|bf16|q8_0|gen|groups]]]]; with flags, L2Wrap on too */
int main(int argc, char **argv) {
    const int flags = argc > 1 ? atoi(argv[1]) : 0, head_rows = argc > 2 ? atoi(argv[2]) : 0;
    rows_mode = argc > 4 && strcmp(argv[4], "rows") == 0;
    /* large enough that the norms, GEMMs and cross-entropy take their
     * multi-threaded paths (OMP_NUM_THREADS=2) */
    const int groups = argc > 4 && strcmp(argv[4], "groups") == 0;
    const rx_pt_config cfg = {
        .n_embd = 128, .n_head = 2, .head_size = 64, .n_rwkv_layer = 2,
        .n_attn_layer = groups ? 0 : 1,
        .vocab_size = 384, .Dw = 16, .Da = 16, .Dg = 32, .Dv = 8, .ffn_dim = 256,
        .chunk_size = 32, .moba_top_k = 2,
    };
    static int tok[B * T], tgt[B * T];
    for (int i = 0; i < B * T; i++) tok[i] = (7 * i + 3) % cfg.vocab_size;
    for (int i = 0; i < B * T; i++) tgt[i] = (5 * i + 1) % cfg.vocab_size;
    rx_ptmodel *m = NULL;
    rx_pt_acts *acts = NULL;
    int64_t n = 0;
    int rc = rx_model_create(&cfg, 0, 0, &m);
    if (rc == RX_OK)
        rc = rx_pt_acts_create_groups(m, B, T, flags, head_rows, groups ? 1 : B, &acts);
    if (rc == RX_OK && flags) rc = rx_ptmodel_set_l2wrap(m, 1e-4);
    if (rc == RX_OK && argc > 3 && (strcmp(argv[3], "lora") == 0 || strcmp(argv[3], "dora") == 0))
        rc = add_lora(m, strcmp(argv[3], "dora") == 0);
    if (rc == RX_OK && argc > 4 && (strcmp(argv[4], "bf16") == 0 || strcmp(argv[4], "q8_0") == 0))
        rc = add_base(m, strcmp(argv[4], "q8_0") == 0 ? RX_BASE_Q8_0 : RX_BASE_BF16);
    if (rc == RX_OK) rx_ptmodel_param_arena(m, &n);
    float *mom = calloc((size_t)n + 1, sizeof(float)), *vel = calloc((size_t)n + 1, sizeof(float));
    const int accum = argc > 4 && strcmp(argv[4], "accum") == 0;
    float *acc = accum ? calloc((size_t)n + 1, sizeof(float)) : NULL;
    if (rc != RX_OK || !mom || !vel || (accum && !acc)) {
        fprintf(stderr, "set-up failed: %s\n", rx_last_error());
        return 2;
    }
    rx_gen *g = NULL;
    if (rc == RX_OK && argc > 4 && strcmp(argv[4], "gen") == 0)
        rc = rx_gen_create(m, GEN_SLOTS, 2 * T, GEN_TOKENS, &g);
    const int precisions[2] = {RX_PRECISION_FP32, RX_PRECISION_BF16};
    const char *names[2] = {"fp32", "bf16"};
    int64_t t = 1;
    for (int i = 0; i < 2; i++) {
        rc = rx_ptmodel_set_precision(m, precisions[i]);
        /* the first grows the buffers */
        if (rc == RX_OK) rc = g ? gen_steps(g, tok, 1) : step(m, acts, tok, tgt, mom, vel, t++, acc);
        __atomic_store_n(&count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&counting, 1, __ATOMIC_RELAXED);
        if (rc == RX_OK) rc = g ? gen_steps(g, tok, 0) : step(m, acts, tok, tgt, mom, vel, t++, acc);
        __atomic_store_n(&counting, 0, __ATOMIC_RELAXED);
        if (rc != RX_OK) {
            fprintf(stderr, "%s step failed: %s\n", names[i], rx_last_error());
            return 2;
        }
        printf("allocations %s %ld\n", names[i], __atomic_load_n(&count, __ATOMIC_RELAXED));
    }
    free(mom);
    free(vel);
    free(acc);
    rx_gen_free(g);
    rx_pt_acts_free(acts);
    rx_ptmodel_free(m);
    return 0;
}
