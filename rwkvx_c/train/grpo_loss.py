"""GRPO's maths (docs/maths.md §GRPO), as TRL's GRPOTrainer computes it:
group advantages of the completions' rewards, and the clipped surrogate
with its four aggregations over the completion tokens, with its grad on
each token's log-probability (float64 NumPy; the model's backward takes
that grad in through the cross-entropy of each token, RxPtModel.backward_rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rwkvx_c.run.rundir import Row

__all__ = ["LOSS_TYPES", "SCALE_REWARDS", "STD_EPS", "Advantages", "advantages", "TokenLoss",
           "token_loss", "nanstd"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4   # TRL's: advantages / (std + 1e-4)


def nanstd(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """TRL's nanstd: the Bessel-corrected std of the non-NaN values (NaN
    for fewer than two)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.nanmean(x, axis=axis, keepdims=True)
        var = np.nanmean((x - mean) ** 2, axis=axis)
        n = np.sum(~np.isnan(x), axis=axis)
        return np.sqrt(np.where(n > 1, var * n / np.maximum(n - 1, 1), np.nan))


@dataclass
class Advantages:
    """advantages (N,): each completion's; rewards (N,): the weighted sum of
    its functions' rewards (NaN where every function returned None);
    zero_std (N,): its group's (or the batch's) rewards do not vary."""
    advantages: np.ndarray
    rewards: np.ndarray
    zero_std: np.ndarray


def advantages(per_func: np.ndarray, weights: np.ndarray, G: int, scale: str) -> Advantages:
    """TRL's sum_then_normalize advantages of N = P*G completions (P groups
    of G in order): per_func (N, F), NaN where a function returned None."""
    unscorable = np.isnan(per_func).all(axis=1)
    rewards = np.nansum(per_func * weights[None, :], axis=1)
    rewards[unscorable] = np.nan
    grouped = rewards.reshape(-1, G)
    with np.errstate(invalid="ignore"):
        mean = np.repeat(np.nanmean(grouped, axis=1), G)
    if scale == "batch":
        std = np.full(len(rewards), nanstd(rewards) if len(rewards) > 1 else 0.0)
    else:   # group, and none (whose std only says which groups do not vary)
        std = np.repeat(nanstd(grouped, axis=1), G) if G > 1 else np.zeros(len(rewards))
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + STD_EPS)
    zero = np.isclose(std, 0.0)   # torch.isclose: the same default tolerances
    return Advantages(np.nan_to_num(adv, nan=0.0), rewards, zero)


@dataclass
class TokenLoss:
    """The loss of one micro-batch, its grad on each token's log-probability
    (N, T) (0 off the mask) and TRL's metrics of it."""
    loss: float
    grad: np.ndarray
    metrics: Row


def _masked_mean(x: np.ndarray, mask: np.ndarray) -> float:
    return float((x * mask).sum() / max(mask.sum(), 1.0))


def token_loss(logp: np.ndarray, mask: np.ndarray, adv: np.ndarray, *, loss_type: str,
               eps_low: float, eps_high: float, beta: float = 0.0,
               old: np.ndarray | None = None, ref: np.ndarray | None = None,
               max_len: int = 0, accum: int = 1, n_items: float = 1.0,
               n_micro: float | None = None) -> TokenLoss:
    """TRL's GRPO loss of a micro-batch of N completions: logp (N, T) the
    policy's log-probability of each completion token, mask (N, T) 1 on the
    tokens the loss takes, adv (N,), old (N, T) the log-probabilities the
    ratio divides by (None: logp itself, held constant: ratio 1), ref (N,
    T) the reference's (beta > 0). max_len: --max-completion-length
    (dr_grpo); accum: the micro-batches of the step; n_items: the masked
    tokens of the whole step (dapo); n_micro: the masked tokens of the
    micro-batch (bnpo; None: mask's own)."""
    logp = np.asarray(logp, np.float64)
    mask = np.asarray(mask, np.float64)
    A = np.asarray(adv, np.float64)[:, None]
    ratio = np.exp(logp - old) if old is not None else np.ones_like(logp)
    clipped = np.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    l1, l2 = ratio * A, clipped * A
    per_tok = -np.minimum(l1, l2)
    # d(-min(l1, l2))/dlogp: l1's branch carries ratio * A; the clipped one
    # is flat (ratio outside the range); at a tie both branches agree
    d_tok = np.where(l1 <= l2, -ratio * A, 0.0)
    m: Row = {}
    if beta != 0.0:
        assert ref is not None, "beta > 0 needs the reference's log-probabilities"
        e = np.exp(ref - logp)
        kl = e - (ref - logp) - 1.0
        # TRL's use_bias_correction_kl: the KL weighted by the ratio, whose grad is ratio's
        per_tok = per_tok + beta * kl * ratio
        d_tok = d_tok + beta * ratio * ((1.0 - e) + kl)
        m["kl"] = _masked_mean(kl * ratio, mask)
    N = logp.shape[0]
    if loss_type == "grpo":
        per_seq = mask / np.maximum(mask.sum(axis=1, keepdims=True), 1.0)
        w = per_seq / N
    elif loss_type == "bnpo":
        w = mask / max(mask.sum() if n_micro is None else n_micro, 1.0)
    elif loss_type == "dr_grpo":
        w = mask / (N * max_len)
    elif loss_type == "dapo":
        w = mask / max(n_items, 1.0)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")
    if loss_type != "dapo":
        w = w / accum   # dapo's normaliser is the whole step's tokens already
    loss = float((per_tok * w).sum())
    low = ((ratio < 1.0 - eps_low) & (A < 0)).astype(np.float64)
    high = ((ratio > 1.0 + eps_high) & (A > 0)).astype(np.float64)
    m["clip_ratio/low_mean"] = _masked_mean(low, mask)
    m["clip_ratio/high_mean"] = _masked_mean(high, mask)
    m["clip_ratio/region_mean"] = _masked_mean(np.maximum(low, high), mask)
    n_seq = mask.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        seq_low = (low * mask).sum(axis=1) / n_seq
        seq_high = (high * mask).sum(axis=1) / n_seq
    m["clip_ratio/low_min"] = float(np.nanmin(seq_low)) if np.isfinite(seq_low).any() \
        else float("nan")
    m["clip_ratio/high_max"] = float(np.nanmax(seq_high)) if np.isfinite(seq_high).any() \
        else float("nan")
    return TokenLoss(loss, d_tok * w, m)
