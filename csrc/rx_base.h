/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * rx_base.h -- the frozen base's internals, shared by its files and not part
 * of the API: the exact number formats, the frozen-base dtype (one row of
 * rx_base_types, base_types.c, whose kernels live in base_<dtype>.c), and a
 * base tensor's store (base.c; packed for the GEMMs by base_pack.c).
 */
#ifndef RWKVX_BASE_H
#define RWKVX_BASE_H

#include "rx_internal.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define RX_BASE_X86 1
#define RX_BASE512 __attribute__((target("avx512f,avx512bw")))
#define RX_BASE_AVX2 __attribute__((target("avx2,f16c")))   /* rx_cpu_base_avx2 */
#define RX_BASE_BF16V __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
/* level 3 of rx_cpu_base_simd */
#define RX_BASE_BF16VB __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")))
#endif

/* a function whose float32 products must each round before an addition:
 * GNU C would otherwise contract them into fused multiply-adds across
 * statements */
#if defined(__GNUC__) && !defined(__clang__)
#define RX_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define RX_NO_CONTRACT
#endif

/* ---- number formats (exact) --------------------------------------------- */

static inline float bits_f32(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* fp32 -> bf16, round to nearest even, NaN kept quiet (torch's and numpy's
 * conversion: subnormals are kept, unlike the GEMM's operand rounding) */
static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* fp32 -> IEEE half, round to nearest even (numpy's astype(float16)) */
static inline uint16_t to_f16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);   /* rounds past 65504 */
    if (a < 0x38800000u) {   /* below 2^-14: a half subnormal (or zero) */
        if (a < 0x33000000u) return (uint16_t)sign;   /* below half of 2^-24 */
        const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126 - e;   /* 14..24: m >> shift in units of 2^-24 */
        uint32_t h = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((a >> 13) - (112u << 10));   /* rebias 127 -> 15 */
    const uint32_t rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

static inline float f16_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        const float v = (float)m * 0x1p-24f;   /* exact */
        return sign ? -v : v;
    }
    if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13));
    return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

/* the GEMM's bf16 operand rounding (rx_bf16_operand): a base value is a
 * bf16 or q*d; rounding it as a float32 gives what the float32 model
 * holding the decoded weights would pack */
static inline uint16_t operand_bf16(float x) { return rx_bf16_operand(x); }

/* ---- the frozen-base dtype ------------------------------------------------
 * One row of rx_base_types (base_types.c) is everything the store and the
 * GEMMs' packers know of a dtype, as ggml's type_traits: a stored row of W^T
 * is whole blocks of blk_elems values in blk_bytes each (the input size must
 * be a multiple of blk_elems), and these kernels read and write it. */
typedef struct rx_base_type {
    const char *name;          /* "bf16", "q8_0", "q4_0", "nf4", "q4_k": the binding's, the files' and the CLI's */
    int id;                    /* RX_BASE_* (rx_pretrain.h) */
    size_t blk_elems, blk_bytes;
    /* every value is a bf16: a model computing in bf16 may store the
     * tensor as rx_bgemm's packed op(B) itself (rx_base_create's packed) */
    int bf16_exact;
    /* n float32 values -> one stored row, as the dtype's reference rounds */
    void (*from_float)(const float *x, size_t n, unsigned char *dst);
    /* n bf16 (bits) -> one stored row when that is exact and cheaper than
     * through float32; NULL: through from_float */
    void (*from_bf16)(const uint16_t *h, size_t n, unsigned char *dst);
    /* n values of a stored row from element k0 into dst as float32, exact;
     * k0 and n stay inside whole blocks or one block */
    void (*decode)(const unsigned char *row, size_t k0, size_t n, float *dst);
    /* rx_sgemm's forward sliver: the nr stored rows [j0, j0+nr) of rb
     * bytes, k [p0, p0+kc), k-major into Bp [kc][nr]; NULL, or 0 returned,
     * where it has no faster way (the packer then decodes row by row) */
    int (*sliver_f32)(const unsigned char *data, size_t rb, size_t j0, size_t p0, size_t kc,
                      size_t nr, float *Bp);
    /* one whole bt_r x bt_k block of rx_bgemm's packed op(B) at columns j0,
     * k k0, as the GEMM rounds its operands: forward (tb 0) from stored rows
     * j, dX (tb 1) from stored rows k; NULL, or 0 returned, where it has no
     * faster way (the packer then decodes and rounds the values itself) */
    int (*block_bf16)(const unsigned char *data, size_t rb, int tb, size_t j0, size_t k0,
                      size_t bt_r, size_t bt_k, uint16_t *dst);
    /* rx_sgemm's small-M forward product straight from the stored rows
     * (rx_gemm_source's small_f32): C[M][j0, j1) (+)= A[M][K] (row stride
     * lda) . W[K][j0, j1), each C element summed as the GEMM's kernels sum
     * it; returns the columns from j0 it wrote (0: no faster way); NULL
     * where the dtype has none */
    size_t (*small_f32)(const unsigned char *data, size_t rb, size_t M, const float *A,
                        size_t lda, size_t K, size_t kcb, size_t j0, size_t j1, int acc0,
                        float *C, size_t ldc);
    /* the 16 stored rows [j0, j0+16), k [k0, k0+32), as the GEMM rounds its
     * operands, row-major [16][32] (an AMX A tile of W^T: RX_ROWS_TILE), or
     * with pairs where it has a faster way, block_bf16's forward block
     * (RX_ROWS_PAIRS), and the slice at k0 of the 16 rows from pj (the
     * caller's next; RX_NO_ROWS: none) prefetched: rx_gemm_source's
     * rows_bf16; NULL, or RX_ROWS_NONE returned, where it has no faster way */
    int (*rows_bf16)(const unsigned char *data, size_t rb, size_t j0, size_t k0, size_t pj,
                     int pairs, uint16_t *dst);
} rx_base_type;

