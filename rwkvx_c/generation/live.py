"""The live engine: requests that arrive at any time share one batch
(the server's core, rwkvx_c.server; docs/training.md §Serving).

One scheduler thread owns a GenState of B slots and steps every active slot
together, as run_requests does for a list known up front: a request takes a
free slot as soon as one is free (it joins while others decode), its prompt
is read in pieces of at most PROMPT_PIECE tokens in the same steps as the
others' single decoded tokens, and a finished (or cancelled) sequence frees
its slot for the next in line. Each request has its own Sampling (drawn
with the rwkv package's penalties, Penalties, the rows of one Sampling
drawn together by sample_rows) and its own random stream, so its tokens
depend on its seed and the model, not on what shares its steps; the
GenState step runs without the GIL, so the HTTP threads stay responsive
while the model computes. Each request's text is delivered piece by
piece through its own queue (LiveRequest.events).
"""
from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass, field

import numpy as np

from rwkvx_c import _core
from rwkvx_c.data.tokenizers import Tokenizer
from rwkvx_c.errors import SampleError
from rwkvx_c.generation.engine import (
    PROMPT_PIECE,
    Completion,
    _Seq,
    cache_positions,
    plan_step,
)
from rwkvx_c.generation.sampling import Penalties, Sampling, sample_rows

__all__ = ["LiveEngine", "LiveRequest"]


@dataclass
class LiveRequest:
    """One sequence to generate: its prompt ids, sampling, most new tokens
    and seed. events yields ("text", str) pieces, then ("done", Completion)
    or ("error", message); cancel() frees its slot at the next step."""
    ids: np.ndarray
    sampling: Sampling
    max_new_tokens: int
    seed: int = 0
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


class _Active:
    """A slot's request, its sequence state and penalties."""

    def __init__(self, req: LiveRequest, vocab: int) -> None:
        self.req = req
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([req.seed, 0, 0])))
        self.seq = _Seq(Completion(0, 0), req.max_new_tokens, req.sampling.stop, rng,
                        np.ascontiguousarray(req.ids, np.int32))
        s = req.sampling   # penalties kept only where they change a logit
        self.pen = Penalties(s) if s.penalised or s.token_ban else None


