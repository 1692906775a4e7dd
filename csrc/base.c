/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * base.c -- the frozen base: weight matrices that do not train, held only
 * in a compact format the projection GEMM reads (docs/layout.md §Frozen
 * base, docs/finetune.md §The frozen base).
 *
 *     bf16   W^T [out][in] as bfloat16, 2 bytes an element
 *     q8_0   W^T [out][in] in GGUF Q8_0 blocks along in: per 32 values one
 *            fp16 scale d, then 32 int8 q (34 bytes), value = q * d; the
 *            bytes are those of gguf.quants.quantize(W^T, Q8_0)
 *
 * W^T is torch's [out][in] orientation: an official .pth tensor is copied
 * in as it is. A bf16 base of a model that computes in bf16 is stored
 * instead as the bf16 GEMM's own packed op(B) of each forward product
 * (rx_base_create's packed): the forward reads it in place, and the dX
 * product's packing is a transpose of whole 64-bit words (pack_t_packed),
 * where rows cost a pack per product, about a quarter of a 1.5B LoRA
 * step. A base tensor keeps its place in the parameter arena, but
 * only as address space: the model's arenas are mapped lazily
 * (RX_PT_NO_INIT) and a base tensor's float32 pages are released here and
 * never written again, so they take no memory. The products that read W
 * are recognised by their B pointer (as lora.c recognises adapted weights):
 * rx_pgemm_batch, while the model's base is set for the thread
 * (rx_gemm_set_base), marks each such op, and the fp32 and bf16 GEMMs pack
 * op(B) from the store instead of the arena (rx_base_pack_f32,
 * rx_base_pack_bf16). Decoding is exact (a bf16 or q*d is a float32), so
 * at fp32 precision the model computes bit for bit what a float32 model
 * holding the decoded weights computes; the weight-grad product of a base
 * tensor is never run (its grad is not kept), the dX products are.
 */
#include <math.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "rx_internal.h"
#include "rx_simd.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#define RX_BASE_X86 1
#define RX_BASE512 __attribute__((target("avx512f,avx512bw")))
#define RX_BASE_BF16V __attribute__((target("avx512f,avx512bw,avx512bf16")))
#endif

#define Q8_BLOCK 32                 /* values per Q8_0 block */
#define Q8_BYTES (2 + Q8_BLOCK)     /* its fp16 scale, then 32 int8 */

struct rx_base_mat {
    const float *W, *GW;   /* the arena slots: the keys of the products */
    size_t in, out;
    int param, loaded, dtype;
    int rows;              /* the embedding: its slot is [out][in], rows gathered */
    int packed;            /* rx_bgemm's packed op(B) of W (below), else rows */
    size_t np, nkc;        /* packed: out padded to RX_BT_BLK, in in RX_BT_K chunks */
    unsigned char *data;   /* [out] rows of rx_base_row_bytes(in) bytes, or packed */
};

struct rx_base {
    int dtype, n;
    size_t bytes;
    rx_base_mat *mats;     /* [n] in arena order */
    unsigned char *store;  /* every tensor's rows, one allocation */
};

/* ---- number formats ------------------------------------------------------ */

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
static uint16_t to_f16(float x) {
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

static float f16_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        const float v = (float)m * 0x1p-24f;   /* exact */
        return sign ? -v : v;
    }
    if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13));
    return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

size_t rx_base_row_bytes(int dtype, size_t in) {
    return dtype == RX_BASE_Q8_0 ? in / Q8_BLOCK * Q8_BYTES : in * 2;
}

/* One row of n values into a Q8_0 row, as gguf's Q8_0.quantize_blocks
 * (float32 throughout: d = amax / 127, id = 1 / d or 0, q = roundf(x id)) */
static void q8_row(const float *x, size_t n, unsigned char *dst) {
    for (size_t b = 0; b < n; b += Q8_BLOCK, dst += Q8_BYTES) {
        float amax = 0.0f;
        for (size_t i = 0; i < Q8_BLOCK; i++) amax = fmaxf(amax, fabsf(x[b + i]));
        const float d = amax / 127.0f, id = d == 0.0f ? 0.0f : 1.0f / d;
        const uint16_t dh = to_f16(d);
        memcpy(dst, &dh, 2);
        for (size_t i = 0; i < Q8_BLOCK; i++) {
            const float q = roundf(x[b + i] * id);
            dst[2 + i] = (unsigned char)(int8_t)q;
        }
    }
}

/* element k of a stored row: exact */
static inline float row_at(int dtype, const unsigned char *row, size_t k) {
    if (dtype == RX_BASE_Q8_0) {
        const unsigned char *blk = row + k / Q8_BLOCK * Q8_BYTES;
        uint16_t dh;
        memcpy(&dh, blk, 2);
        return (float)(int8_t)blk[2 + k % Q8_BLOCK] * f16_f32(dh);
    }
    uint16_t h;
    memcpy(&h, row + 2 * k, 2);
    return bf16_f32(h);
}

