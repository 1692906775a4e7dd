"""PyTorch .pth files: state dicts in as float32 NumPy arrays, out at a chosen
dtype. torch is an optional extra (pip install "rwkvx_c[torch]"); it is
imported only here, when a .pth is read or written.

    save_pth(sd, "model.pth", "bf16")  # round to nearest even
    sd = load_pth("model.pth")         # bf16 / fp16 / fp32 in, float32 out
"""
from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from rwkvx_c.errors import InteropError
from rwkvx_c.util.atomic import replacing
from rwkvx_c.util.files import open_input

__all__ = ["DTYPES", "load_pth", "save_pth"]

DTYPES = ("fp32", "bf16", "fp16")


def _need_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise InteropError('reading and writing .pth files needs PyTorch: '
                           'pip install "rwkvx_c[torch]"') from None
    return torch


def load_pth(path: str) -> dict[str, np.ndarray]:
    """The tensors of a .pth state dict as float32 NumPy arrays (bf16, fp16
    and fp32 are converted exactly). Needs torch; loads weights only."""
    torch = _need_torch()
    try:
        with open_input(path, InteropError) as f:
            obj = torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise InteropError(f"{path}: no such file") from None
    except pickle.UnpicklingError as e:
        # torch's weights-only loader refused the pickle; its message (many
        # lines, suggesting weights_only=False) names a global when the file
        # would call code on load
        code = re.search(r"GLOBAL ([\w.]+)", str(e))
        if code:
            raise InteropError(f"{path} holds Python code ({code.group(1)}) and was not "
                               "loaded: a .pth state dict holds tensors only") from None
        why = re.search(r"Unsupported[^\n]*", str(e))
        raise InteropError(f"{path} is not a readable .pth state dict (not a pickle of "
                           f"tensors{': ' + why.group(0) if why else ''})") from None
    except InteropError:
        raise
    except Exception as e:  # noqa: BLE001 -- pickle and zip errors have many types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InteropError(f"{path} is not a readable .pth state dict: {first}") from None
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


def _torch_dtype(torch: Any, dtype: str) -> Any:
    if dtype not in DTYPES:
        raise InteropError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def save_pth(sd: Mapping[str, np.ndarray], path: str, dtype: str = "fp32") -> None:
    """Writes sd as a torch .pth state dict of dtype (fp32, bf16 or fp16;
    round to nearest even), atomically."""
    torch = _need_torch()
    td = _torch_dtype(torch, dtype)
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)).to(td)
               for k, v in sd.items()}
    try:
        # torch writes into our file object, so a failing write is the OSError
        # it is (disk full, read-only folder), not torch's enforce-fail text
        with replacing(path) as f:
            torch.save(tensors, f)
    except OSError as e:
        raise InteropError(f"cannot write {path}: {e.strerror or e}") from None
    except RuntimeError as e:   # torch's own writer failing
        raise InteropError(f"cannot write {path}: {str(e).splitlines()[0]}") from None
