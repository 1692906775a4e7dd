/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * test_kernels.c -- the foundation kernels (WKV7, LayerNorm, embedding,
 * head, cross-entropy, channel-mix) against plain double-precision loops on
 * random inputs, plus their invalid-argument answers. Built with
 * -fsanitize=address,undefined by tests/test_sanitizers.py, so every buffer
 * here is exactly its size: an overrun is a sanitizer error.
 *
 * Exit status: 0 when every check passes.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rx_pretrain.h"

#define FWD_TOL 1e-5
#define GRAD_TOL 1e-4

static int failures;
static uint64_t rng_state = 0x1234567887654321ull;

static double urand(void) { /* splitmix64 -> [0, 1) */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1.0p-53;
}

static float *frand(size_t n, double lo, double hi) {
    float *p = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = (float)(lo + (hi - lo) * urand());
    return p;
}

static float *fbuf(size_t n) { return malloc(n * sizeof(float)); }
static double *dbuf(size_t n) { return calloc(n, sizeof(double)); }

static void fail(const char *what) {
    printf("FAIL %s\n", what);
    failures++;
}

/* max|got - ref| <= tol * max|ref|, and every value finite */
static void check(const char *what, const float *got, const double *ref, size_t n, double tol) {
    double err = 0.0, scale = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(got[i])) {
            printf("FAIL %s: non-finite at %zu\n", what, i);
            failures++;
            return;
        }
        double d = fabs((double)got[i] - ref[i]);
        err = d > err ? d : err;
        scale = fabs(ref[i]) > scale ? fabs(ref[i]) : scale;
    }
    if (err > tol * scale) {
        printf("FAIL %s: max|err| %.3e > %.0e * max|ref| %.3e\n", what, err, tol, scale);
        failures++;
    }
}

static int all_zero(const float *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != 0.0f) return 0;
    return 1;
}

/* ------------------------------------------------------------------ WKV7 */

/* Double forward keeping every state: Ss [B][H][T+1][N][N], y [B][T][H][N]. */
static void wkv7_ref(const float *r, const float *w, const float *k, const float *v,
                     const float *a, const float *b, const float *s0, double *Ss, double *y,
                     int B, int T, int H, int N) {
    size_t C = (size_t)H * N, NN = (size_t)N * N;
    for (int bi = 0; bi < B; bi++)
        for (int h = 0; h < H; h++) {
            double *S = Ss + ((size_t)bi * H + h) * (T + 1) * NN;
            for (size_t e = 0; e < NN; e++) S[e] = s0 ? s0[((size_t)bi * H + h) * NN + e] : 0.0;
            for (int t = 0; t < T; t++) {
                size_t o = ((size_t)bi * T + t) * C + (size_t)h * N;
                double *P = S + (size_t)t * NN, *Q = P + NN;
                for (int i = 0; i < N; i++) {
                    double sa = 0.0, yi = 0.0;
                    for (int j = 0; j < N; j++) sa += (double)a[o + j] * P[i * N + j];
                    for (int j = 0; j < N; j++) {
                        Q[i * N + j] = P[i * N + j] * w[o + j] + (double)v[o + i] * k[o + j] +
                                       sa * b[o + j];
                        yi += Q[i * N + j] * r[o + j];
                    }
                    y[o + i] = yi;
                }
            }
        }
}

