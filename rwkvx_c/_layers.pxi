# LayerNorm (docs/maths.md §LayerNorm), embedding, head and cross-entropy (docs/maths.md §Loss).
# Included by _core.pyx.


cdef int _index(object v, str name) except? -1:
    """A keyword int argument that may be negative (ignore_index)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < _INT_MIN or v > _INT_MAX:
        raise ValueError(f"{name} {v} exceeds the C API's int range")
    return v


def layernorm_forward(x, w, b):
    """LayerNorm over the last axis, eps RX_LN_EPS (the default ln_eps,
    OPTION_FIELDS["ln_eps"]), biased variance (docs/maths.md §LayerNorm).

    x : float32 (B, T, C); w, b : float32 (C,).
    Returns out (B, T, C).
    """
    _arr(x, "x", np.float32, 3)
    cdef int B = x.shape[0], T = x.shape[1], C = x.shape[2]
    _f32(w, "w", (C,))
    _f32(b, "b", (C,))
    out = _empty(B, T, C)
    cdef const float *px = _ptr(x)
    cdef const float *pw = _ptr(w)
    cdef const float *pb = _ptr(b)
    cdef float *po = _wptr(out)
    cdef int rc
    with nogil:
        rc = rx_layernorm_forward_seq(px, pw, pb, po, B, T, C)
    _check_rc(rc, "layernorm_forward")
    return out


def layernorm_backward(x, w, b, dy):
    """Backward of layernorm_forward.

    x, dy : float32 (B, T, C); w, b : float32 (C,).
    Returns (dx, dw, db): dx (B, T, C), dw and db (C,) summed over B and T.
    """
    _arr(x, "x", np.float32, 3)
    cdef int B = x.shape[0], T = x.shape[1], C = x.shape[2]
    _f32(w, "w", (C,))
    _f32(b, "b", (C,))
    _f32(dy, "dy", (B, T, C))
    dx, dw, db = _empty(B, T, C), _empty(C), _empty(C)
    cdef const float *px = _ptr(x)
    cdef const float *pw = _ptr(w)
    cdef const float *pb = _ptr(b)
    cdef const float *pdy = _ptr(dy)
    cdef float *pdx = _wptr(dx)
    cdef float *pdw = _wptr(dw)
    cdef float *pdb = _wptr(db)
    cdef int rc
    with nogil:
        rc = rx_layernorm_backward(px, pw, pb, pdy, pdx, pdw, pdb, B, T, C)
    _check_rc(rc, "layernorm_backward")
    return dx, dw, db


def embedding_forward(emb, tokens):
    """Token embedding: out[t] = emb[tokens[t]].

    emb : float32 (vocab, C); tokens : int32 (T,), each in [0, vocab).
    Returns out (T, C).
    """
    _arr(emb, "emb", np.float32, 2)
    cdef int V = emb.shape[0], C = emb.shape[1]
    _arr(tokens, "tokens", np.int32, 1)
    cdef int T = tokens.shape[0]
    _tokens(tokens, "tokens", T, V)
    out = _empty(T, C)
    cdef const float *pe = _ptr(emb)
    cdef const int *pt = _iptr(tokens)
    cdef float *po = _wptr(out)
    cdef int rc
    with nogil:
        rc = rx_embedding_gather(pe, pt, T, C, V, po)
    _check_rc(rc, "embedding_forward")
    return out


def embedding_backward(tokens, d_out, vocab):
    """Backward of embedding_forward: scatter-adds d_out rows into d_emb.

    tokens : int32 (T,), each in [0, vocab); d_out : float32 (T, C);
    vocab : int >= 1. Returns d_emb (vocab, C).
    """
    cdef int V = _size(vocab, "vocab")
    _arr(tokens, "tokens", np.int32, 1)
    cdef int T = tokens.shape[0]
    _tokens(tokens, "tokens", T, V)
    _arr(d_out, "d_out", np.float32, 2)
    if d_out.shape[0] != T:
        raise ValueError(f"d_out has shape {d_out.shape}, expected ({T}, C) to match tokens")
    cdef int C = d_out.shape[1]
    d_emb = _empty(V, C)
    cdef const int *pt = _iptr(tokens)
    cdef const float *pg = _ptr(d_out)
    cdef float *pd = _wptr(d_emb)
    cdef int rc
    with nogil:
        rc = rx_embedding_scatter(pt, T, C, V, pg, pd)
    _check_rc(rc, "embedding_backward")
    return d_emb


def head_forward(x, head):
    """Unembedding projection: logits = x . head.

    x : float32 (T, C); head : float32 (C, vocab).
    Returns logits (T, vocab).
    """
    _arr(x, "x", np.float32, 2)
    cdef int T = x.shape[0], C = x.shape[1]
    _arr(head, "head", np.float32, 2)
    if head.shape[0] != C:
        raise ValueError(f"head has shape {head.shape}, expected ({C}, vocab) to match x")
    cdef int V = head.shape[1]
    logits = _empty(T, V)
    cdef const float *px = _ptr(x)
    cdef const float *ph = _ptr(head)
    cdef float *pl = _wptr(logits)
    cdef int rc
    with nogil:
        rc = rx_head_logits(px, ph, T, C, V, pl)
    _check_rc(rc, "head_forward")
    return logits


def head_backward(x, head, dlogits):
    """Backward of head_forward.

    x : float32 (T, C); head : float32 (C, vocab); dlogits : float32 (T, vocab).
    Returns (dx, d_head): dx (T, C), d_head (C, vocab).
    """
    _arr(x, "x", np.float32, 2)
    cdef int T = x.shape[0], C = x.shape[1]
    _arr(head, "head", np.float32, 2)
    if head.shape[0] != C:
        raise ValueError(f"head has shape {head.shape}, expected ({C}, vocab) to match x")
    cdef int V = head.shape[1]
    _f32(dlogits, "dlogits", (T, V))
    dx, d_head = _empty(T, C), _empty(C, V)
    cdef const float *px = _ptr(x)
    cdef const float *ph = _ptr(head)
    cdef const float *pg = _ptr(dlogits)
    cdef float *pdx = _wptr(dx)
    cdef float *pdh = _wptr(d_head)
    cdef int rc
    with nogil:
        rc = rx_head_grads(px, ph, pg, T, C, V, pdx, pdh)
    _check_rc(rc, "head_backward")
    return dx, d_head


cdef tuple _ce_args(object logits, object targets, object ignore_index):
    """(T, vocab, ignore_index) after checking the cross-entropy arguments."""
    _arr(logits, "logits", np.float32, 2)
    cdef int T = logits.shape[0], V = logits.shape[1]
    cdef int ii = _index(ignore_index, "ignore_index")
    _targets(targets, "targets", T, V, ii)
    return T, V, ii


def cross_entropy_forward(logits, targets, ignore_index=-1):
    """Mean softmax cross-entropy over valid positions (docs/maths.md §Loss).

    logits : float32 (T, vocab); targets : int32 (T,). A position is valid
    when ignore_index < 0 or targets[t] != ignore_index; valid targets lie in
    [0, vocab). Returns the loss as a float (0.0 when no position is valid).
    """
    T, V, ii = _ce_args(logits, targets, ignore_index)
    cdef int cT = T, cV = V, cii = ii
    cdef const float *pl = _ptr(logits)
    cdef const int *pt = _iptr(targets)
    cdef double loss
    cdef int rc
    with nogil:
        rc = rx_cross_entropy(pl, pt, cT, cV, cii, NULL, &loss)
    _check_rc(rc, "cross_entropy_forward")
    return loss


def cross_entropy_backward(logits, targets, ignore_index=-1):
    """Loss and its grad w.r.t. the logits.

    Arguments as cross_entropy_forward. Returns (loss, dlogits): dlogits
    (T, vocab) = (softmax - onehot) / n_valid, zero rows at ignored positions
    (all zero when no position is valid).
    """
    T, V, ii = _ce_args(logits, targets, ignore_index)
    cdef int cT = T, cV = V, cii = ii
    dlogits = _empty(cT, cV)
    cdef const float *pl = _ptr(logits)
    cdef const int *pt = _iptr(targets)
    cdef float *pd = _wptr(dlogits)
    cdef double loss
    cdef int rc
    with nogil:
        rc = rx_cross_entropy(pl, pt, cT, cV, cii, pd, &loss)
    _check_rc(rc, "cross_entropy_backward")
    return loss, dlogits


def head_loss(x, head, targets, *, rows=0, ignore_index=-1, l2wrap=0.0, grads=True):
    """The head and the loss over row chunks, never holding every logit
    (docs/maths.md §Chunked head).

    x : float32 (T, C), ln_out's output; head : float32 (C, vocab); targets :
    int32 (T,) as cross_entropy_forward's. rows : rows per chunk (0: the
    fixed scratch budget's, head_chunk_rows(vocab)). l2wrap : RWKV-LM's
    L2Wrap factor (0: none), over the T positions. Returns loss when grads
    is False, else (loss, dx (T, C), d_head (C, vocab)): the loss of
    cross_entropy_forward(x . head, targets) with the same bits, and its
    grads (plus L2Wrap's).
    """
    _arr(x, "x", np.float32, 2)
    cdef int T = x.shape[0], C = x.shape[1]
    _arr(head, "head", np.float32, 2)
    if head.shape[0] != C:
        raise ValueError(f"head has shape {head.shape}, expected ({C}, vocab) to match x")
    cdef int V = head.shape[1]
    cdef int ii = _index(ignore_index, "ignore_index")
    _targets(targets, "targets", T, V, ii)
    if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or not 0 <= rows <= _INT_MAX:
        raise ValueError(f"rows must be an int in [0, 2**31), got {rows!r}")
    cdef int R = rows if rows else rx_head_chunk_rows(V, 0)
    cdef double f = float(l2wrap)
    if not (f >= 0.0 and math.isfinite(f)):
        raise ValueError(f"l2wrap must be finite and >= 0, got {l2wrap!r}")
    scratch = _empty(2 * min(R, T), V)
    dx = _empty(T, C) if grads else None
    d_head = _empty(C, V) if grads else None
    cdef const float *px = _ptr(x)
    cdef const float *ph = _ptr(head)
    cdef const int *pt = _iptr(targets)
    cdef float *ps = _wptr(scratch)
    cdef float *pdx = _wptr(dx) if grads else NULL
    cdef float *pdh = _wptr(d_head) if grads else NULL
    cdef double loss
    cdef int rc
    with nogil:
        rc = rx_head_loss(px, ph, pt, T, C, V, ii, f, R, ps, pdx, pdh, &loss)
    _check_rc(rc, "head_loss")
    return (loss, dx, d_head) if grads else loss


def head_chunk_rows(int vocab):
    """Rows per chunk of the head's fixed scratch budget (RX_HEAD_CHUNK_FLOATS
    floats per buffer) at this vocabulary size."""
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    return rx_head_chunk_rows(vocab, 0)
