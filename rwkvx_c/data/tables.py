"""Tables: the columnar files and folders corpora and instruction sets are
published as, read through pyarrow and datasets (the ``datasets`` extra).

  - a ``.parquet`` file, read in row groups of its own, BATCH_ROWS rows at
    a time and only the columns asked for;
  - an ``.arrow`` file, Arrow IPC in its file or its stream form (the form
    the ``datasets`` library caches and saves in), memory-mapped;
  - a ``datasets.save_to_disk`` folder (``datasets_files``): its arrow
    files, as ``datasets.load_from_disk`` lists them; of a DatasetDict
    folder, its ``train`` split;
  - ``hf:NAME`` or ``hf:NAME:CONFIG``: the ``train`` split of a dataset in
    the local Hugging Face datasets cache, by name, as ``datasets.load_dataset``
    finds it offline (HF_DATASETS_OFFLINE: nothing is downloaded; a name not
    in the cache is one line saying so).

Rows come out as dicts, BATCH_ROWS at a time, so memory stays flat
whatever the table's size: a text column is one document a row, chat
columns one conversation a row (rwkvx_c.data.chat).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rwkvx_c.errors import DataError
from rwkvx_c.util.files import read_json

__all__ = ["TABLE_KINDS", "BATCH_ROWS", "HF_PREFIX", "table_rows", "table_columns",
           "datasets_files", "is_datasets_folder", "cached_dataset_files"]

TABLE_KINDS = ("parquet", "arrow")
BATCH_ROWS = 1024
HF_PREFIX = "hf:"
EXTRA = 'pip install "rwkvx_c[datasets]"'
SPLIT = "train"


def _pyarrow(what: str) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"reading {what} needs pyarrow: {EXTRA}") from None
    return pyarrow


def _datasets(what: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading {what} needs the datasets library: {EXTRA}") from None
    return datasets


def _arrow_batches(pa: Any, path: str) -> Iterator[Any]:
    """The record batches of an Arrow IPC file, file form or stream form."""
    with pa.memory_map(path) as src:
        try:
            reader = pa.ipc.open_file(src)
        except pa.ArrowInvalid:   # no file footer: the stream form
            src.seek(0)
            yield from pa.ipc.open_stream(src)
            return
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)


def _batches(path: str, kind: str, columns: Sequence[str] | None) -> Iterator[Any]:
    """Record batches of at most BATCH_ROWS rows of the table at path,
    holding only `columns` (None: all)."""
    pa = _pyarrow(f"{kind} file {path}")
    try:
        if kind == "parquet":
            yield from pa.parquet.ParquetFile(path).iter_batches(
                batch_size=BATCH_ROWS, columns=None if columns is None else list(columns))
            return
        for batch in _arrow_batches(pa, path):
            if columns is not None:
                batch = batch.select(list(columns))
            for lo in range(0, batch.num_rows, BATCH_ROWS):
                yield batch.slice(lo, BATCH_ROWS)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"cannot read {kind} file {path}: {e}") from None


def _rows(path: str, kind: str) -> int:
    """The rows of a table, from its metadata (parquet) or batch headers."""
    pa = _pyarrow(f"{kind} file {path}")
    try:
        if kind == "parquet":
            return int(pa.parquet.ParquetFile(path).metadata.num_rows)
        return sum(b.num_rows for b in _arrow_batches(pa, path))
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"cannot read {kind} file {path}: {e}") from None


def table_columns(path: str, kind: str) -> list[str]:
    """The column names of the table at path."""
    pa = _pyarrow(f"{kind} file {path}")
    try:
        if kind == "parquet":
            return list(pa.parquet.ParquetFile(path).schema_arrow.names)
        with pa.memory_map(path) as src:
            try:
                return list(pa.ipc.open_file(src).schema.names)
            except pa.ArrowInvalid:
                src.seek(0)
                return list(pa.ipc.open_stream(src).schema.names)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"cannot read {kind} file {path}: {e}") from None


def table_rows(path: str, kind: str, columns: Sequence[str] | None = None,
               progress: Callable[[int], object] | None = None
               ) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number from 0, {column: value}) of every row of the table at
    path, holding `columns` (None: all); progress(n) is called with the
    file's bytes in proportion to the rows read."""
    size = os.path.getsize(path) if progress else 0
    total = _rows(path, kind) if progress else 0
    n = done = 0
    for batch in _batches(path, kind, columns):
        for row in batch.to_pylist():
            yield n, row
            n += 1
        if progress and total:
            now = size * n // total
            progress(now - done)
            done = now


