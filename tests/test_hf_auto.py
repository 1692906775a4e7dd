"""Hugging Face folders that load by name (rwkvx_c.interop.hf and
hf_hybrid): AutoModelForCausalLM / AutoTokenizer with trust_remote_code
load a pure RWKV-7 export (rwkv7-hf's thin entry points) and the `default`
preset's hybrid (our own modeling code: RWKV-7 blocks and MoBA attention
with top-k chunk selection), with our logits, our greedy continuation and
the end-of-text token declared.

Without torch / transformers / rwkv7-hf these tests skip, unless
RWKVX_REQUIRE_INTEROP=1 (set by .ci/run), where that is a failure."""
import codecs
import json
import os

import numpy as np
import pytest
from test_interop import _need, _rel

import rwkvx_c as rx
from rwkvx_c.cli import main
from rwkvx_c.interop import hf, hf_hybrid
from rwkvx_c.sample import load_run

TOL = 1e-4   # max |logit diff| / max |logit|, fp32 on both sides (docs/interop.md)
TEXT = b"def f(x):\n    return x * 2\n# a comment that runs on a while\n"
# longer than four 32-token chunks: top-k 2 leaves chunks out
PROMPT = "def f(x):\n    return x * 2\n# a comment that runs on a while\ndef g(y):\n    ret" \
         "urn y + 1\n# and the next one\ndef f(x):\n    return"


def _train(d, *shape):
    (d / "corpus.txt").write_bytes(TEXT * 200)
    assert main(["train", "--preset", "default", *shape, "--steps", "6", "--seq-len", "64",
                 "--batch", "2", "--eval-tokens", "128", "--threads", "1", "--warmup", "1",
                 "--data", str(d / "corpus.txt"), "--out", str(d / "run"),
                 "--cache-dir", str(d / "cache")]) == 0
    return d / "run"


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """The default preset (RRA, MoBA top-k 2, chunks of 32), trained 6 steps."""
    _need("torch", "safetensors", "transformers", "tokenizers")
    d = tmp_path_factory.mktemp("hybrid")
    run = _train(d)
    model, _ = load_run(str(run))
    assert model.layers == "RRA" and model.config["moba_top_k"] == 2
    assert main(["export", str(run), "--format", "hf", "--out", str(d / "hf")]) == 0
    return run, d / "hf"


def _auto(folder):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    m = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True,
                                             dtype=torch.float32).eval()
    return m, AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)


def _logits(m, tokens):
    import torch
    with torch.no_grad():
        return m(torch.as_tensor(np.asarray(tokens, np.int64))[None]).logits[0].numpy()


def test_the_hybrid_loads_by_name_with_our_logits(hybrid):
    run, folder = hybrid
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "rwkvx" and cfg["block_types"] == ["rwkv", "rwkv", "moba"]
    assert set(hf_hybrid.HYBRID_CODE) <= set(os.listdir(folder))
    m, _ = _auto(folder)
    model, _ = load_run(str(run))
    x = np.frombuffer(PROMPT.encode() * 2, np.uint8).astype(np.int32)   # 9 chunks
    ours = model.forward(x)
    err = _rel(_logits(m, x), ours)
    print(f"AutoModelForCausalLM (rwkvx_c's modeling code) vs RxPtModel, hybrid RRA top-k 2, "
          f"{len(x)} tokens: {err:.2e}")
    assert err <= TOL


def test_the_hybrid_cache_gives_the_logits_of_the_whole_sequence(hybrid):
    """Prefill in uneven pieces through the cache: the same logits as one pass."""
    import torch
    _, folder = hybrid
    m, _ = _auto(folder)
    x = torch.as_tensor(np.frombuffer(PROMPT.encode() * 2, np.uint8).astype(np.int64))[None]
    with torch.no_grad():
        whole = m(x).logits[0]
        parts, cache, i = [], None, 0
        for n in (5, 31, 1, 40, 1, 1, 70, 1000):
            out = m(x[:, i:i + n], past_key_values=cache, use_cache=True)
            parts.append(out.logits[0])
            cache, i = out.past_key_values, i + n
    pieced = torch.cat(parts).numpy()
    assert _rel(pieced, whole.numpy()) <= 1e-5


