"""The Hugging Face layout of RWKV-7 (flash-linear-attention's ``rwkv7``
model type, which fla-hub checkpoints, rwkv7-hf conversions, vLLM and
SGLang read), out and in:

    save_hf(model, tokenizer, "out/", "bf16")   # config.json, model.safetensors, tokenizer
    sd, config = load_hf("fla-hub-model/")      # float32 arrays under the HF names
    model = from_hf(sd, config)

The HF names are a renaming of the x070 state dict (rwkvx_c.interop.rwkv7):
this module translates names and layouts only, so export and import share
every check the x070 door makes. The mapping and what is refused is
docs/interop.md §hf. Files are safetensors: read tensor by tensor by
rwkvx_c.interop.safetensors_file (HfAsX070 hands a folder to
rwkvx_c.interop.rwkv7.stream_rwkv7 as x070 tensors, converted as each is
read), written with the ``safetensors`` package over torch tensors (bf16
has no NumPy type): the extra ``hf-model``. The tokenizer's files, written
and read back, are rwkvx_c.interop.hf_tokenizer's.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from rwkvx_c._core import RxPtModel
from rwkvx_c.data.tokenizers import (
    WORLD_VOCAB,
    Tokenizer,
)
from rwkvx_c.errors import InteropError
from rwkvx_c.interop.hf_tokenizer import (
    BYTE_MARK,
    EOT_ID,
    WORLD_CODE,
    hf_tokenizer,
    save_tokenizer,
    write_code,
    write_json,
)
from rwkvx_c.interop.pth import DTYPES
from rwkvx_c.interop.rwkv7 import from_rwkv7, linear_prefixes, to_rwkv7
from rwkvx_c.interop.safetensors_file import SafetensorsTensors, ShardedTensors
from rwkvx_c.model.config import ModelConfig, export_refusal
from rwkvx_c.model.lora import ADAPTERS
from rwkvx_c.run.rundir import CHECKPOINT
from rwkvx_c.util.atomic import replace_with
from rwkvx_c.util.files import read_json

__all__ = ["hf_refusal", "hf_config", "to_hf", "from_hf", "save_hf", "load_hf", "hf_tokenizer",
           "HF_WEIGHTS", "BYTE_MARK", "PEFT_FILES", "save_peft", "hf_modules", "BLOCK_NAMES",
           "write_code", "write_folder", "HfAsX070", "hf_tensors", "read_hf_config"]

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
# the entry points of rwkv7-hf's thin layout (package data under hf_code/, as
# rwkv7-hf's converter writes them: subclasses of the installed package's)
RWKV7_CODE = ("configuration_rwkv7.py", "modeling_rwkv7.py")
RWKV7_HF_MIN = "0.9.0"   # the oldest rwkv7-hf whose classes the entry points name
# every file an export may write into its folder
HF_FILES = ("config.json", HF_WEIGHTS, "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", WORLD_VOCAB, *RWKV7_CODE, *WORLD_CODE,
            "configuration_rwkvx.py", "modeling_rwkvx.py")
# the files of a PEFT LoRA adapter folder (save_peft)
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")
HYBRID_TYPE = "rwkvx"   # config.json's model_type of rwkvx_c's own layout (hf_hybrid)

# x070 name inside a block -> (HF name inside model.layers.i, kind): "same"
# (identical array), "T" (transposed: x070 LoRA matrices are [in, out], HF
# Linear weights [out, in]), "flat" (x070 (1, 1, C), HF [C])
BLOCK_NAMES = {
    "ln0.weight": ("pre_norm.weight", "same"), "ln0.bias": ("pre_norm.bias", "same"),
    "ln1.weight": ("attn_norm.weight", "same"), "ln1.bias": ("attn_norm.bias", "same"),
    "ln2.weight": ("ffn_norm.weight", "same"), "ln2.bias": ("ffn_norm.bias", "same"),
    **{f"att.x_{c}": (f"attn.x_{c}", "same") for c in "rwkvag"},
    "att.k_k": ("attn.k_k", "flat"), "att.k_a": ("attn.k_a", "flat"),
    "att.r_k": ("attn.r_k", "same"),
    **{f"att.{p}0": (f"attn.{p}_lora.lora.2.bias", "flat") for p in "wav"},
    **{f"att.{p}1": (f"attn.{p}_lora.lora.0.weight", "T") for p in "wavg"},
    **{f"att.{p}2": (f"attn.{p}_lora.lora.2.weight", "T") for p in "wavg"},
    "att.receptance.weight": ("attn.r_proj.weight", "same"),
    "att.key.weight": ("attn.k_proj.weight", "same"),
    "att.value.weight": ("attn.v_proj.weight", "same"),
    "att.output.weight": ("attn.o_proj.weight", "same"),
    "att.ln_x.weight": ("attn.g_norm.weight", "same"),
    "att.ln_x.bias": ("attn.g_norm.bias", "same"),
    "ffn.x_k": ("ffn.x_k", "flat"),
    "ffn.key.weight": ("ffn.key.weight", "same"), "ffn.value.weight": ("ffn.value.weight", "same"),
}
_TOP = {"emb.weight": "model.embeddings.weight", "ln_out.weight": "model.norm.weight",
        "ln_out.bias": "model.norm.bias", "head.weight": "lm_head.weight"}
_BLOCK_BACK = {hf: (x, kind) for x, (hf, kind) in BLOCK_NAMES.items()}
_TOP_BACK = {hf: x for x, hf in _TOP.items()}


def hf_refusal(config: Mapping[str, int]) -> str | None:
    """Why the HF rwkv7 layout cannot hold a model of this config, or None
    (export_model then writes rwkvx_c's own layout, rwkvx_c.interop.hf_hybrid)."""
    return export_refusal(config, "hf", "the Hugging Face rwkv7 layout")


def hf_config(config: Mapping[str, int]) -> dict[str, Any]:
    """config.json of a model: flash-linear-attention's RWKV7Config keys
    (which rwkv7-hf's shares), and the auto_map of rwkv7-hf's thin layout
    that lets transformers load the folder by name."""
    C, L = config["n_embd"], config["n_rwkv_layer"]
    return {
        "model_type": "rwkv7", "architectures": ["RWKV7ForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_rwkv7.RWKV7Config",
                     "AutoModel": "modeling_rwkv7.RWKV7Model",
                     "AutoModelForCausalLM": "modeling_rwkv7.RWKV7ForCausalLM"},
        "rwkv7_hf_adapter_layout": "thin", "rwkv7_hf_runtime_version": _rwkv7_hf_version(),
        "vocab_size": config["vocab_size"], "hidden_size": C, "num_hidden_layers": L,
        "head_dim": config["head_size"], "num_heads": config["n_head"],
        "hidden_ratio": config["ffn_dim"] / C, "intermediate_size": config["ffn_dim"],
        "decay_low_rank_dim": config["Dw"], "a_low_rank_dim": config["Da"],
        "v_low_rank_dim": config["Dv"], "gate_low_rank_dim": config["Dg"],
        "value_dim": [C] * L, "hidden_act": "sqrelu", "norm_first": True, "norm_bias": True,
        "norm_eps": ModelConfig.resolve(config)["ln_eps"], "attn": None,
        "tie_word_embeddings": False,
        "use_cache": True, "fuse_norm": False, "fuse_cross_entropy": False,
        "attn_mode": "chunk", "torch_dtype": "float32",
        "bos_token_id": EOT_ID, "eos_token_id": EOT_ID, "pad_token_id": EOT_ID,
    }


def _rwkv7_hf_version() -> str:
    """The rwkv7-hf version the thin entry points run on: the installed one."""
    from importlib import metadata
    try:
        return metadata.version("rwkv7-hf")
    except metadata.PackageNotFoundError:
        return RWKV7_HF_MIN


def to_hf(model: RxPtModel) -> dict[str, np.ndarray]:
    """The HF state dict of a model: float32 arrays under the rwkv7 names."""
    why = hf_refusal(model.config)
    if why:
        raise InteropError(why)
    out = {}
    for name, a in to_rwkv7(model).items():
        hf, kind = _hf_name(name)
        out[hf] = np.ascontiguousarray(a.T) if kind == "T" else \
            a.reshape(-1).copy() if kind == "flat" else a
    return out


def _hf_name(x070: str) -> tuple[str, str]:
    if x070 in _TOP:
        return _TOP[x070], "same"
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", x070)
    assert m and m.group(2) in BLOCK_NAMES, x070   # to_rwkv7 writes only these
    hf, kind = BLOCK_NAMES[m.group(2)]
    return f"model.layers.{m.group(1)}.{hf}", kind


def _x070_name(hf: str) -> tuple[str, str]:
    if hf in _TOP_BACK:
        return _TOP_BACK[hf], "same"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
    if not m or m.group(2) not in _BLOCK_BACK:
        raise InteropError(f"{hf} is not a tensor of the RWKV-7 model rwkvx_c holds (the "
                           "Hugging Face rwkv7 layout)")
    x, kind = _BLOCK_BACK[m.group(2)]
    return f"blocks.{m.group(1)}.{x}", kind


def _check_config(cfg: Mapping[str, Any], what: str) -> None:
    """Refuses a config.json whose model differs from ours in what the
    tensors do not show (the tensors' shapes give every size)."""
    if cfg.get("model_type") != "rwkv7":
        raise InteropError(f"{what}: model_type is {cfg.get('model_type')!r}, not 'rwkv7'")
    checks = [("hidden_act", "sqrelu"), ("norm_first", True), ("norm_bias", True),
              ("attn", None)]
    for key, want in checks:
        if key in cfg and cfg[key] != want:
            raise InteropError(f"{what}: {key} is {cfg[key]!r}; rwkvx_c's RWKV-7 has {want!r}")
    ln_eps = ModelConfig.default("ln_eps")
    eps = cfg.get("norm_eps", ln_eps)
    if not isinstance(eps, (int, float)) or abs(eps - ln_eps) > 1e-12:
        raise InteropError(f"{what}: norm_eps is {eps!r}; rwkvx_c's LayerNorms use "
                           f"{ln_eps!r}")
    C = cfg.get("hidden_size")
    if any(v != C for v in cfg.get("value_dim") or []):
        raise InteropError(f"{what}: value_dim {cfg['value_dim']} differs from hidden_size {C}")


class _InMemory:
    """A state dict in memory, read as HfAsX070 reads a file."""

    def __init__(self, sd: Mapping[str, np.ndarray]) -> None:
        self._sd, self.path = sd, "the state dict"

    @property
    def names(self) -> list[str]:
        return list(self._sd)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(np.shape(self._sd[name]))

    def array(self, name: str) -> np.ndarray:
        return np.asarray(self._sd[name])


def _to_x070(a: np.ndarray, kind: str) -> np.ndarray:
    return np.ascontiguousarray(a.T) if kind == "T" else a.reshape(1, 1, -1) \
        if kind == "flat" else a


class HfAsX070:
    """The tensors of an HF rwkv7 state dict (SafetensorsTensors,
    ShardedTensors) under the x070 names and layouts, each converted as it
    is read, so stream_rwkv7 takes it as it takes a .pth: "same" tensors
    (every Linear weight: [out, in] in both) pass their stored bits
    through, the time-mix LoRA matrices ("T", small) come transposed, the
    [C] vectors ("flat") as (1, 1, C). Every name, shape and config.json
    key is checked when it is made (a tied head, no lm_head.weight and
    tie_word_embeddings true, reads the embedding)."""

    def __init__(self, tensors: Any, config: Mapping[str, Any] | None = None) -> None:
        config = config or {}
        _check_config(dict(config, model_type=config.get("model_type", "rwkv7")), "config.json")
        self.path, self._t = tensors.path, tensors
        self._names: dict[str, tuple[str, str]] = {}
        for name in tensors.names:
            x, kind = _x070_name(name)
            shape = tensors.shape(name)
            if kind == "T" and len(shape) != 2:
                raise InteropError(f"{name} has shape {shape}, expected 2 dimensions")
            if kind == "flat" and sum(d != 1 for d in shape) > 1:
                raise InteropError(f"{name} has shape {shape}, expected a vector")
            self._names[x] = (name, kind)
        if "head.weight" not in self._names and config.get("tie_word_embeddings") \
                and "emb.weight" in self._names:
            self._names["head.weight"] = self._names["emb.weight"]
        if "blocks.0.att.r_k" in self._names:
            rk = self.shape("blocks.0.att.r_k")
            if rk[-1:] != (64,):
                raise InteropError(f"head size {rk[-1] if rk else rk}: the Hugging Face rwkv7 "
                                   "layout wants 64")

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        hf, kind = self._names[name]
        s = self._t.shape(hf)
        return s[::-1] if kind == "T" else (1, 1, int(np.prod(s))) if kind == "flat" else s

    def dtype(self, name: str) -> str:
        return str(self._t.dtype(self._names[name][0]))

    def raw(self, name: str) -> np.ndarray:
        hf, kind = self._names[name]
        return _to_x070(self._t.raw(hf), kind)

    def array(self, name: str) -> np.ndarray:
        hf, kind = self._names[name]
        return _to_x070(self._t.array(hf), kind)

    def release(self, name: str) -> None:
        self._t.release(self._names[name][0])

    def close(self) -> None:
        self._t.close()


def from_hf(sd: Mapping[str, np.ndarray], config: Mapping[str, Any] | None = None
            ) -> RxPtModel:
    """An RxPtModel holding an HF rwkv7 state dict (sizes from the shapes,
    every tensor checked as an x070 import is; HfAsX070's checks)."""
    view = HfAsX070(_InMemory(sd), config)
    return from_rwkv7({x: view.array(x) for x in view.names})


# ---- files ----------------------------------------------------------------------


def _need(what: str) -> tuple[Any, Any]:
    try:
        import safetensors.torch
        import torch
    except ImportError:
        raise InteropError(f"{what} needs safetensors and PyTorch: "
                           'pip install "rwkvx_c[hf-model]"') from None
    return torch, safetensors.torch


def save_hf(model: RxPtModel, tokenizer: Tokenizer, out_dir: str, dtype: str = "fp32",
            chat_template: str | None = None) -> None:
    """Writes the HF folder out_dir: config.json, model.safetensors (dtype
    fp32, bf16 or fp16), rwkv7-hf's thin entry points and the tokenizer's
    files (with chat_template, when given); each file atomically. Refuses a
    model the layout cannot hold before writing anything."""
    write_folder(to_hf(model), hf_config(model.config), tokenizer, out_dir, dtype,
                 model.config["vocab_size"], chat_template)
    write_code(RWKV7_CODE, out_dir)


def write_folder(sd: Mapping[str, np.ndarray], cfg: dict[str, Any], tokenizer: Tokenizer,
                 out_dir: str, dtype: str, vocab: int, chat_template: str | None = None) -> None:
    """The files every HF export holds: the tensors sd as model.safetensors
    at dtype, config.json cfg and the tokenizer's files (chat_template in
    its tokenizer_config.json)."""
    if dtype not in DTYPES:
        raise InteropError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    torch, st = _need("the Hugging Face format")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise InteropError(f"{out_dir} is a file; --format hf writes a folder")
    if os.path.exists(os.path.join(out_dir, CHECKPOINT)):
        # its tokenizer.json would be replaced: a run folder is an input, never an output
        raise InteropError(f"{out_dir} is a run folder; write the Hugging Face folder elsewhere")
    os.makedirs(out_dir, exist_ok=True)
    td = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)).to(td) for k, v in sd.items()}
    cfg = dict(cfg, torch_dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype])
    replace_with(os.path.join(out_dir, HF_WEIGHTS),
                 lambda tmp: st.save_file(tensors, tmp, metadata={"format": "pt"}))
    write_json(os.path.join(out_dir, "config.json"), cfg)
    save_tokenizer(tokenizer, out_dir, vocab, chat_template)


