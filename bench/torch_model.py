"""The RWKV-X model of docs/maths.md written in plain PyTorch, for the side-by-side
benchmark (bench/bench.py). PyTorch is optional: nothing in rwkvx_c or its
tests needs it.

It is meant as the strongest straightforward PyTorch CPU implementation:
every projection is one batched matmul (oneDNN/MKL), the WKV7 recurrence is
solved in 16-step chunks with dense products (below), attention is one masked
dense softmax per head, and autograd does the backward.

Parameter names and shapes are docs/layout.md §Parameters (`model.params` maps name -> tensor;
the time-mix's come from rwkvx_c.tm_shapes, the library's one schema),
so weights can be copied in from an rwkvx_c.RxPtModel; `init_params` draws the
docs/layout.md §Init splitmix64 init, so the same seed gives the same weights as rwkvx_c.

Chunked WKV7 (per batch row and head; S is [value i][key j], docs/maths.md §WKV7). Within
a chunk of L steps entering with state S0, with W_t = prod_{q<=t} w_q and
u_t = S_{t-1} a_t (the sa of step t):
    S_t = S0 diag(W_t) + sum_{s<=t} (u_s b_s^T + v_s k_s^T) diag(W_t / W_s)
so, with  a~_t = a_t W_{t-1},  r~_t = r_t W_t,  b^_s = b_s / W_s,  k^_s = k_s / W_s,
    U = A~ S0^T + tril_{-1}(A~ B^^T) U + tril_{-1}(A~ K^^T) V
      => U = A1 S0^T + U0,  A1 = (I - tril_{-1}(A~ B^^T))^-1 A~,
                            U0 = (I - tril_{-1}(A~ B^^T))^-1 tril_{-1}(A~ K^^T) V
    Y = (R~ + tril(R~ B^^T) A1) S0^T + tril(R~ B^^T) U0 + tril(R~ K^^T) V
    S_L = S0 (diag(W_L) + A1^T B-) + U0^T B- + V^T K-,  B-_s = b_s W_L/W_s, K-_s = k_s W_L/W_s
Everything but the chunk-to-chunk state update S_L = S0 Tm + Ofs is computed
for all chunks at once; with w in (e^-0.6065, 1) and L = 16 the inverse decays
stay below 1.7e4, well inside float32.

    python bench/torch_model.py --selfcheck     # float64 check on a tiny config
"""
import math

import common  # noqa: F401  (puts an in-place build of rwkvx_c first)
import numpy as np
import torch
import torch.nn.functional as F

import rwkvx_c as rx

WKV_CHUNK = 16
E_HALF = 0.6065306597126334  # e^{-1/2}


def layer_order(n_rwkv, n_attn):
    """docs/maths.md §Whole model: 'R' / 'A' per block in model order."""
    if n_attn == 0:
        return ["R"] * n_rwkv
    interval, out, placed = n_rwkv // n_attn, [], 0
    for i in range(n_rwkv):
        out.append("R")
        if placed < n_attn and (i + 1) % interval == 0:
            out.append("A")
            placed += 1
    return out


def param_shapes(cfg):
    """[(name, shape)] in docs/layout.md §Parameters order."""
    C, V, F_ = cfg["n_embd"], cfg["vocab_size"], cfg["ffn_dim"]
    sizes = dict(C=C, Dw=cfg["Dw"], Da=cfg["Da"], Dg=cfg["Dg"], Dv=cfg["Dv"])
    out = [("emb", (V, C))]
    rwkv_id = 0
    for L, kind in enumerate(layer_order(cfg["n_rwkv_layer"], cfg["n_attn_layer"])):
        p = "blocks.%d." % L
        out += [(p + "ln1_w", (C,)), (p + "ln1_b", (C,))]
        if kind == "R":
            out += [(p + "tm." + f, s) for f, s in rx.tm_shapes(sizes, rwkv_id).items()]
            rwkv_id += 1
        else:
            out += [(p + n, (C, C)) for n in ("receptance_w", "key_w", "value_w", "output_w")]
        out += [(p + "ln2_w", (C,)), (p + "ln2_b", (C,)), (p + "cm.ffn_x_k", (C,)),
                (p + "cm.ffn_key_w", (C, F_)), (p + "cm.ffn_value_w", (F_, C))]
    out += [("ln_out_w", (C,)), ("ln_out_b", (C,)), ("head", (C, V))]
    return out


