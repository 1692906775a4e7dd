"""What every subcommand shares: the parser with one-line errors and no
abbreviated flags, the checked argument types, and how an expected failure
becomes one line on stderr."""
from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

from rwkvx_c.errors import RwkvxError
from rwkvx_c.run.rundir import CHOICES, RunDir, checkpoint_path
from rwkvx_c.util.registry import KINDS

T = TypeVar("T")

__all__ = ["Parser", "Subparsers", "checked", "positive_int", "nonneg_int", "positive_float",
           "nonneg_float", "unit_float", "ARG_TYPES", "err", "describe_error", "EXIT_USAGE",
           "EXIT_FAILURE", "EXIT_INTERRUPTED", "add_run_flags", "pick_checkpoint"]

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a command that reads a run: --checkpoint, which of its
    checkpoints, and --base PATH, where a fine-tune's base lies now when it
    moved (its checkpoint names the base instead of holding it:
    docs/finetune.md)."""
    p.add_argument("--checkpoint", choices=CHOICES, help="which checkpoint of the run folder: "
                   "its last, or best.safetensors (default: best when the run was trained with "
                   "--keep-best, else last)")
    p.add_argument("--base", metavar="PATH", help="a fine-tune whose base (--init-from) moved: "
                   "its path now, checked against the content hash the run recorded (default: "
                   "the path the run recorded)")


def pick_checkpoint(a: argparse.Namespace) -> None:
    """a.dir, a run folder, as the checkpoint file the command reads
    (rwkvx_c.run.rundir.checkpoint_path); any other source stays as given."""
    d = getattr(a, "dir", None)
    if d and (a.checkpoint is not None or (os.path.isdir(d) and RunDir(d).has_checkpoint())):
        a.dir = checkpoint_path(d, a.checkpoint)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, and long flags taken only when spelt
    out: `--step 3` is an error, not `--steps 3`."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        """argparse's, with a flag spelt with underscores (`--lora_r`, as
        RWKV-LM and RWKV-PEFT spell theirs) taken as its hyphenated self, and
        an unknown flag of a subcommand answered with the nearest known one."""
        argv = [self._spelt(a) for a in (sys.argv[1:] if args is None else args)]
        ns, extras = super().parse_known_args(argv, namespace)
        if extras and not self._subparsers:   # a leaf: nothing else would take them
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._hint(extras)}")
        return ns, extras

    def _spelt(self, arg: str) -> str:
        """--a_b[=V] as --a-b[=V] when that is a flag of this parser and --a_b is not."""
        name, eq, value = arg.partition("=")
        if not name.startswith("--") or "_" not in name or name in self._option_string_actions:
            return arg
        dashed = "--" + name[2:].replace("_", "-")
        return dashed + eq + value if dashed in self._option_string_actions else arg

    def _hint(self, extras: list[str]) -> str:
        """"; did you mean --x?" for the first unknown flag close to a known one."""
        known = [o for o in self._option_string_actions if o.startswith("--")]
        for a in extras:
            if a.startswith("--"):
                near = difflib.get_close_matches(a.partition("=")[0], known, n=1, cutoff=0.6)
                if near:
                    return f" (did you mean {near[0]}?)"
        return ""


Subparsers = argparse._SubParsersAction   # the type add_subparsers returns


def checked(conv: Callable[[str], T], ok: Callable[[T], bool], what: str) -> Callable[[str], T]:
    """An argparse type: conv(s), which must satisfy ok, else "expected <what>"."""
    def parse(s: str) -> T:
        try:
            v = conv(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return v
    return parse


# the value kinds of declared fields (rwkvx_c.util.registry), as argparse types
ARG_TYPES: dict[str, Callable[[str], Any]] = {
    name: checked(k.parse, k.ok, k.cli_what) for name, k in KINDS.items()
    if k.type is not dict and k.type is not bool}
positive_int = ARG_TYPES["pos_int"]
nonneg_int = ARG_TYPES["nonneg_int"]
positive_float = ARG_TYPES["pos_float"]
nonneg_float = ARG_TYPES["nonneg_float"]
unit_float = ARG_TYPES["unit_float"]


def err(msg: str, code: int = EXIT_FAILURE) -> int:
    sys.stderr.write(f"rwkvx-c: error: {msg}\n")
    return code


def describe_error(e: BaseException) -> str:
    """The one line an expected failure prints (RwkvxError, OSError, MemoryError)."""
    if isinstance(e, OSError) and not isinstance(e, RwkvxError) and e.filename:
        return f"{e.strerror}: {e.filename}"
    if isinstance(e, MemoryError) and not isinstance(e, RwkvxError):
        return f"out of memory: {e}"
    rank = getattr(e, "rank", 0)   # set by rwkvx_c.train.distributed on another rank's error
    return str(e) + (f" (on rank {rank})" if rank else "")
