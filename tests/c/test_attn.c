/* test_attn.c -- MoBA attention kernels against plain double loops.
 *
 *   gcc -fsanitize=address,undefined -g -O1 -fopenmp -Icsrc tests/c/test_attn.c csrc/[a-z]*.c -lm
 *
 * The score/AV hooks are checked against a dense double-precision masked
 * softmax (selection by a straightforward arg-max scan, a different
 * algorithm from the kernel's); the block forward against a double
 * evaluation of the whole block; the block backward by a central finite
 * difference of that double forward along one random direction over x,
 * the carry and every parameter. Exit status 0 when everything passes.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rx_pretrain.h"
#include "check.h"

static unsigned long long rng_state = 0x1234567ULL;
static double urand(void) { /* splitmix64 -> [-1, 1) */
    unsigned long long z = (rng_state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (double)(z >> 11) * 0x1.0p-53 * 2.0 - 1.0;
}
static float *frand(size_t n, double scale, double offset) {
    float *p = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = (float)(offset + scale * urand());
    return p;
}
static double *dalloc(size_t n) { return calloc(n, sizeof(double)); }

/* max|a - b| / max|b| (b the double reference; scale 1 when b is all zero) */
static double rel_err(const float *a, const double *b, size_t n) {
    double e = 0.0, m = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > e || d != d) e = d;
        if (fabs(b[i]) > m) m = fabs(b[i]);
    }
    return e / (m > 0.0 ? m : 1.0);
}

/* ---- double reference of the attention core -------------------------------- */

/* mask [B][H][T][T]: 1 where query t attends key s (docs/maths.md §Blocks) */
static void ref_mask(const double *q, const double *k, int B, int T, int H, int N, int cs,
                     int top_k, char *mask) {
    int C = H * N;
    double *g = dalloc((size_t)T);
    char *taken = calloc((size_t)T, 1);
    memset(mask, 0, (size_t)B * H * T * T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                char *row = mask + (((size_t)b * H + h) * T + t) * T;
                int ct = t / cs;
                for (int s = ct * cs; s <= t; s++) row[s] = 1;
                for (int j = 0; j < ct; j++) {
                    g[j] = 0.0;
                    for (int n = 0; n < N; n++) {
                        double m = 0.0;
                        for (int s = j * cs; s < (j + 1) * cs; s++)
                            m += k[((size_t)b * T + s) * C + h * N + n];
                        g[j] += q[((size_t)b * T + t) * C + h * N + n] * (m / cs);
                    }
                    taken[j] = 0;
                }
                int keep = top_k <= 0 || top_k >= ct ? ct : top_k;
                for (int r = 0; r < keep; r++) {
                    int best = -1;
                    for (int j = 0; j < ct; j++)
                        if (!taken[j] && (best < 0 || g[j] > g[best])) best = j;
                    taken[best] = 1;
                    for (int s = best * cs; s < (best + 1) * cs; s++) row[s] = 1;
                }
            }
    free(g);
    free(taken);
}

/* p [B][H][T][T], y [B][T][C] from q, k, v and the mask */
static void ref_core_forward(const double *q, const double *k, const double *v,
                             const char *mask, int B, int T, int H, int N, double *p,
                             double *y) {
    int C = H * N;
    double scale = 1.0 / sqrt((double)N);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                size_t row = (((size_t)b * H + h) * T + t) * T;
                double m = -INFINITY, sum = 0.0;
                for (int s = 0; s < T; s++) {
                    p[row + s] = 0.0;
                    if (!mask[row + s]) continue;
                    double a = 0.0;
                    for (int n = 0; n < N; n++)
                        a += q[((size_t)b * T + t) * C + h * N + n] *
                             k[((size_t)b * T + s) * C + h * N + n];
                    p[row + s] = a * scale;
                    if (a * scale > m) m = a * scale;
                }
                for (int s = 0; s < T; s++)
                    if (mask[row + s]) sum += (p[row + s] = exp(p[row + s] - m));
                for (int s = 0; s < T; s++) p[row + s] /= sum;
                for (int n = 0; n < N; n++) {
                    double acc = 0.0;
                    for (int s = 0; s < T; s++)
                        acc += p[row + s] * v[((size_t)b * T + s) * C + h * N + n];
                    y[((size_t)b * T + t) * C + h * N + n] = acc;
                }
            }
}

