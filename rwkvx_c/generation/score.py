"""Scoring continuations in the batched engine: log p(continuation |
context) of many (context, continuation) pairs, as lm-eval's loglikelihood
requests, LAMBADA and passkey retrieval ask for them.

    scores = score_continuations(model, [(ctx_ids, cont_ids), ...])
    scores[0]   # (log-probability in nats, every continuation token the argmax)

A pair reads its context but the last token in the engine's prompt pieces
(only the slot's state matters there: no logits are kept), then its tail,
the context's last token and the continuation but its last, with every
row's logits (GenState.step all_logits): row i predicts continuation token
i. Pairs that share a context read it once: its state is copied into the
slots of the others (GenState.copy). A pair's pieces are cut from its own
start whatever shares the step, so its score does not depend on the other
pairs (the engine's slots are independent), and it equals the training
forward's log-probabilities to float32 rounding.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from rwkvx_c import _core
from rwkvx_c.errors import SampleError
from rwkvx_c.generation.engine import DEFAULT_BATCH, PROMPT_PIECE, cache_positions

__all__ = ["score_continuations", "LOGIT_BYTES"]

# the most logits an evaluation materialises at once (rows * vocab floats:
# one engine step here, one forward call in rwkvx_c.eval.metrics): the
# memory it holds beyond the model, whatever the corpus or the requests
LOGIT_BYTES = 64 << 20

Pair = tuple[Sequence[int] | np.ndarray, Sequence[int] | np.ndarray]


def score_continuations(model: _core.RxPtModel, pairs: Sequence[Pair],
                        batch_size: int = DEFAULT_BATCH,
                        progress: Callable[[int], object] | None = None
                        ) -> list[tuple[float, bool]]:
    """(log p(continuation | context) in nats, whether every continuation
    token is the greedy choice) of each (context, continuation) pair of
    token ids, in order; up to batch_size pairs share the engine at once.
    An empty continuation scores (0.0, True); a context needs a token.
    progress(k): k more pairs scored."""
    if batch_size < 1:
        raise SampleError("batch_size must be at least 1")
    ctxs = [np.ascontiguousarray(c, np.int32).reshape(-1) for c, _ in pairs]
    conts = [np.ascontiguousarray(c, np.int32).reshape(-1) for _, c in pairs]
    out: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
    todo = [i for i in range(len(pairs)) if len(conts[i])]
    if len(todo) < len(pairs) and progress is not None:
        progress(len(pairs) - len(todo))
    if not todo:
        return out
    if any(not len(ctxs[i]) for i in todo):
        raise SampleError("a continuation is scored after a context of at least one token")
    V = model.config["vocab_size"]
    piece = min(PROMPT_PIECE, _core.head_chunk_rows(V))
    tail = max(1, min(piece, LOGIT_BYTES // (4 * V)))   # rows whose logits one step keeps
    B = min(batch_size, len(todo))
    longest = max(len(ctxs[i]) + len(conts[i]) for i in todo)
    g = _core.GenState(model, B, max_len=cache_positions(
        model, longest, B, "score fewer or shorter requests at once (--batch)"),
        max_tokens=piece)
    # the longest first (a wave's pairs take about as long), one context's pairs together
    todo.sort(key=lambda i: (-len(ctxs[i]), ctxs[i].tobytes()))
    for w in range(0, len(todo), B):
        wave = todo[w:w + B]
        _wave(g, wave, ctxs, conts, piece, tail, out)
        if progress is not None:
            progress(len(wave))
    return out


def _steps(g: _core.GenState, reads: dict[int, np.ndarray], piece: int, all_logits: bool
           ) -> Iterator[tuple[list[tuple[int, int, int]], np.ndarray]]:
    """Every slot of reads (slot -> its tokens) through its tokens, in
    pieces of at most `piece` cut from each slot's start, as many slots a
    step as fit the piece: yields each step's (slot, its first token's
    index in its tokens, count) and logits."""
    left = {k: 0 for k in reads}
    while left:
        moved: list[tuple[int, int, int]] = []
        used = 0
        for k, at in left.items():
            c = min(piece, len(reads[k]) - at)
            if used + c <= piece:
                moved.append((k, at, c))
                used += c
        toks = np.concatenate([reads[k][at:at + c] for k, at, c in moved])
        yield moved, g.step([k for k, _, _ in moved], [c for _, _, c in moved], toks,
                            all_logits=all_logits)
        for k, at, c in moved:
            left[k] = at + c
            if left[k] == len(reads[k]):
                del left[k]


def _wave(g: _core.GenState, wave: list[int], ctxs: list[np.ndarray],
          conts: list[np.ndarray], piece: int, tail: int,
          out: list[tuple[float, bool]]) -> None:
    """The pairs of wave (one slot each) scored into out."""
    lead: dict[bytes, int] = {}   # a context's first slot, which reads it
    for k, i in enumerate(wave):
        g.reset(k)
        lead.setdefault(ctxs[i].tobytes(), k)
    reads = {k: ctxs[wave[k]][:-1] for k in lead.values() if len(ctxs[wave[k]]) > 1}
    for _ in _steps(g, reads, piece, False):
        pass
    for k, i in enumerate(wave):
        g.copy(k, lead[ctxs[i].tobytes()])
    tails = {k: np.concatenate([ctxs[i][-1:], conts[i][:-1]]) for k, i in enumerate(wave)}
    lp = [0.0] * len(wave)
    greedy = [True] * len(wave)
    for moved, logits in _steps(g, tails, tail, True):
        row = 0
        for k, at, c in moved:
            # row j predicts continuation token at + j: its log-softmax in float64
            z = logits[row:row + c].astype(np.float64)
            row += c
            z -= z.max(axis=-1, keepdims=True)
            want = conts[wave[k]][at:at + c]
            lse = np.log(np.exp(z).sum(axis=-1))
            lp[k] += float((z[np.arange(c), want] - lse).sum())
            greedy[k] = greedy[k] and bool(np.all(np.argmax(z, axis=-1) == want))
    for k, i in enumerate(wave):
        out[i] = (lp[k], greedy[k])
