"""Prompt data (--objective grpo): prompts the policy completes, each with
the columns its rewards read (docs/finetune.md §GRPO).

A record (a .jsonl / .jsonl.gz line, or a row of a table: .parquet,
.arrow, a datasets folder) is a prompt in TRL's forms or SFT's:

    {"prompt": "What is 2+3?", "answer": "5"}                  # text (system optional)
    {"prompt": [{"role": "user", "content": "What is 2+3?"}], "answer": "5"}
    {"messages": [{"role": "user", "content": "What is 2+3?"}], "answer": "5"}

A ``messages`` list may end with an assistant turn (an SFT record): that
turn is dropped, the conversation before it is the prompt. The prompt is
rendered as SFT renders a conversation (rwkvx_c.data.chat): SEPARATOR,
then the turns up to ``Assistant:``, where the completion begins. Every
other field of the record is a column the rewards receive as a keyword
argument. The last VAL_FRACTION of the records (at least one) are held
out for evaluation.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rwkvx_c.data.chat import SEPARATOR, segments
from rwkvx_c.data.formats import records
from rwkvx_c.data.preferences import held_out_start
from rwkvx_c.data.sources import source_files
from rwkvx_c.errors import DataError

if TYPE_CHECKING:
    from rwkvx_c.data.tokenizers import Tokenizer

__all__ = ["Prompts", "read_prompts", "split_prompts", "PROMPT_KEYS"]

PROMPT_KEYS = ("prompt", "messages", "system")   # the prompt's fields; the rest are columns


@dataclass
class Prompts:
    """Encoded prompts. ids: each prompt's token ids (SEPARATOR first);
    prompts: each record's prompt as given (a string or a list of
    messages), what a reward receives; columns: each record's other
    fields; where: each record's file:line."""
    ids: list[list[int]]
    prompts: list[Any]
    columns: list[dict[str, Any]]
    where: list[str]
    description: str

    def __len__(self) -> int:
        return len(self.ids)

    def vocab_size(self) -> int:
        return max((max(i) for i in self.ids), default=0) + 1

    def longest(self) -> int:
        return max(len(i) for i in self.ids)

    def subset(self, lo: int, hi: int) -> Prompts:
        return Prompts(self.ids[lo:hi], self.prompts[lo:hi], self.columns[lo:hi],
                       self.where[lo:hi], self.description)


def _conversation(rec: object, where: str) -> tuple[dict[str, Any], Any]:
    """(an SFT chat record whose last assistant turn is a placeholder, the
    prompt as a reward sees it) of a prompt record."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: a prompt record is an object with a prompt or messages")
    prompt = rec.get("prompt", rec.get("messages"))
    if isinstance(prompt, list):
        msgs = list(prompt)
        if "prompt" not in rec and msgs and isinstance(msgs[-1], dict) \
                and msgs[-1].get("role") == "assistant":
            msgs = msgs[:-1]   # an SFT record: its answer is not the prompt
        if not msgs:
            raise DataError(f"{where}: the prompt has no message")
        return {"messages": msgs + [{"role": "assistant", "content": "x"}]}, msgs
    if isinstance(prompt, str):
        conv: dict[str, Any] = {"prompt": prompt, "response": "x"}
        if rec.get("system") is not None:
            conv["system"] = rec["system"]
        return conv, prompt
    raise DataError(f"{where}: no prompt (a 'prompt' string or list of messages, or "
                    "'messages')")


def read_prompts(paths: str | list[str] | None, tok: Tokenizer) -> Prompts:
    """Every prompt record of the files at paths, encoded. DataError naming
    the record for one that is no prompt."""
    if paths is None:
        raise DataError("--objective grpo needs --data: prompt records (.jsonl or a table) "
                        "with a prompt or messages, and the columns the rewards read")
    ids, prompts, columns, wheres = [], [], [], []
    digest = hashlib.sha256()
    for src in source_files([paths] if isinstance(paths, str) else paths):
        if src[2] == "text":
            raise DataError(f"{src[1]}: prompt data is .jsonl records or a table")
        for where, rec in records(src):
            conv, prompt = _conversation(rec, where)
            pieces = [t for t, _ in segments(conv, where)[:-1]]
            digest.update("\0".join(pieces).encode("utf-8", "surrogatepass") + b"\1")
            enc = tok.encode_docs([t.encode("utf-8", "surrogatepass") for t in pieces])
            ids.append([SEPARATOR] + [int(i) for part in enc for i in part])
            prompts.append(prompt)
            assert isinstance(rec, dict)
            columns.append({k: v for k, v in rec.items() if k not in PROMPT_KEYS})
            wheres.append(where)
    if not ids:
        raise DataError("the prompt data holds no record")
    keys = set(columns[0])
    for c, w in zip(columns, wheres):
        if set(c) != keys:   # a reward reads one list per column: every record has them all
            raise DataError(f"{w}: has the columns {sorted(c)}, the first record "
                            f"{sorted(keys)}")
    return Prompts(ids, prompts, columns, wheres,
                   f"{len(ids)} prompts, sha256 {digest.hexdigest()[:16]}")


def split_prompts(p: Prompts) -> tuple[Prompts, Prompts]:
    """(train, val): the last VAL_FRACTION of the prompts, at least one, are val."""
    k = held_out_start(len(p), "prompt data")
    return p.subset(0, k), p.subset(k, len(p))
