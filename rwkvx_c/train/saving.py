"""The Trainer's checkpoint: the run state it stores, its atomic save
behind the divergence guard, and the restore of a resumed run (and of a
rollback) from one.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from rwkvx_c.data.sampler import IGNORE
from rwkvx_c.errors import TrainError
from rwkvx_c.interop.source import base_weights
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.model.weights import copy_tensor
from rwkvx_c.run.base import BASE_KEY
from rwkvx_c.run.checkpoint import save_checkpoint
from rwkvx_c.train.assemble import load_source, load_weights
from rwkvx_c.train.base import Decoded
from rwkvx_c.train.finetune import (
    held_names,
    is_unfrozen,
    lisa_due,
    saved_params,
    switched,
    trained_tensors,
)
from rwkvx_c.train.options import new_run_hint
from rwkvx_c.train.resume import saved_counters
from rwkvx_c.train.stepping import Stepper

__all__ = ["Saver"]


class Saver(Stepper):
    """A Trainer's checkpoints: state(), save() and the restore of one."""

    def _restore(self, state: dict[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        # a different number of ranks sums the gradients in another order: not the same run
        ranks = state.get("world_size", 1)
        if ranks != self.group.size:
            raise TrainError(f"the run was trained on {ranks} process(es) and this is "
                             f"{self.group.size}; resume it with the same number "
                             f"(mpiexec -n {ranks}), or {new_run_hint(self.out_dir or 'RUN')}")
        if not self.corpus.described_as(state.get("corpus")):
            raise TrainError(f"the corpus changed since the checkpoint: it was "
                             f"{state.get('corpus')}, it is now {self.corpus.description}; "
                             f"{new_run_hint(self.out_dir or 'RUN')}")
        c = saved_counters(state)
        self.keeper.restore(state.get("keeper"))
        # the side of the base-unfreeze first: past it a LoRA run's checkpoint
        # holds the merged base and no adapters, before it both
        partial = state.get(BASE_KEY) is not None
        if partial and is_unfrozen(self.optim) and not state.get("unfrozen"):
            self._reload_base()   # a rollback to before the switch: the base as it began
        self.optim = switched(self.model, self.optim, self.opts, bool(state.get("unfrozen")))
        # LISA: the optimiser of the period that took the checkpoint's last step
        self.optim = lisa_due(self.model, self.optim, self.opts, max(c["step"] - 1, 0))
        self._load_params(tensors, partial)
        n = self.optim.m.size
        for key, buf in (("optim.m", self.optim.m), ("optim.v", self.optim.v)):
            if key not in tensors or tensors[key].shape != (n,):
                raise TrainError(f"checkpoint lacks the optimiser state {key}")
            copy_tensor(tensors, key, buf)   # a moment is as large as what trains
        try:
            (self.pref or self.sampler).set_state(state["sampler"])
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
            raise TrainError(f"the checkpoint holds a bad sampler state ({type(e).__name__}: "
                             f"{e})") from None
        self.optim.t, self.step_count = c["optim_t"], c["step"]
        self.elapsed, self.tokens_seen = c["elapsed"], c["tokens_seen"]
        self._warm_end, self._next_eval_at = c["warm_end"], c["next_eval_at"]
        self.last_eval, self._eval_seconds = c["last_eval"], c["eval_seconds"]
        self.lr_scale, self.rollbacks = c["lr_scale"], c["rollbacks"]
        self.saved_step = self.step_count
        if self.run_dir is not None:
            self.run_dir.truncate_log(self.step_count)

    def _load_params(self, tensors: Mapping[str, np.ndarray], partial: bool = False) -> None:
        """The checkpoint's parameters into the model: every one, or (partial:
        a checkpoint naming its base, which the model was built from) the
        ones it holds, which must include every one that trains."""
        load_weights(self.model, tensors,
                     held_names(self.model, self.opts, tensors) if partial else None)

    def _reload_base(self) -> None:
        """The base's weights into the model again, as the run began."""
        assert self.base is not None
        _, weights = base_weights(self.base, str(self.out_dir), None, TrainError)
        load_source(self.model, weights)

    def _names_base(self) -> bool:
        """True when the next checkpoint names the base instead of holding it."""
        return self.base is not None and not is_unfrozen(self.optim)

    def state(self) -> dict[str, Any]:
        """The JSON-serialisable run state a checkpoint stores."""
        return {"step": self.step_count, "optim_t": self.optim.t,
                "elapsed": self.train_seconds(), "tokens_seen": self.tokens_seen,
                "sampler": (self.pref or self.sampler).state(), "warm_end": self._warm_end,
                "next_eval_at": self._next_eval_at, "last_eval": self.last_eval,
                "eval_seconds": self._eval_seconds, "options": self.opts.stored(),
                "corpus": self.corpus.description, "tokenizer": self.tokenizer.identity(),
                "chat_template": self.chat_template.stored(),
                "world_size": self.group.size, "unfrozen": is_unfrozen(self.optim),
                "lr_scale": self.lr_scale, "rollbacks": self.rollbacks,
                BASE_KEY: self.base if self._names_base() else None,
                "keeper": self.keeper.state()}

    def save(self, path: str | None = None) -> str | None:
        """Write the checkpoint (params, AdamW moments, run state) atomically.

        Defaults to out_dir/checkpoint.safetensors; returns the path (None on
        ranks other than 0, which write nothing). A model with a non-finite
        parameter or a loss above the uniform-guess bound (rwkvx_c.train.guard) is
        never written: Divergence instead."""
        if not self.group.is_root:
            return None
        if path is None:
            if self.run_dir is None:
                raise TrainError("save() needs a path when the trainer has no out_dir")
            path = self.run_dir.checkpoint
        t = time.perf_counter()
        self._check_saveable()
        tensors = saved_params(self.model, self.opts,
                               self._base_names if self._names_base() else None)
        tensors["optim.m"] = self.optim.m
        tensors["optim.v"] = self.optim.v
        tensors.update(trained_tensors(self.model, self.optim))
        # a frozen base's matrices are not in the arena: decoded for the
        # file one at a time, as it is written
        save_checkpoint(path, Decoded(self.model, tensors),
                        ModelConfig.stored(self.model.config), self.state())
        if self.run_dir is not None and path == self.run_dir.checkpoint:
            self.saved_step = self.step_count
            self.keeper.snapshot(self.run_dir, self.step_count)
        self._save_seconds = max(self._save_seconds or 0.0, time.perf_counter() - t)
        return path

    def _check_saveable(self) -> None:
        """Divergence unless the model as it is now (after its last update)
        is finite and not worse than the uniform guess: on the validation
        loss of this step when there is one, else on the loss of the last
        training batch, recomputed (one forward)."""
        self.guard.check_params(self.model.param_buffer, self.step_count)
        if self.last_eval is not None and self.last_eval["step"] == self.step_count:
            self.guard.check_eval(self.last_eval["val_loss"], self.step_count)
        elif self._last_batch is not None:
            x, y = self._last_batch   # its first micro-batch: the model's acts fit it
            B = self.opts.batch
            self.model.forward(x[:B], return_logits=False)
            self.guard.check_eval(self.model.loss(y[:B], IGNORE), self.step_count)