def _splitmix64_uniform(seed, n):
    """n draws u in [0,1) of docs/layout.md §Init splitmix64 stream, continuing nothing."""
    with np.errstate(over="ignore"):
        z = (np.uint64(seed) + np.arange(1, n + 1, dtype=np.uint64)
             * np.uint64(0x9E3779B97F4A7C15))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)).astype(np.float64) * 2.0 ** -24


def init_params(cfg, seed=0):
    """{name: float32 ndarray} drawn by the docs/layout.md §Init scheme."""
    shapes = param_shapes(cfg)
    total = sum(int(np.prod(s)) for _, s in shapes)
    u = _splitmix64_uniform(seed, total)
    out, pos = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        x = u[pos:pos + n]
        pos += n
        base = name.rsplit(".", 1)[-1]
        if name == "emb":
            val = (x - 0.5) * 0.5
        elif len(shape) == 2:
            val = (x - 0.5) * 0.3
        elif base in ("ln1_w", "ln2_w", "ln_x_w", "ln_out_w"):
            val = 1.0 + 0.2 * (x - 0.5)
        elif base in ("ln1_b", "ln2_b", "ln_x_b", "ln_out_b"):
            val = 0.2 * (x - 0.5)
        else:
            val = (x - 0.5) * 0.5
        out[name] = val.astype(np.float32).reshape(shape)
    return out


# ---------------------------------------------------------------------------
# WKV7


def wkv7_loop(r, w, k, v, a, b, s0=None):
    """The plain recurrence of docs/maths.md §WKV7 (reference). Inputs (B,T,H,N)."""
    B, T, H, N = r.shape
    S = torch.zeros(B, H, N, N, dtype=r.dtype) if s0 is None else s0
    ys = []
    for t in range(T):
        sa = torch.einsum("bhij,bhj->bhi", S, a[:, t])
        S = (S * w[:, t, :, None, :] + v[:, t, :, :, None] * k[:, t, :, None, :]
             + sa[..., None] * b[:, t, :, None, :])
        ys.append(torch.einsum("bhij,bhj->bhi", S, r[:, t]))
    return torch.stack(ys, 1), S


def wkv7_chunked(r, w, k, v, a, b, s0=None, L=WKV_CHUNK):
    """WKV7 in chunks of L steps with dense products (module docstring).
    Inputs (B,T,H,N); returns y (B,T,H,N) and the final state (B,H,N,N)."""
    B, T, H, N = r.shape
    pad = (-T) % L
    if pad:  # identity steps: w = 1, everything else 0
        z = lambda x, fill=0.0: F.pad(x, (0, 0, 0, 0, 0, pad), value=fill)  # noqa: E731
        r, k, v, a, b = z(r), z(k), z(v), z(a), z(b)
        w = z(w, 1.0)
    nc = (T + pad) // L
    # (B,H,nc,L,N)
    shp = lambda x: x.view(B, nc, L, H, N).permute(0, 3, 1, 2, 4)  # noqa: E731
    r, w, k, v, a, b = map(shp, (r, w, k, v, a, b))
    lw = torch.cumsum(torch.log(w), dim=3)             # log W_t
    lw_prev = lw - torch.log(w)                        # log W_{t-1}
    a_t = a * torch.exp(lw_prev)
    r_t = r * torch.exp(lw)
    inv = torch.exp(-lw)
    b_h, k_h = b * inv, k * inv
    lw_end = lw[:, :, :, -1:, :]
    dec_end = torch.exp(lw_end - lw)
    b_e, k_e = b * dec_end, k * dec_end
    strict = torch.ones(L, L, dtype=torch.bool).tril(-1)
    incl = torch.ones(L, L, dtype=torch.bool).tril()
    m_ab = (a_t @ b_h.transpose(-1, -2)).masked_fill(~strict, 0.0)
    m_ak = (a_t @ k_h.transpose(-1, -2)).masked_fill(~strict, 0.0)
    m_rb = (r_t @ b_h.transpose(-1, -2)).masked_fill(~incl, 0.0)
    m_rk = (r_t @ k_h.transpose(-1, -2)).masked_fill(~incl, 0.0)
    eye = torch.eye(L, dtype=r.dtype)
    lhs = eye - m_ab
    a1 = torch.linalg.solve_triangular(lhs, a_t, upper=False, unitriangular=True)
    u0 = torch.linalg.solve_triangular(lhs, m_ak @ v, upper=False, unitriangular=True)
    q = r_t + m_rb @ a1                                 # (..,L,Nj)
    y0 = m_rb @ u0 + m_rk @ v                           # (..,L,Ni)
    tm = torch.diag_embed(torch.exp(lw_end[:, :, :, 0, :])) + a1.transpose(-1, -2) @ b_e
    ofs = u0.transpose(-1, -2) @ b_e + v.transpose(-1, -2) @ k_e
    S = torch.zeros(B, H, N, N, dtype=r.dtype) if s0 is None else s0
    states = []
    for c in range(nc):
        states.append(S)
        S = S @ tm[:, :, c] + ofs[:, :, c]
    Sc = torch.stack(states, 2)                         # (B,H,nc,Ni,Nj)
    y = q @ Sc.transpose(-1, -2) + y0                   # (B,H,nc,L,Ni)
    y = y.permute(0, 2, 3, 1, 4).reshape(B, nc * L, H, N)[:, :T]
    return y, S