/* Backward through time over the stored states. g: dr, dw, dk, dv, da, db. */
static void wkv7_ref_back(const float *r, const float *w, const float *k, const float *v,
                          const float *a, const float *b, const float *dy, const double *Ss,
                          double *g[6], double *dS0, int B, int T, int H, int N) {
    size_t C = (size_t)H * N, NN = (size_t)N * N;
    double *dS = dbuf(NN), *dsa = dbuf((size_t)N);
    for (int bi = 0; bi < B; bi++)
        for (int h = 0; h < H; h++) {
            const double *S = Ss + ((size_t)bi * H + h) * (T + 1) * NN;
            memset(dS, 0, NN * sizeof(double));
            for (int t = T - 1; t >= 0; t--) {
                size_t o = ((size_t)bi * T + t) * C + (size_t)h * N;
                const double *P = S + (size_t)t * NN, *Q = P + NN;
                for (int i = 0; i < N; i++)
                    for (int j = 0; j < N; j++) {
                        dS[i * N + j] += (double)dy[o + i] * r[o + j];
                        g[0][o + j] += (double)dy[o + i] * Q[i * N + j];
                    }
                for (int i = 0; i < N; i++) {
                    double sa = 0.0;
                    dsa[i] = 0.0;
                    for (int j = 0; j < N; j++) sa += (double)a[o + j] * P[i * N + j];
                    for (int j = 0; j < N; j++) {
                        double gs = dS[i * N + j];
                        g[1][o + j] += gs * P[i * N + j];
                        g[2][o + j] += gs * v[o + i];
                        g[3][o + i] += gs * k[o + j];
                        g[5][o + j] += gs * sa;
                        dsa[i] += gs * b[o + j];
                    }
                }
                for (int i = 0; i < N; i++)
                    for (int j = 0; j < N; j++) {
                        g[4][o + j] += dsa[i] * P[i * N + j];
                        dS[i * N + j] = dS[i * N + j] * w[o + j] + dsa[i] * a[o + j];
                    }
            }
            memcpy(dS0 + ((size_t)bi * H + h) * NN, dS, NN * sizeof(double));
        }
    free(dS);
    free(dsa);
}

static void test_wkv7(int B, int T, int H, int N, int with_state) {
    size_t n = (size_t)B * T * H * N, ns = (size_t)B * H * N * N;
    float *r = frand(n, -1, 1), *w = frand(n, 0.55, 1.0), *k = frand(n, -1, 1);
    float *v = frand(n, -1, 1), *a = fbuf(n), *b = fbuf(n), *dy = frand(n, -1, 1);
    float *s0 = with_state ? frand(ns, -0.5, 0.5) : NULL;
    /* a = -kk, b = kk * iclr with kk unit-norm per head: a bounded state */
    for (size_t o = 0; o < n; o += (size_t)N) {
        double nn = 0.0;
        for (int j = 0; j < N; j++) {
            a[o + j] = (float)(urand() - 0.5);
            nn += (double)a[o + j] * a[o + j];
        }
        for (int j = 0; j < N; j++) {
            float kk = (float)(a[o + j] / sqrt(nn));
            a[o + j] = -kk;
            b[o + j] = kk * (float)urand();
        }
    }
    double *Ss = dbuf((size_t)B * H * (T + 1) * N * N), *y_ref = dbuf(n), *dS0_ref = dbuf(ns);
    double *g_ref[6];
    for (int i = 0; i < 6; i++) g_ref[i] = dbuf(n);
    wkv7_ref(r, w, k, v, a, b, s0, Ss, y_ref, B, T, H, N);
    wkv7_ref_back(r, w, k, v, a, b, dy, Ss, g_ref, dS0_ref, B, T, H, N);
    double *sf_ref = dbuf(ns);
    for (int bh = 0; bh < B * H; bh++)
        for (int e = 0; e < N * N; e++)
            sf_ref[(size_t)bh * N * N + e] = Ss[((size_t)bh * (T + 1) + T) * N * N + e];

    float *y = fbuf(n), *sf = fbuf(ns), *dS0 = fbuf(ns), *g[6];
    for (int i = 0; i < 6; i++) g[i] = fbuf(n);
    static const char *names[6] = {"wkv7 dr", "wkv7 dw", "wkv7 dk", "wkv7 dv", "wkv7 da", "wkv7 db"};
    for (int threads = 1; threads <= 2; threads++) {
        rx_set_num_threads(threads);
        if (rx_wkv7_forward_seq(r, w, k, v, a, b, s0, y, sf, B, T, H, N) != RX_OK) fail("wkv7 fwd rc");
        check("wkv7 y", y, y_ref, n, FWD_TOL);
        check("wkv7 s_final", sf, sf_ref, ns, FWD_TOL);
        /* y only, no final state */
        if (rx_wkv7_forward_seq(r, w, k, v, a, b, s0, y, NULL, B, T, H, N) != RX_OK) fail("wkv7 fwd rc");
        check("wkv7 y (no s_final)", y, y_ref, n, FWD_TOL);
        if (rx_wkv7_backward(r, w, k, v, a, b, dy, s0, g[0], g[1], g[2], g[3], g[4], g[5], dS0,
                             B, T, H, N) != RX_OK)
            fail("wkv7 bwd rc");
        for (int i = 0; i < 6; i++) check(names[i], g[i], g_ref[i], n, GRAD_TOL);
        check("wkv7 dS0", dS0, dS0_ref, ns, GRAD_TOL);
    }
    rx_set_num_threads(0);

    /* invalid arguments */
    if (rx_wkv7_forward_seq(NULL, w, k, v, a, b, s0, y, sf, B, T, H, N) != RX_EINVAL) fail("wkv7 NULL r");
    if (rx_wkv7_forward_seq(r, w, k, v, a, b, s0, y, sf, B, 0, H, N) != RX_EINVAL) fail("wkv7 T=0");
    if (rx_wkv7_forward_seq(r, w, k, v, a, b, s0, y, sf, B, T, H, -1) != RX_EINVAL) fail("wkv7 N<0");
    if (rx_wkv7_backward(r, w, k, v, a, b, NULL, s0, g[0], g[1], g[2], g[3], g[4], g[5], dS0,
                         B, T, H, N) != RX_EINVAL)
        fail("wkv7 bwd NULL dy");
    if (rx_wkv7_backward(r, w, k, v, a, b, dy, s0, g[0], g[1], g[2], g[3], g[4], NULL, dS0,
                         B, T, H, N) != RX_EINVAL)
        fail("wkv7 bwd NULL db");
    if (rx_wkv7_backward(r, w, k, v, a, b, dy, s0, g[0], g[1], g[2], g[3], g[4], g[5], dS0,
                         0, T, H, N) != RX_EINVAL)
        fail("wkv7 bwd B=0");

    free(r); free(w); free(k); free(v); free(a); free(b); free(dy); free(s0);
    free(Ss); free(y_ref); free(dS0_ref); free(sf_ref); free(y); free(sf); free(dS0);
    for (int i = 0; i < 6; i++) {
        free(g_ref[i]);
        free(g[i]);
    }
}

