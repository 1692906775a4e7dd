"""The config of an RWKV-X model exported by rwkvx_c (``model_type
"rwkvx"``): RWKV-7 blocks and MoBA attention blocks in ``block_types``
order. Written into every hybrid export folder beside modeling_rwkvx.py,
so ``AutoConfig.from_pretrained(DIR, trust_remote_code=True)`` reads it
with transformers alone (rwkvx_c need not be installed)."""
from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

__all__ = ["RwkvxConfig"]


class RwkvxConfig(PretrainedConfig):
    """Sizes of rwkvx_c's model (docs/maths.md): hidden_size C, head_dim N
    (C // N heads), block_types ("rwkv" or "moba" per block, in order),
    intermediate_size F (channel-mix), the time-mix LoRA ranks, MoBA's
    chunk size and top-k (0: every earlier chunk), embed_norm (LayerNorm
    after the embedding, RWKV-7's ln0)."""

    model_type = "rwkvx"
    keys_to_ignore_at_inference = ("past_key_values",)

    def __init__(self, vocab_size: int = 256, hidden_size: int = 128, head_dim: int = 64,
                 block_types: list[str] | None = None, intermediate_size: int = 512,
                 decay_low_rank_dim: int = 16, a_low_rank_dim: int = 16,
                 v_low_rank_dim: int = 8, gate_low_rank_dim: int = 32,
                 moba_chunk_size: int = 32, moba_top_k: int = 2, embed_norm: bool = True,
                 norm_eps: float | None = None, group_norm_eps: float | None = None,
                 use_cache: bool = True,
                 bos_token_id: int = 0, eos_token_id: int = 0, pad_token_id: int = 0,
                 tie_word_embeddings: bool = False, **kwargs: Any) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.head_dim = head_dim
        self.num_heads = self.num_attention_heads = hidden_size // head_dim
        self.block_types = list(block_types or ["rwkv", "rwkv", "moba"])
        self.num_hidden_layers = len(self.block_types)
        self.intermediate_size = intermediate_size
        self.decay_low_rank_dim = decay_low_rank_dim
        self.a_low_rank_dim = a_low_rank_dim
        self.v_low_rank_dim = v_low_rank_dim
        self.gate_low_rank_dim = gate_low_rank_dim
        self.moba_chunk_size = moba_chunk_size
        self.moba_top_k = moba_top_k
        self.embed_norm = embed_norm
        # the export writes the model's own epsilons into config.json (no
        # default here: they are rwkvx_c's, docs/maths.md)
        self.norm_eps = norm_eps
        self.group_norm_eps = group_norm_eps
        self.use_cache = use_cache
        super().__init__(**kwargs)
        # after the base's __init__, which sets its own defaults for these
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.pad_token_id, self.tie_word_embeddings = pad_token_id, tie_word_embeddings
