"""LoRA adapters back in (rwkvx_c.interop.adapters): a PEFT adapter folder
written for the hf export (`export --format peft`) on that export of its
base, or an RWKV-PEFT LoRA .pth (`export --format lora`) on the rwkv7
export, becomes a LoRA run holding the same model that trains on from
there (`import --base`, then `train --resume`; or `train --init-from`).
Modules rwkvx_c does not adapt are refused by name."""
import json
import os

import numpy as np
import pytest
from test_finetune import _base_run
from test_interop import H64, _need
from test_lora import _lora_run

from rwkvx_c.cli import main
from rwkvx_c.interop import InteropError
from rwkvx_c.run.checkpoint import read_checkpoint
from rwkvx_c.sample import load_model

TOKENS = np.frombuffer(b"def f(x):\n    return x * 2", np.uint8).astype(np.int32)


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """A LoRA run (4 steps) on a trained base, its peft and lora exports
    and the hf and rwkv7 exports of its base."""
    _need("torch", "safetensors", "tokenizers")
    d = tmp_path_factory.mktemp("adapters")
    base = _base_run(d, dict(H64, n_rwkv_layer=2))
    _lora_run(d, base, "run", steps=4).run()
    run = str(d / "run")
    for fmt, src, out in (("hf", base, "base_hf"), ("rwkv7", base, "base.pth"),
                          ("peft", run, "peft"), ("lora", run, "lora.pth")):
        assert main(["export", src, "--format", fmt, "--out", str(d / out)]) == 0
    return d, run


def _adapters(path):
    t, _, _ = read_checkpoint(os.path.join(path, "checkpoint.safetensors"))
    return {k: v for k, v in t.items() if "lora" in k}


def test_a_peft_folder_continues_training_from_where_its_run_stopped(lora):
    d, run = lora
    cont = str(d / "cont")
    assert main(["import", str(d / "peft"), "--base", str(d / "base_hf"), "--out", cont]) == 0
    # the same model, bit for bit: the frozen base and the adapters as they were
    assert np.array_equal(load_model(cont).param_buffer, load_model(run).param_buffer)
    before = _adapters(cont)
    assert before.keys() == _adapters(run).keys()
    assert all(np.array_equal(before[k], _adapters(run)[k]) for k in before)
    base_w, _, _ = read_checkpoint(os.path.join(cont, "checkpoint.safetensors"))
    assert main(["train", "--resume", "--out", cont, "--data", str(d / "corpus.txt"),
                 "--cache-dir", str(d / "cache"), "--steps", "3", "--batch", "2",
                 "--seq-len", "16", "--eval-tokens", "32", "--threads", "1",
                 "--no-progress"]) == 0
    after, _, state = read_checkpoint(os.path.join(cont, "checkpoint.safetensors"))
    opts = state["options"]
    assert (opts["tune"], opts["lora_r"], opts["lora_alpha"]) == ("lora", 4, 32.0)
    assert any(not np.array_equal(after[k], before[k]) for k in before)   # they trained
    for k in ("blocks.0.tm.key_w", "emb", "head"):                        # the base did not
        assert np.array_equal(after[k], base_w[k]), k


