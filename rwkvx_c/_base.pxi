# The frozen-base dtypes (docs/architecture.md §The frozen-base dtypes): the
# C table of csrc/base_types.c, read once at import, so no Python module
# lists a dtype or its block geometry itself. Included by _core.pyx.


cdef tuple _base_dtype_table():
    """(name, RX_BASE_* id, block values, block bytes) of each dtype, in the table's order."""
    cdef const char *name
    cdef int i, code, elems, nbytes
    rows = []
    for i in range(rx_base_num_dtypes()):
        rx_base_dtype_info(i, &name, &code, &elems, &nbytes)
        rows.append((name.decode(), code, elems, nbytes))
    return tuple(rows)


_BASE_DTYPE_TABLE = _base_dtype_table()
# the frozen base's dtypes (rx_ptmodel_set_base), by name
BASE_DTYPES = tuple(row[0] for row in _BASE_DTYPE_TABLE)
_BASE_DTYPE_IDS = {row[0]: row[1] for row in _BASE_DTYPE_TABLE}
_BASE_DTYPE_NAMES = {row[1]: row[0] for row in _BASE_DTYPE_TABLE}


def base_dtype_block(dtype):
    """(values, bytes) of one stored block of the frozen-base dtype named
    dtype (one of BASE_DTYPES): a stored row of n values (n a multiple of
    values) takes n // values * bytes bytes; ValueError for another name."""
    for row in _BASE_DTYPE_TABLE:
        if row[0] == dtype:
            return row[2], row[3]
    raise ValueError(f"base dtype must be one of {BASE_DTYPES}, got {dtype!r}")


def base_quantize(dtype, rows):
    """The stored rows a frozen base of dtype holds of rows, float32 [R,
    n] (n a multiple of the block's values): uint8 [R, n / values *
    bytes], the bytes set_base's base_fill writes (for q4_k, ggml's
    quantize_row_q4_K_ref's)."""
    _arr(rows, "rows", np.float32, 2)
    elems, nbytes = base_dtype_block(dtype)
    cdef size_t R = rows.shape[0], n = rows.shape[1], i
    if n % elems:
        raise ValueError(f"base_quantize: rows of {n} values are not whole {elems}-value "
                         f"blocks of {dtype}")
    out = np.empty((R, n // elems * nbytes), np.uint8)
    cdef int code = _BASE_DTYPE_IDS[dtype], rc = RX_OK
    cdef const float[:, ::1] src = rows
    cdef unsigned char[:, ::1] dst = out
    with nogil:
        for i in range(R):
            rc = rx_base_quantize(code, &src[i, 0], n, &dst[i, 0])
            if rc != RX_OK:
                break
    _check_rc(rc, "base_quantize")
    return out


def base_dequantize(dtype, data):
    """base_quantize's rows back as float32 [R, n] (exact: the values a
    base of dtype computes with)."""
    _arr(data, "data", np.uint8, 2)
    elems, nbytes = base_dtype_block(dtype)
    cdef size_t R = data.shape[0], n = data.shape[1] // nbytes * elems, i
    if data.shape[1] % nbytes:
        raise ValueError(f"base_dequantize: rows of {data.shape[1]} bytes are not whole "
                         f"{nbytes}-byte blocks of {dtype}")
    out = np.empty((R, n), np.float32)
    cdef int code = _BASE_DTYPE_IDS[dtype], rc = RX_OK
    cdef const unsigned char[:, ::1] src = data
    cdef float[:, ::1] dst = out
    with nogil:
        for i in range(R):
            rc = rx_base_dequantize(code, &src[i, 0], n, &dst[i, 0])
            if rc != RX_OK:
                break
    _check_rc(rc, "base_dequantize")
    return out
