# RWKV-7 time-mix, channel-mix and residual block (docs/maths.md, docs/layout.md).
# Included by _core.pyx.
#
# A params dict is keyed by field name: bare rx_tm_params / rx_cm_params
# names for the time-mix and channel-mix alone, docs/layout.md §Parameters names without the
# 'blocks.L.' prefix for the block. LoRA sizes come from the shapes of
# w1/a1/g1/v1 (and ffn_dim from ffn_key_w). Grads come back as a dict with
# the same keys.

cdef tuple _tm_table():
    """rx_tm_field's rows: (name, dims, at_layer0, params offset, grads offset)."""
    cdef const char *name
    cdef const char *dims[2]
    cdef size_t p_off, g_off
    cdef int at0
    rows = []
    for i in range(rx_tm_num_fields()):
        rx_tm_field(i, &name, &p_off, &g_off, dims, &at0)
        shape = (dims[0].decode(),) if dims[1] == NULL else (dims[0].decode(), dims[1].decode())
        rows.append((name.decode(), shape, bool(at0), p_off, g_off))
    return tuple(rows)


_TM_TABLE = _tm_table()


def tm_fields():
    """The time-mix parameters (docs/layout.md §Parameters), as the C library
    defines them, in rx_tm_params order: a tuple of (name, dims, at_layer0).
    dims names the shape's dimensions ('C', 'Dw', 'Da', 'Dg', 'Dv'): ('C',)
    for a vector, ('C', 'Dw') for a [C, Dw] matrix; at_layer0 is False for
    the value residual v0, v1, v2, which RWKV block 0 lacks."""
    return tuple(row[:3] for row in _TM_TABLE)


def tm_shapes(sizes, layer_id):
    """{name: shape} of the time-mix parameters of the RWKV block layer_id, in
    rx_tm_params order; sizes maps each dimension name of tm_fields ('C',
    'Dw', 'Da', 'Dg', 'Dv') to its size ('Dv' is not read at layer_id 0)."""
    return {name: tuple(sizes[d] for d in dims) for name, dims, at0, _, _ in _TM_TABLE
            if at0 or layer_id > 0}


_CM_FIELDS = ("ffn_x_k", "ffn_key_w", "ffn_value_w")


cdef int _layer_id(object v) except -1:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"layer_id must be an int, got {type(v).__name__}")
    if v < 0 or v > _INT_MAX:
        raise ValueError(f"layer_id must be >= 0, got {v}")
    return v


cdef tuple _tm_keys(str pre, int layer_id):
    return tuple(pre + row[0] for row in _TM_TABLE if row[2] or layer_id > 0)


cdef tuple _cm_keys(str pre):
    return tuple(pre + f for f in _CM_FIELDS)


cdef int _check_keys(object p, tuple keys) except -1:
    """p is a dict holding exactly these keys."""
    if not isinstance(p, dict):
        raise TypeError(f"params must be a dict of float32 arrays, got {type(p).__name__}")
    missing = [k for k in keys if k not in p]
    if missing:
        raise ValueError(f"params is missing {', '.join(repr(k) for k in missing)}")
    extra = [k for k in p if k not in keys]
    if extra:
        raise ValueError(f"params has unexpected {', '.join(repr(k) for k in extra)}")
    return 0


cdef int _inner_dim(dict p, str key, int C) except -1:
    """Inner size of a LoRA (or the FFN) from its (C, D) down matrix."""
    a = _arr(p[key], f"params['{key}']", np.float32, 2)
    if a.shape[0] != C:
        raise ValueError(f"params['{key}'] has shape {a.shape}, expected ({C}, D)")
    return a.shape[1]


cdef dict _tm_shapes(dict p, str pre, int C, int layer_id):
    """{key: shape} of a time-mix params dict whose keys were checked."""
    cdef int Dw = _inner_dim(p, pre + "w1", C), Da = _inner_dim(p, pre + "a1", C)
    cdef int Dg = _inner_dim(p, pre + "g1", C)
    cdef int Dv = _inner_dim(p, pre + "v1", C) if layer_id > 0 else 0
    shapes = tm_shapes({"C": C, "Dw": Dw, "Da": Da, "Dg": Dg, "Dv": Dv}, layer_id)
    return {pre + k: s for k, s in shapes.items()}


