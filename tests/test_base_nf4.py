"""The nf4 frozen base (docs/layout.md §Frozen base): QLoRA's NF4 blocks of
64 (bitsandbytes' quantize_4bit, quant_type "nf4"). Its bytes are those of
tests/reference/nf4.py, written from the definition, on every kind of row
(random, zero, tiny, huge, subnormal, all equal, a negative largest value,
values on the midpoints between levels, NaN and infinity), and
bitsandbytes' own where it is installed; they decode as level[q] *
absmax. A model over an nf4 base computes bit for bit the logits and
gradients of the float32 model holding the decoded weights; a LoRA tune
on it trains, resumes bit for bit and exports from the original weights;
a GGUF source is converted into it once with one line."""
import json

import numpy as np
import pytest
from test_base import (
    CFG,
    _assert_same_bits,
    _bf16_pth,
    _counts_its_bytes,
    _falls,
    _pair,
    _resumed_losses,
    _tune_losses,
)

import rwkvx_c as rx
from rwkvx_c.cli import main
from rwkvx_c.errors import RwkvxWarning

from checks import portable_run
from reference import nf4

# every matrix's input size a multiple of 64 (NF4's block): the whole model in the base
CFG64 = dict(CFG, Dw=64, Da=64, Dg=64, Dv=64, ffn_dim=128)
V, C = CFG["vocab_size"], CFG["n_embd"]   # the embedding: V rows of one block each


def _rows():
    """V x C values, one block a row, each a kind of block apart"""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((V, C)).astype(np.float32)
    x[1] = 0.0
    x[2] *= 1e-30                            # tiny: 1 / absmax still finite
    x[3] = rng.standard_normal(C) * 1e-40    # a subnormal absmax: the 1e-38 clamp
    x[4] = rng.standard_normal(C) * 3e37     # huge
    x[5, :7] = 3.4e38                        # the largest float32
    x[6] = 0.3                               # all equal: level 1.0 each
    x[7] = -0.3
    x[8, 5] = -40.0                          # the largest magnitude negative
    x[9:11, 16:] = 0.0
    x[9, :15] = nf4.MIDPOINTS                # on the midpoints: the lower level
    x[9, 15] = 1.0
    x[10, :15] = np.nextafter(nf4.MIDPOINTS, np.float32(2))   # just above: the upper
    x[10, 15] = -1.0
    x[11, 3] = np.nan                        # a NaN: absmax NaN, every code 0
    x[12, 9] = np.inf                        # an infinity: absmax inf
    x[13] = -np.abs(x[13])
    x[14] = np.abs(x[14]) + 1.0
    return x


def test_the_reference_codes_the_nearest_level():
    """The midpoint rule is the nearest level (float64 distances) wherever
    the two are not tied."""
    t = np.random.default_rng(0).uniform(-1.2, 1.2, 100_000).astype(np.float32)
    d = np.abs(t.astype(np.float64)[:, None] - nf4.LEVELS.astype(np.float64))
    near = np.argmin(d, axis=1)
    assert np.array_equal(nf4.codes(t), near)
    assert np.array_equal(nf4.codes(nf4.LEVELS), np.arange(16))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nf4_blocks_are_the_references_bytes_and_decode_exactly(precision):
    x = _rows()
    want = nf4.quantize(x)
    m = rx.RxPtModel(CFG, seed=0, init=False, precision=precision)
    m.set_base("nf4", ["emb"])
    m.base_fill("emb", x)
    got = m.base_data("emb")
    assert got.shape == (V, C // 64 * 36) and m.base_bytes == V * C // 64 * 36
    for i in range(V):
        assert np.array_equal(got[i], want[i]), i
    assert np.array_equal(m.base_tensor("emb"), nf4.dequantize(want), equal_nan=True)
    assert np.array_equal(got[9, 4:12], [0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF])
    # a row of W^T, whose blocks lie along in: the key projection's
    w = np.random.default_rng(1).standard_normal((C, C)).astype(np.float32)
    p = rx.RxPtModel(CFG, seed=0, init=False, precision=precision)
    p.set_base("nf4", ["blocks.0.tm.key_w"])
    p.base_fill("blocks.0.tm.key_w", w, transposed=True)   # W^T [out, in] as given
    assert np.array_equal(p.base_data("blocks.0.tm.key_w"), nf4.quantize(w))
    assert np.array_equal(p.base_tensor("blocks.0.tm.key_w"),
                          np.ascontiguousarray(nf4.dequantize(nf4.quantize(w)).T))
    # its own stored rows go back in as they are
    p.base_fill("blocks.0.tm.key_w", nf4.quantize(w), transposed=True)
    assert np.array_equal(p.base_data("blocks.0.tm.key_w"), nf4.quantize(w))


def test_the_portable_nf4_decoder_gives_the_same_bits():
    """The bytes and the model's bits again in a process with
    RWKVX_BASE_PORTABLE=1: the decoder's scalar loop, not its AVX2 form."""
    portable_run("test_base_nf4.py", "references_bytes or float32_models_bits")


def test_nf4_blocks_are_bitsandbytes_own():
    """bitsandbytes' quantize_4bit (its CPU backend) on the finite rows:
    the same absmax, the same packed codes, the same dequantised values."""
    bnb = pytest.importorskip("bitsandbytes.functional")
    torch = pytest.importorskip("torch")
    x = np.delete(_rows(), [11, 12], axis=0)
    packed, state = bnb.quantize_4bit(torch.from_numpy(x), blocksize=64, quant_type="nf4",
                                      compress_statistics=False)
    ours = nf4.quantize(x).reshape(-1, 36)
    assert np.array_equal(ours[:, :4].copy().view("<f4").ravel(), state.absmax.numpy())
    assert np.array_equal(ours[:, 4:].ravel(), packed.numpy().ravel())
    assert np.array_equal(nf4.dequantize(nf4.quantize(x)),
                          bnb.dequantize_4bit(packed, state).numpy())
    m = rx.RxPtModel(CFG, seed=0, init=False)
    m.set_base("nf4", ["head"])
    w = np.random.default_rng(2).standard_normal((V, C)).astype(np.float32)
    m.base_fill("head", w, transposed=True)
    packed, state = bnb.quantize_4bit(torch.from_numpy(w), blocksize=64, quant_type="nf4",
                                      compress_statistics=False)
    assert np.array_equal(m.base_tensor("head").T, bnb.dequantize_4bit(packed, state).numpy())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute,chunked", [(False, False), (True, True)],
                         ids=["plain", "recompute+chunked_head"])
