"""rwkvx-c chat: a multi-turn conversation with a run in the terminal, in
the chat template its chat data trained with (rwkvx_c.sample.Chat)."""
from __future__ import annotations

import argparse
import sys

from rwkvx_c.cli.common import Subparsers, add_run_flags, err, positive_int
from rwkvx_c.cli.sample import add_sampling_args, sampling_of, set_threads
from rwkvx_c.sample import Chat, Sampling, load_run, run_template

__all__ = ["add_parser", "run", "CHAT_DEFAULTS", "CONTEXT"]

# the sampling of the rwkv package's API_DEMO_CHAT
CHAT_DEFAULTS = Sampling(temperature=1.0, top_p=0.3, alpha_presence=0.0, alpha_frequency=1.0,
                         alpha_decay=0.996)
CONTEXT = 16384   # positions of a model with attention (its key/value cache)


def add_parser(sub: Subparsers) -> None:
    s = sub.add_parser("chat", help="talk with a trained run, turn by turn",
                       description="A conversation with the checkpoint in DIR, in the chat "
                       "template it trained with (--chat-template; RWKV's by default): each "
                       "line you type is a user turn, the reply an assistant turn stopped at "
                       "the turn's end; the state carries from turn to turn. End with Ctrl-D.")
    s.add_argument("dir", metavar="DIR", help="run folder (or checkpoint file)")
    s.add_argument("--system", metavar="TEXT",
                   help="a system turn the conversation starts with (default: none)")
    s.add_argument("--max-new-tokens", type=positive_int, default=500, metavar="N",
                   help="most tokens of one reply (default: 500)")
    s.add_argument("--context", type=positive_int, default=CONTEXT, metavar="N",
                   help="most positions the conversation may reach with a model that has "
                   f"attention blocks (default: {CONTEXT}); without them it is unbounded")
    add_sampling_args(s, CHAT_DEFAULTS)
    add_run_flags(s)


def run(a: argparse.Namespace) -> int:
    bad = set_threads(a)
    if bad:
        return err(bad)
    model, tok = load_run(a.dir, a.base, hold_base=True)
    chat = Chat(model, tok, sampling_of(a), a.max_new_tokens, a.context, a.seed, a.system,
                run_template(a.dir))
    out = sys.stdout
    while True:
        try:
            line = input("User: ")
        except EOFError:
            out.write("\n")
            return 0
        if not sys.stdin.isatty():   # a terminal echoes the typed line; a pipe does not
            out.write(line + "\n")
        if not line.strip():
            continue
        out.write("Assistant:")
        for piece in chat.say(line):
            out.write(piece)
            out.flush()
        out.write("\n\n")
        out.flush()