/* ------------------------------------------------------------- LayerNorm */

static void test_layernorm(int B, int T, int C, double offset) {
    size_t rows = (size_t)B * T, n = rows * C;
    float *x = frand(n, offset - 1.0, offset + 1.0), *w = frand((size_t)C, 0.8, 1.2);
    float *bb = frand((size_t)C, -0.2, 0.2), *dy = frand(n, -1, 1);
    double *out_ref = dbuf(n), *dx_ref = dbuf(n), *dw_ref = dbuf((size_t)C), *db_ref = dbuf((size_t)C);
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + r * C, *g = dy + r * C;
        double mu = 0.0, var = 0.0, sg = 0.0, sgx = 0.0;
        for (int c = 0; c < C; c++) mu += xr[c];
        mu /= C;
        for (int c = 0; c < C; c++) var += (xr[c] - mu) * (xr[c] - mu);
        double rs = 1.0 / sqrt(var / C + RX_DEFAULT_LN_EPS);
        for (int c = 0; c < C; c++) {
            double xh = (xr[c] - mu) * rs;
            out_ref[r * C + c] = xh * w[c] + bb[c];
            dw_ref[c] += g[c] * xh;
            db_ref[c] += g[c];
            sg += (double)g[c] * w[c];
            sgx += (double)g[c] * w[c] * xh;
        }
        for (int c = 0; c < C; c++) {
            double xh = (xr[c] - mu) * rs;
            dx_ref[r * C + c] = rs * ((double)g[c] * w[c] - sg / C - xh * sgx / C);
        }
    }
    float *out = fbuf(n), *dx = fbuf(n), *dw = fbuf((size_t)C), *db = fbuf((size_t)C);
    for (int threads = 1; threads <= 2; threads++) {
        rx_set_num_threads(threads);
        if (rx_layernorm_forward_seq(x, w, bb, out, B, T, C) != RX_OK) fail("layernorm fwd rc");
        check("layernorm out", out, out_ref, n, FWD_TOL);
        if (rx_layernorm_backward(x, w, bb, dy, dx, dw, db, B, T, C) != RX_OK) fail("layernorm bwd rc");
        check("layernorm dx", dx, dx_ref, n, GRAD_TOL);
        check("layernorm dw", dw, dw_ref, (size_t)C, GRAD_TOL);
        check("layernorm db", db, db_ref, (size_t)C, GRAD_TOL);
    }
    rx_set_num_threads(0);
    if (rx_layernorm_forward_seq(x, w, NULL, out, B, T, C) != RX_EINVAL) fail("layernorm NULL b");
    if (rx_layernorm_forward_seq(x, w, bb, out, B, T, 0) != RX_EINVAL) fail("layernorm C=0");
    if (rx_layernorm_backward(x, w, bb, dy, dx, NULL, db, B, T, C) != RX_EINVAL) fail("layernorm NULL dw");
    if (rx_layernorm_backward(x, w, bb, dy, dx, dw, db, 0, T, C) != RX_EINVAL) fail("layernorm B=0");
    free(x); free(w); free(bb); free(dy); free(out_ref); free(dx_ref); free(dw_ref); free(db_ref);
    free(out); free(dx); free(dw); free(db);
}

