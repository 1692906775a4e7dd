"""The token cache: a corpus tokenised once, then memory-mapped.

``cached_tokens`` writes CACHE/tok-KEY/{train,val}.tok (uint8, uint16 or
uint32 by vocabulary size) and spans.npy, where each source's tokens lie in
them; all.tok (every source's tokens in source order, for the tail split
of a corpus whose file split leaves a side shorter than a window) is made
from those on first use. A chat corpus (rwkvx_c.data.chat) also writes
{train,val}.mask, one uint8 per token (1: a token the loss is taken on),
and all.mask beside all.tok, so a later run reads its masks from the cache.
CACHE is $RWKVX_CACHE, else $XDG_CACHE_HOME/rwkvx_c, else ~/.cache/rwkvx_c.
KEY hashes the layout version, the tokenizer's identity (name + vocabulary
SHA-256), the text field, a chat corpus's template and --train-on-inputs
(when not the default) and every source file's path, size and
modification time (size+mtime, not content: hashing a corpus of many GB on
every start would cost as much as reading it); change any of them and the
cache is rebuilt.

The pass writes into a temporary folder renamed into place only when
complete, so an interrupted pass leaves nothing a later run would use; the
temporary of a killed pass (its writer's PID dead) is removed at the next
load (rwkvx_c.util.atomic.sweep_orphans).

Memory: documents are encoded in batches of at most BATCH_BYTES, a longer
document in pieces (rwkvx_c.data.formats.PIECE_BYTES; exact for byte and
trie tokenizers, whose pieces are cut where no token can cross), so peak
memory does not grow with the corpus. Encoding is parallel over the
documents of a batch and within a long piece (the C trie's threads, the
tokenizers library's own).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from rwkvx_c.data import formats
from rwkvx_c.data.chat import ChatFormat, encode_chat, is_chat_file
from rwkvx_c.data.formats import iter_documents, memmap
from rwkvx_c.data.sources import Source, is_val_file
from rwkvx_c.errors import DataError
from rwkvx_c.util.atomic import replacing, sweep_orphans

if TYPE_CHECKING:
    from rwkvx_c.data.tokenizers import Tokenizer

__all__ = ["BATCH_BYTES", "CachedTokens", "cached_tokens", "default_cache_dir", "token_dtype"]

BATCH_BYTES = 16 << 20
LAYOUT = 2          # all.tok in source order (1: train then val)
COPY_BYTES = 1 << 22
PREFIX = "tok-"
SPANS = "spans.npy"


def default_cache_dir() -> str:
    d = os.environ.get("RWKVX_CACHE")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rwkvx_c")


def token_dtype(vocab: int) -> type[np.unsignedinteger]:
    """The narrowest unsigned type that holds every id of a vocabulary."""
    return np.uint8 if vocab <= 256 else np.uint16 if vocab <= 65536 else np.uint32


class CachedTokens:
    """The memory-mapped tokens of a cached corpus: train and val by the
    file split; all_tokens() every source's in source order."""

    def __init__(self, folder: str, meta: dict[str, Any]) -> None:
        self.folder = folder
        self.dtype = np.dtype(meta["dtype"])
        self.train = memmap(os.path.join(folder, "train.tok"), self.dtype)
        self.val = memmap(os.path.join(folder, "val.tok"), self.dtype)
        self.source_bytes = int(meta["source_bytes"])
        # a chat corpus: the trained-token masks and the conversation count
        self.chat = bool(meta.get("chat", False))
        self.conversations = int(meta.get("conversations", 0))
        self.train_mask = memmap(os.path.join(folder, "train.mask")) if self.chat else None
        self.val_mask = memmap(os.path.join(folder, "val.mask")) if self.chat else None

    def all_tokens(self) -> np.ndarray:
        """Every token in source order: all.tok, written on first use from the
        sources' spans in train.tok / val.tok (a pass that finds both splits
        long enough never needs it)."""
        return self._whole("tok", self.dtype)

    def all_mask(self) -> np.ndarray | None:
        """all_tokens()'s masks (all.mask) of a chat corpus, else None."""
        return self._whole("mask", np.dtype(np.uint8)) if self.chat else None

    def _whole(self, ext: str, dtype: np.dtype) -> np.ndarray:
        whole = os.path.join(self.folder, "all." + ext)
        if not os.path.exists(whole):
            spans = np.load(os.path.join(self.folder, SPANS))
            names = [os.path.join(self.folder, f"{n}.{ext}") for n in ("train", "val")]
            with replacing(whole) as out:
                _copy_spans(out, [(names[side], lo, hi) for side, lo, hi in spans.tolist()],
                            dtype.itemsize)
        return memmap(whole, dtype)


