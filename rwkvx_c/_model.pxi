# The whole model (docs/maths.md, docs/layout.md) over csrc/model.c: its arenas,
# parameters and trainable parts (_ModelCore; RxPtModel adds the steps in _steps.pxi).
# Included by _core.pyx after _config.pxi.
from cpython.buffer cimport PyBUF_FORMAT, PyBUF_WRITABLE
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcpy

# Row groups (RxPtModel.row_group_of): the fewest tokens a group runs (fewer
# rows would read a frozen base's weights more often than the step gains)
# and what they are a multiple of (the GEMMs' k range, so each adapter
# weight grad adds the same k ranges in the same order as one product).
GROUP_ROWS = 1024
GROUP_ALIGN = 256


cdef class _ModelHandle:
    """Owns one C model. RxPtModel and every array view hold a reference, so
    the C memory is freed only when the last of them is gone."""
    cdef rx_ptmodel *m

    def __dealloc__(self):
        if self.m != NULL:
            rx_ptmodel_free(self.m)
            self.m = NULL


cdef class _Arena:
    """A writable 1-D float32 buffer over one of the model's arenas."""
    cdef _ModelHandle handle
    cdef float *ptr
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __getbuffer__(self, Py_buffer *buf, int flags):
        buf.buf = <void *>self.ptr
        buf.obj = self
        buf.len = self.shape[0] * sizeof(float)
        buf.itemsize = sizeof(float)
        buf.readonly = 0
        buf.ndim = 1
        buf.format = NULL
        if flags & PyBUF_FORMAT:
            buf.format = b"f"
        buf.shape = self.shape
        buf.strides = self.strides
        buf.suboffsets = NULL
        buf.internal = NULL

    def __releasebuffer__(self, Py_buffer *buf):
        pass


cdef object _arena_view(_ModelHandle h, float *ptr, int64_t n):
    cdef _Arena a = _Arena.__new__(_Arena)
    a.handle, a.ptr = h, ptr
    a.shape[0], a.strides[0] = n, sizeof(float)
    return np.asarray(a)


cdef int _precision_code(precision) except -1:
    if precision == "fp32":
        return RX_PRECISION_FP32
    if precision == "bf16":
        return RX_PRECISION_BF16
    raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")


