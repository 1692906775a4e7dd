"""Replacing a file so that a reader, or a crash at any moment, finds either
the old file or the new one, never a torn one: the new contents go to a
temporary file beside it, are fsynced, renamed over it, and the folder is
fsynced so the rename itself survives a power cut. Every file rwkvx_c
writes (checkpoints, logs, plots, tokenizers, exports, corpus caches) goes
through here.

A temporary file is named ".NAME.tmpPID" (".NAME.tmpPID.EXT" when the
writer picks its format by extension, as matplotlib does): hidden, next to
NAME, and naming the process that writes it, so a sweep can tell a killed
writer's orphan (writer_pid) from a live writer's file.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from typing import IO, Any

__all__ = ["replacing", "replace_with", "publish", "temp_path", "writer_pid", "sweep_orphans"]

_TMP = re.compile(r"\.tmp(\d+)(\.[A-Za-z0-9]+)?$")


def temp_path(dest: str, keep_ext: bool = False) -> str:
    """The temporary file a write of dest goes through (see the module doc)."""
    d, base = os.path.split(os.path.abspath(dest))
    ext = os.path.splitext(base)[1] if keep_ext else ""
    return os.path.join(d, f".{base}.tmp{os.getpid()}{ext}")


def writer_pid(name: str) -> int | None:
    """The process id in a temporary name (NAME.tmpPID, .NAME.tmpPID[.EXT]),
    or None when name is not one."""
    m = _TMP.search(name)
    return int(m.group(1)) if m else None


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return   # a platform without directory fds: the rename is all there is
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _temporary(dest: str, keep_ext: bool = False) -> Iterator[str]:
    """The temporary path to fill; renamed over dest on a clean exit,
    removed on any exception (dest untouched)."""
    tmp = temp_path(dest, keep_ext)
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    try:
        yield tmp
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(tmp))


@contextlib.contextmanager
def replacing(dest: str, mode: str = "wb") -> Iterator[IO[Any]]:
    """with replacing(dest) as f: write f; on a clean exit dest is replaced
    by what was written, on any exception dest is untouched and the
    temporary file removed."""
    if mode not in ("wb", "w"):
        raise ValueError(f"mode must be 'wb' or 'w', not {mode!r}")
    with _temporary(dest) as tmp, open(tmp, mode) as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def replace_with(dest: str, write: Callable[[str], object], keep_ext: bool = False) -> None:
    """replacing() for a writer that takes a path (torch.save, a tokenizer's
    save, savefig): write(tmp) makes the temporary file, then it replaces
    dest. keep_ext gives tmp dest's extension, for writers that pick their
    format by it."""
    with _temporary(dest, keep_ext) as tmp:
        write(tmp)
        # a writer that makes its file 0600 (safetensors' save_file does) gets
        # the mode open() gives every other file: readable as the umask allows
        os.chmod(tmp, 0o666 & ~_umask())
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())


def publish(src: str, dst: str) -> None:
    """dst becomes a copy of the file src, atomically: a hard link where the
    file system has them (src is replaced by rename, never written in
    place, so the link keeps this version), else a copy with src's
    modification time (a copy is the same file to a size-and-mtime check)."""
    tmp = temp_path(dst)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        os.link(src, tmp)
        os.replace(tmp, dst)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        replace_with(dst, lambda t: shutil.copy2(src, t))


def _umask() -> int:
    """The process's umask (read by setting it and back: no call only reads it)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True   # another user's process, or no PID we can judge: not ours to remove
    return True


def sweep_orphans(folder: str, prefix: str = "") -> None:
    """Remove the temporaries in `folder` (.NAME.tmpPID files, NAME.tmpPID
    folders) whose name starts with prefix and whose writer is dead: a
    killed writer never renames its temporary into place, and nothing else
    would ever delete it. A live writer's stays."""
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