/* the index of element (j, k) of W^T (j < np, k < nkc * RX_BT_K) in a
 * packed store: block (j / 16, k / 32), its row of k pair k / 2 % 16,
 * column j % 16's word, half k % 2 */
static inline size_t pk_index(const rx_base_mat *b, size_t j, size_t k) {
    return ((j / RX_BT_R) * b->nkc + k / RX_BT_K) * (RX_BT_R * RX_BT_K) +
           k % RX_BT_K / 2 * RX_BT_K + 2 * (j % RX_BT_R) + k % 2;
}

/* element (j, k) of W^T [out][in]: exact */
static inline float mat_at(const rx_base_mat *b, size_t j, size_t k) {
    if (b->packed) return bf16_f32(((const uint16_t *)(const void *)b->data)[pk_index(b, j, k)]);
    return row_at(b->dtype, b->data + j * rx_base_row_bytes(b->dtype, b->in), k);
}

/* ---- the store ----------------------------------------------------------- */

void rx_base_free(rx_base *s) {
    if (!s) return;
    free(s->store);
    free(s->mats);
    free(s);
}

/* Releases the whole pages inside [p, p + n floats): they read as zero and
 * take no memory until written (anonymous private memory, which the lazy
 * arenas are); a no-op where madvise cannot. */
static void release_pages(float *p, size_t n) {
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t b = ((uintptr_t)p + pg - 1) / pg * pg, e = (uintptr_t)(p + n) / pg * pg;
    if (e > b) (void)madvise((void *)b, e - b, MADV_DONTNEED);
}

/* bytes of a tensor's store */
static size_t mat_bytes(const rx_base_mat *b) {
    return b->packed ? b->np * b->nkc * RX_BT_K * 2 : b->out * rx_base_row_bytes(b->dtype, b->in);
}

int rx_base_create(int dtype, const rx_base_target *t, int n, int packed, rx_base **out) {
    static const char *const fn = "rx_ptmodel_set_base";
    *out = NULL;
    rx_base *s = calloc(1, sizeof *s);
    if (!s) return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    s->dtype = dtype;
    s->n = n;
    s->mats = calloc((size_t)n, sizeof *s->mats);
    for (int i = 0; s->mats && i < n; i++) {
        rx_base_mat *b = &s->mats[i];
        b->in = t[i].in;
        b->out = t[i].out;
        b->dtype = dtype;
        b->rows = t[i].rows;
        b->packed = packed && dtype == RX_BASE_BF16 && !b->rows;
        b->np = (b->out + RX_BT_BLK - 1) / RX_BT_BLK * RX_BT_BLK;
        b->nkc = (b->in + RX_BT_K - 1) / RX_BT_K;
        s->bytes += mat_bytes(b);
    }
    s->store = s->mats ? rx_alloc(s->bytes, 1) : NULL;
    if (!s->mats || !s->store) {
        const size_t bytes = s->bytes;
        rx_base_free(s);
        return rx_fail(RX_ENOMEM, "%s: out of memory for a base of %zu bytes", fn, bytes);
    }
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        rx_base_mat *b = &s->mats[i];
        b->W = t[i].W;
        b->GW = t[i].GW;
        b->param = t[i].param;
        b->data = s->store + off;
        off += mat_bytes(b);
        release_pages((float *)t[i].W, b->in * b->out);
        release_pages((float *)t[i].GW, b->in * b->out);
    }
    *out = s;
    return RX_OK;
}

int rx_base_dtype(const rx_base *s) { return s ? s->dtype : RX_BASE_NONE; }

size_t rx_base_bytes(const rx_base *s) { return s ? s->bytes : 0; }

int rx_base_count(const rx_base *s) { return s ? s->n : 0; }

const rx_base_mat *rx_base_by_param(const rx_base *s, int param) {
    for (int i = 0; s && i < s->n; i++)
        if (s->mats[i].param == param) return &s->mats[i];
    return NULL;
}

const rx_base_mat *rx_base_at(const rx_base *s, int i) {
    return s && i >= 0 && i < s->n ? &s->mats[i] : NULL;
}

int rx_base_param(const rx_base_mat *b) { return b->param; }

int rx_base_loaded(const rx_base *s) {
    for (int i = 0; s && i < s->n; i++)
        if (!s->mats[i].loaded) return 0;
    return 1;
}

/* the base tensor whose arena slot is W, or NULL */
const rx_base_mat *rx_base_find(const rx_base *s, const float *W) {
    for (int i = 0; s && i < s->n; i++)
        if (s->mats[i].W == W) return &s->mats[i];
    return NULL;
}

