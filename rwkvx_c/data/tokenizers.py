"""Tokenizers: bytes, the RWKV World vocabulary, and Hugging Face tokenizer.json files.

``load(spec)`` with spec:
  - ``"byte"``: one token per byte, vocab 256 (the default; needs nothing).
  - ``"world"``: the RWKV World vocabulary (65,536 ids), greedy longest match
    over a byte trie, ids identical to the ``rwkv`` package's TRIE_TOKENIZER.
    The vocabulary file is read at run time from the installed ``rwkv``
    package (extra ``world``); the trie and the encoder are C
    (csrc/tokenize.c), threaded over documents and within long texts.
  - a path to a ``tokenizer.json``: a Hugging Face tokenizer used through
    the ``tokenizers`` library (extra ``hf``); ``train_bpe`` fits a byte-level
    BPE one on your corpus.

Every tokenizer has ``encode(str | bytes) -> int32 array``, ``decode(ids) ->
bytes``, ``vocab_size``, ``token_lengths()`` (the UTF-8 bytes each id decodes
to, which val_bpb divides by) and ``identity()`` (name and SHA-256 of the
vocabulary), which a run stores so that resuming or sampling with another
tokenizer is refused. ``save(folder)`` writes what a run folder needs to load
the tokenizer again without the original file (``run_tokenizer``).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Union

import numpy as np

from rwkvx_c import _core
from rwkvx_c.errors import TokenizerError
from rwkvx_c.run.rundir import TOKENIZER, claim_output
from rwkvx_c.util.atomic import replace_with, replacing
from rwkvx_c.util.files import check_input, open_input

__all__ = [
    "WORLD_VOCAB",
    "MAX_TOKENIZER_VOCAB",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "TokenizerError",
    "WorldTokenizer",
    "load",
    "run_tokenizer",
    "train_bpe",
    "world_vocab_path",
]

Text = Union[str, bytes, bytearray, memoryview]
WORLD_VOCAB = "rwkv_vocab_v20230424.txt"
WORLD_VOCAB_SIZE = 65536   # the World models' embedding rows (ids 0..65529 used)
# The most ids a tokenizer.json may have or train_bpe may fit: far past any
# real vocabulary (256k), and what the tokenizers library trains in a 4 GiB
# address space (at 10^9 it aborts the process allocating, at 2^32 its u32
# ids overflow)
MAX_TOKENIZER_VOCAB = 1 << 24


def _as_bytes(text: Text) -> bytes:
    return text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)


def _threads() -> int:
    return max(1, _core.get_num_threads())


class Tokenizer:
    """Interface every tokenizer implements (see the module doc)."""

    name = "tokenizer"
    vocab_size = 0

    def encode(self, text: Text) -> np.ndarray:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> bytes:
        raise NotImplementedError

    def token_lengths(self) -> np.ndarray:
        raise NotImplementedError

    def identity(self) -> dict:
        raise NotImplementedError

    def encode_docs(self, docs: Sequence[bytes]) -> list:
        """Each document encoded on its own (no token crosses a document end)."""
        return [self.encode(d) for d in docs]

    def encode_piece(self, data: bytes, final: bool) -> tuple:
        """(ids, consumed) for a piece of a longer document: the ids of
        data[:consumed]; data[consumed:] must start the next piece. Exact for
        byte and trie tokenizers; HF tokenizers cut after the piece's last
        newline (a long document is encoded line-block by line-block)."""
        if final:
            return self.encode(data), len(data)
        # a piece with no line end is cut after a space, else taken whole,
        # so what is carried over stays bounded
        cut = data.rfind(b"\n") + 1 or data.rfind(b" ") + 1 or len(data)
        return self.encode(data[:cut]), cut

    def save(self, folder: str) -> None:
        """Write into a run folder whatever run_tokenizer needs besides identity()."""


class ByteTokenizer(Tokenizer):
    """Token i is byte i; vocab_size 256."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: Text) -> np.ndarray:
        return np.frombuffer(_as_bytes(text), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int]) -> bytes:
        a = np.asarray(ids)
        if a.size and (a.min() < 0 or a.max() > 255):
            raise TokenizerError("byte tokenizer ids must lie in [0, 256)")
        return a.astype(np.uint8).tobytes()

    def token_lengths(self) -> np.ndarray:
        return np.ones(256, dtype=np.int32)

    def encode_piece(self, data: bytes, final: bool) -> tuple:
        return self.encode(data), len(data)

    def encode_docs(self, docs: Sequence[bytes]) -> list:
        # the token cache stores bytes as uint8: the bytes themselves, no int32 copy
        return [np.frombuffer(d, dtype=np.uint8) for d in docs]

    def identity(self) -> dict:
        return {"name": "byte", "sha256": None}