def hf_modules(model: RxPtModel) -> dict[str, str]:
    """{our projection matrix: its nn.Linear's name in the rwkv7 layout}."""
    return {ours: _hf_name(x070 + ".weight")[0][:-len(".weight")]
            for ours, x070 in linear_prefixes(model).items()}


def save_peft(model: RxPtModel, adapters: Mapping[str, tuple[np.ndarray, np.ndarray]],
              alpha: float, out_dir: str, dtype: str = "fp32",
              modules: Mapping[str, str] | None = None, kind: str = "lora",
              magnitudes: Mapping[str, np.ndarray] | None = None) -> None:
    """Writes a LoRA run's adapters as a Hugging Face PEFT adapter folder for
    the hf export of its base: adapter_config.json (LORA, r, lora_alpha,
    target_modules: the hf names of the adapted Linears) and
    adapter_model.safetensors ('base_model.model.{module}.lora_A.weight'
    [r, in], '.lora_B.weight' [out, r]); PeftModel.from_pretrained puts them
    on RWKV7ForCausalLM (tests/test_lora.py). modules: {our matrix: module
    name} of the hf export (default: the rwkv7 layout's; a hybrid's come
    from rwkvx_c.interop.hf_hybrid.export_modules). kind: the adapters'
    (rwkvx_c.model.lora.ADAPTERS), whose PEFT keys the config sets
    (rsLoRA: use_rslora, alpha its own); magnitudes: DoRA's {our matrix:
    M [out]}, written as '.lora_magnitude_vector' [out] (use_dora)."""
    if dtype not in DTYPES:
        raise InteropError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if modules is None:
        why = hf_refusal(model.config)
        if why:
            raise InteropError(why)
        modules = hf_modules(model)
    torch, st = _need("the PEFT format")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise InteropError(f"{out_dir} is a file; --format peft writes a folder")
    td = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    fold = ADAPTERS[kind].fold   # MiSS: its block B^T [r, out] alone (A is the fixed fold)
    tensors, targets, r = {}, [], 0
    for ours, (A, B) in adapters.items():
        module = modules[ours]
        targets.append(module)
        r = A.shape[0]
        parts: tuple[tuple[str, np.ndarray], ...] = \
            (("miss_block", np.ascontiguousarray(B.T)),) if fold else \
            (("lora_A.weight", A), ("lora_B.weight", B))
        if magnitudes:
            parts += (("lora_magnitude_vector", magnitudes[ours]),)
        for part, a in parts:
            tensors[f"base_model.model.{module}.{part}"] = torch.from_numpy(
                np.array(a, dtype=np.float32)).to(td)
    cfg: dict[str, Any] = {"task_type": "CAUSAL_LM", "r": r, "target_modules": targets,
                           "bias": "none", "inference_mode": True,
                           "base_model_name_or_path": None, "modules_to_save": None}
    cfg.update({"init_weights": True, "miss_dropout": 0.0} if fold else
               {"peft_type": "LORA", "lora_alpha": alpha, "lora_dropout": 0.0,
                "fan_in_fan_out": False, "use_rslora": False})
    cfg.update(ADAPTERS[kind].peft)
    os.makedirs(out_dir, exist_ok=True)
    replace_with(os.path.join(out_dir, PEFT_FILES[1]),
                 lambda tmp: st.save_file(tensors, tmp, metadata={"format": "pt"}))
    write_json(os.path.join(out_dir, PEFT_FILES[0]), cfg)