/* the row of dtype id (RX_BASE_*), NULL when it is none */
const rx_base_type *rx_base_type_of(int id);

/* bytes of a stored row of in values */
static inline size_t rx_base_type_row_bytes(const rx_base_type *ty, size_t in) {
    return in / ty->blk_elems * ty->blk_bytes;
}

/* base_bf16.c: bf16 rows (2 bytes a value) */
void rx_bf16_from_float(const float *x, size_t n, unsigned char *dst);
void rx_bf16_from_bf16(const uint16_t *h, size_t n, unsigned char *dst);
void rx_bf16_decode(const unsigned char *row, size_t k0, size_t n, float *dst);
int rx_bf16_sliver_f32(const unsigned char *data, size_t rb, size_t j0, size_t p0, size_t kc,
                       size_t nr, float *Bp);
int rx_bf16_block_bf16(const unsigned char *data, size_t rb, int tb, size_t j0, size_t k0,
                       size_t bt_r, size_t bt_k, uint16_t *dst);
size_t rx_bf16_small_f32(const unsigned char *data, size_t rb, size_t M, const float *A,
                         size_t lda, size_t K, size_t kcb, size_t j0, size_t j1, int acc0,
                         float *C, size_t ldc);

/* base_q8_0.c: GGUF Q8_0 rows, per block one fp16 scale d, then int8 q */
#define RX_Q8_0_BLOCK 32                   /* values per block */
#define RX_Q8_0_BYTES (2 + RX_Q8_0_BLOCK)  /* its fp16 scale, then 32 int8 */
void rx_q8_0_from_float(const float *x, size_t n, unsigned char *dst);
void rx_q8_0_decode(const unsigned char *row, size_t k0, size_t n, float *dst);
int rx_q8_0_sliver_f32(const unsigned char *data, size_t rb, size_t j0, size_t p0, size_t kc,
                       size_t nr, float *Bp);
int rx_q8_0_block_bf16(const unsigned char *data, size_t rb, int tb, size_t j0, size_t k0,
                       size_t bt_r, size_t bt_k, uint16_t *dst);
size_t rx_q8_0_small_f32(const unsigned char *data, size_t rb, size_t M, const float *A,
                        size_t lda, size_t K, size_t kcb, size_t j0, size_t j1, int acc0,
                        float *C, size_t ldc);
int rx_q8_0_rows_bf16(const unsigned char *data, size_t rb, size_t j0, size_t k0, size_t pj,
                      int pairs, uint16_t *dst);

/* base_q4_0.c: GGUF Q4_0 rows, per block one fp16 scale d, then 16 bytes of
 * two 4-bit q each (low nibbles: values 0..15, high: 16..31) */
