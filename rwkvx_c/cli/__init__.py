"""The rwkvx-c command (also ``python -m rwkvx_c``), one module per subcommand.

    rwkvx-c train [--data PATH ...] [--preset tiny|S|M|default] [--steps N] [...]
    rwkvx-c sample DIR --prompt TEXT [--max-new-tokens N] [--temperature X] [--stop STR] [...]
    rwkvx-c chat DIR [--system TEXT] [--max-new-tokens N] [--temperature X] [...]
    rwkvx-c export DIR --format rwkv7|rwkvx|gguf|hf|state|lora --out FILE [--dtype ...]
    rwkvx-c import FILE.pth|HF_DIR --out DIR
    rwkvx-c merge RUN --out DIR
    rwkvx-c eval DIR [--data PATH ...] [--lambada FILE] [--passkey] [--tasks TASK ...] [--json]
    rwkvx-c tokenizer train [DATA ...] --vocab-size N --out tok.json
    rwkvx-c serve DIR [--host 127.0.0.1] [--port 8000] [--slots B] [...]

Bad input is one line on stderr naming the problem and a non-zero exit
status (2 for bad flags, 1 otherwise); no traceback, and an existing
checkpoint is never touched by a run that fails to start. Every expected
failure is an rwkvx_c.errors.RwkvxError (or an OSError or MemoryError from
the environment); anything else is a bug and shows its traceback. A
diverged run stops with status 1 (or rolls back, with --on-divergence
rollback); Ctrl-C ends a run after its checkpoint (status 130), a second
Ctrl-C at once.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import TextIO

from rwkvx_c import __version__
from rwkvx_c.cli import chat, eval, export, import_, merge, sample, serve, tokenizer, train
from rwkvx_c.cli.common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    Parser,
    describe_error,
    err,
    pick_checkpoint,
)
from rwkvx_c.errors import RwkvxError, RwkvxWarning
from rwkvx_c.train.distributed import abort_job

__all__ = ["main", "build_parser"]

# subcommand name -> its module (add_parser, run)
COMMANDS = {"train": train, "sample": sample, "chat": chat, "export": export, "import": import_,
            "merge": merge, "tokenizer": tokenizer, "eval": eval, "serve": serve}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="rwkvx-c", description="CPU training of RWKV-X language models.")
    p.add_argument("--version", action="version", version=f"rwkvx-c {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="{" + ",".join(COMMANDS) + "}",
                           parser_class=Parser)
    sub.required = True
    for mod in COMMANDS.values():
        mod.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = COMMANDS[args.cmd].run
    try:
        with warnings.catch_warnings():   # restores showwarning after the command
            warnings.showwarning = _show_warning
            if hasattr(args, "checkpoint"):
                pick_checkpoint(args)
            return run(args)
    except BrokenPipeError:
        # the reader went away (`| head`): silence the flush at exit too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILURE
    except KeyboardInterrupt:
        sys.stderr.write("\nrwkvx-c: interrupted\n")
        return EXIT_INTERRUPTED
    except RwkvxError as e:
        # raised on every rank alike (set-up agrees across ranks, the guard
        # sees the averaged loss): each says it and ends, nothing to abort
        return err(describe_error(e))
    except (MemoryError, OSError) as e:
        abort_job(e)  # under MPI the other ranks must not wait for this one
        return err(describe_error(e))
    except BaseException as e:
        abort_job(e)  # under MPI: report this rank's failure and end every rank
        raise
    finally:
        if argv is None:
            # the command is over: a late Ctrl-C (a second one arriving as the
            # first one's clean stop finishes) must not kill the exiting process
            _ignore_sigint()


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: TextIO | None = None, line: str | None = None) -> None:
    """An RwkvxWarning as one line, as the errors are; any other as Python shows it."""
    if issubclass(category, RwkvxWarning):
        sys.stderr.write(f"rwkvx-c: warning: {message}\n")
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _ignore_sigint() -> None:
    """SIG_IGN for SIGINT. A Ctrl-C landing while it is being set (before
    the handler is swapped, KeyboardInterrupt is raised inside signal.signal)
    only means setting it again; once it is set, pending ones are dropped."""
    while True:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            return
        except KeyboardInterrupt:
            continue


if __name__ == "__main__":
    sys.exit(main())
