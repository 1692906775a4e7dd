/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * gemm_ops.c -- what the fp32 and the bf16 GEMM batches share: the check
 * that a batch's ops are independent, and the ops with work left in it.
 */
#include "rx_internal.h"

/* ---- independence of a batch's ops ---------------------------------------
 *
 * A batch runs every op's packing and compute in one parallel region, and
 * a single op reads op(A) panel by panel while other panels' C rows are
 * already written: an output that shares memory with an input, or with
 * another op's output, gives a result that depends on the threads' timing.
 * So every batch checks this before it writes anything (its cost is a few
 * comparisons per pair of ops; the model's passes hold at most 16). */

/* A row-major region: rows of cols floats, row r at byte p + r * ld. */
typedef struct {
    uintptr_t p;
    size_t rows, cols, ld;   /* cols and ld in bytes */
} region;

static region mat_region(const float *p, size_t rows, size_t cols, size_t ld) {
    region g = {(uintptr_t)p, rows, cols * sizeof(float), ld * sizeof(float)};
    return g;
}

/* One past the last byte of g. */
static uintptr_t region_end(region g) { return g.p + (g.rows - 1) * g.ld + g.cols; }

/* Whether the bytes [s, e) meet row r of g, for any r. Only the rows whose
 * span can reach [s, e) are tried: at most 2 + (e - s) / ld of them. */
static int bytes_meet(uintptr_t s, uintptr_t e, region g) {
    if (e <= g.p || s >= region_end(g)) return 0;
    if (g.rows == 1 || g.ld == 0) return 1;
    size_t hi = (e - 1 - g.p) / g.ld, lo = 0;
    if (hi > g.rows - 1) hi = g.rows - 1;
    if (s > g.p && s - g.p >= g.cols) lo = (s - g.p - g.cols) / g.ld + 1;
    for (size_t r = lo; r <= hi; r++) {
        uintptr_t a = g.p + r * g.ld;
        if (a < e && a + g.cols > s) return 1;
    }
    return 0;
}

/* Whether regions a and b share a byte: their extents first, then row by
 * row of the shorter (column-interleaved layouts share extents only). */
static int regions_meet(region a, region b) {
    if (region_end(a) <= b.p || region_end(b) <= a.p) return 0;
    if (a.rows > b.rows) {
        region t = a;
        a = b;
        b = t;
    }
    for (size_t r = 0; r < a.rows; r++)
        if (bytes_meet(a.p + r * a.ld, a.p + r * a.ld + a.cols, b)) return 1;
    return 0;
}

int rx_gemm_check_batch(const char *fn, const rx_gemm_op *ops, size_t n) {
    for (size_t j = 0; j < n; j++) {
        const rx_gemm_op *c = &ops[j];
        if (c->M == 0 || c->N == 0) continue;
        const region out = mat_region(c->C, c->M, c->N, c->ldc);
        for (size_t k = 0; k < n; k++) {
            const rx_gemm_op *g = &ops[k];
            if (g->M == 0 || g->N == 0) continue;
            const char *what = NULL;
            if (g->K > 0 && regions_meet(out, g->ta ? mat_region(g->A, g->K, g->M, g->lda)
                                                    : mat_region(g->A, g->M, g->K, g->lda)))
                what = "input A";
            else if (g->K > 0 && regions_meet(out, g->tb ? mat_region(g->B, g->N, g->K, g->ldb)
                                                         : mat_region(g->B, g->K, g->N, g->ldb)))
                what = "input B";
            else if (k < j && regions_meet(out, mat_region(g->C, g->M, g->N, g->ldc)))
                what = "output C";
            if (what)
                return rx_fail(RX_EINVAL, "%s: the output C of GEMM %zu of %zu overlaps the %s of "
                               "GEMM %zu (outputs must not share memory with inputs or other "
                               "outputs)", fn, j, n, what, k);
        }
    }
    return RX_OK;
}

size_t rx_gemm_live_ops(const rx_gemm_op *ops, size_t n, rx_gemm_op *live) {
    size_t nl = 0;
    for (size_t k = 0; k < n; k++) {
        const rx_gemm_op *g = &ops[k];
        if (g->M == 0 || g->N == 0) continue;
        if (g->K == 0) {
            if (g->beta == 0.0f)
                for (size_t i = 0; i < g->M; i++) memset(g->C + i * g->ldc, 0, g->N * sizeof(float));
            continue;
        }
        live[nl++] = *g;
    }
    return nl;
}

/* The small-M bound both GEMMs read (gemm.c, gemm_bf16.c "small M"), here
 * below them so that neither calls the other */
static size_t small_m = RX_GEMM_SMALL_M;

size_t rx_sgemm_small_m(size_t m) {
    const size_t old = small_m;
    small_m = m < RX_GEMM_SMALL_MAX ? m : RX_GEMM_SMALL_MAX;
    return old;
}

size_t rx_gemm_small_bound(void) { return small_m; }

size_t rx_gemm_set_budget(size_t *budget, size_t v, size_t dflt) {
    const size_t was = *budget;
    *budget = v ? v : dflt;
    return was;
}
