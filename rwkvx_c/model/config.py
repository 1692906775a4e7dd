"""ModelConfig: the one type for an RWKV-X model's sizes, and its rules.

Fields are rx_pt_config's (csrc/rx_pretrain.h, docs/layout.md §Config) in
its order, plus ``ln0`` (the embedding LayerNorm, a model flag; absent in
checkpoints written before it existed, so it defaults to 0). A ModelConfig
is checked when it is made -- the C core's own rules, by name, through
``_core.check_config`` -- so an instance always builds a model.

Derived sizes live here too: the RWKV-7 LoRA sizes a width suggests
(``lora_sizes``), and ``with_shape``, which applies the model-shape options
of the trainer and the CLI (``SHAPE_OPTIONS``, the one list of them) the way
a user expects: a new width brings its own head count, ffn_dim 4*C and LoRA
sizes unless those are given too.

Checkpoints and the Python model keep the config as a plain dict
(``to_dict`` / ``from_dict``), so the file format does not depend on this
class.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from rwkvx_c import _core
from rwkvx_c.errors import ConfigError
from rwkvx_c.model.presets import PRESETS

__all__ = ["ModelConfig", "ShapeOption", "SHAPE_OPTIONS", "LORA_FACTORS", "lora_sizes"]

# RWKV-LM x070's LoRA size rule max(32, round(f * sqrt(C) / 32) * 32), its f
# per LoRA, in the config's order Dw, Da, Dg, Dv
LORA_FACTORS = {"Dw": 2.5, "Da": 2.5, "Dg": 5.0, "Dv": 1.7}
LORA_MIN = 32
LORA_STEP = 32
FFN_MULT = 4


def lora_sizes(n_embd: int) -> dict[str, int]:
    """{"Dw", "Da", "Dg", "Dv"}: the LoRA sizes RWKV-LM's x070 suggests for
    width n_embd (C = 768 gives 64, 64, 128, 32, as the 0.1B model ships)."""
    return {k: max(LORA_MIN, int(round(f * n_embd ** 0.5 / LORA_STEP) * LORA_STEP))
            for k, f in LORA_FACTORS.items()}


@dataclass(frozen=True)
class ShapeOption:
    """One model-shape option: keyword `name` (CLI flag --name with _ as -)
    sets config field `field`, an integer >= least."""
    name: str
    field: str
    least: int
    metavar: str
    help: str


_LORA_HELP = "LoRA size (default: RWKV-7's max(32, round(f*sqrt(C)/32)*32))"
SHAPE_OPTIONS = (
    ShapeOption("n_embd", "n_embd", 1, "C", "width; a new width also sets ffn_dim 4*C and "
                "RWKV-7's LoRA sizes for C unless given"),
    ShapeOption("head_size", "head_size", 1, "N", "head size (n_embd must be a multiple; 64 "
                "for llama.cpp and rwkv-x)"),
    ShapeOption("n_layer", "n_rwkv_layer", 1, "L", "RWKV-7 blocks"),
    ShapeOption("n_attn_layer", "n_attn_layer", 0, "A", "MoBA attention blocks (0: pure "
                "RWKV-7; at most n_layer)"),
    ShapeOption("ffn_dim", "ffn_dim", 1, "F", "channel-mix hidden size"),
    ShapeOption("chunk_size", "chunk_size", 1, "K", "MoBA chunk size"),
    ShapeOption("moba_top_k", "moba_top_k", 0, "K", "MoBA chunks each query selects (0: all, "
                "dense causal attention)"),
    ShapeOption("d_decay", "Dw", 1, "D", "decay " + _LORA_HELP),
    ShapeOption("d_aaa", "Da", 1, "D", "in-context learning rate " + _LORA_HELP),
    ShapeOption("d_gate", "Dg", 1, "D", "output gate " + _LORA_HELP),
    ShapeOption("d_mv", "Dv", 1, "D", "value-residual " + _LORA_HELP),
)


@dataclass(frozen=True)
class ModelConfig:
    """The sizes of an RWKV-X model (docs/maths.md §Whole model); checked on creation."""
    n_embd: int
    n_head: int
    head_size: int
    n_rwkv_layer: int
    n_attn_layer: int
    vocab_size: int
    Dw: int
    Da: int
    Dg: int
    Dv: int
    ffn_dim: int
    chunk_size: int
    moba_top_k: int
    ln0: int = 0

    def __post_init__(self) -> None:
        try:
            _core.check_config(asdict(self))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"bad model config: {e}") from None

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ModelConfig:
        """The config of a dict with the field names (ln0 may be absent)."""
        if not isinstance(config, Mapping):
            raise ConfigError(f"a model config is a dict of sizes, got {type(config).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(config) - set(names))
        if unknown:
            raise ConfigError(f"unknown model config keys: {', '.join(map(str, unknown))}")
        missing = [n for n in names if n not in config and n != "ln0"]
        if missing:
            raise ConfigError(f"the model config lacks {', '.join(missing)}")
        return cls(**dict(config))

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """The model of preset `name` (rwkvx_c.model.presets)."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls.from_dict(PRESETS[name]["model"])

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @property
    def n_blocks(self) -> int:
        return self.n_rwkv_layer + self.n_attn_layer

    def with_shape(self, **options: int | None) -> ModelConfig:
        """This config with the SHAPE_OPTIONS given (None: keep). A new width
        or head size sets n_head; a new width also sets ffn_dim and the LoRA
        sizes for it unless they are given. ConfigError on a bad value."""
        known = {o.name: o for o in SHAPE_OPTIONS}
        for name, v in options.items():
            if name not in known:
                raise ConfigError(f"unknown model-shape option {name!r}")
            least = known[name].least
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < least):
                raise ConfigError(f"{name} must be an integer >= {least}, got {v!r}")
        given = {known[k].field: v for k, v in options.items() if v is not None}
        C = given.get("n_embd", self.n_embd)
        N = given.get("head_size", self.head_size)
        if C % N:
            raise ConfigError(f"n_embd {C} is not a multiple of head_size {N}")
        new: dict[str, int] = {}
        if "n_embd" in given or "head_size" in given:
            new.update(n_embd=C, head_size=N, n_head=C // N)
        if "n_embd" in given:
            new.update(ffn_dim=FFN_MULT * C, **lora_sizes(C))
        new.update(given)
        return replace(self, **new)
