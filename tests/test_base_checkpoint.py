"""A fine-tune's checkpoint holds what trains and names its base
(docs/finetune.md §Checkpoints of a fine-tune, rwkvx_c/run/base.py): the
trained tensors and their moments and nothing of the frozen base; the base
by path and SHA-256; resume, load_model, sample, export and --init-from
rebuild the model from the base; a moved or changed base refused in one
line, --base pointing at it again; full-copy checkpoints of earlier
versions still resume bit for bit; a LoRA run's merged export merges into
the source's original weights, read again from it."""
import hashlib
import os
import shutil

import numpy as np
import pytest
from test_finetune import _base_run
from test_finetune import _tune as _tune_at
from test_interop import _official_dict
from test_train import SMALL, _opts

from rwkvx_c import interop
from rwkvx_c.cli import main
from rwkvx_c.errors import CheckpointError
from rwkvx_c.interop.source import read_source
from rwkvx_c.run.checkpoint import read_checkpoint, save_checkpoint
from rwkvx_c.run.rundir import RunDir
from rwkvx_c.sample import load_model
from rwkvx_c.train import Trainer
from rwkvx_c.train.finetune import from_source, is_unfrozen

RWKV = dict(SMALL, n_attn_layer=0)
CKPT = "checkpoint.safetensors"
TOKENS = np.arange(40, dtype=np.int32).reshape(2, 20) % 200



def _tune(tmp_path, src, out, **kw):
    """A fine-tune in fp32: its model is compared bit for bit with the model
    load_model rebuilds (fp32), whatever --precision auto picks here."""
    return _tune_at(tmp_path, src, out, **{"precision": "fp32", **kw})

def _sha256(folder):
    """The recorded hash of a run folder base, computed here from its rule
    (name, size, then the bytes of the folder's checkpoint)."""
    p = os.path.join(folder, CKPT)
    with open(p, "rb") as f:
        data = f.read()
    return hashlib.sha256(f"{CKPT}\0{len(data)}\0".encode() + data).hexdigest()


def _losses(rows):
    return [r["loss"] for r in rows if "loss" in r]


def test_a_state_checkpoint_holds_the_states_and_names_its_base(tmp_path):
    base = _base_run(tmp_path, RWKV)
    tr = _tune(tmp_path, base, "st", tune="state", steps=3, lr=3e-2)
    tr.run()
    ck, _, state = read_checkpoint(str(tmp_path / "st" / CKPT))
    assert sorted(ck) == ["optim.m", "optim.v", "state0"]
    assert ck["optim.m"].size == tr.model.state.size
    rec = state["base"]
    assert rec["path"] == os.path.abspath(base) and rec["sha256"] == _sha256(base)
    # rebuilt from the base: the trained model, bit for bit
    m = load_model(str(tmp_path / "st"))
    assert np.array_equal(m.state, tr.model.state)
    assert np.array_equal(m.forward(TOKENS), tr.model.forward(TOKENS))
    # and as a source of the next tune: the base's weights with the states
    src = read_source(str(tmp_path / "st"))
    base_ck, _, _ = read_checkpoint(os.path.join(base, CKPT))
    for n in tr.model.param_names:
        assert np.array_equal(src.weights[n], base_ck[n]), n
    assert np.array_equal(src.state0, tr.model.state)


def test_a_lora_run_with_a_trained_group_resumes_bit_exact_from_its_base(tmp_path):
    base = _base_run(tmp_path, RWKV)
    kw = dict(tune="lora", lora_r=3, train_parts="ln", steps=6, lr=1e-2, save_every=3)
    whole = _tune(tmp_path, base, "a", **kw)
    rows = []
    whole.run(on_step=rows.append)
    ck, _, _ = read_checkpoint(str(tmp_path / "a" / CKPT))
    held = {k for k in ck if not k.startswith("optim.") and not k.endswith(("lora_A", "lora_B"))}
    assert held and all(k.rsplit(".", 1)[-1].startswith("ln") for k in held)
    part = _tune(tmp_path, base, "b", **kw)
    part.run(stop=lambda: part.step_count >= 3)
    again = []
    r = Trainer.resume(str(tmp_path / "b"))
    r.run(on_step=again.append)
    assert _losses(again) == _losses(rows)[3:]
    assert np.array_equal(r.model.param_buffer, whole.model.param_buffer)
    assert np.array_equal(r.model.lora_buffer, whole.model.lora_buffer)


def test_an_expanded_hybrid_holds_its_new_blocks(tmp_path):
    """--init-from a pure RWKV-7 run with --n-attn-layer: the attention
    blocks the base lacks are held by the checkpoint, the rest named."""
    base = _base_run(tmp_path, RWKV)
    s = read_source(base)
    opts = from_source(_opts(tmp_path, model={"n_attn_layer": 1}, tune="state", steps=2,
                             lr=3e-2, precision="fp32"), s.config, s.tokenizer, base)
    tr = Trainer(opts, str(tmp_path / "x"), _weights=s.weights)
    tr.run()
    ck, _, _ = read_checkpoint(str(tmp_path / "x" / CKPT))
    layers = tr.model.layers
    attn = [n for n in tr.model.param_names
            if n.startswith("blocks.") and layers[int(n.split(".")[1])] == "A"]
    assert attn and set(attn) <= set(ck)
    assert not any(n in ck for n in tr.model.param_names if n not in attn)
    m = load_model(str(tmp_path / "x"))
    assert np.array_equal(m.forward(TOKENS), tr.model.forward(TOKENS))