class _TokenWriter:
    """Appends token arrays to a file as `dtype`, counting them."""

    def __init__(self, path: str, dtype: Any) -> None:
        self.f = open(path, "wb")  # noqa: SIM115 -- closed by close(), in a finally
        self.dtype = dtype
        self.n = 0

    def write(self, ids: np.ndarray) -> None:
        if len(ids):
            self.f.write(np.asarray(ids).astype(self.dtype, copy=False).tobytes())
            self.n += len(ids)

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def _encode_side(files: Sequence[Source], tok: Tokenizer, writer: _TokenWriter,
                 text_field: str, progress: Callable[[int], object] | None) -> list[int]:
    """Encode every document of files into writer, batching short documents
    (across files, so the encoders' threads see many at once) and streaming
    long ones piece by piece. Returns each file's token count."""
    counts = [0] * len(files)
    batch: list[bytes] = []
    owner: list[int] = []    # the file of each batched document
    size = 0

    def flush() -> None:
        nonlocal batch, owner, size
        for i, ids in zip(owner, tok.encode_docs(batch)):
            writer.write(ids)
            counts[i] += len(ids)
        batch, owner, size = [], [], 0

    def put(i: int, ids: np.ndarray) -> None:
        writer.write(ids)
        counts[i] += len(ids)

    for i, src in enumerate(files):
        carry = b""
        for piece, final in iter_documents([src], text_field, progress):
            if not carry and final and len(piece) < formats.PIECE_BYTES:
                batch.append(piece)
                owner.append(i)
                size += len(piece)
                if size >= BATCH_BYTES:
                    flush()
                continue
            flush()
            data = carry + piece
            ids, used = tok.encode_piece(data, final)
            put(i, ids)
            carry = data[used:]
            if final and carry:  # cannot happen for exact tokenizers; never drop text
                put(i, tok.encode(carry))
                carry = b""
    flush()
    return counts


def _encode_chat_side(files: Sequence[Source], tok: Tokenizer, writer: _TokenWriter,
                      masks: _TokenWriter, progress: Callable[[int], object] | None,
                      chat: ChatFormat) -> tuple[list[int], int]:
    """Encode the conversations of files into writer, their masks into
    masks. Returns each file's token count and the conversations."""
    counts, convs = [], 0

    def write(ids: np.ndarray, mask: np.ndarray) -> None:
        writer.write(ids)
        masks.write(mask)
    for src in files:
        before = writer.n
        convs += encode_chat(src, tok, write, progress, chat)[0]
        counts.append(writer.n - before)
    return counts, convs


def _chat_sources(files: Sequence[Source]) -> bool:
    """True when every source is a chat .jsonl, False when none is;
    DataError for a corpus that mixes them."""
    chat = [is_chat_file(f) for f in files]
    if any(chat) and not all(chat):
        a, b = (files[chat.index(v)][1] for v in (True, False))
        raise DataError(f"the corpus mixes chat records ({a}) with text ({b}); train on "
                        "them in separate runs")
    return bool(chat) and all(chat)


