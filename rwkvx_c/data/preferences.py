"""Preference data (DPO and its relatives): pairs of a prompt with a chosen
and a rejected completion, rendered in the chat format SFT uses
(rwkvx_c.data.chat), with the loss taken on the completion's tokens alone
(docs/finetune.md §Preference tuning).

A ``.jsonl`` / ``.jsonl.gz`` record is a pair in either of TRL's forms:

    {"prompt": "Hi", "chosen": "Hello.", "rejected": "Go away."}
    {"prompt": [{"role": "user", "content": "Hi"}],
     "chosen": [{"role": "assistant", "content": "Hello."}],
     "rejected": [{"role": "assistant", "content": "Go away."}]}

The text form is the conversation ``User: Hi`` then ``Assistant: Hello.``
(a ``system`` field is optional); the conversational form's prompt is any
list of messages and each completion one assistant message. Either way a
sequence is SEPARATOR, the prompt's tokens up to ``Assistant:``, then the
completion's `` content\\n\\n``, encoded in those segments as SFT encodes
them; the targets are IGNORE everywhere but on the completion.

The last VAL_FRACTION of the pairs (at least one) are held out for
evaluation; the pairs are read in file order.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rwkvx_c.data.chat import IGNORE, SEPARATOR, normalise, segments
from rwkvx_c.data.formats import read_jsonl
from rwkvx_c.data.sources import source_files
from rwkvx_c.errors import DataError
from rwkvx_c.model import memory

if TYPE_CHECKING:
    from rwkvx_c.data.tokenizers import Tokenizer

__all__ = ["Pairs", "is_preference_record", "pair_segments", "read_pairs", "split_pairs",
           "PairSampler", "VAL_FRACTION", "held_out_start"]

VAL_FRACTION = 0.05
FIELDS = ("prompt", "chosen", "rejected")


def is_preference_record(rec: object) -> bool:
    """True for a record holding a prompt, a chosen and a rejected completion."""
    return isinstance(rec, dict) and all(k in rec for k in FIELDS)


def _completion(value: object, which: str, where: str) -> str:
    """The text of a completion: a string, or a list of one assistant message."""
    if isinstance(value, list):
        if len(value) != 1 or not isinstance(value[0], dict) \
                or value[0].get("role") != "assistant":
            raise DataError(f"{where}: {which} must be a string or a list of one assistant "
                            "message")
        value = value[0].get("content")
    if not isinstance(value, str):
        raise DataError(f"{where}: {which} has no text content")
    return value


def pair_segments(rec: object, where: str) -> tuple[list[str], str, str]:
    """(prompt pieces, chosen text, rejected text) of a preference record
    as the model reads them: the prompt's pieces as SFT encodes them (cut
    where an earlier assistant turn begins and ends), the last ending with
    ``Assistant:``; each completion is `` content\\n\\n``. DataError naming `where` for a record
    that does not fit, an empty completion included."""
    if not is_preference_record(rec):
        raise DataError(f"{where}: not a preference record (prompt, chosen and rejected)")
    assert isinstance(rec, dict)
    out = []
    for which in ("chosen", "rejected"):
        text = _completion(rec[which], which, where)
        if not normalise(text):
            raise DataError(f"{where}: the {which} completion is empty")
        if isinstance(rec["prompt"], list):
            conv: dict[str, Any] = {"messages": rec["prompt"] + [
                {"role": "assistant", "content": text}]}
        else:
            conv = {"prompt": rec["prompt"], "response": text}
            if rec.get("system") is not None:
                conv["system"] = rec["system"]
        segs = segments(conv, where)
        # the completion is the last trained piece; earlier assistant turns are prompt
        out.append(([t for t, _ in segs[:-1]], segs[-1][0]))
    if out[0][0] != out[1][0]:   # cannot happen: the same prompt rendered twice
        raise DataError(f"{where}: the prompt renders differently for its two completions")
    return out[0][0], out[0][1], out[1][1]


@dataclass
class Pairs:
    """Encoded pairs. x, y: (n, 2, seq_len) int32, [pair][chosen 0 / rejected
    1][position]: the input tokens (SEPARATOR-padded) and the targets (IGNORE
    but on the completion); n_tokens: (n, 2) the completion's token counts;
    where: each pair's file:line."""
    x: np.ndarray
    y: np.ndarray
    n_tokens: np.ndarray
    where: list[str]
    description: str

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def vocab_size(self) -> int:
        return int(self.x.max()) + 1 if len(self) else 1


