/* test_rwkv.c -- the RWKV-7 time-mix and block kernels against plain
 * double-precision loops written from docs/maths.md §Time-mix-§6, and their backward
 * against central finite differences of those loops: for every tensor, a
 * random direction d in it alone, <grad_C, d> vs (L(th+eps d) - L(th-eps d))
 * / 2eps with L = sum(out*dy) (+ sum(v_first*dvf) at layer 0). Also the
 * RX_EINVAL returns. Standalone: returns nonzero on failure.
 *
 *   gcc -fsanitize=address,undefined -g -O1 -fopenmp -Icsrc tests/c/test_rwkv.c csrc/[a-z]*.c -lm
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rx_pretrain.h"
#include "check.h"

enum { B = 2, T = 5, H = 2, N = 3, C = H * N, DW = 3, DA = 2, DG = 4, DV = 3, F = 5 };

/* Every tensor of the test, params then inputs, in one flat array. */
enum {
    X_R, X_K, X_V, X_W, X_A, X_G, RW, KW, VW, OW, W0, W1, W2, A0, A1, A2, G1, G2, V0, V1, V2,
    KK, KA, RK, LNXW, LNXB, LN1W, LN1B, LN2W, LN2B, FXK, FKW, FVW,
    IX, IXP1, IXP2, IVF, NTEN
};
static const char *NAME[NTEN] = {
    "x_r", "x_k", "x_v", "x_w", "x_a", "x_g", "receptance_w", "key_w", "value_w", "output_w",
    "w0", "w1", "w2", "a0", "a1", "a2", "g1", "g2", "v0", "v1", "v2", "k_k", "k_a", "r_k",
    "ln_x_w", "ln_x_b", "ln1_w", "ln1_b", "ln2_w", "ln2_b", "ffn_x_k", "ffn_key_w",
    "ffn_value_w", "x", "xprev1", "xprev2", "v_first"};
static size_t SIZE[NTEN], OFF[NTEN + 1];

static void init_layout(void) {
    for (int i = 0; i < NTEN; i++) SIZE[i] = C;
    SIZE[RW] = SIZE[KW] = SIZE[VW] = SIZE[OW] = C * C;
    SIZE[W1] = SIZE[W2] = C * DW;
    SIZE[A1] = SIZE[A2] = C * DA;
    SIZE[G1] = SIZE[G2] = C * DG;
    SIZE[V1] = SIZE[V2] = C * DV;
    SIZE[FKW] = SIZE[FVW] = C * F;
    SIZE[IX] = SIZE[IVF] = B * T * C;
    SIZE[IXP1] = SIZE[IXP2] = B * C;
    OFF[0] = 0;
    for (int i = 0; i < NTEN; i++) OFF[i + 1] = OFF[i] + SIZE[i];
}

static unsigned long long rng_state = 0x1234567ULL;
static double urand(void) { /* [-1, 1) */
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(rng_state >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

/* ---------------- double-precision reference, straight from docs ------- */

static double sigm(double x) { return 1.0 / (1.0 + exp(-x)); }

/* out[bt][c] = x + (x_prev - x) * mix */
static void lerp_d(const double *x, const double *init, const double *mix, double *out) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int c = 0; c < C; c++) {
                double xv = x[(b * T + t) * C + c];
                double xp = t > 0 ? x[(b * T + t - 1) * C + c] : init[b * C + c];
                out[(b * T + t) * C + c] = xv + (xp - xv) * mix[c];
            }
}

/* y [rows][m] = x [rows][k] . W [k][m] */
static void mat_d(const double *x, int rows, int k, const double *W, int m, double *y) {
    for (int r = 0; r < rows; r++)
        for (int o = 0; o < m; o++) {
            double s = 0.0;
            for (int i = 0; i < k; i++) s += x[r * k + i] * W[i * m + o];
            y[r * m + o] = s;
        }
}

/* rows of D normalised, affine at (row % period)*D */
static void norm_d(const double *x, const double *w, const double *b, double *out, int rows,
                   int D, int period, double eps) {
    for (int r = 0; r < rows; r++) {
        double mu = 0.0, var = 0.0;
        for (int n = 0; n < D; n++) mu += x[r * D + n] / D;
        for (int n = 0; n < D; n++) var += (x[r * D + n] - mu) * (x[r * D + n] - mu) / D;
        int p = (r % period) * D;
        for (int n = 0; n < D; n++)
            out[r * D + n] = (x[r * D + n] - mu) / sqrt(var + eps) * w[p + n] + b[p + n];
    }
}

enum { BTC = B * T * C };

