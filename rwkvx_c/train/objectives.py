"""Preference objectives (docs/maths.md §Preference tuning): DPO's sigmoid
loss, IPO and the reference-free SimPO over pairs of summed completion
log-probabilities, and the step that trains on them.

One step of ``--objective dpo|ipo|simpo``: the batch's B/2 pairs as B
sequences (the chosen ones, then the rejected ones) -> one forward ->
each position's cross-entropy (RxPtModel.row_losses) -> each sequence's
summed log-probability pi = -sum of its completion's row losses -> the
objective's loss and its grad dL/dpi in float64 here -> one backward whose
cross-entropy grad of every row of sequence b is scaled by -dL/dpi_b
(RxPtModel.backward_rows). The reference's log-probabilities are computed
once, before the first step, with the same code: the model with its
adapters off (--tune lora), else as it is at step 0 (the --init-from
weights, a state tune's states as it starts them), or --ref-from's model;
they are kept in the run folder
(REF_FILE) and a resumed run reads them back.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rwkvx_c import _core
from rwkvx_c.data.chat import IGNORE
from rwkvx_c.data.preferences import Pairs, PairSampler
from rwkvx_c.errors import CheckpointError, ConfigError, TrainError
from rwkvx_c.interop.source import read_run
from rwkvx_c.model.lora import adapters_of, adapters_off, run_alpha, without_adapters
from rwkvx_c.model.weights import load_params, load_states
from rwkvx_c.run.checkpoint import STATE_KEY
from rwkvx_c.run.rundir import REFERENCE, Row, checkpoint_path
from rwkvx_c.util.atomic import replace_with

if TYPE_CHECKING:
    from rwkvx_c.run.rundir import RunDir

__all__ = ["OBJECTIVES", "PREFERENCES", "REFERENCE_FREE", "REF_FILE", "PairLoss", "pair_loss",
           "pair_logps", "reference_logps", "PreferenceStep", "metrics"]

OBJECTIVES = ("lm", "dpo", "ipo", "simpo", "grpo")
PREFERENCES = ("dpo", "ipo", "simpo")
REFERENCE_FREE = ("simpo",)
LENGTH_NORMALISED = ("ipo", "simpo")   # on the mean log-probability per completion token
REF_FILE = REFERENCE   # in the run folder: (n_pairs, 2) float64, the train pairs, then val



@dataclass
class PairLoss:
    """The objective over P pairs: losses (P,), the grads of their mean on
    each pair's summed policy log-probabilities (grad_chosen, grad_rejected),
    and TRL's implicit rewards (P,) each."""
    losses: np.ndarray
    grad_chosen: np.ndarray
    grad_rejected: np.ndarray
    rewards_chosen: np.ndarray
    rewards_rejected: np.ndarray


def _log_sigmoid(z: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -z)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return np.exp(_log_sigmoid(z))


def pair_loss(kind: str, beta: float, pc: np.ndarray, pr: np.ndarray, rc: np.ndarray,
              rr: np.ndarray, nc: np.ndarray, nr: np.ndarray, *, smoothing: float = 0.0,
              gamma: float = 0.5) -> PairLoss:
    """The objective `kind` over P pairs (docs/maths.md §Preference
    tuning). pc, pr: the policy's summed log-probabilities of the chosen and
    rejected completions; rc, rr: the reference's (unused by SimPO); nc, nr:
    the completions' token counts. smoothing: DPO's label smoothing eps;
    gamma: SimPO's target margin (TRL's simpo_gamma)."""
    pc, pr, rc, rr = (np.asarray(a, np.float64) for a in (pc, pr, rc, rr))
    nc, nr = np.asarray(nc, np.float64), np.asarray(nr, np.float64)
    P = len(pc)
    if kind in LENGTH_NORMALISED:   # TRL averages these over the completion's tokens
        sc, sr = 1.0 / nc, 1.0 / nr
    else:
        sc, sr = np.ones(P), np.ones(P)
    if kind == "simpo":
        h = pc * sc - pr * sr - gamma / beta
        rew_c, rew_r = beta * pc * sc, beta * pr * sr
    else:
        h = (pc * sc - rc * sc) - (pr * sr - rr * sr)
        rew_c, rew_r = beta * (pc - rc), beta * (pr - rr)   # TRL: unnormalised for IPO too
    if kind == "ipo":
        d = h - 1.0 / (2.0 * beta)
        losses, dh = d * d, 2.0 * d
    elif kind in ("dpo", "simpo"):
        z = beta * h
        losses = -(1.0 - smoothing) * _log_sigmoid(z) - smoothing * _log_sigmoid(-z)
        dh = beta * (-(1.0 - smoothing) * _sigmoid(-z) + smoothing * _sigmoid(z))
    else:
        raise ValueError(f"unknown preference objective {kind!r}")
    return PairLoss(losses, dh * sc / P, -dh * sr / P, rew_c, rew_r)


