"""Corpora for every tokenizer (rwkvx_c.data.pipeline): JSON lines, binidx,
several paths, streaming, the token cache's rebuild rules, and val_bpb."""
import gzip
import json
import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from rwkvx_c.data import DataError, formats, load_corpus, sources
from rwkvx_c.data import cache as token_cache
from rwkvx_c.data import tokenizers as tkz


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _all_tokens(c):
    """A corpus built from few files is split by its tail: train ++ val is everything."""
    return np.concatenate([np.asarray(c.train), np.asarray(c.val)])


def _records():
    return [{"text": "first record\n", "id": 1}, {"text": "zweite Zeile ✓", "meta": {}},
            {"text": "third 😀 " * 40}, {"text": ""}]


def test_jsonl_and_gzip(tmp_path):
    recs = _records()
    lines = "\n".join(json.dumps(r) for r in recs) + "\n\n"   # a blank line is skipped
    p = tmp_path / "d.jsonl"
    p.write_text(lines)
    g = tmp_path / "d.jsonl.gz"
    g.write_bytes(gzip.compress(lines.encode()))
    want = b"".join(r["text"].encode() + b"\n" for r in recs)
    for path in (p, g):
        c = load_corpus(str(path), seq_len=16, val_fraction=0.2, cache_dir=str(tmp_path / "c"))
        assert bytes(_all_tokens(c).astype(np.uint8)) == want
        assert c.vocab_size == 256 and c.is_bytes
    # another field
    q = tmp_path / "e.jsonl"
    q.write_text("\n".join(json.dumps({"body": r["text"]}) for r in recs))
    c = load_corpus(str(q), seq_len=16, cache_dir=str(tmp_path / "c"), text_field="body")
    assert bytes(_all_tokens(c).astype(np.uint8)) == want


def test_jsonl_errors_name_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: no string field 'text'"):
        load_corpus(str(p), seq_len=4, cache_dir=str(tmp_path / "c"))
    p.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not JSON"):
        load_corpus(str(p), seq_len=4, cache_dir=str(tmp_path / "c"))
    p.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not UTF-8"):
        load_corpus(str(p), seq_len=4, cache_dir=str(tmp_path / "c"))
    g = tmp_path / "cut.jsonl.gz"
    g.write_bytes(gzip.compress(b'{"text": "abc"}\n' * 1000)[:-12])  # no trailer
    with pytest.raises(DataError, match=r"cut\.jsonl\.gz"):
        load_corpus(str(g), seq_len=4, cache_dir=str(tmp_path / "c"))


def _write_binidx(stem, docs, dtype=np.uint16, code=8, magic=b"MMIDIDX\x00\x00"):
    """A binidx pair written from the format's description: one sequence per document."""
    sizes = np.array([len(d) for d in docs], dtype="<i4")
    ptrs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype("<i8") * np.dtype(dtype).itemsize
    with open(str(stem) + ".bin", "wb") as f:
        f.writelines(np.asarray(d, dtype=dtype).tobytes() for d in docs)
    with open(str(stem) + ".idx", "wb") as f:
        f.write(magic + struct.pack("<QBQQ", 1, code, len(docs), len(docs) + 1))
        f.write(sizes.tobytes() + ptrs.tobytes() + np.arange(len(docs) + 1, dtype="<i8").tobytes())