static void ref_core_backward(const double *q, const double *k, const double *v,
                              const double *p, const double *dy, int B, int T, int H, int N,
                              double *dq, double *dk, double *dv) {
    int C = H * N;
    double scale = 1.0 / sqrt((double)N);
    size_t BTC = (size_t)B * T * C;
    memset(dq, 0, BTC * sizeof(double));
    memset(dk, 0, BTC * sizeof(double));
    memset(dv, 0, BTC * sizeof(double));
    double *dp = dalloc((size_t)T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                size_t row = (((size_t)b * H + h) * T + t) * T;
                const double *dyt = dy + ((size_t)b * T + t) * C + h * N;
                double D = 0.0;
                for (int s = 0; s < T; s++) {
                    dp[s] = 0.0;
                    for (int n = 0; n < N; n++) dp[s] += dyt[n] * v[((size_t)b * T + s) * C + h * N + n];
                    D += p[row + s] * dp[s];
                }
                for (int s = 0; s < T; s++) {
                    double ds = p[row + s] * (dp[s] - D) * scale;
                    for (int n = 0; n < N; n++) {
                        size_t ot = ((size_t)b * T + t) * C + h * N + n;
                        size_t os = ((size_t)b * T + s) * C + h * N + n;
                        dq[ot] += ds * k[os];
                        dk[os] += ds * q[ot];
                        dv[os] += p[row + s] * dy[ot];
                    }
                }
            }
    free(dp);
}

static double *to_d(const float *a, size_t n) {
    double *d = dalloc(n);
    for (size_t i = 0; i < n; i++) d[i] = a[i];
    return d;
}

/* tied: positive queries, chunks 0 and 1 identical (their gates tie
 * exactly) and chunk 2 ahead of both, so the tie rule decides selections */
static void test_core(int B, int T, int H, int N, int cs, int top_k, int tied) {
    int C = H * N;
    size_t BTC = (size_t)B * T * C, P = (size_t)B * H * T * T;
    float *q = frand(BTC, 1.0, 0.0), *k = frand(BTC, 1.0, 0.0), *v = frand(BTC, 1.0, 0.0);
    for (size_t i = 0; tied && i < BTC; i++) {
        size_t t = i / C % T;
        q[i] = fabsf(q[i]) + 1.0f;
        k[i] = t < (size_t)cs ? 2.0f + 0.1f * k[i] : t < 2 * (size_t)cs ? k[i - (size_t)cs * C]
               : t < 3 * (size_t)cs ? 3.0f + 0.1f * k[i] : 0.1f * k[i];
    }
    float *dy = frand(BTC, 1.0, 0.0);
    float *p = malloc(P * sizeof(float)), *y = malloc(BTC * sizeof(float));
    float *dq = malloc(BTC * sizeof(float)), *dk = malloc(BTC * sizeof(float));
    float *dv = malloc(BTC * sizeof(float));
    rx_attn_params ap = {0};
    ap.c = C, ap.n_head = H, ap.head_size = N, ap.chunk_size = cs, ap.moba_top_k = top_k;
    CHECK(rx_attn_score_av_forward(&ap, q, k, v, B, T, p, y) == RX_OK, "forward rc");
    CHECK(rx_attn_score_av_backward(&ap, q, k, v, dy, B, T, dq, dk, dv) == RX_OK, "backward rc");

    double *qd = to_d(q, BTC), *kd = to_d(k, BTC), *vd = to_d(v, BTC), *dyd = to_d(dy, BTC);
    char *mask = malloc(P);
    double *pr = dalloc(P), *yr = dalloc(BTC), *dqr = dalloc(BTC), *dkr = dalloc(BTC),
           *dvr = dalloc(BTC);
    ref_mask(qd, kd, B, T, H, N, cs, top_k, mask);
    ref_core_forward(qd, kd, vd, mask, B, T, H, N, pr, yr);
    ref_core_backward(qd, kd, vd, pr, dyd, B, T, H, N, dqr, dkr, dvr);
    size_t bad = 0, dropped = 0;
    for (size_t i = 0; i < P; i++) {
        bad += (p[i] > 0.0f) != (mask[i] != 0) || (!mask[i] && p[i] != 0.0f);
        dropped += !mask[i] && (i % T) <= (i / T) % T;
    }
    double rowsum = 0.0;
    for (size_t r = 0; r < P / T; r++) {
        double s = 0.0;
        for (int t = 0; t < T; t++) s += p[r * T + t];
        if (fabs(s - 1.0) > rowsum) rowsum = fabs(s - 1.0);
    }
    double ep = rel_err(p, pr, P), ey = rel_err(y, yr, BTC), eq = rel_err(dq, dqr, BTC),
           ek = rel_err(dk, dkr, BTC), ev = rel_err(dv, dvr, BTC);
    printf("core%s B=%d T=%d H=%d N=%d cs=%d top_k=%d: dropped %zu, p %.1e y %.1e dq %.1e dk %.1e "
           "dv %.1e rowsum %.1e\n", tied ? " (tied gates)" : "", B, T, H, N, cs, top_k, dropped, ep, ey, eq, ek, ev, rowsum);
    CHECK(bad == 0, "selection pattern differs in %zu entries", bad);
    /* p = exp(score - lse) with lse in float: each weight carries a relative
     * error of about |lse| * 2^-24, so rows with scores near 10 sum to 1
     * within a few 1e-6 */
    CHECK(rowsum < 1e-5, "row sums %.1e", rowsum);
    CHECK(ep <= 1e-5 && ey <= 1e-5, "forward error");
    CHECK(eq <= 1e-4 && ek <= 1e-4 && ev <= 1e-4, "backward error");
    free(q), free(k), free(v), free(dy), free(p), free(y), free(dq), free(dk), free(dv);
    free(qd), free(kd), free(vd), free(dyd), free(mask), free(pr), free(yr), free(dqr),
        free(dkr), free(dvr);
}

