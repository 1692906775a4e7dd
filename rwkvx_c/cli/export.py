"""rwkvx-c export: a run's model as a file another tool reads."""
from __future__ import annotations

import argparse
import os

from rwkvx_c.cli.common import Subparsers, add_run_flags, err
from rwkvx_c.interop.gguf import GGUF_DTYPES, QUANTS
from rwkvx_c.interop.runs import EXPORTS, FORMATS, Adapters, export_model, formats_holding
from rwkvx_c.model.lora import ADAPTERS, adapters_of, magnitudes_of, plain_alpha, run_adapter
from rwkvx_c.model.parts import STATES, part_of
from rwkvx_c.run.base import BASE_KEY, short
from rwkvx_c.run.checkpoint import STATE_KEY, read_checkpoint, read_state
from rwkvx_c.run.rundir import checkpoint_path
from rwkvx_c.sample import load_run, run_template
from rwkvx_c.train.finetune import parse_parts

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    says = "; ".join(f"{f.name}: {f.says}" for f in EXPORTS.values())
    folders = " and ".join(f.name for f in EXPORTS.values() if f.folder)
    e = sub.add_parser("export", help="write a trained model for another tool",
                       description=f"Write the model in DIR for another tool ({says}); a "
                       "LoRA run's model files hold its adapters merged. See docs/interop.md, "
                       "docs/finetune.md.")
    e.add_argument("dir", metavar="DIR", help="run folder (or checkpoint file)")
    e.add_argument("--format", required=True, choices=list(FORMATS),
                   help="the file format (required)")
    e.add_argument("--out", required=True, metavar="FILE",
                   help=f"the file to write (a folder for {folders}) (required)")
    e.add_argument("--dtype", default="fp32", choices=list(GGUF_DTYPES),
                   help="tensor type of the file's matrices (default: fp32; q8_0, q4_0 and q4_k, "
                   "GGUF's blocks, for --format gguf: a frozen base of that type is "
                   "written as it is)")
    add_run_flags(e)


def run(a: argparse.Namespace) -> int:
    run_state = read_state(checkpoint_path(a.dir))
    opts = run_state.get("options") or {}
    # a GGUF of blocks takes a frozen base's blocks as they are (its LoRA
    # adapters, merged, make new matrices: those are quantized once)
    hold = a.format == "gguf" and a.dtype in QUANTS and opts.get("tune") != "lora"
    # a state export writes no weight: a frozen base is held as it trained, never float32
    hold = hold or EXPORTS[a.format].holds == "state"
    # an export reads and writes every weight: one more pass hashing the base is cheap
    model, tok = load_run(a.dir, a.base, rehash=True, hold_base=hold)
    if a.format in ("gguf", "gguf-lora") and tok.name not in ("byte", "world"):
        # the GGUF holds its vocabulary, and llama.cpp's rwkv7 knows byte and World only
        return err(f"the run in {a.dir} uses a {tok.name} tokenizer; a GGUF export needs "
                   "the byte or the World tokenizer (train with --tokenizer byte or world); "
                   "--format hf holds this run with its tokenizer")
    # the checkpoint and, beside it, the tokenizer.json load_run read
    inputs = [a.dir, os.path.dirname(os.path.abspath(a.dir))] if os.path.isfile(a.dir) \
        else [a.dir]
    # past --unfreeze-at a LoRA run's adapters live on in its base weights alone
    merged_base = opts.get("tune") == "lora" and bool(run_state.get("unfrozen"))
    adapters: Adapters | None = None
    holds = EXPORTS[a.format].holds
    if holds == "adapters":   # load_run merged them: read them again
        if merged_base:
            return err(f"the LoRA run in {a.dir} merged its adapters into the base at "
                       f"--unfreeze-at {opts.get('unfreeze_at')}; export the model instead "
                       f"(--format {formats_holding('model')})")
        p = checkpoint_path(a.dir)
        tensors, _, state = read_checkpoint(p)
        ads = adapters_of(tensors)
        if ads:
            kind, r, alpha = run_adapter(state, p)
            if ADAPTERS[kind].principal:   # PEFT's converted form: plain LoRA at rank 2r
                kind, alpha = "lora", plain_alpha(kind, r, alpha)
            # the groups it trained beside them (--train-parts): RWKV-PEFT's file holds them too
            groups = parse_parts(opts.get("train_parts"), "--train-parts")
            parts = [n for n in model.param_names if part_of(n, model.layers) in groups] + \
                ([STATE_KEY] if STATES in groups and model.state is not None else [])
            adapters = (ads, alpha, kind, magnitudes_of(tensors), parts)
    export_model(model, a.format, a.out, a.dtype, inputs=inputs, tokenizer=tok,
                 adapters=adapters, chat_template=run_template(a.dir).source)
    print(f"rwkvx-c export: {a.out} ({a.format}, {a.dtype})")
    if opts.get("tune") == "lora" and not merged_base and holds == "model":
        base = run_state.get(BASE_KEY)
        into = "this model" if not base else \
            f"the original weights of its base, read again from {a.base or base['path']} " \
            f"({short(base)}, as the run recorded)"
        print(f"rwkvx-c export: the LoRA adapters are merged into {into}; "
              f"--format {formats_holding('adapters')} writes them alone")
    if holds == "state":
        print(f"rwkvx-c export: {_state_readers(model.config, a.dir)}")
    if model.state is not None and holds != "state":
        print("rwkvx-c export: the model's trained initial states are not in this file; they "
              "travel separately: rwkvx-c export DIR --format state --out FILE")
    return 0


def _state_readers(config: dict[str, int], run_dir: str) -> str:
    """Which tools run the states a state export wrote, said after it."""
    if config["n_attn_layer"]:
        return ("these states belong to a hybrid (its RWKV blocks, numbered among them); "
                "no other tool runs RWKV-X with MoBA attention and initial states: rwkvx_c "
                f"does (rwkvx-c sample {run_dir}, rwkvx-c train --init-from {run_dir})")
    return ("RWKV-PEFT and the rwkv package run these states on the model's --format rwkv7 "
            "export (state[3*i+1] of the rwkv package's x070 model)")
