"""Training data: a byte-level tokenizer, corpora as memory-mapped token
arrays, and seeded batch sampling whose state can be checkpointed.

Tokenizer: one token per byte (vocab 256); decoding is bytes -> UTF-8 with
replacement, so any text (or any file) round-trips byte for byte.

Corpora (``load_corpus``):
  - None (the default): the Python standard library's own ``.py`` files,
    found through ``sysconfig.get_paths()["stdlib"]`` (site-packages
    excluded), so every machine with Python has it without a download. Each
    file goes to validation when the first 8 bytes of SHA-1(relative path)
    as a big-endian integer are divisible by 50 (about 2% of the files),
    otherwise to training.
  - a text file: its bytes; the last ``val_fraction`` of it is validation.
  - a folder: every non-hidden regular text file below it (files with a NUL
    byte in their first 8 KiB are taken as binary and skipped), split by file
    with the same hash rule; when that leaves either side without a full
    window, the concatenation's tail is validation instead.
  - a ``.bin`` token file: raw little-endian uint8/uint16/uint32 tokens,
    memory-mapped (memory stays flat at any size). The dtype comes from a
    sidecar ``NAME.bin.json`` ({"dtype": "uint16", "vocab_size": 50304})
    or from the name (``*.u8.bin``, ``*.u16.bin``, ``*.u32.bin``,
    ``*.uint16.bin``, ...); the vocab size from the sidecar, else 256 for
    uint8 and max(token)+1 otherwise. The tail ``val_fraction`` is validation.
  - JSON lines (``.jsonl``, ``.jsonl.gz``), RWKV-LM binidx, several paths,
    and any corpus read with a tokenizer other than bytes: rwkvx_c.corpora.
Folders and the default corpus are concatenated once into ``train.bin`` /
``val.bin`` under the cache folder ($RWKVX_CACHE, else
$XDG_CACHE_HOME/rwkvx_c, else ~/.cache/rwkvx_c), keyed by the file list,
sizes and modification times, and memory-mapped from there. Each is written
to NAME.tmpPID and renamed into place; a killed writer's temporary is
removed at the next load that uses the folder.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from rwkvx_c.atomic import replacing, writer_pid

if TYPE_CHECKING:
    from rwkvx_c.tokenizer import Tokenizer

__all__ = ["ByteTokenizer", "Corpus", "DataError", "BatchSampler", "load_corpus",
           "default_cache_dir", "eval_windows"]

VOCAB_BYTES = 256
# (name relative to its folder, path) of a source file; the name decides its split
Files = list[tuple[str, str]]
# a corpus argument: one path, several, or None for the standard library
DataPaths = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]], None]
_MAX_VOCAB = 2 ** 31 - 1   # token ids are int32 in the C API
_DTYPES = {"uint8": np.uint8, "u8": np.uint8, "uint16": np.uint16, "u16": np.uint16,
           "uint32": np.uint32, "u32": np.uint32}


class DataError(ValueError):
    """A corpus that cannot be used (missing, empty, unreadable, too small)."""


class ByteTokenizer:
    """Byte-level tokenizer: token i is byte i; vocab_size 256."""

    vocab_size = VOCAB_BYTES

    def encode(self, text: str | bytes) -> np.ndarray:
        """str (UTF-8) or bytes -> int32 (n,)."""
        b = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return np.frombuffer(b, dtype=np.uint8).astype(np.int32)

    def decode(self, tokens: Sequence[int] | np.ndarray) -> str:
        """Token ids -> str (invalid UTF-8 becomes U+FFFD)."""
        return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


@dataclass
class Corpus:
    """Train and validation tokens (1-D, memory-mapped where possible)."""
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    is_bytes: bool        # one token per byte: bits per byte = loss / ln 2
    description: str
    token_bytes: np.ndarray | None = None  # UTF-8 bytes each id decodes to (val_bpb's divisor)


def default_cache_dir() -> str:
    d = os.environ.get("RWKVX_CACHE")
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rwkvx_c")


def _is_val_file(rel: str) -> bool:
    h = hashlib.sha1(rel.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(h[:8], "big") % 50 == 0


def stdlib_files() -> tuple[str, Files]:
    """Sorted (relative path, absolute path) of the standard library's .py files."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs
                         if x not in ("site-packages", "dist-packages", "__pycache__"))
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(d, f)
                out.append((os.path.relpath(p, root).replace(os.sep, "/"), p))
    return root, sorted(out)