/* ------------------------------------------------------------- embedding */

static void test_embedding(int T, int C, int V) {
    size_t n = (size_t)T * C;
    float *emb = frand((size_t)V * C, -1, 1), *d_out = frand(n, -1, 1);
    float *out = fbuf(n), *d_emb = fbuf((size_t)V * C);
    int *tok = malloc((size_t)T * sizeof(int));
    for (int t = 0; t < T; t++) tok[t] = (int)(urand() * V);
    tok[T - 1] = tok[0]; /* a repeat */
    if (rx_embedding_gather(emb, tok, T, C, V, out) != RX_OK) fail("embedding gather rc");
    for (int t = 0; t < T; t++)
        if (memcmp(out + (size_t)t * C, emb + (size_t)tok[t] * C, (size_t)C * sizeof(float)))
            fail("embedding gather");
    double *ref = dbuf((size_t)V * C);
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++) ref[(size_t)tok[t] * C + c] += d_out[(size_t)t * C + c];
    for (int threads = 1; threads <= 2; threads++) {
        rx_set_num_threads(threads);
        for (size_t i = 0; i < (size_t)V * C; i++) d_emb[i] = 7.0f; /* must be zeroed */
        if (rx_embedding_scatter(tok, T, C, V, d_out, d_emb) != RX_OK)
            fail("embedding scatter rc");
        check("embedding d_emb", d_emb, ref, (size_t)V * C, GRAD_TOL);
    }
    rx_set_num_threads(0);
    /* a token outside [0, vocab), a NULL buffer or a size below 1: refused */
    const int keep = tok[0];
    for (int bad = -1; bad <= V; bad += V + 1) {
        tok[0] = bad;
        if (rx_embedding_gather(emb, tok, T, C, V, out) != RX_EINVAL) fail("gather token outside");
        if (rx_embedding_scatter(tok, T, C, V, d_out, d_emb) != RX_EINVAL)
            fail("scatter token outside");
    }
    tok[0] = keep;
    if (rx_embedding_gather(NULL, tok, T, C, V, out) != RX_EINVAL) fail("gather NULL emb");
    if (rx_embedding_scatter(tok, T, C, V, NULL, d_emb) != RX_EINVAL) fail("scatter NULL d_out");
    if (rx_embedding_gather(emb, tok, 0, C, V, out) != RX_EINVAL) fail("gather T=0");
    if (rx_embedding_scatter(tok, T, 0, V, d_out, d_emb) != RX_EINVAL) fail("scatter C=0");
    free(emb); free(d_out); free(out); free(d_emb); free(tok); free(ref);
}

/* ------------------------------------------------------------------ head */

static void test_head(int T, int C, int V) {
    size_t nx = (size_t)T * C, nh = (size_t)C * V, nl = (size_t)T * V;
    float *x = frand(nx, -1, 1), *hw = frand(nh, -0.3, 0.3), *g = frand(nl, -1, 1);
    double *l_ref = dbuf(nl), *dx_ref = dbuf(nx), *dh_ref = dbuf(nh);
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++)
            for (int v = 0; v < V; v++) {
                size_t ix = (size_t)t * C + c, ih = (size_t)c * V + v, il = (size_t)t * V + v;
                l_ref[il] += (double)x[ix] * hw[ih];
                dx_ref[ix] += (double)g[il] * hw[ih];
                dh_ref[ih] += (double)x[ix] * g[il];
            }
    float *l = fbuf(nl), *dx = fbuf(nx), *dh = fbuf(nh);
    for (int threads = 1; threads <= 2; threads++) {
        rx_set_num_threads(threads);
        if (rx_head_logits(x, hw, T, C, V, l) != RX_OK) fail("head logits rc");
        check("head logits", l, l_ref, nl, FWD_TOL);
        if (rx_head_grads(x, hw, g, T, C, V, dx, dh) != RX_OK) fail("head grads rc");
        check("head dx", dx, dx_ref, nx, GRAD_TOL);
        check("head d_head", dh, dh_ref, nh, GRAD_TOL);
    }
    rx_set_num_threads(0);
    if (rx_head_logits(x, NULL, T, C, V, l) != RX_EINVAL) fail("head NULL head");
    if (rx_head_grads(x, hw, NULL, T, C, V, dx, dh) != RX_EINVAL) fail("head NULL dlogits");
    if (rx_head_logits(x, hw, T, 0, V, l) != RX_EINVAL) fail("head C=0");
    free(x); free(hw); free(g); free(l_ref); free(dx_ref); free(dh_ref); free(l); free(dx); free(dh);
}

