"""Validation and the checkpoints a run keeps (issue 38): --val-data and
--val-fraction, the warning of a validation split too small to judge by,
--keep-best, --keep-last K, --early-stop K; export, sample and eval take
the best checkpoint or a snapshot as they take the last one."""
import json
import os

import numpy as np
import pytest
from test_train import _opts

from rwkvx_c.cli import main
from rwkvx_c.errors import RwkvxError, RwkvxWarning
from rwkvx_c.run.checkpoint import read_checkpoint
from rwkvx_c.sample import load_model
from rwkvx_c.train import Trainer, TrainError

from hostile import SMALL, corpus, tiny_run

RWKV = dict(SMALL, n_attn_layer=0)


def _other_text(folder, n=4000):
    """Text the base never saw: validating on it while training on the
    base's corpus at a high rate, the loss falls, then rises."""
    p = os.path.join(folder, "other.txt")
    rng = np.random.default_rng(5)
    with open(p, "w") as f:
        f.write("".join(rng.choice(list("xyzw.,;QZ\n"), n)))
    return p


def _log(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_val_data_is_the_validation_set(tmp_path):
    other = _other_text(str(tmp_path))
    tr = Trainer(_opts(tmp_path, val_data=other, steps=1))
    assert "validation" in tr.corpus.description and other in tr.corpus.description
    with open(other, "rb") as f:
        text = f.read()
    # the windows are the other text's bytes
    assert bytes(tr.val_x[0].astype(np.uint8)) in text
    tr.close()
    with pytest.raises(RwkvxError, match="--val-data"):
        Trainer(_opts(tmp_path, val_data=str(tmp_path / "none.txt")))


def test_val_fraction_sets_the_split(tmp_path):
    small = Trainer(_opts(tmp_path, val_fraction=0.02, steps=1)).corpus
    large = Trainer(_opts(tmp_path, val_fraction=0.2, steps=1)).corpus
    assert len(large.val) > 5 * len(small.val)
    assert len(large.train) + len(large.val) == len(small.train) + len(small.val)
    with pytest.raises(TrainError, match="val_fraction"):
        _opts(tmp_path, val_fraction=1.0).resolved()


def test_a_small_validation_split_warns(tmp_path):
    with pytest.warns(RwkvxWarning, match="validation holds only 1 window of 24 tokens"):
        Trainer(_opts(tmp_path, val_fraction=0.001, eval_tokens=24 * 8)).close()


def _overfit(tmp_path, base, out, **kw):
    """A LoRA tune at a high rate on text the base never saw, validated on
    the base's own kind of text: the better it fits the one, the worse the other."""
    os.makedirs(tmp_path / "val", exist_ok=True)
    kw = {"steps": 16, **kw}
    # fp32: the best checkpoint is scored again with its adapters merged, which
    # bf16 GEMMs would round differently from the adapters apart
    return Trainer(_opts(tmp_path, model=None, init_from=base, tune="lora", lr=0.05,
                         precision="fp32",
                         warmup_steps=0, batch=2, seq_len=16, eval_every=2,
                         data=_other_text(str(tmp_path)),
                         val_data=corpus(str(tmp_path / "val")), **kw), str(tmp_path / out))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_run(str(tmp_path_factory.mktemp("base")))


def test_keep_best_keeps_the_lowest_validation_checkpoint(tmp_path, base):
    tr = _overfit(tmp_path, base, "ft", keep_best=True)
    tr.run()
    out = str(tmp_path / "ft")
    # step 0 is the source's baseline, no checkpoint: the keeper judges the trained steps
    evals = [(r["step"], r["val_loss"]) for r in _log(out) if "val_loss" in r and r["step"]]
    best_step, best_loss = min(evals, key=lambda e: e[1])
    assert best_step < evals[-1][0], evals   # the run overfits: its last is not its best
    _, _, state = read_checkpoint(os.path.join(out, "best.safetensors"))
    assert state["step"] == best_step
    assert state["keeper"]["best_step"] == best_step
    # the best checkpoint's model scores its validation loss again
    again = Trainer(_opts(tmp_path, model=None, init_from=os.path.join(out, "best.safetensors"),
                          tune="full", steps=1, batch=2, seq_len=16, precision="fp32",
                          data=_other_text(str(tmp_path)), val_data=tr.opts.val_data))
    # the source's adapters come merged into its weights: float32 rounding apart
    assert again.evaluate()["val_loss"] == pytest.approx(best_loss, rel=1e-5)
    again.close()
    # export, sample and eval take it as a checkpoint
    best = os.path.join(out, "best.safetensors")
    assert main(["export", best, "--format", "rwkv7", "--out", str(tmp_path / "b.pth")]) == 0
    load_model(best)
    assert main(["eval", best, "--data", _other_text(str(tmp_path)), "--json"]) == 0


def test_keep_last_rotates_step_snapshots(tmp_path):
    out = str(tmp_path / "run")
    Trainer(_opts(tmp_path, steps=6, save_every=1, keep_last=2), out).run()
    snaps = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
    assert snaps == ["checkpoint-0000005.safetensors", "checkpoint-0000006.safetensors"]
    for n, step in zip(snaps, (5, 6)):
        _, _, state = read_checkpoint(os.path.join(out, n))
        assert state["step"] == step
    load_model(os.path.join(out, snaps[0]))
    # the folder's own files: a new run refuses none of them as foreign
    from rwkvx_c.run.rundir import RunDir
    assert RunDir(out).foreign_entries() == []


def test_early_stop_ends_a_run_that_stops_improving(tmp_path, base):
    tr = _overfit(tmp_path, base, "es", early_stop=2, steps=200)
    tr.run()
    evals = [r["val_loss"] for r in _log(str(tmp_path / "es")) if "val_loss" in r and r["step"]]
    assert tr.step_count < 200
    k = int(np.argmin(evals))
    assert len(evals) - 1 - k == 2, evals   # two evaluations after the best, then the stop
    # the option resumes as RESUMABLE: a larger patience goes on
    tr = Trainer.resume(str(tmp_path / "es"), early_stop=50, steps=tr.step_count + 2)
    assert tr.keeper.stale == 2 and not tr.done()
    tr.close()


def test_the_flags_from_the_command_line(tmp_path, base, capsys):
    out = str(tmp_path / "cli")
    args = ["train", "--out", out, "--init-from", base, "--tune", "lora", "--steps", "4",
            "--batch", "2", "--seq-len", "16", "--eval-every", "2", "--val-data",
            _other_text(str(tmp_path)), "--keep-best", "--keep-last", "1", "--early-stop", "5",
            "--val-fraction", "0.05", "--no-progress", "--data", corpus(str(tmp_path)),
            "--cache-dir", str(tmp_path / "cache")]
    assert main(args) == 0
    names = os.listdir(out)
    assert "best.safetensors" in names and "checkpoint-0000004.safetensors" in names
    tr = Trainer.resume(out)
    assert (tr.opts.keep_best, tr.opts.keep_last, tr.opts.early_stop, tr.opts.val_fraction) \
        == (True, 1, 5, 0.05)
    tr.close()
