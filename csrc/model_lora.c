/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * model_lora.c -- the model's LoRA adapters (rx_ptmodel_*lora*, rx_pretrain.h;
 * docs/maths.md §LoRA): which projections they sit on, enabling and
 * disabling them. The adapters' arenas and products are lora.c's.
 */
#include <string.h>

#include "rx_model.h"

/* tensor i is a projection an adapter may sit on: a block's time-mix or
 * attention receptance/key/value/output, or its channel-mix key/value */
static int adaptable(const rx_tensor *t) {
    static const char *const ends[] = {".receptance_w", ".key_w", ".value_w", ".output_w",
                                       ".ffn_key_w", ".ffn_value_w"};
    if (strncmp(t->name, "blocks.", 7) != 0 || t->ndim != 2) return 0;
    const size_t n = strlen(t->name);
    for (size_t e = 0; e < sizeof ends / sizeof ends[0]; e++) {
        const size_t k = strlen(ends[e]);
        if (n > k && strcmp(t->name + n - k, ends[e]) == 0) return 1;
    }
    return 0;
}

/* L holds r, alpha and one adapter (DoRA or not) on each of params [n], in that order */
static int same_adapters(const rx_lora *L, int r, double alpha, int dora, const int *params,
                         int n) {
    int lr;
    double la;
    if (rx_lora_count(L, &lr, &la) != n || lr != r || la != alpha) return 0;
    if ((rx_lora_magnitude(L, 0) >= 0) != (dora != 0)) return 0;
    for (int i = 0; i < n; i++) {
        int p;
        int64_t a, b;
        if (rx_lora_adapter(L, i, &p, &a, &b) != RX_OK || p != params[i]) return 0;
    }
    return 1;
}

static int enable(rx_ptmodel *m, int r, double alpha, int dora, const int *params, int n);

int rx_ptmodel_enable_lora(rx_ptmodel *m, int r, double alpha, const int *params, int n) {
    return enable(m, r, alpha, 0, params, n);
}

int rx_ptmodel_enable_dora(rx_ptmodel *m, int r, double alpha, const int *params, int n) {
    return enable(m, r, alpha, 1, params, n);
}

/* rx_ptmodel_enable_lora, the adapters DoRA's when dora */
static int enable(rx_ptmodel *m, int r, double alpha, int dora, const int *params, int n) {
    static const char *const fn = "rx_ptmodel_enable_lora";
    if (!m || !params) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, !m ? "model" : "params");
    if (m->lora) {
        /* a disabled model takes the very same adapters back, in their old
         * arena (a rollback across a LoRA run's base-unfreeze); anything
         * else would move the binding's views under its feet */
        if (!m->lora_on && same_adapters(m->lora, r, alpha, dora, params, n)) {
            m->lora_on = 1;
            return RX_OK;
        }
        return rx_fail(RX_EINVAL, "%s: the model has adapters already, or had others", fn);
    }
    if (r < 1 || n < 1) return rx_fail(RX_EINVAL, "%s: r = %d and n = %d must be >= 1", fn, r, n);
    if (!(alpha > 0.0) || isinf(alpha))
        return rx_fail(RX_EINVAL, "%s: alpha %g must be finite and > 0", fn, alpha);
    rx_lora_target *t = calloc((size_t)n, sizeof *t);
    if (!t) return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    int rc = RX_OK;
    for (int i = 0; i < n && rc == RX_OK; i++) {
        const int p = params[i];
        if (p < 0 || p >= m->n_tensors || !adaptable(&m->tensors[p])) {
            rc = rx_fail(RX_EINVAL, "%s: tensor %d (%s) is not a block's projection", fn, p,
                         p >= 0 && p < m->n_tensors ? m->tensors[p].name : "out of range");
            break;
        }
        for (int k = 0; k < i; k++)
            if (params[k] == p) rc = rx_fail(RX_EINVAL, "%s: tensor %d is named twice", fn, p);
        const rx_tensor *x = &m->tensors[p];
        t[i] = (rx_lora_target){m->params + x->off, m->grads + x->off, (size_t)x->shape[0],
                                (size_t)x->shape[1], p};
    }
    if (rc == RX_OK) rc = rx_lora_create(r, alpha, dora, t, n, &m->lora);
    m->lora_on = rc == RX_OK;
    free(t);
    return rc;
}

/* the arenas stay until the model is freed: a binding's views of them stay valid */
int rx_ptmodel_disable_lora(rx_ptmodel *m) {
    if (!m) return rx_fail(RX_EINVAL, "rx_ptmodel_disable_lora: model is NULL");
    m->lora_on = 0;
    return RX_OK;
}

int rx_ptmodel_lora_count(const rx_ptmodel *m, int *r, double *alpha) {
    return rx_lora_count(m && m->lora_on ? m->lora : NULL, r, alpha);
}

int rx_ptmodel_lora_adapter(const rx_ptmodel *m, int i, int *param, int64_t *a_off,
                            int64_t *b_off) {
    const int n = rx_ptmodel_lora_count(m, NULL, NULL);
    if (i < 0 || i >= n)
        return rx_fail(RX_EINVAL, "rx_ptmodel_lora_adapter: index %d is outside [0, %d)", i, n);
    return rx_lora_adapter(m->lora, i, param, a_off, b_off);
}

int rx_ptmodel_lora_magnitude(const rx_ptmodel *m, int i, int64_t *m_off) {
    const int n = rx_ptmodel_lora_count(m, NULL, NULL);
    if (i < 0 || i >= n)
        return rx_fail(RX_EINVAL, "rx_ptmodel_lora_magnitude: index %d is outside [0, %d)", i, n);
    if (m_off) *m_off = rx_lora_magnitude(m->lora, i);
    return RX_OK;
}

int rx_ptmodel_lora_norms(rx_ptmodel *m, int i, float *out) {
    const int n = rx_ptmodel_lora_count(m, NULL, NULL);
    if (i < 0 || i >= n || !out)
        return rx_fail(RX_EINVAL, "rx_ptmodel_lora_norms: index %d is outside [0, %d) or out "
                       "is NULL", i, n);
    if (m->base && !rx_base_loaded(m->base))
        return rx_fail(RX_EINVAL, "rx_ptmodel_lora_norms: the model's base is not filled");
    const int rc = rx_lora_prepare(m->lora, &rx_base_columns, m->base);
    return rc == RX_OK ? rx_lora_norms(m->lora, i, out) : rc;
}

float *rx_ptmodel_lora_arena(rx_ptmodel *m, int64_t *n) {
    return rx_lora_arena(m && m->lora_on ? m->lora : NULL, n);
}

float *rx_ptmodel_lora_grad_arena(rx_ptmodel *m, int64_t *n) {
    return rx_lora_grad_arena(m && m->lora_on ? m->lora : NULL, n);
}

const rx_lora *rx_ptmodel_lora_table(const rx_ptmodel *m) {
    return m && m->lora_on ? m->lora : NULL;
}