cdef dict _cm_shapes(dict p, str pre, int C):
    cdef int F = _inner_dim(p, pre + "ffn_key_w", C)
    return {pre + "ffn_x_k": (C,), pre + "ffn_key_w": (C, F), pre + "ffn_value_w": (F, C)}


cdef int _check_shapes(dict p, dict shapes) except -1:
    for k, s in shapes.items():
        _f32(p[k], f"params['{k}']", s)
    return 0


cdef int _tm_fill(rx_tm_params *P, dict p, str pre, int H, int N, int layer_id) except -1:
    """Point P at the checked arrays of p."""
    P.c = H * N
    P.n_head = H
    P.head_size = N
    P.Dw = p[pre + "w1"].shape[1]
    P.Da = p[pre + "a1"].shape[1]
    P.Dg = p[pre + "g1"].shape[1]
    P.Dv = p[pre + "v1"].shape[1] if layer_id > 0 else 0
    P.layer_id = layer_id
    cdef char *base = <char *>P
    cdef size_t off
    for row in _TM_TABLE:   # at layer 0 p has no v0/v1/v2: those stay NULL
        off = row[3]
        (<const float **>(base + off))[0] = _ptr(p.get(pre + row[0]))
    return 0


cdef int _tm_grads_fill(rx_tm_grads *G, dict g, str pre) except -1:
    """Point G at the grad arrays of g (v0/v1/v2 NULL when absent)."""
    cdef char *base = <char *>G
    cdef size_t off
    for row in _TM_TABLE:
        off = row[4]
        (<float **>(base + off))[0] = _wptr(g.get(pre + row[0]))
    return 0


cdef int _cm_fill(rx_cm_params *P, dict p, str pre) except -1:
    P.c = p[pre + "ffn_key_w"].shape[0]
    P.ffn_dim = p[pre + "ffn_key_w"].shape[1]
    P.ffn_x_k = _ptr(p[pre + "ffn_x_k"])
    P.ffn_key_w = _ptr(p[pre + "ffn_key_w"])
    P.ffn_value_w = _ptr(p[pre + "ffn_value_w"])
    return 0


cdef int _cm_grads_fill(rx_cm_grads *G, dict g, str pre) except -1:
    G.ffn_x_k = _wptr(g[pre + "ffn_x_k"])
    G.ffn_key_w = _wptr(g[pre + "ffn_key_w"])
    G.ffn_value_w = _wptr(g[pre + "ffn_value_w"])
    return 0


cdef tuple _seq_shape(object x, str name):
    _arr(x, name, np.float32, 3)
    return x.shape


cdef int _heads(object n_head, object head_size, int C) except -1:
    cdef int H = _size(n_head, "n_head"), N = _size(head_size, "head_size")
    if <long long>H * N != C:
        raise ValueError(f"n_head * head_size = {H} * {N} must equal the channel count {C} of x")
    return 0


cdef int _v_first_args(object v_first, object d_v_first, int layer_id, tuple shape) except -1:
    """Layer 0 produces v_first (and may take the downstream grad on it);
    later layers read it and return its grad."""
    if layer_id == 0:
        if v_first is not None:
            raise ValueError("v_first must be None at layer_id 0, which produces it")
        _f32_opt(d_v_first, "d_v_first", shape)
    else:
        if v_first is None:
            raise ValueError(f"v_first (B, T, C) is required at layer_id {layer_id} > 0")
        _f32(v_first, "v_first", shape)
        if d_v_first is not None:
            raise ValueError("d_v_first is an output at layer_id > 0; pass None")
    return 0


