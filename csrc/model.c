/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * model.c -- the whole RWKV-X model (docs/maths.md, docs/layout.md): the parameter and grad
 * arenas, the splitmix64 init, introspection, the layer order, and the
 * forward / backward over B sequences at once.
 *
 *     x0 = emb[tokens] (then ln0(x0) when the model has ln0);
 *     x = block_L(x) in model order; h = ln_out(x);
 *     logits = h . head; loss = mean CE over the valid targets
 *
 * Every parameter is a view into one float32 arena and its grad the view at
 * the same offset of a second arena, so an optimiser, a checkpoint or a
 * NumPy view sees the whole model as one flat vector.
 */
#include <float.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "rx_internal.h"

#define RX_PREFIX_MAX 20 /* "blocks.<int>." */
#define RX_NAME_MAX 48   /* "blocks.<int>.tm.receptance_w" fits with room */

enum { INIT_MAT, INIT_EMB, INIT_VEC, INIT_GAMMA, INIT_BETA };
/* symbolic tensor dimensions, resolved against the config; the suffixes
 * are the dimension names of RX_TM_FIELDS */
enum { D_NONE, D_C, D_V, D_F, D_Dw, D_Da, D_Dg, D_Dv };
static const char *const dim_name[] = {NULL, "C", "V", "F", "Dw", "Da", "Dg", "Dv"};

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
    rx_base *base;            /* the frozen base (base.c, rx_ptmodel_set_base), NULL: none */
    int lora_on;              /* the forward and backward apply them (0 once disabled) */
};

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
 * never written take no memory: a frozen base's slots), else allocated */
static float *arena_new(size_t n, int flags) {
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
    return p == MAP_FAILED ? NULL : p;
}

static void arena_free(float *p, size_t n, int flags) {
    if (p && (flags & RX_PT_NO_INIT)) munmap(p, n * sizeof(float));
    else free(p);
}

rx_base *rx_ptmodel_base_store(const rx_ptmodel *m) { return m->base; }

void rx_ptmodel_attach_base(rx_ptmodel *m, rx_base *s) { m->base = s; }

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

/* ---- the model context -------------------------------------------------- */

const rx_model_ctx rx_ctx_default = RX_MODEL_CTX_DEFAULT;

void rx_model_ctx_default(rx_model_ctx *ctx) {
    if (ctx) *ctx = rx_ctx_default;
}

int rx_model_ctx_validate(const rx_model_ctx *ctx) {
    static const char *const fn = "rx_model_ctx_validate";
    if (!ctx) return rx_fail(RX_EINVAL, "%s: ctx is NULL", fn);
    /* an eps is rounded to float for the kernels: it must stay > 0 there */
    if (!(isfinite(ctx->ln_eps) && (float)ctx->ln_eps > 0.0f && ctx->ln_eps <= FLT_MAX))
        return rx_fail(RX_ECONFIG, "%s: ln_eps %g must be finite and > 0", fn, ctx->ln_eps);
    if (!(isfinite(ctx->gn_eps) && (float)ctx->gn_eps > 0.0f && ctx->gn_eps <= FLT_MAX))
        return rx_fail(RX_ECONFIG, "%s: gn_eps %g must be finite and > 0", fn, ctx->gn_eps);
    if (ctx->ln0 != 0 && ctx->ln0 != 1)
        return rx_fail(RX_ECONFIG, "%s: ln0 %d must be 0 or 1", fn, ctx->ln0);
    if (!(isfinite(ctx->l2wrap) && ctx->l2wrap >= 0.0))
        return rx_fail(RX_ECONFIG, "%s: l2wrap %g must be finite and >= 0", fn, ctx->l2wrap);
    return RX_OK;
}

int rx_ptmodel_ctx(const rx_ptmodel *m, rx_model_ctx *out) {
    if (!m || !out) return rx_fail(RX_EINVAL, "rx_ptmodel_ctx: %s is NULL", m ? "out" : "model");
    *out = m->ctx;
    return RX_OK;
}

