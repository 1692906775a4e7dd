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