def _cli_state_run(tmp_path, base, out, steps=2, *extra):
    data = ["--data", str(tmp_path / "corpus.txt"), "--cache-dir", str(tmp_path / "cache")]
    fast = ["--steps", str(steps), "--batch", "2", "--seq-len", "16", "--eval-tokens", "32",
            "--threads", "1", "--no-progress", "--lr", "0.03"]
    return main(["train", "--init-from", base, "--tune", "state", "--out", out]
                + data + fast + list(extra))


def test_a_moved_or_changed_base_is_refused_and_base_points_again(tmp_path, capsys):
    """A base the run does not pin (a run recorded before pins; the same
    rules hold for a .pth or Hugging Face base, which are never pinned)."""
    base = _base_run(tmp_path, RWKV)
    run = str(tmp_path / "st")
    _tune(tmp_path, base, "st", tune="state", steps=2, lr=3e-2).run()
    want = load_model(run).forward(TOKENS)
    moved = str(tmp_path / "moved")
    shutil.move(base, moved)
    capsys.readouterr()
    for cmd in (["sample", run, "--max-new-tokens", "2"],
                ["export", run, "--format", "state", "--out", str(tmp_path / "s.pth")],
                ["train", "--resume", "--out", run, "--steps", "3", "--no-progress"]):
        assert main(cmd) == 1, cmd
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and os.path.abspath(base) in err[0] and run in err[0], err
        assert "--base PATH" in err[0] and "missing" in err[0]
    with pytest.raises(CheckpointError, match="missing"):
        load_model(run)
    with pytest.raises(CheckpointError, match=r"--base \S+nowhere is missing; give the path "
                       r"of the base of .* \(it was " + os.path.abspath(base)):
        load_model(run, base=str(tmp_path / "nowhere"))
    # pointed at again: the same model; a resume records where it is now
    assert np.array_equal(load_model(run, base=moved).forward(TOKENS), want)
    assert main(["sample", run, "--max-new-tokens", "2", "--base", moved]) == 0
    assert main(["eval", run, "--data", str(tmp_path / "corpus.txt"), "--seq-len", "16",
                 "--base", moved]) == 0
    assert main(["export", run, "--format", "rwkv7", "--out", str(tmp_path / "e.pth"),
                 "--base", moved]) == 0
    assert main(["train", "--resume", "--out", run, "--steps", "3", "--no-progress",
                 "--base", moved]) == 0
    _, _, state = read_checkpoint(os.path.join(run, CKPT))
    assert state["base"]["path"] == moved and state["step"] == 3
    assert main(["sample", run, "--max-new-tokens", "2"]) == 0
    # touched but the same bytes: hashed again and accepted
    os.utime(os.path.join(moved, CKPT), ns=(1, 1))
    assert main(["sample", run, "--max-new-tokens", "2"]) == 0
    # changed: refused, naming both and how to point at the original
    with open(os.path.join(moved, CKPT), "rb") as f:
        original = f.read()
    tensors, config, st = read_checkpoint(os.path.join(moved, CKPT))
    tensors = {k: np.array(v) for k, v in tensors.items()}
    tensors["emb"][0, 0] += 1.0
    save_checkpoint(os.path.join(moved, CKPT), tensors, config, st)
    capsys.readouterr()
    assert main(["sample", run, "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and moved in err[0] and run in err[0] and "--base PATH" in err[0], err
    assert "is not the base" in err[0]
    # a new run from the run: --base names where the run's base is now
    with open(os.path.join(moved, CKPT), "wb") as f:
        f.write(original)
    shutil.move(moved, base)
    capsys.readouterr()
    assert _cli_state_run(tmp_path, run, str(tmp_path / "next"), 1) == 1
    assert "missing" in capsys.readouterr().err
    assert _cli_state_run(tmp_path, run, str(tmp_path / "next"), 1, "--base", base) == 0
    # the new run pins the run, and the run's base found at --base
    rec = read_checkpoint(str(tmp_path / "next" / CKPT))[2]["base"]
    assert os.path.samefile(rec["path"], os.path.join(run, CKPT))
    assert len(RunDir(str(tmp_path / "next")).pins()) == 2
    # --base without --init-from, or on a run that names no base, is refused
    assert main(["train", "--out", str(tmp_path / "new"), "--base", base]) == 1
    assert "give it with --resume" in capsys.readouterr().err
    assert main(["train", "--resume", "--out", base, "--steps", "4", "--no-progress",
                 "--base", base]) == 1
    assert "names no base" in capsys.readouterr().err


def test_a_full_copy_checkpoint_of_an_earlier_version_resumes_bit_for_bit(tmp_path):
    """Fine-tune checkpoints written before the base was named hold every
    parameter and no base record: they load and resume as they did."""
    base = _base_run(tmp_path, RWKV)
    kw = dict(tune="state", steps=6, lr=3e-2, save_every=3)
    whole = _tune(tmp_path, base, "a", **kw)
    rows = []
    whole.run(on_step=rows.append)
    part = _tune(tmp_path, base, "b", **kw)
    part.run(stop=lambda: part.step_count >= 3)
    # rewritten as the earlier code wrote it: every parameter, no "base"
    path = str(tmp_path / "b" / CKPT)
    tensors, config, state = read_checkpoint(path)
    del state["base"]
    full = {**{n: np.array(p) for n, p in part.model.params.items()}, **tensors}
    save_checkpoint(path, full, config, state)
    shutil.move(base, str(tmp_path / "gone"))   # nothing of the base is needed
    assert np.array_equal(load_model(str(tmp_path / "b")).state, part.model.state)
    again = []
    r = Trainer.resume(str(tmp_path / "b"))
    r.run(on_step=again.append)
    assert _losses(again) == _losses(rows)[3:]
    assert np.array_equal(r.model.state, whole.model.state)
    ck, _, st = read_checkpoint(path)
    assert st.get("base") is None and "emb" in ck   # it stays whole


def test_a_rollback_across_the_switch_takes_the_base_back(tmp_path):
    base = _base_run(tmp_path, RWKV)
    tr = _tune(tmp_path, base, "u", tune="lora", lora_r=2, steps=4, unfreeze_at=3, lr=1e-2)
    tr.step()
    tr.step()
    tr.save()
    before = {k: np.array(v) for k, v in tr.model.lora.items()}
    tr.step()   # the switch: the adapters merged, the base training
    tr.step()
    assert is_unfrozen(tr.optim) and tr.model.lora is None
    ck, _, state = read_checkpoint(str(tmp_path / "u" / CKPT))
    assert state["unfrozen"] is False and state["base"] is not None
    tr._restore(state, ck)
    src, _, _ = read_checkpoint(os.path.join(base, CKPT))
    assert not is_unfrozen(tr.optim)
    for n in tr.model.param_names:
        assert np.array_equal(tr.model.params[n], src[n]), n
    for k, v in before.items():
        assert np.array_equal(tr.model.lora[k], v), k
    resumed = Trainer.resume(str(tmp_path / "u"))
    assert resumed.step()["loss"] == tr.step()["loss"]


def test_the_merged_export_merges_into_the_sources_original_weights(tmp_path, capsys):
    """A LoRA run on a bf16 .pth: its rwkv7 export is RWKV-PEFT's merge
    (W += B @ A * alpha / r) applied to the .pth's own weights, whatever
    the base is held as in training; the output line says so."""
    torch = pytest.importorskip("torch")
    sd = _official_dict(np.random.default_rng(0), V=256, C=32, H=2, N=16, L=2, F=64, Dw=8,
                        Da=8, Dv=8, Dg=8)
    pth = str(tmp_path / "official.pth")
    interop.save_pth(sd, pth, "bf16")
    (tmp_path / "corpus.txt").write_text("".join(
        np.random.default_rng(1).choice(list("abcdefgh \n"), 4000)))
    run = str(tmp_path / "lo")
    assert main(["train", "--init-from", pth, "--tune", "lora", "--lora-r", "4",
                 "--lora-alpha", "8", "--out", run, "--data", str(tmp_path / "corpus.txt"),
                 "--cache-dir", str(tmp_path / "cache"), "--steps", "3", "--batch", "2",
                 "--seq-len", "16", "--eval-tokens", "32", "--lr", "0.01", "--threads", "1",
                 "--no-progress"]) == 0
    capsys.readouterr()
    merged, lora = str(tmp_path / "m.pth"), str(tmp_path / "l.pth")
    assert main(["export", run, "--format", "rwkv7", "--out", merged]) == 0
    out = capsys.readouterr().out
    assert "merged into the original weights of its base, read again from " + pth in out
    assert main(["export", run, "--format", "lora", "--out", lora]) == 0
    orig = torch.load(pth, map_location="cpu")
    got = torch.load(merged, map_location="cpu")
    ad = torch.load(lora, map_location="cpu")
    scale = float(ad.pop("lora_alpha")) / float(ad.pop("lora_r"))
    mods = [k[:-len(".lora_A")] for k in ad if k.endswith(".lora_A")]
    assert mods
    for mod in mods:
        A, B = ad[mod + ".lora_A"].double(), ad[mod + ".lora_B"].double()
        assert B.abs().max() > 0
        want = (orig[mod + ".weight"].double() + scale * (B @ A)).float().numpy()
        have = got[mod + ".weight"].float().numpy()
        # one float32 rounding of the same double sum (its order over r aside)
        assert np.all(np.abs(have - want) <= np.spacing(np.abs(want))), mod
    same = [k for k in got if k in orig and not any(k == m + ".weight" for m in mods)]
    assert len(same) > len(mods)
    for k in same:   # every other weight is the source's own
        assert np.array_equal(got[k].float().numpy().ravel(), orig[k].float().numpy().ravel()), k
