"""Text generation from a trained checkpoint.

Generation is recurrent, as RWKV models are used: the prompt runs through
the model once (in pieces), then every new token costs one step, in one
slot of the batched engine (``GenState``, rwkvx_c.generation, which
batches many sequences). RWKV-7 blocks carry their WKV state and both
token-shift carries; attention blocks keep a key/value cache and apply the
same MoBA chunk selection as training. The step is C
(csrc/gen.c), the draw rwkvx_c.generation.sampling's; loading a run, the
feeding of text in bounded pieces (Session) and the multi-turn chat (Chat)
are here.
"""
from __future__ import annotations

import codecs
import os
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from rwkvx_c import _core
from rwkvx_c.data.chat import normalise
from rwkvx_c.data.templates import BUILTIN, DEFAULT_TEMPLATE, ChatTemplate, builtin
from rwkvx_c.data.tokenizers import ByteTokenizer, Tokenizer, run_tokenizer
from rwkvx_c.data.tokenizers import load as load_tokenizer
from rwkvx_c.errors import (
    CheckpointError,
    ConfigError,
    InteropError,
    MemoryTooSmall,
    SampleError,
    TokenizerError,
)
from rwkvx_c.generation.engine import MAX_POSITIONS, PROMPT_PIECE, cache_positions
from rwkvx_c.generation.sampling import Penalties, Sampling, StopText, sample_token
from rwkvx_c.interop.source import Layered, read_run, read_source
from rwkvx_c.model import memory
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.model.lora import (
    A_SUFFIX,
    B_SUFFIX,
    M_SUFFIX,
    adapters_of,
    magnitudes_of,
    run_alpha,
    without_adapters,
)
from rwkvx_c.model.weights import auto_base_dtype, fill_base, load_params, load_states
from rwkvx_c.run.checkpoint import STATE_KEY, read_state
from rwkvx_c.run.rundir import RunDir, checkpoint_path

__all__ = ["load_model", "load_run", "load_any", "is_run", "Sampling", "Session",
           "sample_token", "generate", "checkpoint_path", "PROMPT_PIECE", "Chat", "CHAT_STOPS",
           "run_template", "reply_stops"]


def load_model(path: str, base: str | None = None, rehash: bool = False,
               hold_base: bool = False) -> _core.RxPtModel:
    """An RxPtModel holding the parameters of the checkpoint at path (a run
    folder or a .safetensors file): a LoRA run's with its adapters merged, a
    state run's with its initial states; a fine-tune whose checkpoint names
    its base rebuilt from that base (read again; base: where it lies now,
    when it moved; rehash: hashed again even when its files look unchanged,
    rwkvx_c.run.base). hold_base: as load_run's. Raises CheckpointError when
    it is missing, corrupt or does not describe a model, or its base is
    missing or changed."""
    return load_run(path, base, rehash, hold_base)[0]


