"""Text generation from a trained checkpoint.

Generation is recurrent, as RWKV models are used: the prompt runs through
the model once (``InferState.forward`` over all its tokens), then every new
token costs one step. RWKV-7 blocks carry their WKV state and both
token-shift carries; attention blocks keep a key/value cache and apply the
same MoBA chunk selection as training. The per-token step is C
(csrc/infer.c); the sampling (temperature, top-k, top-p, the rwkv
package's repetition penalties, stop ids and strings), the feeding of text
in bounded pieces (Session) and the multi-turn chat (Chat) are here.
"""
from __future__ import annotations

import codecs
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rwkvx_c import _core
from rwkvx_c.data.chat import ROLES, normalise
from rwkvx_c.data.tokenizers import ByteTokenizer, Tokenizer, run_tokenizer
from rwkvx_c.errors import (
    CheckpointError,
    ConfigError,
    MemoryTooSmall,
    SampleError,
    TokenizerError,
)
from rwkvx_c.interop.source import Layered, read_run
from rwkvx_c.model import memory
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.model.lora import adapters_of, run_alpha, without_adapters
from rwkvx_c.model.weights import load_params, load_states
from rwkvx_c.run.checkpoint import STATE_KEY
from rwkvx_c.run.rundir import checkpoint_path

__all__ = ["load_model", "load_run", "Sampling", "Session", "sample_token", "generate",
           "checkpoint_path", "PROMPT_PIECE", "Chat", "CHAT_STOPS"]


def load_model(path: str, base: str | None = None, rehash: bool = False) -> _core.RxPtModel:
    """An RxPtModel holding the parameters of the checkpoint at path (a run
    folder or a .safetensors file): a LoRA run's with its adapters merged, a
    state run's with its initial states; a fine-tune whose checkpoint names
    its base rebuilt from that base (read again; base: where it lies now,
    when it moved; rehash: hashed again even when its files look unchanged,
    rwkvx_c.run.base). Raises CheckpointError when it is missing, corrupt or
    does not describe a model, or its base is missing or changed."""
    return load_run(path, base, rehash)[0]


