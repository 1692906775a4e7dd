"""One declaration per field: the form in which a training option
(rwkvx_c.train.options.TrainOptions) or a model-config field
(rwkvx_c.model.config.ModelConfig) is declared, and what is derived from it.

A field is one ``declare(default, help, kind=..., ...)`` call on a
dataclass. ``entries(cls)`` reads the declarations back as ``Entry``
records -- key, value type, default, what absence in an old checkpoint
means, help, CLI flag, check, C route, export limits -- from which the
command line (its flags, argparse types and --help), a config file's
schema, the checks of a value, resume's comparison of saved and given
values, what a checkpoint stores, and the exporters' refusals are all
derived (docs/architecture.md §Checklist: adding a training option).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import numpy as np

__all__ = ["Kind", "KINDS", "Entry", "declare", "entries", "resolve", "stored", "REQUIRED",
           "SAME", "DEFAULT"]


def _int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _real(v: object) -> bool:
    """An int or float (not a bool), finite."""
    if not (_int(v) or isinstance(v, (float, np.floating))):
        return False
    try:
        return math.isfinite(v)   # type: ignore[arg-type]
    except OverflowError:   # an int beyond float range
        return False


def _paths(v: object) -> bool:
    return isinstance(v, str) or (isinstance(v, (list, tuple)) and len(v) > 0
                                  and all(isinstance(p, str) for p in v))


@dataclass(frozen=True)
class Kind:
    """A kind of value: its type in a config file, the check of a value
    (`ok`; the error says "NAME must be WHAT, got V"), and how a
    command-line word becomes one (`parse`; argparse says "expected CLI_WHAT")."""
    type: type
    ok: Callable[[Any], bool]
    what: str
    parse: Callable[[str], Any]
    cli_what: str


KINDS: dict[str, Kind] = {
    "pos_int": Kind(int, lambda v: _int(v) and v >= 1, "an integer > 0", int,
                    "a positive integer"),
    "nonneg_int": Kind(int, lambda v: _int(v) and v >= 0, "an integer >= 0", int,
                       "an integer >= 0"),
    "pos_float": Kind(float, lambda v: _real(v) and v > 0, "a number > 0", float,
                      "a positive number"),
    "nonneg_float": Kind(float, lambda v: _real(v) and v >= 0, "a number >= 0", float,
                         "a number >= 0"),
    "unit_float": Kind(float, lambda v: _real(v) and 0 <= v <= 1, "a number in [0, 1]", float,
                       "a number in [0, 1]"),
    "unit_open": Kind(float, lambda v: _real(v) and 0 <= v < 1, "a number in [0, 1)", float,
                      "a number in [0, 1)"),
    "bit": Kind(int, lambda v: _int(v) and v in (0, 1), "0 or 1", int, "0 or 1"),
    "flag": Kind(bool, lambda v: isinstance(v, (bool, np.bool_)), "true or false", bool,
                 "true or false"),
    "str": Kind(str, lambda v: isinstance(v, str), "a string", str, "a string"),
    "names": Kind(str, lambda v: isinstance(v, str), "a comma list of names", str,
                  "a comma list of names"),
    "path": Kind(str, lambda v: isinstance(v, str), "a path", str, "a path"),
    "paths": Kind(list, _paths, "a path or a list of paths", str, "a path"),
    "texts": Kind(list, _paths, "a text or a list of texts", str, "a text"),
    "config": Kind(dict, lambda v: isinstance(v, dict), "a dict of config overrides", str,
                   "a dict"),
}


class _Same:
    """The `absent` of a field whose absence means its default."""

    def __repr__(self) -> str:
        return "SAME"


SAME: Any = _Same()
DEFAULT: Any = object()   # absent=DEFAULT: absence means the default, declared so
REQUIRED: Any = MISSING   # the default of a field that has none (a model size)


def declare(default: Any, help: str, *, kind: str = "str", flag: str | None = None,
            metavar: str | None = None, choices: tuple[str, ...] | None = None,
            cli: bool = True, absent: Any = SAME,
            check: Callable[[Any], str | None] | None = None, c_route: str | None = None,
            exports: Mapping[str, Any] | tuple[str, ...] | None = None,
            aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field with everything derived from it.

    default: the value when not given (REQUIRED: none; None: "unset", e.g.
    the preset's). help: the --help line. kind: a KINDS key (with
    `choices`, any str of them). flag / metavar: the CLI flag (default
    --NAME with _ as -) and its value's name; cli=False: no flag.
    absent: what a saved dict (a checkpoint) lacking the key means; a field
    added after checkpoints were first written declares it (its old
    behaviour), and a checkpoint then stores the key only when the value
    differs from it, so a run that does not use the field loads in an older
    version (absent=DEFAULT: absence means the default). check: a further
    check of a value, returning its error or None.
    c_route: how the C core receives the value ("struct": rx_pt_config;
    "ctx": rx_model_ctx, the model context every kernel reads).
    exports: {format: the one value that format can hold}, or a tuple of the
    formats that hold only the default. aliases: further CLI spellings of
    the flag (a shorter one users know); the config key stays the name."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}")
    return field(default=default, metadata=dict(
        help=help, kind=kind, flag=flag, metavar=metavar, choices=choices, cli=cli,
        absent=absent, check=check, c_route=c_route, aliases=tuple(aliases),
        exports=dict.fromkeys(exports, default) if isinstance(exports, tuple) else
        dict(exports or {})))


@dataclass(frozen=True)
class Entry:
    """One declared field, read back (see declare)."""
    key: str
    kind: str
    default: Any
    absent: Any
    help: str
    flag: str | None
    metavar: str | None
    choices: tuple[str, ...] | None
    check: Callable[[Any], str | None] | None
    c_route: str | None
    exports: Mapping[str, Any]
    declares_absent: bool
    aliases: tuple[str, ...] = ()   # further CLI spellings of flag

    @property
    def type(self) -> type:
        """The value's type in a config file."""
        return KINDS[self.kind].type

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def problem(self, v: Any) -> str | None:
        """Why v is no value of this field ("NAME must be ..., got V"), or
        None. None is a value where the default is None (unset)."""
        if v is None and self.default is None:
            return None
        if self.choices is not None:
            if v not in self.choices:
                return f"unknown {self.key} {v!r}; choose one of {', '.join(self.choices)}"
        elif not KINDS[self.kind].ok(v):
            return f"{self.key} must be {KINDS[self.kind].what}, got {v!r}"
        return self.check(v) if self.check is not None else None