def metrics(res: PairLoss, pc: np.ndarray, pr: np.ndarray, prefix: str = "") -> Row:
    """TRL's names: loss, rewards/{chosen,rejected,accuracies,margins},
    logps/{chosen,rejected}, each the mean over the pairs."""
    rc, rr = res.rewards_chosen, res.rewards_rejected
    return {prefix + "loss": float(res.losses.mean()),
            prefix + "rewards/chosen": float(rc.mean()),
            prefix + "rewards/rejected": float(rr.mean()),
            prefix + "rewards/accuracies": float((rc > rr).mean()),
            prefix + "rewards/margins": float((rc - rr).mean()),
            prefix + "logps/chosen": float(np.mean(pc)),
            prefix + "logps/rejected": float(np.mean(pr))}


def _batches(n: int, pairs: int) -> list[np.ndarray]:
    """Index batches of `pairs` over range(n), the last padded with pair 0
    (the model keeps its batch shape: no new activations)."""
    out = []
    for i in range(0, n, pairs):
        idx = np.arange(i, min(i + pairs, n))
        out.append(np.concatenate([idx, np.zeros(pairs - len(idx), np.int64)]))
    return out


def pair_logps(model: _core.RxPtModel, p: Pairs, pairs: int) -> np.ndarray:
    """(n, 2) summed log-probabilities of every pair's chosen and rejected
    completion under model, `pairs` pairs (2*pairs sequences) a forward."""
    n = len(p)
    out = np.empty((n, 2), np.float64)
    rl = np.empty((2 * pairs, p.x.shape[2]), np.float64)
    for idx in _batches(n, pairs):
        x = np.ascontiguousarray(p.x[idx].transpose(1, 0, 2).reshape(2 * pairs, -1))
        y = np.ascontiguousarray(p.y[idx].transpose(1, 0, 2).reshape(2 * pairs, -1))
        model.forward(x, return_logits=False)
        model.row_losses(y, IGNORE, out=rl)
        lp = -rl.sum(axis=1)
        keep = min(pairs, n - int(idx[0]))
        out[idx[:keep], 0] = lp[:keep]
        out[idx[:keep], 1] = lp[pairs:pairs + keep]
    return out


def reference_logps(model: _core.RxPtModel, p: Pairs, pairs: int, tune: str) -> np.ndarray:
    """pair_logps of the reference: model with its LoRA adapters off for the
    call (tune "lora": the base, bit for bit, and back on after it); any
    other tune, model as it is (before the first step: the --init-from
    weights, a state tune's the states it starts from)."""
    if tune == "lora":
        with adapters_off(model):
            return pair_logps(model, p, pairs)
    return pair_logps(model, p, pairs)


def checkpoint_model(path: str, vocab: int) -> _core.RxPtModel:
    """The model of the run folder or checkpoint at path (--ref-from): a
    LoRA run's with its adapters merged, a state run's with its initial
    states, a fine-tune's base (which its checkpoint names) read under what
    it holds itself. TrainError for one that cannot be read or has another
    vocabulary than vocab."""
    p = checkpoint_path(path)
    try:
        tensors, config, state = read_run(p, None, TrainError)
        if adapters_of(tensors):
            tensors = without_adapters(tensors, run_alpha(state, p))
        model = _core.RxPtModel(config)
    except (CheckpointError, ConfigError, OSError) as e:
        raise TrainError(f"--ref-from {path}: {e} (a run folder or checkpoint; import a .pth "
                         "with rwkvx-c import first)") from None
    if config.get("vocab_size") != vocab:
        raise TrainError(f"--ref-from {path} has a vocabulary of {config.get('vocab_size')} "
                         f"ids, the model {vocab}: the reference must read the same tokens")
    load_params(model, tensors, f"--ref-from {path}", TrainError)
    load_states(model, tensors.get(STATE_KEY), f"--ref-from {path}", TrainError)
    return model


