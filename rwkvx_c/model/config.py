"""ModelConfig: the one type for an RWKV-X model's sizes and settings, and its rules.

Each field is one declaration (``declare``, rwkvx_c.util.registry): its
default (or none: a size is required), what its absence in an old
checkpoint means, its help and CLI flag, the C route it takes and the one
value each export format can hold. From them come the model-shape flags
(``SHAPE_OPTIONS``), a saved config's resolution (``resolve``) and what a
checkpoint stores (``stored``), and the exporters' refusals
(``export_refusal``). The fields routed "struct" are rx_pt_config's
(csrc/rx_pretrain.h) in its order; ``ln0`` (the embedding LayerNorm) and
the eps of the norms are the model context's (rx_model_ctx), which carries
them to every kernel, training and inference alike. A ModelConfig is
checked when it is made -- the C core's own rules, by name, through
``_core.check_config`` -- so an instance always builds a model.

Derived sizes live here too: the RWKV-7 LoRA sizes a width suggests
(``lora_sizes``), and ``with_shape``, which applies the model-shape options
the way a user expects: a new width brings its own head count, ffn_dim 4*C
and LoRA sizes unless those are given too.

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
from rwkvx_c.util.registry import DEFAULT, KINDS, REQUIRED, declare, entries, resolve, stored

__all__ = ["ModelConfig", "ShapeOption", "SHAPE_OPTIONS", "LORA_FACTORS", "lora_sizes",
           "export_refusal"]

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
    """One model-shape option, derived from a ModelConfig field that has a
    flag: keyword `name` (CLI flag --name with _ as -) sets config field
    `field`, a value of `kind` (a rwkvx_c.util.registry.KINDS key)."""
    name: str
    field: str
    kind: str
    metavar: str
    help: str


_LORA_HELP = "LoRA size (default: RWKV-7's max(32, round(f*sqrt(C)/32)*32))"
# the one value of a field that each export format can hold (docs/interop.md):
# x070 .pth (rwkv7), rwkv-x's .pth (rwkvx), llama.cpp's GGUF, the Hugging Face layout
_RWKV7_ONLY = {"rwkv7": 0, "gguf": 0, "hf": 0}
_HEAD_64 = {"gguf": 64, "hf": 64, "rwkvx": 64}
_NEEDS_LN0 = {"rwkv7": 1, "gguf": 1, "hf": 1, "rwkvx": 1}


@dataclass(frozen=True)
class ModelConfig:
    """The sizes of an RWKV-X model (docs/maths.md §Whole model); checked on
    creation. Each field is one declaration (rwkvx_c.util.registry): the
    fields routed "struct" are rx_pt_config's, in its order
    (_core.CONFIG_FIELDS); those routed "ctx" the model context's
    (rx_model_ctx; _core.OPTION_FIELDS)."""
    n_embd: int = declare(REQUIRED, "width; a new width also sets ffn_dim 4*C and RWKV-7's "
                          "LoRA sizes for C unless given", kind="pos_int", flag="--n-embd",
                          metavar="C", c_route="struct")
    n_head: int = declare(REQUIRED, "heads: n_embd / head_size", kind="pos_int", cli=False,
                          c_route="struct")
    head_size: int = declare(REQUIRED, "head size (n_embd must be a multiple; 64 for "
                             "llama.cpp and rwkv-x)", kind="pos_int", flag="--head-size",
                             metavar="N", c_route="struct", exports=_HEAD_64)
    n_rwkv_layer: int = declare(REQUIRED, "RWKV-7 blocks", kind="pos_int", flag="--n-layer",
                                metavar="L", c_route="struct")
    n_attn_layer: int = declare(REQUIRED, "MoBA attention blocks (0: pure RWKV-7; at most "
                                "n_layer)", kind="nonneg_int", flag="--n-attn-layer",
                                metavar="A", c_route="struct", exports=_RWKV7_ONLY)
    vocab_size: int = declare(REQUIRED, "vocabulary size", kind="pos_int", cli=False,
                              c_route="struct")
    Dw: int = declare(REQUIRED, "decay " + _LORA_HELP, kind="pos_int", flag="--d-decay",
                      metavar="D", c_route="struct")
    Da: int = declare(REQUIRED, "in-context learning rate " + _LORA_HELP, kind="pos_int",
                      flag="--d-aaa", metavar="D", c_route="struct")
    Dg: int = declare(REQUIRED, "output gate " + _LORA_HELP, kind="pos_int", flag="--d-gate",
                      metavar="D", c_route="struct")
    Dv: int = declare(REQUIRED, "value-residual " + _LORA_HELP, kind="pos_int", flag="--d-mv",
                      metavar="D", c_route="struct")
    ffn_dim: int = declare(REQUIRED, "channel-mix hidden size", kind="pos_int",
                           flag="--ffn-dim", metavar="F", c_route="struct")
    chunk_size: int = declare(REQUIRED, "MoBA chunk size", kind="pos_int", flag="--chunk-size",
                              metavar="K", c_route="struct")
    moba_top_k: int = declare(REQUIRED, "MoBA chunks each query selects (0: all, dense causal "
                              "attention)", kind="nonneg_int", flag="--moba-top-k", metavar="K",
                              c_route="struct")
    ln0: int = declare(_core.OPTION_FIELDS["ln0"], "the embedding LayerNorm of official "
                       "RWKV-7 (1), or none (0: checkpoints written before it)", kind="bit",
                       cli=False, absent=DEFAULT, c_route="ctx", exports=_NEEDS_LN0)
    ln_eps: float = declare(_core.OPTION_FIELDS["ln_eps"], "the eps of every LayerNorm (ln0, "
                            "ln1, ln2, ln_out)", kind="pos_float", cli=False, absent=DEFAULT,
                            c_route="ctx", exports=("rwkv7", "rwkvx", "hf"))
    gn_eps: float = declare(_core.OPTION_FIELDS["gn_eps"], "the eps of the time-mix group norm "
                            "(ln_x)", kind="pos_float", cli=False, absent=DEFAULT,
                            c_route="ctx", exports=("rwkv7", "rwkvx", "hf", "gguf"))

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
        missing = [e.key for e in entries(cls) if e.required and e.key not in config]
        if missing:
            raise ConfigError(f"the model config lacks {', '.join(missing)}")
        return cls(**dict(config))

    @classmethod
    def default(cls, key: str) -> Any:
        """The declared default of optional field `key` (ln0, ln_eps, gn_eps)."""
        return next(e.default for e in entries(cls) if e.key == key)

    @classmethod
    def resolve(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """A saved config dict with every optional key it lacks set to what
        its absence means (ln0 0), so two configs compare by value."""
        return resolve(cls, config)

    @classmethod
    def stored(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """What a checkpoint stores of a config: no optional key whose value
        is what its absence means, so an older version reads it."""
        return stored(cls, config)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """The model of preset `name` (rwkvx_c.model.presets)."""
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls.from_dict(PRESETS[name]["model"])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def n_blocks(self) -> int:
        return self.n_rwkv_layer + self.n_attn_layer

    def with_shape(self, **options: Any) -> ModelConfig:
        """This config with the SHAPE_OPTIONS given (None: keep). A new width
        or head size sets n_head; a new width also sets ffn_dim and the LoRA
        sizes for it unless they are given. ConfigError on a bad value."""
        known = {o.name: o for o in SHAPE_OPTIONS}
        for name, v in options.items():
            if name not in known:
                raise ConfigError(f"unknown model-shape option {name!r}")
            kind = KINDS[known[name].kind]
            if v is not None and not kind.ok(v):
                raise ConfigError(f"{name} must be {kind.what}, got {v!r}")
        given = {known[k].field: v for k, v in options.items() if v is not None}
        C = given.get("n_embd", self.n_embd)
        N = given.get("head_size", self.head_size)
        if C % N:
            raise ConfigError(f"n_embd {C} is not a multiple of head_size {N}")
        new: dict[str, Any] = {}
        if "n_embd" in given or "head_size" in given:
            new.update(n_embd=C, head_size=N, n_head=C // N)
        if "n_embd" in given:
            new.update(ffn_dim=FFN_MULT * C, **lora_sizes(C))
        new.update(given)
        return replace(self, **new)


SHAPE_OPTIONS = tuple(ShapeOption(e.flag[2:].replace("-", "_"), e.key, e.kind, e.metavar or "",
                                  e.help) for e in entries(ModelConfig) if e.flag)


def export_refusal(config: Mapping[str, Any], fmt: str, holder: str) -> str | None:
    """Why format `fmt` (a key of the fields' exports: rwkv7, rwkvx, gguf,
    hf), named `holder` in the message, cannot hold a model of `config`: the
    first field whose value is not the one the format holds, with the train
    flag that makes a model it holds; or None."""
    c = ModelConfig.resolve(config)
    for e in entries(ModelConfig):
        if fmt in e.exports and c.get(e.key) != e.exports[fmt]:
            what = e.help.split(" (")[0]
            way = f" (train with {e.flag} {e.exports[fmt]} for {fmt})" if e.flag else ""
            return (f"{holder} needs {e.key} = {e.exports[fmt]} ({what}); this model has "
                    f"{e.key} = {c.get(e.key)}{way}")
    return None
