"""GGUF export for llama.cpp's rwkv7: read back with the gguf package's own
reader -- names, ggml shapes, types, metadata, tokenizer and every value --
plus the refusals. With llama.cpp's Python binding (llama_cpp importable, or
a Python that has it named by RWKVX_LLAMA_PYTHON) the logits are compared
too; without it that check skips (CI does not build llama.cpp)."""
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

import rwkvx_c as rx
from rwkvx_c.interop import InteropError, export_model
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.model.lora import DEFAULT_TARGETS, adapters_of, merge_into, target_params

gguf = pytest.importorskip("gguf") if os.environ.get("RWKVX_REQUIRE_INTEROP") != "1" \
    else __import__("gguf")

CFG = dict(n_embd=128, n_head=2, head_size=64, n_rwkv_layer=3, n_attn_layer=0, vocab_size=256,
           ffn_dim=320, Dw=16, Da=24, Dg=40, Dv=8, chunk_size=32, moba_top_k=2, ln0=1)


def _read(path):
    r = gguf.GGUFReader(str(path))
    fields = {}
    for name, f in r.fields.items():
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
            fields[name] = [f.contents(i) for i in range(len(f.data))]
        else:
            fields[name] = f.contents()
    return r, fields


def test_fp32_read_back_exactly(tmp_path):
    m = rx.RxPtModel(CFG, seed=3)
    path = tmp_path / "m.gguf"
    export_model(m, "gguf", str(path))
    r, f = _read(path)
    assert f["general.architecture"] == "rwkv7"
    assert f["general.file_type"] == 0
    for key, want in (("rwkv7.embedding_length", 128), ("rwkv7.block_count", 3),
                      ("rwkv7.feed_forward_length", 320), ("rwkv7.wkv.head_size", 64),
                      ("rwkv7.attention.decay_lora_rank", 16),
                      ("rwkv7.attention.iclr_lora_rank", 24),
                      ("rwkv7.attention.value_residual_mix_lora_rank", 8),
                      ("rwkv7.attention.gate_lora_rank", 40),
                      ("rwkv7.attention.head_count", 0), ("rwkv7.context_length", 1048576)):
        assert f[key] == want, key
    assert abs(f["rwkv7.attention.layer_norm_epsilon"] - ModelConfig.default("ln_eps")) < 1e-12
    assert f["tokenizer.ggml.model"] == "rwkv"
    toks = f["tokenizer.ggml.tokens"]
    assert len(toks) == 256 and toks[97] == "a" and toks[10] == "\\n" and toks[200] == "\\xc8"
    assert len(set(toks)) == 256
    t = {x.name: x for x in r.tensors}
    p = m.params
    # ggml dims are the numpy shape reversed: an [in, out] matrix is stored [out, in]
    checks = {
        "token_embd.weight": ((128, 256), p["emb"]),
        "token_embd_norm.weight": ((128,), p["ln0_w"]),
        "blk.1.time_mix_key.weight": ((128, 128), p["blocks.1.tm.key_w"].T),
        "blk.2.time_mix_w1.weight": ((128, 16), p["blocks.2.tm.w1"].T),
        "blk.2.time_mix_v2.weight": ((8, 128), p["blocks.2.tm.v2"].T),
        "blk.0.time_mix_v1.weight": ((128, 24), p["blocks.0.tm.a1"].T),  # layer-0 stand-in
        "blk.0.time_mix_r_k.weight": ((128,), p["blocks.0.tm.r_k"]),
        "blk.1.channel_mix_key.weight": ((128, 320), p["blocks.1.cm.ffn_key_w"].T),
        "blk.1.channel_mix_value.weight": ((320, 128), p["blocks.1.cm.ffn_value_w"].T),
        "output.weight": ((128, 256), p["head"].T),
    }
    for name, (ne, want) in checks.items():
        assert tuple(int(d) for d in t[name].shape) == ne, name
        assert np.array_equal(np.asarray(t[name].data).reshape(want.shape), want), name
    lerp = np.asarray(t["blk.1.time_mix_lerp_fused.weight"].data).reshape(6, 128)
    for j, x in enumerate(("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")):
        assert np.array_equal(lerp[j], p[f"blocks.1.tm.{x}"])
    assert len(t) == 3 + 3 * 28 + 3   # 28 tensors per block (loader: rwkv7 load_arch_tensors)


