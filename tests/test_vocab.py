"""The model's vocabulary follows the data (rwkvx_c.train.assemble.model_vocab):
the README's pre-tokenised example trains, --vocab-size sets or pads it,
and --resume keeps it."""
import json

import numpy as np
import pytest

from rwkvx_c.cli import main
from rwkvx_c.errors import TrainError
from rwkvx_c.run.checkpoint import read_checkpoint
from rwkvx_c.train.options import TrainOptions
from rwkvx_c.train.trainer import Trainer

from hostile import SMALL

TINY_V = dict(SMALL, n_attn_layer=0)


@pytest.fixture
def tokens(tmp_path):
    """The README's example: tokens.u16.bin with {"dtype": "uint16", "vocab_size": 50304}."""
    p = tmp_path / "tokens.u16.bin"
    np.random.default_rng(0).integers(0, 50000, 6000).astype("<u2").tofile(p)
    (tmp_path / "tokens.u16.bin.json").write_text(json.dumps({"dtype": "uint16",
                                                              "vocab_size": 50304}))
    return str(p)


def _opts(tmp_path, data, **kw):
    return TrainOptions(**{**dict(preset="tiny", data=data, model=dict(TINY_V), batch=2,
                                  seq_len=16, steps=2, eval_tokens=32, threads=2,
                                  cache_dir=str(tmp_path / "c")), **kw})


def test_the_readme_token_file_trains_at_its_vocabulary(tmp_path, tokens):
    tr = Trainer(_opts(tmp_path, tokens), str(tmp_path / "run"))
    tr.run()
    assert tr.model.config["vocab_size"] == 50304
    _, config, state = read_checkpoint(str(tmp_path / "run" / "checkpoint.safetensors"))
    assert config["vocab_size"] == 50304 and state["options"]["vocab_size"] == 50304


def test_vocab_size_pads_or_is_refused(tmp_path, tokens):
    tr = Trainer(_opts(tmp_path, tokens, vocab_size=50432), None)
    assert tr.model.params["emb"].shape[0] == 50432
    tr.step()
    with pytest.raises(TrainError, match=r"cannot hold the data's token ids \(0\.\.50303\)"):
        Trainer(_opts(tmp_path, tokens, vocab_size=1000), None)
    # and bytes: a byte corpus pads too
    (tmp_path / "t.txt").write_text("hello world " * 300)
    assert Trainer(_opts(tmp_path, str(tmp_path / "t.txt"), vocab_size=320),
                   None).model.config["vocab_size"] == 320


def test_cli_vocab_size_and_resume(tmp_path, tokens, capsys):
    out = str(tmp_path / "run")
    base = ["train", "--data", tokens, "--preset", "tiny", "--n-embd", "32", "--head-size", "16",
            "--n-layer", "1", "--n-attn-layer", "0", "--ffn-dim", "64", "--batch", "2",
            "--seq-len", "16", "--eval-tokens", "32", "--cache-dir", str(tmp_path / "c"),
            "--no-progress", "--out", out]
    assert main(base + ["--steps", "2", "--vocab-size", "50368"]) == 0
    capsys.readouterr()
    resume = ["train", "--resume", "--out", out, "--steps", "3", "--no-progress",
              "--cache-dir", str(tmp_path / "c")]
    assert main(resume + ["--vocab-size", "50304"]) == 1
    assert "vocab_size 50368 -> 50304" in capsys.readouterr().err
    assert main(resume + ["--vocab-size", "50368"]) == 0
    assert main(resume[:4] + ["--steps", "4"] + resume[6:]) == 0
    _, config, _ = read_checkpoint(out + "/checkpoint.safetensors")
    assert config["vocab_size"] == 50368
