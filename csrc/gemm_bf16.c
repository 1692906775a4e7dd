/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * gemm_bf16.c -- the projections' GEMM in bf16 mixed precision.
 *
 *     C[M,N] = beta*C + op(A)[M,K] . op(B)[K,N]      (rx_sgemm's arguments)
 *
 * computed on operands rounded to bfloat16 (round to nearest even, fp32
 * subnormal inputs to signed zero, exactly as the vcvtne2ps2bf16
 * instruction converts) with fp32 accumulation
 * and an fp32 C. The product of two bf16 numbers is exact in fp32, so every
 * kernel below adds the same exact products: they differ only in the order
 * of the fp32 additions, and at most in products below 2^-126 that the
 * hardware flushes to zero. For a dot product of length K with P = the sum
 * of |a_k b_k| over the rounded operands, any two kernels therefore agree
 * within 2 * K * 2^-24 * (P + |C_old|) + K * 2^-125 (Higham's gamma_K bound
 * for each ordering, plus the flushed products); tests/test_gemm_bf16.py
 * holds them to that.
 *
 * Both operands are converted into a packed bf16 copy -- op(B) whole at the
 * start of a call, op(A) one 128-row panel at a time by the thread that
 * computes with it (compute_item):
 *   op(A): 16-row x 32-k blocks, each 16 rows of 64 bytes (an AMX A tile);
 *   op(B): 16-column x 32-k blocks, each 16 rows of k pairs x 16 columns
 *          (the "VNNI" layout of an AMX B tile, and one zmm per k pair).
 * M and N are padded with zeros to multiples of 32, K to a multiple of 32.
 * One layout serves every kernel:
 *   "amx-bf16"    2x2 AMX tiles (_tile_dpbf16ps), a 32x32 C block per pass;
 *   "avx512-bf16" 8x32 register tiles of vdpbf16ps (16 accumulators);
 *   "generic-bf16" portable C over the same packed operands, so a machine
 *          without bf16 hardware computes the same products.
 * The kernel is picked at run time (AMX where the CPU has AMX-BF16 and Linux
 * grants the tile-data state, else AVX512-BF16, else generic); everything
 * bf16-specific is compiled with per-function target attributes, so a
 * default build runs on any x86-64.
 *
 * Threading: a batch of independent GEMMs (as rx_sgemm_batch) packs every
 * op(B) in one parallel pass, then runs its compute items (128-row panels,
 * cut into column ranges when there are too few panels for the team).
 * Each C element is summed over all of K by one thread in a fixed order,
 * so the result does not depend on the thread count.
 */
#include <string.h>

#include "rx_internal.h"
#include "rx_simd.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define RX_BF16_X86 1
#endif

#define BT_R RX_BT_R         /* rows of a packed block (an AMX tile's rows): 16 */
#define BT_K RX_BT_K         /* k values of a packed block row: 32, 64 bytes */
#define BT_E (BT_R * BT_K)   /* bf16 elements of one packed block (1 KiB) */
#define BLK RX_BT_BLK        /* C block of one kernel call: 2x2 tiles, 32 */
#define PANEL 128            /* rows of op(A) a compute item packs and computes */
/* op(B) packing task: PACK_BCOLS 16-column blocks x up to PACK_KC k chunks.
 * 256 columns make each row's read a 1 KiB run the prefetchers follow (64
 * columns, a K-deep strip, left the head's packing waiting on memory), and
 * the k split keeps enough tasks for the team: a pass with fewer than two
 * tasks per thread halves its k chunks per task, down to one (bplan.kc). */
#define PACK_BCOLS 16
#define PACK_KC 4
#define KCB 8                /* k chunks (of BT_K) per range of compute_item */
/* Bytes of packed op(B) per K range in a column chunk of compute_item:
 * 256 KiB, which stays in a 2 MiB L2 while each 32-row block of the
 * panel runs over it. */
#define BCHUNK_BYTES (256 * 1024)
#define MAX_OPS 16           /* ops of one pass (rx_sgemm_batch's batch size) */
/* bf16 elements of packed op(B) one pass holds: 8 MiB. A batch whose
 * op(B)s outgrow it runs in passes over windows of its ops (bgemm_ops; the
 * head's 65,536 x 4,096 is 512 MiB whole), each C element still summed over
 * the same k ranges in the same order, so the bits do not depend on it. */
#define PACK_BUDGET ((size_t)4 << 20)
static size_t pack_budget = PACK_BUDGET;   /* rx_bgemm_pack_budget's */

size_t rx_bgemm_pack_budget(size_t elems) {
    return rx_gemm_set_budget(&pack_budget, elems, PACK_BUDGET);
}

typedef uint16_t bf16;

/* ---- rounding ------------------------------------------------------------ */

/* fp32 -> bf16 as vcvtne2ps2bf16 converts (rx_bf16_operand): the AVX-512
 * packers use that instruction, so every kernel sees the same bits. */
static inline bf16 bf16_round(float x) { return rx_bf16_operand(x); }

static inline float bf16_float(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* ---- one GEMM's packed operands ------------------------------------------ */

typedef struct {
    const rx_gemm_op *g;
    size_t mp, np, nkc;   /* M, N padded to BLK; the pass's k chunks (of BT_K) */
    bf16 *bp;             /* [np/16][nkc][16][32]; op(A) is packed per panel */
    int prepacked;        /* bp is a frozen base's store, read in place (never written) */
    /* The pass's window of the product: columns [j0, j1) (multiples of
     * BLK, j1 <= np) over k chunks [kw, kw + nkc) (kw a multiple of KCB);
     * only its blocks of op(B) are packed and held, bp addressing block
     * (j / 16, k chunk) of the whole op(B) */
    size_t j0, j1, kw;
} bop;

static inline float opa(const rx_gemm_op *g, size_t i, size_t k) {
    return g->ta ? g->A[k * g->lda + i] : g->A[i * g->lda + k];
}

static inline float opb(const rx_gemm_op *g, size_t k, size_t j) {
    return g->tb ? g->B[j * g->ldb + k] : g->B[k * g->ldb + j];
}

/* Packs the 16-row blocks [b0,b1) of op(A) into ap (block b0 first). */
static void pack_a_generic(const bop *o, size_t b0, size_t b1, bf16 *ap) {
    const rx_gemm_op *g = o->g;
    for (size_t rb = b0; rb < b1; rb++)
        for (size_t kc = 0; kc < o->nkc; kc++) {
            bf16 *dst = ap + ((rb - b0) * o->nkc + kc) * BT_E;
            for (size_t r = 0; r < BT_R; r++)
                for (size_t q = 0; q < BT_K; q++) {
                    size_t i = rb * BT_R + r, k = (o->kw + kc) * BT_K + q;
                    dst[r * BT_K + q] = i < g->M && k < g->K ? bf16_round(opa(g, i, k)) : 0;
                }
        }
}

/* Packs k chunks [k0,k1) of the 16-column blocks [b0,b1) of op(B): row p
 * of a block holds the k pair (2p, 2p+1) of its 16 columns interleaved. */
static void pack_b_generic(const bop *o, size_t b0, size_t b1, size_t k0, size_t k1) {
    const rx_gemm_op *g = o->g;
    for (size_t cb = b0; cb < b1; cb++)
        for (size_t kc = k0; kc < k1; kc++) {
            bf16 *dst = o->bp + (cb * o->nkc + kc) * BT_E;
            for (size_t q = 0; q < BT_K; q++)
                for (size_t c = 0; c < BT_R; c++) {
                    size_t k = kc * BT_K + q, j = cb * BT_R + c;
                    dst[q / 2 * BT_K + 2 * c + q % 2] =
                        j < g->N && k < g->K ? bf16_round(opb(g, k, j)) : 0;
                }
        }
}

/* Adds (acc) or writes the mr x nr valid part of a BLK x BLK result t. */
static void store_block(const float *t, float *C, size_t ldc, size_t mr, size_t nr, int acc) {
    for (size_t i = 0; i < mr; i++)
        for (size_t j = 0; j < nr; j++)
            C[i * ldc + j] = acc ? C[i * ldc + j] + t[i * BLK + j] : t[i * BLK + j];
}

/* C block [mr<=32][nr<=32] (+)= Ap[32 rows] . Bp[32 columns] over nk
 * k chunks; Ap, Bp point at the first chunk of the first of two row /
 * column blocks, the second starting bs elements further on. */
typedef void (*bkernel_fn)(const bf16 *Ap, const bf16 *Bp, size_t nk, size_t bs, float *C,
                           size_t ldc, size_t mr, size_t nr, int acc);

/* Sums in the order vdpbf16ps documents: per k pair the odd product, then
 * the even one, each added to the fp32 accumulator. */
static void kernel_generic(const bf16 *Ap, const bf16 *Bp, size_t nk, size_t bs, float *C,
                           size_t ldc, size_t mr, size_t nr, int acc) {
    float t[BLK * BLK];
    for (size_t i = 0; i < BLK; i++) {
        const bf16 *a = Ap + (i / BT_R) * bs + (i % BT_R) * BT_K;
        float s[BLK] = {0};
        for (size_t kc = 0; kc < nk; kc++)
            for (size_t p = 0; p < BT_K / 2; p++) {
                float a0 = bf16_float(a[kc * BT_E + 2 * p]), a1 = bf16_float(a[kc * BT_E + 2 * p + 1]);
                for (size_t j = 0; j < BLK; j++) {
                    const bf16 *b = Bp + (j / BT_R) * bs + kc * BT_E + p * BT_K + 2 * (j % BT_R);
                    s[j] += a1 * bf16_float(b[1]);
                    s[j] += a0 * bf16_float(b[0]);
                }
            }
        memcpy(t + i * BLK, s, sizeof s);
    }
    store_block(t, C, ldc, mr, nr, acc);
}

#ifdef RX_BF16_X86
/* The packers convert with vcvtne2ps2bf16, which every CPU that runs the
 * AMX or AVX512-BF16 kernel has (one instruction for 32 floats, where the
 * same rounding in integer arithmetic took about ten per 16: packing was
 * more than half of the bf16 GEMM's time). */
#define RX_PACK512 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define RX_DPBF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define RX_AMX __attribute__((target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")))

/* A run of 16 k values starting at k of a row whose valid k are < K,
 * zero past K (and everywhere for a row past the matrix: row NULL). */
RX_PACK512 static inline __m512 load16(const float *row, size_t k, size_t K) {
    return row ? _mm512_maskz_loadu_ps(rx_lanes(k, K), row + k) : _mm512_setzero_ps();
}

/* k pairs (k0 + 2p, k0 + 2p + 1), p < 16, of the 16 lanes from column x0
 * of k-major rows (row k at base + k * ld, valid lanes mask, valid k < K),
 * transposed in registers into 16 rows of 32 k values at dst. */
RX_PACK512 static inline void kmajor_block(const float *base, size_t ld, size_t x0, __mmask16 mask,
                                           size_t k0, size_t K, bf16 *dst) {
    __m512i v[16];
    for (size_t p = 0; p < 16; p++) {
        size_t k = k0 + 2 * p;
        __m512 lo = k < K ? _mm512_maskz_loadu_ps(mask, base + k * ld + x0) : _mm512_setzero_ps();
        __m512 hi = k + 1 < K ? _mm512_maskz_loadu_ps(mask, base + (k + 1) * ld + x0)
                              : _mm512_setzero_ps();
        v[p] = rx_pair_rows(lo, hi);
    }
    rx_transpose16(v);
    for (size_t r = 0; r < BT_R; r++) _mm512_storeu_si512(dst + r * BT_K, v[r]);
}

/* pack_a_generic with AVX-512: rows of an untransposed A are 32-float
 * runs; a transposed A is read as k-rows of 16 floats, paired and
 * transposed in registers. There k is the outer loop, so each k row is
 * read as one run over the task's blocks: block-outer, the reads strode
 * K rows apart and spent most of the packing time waiting on memory. */
RX_PACK512 static void pack_a_512(const bop *o, size_t b0, size_t b1, bf16 *ap) {
    const rx_gemm_op *g = o->g;
    const size_t M = g->M, K = g->K;
    if (g->ta) {
        for (size_t kc = 0; kc < o->nkc; kc++)
            for (size_t rb = b0; rb < b1; rb++)
                kmajor_block(g->A, g->lda, rb * BT_R, rx_lanes(rb * BT_R, M),
                             (o->kw + kc) * BT_K, K, ap + ((rb - b0) * o->nkc + kc) * BT_E);
        return;
    }
    for (size_t rb = b0; rb < b1; rb++)
        for (size_t kc = 0; kc < o->nkc; kc++) {
            bf16 *dst = ap + ((rb - b0) * o->nkc + kc) * BT_E;
            const size_t i0 = rb * BT_R, k0 = (o->kw + kc) * BT_K;
            for (size_t r = 0; r < BT_R; r++) {
                const float *row = i0 + r < M ? g->A + (i0 + r) * g->lda : NULL;
                _mm512_storeu_si512(dst + r * BT_K,
                                    rx_pairs32(load16(row, k0, K), load16(row, k0 + 16, K)));
            }
        }
}

/* pack_b_generic with AVX-512: an untransposed B pairs two k-rows of 16
 * columns (k outer, as for a transposed A); a transposed one reads each
 * column's 32-float k run and transposes. */
RX_PACK512 static void pack_b_512(const bop *o, size_t b0, size_t b1, size_t kc0, size_t kc1) {
    const rx_gemm_op *g = o->g;
    const size_t N = g->N, K = g->K;
    if (!g->tb) {
        for (size_t kc = kc0; kc < kc1; kc++)
            for (size_t cb = b0; cb < b1; cb++) {
                bf16 *dst = o->bp + (cb * o->nkc + kc) * BT_E;
                const size_t j0 = cb * BT_R, k0 = kc * BT_K;
                const __mmask16 mj = rx_lanes(j0, N);
                for (size_t p = 0; p < 16; p++) {
                    size_t k = k0 + 2 * p;
                    __m512 lo = k < K ? _mm512_maskz_loadu_ps(mj, g->B + k * g->ldb + j0)
                                      : _mm512_setzero_ps();
                    __m512 hi = k + 1 < K ? _mm512_maskz_loadu_ps(mj, g->B + (k + 1) * g->ldb + j0)
                                          : _mm512_setzero_ps();
                    _mm512_storeu_si512(dst + p * BT_K, rx_pair_rows(lo, hi));
                }
            }
        return;
    }
    for (size_t cb = b0; cb < b1; cb++)
        for (size_t kc = kc0; kc < kc1; kc++) {
            bf16 *dst = o->bp + (cb * o->nkc + kc) * BT_E;
            const size_t j0 = cb * BT_R, k0 = kc * BT_K;
            __m512i v[16];
            for (size_t c = 0; c < 16; c++) {
                const float *row = j0 + c < N ? g->B + (j0 + c) * g->ldb : NULL;
                v[c] = rx_pairs32(load16(row, k0, K), load16(row, k0 + 16, K));
            }
            rx_transpose16(v);
            for (size_t p = 0; p < 16; p++) _mm512_storeu_si512(dst + p * BT_K, v[p]);
        }
}

/* 8 rows x 32 columns of sums from rows [0,8) of the nk chunks of a
 * 16-row A block at a (Ap of kernel_avx512bf16 plus a row offset), stored
 * to t (row stride ldt), or added to it with acc (t + the sums: C's own
 * update, so a whole block's C is written here, not through a copy). */
RX_DPBF16 static inline void dp8x32(const bf16 *a, const bf16 *b0, const bf16 *b1, size_t nk,
                                    float *t, size_t ldt, int acc) {
    __m512 c[8][2];
    for (int i = 0; i < 8; i++) c[i][0] = c[i][1] = _mm512_setzero_ps();
    for (size_t kc = 0; kc < nk; kc++, a += BT_E, b0 += BT_E, b1 += BT_E)
        for (size_t p = 0; p < BT_K / 2; p++) {
            const __m512bh x0 = (__m512bh)_mm512_load_si512(b0 + p * BT_K);
            const __m512bh x1 = (__m512bh)_mm512_load_si512(b1 + p * BT_K);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                int32_t w;
                memcpy(&w, a + i * BT_K + 2 * p, sizeof w);
                const __m512bh y = (__m512bh)_mm512_set1_epi32(w);
                c[i][0] = _mm512_dpbf16_ps(c[i][0], y, x0);
                c[i][1] = _mm512_dpbf16_ps(c[i][1], y, x1);
            }
        }
    for (int i = 0; i < 8; i++) {
        float *ti = t + i * ldt;
        _mm512_storeu_ps(ti, acc ? _mm512_add_ps(_mm512_loadu_ps(ti), c[i][0]) : c[i][0]);
        _mm512_storeu_ps(ti + 16,
                         acc ? _mm512_add_ps(_mm512_loadu_ps(ti + 16), c[i][1]) : c[i][1]);
    }
}

RX_DPBF16 static void kernel_avx512bf16(const bf16 *Ap, const bf16 *Bp, size_t nk, size_t bs,
                                        float *C, size_t ldc, size_t mr, size_t nr, int acc) {
    float t[BLK * BLK] __attribute__((aligned(64)));
    const bf16 *b1 = Bp + bs;
    const int full = mr == BLK && nr == BLK;
    for (size_t i = 0; i < BLK; i += 8)
        if (i < mr)
            dp8x32(Ap + (i / BT_R) * bs + (i % BT_R) * BT_K, Bp, b1, nk,
                   full ? C + i * ldc : t + i * BLK, full ? ldc : BLK, full && acc);
    if (!full) store_block(t, C, ldc, mr, nr, acc);
}

/* The AMX tile configuration: palette 1, every tile 16 rows of 64 bytes. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

/* ldtilecfg by hand: GCC 12's _tile_loadconfig tells the compiler it reads
 * only 8 bytes of the configuration, which lets it drop the stores to the
 * rest (the instruction then faults on garbage). */
RX_AMX static void amx_configure(void) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

RX_AMX static void amx_release(void) { _tile_release(); }

/* Tiles 0-3 hold C (rows 0-15 / 16-31 x columns 0-15 / 16-31), 4-5 the two
 * A blocks, 6-7 the two B blocks of the current k chunk. With acc the
 * tiles start from the old C (through t for a ragged block) and keep
 * accumulating, so a C block summed over several calls of consecutive k
 * ranges gets exactly the bits of one call over all of them. */
RX_AMX static void kernel_amx(const bf16 *Ap, const bf16 *Bp, size_t nk, size_t bs, float *C,
                              size_t ldc, size_t mr, size_t nr, int acc) {
    const bf16 *a1 = Ap + bs, *b1 = Bp + bs;
    const int full = mr == BLK && nr == BLK;
    float t[BLK * BLK] __attribute__((aligned(64)));
    float *c = full ? C : t;
    const size_t s = (full ? ldc : BLK) * sizeof(float), ld = full ? ldc : BLK;
    if (acc) {
        if (!full) {
            memset(t, 0, sizeof t);
            for (size_t i = 0; i < mr; i++) memcpy(t + i * BLK, C + i * ldc, nr * sizeof(float));
        }
        _tile_loadd(0, c, s);
        _tile_loadd(1, c + 16, s);
        _tile_loadd(2, c + 16 * ld, s);
        _tile_loadd(3, c + 16 * ld + 16, s);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
    for (size_t kc = 0; kc < nk; kc++) {
        _tile_loadd(4, Ap + kc * BT_E, 64);
        _tile_loadd(6, Bp + kc * BT_E, 64);
        _tile_loadd(7, b1 + kc * BT_E, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a1 + kc * BT_E, 64);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, s);
    _tile_stored(1, c + 16, s);
    _tile_stored(2, c + 16 * ld, s);
    _tile_stored(3, c + 16 * ld + 16, s);
    if (!full)
        for (size_t i = 0; i < mr; i++) memcpy(C + i * ldc, t + i * BLK, nr * sizeof(float));
}

/* CPUID / XCR0 checks the compiler's __builtin_cpu_supports may not know. */
static int cpuid_bit(unsigned leaf, unsigned sub, int reg, int bit) {
    unsigned r[4];
    if (!__get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3])) return 0;
    return (r[reg] >> bit) & 1;
}

