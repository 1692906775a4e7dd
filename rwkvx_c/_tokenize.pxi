# Greedy longest-match byte-trie tokenizer (csrc/tokenize.c). Included by _core.pyx.
from libc.stdint cimport int32_t, int64_t, uint8_t


cdef const uint8_t[::1] _u8view(object data, str name):
    """A read-only byte view of bytes / bytearray / memoryview / uint8 array."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise TypeError(f"{name} must be a 1-D uint8 array, got {data.dtype} {data.shape}")
        return np.ascontiguousarray(data)
    return memoryview(data).cast("B")


cdef class ByteTrie:
    """ByteTrie(entries, vocab_size)
--

A vocabulary of byte strings encoded by greedy longest match.

    ByteTrie(entries, vocab_size): entries is a list of (bytes, id) pairs,
    ids in [0, vocab_size), every one-byte string present. When two entries
    share the same bytes, the later one wins (as a dict built from them would).
    """
    cdef rx_trie *t
    cdef readonly int vocab_size
    cdef readonly int max_len

    def __cinit__(self, entries, int vocab_size):
        last = {}
        for b, i in entries:
            last[bytes(b)] = int(i)
        keys = sorted(last)
        blob = b"".join(keys)
        offs = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum([len(k) for k in keys], out=offs[1:])
        ids = np.array([last[k] for k in keys], dtype=np.int32)
        cdef const uint8_t[::1] bv = _u8view(blob if blob else b"\0", "entries")
        cdef const int64_t[::1] ov = offs
        cdef const int32_t[::1] iv = ids
        cdef int err = 0
        cdef int64_t n = len(keys)
        if n < 256:
            raise ValueError(f"a byte trie needs all 256 one-byte entries; got {n} entries")
        with nogil:
            self.t = rx_trie_build(&bv[0], &ov[0], &iv[0], n, vocab_size, &err)
        _check_rc(err, "ByteTrie")
        self.vocab_size = vocab_size
        self.max_len = rx_trie_max_len(self.t)

    def __dealloc__(self):
        rx_trie_free(self.t)

    def token_lengths(self):
        """int32 (vocab_size,): byte length of each id (0 for ids with no entry)."""
        out = np.empty(self.vocab_size, dtype=np.int32)
        cdef int32_t[::1] o = out
        cdef int32_t i
        for i in range(self.vocab_size):
            o[i] = rx_trie_token_len(self.t, i)
        return out

    def encode(self, data, bint final=True, int threads=1):
        """Bytes-like -> int32 ids; with final=False -> (ids, consumed): only
        the tokens whose match cannot change with more input, and where the
        next piece must start (data[consumed:] is carried over)."""
        cdef const uint8_t[::1] x = _u8view(data, "data")
        cdef int64_t n = x.shape[0], consumed = 0, k
        out = np.empty(max(n, 1), dtype=np.int32)
        scratch = np.empty(max(n, 1), dtype=np.int32) if threads > 1 else out
        cdef int32_t[::1] o = out, s = scratch
        cdef const uint8_t *px = &x[0] if n else NULL
        with nogil:
            k = rx_trie_encode(self.t, px, n, final, threads, &o[0],
                               &s[0] if threads > 1 else NULL, &consumed)
        _check_rc(<int>k if k < 0 else RX_OK, "rx_trie_encode")
        ids = out[:k].copy() if k < n // 2 else out[:k]
        return ids if final else (ids, int(consumed))

    def encode_docs(self, data, offsets, int threads=1):
        """Documents data[offsets[d]:offsets[d+1]] each encoded on its own,
        spread over threads. Returns (ids int32, counts int64 per document)."""
        cdef const uint8_t[::1] x = _u8view(data, "data")
        offs = np.ascontiguousarray(offsets, dtype=np.int64)
        if offs.ndim != 1 or offs.shape[0] < 1 or offs[0] < 0 \
                or offs[offs.shape[0] - 1] > x.shape[0] or np.any(np.diff(offs) < 0):
            raise ValueError("offsets must be non-decreasing positions in data")
        cdef int64_t nd = offs.shape[0] - 1, k
        cdef int64_t nb = offs[nd] - offs[0]
        out = np.empty(max(nb, 1), dtype=np.int32)
        counts = np.zeros(max(nd, 1), dtype=np.int64)
        cdef const int64_t[::1] ov = offs
        cdef int32_t[::1] o = out
        cdef int64_t[::1] c = counts
        cdef const uint8_t *px = &x[0] if x.shape[0] else NULL
        with nogil:
            k = rx_trie_encode_docs(self.t, px, &ov[0], nd, threads, &o[0], &c[0])
        _check_rc(<int>k if k < 0 else RX_OK, "rx_trie_encode_docs")
        return out[:k], counts[:nd]