def timemix_forward(p, x, x_prev_init=None, v_first=None, *, n_head, head_size, layer_id):
    """RWKV-7 time-mix (docs/maths.md §Time-mix) over a batch of sequences.

    p           : dict of float32 params keyed 'x_r' .. 'ln_x_b' (rx_tm_params
                  names; 'v0', 'v1', 'v2' present iff layer_id > 0)
    x           : float32 (B, T, C), the ln1 output; C = n_head * head_size
    x_prev_init : float32 (B, C) token-shift carry, or None for zero
    v_first     : float32 (B, T, C) at layer_id > 0; None at layer_id 0
    Returns (out, v_first): out (B, T, C); v_first is the new (B, T, C) value
    at layer 0 and the given array at layer_id > 0.
    """
    cdef int B, T, C
    B, T, C = _seq_shape(x, "x")
    cdef int lid = _layer_id(layer_id)
    _heads(n_head, head_size, C)
    _check_keys(p, _tm_keys("", lid))
    _check_shapes(p, _tm_shapes(p, "", C, lid))
    _f32_opt(x_prev_init, "x_prev_init", (B, C))
    _v_first_args(v_first, None, lid, (B, T, C))
    cdef rx_tm_params P
    _tm_fill(&P, p, "", n_head, head_size, lid)
    out = _empty(B, T, C)
    vf = _empty(B, T, C) if lid == 0 else v_first
    cdef const float *px = _ptr(x)
    cdef const float *pxp = _ptr(x_prev_init)
    cdef float *pvf = _wptr(vf) if lid == 0 else <float *>_ptr(vf)
    cdef float *pout = _wptr(out)
    cdef int rc
    with nogil:
        rc = rx_timemix_forward_seq(&P, px, pxp, pvf, pout, B, T)
    _check_rc(rc, "timemix_forward")
    return out, vf


def timemix_backward(p, x, dy, x_prev_init=None, v_first=None, d_v_first=None, *, n_head,
                     head_size, layer_id):
    """Backward of timemix_forward for the grad dy (B, T, C) on out.

    d_v_first : at layer_id 0, optional (B, T, C) downstream grad on the
                v_first this layer produced; must be None at layer_id > 0.
    Returns (dx, grads, d_xprev_init, d_v_first): dx (B, T, C); grads a dict
    with the keys of p; d_xprev_init (B, C) (the grad on a zero carry when
    x_prev_init is None); d_v_first (B, T, C) the grad on the v_first input
    at layer_id > 0, None at layer_id 0.
    """
    cdef int B, T, C
    B, T, C = _seq_shape(x, "x")
    cdef int lid = _layer_id(layer_id)
    _heads(n_head, head_size, C)
    _check_keys(p, _tm_keys("", lid))
    shapes = _tm_shapes(p, "", C, lid)
    _check_shapes(p, shapes)
    _f32(dy, "dy", (B, T, C))
    _f32_opt(x_prev_init, "x_prev_init", (B, C))
    _v_first_args(v_first, d_v_first, lid, (B, T, C))
    cdef rx_tm_params P
    cdef rx_tm_grads G
    _tm_fill(&P, p, "", n_head, head_size, lid)
    grads = {k: _empty(*s) for k, s in shapes.items()}
    _tm_grads_fill(&G, grads, "")
    dx, dxp = _empty(B, T, C), _empty(B, C)
    dvf = _empty(B, T, C) if lid > 0 else None
    cdef const float *px = _ptr(x)
    cdef const float *pdy = _ptr(dy)
    cdef const float *pxp = _ptr(x_prev_init)
    cdef const float *pvf = _ptr(v_first)
    cdef float *pdx = _wptr(dx)
    cdef float *pdxp = _wptr(dxp)
    cdef float *pdvf = _wptr(dvf) if lid > 0 else <float *>_ptr(d_v_first)
    cdef int rc
    with nogil:
        rc = rx_timemix_backward(&P, px, pxp, pvf, pdy, &G, pdx, pdxp, pdvf, B, T)
    _check_rc(rc, "timemix_backward")
    return dx, grads, dxp, dvf


