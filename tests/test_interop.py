"""Interop (rwkvx_c.interop): the x070 and RWKV-X mappings, .pth round
trips, and logits against the external tools themselves -- the `rwkv`
package (RWKV_V7_ON=1, cpu fp32) and the `rwkv-x` package -- each run in a
subprocess (they set process-wide torch state at import).

Without torch / rwkv / rwkv-x these tests skip, unless RWKVX_REQUIRE_INTEROP=1
(set by .ci/run), where a missing tool is a failure."""
import dataclasses
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

import rwkvx_c as rx
from rwkvx_c import interop
from rwkvx_c.interop import InteropError

ODD = dict(n_embd=15, n_head=3, head_size=5, n_rwkv_layer=3, n_attn_layer=0, vocab_size=23,
           Dw=3, Da=5, Dg=7, Dv=2, ffn_dim=19, chunk_size=3, moba_top_k=0, ln0=1)
# the external tools: head size 64 (rwkv-x fixes it), ffn 4C (rwkv-x's attention blocks)
H64 = dict(n_embd=128, n_head=2, head_size=64, n_rwkv_layer=2, n_attn_layer=0, vocab_size=256,
           ffn_dim=512, Dw=16, Da=16, Dg=32, Dv=8, chunk_size=4, moba_top_k=0, ln0=1)
TOL = 1e-4   # max |logit diff| / max |logit|, fp32 on both sides

_RWKV = """
import os, sys
os.environ["RWKV_V7_ON"] = "1"
import numpy as np
from rwkv.model import RWKV
m = RWKV(model=sys.argv[1][:-len(".pth")], strategy="cpu fp32")
out, _ = m.forward(np.load(sys.argv[2]).tolist(), None, full_output=True)
np.save(sys.argv[3], out.float().numpy())
"""
_RWKVX = """
import sys
import numpy as np
from rwkv_x.model import RWKV_X
m = RWKV_X(sys.argv[1], "cpu fp32")
out, _ = m.forward(np.load(sys.argv[2]).tolist(), None, full_output=True)
np.save(sys.argv[3], out.float().numpy())
"""


def _need(*mods):
    missing = [m for m in mods if importlib.util.find_spec(m) is None]
    if missing:
        if os.environ.get("RWKVX_REQUIRE_INTEROP") == "1":
            pytest.fail(f"RWKVX_REQUIRE_INTEROP=1 but {', '.join(missing)} is not installed")
        pytest.skip(f"{', '.join(missing)} not installed")


def _tool_logits(script, pth, tokens, tmp_path):
    """Logits (T, V) of an external tool on tokens, from a fresh interpreter."""
    tok, out = tmp_path / "tokens.npy", tmp_path / "logits.npy"
    np.save(tok, np.asarray(tokens, dtype=np.int64))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", script, str(pth), str(tok), str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return np.load(out)


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _official_dict(rng, V=256, C=128, H=2, N=64, L=3, F=448, Dw=32, Da=32, Dv=32, Dg=64,
                   layer0_v=True):
    """A random x070 state dict built from the official names and layouts
    (RWKV-LM's RWKV_Tmix_x070 / RWKV_CMix_x070), independent of our mapping:
    values scaled so every path carries signal."""
    def u(*shape, s=0.5):
        return ((rng.random(shape) - 0.5) * s).astype(np.float32)

    sd = {"emb.weight": u(V, C, s=2.0), "blocks.0.ln0.weight": 1 + u(C, s=0.2),
          "blocks.0.ln0.bias": u(C, s=0.2)}
    for i in range(L):
        p = f"blocks.{i}."
        sd[p + "ln1.weight"], sd[p + "ln1.bias"] = 1 + u(C, s=0.2), u(C, s=0.2)
        sd[p + "ln2.weight"], sd[p + "ln2.bias"] = 1 + u(C, s=0.2), u(C, s=0.2)
        a = p + "att."
        for x in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "k_k", "k_a"):
            sd[a + x] = u(1, 1, C, s=1.0)
        sd[a + "w1"], sd[a + "w2"] = u(C, Dw), u(Dw, C)
        sd[a + "a1"], sd[a + "a2"] = u(C, Da), u(Da, C)
        if i > 0 or layer0_v:
            sd[a + "v0"], sd[a + "v1"], sd[a + "v2"] = u(1, 1, C, s=1.0), u(C, Dv), u(Dv, C)
        sd[a + "g1"], sd[a + "g2"] = u(C, Dg), u(Dg, C)
        sd[a + "r_k"] = u(H, N)
        for w in ("receptance", "key", "value", "output"):
            sd[a + w + ".weight"] = u(C, C, s=0.3)
        sd[a + "ln_x.weight"], sd[a + "ln_x.bias"] = 1 + u(C, s=0.2), u(C, s=0.2)
        sd[p + "ffn.x_k"] = u(1, 1, C, s=1.0)
        sd[p + "ffn.key.weight"], sd[p + "ffn.value.weight"] = u(F, C, s=0.3), u(C, F, s=0.3)
    sd["ln_out.weight"], sd["ln_out.bias"] = 1 + u(C, s=0.2), u(C, s=0.2)
    sd["head.weight"] = u(V, C, s=0.3)
    return sd


