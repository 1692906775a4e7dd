"""PyTorch .pth files: state dicts in as float32 NumPy arrays, out at a chosen
dtype, both without torch: a .pth is a zip of one pickle and one raw member
per tensor, which this module reads (PthTensors, memory-mapped, tensor by
tensor) and writes (save_pth) itself. torch is used only to read a file in
torch's legacy pre-1.6 (non-zip) format, when it is installed.

    save_pth(sd, "model.pth", "bf16")  # round to nearest even
    sd = load_pth("model.pth")         # bf16 / fp16 / fp32 in, float32 out
"""
from __future__ import annotations

import mmap
import pickle
import re
import struct
import zipfile
from collections.abc import Mapping
from typing import IO, Any

import numpy as np

from rwkvx_c.errors import InteropError
from rwkvx_c.util.atomic import replacing
from rwkvx_c.util.files import drop_pages, open_input

__all__ = ["DTYPES", "load_pth", "save_pth", "PthTensors", "MappedTensors", "to_bf16_bits"]

DTYPES = ("fp32", "bf16", "fp16")
ARCHIVE = "archive"   # the folder torch.save names inside the zip for a file object
ALIGN = 64            # torch.save starts each tensor's bytes at a multiple of 64


def _unreadable(path: str, e: Exception) -> InteropError:
    """The one-line error of a .pth either reader could not read: missing, a
    pickle that would run code on load (torch's weights-only loader and
    PthTensors' unpickler both name the global), or another error's first
    line."""
    if isinstance(e, FileNotFoundError):
        return InteropError(f"{path}: no such file")
    text = str(e).strip()
    code = re.search(r"GLOBAL ([\w.]+)", text)
    if isinstance(e, pickle.UnpicklingError) and code:
        return InteropError(f"{path} holds Python code or objects ({code.group(1)}) besides "
                            "tensors and was not loaded: a .pth state dict holds tensors only")
    why = re.search(r"Unsupported[^\n]*", text)
    first = why.group(0) if why else text.splitlines()[0] if text else type(e).__name__
    return InteropError(f"{path} is not a readable .pth state dict: {first}")


def load_pth(path: str) -> dict[str, np.ndarray]:
    """The tensors of a .pth state dict as float32 NumPy arrays (bf16, fp16
    and fp32 are converted exactly), read by PthTensors without torch; a
    file in torch's legacy non-zip format through torch, when installed.
    Loads weights only: a pickle naming anything else is refused."""
    try:
        legacy = not zipfile.is_zipfile(path)
    except OSError:
        legacy = False   # PthTensors says why it cannot be read
    if legacy and _legacy_pickle(path):
        return _load_with_torch(path)
    pth = PthTensors(path)
    try:
        return {k: pth.array(k) for k in pth.names}
    finally:
        pth.close()


def _legacy_pickle(path: str) -> bool:
    """True for a file in torch's pre-1.6 format: a pickle from its first byte."""
    try:
        with open(path, "rb") as f:
            return f.read(1) == b"\x80"
    except OSError:
        return False


def _load_with_torch(path: str) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise InteropError(f"{path} is a .pth in torch's legacy (pre-1.6) format, which only "
                           "torch reads: pip install torch --index-url "
                           "https://download.pytorch.org/whl/cpu, or save it again with a "
                           "recent torch") from None
    try:
        with open_input(path, InteropError) as f:
            obj = torch.load(f, map_location="cpu", weights_only=True)
    except InteropError:
        raise
    except Exception as e:  # noqa: BLE001 -- pickle and zip errors have many types
        raise _unreadable(path, e) from None
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise InteropError(f"{path} does not hold a flat dict of tensors")
    out = {}
    for k, v in obj.items():
        if not v.is_floating_point():
            raise InteropError(f"{path}: tensor {k} has dtype {v.dtype}, expected floating point")
        a = v.detach().to(torch.float32).contiguous().numpy()
        bad = a.size - int(np.isfinite(a).sum())
        if bad:   # a model with these weights computes NaN: refuse it, by name
            raise InteropError(f"{path}: tensor {k} holds {bad:,} non-finite values (NaN or "
                               f"inf) of {a.size:,}; the file was not imported")
        out[k] = a
    return out


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bits (uint16), rounded to nearest even as torch's
    .to(torch.bfloat16) rounds; a NaN stays a (quiet) NaN."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
    out = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return out


