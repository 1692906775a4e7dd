# cython: language_level=3
"""rwkvx_c._core -- the validated Cython skin over the C core (csrc/).

Every function checks dtype (float32 / int32), C-contiguity and shapes
before calling C, raises TypeError / ValueError naming the argument, and
releases the GIL while C runs. Results are new NumPy arrays. The kernels of
each concern live in an include file next to this one.
"""
import math

import numpy as np

from rwkvx_c._rx cimport *

# ---------------------------------------------------------------------------
# validation helpers shared by every binding

# The C API's int range: every size and index crossing into C is an int
_INT_MIN, _INT_MAX = -2 ** 31, 2 ** 31 - 1


cdef object _arr(object a, str name, object dtype, int ndim):
    """a itself after checking type, dtype, C-contiguity and ndim."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray of {np.dtype(dtype).name}, "
                        f"got {type(a).__name__}")
    if a.dtype != dtype:
        raise TypeError(f"{name} must have dtype {np.dtype(dtype).name}, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (use numpy.ascontiguousarray)")
    for d in a.shape:
        if d < 1:
            raise ValueError(f"{name} has an empty dimension: shape {a.shape}")
        if d > _INT_MAX:
            raise ValueError(f"{name} dimension {d} exceeds the C API's int range")
    return a


cdef object _f32(object a, str name, tuple shape):
    """Check a float32 array of exactly this shape."""
    _arr(a, name, np.float32, len(shape))
    if a.shape != shape:
        raise ValueError(f"{name} has shape {a.shape}, expected {shape}")
    return a


cdef object _f32_opt(object a, str name, tuple shape):
    return None if a is None else _f32(a, name, shape)


cdef object _tokens(object a, str name, int T, int vocab):
    """Check an int32 (T,) array with every entry in [0, vocab)."""
    _arr(a, name, np.int32, 1)
    if a.shape[0] != T:
        raise ValueError(f"{name} has length {a.shape[0]}, expected {T}")
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"{name} entries must lie in [0, {vocab}), got range [{lo}, {hi}]")
    return a


cdef object _targets(object a, str name, int T, int vocab, int ignore_index):
    """Like _tokens, but entries equal to ignore_index (when >= 0) are allowed."""
    _arr(a, name, np.int32, 1)
    if a.shape[0] != T:
        raise ValueError(f"{name} has length {a.shape[0]}, expected {T}")
    valid = a if ignore_index < 0 else a[a != ignore_index]
    if valid.size and (int(valid.min()) < 0 or int(valid.max()) >= vocab):
        raise ValueError(f"{name} entries must lie in [0, {vocab}) or equal ignore_index "
                         f"({ignore_index}), got range [{int(valid.min())}, {int(valid.max())}]")
    return a


cdef int _size(object v, str name) except -1:
    """A keyword size argument: a Python int >= 1."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < 1 or v > _INT_MAX:
        raise ValueError(f"{name} must be >= 1, got {v}")
    return v


cdef const float *_ptr(object a) except? NULL:
    """Data pointer of a checked float32 array, NULL for None."""
    cdef const float[::1] mv
    if a is None:
        return NULL
    mv = a.reshape(-1)
    return &mv[0]


cdef float *_wptr(object a) except? NULL:
    """Data pointer of a writable float32 array we allocated, NULL for None."""
    cdef float[::1] mv
    if a is None:
        return NULL
    mv = a.reshape(-1)
    return &mv[0]


cdef const int *_iptr(object a) except? NULL:
    cdef const int[::1] mv = a.reshape(-1)
    return &mv[0]


cdef int _check_rc(int rc, str fn) except -1:
    """The one place a C return code becomes an exception: RX_ENOMEM ->
    MemoryError, RX_EINVAL / RX_ECONFIG -> ValueError, with the C side's
    rx_last_error() message (which names the bad argument) after fn, the
    Python entry point. Call it on the thread that made the C call (the
    message is per thread), right after the call."""
    if rc == RX_OK:
        return 0
    msg = f"{fn}: {rx_last_error().decode('utf-8', 'replace')}"
    if rc == RX_ENOMEM:
        raise MemoryError(msg)
    if rc == RX_EINVAL or rc == RX_ECONFIG:
        raise ValueError(msg)
    raise RuntimeError(f"{msg} (unknown C error code {rc})")


def _empty(*shape):
    """A new float32 array whose data starts on a 64-byte cache line (NumPy's
    own start 16 bytes past one): the kernels' threads write neighbouring
    rows, and rows that straddle lines would share a line between threads."""
    n = 1
    for d in shape:
        n *= d
    raw = np.empty(n + 16, dtype=np.float32)
    s = (-raw.ctypes.data % 64) // 4
    return raw[s:s + n].reshape(shape)


# ---------------------------------------------------------------------------
# threads


MAX_THREADS = RX_MAX_THREADS


def set_num_threads(n):
    """Use n OpenMP threads in later rwkvx_c calls from this thread.

    n = 0 restores the default (OMP_NUM_THREADS, else the core count); a
    negative n, or one above MAX_THREADS, is a ValueError (OpenMP would try
    to start that many threads).
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"set_num_threads: n must be an int, got {type(n).__name__}")
    if not 0 <= n <= RX_MAX_THREADS:
        raise ValueError(f"set_num_threads: n must lie in [0, {RX_MAX_THREADS}], got {n}")
    rx_set_num_threads(n)


def get_num_threads():
    """Number of OpenMP threads the next rwkvx_c call will use (1 without OpenMP)."""
    return rx_get_num_threads()


def has_openmp():
    """True when the C core was compiled with OpenMP."""
    return bool(rx_has_openmp())


def gemm_kernel(precision="fp32"):
    """Name of the GEMM kernel picked for this CPU at run time for a
    precision: "fp32" -> "avx512f-12x32" (Intel
    with AVX-512), "avx512f-8x32" (AMD Zen 5 and later), "avx512f" (other
    AVX-512 CPUs), "avx2-fma" or "generic"; "bf16" ->
    "amx-bf16", "avx512-bf16" or "generic-bf16" (fp32 arithmetic on the same
    bf16-rounded operands)."""
    if precision == "fp32":
        return rx_sgemm_kernel().decode()
    if precision == "bf16":
        return rx_bgemm_kernel().decode()
    raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")


def bf16_hardware():
    """True when the bf16 GEMM runs on bf16 hardware here (AMX-BF16 or
    AVX512-BF16)."""
    return bool(rx_bgemm_hw())


def bf16_pays():
    """True where the bf16 GEMM makes a training step faster than fp32 on
    this CPU: AMX, or AVX512-BF16 whose vdpbf16ps issues at the fp32 FMA's
    rate (AMD Zen 4 and 5); what precision "auto" asks
    (rwkvx_c.train.auto_precision)."""
    return bool(rx_bgemm_pays())


include "_wkv7.pxi"
include "_layers.pxi"
include "_rwkv.pxi"
include "_attn.pxi"
include "_memory.pxi"
include "_config.pxi"
include "_base.pxi"
include "_model.pxi"
include "_steps.pxi"
include "_optim.pxi"
include "_infer.pxi"
include "_gen.pxi"
include "_gemm.pxi"
include "_profile.pxi"
include "_tokenize.pxi"
