"""Checkpoint files (rwkvx_c/run/checkpoint.py): round trip, safetensors
compatibility, atomic writes, and clear errors on damaged files."""
import os
from pathlib import Path

import numpy as np
import pytest

from rwkvx_c.run.checkpoint import CheckpointError, read_checkpoint, save_checkpoint


def _tensors():
    g = np.random.default_rng(0)
    return {"emb": g.standard_normal((7, 5)).astype(np.float32),
            "blocks.0.ln1_w": g.standard_normal(5).astype(np.float32),
            "optim.m": g.standard_normal(40).astype(np.float32)}


def test_round_trip(tmp_path):
    p = str(tmp_path / "c.safetensors")
    t = _tensors()
    cfg = {"n_embd": 5, "vocab_size": 7}
    state = {"step": 12, "sampler": {"state": 2 ** 100}}
    save_checkpoint(p, t, cfg, state)
    got, c2, s2 = read_checkpoint(p)
    assert c2 == cfg and s2 == state
    assert list(got) == list(t)
    for k in t:
        np.testing.assert_array_equal(got[k], t[k])
        assert got[k].dtype == np.float32
    assert not [f for f in os.listdir(tmp_path) if f != "c.safetensors"]  # no temp left


def test_readable_by_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    from safetensors import safe_open
    p = str(tmp_path / "c.safetensors")
    t = _tensors()
    save_checkpoint(p, t, {"a": 1}, {"b": 2})
    got = st.load_file(p)
    for k in t:
        np.testing.assert_array_equal(got[k], t[k])
    with safe_open(p, framework="np") as f:
        assert f.metadata()["format"] == "rwkvx_c.checkpoint"


def test_overwrite_is_atomic_on_failure(tmp_path):
    p = str(tmp_path / "c.safetensors")
    save_checkpoint(p, _tensors(), {}, {"step": 1})
    before = Path(p).read_bytes()
    bad = {"x": np.zeros(3, np.float64)}
    with pytest.raises(TypeError):
        save_checkpoint(p, bad, {}, {"step": 2})
    assert Path(p).read_bytes() == before
    assert os.listdir(tmp_path) == ["c.safetensors"]


@pytest.mark.parametrize("cut", [0, 5, 8, 40, -1, -100])
def test_truncated(tmp_path, cut):
    p = str(tmp_path / "c.safetensors")
    save_checkpoint(p, _tensors(), {}, {})
    blob = Path(p).read_bytes()
    Path(p).write_bytes(blob[:cut] if cut >= 0 else blob[:len(blob) + cut])
    with pytest.raises(CheckpointError, match=r"truncated|corrupt"):
        read_checkpoint(p)


def test_corrupt(tmp_path):
    p = str(tmp_path / "c.safetensors")
    save_checkpoint(p, _tensors(), {}, {})
    blob = bytearray(Path(p).read_bytes())
    flipped = blob.copy()
    flipped[-17] ^= 0x40  # one bit of tensor data
    Path(p).write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="checksum"):
        read_checkpoint(p)
    garbled = blob.copy()
    garbled[12:20] = b"\xff" * 8  # inside the JSON header
    Path(p).write_bytes(bytes(garbled))
    with pytest.raises(CheckpointError, match="corrupt"):
        read_checkpoint(p)
    Path(p).write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match=r"corrupt|truncated"):
        read_checkpoint(p)
    Path(p).write_bytes(bytes(blob) + b"extra")
    with pytest.raises(CheckpointError, match="after the last tensor"):
        read_checkpoint(p)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        read_checkpoint(str(tmp_path / "missing.safetensors"))


def test_foreign_safetensors_rejected(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    p = str(tmp_path / "other.safetensors")
    st.save_file({"w": np.ones(3, np.float32)}, p)
    with pytest.raises(CheckpointError, match="not an rwkvx_c checkpoint"):
        read_checkpoint(p)


def test_a_mapped_tensor_copies_a_span_at_a_time(tmp_path, monkeypatch):
    """copy_into copies a tensor MAP_SPAN bytes at a time (the span made
    small here: many spans, a ragged last one) to the same values, into a
    contiguous array or, whole, into a strided view; a checksum read of
    that many spans still finds a flipped bit."""
    import rwkvx_c.run.checkpoint as ck
    monkeypatch.setattr(ck, "MAP_SPAN", 4096)
    rng = np.random.default_rng(1)
    t = {"m": rng.standard_normal(10_007).astype(np.float32),
         "w": rng.standard_normal((33, 65)).astype(np.float32)}
    p = str(tmp_path / "c.safetensors")
    save_checkpoint(p, t, {"n": 1}, {"step": 1})
    got, _, _ = read_checkpoint(p)
    for name, want in t.items():
        out = np.full(want.shape, np.nan, np.float32)
        got.copy_into(name, out)
        assert np.array_equal(out, want)
    strided = np.full((33, 130), np.nan, np.float32)
    got.copy_into("w", strided[:, ::2])
    assert np.array_equal(strided[:, ::2], t["w"]) and np.isnan(strided[:, 1::2]).all()
    blob = bytearray(Path(p).read_bytes())
    blob[-5] ^= 0x10
    Path(p).write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="checksum"):
        read_checkpoint(p)
