"""The Hugging Face rwkv7 layout (rwkvx_c.interop.hf), judged by rwkv7-hf
itself: its RWKV7ForCausalLM loads our export and reproduces our logits,
its converter turns our rwkv7 export into the same tensors, and its folder
imports back with the same logits. Sharded and bf16 folders, the refusals.

Without torch / safetensors / transformers / rwkv7-hf these tests skip,
unless RWKVX_REQUIRE_INTEROP=1 (set by .ci/run), where that is a failure."""
import json
import os

import numpy as np
import pytest
from test_interop import _need, _rel

import rwkvx_c as rx
from rwkvx_c import interop
from rwkvx_c.cli import main
from rwkvx_c.interop import InteropError, hf, hf_tokenizer
from rwkvx_c.sample import load_run

TOL = 1e-4   # max |logit diff| / max |logit|, fp32 on both sides (docs/interop.md)
TEXT = b"def f(x):\n    return x * 2\n"


@pytest.fixture(scope="module")
def run30(tmp_path_factory):
    """`rwkvx-c train --preset tiny --n-attn-layer 0`, shortened: a byte run."""
    d = tmp_path_factory.mktemp("hf")
    corpus = d / "corpus.txt"
    corpus.write_bytes(TEXT * 300)
    assert main(["train", "--preset", "tiny", "--n-attn-layer", "0", "--steps", "6",
                 "--seq-len", "32", "--batch", "2", "--eval-tokens", "64", "--threads", "1",
                 "--warmup", "1", "--data", str(corpus), "--out", str(d / "run"),
                 "--cache-dir", str(d / "cache")]) == 0
    return d / "run"


def _hf_logits(folder, tokens, dtype="float32"):
    import torch
    from rwkv7_hf import RWKV7ForCausalLM
    m = RWKV7ForCausalLM.from_pretrained(str(folder), torch_dtype=getattr(torch, dtype))
    m.eval()
    with torch.no_grad():
        out = m(torch.from_numpy(np.asarray(tokens, np.int64))[None]).logits[0]
    return out.float().numpy()


def _tokens():
    return np.frombuffer(TEXT * 2, np.uint8).astype(np.int32)