def parse_vocab_file(path: str) -> list:
    """(bytes, id) entries of an RWKV vocabulary file: lines 'ID LITERAL LEN',
    LITERAL a Python str or bytes literal, LEN its UTF-8 byte length."""
    entries = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                i = int(line[:line.index(" ")])
                x = ast.literal_eval(line[line.index(" "):line.rindex(" ")].strip())
                x = x.encode("utf-8") if isinstance(x, str) else x
                ok = isinstance(x, bytes) and len(x) == int(line[line.rindex(" "):])
            except (ValueError, SyntaxError):
                ok = False
            if not ok:
                raise TokenizerError(f"{path}:{n}: not a vocabulary line 'ID LITERAL LEN'")
            entries.append((x, i))
    return entries


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for blk in iter(lambda: f.read(1 << 20), b""):
            h.update(blk)
    return h.hexdigest()


def world_vocab_path() -> str:
    """The World vocabulary file shipped by the installed `rwkv` package."""
    spec = importlib.util.find_spec("rwkv")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError("the World tokenizer reads its vocabulary from the rwkv package: "
                             'pip install "rwkvx_c[world]"')
    for d in spec.submodule_search_locations:
        p = os.path.join(d, WORLD_VOCAB)
        if os.path.isfile(p):
            return p
    raise TokenizerError(f"the installed rwkv package has no {WORLD_VOCAB}: "
                         'pip install -U "rwkvx_c[world]"')


@functools.lru_cache(maxsize=4)
def _build_trie(path: str, size: int, mtime_ns: int, vocab_size: int) -> tuple:
    """(ByteTrie, id -> bytes, file SHA-256) of a vocabulary file; cached by
    path, size and mtime (a trainer and its sampler load it more than once)."""
    entries = parse_vocab_file(path)
    if not entries or max(i for _, i in entries) >= vocab_size:
        raise TokenizerError(f"{path}: ids exceed vocab_size {vocab_size}")
    try:
        trie = _core.ByteTrie(entries, vocab_size)
    except ValueError as e:
        raise TokenizerError(f"{path}: {e}") from None
    table = [b""] * vocab_size
    for b, i in entries:
        table[i] = b
    return trie, table, _sha256_file(path)


DECODE_CHUNK = 1 << 16   # ids gathered at once by _Pieces.join


def _id_array(ids: Iterable[int]) -> np.ndarray:
    """ids as a flat integer array: an integer array as it is (no int64
    copy of millions of ids), anything else converted."""
    a = np.asarray(ids)
    return (a if a.dtype.kind in "iu" and a.size else a.astype(np.int64)).reshape(-1)


class _Pieces:
    """The bytes of every id as one buffer and offsets, so that decoding
    millions of ids gathers them with NumPy into the output, chunk by chunk,
    instead of building a Python list of millions of pieces."""

    def __init__(self, table: Sequence[bytes]) -> None:
        self.offs = np.zeros(len(table) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in table], out=self.offs[1:])
        self.blob = np.frombuffer(b"".join(table), dtype=np.uint8)

    def join(self, ids: np.ndarray) -> bytes:
        """The bytes of ids (int64, every one in range), concatenated; beside
        the output, memory stays at a chunk's worth."""
        parts = []
        for i in range(0, len(ids), DECODE_CHUNK):
            c = ids[i:i + DECODE_CHUNK]
            s, n = self.offs[c], self.offs[c + 1] - self.offs[c]
            ends = np.cumsum(n)
            if len(ends) and ends[-1]:
                # byte j of the chunk comes from the piece it falls in, at its offset there
                parts.append(self.blob[np.arange(ends[-1]) + np.repeat(s - (ends - n), n)]
                             .tobytes())
        return b"".join(parts)


