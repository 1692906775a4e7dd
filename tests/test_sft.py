"""Chat / instruction data (docs/finetune.md §Chat data): the rendering of
both record kinds, the masks of the assistant tokens (in the cache, read
back by a second run), no counted target across a separator, one line per
bad record naming file:line, the masked loss and its gradients against the
float64 reference, val_loss / val_bpb over the masked tokens, and a run
whose loss falls and resumes bit for bit."""
import gzip
import json
import math
import os
import re

import numpy as np
import pytest
from test_train import SMALL, _opts

import rwkvx_c as rx
from rwkvx_c.cli import main
from rwkvx_c.data import cache as cache_mod
from rwkvx_c.data.chat import IGNORE, SEPARATOR, render, segments
from rwkvx_c.data.pipeline import load_corpus
from rwkvx_c.data.sampler import BatchSampler, conversation_starts, eval_starts
from rwkvx_c.data.tokenizers import load as load_tokenizer
from rwkvx_c.errors import DataError, TokenizerError
from rwkvx_c.train import Trainer

from checks import FWD_TOL, GRAD_TOL, assert_rel
from reference.chat import masked_cross_entropy, masked_model_loss, windows
from reference.model import leaves

HERE = os.path.dirname(__file__)
CHAT = os.path.join(HERE, "data", "chat.jsonl")
RWKV = dict(SMALL, n_attn_layer=0)