/* rx_model_create's body; unknown: flag bits of rx_model_create it does not know */
/* create: RX_PT_NO_INIT or 0 (ln0 comes from ctx) */
static int model_create(const char *fn, const rx_pt_config *pc, const rx_model_ctx *ctx,
                        int create, int unknown, uint64_t seed, rx_ptmodel **out) {
    if (!out) return rx_fail(RX_EINVAL, "%s: out is NULL", fn);
    *out = NULL;
    int rc = rx_pt_config_validate(pc);
    if (rc != RX_OK) return rc;
    if (unknown) return rx_fail(RX_EINVAL, "%s: unknown flag bits 0x%x", fn, unknown);
    rc = rx_model_ctx_validate(ctx);
    if (rc != RX_OK) return rc;
    const int flags = (ctx->ln0 ? RX_PT_LN0 : 0) | (create & RX_PT_NO_INIT);
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

    m->params = flags & RX_PT_NO_INIT ? arena_new(m->n_elems, flags) : rx_falloc(m->n_elems);
    m->grads = arena_new(m->n_elems, flags);
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
    return model_create("rx_model_create_ctx", pc, ctx, flags, flags & ~RX_PT_NO_INIT, seed,
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

/* ---- activations --------------------------------------------------------- */

/* a*b into *out, 0 on size_t overflow */
static int mul_ok(size_t a, size_t b, size_t *out) {
    if (b && a > SIZE_MAX / b) return 0;
    *out = a * b;
    return 1;
}

/* The blocks' kept forward intermediates: one set per block, or under
 * recompute one set shared by every RWKV block and one by every attention
 * block, both carved from one region (only one block's are live at a
 * time), holding the block held_r / held_a last ran forward into. */
struct rx_pt_saved {
    int n, na;
    rx_block_acts *rwkv;   /* [n] */
    rx_attn_acts **attn;   /* [na] */
    float *work;           /* scratch for any block's backward: the largest
                            * rx_block_work or RX_ATTN_WORK */
    float *s, *ds;         /* [B][H][N][N] each when the model has initial states:
                            * one block's broadcast state (advanced in place by
                            * its forward), and the grad on it per sequence */
    int recompute;
    int held_r, held_a;    /* recompute: the blocks the shared sets hold, -1 none */
    rx_block_acts view0;   /* recompute: rwkv[0] as RWKV block 0 sees it */
    float *shared;         /* recompute: the region rwkv[0] and attn[0] share */
    int lnout_stale;       /* recompute: a backward used lnout as scratch since the forward */
    float *kept;           /* recompute: [n_attn_layer][kept_n] each attention block's
                            * core products (rx_attn_kept_floats), never recomputed */
    size_t kept_n;
};

/* The intermediates of RWKV block i. Under recompute the shared set is
 * sized for a block after the first (a superset: block 0 has no value
 * residual), and block 0 reads it through view0, whose v-residual buffers
 * are block 0's: vmod the same buffer as v, no vg, no tv. */
static rx_block_acts *rwkv_acts(struct rx_pt_saved *s, int i) {
    if (!s->recompute) return &s->rwkv[i];
    return i == 0 ? &s->view0 : &s->rwkv[0];
}

/* The intermediates of attention block i; under recompute the shared set,
 * pointed at block i's kept core products. */
static rx_attn_acts *attn_acts(struct rx_pt_saved *s, const rx_ptmodel *m, int i) {
    if (!s->recompute) return s->attn[i];
    rx_attn_acts_bind(s->attn[0], &m->attn[i], s->kept + (size_t)i * s->kept_n);
    return s->attn[0];
}

static void saved_free(struct rx_pt_saved *s) {
    if (!s) return;
    for (int i = 0; i < s->n; i++) rx_block_acts_free(&s->rwkv[i]);
    for (int i = 0; i < s->na; i++) rx_attn_acts_free(s->attn[i]);
    free(s->rwkv);
    free(s->attn);
    free(s->work);
    free(s->s);
    free(s->ds);
    free(s->shared);
    free(s->kept);
    free(s);
}

static struct rx_pt_saved *saved_new(const rx_ptmodel *m, size_t B, size_t T, int recompute) {
    struct rx_pt_saved *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    const int n = recompute ? 1 : m->cfg.n_rwkv_layer;
    const int na = recompute && m->cfg.n_attn_layer ? 1 : m->cfg.n_attn_layer;
    s->recompute = recompute;
    s->held_r = s->held_a = -1;
    /* the shared RWKV set is sized as the last block's (a block after the
     * first when there is one) */
    const rx_block_params *shape_of = &m->rwkv[recompute ? m->cfg.n_rwkv_layer - 1 : 0];
    const size_t BT = B * T, C = (size_t)m->cfg.n_embd, F = (size_t)m->cfg.ffn_dim;
    size_t nwork = na ? RX_ATTN_WORK(BT, C, F) : 0;
    for (int i = 0; i < m->cfg.n_rwkv_layer; i++) {
        const size_t w = (recompute ? rx_block_work_lean : rx_block_work)(&m->rwkv[i], BT);
        if (w > nwork) nwork = w;
    }
    s->rwkv = calloc((size_t)n, sizeof *s->rwkv);
    s->attn = calloc((size_t)(na ? na : 1), sizeof *s->attn);
    s->work = rx_falloc(nwork);
    const size_t nstate = B * (size_t)m->cfg.n_head * (size_t)m->cfg.head_size *
                          (size_t)m->cfg.head_size;
    if (m->state0) {
        s->s = rx_falloc(nstate);
        s->ds = rx_falloc(nstate);
    }
    if (!s->rwkv || !s->attn || !s->work || (m->state0 && (!s->s || !s->ds))) {
        free(s->rwkv);
        free(s->attn);
        free(s->work);
        free(s->s);
        free(s->ds);
        free(s);
        return NULL;
    }
    if (recompute) {
        /* the lean set: part of it in the blocks' backward scratch */
        size_t nr = rx_block_acts_floats_lean(shape_of, B, T);
        const size_t nat = na ? rx_attn_acts_floats(&m->attn[0], B, T) : 0;
        s->shared = rx_falloc(nr > nat ? nr : nat);
        if (s->shared) rx_block_acts_carve_lean(&s->rwkv[0], shape_of, B, T, s->shared, s->work);
        s->n = s->shared ? 1 : 0;
        s->attn[0] = s->shared && na ? rx_attn_acts_new_in(&m->attn[0], B, T, s->shared) : NULL;
        s->na = s->attn[0] ? 1 : 0;
        s->kept_n = na ? rx_attn_kept_floats(&m->attn[0], B, T) : 0;
        s->kept = s->kept_n ? rx_falloc((size_t)m->cfg.n_attn_layer * s->kept_n) : NULL;
        if (!s->shared || s->na != na || (s->kept_n && !s->kept)) {
            saved_free(s);
            return NULL;
        }
    }
    for (; s->n < n; s->n++)
        if (rx_block_acts_alloc(&s->rwkv[s->n], recompute ? shape_of : &m->rwkv[s->n], B, T) !=
            RX_OK) {
            s->n++;   /* a partial allocation is freed with the rest */
            saved_free(s);
            return NULL;
        }
    for (; s->na < na; s->na++)
        if (!(s->attn[s->na] = rx_attn_acts_new(&m->attn[s->na], B, T))) {
            saved_free(s);
            return NULL;
        }
    if (recompute) {
        s->view0 = s->rwkv[0];
        s->view0.tm.vmod = s->view0.tm.v;
        s->view0.tm.vg = NULL;
        s->view0.tm.tv = NULL;
    }
    return s;
}

void rx_pt_acts_free(rx_pt_acts *a) {
    if (!a) return;
    saved_free(a->saved);
    free(a->tokens);
    free(a->block_in);   /* the start of the one float allocation */
    free(a);
}

/* One float allocation carved into block_in | v_first | lnout | work |
 * logits | dlogits: BT*((n_blocks+7)*C + 2*vocab) floats, or with the
 * chunked head BT*(n_blocks+7)*C + 2*rows*vocab (logits NULL, dlogits the
 * head's scratch); the blocks' kept intermediates and a block backward's
 * scratch beside it. Under recompute lnout is work's third buffer (the
 * summed v_first grad, written only after the head has read lnout), one
 * [BT][C] less: the backward and rx_pretrain_loss make it again from the
 * last block's output when a backward has used it. */
int rx_pt_acts_create_opts(const rx_ptmodel *m, int B, int T, int flags, int head_rows,
                           rx_pt_acts **out) {
    static const char *const fn = "rx_pt_acts_create";
    if (!out) return rx_fail(RX_EINVAL, "%s: out is NULL", fn);
    *out = NULL;
    if (!m) return rx_fail(RX_EINVAL, "%s: model is NULL", fn);
    if (flags & ~RX_ACTS_FLAGS_ALL)
        return rx_fail(RX_EINVAL, "%s: unknown flag bits 0x%x", fn, flags & ~RX_ACTS_FLAGS_ALL);
    if (head_rows < 0) return rx_fail(RX_EINVAL, "%s: head_rows = %d is < 0", fn, head_rows);
    if (B < 1 || T < 1 || (int64_t)B * T > INT32_MAX)
        return rx_fail(RX_EINVAL, "%s: B = %d, T = %d: each must be >= 1 and B*T <= 2**31 - 1",
                       fn, B, T);
    const size_t BT = (size_t)B * (size_t)T, C = (size_t)m->cfg.n_embd;
    const size_t V = (size_t)m->cfg.vocab_size, nb = (size_t)m->n_blocks;
    const int chunked = (flags & RX_ACTS_CHUNKED_HEAD) != 0;
    const size_t lean = (flags & RX_ACTS_RECOMPUTE) != 0;
    const int rows = head_rows ? head_rows : rx_head_chunk_rows((int)V, 0);
    size_t rowc, rowv, total;
    /* sizes that do not fit the address space cannot be allocated either */
    if (!mul_ok(BT, C, &rowc) ||
        !mul_ok(chunked ? ((size_t)rows < BT ? (size_t)rows : BT) : BT, V, &rowv) ||
        !mul_ok(rowc, nb + 7 - lean, &total) ||
        total > SIZE_MAX - 2 * rowv || rowv > SIZE_MAX / 2)
        return rx_fail(RX_ENOMEM, "%s: acts for B = %d, T = %d exceed the address space", fn, B,
                       T);
    total += 2 * rowv;
    rx_pt_acts *a = calloc(1, sizeof *a);
    if (!a) return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    float *f = rx_fcalloc(total);   /* zeroed: nothing is ever read uninitialised */
    a->tokens = f ? rx_alloc(BT, sizeof(int)) : NULL;
    a->saved = a->tokens ? saved_new(m, (size_t)B, (size_t)T, flags & RX_ACTS_RECOMPUTE) : NULL;
    if (!a->tokens || !f || !a->saved) {
        saved_free(a->saved);
        free(a->tokens);
        free(f);
        free(a);
        return rx_fail(RX_ENOMEM, "%s: out of memory for B = %d, T = %d (%zu floats of "
                       "activations, besides the blocks' own)", fn, B, T, total);
    }
    a->B = B;
    a->T = T;
    a->C = (int)C;
    a->vocab = (int)V;
    a->n_blocks = (int)nb;
    a->block_in = f;
    a->v_first = a->block_in + (nb + 1) * rowc;
    a->work = a->v_first + (2 - lean) * rowc;
    a->lnout = lean ? a->work + 2 * rowc : a->v_first + rowc;
    a->logits = chunked ? NULL : a->work + 4 * rowc;
    a->dlogits = a->work + 4 * rowc + (chunked ? 0 : rowv);
    a->flags = flags;
    a->head_rows = chunked ? rows : 0;
    *out = a;
    return RX_OK;
}

int rx_pt_acts_create(const rx_ptmodel *m, int B, int T, rx_pt_acts **out) {
    return rx_pt_acts_create_opts(m, B, T, 0, 0, out);
}

rx_pt_acts *rx_pt_acts_new_batch(const rx_ptmodel *m, int B, int T) {
    rx_pt_acts *a;
    rx_pt_acts_create(m, B, T, &a);
    return a;
}

rx_pt_acts *rx_pt_acts_new(const rx_ptmodel *m, int T) {
    rx_pt_acts *a;
    rx_pt_acts_create(m, 1, T, &a);
    return a;
}

/* acts were made for this model's sizes and this B, T */
static int acts_fit(const rx_ptmodel *m, const rx_pt_acts *a, int B, int T) {
    return a && a->B == B && a->T == T && a->C == m->cfg.n_embd &&
           a->vocab == m->cfg.vocab_size && a->n_blocks == m->n_blocks;
}

/* ---- forward ------------------------------------------------------------- */

/* the arena's elements [off, off + n) lie inside one frozen range */
static int is_frozen(const rx_ptmodel *m, size_t off, size_t n) {
    for (int r = 0; r < m->n_frozen; r++)
        if ((int64_t)off >= m->frozen[2 * r] && (int64_t)(off + n) <= m->frozen[2 * r + 1])
            return 1;
    return 0;
}

/* out [BT][C] = the embedding's rows of acts->tokens, from the arena or,
 * when the embedding is in the frozen base, decoded from it */
static int emb_gather(const rx_ptmodel *m, const rx_pt_acts *acts, int BT, float *out) {
    const rx_base_mat *b = rx_base_find(m->base, m->emb);
    const int V = m->cfg.vocab_size, C = m->cfg.n_embd;
    return b ? rx_embedding_gather_base(b, acts->tokens, BT, C, V, out)
             : rx_embedding_gather(m->emb, acts->tokens, BT, C, V, out);
}

/* The initial state of RWKV block i for each of the B sequences into s
 * [B][H][N][N] (a trainable state is one for all sequences) */
static void broadcast_state(const rx_ptmodel *m, int i, int B, float *s) {
    const size_t n = (size_t)m->cfg.n_head * (size_t)m->cfg.head_size * (size_t)m->cfg.head_size;
    for (int b = 0; b < B; b++)
        memcpy(s + (size_t)b * n, m->state0 + (size_t)i * n, n * sizeof(float));
}

/* g_state0 of RWKV block i = the sum over the B sequences of ds
 * [B][H][N][N], in sequence order (the same bits at any thread count) */
static void reduce_state_grad(rx_ptmodel *m, int i, int B, const float *ds) {
    const size_t n = (size_t)m->cfg.n_head * (size_t)m->cfg.head_size * (size_t)m->cfg.head_size;
    float *g = m->g_state0 + (size_t)i * n;
    memcpy(g, ds, n * sizeof(float));
    for (int b = 1; b < B; b++)
        for (size_t e = 0; e < n; e++) g[e] += ds[(size_t)b * n + e];
}

/* Block L forward from block_in[L] into out [B*T][C], keeping its
 * intermediates (the shared set under recompute, which then holds L);
 * RWKV block 0 writes v_first when write_vf. */
static int block_forward_vf(rx_ptmodel *m, const rx_pt_acts *acts, int L, float *out,
                            int write_vf) {
    struct rx_pt_saved *s = acts->saved;
    const float *x = acts->block_in + (size_t)L * (size_t)acts->B * acts->T * acts->C;
    const int i = m->block_idx[L];
    /* under recompute both sets share one region: one kind's forward
     * overwrites what the other held */
    if (m->layers[L] == 'A') {
        s->held_a = i;
        s->held_r = -1;
        /* a recompute (out NULL) finds the core's products kept */
        return out ? rx_attn_forward_acts(&m->ctx, &m->attn[i], x, NULL, attn_acts(s, m, i), out)
                   : rx_attn_forward_kept(&m->ctx, &m->attn[i], x, NULL, attn_acts(s, m, i));
    }
    s->held_r = i;
    s->held_a = -1;
    /* a trainable initial state, broadcast to every sequence (the forward
     * advances it in place, so each forward of the block, a recompute's
     * too, starts from a fresh copy) */
    float *st = m->state0 ? s->s : NULL;
    if (st) broadcast_state(m, i, acts->B, st);
    return rx_block_forward_state(&m->ctx, &m->rwkv[i], x, NULL, NULL, i > 0 ? acts->v_first : NULL,
                                  i > 0 || !write_vf ? NULL : acts->v_first, st, rwkv_acts(s, i),
                                  out);
}

static int block_forward(rx_ptmodel *m, const rx_pt_acts *acts, int L, float *out) {
    return block_forward_vf(m, acts, L, out, 1);
}

/* Under recompute, block L's intermediates back in the shared set unless
 * it holds them already: its forward again from its kept input (the same
 * inputs and kernels, so the same bits), without the block output (and the
 * channel-mix value projection that only it reads), v_first left as it is. */
static int block_recompute(rx_ptmodel *m, const rx_pt_acts *acts, int L) {
    const struct rx_pt_saved *s = acts->saved;
    const int i = m->block_idx[L];
    if (!s->recompute || (m->layers[L] == 'A' ? s->held_a : s->held_r) == i) return RX_OK;
    return block_forward_vf(m, acts, L, NULL, 0);
}

/* lnout = ln_out(the last block's output) */
static int lnout_forward(const rx_ptmodel *m, const rx_pt_acts *acts) {
    const size_t rowc = (size_t)acts->B * (size_t)acts->T * (size_t)acts->C;
    acts->saved->lnout_stale = 0;
    return rx_layernorm_forward_eps(acts->block_in + (size_t)m->n_blocks * rowc, m->ln_out_w,
                                    m->ln_out_b, acts->lnout, acts->B, acts->T, acts->C,
                                    (float)m->ctx.ln_eps);
}

/* tokens: [B][T]; fills acts: block_in, v_first, lnout, logits */
static int forward_batch(rx_ptmodel *m, const int *tokens, int B, int T, rx_pt_acts *acts) {
    static const char *const fn = "rx_pretrain_forward_batch";
    if (!m || !tokens || !acts)
        return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, !m ? "model" : !tokens ? "tokens" : "acts");
    if (!acts_fit(m, acts, B, T))
        return rx_fail(RX_EINVAL, "%s: acts were made for B = %d, T = %d (or another model), "
                       "called with B = %d, T = %d", fn, acts->B, acts->T, B, T);
    if (m->state0 && !acts->saved->s)
        return rx_fail(RX_EINVAL, "%s: acts were made before rx_ptmodel_enable_state; make "
                       "them again", fn);
    const int V = m->cfg.vocab_size, C = m->cfg.n_embd, BT = B * T;
    /* copy into the backward's scratch (work), check the copy, then keep
     * it: a caller's thread writing to tokens meanwhile cannot slip an id
     * past the check into the embedding, and a rejected call leaves the
     * previous forward intact */
    unsigned char *copy = (unsigned char *)acts->work;
    memcpy(copy, tokens, (size_t)BT * sizeof(int));
    for (int i = 0; i < BT; i++) {
        int t;
        memcpy(&t, copy + (size_t)i * sizeof(int), sizeof t);
        if (t < 0 || t >= V)
            return rx_fail(RX_EINVAL, "%s: token %d at position %d is outside [0, %d)", fn, t, i,
                           V);
    }
    acts->ready = 0;
    memcpy(acts->tokens, copy, (size_t)BT * sizeof(int));
    const size_t rowc = (size_t)BT * (size_t)C;
    int rc;
    if (m->ln0_w) {
        /* the raw rows go through scratch; the backward gathers them again */
        rc = emb_gather(m, acts, BT, acts->work);
        if (rc == RX_OK)
            rx_rownorm_forward(acts->work, m->ln0_w, m->ln0_b, acts->block_in, NULL, NULL,
                               (size_t)BT, (size_t)C, 1, (float)m->ctx.ln_eps);
    } else {
        rc = emb_gather(m, acts, BT, acts->block_in);
    }
    for (int L = 0; L < m->n_blocks && rc == RX_OK; L++)
        rc = block_forward(m, acts, L, acts->block_in + (size_t)(L + 1) * rowc);
    if (rc == RX_OK) rc = lnout_forward(m, acts);
    if (rc == RX_OK && acts->logits)
        rc = rx_head_logits(acts->lnout, m->head, BT, C, V, acts->logits);
    if (rc != RX_OK) return rc;
    acts->ready = 1;
    return RX_OK;
}

/* forward_batch with the projections in the model's precision */
int rx_pretrain_forward_batch(rx_ptmodel *m, const int *tokens, int B, int T, rx_pt_acts *acts) {
    if (m && m->base && !rx_base_loaded(m->base))
        return rx_fail(RX_EINVAL, "rx_pretrain_forward_batch: the model's base is not filled");
    const int old = rx_gemm_set_precision(m ? m->precision : RX_PRECISION_FP32);
    const rx_lora *was = rx_gemm_set_lora(m && m->lora_on ? m->lora : NULL);
    const rx_base *was_base = rx_gemm_set_base(m ? m->base : NULL);
    const int rc = forward_batch(m, tokens, B, T, acts);
    rx_gemm_set_base(was_base);
    rx_gemm_set_lora(was);
    rx_gemm_set_precision(old);
    return rc;
}

int rx_pretrain_forward(rx_ptmodel *m, const int *tokens, int T, rx_pt_acts *acts) {
    return rx_pretrain_forward_batch(m, tokens, 1, T, acts);
}

/* ---- backward ------------------------------------------------------------ */

/* RX_OK when a loss call's arguments are there and its acts hold a forward
 * of this model at B x T; else RX_EINVAL through rx_fail, naming fn. */
static int check_loss_call(const char *fn, const rx_ptmodel *m, const rx_pt_acts *acts,
                           const int *targets, const double *loss, int B, int T) {
    if (!m || !acts || !targets || !loss)
        return rx_fail(RX_EINVAL, "%s: %s is NULL", fn,
                       !m ? "model" : !acts ? "acts" : !targets ? "targets" : "loss");
    if (!acts_fit(m, acts, B, T))
        return rx_fail(RX_EINVAL, "%s: acts were made for B = %d, T = %d (or another model), "
                       "called with B = %d, T = %d", fn, acts->B, acts->T, B, T);
    if (!acts->ready) return rx_fail(RX_EINVAL, "%s: acts hold no forward", fn);
    return RX_OK;
}

/* targets: [B][T]; returns the mean loss over the valid positions of the
 * batch and writes the grads of that mean into the grad arena. With w
 * [B][T] (the rows form, fn names it) the grads are those of
 * sum_t w[t] * loss[t] instead, and row_loss [B][T] gets each loss[t]. */
static int backward_batch(const char *fn, rx_ptmodel *m, const rx_pt_acts *acts,
                          const int *targets, int B, int T, int ignore_index, const double *w,
                          double *row_loss, double *loss_out) {
    int rc = check_loss_call(fn, m, acts, targets, loss_out, B, T);
    if (rc != RX_OK) return rc;
    const int V = m->cfg.vocab_size, C = m->cfg.n_embd, BT = B * T;
    for (int i = 0; i < BT; i++) {
        int t = targets[i];
        if ((ignore_index < 0 || t != ignore_index) && (t < 0 || t >= V))
            return rx_fail(RX_EINVAL, "%s: target %d at position %d is outside [0, %d) and is "
                           "not ignore_index %d", fn, t, i, V, ignore_index);
    }
    const size_t rowc = (size_t)BT * (size_t)C;
    float *dcur = acts->work, *dnext = acts->work + rowc;
    float *dvf_sum = acts->work + 2 * rowc, *dvf_one = acts->work + 3 * rowc;
    float *bwork = acts->saved->work;
    /* the same call as the forward's: the same bits */
    if (acts->saved->lnout_stale && (rc = lnout_forward(m, acts)) != RX_OK) return rc;

    /* targets are valid here, so a NaN loss means non-finite logits: the
     * NaN grads still go through, as the grads of this call */
    double loss;
    if (w && acts->logits) {
        rc = rx_cross_entropy_rows(acts->logits, targets, BT, V, ignore_index, w, acts->dlogits,
                                   row_loss);
        loss = 0.0;
        if (rc == RX_OK)
            rx_l2wrap_rows(acts->logits, acts->dlogits, (size_t)BT, (size_t)V,
                           m->ctx.l2wrap / (double)BT);
        if (rc == RX_OK)
            rc = rx_head_grads(acts->lnout, m->head, acts->dlogits, BT, C, V, dnext, m->g_head);
    } else if (w) {
        rc = rx_head_loss_rows(acts->lnout, m->head, targets, BT, C, V, ignore_index, m->ctx.l2wrap,
                               w, acts->head_rows, acts->dlogits, dnext, m->g_head, row_loss);
        loss = 0.0;
    } else if (acts->logits) {
        rc = rx_cross_entropy(acts->logits, targets, BT, V, ignore_index, acts->dlogits, &loss);
        if (rc == RX_OK)
            rx_l2wrap_rows(acts->logits, acts->dlogits, (size_t)BT, (size_t)V,
                           m->ctx.l2wrap / (double)BT);
        if (rc == RX_OK)
            rc = rx_head_grads(acts->lnout, m->head, acts->dlogits, BT, C, V, dnext, m->g_head);
    } else {
        rc = rx_head_loss(acts->lnout, m->head, targets, BT, C, V, ignore_index, m->ctx.l2wrap,
                          acts->head_rows, acts->dlogits, dnext, m->g_head, &loss);
    }
    if (rc == RX_OK)
        rc = rx_layernorm_backward_eps(acts->block_in + (size_t)m->n_blocks * rowc,
                                       m->ln_out_w, m->ln_out_b, dnext, dcur, m->g_ln_out_w,
                                       m->g_ln_out_b, B, T, C, (float)m->ctx.ln_eps);
    /* dcur: grad on the residual leaving block L. Every RWKV block after
     * the first reads v_first; their grads on it are summed into dvf_sum and
     * handed to RWKV block 0 (always the first block), which produced it. */
    int have_dvf = 0;
    float *ds = m->state0 ? acts->saved->ds : NULL;   /* the initial states' grads, or none */
    for (int L = m->n_blocks - 1; L >= 0 && rc == RX_OK; L--) {
        const float *x = acts->block_in + (size_t)L * rowc;
        int i = m->block_idx[L];
        rc = block_recompute(m, acts, L);
        acts->saved->lnout_stale = acts->saved->recompute;   /* dvf_sum is lnout */
        /* a block's backward takes the scratch that holds part of the lean
         * set and overwrites the rest of it: the shared sets hold no block */
        acts->saved->held_r = acts->saved->held_a = -1;
        if (rc != RX_OK) break;
        if (m->layers[L] == 'A') {
            rc = rx_attn_backward_acts(&m->ctx, &m->attn[i], attn_acts(acts->saved, m, i), x, NULL,
                                       dcur, &m->attn_g[i], dnext, NULL, bwork);
        } else if (i > 0) {
            float *dvf = have_dvf ? dvf_one : dvf_sum;
            rc = rx_block_backward_state(&m->ctx,
                                         &m->rwkv[i], rwkv_acts(acts->saved, i), x, NULL, NULL,
                                         acts->v_first, dcur, &m->rwkv_g[i], dnext, NULL, NULL,
                                         dvf, ds, bwork);
            if (have_dvf)
                for (size_t e = 0; e < rowc; e++) dvf_sum[e] += dvf_one[e];
            have_dvf = 1;
        } else {
            rc = rx_block_backward_state(&m->ctx,
                                         &m->rwkv[0], rwkv_acts(acts->saved, 0), x, NULL, NULL,
                                         acts->v_first, dcur, &m->rwkv_g[0], dnext, NULL, NULL,
                                         have_dvf ? dvf_sum : NULL, ds, bwork);
        }
        if (rc == RX_OK && ds && m->layers[L] == 'R') reduce_state_grad(m, i, B, ds);
        float *s = dcur;
        dcur = dnext;
        dnext = s;
    }
    /* with emb (and ln0) frozen, nothing below is wanted */
    const size_t emb_off = (size_t)(m->emb - m->params), V_C = (size_t)V * (size_t)C;
    const int emb_frozen = is_frozen(m, emb_off, V_C) || rx_base_find(m->base, m->emb);
    if (emb_frozen && (!m->ln0_w || is_frozen(m, emb_off + V_C, 2 * (size_t)C))) {
        if (rc == RX_OK) *loss_out = loss;
        return rc;
    }
    if (rc == RX_OK && m->ln0_w) {
        /* dcur is the grad on ln0's output; the raw rows are gathered again
         * into the free dnext, and the grad on them overwrites dcur */
        rc = emb_gather(m, acts, BT, dnext);
        if (rc == RX_OK)
            rc = rx_layernorm_backward_eps(dnext, m->ln0_w, m->ln0_b, dcur, dcur, m->g_ln0_w,
                                           m->g_ln0_b, B, T, C, (float)m->ctx.ln_eps);
    }
    if (rc == RX_OK && !emb_frozen)
        rc = rx_embedding_scatter(acts->tokens, BT, C, V, dcur, m->g_emb);
    if (rc == RX_OK) *loss_out = loss;
    return rc;
}

/* backward_batch with the projections in the model's precision */
int rx_pretrain_backward_loss(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets, int B,
                              int T, int ignore_index, double *loss) {
    const int old = rx_gemm_set_precision(m ? m->precision : RX_PRECISION_FP32);
    const rx_frozen f = {m ? m->grads : NULL, m ? m->frozen : NULL, m ? m->n_frozen : 0};
    const rx_frozen was = rx_gemm_set_frozen(f);
    /* a recompute's forward and the dx and weight-grad products see the adapters */
    const rx_lora *was_lora = rx_gemm_set_lora(m && m->lora_on ? m->lora : NULL);
    const rx_base *was_base = rx_gemm_set_base(m ? m->base : NULL);
    const int rc = backward_batch("rx_pretrain_backward_loss", m, acts, targets, B, T,
                                  ignore_index, NULL, NULL, loss);
    rx_gemm_set_base(was_base);
    rx_gemm_set_lora(was_lora);
    rx_gemm_set_frozen(was);
    rx_gemm_set_precision(old);
    return rc;
}

/* targets, weight, row_loss: [B][T]; backward_batch's rows form */
int rx_pretrain_backward_rows(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets, int B,
                              int T, int ignore_index, const double *weight, double *row_loss) {
    static const char *const fn = "rx_pretrain_backward_rows";
    if (!weight || !row_loss)
        return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, !weight ? "weight" : "row_loss");
    const int old = rx_gemm_set_precision(m ? m->precision : RX_PRECISION_FP32);
    const rx_frozen f = {m ? m->grads : NULL, m ? m->frozen : NULL, m ? m->n_frozen : 0};
    const rx_frozen was = rx_gemm_set_frozen(f);
    const rx_lora *was_lora = rx_gemm_set_lora(m && m->lora_on ? m->lora : NULL);
    const rx_base *was_base = rx_gemm_set_base(m ? m->base : NULL);
    double unused;
    const int rc = backward_batch(fn, m, acts, targets, B, T, ignore_index, weight, row_loss,
                                  &unused);
    rx_gemm_set_base(was_base);
    rx_gemm_set_lora(was_lora);
    rx_gemm_set_frozen(was);
    rx_gemm_set_precision(old);
    return rc;
}

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

