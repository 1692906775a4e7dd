"""RWKV-PEFT's adapter files in and out (docs/finetune.md §Adapters in,
docs/interop.md): MiSS as RWKV-PEFT's DiSHA of "bone" mode ('{module}.disha'
[r, out]), the parts a run trained beside its adapters (RWKV-PEFT's
train_parts, "ln" by default) in the same file, and peft's MiSS forms (the
default, mini; bat refused). The merged weights are judged against a float64
NumPy merge written from RWKV-PEFT's rule (docs/interop.md), peft's mini form
by peft itself on the hf export."""
import json
import os

import numpy as np
import pytest
from test_finetune import _base_run
from test_interop import H64, TOL, _need, _rel
from test_lora import _lora_run
from test_train import _opts

from rwkvx_c.cli import main
from rwkvx_c.errors import InteropError, TrainError
from rwkvx_c.interop.pth import load_pth, save_pth
from rwkvx_c.interop.source import read_source
from rwkvx_c.run.checkpoint import read_checkpoint
from rwkvx_c.sample import load_model
from rwkvx_c.train import Trainer

from checks import FWD_TOL

TOKENS = np.frombuffer(b"def f(x):\n    return x * 2", np.uint8).astype(np.int32)
R = 4


def _trained(tr, seed=1):
    """tr run, then its adapters moved away from their init (and saved)."""
    tr.run()
    rng = np.random.default_rng(seed)
    for k, v in tr.model.lora.items():
        if not k.endswith(".lora_A") or tr.opts.adapter != "miss":   # MiSS's A is fixed
            v[...] += rng.standard_normal(v.shape).astype(np.float32) * 0.05
    tr.save()
    return tr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A base, a MiSS run and a LoRA run with --train-parts ln on it, and the
    rwkv7 export of the base."""
    d = tmp_path_factory.mktemp("rwkv_peft")
    base = _base_run(d, dict(H64, n_rwkv_layer=2))
    miss = _trained(_lora_run(d, base, "miss", steps=2, adapter="miss"))
    ln = _trained(_lora_run(d, base, "ln", steps=2, train_parts="ln"))
    assert main(["export", base, "--format", "rwkv7", "--out", str(d / "base.pth")]) == 0
    return d, base, miss, ln


def test_a_lora_tune_trains_the_states_beside_its_adapters_as_rwkv_peft_does(runs, tmp_path):
    """--tune lora --train-parts state: the initial WKV states train with
    the adapters (RWKV-PEFT's state tuning beside its PEFT), resume bit-exact,
    and travel in the lora export as '{block}.att.time_state', which comes
    back in as the same model training the same parts."""
    d, base, _, _ = runs
    tr = _lora_run(tmp_path, base, "ls", steps=4, train_parts="state", lr=1e-2)
    rows = []
    tr.run(on_step=rows.append)
    assert tr.model.state is not None and np.abs(tr.model.state).max() > 0   # they moved
    again = _lora_run(tmp_path, base, "ls2", steps=4, train_parts="state", lr=1e-2)
    again.run(stop=lambda: again.step_count >= 2)
    r = Trainer.resume(str(tmp_path / "ls2"))
    more = []
    r.run(on_step=more.append)
    assert [x["loss"] for x in more if "loss" in x] == [x["loss"] for x in rows if "loss" in x][2:]
    out = tmp_path / "ls.pth"
    assert main(["export", str(tmp_path / "ls"), "--format", "lora", "--out", str(out)]) == 0
    sd = load_pth(str(out))
    for i, s in enumerate(tr.model.state):
        assert np.array_equal(sd[f"blocks.{i}.att.time_state"], s)
    back = str(tmp_path / "back")
    assert main(["import", str(out), "--base", str(d / "base.pth"), "--out", back]) == 0
    assert _rel(load_model(back).forward(TOKENS), tr.model.forward(TOKENS)) <= FWD_TOL
    _, _, state = read_checkpoint(os.path.join(back, "checkpoint.safetensors"))
    assert state["lora"]["parts"] == "state"
    for kw in (dict(tune="full", train_parts="state"), dict(tune="state", train_parts="state"),
               dict(tune="full", freeze="state")):
        with pytest.raises(TrainError, match="the state group"):
            _opts(tmp_path, **kw).resolved()


def test_miss_goes_out_as_disha_blocks_that_merge_by_rwkv_peft_rule(runs):
    """export --format lora of a MiSS run writes '{module}.disha' [r, out]
    alone; merged by RWKV-PEFT's bone rule W[o, i] += disha[i % r, o] (its
    merge_disha.py) in float64 onto the base's x070 weights, it gives the
    merged model our export writes."""
    d = runs[0]
    out = d / "miss.pth"
    assert main(["export", str(d / "miss"), "--format", "lora", "--out", str(out)]) == 0
    sd = load_pth(str(out))
    assert sd and all(k.endswith(".disha") for k in sd), sorted(sd)[:3]
    base = load_pth(str(d / "base.pth"))
    assert main(["export", str(d / "miss"), "--format", "rwkv7", "--out",
                 str(d / "miss_merged.pth")]) == 0
    merged = load_pth(str(d / "miss_merged.pth"))
    for key, D in sd.items():
        W = base[key[:-len(".disha")] + ".weight"].astype(np.float64)   # [out, in]
        assert D.shape == (R, W.shape[0])
        ref = W + D.astype(np.float64)[np.arange(W.shape[1]) % R].T
        got = merged[key[:-len(".disha")] + ".weight"]
        assert np.abs(got - ref).max() <= 4 * np.finfo(np.float32).eps * np.abs(ref).max(), key
        assert np.abs(ref - W).max() > 0, key   # the blocks matter


def test_a_disha_file_comes_back_as_a_miss_tune(runs, tmp_path):
    """import of the DiSHA file on the base: the same model, and it trains
    on as MiSS (its fold A fixed, its blocks moving)."""
    d, _, miss, _ = runs
    out = d / "miss_back.pth"
    assert main(["export", str(d / "miss"), "--format", "lora", "--out", str(out)]) == 0
    back = str(tmp_path / "back")
    assert main(["import", str(out), "--base", str(d / "base.pth"), "--out", back]) == 0
    assert _rel(load_model(back).forward(TOKENS), miss.model.forward(TOKENS)) <= FWD_TOL
    _, _, state = read_checkpoint(os.path.join(back, "checkpoint.safetensors"))
    assert state["lora"]["kind"] == "miss"
    tr = Trainer(_opts(tmp_path, model=None, init_from=str(out), base=str(d / "base.pth"),
                       steps=2), str(tmp_path / "on"))
    assert tr.opts.adapter == "miss"
    before = {k: np.array(v) for k, v in tr.model.lora.items()}
    tr.run()
    for k, v in tr.model.lora.items():
        moved = not np.array_equal(v, before[k])
        assert moved == k.endswith(".lora_B"), k


def test_bat_and_mixed_files_are_refused_in_one_line(runs, tmp_path):
    d, _, _, _ = runs
    sd = load_pth(str(d / "base.pth"))
    C = sd["blocks.0.att.key.weight"].shape[1]
    bat = {"blocks.0.att.key.disha": np.zeros((C // R, R, R), np.float32)}
    save_pth(bat, str(tmp_path / "bat.pth"))
    with pytest.raises(InteropError, match=r"bat mode .*merge_disha\.py"):
        read_source(str(tmp_path / "bat.pth"), str(d / "base.pth"))
    mixed = {"blocks.0.att.key.disha": np.zeros((R, C), np.float32),
             "blocks.0.att.value.lora_A": np.zeros((R, C), np.float32),
             "blocks.0.att.value.lora_B": np.zeros((C, R), np.float32)}
    save_pth(mixed, str(tmp_path / "mixed.pth"))
    with pytest.raises(InteropError, match=r"both LoRA .* and MiSS"):
        read_source(str(tmp_path / "mixed.pth"), str(d / "base.pth"))


def test_the_parts_a_tune_trained_travel_in_its_rwkv_peft_file(runs, tmp_path, capsys):
    """A LoRA run with --train-parts ln: its lora export holds the trained
    LayerNorms beside the adapters, as RWKV-PEFT saves its train_parts; the
    file comes back as the same model training the same parts; a format
    holding adapters alone refuses the run in one line."""
    d, base, _, ln = runs
    out = tmp_path / "ln.pth"
    assert main(["export", str(d / "ln"), "--format", "lora", "--out", str(out)]) == 0
    sd = load_pth(str(out))
    lns = sorted(k for k in sd if ".ln" in k or k.startswith("ln_out"))
    assert "blocks.0.ln1.weight" in lns and "blocks.1.att.ln_x.bias" in lns
    assert np.array_equal(sd["blocks.1.ln2.bias"], ln.model.params["blocks.1.ln2_b"])
    assert not np.array_equal(sd["blocks.1.ln2.bias"], read_source(base).weights["blocks.1.ln2_b"])
    back = str(tmp_path / "back")
    assert main(["import", str(out), "--base", str(d / "base.pth"), "--out", back]) == 0
    assert _rel(load_model(back).forward(TOKENS), ln.model.forward(TOKENS)) <= FWD_TOL
    _, _, state = read_checkpoint(os.path.join(back, "checkpoint.safetensors"))
    assert state["lora"]["parts"] == "ln"
    kw = dict(model=None, init_from=str(out), base=str(d / "base.pth"), steps=1)
    assert Trainer(_opts(tmp_path, **kw), str(tmp_path / "on")).opts.train_parts == "ln"
    with pytest.raises(TrainError, match="trained ln beside its adapters"):
        Trainer(_opts(tmp_path, **kw, train_parts="time"), str(tmp_path / "on2"))
    for fmt in ("peft", "gguf-lora"):
        assert main(["export", str(d / "ln"), "--format", fmt, "--out",
                     str(tmp_path / fmt)]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--format lora holds both" in err[0], err
        assert not os.path.exists(tmp_path / fmt)


@pytest.mark.parametrize("form", ["mini", "bat"])
def test_peft_miss_forms(runs, tmp_path, form):
    """peft's MiSS of init_weights mini (a [r, mini_r] block repeated over
    the outputs) comes in as the default form of the same function: our
    logits equal peft's on the hf export within TOL. bat, whose change
    depends on the base weights, is refused in one line naming the route."""
    _need("torch", "safetensors", "transformers", "rwkv7_hf", "peft")
    import torch
    from peft import MissConfig, get_peft_model
    from rwkv7_hf import RWKV7ForCausalLM

    from rwkvx_c.interop.hf import hf_modules
    d, base, _, _ = runs
    hf = str(d / "base_hf")
    if not os.path.isdir(hf):
        assert main(["export", base, "--format", "hf", "--out", hf]) == 0
    model = load_model(base)
    mods = sorted(set(hf_modules(model).values()))
    torch.manual_seed(0)
    fresh = RWKV7ForCausalLM.from_pretrained(hf, torch_dtype=torch.float32)
    pm = get_peft_model(fresh, MissConfig(r=R, init_weights=form, mini_r=8, target_modules=mods))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "miss_block" in n:
                p.normal_(0, 0.05)
    pm.save_pretrained(str(tmp_path / "peft"))
    if form == "bat":
        with pytest.raises(InteropError, match=r"init_weights is 'bat', whose change depends "
                           r"on the base weights.*merge_and_unload"):
            read_source(str(tmp_path / "peft"), hf)
        return
    with open(tmp_path / "peft" / "adapter_config.json") as f:
        assert json.load(f)["init_weights"] == "mini"
    back = str(tmp_path / "back")
    assert main(["import", str(tmp_path / "peft"), "--base", hf, "--out", back]) == 0
    ours = load_model(back).forward(TOKENS)
    pm.eval()
    ids = torch.from_numpy(TOKENS.astype(np.int64))[None]
    with torch.no_grad():
        theirs = pm(ids).logits[0].numpy()
        with pm.disable_adapter():
            plain = pm(ids).logits[0].numpy()
    assert _rel(theirs, ours) <= TOL
    assert _rel(plain, ours) > 100 * TOL   # the blocks matter


def _pissa_files(d, tmp_path, r=R):
    """An RWKV-PEFT PiSSA checkpoint and its init_pissa.pth on two targets of
    every block of the base's x070 export, and the merged x070 dict by
    merge_pissa.py's rule W - B0 A0 + B A (float64)."""
    sd = load_pth(str(d / "base.pth"))
    rng = np.random.default_rng(5)
    ck, init, merged = {}, {}, dict(sd)
    for i in range(2):
        for mod in (f"blocks.{i}.att.key", f"blocks.{i}.ffn.value"):
            W = sd[mod + ".weight"].astype(np.float64)
            A, A0 = (rng.standard_normal((r, W.shape[1])).astype(np.float32) * 0.1
                     for _ in range(2))
            B, B0 = (rng.standard_normal((W.shape[0], r)).astype(np.float32) * 0.1
                     for _ in range(2))
            ck[mod + ".lora_A"], ck[mod + ".lora_B"] = A, B
            init[mod + ".init_lora_A"], init[mod + ".init_lora_B"] = A0, B0
            merged[mod + ".weight"] = (W - B0.astype(np.float64) @ A0 + B.astype(np.float64) @ A
                                       ).astype(np.float32)
    save_pth(ck, str(tmp_path / "rwkv-0.pth"))
    save_pth(init, str(tmp_path / "init_pissa.pth"))
    save_pth(merged, str(tmp_path / "merged.pth"))
    return tmp_path / "rwkv-0.pth", tmp_path / "init_pissa.pth", tmp_path / "merged.pth"


