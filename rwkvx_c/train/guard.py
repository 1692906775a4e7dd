"""Divergence detection for a training run (docs/training.md §Divergence).

A run has diverged when, before its optimiser step,

  - the loss is not finite, or the gradient norm is not finite;
  - the loss exceeds the uniform-guess loss ln(V) by more than
    UNIFORM_SLACK_NATS: the model then gives the data on average less than
    e^-UNIFORM_SLACK_NATS (37%) of the probability a constant uniform guess
    gives it. A freshly initialised model sits at ~ln(V) (its logits start
    near zero) and training only lowers it, so no healthy run is there;
  - the loss has risen, on evidence beyond one batch. A step's loss is a
    spike when it lies above the median of the last SPIKE_WINDOW healthy
    losses by more than max(SPIKE_NATS, SPIKE_REL * median). One spike is
    not evidence: a single small batch can be that hard (a window of
    base64 or of a foreign script in a code corpus costs a byte-level
    model up to 3 nats more than the median, at the same step of every run
    with the same seed). A spike is a divergence only when
      * SPIKE_PERSIST of the last SPIKE_SPAN steps were spikes: the loss
        stays up over batches drawn independently, so the model, not the
        data, changed; or
      * GRAD_PERSIST of them also had a gradient norm above GRAD_SPIKE
        times the median of the recent healthy gradient norms: the rise
        shows in the gradient too, so fewer steps are evidence enough. (One
        hard batch can show both: measured on the standard-library corpus
        with the tiny preset, a 1 x 256 batch 1.03 nats above the median
        with 20x the median gradient norm, a 2 x 64 one 0.9 nats above with
        46x; never two such batches within SPIKE_SPAN steps.)
    Spikes are kept out of the history, so the median they are judged
    against is the level before the rise.

The same bounds decide whether a model may be checkpointed: a checkpoint is
never overwritten with a non-finite or worse-than-uniform model, and no
periodic checkpoint is taken while a spike is among the last SPIKE_SPAN
steps (suspect()).
"""
from __future__ import annotations

import math
import statistics
from collections import deque

import numpy as np

from rwkvx_c.errors import Divergence

__all__ = ["Divergence", "DivergenceGuard", "UNIFORM_SLACK_NATS", "SPIKE_WINDOW",
           "SPIKE_MIN_HISTORY", "SPIKE_NATS", "SPIKE_REL", "SPIKE_PERSIST", "SPIKE_SPAN",
           "GRAD_SPIKE", "GRAD_PERSIST", "ROLLBACK_LR_FACTOR", "MAX_ROLLBACKS", "ON_DIVERGENCE"]

UNIFORM_SLACK_NATS = 1.0
SPIKE_WINDOW = 20
SPIKE_MIN_HISTORY = 5      # losses needed before a spike can be judged
SPIKE_NATS = 1.0
_BLOCK = 1 << 22           # elements per block of the finiteness check
SPIKE_REL = 0.5
SPIKE_PERSIST = 3          # spikes among the last SPIKE_SPAN steps that make a divergence
SPIKE_SPAN = 5
GRAD_SPIKE = 10.0          # a spike's grad norm over the median that counts as a grad spike
GRAD_PERSIST = 2           # spikes with a grad spike among the last SPIKE_SPAN that diverge
ROLLBACK_LR_FACTOR = 0.5   # each rollback halves the learning rate
MAX_ROLLBACKS = 3          # then the run stops: 1/8 of the lr did not help
ON_DIVERGENCE = ("stop", "rollback")


class DivergenceGuard:
    """Judges each step's loss and grad norm against the bounds above."""

    def __init__(self, vocab_size: int, per_token: bool = True) -> None:
        # a preference objective's loss (per_token False) is no per-token
        # cross-entropy: neither the uniform-guess bound nor the spike rule,
        # tuned on those, applies (a pair's loss swings by nats from batch to
        # batch); a non-finite loss, grad norm or parameter still stops it
        self.per_token = per_token
        self.uniform = math.log(vocab_size) if per_token else math.inf
        self.recent: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self.norms: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self.spikes: deque[bool] = deque(maxlen=SPIKE_SPAN)
        self.grad_spikes: deque[bool] = deque(maxlen=SPIKE_SPAN)

    def reset(self) -> None:
        """Forget the recent losses (after a rollback)."""
        self.recent.clear()
        self.norms.clear()
        self.spikes.clear()
        self.grad_spikes.clear()

    def ceiling(self) -> float:
        """The highest loss a healthy model may have."""
        return self.uniform + UNIFORM_SLACK_NATS

    def suspect(self) -> bool:
        """True while a spike is among the last SPIKE_SPAN steps."""
        return any(self.spikes)

    def check_loss(self, loss: float, step: int, grad_norm: float | None = None) -> None:
        """Raises Divergence when `loss` (of the step about to be applied,
        with its gradient norm before clipping when known) shows a diverging
        model (see the module doc)."""
        if not math.isfinite(loss):
            raise Divergence(step, f"the loss is {loss}")
        if grad_norm is not None:
            self.check_grad_norm(grad_norm, step)
        if loss > self.ceiling():
            raise Divergence(step, f"the loss {loss:.4g} is above the uniform-guess loss "
                                   f"ln(V) = {self.uniform:.4g} + {UNIFORM_SLACK_NATS:g}")
        spike = grad_spike = False
        if len(self.recent) >= SPIKE_MIN_HISTORY and self.per_token:
            med = statistics.median(self.recent)
            spike = loss - med > max(SPIKE_NATS, SPIKE_REL * med)
        if spike and grad_norm is not None and self.norms:
            gmed = statistics.median(self.norms)
            grad_spike = grad_norm > GRAD_SPIKE * gmed
        self.spikes.append(spike)
        self.grad_spikes.append(grad_spike)
        if not spike:
            self.recent.append(loss)
            if grad_norm is not None:
                self.norms.append(grad_norm)
            return
        n, g = sum(self.spikes), sum(self.grad_spikes)
        if n >= SPIKE_PERSIST:
            raise Divergence(step, f"the loss jumped to {loss:.4g} from a recent median of "
                                   f"{med:.4g}, in {n} of the last {len(self.spikes)} steps")
        if g >= GRAD_PERSIST:
            raise Divergence(step, f"the loss jumped to {loss:.4g} from a recent median of "
                                   f"{med:.4g} and the gradient norm to {grad_norm:.3g} from "
                                   f"{gmed:.3g}, in {g} of the last {len(self.spikes)} steps")

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
        # in blocks: no temporary as large as the model
        if not all(np.isfinite(params[i:i + _BLOCK]).all() for i in range(0, params.size, _BLOCK)):
            raise Divergence(step, "a parameter is not finite")
