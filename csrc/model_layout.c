/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * model_layout.c -- the RWKV-X model as data (docs/layout.md): the config
 * and the layer order, the parameter and grad arenas and their tensors, the
 * splitmix64 init, creation, introspection and the model's settings
 * (frozen ranges, precision, L2Wrap). model.c runs it.
 *
 * Every parameter is a view into one float32 arena and its grad the view at
 * the same offset of a second arena, so an optimiser, a checkpoint or a
 * NumPy view sees the whole model as one flat vector.
 */
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "rx_model.h"

#define RX_PREFIX_MAX 20 /* "blocks.<int>." */

enum { INIT_MAT, INIT_EMB, INIT_VEC, INIT_GAMMA, INIT_BETA };
/* symbolic tensor dimensions, resolved against the config; the suffixes
 * are the dimension names of RX_TM_FIELDS */
enum { D_NONE, D_C, D_V, D_F, D_Dw, D_Da, D_Dg, D_Dv };
static const char *const dim_name[] = {NULL, "C", "V", "F", "Dw", "Da", "Dg", "Dv"};

/* ---- config and layer order ------------------------------------------ */

static int64_t dim_of(const rx_pt_config *c, int d) {
    switch (d) {
    case D_C: return c->n_embd;
    case D_V: return c->vocab_size;
    case D_F: return c->ffn_dim;
    case D_Dw: return c->Dw;
    case D_Da: return c->Da;
    case D_Dg: return c->Dg;
    case D_Dv: return c->Dv;
    default: return 1;
    }
}

int rx_pt_config_validate(const rx_pt_config *c) {
    static const char *const fn = "rx_pt_config_validate";
    if (!c) return rx_fail(RX_EINVAL, "%s: config is NULL", fn);
    /* every size field must be >= 1 (n_attn_layer >= 0, moba_top_k free) */
    const struct { const char *name; int v; } pos[] = {
        {"n_embd", c->n_embd}, {"n_head", c->n_head}, {"head_size", c->head_size},
        {"n_rwkv_layer", c->n_rwkv_layer}, {"vocab_size", c->vocab_size}, {"Dw", c->Dw},
        {"Da", c->Da}, {"Dg", c->Dg}, {"Dv", c->Dv}, {"ffn_dim", c->ffn_dim},
        {"chunk_size", c->chunk_size}};
    for (size_t i = 0; i < sizeof pos / sizeof pos[0]; i++)
        if (pos[i].v < 1)
            return rx_fail(RX_ECONFIG, "%s: %s = %d must be >= 1", fn, pos[i].name, pos[i].v);
    if (c->n_attn_layer < 0 || c->n_attn_layer > c->n_rwkv_layer)
        return rx_fail(RX_ECONFIG, "%s: n_attn_layer = %d must lie in [0, n_rwkv_layer = %d]",
                       fn, c->n_attn_layer, c->n_rwkv_layer);
    if ((int64_t)c->n_head * c->head_size != c->n_embd)
        return rx_fail(RX_ECONFIG, "%s: n_head * head_size = %d * %d must equal n_embd = %d",
                       fn, c->n_head, c->head_size, c->n_embd);
    /* rx_ptmodel_param reports element counts as int: the largest of the
     * [C, x] tensors must fit */
    const int64_t C = c->n_embd;
    for (int d = D_C; d <= D_Dv; d++)
        if (C * dim_of(c, d) > INT32_MAX)
            return rx_fail(RX_ECONFIG, "%s: config too large: a [%d, %lld] parameter tensor "
                           "exceeds 2**31 - 1 elements", fn, c->n_embd, (long long)dim_of(c, d));
    return RX_OK;
}

/* layers[L] for L in model order: an attention block after every
 * interval-th RWKV block until n_attn are placed (docs/maths.md §Whole model) */
static void layer_order(const rx_pt_config *c, char *layers, int *block_idx) {
    int interval = c->n_attn_layer ? c->n_rwkv_layer / c->n_attn_layer : 0;
    int L = 0, placed = 0;
    for (int r = 0; r < c->n_rwkv_layer; r++) {
        layers[L] = 'R';
        block_idx[L++] = r;
        if (placed < c->n_attn_layer && (r + 1) % interval == 0) {
            layers[L] = 'A';
            block_idx[L++] = placed++;
        }
    }
    layers[L] = '\0';
}