class WorldTokenizer(Tokenizer):
    """Greedy longest match over a byte trie (the RWKV World rule), in C."""

    name = "world"

    def __init__(self, path: str | None = None, vocab_size: int = WORLD_VOCAB_SIZE):
        self.path = path or world_vocab_path()
        st = os.stat(self.path)
        self._trie, self._bytes, self._sha = _build_trie(self.path, st.st_size, st.st_mtime_ns,
                                                         vocab_size)
        self.vocab_size = vocab_size
        self._pieces = _Pieces(self._bytes)
        self.threads = None   # None: the rwkvx_c thread count

    def _nt(self) -> int:
        return self.threads or _threads()

    def encode(self, text: Text) -> np.ndarray:
        return self._trie.encode(_as_bytes(text), True, self._nt())

    def encode_piece(self, data: bytes, final: bool) -> tuple:
        if final:
            return self._trie.encode(data, True, self._nt()), len(data)
        return self._trie.encode(data, False, self._nt())

    def encode_docs(self, docs: Sequence[bytes]) -> list:
        offs = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum([len(d) for d in docs], out=offs[1:])
        ids, counts = self._trie.encode_docs(b"".join(docs), offs, self._nt())
        return np.split(ids, np.cumsum(counts)[:-1]) if len(docs) else []

    def decode(self, ids: Iterable[int]) -> bytes:
        a = _id_array(ids)
        if a.size and (a.min() < 0 or a.max() >= self.vocab_size):
            raise TokenizerError(f"World ids must lie in [0, {self.vocab_size})")
        return self._pieces.join(a)

    def token_lengths(self) -> np.ndarray:
        return self._trie.token_lengths()

    def identity(self) -> dict:
        return {"name": "world", "file": os.path.basename(self.path), "sha256": self._sha}


def _byte_level_table() -> dict:
    """The GPT-2 byte-level alphabet: printable stand-in character -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + \
        list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError("tokenizer.json files need the tokenizers package: "
                             'pip install "rwkvx_c[hf]"') from None
    return tokenizers


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer.json through the `tokenizers` library.

    decode gives exact bytes for byte-level tokenizers (the ones train_bpe
    writes); for others it is the library's decode, UTF-8 encoded. Input
    bytes that are not UTF-8 are replaced by U+FFFD before encoding.
    """

    name = "hf"

    def __init__(self, path: str):
        tk = _import_tokenizers()
        try:
            with open_input(path, TokenizerError, "tokenizer") as f:
                self._json = f.read()
            self._tok = tk.Tokenizer.from_str(self._json.decode("utf-8"))
            spec = json.loads(self._json)
            added = {int(t["id"]): str(t["content"]).encode("utf-8")
                     for t in spec.get("added_tokens") or []}
            dec = spec.get("decoder") or {}
        except OSError as e:
            raise TokenizerError(f"cannot read tokenizer {path}: {e.strerror}") from None
        except TokenizerError:
            raise
        except Exception as e:  # noqa: BLE001 -- tokenizers raises plain Exception
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TokenizerError(f"{path} is not a tokenizers tokenizer.json: {first}") from None
        self.path = path
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        top = max(ids, default=-1)
        # ids may leave gaps (holes decode to nothing); the vocabulary is the
        # largest id + 1, which a model must be able to hold
        if min(ids, default=0) < 0 or top >= MAX_TOKENIZER_VOCAB:
            raise TokenizerError(f"{path} has token ids up to {top}; a vocabulary holds at "
                                 f"most {MAX_TOKENIZER_VOCAB:,} ids (0..{MAX_TOKENIZER_VOCAB - 1})")
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), top + 1)
        self._bytes = None
        if isinstance(dec, dict) and dec.get("type") == "ByteLevel":
            # exact per-token bytes from the alphabet
            alpha = _byte_level_table()
            table = [b""] * self.vocab_size
            for s, i in self._tok.get_vocab(with_added_tokens=True).items():
                table[i] = added[i] if i in added else bytes(alpha[c] for c in s if c in alpha)
            self._bytes = table
        self._pieces = _Pieces(self._bytes) if self._bytes is not None else None
        self._sha = hashlib.sha256(self._json).hexdigest()

    @staticmethod
    def _text(text: Text) -> str:
        return text if isinstance(text, str) else bytes(text).decode("utf-8", "replace")

    def encode(self, text: Text) -> np.ndarray:
        return np.asarray(self._tok.encode(self._text(text), add_special_tokens=False).ids,
                          dtype=np.int32)

    def encode_docs(self, docs: Sequence[bytes]) -> list:
        out = self._tok.encode_batch([self._text(d) for d in docs], add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in out]

    def decode(self, ids: Iterable[int]) -> bytes:
        a = _id_array(ids)
        if a.size and (a.min() < 0 or a.max() >= self.vocab_size):
            raise TokenizerError(f"ids must lie in [0, {self.vocab_size})")
        if self._pieces is not None:
            return self._pieces.join(a)
        return self._tok.decode(a.tolist(), skip_special_tokens=False).encode("utf-8")

    def token_lengths(self) -> np.ndarray:
        if self._bytes is not None:
            return np.array([len(b) for b in self._bytes], dtype=np.int32)
        return np.array([len(self.decode([i])) for i in range(self.vocab_size)], dtype=np.int32)

    def identity(self) -> dict:
        return {"name": "hf", "sha256": self._sha}

    def save(self, folder: str) -> None:
        with replacing(os.path.join(folder, TOKENIZER)) as f:
            f.write(self._json)


