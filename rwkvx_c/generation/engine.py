"""Batched generation: many sequences of one model advanced together.

A GenState holds B slots, each a sequence's recurrent state; one step
advances any set of them at once (a slot by a piece of its prompt, or by
the one token it last drew), so every projection is one GEMM over all the
rows the step moves. The scheduler here keeps up to B slots busy: a request
(a prompt and its n samples) takes free slots, its prompt is read once in
pieces of at most `piece` tokens and its state copied into the slots of its
other samples (GenState.copy); a finished sequence frees its slot for the
next request. The draw is vectorised over the rows that sample in a step
(sampling.draw_rows, in C), each sequence with its own random stream seeded
from (seed, prompt index, sample index), so a sequence's tokens do not
depend on what else shares its batch.
"""
from __future__ import annotations

import codecs
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from rwkvx_c import _core
from rwkvx_c.data.tokenizers import ByteTokenizer, Tokenizer
from rwkvx_c.errors import SampleError
from rwkvx_c.generation.sampling import (
    WEIGHTLESS,
    RowPenalties,
    Sampling,
    StopText,
    draw_rows,
)
from rwkvx_c.model import memory

__all__ = ["Request", "Completion", "STOP_REASONS", "run_requests", "generate",
           "DEFAULT_BATCH", "PROMPT_PIECE", "MAX_POSITIONS", "cache_positions"]

# why a sequence ended: max_new_tokens reached, a stop string, a stop id
STOP_REASONS = ("length", "stop", "stop_id")
DEFAULT_BATCH = 64
# Prompt tokens a slot reads in one step: the state carries across steps,
# so a long prompt costs the memory of one piece
PROMPT_PIECE = 512
MAX_POSITIONS = 2 ** 31 - 1   # positions are int32 in the C API


@dataclass(frozen=True)
class Request:
    """One prompt (token ids) and how many samples of it to draw; stop and
    max_new_tokens: this request's own, over the call's (None: the call's);
    stream: the index its samples' random streams are seeded with (None:
    its index in the call), so that a caller splitting its requests over
    several calls (or processes) draws the same samples."""
    ids: Sequence[int] | np.ndarray
    n: int = 1
    max_new_tokens: int | None = None
    stop: Sequence[str] | None = None
    stream: int | None = None


@dataclass
class Completion:
    """One sample. text: the decoded new tokens (a stop string and a stop id
    not written); token_ids: every id drawn, the stop id included;
    logprobs: each drawn id's log-probability under the model
    (log_softmax of its logits, before temperature, penalties, top-k/p);
    stop_reason: one of STOP_REASONS."""
    prompt_index: int
    sample_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str = "length"


class _Seq:
    """A slot's sequence: what it has still to read, and its output so far."""

    def __init__(self, out: Completion, max_new: int, stops: Sequence[str],
                 rng: np.random.Generator, todo: np.ndarray) -> None:
        self.out, self.max_new = out, max_new
        self.stops = StopText(stops)
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.rng, self.todo = rng, todo
        self.parts: list[str] = []
        self.forks: list[int] = []   # slots waiting for this prompt's state

    def finish(self, why: str) -> None:
        if why == "length":
            tail = self.stops.push(self.dec.decode(b"", final=True)) + self.stops.flush()
            if tail and not self.stops.hit:
                self.parts.append(tail)
        self.out.text, self.out.stop_reason = "".join(self.parts), why


def cache_positions(model: _core.RxPtModel, n: int, slots: int, advice: str) -> int:
    """The positions each of `slots` slots must hold for n tokens, checked:
    attention blocks keep every key and value (2 x n_attn_layer x n_embd
    floats a position, allocated up front); RWKV-7 blocks carry a state of
    fixed size, so a model without attention needs no cache at all."""
    c = model.config
    if c["n_attn_layer"] == 0:
        return 1
    if n > MAX_POSITIONS:
        raise SampleError(f"{n:,} positions pass the {MAX_POSITIONS:,} a sequence of a model "
                          f"with attention may hold; {advice}")
    many = f"{slots} sequences x " if slots > 1 else ""
    memory.check(2 * 4 * c["n_attn_layer"] * c["n_embd"] * n * slots,
                 f"the attention cache of {many}{n:,} positions", advice)
    return n


