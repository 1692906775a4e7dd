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

A fine-tune of a run pins it (pin_source): the run's checkpoint as it is
when the tune starts becomes a file of the tune's folder, source-SHA.safetensors
(a hard link: the run's later saves replace its checkpoint by rename and
leave the link's version alone; else a copy with the same modification
time), and the base record names that pin. So does the run's own base,
down the chain, when it is a run checkpoint: a reader (check_base) whose
recorded path is missing or changed takes the pin named by the record's
hash from the folder of the checkpoint it reads. Continuing, resuming or
deleting the source run then leaves the tune whole; a source resumed while
tunes pin it says so (pinned_by). A run recorded before pins, whose base
run moved on, is told in one line which snapshot of that run
(--keep-last, --keep-best, its pins) holds the recorded checkpoint.
"""
from __future__ import annotations

import hashlib
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

from rwkvx_c.errors import RwkvxError, RwkvxWarning
from rwkvx_c.run.checkpoint import read_state
from rwkvx_c.run.rundir import CHECKPOINT, RunDir, checkpoint_path
from rwkvx_c.util.atomic import publish
from rwkvx_c.util.files import check_input

__all__ = ["BASE_KEY", "identify", "check_base", "short", "pin_source", "pinned_by"]

BASE_KEY = "base"      # the run state's record of the base
_CHUNK = 1 << 24       # bytes per read of the streaming hash

# the record: {"path": abs path, "sha256": hex, "files": [[name, size, mtime_ns], ...]}
Record = dict[str, Any]


def _files(path: str) -> list[str]:
    """The files whose bytes make up the source at path."""
    if not os.path.isdir(path):
        return [path]
    own = os.path.join(path, CHECKPOINT)
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


def _digest(path: str, as_name: str | None = None) -> str:
    """SHA-256 over every file of the source: name, size, then its bytes
    (as_name: the name a file source is hashed under)."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    for f in _files(path):
        name = as_name if as_name is not None else os.path.relpath(f, path) if f != path else ""
        h.update(f"{name}\0{os.path.getsize(f)}\0".encode())
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


def _one_file(record: Mapping[str, Any]) -> list[Any] | None:
    """[name, size, mtime_ns] of a record of one file (a checkpoint file, or
    a run folder's checkpoint), else None."""
    files = record.get("files")
    if isinstance(files, list) and len(files) == 1 and isinstance(files[0], list) \
            and len(files[0]) == 3:
        return files[0]
    return None


def _sha_as(record: Mapping[str, Any], path: str) -> str:
    """The hash of the source at path taken as the record's was: a file
    standing for a record of one file (a snapshot or pin of a run folder's
    checkpoint) hashed under that file's recorded name."""
    one = _one_file(record)
    if one is not None and os.path.isfile(path):
        return _digest(path, str(one[0]))
    return _digest(path)


def _unchanged(record: Mapping[str, Any], path: str) -> bool:
    """True when path's files have the recorded sizes and mtimes (a pin, a
    hard link or a copy of the recorded file, has those of its one file)."""
    one = _one_file(record)
    if one is not None and os.path.isfile(path):
        st = os.stat(path)
        return [st.st_size, st.st_mtime_ns] == one[1:]
    return path == record["path"] and _stats(path) == record.get("files")


def _sha_ok(record: Mapping[str, Any]) -> bool:
    """True when the record's hash is 64 hex digits: only then does it name
    a pin (a tampered record never names a path outside the folder)."""
    return re.fullmatch("[0-9a-f]{64}", str(record.get("sha256"))) is not None


def _folder(run: str) -> str:
    return run if os.path.isdir(run) else os.path.dirname(os.path.abspath(run))


def _located(record: Mapping[str, Any], run: str) -> str:
    """Where the base of the checkpoint at run lies: its recorded path while
    that holds the recorded files, else the pin of it beside the checkpoint
    when there is one, else the recorded path (whose check then fails)."""
    path: str = record["path"]
    try:
        if os.path.exists(path) and _unchanged(record, path):
            return path
    except OSError:
        pass
    if not _sha_ok(record):
        return path
    pin = RunDir(_folder(run)).pin(str(record["sha256"]))
    return pin if os.path.isfile(pin) else path


def _rescue(record: Mapping[str, Any]) -> str:
    """'; X holds it: give --base X' when a checkpoint of the recorded base's
    run folder (its snapshots, best checkpoint or pins) is the recorded one,
    else ''."""
    one = _one_file(record)
    path = str(record["path"])
    if one is None:
        return ""
    run = RunDir(path if os.path.isdir(path) or not os.path.splitext(path)[1]
                 else os.path.dirname(path))
    found = [run.checkpoint, run.best] + run.snapshots() + run.pins()
    same = [f for f in found if os.path.isfile(f) and os.path.getsize(f) == one[1]]
    same.sort(key=lambda f: os.stat(f).st_mtime_ns != one[2])   # a link's mtime first
    for f in same:
        try:
            if _digest(f, str(one[0])) == record["sha256"]:
                return f"; {f} holds it: give --base {f}"
        except OSError:
            continue
    return ""


