/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * tokenize.c -- greedy longest-match encoding over a byte trie (rx_tokenize.h).
 *
 * Layout: nodes in creation order, node 0 the root. The root's children are a
 * dense [256] table (every encode step starts there); every other node's
 * children are a run of edges sorted by byte (edge_start[u] ..
 * edge_start[u+1]), found by a linear scan when short and a binary search
 * when long. value[u] is the id of the entry ending at u, or -1.
 *
 * Parallel encoding of one text: the text is cut into P chunks, each thread
 * encodes its chunk speculatively as if a token started at the cut, then a
 * serial pass walks the seams: the true encoding coming from the left either
 * lands on a token start of the speculative encoding (from there the two are
 * identical, since greedy matching depends only on the position) or is
 * continued token by token until it does. Greedy encodings resynchronise
 * within a few tokens, so the serial pass is short.
 */
#include <stdlib.h>
#include <string.h>

#include "rx_internal.h"
#include "rx_tokenize.h"

#define ROOT_FANOUT 256
#define LINEAR_SCAN_MAX 8        /* children scanned linearly up to this many */
#define DENSE_MIN_CHILDREN 24    /* nodes with this many children get a [256] row */
#define MIN_CHUNK_BYTES 65536    /* below this per thread, encode serially */

struct rx_trie {
    int32_t n_nodes;
    int32_t vocab;
    int32_t max_len;
    int32_t root[ROOT_FANOUT];  /* child of the root per byte, -1 none */
    int32_t *value;             /* [n_nodes] id of the entry ending here, -1 none */
    int32_t *edge_start;        /* [n_nodes + 1] */
    uint8_t *edge_byte;         /* [n_edges] sorted within each node */
    int32_t *edge_node;         /* [n_edges] */
    int32_t *tok_len;           /* [vocab] byte length of each id, 0 when unused */
    int32_t *dense_row;         /* [n_nodes] row of `dense` for wide nodes, -1 others */
    int32_t *dense;             /* [n_dense][256] child per byte, -1 none */
};

void rx_trie_free(rx_trie *t) {
    if (!t) return;
    free(t->value);
    free(t->edge_start);
    free(t->edge_byte);
    free(t->edge_node);
    free(t->tok_len);
    free(t->dense_row);
    free(t->dense);
    free(t);
}

int32_t rx_trie_max_len(const rx_trie *t) { return t ? t->max_len : -1; }

int32_t rx_trie_token_len(const rx_trie *t, int32_t id) {
    return (!t || id < 0 || id >= t->vocab) ? -1 : t->tok_len[id];
}

/* -1 when a sorts before b, 0 equal, 1 after (byte-lexicographic). */
static int cmp_bytes(const uint8_t *a, int64_t na, const uint8_t *b, int64_t nb) {
    int64_t n = na < nb ? na : nb;
    int c = memcmp(a, b, (size_t)n);
    if (c) return c < 0 ? -1 : 1;
    return na < nb ? -1 : (na > nb);
}

