"""The corpus pipeline: ``load_corpus`` for every tokenizer and source.

    paths -> sources (rwkvx_c.data.sources) -> tokens -> train / validation

Tokens come from one of three places, by what the paths hold:

  - a token file (a raw ``.bin`` or an RWKV-LM binidx pair; it must be the
    only path): memory-mapped as it is (rwkvx_c.data.formats). With a
    tokenizer other than bytes its ids must lie in that vocabulary, which
    becomes the corpus's; with bytes the vocabulary is the file's own (its
    sidecar's, else max id + 1; 256 for uint8);
  - one text file read as bytes: the file itself, memory-mapped, since the
    byte tokens of a text are its bytes;
  - anything else (the standard-library default, folders, JSON lines,
    several paths, any tokenizer): encoded once into the token cache
    (rwkvx_c.data.cache) and memory-mapped from there; chat records
    (rwkvx_c.data.chat) come with the masks of the tokens the loss is
    taken on (Corpus.train_mask, val_mask).

Splits: by file (rwkvx_c.data.sources.is_val_file) when the sources are
files; when that leaves a side shorter than a window (seq_len + 1 tokens),
and for a single file or a token file, the validation split is the last
``val_fraction`` of all tokens in source order instead.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import numpy as np

from rwkvx_c.data.cache import cached_tokens
from rwkvx_c.data.chat import ChatFormat
from rwkvx_c.data.formats import is_token_file, max_token, read_token_file
from rwkvx_c.data.sources import STDLIB_LABEL, Source, source_files
from rwkvx_c.data.tokenizers import ByteTokenizer
from rwkvx_c.errors import DataError
from rwkvx_c.util.files import check_input
from rwkvx_c.util.words import counted

if TYPE_CHECKING:
    from rwkvx_c.data.tokenizers import Tokenizer

__all__ = ["Corpus", "DataPaths", "load_corpus", "VOCAB_BYTES"]

VOCAB_BYTES = 256
# a corpus argument: one path, several, or None for the standard library
DataPaths = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]], None]


@dataclass
class Corpus:
    """Train and validation tokens (1-D, memory-mapped)."""
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    is_bytes: bool        # one token per byte: bits per byte = loss / ln 2
    description: str
    token_bytes: np.ndarray | None = None  # UTF-8 bytes each id decodes to (val_bpb's divisor)
    # chat data (rwkvx_c.data.chat): 1 on each token the loss is taken on; None: every token
    train_mask: np.ndarray | None = None
    val_mask: np.ndarray | None = None

    def described_as(self, saved: object) -> bool:
        """True when `saved` (a checkpoint's) describes this corpus; a corpus
        of one file was "(1 files, ..." in runs saved before the singular."""
        old = self.description.replace(COMPRESSED, " bytes)")   # before compressed sizes were told
        return saved in tuple(d.replace("(1 file,", "(1 files,") if one else d
                              for d in (self.description, old) for one in (False, True))


# how a description ends when its files' sizes are compressed ones (tables, .jsonl.gz)
COMPRESSED = " bytes of compressed files)"


def tail_split(tokens: np.ndarray, val_fraction: float, min_len: int,
               what: str) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): the last val_fraction of tokens (at least min_len) is val."""
    n = len(tokens)
    nval = max(int(n * val_fraction), min_len)
    if n - nval < min_len:
        raise DataError(f"{what} has {n} tokens: too few for a training and a validation "
                        f"split of at least {min_len} tokens each (seq_len + 1)")
    return tokens[: n - nval], tokens[n - nval:]


def _describe(paths: list[str] | None, files: list[Source], tok: Tokenizer, train: np.ndarray,
              val: np.ndarray, source_bytes: int) -> str:
    """The description of a cached corpus. A resumed run compares it with
    the one its checkpoint stored (Corpus.described_as), so it keeps the
    spellings runs have stored: plain text files of the default corpus or of one folder,
    read as bytes, count bytes; every other cached corpus counts the
    tokenizer's tokens and the bytes they came from."""
    in_bytes = tok.name == "byte" and all(kind == "text" for _, _, kind in files) and \
        (paths is None or (len(paths) == 1 and os.path.isdir(paths[0])))
    if paths is not None:
        what = ", ".join(paths)
    else:
        what = STDLIB_LABEL if in_bytes else "the standard library"
    if in_bytes:
        return (f"{what} ({counted(len(files), 'file')}, {len(train):,} train / {len(val):,} "
                "val bytes)")
    # a .parquet, .arrow or .jsonl.gz file's size is no count of its text's bytes
    packed = any(kind != "text" for _, _, kind in files)
    return (f"{what} ({counted(len(files), 'file')}, {len(train):,} train / {len(val):,} val "
            f"{tok.identity()['name']} tokens from {source_bytes:,}"
            + (COMPRESSED if packed else " bytes)"))


def _token_file_corpus(path: str, tok: Tokenizer, val_fraction: float, min_len: int) -> Corpus:
    f = read_token_file(path)
    declared = f.vocab_size
    if not (f.tokens.dtype == np.uint8 and (declared is None or declared >= VOCAB_BYTES)):
        lo, hi = max_token(f.tokens)
        if lo < 0:
            raise DataError(f"token file {path} holds a negative token id ({lo})")
        if declared is not None and hi >= declared:
            raise DataError(f"token file {path} holds token id {hi}, but its sidecar's "
                            f"vocab_size is {declared}")
        vocab = declared if declared is not None else hi + 1
    else:
        vocab = declared if declared is not None else VOCAB_BYTES
    token_bytes = None
    if tok.name != "byte":
        if vocab > tok.vocab_size:
            raise DataError(f"token file {path} has ids up to {vocab - 1}, outside the "
                            f"{tok.identity()['name']} tokenizer's vocabulary of "
                            f"{tok.vocab_size}: pass --tokenizer with the vocabulary it was "
                            "made with")
        vocab, token_bytes = tok.vocab_size, tok.token_lengths()
    train, val = tail_split(f.tokens, val_fraction, min_len, f"token file {path}")
    if f.documents is not None:
        what = (f"binidx, {f.documents:,} documents, {len(train):,} train / {len(val):,} val "
                f"{tok.identity()['name']} tokens")
    else:
        what = f"{len(f.tokens):,} {f.tokens.dtype.name} tokens"
    is_bytes = tok.name == "byte" and vocab <= VOCAB_BYTES
    return Corpus(train, val, int(vocab), is_bytes, f"{path} ({what})", token_bytes)


def _mapped_text_corpus(path: str, val_fraction: float, min_len: int) -> Corpus:
    """One text file as bytes: the file is its own token array."""
    try:
        if os.path.getsize(path) == 0:
            raise DataError(f"data file is empty: {path}")
        tokens = np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror}") from None
    train, val = tail_split(tokens, val_fraction, min_len, f"data file {path}")
    return Corpus(train, val, VOCAB_BYTES, True,
                  f"{path} ({len(train):,} train / {len(val):,} val bytes)")