static uint64_t xcr0(void) {
    if (!cpuid_bit(1, 0, 2, 27)) return 0;   /* OSXSAVE */
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (uint64_t)hi << 32 | lo;
}

static int have_avx512bf16(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           cpuid_bit(7, 1, 0, 5);
}

/* AMX-BF16 and AMX-TILE in CPUID, the tile state enabled in XCR0, and
 * Linux's per-process permission for the tile data (ARCH_REQ_XCOMP_PERM
 * for XFEATURE_XTILEDATA), asked once. A refusal (an old kernel, a
 * seccomp filter) leaves AMX off and the AVX512-BF16 kernel in use. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
static int have_amx(void) {
    static int ok = -1;
    int v = __atomic_load_n(&ok, __ATOMIC_ACQUIRE);
    if (v >= 0) return v;
    v = have_avx512bf16() && cpuid_bit(7, 0, 3, 22) && cpuid_bit(7, 0, 3, 24) &&
        (xcr0() & (3u << 17)) == (3u << 17) &&
        syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    __atomic_store_n(&ok, v, __ATOMIC_RELEASE);
    return v;
}
#endif

typedef struct {
    const char *name;
    bkernel_fn kern;
    void (*pack_a)(const bop *, size_t, size_t, bf16 *);
    void (*pack_b)(const bop *, size_t, size_t, size_t, size_t);
    int amx;   /* tile configuration around the kernel calls */
} bgemm_impl;

