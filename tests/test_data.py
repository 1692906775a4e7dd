"""Corpora, the byte tokenizer and the seeded batch sampler (rwkvx_c.data)."""
import json
import os

import numpy as np
import pytest

from rwkvx_c.data import (
    BatchSampler,
    ByteTokenizer,
    DataError,
    eval_windows,
    is_val_file,
    load_corpus,
    stdlib_files,
)


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    s = "héllo wörld ✓\n"
    ids = tok.encode(s)
    assert ids.dtype == np.int32 and ids.max() < 256
    assert len(ids) == len(s.encode())
    assert tok.decode(ids) == s.encode()
    assert tok.decode([0xE2, 0x9C]) == b"\xe2\x9c"  # cut UTF-8: the bytes as they are


def test_default_corpus_split_by_file(tmp_path):
    c = load_corpus(cache_dir=str(tmp_path), seq_len=64)
    _root, files = stdlib_files()
    assert all("site-packages" not in rel for rel, _ in files)
    val_files = [p for rel, p in files if is_val_file(rel)]
    train_files = [p for rel, p in files if not is_val_file(rel)]
    assert 0 < len(val_files) < len(files) // 10
    assert len(c.val) == sum(os.path.getsize(p) for p in val_files)
    assert len(c.train) == sum(os.path.getsize(p) for p in train_files)
    assert isinstance(c.train, np.memmap) and c.train.dtype == np.uint8
    assert c.vocab_size == 256 and c.is_bytes
    # the val split starts with the first validation file's bytes
    with open(val_files[0], "rb") as f:
        head = f.read(100)
    assert bytes(c.val[:len(head)]) == head
    # cached: a second load maps the same files
    c2 = load_corpus(cache_dir=str(tmp_path), seq_len=64)
    assert c2.train.filename == c.train.filename


def test_text_file_tail_split(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(bytes(range(256)) * 40)
    c = load_corpus(str(p), seq_len=16, val_fraction=0.1)
    assert len(c.train) + len(c.val) == 256 * 40
    assert len(c.val) == 1024
    assert bytes(c.val[:4]) == bytes(c.train[:4])  # 9216 % 256 == 0
    assert c.is_bytes


def test_folder_with_few_files_falls_back_to_tail(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("alpha " * 500)
    (d / "sub" / "b.md").write_text("beta " * 500)
    (d / ".hidden").write_text("x" * 10000)
    (d / "blob.bin").write_bytes(b"\0\1\2" * 100)
    c = load_corpus(str(d), seq_len=32, cache_dir=str(tmp_path / "cache"))
    assert len(c.train) + len(c.val) == 3000 + 2500
    assert b"\0" not in bytes(c.train) + bytes(c.val)


def test_bin_token_files(tmp_path):
    toks = (np.arange(5000) % 1000).astype(np.uint16)
    p = tmp_path / "data.u16.bin"
    toks.tofile(p)
    c = load_corpus(str(p), seq_len=32)
    assert c.vocab_size == 1000 and not c.is_bytes
    assert c.train.dtype == np.uint16 and isinstance(c.train, np.memmap)
    assert len(c.train) + len(c.val) == 5000
    q = tmp_path / "plain.bin"
    toks.astype(np.uint32).tofile(q)
    (tmp_path / "plain.bin.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 4096}))
    c = load_corpus(str(q), seq_len=32)
    assert c.vocab_size == 4096 and c.train.dtype == np.uint32


def test_bad_corpora(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "small.txt").write_bytes(b"abc" * 10)
    with pytest.raises(DataError, match="too few"):
        load_corpus(str(tmp_path / "small.txt"), seq_len=64)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(DataError, match=r"no text, \.jsonl, \.parquet or \.arrow files"):
        load_corpus(str(tmp_path / "emptydir"))
    (tmp_path / "x.bin").write_bytes(b"\0" * 100)
    with pytest.raises(DataError, match="dtype"):
        load_corpus(str(tmp_path / "x.bin"))
    (tmp_path / "odd.u16.bin").write_bytes(b"\0" * 101)
    with pytest.raises(DataError, match="multiple"):
        load_corpus(str(tmp_path / "odd.u16.bin"))


@pytest.mark.parametrize("sidecar,match", [
    (b'["uint16"]', "not a JSON object"),
    (b'{"dtype": "float32"}', "dtype 'float32' is not"),
    (b'{"dtype": 16}', "dtype 16 is not"),
    (b'{"dtype": "uint16", "vocab_size": true}', "vocab_size True is not"),
    (b'{"dtype": "uint16", "vocab_size": NaN}', "vocab_size nan is not"),
    (b'{"dtype": "uint16", "vocab_size": -5}', "vocab_size -5 is not"),
    (b'{"dtype": "uint16", "vocab_size": 100}', "token id 999, but its sidecar's vocab_size is 1"),
    (b'{"dtype": "uint\xff16"}', "cannot read token sidecar"),
])
def test_bad_token_sidecar(tmp_path, sidecar, match):
    p = tmp_path / "t.bin"
    (np.arange(5000) % 1000).astype(np.uint16).tofile(p)
    (tmp_path / "t.bin.json").write_bytes(sidecar)
    with pytest.raises(DataError, match=match):
        load_corpus(str(p), seq_len=32)


def test_sampler_windows_and_state():
    tokens = np.arange(10000, dtype=np.uint16) % 256
    s = BatchSampler(tokens, 4, 16, seed=7)
    x, y = s.next()
    assert x.shape == (4, 16) and x.dtype == np.int32 and x.flags.c_contiguous
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    np.testing.assert_array_equal((x[:, 0] + 1) % 256, y[:, 0])
    st = s.state()
    json.dumps(st)  # checkpointable as JSON
    a = [s.next() for _ in range(3)]
    s2 = BatchSampler(tokens, 4, 16, seed=123)
    s2.set_state(json.loads(json.dumps(st)))
    b = [s2.next() for _ in range(3)]
    for (xa, ya), (xb, yb) in zip(a, b):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
    assert s2.batches == s.batches == 4
    # same seed, same stream; another seed, another
    x3, _ = BatchSampler(tokens, 4, 16, seed=7).next()
    np.testing.assert_array_equal(x3, x)


def test_eval_windows_fixed():
    tokens = np.arange(1000, dtype=np.uint8)
    x, y = eval_windows(tokens, 10, 5)
    x2, _ = eval_windows(tokens, 10, 5)
    np.testing.assert_array_equal(x, x2)
    assert x.shape == (5, 10) and x[0, 0] == 0 and y[-1, -1] == tokens[-1]
