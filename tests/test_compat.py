"""Runs saved by earlier versions keep working: tests/data/old_run is a run
folder written by rwkvx_c 0.1.0 before its package was split into layers
(a 1+1-block model on tests/data/old_run_corpus.txt, stopped after 4 of 8
steps), and old_run_losses.json the 8 losses of the same run uninterrupted.
A resume must repeat steps 5-8 bit for bit, on any thread count."""
import json
import os
import shutil

import pytest

from rwkvx_c.run import RunDir
from rwkvx_c.train import Trainer

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@pytest.mark.parametrize("threads", [1, 2])
def test_an_old_run_resumes_bit_for_bit(tmp_path, monkeypatch, threads):
    run = tmp_path / "run"
    shutil.copytree(os.path.join(DATA, "old_run"), run)
    # the run names its corpus as it was given: corpus.txt, in the working folder
    shutil.copy(os.path.join(DATA, "old_run_corpus.txt"), tmp_path / "corpus.txt")
    monkeypatch.chdir(tmp_path)
    with open(os.path.join(DATA, "old_run_losses.json")) as f:
        want = json.load(f)["losses"]
    tr = Trainer.resume("run", threads=threads, cache_dir=str(tmp_path / "cache"))
    assert tr.step_count == 4 and tr.opts.precision == "fp32"
    tr.run()
    got = [r["loss"] for r in RunDir("run").read_log() if "loss" in r]
    assert got == want
