/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * peak.c -- one core's arithmetic peak per instruction, in GFLOP/s: what
 * each GEMM kernel of csrc/ could reach at best on this CPU. Built and run
 * by bench_peak.py; prints "name GFLOP/s" lines, "name -" where the CPU (or
 * the OS, for AMX) lacks the instruction.
 *
 *   fma-ymm     vfmadd231ps on 8 floats    (the avx2-fma sgemm kernel)
 *   fma-zmm     vfmadd231ps on 16 floats   (the avx512f sgemm kernels)
 *   dpbf16-zmm  vdpbf16ps on 32 bf16 pairs (the avx512-bf16 kernel)
 *   amx-bf16    tdpbf16ps on 16x32 tiles   (the amx-bf16 kernel), 2x2
 *               accumulator tiles from register-resident operands
 *
 * Each loop keeps 12 (AVX2) or 16 independent accumulators (more than
 * latency times ports on any current core) and operands that never change, so it
 * measures issue rate, not memory. The operands are ordinary non-zero
 * numbers (a multiplier may take shortcuts on zeros). The best of several
 * repetitions, by thread CPU time, is reported: a shared core only ever
 * makes a figure lower.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define REPS 7
#define ACC 16     /* accumulators of a 32-register (AVX-512) loop */
#define ACC_YMM 12 /* of the AVX2 one: 16 registers hold 12 plus the operands */

static double cpu_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* best GFLOP/s of REPS runs of fn(n), each doing flops_per_iter * n flops */
static double best_rate(double (*fn)(long), long n, double flops_per_iter) {
    double best = 0.0;
    for (int r = 0; r < REPS; r++) {
        double t = fn(n);
        double g = flops_per_iter * (double)n / t / 1e9;
        if (g > best) best = g;
    }
    return best;
}

static volatile float sink;

#define FMA_LOOP(NACC, T, SET1, FMA, ADD, RED)                                    \
    T c[NACC];                                                                   \
    for (int j = 0; j < NACC; j++) c[j] = SET1(0.0f);                            \
    T a = SET1(1.0001f), b = SET1(0.9999f);                                      \
    double t = cpu_now();                                                        \
    for (long i = 0; i < n; i++) {                                               \
        _Pragma("GCC unroll 16") for (int j = 0; j < NACC; j++) c[j] = FMA(a, b, c[j]); \
        __asm__ volatile("" : "+v"(a), "+v"(b));                                 \
    }                                                                            \
    t = cpu_now() - t;                                                           \
    for (int j = 1; j < NACC; j++) c[0] = ADD(c[0], c[j]);                       \
    sink = RED(c[0]);                                                            \
    return t;

__attribute__((target("avx2,fma"))) static float red256(__m256 x) {
    float v[8];
    _mm256_storeu_ps(v, x);
    return v[0];
}

__attribute__((target("avx2,fma"))) static double fma_ymm(long n) {
    FMA_LOOP(ACC_YMM, __m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps, red256)
}

__attribute__((target("avx512f"))) static float red512(__m512 x) {
    return _mm512_reduce_add_ps(x);
}

__attribute__((target("avx512f"))) static double fma_zmm(long n) {
    FMA_LOOP(ACC, __m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps, red512)
}

__attribute__((target("avx512f,avx512bf16"))) static double dpbf16_zmm(long n) {
    __m512 c[ACC];
    for (int j = 0; j < ACC; j++) c[j] = _mm512_setzero_ps();
    __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f813f80), b = (__m512bh)_mm512_set1_epi32(0x3f7f3f81);
    double t = cpu_now();
    for (long i = 0; i < n; i++) {
        _Pragma("GCC unroll 16") for (int j = 0; j < ACC; j++) c[j] = _mm512_dpbf16_ps(c[j], a, b);
        __asm__ volatile("" : "+v"(a), "+v"(b));
    }
    t = cpu_now() - t;
    for (int j = 1; j < ACC; j++) c[0] = _mm512_add_ps(c[0], c[j]);
    sink = _mm512_reduce_add_ps(c[0]);
    return t;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

static uint16_t tiles[4][16 * 32] __attribute__((aligned(64)));

__attribute__((target("amx-tile,amx-bf16"))) static double amx_bf16(long n) {
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, tiles[0], 64);
    _tile_loadd(5, tiles[1], 64);
    _tile_loadd(6, tiles[2], 64);
    _tile_loadd(7, tiles[3], 64);
    double t = cpu_now();
    for (long i = 0; i < n; i++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    t = cpu_now() - t;
    static float out[16 * 16] __attribute__((aligned(64)));
    _tile_stored(0, out, 64);
    _tile_release();
    sink = out[0];
    return t;
}

static int cpuid_bit(unsigned leaf, unsigned sub, int reg, int bit) {
    unsigned r[4];
    if (!__get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3])) return 0;
    return (r[reg] >> bit) & 1;
}

/* AMX-BF16 in CPUID and Linux's permission for the tile data (as
 * csrc/gemm_bf16.c asks for it). */
static int have_amx(void) {
    return cpuid_bit(7, 0, 3, 22) && cpuid_bit(7, 0, 3, 24) &&
           syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

int main(void) {
    for (int i = 0; i < 4 * 16 * 32; i++) tiles[i / 512][i % 512] = (uint16_t)(0x3f80 + i % 7);
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        printf("fma-ymm %.1f\n", best_rate(fma_ymm, 20000000, ACC_YMM * 16.0));
    else
        printf("fma-ymm -\n");
    if (__builtin_cpu_supports("avx512f"))
        printf("fma-zmm %.1f\n", best_rate(fma_zmm, 20000000, ACC * 32.0));
    else
        printf("fma-zmm -\n");
    if (__builtin_cpu_supports("avx512f") && cpuid_bit(7, 1, 0, 5))
        printf("dpbf16-zmm %.1f\n", best_rate(dpbf16_zmm, 10000000, ACC * 64.0));
    else
        printf("dpbf16-zmm -\n");
    if (have_amx())
        printf("amx-bf16 %.1f\n", best_rate(amx_bf16, 1000000, 4 * 16 * 16 * 32 * 2.0));
    else
        printf("amx-bf16 -\n");
    return 0;
}
#else
int main(void) {
    puts("fma-ymm -\nfma-zmm -\ndpbf16-zmm -\namx-bf16 -");
    return 0;
}
#endif
