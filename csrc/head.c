/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * head.c -- the unembedding projection and the softmax cross-entropy loss
 * that reads its logits (docs/maths.md §Loss).
 *
 * rx_head_logits, rx_head_grads and rx_cross_entropy return a code; the
 * original API's void and double forms wrap them, and since they cannot
 * return an error, fill their outputs with NaN on one instead (an output
 * that overlaps an input is left as it is: the input stays intact).
 *
 * The log-sum-exp subtracts the row maximum and accumulates in double, so
 * any finite logits, +-3e38 included, give the exact loss and a clean
 * softmax (docs/maths.md §Loss).
 */
#include <float.h>

#include "rx_internal.h"

/* x: [T][C]; head: [C][vocab]; logits: [T][vocab] */
int rx_head_logits(const float *x, const float *head, int T, int C, int vocab,
                   float *logits) {
    if (!x || !head || !logits)
        return rx_fail(RX_EINVAL, "rx_head_logits: %s is NULL",
                       !x ? "x" : !head ? "head" : "logits");
    if (T < 1 || C < 1 || vocab < 1)
        return rx_fail(RX_EINVAL, "rx_head_logits: T = %d, C = %d, vocab = %d must be >= 1", T,
                       C, vocab);
    const size_t TT = (size_t)T, CC = (size_t)C, V = (size_t)vocab;
    return rx_pgemm(0, 0, TT, V, CC, x, CC, head, V, 0.0f, logits, V);
}

void rx_head_forward(const float *x, const float *head, int T, int C, int vocab,
                     float *logits) {
    if (rx_head_logits(x, head, T, C, vocab, logits) == RX_OK || T < 1 || C < 1 || vocab < 1)
        return;
    rx_spans in = {.n = 0};
    RX_SPAN_ADD(&in, "x", x, (size_t)T * C);
    RX_SPAN_ADD(&in, "head", head, (size_t)C * vocab);
    rx_fnan_apart(logits, (size_t)T * (size_t)vocab, &in);
}

/* x: [T][C]; head: [C][vocab]; dlogits: [T][vocab];
 * dx: [T][C] written; d_head: [C][vocab] overwritten with x^T . dlogits */
int rx_head_grads(const float *x, const float *head, const float *dlogits,
                  int T, int C, int vocab, float *dx, float *d_head) {
    if (!x || !head || !dlogits || !dx || !d_head)
        return rx_fail(RX_EINVAL, "rx_head_grads: %s is NULL",
                       !x ? "x" : !head ? "head" : !dlogits ? "dlogits" : !dx ? "dx" : "d_head");
    if (T < 1 || C < 1 || vocab < 1)
        return rx_fail(RX_EINVAL, "rx_head_grads: T = %d, C = %d, vocab = %d must be >= 1", T,
                       C, vocab);
    const size_t TT = (size_t)T, CC = (size_t)C, V = (size_t)vocab;
    const rx_gemm_op ops[2] = {{0, 1, TT, CC, V, dlogits, V, head, V, 0.0f, dx, CC},
                               {1, 0, CC, V, TT, x, CC, dlogits, V, 0.0f, d_head, V}};
    return rx_pgemm_batch(ops, 2);
}

void rx_head_backward(const float *x, const float *head, const float *dlogits,
                      int T, int C, int vocab, float *dx, float *d_head) {
    if (rx_head_grads(x, head, dlogits, T, C, vocab, dx, d_head) == RX_OK || T < 1 || C < 1 ||
        vocab < 1)
        return;
    rx_spans in = {.n = 0};
    RX_SPAN_ADD(&in, "x", x, (size_t)T * C);
    RX_SPAN_ADD(&in, "head", head, (size_t)C * vocab);
    RX_SPAN_ADD(&in, "dlogits", dlogits, (size_t)T * vocab);
    rx_fnan_apart(dx, (size_t)T * (size_t)C, &in);
    rx_fnan_apart(d_head, (size_t)C * (size_t)vocab, &in);
}