/* --------------------------------------------------------- cross-entropy */

static double ce_ref(const float *l, const int *tg, int T, int V, int ii, double *d) {
    int nv = 0;
    for (int t = 0; t < T; t++) nv += ii < 0 || tg[t] != ii;
    double loss = 0.0;
    for (int t = 0; t < T; t++) {
        const float *lr = l + (size_t)t * V;
        double m = lr[0], s = 0.0;
        for (int v = 1; v < V; v++) m = lr[v] > m ? lr[v] : m;
        for (int v = 0; v < V; v++) s += exp(lr[v] - m);
        double lse = m + log(s);
        int valid = ii < 0 || tg[t] != ii;
        if (valid) loss += lse - lr[tg[t]];
        for (int v = 0; v < V; v++)
            d[(size_t)t * V + v] = valid ? (exp(lr[v] - lse) - (v == tg[t])) / nv : 0.0;
    }
    return nv ? loss / nv : 0.0;
}

static void check_loss(const char *what, double got, double ref) {
    if (!isfinite(got) || fabs(got - ref) > FWD_TOL * fabs(ref)) {
        printf("FAIL %s: %.9g vs %.9g\n", what, got, ref);
        failures++;
    }
}

/* rx_cross_entropy's loss (dlogits NULL: the loss alone); NaN when it
 * fails, which check_loss reports */
static double ce(const float *l, const int *tg, int T, int V, int ii, float *d) {
    double loss;
    return rx_cross_entropy(l, tg, T, V, ii, d, &loss) == RX_OK ? loss : NAN;
}

static void test_cross_entropy(int T, int V, double spread) {
    size_t n = (size_t)T * V;
    float *l = frand(n, -spread, spread), *d = fbuf(n);
    int *tg = malloc((size_t)T * sizeof(int));
    for (int t = 0; t < T; t++) tg[t] = (int)(urand() * V);
    double *d_ref = dbuf(n);
    for (int threads = 1; threads <= 2; threads++) {
        rx_set_num_threads(threads);
        for (int pass = 0; pass < 2; pass++) {
            int ii = pass == 0 ? -1 : tg[0];        /* no ignoring, then ignore tg[0]'s class */
            double ref = ce_ref(l, tg, T, V, ii, d_ref);
            check_loss("ce loss", ce(l, tg, T, V, ii, NULL), ref);
            check_loss("ce loss with dlogits", ce(l, tg, T, V, ii, d), ref);
            check("ce dlogits", d, d_ref, n, GRAD_TOL);
        }
    }
    rx_set_num_threads(0);
    /* every position ignored: loss 0, zero grads */
    int *same = malloc((size_t)T * sizeof(int));
    for (int t = 0; t < T; t++) same[t] = 0;
    if (ce(l, same, T, V, 0, NULL) != 0.0) fail("ce all ignored loss");
    for (size_t i = 0; i < n; i++) d[i] = 1.0f;
    if (ce(l, same, T, V, 0, d) != 0.0 || !all_zero(d, n)) fail("ce all ignored grads");
    /* an ignored target may lie outside the vocab */
    same[0] = V + 3;
    same[T - 1] = V + 3;
    if (!isfinite(ce(l, same, T, V, V + 3, NULL))) fail("ce ignored out-of-range");
    /* a valid target outside [0, vocab), a NULL input or a size below 1: refused */
    double loss;
    if (rx_cross_entropy(l, same, T, V, -1, NULL, &loss) != RX_EINVAL) fail("ce target = vocab+3");
    same[0] = -1;
    if (rx_cross_entropy(l, same, T, V, -1, d, &loss) != RX_EINVAL) fail("ce negative target");
    same[0] = V;
    if (rx_cross_entropy(l, same, T, V, V + 1, NULL, &loss) != RX_EINVAL) fail("ce target = vocab");
    if (rx_cross_entropy(NULL, tg, T, V, -1, d, &loss) != RX_EINVAL) fail("ce NULL logits");
    if (rx_cross_entropy(l, NULL, T, V, -1, d, &loss) != RX_EINVAL) fail("ce NULL targets");
    if (rx_cross_entropy(l, tg, T, V, -1, d, NULL) != RX_EINVAL) fail("ce NULL loss");
    if (rx_cross_entropy(l, tg, 0, V, -1, d, &loss) != RX_EINVAL) fail("ce T=0");
    if (rx_cross_entropy(l, tg, T, 0, -1, d, &loss) != RX_EINVAL) fail("ce vocab=0");
    free(l); free(d); free(tg); free(d_ref); free(same);
}