# ---- the mapping (NumPy only) ---------------------------------------------------


def test_rwkv7_names_shapes_and_round_trip():
    m = rx.RxPtModel(ODD, seed=1)
    sd = interop.to_rwkv7(m)
    C, H, N, F = 15, 3, 5, 19
    assert sd["emb.weight"].shape == (23, C) and sd["head.weight"].shape == (23, C)
    assert np.array_equal(sd["head.weight"], m.params["head"].T)
    assert np.array_equal(sd["blocks.0.ln0.weight"], m.params["ln0_w"])
    assert sd["blocks.1.att.r_k"].shape == (H, N)
    assert sd["blocks.2.att.w0"].shape == (1, 1, C)
    assert sd["blocks.1.att.w1"].shape == (C, 3) and sd["blocks.1.att.v2"].shape == (2, C)
    assert np.array_equal(sd["blocks.1.att.key.weight"], m.params["blocks.1.tm.key_w"].T)
    assert sd["blocks.0.ffn.key.weight"].shape == (F, C)
    assert "blocks.0.att.v0" not in sd and "blocks.1.att.v0" in sd
    assert len(sd) == len(m.param_names)
    back = interop.from_rwkv7(sd)
    moba = ("chunk_size", "moba_top_k")   # x070 has no attention: not stored
    assert {k: v for k, v in back.config.items() if k not in moba} == \
        {k: v for k, v in m.config.items() if k not in moba}
    assert back.param_buffer.tobytes() == m.param_buffer.tobytes()


def test_rwkv7_import_derives_sizes_and_accepts_layer0_v():
    rng = np.random.default_rng(0)
    sd = _official_dict(rng, V=37, C=12, H=3, N=4, L=2, F=30, Dw=5, Da=6, Dv=7, Dg=9)
    m = interop.from_rwkv7(sd)
    c = m.config
    assert (c["vocab_size"], c["n_embd"], c["n_head"], c["head_size"], c["n_rwkv_layer"],
            c["ffn_dim"], c["Dw"], c["Da"], c["Dv"], c["Dg"], c["ln0"]) == \
        (37, 12, 3, 4, 2, 30, 5, 6, 7, 9, 1)
    assert np.array_equal(m.params["blocks.1.tm.r_k"], sd["blocks.1.att.r_k"].reshape(-1))
    without = {k: v for k, v in sd.items() if k not in ("blocks.0.att.v0", "blocks.0.att.v1",
                                                        "blocks.0.att.v2")}
    assert interop.from_rwkv7(without).param_buffer.tobytes() == m.param_buffer.tobytes()