/* One row: returns -log softmax(k l)[target]; if d is not NULL writes its
 * grad on l, d = (softmax(k l) - onehot(target)) * scale * k. l, d: [V];
 * k > 0 the inverse of a sampling temperature (docs/maths.md §GRPO), 1 for
 * the plain loss, whose products by k then leave every bit as it was. One
 * exp per logit (rx_expf, vectorised): e = exp(k (l - max)) is summed in
 * eight double lanes and, scaled by 1/sum, is the softmax.
 *
 * The loss is formed as log(sum) + (max - l[target]), never as
 * max + log(sum) - l[target]: with logits near 3e38 the latter loses
 * log(sum) to the rounding of max and reads 0.0 (docs/maths.md §Loss).
 * log(sum) is log1p of the sum without the maximum's own 1 (the tail), so a
 * target that dominates its row by a gap g still gives ~e^-g, not log(1.0);
 * below CE_TINY_TAIL the float terms lose precision to underflow and the
 * tail is summed again in double. A row of V >= 2 finite logits never
 * assigns its target probability 1, so its loss is at least DBL_TRUE_MIN. */
#define CE_LANES 8
#define CE_TINY_TAIL 1e-30
/* The first index of the largest of l[0..V), as a scan keeping the first
 * of equal maxima and passing over NaNs (0 when l[0] is NaN). The maximum
 * comes from AM_LANES running maxima in independent chains, then the index
 * from a scan for the first element equal to it, a block of AM_LANES
 * compares at a time: both loops vectorise. (Eight running maxima, or the
 * index kept beside each maximum, the compiler left scalar or branchy:
 * perf, V = 16384, 40% of ce_row's time.) */
#define AM_LANES 32
RX_HOT static size_t first_argmax(const float *restrict l, size_t V) {
    float mx[AM_LANES];
    for (size_t j = 0; j < AM_LANES; j++) mx[j] = l[0];
    size_t v = 1;
    for (; v + AM_LANES <= V; v += AM_LANES)
        for (size_t j = 0; j < AM_LANES; j++) mx[j] = l[v + j] > mx[j] ? l[v + j] : mx[j];
    for (; v < V; v++) mx[0] = l[v] > mx[0] ? l[v] : mx[0];
    float m = mx[0];
    for (size_t j = 1; j < AM_LANES; j++) m = mx[j] > m ? mx[j] : m;
    if (m != m) return 0;
    for (v = 0; v + AM_LANES <= V; v += AM_LANES) {
        int hit = 0;
        for (size_t j = 0; j < AM_LANES; j++) hit |= l[v + j] == m;
        if (hit) break;
    }
    while (l[v] != m) v++;
    return v;
}

RX_HOT static double ce_row(const float *restrict l, size_t V, size_t target,
                            float *restrict d, double scale, float k) {
    const size_t am = first_argmax(l, V);
    const float m = l[am];
    /* acc sums every e but the maximum's own 1, so small terms are not
     * rounded away against it; lane j takes the elements v + j, in order
     * (only the maximum's block masks an element: a mask in every block
     * kept the compiler from vectorising the sums) */
    double acc[CE_LANES] = {0};
    const size_t amb = am / CE_LANES * CE_LANES;
    size_t v = 0;
    for (; v + CE_LANES <= V; v += CE_LANES) {
        float e[CE_LANES];
        for (size_t j = 0; j < CE_LANES; j++) e[j] = rx_expf(k * (l[v + j] - m));
        if (d)
            for (size_t j = 0; j < CE_LANES; j++) d[v + j] = e[j];
        if (v == amb) {
            for (size_t j = 0; j < CE_LANES; j++) acc[j] += v + j == am ? 0.0 : (double)e[j];
            continue;
        }
        for (size_t j = 0; j < CE_LANES; j++) acc[j] += (double)e[j];
    }
    for (; v < V; v++) {
        float e = rx_expf(k * (l[v] - m));
        if (d) d[v] = e;
        acc[0] += v == am ? 0.0f : e;
    }
    double tail = 0.0;
    for (size_t j = 0; j < CE_LANES; j++) tail += acc[j];
    const double s = 1.0 + tail;
    if (d) {
        const double sk = scale * (double)k;
        const float f = (float)(sk / s);
        for (v = 0; v < V; v++) d[v] *= f;
        d[target] = (float)((double)d[target] - sk);
    }
    if (tail < CE_TINY_TAIL) {
        tail = 0.0;
        for (v = 0; v < V; v++)
            if (v != am) tail += exp((double)k * ((double)l[v] - (double)m));
    }
    double loss = log1p(tail) + (double)k * ((double)m - (double)l[target]);
    return V > 1 && loss < DBL_TRUE_MIN ? DBL_TRUE_MIN : loss;
}

