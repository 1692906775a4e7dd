/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * embedding.c -- token embedding: a gather forward, a scatter-add backward.
 *
 * rx_embedding_gather and rx_embedding_scatter return a code. The original
 * API's void forms cannot, so a bad argument shows up in their output
 * instead: a row that cannot be gathered is NaN (never an out-of-bounds
 * read), a backward with a missing input fills d_emb with NaN.
 */
#include <string.h>

#include "rx_internal.h"

#define EMB_MIN_SLICE 16 /* floats: one 64-byte line */

/* emb: [vocab][C] in float32, or b: the same rows in a frozen base (then
 * emb is NULL); tokens: [T]; out: [T][C]. A token outside [0, vocab)
 * (vocab < 0: unknown, only negative ids caught), or no emb or tokens,
 * yields NaN rows; returns how many rows those were. */
static size_t gather(const float *emb, const rx_base_mat *b, const int *tokens, int T, int C,
                     int vocab, float *out) {
    const size_t TT = (size_t)T, CC = (size_t)C;
    size_t bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad) \
    if (!rx_in_parallel() && TT * CC >= RX_EW_MIN_PAR)
    for (size_t t = 0; t < TT; t++) {
        float *o = out + t * CC;
        /* one read: the id checked is the id gathered */
        const int tok = tokens ? __atomic_load_n(&tokens[t], __ATOMIC_RELAXED) : -1;
        if ((!emb && !b) || tok < 0 || (vocab >= 0 && tok >= vocab)) {
            rx_fnan(o, CC);
            bad++;
            continue;
        }
        if (b)
            rx_base_row(b, (size_t)tok, o);
        else
            memcpy(o, emb + (size_t)tok * CC, CC * sizeof(float));
    }
    return bad;
}

/* gather()'s result as a code: the first bad id named (it may have changed since) */
static int gathered(const char *fn, size_t bad, const int *tokens, int T, int vocab) {
    if (bad == 0) return RX_OK;
    for (int t = 0; t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= vocab)
            return rx_fail(RX_EINVAL, "%s: token %d at position %d is outside [0, %d)", fn,
                           tokens[t], t, vocab);
    return rx_fail(RX_EINVAL, "%s: tokens changed while being read", fn);
}

int rx_embedding_gather(const float *emb, const int *tokens, int T, int C, int vocab,
                        float *out) {
    static const char *const fn = "rx_embedding_gather";
    if (!emb || !tokens || !out)
        return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, !emb ? "emb" : !tokens ? "tokens" : "out");
    if (T < 1 || C < 1 || vocab < 1)
        return rx_fail(RX_EINVAL, "%s: T = %d, C = %d, vocab = %d must be >= 1", fn, T, C, vocab);
    rx_spans in = {.n = 0}, o = {.n = 0};
    RX_SPAN_ADD(&in, "emb", emb, (size_t)vocab * C);
    RX_SPAN_ADD(&in, "tokens", tokens, (size_t)T);
    RX_SPAN_ADD(&o, "out", out, (size_t)T * C);
    int rc = rx_spans_check(fn, &o, &in);
    if (rc != RX_OK) return rc;
    return gathered(fn, gather(emb, NULL, tokens, T, C, vocab, out), tokens, T, vocab);
}

/* the model's own call (model.c): b, T, C and vocab are the model's */
int rx_embedding_gather_base(const rx_base_mat *b, const int *tokens, int T, int C, int vocab,
                             float *out) {
    static const char *const fn = "rx_embedding_gather";
    if (!b || !tokens || !out)
        return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, !b ? "emb" : !tokens ? "tokens" : "out");
    return gathered(fn, gather(NULL, b, tokens, T, C, vocab, out), tokens, T, vocab);
}

void rx_embedding_forward(const float *emb, const int *tokens, int T, int C, float *out) {
    if (out && T >= 1 && C >= 1) gather(emb, NULL, tokens, T, C, -1, out);
}

/* tokens: [T]; d_out: [T][C]; d_emb: [vocab][C], zeroed then scatter-added.
 * Tokens outside [0, vocab) contribute nothing. */
