/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * proj.c -- the one projection entry (rx_pgemm, rx_pgemm_batch): every
 * weight product of the model runs through here, and here alone meet the
 * calling thread's tables that shape it:
 *
 *     precision  rx_sgemm or rx_bgemm (rx_gemm_set_precision)
 *     frozen     weight-grad products that are not run (rx_gemm_set_frozen)
 *     base       products whose op(B) a frozen base store packs
 *                (rx_gemm_set_base, base_pack.c's rx_base_source)
 *     fast       those over a Q8_0 or Q4_0 base run as integer products
 *                instead (rx_gemm_set_fast, base_fast.c)
 *     lora       adapter products after the base ones (rx_gemm_set_lora,
 *                lora.c, handed rx_pgemm_run to run them on)
 *
 * The model sets the tables for the span of its forward and backward.
 */
#include "rx_internal.h"

static _Thread_local int tl_precision = RX_PRECISION_FP32;

int rx_gemm_set_precision(int precision) {
    int old = tl_precision;
    tl_precision = precision;
    return old;
}

/* The calling thread's frozen spans (rx_gemm_set_frozen): none when n = 0 */
static _Thread_local rx_frozen tl_frozen;

rx_frozen rx_gemm_set_frozen(rx_frozen f) {
    const rx_frozen old = tl_frozen;
    tl_frozen = f;
    return old;
}

int rx_pgemm_run(const rx_gemm_op *ops, size_t n) {
    return tl_precision == RX_PRECISION_BF16 ? rx_bgemm_batch(ops, n) : rx_sgemm_batch(ops, n);
}

/* The calling thread's adapter table (rx_gemm_set_lora): NULL when none */
static _Thread_local const rx_lora *tl_lora;

const rx_lora *rx_gemm_set_lora(const rx_lora *L) {
    const rx_lora *old = tl_lora;
    tl_lora = L;
    return old;
}

/* C lies in one of the frozen spans */
static int frozen_out(const float *c) {
    const rx_frozen *f = &tl_frozen;
    if (c < f->base) return 0;
    const int64_t off = (int64_t)(c - f->base);
    for (int r = 0; r < f->n; r++)
        if (off >= f->ranges[2 * r] && off < f->ranges[2 * r + 1]) return 1;
    return 0;
}

/* The calling thread's frozen base (rx_gemm_set_base): NULL when none */
static _Thread_local const rx_base *tl_base;

const rx_base *rx_gemm_set_base(const rx_base *s) {
    const rx_base *old = tl_base;
    tl_base = s;
    return old;
}

/* The calling thread's fast decode (rx_gemm_set_fast): 0 off */
static _Thread_local int tl_fast;

int rx_gemm_set_fast(int on) {
    const int old = tl_fast;
    tl_fast = on;
    return old;
}

/* The base products of a batch, less those of frozen tensors; a product
 * reading a base tensor has its op(B) packed from the store (base_pack.c),
 * or with the fast decode on, runs as its integer product (base_fast.c) */
static int pgemm_base(const rx_gemm_op *ops, size_t n) {
    if (!tl_frozen.n && !tl_base) return rx_pgemm_run(ops, n);
    /* a weight-grad product of a frozen tensor: its output lies in the grad
     * arena where nothing reads it, so it is not computed at all */
    rx_gemm_op live[16];
    size_t nl = 0;
    int rc = RX_OK;
    for (size_t i = 0; i < n && rc == RX_OK; i++) {
        if (frozen_out(ops[i].C) || rx_base_grad_slot(tl_base, ops[i].C)) continue;
        live[nl] = ops[i];
        live[nl].bsrc_of = rx_base_find(tl_base, ops[i].B);
        live[nl].bsrc = live[nl].bsrc_of ? &rx_base_source : NULL;
        if (tl_fast && live[nl].bsrc_of && rx_base_fast_ok(live[nl].bsrc_of, &live[nl])) {
            rc = rx_base_fast_sgemm(live[nl].bsrc_of, &live[nl]);
            continue;
        }
        nl++;
        if (nl == sizeof live / sizeof live[0]) rc = rx_pgemm_run(live, nl), nl = 0;
    }
    return rc == RX_OK && nl ? rx_pgemm_run(live, nl) : rc;
}

/* The base products, then the adapters' (lora.c) when the thread has any */
int rx_pgemm_batch(const rx_gemm_op *ops, size_t n) {
    return tl_lora ? rx_lora_apply(tl_lora, ops, n, pgemm_base, rx_pgemm_run)
                   : pgemm_base(ops, n);
}

int rx_pgemm(int ta, int tb, size_t M, size_t N, size_t K, const float *A, size_t lda,
             const float *B, size_t ldb, float beta, float *C, size_t ldc) {
    const rx_gemm_op g = {ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc};
    return rx_pgemm_batch(&g, 1);
}