static const bgemm_impl bimpl_generic = {"generic-bf16", kernel_generic, pack_a_generic,
                                         pack_b_generic, 0};
#ifdef RX_BF16_X86
static const bgemm_impl bimpl_avx512 = {"avx512-bf16", kernel_avx512bf16, pack_a_512, pack_b_512,
                                        0};
static const bgemm_impl bimpl_amx = {"amx-bf16", kernel_amx, pack_a_512, pack_b_512, 1};
#endif

static const bgemm_impl *const bimpls[] = {
#ifdef RX_BF16_X86
    &bimpl_amx, &bimpl_avx512,
#endif
    &bimpl_generic};

static int bimpl_runs(const bgemm_impl *im) {
#ifdef RX_BF16_X86
    if (im == &bimpl_amx) return have_amx();
    if (im == &bimpl_avx512) return have_avx512bf16();
#endif
    return im == &bimpl_generic;
}

/* Set by rx_bgemm_use_kernel or RWKVX_BF16_KERNEL; NULL: pick by CPU. */
static const bgemm_impl *forced_bimpl;

int rx_bgemm_use_kernel(const char *name) {
    if (!name) {
        forced_bimpl = NULL;
        return RX_OK;
    }
    for (size_t i = 0; i < sizeof bimpls / sizeof bimpls[0]; i++)
        if (!strcmp(name, bimpls[i]->name) && bimpl_runs(bimpls[i])) {
            forced_bimpl = bimpls[i];
            return RX_OK;
        }
    return rx_fail(RX_EINVAL, "rx_bgemm_use_kernel: kernel \"%s\" is unknown or cannot run here",
                   name);
}

static const bgemm_impl *pick_bimpl(void) {
    if (forced_bimpl) return forced_bimpl;
    static const bgemm_impl *picked;
    const bgemm_impl *im = __atomic_load_n(&picked, __ATOMIC_ACQUIRE);
    if (im) return im;
    /* the environment may name a kernel (tests, benchmarks); one this CPU
     * cannot run is ignored */
    const char *env = getenv("RWKVX_BF16_KERNEL");
    for (size_t i = 0; i < sizeof bimpls / sizeof bimpls[0] && !im; i++)
        if (env && !strcmp(env, bimpls[i]->name) && bimpl_runs(bimpls[i])) im = bimpls[i];
    for (size_t i = 0; i < sizeof bimpls / sizeof bimpls[0] && !im; i++)
        if (bimpl_runs(bimpls[i])) im = bimpls[i];
    __atomic_store_n(&picked, im, __ATOMIC_RELEASE);
    return im;
}

const char *rx_bgemm_kernel(void) { return pick_bimpl()->name; }

int rx_bgemm_hw(void) { return pick_bimpl() != &bimpl_generic; }