double rx_pretrain_backward_batch(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets,
                                  int B, int T, int ignore_index) {
    double loss;
    int rc = rx_pretrain_backward_loss(m, acts, targets, B, T, ignore_index, &loss);
    return rc == RX_OK ? loss : NAN;
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

double rx_pretrain_backward(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets, int T,
                            int ignore_index) {
    double loss;
    int rc = rx_pretrain_backward_loss(m, acts, targets, 1, T, ignore_index, &loss);
    return rc == RX_OK ? loss : NAN;
}

/* the checks of backward_batch, then the loss alone (row_loss [B][T] not
 * NULL: each position's loss instead, as rx_pretrain_row_losses) */
static int loss_batch(const char *fn, rx_ptmodel *m, const rx_pt_acts *acts, const int *targets,
                      int B, int T, int ignore_index, double *row_loss, double *loss) {
    int rc = check_loss_call(fn, m, acts, targets, loss, B, T);
    if (rc != RX_OK) return rc;
    if (acts->saved->lnout_stale && (rc = lnout_forward(m, acts)) != RX_OK) return rc;
    const int V = m->cfg.vocab_size, C = m->cfg.n_embd, BT = B * T;
    if (row_loss && acts->logits)
        return rx_cross_entropy_rows(acts->logits, targets, BT, V, ignore_index, NULL, NULL,
                                     row_loss);
    if (row_loss)
        return rx_head_loss_rows(acts->lnout, m->head, targets, BT, C, V, ignore_index, 0.0,
                                 NULL, acts->head_rows, acts->dlogits, NULL, NULL, row_loss);
    if (acts->logits)
        return rx_cross_entropy(acts->logits, targets, BT, V, ignore_index, NULL, loss);
    return rx_head_loss(acts->lnout, m->head, targets, BT, C, V, ignore_index, 0.0,
                        acts->head_rows, acts->dlogits, NULL, NULL, loss);
}

int rx_pretrain_loss(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets, int B, int T,
                     int ignore_index, double *loss) {
    const int old = rx_gemm_set_precision(m ? m->precision : RX_PRECISION_FP32);
    const rx_base *was_base = rx_gemm_set_base(m ? m->base : NULL);
    const int rc = loss_batch("rx_pretrain_loss", m, acts, targets, B, T, ignore_index, NULL,
                              loss);
    rx_gemm_set_base(was_base);
    rx_gemm_set_precision(old);
    return rc;
}

int rx_pretrain_row_losses(rx_ptmodel *m, const rx_pt_acts *acts, const int *targets, int B,
                           int T, int ignore_index, double *row_loss) {
    static const char *const fn = "rx_pretrain_row_losses";
    if (!row_loss) return rx_fail(RX_EINVAL, "%s: row_loss is NULL", fn);
    const int old = rx_gemm_set_precision(m ? m->precision : RX_PRECISION_FP32);
    const rx_base *was_base = rx_gemm_set_base(m ? m->base : NULL);
    double unused;
    const int rc = loss_batch(fn, m, acts, targets, B, T, ignore_index, row_loss, &unused);
    rx_gemm_set_base(was_base);
    rx_gemm_set_precision(old);
    return rc;
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

/* ---- LoRA adapters (docs/maths.md §LoRA, lora.c) ----------------------- */

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

/* L holds r, alpha and one adapter on each of params [n], in that order */
static int same_adapters(const rx_lora *L, int r, double alpha, const int *params, int n) {
    int lr;
    double la;
    if (rx_lora_count(L, &lr, &la) != n || lr != r || la != alpha) return 0;
    for (int i = 0; i < n; i++) {
        int p;
        int64_t a, b;
        if (rx_lora_adapter(L, i, &p, &a, &b) != RX_OK || p != params[i]) return 0;
    }
    return 1;
}

int rx_ptmodel_enable_lora(rx_ptmodel *m, int r, double alpha, const int *params, int n) {
    static const char *const fn = "rx_ptmodel_enable_lora";
    if (!m || !params) return rx_fail(RX_EINVAL, "%s: %s is NULL", fn, !m ? "model" : "params");
    if (m->lora) {
        /* a disabled model takes the very same adapters back, in their old
         * arena (a rollback across a LoRA run's base-unfreeze); anything
         * else would move the binding's views under its feet */
        if (!m->lora_on && same_adapters(m->lora, r, alpha, params, n)) {
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
    if (rc == RX_OK) rc = rx_lora_create(r, alpha, t, n, &m->lora);
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

float *rx_ptmodel_lora_arena(rx_ptmodel *m, int64_t *n) {
    return rx_lora_arena(m && m->lora_on ? m->lora : NULL, n);
}

float *rx_ptmodel_lora_grad_arena(rx_ptmodel *m, int64_t *n) {
    return rx_lora_grad_arena(m && m->lora_on ? m->lora : NULL, n);
}
