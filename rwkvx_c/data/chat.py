"""Chat / instruction data (SFT): records rendered in RWKV's chat format,
with the mask of the tokens the loss is taken on (docs/finetune.md §Chat data).

A ``.jsonl`` / ``.jsonl.gz`` file is chat data when its first record holds
``messages`` or both ``prompt`` and ``response`` (``is_chat_file``):

    {"messages": [{"role": "system", "content": "Be terse."},
                  {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}]}
    {"prompt": "Hi", "response": "Hello.", "system": "Be terse."}   # system optional

rendered as ``System: Be terse.\\n\\nUser: Hi\\n\\nAssistant: Hello.\\n\\n``:
each turn ``Role: content`` closed by a blank line, the content with its
line ends made ``\\n``, runs of newlines made one and its ends stripped, as
the ``rwkv`` package's API_DEMO_CHAT prepares a message (a blank line inside
a turn would end it: generation stops at ``\\n\\n``). The loss is taken on
each assistant turn's `` content\\n\\n`` (its text and its turn end), nothing
else. The text is encoded in segments cut where an assistant turn's text
begins and ends, as a chat encodes it: the prompt up to ``Assistant:`` in
one piece, the reply as the model writes it.

Conversations are packed one after another, each followed by SEPARATOR
(id 0, the end-of-text RWKV-LM packs documents with); neither the
separator nor the first token after it (always a prompt token) is ever a
target, so no counted target is predicted from a token of another
conversation.
"""
from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from rwkvx_c.data.formats import MAX_LINE_BYTES, read_jsonl
from rwkvx_c.data.sources import Source
from rwkvx_c.errors import DataError

if TYPE_CHECKING:
    from rwkvx_c.data.tokenizers import Tokenizer

__all__ = ["SEPARATOR", "IGNORE", "ROLES", "is_chat_record", "is_chat_file", "normalise",
           "segments", "render", "encode_chat"]

SEPARATOR = 0          # between conversations: the World vocabulary's end-of-text
IGNORE = 2 ** 31 - 1   # the target id of a position the loss leaves out (never a token id)
ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
BATCH_BYTES = 4 << 20  # conversations encoded together (the encoders' threads see many)
_NEWLINES = re.compile(r"\n+")

# (text, trained) pieces of one conversation
Segments = list[tuple[str, bool]]


def is_chat_record(rec: object) -> bool:
    """True for a record holding messages, or a prompt and a response."""
    return isinstance(rec, dict) and ("messages" in rec or ("prompt" in rec and "response" in rec))


def is_chat_file(src: Source) -> bool:
    """True when the first record of a .jsonl source is a chat record (a
    file that cannot be read or parsed is left to the text reader, whose
    error names the line)."""
    _, path, kind = src
    if kind not in ("jsonl", "jsonl.gz"):
        return False
    try:
        with open(path, "rb") as raw:
            fh = gzip.GzipFile(fileobj=raw) if kind == "jsonl.gz" else raw
            while True:
                line = fh.readline(MAX_LINE_BYTES + 1)
                if not line:
                    return False
                if line.strip():
                    return is_chat_record(json.loads(line))
    except (OSError, EOFError, ValueError, RecursionError):
        return False


def normalise(text: str) -> str:
    """A turn's content as it is rendered: \\r\\n and \\r made \\n, runs of
    newlines made one, the ends stripped."""
    return _NEWLINES.sub("\n", text.replace("\r\n", "\n").replace("\r", "\n")).strip()


def _turns(rec: dict, where: str) -> list[tuple[str, str]]:
    """(role, content) of a record, each checked."""
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise DataError(f"{where}: messages must be a non-empty list of "
                            '{"role": ..., "content": ...}')
        out = []
        for i, m in enumerate(msgs):
            role = m.get("role") if isinstance(m, dict) else None
            if role not in ROLES:
                raise DataError(f"{where}: message {i} has role {role!r}; roles are "
                                f"{', '.join(ROLES)}")
            out.append((role, m.get("content")))
    else:
        out = [("user", rec["prompt"]), ("assistant", rec["response"])]
        if rec.get("system") is not None:
            out.insert(0, ("system", rec["system"]))
    turns = []
    for i, (role, content) in enumerate(out):
        if not isinstance(content, str) or not normalise(content):
            raise DataError(f"{where}: the {role} turn (message {i}) has no text content")
        turns.append((role, normalise(content)))
    if not any(role == "assistant" for role, _ in turns):
        raise DataError(f"{where}: no assistant turn: nothing to train on")
    return turns


def segments(rec: object, where: str) -> Segments:
    """The (text, trained) pieces of a chat record, in order; DataError
    naming `where` (file:line) for a record that does not fit."""
    if not is_chat_record(rec):
        raise DataError(f"{where}: not a chat record (messages, or prompt and response)")
    assert isinstance(rec, dict)
    out: Segments = []
    prompt = ""
    for role, content in _turns(rec, where):
        if role == "assistant":
            out.append((prompt + "Assistant:", False))
            out.append((" " + content + "\n\n", True))
            prompt = ""
        else:
            prompt += f"{ROLES[role]}: {content}\n\n"
    if prompt:   # turns after the last assistant turn: context with no target
        out.append((prompt, False))
    return out


def render(rec: object, where: str = "record") -> str:
    """The text of a chat record as the model reads it."""
    return "".join(text for text, _ in segments(rec, where))


def _chat_records(src: Source, progress: Callable[[int], object] | None
                  ) -> Iterator[tuple[str, Segments]]:
    """(file:line, segments) of every record of src; progress(n) is called
    with the source bytes read."""
    _, path, kind = src
    for n, rec in read_jsonl(path, kind, progress):
        yield f"{path}:{n}", segments(rec, f"{path}:{n}")


def encode_chat(src: Source, tok: Tokenizer, write: Callable[[np.ndarray, np.ndarray], None],
                progress: Callable[[int], object] | None = None) -> tuple[int, int]:
    """Encode every conversation of src with tok, calling write(ids, mask)
    for each (the separator included; mask 1 on the trained tokens).
    Returns (conversations, trained tokens)."""
    batch: list[tuple[str, Segments]] = []
    size = 0
    convs = trained = 0

    def flush() -> None:
        nonlocal batch, size, convs, trained
        pieces = [text.encode("utf-8", "surrogatepass") for _, segs in batch for text, _ in segs]
        ids = iter(tok.encode_docs(pieces))
        for where, segs in batch:
            parts = [np.asarray(next(ids), np.int64) for _ in segs]
            mask = np.concatenate([np.full(len(p), t, np.uint8) for p, (_, t) in
                                   zip(parts, segs)] + [np.zeros(1, np.uint8)])
            packed = np.concatenate(parts + [np.array([SEPARATOR], np.int64)])
            if not mask.any():   # an assistant turn no token encodes
                raise DataError(f"{where}: its assistant turns encode to no token")
            if np.any(packed[:-1] == SEPARATOR):   # a NUL byte, with the byte tokenizer
                raise DataError(f"{where}: its text encodes to id {SEPARATOR}, which separates "
                                "conversations; remove that character")
            write(packed, mask)
            convs += 1
            trained += int(mask.sum())
        batch, size = [], 0

    for where, segs in _chat_records(src, progress):
        batch.append((where, segs))
        size += sum(len(t) for t, _ in segs)
        if size >= BATCH_BYTES:
            flush()
    flush()
    return convs, trained