def test_binidx(tmp_path):
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(1, 65530, n)) + [0] for n in (50, 300, 7, 1000)]
    stem = tmp_path / "corpus_text_document"
    _write_binidx(stem, docs)
    tokens, starts = formats.read_binidx(str(stem) + ".bin")
    assert np.array_equal(np.asarray(tokens), np.concatenate(docs))
    assert starts.tolist() == [0, 51, 352, 360]
    world = tkz.load("world")
    for name in ("bin", "idx"):
        c = load_corpus(f"{stem}.{name}", seq_len=32, val_fraction=0.1, tokenizer=world)
        assert isinstance(c.train, np.memmap) and not c.train.flags.writeable
        assert np.array_equal(_all_tokens(c), np.concatenate(docs))
        assert c.vocab_size == 65536 and c.token_bytes is not None
    # read as bytes (no tokenizer named) a token file keeps its own vocabulary
    c = load_corpus(f"{stem}.bin", seq_len=32)
    assert c.vocab_size == int(np.concatenate(docs).max()) + 1 and not c.is_bytes

    class Small(tkz.ByteTokenizer):   # a vocabulary smaller than the file's ids
        name, vocab_size = "small", 1000

        def identity(self):
            return {"name": "small", "sha256": None}
    with pytest.raises(DataError, match="outside the small tokenizer's vocabulary"):
        load_corpus(f"{stem}.bin", seq_len=32, tokenizer=Small())
    with pytest.raises(DataError, match="only --data path"):
        load_corpus([f"{stem}.bin", f"{stem}.bin"], seq_len=32, tokenizer=world)
    bad = tmp_path / "bad"
    _write_binidx(bad, docs, magic=b"NOTANIDX\x00")
    with pytest.raises(DataError, match="not a binidx index"):
        load_corpus(f"{bad}.bin", seq_len=32, tokenizer=world)
    _write_binidx(bad, docs, code=6)
    with pytest.raises(DataError, match="not an integer type"):
        load_corpus(f"{bad}.bin", seq_len=32, tokenizer=world)
    _write_binidx(bad, docs)
    with open(f"{bad}.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match="points past the end"):
        load_corpus(f"{bad}.bin", seq_len=32, tokenizer=world)


def test_several_paths_in_order(tmp_path):
    a = tmp_path / "a.txt"
    a.write_bytes(b"alpha " * 50)
    j = tmp_path / "b.jsonl"
    j.write_text(json.dumps({"text": "beta"}) + "\n")
    d = tmp_path / "folder"
    d.mkdir()
    (d / "c.txt").write_bytes(b"gamma " * 30)
    (d / "d.jsonl").write_text(json.dumps({"text": "delta"}) + "\n")
    c = load_corpus([str(a), str(j), str(d)], seq_len=8, cache_dir=str(tmp_path / "c"))
    assert bytes(_all_tokens(c).astype(np.uint8)) == \
        b"alpha " * 50 + b"beta\n" + b"gamma " * 30 + b"delta\n"


def test_long_documents_stream_exactly(tmp_path, monkeypatch):
    world = tkz.load("world")
    _, files = sources.stdlib_files()
    text = b"".join(_read(p) for _, p in files[:30])
    p = tmp_path / "long.txt"
    p.write_bytes(text)
    monkeypatch.setattr(formats, "PIECE_BYTES", 5000)   # many pieces, many carries
    monkeypatch.setattr(token_cache, "BATCH_BYTES", 20000)
    c = load_corpus(str(p), seq_len=64, tokenizer=world, cache_dir=str(tmp_path / "c"))
    assert np.asarray(c.train).dtype == np.uint16
    assert _all_tokens(c).tolist() == world.encode(text).tolist()


def test_cache_rebuild_rules(tmp_path, monkeypatch):
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(3):
        (d / f"{i}.txt").write_text(f"document {i} " * 100)
    (d / "x.jsonl").write_text(json.dumps({"text": "json doc"}) + "\n")
    cache = str(tmp_path / "cache")
    builds = []
    real = token_cache._build
    monkeypatch.setattr(token_cache, "_build", lambda *a: (builds.append(a[0]), real(*a))[1])
    world = tkz.load("world")

    def load(tok=None):
        return load_corpus(str(d), seq_len=16, cache_dir=cache, tokenizer=tok)

    c1 = load()
    c2 = load()                       # unchanged: reused
    assert len(builds) == 1 and c2.train.filename == c1.train.filename
    load(world)                       # another tokenizer: its own cache
    assert len(builds) == 2
    st = os.stat(d / "1.txt")
    os.utime(d / "1.txt", ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))  # mtime changed
    load()
    assert len(builds) == 3
    (d / "2.txt").write_text("changed size " * 100)                       # size changed
    c = load()
    assert len(builds) == 4 and b"changed size" in bytes(_all_tokens(c).astype(np.uint8))
    load()
    assert len(builds) == 4


