/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * wkv7_simd.h -- the vectorised WKV7 steps of wkv7.c, written once for a
 * vector of WKV_W floats and included by wkv7.c once per width (AVX2: 8,
 * AVX-512: 16). The includer defines:
 *   WKV_W           lanes per vector; N must be a multiple of it
 *   WKV_T           the function target attribute
 *   WKV_FN(name)    the name of this width's copy of a function
 *   WKV_V           the vector type
 *   WKV_LOAD, WKV_STORE, WKV_FMA(a, b, c) = a*b + c, WKV_MUL, WKV_ADD,
 *   WKV_ZERO(), WKV_BCAST(const float *)
 *   WKV_HSUM4(a0, a1, a2, a3)  an __m128 whose lane q is the sum of a_q
 *   WKV_HSUM1(a)    the sum of a's lanes
 *   WKV_JU          column vectors per pass of the backward's column sums
 *                   (1 or 2: each holds eight vectors in registers; 16 ymm
 *                   registers fit one, 32 zmm two)
 * and WKV_BACK_ROWS. No include guard: it is meant to be included twice.
 * What each step computes, and why in this order, is wkv7.c's header.
 */

/* sa [R] = rows of S [R][N] dotted with a [N], N % WKV_W == 0, R % 4 == 0:
 * a step's sa, from the state it starts from. Every function here works on
 * R rows of a head's N (all of them, or one row tile of a split head,
 * wkv7.c): the row-indexed arguments (S, v, y, sa, dy, ...) point at the
 * first of them, the column-indexed ones (r, w, k, a, b, the column sums)
 * are whole. */
WKV_T static inline __attribute__((always_inline)) void
WKV_FN(rowdots_body)(const float *S, const float *a, float *sa, size_t R, size_t N) {
    for (size_t i = 0; i < R; i += 4) {
        const float *s0 = S + i * N, *s1 = s0 + N, *s2 = s1 + N, *s3 = s2 + N;
        WKV_V c0 = WKV_ZERO(), c1 = c0, c2 = c0, c3 = c0;
        for (size_t j = 0; j < N; j += WKV_W) {
            WKV_V av = WKV_LOAD(a + j);
            c0 = WKV_FMA(WKV_LOAD(s0 + j), av, c0);
            c1 = WKV_FMA(WKV_LOAD(s1 + j), av, c1);
            c2 = WKV_FMA(WKV_LOAD(s2 + j), av, c2);
            c3 = WKV_FMA(WKV_LOAD(s3 + j), av, c3);
        }
        _mm_storeu_ps(sa + i, WKV_HSUM4(c0, c1, c2, c3));
    }
}

/* rowdots_body for the first step of a run (the later ones get their sa
 * from WKV_FN(step)). */
WKV_T static void WKV_FN(rowdots)(const float *S, const float *a, float *sa, size_t R,
                                  size_t N) {
    WKV_FN(rowdots_body)(S, a, sa, R, N);
}

/* wkv7_step for N % WKV_W == 0, reading the state from Si and writing it to So
 * (the same buffer or another one, so a recomputed chunk needs no copies),
 * with this step's sa [N] given; y [N] may be NULL. Then, for the next
 * step's a (an, NULL: last step), the next step's sa (san [N]). Four rows at
 * a time, their y row sums reduced together (one horizontal add tree per
 * four rows); all rows are updated before any next sa is summed, so the
 * sums pipeline instead of each waiting on its row's update. Always inlined
 * so NULL y or an compile their work away. */
