"""Training options from a TOML file (`rwkvx-c train --config run.toml`,
TrainOptions.from_file), and the resolved options every run folder saves as
`config.toml`, from which `--config RUN/config.toml` trains the same run
again (the same losses bit for bit, with a --steps schedule).

The keys are the TrainOptions fields (dataclasses.fields(TrainOptions),
their help in `rwkvx-c train --help` under the flag's name), the model's
shape in a [model] table of ModelConfig fields. An unknown key is one line
naming the nearest valid one; a value of the wrong type or range is one line
naming the key. TOML has no null: an option left out takes its default. A
value TOML cannot hold (a path whose bytes are not UTF-8) is saved as a
comment naming its key, and a config holding one is refused unless that
option is given as a flag: the file never trains on a default instead."""
from __future__ import annotations

import difflib
import json
import math
import re
import sys
from collections.abc import Collection, Mapping
from dataclasses import fields
from typing import Any

from rwkvx_c import _core
from rwkvx_c.errors import TrainError
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.train.options import TrainOptions, flag_of
from rwkvx_c.util.atomic import replacing
from rwkvx_c.util.files import read_input
from rwkvx_c.util.registry import KINDS, entries

if sys.version_info >= (3, 11):
    import tomllib
else:   # pragma: no cover -- the tomli dependency of Python 3.9 and 3.10
    import tomli as tomllib

__all__ = ["load_config", "save_config", "options_from_file", "OPTION_KEYS", "MODEL_KEYS"]

OPTION_KEYS = tuple(f.name for f in fields(TrainOptions))
MODEL_KEYS = tuple(_core.CONFIG_FIELDS) + tuple(_core.OPTION_FIELDS)
MAX_CONFIG_BYTES = 1 << 20   # a config of every option is ~2 KB; a larger file is another one
UNSAVED = "not UTF-8, give it as a flag"   # the comment of a value TOML cannot hold
_UNSAVED_LINE = re.compile(r"^# (\w+): " + re.escape(UNSAVED) + r"$", re.MULTILINE)
_OPTIONS = {e.key: e for e in entries(TrainOptions)}
_MODEL = {e.key: e for e in entries(ModelConfig)}


def load_config(path: str, given: Collection[str] = ()) -> dict[str, Any]:
    """The TrainOptions keyword arguments a TOML file holds; TrainError (one
    line) for a file that cannot be read or parsed (a FIFO, a device, over
    MAX_CONFIG_BYTES, not UTF-8, nested past the parser's depth), an unknown
    key, a value of the wrong type, or a value the file could not hold
    (its comment) that `given` (the options set otherwise) does not name."""
    try:
        text = read_input(path, TrainError, "--config", MAX_CONFIG_BYTES).decode("utf-8")
        data = tomllib.loads(text)
    except OSError as e:
        raise TrainError(f"--config {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TrainError(f"--config {path} is not UTF-8 text (byte {e.start}); TOML is "
                         "UTF-8") from None
    except RecursionError:
        raise TrainError(f"--config {path} nests arrays or tables too deeply") from None
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
    _check_values(path, data)
    for key in _UNSAVED_LINE.findall(text):
        if key in OPTION_KEYS and key not in data and key not in given:
            raise TrainError(f"--config {path}: its run's {key} is not UTF-8, which TOML "
                             f"cannot hold; give it with {flag_of(key)}")
    return data


def _check_values(path: str, data: dict[str, Any]) -> None:
    """TrainError naming the key of the first value of the wrong type or
    range (each declaration's check, rwkvx_c.util.registry.Entry.problem)."""
    for table, decl, values in (("", _OPTIONS, data), ("model.", _MODEL, data.get("model", {}))):
        for key, v in values.items():
            e = decl.get(key)
            if e is None or (table == "" and key == "model"):
                continue
            why: str | None
            if isinstance(v, (dict, list)) and e.kind not in ("paths", "texts"):
                why = f"{key} must be {_what(e)}, got a TOML {type(v).__name__}"
            else:
                why = e.problem(v)
            if why is not None:
                raise TrainError(f"--config {path}: {table}{why}")


def _what(e: Any) -> str:
    return f"one of {', '.join(e.choices)}" if e.choices else KINDS[e.kind].what


def options_from_file(path: str, **overrides: Any) -> TrainOptions:
    """TrainOptions of a TOML file, `overrides` (options by name) over it."""
    given = [k for k, v in overrides.items() if v is not None]
    return TrainOptions(**{**load_config(path, given), **overrides})


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
        return f"# {key}: {UNSAVED}"
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
