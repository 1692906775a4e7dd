# MoBA-sparse attention block and its score/AV test hooks (docs/maths.md §Blocks). Included by _core.pyx.
from libc.string cimport memset

_ATTN_KEYS = ("ln1_w", "ln1_b", "receptance_w", "key_w", "value_w", "output_w",
              "ln2_w", "ln2_b", "cm.ffn_x_k", "cm.ffn_key_w", "cm.ffn_value_w")


cdef object _attn_dims(object x, str name, int n_head, int head_size):
    """(B, T) of a (B, T, n_head*head_size) float32 array."""
    _arr(x, name, np.float32, 3)
    C = n_head * head_size
    if x.shape[2] != C:
        raise ValueError(f"{name} has {x.shape[2]} channels, expected n_head*head_size = {C}")
    return x.shape[0], x.shape[1]


cdef int _attn_topk(object v) except? -1:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"moba_top_k must be an int, got {type(v).__name__}")
    if v < _INT_MIN or v > _INT_MAX:
        raise ValueError(f"moba_top_k {v} exceeds the C API's int range")
    return v


cdef int _attn_fill(rx_attn_params *P, object p, int C, int n_head, int head_size,
                    int chunk_size, int moba_top_k) except -1:
    """Check the params dict (exact keys, float32, C-contiguous, shapes) and point P at it."""
    if not isinstance(p, dict):
        raise TypeError(f"p must be a dict of float32 arrays, got {type(p).__name__}")
    missing = [key for key in _ATTN_KEYS if key not in p]
    if missing:
        raise ValueError(f"p is missing {missing[0]!r}")
    extra = sorted(str(key) for key in p if key not in _ATTN_KEYS)
    if extra:
        raise ValueError(f"p has an unexpected entry {extra[0]!r}")
    _arr(p["cm.ffn_key_w"], "p['cm.ffn_key_w']", np.float32, 2)
    cdef int F = p["cm.ffn_key_w"].shape[1]
    shapes = {"ln1_w": (C,), "ln1_b": (C,), "receptance_w": (C, C), "key_w": (C, C),
              "value_w": (C, C), "output_w": (C, C), "ln2_w": (C,), "ln2_b": (C,),
              "cm.ffn_x_k": (C,), "cm.ffn_key_w": (C, F), "cm.ffn_value_w": (F, C)}
    for key in _ATTN_KEYS:
        _f32(p[key], f"p[{key!r}]", shapes[key])
    P.c = C
    P.n_head = n_head
    P.head_size = head_size
    P.chunk_size = chunk_size
    P.moba_top_k = moba_top_k
    P.ln1_w = _ptr(p["ln1_w"])
    P.ln1_b = _ptr(p["ln1_b"])
    P.receptance_w = _ptr(p["receptance_w"])
    P.key_w = _ptr(p["key_w"])
    P.value_w = _ptr(p["value_w"])
    P.output_w = _ptr(p["output_w"])
    P.ln2_w = _ptr(p["ln2_w"])
    P.ln2_b = _ptr(p["ln2_b"])
    P.cm.c = C
    P.cm.ffn_dim = F
    P.cm.ffn_x_k = _ptr(p["cm.ffn_x_k"])
    P.cm.ffn_key_w = _ptr(p["cm.ffn_key_w"])
    P.cm.ffn_value_w = _ptr(p["cm.ffn_value_w"])
    return 0


cdef int _attn_hook_params(rx_attn_params *P, int n_head, int head_size, int chunk_size,
                           int moba_top_k) except -1:
    memset(P, 0, sizeof(rx_attn_params))
    P.c = n_head * head_size
    P.n_head = n_head
    P.head_size = head_size
    P.chunk_size = chunk_size
    P.moba_top_k = moba_top_k
    return 0


def attn_forward(p, x, cm_xprev_init=None, *, n_head, head_size, chunk_size, moba_top_k):
    """MoBA-sparse attention block (docs/maths.md §Blocks).

    p             : dict of float32 arrays, exactly the keys 'ln1_w', 'ln1_b' (C,),
                    'receptance_w', 'key_w', 'value_w', 'output_w' (C, C), 'ln2_w',
                    'ln2_b' (C,), 'cm.ffn_x_k' (C,), 'cm.ffn_key_w' (C, F),
                    'cm.ffn_value_w' (F, C); C = n_head*head_size
    x             : float32 (B, T, C)
    cm_xprev_init : float32 (B, C) channel-mix token-shift carry over ln2(x1), or None (zero)
    chunk_size >= 1; moba_top_k <= 0 keeps every earlier chunk.
    Returns out (B, T, C).
    """
    cdef int H = _size(n_head, "n_head"), N = _size(head_size, "head_size")
    cdef int cs = _size(chunk_size, "chunk_size"), topk = _attn_topk(moba_top_k)
    B, T = _attn_dims(x, "x", H, N)
    cdef int C = H * N, Bi = B, Ti = T
    cdef rx_attn_params P
    _attn_fill(&P, p, C, H, N, cs, topk)
    _f32_opt(cm_xprev_init, "cm_xprev_init", (B, C))
    out = _empty(B, T, C)
    cdef const float *px = _ptr(x)
    cdef const float *pc = _ptr(cm_xprev_init)
    cdef float *po = _wptr(out)
    cdef int rc
    with nogil:
        rc = rx_attn_forward_seq(&P, px, pc, po, Bi, Ti)
    _check_rc(rc, "attn_forward")
    return out


