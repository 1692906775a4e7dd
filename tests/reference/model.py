"""Reference whole model (docs/maths.md, docs/layout.md): parameter names, order and shapes,
the splitmix64 init, the layer order, and the forward and loss composed from
the block references. A config here is a model's whole config
(RxPtModel.config): ln0, ln_eps and gn_eps included, which the reference takes
from it. Parameters are a dict name -> array (or autograd Var);
tokens and targets are int arrays (T,) or (B, T)."""
import numpy as np

from reference.attn import attn_block_of, attn_block_qk, moba_gate_margin
from reference.autograd import Var
from reference.layers import cross_entropy, embedding, head, layernorm
from reference.rwkv import rwkv_block, tm_param_shapes

_ATTN_FIELDS = ("receptance_w", "key_w", "value_w", "output_w")


def layer_order(config):
    """'R' / 'A' per block in model order: an attention block after every
    interval-th RWKV block (interval = n_rwkv // n_attn) until n_attn are placed."""
    n_r, n_a = config["n_rwkv_layer"], config["n_attn_layer"]
    out, placed = [], 0
    for r in range(n_r):
        out.append("R")
        if placed < n_a and (r + 1) % (n_r // n_a) == 0:
            out.append("A")
            placed += 1
    return "".join(out)


def param_specs(config):
    """[(name, shape)] in docs/layout.md §Parameters order."""
    C, V, F = config["n_embd"], config["vocab_size"], config["ffn_dim"]
    lora = [config[d] for d in ("Dw", "Da", "Dg", "Dv")]
    cm = [("cm.ffn_x_k", (C,)), ("cm.ffn_key_w", (C, F)), ("cm.ffn_value_w", (F, C))]
    specs = [("emb", (V, C))]
    if config["ln0"]:
        specs += [("ln0_w", (C,)), ("ln0_b", (C,))]
    n_rwkv = 0
    for L, kind in enumerate(layer_order(config)):
        pre = f"blocks.{L}."
        block = [("ln1_w", (C,)), ("ln1_b", (C,))]
        if kind == "R":
            block += [("tm." + f, s) for f, s in tm_param_shapes(C, *lora, n_rwkv).items()]
            n_rwkv += 1
        else:
            block += [(f, (C, C)) for f in _ATTN_FIELDS]
        block += [("ln2_w", (C,)), ("ln2_b", (C,))] + cm
        specs += [(pre + n, s) for n, s in block]
    return specs + [("ln_out_w", (C,)), ("ln_out_b", (C,)), ("head", (C, V))]


def splitmix64(seed, n, start=0):
    """Draws start .. start+n-1 of the splitmix64 stream seeded with seed, as
    uint64: draw i mixes the state seed + (i+1)*0x9E3779B97F4A7C15."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + np.arange(start + 1, start + n + 1, dtype=np.uint64) \
            * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _init_kind(name, shape):
    last = name.split(".")[-1]
    if name == "emb":
        return "emb"
    if len(shape) == 2:
        return "mat"
    if last.startswith("ln") and last.endswith("_w"):
        return "gamma"
    if last.startswith("ln") and last.endswith("_b"):
        return "beta"
    return "vec"


def init_params(config, seed):
    """dict name -> float32 array: the docs/layout.md §Init, computed in double and
    rounded once to float32."""
    out, start = {}, 0
    for name, shape in param_specs(config):
        n = int(np.prod(shape))
        d = (splitmix64(seed, n, start) >> np.uint64(40)).astype(np.float64) * 2.0 ** -24 - 0.5
        kind = _init_kind(name, shape)
        v = {"mat": d * 0.3, "emb": d * 0.5, "vec": d * 0.5,
             "gamma": 1.0 + 0.2 * d, "beta": 0.2 * d}[kind]
        out[name] = v.astype(np.float32).reshape(shape)
        start += n
    return out


def _sub(params, prefix):
    """The params under prefix, with the prefix removed."""
    return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}


def model_forward(params, config, tokens, block_inputs=None, state0=None):
    """Logits Var (B, T, vocab) for tokens (B, T), or (T, vocab) for (T,).
    params: Vars, or arrays taken as constants. block_inputs: a list that
    receives the residual entering each block. state0: None, or a list of
    one initial WKV state Var (H, N, N) per RWKV block, every sequence of
    the batch starting from it (docs/maths.md §Initial state)."""
    params = {k: v if isinstance(v, Var) else Var(v, requires_grad=False)
              for k, v in params.items()}
    tokens = np.asarray(tokens)
    tok2 = tokens.reshape(1, -1) if tokens.ndim == 1 else tokens
    _B, T = tok2.shape
    H, N = config["n_head"], config["head_size"]
    ln_eps, gn_eps = config["ln_eps"], config["gn_eps"]
    x = embedding(params["emb"], tok2)
    if config["ln0"]:
        x = layernorm(x, params["ln0_w"], params["ln0_b"], ln_eps)
    v_first, r = None, 0
    for L, kind in enumerate(layer_order(config)):
        p = _sub(params, f"blocks.{L}.")
        if block_inputs is not None:
            block_inputs.append(x)
        if kind == "R":
            s0 = None if state0 is None else state0[r].reshape(1, H, N, N)
            x, vf = rwkv_block(p, x, None, None, v_first, H, N, r, ln_eps, gn_eps, s0)
            if r == 0:
                v_first = vf
            r += 1
        else:
            x = attn_block_of(p, x, config)
    logits = head(layernorm(x, params["ln_out_w"], params["ln_out_b"], ln_eps), params["head"])
    return logits.reshape(T, config["vocab_size"]) if tokens.ndim == 1 else logits


def model_loss(params, config, tokens, targets, ignore_index=-1, state0=None):
    """Scalar Var: mean cross-entropy over every valid position of the batch."""
    logits = model_forward(params, config, tokens, state0=state0)
    V = config["vocab_size"]
    return cross_entropy(logits.reshape(-1, V), np.asarray(targets).reshape(-1), ignore_index)


def min_gate_margin(params, config, tokens):
    """The smallest MoBA gate margin (reference.attn.moba_gate_margin) over
    every attention block of the model on these tokens: inf without a choice."""
    xs = []
    model_forward(params, config, tokens, block_inputs=xs)
    H, N = config["n_head"], config["head_size"]
    margin = np.inf
    for L, kind in enumerate(layer_order(config)):
        if kind == "A":
            q, k = attn_block_qk(_sub(params, f"blocks.{L}."), xs[L], H, N, config["ln_eps"])
            margin = min(margin, moba_gate_margin(q, k, config["chunk_size"],
                                                  config["moba_top_k"], H, N))
    return margin


def leaves(params):
    """float64 autograd leaves of a params dict."""
    return {k: Var(np.array(v, dtype=np.float64)) for k, v in params.items()}
