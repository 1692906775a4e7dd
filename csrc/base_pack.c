/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * base_pack.c -- the frozen base as a B operand of the GEMMs (rx_base_source):
 * a product reading a base tensor has its op(B) packed here from the store,
 * in the fp32 GEMM's slivers or the bf16 GEMM's blocks, each value decoded
 * exactly (and, for the bf16 GEMM, rounded as it rounds its operands) by
 * the dtype's kernels (rx_base_types). The GEMMs never name the base: they
 * call rx_base_source's functions on the op's bsrc_of, a base tensor.
 */
#include "rx_base.h"
#include "rx_simd.h"

/* b's store when it is rx_bgemm's packed op(B) of a forward product of
 * N x K (b's out x in), else NULL */
static const uint16_t *packed(const void *src, size_t N, size_t K) {
    const rx_base_mat *b = src;
    return b && b->packed && N == b->out && K == b->in ? (const uint16_t *)(const void *)b->data
                                                       : NULL;
}

/* rx_sgemm's packed B sliver layout: op(B) rows [p0,p0+kc) x columns
 * [j0,j0+nc) as nr-column slivers, k-major, zero past nc; op(B) = W (tb 0)
 * or W^T (tb 1). Forward (W): a sliver column j is stored row j, read
 * along k; dX (W^T): a k row is stored row k, read along j. */
static void pack_f32(const void *src, int tb, size_t p0, size_t kc, size_t j0, size_t nc,
                     size_t nr, float *Bp) {
    const rx_base_mat *b = src;
    const rx_base_type *ty = b->ty;
    const size_t rb = rx_base_type_row_bytes(ty, b->in);
    float run[256];   /* one decoded run of a row, k or j */
    for (size_t s = 0; s < nc; s += nr, Bp += nr * kc) {
        const size_t w = nc - s < nr ? nc - s : nr;
        if (b->packed) {   /* read by element: the bf16 GEMM's layout, at fp32 precision */
            for (size_t p = 0; p < kc; p++)
                for (size_t j = 0; j < nr; j++)
                    Bp[p * nr + j] = j >= w ? 0.0f
                                   : tb     ? rx_base_at_jk(b, p0 + p, j0 + s + j)
                                            : rx_base_at_jk(b, j0 + s + j, p0 + p);
        } else if (!tb && ty->sliver_f32 && w == nr && nr <= 64 &&
                   ty->sliver_f32(b->data, rb, j0 + s, p0, kc, nr, Bp)) {
            continue;
        } else if (!tb) {
            for (size_t j = 0; j < nr; j++) {
                if (j >= w) {
                    for (size_t p = 0; p < kc; p++) Bp[p * nr + j] = 0.0f;
                    continue;
                }
                const unsigned char *row = b->data + (j0 + s + j) * rb;
                for (size_t q = 0; q < kc; q += 256) {
                    const size_t n = kc - q < 256 ? kc - q : 256;
                    ty->decode(row, p0 + q, n, run);
                    for (size_t p = 0; p < n; p++) Bp[(q + p) * nr + j] = run[p];
                }
            }
        } else {
            for (size_t p = 0; p < kc; p++) {
                float *dst = Bp + p * nr;
                ty->decode(b->data + (p0 + p) * rb, j0 + s, w, dst);
                for (size_t j = w; j < nr; j++) dst[j] = 0.0f;
            }
        }
    }
}

/* (e0, e1, e2, e3) -> (e0, e2, e1, e3): 16-bit elements of a 64-bit word */
static inline uint64_t swap_mid16(uint64_t x) {
    return (x & 0xffff00000000ffffull) | (x >> 16 & 0x00000000ffff0000ull) |
           (x << 16 & 0x0000ffff00000000ull);
}

#ifdef RX_BASE_X86
/* pack_packed's 8 x 8 transpose of 64-bit words (rows of 64 bytes, RX_BT_K
 * bf16 apart) with swap_mid16 on each word */
