"""Small things a new user hit: Trainer.run() shows progress and draws the
plot when asked, a manual step() loop logs with tr.log(row), and the
warmup-stable-decay schedule extends cleanly when a run is given more steps."""
import os

import pytest

from rwkvx_c.run.rundir import LOCK, LOG, PLOT
from rwkvx_c.train import schedule
from rwkvx_c.train.options import TrainOptions
from rwkvx_c.train.trainer import Trainer

from hostile import SMALL, corpus


def _opts(tmp_path, **kw):
    return TrainOptions(**{**dict(preset="tiny", data=corpus(str(tmp_path)), model=dict(SMALL),
                                  batch=2, seq_len=16, steps=4, eval_tokens=32, threads=2,
                                  warmup_steps=2, cache_dir=str(tmp_path / "c")), **kw})


def test_run_from_python_shows_progress_and_draws_the_plot(tmp_path, capfd):
    pytest.importorskip("matplotlib")
    out = str(tmp_path / "run")
    Trainer(_opts(tmp_path), out).run(progress=True, plot=True)
    err = capfd.readouterr().err
    assert "4/4 step" in err and "loss" in err
    assert os.path.getsize(os.path.join(out, PLOT)) > 1000
    assert not os.path.exists(os.path.join(out, LOCK))
    out2 = str(tmp_path / "quiet")
    Trainer(_opts(tmp_path), out2).run()   # the defaults: neither
    assert capfd.readouterr().err == "" and not os.path.exists(os.path.join(out2, PLOT))


def test_a_manual_step_loop_logs_with_log(tmp_path):
    out = str(tmp_path / "run")
    tr = Trainer(_opts(tmp_path), out)
    while not tr.done():
        tr.log(tr.step())
    tr.save()
    tr.close()
    assert [r["step"] for r in tr.read_log()] == [1, 2, 3, 4]
    assert os.path.exists(os.path.join(out, LOG))


def test_wsd_schedule_shape():
    kw = dict(lr=1.0, warmup_steps=10, min_lr_frac=0.1, kind="wsd")
    assert schedule.lr_at(5, 0.0, **kw) == 0.5
    assert schedule.lr_at(50, 0.5, **kw) == 1.0
    assert schedule.lr_at(50, 1 - schedule.WSD_DECAY_FRAC, **kw) == 1.0
    assert schedule.lr_at(50, 0.9, **kw) == pytest.approx(0.55)
    assert schedule.lr_at(50, 1.0, **kw) == pytest.approx(0.1)


@pytest.mark.parametrize("kind", ["cosine", "wsd"])
def test_resuming_with_more_steps(tmp_path, kind):
    """A run of 20 steps saved at step 8, resumed for 40: under wsd the
    learning rate goes on as it was (the stable phase grows); under a
    cosine it jumps to the longer cosine's value (documented)."""
    out = str(tmp_path / "run")
    tr = Trainer(_opts(tmp_path, steps=20, schedule=kind), out)
    for _ in range(8):
        tr.step()
    before = tr.lr()
    tr.save()
    tr.close()
    tr = Trainer.resume(out, steps=40)
    after = tr.lr()
    tr.close()
    if kind == "wsd":
        assert after == before == tr.opts.lr
    else:
        assert after > before * 1.05
