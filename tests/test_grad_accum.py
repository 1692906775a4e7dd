"""Gradient accumulation (--grad-accum N, rwkvx_c.train.accumulate): an
optimiser step over N micro-batches of B sequences gives the losses of one
batch of N*B, on 1 and 2 threads and under mpiexec -n 2; _core.axpby, its
sum, against NumPy."""
import numpy as np
import pytest
from test_distributed import FAST, _launch, _losses
from test_train import _opts

import rwkvx_c as rx
from rwkvx_c.cli import main
from rwkvx_c.train import Trainer, TrainError

# float32 grads summed in another order (a micro-batch's mean, then their
# weighted sum) differ from one batch's by ~1e-7 relative a step, grown over
# 20 steps of training; 1e-5 is the bound, well above that noise
REL = 1e-5
STEPS = 20


def _losses_of(tmp_path, threads, **kw):
    rows = []
    tr = Trainer(_opts(tmp_path, steps=STEPS, threads=threads, precision="fp32", **kw))
    tr.run(on_step=rows.append)
    return [r["loss"] for r in rows if "loss" in r], [r["val_loss"] for r in rows
                                                      if "val_loss" in r]


@pytest.mark.parametrize("threads", [1, 2])
def test_accumulated_micro_batches_equal_one_large_batch(tmp_path, threads):
    big, vbig = _losses_of(tmp_path, threads, batch=8)
    acc, vacc = _losses_of(tmp_path, threads, batch=2, grad_accum=4)
    assert len(big) == len(acc) == STEPS
    rel = np.abs(np.subtract(big, acc)) / np.abs(big)
    assert rel.max() <= REL, rel
    assert np.allclose(vbig, vacc, rtol=REL, atol=0)
    # and not vacuously: two sequences a step are another run
    small, _ = _losses_of(tmp_path, threads, batch=2)
    assert np.abs(np.subtract(big, small)).max() > 1e-3


def test_accumulation_weighs_a_chat_micro_batch_by_its_counted_targets(tmp_path):
    p = tmp_path / "chat.jsonl"
    rng = np.random.default_rng(0)
    words = ["hello", "there", "how", "are", "you", "fine", "thanks", "ok"]
    with open(p, "w") as f:
        for _ in range(60):
            q = " ".join(rng.choice(words, rng.integers(2, 12)))
            a = " ".join(rng.choice(words, rng.integers(1, 20)))
            f.write('{"messages": [{"role": "user", "content": "%s"}, '
                    '{"role": "assistant", "content": "%s"}]}\n' % (q, a))
    kw = dict(data=str(p), seq_len=16)
    big, _ = _losses_of(tmp_path, 2, batch=8, **kw)
    acc, _ = _losses_of(tmp_path, 2, batch=2, grad_accum=4, **kw)
    rel = np.abs(np.subtract(big, acc)) / np.abs(big)
    assert rel.max() <= REL, rel


def test_grad_accum_from_the_command_line_and_its_header(tmp_path, capsys):
    out = str(tmp_path / "run")
    args = ["train", "--out", out, "--preset", "tiny", "--data", _opts(tmp_path).data,
            "--steps", "2", "--batch", "2", "--grad-accum", "3", "--seq-len", "16",
            "--eval-tokens", "32", "--no-progress", "--cache-dir", str(tmp_path / "cache")]
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "batch 2 x 3 accumulated = 6 x seq_len 16" in said
    _, rows = _losses(out)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    # the effective batch's tokens: 6 sequences of 16 a step
    tr = Trainer.resume(out, steps=3)
    assert tr.tokens_seen == 2 * 6 * 16 and tr.opts.grad_accum == 3
    tr.close()
    with pytest.raises(TrainError, match=r"grad_accum 3 -> 2.*--init-from"):
        Trainer.resume(out, grad_accum=2)
    with pytest.raises(TrainError, match="grad_accum must be an integer > 0"):
        _opts(tmp_path, grad_accum=0).resolved()


def test_two_ranks_accumulate_as_one_process_with_a_large_batch(tmp_path):
    big, acc = str(tmp_path / "big"), str(tmp_path / "acc")
    fast = [a for i, a in enumerate(FAST) if "--batch" not in FAST[max(i - 1, 0):i + 1]]
    common = fast + ["--steps", str(STEPS), "--precision", "fp32"]
    r = _launch(1, ["--out", big, "--batch", "8"] + common, tmp_path)
    assert r.returncode == 0, r.stderr
    r = _launch(2, ["--out", acc, "--batch", "2", "--grad-accum", "4"] + common, tmp_path)
    assert r.returncode == 0, r.stderr
    l1, _ = _losses(big)
    l2, rows = _losses(acc)
    assert len(l1) == STEPS and {row["world_size"] for row in rows} == {2}
    rel = np.abs(np.subtract(l1, l2)) / np.abs(l1)
    assert rel.max() <= REL, rel


@pytest.mark.parametrize("n", [1, 7, 100_003])
def test_axpby_against_numpy(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    want = (0.25 * x.astype(np.float64) + 1.0 * y.astype(np.float64))
    got = y.copy()
    rx.axpby(0.25, x, 1.0, got)
    # one product and one sum in float32 (fused or not): within 2 ulp of the float64 value
    assert np.all(np.abs(got - want) <= 2 * np.spacing(np.abs(want).astype(np.float32)))
    got = np.full(n, np.nan, np.float32)   # b = 0 overwrites, never reads y
    rx.axpby(0.5, x, 0.0, got)
    assert np.array_equal(got, 0.5 * x)


def test_axpby_refuses_bad_buffers():
    x = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="same length"):
        rx.axpby(1.0, x, 1.0, np.ones(7, np.float32))
    with pytest.raises(ValueError, match="overlap"):
        rx.axpby(1.0, x[:6], 1.0, x[2:])
    with pytest.raises(TypeError, match="float32"):
        rx.axpby(1.0, x.astype(np.float64), 1.0, x)
