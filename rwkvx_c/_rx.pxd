# Cython declarations of every C function, struct and constant the binding uses:
# the C API of csrc/rx_pretrain.h (docs/ is the contract), then the internal
# kernels of csrc/rx_internal.h that tests and benchmarks reach, then the
# tokenizer's csrc/rx_tokenize.h. The .pxi files declare nothing of C.
# The header's legacy section (the NULL / NaN / void forms) is left out: the
# binding calls only the int-returning forms, which carry the RX_* code that
# _check_rc turns into an exception.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

cdef extern from "rx_pretrain.h" nogil:
    int RX_OK
    int RX_ENOMEM
    int RX_EINVAL
    int RX_ECONFIG
    const char *rx_last_error()
    const char *rx_strerror(int code)

    int rx_wkv7_forward_seq(const float *r, const float *w, const float *k, const float *v,
                            const float *a, const float *b, const float *s_init,
                            float *y_out, float *s_final, int B, int T, int n_head, int head_size)
    int rx_wkv7_backward(const float *r, const float *w, const float *k, const float *v,
                         const float *a, const float *b, const float *dy, const float *s_init,
                         float *dr, float *dw, float *dk, float *dv, float *da, float *db,
                         float *dS_out, int B, int T, int n_head, int head_size)

    # The time-mix pointers are set by offset from rx_tm_field's table
    # (_rwkv.pxi), so only the sizes are declared here; the C compiler sees
    # the whole structs.
    ctypedef struct rx_tm_params:
        int c
        int n_head, head_size
        int Dw, Da, Dg, Dv
        int layer_id

    ctypedef struct rx_tm_grads:
        pass

    int rx_tm_num_fields()
    int rx_tm_field(int i, const char **name, size_t *p_off, size_t *g_off, const char **dims,
                    int *at_layer0)

    int rx_timemix_forward_seq(const rx_tm_params *P, const float *x, const float *x_prev_init,
                               float *v_first, float *out, int B, int T)
    int rx_timemix_backward(const rx_tm_params *P, const float *x, const float *x_prev_init,
                            const float *v_first, const float *dy, rx_tm_grads *G, float *dx,
                            float *d_xprev_init, float *d_v_first, int B, int T)

    ctypedef struct rx_cm_params:
        int c
        int ffn_dim
        const float *ffn_x_k
        const float *ffn_key_w
        const float *ffn_value_w

    ctypedef struct rx_cm_grads:
        float *ffn_x_k
        float *ffn_key_w
        float *ffn_value_w

    int rx_channelmix_forward_seq(const rx_cm_params *P, const float *x, const float *x_prev_init,
                                  float *out, int B, int T)
    int rx_channelmix_backward(const rx_cm_params *P, const float *x, const float *x_prev_init,
                               const float *dy, rx_cm_grads *G, float *dx, float *d_xprev_init,
                               int B, int T)

    int rx_layernorm_forward_seq(const float *x, const float *w, const float *b, float *out,
                                 int B, int T, int C)
    int rx_layernorm_backward(const float *x, const float *w, const float *b, const float *dy,
                              float *dx, float *dw, float *db, int B, int T, int C)

    ctypedef struct rx_block_params:
        rx_tm_params tm
        rx_cm_params cm
        const float *ln1_w
        const float *ln1_b
        const float *ln2_w
        const float *ln2_b

    ctypedef struct rx_block_grads:
        rx_tm_grads tm
        rx_cm_grads cm
        float *ln1_w
        float *ln1_b
        float *ln2_w
        float *ln2_b

    int rx_block_forward_seq(const rx_block_params *P, const float *x, const float *tm_xprev_init,
                             const float *cm_xprev_init, float *v_first, float *out, int B, int T)
    int rx_block_backward(const rx_block_params *P, const float *x, const float *tm_xprev_init,
                          const float *cm_xprev_init, const float *v_first, const float *dy,
                          rx_block_grads *G, float *dx, float *d_tm_xprev_init,
                          float *d_cm_xprev_init, float *d_v_first, int B, int T)

    ctypedef struct rx_attn_params:
        int c
        int n_head, head_size
        int chunk_size
        int moba_top_k
        const float *ln1_w
        const float *ln1_b
        const float *receptance_w
        const float *key_w
        const float *value_w
        const float *output_w
        const float *ln2_w
        const float *ln2_b
        rx_cm_params cm

    ctypedef struct rx_attn_grads:
        float *ln1_w
        float *ln1_b
        float *receptance_w
        float *key_w
        float *value_w
        float *output_w
        float *ln2_w
        float *ln2_b
        rx_cm_grads cm

    int rx_attn_forward_seq(const rx_attn_params *P, const float *x, const float *cm_xprev_init,
                            float *out, int B, int T)
    int rx_attn_backward_full(const rx_attn_params *P, const float *x, const float *cm_xprev_init,
                              const float *dy, rx_attn_grads *G, float *dx,
                              float *d_cm_xprev_init, int B, int T)
    int rx_attn_score_av_forward(const rx_attn_params *P, const float *q, const float *k,
                                 const float *v, int B, int T, float *p, float *y)
    int rx_attn_score_av_backward(const rx_attn_params *P, const float *q, const float *k,
                                  const float *v, const float *dy, int B, int T,
                                  float *dq, float *dk, float *dv)

    int rx_embedding_gather(const float *emb, const int *tokens, int T, int C, int vocab,
                            float *out)
    int rx_embedding_scatter(const int *tokens, int T, int C, int vocab,
                             const float *d_out, float *d_emb)
    int rx_head_logits(const float *x, const float *head, int T, int C, int vocab,
                       float *logits)
    int rx_head_grads(const float *x, const float *head, const float *dlogits,
                      int T, int C, int vocab, float *dx, float *d_head)
    int rx_cross_entropy(const float *logits, const int *targets, int T, int vocab,
                         int ignore_index, float *dlogits, double *loss)

    ctypedef struct rx_pt_config:
        int n_embd, n_head, head_size
        int n_rwkv_layer, n_attn_layer
        int vocab_size
        int Dw, Da, Dg, Dv
        int ffn_dim
        int chunk_size, moba_top_k

    ctypedef struct rx_ptmodel:
        pass

    int rx_model_create(const rx_pt_config *pc, int flags, uint64_t seed, rx_ptmodel **out)
    void rx_ptmodel_free(rx_ptmodel *m)
    int rx_ptmodel_num_params(const rx_ptmodel *m)
    int rx_ptmodel_param(rx_ptmodel *m, int i, const char **name, float **data, float **grad,
                         int *n)
    rx_pt_config rx_ptmodel_config(const rx_ptmodel *m)
    const rx_block_params* rx_ptmodel_rwkv(rx_ptmodel *m, int idx)
    const rx_attn_params* rx_ptmodel_attn(rx_ptmodel *m, int idx)

    ctypedef struct rx_pt_acts:
        int T, C, vocab, n_blocks
        int *tokens
        float *block_in
        float *v_first
        float *lnout
        float *logits
        int B
        int ready
        float *dlogits
        float *work
        void *saved
        int flags
        int head_rows
        int group

    int rx_pt_acts_create(const rx_ptmodel *m, int B, int T, rx_pt_acts **out)
    void rx_pt_acts_free(rx_pt_acts *a)
    int rx_pretrain_forward(rx_ptmodel *m, const int *tokens, int T, rx_pt_acts *acts)
    int rx_pretrain_backward_loss(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets,
                                  int B, int T, int ignore_index, double *loss)
    void rx_ptmodel_zero_grad(rx_ptmodel *m)
    int RX_ACTS_RECOMPUTE, RX_ACTS_CHUNKED_HEAD
    int rx_pt_acts_create_opts(const rx_ptmodel *m, int B, int T, int flags, int head_rows,
                               rx_pt_acts **out)
    int rx_pt_acts_create_groups(const rx_ptmodel *m, int B, int T, int flags, int head_rows,
                                 int group, rx_pt_acts **out)
    size_t rx_pt_acts_group_floats(const rx_ptmodel *m, int B, int T, int group)
    int rx_ptmodel_groups_exact(const rx_ptmodel *m)
    int rx_pretrain_loss(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets, int B,
                         int T, int ignore_index, double *loss)
    int rx_pretrain_row_losses(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets,
                               int B, int T, int ignore_index, double *row_loss)
    int rx_pretrain_backward_rows(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets,
                                  int B, int T, int ignore_index, const double *weight,
                                  double *row_loss)
    int rx_pretrain_row_losses_temp(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets,
                                    int B, int T, int ignore_index, double temperature,
                                    double *row_loss)
    int rx_pretrain_backward_rows_temp(rx_ptmodel *m, const rx_pt_acts *acts,
                                       const int *targets, int B, int T, int ignore_index,
                                       double temperature, const double *weight,
                                       double *row_loss)
    int rx_ptmodel_set_l2wrap(rx_ptmodel *m, double factor)
    double rx_ptmodel_l2wrap(const rx_ptmodel *m)
    int rx_head_loss(const float *x, const float *head, const int *targets, int T, int C,
                     int vocab, int ignore_index, double l2wrap, int rows, float *scratch,
                     float *dx, float *d_head, double *loss)
    int rx_head_chunk_rows(int vocab, int budget_floats)

    enum: RX_MAX_THREADS
    void rx_set_num_threads(int n)
    int rx_get_num_threads()
    int rx_has_openmp()
    const char *rx_sgemm_kernel()
    const char *rx_bgemm_kernel()
    int rx_bgemm_hw()
    int rx_bgemm_pays()
    int RX_PRECISION_FP32, RX_PRECISION_BF16
    int rx_ptmodel_set_precision(rx_ptmodel *m, int precision)
    int rx_ptmodel_precision(const rx_ptmodel *m)
    void rx_profile_enable(int on)
    int rx_profile_read(double *seconds, int n)
    const char *rx_profile_name(int i)

    # the whole model beyond the above: batches, state tuning, freezing, LoRA, the context
    int rx_pretrain_forward_batch(rx_ptmodel *m, const int *tokens, int B, int T,
                                  rx_pt_acts *acts)
    int rx_pt_config_validate(const rx_pt_config *pc)
    int rx_ptmodel_param_shape(const rx_ptmodel *m, int i, int *shape)
    float *rx_ptmodel_param_arena(rx_ptmodel *m, int64_t *n)
    float *rx_ptmodel_grad_arena(rx_ptmodel *m, int64_t *n)
    const char *rx_ptmodel_layers(const rx_ptmodel *m)
    int rx_ptmodel_enable_state(rx_ptmodel *m)
    float *rx_ptmodel_state_arena(rx_ptmodel *m, int64_t *n)
    float *rx_ptmodel_state_grad_arena(rx_ptmodel *m, int64_t *n)
    int rx_ptmodel_set_frozen(rx_ptmodel *m, int frozen)
    int rx_ptmodel_set_frozen_ranges(rx_ptmodel *m, const int64_t *ranges, int n)
    int rx_ptmodel_frozen(const rx_ptmodel *m)
    int rx_ptmodel_flags(const rx_ptmodel *m)
    int rx_ptmodel_enable_lora(rx_ptmodel *m, int r, double alpha, const int *params, int n)
    int rx_ptmodel_disable_lora(rx_ptmodel *m)
    int rx_ptmodel_lora_count(const rx_ptmodel *m, int *r, double *alpha)
    int rx_ptmodel_lora_adapter(const rx_ptmodel *m, int i, int *param, int64_t *a_off,
                                int64_t *b_off)
    float *rx_ptmodel_lora_arena(rx_ptmodel *m, int64_t *n)
    float *rx_ptmodel_lora_grad_arena(rx_ptmodel *m, int64_t *n)
    int rx_ptmodel_enable_dora(rx_ptmodel *m, int r, double alpha, const int *params, int n)
    int rx_ptmodel_lora_magnitude(const rx_ptmodel *m, int i, int64_t *m_off)
    int rx_ptmodel_lora_norms(rx_ptmodel *m, int i, float *out)
    # the frozen base (csrc/base.c): matrices held as bf16 or Q8_0
    int rx_ptmodel_set_base(rx_ptmodel *m, int dtype, const int *params, int n)
    int rx_ptmodel_base_fill(rx_ptmodel *m, int param, const void *src, int kind,
                             int transposed)
    int rx_ptmodel_base_read(const rx_ptmodel *m, int param, float *dst)
    const void *rx_ptmodel_base_data(const rx_ptmodel *m, int param, int64_t *bytes)
    int rx_ptmodel_base_rows(const rx_ptmodel *m, int param, void *dst)
    int rx_ptmodel_base_info(const rx_ptmodel *m, int *dtype, int *n, int64_t *bytes)
    int rx_ptmodel_base_param(const rx_ptmodel *m, int i)
    int rx_ptmodel_base_release(rx_ptmodel *m)
    int rx_base_num_dtypes()
    int rx_base_dtype_info(int i, const char **name, int *id, int *block_elems, int *block_bytes)
    int rx_base_quantize(int dtype, const float *x, size_t n, void *dst)
    int rx_base_dequantize(int dtype, const void *src, size_t n, float *dst)
    int RX_PT_LN0
    int RX_PT_NO_INIT
    int RX_PT_DENSE
    int RX_BASE_NONE
    int RX_BASE_BF16
    int RX_BASE_Q8_0

    ctypedef struct rx_model_ctx:
        double ln_eps
        double gn_eps
        int ln0
        double l2wrap
    double RX_DEFAULT_LN_EPS, RX_DEFAULT_GN_EPS, RX_DEFAULT_L2WRAP
    float RX_KK_FLOOR
    int RX_DEFAULT_LN0
    void rx_model_ctx_default(rx_model_ctx *ctx)
    int rx_model_ctx_validate(const rx_model_ctx *ctx)
    int rx_model_create_ctx(const rx_pt_config *pc, const rx_model_ctx *ctx, int flags,
                            uint64_t seed, rx_ptmodel **out)
    int rx_ptmodel_ctx(const rx_ptmodel *m, rx_model_ctx *out)

    # recurrent inference (csrc/infer.c)
    ctypedef struct rx_infer_state:
        pass
    int rx_infer_create(rx_ptmodel *m, int max_len, rx_infer_state **out)
    void rx_infer_free(rx_infer_state *s)
    void rx_infer_reset(rx_infer_state *s)
    int rx_infer_pos(const rx_infer_state *s)
    int rx_infer_forward(rx_infer_state *s, const int *tokens, int T, float *logits)

    # batched generation (csrc/gen.c)
    ctypedef struct rx_gen:
        pass
    int rx_gen_create(rx_ptmodel *m, int n_slots, int max_len, int max_tokens, rx_gen **out)
    void rx_gen_free(rx_gen *g)
    int rx_gen_reset(rx_gen *g, int slot)
    int rx_gen_copy(rx_gen *g, int dst, int src)
    int rx_gen_pos(const rx_gen *g, int slot)
    int rx_gen_step(rx_gen *g, int n, const int *slots, const int *counts, const int *tokens,
                    int all, float *logits)
    int rx_gen_set_fast(rx_gen *g, int on)

    # drawing each row's next token (csrc/sample.c)
    int rx_sample_rows(int R, int V, const float *x, const float *raw, size_t ld,
                       const double *u, double temperature, double top_p, int top_k,
                       int32_t *ids, double *logprob)

    # AdamW and the global grad norm (csrc/optim.c)
    int rx_adamw_step(float *params, const float *grads, float *m, float *v, size_t n,
                      const int64_t *decay_ranges, int n_ranges,
                      float lr, float beta1, float beta2, float eps, float weight_decay,
                      float grad_scale, int64_t step)
    int rx_grad_norm_l2(const float *g, size_t n, double *norm)
    int rx_axpby(size_t n, float a, const float *x, float b, float *y)

