/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * test_fastmath.c -- rx_expf, rx_sigmoidf and rx_tanhf (rx_internal.h)
 * against double-precision libm over dense sweeps of their whole input
 * range, subnormal results, infinities and NaN. Each is checked twice: as
 * compiled here and, on a CPU with AVX2+FMA, inlined into an x86-64-v3
 * function (the RX_HOT clone, where GCC contracts to FMA).
 *
 * Exit status: 0 when every check passes.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>

#include "rx_internal.h"

#define EXP_MAX_ULP 1.5
#define SIGMOID_MAX_ULP 3.0
#define TANH_MAX_ULP 2.0

static int failures;

static void fail(const char *what, double x, double got, double ref) {
    if (failures++ < 10) printf("FAIL %s: x=%.9g got %.9g want %.9g\n", what, x, got, ref);
}

/* |got - ref| in units of the float spacing at ref (subnormal spacing below
 * FLT_MIN) */
static double ulps(float got, double ref) {
    double a = fabs(ref), u = a < FLT_MIN ? 0x1p-149 : ldexp(1.0, ilogb(a) - 23);
    return fabs((double)got - ref) / u;
}

typedef float (*f1)(float);

static float exp_plain(float x) { return rx_expf(x); }
static float sigmoid_plain(float x) { return rx_sigmoidf(x); }
static float tanh_plain(float x) { return rx_tanhf(x); }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define V3 __attribute__((target("arch=x86-64-v3"), noinline))
V3 static float exp_v3(float x) { return rx_expf(x); }
V3 static float sigmoid_v3(float x) { return rx_sigmoidf(x); }
V3 static float tanh_v3(float x) { return rx_tanhf(x); }
static int have_v3(void) { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }
#endif

/* the float nearest x, then the worst ulp error of f over the sweep */
static double sweep(const char *what, f1 f, double (*ref)(double), double lo, double hi,
                    double step, double max_ulp) {
    double worst = 0.0;
    for (double xd = lo; xd <= hi; xd += step) {
        float x = (float)xd;
        double want = ref((double)x);
        float got = f(x);
        if ((float)want == INFINITY || (float)want == -INFINITY) {
            /* overflow: inf, or FLT_MAX where e^x rounds just past it */
            if (!(fabsf(got) == INFINITY || ulps(got, want) <= max_ulp)) fail(what, x, got, want);
            continue;
        }
        double e = ulps(got, want);
        if (!(e <= max_ulp)) fail(what, x, got, want);
        if (e > worst) worst = e;
    }
    return worst;
}

static double dexp(double x) { return exp(x); }
static double dsigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
static double dtanh(double x) { return tanh(x); }

static void check_special(const char *what, f1 f, float x, float want) {
    float got = f(x);
    if (isnan(want) ? !isnan(got) : got != want) fail(what, x, got, want);
}

static void check_all(const char *tag, f1 ex, f1 sg, f1 th) {
    char name[64];
    snprintf(name, sizeof name, "expf %s", tag);
    double w = sweep(name, ex, dexp, -110.0, 95.0, 1.1e-4, EXP_MAX_ULP);
    /* near 0 the reduction is trivial: the polynomial alone */
    double w0 = sweep(name, ex, dexp, -1e-3, 1e-3, 3.1e-9, EXP_MAX_ULP);
    /* subnormal results: ldexp rounding */
    double ws = sweep(name, ex, dexp, -103.98, -87.3, 1.1e-6, EXP_MAX_ULP);
    check_special(name, ex, 0.0f, 1.0f);
    check_special(name, ex, -0.0f, 1.0f);
    check_special(name, ex, INFINITY, INFINITY);
    check_special(name, ex, -INFINITY, 0.0f);
    check_special(name, ex, 89.0f, INFINITY);
    check_special(name, ex, 1e30f, INFINITY);
    check_special(name, ex, -1e30f, 0.0f);
    check_special(name, ex, -104.0f, 0.0f);
    check_special(name, ex, NAN, NAN);
    check_special(name, ex, -NAN, NAN);
    check_special(name, ex, FLT_MIN, 1.0f);
    check_special(name, ex, 0x1p-149f, 1.0f);
    printf("%s: worst %.3f ulp (%.3f near 0, %.3f subnormal)\n", name, w, w0, ws);

    snprintf(name, sizeof name, "sigmoid %s", tag);
    w = sweep(name, sg, dsigmoid, -87.9, 95.0, 1.1e-4, SIGMOID_MAX_ULP);
    check_special(name, sg, INFINITY, 1.0f);
    check_special(name, sg, -INFINITY, sg(-88.5f)); /* clamped like -88 */
    check_special(name, sg, NAN, NAN);
    if (!(sg(-1e30f) >= 0.0f && sg(-1e30f) < 1e-37f)) fail(name, -1e30, sg(-1e30f), 0.0);
    printf("%s: worst %.3f ulp\n", name, w);

    snprintf(name, sizeof name, "tanh %s", tag);
    w = sweep(name, th, dtanh, -20.0, 20.0, 3.1e-5, TANH_MAX_ULP);
    w0 = sweep(name, th, dtanh, -1e-3, 1e-3, 3.1e-9, TANH_MAX_ULP);
    check_special(name, th, 0.0f, 0.0f);
    check_special(name, th, INFINITY, 1.0f);
    check_special(name, th, -INFINITY, -1.0f);
    check_special(name, th, 1e30f, 1.0f);
    check_special(name, th, -1e30f, -1.0f);
    check_special(name, th, 0x1p-149f, 0x1p-149f);
    check_special(name, th, NAN, NAN);
    if (signbit(th(-0.0f)) == 0) fail(name, -0.0, th(-0.0f), -0.0);
    printf("%s: worst %.3f ulp (%.3f near 0)\n", name, w, w0);
}

int main(void) {
    check_all("plain", exp_plain, sigmoid_plain, tanh_plain);
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    if (have_v3()) check_all("x86-64-v3", exp_v3, sigmoid_v3, tanh_v3);
#endif
    if (failures) printf("%d failures\n", failures);
    else printf("ok\n");
    return failures != 0;
}
