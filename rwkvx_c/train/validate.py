"""The validation loss of a run and the check of its validation split.

The loss is the mean over the fixed validation windows' counted targets (a
chat corpus's assistant tokens alone), each rank scoring its share of the
windows, and bits per byte of text: the loss summed in nats over every
target / (ln 2 * the UTF-8 bytes those targets decode to)."""
from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING

import numpy as np

from rwkvx_c.data.sampler import IGNORE, count_targets
from rwkvx_c.errors import RwkvxWarning
from rwkvx_c.util.words import counted

if TYPE_CHECKING:
    from rwkvx_c import _core
    from rwkvx_c.train.distributed import ProcessGroup

__all__ = ["validation_loss", "check_validation", "check_pair_validation", "MIN_VAL_WINDOWS",
           "MIN_VAL_PAIRS"]

MIN_VAL_WINDOWS = 4   # fewer validation windows than this (when more were asked): a warning
MIN_VAL_PAIRS = 4     # fewer held-out preference pairs than this: a warning


def check_validation(windows: int, eval_tokens: int, seq_len: int, val_data: bool = False,
                     aligned: bool = False) -> None:
    """An RwkvxWarning when the validation split holds fewer windows than
    MIN_VAL_WINDOWS and than --eval-tokens asks for: a loss over so few
    tokens cannot tell a better model from a worse one. Its advice is the
    run's: a larger --val-data when it has one, else --val-data or a
    larger --val-fraction; more conversations when its windows start at
    them (aligned: a state tune on chat data)."""
    asked = max(1, eval_tokens // seq_len)
    if windows < min(MIN_VAL_WINDOWS, asked):
        more = "a larger --val-data" if val_data else "--val-data, a larger --val-fraction"
        why = " (a state tune's windows start at conversations: one per conversation at most)" \
            if aligned else ""
        warnings.warn(RwkvxWarning(
            f"validation holds only {counted(windows, 'window')} of {seq_len} tokens{why}: its "
            f"loss is noise; give {more} or a shorter --seq-len"), stacklevel=3)


def check_pair_validation(pairs: int, total: int) -> None:
    """An RwkvxWarning when a preference run holds out fewer than
    MIN_VAL_PAIRS pairs (of total): their loss and accuracy are noise."""
    if pairs < MIN_VAL_PAIRS:
        warnings.warn(RwkvxWarning(
            f"the held-out preference set is only {counted(pairs, 'pair')} of {total}: its "
            "loss and accuracy are noise; give more pairs"), stacklevel=3)


def validation_loss(model: _core.RxPtModel, val_x: np.ndarray, val_y: np.ndarray,
                    rows: tuple[int, int], group: ProcessGroup,
                    val_bytes: int | None) -> tuple[float, float | None]:
    """(mean loss in nats, bits per byte or None) over val_x / val_y
    (windows, T), scored in batches of this rank's rows of a training batch."""
    lo, hi = rows
    B = hi - lo
    first, last = group.split(len(val_x))
    total, n = 0.0, 0.0
    for i in range(first, last, B):
        x = np.ascontiguousarray(val_x[i:min(i + B, last)])
        y = np.ascontiguousarray(val_y[i:min(i + B, last)])
        # the head and loss over row chunks: no (B*T, vocab) logits
        model.forward(x, return_logits=False)
        k = count_targets(y)   # a chat corpus scores its assistant tokens alone
        total += model.loss(y, IGNORE) * k
        n += k
    total, n = group.sum_values(total, n)
    return total / n, (total / (math.log(2) * val_bytes) if val_bytes else None)
