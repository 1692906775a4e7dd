"""Every error rwkvx_c reports as one line, under one base.

A caller that wants "bad input or a bad environment, say it and stop"
catches ``RwkvxError``; the ``rwkvx-c`` command does exactly that and
prints the message, while anything else is a bug and keeps its traceback.
Each class also derives from the built-in exception it always was
(ValueError, OSError, MemoryError, FloatingPointError), so code written
against those keeps working.

The classes live here, not in the modules that raise them, so that this
list is the one place to read them and no layer imports another just to
name its error.
"""
from __future__ import annotations

__all__ = [
    "RwkvxError",
    "ConfigError",
    "CheckpointError",
    "RunLocked",
    "MemoryTooSmall",
    "DataError",
    "TokenizerError",
    "TrainError",
    "Divergence",
    "DistributedError",
    "InteropError",
    "EvalError",
    "OutputError",
    "SampleError",
    "ApiError",
    "RwkvxWarning",
]


class RwkvxError(Exception):
    """Base of every expected failure: its message is the whole story."""


class ConfigError(RwkvxError, ValueError):
    """A model config that cannot be built (rwkvx_c.model.config)."""


class CheckpointError(RwkvxError, ValueError):
    """A checkpoint that is missing, truncated, corrupt or does not fit."""


class RunLocked(RwkvxError, OSError):
    """The run folder is locked by another process."""


class MemoryTooSmall(RwkvxError, MemoryError):
    """The run would not fit in the available memory."""


class DataError(RwkvxError, ValueError):
    """A corpus that cannot be used (missing, empty, unreadable, too small)."""


class TokenizerError(RwkvxError, ValueError):
    """A tokenizer that cannot be loaded, or does not match a run."""


class TrainError(RwkvxError, ValueError):
    """A training setup that cannot run (bad option, data, checkpoint or resume)."""


class Divergence(RwkvxError, FloatingPointError):
    """The run diverged at `step`; `reason` says how (rwkvx_c.train.guard)."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(f"the run diverged at step {step}: {reason}")
        self.step = step
        self.reason = reason

    def __reduce__(self) -> tuple[type[Divergence], tuple[int, str], dict[str, object]]:
        # pickled across MPI ranks (rwkvx_c.train.distributed): rebuilt from
        # its fields, with its attributes (the failing rank) as state
        return (Divergence, (self.step, self.reason), dict(self.__dict__))


class DistributedError(RwkvxError, ValueError):
    """A distributed set-up that cannot run (mpi4py missing, bad batch split)."""


class InteropError(RwkvxError, ValueError):
    """A model or file that the requested format cannot hold or that is not
    a valid file of it (one line, saying why)."""


class EvalError(RwkvxError, ValueError):
    """An evaluation that cannot run: a missing extra, a bad task or option
    (rwkvx_c.eval)."""


class OutputError(RwkvxError, ValueError):
    """An output path that would overwrite an input, a run folder's own
    files, or a folder that holds something else (rwkvx_c.run.rundir.check_output)."""


class SampleError(RwkvxError, ValueError):
    """A generation that cannot run or went wrong (rwkvx_c.sample): more
    tokens than a sequence can hold, a model whose logits are not finite."""


class ApiError(RwkvxError, ValueError):
    """A request the HTTP server (rwkvx_c.server) refuses: its HTTP status,
    the parameter at fault, and OpenAI's error type; body() is the answer."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict[str, object]:
        """OpenAI's error shape."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}


class RwkvxWarning(UserWarning):
    """Something a user should know that does not stop the work (a
    validation split too small to judge by, a tracker that failed); the
    command line prints it as one line."""
