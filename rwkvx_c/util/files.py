"""Opening an input file without trusting what the path names.

A path handed to rwkvx_c as a checkpoint, a .pth or a tokenizer may name a
FIFO (open blocks until a writer comes, forever), a character device such
as /dev/zero (read() never ends and fills memory), a folder, or a link to
any of these. ``open_input`` opens without blocking, looks at what it
opened (fstat: the thing itself, not the name, so a link swapped in
between cannot fool it) and hands back a plain binary file only for a
regular file; anything else is the caller's one-line error.
"""
from __future__ import annotations

import fcntl
import os
import stat
from typing import IO

__all__ = ["open_input"]


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_input(path: str, error: type[Exception], what: str = "") -> IO[bytes]:
    """`path` opened for binary reading when it is a regular file (a link
    to one is fine); error(one line) when it is a FIFO, a device, a folder
    or a socket. FileNotFoundError and other OSErrors of open pass through."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            label = f"{what} {path}" if what else path
            raise error(f"{label} is {_kind(mode)}, not a file; name a regular file")
        # reads of a regular file never block; clear the flag all the same
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
