"""GGUF in (rwkvx_c.interop.gguf_in): an rwkv7 GGUF as --init-from streams
into the frozen base in its own form -- the file's Q8_0 / Q4_0 blocks and
BF16 bits copied as they are -- and the model computes bit for bit what
the float32 model of gguf's dequantised tensors computes; a form the base
cannot hold is converted once with one line; the base's blocks go out
again as they came in (export --format gguf --dtype q8_0 / q4_0)."""
import os
import warnings

import numpy as np
import pytest
from test_train import _opts

import rwkvx_c as rx
from rwkvx_c.errors import InteropError, RwkvxWarning
from rwkvx_c.interop import export_model, read_source
from rwkvx_c.interop.gguf import save_gguf

gguf = pytest.importorskip("gguf")

# every matrix's rows whole blocks of 32; head size 64 (llama.cpp's rwkv7)
CFG = dict(n_embd=128, n_head=2, head_size=64, n_rwkv_layer=2, n_attn_layer=0, vocab_size=256,
           ffn_dim=256, Dw=32, Da=32, Dg=32, Dv=32, chunk_size=32, moba_top_k=2, ln0=1)
TOKENS = np.frombuffer(b"def f(x):\n    return x + 1\n", np.uint8).astype(np.int32)


def _tensors(path):
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def _model(tmp_path, path, tune="lora", **kw):
    from rwkvx_c.train.base import model_from_source
    from rwkvx_c.train.finetune import from_source
    src = read_source(str(path))
    opts = from_source(_opts(tmp_path, model=None, tune=tune, precision="fp32", **kw),
                       src.config, src.tokenizer, str(path)).resolved()
    return model_from_source(opts, src.weights), src


def _dequantised(src):
    """The float32 model of gguf's dequantised tensors."""
    ref = rx.RxPtModel(src.config, init=False)
    for n in ref.param_names:
        ref.params[n][...] = src.weights[n]
    return ref


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "bf16"])
def test_the_files_blocks_go_into_the_base_as_they_are(tmp_path, dtype):
    m = rx.RxPtModel(CFG, seed=3)
    path = tmp_path / "m.gguf"
    export_model(m, "gguf", str(path), dtype)
    model, src = _model(tmp_path, path)
    assert src.dtype == dtype and src.tokenizer == "byte" and model.base_dtype == dtype
    t = _tensors(path)
    # the projections, the head, the embedding and the LoRAs the file holds in dtype;
    # the decay LoRA (F32 in the file, as the converter keeps it) stays float32
    assert "blocks.0.tm.w1" not in model.base_names and "emb" in model.base_names
    # per block 4 time-mix and 2 channel-mix projections, a1 a2 g1 g2 (v1 v2 past block 0)
    assert len(model.base_names) == 10 + 12 + 2
    for ours, theirs in (("blocks.1.tm.key_w", "blk.1.time_mix_key.weight"),
                         ("head", "output.weight"), ("emb", "token_embd.weight"),
                         ("blocks.1.cm.ffn_value_w", "blk.1.channel_mix_value.weight")):
        raw = np.asarray(t[theirs].data)
        assert np.array_equal(model.base_data(ours).view(np.uint8), raw.view(np.uint8)), ours
    ref = _dequantised(src)
    assert np.array_equal(model.forward(TOKENS), ref.forward(TOKENS))
    assert np.array_equal(ref.params["blocks.0.tm.w1"], m.params["blocks.0.tm.w1"])


def test_a_state_tune_and_a_full_tune(tmp_path):
    m = rx.RxPtModel(CFG, seed=4)
    path = tmp_path / "m.gguf"
    export_model(m, "gguf", str(path), "q8_0")
    state, src = _model(tmp_path, path, tune="state")
    assert state.base_dtype == "q8_0"
    full, _ = _model(tmp_path, path, tune="full")   # nothing frozen: float32, dequantised
    assert full.base_dtype is None
    want = _dequantised(src).forward(TOKENS)
    assert np.array_equal(state.forward(TOKENS), want)
    assert np.array_equal(full.forward(TOKENS), want)


def test_f32_is_exact_and_holds_no_base(tmp_path):
    m = rx.RxPtModel(CFG, seed=5)
    path = tmp_path / "m.gguf"
    export_model(m, "gguf", str(path))
    model, src = _model(tmp_path, path)
    assert src.dtype == "fp32" and model.base_dtype is None
    assert np.array_equal(model.forward(TOKENS), m.forward(TOKENS))


@pytest.mark.parametrize("file,base,word", [("fp16", "auto", "fp16, not bf16"),
                                            ("q8_0", "q4_0", "q8_0, not q4_0")])
def test_a_form_the_base_cannot_hold_is_converted_once_with_one_line(tmp_path, file, base,
                                                                     word):
    m = rx.RxPtModel(CFG, seed=6)
    path = tmp_path / "m.gguf"
    export_model(m, "gguf", str(path), file)
    with pytest.warns(RwkvxWarning, match=f"{word}: each converted once") as w:
        model, src = _model(tmp_path, path, base_dtype=base)
    assert len(w) == 1
    dtype = "bf16" if base == "auto" else base
    assert model.base_dtype == dtype
    # once: the base holds the quantisation of gguf's dequantised values
    rows = np.ascontiguousarray(src.weights["blocks.0.tm.key_w"].T)
    if dtype == "bf16":
        u = rows.view(np.uint32)
        want = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    else:
        want = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(model.base_data("blocks.0.tm.key_w"), want)


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_the_base_goes_out_as_it_came_in(tmp_path, dtype):
    m = rx.RxPtModel(CFG, seed=7)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    export_model(m, "gguf", str(a), dtype)
    model, _ = _model(tmp_path, a, tune="state")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_gguf(model, str(b), dtype)
    ta, tb = _tensors(a), _tensors(b)
    assert set(ta) == set(tb)
    for name, t in ta.items():
        assert t.tensor_type == tb[name].tensor_type, name
        assert np.array_equal(np.asarray(t.data), np.asarray(tb[name].data)), name


