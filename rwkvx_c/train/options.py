"""TrainOptions: everything that defines a run, its checks, how it resolves
against a preset, and which options a resumed run may change.

Each field carries what the command line needs to offer it (``flag``,
``help``, ``metavar``, the kind of value), so ``rwkvx-c train``'s flags are
derived from this one list; a field with ``cli=False`` is Python-only.
None means "the preset's value" for the preset-driven fields.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from rwkvx_c import _core
from rwkvx_c.data.tokenizers import check_identity
from rwkvx_c.data.tokenizers import load as load_tokenizer
from rwkvx_c.errors import ConfigError, TokenizerError, TrainError
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.model.init import SCHEMES
from rwkvx_c.model.presets import PRESETS
from rwkvx_c.train.guard import ON_DIVERGENCE
from rwkvx_c.train.schedule import SCHEDULES

__all__ = ["TrainOptions", "auto_precision", "PRECISIONS", "BASE_DTYPES", "TUNE_MODES",
            "DEFAULT_STEPS",
           "saved_options", "apply_changes", "model_vocab"]

PRECISIONS = ("fp32", "bf16", "auto")
BASE_DTYPES = ("auto", "fp32", "bf16", "q8_0")   # --base-dtype (docs/finetune.md §The frozen base)
TUNE_MODES = ("full", "state", "lora")   # what trains (rwkvx_c.train.finetune)
DEFAULT_STEPS = 1000      # a preset with neither steps nor a time budget
MAX_TOKENS_PER_STEP = 2 ** 31 - 1   # B * T indexes int32 arrays in the C API


def auto_precision() -> str:
    """What precision "auto" means on this CPU: bf16 where the bf16 GEMM runs
    on AMX tiles, fp32 elsewhere. On a Sapphire Rapids the AMX kernel makes a
    training step 2-2.7x faster at 1 thread, while the AVX512-BF16 kernel
    runs at 0.6-0.7x of the fp32 AVX-512 GEMM, so bf16 there would only lose
    precision and time (docs/performance.md)."""
    return "bf16" if _core.gemm_kernel("bf16") == "amx-bf16" else "fp32"


def _opt(default: Any, help: str, *, kind: str = "str", flag: str | None = None,
         metavar: str | None = None, choices: tuple[str, ...] | None = None,
         cli: bool = True) -> Any:
    """A TrainOptions field with its command-line description. kind:
    "pos_int", "nonneg_int", "pos_float", "nonneg_float", "unit_float",
    "str", "paths", "flag" (a switch, off by default)."""
    return field(default=default, metadata=dict(help=help, kind=kind, flag=flag,
                                                metavar=metavar, choices=choices, cli=cli))


def _preset_values(key: str) -> str:
    """"tiny 8, S 8, M 8" for a preset-driven option's help."""
    return ", ".join(f"{n} {p[key]:g}" for n, p in PRESETS.items() if n != "default")


