"""Exclusive use of a run folder while a run writes to it.

A run takes an advisory lock (fcntl.flock) on DIR/.lock for as long as it
may write there, so a second process training into, or resuming, the same
folder is refused with a message naming the holder instead of both writing
one checkpoint. The kernel drops the lock when its holder exits, kill -9
included, so a crashed run never leaves the folder locked; a run that ends
removes the file too (a killed one leaves it, unlocked). Inside one
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


def _same_inode(fd: int, path: str) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


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
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
                finally:
                    os.close(fd)
                raise RunLocked(f"run folder {folder} is in use by another rwkvx-c process "
                                f"(pid {holder}); wait for it to end or choose another "
                                "--out") from None
            # a holder removes the file before it lets go: a lock won on a
            # removed file is no lock, take the one now at path instead
            if _same_inode(fd, path):
                break
            os.close(fd)
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
            # removed while still held, so a finished run leaves no .lock and
            # no process can win a lock on the file as it goes (see __init__)
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.folder, LOCK_NAME))
            os.close(entry[0])   # closing the only descriptor drops the flock

    def __del__(self) -> None:
        # at interpreter exit module globals may already be gone: never raise here
        with contextlib.suppress(Exception):
            self.release()
