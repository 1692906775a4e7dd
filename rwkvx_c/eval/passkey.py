"""Passkey retrieval, RWKV-X's long-context test: a key hidden at a depth
in repeated filler text, asked for at the end.

    grid = passkey_grid(model, tok, lengths=[256, 1024], depths=[0.0, 0.5, 1.0], trials=5)
    print(format_table(grid)); heatmap(grid, "passkey.png")

A trial is a success when every token of " <key>." after "The pass key is"
is the model's greedy choice, which is greedy generation producing the key
(docs/training.md §Evaluation).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rwkvx_c._core import RxPtModel
from rwkvx_c.data.tokenizers import Tokenizer
from rwkvx_c.errors import EvalError
from rwkvx_c.generation.score import score_continuations
from rwkvx_c.util.atomic import replace_with

__all__ = ["passkey_grid", "passkey_prompt", "format_table", "heatmap", "DEFAULT_LENGTHS",
           "DEFAULT_DEPTHS"]

DEFAULT_LENGTHS = (256, 512, 1024, 2048)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
          "memorize it. I will quiz you about the important information there.\n")
_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back " \
          "again.\n"
_KEY = "The pass key is {key}. Remember it. {key} is the pass key.\n"
_ASK = "What is the pass key? The pass key is"


def passkey_prompt(tok: Tokenizer, length: int, depth: float, key: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(prompt tokens, answer tokens) of one trial: about `length` prompt
    tokens, the key line after round(depth * n) of the n filler lines."""
    intro, filler = tok.encode(_INTRO), tok.encode(_FILLER)
    line, ask = tok.encode(_KEY.format(key=key)), tok.encode(_ASK)
    n = max(0, (length - len(intro) - len(line) - len(ask)) // max(1, len(filler)))
    at = round(depth * n)
    parts = [intro] + [filler] * at + [line] + [filler] * (n - at) + [ask]
    return np.concatenate(parts).astype(np.int32), tok.encode(f" {key}.").astype(np.int32)


def passkey_grid(model: RxPtModel, tok: Tokenizer, lengths: Sequence[int] = DEFAULT_LENGTHS,
            depths: Sequence[float] = DEFAULT_DEPTHS, trials: int = 5, seed: int = 0,
            progress: Callable[[int], object] | None = None) -> dict[str, Any]:
    """Accuracy per (length, depth) cell over `trials` random 5-digit keys
    (the same keys in every cell). Returns {"lengths", "depths", "acc":
    [[acc per depth] per length], "tokens": [prompt tokens per length]}."""
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise EvalError("passkey depths must lie in [0, 1]")
    if any(n < 1 for n in lengths) or trials < 1:
        raise EvalError("passkey lengths and trials must be positive")
    keys = np.random.Generator(np.random.PCG64(seed)).integers(10000, 100000, size=trials)
    acc, sizes = [], []
    for length in lengths:
        # every trial of a length at once, in the batched engine
        trials_of = [passkey_prompt(tok, int(length), float(d), k) for d in depths
                     for k in keys.tolist()]
        hits = [greedy for _, greedy in score_continuations(model, trials_of,
                                                             progress=progress)]
        acc.append([sum(hits[j * trials:(j + 1) * trials]) / trials
                    for j in range(len(depths))])
        sizes.append(len(trials_of[-1][0]))
    return {"lengths": [int(n) for n in lengths], "depths": [float(d) for d in depths],
            "acc": acc, "tokens": sizes, "trials": trials}


def format_table(grid: dict[str, Any]) -> str:
    """The grid as text: a row per length, a column per depth."""
    head = "length \\ depth " + "".join(f"{d:>7.2f}" for d in grid["depths"])
    rows = [f"{n:>14d} " + "".join(f"{a:>7.2f}" for a in accs)
            for n, accs in zip(grid["lengths"], grid["acc"])]
    return "\n".join([head] + rows)


def heatmap(grid: dict[str, Any], path: str, title: str = "passkey retrieval") -> None:
    """Draws the grid as a heat map PNG (length across, depth down, as
    long-context papers show it), atomically. Needs matplotlib
    (rwkvx_c[train])."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EvalError('the passkey heat map needs matplotlib: pip install "rwkvx_c[train]"') \
            from None
    a = np.asarray(grid["acc"], dtype=np.float64).T   # (depths, lengths)
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * a.shape[1], 1.0 + 0.6 * a.shape[0]))
    im = ax.imshow(a, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(a.shape[1]), [str(n) for n in grid["lengths"]])
    ax.set_yticks(range(a.shape[0]), [f"{d:.0%}" for d in grid["depths"]])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("key depth")
    ax.set_title(title)
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            ax.text(j, i, f"{a[i, j]:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=ax, label="accuracy")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        replace_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    finally:
        plt.close(fig)