def test_the_hybrids_greedy_generate_is_rwkvx_c_sample_temperature_0(hybrid, capsysbinary):
    import torch
    run, folder = hybrid
    n = 48
    capsysbinary.readouterr()
    assert main(["sample", str(run), "--prompt", PROMPT, "--max-new-tokens", str(n),
                 "--temperature", "0", "--threads", "1"]) == 0
    ours = capsysbinary.readouterr().out[len(PROMPT.encode()):-1]
    m, tok = _auto(folder)
    assert tok.eos_token_id == 0 and m.generation_config.eos_token_id == 0
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()
    if 0 in out:   # generate stops at the end-of-text; sample runs on
        out = out[:out.index(0)]
    theirs = codecs.decode(bytes(out), "utf-8", "replace").encode()
    assert ours.startswith(theirs) and (len(out) == n or ours[len(theirs):][:1] == b"\x00")


def test_the_byte_tokenizer_declares_byte_0_the_end_of_text(hybrid):
    _, folder = hybrid
    _, tok = _auto(folder)
    assert tok.eos_token_id == 0 and tok.pad_token_id == 0
    text = "héllo \x00 wörld Ā ~"   # Ā spells byte 0's token: it is text, two bytes
    assert tok(text, add_special_tokens=False)["input_ids"] == list(text.encode("utf-8"))
    assert tok.decode(list(text.encode("utf-8"))) == text


def test_a_pure_rwkv7_export_loads_by_name_through_rwkv7_hf(tmp_path):
    _need("torch", "safetensors", "transformers", "rwkv7_hf")
    run = _train(tmp_path, "--n-attn-layer", "0")
    out = tmp_path / "hf"
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "rwkv7" and cfg["rwkv7_hf_adapter_layout"] == "thin"
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_rwkv7.RWKV7ForCausalLM"
    m, tok = _auto(out)
    assert type(m).__module__ == "rwkv7_hf.modeling_rwkv7"
    assert tok.eos_token_id == 0
    model, _ = load_run(str(run))
    x = np.frombuffer(PROMPT.encode(), np.uint8).astype(np.int32)
    assert _rel(_logits(m, x), model.forward(x)) <= TOL


def test_any_model_exports_to_hf(tmp_path):
    """What the rwkv7 layout cannot hold (head size 32, no ln0, several
    attention blocks, dense attention) goes to our own code, with our logits."""
    _need("torch", "safetensors", "transformers", "tokenizers")
    base = dict(n_embd=64, n_head=2, head_size=32, n_rwkv_layer=3, n_attn_layer=2,
                vocab_size=256, ffn_dim=160, Dw=8, Da=8, Dg=16, Dv=8, chunk_size=4,
                moba_top_k=1, ln0=0)
    x = np.arange(37, dtype=np.int32) * 7 % 256
    for i, change in enumerate([{}, dict(moba_top_k=0, ln0=1), dict(n_attn_layer=0)]):
        model = rx.RxPtModel(dict(base, **change), seed=i + 1)
        for p in model.param_names:   # the init's zero output projections hide too much
            model.params[p][...] += np.random.default_rng(i).normal(
                0, 0.05, model.params[p].shape).astype(np.float32)
        rx.interop.export_model(model, "hf", str(tmp_path / f"m{i}"))
        m, _ = _auto(tmp_path / f"m{i}")
        assert _rel(_logits(m, x), model.forward(x)) <= TOL, change
        rx.interop.import_pth(str(tmp_path / f"m{i}"), str(tmp_path / f"r{i}"))   # and back
        assert np.array_equal(load_run(str(tmp_path / f"r{i}"))[0].param_buffer,
                              model.param_buffer), change


