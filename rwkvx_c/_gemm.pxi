# GEMM and WKV7 kernel test/bench hooks (csrc/gemm.c, csrc/wkv7.c). Included by _core.pyx.


def _sgemm(a, b, ta=False, tb=False, out=None, beta=0.0, m=None, n=None, k=None):
    """rx_sgemm, the GEMM behind every projection (test and benchmark hook).

    a    : float32 (M, K), or (K, M) with ta
    b    : float32 (K, N), or (N, K) with tb
    out  : None, or float32 (M, N) written in place
    beta : 0.0 (out = op(a).op(b)) or 1.0 (out += op(a).op(b); needs out)
    m, n, k : None, or fewer rows, columns, depth than the arrays hold: the
           product of their leading blocks, each array keeping its row
           length as leading dimension
    Returns out, or a new (M, N) array when out is None.
    """
    return _gemm(a, b, ta, tb, out, beta, False, m, n, k)


def _bgemm(a, b, ta=False, tb=False, out=None, beta=0.0, m=None, n=None, k=None):
    """rx_bgemm, the bf16 projection GEMM: as _sgemm on a and b rounded to
    bf16 (nearest even), fp32 accumulation (test and benchmark hook)."""
    return _gemm(a, b, ta, tb, out, beta, True, m, n, k)


cdef size_t _within(object v, size_t full, str name) except? 0:
    """v (None: full) after checking 0 < v <= full"""
    if v is None:
        return full
    if not 0 < v <= full:
        raise ValueError(f"{name} must be in [1, {full}], got {v!r}")
    return v


cdef object _gemm(a, b, ta, tb, out, beta, bint bf16, m, n, k):
    _arr(a, "a", np.float32, 2)
    _arr(b, "b", np.float32, 2)
    cdef size_t M = _within(m, a.shape[1] if ta else a.shape[0], "m")
    cdef size_t K = a.shape[0] if ta else a.shape[1]
    cdef size_t Kb = b.shape[1] if tb else b.shape[0]
    cdef size_t N = _within(n, b.shape[0] if tb else b.shape[1], "n")
    if Kb != K:
        raise ValueError(f"b has shape {b.shape}, inner dimension {Kb} != {K} of a")
    K = _within(k, K, "k")
    if beta not in (0.0, 1.0):
        raise ValueError(f"beta must be 0.0 or 1.0, got {beta!r}")
    if out is None:
        if beta != 0.0:
            raise ValueError("beta = 1.0 accumulates into out, which is None")
        out = _empty(M, N)
    else:
        _f32(out, "out", (<object>M, <object>N))
        if not out.flags.writeable:
            raise ValueError("out must be writeable")
    cdef float fbeta = beta
    cdef int ita = 1 if ta else 0, itb = 1 if tb else 0
    cdef size_t lda = a.shape[1], ldb = b.shape[1]
    cdef const float *pa = _ptr(a)
    cdef const float *pb = _ptr(b)
    cdef float *pc = _wptr(out)
    cdef int rc
    with nogil:
        if bf16:
            rc = rx_bgemm(ita, itb, M, N, K, pa, lda, pb, ldb, fbeta, pc, N)
        else:
            rc = rx_sgemm(ita, itb, M, N, K, pa, lda, pb, ldb, fbeta, pc, N)
    _check_rc(rc, "_bgemm" if bf16 else "_sgemm")
    return out


def _sgemm_use_kernel(name=None):
    """Force the GEMM micro-kernel ("generic", "avx2-fma", "avx512f",
    "avx512f-12x32", "avx512f-8x32") for later calls; None picks by CPU again (test hook).
    ValueError if this CPU cannot run it."""
    cdef bytes b
    if name is None:
        rx_sgemm_use_kernel(NULL)
        return
    b = str(name).encode()
    _check_rc(rx_sgemm_use_kernel(b), "_sgemm_use_kernel")


def _sgemm_small_m(size_t m):
    """Batches of at most m rows read op(B) in place (csrc/gemm.c "small
    M"); 0 turns that path off. Returns the previous bound (test hook)."""
    return rx_sgemm_small_m(m)


def _bgemm_pack_budget(size_t elems):
    """bf16 elements of packed op(B) one bf16 GEMM pass holds (csrc/gemm_bf16.c
    PACK_BUDGET; 0 restores it): wider batches run in windows of k or columns.
    Returns the previous budget (test hook)."""
    return rx_bgemm_pack_budget(elems)


def _sgemm_full_budget(size_t floats):
    """Floats of op(B) one thread of a parallel fp32 GEMM packs for a unit
    (csrc/gemm.c FULL_BUDGET; 0 restores it): deeper ops run in k windows.
    Returns the previous budget (test hook)."""
    return rx_sgemm_full_budget(floats)


def _base_sgemm(dtype, rows, a, fast=False, bf16=False):
    """a . W through rx_sgemm reading W from a frozen base (test hook): W^T
    [N, K] held as the stored rows of the base dtype named dtype, uint8 [N,
    K / block values * block bytes]; a float32 [M, K]. op(B) is packed
    from the rows by the dtype's kernels as a model's forward packs it;
    fast=True: the fast decode's integer product instead (q8_0, q4_0);
    bf16=True: through rx_bgemm (bf16 precision's GEMM) instead.
    Returns the float32 [M, N] product."""
    _arr(a, "a", np.float32, 2)
    _arr(rows, "rows", np.uint8, 2)
    elems, nbytes = base_dtype_block(dtype)
    cdef size_t M = a.shape[0], K = a.shape[1], N = rows.shape[0]
    if K % elems or rows.shape[1] != K // elems * nbytes:
        raise ValueError(f"rows of {dtype} for K = {K} take {K // elems * nbytes} bytes of "
                         f"whole {elems}-value blocks; got shape {rows.shape}")
    out = _empty(M, N)
    cdef int code = _BASE_DTYPE_IDS[dtype]
    cdef const unsigned char[:, ::1] raw = rows
    cdef const float *pa = _ptr(a)
    cdef float *pc = _wptr(out)
    cdef int rc, f = 1 if fast else 2 if bf16 else 0   # RX_BASE_GEMM_*
    with nogil:
        rc = rx_base_sgemm(code, &raw[0, 0], M, N, K, pa, pc, f)
    _check_rc(rc, "_base_sgemm")
    return out


def _bgemm_use_kernel(name=None):
    """Force the bf16 GEMM kernel ("amx-bf16", "avx512-bf16",
    "generic-bf16") for later calls; None picks by CPU again (test hook).
    ValueError if this CPU cannot run it."""
    cdef bytes b
    if name is None:
        rx_bgemm_use_kernel(NULL)
        return
    b = str(name).encode()
    _check_rc(rx_bgemm_use_kernel(b), "_bgemm_use_kernel")


def _wkv7_kernel(int head_size):
    """The WKV7 steps used for this head size: "avx512f", "avx2" or "portable"."""
    return rx_wkv7_kernel(head_size).decode()


def _wkv7_use_kernel(name=None):
    """Force the WKV7 steps ("avx512f", "avx2", "portable") for later calls;
    None picks by CPU again (test hook). ValueError if this CPU cannot run
    them."""
    cdef bytes b
    if name is None:
        rx_wkv7_use_kernel(NULL)
        return
    b = str(name).encode()
    _check_rc(rx_wkv7_use_kernel(b), "_wkv7_use_kernel")
