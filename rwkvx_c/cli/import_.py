"""rwkvx-c import: a run folder made from an RWKV-7 or RWKV-X .pth, a
Hugging Face rwkv7 folder, or LoRA adapters (a PEFT folder, an RWKV-PEFT
.pth) on their base."""
from __future__ import annotations

import argparse
import os

from rwkvx_c.cli.common import Subparsers, err, positive_float
from rwkvx_c.interop.adapters import is_adapter, peft_base
from rwkvx_c.interop.runs import import_adapters, import_pth

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    i = sub.add_parser("import", help="make a run folder from an RWKV-7 .pth",
                       description="Read an RWKV-LM x070 .pth (bf16, fp16 or fp32), or an "
                       "RWKV-X one, a Hugging Face rwkv7 folder (safetensors, sharded or "
                       "not), or an rwkv7 GGUF (dequantized), into a new run folder that "
                       "rwkvx-c sample runs and "
                       "rwkvx-c train --resume continues training from. With --base, FILE is "
                       "a LoRA adapter (a PEFT adapter folder written for the hf export, or "
                       "an RWKV-PEFT LoRA .pth) and the run is a LoRA run on BASE that "
                       "train --resume trains on. See docs/interop.md.")
    i.add_argument("file", metavar="FILE", help="x070 state dict or RWKV-X checkpoint (.pth), "
                   "a Hugging Face folder, an rwkv7 .gguf, or (with --base) a LoRA adapter")
    i.add_argument("--out", required=True, metavar="DIR", help="the run folder to make "
                   "(required)")
    i.add_argument("--base", metavar="PATH", help="the model FILE's adapters sit on: a run "
                   "folder, checkpoint, .pth or Hugging Face folder (default: none; for a PEFT "
                   "folder, the local folder its adapter_config.json names)")
    i.add_argument("--lora-alpha", type=positive_float, metavar="A", help="the adapters' "
                   "alpha, for an RWKV-PEFT .pth that does not record it (default: the file's)")
    i.add_argument("--lora-init", metavar="FILE", help="for an RWKV-PEFT PiSSA checkpoint: "
                   "its init_pissa.pth, the initial adapters its base held subtracted "
                   "(default: none; FILE's lora_A / lora_B are then plain LoRA)")


def run(a: argparse.Namespace) -> int:
    if a.base or is_adapter(a.file):
        base = a.base or (peft_base(a.file) if os.path.isdir(a.file) else None)
        if base is None:
            return err(f"{a.file} holds LoRA adapters and names no local base; give the model "
                       "they sit on with --base", 2)
        ckpt = import_adapters(a.file, base, a.out, a.lora_alpha, a.lora_init)
    elif a.lora_alpha is not None or a.lora_init is not None:
        flag = "--lora-alpha" if a.lora_alpha is not None else "--lora-init"
        return err(f"{flag} belongs to LoRA adapters; FILE holds none", 2)
    else:
        ckpt = import_pth(a.file, a.out)
    print(f"rwkvx-c import: {ckpt}\n  sample     rwkvx-c sample {a.out} --prompt 'Hello'\n"
          f"  train      rwkvx-c train --resume --out {a.out}")
    return 0