/* The step ratios behind this are in docs/performance.md §bf16 mixed
 * precision (bf16 step / fp32 step by CPU): AMD's vdpbf16ps (Zen 4 and 5)
 * issues at its FMA's rate, twice the flops; Intel's at half of it. */
int rx_bgemm_pays(void) {
#ifdef RX_BF16_X86
    const bgemm_impl *im = pick_bimpl();
    return im == &bimpl_amx || (im == &bimpl_avx512 && __builtin_cpu_is("amd"));
#else
    return 0;
#endif
}

/* ---- the batch driver ---------------------------------------------------- */

/* op(B) of g in the packed layout from a source that holds it so (a bf16
 * base at bf16 precision), read in place; else NULL */
static const uint16_t *prepacked_b(const rx_gemm_op *g) {
    return g->bsrc && !g->tb ? g->bsrc->packed(g->bsrc_of, g->N, g->K) : NULL;
}

/* The compute phase's work item: op k's rows [i0, i0+PANEL) by columns
 * [j0, j1). The item packs its A panel (PANEL rows, all of K) into the
 * thread's own buffer, where it stays in L2 while the item's columns are
 * computed -- packed all at once before the compute, op(A) of the long
 * projections (B*T rows) came back from L3. It then walks its columns in
 * chunks of BCHUNK_BYTES of packed op(B) per K range, K in ranges of KCB
 * chunks (256 k), and in each, the panel's 32-row blocks one after
 * another over the chunk's 32-column blocks: a block's A range (16 KiB)
 * stays in L1 while the B blocks stream from L2. (A 64-row panel, each B
 * block serving both its halves while the whole A range sat in L1, made a
 * bf16 step 1.5-3% slower, S and M at 1 and 2 threads: the B range of a
 * wide projection, all its columns, outgrew L2.) Each C element is summed over
 * all of K by one thread in a fixed order, so the result does not depend
 * on the thread count, nor on these block sizes. */
static void compute_item(const bgemm_impl *im, const bop *o, size_t i0, size_t j0, size_t j1,
                         bf16 *ap) {
    const rx_gemm_op *g = o->g;
    const size_t i1 = i0 + PANEL < o->mp ? i0 + PANEL : o->mp;
    const size_t bs = o->nkc * BT_E;
    im->pack_a(o, i0 / BT_R, i1 / BT_R, ap);
    const size_t kr = o->nkc < KCB ? o->nkc : KCB;
    size_t cw = BCHUNK_BYTES / (kr * BT_K * sizeof(bf16)) / BLK * BLK;
    if (cw < BLK) cw = BLK;
    for (size_t jc = j0; jc < j1; jc += cw) {
        const size_t jc1 = jc + cw < j1 ? jc + cw : j1;
        for (size_t kb = 0; kb < o->nkc; kb += KCB) {
            const size_t nk = o->nkc - kb < KCB ? o->nkc - kb : KCB;
            /* a k window after the first adds to what the earlier ones wrote */
            const int acc = kb > 0 || o->kw > 0 || g->beta != 0.0f;
            for (size_t i = i0; i < i1; i += BLK)
                for (size_t j = jc; j < jc1; j += BLK) {
                    size_t mr = g->M - i < BLK ? g->M - i : BLK, nr = g->N - j < BLK ? g->N - j : BLK;
                    im->kern(ap + (i - i0) / BT_R * bs + kb * BT_E,
                             o->bp + j / BT_R * bs + (o->kw + kb) * BT_E, nk, bs,
                             g->C + i * g->ldc + j, g->ldc, mr, nr, acc);
                }
        }
    }
}

/* Work of a pass: prefix counts of B packing tasks and of compute items
 * (per op: panels x column ranges of width cw). */
typedef struct {
    size_t pb[MAX_OPS + 1], ci[MAX_OPS + 1], ncr[MAX_OPS], cw[MAX_OPS];
    size_t kc;   /* k chunks per packing task */
} bplan;

/* Packing tasks of op o with kc k chunks per task. */
static size_t pack_tasks(const bop *o, size_t kc) {
    if (o->prepacked) return 0;
    return ((o->j1 - o->j0) / BT_R + PACK_BCOLS - 1) / PACK_BCOLS * ((o->nkc + kc - 1) / kc);
}

static size_t find_op(const size_t *prefix, size_t n, size_t w) {
    size_t k = 0;
    while (k + 1 < n && prefix[k + 1] <= w) k++;
    return k;
}

/* One pass's share of a live op (M, N, K >= 1): its columns [j0, j1),
 * multiples of BLK (j1 at most N rounded up to BLK), over k chunks [kw,
 * kw + nk) (kw a multiple of KCB, so each C element is summed over the
 * same KCB ranges in the same order as by the whole op). */
typedef struct {
    const rx_gemm_op *g;
    size_t j0, j1, kw, nk;
} bpiece;

/* Up to MAX_OPS pieces in one pass: op(B) of every piece is packed first
 * (the weights, or the output grads of a weight gradient), then the items
 * run. RX_ENOMEM (C untouched) when the packing buffer cannot be
 * allocated. */
static int bgemm_pass(const bgemm_impl *im, const bpiece *pc, size_t n) {
    bop o[MAX_OPS];
    bplan pl;
    int nt = rx_in_parallel() ? 1 : rx_max_threads();
    size_t need = 0, panel = 0, panels = 0;
    double total = 0.0;
    for (size_t k = 0; k < n; k++) {
        const rx_gemm_op *g = pc[k].g;
        o[k].g = g;
        o[k].mp = (g->M + BLK - 1) / BLK * BLK;
        o[k].np = (g->N + BLK - 1) / BLK * BLK;
        o[k].nkc = pc[k].nk;
        o[k].j0 = pc[k].j0;
        o[k].j1 = pc[k].j1;
        o[k].kw = pc[k].kw;
        /* a source holding this layout: its forward product reads it in place */
        const uint16_t *pre = prepacked_b(g);
        o[k].prepacked = pre != NULL;
        o[k].bp = (bf16 *)(uintptr_t)pre;
        if (!pre) need += (o[k].j1 - o[k].j0) * o[k].nkc * BT_K;
        if (PANEL * o[k].nkc * BT_K > panel) panel = PANEL * o[k].nkc * BT_K;
        panels += (o[k].mp + PANEL - 1) / PANEL;
        total += (double)g->M * (double)(o[k].j1 - o[k].j0) * (double)(o[k].nkc * BT_K);
    }
    /* below ~10 us of work a fork/join costs more than it saves */
    if (total < RX_GEMM_MIN_PAR) nt = 1;
    /* too few panels for the team: cut the columns too (each cut packs
     * its panel again, so only as far as two items per thread) */
    size_t cuts = panels >= 2 * (size_t)nt ? 1 : (2 * (size_t)nt + panels - 1) / panels;
    for (pl.kc = PACK_KC; pl.kc > 1; pl.kc /= 2) {
        size_t tasks = 0;
        for (size_t k = 0; k < n; k++) tasks += pack_tasks(&o[k], pl.kc);
        if (tasks >= 2 * (size_t)nt) break;
    }
    pl.pb[0] = pl.ci[0] = 0;
    for (size_t k = 0; k < n; k++) {
        size_t nblk = (o[k].j1 - o[k].j0) / BLK, ncr = cuts < nblk ? cuts : nblk;
        pl.cw[k] = (nblk + ncr - 1) / ncr * BLK;
        pl.ncr[k] = (o[k].j1 - o[k].j0 + pl.cw[k] - 1) / pl.cw[k];
        pl.pb[k + 1] = pl.pb[k] + pack_tasks(&o[k], pl.kc);
        pl.ci[k + 1] = pl.ci[k] + (o[k].mp + PANEL - 1) / PANEL * pl.ncr[k];
    }
    /* the calling thread's buffer: every op's packed op(B), then one A
     * panel per thread; grown to the largest pass seen (a training step
     * must not allocate) and freed with the thread */
    bf16 *pack = NULL;
    if (panel <= (SIZE_MAX / sizeof(bf16) - need) / (size_t)nt)
        pack = rx_thread_buffer(RX_BUF_BF16_PACK, (need + (size_t)nt * panel) * sizeof(bf16));
    if (!pack) return RX_ENOMEM;
    bf16 *p = pack;
    for (size_t k = 0; k < n; k++) {
        if (o[k].prepacked) continue;
        /* the window's blocks at p, bp addressing its first there */
        o[k].bp = (bf16 *)((uintptr_t)p -
                           (o[k].j0 / BT_R * o[k].nkc + o[k].kw) * BT_E * sizeof(bf16));
        p += (o[k].j1 - o[k].j0) * o[k].nkc * BT_K;
    }
    bf16 *const panels_at = p;
    const size_t npack = pl.pb[n], nitem = pl.ci[n];
    (void)nt; /* read only by the OpenMP pragma */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        bf16 *ap = panels_at + (size_t)rx_thread_id() * panel;
#pragma omp for schedule(dynamic, 1)
        for (size_t w = 0; w < npack; w++) {
            size_t k = find_op(pl.pb, n + 1, w), u = w - pl.pb[k];
            size_t nkg = (o[k].nkc + pl.kc - 1) / pl.kc, nb = o[k].j1 / BT_R;
            size_t b0 = o[k].j0 / BT_R + u / nkg * PACK_BCOLS, k0 = o[k].kw + u % nkg * pl.kc;
            const size_t b1 = b0 + PACK_BCOLS < nb ? b0 + PACK_BCOLS : nb;
            const size_t kend = o[k].kw + o[k].nkc, k1 = k0 + pl.kc < kend ? k0 + pl.kc : kend;
            if (o[k].g->bsrc)   /* a frozen base tensor: packed by its source */
                o[k].g->bsrc->pack_bf16(o[k].g->bsrc_of, o[k].g->tb, o[k].g->N, o[k].g->K,
                                        o[k].nkc, b0, b1, k0, k1, BT_R, BT_K, o[k].bp);
            else
                im->pack_b(&o[k], b0, b1, k0, k1);
        }
#ifdef RX_BF16_X86
        if (im->amx) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
        for (size_t w = 0; w < nitem; w++) {
            size_t k = find_op(pl.ci, n + 1, w), u = w - pl.ci[k];
            /* column range major: a thread's next item tends to share its B range */
            size_t np_k = (o[k].mp + PANEL - 1) / PANEL;
            size_t j0 = o[k].j0 + u / np_k * pl.cw[k];
            size_t j1 = j0 + pl.cw[k] < o[k].j1 ? j0 + pl.cw[k] : o[k].j1;
            compute_item(im, &o[k], u % np_k * PANEL, j0, j1, ap);
        }
#ifdef RX_BF16_X86
        if (im->amx) amx_release();
#endif
    }
    return RX_OK;
}

