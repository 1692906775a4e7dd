"""The file formats a corpus is read from.

Documents (``iter_documents``): a text file is one document, read in pieces
of PIECE_BYTES; a JSON-lines file (``.jsonl``, ``.jsonl.gz``) holds one
document per line, the string in the record's ``text_field`` followed by a
newline; blank lines are skipped, and a line that is not a JSON object
holding that string is a DataError naming the file and line. A table
(``.parquet``, ``.arrow``: rwkvx_c.data.tables) holds one document a row,
its ``text_field`` column's string followed by a newline, as a JSON line.

Records (``records``): the (where, record) of every JSON line or table
row of a source, where naming ``FILE:LINE`` or ``FILE row N``.

Token files, already tokens and memory-mapped read-only, never copied:

  - a raw ``.bin`` token file: little-endian uint8/uint16/uint32 ids. The
    dtype comes from a sidecar ``NAME.bin.json`` ({"dtype": "uint16",
    "vocab_size": 50304}) or from the name (``*.u8.bin``, ``*.u16.bin``,
    ``*.u32.bin``, ``*.uint16.bin``, ...); the vocabulary size from the
    sidecar, else 256 for uint8 and max(id) + 1 otherwise;
  - an RWKV-LM / Megatron binidx pair (``NAME.bin`` + ``NAME.idx``).
"""
from __future__ import annotations

import gzip
import json
import os
import struct
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import IO

import numpy as np

from rwkvx_c.data.sources import Source
from rwkvx_c.data.tables import TABLE_KINDS, table_columns, table_rows
from rwkvx_c.errors import DataError

__all__ = ["PIECE_BYTES", "MAX_LINE_BYTES", "TokenFile", "is_binidx", "is_token_file",
           "iter_documents", "jsonl_records", "read_jsonl", "records", "max_token", "memmap",
           "read_binidx",
           "read_token_file"]

PIECE_BYTES = 8 << 20
MAX_LINE_BYTES = 64 << 20   # one .jsonl document (line) at most
MAX_VOCAB = 2 ** 31 - 1   # token ids are int32 in the C API
SCAN_TOKENS = 1 << 24     # ids scanned at once for the largest: memory stays flat
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEAD = len(_IDX_MAGIC) + 8 + 1 + 8 + 8
_IDX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
_BIN_DTYPES = {"uint8": np.uint8, "u8": np.uint8, "uint16": np.uint16, "u16": np.uint16,
               "uint32": np.uint32, "u32": np.uint32}


def memmap(path: str, dtype: np.dtype | type = np.uint8) -> np.ndarray:
    """A read-only memory map of path (an empty array for an empty file,
    which NumPy cannot map)."""
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def max_token(tokens: np.ndarray) -> tuple[int, int]:
    """(smallest, largest) id of tokens, scanned in chunks."""
    lo, hi = 0, 0
    for i in range(0, len(tokens), SCAN_TOKENS):
        blk = tokens[i:i + SCAN_TOKENS]
        lo, hi = min(lo, int(blk.min())), max(hi, int(blk.max()))
    return lo, hi


# ---- token files ----------------------------------------------------------------


def is_binidx(path: str) -> bool:
    if not path.endswith((".bin", ".idx")) or len(path) == 4:
        return False
    stem = path[:-4]
    return os.path.isfile(stem + ".bin") and os.path.isfile(stem + ".idx")


def is_token_file(path: str) -> bool:
    """True for a path that holds tokens, not text: a .bin file or a binidx pair."""
    return path.endswith(".bin") or is_binidx(path)