def is_datasets_folder(path: str) -> bool:
    """True for a folder datasets.save_to_disk wrote: a Dataset's (its
    state.json and dataset_info.json) or a DatasetDict's (dataset_dict.json)."""
    def has(*names: str) -> bool:
        return all(os.path.isfile(os.path.join(path, f)) for f in names)
    return has("state.json", "dataset_info.json") or has("dataset_dict.json")


def _arrow_files(ds: Any, what: str) -> list[str]:
    if not isinstance(ds, _datasets(what).Dataset):
        if SPLIT not in ds:
            raise DataError(f"{what} has no {SPLIT!r} split (it has "
                            f"{', '.join(ds)}); give the split's folder")
        ds = ds[SPLIT]
    files = [f["filename"] for f in ds.cache_files]
    if not files:
        raise DataError(f"{what} is held in memory, not in arrow files")
    return files


def _json_object(path: str) -> dict[str, Any]:
    """The JSON object in the file at path, read with a bound; DataError else."""
    value = read_json(path, DataError, "datasets file")
    if not isinstance(value, dict):
        raise DataError(f"datasets file {path} holds a {type(value).__name__}, not an object")
    return value


def _check_saved(folder: str) -> None:
    """The JSON files of a save_to_disk folder (of a DatasetDict: of its
    train split) hold what datasets reads from them, checked first: the
    library reads them without a bound and meets a wrong type with a
    TypeError or KeyError."""
    path = os.path.join(folder, "dataset_dict.json")
    if os.path.lexists(path) and not os.path.lexists(os.path.join(folder, "state.json")):
        splits = _json_object(path).get("splits")
        if not isinstance(splits, list) or not all(isinstance(x, str) for x in splits):
            raise DataError(f"datasets file {path}: 'splits' must be a list of names")
        if SPLIT not in splits:
            return   # _arrow_files names the splits there are
        folder = os.path.join(folder, SPLIT)
    _json_object(os.path.join(folder, "dataset_info.json"))
    path = os.path.join(folder, "state.json")
    files = _json_object(path).get("_data_files")
    if not isinstance(files, list) or not files or not all(
            isinstance(f, dict) and isinstance(f.get("filename"), str) for f in files):
        raise DataError(f"datasets file {path}: '_data_files' must be a non-empty list "
                        "of {'filename': NAME} objects")


def datasets_files(folder: str) -> list[str]:
    """The arrow files, in order, of a datasets.save_to_disk folder (of a
    DatasetDict, its train split)."""
    ds = _datasets(f"the datasets folder {folder}")
    _check_saved(folder)
    try:
        return _arrow_files(ds.load_from_disk(folder), f"datasets folder {folder}")
    except (OSError, ValueError, TypeError, LookupError, AttributeError) as e:
        # FileNotFoundError for a broken folder; the others for JSON whose
        # fields past those _check_saved reads hold the wrong types
        raise DataError(f"cannot read datasets folder {folder}: {type(e).__name__}: {e}") \
            from None


def cached_dataset_files(name: str) -> list[str]:
    """The arrow files of the train split of the dataset `name` (NAME or
    NAME:CONFIG, without hf:) in the local Hugging Face datasets cache,
    found offline: nothing is downloaded. The offline switches
    (HF_HUB_OFFLINE, which the environment sets when the libraries are
    imported) are set for the call alone and restored after it."""
    ds = _datasets(f"{HF_PREFIX}{name}")
    from huggingface_hub import constants as hub
    switches = [(m, a) for m in (ds.config, hub) for a in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
                if hasattr(m, a)]
    saved = [getattr(m, a) for m, a in switches]
    repo, _, config = name.partition(":")
    try:
        for m, a in switches:
            setattr(m, a, True)
        found = ds.load_dataset(repo, config or None, split=SPLIT)
    except Exception as e:   # noqa: BLE001 -- datasets raises many kinds for a missing entry
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{HF_PREFIX}{name}: no such dataset in the local Hugging Face "
                        f"datasets cache ({first}); nothing is downloaded") from None
    finally:
        for (m, a), v in zip(switches, saved):
            setattr(m, a, v)
    return _arrow_files(found, f"{HF_PREFIX}{name}")
