# Batched recurrent generation (csrc/gen.c). Included by _core.pyx after
# _model.pxi (it reads RxPtModel's C handle).


cdef object _int_vec(object v, str name, int n_max):
    """v (a sequence of ints or an integer array) as a new C-contiguous
    int32 (n,) array, 1 <= n <= n_max."""
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got dtype {v.dtype}")
        if v.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {v.shape}")
    elif isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
        raise TypeError(f"{name} must be a sequence of ints or an integer array, "
                        f"got {type(v).__name__}")
    elif any(isinstance(e, bool) or not isinstance(e, (int, np.integer)) for e in v):
        raise TypeError(f"{name} must hold ints")
    a = np.asarray(v, dtype=np.int64)
    if a.ndim != 1 or not 1 <= a.shape[0] <= n_max:
        raise ValueError(f"{name} must hold 1 to {n_max} entries, got shape {a.shape}")
    if int(a.min()) < _INT_MIN or int(a.max()) > _INT_MAX:
        raise ValueError(f"{name} entries exceed the C API's int range")
    return np.ascontiguousarray(a, dtype=np.int32)


cdef class GenState:
    """GenState(model, n_slots, max_len=4096, max_tokens=512)
--

Recurrent state of n_slots sequences of one RxPtModel, advanced together.

    GenState(model, n_slots, max_len=4096, max_tokens=512, fast_decode=False)
        model      : the RxPtModel (kept alive; its current parameters,
                     precision, frozen base and LoRA adapters are used)
        n_slots    : sequences held
        max_len    : most positions a slot may reach (the attention blocks'
                     key/value cache; a model without attention ignores it)
        max_tokens : most tokens one step advances in all (sizes the
                     scratch once: a step allocates nothing)
        fast_decode: the products over a Q8_0 or Q4_0 frozen base in
                     integer dot products of each row's activations
                     quantised to int8 blocks, as llama.cpp does: faster,
                     still independent of the other slots, no longer the
                     training forward's to float32 rounding
                     (docs/training.md §Fast decode); also a property

    step(slots, counts, tokens) advances slot slots[i] by counts[i] tokens,
    taken in order from tokens (int32, sum(counts) of them): one token per
    decoding slot, a chunk of a prompt for a slot that joins, all in one
    call whose projections are one GEMM over every row. It returns the
    logits, float32 (n, vocab_size) of each slot's last token, or with
    all_logits=True (sum(counts), vocab_size) of every token. Each block
    runs the training forward's own code: a slot's logits equal
    model.forward over its sequence to float32 rounding and do not depend
    on which slots share the step. reset(slot) starts a slot anew (the
    state tune's initial states, else zeros), copy(dst, src) clones one.
    """
    cdef rx_gen *g
    cdef RxPtModel model
    cdef public int n_slots, max_len, max_tokens, vocab_size
    cdef int n_attn
    cdef bint _busy     # a step runs (the GIL is released): a second caller is refused
    cdef bint _fast     # fast_decode

    def __cinit__(self):
        self.g = NULL

    def __init__(self, RxPtModel model, n_slots, max_len=4096, max_tokens=512,
                 fast_decode=False):
        cdef int S = _size(n_slots, "n_slots")
        cdef int L = _size(max_len, "max_len")
        cdef int MT = _size(max_tokens, "max_tokens")
        self.model = model
        self.n_slots, self.max_len, self.max_tokens = S, L, MT
        self.vocab_size = model._config["vocab_size"]
        self.n_attn = model._config["n_attn_layer"]
        cdef int rc
        with nogil:
            rc = rx_gen_create(model._h.m, S, L, MT, &self.g)
        _check_rc(rc, "GenState")
        self.fast_decode = fast_decode

    def __dealloc__(self):
        if self.g != NULL:
            rx_gen_free(self.g)
            self.g = NULL

    cdef int _slot(self, object slot, str name) except -1:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(slot).__name__}")
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"{name} = {slot} is outside [0, {self.n_slots})")
        return slot

    cdef int _idle(self, str what) except -1:
        if self._busy:
            raise RuntimeError(f"GenState is stepping in another thread; {what} it after")
        return 0

    def reset(self, slot):
        """Start slot anew: position 0, the model's initial state."""
        cdef int s = self._slot(slot, "slot")
        self._idle("reset")
        _check_rc(rx_gen_reset(self.g, s), "GenState.reset")

    def copy(self, dst, src):
        """Slot dst := slot src (state, cache and position)."""
        cdef int d = self._slot(dst, "dst"), s = self._slot(src, "src")
        self._idle("copy")
        _check_rc(rx_gen_copy(self.g, d, s), "GenState.copy")

    @property
    def fast_decode(self):
        """Whether steps take the fast decode (see the class); settable
        between steps."""
        return self._fast

    @fast_decode.setter
    def fast_decode(self, on):
        if not isinstance(on, (bool, int)) or on not in (0, 1):
            raise TypeError(f"fast_decode must be a bool; got {on!r}")
        self._idle("set fast_decode")
        _check_rc(rx_gen_set_fast(self.g, 1 if on else 0), "GenState.fast_decode")
        self._fast = bool(on)

    def pos(self, slot):
        """Tokens slot has consumed since its reset."""
        return rx_gen_pos(self.g, self._slot(slot, "slot"))

    def step(self, slots, counts, tokens, all_logits=False, out=None):
        """Advance slots[i] by counts[i] of tokens (int32); the logits,
        float32 (n, vocab_size), or (sum(counts), vocab_size) with
        all_logits (into out when given)."""
        s = _int_vec(slots, "slots", self.n_slots)
        c = _int_vec(counts, "counts", self.n_slots)
        n = s.shape[0]
        if c.shape[0] != n:
            raise ValueError(f"counts has {c.shape[0]} entries, slots {n}")
        if len(set(s.tolist())) != n:
            raise ValueError("slots must be distinct")
        if int(s.min()) < 0 or int(s.max()) >= self.n_slots:
            raise ValueError(f"slots entries must lie in [0, {self.n_slots})")
        if int(c.min()) < 1:
            raise ValueError("counts entries must be >= 1")
        total = int(c.sum())
        if total > self.max_tokens:
            raise ValueError(f"counts sum to {total}, past max_tokens={self.max_tokens}")
        if not isinstance(all_logits, (bool, np.bool_)):
            raise TypeError(f"all_logits must be a bool, got {type(all_logits).__name__}")
        _tokens(tokens, "tokens", total, self.vocab_size)
        if self.n_attn > 0:
            for i in range(n):
                p = rx_gen_pos(self.g, s[i])
                if p + c[i] > self.max_len:
                    raise ValueError(f"slot {s[i]}: {c[i]} tokens at position {p} would pass "
                                     f"max_len={self.max_len}")
        rows = total if all_logits else n
        if out is None:
            out = _empty(rows, self.vocab_size)
        else:
            _f32(out, "out", (rows, self.vocab_size))
        cdef const int *ps = _iptr(s)
        cdef const int *pc = _iptr(c)
        cdef const int *pt = _iptr(tokens)
        cdef float *pl = _wptr(out)
        cdef int rc, nn = n, al = 1 if all_logits else 0
        # checked and set under the GIL: of two threads one runs and the
        # other is refused (both would read and write the same slots)
        if self._busy:
            raise RuntimeError("GenState is already stepping in another thread; a state is "
                               "stepped by one thread at a time")
        self._busy = True
        try:
            with nogil:
                rc = rx_gen_step(self.g, nn, ps, pc, pt, al, pl)
        finally:
            self._busy = False
        _check_rc(rc, "GenState.step")
        return out


