"""Opening an input file without trusting what the path names.

A path handed to rwkvx_c as a checkpoint, a .pth or a tokenizer may name a
FIFO (open blocks until a writer comes, forever), a character device such
as /dev/zero (read() never ends and fills memory), a folder, or a link to
any of these. ``open_input`` opens without blocking, looks at what it
opened (fstat: the thing itself, not the name, so a link swapped in
between cannot fool it) and hands back a plain binary file only for a
regular file; anything else is the caller's one-line error.
``read_input`` reads such a file whole up to a bound (a file of known
structure -- a config, a JSON sidecar -- has no business being larger), and
``check_input`` checks a path that may name a folder (a run, a Hugging
Face folder, a data folder) to be a folder or a regular file before any of
it is read.
"""
from __future__ import annotations

import fcntl
import json
import mmap
import os
import stat
from typing import IO

__all__ = ["open_input", "read_input", "read_json", "check_input", "MAX_JSON_BYTES"]

MAX_JSON_BYTES = 1 << 24   # a config or index JSON file is kilobytes; a tokenizer.json is not one
# bytes of a mapped checkpoint a reader checksums between two drops of its
# pages: with the tensor it is copying, all of the file it holds at once
MAP_SPAN = 64 << 20


def drop_pages(m: mmap.mmap, b: int, e: int) -> None:
    """Drop the whole pages inside bytes [b, e) of the file mapping m from
    this process's memory (read from the file again if touched again)."""
    page = mmap.PAGESIZE
    b, e = -(-b // page) * page, e // page * page
    if e > b:
        m.madvise(mmap.MADV_DONTNEED, b, e - b)


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


def read_input(path: str, error: type[Exception], what: str, limit: int) -> bytes:
    """The bytes of the regular file at path (open_input's checks), error
    (one line) when it holds more than `limit` bytes: read up to limit + 1,
    never the whole of whatever the path names."""
    with open_input(path, error, what) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise error(f"{what} {path} is larger than {limit:,} bytes, more than such a file "
                    "holds; name the right file")
    return data


def read_json(path: str, error: type[Exception], what: str,
              limit: int = MAX_JSON_BYTES) -> object:
    """The JSON value in the regular file at path, read with read_input's
    bound; error (one line) when it is not UTF-8 JSON or nests deeper than
    the parser goes. OSErrors of open pass through."""
    data = read_input(path, error, what, limit)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:   # UnicodeDecodeError is a ValueError
        raise error(f"{what} {path} is not readable JSON: "
                    f"{e if isinstance(e, ValueError) else 'nested too deeply'}") from None


def check_input(path: str, error: type[Exception], what: str) -> str:
    """path when it names a folder or a regular file (a link to one is
    fine); error (one line) for a FIFO, a device or a socket, which a read
    would block on or never finish. A missing path passes: the caller
    says what it needed."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return path
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise error(f"{what} {path} is {_kind(mode)}; name a regular file or a folder")
    return path
