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


# ---- the second hour's small things (issue: fine-tunes, eval, chat) ----

def _cli_train(tmp_path, out, *extra):
    from rwkvx_c.cli import main
    return main(["train", "--data", corpus(str(tmp_path)), "--batch", "2", "--seq-len", "16",
                 "--eval-tokens", "32", "--threads", "2", "--no-progress", "--preset", "tiny",
                 "--n-embd", "32", "--head-size", "16", "--n-layer", "2", "--n-attn-layer", "0",
                 "--cache-dir", str(tmp_path / "c"), "--out", out, *extra])


def test_piped_chat_echoes_the_users_lines(tmp_path, capsys, monkeypatch):
    import io

    from rwkvx_c.cli import main
    run = str(tmp_path / "r")
    assert _cli_train(tmp_path, run, "--steps", "1") == 0
    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there\nsecond line\n"))
    assert main(["chat", run, "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "User: hello there\nAssistant:" in out and "User: second line\nAssistant:" in out


def test_the_header_counts_what_trains_once_and_names_the_frozen_rest(tmp_path, capsys):
    base, lora = str(tmp_path / "b"), str(tmp_path / "l")
    assert _cli_train(tmp_path, base, "--steps", "1") == 0
    capsys.readouterr()
    assert _cli_train(tmp_path, lora, "--steps", "1", "--init-from", base, "--tune", "lora",
                      "--lora-r", "2") == 0
    out = capsys.readouterr().out
    assert out.count("params train") == 0 and out.count("2,304 params") == 1, out
    assert "no frozen base" not in out and "the rest frozen, fp32" in out
    assert "pins   1 source run checkpoint(s)" in out


def test_a_preference_run_names_its_objective_and_warns_of_a_tiny_held_out_set(tmp_path,
                                                                              capsys):
    import json
    base, dpo = str(tmp_path / "b"), str(tmp_path / "d")
    assert _cli_train(tmp_path, base, "--steps", "1") == 0
    pairs = tmp_path / "pairs.jsonl"
    with open(pairs, "w") as f:   # 10 pairs: the last one held out
        for i in range(10):
            f.write(json.dumps({"prompt": f"Say {i}", "chosen": f"{i} {i}",
                                "rejected": "no"}) + "\n")
    capsys.readouterr()
    assert _cli_train(tmp_path, dpo, "--steps", "1", "--init-from", base, "--tune", "lora",
                      "--lora-r", "2", "--objective", "dpo", "--dpo-beta", "0.2",
                      "--data", str(pairs), "--batch", "2", "--seq-len", "40") == 0
    out, err = capsys.readouterr()
    assert "warning: the held-out preference set is only 1 pair of 10" in err, err
    assert "  loss   dpo, beta 0.2\n" in out, out
    # its evaluations carry no val_bpb (pairs have no bytes to count), not a null
    with open(os.path.join(dpo, LOG)) as f:
        rows = [json.loads(line) for line in f]
    assert [r for r in rows if "val_loss" in r] and all("val_bpb" not in r for r in rows)
    # the summary's sample hint is a chat turn, not code
    assert "rwkvx-c sample" in out and "'def '" not in out


def test_the_sample_hint_fits_the_data(tmp_path, capsys):
    import json
    chat = tmp_path / "chat.jsonl"
    with open(chat, "w") as f:
        for i in range(40):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    run = str(tmp_path / "chat")
    capsys.readouterr()
    assert _cli_train(tmp_path, run, "--steps", "1", "--data", str(chat)) == 0
    hint = capsys.readouterr().out.strip().splitlines()[-1]
    assert "Assistant:" in hint and "def " not in hint, hint
    # any other text: sample's own empty prompt
    assert _cli_train(tmp_path, str(tmp_path / "t"), "--steps", "1") == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(str(tmp_path / "t"))


def test_a_compressed_files_size_is_not_called_its_bytes(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    from rwkvx_c.data import load_corpus
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["def f(x):\n    return x\n" * 20] * 30}), str(p))
    c = load_corpus(str(p), seq_len=16, tokenizer=None, cache_dir=str(tmp_path / "c"))
    assert c.description.endswith(f"from {os.path.getsize(p):,} bytes of compressed files)")
    # a run saved with the old spelling still resumes on it
    assert c.described_as(c.description.replace(" bytes of compressed files)", " bytes)"))


def test_warmup_steps_is_the_flag_of_its_toml_key(tmp_path):
    from rwkvx_c.train.config_file import load_config
    for flag in ("--warmup-steps", "--warmup"):   # the old spelling stays an alias
        out = str(tmp_path / flag.strip("-"))
        assert _cli_train(tmp_path, out, "--steps", "1", flag, "3") == 0
        assert load_config(os.path.join(out, "config.toml"))["warmup_steps"] == 3
