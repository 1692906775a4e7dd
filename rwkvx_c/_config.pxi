# The model's config (docs/maths.md §Whole model): the rx_pt_config fields and the
# model context's keys (rx_model_ctx), checked by name. Included by _core.pyx
# before _model.pxi.


CONFIG_FIELDS = ("n_embd", "n_head", "head_size", "n_rwkv_layer", "n_attn_layer", "vocab_size",
                 "Dw", "Da", "Dg", "Dv", "ffn_dim", "chunk_size", "moba_top_k")
# Config keys beyond the C struct: the model context's settings (rx_model_ctx),
# each with its default from csrc/rx_pretrain.h (RX_DEFAULT_*), which is also
# what its absence means: the model as before the key existed.
OPTION_FIELDS = {"ln0": RX_DEFAULT_LN0, "ln_eps": RX_DEFAULT_LN_EPS, "gn_eps": RX_DEFAULT_GN_EPS}


cdef rx_model_ctx _pt_ctx(dict config) except *:
    """The C model context of a config dict's optional keys (OPTION_FIELDS;
    an absent key takes its default), each checked by name."""
    cdef rx_model_ctx ctx
    rx_model_ctx_default(&ctx)
    v = config.get("ln0", RX_DEFAULT_LN0)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v not in (0, 1):
        raise ValueError(f"config['ln0'] must be 0 or 1, got {v!r}")
    ctx.ln0 = v
    for k in ("ln_eps", "gn_eps"):
        v = config.get(k, OPTION_FIELDS[k])
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise ValueError(f"config['{k}'] must be a number, got {type(v).__name__}")
    ctx.ln_eps = config.get("ln_eps", ctx.ln_eps)
    ctx.gn_eps = config.get("gn_eps", ctx.gn_eps)
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