def load_run(path: str, base: str | None = None, rehash: bool = False
             ) -> tuple[_core.RxPtModel, Tokenizer]:
    """(model, tokenizer) of the checkpoint at path: the tokenizer the run
    was trained with (its identity is in the checkpoint; a tokenizer.json
    lies beside it). base, rehash: as load_model's. CheckpointError when
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
    try:
        ModelConfig.from_dict(config)
        # the parameters and the file's copy of them, checked before either
        # exists; a checkpoint naming its base reads the base one tensor at
        # a time (Layered): the model and its largest tensor, read and converted
        params = memory.estimate_params(config)
        largest = config["vocab_size"] * config["n_embd"]
        need = 4 * params + 8 * largest if isinstance(tensors, Layered) else 8 * params
        memory.check(need, f"the model of {p}", "sample on a machine with more memory")
        # every parameter is written below; the grads, never written here,
        # stay unmapped address space
        model = _core.RxPtModel(config, init=False)
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {p} holds an unusable model config ({e})") from None
    except MemoryTooSmall as e:
        raise CheckpointError(str(e)) from None
    if adapters_of(tensors):   # a LoRA run: the model it trained, merged
        tensors = without_adapters(tensors, run_alpha(state, p))
    load_params(model, tensors, f"checkpoint {p}")
    load_states(model, tensors.get(STATE_KEY), f"checkpoint {p}")
    return model, tok


@dataclass(frozen=True)
class Sampling:
    """How each new token is drawn, checked on construction (SampleError).

    temperature, top_k, top_p: softmax(logits / temperature) kept to the
    top_k most likely tokens (0: all), then to the smallest set of the most
    likely whose probability reaches top_p (1: all), renormalised;
    temperature 0 picks the argmax. Before that, as the ``rwkv`` package's
    PIPELINE.generate does: every id of token_ban gets logit -inf, and each
    id already generated has its logit lowered by alpha_presence +
    alpha_frequency * its count, where the counts decay by alpha_decay each
    step and a token whose text lies in " \\t0123456789" counts 0. A
    sampled id of token_stop ends the generation unwritten; so does the
    text reaching one of `stop` (the text before it is written, the stop
    string not).
    """
    temperature: float = 1.0
    top_p: float = 0.9
    top_k: int = 0
    alpha_presence: float = 0.0
    alpha_frequency: float = 0.0
    alpha_decay: float = 0.996   # the rwkv package's default
    token_ban: Sequence[int] = ()
    token_stop: Sequence[int] = ()
    stop: str | Sequence[str] = ()   # one string or several; held as a tuple

    def __post_init__(self) -> None:
        for name in ("temperature", "alpha_presence", "alpha_frequency"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise SampleError(f"{name} must be a finite number >= 0, got {v!r}")
        for name in ("top_p", "alpha_decay"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v <= 1):
                raise SampleError(f"{name} must be a number in [0, 1], got {v!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SampleError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        # one stop string may come alone, as in the OpenAI API; lists as tuples
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(t, str) or not t for t in stop):
            raise SampleError("a stop string must be non-empty text")
        object.__setattr__(self, "stop", stop)
        for name in ("token_ban", "token_stop"):
            ids = tuple(getattr(self, name))
            if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0
                   for t in ids):
                raise SampleError(f"{name} must hold token ids (integers >= 0)")
            object.__setattr__(self, name, tuple(int(t) for t in ids))


def sample_token(logits: np.ndarray, rng: np.random.Generator, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0) -> int:
    """A token id drawn from logits (vocab,) as Sampling describes."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature <= 0:
        return int(np.argmax(logits))
    # shifted before the division: a tiny temperature sends the gaps to
    # -inf (probability 0), never inf - inf = NaN
    z = (logits - logits.max()) / temperature
    p = np.exp(z)
    p /= p.sum()
    if top_p < 1.0 or 0 < top_k < len(p):
        order = np.argsort(-p, kind="stable")
        if 0 < top_k < len(p):
            order = order[:top_k]
        cum = np.cumsum(p[order]) / p[order].sum()
        keep = order[: int(np.searchsorted(cum, top_p)) + 1] if top_p < 1.0 else order
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    return int(rng.choice(len(p), p=p))


class Penalties:
    """The rwkv package's repetition penalties (Sampling): the decayed
    count of every generated id, subtracted from its logit."""

    WEIGHTLESS = " \t0123456789"   # a token whose text lies in this counts 0

    def __init__(self, s: Sampling) -> None:
        self.s = s
        self.count: dict[int, float] = {}

    def apply(self, logits: np.ndarray) -> np.ndarray:
        if not (self.s.token_ban or self.count):
            return logits
        out = np.array(logits, dtype=np.float32)
        if self.s.token_ban:
            out[[t for t in self.s.token_ban if 0 <= t < len(out)]] = -np.inf
        if self.count:
            ids = np.fromiter(self.count, np.int64, len(self.count))
            n = np.fromiter(self.count.values(), np.float64, len(self.count))
            out[ids] -= (self.s.alpha_presence + n * self.s.alpha_frequency).astype(np.float32)
        return out

    def add(self, token: int, text: str) -> None:
        for t in self.count:
            self.count[t] *= self.s.alpha_decay
        self.count[token] = self.count.get(token, 0.0) + (0.0 if text in self.WEIGHTLESS else 1.0)