rx_trie *rx_trie_build(const uint8_t *bytes, const int64_t *offsets, const int32_t *ids,
                       int64_t n_tok, int32_t vocab, int *err) {
    static const char *const fn = "rx_trie_build";
    if (!bytes || !offsets || !ids || n_tok < ROOT_FANOUT || vocab < 1) {
        *err = rx_fail(RX_EINVAL, "%s: a NULL array, n_tok = %lld < %d or vocab = %d < 1", fn,
                       (long long)n_tok, ROOT_FANOUT, vocab);
        return NULL;
    }
    int64_t total = offsets[n_tok] - offsets[0];
    if (total + 1 > INT32_MAX) {
        *err = rx_fail(RX_EINVAL, "%s: %lld entry bytes exceed 2**31 - 2", fn, (long long)total);
        return NULL;
    }
    for (int64_t i = 0; i < n_tok; i++) {
        int64_t len = offsets[i + 1] - offsets[i];
        if (len < 1 || len > INT32_MAX || ids[i] < 0 || ids[i] >= vocab) {
            *err = rx_fail(RX_EINVAL, "%s: entry %lld is empty, too long or has id %d outside "
                           "[0, %d)", fn, (long long)i, ids[i], vocab);
            return NULL;
        }
        if (i && cmp_bytes(bytes + offsets[i - 1], offsets[i] - offsets[i - 1],
                           bytes + offsets[i], len) >= 0) {
            *err = rx_fail(RX_EINVAL, "%s: entry %lld is not after entry %lld in byte order",
                           fn, (long long)i, (long long)i - 1);
            return NULL;
        }
    }
    rx_trie *t = calloc(1, sizeof(rx_trie));
    size_t cap = (size_t)total + 1;  /* at most one node per entry byte, plus the root */
    int32_t *parent = malloc(cap * sizeof(int32_t));
    int32_t *last_child = malloc(cap * sizeof(int32_t));
    uint8_t *in_byte = malloc(cap);
    if (t) {
        t->value = malloc(cap * sizeof(int32_t));
        t->tok_len = calloc((size_t)vocab, sizeof(int32_t));
    }
    if (!t || !parent || !last_child || !in_byte || !t->value || !t->tok_len) goto fail;
    t->vocab = vocab;
    for (int b = 0; b < ROOT_FANOUT; b++) t->root[b] = -1;
    /* Entries arrive sorted, so a node's children are created in byte order
     * and the child an entry shares with the previous one is always the
     * parent's most recent child. */
    int32_t n = 1;
    parent[0] = -1;
    last_child[0] = -1;
    t->value[0] = -1;
    for (int64_t i = 0; i < n_tok; i++) {
        const uint8_t *s = bytes + offsets[i];
        int32_t len = (int32_t)(offsets[i + 1] - offsets[i]), u = 0;
        for (int32_t j = 0; j < len; j++) {
            int32_t c = last_child[u];
            if (c < 0 || in_byte[c] != s[j]) {
                c = n++;
                parent[c] = u;
                in_byte[c] = s[j];
                last_child[c] = -1;
                t->value[c] = -1;
                last_child[u] = c;
            }
            u = c;
        }
        t->value[u] = ids[i];
        t->tok_len[ids[i]] = len;
        if (len > t->max_len) t->max_len = len;
    }
    t->n_nodes = n;
    /* children of each node as a sorted run of edges: counting sort by parent
     * (stable, and creation order is byte order within a parent) */
    t->edge_start = calloc((size_t)n + 1, sizeof(int32_t));
    t->edge_byte = malloc((size_t)n);
    t->edge_node = malloc((size_t)n * sizeof(int32_t));
    if (!t->edge_start || !t->edge_byte || !t->edge_node) goto fail;
    for (int32_t c = 1; c < n; c++) t->edge_start[parent[c] + 1]++;
    for (int32_t u = 0; u < n; u++) t->edge_start[u + 1] += t->edge_start[u];
    memcpy(last_child, t->edge_start, (size_t)n * sizeof(int32_t));  /* fill cursors */
    for (int32_t c = 1; c < n; c++) {
        int32_t e = last_child[parent[c]]++;
        t->edge_byte[e] = in_byte[c];
        t->edge_node[e] = c;
        if (parent[c] == 0) t->root[in_byte[c]] = c;
    }
    free(parent);
    free(last_child);
    free(in_byte);
    parent = last_child = NULL;
    in_byte = NULL;
    /* wide nodes (near the root, where most lookups happen) get a dense row */
    int32_t n_dense = 0;
    t->dense_row = malloc((size_t)n * sizeof(int32_t));
    if (!t->dense_row) goto fail;
    for (int32_t u = 0; u < n; u++)
        t->dense_row[u] = t->edge_start[u + 1] - t->edge_start[u] >= DENSE_MIN_CHILDREN
                          ? n_dense++ : -1;
    t->dense = malloc(((size_t)n_dense * ROOT_FANOUT + 1) * sizeof(int32_t));
    if (!t->dense) goto fail;
    for (int32_t u = 0; u < n; u++) {
        if (t->dense_row[u] < 0) continue;
        int32_t *row = t->dense + (size_t)t->dense_row[u] * ROOT_FANOUT;
        for (int b = 0; b < ROOT_FANOUT; b++) row[b] = -1;
        for (int32_t e = t->edge_start[u]; e < t->edge_start[u + 1]; e++)
            row[t->edge_byte[e]] = t->edge_node[e];
    }
    for (int b = 0; b < ROOT_FANOUT; b++) {
        if (t->root[b] < 0 || t->value[t->root[b]] < 0) {  /* a byte no entry covers */
            rx_trie_free(t);
            *err = rx_fail(RX_EINVAL, "%s: byte 0x%02x has no one-byte entry (all 256 need one)",
                           fn, b);
            return NULL;
        }
    }
    *err = RX_OK;
    return t;
fail:
    free(parent);
    free(last_child);
    free(in_byte);
    rx_trie_free(t);
    *err = rx_fail(RX_ENOMEM, "%s: out of memory for %lld entries", fn, (long long)n_tok);
    return NULL;
}

static inline int32_t child(const rx_trie *t, int32_t u, uint8_t b) {
    if (t->dense_row[u] >= 0) return t->dense[(size_t)t->dense_row[u] * ROOT_FANOUT + b];
    int32_t lo = t->edge_start[u], hi = t->edge_start[u + 1];
    if (hi - lo <= LINEAR_SCAN_MAX) {
        for (int32_t e = lo; e < hi; e++)
            if (t->edge_byte[e] == b) return t->edge_node[e];
        return -1;
    }
    while (lo < hi) {
        int32_t mid = (lo + hi) >> 1;
        if (t->edge_byte[mid] < b) lo = mid + 1;
        else hi = mid;
    }
    return (lo < t->edge_start[u + 1] && t->edge_byte[lo] == b) ? t->edge_node[lo] : -1;
}