def read_hf_config(folder: str) -> dict[str, Any]:
    """config.json of an HF folder, checked as an rwkv7 model's unless it
    is rwkvx_c's own layout (hf_hybrid checks that)."""
    cpath = os.path.join(folder, "config.json")
    try:
        config = read_json(cpath, InteropError, "the model config")
    except FileNotFoundError:
        raise InteropError(f"{folder} has no config.json: not a Hugging Face model folder") \
            from None
    except OSError as e:
        raise InteropError(f"{cpath} is not readable: {e.strerror or e}") from None
    if not isinstance(config, dict):
        raise InteropError(f"{cpath} does not hold a JSON object")
    if config.get("model_type") != HYBRID_TYPE:
        _check_config(config, cpath)
    return config


def hf_tensors(folder: str) -> SafetensorsTensors | ShardedTensors:
    """The weights of an HF folder, opened (nothing read): model.safetensors,
    or the shards its index names. No pickle: .bin weights are refused."""
    single, index = os.path.join(folder, HF_WEIGHTS), os.path.join(folder, HF_INDEX)
    if os.path.isfile(index):
        return ShardedTensors(index)
    if os.path.isfile(single):
        return SafetensorsTensors(single)
    if any(n.endswith(".bin") for n in os.listdir(folder)):
        raise InteropError(f"{folder} holds pickled .bin weights only; rwkvx_c reads "
                           "safetensors (no pickle)")
    raise InteropError(f"{folder} has neither {HF_WEIGHTS} nor {HF_INDEX}")


def load_hf(folder: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(float32 tensors under the HF names, config.json) of an HF folder
    (hf_tensors): bf16, fp16 and fp32 converted exactly."""
    config = read_hf_config(folder)
    tensors = hf_tensors(folder)
    try:
        return {n: tensors.array(n) for n in tensors.names}, config
    finally:
        tensors.close()