def read_binidx(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens memmap, document start offsets in tokens) of an RWKV-LM /
    Megatron binidx pair given as NAME.bin or NAME.idx. The index holds:
    magic b"MMIDIDX\\0\\0", u64 version 1, u8 dtype code, u64 sequence count
    S, u64 document count D, then i32 sizes[S], i64 byte pointers[S] into
    the .bin, i64 doc_idx[D]; all little-endian."""
    stem = path[:-4]
    idx, binp = stem + ".idx", stem + ".bin"
    try:
        with open(idx, "rb") as f:
            head = f.read(_IDX_HEAD)
    except OSError as e:
        raise DataError(f"cannot read binidx index {idx}: {e.strerror}") from None
    if len(head) < _IDX_HEAD or head[:len(_IDX_MAGIC)] != _IDX_MAGIC:
        raise DataError(f"{idx} is not a binidx index (no MMIDIDX header)")
    version, code, S, D = struct.unpack("<QBQQ", head[len(_IDX_MAGIC):])
    if version != 1:
        raise DataError(f"{idx}: binidx version {version}, only 1 is known")
    if code not in _IDX_DTYPES:
        raise DataError(f"{idx}: token dtype code {code} is not an integer type")
    dtype = np.dtype(_IDX_DTYPES[code])
    need = _IDX_HEAD + S * 4 + S * 8 + D * 8
    if os.path.getsize(idx) < need:
        raise DataError(f"{idx} is truncated: {os.path.getsize(idx)} bytes, the header "
                        f"announces {need}")
    sizes = np.memmap(idx, dtype="<i4", mode="r", offset=_IDX_HEAD, shape=(S,)) if S \
        else np.zeros(0)
    ptrs = np.memmap(idx, dtype="<i8", mode="r", offset=_IDX_HEAD + 4 * S, shape=(S,)) if S \
        else np.zeros(0, dtype=np.int64)
    nbytes = os.path.getsize(binp)
    if nbytes % dtype.itemsize:
        raise DataError(f"{binp} has {nbytes} bytes, not a multiple of {dtype.itemsize} "
                        f"({dtype.name})")
    if S and (int(ptrs[-1]) + int(sizes[-1]) * dtype.itemsize > nbytes or int(sizes.min()) < 0):
        raise DataError(f"{idx} points past the end of {binp}: the pair does not match")
    if nbytes == 0:
        raise DataError(f"binidx data {binp} is empty")
    tokens = np.memmap(binp, dtype=dtype.newbyteorder("<"), mode="r")
    return tokens, np.asarray(ptrs, dtype=np.int64) // dtype.itemsize


def _show(v: object) -> str:
    """A sidecar value for a one-line message: ASCII, and short whatever it holds."""
    s = ascii(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _bin_dtype(path: str) -> tuple[np.dtype, int | None]:
    """(dtype, vocab_size or None) of a raw .bin token file, from its sidecar or name."""
    side = path + ".json"
    info = {}
    if os.path.exists(side):
        try:
            with open(side, encoding="utf-8") as f:
                info = json.load(f)
        except (OSError, ValueError) as e:   # UnicodeDecodeError is a ValueError
            raise DataError(f"cannot read token sidecar {side}: {e}") from None
        if not isinstance(info, dict):
            raise DataError(f"token sidecar {side} holds {_show(info)}, not a JSON object "
                            'such as {"dtype": "uint16", "vocab_size": 50304}')
    name = info.get("dtype")
    if name is None:
        parts = os.path.basename(path).lower().split(".")
        hits = [p for p in parts[:-1] if p in _BIN_DTYPES]
        name = hits[-1] if hits else None
    elif not isinstance(name, str) or name not in _BIN_DTYPES:
        raise DataError(f"token sidecar {side}: dtype {_show(name)} is not uint8, uint16 "
                        "or uint32")
    if name not in _BIN_DTYPES:
        raise DataError(f"cannot tell the token dtype of {path}: name it *.u8.bin, *.u16.bin "
                        f"or *.u32.bin, or add {os.path.basename(side)} with "
                        '{"dtype": "uint16"}')
    vocab = info.get("vocab_size")
    # bool is an int to Python, and float vocabularies do not exist
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int)
                              or not 1 <= vocab <= MAX_VOCAB):
        raise DataError(f"token sidecar {side}: vocab_size {_show(vocab)} is not an integer "
                        f"in [1, {MAX_VOCAB}]")
    return np.dtype(_BIN_DTYPES[name]), vocab


class TokenFile:
    """The tokens of a token file; vocab_size as the file declares it (a
    sidecar's; None: unknown), documents the binidx document count (None
    for a raw .bin)."""

    def __init__(self, tokens: np.ndarray, vocab_size: int | None,
                 documents: int | None) -> None:
        self.tokens = tokens
        self.vocab_size = vocab_size
        self.documents = documents


def read_token_file(path: str) -> TokenFile:
    """The tokens of a raw .bin token file or of a binidx pair, memory-mapped."""
    if is_binidx(path):
        tokens, docs = read_binidx(path)
        return TokenFile(tokens, None, len(docs))
    dtype, vocab = _bin_dtype(path)
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"token file {path} is empty")
    if size % dtype.itemsize:
        raise DataError(f"token file {path} has {size} bytes, not a multiple of "
                        f"{dtype.itemsize} ({dtype.name})")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    return TokenFile(tokens, vocab, None)


# ---- documents ------------------------------------------------------------------


def jsonl_records(path: str, fh: IO[bytes] | gzip.GzipFile) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON value) of every non-blank line of fh;
    DataError naming path:line for a line that is not JSON."""
    n = 0
    while True:
        # read with a bound: one line is held whole, and decoded it takes
        # several times its bytes
        line = fh.readline(MAX_LINE_BYTES + 1)
        n += 1
        if not line:
            return
        if len(line) > MAX_LINE_BYTES:
            raise DataError(f"{path}:{n}: a line longer than {MAX_LINE_BYTES >> 20} MiB; give "
                            "documents that large as text files")
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
        except UnicodeDecodeError:   # json.loads decodes the bytes first
            raise DataError(f"{path}:{n}: not UTF-8 text") from None
        except RecursionError:
            raise DataError(f"{path}:{n}: JSON nested too deeply") from None
        except ValueError:   # Python's bound on the digits of an integer
            raise DataError(f"{path}:{n}: a number with more digits than Python reads "
                            f"({sys.get_int_max_str_digits()})") from None
        yield n, rec