class StopText:
    """Holds back generated text that may be the start of a stop string:
    push() returns what can be written, and sets hit at a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.held = ""
        self.hit = False

    def push(self, text: str) -> str:
        self.held += text
        at = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if at:
            out, self.held, self.hit = self.held[:min(at)], "", True
            return out
        keep = max((k for s in self.stops for k in range(1, len(s))
                    if self.held.endswith(s[:k])), default=0)
        out = self.held[:len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


# Prompt tokens per recurrent call: the state carries across calls, so a
# long prompt costs the memory of one piece (the call's intermediates and
# its [piece, vocab] logits), not of the whole prompt.
PROMPT_PIECE = 512


class Session:
    """One recurrent state of a model: text is fed into it (in pieces of at
    most PROMPT_PIECE tokens, fewer at a large vocabulary: the head's chunk
    rows) and generated from it, one recurrent step a new token.
    max_positions: the positions a model with attention may reach (its
    key/value cache, allocated up front and checked against the memory);
    a model without attention carries a state of fixed size and has no bound."""

    def __init__(self, model: _core.RxPtModel, tokenizer: Tokenizer | None = None,
                 max_positions: int = 1, seed: int = 0, advice: str = "lower --context") -> None:
        self.model = model
        self.tok = tokenizer or ByteTokenizer()
        self.attends = model.config["n_attn_layer"] > 0
        self.max_positions = _cache_positions(model, max_positions, advice)
        self.state = _core.InferState(model, max_len=self.max_positions)
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.piece = min(PROMPT_PIECE, _core.head_chunk_rows(model.config["vocab_size"]))
        self.logits: np.ndarray | None = None
        self.pending: int | None = None   # the last generated id, not yet fed
        self.generated = b""              # the bytes of the ids generate() fed

    def feed(self, text: str | bytes) -> None:
        """Run text (after the pending generated id) through the state."""
        self.feed_ids(self.tok.encode(text) if len(text) else [])

    def feed_ids(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Run token ids (after the pending generated id) through the state."""
        ids = np.ascontiguousarray(tokens, dtype=np.int32)
        if self.pending is not None:
            ids = np.concatenate([np.array([self.pending], np.int32), ids])
            self.pending = None
        if self.attends and self.state.pos + len(ids) > self.max_positions:
            raise SampleError(f"the text reaches {self.state.pos + len(ids):,} positions, past "
                              f"the {self.max_positions:,} this model's attention cache holds; "
                              "raise --context or start again")
        for i in range(0, len(ids), self.piece):
            self.logits = self.state.forward(ids[i:i + self.piece])[-1].copy()

    def reset(self) -> None:
        self.state.reset()
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
            logits = _finite(self.state.forward(np.array([t], dtype=np.int32))[-1], i + 1)
            self.generated += raw
        tail = stops.push(dec.decode(b"", final=True)) + stops.flush()
        if tail and not stops.hit:
            yield tail


def generate(model: _core.RxPtModel, prompt: str | bytes, max_new_tokens: int = 200,
             temperature: float = 1.0, top_p: float = 0.9, seed: int = 0,
             tokenizer: Tokenizer | None = None, **sampling: Any) -> Iterator[str]:
    """Yield the decoded text of each new token after `prompt` (str or bytes).

    The prompt runs through the recurrent state in pieces (Session); each
    new token is one recurrent step. An empty prompt starts from a newline.
    tokenizer: the run's (load_run); None means bytes. sampling: the other
    fields of Sampling (top_k, alpha_presence, alpha_frequency, alpha_decay,
    token_ban, token_stop, stop), as the rwkv package's PIPELINE_ARGS
    names them.
    """
    s = Sampling(temperature=temperature, top_p=top_p, **sampling)
    tok = tokenizer or ByteTokenizer()
    ids = tok.encode(prompt) if len(prompt) else tok.encode("\n")
    if model.config["n_attn_layer"] and len(ids) + max_new_tokens > MAX_POSITIONS:
        raise SampleError(f"{len(ids)} prompt tokens + {max_new_tokens:,} new ones pass the "
                          f"{MAX_POSITIONS:,} positions a sequence of a model with attention "
                          "may hold; lower --max-new-tokens")
    session = Session(model, tok, len(ids) + max(max_new_tokens, 1), seed,
                      "shorten the prompt or lower --max-new-tokens")
    session.feed_ids(ids)
    yield from session.generate(max_new_tokens, s)