def test_init_from_a_peft_folder_that_names_its_base(lora, tmp_path):
    d, run = lora
    peft = tmp_path / "peft"
    peft.mkdir()
    for f in os.listdir(d / "peft"):
        (peft / f).write_bytes((d / "peft" / f).read_bytes())
    cfg = json.loads((peft / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = os.path.relpath(d / "base_hf", peft)
    (peft / "adapter_config.json").write_text(json.dumps(cfg))
    out = str(tmp_path / "tuned")
    assert main(["train", "--init-from", str(peft), "--out", out, "--data",
                 str(d / "corpus.txt"), "--cache-dir", str(d / "cache"), "--steps", "1",
                 "--lr", "1e-9", "--batch", "2", "--seq-len", "16", "--eval-tokens", "32",
                 "--threads", "1", "--no-progress"]) == 0
    a, b = _adapters(out), _adapters(run)
    assert a.keys() == b.keys()
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) < 1e-6   # one step at lr 1e-9


def test_an_rwkv_peft_file_on_its_base(lora):
    d, run = lora
    out = str(d / "from_pth")
    assert main(["import", str(d / "lora.pth"), "--base", str(d / "base.pth"),
                 "--out", out]) == 0
    assert np.array_equal(load_model(out).param_buffer, load_model(run).param_buffer)


def test_unknown_modules_and_missing_bases_are_refused_by_name(lora, tmp_path, capsys):
    import safetensors.torch
    import torch
    d, _ = lora
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((d / "peft" / "adapter_config.json").read_text())
    t = safetensors.torch.load_file(str(d / "peft" / "adapter_model.safetensors"))
    t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 128)
    t["base_model.model.lm_head.lora_B.weight"] = torch.zeros(256, 4)
    safetensors.torch.save_file(t, str(bad / "adapter_model.safetensors"))
    capsys.readouterr()
    assert main(["import", str(bad), "--base", str(d / "base_hf"), "--out",
                 str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err.strip()
    assert "lm_head is not a projection rwkvx_c adapts" in err and len(err.splitlines()) == 1
    assert not os.path.exists(tmp_path / "x" / "checkpoint.safetensors")
    # no base named: the way out is said
    assert main(["import", str(d / "peft"), "--out", str(tmp_path / "y")]) == 2
    assert "--base" in capsys.readouterr().err
    with pytest.raises(InteropError, match=r"rwkvx-c import .* --base BASE"):
        from rwkvx_c.interop import read_source
        read_source(str(d / "peft"))


def test_peft_on_the_hybrid_export_and_back(tmp_path):
    """A LoRA run on the default preset's hybrid: its peft export on the hf
    export of its base (rwkvx_c's own modeling code, PEFT's LoRA on its
    nn.Linear modules, attention blocks' included) gives our logits, and
    comes back on the base run as the same model."""
    _need("torch", "safetensors", "transformers", "tokenizers", "peft")
    import torch
    from peft import PeftModel
    from test_interop import _rel
    from transformers import AutoModelForCausalLM
    (tmp_path / "corpus.txt").write_bytes(b"def f(x):\n    return x * 2\n" * 200)
    common = ["--seq-len", "64", "--batch", "2", "--eval-tokens", "128", "--threads", "1",
              "--data", str(tmp_path / "corpus.txt"), "--cache-dir", str(tmp_path / "cache"),
              "--no-progress"]
    assert main(["train", "--preset", "default", "--steps", "3",
                 "--out", str(tmp_path / "base")] + common) == 0
    assert main(["train", "--init-from", str(tmp_path / "base"), "--tune", "lora", "--lora-r",
                 "4", "--steps", "3", "--lr", "1e-2", "--out", str(tmp_path / "lora")]
                + common) == 0
    for fmt, src, out in (("hf", "base", "base_hf"), ("peft", "lora", "peft")):
        assert main(["export", str(tmp_path / src), "--format", fmt, "--out",
                     str(tmp_path / out)]) == 0
    targets = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert "model.layers.2.attn.q_proj" in targets["target_modules"]
    ours = load_model(str(tmp_path / "lora")).forward(TOKENS)
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base_hf"), trust_remote_code=True,
                                                dtype=torch.float32)
    m = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        theirs = m(torch.from_numpy(TOKENS.astype(np.int64))[None]).logits[0].numpy()
    assert _rel(load_model(str(tmp_path / "base")).forward(TOKENS), ours) > 1e-3   # they matter
    err = _rel(theirs, ours)
    print(f"peft on the hybrid's hf export with the exported adapters vs RxPtModel: {err:.2e}")
    assert err <= 1e-4
    assert main(["import", str(tmp_path / "peft"), "--base", str(tmp_path / "base"), "--out",
                 str(tmp_path / "back")]) == 0
    assert np.array_equal(load_model(str(tmp_path / "back")).param_buffer,
                          load_model(str(tmp_path / "lora")).param_buffer)


def _contradicting(d, tmp_path, name, change):
    """A copy of the peft export whose adapter_config.json `change` edits."""
    src, out = d / "peft", tmp_path / name
    out.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    change(cfg)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    (out / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors")
                                                   .read_bytes())
    return str(out)


@pytest.mark.parametrize("name,change,msg", [
    ("rank", lambda c: c.update(r=8), "r is 8 but the adapters have rank 4"),
    ("one", lambda c: c.update(target_modules=c["target_modules"][:1]),
     "target_modules leaves out"),
    ("extra", lambda c: c["target_modules"].remove(c["target_modules"][-1]) or
     c["target_modules"].append("lm_head"), "target_modules leaves out"),
    ("none", lambda c: c.update(target_modules=None), "target_modules is None"),
    ("layers", lambda c: c.update(layers_to_transform=[0]), "layers_to_transform"),
    ("regex", lambda c: c.update(target_modules="(("), "no regular expression"),
])
def test_a_peft_folder_contradicting_itself_is_refused_naming_the_key(lora, tmp_path, capsys,
                                                                     name, change, msg):
    d, _ = lora
    bad = _contradicting(d, tmp_path, name, change)
    capsys.readouterr()
    assert main(["import", bad, "--base", str(d / "base_hf"), "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1, err


def test_a_peft_folder_naming_a_module_without_tensors_is_refused(lora, tmp_path, capsys):
    """The folder holds adapters for fewer modules than its target_modules
    names: peft would put fresh adapters there; rwkvx_c says so."""
    import safetensors.torch
    d, _ = lora
    bad = tmp_path / "fewer"
    bad.mkdir()
    cfg = json.loads((d / "peft" / "adapter_config.json").read_text())
    dropped = cfg["target_modules"][0]
    t = safetensors.torch.load_file(str(d / "peft" / "adapter_model.safetensors"))
    t = {k: v for k, v in t.items() if f".{dropped}.lora_" not in k}
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    safetensors.torch.save_file(t, str(bad / "adapter_model.safetensors"))
    capsys.readouterr()
    assert main(["import", str(bad), "--base", str(d / "base_hf"), "--out",
                 str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err.strip()
    assert f"target_modules names {dropped}, which the folder holds no adapter" in err, err


@pytest.mark.parametrize("targets", [["model.layers.0.attn.key", "value"], "all-linear",
                                     r"model\.layers\.[01]\.(attn|ffn)\.key", ["key"]])
def test_target_modules_match_as_peft_matches_them(targets):
    """rwkvx_c reads target_modules as peft's check_target_module_exists does."""
    peft = pytest.importorskip("peft")
    from peft.tuners.tuners_utils import check_target_module_exists

    from rwkvx_c.interop.adapters import _targeted
    cfg = peft.LoraConfig(target_modules=targets)
    ours = ".*" if targets == "all-linear" else targets
    for m in ("model.layers.0.attn.key", "model.layers.1.attn.value", "model.layers.1.ffn.key",
              "model.layers.10.attn.key", "model.layers.0.attn.output"):
        want = bool(check_target_module_exists(cfg, m)) if targets != "all-linear" else True
        assert _targeted(ours, m) == want, (targets, m)