class PreferenceStep:
    """The training step and the evaluation of a preference objective over
    the train and val pairs, with the reference's log-probabilities (None
    for a reference-free objective) and buffers made once: a step
    allocates nothing in the C core."""

    def __init__(self, kind: str, beta: float, smoothing: float, train: Pairs, val: Pairs,
                 batch: int, seed: int, ref: np.ndarray | None = None) -> None:
        if batch % 2:
            raise TrainError(f"--batch {batch} must be even with a preference objective: "
                             "each pair is two sequences")
        self.kind, self.beta, self.smoothing = kind, beta, smoothing
        self.train, self.val, self.pairs = train, val, batch // 2
        self.ref = ref
        self.sampler = PairSampler(len(train), self.pairs, seed)
        T = train.x.shape[2]
        self._x = np.empty((batch, T), np.int32)
        self._y = np.empty((batch, T), np.int32)
        self._w = np.empty((batch, T), np.float64)
        self._rl = np.empty((batch, T), np.float64)

    def _loss(self, pol: np.ndarray, idx: np.ndarray, p: Pairs, ref: np.ndarray | None
              ) -> PairLoss:
        P = len(idx)
        rc = ref[idx, 0] if ref is not None else np.zeros(P)
        rr = ref[idx, 1] if ref is not None else np.zeros(P)
        return pair_loss(self.kind, self.beta, pol[:P], pol[P:], rc, rr, p.n_tokens[idx, 0],
                         p.n_tokens[idx, 1], smoothing=self.smoothing)

    def step(self, model: _core.RxPtModel) -> tuple[float, Row, int]:
        """One forward and backward over the next batch of pairs: (loss,
        TRL's metrics, tokens). The grads are left in the model's arenas."""
        idx = self.sampler.next_indices()
        P, t = self.pairs, self.train
        self._x[:P], self._x[P:] = t.x[idx, 0], t.x[idx, 1]
        self._y[:P], self._y[P:] = t.y[idx, 0], t.y[idx, 1]
        model.forward(self._x, return_logits=False)
        model.row_losses(self._y, IGNORE, out=self._rl)
        pol = -self._rl.sum(axis=1)
        res = self._loss(pol, idx, t, self.ref)
        # L's grad on row t of sequence b is dL/dpi_b * dpi_b/dloss_t = -dL/dpi_b
        self._w[:P] = -res.grad_chosen[:, None]
        self._w[P:] = -res.grad_rejected[:, None]
        model.backward_rows(self._y, self._w, IGNORE, out=self._rl)
        row = metrics(res, pol[:P], pol[P:])
        return row.pop("loss"), row, self._x.size

    def evaluate(self, model: _core.RxPtModel) -> Row:
        """TRL's metrics over the val pairs, named eval_*, with val_loss the
        mean loss."""
        n = len(self.train)
        pol = pair_logps(model, self.val, self.pairs)
        ref = self.ref[n:] if self.ref is not None else None
        idx = np.arange(len(self.val))
        both = np.concatenate([pol[:, 0], pol[:, 1]])
        row = metrics(self._loss(both, idx, self.val, ref), pol[:, 0], pol[:, 1], "eval_")
        return {"val_loss": row.pop("eval_loss"), **row}

    def set_reference(self, model: _core.RxPtModel, tune: str, run_dir: RunDir | None,
                      resumed: bool, ref_from: str | None = None) -> None:
        """The reference's log-probabilities of the train then val pairs:
        read from the run folder's REF_FILE when there (a resumed run must
        find it), else computed and kept there: from ref_from's model (made
        for the call and freed after it) when given, else from model as it
        is now (reference_logps)."""
        if self.kind in REFERENCE_FREE:
            return
        path = run_dir.reference_path if run_dir is not None else None
        if resumed and (path is None or not os.path.exists(path)):
            raise TrainError(f"the run folder lacks {REF_FILE}, the reference's "
                             "log-probabilities its run trained against; start a new run")
        both = Pairs(np.concatenate([self.train.x, self.val.x]),
                     np.concatenate([self.train.y, self.val.y]),
                     np.concatenate([self.train.n_tokens, self.val.n_tokens]),
                     self.train.where + self.val.where, self.train.description)
        def compute() -> np.ndarray:
            if ref_from is None:
                return reference_logps(model, both, self.pairs, tune)
            ref = checkpoint_model(ref_from, model.config["vocab_size"])
            ref.precision = model.precision
            return pair_logps(ref, both, self.pairs)
        self.ref = load_or_compute_ref(path, len(both), compute)

    def state(self) -> dict[str, Any]:
        return self.sampler.state()

    def set_state(self, st: dict[str, Any]) -> None:
        self.sampler.set_state(st)


def load_or_compute_ref(path: str | None, n_pairs: int,
                        compute: Callable[[], np.ndarray]) -> np.ndarray:
    """The reference log-probabilities kept at path (a resumed run's), else
    compute() written there atomically (path None: not kept)."""
    if path is not None and os.path.exists(path):
        try:
            ref = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise TrainError(f"cannot read the reference log-probabilities {path}: {e}") \
                from None
        if ref.shape != (n_pairs, 2) or ref.dtype != np.float64:
            raise TrainError(f"{path} holds {ref.shape} {ref.dtype}, not the ({n_pairs}, 2) "
                             "float64 reference log-probabilities of this run's pairs")
        return ref
    ref = compute()
    if path is not None:
        replace_with(path, lambda tmp: np.save(tmp, ref, allow_pickle=False), keep_ext=True)
    return ref
