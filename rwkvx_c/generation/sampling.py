"""How the next token is drawn: the Sampling settings, the rwkv package's
repetition penalties, stop strings, and the draw itself, for one sequence
(sample_token) and for the rows of a batch at once (sample_rows).

sample_rows is sample_token over each row with the row's own random
stream, vectorised: every row's result depends on that row's logits,
counts and stream alone, so a sequence draws the same ids whatever else
shares its batch.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rwkvx_c.errors import SampleError

__all__ = ["Sampling", "sample_token", "sample_rows", "log_probs", "Penalties", "RowPenalties",
           "StopText", "WEIGHTLESS", "TOP_CANDIDATES"]

WEIGHTLESS = " \t0123456789"   # a token whose text lies in this counts 0 (the rwkv pipeline)
# top-k / top-p look at this many of a row's most likely ids first, sorted,
# and sort the whole row only when the cut falls past them
TOP_CANDIDATES = 1024


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


def sample_token(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0) -> int:
    """A token id drawn from logits (vocab,) as Sampling describes."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature <= 0:
        return int(np.argmax(logits))
    # shifted before the division: a tiny temperature sends the gaps to
    # -inf (probability 0), never inf - inf = NaN
    z = (logits - logits.max()) / temperature
    p = np.exp(z)
    p /= p.sum()
    if top_p < 1.0 or 0 < top_k < len(p):
        order = np.argsort(-p, kind="stable")
        topk = 0 < top_k < len(p)
        if topk:
            order = order[:top_k]
        cum = np.cumsum(p[order]) / (p[order].sum() if topk else p.sum())
        keep = order[: int(np.searchsorted(cum, top_p)) + 1] if top_p < 1.0 else order
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return int(rng.choice(len(p), p=p))


def sample_rows(logits: np.ndarray, rngs: Sequence[np.random.Generator],
                temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> np.ndarray:
    """sample_token over each row of logits [R, V] with rngs[r] (one
    uniform draw a row when temperature > 0): the ids [R]."""
    x = np.asarray(logits, dtype=np.float64)
    V = x.shape[1]
    if temperature <= 0:
        return np.argmax(x, axis=1)
    p = np.exp((x - x.max(axis=1, keepdims=True)) / temperature)
    p /= p.sum(axis=1, keepdims=True)
    if top_p < 1.0 or 0 < top_k < V:
        p = _nucleus(p, top_p, top_k if 0 < top_k < V else 0)
    # Generator.choice(V, p=row): the cumulative sum, normalised by its
    # last value, searched (right) for one uniform draw
    u = np.array([rng.random() for rng in rngs], dtype=np.float64)
    cdf = np.cumsum(p, axis=1)
    cdf /= cdf[:, -1:]
    return np.minimum((cdf <= u[:, None]).sum(axis=1), V - 1)


def _nucleus(p: np.ndarray, top_p: float, top_k: int) -> np.ndarray:
    """p [R, V] (rows summing to 1) kept to each row's top_k (0: all), then
    to the smallest most-likely set reaching top_p, renormalised: the q of
    sample_token. The cut is found among the TOP_CANDIDATES most likely ids
    of a row, sorted by (-p, id) as a stable sort orders them; a row whose
    cut falls at or past the least of them (a tie there may leave out an
    id the full sort would keep) is sorted whole."""
    R, V = p.shape
    k = min(V, max(TOP_CANDIDATES, top_k + 1))
    rows = np.arange(R)[:, None]
    if k < V:
        cand = np.argpartition(-p, k - 1, axis=1)[:, :k]
        cand.sort(axis=1)                    # by id, so that the stable sort breaks ties by id
    else:
        cand = np.broadcast_to(np.arange(V), (R, V))
    order = np.take_along_axis(cand, np.argsort(-p[rows, cand], axis=1, kind="stable"), axis=1)
    ps = p[rows, order]
    kept = ps[:, :top_k] if top_k else ps
    # the divisor as sample_token's: the kept mass (all of it without top-k)
    total = kept.sum(axis=1) if top_k else p.sum(axis=1)
    n = np.full(R, kept.shape[1])
    if top_p < 1.0:
        cum = np.cumsum(kept, axis=1) / total[:, None]
        n = np.minimum((cum < top_p).sum(axis=1) + 1, kept.shape[1])
    q = np.zeros_like(p)
    for r in range(R):
        last = ps[r, n[r] - 1]
        if k < V and last <= ps[r, -1]:   # the cut reaches the candidates' end: sort it all
            whole = np.argsort(-p[r], kind="stable")
            if top_k:
                whole = whole[:top_k]
            c = np.cumsum(p[r, whole]) / p[r, whole].sum()
            keep = whole[: int(np.searchsorted(c, top_p)) + 1] if top_p < 1.0 else whole
        else:
            keep = order[r, :n[r]]
        q[r, keep] = p[r, keep]
    return q / q.sum(axis=1, keepdims=True)


def log_probs(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """log_softmax(logits[r])[ids[r]] of each row of logits [R, V], in float64:
    the model's own probability of the id drawn (before temperature,
    penalties and top-k/top-p)."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=1)
    lse = np.log(np.exp(x - m[:, None]).sum(axis=1)) + m
    return x[np.arange(len(ids)), ids] - lse


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
    """Penalties for the rows of a batch at once: each row's counts (and
    which ids it has generated) as dense [rows, V] arrays, so a step's
    penalties are array operations, never a loop over ids."""

    def __init__(self, s: Sampling, rows: int, vocab: int) -> None:
        self.s = s
        self.count = np.zeros((rows, vocab) if s.penalised else (0, 0), np.float64)
        self.seen = np.zeros(self.count.shape, bool)
        self.ban = np.array([t for t in s.token_ban if t < vocab], np.int64)

    def apply(self, logits: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """logits [len(rows), V] of those rows, penalised (float32, a copy)."""
        out = np.array(logits, dtype=np.float32)
        if len(self.ban):
            out[:, self.ban] = -np.inf
        if self.s.penalised:
            pen = (self.s.alpha_presence + self.count[rows] * self.s.alpha_frequency)
            out -= np.where(self.seen[rows], pen, 0.0).astype(np.float32)
        return out

    def reset(self, row: int) -> None:
        if self.s.penalised:
            self.count[row] = 0
            self.seen[row] = False

    def add(self, rows: np.ndarray, ids: np.ndarray, weights: np.ndarray) -> None:
        """Each row's counts decayed, then its new id counted (weight 0 or 1)."""
        if self.s.penalised:
            self.count[rows] *= self.s.alpha_decay
            self.count[rows, ids] += weights
            self.seen[rows, ids] = True


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