def read_pairs(paths: str | list[str] | None, tok: Tokenizer, seq_len: int) -> Pairs:
    """Every preference record of the .jsonl / .jsonl.gz files at paths,
    encoded for windows of seq_len targets. DataError naming the record for
    one that is not a pair, whose completion encodes to no token, or whose
    sequence does not fit the window."""
    if paths is None:
        raise DataError("preference tuning needs --data: .jsonl records with prompt, chosen "
                        "and rejected")
    files = source_files([paths] if isinstance(paths, str) else paths)
    seqs: list[tuple[list[int], list[int], list[int]]] = []   # prompt, chosen, rejected
    wheres = []
    digest = hashlib.sha256()
    for _, path, kind in files:
        if kind not in ("jsonl", "jsonl.gz"):
            raise DataError(f"{path}: preference data is .jsonl or .jsonl.gz records")
        for n, rec in read_jsonl(path, kind):
            where = f"{path}:{n}"
            pieces, chosen, rejected = pair_segments(rec, where)
            texts = pieces + [chosen, rejected]
            digest.update("\0".join(texts).encode("utf-8", "surrogatepass") + b"\1")
            ids = tok.encode_docs([t.encode("utf-8", "surrogatepass") for t in texts])
            prompt = [SEPARATOR] + [int(i) for part in ids[:len(pieces)] for i in part]
            comps = []
            for j, which in enumerate(("chosen", "rejected")):
                comp = [int(i) for i in ids[len(pieces) + j]]
                if not comp:
                    raise DataError(f"{where}: the {which} completion encodes to no token")
                if len(prompt) + len(comp) - 1 > seq_len:
                    raise DataError(f"{where}: the {which} sequence has "
                                    f"{len(prompt) + len(comp) - 1} targets, more than "
                                    f"--seq-len {seq_len}; raise --seq-len or shorten the record")
                comps.append(comp)
            seqs.append((prompt, comps[0], comps[1]))
            wheres.append(where)
    if not seqs:
        raise DataError("the preference data holds no record")
    # the windows (x, y int32 [P, 2, T]) are allocated once, checked first: a
    # --seq-len far beyond the records would otherwise fill memory per record
    memory.check(2 * 2 * 4 * len(seqs) * seq_len, f"the windows of {len(seqs):,} preference "
                 f"pairs at --seq-len {seq_len:,}", "lower --seq-len")
    x = np.full((len(seqs), 2, seq_len), SEPARATOR, np.int32)
    y = np.full((len(seqs), 2, seq_len), IGNORE, np.int32)
    counts = np.zeros((len(seqs), 2), np.int64)
    for i, (prompt, *comps) in enumerate(seqs):
        for j, comp in enumerate(comps):
            seq = prompt + comp
            x[i, j, :len(seq) - 1] = seq[:-1]
            y[i, j, len(prompt) - 1:len(seq) - 1] = comp
            counts[i, j] = len(comp)
    desc = f"{len(seqs)} preference pairs, sha256 {digest.hexdigest()[:16]}"
    return Pairs(x, y, counts, wheres, desc)


def held_out_start(n: int, what: str) -> int:
    """Where the held-out last VAL_FRACTION (at least one) of n records
    begins; DataError for fewer than 2 (`what`: "preference data", "pair")."""
    if n < 2:
        raise DataError(f"the {what} has {n}: too few for a training and a validation "
                        "split (at least 2)")
    return n - max(1, int(n * VAL_FRACTION))


def split_pairs(p: Pairs) -> tuple[Pairs, Pairs]:
    """(train, val): the last VAL_FRACTION of the pairs, at least one, are val."""
    k = held_out_start(len(p), "preference data")
    return (Pairs(p.x[:k], p.y[:k], p.n_tokens[:k], p.where[:k], p.description),
            Pairs(p.x[k:], p.y[k:], p.n_tokens[k:], p.where[k:], p.description))


class PairSampler:
    """Batches of `pairs` pair indices out of n, in a seeded order
    reshuffled each epoch (next_indices()). state()/set_state() capture the
    epoch and position, so a resumed run draws the same batches."""

    def __init__(self, n: int, pairs: int, seed: int) -> None:
        self.n, self.pairs, self.seed = n, pairs, seed
        self.epoch, self.pos = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)

    def next_indices(self) -> np.ndarray:
        out = np.empty(self.pairs, np.int64)
        for i in range(self.pairs):
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._shuffle()
            out[i] = self._order[self.pos]
            self.pos += 1
        return out

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos}

    def set_state(self, st: dict[str, Any]) -> None:
        epoch, pos = int(st["epoch"]), int(st["pos"])
        if not (epoch >= 0 and 0 <= pos <= self.n):
            raise ValueError(f"epoch {epoch}, position {pos} of {self.n} pairs")
        self.epoch, self.pos = epoch, pos
        self._order = self._shuffle()
