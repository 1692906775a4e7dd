"""Reference layers shared by both block kinds: token shift, LayerNorm
(docs/maths.md §LayerNorm) and the RWKV-7 channel-mix (docs/maths.md §Channel-mix).
Inputs and outputs are autograd Vars of shape (B, T, C) unless stated."""
import numpy as np

from reference.autograd import Var, concat


def token_shift(x, x_prev_init=None):
    """x_prev(t) = x[t-1] for t > 0, x_prev_init (B, C) or zero for t = 0."""
    B, T, C = x.shape
    first = Var(np.zeros((B, 1, C)), requires_grad=False) if x_prev_init is None \
        else x_prev_init.reshape(B, 1, C)
    return concat([first, x[:, :T - 1]], axis=1) if T > 1 else first


def layernorm(x, w, b, eps):
    """(x - mean) / sqrt(var + eps) * w + b over the last axis, biased variance;
    eps: the model's (its config's ln_eps, or gn_eps for the group norm)."""
    mu = x.mean(-1, keepdims=True)
    d = x - mu
    var = d.square().mean(-1, keepdims=True)
    return d / (var + eps).sqrt() * w + b


def channelmix(p, x, x_prev_init=None):
    """relu(xk . ffn_key_w)^2 . ffn_value_w with xk = x + (x_prev - x) * ffn_x_k.
    p: dict with 'ffn_x_k' (C,), 'ffn_key_w' (C, F), 'ffn_value_w' (F, C)."""
    xx = token_shift(x, x_prev_init) - x
    xk = x + xx * p["ffn_x_k"]
    return (xk @ p["ffn_key_w"]).relu().square() @ p["ffn_value_w"]


def embedding(emb, tokens):
    """emb (vocab, C) Var; tokens int (T,) in [0, vocab). Returns (T, C)."""
    return emb[np.asarray(tokens)]


def head(x, w):
    """logits = x . w; x (T, C), w (C, vocab)."""
    return x @ w


def cross_entropy(logits, targets, ignore_index=-1):
    """Mean over valid positions of -log softmax(logits_t)[target_t] (docs/maths.md §Whole model);
    position t is valid when ignore_index < 0 or targets[t] != ignore_index.
    No valid position: 0 (with zero grads). logits (T, vocab) Var."""
    targets = np.asarray(targets)
    T = logits.shape[0]
    valid = np.ones(T, bool) if ignore_index < 0 else targets != ignore_index
    n_valid = int(valid.sum())
    if n_valid == 0:
        return (logits * 0.0).sum()
    m = logits.value.max(-1, keepdims=True)       # a constant shift: lse is invariant to it
    lse = (logits - m).exp().sum(-1).log() + m[:, 0]
    picked = logits[np.arange(T), np.where(valid, targets, 0)]
    return ((lse - picked) * valid).sum() * (1.0 / n_valid)


def l2wrap_penalty(logits, factor):
    """factor / (2 T) * sum_t (max_v logits[t, v])^2, whose gradient is RWKV-LM's
    L2Wrap (docs/maths.md §L2Wrap): factor * max / T on each row's first
    largest logit. logits (T, vocab) Var."""
    T = logits.shape[0]
    am = np.argmax(logits.value, axis=-1)      # the first of equal maxima
    picked = logits[np.arange(T), am]
    return (picked * picked).sum() * (factor / (2.0 * T))
