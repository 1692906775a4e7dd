"""Reference RWKV-7 time-mix (docs/maths.md §Time-mix) and residual block
(docs/maths.md §Blocks) over autograd Vars, float64. Params dicts use the keys of the
Python API: the bare rx_tm_params field names for the time-mix ('x_r' .. 'ln_x_b', 'v0'/'v1'/'v2'
only when layer_id > 0); for the block 'ln1_w', 'ln1_b', 'tm.<field>',
'ln2_w', 'ln2_b', 'cm.ffn_x_k', 'cm.ffn_key_w', 'cm.ffn_value_w'."""

import functools
import os
import re

from reference.layers import channelmix, layernorm, token_shift
from reference.wkv7 import wkv7

DECAY_SCALE = 0.6065306597126334   # e^{-1/2}
KK_FLOOR = 1e-12

_LAYOUT_MD = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                          "docs", "layout.md")


@functools.cache
def tm_schema():
    """((name, dims, at_layer0), ...) of the time-mix fields in rx_tm_params
    order, read from the table of docs/layout.md §Parameters (the contract),
    so the tests hold the library's one schema (rwkvx_c.tm_fields) against
    the docs rather than against a copy. dims names the shape's dimensions,
    ('C',) or ('C', 'Dw'); at_layer0 is False where the role says the field
    is absent in RWKV block 0."""
    with open(_LAYOUT_MD, encoding="utf-8") as f:
        text = f.read()
    table = text.split("Time-mix fields", 1)[1].split("\n\n")[1]
    out = []
    for row in table.splitlines()[2:]:
        names, shapes, role = (c.strip().strip("`") for c in row.strip("|").split("|"))
        names = names.split()
        dims = [tuple(d.strip() for d in s.split(",")) for s in re.findall(r"\[([^]]+)\]", shapes)]
        dims = dims * len(names) if len(dims) == 1 else dims
        assert len(dims) == len(names), row
        out += [(n, d, "absent in RWKV block 0" not in role) for n, d in zip(names, dims)]
    return tuple(out)


def tm_param_shapes(C, Dw, Da, Dg, Dv, layer_id):
    """{name: shape} of a time-mix params dict, in rx_tm_params order."""
    sizes = dict(C=C, Dw=Dw, Da=Da, Dg=Dg, Dv=Dv)
    return {n: tuple(sizes[d] for d in dims) for n, dims, at0 in tm_schema()
            if at0 or layer_id > 0}


def block_param_shapes(C, Dw, Da, Dg, Dv, F, layer_id):
    """{name: shape} of a block params dict, in docs/layout.md §Parameters order."""
    shapes = {"ln1_w": (C,), "ln1_b": (C,)}
    shapes.update({"tm." + k: s for k, s in tm_param_shapes(C, Dw, Da, Dg, Dv, layer_id).items()})
    shapes.update({"ln2_w": (C,), "ln2_b": (C,), "cm.ffn_x_k": (C,), "cm.ffn_key_w": (C, F),
                   "cm.ffn_value_w": (F, C)})
    return shapes


def timemix(p, x, x_prev_init, v_first, n_head, head_size, layer_id, gn_eps, s_init=None):
    """docs/maths.md §Time-mix. gn_eps: the group norm's eps (the config's).
    x: (B, T, C) Var (the ln1 output); x_prev_init (B, C) Var or
    None; v_first (B, T, C) Var, read when layer_id > 0 (ignored at 0).
    Returns (out, v_first_out): layer 0 returns its own v, later layers
    return the v_first they were given. s_init: the WKV7 initial state
    (docs/maths.md §Initial state), a Var broadcasting to (B, H, N, N), or
    None (zero)."""
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

    y, _ = wkv7(heads(r), heads(w), heads(k), heads(v), kk * -1.0, kk * heads(a), s_init)
    z = layernorm(y, p["ln_x_w"].reshape(H, N), p["ln_x_b"].reshape(H, N), eps=gn_eps)
    bonus = (heads(r) * heads(k) * p["r_k"].reshape(H, N)).sum(-1, keepdims=True)
    z = (z + bonus * heads(v)).reshape(B, T, C)
    return (z * g) @ p["output_w"], v_first


def rwkv_block(p, x, tm_xprev_init, cm_xprev_init, v_first, n_head, head_size, layer_id,
               ln_eps, gn_eps, s_init=None):
    """docs/maths.md §Blocks: h1 = ln1(x); x1 = x + TM(h1); h2 = ln2(x1); out = x1 + CM(h2).
    Carries are over h1 and h2; ln_eps, gn_eps: the config's. Returns
    (out, v_first_out) as timemix."""
    tm = {k[3:]: v for k, v in p.items() if k.startswith("tm.")}
    cm = {k[3:]: v for k, v in p.items() if k.startswith("cm.")}
    h1 = layernorm(x, p["ln1_w"], p["ln1_b"], ln_eps)
    att, v_first = timemix(tm, h1, tm_xprev_init, v_first, n_head, head_size, layer_id, gn_eps,
                           s_init)
    x1 = x + att
    return x1 + channelmix(cm, layernorm(x1, p["ln2_w"], p["ln2_b"], ln_eps), cm_xprev_init), \
        v_first
