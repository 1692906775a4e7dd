# AdamW and the global grad norm over flat float32 buffers (csrc/optim.c).
# Included by _core.pyx.
from libc.stdint cimport int64_t


cdef object _flat_f32(object a, str name, bint writable):
    """A 1-D float32 C-contiguous array (writable when it is updated in place)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of float32, got {type(a).__name__}")
    if a.dtype != np.float32:
        raise TypeError(f"{name} must have dtype float32, got {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (use numpy.ascontiguousarray)")
    if a.shape[0] < 1:
        raise ValueError(f"{name} is empty")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name} must be writable: it is updated in place")
    return a


def grad_norm(g):
    """Global L2 norm of a flat float32 buffer, accumulated in double.

    g : float32 (n,), e.g. a model's grad_buffer.
    Returns a Python float; at a given thread count the summation order is
    fixed, so the same buffer always gives the same number.
    """
    _flat_f32(g, "g", False)
    cdef const float[::1] mv = g
    cdef size_t n = g.shape[0]
    cdef double r
    cdef int rc
    with nogil:
        rc = rx_grad_norm_l2(&mv[0], n, &r)
    _check_rc(rc, "grad_norm")
    return r


def axpby(double a, x, double b, y):
    """y = a*x + b*y in place over flat float32 buffers (gradient
    accumulation); b == 0 writes a*x without reading y.

    x, y : float32 (n,), the same n; y writable and not overlapping x.
    """
    _flat_f32(x, "x", False)
    _flat_f32(y, "y", True)
    if x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must have the same length, got {x.shape[0]} and {y.shape[0]}")
    cdef const float[::1] xv = x
    cdef float[::1] yv = y
    cdef size_t n = x.shape[0]
    cdef float fa = a, fb = b
    cdef int rc
    with nogil:
        rc = rx_axpby(n, fa, &xv[0], fb, &yv[0])
    _check_rc(rc, "axpby")


def adamw_step(params, grads, m, v, *, double lr, long long step, double beta1=0.9,
               double beta2=0.99, double eps=1e-8, double weight_decay=0.0,
               decay_ranges=None, double grad_scale=1.0):
    """One decoupled-AdamW step (torch.optim.AdamW semantics), in place.

    params, m, v : float32 (n,), writable; updated in place (m, v start at 0)
    grads        : float32 (n,)
    step         : 1-based step count (bias correction)
    decay_ranges : int64 (R, 2) sorted, non-overlapping [begin, end) element
                   ranges that get weight decay; None applies it everywhere,
                   an empty (0, 2) array nowhere
    grad_scale   : multiplies the grads first (clipping: min(1, max_norm/norm))
    Update: g = grad_scale*grads; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
    params = params*(1 - lr*wd in decay ranges) - lr*m_hat/(sqrt(v_hat)+eps).
    """
    _flat_f32(params, "params", True)
    _flat_f32(grads, "grads", False)
    _flat_f32(m, "m", True)
    _flat_f32(v, "v", True)
    cdef size_t n = params.shape[0]
    for name, arr in (("grads", grads), ("m", m), ("v", v)):
        if arr.shape[0] != n:
            raise ValueError(f"{name} has length {arr.shape[0]}, expected {n} (params)")
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if not (0.0 <= beta1 < 1.0) or not (0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must lie in [0, 1), got ({beta1}, {beta2})")
    if not (lr >= 0.0) or not (eps >= 0.0) or not (weight_decay >= 0.0):
        raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
    if not np.isfinite(grad_scale):
        raise ValueError(f"grad_scale must be finite, got {grad_scale}")
    if decay_ranges is None:
        ranges = np.array([[0, n]], dtype=np.int64)
    else:
        ranges = np.ascontiguousarray(decay_ranges, dtype=np.int64)
        if ranges.ndim != 2 or ranges.shape[1] != 2:
            raise ValueError(f"decay_ranges must have shape (R, 2), got {ranges.shape}")
        if ranges.shape[0]:
            flat = ranges.reshape(-1)
            if flat.min() < 0 or flat.max() > n or np.any(np.diff(flat) < 0):
                raise ValueError("decay_ranges must be sorted, non-overlapping [begin, end) "
                                 f"ranges within [0, {n}]")
    if ranges.shape[0] > _INT_MAX:
        raise ValueError("decay_ranges has too many rows")
    cdef int nr = ranges.shape[0]
    cdef int64_t dummy = 0
    cdef const int64_t[:, ::1] rv
    cdef const int64_t *pr = &dummy
    if nr:
        rv = ranges
        pr = &rv[0, 0]
    cdef float[::1] pp = params
    cdef const float[::1] pg = grads
    cdef float[::1] pm = m
    cdef float[::1] pv = v
    cdef int rc
    cdef float flr = lr, fb1 = beta1, fb2 = beta2, feps = eps, fwd = weight_decay
    cdef float fgs = grad_scale
    cdef int64_t st = step
    with nogil:
        rc = rx_adamw_step(&pp[0], &pg[0], &pm[0], &pv[0], n, pr, nr, flr, fb1, fb2, feps,
                           fwd, fgs, st)
    _check_rc(rc, "adamw_step")
