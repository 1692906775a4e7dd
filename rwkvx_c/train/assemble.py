"""A run's components, built from its resolved options: the tokenizer and
corpus it reads, and the model (checked to fit in memory) with its first
weights and the optimiser over what trains. The Trainer composes these."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rwkvx_c import _core
from rwkvx_c.data.chat import ChatFormat
from rwkvx_c.data.pipeline import Corpus, load_corpus
from rwkvx_c.data.preferences import Pairs, read_pairs, split_pairs
from rwkvx_c.data.prompts import Prompts, read_prompts, split_prompts
from rwkvx_c.data.templates import ChatTemplate, end_of_text, load_template
from rwkvx_c.data.tokenizers import load as load_tokenizer
from rwkvx_c.data.tokenizers import run_tokenizer
from rwkvx_c.errors import ConfigError, DataError, MemoryTooSmall, TokenizerError, TrainError
from rwkvx_c.interop.source import STATE_KEY, Layered, read_source
from rwkvx_c.model import memory
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.model.init import init_model
from rwkvx_c.model.lora import A_SUFFIX, B_SUFFIX, M_SUFFIX, adapters_of
from rwkvx_c.model.weights import load_params
from rwkvx_c.run.base import BASE_KEY, Record, identify, pin_source
from rwkvx_c.train.base import model_from_source
from rwkvx_c.train.expand import place_weights
from rwkvx_c.train.finetune import (
    PartsAdamW,
    adapter_options,
    base_frozen,
    from_source,
    make_optimizer,
    restore_trained,
)
from rwkvx_c.train.optim import AdamW

if TYPE_CHECKING:
    from rwkvx_c.data.tokenizers import Tokenizer
    from rwkvx_c.train.distributed import ProcessGroup
    from rwkvx_c.train.options import ResolvedOptions, TrainOptions

__all__ = ["chat_format", "load_data", "load_pairs", "build_model", "load_source",
           "load_weights", "name_base", "start_from_source"]


def start_from_source(options: TrainOptions, group: ProcessGroup, out_dir: str | None
                      ) -> tuple[TrainOptions, Mapping[str, np.ndarray], Record | None]:
    """A fine-tune's options, first weights and pin from its --init-from
    source (rwkvx_c.interop.source, read by rank 0): the source's shape and
    tokenizer, its weights with a state-tuned source's initial states and a
    PEFT / RWKV-PEFT source's adapters (which a LoRA tune trains on).
    options.base: where the source's own base lies now, when the source is
    a fine-tune whose base moved. A tune whose checkpoints will name their
    base (base_frozen) and whose source is a run checkpoint pins it in
    out_dir first and reads the pin (rwkvx_c.run.base.pin_source); the
    record of the pin is the third value (None: nothing pinned)."""
    path = options.init_from
    assert path is not None
    pin = group.on_root(pin_source, path, out_dir, options.base) \
        if base_frozen(options) and out_dir is not None else None
    src = group.on_root(read_source, path, options.base, pinned=pin and pin["path"])
    options = dataclasses.replace(options, base=None)   # the source's, not this run's
    # a .pth's weights stay in its file until the model reads them (rwkvx_c.train.base)
    weights: Mapping[str, np.ndarray] = src.weights
    if src.state0 is not None:   # over the weights, which stay unread
        weights = Layered({STATE_KEY: src.state0}, src.weights)
    if src.adapters is not None:
        ads = src.adapters
        pairs = {n + s: m for n, (A, B) in ads.pairs.items() for s, m in ((A_SUFFIX, A),
                                                                           (B_SUFFIX, B))}
        pairs.update({n + M_SUFFIX: M for n, M in ads.magnitudes.items()})
        weights = {**weights, **ads.parts, **pairs}   # the parts it trained replace the base's
        asked = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
                 if getattr(options, f.name) != f.default}   # what the user set
        options = dataclasses.replace(options, **adapter_options(asked, ads.record(), path))
    return from_source(options, src.config, src.tokenizer, path), weights, pin


def _tokenizer(opts: ResolvedOptions, run_dir: str | None, out_dir: str | None,
               state: dict[str, Any] | None) -> Tokenizer:
    """The run's tokenizer (a resumed run's own); a new run's is saved into
    out_dir (rank 0) to travel with it."""
    try:
        tokenizer = (run_tokenizer(run_dir, state.get("tokenizer"))
                     if state is not None and run_dir is not None
                     else load_tokenizer(opts.tokenizer))
    except TokenizerError as e:
        raise TrainError(str(e)) from None
    if out_dir is not None and state is None:
        tokenizer.save(out_dir)
    return tokenizer


def chat_format(opts: ResolvedOptions, state: dict[str, Any] | None,
                tokenizer: Tokenizer) -> ChatFormat:
    """How the run renders chat records: a resumed run's stored template
    (its text, so a moved template file does not matter), else
    --chat-template's, with --train-on-inputs."""
    try:
        template = ChatTemplate.from_stored(state.get("chat_template")) if state is not None \
            else load_template(opts.chat_template, opts.tokenizer, end_of_text(tokenizer))
    except DataError as e:
        raise TrainError(str(e)) from None
    return ChatFormat(template, bool(opts.train_on_inputs))