def _records():
    with open(CHAT, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_rendering_of_both_record_kinds():
    rec = {"messages": [{"role": "system", "content": " Be terse. "},
                        {"role": "user", "content": "Hi\r\n\r\nthere"},
                        {"role": "assistant", "content": "Hello.\n\n\nBye."},
                        {"role": "user", "content": "Again"},
                        {"role": "assistant", "content": "Hello\ragain."}]}
    assert segments(rec, "x") == [
        ("System: Be terse.\n\nUser: Hi\nthere\n\nAssistant:", False),
        (" Hello.\nBye.\n\n", True),
        ("User: Again\n\nAssistant:", False),
        (" Hello\nagain.\n\n", True)]
    assert render(rec) == ("System: Be terse.\n\nUser: Hi\nthere\n\nAssistant: Hello.\nBye.\n\n"
                           "User: Again\n\nAssistant: Hello\nagain.\n\n")
    pr = {"prompt": "What is 2 plus 3?", "response": "5."}
    assert render(pr) == "User: What is 2 plus 3?\n\nAssistant: 5.\n\n"
    assert segments(dict(pr, system="Count."), "x")[0] == (
        "System: Count.\n\nUser: What is 2 plus 3?\n\nAssistant:", False)
    # turns after the last assistant turn are context without a target
    tail = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": "c"}]}
    assert segments(tail, "x")[-1] == ("User: c\n\n", False)


def _corpus(tmp_path, tokenizer=None, seq_len=32):
    return load_corpus(CHAT, seq_len=seq_len, cache_dir=str(tmp_path / "cache"),
                       tokenizer=tokenizer)


def _conversations(tokens, mask):
    """(ids, mask) of each conversation of a packed split, cut at the separators."""
    ends = np.flatnonzero(np.asarray(tokens) == SEPARATOR)
    out, lo = [], 0
    for e in ends:
        out.append((np.asarray(tokens[lo:e]), np.asarray(mask[lo:e + 1])))
        lo = e + 1
    return out


@pytest.mark.parametrize("tokenizer", ["byte", "world"])
def test_masks_are_the_assistant_turns_and_come_from_the_cache(tmp_path, monkeypatch, tokenizer):
    try:
        tok = load_tokenizer(tokenizer)
    except TokenizerError as e:   # the world extra is not installed
        pytest.skip(str(e))
    c = _corpus(tmp_path, tok)
    assert c.train_mask is not None and "chat: 33 conversations" in c.description
    tokens = np.concatenate([c.train, c.val])
    mask = np.concatenate([c.train_mask, c.val_mask])
    convs = _conversations(tokens, mask)
    recs = _records()
    assert len(convs) == len(recs)
    for (ids, m), rec in zip(convs, recs):
        assert m[-1] == 0 and m[0] == 0          # the separator and the first token
        assert tok.decode(ids) == render(rec).encode()
        want = "".join(t for t, trained in segments(rec, "r") if trained)
        assert tok.decode(ids[m[:-1] == 1]) == want.encode()
    # a second load reads tokens and masks from the cache: no pass runs
    monkeypatch.setattr(cache_mod, "_build", lambda *a: pytest.fail("the cache was rebuilt"))
    again = _corpus(tmp_path, tok)
    assert np.array_equal(again.train_mask, c.train_mask) and again.description == c.description


def test_a_gzipped_chat_file_is_chat_data_too(tmp_path):
    gz = tmp_path / "chat.jsonl.gz"
    with open(CHAT, "rb") as f:
        gz.write_bytes(gzip.compress(f.read()))
    a = _corpus(tmp_path)
    b = load_corpus(str(gz), seq_len=32, cache_dir=str(tmp_path / "cache"))
    assert b.train_mask is not None
    for x, y in ((a.train, b.train), (a.train_mask, b.train_mask), (a.val_mask, b.val_mask)):
        assert np.array_equal(x, y)


def test_no_counted_target_crosses_a_separator(tmp_path):
    c = _corpus(tmp_path)
    s = BatchSampler(c.train, 8, 32, seed=3, mask=c.train_mask)
    seen = 0
    for _ in range(40):
        x, y = s.next()
        counted = y != IGNORE
        # input and target are neighbours: neither a separator means one conversation
        assert not np.any(counted & (x == SEPARATOR)) and not np.any(counted & (y == SEPARATOR))
        seen += int(counted.sum())
    assert seen > 0
    # and the targets the sampler counts are exactly the reference's
    rng = np.random.Generator(np.random.PCG64(5))
    starts = rng.integers(0, len(c.train) - 32, size=4)
    x, y = BatchSampler(c.train, 4, 32, seed=5, mask=c.train_mask).next()
    rx_, ry, rk = windows(c.train, c.train_mask, starts, 32)
    assert np.array_equal(x, rx_) and np.array_equal(y, np.where(rk, ry, IGNORE))
    # aligned (a state tune's), every window starts a conversation (the split's
    # first token or one after a separator) and holds an assistant token
    T = 64
    conv = [o for o in [0] + [i + 1 for i in range(len(c.train) - T - 1)
                              if c.train[i] == SEPARATOR]
            if o + T + 1 <= len(c.train) and c.train_mask[o + 1:o + T + 1].any()]
    assert 0 < len(conv) < np.count_nonzero(c.train[:-T - 1] == SEPARATOR)
    rng = np.random.Generator(np.random.PCG64(5))
    starts = np.array(conv)[rng.integers(0, len(conv), size=4)]
    x, y = BatchSampler(c.train, 4, T, seed=5, mask=c.train_mask, aligned=True).next()
    rx_, ry, rk = windows(c.train, c.train_mask, starts, T)
    assert np.array_equal(x, rx_) and np.array_equal(y, np.where(rk, ry, IGNORE))
    conv = conversation_starts(c.train, c.train_mask, T)   # eval's: never overlapping
    ev = eval_starts(len(c.train), T, 100, conv)
    assert len(ev) > 2
    assert np.all(np.diff(ev) >= 64) and set(ev.tolist()) <= set(conv.tolist())
    with pytest.raises(DataError, match="raise --seq-len"):
        BatchSampler(c.train, 4, 8, seed=5, mask=c.train_mask, aligned=True)


BAD = [
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant"', "not JSON"),
    ('{"messages": [{"role": "bot", "content": "a"}]}', "role 'bot'"),
    ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "b"}]}',
     "no text content"),
    ('{"messages": [{"role": "user", "content": "a"}]}', "no assistant turn"),
    ('{"messages": []}', "non-empty list"),
    ('{"prompt": "a", "response": 3}', "no text content"),
    ('{"text": "plain"}', "not a chat record"),
    ('{"prompt": "a\\u0000b", "response": "c"}', "encodes to id 0"),
]