def channelmix_forward(p, x, x_prev_init=None):
    """RWKV-7 channel-mix (docs/maths.md §Channel-mix): relu(xk . ffn_key_w)^2 . ffn_value_w.

    p           : dict with 'ffn_x_k' (C,), 'ffn_key_w' (C, F), 'ffn_value_w' (F, C)
    x           : float32 (B, T, C), the ln2 output
    x_prev_init : float32 (B, C) token-shift carry, or None for zero
    Returns out (B, T, C).
    """
    cdef int B, T, C
    B, T, C = _seq_shape(x, "x")
    _check_keys(p, _cm_keys(""))
    _check_shapes(p, _cm_shapes(p, "", C))
    _f32_opt(x_prev_init, "x_prev_init", (B, C))
    cdef rx_cm_params P
    _cm_fill(&P, p, "")
    out = _empty(B, T, C)
    cdef const float *px = _ptr(x)
    cdef const float *pxp = _ptr(x_prev_init)
    cdef float *pout = _wptr(out)
    cdef int rc
    with nogil:
        rc = rx_channelmix_forward_seq(&P, px, pxp, pout, B, T)
    _check_rc(rc, "channelmix_forward")
    return out


def channelmix_backward(p, x, dy, x_prev_init=None):
    """Backward of channelmix_forward for the grad dy (B, T, C) on out.

    Returns (dx, grads, d_xprev_init): dx (B, T, C), grads a dict with the
    keys of p, d_xprev_init (B, C).
    """
    cdef int B, T, C
    B, T, C = _seq_shape(x, "x")
    _check_keys(p, _cm_keys(""))
    shapes = _cm_shapes(p, "", C)
    _check_shapes(p, shapes)
    _f32(dy, "dy", (B, T, C))
    _f32_opt(x_prev_init, "x_prev_init", (B, C))
    cdef rx_cm_params P
    cdef rx_cm_grads G
    _cm_fill(&P, p, "")
    grads = {k: _empty(*s) for k, s in shapes.items()}
    _cm_grads_fill(&G, grads, "")
    dx, dxp = _empty(B, T, C), _empty(B, C)
    cdef const float *px = _ptr(x)
    cdef const float *pdy = _ptr(dy)
    cdef const float *pxp = _ptr(x_prev_init)
    cdef float *pdx = _wptr(dx)
    cdef float *pdxp = _wptr(dxp)
    cdef int rc
    with nogil:
        rc = rx_channelmix_backward(&P, px, pxp, pdy, &G, pdx, pdxp, B, T)
    _check_rc(rc, "channelmix_backward")
    return dx, grads, dxp


cdef tuple _block_keys(int layer_id):
    return (("ln1_w", "ln1_b") + _tm_keys("tm.", layer_id) + ("ln2_w", "ln2_b") +
            _cm_keys("cm."))


cdef dict _block_shapes(dict p, int C, int layer_id):
    shapes = {"ln1_w": (C,), "ln1_b": (C,)}
    shapes.update(_tm_shapes(p, "tm.", C, layer_id))
    shapes.update({"ln2_w": (C,), "ln2_b": (C,)})
    shapes.update(_cm_shapes(p, "cm.", C))
    return shapes


cdef int _block_fill(rx_block_params *P, dict p, int H, int N, int layer_id) except -1:
    _tm_fill(&P.tm, p, "tm.", H, N, layer_id)
    _cm_fill(&P.cm, p, "cm.")
    P.ln1_w = _ptr(p["ln1_w"])
    P.ln1_b = _ptr(p["ln1_b"])
    P.ln2_w = _ptr(p["ln2_w"])
    P.ln2_b = _ptr(p["ln2_b"])
    return 0