def load_data(opts: ResolvedOptions, run_dir: str | None, out_dir: str | None,
              state: dict[str, Any] | None, progress: bool
              ) -> tuple[Tokenizer, Corpus, ChatFormat]:
    """The tokenizer (a resumed run's own), the corpus it reads and how its
    chat records are rendered; a new run's tokenizer is saved into out_dir
    (rank 0) to travel with it."""
    tokenizer = _tokenizer(opts, run_dir, out_dir, state)
    chat = chat_format(opts, state, tokenizer)
    try:
        corpus = load_corpus(opts.data, seq_len=opts.seq_len, val_fraction=opts.val_fraction,
                             cache_dir=opts.cache_dir, tokenizer=tokenizer,
                             text_field=opts.text_field, progress=progress, chat=chat)
        if opts.val_data is not None:
            corpus = _with_validation(corpus, opts, tokenizer, progress, chat)
    except OSError as e:
        raise TrainError(f"cannot prepare the corpus: {e}") from None
    if corpus.train_mask is None and state is None and chat.identity() is not None:
        raise TrainError("--chat-template and --train-on-inputs apply to chat records; "
                         "this corpus is plain text")
    return tokenizer, corpus, chat


def load_pairs(opts: ResolvedOptions, run_dir: str | None, out_dir: str | None,
               state: dict[str, Any] | None) -> tuple[Tokenizer, Corpus, Pairs, Pairs]:
    """The tokenizer, the preference pairs split into train and val, and a
    Corpus of their tokens (its vocabulary and description) for what reads
    one (rwkvx_c.data.preferences)."""
    tokenizer = _tokenizer(opts, run_dir, out_dir, state)
    pairs = read_pairs(opts.data, tokenizer, opts.seq_len)
    train, val = split_pairs(pairs)
    corpus = Corpus(train.x.reshape(-1), val.x.reshape(-1), pairs.vocab_size(),
                    tokenizer.name == "byte", pairs.description)
    return tokenizer, corpus, train, val


def load_prompts(opts: ResolvedOptions, run_dir: str | None, out_dir: str | None,
                 state: dict[str, Any] | None) -> tuple[Tokenizer, Corpus, Prompts, Prompts]:
    """The tokenizer, the prompt records of --objective grpo split into
    train and val, and a Corpus of their tokens (rwkvx_c.data.prompts)."""
    tokenizer = _tokenizer(opts, run_dir, out_dir, state)
    prompts = read_prompts(opts.data, tokenizer)
    train, val = split_prompts(prompts)
    flat = np.array([i for ids in prompts.ids for i in ids], np.int32)
    corpus = Corpus(flat, flat[:0], prompts.vocab_size(), tokenizer.name == "byte",
                    prompts.description)
    return tokenizer, corpus, train, val


def _with_validation(corpus: Corpus, opts: ResolvedOptions, tokenizer: Tokenizer,
                     progress: bool, chat: ChatFormat) -> Corpus:
    """corpus validated on --val-data: every token of that corpus (both of
    its splits, in order), read with the run's tokenizer."""
    try:
        v = load_corpus(opts.val_data, seq_len=opts.seq_len, val_fraction=opts.val_fraction,
                        cache_dir=opts.cache_dir, tokenizer=tokenizer,
                        text_field=opts.text_field, progress=progress, chat=chat)
    except DataError as e:
        raise DataError(f"--val-data: {e}") from None
    if (v.train_mask is None) != (corpus.train_mask is None):
        raise DataError("--val-data must be chat records when --data is, and plain text when "
                        "--data is")
    mask = None if v.train_mask is None or v.val_mask is None else \
        np.concatenate([v.train_mask, v.val_mask])
    val = np.concatenate([v.train, v.val])
    return dataclasses.replace(corpus, val=val, val_mask=mask,
                               description=f"{corpus.description}; validation {v.description}")