/* the base tensor whose grad slot C starts inside, or NULL */
int rx_base_grad_slot(const rx_base *s, const float *C) {
    for (int i = 0; s && i < s->n; i++) {
        const rx_base_mat *b = &s->mats[i];
        if (C >= b->GW && C < b->GW + b->in * b->out) return 1;
    }
    return 0;
}

void rx_base_zero_grads(const rx_base *s, float *grads, size_t n) {
    size_t at = 0;
    for (int i = 0; s && i < s->n; i++) {   /* in arena order */
        const size_t b = (size_t)(s->mats[i].GW - grads);
        if (b > at) rx_fzero(grads + at, b - at);
        at = b + s->mats[i].in * s->mats[i].out;
    }
    if (n > at) rx_fzero(grads + at, n - at);
}

/* the bf16 GEMM's operand rounding of a stored bf16: a subnormal becomes
 * a signed zero, anything else stays */
static inline uint16_t operand_of_bf16(uint16_t h) {
    return (h & 0x7f80u) ? h : (uint16_t)(h & 0x8000u);
}

/* row j of W^T (in bf16 values) into a packed store, as the GEMM reads it */
static void place_row(const rx_base_mat *b, size_t j, const uint16_t *enc) {
    uint16_t *d = (uint16_t *)(void *)b->data;
    for (size_t k = 0; k < b->in; k++) d[pk_index(b, j, k)] = operand_of_bf16(enc[k]);
}

/* src: W^T [out][in] (src_t) or W [in][out], float32 or bf16 (RX_BASE_BF16
 * as kind: uint16 bits) */
int rx_base_fill(rx_base *s, int i, const void *src, int kind, int src_t) {
    rx_base_mat *b = &s->mats[i];
    const size_t rb = rx_base_row_bytes(s->dtype, b->in);
    float *row = s->dtype == RX_BASE_Q8_0 || !src_t ? rx_falloc(b->in) : NULL;
    /* packed: each row encoded here, then placed (padding: zeros) */
    uint16_t *enc = b->packed ? rx_alloc(b->in, sizeof *enc) : NULL;
    if (((s->dtype == RX_BASE_Q8_0 || !src_t) && !row) || (b->packed && !enc)) {
        free(row);
        return rx_fail(RX_ENOMEM, "rx_ptmodel_base_fill: out of memory");
    }
    if (b->packed) memset(b->data, 0, mat_bytes(b));
    const float *f = src;
    const uint16_t *h = src;
    for (size_t j = 0; j < b->out; j++) {
        if (j && b->packed) place_row(b, j - 1, enc);
        unsigned char *dst = b->packed ? (unsigned char *)enc : b->data + j * rb;
        if (src_t && s->dtype == RX_BASE_BF16 && kind == RX_BASE_BF16) {
            memcpy(dst, h + j * b->in, rb);   /* bf16 in, bf16 kept: a copy */
            continue;
        }
        if (src_t && s->dtype == RX_BASE_BF16) {
            uint16_t *d = (uint16_t *)(void *)dst;
            for (size_t k = 0; k < b->in; k++) {
                const uint16_t v = to_bf16(f[j * b->in + k]);
                memcpy(d + k, &v, 2);
            }
            continue;
        }
        for (size_t k = 0; k < b->in; k++) {
            const size_t e = src_t ? j * b->in + k : k * b->out + j;
            row[k] = kind == RX_BASE_BF16 ? bf16_f32(h[e]) : f[e];
        }
        if (s->dtype == RX_BASE_Q8_0) {
            q8_row(row, b->in, dst);
        } else {
            for (size_t k = 0; k < b->in; k++) {
                const uint16_t v = to_bf16(row[k]);
                memcpy(dst + 2 * k, &v, 2);
            }
        }
    }
    if (b->packed && b->out) place_row(b, b->out - 1, enc);
    free(row);
    free(enc);
    b->loaded = 1;
    return RX_OK;
}

/* W [in][out] (a rows tensor: [out][in]) decoded into dst */
void rx_base_read(const rx_base *s, const rx_base_mat *b, float *dst) {
    for (size_t j = 0; j < b->out; j++) {
        if (b->rows) {
            rx_base_row(b, j, dst + j * b->in);
            continue;
        }
        for (size_t k = 0; k < b->in; k++) dst[k * b->out + j] = mat_at(b, j, k);
    }
    (void)s;
}

const unsigned char *rx_base_data(const rx_base_mat *b, size_t *bytes) {
    if (bytes) *bytes = mat_bytes(b);
    return b->data;
}

void rx_base_rows(const rx_base_mat *b, void *dst) {
    if (!b->packed) {
        memcpy(dst, b->data, mat_bytes(b));
        return;
    }
    const uint16_t *d = (const uint16_t *)(const void *)b->data;
    uint16_t *o = dst;
    for (size_t j = 0; j < b->out; j++)
        for (size_t k = 0; k < b->in; k++) o[j * b->in + k] = d[pk_index(b, j, k)];
}