def check_base(record: object, run: str, override: str | None,
               error: type[RwkvxError], rehash: bool = False) -> Record:
    """The record of the base a run refers to (record: its checkpoint's,
    run: that checkpoint or its folder), found at override (--base PATH)
    when given, else at the recorded path or the pin of it beside run, and
    checked to hold the recorded content (rehash: hashed again even when
    its files' sizes and mtimes are the recorded ones; else such a base is
    trusted, with a warning line saying so); the record returned names
    where it is now. error (one line naming the run, the base and --base,
    and the snapshot that holds the base when one does) when it is
    missing, no regular file or folder, or its content differs."""
    if not isinstance(record, dict) or not isinstance(record.get("path"), str) \
            or not isinstance(record.get("sha256"), str):
        raise error(f"{run} names its base badly ({record!r}); the checkpoint is damaged")
    path = os.path.abspath(override) if override else _located(record, run)
    if not os.path.exists(path):
        if override:
            raise error(f"--base {override} is missing; give the path of the base of {run} "
                        f"(it was {record['path']}) with --base PATH")
        raise error(f"the base {path} of {run} is missing (moved or deleted?); give its path "
                    f"now with --base PATH{_rescue(record)}")
    check_input(path, error, "--base" if override else f"the base of {run}")
    try:
        if not rehash and not override and _unchanged(record, path):
            warnings.warn(RwkvxWarning(
                f"the base {path} of {run} is taken as the one recorded ({short(record)}) on "
                "its files' sizes and modification times, not hashed again"), stacklevel=2)
            return {**record, "path": path}   # unchanged since it was hashed: no pass over it
        sha = _sha_as(record, path)
    except OSError as e:
        raise error(f"cannot read the base {path} of {run}: {e.strerror or e}") from None
    now = {"path": path, "sha256": sha, "files": _stats(path)}
    if sha != record["sha256"]:
        was = f"the base {record['path']} of {run} ({short(record)})"
        hint = "" if override else _rescue(record)
        raise error(f"{path} ({short(now)}) is not {was}: it changed or is another file; "
                    f"give the original's path with --base PATH{hint}")
    return now


def pin_source(src: str, folder: str, base: str | None = None) -> Record | None:
    """Pins the run checkpoint at src (a run folder's, or a checkpoint file)
    in the run folder `folder`, and the run checkpoints its base comes from,
    down the chain; returns the record that names the pin (None: src is no
    run checkpoint, a .pth or Hugging Face weights, which no run rewrites).
    One pass over src's bytes (its hash); the chain's pins are checked when
    they are read (base: where src's own base lies now, --base, which the
    source's reader hashes)."""
    ck = _checkpoint_of(src)
    if ck is None:
        return None
    st = os.stat(ck)
    sha = _digest(ck)
    pin = RunDir(folder).pin(sha)
    publish(ck, pin)
    now = os.stat(pin)
    if (now.st_size, now.st_mtime_ns) != (st.st_size, st.st_mtime_ns):   # saved meanwhile
        os.unlink(pin)
        return pin_source(src, folder, base)
    _pin_chain(read_state(pin).get(BASE_KEY), ck, folder, base)
    return {"path": os.path.abspath(pin), "sha256": sha, "files": _stats(pin)}


def _pin_chain(record: object, run: str, folder: str, base: str | None) -> None:
    """Pins, in folder, the base of the checkpoint at run (record; found at
    base when given) when it is a run checkpoint, and so on down its chain;
    a base missing, changed or not a checkpoint ends the chain (its reader
    says so)."""
    while isinstance(record, dict) and isinstance(record.get("sha256"), str) \
            and isinstance(record.get("path"), str):
        where = base or _located(record, run)
        ck = _checkpoint_of(where) if os.path.exists(where) else None
        if ck is None or _one_file(record) is None or not _sha_ok(record) \
                or not (base or _unchanged(record, ck)):
            return
        base = None
        pin = RunDir(folder).pin(record["sha256"])
        if not os.path.exists(pin):
            publish(ck, pin)
        record, run = read_state(pin).get(BASE_KEY), ck


def _checkpoint_of(src: str) -> str | None:
    """The checkpoint a reader takes of a run folder (checkpoint_path), or
    src when it is a checkpoint file (its header holds a run state), else
    None."""
    path = checkpoint_path(src)
    return path if os.path.isfile(path) and read_state(path) else None


def pinned_by(run: str) -> int:
    """How many files outside the run folder `run` hold its checkpoint: the
    fine-tunes pinning it by hard link (copies cannot be counted)."""
    rd = RunDir(run)
    try:
        st = os.stat(rd.checkpoint)
    except OSError:
        return 0
    own = 0
    for f in rd.own_files():
        try:
            own += os.path.samefile(f, rd.checkpoint)
        except OSError:
            continue
    return max(st.st_nlink - own, 0)
