"""AdamW (decoupled weight decay, torch.optim.AdamW semantics) and the global
grad norm in NumPy float64, written from the update rule in csrc/optim.c's
header comment. Independent of rwkvx_c."""
import numpy as np


def grad_norm(g):
    """sqrt(sum g^2) in float64."""
    g = np.asarray(g, dtype=np.float64)
    return float(np.sqrt(np.sum(g * g)))


def decay_mask(n, decay_ranges):
    """Boolean (n,) mask of the elements inside [begin, end) ranges; None: all."""
    if decay_ranges is None:
        return np.ones(n, dtype=bool)
    mask = np.zeros(n, dtype=bool)
    for b, e in np.asarray(decay_ranges).reshape(-1, 2):
        mask[b:e] = True
    return mask


def adamw_step(p, g, m, v, *, lr, step, beta1=0.9, beta2=0.99, eps=1e-8,
               weight_decay=0.0, decay_ranges=None, grad_scale=1.0):
    """One AdamW step; returns new (p, m, v) as float64 arrays."""
    p, g, m, v = (np.asarray(a, dtype=np.float64) for a in (p, g, m, v))
    g = g * grad_scale
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    mhat = m / (1.0 - beta1 ** step)
    vhat = v / (1.0 - beta2 ** step)
    mask = decay_mask(p.size, decay_ranges)
    p = np.where(mask, p * (1.0 - lr * weight_decay), p)
    p = p - lr * mhat / (np.sqrt(vhat) + eps)
    return p, m, v


def clip_scale(norm, max_norm):
    """Factor that brings a grad of this norm down to max_norm (1 when below)."""
    return 1.0 if max_norm <= 0 or norm <= max_norm else max_norm / (norm + 1e-6)


def cosine_lr(step, *, lr, warmup, total, min_lr_frac=0.1):
    """Linear warmup over `warmup` steps (step 1 gets lr/warmup), then a cosine
    from lr down to min_lr_frac*lr at step `total`."""
    if warmup > 0 and step <= warmup:
        return lr * step / warmup
    if total <= warmup:
        return lr
    t = min(1.0, (step - warmup) / (total - warmup))
    lo = lr * min_lr_frac
    return lo + 0.5 * (lr - lo) * (1.0 + np.cos(np.pi * t))