def _write(path, arch="rwkv7", drop=None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_embedding_length(128)
    if drop is None:
        w.add_tensor("token_embd.weight", np.zeros((256, 128), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_what_is_not_an_rwkv7_gguf_is_one_line(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(InteropError, match="not a GGUF file"):
        read_source(str(bad))
    _write(tmp_path / "l.gguf", "llama")
    with pytest.raises(InteropError, match="architecture 'llama'"):
        read_source(str(tmp_path / "l.gguf"))
    _write(tmp_path / "r.gguf")
    with pytest.raises(InteropError, match=r"metadata has no rwkv7\.block_count"):
        read_source(str(tmp_path / "r.gguf"))
    m = rx.RxPtModel(CFG, seed=8)
    path = tmp_path / "m.gguf"
    export_model(m, "gguf", str(path))
    r = gguf.GGUFReader(str(path), "r+")
    t = {x.name: x for x in r.tensors}["blk.0.time_mix_key.weight"]
    t.data[0, 0] = np.nan
    r.data.flush()
    del r
    model = None
    with pytest.raises(InteropError, match=r"blk\.0\.time_mix_key\.weight holds a non-finite"):
        model, _ = _model(tmp_path, path, base_dtype="q8_0")
    assert model is None


def test_the_command_line_round_trip(tmp_path, capsys):
    """train --init-from a Q8_0 GGUF: a state run exports the file's blocks
    back; a LoRA run's adapters go out as llama.cpp's adapter file."""
    from rwkvx_c.cli import main
    m = rx.RxPtModel(CFG, seed=10)
    src = tmp_path / "m.gguf"
    export_model(m, "gguf", str(src), "q8_0")
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    args = ["train", "--init-from", str(src), "--data", str(tmp_path / "corpus.txt"),
            "--cache-dir", str(tmp_path / "cache"), "--steps", "2", "--batch", "2", "--seq-len",
            "16", "--eval-tokens", "32", "--threads", "1", "--no-progress"]
    assert main(args + ["--tune", "state", "--out", str(tmp_path / "s")]) == 0
    assert "frozen base q8_0, 24 matrices" in capsys.readouterr().out
    out = tmp_path / "s.gguf"
    assert main(["export", str(tmp_path / "s"), "--format", "gguf", "--dtype", "q8_0",
                 "--out", str(out)]) == 0
    ta, tb = _tensors(src), _tensors(out)
    for name, t in ta.items():
        assert np.array_equal(np.asarray(t.data), np.asarray(tb[name].data)), name
    assert main(args + ["--tune", "lora", "--out", str(tmp_path / "l")]) == 0
    assert main(["export", str(tmp_path / "l"), "--format", "gguf-lora",
                 "--out", str(tmp_path / "l.gguf")]) == 0
    names = set(_tensors(tmp_path / "l.gguf"))
    assert "blk.1.time_mix_key.weight.lora_a" in names and len(names) == 2 * 6 * 2
    # the default --base-dtype (auto) trained over the file's Q8_0 blocks, and
    # sampling holds that base again, its adapters unmerged (not a float32 model)
    from rwkvx_c.sample import load_run
    held, _ = load_run(str(tmp_path / "l"), hold_base=True)
    assert held.base_dtype == "q8_0" and "emb" in held.base_names
    assert held.lora_rank is not None


@pytest.mark.skipif(os.environ.get("RWKVX_SLOW") != "1",
                    reason="15 s (the gguf reader parses 65536 strings); RWKVX_SLOW=1 runs it")
def test_the_world_vocabulary_comes_from_the_metadata(tmp_path):
    pytest.importorskip("rwkv")
    m = rx.RxPtModel(dict(CFG, vocab_size=65536), seed=11)
    path = tmp_path / "w.gguf"
    export_model(m, "gguf", str(path), "q8_0")
    src = read_source(str(path))
    assert src.tokenizer == "world" and src.config["vocab_size"] == 65536
    import rwkv
    from rwkv.rwkv_tokenizer import TRIE_TOKENIZER  # the rwkv package's World tokenizer

    from rwkvx_c.data.tokenizers import load
    theirs = TRIE_TOKENIZER(os.path.join(os.path.dirname(rwkv.__file__),
                                         "rwkv_vocab_v20230424.txt"))
    text = "Hello, world! 你好 def f(x):\n\n    return x"
    assert list(load(src.tokenizer).encode(text)) == theirs.encode(text)
    # a token changed in the file: refused by id
    r = gguf.GGUFReader(str(path), "r+")
    f = r.fields["tokenizer.ggml.tokens"]
    f.parts[f.data[300]][0] ^= 1
    r.data.flush()
    del r
    with pytest.raises(InteropError, match="token 300 is"):
        read_source(str(path))


def test_import_makes_a_float32_run_of_the_dequantised_tensors(tmp_path):
    from rwkvx_c.interop.runs import import_pth
    from rwkvx_c.run.checkpoint import read_checkpoint
    m = rx.RxPtModel(CFG, seed=12)
    path = tmp_path / "m.gguf"
    export_model(m, "gguf", str(path), "q4_0")
    tensors, _, state = read_checkpoint(import_pth(str(path), str(tmp_path / "run")))
    src = read_source(str(path))
    assert state["format"] == "gguf" and state["tokenizer"]["name"] == "byte"
    for n in ("blocks.1.tm.key_w", "emb", "head", "blocks.0.tm.w1"):
        assert np.array_equal(tensors[n], src.weights[n]), n
