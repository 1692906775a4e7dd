"""Reward functions of --objective grpo (docs/finetune.md §Rewards).

A reward is named by --reward SPEC, one of:

    module:function        a function of an importable module
    path/to/file.py:name   a function of a Python file
    exact                  1.0 when the completion, stripped, is the record's answer
    numeric                1.0 when the last number in the completion equals the answer
    format:REGEX           1.0 when the whole completion matches REGEX (re.DOTALL)
    length:CACHE           DAPO's soft overlong punishment over the last CACHE tokens
                           before --max-completion-length (TRL's get_soft_overlong_punishment)

A function is called as TRL calls one: fn(prompts=..., completions=...,
completion_ids=..., **columns), each a list with one entry per completion
(a prompt repeated for each of its completions; a record's other columns
as keyword arguments), and returns one float or None (not scored) per
completion. A function that raises, returns another count or anything
but a number or None stops the run with a TrainError naming it. Nothing
runs that --reward does not name.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rwkvx_c.errors import TrainError

__all__ = ["Reward", "BUILTINS", "load_rewards", "score", "parse_weights"]

BUILTINS = ("exact", "numeric", "format", "length")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


@dataclass(frozen=True)
class Reward:
    """One reward function and the name its metrics carry (rewards/NAME/mean)."""
    name: str
    fn: Callable[..., Any]


def _answers(kw: dict[str, Any], name: str) -> list[Any]:
    if "answer" not in kw:
        raise TrainError(f"reward {name}: the prompt records have no 'answer' field to compare "
                         "with")
    return list(kw["answer"])


def _text(c: object) -> str:
    """A completion's text: a string, or a conversational completion's content."""
    if isinstance(c, list) and c and isinstance(c[-1], dict):
        return str(c[-1].get("content", ""))
    return str(c)


def _exact(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float]:
    return [float(_text(c).strip() == str(a).strip())
            for c, a in zip(completions, _answers(kw, "exact"))]


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def _numeric(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float]:
    out = []
    for c, a in zip(completions, _answers(kw, "numeric")):
        got, want = _last_number(_text(c)), _last_number(str(a))
        out.append(float(got is not None and want is not None
                         and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)))
    return out


def _format(pattern: str) -> Callable[..., list[float]]:
    try:
        rx = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise TrainError(f"--reward format:{pattern}: not a regular expression ({e})") from None

    def format_reward(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float]:
        return [float(rx.fullmatch(_text(c)) is not None) for c in completions]
    return format_reward


def _length(cache: str, max_len: int) -> Callable[..., list[float]]:
    try:
        n = int(cache)
    except ValueError:
        n = 0
    if not 0 < n < max_len:
        raise TrainError(f"--reward length:{cache}: CACHE must be an integer in [1, "
                         f"--max-completion-length {max_len})")
    keep = max_len - n

    def length_penalty(prompts: list[Any], completions: list[Any], completion_ids: list[Any],
                       **kw: Any) -> list[float]:
        # 0 up to max_len - cache tokens, then falling linearly to -1 at max_len
        return [0.0 if len(ids) <= keep else (keep - len(ids)) / n if len(ids) <= max_len
                else -1.0 for ids in completion_ids]
    return length_penalty


def _user(spec: str) -> Reward:
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise TrainError(f"--reward {spec}: give module:function, file.py:function or one of "
                         f"{', '.join(BUILTINS)}")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise TrainError(f"--reward {spec}: no file {where}")
            s = importlib.util.spec_from_file_location(f"rwkvx_reward_{abs(hash(where))}", where)
            assert s is not None and s.loader is not None
            mod = importlib.util.module_from_spec(s)
            s.loader.exec_module(mod)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())   # a module beside the user, as `python -m` finds
            mod = importlib.import_module(where)
    except TrainError:
        raise
    except Exception as e:  # noqa: BLE001 -- the user's module: any failure, one line
        raise TrainError(f"--reward {spec}: cannot import {where} ({type(e).__name__}: {e})") \
            from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise TrainError(f"--reward {spec}: {where} has no function {name}")
    return Reward(name, fn)


def load_rewards(specs: Sequence[str] | None, max_len: int) -> list[Reward]:
    """The reward functions --reward names (TrainError for a bad one or none)."""
    if not specs:
        raise TrainError("--objective grpo needs at least one --reward (module:function, "
                         f"file.py:function, or a built-in: {', '.join(BUILTINS)})")
    out = []
    for spec in specs:
        head, _, arg = spec.partition(":")
        if spec in ("exact", "numeric"):
            out.append(Reward(spec, _exact if spec == "exact" else _numeric))
        elif head == "format" and arg:
            out.append(Reward("format", _format(arg)))
        elif head == "length" and arg:
            out.append(Reward("length", _length(arg, max_len)))
        else:
            out.append(_user(spec))
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        raise TrainError(f"--reward names a function twice ({', '.join(names)})")
    return out


def parse_weights(text: str | None, n: int) -> np.ndarray:
    """--reward-weights "1,0.5" as n float64 weights (None: all 1)."""
    if text is None:
        return np.ones(n)
    try:
        w = np.array([float(v) for v in text.split(",")], np.float64)
    except ValueError:
        raise TrainError(f"--reward-weights {text}: a comma list of numbers") from None
    if len(w) != n or not np.isfinite(w).all():
        raise TrainError(f"--reward-weights {text}: {n} finite numbers, one per --reward")
    return w


def _checked(r: Reward, got: object, n: int) -> np.ndarray:
    if isinstance(got, np.ndarray):
        got = got.tolist()
    if not isinstance(got, (list, tuple)):
        raise TrainError(f"reward {r.name} returned {type(got).__name__}, not a list of "
                         f"{n} numbers")
    if len(got) != n:
        raise TrainError(f"reward {r.name} returned {len(got)} rewards for {n} completions")
    out = np.empty(n, np.float64)
    for i, v in enumerate(got):
        if v is None:
            out[i] = np.nan
        elif isinstance(v, (int, float, np.integer, np.floating)) and math.isfinite(v):
            out[i] = float(v)
        else:
            raise TrainError(f"reward {r.name} returned {v!r} for completion {i}: not a finite "
                             "number or None")
    return out


def score(rewards: Sequence[Reward], prompts: list[Any], completions: list[Any],
          completion_ids: list[list[int]], columns: dict[str, list[Any]]) -> np.ndarray:
    """(N, len(rewards)) float64: each function's reward of each completion,
    NaN where it returned None."""
    n = len(completions)
    out = np.empty((n, len(rewards)), np.float64)
    for k, r in enumerate(rewards):
        try:
            got = r.fn(prompts=prompts, completions=completions, completion_ids=completion_ids,
                       **columns)
        except TrainError:
            raise
        except Exception as e:  # noqa: BLE001 -- the user's code: any failure, one line
            raise TrainError(f"reward {r.name} raised {type(e).__name__}: {e}") from None
        out[:, k] = _checked(r, got, n)
    return out