const uint16_t *rx_base_packed(const rx_base_mat *b, size_t N, size_t K) {
    return b && b->packed && N == b->out && K == b->in ? (const uint16_t *)(const void *)b->data
                                                       : NULL;
}

/* ---- the GEMM's packing -------------------------------------------------- */

/* n values of stored row `row` from element k0 into dst as float32 (exact);
 * for Q8_0, k0 and n stay inside whole blocks or one block */
static inline void decode_run(int dtype, const unsigned char *row, size_t k0, size_t n,
                              float *dst) {
    if (dtype == RX_BASE_Q8_0) {
        for (size_t k = k0; k < k0 + n;) {
            const unsigned char *blk = row + k / Q8_BLOCK * Q8_BYTES;
            uint16_t dh;
            memcpy(&dh, blk, 2);
            const float d = f16_f32(dh);
            const size_t e = (k / Q8_BLOCK + 1) * Q8_BLOCK < k0 + n ? (k / Q8_BLOCK + 1) * Q8_BLOCK
                                                                    : k0 + n;
            const int8_t *q = (const int8_t *)(blk + 2);
            for (size_t i = k; i < e; i++) *dst++ = (float)q[i % Q8_BLOCK] * d;
            k = e;
        }
        return;
    }
    const uint16_t *h = (const uint16_t *)(const void *)row + k0;
    for (size_t i = 0; i < n; i++) dst[i] = bits_f32((uint32_t)h[i] << 16);
}

void rx_base_row(const rx_base_mat *b, size_t j, float *dst) {
    decode_run(b->dtype, b->data + j * rx_base_row_bytes(b->dtype, b->in), 0, b->in, dst);
}

#ifdef RX_BASE_X86
/* 16 words (32 bf16) with each subnormal half made a signed zero */
RX_BASE512 static inline __m512i flush16(__m512i v) {
    const __mmask32 sub = _mm512_testn_epi16_mask(v, _mm512_set1_epi16(0x7f80));
    return _mm512_mask_mov_epi16(v, sub, _mm512_and_si512(v, _mm512_set1_epi16((short)0x8000)));
}

/* The forward sliver of 16 bf16 rows (columns j) over k [p0, p0+kc), as
 * float32 k rows of 16: 16 k at a time, one transpose each */
RX_BASE512 static void sliver_bf16_512(const uint16_t *const rows[16], size_t p0, size_t kc,
                                        float *Bp) {
    size_t p = 0;
    for (; p + 16 <= kc; p += 16) {
        __m512i v[16];
        for (int j = 0; j < 16; j++)
            v[j] = _mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(rows[j] + p0 + p))),
                16);
        rx_transpose16(v);
        for (int q = 0; q < 16; q++) _mm512_storeu_si512(Bp + (p + q) * 16, v[q]);
    }
    for (; p < kc; p++) {
        uint32_t *dst = (uint32_t *)(void *)(Bp + p * 16);
        for (int j = 0; j < 16; j++) dst[j] = (uint32_t)rows[j][p0 + p] << 16;
    }
}

/* A forward block of rx_bgemm's op(B) from a bf16 base: column c's 32 k
 * are 64 bytes of its stored row; one transpose of the 16 runs */
RX_BASE512 static void block_bf16_512(const unsigned char *const rows[16], uint16_t *dst) {
    __m512i v[16];
    for (int c = 0; c < 16; c++) v[c] = flush16(_mm512_loadu_si512(rows[c]));
    rx_transpose16(v);
    for (int p = 0; p < 16; p++) _mm512_storeu_si512(dst + p * 32, v[p]);
}

/* The same from a Q8_0 base: column c's 32 k are one block, q * d rounded
 * by vcvtne2ps2bf16, the GEMM's own operand rounding */
RX_BASE_BF16V static void block_q8_512(const unsigned char *const blks[16], uint16_t *dst) {
    __m512i v[16];
    for (int c = 0; c < 16; c++) {
        uint16_t dh;
        memcpy(&dh, blks[c], 2);
        const __m512 d = _mm512_set1_ps(f16_f32(dh));
        const __m256i q = _mm256_loadu_si256((const __m256i *)(blks[c] + 2));
        const __m512 x0 = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), d);
        const __m512 x1 = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), d);
        v[c] = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
    }
    rx_transpose16(v);
    for (int p = 0; p < 16; p++) _mm512_storeu_si512(dst + p * 32, v[p]);
}

/* A dX block from a Q8_0 base: k row q is stored row k0 + q, whose 16 j
 * from j0 lie in one Q8_0 block; rows 2p, 2p+1 decoded (q * d, exact) and
 * rounded as the GEMM rounds its operands, then interleaved into k pairs */