def test_rwkv7_hf_loads_the_export_with_our_logits(run30, tmp_path):
    _need("torch", "safetensors", "transformers", "rwkv7_hf")
    out = tmp_path / "hf"
    assert main(["export", str(run30), "--format", "hf", "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "rwkv7" and cfg["head_dim"] == 64
    assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= \
        set(os.listdir(out))
    model, _ = load_run(str(run30))
    x = _tokens()
    err = _rel(_hf_logits(out, x), model.forward(x))
    print(f"rwkv7-hf vs RxPtModel (hf export, fp32): {err:.2e}")
    assert err <= TOL


def test_the_byte_tokenizer_json_is_the_byte_vocabulary(run30, tmp_path):
    _need("transformers", "tokenizers")
    from transformers import AutoTokenizer
    out = tmp_path / "hf"
    model, tok = load_run(str(run30))
    hf.save_hf(model, tok, str(out))
    t = AutoTokenizer.from_pretrained(str(out))
    text = "héllo \x00 wörld\n\t ~ Ā"
    assert t(text, add_special_tokens=False)["input_ids"] == list(text.encode("utf-8"))
    assert t.decode(list(text.encode("utf-8"))) == text


def test_rwkv7_hf_conversion_holds_our_tensors_and_imports_back(run30, tmp_path):
    _need("torch", "safetensors", "transformers", "rwkv7_hf")
    from rwkv7_hf import converter
    model, _ = load_run(str(run30))
    pth = tmp_path / "r7.pth"
    interop.export_model(model, "rwkv7", str(pth))
    conv = tmp_path / "converted"
    converter.main(["--input", str(pth), "--output", str(conv), "--precision", "fp32"])
    theirs, _ = hf.load_hf(str(conv))
    ours = hf.to_hf(model)
    assert sorted(theirs) == sorted(ours)
    for k in ours:
        assert theirs[k].shape == ours[k].shape, k
        assert np.array_equal(theirs[k], ours[k]), k
    back = tmp_path / "back"
    assert main(["import", str(conv), "--out", str(back)]) == 0
    m2, _ = load_run(str(back))
    x = _tokens()
    err = _rel(m2.forward(x), model.forward(x))
    print(f"rwkv7-hf conversion of our rwkv7 export, imported: {err:.2e}")
    assert err == 0.0


def test_import_reads_sharded_bf16_folders(run30, tmp_path):
    _need("torch", "safetensors")
    import torch
    from safetensors.torch import save_file
    model, _ = load_run(str(run30))
    sd = hf.to_hf(model)
    names = sorted(sd)
    half = len(names) // 2
    folder = tmp_path / "sharded"
    folder.mkdir()
    shards = {"model-00001-of-00002.safetensors": names[:half],
              "model-00002-of-00002.safetensors": names[half:]}
    for f, ks in shards.items():
        save_file({k: torch.from_numpy(sd[k]).to(torch.bfloat16) for k in ks},
                  str(folder / f))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    (folder / "config.json").write_text(json.dumps(hf.hf_config(model.config)))
    run = tmp_path / "run"
    interop.import_pth(str(folder), str(run))
    m2, tok2 = load_run(str(run))
    assert tok2.name == "byte"   # no tokenizer files: 256 ids are bytes
    for n in model.param_names:   # bf16 of each weight, widened exactly
        want = torch.from_numpy(np.array(model.params[n])).to(torch.bfloat16).float().numpy()
        assert np.array_equal(m2.params[n], want), n


def test_models_the_layout_cannot_hold_are_refused_in_one_line(tmp_path):
    base = dict(n_embd=128, n_head=2, head_size=64, n_rwkv_layer=2, n_attn_layer=1,
                vocab_size=256, ffn_dim=512, Dw=16, Da=16, Dg=32, Dv=8, chunk_size=4,
                moba_top_k=0, ln0=1)
    with pytest.raises(InteropError, match=r"needs n_attn_layer = 0 \(MoBA attention blocks"):
        hf.to_hf(rx.RxPtModel(base))
    with pytest.raises(InteropError, match="head_size = 64"):
        hf.to_hf(rx.RxPtModel(dict(base, n_attn_layer=0, n_head=4, head_size=32)))
    assert not os.path.exists(tmp_path / "x")


def test_import_refuses_bad_folders(tmp_path, run30):
    _need("torch", "safetensors")
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(InteropError, match=r"no config\.json"):
        hf.load_hf(str(d))
    model, _ = load_run(str(run30))
    (d / "config.json").write_text(json.dumps(dict(hf.hf_config(model.config),
                                                   hidden_act="gelu")))
    with pytest.raises(InteropError, match="hidden_act"):
        hf.load_hf(str(d))
    (d / "config.json").write_text(json.dumps(hf.hf_config(model.config)))
    (d / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(InteropError, match="no pickle"):
        hf.load_hf(str(d))
    sd = hf.to_hf(model)
    sd["model.layers.0.attn.x_x"] = np.zeros(4, np.float32)
    with pytest.raises(InteropError, match="x_x is not a tensor"):
        hf.from_hf(sd)
    sd = hf.to_hf(model)
    del sd["model.layers.1.attn.k_k"]
    with pytest.raises(InteropError, match="missing"):
        hf.from_hf(sd)
    with pytest.raises(InteropError, match="being imported"):
        interop.import_pth(str(d), str(d))
    with pytest.raises(InteropError, match="is a run folder"):
        hf.save_hf(model, load_run(str(run30))[1], str(run30))


def test_world_exports_carry_the_vocabulary_rwkv7_hfs_tokenizer_reads(tmp_path):
    _need("rwkv", "transformers", "rwkv7_hf")
    from rwkv7_hf import RWKV7Tokenizer

    from rwkvx_c.data.tokenizers import WorldTokenizer
    tok = WorldTokenizer()
    hf_tokenizer.save_tokenizer(tok, str(tmp_path), 65536)
    theirs = RWKV7Tokenizer.from_pretrained(str(tmp_path))
    text = "Hello world, 你好 — ok\n\nmore text 123 \x00 é"
    assert theirs(text, add_special_tokens=False)["input_ids"] == tok.encode(text).tolist()
    # and the folder's tokenizer comes back as World on import
    assert hf.hf_tokenizer(str(tmp_path), 65536).name == "world"


def test_bf16_export_rounds_each_weight_once(run30, tmp_path):
    _need("torch", "safetensors", "tokenizers")
    import torch
    model, tok = load_run(str(run30))
    hf.save_hf(model, tok, str(tmp_path / "b"), "bf16")
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"
    back, _ = hf.load_hf(str(tmp_path / "b"))
    for k, v in hf.to_hf(model).items():
        assert np.array_equal(back[k], torch.from_numpy(v).to(torch.bfloat16).float().numpy()), k