/* ---- small M -------------------------------------------------------------
 * Decoding multiplies a few rows (one per sequence) by every weight: the
 * packed path would round all of op(B) into its buffer first and compute
 * 32-row blocks to keep M rows. Up to the small-M bound (rx_sgemm_small_m,
 * 8 rows) a batch runs here instead, where kernel_generic is the kernel and
 * the CPU has AVX2: op(A)'s M rows rounded once; op(B) one 16-column block
 * (all of K) at a time, read in place from a store in the packed layout (a
 * bf16 base at bf16 precision), else packed by the packed path's own packer
 * (the source's for a base) into the thread's block buffer (K / 16 KiB).
 * Each C element is summed as kernel_generic sums it: per range of KCB k
 * chunks from zero, per k pair the odd product then the even one, each
 * product exact (bf16 x bf16 fits fp32) and each addition rounded -- a
 * multiply then an add, never fused (target avx2 without fma), as a fused
 * one would round products below 2^-126 differently -- and the range's sum
 * added to C (written: the first range with beta 0), as store_block does.
 * So the bits are the packed path's at any M, thread count and column cut.
 * The AVX-512 and AMX kernels come here too, each with a small kernel that
 * sums as its packed kernel does, on op(A)'s rows rounded to bf16 once:
 *   AMX (small_amx): tiles of M rows; a C element starts from zero (C with
 *     beta) and takes one tdpbf16ps per k chunk over all of K, the chain
 *     kernel_amx keeps across its calls;
 *   AVX512-BF16 (small_dp): per range of KCB k chunks, one vdpbf16ps per k
 *     pair from zero, the range's sum then added to C, as dp8x32 and
 *     kernel_avx512bf16 do; at up to 4 rows two column blocks' chains side
 *     by side (small_dp2), and a base's block made from its prefetched
 *     stored rows (small_rows_dp).
 * A tile or a vdpbf16ps lane computes each C element from its own row and
 * column alone, so the rows' count changes no bit (tests/test_bf16.py
 * holds each kernel's small path to its packed path's bits). */
#ifdef RX_BF16_X86
#define RX_BF16_AVX2 __attribute__((target("avx2")))

/* 8 columns (half h of a 16-column block) of R rows: C[R][nc] (+)= ar[R][K]
 * . bp[nkc blocks], ar the rows rounded (kp floats a row, zero past K); R a
 * constant at each use */
RX_BF16_AVX2 static inline __attribute__((always_inline)) void
small_half(size_t R, const float *ar, size_t kp, const bf16 *bp, size_t nkc, size_t h, float *C,
           size_t ldc, size_t nc, int beta_nz) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (size_t kb = 0; kb < nkc; kb += KCB) {
        const size_t ke = kb + KCB < nkc ? kb + KCB : nkc;
        __m256 s[8];
        for (size_t i = 0; i < R; i++) s[i] = _mm256_setzero_ps();
        for (size_t kc = kb; kc < ke; kc++) {
            const bf16 *blk = bp + kc * BT_E + 16 * h;
            const float *a = ar + kc * BT_K;
            for (size_t p = 0; p < BT_K / 2; p++) {
                /* a word per column: its even k in the low half, odd in the high */
                const __m256i w = _mm256_loadu_si256((const __m256i *)(const void *)(blk + p * BT_K));
                const __m256 ev = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
                const __m256 od = _mm256_castsi256_ps(_mm256_and_si256(w, hi));
                for (size_t i = 0; i < R; i++) {
                    s[i] = _mm256_add_ps(s[i], _mm256_mul_ps(_mm256_broadcast_ss(a + i * kp + 2 * p + 1), od));
                    s[i] = _mm256_add_ps(s[i], _mm256_mul_ps(_mm256_broadcast_ss(a + i * kp + 2 * p), ev));
                }
            }
        }
        const int acc = kb > 0 || beta_nz;
        for (size_t i = 0; i < R; i++) {
            float t[8];
            _mm256_storeu_ps(t, s[i]);
            float *c = C + i * ldc;
            for (size_t j = 0; j < nc; j++) c[j] = acc ? c[j] + t[j] : t[j];
        }
    }
}

/* F(r, ...) with r the constant equal to R (1..8; 8 past it), so each
 * instance keeps its r rows' sums in registers */
#define SMALL_BY_ROWS(R, F, ...)                                                                \
    do {                                                                                      \
        switch (R) {                                                                          \
        case 1: F(1, __VA_ARGS__); break;                                                     \
        case 2: F(2, __VA_ARGS__); break;                                                     \
        case 3: F(3, __VA_ARGS__); break;                                                     \
        case 4: F(4, __VA_ARGS__); break;                                                     \
        case 5: F(5, __VA_ARGS__); break;                                                     \
        case 6: F(6, __VA_ARGS__); break;                                                     \
        case 7: F(7, __VA_ARGS__); break;                                                     \
        default: F(8, __VA_ARGS__); break;                                                    \
        }                                                                                     \
    } while (0)

RX_BF16_AVX2 static void small_block(size_t R, const float *ar, size_t kp, const bf16 *bp,
                                     size_t nkc, size_t h, float *C, size_t ldc, size_t nc,
                                     int beta_nz) {
    SMALL_BY_ROWS(R, small_half, ar, kp, bp, nkc, h, C, ldc, nc, beta_nz);
}

/* op(B)'s column block cb (all of K, nkc chunks) into dst as pack_bf16
 * lays it out, from a base's stored rows: rows_bf16's blocks, or its
 * [16][32] tiles (the values its block packer rounds) transposed into k
 * pairs in registers, the block packer's own last step, so the same bits;
 * the next column block's rows are prefetched a slice a call (16 rows
 * stepping along k are more streams than the hardware prefetchers
 * follow). 0 where the source has no such rows (then nothing is left
 * written that counts). */