def _text_files(folder: str) -> Files:
    out = []
    for d, dirs, files in os.walk(folder):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for f in files:
            p = os.path.join(d, f)
            if f.startswith(".") or not os.path.isfile(p):
                continue
            try:
                with open(p, "rb") as fh:
                    if b"\0" in fh.read(8192):
                        continue
            except OSError:
                continue
            out.append((os.path.relpath(p, folder).replace(os.sep, "/"), p))
    return sorted(out)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True   # another user's process, or no PID we can judge: not ours to remove
    return True


def _sweep_orphans(folder: str, prefix: str = "") -> None:
    """Remove the temporaries in `folder` (.NAME.tmpPID files, NAME.tmpPID
    folders: rwkvx_c.atomic)
    whose writer is dead: a killed writer never renames its temporary into
    place, and nothing else would ever delete it. A live writer's stays."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        pid = writer_pid(name)
        if pid is None or not name.startswith(prefix) or _pid_alive(pid):
            continue
        p = os.path.join(folder, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):   # another sweeper may be first
                os.unlink(p)


def _atomic_concat(paths: Sequence[str], dest: str) -> int:
    with replacing(dest) as out:
        for p in paths:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
        return out.tell()


def _memmap(path: str, dtype: Any = np.uint8) -> np.ndarray:
    if os.path.getsize(path) == 0:  # numpy cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def _cache_dir_for(files: Files, label: str, cache_dir: str | None) -> str:
    """Cache folder keyed by the source label and every file's name, size and mtime."""
    sig = hashlib.sha1(label.encode("utf-8", "surrogateescape"))
    for rel, p in files:
        st = os.stat(p)
        sig.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    d = os.path.join(cache_dir or default_cache_dir(), sig.hexdigest()[:20])
    os.makedirs(d, exist_ok=True)
    _sweep_orphans(d)
    return d


def _cached_concat(d: str, name: str, paths: Sequence[str]) -> np.ndarray:
    """d/name holding the files' bytes back to back (built once, atomically), memory-mapped."""
    dest = os.path.join(d, name)
    if not os.path.exists(dest):
        _atomic_concat(paths, dest)
    return _memmap(dest)


