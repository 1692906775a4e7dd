"""How the next token is drawn: the Sampling settings, the rwkv package's
repetition penalties, stop strings, and the draw itself, for the rows of a
batch at once (draw_rows, sample_rows) and for one sequence (sample_token).

The draw runs in C (csrc/sample.c, rx_sample_rows), each row with its own
random stream and alone: every row's result depends on that row's logits,
counts and stream alone, so a sequence draws the same ids whatever else
shares its batch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rwkvx_c import _core
from rwkvx_c.errors import SampleError

__all__ = ["Sampling", "sample_token", "sample_rows", "draw_rows", "Penalties", "RowPenalties",
           "StopText", "WEIGHTLESS"]

WEIGHTLESS = " \t0123456789"   # a token whose text lies in this counts 0 (the rwkv pipeline)


@dataclass(frozen=True)
class Sampling:
    """How each new token is drawn, checked on construction (SampleError).

    temperature, top_k, top_p: softmax(logits / temperature) kept to the
    top_k most likely tokens (0: all), then to the smallest set of the most
    likely whose probability reaches top_p (1: all), renormalised;
    temperature 0 picks the argmax. Before that, as the ``rwkv`` package's
    PIPELINE.generate does: every id of token_ban gets logit -inf, and each
    id already generated has its logit lowered by alpha_presence +
    alpha_frequency * its count, where the counts decay by alpha_decay each
    step and a token whose text lies in " \\t0123456789" counts 0. A
    sampled id of token_stop ends the generation unwritten; so does the
    text reaching one of `stop` (the text before it is written, the stop
    string not).
    """
    temperature: float = 1.0
    top_p: float = 0.9
    top_k: int = 0
    alpha_presence: float = 0.0
    alpha_frequency: float = 0.0
    alpha_decay: float = 0.996   # the rwkv package's default
    token_ban: Sequence[int] = ()
    token_stop: Sequence[int] = ()
    stop: str | Sequence[str] = ()   # one string or several; held as a tuple

    def __post_init__(self) -> None:
        for name in ("temperature", "alpha_presence", "alpha_frequency"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise SampleError(f"{name} must be a finite number >= 0, got {v!r}")
        for name in ("top_p", "alpha_decay"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v <= 1):
                raise SampleError(f"{name} must be a number in [0, 1], got {v!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SampleError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        # one stop string may come alone, as in the OpenAI API; lists as tuples
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(t, str) or not t for t in stop):
            raise SampleError("a stop string must be non-empty text")
        object.__setattr__(self, "stop", stop)
        for name in ("token_ban", "token_stop"):
            ids = tuple(getattr(self, name))
            if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0
                   for t in ids):
                raise SampleError(f"{name} must hold token ids (integers >= 0)")
            object.__setattr__(self, name, tuple(int(t) for t in ids))

    @property
    def penalised(self) -> bool:
        """Whether the repetition penalties change any logit."""
        return self.alpha_presence > 0 or self.alpha_frequency > 0


def draw_rows(x: np.ndarray, raw: np.ndarray, rngs: Sequence[np.random.Generator],
              temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0
              ) -> tuple[np.ndarray, np.ndarray]:
    """Each row's next token drawn from x [R, V] as Sampling describes, with
    rngs[r] (one uniform draw a row when temperature > 0), and its
    log-probability under raw [R, V], the model's logits (x may be raw
    itself): (ids [R], logprobs [R]). Read as float32, drawn in float64 by
    csrc/sample.c, each row alone (docs/training.md §Drawing a token)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    raw = np.ascontiguousarray(raw, dtype=np.float32)
    if temperature > 0:
        u = np.array([rng.random() for rng in rngs], dtype=np.float64)
    else:
        u = np.zeros(len(rngs))
    ids, lps = _core.draw_rows(x, raw, u, float(temperature), float(top_p), int(top_k))
    bad = np.flatnonzero(ids < 0)
    if len(bad):
        if not np.isfinite(raw[bad]).all():
            raise SampleError("the model's logits are not finite (NaN or inf): its weights do "
                              "not make a usable model")
        raise SampleError("every token is banned (token_ban) or penalised to -inf: "
                          "there is nothing to draw")
    return ids, lps


