# The model's steps (docs/maths.md §Whole model): RxPtModel, the public class, adds
# the forward, the backward and the losses to _ModelCore (_model.pxi). Included by
# _core.pyx after _model.pxi.


cdef class RxPtModel(_ModelCore):
    """RxPtModel(config, seed=0, *, precision='fp32', recompute=False, l2wrap=0.0, init=True,
                dense=False)
--

A whole RWKV-X model (docs/maths.md §Whole model) with its parameters and grads in two
    flat float32 arenas, initialised by the docs/layout.md §Init splitmix64 scheme.

    Arguments:
        config : dict with exactly the rx_pt_config fields (CONFIG_FIELDS):
                 n_embd, n_head, head_size, n_rwkv_layer, n_attn_layer,
                 vocab_size, Dw, Da, Dg, Dv, ffn_dim, chunk_size, moba_top_k;
                 optionally the model context's keys (OPTION_FIELDS, with
                 their defaults, RX_DEFAULT_* of rx_pretrain.h; each is
                 described where rwkvx_c.model.config.ModelConfig declares
                 it). ln0 = 1 adds x0 = LayerNorm(emb[token]) with params
                 ln0_w, ln0_b right after emb.
        seed   : int in [0, 2**64)
        precision : "fp32", or "bf16": every projection GEMM multiplies
                 bf16-rounded operands with fp32 accumulation; parameters,
                 grads, WKV7, norms, softmax and the loss stay fp32 (see
                 rx_pretrain.h). Readable and settable as m.precision.
        recompute : True keeps only each block's input during the forward and
                 runs the block's forward again in its backward (activation
                 checkpointing, RWKV-LM's --grad_cp): the same loss and grads,
                 bit for bit, in about one block's activations instead of
                 every block's. Settable as m.recompute.
        l2wrap : RWKV-LM's L2Wrap factor (0: off; RWKV-LM uses 1e-4): the
                 backward adds l2wrap * max logit / (B*T) to the grad of each
                 position's largest logit. Settable as m.l2wrap.
        init   : False: no init, every parameter zero, and the arenas mapped
                 lazily (a page never written takes no memory): for weights
                 that come from elsewhere, and for a frozen base (set_base).
        dense  : with init False, the caller writes every parameter (a whole
                 model read from a file, no frozen base): the parameters sit
                 on transparent huge pages, which decoding reads faster (a
                 model made with init always does).
    A missing or unknown key, or a value breaking docs/maths.md §Whole model, is a ValueError
    naming it.

    params / grads map each docs/layout.md §Parameters name to a writable zero-copy view of its
    tensor; param_buffer / grad_buffer view the whole arenas. A view keeps
    the model's memory alive after the model itself is deleted.
    """

    def forward(self, tokens, *, return_logits=True):
        """Logits of the model on a token sequence or a batch of them.

        tokens        : int32 (T,) or (B, T), every entry in [0, vocab_size)
        return_logits : False returns None and holds no logits at all: the
                        backward (and loss()) then run the head and the loss
                        over row chunks of a fixed scratch budget, so no
                        (B*T, vocab) buffer exists (docs/maths.md §Chunked
                        head). True computes and returns every logit.
        Returns float32 (T, vocab_size) or (B, T, vocab_size), a new array.
        A batch runs its B sequences independently and together.
        """
        if not isinstance(tokens, np.ndarray):
            raise TypeError(f"tokens must be a numpy.ndarray of int32, got {type(tokens).__name__}")
        if tokens.ndim not in (1, 2):
            raise ValueError(f"tokens must be (T,) or (B, T), got shape {tokens.shape}")
        _arr(tokens, "tokens", np.int32, tokens.ndim)
        if tokens.size > _INT_MAX:
            raise ValueError(f"tokens has {tokens.size} entries, more than the C API's int range")
        cdef int V = self._config["vocab_size"]
        cdef int B = 1 if tokens.ndim == 1 else tokens.shape[0]
        cdef int T = tokens.shape[tokens.ndim - 1]
        cdef const int *ptok
        cdef int rc
        cdef int flags = (RX_ACTS_RECOMPUTE if self._recompute else 0) | \
            (0 if return_logits else RX_ACTS_CHUNKED_HEAD)
        _tokens(tokens.reshape(-1), "tokens", B * T, V)
        self._enter()
        try:
            self._fwd_shape = None
            group = self.row_group_of(B, T)
            if self._acts == NULL or self._B != B or self._T != T or \
                    self._acts_flags != flags or self._acts_group != group:
                # the activations of B x T tokens, filled as the forward runs
                _check_alloc(<int64_t>B * T * (_act_bytes_per_token(self._config, self._recompute)
                                               + (4 * V if return_logits else 0)),
                             f"a forward of {B} x {T} tokens", "pass fewer tokens at once"
                             + ("" if self._recompute else ", or recompute=True"))
                if self._acts != NULL:
                    rx_pt_acts_free(self._acts)
                    self._acts = NULL
                rc = rx_pt_acts_create_groups(self._h.m, B, T, flags, 0, group, &self._acts)
                _check_rc(rc, "RxPtModel.forward")
                self._B, self._T, self._acts_flags, self._acts_group = B, T, flags, group
            logits = _empty(*tokens.shape, V) if return_logits else None
            ptok = _iptr(tokens)
            with nogil:
                rc = rx_pretrain_forward_batch(self._h.m, ptok, B, T, self._acts)
            _check_rc(rc, "RxPtModel.forward")
            if logits is not None:
                memcpy(_wptr(logits), self._acts.logits, <size_t>B * T * V * sizeof(float))
            self._fwd_shape = tokens.shape
        finally:
            self._busy = False
        return logits

    def backward(self, targets, int ignore_index=-1):
        """Loss of the last forward against targets, with every grad.

        targets      : int32 with the shape of the last forward's tokens, each
                       in [0, vocab_size) or equal to ignore_index
        ignore_index : positions whose target equals it are left out of the
                       mean (a negative ignore_index keeps every position)
        Returns the mean cross-entropy over the valid positions (0.0 when none
        is) as a float and overwrites grads / grad_buffer with its gradient.
        Every block reuses the intermediates its forward kept (backward may
        run again on the same forward): change no parameter between
        forward() and backward().
        """
        if self._fwd_shape is None:
            raise ValueError("RxPtModel.backward: no forward() preceded it")
        if not isinstance(targets, np.ndarray):
            raise TypeError(f"targets must be a numpy.ndarray of int32, got {type(targets).__name__}")
        if targets.shape != self._fwd_shape:
            raise ValueError(f"targets has shape {targets.shape}, expected {self._fwd_shape} "
                             "(the shape of the last forward's tokens)")
        _arr(targets, "targets", np.int32, targets.ndim)
        # checked and read from a private copy: another thread writing to the
        # caller's array cannot make the ids the kernels read differ from
        # the ids checked
        targets = targets.copy()
        cdef int B = self._B, T = self._T
        _targets(targets.reshape(-1), "targets", B * T, self._config["vocab_size"], ignore_index)
        cdef double loss
        cdef int rc
        cdef const int *ptgt = _iptr(targets)
        self._enter()
        try:
            with nogil:
                rc = rx_pretrain_backward_loss(self._h.m, self._acts, ptgt, B, T, ignore_index,
                                               &loss)
        finally:
            self._busy = False
        _check_rc(rc, "RxPtModel.backward")
        return loss

    def loss(self, targets, int ignore_index=-1):
        """Mean cross-entropy of the last forward against targets, without
        any grad (evaluation): the loss backward() would return, with the
        same bits. Arguments as backward(); the grads are left as they are.
        """
        if self._fwd_shape is None:
            raise ValueError("RxPtModel.loss: no forward() preceded it")
        if not isinstance(targets, np.ndarray):
            raise TypeError(f"targets must be a numpy.ndarray of int32, got {type(targets).__name__}")
        if targets.shape != self._fwd_shape:
            raise ValueError(f"targets has shape {targets.shape}, expected {self._fwd_shape} "
                             "(the shape of the last forward's tokens)")
        _arr(targets, "targets", np.int32, targets.ndim)
        targets = targets.copy()   # checked and read from a private copy, as in backward
        cdef int B = self._B, T = self._T
        _targets(targets.reshape(-1), "targets", B * T, self._config["vocab_size"], ignore_index)
        cdef double loss
        cdef int rc
        cdef const int *ptgt = _iptr(targets)
        self._enter()
        try:
            with nogil:
                rc = rx_pretrain_loss(self._h.m, self._acts, ptgt, B, T, ignore_index, &loss)
        finally:
            self._busy = False
        _check_rc(rc, "RxPtModel.loss")
        return loss

    cdef object _rows_targets(self, object targets, str fn, int ignore_index):
        """targets checked against the last forward, as a private copy (as in backward)."""
        if self._fwd_shape is None:
            raise ValueError(f"RxPtModel.{fn}: no forward() preceded it")
        if not isinstance(targets, np.ndarray):
            raise TypeError(f"targets must be a numpy.ndarray of int32, got {type(targets).__name__}")
        if targets.shape != self._fwd_shape:
            raise ValueError(f"targets has shape {targets.shape}, expected {self._fwd_shape} "
                             "(the shape of the last forward's tokens)")
        _arr(targets, "targets", np.int32, targets.ndim)
        targets = targets.copy()
        _targets(targets.reshape(-1), "targets", self._B * self._T, self._config["vocab_size"],
                 ignore_index)
        return targets

    cdef object _f64_out(self, object out, str name, tuple shape):
        if out is None:
            return np.empty(shape, np.float64)
        if not isinstance(out, np.ndarray) or out.dtype != np.float64 or out.shape != shape \
                or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"{name} must be a writable C-contiguous float64 array of shape "
                             f"{shape}")
        return out

    def row_losses(self, targets, int ignore_index=-1, out=None, double temperature=1.0):
        """Each position's cross-entropy of the last forward against targets
        (0.0 where the target is ignore_index), without any grad: a
        sequence's summed log-probability is minus the sum of its row
        (docs/maths.md §Preference tuning). Arguments as loss(); out: a
        float64 array shaped as targets to write into; temperature: of the
        logits divided by it (docs/maths.md §GRPO). Returns it."""
        targets = self._rows_targets(targets, "row_losses", ignore_index)
        out = self._f64_out(out, "out", targets.shape)
        cdef double[::1] ov = out.reshape(-1)
        cdef const int *ptgt = _iptr(targets)
        cdef int B = self._B, T = self._T, rc
        self._enter()
        try:
            with nogil:
                rc = rx_pretrain_row_losses_temp(self._h.m, self._acts, ptgt, B, T,
                                                 ignore_index, temperature, &ov[0])
        finally:
            self._busy = False
        _check_rc(rc, "RxPtModel.row_losses")
        return out

    def backward_rows(self, targets, weight, int ignore_index=-1, out=None,
                      double temperature=1.0):
        """The backward of sum_t weight[t] * row_loss[t]: each position's
        cross-entropy grad scaled by its weight (a float64 array shaped as
        targets) instead of the mean's 1/n. Overwrites grads / grad_buffer
        as backward() does and returns row_losses (into out when given),
        both of the logits divided by temperature as row_losses'."""
        targets = self._rows_targets(targets, "backward_rows", ignore_index)
        if not isinstance(weight, np.ndarray) or weight.dtype != np.float64 \
                or weight.shape != targets.shape:
            raise ValueError(f"weight must be a float64 array of shape {targets.shape}")
        weight = np.ascontiguousarray(weight)
        out = self._f64_out(out, "out", targets.shape)
        cdef const double[::1] wv = weight.reshape(-1)
        cdef double[::1] ov = out.reshape(-1)
        cdef const int *ptgt = _iptr(targets)
        cdef int B = self._B, T = self._T, rc
        self._enter()
        try:
            with nogil:
                rc = rx_pretrain_backward_rows_temp(self._h.m, self._acts, ptgt, B, T,
                                                    ignore_index, temperature, &wv[0], &ov[0])
        finally:
            self._busy = False
        _check_rc(rc, "RxPtModel.backward_rows")
        return out

    def zero_grad(self):
        """Set every grad to zero."""
        self._enter()
        try:
            rx_ptmodel_zero_grad(self._h.m)
        finally:
            self._busy = False

    def __repr__(self):
        c = self._config
        return (f"RxPtModel(layers='{self._layers}', n_params={self.n_params:,}, "
                f"n_embd={c['n_embd']}, n_head={c['n_head']}x{c['head_size']}, "
                f"vocab_size={c['vocab_size']}, ffn_dim={c['ffn_dim']})")