def draw_rows(const float[:, ::1] x not None, const float[:, ::1] raw not None,
              const double[::1] u not None, double temperature, double top_p, int top_k):
    """Each row's next token drawn from x (R, V) by u[r] in [0, 1), and its
    log-probability under raw (R, V), the model's logits (csrc/sample.c,
    rx_sample_rows; x may be raw itself): (ids int32 (R,), logprobs
    float64 (R,)); ids[r] = -1 for a row whose raw logits are not all
    finite or whose x has no finite value."""
    cdef Py_ssize_t R = x.shape[0], V = x.shape[1]
    if raw.shape[0] != R or raw.shape[1] != V or u.shape[0] != R:
        raise ValueError(f"x {(R, V)}, raw {(raw.shape[0], raw.shape[1])} and u "
                         f"({u.shape[0]},) must agree")
    if V < 1 or V > _INT_MAX or R > _INT_MAX:
        raise ValueError(f"x's shape {(R, V)} is outside the C API's range")
    ids = np.empty(R, np.int32)
    lps = np.empty(R, np.float64)
    if R == 0:
        return ids, lps
    cdef int32_t[::1] pi = ids
    cdef double[::1] pl = lps
    cdef int rc
    with nogil:
        rc = rx_sample_rows(<int>R, <int>V, &x[0, 0], &raw[0, 0], <size_t>V, &u[0],
                            temperature, top_p, top_k, &pi[0], &pl[0])
    _check_rc(rc, "draw_rows")
    return ids, lps