def plan_step(todo: Mapping[int, np.ndarray], piece: int, budget: int
              ) -> tuple[list[int], list[int], np.ndarray]:
    """(slots, counts, tokens) of one GenState step over todo ({slot: the
    tokens it has still to read}): the decoding slots (one token each) first,
    then prompt pieces of at most piece tokens while the step's budget holds
    them; a piece is never cut shorter to fit, so a prompt's pieces are the
    same whatever shares the step."""
    moving: list[int] = []
    counts: list[int] = []
    used = 0
    for k in sorted(todo, key=lambda k: len(todo[k]) > 1):
        c = min(len(todo[k]), piece)
        if used + c <= budget:
            moving.append(k)
            counts.append(c)
            used += c
    return moving, counts, np.concatenate([todo[k][:c] for k, c in zip(moving, counts)])


def run_requests(model: _core.RxPtModel, requests: Sequence[Request], s: Sampling,
                 max_new_tokens: int, seed: int = 0, tokenizer: Tokenizer | None = None,
                 batch_size: int = DEFAULT_BATCH,
                 progress: Callable[[int], None] | None = None,
                 fast_decode: bool = False) -> list[list[Completion]]:
    """Every request's samples (a list per request, by sample index), drawn
    with s in up to batch_size slots at once. progress(k): k new tokens.
    fast_decode: GenState's (docs/training.md §Fast decode)."""
    tok = tokenizer or ByteTokenizer()
    if max_new_tokens < 1 or batch_size < 1:
        raise SampleError("max_new_tokens and batch_size must be at least 1")
    for r in requests:
        if not len(r.ids) or r.n < 1:
            raise SampleError("a request needs at least one prompt token and one sample")
    total = sum(r.n for r in requests)
    if not total:
        return []
    B = min(batch_size, total)
    V = model.config["vocab_size"]
    piece = min(PROMPT_PIECE, _core.head_chunk_rows(V))
    longest = max(len(r.ids) + (r.max_new_tokens or max_new_tokens) for r in requests)
    max_len = cache_positions(model, longest, B, "shorten the prompts, lower "
                              "--max-new-tokens or the batch")
    slots = _core.GenState(model, B, max_len=max_len, max_tokens=piece + B,
                           fast_decode=fast_decode)
    outs = [[Completion(i, j) for j in range(r.n)] for i, r in enumerate(requests)]
    _Scheduler(slots, requests, outs, s, max_new_tokens, seed, tok, piece, progress).run()
    return outs