#define RX_Q4_0_BLOCK 32                       /* values per block */
#define RX_Q4_0_BYTES (2 + RX_Q4_0_BLOCK / 2)  /* its fp16 scale, then 32 nibbles */
void rx_q4_0_from_float(const float *x, size_t n, unsigned char *dst);
void rx_q4_0_decode(const unsigned char *row, size_t k0, size_t n, float *dst);
int rx_q4_0_sliver_f32(const unsigned char *data, size_t rb, size_t j0, size_t p0, size_t kc,
                       size_t nr, float *Bp);
int rx_q4_0_block_bf16(const unsigned char *data, size_t rb, int tb, size_t j0, size_t k0,
                       size_t bt_r, size_t bt_k, uint16_t *dst);
int rx_q4_0_rows_bf16(const unsigned char *data, size_t rb, size_t j0, size_t k0, size_t pj,
                      int pairs, uint16_t *dst);
size_t rx_q4_0_small_f32(const unsigned char *data, size_t rb, size_t M, const float *A,
                        size_t lda, size_t K, size_t kcb, size_t j0, size_t j1, int acc0,
                        float *C, size_t ldc);

/* base_nf4.c: QLoRA's NF4 rows, per block one float32 absmax, then 32 bytes
 * of two 4-bit codes each (value 2i: byte i's high nibble, 2i + 1: its low) */
#define RX_NF4_BLOCK 64                      /* values per block (bitsandbytes' blocksize) */
#define RX_NF4_BYTES (4 + RX_NF4_BLOCK / 2)  /* its float32 absmax, then 64 nibbles */
void rx_nf4_from_float(const float *x, size_t n, unsigned char *dst);
void rx_nf4_decode(const unsigned char *row, size_t k0, size_t n, float *dst);

/* base_q4_k.c: GGUF Q4_K rows (ggml's block_q4_K), per super-block of 256
 * fp16 d and dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of q */
#define RX_Q4_K_BLOCK 256                           /* values per super-block */
#define RX_Q4_K_BYTES (4 + 12 + RX_Q4_K_BLOCK / 2)  /* d, dmin, scales, 256 nibbles */
void rx_q4_k_from_float(const float *x, size_t n, unsigned char *dst);
void rx_q4_k_decode(const unsigned char *row, size_t k0, size_t n, float *dst);
int rx_q4_k_block_bf16(const unsigned char *data, size_t rb, int tb, size_t j0, size_t k0,
                       size_t bt_r, size_t bt_k, uint16_t *dst);
int rx_q4_k_rows_bf16(const unsigned char *data, size_t rb, size_t j0, size_t k0, size_t pj,
                      int pairs, uint16_t *dst);
size_t rx_q4_k_small_f32(const unsigned char *data, size_t rb, size_t M, const float *A,
                         size_t lda, size_t K, size_t kcb, size_t j0, size_t j1, int acc0,
                         float *C, size_t ldc);

/* ---- a base tensor's store (base.c) --------------------------------------- */

struct rx_base_mat {
    const float *W, *GW;   /* the arena slots: the keys of the products */
    size_t in, out;
    int param, loaded;
    const rx_base_type *ty;
    int rows;              /* the embedding: its slot is [out][in], rows gathered */
    int packed;            /* rx_bgemm's packed op(B) of W (below), else rows */
    size_t np, nkc;        /* packed: out padded to RX_BT_BLK, in in RX_BT_K chunks */
    unsigned char *data;   /* [out] rows of its dtype, or packed */
};

/* the index of element (j, k) of W^T (j < np, k < nkc * RX_BT_K) in a
 * packed store: block (j / 16, k / 32), its row of k pair k / 2 % 16,
 * column j % 16's word, half k % 2 */
static inline size_t pk_index(const rx_base_mat *b, size_t j, size_t k) {
    return ((j / RX_BT_R) * b->nkc + k / RX_BT_K) * (RX_BT_R * RX_BT_K) +
           k % RX_BT_K / 2 * RX_BT_K + 2 * (j % RX_BT_R) + k % 2;
}

/* element (j, k) of W^T [out][in]: exact */
static inline float rx_base_at_jk(const rx_base_mat *b, size_t j, size_t k) {
    if (b->packed) return bf16_f32(((const uint16_t *)(const void *)b->data)[pk_index(b, j, k)]);
    float v;
    b->ty->decode(b->data + j * rx_base_type_row_bytes(b->ty, b->in), k, 1, &v);
    return v;
}

#endif /* RWKVX_BASE_H */