def _cached_corpus(paths: list[str] | None, files: list[Source], tok: Tokenizer, *,
                   val_fraction: float, min_len: int, cache_dir: str | None, text_field: str,
                   progress: bool, chat: ChatFormat) -> Corpus:
    c = cached_tokens(files, tok, text_field=text_field, cache_dir=cache_dir, progress=progress,
                      chat=chat)
    train, val, tmask, vmask = c.train, c.val, c.train_mask, c.val_mask
    if min(len(train), len(val)) < min_len:
        what = STDLIB_LABEL if paths is None else ", ".join(paths)
        whole = c.all_tokens()
        if len(whole) == 0:
            raise DataError(f"{what} holds no text")
        train, val = tail_split(whole, val_fraction, min_len, what)
        mask = c.all_mask()
        if mask is not None:   # the same cut through the masks
            tmask, vmask = mask[:len(train)], mask[len(train):]
    byte = tok.name == "byte"
    what = _describe(paths, files, tok, train, val, c.source_bytes)
    if tmask is not None:
        what += f", chat: {c.conversations:,} conversations"
    return Corpus(train, val, tok.vocab_size, byte, what,
                  None if byte else tok.token_lengths(), tmask, vmask)


def load_corpus(path: DataPaths = None, *, seq_len: int = 256, val_fraction: float = 0.02,
                cache_dir: str | None = None, tokenizer: Tokenizer | None = None,
                text_field: str = "text", progress: bool = False,
                chat: ChatFormat | None = None) -> Corpus:
    """The corpus at `path` (None: the standard-library default; a list:
    several paths, read in order) in tokenizer's ids (None: bytes), chat
    records rendered as chat says (RWKV's template by default); see the
    module doc. Raises DataError with a one-line reason for a missing path,
    an empty corpus, an unreadable file or a corpus too small for seq_len."""
    tok = tokenizer or ByteTokenizer()
    paths = None if path is None else [os.fspath(path)] if isinstance(path, (str, os.PathLike)) \
        else [os.fspath(p) for p in path]
    if paths is not None and not paths:
        raise DataError("no data path given")
    min_len = seq_len + 1
    if paths is not None and any(is_token_file(p) for p in paths):
        if len(paths) != 1:
            raise DataError("a token file (.bin or binidx) must be the only --data path")
        if not os.path.exists(paths[0]):
            raise DataError(f"data path does not exist: {paths[0]}")
        check_input(paths[0], DataError, "data path")
        return _token_file_corpus(paths[0], tok, val_fraction, min_len)
    files = source_files(paths)
    if paths is not None and len(paths) == 1 and tok.name == "byte" \
            and not os.path.isdir(paths[0]) and files[0][2] == "text":
        return _mapped_text_corpus(paths[0], val_fraction, min_len)
    return _cached_corpus(paths, files, tok, val_fraction=val_fraction, min_len=min_len,
                          cache_dir=cache_dir, text_field=text_field, progress=progress,
                          chat=chat or ChatFormat())
