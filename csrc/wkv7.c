/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * wkv7.c -- the RWKV-7 WKV recurrence, forward and backward through time.
 *
 * The backward equations are those of the wkv7 CUDA kernel of BlinkDL's
 * RWKV-LM (Apache-2.0, see NOTICE), restated for a row-major state:
 *     dS_t    += dy_t r_t^T                       (grad entering S_t)
 *     dr_t[j]  = sum_i S_t[i][j] dy_t[i]
 *     dw_t[j]  = sum_i dS[i][j] S_{t-1}[i][j]
 *     dk_t[j]  = sum_i dS[i][j] v_t[i]      dv_t[i] = sum_j dS[i][j] k_t[j]
 *     db_t[j]  = sum_i dS[i][j] sa[i]      dsa[i]  = sum_j dS[i][j] b_t[j]
 *     da_t[j]  = sum_i dsa[i] S_{t-1}[i][j]
 *     dS_{t-1} = dS diag(w_t) + dsa a_t^T
 * Unlike the CUDA kernel, dw is w.r.t. the effective decay w itself.
 *
 * Memory: the backward keeps the state only every WKV_CHUNK steps and
 * recomputes the states inside a chunk from its checkpoint, so a head costs
 * ceil(T/16)*N*N saved floats instead of T*N*N. Recomputation repeats the
 * forward arithmetic exactly, so the states match the forward's bit for bit.
 *
 * Each (b, h) pair is independent: OpenMP runs over B*H, and every row
 * operation runs over the key dimension j, contiguous in memory.
 */
#include <string.h>

#include "rx_internal.h"

#define WKV_CHUNK 16

/* One step for one head: S [N][N] updated in place; y [N] or NULL. */
RX_HOT static void wkv7_step(float *S, const float *r, const float *w, const float *k,
                             const float *v, const float *a, const float *b, float *y,
                             size_t N) {
    for (size_t i = 0; i < N; i++) {
        float *Si = S + i * N;
        float sa = 0.0f, yi = 0.0f, vi = v[i];
#pragma omp simd reduction(+ : sa)
        for (size_t j = 0; j < N; j++) sa += a[j] * Si[j];
#pragma omp simd reduction(+ : yi)
        for (size_t j = 0; j < N; j++) {
            float s = Si[j] * w[j] + vi * k[j] + sa * b[j];
            Si[j] = s;
            yi += s * r[j];
        }
        if (y) y[i] = yi;
    }
}

/* One reverse step for one head. S0 = state before the step, S1 after it;
 * dS [N][N] enters as the grad on S1 (without this step's dy) and leaves as
 * the grad on S0. dr..db receive this step's per-token grads. */
RX_HOT static void wkv7_step_back(const float *S0, const float *S1, float *dS,
                                  const float *r, const float *w, const float *k,
                                  const float *v, const float *a, const float *b,
                                  const float *dy, float *dr, float *dw, float *dk,
                                  float *dv, float *da, float *db, size_t N) {
    for (size_t j = 0; j < N; j++) dr[j] = dw[j] = dk[j] = da[j] = db[j] = 0.0f;
    for (size_t i = 0; i < N; i++) {
        const float *S0i = S0 + i * N, *S1i = S1 + i * N;
        float *dSi = dS + i * N;
        float dyi = dy[i], vi = v[i], sa = 0.0f, dvi = 0.0f, dsa = 0.0f;
#pragma omp simd reduction(+ : sa, dvi, dsa)
        for (size_t j = 0; j < N; j++) {
            float g = dSi[j] + dyi * r[j];
            dSi[j] = g;
            dr[j] += dyi * S1i[j];
            sa += a[j] * S0i[j];
            dvi += g * k[j];
            dsa += g * b[j];
        }
        dv[i] = dvi;
#pragma omp simd
        for (size_t j = 0; j < N; j++) {
            float g = dSi[j];
            dw[j] += g * S0i[j];
            dk[j] += g * vi;
            db[j] += g * sa;
            da[j] += dsa * S0i[j];
            dSi[j] = g * w[j] + dsa * a[j];
        }
    }
}

static int wkv7_args_ok(const float *r, const float *w, const float *k, const float *v,
                        const float *a, const float *b, int B, int T, int H, int N) {
    return r && w && k && v && a && b && B >= 1 && T >= 1 && H >= 1 && N >= 1;
}