def entries(cls: type) -> Iterator[Entry]:
    """The declared fields of dataclass `cls`, in order."""
    for f in fields(cls):
        m = f.metadata
        if "kind" not in m:
            continue
        flag = (m["flag"] or "--" + f.name.replace("_", "-")) if m["cli"] else None
        own = m["absent"] is not SAME and m["absent"] is not DEFAULT   # not the default
        yield Entry(key=f.name, kind=m["kind"], default=f.default,
                    absent=m["absent"] if own else f.default, help=m["help"], flag=flag,
                    metavar=m["metavar"], choices=m["choices"], check=m["check"],
                    c_route=m["c_route"], exports=m["exports"],
                    declares_absent=m["absent"] is not SAME,
                    aliases=m["aliases"] if m["cli"] else ())


def resolve(cls: type, saved: Mapping[str, Any]) -> dict[str, Any]:
    """`saved` (a checkpoint's dict of cls's fields) with every key it lacks
    set to what its absence means; a required key it lacks stays absent."""
    out = dict(saved)
    for e in entries(cls):
        if e.key not in out and e.absent is not REQUIRED:
            out[e.key] = e.absent
    return out


def stored(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint stores of `values`: every key but those of fields
    that declare their absence and whose value is it (an older version,
    which lacks the key, then reads the same run)."""
    absent = {e.key: e.absent for e in entries(cls) if e.declares_absent}
    return {k: v for k, v in values.items() if k not in absent or v != absent[k]}