def read_jsonl(path: str, kind: str, progress: Callable[[int], object] | None = None
               ) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of every record of a "jsonl" or
    "jsonl.gz" file (jsonl_records); progress(n) is called with the source
    bytes read. DataError for a file that cannot be read or a truncated gzip."""
    try:
        with open(path, "rb") as raw:
            fh = gzip.GzipFile(fileobj=raw) if kind == "jsonl.gz" else raw
            pos = 0
            for n, rec in jsonl_records(path, fh):
                if progress:
                    now = raw.tell()
                    progress(now - pos)
                    pos = now
                yield n, rec
            if progress:
                progress(raw.tell() - pos)
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    except EOFError:
        raise DataError(f"{path} is a truncated gzip file") from None


def _text_pieces(path: str, progress: Callable[[int], object] | None
                 ) -> Iterator[tuple[bytes, bool]]:
    with open(path, "rb") as f:
        while True:
            blk = f.read(PIECE_BYTES)
            nxt = f.peek(1) if blk else b""
            if progress:
                progress(len(blk))
            if not blk:
                return
            yield blk, not nxt
            if not nxt:
                return


def records(src: Source, progress: Callable[[int], object] | None = None,
            columns: Sequence[str] | None = None) -> Iterator[tuple[str, object]]:
    """(where, record) of every record of a jsonl or table source; a
    table's rows hold those of `columns` it has (None: all of them)."""
    _, path, kind = src
    if kind in TABLE_KINDS:
        if columns is not None:
            have = set(table_columns(path, kind))
            columns = [c for c in columns if c in have]
        for n, row in table_rows(path, kind, columns, progress):
            yield f"{path} row {n}", row
        return
    for n, rec in read_jsonl(path, kind, progress):
        yield f"{path}:{n}", rec


def _table_documents(path: str, kind: str, text_field: str,
                     progress: Callable[[int], object] | None) -> Iterator[tuple[bytes, bool]]:
    names = table_columns(path, kind)
    if text_field not in names:
        raise DataError(f"{path}: no column {text_field!r} (it has {', '.join(names)}; choose "
                        "the text column with --text-field)")
    for n, row in table_rows(path, kind, [text_field], progress):
        text = row[text_field]
        if not isinstance(text, str):
            raise DataError(f"{path} row {n}: column {text_field!r} holds "
                            f"{type(text).__name__}, not text (choose the text column with "
                            "--text-field)")
        yield text.encode("utf-8", "surrogatepass") + b"\n", True


def iter_documents(files: Sequence[Source], text_field: str = "text",
                   progress: Callable[[int], object] | None = None
                   ) -> Iterator[tuple[bytes, bool]]:
    """(bytes, final) pieces of every document of files, in order: a
    document shorter than PIECE_BYTES is one (doc, True); a longer text file
    comes as several (piece, False) ... (last, True). progress(n) is called
    with the source bytes read."""
    for _, p, kind in files:
        if kind in TABLE_KINDS:
            yield from _table_documents(p, kind, text_field, progress)
            continue
        if kind != "text":
            for n, rec in read_jsonl(p, kind, progress):
                text = rec.get(text_field) if isinstance(rec, dict) else None
                if not isinstance(text, str):
                    raise DataError(f"{p}:{n}: no string field {text_field!r} "
                                    "(choose the field with --text-field)")
                yield text.encode("utf-8", "surrogatepass") + b"\n", True
            continue
        try:
            yield from _text_pieces(p, progress)
        except OSError as e:
            raise DataError(f"cannot read {p}: {e.strerror or e}") from None