/* r..b, y_out: [B][T][H][N]; s_init, s_final: [B][H][N][N] */
int rx_wkv7_forward_seq(const float *r, const float *w, const float *k, const float *v,
                        const float *a, const float *b, const float *s_init,
                        float *y_out, float *s_final, int B, int T, int n_head, int head_size) {
    if (!wkv7_args_ok(r, w, k, v, a, b, B, T, n_head, head_size)) return RX_EINVAL;
    const size_t H = (size_t)n_head, N = (size_t)head_size, C = H * N, NN = N * N;
    const size_t BH = (size_t)B * H;
    int nt = rx_in_parallel() ? 1 : rx_max_threads();
    if ((size_t)nt > BH) nt = (int)BH;
    float *scratch = s_final ? NULL : rx_falloc((size_t)nt * NN);
    if (!s_final && !scratch) return RX_ENOMEM;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (size_t bh = 0; bh < BH; bh++) {
        size_t bi = bh / H, h = bh % H;
        float *S = s_final ? s_final + bh * NN : scratch + (size_t)rx_thread_id() * NN;
        if (!s_init) memset(S, 0, NN * sizeof(float));
        else if (S != s_init + bh * NN) memcpy(S, s_init + bh * NN, NN * sizeof(float));
        for (size_t t = 0; t < (size_t)T; t++) {
            size_t o = (bi * (size_t)T + t) * C + h * N;
            wkv7_step(S, r + o, w + o, k + o, v + o, a + o, b + o, y_out ? y_out + o : NULL, N);
        }
    }
    free(scratch);
    return RX_OK;
}

/* r..b, dy, dr..db: [B][T][H][N]; s_init, dS_out: [B][H][N][N] */
int rx_wkv7_backward(const float *r, const float *w, const float *k, const float *v,
                     const float *a, const float *b, const float *dy, const float *s_init,
                     float *dr, float *dw, float *dk, float *dv, float *da, float *db,
                     float *dS_out, int B, int T, int n_head, int head_size) {
    if (!wkv7_args_ok(r, w, k, v, a, b, B, T, n_head, head_size) || !dy || !dr || !dw ||
        !dk || !dv || !da || !db)
        return RX_EINVAL;
    const size_t H = (size_t)n_head, N = (size_t)head_size, C = H * N, NN = N * N;
    const size_t BH = (size_t)B * H, TT = (size_t)T;
    const size_t ncp = (TT + WKV_CHUNK - 1) / WKV_CHUNK;
    int nt = rx_in_parallel() ? 1 : rx_max_threads();
    if ((size_t)nt > BH) nt = (int)BH;
    /* per thread: chunk states [WKV_CHUNK+1][N][N], checkpoints [ncp][N][N], dS [N][N] */
    const size_t per = (WKV_CHUNK + 1) * NN + ncp * NN + NN;
    float *scratch = rx_falloc((size_t)nt * per);
    if (!scratch) return RX_ENOMEM;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (size_t bh = 0; bh < BH; bh++) {
        size_t bi = bh / H, h = bh % H;
        float *buf = scratch + (size_t)rx_thread_id() * per;
        float *cp = buf + (WKV_CHUNK + 1) * NN, *dS = cp + ncp * NN;
#define OFF(t) ((bi * TT + (t)) * C + h * N)
        /* forward: checkpoint the state entering every chunk */
        float *S = buf;
        if (s_init) memcpy(S, s_init + bh * NN, NN * sizeof(float));
        else memset(S, 0, NN * sizeof(float));
        for (size_t t = 0; t < TT; t++) {
            if (t % WKV_CHUNK == 0) memcpy(cp + (t / WKV_CHUNK) * NN, S, NN * sizeof(float));
            size_t o = OFF(t);
            wkv7_step(S, r + o, w + o, k + o, v + o, a + o, b + o, NULL, N);
        }
        memset(dS, 0, NN * sizeof(float));
        for (size_t c = ncp; c-- > 0;) {
            size_t t0 = c * WKV_CHUNK, t1 = t0 + WKV_CHUNK < TT ? t0 + WKV_CHUNK : TT;
            /* buf[u] = state entering step t0+u, for u = 0..t1-t0 */
            memcpy(buf, cp + c * NN, NN * sizeof(float));
            for (size_t t = t0; t < t1; t++) {
                float *Sn = buf + (t - t0 + 1) * NN;
                memcpy(Sn, Sn - NN, NN * sizeof(float));
                size_t o = OFF(t);
                wkv7_step(Sn, r + o, w + o, k + o, v + o, a + o, b + o, NULL, N);
            }
            for (size_t t = t1; t-- > t0;) {
                size_t o = OFF(t);
                wkv7_step_back(buf + (t - t0) * NN, buf + (t - t0 + 1) * NN, dS, r + o, w + o,
                               k + o, v + o, a + o, b + o, dy + o, dr + o, dw + o, dk + o,
                               dv + o, da + o, db + o, N);
            }
        }
        if (dS_out) memcpy(dS_out + bh * NN, dS, NN * sizeof(float));
#undef OFF
    }
    free(scratch);
    return RX_OK;
}
