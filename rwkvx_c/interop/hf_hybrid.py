"""The Hugging Face folder of a model the rwkv7 layout cannot hold (RWKV-X
hybrids with MoBA attention, and RWKV-7 models of another head size or
without ln0): rwkvx_c's own modeling code for transformers, written into
the folder (``model_type "rwkvx"``, package data under hf_code/), so

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

runs it with transformers and torch alone. The weights are the rwkv-x
names (rwkvx_c.interop.rwkv7) renamed to the rwkv7 layout's module names
(model.layers.{i}.attn.r_proj ...) with a MoBA block's projections
attn.q_proj .. o_proj; docs/interop.md §hf."""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from rwkvx_c._core import RxPtModel
from rwkvx_c.data.tokenizers import Tokenizer
from rwkvx_c.errors import InteropError, RwkvxError
from rwkvx_c.interop.hf import (
    BLOCK_NAMES,
    HYBRID_TYPE,
    from_hf,
    hf_modules,
    hf_refusal,
    load_hf,
    write_code,
    write_folder,
)
from rwkvx_c.interop.rwkv7 import _export_pairs, _rwkvx_pairs
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.util.registry import entries

__all__ = ["HYBRID_CODE", "hybrid_config", "to_hybrid", "from_hybrid", "export_modules",
           "save_hybrid", "read_hf_folder"]

# the model context's keys config.json holds under the names transformers'
# configs use (ln0 as the bool embed_norm); every other one of them
# (ModelConfig's fields routed "ctx") goes there under its own name
_CTX_NAMED = ("ln0", "ln_eps", "gn_eps")


def _ctx_own() -> list[str]:
    """The model context's keys config.json holds under their own names."""
    return [e.key for e in entries(ModelConfig) if e.c_route == "ctx" and e.key not in _CTX_NAMED]


# the modeling files every such folder holds (rwkvx_c/interop/hf_code/)
HYBRID_CODE = ("configuration_rwkvx.py", "modeling_rwkvx.py")

# rwkv-x name inside an attention block -> (HF name inside model.layers.i, kind)
_MOBA = {
    "ln1.weight": ("attn_norm.weight", "same"), "ln1.bias": ("attn_norm.bias", "same"),
    "ln2.weight": ("ffn_norm.weight", "same"), "ln2.bias": ("ffn_norm.bias", "same"),
    "att.receptance.weight": ("attn.q_proj.weight", "same"),
    "att.key.weight": ("attn.k_proj.weight", "same"),
    "att.value.weight": ("attn.v_proj.weight", "same"),
    "att.output.weight": ("attn.o_proj.weight", "same"),
    "ffn.x_k": ("ffn.x_k", "flat"),
    "ffn.key.weight": ("ffn.key.weight", "same"), "ffn.value.weight": ("ffn.value.weight", "same"),
}
_TOP = {"rwkv.emb.weight": "model.embeddings.weight",
        "rwkv.blocks.0.ln0.weight": "model.pre_norm.weight",
        "rwkv.blocks.0.ln0.bias": "model.pre_norm.bias",
        "rwkv.ln_out.weight": "model.norm.weight", "rwkv.ln_out.bias": "model.norm.bias",
        "rwkv.head.weight": "lm_head.weight"}


def hybrid_config(config: Mapping[str, int], layers: str) -> dict[str, Any]:
    """config.json of a model of this config and block order (RxPtModel.layers,
    "R" and "A") in rwkvx_c's own layout, with the auto_map that points
    transformers at the folder's modeling files."""
    eps = ModelConfig.resolve(config)   # the LayerNorm and GroupNorm epsilons
    return {
        "model_type": HYBRID_TYPE, "architectures": ["RwkvxForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_rwkvx.RwkvxConfig",
                     "AutoModel": "modeling_rwkvx.RwkvxModel",
                     "AutoModelForCausalLM": "modeling_rwkvx.RwkvxForCausalLM"},
        "vocab_size": config["vocab_size"], "hidden_size": config["n_embd"],
        "head_dim": config["head_size"], "num_heads": config["n_head"],
        "num_attention_heads": config["n_head"],
        "block_types": ["rwkv" if k == "R" else "moba" for k in layers],
        "num_hidden_layers": config["n_rwkv_layer"] + config["n_attn_layer"],
        "intermediate_size": config["ffn_dim"], "decay_low_rank_dim": config["Dw"],
        "a_low_rank_dim": config["Da"], "v_low_rank_dim": config["Dv"],
        "gate_low_rank_dim": config["Dg"], "moba_chunk_size": config["chunk_size"],
        "moba_top_k": config["moba_top_k"], "embed_norm": bool(config.get("ln0", 0)),
        "norm_eps": eps["ln_eps"], "group_norm_eps": eps["gn_eps"],
        **{k: eps[k] for k in _ctx_own()},
        "tie_word_embeddings": False, "use_cache": True, "torch_dtype": "float32",
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
    }


def _positions(layers: str) -> dict[tuple[str, int], int]:
    """{(kind, j): L}: the j-th RWKV ("R") or attention ("A") block is block L."""
    return {(kind, j): L for kind in "RA"
            for j, L in enumerate(L for L, k in enumerate(layers) if k == kind)}


