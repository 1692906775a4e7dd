"""The q4_k frozen base (docs/layout.md §Frozen base): GGUF's Q4_K
super-blocks of 256. Its bytes are llama.cpp's own quantize_row_q4_K_ref
(ggml's reference, no importance matrix, called through ctypes from
llama-cpp-python's libggml-base) on every kind of row (random, zero,
all equal, tiny, huge, subnormal, NaN and infinity, one-signed, of a
trained model's scale), and they decode bit for bit as gguf-py's
Q4_K.dequantize_blocks and tests/reference/q4_k.py (float64) do, with the
AVX2 decoder and the portable loop alike, as the GEMM's products over
them are (the model's bits over a q4_k base are tests/test_base.py's). A
tune on it (a model whose C is no multiple of 256: those matrices stay
float32) runs from TrainOptions, the command line and a config file,
resumes bit for bit and exports."""
import ctypes
import os

import numpy as np
import pytest
from test_base import CFG256, _counts_its_bytes, _falls, _resumes_and_exports, _tune_three_ways

import rwkvx_c as rx

from checks import portable_run
from reference import q4_k

gguf = pytest.importorskip("gguf")
Q4_K = gguf.GGMLQuantizationType.Q4_K
# C = 256: the embedding's and the head's rows are one super-block each
V, C = CFG256["vocab_size"], CFG256["n_embd"]


def _llama_q4_k(x):
    """llama.cpp's quantize_row_q4_K_ref of each row of x (skips without
    llama-cpp-python)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    lib.quantize_row_q4_K_ref.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.quantize_row_q4_K_ref.restype = None
    x = np.ascontiguousarray(x, np.float32)
    out = np.zeros((x.shape[0], x.shape[1] // 256 * 144), np.uint8)
    for i in range(x.shape[0]):
        lib.quantize_row_q4_K_ref(x[i].ctypes.data, out[i].ctypes.data, x.shape[1])
    return out


def _rows(n=512):
    """rows of n values, each a kind of super-block ggml treats apart"""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((40, n)).astype(np.float32)
    x[1] = 0.0
    x[2] = 0.3                               # all equal, positive: the min clamps at 0
    x[3] = -0.3                              # all equal, negative: every q 0
    x[4] *= 1e-30                            # tiny: d underflows fp16
    x[5] *= 1e-6                             # d an fp16 subnormal
    x[6] = rng.standard_normal(n) * 3e37     # huge: d overflows fp16
    x[7, :40] = 3.4e38                       # the largest float32
    x[8] = rng.standard_normal(n) * 1e-40    # float32 subnormals
    x[9] = np.abs(x[9]) + 1.0                # one-signed: no min
    x[10] = -np.abs(x[10])
    x[11, 3] = np.nan                        # a NaN (what ggml's reference makes of it)
    x[12, 9] = np.inf
    x[13, 100] = -np.inf
    x[14, :32] = 0.0                         # one zero sub-block among live ones
    x[15, ::2] = 0.0
    x[16] = np.round(x[16] * 4) / 4          # exact quarters: rounding ties
    x[17, 7] = 50.0                          # one outlier: the other scales coarse
    x[18:30] *= 0.02                         # a trained model's scale
    x[30:] = rng.uniform(-1, 1, (10, n)) * rng.uniform(0, 3, (10, 1))
    return x


def test_q4_k_rows_are_llama_cpps_bytes():
    x = _rows()
    want = _llama_q4_k(x)
    got = rx.base_quantize("q4_k", x)
    assert got.shape == (len(x), 2 * 144)
    for i in range(len(x)):
        assert np.array_equal(got[i], want[i]), i
    y = np.random.default_rng(3).standard_normal((64, 4096)).astype(np.float32) * 0.03
    assert np.array_equal(rx.base_quantize("q4_k", y), _llama_q4_k(y))


def test_q4_k_decodes_as_gguf_and_the_float64_reference():
    data = rx.base_quantize("q4_k", _rows())
    ours = rx.base_dequantize("q4_k", data)
    assert np.array_equal(ours, q4_k.dequantize(data), equal_nan=True)
    with np.errstate(invalid="ignore"):
        theirs = gguf.quants.dequantize(data, Q4_K)
    assert np.array_equal(ours, theirs, equal_nan=True)
    # every byte value in every place: random blocks, finite scales
    raw = np.random.default_rng(2).integers(0, 256, (64, 4 * 144), dtype=np.uint8)
    b = raw.reshape(64, 4, 144)
    b[..., 0:4] = np.float16(0.01 * np.random.default_rng(4).standard_normal((64, 4, 2))) \
        .view(np.uint8).reshape(64, 4, 4)
    assert np.array_equal(rx.base_dequantize("q4_k", raw), q4_k.dequantize(raw))
    assert np.array_equal(rx.base_dequantize("q4_k", raw), gguf.quants.dequantize(raw, Q4_K))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_q4_k_base_holds_the_bytes_and_decodes_them(precision):
    x = _rows(C)[:V]
    want = rx.base_quantize("q4_k", x)
    m = rx.RxPtModel(CFG256, seed=0, init=False, precision=precision)
    m.set_base("q4_k", ["emb", "head"])
    m.base_fill("emb", x)
    assert np.array_equal(m.base_data("emb"), want)
    assert m.base_bytes == 2 * V * 144
    assert np.array_equal(m.base_tensor("emb"), q4_k.dequantize(want), equal_nan=True)
    # a row of W^T, its blocks along in, and its own stored rows back in as they are
    w = np.random.default_rng(1).standard_normal((V, C)).astype(np.float32)
    m.base_fill("head", w, transposed=True)
    assert np.array_equal(m.base_data("head"), rx.base_quantize("q4_k", w))
    m.base_fill("head", want, transposed=True)
    assert np.array_equal(m.base_data("head"), want)
    assert np.array_equal(m.base_tensor("head").T, q4_k.dequantize(want), equal_nan=True)


def test_the_portable_q4_k_decoder_gives_the_same_bits():
    """The decode tests again in a process with RWKVX_BASE_PORTABLE=1: the
    decoder's scalar loop, not its AVX2 form."""
    portable_run("test_base_q4_k.py", "decodes_as_gguf or holds_the_bytes or products_bits")