def _copy_spans(out: IO[bytes], spans: Sequence[tuple[str, int, int]], itemsize: int) -> None:
    """Write the (file, first token, end token) spans to out back to back."""
    for path, lo, hi in spans:
        with open(path, "rb") as f:
            f.seek(lo * itemsize)
            left = (hi - lo) * itemsize
            while left:
                blk = f.read(min(left, COPY_BYTES))
                if not blk:
                    raise OSError(f"{path} is shorter than the cache's spans say")
                out.write(blk)
                left -= len(blk)


def _build(d: str, files: Sequence[Source], tok: Tokenizer, text_field: str,
           show_progress: bool, chat_format: ChatFormat) -> None:
    """Write the cache folder d (see the module doc) via a temporary folder."""
    os.makedirs(os.path.dirname(d), exist_ok=True)
    tmp = f"{d}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    dtype = token_dtype(tok.vocab_size)
    chat = _chat_sources(files)
    convs = 0
    total = sum(os.path.getsize(p) for _, p, _ in files)
    bar = None
    if show_progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, dynamic_ncols=True,
                   desc=f"tokenising ({tok.identity()['name']})")
    try:
        counts = {}
        spans = np.zeros((len(files), 3), dtype=np.int64)   # (side, first, end) per source
        for side_no, (name, pick) in enumerate((("train", False), ("val", True))):
            side = [i for i, f in enumerate(files) if is_val_file(f[0]) == pick]
            w = _TokenWriter(os.path.join(tmp, name + ".tok"), dtype)
            mw = _TokenWriter(os.path.join(tmp, name + ".mask"), np.uint8) if chat else None
            try:
                if mw is not None:
                    n, c = _encode_chat_side([files[i] for i in side], tok, w, mw,
                                             bar.update if bar else None, chat_format)
                    convs += c
                else:
                    n = _encode_side([files[i] for i in side], tok, w, text_field,
                                     bar.update if bar else None)
            finally:
                w.close()
                if mw is not None:
                    mw.close()
            counts[name] = w.n
            ends = np.cumsum(n, dtype=np.int64)
            spans[side, 0], spans[side, 1], spans[side, 2] = side_no, ends - n, ends
        np.save(os.path.join(tmp, SPANS), spans)
        with open(os.path.join(tmp, "meta.json"), "w") as meta:
            json.dump({"tokenizer": tok.identity(), "dtype": np.dtype(dtype).name,
                       "files": len(files), "tokens": counts, "source_bytes": total,
                       "layout": LAYOUT, "chat": chat, "conversations": convs}, meta)
        try:
            os.rename(tmp, d)
        except OSError:  # another process finished the same cache first
            if not os.path.exists(os.path.join(d, "meta.json")):
                raise
    finally:
        if bar:
            bar.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _cache_key(files: Sequence[Source], tok: Tokenizer, text_field: str,
               chat: ChatFormat) -> str:
    head: list[object] = [LAYOUT, tok.identity(), text_field]
    if chat.identity() is not None:   # the default keeps the keys it always had
        head.append(chat.identity())
    h = hashlib.sha256(json.dumps(head).encode())
    for rel, p, kind in files:
        st = os.stat(p)
        h.update(f"{os.path.abspath(p)}\0{rel}\0{kind}\0{st.st_size}\0{st.st_mtime_ns}\n"
                 .encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:24]


def cached_tokens(files: Sequence[Source], tok: Tokenizer, *, text_field: str,
                  cache_dir: str | None, progress: bool,
                  chat: ChatFormat | None = None) -> CachedTokens:
    """The tokens of files encoded with tok (chat records with chat's
    template), from the cache (built first when missing)."""
    root = cache_dir or default_cache_dir()
    chat = chat or ChatFormat()
    sweep_orphans(root, PREFIX)
    d = os.path.join(root, PREFIX + _cache_key(files, tok, text_field, chat))
    if not os.path.exists(os.path.join(d, "meta.json")):
        _build(d, files, tok, text_field, progress, chat)
    sweep_orphans(d)   # an all.tok a killed process was writing
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    return CachedTokens(d, meta)
