"""A run kept with --keep-best answers with best.safetensors (docs/training.md
§What a run keeps): sample, chat, export, eval, merge, --init-from RUN and
load_model(RUN) take it; --checkpoint last|best picks; the summary names
both checkpoints with their losses."""
import json
import os
import shutil

import numpy as np
import pytest
from test_train import SMALL, _corpus

from rwkvx_c.cli import main
from rwkvx_c.errors import CheckpointError
from rwkvx_c.interop.source import read_source
from rwkvx_c.run.rundir import RunDir, checkpoint_path
from rwkvx_c.sample import load_model

RWKV = dict(SMALL, n_attn_layer=0)
TOKENS = np.arange(40, dtype=np.int32).reshape(2, 20) % 200


def _train(tmp_path, out, *extra):
    return main(["train", "--data", _corpus(tmp_path), "--batch", "2", "--seq-len", "24",
                 "--eval-tokens", "96", "--threads", "2", "--precision", "fp32", "--no-progress",
                 "--cache-dir", str(tmp_path / "cache"), "--preset", "tiny", "--n-embd", "32",
                 "--head-size", "16", "--n-layer", "2", "--n-attn-layer", "0",
                 "--out", out, *extra])


def _forward(path, **kw):
    return load_model(path, **kw).forward(TOKENS)


def _val(run, *extra):
    assert main(["eval", run, "--split", "val", "--json", *extra]) == 0


@pytest.fixture
def kept(tmp_path, capsys):
    """A --keep-best run whose best.safetensors is its step-1 checkpoint
    (put there: which step is best is the keeper's business, tested in
    test_validation.py), and what its summary printed."""
    run = str(tmp_path / "r")
    assert _train(tmp_path, run, "--steps", "3", "--eval-every", "1", "--keep-best",
                  "--keep-last", "3", "--lr", "0.003") == 0
    out = capsys.readouterr().out
    rd = RunDir(run)
    os.unlink(rd.best)
    shutil.copyfile(rd.snapshot(1), rd.best)
    return run, out


def test_the_summary_names_both_checkpoints_with_their_losses(kept):
    run, out = kept
    with open(os.path.join(run, "log.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    evals = [r for r in rows if r.get("val_loss") is not None]
    best = min(evals, key=lambda r: r["val_loss"])
    assert f"checkpoint {run}/checkpoint.safetensors (step 3, val_loss " \
        f"{evals[-1]['val_loss']:.4f})" in out, out
    assert f"best       {run}/best.safetensors (step {best['step']}, val_loss " \
        f"{best['val_loss']:.4f})" in out, out


def test_readers_take_the_best_checkpoint_and_checkpoint_picks(kept, tmp_path, capsys):
    run, _ = kept
    rd = RunDir(run)
    best, last = _forward(rd.best), _forward(rd.checkpoint)
    assert not np.array_equal(best, last)
    assert checkpoint_path(run) == rd.best and checkpoint_path(run, "last") == rd.checkpoint
    assert np.array_equal(_forward(run), best)
    # the CLI: eval, sample, export by default the best, --checkpoint last the last
    capsys.readouterr()
    scores = []
    for extra in ([], ["--checkpoint", "best"], ["--checkpoint", "last"]):
        _val(run, *extra)
        scores.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    _val(rd.checkpoint)
    on_last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert scores[0] == scores[1] != scores[2] and scores[2]["data"] == on_last["data"]
    for which in ("best", "last"):
        out = str(tmp_path / f"{which}.pth")
        assert main(["export", run, "--format", "rwkv7", "--out", out, "--checkpoint",
                     which]) == 0
    assert main(["sample", run, "--prompt", "def", "--max-new-tokens", "2"]) == 0
    # --init-from RUN starts from the best
    src = read_source(run)
    assert np.array_equal(src.weights["emb"], load_model(rd.best).params["emb"])


def test_checkpoint_is_refused_where_it_cannot_pick(tmp_path, capsys):
    run = str(tmp_path / "plain")
    assert _train(tmp_path, run, "--steps", "1") == 0
    assert checkpoint_path(run) == RunDir(run).checkpoint
    capsys.readouterr()
    assert main(["sample", run, "--checkpoint", "best"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no best.safetensors" in err[0], err
    assert main(["sample", RunDir(run).checkpoint, "--checkpoint", "last"]) == 1
    assert "is a file" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="holds no best"):
        checkpoint_path(run, "best")
