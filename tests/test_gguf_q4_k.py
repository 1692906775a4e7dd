"""GGUF's Q4_K in and out: export --format gguf --dtype q4_k writes each
matrix's Q4_K blocks as llama.cpp's quantize_row_q4_K_ref makes them (a
q4_k base's blocks as they are) and llama.cpp reads the file; --init-from a
Q4_K GGUF copies the file's blocks into a q4_k base as they are, and
--init-from a Q4_K_M GGUF made by llama.cpp's own quantizer (llama_model_
quantize on our F32 export) too, its Q6_K matrices converted once with
one line."""
import importlib.util
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from test_base_q4_k import _llama_q4_k
from test_gguf import Q8_TOL, TOKENS, _err, _llama_logits
from test_gguf_in import _dequantised, _model, _tensors

import rwkvx_c as rx
from rwkvx_c.errors import InteropError, RwkvxWarning
from rwkvx_c.interop import export_model
from rwkvx_c.interop.gguf import save_gguf

gguf = pytest.importorskip("gguf")
Q4_K = gguf.GGMLQuantizationType.Q4_K

# C and F multiples of 256: the projections, the head and the embedding are
# whole Q4_K super-blocks; the LoRAs' rank-32 rows fall back to F16; CFG's 3
# blocks, so test_gguf's Q8_TOL bounds llama.cpp's activation rounding (Q8_K)
CFG = dict(n_embd=256, n_head=4, head_size=64, n_rwkv_layer=3, n_attn_layer=0, vocab_size=256,
           ffn_dim=512, Dw=32, Da=32, Dg=32, Dv=32, chunk_size=32, moba_top_k=2, ln0=1)
# the matrices a q4_k base holds: per block 4 time-mix and 2 channel-mix
# projections, a1 g1 (v1 past block 0); the head and the embedding
HELD = 3 * 8 + 2 + 2