/* docs/maths.md §Time-mix. th: every tensor in double; x: the time-mix input. */
static void tm_d(const double *th, const double *x, const double *xp, int layer,
                 double *vf_out, double *out) {
    static double xs[6][BTC], r[BTC], k[BTC], v[BTC], w[BTC], a[BTC], g[BTC], vg[BTC];
    static double kk[BTC], y[BTC], z[BTC], h[B * T * 8];
    const int mixes[6] = {X_R, X_W, X_K, X_V, X_A, X_G};
    for (int i = 0; i < 6; i++) lerp_d(x, xp, th + OFF[mixes[i]], xs[i]);
    mat_d(xs[0], B * T, C, th + OFF[RW], C, r);
    mat_d(xs[2], B * T, C, th + OFF[KW], C, k);
    mat_d(xs[3], B * T, C, th + OFF[VW], C, v);
    mat_d(xs[1], B * T, C, th + OFF[W1], DW, h);
    for (int i = 0; i < B * T * DW; i++) h[i] = tanh(h[i]);
    mat_d(h, B * T, DW, th + OFF[W2], C, w);
    mat_d(xs[4], B * T, C, th + OFF[A1], DA, h);
    mat_d(h, B * T, DA, th + OFF[A2], C, a);
    mat_d(xs[5], B * T, C, th + OFF[G1], DG, h);
    for (int i = 0; i < B * T * DG; i++) h[i] = sigm(h[i]);
    mat_d(h, B * T, DG, th + OFF[G2], C, g);
    if (layer > 0) {
        mat_d(xs[3], B * T, C, th + OFF[V1], DV, h);
        mat_d(h, B * T, DV, th + OFF[V2], C, vg);
    }
    for (int i = 0; i < BTC; i++) {
        int c = i % C;
        w[i] = exp(-0.6065306597126334 * sigm(th[OFF[W0] + c] + w[i]));
        a[i] = sigm(th[OFF[A0] + c] + a[i]);
        if (layer > 0)
            v[i] = v[i] + (th[OFF[IVF] + i] - v[i]) * sigm(th[OFF[V0] + c] + vg[i]);
        else if (vf_out)
            vf_out[i] = v[i];
        kk[i] = k[i] * th[OFF[KK] + c];
    }
    for (int i = 0; i < B * T * H; i++) {
        double s = 0.0;
        for (int n = 0; n < N; n++) s += kk[i * N + n] * kk[i * N + n];
        s = sqrt(s) > 1e-12 ? sqrt(s) : 1e-12;
        for (int n = 0; n < N; n++) kk[i * N + n] /= s;
    }
    for (int i = 0; i < BTC; i++) k[i] *= 1.0 + (a[i] - 1.0) * th[OFF[KA] + i % C];
    for (int b = 0; b < B; b++)
        for (int hh = 0; hh < H; hh++) {
            double S[N][N] = {{0}};
            for (int t = 0; t < T; t++) {
                int o = (b * T + t) * C + hh * N;
                for (int i = 0; i < N; i++) {
                    double sa = 0.0;
                    for (int j = 0; j < N; j++) sa -= kk[o + j] * S[i][j];
                    for (int j = 0; j < N; j++)
                        S[i][j] = S[i][j] * w[o + j] + v[o + i] * k[o + j] +
                                  sa * kk[o + j] * a[o + j];
                }
                for (int i = 0; i < N; i++) {
                    y[o + i] = 0.0;
                    for (int j = 0; j < N; j++) y[o + i] += S[i][j] * r[o + j];
                }
            }
        }
    norm_d(y, th + OFF[LNXW], th + OFF[LNXB], z, B * T * H, N, H, RX_DEFAULT_GN_EPS);
    for (int i = 0; i < B * T * H; i++) {
        double s = 0.0;
        for (int n = 0; n < N; n++) s += r[i * N + n] * k[i * N + n] * th[OFF[RK] + (i % H) * N + n];
        for (int n = 0; n < N; n++) z[i * N + n] = (z[i * N + n] + s * v[i * N + n]) * g[i * N + n];
    }
    mat_d(z, B * T, C, th + OFF[OW], C, out);
}

/* docs/maths.md §Channel-mix */
static void cm_d(const double *th, const double *x, const double *xp, double *out) {
    static double xk[BTC], hid[B * T * F];
    lerp_d(x, xp, th + OFF[FXK], xk);
    mat_d(xk, B * T, C, th + OFF[FKW], F, hid);
    for (int i = 0; i < B * T * F; i++) hid[i] = hid[i] > 0 ? hid[i] * hid[i] : 0.0;
    mat_d(hid, B * T, F, th + OFF[FVW], C, out);
}

