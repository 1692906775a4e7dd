"""The rwkvx-c command: smoke runs, resume, sampling, and one-line errors."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rwkvx_c.cli import main

FAST = ["--preset", "tiny", "--seq-len", "32", "--batch", "2", "--eval-tokens", "64",
        "--threads", "2", "--no-progress"]


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    rng = np.random.default_rng(0)
    p.write_text("".join(rng.choice(list("abcdefgh \n"), 20000)))
    return str(p)


def _one_line_error(capsys, code, rc, *words):
    err = capsys.readouterr().err
    assert rc == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], lines[0]


def test_train_resume_and_sample(tmp_path, corpus, capsys):
    out = str(tmp_path / "run")
    args = ["train", "--data", corpus, "--out", out, "--steps", "3", "--cache-dir",
            str(tmp_path / "cache")] + FAST
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "val_bpb" in text and "checkpoint" in text
    for f in ("checkpoint.safetensors", "log.jsonl"):
        assert os.path.exists(os.path.join(out, f))
    rows = [json.loads(line) for line in Path(out, "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert main(["train", "--out", out, "--resume", "--steps", "4"] + FAST) == 0
    rows = [json.loads(line) for line in Path(out, "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    capsys.readouterr()
    assert main(["sample", out, "--prompt", "ab", "--max-new-tokens", "20", "--seed", "1"]) == 0
    s = capsys.readouterr().out
    assert s.startswith("ab") and len(s) >= 3


@pytest.mark.parametrize("flag,value,word", [
    ("--lr", "abc", "--lr"), ("--steps", "0", "--steps"), ("--batch", "-3", "--batch"),
    ("--preset", "XL", "--preset"), ("--time-budget", "nan", "--time-budget"),
    ("--threads", "1.5", "--threads")])
def test_bad_flags(capsys, flag, value, word):
    with pytest.raises(SystemExit) as e:
        main(["train", flag, value])
    _one_line_error(capsys, 2, e.value.code, word)


def test_bad_inputs(tmp_path, corpus, capsys):
    rc = main(["train", "--data", str(tmp_path / "missing.txt"), "--out",
               str(tmp_path / "r0")] + FAST)
    _one_line_error(capsys, 1, rc, "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    rc = main(["train", "--data", str(empty), "--out", str(tmp_path / "r1")] + FAST)
    _one_line_error(capsys, 1, rc, "empty")
    out = str(tmp_path / "run")
    assert main(["train", "--data", corpus, "--out", out, "--steps", "1", "--cache-dir",
                 str(tmp_path / "cache")] + FAST) == 0
    capsys.readouterr()
    ck = os.path.join(out, "checkpoint.safetensors")
    rc = main(["train", "--out", out, "--resume", "--batch", "3"] + FAST[:4] + FAST[6:])
    _one_line_error(capsys, 1, rc, "different configuration", "batch")
    rc = main(["train", "--data", corpus, "--out", out, "--steps", "1"] + FAST)
    _one_line_error(capsys, 1, rc, "already holds a run")
    blob = Path(ck).read_bytes()
    Path(ck).write_bytes(blob[:-10])
    damaged = Path(ck).read_bytes()
    rc = main(["train", "--out", out, "--resume", "--steps", "2"] + FAST)
    _one_line_error(capsys, 1, rc, "truncated")
    assert Path(ck).read_bytes() == damaged  # a failed start writes nothing
    rc = main(["sample", out, "--prompt", "x"])
    _one_line_error(capsys, 1, rc, "truncated")
    rc = main(["sample", str(tmp_path / "nope"), "--prompt", "x"])
    _one_line_error(capsys, 1, rc, "no checkpoint")


def test_python_m_entry_point(tmp_path):
    import rwkvx_c
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(rwkvx_c.__file__)))
    r = subprocess.run([sys.executable, "-m", "rwkvx_c", "train", "--steps", "zero"],
                       capture_output=True, text=True, cwd=str(tmp_path), env=env)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "--steps" in r.stderr


def test_late_ctrl_c_while_ignoring_it(monkeypatch):
    """A second Ctrl-C can land inside signal.signal itself, before SIGINT is
    ignored (CI saw the traceback): the exit path sets it again."""
    from rwkvx_c import cli
    real, calls = signal.signal, []

    def interrupted_once(sig, handler):
        calls.append(handler)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(sig, handler)

    old = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(signal, "signal", interrupted_once)
    try:
        cli._ignore_sigint()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and len(calls) == 2
    finally:
        real(signal.SIGINT, old)


def _actions(parser):
    """(command path, action) of every option of the parser and its subcommands."""
    import argparse
    todo = [((), parser)]
    while todo:
        path, p = todo.pop()
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += [(path + (name,), sub) for name, sub in a.choices.items()]
            elif a.option_strings:
                yield path, a


def test_every_option_shows_its_default():
    import argparse

    from rwkvx_c.cli import build_parser
    seen = 0
    for path, a in _actions(build_parser()):
        if isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
            continue
        seen += 1
        assert a.help and ("default" in a.help or "required" in a.help), \
            f"rwkvx-c {' '.join(path)} {a.option_strings[0]}: {a.help!r}"
    assert seen > 40


def test_every_subcommand_prints_its_help(capsys):
    """--help formats every option's help (argparse %-expands it: a bare
    '%' in a help text made `rwkvx-c train --help` raise ValueError)."""
    from rwkvx_c.cli import build_parser
    subs = sorted({path[0] for path, _ in _actions(build_parser()) if path})
    assert "train" in subs
    for sub in subs:
        with pytest.raises(SystemExit) as e:
            main([sub, "--help"])
        assert e.value.code == 0, sub
        assert "usage: rwkvx-c " + sub in capsys.readouterr().out


def test_version_and_no_abbreviated_flags(capsys):
    import rwkvx_c
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == \
        f"rwkvx-c {rwkvx_c.__version__}"
    # --step is not --steps, nor --seq is --seq-len: a typo is an error, not a guess
    for flag in ("--step", "--seq", "--lr-scale"):
        with pytest.raises(SystemExit) as e:
            main(["train", flag, "3"])
        assert e.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def test_loss_plot_has_the_run_bpb_and_time(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from rwkvx_c.run.plot import plot_log
    rows = [{"step": s, "loss": 5.0 - s / 100, "elapsed": 1.5 * s} for s in range(1, 201)]
    rows += [{"step": s, "val_loss": 3.0, "val_bpb": 4.3 - s / 100, "elapsed": 1.5 * s}
             for s in (50, 100, 200)]
    drawn = []
    real = plt.Figure.savefig

    def keep(fig, *a, **kw):
        drawn.append(fig)
        return real(fig, *a, **kw)
    plt.Figure.savefig = keep
    try:
        assert plot_log(rows, str(tmp_path / "loss.png"), title="rwkvx-c train: runs/x")
    finally:
        plt.Figure.savefig = real
    (fig,) = drawn
    main_ax = fig.axes[0]
    assert main_ax.get_title() == "rwkvx-c train: runs/x"
    labels = {ax.get_ylabel() for ax in fig.axes} | {ax.get_xlabel() for ax in fig.axes}
    assert "validation bits per byte" in labels and "training time (min)" in labels
    assert (tmp_path / "loss.png").stat().st_size > 10000


def test_a_source_tree_without_its_extension_says_what_to_do(tmp_path):
    import shutil

    import rwkvx_c
    tree = tmp_path / "checkout"
    shutil.copytree(os.path.dirname(rwkvx_c.__file__), tree / "rwkvx_c",
                    ignore=shutil.ignore_patterns("*.so", "lib", "include", "__pycache__"))
    # -S: no site-packages, so neither an installed rwkvx_c nor an editable
    # install's finder can supply the extension
    r = subprocess.run([sys.executable, "-S", "-c", "import rwkvx_c"], cwd=tree,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: rwkvx_c was imported from the source tree"), r.stderr
    assert "pip install -e ." in last and "another folder" in last