def build_model(opts: ResolvedOptions, tokenizer: Tokenizer, corpus: Corpus,
                tensors: Mapping[str, np.ndarray] | None,
                weights: Mapping[str, np.ndarray] | None, step_len: int | None = None
                ) -> tuple[_core.RxPtModel, AdamW | PartsAdamW]:
    """The model, its first weights (imported or --init-from: weights; a
    resume: none here, the checkpoint's come later; else initialised) and
    the optimiser over what trains (--tune). Sets opts' vocabulary.
    step_len: the tokens of a step's longest sequence, which the memory
    check measures (default --seq-len)."""
    opts.vocab_size = opts.model["vocab_size"] = model_vocab(
        opts, tokenizer, corpus, fixed=weights is not None)
    cfg = dict(opts.model)
    if weights is not None:   # a fine-tune: its own memory check, then its source's weights
        model = model_from_source(opts, weights, step_len)
        restore_trained(model, weights, "the source")   # a state-tuned source's states
        optim = make_optimizer(model, opts)
        if adapters_of(weights):   # imported adapters (PEFT, RWKV-PEFT) train on
            if model.lora is None or set(adapters_of(model.lora)) != set(adapters_of(weights)):
                raise TrainError("the source's LoRA adapters are not the ones --tune lora "
                                 "--lora-targets makes; drop --lora-targets")
            restore_trained(model, weights, "the source")
        check_groups(model, opts)
        return model, optim
    try:
        ModelConfig.from_dict(cfg)
        memory.check(memory.param_bytes(memory.estimate_params(cfg)),
                     "the model with its optimiser state", "choose a smaller --preset")
        model = _core.RxPtModel(cfg, seed=opts.seed, precision=opts.precision,
                                recompute=bool(opts.grad_cp), l2wrap=opts.l2wrap)
        model.row_group = opts.row_group
        memory.check_step(model, opts.batch, step_len or opts.seq_len,
                          auto_recompute=opts.grad_cp is None)
    except (ConfigError, MemoryTooSmall) as e:
        raise TrainError(str(e)) from None
    if tensors is None:
        init_model(model, opts.init, seed=opts.seed)
    optim = make_optimizer(model, opts)   # its adapters decide groups_exact
    check_groups(model, opts)
    return model, optim


def check_groups(model: _core.RxPtModel, opts: ResolvedOptions) -> None:
    """TrainError unless --row-group N keeps this tune's bits
    (RxPtModel.groups_exact, with what trains now set) for the whole run
    (no --unfreeze-at) under recompute."""
    if opts.row_group and (opts.grad_cp is False or opts.unfreeze_at is not None):
        raise TrainError(f"--row-group {opts.row_group} groups the blocks of activation "
                         "recompute of a tune whose base stays frozen: it has no effect "
                         "without --grad-cp, nor past --unfreeze-at")
    if opts.row_group and model.recompute and not model.groups_exact:
        raise TrainError(f"--row-group {opts.row_group}: row groups keep a step's grads only "
                         "for LoRA adapters (not DoRA) with nothing else training, on a model "
                         "without attention blocks; drop --row-group")


def load_source(model: _core.RxPtModel, weights: Mapping[str, np.ndarray]) -> None:
    """A source's weights (--init-from, or the base a fine-tune's checkpoint
    names) into model, expanded when the model has attention blocks the
    source lacks (rwkvx_c.train.expand)."""
    load_weights(model, place_weights(model, weights))


def load_weights(model: _core.RxPtModel, tensors: Mapping[str, np.ndarray],
                 names: Sequence[str] | None = None) -> None:
    """A checkpoint's (or source's) weights into model, with a state run's
    states and a LoRA run's adapters (names: these parameters alone)."""
    load_params(model, tensors, "the checkpoint", TrainError, names)
    restore_trained(model, tensors, "the checkpoint")


def name_base(opts: ResolvedOptions, state: Mapping[str, Any] | None,
              weights: Mapping[str, np.ndarray] | None, writes: bool,
              pin: Record | None = None) -> Record | None:
    """The base a run's checkpoints name instead of holding it
    (rwkvx_c.run.base): a resumed run's as its checkpoint recorded it; a
    fine-tune's with part of the model frozen: its pin of a run source,
    else the source hashed once as it starts (by the process that writes:
    writes); else None (they hold every parameter)."""
    if state is not None:
        base: Record | None = state.get(BASE_KEY)
        return base
    if opts.base:
        raise TrainError("--base names where a fine-tune's base lies now: give it with "
                         "--resume, or with --init-from a fine-tune whose base moved")
    if opts.init_from and weights is not None and base_frozen(opts) and writes:
        return pin or identify(opts.init_from)
    return None


def model_vocab(opts: ResolvedOptions, tokenizer: Tokenizer, corpus: Corpus,
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
