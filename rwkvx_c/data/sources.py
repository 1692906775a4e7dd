"""Where a corpus's documents come from, and which split each file goes to.

``source_files(paths)`` turns the ``--data`` paths into a sorted list of
(name, path, kind) sources:

  - None (the default): the Python standard library's own ``.py`` files,
    found through ``sysconfig.get_paths()["stdlib"]`` (site-packages
    excluded), so every machine with Python has a corpus without a download;
  - a file: itself (kind ``jsonl`` / ``jsonl.gz`` / ``parquet`` / ``arrow``
    by its name, else ``text``);
  - a folder: every non-hidden regular text file below it (a file with a
    NUL byte in its first 8 KiB is binary and skipped) and every
    ``.jsonl.gz``, ``.parquet`` and ``.arrow`` file (binary, so found by
    name); hidden folders skipped;
  - a ``datasets.save_to_disk`` folder or ``hf:NAME[:CONFIG]`` (a dataset
    in the local Hugging Face datasets cache): its arrow files
    (rwkvx_c.data.tables), named by their path relative to the folder.

The split rule (``is_val_file``): a source goes to validation when the first
8 bytes of SHA-1(name) as a big-endian integer are divisible by 50 (about
2% of the files), where name is its path relative to its folder (a file
given directly: its base name), so the split never depends on how a path
is spelt. The pipeline falls back to a tail split when that leaves a side
without a full window (rwkvx_c.data.pipeline).
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Sequence

from rwkvx_c.data.tables import (
    HF_PREFIX,
    cached_dataset_files,
    datasets_files,
    is_datasets_folder,
)
from rwkvx_c.errors import DataError
from rwkvx_c.util.files import check_input

__all__ = ["Source", "BINARY_KINDS", "source_files", "stdlib_files", "text_files", "is_val_file",
           "kind_of",
           "STDLIB_LABEL", "VAL_MODULUS"]

# (name relative to its folder, path, kind: text, jsonl, jsonl.gz, parquet or arrow)
# of a source file
Source = tuple[str, str, str]
# the kinds found by their name (binary files), by the ending that names them
BINARY_KINDS = {".jsonl.gz": "jsonl.gz", ".parquet": "parquet", ".arrow": "arrow"}
VAL_MODULUS = 50
STDLIB_LABEL = "Python standard library .py files"
_SNIFF_BYTES = 8192
_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


def is_val_file(rel: str) -> bool:
    """True when the source named rel belongs to the validation split."""
    h = hashlib.sha1(rel.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(h[:8], "big") % VAL_MODULUS == 0


def kind_of(path: str) -> str:
    p = path.lower()
    if p.endswith(".jsonl"):
        return "jsonl"
    return next((kind for end, kind in BINARY_KINDS.items() if p.endswith(end)), "text")


def stdlib_files() -> tuple[str, list[tuple[str, str]]]:
    """(root, sorted (relative path, absolute path)) of the standard library's .py files."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(d, f)
                out.append((os.path.relpath(p, root).replace(os.sep, "/"), p))
    return root, sorted(out)


def _rel(p: str, folder: str) -> str:
    return os.path.relpath(p, folder).replace(os.sep, "/")


def text_files(folder: str) -> list[tuple[str, str]]:
    """Sorted (relative path, path) of the non-hidden text files below folder."""
    out = []
    for d, dirs, files in os.walk(folder):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for f in files:
            p = os.path.join(d, f)
            if f.startswith(".") or not os.path.isfile(p):
                continue
            try:
                with open(p, "rb") as fh:
                    if b"\0" in fh.read(_SNIFF_BYTES):
                        continue
            except OSError:
                continue
            out.append((_rel(p, folder), p))
    return sorted(out)


def _folder_sources(folder: str) -> list[Source]:
    if is_datasets_folder(folder):
        return [(_rel(p, folder), p, "arrow") for p in datasets_files(folder)]
    names = dict(text_files(folder))
    for d, dirs, found in os.walk(folder):   # binary files: found by name
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for f in found:
            if f.lower().endswith(tuple(BINARY_KINDS)) and not f.startswith("."):
                p = os.path.join(d, f)
                names[_rel(p, folder)] = p
    if not names:
        raise DataError(f"no text, .jsonl, .parquet or .arrow files found in folder {folder}")
    return [(rel, p, kind_of(p)) for rel, p in sorted(names.items())]


def source_files(paths: Sequence[str | os.PathLike[str]] | None) -> list[Source]:
    """(name, path, kind) of every source file, sorted within each path."""
    if paths is None:
        root, files = stdlib_files()
        if not files:
            raise DataError(f"no .py files found in the standard library at {root}")
        return [(rel, p, "text") for rel, p in files]
    out: list[Source] = []
    for path in (os.fspath(p) for p in paths):
        if path.startswith(HF_PREFIX) and not os.path.exists(path):
            arrows = cached_dataset_files(path[len(HF_PREFIX):])
            root = os.path.commonpath([os.path.dirname(p) for p in arrows])
            out += [(_rel(p, root), p, "arrow") for p in arrows]
            continue
        if not os.path.exists(path):
            raise DataError(f"data path does not exist: {path} (a dataset of the local "
                            f"Hugging Face cache is given as {HF_PREFIX}NAME)")
        check_input(path, DataError, "data path")   # a FIFO or a device: never read
        if os.path.isdir(path):
            out += _folder_sources(path)
        else:   # the split must not depend on how the path is spelt
            out.append((os.path.basename(path), path, kind_of(path)))
    return out
