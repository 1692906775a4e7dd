"""rwkvx-c eval of every source --init-from takes (docs/training.md
§Evaluating a trained model): a run, its checkpoint, an x070 .pth, a
Hugging Face folder and its .safetensors score the same; --split val
scores a run's own --val-data as the run validated on it; the warnings
advise what the run lacks."""
import importlib.util
import json
import os

import pytest
from test_train import SMALL, _corpus, _opts

from rwkvx_c.cli import main
from rwkvx_c.errors import RwkvxWarning
from rwkvx_c.train import Trainer

RWKV = dict(SMALL, n_attn_layer=0)


def _other(tmp_path):
    p = tmp_path / "other.txt"
    p.write_text("return self if x else None\n" * 300)
    return str(p)


def _score(capsys, *args):
    capsys.readouterr()
    assert main(["eval", *args, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_every_source_scores_the_same(tmp_path, capsys):
    run = str(tmp_path / "run")
    Trainer(_opts(tmp_path, model=dict(RWKV), steps=2, precision="fp32"), run).run()
    pth, hf = str(tmp_path / "m.pth"), str(tmp_path / "hf")
    assert main(["export", run, "--format", "rwkv7", "--out", pth]) == 0
    assert main(["export", run, "--format", "hf", "--out", hf]) == 0
    data = ["--data", _corpus(tmp_path), "--seq-len", "24"]
    want = _score(capsys, run, *data)["data"]
    sources = [os.path.join(run, "checkpoint.safetensors"), pth, hf]
    if importlib.util.find_spec("torch") is not None:   # the .pth's tensors, x070 names
        import torch
        from safetensors.torch import save_file
        st = str(tmp_path / "m.safetensors")
        save_file({k: v.contiguous() for k, v in torch.load(pth).items()}, st)
        sources.append(st)
    for src in sources:
        got = _score(capsys, src, *data)["data"]
        assert got["tokens"] == want["tokens"], src
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6), src
    # --split val needs a run's own data; --base a run's base
    assert main(["eval", pth, "--split", "val"]) == 2
    assert "is no run: give --data" in capsys.readouterr().err
    assert main(["eval", pth, "--base", run, *data]) == 1
    assert "names no base" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "nothing.pth"), *data]) == 1
    assert "no such file or folder" in capsys.readouterr().err


def test_split_val_scores_the_runs_own_val_data(tmp_path, capsys):
    run = str(tmp_path / "v")
    tr = Trainer(_opts(tmp_path, model=dict(RWKV), steps=2, precision="fp32",
                       val_data=_other(tmp_path)), run)
    final = tr.run()
    got = _score(capsys, run, "--split", "val")["data"]
    assert got["loss"] == pytest.approx(final["val_loss"], rel=1e-6)
    assert got["bpb"] == pytest.approx(final["val_bpb"], rel=1e-6)
    assert got["corpus"].startswith("validation ")
    # --data names another corpus: its own split, as before
    other = _score(capsys, run, "--split", "val", "--data", _corpus(tmp_path))["data"]
    assert other["loss"] != got["loss"]


def test_a_small_validation_warning_advises_what_the_run_lacks(tmp_path):
    with pytest.warns(RwkvxWarning, match="give --val-data, a larger --val-fraction"):
        Trainer(_opts(tmp_path, model=dict(RWKV), val_fraction=0.001,
                      eval_tokens=24 * 8)).close()
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x = 1\n" * 12)
    with pytest.warns(RwkvxWarning) as seen:
        Trainer(_opts(tmp_path, model=dict(RWKV), val_data=str(tiny),
                      eval_tokens=24 * 8)).close()
    msgs = [str(w.message) for w in seen if "validation holds" in str(w.message)]
    assert msgs and all("give a larger --val-data" in m and "give --val-data" not in m
                        for m in msgs), msgs