RX_DPBF16 static int small_rows_dp(const rx_gemm_op *g, size_t nkc, size_t cb, bf16 *dst) {
    if (!g->bsrc || g->tb || !g->bsrc->rows_bf16 || 16 * cb + 16 > g->N) return 0;
    for (size_t kc = 0; kc < nkc; kc++) {
        bf16 *blk = dst + kc * BT_E;
        const int got = g->bsrc->rows_bf16(g->bsrc_of, g->N, g->K, 16 * cb, kc * BT_K,
                                           16 * (cb + 1), 1, blk);
        if (got == RX_ROWS_NONE) return 0;
        if (got == RX_ROWS_PAIRS) continue;
        __m512i v[BT_R];
        for (int r = 0; r < BT_R; r++) v[r] = _mm512_loadu_si512(blk + BT_K * r);
        rx_transpose16(v);
        for (int p = 0; p < BT_K / 2; p++) _mm512_storeu_si512(blk + p * BT_K, v[p]);
    }
    return 1;
}

/* C[R][nc] (+)= ab[R][kp] . bp[nkc blocks] for one 16-column block (nc <=
 * 16 valid), ab the rows rounded to bf16 (zero past K), summed as
 * kernel_avx512bf16 sums: per range of KCB chunks, from zero, one
 * vdpbf16ps per k pair (A's pair broadcast, B's row of 16 columns), then
 * added to C (written: the first range with beta 0). R a constant at each use. */
RX_DPBF16 static inline __attribute__((always_inline)) void
small_dp_rows(size_t R, const bf16 *ab, size_t kp, const bf16 *bp, size_t nkc, float *C,
              size_t ldc, size_t nc, int beta_nz) {
    const __mmask16 m = (__mmask16)((1u << nc) - 1u);
    for (size_t kb = 0; kb < nkc; kb += KCB) {
        const size_t ke = kb + KCB < nkc ? kb + KCB : nkc;
        __m512 c[8];
#pragma GCC unroll 8
        for (size_t i = 0; i < R; i++) c[i] = _mm512_setzero_ps();
        for (size_t kc = kb; kc < ke; kc++) {
            const bf16 *blk = bp + kc * BT_E, *a = ab + kc * BT_K;
#pragma GCC unroll 4
            for (size_t p = 0; p < BT_K / 2; p++) {
                const __m512bh x = (__m512bh)_mm512_load_si512(blk + p * BT_K);
#pragma GCC unroll 8
                for (size_t i = 0; i < R; i++) {
                    int32_t w;
                    memcpy(&w, a + i * kp + 2 * p, sizeof w);
                    c[i] = _mm512_dpbf16_ps(c[i], (__m512bh)_mm512_set1_epi32(w), x);
                }
            }
        }
        const int acc = kb > 0 || beta_nz;
#pragma GCC unroll 8
        for (size_t i = 0; i < R; i++) {
            float *ci = C + i * ldc;
            _mm512_mask_storeu_ps(ci, m, acc ? _mm512_add_ps(_mm512_maskz_loadu_ps(m, ci), c[i])
                                             : c[i]);
        }
    }
}

RX_DPBF16 static void small_dp(size_t R, const bf16 *ab, size_t kp, const bf16 *bp, size_t nkc,
                               float *C, size_t ldc, size_t nc, int beta_nz) {
    SMALL_BY_ROWS(R, small_dp_rows, ab, kp, bp, nkc, C, ldc, nc, beta_nz);
}

/* small_dp_rows over two column blocks side by side (b0 whole, b1 nc1 <= 16
 * valid columns, C's columns 16 on), each column its own lane's chain as
 * before, so the same bits: at R <= 4 rows one block's R chains leave the
 * vdpbf16ps latency bare; two blocks' 2R interleave. */
RX_DPBF16 static inline __attribute__((always_inline)) void
small_dp2_rows(size_t R, const bf16 *ab, size_t kp, const bf16 *b0, const bf16 *b1, size_t nkc,
               float *C, size_t ldc, size_t nc1, int beta_nz) {
    const __mmask16 m1 = (__mmask16)((1u << nc1) - 1u);
    for (size_t kb = 0; kb < nkc; kb += KCB) {
        const size_t ke = kb + KCB < nkc ? kb + KCB : nkc;
        __m512 c0[4], c1[4];
#pragma GCC unroll 4
        for (size_t i = 0; i < R; i++) c0[i] = c1[i] = _mm512_setzero_ps();
        for (size_t kc = kb; kc < ke; kc++) {
            const bf16 *k0 = b0 + kc * BT_E, *k1 = b1 + kc * BT_E, *a = ab + kc * BT_K;
#pragma GCC unroll 4
            for (size_t p = 0; p < BT_K / 2; p++) {
                const __m512bh x0 = (__m512bh)_mm512_load_si512(k0 + p * BT_K);
                const __m512bh x1 = (__m512bh)_mm512_load_si512(k1 + p * BT_K);
#pragma GCC unroll 4
                for (size_t i = 0; i < R; i++) {
                    int32_t w;
                    memcpy(&w, a + i * kp + 2 * p, sizeof w);
                    const __m512bh av = (__m512bh)_mm512_set1_epi32(w);
                    c0[i] = _mm512_dpbf16_ps(c0[i], av, x0);
                    c1[i] = _mm512_dpbf16_ps(c1[i], av, x1);
                }
            }
        }
        const int acc = kb > 0 || beta_nz;
#pragma GCC unroll 4
        for (size_t i = 0; i < R; i++) {
            float *ci = C + i * ldc;
            _mm512_storeu_ps(ci, acc ? _mm512_add_ps(_mm512_loadu_ps(ci), c0[i]) : c0[i]);
            _mm512_mask_storeu_ps(ci + 16, m1, acc ? _mm512_add_ps(
                                                         _mm512_maskz_loadu_ps(m1, ci + 16), c1[i])
                                                   : c1[i]);
        }
    }
}

RX_DPBF16 static void small_dp2(size_t R, const bf16 *ab, size_t kp, const bf16 *b0,
                                const bf16 *b1, size_t nkc, float *C, size_t ldc, size_t nc1,
                                int beta_nz) {
    switch (R) {
    case 1: small_dp2_rows(1, ab, kp, b0, b1, nkc, C, ldc, nc1, beta_nz); break;
    case 2: small_dp2_rows(2, ab, kp, b0, b1, nkc, C, ldc, nc1, beta_nz); break;
    case 3: small_dp2_rows(3, ab, kp, b0, b1, nkc, C, ldc, nc1, beta_nz); break;
    default: small_dp2_rows(4, ab, kp, b0, b1, nkc, C, ldc, nc1, beta_nz); break;
    }
}

/* The tiles of small_amx for R rows: 0 C (R x 16 floats), 1 A (R rows of
 * a k chunk), 2 B (one block) */
RX_AMX static void small_amx_configure(size_t R) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 3; i++) cfg.colsb[i] = 64;
    cfg.rows[0] = cfg.rows[1] = (uint8_t)R;
    cfg.rows[2] = BT_R;
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

/* C[R][nc] (+)= ab[R][kp] . bp[nkc blocks] for one 16-column block, tiles
 * configured for R rows: the C tile from zero (C itself with beta), one
 * tdpbf16ps per k chunk over all of K, stored once: kernel_amx's chain. */
RX_AMX static void small_amx(size_t R, const bf16 *ab, size_t kp, const bf16 *bp, size_t nkc,
                             float *C, size_t ldc, size_t nc, int beta_nz) {
    float t[BT_R * 16] __attribute__((aligned(64)));
    if (beta_nz) {
        for (size_t i = 0; i < R; i++) {
            memcpy(t + 16 * i, C + i * ldc, nc * sizeof(float));
            memset(t + 16 * i + nc, 0, (16 - nc) * sizeof(float));
        }
        _tile_loadd(0, t, 64);
    } else {
        _tile_zero(0);
    }
    for (size_t kc = 0; kc < nkc; kc++) {
        _tile_loadd(1, ab + kc * BT_K, kp * sizeof(bf16));
        _tile_loadd(2, bp + kc * BT_E, 64);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, t, 64);
    for (size_t i = 0; i < R; i++) memcpy(C + i * ldc, t + 16 * i, nc * sizeof(float));
}