def sample_rows(logits: np.ndarray, rngs: Sequence[np.random.Generator],
                temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> np.ndarray:
    """The ids [R] drawn from logits [R, V] (penalised: a banned id's is
    -inf) with rngs[r], as draw_rows draws them."""
    x = np.ascontiguousarray(logits, dtype=np.float32)
    # no log-probability is asked: -inf (a banned id) is no error here
    banned = np.isneginf(x)
    raw = np.where(banned, np.float32(0), x) if banned.any() else x
    return draw_rows(x, raw, rngs, temperature, top_p, top_k)[0]


def sample_token(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0) -> int:
    """A token id drawn from logits (vocab,) as Sampling describes: the
    draw of one row by sample_rows."""
    x = np.asarray(logits, dtype=np.float32).reshape(1, -1)
    return int(sample_rows(x, [rng], temperature, top_p, top_k)[0])


class Penalties:
    """The rwkv package's repetition penalties (Sampling) of one sequence:
    the decayed count of every generated id, subtracted from its logit."""

    WEIGHTLESS = WEIGHTLESS

    def __init__(self, s: Sampling) -> None:
        self.s = s
        self.count: dict[int, float] = {}

    def apply(self, logits: np.ndarray) -> np.ndarray:
        if not (self.s.token_ban or self.count):
            return logits
        out = np.array(logits, dtype=np.float32)
        if self.s.token_ban:
            out[[t for t in self.s.token_ban if 0 <= t < len(out)]] = -np.inf
        if self.count:
            ids = np.fromiter(self.count, np.int64, len(self.count))
            n = np.fromiter(self.count.values(), np.float64, len(self.count))
            out[ids] -= (self.s.alpha_presence + n * self.s.alpha_frequency).astype(np.float32)
        return out

    def add(self, token: int, text: str) -> None:
        for t in self.count:
            self.count[t] *= self.s.alpha_decay
        self.count[token] = self.count.get(token, 0.0) + (0.0 if text in WEIGHTLESS else 1.0)


class RowPenalties:
    """Penalties (their rule, bit for bit) for the rows of a batch at once:
    each row's generated ids and their decayed counts, kept sparse, so a
    step costs the ids each row has generated, not the vocabulary."""

    def __init__(self, s: Sampling, rows: int, vocab: int) -> None:
        self.s = s
        self.ban = np.array([t for t in s.token_ban if t < vocab], np.int64)
        self.ids = [np.zeros(0, np.int64) for _ in range(rows)]   # in the order first drawn
        self.count = [np.zeros(0) for _ in range(rows)]           # each id's, float64
        self.at: list[dict[int, int]] = [{} for _ in range(rows)]  # id -> its place

    def apply(self, logits: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """logits [len(rows), V] of those rows, penalised (float32, a copy);
        logits themselves when no id is banned or penalised."""
        if not (len(self.ban) or self.s.penalised):
            return logits
        out = np.array(logits, dtype=np.float32)
        if len(self.ban):
            out[:, self.ban] = -np.inf
        if self.s.penalised:
            for r, k in enumerate(rows.tolist()):
                if len(self.ids[k]):
                    pen = self.s.alpha_presence + self.count[k] * self.s.alpha_frequency
                    out[r, self.ids[k]] -= pen.astype(np.float32)
        return out

    def reset(self, row: int) -> None:
        self.ids[row] = np.zeros(0, np.int64)
        self.count[row] = np.zeros(0)
        self.at[row] = {}

    def add(self, rows: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> None:
        """Each row's counts decayed, then its new id counted (weight 0 or 1)."""
        if not self.s.penalised:
            return
        for k, t, w in zip(rows.tolist(), ids.tolist(), weights.tolist()):
            self.count[k] *= self.s.alpha_decay
            j = self.at[k].get(t)
            if j is None:   # 0 decayed is 0, and 0 + w is w
                self.at[k][t] = len(self.ids[k])
                self.ids[k] = np.append(self.ids[k], t)
                self.count[k] = np.append(self.count[k], w)
            else:
                self.count[k][j] += w


class StopText:
    """Holds back generated text that may be the start of a stop string:
    push() returns what can be written, and sets hit at a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.held = ""
        self.hit = False

    def push(self, text: str) -> str:
        self.held += text
        at = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if at:
            out, self.held, self.hit = self.held[:min(at)], "", True
            return out
        keep = max((k for s in self.stops for k in range(1, len(s))
                    if self.held.endswith(s[:k])), default=0)
        out = self.held[:len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
