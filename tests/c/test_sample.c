/* Sanitizer test of csrc/sample.c (rx_sample_rows): flat, peaked, tied and
 * banned rows of 7 and 3,001 ids under every cut -- each id drawn lies in
 * the row and carries weight (x finite; inside top_k), top_k 1 and
 * temperature 0 give the first largest x, the log-probability is the
 * double loop's log_softmax, a row alone gives the bits it gives in the
 * batch -- then non-finite rows (id -1) and bad arguments (RX_EINVAL).
 * Returns nonzero on failure. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "rx_pretrain.h"

enum { R = 6, VMAX = 3001 };

static float X[R * VMAX], RAW[R * VMAX];

static void fill(int V) {
    srand(7);
    for (int r = 0; r < R; r++)
        for (int i = 0; i < V; i++) {
            const float z = (float)rand() / (float)RAND_MAX * 2.0f - 1.0f;
            const float scale = r % 3 == 0 ? 0.3f : r % 3 == 1 ? 3.0f : 15.0f;
            RAW[r * V + i] = z * scale;
        }
    for (int i = 0; i < V / 2; i++) RAW[3 * V + i] = RAW[3 * V];   /* a tie across half */
    memcpy(X, RAW, sizeof(float) * (size_t)(R * V));
    for (int i = 0; i < V; i += 3) X[4 * V + i] = -INFINITY;       /* banned ids */
}

static size_t first_max(const float *x, int V) {
    size_t b = 0;
    for (int i = 1; i < V; i++)
        if (x[i] > x[b]) b = (size_t)i;
    return b;
}

static double log_softmax(const float *x, int V, int id) {
    double m = x[first_max(x, V)], s = 0.0;
    for (int i = 0; i < V; i++) s += exp((double)x[i] - m);
    return (double)x[id] - (log(s) + m);
}

/* how many ids of x are strictly likelier than id, or as likely with a smaller id */
static int rank_of(const float *x, int V, int id) {
    int n = 0;
    for (int i = 0; i < V; i++) n += x[i] > x[id] || (x[i] == x[id] && i < id);
    return n;
}

int main(void) {
    const double T[] = {0.0, 0.7, 1.0, 2.0}, P[] = {1.0, 0.9, 0.3, 0.0};
    const int K[] = {0, 1, 3, 40};
    double u[R];
    for (int r = 0; r < R; r++) u[r] = (r + 0.5) / R;
    int32_t ids[R], one;
    double lps[R], lp1;
    for (int vi = 0; vi < 2; vi++) {
        const int V = vi ? VMAX : 7;
        fill(V);
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < 4; b++)
                for (int c = 0; c < 4; c++) {
                    CHECK(rx_sample_rows(R, V, X, RAW, (size_t)V, u, T[a], P[b], K[c], ids, lps)
                              == RX_OK, "rx_sample_rows failed");
                    for (int r = 0; r < R; r++) {
                        const float *x = X + (size_t)r * V, *raw = RAW + (size_t)r * V;
                        const int id = ids[r];
                        CHECK(id >= 0 && id < V, "V %d row %d: id %d", V, r, id);
                        if (id < 0 || id >= V) continue;
                        CHECK(isfinite(x[id]), "V %d row %d: a banned id %d drawn", V, r, id);
                        if (T[a] == 0.0 || K[c] == 1 || P[b] == 0.0)
                            CHECK((size_t)id == first_max(x, V), "V %d row %d: not the argmax", V,
                                  r);
                        if (K[c] > 0 && K[c] < V)
                            CHECK(rank_of(x, V, id) < K[c], "V %d row %d: past top_k", V, r);
                        const double want = log_softmax(raw, V, id);
                        CHECK(fabs(lps[r] - want) <= 1e-12 * (1.0 + fabs(want)),
                              "V %d row %d: logprob %.17g, want %.17g", V, r, lps[r], want);
                        CHECK(rx_sample_rows(1, V, x, raw, (size_t)V, u + r, T[a], P[b], K[c],
                                             &one, &lp1) == RX_OK &&
                                  one == id && memcmp(&lp1, &lps[r], sizeof lp1) == 0,
                              "V %d row %d: alone it draws otherwise", V, r);
                    }
                }
    }
    /* a row with a NaN logit, and a row whose every id is banned: -1 */
    fill(7);
    RAW[7 + 2] = NAN;
    X[7 + 2] = NAN;
    for (int i = 0; i < 7; i++) X[2 * 7 + i] = -INFINITY;
    CHECK(rx_sample_rows(3, 7, X, RAW, 7, u, 1.0, 0.9, 0, ids, lps) == RX_OK, "bad rows failed");
    CHECK(ids[0] >= 0 && ids[1] == -1 && ids[2] == -1, "ids %d %d %d", ids[0], ids[1], ids[2]);
    /* bad arguments */
    fill(7);
    double bad_u = 1.0;
    CHECK(rx_sample_rows(1, 7, X, RAW, 7, &bad_u, 1.0, 1.0, 0, ids, lps) == RX_EINVAL, "u 1");
    CHECK(rx_sample_rows(1, 7, X, RAW, 7, u, NAN, 1.0, 0, ids, lps) == RX_EINVAL, "t NaN");
    CHECK(rx_sample_rows(1, 7, X, RAW, 7, u, 1.0, 1.5, 0, ids, lps) == RX_EINVAL, "top_p");
    CHECK(rx_sample_rows(1, 7, X, RAW, 7, u, 1.0, 1.0, -1, ids, lps) == RX_EINVAL, "top_k");
    CHECK(rx_sample_rows(1, 7, X, RAW, 6, u, 1.0, 1.0, 0, ids, lps) == RX_EINVAL, "ld");
    CHECK(rx_sample_rows(1, 0, X, RAW, 7, u, 1.0, 1.0, 0, ids, lps) == RX_EINVAL, "V 0");
    CHECK(rx_sample_rows(1, 7, NULL, RAW, 7, u, 1.0, 1.0, 0, ids, lps) == RX_EINVAL, "NULL");
    CHECK(rx_sample_rows(0, 7, X, RAW, 7, NULL, 1.0, 1.0, 0, NULL, NULL) == RX_OK, "R 0");
    return failures != 0;
}