static int ce_valid(int target, int ignore_index) {
    return ignore_index < 0 || target != ignore_index;
}

/* *n_valid = the positions of targets [T] the loss counts (not
 * ignore_index); RX_EINVAL naming the first counted target outside
 * [0, vocab). */
static int count_targets(const char *fn, const int *targets, size_t T, int vocab,
                         int ignore_index, size_t *n_valid) {
    size_t n = 0;
    for (size_t t = 0; t < T; t++) {
        if (!ce_valid(targets[t], ignore_index)) continue;
        if (targets[t] < 0 || targets[t] >= vocab)
            return rx_fail(RX_EINVAL, "%s: target %d at position %zu is outside [0, %d) and is "
                           "not ignore_index %d", fn, targets[t], t, vocab, ignore_index);
        n++;
    }
    *n_valid = n;
    return RX_OK;
}

/* logits, dlogits: [T][vocab]; targets: [T]. Shared by the forward (dlogits
 * NULL) and the backward. With w [T] (the rows form), each row's grad is
 * scaled by w[t] instead of 1/n_valid; row_loss [T] (or NULL) gets each
 * row's loss, 0 for an ignored one. */
static int cross_entropy(const char *fn, const float *logits, const int *targets, int T,
                         int vocab, int ignore_index, const double *w, float k, float *dlogits,
                         double *row_loss, double *loss_out) {
    if (!logits || !targets || !loss_out)
        return rx_fail(RX_EINVAL, "%s: %s is NULL", fn,
                       !logits ? "logits" : !targets ? "targets" : "loss");
    if (T < 1 || vocab < 1)
        return rx_fail(RX_EINVAL, "%s: T = %d, vocab = %d must be >= 1", fn, T, vocab);
    const size_t TT = (size_t)T, V = (size_t)vocab;
    rx_spans in = {.n = 0}, out = {.n = 0};
    RX_SPAN_ADD(&in, "logits", logits, TT * V);
    RX_SPAN_ADD(&in, "targets", targets, TT);
    RX_SPAN_ADD(&in, "weight", w, TT);
    RX_SPAN_ADD(&out, "dlogits", dlogits, TT * V);
    RX_SPAN_ADD(&out, "row_loss", row_loss, TT);
    int rc = rx_spans_check(fn, &out, &in);
    if (rc != RX_OK) return rc;
    size_t n_valid = 0;
    rc = count_targets(fn, targets, TT, vocab, ignore_index, &n_valid);
    if (rc != RX_OK) return rc;
    if (n_valid == 0) {
        rx_fzero(dlogits, TT * V);
        if (row_loss) memset(row_loss, 0, TT * sizeof *row_loss);
        *loss_out = 0.0;
        return RX_OK;
    }
    const double scale = 1.0 / (double)n_valid;
    /* the fixed row blocks (rx_block_rows), each summed into its own slot
     * and the slots added in order: the loss has the same bits at any
     * thread count */
    const size_t rows = rx_block_rows(TT), np = rx_row_blocks(TT);
    double part[RX_MAX_ROW_BLOCKS];   /* 8 KiB on the stack: no allocation in a step */
    const int nt = (rx_in_parallel() || TT * V < RX_ROW_MIN_PAR) ? 1 : rx_max_threads();
    (void)nt; /* read only by the OpenMP pragma */
    /* each target is read once here and range-checked as read: a caller's
     * thread changing targets after the check above cannot index past V */
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1) reduction(| : bad)
    for (size_t p = 0; p < np; p++) {
        const size_t t0 = p * rows, t1 = t0 + rows < TT ? t0 + rows : TT;
        double acc = 0.0;
        for (size_t t = t0; t < t1; t++) {
            float *d = dlogits ? dlogits + t * V : NULL;
            const int y = __atomic_load_n(&targets[t], __ATOMIC_RELAXED);
            double l = 0.0;
            if (!ce_valid(y, ignore_index))
                rx_fzero(d, V);
            else if (y >= 0 && y < vocab)
                l = ce_row(logits + t * V, V, (size_t)y, d, w ? w[t] : scale, k);
            else
                bad = 1;
            if (row_loss) row_loss[t] = l;
            acc += l;
        }
        part[p] = acc;
    }
    double loss = 0.0;
    for (size_t p = 0; p < np; p++) loss += part[p];
    if (bad)   /* a thread of the caller's changed a target after the check */
        return rx_fail(RX_EINVAL, "%s: targets changed while being read", fn);
    *loss_out = loss * scale;
    return RX_OK;
}