@pytest.mark.parametrize("line,why", BAD)
def test_a_bad_record_is_one_line_naming_file_and_line(tmp_path, line, why):
    p = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "p", "response": "r"})
    p.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(DataError, match=f"^{p}:3: .*{why}") as e:
        load_corpus(str(p), seq_len=4, cache_dir=str(tmp_path / "cache"))
    assert "\n" not in str(e.value)


def test_a_corpus_mixing_chat_and_text_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text(json.dumps({"prompt": "p", "response": "r"}) + "\n")
    (tmp_path / "d" / "b.txt").write_text("plain text " * 20)
    with pytest.raises(DataError, match="mixes chat records"):
        load_corpus(str(tmp_path / "d"), seq_len=4, cache_dir=str(tmp_path / "cache"))


def test_masked_loss_and_grads_equal_the_float64_reference(tmp_path):
    c = _corpus(tmp_path, seq_len=17)
    cfg = dict(RWKV, n_rwkv_layer=2)
    m = rx.RxPtModel(cfg, seed=4)
    s = BatchSampler(c.train, 3, 17, seed=1, mask=c.train_mask)
    x, y = s.next()
    assert 0 < np.count_nonzero(y != IGNORE) < y.size
    logits = m.forward(x)
    loss = m.backward(y, IGNORE)
    trained = y != IGNORE
    tgt = np.where(trained, y, 0)
    # from the model's own logits, and through the whole float64 model
    ref_head = masked_cross_entropy(logits.reshape(-1, cfg["vocab_size"]), tgt, trained).value
    assert_rel("sft.loss_from_logits", loss, ref_head, FWD_TOL)
    lv = leaves({n: v.copy() for n, v in m.params.items()})
    ref = masked_model_loss(lv, m.config, x, tgt, trained)
    ref.backward()
    assert_rel("sft.loss", loss, ref.value, FWD_TOL)
    for n in m.param_names:
        g = lv[n].grad if lv[n].grad is not None else np.zeros(lv[n].shape)
        assert_rel(f"sft.grad.{n}", m.grads[n], g, GRAD_TOL)
    # an unmasked target changes the loss: the mask is what is applied
    assert abs(m.backward(np.where(trained, y, 1).astype(np.int32), IGNORE) - loss) > 1e-3