MAX_POSITIONS = 2 ** 31 - 1   # positions are int32 in the C API


def _cache_positions(model: _core.RxPtModel, n: int, advice: str) -> int:
    """The positions an InferState must hold for n tokens, checked:
    attention blocks keep every key and value (2 x n_attn_layer x n_embd
    floats a position, allocated up front); RWKV-7 blocks carry a state of
    fixed size, so a model without attention needs no cache at all."""
    c = model.config
    if c["n_attn_layer"] == 0:
        return 1
    if n > MAX_POSITIONS:
        raise SampleError(f"{n:,} positions pass the {MAX_POSITIONS:,} a sequence of a model "
                          f"with attention may hold; {advice}")
    memory.check(2 * 4 * c["n_attn_layer"] * c["n_embd"] * n,
                 f"the attention cache of {n:,} positions", advice)
    return n


def _finite(logits: np.ndarray, i: int) -> np.ndarray:
    """logits, when every one is finite; else SampleError: sampling from
    NaN would pick garbage or fail deep inside NumPy."""
    if not np.isfinite(logits).all():
        raise SampleError(f"the model's logits are not finite (NaN or inf) at new token {i}: "
                          "its weights do not make a usable model")
    return logits


# A reply ends at the blank line that closes a turn (the rendering of
# rwkvx_c.data.chat trains the model to write it) or where it starts a
# User: turn of its own.
CHAT_STOPS = ("\n\n", "\nUser:")
# what a reply's end adds past its generated ids (its last id re-read with
# "\n\n"); Session.feed checks the bound exactly
TURN_END_TOKENS = 3


class Chat:
    """A conversation in the chat format of rwkvx_c.data.chat, one state
    carried from turn to turn. say(text) feeds "User: TEXT\\n\\nAssistant:"
    and yields the reply, stopped at CHAT_STOPS (and s.stop); the state then
    holds the reply as the training data renders a turn, "REPLY\\n\\n" (the
    text the model wrote, the stop string replaced by the turn's end), so
    the next turn reads what a rendered conversation holds. context: the
    positions a model with attention may reach (its key/value cache)."""

    def __init__(self, model: _core.RxPtModel, tokenizer: Tokenizer | None, s: Sampling,
                 max_new_tokens: int, context: int, seed: int = 0,
                 system: str | None = None) -> None:
        self.session = Session(model, tokenizer, context, seed, "lower --context")
        self.s = replace(s, stop=tuple(s.stop) + CHAT_STOPS)
        self.max_new_tokens = max_new_tokens
        self.transcript = b""   # every byte the state has read
        if system and normalise(system):
            self._read(f"{ROLES['system']}: {normalise(system)}\n\n".encode())

    def _read(self, text: bytes) -> None:
        self.session.feed(text)
        self.transcript += text

    def say(self, text: str) -> Iterator[str]:
        """Yield the reply to the user's text, piece by piece."""
        self._read(f"{ROLES['user']}: {normalise(text)}\n\n{ROLES['assistant']}:".encode(
            "utf-8", "surrogatepass"))
        st = self.session
        # a reply at its longest, and the turn's end after it, must fit the cache
        if st.attends and \
                st.state.pos + self.max_new_tokens + TURN_END_TOKENS > st.max_positions:
            raise SampleError(f"the conversation holds {st.state.pos:,} positions; a reply of "
                              f"up to {self.max_new_tokens:,} tokens would pass the "
                              f"{st.max_positions:,} of --context: raise it or start again")
        reply = []
        for piece in self.session.generate(self.max_new_tokens, self.s):
            reply.append(piece)
            yield piece
        turn = "".join(reply).encode("utf-8", "surrogatepass") + b"\n\n"
        fed = self.session.generated
        self.session.pending = None   # the id that ended the reply, or one past it
        if turn.startswith(fed):
            self.session.feed(turn[len(fed):])
        else:   # the state read part of a stop string the turn does not hold
            self.session.reset()
            self.session.feed(self.transcript + turn)
        self.transcript += turn
