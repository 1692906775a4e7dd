"""Entry point of an rwkvx_c Hugging Face export of a pure RWKV-7 model,
in rwkv7-hf's thin layout: config.json's auto_map names this module, whose
model classes are the installed rwkv7-hf package's, re-exported."""
from __future__ import annotations

try:
    from rwkv7_hf.modeling_rwkv7 import RWKV7ForCausalLM, RWKV7Model
except ImportError as exc:
    raise ImportError("this RWKV-7 model runs on the rwkv7-hf package: "
                      "pip install 'rwkv7-hf>=0.9'") from exc

__all__ = ["RWKV7Model", "RWKV7ForCausalLM"]