def attn_backward(p, x, dy, cm_xprev_init=None, *, n_head, head_size, chunk_size, moba_top_k):
    """Backward of attn_forward; the chunk selection is recomputed and held fixed.

    dy : float32 (B, T, C), the grad on out.
    Returns (dx, grads, d_cm_xprev): dx (B, T, C); grads a dict with the keys and
    shapes of p; d_cm_xprev (B, C), the grad on cm_xprev_init (on a zero carry
    when it is None).
    """
    cdef int H = _size(n_head, "n_head"), N = _size(head_size, "head_size")
    cdef int cs = _size(chunk_size, "chunk_size"), topk = _attn_topk(moba_top_k)
    B, T = _attn_dims(x, "x", H, N)
    cdef int C = H * N, Bi = B, Ti = T
    cdef rx_attn_params P
    _attn_fill(&P, p, C, H, N, cs, topk)
    _f32(dy, "dy", (B, T, C))
    _f32_opt(cm_xprev_init, "cm_xprev_init", (B, C))
    grads = {key: _empty(*p[key].shape) for key in _ATTN_KEYS}
    dx, dcm = _empty(B, T, C), _empty(B, C)
    cdef rx_attn_grads G
    G.ln1_w = _wptr(grads["ln1_w"])
    G.ln1_b = _wptr(grads["ln1_b"])
    G.receptance_w = _wptr(grads["receptance_w"])
    G.key_w = _wptr(grads["key_w"])
    G.value_w = _wptr(grads["value_w"])
    G.output_w = _wptr(grads["output_w"])
    G.ln2_w = _wptr(grads["ln2_w"])
    G.ln2_b = _wptr(grads["ln2_b"])
    G.cm.ffn_x_k = _wptr(grads["cm.ffn_x_k"])
    G.cm.ffn_key_w = _wptr(grads["cm.ffn_key_w"])
    G.cm.ffn_value_w = _wptr(grads["cm.ffn_value_w"])
    cdef const float *px = _ptr(x)
    cdef const float *pdy = _ptr(dy)
    cdef const float *pc = _ptr(cm_xprev_init)
    cdef float *pdx = _wptr(dx)
    cdef float *pdc = _wptr(dcm)
    cdef int rc
    with nogil:
        rc = rx_attn_backward_full(&P, px, pc, pdy, &G, pdx, pdc, Bi, Ti)
    _check_rc(rc, "attn_backward")
    return dx, grads, dcm


def attn_score_av_forward(q, k, v, *, n_head, head_size, chunk_size, moba_top_k):
    """Sparse attention core alone (test hook): selection, softmax, weighted values.

    q, k, v : float32 (B, T, C), C = n_head*head_size, heads laid out (B, T, H, N)
    Returns (p, y): p (B, H, T, T) softmax weights, exactly zero on keys that are
    not attended; y (B, T, C).
    """
    cdef int H = _size(n_head, "n_head"), N = _size(head_size, "head_size")
    cdef int cs = _size(chunk_size, "chunk_size"), topk = _attn_topk(moba_top_k)
    B, T = _attn_dims(q, "q", H, N)
    cdef int C = H * N, Bi = B, Ti = T
    _f32(k, "k", (B, T, C))
    _f32(v, "v", (B, T, C))
    cdef rx_attn_params P
    _attn_hook_params(&P, H, N, cs, topk)
    pm, y = _empty(B, H, T, T), _empty(B, T, C)
    cdef const float *pq = _ptr(q)
    cdef const float *pk = _ptr(k)
    cdef const float *pv = _ptr(v)
    cdef float *pp = _wptr(pm)
    cdef float *py = _wptr(y)
    cdef int rc
    with nogil:
        rc = rx_attn_score_av_forward(&P, pq, pk, pv, Bi, Ti, pp, py)
    _check_rc(rc, "attn_score_av_forward")
    return pm, y


def attn_score_av_backward(q, k, v, dy, *, n_head, head_size, chunk_size, moba_top_k):
    """Backward of attn_score_av_forward with the selection held fixed.

    q, k, v, dy : float32 (B, T, C). Returns (dq, dk, dv), each (B, T, C).
    """
    cdef int H = _size(n_head, "n_head"), N = _size(head_size, "head_size")
    cdef int cs = _size(chunk_size, "chunk_size"), topk = _attn_topk(moba_top_k)
    B, T = _attn_dims(q, "q", H, N)
    cdef int C = H * N, Bi = B, Ti = T
    _f32(k, "k", (B, T, C))
    _f32(v, "v", (B, T, C))
    _f32(dy, "dy", (B, T, C))
    cdef rx_attn_params P
    _attn_hook_params(&P, H, N, cs, topk)
    dq, dk, dv = _empty(B, T, C), _empty(B, T, C), _empty(B, T, C)
    cdef const float *pq = _ptr(q)
    cdef const float *pk = _ptr(k)
    cdef const float *pv = _ptr(v)
    cdef const float *pdy = _ptr(dy)
    cdef float *pdq = _wptr(dq)
    cdef float *pdk = _wptr(dk)
    cdef float *pdv = _wptr(dv)
    cdef int rc
    with nogil:
        rc = rx_attn_score_av_backward(&P, pq, pk, pv, pdy, Bi, Ti, pdq, pdk, pdv)
    _check_rc(rc, "attn_score_av_backward")
    return dq, dk, dv
