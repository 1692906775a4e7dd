# The model's config (docs/maths.md §Whole model): the rx_pt_config fields and the
# model context's keys (rx_model_ctx), checked by name. Included by _core.pyx
# before _model.pxi.


CONFIG_FIELDS = ("n_embd", "n_head", "head_size", "n_rwkv_layer", "n_attn_layer", "vocab_size",
                 "Dw", "Da", "Dg", "Dv", "ffn_dim", "chunk_size", "moba_top_k")
# The model context (rx_model_ctx) by key, in a config's order: the keys a
# config may hold beyond the C struct (rwkvx_c.model.config declares each,
# c_route "ctx"), then the ones that are settings of the model object rather
# than of its config (RxPtModel.l2wrap, a training option). Together they are
# the C struct's fields, checked at import and by tests/test_registry.py.
_CTX_KEYS = ("ln0", "ln_eps", "gn_eps")
_CTX_SETTINGS = ("l2wrap",)


cdef dict _ctx_dict(const rx_model_ctx *ctx):
    """The context as {field: value} (Cython converts a struct to a dict of its fields)."""
    return ctx[0]


cdef dict _default_ctx():
    cdef rx_model_ctx ctx
    rx_model_ctx_default(&ctx)
    got = _ctx_dict(&ctx)
    if set(got) != set(_CTX_KEYS + _CTX_SETTINGS):   # the C struct gained or lost a field
        raise ImportError(f"rx_model_ctx has the fields {sorted(got)}; the binding knows "
                          f"{sorted(_CTX_KEYS + _CTX_SETTINGS)}")
    return got


# Config keys beyond the C struct, each with its default from csrc/rx_pretrain.h
# (RX_DEFAULT_*, through rx_model_ctx_default), which is also what its absence
# means: the model as before the key existed.
OPTION_FIELDS = {k: _default_ctx()[k] for k in _CTX_KEYS}
# the floor of the time-mix key normalisation (RX_KK_FLOOR, a float32): a
# constant of the maths that the kernels, not a config, hold
KK_FLOOR = RX_KK_FLOOR


cdef rx_model_ctx _pt_ctx(dict config) except *:
    """The C model context of a config dict's optional keys (OPTION_FIELDS;
    an absent key takes its default), each checked by name: of the C
    field's type here, in its range by rx_model_ctx_validate."""
    fields = _default_ctx()
    for k in _CTX_KEYS:
        v = config.get(k, fields[k])
        if isinstance(fields[k], int):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"config['{k}'] must be an int, got {type(v).__name__}")
            if not _INT_MIN <= v <= _INT_MAX:
                raise ValueError(f"config['{k}'] = {v} exceeds the C API's int range")
        elif isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise ValueError(f"config['{k}'] must be a number, got {type(v).__name__}")
        fields[k] = v
    cdef rx_model_ctx ctx = fields
    _check_rc(rx_model_ctx_validate(&ctx), "config")   # the ranges, named
    return ctx


cdef rx_pt_config _pt_config(object config) except *:
    """The C config of a config dict, every docs/maths.md §Whole model rule checked by name."""
    cdef rx_pt_config c
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    missing = [k for k in CONFIG_FIELDS if k not in config]
    unknown = [k for k in config if k not in CONFIG_FIELDS and k not in OPTION_FIELDS]
    if missing:
        raise ValueError(f"config is missing {missing}")
    if unknown:
        raise ValueError(f"config has unknown keys {unknown}; expected {list(CONFIG_FIELDS)} "
                         f"and optionally {list(OPTION_FIELDS)}")
    for k in CONFIG_FIELDS:
        v = config[k]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"config['{k}'] must be an int, got {type(v).__name__}")
        if not _INT_MIN <= v <= _INT_MAX:
            raise ValueError(f"config['{k}'] = {v} exceeds the C API's int range")
        if k == "n_attn_layer":
            if v < 0:
                raise ValueError(f"config['n_attn_layer'] must be >= 0, got {v}")
        elif k != "moba_top_k" and v < 1:
            raise ValueError(f"config['{k}'] must be >= 1, got {v}")
    if config["n_attn_layer"] > config["n_rwkv_layer"]:
        raise ValueError(f"config['n_attn_layer'] ({config['n_attn_layer']}) must not exceed "
                         f"config['n_rwkv_layer'] ({config['n_rwkv_layer']})")
    if config["n_head"] * config["head_size"] != config["n_embd"]:
        raise ValueError(f"config['n_head'] * config['head_size'] ({config['n_head']} * "
                         f"{config['head_size']}) must equal config['n_embd'] ({config['n_embd']})")
    c.n_embd, c.n_head, c.head_size = config["n_embd"], config["n_head"], config["head_size"]
    c.n_rwkv_layer, c.n_attn_layer = config["n_rwkv_layer"], config["n_attn_layer"]
    c.vocab_size, c.ffn_dim = config["vocab_size"], config["ffn_dim"]
    c.Dw, c.Da, c.Dg, c.Dv = config["Dw"], config["Da"], config["Dg"], config["Dv"]
    c.chunk_size, c.moba_top_k = config["chunk_size"], config["moba_top_k"]
    _check_rc(rx_pt_config_validate(&c), "config")
    return c


def check_config(config):
    """Raises TypeError / ValueError naming the first bad field of a model
    config (the checks RxPtModel makes), allocating nothing."""
    _pt_config(config)
    _pt_ctx(config)
