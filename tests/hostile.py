"""Helpers of the hardening tests: run code or the CLI in a fresh interpreter
(a crash there fails one test, not the suite) and a small corpus."""
import os
import subprocess
import sys

import numpy as np

import rwkvx_c as rx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(rx.__file__)))

SMALL = dict(n_embd=32, n_head=2, head_size=16, n_rwkv_layer=2, n_attn_layer=1, vocab_size=256,
             ffn_dim=64, Dw=8, Da=8, Dg=8, Dv=8, chunk_size=8, moba_top_k=1)


def env(**kw):
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE]), OMP_NUM_THREADS="2", **kw)
    e.pop("PYTHONWARNINGS", None)
    return e


def python(code, timeout=120, cwd=HERE, **kw):
    """CompletedProcess of `python -c code` importing this rwkvx_c, in cwd."""
    return subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, **kw)


def cli(*args, cwd, timeout=180, **kw):
    """CompletedProcess of `python -m rwkvx_c ARGS` in cwd, stderr not a terminal."""
    return subprocess.run([sys.executable, "-m", "rwkvx_c", *args], env=env(),
                          capture_output=True, timeout=timeout, cwd=cwd, **kw)


def corpus(folder, n=6000):
    p = os.path.join(folder, "corpus.txt")
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "(", ")", ":"]
    with open(p, "w") as f:
        f.write(" ".join(rng.choice(words, n)))
    return p


def tiny_run(folder):
    """A saved two-step run of a small pure RWKV-7 model in folder/run (the
    input the output-path and surface tests point commands at)."""
    from rwkvx_c.train.options import TrainOptions
    from rwkvx_c.train.trainer import Trainer
    out = os.path.join(folder, "run")
    Trainer(TrainOptions(preset="tiny", data=corpus(folder), model=dict(SMALL, n_attn_layer=0),
                         batch=2, seq_len=16, steps=2, eval_tokens=32, threads=2,
                         cache_dir=os.path.join(folder, "cache")), out).run()
    return out


def no_traceback(r):
    err = r.stderr if isinstance(r.stderr, str) else r.stderr.decode(errors="replace")
    assert "Traceback" not in err, err
    assert r.returncode >= 0, f"killed by signal {-r.returncode}: {err}"
    return err
