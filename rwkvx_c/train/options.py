"""TrainOptions: everything that defines a run, its checks, how it resolves
against a preset, and which options a resumed run may change.

Each field is one declaration (``_opt``, rwkvx_c.util.registry.declare):
its default, help, kind of value, flag, what its absence in an older
checkpoint means and any further check. ``rwkvx-c train``'s flags, each
value's check, the config-file schema (``schema``), resume's comparison
(``saved_options``) and what a checkpoint stores (``TrainOptions.stored``)
are derived from them; a field with ``cli=False`` is Python-only. None
means "the preset's value" for the preset-driven fields.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, cast

from rwkvx_c import _core
from rwkvx_c.data.templates import DEFAULT_TEMPLATE, TEMPLATE_CHOICES
from rwkvx_c.data.tokenizers import check_identity
from rwkvx_c.data.tokenizers import load as load_tokenizer
from rwkvx_c.errors import ConfigError, TokenizerError, TrainError
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.model.init import SCHEMES
from rwkvx_c.model.lora import ADAPTER_KINDS, ADAPTERS
from rwkvx_c.model.parts import STATES
from rwkvx_c.model.presets import PRESETS
from rwkvx_c.train.grpo_loss import LOSS_TYPES, SCALE_REWARDS
from rwkvx_c.train.guard import ON_DIVERGENCE
from rwkvx_c.train.objectives import OBJECTIVES
from rwkvx_c.train.schedule import SCHEDULES
from rwkvx_c.train.trackers import parse_trackers
from rwkvx_c.util.registry import DEFAULT, Entry, entries, resolve, stored
from rwkvx_c.util.registry import declare as _opt

__all__ = ["TrainOptions", "auto_precision", "PRECISIONS", "BASE_DTYPES", "TUNE_MODES",
           "DEFAULT_STEPS", "saved_options", "apply_changes", "flag_of",
           "new_run_hint", "schema"]

PRECISIONS = ("fp32", "bf16", "auto")
# --base-dtype (docs/finetune.md §The frozen base): the C table's dtypes
BASE_DTYPES = ("auto", "fp32", *_core.BASE_DTYPES)
TUNE_MODES = ("full", "state", "lora")   # what trains (rwkvx_c.train.finetune)
DEFAULT_STEPS = 1000      # a preset with neither steps nor a time budget
# a state tune's defaults, RWKV-PEFT's (its demo-state-tuning.sh: --lr_init 1
# --lr_final 1e-2): the states are few and move slowly at a full tune's rates
STATE_LR = 1.0
STATE_MIN_LR_FRAC = 0.01
MIN_LR_FRAC = 0.1
DEFAULT_VAL_FRACTION = 0.02
MAX_TOKENS_PER_STEP = 2 ** 31 - 1   # B * T indexes int32 arrays in the C API


def auto_precision() -> str:
    """What precision "auto" means on this CPU: bf16 where a bf16 step is
    faster than an fp32 one, fp32 elsewhere (rwkvx_c._core.bf16_pays). On a
    Sapphire Rapids the AMX kernel makes a step 2-2.7x faster at 1 thread
    while its AVX512-BF16 kernel (vdpbf16ps at half the FMA rate) runs at
    0.6-0.7x of the fp32 GEMM; on Zen 4 and 5 vdpbf16ps issues at the FMA rate,
    twice its flops (the table in docs/performance.md §bf16 mixed precision)."""
    return "bf16" if _core.bf16_pays() else "fp32"


# A TrainOptions field: one declare() call (rwkvx_c.util.registry) with its
# default, help and kind (a KINDS key: "pos_int", "nonneg_int", "pos_float",
# "nonneg_float", "unit_float", "unit_open", "str", "names", "path", "paths",
# "flag" (a switch, off by default), "config"), and as needed flag=, metavar=,
# choices=, cli=False, absent= (what its absence in an older checkpoint
# means), check= (a further check of a value); _opt is declare.


def _max_threads(v: int) -> str | None:
    return f"threads must be at most {_core.MAX_THREADS}, got {v}" \
        if v > _core.MAX_THREADS else None


def _seed_range(v: int) -> str | None:   # the C seed's range
    return f"seed must be an integer in [0, 2**64), got {v!r}" if v >= 2 ** 64 else None


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
        None, "text file, folder, .jsonl / .jsonl.gz, .parquet / .arrow, datasets.save_to_disk "
        "folder, hf:NAME (a dataset of the local Hugging Face cache), RWKV-LM binidx (.bin + "
        ".idx) or .bin token file; several paths are read in order (default: the Python "
        "standard library's .py files)", kind="paths", metavar="PATH")
    val_data: str | list[str] | None = _opt(
        None, "validate on this corpus (any form --data takes) instead of a split of --data",
        kind="paths", metavar="PATH", absent=DEFAULT)
    val_fraction: float = _opt(DEFAULT_VAL_FRACTION, "the validation split of --data: its last "
                               "F of tokens when it is one file or a token file (a folder or "
                               "several files hold out whole files)", kind="unit_float",
                               metavar="F", absent=DEFAULT)
    chat_template: str = _opt(DEFAULT_TEMPLATE, "how chat records are rendered: rwkv (RWKV's "
                              "User: / Assistant: turns), chatml, tokenizer (the chat_template "
                              "of the tokenizer_config.json beside a --tokenizer tokenizer.json) "
                              "or a Jinja file, tokenizer_config.json or folder holding one; "
                              "sample, chat, serve and the HF export use the run's",
                              metavar=TEMPLATE_CHOICES, absent=DEFAULT)
    train_on_inputs: bool = _opt(False, "with chat data, train on every token of a "
                                 "conversation, its prompts too, not only the assistant's "
                                 "replies", kind="flag", absent=DEFAULT)
    tokenizer: str = _opt("byte", "byte, world (the RWKV World vocabulary; needs "
                          "rwkvx_c[world]) or a tokenizer.json (needs rwkvx_c[hf]); a resumed "
                          "run keeps its own", metavar="byte|world|PATH")
    text_field: str = _opt("text", "the text field of .jsonl records, the text column of "
                           "tables", metavar="NAME")
    steps: int | None = _opt(None, "stop after N steps (learning-rate schedule by steps; "
                             f"default: {DEFAULT_STEPS} unless the preset has a time budget)",
                             kind="pos_int", metavar="N")
    epochs: float | None = _opt(None, "stop after N passes over the training split (a "
                                "fraction too): the steps they take, batch x grad_accum x "
                                "seq_len tokens (a preference run's batch / 2 pairs) a step; "
                                "not with --steps", kind="pos_float", metavar="N",
                                absent=DEFAULT)
    time_budget: float | None = _opt(None, "stop so that the whole run, final evaluation and "
                                     "checkpoint included, takes at most MIN minutes "
                                     "(default: the default preset's 9.5)",
                                     kind="pos_float", metavar="MIN")
    batch: int | None = _opt(None, "sequences per step (default: the preset's: "
                             f"{_preset_values('batch')})", kind="pos_int", metavar="B")
    grad_accum: int = _opt(1, "gradient accumulation: each optimiser step sums the grads of N "
                           "micro-batches of --batch sequences (an effective batch of N x B; "
                           "RWKV-LM's --accumulate_grad_batches)", kind="pos_int", metavar="N",
                           absent=DEFAULT)
    seq_len: int | None = _opt(None, "tokens per sequence (default: the preset's: "
                               f"{_preset_values('seq_len')})", kind="pos_int", metavar="T")
    lr: float | None = _opt(None, f"peak learning rate (default: {STATE_LR:g} with --tune state, "
                            "RWKV-PEFT's; else the preset's: "
                            f"{_preset_values('lr')})", kind="pos_float", metavar="X")
    warmup_steps: int | None = _opt(None, "linear warmup steps (default: the preset's: "
                                    f"{_preset_values('warmup_steps')})", kind="nonneg_int",
                                    aliases=("--warmup",), metavar="N")
    min_lr_frac: float | None = _opt(None, "the schedule ends at this fraction of the peak "
                                     f"learning rate (default: {STATE_MIN_LR_FRAC:g} with --tune "
                                     f"state, RWKV-PEFT's; else {MIN_LR_FRAC:g})",
                                     kind="unit_float", metavar="F")
    schedule: str = _opt("cosine", "the learning rate after the warmup: cosine down to "
                         "min_lr_frac, or wsd (warmup-stable-decay): constant, then linear "
                         "down over the last fifth; a resumed run given more --steps keeps wsd's "
                         "constant rate, while a cosine jumps (docs/training.md)",
                         choices=SCHEDULES)
    weight_decay: float = _opt(0.1, "AdamW weight decay on matrices", kind="nonneg_float",
                               metavar="X")
    grad_clip: float = _opt(1.0, "clip the global grad norm to X, 0 disables",
                            kind="nonneg_float", metavar="X")
    beta1: float = _opt(0.9, "AdamW beta1", kind="unit_open", cli=False)
    beta2: float = _opt(0.99, "AdamW beta2", kind="unit_open", cli=False)
    adam_eps: float = _opt(1e-8, "AdamW epsilon", kind="nonneg_float", cli=False)
    threads: int | None = _opt(None, "OpenMP threads (default: OMP_NUM_THREADS or every "
                               "core; under MPI each rank's share of its cores)",
                               kind="pos_int", metavar="N", check=_max_threads)
    seed: int = _opt(0, "seed of the init and the data order", kind="nonneg_int", metavar="S",
                    check=_seed_range)
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
    model: dict[str, Any] | None = _opt(None, "overrides of the preset's model config",
                                        kind="config", cli=False)
    cache_dir: str | None = _opt(None, "where corpora are cached as token files (default: "
                                 "$RWKVX_CACHE or ~/.cache/rwkvx_c)", kind="path",
                                 metavar="DIR")
    precision: str = _opt("auto", "projection GEMMs in fp32, or bf16 with fp32 accumulation; "
                          "auto: bf16 where a bf16 step is faster (AMX, or a full-rate "
                          "AVX512-BF16 dot product as on Zen 4 and 5). A resumed run keeps its "
                          "precision", choices=PRECISIONS)
    grad_cp: bool | None = _opt(None, "activation recompute (RWKV-LM's --grad_cp): keep only "
                                "each block's input and recompute it in its backward (the same "
                                "losses bit for bit, about one block's activations); unset: on "
                                "only where it alone lets a step fit", kind="flag")
    row_group: int | None = _opt(None, "with --grad-cp, run each block N sequences at a time (a "
                                 "LoRA tune's bits kept); 0: the whole batch; unset: automatic",
                                 kind="nonneg_int", metavar="N")
    l2wrap: float = _opt(0.0, "RWKV-LM's L2Wrap: push each position's largest logit towards 0 "
                         "with a grad of X * max_logit / (B*T); RWKV-LM uses 1e-4, 0 disables",
                         kind="nonneg_float", metavar="X")
    sample_every: int | None = _opt(None, "every K steps, and before the first, generate "
                                    "from each --sample-prompt (greedy, "
                                    "rwkvx_c.generation.generate) into the log and the "
                                    "trackers", kind="pos_int", metavar="K", absent=DEFAULT)
    sample_prompt: list[str] | None = _opt(None, "a prompt of --sample-every (repeatable)",
                                           kind="texts", metavar="TEXT", absent=DEFAULT)
    keep_best: bool = _opt(False, "also keep best.safetensors, the checkpoint of the lowest "
                           "validation loss (export, sample and eval take it as a checkpoint)",
                           kind="flag", absent=DEFAULT)
    keep_last: int | None = _opt(None, "also keep the K newest checkpoints as step snapshots "
                                 "(checkpoint-STEP.safetensors)", kind="pos_int", metavar="K",
                                 absent=DEFAULT)
    early_stop: int | None = _opt(None, "stop after K evaluations without a lower validation "
                                  "loss", kind="pos_int", metavar="K", absent=DEFAULT)
    log_to: str | None = _opt(None, "also send every log row and evaluation, the options and "
                              "the loss plot to these trackers, a comma list of tensorboard, "
                              "wandb, mlflow (each needs its extra: rwkvx_c[tensorboard], ...); "
                              "WANDB_MODE=offline and MLFLOW_TRACKING_URI are honoured",
                              metavar="T,T", absent=DEFAULT)
    on_divergence: str = _opt("stop", "when the loss blows up: stop, or reload the last "
                              "checkpoint and halve the learning rate (at most 3 times)",
                              choices=ON_DIVERGENCE)

    init_from: str | None = _opt(None, "start from these weights: a run folder, a "
                                 "checkpoint or an x070 / RWKV-X .pth (a new run at step 0; "
                                 "shape and tokenizer from SRC)", kind="path",
                                 metavar="SRC")
    tune: str = _opt("full", "what trains: every parameter, (state) one initial WKV "
                     "state per RWKV block, or (lora) LoRA adapters on the projections, "
                     "the rest frozen", choices=TUNE_MODES)
    train_parts: str | None = _opt(None, "with --tune state or lora, these groups train too; with "
                                   "--tune full, only these train (attn: RWKV-X's "
                                   "--only_train_moba): a comma list of ln, time (lerp, decay, "
                                   "gate vectors and their LoRAs), emb, head, attn, state "
                                   "(--tune lora: the initial WKV states)",
                                   kind="names", metavar="G,G")
    freeze: str | None = _opt(None, "with --tune full, hold these groups fixed (as "
                              "--train-parts)", kind="names", metavar="G,G")
    unfreeze_at: int | None = _opt(None, "the base-unfreeze: from step STEP on everything "
                                   "trains (a state tune's states too; a LoRA tune's "
                                   "adapters are merged into the base there); the parameters "
                                   "that were frozen start with zero AdamW moments",
                                   kind="pos_int", metavar="STEP")
    lisa_layers: int | None = _opt(None, "LISA (layer-wise sampled full tuning): with --tune "
                                   "full, only N blocks train at a time, drawn anew every "
                                   "--lisa-interval steps, beside the embedding, head and "
                                   "final norms", kind="pos_int", metavar="N", absent=DEFAULT)
    lisa_interval: int = _opt(20, "with --lisa-layers, the steps between draws",
                              kind="pos_int", metavar="K", absent=DEFAULT)
    lora_r: int = _opt(32, "with --tune lora, the adapters' rank r", kind="pos_int",
                       metavar="R")
    lora_alpha: float = _opt(32.0, "with --tune lora, the adapters' alpha: W + (alpha/r) B A",
                             kind="pos_float", metavar="X")
    adapter: str = _opt("lora", "with --tune lora, the adapters' kind: " + "; ".join(
        f"({k.name}) {k.says}" for k in ADAPTERS.values()), choices=ADAPTER_KINDS,
        metavar="KIND", absent=DEFAULT)
    lora_targets: str | None = _opt(None, "with --tune lora, the projections that get "
                                    "adapters, a comma list of att.receptance, att.key, "
                                    "att.value, att.output, ffn.key, ffn.value (RWKV blocks), "
                                    "attn.q, attn.k, attn.v, attn.o, attn.ffn.key, "
                                    "attn.ffn.value (attention blocks) (default: all but the "
                                    "attn.ffn ones)", kind="names", metavar="T,T")
    objective: str = _opt("lm", "what a step minimises: lm (language modelling, SFT on chat "
                          "data), or on preference pairs ({prompt, chosen, rejected} .jsonl; "
                          "--batch counts sequences, two per pair) dpo (DPO's sigmoid loss), "
                          "ipo, or simpo (reference-free, on the mean log-probability per "
                          "token), or grpo (rewards of sampled completions of prompt records; "
                          "--batch counts completions; docs/finetune.md)", choices=OBJECTIVES,
                          absent=DEFAULT)
    dpo_beta: float = _opt(0.1, "with a preference objective, beta: the scale of the "
                           "log-probability ratios (SimPO's papers use 2 to 10)",
                           kind="pos_float", metavar="X", absent=DEFAULT)
    ref_from: str | None = _opt(None, "with --objective dpo or ipo, the reference model: a "
                                "run folder or checkpoint whose log-probabilities of every "
                                "pair are computed once before the first step and kept in "
                                "the run folder (default: the model before its first step, "
                                "--init-from's weights; a LoRA tune's adapters off)",
                                metavar="SRC", absent=DEFAULT)
    dpo_label_smoothing: float = _opt(0.0, "with --objective dpo or simpo, the chance eps "
                                      "that a pair's labels are swapped (cDPO): the loss is "
                                      "(1-eps) -log sig(z) + eps -log sig(-z)",
                                      kind="unit_float", metavar="EPS", absent=DEFAULT)
    # --objective grpo (docs/finetune.md §GRPO): TRL GRPOConfig's names and defaults
    reward: str | list[str] | None = _opt(
        None, "with --objective grpo, the reward functions: module:function, file.py:function, "
        "or a built-in: exact, numeric (against the records' answer), format:REGEX, "
        "length:CACHE (DAPO's overlong penalty)", kind="paths", metavar="SPEC", absent=DEFAULT)
    reward_weights: str | None = _opt(None, "with --objective grpo, each --reward's weight in "
                                      "the summed reward (default: 1 each)", kind="names",
                                      metavar="W,W", absent=DEFAULT)
    num_generations: int = _opt(8, "with --objective grpo, the completions sampled per prompt "
                                "(a group)", kind="pos_int", metavar="G", absent=DEFAULT)
    max_completion_length: int = _opt(512, "with --objective grpo, the most tokens a "
                                      "completion has", kind="pos_int", metavar="N",
                                      absent=DEFAULT)
    temperature: float = _opt(1.0, "with --objective grpo, the sampling temperature of the "
                              "rollouts", kind="nonneg_float", metavar="X", absent=DEFAULT)
    top_p: float = _opt(1.0, "with --objective grpo, the rollouts' nucleus (1: all tokens)",
                        kind="unit_float", metavar="P", absent=DEFAULT)
    top_k: int = _opt(0, "with --objective grpo, the rollouts' top-k (0: all tokens)",
                      kind="nonneg_int", metavar="K", absent=DEFAULT)
    stop: str | list[str] | None = _opt(None, "with --objective grpo, strings that end a "
                                        "completion, with \\n escapes (default: the chat "
                                        "turn end, a blank line)", kind="paths", metavar="S",
                                        absent=DEFAULT)
    loss_type: str = _opt("dapo", "with --objective grpo, how the token losses are averaged: "
                          "grpo (per completion), bnpo (per micro-batch token), dr_grpo "
                          "(over batch x --max-completion-length), dapo (per token of the step)",
                          choices=LOSS_TYPES, absent=DEFAULT)
    beta: float = _opt(0.0, "with --objective grpo, the weight of the KL to the reference "
                       "(0: no reference)", kind="nonneg_float", metavar="X", absent=DEFAULT)
    epsilon: float = _opt(0.2, "with --objective grpo, the ratio's clipping range below (and "
                          "above without --epsilon-high)", kind="nonneg_float", metavar="X",
                          absent=DEFAULT)
    epsilon_high: float | None = _opt(None, "with --objective grpo, the ratio's clipping range "
                                      "above (DAPO: 0.28)", kind="nonneg_float", metavar="X",
                                      absent=DEFAULT)
    num_iterations: int = _opt(1, "with --objective grpo, optimiser steps on each batch of "
                               "completions", kind="pos_int", metavar="N", absent=DEFAULT)
    scale_rewards: str = _opt("group", "with --objective grpo, what divides the advantages: "
                              "the group's reward std, the batch's, or none",
                              choices=SCALE_REWARDS, absent=DEFAULT)
    mask_truncated_completions: bool = _opt(False, "with --objective grpo, leave the "
                                            "completions cut at --max-completion-length out "
                                            "of the loss", kind="flag", absent=DEFAULT)

    base: str | None = _opt(None, "resume a fine-tune whose base (--init-from) moved: its path "
                            "now, checked against the content hash the run recorded",
                            kind="path", metavar="PATH", absent=None)
    base_dtype: str = _opt("auto", "how the frozen matrices of a state or LoRA tune (or of "
                           "--freeze / --train-parts) are held: fp32, bf16 (half the memory; "
                           "exact for a bf16 source), q8_0 (GGUF's 8-bit blocks, about a "
                           "quarter), q4_0, nf4 (QLoRA's NormalFloat) or q4_k (GGUF's "
                           "k-quant) (4-bit forms, an eighth); auto: the --init-from source's form",
                           choices=BASE_DTYPES, absent=DEFAULT)

    # options a resumed run may change without changing what it computes
    RESUMABLE = ("steps", "time_budget", "eval_every", "save_every", "threads", "cache_dir",
                 "on_divergence", "grad_cp", "row_group", "base", "keep_best", "keep_last",
                 "early_stop", "log_to", "sample_every", "sample_prompt")

    def resolved(self) -> ResolvedOptions:
        """A copy with every preset default filled in and every value checked."""
        if self.preset not in PRESETS:
            raise TrainError(f"unknown preset {self.preset!r}; choose one of "
                             f"{', '.join(PRESETS)}")
        p = PRESETS[self.preset]
        o = TrainOptions(**{f.name: getattr(self, f.name) for f in fields(self)})
        state = o.tune == "state"
        if o.lr is None and state:
            o.lr = STATE_LR
        if o.min_lr_frac is None:
            o.min_lr_frac = STATE_MIN_LR_FRAC if state else MIN_LR_FRAC
        for k in ("batch", "seq_len", "lr", "warmup_steps"):
            if getattr(o, k) is None:
                setattr(o, k, p[k])
        if o.steps is None and o.time_budget is None and o.epochs is None:
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
        if self.on_divergence is None:
            self.on_divergence = "stop"
        for e in entries(TrainOptions):   # each value by its declaration
            why = e.problem(getattr(self, e.key))
            if why is not None:
                raise TrainError(why)
        if self.precision not in PRECISIONS[:2]:
            raise TrainError(f"precision must be {', '.join(PRECISIONS)}, got "
                             f"{self.precision!r}")
        if not 0.0 < self.val_fraction < 1.0:
            raise TrainError(f"val_fraction must lie in (0, 1), got {self.val_fraction!r}")
        if self.train_parts and self.freeze:
            raise TrainError("give --train-parts (what trains) or --freeze (what does not), "
                             "not both")
        if STATES in (self.freeze or "") or (STATES in (self.train_parts or "") and
                                             self.tune != "lora"):   # no other group holds it
            raise TrainError("the state group (the initial WKV states) trains beside a LoRA "
                             "tune's adapters (--tune lora --train-parts state); --tune state "
                             "trains them alone")
        if self.freeze and self.tune != "full":
            raise TrainError(f"--freeze holds groups of --tune full fixed; --tune {self.tune} "
                             "freezes the whole base already")
        if self.unfreeze_at is not None and self.tune == "full" and not self.freeze \
                and not self.train_parts:
            raise TrainError("--unfreeze-at unfreezes a frozen base: give it with --tune state, "
                             "--freeze or --train-parts (in a plain full run everything trains)")
        self._check_mode()
        if (self.sample_every is None) != (self.sample_prompt is None):
            raise TrainError("--sample-every K and --sample-prompt TEXT go together: give both")
        parse_trackers(self.log_to)
        if not self.dpo_label_smoothing < 0.5:
            raise TrainError(f"dpo_label_smoothing must lie in [0, 0.5), got "
                             f"{self.dpo_label_smoothing!r}")
        if self.dpo_label_smoothing and self.objective not in ("dpo", "simpo"):
            raise TrainError(f"--dpo-label-smoothing applies to --objective dpo or simpo, not "
                             f"{self.objective}")
        pairs = self.objective not in ("lm", "grpo")
        if pairs and self.batch is not None and self.batch % 2:
            raise TrainError(f"--batch {self.batch} must be even with --objective "
                             f"{self.objective}: each pair is two sequences")
        if pairs and self.grad_accum != 1:
            raise TrainError(f"--grad-accum applies to --objective lm or grpo, not "
                             f"{self.objective}")
        self._check_grpo()
        assert self.batch is not None and self.seq_len is not None   # resolved() set them
        if self.batch * self.seq_len > MAX_TOKENS_PER_STEP:
            raise TrainError(f"batch * seq_len exceeds {MAX_TOKENS_PER_STEP}")

    def _check_mode(self) -> None:
        """A TrainError for an option that has no effect in the chosen mode
        (a LoRA option off --tune lora, an init over --init-from's weights):
        a user who gives one expects it to do something."""
        if self.tune != "lora":
            for k in ("lora_r", "lora_alpha", "lora_targets", "adapter"):
                if getattr(self, k) not in (None, _DEFAULTS[k]):
                    raise TrainError(f"{flag_of(k)} sets the adapters of --tune lora; it has no "
                                     f"effect with --tune {self.tune}")
        if self.lisa_layers is None and self.lisa_interval != _DEFAULTS["lisa_interval"]:
            raise TrainError("--lisa-interval sets the schedule of --lisa-layers; give both")
        if self.lisa_layers is not None and (self.tune != "full" or self.freeze
                                             or self.train_parts or self.unfreeze_at):
            raise TrainError("--lisa-layers is a schedule of a plain full tune (--tune full, "
                             "no --freeze, --train-parts or --unfreeze-at)")
        if ADAPTERS[self.adapter].fold and self.lora_alpha != _DEFAULTS["lora_alpha"]:
            raise TrainError(f"--adapter {self.adapter} scales by 1: --lora-alpha has no effect "
                             "with it")
        if ADAPTERS[self.adapter].principal and self.tune == "lora" and not self.init_from:
            raise TrainError(f"--adapter {self.adapter} splits given weights: give them with "
                             "--init-from")
        if self.objective != "lm" and (self.train_on_inputs
                                       or self.chat_template != DEFAULT_TEMPLATE):
            raise TrainError(f"--chat-template and --train-on-inputs apply to chat data "
                             f"(--objective lm); preference pairs are rendered in RWKV's "
                             f"template, not with --objective {self.objective}")
        if self.ref_from is not None and self.objective not in ("dpo", "ipo", "grpo"):
            raise TrainError(f"--ref-from names the reference of --objective dpo, ipo or grpo; "
                             f"it has no effect with --objective {self.objective}")
        if self.init_from and self.init != _DEFAULTS["init"]:
            raise TrainError(f"--init {self.init} initialises a new model; --init-from "
                             f"{self.init_from}'s weights replace it: drop --init")

    def _check_grpo(self) -> None:
        """A TrainError for a GRPO option given without --objective grpo (it
        would do nothing), and --ref-from without the KL term it serves."""
        if self.objective != "grpo":
            for k in GRPO_KEYS:
                if getattr(self, k) != _DEFAULTS[k]:
                    raise TrainError(f"{flag_of(k)} applies to --objective grpo, not "
                                     f"{self.objective}")
        elif self.ref_from is not None and self.beta == 0.0:
            raise TrainError("--ref-from names the reference of the KL term; give --beta > 0 "
                             "with it")
        elif (self.beta > 0.0 and self.tune == "lora" and self.ref_from is None
              and ADAPTERS[self.adapter].principal):
            # its base holds the residual: adapters off is not the model it started from
            raise TrainError(f"--adapter {self.adapter} with --beta > 0 needs --ref-from (the "
                             f"--init-from source): its adapters off leave the residual")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def stored(self) -> dict[str, Any]:
        """What a checkpoint stores of these options: to_dict() without the
        keys (options', and the model config's) whose value is what their
        absence means, so a run that does not use a newer field loads in an
        older version."""
        d = stored(TrainOptions, self.to_dict())
        if d.get("model") is not None:
            d["model"] = ModelConfig.stored(d["model"])
        return d


_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(TrainOptions)}
GRPO_KEYS = ("reward", "reward_weights", "num_generations", "max_completion_length",
             "temperature", "top_p", "top_k", "stop", "loss_type", "beta", "epsilon",
             "epsilon_high", "num_iterations", "scale_rewards", "mask_truncated_completions")


def flag_of(name: str) -> str:
    """The command-line flag of option `name`."""
    f = next(f for f in fields(TrainOptions) if f.name == name)
    return f.metadata["flag"] or "--" + name.replace("_", "-")


if TYPE_CHECKING:
    class ResolvedOptions(TrainOptions):
        """The type of TrainOptions.resolved(): the preset's values filled in."""
        batch: int
        seq_len: int
        lr: float
        min_lr_frac: float
        warmup_steps: int
        model: dict[str, Any]


def saved_options(saved: object, path: str) -> TrainOptions:
    """The TrainOptions a checkpoint's state holds (TrainError if it holds none or bad ones)."""
    if not isinstance(saved, dict):
        raise TrainError(f"checkpoint {path} holds no training state")
    # options (and model keys) added since the checkpoint was written take
    # what their absence means (ln0: 0, not the preset's); a run saved before
    # "auto" existed stored a resolved precision anyway
    values = resolve(TrainOptions, saved)
    opts = TrainOptions(**{e.key: values[e.key] for e in entries(TrainOptions)})
    if opts.model is None or isinstance(opts.model, dict):
        opts.model = ModelConfig.resolve(opts.model or {})
    try:
        opts.resolved()
    except TrainError as e:
        raise TrainError(f"checkpoint {path} holds bad options: {e}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise TrainError(f"checkpoint {path} holds bad options ({e})") from None
    return opts


def schema() -> Iterator[Entry]:
    """Every setting of a run, for a config file: each TrainOptions entry
    (key, type, default, check: Entry.problem), then each model-config field
    as "model.KEY" (an override of the preset's model)."""
    yield from entries(TrainOptions)
    for e in entries(ModelConfig):
        yield replace(e, key="model." + e.key)


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
        raise TrainError("cannot resume with a different configuration: " + "; ".join(diff)
                         + "; " + new_run_hint(out_dir))


def new_run_hint(out_dir: str) -> str:
    """What a refused resume says: a new run can start from the saved one's weights."""
    return f"to start a new run from its weights, use --init-from {out_dir}"