# ---------------------------------------------------------------------------
# layers (docs/maths.md); x is (B,T,C)


def proj(x, p, name):
    """x @ p[name], plus the LoRA update s * (x A^T) B^T when p holds name's
    adapters (name.lora_A [r, in], name.lora_B [out, r], name.lora_s a 0-d
    scale: RwkvXTorch.add_lora), in the factored form PEFT uses."""
    y = x @ p[name]
    A = p.get(name + ".lora_A")
    if A is None:
        return y
    return y + ((x @ A.t()) @ p[name + ".lora_B"].t()) * p[name + ".lora_s"]


def _shift(x):
    return F.pad(x, (0, 0, 1, -1))


def time_mix(p, x, v_first, layer_id, H, N, gn_eps, wkv=wkv7_chunked):
    B, T, C = x.shape
    xx = _shift(x) - x
    xr, xw, xk, xv, xa, xg = (x + xx * p[f] for f in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"))
    r = proj(xr, p, "receptance_w")
    k = proj(xk, p, "key_w")
    v = proj(xv, p, "value_w")
    w = torch.exp(-E_HALF * torch.sigmoid(p["w0"] + torch.tanh(xw @ p["w1"]) @ p["w2"]))
    a = torch.sigmoid(p["a0"] + (xa @ p["a1"]) @ p["a2"])
    g = torch.sigmoid(xg @ p["g1"]) @ p["g2"]
    if layer_id == 0:
        v_first = v
    else:
        v = v + (v_first - v) * torch.sigmoid(p["v0"] + (xv @ p["v1"]) @ p["v2"])
    kk = (k * p["k_k"]).view(B, T, H, N)
    kk = kk / torch.clamp(kk.norm(dim=-1, keepdim=True), min=rx._core.KK_FLOOR)
    kk = kk.view(B, T, C)
    k = k * (1 + (a - 1) * p["k_a"])
    h4 = lambda t: t.view(B, T, H, N)  # noqa: E731
    # WKV7 stays in the model's dtype under torch.autocast (bench.py --precision
    # bf16), as in rwkvx_c
    with torch.autocast("cpu", enabled=False):
        y, _ = wkv(*(h4(t).to(x.dtype) for t in (r, w, k, v, -kk, kk * a)))
    z = F.group_norm(y.reshape(B * T, C), H, p["ln_x_w"], p["ln_x_b"], eps=gn_eps).view(B, T, C)
    bonus = (h4(r) * h4(k) * p["r_k"].view(H, N)).sum(-1, keepdim=True) * h4(v)
    z = z + bonus.reshape(B, T, C)
    return proj(z * g, p, "output_w"), v_first


def channel_mix(p, x):
    xk = x + (_shift(x) - x) * p["ffn_x_k"]
    return proj(torch.relu(proj(xk, p, "ffn_key_w")).square(), p, "ffn_value_w")


def moba_attention(q, k, v, chunk, top_k):
    """docs/maths.md §Blocks MoBA sparse attention as one masked dense softmax per head.
    q, k, v (B,H,T,N); the chunk selection is hard (no grad through gates)."""
    B, H, T, N = q.shape
    cid = torch.arange(T) // chunk
    nch = int(cid[-1]) + 1
    with torch.no_grad():
        kpad = F.pad(k, (0, 0, 0, nch * chunk - T)).view(B, H, nch, chunk, N)
        kmean = kpad.sum(3) / chunk                     # only complete chunks are read
        gates = q @ kmean.transpose(-1, -2)             # (B,H,T,nch)
        valid = torch.arange(nch)[None, :] < cid[:, None]   # (T,nch): j < ct
        ct = cid[:, None]
        if top_k <= 0:
            sel = valid.expand(B, H, T, nch)
        else:
            g = gates.masked_fill(~valid, float("-inf"))
            order = torch.sort(g, dim=-1, descending=True, stable=True).indices
            rank = torch.argsort(order, dim=-1)
            sel = valid & ((rank < top_k) | (ct <= top_k))
        pos = torch.arange(T)
        own = (cid[None, :] == cid[:, None]) & (pos[None, :] <= pos[:, None])
        mask = sel[..., cid] | own                      # (B,H,T,T)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(N))
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


class RwkvXTorch(torch.nn.Module):
    """Whole model of docs/maths.md §Whole model.
    params: {docs/layout.md §Parameters name: tensor}."""

    def __init__(self, cfg, seed=0, dtype=torch.float32, wkv=wkv7_chunked):
        super().__init__()
        self.cfg = {**rx.OPTION_FIELDS, **cfg}   # the model's eps (ln_eps, gn_eps) with it
        self.wkv = wkv
        init = init_params(cfg, seed)
        self.names = list(init)
        self.plist = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.from_numpy(init[n]).to(dtype)) for n in self.names])
        self.params = dict(zip(self.names, self.plist))
        self.order = layer_order(cfg["n_rwkv_layer"], cfg["n_attn_layer"])

    def add_lora(self, r, alpha, targets, seed=0):
        """LoRA adapters on every RWKV block's projections named in targets
        (e.g. "tm.receptance_w", "cm.ffn_key_w"): A [r, in] kaiming-uniform,
        B [out, r] zero, scale alpha / r, as PEFT; they alone train."""
        g = torch.Generator().manual_seed(seed)
        for t in self.plist:
            t.requires_grad_(False)
        self.adapters = torch.nn.ParameterList()
        for L, kind in enumerate(self.order):
            for tgt in targets if kind == "R" else ():
                name = "blocks.%d.%s" % (L, tgt)
                W = self.params[name]
                n_in, n_out = W.shape                       # x @ W: W is [in, out]
                bound = 1.0 / math.sqrt(n_in)
                A = torch.nn.Parameter(((torch.rand(r, n_in, generator=g) * 2 - 1) * bound)
                                       .to(W.dtype))
                B = torch.nn.Parameter(torch.zeros(n_out, r, dtype=W.dtype))
                self.adapters.extend([A, B])
                self.params[name + ".lora_A"], self.params[name + ".lora_B"] = A, B
                self.params[name + ".lora_s"] = torch.tensor(alpha / r, dtype=W.dtype)
        return list(self.adapters)

    def load(self, arrays):
        """Copy in {name: array} (e.g. RxPtModel.params)."""
        with torch.no_grad():
            for n in self.names:
                self.params[n].copy_(torch.as_tensor(np.asarray(arrays[n])))

    def _block(self, L):
        pre = "blocks.%d." % L
        return {n[len(pre):]: t for n, t in self.params.items() if n.startswith(pre)}

    def forward(self, tokens):
        """tokens (B,T) int -> logits (B,T,vocab)."""
        cfg = self.cfg
        H, N, eps = cfg["n_head"], cfg["head_size"], cfg["ln_eps"]
        x = self.params["emb"][tokens]
        v_first, rwkv_id = None, 0
        for L, kind in enumerate(self.order):
            p = self._block(L)
            h1 = F.layer_norm(x, (x.shape[-1],), p["ln1_w"], p["ln1_b"], eps)
            if kind == "R":
                tm = {f[3:]: t for f, t in p.items() if f.startswith("tm.")}
                dx, v_first = time_mix(tm, h1, v_first, rwkv_id, H, N, cfg["gn_eps"], self.wkv)
                rwkv_id += 1
            else:
                B, T, C = h1.shape
                heads = lambda t: t.view(B, T, H, N).transpose(1, 2)  # noqa: E731, B023
                y = moba_attention(heads(h1 @ p["receptance_w"]), heads(h1 @ p["key_w"]),
                                   heads(h1 @ p["value_w"]), cfg["chunk_size"],
                                   cfg["moba_top_k"])
                dx = y.transpose(1, 2).reshape(B, T, C) @ p["output_w"]
            x = x + dx
            h2 = F.layer_norm(x, (x.shape[-1],), p["ln2_w"], p["ln2_b"], eps)
            cm = {f[3:]: t for f, t in p.items() if f.startswith("cm.")}
            x = x + channel_mix(cm, h2)
        x = F.layer_norm(x, (x.shape[-1],), self.params["ln_out_w"], self.params["ln_out_b"], eps)
        return x @ self.params["head"]

    def loss(self, tokens, targets, ignore_index=-1):
        """docs/maths.md §Loss: mean cross-entropy over valid targets (0 when none is valid)."""
        logits = self.forward(tokens)
        t = targets.reshape(-1).long()
        valid = t != ignore_index if ignore_index >= 0 else torch.ones_like(t, dtype=torch.bool)
        if not bool(valid.any()):
            return logits.sum() * 0.0
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1])[valid], t[valid])


