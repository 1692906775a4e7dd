/* SPDX-License-Identifier: AGPL-3.0-or-later AND Apache-2.0
 *
 * base.c -- the frozen base's store: weight matrices that do not train,
 * held only in a compact format the projection GEMM reads (docs/layout.md
 * §Frozen base, docs/finetune.md §The frozen base), rows of W^T [out][in]
 * in one of the dtypes of rx_base_types (base_types.c: bf16, GGUF q8_0).
 *
 * W^T is torch's [out][in] orientation: an official .pth tensor is copied
 * in as it is. A bf16 base of a model that computes in bf16 is stored
 * instead as the bf16 GEMM's own packed op(B) of each forward product
 * (rx_base_create's packed): the forward reads it in place, and the dX
 * product's packing is a transpose of whole 64-bit words (pack_t_packed),
 * where rows cost a pack per product, about a quarter of a 1.5B LoRA
 * step. A base tensor keeps its place in the parameter arena, but
 * only as address space: the model's arenas are mapped lazily
 * (RX_PT_NO_INIT) and a base tensor's float32 pages are released here and
 * never written again, so they take no memory. The products that read W
 * are recognised by their B pointer (as lora.c recognises adapted weights):
 * rx_pgemm_batch, while the model's base is set for the thread
 * (rx_gemm_set_base), marks each such op, and the fp32 and bf16 GEMMs have
 * op(B) packed from the store instead of the arena (base_pack.c's
 * rx_base_source). Decoding is exact (a bf16 or q*d is a float32), so
 * at fp32 precision the model computes bit for bit what a float32 model
 * holding the decoded weights computes; the weight-grad product of a base
 * tensor is never run (its grad is not kept), the dX products are.
 */
#include <stdatomic.h>
#include <sys/mman.h>
#include <unistd.h>

#include "rx_base.h"

struct rx_base {
    int dtype, n;
    size_t bytes;
    rx_base_mat *mats;     /* [n] in arena order */
    unsigned char *store;  /* every tensor's rows, one allocation */
    uint64_t version;      /* unique to this store's contents: new at creation and every fill */
};

/* versions are drawn from one counter, so no two stores' contents (nor one
 * store's before and after a fill) share one */
static _Atomic uint64_t versions;

static uint64_t new_version(void) { return atomic_fetch_add(&versions, 1) + 1; }

/* ---- the store ----------------------------------------------------------- */

void rx_base_free(rx_base *s) {
    if (!s) return;
    free(s->store);
    free(s->mats);
    free(s);
}

/* Releases the whole pages inside [p, p + n floats): they read as zero and
 * take no memory until written (anonymous private memory, which the lazy
 * arenas are); a no-op where madvise cannot. */
static void release_pages(float *p, size_t n) {
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t b = ((uintptr_t)p + pg - 1) / pg * pg, e = (uintptr_t)(p + n) / pg * pg;
    if (e > b) (void)madvise((void *)b, e - b, MADV_DONTNEED);
}

/* bytes of a tensor's store */
static size_t mat_bytes(const rx_base_mat *b) {
    return b->packed ? b->np * b->nkc * RX_BT_K * 2 : b->out * rx_base_type_row_bytes(b->ty, b->in);
}