/* ---- double reference of the block ------------------------------------------ */

enum { LN1W, LN1B, WR, WK, WV, WO, LN2W, LN2B, FXK, FKW, FVW, NPAR };

typedef struct {
    int B, T, H, N, C, F, cs, top_k;
} geom;

static size_t par_size(const geom *g, int i) {
    size_t C = (size_t)g->C, F = (size_t)g->F;
    switch (i) {
    case WR: case WK: case WV: case WO: return C * C;
    case FKW: case FVW: return C * F;
    default: return C;
    }
}

static void ref_ln(const double *x, const double *w, const double *b, double *o, size_t rows,
                   size_t C) {
    for (size_t r = 0; r < rows; r++) {
        double mu = 0.0, var = 0.0;
        for (size_t c = 0; c < C; c++) mu += x[r * C + c];
        mu /= C;
        for (size_t c = 0; c < C; c++) var += (x[r * C + c] - mu) * (x[r * C + c] - mu);
        double rs = 1.0 / sqrt(var / C + RX_DEFAULT_LN_EPS);
        for (size_t c = 0; c < C; c++) o[r * C + c] = (x[r * C + c] - mu) * rs * w[c] + b[c];
    }
}

static void ref_mm(const double *a, const double *w, double *o, size_t rows, size_t K,
                   size_t M) {
    for (size_t r = 0; r < rows; r++)
        for (size_t m = 0; m < M; m++) {
            double s = 0.0;
            for (size_t i = 0; i < K; i++) s += a[r * K + i] * w[i * M + m];
            o[r * M + m] = s;
        }
}