cdef class _ModelCore:
    """The model's arenas, parameters and trainable parts: the state and
    attributes RxPtModel (_steps.pxi, the public class) runs its steps on."""
    cdef _ModelHandle _h
    cdef rx_pt_acts *_acts
    cdef int _B, _T            # the batch shape _acts was made for
    cdef int _acts_flags       # the RX_ACTS_* options _acts was made with
    cdef int _acts_group       # the sequences per row group _acts was made with
    cdef bint _recompute
    cdef object _row_group     # None: automatic; 0: the whole batch; n: at most n sequences
    cdef object _fwd_shape     # tokens shape of the last successful forward
    cdef bint _busy            # a forward / backward runs (the GIL is released)
    cdef dict _config, _params, _grads
    cdef list _names
    cdef object _pbuf, _gbuf
    cdef object _sbuf, _sgbuf  # the initial WKV states and their grads (None until enabled)
    cdef object _lbuf, _lgbuf  # the LoRA adapters' arena and its grads (None without)
    cdef dict _lora, _lora_g
    cdef int _lora_r
    cdef double _lora_alpha
    cdef str _layers

    def __cinit__(self):
        self._acts = NULL

    def __init__(self, config, seed=0, *, precision="fp32", recompute=False, l2wrap=0.0,
                 init=True, dense=False):
        if self._h is not None:
            # a second __init__ would swap the arenas under live views and _acts
            raise RuntimeError("RxPtModel is already initialised; make a new one")
        cdef rx_pt_config c = _pt_config(config)
        cdef rx_model_ctx ctx = _pt_ctx(config)
        # dense (init False): the caller writes every parameter, so the
        # arena is on huge pages (as a model with init always is)
        cdef int flags = 0 if init else RX_PT_NO_INIT | (RX_PT_DENSE if dense else 0)
        cdef int prec = _precision_code(precision)
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if not 0 <= seed < 2 ** 64:
            raise ValueError(f"seed must lie in [0, 2**64), got {seed}")
        cdef uint64_t s = seed
        cdef int rc
        # the arenas are calloc'ed lazily and the init fills them: check first
        # (without init the caller checks what it will write)
        if init:
            _check_alloc(8 * _param_elems(config), "RxPtModel (parameters and grads)",
                         "choose a smaller model")
        h = _ModelHandle()
        with nogil:
            rc = rx_model_create_ctx(&c, &ctx, flags, s, &h.m)
        _check_rc(rc, "RxPtModel")
        self._h = h
        rx_ptmodel_set_precision(h.m, prec)
        self.recompute = recompute
        self.l2wrap = l2wrap
        self._config = {k: int(config[k]) for k in CONFIG_FIELDS}
        rx_ptmodel_ctx(h.m, &ctx)
        got = _ctx_dict(&ctx)
        self._config.update({k: got[k] for k in _CTX_KEYS})
        self._layers = rx_ptmodel_layers(h.m).decode()
        cdef int64_t n
        cdef float *base = rx_ptmodel_param_arena(h.m, &n)
        self._pbuf = _arena_view(h, base, n)
        self._gbuf = _arena_view(h, rx_ptmodel_grad_arena(h.m, NULL), n)
        cdef const char *name
        cdef float *data
        cdef float *grad
        cdef int cnt, ndim
        cdef int shape[2]
        self._names, self._params, self._grads = [], {}, {}
        for i in range(rx_ptmodel_num_params(h.m)):
            rx_ptmodel_param(h.m, i, &name, &data, &grad, &cnt)
            ndim = rx_ptmodel_param_shape(h.m, i, shape)
            off = data - base
            key = name.decode()
            shp = (shape[0], shape[1])[:ndim]
            self._names.append(key)
            self._params[key] = self._pbuf[off:off + cnt].reshape(shp)
            self._grads[key] = self._gbuf[off:off + cnt].reshape(shp)
        self._fwd_shape = None

    def __dealloc__(self):
        if self._acts != NULL:
            rx_pt_acts_free(self._acts)
            self._acts = NULL

    @property
    def config(self):
        """The config dict (a copy), every optional key (OPTION_FIELDS) with its value."""
        return dict(self._config)

    @property
    def precision(self):
        """The projections' GEMM precision, "fp32" or "bf16" (settable)."""
        return "bf16" if rx_ptmodel_precision(self._h.m) == RX_PRECISION_BF16 else "fp32"

    @precision.setter
    def precision(self, value):
        cdef int prec = _precision_code(value)
        if self._busy:
            raise RuntimeError("RxPtModel: precision changed while a forward or backward runs")
        rx_ptmodel_set_precision(self._h.m, prec)

    @property
    def recompute(self):
        """True: activation recompute (see the class docstring; settable)."""
        return bool(self._recompute)

    @recompute.setter
    def recompute(self, value):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"recompute must be a bool, got {type(value).__name__}")
        if self._busy:
            raise RuntimeError("RxPtModel: recompute changed while a forward or backward runs")
        self._recompute = bool(value)

    @property
    def row_group(self):
        """Sequences per row group under recompute (docs/maths.md §Row
        groups; settable): None (the default) chooses (row_group_of), 0
        runs the whole batch at once, n >= 1 at most n sequences a group
        (the largest divisor of the batch not above n)."""
        return self._row_group

    @row_group.setter
    def row_group(self, value):
        if value is not None and (isinstance(value, bool) or
                                  not isinstance(value, (int, np.integer)) or value < 0):
            raise ValueError(f"row_group must be None or an int >= 0, got {value!r}")
        if self._busy:
            raise RuntimeError("RxPtModel: row_group changed while a forward or backward runs")
        self._row_group = None if value is None else int(value)

    @property
    def groups_exact(self):
        """True when a backward over row groups gives this model's grads
        (LoRA adapters, not DoRA, on an otherwise frozen RWKV model without
        trainable states): where the automatic row_group groups."""
        return rx_ptmodel_groups_exact(self._h.m) == 1

    def row_group_of(self, int B, int T, exact=None):
        """The sequences per row group a step of B x T tokens runs in: B
        without recompute or with row_group 0; the largest divisor of B not
        above row_group when it is set; automatically (None), when
        groups_exact (or exact, when not None: what a tune about to enable
        its adapters will be), the fewest sequences whose GROUP_ROWS or
        more tokens are a multiple of GROUP_ALIGN (so the grads keep their
        bits), else B."""
        if not self._recompute or self._row_group == 0 or B < 1 or T < 1:
            return B
        if self._row_group is not None:
            return max(d for d in range(1, min(self._row_group, B) + 1) if B % d == 0)
        if self._layers.count("A") or not (self.groups_exact if exact is None else exact):
            return B
        return next((d for d in range(1, B) if B % d == 0 and d * T >= GROUP_ROWS and
                     d * T % GROUP_ALIGN == 0), B)

    def group_saving(self, int B, int T, exact=None):
        """Bytes a step of B x T tokens keeps fewer in row groups
        (row_group_of, exact as there) than with the whole batch at once."""
        g = self.row_group_of(B, T, exact)
        if g == B:
            return 0
        return 4 * (<int64_t>rx_pt_acts_group_floats(self._h.m, B, T, B) -
                    <int64_t>rx_pt_acts_group_floats(self._h.m, B, T, g))

    @property
    def l2wrap(self):
        """The L2Wrap factor of every backward (0.0: off; settable)."""
        return rx_ptmodel_l2wrap(self._h.m)

    @l2wrap.setter
    def l2wrap(self, value):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"l2wrap must be a number, got {type(value).__name__}")
        f = float(value)
        if not (f >= 0.0 and math.isfinite(f)):
            raise ValueError(f"l2wrap must be finite and >= 0, got {value!r}")
        if self._busy:
            raise RuntimeError("RxPtModel: l2wrap changed while a forward or backward runs")
        _check_rc(rx_ptmodel_set_l2wrap(self._h.m, f), "RxPtModel.l2wrap")

    @property
    def layers(self):
        """Block kinds in model order, 'R' (RWKV-7) or 'A' (attention): e.g. 'RRARRAR'."""
        return self._layers

    @property
    def param_names(self):
        """Parameter names in docs/layout.md §Parameters order."""
        return list(self._names)

    @property
    def params(self):
        """dict name -> writable float32 view into the parameter arena (docs/layout.md §Parameters shapes)."""
        return dict(self._params)

    @property
    def grads(self):
        """dict name -> writable float32 view into the grad arena, same keys and shapes."""
        return dict(self._grads)

    @property
    def param_buffer(self):
        """1-D float32 view of every parameter, in param_names order, no padding."""
        return self._pbuf

    @property
    def grad_buffer(self):
        """1-D float32 view of every grad, same layout as param_buffer."""
        return self._gbuf

    def enable_state(self):
        """Give every RWKV block a trainable initial WKV state, zero to
        start (docs/maths.md §Initial state); idempotent. The forward then
        starts each block's WKV7 from it (every sequence of a batch alike) and
        the backward also writes state_grad."""
        cdef int rc
        if self._sbuf is not None:
            return
        self._enter()
        try:
            rc = rx_ptmodel_enable_state(self._h.m)
            _check_rc(rc, "RxPtModel.enable_state")
            if self._acts != NULL:   # made without the state buffers
                rx_pt_acts_free(self._acts)
                self._acts = NULL
            self._fwd_shape = None
        finally:
            self._busy = False
        cdef int64_t n
        cdef float *p = rx_ptmodel_state_arena(self._h.m, &n)
        c = self._config
        shp = (c["n_rwkv_layer"], c["n_head"], c["head_size"], c["head_size"])
        self._sbuf = _arena_view(self._h, p, n).reshape(shp)
        self._sgbuf = _arena_view(self._h, rx_ptmodel_state_grad_arena(self._h.m, NULL),
                                  n).reshape(shp)

    @property
    def frozen(self):
        """True: backward computes no weight grads (no weight-gradient GEMM,
        grads / grad_buffer unspecified) but the same grads on activations and
        state_grad; a state tune's setting (settable)."""
        return rx_ptmodel_frozen(self._h.m) == 1

    @frozen.setter
    def frozen(self, value):
        if self._busy:
            raise RuntimeError("RxPtModel: frozen changed while a forward or backward runs")
        rx_ptmodel_set_frozen(self._h.m, 1 if value else 0)

    def freeze_ranges(self, ranges):
        """Freeze part of the model: ranges, int64 (R, 2) [begin, end)
        element ranges of param_buffer whose weight grads backward skips
        (no weight-gradient GEMM, no embedding scatter; their grads are then
        unspecified; every other grad is the same bits). An empty array
        unfreezes everything; frozen is True only when all is frozen."""
        r = np.ascontiguousarray(ranges, dtype=np.int64).reshape(-1, 2)
        if self._busy:
            raise RuntimeError("RxPtModel: frozen changed while a forward or backward runs")
        cdef const int64_t[:, ::1] rv = r if r.shape[0] else np.zeros((1, 2), np.int64)
        cdef int rc = rx_ptmodel_set_frozen_ranges(self._h.m, &rv[0, 0], <int>r.shape[0])
        _check_rc(rc, "RxPtModel.freeze_ranges")

    def enable_lora(self, r, alpha, names, dora=False):
        """LoRA adapters (docs/maths.md §LoRA) on the block projections
        `names` (param names: a block's receptance_w, key_w, value_w,
        output_w, ffn_key_w or ffn_value_w), A [r, in] and B [out, r] zero
        to start: the forward and backward then use W + (alpha/r) A^T B^T
        in the arena's [in, out] orientation without forming it, and the
        backward writes lora_grads. Once per model, except that a model
        whose adapters were disabled takes the same r, alpha and names back
        (their arrays as disable_lora left them). dora: DoRA's adapters
        (docs/maths.md §DoRA), each with a magnitude '{param}.lora_magnitude'
        [out] after its B, zero until set (lora_norms gives W_eff's norms)."""
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not 1 <= r <= _INT_MAX:
            raise ValueError(f"r must be an int >= 1, got {r!r}")
        idx = []
        for n in names:
            if n not in self._params:
                raise ValueError(f"enable_lora: {n!r} is not a parameter")
            idx.append(self._names.index(n))
        cdef int[::1] iv = np.array(idx or [0], np.int32)
        cdef int rc
        if self._busy:
            raise RuntimeError("RxPtModel: enable_lora while a forward or backward runs")
        if dora:
            rc = rx_ptmodel_enable_dora(self._h.m, <int>r, <double>float(alpha), &iv[0], len(idx))
        else:
            rc = rx_ptmodel_enable_lora(self._h.m, <int>r, <double>float(alpha), &iv[0], len(idx))
        _check_rc(rc, "RxPtModel.enable_lora")
        cdef int64_t n_el, a_off, b_off, m_off
        cdef int param
        cdef float *p = rx_ptmodel_lora_arena(self._h.m, &n_el)
        self._lbuf = _arena_view(self._h, p, n_el)
        self._lgbuf = _arena_view(self._h, rx_ptmodel_lora_grad_arena(self._h.m, NULL), n_el)
        self._lora, self._lora_g = {}, {}
        self._lora_r, self._lora_alpha = int(r), float(alpha)
        for i in range(len(idx)):
            rx_ptmodel_lora_adapter(self._h.m, i, &param, &a_off, &b_off)
            rx_ptmodel_lora_magnitude(self._h.m, i, &m_off)
            w = self._params[self._names[param]]
            for key, off, shp in ((".lora_A", a_off, (r, w.shape[0])),
                                  (".lora_B", b_off, (w.shape[1], r)),
                                  (".lora_magnitude", m_off, (w.shape[1], 1))):
                if off < 0:
                    continue
                k = self._names[param] + key
                self._lora[k] = self._lbuf[off:off + shp[0] * shp[1]].reshape(shp)
                self._lora_g[k] = self._lgbuf[off:off + shp[0] * shp[1]].reshape(shp)
                if key == ".lora_magnitude":
                    self._lora[k], self._lora_g[k] = self._lora[k][:, 0], self._lora_g[k][:, 0]

    def lora_norms(self, name):
        """DoRA's column norms [out] of W + s A^T B^T over in for the adapter
        on parameter `name`, from the adapters and the base now."""
        keys = [k[:-len(".lora_A")] for k in (self._lora or {}) if k.endswith(".lora_A")]
        if name not in keys:
            raise ValueError(f"lora_norms: {name!r} has no adapter")
        out = np.empty(self._params[name].shape[1], np.float32)
        cdef float[::1] ov = out
        if self._busy:
            raise RuntimeError("RxPtModel: lora_norms while a forward or backward runs")
        _check_rc(rx_ptmodel_lora_norms(self._h.m, keys.index(name), &ov[0]), "RxPtModel.lora_norms")
        return out

    def set_base(self, dtype, names):
        """Hold the matrices `names` (2-D parameters) only in a frozen base
        of dtype "bf16", "q8_0", "q4_0", "nf4" or "q4_k" (docs/layout.md §Frozen base), read by
        the projection GEMMs (the embedding: its rows decoded as they are
        gathered): their params / grads views are
        then address space only (they read zero, take no memory and must
        not be written), nothing computes their weight grads, and dX flows
        through them. Fill each with base_fill before a forward. Once per
        model (release_base ends it)."""
        if dtype not in BASE_DTYPES:
            raise ValueError(f"base dtype must be one of {BASE_DTYPES}, got {dtype!r}")
        idx = []
        for n in names:
            if n not in self._params:
                raise ValueError(f"set_base: {n!r} is not a parameter")
            idx.append(self._names.index(n))
        cdef int[::1] iv = np.array(idx or [0], np.int32)
        if self._busy:
            raise RuntimeError("RxPtModel: set_base while a forward or backward runs")
        cdef int code = _BASE_DTYPE_IDS[dtype]
        _check_rc(rx_ptmodel_set_base(self._h.m, code, &iv[0], len(idx)), "RxPtModel.set_base")

    def base_fill(self, name, values, *, transposed=False):
        """Encode base tensor `name` from values: float32, or uint16 bf16
        bits, shaped as its param [in, out], or [out, in] with transposed
        (torch's orientation, an official .pth tensor as it is; the
        embedding is [vocab, C] in both orientations). bf16 is
        kept as it is or rounded to nearest even (torch's rounding); q8_0 / q4_0
        quantized as gguf.quants.quantize(W^T, Q8_0 / Q4_0) does, nf4 as
        bitsandbytes' quantize_4bit(W^T, blocksize=64, quant_type="nf4"), q4_k as
        llama.cpp's quantize_row_q4_K_ref (ggml's reference) of each row. A block
        base also takes its own stored rows, uint8 as base_data gives them
        (transposed: a GGUF file's blocks), copied as they are."""
        if name not in self._params or self._names.index(name) not in self._base_params():
            raise ValueError(f"base_fill: {name!r} is not in the model's base")
        rows = name == "emb"   # gathered, not multiplied: the same in both orientations
        want = self._params[name].shape[::-1] if transposed and not rows \
            else self._params[name].shape
        per, nbytes = base_dtype_block(self.base_dtype)
        own = isinstance(values, np.ndarray) and values.dtype == np.uint8 and per > 1
        if own:   # stored rows: [out, in / per * nbytes]
            if not transposed:
                raise ValueError("base_fill: stored rows are W^T's: pass transposed=True")
            want = (want[0], want[1] // per * nbytes)
        elif not isinstance(values, np.ndarray) or values.dtype not in (np.float32, np.uint16):
            raise TypeError("base_fill: values must be a float32 or uint16 (bf16 bits) array, "
                            "or uint8 stored rows of a block base")
        if values.shape != want:
            raise ValueError(f"base_fill: {name} takes shape {want}, got {values.shape}")
        v = np.ascontiguousarray(values)
        cdef int kind = _BASE_DTYPE_IDS[self.base_dtype] if own else \
            RX_BASE_BF16 if v.dtype == np.uint16 else 0
        cdef int p = self._names.index(name)
        cdef int tr = 1 if transposed else 0
        cdef const unsigned char[::1] raw = v.reshape(-1).view(np.uint8)
        cdef int rc
        self._enter()
        try:
            with nogil:
                rc = rx_ptmodel_base_fill(self._h.m, p, &raw[0], kind, tr)
        finally:
            self._busy = False
        _check_rc(rc, "RxPtModel.base_fill")

    cdef list _base_params(self):
        cdef int n
        rx_ptmodel_base_info(self._h.m, NULL, &n, NULL)
        return [rx_ptmodel_base_param(self._h.m, i) for i in range(n)]

    @property
    def base_dtype(self):
        """"bf16", "q8_0", "q4_0", "nf4" or "q4_k" when the model holds a frozen base, else None."""
        cdef int d
        rx_ptmodel_base_info(self._h.m, &d, NULL, NULL)
        return None if d == RX_BASE_NONE else _BASE_DTYPE_NAMES[d]

    @property
    def base_names(self):
        """The parameters held in the frozen base, in arena order ([] without)."""
        return [self._names[p] for p in self._base_params()]

    @property
    def base_bytes(self):
        """Bytes of the frozen base's store (0 without)."""
        cdef int64_t b
        rx_ptmodel_base_info(self._h.m, NULL, NULL, &b)
        return int(b)

    def base_tensor(self, name):
        """Base tensor `name` decoded (exactly) into a new float32 [in, out] array."""
        if name not in self._params or self._names.index(name) not in self._base_params():
            raise ValueError(f"base_tensor: {name!r} is not in the model's base")
        out = np.empty(self._params[name].shape, np.float32)
        _check_rc(rx_ptmodel_base_read(self._h.m, self._names.index(name), _wptr(out)),
                  "RxPtModel.base_tensor")
        return out

    def base_data(self, name):
        """The stored bytes of base tensor `name` (a copy): bf16 [out, in]
        as uint16, or a block dtype's rows of W^T as uint8 [out, in / 32 *
        34] (q8_0), [out, in / 32 * 18] (q4_0), the bytes of
        gguf.quants.quantize(W^T, Q8_0 / Q4_0), or [out, in / 64 * 36] (nf4:
        per block the float32 absmax, then bitsandbytes' packed codes), or
        [out, in / 256 * 144] (q4_k: ggml's block_q4_K); the
        embedding's rows as they
        are ([vocab, C], quantize(emb, ...))."""
        if name not in self._params or self._names.index(name) not in self._base_params():
            raise ValueError(f"base_data: {name!r} is not in the model's base")
        i, o = self._params[name].shape
        if name == "emb":
            i, o = o, i
        per, nbytes = base_dtype_block(self.base_dtype)
        out = np.empty((o, i // per * nbytes), np.uint8)
        cdef unsigned char[::1] raw = out.reshape(-1).view(np.uint8)
        _check_rc(rx_ptmodel_base_rows(self._h.m, self._names.index(name), &raw[0]),
                  "RxPtModel.base_data")
        return out.view(np.uint16) if (per, nbytes) == (1, 2) else out   # bf16 bits

    def release_base(self):
        """Decode every base tensor into its params view and drop the
        store: the model holds float32 weights again (a q8_0, q4_0, nf4
        or q4_k base's dequantised values), as a base-unfreeze needs."""
        if self._busy:
            raise RuntimeError("RxPtModel: release_base while a forward or backward runs")
        _check_rc(rx_ptmodel_base_release(self._h.m), "RxPtModel.release_base")

    def disable_lora(self):
        """Stop applying the adapters (their arrays stay valid, the model
        then has none; only the same adapters can be enabled again)."""
        if self._busy:
            raise RuntimeError("RxPtModel: disable_lora while a forward or backward runs")
        rx_ptmodel_disable_lora(self._h.m)
        self._lbuf = self._lgbuf = self._lora = self._lora_g = None

    @property
    def lora(self):
        """dict '{param}.lora_A' [r, in] / '{param}.lora_B' [out, r] (DoRA:
        and '{param}.lora_magnitude' [out]) -> writable float32 views of the
        adapters, in adapter order; None without adapters."""
        return None if self._lora is None else dict(self._lora)

    @property
    def lora_grads(self):
        """The adapters' grads, same keys and shapes as lora."""
        return None if self._lora_g is None else dict(self._lora_g)

    @property
    def lora_buffer(self):
        """1-D float32 view of every adapter (A, B, DoRA's magnitude each, in lora's
        order); None without."""
        return self._lbuf

    @property
    def lora_grad_buffer(self):
        """1-D float32 view of the adapters' grads, laid out as lora_buffer."""
        return self._lgbuf

    @property
    def lora_rank(self):
        """(r, alpha) of the adapters; None without."""
        return None if self._lbuf is None else (self._lora_r, self._lora_alpha)

    @property
    def state(self):
        """Writable float32 (n_rwkv_layer, H, N, N) view of the initial WKV
        states, [block][head][value i][key j]; None until enable_state()."""
        return self._sbuf

    @property
    def state_grad(self):
        """Writable float32 view of the initial states' grads, shaped as state."""
        return self._sgbuf

    @property
    def n_params(self):
        """Total number of parameter elements."""
        return int(self._pbuf.shape[0])

    cdef int _enter(self) except -1:
        if self._busy:
            raise RuntimeError("RxPtModel is already running forward/backward in another thread")
        self._busy = True
        return 0