def _random_rows(rng, N, K):
    """N stored rows of K / 256 random super-blocks, d and dmin random fp16
    of every kind the decoders meet (subnormal, zero, negative, the largest)"""
    raw = rng.integers(0, 256, (N, K // 256, 144), dtype=np.uint8)
    h = (rng.standard_normal((N, K // 256, 2)) * 0.02).astype(np.float16)
    h.reshape(-1)[::7] = np.float16(2.0 ** -24)
    h.reshape(-1)[3::11] = 0
    h.reshape(-1)[5::13] = np.float16(-65504.0)
    raw[..., 0:4] = h.view(np.uint8).reshape(N, K // 256, 4)
    return np.ascontiguousarray(raw.reshape(N, -1))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("N", [16, 57, 1000])
def test_a_q4_k_base_products_bits_are_the_decoded_weights(N, threads, restore_threads):
    """The fp32 GEMM reading a q4_k base (the small-M product of M 1..4,
    the packed slivers' of 5..9) gives the bits of the same product over
    the decoded weights held as float32; K past one KC-deep chunk (256)."""
    K = 3 * 256
    rng = np.random.default_rng(N)
    rows = _random_rows(rng, N, K)
    w = q4_k.dequantize(rows)
    rx.set_num_threads(threads)
    for M in range(1, 10):
        a = rng.standard_normal((M, K)).astype(np.float32)
        want = rx._core._sgemm(a, w, tb=True)
        got = rx._core._base_sgemm("q4_k", rows, a)
        assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist(), M


def test_sizes_that_are_not_whole_q4_k_blocks_are_refused_and_the_bytes_counted():
    odd = rx.RxPtModel(dict(CFG256, Dw=32), seed=0, init=False)
    with pytest.raises(ValueError, match=r"w2 \[32, 256\]: Q4_K needs its input size a "
                                         r"multiple of 256"):
        odd.set_base("q4_k", ["blocks.0.tm.w2"])
    narrow = rx.RxPtModel(dict(CFG256, n_embd=320, n_head=10), seed=0, init=False)
    with pytest.raises(ValueError, match=r"emb \[37, 320\]: Q4_K needs its row size a "
                                         r"multiple of 256"):
        narrow.set_base("q4_k", ["emb"])
    with pytest.raises(ValueError, match="not whole 256-value blocks"):
        rx.base_quantize("q4_k", np.zeros((2, 320), np.float32))
    _counts_its_bytes(CFG256, "q4_k", 256, 144)   # 4.5 bits a weight


def _pth(tmp_path):
    """a bf16 x070 .pth of C = 320, no multiple of 256: the embedding, the
    head and every time-mix matrix stay float32, the channel mixes' value
    matrices (in = F = 256) are held; its head scaled down, so the first
    loss is near the uniform guess's (the run's divergence guard)"""
    pytest.importorskip("torch")
    from test_interop import _official_dict

    from rwkvx_c import interop
    sd = _official_dict(np.random.default_rng(0), V=256, C=320, H=10, N=32, L=2, F=256,
                        Dw=32, Da=32, Dv=32, Dg=32)
    sd["head.weight"] *= 0.1
    pth = str(tmp_path / "o.pth")
    interop.save_pth(sd, pth, "bf16")
    return pth


def test_a_q4_k_tune_from_trainoptions_the_command_line_and_a_config_file(tmp_path, capsys):
    tr, runs = _tune_three_ways(tmp_path, capsys, _pth(tmp_path), "q4_k", 2)
    assert tr.model.base_dtype == "q4_k"
    assert tr.model.base_names == ["blocks.0.cm.ffn_value_w", "blocks.1.cm.ffn_value_w"]
    assert all(_falls(losses) for losses in runs) and runs[1] == runs[2], runs


def test_a_q4_k_lora_tune_resumes_bit_exact_and_exports(tmp_path, capsys):
    _resumes_and_exports(tmp_path, capsys, _pth(tmp_path), "q4_k")
