"""rwkvx-c serve: a run (or any model `--init-from` takes as a run folder or
checkpoint) behind an OpenAI-compatible HTTP API (rwkvx_c.server)."""
from __future__ import annotations

import argparse
import os
import sys

from rwkvx_c.cli.common import Subparsers, add_run_flags, err, positive_int
from rwkvx_c.cli.sample import set_threads
from rwkvx_c.generation.live import LiveEngine
from rwkvx_c.run.rundir import BEST, CHECKPOINT
from rwkvx_c.sample import load_run, run_template
from rwkvx_c.server import DEFAULT_HOST, DEFAULT_PORT, Server, make_server

__all__ = ["add_parser", "run"]

DEFAULT_SLOTS = 8        # sequences the engine advances together
DEFAULT_CONTEXT = 4096   # positions a sequence may reach (a hybrid's attention cache)
DEFAULT_MAX_TOKENS = 512


def add_parser(sub: Subparsers) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over a run",
                       description="Serve the checkpoint in DIR over HTTP with OpenAI's API: "
                       "POST /v1/completions, POST /v1/chat/completions (the run's chat "
                       "template; stream: true for server-sent events), GET /v1/models. "
                       "Concurrent requests share one batch. Stop with Ctrl-C.")
    s.add_argument("dir", metavar="DIR", help="run folder (or checkpoint file)")
    s.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default: {DEFAULT_HOST}, this machine only; "
                   "0.0.0.0 opens it to the network, with no authentication)")
    s.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"TCP port; 0 picks a free one (default: {DEFAULT_PORT})")
    s.add_argument("--slots", type=positive_int, default=DEFAULT_SLOTS, metavar="B",
                   help="sequences generated together; more requests wait for a free slot "
                   f"(default: {DEFAULT_SLOTS})")
    s.add_argument("--context", type=positive_int, default=DEFAULT_CONTEXT, metavar="N",
                   help="most positions of one request, prompt and reply (the key/value "
                   "cache of a model with attention blocks, allocated for every slot; a pure "
                   f"RWKV model keeps none) (default: {DEFAULT_CONTEXT})")
    s.add_argument("--max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help="a chat reply's max_tokens when the request gives none "
                   f"(default: {DEFAULT_MAX_TOKENS})")
    s.add_argument("--model-name", metavar="NAME",
                   help="the model id /v1/models lists (default: DIR's name)")
    s.add_argument("--threads", type=positive_int, metavar="N",
                   help="OpenMP threads (default: OMP_NUM_THREADS or every core)")
    s.add_argument("--verbose", action="store_true",
                   help="log every HTTP request to stderr (default: off)")
    add_run_flags(s)


def run(a: argparse.Namespace) -> int:
    bad = set_threads(a)
    if bad:
        return err(bad)
    if not 0 <= a.port < 65536:
        return err(f"--port must lie in [0, 65535], got {a.port}")
    model, tok = load_run(a.dir, a.base, hold_base=True)
    template = run_template(a.dir)
    # a.dir is the run's chosen checkpoint by now (pick_checkpoint): the id names its folder
    src = os.path.abspath(a.dir)
    folder = os.path.dirname(src) if os.path.basename(src) in (CHECKPOINT, BEST) else src
    name = a.model_name or os.path.basename(folder)
    engine = LiveEngine(model, tok, a.slots, a.context)
    try:
        httpd = make_server(Server(engine, tok, template, name, a.max_tokens), a.host, a.port,
                            a.verbose)
    except OSError as e:
        engine.close()
        return err(f"cannot listen on {a.host}:{a.port}: {e.strerror or e}")
    host, port = str(httpd.server_address[0]), int(httpd.server_address[1])
    sys.stderr.write(f"rwkvx-c serve: {name} at http://{host}:{port}/v1 ({a.slots} slots, "
                     f"chat template {template.name}); Ctrl-C stops\n")
    sys.stderr.flush()
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        sys.stderr.write("\nrwkvx-c serve: stopped\n")
    finally:
        httpd.server_close()
        engine.close()
    return 0
