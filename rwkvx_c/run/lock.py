"""Exclusive use of a run folder while a run writes to it.

A run takes an advisory lock (fcntl.flock) on DIR/.lock for as long as it
may write there, so a second process training into, or resuming, the same
folder is refused with a message naming the holder instead of both writing
one checkpoint. The kernel drops the lock when its holder exits, kill -9
included, so a crashed run never leaves the folder locked. Inside one
process the lock is shared: Trainer objects of one interpreter on one
folder (a script that resumes what it just trained) count references.

With the lock held, files that only an unfinished write leaves behind
(".NAME.tmpPID[.EXT]", rwkvx_c.util.atomic's temporaries; "NAME.tmp" and
"NAME.tmp.png", those of earlier versions) belong to a writer that died,
and are removed.
"""
from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import os

from rwkvx_c.errors import RunLocked

__all__ = ["RunLocked", "RunLock", "LOCK_NAME", "ORPHAN_PATTERNS", "remove_orphans"]

LOCK_NAME = ".lock"
# fnmatch's * spans dots, so the first also matches ".NAME.tmpPID.EXT"
ORPHAN_PATTERNS = (".*.tmp[0-9]*", "*.tmp", "*.tmp.png")

_held: dict[str, list] = {}   # realpath -> [fd, references]


def remove_orphans(folder: str) -> list[str]:
    """Delete the temporary files of interrupted writers in folder; returns their names."""
    gone = []
    for name in os.listdir(folder):
        if name != LOCK_NAME and any(fnmatch.fnmatch(name, p) for p in ORPHAN_PATTERNS):
            try:
                os.unlink(os.path.join(folder, name))
                gone.append(name)
            except OSError:
                pass
    return gone


class RunLock:
    """Holds DIR/.lock; release() (or the end of the process) lets it go."""

    def __init__(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.key = os.path.realpath(folder)
        self.folder = folder
        self.released = False
        if self.key in _held:
            _held[self.key][1] += 1
            return
        path = os.path.join(folder, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise RunLocked(f"run folder {folder} is in use by another rwkvx-c process "
                            f"(pid {holder}); wait for it to end or choose another --out") \
                from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        _held[self.key] = [fd, 1]
        remove_orphans(folder)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        entry = _held.get(self.key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[self.key]
            os.close(entry[0])   # closing the only descriptor drops the flock

    def __del__(self) -> None:
        # at interpreter exit module globals may already be gone: never raise here
        with contextlib.suppress(Exception):
            self.release()
