"""The q4_0 frozen base (docs/layout.md §Frozen base): its blocks are the
bytes of gguf.quants.quantize(W^T, Q4_0) on every kind of row (random,
zero, tiny, huge, subnormal, all equal, a negative or tied largest value),
decoded as gguf dequantizes them, with the AVX2 decoders and the portable
loops alike; a tune on it from TrainOptions, the command line and a config
file trains, resumes bit for bit and exports as a q8_0 one does. The
model's bits over it (both precisions, any thread count, state and LoRA)
are tests/test_base.py's, parametrized over every block dtype."""
import os

import numpy as np
import pytest
from test_base import CFG, _bf16_pth, _falls, _resumes_and_exports, _tune_three_ways

import rwkvx_c as rx
from rwkvx_c.cli import main

from checks import portable_run

gguf = pytest.importorskip("gguf")
Q4_0 = gguf.GGMLQuantizationType.Q4_0
V, C = CFG["vocab_size"], CFG["n_embd"]   # the embedding: V rows of C / 32 blocks


def _rows():
    """V x C values, two blocks a row, each row a kind of block gguf treats
    apart: the largest magnitude negative, tied with its negation, at the
    extremes of float32 and of the fp16 scale, all equal, exact halves"""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((V, C)).astype(np.float32)
    x[1] = 0.0
    x[2] *= 1e-30                        # d underflows fp16 to zero
    x[3] *= 1e-6                         # d an fp16 subnormal
    x[4] = rng.standard_normal(C) * 3e37  # d overflows fp16 to inf
    x[5, :32] = 3.4e38                   # the largest float32
    x[6] = rng.standard_normal(C) * 1e-40  # float32 subnormals: id = 1 / d overflows
    x[7] = 0.3
    x[8] = -0.3
    x[9, 5] = -40.0                      # the largest magnitude negative: d > 0
    x[10, 3], x[10, 9] = 7.0, -7.0        # tied: the first one sets d's sign
    x[10, 40], x[10, 33] = 7.0, -7.0
    x[11] = np.arange(C) / 2 - 8.0       # exact halves: x / d + 8.5 lands on integers
    x[12, :32] = np.float32(1e-45)       # the smallest subnormal
    x[13] = -np.abs(x[13])
    x[14] = np.abs(x[14]) + 1.0
    return x


def _base(x, precision="fp32"):
    m = rx.RxPtModel(CFG, seed=0, init=False, precision=precision)
    m.set_base("q4_0", ["emb"])
    m.base_fill("emb", x)
    return m


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_q4_0_blocks_are_ggufs_bytes_and_decode_as_gguf(precision):
    x = _rows()
    with np.errstate(all="ignore"):   # gguf's own overflow on the subnormal rows
        want = gguf.quants.quantize(x, Q4_0)
        dec = gguf.quants.dequantize(want, Q4_0)
    m = _base(x, precision)
    got = m.base_data("emb")
    assert got.shape == (V, C // 32 * 18) and m.base_bytes == V * C // 32 * 18
    for i in range(V):
        assert np.array_equal(got[i], want[i]), i
    assert np.array_equal(m.base_tensor("emb"), dec, equal_nan=True)
    # a row of W^T too, whose blocks lie along in: the key projection's
    w = np.random.default_rng(1).standard_normal((C, C)).astype(np.float32)
    p = rx.RxPtModel(CFG, seed=0, init=False, precision=precision)
    p.set_base("q4_0", ["blocks.0.tm.key_w"])
    p.base_fill("blocks.0.tm.key_w", w, transposed=True)   # W^T [out, in] as given
    assert np.array_equal(p.base_data("blocks.0.tm.key_w"), gguf.quants.quantize(w, Q4_0))
    assert np.array_equal(p.base_tensor("blocks.0.tm.key_w"),
                          np.ascontiguousarray(gguf.quants.dequantize(
                              gguf.quants.quantize(w, Q4_0), Q4_0).T))


def test_the_portable_q4_0_loops_give_the_same_bytes():
    """The same in a process with RWKVX_BASE_PORTABLE=1: no AVX2 decoders."""
    portable_run("test_base_q4_0.py", "ggufs_bytes")


def test_a_q4_0_tune_from_trainoptions_the_command_line_and_a_config_file(tmp_path, capsys):
    tr, runs = _tune_three_ways(tmp_path, capsys, _bf16_pth(tmp_path), "q4_0", 28)
    assert tr.model.base_dtype == "q4_0"
    assert all(_falls(losses) for losses in runs), runs


def test_a_q4_0_lora_tune_resumes_bit_exact_and_exports(tmp_path, capsys):
    _resumes_and_exports(tmp_path, capsys, _bf16_pth(tmp_path), "q4_0")
    assert main(["export", str(tmp_path / "a"), "--format", "lora",
                 "--out", str(tmp_path / "l.pth")]) == 0
    assert os.path.getsize(tmp_path / "l.pth") > 0
