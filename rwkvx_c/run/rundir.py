"""The run folder: the one owner of its file names and of what happens to them.

A run folder holds the files of RUN_FILES, the one list of them: every
check of a name (a run's own file, a foreign entry, what an output may not
overwrite, what marks a run, what an input folder stands for) derives from
it, and docs/training.md §The run folder's table is checked against it
(tests/test_outputs.py). The log is appended as the run goes and cut back
to the checkpoint's step when a run resumes (work after the checkpoint is
redone).

New runs without a name go under ``runs/`` of the working folder, named by
their start time; ``RunDir.latest`` finds the newest one with a checkpoint.
Every write is atomic (rwkvx_c.util.atomic) except the log's appends,
which add whole lines.
"""
from __future__ import annotations

import datetime
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from rwkvx_c.errors import CheckpointError, OutputError
from rwkvx_c.run.checkpoint import Checkpoint, read_checkpoint, read_state, save_checkpoint
from rwkvx_c.run.lock import LOCK_NAME, RunLock
from rwkvx_c.util.atomic import replacing, sweep_orphans

__all__ = ["RunDir", "RunFile", "RUN_FILES", "CHECKPOINT", "BEST", "CONFIG", "LOG", "TOKENIZER",
           "PLOT", "REFERENCE", "LOCK", "RUNS_ROOT", "SNAPSHOTS", "PINS",
           "CHOICES", "checkpoint_path", "claim_output", "describe_entries"]

CHECKPOINT = "checkpoint.safetensors"
CONFIG = "config.toml"
BEST = "best.safetensors"
LOG = "log.jsonl"
TOKENIZER = "tokenizer.json"
PLOT = "loss.png"
REFERENCE = "reference_logps.npy"
LOCK = LOCK_NAME
SNAPSHOTS = "checkpoint-STEP.safetensors"
_SNAPSHOT = re.compile("^" + re.escape(SNAPSHOTS).replace("STEP", r"(\d+)") + "$")
PINS = "source-SHA.safetensors"
_PIN = re.compile("^" + re.escape(PINS).replace("SHA", "[0-9a-f]{16}") + "$")
RUNS_ROOT = "runs"
_STAMP = "%Y%m%d-%H%M%S"


@dataclass(frozen=True)
class RunFile:
    """One file of a run folder: its name, what it holds (docs/training.md
    §The run folder), and whether its presence says a run lives there."""
    name: str
    holds: str
    marks_run: bool = False


# every file a run owns, in the order RunDir.own_files gives them
RUN_FILES = (
    RunFile(CHECKPOINT, "model, optimiser moments and run state (rwkvx_c.run.checkpoint)",
            marks_run=True),
    RunFile(LOG, "one JSON row per step or evaluation", marks_run=True),
    RunFile(TOKENIZER, "a copy of the run's tokenizer file, when it has one (byte and World "
            "runs need none)"),
    RunFile(PLOT, "the loss plot"),
    RunFile(REFERENCE, "a preference run's reference log-probabilities"),
    RunFile(LOCK, "the lock of the process writing the folder (rwkvx_c.run.lock)",
            marks_run=True),
    RunFile(BEST, "--keep-best: the checkpoint of the lowest validation loss"),
    RunFile(CONFIG, "the run's resolved options (rwkvx_c.train.config_file)"),
    RunFile(SNAPSHOTS, "--keep-last: the checkpoint of step STEP (7 digits)"),
    RunFile(PINS, "a fine-tune's pin of a run checkpoint it starts from (--init-from, and "
            "that run's own base, down the chain; --ref-from), as it was when the tune "
            "started: a hard link, else a copy; SHA: the first 16 hex digits of the SHA-256 "
            "it is recorded by"),
)
_NAMES = frozenset(f.name for f in RUN_FILES if f.name not in (SNAPSHOTS, PINS))
_MARKS = tuple(f.name for f in RUN_FILES if f.marks_run)


def _own_name(name: str) -> bool:
    """True for the name of a file a run folder's run owns (RUN_FILES)."""
    return name in _NAMES or bool(_SNAPSHOT.match(name)) or bool(_PIN.match(name))