def block_forward(p, x, tm_xprev_init=None, cm_xprev_init=None, v_first=None, *, n_head,
                  head_size, layer_id):
    """RWKV-7 residual block (docs/maths.md §Blocks): h1 = ln1(x); x1 = x + TM(h1);
    h2 = ln2(x1); out = x1 + CM(h2).

    p             : dict keyed 'ln1_w', 'ln1_b', 'tm.x_r' .. 'tm.ln_x_b'
                    ('tm.v0/v1/v2' iff layer_id > 0), 'ln2_w', 'ln2_b',
                    'cm.ffn_x_k', 'cm.ffn_key_w', 'cm.ffn_value_w'
    x             : float32 (B, T, C), C = n_head * head_size
    tm_xprev_init : float32 (B, C) carry over h1, or None
    cm_xprev_init : float32 (B, C) carry over h2, or None
    v_first       : as in timemix_forward
    Returns (out, v_first) as timemix_forward.
    """
    cdef int B, T, C
    B, T, C = _seq_shape(x, "x")
    cdef int lid = _layer_id(layer_id)
    _heads(n_head, head_size, C)
    _check_keys(p, _block_keys(lid))
    _check_shapes(p, _block_shapes(p, C, lid))
    _f32_opt(tm_xprev_init, "tm_xprev_init", (B, C))
    _f32_opt(cm_xprev_init, "cm_xprev_init", (B, C))
    _v_first_args(v_first, None, lid, (B, T, C))
    cdef rx_block_params P
    _block_fill(&P, p, n_head, head_size, lid)
    out = _empty(B, T, C)
    vf = _empty(B, T, C) if lid == 0 else v_first
    cdef const float *px = _ptr(x)
    cdef const float *ptm = _ptr(tm_xprev_init)
    cdef const float *pcm = _ptr(cm_xprev_init)
    cdef float *pvf = _wptr(vf) if lid == 0 else <float *>_ptr(vf)
    cdef float *pout = _wptr(out)
    cdef int rc
    with nogil:
        rc = rx_block_forward_seq(&P, px, ptm, pcm, pvf, pout, B, T)
    _check_rc(rc, "block_forward")
    return out, vf


def block_backward(p, x, dy, tm_xprev_init=None, cm_xprev_init=None, v_first=None,
                   d_v_first=None, *, n_head, head_size, layer_id):
    """Backward of block_forward for the grad dy (B, T, C) on out.

    d_v_first : as in timemix_backward.
    Returns (dx, grads, d_tm_xprev, d_cm_xprev, d_v_first): dx (B, T, C);
    grads a dict with the keys of p; the carry grads (B, C); d_v_first
    (B, T, C) at layer_id > 0, None at layer_id 0.
    """
    cdef int B, T, C
    B, T, C = _seq_shape(x, "x")
    cdef int lid = _layer_id(layer_id)
    _heads(n_head, head_size, C)
    _check_keys(p, _block_keys(lid))
    shapes = _block_shapes(p, C, lid)
    _check_shapes(p, shapes)
    _f32(dy, "dy", (B, T, C))
    _f32_opt(tm_xprev_init, "tm_xprev_init", (B, C))
    _f32_opt(cm_xprev_init, "cm_xprev_init", (B, C))
    _v_first_args(v_first, d_v_first, lid, (B, T, C))
    cdef rx_block_params P
    cdef rx_block_grads G
    _block_fill(&P, p, n_head, head_size, lid)
    grads = {k: _empty(*s) for k, s in shapes.items()}
    _tm_grads_fill(&G.tm, grads, "tm.")
    _cm_grads_fill(&G.cm, grads, "cm.")
    G.ln1_w = _wptr(grads["ln1_w"])
    G.ln1_b = _wptr(grads["ln1_b"])
    G.ln2_w = _wptr(grads["ln2_w"])
    G.ln2_b = _wptr(grads["ln2_b"])
    dx, dtm, dcm = _empty(B, T, C), _empty(B, C), _empty(B, C)
    dvf = _empty(B, T, C) if lid > 0 else None
    cdef const float *px = _ptr(x)
    cdef const float *pdy = _ptr(dy)
    cdef const float *ptm = _ptr(tm_xprev_init)
    cdef const float *pcm = _ptr(cm_xprev_init)
    cdef const float *pvf = _ptr(v_first)
    cdef float *pdx = _wptr(dx)
    cdef float *pdtm = _wptr(dtm)
    cdef float *pdcm = _wptr(dcm)
    cdef float *pdvf = _wptr(dvf) if lid > 0 else <float *>_ptr(d_v_first)
    cdef int rc
    with nogil:
        rc = rx_block_backward(&P, px, ptm, pcm, pvf, pdy, &G, pdx, pdtm, pdcm, pdvf, B, T)
    _check_rc(rc, "block_backward")
    return dx, grads, dtm, dcm, dvf