# (numpy conversion, torch's storage class) of each dtype save_pth writes
_WRITE = {"fp32": (lambda a: np.ascontiguousarray(a, "<f4"), "FloatStorage"),
          "bf16": (to_bf16_bits, "BFloat16Storage"),
          "fp16": (lambda a: np.ascontiguousarray(a, np.float32).astype("<f2"), "HalfStorage")}


def save_pth(sd: Mapping[str, np.ndarray], path: str, dtype: str = "fp32") -> None:
    """Writes sd as a torch .pth state dict of dtype (fp32, bf16 or fp16;
    round to nearest even), atomically, in the zip format torch.save writes
    (torch.load(weights_only=True) reads it); no torch needed."""
    if dtype not in DTYPES:
        raise InteropError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    convert, storage = _WRITE[dtype]
    try:
        with replacing(path) as f:
            _write_zip(f, sd, convert, storage)
    except OSError as e:
        raise InteropError(f"cannot write {path}: {e.strerror or e}") from None


def _pickle(sd: Mapping[str, np.ndarray], storage: str) -> bytes:
    """data.pkl as torch.save writes it (protocol 2): an OrderedDict of
    torch._utils._rebuild_tensor_v2(storage i, 0, shape, strides, False,
    OrderedDict()), storage i the persistent id ("storage", torch.<storage>,
    "i", "cpu", numel). Written opcode by opcode: the names are torch's,
    which need not be importable here."""
    P = pickle

    def text(s: str) -> bytes:
        b = s.encode("utf-8")
        return P.BINUNICODE + struct.pack("<I", len(b)) + b

    def integer(v: int) -> bytes:
        return P.BININT + struct.pack("<i", v) if -2 ** 31 <= v < 2 ** 31 else \
            P.LONG1 + bytes([8]) + struct.pack("<q", v)

    def ints(vs: tuple[int, ...]) -> bytes:
        return P.MARK + b"".join(integer(v) for v in vs) + P.TUPLE

    odict = P.GLOBAL + b"collections\nOrderedDict\n" + P.EMPTY_TUPLE + P.REDUCE
    out = [P.PROTO + bytes([2]), odict, P.MARK]
    for i, (k, a) in enumerate(sd.items()):
        shape = tuple(int(d) for d in np.shape(a))
        strides: list[int] = []
        step = 1
        for d in reversed(shape):
            strides.insert(0, step)
            step *= d
        pid = (P.MARK + text("storage") + P.GLOBAL + f"torch\n{storage}\n".encode()
               + text(str(i)) + text("cpu") + integer(int(np.size(a))) + P.TUPLE)
        out += [text(k), P.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n", P.MARK,
                pid, P.BINPERSID, integer(0), ints(shape), ints(tuple(strides)), P.NEWFALSE,
                odict, P.TUPLE, P.REDUCE]
    out += [P.SETITEMS, P.STOP]
    return b"".join(out)