/* logits, dlogits: [T][vocab] (dlogits NULL: the loss alone); targets: [T] */
int rx_cross_entropy(const float *logits, const int *targets, int T, int vocab,
                     int ignore_index, float *dlogits, double *loss) {
    rx_prof_push(RX_PROF_CE);
    int rc = cross_entropy("rx_cross_entropy", logits, targets, T, vocab, ignore_index, NULL,
                           1.0f, dlogits, NULL, loss);
    rx_prof_pop();
    return rc;
}

/* logits, dlogits: [T][vocab] (dlogits NULL: the losses alone); targets,
 * weight, row_loss: [T] */
int rx_cross_entropy_rows(const float *logits, const int *targets, int T, int vocab,
                          int ignore_index, const double *weight, float *dlogits,
                          double *row_loss) {
    return rx_cross_entropy_rows_k(logits, targets, T, vocab, ignore_index, weight, 1.0f,
                                   dlogits, row_loss);
}

/* logits, dlogits: [T][vocab]; targets, weight, row_loss: [T] */
int rx_cross_entropy_rows_k(const float *logits, const int *targets, int T, int vocab,
                            int ignore_index, const double *weight, float k, float *dlogits,
                            double *row_loss) {
    static const char *const fn = "rx_cross_entropy_rows";
    if (!row_loss) return rx_fail(RX_EINVAL, "%s: row_loss is NULL", fn);
    if (dlogits && !weight)
        return rx_fail(RX_EINVAL, "%s: dlogits needs the row weights (weight is NULL)", fn);
    double mean;
    rx_prof_push(RX_PROF_CE);
    int rc = cross_entropy(fn, logits, targets, T, vocab, ignore_index, weight, k, dlogits,
                           row_loss, &mean);
    rx_prof_pop();
    return rc;
}

/* logits: [T][vocab]; targets: [T] */
double rx_cross_entropy_forward(const float *logits, const int *targets, int T, int vocab,
                                int ignore_index) {
    double loss;
    return rx_cross_entropy(logits, targets, T, vocab, ignore_index, NULL, &loss) == RX_OK
               ? loss : NAN;
}

/* logits, dlogits: [T][vocab]; targets: [T]. dlogits is required; NaN-filled
 * on failure. */
double rx_cross_entropy_backward(const float *logits, const int *targets, int T, int vocab,
                                 int ignore_index, float *dlogits) {
    double loss;
    if (!dlogits) {
        rx_fail(RX_EINVAL, "rx_cross_entropy_backward: dlogits is NULL");
        return NAN;
    }
    if (rx_cross_entropy(logits, targets, T, vocab, ignore_index, dlogits, &loss) == RX_OK)
        return loss;
    if (T < 1 || vocab < 1) return NAN;
    rx_spans in = {.n = 0};
    RX_SPAN_ADD(&in, "logits", logits, (size_t)T * vocab);
    RX_SPAN_ADD(&in, "targets", targets, (size_t)T);
    rx_fnan_apart(dlogits, (size_t)T * (size_t)vocab, &in);
    return NAN;
}

/* ---- the head and loss over row chunks (docs/maths.md §Chunked head) ----
 * No [T][vocab] buffer: rows of x go through the head `rows` at a time into
 * two [rows][vocab] scratch buffers (logits, their grad). Every sum keeps
 * the unchunked order: a row's logits and dx are the same GEMM rows; the
 * loss adds each row into the slot of its fixed row block (rx_block_rows of
 * all T rows), in row order, whichever chunk it falls in; d_head sums the
 * chunks' x^T . dlogits in chunk order. */