/* Longest entry at x[p..n): its id, length in *len (>= 1: every byte is an entry). */
static inline int32_t match(const rx_trie *t, const uint8_t *x, int64_t p, int64_t n,
                            int32_t *len) {
    int32_t u = t->root[x[p]];
    int32_t best = t->value[u], blen = 1;
    for (int64_t q = p + 1; q < n; q++) {
        u = child(t, u, x[q]);
        if (u < 0) break;
        if (t->value[u] >= 0) {
            best = t->value[u];
            blen = (int32_t)(q - p + 1);
        }
    }
    *len = blen;
    return best;
}

/* Encode tokens starting in [p, stop) of x[..n) into out; *end gets the
 * position after the last token. Returns the count. */
static int64_t encode_span(const rx_trie *t, const uint8_t *x, int64_t n, int64_t p,
                           int64_t stop, int32_t *out, int64_t *end) {
    int64_t w = 0;
    while (p < stop) {
        int32_t len;
        out[w++] = match(t, x, p, n, &len);
        p += len;
    }
    *end = p;
    return w;
}

int64_t rx_trie_encode(const rx_trie *t, const uint8_t *x, int64_t n, int final, int nthreads,
                       int32_t *out, int32_t *scratch, int64_t *consumed) {
    if (!t || n < 0 || (n && (!x || !out)) || !consumed)
        return rx_fail(RX_EINVAL, "rx_trie_encode: a NULL argument or n = %lld < 0", (long long)n);
    int64_t limit = final ? n : n - t->max_len + 1;  /* tokens must start before it */
    *consumed = 0;
    if (limit <= 0) return 0;
    int64_t P = nthreads > 1 && scratch ? nthreads : 1;
    if (limit / MIN_CHUNK_BYTES < P) P = limit / MIN_CHUNK_BYTES > 1 ? limit / MIN_CHUNK_BYTES : 1;
    if (P == 1) return encode_span(t, x, n, 0, limit, out, consumed);

    int64_t *cnt = malloc((size_t)P * 2 * sizeof(int64_t));
    if (!cnt) return rx_fail(RX_ENOMEM, "rx_trie_encode: out of memory");
    int64_t *end = cnt + P;
    /* chunk k covers token starts [b(k), b(k+1)); chunk 0 is exact and goes
     * straight to out, the others to scratch at their own offset (a chunk
     * has no more tokens than bytes) */
#define B_(k) (limit * (k) / P)
#pragma omp parallel for schedule(static, 1) num_threads((int)P)
    for (int64_t k = 0; k < P; k++)
        cnt[k] = encode_span(t, x, n, B_(k), B_(k + 1), (k ? scratch : out) + B_(k), &end[k]);
    int64_t w = cnt[0], cur = end[0];
    for (int64_t k = 1; k < P; k++) {
        const int32_t *s = scratch + B_(k);
        int64_t p = B_(k), i = 0, stop = B_(k + 1);
        while (cur < stop) {
            while (i < cnt[k] && p < cur) p += t->tok_len[s[i++]];
            if (p == cur) {  /* in step with the speculative encoding from here on */
                memmove(out + w, s + i, (size_t)(cnt[k] - i) * sizeof(int32_t));
                w += cnt[k] - i;
                cur = end[k];
                break;
            }
            int32_t len;
            out[w++] = match(t, x, cur, n, &len);
            cur += len;
        }
    }
#undef B_
    free(cnt);
    *consumed = cur;
    return w;
}

int64_t rx_trie_encode_docs(const rx_trie *t, const uint8_t *x, const int64_t *offsets,
                            int64_t n_doc, int nthreads, int32_t *out, int64_t *counts) {
    static const char *const fn = "rx_trie_encode_docs";
    if (!t || n_doc < 0 || (n_doc && (!offsets || !counts)))
        return rx_fail(RX_EINVAL, "%s: a NULL argument or n_doc = %lld < 0", fn, (long long)n_doc);
    for (int64_t d = 0; d < n_doc; d++)
        if (offsets[d + 1] < offsets[d])
            return rx_fail(RX_EINVAL, "%s: offsets decrease at document %lld", fn, (long long)d);
    if (n_doc && offsets[n_doc] > offsets[0] && (!x || !out))
        return rx_fail(RX_EINVAL, "%s: x or out is NULL", fn);
    /* each document writes at its own byte offset (ids <= bytes), then the
     * runs are packed left, which never overwrites a run not yet moved */
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads > 1 ? nthreads : 1)
    for (int64_t d = 0; d < n_doc; d++) {
        int64_t e;
        int64_t o = offsets[d] - offsets[0];
        counts[d] = encode_span(t, x, offsets[d + 1], offsets[d], offsets[d + 1], out + o, &e);
    }
    int64_t w = 0;
    for (int64_t d = 0; d < n_doc; d++) {
        memmove(out + w, out + (offsets[d] - offsets[0]), (size_t)counts[d] * sizeof(int32_t));
        w += counts[d];
    }
    return w;
}