int rx_base_create(int dtype, const rx_base_target *t, int n, int packed, rx_base **out) {
    static const char *const fn = "rx_ptmodel_set_base";
    *out = NULL;
    const rx_base_type *ty = rx_base_type_of(dtype);
    if (!ty) return rx_fail(RX_EINVAL, "%s: unknown dtype %d", fn, dtype);
    rx_base *s = calloc(1, sizeof *s);
    if (!s) return rx_fail(RX_ENOMEM, "%s: out of memory", fn);
    s->dtype = dtype;
    s->n = n;
    s->version = new_version();
    s->mats = calloc((size_t)n, sizeof *s->mats);
    for (int i = 0; s->mats && i < n; i++) {
        rx_base_mat *b = &s->mats[i];
        b->in = t[i].in;
        b->out = t[i].out;
        b->ty = ty;
        b->rows = t[i].rows;
        b->packed = packed && ty->bf16_exact && !b->rows;
        b->np = (b->out + RX_BT_BLK - 1) / RX_BT_BLK * RX_BT_BLK;
        b->nkc = (b->in + RX_BT_K - 1) / RX_BT_K;
        s->bytes += mat_bytes(b);
    }
    /* every byte is written once the base is filled: huge pages pay */
    s->store = s->mats ? rx_alloc_huge(s->bytes) : NULL;
    if (!s->mats || !s->store) {
        const size_t bytes = s->bytes;
        rx_base_free(s);
        return rx_fail(RX_ENOMEM, "%s: out of memory for a base of %zu bytes", fn, bytes);
    }
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        rx_base_mat *b = &s->mats[i];
        b->W = t[i].W;
        b->GW = t[i].GW;
        b->param = t[i].param;
        b->data = s->store + off;
        off += mat_bytes(b);
        release_pages((float *)t[i].W, b->in * b->out);
        release_pages((float *)t[i].GW, b->in * b->out);
    }
    *out = s;
    return RX_OK;
}

int rx_base_dtype(const rx_base *s) { return s ? s->dtype : RX_BASE_NONE; }

size_t rx_base_bytes(const rx_base *s) { return s ? s->bytes : 0; }

int rx_base_count(const rx_base *s) { return s ? s->n : 0; }

const rx_base_mat *rx_base_by_param(const rx_base *s, int param) {
    for (int i = 0; s && i < s->n; i++)
        if (s->mats[i].param == param) return &s->mats[i];
    return NULL;
}

const rx_base_mat *rx_base_at(const rx_base *s, int i) {
    return s && i >= 0 && i < s->n ? &s->mats[i] : NULL;
}

int rx_base_param(const rx_base_mat *b) { return b->param; }

int rx_base_loaded(const rx_base *s) {
    for (int i = 0; s && i < s->n; i++)
        if (!s->mats[i].loaded) return 0;
    return 1;
}

/* the base tensor whose arena slot is W, or NULL */
const rx_base_mat *rx_base_find(const rx_base *s, const float *W) {
    for (int i = 0; s && i < s->n; i++)
        if (s->mats[i].W == W) return &s->mats[i];
    return NULL;
}

/* the base tensor whose grad slot C starts inside, or NULL */
int rx_base_grad_slot(const rx_base *s, const float *C) {
    for (int i = 0; s && i < s->n; i++) {
        const rx_base_mat *b = &s->mats[i];
        if (C >= b->GW && C < b->GW + b->in * b->out) return 1;
    }
    return 0;
}

void rx_base_zero_grads(const rx_base *s, float *grads, size_t n) {
    size_t at = 0;
    for (int i = 0; s && i < s->n; i++) {   /* in arena order */
        const size_t b = (size_t)(s->mats[i].GW - grads);
        if (b > at) rx_fzero(grads + at, b - at);
        at = b + s->mats[i].in * s->mats[i].out;
    }
    if (n > at) rx_fzero(grads + at, n - at);
}

/* the bf16 GEMM's operand rounding of a stored bf16: a subnormal becomes
 * a signed zero, anything else stays */
static inline uint16_t operand_of_bf16(uint16_t h) {
    return (h & 0x7f80u) ? h : (uint16_t)(h & 0x8000u);
}

/* row j of W^T (in bf16 values) into a packed store, as the GEMM reads it */
static void place_row(const rx_base_mat *b, size_t j, const uint16_t *enc) {
    uint16_t *d = (uint16_t *)(void *)b->data;
    for (size_t k = 0; k < b->in; k++) d[pk_index(b, j, k)] = operand_of_bf16(enc[k]);
}

/* src: W^T [out][in] (src_t) or W [in][out], float32 or bf16 (RX_BASE_BF16
 * as kind: uint16 bits); or, kind the store's block dtype, its stored rows
 * of W^T (src_t) */
