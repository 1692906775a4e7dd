"""The mean reward of a run's greedy completions of held-out prompts
(``rwkvx-c eval RUN --rewards FILE``; docs/finetune.md §GRPO): one
completion of each prompt record, scored by the run's own reward
functions (its --reward, --reward-weights, --max-completion-length and
--stop) or by those given."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rwkvx_c.data.prompts import read_prompts
from rwkvx_c.errors import EvalError, TrainError
from rwkvx_c.train.grpo import greedy_rewards, stop_strings
from rwkvx_c.train.rewards import load_rewards, parse_weights

if TYPE_CHECKING:
    from rwkvx_c import _core
    from rwkvx_c.data.tokenizers import Tokenizer

__all__ = ["score_rewards"]

MAX_LEN = 512   # TRL's max_completion_length, for a run that names none


def score_rewards(model: _core.RxPtModel, tok: Tokenizer, path: str, opts: dict[str, Any],
                  specs: list[str] | None = None) -> dict[str, Any]:
    """{"reward", "rewards/NAME/mean", "n_prompts"} of the prompt records at
    path; specs: the reward functions (None: the run's own, opts)."""
    given = specs or opts.get("reward")
    if not given:
        raise EvalError("the run names no reward function: give --reward")
    max_len = int(opts.get("max_completion_length") or MAX_LEN)
    try:
        rewards = load_rewards([given] if isinstance(given, str) else list(given), max_len)
        weights = parse_weights(None if specs else opts.get("reward_weights"), len(rewards))
        prompts = read_prompts(path, tok)
        row = greedy_rewards(model, tok, rewards, weights, prompts, max_len,
                             stop_strings(opts.get("stop")))
    except TrainError as e:
        raise EvalError(str(e)) from None
    return {**row, "n_prompts": len(prompts)}
