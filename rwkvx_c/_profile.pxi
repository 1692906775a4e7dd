# Per-kernel time accounting (csrc/runtime.c), a benchmark hook. Included by _core.pyx.


def profile_enable(on=True):
    """Zero the per-kernel time counters and start (on=True) or stop counting.

    Counts the rwkvx_c calls made from the calling thread; read with profile().
    """
    rx_profile_enable(1 if on else 0)


def profile():
    """Seconds of self time per kernel since profile_enable(True): dict
    slot name -> seconds ('gemm', 'wkv7', 'attention core', 'norms',
    'cross-entropy', 'dora norms' (DoRA's column norms), and 'other
    (elementwise, glue)' for the rest)."""
    cdef double secs[32]
    cdef int n = rx_profile_read(secs, 32)
    return {rx_profile_name(i).decode(): secs[i] for i in range(min(n, 32))}
