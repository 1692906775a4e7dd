/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * base_types.c -- the frozen-base dtypes: one row each, the only place the
 * store, the GEMMs' packers and the binding learn what a dtype is (its
 * name, block geometry and kernels, rx_base.h's rx_base_type). A new dtype
 * is a base_<dtype>.c of kernels, an RX_BASE_* id in rx_pretrain.h and one
 * row here (docs/architecture.md, "a new frozen-base dtype").
 */
#include "rx_base.h"

/*   name    id            block: values, bytes          bf16_exact
 *   from_float, from_bf16, decode, sliver_f32, block_bf16, small_f32 */
static const rx_base_type types[] = {
    {"bf16", RX_BASE_BF16, 1, 2, 1,
     rx_bf16_from_float, rx_bf16_from_bf16, rx_bf16_decode, rx_bf16_sliver_f32,
     rx_bf16_block_bf16, rx_bf16_small_f32},
    {"q8_0", RX_BASE_Q8_0, RX_Q8_0_BLOCK, RX_Q8_0_BYTES, 0,
     rx_q8_0_from_float, NULL, rx_q8_0_decode, rx_q8_0_sliver_f32,
     rx_q8_0_block_bf16, rx_q8_0_small_f32, rx_q8_0_rows_bf16},
    {"q4_0", RX_BASE_Q4_0, RX_Q4_0_BLOCK, RX_Q4_0_BYTES, 0,
     rx_q4_0_from_float, NULL, rx_q4_0_decode, rx_q4_0_sliver_f32,
     rx_q4_0_block_bf16, rx_q4_0_small_f32, rx_q4_0_rows_bf16},
    {"nf4", RX_BASE_NF4, RX_NF4_BLOCK, RX_NF4_BYTES, 0,
     rx_nf4_from_float, NULL, rx_nf4_decode, NULL, NULL, NULL},
    {"q4_k", RX_BASE_Q4_K, RX_Q4_K_BLOCK, RX_Q4_K_BYTES, 0,
     rx_q4_k_from_float, NULL, rx_q4_k_decode, NULL, rx_q4_k_block_bf16, rx_q4_k_small_f32,
     rx_q4_k_rows_bf16},
};
#define N_TYPES ((int)(sizeof types / sizeof types[0]))

const rx_base_type *rx_base_type_of(int id) {
    for (int i = 0; i < N_TYPES; i++)
        if (types[i].id == id) return &types[i];
    return NULL;
}

int rx_base_num_dtypes(void) { return N_TYPES; }

int rx_base_dtype_info(int i, const char **name, int *id, int *block_elems, int *block_bytes) {
    if (i < 0 || i >= N_TYPES)
        return rx_fail(RX_EINVAL, "rx_base_dtype_info: index %d is outside [0, %d)", i, N_TYPES);
    if (name) *name = types[i].name;
    if (id) *id = types[i].id;
    if (block_elems) *block_elems = (int)types[i].blk_elems;
    if (block_bytes) *block_bytes = (int)types[i].blk_bytes;
    return RX_OK;
}

/* the dtype's row of n values, or NULL (the error set) */
static const rx_base_type *row_type(int dtype, size_t n, const char *who) {
    const rx_base_type *ty = rx_base_type_of(dtype);
    if (!ty || n % ty->blk_elems) {
        rx_fail(RX_EINVAL, "%s: dtype %d, n %zu: not a dtype, or n not whole blocks", who,
                dtype, n);
        return NULL;
    }
    return ty;
}

int rx_base_quantize(int dtype, const float *x, size_t n, void *dst) {
    const rx_base_type *ty = row_type(dtype, n, "rx_base_quantize");
    if (!ty) return RX_EINVAL;
    ty->from_float(x, n, dst);
    return RX_OK;
}

int rx_base_dequantize(int dtype, const void *src, size_t n, float *dst) {
    const rx_base_type *ty = row_type(dtype, n, "rx_base_dequantize");
    if (!ty) return RX_EINVAL;
    ty->decode(src, 0, n, dst);
    return RX_OK;
}