def test_bf16_keeps_small_tensors_f32(tmp_path):
    m = rx.RxPtModel(CFG, seed=4)
    path = tmp_path / "m.gguf"
    export_model(m, "gguf", str(path), "bf16")
    r, f = _read(path)
    assert f["general.file_type"] == 32
    types = {x.name: x.tensor_type.name for x in r.tensors}
    assert types["blk.0.time_mix_key.weight"] == "BF16" and types["output.weight"] == "BF16"
    for n in ("blk.0.time_mix_w1.weight", "blk.0.time_mix_lerp_fused.weight",
              "blk.0.attn_norm.weight", "blk.0.time_mix_w0.weight"):
        assert types[n] == "F32", n


@pytest.mark.parametrize("dtype,ftype", [("q8_0", 7), ("q4_0", 2)])
def test_block_types_are_ggufs_quantization(tmp_path, dtype, ftype):
    m = rx.RxPtModel(CFG, seed=4)
    path = tmp_path / "m.gguf"
    export_model(m, "gguf", str(path), dtype)
    r, f = _read(path)
    assert f["general.file_type"] == ftype
    t = {x.name: x for x in r.tensors}
    Q = gguf.GGMLQuantizationType
    q = Q.Q8_0 if dtype == "q8_0" else Q.Q4_0
    key = m.params["blocks.1.tm.key_w"]
    assert t["blk.1.time_mix_key.weight"].tensor_type == q
    assert np.array_equal(np.asarray(t["blk.1.time_mix_key.weight"].data),
                          gguf.quants.quantize(np.ascontiguousarray(key.T), q))
    assert t["token_embd.weight"].tensor_type == q and t["output.weight"].tensor_type == q
    # rows that are not whole blocks (a2's Da = 24): F16, as the converter falls back
    assert t["blk.1.time_mix_a2.weight"].tensor_type == Q.F16
    assert t["blk.1.time_mix_w1.weight"].tensor_type == Q.F32
    with pytest.raises(InteropError, match="--format rwkv7 writes no dtype 'q8_0'"):
        export_model(m, "rwkv7", str(tmp_path / "x.pth"), "q8_0")


@pytest.mark.parametrize("dtype", ["fp32", "q8_0"])
def test_an_export_holds_one_tensor_at_a_time(tmp_path, dtype):
    """The GGUF export makes each tensor (transposed, decoded, quantised)
    only when it writes it: its allocations while writing a 12-block model
    stay a few times its largest tensor (the model is 52 of them), where holding every converted
    tensor until the end took the model's size again (a 1.5B model's export
    peaked at 17.5 GB)."""
    import tracemalloc
    m = rx.RxPtModel(dict(CFG, n_rwkv_layer=12), seed=4)
    largest = max(a.nbytes for a in m.params.values())
    total = sum(a.nbytes for a in m.params.values())
    assert total > 40 * largest, "a model whose tensors sum far past its largest tests nothing"
    tracemalloc.start()
    try:
        export_model(m, "gguf", str(tmp_path / "m.gguf"), dtype)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # one tensor made, and gguf's quantize's temporaries: a few float32 copies of it
    assert peak < 8 * largest, (peak, largest, total)


@pytest.mark.parametrize("change,word", [
    (dict(n_attn_layer=1), "attention"), (dict(ln0=0), "ln0"),
    (dict(n_head=4, head_size=32), "head_size = 64"), (dict(vocab_size=300), "vocab 300")])
def test_refusals(tmp_path, change, word):
    with pytest.raises(InteropError, match=word):
        export_model(rx.RxPtModel(dict(CFG, **change)), "gguf", str(tmp_path / "x.gguf"))
    assert not os.listdir(tmp_path)