/* out [B][T][C] of the whole block in double */
static void ref_block(const geom *g, double *const *par, const double *x, const double *cmx,
                      double *out) {
    size_t BT = (size_t)g->B * g->T, C = (size_t)g->C, F = (size_t)g->F;
    double *h1 = dalloc(BT * C), *q = dalloc(BT * C), *k = dalloc(BT * C), *v = dalloc(BT * C);
    double *y = dalloc(BT * C), *x1 = dalloc(BT * C), *h2 = dalloc(BT * C), *xk = dalloc(BT * C);
    double *hid = dalloc(BT * F), *p = dalloc((size_t)g->B * g->H * g->T * g->T);
    char *mask = malloc((size_t)g->B * g->H * g->T * g->T);
    ref_ln(x, par[LN1W], par[LN1B], h1, BT, C);
    ref_mm(h1, par[WR], q, BT, C, C);
    ref_mm(h1, par[WK], k, BT, C, C);
    ref_mm(h1, par[WV], v, BT, C, C);
    ref_mask(q, k, g->B, g->T, g->H, g->N, g->cs, g->top_k, mask);
    ref_core_forward(q, k, v, mask, g->B, g->T, g->H, g->N, p, y);
    ref_mm(y, par[WO], x1, BT, C, C);
    for (size_t i = 0; i < BT * C; i++) x1[i] += x[i];
    ref_ln(x1, par[LN2W], par[LN2B], h2, BT, C);
    for (size_t bt = 0; bt < BT; bt++)
        for (size_t c = 0; c < C; c++) {
            size_t t = bt % g->T;
            double prev = t ? h2[(bt - 1) * C + c] : (cmx ? cmx[(bt / g->T) * C + c] : 0.0);
            xk[bt * C + c] = h2[bt * C + c] + (prev - h2[bt * C + c]) * par[FXK][c];
        }
    ref_mm(xk, par[FKW], hid, BT, C, F);
    for (size_t i = 0; i < BT * F; i++) hid[i] = hid[i] > 0.0 ? hid[i] * hid[i] : 0.0;
    ref_mm(hid, par[FVW], out, BT, F, C);
    for (size_t i = 0; i < BT * C; i++) out[i] += x1[i];
    free(h1), free(q), free(k), free(v), free(y), free(x1), free(h2), free(xk), free(hid),
        free(p), free(mask);
}

static void fill_params(const geom *g, float *const *par, rx_attn_params *P) {
    memset(P, 0, sizeof *P);
    P->c = g->C, P->n_head = g->H, P->head_size = g->N;
    P->chunk_size = g->cs, P->moba_top_k = g->top_k;
    P->ln1_w = par[LN1W], P->ln1_b = par[LN1B], P->receptance_w = par[WR];
    P->key_w = par[WK], P->value_w = par[WV], P->output_w = par[WO];
    P->ln2_w = par[LN2W], P->ln2_b = par[LN2B];
    P->cm.c = g->C, P->cm.ffn_dim = g->F;
    P->cm.ffn_x_k = par[FXK], P->cm.ffn_key_w = par[FKW], P->cm.ffn_value_w = par[FVW];
}