# ---------------------------------------------------------------------------
# self-check


def _selfcheck():
    torch.manual_seed(0)
    dt = torch.float64
    B, T, H, N = 2, 37, 2, 8
    r, k, v = (torch.randn(B, T, H, N, dtype=dt) * 0.5 for _ in range(3))
    w = torch.exp(-E_HALF * torch.sigmoid(torch.randn(B, T, H, N, dtype=dt)))
    kk = F.normalize(torch.randn(B, T, H, N, dtype=dt), dim=-1)
    a, b = -kk, kk * torch.sigmoid(torch.randn(B, T, H, N, dtype=dt))
    s0 = torch.randn(B, H, N, N, dtype=dt) * 0.3
    ins = [t.requires_grad_() for t in (r, w, k, v, a, b, s0)]
    y1, S1 = wkv7_loop(*ins)
    y2, S2 = wkv7_chunked(*ins)
    dy, dS = torch.randn_like(y1), torch.randn_like(S1)
    g1 = torch.autograd.grad((y1 * dy).sum() + (S1 * dS).sum(), ins)
    g2 = torch.autograd.grad((y2 * dy).sum() + (S2 * dS).sum(), ins)
    with torch.no_grad():
        err = max(float((y1 - y2).abs().max() / y1.abs().max()),
                  float((S1 - S2).abs().max() / S1.abs().max()))
    gerr = max(float((x - z).abs().max() / x.abs().max()) for x, z in zip(g1, g2))
    print("wkv7 chunked vs loop (float64): forward %.1e, grads %.1e" % (err, gerr))
    ok = err < 1e-10 and gerr < 1e-10
    cfg = dict(n_embd=16, n_head=2, head_size=8, n_rwkv_layer=3, n_attn_layer=1,
               vocab_size=11, ffn_dim=24, Dw=4, Da=4, Dg=6, Dv=3, chunk_size=4, moba_top_k=1)
    tok = torch.randint(0, 11, (2, 21))
    tgt = torch.randint(0, 11, (2, 21))
    m1 = RwkvXTorch(cfg, seed=5, dtype=dt, wkv=wkv7_loop)
    m2 = RwkvXTorch(cfg, seed=5, dtype=dt)
    l1, l2 = m1.loss(tok, tgt), m2.loss(tok, tgt)
    l1.backward()
    l2.backward()
    gm = max(float((p1.grad - p2.grad).abs().max() / max(p1.grad.abs().max(), 1e-30))
             for p1, p2 in zip(m1.plist, m2.plist))
    print("model chunked vs loop WKV (float64): loss %.1e, grads %.1e"
          % (abs(float(l1 - l2)), gm))
    ok &= abs(float(l1 - l2)) < 1e-12 and gm < 1e-9
    print("selfcheck", "OK" if ok else "FAILED")
    return ok


if __name__ == "__main__":
    import sys
    if "--selfcheck" in sys.argv:
        sys.exit(0 if _selfcheck() else 1)
    print(__doc__)