def _hybrid_name(name: str, at: Mapping[tuple[str, int], int]) -> tuple[str, str]:
    """(HF name, kind) of an rwkv-x name in rwkvx_c's own layout."""
    if name in _TOP:
        return _TOP[name], "same"
    m = re.fullmatch(r"(rwkv\.blocks|moba)\.(\d+)\.(.+)", name)
    assert m, name   # _rwkvx_pairs names only these
    rwkv = m.group(1) == "rwkv.blocks"
    hf, kind = (BLOCK_NAMES if rwkv else _MOBA)[m.group(3)]
    return f"model.layers.{at[('R' if rwkv else 'A', int(m.group(2)))]}.{hf}", kind


def to_hybrid(model: RxPtModel) -> dict[str, np.ndarray]:
    """The state dict of rwkvx_c's own HF layout: float32 arrays."""
    at = _positions(model.layers)
    pairs = [p for p in _rwkvx_pairs(model) if p[1] in model.params]   # ln0 only when present
    out = {}
    for name, a in _export_pairs(model, pairs).items():
        hf, kind = _hybrid_name(name, at)
        out[hf] = np.ascontiguousarray(a.T) if kind == "T" else \
            a.reshape(-1).copy() if kind == "flat" else a
    return out


def export_modules(model: RxPtModel) -> dict[str, str]:
    """{our projection matrix: the name of its nn.Linear in the model's hf
    export} for every matrix a LoRA adapts: PEFT's module names, in the
    layout export_model writes for this model (rwkv7 or rwkvx_c's own)."""
    if hf_refusal(model.config) is None:
        return hf_modules(model)
    at = _positions(model.layers)
    return {ours: _hybrid_name(theirs, at)[0][:-len(".weight")]
            for theirs, ours, kind in _rwkvx_pairs(model) if kind == "lin" and ours != "head"}


def save_hybrid(model: RxPtModel, tokenizer: Tokenizer, out_dir: str, dtype: str = "fp32",
                chat_template: str | None = None) -> None:
    """Writes the folder out_dir: config.json, model.safetensors, the
    modeling files and the tokenizer's files (with chat_template, when
    given); each file atomically."""
    write_folder(to_hybrid(model), hybrid_config(model.config, model.layers), tokenizer,
                 out_dir, dtype, model.config["vocab_size"], chat_template)
    write_code(HYBRID_CODE, out_dir)


def read_hf_folder(folder: str) -> RxPtModel:
    """The model of a Hugging Face folder in either layout export_model
    writes (rwkv7 or rwkvx_c's own)."""
    sd, cfg = load_hf(folder)
    return from_hybrid(sd, cfg) if cfg.get("model_type") == HYBRID_TYPE else from_hf(sd, cfg)


def from_hybrid(sd: Mapping[str, np.ndarray], cfg: Mapping[str, Any]) -> RxPtModel:
    """An RxPtModel holding a folder of rwkvx_c's own layout (the inverse of
    to_hybrid): sizes from config.json, every tensor present with its shape,
    none unknown."""
    try:
        types = list(cfg["block_types"])
        C, N = int(cfg["hidden_size"]), int(cfg["head_dim"])
        config: dict[str, Any] = dict(
            n_embd=C, head_size=N, n_head=C // N, n_rwkv_layer=types.count("rwkv"),
            n_attn_layer=types.count("moba"), vocab_size=int(cfg["vocab_size"]),
            ffn_dim=int(cfg["intermediate_size"]), Dw=int(cfg["decay_low_rank_dim"]),
            Da=int(cfg["a_low_rank_dim"]), Dg=int(cfg["gate_low_rank_dim"]),
            Dv=int(cfg["v_low_rank_dim"]), chunk_size=int(cfg["moba_chunk_size"]),
            moba_top_k=int(cfg["moba_top_k"]), ln0=int(bool(cfg["embed_norm"])),
            ln_eps=float(cfg.get("norm_eps", ModelConfig.default("ln_eps"))),
            gn_eps=float(cfg.get("group_norm_eps", ModelConfig.default("gn_eps"))),
            **{k: cfg[k] for k in _ctx_own() if k in cfg})
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise InteropError(f"config.json of model_type {HYBRID_TYPE!r} lacks or garbles "
                           f"{e}") from None
    try:
        model = RxPtModel(config)
    except (RwkvxError, ValueError) as e:
        raise InteropError(f"config.json's sizes make no valid model: {e}") from None
    order = "".join("R" if t == "rwkv" else "A" for t in types)
    if model.layers != order:
        raise InteropError(f"config.json's block order {order} is not rwkvx_c's "
                           f"{model.layers} for these sizes")
    at = _positions(model.layers)
    seen = set()
    for theirs, ours, kind in _rwkvx_pairs(model):
        if ours not in model.params:
            continue
        hf, hkind = _hybrid_name(theirs, at)
        if hf not in sd:
            raise InteropError(f"the folder lacks tensor {hf}")
        a = np.asarray(sd[hf], dtype=np.float32)
        want = model.params[ours].shape
        # a Linear weight is [out, in] (ours [in, out]); a time-mix LoRA matrix
        # is transposed between x070 and HF: either way one transpose
        if (kind == "lin") != (hkind == "T"):
            a = a.T
        if a.size != int(np.prod(want)) or (len(want) == 2 and a.shape != want):
            raise InteropError(f"{hf} has shape {np.shape(sd[hf])}, the model expects {want}")
        model.params[ours][...] = a.reshape(want)
        seen.add(hf)
    extra = sorted(set(sd) - seen)
    if extra:
        raise InteropError(f"{extra[0]} is not a tensor of rwkvx_c's model")
    return model