static void test_block(int B, int T, int H, int N, int F, int cs, int top_k) {
    geom g = {B, T, H, N, H * N, F, cs, top_k};
    size_t BTC = (size_t)B * T * g.C, BC = (size_t)B * g.C;
    float *par[NPAR], *grad[NPAR], *dir[NPAR];
    for (int i = 0; i < NPAR; i++) {
        int gain = i == LN1W || i == LN2W;
        double sc = par_size(&g, i) > (size_t)g.C ? 1.0 / sqrt((double)g.C) : 0.3;
        if (i == FVW) sc = 1.0 / sqrt((double)F);
        par[i] = frand(par_size(&g, i), sc, gain ? 1.0 : 0.0);
        grad[i] = malloc(par_size(&g, i) * sizeof(float));
        dir[i] = frand(par_size(&g, i), 1.0, 0.0);
    }
    float *x = frand(BTC, 1.0, 0.0), *cmx = frand(BC, 1.0, 0.0), *dy = frand(BTC, 1.0, 0.0);
    float *dirx = frand(BTC, 1.0, 0.0), *dirc = frand(BC, 1.0, 0.0);
    float *out = malloc(BTC * sizeof(float)), *dx = malloc(BTC * sizeof(float));
    float *dcm = malloc(BC * sizeof(float));
    rx_attn_params P;
    fill_params(&g, par, &P);
    rx_attn_grads G = {grad[LN1W], grad[LN1B], grad[WR], grad[WK], grad[WV], grad[WO],
                       grad[LN2W], grad[LN2B], {grad[FXK], grad[FKW], grad[FVW]}};
    CHECK(rx_attn_forward_seq(&P, x, cmx, out, B, T) == RX_OK, "block forward rc");
    CHECK(rx_attn_backward_full(&P, x, cmx, dy, &G, dx, dcm, B, T) == RX_OK, "block backward rc");

    /* forward against double loops */
    double *pd[NPAR], *xd = to_d(x, BTC), *cd = to_d(cmx, BC), *ref = dalloc(BTC);
    for (int i = 0; i < NPAR; i++) pd[i] = to_d(par[i], par_size(&g, i));
    ref_block(&g, pd, xd, cd, ref);
    double eo = rel_err(out, ref, BTC);

    /* backward: d/de sum(dy . out(inputs + e dir)) by central differences */
    double analytic = 0.0, fd = 0.0, eps = 1e-5;
    for (size_t i = 0; i < BTC; i++) analytic += (double)dx[i] * dirx[i];
    for (size_t i = 0; i < BC; i++) analytic += (double)dcm[i] * dirc[i];
    for (int i = 0; i < NPAR; i++)
        for (size_t j = 0; j < par_size(&g, i); j++) analytic += (double)grad[i][j] * dir[i][j];
    for (int sgn = -1; sgn <= 1; sgn += 2) {
        double *pp[NPAR], *xp = dalloc(BTC), *cp = dalloc(BC), *o = dalloc(BTC), l = 0.0;
        for (int i = 0; i < NPAR; i++) {
            pp[i] = dalloc(par_size(&g, i));
            for (size_t j = 0; j < par_size(&g, i); j++) pp[i][j] = pd[i][j] + sgn * eps * dir[i][j];
        }
        for (size_t i = 0; i < BTC; i++) xp[i] = xd[i] + sgn * eps * dirx[i];
        for (size_t i = 0; i < BC; i++) cp[i] = cd[i] + sgn * eps * dirc[i];
        ref_block(&g, pp, xp, cp, o);
        for (size_t i = 0; i < BTC; i++) l += dy[i] * o[i];
        fd += sgn * l / (2.0 * eps);
        for (int i = 0; i < NPAR; i++) free(pp[i]);
        free(xp), free(cp), free(o);
    }
    double eb = fabs(analytic - fd) / fabs(fd);
    printf("block B=%d T=%d H=%d N=%d F=%d cs=%d top_k=%d: out %.1e, directional grad %.1e\n",
           B, T, H, N, F, cs, top_k, eo, eb);
    CHECK(eo <= 1e-5, "block forward error");
    CHECK(eb <= 1e-4, "block backward directional error (analytic %g, fd %g)", analytic, fd);

    /* invalid arguments: -2, nothing written */
    rx_attn_params bad = P;
    CHECK(rx_attn_forward_seq(NULL, x, cmx, out, B, T) == RX_EINVAL, "NULL P");
    CHECK(rx_attn_forward_seq(&P, NULL, cmx, out, B, T) == RX_EINVAL, "NULL x");
    CHECK(rx_attn_forward_seq(&P, x, cmx, NULL, B, T) == RX_EINVAL, "NULL out");
    CHECK(rx_attn_forward_seq(&P, x, cmx, out, 0, T) == RX_EINVAL, "B = 0");
    CHECK(rx_attn_forward_seq(&P, x, cmx, out, B, 0) == RX_EINVAL, "T = 0");
    bad.chunk_size = 0;
    CHECK(rx_attn_forward_seq(&bad, x, cmx, out, B, T) == RX_EINVAL, "chunk_size 0");
    bad = P, bad.head_size = N + 1;
    CHECK(rx_attn_forward_seq(&bad, x, cmx, out, B, T) == RX_EINVAL, "c != H*N");
    bad = P, bad.cm.c = g.C + 1;
    CHECK(rx_attn_forward_seq(&bad, x, cmx, out, B, T) == RX_EINVAL, "cm.c != c");
    bad = P, bad.key_w = NULL;
    CHECK(rx_attn_forward_seq(&bad, x, cmx, out, B, T) == RX_EINVAL, "NULL key_w");
    bad = P, bad.cm.ffn_value_w = NULL;
    CHECK(rx_attn_backward_full(&bad, x, cmx, dy, &G, dx, dcm, B, T) == RX_EINVAL, "NULL ffn_value_w");
    CHECK(rx_attn_backward_full(&P, x, cmx, NULL, &G, dx, dcm, B, T) == RX_EINVAL, "NULL dy");
    CHECK(rx_attn_backward_full(&P, x, cmx, dy, NULL, dx, dcm, B, T) == RX_EINVAL, "NULL G");
    CHECK(rx_attn_backward_full(&P, x, cmx, dy, &G, NULL, dcm, B, T) == RX_EINVAL, "NULL dx");
    rx_attn_grads badg = G;
    badg.output_w = NULL;
    CHECK(rx_attn_backward_full(&P, x, cmx, dy, &badg, dx, dcm, B, T) == RX_EINVAL, "NULL G.output_w");
    badg = G, badg.cm.ffn_x_k = NULL;
    CHECK(rx_attn_backward_full(&P, x, cmx, dy, &badg, dx, dcm, B, T) == RX_EINVAL, "NULL G.cm.ffn_x_k");
    /* carries are optional */
    CHECK(rx_attn_forward_seq(&P, x, NULL, out, B, T) == RX_OK, "NULL carry forward");
    CHECK(rx_attn_backward_full(&P, x, NULL, dy, &G, dx, NULL, B, T) == RX_OK, "NULL carries backward");
    /* the hooks */
    bad = P, bad.n_head = 0;
    CHECK(rx_attn_score_av_forward(&bad, x, x, x, B, T, NULL, out) == RX_EINVAL, "hook n_head 0");
    CHECK(rx_attn_score_av_forward(&P, x, NULL, x, B, T, NULL, out) == RX_EINVAL, "hook NULL k");
    CHECK(rx_attn_score_av_forward(&P, x, x, x, B, T, NULL, NULL) == RX_EINVAL, "hook NULL y");
    CHECK(rx_attn_score_av_forward(&P, x, x, x, B, T, NULL, out) == RX_OK, "hook NULL p");
    CHECK(rx_attn_score_av_backward(&P, x, x, x, dy, B, T, dx, NULL, dx) == RX_EINVAL, "hook NULL dk");
    CHECK(rx_attn_score_av_backward(&P, x, x, x, NULL, B, T, dx, dx, dx) == RX_EINVAL, "hook NULL dy");
    CHECK(rx_attn_score_av_backward(NULL, x, x, x, dy, B, T, dx, dx, dx) == RX_EINVAL, "hook NULL P");

    for (int i = 0; i < NPAR; i++) free(par[i]), free(grad[i]), free(dir[i]), free(pd[i]);
    free(x), free(cmx), free(dy), free(dirx), free(dirc), free(out), free(dx), free(dcm);
    free(xd), free(cd), free(ref);
}

