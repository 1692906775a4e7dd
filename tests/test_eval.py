"""rwkvx-c eval and rwkvx_c.eval: the trainer's own validation figures for
the same windows, corpus scores and LAMBADA against a float64 NumPy
recomputation (tests/reference, never the C code), passkey retrieval, and
the one-line errors."""
import json
import math

import numpy as np
import pytest

from rwkvx_c.cli import main
from rwkvx_c.data.pipeline import load_corpus
from rwkvx_c.eval import metrics
from rwkvx_c.eval.passkey import format_table, heatmap, passkey_grid, passkey_prompt
from rwkvx_c.sample import load_run

from reference.model import model_forward

TEXT = b"def f(x):\n    return x * 2\n"
HELD_OUT = (b"class A:\n    def g(self, y):\n        return y + 1\n" * 12
            + "# é ü — ok\n".encode() * 4)
T = 32
# fp32 forward vs the float64 reference: logits agree to ~1e-6 relative
# (tests/checks.py bounds), so a mean loss of O(1) nats agrees to ~1e-6;
# 1e-5 leaves a margin of ten without hiding a wrong window or divisor
# (either moves the loss by more than 1e-3)
REF_TOL = 1e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny pure RWKV-7 byte run, fp32 (its val figures are fp32 forwards)."""
    d = tmp_path_factory.mktemp("eval")
    corpus = d / "corpus.txt"
    corpus.write_bytes(TEXT * 300)
    assert main(["train", "--preset", "tiny", "--n-attn-layer", "0", "--steps", "6",
                 "--seq-len", str(T), "--batch", "2", "--eval-tokens", "96", "--threads", "1",
                 "--warmup", "1", "--precision", "fp32", "--data", str(corpus),
                 "--out", str(d / "run"), "--cache-dir", str(d / "cache")]) == 0
    return d


def _json_out(capsys, argv):
    capsys.readouterr()
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_of_the_val_split_is_the_trainers_last_evaluation(run, capsys):
    rows = [json.loads(x) for x in (run / "run" / "log.jsonl").read_text().splitlines()]
    last = [r for r in rows if "val_loss" in r][-1]
    out = _json_out(capsys, ["eval", str(run / "run"), "--data", str(run / "corpus.txt"),
                             "--split", "val", "--json"])["data"]
    print(f"eval --split val vs the trainer: loss {out['loss']:.9f} / {last['val_loss']:.9f}, "
          f"bpb {out['bpb']:.9f} / {last['val_bpb']:.9f}")
    assert out["windows"] == 3 and out["tokens"] == 3 * T   # eval_tokens 96 // 32
    assert out["loss"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert out["bpb"] == pytest.approx(last["val_bpb"], rel=1e-6)
    # without --data: the run's own corpus
    own = _json_out(capsys, ["eval", str(run / "run"), "--split", "val", "--json"])["data"]
    assert (own["loss"], own["bpb"]) == (out["loss"], out["bpb"])


def _ref_score(params, config, tokens, T):
    """(summed nats, target count) of every-token-once windows, float64."""
    nats, n = 0.0, 0
    for s in range(0, len(tokens) - 1, T):
        w = np.asarray(tokens[s:s + T + 1], dtype=np.int64)
        z = model_forward(params, config, w[:-1]).value
        lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
        nats += float((lse - z[np.arange(len(w) - 1), w[1:]]).sum())
        n += len(w) - 1
    return nats, n


def test_corpus_scores_match_a_float64_recomputation(run, capsys):
    held = run / "held_out.txt"
    held.write_bytes(HELD_OUT)
    out = _json_out(capsys, ["eval", str(run / "run"), "--data", str(held), "--json"])["data"]
    model, tok = load_run(str(run / "run"))
    params = {k: np.asarray(v, np.float64) for k, v in model.params.items()}
    corpus = load_corpus(str(held), seq_len=T, tokenizer=tok)
    nats = n = 0
    for part in (corpus.train, corpus.val):   # each split scored on its own
        a, b = _ref_score(params, model.config, np.asarray(part), T)
        nats, n = nats + a, n + b
    assert n == len(HELD_OUT) - 2 and out["tokens"] == n
    loss = nats / n
    print(f"eval vs float64: loss {out['loss']:.9f} / {loss:.9f}")
    assert out["loss"] == pytest.approx(loss, rel=REF_TOL)
    assert out["ppl"] == pytest.approx(math.exp(loss), rel=REF_TOL)
    assert out["bpb"] == pytest.approx(nats / (math.log(2) * n), rel=REF_TOL)   # one byte a token


def test_windows_cover_every_token_once_in_bounded_batches():
    starts = metrics.consecutive_starts(100, 32)
    assert starts.tolist() == [0, 32, 64, 96]
    tokens = np.arange(100) % 7
    seen = []
    for x, y in metrics._batches(tokens, starts, 32, 2):
        assert len(x) <= 2
        seen += y.reshape(-1).tolist()
    assert seen == tokens[1:].tolist()


def test_lambada_follows_rwkv_lms_protocol(run, tmp_path, capsys):
    docs = ["the cat sat on the mat", "def f(x): return x", "a b c d e f g h"]
    path = tmp_path / "lambada.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = _json_out(capsys, ["eval", str(run / "run"), "--lambada", str(path), "--json"])
    model, _ = load_run(str(run / "run"))
    params = {k: np.asarray(v, np.float64) for k, v in model.params.items()}
    total, hits = 0.0, 0
    for d in docs:
        ctx, word = d.rsplit(" ", 1)
        src = [0] + list(ctx.encode())      # RWKV-LM: token 0, then the context
        dst = list((" " + word).encode())
        z = model_forward(params, model.config, np.array(src + dst[:-1])).value
        lp = z - (np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1))[:, None]
        rows = np.arange(len(src) - 1, len(src) - 1 + len(dst))
        total += float(lp[rows, dst].sum())
        hits += bool(np.all(np.argmax(z[rows], -1) == dst))
    lam = out["lambada"]
    assert lam["docs"] == 3
    assert lam["acc"] == hits / 3
    assert lam["ppl"] == pytest.approx(math.exp(-total / 3), rel=REF_TOL)


def test_passkey_grid_table_and_heat_map(run, tmp_path, capsys):
    _, tok = load_run(str(run / "run"))
    prompt, answer = passkey_prompt(tok, 400, 0.5, 12345)
    text = tok.decode(prompt).decode()
    assert "The pass key is 12345." in text and text.endswith("The pass key is")
    filler = len(b"The grass is green. The sky is blue. The sun is yellow. Here we go. "
                 b"There and back again.\n")
    assert 400 - filler < len(prompt) <= 400 and tok.decode(answer) == b" 12345."
    first = tok.decode(passkey_prompt(tok, 400, 0.0, 1)[0]).decode()
    assert first.index("pass key is 1.") < first.index("grass")   # depth 0: before the filler
    png = tmp_path / "pk.png"
    out = _json_out(capsys, ["eval", str(run / "run"), "--passkey", "--passkey-lengths",
                             "256,384", "--passkey-depths", "0,1", "--passkey-trials", "2",
                             "--plot", str(png), "--json"])["passkey"]
    assert out["lengths"] == [256, 384] and out["depths"] == [0.0, 1.0]
    assert np.shape(out["acc"]) == (2, 2)
    assert all(a in (0.0, 0.5, 1.0) for row in out["acc"] for a in row)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "length \\ depth" in format_table(out)


def test_passkey_counts_a_trial_when_every_answer_token_is_greedy(run, monkeypatch):
    """A stand-in for the model's scores: right answers at depth 0 only."""
    from rwkvx_c.eval import passkey as pk
    model, tok = load_run(str(run / "run"))

    def fake(model, pairs, progress=None):
        """Each trial (prompt, answer) right only when the key comes
        before the filler (depth 0)."""
        out = []
        for prompt, _ in pairs:
            text = tok.decode(prompt)
            out.append((0.0, text.index(b"pass key is") < text.index(b"grass")))
        return out

    monkeypatch.setattr(pk, "score_continuations", fake)
    grid = passkey_grid(model, tok, lengths=[600], depths=[0.0, 1.0], trials=3)
    assert grid["acc"] == [[1.0, 0.0]]
    assert format_table(grid).splitlines()[1].split() == ["600", "1.00", "0.00"]
    with pytest.raises(Exception, match="depths must lie"):
        passkey_grid(model, tok, depths=[1.5])


