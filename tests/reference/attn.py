"""Reference MoBA-sparse attention block (docs/maths.md §Blocks), float64 autograd Vars.

Tensors are (B, T, C) with C = n_head * head_size, heads laid out as
(B, T, H, N). The chunk selection is hard (not differentiated): it is a
boolean mask computed from the float64 values of q and k, or passed in.
"""
import numpy as np

from reference.autograd import Var, _val
from reference.layers import channelmix, layernorm


def _np(x):
    return x.value if isinstance(x, Var) else np.asarray(x, dtype=np.float64)


def _heads(x, n_head, head_size):
    """(B, T, C) Var -> (B, H, T, N) Var."""
    B, T, _ = x.shape
    return _transpose(x.reshape(B, T, n_head, head_size), (0, 2, 1, 3))


def _transpose(x, axes):
    inv = np.argsort(axes)
    return x._make(np.transpose(x.value, axes), (x,), (lambda g: np.transpose(g, inv),))


def _bmm(a, b):
    """Batched a @ b over the last two axes (leading axes equal)."""
    b = _val(b)
    av, bv = a.value, b.value
    return a._make(av @ bv, (a, b), (lambda g: g @ np.swapaxes(bv, -1, -2),
                                     lambda g: np.swapaxes(av, -1, -2) @ g))


def moba_gates(q, k, chunk_size, n_head, head_size):
    """Gate rows from float64 values: list over t of (B, H, ct) arrays,
    gate_j = q_t . mean key of chunk j for the complete chunks j < t // chunk_size."""
    q, k = _np(q), _np(k)
    B, T, _ = q.shape
    qh = q.reshape(B, T, n_head, head_size).transpose(0, 2, 1, 3)
    kh = k.reshape(B, T, n_head, head_size).transpose(0, 2, 1, 3)
    nck = T // chunk_size
    kmean = kh[:, :, :nck * chunk_size].reshape(B, n_head, nck, chunk_size, head_size).mean(3)
    return [np.einsum("bhn,bhjn->bhj", qh[:, :, t], kmean[:, :, :t // chunk_size])
            for t in range(T)]


def moba_mask(q, k, chunk_size, moba_top_k, n_head, head_size):
    """Bool (B, H, T, T): True where query t attends key s (docs/maths.md §Blocks)."""
    q = _np(q)
    B, T, _ = q.shape
    mask = np.zeros((B, n_head, T, T), dtype=bool)
    for t, g in enumerate(moba_gates(q, k, chunk_size, n_head, head_size)):
        ct = t // chunk_size
        mask[:, :, t, ct * chunk_size:t + 1] = True
        if ct == 0:
            continue
        if moba_top_k <= 0 or moba_top_k >= ct:
            chosen = np.broadcast_to(np.arange(ct), (B, n_head, ct))
        else:
            # stable sort of -gate: equal gates keep index order, the smaller j wins
            chosen = np.argsort(-g, axis=-1, kind="stable")[..., :moba_top_k]
        for b in range(B):
            for h in range(n_head):
                for j in chosen[b, h]:
                    mask[b, h, t, j * chunk_size:(j + 1) * chunk_size] = True
    return mask


def moba_gate_margin(q, k, chunk_size, moba_top_k, n_head, head_size):
    """Smallest gap, relative to the row's largest |gate|, between the last
    kept and the first dropped gate over every query that chooses (inf when
    none does). A test whose margin is far above fp32 rounding cannot see the
    C and float64 selections differ."""
    margin = np.inf
    if moba_top_k <= 0:
        return margin
    for t, g in enumerate(moba_gates(q, k, chunk_size, n_head, head_size)):
        if moba_top_k >= t // chunk_size:
            continue
        s = -np.sort(-g, axis=-1)
        gap = (s[..., moba_top_k - 1] - s[..., moba_top_k]) / np.abs(g).max(-1)
        margin = min(margin, float(gap.min()))
    return margin


def attn_core(q, k, v, n_head, head_size, chunk_size, moba_top_k, mask=None):
    """q, k, v: (B, T, C) Vars -> (p (B, H, T, T), y (B, T, C)); mask: bool
    (B, H, T, T) or None for moba_mask of the float64 q, k."""
    B, T, C = q.shape
    if mask is None:
        mask = moba_mask(q, k, chunk_size, moba_top_k, n_head, head_size)
    qh, kh, vh = (_heads(x, n_head, head_size) for x in (q, k, v))
    s = _bmm(qh, _transpose(kh, (0, 1, 3, 2))) * (1.0 / np.sqrt(head_size))
    s = s.where(mask, -np.inf)
    e = (s - s.value.max(-1, keepdims=True)).exp()
    p = e / e.sum(-1, keepdims=True)
    y = _transpose(_bmm(p, vh), (0, 2, 1, 3)).reshape(B, T, C)
    return p, y


def attn_block(p, x, cm_xprev_init, n_head, head_size, chunk_size, moba_top_k, ln_eps,
               mask=None):
    """The whole attention block. p: dict of Vars with the docs/layout.md keys
    ('ln1_w', ..., 'cm.ffn_value_w'); x: (B, T, C); cm_xprev_init: (B, C) or
    None; ln_eps: the LayerNorms' eps (the config's). Returns out (B, T, C)."""
    h1 = layernorm(x, p["ln1_w"], p["ln1_b"], ln_eps)
    q, k, v = h1 @ p["receptance_w"], h1 @ p["key_w"], h1 @ p["value_w"]
    _, y = attn_core(q, k, v, n_head, head_size, chunk_size, moba_top_k, mask)
    x1 = x + y @ p["output_w"]
    h2 = layernorm(x1, p["ln2_w"], p["ln2_b"], ln_eps)
    cm = {name[3:]: p[name] for name in ("cm.ffn_x_k", "cm.ffn_key_w", "cm.ffn_value_w")}
    return x1 + channelmix(cm, h2, cm_xprev_init)


def attn_block_of(p, x, config):
    """attn_block of the model's config (a whole one: RxPtModel.config or
    checks.full_config), its sizes and every setting the block reads."""
    return attn_block(p, x, None, config["n_head"], config["head_size"], config["chunk_size"],
                      config["moba_top_k"], config["ln_eps"])


def attn_block_qk(p, x, n_head, head_size, ln_eps):
    """float64 q, k of the block (for moba_mask / moba_gate_margin)."""
    h1 = layernorm(_val(x), _val(p["ln1_w"]), _val(p["ln1_b"]), ln_eps)
    return (h1 @ _val(p["receptance_w"])).value, (h1 @ _val(p["key_w"])).value