# llama.cpp's extra weight buffers (AMX, repacked blocks) off: its plain CPU
# kernels are the judge on every CPU, and its AMX matmul crashes on RWKV-7's
# quantised tensors (llama-cpp-python 0.3.36, Sapphire Rapids: SIGSEGV in
# ggml_backend_amx_mul_mat)
_LLAMA = """
import sys, numpy as np
import llama_cpp.llama_cpp as low
from llama_cpp import Llama
default = low.llama_model_default_params
def params():
    p = default()
    if hasattr(p, "use_extra_bufts"):
        p.use_extra_bufts = False
    return p
low.llama_model_default_params = params
toks = [int(t) for t in np.load(sys.argv[2])]
llm = Llama(model_path=sys.argv[1], n_ctx=len(toks) + 8, n_batch=64, n_ubatch=64,
            n_gpu_layers=0, logits_all=True, n_threads=1, verbose=False,
            lora_path=sys.argv[4] if len(sys.argv) > 4 else None)
llm.eval(toks)
np.save(sys.argv[3], np.array(llm.scores[:llm.n_tokens, :], dtype=np.float32))
"""
TOKENS = np.frombuffer(b"def f(x):\n    return x + 1\n", np.uint8).astype(np.int32)
# One Q8_0 (or Q4_0) product in llama.cpp rounds its activations to Q8_0 blocks
# (32 values, scale max|x| / 127): each value moves by at most half a step,
# max|x| / 254 of its block, so a product is off by at most 1/254 of what the
# block's largest value contributes. Along the model the rounded products
# stack: per block the time-mix projections then its output, the channel-mix
# key then its value (4), and the head: (4 L + 1) / 254 of the largest logit
# bounds the error, 13 / 254 = 5.1e-2 at CFG's 3 blocks (docs/interop.md).
Q8_TOL = (4 * CFG["n_rwkv_layer"] + 1) / 254


def _llama_logits(tmp_path, path, lora=None):
    py = os.environ.get("RWKVX_LLAMA_PYTHON")
    if not py:
        if importlib.util.find_spec("llama_cpp") is None:
            pytest.skip("llama.cpp's Python binding is not installed")
        py = sys.executable
    np.save(tmp_path / "t.npy", TOKENS)
    r = subprocess.run([py, "-c", _LLAMA, str(path), str(tmp_path / "t.npy"),
                        str(tmp_path / "l.npy")] + ([str(lora)] if lora else []),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return np.load(tmp_path / "l.npy")


def _err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-4), ("bf16", 5e-2), ("fp16", 1e-2),
                                       ("q8_0", Q8_TOL), ("q4_0", Q8_TOL)])
def test_llama_cpp_logits(tmp_path, dtype, tol):
    """llama.cpp on our export against the float32 model of the file's
    dequantised tensors (for fp32: the model itself)."""
    m = rx.RxPtModel(CFG, seed=5)
    path = tmp_path / "m.gguf"
    export_model(m, "gguf", str(path), dtype)
    got = _llama_logits(tmp_path, path)
    from rwkvx_c.interop.gguf_in import GgufWeights
    w = GgufWeights(str(path))
    ref_model = rx.RxPtModel(w.config, init=False)
    for n in ref_model.param_names:
        ref_model.params[n][...] = w[n]
    ref = ref_model.forward(TOKENS)
    err = _err(got, ref)
    print(f"llama.cpp ({dtype}) vs RxPtModel: {err:.2e}")
    assert err <= tol


def _lora_model(seed=9, r=4, alpha=8.0):
    m = rx.RxPtModel(CFG, seed=seed)
    names = target_params(m.layers, DEFAULT_TARGETS)
    m.enable_lora(r, alpha, names)
    rng = np.random.default_rng(seed)
    for v in m.lora.values():
        v[...] = rng.normal(0, 0.05, v.shape).astype(np.float32)
    return m, adapters_of(m.lora), alpha