def test_an_rwkv_peft_pissa_checkpoint_comes_in_with_its_init(runs, tmp_path, capsys):
    """import --lora-init: RWKV-PEFT's PiSSA checkpoint (scale 1) and its
    initial adapters become the plain LoRA of rank 2r that computes
    merge_pissa.py's model on the original base."""
    d = runs[0]
    ck, init, merged = _pissa_files(d, tmp_path)
    out = str(tmp_path / "run")
    assert main(["import", str(ck), "--base", str(d / "base.pth"), "--lora-init", str(init),
                 "--out", out]) == 0
    assert main(["import", str(merged), "--out", str(tmp_path / "ref")]) == 0
    ours = load_model(out).forward(TOKENS)
    assert _rel(ours, load_model(str(tmp_path / "ref")).forward(TOKENS)) <= FWD_TOL
    _, _, state = read_checkpoint(os.path.join(out, "checkpoint.safetensors"))
    assert (state["lora"]["r"], state["lora"]["alpha"]) == (2 * R, 2.0 * R)   # scale 1
    # from Python: the source the import reads
    ads = read_source(str(ck), str(d / "base.pth"), lora_init=str(init)).adapters
    assert ads is not None and ads.record() == state["lora"]
    capsys.readouterr()
    for extra, says in ((["--lora-alpha", "8"], "scales by 1; drop --lora-alpha"),
                        ([], "init_lora_B is missing")):
        if not extra:
            sd = load_pth(str(init))
            sd.pop("blocks.1.ffn.value.init_lora_B")
            save_pth(sd, str(init))
        assert main(["import", str(ck), "--base", str(d / "base.pth"), "--lora-init",
                     str(init), "--out", str(tmp_path / f"bad{len(extra)}"), *extra]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    assert main(["import", str(d / "base.pth"), "--lora-init", str(init), "--out",
                 str(tmp_path / "bad")]) == 2
    assert "--lora-init belongs to LoRA adapters" in capsys.readouterr().err
