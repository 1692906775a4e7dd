"""Entry point of an rwkvx_c Hugging Face export with the RWKV World
vocabulary: tokenizer_config.json's auto_map names this module, whose
tokenizer is the installed rwkv7-hf package's, re-exported (it reads the
folder's rwkv_vocab_v20230424.txt; id 0 is <|endoftext|>)."""
from __future__ import annotations

try:
    from rwkv7_hf.tokenization_rwkv7 import RWKV7Tokenizer
except ImportError as exc:
    raise ImportError("the RWKV World tokenizer runs on the rwkv7-hf package: "
                      "pip install 'rwkv7-hf>=0.9'") from exc

__all__ = ["RWKV7Tokenizer"]