/* AMX over a source that gives W^T's rows as tiles (rows_bf16: a Q8_0,
 * Q4_0 or Q4_K base): the transposed product C^T = W^T . A^T, so the
 * weights are the A tile, decoded row by row without the transpose into
 * the k-pair layout, and op(A)'s R rows are the B tile (xv: per k chunk, 16
 * rows of R k pairs). A C element takes the same products in the same k
 * pairs in the same order (each bf16 x bf16 product exact, the same pair
 * slots), so its bits are small_amx's. Two column blocks go side by side,
 * each its own chain (tiles 0 and 3 their C^T, 1 and 4 their weights, 2
 * xv): one block's tdpbf16ps waits on the one before it, and the other
 * block's decode and product fill that wait. */
RX_AMX static void small_amx_t_configure(size_t R) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 5; i++) cfg.colsb[i] = 64, cfg.rows[i] = BT_R;
    cfg.colsb[0] = cfg.colsb[2] = cfg.colsb[3] = (uint16_t)(R * 4);
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}

/* C^T of column block j0 / 16 from zero (C with beta) into tile T, R rows */
#define SMALL_T_START(T, t, j0)                                                               \
    do {                                                                                      \
        if (g->beta != 0.0f) {                                                                \
            for (size_t j = 0; j < 16; j++)                                                   \
                for (size_t i = 0; i < R; i++) (t)[16 * j + i] = g->C[i * g->ldc + (j0) + j]; \
            _tile_loadd(T, t, 64);                                                            \
        } else {                                                                              \
            _tile_zero(T);                                                                    \
        }                                                                                     \
    } while (0)

/* Column blocks cb and (two) cb + 1, 16 whole columns each, of op g from
 * W^T's rows, tiles configured by small_amx_t_configure(R); pj: the first
 * column the thread takes next (RX_NO_ROWS: none), prefetched meanwhile.
 * Returns 0 (C untouched) where the source gives no rows for them. */
RX_AMX static int small_amx_t(size_t R, const bf16 *xv, const rx_gemm_op *g, size_t nkc,
                              size_t cb, int two, size_t pj) {
    bf16 w[2][BT_R * BT_K] __attribute__((aligned(64)));
    float t[2][BT_R * 16] __attribute__((aligned(64)));   /* C^T: row j, column i */
    const rx_gemm_source *src = g->bsrc;
    const size_t j0 = 16 * cb, j1 = j0 + 16;
    const size_t p0 = pj, p1 = pj == RX_NO_ROWS ? pj : pj + 16;
    if (!src->rows_bf16(g->bsrc_of, g->N, g->K, j0, 0, p0, 0, w[0]) ||
        (two && !src->rows_bf16(g->bsrc_of, g->N, g->K, j1, 0, p1, 0, w[1])))
        return 0;
    SMALL_T_START(0, t[0], j0);
    if (two) SMALL_T_START(3, t[1], j1);
    for (size_t kc = 0; kc < nkc; kc++) {
        if (kc) src->rows_bf16(g->bsrc_of, g->N, g->K, j0, kc * BT_K, p0, 0, w[0]);
        _tile_loadd(1, w[0], 64);
        _tile_loadd(2, xv + kc * BT_K * R, R * 4);
        _tile_dpbf16ps(0, 1, 2);
        if (!two) continue;
        if (kc) src->rows_bf16(g->bsrc_of, g->N, g->K, j1, kc * BT_K, p1, 0, w[1]);
        _tile_loadd(4, w[1], 64);
        _tile_dpbf16ps(3, 4, 2);
    }
    _tile_stored(0, t[0], 64);
    if (two) _tile_stored(3, t[1], 64);
    for (int h = 0; h <= two; h++)
        for (size_t j = 0; j < 16; j++)
            for (size_t i = 0; i < R; i++) g->C[i * g->ldc + j0 + 16 * (size_t)h + j] = t[h][16 * j + i];
    return 1;
}
#undef SMALL_T_START

/* column block cb of op(B) in the packed layout: in place from a packed
 * store, else into scratch (room for one block: nkc chunks) */
static const bf16 *small_block_b(const bgemm_impl *im, const bop *o, size_t cb, bf16 *scratch) {
    const rx_gemm_op *g = o->g;
    const size_t E = o->nkc * BT_E;
    if (o->bp) return o->bp + cb * E;
    if (!(im == &bimpl_avx512 && small_rows_dp(g, o->nkc, cb, scratch))) {
        /* the packers write block (cb, kc) at bp + (cb * nkc + kc) * BT_E: a
         * base address one column block stride below the scratch puts them in it */
        bf16 *at = (bf16 *)(uintptr_t)((uintptr_t)scratch - cb * E * sizeof(bf16));
        if (g->bsrc)
            g->bsrc->pack_bf16(g->bsrc_of, g->tb, g->N, g->K, o->nkc, cb, cb + 1, 0, o->nkc,
                               BT_R, BT_K, at);
        else {
            bop ob = *o;
            ob.bp = at;
            im->pack_b(&ob, cb, cb + 1, 0, o->nkc);
        }
    }
    return scratch;
}

/* Column block cb (16 columns, all of K) of op o into C from its packed
 * block bp; ar: op(A)'s rows rounded (floats for the generic kernel, bf16
 * for the others) */
static void small_one(const bgemm_impl *im, const bop *o, const float *ar, size_t cb,
                      const bf16 *bp) {
    const rx_gemm_op *g = o->g;
    const size_t kp = o->nkc * BT_K, nb = g->N - 16 * cb < 16 ? g->N - 16 * cb : 16;
    if (im != &bimpl_generic) {
        const bf16 *ab = (const bf16 *)(const void *)ar;
        if (im->amx) small_amx(g->M, ab, kp, bp, o->nkc, g->C + 16 * cb, g->ldc, nb,
                               g->beta != 0.0f);
        else small_dp(g->M, ab, kp, bp, o->nkc, g->C + 16 * cb, g->ldc, nb, g->beta != 0.0f);
        return;
    }
    for (size_t h = 0; h < 2 && 16 * cb + 8 * h < g->N; h++) {
        const size_t j0 = 16 * cb + 8 * h, nc = g->N - j0 < 8 ? g->N - j0 : 8;
        small_block(g->M, ar, kp, bp, o->nkc, h, g->C + j0, g->ldc, nc, g->beta != 0.0f);
    }
}

/* C's column block cb (and cb + 1 with two, at most 4 rows, AVX512-BF16:
 * small_dp2) of op o from its rows ar; scratch: room for two blocks */
static void small_unit(const bgemm_impl *im, const bop *o, const float *ar, size_t cb, int two,
                       bf16 *scratch) {
    const rx_gemm_op *g = o->g;
    const size_t E = o->nkc * BT_E, kp = o->nkc * BT_K;
    if (two && im == &bimpl_avx512 && g->M <= 4) {
        const bf16 *b0 = small_block_b(im, o, cb, scratch);
        const bf16 *b1 = small_block_b(im, o, cb + 1, scratch + E);
        const size_t nc1 = g->N - 16 * (cb + 1) < 16 ? g->N - 16 * (cb + 1) : 16;
        small_dp2(g->M, (const bf16 *)(const void *)ar, kp, b0, b1, o->nkc, g->C + 16 * cb,
                  g->ldc, nc1, g->beta != 0.0f);
        return;
    }
    for (size_t c = cb; c < cb + 1 + (size_t)two; c++)
        small_one(im, o, ar, c, small_block_b(im, o, c, scratch));
}

/* whether the batch takes the small-M path */
static int small_bbatch(const bgemm_impl *im, const rx_gemm_op *ops, size_t n) {
    if (im == &bimpl_generic && !__builtin_cpu_supports("avx2")) return 0;
    const size_t bound = rx_gemm_small_bound();
    for (size_t k = 0; k < n; k++)
        if (ops[k].M > bound || ops[k].M > 8) return 0;
    return n > 0;
}

/* The small-M batch (n <= MAX_OPS live ops); RX_ENOMEM when its buffer
 * cannot be had */
