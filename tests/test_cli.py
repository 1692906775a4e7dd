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