# internal kernels the tests and benchmarks reach (csrc/rx_internal.h)
cdef extern from "rx_internal.h" nogil:
    int rx_sgemm(int ta, int tb, size_t M, size_t N, size_t K,
                  const float *A, size_t lda, const float *B, size_t ldb,
                  float beta, float *C, size_t ldc)
    int rx_sgemm_use_kernel(const char *name)
    size_t rx_sgemm_small_m(size_t m)
    size_t rx_bgemm_pack_budget(size_t elems)
    size_t rx_sgemm_full_budget(size_t floats)
    int rx_bgemm(int ta, int tb, size_t M, size_t N, size_t K,
                  const float *A, size_t lda, const float *B, size_t ldb,
                  float beta, float *C, size_t ldc)
    int rx_bgemm_use_kernel(const char *name)
    int rx_base_sgemm(int dtype, const void *rows, size_t M, size_t N, size_t K, const float *A,
                      float *C, int how)
    const char *rx_wkv7_kernel(int head_size)
    int rx_wkv7_use_kernel(const char *name)

# the byte-trie tokenizer (csrc/rx_tokenize.h)
cdef extern from "rx_tokenize.h" nogil:
    ctypedef struct rx_trie:
        pass
    rx_trie *rx_trie_build(const uint8_t *bytes, const int64_t *offsets, const int32_t *ids,
                           int64_t n_tok, int32_t vocab, int *err)
    void rx_trie_free(rx_trie *t)
    int32_t rx_trie_max_len(const rx_trie *t)
    int32_t rx_trie_token_len(const rx_trie *t, int32_t id)
    int64_t rx_trie_encode(const rx_trie *t, const uint8_t *x, int64_t n, int final,
                           int nthreads, int32_t *out, int32_t *scratch, int64_t *consumed)
    int64_t rx_trie_encode_docs(const rx_trie *t, const uint8_t *x, const int64_t *offsets,
                                int64_t n_doc, int nthreads, int32_t *out, int64_t *counts)
