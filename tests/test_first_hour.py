"""A new user's first hour (issue 38): init_from from Python as from the
command line, a state tune's own learning rate, flags refused where they do
nothing, typos and underscore spellings, resume refusals that name
--init-from, no folder left by a failed start, exports readable as every
other file, a header that says what trains, counts in the singular, and a
fine-tune's plot."""
import os
import stat

import numpy as np
import pytest
from test_train import _opts

from rwkvx_c.cli import build_parser, main
from rwkvx_c.data.pipeline import load_corpus
from rwkvx_c.errors import RwkvxError
from rwkvx_c.model.presets import PRESETS
from rwkvx_c.run.checkpoint import read_checkpoint
from rwkvx_c.train import Trainer, TrainError
from rwkvx_c.train.options import STATE_LR, TrainOptions
from rwkvx_c.train.progress import run_title
from rwkvx_c.util.atomic import replace_with
from rwkvx_c.util.words import counted

from hostile import SMALL, cli, corpus, no_traceback, tiny_run

RWKV = dict(SMALL, n_attn_layer=0)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_run(str(tmp_path_factory.mktemp("base")))


def _umask_mode():
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


@pytest.mark.parametrize("tune", ["full", "lora", "state"])
def test_init_from_works_from_python(tmp_path, base, tune):
    tensors, _, _ = read_checkpoint(os.path.join(base, "checkpoint.safetensors"))
    tr = Trainer(TrainOptions(init_from=base, tune=tune, data=corpus(str(tmp_path)), batch=2,
                              seq_len=16, steps=1, eval_tokens=32, threads=2,
                              cache_dir=str(tmp_path / "cache")), str(tmp_path / "ft"))
    try:
        assert tr.opts.init_from == base and tr.opts.model["n_attn_layer"] == 0
        for n in tr.model.param_names:
            if n in tensors:
                assert np.array_equal(tr.model.params[n], tensors[n]), n
    finally:
        tr.close()


def test_a_state_tune_defaults_to_rwkv_peft_learning_rate(capsys):
    o = TrainOptions(tune="state").resolved()
    assert o.lr == STATE_LR == 1.0 and o.min_lr_frac == 0.01
    o = TrainOptions(tune="lora").resolved()
    assert o.lr == PRESETS["default"]["lr"] and o.min_lr_frac == 0.1
    assert TrainOptions(tune="state", lr=0.1, min_lr_frac=0.5).resolved().lr == 0.1
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "1 with --tune state, RWKV-PEFT's" in said and "0.01 with --tune state" in said


@pytest.mark.parametrize("kw,flag", [(dict(tune="state", lora_r=8), "--lora-r"),
                                     (dict(tune="full", lora_alpha=8.0), "--lora-alpha"),
                                     (dict(tune="state", lora_targets="att.key"),
                                      "--lora-targets"),
                                     (dict(init_from="x", init="spec"), "--init")])
def test_a_flag_without_effect_in_the_mode_is_refused(kw, flag):
    with pytest.raises(TrainError, match=flag):
        TrainOptions(**kw).resolved()


def test_a_flag_without_effect_is_one_line_from_the_command_line(tmp_path, base):
    r = cli("train", "--init-from", base, "--tune", "state", "--lora-r", "8", "--steps", "1",
            cwd=str(tmp_path))
    err = no_traceback(r)
    assert r.returncode == 1 and err.count("\n") == 1 and "--lora-r" in err, err
    assert not os.path.exists(tmp_path / "runs") or not os.listdir(tmp_path / "runs")


@pytest.mark.parametrize("typo,near", [("--time-bugdet", "--time-budget"),
                                       ("--lora-rank", "--lora-r"), ("--step", "--steps")])