WKV_T static inline __attribute__((always_inline)) void
WKV_FN(step_body)(const float *Si, float *So, const float *r, const float *w, const float *k,
          const float *v, const float *b, const float *sa, const float *an, float *y,
          float *san, size_t R, size_t N) {
    for (size_t i = 0; i < R; i += 4) {
        const float *s0 = Si + i * N, *s1 = s0 + N, *s2 = s1 + N, *s3 = s2 + N;
        float *o0 = So + i * N, *o1 = o0 + N, *o2 = o1 + N, *o3 = o2 + N;
        WKV_V sa0 = WKV_BCAST(sa + i), sa1 = WKV_BCAST(sa + i + 1);
        WKV_V sa2 = WKV_BCAST(sa + i + 2), sa3 = WKV_BCAST(sa + i + 3);
        WKV_V v0 = WKV_BCAST(v + i), v1 = WKV_BCAST(v + i + 1);
        WKV_V v2 = WKV_BCAST(v + i + 2), v3 = WKV_BCAST(v + i + 3);
        WKV_V y0 = WKV_ZERO(), y1 = y0, y2 = y0, y3 = y0;
        for (size_t j = 0; j < N; j += WKV_W) {
            WKV_V wv = WKV_LOAD(w + j), kv = WKV_LOAD(k + j);
            WKV_V bv = WKV_LOAD(b + j), t;
#define ROW(s_, o_, v_, sa_, y_)                                                        \
    t = WKV_FMA(WKV_LOAD(s_ + j), wv,                                    \
                        WKV_FMA(v_, kv, WKV_MUL(sa_, bv)));               \
    WKV_STORE(o_ + j, t);                                                        \
    if (y) y_ = WKV_FMA(t, WKV_LOAD(r + j), y_);
            ROW(s0, o0, v0, sa0, y0)
            ROW(s1, o1, v1, sa1, y1)
            ROW(s2, o2, v2, sa2, y2)
            ROW(s3, o3, v3, sa3, y3)
#undef ROW
        }
        if (y) _mm_storeu_ps(y + i, WKV_HSUM4(y0, y1, y2, y3));
    }
    if (an) WKV_FN(rowdots_body)(So, an, san, R, N);
}

/* WKV_FN(step_body) with each combination of y and an compiled on its own, and
 * for N = 64 (every reference configuration's head size) with N a
 * constant: the row offsets become immediates, which frees the general
 * registers the loops otherwise spill their row pointers from. */
WKV_T static void WKV_FN(step)(const float *Si, float *So, const float *r, const float *w,
                                  const float *k, const float *v, const float *b,
                                  const float *sa, const float *an, float *y, float *san,
                                  size_t R, size_t N) {
#define STEP(N_)                                                                        \
    if (y && an) WKV_FN(step_body)(Si, So, r, w, k, v, b, sa, an, y, san, R, N_);       \
    else if (y) WKV_FN(step_body)(Si, So, r, w, k, v, b, sa, NULL, y, NULL, R, N_);     \
    else if (an) WKV_FN(step_body)(Si, So, NULL, w, k, v, b, sa, an, NULL, san, R, N_); \
    else WKV_FN(step_body)(Si, So, NULL, w, k, v, b, sa, NULL, NULL, NULL, R, N_);
    if (N == 64) {
        STEP(64)
    } else {
        STEP(N)
    }
#undef STEP
}

/* out [N] = x [R] . S [R][N] (sums over rows), N % WKV_W == 0: the dr of a
 * sequence's last step, the only one no later step computes. Summed per
 * tile of WKV_BACK_ROWS rows, each tile's sum added to the earlier ones, as
 * WKV_FN(step_back) sums its columns, so a split head's tile sums add up to
 * the same bits. */
WKV_T static void WKV_FN(coldots)(const float *S, const float *x, float *out, size_t R,
                                  size_t N) {
    for (size_t i0 = 0; i0 < R; i0 += WKV_BACK_ROWS) {
        size_t i1 = i0 + WKV_BACK_ROWS < R ? i0 + WKV_BACK_ROWS : R;
        for (size_t j = 0; j < N; j += WKV_W) {
            WKV_V c = WKV_ZERO();
            for (size_t i = i0; i < i1; i++)
                c = WKV_FMA(WKV_BCAST(x + i), WKV_LOAD(S + i * N + j), c);
            WKV_STORE(out + j, i0 > 0 ? WKV_ADD(c, WKV_LOAD(out + j)) : c);
        }
    }
}

