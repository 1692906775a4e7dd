"""Divergence detection for a training run (docs/training.md §Divergence).

A run has diverged when, before its optimiser step,

  - the loss is not finite, or the gradient norm is not finite;
  - the loss exceeds the uniform-guess loss ln(V) by more than
    UNIFORM_SLACK_NATS: the model then gives the data on average less than
    e^-UNIFORM_SLACK_NATS (37%) of the probability a constant uniform guess
    gives it. A freshly initialised model sits at ~ln(V) (its logits start
    near zero) and training only lowers it, so no healthy run is there;
  - the loss jumps above the median of the last SPIKE_WINDOW losses by more
    than max(SPIKE_NATS, SPIKE_REL * median). Batch-to-batch noise of a mean
    over B*T >= 256 tokens is a few percent of the loss; one nat above the
    recent level means the model now gives the data e^-1 of the probability
    it gave a few steps ago, which noise does not do and a blow-up does.

The same bounds decide whether a model may be checkpointed: a checkpoint is
never overwritten with a non-finite or worse-than-uniform model.
"""
from __future__ import annotations

import math
import statistics
from collections import deque

import numpy as np

from rwkvx_c.errors import Divergence

__all__ = ["Divergence", "DivergenceGuard", "UNIFORM_SLACK_NATS", "SPIKE_WINDOW",
           "SPIKE_MIN_HISTORY", "SPIKE_NATS", "SPIKE_REL", "ROLLBACK_LR_FACTOR",
           "MAX_ROLLBACKS", "ON_DIVERGENCE"]

UNIFORM_SLACK_NATS = 1.0
SPIKE_WINDOW = 20
SPIKE_MIN_HISTORY = 5      # losses needed before a spike can be judged
SPIKE_NATS = 1.0
SPIKE_REL = 0.5
ROLLBACK_LR_FACTOR = 0.5   # each rollback halves the learning rate
MAX_ROLLBACKS = 3          # then the run stops: 1/8 of the lr did not help
ON_DIVERGENCE = ("stop", "rollback")


class DivergenceGuard:
    """Judges each step's loss and grad norm against the bounds above."""

    def __init__(self, vocab_size: int) -> None:
        self.uniform = math.log(vocab_size)
        self.recent: deque[float] = deque(maxlen=SPIKE_WINDOW)

    def reset(self) -> None:
        """Forget the recent losses (after a rollback)."""
        self.recent.clear()

    def ceiling(self) -> float:
        """The highest loss a healthy model may have."""
        return self.uniform + UNIFORM_SLACK_NATS

    def check_loss(self, loss: float, step: int) -> None:
        """Raises Divergence when `loss` (of the step about to be applied) is bad."""
        if not math.isfinite(loss):
            raise Divergence(step, f"the loss is {loss}")
        if loss > self.ceiling():
            raise Divergence(step, f"the loss {loss:.4g} is above the uniform-guess loss "
                                   f"ln(V) = {self.uniform:.4g} + {UNIFORM_SLACK_NATS:g}")
        if len(self.recent) >= SPIKE_MIN_HISTORY:
            med = statistics.median(self.recent)
            if loss - med > max(SPIKE_NATS, SPIKE_REL * med):
                raise Divergence(step, f"the loss jumped to {loss:.4g} from a recent median "
                                       f"of {med:.4g}")
        self.recent.append(loss)

    def check_grad_norm(self, norm: float, step: int) -> None:
        if not math.isfinite(norm):
            raise Divergence(step, f"the gradient norm is {norm}")

    def check_eval(self, val_loss: float, step: int) -> None:
        if not (math.isfinite(val_loss) and val_loss <= self.ceiling()):
            raise Divergence(step, f"the loss of the model {val_loss:.4g} is above the "
                                   f"uniform-guess loss ln(V) = {self.uniform:.4g} + "
                                   f"{UNIFORM_SLACK_NATS:g}")

    def check_params(self, params: np.ndarray, step: int) -> None:
        """Raises Divergence when a parameter is not finite."""
        if not np.isfinite(params).all():
            raise Divergence(step, "a parameter is not finite")
