"""A LoRA run's adapters as llama.cpp's adapter GGUF (``rwkvx-c export
--format gguf-lora``), loaded beside the base's GGUF (``llama-cli -m
BASE.gguf --lora ADAPTER.gguf``; llama_cpp.Llama(lora_path=...)).

What llama.cpp's loader (src/llama-adapter.cpp) reads: general.type
"adapter", general.architecture "rwkv7", adapter.type "lora",
adapter.lora.alpha; for each adapted matrix "{tensor}.lora_a", ggml
[in, r] (numpy [r, in]: our A), and "{tensor}.lora_b", ggml [r, out]
(numpy [out, r]: our B), under the base GGUF's tensor name. It scales by
alpha / r (r: lora_b's ggml ne[0]), as rwkvx_c's tune does. Its rwkv7
graph applies an adapter only where it multiplies through build_lora_mm
(src/models/rwkv7-base.cpp, rwkv7.cpp): the time-mix receptance, key,
value and output, the channel-mix key and value, and the head; an adapter
on anything else is refused in one line (docs/interop.md).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from rwkvx_c._core import RxPtModel
from rwkvx_c.errors import InteropError
from rwkvx_c.interop.gguf import ARCH, gguf_pairs, gguf_refusal, need_gguf
from rwkvx_c.interop.pth import DTYPES
from rwkvx_c.util.atomic import replace_with

__all__ = ["LLAMA_LORA", "save_gguf_lora"]

# the GGUF tensors llama.cpp's rwkv7 graph applies adapters to (build_lora_mm)
LLAMA_LORA = ("time_mix_receptance", "time_mix_key", "time_mix_value", "time_mix_output",
              "channel_mix_key", "channel_mix_value", "output")


def _applied(theirs: str) -> bool:
    return theirs.removesuffix(".weight").rsplit(".", 1)[-1] in LLAMA_LORA


def save_gguf_lora(model: RxPtModel, adapters: Mapping[str, tuple[np.ndarray, np.ndarray]],
                   alpha: float, path: str, dtype: str = "fp32") -> None:
    """Writes adapters ({our matrix: (A [r, in], B [out, r])}, scale alpha
    / r) as llama.cpp's adapter GGUF for model's gguf export, at dtype
    (fp32, bf16, fp16), atomically; InteropError (nothing written) when
    llama.cpp's rwkv7 holds no such model or applies no adapter to one of
    the matrices."""
    gguf = need_gguf()
    if dtype not in DTYPES:
        raise InteropError(f"unknown dtype {dtype!r} for gguf-lora; choose one of "
                           f"{', '.join(DTYPES)}")
    why = gguf_refusal(model.config)
    if why:
        raise InteropError(why)
    names = {ours: theirs for ours, theirs, how in gguf_pairs(model.config) if how == "t"}
    refused = [n for n in adapters if n not in names or not _applied(names[n])]
    if refused:
        raise InteropError(f"llama.cpp applies no adapter to {refused[0]} ({len(refused)} such "
                           "adapted matrices); it adapts the time-mix receptance, key, value, "
                           "output and the channel-mix key, value (train with the default "
                           "--lora-targets)")
    T = gguf.GGMLQuantizationType
    qtype = {"fp32": T.F32, "bf16": T.BF16, "fp16": T.F16}[dtype]

    def write(tmp: str) -> None:
        w = gguf.GGUFWriter(tmp, ARCH)
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_name("rwkvx_c LoRA adapters")
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        for ours, (A, B) in adapters.items():
            for suffix, a in ((".lora_a", A), (".lora_b", B)):
                a32 = np.ascontiguousarray(a, dtype=np.float32)
                if qtype == T.F32:
                    w.add_tensor(names[ours] + suffix, a32)
                else:
                    w.add_tensor(names[ours] + suffix, gguf.quants.quantize(a32, qtype),
                                 raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    replace_with(path, write)