def test_hf_refusals_are_gone_and_others_name_the_way_out():
    cfg = dict(n_embd=128, n_head=2, head_size=64, n_rwkv_layer=2, n_attn_layer=1,
               vocab_size=256, ffn_dim=512, Dw=16, Da=16, Dg=32, Dv=8, chunk_size=32,
               moba_top_k=2, ln0=1)
    model = rx.RxPtModel(cfg)
    for fmt in ("rwkv7", "rwkvx", "gguf"):
        with pytest.raises(rx.interop.InteropError) as e:
            rx.interop.export_model(model, fmt, "/nonexistent/x")
        assert "--format hf holds this model" in str(e.value), fmt
    with pytest.raises(rx.interop.InteropError, match="--moba-top-k 0"):
        rx.interop.to_rwkvx(model)
    with pytest.raises(rx.interop.InteropError, match="--n-attn-layer 0"):
        rx.interop.to_rwkv7(model)
    assert hf.hf_refusal(cfg) is not None   # the rwkv7 layout still holds no attention


def test_a_hybrids_state_export_says_which_tools_run_it(hybrid, tmp_path, capsys):
    run, _ = hybrid
    d = run.parent
    tuned = tmp_path / "tuned"
    assert main(["train", "--init-from", str(run), "--tune", "state", "--steps", "1",
                 "--seq-len", "64", "--batch", "2", "--eval-tokens", "128", "--threads", "1",
                 "--data", str(d / "corpus.txt"), "--cache-dir", str(d / "cache"),
                 "--out", str(tuned), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["export", str(tuned), "--format", "state", "--out",
                 str(tmp_path / "s.pth")]) == 0
    out = capsys.readouterr().out
    assert "no other tool runs RWKV-X with MoBA attention and initial states" in out
    assert f"rwkvx-c sample {tuned}" in out


def test_the_hybrid_folder_imports_back_and_inits_a_run(hybrid, tmp_path):
    from rwkvx_c.interop import read_source
    run, folder = hybrid
    assert main(["import", str(folder), "--out", str(tmp_path / "back")]) == 0
    back, tok = load_run(str(tmp_path / "back"))
    model, _ = load_run(str(run))
    assert tok.name == "byte" and back.layers == "RRA" and back.config == model.config
    assert np.array_equal(back.param_buffer, model.param_buffer)
    assert read_source(str(folder)).config == model.config
    sd, cfg = hf.load_hf(str(folder))
    sd["model.layers.2.attn.gate.weight"] = np.zeros(4, np.float32)
    with pytest.raises(rx.interop.InteropError, match=r"attn\.gate\.weight is not a tensor"):
        hf_hybrid.from_hybrid(sd, cfg)
    del sd["model.layers.2.attn.gate.weight"], sd["model.layers.2.attn.q_proj.weight"]
    with pytest.raises(rx.interop.InteropError,
                       match=r"lacks tensor model\.layers\.2\.attn\.q_proj"):
        hf_hybrid.from_hybrid(sd, cfg)


def test_a_config_describing_weights_the_export_lacks_is_refused(hybrid, tmp_path):
    """A tampered config.json (one more attention block than the weights
    hold) fails to load, naming a missing parameter, instead of a model
    whose new block is uninitialised memory (NaN logits); a fresh model of
    that config has every parameter set and finite logits."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    _, folder = hybrid
    bad = tmp_path / "hf"
    shutil.copytree(folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["block_types"].append("moba")
    cfg["num_hidden_layers"] = len(cfg["block_types"])
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"the weights lack \d+ parameters .*model\.layers\.3\."):
        _auto(bad)
    torch.manual_seed(0)
    fresh = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(str(bad), trust_remote_code=True), trust_remote_code=True)
    assert np.isfinite(_logits(fresh.eval(), [1, 2, 3])).all()
