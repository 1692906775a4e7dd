/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * model_base.c -- the model's frozen base (rx_ptmodel_*base*, rx_pretrain.h;
 * docs/finetune.md §The frozen base): which tensors it holds, filling and
 * reading them, and the base-unfreeze. The store itself is base.c's.
 */
#include <ctype.h>

#include "rx_base.h"

/* a dtype's name as the messages spell it ("q8_0" -> "Q8_0") */
static const char *upper(const char *name, char *buf, size_t n) {
    size_t i = 0;
    for (; name[i] && i + 1 < n; i++) buf[i] = (char)toupper((unsigned char)name[i]);
    buf[i] = 0;
    return buf;
}

int rx_ptmodel_set_base(rx_ptmodel *m, int dtype, const int *params, int n) {
    static const char *const fn = "rx_ptmodel_set_base";
    if (!m || !params) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, !m ? "model" : "params");
    const rx_base_type *ty = rx_base_type_of(dtype);
    if (!ty) return rx_fail(RX_EINVAL, "%s: unknown dtype %d", fn, dtype);
    if (n < 1) return rx_fail(RX_EINVAL, "%s: n = %d must be >= 1", fn, n);
    if (rx_ptmodel_base_store(m)) return rx_fail(RX_EINVAL, "%s: the model has a base already", fn);
    const int nt = rx_ptmodel_num_params(m);
    /* in arena order: tensor indices ascending */
    char *pick = calloc((size_t)nt, 1);
    rx_base_target *t = calloc((size_t)n, sizeof *t);
    int rc = pick && t ? RX_OK : rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    for (int i = 0; i < n && rc == RX_OK; i++) {
        const int p = params[i];
        int shape[2] = {0, 0};
        const char *name = NULL;
        if (p < 0 || p >= nt) {
            rc = rx_fail(RX_EINVAL, "%s: tensor %d is outside [0, %d)", fn, p, nt);
        } else if (pick[p]) {
            rc = rx_fail(RX_EINVAL, "%s: tensor %d is named twice", fn, p);
        } else if (rx_ptmodel_param(m, p, &name, NULL, NULL, NULL) != RX_OK ||
                   rx_ptmodel_param_shape(m, p, shape) != 2) {
            rc = rx_fail(RX_EINVAL, "%s: tensor %d (%s) is not a matrix", fn, p,
                         name ? name : "?");
        } else if (shape[!strcmp(name, "emb")] % (int)ty->blk_elems) {
            char label[16];
            rc = rx_fail(RX_EINVAL, "%s: %s [%d, %d]: %s needs its %s size a multiple of "
                         "%d", fn, name, shape[0], shape[1], upper(ty->name, label, sizeof label),
                         strcmp(name, "emb") ? "input" : "row", (int)ty->blk_elems);
        }
        if (rc == RX_OK) pick[p] = 1;
    }
    int k = 0;
    for (int p = 0; p < nt && rc == RX_OK; p++) {
        if (!pick[p]) continue;
        float *W, *GW;
        int shape[2];
        const char *name;
        rx_ptmodel_param(m, p, &name, &W, &GW, NULL);
        rx_ptmodel_param_shape(m, p, shape);
        /* the embedding [V][C] is gathered by rows: stored as it is, rows of C */
        const int rows = !strcmp(name, "emb");
        t[k++] = (rx_base_target){W, GW, (size_t)shape[rows], (size_t)shape[!rows], p, rows};
    }
    rx_base *s = NULL;
    /* the bf16 GEMM's own layout when the model computes in bf16 */
    const int packed = rx_ptmodel_precision(m) == RX_PRECISION_BF16;
    if (rc == RX_OK) rc = rx_base_create(dtype, t, n, packed, &s);
    if (rc == RX_OK) rx_ptmodel_attach_base(m, s);
    free(pick);
    free(t);
    return rc;
}

/* the base tensor param of m, or NULL through rx_fail naming fn */
static const rx_base_mat *mat_of(const rx_ptmodel *m, int param, const char *fn) {
    const rx_base *s = m ? rx_ptmodel_base_store(m) : NULL;
    const rx_base_mat *b = rx_base_by_param(s, param);
    if (!b) rx_fail(RX_EINVAL, "%s: tensor %d is not in the model's base", fn, param);
    return b;
}

int rx_ptmodel_base_fill(rx_ptmodel *m, int param, const void *src, int kind, int transposed) {
    static const char *const fn = "rx_ptmodel_base_fill";
    const rx_base_mat *b = mat_of(m, param, fn);
    if (!b) return RX_EINVAL;
    rx_base *s = rx_ptmodel_base_store(m);
    const int own = kind == rx_base_dtype(s) && kind != RX_BASE_BF16;   /* stored rows */
    if (!src || (kind != RX_BASE_FP32 && kind != RX_BASE_BF16 && !own))
        return rx_fail(RX_EINVAL, "%s: src is NULL or kind %d unknown", fn, kind);
    if (own && !transposed && !b->rows)
        return rx_fail(RX_EINVAL, "%s: a block dtype's stored rows are W^T's (transposed)", fn);
    return rx_base_fill(s, (int)(b - rx_base_at(s, 0)), src, kind, transposed || b->rows);
}

int rx_ptmodel_base_read(const rx_ptmodel *m, int param, float *dst) {
    const rx_base_mat *b = mat_of(m, param, "rx_ptmodel_base_read");
    if (!b || !dst) return b ? rx_fail(RX_EINVAL, "rx_ptmodel_base_read: dst is NULL") : RX_EINVAL;
    rx_base_read(rx_ptmodel_base_store(m), b, dst);
    return RX_OK;
}

const void *rx_ptmodel_base_data(const rx_ptmodel *m, int param, int64_t *bytes) {
    const rx_base_mat *b = mat_of(m, param, "rx_ptmodel_base_data");
    size_t nb = 0;
    const void *p = b ? rx_base_data(b, &nb) : NULL;
    if (bytes) *bytes = (int64_t)nb;
    return p;
}

int rx_ptmodel_base_rows(const rx_ptmodel *m, int param, void *dst) {
    const rx_base_mat *b = mat_of(m, param, "rx_ptmodel_base_rows");
    if (!b || !dst) return b ? rx_fail(RX_EINVAL, "rx_ptmodel_base_rows: dst is NULL") : RX_EINVAL;
    rx_base_rows(b, dst);
    return RX_OK;
}

int rx_ptmodel_base_info(const rx_ptmodel *m, int *dtype, int *n, int64_t *bytes) {
    const rx_base *s = m ? rx_ptmodel_base_store(m) : NULL;
    if (dtype) *dtype = rx_base_dtype(s);
    if (n) *n = rx_base_count(s);
    if (bytes) *bytes = (int64_t)rx_base_bytes(s);
    return RX_OK;
}

int rx_ptmodel_base_param(const rx_ptmodel *m, int i) {
    const rx_base_mat *b = rx_base_at(m ? rx_ptmodel_base_store(m) : NULL, i);
    return b ? rx_base_param(b)
             : rx_fail(RX_EINVAL, "rx_ptmodel_base_param: index %d is outside the base", i);
}

int rx_ptmodel_base_release(rx_ptmodel *m) {
    if (!m) return rx_fail(RX_EINVAL, "rx_ptmodel_base_release: model is NULL");
    rx_base *s = rx_ptmodel_base_store(m);
    if (!s) return RX_OK;
    rx_base_materialise(s);
    rx_ptmodel_attach_base(m, NULL);
    rx_base_free(s);
    return RX_OK;
}
