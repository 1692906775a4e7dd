/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * cpu.c -- the machine under the kernels: each thread's scratch buffers
 * (rx_thread_buffer) and what the CPU can run (rx_cpu_*), read by the
 * GEMMs, the norms, the WKV kernel, the adapters and the base's packers.
 */
#include <pthread.h>
#include <sys/mman.h>

#include "rx_internal.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#define RX_CPU_X86 1
#endif

/* ---- per-thread scratch -------------------------------------------------
 * The buffers live for the thread's lifetime: a training step must not
 * allocate once its first call has grown them. They are reached through a
 * thread-local pointer and also registered under a pthread key whose
 * destructor frees them when the thread exits: a caller that runs steps
 * from many short-lived threads (or an OpenMP pool that shrinks) would
 * otherwise leak them per thread. */
typedef struct {
    void *buf[RX_BUF_N];
    size_t buf_n[RX_BUF_N];
} thread_bufs;

static _Thread_local thread_bufs *tl;
static pthread_key_t bufs_key;
static pthread_once_t bufs_once = PTHREAD_ONCE_INIT;
static int bufs_key_ok;

static void bufs_free(void *p) {
    thread_bufs *s = p;
    for (int i = 0; i < RX_BUF_N; i++) free(s->buf[i]);
    free(s);
}

static void bufs_key_make(void) { bufs_key_ok = pthread_key_create(&bufs_key, bufs_free) == 0; }

/* The calling thread's buffers, created empty on first use; NULL when they
 * cannot be made. */
static thread_bufs *bufs(void) {
    if (tl) return tl;
    pthread_once(&bufs_once, bufs_key_make);
    if (!bufs_key_ok) return NULL;
    thread_bufs *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    if (pthread_setspecific(bufs_key, s) != 0) {
        free(s);
        return NULL;
    }
    return tl = s;
}

void *rx_thread_buffer(int slot, size_t bytes) {
    thread_bufs *s = bufs();
    if (!s) return NULL;
    if (bytes > s->buf_n[slot]) {
        free(s->buf[slot]);
        s->buf[slot] = rx_alloc(bytes, 1);
        s->buf_n[slot] = s->buf[slot] ? bytes : 0;
    }
    return s->buf[slot];
}

/* ---- huge pages ----------------------------------------------------------- */

void rx_advise_huge(void *p, size_t bytes) {
#ifdef MADV_HUGEPAGE
    if (p && bytes >= RX_HUGE_PAGE) (void)madvise(p, bytes, MADV_HUGEPAGE);
#else
    (void)p;
    (void)bytes;
#endif
}

void *rx_alloc_huge(size_t bytes) {
    if (bytes < RX_HUGE_PAGE) return rx_alloc(bytes, 1);
    const size_t whole = (bytes + RX_HUGE_PAGE - 1) / RX_HUGE_PAGE * RX_HUGE_PAGE;
    if (whole < bytes) return NULL;
    void *p = aligned_alloc(RX_HUGE_PAGE, whole);
    rx_advise_huge(p, whole);
    return p;
}

/* ---- CPU detection -------------------------------------------------------- */

#ifdef RX_CPU_X86
/* CPUID leaf 1's family: the base family plus, when that is 0xF, the
 * extended family. */
static unsigned cpu_family(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const unsigned base = (a >> 8) & 0xF;
    return base == 0xF ? base + ((a >> 20) & 0xFF) : base;
}
#endif

/* Zen 4 (family 0x19) splits each 512-bit FMA over two 256-bit halves;
 * Zen 5 (0x1A) runs it, and vdpbf16ps, on full-width pipes. */
int rx_cpu_zen5_or_later(void) {
#ifdef RX_CPU_X86
    /* asked once: every fp32 GEMM call picks its kernel by it, and a CPUID
     * under a hypervisor exits to it (1.4% of a batch-1 decode's samples
     * on a Zen 4 guest when asked each call) */
    static int zen5 = -1;
    int v = __atomic_load_n(&zen5, __ATOMIC_ACQUIRE);
    if (v >= 0) return v;
    v = __builtin_cpu_is("amd") && cpu_family() >= 0x1A;
    __atomic_store_n(&zen5, v, __ATOMIC_RELEASE);
    return v;
#else
    return 0;
#endif
}

int rx_cpu_base_simd(void) {
#ifdef RX_CPU_X86
    static int level = -1;
    int v = __atomic_load_n(&level, __ATOMIC_ACQUIRE);
    if (v >= 0) return v;
    unsigned a, b, c, d;
    /* RWKVX_BASE_PORTABLE=1: the portable packers; =avx2: the AVX2 ones;
     * =avx512bf16: level 2's (tests on a CPU with more) */
    const char *env = getenv("RWKVX_BASE_PORTABLE");
    v = !(env && (!strcmp(env, "1") || !strcmp(env, "avx2"))) &&
        __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl");
    if (v && __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1)) v = 2;
    if (v == 2 && __builtin_cpu_supports("avx512vbmi") && !(env && !strcmp(env, "avx512bf16")))
        v = 3;
    __atomic_store_n(&level, v, __ATOMIC_RELEASE);
    return v;
#else
    return 0;
#endif
}

int rx_cpu_base_avx2(void) {
#ifdef RX_CPU_X86
    static int level = -1;
    int v = __atomic_load_n(&level, __ATOMIC_ACQUIRE);
    if (v >= 0) return v;
    const char *env = getenv("RWKVX_BASE_PORTABLE");
    v = !(env && !strcmp(env, "1")) && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("f16c");
    __atomic_store_n(&level, v, __ATOMIC_RELEASE);
    return v;
#else
    return 0;
#endif
}
