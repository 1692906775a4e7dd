"""rwkvx-c import: a run folder made from an RWKV-7 or RWKV-X .pth, or a
Hugging Face rwkv7 folder."""
from __future__ import annotations

import argparse

from rwkvx_c.cli.common import Subparsers
from rwkvx_c.interop.runs import import_pth

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    i = sub.add_parser("import", help="make a run folder from an RWKV-7 .pth",
                       description="Read an RWKV-LM x070 .pth (bf16, fp16 or fp32), or an "
                       "RWKV-X one, or a Hugging Face rwkv7 folder (safetensors, sharded or "
                       "not), into a new run folder that rwkvx-c sample runs and "
                       "rwkvx-c train --resume continues training from.")
    i.add_argument("file", metavar="FILE", help="x070 state dict or RWKV-X checkpoint (.pth), "
                   "or a Hugging Face folder")
    i.add_argument("--out", required=True, metavar="DIR", help="the run folder to make "
                   "(required)")


def run(a: argparse.Namespace) -> int:
    ckpt = import_pth(a.file, a.out)
    print(f"rwkvx-c import: {ckpt}\n  sample     rwkvx-c sample {a.out} --prompt 'Hello'\n"
          f"  train      rwkvx-c train --resume --out {a.out}")
    return 0