@dataclass
class TrainOptions:
    """Everything that defines a run; None means "the preset's value".

    steps / time_budget: stop after this many optimiser steps / this many
    minutes of wall-clock for the whole run, final evaluation and checkpoint
    included (whichever comes first). With steps the learning-rate schedule
    runs over steps; with only a time budget it runs over elapsed time.
    """
    preset: str = _opt("default", "model size and training defaults; default: the tiny "
                       "model for 9.5 minutes", choices=tuple(PRESETS))
    data: str | list[str] | None = _opt(
        None, "text file, folder, .jsonl / .jsonl.gz, RWKV-LM binidx (.bin + .idx) or .bin "
        "token file; several paths are read in order (default: the Python standard "
        "library's .py files)", kind="paths", metavar="PATH")
    tokenizer: str = _opt("byte", "byte, world (the RWKV World vocabulary; needs "
                          "rwkvx_c[world]) or a tokenizer.json (needs rwkvx_c[hf]); a resumed "
                          "run keeps its own", metavar="byte|world|PATH")
    text_field: str = _opt("text", "the text field of .jsonl records", metavar="NAME")
    steps: int | None = _opt(None, "stop after N steps (learning-rate schedule by steps; "
                             f"default: {DEFAULT_STEPS} unless the preset has a time budget)",
                             kind="pos_int", metavar="N")
    time_budget: float | None = _opt(None, "stop so that the whole run, final evaluation and "
                                     "checkpoint included, takes at most MIN minutes "
                                     "(default: the default preset's 9.5)",
                                     kind="pos_float", metavar="MIN")
    batch: int | None = _opt(None, "sequences per step (default: the preset's: "
                             f"{_preset_values('batch')})", kind="pos_int", metavar="B")
    seq_len: int | None = _opt(None, "tokens per sequence (default: the preset's: "
                               f"{_preset_values('seq_len')})", kind="pos_int", metavar="T")
    lr: float | None = _opt(None, "peak learning rate (default: the preset's: "
                            f"{_preset_values('lr')})", kind="pos_float", metavar="X")
    warmup_steps: int | None = _opt(None, "linear warmup steps (default: the preset's: "
                                    f"{_preset_values('warmup_steps')})", kind="nonneg_int",
                                    flag="--warmup", metavar="N")
    min_lr_frac: float = _opt(0.1, "the schedule ends at this fraction of the peak learning "
                              "rate", kind="unit_float", metavar="F")
    schedule: str = _opt("cosine", "the learning rate after the warmup: cosine down to "
                         "min_lr_frac, or wsd (warmup-stable-decay): constant, then linear "
                         "down over the last fifth; a resumed run given more --steps keeps wsd's "
                         "constant rate, while a cosine jumps (docs/training.md)",
                         choices=SCHEDULES)
    weight_decay: float = _opt(0.1, "AdamW weight decay on matrices", kind="nonneg_float",
                               metavar="X")
    grad_clip: float = _opt(1.0, "clip the global grad norm to X, 0 disables",
                            kind="nonneg_float", metavar="X")
    beta1: float = _opt(0.9, "AdamW beta1", cli=False)
    beta2: float = _opt(0.99, "AdamW beta2", cli=False)
    adam_eps: float = _opt(1e-8, "AdamW epsilon", cli=False)
    threads: int | None = _opt(None, "OpenMP threads (default: OMP_NUM_THREADS or every "
                               "core; under MPI each rank's share of its cores)",
                               kind="pos_int", metavar="N")
    seed: int = _opt(0, "seed of the init and the data order", kind="nonneg_int", metavar="S")
    eval_every: int | None = _opt(None, "evaluate every K steps (default: 10 evaluations over "
                                  "the run)", kind="pos_int", metavar="K")
    eval_tokens: int = _opt(32768, "validation tokens per evaluation", kind="pos_int",
                            metavar="N")
    save_every: int | None = _opt(None, "checkpoint every K steps (default: at every "
                                  "evaluation) and always at the end", kind="pos_int",
                                  metavar="K")
    init: str = _opt("rwkv7", "parameter init", choices=SCHEMES)
    vocab_size: int | None = _opt(None, "the model's vocabulary: at least the data's ids; "
                                  "larger pads it (default: the tokenizer's, or a token "
                                  "corpus's: its sidecar's vocab_size, else its largest id + 1; "
                                  "a resumed run keeps its own)", kind="pos_int", metavar="V")
    model: dict[str, int] | None = _opt(None, "overrides of the preset's model config",
                                        cli=False)
    cache_dir: str | None = _opt(None, "where corpora are cached as token files (default: "
                                 "$RWKVX_CACHE or ~/.cache/rwkvx_c)", metavar="DIR")
    precision: str = _opt("auto", "projection GEMMs in fp32, or bf16 with fp32 accumulation; "
                          "auto: bf16 where the CPU has AMX-BF16, where it is faster. A "
                          "resumed run keeps its precision", choices=PRECISIONS)
    grad_cp: bool = _opt(False, "activation recompute (RWKV-LM's --grad_cp): keep only each "
                         "block's input and recompute the block in its backward; the same "
                         "losses bit for bit, about one block's activations instead of all",
                         kind="flag")
    l2wrap: float = _opt(0.0, "RWKV-LM's L2Wrap: push each position's largest logit towards 0 "
                         "with a grad of X * max_logit / (B*T); RWKV-LM uses 1e-4, 0 disables",
                         kind="nonneg_float", metavar="X")
    on_divergence: str = _opt("stop", "when the loss blows up: stop, or reload the last "
                              "checkpoint and halve the learning rate (at most 3 times)",
                              choices=ON_DIVERGENCE)

    init_from: str | None = _opt(None, "start from these weights: a run folder, a "
                                 "checkpoint or an x070 / RWKV-X .pth (a new run at step 0; "
                                 "shape and tokenizer from SRC)", metavar="SRC")
    tune: str = _opt("full", "what trains: every parameter, (state) one initial WKV "
                     "state per RWKV block, or (lora) LoRA adapters on the projections, "
                     "the rest frozen", choices=TUNE_MODES)
    train_parts: str | None = _opt(None, "with --tune state or lora, these groups train too; with "
                                   "--tune full, only these train (attn: RWKV-X's "
                                   "--only_train_moba): a comma list of ln, time (lerp, decay, "
                                   "gate vectors and their LoRAs), emb, head, attn",
                                   metavar="G,G")
    freeze: str | None = _opt(None, "with --tune full, hold these groups fixed (as "
                              "--train-parts)", metavar="G,G")
    unfreeze_at: int | None = _opt(None, "the base-unfreeze: from step STEP on everything "
                                   "trains (a state tune's states too; a LoRA tune's "
                                   "adapters are merged into the base there); the parameters "
                                   "that were frozen start with zero AdamW moments",
                                   kind="pos_int", metavar="STEP")
    lora_r: int = _opt(32, "with --tune lora, the adapters' rank r", kind="pos_int",
                       metavar="R")
    lora_alpha: float = _opt(32.0, "with --tune lora, the adapters' alpha: W + (alpha/r) B A",
                             kind="pos_float", metavar="X")
    lora_targets: str | None = _opt(None, "with --tune lora, the projections that get "
                                    "adapters, a comma list of att.receptance, att.key, "
                                    "att.value, att.output, ffn.key, ffn.value (RWKV blocks), "
                                    "attn.q, attn.k, attn.v, attn.o, attn.ffn.key, "
                                    "attn.ffn.value (attention blocks) (default: all but the "
                                    "attn.ffn ones)", metavar="T,T")
    base_dtype: str = _opt("auto", "how the frozen matrices of a state or LoRA tune (or of "
                           "--freeze / --train-parts) are held: fp32, bf16 (half the memory; "
                           "exact for a bf16 source) or q8_0 (GGUF's 8-bit blocks, about a "
                           "quarter); auto: bf16 when the --init-from source is bf16, else "
                           "fp32", choices=BASE_DTYPES)

    # options a resumed run may change without changing what it computes
    RESUMABLE = ("steps", "time_budget", "eval_every", "save_every", "threads", "cache_dir",
                 "on_divergence", "grad_cp")

    def resolved(self) -> ResolvedOptions:
        """A copy with every preset default filled in and every value checked."""
        if self.preset not in PRESETS:
            raise TrainError(f"unknown preset {self.preset!r}; choose one of "
                             f"{', '.join(PRESETS)}")
        p = PRESETS[self.preset]
        o = TrainOptions(**{f.name: getattr(self, f.name) for f in fields(self)})
        for k in ("batch", "seq_len", "lr", "warmup_steps"):
            if getattr(o, k) is None:
                setattr(o, k, p[k])
        if o.steps is None and o.time_budget is None:
            o.time_budget = p.get("time_budget")
            if o.time_budget is None:
                o.steps = DEFAULT_STEPS
        if o.model is not None and not isinstance(o.model, dict):
            raise TrainError(f"model must be a dict of config overrides, got {o.model!r}")
        try:
            o.model = ModelConfig.from_dict({**p["model"], **(o.model or {})}).to_dict()
        except ConfigError as e:
            raise TrainError(str(e)) from None
        if o.precision == "auto":
            o.precision = auto_precision()
        o._check()
        return cast("ResolvedOptions", o)

    def _check(self) -> None:
        def pos(name: str, v: Any, integer: bool = True, allow_zero: bool = False) -> None:
            ok = isinstance(v, (int, np.integer)) and not isinstance(v, bool) if integer \
                else isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v)
            if not ok or v < 0 or (v == 0 and not allow_zero):
                kind = "an integer" if integer else "a number"
                raise TrainError(f"{name} must be {kind} {'>= 0' if allow_zero else '> 0'}, "
                                 f"got {v!r}")
        if self.steps is not None:
            pos("steps", self.steps)
        if self.time_budget is not None:
            pos("time_budget", self.time_budget, integer=False)
        pos("batch", self.batch)
        pos("seq_len", self.seq_len)
        pos("lr", self.lr, integer=False)
        pos("warmup_steps", self.warmup_steps, allow_zero=True)
        pos("eval_tokens", self.eval_tokens)
        pos("weight_decay", self.weight_decay, integer=False, allow_zero=True)
        pos("grad_clip", self.grad_clip, integer=False, allow_zero=True)
        pos("adam_eps", self.adam_eps, integer=False, allow_zero=True)
        pos("l2wrap", self.l2wrap, integer=False, allow_zero=True)
        pos("lora_r", self.lora_r)
        pos("lora_alpha", self.lora_alpha, integer=False)
        for k in ("train_parts", "freeze", "lora_targets"):
            if getattr(self, k) is not None and not isinstance(getattr(self, k), str):
                raise TrainError(f"{k} must be a comma list of names, got {getattr(self, k)!r}")
        if not isinstance(self.grad_cp, (bool, np.bool_)):
            raise TrainError(f"grad_cp must be true or false, got {self.grad_cp!r}")

        def real(v: object) -> bool:
            return isinstance(v, (int, float, np.floating)) and not isinstance(v, bool)
        if not (real(self.min_lr_frac) and 0.0 <= self.min_lr_frac <= 1.0):
            raise TrainError(f"min_lr_frac must lie in [0, 1], got {self.min_lr_frac!r}")
        for b in ("beta1", "beta2"):
            if not (real(getattr(self, b)) and 0.0 <= getattr(self, b) < 1.0):
                raise TrainError(f"{b} must lie in [0, 1), got {getattr(self, b)!r}")
        for k in ("eval_every", "save_every", "threads", "vocab_size", "unfreeze_at"):
            if getattr(self, k) is not None:
                pos(k, getattr(self, k))
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 64:   # the C seed's range
            raise TrainError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.base_dtype not in BASE_DTYPES:
            raise TrainError(f"base_dtype must be one of {', '.join(BASE_DTYPES)}, got "
                             f"{self.base_dtype!r}")
        if self.precision not in PRECISIONS[:2]:
            raise TrainError(f"precision must be {', '.join(PRECISIONS)}, got "
                             f"{self.precision!r}")
        paths = self.data if isinstance(self.data, (list, tuple)) else [self.data]
        for k, v in [("data", p) for p in paths] + [("cache_dir", self.cache_dir)]:
            if v is not None and not isinstance(v, str):
                raise TrainError(f"{k} must be a path, got {v!r}")
        if self.on_divergence is None:
            self.on_divergence = "stop"
        if self.on_divergence not in ON_DIVERGENCE:
            raise TrainError(f"unknown on_divergence {self.on_divergence!r}; choose one of "
                             f"{', '.join(ON_DIVERGENCE)}")
        if self.threads is not None and self.threads > _core.MAX_THREADS:
            raise TrainError(f"threads must be at most {_core.MAX_THREADS}, got {self.threads}")
        if self.schedule not in SCHEDULES:
            raise TrainError(f"unknown schedule {self.schedule!r}; choose one of "
                             f"{', '.join(SCHEDULES)}")
        if self.tune not in TUNE_MODES:
            raise TrainError(f"unknown tune {self.tune!r}; choose one of {', '.join(TUNE_MODES)}")
        if self.train_parts and self.freeze:
            raise TrainError("give --train-parts (what trains) or --freeze (what does not), "
                             "not both")
        if self.freeze and self.tune != "full":
            raise TrainError(f"--freeze holds groups of --tune full fixed; --tune {self.tune} "
                             "freezes the whole base already")
        if self.unfreeze_at is not None and self.tune == "full" and not self.freeze \
                and not self.train_parts:
            raise TrainError("--unfreeze-at unfreezes a frozen base: give it with --tune state, "
                             "--freeze or --train-parts (in a plain full run everything trains)")
        if self.tune != "lora" and self.lora_targets:
            raise TrainError("--lora-targets names the adapters of --tune lora")
        if self.init not in SCHEMES:
            raise TrainError(f"unknown init {self.init!r}; choose one of {', '.join(SCHEMES)}")
        assert self.batch is not None and self.seq_len is not None   # pos() checked them
        if self.batch * self.seq_len > MAX_TOKENS_PER_STEP:
            raise TrainError(f"batch * seq_len exceeds {MAX_TOKENS_PER_STEP}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


if TYPE_CHECKING:
    from rwkvx_c.data.pipeline import Corpus
    from rwkvx_c.data.tokenizers import Tokenizer

    class ResolvedOptions(TrainOptions):
        """The type of TrainOptions.resolved(): the preset's values filled in."""
        batch: int
        seq_len: int
        lr: float
        warmup_steps: int
        model: dict[str, int]


def saved_options(saved: object, path: str) -> TrainOptions:
    """The TrainOptions a checkpoint's state holds (TrainError if it holds none or bad ones)."""
    if not isinstance(saved, dict):
        raise TrainError(f"checkpoint {path} holds no training state")
    # options added since the checkpoint was written take their defaults; a
    # run saved before "auto" existed stored a resolved precision anyway
    opts = TrainOptions(**{f.name: saved.get(f.name, f.default) for f in fields(TrainOptions)})
    try:
        opts.resolved()
    except TrainError as e:
        raise TrainError(f"checkpoint {path} holds bad options: {e}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise TrainError(f"checkpoint {path} holds bad options ({e})") from None
    # runs saved before the ln0 key existed had none: ln0 = 0, not the preset's
    opts.model = {"ln0": 0, **(opts.model or {})}
    return opts


def apply_changes(opts: TrainOptions, changes: dict[str, Any], tokenizer: dict | None,
                  out_dir: str) -> None:
    """Sets the RESUMABLE options of `changes` on a resumed run's opts; any
    other option that differs from the saved run is a TrainError, as is a
    tokenizer with another vocabulary than the run's (`tokenizer`, its identity)."""
    if changes.get("precision") == "auto":   # "auto" keeps the saved precision
        changes = dict(changes, precision=None)
    names = {f.name for f in fields(TrainOptions)}
    diff = []
    for k, v in changes.items():
        if k not in names:
            raise TrainError(f"unknown option {k!r}")
        if v is None:
            continue
        if k in TrainOptions.RESUMABLE:
            setattr(opts, k, v)
        elif k == "tokenizer":  # judged by the vocabulary's hash, not the spelling
            try:
                check_identity(load_tokenizer(v), tokenizer, f"the run in {out_dir}")
            except TokenizerError as e:
                raise TrainError(f"cannot resume: {e}") from None
        elif k == "model":
            model = opts.model or {}
            for mk, mv in v.items():
                if model.get(mk) != mv:
                    diff.append(f"model.{mk} {model.get(mk)!r} -> {mv!r}")
        elif getattr(opts, k) != v:
            diff.append(f"{k} {getattr(opts, k)!r} -> {v!r}")
    if diff:
        raise TrainError("cannot resume with a different configuration: " + "; ".join(diff))


def _finite(v: float) -> bool:
    """math.isfinite, False (not OverflowError) for an int beyond float range."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def model_vocab(opts: TrainOptions, tokenizer: Tokenizer, corpus: Corpus,
                fixed: bool = False) -> int:
    """The vocabulary the model gets: opts.vocab_size (--vocab-size) when
    given, else the tokenizer's (unless it is bytes), else the larger of the
    config's (a preset's, or a resumed run's) and the corpus's ids (a token
    file's sidecar vocab_size, or its largest id + 1). fixed: the weights
    come with the config (imported, --init-from), whose size then stands.
    TrainError when the size cannot hold the corpus's or the tokenizer's ids."""
    assert opts.model is not None   # resolved() filled it
    tok = None if tokenizer.name == "byte" else tokenizer.vocab_size
    need = max(corpus.vocab_size, tok or 0)
    if fixed:
        have = opts.model["vocab_size"]
        if opts.vocab_size is not None and opts.vocab_size != have:
            raise TrainError(f"--vocab-size {opts.vocab_size} differs from the weights' "
                             f"vocabulary of {have}; leave it out")
        if need > have:
            raise TrainError(f"the corpus has {need} token ids but the model's vocab_size is "
                             f"{have}")
        return have
    if opts.vocab_size is None:
        return tok if tok is not None else max(opts.model["vocab_size"], corpus.vocab_size)
    if opts.vocab_size < need:
        raise TrainError(f"--vocab-size {opts.vocab_size} cannot hold the data's token ids "
                         f"(0..{need - 1}); give at least {need}, or leave it out")
    return opts.vocab_size