/* rx_cross_entropy_rows and rx_head_loss_rows: each row's loss and the
 * grads of sum_t w[t] * loss[t] (docs/maths.md §Preference tuning) against
 * the double reference; the chunked head's rows equal the unchunked ones */
static void test_cross_entropy_rows(int T, int C, int V, int ii) {
    size_t n = (size_t)T * V;
    float *x = frand((size_t)T * C, -1.0, 1.0), *h = frand((size_t)C * V, -1.0, 1.0);
    float *l = fbuf(n), *d = fbuf(n), *scratch = fbuf(2 * n);
    float *dx = fbuf((size_t)T * C), *dh = fbuf((size_t)C * V);
    float *dx_ref = fbuf((size_t)T * C), *dh_ref = fbuf((size_t)C * V);
    int *tg = malloc((size_t)T * sizeof(int));
    double *w = dbuf(T), *rl = dbuf(T), *rl2 = dbuf(T), *d_ref = dbuf(n), *one = dbuf(n);
    for (int t = 0; t < T; t++) {
        tg[t] = (int)(urand() * V);
        w[t] = urand() * 4.0 - 2.0;
    }
    if (ii >= 0) tg[T / 2] = ii;
    if (rx_head_logits(x, h, T, C, V, l) != RX_OK) fail("rows logits");
    for (int threads = 1; threads <= 2; threads++) {
        rx_set_num_threads(threads);
        if (rx_cross_entropy_rows(l, tg, T, V, ii, w, d, rl) != RX_OK) fail("ce rows");
        for (int t = 0; t < T; t++) {
            /* one row alone through the mean form's reference: its loss and
             * (softmax - onehot), then scaled by w[t] */
            double lt = ce_ref(l + (size_t)t * V, tg + t, 1, V, ii, one);
            for (int v = 0; v < V; v++) d_ref[(size_t)t * V + v] = w[t] * one[v];
            check_loss("ce row loss", rl[t] + 1.0, lt + 1.0);   /* 0 when ignored */
        }
        check("ce rows dlogits", d, d_ref, n, GRAD_TOL);
        /* the chunked head, 3 rows a chunk: the same rows, the same grads */
        if (rx_head_grads(x, h, d, T, C, V, dx_ref, dh_ref) != RX_OK) fail("rows head grads");
        if (rx_head_loss_rows(x, h, tg, T, C, V, ii, 0.0, w, 3, scratch, dx, dh, rl2) != RX_OK)
            fail("head loss rows");
        for (int t = 0; t < T; t++)
            if (rl2[t] != rl[t]) fail("head loss rows: a row's loss differs from the unchunked");
        double *r1 = dbuf((size_t)T * C), *r2 = dbuf((size_t)C * V);
        for (size_t i = 0; i < (size_t)T * C; i++) r1[i] = dx_ref[i];
        for (size_t i = 0; i < (size_t)C * V; i++) r2[i] = dh_ref[i];
        check("head loss rows dx", dx, r1, (size_t)T * C, GRAD_TOL);
        check("head loss rows d_head", dh, r2, (size_t)C * V, GRAD_TOL);
        free(r1); free(r2);
        /* the losses alone: no weights needed, the same rows */
        if (rx_cross_entropy_rows(l, tg, T, V, ii, NULL, NULL, rl2) != RX_OK) fail("ce rows alone");
        for (int t = 0; t < T; t++)
            if (rl2[t] != rl[t]) fail("ce rows alone: a row's loss differs");
    }
    rx_set_num_threads(0);
    if (rx_cross_entropy_rows(l, tg, T, V, ii, w, d, NULL) != RX_EINVAL) fail("ce rows NULL out");
    if (rx_cross_entropy_rows(l, tg, T, V, ii, NULL, d, rl) != RX_EINVAL) fail("ce rows no w");
    if (rx_head_loss_rows(x, h, tg, T, C, V, ii, 0.0, NULL, 3, scratch, dx, dh, rl) != RX_EINVAL)
        fail("head loss rows no w");
    if (rx_cross_entropy_rows(l, tg, T, V, ii, w, d, (double *)(void *)l) != RX_EINVAL)
        fail("ce rows: row_loss over the logits");
    free(x); free(h); free(l); free(d); free(scratch); free(dx); free(dh); free(dx_ref);
    free(dh_ref); free(tg); free(w); free(rl); free(rl2); free(d_ref); free(one);
}