RX_BASE_BF16V static void block_q8_t_512(const unsigned char *data, size_t rb, size_t k0,
                                         size_t j0, uint16_t *dst) {
    const size_t off = j0 / Q8_BLOCK * Q8_BYTES + 2 + j0 % Q8_BLOCK;
    /* word 2c: row 2p's value c (cvtne2ps's word c), word 2c+1: row 2p+1's (word 16+c) */
    const __m512i mix = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    for (int p = 0; p < 16; p++) {
        __m512 x[2];
        for (int h = 0; h < 2; h++) {
            const unsigned char *q = data + (k0 + 2 * (size_t)p + (size_t)h) * rb + off;
            uint16_t dh;
            memcpy(&dh, q - 2 - j0 % Q8_BLOCK, 2);
            const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)q);
            x[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)),
                                 _mm512_set1_ps(f16_f32(dh)));
        }
        const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(x[1], x[0]);
        _mm512_storeu_si512(dst + p * 32, _mm512_permutexvar_epi16(mix, w));
    }
}

/* A dX block from a bf16 base: k pair p is stored rows 2p, 2p+1 at j0 */
RX_BASE512 static void block_bf16_t_512(const unsigned char *data, size_t rb, size_t k0,
                                         size_t j0, uint16_t *dst) {
    for (int p = 0; p < 16; p++) {
        const uint16_t *r0 = (const uint16_t *)(const void *)(data + (k0 + 2 * p) * rb) + j0;
        const uint16_t *r1 = (const uint16_t *)(const void *)(data + (k0 + 2 * p + 1) * rb) + j0;
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)r0));
        const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)r1));
        _mm512_storeu_si512(dst + p * 32, flush16(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16))));
    }
}

/* 1 when the CPU runs the AVX-512 (BW) packers, 2 when also AVX512-BF16 */
static int simd_level(void) {
    static int level = -1;
    int v = __atomic_load_n(&level, __ATOMIC_ACQUIRE);
    if (v >= 0) return v;
    unsigned a, b, c, d;
    /* RWKVX_BASE_PORTABLE=1: the portable packers (tests on an AVX-512 CPU) */
    const char *env = getenv("RWKVX_BASE_PORTABLE");
    v = !(env && env[0] == '1') && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw");
    if (v && __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1)) v = 2;
    __atomic_store_n(&level, v, __ATOMIC_RELEASE);
    return v;
}
#endif

/* rx_sgemm's packed B sliver layout: op(B) rows [p0,p0+kc) x columns
 * [j0,j0+nc) as nr-column slivers, k-major, zero past nc; op(B) = W (tb 0)
 * or W^T (tb 1). Forward (W): a sliver column j is stored row j, read
 * along k; dX (W^T): a k row is stored row k, read along j. */
void rx_base_pack_f32(const rx_base_mat *b, int tb, size_t p0, size_t kc, size_t j0,
                      size_t nc, size_t nr, float *Bp) {
    const int dtype = b->dtype;
    const size_t rb = rx_base_row_bytes(dtype, b->in);
    float run[256];   /* one decoded run of a row, k or j */
    for (size_t s = 0; s < nc; s += nr, Bp += nr * kc) {
        const size_t w = nc - s < nr ? nc - s : nr;
        if (b->packed) {   /* read by element: the bf16 GEMM's layout, at fp32 precision */
            for (size_t p = 0; p < kc; p++)
                for (size_t j = 0; j < nr; j++)
                    Bp[p * nr + j] = j >= w ? 0.0f
                                   : tb     ? mat_at(b, p0 + p, j0 + s + j)
                                            : mat_at(b, j0 + s + j, p0 + p);
        } else if (!tb && dtype == RX_BASE_BF16 && w == nr && nr <= 64) {
            /* k-major over the sliver's nr stored rows: each Bp row written whole */
            const uint16_t *rows[64];
            for (size_t j = 0; j < nr; j++)
                rows[j] = (const uint16_t *)(const void *)(b->data + (j0 + s + j) * rb) + p0;
#ifdef RX_BASE_X86
            if (nr == 16 && simd_level() >= 1) {
                sliver_bf16_512(rows, 0, kc, Bp);
                continue;
            }
#endif
            for (size_t p = 0; p < kc; p++) {
                uint32_t *dst = (uint32_t *)(void *)(Bp + p * nr);
                for (size_t j = 0; j < nr; j++) dst[j] = (uint32_t)rows[j][p] << 16;
            }
        } else if (!tb) {
            for (size_t j = 0; j < nr; j++) {
                if (j >= w) {
                    for (size_t p = 0; p < kc; p++) Bp[p * nr + j] = 0.0f;
                    continue;
                }
                const unsigned char *row = b->data + (j0 + s + j) * rb;
                for (size_t q = 0; q < kc; q += 256) {
                    const size_t n = kc - q < 256 ? kc - q : 256;
                    decode_run(dtype, row, p0 + q, n, run);
                    for (size_t p = 0; p < n; p++) Bp[(q + p) * nr + j] = run[p];
                }
            }
        } else {
            for (size_t p = 0; p < kc; p++) {
                float *dst = Bp + p * nr;
                decode_run(dtype, b->data + (p0 + p) * rb, j0 + s, w, dst);
                for (size_t j = w; j < nr; j++) dst[j] = 0.0f;
            }
        }
    }
}