def _split_by_file(files: Files, label: str, cache_dir: str | None, val_fraction: float,
                   min_len: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) memmaps split by file hash, or by the tail of the
    concatenation when a side would be shorter than min_len."""
    d = _cache_dir_for(files, label, cache_dir)
    train = _cached_concat(d, "train.bin", [p for rel, p in files if not _is_val_file(rel)])
    val = _cached_concat(d, "val.bin", [p for rel, p in files if _is_val_file(rel)])
    if len(train) >= min_len and len(val) >= min_len:
        return train, val
    whole = _cached_concat(d, "all.bin", [p for _, p in files])
    if len(whole) == 0:
        raise DataError(f"{what} holds no data: every file is empty")
    return _tail_split(whole, val_fraction, min_len, what)


def _tail_split(tokens: np.ndarray, val_fraction: float, min_len: int,
                what: str) -> tuple[np.ndarray, np.ndarray]:
    n = len(tokens)
    nval = max(int(n * val_fraction), min_len)
    if n - nval < min_len:
        raise DataError(f"{what} has {n} tokens: too few for a training and a validation "
                        f"split of at least {min_len} tokens each (seq_len + 1)")
    return tokens[: n - nval], tokens[n - nval:]


def _show(v: object) -> str:
    """A sidecar value for a one-line message: ASCII, and short whatever it holds."""
    s = ascii(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _bin_dtype(path: str) -> tuple[np.dtype, int | None]:
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
        hits = [p for p in parts[:-1] if p in _DTYPES]
        name = hits[-1] if hits else None
    elif not isinstance(name, str) or name not in _DTYPES:
        raise DataError(f"token sidecar {side}: dtype {_show(name)} is not uint8, uint16 "
                        "or uint32")
    if name not in _DTYPES:
        raise DataError(f"cannot tell the token dtype of {path}: name it *.u8.bin, *.u16.bin "
                        f"or *.u32.bin, or add {os.path.basename(side)} with "
                        '{"dtype": "uint16"}')
    vocab = info.get("vocab_size")
    # bool is an int to Python, and float vocabularies do not exist
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int)
                              or not 1 <= vocab <= _MAX_VOCAB):
        raise DataError(f"token sidecar {side}: vocab_size {_show(vocab)} is not an integer "
                        f"in [1, {_MAX_VOCAB}]")
    return np.dtype(_DTYPES[name]), vocab


def _load_bin(path: str, val_fraction: float, min_len: int) -> Corpus:
    dtype, vocab = _bin_dtype(path)
    size = os.path.getsize(path)
    if size == 0:
        raise DataError(f"token file {path} is empty")
    if size % dtype.itemsize:
        raise DataError(f"token file {path} has {size} bytes, not a multiple of "
                        f"{dtype.itemsize} ({dtype.name})")
    tokens = np.memmap(path, dtype=dtype, mode="r")
    # a sidecar's vocab_size is checked against the tokens: one below it would
    # only fail mid-training, at the first batch holding a larger id
    if not (dtype == np.uint8 and (vocab is None or vocab >= VOCAB_BYTES)):
        top = max(int(tokens[i:i + (1 << 24)].max())   # chunked so memory stays flat
                  for i in range(0, len(tokens), 1 << 24))
        if vocab is None:
            vocab = top + 1
        elif top >= vocab:
            raise DataError(f"token file {path} holds token id {top}, but its sidecar's "
                            f"vocab_size is {vocab}")
    elif vocab is None:
        vocab = VOCAB_BYTES
    train, val = _tail_split(tokens, val_fraction, min_len, f"token file {path}")
    return Corpus(train, val, int(vocab), dtype == np.uint8 and vocab <= VOCAB_BYTES,
                  f"{path} ({len(tokens):,} {dtype.name} tokens)")


def load_corpus(path: DataPaths = None, *, seq_len: int = 256, val_fraction: float = 0.02,
                cache_dir: str | None = None, tokenizer: Tokenizer | None = None,
                text_field: str = "text", progress: bool = False) -> Corpus:
    """The corpus at `path` (None: the standard-library default; a list:
    several paths); see the module doc. tokenizer (a rwkvx_c.tokenizer
    Tokenizer, None for bytes), JSON lines, binidx and several paths go
    through rwkvx_c.corpora, which tokenises once into the cache.

    Raises DataError with a one-line reason for a missing path, an empty
    corpus, an unreadable token file or a corpus too small for seq_len.
    """
    from rwkvx_c import corpora
    paths = None if path is None else [path] if isinstance(path, (str, os.PathLike)) \
        else list(path)
    if paths is not None and not paths:
        raise DataError("no data path given")
    byte = tokenizer is None or tokenizer.name == "byte"
    one = os.fspath(paths[0]) if paths is not None and len(paths) == 1 else None
    raw_bin = one is not None and one.endswith(".bin") and not corpora.is_binidx(one)
    if not raw_bin and ((paths is not None and one is None) or not byte
                        or (one is not None and corpora.needs_tokenizing(one))):
        from rwkvx_c.tokenizer import ByteTokenizer as _Bytes
        return corpora.load_tokenized(paths, tokenizer or _Bytes(), seq_len=seq_len,
                                      val_fraction=val_fraction, cache_dir=cache_dir,
                                      text_field=text_field, progress=progress)
    min_len = seq_len + 1
    if one is None:   # no path: several paths were tokenised above
        return _stdlib_corpus(cache_dir, val_fraction, min_len)
    if not os.path.exists(one):
        raise DataError(f"data path does not exist: {one}")
    if os.path.isdir(one):
        return _folder_corpus(one, cache_dir, val_fraction, min_len)
    if one.endswith(".bin"):
        return _token_file_corpus(one, tokenizer, val_fraction, min_len)
    return _text_file_corpus(one, val_fraction, min_len)


def _stdlib_corpus(cache_dir: str | None, val_fraction: float, min_len: int) -> Corpus:
    root, files = stdlib_files()
    if not files:
        raise DataError(f"no .py files found in the standard library at {root}")
    train, val = _split_by_file(files, "stdlib:" + root, cache_dir, val_fraction, min_len,
                                f"the standard library at {root}")
    return Corpus(train, val, VOCAB_BYTES, True,
                  f"Python standard library .py files ({len(files)} files, "
                  f"{len(train):,} train / {len(val):,} val bytes)")


def _folder_corpus(path: str, cache_dir: str | None, val_fraction: float,
                   min_len: int) -> Corpus:
    files = _text_files(path)
    if not files:
        raise DataError(f"no text files found in folder {path}")
    train, val = _split_by_file(files, "dir:" + os.path.abspath(path), cache_dir,
                                val_fraction, min_len, f"folder {path}")
    return Corpus(train, val, VOCAB_BYTES, True,
                  f"{path} ({len(files)} files, {len(train):,} train / {len(val):,} val bytes)")


def _token_file_corpus(path: str, tokenizer: Tokenizer | None, val_fraction: float,
                       min_len: int) -> Corpus:
    """A .bin token file, read with the vocabulary of a tokenizer other than bytes when given."""
    c = _load_bin(path, val_fraction, min_len)
    if tokenizer is not None and tokenizer.name != "byte":
        if c.vocab_size > tokenizer.vocab_size:
            raise DataError(f"token file {path} has ids up to {c.vocab_size - 1}, outside "
                            f"the tokenizer's vocabulary of {tokenizer.vocab_size}")
        c.vocab_size, c.token_bytes = tokenizer.vocab_size, tokenizer.token_lengths()
    return c


def _text_file_corpus(path: str, val_fraction: float, min_len: int) -> Corpus:
    try:
        if os.path.getsize(path) == 0:
            raise DataError(f"data file is empty: {path}")
        tokens = np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror}") from None
    train, val = _tail_split(tokens, val_fraction, min_len, f"data file {path}")
    return Corpus(train, val, VOCAB_BYTES, True,
                  f"{path} ({len(train):,} train / {len(val):,} val bytes)")

class BatchSampler:
    """Random (B, T) training windows from a 1-D token array.

    Each batch draws B start offsets uniformly from [0, len - T - 1] with a
    numpy PCG64 Generator seeded by `seed`; inputs are tokens[o:o+T], targets
    tokens[o+1:o+T+1]. state()/set_state() capture the generator and the
    number of batches drawn, so a restored sampler continues the same stream.
    """

    def __init__(self, tokens: np.ndarray, batch: int, seq_len: int, seed: int) -> None:
        if len(tokens) < seq_len + 1:
            raise DataError(f"corpus split of {len(tokens)} tokens is shorter than "
                            f"seq_len + 1 = {seq_len + 1}")
        self.tokens, self.batch, self.seq_len = tokens, int(batch), int(seq_len)
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.batches = 0

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), both int32 (B, T)."""
        T = self.seq_len
        offs = self.rng.integers(0, len(self.tokens) - T, size=self.batch)
        win = np.stack([np.asarray(self.tokens[o:o + T + 1]) for o in offs]).astype(np.int32)
        self.batches += 1
        return np.ascontiguousarray(win[:, :T]), np.ascontiguousarray(win[:, 1:])

    def state(self) -> dict[str, Any]:
        """JSON-serialisable sampler state."""
        return {"bit_generator": self.rng.bit_generator.state, "batches": self.batches}

    def set_state(self, st: dict[str, Any]) -> None:
        self.rng.bit_generator.state = st["bit_generator"]
        self.batches = int(st["batches"])


def eval_windows(tokens: np.ndarray, seq_len: int,
                 n_windows: int) -> tuple[np.ndarray, np.ndarray]:
    """Fixed validation windows: up to n_windows (T+1)-token windows at evenly
    spaced offsets covering the split (the same every call)."""
    T = seq_len
    span = len(tokens) - T - 1
    n = max(1, min(int(n_windows), span // T + 1 if span > 0 else 1))
    offs = np.linspace(0, max(span, 0), n).astype(np.int64)
    win = np.stack([np.asarray(tokens[o:o + T + 1]) for o in offs]).astype(np.int32)
    return np.ascontiguousarray(win[:, :T]), np.ascontiguousarray(win[:, 1:])
