"""A run's components, built from its resolved options: the tokenizer and
corpus it reads, and the model (checked to fit in memory) with its first
weights and the optimiser over what trains. The Trainer composes these."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from rwkvx_c import _core
from rwkvx_c.data.pipeline import load_corpus
from rwkvx_c.data.tokenizers import load as load_tokenizer
from rwkvx_c.data.tokenizers import run_tokenizer
from rwkvx_c.errors import ConfigError, MemoryTooSmall, TokenizerError, TrainError
from rwkvx_c.model import memory
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.model.init import init_model
from rwkvx_c.model.weights import load_params
from rwkvx_c.train.base import model_from_source
from rwkvx_c.train.finetune import PartsAdamW, make_optimizer, restore_trained
from rwkvx_c.train.optim import AdamW
from rwkvx_c.train.options import model_vocab

if TYPE_CHECKING:
    from rwkvx_c.data.pipeline import Corpus
    from rwkvx_c.data.tokenizers import Tokenizer
    from rwkvx_c.train.options import ResolvedOptions

__all__ = ["load_data", "build_model", "load_weights"]


def load_data(opts: ResolvedOptions, run_dir: str | None, out_dir: str | None,
              state: dict[str, Any] | None, progress: bool) -> tuple[Tokenizer, Corpus]:
    """The tokenizer (a resumed run's own) and the corpus it reads; a new
    run's tokenizer is saved into out_dir (rank 0) to travel with it."""
    try:
        tokenizer = (run_tokenizer(run_dir, state.get("tokenizer"))
                     if state is not None and run_dir is not None
                     else load_tokenizer(opts.tokenizer))
    except TokenizerError as e:
        raise TrainError(str(e)) from None
    if out_dir is not None and state is None:
        tokenizer.save(out_dir)
    try:
        corpus = load_corpus(opts.data, seq_len=opts.seq_len, cache_dir=opts.cache_dir,
                             tokenizer=tokenizer, text_field=opts.text_field, progress=progress)
    except OSError as e:
        raise TrainError(f"cannot prepare the corpus: {e}") from None
    return tokenizer, corpus


def build_model(opts: ResolvedOptions, tokenizer: Tokenizer, corpus: Corpus,
                tensors: Mapping[str, np.ndarray] | None,
                weights: Mapping[str, np.ndarray] | None,
                ranks: int) -> tuple[_core.RxPtModel, AdamW | PartsAdamW]:
    """The model, its first weights (imported or --init-from: weights; a
    resume: none here, the checkpoint's come later; else initialised) and
    the optimiser over what trains (--tune). Sets opts' vocabulary."""
    opts.vocab_size = opts.model["vocab_size"] = model_vocab(
        opts, tokenizer, corpus, fixed=weights is not None)
    cfg = dict(opts.model)
    if weights is not None:   # a fine-tune: its own memory check, then its source's weights
        model = model_from_source(opts, weights)
        restore_trained(model, weights, "the source")
        return model, make_optimizer(model, opts, ranks)
    try:
        ModelConfig.from_dict(cfg)
        memory.check(memory.param_bytes(memory.estimate_params(cfg)),
                     "the model with its optimiser state", "choose a smaller --preset")
        model = _core.RxPtModel(cfg, seed=opts.seed, precision=opts.precision,
                                recompute=bool(opts.grad_cp), l2wrap=opts.l2wrap)
        memory.check_step(model, opts.batch, opts.seq_len)
    except (ConfigError, MemoryTooSmall) as e:
        raise TrainError(str(e)) from None
    if tensors is None:
        init_model(model, opts.init, seed=opts.seed)
    return model, make_optimizer(model, opts, ranks)


def load_weights(model: _core.RxPtModel, tensors: Mapping[str, np.ndarray]) -> None:
    """A checkpoint's (or source's) weights into model, with a state run's states."""
    load_params(model, tensors, "the checkpoint", TrainError)
    restore_trained(model, tensors, "the checkpoint")