# one log row: JSON values by name
Row = dict[str, Any]


CHOICES = ("last", "best")   # --checkpoint: which checkpoint of a run folder a reader takes


def checkpoint_path(path: str, which: str | None = None) -> str:
    """The checkpoint file a reader takes of a run folder, or `path` itself
    when it names a file. which: "last" (checkpoint.safetensors), "best"
    (best.safetensors; OutputError when the run kept none) or None: best
    when the run keeps it (--keep-best in its last checkpoint's options)
    and it is there, else last."""
    if not os.path.isdir(path):
        if which is not None:
            raise CheckpointError(f"--checkpoint {which} picks a checkpoint of a run folder; "
                              f"{path} is a file: drop --checkpoint or give the folder")
        return path
    run = RunDir(path)
    if which == "best" and not os.path.isfile(run.best):
        raise CheckpointError(f"{path} holds no {BEST}: it was not trained with --keep-best")
    if which == "best" or (which is None and run.keeps_best()):
        return run.best
    return run.checkpoint


class RunDir:
    """The files of one run folder (which need not exist yet)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def __repr__(self) -> str:
        return f"RunDir({self.path!r})"

    def __str__(self) -> str:
        return self.path

    # ----------------------------------------------------------- names
    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def checkpoint(self) -> str:
        return self.file(CHECKPOINT)

    @property
    def log_path(self) -> str:
        return self.file(LOG)

    @property
    def tokenizer_path(self) -> str:
        return self.file(TOKENIZER)

    @property
    def plot_path(self) -> str:
        return self.file(PLOT)

    @property
    def reference_path(self) -> str:
        return self.file(REFERENCE)

    @property
    def config(self) -> str:
        return self.file(CONFIG)

    @property
    def best(self) -> str:
        return self.file(BEST)

    def snapshot(self, step: int) -> str:
        """The --keep-last snapshot of the checkpoint of `step`."""
        return self.file(SNAPSHOTS.replace("STEP", f"{step:07d}"))

    def snapshots(self) -> list[str]:
        """The step snapshots in the folder, oldest step first."""
        try:
            names = os.listdir(self.path)
        except OSError:
            return []
        found = sorted((int(m.group(1)), n) for n in names if (m := _SNAPSHOT.match(n)))
        return [self.file(n) for _, n in found]

    def pin(self, sha: str) -> str:
        """The pin of the checkpoint whose SHA-256 is sha (rwkvx_c.run.base)."""
        return self.file(PINS.replace("SHA", sha[:16]))

    def pins(self) -> list[str]:
        """The pins in the folder, by name."""
        try:
            names = os.listdir(self.path)
        except OSError:
            return []
        return [self.file(n) for n in sorted(names) if _PIN.match(n)]

    def own_files(self) -> tuple[str, ...]:
        """Every file the folder's run owns (whether it exists or not), its
        snapshots and its pins."""
        return tuple(self.file(f.name) for f in RUN_FILES if f.name in _NAMES) \
            + tuple(self.snapshots()) + tuple(self.pins())

    # ------------------------------------------------------- the folder
    @classmethod
    def new(cls, root: str = RUNS_ROOT) -> RunDir:
        """A name for a new run under root, from the time, never an existing one."""
        base = os.path.join(root, datetime.datetime.now().strftime(_STAMP))
        d, i = base, 1
        while os.path.exists(d):
            i += 1
            d = f"{base}-{i}"
        return cls(d)

    @classmethod
    def latest(cls, root: str = RUNS_ROOT) -> RunDir | None:
        """The most recently written run under root that has a checkpoint."""
        if not os.path.isdir(root):
            return None
        runs = [cls(os.path.join(root, d)) for d in os.listdir(root)]
        saved = [r for r in runs if os.path.exists(r.checkpoint)]
        return max(saved, key=lambda r: os.path.getmtime(r.path)) if saved else None

    def exists(self) -> bool:
        return os.path.isdir(self.path)

    def create(self) -> None:
        os.makedirs(self.path, exist_ok=True)

    def has_checkpoint(self) -> bool:
        return os.path.exists(self.checkpoint)

    def keeps_best(self) -> bool:
        """True when the run keeps best.safetensors (its last checkpoint's
        options say --keep-best) and the file is there."""
        opts = read_state(self.checkpoint).get("options") if self.has_checkpoint() else None
        return isinstance(opts, dict) and opts.get("keep_best") is True \
            and os.path.isfile(self.best)

    def holds_run(self) -> bool:
        """True when a run lives here: a file of RUN_FILES that marks one
        (a checkpoint, a log or a lock)."""
        return any(os.path.lexists(self.file(n)) for n in _MARKS)

    def foreign_entries(self) -> list[str]:
        """The entries of an existing folder that are not a run's (its own
        files and the temporaries of their atomic writes), sorted."""
        try:
            names = os.listdir(self.path)
        except OSError:
            return []
        return sorted(n for n in names if not _own_name(n)
                      and not (n.startswith(".") and _own_name(n[1:].split(".tmp")[0])))

    def lock(self) -> RunLock:
        """Exclusive use of the folder (RunLocked when another process has it)."""
        return RunLock(self.path)

    # ------------------------------------------------------- checkpoint
    def read_checkpoint(self) -> Checkpoint:
        return read_checkpoint(self.checkpoint)

    def save_checkpoint(self, tensors: Mapping[str, np.ndarray], config: Mapping[str, Any],
                        state: Mapping[str, Any]) -> str:
        save_checkpoint(self.checkpoint, tensors, config, state)
        return self.checkpoint

    # -------------------------------------------------------------- log
    def append_log(self, rows: Iterable[Row]) -> None:
        """Append rows to log.jsonl, one JSON object per line."""
        with open(self.log_path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)

    def read_log(self) -> list[Row]:
        """The rows of log.jsonl ([] when there is none); a torn last line is skipped."""
        if not os.path.exists(self.log_path):
            return []
        rows = []
        with open(self.log_path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    rows.append(row)
        return rows

    def truncate_log(self, step: int) -> None:
        """Drop the rows past `step` (atomically): the work after a checkpoint, redone."""
        if not os.path.exists(self.log_path):
            return
        keep = [r for r in self.read_log() if r.get("step", 0) <= step]
        with replacing(self.log_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)

    def remove_log(self) -> None:
        """Delete the log (the rows of a run that never saved)."""
        if os.path.exists(self.log_path):
            os.unlink(self.log_path)


def _same_file(a: str, b: str) -> bool:
    """True when a and b name one file (hard links and symbolic links
    included; by resolved path when either does not exist)."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return os.path.realpath(a) == os.path.realpath(b)


