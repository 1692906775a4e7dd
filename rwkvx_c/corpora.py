"""Corpora for any tokenizer: text files, folders, JSON lines and RWKV-LM binidx.

``load_tokenized`` (reached through ``data.load_corpus``) turns one or more
paths into train/validation token arrays:

  - a text file: one document; a folder: every non-hidden text file below it
    (``.jsonl`` / ``.jsonl.gz`` files in it are read as JSON lines); several
    paths: all of their documents in the order given. No path: the standard
    library's ``.py`` files (data.stdlib_files).
  - ``.jsonl`` / ``.jsonl.gz``: one document per line, the string in the
    record's ``text_field`` followed by a newline; blank lines are skipped and
    a line that is not a JSON object holding that string is a DataError
    naming the file and line.
  - RWKV-LM binidx (``NAME.bin`` + ``NAME.idx``, Megatron's MMIDIDX index):
    already tokens, memory-mapped read-only, never copied; it must be the only
    path. Its ids must lie in the tokenizer's vocabulary.

Splits: a file goes to validation when the hash rule of data._is_val_file
picks its relative name (about 2% of files); when that leaves a side shorter
than a window, the validation split is the tail of all tokens instead
(a single file, binidx, or very few files).

Cache: tokens are written once to CACHE/tok-KEY/{train,val}.tok (uint8,
uint16 or uint32 by vocabulary size) and memory-mapped. KEY hashes the
tokenizer's identity (name + vocabulary SHA-256), the text field and every
source file's path, size and modification time (size+mtime, not content:
hashing a corpus of many GB on every start would cost as much as reading it);
change any of them and the cache is rebuilt. The pass writes into a
temporary folder that is renamed into place only when complete, so an
interrupted pass leaves nothing a later run would use; the temporary of a
killed pass (its writer's PID dead) is removed at the next load.

Memory: documents are read and encoded in batches of at most BATCH_BYTES, a
longer document in pieces of PIECE_BYTES (exactly, for byte and trie
tokenizers: a piece is cut where no token can cross), so peak memory does
not grow with the corpus. Encoding is parallel over the documents of a batch
and within a long piece (the C trie's threads; tokenizers' own threads).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rwkvx_c.data import (
    Corpus,
    DataError,
    _is_val_file,
    _sweep_orphans,
    _tail_split,
    _text_files,
    default_cache_dir,
    stdlib_files,
)

if TYPE_CHECKING:
    from rwkvx_c.tokenizer import Tokenizer

# (name relative to its folder, path, kind: text, jsonl or jsonl.gz) of a source file
Source = tuple[str, str, str]

__all__ = [
    "is_binidx",
    "iter_documents",
    "load_tokenized",
    "needs_tokenizing",
    "read_binidx",
    "source_files",
]

BATCH_BYTES = 16 << 20
PIECE_BYTES = 8 << 20
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


def is_binidx(path: str) -> bool:
    if not path.endswith((".bin", ".idx")) or len(path) == 4:
        return False
    stem = path[:-4]
    return os.path.isfile(stem + ".bin") and os.path.isfile(stem + ".idx")


def read_binidx(path: str) -> tuple:
    """(tokens memmap, document start offsets in tokens) of an RWKV-LM /
    Megatron binidx pair given as NAME.bin or NAME.idx. The index holds:
    magic b"MMIDIDX\\0\\0", u64 version 1, u8 dtype code, u64 sequence count
    S, u64 document count D, then i32 sizes[S], i64 byte pointers[S] into
    the .bin, i64 doc_idx[D]; all little-endian."""
    stem = path[:-4]
    idx, binp = stem + ".idx", stem + ".bin"
    try:
        with open(idx, "rb") as f:
            head = f.read(len(_IDX_MAGIC) + 8 + 1 + 8 + 8)
    except OSError as e:
        raise DataError(f"cannot read binidx index {idx}: {e.strerror}") from None
    if len(head) < 34 or head[:9] != _IDX_MAGIC:
        raise DataError(f"{idx} is not a binidx index (no MMIDIDX header)")
    version, code, S, D = struct.unpack("<QBQQ", head[9:34])
    if version != 1:
        raise DataError(f"{idx}: binidx version {version}, only 1 is known")
    if code not in _IDX_DTYPES:
        raise DataError(f"{idx}: token dtype code {code} is not an integer type")
    dtype = np.dtype(_IDX_DTYPES[code])
    need = 34 + S * 4 + S * 8 + D * 8
    if os.path.getsize(idx) < need:
        raise DataError(f"{idx} is truncated: {os.path.getsize(idx)} bytes, the header "
                        f"announces {need}")
    sizes = np.memmap(idx, dtype="<i4", mode="r", offset=34, shape=(S,)) if S else np.zeros(0)
    ptrs = np.memmap(idx, dtype="<i8", mode="r", offset=34 + 4 * S, shape=(S,)) if S \
        else np.zeros(0, dtype=np.int64)
    nbytes = os.path.getsize(binp)
    if nbytes % dtype.itemsize:
        raise DataError(f"{binp} has {nbytes} bytes, not a multiple of {dtype.itemsize} "
                        f"({dtype.name})")
    n = nbytes // dtype.itemsize
    if S and (int(ptrs[-1]) + int(sizes[-1]) * dtype.itemsize > nbytes or int(sizes.min()) < 0):
        raise DataError(f"{idx} points past the end of {binp}: the pair does not match")
    if n == 0:
        raise DataError(f"binidx data {binp} is empty")
    tokens = np.memmap(binp, dtype=dtype.newbyteorder("<"), mode="r")
    return tokens, np.asarray(ptrs, dtype=np.int64) // dtype.itemsize


def needs_tokenizing(path: str) -> bool:
    """True for a path the byte-level loader of data.py does not read as it
    is: JSON lines, binidx, or a folder holding JSON lines."""
    if os.path.isdir(path):
        return any(f.lower().endswith((".jsonl", ".jsonl.gz")) for _, _, fs in os.walk(path)
                   for f in fs)
    return _kind(path) != "text" or is_binidx(path)


def _max_token(tokens: np.ndarray) -> tuple:
    lo, hi = 0, 0
    for i in range(0, len(tokens), 1 << 24):  # chunked: memory stays flat
        blk = tokens[i:i + (1 << 24)]
        lo, hi = min(lo, int(blk.min())), max(hi, int(blk.max()))
    return lo, hi


def _binidx_corpus(path: str, tok: Tokenizer, val_fraction: float, min_len: int) -> Corpus:
    tokens, docs = read_binidx(path)
    lo, hi = _max_token(tokens)
    if lo < 0 or hi >= tok.vocab_size:
        raise DataError(f"binidx {path} holds ids up to {hi} (min {lo}), outside the "
                        f"{tok.identity()['name']} tokenizer's vocabulary of {tok.vocab_size}: "
                        "pass --tokenizer with the vocabulary it was made with")
    train, val = _tail_split(tokens, val_fraction, min_len, f"binidx {path}")
    return Corpus(train, val, tok.vocab_size, tok.name == "byte",
                  f"{path} (binidx, {len(docs):,} documents, {len(train):,} train / "
                  f"{len(val):,} val {tok.identity()['name']} tokens)",
                  tok.token_lengths())


def _kind(path: str) -> str:
    p = path.lower()
    if p.endswith(".jsonl"):
        return "jsonl"
    if p.endswith(".jsonl.gz"):
        return "jsonl.gz"
    return "text"


def source_files(paths: Sequence[str | os.PathLike[str]] | None) -> list[Source]:
    """(name, path, kind) of every source file, sorted within each path; name
    (relative to its folder, or the file's own name) decides the split."""
    if paths is None:
        _, files = stdlib_files()
        return [(rel, p, "text") for rel, p in files]
    out: list[Source] = []
    for path in paths:
        path = os.fspath(path)
        if not os.path.exists(path):
            raise DataError(f"data path does not exist: {path}")
        if os.path.isdir(path):
            names = dict(_text_files(path))
            for d, dirs, found in os.walk(path):  # gzip files are binary: find them by name
                dirs[:] = sorted(x for x in dirs if not x.startswith("."))
                for f in found:
                    if f.lower().endswith(".jsonl.gz") and not f.startswith("."):
                        p = os.path.join(d, f)
                        names[os.path.relpath(p, path).replace(os.sep, "/")] = p
            if not names:
                raise DataError(f"no text or .jsonl files found in folder {path}")
            out += [(rel, p, _kind(p)) for rel, p in sorted(names.items())]
        else:  # the split must not depend on how the path is spelt
            out.append((os.path.basename(path), path, _kind(path)))
    return out


def _jsonl_docs(path: str, fh: Iterable[bytes], text_field: str) -> Iterator[bytes]:
    for n, line in enumerate(fh, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
        except UnicodeDecodeError:   # json.loads decodes the bytes first
            raise DataError(f"{path}:{n}: not UTF-8 text") from None
        text = rec.get(text_field) if isinstance(rec, dict) else None
        if not isinstance(text, str):
            raise DataError(f"{path}:{n}: no string field {text_field!r} "
                            "(choose the field with --text-field)")
        yield text.encode("utf-8", "surrogatepass") + b"\n"


def iter_documents(files: Sequence[Source], text_field: str = "text",
                   progress: Callable[[int], object] | None = None
                   ) -> Iterator[tuple[bytes, bool]]:
    """(bytes, final) pieces of every document of files, in order: a
    document shorter than PIECE_BYTES is one (doc, True); a longer text file
    comes as several (piece, False) ... (last, True). progress(n) is called
    with the source bytes read."""
    for _, p, kind in files:
        try:
            if kind == "text":
                with open(p, "rb") as f:
                    while True:
                        blk = f.read(PIECE_BYTES)
                        nxt = f.peek(1) if blk else b""
                        if progress:
                            progress(len(blk))
                        if not blk:
                            break
                        yield blk, not nxt
                        if not nxt:
                            break
                continue
            with open(p, "rb") as raw:
                fh = gzip.GzipFile(fileobj=raw) if kind == "jsonl.gz" else raw
                pos = 0
                for doc in _jsonl_docs(p, fh, text_field):
                    if progress:
                        now = raw.tell()
                        progress(now - pos)
                        pos = now
                    yield doc, True
                if progress:
                    progress(raw.tell() - pos)
        except OSError as e:
            raise DataError(f"cannot read {p}: {e.strerror or e}") from None
        except EOFError:
            raise DataError(f"{p} is a truncated gzip file") from None


class _TokenWriter:
    """Appends token arrays to a file as `dtype`."""

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


def _encode_files(files: Sequence[Source], tok: Tokenizer, writer: _TokenWriter,
                  text_field: str, progress: Callable[[int], object] | None) -> None:
    """Encode every document of files into writer, batching short documents
    and streaming long ones piece by piece."""
    batch: list[bytes] = []
    size = 0

    def flush() -> None:
        nonlocal batch, size
        for ids in tok.encode_docs(batch):
            writer.write(ids)
        batch, size = [], 0

    carry = b""
    for piece, final in iter_documents(files, text_field, progress):
        if not carry and final and len(piece) < PIECE_BYTES:
            batch.append(piece)
            size += len(piece)
            if size >= BATCH_BYTES:
                flush()
            continue
        flush()
        data = carry + piece
        ids, used = tok.encode_piece(data, final)
        writer.write(ids)
        carry = data[used:]
        if final and carry:  # cannot happen for exact tokenizers; never drop text
            writer.write(tok.encode(carry))
            carry = b""
    flush()


def _dtype_for(vocab: int) -> type[np.unsignedinteger]:
    return np.uint8 if vocab <= 256 else np.uint16 if vocab <= 65536 else np.uint32


def _cache_key(files: Sequence[Source], tok: Tokenizer, text_field: str) -> str:
    h = hashlib.sha256(json.dumps([tok.identity(), text_field]).encode())
    for rel, p, kind in files:
        st = os.stat(p)
        h.update(f"{os.path.abspath(p)}\0{rel}\0{kind}\0{st.st_size}\0{st.st_mtime_ns}\n"
                 .encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:24]


def _build(d: str, files: Sequence[Source], tok: Tokenizer, text_field: str, min_len: int,
           show_progress: bool) -> None:
    """Write d/{train,val}.tok (and all.tok when a side is too short) via a
    temporary folder renamed into place."""
    parent = os.path.dirname(d)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{d}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    dtype = _dtype_for(tok.vocab_size)
    total = sum(os.path.getsize(p) for _, p, _ in files)
    bar = None
    if show_progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, dynamic_ncols=True,
                   desc=f"tokenising ({tok.identity()['name']})")
    try:
        sides = {}
        for name, pick in (("train", False), ("val", True)):
            w = _TokenWriter(os.path.join(tmp, name + ".tok"), dtype)
            try:
                _encode_files([f for f in files if _is_val_file(f[0]) == pick], tok, w,
                              text_field, bar.update if bar else None)
            finally:
                w.close()
            sides[name] = w.n
        if min(sides.values()) < min_len:
            with open(os.path.join(tmp, "all.tok"), "wb") as out:
                for name in ("train", "val"):
                    with open(os.path.join(tmp, name + ".tok"), "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 22)
                out.flush()
                os.fsync(out.fileno())
        with open(os.path.join(tmp, "meta.json"), "w") as meta:
            json.dump({"tokenizer": tok.identity(), "dtype": np.dtype(dtype).name,
                       "files": len(files), "tokens": sides, "source_bytes": total}, meta)
        try:
            os.rename(tmp, d)
        except OSError:  # another process finished the same cache first
            if not os.path.exists(os.path.join(d, "meta.json")):
                raise
    finally:
        if bar:
            bar.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _mm(path: str, dtype: np.dtype) -> np.ndarray:
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def load_tokenized(paths: Sequence[str | os.PathLike[str]] | None, tok: Tokenizer, *,
                   seq_len: int = 256, val_fraction: float = 0.02, cache_dir: str | None = None,
                   text_field: str = "text", progress: bool = False) -> Corpus:
    """The corpus of `paths` (a list, or None for the standard library)
    encoded with tokenizer `tok`; see the module doc."""
    min_len = seq_len + 1
    if paths is not None and any(is_binidx(os.fspath(p)) for p in paths):
        if len(paths) != 1:
            raise DataError("a binidx corpus must be the only --data path")
        return _binidx_corpus(os.fspath(paths[0]), tok, val_fraction, min_len)
    files = source_files(paths)
    if not files:
        raise DataError("no source files found")
    root = cache_dir or default_cache_dir()
    _sweep_orphans(root, "tok-")
    d = os.path.join(root, "tok-" + _cache_key(files, tok, text_field))
    if not os.path.exists(os.path.join(d, "meta.json")):
        _build(d, files, tok, text_field, min_len, progress)
    with open(os.path.join(d, "meta.json")) as f:
        meta = json.load(f)
    dtype = np.dtype(meta["dtype"])
    what = "the standard library" if paths is None else ", ".join(map(str, paths))
    if os.path.exists(os.path.join(d, "all.tok")):
        whole = _mm(os.path.join(d, "all.tok"), dtype)
        if len(whole) == 0:
            raise DataError(f"{what} holds no text")
        train, val = _tail_split(whole, val_fraction, min_len, what)
    else:
        train, val = _mm(os.path.join(d, "train.tok"), dtype), _mm(os.path.join(d, "val.tok"),
                                                                    dtype)
    name = tok.identity()["name"]
    return Corpus(train, val, tok.vocab_size, name == "byte",
                  f"{what} ({len(files)} files, {len(train):,} train / {len(val):,} val "
                  f"{name} tokens from {meta['source_bytes']:,} bytes)", tok.token_lengths())