int main(void) {
    /* B, T, H, N, chunk_size, top_k */
    test_core(2, 37, 3, 5, 4, 2, 0);    /* selection active, T not a multiple of chunk_size */
    test_core(1, 23, 2, 4, 3, 1, 0);
    test_core(2, 30, 2, 4, 4, 0, 0);    /* top_k <= 0: all earlier chunks */
    test_core(1, 30, 2, 4, 4, 9, 0);    /* top_k >= candidates */
    test_core(1, 20, 1, 4, 1, 3, 0);    /* chunk_size 1 */
    test_core(2, 5, 2, 3, 8, 2, 0);     /* T < chunk_size */
    test_core(2, 1, 2, 3, 2, 1, 0);     /* T = 1 */
    test_core(1, 70, 2, 1, 2, 5, 0);    /* N = 1, many chunks */
    test_core(2, 130, 2, 16, 8, 3, 0);  /* big enough for the threaded paths */
    test_core(2, 130, 2, 16, 8, 0, 0);
    test_core(1, 300, 2, 4, 70, 2, 0);  /* chunks longer than a 64-row tile */
    test_core(1, 300, 1, 4, 70, 0, 0);
    test_core(1, 150, 2, 3, 200, 1, 0); /* one partial chunk of several tiles */
    test_core(2, 24, 2, 4, 4, 1, 1);    /* equal gates: the smaller chunk wins */
    test_core(2, 24, 2, 4, 4, 2, 1);
    /* B, T, H, N, F, chunk_size, top_k */
    test_block(2, 19, 2, 3, 7, 3, 2);
    test_block(1, 9, 1, 4, 5, 2, 0);
    test_block(2, 3, 2, 2, 3, 4, 1);
    test_block(2, 70, 2, 16, 24, 8, 2);
    if (failures) printf("%d FAILURES\n", failures);
    else printf("all attention checks passed\n");
    return failures != 0;
}
