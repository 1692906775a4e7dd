"""--objective grpo: a step's rollouts, rewards, advantages and the update
(docs/finetune.md §GRPO, docs/maths.md §GRPO).

One step: when the last batch of completions has been used
--num-iterations times, the next P = batch * grad_accum / num_generations
prompts (a seeded sampler, reshuffled each epoch) each get G =
--num-generations completions from the batched generation engine
(rwkvx_c.generation, seeded by (--seed, rollout number, prompt, sample):
a resumed run draws the same ones), the rewards score them and their
group advantages are computed (rwkvx_c.train.grpo_loss). Then
--grad-accum micro-batches of --batch completions each: one forward over
prompt + completion, each completion token's log-probability (the
cross-entropy of RxPtModel.row_losses, of the logits divided by
--temperature as TRL's), TRL's loss and its grad on those
log-probabilities, and one backward that takes that grad in through each
token's cross-entropy (RxPtModel.backward_rows): the exact gradient of
the loss through the model. With --num-iterations > 1 the first pass's
log-probabilities are kept as the old policy's, which the ratio divides
by on the later passes. With --beta > 0 the reference's log-probabilities
come from the same model with its LoRA adapters off (--tune lora), else
from --ref-from's model (by default --init-from's), a run's checkpoint as
pinned in the run folder when the run started (rwkvx_c.run.base), which
a resumed run reads again.
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rwkvx_c import _core
from rwkvx_c.data.chat import IGNORE, SEPARATOR
from rwkvx_c.data.preferences import PairSampler
from rwkvx_c.errors import SampleError, TrainError
from rwkvx_c.generation import Request, Sampling, run_requests
from rwkvx_c.model.lora import adapters_off
from rwkvx_c.run.base import pin_source
from rwkvx_c.run.rundir import RunDir
from rwkvx_c.train.distributed import ProcessGroup
from rwkvx_c.train.grpo_loss import advantages, nanstd, token_loss
from rwkvx_c.train.objectives import checkpoint_model
from rwkvx_c.train.rewards import Reward, load_rewards, parse_weights, score

if TYPE_CHECKING:
    from rwkvx_c.data.prompts import Prompts
    from rwkvx_c.data.tokenizers import Tokenizer
    from rwkvx_c.run.base import Record
    from rwkvx_c.run.rundir import Row
    from rwkvx_c.train.accumulate import GradAccumulator
    from rwkvx_c.train.options import ResolvedOptions

__all__ = ["GRPOStep", "Rollout", "stop_strings", "DEFAULT_STOP", "generate", "greedy_rewards"]

DEFAULT_STOP = ("\n\n",)   # the chat format's turn end (rwkvx_c.data.chat)


def stop_strings(given: str | list[str] | None) -> tuple[str, ...]:
    """--stop's strings with backslash escapes (\\n) read, or DEFAULT_STOP."""
    if given is None:
        return DEFAULT_STOP
    items = [given] if isinstance(given, str) else given
    # other characters pass as escapes of themselves, so only the user's escapes are read
    return tuple(s.encode("latin-1", "backslashreplace").decode("unicode_escape")
                 for s in items)


@dataclass
class Rollout:
    """A batch of N completions: idx (P,) the train prompts they complete,
    G each; x, y (N, T) int32 the forward's tokens and
    targets (IGNORE but on the trained completion tokens), adv (N,), old
    (N, T) the first pass's log-probabilities (None until it ran), n_items
    the trained tokens, and its metrics."""
    idx: np.ndarray
    x: np.ndarray
    y: np.ndarray
    adv: np.ndarray
    n_items: float
    metrics: Row
    old: np.ndarray | None = None

    def state(self) -> dict[str, Any]:
        return {"idx": self.idx.tolist(), "x": self.x.tolist(), "y": self.y.tolist(),
                "adv": self.adv.tolist(), "n_items": self.n_items, "metrics": self.metrics,
                "old": None if self.old is None else self.old.tolist()}

    @classmethod
    def from_state(cls, st: dict[str, Any]) -> Rollout:
        old = st["old"]
        return cls(np.array(st["idx"], np.int64), np.array(st["x"], np.int32),
                   np.array(st["y"], np.int32),
                   np.array(st["adv"], np.float64), float(st["n_items"]), dict(st["metrics"]),
                   None if old is None else np.array(old, np.float64))


def _completion_metrics(lens: np.ndarray, cut: np.ndarray) -> Row:
    """TRL's completions/* metrics of the completions' lengths in tokens
    and whether each was cut at the limit."""
    term = lens[~cut] if (~cut).any() else np.zeros(1)
    return {"completions/mean_length": float(lens.mean()),
            "completions/min_length": float(lens.min()),
            "completions/max_length": float(lens.max()),
            "completions/clipped_ratio": float(cut.mean()),
            "completions/mean_terminated_length": float(term.mean()),
            "completions/min_terminated_length": float(term.min()),
            "completions/max_terminated_length": float(term.max())}