def test_val_loss_and_bpb_are_over_the_masked_tokens(tmp_path):
    tr = Trainer(_opts(tmp_path, data=CHAT, model=dict(RWKV), seq_len=32, eval_tokens=256))
    c = tr.corpus
    ev = tr.evaluate()
    starts = eval_starts(len(c.val), 32, 256 // 32)
    x, y, k = windows(c.val, c.val_mask, starts, 32)
    assert np.array_equal(tr.val_x, x)
    total = 0.0
    for b in range(len(x)):
        logits = tr.model.forward(np.ascontiguousarray(x[b:b + 1]).astype(np.int32))
        total += masked_cross_entropy(logits.reshape(-1, 256), y[b], k[b]).value * k[b].sum()
    assert tr.val_bytes == int(k.sum())       # bytes: one per counted target
    assert abs(ev["val_loss"] - total / k.sum()) <= 1e-5 * ev["val_loss"]
    assert ev["val_bpb"] == pytest.approx(ev["val_loss"] / math.log(2), rel=1e-12)


def test_sft_run_loss_falls_and_resumes_bit_exact(tmp_path):
    kw = dict(data=CHAT, model=dict(RWKV), seq_len=32, batch=4, steps=8, lr=1e-2,
              eval_tokens=256, save_every=4)
    tr = Trainer(_opts(tmp_path, **kw), str(tmp_path / "a"))
    val0 = tr.evaluate()["val_loss"]
    rows = []
    assert tr.run(on_step=rows.append)["val_loss"] < val0
    losses = [r["loss"] for r in rows if "loss" in r]
    b = Trainer(_opts(tmp_path, **kw), str(tmp_path / "b"))
    b.run(stop=lambda: b.step_count >= 4)
    r = Trainer.resume(str(tmp_path / "b"))
    again = []
    r.run(on_step=again.append)
    assert [x["loss"] for x in again if "loss" in x] == losses[4:]
    assert np.array_equal(r.model.param_buffer, tr.model.param_buffer)


def test_eval_scores_the_assistant_tokens_as_the_trainer(tmp_path, capsys):
    """rwkvx-c eval of a chat run: --split val repeats the run's logged
    val_loss / val_bpb; --split all scores the assistant tokens alone."""
    out = str(tmp_path / "run")
    assert main(["train", "--preset", "tiny", "--n-attn-layer", "0", "--steps", "3",
                 "--seq-len", "32", "--batch", "2", "--eval-tokens", "64", "--threads", "1",
                 "--precision", "fp32", "--data", CHAT, "--out", out,
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    with open(os.path.join(out, "log.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    last = [r for r in rows if "val_loss" in r][-1]
    capsys.readouterr()
    assert main(["eval", out, "--split", "val", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["data"]
    assert got["loss"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert got["bpb"] == pytest.approx(last["val_bpb"], rel=1e-6)
    assert main(["eval", out, "--data", CHAT, "--json"]) == 0
    every = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["data"]
    c = _corpus(tmp_path)
    assert every["tokens"] == every["bytes"] == int(c.train_mask[1:].sum() + c.val_mask[1:].sum())


def test_the_tokens_are_what_the_rwkv_package_feeds_a_chat(tmp_path):
    """Each conversation's ids are the rwkv package's TRIE_TOKENIZER ids of
    API_DEMO_CHAT's pieces: "User: " + msg + "\\n\\nAssistant:" (msg stripped,
    newline runs made one) as the prompt, the reply as it is generated."""
    rwkv_tok = pytest.importorskip("rwkv.rwkv_tokenizer", reason="needs the rwkv package")
    try:
        tok = load_tokenizer("world")
    except TokenizerError as e:
        pytest.skip(str(e))
    trie = rwkv_tok.TRIE_TOKENIZER(tok.path)
    c = _corpus(tmp_path, tok)
    convs = _conversations(np.concatenate([c.train, c.val]),
                           np.concatenate([c.train_mask, c.val_mask]))
    demo = 0
    for (ids, _), rec in zip(convs, _records()):
        msgs = rec.get("messages") or [{"role": "user", "content": rec["prompt"]},
                                       {"role": "assistant", "content": rec["response"]}]
        if rec.get("system") or msgs[0]["role"] == "system":
            continue   # API_DEMO_CHAT has no system turn
        want = []
        for m in msgs:
            msg = re.sub(r"\n+", "\n", m["content"].replace("\r\n", "\n").replace("\r", "\n")
                         .strip())
            want += trie.encode("User: " + msg + "\n\nAssistant:") if m["role"] == "user" \
                else trie.encode(" " + msg + "\n\n")
        assert ids.tolist() == want
        demo += 1
    assert demo > 20


def test_a_state_tune_starts_every_window_at_a_conversation(tmp_path):
    """A state tune's training and validation windows start where
    conversations do (the state is what a chat starts from); a full tune's
    start anywhere."""
    from test_finetune import _base_run, _tune
    data = tmp_path / "many.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}.", "response": f"{i}, done."}) + "\n"
                            for i in range(400)))
    base = _base_run(tmp_path, RWKV)
    tr = _tune(tmp_path, base, "s", tune="state", data=str(data), seq_len=40, eval_tokens=200)
    c = tr.corpus
    starts = set(conversation_starts(c.train, c.train_mask, 40).tolist())
    assert tr.sampler.starts is not None and set(tr.sampler.starts.tolist()) == starts
    conv = conversation_starts(c.val, c.val_mask, 40)
    for row in tr.val_x:   # each window is the split at one of its conversation starts
        assert any(np.array_equal(row, c.val[o:o + 40]) for o in conv.tolist())
    tr.run()
    full = _tune(tmp_path, base, "f", data=str(data), seq_len=40, eval_tokens=200)
    assert full.sampler.starts is None