def test_an_nf4_base_gives_the_float32_models_bits(precision, recompute, chunked):
    ref, m, names = _pair("nf4", precision, recompute, cfg=CFG64)
    assert len(names) == len([n for n in m.param_names if m.params[n].ndim == 2])
    _assert_same_bits(ref, m, names, chunked)
    m.release_base()
    for n in names:
        assert np.array_equal(m.params[n], ref.params[n]), n


def test_sizes_that_are_not_whole_nf4_blocks_are_refused_and_the_bytes_counted():
    odd = rx.RxPtModel(CFG, seed=0, init=False)   # Dw = 32: half a block
    with pytest.raises(ValueError, match=r"w2 \[32, 64\]: NF4 needs its input size a multiple "
                                         r"of 64"):
        odd.set_base("nf4", ["blocks.0.tm.w2"])
    narrow = rx.RxPtModel(dict(CFG, n_embd=96, n_head=3, head_size=32), seed=0, init=False)
    with pytest.raises(ValueError, match=r"emb \[37, 96\]: NF4 needs its row size a multiple "
                                         r"of 64"):
        narrow.set_base("nf4", ["emb"])
    _counts_its_bytes(CFG64, "nf4", 64, 36)   # 0.5625 bytes a weight


def test_an_nf4_lora_tune_trains_resumes_bit_exact_and_exports(tmp_path, capsys):
    pth = _bf16_pth(tmp_path, H=1, N=64, Dw=64, Da=64, Dv=64, Dg=64)   # gguf: heads of 64
    kw = dict(tune="lora", steps=6, save_every=3, lr=0.02, base_dtype="nf4")
    tr, want = _tune_losses(tmp_path, pth, "a", **kw)
    assert tr.model.base_dtype == "nf4" and _falls(want), want
    r, got = _resumed_losses(tmp_path, pth, "b", **kw)
    assert r.model.base_dtype == "nf4" and got == want[3:]
    capsys.readouterr()
    # no GGUF type holds NF4: an export merges into the source's own weights
    for fmt, ext in (("rwkv7", "pth"), ("gguf", "gguf")):
        assert main(["export", str(tmp_path / "a"), "--format", fmt,
                     "--out", str(tmp_path / f"m.{ext}")]) == 0
        assert "merged into the original weights of its base" in capsys.readouterr().out


def test_nf4_from_the_command_line(tmp_path, capsys):
    pth = _bf16_pth(tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    assert main(["train", "--init-from", pth, "--tune", "lora", "--data", str(corpus),
                 "--cache-dir", str(tmp_path / "cache"), "--steps", "6", "--batch", "2",
                 "--seq-len", "16", "--eval-tokens", "32", "--lr", "0.02", "--threads", "2",
                 "--no-progress", "--base-dtype", "nf4", "--out", str(tmp_path / "c")]) == 0
    # Dw = 32: the decay LoRAs' w2 stay float32, every other matrix is held
    assert "frozen base nf4, " in capsys.readouterr().out
    # and from the run's saved config: the same tune, the same losses
    assert main(["train", "--config", str(tmp_path / "c" / "config.toml"),
                 "--out", str(tmp_path / "cfg")]) == 0
    losses = []
    for run in ("c", "cfg"):
        with open(tmp_path / run / "log.jsonl") as f:
            losses.append([r["loss"] for r in map(json.loads, f) if "loss" in r])
    assert _falls(losses[0]) and losses[0] == losses[1]


def test_a_gguf_source_is_converted_once_into_an_nf4_base(tmp_path):
    from test_gguf_in import CFG as GCFG
    from test_gguf_in import _model

    from rwkvx_c.interop import export_model
    m = rx.RxPtModel(dict(GCFG, Dw=64, Da=64, Dg=64, Dv=64), seed=6)
    path = tmp_path / "m.gguf"
    export_model(m, "gguf", str(path), "q4_0")
    with pytest.warns(RwkvxWarning, match="q4_0, not nf4: each converted once") as w:
        model, src = _model(tmp_path, path, base_dtype="nf4")
    assert len(w) == 1 and model.base_dtype == "nf4"
    rows = np.ascontiguousarray(src.weights["blocks.0.tm.key_w"].T)
    assert np.array_equal(model.base_data("blocks.0.tm.key_w"), nf4.quantize(rows))