static int bgemm_small(const bgemm_impl *im, const rx_gemm_op *ops, size_t n) {
    bop o[MAX_OPS];
    size_t first[MAX_OPS + 1], arow[MAX_OPS + 1], maxe = 0;
    double total = 0.0;
    first[0] = arow[0] = 0;
    for (size_t k = 0; k < n; k++) {
        const rx_gemm_op *g = &ops[k];
        o[k].g = g;
        o[k].nkc = (g->K + BT_K - 1) / BT_K;
        o[k].mp = o[k].np = o[k].j0 = o[k].j1 = o[k].kw = 0;
        const uint16_t *pre = prepacked_b(g);
        o[k].prepacked = pre != NULL;
        o[k].bp = (bf16 *)(uintptr_t)pre;
        if (!pre && o[k].nkc * BT_E > maxe) maxe = o[k].nkc * BT_E;
        /* a unit: two column blocks (small_amx_t's pair) */
        first[k + 1] = first[k] + ((g->N + BT_R - 1) / BT_R + 1) / 2;
        arow[k + 1] = arow[k] + g->M * o[k].nkc * BT_K;
        total += (double)g->M * g->N * g->K;
    }
    int nt = rx_in_parallel() || total < RX_GEMM_MIN_PAR ? 1 : rx_max_threads();
    /* the rounded rows of every op, then a thread's room for two blocks */
    const size_t bytes = arow[n] * sizeof(float) + (size_t)nt * 2 * maxe * sizeof(bf16);
    float *ar = rx_thread_buffer(RX_BUF_BF16_PACK, bytes);
    if (!ar) return RX_ENOMEM;
    bf16 *blocks = (bf16 *)(void *)(ar + arow[n]);
    /* the generic kernel takes the rounded values as floats, the others as
     * bf16 (op k's rows at the same offset, half of its room used) */
    const int hw = im != &bimpl_generic;
    size_t kpad[MAX_OPS];
    int trans_op[MAX_OPS];
    for (size_t k = 0; k < n; k++) {
        const rx_gemm_op *g = &ops[k];
        const size_t kp = kpad[k] = o[k].nkc * BT_K;
        bf16 *ab = (bf16 *)(void *)(ar + arow[k]);
        for (size_t i = 0; i < g->M; i++)
            for (size_t q = 0; q < kp; q++) {
                const bf16 h = q < g->K ? bf16_round(opa(g, i, q)) : 0;
                if (hw) ab[i * kp + q] = h;
                else ar[arow[k] + i * kp + q] = bf16_float(h);
            }
        /* an op small_amx_t takes: the same rows as k pairs, in the room's
         * other half: chunk kc, pair p, row i at (kc * 16 + p) * M + i */
        trans_op[k] = im->amx && !o[k].bp && g->bsrc && !g->tb && g->bsrc->rows_bf16;
        if (trans_op[k])
            for (size_t i = 0; i < g->M; i++)
                for (size_t q = 0; q < kp; q += 2) {
                    bf16 *x = ab + g->M * kp + 2 * (q / 2 * g->M + i);
                    x[0] = ab[i * kp + q];
                    x[1] = ab[i * kp + q + 1];
                }
    }
    const long nu = (long)first[n];
    (void)nt; /* read only by the OpenMP pragma */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        /* the AMX tiles' configuration: rows (0: none), transposed or not */
        size_t rows = 0;
        int trans = 0;
#pragma omp for schedule(static)
        for (long u = 0; u < nu; u++) {
            const size_t k = find_op(first, n + 1, (size_t)u), cb = 2 * ((size_t)u - first[k]);
            const rx_gemm_op *g = &ops[k];
            bf16 *scratch = blocks + (size_t)rx_thread_id() * 2 * maxe;
            const int two = 16 * (cb + 1) < g->N;   /* a second column block */
            size_t c = cb;                          /* the first block not yet done */
            if (trans_op[k] && 16 * cb + 16 <= g->N) {
                if (g->M != rows || !trans) small_amx_t_configure(rows = g->M), trans = 1;
                const bf16 *xv = (const bf16 *)(const void *)(ar + arow[k]) + g->M * kpad[k];
                const int both = two && 16 * cb + 32 <= g->N;   /* both whole */
                if (small_amx_t(g->M, xv, g, o[k].nkc, cb, both, 16 * (cb + 2)))
                    c += both ? 2 : 1;
            }
            if (!im->amx) small_unit(im, &o[k], ar + arow[k], cb, two, scratch);
            else
                for (; c < cb + 1 + (size_t)two; c++) {
                    if (g->M != rows || trans) small_amx_configure(rows = g->M), trans = 0;
                    small_unit(im, &o[k], ar + arow[k], c, 0, scratch);
                }
        }
        if (rows) amx_release();
    }
    return RX_OK;
}
#endif

/* The packed path over n <= MAX_OPS live ops: one pass when their op(B)s
 * fit the budget (PACK_BUDGET), else ops whole gathered into passes while
 * they fit, and an op beyond the budget alone in passes over windows:
 * along K (KCB-aligned, in k order) when K >= N, where column windows
 * would pack each A panel over all of K once per window (the head's dX,
 * K = vocab); else along N (the head's logits). A window stays at least
 * KCB k chunks by BLK columns. A prepacked op(B) is read in place and
 * takes none of the budget. */
static int bgemm_ops(const bgemm_impl *im, const rx_gemm_op *ops, size_t n) {
    bpiece pc[MAX_OPS];
    size_t np = 0, held = 0;   /* the pieces gathered, their packed elements */
    int rc = RX_OK;
    for (size_t k = 0; k < n && rc == RX_OK; k++) {
        const rx_gemm_op *g = &ops[k];
        const size_t cols = (g->N + BLK - 1) / BLK * BLK, nkc = (g->K + BT_K - 1) / BT_K;
        const size_t e = prepacked_b(g) ? 0 : cols * nkc * BT_K;
        if (np && (np == MAX_OPS || held + e > pack_budget)) {
            rc = bgemm_pass(im, pc, np);
            np = held = 0;
        }
        if (e <= pack_budget) {
            pc[np++] = (bpiece){g, 0, cols, 0, nkc};
            held += e;
            continue;
        }
        size_t w = cols, kn = nkc;   /* a window's columns and k chunks */
        if (g->K >= g->N) {
            kn = pack_budget / (cols * BT_K) / KCB * KCB;
            if (kn < KCB) kn = KCB;
        }
        if (w * kn * BT_K > pack_budget) {
            w = pack_budget / (kn * BT_K) / BLK * BLK;
            if (w < BLK) w = BLK;
        }
        for (size_t j0 = 0; j0 < cols && rc == RX_OK; j0 += w)
            for (size_t kw = 0; kw < nkc && rc == RX_OK; kw += kn) {
                const bpiece one = {g, j0, j0 + w < cols ? j0 + w : cols, kw,
                                    kw + kn < nkc ? kn : nkc - kw};
                rc = bgemm_pass(im, &one, 1);
            }
    }
    return rc == RX_OK && np ? bgemm_pass(im, pc, np) : rc;
}

int rx_bgemm_batch(const rx_gemm_op *ops, size_t n) {
    const bgemm_impl *im = pick_bimpl();
    int rc = rx_gemm_check_batch("rx_bgemm", ops, n);
    if (rc != RX_OK) return rc;
    rx_prof_push(RX_PROF_GEMM);
    for (size_t b = 0; b < n && rc == RX_OK; b += MAX_OPS) {
        rx_gemm_op live[MAX_OPS];
        const size_t nl = rx_gemm_live_ops(ops + b, n - b < MAX_OPS ? n - b : MAX_OPS, live);
#ifdef RX_BF16_X86
        if (small_bbatch(im, live, nl)) {
            rc = bgemm_small(im, live, nl);
            continue;
        }
#endif
        if (nl) rc = bgemm_ops(im, live, nl);
    }
    rx_prof_pop();
    if (rc != RX_OK && !rx_in_parallel())
        rx_fail(rc, "rx_bgemm: out of memory for the bf16 packing buffer");
    return rc;
}

int rx_bgemm(int ta, int tb, size_t M, size_t N, size_t K, const float *A, size_t lda,
             const float *B, size_t ldb, float beta, float *C, size_t ldc) {
    const rx_gemm_op g = {ta, tb, M, N, K, A, lda, B, ldb, beta, C, ldc};
    return rx_bgemm_batch(&g, 1);
}
