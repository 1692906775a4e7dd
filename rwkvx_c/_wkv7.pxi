# WKV7 recurrence (docs/maths.md §WKV7). Included by _core.pyx.


cdef tuple _wkv7_shape(object r):
    _arr(r, "r", np.float32, 4)
    return r.shape


def wkv7_forward(r, w, k, v, a, b, s_init=None):
    """WKV7 recurrence over a whole sequence (docs/maths.md §WKV7).

    r, w, k, v, a, b : float32 (B, T, H, N)
    s_init           : float32 (B, H, N, N) initial state, or None for zero
    Returns (y, s_final): y (B, T, H, N), s_final (B, H, N, N).
    """
    shape = _wkv7_shape(r)
    cdef int B = shape[0], T = shape[1], H = shape[2], N = shape[3]
    for name, arr in (("w", w), ("k", k), ("v", v), ("a", a), ("b", b)):
        _f32(arr, name, shape)
    _f32_opt(s_init, "s_init", (B, H, N, N))
    y, s_final = _empty(B, T, H, N), _empty(B, H, N, N)
    cdef const float *pr = _ptr(r)
    cdef const float *pw = _ptr(w)
    cdef const float *pk = _ptr(k)
    cdef const float *pv = _ptr(v)
    cdef const float *pa = _ptr(a)
    cdef const float *pb = _ptr(b)
    cdef const float *ps = _ptr(s_init)
    cdef float *py = _wptr(y)
    cdef float *pf = _wptr(s_final)
    cdef int rc
    with nogil:
        rc = rx_wkv7_forward_seq(pr, pw, pk, pv, pa, pb, ps, py, pf, B, T, H, N)
    _check_rc(rc, "wkv7_forward")
    return y, s_final


def wkv7_backward(r, w, k, v, a, b, dy, s_init=None):
    """Backward of wkv7_forward through time.

    dy : float32 (B, T, H, N), the grad on y.
    Returns (dr, dw, dk, dv, da, db, ds_init): the first six (B, T, H, N), dw
    w.r.t. the effective decay w itself; ds_init (B, H, N, N) is the grad
    w.r.t. the initial state (zero state when s_init is None).
    """
    shape = _wkv7_shape(r)
    cdef int B = shape[0], T = shape[1], H = shape[2], N = shape[3]
    for name, arr in (("w", w), ("k", k), ("v", v), ("a", a), ("b", b), ("dy", dy)):
        _f32(arr, name, shape)
    _f32_opt(s_init, "s_init", (B, H, N, N))
    grads = [_empty(B, T, H, N) for _ in range(6)]
    ds = _empty(B, H, N, N)
    cdef const float *pr = _ptr(r)
    cdef const float *pw = _ptr(w)
    cdef const float *pk = _ptr(k)
    cdef const float *pv = _ptr(v)
    cdef const float *pa = _ptr(a)
    cdef const float *pb = _ptr(b)
    cdef const float *pdy = _ptr(dy)
    cdef const float *ps = _ptr(s_init)
    cdef float *g0 = _wptr(grads[0])
    cdef float *g1 = _wptr(grads[1])
    cdef float *g2 = _wptr(grads[2])
    cdef float *g3 = _wptr(grads[3])
    cdef float *g4 = _wptr(grads[4])
    cdef float *g5 = _wptr(grads[5])
    cdef float *pds = _wptr(ds)
    cdef int rc
    with nogil:
        rc = rx_wkv7_backward(pr, pw, pk, pv, pa, pb, pdy, ps, g0, g1, g2, g3, g4, g5, pds,
                              B, T, H, N)
    _check_rc(rc, "wkv7_backward")
    return (*grads, ds)