def test_gguf_lora_is_llama_cpps_adapter_file(tmp_path):
    m, ads, alpha = _lora_model()
    path = tmp_path / "a.gguf"
    export_model(m, "gguf-lora", str(path), adapters=(ads, alpha, "lora", {}, ()))
    r, f = _read(path)
    assert f["general.type"] == "adapter" and f["general.architecture"] == "rwkv7"
    assert f["adapter.type"] == "lora" and f["adapter.lora.alpha"] == alpha
    t = {x.name: x for x in r.tensors}
    assert len(t) == 2 * len(ads) == 2 * 6 * CFG["n_rwkv_layer"]
    A, B = ads["blocks.1.tm.key_w"]
    a, b = t["blk.1.time_mix_key.weight.lora_a"], t["blk.1.time_mix_key.weight.lora_b"]
    assert tuple(int(d) for d in a.shape) == (128, 4) and tuple(int(d) for d in b.shape) == \
        (4, 128)   # ggml [in, r] and [r, out]
    assert np.array_equal(np.asarray(a.data), A) and np.array_equal(np.asarray(b.data), B)
    with pytest.raises(InteropError, match=r"llama\.cpp applies no adapter to blocks\.0\.tm\.w1"):
        export_model(m, "gguf-lora", str(tmp_path / "x.gguf"),
                     adapters=({"blocks.0.tm.w1": (A[:, :128], B[:32])}, alpha, "lora", {}, ()))
    with pytest.raises(InteropError, match="writes no dtype 'q8_0'"):
        export_model(m, "gguf-lora", str(tmp_path / "x.gguf"), "q8_0",
                     adapters=(ads, alpha, "lora", {}, ()))
    assert not os.path.exists(tmp_path / "x.gguf")


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-4), ("q8_0", Q8_TOL)])
def test_llama_cpp_applies_our_gguf_lora_as_we_merge_it(tmp_path, dtype, tol):
    m, ads, alpha = _lora_model()
    base, lora = tmp_path / "base.gguf", tmp_path / "lora.gguf"
    export_model(m, "gguf", str(base), dtype)   # the base's own weights: adapters aside
    export_model(m, "gguf-lora", str(lora), adapters=(ads, alpha, "lora", {}, ()))
    got = _llama_logits(tmp_path, base, lora)
    from rwkvx_c.interop.gguf_in import GgufWeights
    w = GgufWeights(str(base))
    merged = rx.RxPtModel(w.config, init=False)
    for n in merged.param_names:
        merged.params[n][...] = w[n]
    merge_into(merged.params, ads, alpha)
    err = _err(got, merged.forward(TOKENS))
    print(f"llama.cpp ({dtype} + gguf-lora) vs the merged RxPtModel: {err:.2e}")
    assert err <= tol


def test_world_vocabulary_tokens():
    if importlib.util.find_spec("rwkv") is None:
        if os.environ.get("RWKVX_REQUIRE_INTEROP") == "1":
            pytest.fail("RWKVX_REQUIRE_INTEROP=1 but rwkv is not installed")
        pytest.skip("the rwkv package (World vocabulary file) is not installed")
    from rwkvx_c.interop.gguf import gguf_vocab
    texts, types = gguf_vocab(65536)
    assert len(texts) == len(types) == 65536 and len(set(texts)) == 65536
    assert texts[0] == "<s>" and types[0] == int(gguf.TokenType.CONTROL)
    assert texts[11] == "\\n" and texts[261] == "\\n\\n"   # World ids 11 and 261
    assert texts[-1].startswith("[PAD") and types[-1] == int(gguf.TokenType.UNUSED)


@pytest.mark.skipif(os.environ.get("RWKVX_SLOW") != "1",
                    reason="15 s (the gguf reader parses 65536 strings); RWKVX_SLOW=1 runs it")
def test_world_gguf_special_tokens(tmp_path):
    m = rx.RxPtModel(dict(CFG, n_embd=64, n_head=1, n_rwkv_layer=1, ffn_dim=64,
                          vocab_size=65536), seed=6)
    path = tmp_path / "w.gguf"
    export_model(m, "gguf", str(path))
    f = gguf.GGUFReader(str(path)).fields   # read lazily: 65536 strings are slow to list
    toks = f["tokenizer.ggml.tokens"]
    assert len(toks.data) == 65536 and toks.contents(261) == "\\n\\n"
    assert [f[f"tokenizer.ggml.{k}_token_id"].contents() for k in ("bos", "eos", "eot")] == \
        [0, 0, 261]