static void scatter(const int *tokens, int T, int C, int vocab, const float *d_out,
                    float *d_emb) {
    const size_t TT = (size_t)T, CC = (size_t)C, V = (size_t)vocab;
    /* Threads own disjoint channel slices of every row, so repeated tokens
     * never race and each element is summed in token order (deterministic). */
    int nt = (rx_in_parallel() || (V + TT) * CC < RX_EW_MIN_PAR) ? 1 : rx_max_threads();
    /* a slice of at least a cache line: a wide team would otherwise share
     * every written line among several threads (4 floats each at C = 256
     * and 64 threads) */
    if ((size_t)nt > CC / EMB_MIN_SLICE) nt = CC >= EMB_MIN_SLICE ? (int)(CC / EMB_MIN_SLICE) : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        const size_t p = (size_t)rx_thread_id(), n = (size_t)rx_team_size();
        /* zeroed as one contiguous run per thread: row slices, one short
         * memset per row, ran at under half the speed (V = 65536, C = 256) */
        memset(d_emb + V * p / n * CC, 0, (V * (p + 1) / n - V * p / n) * CC * sizeof(float));
#pragma omp barrier
        size_t c0 = CC * p / n, c1 = CC * (p + 1) / n;
        for (size_t t = 0; t < TT; t++) {
            int tok = tokens[t];
            if (tok < 0 || tok >= vocab) continue;
            float *de = d_emb + (size_t)tok * CC;
            const float *g = d_out + t * CC;
            for (size_t c = c0; c < c1; c++) de[c] += g[c];
        }
    }
}

/* RX_OK when d_emb [vocab][C] shares no memory with tokens [T] or d_out
 * [T][C]; else RX_EINVAL naming fn (rx_spans_check) */
static int scatter_apart(const char *fn, const int *tokens, int T, int C, int vocab,
                         const float *d_out, const float *d_emb) {
    rx_spans in = {.n = 0}, out = {.n = 0};
    RX_SPAN_ADD(&in, "tokens", tokens, (size_t)T);
    RX_SPAN_ADD(&in, "d_out", d_out, (size_t)T * C);
    RX_SPAN_ADD(&out, "d_emb", d_emb, (size_t)vocab * C);
    return rx_spans_check(fn, &out, &in);
}

int rx_embedding_scatter(const int *tokens, int T, int C, int vocab, const float *d_out,
                         float *d_emb) {
    static const char *const fn = "rx_embedding_scatter";
    if (!tokens || !d_out || !d_emb)
        return rx_fail(RX_EINVAL, "%s: %s is NULL", fn,
                       !tokens ? "tokens" : !d_out ? "d_out" : "d_emb");
    if (T < 1 || C < 1 || vocab < 1)
        return rx_fail(RX_EINVAL, "%s: T = %d, C = %d, vocab = %d must be >= 1", fn, T, C, vocab);
    int rc = scatter_apart(fn, tokens, T, C, vocab, d_out, d_emb);
    if (rc != RX_OK) return rc;
    for (int t = 0; t < T; t++)
        if (tokens[t] < 0 || tokens[t] >= vocab)
            return rx_fail(RX_EINVAL, "%s: token %d at position %d is outside [0, %d)", fn,
                           tokens[t], t, vocab);
    scatter(tokens, T, C, vocab, d_out, d_emb);
    return RX_OK;
}

void rx_embedding_backward(const int *tokens, int T, int C, int vocab, const float *d_out,
                           float *d_emb) {
    if (!d_emb || C < 1 || vocab < 1) return;
    if (!tokens || !d_out || T < 1) {
        rx_fnan(d_emb, (size_t)vocab * (size_t)C);
        return;
    }
    /* refused (rx_last_error says why): d_emb is left as it is, the input
     * it overlaps intact */
    if (scatter_apart("rx_embedding_backward", tokens, T, C, vocab, d_out, d_emb) == RX_OK)
        scatter(tokens, T, C, vocab, d_out, d_emb);
}