/* docs/maths.md §Blocks (block) or §3 alone; the loss of the gradient checks */
static double loss_d(const double *th, int block, int layer, const double *dy,
                     const double *dvf, double *out) {
    static double h[BTC], x1[BTC], t1[BTC], vf[BTC];
    const double *x = th + OFF[IX];
    if (block) {
        norm_d(x, th + OFF[LN1W], th + OFF[LN1B], h, B * T, C, 1, RX_DEFAULT_LN_EPS);
        tm_d(th, h, th + OFF[IXP1], layer, vf, t1);
        for (int i = 0; i < BTC; i++) x1[i] = x[i] + t1[i];
        norm_d(x1, th + OFF[LN2W], th + OFF[LN2B], h, B * T, C, 1, RX_DEFAULT_LN_EPS);
        cm_d(th, h, th + OFF[IXP2], t1);
        for (int i = 0; i < BTC; i++) out[i] = x1[i] + t1[i];
    } else {
        tm_d(th, x, th + OFF[IXP1], layer, vf, out);
    }
    double L = 0.0;
    for (int i = 0; i < BTC; i++) L += out[i] * dy[i] + (layer == 0 ? vf[i] * dvf[i] : 0.0);
    return L;
}

/* ---------------- the C kernels over the same tensors ------------------ */

static void fill_params(rx_block_params *P, const float *th, int layer) {
    memset(P, 0, sizeof *P);
    rx_tm_params *t = &P->tm;
    t->c = C, t->n_head = H, t->head_size = N, t->Dw = DW, t->Da = DA, t->Dg = DG;
    t->Dv = layer > 0 ? DV : 0, t->layer_id = layer;
    const float **tp[] = {&t->x_r, &t->x_k, &t->x_v, &t->x_w, &t->x_a, &t->x_g,
                          &t->receptance_w, &t->key_w, &t->value_w, &t->output_w,
                          &t->w0, &t->w1, &t->w2, &t->a0, &t->a1, &t->a2, &t->g1, &t->g2,
                          &t->v0, &t->v1, &t->v2, &t->k_k, &t->k_a, &t->r_k, &t->ln_x_w,
                          &t->ln_x_b, &P->ln1_w, &P->ln1_b, &P->ln2_w, &P->ln2_b,
                          &P->cm.ffn_x_k, &P->cm.ffn_key_w, &P->cm.ffn_value_w};
    for (int i = 0; i <= FVW; i++) *tp[i] = th + OFF[i];
    if (layer == 0) t->v0 = t->v1 = t->v2 = NULL;
    P->cm.c = C, P->cm.ffn_dim = F;
}

static void fill_grads(rx_block_grads *G, float *gr, int layer) {
    rx_tm_grads *t = &G->tm;
    float **tp[] = {&t->x_r, &t->x_k, &t->x_v, &t->x_w, &t->x_a, &t->x_g,
                    &t->receptance_w, &t->key_w, &t->value_w, &t->output_w,
                    &t->w0, &t->w1, &t->w2, &t->a0, &t->a1, &t->a2, &t->g1, &t->g2,
                    &t->v0, &t->v1, &t->v2, &t->k_k, &t->k_a, &t->r_k, &t->ln_x_w,
                    &t->ln_x_b, &G->ln1_w, &G->ln1_b, &G->ln2_w, &G->ln2_b,
                    &G->cm.ffn_x_k, &G->cm.ffn_key_w, &G->cm.ffn_value_w};
    for (int i = 0; i <= FVW; i++) *tp[i] = gr + OFF[i];
    if (layer == 0) t->v0 = t->v1 = t->v2 = NULL;
}

/* One case: forward vs the double loops, then every tensor's directional
 * derivative vs finite differences. */