class _Scheduler:
    def __init__(self, slots: _core.GenState, requests: Sequence[Request],
                 outs: list[list[Completion]], s: Sampling, max_new: int, seed: int,
                 tok: Tokenizer, piece: int,
                 progress: Callable[[int], None] | None) -> None:
        self.g, self.reqs, self.outs, self.s = slots, requests, outs, s
        self.max_new, self.seed, self.tok, self.piece = max_new, seed, tok, piece
        self.progress = progress
        self.B = slots.n_slots
        self.pen = RowPenalties(s, self.B, slots.vocab_size)
        self.seqs: list[_Seq | None] = [None] * self.B
        self.queue = [(i, 0) for i in range(len(requests))]   # (request, next sample)
        self.stop_ids = np.array(s.token_stop, np.int64)

    def _seq(self, slot: int, i: int, j: int, todo: np.ndarray) -> _Seq:
        r = self.reqs[i]
        k = i if r.stream is None else r.stream
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, k, j])))
        stops = tuple(self.s.stop) + tuple(r.stop or ())
        q = _Seq(self.outs[i][j], r.max_new_tokens or self.max_new, stops, rng, todo)
        self.g.reset(slot)
        self.pen.reset(slot)
        self.seqs[slot] = q
        return q

    def _admit(self) -> None:
        """Free slots to the queue's requests: a prompt's first free slot
        reads it, the others wait for its state (forks)."""
        free = [k for k in range(self.B) if self.seqs[k] is None]
        while free and self.queue:
            i, j = self.queue[0]
            r = self.reqs[i]
            take = min(r.n - j, len(free))
            lead, rest = free[0], free[1:take]
            free = free[take:]
            q = self._seq(lead, i, j, np.ascontiguousarray(r.ids, np.int32))
            for d, k in enumerate(rest, 1):
                self._seq(k, i, j + d, np.zeros(0, np.int32))
                q.forks.append(k)
            if j + take < r.n:
                self.queue[0] = (i, j + take)
            else:
                self.queue.pop(0)

    def run(self) -> None:
        while self.queue or any(q is not None for q in self.seqs):
            self._admit()
            moving, counts, tokens = plan_step(
                {k: q.todo for k, q in enumerate(self.seqs) if q is not None and len(q.todo)},
                self.piece, self.g.max_tokens)
            logits = self.g.step(moving, counts, tokens)
            ready: list[int] = []
            rows: list[int] = []
            for r, (k, c) in enumerate(zip(moving, counts)):
                q = self.seqs[k]
                assert q is not None
                q.todo = q.todo[c:]
                if not len(q.todo):
                    ready.append(k)
                    rows.append(r)
                    for f in q.forks:   # the prompt's state and logits to its other samples
                        self.g.copy(f, k)
                        ready.append(f)
                        rows.append(r)
                    q.forks = []
            if ready:   # every row of the step draws once, in order: its logits as they are
                whole = rows == list(range(len(logits)))
                self._sample(np.array(ready), logits if whole else logits[np.array(rows)])

    def _sample(self, ready: np.ndarray, raw: np.ndarray) -> None:
        s = self.s
        seqs = [self.seqs[k] for k in ready]
        x = self.pen.apply(raw, ready)
        ids, lps = draw_rows(x, raw, [q.rng for q in seqs if q is not None], s.temperature,
                             s.top_p, s.top_k)
        weights = np.ones(len(ready))
        new = 0
        for r, (k, q) in enumerate(zip(ready, seqs)):
            assert q is not None
            t = int(ids[r])
            q.out.token_ids.append(t)
            q.out.logprobs.append(float(lps[r]))
            new += 1
            if t in s.token_stop:
                q.finish("stop_id")
                self.seqs[k] = None
                continue
            raw_t = self.tok.decode([t]) if t < self.tok.vocab_size else b""
            weights[r] = 0.0 if raw_t.decode("utf-8", "replace") in WEIGHTLESS else 1.0
            text = q.stops.push(q.dec.decode(raw_t))
            if text:
                q.parts.append(text)
            if q.stops.hit:
                q.finish("stop")
                self.seqs[k] = None
            elif len(q.out.token_ids) == q.max_new:
                q.finish("length")
                self.seqs[k] = None
            else:
                q.todo = np.array([t], np.int32)
        self.pen.add(ready, ids, weights)
        if self.progress is not None:
            self.progress(new)


def generate(model: _core.RxPtModel, prompts: str | bytes | Sequence[str | bytes],
             n: int = 1, max_new_tokens: int = 200, sampling: Sampling | None = None,
             seed: int = 0, tokenizer: Tokenizer | None = None,
             batch_size: int = DEFAULT_BATCH,
             progress: Callable[[int], None] | None = None,
             fast_decode: bool = False) -> list[Completion]:
    """n samples of each prompt (one str or bytes, or a list of them), drawn
    in batches of up to batch_size sequences: the Completions in order of
    prompt, then sample. An empty prompt starts from a newline. sampling:
    Sampling() when None; tokenizer: the run's (load_run), None means
    bytes. A sample's text depends on (seed, its prompt's index, its
    sample index) and the model, not on batch_size. fast_decode: the
    products over a Q8_0 or Q4_0 base in integer dot products, faster and
    no longer the training forward's logits (docs/training.md §Fast
    decode); still independent of batch_size."""
    tok = tokenizer or ByteTokenizer()
    one = isinstance(prompts, (str, bytes))
    items = [prompts] if one else list(prompts)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SampleError(f"n must be an integer >= 1, got {n!r}")
    reqs = []
    for p in items:
        if not isinstance(p, (str, bytes)):
            raise SampleError(f"a prompt must be str or bytes, got {type(p).__name__}")
        reqs.append(Request(tok.encode(p) if len(p) else tok.encode("\n"), n))
    out = run_requests(model, reqs, sampling or Sampling(), max_new_tokens, seed, tok,
                       batch_size, progress, fast_decode)
    return [c for group in out for c in group]