def _write_zip(f: IO[bytes], sd: Mapping[str, np.ndarray], convert: Any, storage: str) -> None:
    """The zip of torch.save: ARCHIVE/data.pkl, ARCHIVE/byteorder, one
    ARCHIVE/data/<i> per tensor (its raw little-endian bytes, stored
    uncompressed and ALIGN-aligned as torch aligns them), ARCHIVE/version."""
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        def member(name: str, data: Any, nbytes: int) -> None:
            info = zipfile.ZipInfo(f"{ARCHIVE}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            info.file_size = nbytes
            # pad the local header's extra field so the bytes start aligned;
            # a zip64 member gets a 20-byte extra of zipfile's own first
            start = f.tell() + 30 + len(info.filename.encode()) + 4 + \
                (20 if nbytes > 0x7FFFFFFF else 0)
            pad = -start % ALIGN
            info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad   # torch's "FB" field
            with z.open(info, "w", force_zip64=nbytes > 0x7FFFFFFF) as w:
                w.write(data)
        member("data.pkl", _pickle(sd, storage), 0)
        member("byteorder", b"little", 0)
        for i, a in enumerate(sd.values()):
            raw = convert(np.asarray(a))
            member(f"data/{i}", np.ascontiguousarray(raw).reshape(-1).view(np.uint8),
                   raw.nbytes)
        member("version", b"3\n", 0)


# ---- streaming: tensor by tensor, without torch -----------------------------
# A .pth is a zip: <prefix>/data.pkl (the pickled state dict) and one member
# <prefix>/data/<key> per storage, its raw little-endian bytes, stored
# uncompressed. The pickle refers to storages by persistent id
# ("storage", <dtype class>, key, location, numel) and builds each tensor by
# torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...): read
# here by an unpickler that knows only those names, so nothing of the file
# runs and no tensor is made until it is asked for.
_STORAGE_DTYPES: dict[str, np.dtype[Any]] = {
    "FloatStorage": np.dtype("<f4"), "BFloat16Storage": np.dtype("<u2"),
    "HalfStorage": np.dtype("<f2")}
_DTYPE_NAMES = {"FloatStorage": "fp32", "BFloat16Storage": "bf16", "HalfStorage": "fp16"}


def _address(m: mmap.mmap) -> int:
    """The address the mapping starts at."""
    return int(np.frombuffer(m, np.uint8, count=1).__array_interface__["data"][0])


class MappedTensors:
    """What every memory-mapped tensor file shares (a .pth here, a
    safetensors file in rwkvx_c.interop.safetensors_file): a subclass sets
    path, _map and, once every tensor is checked, _meta (name -> shape and
    dtype name, in the file's order), and gives raw; this gives names,
    shape, dtype, the float32 copy and the release of a tensor's pages."""

    path: str
    _map: mmap.mmap
    _meta: dict[str, tuple[tuple[int, ...], str]]

    @property
    def names(self) -> list[str]:
        return list(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta[name][0]

    def dtype(self, name: str) -> str:
        return self._meta[name][1]

    def raw(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def release(self, name: str) -> None:
        """Drop the mapped pages of tensor name from this process's memory
        (they are read again from the file if asked for again)."""
        r = self.raw(name)
        if not r.nbytes:
            return
        start = r.__array_interface__["data"][0] - _address(self._map)
        drop_pages(self._map, start, start + r.nbytes)

    def array(self, name: str) -> np.ndarray:
        """The tensor as float32 (bf16 and fp16 converted exactly), refusing
        non-finite values by name."""
        r, d = self.raw(name), self.dtype(name)
        if d == "bf16":   # widened in place: one float32 array, the largest tensor's peak
            a = np.empty(r.shape, np.float32)
            bits = a.view(np.uint32)
            bits[...] = r
            bits <<= 16
        else:
            a = r.astype(np.float32)
        bad = a.size - int(np.isfinite(a).sum())
        if bad:
            raise InteropError(f"{self.path}: tensor {name} holds {bad:,} non-finite values (NaN "
                               f"or inf) of {a.size:,}; the file was not imported")
        return a


class _Storage:
    def __init__(self, cls: str, key: str, numel: int) -> None:
        self.cls, self.key, self.numel = cls, key, numel


class _TensorRef:
    def __init__(self, storage: _Storage, offset: int, size: tuple[int, ...],
                 stride: tuple[int, ...]) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride


def _rebuild(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> _TensorRef:
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor without a storage")
    return _TensorRef(storage, int(offset), tuple(int(s) for s in size),
                      tuple(int(s) for s in stride))


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name.endswith("Storage") and name.isidentifier():
            return name   # persistent_load names the ones it cannot read
        if (module, name) == ("collections", "OrderedDict"):
            from collections import OrderedDict
            return OrderedDict
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return _rebuild
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"Unsupported storage {pid!r}")
        if pid[1] not in _STORAGE_DTYPES:
            raise pickle.UnpicklingError(f"Unsupported tensor type {pid[1]}: a state dict of "
                                         "floating-point tensors (fp32, bf16, fp16) is read")
        return _Storage(pid[1], str(pid[2]), int(pid[4]))


class PthTensors(MappedTensors):
    """The tensors of a torch .pth state dict, read one at a time from the
    file (memory-mapped), never all at once. names: in the file's order;
    shape(name), dtype(name) ("bf16", "fp16", "fp32"); raw(name): the
    tensor's own elements as stored (uint16 bits for bf16), a read-only
    view of the mapped file; array(name): as float32 (a new array). Every
    tensor's claimed shape and strides are checked against the bytes its
    storage holds when the file is opened, before anything is allocated:
    InteropError (one line) on a bad file."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open_input(path, InteropError) as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            zf = zipfile.ZipFile(path)
            pkl = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pkl) != 1:
                raise InteropError(f"{path} is not a torch .pth zip (no data.pkl)")
            prefix = pkl[0][:-len("data.pkl")]
            obj = _Unpickler(zf.open(pkl[0])).load()
            self._members = {i.filename: i for i in zf.infolist()}
            self._zip = zf
        except InteropError:
            raise
        except Exception as e:  # noqa: BLE001 -- zip and pickle errors have many types
            raise _unreadable(path, e) from None
        if not isinstance(obj, dict) or not all(isinstance(v, _TensorRef) for v in obj.values()):
            raise InteropError(f"{path} does not hold a flat dict of tensors")
        self._refs: dict[str, _TensorRef] = dict(obj)
        self._prefix = prefix
        for k, t in self._refs.items():
            self._check(k, t)
        self._meta = {k: (t.size, _DTYPE_NAMES[t.storage.cls]) for k, t in self._refs.items()}

    def _check(self, name: str, t: _TensorRef) -> None:
        """The tensor must be dense and row-major inside its storage, and
        the storage's member must hold its bytes, stored uncompressed."""
        n = 1
        for s in t.size:
            if s < 0:
                raise InteropError(f"{self.path}: tensor {name} claims shape {t.size}")
            n *= s
        want: list[int] = []
        step = 1
        for s in reversed(t.size):
            want.insert(0, step)
            step *= s
        member = self._members.get(f"{self._prefix}data/{t.storage.key}")
        item = _STORAGE_DTYPES[t.storage.cls].itemsize
        dense = n <= 1 or all(st == w for st, w, s in zip(t.stride, want, t.size) if s > 1)
        if (not dense or t.offset < 0 or t.offset + n > t.storage.numel or member is None
                or member.compress_type != 0 or member.file_size < t.storage.numel * item):
            raise InteropError(f"{self.path}: tensor {name} claims shape {t.size} with strides "
                               f"{t.stride} at offset {t.offset} over a storage of "
                               f"{t.storage.numel:,} elements"
                               f"{'' if member is not None else ' that the file lacks'}; "
                               "only dense tensors inside their storage are read")

    def raw(self, name: str) -> np.ndarray:
        t = self._refs[name]
        info = self._members[f"{self._prefix}data/{t.storage.key}"]
        # the local header: 30 bytes, then the name and extra fields
        h = info.header_offset
        start = h + 30 + int.from_bytes(self._map[h + 26:h + 28], "little") + \
            int.from_bytes(self._map[h + 28:h + 30], "little")
        dt = _STORAGE_DTYPES[t.storage.cls]
        n = int(np.prod(t.size, dtype=np.int64))
        a: np.ndarray = np.frombuffer(self._map, dt, count=n, offset=start + t.offset * dt.itemsize)
        return a.reshape(t.size)

    def close(self) -> None:
        self._zip.close()
