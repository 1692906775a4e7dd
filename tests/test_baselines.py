"""Baselines and progress (docs/training.md §Progress): a fine-tune's
evaluation before its first step, logged as step 0; --sample-every's
generations in the log and the trackers; --epochs. Each option from the
command line, TrainOptions and a config file."""
import json
import math
import os

import numpy as np
import pytest
from test_finetune import _base_run
from test_train import SMALL, _corpus, _opts

from rwkvx_c.cli import main
from rwkvx_c.generation import Sampling, generate
from rwkvx_c.run.plot import plot_log
from rwkvx_c.sample import load_run
from rwkvx_c.train import Trainer, TrainError, TrainOptions, options_from_file
from rwkvx_c.train.config_file import load_config
from rwkvx_c.train.stepping import SAMPLE_TOKENS

RWKV = dict(SMALL, n_attn_layer=0)
PROMPTS = ["def ", "return"]


def _rows(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def _cli(tmp_path, out, *extra):
    return main(["train", "--data", _corpus(tmp_path), "--batch", "2", "--seq-len", "24",
                 "--eval-tokens", "96", "--threads", "2", "--precision", "fp32", "--no-progress",
                 "--cache-dir", str(tmp_path / "cache"), "--preset", "tiny", "--n-embd", "32",
                 "--head-size", "16", "--n-layer", "2", "--n-attn-layer", "0", "--warmup", "1",
                 "--out", out, *extra])


def test_a_fine_tune_evaluates_its_source_as_step_0(tmp_path):
    base = _base_run(tmp_path, RWKV)
    src = Trainer.resume(base)
    want = src.evaluate()   # the source's loss on the same windows
    src.close()
    out = str(tmp_path / "ft")
    tr = Trainer(_opts(tmp_path, model=None, init_from=base, tune="state", steps=2), out)
    seen = []
    tr.run(on_step=seen.append)
    rows = _rows(out)
    assert rows[0] == {"step": 0, "val_loss": want["val_loss"], "val_bpb": want["val_bpb"],
                       "elapsed": rows[0]["elapsed"], "world_size": 1}
    assert seen[0]["step"] == 0 and [r["step"] for r in rows if "loss" in r] == [1, 2]
    # plotted with the rest of the validation curve
    assert plot_log(rows, str(tmp_path / "p.png")) and os.path.getsize(tmp_path / "p.png")
    # a run from scratch has no source to measure: its log starts at step 1
    scratch = str(tmp_path / "s")
    Trainer(_opts(tmp_path, model=dict(RWKV), steps=1), scratch).run()
    assert _rows(scratch)[0]["step"] == 1


def test_sample_every_writes_generations_and_leaves_training_alone(tmp_path):
    plain, sampled = str(tmp_path / "plain"), str(tmp_path / "sampled")
    assert _cli(tmp_path, plain, "--steps", "4") == 0
    args = ["--steps", "4", "--sample-every", "2"]
    for p in PROMPTS:
        args += ["--sample-prompt", p]
    assert _cli(tmp_path, sampled, *args) == 0
    losses = [[r["loss"] for r in _rows(o) if "loss" in r] for o in (plain, sampled)]
    assert losses[0] == losses[1] and len(losses[0]) == 4
    got = [r for r in _rows(sampled) if "samples" in r]
    assert [r["step"] for r in got] == [0, 2, 4]
    assert [s["prompt"] for s in got[-1]["samples"]] == PROMPTS
    # the last: what the batched engine gives the saved model, greedy
    model, tok = load_run(sampled)
    outs = generate(model, PROMPTS, max_new_tokens=SAMPLE_TOKENS,
                    sampling=Sampling(temperature=0.0), tokenizer=tok)
    assert [s["text"] for s in got[-1]["samples"]] == [c.text for c in outs]
    assert load_config(os.path.join(sampled, "config.toml"))["sample_prompt"] == PROMPTS


def test_the_generations_reach_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = str(tmp_path / "tb")
    Trainer(_opts(tmp_path, model=dict(RWKV), steps=2, sample_every=1, sample_prompt=["def "],
                  log_to="tensorboard"), out).run()
    acc = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = acc.Tensors("samples")
    assert [e.step for e in texts] == [0, 1, 2]
    last = [r for r in _rows(out) if "samples" in r][-1]["samples"][0]
    assert texts[-1].tensor_proto.string_val[0].decode() == last["prompt"] + last["text"]


def test_epochs_set_the_steps_and_the_header_says_what_they_cover(tmp_path, capsys):
    out = str(tmp_path / "e")
    assert _cli(tmp_path, out, "--epochs", "0.05") == 0
    header = capsys.readouterr().out
    tr = Trainer.resume(out)
    per_epoch = tr.epoch_steps()
    tr.close()
    steps = math.ceil(0.05 * per_epoch)
    assert [r["step"] for r in _rows(out) if "loss" in r][-1] == steps
    assert f"stop after {steps} steps ({steps / per_epoch:.3g} epochs)" in header, header
    # --steps beside it must be the same count
    assert _cli(tmp_path, str(tmp_path / "x"), "--epochs", "0.05", "--steps",
                str(steps + 1)) == 1
    assert "give --epochs or --steps, not both" in capsys.readouterr().err
    # from Python: a pass is the training split's tokens over a step's
    tr = Trainer(_opts(tmp_path, model=dict(RWKV), steps=None, epochs=2.0), str(tmp_path / "p"))
    assert tr.opts.steps == math.ceil(2.0 * tr.corpus.train.size / (2 * 24))
    tr.close()


def test_each_option_from_python_and_from_a_config_file(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('epochs = 0.02\nsample_every = 3\nsample_prompt = ["def ", "x"]\n')
    o = options_from_file(str(cfg))
    assert (o.epochs, o.sample_every, o.sample_prompt) == (0.02, 3, ["def ", "x"])
    p = TrainOptions(epochs=0.02, sample_every=3, sample_prompt=["def ", "x"])
    assert (p.epochs, p.sample_every, p.sample_prompt) == (o.epochs, o.sample_every,
                                                           o.sample_prompt)
    out = str(tmp_path / "c")
    assert _cli(tmp_path, out, "--config", str(cfg)) == 0
    rows = _rows(out)
    assert [r["step"] for r in rows if "samples" in r][:2] == [0, 3]
    saved = load_config(os.path.join(out, "config.toml"))
    assert saved["epochs"] == 0.02 and saved["sample_every"] == 3
    # --sample-every without a prompt, or a prompt without it, is refused
    for kw in ({"sample_every": 2}, {"sample_prompt": ["a"]}):
        with pytest.raises(TrainError, match="go together"):
            Trainer(_opts(tmp_path, model=dict(RWKV), **kw))
    bad = tmp_path / "bad.toml"
    bad.write_text("sample_prompt = 3\n")
    with pytest.raises(TrainError, match="sample_prompt must be a text or a list of texts"):
        options_from_file(str(bad))
    assert np.isfinite([r["loss"] for r in rows if "loss" in r]).all()