RX_BASE512 static void transpose8_512(const uint16_t *src, uint16_t *dst) {
    const __m512i mid = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15));
    __m512i r[8], t[8], u[8];
    for (int i = 0; i < 8; i++)
        r[i] = _mm512_shuffle_epi8(_mm512_loadu_si512(src + i * RX_BT_K), mid);
    for (int i = 0; i < 8; i += 2) {   /* t[i]: words 0, 2, 4, 6 of rows i, i+1; t[i+1]: odd */
        t[i] = _mm512_unpacklo_epi64(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi64(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)     /* 128-bit lanes 0, 2 (0x88) and 1, 3 (0xdd) */
        for (int o = 0; o < 2; o++) {
            u[i + 2 * o] = _mm512_shuffle_i64x2(t[i + o], t[i + o + 2], 0x88);
            u[i + 2 * o + 1] = _mm512_shuffle_i64x2(t[i + o], t[i + o + 2], 0xdd);
        }
    /* u[0..3]: rows 0-3 of words {0,4}, {2,6}, {1,5}, {3,7}; u[4..7]: rows 4-7 */
    static const int word[4][2] = {{0, 4}, {2, 6}, {1, 5}, {3, 7}};
    for (int i = 0; i < 4; i++) {
        _mm512_storeu_si512(dst + word[i][0] * RX_BT_K, _mm512_shuffle_i64x2(u[i], u[i + 4], 0x88));
        _mm512_storeu_si512(dst + word[i][1] * RX_BT_K, _mm512_shuffle_i64x2(u[i], u[i + 4], 0xdd));
    }
}
#endif

/* pack_bf16 from a packed store (whose layout is the GEMM's, so
 * nkc and the blocks of op(B) are the store's, padding included).
 * Forward: the store's blocks as they are (the GEMM normally reads them in
 * place, packed). dX, op(B) = W^T (N = in, K = out): block (cb,
 * kc) holds in [16 cb, +16) x out [32 kc, +32); row q of it (out pair
 * 32 kc + 2q, +1) is, in word pairs, word q % 8 of rows 8 (cb % 2) + [0, 8)
 * of the store's block (out / 16, in / 32) with its middle halves swapped:
 * an 8 x 8 transpose of 64-bit words per half. */
static void pack_packed(const rx_base_mat *b, int tb, size_t nkc, size_t cb0, size_t cb1,
                        size_t kc0, size_t kc1, uint16_t *bp) {
    enum { E = RX_BT_R * RX_BT_K, W = RX_BT_K / 4 };   /* a block; 64-bit words a row */
    const uint16_t *st = (const uint16_t *)(const void *)b->data;
    for (size_t cb = cb0; cb < cb1; cb++)
        for (size_t kc = kc0; kc < kc1; kc++) {
            uint16_t *dst = bp + (cb * nkc + kc) * E;
            if (!tb) {
                memcpy(dst, st + (cb * b->nkc + kc) * E, E * sizeof *dst);
                continue;
            }
            for (size_t h = 0; h < 2; h++) {   /* out [32 kc + 16 h, +16): store block */
                const uint16_t *src = st + ((2 * kc + h) * b->nkc + cb / 2) * E +
                                      cb % 2 * 8 * RX_BT_K;
#ifdef RX_BASE_X86
                if (rx_cpu_base_simd() >= 1) {
                    transpose8_512(src, dst + 8 * h * RX_BT_K);
                    continue;
                }
#endif
                for (size_t q = 0; q < 8; q++)
                    for (size_t p = 0; p < W; p++) {
                        uint64_t v;
                        memcpy(&v, src + p * RX_BT_K + 4 * q, 8);
                        v = swap_mid16(v);
                        memcpy(dst + (8 * h + q) * RX_BT_K + 4 * p, &v, 8);
                    }
            }
        }
}

/* Stored rows [j0, j0 + n) of b over k range [k0, k1), asked for ahead of
 * their decode: a packing task reads each row's run of a few lines only,
 * 16 rows at a time, runs no hardware prefetcher follows. pack_bf16 asks
 * for the next column block at each block's k, spread as it decodes
 * (64-sequence decode over a Q8_0 base, bf16, Zen 4: one burst a column
 * block gave 3-10%, spread so 14% more) */
static void prefetch_rows(const rx_base_mat *b, size_t rb, size_t j0, size_t n, size_t k0,
                          size_t k1, size_t N) {
    if (j0 >= N) return;
    if (j0 + n > N) n = N - j0;
    /* within the rows (a range past K is empty): no address past the store
     * is formed */
    const size_t a = rx_base_type_row_bytes(b->ty, k0), e1 = rx_base_type_row_bytes(b->ty, k1);
    const size_t e = e1 < rb ? e1 : rb;
    for (size_t c = 0; c < n && a < e; c++) {
        const unsigned char *row = b->data + (j0 + c) * rb;
        for (size_t off = a; off < e; off += 64) __builtin_prefetch(row + off);
        __builtin_prefetch(row + e - 1);
    }
}

/* rx_bgemm's packed op(B): 16-column x 32-k blocks (bt_r x bt_k), block
 * (cb, kc) at bp + (cb * nkc + kc) * bt_r * bt_k, row q/2 holding the k pair
 * (q even, q odd) of its 16 columns interleaved; zero past N and K. Column
 * blocks [cb0,cb1) x k chunks [kc0,kc1). A whole block decodes a run of 32
 * k (forward: one Q8_0 block) or 16 j (dX) per row at a time. */
static void pack_bf16(const void *src, int tb, size_t N, size_t K, size_t nkc, size_t cb0,
                      size_t cb1, size_t kc0, size_t kc1, size_t bt_r, size_t bt_k,
                      uint16_t *bp) {
    const rx_base_mat *b = src;
    const rx_base_type *ty = b->ty;
    const size_t rb = rx_base_type_row_bytes(ty, b->in);
    float run[128];
    /* a packed store serves the whole products it was made for */
    if (b->packed && N == (tb ? b->in : b->out) && K == (tb ? b->out : b->in)) {
        pack_packed(b, tb, nkc, cb0, cb1, kc0, kc1, bp);
        return;
    }
    for (size_t cb = cb0; cb < cb1; cb++)
        for (size_t kc = kc0; kc < kc1; kc++) {
            uint16_t *dst = bp + (cb * nkc + kc) * bt_r * bt_k;
            const size_t j0 = cb * bt_r, k0 = kc * bt_k;
            if (!tb) prefetch_rows(b, rb, j0 + bt_r, bt_r, k0, k0 + bt_k, N);
            const size_t nj = j0 >= N ? 0 : N - j0 < bt_r ? N - j0 : bt_r;
            const size_t nk = k0 >= K ? 0 : K - k0 < bt_k ? K - k0 : bt_k;
            if (bt_r > 64 || bt_k != 2 * bt_r || nj < bt_r || nk < bt_k || b->packed) {
                /* an edge block, or a packed store read by element */
                for (size_t c = 0; c < bt_r; c++)
                    for (size_t q = 0; q < bt_k; q++) {
                        const size_t j = j0 + c, k = k0 + q;
                        float v = 0.0f;
                        if (j < N && k < K) v = tb ? rx_base_at_jk(b, k, j) : rx_base_at_jk(b, j, k);
                        dst[q / 2 * bt_k + 2 * c + q % 2] = operand_bf16(v);
                    }
                continue;
            }
            if (ty->block_bf16 && ty->block_bf16(b->data, rb, tb, j0, k0, bt_r, bt_k, dst))
                continue;
            if (!tb) {   /* column c: its stored row's run of bt_k k */
                for (size_t c = 0; c < bt_r; c++) {
                    ty->decode(b->data + (j0 + c) * rb, k0, bt_k, run);
                    for (size_t q = 0; q < bt_k; q++)
                        dst[q / 2 * bt_k + 2 * c + q % 2] = operand_bf16(run[q]);
                }
                continue;
            }
            for (size_t q = 0; q < bt_k; q++) {   /* k row q is stored row k0 + q: its bt_r j */
                ty->decode(b->data + (k0 + q) * rb, j0, bt_r, run);
                for (size_t c = 0; c < bt_r; c++)
                    dst[q / 2 * bt_k + 2 * c + q % 2] = operand_bf16(run[c]);
            }
        }
}

/* rx_gemm_source's small_f32 by the dtype's kernel: a forward product
 * (op(B) = W, its columns b's stored rows) of op(A) read in place */
static size_t small_f32(const void *src, const rx_gemm_op *g, size_t j0, size_t j1, size_t kcb) {
    const rx_base_mat *b = src;
    if (b->packed || g->tb || g->ta || !b->ty->small_f32) return 0;
    return b->ty->small_f32(b->data, rx_base_type_row_bytes(b->ty, b->in), g->M, g->A, g->lda,
                            g->K, kcb, j0, j1, g->beta != 0.0f, g->C, g->ldc);
}

/* rx_gemm_source's rows_bf16 by the dtype's kernel: whole rows and chunks
 * of a forward product over a store of rows */
static int rows_bf16(const void *src, size_t N, size_t K, size_t j0, size_t k0, size_t pj,
                     int pairs, uint16_t *dst) {
    const rx_base_mat *b = src;
    if (b->packed || !b->ty->rows_bf16 || N != b->out || K != b->in || j0 + 16 > N ||
        k0 + 32 > K)
        return RX_ROWS_NONE;
    return b->ty->rows_bf16(b->data, rx_base_type_row_bytes(b->ty, b->in), j0, k0,
                            pj != RX_NO_ROWS && pj + 16 <= N ? pj : RX_NO_ROWS, pairs, dst);
}

const rx_gemm_source rx_base_source = {pack_f32, pack_bf16, packed, small_f32, rows_bf16};

int rx_base_sgemm(int dtype, const void *rows, size_t M, size_t N, size_t K, const float *A,
                  float *C, int how) {
    const rx_base_type *ty = rx_base_type_of(dtype);
    if (!ty || K % ty->blk_elems)
        return rx_fail(RX_EINVAL, "rx_base_sgemm: dtype %d, K %zu: not a dtype, or K not whole "
                       "blocks", dtype, K);
    const rx_base_mat b = {.in = K, .out = N, .loaded = 1, .ty = ty,
                           .data = (unsigned char *)(uintptr_t)rows};
    /* B: the rows, for the overlap check only (ldb 0: one row's extent) */
    rx_gemm_op g = {0, 0, M, N, K, A, K, rows, 0, 0.0f, C, N};
    g.bsrc = &rx_base_source;
    g.bsrc_of = &b;
    if (how == RX_BASE_GEMM_FP32) return rx_sgemm_batch(&g, 1);
    if (how == RX_BASE_GEMM_BF16) return rx_bgemm_batch(&g, 1);
    if (!rx_base_fast_ok(&b, &g))
        return rx_fail(RX_EINVAL, "rx_base_sgemm: the fast decode takes a Q8_0 or Q4_0 base of "
                       "K <= 16384; got dtype %d, K %zu", dtype, K);
    return rx_base_fast_sgemm(&b, &g);
}
