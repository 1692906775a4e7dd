"""rwkvx-c tokenizer train: fit a byte-level BPE on a corpus's training files."""
from __future__ import annotations

import argparse

from rwkvx_c.cli.common import Parser, Subparsers, checked
from rwkvx_c.data.formats import iter_documents
from rwkvx_c.data.sources import is_val_file, source_files
from rwkvx_c.data.tokenizers import MAX_TOKENIZER_VOCAB, train_bpe
from rwkvx_c.util.words import counted

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    k = sub.add_parser("tokenizer", help="fit a tokenizer on a corpus")
    ksub = k.add_subparsers(dest="tok_cmd", metavar="{train}", parser_class=Parser)
    ksub.required = True
    kt = ksub.add_parser("train", help="fit a byte-level BPE (needs rwkvx_c[hf])",
                         description="Fit a byte-level BPE tokenizer with the tokenizers "
                         "library on the training files of DATA (same formats as train "
                         "--data) and write its tokenizer.json.")
    kt.add_argument("data", metavar="DATA", nargs="*", help="corpus paths (default: the Python "
                    "standard library's .py files)")
    kt.add_argument("--vocab-size", type=checked(int, lambda v: 256 < v <= MAX_TOKENIZER_VOCAB,
                                                 f"an integer in 257..{MAX_TOKENIZER_VOCAB}"),
                    required=True, metavar="N", help="ids in the vocabulary (required)")
    kt.add_argument("--out", required=True, metavar="FILE", help="the tokenizer.json to write "
                    "(required)")
    kt.add_argument("--text-field", default="text", metavar="NAME",
                    help="the text field of .jsonl records (default: text)")
    kt.add_argument("--no-progress", action="store_true",
                    help="no progress bar (default: the tokenizers library's bar)")


def run(a: argparse.Namespace) -> int:
    files = [f for f in source_files(a.data or None) if not is_val_file(f[0])]
    docs = (d for d, _ in iter_documents(files, a.text_field))
    tok = train_bpe(docs, a.vocab_size, a.out, progress=not a.no_progress,
                    inputs=[f[1] for f in files])
    print(f"wrote {a.out}: byte-level BPE, {tok.vocab_size:,} ids, fitted on "
          f"{counted(len(files), 'file')}")
    return 0
