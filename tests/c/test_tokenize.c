/* Sanitizer test of csrc/tokenize.c: greedy longest match against a brute
 * force search over every entry, the threaded encoder (seams repaired)
 * against the serial one, pieces, documents, and the invalid-argument paths.
 * The vocabulary is random strings over a 5-letter alphabet, so entries
 * overlap heavily and speculative chunks start out of step. Returns nonzero
 * on failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rx_pretrain.h"
#include "rx_tokenize.h"

#define N_RANDOM 3000
#define N_BRUTE 20000        /* bytes checked against the brute force */
#define N_BIG 600000         /* bytes for the threaded encoder (> 64 KiB per thread) */

static unsigned long long rng = 88172645463325252ULL;
static unsigned rnd(unsigned n) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (unsigned)(rng % n);
}

typedef struct { uint8_t b[16]; int len; } entry;

static int cmp_entry(const void *pa, const void *pb) {
    const entry *a = pa, *b = pb;
    int c = memcmp(a->b, b->b, (size_t)(a->len < b->len ? a->len : b->len));
    return c ? c : (a->len > b->len) - (a->len < b->len);
}

int main(void) {
    static const char alpha[] = "ab =\n";
    entry *e = malloc((256 + N_RANDOM) * sizeof *e);
    int m = 0, fail = 0;
    for (int i = 0; i < 256; i++) e[m++] = (entry){{(uint8_t)i}, 1};
    for (int i = 0; i < N_RANDOM; i++) {
        entry x = {{0}, 2 + (int)rnd(12)};
        for (int j = 0; j < x.len; j++) x.b[j] = (uint8_t)alpha[rnd(5)];
        e[m++] = x;
    }
    qsort(e, (size_t)m, sizeof *e, cmp_entry);
    int u = 0;
    for (int i = 0; i < m; i++)
        if (!u || cmp_entry(&e[u - 1], &e[i])) e[u++] = e[i];
    m = u;
    int64_t *off = malloc((size_t)(m + 1) * sizeof *off);
    int32_t *ids = malloc((size_t)m * sizeof *ids);
    off[0] = 0;
    for (int i = 0; i < m; i++) off[i + 1] = off[i] + e[i].len;
    uint8_t *blob = malloc((size_t)off[m]);
    for (int i = 0; i < m; i++) {
        memcpy(blob + off[i], e[i].b, (size_t)e[i].len);
        ids[i] = m - 1 - i;  /* ids need not follow the byte order */
    }
    int err;
    rx_trie *t = rx_trie_build(blob, off, ids, m, m, &err);
    if (!t) {
        printf("build failed: %d\n", err);
        return 1;
    }

    uint8_t *x = malloc(N_BIG);
    for (int i = 0; i < N_BIG; i++) x[i] = (uint8_t)(rnd(50) ? alpha[rnd(5)] : rnd(256));
    int32_t *o1 = malloc(N_BIG * sizeof *o1), *o2 = malloc(N_BIG * sizeof *o2);
    int32_t *sc = malloc(N_BIG * sizeof *sc);
    int64_t c1, c2;

    /* serial encoder == brute-force longest match */
    int64_t k = rx_trie_encode(t, x, N_BRUTE, 1, 1, o1, NULL, &c1);
    int64_t p = 0, w = 0;
    while (p < N_BRUTE && !fail) {
        int best = -1;
        for (int i = 0; i < m; i++)
            if (p + e[i].len <= N_BRUTE && !memcmp(x + p, e[i].b, (size_t)e[i].len) &&
                (best < 0 || e[i].len > e[best].len))
                best = i;
        if (w >= k || o1[w] != ids[best]) {
            printf("brute force differs at byte %lld\n", (long long)p);
            fail = 1;
        }
        p += e[best].len;
        w++;
    }
    if (!fail && (w != k || c1 != N_BRUTE)) fail = printf("token count %lld != %lld\n",
                                                           (long long)k, (long long)w) > 0;

    /* threads, final and piece mode, equal the serial encoding */
    for (int fin = 0; fin < 2 && !fail; fin++) {
        int64_t k1 = rx_trie_encode(t, x, N_BIG, fin, 1, o1, NULL, &c1);
        if (!fin && (c1 < N_BIG - rx_trie_max_len(t) + 1 || c1 > N_BIG)) fail = 1;
        for (int th = 2; th <= 8 && !fail; th++) {
            int64_t k2 = rx_trie_encode(t, x, N_BIG, fin, th, o2, sc, &c2);
            if (k1 != k2 || c1 != c2 || memcmp(o1, o2, (size_t)k1 * sizeof *o1)) {
                printf("threads %d final %d differ from serial\n", th, fin);
                fail = 1;
            }
        }
    }

    /* documents: each encoded alone, packed back to back */
    int64_t docs[6] = {0, 10, 10, 70000, 300001, N_BIG}, cnt[5];
    int64_t kd = rx_trie_encode_docs(t, x, docs, 5, 3, o2, cnt);
    int64_t at = 0;
    for (int d = 0; d < 5 && !fail; d++) {
        int64_t kk = rx_trie_encode(t, x + docs[d], docs[d + 1] - docs[d], 1, 1, o1, NULL, &c1);
        if (kk != cnt[d] || memcmp(o1, o2 + at, (size_t)kk * sizeof *o1)) {
            printf("document %d differs\n", d);
            fail = 1;
        }
        at += kk;
    }
    if (at != kd) fail = 1;

    /* invalid arguments */
    if (rx_trie_encode(NULL, x, 10, 1, 1, o1, NULL, &c1) != RX_EINVAL) fail = 1;
    if (rx_trie_encode(t, x, 0, 1, 1, o1, NULL, &c1) != 0 || c1 != 0) fail = 1;
    if (rx_trie_encode(t, x, 5, 0, 1, o1, NULL, &c1) != 0 || c1 != 0) fail = 1;  /* < max_len */
    int64_t bad_docs[3] = {0, 20, 10};
    if (rx_trie_encode_docs(t, x, bad_docs, 2, 1, o2, cnt) != RX_EINVAL) fail = 1;
    if (rx_trie_token_len(t, -1) != -1 || rx_trie_token_len(t, m) != -1) fail = 1;
    int32_t tmp_id = ids[0];
    ids[0] = m + 5;         /* id out of range */
    if (rx_trie_build(blob, off, ids, m, m, &err) || err != RX_EINVAL) fail = 1;
    ids[0] = tmp_id;
    /* the first 256 entries in byte order dropped: some single bytes are missing */
    if (rx_trie_build(blob, off + 256, ids, m - 256, m, &err) || err != RX_EINVAL) fail = 1;
    /* entries 300 and 301 swapped: not in increasing byte order */
    entry keep = e[300];
    e[300] = e[301];
    e[301] = keep;
    for (int i = 0; i < m; i++) {
        off[i + 1] = off[i] + e[i].len;
        memcpy(blob + off[i], e[i].b, (size_t)e[i].len);
    }
    if (rx_trie_build(blob, off, ids, m, m, &err) || err != RX_EINVAL) fail = 1;
    rx_trie_free(t);
    rx_trie_free(NULL);
    free(e), free(off), free(ids), free(blob), free(x), free(o1), free(o2), free(sc);
    if (fail) printf("test_tokenize: FAILED\n");
    return fail;
}
