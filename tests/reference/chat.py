"""The loss of chat data (docs/maths.md §Loss, docs/finetune.md §Chat data):
the mean of -log softmax(logits_t)[target_t] over the positions whose target
is an assistant token, in float64, chosen by a boolean mask, never through
an ignore id; and the windows' (input, target, trained) triples read
straight from a token array and its per-token mask."""
import numpy as np

from .autograd import Var
from .model import model_forward


def masked_cross_entropy(logits, targets, trained):
    """logits (n, V) Var (or array, taken as a constant); targets (n,) ids;
    trained (n,) bool. The mean over the trained positions alone; 0 with none."""
    if not isinstance(logits, Var):
        logits = Var(np.asarray(logits, np.float64), requires_grad=False)
    targets = np.asarray(targets).reshape(-1)
    trained = np.asarray(trained, bool).reshape(-1)
    n = int(trained.sum())
    if n == 0:
        return (logits * 0.0).sum()
    rows = np.flatnonzero(trained)
    sub = logits[rows]
    m = sub.value.max(-1, keepdims=True)     # a constant shift: log-sum-exp is invariant to it
    lse = (sub - m).exp().sum(-1).log() + m[:, 0]
    return (lse - sub[np.arange(n), targets[rows]]).sum() * (1.0 / n)


def masked_model_loss(params, config, tokens, targets, trained):
    """Scalar Var: masked_cross_entropy of the reference model's logits."""
    logits = model_forward(params, config, tokens)
    return masked_cross_entropy(logits.reshape(-1, config["vocab_size"]), targets, trained)


def windows(tokens, mask, starts, T):
    """(inputs, targets, trained) (len(starts), T) of the windows at starts:
    input tokens[s + t], target tokens[s + t + 1], trained mask[s + t + 1]."""
    tokens, mask = np.asarray(tokens, np.int64), np.asarray(mask, bool)
    x = np.stack([tokens[s:s + T] for s in starts])
    y = np.stack([tokens[s + 1:s + T + 1] for s in starts])
    k = np.stack([mask[s + 1:s + T + 1] for s in starts])
    return x, y, k