static void check_case(int block, int layer) {
    const size_t n = OFF[NTEN];
    float *th = malloc(n * sizeof(float)), *gr = malloc(n * sizeof(float));
    double *thd = malloc(n * sizeof(double)), *dir = malloc(n * sizeof(double));
    float *out = malloc(BTC * sizeof(float)), *vf = malloc(BTC * sizeof(float));
    float *dyf = malloc(BTC * sizeof(float)), *dvff = malloc(BTC * sizeof(float));
    double *dy = malloc(BTC * sizeof(double)), *dvf = malloc(BTC * sizeof(double));
    double *outd = malloc(BTC * sizeof(double));
    for (int i = 0; i < NTEN; i++)
        for (size_t e = 0; e < SIZE[i]; e++) {
            double u = urand();
            if (i == RW || i == KW || i == VW || i == OW || i == W1 || i == A1 || i == G1 ||
                i == V1 || i == FKW)
                u *= sqrt(3.0 / C);
            else if (i == W2 || i == A2 || i == G2 || i == V2 || i == FVW)
                u *= sqrt(3.0 / (SIZE[i] / C));
            else if (i == LNXW || i == LN1W || i == LN2W)
                u = 1.0 + 0.2 * u;
            else if (i >= IX)
                u *= 1.5;
            th[OFF[i] + e] = (float)u;
            thd[OFF[i] + e] = th[OFF[i] + e];
        }
    for (int i = 0; i < BTC; i++) {
        dyf[i] = (float)urand();
        dvff[i] = (float)urand();
        dy[i] = dyf[i];
        dvf[i] = dvff[i];
    }
    rx_block_params P;
    rx_block_grads G;
    fill_params(&P, th, layer);
    fill_grads(&G, gr, layer);
    const char *what = block ? "block" : "timemix";
    float *vf_arg = layer > 0 ? th + OFF[IVF] : vf;
    int rc;
    if (block)
        rc = rx_block_forward_seq(&P, th + OFF[IX], th + OFF[IXP1], th + OFF[IXP2], vf_arg,
                                  out, B, T);
    else
        rc = rx_timemix_forward_seq(&P.tm, th + OFF[IX], th + OFF[IXP1], vf_arg, out, B, T);
    CHECK(rc == RX_OK, "%s layer %d forward rc %d", what, layer, rc);
    double scale = 0.0, err = 0.0;
    (void)loss_d(thd, block, layer, dy, dvf, outd);
    for (int i = 0; i < BTC; i++) {
        scale = fmax(scale, fabs(outd[i]));
        err = fmax(err, fabs(out[i] - outd[i]));
    }
    CHECK(err <= 1e-5 * scale, "%s layer %d forward error %.2e of %.2e", what, layer, err, scale);

    for (size_t i = 0; i < n; i++) gr[i] = NAN;   /* every grad must be written */
    float *dvf_slot = layer > 0 ? gr + OFF[IVF] : dvff;
    if (block)
        rc = rx_block_backward(&P, th + OFF[IX], th + OFF[IXP1], th + OFF[IXP2], th + OFF[IVF],
                               dyf, &G, gr + OFF[IX], gr + OFF[IXP1], gr + OFF[IXP2], dvf_slot,
                               B, T);
    else
        rc = rx_timemix_backward(&P.tm, th + OFF[IX], th + OFF[IXP1], th + OFF[IVF], dyf, &G.tm,
                                 gr + OFF[IX], gr + OFF[IXP1], dvf_slot, B, T);
    CHECK(rc == RX_OK, "%s layer %d backward rc %d", what, layer, rc);

    for (int ten = 0; ten < NTEN; ten++) {
        int unused = (!block && (ten >= LN1W && ten <= FVW)) || (!block && ten == IXP2) ||
                     (layer == 0 && (ten == V0 || ten == V1 || ten == V2 || ten == IVF));
        if (unused) continue;
        double dd = 0.0, mag = 0.0, eps = 1e-6;
        for (size_t i = 0; i < n; i++) dir[i] = 0.0;
        for (size_t e = 0; e < SIZE[ten]; e++) {
            size_t i = OFF[ten] + e;
            dir[i] = urand();
            dd += gr[i] * dir[i];
            mag += fabs(gr[i] * dir[i]);
        }
        for (size_t i = 0; i < n; i++) thd[i] = th[i] + eps * dir[i];
        double Lp = loss_d(thd, block, layer, dy, dvf, outd);
        for (size_t i = 0; i < n; i++) thd[i] = th[i] - eps * dir[i];
        double Lm = loss_d(thd, block, layer, dy, dvf, outd);
        double fd = (Lp - Lm) / (2.0 * eps);
        CHECK(isfinite(dd) && fabs(dd - fd) <= 1e-4 * mag + 1e-7,
              "%s layer %d grad %s: <g,d> %.8e, finite difference %.8e", what, layer, NAME[ten],
              dd, fd);
    }
    free(th), free(gr), free(thd), free(dir), free(out), free(vf), free(dyf), free(dvff);
    free(dy), free(dvf), free(outd);
}