def load_run(path: str, base: str | None = None, rehash: bool = False,
             hold_base: bool = False) -> tuple[_core.RxPtModel, Tokenizer]:
    """(model, tokenizer) of the checkpoint at path: the tokenizer the run
    was trained with (its identity is in the checkpoint; a tokenizer.json
    lies beside it). base, rehash: as load_model's. hold_base: a run that
    names its base keeps that base as it trained on it (bf16 or Q8_0 rows
    read in place, its LoRA adapters applied unmerged, its trained states
    the start), for the batched engine (GenState) to generate from; else
    every weight is float32 and the adapters merged. CheckpointError when
    either cannot be had."""
    p = checkpoint_path(path)
    tensors, config, state = read_run(p, base, rehash=rehash)
    try:
        tok = run_tokenizer(os.path.dirname(os.path.abspath(p)), (state or {}).get("tokenizer"))
    except TokenizerError as e:
        raise CheckpointError(str(e)) from None
    if tok.name != "byte" and tok.vocab_size > config.get("vocab_size", 0):
        raise CheckpointError(f"checkpoint {p}: its model has {config.get('vocab_size')} ids, "
                              f"fewer than its tokenizer's {tok.vocab_size}")
    held = tensors if hold_base and isinstance(tensors, Layered) else None
    opts = (state or {}).get("options") or {}
    try:
        ModelConfig.from_dict(config)
        precision = str(opts.get("precision")) if held is not None and \
            opts.get("precision") in ("fp32", "bf16") else "fp32"
        # every parameter is written below (dense: on huge pages, unless a
        # base will hold some); the grads, never written here, stay unmapped
        # address space
        model = _core.RxPtModel(config, init=False, precision=precision, dense=held is None)
        names, dtype = _held_base(model, held, opts) if held is not None else ([], "fp32")
        # the parameters (a held base's in its dtype) and, while reading, the
        # largest tensor twice (a checkpoint's mapped pages are dropped once
        # copied): checked before anything is read
        in_base = sum(model.params[n].size for n in names)
        per, nbytes = _core.base_dtype_block(dtype) if names else (1, 4)
        largest = config["vocab_size"] * config["n_embd"]
        need = 4 * (model.n_params - in_base) + in_base // per * nbytes + 8 * largest
        if adapters_of(tensors) and not isinstance(tensors, Layered):
            need = 8 * model.n_params   # the merged weights are copies (without_adapters)
        memory.check(need, f"the model of {p}" + (f" (its base {dtype})" if names else ""),
                     "sample on a machine with more memory")
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {p} holds an unusable model config ({e})") from None
    except MemoryTooSmall as e:
        raise CheckpointError(str(e)) from None
    if held is not None:
        _fill_held(model, held, names, dtype, run_alpha(state, p) if adapters_of(tensors)
                   else None, f"checkpoint {p}")
    else:
        if adapters_of(tensors):   # a LoRA run: the model it trained, merged
            tensors = without_adapters(tensors, run_alpha(state, p))
        load_params(model, tensors, f"checkpoint {p}")
    load_states(model, tensors.get(STATE_KEY), f"checkpoint {p}")
    return model, tok


def is_run(path: str) -> bool:
    """True when path is a run folder with a checkpoint or a checkpoint
    file (its header holds a run state); else it is another source
    --init-from takes (a .pth, a Hugging Face folder, a .safetensors of
    x070 or HF rwkv7 names)."""
    if os.path.isdir(path):
        return RunDir(path).has_checkpoint()
    return not path.endswith(".pth") and (not path.endswith(".safetensors")
                                          or bool(read_state(path)))