@pytest.mark.parametrize("argv, msg", [
    (["eval", "{run}"], "nothing to evaluate"),
    (["eval", "{run}", "--include-path", "x", "--passkey"], "--include-path needs --tasks"),
    (["eval", "{run}", "--lambada", "{missing}"], "cannot read"),
    (["eval", "{run}", "--data", "{missing}"], "does not exist"),
])
def test_bad_input_is_one_line(run, tmp_path, capsys, argv, msg):
    argv = [a.format(run=run / "run", missing=tmp_path / "nope.jsonl") for a in argv]
    assert main(argv) in (1, 2)
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1, err


def test_heat_map_is_written_atomically(tmp_path):
    grid = {"lengths": [8, 16], "depths": [0.0, 1.0], "acc": [[1.0, 0.0], [0.5, 1.0]]}
    heatmap(grid, str(tmp_path / "h.png"))
    assert [p.name for p in tmp_path.iterdir()] == ["h.png"]


def test_a_missing_extra_is_one_line_naming_it(run, tmp_path, monkeypatch, capsys):
    import sys
    monkeypatch.delitem(sys.modules, "rwkvx_c.eval.harness", raising=False)
    monkeypatch.setitem(sys.modules, "lm_eval", None)        # import lm_eval fails
    monkeypatch.setitem(sys.modules, "lm_eval.api.model", None)
    assert main(["eval", str(run / "run"), "--tasks", "x"]) == 1
    assert 'pip install "rwkvx_c[eval]"' in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    assert main(["export", str(run / "run"), "--format", "hf", "--out",
                 str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err.strip()
    assert 'pip install "rwkvx_c[hf-model]"' in err and len(err.splitlines()) == 1
    assert not (tmp_path / "hf").exists()