@pytest.mark.parametrize("change,match", [
    (lambda sd: sd.update({"blocks.0.ffn.s_emb.weight": np.zeros((4, 4), np.float32)}),
     "s_emb"),
    (lambda sd: sd.pop("blocks.1.att.g2"), "blocks.1.att.g2 is missing"),
    (lambda sd: sd.pop("blocks.0.ln0.weight"), "ln0.weight is missing"),
    (lambda sd: sd.update({"blocks.1.att.w0": np.zeros((12,), np.float32)}), "shape"),
    (lambda sd: sd.update({"head.weight": np.zeros((12, 37), np.float32)}), "shape"),
    (lambda sd: sd.update({"blocks.0.att.r_k": np.zeros((2, 4), np.float32)}), "r_k"),
    (lambda sd: sd.update({"blocks.3.ln1.weight": np.ones(12, np.float32)}), "gaps"),
    (lambda sd: sd.update({"emb.weight": np.zeros((37, 12), np.int32)}), "dtype"),
])
def test_rwkv7_import_refuses_bad_dicts(change, match):
    sd = _official_dict(np.random.default_rng(1), V=37, C=12, H=3, N=4, L=2, F=30, Dw=5,
                        Da=6, Dv=7, Dg=9)
    change(sd)
    with pytest.raises(InteropError, match=match):
        interop.from_rwkv7(sd)


def test_export_refusals():
    with pytest.raises(InteropError, match="attention blocks"):
        interop.to_rwkv7(rx.RxPtModel(dict(ODD, n_attn_layer=1)))
    no_ln0 = {k: v for k, v in ODD.items() if k != "ln0"}
    with pytest.raises(InteropError, match="ln0"):
        interop.to_rwkv7(rx.RxPtModel(no_ln0))
    hybrid = dict(H64, n_rwkv_layer=4, n_attn_layer=2)
    interop.to_rwkvx(rx.RxPtModel(hybrid))
    for change, word in [(dict(moba_top_k=2), "moba_top_k=2"), (dict(ffn_dim=500), "ffn_dim"),
                         (dict(n_rwkv_layer=5), "5 % 2"), (dict(ln0=0), "ln0"),
                         (dict(n_head=4, head_size=32), "head size")]:
        with pytest.raises(InteropError, match=word):
            interop.to_rwkvx(rx.RxPtModel(dict(hybrid, **change)))