static void test_cross_entropy_extreme(void) {
    enum { T = 4, V = 6 };
    float l[T * V], d[T * V];
    int tg[T] = {0, 5, 2, 3};
    for (int i = 0; i < T * V; i++) l[i] = (i * 7) % 3 == 0 ? 1e4f : ((i % 2) ? -1e4f : 0.0f);
    double d_ref[T * V], ref = ce_ref(l, tg, T, V, -1, d_ref);
    check_loss("ce +-1e4 loss", ce(l, tg, T, V, -1, NULL), ref);
    check_loss("ce +-1e4 loss with dlogits", ce(l, tg, T, V, -1, d), ref);
    check("ce +-1e4 dlogits", d, d_ref, T * V, GRAD_TOL);
}

/* ------------------------------------------------------------ channel-mix */

static void test_channelmix(int B, int T, int C, int F, int with_carry) {
    size_t n = (size_t)B * T * C;
    float *x = frand(n, -1, 1), *mix = frand((size_t)C, 0, 1), *wk = frand((size_t)C * F, -0.5, 0.5);
    float *wv = frand((size_t)F * C, -0.5, 0.5), *dy = frand(n, -1, 1);
    float *init = with_carry ? frand((size_t)B * C, -1, 1) : NULL;
    double *xk = dbuf(n), *pre = dbuf((size_t)B * T * F), *out_ref = dbuf(n);
    double *dxk = dbuf(n), *dx_ref = dbuf(n), *dmix_ref = dbuf((size_t)C), *dwk_ref = dbuf((size_t)C * F);
    double *dwv_ref = dbuf((size_t)F * C), *dinit_ref = dbuf((size_t)B * C);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            size_t bt = (size_t)b * T + t;
            for (int c = 0; c < C; c++) {
                double xp = t > 0 ? x[(bt - 1) * C + c] : (init ? init[(size_t)b * C + c] : 0.0);
                xk[bt * C + c] = x[bt * C + c] + (xp - x[bt * C + c]) * mix[c];
            }
            for (int f = 0; f < F; f++) {
                double s = 0.0;
                for (int c = 0; c < C; c++) s += xk[bt * C + c] * wk[(size_t)c * F + f];
                pre[bt * F + f] = s;
            }
            for (int c = 0; c < C; c++) {
                double s = 0.0;
                for (int f = 0; f < F; f++) {
                    double h = pre[bt * F + f] > 0 ? pre[bt * F + f] : 0.0;
                    s += h * h * wv[(size_t)f * C + c];
                }
                out_ref[bt * C + c] = s;
            }
            /* backward of this token's FFN */
            for (int f = 0; f < F; f++) {
                double p = pre[bt * F + f], h = p > 0 ? p * p : 0.0, dh = 0.0;
                for (int c = 0; c < C; c++) {
                    dwv_ref[(size_t)f * C + c] += h * dy[bt * C + c];
                    dh += (double)dy[bt * C + c] * wv[(size_t)f * C + c];
                }
                double dp = p > 0 ? 2.0 * p * dh : 0.0;
                for (int c = 0; c < C; c++) {
                    dwk_ref[(size_t)c * F + f] += xk[bt * C + c] * dp;
                    dxk[bt * C + c] += dp * wk[(size_t)c * F + f];
                }
            }
        }
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            size_t bt = (size_t)b * T + t;
            for (int c = 0; c < C; c++) {
                double xp = t > 0 ? x[(bt - 1) * C + c] : (init ? init[(size_t)b * C + c] : 0.0);
                double g = dxk[bt * C + c];
                dmix_ref[c] += g * (xp - x[bt * C + c]);
                dx_ref[bt * C + c] += g * (1.0 - mix[c]);
                if (t > 0) dx_ref[(bt - 1) * C + c] += g * mix[c];
                else dinit_ref[(size_t)b * C + c] = g * mix[c];
            }
        }
    rx_cm_params P = {C, F, mix, wk, wv};
    float *out = fbuf(n), *dx = fbuf(n), *dmix = fbuf((size_t)C), *dwk = fbuf((size_t)C * F);
    float *dwv = fbuf((size_t)F * C), *dinit = fbuf((size_t)B * C);
    rx_cm_grads G = {dmix, dwk, dwv};
    for (int threads = 1; threads <= 2; threads++) {
        rx_set_num_threads(threads);
        if (rx_channelmix_forward_seq(&P, x, init, out, B, T) != RX_OK) fail("channelmix fwd rc");
        check("channelmix out", out, out_ref, n, FWD_TOL);
        if (rx_channelmix_backward(&P, x, init, dy, &G, dx, dinit, B, T) != RX_OK)
            fail("channelmix bwd rc");
        check("channelmix dx", dx, dx_ref, n, GRAD_TOL);
        check("channelmix d_ffn_x_k", dmix, dmix_ref, (size_t)C, GRAD_TOL);
        check("channelmix d_ffn_key_w", dwk, dwk_ref, (size_t)C * F, GRAD_TOL);
        check("channelmix d_ffn_value_w", dwv, dwv_ref, (size_t)F * C, GRAD_TOL);
        check("channelmix d_xprev_init", dinit, dinit_ref, (size_t)B * C, GRAD_TOL);
    }
    rx_set_num_threads(0);
    if (rx_channelmix_forward_seq(NULL, x, init, out, B, T) != RX_EINVAL) fail("channelmix NULL P");
    if (rx_channelmix_forward_seq(&P, x, init, out, B, 0) != RX_EINVAL) fail("channelmix T=0");
    if (rx_channelmix_backward(&P, x, init, dy, &G, NULL, dinit, B, T) != RX_EINVAL)
        fail("channelmix NULL dx");
    rx_cm_params Q = P;
    Q.ffn_dim = 0;
    if (rx_channelmix_forward_seq(&Q, x, init, out, B, T) != RX_EINVAL) fail("channelmix F=0");
    free(x); free(mix); free(wk); free(wv); free(dy); free(init); free(xk); free(pre);
    free(out_ref); free(dxk); free(dx_ref); free(dmix_ref); free(dwk_ref); free(dwv_ref);
    free(dinit_ref); free(out); free(dx); free(dmix); free(dwk); free(dwv); free(dinit);
}