def load_any(path: str, base: str | None = None, hold_base: bool = False
             ) -> tuple[_core.RxPtModel, Tokenizer]:
    """(model, tokenizer) of any source --init-from takes: a run or a
    checkpoint (load_run), or a .pth, a Hugging Face folder or a
    .safetensors of x070 / HF names, read as --init-from reads it
    (rwkvx_c.interop.source.read_source) with the tokenizer it names.
    hold_base: as load_run's, for a run. CheckpointError (one line) when it cannot be had."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or folder")
    if is_run(path):
        return load_run(path, base, hold_base=hold_base)
    if base is not None:
        raise CheckpointError(f"--base {base}: {path} is no run and names no base; leave "
                              "--base out")
    try:
        src = read_source(path)
    except InteropError as e:
        raise CheckpointError(str(e).replace("--init-from ", "", 1)) from None
    if src.adapters is not None:
        raise CheckpointError(f"{path} holds LoRA adapters; put them on their base first: "
                              f"rwkvx-c import {path} --base BASE --out RUN")
    # a source that names none: bytes, as --init-from's default --tokenizer, when they fit
    spec = src.tokenizer or ("byte" if src.config["vocab_size"] == ByteTokenizer.vocab_size
                             else None)
    if spec is None:
        raise CheckpointError(f"{path} names no tokenizer for its vocabulary of "
                              f"{src.config['vocab_size']:,}; train from it with "
                              f"--tokenizer PATH, or score a run made so")
    try:
        # every parameter in float32 and, while reading, the largest tensor twice
        memory.check(4 * memory.estimate_params(src.config)
                     + 8 * src.config["vocab_size"] * src.config["n_embd"],
                     f"the model of {path}", "evaluate on a machine with more memory")
        model = _core.RxPtModel(src.config, init=False, dense=True)
        tok = load_tokenizer(spec)
    except (ConfigError, MemoryTooSmall, TokenizerError) as e:
        raise CheckpointError(str(e)) from None
    load_params(model, src.weights, path, CheckpointError)
    load_states(model, src.state0, path)
    return model, tok


def _held_base(model: _core.RxPtModel, tensors: Layered, opts: dict[str, Any]
               ) -> tuple[list[str], str]:
    """(the matrices a base-naming run's base holds, its dtype): the run's
    --base-dtype ("auto": the source's form when a base holds it), over
    every 2-D parameter the checkpoint does not hold itself whose rows are
    whole blocks of it and that its source holds in less than float32
    where it says (as rwkvx_c.train.base.base_names picks them)."""
    dtype = str(opts.get("base_dtype") or "auto")
    if dtype == "auto":   # as the run resolved it: the base's own form (it froze something)
        dtype = auto_base_dtype(tensors.base_dtype)
    if dtype == "fp32":
        return [], dtype
    per, _ = _core.base_dtype_block(dtype)
    p = model.params
    return [n for n in model.param_names if not tensors.owns(n) and p[n].ndim == 2
            and p[n].shape[n == "emb"] % per == 0 and tensors.compact(n)], dtype


def _fill_held(model: _core.RxPtModel, tensors: Layered, names: list[str], dtype: str,
               alpha: float | None, what: str) -> None:
    """model's weights from tensors, names in a base of dtype (each read
    and released one at a time), the run's adapters unmerged."""
    if names:
        model.set_base(dtype, names)
    held = set(names)
    for n in model.param_names:
        if n in held:
            fill_base(model, tensors, n)
        else:
            load_params(model, {n: tensors[n]}, what, names=[n])
        tensors.release(n)
    ads = adapters_of(tensors)
    if ads:
        assert alpha is not None
        r = next(iter(ads.values()))[0].shape[0]
        mags = magnitudes_of(tensors)
        model.enable_lora(r, alpha, list(ads), dora=bool(mags))
        assert model.lora is not None
        for name, (A, B) in ads.items():
            model.lora[name + A_SUFFIX][...] = A
            model.lora[name + B_SUFFIX][...] = B
            if mags:
                model.lora[name + M_SUFFIX][...] = mags[name]


class Session:
    """One recurrent state of a model: text is fed into it (in pieces of at
    most PROMPT_PIECE tokens, fewer at a large vocabulary: the head's chunk
    rows) and generated from it, one recurrent step a new token.
    max_positions: the positions a model with attention may reach (its
    key/value cache, allocated up front and checked against the memory);
    a model without attention carries a state of fixed size and has no bound."""

    def __init__(self, model: _core.RxPtModel, tokenizer: Tokenizer | None = None,
                 max_positions: int = 1, seed: int = 0, advice: str = "lower --context",
                 fast_decode: bool = False) -> None:
        self.model = model
        self.tok = tokenizer or ByteTokenizer()
        self.attends = model.config["n_attn_layer"] > 0
        self.max_positions = cache_positions(model, max_positions, 1, advice)
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.piece = min(PROMPT_PIECE, _core.head_chunk_rows(model.config["vocab_size"]))
        # one slot of the batched engine: it reads a frozen base in place
        self.state = _core.GenState(model, 1, max_len=self.max_positions, max_tokens=self.piece,
                                    fast_decode=fast_decode)
        self.logits: np.ndarray | None = None
        self.pending: int | None = None   # the last generated id, not yet fed
        self.generated = b""              # the bytes of the ids generate() fed

    @property
    def pos(self) -> int:
        """Positions the state has read."""
        return int(self.state.pos(0))

    def feed(self, text: str | bytes) -> None:
        """Run text (after the pending generated id) through the state."""
        self.feed_ids(self.tok.encode(text) if len(text) else [])

    def feed_ids(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Run token ids (after the pending generated id) through the state."""
        ids = np.ascontiguousarray(tokens, dtype=np.int32)
        if self.pending is not None:
            ids = np.concatenate([np.array([self.pending], np.int32), ids])
            self.pending = None
        if self.attends and self.pos + len(ids) > self.max_positions:
            raise SampleError(f"the text reaches {self.pos + len(ids):,} positions, past "
                              f"the {self.max_positions:,} this model's attention cache holds; "
                              "raise --context or start again")
        for i in range(0, len(ids), self.piece):
            piece = ids[i:i + self.piece]
            self.logits = self.state.step([0], [len(piece)], piece)[-1].copy()

    def reset(self) -> None:
        self.state.reset(0)
        self.logits, self.pending, self.generated = None, None, b""

    def generate(self, max_new_tokens: int, s: Sampling) -> Iterator[str]:
        """Yield the decoded text of each new token after what was fed, until
        max_new_tokens, an id of s.token_stop or a string of s.stop; the last
        id stays pending (fed with the next text). self.generated holds the
        bytes of the ids fed meanwhile."""
        if self.logits is None:
            raise SampleError("nothing was fed to generate from")
        logits = _finite(self.logits, 0)
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pen, stops = Penalties(s), StopText(s.stop)
        self.generated = b""
        for i in range(max_new_tokens):
            t = sample_token(pen.apply(logits), self.rng, s.temperature, s.top_p, s.top_k)
            if t in s.token_stop:
                break
            raw = self.tok.decode([t]) if t < self.tok.vocab_size else b""
            pen.add(t, raw.decode("utf-8", "replace"))
            text = stops.push(dec.decode(raw))
            if text:
                yield text
            if stops.hit:
                self.pending = t
                return
            if i + 1 == max_new_tokens:
                self.pending = t
                break
            logits = _finite(self.state.step([0], [1], np.array([t], np.int32))[-1], i + 1)
            self.generated += raw
        tail = stops.push(dec.decode(b"", final=True)) + stops.flush()
        if tail and not stops.hit:
            yield tail


def generate(model: _core.RxPtModel, prompt: str | bytes, max_new_tokens: int = 200,
             temperature: float = 1.0, top_p: float = 0.9, seed: int = 0,
             tokenizer: Tokenizer | None = None, fast_decode: bool = False,
             **sampling: Any) -> Iterator[str]:
    """Yield the decoded text of each new token after `prompt` (str or bytes).

    The prompt runs through the recurrent state in pieces (Session); each
    new token is one recurrent step. An empty prompt starts from a newline.
    tokenizer: the run's (load_run); None means bytes. sampling: the other
    fields of Sampling (top_k, alpha_presence, alpha_frequency, alpha_decay,
    token_ban, token_stop, stop), as the rwkv package's PIPELINE_ARGS
    names them. fast_decode: the products over a Q8_0 or Q4_0 base in
    integer dot products (GenState's; docs/training.md §Fast decode).
    """
    s = Sampling(temperature=temperature, top_p=top_p, **sampling)
    tok = tokenizer or ByteTokenizer()
    ids = tok.encode(prompt) if len(prompt) else tok.encode("\n")
    if model.config["n_attn_layer"] and len(ids) + max_new_tokens > MAX_POSITIONS:
        raise SampleError(f"{len(ids)} prompt tokens + {max_new_tokens:,} new ones pass the "
                          f"{MAX_POSITIONS:,} positions a sequence of a model with attention "
                          "may hold; lower --max-new-tokens")
    session = Session(model, tok, len(ids) + max(max_new_tokens, 1), seed,
                      "shorten the prompt or lower --max-new-tokens", fast_decode)
    session.feed_ids(ids)
    yield from session.generate(max_new_tokens, s)


def _finite(logits: np.ndarray, i: int) -> np.ndarray:
    """logits, when every one is finite; else SampleError: sampling from
    NaN would pick garbage or fail deep inside NumPy."""
    if not np.isfinite(logits).all():
        raise SampleError(f"the model's logits are not finite (NaN or inf) at new token {i}: "
                          "its weights do not make a usable model")
    return logits


# A reply in RWKV's template ends at the blank line that closes a turn (the
# rendering of rwkvx_c.data.chat trains the model to write it) or where it
# starts a User: turn of its own; another template's at the text it writes
# after a reply (ChatTemplate.stops).
CHAT_STOPS = ("\n\n", "\nUser:")
# what a reply's end adds past its generated ids (its last id re-read with
# the turn's end); Session.feed checks the bound exactly
TURN_END_TOKENS = 3


def run_template(path: str) -> ChatTemplate:
    """The chat template the run at path trained with (its checkpoint keeps
    it); RWKV's for a run from before templates, an imported model or a
    run of plain text."""
    return ChatTemplate.from_stored(read_state(checkpoint_path(path)).get("chat_template"))


def reply_stops(template: ChatTemplate) -> tuple[str, ...]:
    """The strings a reply in template stops at."""
    return CHAT_STOPS if template.source == BUILTIN[DEFAULT_TEMPLATE] else template.stops


class Chat:
    """A conversation rendered with a chat template (RWKV's by default,
    rwkvx_c.data.templates), one state carried from turn to turn. say(text)
    feeds what the template adds for the user's turn and the generation
    prompt, and yields the reply, stopped at the template's end of a reply
    (and s.stop); the state then holds the reply as the template renders
    it (the text the model wrote, the stop string replaced by the turn's
    end), so the next turn reads what a rendered conversation holds.
    context: the positions a model with attention may reach (its
    key/value cache)."""

    def __init__(self, model: _core.RxPtModel, tokenizer: Tokenizer | None, s: Sampling,
                 max_new_tokens: int, context: int, seed: int = 0,
                 system: str | None = None, template: ChatTemplate | None = None) -> None:
        self.session = Session(model, tokenizer, context, seed, "lower --context")
        self.template = template or builtin()
        self.s = replace(s, stop=tuple(s.stop) + reply_stops(self.template))
        self.max_new_tokens = max_new_tokens
        self.messages: list[dict[str, str]] = \
            [{"role": "system", "content": system}] if system and normalise(system) else []
        self.transcript = ""   # the text the state has read

    def _read(self, text: str) -> None:
        """Bring the state to text: what it adds to the transcript, or all
        of it again when it rewrites the transcript."""
        if text.startswith(self.transcript):
            self.session.feed(text[len(self.transcript):].encode("utf-8", "surrogatepass"))
            self.transcript = text
        else:
            self._reread(text)

    def _reread(self, text: str) -> None:
        """The state from the start, fed text."""
        self.session.reset()
        self.session.feed(text.encode("utf-8", "surrogatepass"))
        self.transcript = text

    def say(self, text: str) -> Iterator[str]:
        """Yield the reply to the user's text, piece by piece."""
        msgs = self.messages + [{"role": "user", "content": text}]
        prompt = self.template.render(msgs, add_generation_prompt=True)
        self._read(prompt)
        st = self.session
        # a reply at its longest, and the turn's end after it, must fit the cache
        if st.attends and \
                st.pos + self.max_new_tokens + TURN_END_TOKENS > st.max_positions:
            raise SampleError(f"the conversation holds {st.pos:,} positions; a reply of "
                              f"up to {self.max_new_tokens:,} tokens would pass the "
                              f"{st.max_positions:,} of --context: raise it or start again")
        reply = []
        for piece in self.session.generate(self.max_new_tokens, self.s):
            reply.append(piece)
            yield piece
        self.messages = msgs + [{"role": "assistant", "content": "".join(reply)}]
        full = self.template.render(self.messages)
        fed = self.session.generated
        self.session.pending = None   # the id that ended the reply, or one past it
        turn = full[len(prompt):].encode("utf-8", "surrogatepass") \
            if full.startswith(prompt) else b""
        if turn.startswith(fed):
            self.session.feed(turn[len(fed):])
            self.transcript = full
        else:   # the state read text the rendered turn does not hold (part of a stop string)
            self._reread(full)
