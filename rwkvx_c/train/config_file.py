"""Training options from a TOML file (`rwkvx-c train --config run.toml`,
TrainOptions.from_file), and the resolved options every run folder saves as
`config.toml`, from which `--config RUN/config.toml` trains the same run
again (the same losses bit for bit, with a --steps schedule).

The keys are the TrainOptions fields (dataclasses.fields(TrainOptions),
their help in `rwkvx-c train --help` under the flag's name), the model's
shape in a [model] table of ModelConfig fields. An unknown key is one line
naming the nearest valid one. TOML has no null: an option left out takes
its default."""
from __future__ import annotations

import difflib
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from rwkvx_c import _core
from rwkvx_c.errors import TrainError
from rwkvx_c.train.options import TrainOptions
from rwkvx_c.util.atomic import replacing

if sys.version_info >= (3, 11):
    import tomllib
else:   # pragma: no cover -- the tomli dependency of Python 3.9 and 3.10
    import tomli as tomllib

__all__ = ["load_config", "save_config", "options_from_file", "OPTION_KEYS", "MODEL_KEYS"]

OPTION_KEYS = tuple(f.name for f in fields(TrainOptions))
MODEL_KEYS = tuple(_core.CONFIG_FIELDS) + tuple(_core.OPTION_FIELDS)


def load_config(path: str) -> dict[str, Any]:
    """The TrainOptions keyword arguments a TOML file holds; TrainError (one
    line) for a file that cannot be read or parsed, or an unknown key."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise TrainError(f"--config {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise TrainError(f"--config {path} is not TOML: {e}") from None
    for key in data:
        if key not in OPTION_KEYS:
            raise TrainError(f"--config {path}: unknown option {key!r}{_nearest(key, OPTION_KEYS)}")
    model = data.get("model")
    if model is not None:
        if not isinstance(model, dict):
            raise TrainError(f"--config {path}: model must be a table of model config keys")
        for key in model:
            if key not in MODEL_KEYS:
                raise TrainError(f"--config {path}: unknown model key {key!r}"
                                 f"{_nearest(key, MODEL_KEYS)}")
    return data


def options_from_file(path: str, **overrides: Any) -> TrainOptions:
    """TrainOptions of a TOML file, `overrides` (options by name) over it."""
    return TrainOptions(**{**load_config(path), **overrides})


def _nearest(key: str, valid: tuple[str, ...]) -> str:
    """"; did you mean 'x'?" for the valid key nearest to key ('-' read as '_'), or ""."""
    near = difflib.get_close_matches(key.replace("-", "_"), valid, n=1, cutoff=0.5)
    return f"; did you mean {near[0]!r}?" if near else ""


def save_config(path: str, options: TrainOptions) -> None:
    """The options as TOML at path (atomically), None values left out; a
    value TOML cannot hold (a path whose bytes are not UTF-8) is a comment
    saying so."""
    lines, tables = [], []
    for k, v in options.to_dict().items():
        if isinstance(v, Mapping):
            tables.append(f"\n[{k}]")
            tables += [_line(mk, mv) for mk, mv in v.items() if mv is not None]
        elif v is not None:
            lines.append(_line(k, v))
    with replacing(path, "w") as f:
        f.write("# the resolved options of this run: rwkvx-c train --config THIS_FILE "
                "trains it again\n" + "\n".join(lines + tables) + "\n")


def _line(key: str, v: Any) -> str:
    text = f"{key} = {_toml(v)}"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:   # TOML is UTF-8 text
        return f"# {key}: not UTF-8, give it as a flag"
    return text


def _toml(v: Any) -> str:
    """A TOML value: a bool, int, float, string or list of them."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if math.isnan(v) else
                                                  ("inf" if v > 0 else "-inf"))
    if isinstance(v, str):   # a JSON string is a TOML basic string, DEL escaped too
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {v!r}")
