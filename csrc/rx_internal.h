/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * rx_internal.h -- helpers shared by the C core; not part of the public API.
 */
#ifndef RWKVX_INTERNAL_H
#define RWKVX_INTERNAL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The legacy forms' deprecation attribute stays live for the core (no
 * RX_NO_DEPRECATION_WARNINGS here): defining a deprecated function does not
 * warn, and no legacy form calls another (each calls its int form or the
 * kernel beneath it), so a deprecation warning in this build means core
 * code calls a legacy form, which it should not. */
#include "rx_pretrain.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* Hot per-row kernels are compiled for baseline x86-64 and for x86-64-v3
 * (AVX2+FMA); the loader picks one at run time, so a default build runs on
 * any x86-64 and still uses wide vectors where the CPU has them. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(RX_NO_CLONES)
#define RX_HOT __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define RX_HOT
#endif

static inline int rx_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static inline int rx_thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Threads of the current team (1 outside a parallel region). */
static inline int rx_team_size(void) {
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

static inline int rx_in_parallel(void) {
#ifdef _OPENMP
    return omp_in_parallel();
#else
    return 1;
#endif
}

/* Array allocation with the n*size product checked for overflow. Returns
 * NULL on overflow or failure; n == 0 allocates one element so callers can
 * treat NULL as failure only. 64-byte aligned for vector loads. */
static inline void *rx_alloc(size_t n, size_t size) {
    if (n == 0) n = 1;
    if (size != 0 && n > SIZE_MAX / size) return NULL;
    size_t bytes = n * size;
    bytes = (bytes + 63) & ~(size_t)63;
    return aligned_alloc(64, bytes);
}

static inline float *rx_falloc(size_t n) { return (float *)rx_alloc(n, sizeof(float)); }

static inline float *rx_fcalloc(size_t n) {
    float *p = rx_falloc(n);
    if (p) for (size_t i = 0; i < n; i++) p[i] = 0.0f;
    return p;
}

static inline void rx_fzero(float *p, size_t n) {
    if (p) for (size_t i = 0; i < n; i++) p[i] = 0.0f;
}

/* Marks an output of a void API function that got invalid arguments. */
static inline void rx_fnan(float *p, size_t n) {
    if (p) for (size_t i = 0; i < n; i++) p[i] = NAN;
}

/* Buffers carved from one allocation: rx_lines(n) floats hold n in whole
 * 64-byte lines plus one more, so that buffers of one power-of-two size do
 * not all start in the same cache set (a pass over six of them would evict
 * its own lines); rx_carve hands out the next n. */
static inline size_t rx_lines(size_t n) { return ((n + 15) & ~(size_t)15) + 16; }

static inline float *rx_carve(float **p, size_t n) {
    float *r = *p;
    *p += rx_lines(n);
    return r;
}

/* Elementwise passes over n floats run OpenMP over chunks of this many,
 * and only from this many floats on (below, one thread is faster) */
#define RX_EW_CHUNK ((size_t)16384)
#define RX_EW_MIN_PAR ((size_t)65536)
/* Row reductions (norms, softmax) over fewer elements run on one thread */
#define RX_ROW_MIN_PAR ((size_t)32768)

static inline size_t rx_ew_len(size_t i0, size_t n) {
    return n - i0 < RX_EW_CHUNK ? n - i0 : RX_EW_CHUNK;
}

/* c ? a : b by bit masks. GCC (with the default -ftrapping-math) will not
 * if-convert a float ?: whose arms compute anything, so a loop holding one
 * stays scalar; this form vectorises to a compare and an and/or. */
static inline float rx_selectf(int c, float a, float b) {
    uint32_t ua, ub, m = 0u - (uint32_t)(c != 0);
    memcpy(&ua, &a, sizeof ua);
    memcpy(&ub, &b, sizeof ub);
    ua = (ua & m) | (ub & ~m);
    memcpy(&a, &ua, sizeof a);
    return a;
}

/* e^x without a libm call or a branch, so loops calling it vectorise:
 * Cody-Waite reduction x = n ln2 + r (|r| <= ln2/2), Cephes' polynomial for
 * e^r, then 2^n applied as two normal power-of-two factors, so a subnormal
 * result is rounded once, as by ldexpf. Within 1.5 ulp of e^x everywhere
 * (tests/c/test_fastmath.c); +inf above ~88.72, +0 below ~-103.97, NaN in,
 * NaN out. All integer work is unsigned: no UB whatever x is. */
static inline float rx_expf(float x) {
    x = rx_selectf(x < -110.0f, -110.0f, x);
    x = rx_selectf(x > 90.0f, 90.0f, x);
    /* round x/ln2 to the nearest integer n: adding 1.5*2^23 leaves n in the
     * low mantissa bits */
    const float magic = 12582912.0f;
    float t = x * 1.44269504088896341f + magic, n = t - magic;
    float r = x - n * 0.693359375f;   /* ln2 high part, exact product */
    r = r + n * 2.12194440e-4f;       /* minus the low part */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    /* n + 256 in [97, 386]; 2^n = 2^(n1) 2^(n2) with biased exponents
     * e1 = floor(nb/2) - 1 and e2 = ceil(nb/2) - 1, both in [47, 192] */
    uint32_t tb, nb, s1b, s2b;
    memcpy(&tb, &t, sizeof tb);
    nb = tb - 0x4B400000u + 256u;
    s1b = ((nb >> 1) - 1u) << 23;
    s2b = ((nb - (nb >> 1)) - 1u) << 23;
    float s1, s2;
    memcpy(&s1, &s1b, sizeof s1);
    memcpy(&s2, &s2b, sizeof s2);
    return (p * s1) * s2;
}

static inline float rx_sigmoidf(float x) {
    return 1.0f / (1.0f + rx_expf(rx_selectf(x < -88.0f, 88.0f, -x)));
}

/* tanh without libm, vectorisable: Cephes' odd polynomial below 0.625 (where
 * 1 - 2/(e^2x + 1) would cancel), that formula above. */
static inline float rx_tanhf(float x) {
    float ax = fabsf(x), z = x * x;
    float p = -5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    float small = ax + ax * (z * p), big = 1.0f - 2.0f / (rx_expf(2.0f * ax) + 1.0f);
    return copysignf(rx_selectf(ax < 0.625f, small, big), x);
}

/* The row a token shift reads at (b, t) of x [B][T][C]: x[b][t-1], at t = 0
 * the carry row init[b] (NULL init: zero, returned as NULL). */
static inline const float *rx_shift_src(const float *x, const float *init,
                                        size_t b, size_t t, size_t T, size_t C) {
    if (t > 0) return x + (b * T + t - 1) * C;
    return init ? init + b * C : NULL;
}

/* The sequences a call's rows hold: B sequences of T rows each (off NULL:
 * the training forward's batch), or a ragged step of batched generation
 * (gen.c): sequence b is the rows [off[b], off[b+1]) (row r's sequence is
 * seq[r]) and its carries and WKV state are those of slot slot[b]. */
typedef struct {
    size_t B, T;
    const int *off, *seq, *slot;
} rx_seqs;

static inline size_t rx_seqs_rows(const rx_seqs *s) {
    return s->off ? (size_t)s->off[s->B] : s->B * s->T;
}

/* The carry row of sequence b: init[slot[b]] in a ragged step, else init[b] */
static inline size_t rx_seqs_slot(const rx_seqs *s, size_t b) {
    return s->off ? (size_t)s->slot[b] : b;
}

/* rx_shift_src over rows r of x [rows][C] laid out as s says */
static inline const float *rx_seqs_prev(const rx_seqs *s, const float *x, const float *init,
                                        size_t r, size_t C) {
    if (!s->off) return rx_shift_src(x, init, r / s->T, r % s->T, s->T, C);
    const size_t b = (size_t)s->seq[r];
    if (r > (size_t)s->off[b]) return x + (r - 1) * C;
    return init ? init + (size_t)s->slot[b] * C : NULL;
}

/* ---- runtime.c: errors ---------------------------------------------------
 * The one way a C function reports a failure: return rx_fail(code, fmt, ...)
 * records the printf-formatted message for rx_last_error on the calling
 * thread and returns code. The message names the function and the bad
 * argument or value ("rx_infer_forward: token 300 at position 5 is outside
 * [0, 256)"). A caller that only passes a callee's code on adds nothing: the
 * callee's message is the more precise. Inside an OpenMP team a failure is
 * flagged and reported by the thread that forked it, whose message
 * rx_last_error then returns. */
#define RX_ERROR_MAX 256
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
int rx_fail(int code, const char *fmt, ...);
/* The name of the first NULL of the n pointers p (names: theirs), NULL when
 * none is: the argument a "%s is NULL" message names. */
const char *rx_first_null(const void *const *p, const char *const *names, int n);
#define RX_NULLS(...) (const void *const[]){__VA_ARGS__}
#define RX_NAMES(...) (const char *const[]){__VA_ARGS__}
/* The sequence entry points' shared size checks: B, T >= 1 and, at a layer
 * past 0 (layer_id < 0: no such check), the v_first that every later RWKV
 * layer reads. RX_OK, or the rx_fail code naming fn. */
int rx_seq_check(const char *fn, int B, int T, int layer_id, const float *v_first);

/* ---- runtime.c: buffers that must not share memory ----------------------
 * An entry point lists the contiguous buffers it reads and writes as spans
 * (a name for the message, the start, the byte count; a NULL start is an
 * absent optional buffer) and calls rx_spans_check before any work: every
 * output must be disjoint from every input and every other output, since
 * threads read inputs while others already write. A function that allows
 * an exact in-place call (out == x) leaves that input out when the two are
 * equal; a partial overlap is still refused. Struct-borne tensors (the
 * blocks' P and G) are added by their owners' rx_*_spans helpers, with a
 * prefix ("P->", "G->cm.") for the message. */
#define RX_SPANS_MAX 96
typedef struct {
    const char *prefix, *name;
    const void *p;
    size_t bytes;
} rx_span;
typedef struct {
    rx_span s[RX_SPANS_MAX];
    int n, full;   /* full: a span did not fit (rx_spans_check then fails) */
} rx_spans;
/* Appends a span of n elements of elem bytes (nothing for a NULL p). */
void rx_spans_add(rx_spans *l, const char *prefix, const char *name, const void *p, size_t n,
                  size_t elem);
#define RX_SPAN_ADD(l, name, p, n) rx_spans_add((l), "", (name), (p), (n), sizeof *(p))
/* RX_OK, or RX_EINVAL naming fn, the output and what it overlaps. */
int rx_spans_check(const char *fn, const rx_spans *out, const rx_spans *in);
/* The NaN fill of the original API's void and double forms on a failure:
 * out [n] becomes NaN unless it shares memory with an input of in, which a
 * refused call must leave as it was. */
void rx_fnan_apart(float *out, size_t n, const rx_spans *in);

/* ---- runtime.c: per-kernel self time (rx_profile_*) ---------------------
 * A kernel brackets its work with rx_prof_push(slot) / rx_prof_pop(); time
 * outside every bracket is RX_PROF_OTHER. No-ops unless profiling is on. */
enum { RX_PROF_OTHER, RX_PROF_GEMM, RX_PROF_WKV7, RX_PROF_ATTN, RX_PROF_NORM, RX_PROF_CE,
       RX_PROF_DORA, RX_PROF_N };
void rx_prof_push(int slot);
void rx_prof_pop(void);

/* ---- cpu.c: per-thread scratch, huge pages and CPU detection ------------ */
/* Memory a GEMM streams whole (a parameter arena, a frozen base's store)
 * on transparent huge pages where the kernel gives them on request (its
 * "madvise" mode, a common default): a decode step reads every weight
 * once, and 4 KiB pages' TLB misses cost about a fifth of the read rate
 * (docs/performance.md, "Huge pages"). Only for memory whose every byte is
 * written: a huge page takes its 2 MiB at the first write to any of it. */
#define RX_HUGE_PAGE ((size_t)2 << 20)
/* [p, p + bytes) asked for huge pages before its first write; a no-op
 * where the system has no such request */
void rx_advise_huge(void *p, size_t bytes);
/* rx_alloc(bytes, 1), from RX_HUGE_PAGE bytes up aligned to RX_HUGE_PAGE
 * (whole huge pages) and advised; freed by free() */
void *rx_alloc_huge(size_t bytes);
/* The calling thread's scratch buffers, one per use, so that a training
 * step allocates nothing once its first call has grown them: */
enum {
    RX_BUF_BF16_PACK,   /* rx_bgemm's packed operands */
    RX_BUF_NORM_PART,   /* rx_rownorm_backward's per-block dw/db partial sums */
    RX_BUF_WKV_PART,    /* a split WKV7 backward's per-row-tile column sums */
    RX_BUF_LORA,        /* the LoRA adapters' h = s x A^T and g = s dy B (lora.c) */
    RX_BUF_DORA,        /* DoRA's D^T = B A, and its dz = c dy and z (lora.c) */
    RX_BUF_DORA_ROW,    /* DoRA's column of a frozen base's W, decoded (lora.c) */
    RX_BUF_GEMM_A,      /* rx_sgemm's packed op(A) block */
    RX_BUF_GEMM_B,      /* rx_sgemm's packed op(B) panel */
    RX_BUF_GEMM_FULL,   /* rx_sgemm's op(B) packed over all of K for a parallel unit */
    RX_BUF_GEMM_UNITS,  /* rx_sgemm's table of a parallel batch's units */
    RX_BUF_GEMM_PART,   /* rx_sgemm's k blocks' row sums of a small-M batch (gemm.c) */
    RX_BUF_FAST_ROWS,   /* the fast decode's quantised activation rows (base_fast.c) */
    RX_BUF_FAST_PANEL,  /* the fast decode's repacked weight panel (base_fast.c) */
    RX_BUF_SAMPLE,      /* a drawn row's probabilities, cut and sort (sample.c) */
    RX_BUF_N
};
/* Buffer `slot` of the calling thread, at least `bytes` long, grown to the
 * largest request (its contents then unspecified; kept otherwise) and freed
 * when the thread exits; NULL when it cannot be allocated. */
void *rx_thread_buffer(int slot, size_t bytes);
/* 1 on AMD family 0x1A (Zen 5) and later: 512-bit FMA and vdpbf16ps on
 * full-width pipes (gemm.c's tile). */
int rx_cpu_zen5_or_later(void);
/* 1 when the CPU runs the base's AVX-512 (BW) packers, 2 when also
 * AVX512-BF16, 3 when also AVX-512 VBMI; 0 with RWKVX_BASE_PORTABLE=1 (the
 * portable packers) or RWKVX_BASE_PORTABLE=avx2 (the AVX2 ones: tests on an
 * AVX-512 CPU), at most 2 with RWKVX_BASE_PORTABLE=avx512bf16 */
int rx_cpu_base_simd(void);
/* 1 when the CPU runs the base's AVX2 decoders (AVX2 and F16C), 0 without
 * them or with RWKVX_BASE_PORTABLE=1 (the portable loops) */
int rx_cpu_base_avx2(void);

/* ---- gemm.c ------------------------------------------------------------
 * C[M,N] = beta*C + op(A)[M,K] . op(B)[K,N], all row-major. op(A) is A
 * ([M,K], row stride lda) or, with ta, A^T for A stored [K,M]; likewise B.
 * beta is 0 (overwrite) or 1 (accumulate). Threads itself with OpenMP when
 * called outside a parallel region; inside one it runs on the calling
 * thread. Every projection and its backward goes through here.
 * RX_OK, or RX_ENOMEM when a thread's packing buffers cannot be allocated
 * (C is then unspecified). Inside a parallel region, after the calling
 * thread's rx_gemm_reserve returned RX_OK, it cannot fail: there it uses
 * only those fixed-size buffers, which are kept for the thread's life. */
int rx_sgemm(int ta, int tb, size_t M, size_t N, size_t K,
              const float *A, size_t lda, const float *B, size_t ldb,
              float beta, float *C, size_t ldc);
/* One GEMM of a batch, the arguments of rx_sgemm. */
typedef struct {
    int ta, tb;
    size_t M, N, K;
    const float *A;
    size_t lda;
    const float *B;
    size_t ldb;
    float beta;
    float *C;
    size_t ldc;
    /* set by rx_pgemm_batch alone: B is a frozen base tensor's arena slot,
     * and op(B) is packed by its owner instead (bsrc's functions on
     * bsrc_of, base_pack.c); NULL: from B */
    const struct rx_gemm_source *bsrc;
    const void *bsrc_of;
    /* set by rx_sgemm_batch alone, on a k window of an op over a source:
     * the window's first k in the source's op(B) (A is offset itself) */
    size_t bsrc_k0;
} rx_gemm_op;
/* A B operand the GEMMs do not read as floats but have its owner pack (a
 * frozen base tensor): the GEMMs call these on the op's bsrc_of and never
 * name the owner. pack_f32: op(B) rows [p0,p0+kc) x cols [j0,j0+nc) as
 * rx_sgemm's nr-column slivers; pack_bf16: column blocks [cb0,cb1) x k
 * chunks [kc0,kc1) as rx_bgemm's bt_r x bt_k blocks; packed: the whole
 * packed op(B) of a forward product of N x K when the owner holds it in
 * that layout already (the bf16 GEMM then reads it in place), else NULL;
 * small_f32: rx_sgemm's small-M product of op g's columns [j0, j1) over all
 * of K, summed as its kernels sum (one FMA chain from zero per kcb-deep
 * block of k, added to C in k order), without packing op(B): returns the
 * columns from j0 it wrote (0: it has no faster way for g); rows_bf16:
 * for a forward product of N x K, op(B)'s columns [j0, j0+16) (W^T's rows)
 * over k [k0, k0+32) rounded as rx_bgemm rounds its operands, row-major
 * [16][32] (AMX's A tile of the product's transpose: RX_ROWS_TILE), or
 * where the caller allows it (pairs) and the source has a faster way,
 * rx_bgemm's packed block of them (RX_ROWS_PAIRS), while the caller's next
 * 16 columns from pj (RX_NO_ROWS: none) are fetched into cache a slice a
 * call; returns which it wrote, RX_ROWS_NONE where it has no faster way
 * (an edge, a packed store, a dtype without one). */
#define RX_NO_ROWS ((size_t)-1)
enum { RX_ROWS_NONE, RX_ROWS_TILE, RX_ROWS_PAIRS };
typedef struct rx_gemm_source {
    void (*pack_f32)(const void *src, int tb, size_t p0, size_t kc, size_t j0, size_t nc,
                     size_t nr, float *Bp);
    void (*pack_bf16)(const void *src, int tb, size_t N, size_t K, size_t nkc, size_t cb0,
                      size_t cb1, size_t kc0, size_t kc1, size_t bt_r, size_t bt_k,
                      uint16_t *bp);
    const uint16_t *(*packed)(const void *src, size_t N, size_t K);
    size_t (*small_f32)(const void *src, const rx_gemm_op *g, size_t j0, size_t j1, size_t kcb);
    int (*rows_bf16)(const void *src, size_t N, size_t K, size_t j0, size_t k0, size_t pj,
                     int pairs, uint16_t *dst);
} rx_gemm_source;
/* Independent GEMMs -- no op reads or writes another's C -- run in one
 * parallel region, balanced across threads as one pool of work. */
int rx_sgemm_batch(const rx_gemm_op *ops, size_t n);
/* Allocates the calling thread's GEMM packing buffers if it has none yet:
 * a parallel region whose threads call rx_sgemm calls this first on every
 * thread and reports its failure once, after the region. */
int rx_gemm_reserve(void);
/* Multiply-adds below which a GEMM runs on one thread: under ~10 us of
 * work a fork/join costs more than it saves. */
#define RX_GEMM_MIN_PAR 262144.0
/* Test hook: force the named micro-kernel ("generic", "avx2-fma",
 * "avx512f", "avx512f-12x32", "avx512f-8x32") for every later call, NULL to pick by CPU again. RX_EINVAL
 * when the name is unknown or the CPU cannot run it. Not thread-safe
 * against concurrent GEMMs. */
int rx_sgemm_use_kernel(const char *name);
/* Test hook: batches whose ops all have at most m rows read op(B) in place
 * (gemm.c and gemm_bf16.c "small M"; the same bits as the packed path), in
 * both the fp32 and the bf16 GEMM; 0 turns that off. Returns the previous
 * bound. Not thread-safe against concurrent GEMMs. */
size_t rx_sgemm_small_m(size_t m);
/* Test hook: the bf16 elements of packed op(B) one rx_bgemm pass holds
 * (gemm_bf16.c's PACK_BUDGET, 8 MiB; 0 restores it); a batch beyond it
 * runs in passes over windows of k or columns, with the same bits. Returns the
 * previous budget. Not thread-safe against concurrent GEMMs. */
size_t rx_bgemm_pack_budget(size_t elems);
/* Test hook: the floats of op(B) one thread of a parallel rx_sgemm packs
 * over a unit's k range (gemm.c's FULL_BUDGET, 8 MiB; 0 restores it); a
 * deeper op runs in k windows, with the same bits. Returns the previous
 * budget. Not thread-safe against concurrent GEMMs. */
size_t rx_sgemm_full_budget(size_t floats);
/* The small-M bound rx_sgemm_small_m set (RX_GEMM_SMALL_M unless a test
 * changed it; gemm_ops.c). Rows up to which a batch takes the small-M
 * path: at 16 rows on Zen 3 the packed path was faster, at 8 and fewer
 * mostly slower (docs/performance.md §Decode GEMM); the hook may raise it
 * to RX_GEMM_SMALL_MAX, the rows gemm.c's row sums' buffer holds, or set 0
 * (the paths off). */
#define RX_GEMM_SMALL_M 8
#define RX_GEMM_SMALL_MAX 16
size_t rx_gemm_small_bound(void);
/* ---- gemm_ops.c: what both GEMM batches share -------------------------- */
/* *budget = v, or dflt for v = 0; returns the previous value (the GEMMs'
 * packing-budget test hooks) */
size_t rx_gemm_set_budget(size_t *budget, size_t v, size_t dflt);
/* ops[0..n) -> live: the ops with work to do, in order; returns their count.
 * An op with K = 0 and beta = 0 is done here (C = 0); any other with no
 * work (M, N or K zero) is dropped. Shared by the fp32 and bf16 batches. */
size_t rx_gemm_live_ops(const rx_gemm_op *ops, size_t n, rx_gemm_op *live);
/* RX_OK when no op's C shares memory with any op's A or B (K > 0) or with
 * another op's C; else RX_EINVAL through rx_fail, naming fn and the ops.
 * Every batch runs it first (see gemm.c, "independence"). */
int rx_gemm_check_batch(const char *fn, const rx_gemm_op *ops, size_t n);

/* ---- gemm_bf16.c -------------------------------------------------------
 * rx_sgemm's contract on operands rounded to bf16 (nearest even, subnormal
 * results to zero) with fp32 accumulation and an fp32 C; see gemm_bf16.c
 * for the kernels and the tolerance between them. */
int rx_bgemm(int ta, int tb, size_t M, size_t N, size_t K,
             const float *A, size_t lda, const float *B, size_t ldb,
             float beta, float *C, size_t ldc);
int rx_bgemm_batch(const rx_gemm_op *ops, size_t n);
/* The bf16 GEMM's operand rounding, fp32 -> bf16 as vcvtne2ps2bf16
 * converts (Intel SDM): round to nearest even; NaN stays a (quiet) NaN; a
 * subnormal input becomes a signed zero (so the largest subnormals do not
 * round up to the smallest normal). The frozen base's packers round with
 * it too. */
static inline uint16_t rx_bf16_operand(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    if (!(u & 0x7f800000u)) return (uint16_t)((u >> 16) & 0x8000u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
/* Test hook as rx_sgemm_use_kernel: "amx-bf16", "avx512-bf16",
 * "generic-bf16"; NULL picks by CPU (or RWKVX_BF16_KERNEL) again. */
int rx_bgemm_use_kernel(const char *name);

/* ---- lora.c ------------------------------------------------------------
 * LoRA adapters on projection weights (docs/maths.md §LoRA). A target is a
 * weight W [in][out] of the parameter arena with its grad GW (the pointers
 * the projections' products are recognised by) and its tensor index. */
typedef struct rx_lora rx_lora;
typedef struct {
    const float *W, *GW;
    size_t in, out;
    int param;
} rx_lora_target;
/* t [n] (n >= 1, r >= 1) -> *out: adapters A [r][in], B [out][r] (dora:
 * and a magnitude M [out]), zero, in target order in one arena and its grad
 * arena (docs/layout.md §Adapters); RX_OK or RX_ENOMEM. */
int rx_lora_create(int r, double alpha, int dora, const rx_lora_target *t, int n,
                   rx_lora **out);
void rx_lora_free(rx_lora *L);
/* The adapter count (0 for NULL), *r and *alpha (may be NULL). */
int rx_lora_count(const rx_lora *L, int *r, double *alpha);
/* Adapter i (0 <= i < count): its tensor index, the element offsets of its A
 * and B in the arena. */
int rx_lora_adapter(const rx_lora *L, int i, int *param, int64_t *a_off, int64_t *b_off);
float *rx_lora_arena(rx_lora *L, int64_t *n);
float *rx_lora_grad_arena(rx_lora *L, int64_t *n);
/* Where DoRA's norms read a weight held outside the arena: find, the
 * holder in src of the weight whose arena slot is W (NULL: the arena's
 * float32 W); column, its column o [in] decoded into dst (exactly);
 * version, a number that changes whenever src's contents do (and that no
 * other src shares). The frozen base's is rx_base_columns (base.c), src
 * the rx_base. */
typedef struct {
    const void *(*find)(const void *src, const float *W);
    void (*column)(const void *held, size_t o, float *dst);
    uint64_t (*version)(const void *src);
} rx_weight_columns;
/* DoRA: adapter i's magnitude offset in the arena (-1: not DoRA); its
 * column norms of W + s A^T B^T as last prepared into out [out] (RX_EINVAL:
 * not DoRA); rx_lora_prepare: every adapter's norms and scales M / norm
 * from the arena now, W read through cols where src holds it (src NULL:
 * none) (RX_OK for plain LoRA or NULL; RX_ENOMEM) -- before each forward
 * and backward. When src holds every adapted W, the norms are kept from
 * the last prepare while A, B (bit for bit) and src's version are those
 * it read: only M / norm is taken again. */
int64_t rx_lora_magnitude(const rx_lora *L, int i);
/* on: the adapters' weight-grad products add to their grads instead of
 * writing them (a row group after the first, model.c); L NULL: a no-op. */
void rx_lora_accumulate(rx_lora *L, int on);
int rx_lora_norms(const rx_lora *L, int i, float *out);
int rx_lora_prepare(rx_lora *L, const rx_weight_columns *cols, const void *src);
/* What the adapters run their own products on (the projection entry hands
 * rx_pgemm_run: its precision, neither frozen spans nor adapters). */
typedef int (*rx_gemm_runner)(const rx_gemm_op *ops, size_t n);
/* The base products ops[0..n) on base, then their adapter products on run:
 * y += s (x A^T) B^T after a forward product of an adapted W, dx += s (dy B) A
 * after its dx product, dB = s dy^T (x A^T) and dA = s (dy B)^T x in place
 * of its weight-grad product; DoRA's per-column scale around them (lora.c).
 * RX_OK, RX_ENOMEM, or RX_EINVAL for an adapted weight read in a form
 * other than these. */
int rx_lora_apply(const rx_lora *L, const rx_gemm_op *ops, size_t n, rx_gemm_runner base,
                  rx_gemm_runner run);

/* ---- base.c ------------------------------------------------------------
 * The frozen base (docs/layout.md §Frozen base): weight matrices that do
 * not train, held as rows of W^T [out][in] in one of the dtypes of
 * rx_base_types (rx_base.h, base_types.c), read by the projection GEMMs
 * through their packing (base_pack.c). A target is a weight's arena
 * slot W [in][out], its grad slot GW and its tensor index. */
typedef struct rx_base rx_base;
typedef struct rx_base_mat rx_base_mat;
typedef struct {
    const float *W, *GW;
    size_t in, out;
    int param;
    int rows;   /* 1: the slot is [out][in] itself, rows gathered (the embedding) */
} rx_base_target;
/* rx_bgemm's packed op(B) (gemm_bf16.c): blocks of RX_BT_R columns x
 * RX_BT_K k, row p of a block the k pair (2p, 2p+1) of its columns
 * interleaved; N padded to RX_BT_BLK, K to RX_BT_K. A bf16 base may be
 * stored in it (rx_base_create's packed). */
#define RX_BT_R 16
#define RX_BT_K 32
#define RX_BT_BLK 32
/* t [n] in arena order -> *out: the store (unfilled), and the slots'
 * float32 pages released; RX_OK or RX_ENOMEM. packed (bf16 only): every
 * projection stored as rx_bgemm's packed op(B) of its forward product
 * (W [in][out]: K = in, N = out), which the bf16 GEMM then reads in place
 * instead of packing, with subnormals as the GEMM's operand rounding
 * leaves them (signed zeros); else rows of W^T [out][in]. */
int rx_base_create(int dtype, const rx_base_target *t, int n, int packed, rx_base **out);
/* b's values as rows [out][in] (its dtype's stored rows) into dst, which
 * holds out rows of its dtype's row bytes */
void rx_base_rows(const rx_base_mat *b, void *dst);
void rx_base_free(rx_base *s);
int rx_base_dtype(const rx_base *s);
size_t rx_base_bytes(const rx_base *s);
int rx_base_count(const rx_base *s);
const rx_base_mat *rx_base_at(const rx_base *s, int i);
const rx_base_mat *rx_base_by_param(const rx_base *s, int param);
int rx_base_param(const rx_base_mat *b);
int rx_base_loaded(const rx_base *s);
/* tensor i's values from src: W^T [out][in] (src_t) or W [in][out], as
 * float32 (kind RX_BASE_FP32) or bf16 bits (RX_BASE_BF16); a rows tensor
 * (the embedding) is [out][in] either way; RX_OK, RX_ENOMEM */
int rx_base_fill(rx_base *s, int i, const void *src, int kind, int src_t);
/* the tensor decoded (exactly) into dst in its arena layout: W [in][out],
 * a rows tensor [out][in] */
void rx_base_read(const rx_base *s, const rx_base_mat *b, float *dst);
/* stored row j [in] of b decoded (exactly) into dst: an embedding's row */
void rx_base_row(const rx_base_mat *b, size_t j, float *dst);
/* rx_embedding_gather over an embedding held in a base (b a rows tensor
 * [vocab][C]): the same checks, each row decoded (embedding.c) */
int rx_embedding_gather_base(const rx_base_mat *b, const int *tokens, int T, int C, int vocab,
                             float *out);
/* the stored rows of b and their byte count */
const unsigned char *rx_base_data(const rx_base_mat *b, size_t *bytes);
/* every tensor decoded into its arena slot (the base-unfreeze) */
int rx_base_materialise(rx_base *s);
/* the tensor whose arena slot is W (NULL: none); whether C lies in a grad slot */
const rx_base_mat *rx_base_find(const rx_base *s, const float *W);
int rx_base_grad_slot(const rx_base *s, const float *C);
/* grads [n] = 0 outside the base tensors' grad slots (never touched) */
void rx_base_zero_grads(const rx_base *s, float *grads, size_t n);
/* the base as the GEMMs' B source: a product reading base tensor b has
 * its op(B) packed from the store (base_pack.c), bsrc_of = b */
extern const rx_gemm_source rx_base_source;
/* the base as where DoRA's norms read its weights (rx_lora_prepare): a
 * base tensor's stored row o of W^T, column o of W */
extern const rx_weight_columns rx_base_columns;
/* C [M][N] = A [M][K] . W, W^T [N][K] held as N stored rows of base dtype
 * (RX_BASE_*) at rows, by the GEMM how names, packing op(B) from them as a
 * model's forward does (a test hook for the base's packers):
 * RX_BASE_GEMM_FP32 rx_sgemm_batch, RX_BASE_GEMM_FAST the fast decode's
 * product (base_fast.c), RX_BASE_GEMM_BF16 rx_bgemm_batch (bf16
 * precision's); RX_EINVAL for an unknown dtype or K not whole blocks (fast:
 * a dtype or K it does not take), RX_ENOMEM */
enum { RX_BASE_GEMM_FP32, RX_BASE_GEMM_FAST, RX_BASE_GEMM_BF16 };
int rx_base_sgemm(int dtype, const void *rows, size_t M, size_t N, size_t K, const float *A,
                  float *C, int how);
/* base_fast.c: the fast decode's product (rx_gemm_set_fast) of op g over
 * base tensor src: whether it takes g (a forward product, op(A) and op(B)
 * untransposed, over a Q8_0 or Q4_0 tensor's rows, K whole blocks of at
 * most 16384), and g computed, each row's activations quantised alone,
 * once a call, into the calling thread's buffer (RX_ENOMEM when that
 * cannot grow) */
int rx_base_fast_ok(const void *src, const rx_gemm_op *g);
int rx_base_fast_sgemm(const void *src, const rx_gemm_op *g);
/* the model's base, NULL when none (model_layout.c) */
rx_base *rx_ptmodel_base_store(const rx_ptmodel *m);
/* the model's adapter table as its forward sets it: NULL without adapters
 * or once they are disabled (model_lora.c) */
const rx_lora *rx_ptmodel_lora_table(const rx_ptmodel *m);
/* rx_lora_prepare of the model's adapters on its base (RX_OK without;
 * model.c) */
int rx_ptmodel_lora_prepare(rx_ptmodel *m);
void rx_ptmodel_attach_base(rx_ptmodel *m, rx_base *s);
/* the tensors around the blocks (their arena slots; a frozen base's are
 * found there by rx_base_find): ln0's NULL without it (model_layout.c) */
typedef struct {
    const float *emb, *ln0_w, *ln0_b, *ln_out_w, *ln_out_b, *head;
} rx_model_ends;
rx_model_ends rx_ptmodel_ends(const rx_ptmodel *m);

/* ---- proj.c: the projection entry -------------------------------------- */
/* The projection GEMM: rx_sgemm(_batch) or rx_bgemm(_batch) by the calling
 * thread's projection precision (RX_PRECISION_*), which the model sets for
 * the span of its forward and backward and rx_gemm_set_precision returns to
 * what it was (the return value). Every projection calls these; attention's
 * score tiles call rx_sgemm and stay fp32. */
int rx_gemm_set_precision(int precision);
int rx_pgemm(int ta, int tb, size_t M, size_t N, size_t K,
             const float *A, size_t lda, const float *B, size_t ldb,
             float beta, float *C, size_t ldc);
int rx_pgemm_batch(const rx_gemm_op *ops, size_t n);
/* The calling thread's frozen spans: element ranges [begin, end) of base
 * (ranges [n][2]; n = 0: none), set by rx_gemm_set_frozen, which returns
 * the old ones: rx_pgemm(_batch) skips every product whose output C starts
 * inside one. A model with frozen tensors (rx_ptmodel_set_frozen_ranges)
 * sets their spans of its grad arena for the span of its backward: no
 * weight-grad GEMM of theirs runs, every dX GEMM does. */
typedef struct {
    const float *base;
    const int64_t *ranges;
    int n;
} rx_frozen;
rx_frozen rx_gemm_set_frozen(rx_frozen f);
/* A batch of projection products in the calling thread's precision, with
 * neither frozen spans nor adapters: what lora.c runs its own products on. */
int rx_pgemm_run(const rx_gemm_op *ops, size_t n);
/* The calling thread's adapter table (NULL: none), returning the old one:
 * the model sets it for the span of its forward and backward, and
 * rx_pgemm(_batch) then runs rx_lora_apply after each batch's base
 * products. */
const rx_lora *rx_gemm_set_lora(const rx_lora *L);
/* The calling thread's base (NULL: none), returning the old one: the model
 * sets it for the span of its forward and backward, and rx_pgemm(_batch)
 * then packs every product reading a base tensor from the store and skips
 * its weight-grad product. */
const rx_base *rx_gemm_set_base(const rx_base *s);
/* The calling thread's fast decode (0 off, 1 on), returning the old
 * setting: while on, rx_pgemm(_batch) runs every product over a Q8_0 or
 * Q4_0 base tensor that rx_base_fast_ok takes as rx_base_fast_sgemm, at any
 * number of rows and in either precision (rx_gen_set_fast) */
int rx_gemm_set_fast(int on);

/* ---- head.c ------------------------------------------------------------
 * L2Wrap's grad over rows of logits: dlogits[t][am_t] += coef *
 * logits[t][am_t], am_t the first argmax of row t (coef 0: nothing). */
void rx_l2wrap_rows(const float *logits, float *dlogits, size_t rows, size_t V, double coef);
/* rx_cross_entropy_rows and rx_head_loss_rows of the logits times k > 0,
 * the inverse of a sampling temperature (docs/maths.md §GRPO): each row's
 * loss is -log softmax(k l)[target] and its grad on l is k times the
 * cross-entropy's of k l (the L2Wrap term reads l itself). k = 1: the
 * public forms' bits. */
int rx_cross_entropy_rows_k(const float *logits, const int *targets, int T, int vocab,
                            int ignore_index, const double *weight, float k, float *dlogits,
                            double *row_loss);
int rx_head_loss_rows_k(const float *x, const float *head, const int *targets, int T, int C,
                        int vocab, int ignore_index, double l2wrap, const double *weight,
                        float k, int rows, float *scratch, float *dx, float *d_head,
                        double *row_loss);

/* ---- layernorm.c -------------------------------------------------------
 * Row normalisation shared by LayerNorm (period 1) and the time-mix group
 * norm (period H): rows of length D; row r uses affine w/b at offset
 * (r % period)*D. mean/rstd (may be NULL) receive the per-row statistics. */
void rx_rownorm_forward(const float *x, const float *w, const float *b,
                        float *out, float *mean, float *rstd,
                        size_t rows, size_t D, size_t period, float eps);
/* dx written (may alias dy); dw/db [period*D] accumulated (+=), not zeroed,
 * by fixed row blocks: the same bits at any thread count. Returns RX_OK or
 * RX_ENOMEM (the per-block partial sums' buffer, grown on first use,
 * cannot be allocated). */
int rx_rownorm_backward(const float *x, const float *w, const float *dy,
                        float *dx, float *dw, float *db,
                        size_t rows, size_t D, size_t period, float eps);
/* rx_layernorm_forward_seq / rx_layernorm_backward with the model's eps
 * (rx_model_ctx.ln_eps) for RX_LN_EPS; the same checks and errors. */
int rx_layernorm_forward_eps(const float *x, const float *w, const float *b, float *out,
                             int B, int T, int C, float eps);
int rx_layernorm_backward_eps(const float *x, const float *w, const float *b, const float *dy,
                              float *dx, float *dw, float *db, int B, int T, int C, float eps);

/* ---- wkv7.c ------------------------------------------------------------
 * The model's WKV7 (rx_wkv7_forward_seq / rx_wkv7_backward otherwise). The
 * forward also keeps cp [B][H][ceil(T/RX_WKV7_CHUNK)][N][N] (NULL: not
 * kept), the state entering every RX_WKV7_CHUNK-th step; the backward
 * starts from those (NULL: runs the forward again to make them) and only
 * reads them, so it can run twice per forward. work
 * [rx_wkv7_work_floats(B*H, N)] is scratch for either (NULL: allocated per
 * call): the forward's state and sa of each (sequence, head), then the
 * backward's chunk of recomputed states (RX_WKV7_BWD_WORK) for each of
 * rx_wkv7_slots(B*H) threads, a head at a time in each, so a batch adds
 * only the first part. 64 steps: the checkpoints cost N*N/64 floats a
 * token per head (C at N = 64), and a chunk of recomputed states (65 N*N
 * floats, 1.0 MiB at N = 64) still stays in a 2 MiB L2. */
#define RX_WKV7_CHUNK 64
#define RX_WKV7_CP(BH, T, N) ((BH) * (((T) + RX_WKV7_CHUNK - 1) / RX_WKV7_CHUNK) * (N) * (N))
/* a (sequence, head)'s part of the forward: its state [N][N] (used when
 * s_final is NULL) and sa [2][N]; a thread's of the backward: a chunk of
 * states [RX_WKV7_CHUNK][N][N], dS [N][N], each step's sa and more [N] */
#define RX_WKV7_FWD_WORK(N) ((N) * (N) + 2 * (N))
#define RX_WKV7_BWD_WORK(N) ((RX_WKV7_CHUNK + 1) * (N) * (N) + (RX_WKV7_CHUNK + 4) * (N))
/* The backward's threads for B*H heads: at most the process's CPUs at the
 * first call (a fixed figure, so that a scratch sized by it fits every
 * later call whatever the thread count then) */
size_t rx_wkv7_slots(size_t BH);
size_t rx_wkv7_work_floats(size_t BH, size_t N);
int rx_wkv7_forward_cp(const float *r, const float *w, const float *k, const float *v,
                       const float *a, const float *b, const float *s_init, float *y_out,
                       float *s_final, float *cp, float *work, int B, int T, int n_head,
                       int head_size);
/* The forward over the rows of a step laid out as sq says (rx_seqs): r..b,
 * y_out [rows][H][N]; sequence b's state [H][N][N] at state +
 * rx_seqs_slot(sq, b)*H*N*N enters as the state before its first row and
 * is advanced in place; no checkpoints. The training forward's per-head
 * kernel over each (sequence, head), so every head's bits are those of
 * rx_wkv7_forward_cp over that sequence alone. work: RX_WKV7_SEQS_WORK(B*H,
 * N) floats. */
#define RX_WKV7_SEQS_WORK(BH, N) ((BH) * 2 * (N))
int rx_wkv7_forward_seqs(const float *r, const float *w, const float *k, const float *v,
                         const float *a, const float *b, float *state, float *y_out,
                         const rx_seqs *sq, int n_head, int head_size, float *work);
int rx_wkv7_backward_cp(const float *r, const float *w, const float *k, const float *v,
                        const float *a, const float *b, const float *dy, const float *s_init,
                        const float *cp, float *work, float *dr, float *dw, float *dk,
                        float *dv, float *da, float *db, float *dS_out, int B, int T,
                        int n_head, int head_size);
/* The vectorised steps used for head_size: "avx512f" (N % 16 == 0),
 * "avx2" (N % 8 == 0) or "portable". */
const char *rx_wkv7_kernel(int head_size);
/* Test hook as rx_sgemm_use_kernel: force "avx512f", "avx2" or "portable"
 * (a head size the forced width does not divide runs portable); NULL picks
 * by CPU again. RX_EINVAL when the name is unknown or the CPU cannot run
 * it. Not thread-safe against concurrent WKV7 calls. */
int rx_wkv7_use_kernel(const char *name);

/* ---- fixed row blocks ---------------------------------------------------- */
/* Passes that sum grads over the B*T rows (norm affine grads, the
 * token-shift lerps' mix grads, the time-mix per-token passes) split the
 * rows into fixed blocks, each summing into its own scratch rows, and add
 * those in block order. The block size depends on B*T alone, so the
 * result has the same bits at any thread count. 32 rows, halved (down to
 * 8) while that leaves fewer than RX_ROW_BLOCKS blocks, a 64-core team's
 * units: B*T = 512 gives 64 blocks of 8. Past RX_MAX_ROW_BLOCKS blocks
 * they grow instead, which bounds the scratch (a block's partial rows: 6
 * vectors of C floats in the time-mix) at any batch. What the blocks cost
 * is below what this machine resolves: at S, B = 1, 2 threads, a step
 * took 1.003x (8-row blocks), 1.017x (16) and 1.010x (32) the time of the
 * build before, which summed the norms per thread (bench_ab.py, both
 * launch orders; about 1% between runs). */
#define RX_ROW_BLOCKS 64
#define RX_BLOCK_ROWS 32
#define RX_BLOCK_MIN_ROWS 8
#define RX_MAX_ROW_BLOCKS 1024
static inline size_t rx_block_rows(size_t BT) {
    size_t r = RX_BLOCK_ROWS;
    while (r > RX_BLOCK_MIN_ROWS && BT < (size_t)RX_ROW_BLOCKS * r) r /= 2;
    if (BT / r >= RX_MAX_ROW_BLOCKS) r = (BT + RX_MAX_ROW_BLOCKS - 1) / RX_MAX_ROW_BLOCKS;
    return r;
}
static inline size_t rx_row_blocks(size_t BT) {
    return (BT + rx_block_rows(BT) - 1) / rx_block_rows(BT);
}
/* The block sums: vector v < nvec of block b < nblk at part + b*stride +
 * v*n, [n] floats; dst[v] [n] = (dst[v] if acc) + the blocks' vectors v in
 * block order (dst[v] NULL: skipped). An orphaned omp for: called inside a
 * parallel region the team shares the columns (16 to an item, each
 * column's order the same at any team size), outside it one thread runs
 * all; either way it ends on the team's barrier. */
void rx_block_sums(const float *part, size_t nblk, size_t stride, size_t n, int nvec,
                   float *const *dst, int acc);

/* ---- tokenshift.c ------------------------------------------------------
 * n lerps of one x in one pass: out[i] [B][T][C] = x + (x_prev - x) *
 * mix[i], x_prev the token-shifted x with the carry init [B][C] (NULL: zero)
 * at t = 0. */
void rx_shift_lerp_forward(int n, const float *const *mix, const float *x, const float *init,
                           float *const *out, size_t B, size_t T, size_t C);
/* The same over rows laid out as sq says (rx_seqs: the carries of a
 * ragged step are init's rows slot[b]); rx_shift_lerp_forward is this
 * with B sequences of T. */
void rx_shift_lerp_seqs(int n, const float *const *mix, const float *x, const float *init,
                        float *const *out, const rx_seqs *sq, size_t C);
/* Their backward for the grads dout[i] on out[i]: writes dx [B][T][C], each
 * dmix[i] [C] and d_init [B][C] (NULL: not wanted). part: RX_SHIFT_PART
 * floats of scratch for threaded per-block sums, or NULL (one thread). */
#define RX_SHIFT_PART(n, BT, C) ((size_t)(n) * rx_row_blocks(BT) * (size_t)(C))
void rx_shift_lerp_backward(int n, const float *const *mix, const float *x, const float *init,
                            const float *const *dout, float *dx, float *const *dmix,
                            float *d_init, size_t B, size_t T, size_t C, float *part);

/* ---- channelmix.c ------------------------------------------------------ */
int rx_cm_params_ok(const rx_cm_params *P);
/* rx_tm_spans for the channel-mix */
void rx_cm_spans(const rx_cm_params *P, const rx_cm_grads *G, const char *pp, const char *gp,
                 rx_spans *in, rx_spans *out);
/* Forward keeping xk [BT][C] and h [BT][F] for the backward; out may be
 * NULL. The backward recovers relu(pre) from h; its scratch dh [BT][F]
 * and dxk [BT][C] must not alias h or xk (a batch reads one while it
 * writes the other). */
int rx_cm_forward_acts(const rx_cm_params *P, const float *x, const float *x_prev_init,
                       float *xk, float *h, float *out, size_t B, size_t T);
/* rx_cm_forward_acts over rows laid out as sq says (its token shift's) */
int rx_cm_forward_seqs(const rx_cm_params *P, const float *x, const float *x_prev_init,
                       float *xk, float *h, float *out, const rx_seqs *sq);
int rx_cm_backward_acts(const rx_cm_params *P, const float *x, const float *x_prev_init,
                        const float *xk, const float *h, const float *dy,
                        rx_cm_grads *G, float *dx, float *d_xprev_init, size_t B, size_t T,
                        float *dh, float *dxk);

/* ---- the time-mix schema ------------------------------------------------
 * The one list of the time-mix parameters (docs/layout.md §Parameters):
 * X(field, rows, cols, init, layer0) for each pointer of rx_tm_params and
 * rx_tm_grads, in their declaration order, which model_layout.c checks at compile
 * time. rows and cols name a dimension (C, Dw, Da, Dg, Dv; cols NONE for a
 * vector), init the spec init rule (MAT, VEC, GAMMA, BETA), layer0 whether
 * RWKV block 0 has the field (the value residual only follows it). The
 * model's layout and the pointer checks expand it; the Python side reads it
 * through rx_tm_field (docs/layout.md §Parameters). */
#define RX_TM_FIELDS(X)                                                                  \
    X(x_r, C, NONE, VEC, 1) X(x_k, C, NONE, VEC, 1) X(x_v, C, NONE, VEC, 1)             \
    X(x_w, C, NONE, VEC, 1) X(x_a, C, NONE, VEC, 1) X(x_g, C, NONE, VEC, 1)             \
    X(receptance_w, C, C, MAT, 1) X(key_w, C, C, MAT, 1) X(value_w, C, C, MAT, 1)        \
    X(output_w, C, C, MAT, 1)                                                            \
    X(w0, C, NONE, VEC, 1) X(w1, C, Dw, MAT, 1) X(w2, Dw, C, MAT, 1)                     \
    X(a0, C, NONE, VEC, 1) X(a1, C, Da, MAT, 1) X(a2, Da, C, MAT, 1)                     \
    X(g1, C, Dg, MAT, 1) X(g2, Dg, C, MAT, 1)                                            \
    X(v0, C, NONE, VEC, 0) X(v1, C, Dv, MAT, 0) X(v2, Dv, C, MAT, 0)                     \
    X(k_k, C, NONE, VEC, 1) X(k_a, C, NONE, VEC, 1) X(r_k, C, NONE, VEC, 1)              \
    X(ln_x_w, C, NONE, GAMMA, 1) X(ln_x_b, C, NONE, BETA, 1)

/* ---- timemix.c ---------------------------------------------------------
 * The time-mix forward intermediates, computed once by rx_tm_forward_acts
 * and consumed by rx_tm_backward_acts; the block keeps them alive across
 * the channel-mix backward so its backward runs the time-mix forward once.
 * Rows are the B*T tokens; every [BT][C] buffer is 64-byte aligned. */
typedef struct {
    size_t B, T;
    float *xr, *xw, *xk, *xv, *xa, *xg; /* [BT][C] token-shift lerps */
    float *r, *k, *v;                   /* [BT][C] projections, k and v unmodified */
    float *kmod, *vmod;                 /* [BT][C] k, v entering WKV7 (vmod == v at layer 0) */
    float *w, *wsig;                    /* [BT][C] decay, sigmoid inside it */
    float *a, *g, *vg;                  /* [BT][C] gates (vg NULL at layer 0) */
    float *aw, *bw;                     /* [BT][C] WKV7 a = -kk and b = kk*a */
    float *y, *z, *zg;                  /* [BT][C] WKV7 out, group norm + bonus, z*g */
    float *tw, *ta, *tg, *tv;           /* [BT][D*] LoRA hiddens after activation */
    float *bonus;                       /* [BT][H] sum over the head of r*kmod*r_k */
    float *wkv_cp, *wkv_work;           /* rx_wkv7_forward_cp's checkpoints and scratch */
    /* a ragged step's rows (gen.c): its WKV runs rx_wkv7_forward_seqs with
     * wkv_work of RX_WKV7_SEQS_WORK floats; NULL: B sequences of T */
    const rx_seqs *seqs;
    float *mem;
    int lean;                           /* rx_tm_acts_carve_lean: the lerps share buffers
                                         * that the backward overwrites, and makes them
                                         * again; zg is the caller's scratch */
} rx_tm_acts;

/* Every size and pointer of P valid (v0/v1/v2 and Dv only at layer > 0). */
int rx_tm_params_ok(const rx_tm_params *P);
/* P's tensors (the layer has) into in, named pp + field, and when G is not
 * NULL G's into out, named gp + field: for rx_spans_check. */
void rx_tm_spans(const rx_tm_params *P, const rx_tm_grads *G, const char *pp, const char *gp,
                 rx_spans *in, rx_spans *out);
int rx_tm_grads_ok(const rx_tm_params *P, const rx_tm_grads *G);
/* RX_OK or RX_ENOMEM; rx_tm_acts_free(A) is safe after either. */
int rx_tm_acts_alloc(rx_tm_acts *A, const rx_tm_params *P, size_t B, size_t T);
/* The same buffers carved from caller memory of rx_tm_acts_floats floats
 * (64-byte aligned), which A does not own (A->mem NULL). */
size_t rx_tm_acts_floats(const rx_tm_params *P, size_t B, size_t T);
void rx_tm_acts_carve(rx_tm_acts *A, const rx_tm_params *P, size_t B, size_t T, float *mem);
/* The same less the WKV scratch: rx_tm_acts_floats_shared floats of mem,
 * and wkv_work the caller's (rx_wkv7_work_floats(B*H, N) floats; a ragged step's
 * RX_WKV7_SEQS_WORK). The WKV forward and backward each write that scratch
 * before reading it, and nothing reads it between calls, so sets that
 * never run at once (the blocks of one model step) may share one. A NULL
 * wkv_work carves the set's own from rx_tm_acts_floats floats, as
 * rx_tm_acts_carve. */
size_t rx_tm_acts_floats_shared(const rx_tm_params *P, size_t B, size_t T);
void rx_tm_acts_carve_shared(rx_tm_acts *A, const rx_tm_params *P, size_t B, size_t T,
                             float *mem, float *wkv_work);
/* The lean set of recompute (docs/maths.md §Recompute): the six lerps share
 * buffers with kmod, wsig, aw, bw, y and z, so the backward makes them again
 * after reading those, which leaves A holding no forward (the model runs the
 * forward again before another backward); zg is not carved: the caller
 * points it at [BT][C] of scratch the forward may write (the backward makes
 * it again). rx_tm_acts_floats_lean floats. */
size_t rx_tm_acts_floats_lean(const rx_tm_params *P, size_t B, size_t T);
void rx_tm_acts_carve_lean(rx_tm_acts *A, const rx_tm_params *P, size_t B, size_t T,
                           float *mem);
void rx_tm_acts_free(rx_tm_acts *A);
/* x: [B][T][C]. Layer 0 writes v (v_first_out may be NULL); layer > 0
 * reads v_first_in. out [B][T][C] may be NULL (backward recompute). */
int rx_tm_forward_acts(const rx_model_ctx *ctx,
                       const rx_tm_params *P, const float *x, const float *x_prev_init,
                       const float *v_first_in, float *v_first_out, rx_tm_acts *A,
                       float *out);
/* rx_tm_forward_acts continuing from the WKV state [B][H][N][N] in state,
 * which it advances in place (NULL: zero initial state, nothing kept); the
 * recurrent-inference form (infer.c). */
int rx_tm_forward_state(const rx_model_ctx *ctx,
                        const rx_tm_params *P, const float *x, const float *x_prev_init,
                        const float *v_first_in, float *v_first_out, float *state,
                        rx_tm_acts *A, float *out);
/* A filled by rx_tm_forward_acts on the same inputs; arguments as in
 * rx_timemix_backward; work: rx_tm_backward_work(P, B*T) floats of scratch
 * (NULL: allocated and freed here). */
size_t rx_tm_backward_work(const rx_tm_params *P, size_t BT);
int rx_tm_backward_acts(const rx_model_ctx *ctx,
                        const rx_tm_params *P, const rx_tm_acts *A, const float *x,
                        const float *x_prev_init, const float *v_first, const float *dy,
                        rx_tm_grads *G, float *dx, float *d_xprev_init, float *d_v_first,
                        float *work);
/* rx_tm_backward_acts also writing d_state [B][H][N][N], the grad of the
 * loss on the initial WKV state A's forward started from (NULL: not
 * wanted); the backward of rx_tm_forward_state. */
int rx_tm_backward_state(const rx_model_ctx *ctx,
                         const rx_tm_params *P, const rx_tm_acts *A, const float *x,
                         const float *x_prev_init, const float *v_first, const float *dy,
                         rx_tm_grads *G, float *dx, float *d_xprev_init, float *d_v_first,
                         float *d_state, float *work);

/* ---- block.c -----------------------------------------------------------
 * An RWKV block's forward intermediates, kept by rx_block_forward_acts so
 * the backward need not run the forward again (it only reads them, so it
 * can run more than once per forward). */
typedef struct {
    rx_tm_acts tm;
    float *h1, *x1, *h2, *xk;   /* [BT][C] ln1 out, residual after TM, ln2 out, CM lerp */
    float *hid;                 /* [BT][F] CM relu^2 hidden (its backward recovers relu(pre)) */
    float *mem;
} rx_block_acts;

/* RX_OK or RX_ENOMEM; rx_block_acts_free(S) is safe after either. */
int rx_block_acts_alloc(rx_block_acts *S, const rx_block_params *P, size_t B, size_t T);
/* The same buffers carved from caller memory of rx_block_acts_floats floats
 * (64-byte aligned), which S does not own (rx_block_acts_free frees nothing). */
size_t rx_block_acts_floats(const rx_block_params *P, size_t B, size_t T);
void rx_block_acts_carve(rx_block_acts *S, const rx_block_params *P, size_t B, size_t T,
                         float *mem);
/* rx_block_acts_alloc less the WKV scratch, which is wkv_work, the caller's
 * (rx_tm_acts_carve_shared): the blocks of a model step share one. */
int rx_block_acts_alloc_shared(rx_block_acts *S, const rx_block_params *P, size_t B, size_t T,
                               float *wkv_work);
/* The lean set of recompute: rx_block_acts_floats_lean floats of mem, and
 * h2, xk, hid in work, the scratch of rx_block_work_lean floats that the
 * backward of this set then takes (so between the forward and the backward
 * no other block may use it). The backward overwrites the set
 * (rx_tm_acts_carve_lean). */
size_t rx_block_acts_floats_lean(const rx_block_params *P, size_t B, size_t T);
size_t rx_block_work_lean(const rx_block_params *P, size_t BT);
void rx_block_acts_carve_lean(rx_block_acts *S, const rx_block_params *P, size_t B, size_t T,
                              float *mem, float *work);
void rx_block_acts_free(rx_block_acts *S);
/* rx_block_forward_seq's arguments (validated by the caller), filling S;
 * v_first as in rx_tm_forward_acts (read at layer > 0, written at 0). out
 * NULL: S alone, for a backward (the channel-mix value projection skipped). */
int rx_block_forward_acts(const rx_model_ctx *ctx, const rx_block_params *P, const float *x,
                          const float *tm_xprev_init, const float *cm_xprev_init,
                          const float *v_first_in, float *v_first_out, rx_block_acts *S,
                          float *out);
/* rx_block_backward's arguments (validated by the caller) with S from
 * rx_block_forward_acts on the same inputs; work: rx_block_work(P, B*T)
 * floats of scratch. */
size_t rx_block_work(const rx_block_params *P, size_t BT);
int rx_block_backward_acts(const rx_model_ctx *ctx,
                           const rx_block_params *P, const rx_block_acts *S, const float *x,
                           const float *tm_xprev_init, const float *cm_xprev_init,
                           const float *v_first, const float *dy, rx_block_grads *G,
                           float *dx, float *d_tm_xprev_init, float *d_cm_xprev_init,
                           float *d_v_first, float *work);
/* The two above with a trainable initial WKV state: the forward starts the
 * time-mix's WKV7 from state [B][H][N][N] (NULL: zero), which it advances
 * in place to the final state (rx_tm_forward_state); the backward writes
 * d_state [B][H][N][N], the grad on that initial state (NULL: not wanted). */
int rx_block_forward_state(const rx_model_ctx *ctx, const rx_block_params *P, const float *x,
                           const float *tm_xprev_init, const float *cm_xprev_init,
                           const float *v_first_in, float *v_first_out, float *state,
                           rx_block_acts *S, float *out);
int rx_block_backward_state(const rx_model_ctx *ctx,
                            const rx_block_params *P, const rx_block_acts *S, const float *x,
                            const float *tm_xprev_init, const float *cm_xprev_init,
                            const float *v_first, const float *dy, rx_block_grads *G,
                            float *dx, float *d_tm_xprev_init, float *d_cm_xprev_init,
                            float *d_v_first, float *d_state, float *work);

/* ---- attn.c ------------------------------------------------------------
 * An attention block's forward intermediates and its core's scratch, all
 * allocated once by rx_attn_acts_new for B, T (NULL: bad sizes or no
 * memory), kept by rx_attn_forward_acts so the backward need not run the
 * forward again: rx_attn_backward_acts only reads them (it may run more
 * than once per forward). Arguments as in rx_attn_forward_seq /
 * rx_attn_backward_full; out may be NULL; work: RX_ATTN_WORK floats. */
typedef struct rx_attn_acts rx_attn_acts;
rx_attn_acts *rx_attn_acts_new(const rx_attn_params *P, size_t B, size_t T);
/* rx_attn_acts_new with its [BT] buffers (the core's kept selection and
 * its [BT]-sized scratch too) in caller memory of rx_attn_acts_floats
 * floats (64-byte aligned), which S does not own (0: bad sizes). */
size_t rx_attn_acts_floats(const rx_attn_params *P, size_t B, size_t T);
rx_attn_acts *rx_attn_acts_new_in(const rx_attn_params *P, size_t B, size_t T, float *mem);
void rx_attn_acts_free(rx_attn_acts *S);
/* Recompute keeps what the core made per block, one shared S for the rest:
 * rx_attn_kept_floats floats (64-byte aligned) hold y [BT][C], the
 * selection and the log-sum-exp; rx_attn_acts_bind points S at them (a
 * forward then writes them there); rx_attn_forward_kept redoes the block's
 * forward from x but for the core, whose products S holds already, and
 * without the block output (the channel-mix value projection skipped). */
size_t rx_attn_kept_floats(const rx_attn_params *P, size_t B, size_t T);
void rx_attn_acts_bind(rx_attn_acts *S, const rx_attn_params *P, float *kept);
int rx_attn_forward_kept(const rx_model_ctx *ctx,
                         const rx_attn_params *P, const float *x, const float *cm_xprev_init,
                         rx_attn_acts *S);
int rx_attn_forward_acts(const rx_model_ctx *ctx,
                         const rx_attn_params *P, const float *x, const float *cm_xprev_init,
                         rx_attn_acts *S, float *out);
#define RX_ATTN_WORK(BT, C, F) (5 * (BT) * (C) + (BT) * (F))
int rx_attn_backward_acts(const rx_model_ctx *ctx,
                          const rx_attn_params *P, rx_attn_acts *S, const float *x,
                          const float *cm_xprev_init, const float *dy, rx_attn_grads *G,
                          float *dx, float *d_cm_xprev_init, float *work);

/* ---- block steps: block.c, attn.c, tokenshift.c --------------------------
 * A block advanced over the next T tokens of its sequences from carried
 * state, with the training forward's own functions (recurrent inference,
 * infer.c, calls these in model order). Carries [B][C] (NULL: zero, not
 * kept) hold each sequence's last ln1 / ln2 row before the call and are
 * overwritten with those after it (rx_shift_carry). */
void rx_shift_carry(float *carry, const float *x, size_t B, size_t T, size_t C);
/* rx_shift_carry over rows laid out as sq says (carry rows rx_seqs_slot) */
void rx_shift_carry_seqs(float *carry, const float *x, const rx_seqs *sq, size_t C);
/* rx_block_forward_state (the training forward's: the WKV state advanced in
 * place), then the carries; S for B, T. */
int rx_block_step(const rx_model_ctx *ctx, const rx_block_params *P, const float *x,
                  float *tm_carry, float *cm_carry, const float *v_first_in, float *v_first_out,
                  float *state, rx_block_acts *S, float *out);
/* One sequence (S for B = 1, T): the queries x [T][C] at positions
 * pos..pos+T-1, whose keys and values go into rows pos.. of kc, vc
 * [pos+T][C] after the earlier positions' (the cache); out [T][C]. The
 * core of rx_attn_forward_acts, the training forward being pos 0 over its
 * own keys: at pos 0 the training forward's bits (its tiled core), after
 * it the decoding core, which selects with the same code and softmaxes one
 * query at a time. Projections through rx_pgemm_batch / rx_pgemm. */
int rx_attn_step(const rx_model_ctx *ctx, const rx_attn_params *P, const float *x,
                 float *cm_carry, float *kc, float *vc, int pos, rx_attn_acts *S, float *out);
/* rx_attn_step over the sequences of a ragged step (sq: B sequences, its
 * off, seq and slot set) at once: x, out [rows][C]; slot s's carry row
 * cm_carry[s], cache kc, vc + s*L*C ([L][C] each) and position pos[s]
 * (the caller checked pos[s] + its rows <= L); S made for B = 1 and at
 * least rows tokens. Every projection is one GEMM over all rows; each
 * sequence's bits are rx_attn_step's over its rows alone. */
int rx_attn_step_seqs(const rx_model_ctx *ctx, const rx_attn_params *P, const float *x,
                      float *cm_carry, float *kc, float *vc, size_t L, const int *pos,
                      const rx_seqs *sq, rx_attn_acts *S, float *out);
/* S's decoding core (rx_attn_step after position 0) given scratch for
 * caches of up to max_len positions, so that such a step allocates
 * nothing (without it each allocates its own). RX_OK, RX_EINVAL, RX_ENOMEM. */
int rx_attn_acts_reserve(rx_attn_acts *S, const rx_attn_params *P, size_t max_len);

/* ---- runtime.c: the model context ----------------------------------------
 * The default model context (RX_DEFAULT_*): what the standalone kernels
 * (rx_block_forward_seq, rx_attn_forward_seq, rx_timemix_forward_seq, ...)
 * run with; a model's kernels get its own (rx_model_create_ctx). */
extern const rx_model_ctx rx_ctx_default;

#endif /* RWKVX_INTERNAL_H */