/* The backward's column pass over rows [i0, i1) and the nu (<= 2) vectors
 * of columns from j: the five column sums dr (of the previous step), dw,
 * dk, db, da in registers, added to the sums of the earlier row tiles
 * (i0 > 0), and dS rewritten as the grad on S0. nu vectors at once give
 * each row 5*nu independent sums: with nu = 1 the sums' FMA latency, one
 * row after another, set the pace. Each sum adds its rows in the same
 * order whatever nu is. */
WKV_T static inline __attribute__((always_inline)) void
WKV_FN(col_block)(const float *S0, float *dS, const float *r, const float *w, const float *v,
                  const float *a, const float *dy, const float *dyp, const float *sa,
                  const float *dsa, float *drp, float *dw, float *dk, float *da, float *db,
                  size_t i0, size_t i1, size_t j, size_t N, const int nu) {
    WKV_V rv[2], wv[2], av[2], cr[2], cw[2], ck[2], cb[2], ca[2];
    for (int u = 0; u < nu; u++) {
        rv[u] = WKV_LOAD(r + j + u * WKV_W);
        wv[u] = WKV_LOAD(w + j + u * WKV_W);
        av[u] = WKV_LOAD(a + j + u * WKV_W);
        cr[u] = cw[u] = ck[u] = cb[u] = ca[u] = WKV_ZERO();
    }
    for (size_t i = i0; i < i1; i++) {
        const WKV_V dyi = WKV_BCAST(dy + i), dsai = WKV_BCAST(dsa + i);
        const WKV_V dypi = WKV_BCAST(dyp + i), vi = WKV_BCAST(v + i), sai = WKV_BCAST(sa + i);
        for (int u = 0; u < nu; u++) {
            const size_t o = i * N + j + u * WKV_W;
            WKV_V g = WKV_FMA(dyi, rv[u], WKV_LOAD(dS + o));
            WKV_V s0 = WKV_LOAD(S0 + o);
            cr[u] = WKV_FMA(dypi, s0, cr[u]);
            cw[u] = WKV_FMA(g, s0, cw[u]);
            ck[u] = WKV_FMA(vi, g, ck[u]);
            cb[u] = WKV_FMA(sai, g, cb[u]);
            ca[u] = WKV_FMA(dsai, s0, ca[u]);
            WKV_STORE(dS + o, WKV_FMA(g, wv[u], WKV_MUL(dsai, av[u])));
        }
    }
    for (int u = 0; u < nu; u++) {
        const size_t c = j + u * WKV_W;
        if (i0 > 0) {
            cr[u] = WKV_ADD(cr[u], WKV_LOAD(drp + c));
            cw[u] = WKV_ADD(cw[u], WKV_LOAD(dw + c));
            ck[u] = WKV_ADD(ck[u], WKV_LOAD(dk + c));
            cb[u] = WKV_ADD(cb[u], WKV_LOAD(db + c));
            ca[u] = WKV_ADD(ca[u], WKV_LOAD(da + c));
        }
        WKV_STORE(drp + c, cr[u]);
        WKV_STORE(dw + c, cw[u]);
        WKV_STORE(dk + c, ck[u]);
        WKV_STORE(db + c, cb[u]);
        WKV_STORE(da + c, ca[u]);
    }
}

/* wkv7_step_back for N % WKV_W == 0 (through WKV_FN(step_back)), with this step's
 * sa [N] from the forward and dsa [N] as scratch. Reads only the state
 * before the step, S0: the dr it would need the state after the step for
 * is the previous step's, drp = dyp . S0 (dyp = dy of step t-1; zero at a
 * sequence's first step). */