def test_interrupted_pass_leaves_no_cache(tmp_path, monkeypatch):
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(4):
        (d / f"{i}.jsonl").write_text(json.dumps({"text": f"doc {i} " * 50}) + "\n")
    cache = tmp_path / "cache"
    calls = []

    def boom(self, docs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return [self.encode(x) for x in docs]

    monkeypatch.setattr(token_cache, "BATCH_BYTES", 10)       # one document per batch
    monkeypatch.setattr(tkz.ByteTokenizer, "encode_docs", boom, raising=False)
    with pytest.raises(KeyboardInterrupt):
        load_corpus(str(d), seq_len=16, cache_dir=str(cache))
    assert not any((cache / x / "meta.json").exists() for x in os.listdir(cache))
    assert not [x for x in os.listdir(cache) if ".tmp" in x]
    monkeypatch.undo()
    c = load_corpus(str(d), seq_len=16, cache_dir=str(cache))
    assert bytes(_all_tokens(c).astype(np.uint8)).count(b"doc ") == 200


def test_val_bpb_is_bits_per_byte_of_text(tmp_path):
    """Trainer.evaluate's val_bpb = sum of -log p(target) in nats /
    (ln 2 * bytes the targets decode to), recomputed here in float64."""
    pytest.importorskip("tokenizers")
    from rwkvx_c.train import Trainer, TrainOptions
    _, files = sources.stdlib_files()
    docs = [_read(p) for _, p in files[:30]]
    tj = str(tmp_path / "tok.json")
    tok = tkz.train_bpe(iter(docs), 300, tj, progress=False)
    data = tmp_path / "data.txt"
    data.write_bytes(b"".join(docs))
    tr = Trainer(TrainOptions(preset="tiny", steps=2, data=str(data), tokenizer=tj, seq_len=32,
                              batch=2, eval_tokens=256, cache_dir=str(tmp_path / "c")),
                 str(tmp_path / "run"))
    assert tr.model.config["vocab_size"] == 300
    tr.step()
    got = tr.evaluate()
    nats, nbytes = 0.0, 0
    for x, y in zip(tr.val_x, tr.val_y):
        z = tr.model.forward(np.ascontiguousarray(x[None])).astype(np.float64)[0]
        m = z.max(axis=1, keepdims=True)
        logp = z - m - np.log(np.exp(z - m).sum(axis=1, keepdims=True))
        nats -= logp[np.arange(len(y)), y].sum()
        nbytes += len(tok.decode(y))
    assert nbytes > 1.5 * tr.val_y.size                 # BPE tokens hold several bytes
    assert got["val_bpb"] == pytest.approx(nats / (math.log(2) * nbytes), rel=1e-5)
    assert got["val_loss"] == pytest.approx(nats / tr.val_y.size, rel=1e-5)
    # the run keeps its tokenizer: resume and sampling work without the original file
    tr.save()
    os.unlink(tj)
    tr2 = Trainer.resume(str(tmp_path / "run"), steps=3)
    assert tr2.tokenizer.identity() == tok.identity()
    from rwkvx_c.sample import generate, load_run
    model, t2 = load_run(str(tmp_path / "run"))
    assert t2.identity() == tok.identity()
    assert "".join(generate(model, "def ", 5, tokenizer=t2))
    from rwkvx_c.train import TrainError
    with pytest.raises(TrainError, match="trained with tokenizer hf"):
        Trainer.resume(str(tmp_path / "run"), tokenizer="byte")


def test_cli_tokenizer_train_then_train_sample_resume(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    from rwkvx_c.cli import main
    d = tmp_path / "docs"
    d.mkdir()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "(x)", "\n", "    "]
    for i in range(12):
        (d / f"{i}.txt").write_text(" ".join(rng.choice(words, 3000)))
    (d / "r.jsonl").write_text(json.dumps({"text": "gamma delta " * 200}) + "\n")
    tj = str(tmp_path / "tok.json")
    assert main(["tokenizer", "train", str(d), "--vocab-size", "300", "--out", tj,
                 "--no-progress"]) == 0
    out = str(tmp_path / "run")
    fast = ["--preset", "tiny", "--seq-len", "32", "--batch", "2", "--eval-tokens", "64",
            "--threads", "2", "--no-progress", "--cache-dir", str(tmp_path / "c")]
    assert main(["train", "--data", str(d), "--tokenizer", tj, "--out", out,
                 "--steps", "2"] + fast) == 0
    text = capsys.readouterr().out
    assert "tokens hf, vocab 300" in text and "val_bpb" in text
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    assert main(["sample", out, "--prompt", "def ", "--max-new-tokens", "5"]) == 0
    capsys.readouterr()
    rc = main(["train", "--resume", "--out", out, "--steps", "3", "--tokenizer", "byte"] + fast)
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "tokenizer" in err, err
    rc = main(["train", "--tokenizer", "nope", "--out", str(tmp_path / "r2")] + fast)
    err = capsys.readouterr().err
    assert rc == 1 and "unknown tokenizer 'nope'" in err and "Traceback" not in err


def _dead_and_live_pids():
    """A PID whose process has exited and a running child's (which the caller must stop)."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return done.pid, live


def test_killed_writers_temporaries_are_swept(tmp_path):
    """A tokenising pass or concatenation killed mid-write leaves NAME.tmpPID
    behind; the next load removes those of dead PIDs and leaves a live
    (concurrent) writer's alone."""
    dead, live = _dead_and_live_pids()
    try:
        docs, texts = tmp_path / "docs", tmp_path / "texts"
        docs.mkdir()
        texts.mkdir()
        for i in range(3):
            (docs / f"{i}.jsonl").write_text(json.dumps({"text": f"doc {i} " * 50}) + "\n")
            (texts / f"{i}.txt").write_text(f"text {i} " * 50)
        cache = tmp_path / "cache"
        cache.mkdir()
        orphan, busy = cache / f"tok-0123.tmp{dead}", cache / f"tok-4567.tmp{live.pid}"
        for d in (orphan, busy):
            d.mkdir()
            (d / "train.tok").write_bytes(b"\0" * 10)
        load_corpus(str(docs / "0.jsonl"), seq_len=16, cache_dir=str(cache))
        assert not orphan.exists() and (busy / "train.tok").exists()

        # the files written inside a keyed folder after it is built (all.tok)
        before = set(cache.iterdir())
        load_corpus(str(texts), seq_len=16, cache_dir=str(cache))
        (keyed,) = set(cache.iterdir()) - before
        stale, writing = keyed / f".all.tok.tmp{dead}", keyed / f".all.tok.tmp{live.pid}"
        stale.write_bytes(b"x")
        writing.write_bytes(b"x")
        load_corpus(str(texts), seq_len=16, cache_dir=str(cache))
        assert not stale.exists() and writing.exists()
    finally:
        live.kill()
        live.wait()
