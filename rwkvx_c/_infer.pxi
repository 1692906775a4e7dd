# Recurrent inference for generation (csrc/infer.c). Included by _core.pyx
# after _model.pxi (it reads RxPtModel's C handle).


cdef class InferState:
    """InferState(model, max_len)
--

Recurrent state of one sequence for generation with an RxPtModel.

    InferState(model, max_len)
        model   : the RxPtModel (kept alive; its current parameters are used)
        max_len : most positions the sequence may reach (attention KV cache)

    forward(tokens) runs the next tokens (int32 (T,)) from the carried state
    and returns their logits, float32 (T, vocab_size): the prompt once, then
    one token per call. RWKV-7 blocks carry their WKV state and token-shift
    carries; attention blocks keep a key/value cache and apply the same MoBA
    selection as training. Every block runs the training forward's own
    code: the logits equal model.forward over the whole sequence to float32
    rounding, bit for bit for a call at position 0 (and, without attention,
    for every call).
    """
    cdef rx_infer_state *s
    cdef RxPtModel model
    cdef int vocab, max_len, n_attn
    cdef bint _busy     # a forward runs (the GIL is released): a second caller is refused

    def __cinit__(self):
        self.s = NULL

    def __init__(self, RxPtModel model, max_len):
        cdef int L = _size(max_len, "max_len")
        self.model = model
        self.vocab = model._config["vocab_size"]
        self.n_attn = model._config["n_attn_layer"]
        self.max_len = L
        cdef int rc
        with nogil:
            rc = rx_infer_create(model._h.m, L, &self.s)
        _check_rc(rc, "InferState")

    def __dealloc__(self):
        if self.s != NULL:
            rx_infer_free(self.s)
            self.s = NULL

    @property
    def pos(self):
        """Tokens consumed so far."""
        return rx_infer_pos(self.s)

    def reset(self):
        """Start a new sequence (position 0)."""
        if self._busy:
            raise RuntimeError("InferState is stepping in another thread; reset it after")
        rx_infer_reset(self.s)

    def forward(self, tokens):
        """Logits float32 (T, vocab_size) of the next T tokens (int32 (T,))."""
        _arr(tokens, "tokens", np.int32, 1)
        cdef int T = tokens.shape[0]
        _tokens(tokens, "tokens", T, self.vocab)
        if self.n_attn > 0 and self.pos + T > self.max_len:
            raise ValueError(f"tokens would take the sequence to {self.pos + T} positions, "
                             f"past max_len={self.max_len}")
        logits = _empty(T, self.vocab)
        cdef const int *pt = _iptr(tokens)
        cdef float *pl = _wptr(logits)
        cdef int rc
        # checked and set under the GIL, so of two threads one runs and the
        # other is refused: two steps at once would both read and write the
        # one state (and its position) and one of them would be lost
        if self._busy:
            raise RuntimeError("InferState is already stepping in another thread; one "
                               "sequence is stepped by one thread at a time")
        self._busy = True
        try:
            with nogil:
                rc = rx_infer_forward(self.s, pt, T, pl)
        finally:
            self._busy = False
        _check_rc(rc, "InferState.forward")
        return logits
