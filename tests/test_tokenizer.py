"""Tokenizers (rwkvx_c/data/tokenizers.py, csrc/tokenize.c): World ids against the
rwkv package's TRIE_TOKENIZER, round trips, BPE fitting, run identity."""
import os

import numpy as np
import pytest

from rwkvx_c.data import stdlib_files
from rwkvx_c.data import tokenizers as tkz

rwkv_tok = pytest.importorskip("rwkv.rwkv_tokenizer", reason="needs the rwkv package")


@pytest.fixture(scope="module")
def world():
    return tkz.load("world")


@pytest.fixture(scope="module")
def ref(world):
    return rwkv_tok.TRIE_TOKENIZER(world.path)


def _texts():
    rng = np.random.default_rng(0)
    out = [b"", b"a", b"hello world", b"\r\n", b"line\r\n\r\nnext\r\n", b"\n\n\n\n  \t\t ",
           "😀👍🏽👨‍👩‍👧 emoji".encode(), "中文 日本語 한국어 русский العربية हिन्दी".encode(),
           "mixed: naïve café — “quotes” ½ ∑ 𝔘𝔫𝔦".encode(),  # noqa: RUF001 -- 4-byte UTF-8
           b"\xff\xfe\x80 invalid \xc3 utf-8 \xed\xa0\x80 \xf4\x90\x80\x80",
           bytes(range(256)), bytes(range(256))[::-1] * 3, b"=" * 3000, b" " * 5000,
           b"\x00" * 100]
    out += [rng.integers(0, 256, rng.integers(1, 200)).astype(np.uint8).tobytes()
            for _ in range(100)]
    _, files = stdlib_files()
    for i in rng.choice(len(files), 20, replace=False):
        with open(files[i][1], "rb") as f:
            out.append(f.read(20000))
    return out


def test_world_ids_match_rwkv(world, ref):
    for t in _texts():
        ids = world.encode(t)
        assert ids.dtype == np.int32
        assert ids.tolist() == ref.encodeBytes(t), t[:60]
    s = "def f(x):\r\n    return '✓' + x  # 😀\n"
    assert world.encode(s).tolist() == ref.encode(s)


def test_world_threads_and_seams_are_exact(world, ref):
    # > 64 KiB per thread, so the text is split and the seams repaired;
    # long runs of one byte make the speculative encodings start out of step
    rng = np.random.default_rng(1)
    texts = _texts()
    parts = [texts[i] for i in rng.integers(0, len(texts), 120)] + [b"-" * 70000, b"ab" * 40000]
    rng.shuffle(parts)
    big = b"".join(parts)
    want = ref.encodeBytes(big)
    for th in (1, 2, 3, 7):
        world.threads = th
        try:
            assert world.encode(big).tolist() == want, th
        finally:
            world.threads = None


def test_world_streaming_pieces_and_docs(world):
    texts = _texts()
    big = b"".join(texts)
    want = world.encode(big).tolist()
    got, data, pos = [], b"", 0
    for step in (1000, 7, 128, 129, 4096, 100000):  # pieces of varied size, carry kept
        chunk = big[pos:pos + step]
        pos += step
        ids, used = world.encode_piece(data + chunk, pos >= len(big))
        got += ids.tolist()
        data = (data + chunk)[used:]
    ids, used = world.encode_piece(data + big[pos:], True)
    got += ids.tolist()
    assert got == want
    per_doc = world.encode_docs(texts)
    assert [d.tolist() for d in per_doc] == [world.encode(t).tolist() for t in texts]


@pytest.mark.parametrize("name", ["byte", "world"])
def test_round_trip_is_exact(name):
    tok = tkz.load(name)
    for t in _texts():
        assert tok.decode(tok.encode(t)) == t
    lens = tok.token_lengths()
    ids = tok.encode(b"".join(_texts()[:30]))
    assert int(lens[ids].sum()) == len(tok.decode(ids))


def test_world_vocab_facts(world):
    assert world.vocab_size == 65536
    lens = world.token_lengths()
    assert lens[0] == 0 and (lens[1:65530] > 0).all() and (lens[65530:] == 0).all()
    assert world.identity()["name"] == "world" and len(world.identity()["sha256"]) == 64
    assert world.decode([0]) == b""
    with pytest.raises(tkz.TokenizerError):
        world.decode([65536])


def test_byte_trie_rejects_incomplete_vocab():
    from rwkvx_c._core import ByteTrie
    with pytest.raises(ValueError, match="256"):
        ByteTrie([(bytes([i]), i) for i in range(255)] + [(b"ab", 300)], 400)
    with pytest.raises(ValueError):
        ByteTrie([(bytes([i]), i) for i in range(256)] + [(b"ab", 300)], 300)  # id out of range
    t = ByteTrie([(bytes([i]), i) for i in range(256)] + [(b"ab", 256), (b"abc", 257),
                                                          (b"abcd", 258)], 259)
    # greedy longest match: "abcd" then "ab", then "a" when "abc" is cut short
    assert t.encode(b"abcdaba").tolist() == [258, 256, ord("a")]


def test_bpe_train_and_use(tmp_path):
    pytest.importorskip("tokenizers")
    _, files = stdlib_files()
    docs = []
    for _, p in files[:40]:
        with open(p, "rb") as f:
            docs.append(f.read())
    out = str(tmp_path / "tok.json")
    tok = tkz.train_bpe(iter(docs), 400, out, progress=False)
    assert os.path.isfile(out) and tok.vocab_size == 400
    loaded = tkz.load(out)
    assert loaded.identity() == tok.identity()
    text = docs[0] + "ünïcödé ✓ 😀\r\n".encode()
    ids = loaded.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 400
    assert len(ids) < 0.7 * len(text)          # merges were learnt
    assert loaded.decode(ids) == text
    assert int(loaded.token_lengths()[ids].sum()) == len(text)
    assert [d.tolist() for d in loaded.encode_docs(docs[:3])] == \
        [loaded.encode(d).tolist() for d in docs[:3]]


def test_load_errors(tmp_path):
    with pytest.raises(tkz.TokenizerError, match="unknown tokenizer"):
        tkz.load("no-such-tokenizer")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    pytest.importorskip("tokenizers")
    with pytest.raises(tkz.TokenizerError, match="not a tokenizers"):
        tkz.load(str(bad))


def test_run_identity_checks(tmp_path, world):
    tkz.check_identity(world, world.identity(), "run")
    with pytest.raises(tkz.TokenizerError, match="trained with tokenizer byte"):
        tkz.check_identity(world, None, "the run")
    with pytest.raises(tkz.TokenizerError, match="missing"):
        tkz.run_tokenizer(str(tmp_path), {"name": "hf", "sha256": "0" * 64})
    bad = dict(world.identity(), sha256="0" * 64)
    with pytest.raises(tkz.TokenizerError, match="trained with tokenizer world"):
        tkz.run_tokenizer(str(tmp_path), bad)
