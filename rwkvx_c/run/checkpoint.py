"""Checkpoints as safetensors files, written atomically and validated on load.

Format: a standard safetensors file (8-byte little-endian header length, a
JSON header, then the raw little-endian tensor bytes), readable by the
`safetensors` package and any other safetensors reader. Tensors:

  - every model parameter under its docs/layout.md §Parameters name (``emb``,
    ``blocks.0.tm.x_r``, ..., ``head``), float32, its own shape;
  - the AdamW moments as flat float32 arrays ``optim.m`` and ``optim.v``
    (same length and layout as the arena of what trains: the parameters,
    or in a state or LoRA run the states or adapters and any groups added),
    when saved;
  - ``state0`` (STATE_KEY), the trainable initial WKV states
    [n_rwkv_layer, H, N, N], when the model has them (docs/finetune.md);
  - a LoRA run's adapters, ``{param}.lora_A`` [r, in] and
    ``{param}.lora_B`` [out, r] (rwkvx_c.model.lora), alpha in its options.

A state, LoRA or partly frozen fine-tune's checkpoint holds only the
parameters that train (and any its base lacks); its state's ``base``
names the base (rwkvx_c.run.base), from which readers rebuild the rest
(rwkvx_c.interop.source.read_run).

``__metadata__`` (string -> string, as safetensors requires) holds
``format`` ("rwkvx_c.checkpoint"), ``version``, ``config`` (the model
config as JSON), ``state`` (JSON: step, optimiser step count, sampler RNG
state and data position, elapsed training time, trainer options, ...),
``data_crc32``, the CRC-32 of the whole data section, and ``header_crc32``,
the CRC-32 of the length prefix and the header with this field's own value
read as "00000000": no flipped bit anywhere in the file is trained on
(version 1 files, which lack header_crc32, are still read).

Why not the `safetensors` package: its writer wants the whole file in one
call with no fsync and no streaming, and its reader returns copies; a
NumPy writer of the same format is 40 lines, streams every tensor straight
from the zero-copy parameter views, fsyncs, and checks everything on load.
The reader maps the file: its tensors are views of the mapped pages, read
when touched, and a reader that has copied one drops its pages again
(CheckpointTensors.release), so loading a run's weights holds them once,
never its optimiser moments (twice their size) at all.
tests/test_checkpoint.py reads our files with the `safetensors` package
when it is installed to keep the two in agreement.

Writes go to a temporary file in the destination folder, are fsynced and
then renamed over the destination (and the folder fsynced): a crash at any
moment leaves either the old checkpoint or the new one, never a torn file.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from rwkvx_c.errors import CheckpointError
from rwkvx_c.util.atomic import replacing
from rwkvx_c.util.files import MAP_SPAN, drop_pages, open_input

__all__ = ["CheckpointError", "CheckpointTensors", "save_checkpoint", "read_checkpoint",
           "parse_checkpoint", "read_state", "FORMAT", "VERSION", "STATE_KEY"]

FORMAT = "rwkvx_c.checkpoint"
STATE_KEY = "state0"   # the initial WKV states of a state-tuned model
VERSION = "2"
_READS = ("1", "2")
_MAX_HEADER = 64 << 20
_HCRC_KEY = b'"header_crc32":"'   # unique: quotes inside JSON string values are escaped
_HCRC_ZERO = b"00000000"


# (tensors, config, state), as read_checkpoint returns them
Checkpoint = tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Any]]


def save_checkpoint(path: str, tensors: Mapping[str, np.ndarray], config: Mapping[str, Any],
                    state: Mapping[str, Any]) -> None:
    """Write tensors (ordered name -> float32 C-contiguous array) atomically to path.

    config and state are JSON-serialisable dicts stored in the metadata.
    tensors is read twice, once for the header and once for the data, and
    no array is kept between: a Mapping that makes each array when asked
    (a frozen base's matrices, decoded) never holds them all at once.
    """
    entries, off = {}, 0
    crc = 0
    for name, a in tensors.items():
        if a.dtype != np.float32 or not a.flags.c_contiguous:
            raise TypeError(f"checkpoint tensor {name} must be C-contiguous float32")
        nbytes = a.size * 4
        entries[name] = {"dtype": "F32", "shape": list(a.shape),
                         "data_offsets": [off, off + nbytes]}
        crc = zlib.crc32(a.data.cast("B"), crc)
        off += nbytes
    meta = {"format": FORMAT, "version": VERSION, "config": json.dumps(config, sort_keys=True),
            "state": json.dumps(state, sort_keys=True), "data_crc32": "%08x" % crc,
            "header_crc32": _HCRC_ZERO.decode()}
    header = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # data starts 8-byte aligned, as safetensors does
    prefix = struct.pack("<Q", len(header))
    at = header.index(_HCRC_KEY) + len(_HCRC_KEY)
    hcrc = b"%08x" % zlib.crc32(header, zlib.crc32(prefix))
    header = header[:at] + hcrc + header[at + 8:]
    with replacing(path) as f:
        f.write(prefix)
        f.write(header)
        for name in entries:
            f.write(tensors[name].data.cast("B"))


class CheckpointTensors(dict):
    """A checkpoint's tensors by name: read-only float32 views of the
    file's bytes (of its mapped pages when read_checkpoint could map it).
    release(name) drops that tensor's pages from the process's memory once
    a reader has copied it; touched again, they are read from the file."""

    def __init__(self, tensors: dict[str, np.ndarray], pages: mmap.mmap | None, at: int,
                 spans: dict[str, tuple[int, int]]):
        super().__init__(tensors)
        self._pages, self._at, self._spans = pages, at, spans

    def __reduce__(self) -> tuple[Any, ...]:
        # sent to other processes (MPI ranks) as a plain dict of copies: a
        # mapping does not travel
        return dict, (dict(self),)

    def release(self, name: str) -> None:
        if self._pages is not None and name in self._spans:
            b, e = self._spans[name]
            drop_pages(self._pages, self._at + b, self._at + e)

    def copy_into(self, name: str, out: np.ndarray) -> None:
        """out[...] = self[name] MAP_SPAN bytes at a time into a contiguous
        out, each span's pages dropped once copied: a tensor as large as
        the model (AdamW's moments) never whole in memory twice."""
        span = self._spans.get(name)
        if self._pages is None or span is None or not out.flags.c_contiguous:
            out[...] = self[name]
            self.release(name)
            return
        src, dst, at = self[name].reshape(-1), out.reshape(-1), self._at + span[0]
        step = MAP_SPAN // 4
        for i in range(0, src.size, step):
            dst[i:i + step] = src[i:i + step]
            drop_pages(self._pages, at + 4 * i, at + 4 * min(i + step, src.size))


def read_checkpoint(path: str) -> Checkpoint:
    """(tensors, config, state) from a checkpoint written by save_checkpoint.

    tensors (CheckpointTensors) maps names to read-only float32 arrays
    backed by the file's mapped pages (its bytes read whole where it cannot
    be mapped). Raises CheckpointError naming the file and the problem.
    """
    try:
        with open_input(path, CheckpointError, "checkpoint") as f:
            try:
                blob: bytes | mmap.mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (ValueError, OSError):   # empty, or a file system that maps nothing
                blob = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {path}: {e.strerror}") from None
    return parse_checkpoint(blob, path)


def read_state(path: str) -> dict[str, Any]:
    """The run state of the checkpoint at path from its header alone (the
    tensors unread): what a reader wants before it loads the model, such as
    the run's options. {} when the header is unreadable or path no regular
    file (a FIFO would block the read); read_checkpoint then says why."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, "rb") as f:
            (hlen,) = struct.unpack("<Q", f.read(8))
            if hlen > _MAX_HEADER:
                return {}
            meta = json.loads(f.read(hlen).decode("utf-8")).get("__metadata__") or {}
        state = json.loads(meta["state"])
    except (OSError, struct.error, UnicodeDecodeError, ValueError, KeyError, TypeError,
            AttributeError):
        return {}
    return state if isinstance(state, dict) else {}


def _header_crc_ok(blob: bytes | mmap.mmap, hlen: int) -> bool | None:
    """True when the header checksum matches (files of version 1 have none:
    None)."""
    header = blob[8:8 + hlen]
    at = header.find(_HCRC_KEY)
    if at < 0:
        return None
    if header.find(_HCRC_KEY, at + 1) >= 0:
        return False
    at += len(_HCRC_KEY)
    want = header[at:at + 8]
    zeroed = header[:at] + _HCRC_ZERO + header[at + 8:]
    return want == b"%08x" % zlib.crc32(zeroed, zlib.crc32(blob[:8]))


def parse_checkpoint(blob: bytes | mmap.mmap, path: str = "<bytes>") -> Checkpoint:
    """(tensors, config, state) from the bytes of a checkpoint file (or its
    mapping, whose pages the checksum drops again as it goes); path only
    names it in errors. See read_checkpoint."""
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path} {msg}")

    if len(blob) < 8:
        raise bad(f"is truncated ({len(blob)} bytes)")
    (hlen,) = struct.unpack("<Q", blob[:8])
    if hlen > _MAX_HEADER or blob[8:9] not in (b"{", b""):
        # a safetensors file starts with its header's length and then "{"
        raise bad("is not a checkpoint (no safetensors header); rwkvx-c reads the "
                  "checkpoint.safetensors of a run folder")
    if 8 + hlen > len(blob):
        raise bad("is truncated (header cut short)")
    hcrc = _header_crc_ok(blob, hlen)
    if hcrc is False:
        raise bad("is corrupt (header checksum mismatch)")
    try:
        header = json.loads(blob[8:8 + hlen].decode("utf-8"))
        meta = header.pop("__metadata__", None)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise bad("is not an rwkvx_c checkpoint (no rwkvx_c metadata)")
        config = json.loads(meta["config"])
        state = json.loads(meta["state"])
        crc_want = meta["data_crc32"]
    except CheckpointError:
        raise
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        raise bad("is corrupt (unreadable header)") from None
    if not isinstance(config, dict) or not isinstance(state, dict):
        raise bad("is corrupt (config or state is not a JSON object)")
    if meta.get("version") not in _READS:
        raise bad(f"has format version {meta.get('version')!r}; this rwkvx_c reads "
                  f"{' and '.join(_READS)}")
    if hcrc is None and meta.get("version") != "1":
        raise bad("is corrupt (no header checksum)")
    data = memoryview(blob)[8 + hlen:]
    spans = []
    try:
        for name, e in header.items():
            b, end = (int(x) for x in e["data_offsets"])
            shape = tuple(int(s) for s in e["shape"])
            if e["dtype"] != "F32" or b < 0 or end < b or end - b != 4 * int(np.prod(shape)):
                raise bad(f"is corrupt (bad entry for tensor {name})")
            spans.append((b, end, name, shape))
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError):
        raise bad("is corrupt (bad tensor table)") from None
    spans.sort()
    at = 0
    for b, end, name, _ in spans:
        if b != at:
            raise bad(f"is corrupt (tensor {name} overlaps or leaves a gap)")
        at = end
    if at > len(data):
        raise bad(f"is truncated ({len(data)} of {at} data bytes present)")
    if at < len(data):
        raise bad(f"is corrupt ({len(data) - at} bytes after the last tensor)")
    pages = blob if isinstance(blob, mmap.mmap) else None
    crc = 0
    for b in range(0, len(data), MAP_SPAN):
        crc = zlib.crc32(data[b:b + MAP_SPAN], crc)
        if pages is not None:   # checked: those pages need not stay
            drop_pages(pages, 8 + hlen + b, 8 + hlen + min(b + MAP_SPAN, len(data)))
    if "%08x" % crc != crc_want:
        raise bad("is corrupt (data checksum mismatch)")
    tensors = {}
    for b, end, name, shape in spans:
        tensors[name] = np.frombuffer(data[b:end], dtype="<f4").reshape(shape)
    return CheckpointTensors(tensors, pages, 8 + hlen, {n: (b, e) for b, e, n, _ in spans}), \
        config, state