def claim_output(out: str, inputs: Iterable[str] = (), flag: str = "--out") -> None:
    """Checks that writing the file `out` destroys no input, then removes
    the temporaries killed writes of it left (rwkvx_c.util.atomic).

    OutputError when out is a folder, one of `inputs` (a run folder among
    them stands for its own files), or one of the own files (RUN_FILES) of
    a folder that holds a run, whichever path leads there (links included). The write itself
    then goes through the atomic path, so an unrelated file at out is
    replaced whole or not at all."""
    if os.path.isdir(out):
        raise OutputError(f"{flag} {out} is a folder; name the file to write")
    real = os.path.realpath(out)
    folder, name = os.path.split(real)
    run = RunDir(folder)
    if _own_name(name) and run.holds_run():
        raise OutputError(f"{flag} {out} is the {name} of the run in {folder}; writing it "
                          "would destroy the run: choose another file")
    for p in inputs:
        for c in (RunDir(p).own_files() + (p,)) if os.path.isdir(p) else (p,):
            if _same_file(out, c):
                raise OutputError(f"{flag} {out} is the input {c}; choose another file")
    # the temporaries lie beside out as named, not beside what it links to
    here, base = os.path.split(os.path.abspath(out))
    sweep_orphans(here, f".{base}.tmp")


def describe_entries(names: list[str], show: int = 3) -> str:
    """'a.txt, b.py and 4 more' for a message about a folder's entries."""
    head = ", ".join(names[:show])
    return head + (f" and {len(names) - show} more" if len(names) > show else "")