def generate(model: _core.RxPtModel, tok: Tokenizer, rewards: list[Reward], prompts: Prompts,
             idx: np.ndarray, n: int, sampling: Sampling, max_len: int, seed: int,
             first: int = 0) -> tuple[list[Any], list[Any], np.ndarray]:
    """n completions of each prompt idx[i] of at most max_len tokens,
    seeded as the first + i'th of the call: (the engine's Completions,
    what a reward sees of each, the (N, F) rewards)."""
    reqs = [Request(prompts.ids[i], n, stream=first + k) for k, i in enumerate(idx)]
    outs = run_requests(model, reqs, sampling, max_len, seed, tok,
                        batch_size=min(len(reqs) * n, 64))
    comps = [c for group in outs for c in group]
    rep = [int(i) for i in idx for _ in range(n)]
    shown = [[{"role": "assistant", "content": c.text}]
             if isinstance(prompts.prompts[i], list) else c.text for c, i in zip(comps, rep)]
    cols = {k: [prompts.columns[i][k] for i in rep] for k in prompts.columns[0]}
    per_func = score(rewards, [prompts.prompts[i] for i in rep], shown,
                     [list(c.token_ids) for c in comps], cols)
    return comps, shown, per_func


def greedy_rewards(model: _core.RxPtModel, tok: Tokenizer, rewards: list[Reward],
                   weights: np.ndarray, prompts: Prompts, max_len: int,
                   stop: Sequence[str]) -> Row:
    """The mean weighted reward of one greedy completion of each prompt
    ("reward") and each function's ("rewards/NAME/mean")."""
    greedy = Sampling(temperature=0.0, token_stop=(SEPARATOR,), stop=stop)
    _, _, per_func = generate(model, tok, rewards, prompts, np.arange(len(prompts)), 1, greedy,
                              max_len, 0)
    row: Row = {}
    with np.errstate(invalid="ignore"):
        for k, r in enumerate(rewards):
            row[f"rewards/{r.name}/mean"] = float(np.nanmean(per_func[:, k]))
        total = np.nansum(per_func * weights[None, :], axis=1)
        total[np.isnan(per_func).all(axis=1)] = np.nan
        row["reward"] = float(np.nanmean(total))
    return row


