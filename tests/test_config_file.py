"""Config files (rwkvx_c.train.config_file): `rwkvx-c train --config`, flags
over the file, the resolved config.toml every run saves (training from it
repeats the run's losses bit for bit), one-line errors naming the nearest
valid key, and the examples/ configs."""
import glob
import json
import os

import pytest
from test_train import SMALL

from rwkvx_c.cli import main
from rwkvx_c.train import Trainer, TrainError, TrainOptions, options_from_file
from rwkvx_c.train.config_file import load_config

from hostile import corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _losses(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def _file(tmp_path, text, name="run.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _base(tmp_path):
    model = "\n".join(f"{k} = {v}" for k, v in SMALL.items())
    return _file(tmp_path, f'''preset = "tiny"
data = "{corpus(str(tmp_path))}"
cache_dir = "{tmp_path / 'cache'}"
steps = 4
batch = 2
seq_len = 16
eval_tokens = 32
lr = 0.003
warmup_steps = 1
threads = 2
''' + f"\n[model]\n{model}\n")


def test_a_run_from_its_saved_config_repeats_its_losses_bit_for_bit(tmp_path):
    cfg = _base(tmp_path)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["train", "--config", cfg, "--out", a, "--no-progress", "--grad-accum", "2"]) == 0
    saved = load_config(os.path.join(a, "config.toml"))
    assert saved["grad_accum"] == 2 and saved["steps"] == 4 and saved["model"]["n_embd"] == 32
    assert main(["train", "--config", os.path.join(a, "config.toml"), "--out", b,
                 "--no-progress"]) == 0
    la = [r["loss"] for r in _losses(a) if "loss" in r]
    lb = [r["loss"] for r in _losses(b) if "loss" in r]
    assert la == lb and len(la) == 4


def test_flags_override_the_file(tmp_path):
    cfg = _base(tmp_path)
    out = str(tmp_path / "o")
    assert main(["train", "--config", cfg, "--out", out, "--steps", "2", "--n-embd", "64",
                 "--no-progress"]) == 0
    saved = load_config(os.path.join(out, "config.toml"))
    assert saved["steps"] == 2 and saved["batch"] == 2 and saved["model"]["n_embd"] == 64


def test_the_python_route_is_the_same(tmp_path):
    cfg = _base(tmp_path)
    o = options_from_file(cfg, steps=3)
    assert isinstance(o, TrainOptions) and o.steps == 3 and o.batch == 2
    tr = Trainer(o, str(tmp_path / "py"))
    tr.close()
    assert load_config(str(tmp_path / "py" / "config.toml"))["steps"] == 3


@pytest.mark.parametrize("text,msg", [
    ("stpes = 3\n", "unknown option 'stpes'; did you mean 'steps'?"),
    ("lora-r = 8\n", "unknown option 'lora-r'; did you mean 'lora_r'?"),
    ("[model]\nn_emb = 64\n", "unknown model key 'n_emb'; did you mean 'n_embd'?"),
    ("steps = \n", "is not TOML"),
])
def test_bad_files_are_one_line(tmp_path, capsys, text, msg):
    cfg = _file(tmp_path, text)
    with pytest.raises(TrainError, match=msg.replace("?", r"\?")):
        load_config(cfg)
    assert main(["train", "--config", cfg, "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1
    assert main(["train", "--config", str(tmp_path / "none.toml")]) == 1
    with pytest.raises(TrainError, match="--config starts a new run"):
        from rwkvx_c.cli import build_parser
        from rwkvx_c.cli.train import train_options
        train_options(build_parser().parse_args(["train", "--config", cfg, "--resume"]))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "examples", "*.toml"))),
                         ids=os.path.basename)
def test_the_examples_are_valid_options(path):
    o = options_from_file(path).resolved()
    assert o.steps is not None and o.data
