"""Reference RWKV-7 time-mix (docs/maths.md §Time-mix) and residual block
(docs/maths.md §Blocks) over autograd Vars, float64. Params dicts use the keys of the
Python API: the bare rx_tm_params field names for the time-mix ('x_r' .. 'ln_x_b', 'v0'/'v1'/'v2'
only when layer_id > 0); for the block 'ln1_w', 'ln1_b', 'tm.<field>',
'ln2_w', 'ln2_b', 'cm.ffn_x_k', 'cm.ffn_key_w', 'cm.ffn_value_w'."""

from reference.layers import channelmix, layernorm, token_shift
from reference.wkv7 import wkv7

DECAY_SCALE = 0.6065306597126334   # e^{-1/2}
GROUP_NORM_EPS = 64e-5
KK_FLOOR = 1e-12

TM_FIELDS = ("x_r", "x_k", "x_v", "x_w", "x_a", "x_g", "receptance_w", "key_w", "value_w",
             "output_w", "w0", "w1", "w2", "a0", "a1", "a2", "g1", "g2", "v0", "v1", "v2",
             "k_k", "k_a", "r_k", "ln_x_w", "ln_x_b")
CM_FIELDS = ("ffn_x_k", "ffn_key_w", "ffn_value_w")


def tm_param_shapes(C, Dw, Da, Dg, Dv, layer_id):
    """{name: shape} of a time-mix params dict, in rx_tm_params order."""
    shapes = {}
    for f in TM_FIELDS:
        if f in ("v0", "v1", "v2") and layer_id == 0:
            continue
        shapes[f] = {"receptance_w": (C, C), "key_w": (C, C), "value_w": (C, C),
                     "output_w": (C, C), "w1": (C, Dw), "w2": (Dw, C), "a1": (C, Da),
                     "a2": (Da, C), "g1": (C, Dg), "g2": (Dg, C), "v1": (C, Dv),
                     "v2": (Dv, C)}.get(f, (C,))
    return shapes


def block_param_shapes(C, Dw, Da, Dg, Dv, F, layer_id):
    """{name: shape} of a block params dict, in docs/layout.md §Parameters order."""
    shapes = {"ln1_w": (C,), "ln1_b": (C,)}
    shapes.update({"tm." + k: s for k, s in tm_param_shapes(C, Dw, Da, Dg, Dv, layer_id).items()})
    shapes.update({"ln2_w": (C,), "ln2_b": (C,), "cm.ffn_x_k": (C,), "cm.ffn_key_w": (C, F),
                   "cm.ffn_value_w": (F, C)})
    return shapes


def timemix(p, x, x_prev_init, v_first, n_head, head_size, layer_id):
    """docs/maths.md §Time-mix. x: (B, T, C) Var (the ln1 output); x_prev_init (B, C) Var or
    None; v_first (B, T, C) Var, read when layer_id > 0 (ignored at 0).
    Returns (out, v_first_out): layer 0 returns its own v, later layers
    return the v_first they were given."""
    B, T, C = x.shape
    H, N = n_head, head_size
    xx = token_shift(x, x_prev_init) - x
    xr, xw, xk, xv, xa, xg = (x + xx * p["x_" + s] for s in "rwkvag")
    r = xr @ p["receptance_w"]
    k = xk @ p["key_w"]
    v = xv @ p["value_w"]
    w = (((xw @ p["w1"]).tanh() @ p["w2"] + p["w0"]).sigmoid() * -DECAY_SCALE).exp()
    a = ((xa @ p["a1"]) @ p["a2"] + p["a0"]).sigmoid()
    g = (xg @ p["g1"]).sigmoid() @ p["g2"]
    if layer_id == 0:
        v_first = v
    else:
        v = v + (v_first - v) * ((xv @ p["v1"]) @ p["v2"] + p["v0"]).sigmoid()
    kk = (k * p["k_k"]).reshape(B, T, H, N)
    kk = kk / kk.square().sum(-1, keepdims=True).sqrt().maximum(KK_FLOOR)
    k = k * ((a - 1.0) * p["k_a"] + 1.0)

    def heads(z):
        return z.reshape(B, T, H, N)

    y, _ = wkv7(heads(r), heads(w), heads(k), heads(v), kk * -1.0, kk * heads(a))
    z = layernorm(y, p["ln_x_w"].reshape(H, N), p["ln_x_b"].reshape(H, N), eps=GROUP_NORM_EPS)
    bonus = (heads(r) * heads(k) * p["r_k"].reshape(H, N)).sum(-1, keepdims=True)
    z = (z + bonus * heads(v)).reshape(B, T, C)
    return (z * g) @ p["output_w"], v_first


def rwkv_block(p, x, tm_xprev_init, cm_xprev_init, v_first, n_head, head_size, layer_id):
    """docs/maths.md §Blocks: h1 = ln1(x); x1 = x + TM(h1); h2 = ln2(x1); out = x1 + CM(h2).
    Carries are over h1 and h2. Returns (out, v_first_out) as timemix."""
    tm = {k[3:]: v for k, v in p.items() if k.startswith("tm.")}
    cm = {k[3:]: v for k, v in p.items() if k.startswith("cm.")}
    h1 = layernorm(x, p["ln1_w"], p["ln1_b"])
    att, v_first = timemix(tm, h1, tm_xprev_init, v_first, n_head, head_size, layer_id)
    x1 = x + att
    return x1 + channelmix(cm, layernorm(x1, p["ln2_w"], p["ln2_b"]), cm_xprev_init), v_first
