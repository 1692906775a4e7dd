"""Scores of a model on text: loss, perplexity and bits per byte of a
corpus, and RWKV-LM's LAMBADA protocol.

    s = score_windows(model, tokens, 512, token_bytes=tok.token_lengths())
    s["loss"], s["ppl"], s["bpb"]            # nats per token, e^loss, bits per byte
    lam = lambada(model, tok, "lambada_test.jsonl")   # {"acc", "ppl", "docs"}

Windows are scored as the trainer scores its validation windows (each from
a fresh state, targets the inputs shifted by one, rwkvx_c.train.Trainer.
evaluate), so the same windows give the trainer's figures; the maths is
docs/training.md §Evaluation.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from rwkvx_c import _core
from rwkvx_c._core import RxPtModel
from rwkvx_c.data.sampler import IGNORE, count_targets, target_bytes
from rwkvx_c.data.tokenizers import Tokenizer
from rwkvx_c.errors import DataError
from rwkvx_c.generation.score import LOGIT_BYTES, score_continuations

__all__ = ["consecutive_starts", "score_windows", "lambada", "read_lambada",
           "continuation_score", "LOGIT_BYTES"]



def consecutive_starts(n_tokens: int, seq_len: int) -> np.ndarray:
    """Starts of the windows covering every token of an n_tokens stream
    once as a target: 0, T, 2T, ... (each window holds T + 1 tokens; the
    last may be shorter)."""
    if n_tokens < 2:
        raise DataError(f"the corpus has {n_tokens} token(s); scoring needs at least 2")
    return np.arange(0, n_tokens - 1, seq_len, dtype=np.int64)


def _batches(tokens: np.ndarray, starts: np.ndarray, T: int, B: int,
             mask: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(inputs, targets) int32 (b, t) of the windows at starts, b <= B,
    windows of one length together (a short last window alone); with a
    chat corpus's mask, an untrained target is IGNORE."""
    n = len(tokens)
    i = 0
    while i < len(starts):
        t = min(T, n - 1 - int(starts[i]))
        j = i + 1
        while j < len(starts) and j - i < B and min(T, n - 1 - int(starts[j])) == t:
            j += 1
        win = np.stack([np.asarray(tokens[o:o + t + 1]) for o in starts[i:j]]).astype(np.int32)
        y = win[:, 1:]
        if mask is not None:
            keep = np.stack([np.asarray(mask[o + 1:o + t + 1]) for o in starts[i:j]])
            y = np.where(keep.astype(bool), y, np.int32(IGNORE))
        yield np.ascontiguousarray(win[:, :t]), np.ascontiguousarray(y, dtype=np.int32)
        i = j


def score_windows(model: RxPtModel, tokens: np.ndarray, seq_len: int,
                  starts: np.ndarray | None = None, *, token_bytes: np.ndarray | None = None,
                  is_bytes: bool = False, batch: int = 8,
                  progress: Callable[[int], object] | None = None,
                  mask: np.ndarray | None = None) -> dict[str, Any]:
    """Loss of model on the windows of tokens at starts (default: every
    token once, consecutive_starts), streamed batch by batch: the corpus
    stays memory-mapped and at most LOGIT_BYTES of logits exist at once.

    Returns {"loss": mean nats per target token, "ppl": e^loss, "bpb": the
    summed loss / (ln 2 * the UTF-8 bytes the targets decode to) (None when
    unknown), "tokens", "bytes", "windows"}. progress(k) hears of k more
    target tokens scored. mask: a chat corpus's (rwkvx_c.data.chat): only
    the assistant tokens are scored, as the trainer scores them."""
    T = int(seq_len)
    if starts is None:
        starts = consecutive_starts(len(tokens), T)
    V = model.config["vocab_size"]
    B = max(1, min(int(batch), LOGIT_BYTES // (4 * T * V)))
    total, n, nbytes = 0.0, 0, 0
    for x, y in _batches(tokens, starts, T, B, mask):
        scored = y[y != IGNORE]
        if scored.size and (int(scored.max()) >= V or int(scored.min()) < 0):
            raise DataError(f"the corpus holds token id {int(scored.max())}, outside the "
                            f"model's vocabulary of {V}")
        logits = model.forward(x)
        # the trainer's reduction (Trainer.evaluate): the C mean times the count
        k = count_targets(y)
        total += _core.cross_entropy_forward(logits.reshape(-1, V), y.reshape(-1),
                                             IGNORE) * k
        n += k
        nbytes += target_bytes(y, token_bytes, is_bytes) or 0
        if progress is not None:
            progress(y.size)
    if n == 0:
        raise DataError("the windows hold no assistant token to score")
    loss = total / n
    bpb = total / (math.log(2) * nbytes) if nbytes else None
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "bpb": bpb, "tokens": n,
            "bytes": nbytes or None, "windows": len(starts)}


def continuation_score(model: RxPtModel, context: Sequence[int], continuation: Sequence[int]
                       ) -> tuple[float, bool]:
    """(log p(continuation | context) in nats, whether every continuation
    token is the argmax): one pair of score_continuations."""
    return score_continuations(model, [(context, continuation)])[0]


def read_lambada(path: str) -> list[tuple[str, str]]:
    """(context, " " + last word) of each record {"text": ...} of a LAMBADA
    .jsonl, split at the last space as RWKV-LM and lm-eval split it."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (ValueError, KeyError, TypeError):
                    raise DataError(f"{path}:{i}: not a JSON record with a \"text\" string") \
                        from None
                if not isinstance(text, str) or " " not in text.strip():
                    raise DataError(f"{path}:{i}: the text has no last word to predict")
                ctx, word = text.rsplit(" ", 1)
                out.append((ctx, " " + word))
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    if not out:
        raise DataError(f"{path} holds no records")
    return out


def lambada(model: RxPtModel, tok: Tokenizer, path: str, prefix: int = 0,
            progress: Callable[[int], object] | None = None) -> dict[str, Any]:
    """RWKV-LM's LAMBADA: for each document, [prefix] + the context, then
    the last word; accuracy counts a document when every target token is
    the greedy choice, perplexity is exp(-mean over documents of the
    target's log-likelihood)."""
    docs = read_lambada(path)
    scores = score_continuations(model, [([prefix] + tok.encode(ctx).tolist(),
                                          tok.encode(word).tolist()) for ctx, word in docs],
                                 progress=progress)
    total = sum(lp for lp, _ in scores)
    correct = sum(greedy for _, greedy in scores)
    return {"acc": correct / len(docs), "ppl": math.exp(-total / len(docs)), "docs": len(docs)}