int main(void) {
    test_wkv7(1, 1, 1, 1, 0);
    test_wkv7(2, 21, 2, 5, 1);    /* crosses the 16-step checkpoint chunks */
    test_wkv7(1, 17, 3, 16, 0);
    test_layernorm(1, 1, 3, 0.0);
    test_layernorm(2, 5, 37, 0.0);
    test_layernorm(2, 70, 256, 0.0);   /* large enough for the threaded path */
    test_layernorm(1, 8, 64, 1000.0);  /* a large common offset */
    test_embedding(1, 1, 1);
    test_embedding(9, 7, 5);
    test_embedding(64, 256, 300);      /* threaded scatter */
    test_head(1, 1, 1);
    test_head(7, 13, 17);
    test_head(40, 64, 130);
    test_cross_entropy(1, 1, 3.0);
    test_cross_entropy(9, 11, 3.0);
    test_cross_entropy(70, 600, 5.0);  /* threaded rows */
    test_cross_entropy_extreme();
    test_cross_entropy_rows(1, 1, 2, -1);   /* V = 1 has no grad to compare against: all zero */
    test_cross_entropy_rows(7, 5, 11, 3);
    test_cross_entropy_rows(70, 9, 600, -1);   /* threaded rows */
    test_channelmix(1, 1, 1, 1, 0);
    test_channelmix(2, 6, 7, 10, 1);
    test_channelmix(1, 9, 16, 24, 0);
    if (failures) {
        printf("%d check(s) failed\n", failures);
        return 1;
    }
    printf("test_kernels: all checks passed (OpenMP %s)\n", rx_has_openmp() ? "on" : "off");
    return 0;
}
