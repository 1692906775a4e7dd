"""A fine-tune pins the run it starts from (docs/finetune.md §Pinned
sources, rwkvx_c/run/base.py): the source run's checkpoint, and the run
checkpoints below it, become files of the tune's folder as they were at
its start, so resuming or deleting the source leaves the tune whole; a
resumed source says it is pinned; a tune recorded before pins, whose
source moved on, is told which snapshot holds its base."""
import json
import os
import shutil

import numpy as np
import pytest
from test_finetune import _base_run
from test_finetune import _tune as _unpinned_tune
from test_train import SMALL, _corpus, _opts

from rwkvx_c.cli import main
from rwkvx_c.run.checkpoint import read_state
from rwkvx_c.run.rundir import RunDir
from rwkvx_c.sample import load_model
from rwkvx_c.train import Trainer

RWKV = dict(SMALL, n_attn_layer=0)
TOKENS = np.arange(40, dtype=np.int32).reshape(2, 20) % 200


def _train(tmp_path, *args):
    assert main(["train", "--data", _corpus(tmp_path), "--batch", "2", "--seq-len", "24",
                 "--eval-tokens", "96", "--threads", "2", "--precision", "fp32",
                 "--cache-dir", str(tmp_path / "cache"), *args]) == 0


def _resume(run, steps):
    assert main(["train", "--resume", "--out", run, "--steps", str(steps)]) == 0


def _eval_json(run, capsys):
    capsys.readouterr()
    assert main(["eval", run, "--split", "val", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_tune_survives_its_source_resumed_and_deleted(tmp_path, capsys):
    base = _base_run(tmp_path, RWKV)
    parent, child = str(tmp_path / "parent"), str(tmp_path / "child")
    _train(tmp_path, "--init-from", base, "--tune", "lora", "--lora-r", "2", "--steps", "2",
           "--out", parent)
    _train(tmp_path, "--init-from", parent, "--tune", "lora", "--lora-r", "2", "--steps", "2",
           "--out", child)
    # the child names its pin of the parent, and holds the parent's own pin of the base
    rec = read_state(os.path.join(child, "checkpoint.safetensors"))["base"]
    pins = RunDir(child).pins()
    assert rec["path"] in pins and len(pins) == 2, (rec, pins)
    assert os.path.samefile(rec["path"], os.path.join(parent, "checkpoint.safetensors"))
    before = load_model(child).forward(TOKENS)
    scored = _eval_json(child, capsys)

    capsys.readouterr()
    _resume(parent, 4)
    err = capsys.readouterr().err
    assert "1 fine-tune(s) pin the checkpoint of step 2 of" in err, err
    # the child samples, exports and evaluates as before
    assert np.array_equal(load_model(child).forward(TOKENS), before)
    assert _eval_json(child, capsys) == scored
    assert main(["sample", child, "--prompt", "def", "--max-new-tokens", "4"]) == 0
    assert main(["export", child, "--format", "rwkv7", "--out", str(tmp_path / "c.pth")]) == 0
    # and so it does with the parent and the base gone
    shutil.rmtree(parent)
    shutil.rmtree(base)
    assert np.array_equal(load_model(child).forward(TOKENS), before)
    assert _eval_json(child, capsys) == scored
    # the child's folder moved: its pins move with it
    moved = str(tmp_path / "moved")
    shutil.move(child, moved)
    assert np.array_equal(load_model(moved).forward(TOKENS), before)


def test_a_tune_resumes_after_its_source_was_resumed(tmp_path):
    base = _base_run(tmp_path, RWKV)
    child = str(tmp_path / "st")
    _train(tmp_path, "--init-from", base, "--tune", "state", "--steps", "2", "--save-every",
           "1", "--out", child)
    _resume(base, 5)
    _resume(child, 3)
    assert read_state(os.path.join(child, "checkpoint.safetensors"))["step"] == 3


def test_a_full_tune_pins_nothing(tmp_path):
    base = _base_run(tmp_path, RWKV)
    _train(tmp_path, "--init-from", base, "--steps", "1", "--out", str(tmp_path / "full"))
    assert RunDir(str(tmp_path / "full")).pins() == []


def test_a_tune_recorded_before_pins_is_told_which_snapshot_holds_its_base(tmp_path, capsys):
    parent = str(tmp_path / "parent")
    Trainer(_opts(tmp_path, model=dict(RWKV), steps=2, keep_last=3, save_every=1),
            parent).run()
    tr = _unpinned_tune(tmp_path, parent, "old", tune="state", steps=1, precision="fp32")
    tr.run()
    old = str(tmp_path / "old")
    assert RunDir(old).pins() == []
    before = load_model(old).forward(TOKENS)
    _resume(parent, 3)
    capsys.readouterr()
    assert main(["sample", old, "--prompt", "def", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    snap = RunDir(parent).snapshot(2)
    assert len(err) == 1 and f"{snap} holds it: give --base {snap}" in err[0], err
    assert np.array_equal(load_model(old, base=snap).forward(TOKENS), before)
    with pytest.raises(Exception, match="is not the base"):
        load_model(old, base=RunDir(parent).snapshot(1))


def test_a_preference_run_pins_its_reference_run(tmp_path):
    import json as _json
    base = _base_run(tmp_path, RWKV)
    ref = str(tmp_path / "ref")
    _train(tmp_path, "--init-from", base, "--steps", "1", "--out", ref)
    pairs = tmp_path / "pairs.jsonl"
    with open(pairs, "w") as f:
        for i in range(20):
            f.write(_json.dumps({"prompt": f"Say {i}", "chosen": f"{i} {i}", "rejected": "no"})
                    + "\n")
    dpo = str(tmp_path / "dpo")
    assert main(["train", "--init-from", base, "--tune", "lora", "--lora-r", "2", "--objective",
                 "dpo", "--ref-from", ref, "--data", str(pairs), "--batch", "2", "--seq-len",
                 "40", "--steps", "1", "--threads", "2", "--precision", "fp32", "--out",
                 dpo]) == 0
    pins = RunDir(dpo).pins()
    assert len(pins) == 2 and any(os.path.samefile(p, os.path.join(ref, "checkpoint.safetensors"))
                                  for p in pins)
    shutil.rmtree(ref)
    _resume(dpo, 2)


def test_without_hard_links_the_pin_is_a_copy_with_the_sources_mtime(tmp_path, monkeypatch):
    import rwkvx_c.util.atomic as atomic
    base = _base_run(tmp_path, RWKV)

    def no_link(src, dst):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(atomic.os, "link", no_link)
    out = str(tmp_path / "st")
    Trainer(_opts(tmp_path, model=None, init_from=base, tune="state", steps=1), out).run()
    (pin,) = RunDir(out).pins()
    ck = os.path.join(base, "checkpoint.safetensors")
    assert not os.path.samefile(pin, ck)
    assert os.stat(pin).st_mtime_ns == os.stat(ck).st_mtime_ns
    before = load_model(out).forward(TOKENS)
    monkeypatch.undo()
    _resume(base, 5)
    assert np.array_equal(load_model(out).forward(TOKENS), before)
