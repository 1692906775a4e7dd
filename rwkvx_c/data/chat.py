"""Chat / instruction data (SFT): records rendered in RWKV's chat format,
with the mask of the tokens the loss is taken on (docs/finetune.md §Chat data).

A ``.jsonl`` / ``.jsonl.gz`` file or a table (``.parquet``, ``.arrow``, a
``datasets`` folder: rwkvx_c.data.tables) is chat data when its first
record is in one of four formats (``is_chat_file``):

    {"messages": [{"role": "system", "content": "Be terse."},       # OpenAI
                  {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}]}
    {"conversations": [{"from": "system", "value": "Be terse."},    # ShareGPT
                       {"from": "human", "value": "Hi"},
                       {"from": "gpt", "value": "Hello."}]}
    {"prompt": "Hi", "response": "Hello.", "system": "Be terse."}   # system optional
    {"instruction": "Hi", "input": "", "output": "Hello.",          # Alpaca; input,
     "system": "Be terse."}                                         # system, history optional

Every format is normalised to one record type, a list of ``Turn(role,
content)`` (``turns``), and only that is rendered, so the same
conversation gives the same tokens and masks in any format. ShareGPT's
``human``/``gpt``/``system`` are the roles user/assistant/system; Alpaca's
user turn is the instruction, then a newline and the input when there is
one (LLaMA-Factory's convention), after ``history``'s [instruction,
output] pairs as earlier turns. Turns are rendered with a chat template
(rwkvx_c.data.templates, ChatFormat; --chat-template), by default RWKV's,
``System: Be terse.\\n\\nUser: Hi\\n\\nAssistant: Hello.\\n\\n``:
each turn ``Role: content`` closed by a blank line, the content with its
line ends made ``\\n``, runs of newlines made one and its ends stripped, as
the ``rwkv`` package's API_DEMO_CHAT prepares a message (a blank line inside
a turn would end it: generation stops at ``\\n\\n``). The loss is taken on
each assistant turn's `` content\\n\\n`` (its text and its turn end), nothing
else (every token with --train-on-inputs). The text is encoded in segments
cut where an assistant turn's text begins and ends, as a chat encodes it:
the prompt up to ``Assistant:`` (the template's generation prompt) in one
piece, the reply as the model writes it.

Conversations are packed one after another, each followed by SEPARATOR
(id 0, the end-of-text RWKV-LM packs documents with); neither the
separator nor the first token after it (always a prompt token) is ever a
target, so no counted target is predicted from a token of another
conversation.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from rwkvx_c.data.formats import records
from rwkvx_c.data.sources import Source
from rwkvx_c.data.templates import BUILTIN, DEFAULT_TEMPLATE, ChatTemplate, builtin
from rwkvx_c.errors import DataError

if TYPE_CHECKING:
    from rwkvx_c.data.tokenizers import Tokenizer

__all__ = ["SEPARATOR", "IGNORE", "ROLES", "Turn", "turns", "CHAT_COLUMNS", "is_chat_record",
           "is_chat_file", "normalise", "segments", "render", "encode_chat", "ChatFormat"]

SEPARATOR = 0          # between conversations: the World vocabulary's end-of-text
IGNORE = 2 ** 31 - 1   # the target id of a position the loss leaves out (never a token id)
ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
BATCH_BYTES = 4 << 20  # conversations encoded together (the encoders' threads see many)
_NEWLINES = re.compile(r"\n+")

# (text, trained) pieces of one conversation
Segments = list[tuple[str, bool]]


class Turn(NamedTuple):
    """One turn of a conversation, the one record type every chat format is
    normalised to (``turns``) before it is rendered."""
    role: str      # "system", "user" or "assistant" (ROLES)
    content: str   # as given (the template prepares it), never blank


# (the key that marks a format, the other keys it needs) in the order they are tried
FORMATS = (("messages", ()), ("conversations", ()), ("prompt", ("response",)),
           ("instruction", ("output",)))
# the columns a table (parquet, arrow) holding chat records is read with
CHAT_COLUMNS = ("messages", "conversations", "prompt", "response", "system", "instruction",
                "input", "output", "history")
# ShareGPT's speakers (``from``) as roles; "user" and "assistant" are taken too
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "system": "system"}


def is_chat_record(rec: object) -> bool:
    """True for a record of a chat format: messages, conversations (ShareGPT),
    a prompt and a response, or an instruction and an output (Alpaca)."""
    return isinstance(rec, dict) and any(
        key in rec and all(k in rec for k in need) for key, need in FORMATS)


def is_chat_file(src: Source) -> bool:
    """True when the first record of a .jsonl or table source is a chat
    record (a file that cannot be read or parsed is left to the text
    reader, whose error names the line)."""
    if src[2] == "text":
        return False
    try:
        for _, rec in records(src, columns=CHAT_COLUMNS):
            return is_chat_record(rec)
    except (DataError, OSError, EOFError, ValueError, RecursionError):
        return False
    return False


def normalise(text: str) -> str:
    """A turn's content as it is rendered: \\r\\n and \\r made \\n, runs of
    newlines made one, the ends stripped."""
    return _NEWLINES.sub("\n", text.replace("\r\n", "\n").replace("\r", "\n")).strip()


# the formats that list turns: key -> (the speaker field, the text field,
# the speakers as roles, the one line naming a turn of an unknown speaker)
LISTS = {
    "messages": ("role", "content", {r: r for r in ROLES},
                 "message {i} has role {v!r}; roles are {names}"),
    "conversations": ("from", "value", SHAREGPT_ROLES,
                      "conversation turn {i} is from {v!r}; ShareGPT speakers are {names}"),
}


def _raw_turns(rec: dict, where: str) -> list[tuple[str, object]]:
    """(role, content) of a record in any chat format, roles checked."""
    for key, (who, text, roles, unknown) in LISTS.items():
        if key not in rec:
            continue
        listed = rec[key]
        if not isinstance(listed, list) or not listed:
            raise DataError(f'{where}: {key} must be a non-empty list of {{"{who}": ..., '
                            f'"{text}": ...}}')
        out: list[tuple[str, object]] = []
        for i, m in enumerate(listed):
            v = m.get(who) if isinstance(m, dict) else None
            if not isinstance(v, str) or v not in roles:
                raise DataError(f"{where}: " + unknown.format(i=i, v=v, names=", ".join(roles)))
            out.append((roles[v], m.get(text)))
        return out
    if "prompt" in rec and "response" in rec:   # the format is_chat_record matched
        pairs = [(rec["prompt"], rec["response"])]
    else:   # Alpaca: the input follows the instruction on the next line
        query = rec.get("input")
        user = rec["instruction"]
        if isinstance(user, str) and isinstance(query, str) and query.strip():
            user = user + "\n" + query
        elif query is not None and not isinstance(query, str):
            raise DataError(f"{where}: input must be text, got {type(query).__name__}")
        history = rec.get("history") or []
        if not isinstance(history, list) or not all(
                isinstance(h, (list, tuple)) and len(h) == 2 for h in history):
            raise DataError(f"{where}: history must be a list of [instruction, output] pairs")
        pairs = [(h[0], h[1]) for h in history] + [(user, rec["output"])]
    out = [("system", rec["system"])] if rec.get("system") is not None else []
    for u, a in pairs:
        out += [("user", u), ("assistant", a)]
    return out


def turns(rec: object, where: str) -> list[Turn]:
    """The turns of a chat record in any of its formats (the module doc),
    each checked; DataError naming `where` (file:line) for one that does
    not fit."""
    if not is_chat_record(rec):
        raise DataError(f"{where}: not a chat record (messages, conversations, prompt and "
                        "response, or instruction and output)")
    assert isinstance(rec, dict)
    out = []
    for i, (role, content) in enumerate(_raw_turns(rec, where)):
        if not isinstance(content, str) or not normalise(content):
            raise DataError(f"{where}: the {role} turn (message {i}) has no text content")
        out.append(Turn(role, content))
    if not any(t.role == "assistant" for t in out):
        raise DataError(f"{where}: no assistant turn: nothing to train on")
    return out


def segments(rec: object, where: str, template: ChatTemplate | None = None,
             train_on_inputs: bool = False) -> Segments:
    """The (text, trained) pieces of a chat record, in order, rendered with
    template (RWKV's when None; rwkvx_c.data.templates); train_on_inputs:
    every piece trained. DataError naming `where` (file:line) for a record
    that does not fit."""
    messages = [{"role": t.role, "content": t.content} for t in turns(rec, where)]
    return (template or _rwkv()).segments(messages, where, train_on_inputs)


@functools.lru_cache(maxsize=1)
def _rwkv() -> ChatTemplate:
    return builtin()


def render(rec: object, where: str = "record", template: ChatTemplate | None = None) -> str:
    """The text of a chat record as the model reads it."""
    return "".join(text for text, _ in segments(rec, where, template))


def _chat_records(src: Source, progress: Callable[[int], object] | None,
                  chat: ChatFormat) -> Iterator[tuple[str, Segments]]:
    """(where, segments) of every record of src; progress(n) is called
    with the source bytes read."""
    for where, rec in records(src, progress, CHAT_COLUMNS):
        yield where, segments(rec, where, chat.template, chat.train_on_inputs)


class ChatFormat(NamedTuple):
    """How chat records become training tokens: the template (None: RWKV's)
    and whether the prompt's tokens are trained too (--train-on-inputs)."""
    template: ChatTemplate | None = None
    train_on_inputs: bool = False

    def identity(self) -> str | None:
        """What a token cache keys on; None for the default format."""
        if self.template is None or self.template.source == BUILTIN[DEFAULT_TEMPLATE]:
            return "inputs" if self.train_on_inputs else None
        return self.template.identity() + ("+inputs" if self.train_on_inputs else "")


def encode_chat(src: Source, tok: Tokenizer, write: Callable[[np.ndarray, np.ndarray], None],
                progress: Callable[[int], object] | None = None,
                chat: ChatFormat | None = None) -> tuple[int, int]:
    """Encode every conversation of src with tok and chat's template,
    calling write(ids, mask) for each (the separator included; mask 1 on
    the trained tokens, never the first). Returns (conversations, trained
    tokens)."""
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
            mask[0] = 0   # predicted from the previous conversation's separator
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

    for where, segs in _chat_records(src, progress, chat or ChatFormat()):
        batch.append((where, segs))
        size += sum(len(t) for t, _ in segs)
        if size >= BATCH_BYTES:
            flush()
    flush()
    return convs, trained