class GRPOStep:
    """The training step and the evaluation of --objective grpo over the
    train and val prompts (see the module doc)."""

    def __init__(self, o: ResolvedOptions, tok: Tokenizer, train: Prompts, val: Prompts,
                 group: ProcessGroup | None = None) -> None:
        self.o, self.tok, self.train, self.val = o, tok, train, val
        self.group = group or ProcessGroup()
        self.G, self.B, self.accum = o.num_generations, o.batch, o.grad_accum
        if (self.B * self.accum) % self.G:
            raise TrainError(f"--batch {self.B} x --grad-accum {self.accum} completions a step "
                             f"must be a multiple of --num-generations {self.G}: each prompt's "
                             "completions are one group")
        self.rewards = load_rewards(o.reward if isinstance(o.reward, list) or o.reward is None
                                    else [o.reward], o.max_completion_length)
        self.weights = parse_weights(o.reward_weights, len(self.rewards))
        if o.temperature <= 0.0:
            raise TrainError("--objective grpo samples at --temperature > 0: at 0 every "
                             "completion of a group is the same greedy one")
        self.eps_low = o.epsilon
        self.eps_high = o.epsilon if o.epsilon_high is None else o.epsilon_high
        try:
            self.sampling = Sampling(temperature=o.temperature, top_p=o.top_p, top_k=o.top_k,
                                     token_stop=(SEPARATOR,), stop=stop_strings(o.stop))
        except SampleError as e:
            raise TrainError(str(e)) from None
        P = self.B * self.accum // self.G
        if P % self.group.size:
            raise TrainError(f"the {P} prompts of a step do not divide over "
                             f"{self.group.size} processes: each rank samples whole groups")
        # every rank draws the step's prompts and samples and trains on its share
        self.lo, self.hi = self.group.split(P)
        self.sampler = PairSampler(len(train), P, o.seed)
        self.n_rollouts, self.iteration = 0, 0
        self.rollout: Rollout | None = None
        self.ref: _core.RxPtModel | None = None
        self.ref_record: Record | None = None   # the reference's pin, kept in the state
        self.lora_ref = False
        self.last_times = (0.0, 0.0)   # the last step's rollout and update seconds

    def step_len(self) -> int:
        """The tokens of an update's longest sequence: the longest prompt
        and a completion of --max-completion-length."""
        return max(self.train.longest(), self.val.longest() if len(self.val) else 0) + \
            self.o.max_completion_length

    # ------------------------------------------------------------ reference
    def reference_source(self, tune: str) -> str | None:
        """Where the reference of the KL term (--beta > 0) comes from:
        --ref-from; else --init-from, but for a LoRA tune (its adapters
        off); None without the KL term."""
        if self.o.beta == 0.0:
            return None
        return self.o.ref_from or (None if tune == "lora" else self.o.init_from)

    def pin_reference(self, run_dir: str | None, state: dict[str, Any] | None) -> str | None:
        """The path the reference is read from: a new run (state None)
        pins a run checkpoint source in its folder run_dir (None: no
        folder, the source itself); a resumed one (state: its saved one)
        reads that pin again, in run_dir wherever the folder now is,
        whatever became of the source (a .pth or Hugging Face source, never
        pinned, is read where it is)."""
        src = self.reference_source(self.o.tune)
        if src is None or run_dir is None:
            return src
        rec = pin_source(src, run_dir) if state is None else state.get("ref")
        if rec is not None and state is not None:
            sha = str(rec.get("sha256"))
            pin = RunDir(run_dir).pin(sha) if re.fullmatch("[0-9a-f]{64}", sha) else ""
            if not os.path.isfile(pin):
                raise TrainError(f"{run_dir}: the pin of the reference ({src} as the run "
                                 f"started, sha256 {sha[:16]}) is missing from the run folder")
            rec = {**rec, "path": os.path.abspath(pin)}
        self.ref_record = rec
        return src if rec is None else str(rec["path"])

    def set_reference(self, model: _core.RxPtModel, tune: str, src: str | None) -> None:
        """The reference of the KL term (--beta > 0): src's model (the
        reference_source, or its pin); else a LoRA tune's model with its
        adapters off."""
        if self.o.beta == 0.0:
            return
        if src is None and tune != "lora":
            raise TrainError("--beta > 0 needs a reference: give --ref-from (a model trained "
                             "from scratch has no --init-from to compare with)")
        if src is None:
            self.lora_ref = True
            return
        self.ref = checkpoint_model(src, model.config["vocab_size"])
        self.ref.precision = model.precision

    def _ref_logps(self, model: _core.RxPtModel, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        if self.ref is not None:
            self.ref.forward(x, return_logits=False)
            return -self.ref.row_losses(y, IGNORE, temperature=self.o.temperature)
        assert model.lora_rank is not None
        with adapters_off(model):
            model.forward(x, return_logits=False)
            return -model.row_losses(y, IGNORE, temperature=self.o.temperature)

    # -------------------------------------------------------------- rollout
    def next_rollout(self, model: _core.RxPtModel) -> Rollout:
        """The next P prompts' completions, rewards and advantages (the
        step's batch; a step takes it from self.rollout when set)."""
        idx = self.sampler.next_indices()
        seed = (self.o.seed << 32) + self.n_rollouts   # a stream per rollout, per completion
        self.n_rollouts += 1
        mine = idx[self.lo:self.hi]
        comps, _, local = generate(model, self.tok, self.rewards, self.train, mine, self.G,
                                   self.sampling, self.o.max_completion_length, seed,
                                   self.lo)
        # the advantages of every rank's groups, from all the rewards, as one process has them
        per_func = self.group.gather_rows(local)
        a = advantages(per_func, self.weights, self.G, self.o.scale_rewards)
        N = len(comps)
        seqs = [self.train.ids[int(i)] for i in mine for _ in range(self.G)]
        T = max(len(p) + len(c.token_ids) - 1 for p, c in zip(seqs, comps))
        x = np.full((N, T), SEPARATOR, np.int32)
        y = np.full((N, T), IGNORE, np.int32)
        for k, (p, c) in enumerate(zip(seqs, comps)):
            s = p + list(c.token_ids)
            x[k, :len(s) - 1] = s[:-1]
            if not (self.o.mask_truncated_completions and c.stop_reason == "length"):
                y[k, len(p) - 1:len(s) - 1] = c.token_ids
        m: Row = {}
        for k, r in enumerate(self.rewards):
            with np.errstate(invalid="ignore"):
                m[f"rewards/{r.name}/mean"] = float(np.nanmean(per_func[:, k]))
            m[f"rewards/{r.name}/std"] = float(nanstd(per_func[:, k]))
        with np.errstate(invalid="ignore"):
            m["reward"] = float(np.nanmean(a.rewards))
        m["reward_std"] = float(nanstd(a.rewards))
        m["frac_reward_zero_std"] = float(a.zero_std.mean())
        lens = np.array([len(c.token_ids) for c in comps], np.float64)
        cut = np.array([c.stop_reason == "length" for c in comps], np.float64)
        m.update(_completion_metrics(self.group.gather_rows(lens),
                                     self.group.gather_rows(cut) > 0))
        n_items = self.group.sum_values(float((y != IGNORE).sum()))[0]
        adv = a.advantages[self.lo * self.G:self.hi * self.G]
        return Rollout(idx, x, y, adv, n_items, m)

    # ----------------------------------------------------------------- step
    def step(self, model: _core.RxPtModel, accum: GradAccumulator | None
             ) -> tuple[float, Row, int]:
        """One optimiser step's grads (left in the optimiser's buffers; accum
        sums the micro-batches when --grad-accum > 1): (loss, TRL's
        metrics, tokens)."""
        t0 = time.perf_counter()
        if self.rollout is None:
            self.rollout = self.next_rollout(model)
        r = self.rollout
        t1 = time.perf_counter()
        keep_old = self.o.num_iterations > 1 and r.old is None
        if keep_old:
            r.old = np.zeros(r.x.shape, np.float64)
        loss, rows = 0.0, []
        b = len(r.x) // self.accum   # this rank's completions of each micro-batch
        # the ranks' grads are averaged: a loss normalised over all ranks' tokens is summed
        ranks = self.group.size if self.o.loss_type in ("bnpo", "dapo") else 1
        for k in range(self.accum):
            sl = slice(k * b, (k + 1) * b)
            x, y = np.ascontiguousarray(r.x[sl]), np.ascontiguousarray(r.y[sl])
            mask = (y != IGNORE).astype(np.float64)
            n_micro = self.group.sum_values(float(mask.sum()))[0]
            ref = self._ref_logps(model, x, y) if self.o.beta else None
            model.forward(x, return_logits=False)
            logp = -model.row_losses(y, IGNORE, temperature=self.o.temperature)
            if keep_old:
                assert r.old is not None
                r.old[sl] = logp
            old = None if keep_old or r.old is None else r.old[sl]
            res = token_loss(logp, mask, r.adv[sl], loss_type=self.o.loss_type,
                             eps_low=self.eps_low, eps_high=self.eps_high, beta=self.o.beta,
                             old=old, ref=ref, max_len=self.o.max_completion_length,
                             accum=self.accum, n_items=r.n_items, n_micro=n_micro)
            # the loss's grad on row t's log-probability enters as -weight on its cross-entropy
            model.backward_rows(y, -ranks * res.grad, IGNORE, temperature=self.o.temperature)
            if accum is not None:
                accum.add(k, self.accum, 1.0)
            loss += ranks * res.loss
            rows.append(res.metrics)
        self.iteration = (self.iteration + 1) % self.o.num_iterations
        if self.iteration == 0:   # used num_iterations times: the next step samples anew
            self.rollout = None
        t2 = time.perf_counter()
        self.last_times = (t1 - t0, t2 - t1)
        row: Row = dict(r.metrics)
        for key in rows[0]:
            vals = np.array([m[key] for m in rows], np.float64)
            row[key] = float(np.nanmean(vals)) if np.isfinite(vals).any() else float("nan")
        row["rollout_s"] = round(t1 - t0, 4)
        row["update_s"] = round(t2 - t1, 4)
        return loss, row, int(r.x.size)

    def evaluate(self, model: _core.RxPtModel) -> Row:
        """The mean reward of one greedy completion of each val prompt
        (eval_reward; val_loss is its negative, so that lower is better
        for --keep-best) and of each function."""
        row = greedy_rewards(model, self.tok, self.rewards, self.weights, self.val,
                             self.o.max_completion_length, self.sampling.stop)
        mean = row.pop("reward")
        return {"val_loss": -mean, "val_bpb": None, "eval_reward": mean,
                **{"eval_" + k: v for k, v in row.items()}}

    # ---------------------------------------------------------------- state
    def state(self) -> dict[str, Any]:
        """The sampler's position, the rollout count, and the batch of
        completions still in use (num_iterations > 1), so a resumed run
        continues bit for bit."""
        st: dict[str, Any] = {**self.sampler.state(), "rollouts": self.n_rollouts,
                              "iteration": self.iteration}
        if self.rollout is not None:
            st["rollout"] = self.rollout.state()
        if self.ref_record is not None:
            st["ref"] = self.ref_record
        return st

    def set_state(self, st: dict[str, Any]) -> None:
        self.sampler.set_state(st)
        self.n_rollouts, self.iteration = int(st["rollouts"]), int(st["iteration"])
        if not 0 <= self.iteration < self.o.num_iterations or self.n_rollouts < 0:
            raise ValueError(f"iteration {self.iteration}, rollouts {self.n_rollouts}")
        if st.get("rollout") and self.group.size > 1:
            # the checkpoint holds rank 0's share of the batch alone
            raise ValueError("a run saved mid-way through --num-iterations resumes in one "
                             "process only")
        self.rollout = Rollout.from_state(st["rollout"]) if st.get("rollout") else None