class LiveEngine:
    """The scheduler thread over model's GenState of `slots` slots; max_len:
    the positions a sequence may reach (the attention cache of a hybrid).
    submit() queues a request; close() stops the thread (requests still
    running end with an error event). peak: the most sequences one step
    has moved, for a test to see requests share a batch."""

    def __init__(self, model: _core.RxPtModel, tokenizer: Tokenizer, slots: int = 8,
                 max_len: int = 4096) -> None:
        V = model.config["vocab_size"]
        self.tok, self.vocab = tokenizer, V
        self.piece = min(PROMPT_PIECE, _core.head_chunk_rows(V))
        self.max_len = cache_positions(model, max_len, slots, "lower --context or --slots")
        self.context = max_len
        self.g = _core.GenState(model, slots, max_len=self.max_len,
                                max_tokens=self.piece + slots)
        self.slots: list[_Active | None] = [None] * slots
        self.waiting: collections.deque[LiveRequest] = collections.deque()
        self.cond = threading.Condition()
        self.closed = False
        self.peak = 0
        self.error: str | None = None
        self.thread = threading.Thread(target=self._loop, name="rwkvx-scheduler", daemon=True)
        self.thread.start()

    def submit(self, req: LiveRequest) -> LiveRequest:
        """Queue req (SampleError when it cannot fit the context or the
        engine stopped); its events arrive on req.events."""
        if len(req.ids) < 1 or req.max_new_tokens < 1:
            raise SampleError("a request needs at least one prompt token and one new token")
        if self.g.max_len > 1 and len(req.ids) + req.max_new_tokens > self.context:
            raise SampleError(f"{len(req.ids)} prompt tokens + {req.max_new_tokens} new ones "
                              f"pass the server's context of {self.context} positions")
        with self.cond:
            if self.closed:
                raise SampleError(self.error or "the server is stopping")
            self.waiting.append(req)
            self.cond.notify()
        return req

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join(timeout=10)

    def _admit(self) -> None:
        """Waiting requests into free slots (called with the lock held)."""
        for k, a in enumerate(self.slots):
            if a is None and self.waiting:
                req = self.waiting.popleft()
                if req.cancelled.is_set():
                    continue
                self.g.reset(k)
                self.slots[k] = _Active(req, self.vocab)

    def _loop(self) -> None:
        try:
            while True:
                with self.cond:
                    while not self.closed and not self.waiting and \
                            not any(a is not None for a in self.slots):
                        self.cond.wait()
                    if self.closed:
                        break
                    self._admit()
                self._step()
        except Exception as e:  # noqa: BLE001 -- every waiting client must hear of it
            self.error = f"the generation engine stopped: {type(e).__name__}: {e}"
        with self.cond:
            self.closed = True
            why = self.error or "the server is stopping"
            for a in self.slots:
                if a is not None:
                    a.req.events.put(("error", why))
            while self.waiting:
                self.waiting.popleft().events.put(("error", why))
            self.slots = [None] * len(self.slots)

    def _step(self) -> None:
        """One GenState step over every active slot: the decoding slots (one
        token each) first, then prompt pieces while they fit the budget."""
        for k, a in enumerate(self.slots):
            if a is not None and a.req.cancelled.is_set():
                self.slots[k] = None
        live = [k for k, a in enumerate(self.slots) if a is not None]
        if not live:
            return
        moving, counts, tokens = plan_step({k: self._seq(k).todo for k in live}, self.piece,
                                           self.g.max_tokens)
        logits = self.g.step(moving, counts, tokens)
        self.peak = max(self.peak, len(moving))
        if not np.isfinite(logits).all():
            raise SampleError("the model's logits are not finite (NaN or inf): its weights do "
                              "not make a usable model")
        groups: dict[Sampling, list[tuple[int, np.ndarray]]] = {}
        for r, (k, c) in enumerate(zip(moving, counts)):
            a = self.slots[k]
            assert a is not None
            a.seq.todo = a.seq.todo[c:]
            if not len(a.seq.todo):   # its prompt read, or its last token: it draws
                x = logits[r] if a.pen is None else a.pen.apply(logits[r])
                groups.setdefault(a.req.sampling, []).append((k, x))
        for s, rows in groups.items():   # one vectorised draw per sampling
            slots = [k for k, _ in rows]
            ids = sample_rows(np.stack([x for _, x in rows]), [self._seq(k).rng for k in slots],
                              s.temperature, s.top_p, s.top_k)
            for k, t in zip(slots, ids.tolist()):
                self._take(k, int(t))

    def _seq(self, k: int) -> _Seq:
        a = self.slots[k]
        assert a is not None
        return a.seq

    def _take(self, k: int, t: int) -> None:
        """Slot k drew token t: deliver its text, end or go on."""
        a = self.slots[k]
        assert a is not None
        q, s = a.seq, a.req.sampling
        q.out.token_ids.append(t)
        if t in s.token_stop:
            return self._finish(k, "stop_id")
        raw_t = self.tok.decode([t]) if t < self.tok.vocab_size else b""
        if a.pen is not None:
            a.pen.add(t, raw_t.decode("utf-8", "replace"))
        text = q.stops.push(q.dec.decode(raw_t))
        if text:
            q.parts.append(text)
            a.req.events.put(("text", text))
        if q.stops.hit:
            self._finish(k, "stop")
        elif len(q.out.token_ids) == q.max_new:
            self._finish(k, "length")
        else:
            q.todo = np.array([t], np.int32)

    def _finish(self, k: int, why: str) -> None:
        a = self.slots[k]
        assert a is not None
        q = a.seq
        before = len(q.parts)
        q.finish(why)
        for tail in q.parts[before:]:   # the decoder's and stop filter's held-back text
            a.req.events.put(("text", tail))
        a.req.events.put(("done", q.out))
        self.slots[k] = None