def test_every_export_format_is_one_row_of_the_table(tmp_path, monkeypatch):
    """EXPORTS: each format its own writer, reached by its name alone (no
    format falls through to another's); the formats the model fields'
    export limits name are formats that hold a model; an unknown name is
    refused before anything is written."""
    from rwkvx_c.interop.runs import EXPORTS, FORMATS
    from rwkvx_c.model.config import ModelConfig
    from rwkvx_c.util.registry import entries
    assert tuple(EXPORTS) == FORMATS and interop.FORMATS == FORMATS
    assert len({id(f.write) for f in EXPORTS.values()}) == len(EXPORTS)
    for name, f in EXPORTS.items():
        assert f.name == name and callable(f.write) and f.says
        assert f.holds in ("model", "state", "adapters"), name
    limited = {fmt for e in entries(ModelConfig) for fmt in e.exports}
    assert limited <= {n for n, f in EXPORTS.items() if f.holds == "model"}
    seen = []
    for name, f in EXPORTS.items():
        monkeypatch.setitem(EXPORTS, name, dataclasses.replace(
            f, write=lambda *a, n=name: seen.append(n)))
    m = rx.RxPtModel(ODD)
    for name in FORMATS:
        interop.export_model(m, name, str(tmp_path / name), adapters=({}, 1.0, "lora", {}, ()))
    assert seen == list(FORMATS)
    with pytest.raises(InteropError, match="unknown format"):
        interop.export_model(m, "onnx", str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_rwkvx_layout():
    m = rx.RxPtModel(dict(H64, n_rwkv_layer=4, n_attn_layer=2), seed=2)
    assert m.layers == "RRARRA"
    sd = interop.to_rwkvx(m)
    assert np.array_equal(sd["rwkv.blocks.2.att.x_r"].reshape(-1), m.params["blocks.3.tm.x_r"])
    assert np.array_equal(sd["moba.1.att.key.weight"], m.params["blocks.5.key_w"].T)
    assert np.array_equal(sd["moba.0.ffn.x_k"].reshape(-1), m.params["blocks.2.cm.ffn_x_k"])
    assert len(sd) == len(m.param_names)
    back = interop.from_rwkvx(sd)
    assert back.layers == m.layers and back.config["moba_top_k"] == 0
    assert back.param_buffer.tobytes() == m.param_buffer.tobytes()
    bad = dict(sd)
    bad["moba.0.att.gate.weight"] = np.zeros((128, 128), np.float32)
    with pytest.raises(InteropError, match=r"moba\.0\.att\.gate\.weight"):
        interop.from_rwkvx(bad)
    with pytest.raises(InteropError, match="neither"):
        interop.from_rwkvx(dict(sd, extra=np.zeros(3, np.float32)))


# ---- .pth files (torch) ------------------------------------------------------------


def test_pth_round_trip_and_dtypes(tmp_path):
    _need("torch")
    import torch
    m = rx.RxPtModel(ODD, seed=3)
    path = tmp_path / "m.pth"
    interop.save_pth(interop.to_rwkv7(m), str(path))
    back = interop.from_rwkv7(interop.load_pth(str(path)))
    assert back.param_buffer.tobytes() == m.param_buffer.tobytes()
    for dt, tdt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        interop.save_pth(interop.to_rwkv7(m), str(path), dt)
        raw = torch.load(str(path), weights_only=True)
        assert raw["emb.weight"].dtype == tdt
        got = interop.from_rwkv7(interop.load_pth(str(path))).params["head"]
        want = torch.from_numpy(m.params["head"]).to(tdt).float().numpy()
        assert np.array_equal(got, want)
    with pytest.raises(InteropError, match="dtype"):
        interop.export_model(m, "rwkv7", str(path), "int8")
    with pytest.raises(InteropError, match="not a readable"):
        (tmp_path / "junk.pth").write_bytes(b"not a pickle")
        interop.load_pth(str(tmp_path / "junk.pth"))


# ---- the external tools ---------------------------------------------------------------


def _trained(tmp_path, **model):
    """A model trained a few steps by the Trainer (real, non-degenerate weights)."""
    from rwkvx_c.train import Trainer, TrainOptions
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x * 2\n" * 300)
    opts = TrainOptions(preset="tiny", data=str(corpus), batch=2, seq_len=32, steps=4,
                        eval_tokens=64, warmup_steps=1, threads=1, model=model, precision="fp32",
                        cache_dir=str(tmp_path / "cache"))
    tr = Trainer(opts, str(tmp_path / "run"))
    tr.run()
    return tr.model


def test_rwkv_package_reproduces_an_exported_model(tmp_path):
    _need("torch", "rwkv")
    m = _trained(tmp_path, n_rwkv_layer=2, n_attn_layer=0, n_embd=128, n_head=2, head_size=64)
    path = tmp_path / "out.pth"
    interop.export_model(m, "rwkv7", str(path))
    tokens = np.frombuffer(b"def f(x):\n    return x", np.uint8).astype(np.int32)
    ref = _tool_logits(_RWKV, path, tokens, tmp_path)
    err = _rel(m.forward(tokens), ref)
    print(f"rwkv package vs RxPtModel (exported, trained 4 steps): {err:.2e}")
    assert err <= TOL


def test_state_dict_sizes_that_make_no_model_are_one_interop_error():
    sd = _official_dict(np.random.default_rng(0), V=37, C=12, H=3, N=4, L=2, F=0, Dw=5, Da=6,
                        Dv=7, Dg=9)   # an empty channel-mix
    with pytest.raises(interop.InteropError, match="state dict's sizes make no valid model"):
        interop.from_rwkv7(sd)


def test_rxptmodel_reproduces_the_rwkv_package_on_an_official_dict(tmp_path):
    _need("torch", "rwkv")
    import torch
    sd = _official_dict(np.random.default_rng(5))
    path = tmp_path / "official.pth"
    # written by torch directly, in bf16 as official checkpoints are
    torch.save({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in sd.items()}, path)
    run = tmp_path / "imported"
    interop.import_pth(str(path), str(run))
    from rwkvx_c.sample import load_model
    m = load_model(str(run))
    tokens = np.random.default_rng(6).integers(0, 256, 24).astype(np.int32)
    ref = _tool_logits(_RWKV, path, tokens, tmp_path)
    err = _rel(m.forward(tokens), ref)
    print(f"RxPtModel (imported bf16 x070) vs rwkv package: {err:.2e}")
    assert err <= TOL


def test_rwkvx_package_reproduces_a_hybrid_model(tmp_path):
    _need("torch", "rwkv_x")
    m = rx.RxPtModel(dict(H64, n_rwkv_layer=4, n_attn_layer=2), seed=7)  # test init: all active
    path = tmp_path / "x.pth"
    interop.export_model(m, "rwkvx", str(path))
    tokens = np.random.default_rng(8).integers(0, 256, 21).astype(np.int32)
    ref = _tool_logits(_RWKVX, path, tokens, tmp_path)
    err = _rel(m.forward(tokens), ref)
    print(f"rwkv-x package vs RxPtModel (hybrid RRARRA): {err:.2e}")
    assert err <= TOL


# ---- the command line ------------------------------------------------------------------


def _one_line(capsys, rc, *words):
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err


def test_cli_shape_flags_export_import_sample_resume(tmp_path, capsys):
    _need("torch")
    from rwkvx_c.cli import main
    from rwkvx_c.run.checkpoint import read_checkpoint
    corpus = tmp_path / "c.txt"
    corpus.write_text("abc def ghi\n" * 500)
    fast = ["--data", str(corpus), "--preset", "tiny", "--seq-len", "16", "--batch", "2",
            "--eval-tokens", "32", "--threads", "1", "--no-progress", "--cache-dir",
            str(tmp_path / "cache")]
    run = str(tmp_path / "run")
    assert main(["train", "--out", run, "--steps", "2", "--n-attn-layer", "0", "--n-embd", "64",
                 "--n-layer", "1", "--ffn-dim", "96", "--d-gate", "8"] + fast) == 0
    _, config, _ = read_checkpoint(f"{run}/checkpoint.safetensors")
    assert (config["n_embd"], config["n_head"], config["n_rwkv_layer"], config["n_attn_layer"],
            config["ffn_dim"], config["Dg"], config["Dw"], config["ln0"]) == \
        (64, 1, 1, 0, 96, 8, 32, 1)
    pth = str(tmp_path / "m.pth")
    assert main(["export", run, "--format", "rwkv7", "--out", pth, "--dtype", "bf16"]) == 0
    imp = str(tmp_path / "imp")
    assert main(["import", pth, "--out", imp]) == 0
    capsys.readouterr()
    assert main(["sample", imp, "--prompt", "ab", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("ab")
    # continued pretraining from the imported weights, then an ordinary resume
    assert main(["train", "--out", imp, "--resume", "--steps", "2"] + fast) == 0
    assert main(["train", "--out", imp, "--resume", "--steps", "3"] + fast) == 0
    capsys.readouterr()
    # one-line refusals; nothing written
    hyb = str(tmp_path / "hyb")
    assert main(["train", "--out", hyb, "--steps", "1"] + fast) == 0
    capsys.readouterr()
    _one_line(capsys, main(["export", hyb, "--format", "rwkv7", "--out", pth + "2"]),
              "attention")
    _one_line(capsys, main(["export", hyb, "--format", "rwkvx", "--out", pth + "2"]),
              "moba_top_k")
    dense = str(tmp_path / "dense")   # a hybrid rwkv-x holds: exported and imported back
    assert main(["train", "--out", dense, "--steps", "1", "--n-embd", "64", "--moba-top-k",
                 "0"] + fast) == 0
    xpth = str(tmp_path / "x.pth")
    assert main(["export", dense, "--format", "rwkvx", "--out", xpth]) == 0
    assert main(["import", xpth, "--out", str(tmp_path / "ximp")]) == 0
    from rwkvx_c.sample import load_model
    a, b = load_model(dense), load_model(str(tmp_path / "ximp"))
    assert a.layers == b.layers == "RRA" and a.param_buffer.tobytes() == b.param_buffer.tobytes()
    capsys.readouterr()
    assert not os.path.exists(pth + "2")
    _one_line(capsys, main(["import", pth, "--out", imp]), "already holds")
    _one_line(capsys, main(["import", str(corpus), "--out", str(tmp_path / "x")]),
              "not a readable")
    assert not os.path.exists(tmp_path / "x")
    _one_line(capsys, main(["train", "--n-embd", "100", "--head-size", "64"] + fast),
              "multiple of head_size")
    _one_line(capsys, main(["train", "--n-layer", "2", "--n-attn-layer", "3"] + fast),
              "must not exceed")


def test_shape_options_and_lora_formula():
    from rwkvx_c.errors import ConfigError
    from rwkvx_c.model import ModelConfig, lora_sizes
    # RWKV-7 0.1B (C = 768) ships w1 [768, 64], a1 [768, 64], g1 [768, 128], v1 [768, 32]
    assert lora_sizes(768) == {"Dw": 64, "Da": 64, "Dg": 128, "Dv": 32}
    assert lora_sizes(64) == {"Dw": 32, "Da": 32, "Dg": 32, "Dv": 32}
    tiny = ModelConfig.preset("tiny")
    assert tiny.with_shape(n_attn_layer=0) == ModelConfig.from_dict(
        {**tiny.to_dict(), "n_attn_layer": 0})
    o = tiny.with_shape(n_embd=192, d_gate=16)
    assert (o.n_head, o.ffn_dim, o.Dw, o.Dg) == (3, 768, 32, 16)
    for kw, word in ((dict(n_embd=100), "multiple"), (dict(n_attn_layer=5), "must not exceed"),
                     (dict(head_size=0), "head_size"), (dict(moba_top_k=-1), "moba_top_k")):
        with pytest.raises(ConfigError, match=word):
            tiny.with_shape(**kw)


def test_imported_world_model_keeps_the_world_tokenizer(tmp_path):
    # A 65536-row x070 model is a World model: sample and train --resume must
    # tokenise with the World vocabulary, not silently with bytes.
    _need("torch", "rwkv")
    from rwkvx_c.sample import load_run
    from rwkvx_c.train import Trainer
    rng = np.random.default_rng(3)
    sd = _official_dict(rng, V=65536, C=8, H=2, N=4, L=1, F=16, Dw=2, Da=2, Dv=2, Dg=2)
    pth = tmp_path / "w.pth"
    interop.save_pth(sd, str(pth), "fp32")
    interop.import_pth(str(pth), str(tmp_path / "run"))
    _, tok = load_run(str(tmp_path / "run"))
    assert tok.name == "world"
    (tmp_path / "text.txt").write_text("a few words of plain English text. " * 600)
    tr = Trainer.resume(str(tmp_path / "run"), steps=1, seq_len=16, batch=2,
                        data=str(tmp_path / "text.txt"), cache_dir=str(tmp_path / "cache"))
    assert tr.tokenizer.name == "world"


def test_an_x070_pth_is_imported_tensor_by_tensor(tmp_path, monkeypatch):
    """import reads an x070 .pth as --init-from does, one tensor at a time
    (a 1.5B .pth once took every tensor in float32, a model with its init
    and grads, and the conversions at once: past 20 GB), into the same
    weights as the whole-dict reader's."""
    sd = _official_dict(np.random.default_rng(4))
    pth = tmp_path / "m.pth"
    interop.save_pth(sd, str(pth), "bf16")
    whole = interop.from_rwkv7(interop.load_pth(str(pth)))
    monkeypatch.setattr("rwkvx_c.interop.runs.load_pth", None)   # never the whole dict
    interop.import_pth(str(pth), str(tmp_path / "run"))
    from rwkvx_c.sample import load_model
    got = load_model(str(tmp_path / "run"))
    for n in whole.param_names:
        assert np.array_equal(got.params[n], whole.params[n]), n
