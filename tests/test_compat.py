"""Runs saved by earlier versions keep working: tests/data/old_run is a run
folder written by rwkvx_c 0.1.0 before its package was split into layers
(a 1+1-block model on tests/data/old_run_corpus.txt, stopped after 4 of 8
steps), and old_run_losses.json the 8 losses of the same run uninterrupted,
computed on an AVX-512 machine.

Resume is bit-exact on one machine: the old run resumed to its end gives
the losses, bit for bit, of the same resume stopped after step 6 and resumed
again, on any thread count. Against the stored figures of the other machine
it is compared within OLD_LOSS_RTOL: its GEMM kernels sum float32 products
in another order (AVX-512 vs AVX2 blocking), and a dot product of length K
in float32 is within gamma_K = K u (u = 2^-24) of the exact one, relative to
|x||y| (Higham, Accuracy and Stability, 3.1); two orders differ by at most
twice that, for the largest K of this model's steps (256: the head's input
grad sums over the vocabulary), and to first order each of the 4 resumed
steps adds its own. Equal figures mean the same instruction set."""
import json
import os
import shutil

import pytest

from rwkvx_c.run import RunDir
from rwkvx_c.train import Trainer

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
U32 = 2.0 ** -24          # float32 unit roundoff
K_MAX = 256               # the longest float32 sum of a step of this model: the vocabulary
RESUMED_STEPS = 4
OLD_LOSS_RTOL = RESUMED_STEPS * 2 * K_MAX * U32   # 1.2e-4


def _old_run(tmp_path, name):
    run = tmp_path / name
    shutil.copytree(os.path.join(DATA, "old_run"), run)
    return str(run)


def _losses(run):
    return [r["loss"] for r in RunDir(run).read_log() if "loss" in r]


@pytest.mark.parametrize("threads", [1, 2])
def test_an_old_run_resumes_bit_for_bit(tmp_path, monkeypatch, threads):
    # the run names its corpus as it was given: corpus.txt, in the working folder
    shutil.copy(os.path.join(DATA, "old_run_corpus.txt"), tmp_path / "corpus.txt")
    monkeypatch.chdir(tmp_path)
    with open(os.path.join(DATA, "old_run_losses.json")) as f:
        want = json.load(f)["losses"]
    cache = str(tmp_path / "cache")
    whole = _old_run(tmp_path, "whole")
    tr = Trainer.resume(whole, threads=threads, cache_dir=cache)
    assert tr.step_count == 4 and tr.opts.precision == "fp32"
    tr.run()
    split = _old_run(tmp_path, "split")
    tr = Trainer.resume(split, threads=threads, cache_dir=cache)
    tr.run(stop=lambda: tr.step_count >= 6)
    assert tr.step_count == 6
    Trainer.resume(split, threads=threads, cache_dir=cache).run()
    got = _losses(whole)
    assert len(got) == 8 and got[:4] == want[:4]   # the old run's own log
    assert _losses(split) == got   # bit for bit on this machine
    for step, (g, w) in enumerate(zip(got[4:], want[4:]), 5):
        assert abs(g - w) <= OLD_LOSS_RTOL * abs(w), \
            f"step {step}: {g!r} vs the AVX-512 machine's {w!r}"
