"""safetensors files read tensor by tensor over a memory map, with the
interface of rwkvx_c.interop.pth.PthTensors (names, shape, dtype, raw,
array, release, close), so a fine-tune's frozen base fills from one or
from the shards of a Hugging Face folder without a float32 copy of the
model::

    st = SafetensorsTensors("model.safetensors")
    st.raw("model.embeddings.weight")     # the stored elements (bf16: uint16 bits)
    shards = ShardedTensors("model.safetensors.index.json")

The format: an 8-byte little-endian header length, a JSON object
{name: {"dtype", "shape", "data_offsets": [begin, end]}} (and an optional
"__metadata__"), then the data, offsets counted from its start. Every
entry is checked against the bytes the file holds when it is opened,
before anything is allocated: InteropError (one line) naming the file and
the tensor.

Why not the ``safetensors`` package: its NumPy reader has no bf16 (NumPy
has no such type) and its torch reader would make PyTorch, an optional
extra, a requirement of reading a file.
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
from typing import Any, TypeGuard

import numpy as np

from rwkvx_c.errors import InteropError
from rwkvx_c.interop.pth import MappedTensors
from rwkvx_c.util.files import open_input, read_json

__all__ = ["SafetensorsTensors", "ShardedTensors", "ST_DTYPES"]

# the stored dtypes read (name in the header -> our name, element type);
# others (integers, F64, F8) are refused by name
ST_DTYPES: dict[str, tuple[str, np.dtype[Any]]] = {
    "BF16": ("bf16", np.dtype("<u2")), "F16": ("fp16", np.dtype("<f2")),
    "F32": ("fp32", np.dtype("<f4"))}
_LENGTH = 8   # bytes of the header-length prefix
_MAX_HEADER = 100 * 2**20   # the safetensors package's own bound on a header
_META = "__metadata__"


class _Entry:
    def __init__(self, dtype: str, shape: tuple[int, ...], begin: int) -> None:
        self.dtype, self.shape, self.begin = dtype, shape, begin


def _ints(v: Any) -> TypeGuard[list[int]]:
    return isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)


class SafetensorsTensors(MappedTensors):
    """The tensors of one safetensors file (see the module doc): raw(name)
    is a read-only view of the mapped file, array(name) a float32 copy."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open_input(path, InteropError) as f:
                size = os.fstat(f.fileno()).st_size
                if size < _LENGTH:
                    raise InteropError(f"{path} is not a safetensors file ({size} bytes, "
                                       "shorter than its header length)")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise InteropError(f"{path}: no such file") from None
        except OSError as e:
            raise InteropError(f"cannot read {path}: {e.strerror or e}") from None
        hlen = int.from_bytes(self._map[:_LENGTH], "little")
        if hlen > min(size - _LENGTH, _MAX_HEADER):
            raise InteropError(f"{path} is not a safetensors file: its header claims {hlen:,} "
                               f"bytes of a {size:,}-byte file")
        try:
            header = json.loads(self._map[_LENGTH:_LENGTH + hlen].decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise InteropError(f"{path} is not a safetensors file: its header is not JSON "
                               f"({e})") from None
        if not isinstance(header, dict):
            raise InteropError(f"{path} is not a safetensors file: its header is not a JSON "
                               "object")
        header.pop(_META, None)
        self._data = _LENGTH + hlen
        self._entries = {k: self._entry(k, e, size - self._data) for k, e in header.items()}
        spans = sorted((e.begin, e.begin + self._nbytes(e), k) for k, e in self._entries.items())
        for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
            if begin < end:
                raise InteropError(f"{path}: tensors {a} and {b} overlap")
        self._meta = {k: (e.shape, ST_DTYPES[e.dtype][0]) for k, e in self._entries.items()}

    @staticmethod
    def _nbytes(e: _Entry) -> int:
        return int(np.prod(e.shape, dtype=object)) * ST_DTYPES[e.dtype][1].itemsize

    def _entry(self, name: str, e: Any, room: int) -> _Entry:
        """The header's entry for name, checked against the room the data
        area has (Python integers: no claimed size overflows)."""
        if not isinstance(e, dict):
            raise InteropError(f"{self.path}: tensor {name}'s header entry is not an object")
        d, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if d not in ST_DTYPES:
            raise InteropError(f"{self.path}: tensor {name} has dtype {d!r}; rwkvx_c reads "
                               f"{', '.join(ST_DTYPES)}")
        if not _ints(shape):
            raise InteropError(f"{self.path}: tensor {name} has shape {shape!r}, not a list of "
                               "non-negative integers")
        if not (_ints(offs) and len(offs) == 2):
            raise InteropError(f"{self.path}: tensor {name} has data_offsets {offs!r}, not "
                               "[begin, end]")
        entry = _Entry(d, tuple(shape), offs[0])
        want = self._nbytes(entry)
        if not offs[0] <= offs[1] <= room or offs[1] - offs[0] != want:
            raise InteropError(f"{self.path}: tensor {name} claims shape {tuple(shape)} of {d} "
                               f"({want:,} bytes) at data_offsets {offs}; the file's data is "
                               f"{room:,} bytes")
        return entry

    def raw(self, name: str) -> np.ndarray:
        e = self._entries[name]
        dt = ST_DTYPES[e.dtype][1]
        n = int(np.prod(e.shape, dtype=np.int64))
        a: np.ndarray = np.frombuffer(self._map, dt, count=n, offset=self._data + e.begin)
        return a.reshape(e.shape)

    def close(self) -> None:
        """Unmaps the file once no raw() view of it is alive (till then the
        views keep it)."""
        with contextlib.suppress(BufferError):
            self._map.close()


class ShardedTensors:
    """The tensors of a Hugging Face model.safetensors.index.json: every
    shard its weight_map names (files in the index's folder), opened and
    checked as SafetensorsTensors, behind one interface. A tensor in two
    shards, or missing from the shard the index names, is refused."""

    def __init__(self, index: str) -> None:
        self.path = index
        try:
            found: Any = read_json(index, InteropError, "the safetensors index")
            wm = found["weight_map"]
            files = sorted(set(wm.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise InteropError(f"{index} is not a safetensors index ({e})") from None
        bad = [n for n in files
               if not isinstance(n, str) or os.path.basename(n) != n
               or not n.endswith(".safetensors")]
        if bad:
            raise InteropError(f"{index} names {bad[0]!r}, not a .safetensors file in the folder")
        folder = os.path.dirname(index)
        missing = [n for n in files if not os.path.isfile(os.path.join(folder, n))]
        if missing:
            raise InteropError(f"{index} names the shard {missing[0]}, which {folder or '.'} "
                               "lacks")
        self._shards = [SafetensorsTensors(os.path.join(folder, n)) for n in files]
        self._where: dict[str, SafetensorsTensors] = {}
        for s in self._shards:
            for k in s.names:
                if k in self._where:
                    raise InteropError(f"{k} appears in two shards of {folder or '.'}: "
                                       f"{os.path.basename(self._where[k].path)} and "
                                       f"{os.path.basename(s.path)}")
                self._where[k] = s
        for k, n in wm.items():
            if k not in self._where or os.path.basename(self._where[k].path) != n:
                raise InteropError(f"{index} puts {k} in {n}, which does not hold it")

    @property
    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].shape(name)

    def dtype(self, name: str) -> str:
        return self._where[name].dtype(name)

    def raw(self, name: str) -> np.ndarray:
        return self._where[name].raw(name)

    def array(self, name: str) -> np.ndarray:
        return self._where[name].array(name)

    def release(self, name: str) -> None:
        self._where[name].release(name)

    def close(self) -> None:
        for s in self._shards:
            s.close()