WKV_T static inline __attribute__((always_inline)) void
WKV_FN(step_back_body)(const float *S0, float *dS, const float *r, const float *w, const float *k,
               const float *v, const float *a, const float *b, const float *dy,
               const float *dyp, const float *sa, float *dsa, float *drp, float *dw, float *dk,
               float *dv, float *da, float *db, size_t R, size_t N) {
    WKV_V x = WKV_ZERO(), z = x;
    for (size_t j = 0; j < N; j += WKV_W) {
        WKV_V rv = WKV_LOAD(r + j);
        x = WKV_FMA(rv, WKV_LOAD(k + j), x);
        z = WKV_FMA(rv, WKV_LOAD(b + j), z);
    }
    const __m128 rk = _mm_set1_ps(WKV_HSUM1(x)), rb = _mm_set1_ps(WKV_HSUM1(z));
    /* row sums of g = dS + dy r^T against k and b; meanwhile S0, which the
     * column pass reads next, comes in from L2 */
    for (size_t i = 0; i < R; i += 4) {
        const float *g0 = dS + i * N, *g1 = g0 + N, *g2 = g1 + N, *g3 = g2 + N;
        WKV_V p0 = WKV_ZERO(), p1 = p0, p2 = p0, p3 = p0;
        WKV_V q0 = p0, q1 = p0, q2 = p0, q3 = p0;
        for (size_t j = 0; j < N; j += 16) __builtin_prefetch(S0 + i * N + j);
        for (size_t j = 0; j < N; j += WKV_W) {
            WKV_V kv = WKV_LOAD(k + j), bv = WKV_LOAD(b + j), t;
            t = WKV_LOAD(g0 + j); p0 = WKV_FMA(t, kv, p0); q0 = WKV_FMA(t, bv, q0);
            t = WKV_LOAD(g1 + j); p1 = WKV_FMA(t, kv, p1); q1 = WKV_FMA(t, bv, q1);
            t = WKV_LOAD(g2 + j); p2 = WKV_FMA(t, kv, p2); q2 = WKV_FMA(t, bv, q2);
            t = WKV_LOAD(g3 + j); p3 = WKV_FMA(t, kv, p3); q3 = WKV_FMA(t, bv, q3);
        }
        __m128 dyi = _mm_loadu_ps(dy + i);
        _mm_storeu_ps(dv + i, _mm_fmadd_ps(dyi, rk, WKV_HSUM4(p0, p1, p2, p3)));
        _mm_storeu_ps(dsa + i, _mm_fmadd_ps(dyi, rb, WKV_HSUM4(q0, q1, q2, q3)));
    }
    /* column sums over tiles of WKV_BACK_ROWS rows x WKV_JU vectors of
     * columns, the five sums in registers; dS rewritten as the grad on S0 */
    for (size_t i0 = 0; i0 < R; i0 += WKV_BACK_ROWS) {
        size_t i1 = i0 + WKV_BACK_ROWS < R ? i0 + WKV_BACK_ROWS : R, j = 0;
        for (; j + WKV_JU * WKV_W <= N; j += WKV_JU * WKV_W)
            WKV_FN(col_block)(S0, dS, r, w, v, a, dy, dyp, sa, dsa, drp, dw, dk, da, db, i0, i1,
                              j, N, WKV_JU);
        for (; j < N; j += WKV_W)
            WKV_FN(col_block)(S0, dS, r, w, v, a, dy, dyp, sa, dsa, drp, dw, dk, da, db, i0, i1,
                              j, N, 1);
    }
}

/* WKV_FN(step_back_body), with N a constant for N = 64 as in WKV_FN(step). */
WKV_T static void WKV_FN(step_back)(const float *S0, float *dS, const float *r, const float *w,
                                   const float *k, const float *v, const float *a,
                                   const float *b, const float *dy, const float *dyp,
                                   const float *sa, float *dsa, float *drp, float *dw,
                                   float *dk, float *dv, float *da, float *db, size_t R,
                                   size_t N) {
    if (N == 64)
        WKV_FN(step_back_body)(S0, dS, r, w, k, v, a, b, dy, dyp, sa, dsa, drp, dw, dk, dv, da,
                               db, R, 64);
    else
        WKV_FN(step_back_body)(S0, dS, r, w, k, v, a, b, dy, dyp, sa, dsa, drp, dw, dk, dv, da,
                               db, R, N);
}

