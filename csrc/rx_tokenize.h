/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * rx_tokenize.h -- greedy longest-match tokenizer over a byte trie (the rule
 * of the RWKV "World" tokenizer): at each position, emit the id of the
 * longest vocabulary entry that is a prefix of the remaining bytes.
 *
 * Every function returns RX_OK / RX_ENOMEM / RX_EINVAL (rx_pretrain.h) or a
 * count >= 0, a failure with its rx_last_error() message; none allocates
 * inside an encode call except rx_trie_build.
 */
#ifndef RX_TOKENIZE_H
#define RX_TOKENIZE_H

#include <stdint.h>

typedef struct rx_trie rx_trie;

/* Build a trie of n_tok entries. Entry i is the byte string
 * bytes[offsets[i] .. offsets[i+1]) with id ids[i] in [0, vocab). Entries
 * must be non-empty and in strictly increasing byte-lexicographic order, and
 * all 256 one-byte strings must be present (so any input can be encoded).
 * *err receives RX_OK, RX_ENOMEM or RX_EINVAL; NULL on error. */
rx_trie *rx_trie_build(const uint8_t *bytes, const int64_t *offsets, const int32_t *ids,
                       int64_t n_tok, int32_t vocab, int *err);
void rx_trie_free(rx_trie *t);
/* Longest entry in bytes (the lookahead a streaming caller must keep). */
int32_t rx_trie_max_len(const rx_trie *t);
/* Byte length of id (0 for an id with no entry, -1 out of range). */
int32_t rx_trie_token_len(const rx_trie *t, int32_t id);

/* x: [n] bytes -> out: [<= n] ids. final != 0: encode all of x. final == 0:
 * x is a piece of a longer text; only tokens that start before
 * n - max_len + 1 are emitted (their match cannot depend on later bytes), and
 * *consumed says where the next piece must start. Splits the text over
 * nthreads threads and repairs the seams (exact: the result equals the
 * serial encoding). scratch: [n] ids, used when nthreads > 1. Returns the
 * number of ids, or RX_EINVAL. */
int64_t rx_trie_encode(const rx_trie *t, const uint8_t *x, int64_t n, int final, int nthreads,
                       int32_t *out, int32_t *scratch, int64_t *consumed);

/* n_doc documents, document d being x[offsets[d] .. offsets[d+1]); each is
 * encoded on its own (no token crosses a document end), documents spread
 * over nthreads threads. out: [offsets[n_doc]] receives every document's ids
 * back to back, counts: [n_doc] the number of ids of each. Returns the total
 * number of ids, or RX_EINVAL. */
int64_t rx_trie_encode_docs(const rx_trie *t, const uint8_t *x, const int64_t *offsets,
                            int64_t n_doc, int nthreads, int32_t *out, int64_t *counts);

#endif