def test_a_q4_k_export_is_llama_cpps_blocks_and_llama_cpp_reads_it(tmp_path):
    m = rx.RxPtModel(CFG, seed=5)
    path = tmp_path / "m.gguf"
    export_model(m, "gguf", str(path), "q4_k")
    t = _tensors(path)
    key = t["blk.1.time_mix_key.weight"]
    assert key.tensor_type == Q4_K and t["output.weight"].tensor_type == Q4_K
    assert t["blk.1.time_mix_a2.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    want = _llama_q4_k(np.ascontiguousarray(m.params["blocks.1.tm.key_w"].T))
    assert np.array_equal(np.asarray(key.data), want)
    assert np.array_equal(np.asarray(t["token_embd.weight"].data), _llama_q4_k(m.params["emb"]))
    got = _llama_logits(tmp_path, path)
    err = _err(got, _dequantised(rx.interop.read_source(str(path))).forward(TOKENS))
    print(f"llama.cpp (q4_k) vs RxPtModel: {err:.2e}")
    assert err <= Q8_TOL


def test_the_files_q4_k_blocks_go_into_the_base_as_they_are(tmp_path):
    m = rx.RxPtModel(CFG, seed=3)
    path = tmp_path / "m.gguf"
    export_model(m, "gguf", str(path), "q4_k")
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nothing converted
        model, src = _model(tmp_path, path)
    assert src.dtype == "q4_k" and model.base_dtype == "q4_k"
    assert len(model.base_names) == HELD and "blocks.0.tm.a2" not in model.base_names
    t = _tensors(path)
    assert np.array_equal(model.base_data("blocks.2.cm.ffn_value_w"),
                          np.asarray(t["blk.2.channel_mix_value.weight"].data))
    assert np.array_equal(model.forward(TOKENS), _dequantised(src).forward(TOKENS))


def test_the_q4_k_base_goes_out_as_it_came_in(tmp_path):
    m = rx.RxPtModel(CFG, seed=7)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    export_model(m, "gguf", str(a), "q4_k")
    model, _ = _model(tmp_path, a, tune="state")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_gguf(model, str(b), "q4_k")
    ta, tb = _tensors(a), _tensors(b)
    assert set(ta) == set(tb)
    for name, t in ta.items():
        assert t.tensor_type == tb[name].tensor_type, name
        assert np.array_equal(np.asarray(t.data), np.asarray(tb[name].data)), name


_QUANTIZE = """
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
p.nthread = 1
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))
"""


def test_a_q4_k_m_file_of_llama_cpps_quantizer_goes_into_a_q4_k_base(tmp_path):
    py = os.environ.get("RWKVX_LLAMA_PYTHON")
    if not py:
        if importlib.util.find_spec("llama_cpp") is None:
            pytest.skip("llama.cpp's Python binding is not installed")
        py = sys.executable
    m = rx.RxPtModel(CFG, seed=9)
    f32, qkm = tmp_path / "f32.gguf", tmp_path / "q4_k_m.gguf"
    export_model(m, "gguf", str(f32), "fp32")
    r = subprocess.run([py, "-c", _QUANTIZE, str(f32), str(qkm)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    t = _tensors(qkm)
    kinds = {n: x.tensor_type.name for n, x in t.items()}
    assert kinds["blk.0.time_mix_key.weight"] == "Q4_K" and "Q6_K" in kinds.values()
    with pytest.warns(RwkvxWarning, match="q6_k, not q4_k: each converted once") as w:
        model, src = _model(tmp_path, qkm)
    assert len(w) == 1 and src.dtype == "q4_k" and model.base_dtype == "q4_k"
    pairs = {ours: theirs for ours, theirs, _ in rx.interop.gguf.gguf_pairs(model.config)}
    n_raw = 0
    for n in model.base_names:
        file = t[pairs[n]]
        if file.tensor_type == Q4_K:   # the file's bytes, as they are
            assert np.array_equal(model.base_data(n), np.asarray(file.data)), n
            n_raw += 1
        else:   # decoded by gguf, encoded once
            rows = src.weights[n] if n == "emb" else np.ascontiguousarray(src.weights[n].T)
            assert np.array_equal(model.base_data(n), rx.base_quantize("q4_k", rows)), n
    assert n_raw > HELD // 2


def test_the_command_line_round_trip(tmp_path, capsys):
    """train --init-from a Q4_K GGUF (--base-dtype auto: q4_k), a state
    run; export --format gguf --dtype q4_k gives the file's tensors back."""
    from rwkvx_c.cli import main
    src = tmp_path / "m.gguf"
    m = rx.RxPtModel(CFG, seed=10)
    m.params["head"][...] *= 0.1   # a first loss near the uniform guess's (the run's guard)
    export_model(m, "gguf", str(src), "q4_k")
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    assert main(["train", "--init-from", str(src), "--data", str(tmp_path / "corpus.txt"),
                 "--cache-dir", str(tmp_path / "cache"), "--steps", "2", "--batch", "2",
                 "--seq-len", "16", "--eval-tokens", "32", "--threads", "1", "--no-progress",
                 "--tune", "state", "--out", str(tmp_path / "s")]) == 0
    assert f"frozen base q4_k, {HELD} matrices" in capsys.readouterr().out
    out = tmp_path / "s.gguf"
    assert main(["export", str(tmp_path / "s"), "--format", "gguf", "--dtype", "q4_k",
                 "--out", str(out)]) == 0
    ta, tb = _tensors(src), _tensors(out)
    assert set(ta) == set(tb)
    for name, t in ta.items():
        assert t.tensor_type == tb[name].tensor_type, name
        assert np.array_equal(np.asarray(t.data), np.asarray(tb[name].data)), name


@pytest.mark.parametrize("at,half", [(0, 0x7E00), (2, 0x7C00)], ids=["d NaN", "dmin inf"])
def test_a_non_finite_block_scale_is_one_line(tmp_path, at, half):
    path = tmp_path / "m.gguf"
    export_model(rx.RxPtModel(CFG, seed=8), "gguf", str(path), "q4_k")
    r = gguf.GGUFReader(str(path), "r+")
    t = {x.name: x for x in r.tensors}["blk.0.time_mix_key.weight"]
    t.data[3, at:at + 2] = np.array([half], "<u2").view(np.uint8)   # row 3's super-block
    r.data.flush()
    del r
    with pytest.raises(InteropError, match=r"blk\.0\.time_mix_key\.weight has a non-finite "
                                           "block scale"):
        _model(tmp_path, path)