/* ---- parameter layout (docs/layout.md §Parameters) ---------------------------------------- */

typedef struct {
    const char *name;
    size_t p_off, g_off;   /* offsets of the pointer in the params / grads struct */
    int d0, d1, init;
    int layer0;            /* 0: absent from RWKV block 0 */
} field_spec;

/* RX_TM_FIELDS as data, for the layout below and rx_tm_field */
#define TM(f, rows, cols, init, layer0)                                                   \
    {#f, offsetof(rx_tm_params, f), offsetof(rx_tm_grads, f), D_##rows, D_##cols, INIT_##init, \
     layer0},
static const field_spec tm_fields[] = {RX_TM_FIELDS(TM)};
#undef TM
enum {
#define TM(f, rows, cols, init, layer0) TM_I_##f,   /* each field's index */
    RX_TM_FIELDS(TM)
#undef TM
    N_TM_FIELDS
};

/* RX_TM_FIELDS is exactly the pointer fields of rx_tm_params and
 * rx_tm_grads, in order: field i sits i pointers after the first, and the
 * last ends the struct. A field added, dropped or moved on one side only
 * stops the build here instead of misplacing a tensor. */
#define TM(f, rows, cols, init, layer0)                                                      \
    _Static_assert(offsetof(rx_tm_params, f) ==                                            \
                           offsetof(rx_tm_params, x_r) + TM_I_##f * sizeof(const float *), \
                   "RX_TM_FIELDS out of rx_tm_params order at " #f);                       \
    _Static_assert(offsetof(rx_tm_grads, f) ==                                             \
                           offsetof(rx_tm_grads, x_r) + TM_I_##f * sizeof(float *),        \
                   "RX_TM_FIELDS out of rx_tm_grads order at " #f);
RX_TM_FIELDS(TM)
#undef TM
_Static_assert(sizeof(rx_tm_params) ==
                   offsetof(rx_tm_params, x_r) + N_TM_FIELDS * sizeof(const float *),
               "rx_tm_params has a field RX_TM_FIELDS lacks");
_Static_assert(sizeof(rx_tm_grads) == offsetof(rx_tm_grads, x_r) + N_TM_FIELDS * sizeof(float *),
               "rx_tm_grads has a field RX_TM_FIELDS lacks");

int rx_tm_num_fields(void) { return N_TM_FIELDS; }

int rx_tm_field(int i, const char **name, size_t *p_off, size_t *g_off, const char *dims[2],
                int *at_layer0) {
    if (i < 0 || i >= N_TM_FIELDS)
        return rx_fail(RX_EINVAL, "rx_tm_field: field %d is outside [0, %d)", i, N_TM_FIELDS);
    const field_spec *s = &tm_fields[i];
    if (name) *name = s->name;
    if (p_off) *p_off = s->p_off;
    if (g_off) *g_off = s->g_off;
    if (dims) dims[0] = dim_name[s->d0], dims[1] = dim_name[s->d1];
    if (at_layer0) *at_layer0 = s->layer0;
    return RX_OK;
}

#define RWKV_TENSORS (N_TM_FIELDS + 7)   /* + ln1 (2), ln2 (2), channel-mix (3) */
#define ATTN_TENSORS 11

/* The tensor table under construction, with the places each tensor's data
 * and grad pointers go once the arenas exist. */
typedef struct {
    rx_ptmodel *m;
    const float ***pp;   /* [n_tensors] where each data pointer is stored */
    float ***gp;         /* [n_tensors] where each grad pointer is stored */
} layout;

/* Appends one tensor of shape [d0] or [d0, d1] at the end of the arenas. */
static void add(layout *ly, const char *prefix, const char *field, int d0, int d1, int init,
                const float **pp, float **gp) {
    rx_ptmodel *m = ly->m;
    rx_tensor *t = &m->tensors[m->n_tensors];
    snprintf(t->name, sizeof t->name, "%s%s", prefix, field);
    t->ndim = d1 == D_NONE ? 1 : 2;
    t->shape[0] = (int)dim_of(&m->cfg, d0);
    t->shape[1] = t->ndim == 2 ? (int)dim_of(&m->cfg, d1) : 1;
    t->n = (size_t)t->shape[0] * (size_t)t->shape[1];
    t->off = m->n_elems;
    t->init = init;
    ly->pp[m->n_tensors] = pp;
    ly->gp[m->n_tensors] = gp;
    m->n_elems += t->n;
    m->n_tensors++;
}

static void add_cm(layout *ly, const char *pre, rx_cm_params *p, rx_cm_grads *g) {
    add(ly, pre, "cm.ffn_x_k", D_C, D_NONE, INIT_VEC, &p->ffn_x_k, &g->ffn_x_k);
    add(ly, pre, "cm.ffn_key_w", D_C, D_F, INIT_MAT, &p->ffn_key_w, &g->ffn_key_w);
    add(ly, pre, "cm.ffn_value_w", D_F, D_C, INIT_MAT, &p->ffn_value_w, &g->ffn_value_w);
}

static void add_rwkv(layout *ly, const char *pre, rx_block_params *p, rx_block_grads *g) {
    add(ly, pre, "ln1_w", D_C, D_NONE, INIT_GAMMA, &p->ln1_w, &g->ln1_w);
    add(ly, pre, "ln1_b", D_C, D_NONE, INIT_BETA, &p->ln1_b, &g->ln1_b);
    char tm_pre[RX_PREFIX_MAX + 4];
    snprintf(tm_pre, sizeof tm_pre, "%stm.", pre);
    for (int f = 0; f < N_TM_FIELDS; f++) {
        const field_spec *s = &tm_fields[f];
        if (p->tm.layer_id == 0 && !s->layer0) continue;
        add(ly, tm_pre, s->name, s->d0, s->d1, s->init,
            (const float **)((char *)&p->tm + s->p_off), (float **)((char *)&g->tm + s->g_off));
    }
    add(ly, pre, "ln2_w", D_C, D_NONE, INIT_GAMMA, &p->ln2_w, &g->ln2_w);
    add(ly, pre, "ln2_b", D_C, D_NONE, INIT_BETA, &p->ln2_b, &g->ln2_b);
    add_cm(ly, pre, &p->cm, &g->cm);
}

static void add_attn(layout *ly, const char *pre, rx_attn_params *p, rx_attn_grads *g) {
    add(ly, pre, "ln1_w", D_C, D_NONE, INIT_GAMMA, &p->ln1_w, &g->ln1_w);
    add(ly, pre, "ln1_b", D_C, D_NONE, INIT_BETA, &p->ln1_b, &g->ln1_b);
    add(ly, pre, "receptance_w", D_C, D_C, INIT_MAT, &p->receptance_w, &g->receptance_w);
    add(ly, pre, "key_w", D_C, D_C, INIT_MAT, &p->key_w, &g->key_w);
    add(ly, pre, "value_w", D_C, D_C, INIT_MAT, &p->value_w, &g->value_w);
    add(ly, pre, "output_w", D_C, D_C, INIT_MAT, &p->output_w, &g->output_w);
    add(ly, pre, "ln2_w", D_C, D_NONE, INIT_GAMMA, &p->ln2_w, &g->ln2_w);
    add(ly, pre, "ln2_b", D_C, D_NONE, INIT_BETA, &p->ln2_b, &g->ln2_b);
    add_cm(ly, pre, &p->cm, &g->cm);
}

/* The sizes every block kernel reads from its params struct. */
static void set_block_sizes(const rx_pt_config *c, rx_ptmodel *m) {
    for (int i = 0; i < c->n_rwkv_layer; i++) {
        rx_tm_params *tm = &m->rwkv[i].tm;
        tm->c = c->n_embd;
        tm->n_head = c->n_head;
        tm->head_size = c->head_size;
        tm->Dw = c->Dw;
        tm->Da = c->Da;
        tm->Dg = c->Dg;
        tm->Dv = c->Dv;
        tm->layer_id = i;
        m->rwkv[i].cm.c = c->n_embd;
        m->rwkv[i].cm.ffn_dim = c->ffn_dim;
    }
    for (int i = 0; i < c->n_attn_layer; i++) {
        rx_attn_params *a = &m->attn[i];
        a->c = c->n_embd;
        a->n_head = c->n_head;
        a->head_size = c->head_size;
        a->chunk_size = c->chunk_size;
        a->moba_top_k = c->moba_top_k;
        a->cm.c = c->n_embd;
        a->cm.ffn_dim = c->ffn_dim;
    }
}

/* ---- init (docs/layout.md §Parameters) ---------------------------------------------------- */

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* One element of the scheme, in double, rounded once to float. The volatile
 * product keeps a compiler from fusing 1 + 0.2*d into an FMA, whose single
 * rounding would differ from the reference in the last bit. */
static float init_value(int init, uint64_t x) {
    double d = (double)(x >> 40) * (1.0 / 16777216.0) - 0.5;
    volatile double p;
    switch (init) {
    case INIT_MAT: return (float)(d * 0.3);
    case INIT_GAMMA: p = 0.2 * d; return (float)(1.0 + p);
    case INIT_BETA: return (float)(0.2 * d);
    default: return (float)(d * 0.5);   /* INIT_EMB and INIT_VEC */
    }
}

static void init_params(rx_ptmodel *m, uint64_t seed) {
    uint64_t state = seed;
    for (int i = 0; i < m->n_tensors; i++) {
        const rx_tensor *t = &m->tensors[i];
        float *p = m->params + t->off;
        for (size_t e = 0; e < t->n; e++) p[e] = init_value(t->init, splitmix64(&state));
    }
}

/* ---- construction ------------------------------------------------------ */

/* A zeroed arena of n floats: lazily mapped under RX_PT_NO_INIT (pages
 * never written take no memory: a frozen base's slots), else allocated;
 * dense: on huge pages (every float will be written) */
static float *arena_new(size_t n, int flags, int dense) {
    if (!(flags & RX_PT_NO_INIT)) return rx_fcalloc(n);
    if (n > SIZE_MAX / sizeof(float)) return NULL;
#ifdef MAP_NORESERVE
    /* no swap reserved for the whole arena up front: Linux's heuristic
     * overcommit refuses a 7B model's 29 GB of address space otherwise, though
     * only what trains is ever written */
    const int lazy = MAP_NORESERVE;
#else
    const int lazy = 0;
#endif
    void *p = mmap(NULL, n * sizeof(float), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | lazy, -1, 0);
    if (p == MAP_FAILED) return NULL;
    if (dense) rx_advise_huge(p, n * sizeof(float));
    return p;
}

/* bytes of n floats; SIZE_MAX (an allocation that fails) past size_t */
static size_t n_bytes(size_t n) { return n > SIZE_MAX / sizeof(float) ? SIZE_MAX : n * sizeof(float); }

static void arena_free(float *p, size_t n, int flags) {
    if (p && (flags & RX_PT_NO_INIT)) munmap(p, n * sizeof(float));
    else free(p);
}

rx_base *rx_ptmodel_base_store(const rx_ptmodel *m) { return m->base; }

void rx_ptmodel_attach_base(rx_ptmodel *m, rx_base *s) { m->base = s; }

rx_model_ends rx_ptmodel_ends(const rx_ptmodel *m) {
    return (rx_model_ends){m->emb, m->ln0_w, m->ln0_b, m->ln_out_w, m->ln_out_b, m->head};
}

void rx_ptmodel_free(rx_ptmodel *m) {
    if (!m) return;
    free(m->layers);
    free(m->block_idx);
    free(m->tensors);
    arena_free(m->params, m->n_elems, m->flags);
    arena_free(m->grads, m->n_elems, m->flags);
    free(m->rwkv);
    free(m->rwkv_g);
    free(m->attn);
    free(m->attn_g);
    free(m->state0);
    free(m->g_state0);
    free(m->frozen);
    rx_lora_free(m->lora);
    rx_base_free(m->base);
    free(m);
}

/* ---- the model context (defaults and checks: runtime.c) ------------------ */

int rx_ptmodel_ctx(const rx_ptmodel *m, rx_model_ctx *out) {
    if (!m || !out) return rx_fail(RX_EINVAL, "rx_ptmodel_ctx: %s is NULL", m ? "out" : "model");
    *out = m->ctx;
    return RX_OK;
}

/* rx_model_create's body; unknown: flag bits of rx_model_create it does not know */
/* create: RX_PT_NO_INIT, with or without RX_PT_DENSE, or 0 (ln0 comes
 * from ctx) */
static int model_create(const char *fn, const rx_pt_config *pc, const rx_model_ctx *ctx,
                        int create, int unknown, uint64_t seed, rx_ptmodel **out) {
    if (!out) return rx_fail(RX_EINVAL, "%s: out is NULL", fn);
    *out = NULL;
    int rc = rx_pt_config_validate(pc);
    if (rc != RX_OK) return rc;
    if (unknown) return rx_fail(RX_EINVAL, "%s: unknown flag bits 0x%x", fn, unknown);
    rc = rx_model_ctx_validate(ctx);
    if (rc != RX_OK) return rc;
    if ((create & RX_PT_DENSE) && !(create & RX_PT_NO_INIT))
        return rx_fail(RX_EINVAL, "%s: RX_PT_DENSE is a flag of an RX_PT_NO_INIT model", fn);
    const int flags = (ctx->ln0 ? RX_PT_LN0 : 0) | (create & (RX_PT_NO_INIT | RX_PT_DENSE));
    rx_ptmodel *m = calloc(1, sizeof *m);
    if (!m) return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    m->cfg = *pc;
    m->ctx = *ctx;
    m->flags = flags;
    const int nr = pc->n_rwkv_layer, na = pc->n_attn_layer;
    const size_t max_tensors = 6 + (size_t)nr * RWKV_TENSORS + (size_t)na * ATTN_TENSORS;
    m->n_blocks = nr + na;
    m->layers = malloc((size_t)m->n_blocks + 1);
    m->block_idx = malloc((size_t)m->n_blocks * sizeof(int));
    m->tensors = calloc(max_tensors, sizeof(rx_tensor));
    m->rwkv = calloc((size_t)nr, sizeof(rx_block_params));
    m->rwkv_g = calloc((size_t)nr, sizeof(rx_block_grads));
    m->attn = calloc((size_t)(na ? na : 1), sizeof(rx_attn_params));
    m->attn_g = calloc((size_t)(na ? na : 1), sizeof(rx_attn_grads));
    layout ly = {m, calloc(max_tensors, sizeof(float **)), calloc(max_tensors, sizeof(float **))};
    if (!m->layers || !m->block_idx || !m->tensors || !m->rwkv || !m->rwkv_g || !m->attn ||
        !m->attn_g || !ly.pp || !ly.gp)
        goto fail;
    layer_order(pc, m->layers, m->block_idx);
    set_block_sizes(pc, m);

    add(&ly, "", "emb", D_V, D_C, INIT_EMB, &m->emb, &m->g_emb);
    if (flags & RX_PT_LN0) {
        add(&ly, "", "ln0_w", D_C, D_NONE, INIT_GAMMA, &m->ln0_w, &m->g_ln0_w);
        add(&ly, "", "ln0_b", D_C, D_NONE, INIT_BETA, &m->ln0_b, &m->g_ln0_b);
    }
    for (int L = 0; L < m->n_blocks; L++) {
        char pre[RX_PREFIX_MAX];
        snprintf(pre, sizeof pre, "blocks.%d.", L);
        int i = m->block_idx[L];
        if (m->layers[L] == 'R') add_rwkv(&ly, pre, &m->rwkv[i], &m->rwkv_g[i]);
        else add_attn(&ly, pre, &m->attn[i], &m->attn_g[i]);
    }
    add(&ly, "", "ln_out_w", D_C, D_NONE, INIT_GAMMA, &m->ln_out_w, &m->g_ln_out_w);
    add(&ly, "", "ln_out_b", D_C, D_NONE, INIT_BETA, &m->ln_out_b, &m->g_ln_out_b);
    add(&ly, "", "head", D_C, D_V, INIT_MAT, &m->head, &m->g_head);

    /* the params on huge pages where every one is written: by the init,
     * or by a dense caller */
    m->params = !(flags & RX_PT_NO_INIT)           ? rx_alloc_huge(n_bytes(m->n_elems))
                : arena_new(m->n_elems, flags, (flags & RX_PT_DENSE) != 0);
    m->grads = arena_new(m->n_elems, flags, 0);
    if (!m->params || !m->grads) goto fail;
    for (int i = 0; i < m->n_tensors; i++) {
        *ly.pp[i] = m->params + m->tensors[i].off;
        *ly.gp[i] = m->grads + m->tensors[i].off;
    }
    if (!(flags & RX_PT_NO_INIT)) init_params(m, seed);
    free(ly.pp);
    free(ly.gp);
    *out = m;
    return RX_OK;
fail:
    free(ly.pp);
    free(ly.gp);
    const size_t n = m->n_elems;   /* 0 when the tables failed before the arenas */
    rx_ptmodel_free(m);
    return rx_fail(RX_ENOMEM, "%s: out of memory (parameter arenas of %zu elements)", fn, n);
}

int rx_model_create(const rx_pt_config *pc, int flags, uint64_t seed, rx_ptmodel **out) {
    rx_model_ctx ctx = rx_ctx_default;
    ctx.ln0 = (flags & RX_PT_LN0) != 0;
    return model_create("rx_model_create", pc, &ctx, flags, flags & ~RX_PT_FLAGS_ALL, seed,
                        out);
}

int rx_model_create_ctx(const rx_pt_config *pc, const rx_model_ctx *ctx, int flags,
                        uint64_t seed, rx_ptmodel **out) {
    return model_create("rx_model_create_ctx", pc, ctx, flags,
                        flags & ~(RX_PT_NO_INIT | RX_PT_DENSE), seed,
                        out);
}

rx_ptmodel *rx_model_new_random_flags(const rx_pt_config *pc, int flags, uint64_t seed) {
    rx_ptmodel *m;
    rx_model_create(pc, flags, seed, &m);
    return m;
}

rx_ptmodel *rx_model_new_random(const rx_pt_config *pc, uint64_t seed) {
    rx_ptmodel *m;
    rx_model_create(pc, 0, seed, &m);
    return m;
}

/* ---- introspection ------------------------------------------------------ */

/* n_rwkv_layer * H * N * N: the initial states' element count */
static size_t state_elems(const rx_ptmodel *m) {
    const size_t N = (size_t)m->cfg.head_size;
    return (size_t)m->cfg.n_rwkv_layer * (size_t)m->cfg.n_head * N * N;
}

int rx_ptmodel_enable_state(rx_ptmodel *m) {
    if (!m) return rx_fail(RX_EINVAL, "rx_ptmodel_enable_state: model is NULL");
    if (m->state0) return RX_OK;
    m->state0 = rx_fcalloc(state_elems(m));
    m->g_state0 = rx_fcalloc(state_elems(m));
    if (!m->state0 || !m->g_state0) {
        free(m->state0);
        free(m->g_state0);
        m->state0 = m->g_state0 = NULL;
        return rx_fail(RX_ENOMEM, "rx_ptmodel_enable_state: out of memory (%zu floats)",
                       2 * state_elems(m));
    }
    return RX_OK;
}

float *rx_ptmodel_state_arena(rx_ptmodel *m, int64_t *n) {
    if (n) *n = m && m->state0 ? (int64_t)state_elems(m) : 0;
    return m ? m->state0 : NULL;
}

float *rx_ptmodel_state_grad_arena(rx_ptmodel *m, int64_t *n) {
    if (n) *n = m && m->g_state0 ? (int64_t)state_elems(m) : 0;
    return m ? m->g_state0 : NULL;
}

int rx_ptmodel_flags(const rx_ptmodel *m) { return m ? m->flags : -1; }

int rx_ptmodel_num_params(const rx_ptmodel *m) { return m ? m->n_tensors : 0; }

int rx_ptmodel_param(rx_ptmodel *m, int i, const char **name, float **data, float **grad,
                     int *n) {
    if (!m) return rx_fail(RX_EINVAL, "rx_ptmodel_param: model is NULL");
    if (i < 0 || i >= m->n_tensors)
        return rx_fail(RX_EINVAL, "rx_ptmodel_param: index %d is outside [0, %d)", i,
                       m->n_tensors);
    const rx_tensor *t = &m->tensors[i];
    if (name) *name = t->name;
    if (data) *data = m->params + t->off;
    if (grad) *grad = m->grads + t->off;
    if (n) *n = (int)t->n;
    return RX_OK;
}

int rx_ptmodel_param_shape(const rx_ptmodel *m, int i, int shape[2]) {
    if (!m || !shape) return rx_fail(RX_EINVAL, "rx_ptmodel_param_shape: model or shape is NULL");
    if (i < 0 || i >= m->n_tensors)
        return rx_fail(RX_EINVAL, "rx_ptmodel_param_shape: index %d is outside [0, %d)", i,
                       m->n_tensors);
    const rx_tensor *t = &m->tensors[i];
    shape[0] = t->shape[0];
    if (t->ndim == 2) shape[1] = t->shape[1];
    return t->ndim;
}

float *rx_ptmodel_param_arena(rx_ptmodel *m, int64_t *n) {
    if (n) *n = m ? (int64_t)m->n_elems : 0;
    return m ? m->params : NULL;
}

float *rx_ptmodel_grad_arena(rx_ptmodel *m, int64_t *n) {
    if (n) *n = m ? (int64_t)m->n_elems : 0;
    return m ? m->grads : NULL;
}

rx_pt_config rx_ptmodel_config(const rx_ptmodel *m) {
    rx_pt_config none = {0};
    return m ? m->cfg : none;
}

const char *rx_ptmodel_layers(const rx_ptmodel *m) { return m ? m->layers : NULL; }

const rx_block_params *rx_ptmodel_rwkv(rx_ptmodel *m, int idx) {
    return m && idx >= 0 && idx < m->cfg.n_rwkv_layer ? &m->rwkv[idx] : NULL;
}

const rx_attn_params *rx_ptmodel_attn(rx_ptmodel *m, int idx) {
    return m && idx >= 0 && idx < m->cfg.n_attn_layer ? &m->attn[idx] : NULL;
}

void rx_ptmodel_zero_grad(rx_ptmodel *m) {
    if (m) rx_base_zero_grads(m->base, m->grads, m->n_elems);
    if (m && m->g_state0) rx_fzero(m->g_state0, state_elems(m));
}

/* ---- settings -------------------------------------------------------------- */

int rx_ptmodel_set_frozen_ranges(rx_ptmodel *m, const int64_t *ranges, int n) {
    static const char *const fn = "rx_ptmodel_set_frozen_ranges";
    if (!m) return rx_fail(RX_EINVAL, "%s: model is NULL", fn);
    if (n < 0 || (n > 0 && !ranges))
        return rx_fail(RX_EINVAL, "%s: n = %d ranges at %p", fn, n, (const void *)ranges);
    for (int r = 0; r < n; r++)
        if (ranges[2 * r] < 0 || ranges[2 * r] >= ranges[2 * r + 1] ||
            ranges[2 * r + 1] > (int64_t)m->n_elems)
            return rx_fail(RX_EINVAL, "%s: range %d [%lld, %lld) is not inside [0, %zu)", fn, r,
                           (long long)ranges[2 * r], (long long)ranges[2 * r + 1], m->n_elems);
    int64_t *copy = n ? malloc((size_t)n * 2 * sizeof(int64_t)) : NULL;
    if (n && !copy) return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    if (n) memcpy(copy, ranges, (size_t)n * 2 * sizeof(int64_t));
    free(m->frozen);
    m->frozen = copy;
    m->n_frozen = n;
    return RX_OK;
}

int rx_ptmodel_set_frozen(rx_ptmodel *m, int frozen) {
    const int64_t all[2] = {0, m ? (int64_t)m->n_elems : 0};
    return rx_ptmodel_set_frozen_ranges(m, all, frozen ? 1 : 0);
}

int rx_ptmodel_frozen(const rx_ptmodel *m) {
    if (!m) return 0;
    return m->n_frozen == 1 && m->frozen[0] == 0 && m->frozen[1] == (int64_t)m->n_elems
               ? 1 : m->n_frozen ? 2 : 0;
}

int rx_ptmodel_set_precision(rx_ptmodel *m, int precision) {
    if (!m) return rx_fail(RX_EINVAL, "rx_ptmodel_set_precision: model is NULL");
    if (precision != RX_PRECISION_FP32 && precision != RX_PRECISION_BF16)
        return rx_fail(RX_EINVAL, "rx_ptmodel_set_precision: unknown precision %d", precision);
    m->precision = precision;
    return RX_OK;
}

int rx_ptmodel_precision(const rx_ptmodel *m) {
    return m ? m->precision : rx_fail(RX_EINVAL, "rx_ptmodel_precision: model is NULL");
}

int rx_ptmodel_set_l2wrap(rx_ptmodel *m, double factor) {
    if (!m) return rx_fail(RX_EINVAL, "rx_ptmodel_set_l2wrap: model is NULL");
    if (!(factor >= 0.0) || isinf(factor))
        return rx_fail(RX_EINVAL, "rx_ptmodel_set_l2wrap: factor %g must be finite and >= 0",
                       factor);
    m->ctx.l2wrap = factor;
    return RX_OK;
}

double rx_ptmodel_l2wrap(const rx_ptmodel *m) { return m ? m->ctx.l2wrap : 0.0; }
