/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * rx_model.h -- the model's own struct, shared by the model's files
 * (model_layout.c, model.c, model_base.c, model_lora.c) and no one else:
 * everything below them reaches a model through its rx_ptmodel_* accessors.
 */
#ifndef RWKVX_MODEL_H
#define RWKVX_MODEL_H

#include "rx_internal.h"

#define RX_NAME_MAX 48   /* "blocks.<int>.tm.receptance_w" fits with room */

typedef struct {
    char name[RX_NAME_MAX];
    size_t off, n;       /* element offset into the arenas, element count */
    int ndim, shape[2];
    int init;
} rx_tensor;

struct rx_ptmodel {
    rx_pt_config cfg;
    int flags;                /* RX_PT_LN0 | ...: options beside the config */
    int n_blocks, n_tensors;
    char *layers;             /* [n_blocks+1] 'R' / 'A', NUL-terminated */
    int *block_idx;           /* [n_blocks] index within the RWKV or attention array */
    rx_tensor *tensors;       /* [n_tensors] in docs/layout.md §Parameters order */
    float *params, *grads;    /* the two arenas, [n_elems] each */
    size_t n_elems;
    const float *emb, *ln0_w, *ln0_b, *ln_out_w, *ln_out_b, *head;
    float *g_emb, *g_ln0_w, *g_ln0_b, *g_ln_out_w, *g_ln_out_b, *g_head;
    rx_block_params *rwkv;    /* [n_rwkv_layer], views into the arenas */
    rx_block_grads *rwkv_g;
    rx_attn_params *attn;     /* [n_attn_layer] */
    rx_attn_grads *attn_g;
    int precision;            /* RX_PRECISION_*: the projections' GEMM */
    /* trainable initial WKV states [n_rwkv_layer][H][N][N] and their grads
     * (rx_ptmodel_enable_state); NULL: every block starts from zero */
    float *state0, *g_state0;
    int64_t *frozen;          /* [n_frozen][2] arena ranges that get no weight grads */
    int n_frozen;
    rx_model_ctx ctx;         /* numeric settings every kernel reads (eps, ln0, l2wrap) */
    rx_lora *lora;            /* LoRA adapters (rx_ptmodel_enable_lora), NULL: none */
    rx_base *base;            /* the frozen base (base.c, model_base.c), NULL: none */
    int lora_on;              /* the forward and backward apply them (0 once disabled) */
};

#endif /* RWKVX_MODEL_H */
