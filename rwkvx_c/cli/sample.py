"""rwkvx-c sample: generate text from a run's checkpoint."""
from __future__ import annotations

import argparse
import os
import sys

from rwkvx_c import _core
from rwkvx_c.cli.common import (
    Subparsers,
    add_base_flag,
    err,
    nonneg_float,
    nonneg_int,
    positive_int,
    unit_float,
)
from rwkvx_c.sample import generate, load_run

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    s = sub.add_parser("sample", help="generate text from a trained run",
                       description="Generate text from the checkpoint in DIR: the prompt is "
                       "run once, then one recurrent step per new token.")
    s.add_argument("dir", metavar="DIR", help="run folder (or checkpoint file)")
    s.add_argument("--prompt", default="", help="text to continue (default: empty, which "
                   "starts from a newline)")
    s.add_argument("--max-new-tokens", type=positive_int, default=200, metavar="N",
                   help="tokens to generate (default: 200)")
    s.add_argument("--temperature", type=nonneg_float, default=1.0, metavar="X",
                   help="0 is greedy (default: 1.0)")
    s.add_argument("--top-p", type=unit_float, default=0.9, metavar="P",
                   help="nucleus sampling mass (default: 0.9)")
    s.add_argument("--seed", type=nonneg_int, default=0, metavar="S",
                   help="seed of the sampling (default: 0)")
    s.add_argument("--threads", type=positive_int, metavar="N",
                   help="OpenMP threads (default: OMP_NUM_THREADS or every core)")
    add_base_flag(s)


def run(a: argparse.Namespace) -> int:
    if a.threads:
        if a.threads > _core.MAX_THREADS:
            return err(f"--threads must be at most {_core.MAX_THREADS}, got {a.threads}")
        _core.set_num_threads(a.threads)
    model, tok = load_run(a.dir, a.base)
    if model.config["vocab_size"] < 256:
        return err(f"the model in {a.dir} is not byte-level (vocab {model.config['vocab_size']})")
    # the prompt's own bytes, also when they are not UTF-8 (argv decodes
    # them with surrogateescape); the output is written as UTF-8 bytes
    prompt = os.fsencode(a.prompt)
    out = sys.stdout.buffer
    out.write(prompt)
    for text in generate(model, prompt, a.max_new_tokens, a.temperature, a.top_p, a.seed,
                         tokenizer=tok):
        out.write(text.encode("utf-8", "surrogateescape"))
        out.flush()
    out.write(b"\n")
    out.flush()
    return 0
