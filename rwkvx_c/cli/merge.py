"""rwkvx-c merge: a LoRA run's adapters folded into a plain run folder."""
from __future__ import annotations

import argparse

from rwkvx_c.cli.common import Subparsers, add_run_flags
from rwkvx_c.interop.runs import merge_run

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    m = sub.add_parser("merge", help="fold a LoRA run's adapters into a plain run folder",
                       description="Write a new run folder holding the LoRA run in RUN with "
                       "its adapters merged into the weights (W + (alpha/r) B A), weights "
                       "only, with its tokenizer: rwkvx-c sample runs it, and rwkvx-c train "
                       "--init-from or --resume starts a new run from it. RUN is never "
                       "written. See docs/finetune.md.")
    m.add_argument("dir", metavar="RUN", help="the LoRA run's folder (or checkpoint file)")
    m.add_argument("--out", required=True, metavar="DIR", help="the run folder to make "
                   "(required)")
    add_run_flags(m)


def run(a: argparse.Namespace) -> int:
    ckpt = merge_run(a.dir, a.out, a.base)
    print(f"rwkvx-c merge: {ckpt}\n  sample     rwkvx-c sample {a.out} --prompt 'Hello'")
    return 0