int rx_base_fill(rx_base *s, int i, const void *src, int kind, int src_t) {
    rx_base_mat *b = &s->mats[i];
    const rx_base_type *ty = b->ty;
    if (kind == s->dtype && kind != RX_BASE_BF16) {
        /* a block dtype's own rows of W^T (a GGUF file's blocks): copied as
         * they are, never decoded and quantized again */
        memcpy(b->data, src, mat_bytes(b));
        b->loaded = 1;
        s->version = new_version();
        return RX_OK;
    }
    const size_t rb = rx_base_type_row_bytes(ty, b->in);
    /* bf16 rows in W^T's orientation go straight in where the dtype can */
    const int direct = src_t && kind == RX_BASE_BF16 && ty->from_bf16;
    float *row = direct ? NULL : rx_falloc(b->in);
    /* packed: each row encoded here, then placed (padding: zeros) */
    uint16_t *enc = b->packed ? rx_alloc(b->in, sizeof *enc) : NULL;
    if ((!direct && !row) || (b->packed && !enc)) {
        free(row);
        free(enc);
        return rx_fail(RX_ENOMEM, "rx_ptmodel_base_fill: out of memory");
    }
    if (b->packed) memset(b->data, 0, mat_bytes(b));
    const float *f = src;
    const uint16_t *h = src;
    for (size_t j = 0; j < b->out; j++) {
        if (j && b->packed) place_row(b, j - 1, enc);
        unsigned char *dst = b->packed ? (unsigned char *)enc : b->data + j * rb;
        if (direct) {
            ty->from_bf16(h + j * b->in, b->in, dst);
            continue;
        }
        for (size_t k = 0; k < b->in; k++) {
            const size_t e = src_t ? j * b->in + k : k * b->out + j;
            row[k] = kind == RX_BASE_BF16 ? bf16_f32(h[e]) : f[e];
        }
        ty->from_float(row, b->in, dst);
    }
    if (b->packed && b->out) place_row(b, b->out - 1, enc);
    free(row);
    free(enc);
    b->loaded = 1;
    s->version = new_version();
    return RX_OK;
}

/* W [in][out] (a rows tensor: [out][in]) decoded into dst */
void rx_base_read(const rx_base *s, const rx_base_mat *b, float *dst) {
    for (size_t j = 0; j < b->out; j++) {
        if (b->rows) {
            rx_base_row(b, j, dst + j * b->in);
            continue;
        }
        for (size_t k = 0; k < b->in; k++) dst[k * b->out + j] = rx_base_at_jk(b, j, k);
    }
    (void)s;
}

const unsigned char *rx_base_data(const rx_base_mat *b, size_t *bytes) {
    if (bytes) *bytes = mat_bytes(b);
    return b->data;
}

void rx_base_rows(const rx_base_mat *b, void *dst) {
    if (!b->packed) {
        memcpy(dst, b->data, mat_bytes(b));
        return;
    }
    const uint16_t *d = (const uint16_t *)(const void *)b->data;
    uint16_t *o = dst;
    for (size_t j = 0; j < b->out; j++)
        for (size_t k = 0; k < b->in; k++) o[j * b->in + k] = d[pk_index(b, j, k)];
}

void rx_base_row(const rx_base_mat *b, size_t j, float *dst) {
    b->ty->decode(b->data + j * rx_base_type_row_bytes(b->ty, b->in), 0, b->in, dst);
}

/* rx_base_columns: a base tensor's column o of W, stored row o of W^T,
 * packed or in rows */
static const void *columns_find(const void *src, const float *W) {
    return rx_base_find(src, W);
}

static void columns_read(const void *held, size_t o, float *dst) {
    const rx_base_mat *b = held;
    if (!b->packed) {
        rx_base_row(b, o, dst);
        return;
    }
    for (size_t i = 0; i < b->in; i++) dst[i] = rx_base_at_jk(b, o, i);
}

static uint64_t columns_version(const void *src) { return ((const rx_base *)src)->version; }

const rx_weight_columns rx_base_columns = {columns_find, columns_read, columns_version};

/* Every base tensor decoded into its arena slot, the store freed: the
 * model holds float32 weights again (the base-unfreeze). */
int rx_base_materialise(rx_base *s) {
    for (int i = 0; s && i < s->n; i++) {
        const rx_base_mat *b = &s->mats[i];
        rx_base_read(s, b, (float *)b->W);
    }
    return RX_OK;
}
