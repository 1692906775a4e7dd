"""A fine-tune's base: the source a state, LoRA or partly frozen run's
checkpoint refers to instead of holding a copy of it (docs/finetune.md
§Checkpoints of a fine-tune).

The checkpoint names the base by absolute path and by content: the SHA-256
of its files (a file source: the file; a run folder: its checkpoint; any
other folder, a Hugging Face model: its regular files in name order, each
hashed with its name and size), computed in one streaming pass when the
run starts. Beside it the checkpoint keeps each file's size and mtime_ns:
a reader whose base still has them trusts the hash without reading the
base again (the make / rsync rule), and says so in one warning line (a
same-size file put there with its mtime restored would pass); any other
file at the path, a base named anew (``--base PATH``), or a reader for
which one more pass is cheap beside its own work (a resume, an export or
merge that reads every weight: ``rehash``) hashes it, and it must give the
recorded hash. The base is a regular file or a folder (a FIFO or a device
is refused before it is opened: rwkvx_c.util.files.check_input).
"""
from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Mapping
from typing import Any

from rwkvx_c.errors import RwkvxError, RwkvxWarning
from rwkvx_c.util.files import check_input

__all__ = ["BASE_KEY", "identify", "check_base", "short"]

BASE_KEY = "base"      # the run state's record of the base
_CHUNK = 1 << 24       # bytes per read of the streaming hash
_CHECKPOINT = "checkpoint.safetensors"   # a run folder's (rwkvx_c.run.rundir.CHECKPOINT)

# the record: {"path": abs path, "sha256": hex, "files": [[name, size, mtime_ns], ...]}
Record = dict[str, Any]


def _files(path: str) -> list[str]:
    """The files whose bytes make up the source at path."""
    if not os.path.isdir(path):
        return [path]
    own = os.path.join(path, _CHECKPOINT)
    if os.path.isfile(own):
        return [own]
    return sorted(os.path.join(path, n) for n in os.listdir(path)
                  if not n.startswith(".") and os.path.isfile(os.path.join(path, n)))


def _stats(path: str) -> list[list[Any]]:
    out = []
    for f in _files(path):
        st = os.stat(f)
        out.append([os.path.relpath(f, path) if f != path else "", st.st_size, st.st_mtime_ns])
    return out


def _digest(path: str) -> str:
    """SHA-256 over every file of the source: name, size, then its bytes."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    for f in _files(path):
        h.update(f"{os.path.relpath(f, path) if f != path else ''}\0"
                 f"{os.path.getsize(f)}\0".encode())
        with open(f, "rb") as fh:
            while n := fh.readinto(buf):
                h.update(view[:n])
    return h.hexdigest()


def identify(path: str) -> Record:
    """The record of the base at path (one pass over its bytes)."""
    p = os.path.abspath(path)
    return {"path": p, "sha256": _digest(p), "files": _stats(p)}


def short(record: Mapping[str, Any]) -> str:
    """'sha256 0123456789abcdef' for messages."""
    return f"sha256 {str(record.get('sha256'))[:16]}"


def check_base(record: object, run: str, override: str | None,
               error: type[RwkvxError], rehash: bool = False) -> Record:
    """The record of the base a run refers to (record: its checkpoint's),
    found at override (--base PATH) when given, else at the recorded path,
    and checked to hold the recorded content (rehash: hashed again even
    when its files' sizes and mtimes are the recorded ones; else such a
    base is trusted, with a warning line saying so); the record returned
    names where it is now. error (one line naming the run, the base and
    --base) when it is missing, no regular file or folder, or its content
    differs."""
    if not isinstance(record, dict) or not isinstance(record.get("path"), str) \
            or not isinstance(record.get("sha256"), str):
        raise error(f"{run} names its base badly ({record!r}); the checkpoint is damaged")
    path = os.path.abspath(override) if override else record["path"]
    if not os.path.exists(path):
        if override:
            raise error(f"--base {override} is missing; give the path of the base of {run} "
                        f"(it was {record['path']}) with --base PATH")
        raise error(f"the base {path} of {run} is missing (moved or deleted?); give its path "
                    "now with --base PATH")
    check_input(path, error, "--base" if override else f"the base of {run}")
    try:
        if not rehash and path == record["path"] and _stats(path) == record.get("files"):
            warnings.warn(RwkvxWarning(
                f"the base {path} of {run} is taken as the one recorded ({short(record)}) on "
                "its files' sizes and modification times, not hashed again"), stacklevel=2)
            return dict(record)   # unchanged since it was hashed: no pass over it
        now = identify(path)
    except OSError as e:
        raise error(f"cannot read the base {path} of {run}: {e.strerror or e}") from None
    if now["sha256"] != record["sha256"]:
        was = f"the base {record['path']} of {run} ({short(record)})"
        raise error(f"{path} ({short(now)}) is not {was}: it changed or is another file; "
                    "give the original's path with --base PATH")
    return now
