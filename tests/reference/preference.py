"""Preference objectives (docs/maths.md §Preference tuning) in float64 over
the small autograd: each completion's summed log-probability from logits
and a boolean mask of its tokens, and the DPO / IPO / SimPO losses of
pairs of them, written from the formulas, never calling the package."""
import numpy as np

from .autograd import Var
from .lora import lora_params
from .model import model_forward


def seq_logps(logits, targets, trained):
    """logits (S, T, V) Var; targets (S, T) ids; trained (S, T) bool.
    (S,) Var: sum over each sequence's trained positions of
    log softmax(logits_t)[target_t]."""
    S, T, V = logits.shape
    flat = logits.reshape(S * T, V)
    m = flat.value.max(-1, keepdims=True)    # a constant shift: log-sum-exp is invariant to it
    lse = (flat - m).exp().sum(-1).log() + m[:, 0]
    tgt = np.where(trained, targets, 0).reshape(-1)
    logp = flat[np.arange(S * T), tgt] - lse            # (S*T,)
    return (logp * trained.reshape(-1).astype(np.float64)).reshape(S, T).sum(-1)


def _log_sigmoid(z):
    return -((-z).exp() + 1.0).log()


def pair_loss(kind, beta, pc, pr, rc, rr, nc, nr, eps=0.0, gamma=0.5):
    """Scalar Var: the mean over pairs of the objective's loss. pc, pr
    Vars (P,) of the policy; rc, rr arrays (P,) of the reference; nc, nr
    token counts."""
    nc, nr = np.asarray(nc, np.float64), np.asarray(nr, np.float64)
    if kind == "dpo":
        h = (pc - rc) - (pr - rr)
    elif kind == "ipo":
        h = (pc - rc) * (1.0 / nc) - (pr - rr) * (1.0 / nr)
    elif kind == "simpo":
        h = pc * (1.0 / nc) - pr * (1.0 / nr) - gamma / beta
    else:
        raise ValueError(kind)
    if kind == "ipo":
        losses = (h - 1.0 / (2.0 * beta)).square()
    else:
        z = h * beta
        losses = _log_sigmoid(z) * (-(1.0 - eps)) - _log_sigmoid(-z) * eps
    return losses.mean()


def model_pair_loss(params, config, x, y, trained, kind, beta, rc, rr, nc, nr, eps=0.0,
                    adapters=None, r=None, alpha=None, state0=None):
    """Scalar Var: pair_loss of the reference model's log-probabilities of
    the sequences x (2P, T) (the chosen ones, then the rejected ones)
    against targets y on the trained positions; with adapters, the LoRA
    policy's."""
    if adapters is not None:
        params = lora_params(params, adapters, r, alpha)
    logits = model_forward(params, config, x, state0=state0)
    lp = seq_logps(logits, y, trained)
    P = x.shape[0] // 2
    return pair_loss(kind, beta, lp[np.arange(P)], lp[np.arange(P, 2 * P)], rc, rr, nc, nr,
                     eps)


def as_var(a):
    return Var(np.asarray(a, np.float64))