def test_an_unknown_flag_gets_the_nearest(capsys, typo, near):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["train", typo, "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"did you mean {near}?" in err and err.count("\n") == 1


def test_underscore_spellings_are_the_flags():
    a = build_parser().parse_args(["train", "--lora_r", "8", "--time_budget=3", "--grad_accum",
                                   "2", "--no_progress", "--n_embd", "64"])
    assert (a.lora_r, a.time_budget, a.grad_accum, a.no_progress, a.n_embd) == (8, 3.0, 2, True,
                                                                                  64)


def test_a_refused_resume_points_to_init_from(tmp_path):
    out = tiny_run(str(tmp_path))
    with pytest.raises(TrainError, match=f"batch 2 -> 4; .*--init-from {out}"):
        Trainer.resume(out, batch=4)
    os.makedirs(tmp_path / "other")
    with pytest.raises(TrainError, match=f"--init-from {out}"):
        Trainer.resume(out, data=corpus(str(tmp_path / "other"), n=3000))


def test_a_failed_start_leaves_no_folder(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(RwkvxError):
        Trainer(_opts(tmp_path, data=str(tmp_path / "missing.txt")), str(out))
    assert not out.exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "nobody", "content": "x"}]}\n')
    with pytest.raises(RwkvxError):
        Trainer(_opts(tmp_path, data=str(bad)), str(tmp_path / "tmp-chat"))
    assert not (tmp_path / "tmp-chat").exists()
    # the command with no --out: nothing under ./runs/
    r = cli("train", "--data", str(tmp_path / "missing.txt"), "--steps", "1", cwd=str(tmp_path))
    assert r.returncode == 1, no_traceback(r)
    assert not os.path.exists(tmp_path / "runs") or not os.listdir(tmp_path / "runs")
    # a folder that was there stays, with what it held
    keep = tmp_path / "keep"
    keep.mkdir()
    with pytest.raises(RwkvxError):
        Trainer(_opts(tmp_path, data=str(tmp_path / "missing.txt")), str(keep))
    assert keep.is_dir()


def test_a_writer_making_0600_files_gets_the_umask_mode(tmp_path):
    dest = str(tmp_path / "model.safetensors")

    def private(path):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))   # as safetensors does
    replace_with(dest, private)
    assert stat.S_IMODE(os.stat(dest).st_mode) == _umask_mode()


def test_exports_have_the_umask_mode(tmp_path):
    pytest.importorskip("safetensors")
    run = str(tmp_path / "run")   # the HF layout wants head size 64
    Trainer(_opts(tmp_path, model=dict(RWKV, n_embd=64, n_head=1, head_size=64), steps=1,
                  tune="lora", lora_r=4), run).run()
    out = tmp_path / "hf"
    assert main(["export", run, "--format", "hf", "--out", str(out)]) == 0
    assert main(["export", run, "--format", "peft", "--out", str(tmp_path / "peft")]) == 0
    for name in os.listdir(tmp_path / "peft"):
        assert stat.S_IMODE(os.stat(tmp_path / "peft" / name).st_mode) == _umask_mode(), name
    for name in os.listdir(out):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == _umask_mode(), name


def test_the_header_says_what_trains(tmp_path, base, capsys):
    args = ["train", "--data", corpus(str(tmp_path)), "--steps", "1", "--batch", "2",
            "--seq-len", "16", "--eval-tokens", "32", "--no-progress",
            "--cache-dir", str(tmp_path / "cache")]
    assert main(args + ["--out", str(tmp_path / "lora"), "--init-from", base,
                        "--tune", "lora", "--lora-r", "4"]) == 0
    said = capsys.readouterr().out
    assert f"tune lora of {base}" in said
    line = next(ln for ln in said.splitlines() if ln.lstrip().startswith("trains"))
    assert "LoRA adapters (r 4, alpha 32)" in line
    n = int(line.rsplit(":", 1)[1].split()[0].replace(",", ""))
    tr = Trainer.resume(str(tmp_path / "lora"))
    assert n == tr.optim.m.size > 0
    tr.close()


def test_counts_are_singular_for_one(tmp_path):
    assert counted(1, "file") == "1 file" and counted(2, "file") == "2 files"
    assert counted(1234, "window") == "1,234 windows"
    # a folder of one file
    os.makedirs(tmp_path / "one")
    corpus(str(tmp_path / "one"))
    c = load_corpus(str(tmp_path / "one"), seq_len=16, cache_dir=str(tmp_path / "cache"))
    assert "(1 file," in c.description


def test_a_fine_tune_plot_names_its_source_and_keeps_the_legend_off_the_curves():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from rwkvx_c.run.plot import draw
    o = TrainOptions(init_from="runs/base", tune="lora").resolved()
    title = run_title(o, "runs/ft")
    assert "runs/ft" in title and "tune lora of runs/base" in title
    rows = [{"step": s, "loss": 3.0 - s / 50, "elapsed": s * 0.1} for s in range(1, 101)]
    rows += [{"step": s, "val_loss": 2.9 - s / 60, "val_bpb": 4.0 - s / 40}
             for s in range(10, 101, 10)]
    fig = draw(rows, title)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(r)
    for ax in fig.axes:
        assert not legend.overlaps(ax.get_window_extent(r))
    plt.close(fig)