/* the GEMM's bf16 operand rounding (gemm_bf16.c bf16_round): a base value
 * is a bf16 or q*d; rounding it as a float32 gives what the float32 model
 * holding the decoded weights would pack */
static inline uint16_t operand_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    if (!(u & 0x7f800000u)) return (uint16_t)((u >> 16) & 0x8000u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Two bf16 (a 32-bit word) as the GEMM's operand rounding leaves them:
 * a subnormal becomes a signed zero (a stored bf16 is finite) */
static inline uint32_t flush_pair(uint32_t v) {
    const uint32_t lo = (v & 0x7f80u) ? 0xffffu : 0x8000u;
    const uint32_t hi = (v & 0x7f800000u) ? 0xffff0000u : 0x80000000u;
    return v & (lo | hi);
}

/* q * d (a Q8_0 value: finite, zero or at least 2^-24) rounded to bf16 as
 * operand_bf16 rounds it, without its branches for NaN and subnormals */
static inline uint16_t round_q8(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
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

/* rx_base_pack_bf16 from a packed store (whose layout is the GEMM's, so
 * nkc and the blocks of op(B) are the store's, padding included).
 * Forward: the store's blocks as they are (the GEMM normally reads them in
 * place, rx_base_packed). dX, op(B) = W^T (N = in, K = out): block (cb,
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
                if (simd_level() >= 1) {
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

/* rx_bgemm's packed op(B): 16-column x 32-k blocks (bt_r x bt_k), block
 * (cb, kc) at bp + (cb * nkc + kc) * bt_r * bt_k, row q/2 holding the k pair
 * (q even, q odd) of its 16 columns interleaved; zero past N and K. Column
 * blocks [cb0,cb1) x k chunks [kc0,kc1). A whole block decodes a run of 32
 * k (forward: one Q8_0 block) or 16 j (dX) per row at a time. */
void rx_base_pack_bf16(const rx_base_mat *b, int tb, size_t N, size_t K, size_t nkc,
                       size_t cb0, size_t cb1, size_t kc0, size_t kc1, size_t bt_r, size_t bt_k,
                       uint16_t *bp) {
    const int dtype = b->dtype;
    const size_t rb = rx_base_row_bytes(dtype, b->in);
    float run[64];
    /* a packed store serves the whole products it was made for */
    if (b->packed && N == (tb ? b->in : b->out) && K == (tb ? b->out : b->in)) {
        pack_packed(b, tb, nkc, cb0, cb1, kc0, kc1, bp);
        return;
    }
    for (size_t cb = cb0; cb < cb1; cb++)
        for (size_t kc = kc0; kc < kc1; kc++) {
            uint16_t *dst = bp + (cb * nkc + kc) * bt_r * bt_k;
            const size_t j0 = cb * bt_r, k0 = kc * bt_k;
            const size_t nj = j0 >= N ? 0 : N - j0 < bt_r ? N - j0 : bt_r;
            const size_t nk = k0 >= K ? 0 : K - k0 < bt_k ? K - k0 : bt_k;
            if (bt_r > 64 || bt_k != 2 * bt_r || nj < bt_r || nk < bt_k || b->packed) {
                /* an edge block, or a packed store read by element */
                for (size_t c = 0; c < bt_r; c++)
                    for (size_t q = 0; q < bt_k; q++) {
                        const size_t j = j0 + c, k = k0 + q;
                        float v = 0.0f;
                        if (j < N && k < K) v = tb ? mat_at(b, k, j) : mat_at(b, j, k);
                        dst[q / 2 * bt_k + 2 * c + q % 2] = operand_bf16(v);
                    }
                continue;
            }
            uint32_t *d32 = (uint32_t *)(void *)dst;   /* word (p, c): the k pair 2p, 2p+1 */
#ifdef RX_BASE_X86
            const int lv = bt_r == 16 ? simd_level() : 0;
            if (lv >= 1 && !tb && dtype == RX_BASE_BF16) {
                const unsigned char *rows[16];
                for (int c = 0; c < 16; c++) rows[c] = b->data + (j0 + c) * rb + 2 * k0;
                block_bf16_512(rows, dst);
                continue;
            }
            if (lv >= 2 && !tb && dtype == RX_BASE_Q8_0) {
                const unsigned char *blks[16];
                for (int c = 0; c < 16; c++)
                    blks[c] = b->data + (j0 + c) * rb + k0 / Q8_BLOCK * Q8_BYTES;
                block_q8_512(blks, dst);
                continue;
            }
            if (lv >= 1 && tb && dtype == RX_BASE_BF16) {
                block_bf16_t_512(b->data, rb, k0, j0, dst);
                continue;
            }
            if (lv >= 2 && tb && dtype == RX_BASE_Q8_0) {
                block_q8_t_512(b->data, rb, k0, j0, dst);
                continue;
            }
#endif
            if (!tb && dtype == RX_BASE_BF16) {
                /* column c's k pairs are its stored row's 32-bit words */
                for (size_t c = 0; c < bt_r; c++) {
                    const unsigned char *row = b->data + (j0 + c) * rb + 2 * k0;
                    for (size_t p = 0; p < bt_k / 2; p++) {
                        uint32_t v;
                        memcpy(&v, row + 4 * p, 4);
                        d32[p * bt_r + c] = flush_pair(v);
                    }
                }
            } else if (!tb) {   /* column c: one Q8_0 block (k0 is a multiple of 32) */
                for (size_t c = 0; c < bt_r; c++) {
                    decode_run(dtype, b->data + (j0 + c) * rb, k0, bt_k, run);
                    for (size_t p = 0; p < bt_k / 2; p++)
                        d32[p * bt_r + c] = (uint32_t)round_q8(run[2 * p]) |
                                            (uint32_t)round_q8(run[2 * p + 1]) << 16;
                }
            } else if (dtype == RX_BASE_BF16) {   /* two stored rows make a k pair */
                for (size_t p = 0; p < bt_k / 2; p++) {
                    const uint16_t *r0 = (const uint16_t *)(const void *)(b->data +
                                                                         (k0 + 2 * p) * rb) + j0;
                    const uint16_t *r1 = (const uint16_t *)(const void *)(b->data +
                                                                         (k0 + 2 * p + 1) * rb) + j0;
                    for (size_t c = 0; c < bt_r; c++)
                        d32[p * bt_r + c] = flush_pair((uint32_t)r0[c] | (uint32_t)r1[c] << 16);
                }
            } else {     /* k row q is stored row k0 + q: its 16 j in one run */
                for (size_t q = 0; q < bt_k; q++) {
                    decode_run(dtype, b->data + (k0 + q) * rb, j0, bt_r, run);
                    for (size_t c = 0; c < bt_r; c++)
                        dst[q / 2 * bt_k + 2 * c + q % 2] = operand_bf16(run[c]);
                }
            }
        }
}

/* Every base tensor decoded into its arena slot, the store freed: the
 * model holds float32 weights again (the base-unfreeze). */
int rx_base_materialise(rx_base *s) {
    for (int i = 0; s && i < s->n; i++) {
        const rx_base_mat *b = &s->mats[i];
        rx_base_read(s, b, (float *)b->W);
    }
    return RX_OK;
}

/* ---- the model's base (rx_pretrain.h) ------------------------------------ */

int rx_ptmodel_set_base(rx_ptmodel *m, int dtype, const int *params, int n) {
    static const char *const fn = "rx_ptmodel_set_base";
    if (!m || !params) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, !m ? "model" : "params");
    if (dtype != RX_BASE_BF16 && dtype != RX_BASE_Q8_0)
        return rx_fail(RX_EINVAL, "%s: unknown dtype %d", fn, dtype);
    if (n < 1) return rx_fail(RX_EINVAL, "%s: n = %d must be >= 1", fn, n);
    if (rx_ptmodel_base_store(m)) return rx_fail(RX_EINVAL, "%s: the model has a base already", fn);
    const int nt = rx_ptmodel_num_params(m);
    /* in arena order: tensor indices ascending */
    char *pick = calloc((size_t)nt, 1);
    rx_base_target *t = calloc((size_t)n, sizeof *t);
    int rc = pick && t ? RX_OK : rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    for (int i = 0; i < n && rc == RX_OK; i++) {
        const int p = params[i];
        int shape[2] = {0, 0};
        const char *name = NULL;
        if (p < 0 || p >= nt) {
            rc = rx_fail(RX_EINVAL, "%s: tensor %d is outside [0, %d)", fn, p, nt);
        } else if (pick[p]) {
            rc = rx_fail(RX_EINVAL, "%s: tensor %d is named twice", fn, p);
        } else if (rx_ptmodel_param(m, p, &name, NULL, NULL, NULL) != RX_OK ||
                   rx_ptmodel_param_shape(m, p, shape) != 2) {
            rc = rx_fail(RX_EINVAL, "%s: tensor %d (%s) is not a matrix", fn, p,
                         name ? name : "?");
        } else if (dtype == RX_BASE_Q8_0 && shape[!strcmp(name, "emb")] % Q8_BLOCK) {
            rc = rx_fail(RX_EINVAL, "%s: %s [%d, %d]: Q8_0 needs its %s size a multiple of "
                         "%d", fn, name, shape[0], shape[1],
                         strcmp(name, "emb") ? "input" : "row", Q8_BLOCK);
        }
        if (rc == RX_OK) pick[p] = 1;
    }
    int k = 0;
    for (int p = 0; p < nt && rc == RX_OK; p++) {
        if (!pick[p]) continue;
        float *W, *GW;
        int shape[2];
        const char *name;
        rx_ptmodel_param(m, p, &name, &W, &GW, NULL);
        rx_ptmodel_param_shape(m, p, shape);
        /* the embedding [V][C] is gathered by rows: stored as it is, rows of C */
        const int rows = !strcmp(name, "emb");
        t[k++] = (rx_base_target){W, GW, (size_t)shape[rows], (size_t)shape[!rows], p, rows};
    }
    rx_base *s = NULL;
    /* the bf16 GEMM's own layout when the model computes in bf16 */
    const int packed = rx_ptmodel_precision(m) == RX_PRECISION_BF16;
    if (rc == RX_OK) rc = rx_base_create(dtype, t, n, packed, &s);
    if (rc == RX_OK) rx_ptmodel_attach_base(m, s);
    free(pick);
    free(t);
    return rc;
}

/* the base tensor param of m, or NULL through rx_fail naming fn */
static const rx_base_mat *mat_of(const rx_ptmodel *m, int param, const char *fn) {
    const rx_base *s = m ? rx_ptmodel_base_store(m) : NULL;
    const rx_base_mat *b = rx_base_by_param(s, param);
    if (!b) rx_fail(RX_EINVAL, "%s: tensor %d is not in the model's base", fn, param);
    return b;
}

int rx_ptmodel_base_fill(rx_ptmodel *m, int param, const void *src, int kind, int transposed) {
    static const char *const fn = "rx_ptmodel_base_fill";
    const rx_base_mat *b = mat_of(m, param, fn);
    if (!b) return RX_EINVAL;
    if (!src || (kind != RX_BASE_FP32 && kind != RX_BASE_BF16))
        return rx_fail(RX_EINVAL, "%s: src is NULL or kind %d unknown", fn, kind);
    rx_base *s = rx_ptmodel_base_store(m);
    return rx_base_fill(s, (int)(b - rx_base_at(s, 0)), src, kind, transposed || b->rows);
}

int rx_ptmodel_base_read(const rx_ptmodel *m, int param, float *dst) {
    const rx_base_mat *b = mat_of(m, param, "rx_ptmodel_base_read");
    if (!b || !dst) return b ? rx_fail(RX_EINVAL, "rx_ptmodel_base_read: dst is NULL") : RX_EINVAL;
    rx_base_read(rx_ptmodel_base_store(m), b, dst);
    return RX_OK;
}

const void *rx_ptmodel_base_data(const rx_ptmodel *m, int param, int64_t *bytes) {
    const rx_base_mat *b = mat_of(m, param, "rx_ptmodel_base_data");
    size_t nb = 0;
    const void *p = b ? rx_base_data(b, &nb) : NULL;
    if (bytes) *bytes = (int64_t)nb;
    return p;
}

int rx_ptmodel_base_rows(const rx_ptmodel *m, int param, void *dst) {
    const rx_base_mat *b = mat_of(m, param, "rx_ptmodel_base_rows");
    if (!b || !dst) return b ? rx_fail(RX_EINVAL, "rx_ptmodel_base_rows: dst is NULL") : RX_EINVAL;
    rx_base_rows(b, dst);
    return RX_OK;
}

int rx_ptmodel_base_info(const rx_ptmodel *m, int *dtype, int *n, int64_t *bytes) {
    const rx_base *s = m ? rx_ptmodel_base_store(m) : NULL;
    if (dtype) *dtype = rx_base_dtype(s);
    if (n) *n = rx_base_count(s);
    if (bytes) *bytes = (int64_t)rx_base_bytes(s);
    return RX_OK;
}

int rx_ptmodel_base_param(const rx_ptmodel *m, int i) {
    const rx_base_mat *b = rx_base_at(m ? rx_ptmodel_base_store(m) : NULL, i);
    return b ? rx_base_param(b)
             : rx_fail(RX_EINVAL, "rx_ptmodel_base_param: index %d is outside the base", i);
}

int rx_ptmodel_base_release(rx_ptmodel *m) {
    if (!m) return rx_fail(RX_EINVAL, "rx_ptmodel_base_release: model is NULL");
    rx_base *s = rx_ptmodel_base_store(m);
    if (!s) return RX_OK;
    rx_base_materialise(s);
    rx_ptmodel_attach_base(m, NULL);
    rx_base_free(s);
    return RX_OK;
}