def load(spec: str = "byte") -> Tokenizer:
    """"byte", "world", or the path of a tokenizer.json (see the module doc)."""
    spec = os.fspath(spec)
    if spec == "byte":
        return ByteTokenizer()
    if spec == "world":
        return WorldTokenizer()
    check_input(spec, TokenizerError, "tokenizer")   # a FIFO or a device: never read
    if not os.path.isfile(spec):
        raise TokenizerError(f"unknown tokenizer {spec!r}: use byte, world or the path of "
                             "a tokenizer.json")
    return HFTokenizer(spec)


def run_tokenizer(folder: str, ident: dict | None) -> Tokenizer:
    """The tokenizer a run in `folder` was trained with (identity `ident`,
    None for runs that predate tokenizers: bytes). Raises TokenizerError when
    it cannot be had or no longer matches the stored hash."""
    if ident is not None and not isinstance(ident, dict):
        raise TokenizerError(f"the run in {folder} names its tokenizer as {ident!r}, "
                             "not as a name and hash")
    if not ident or ident.get("name") == "byte":
        return ByteTokenizer()
    if ident.get("name") == "world":
        tok: Tokenizer = WorldTokenizer()
    elif ident.get("name") == "hf":
        p = os.path.join(folder, TOKENIZER)
        if not os.path.isfile(p):
            raise TokenizerError(f"the run in {folder} used a tokenizer.json that is missing "
                                 f"from it ({p})")
        tok = HFTokenizer(p)
    else:
        raise TokenizerError(f"the run in {folder} names an unknown tokenizer {ident!r}")
    check_identity(tok, ident, f"the run in {folder}")
    return tok


def check_identity(tok: Tokenizer, ident: dict | None, what: str) -> None:
    """TokenizerError unless tok is the tokenizer `ident` describes."""
    mine = tok.identity()
    theirs = ident or {"name": "byte", "sha256": None}
    # an identity without a hash names a vocabulary only (an imported World model)
    same_hash = (theirs.get("sha256") is None and theirs.get("name") != "byte") \
        or mine["sha256"] == theirs.get("sha256")
    if mine["name"] != theirs.get("name") or not same_hash:
        def show(d: dict) -> str:
            return d["name"] + (f" (sha256 {d['sha256'][:12]})" if d.get("sha256") else "")
        raise TokenizerError(f"{what} was trained with tokenizer {show(theirs)}, not "
                             f"{show(mine)}")


def train_bpe(docs: Iterable[bytes], vocab_size: int, out: str, *, length: int | None = None,
              progress: bool = True, inputs: Iterable[str] = ()) -> HFTokenizer:
    """Fit a byte-level BPE of vocab_size ids (>= 256 + 1) on docs and write
    its tokenizer.json to out (atomically). Returns it loaded. out must not
    be one of `inputs` (the corpus files) nor a run folder's own file
    (rwkvx_c.run.rundir.claim_output)."""
    tk = _import_tokenizers()
    if not 257 <= vocab_size <= MAX_TOKENIZER_VOCAB:
        raise TokenizerError(f"a byte-level BPE needs a vocab_size in 257..{MAX_TOKENIZER_VOCAB:,}"
                             f", got {vocab_size:,}")
    claim_output(out, inputs)
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tk.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])

    def texts() -> Iterator[str]:
        for d in docs:
            yield d.decode("utf-8", "replace")

    tok.train_from_iterator(texts(), trainer=trainer, length=length)
    replace_with(out, tok.save)
    return HFTokenizer(out)