static void check_invalid(void) {
    const size_t n = OFF[NTEN];
    float *th = calloc(n, sizeof(float)), *gr = calloc(n, sizeof(float));
    float *out = calloc(BTC, sizeof(float));
    rx_block_params P;
    rx_block_grads G;
    fill_params(&P, th, 1);
    fill_grads(&G, gr, 1);
    const float *x = th + OFF[IX];
    float *vf = th + OFF[IVF];
    CHECK(rx_timemix_forward_seq(NULL, x, NULL, vf, out, B, T) == RX_EINVAL, "NULL params");
    CHECK(rx_timemix_forward_seq(&P.tm, NULL, NULL, vf, out, B, T) == RX_EINVAL, "NULL x");
    CHECK(rx_timemix_forward_seq(&P.tm, x, NULL, vf, NULL, B, T) == RX_EINVAL, "NULL out");
    CHECK(rx_timemix_forward_seq(&P.tm, x, NULL, NULL, out, B, T) == RX_EINVAL,
          "layer 1 without v_first");
    CHECK(rx_timemix_forward_seq(&P.tm, x, NULL, vf, out, 0, T) == RX_EINVAL, "B = 0");
    CHECK(rx_timemix_forward_seq(&P.tm, x, NULL, vf, out, B, 0) == RX_EINVAL, "T = 0");
    CHECK(rx_block_forward_seq(&P, x, NULL, NULL, vf, out, B, -1) == RX_EINVAL, "block T < 0");
    rx_block_params Q = P;
    Q.tm.head_size = N + 1;
    CHECK(rx_timemix_forward_seq(&Q.tm, x, NULL, vf, out, B, T) == RX_EINVAL, "H*N != c");
    Q = P;
    Q.tm.layer_id = -1;
    CHECK(rx_timemix_forward_seq(&Q.tm, x, NULL, vf, out, B, T) == RX_EINVAL, "layer_id < 0");
    Q = P;
    Q.tm.Dv = 0;
    CHECK(rx_timemix_forward_seq(&Q.tm, x, NULL, vf, out, B, T) == RX_EINVAL, "Dv = 0 at layer 1");
    Q = P;
    Q.tm.v2 = NULL;
    CHECK(rx_block_forward_seq(&Q, x, NULL, NULL, vf, out, B, T) == RX_EINVAL, "NULL v2");
    Q = P;
    Q.tm.Dg = 0;
    CHECK(rx_block_forward_seq(&Q, x, NULL, NULL, vf, out, B, T) == RX_EINVAL, "Dg = 0");
    Q = P;
    Q.cm.c = C + 1;
    CHECK(rx_block_forward_seq(&Q, x, NULL, NULL, vf, out, B, T) == RX_EINVAL, "cm.c != c");
    Q = P;
    Q.ln2_b = NULL;
    CHECK(rx_block_forward_seq(&Q, x, NULL, NULL, vf, out, B, T) == RX_EINVAL, "NULL ln2_b");
    rx_block_grads H2 = G;
    H2.tm.k_a = NULL;
    CHECK(rx_timemix_backward(&P.tm, x, NULL, vf, x, &H2.tm, gr + OFF[IX], NULL, NULL, B, T) ==
              RX_EINVAL, "NULL grad k_a");
    H2 = G;
    H2.tm.v1 = NULL;
    CHECK(rx_block_backward(&P, x, NULL, NULL, vf, x, &H2, gr + OFF[IX], NULL, NULL, NULL, B, T) ==
              RX_EINVAL, "NULL grad v1 at layer 1");
    H2 = G;
    H2.cm.ffn_key_w = NULL;
    CHECK(rx_block_backward(&P, x, NULL, NULL, vf, x, &H2, gr + OFF[IX], NULL, NULL, NULL, B, T) ==
              RX_EINVAL, "NULL grad ffn_key_w");
    CHECK(rx_block_backward(&P, x, NULL, NULL, NULL, x, &G, gr + OFF[IX], NULL, NULL, NULL, B,
                            T) == RX_EINVAL, "block backward layer 1 without v_first");
    CHECK(rx_block_backward(&P, x, NULL, NULL, vf, NULL, &G, gr + OFF[IX], NULL, NULL, NULL, B,
                            T) == RX_EINVAL, "NULL dy");
    /* layer 0: v/grad v pointers may be NULL, and optional outputs too */
    fill_params(&P, th, 0);
    fill_grads(&G, gr, 0);
    CHECK(rx_block_forward_seq(&P, x, NULL, NULL, NULL, out, B, T) == RX_OK, "layer 0, no v_first");
    CHECK(rx_block_backward(&P, x, NULL, NULL, NULL, x, &G, gr + OFF[IX], NULL, NULL, NULL, B,
                            T) == RX_OK, "layer 0 backward, nothing optional");
    free(th), free(gr), free(out);
}

int main(void) {
    init_layout();
    for (int block = 0; block < 2; block++)
        for (int layer = 0; layer < 3; layer += 2) check_case(block, layer);
    check_invalid();
    if (failures) {
        printf("test_rwkv: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_rwkv: ok\n");
    return 0;
}
