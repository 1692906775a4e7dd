"""Text generation from a trained checkpoint.

Generation is recurrent, as RWKV models are used: the prompt runs through
the model once (``InferState.forward`` over all its tokens), then every new
token costs one step. RWKV-7 blocks carry their WKV state and both
token-shift carries; attention blocks keep a key/value cache and apply the
same MoBA chunk selection as training. The per-token step is C
(csrc/infer.c); temperature and top-p (nucleus) sampling are here.
"""
from __future__ import annotations

import codecs
import os
from collections.abc import Iterator

import numpy as np

from rwkvx_c import _core
from rwkvx_c.data.tokenizers import ByteTokenizer, Tokenizer, run_tokenizer
from rwkvx_c.errors import (
    CheckpointError,
    ConfigError,
    MemoryTooSmall,
    SampleError,
    TokenizerError,
)
from rwkvx_c.interop.source import read_run
from rwkvx_c.model import memory
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.model.lora import adapters_of, run_alpha, without_adapters
from rwkvx_c.model.weights import load_params, load_states
from rwkvx_c.run.checkpoint import STATE_KEY
from rwkvx_c.run.rundir import checkpoint_path

__all__ = ["load_model", "load_run", "sample_token", "generate", "checkpoint_path"]


def load_model(path: str, base: str | None = None) -> _core.RxPtModel:
    """An RxPtModel holding the parameters of the checkpoint at path (a run
    folder or a .safetensors file): a LoRA run's with its adapters merged, a
    state run's with its initial states; a fine-tune whose checkpoint names
    its base rebuilt from that base (read again; base: where it lies now,
    when it moved). Raises CheckpointError when it is missing, corrupt or
    does not describe a model, or its base is missing or changed."""
    return load_run(path, base)[0]


def load_run(path: str, base: str | None = None) -> tuple[_core.RxPtModel, Tokenizer]:
    """(model, tokenizer) of the checkpoint at path: the tokenizer the run
    was trained with (its identity is in the checkpoint; a tokenizer.json
    lies beside it). base: as load_model's. CheckpointError when either
    cannot be had."""
    p = checkpoint_path(path)
    tensors, config, state = read_run(p, base)
    try:
        tok = run_tokenizer(os.path.dirname(os.path.abspath(p)), (state or {}).get("tokenizer"))
    except TokenizerError as e:
        raise CheckpointError(str(e)) from None
    if tok.name != "byte" and tok.vocab_size > config.get("vocab_size", 0):
        raise CheckpointError(f"checkpoint {p}: its model has {config.get('vocab_size')} ids, "
                              f"fewer than its tokenizer's {tok.vocab_size}")
    try:
        ModelConfig.from_dict(config)
        # the parameters and the file's copy of them, checked before either exists
        memory.check(8 * memory.estimate_params(config), f"the model of {p}",
                     "sample on a machine with more memory")
        model = _core.RxPtModel(config)
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {p} holds an unusable model config ({e})") from None
    except MemoryTooSmall as e:
        raise CheckpointError(str(e)) from None
    if adapters_of(tensors):   # a LoRA run: the model it trained, merged
        tensors = without_adapters(tensors, run_alpha(state, p))
    load_params(model, tensors, f"checkpoint {p}")
    load_states(model, tensors.get(STATE_KEY), f"checkpoint {p}")
    return model, tok


def sample_token(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0,
                 top_p: float = 1.0) -> int:
    """A token id drawn from logits (vocab,).

    temperature <= 0 picks the argmax; otherwise softmax(logits/temperature)
    restricted to the smallest set of most likely tokens whose probability
    reaches top_p (top_p >= 1 keeps them all), renormalised.
    """
    logits = np.asarray(logits, dtype=np.float64)
    if temperature <= 0:
        return int(np.argmax(logits))
    # shifted before the division: a tiny temperature sends the gaps to
    # -inf (probability 0), never inf - inf = NaN
    z = (logits - logits.max()) / temperature
    p = np.exp(z)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p)) + 1]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return int(rng.choice(len(p), p=p))


# Prompt tokens per recurrent call: the state carries across calls, so a
# long prompt costs the memory of one piece (the call's intermediates and
# its [piece, vocab] logits), not of the whole prompt.
PROMPT_PIECE = 512


def generate(model: _core.RxPtModel, prompt: str | bytes, max_new_tokens: int = 200,
             temperature: float = 1.0, top_p: float = 0.9, seed: int = 0,
             tokenizer: Tokenizer | None = None) -> Iterator[str]:
    """Yield the decoded text of each new token after `prompt` (str or bytes).

    The prompt runs through the recurrent state in pieces of at most
    PROMPT_PIECE tokens (fewer at a large vocabulary: the head's chunk
    rows); each new token is one recurrent step. An empty prompt starts from
    a newline. tokenizer: the run's (load_run); None
    means bytes.
    """
    tok = tokenizer or ByteTokenizer()
    ids = tok.encode(prompt) if len(prompt) else tok.encode("\n")
    state = _core.InferState(model, max_len=_max_len(model, len(ids), max_new_tokens))
    rng = np.random.Generator(np.random.PCG64(seed))
    piece = min(PROMPT_PIECE, _core.head_chunk_rows(model.config["vocab_size"]))
    prompt_ids = np.ascontiguousarray(ids, dtype=np.int32)
    for i in range(0, len(prompt_ids), piece):
        logits = state.forward(prompt_ids[i:i + piece])[-1].copy()
    logits = _finite(logits, 0)
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for i in range(max_new_tokens):
        t = sample_token(logits, rng, temperature, top_p)
        text = dec.decode(tok.decode([t]) if t < tok.vocab_size else b"")
        if text:
            yield text
        if i + 1 < max_new_tokens:
            logits = _finite(state.forward(np.array([t], dtype=np.int32))[-1], i + 1)
    tail = dec.decode(b"", final=True)
    if tail:
        yield tail


MAX_POSITIONS = 2 ** 31 - 1   # positions are int32 in the C API


def _max_len(model: _core.RxPtModel, prompt: int, new: int) -> int:
    """The positions an InferState must hold for prompt + new tokens, checked:
    attention blocks keep every key and value (2 x n_attn_layer x n_embd
    floats a position, allocated up front); RWKV-7 blocks carry a state of
    fixed size, so a model without attention needs no cache at all."""
    c = model.config
    if c["n_attn_layer"] == 0:
        return 1
    n = prompt + max(new, 1)
    if n > MAX_POSITIONS:
        raise SampleError(f"{prompt} prompt tokens + {new:,} new ones pass the {MAX_POSITIONS:,} "
                          "positions a sequence of a model with attention may hold; lower "
                          "--max-new-tokens")
    memory.check(2 * 4 * c["n_attn_layer"] * c["n_embd"] * n,
                 f"the attention cache of {n:,} positions", "lower --max-new-tokens")
    return n


def _finite(logits: np.ndarray, i: int) -> np.ndarray:
    """logits, when every one is finite; else SampleError: sampling from
    NaN would pick garbage or fail deep inside NumPy."""
    if not np.isfinite(logits).all():
        raise SampleError(f"the model's logits are not finite (NaN or inf) at new token {i}: "
                          "its weights do not make a usable model")
    return logits
