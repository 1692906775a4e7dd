"""Entry point of an rwkvx_c Hugging Face export of a pure RWKV-7 model,
in rwkv7-hf's thin layout: config.json's auto_map names this module, whose
config class is the installed rwkv7-hf package's, re-exported as it is (a
subclass would lose its __init__ to the dataclass transformers 5 makes of
every config subclass)."""
from __future__ import annotations

try:
    from rwkv7_hf.configuration_rwkv7 import RWKV7Config
except ImportError as exc:
    raise ImportError("this RWKV-7 model runs on the rwkv7-hf package: "
                      "pip install 'rwkv7-hf>=0.9'") from exc

__all__ = ["RWKV7Config"]