int rx_head_chunk_rows(int vocab, int budget_floats) {
    if (vocab < 1) return 1;
    const int64_t b = budget_floats > 0 ? budget_floats : RX_HEAD_CHUNK_FLOATS;
    int64_t r = b / vocab;
    /* a multiple of the fp32 GEMM's K block (256), so d_head's sum over rows
     * runs over the same K blocks as one unchunked product */
    if (r >= 256) r = r / 256 * 256;
    return r < 1 ? 1 : r > INT32_MAX ? INT32_MAX : (int)r;
}

/* The L2Wrap grad of one row: d[am] += coef * l[am], am the row's first
 * argmax (RWKV-LM's L2Wrap: coef = factor / (B*T)). l, d: [V]. */
static void l2wrap_row(const float *l, float *d, size_t V, double coef) {
    const size_t am = first_argmax(l, V);
    d[am] = (float)((double)d[am] + coef * (double)l[am]);
}

void rx_l2wrap_rows(const float *logits, float *dlogits, size_t rows, size_t V, double coef) {
    if (coef == 0.0) return;
    const int nt = (rx_in_parallel() || rows * V < RX_ROW_MIN_PAR) ? 1 : rx_max_threads();
    (void)nt;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (size_t t = 0; t < rows; t++) l2wrap_row(logits + t * V, dlogits + t * V, V, coef);
}

/* x: [T][C]; head: [C][vocab]; targets: [T]; scratch: 2 * rows * vocab
 * floats; dx: [T][C] and d_head: [C][vocab] written (both NULL: the loss
 * alone). w, row_loss [T] (or NULL) as cross_entropy's. */
static int head_loss(const char *fn, const float *x, const float *head, const int *targets,
                     int T, int C, int vocab, int ignore_index, double l2wrap,
                     const double *w, float k, int rows, float *scratch, float *dx,
                     float *d_head, double *row_loss, double *loss_out) {
    if (!x || !head || !targets || !scratch || !loss_out)
        return rx_fail(RX_EINVAL, "%s: %s is NULL", fn,
                       !x ? "x" : !head ? "head" : !targets ? "targets" : !scratch ? "scratch"
                                                                                   : "loss");
    if (!dx != !d_head)
        return rx_fail(RX_EINVAL, "%s: dx and d_head must both be given or both be NULL", fn);
    if (T < 1 || C < 1 || vocab < 1 || rows < 1)
        return rx_fail(RX_EINVAL, "%s: T = %d, C = %d, vocab = %d, rows = %d must be >= 1", fn,
                       T, C, vocab, rows);
    if (!(l2wrap >= 0.0) || isinf(l2wrap))
        return rx_fail(RX_EINVAL, "%s: l2wrap = %g must be finite and >= 0", fn, l2wrap);
    const size_t TT = (size_t)T, CC = (size_t)C, V = (size_t)vocab;
    const size_t R = (size_t)rows < TT ? (size_t)rows : TT;
    float *lg = scratch, *dl = scratch + R * V;
    rx_spans in = {.n = 0}, out = {.n = 0};
    RX_SPAN_ADD(&in, "x", x, TT * CC);
    RX_SPAN_ADD(&in, "head", head, CC * V);
    RX_SPAN_ADD(&in, "targets", targets, TT);
    RX_SPAN_ADD(&in, "weight", w, TT);
    RX_SPAN_ADD(&out, "scratch", scratch, 2 * R * V);
    RX_SPAN_ADD(&out, "dx", dx, TT * CC);
    RX_SPAN_ADD(&out, "d_head", d_head, CC * V);
    RX_SPAN_ADD(&out, "row_loss", row_loss, TT);
    int rc = rx_spans_check(fn, &out, &in);
    if (rc != RX_OK) return rc;
    size_t n_valid = 0;
    rc = count_targets(fn, targets, TT, vocab, ignore_index, &n_valid);
    if (rc != RX_OK) return rc;
    const double scale = n_valid ? 1.0 / (double)n_valid : 0.0, coef = l2wrap / (double)TT;
    const size_t brows = rx_block_rows(TT), np = rx_row_blocks(TT);
    double part[RX_MAX_ROW_BLOCKS] = {0};   /* 8 KiB on the stack: no allocation in a step */
    int bad = 0;
    for (size_t r0 = 0; r0 < TT && rc == RX_OK; r0 += R) {
        const size_t n = TT - r0 < R ? TT - r0 : R;
        rc = rx_pgemm(0, 0, n, V, CC, x + r0 * CC, CC, head, V, 0.0f, lg, V);
        if (rc != RX_OK) break;
        /* the row blocks this chunk meets, each continuing its own slot */
        const size_t p0 = r0 / brows, p1 = (r0 + n - 1) / brows + 1;
        const int nt = (rx_in_parallel() || n * V < RX_ROW_MIN_PAR) ? 1 : rx_max_threads();
        (void)nt; /* read only by the OpenMP pragma */
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1) reduction(| : bad)
        for (size_t p = p0; p < p1; p++) {
            const size_t a = p * brows > r0 ? p * brows : r0;
            const size_t e = (p + 1) * brows < r0 + n ? (p + 1) * brows : r0 + n;
            double acc = part[p];
            for (size_t t = a; t < e; t++) {
                const float *l = lg + (t - r0) * V;
                float *d = dx ? dl + (t - r0) * V : NULL;
                const int y = __atomic_load_n(&targets[t], __ATOMIC_RELAXED);
                double lt = 0.0;
                if (!ce_valid(y, ignore_index))
                    rx_fzero(d, V);
                else if (y >= 0 && y < vocab)
                    lt = ce_row(l, V, (size_t)y, d, w ? w[t] : scale, k);
                else
                    bad = 1;
                if (row_loss) row_loss[t] = lt;
                acc += lt;
                if (d && coef != 0.0) l2wrap_row(l, d, V, coef);
            }
            part[p] = acc;
        }
        if (bad) break;
        if (dx) {
            const rx_gemm_op ops[2] = {
                {0, 1, n, CC, V, dl, V, head, V, 0.0f, dx + r0 * CC, CC},
                {1, 0, CC, V, n, x + r0 * CC, CC, dl, V, r0 ? 1.0f : 0.0f, d_head, V}};
            rc = rx_pgemm_batch(ops, 2);
        }
    }
    if (rc != RX_OK) return rc;
    if (bad)   /* a thread of the caller's changed a target after the check */
        return rx_fail(RX_EINVAL, "%s: targets changed while being read", fn);
    double loss = 0.0;
    for (size_t p = 0; p < np; p++) loss += part[p];
    *loss_out = loss * scale;
    return RX_OK;
}

int rx_head_loss(const float *x, const float *head, const int *targets, int T, int C,
                 int vocab, int ignore_index, double l2wrap, int rows, float *scratch,
                 float *dx, float *d_head, double *loss) {
    rx_prof_push(RX_PROF_CE);
    int rc = head_loss("rx_head_loss", x, head, targets, T, C, vocab, ignore_index, l2wrap,
                       NULL, 1.0f, rows, scratch, dx, d_head, NULL, loss);
    rx_prof_pop();
    return rc;
}

int rx_head_loss_rows(const float *x, const float *head, const int *targets, int T, int C,
                      int vocab, int ignore_index, double l2wrap, const double *weight,
                      int rows, float *scratch, float *dx, float *d_head, double *row_loss) {
    return rx_head_loss_rows_k(x, head, targets, T, C, vocab, ignore_index, l2wrap, weight, 1.0f,
                               rows, scratch, dx, d_head, row_loss);
}

/* x, dx: [T][C]; head, d_head: [C][vocab]; targets, weight, row_loss: [T] */
int rx_head_loss_rows_k(const float *x, const float *head, const int *targets, int T, int C,
                        int vocab, int ignore_index, double l2wrap, const double *weight,
                        float k, int rows, float *scratch, float *dx, float *d_head,
                        double *row_loss) {
    static const char *const fn = "rx_head_loss_rows";
    if (!row_loss) return rx_fail(RX_EINVAL, "%s: row_loss is NULL", fn);
    if (dx && !weight)
        return rx_fail(RX_EINVAL, "%s: dx needs the row weights (weight is NULL)", fn);
    double mean;
    rx_prof_push(RX_PROF_CE);
    int rc = head_loss(fn, x, head, targets, T, C, vocab, ignore_index, l2wrap, weight, k, rows,
                       scratch, dx, d_head, row_loss, &mean);
    rx_prof_pop();
    return rc;
}
