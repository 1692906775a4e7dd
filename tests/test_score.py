"""Continuations scored in the batched engine (rwkvx_c.generation.score)
and every evaluation of a run on a frozen base holding that base as it
trained (docs/training.md §Evaluation): a pair's score is the same alone
and in any batch, bit for bit, equals the training forward's and the
one-sequence recurrent state's to float32 rounding, and `rwkvx-c eval`
(corpus, LAMBADA, passkey, preferences, lm-eval tasks) and `export
--format state` of a base-holding run give the figures of the same model
with its base decoded to float32."""
import json
import os

import numpy as np
import pytest
from test_generate import HYBRID, RWKV

import rwkvx_c as rx
import rwkvx_c.cli.eval as cli_eval
import rwkvx_c.cli.export as cli_export
import rwkvx_c.model.memory as memory
from rwkvx_c.cli import main
from rwkvx_c.errors import SampleError
from rwkvx_c.generation.score import score_continuations
from rwkvx_c.run.rundir import checkpoint_path
from rwkvx_c.sample import load_run

DATA = os.path.join(os.path.dirname(__file__), "data", "chat.jsonl")


def _pairs(rng, n):
    """n (context, continuation) pairs, a few sharing their context, one
    with an empty continuation, lengths 1 to 60."""
    out = []
    for i in range(n):
        ctx = rng.integers(0, 256, rng.integers(1, 60)).tolist() if i % 3 or not out \
            else out[-1][0]
        out.append((ctx, rng.integers(0, 256, rng.integers(0 if i == 5 else 1, 12)).tolist()))
    return out


def _forward_score(m, ctx, cont):
    """The training forward's log p(cont | ctx), float64 log-softmax."""
    seq = np.array(ctx + cont, np.int32)
    z = m.forward(seq[:-1])[len(ctx) - 1:].astype(np.float64)
    lp = z - z.max(1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(1, keepdims=True))
    return float(lp[np.arange(len(cont)), cont].sum()), \
        bool(np.all(np.argmax(z, 1) == np.array(cont)))


@pytest.mark.parametrize("cfg", [RWKV, HYBRID], ids=["rwkv", "hybrid"])
def test_a_pair_scores_the_same_alone_and_in_any_batch(cfg):
    m = rx.RxPtModel(cfg, seed=5)
    pairs = _pairs(np.random.default_rng(3), 14)
    together = score_continuations(m, pairs)
    assert together == score_continuations(m, pairs, batch_size=3)
    for p, got in zip(pairs, together):
        assert score_continuations(m, [p], batch_size=1)[0] == got   # bit for bit
        if not p[1]:
            assert got == (0.0, True)
            continue
        lp, greedy = _forward_score(m, *p)
        assert got[0] == pytest.approx(lp, rel=1e-5, abs=1e-4) and got[1] == greedy
    # the one-sequence recurrent state (rx_infer), which scored them before
    st = rx.InferState(m, max_len=128)
    for ctx, cont in pairs[:4]:
        st.reset()
        z = st.forward(np.array(ctx + cont, np.int32)[:-1])[len(ctx) - 1:].astype(np.float64)
        z -= z.max(1, keepdims=True)
        want = float((z[np.arange(len(cont)), cont] - np.log(np.exp(z).sum(1))).sum())
        assert score_continuations(m, [(ctx, cont)])[0][0] == pytest.approx(want, rel=1e-5,
                                                                             abs=1e-4)


def test_a_state_tune_scores_from_its_states_and_bad_pairs_are_one_line():
    m = rx.RxPtModel(RWKV, seed=6)
    m.enable_state()
    m.state[...] = np.random.default_rng(1).normal(0, 0.5, m.state.shape)
    pair = ([1, 2, 3, 4], [5, 6, 7])
    assert score_continuations(m, [pair])[0][0] == pytest.approx(_forward_score(m, *pair)[0],
                                                                  rel=1e-5)
    with pytest.raises(SampleError, match="context of at least one token"):
        score_continuations(m, [([], [1])])
    with pytest.raises(SampleError, match="batch_size"):
        score_continuations(m, [pair], batch_size=0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A base run, a LoRA run and a state run on it, each holding a Q8_0
    base (its rows quantized: the float32 path is the base decoded)."""
    d = tmp_path_factory.mktemp("heldbase")
    common = ["--data", DATA, "--batch", "2", "--seq-len", "32", "--eval-tokens", "64",
              "--threads", "1", "--warmup", "1", "--cache-dir", str(d / "cache")]
    assert main(["train", "--preset", "tiny", "--n-attn-layer", "0", "--steps", "2",
                 "--out", str(d / "base"), *common]) == 0
    for tune in ("lora", "state"):
        assert main(["train", "--init-from", str(d / "base"), "--tune", tune, "--lr", "0.01",
                     "--base-dtype", "q8_0", "--steps", "2", "--out", str(d / tune),
                     *common, "--seq-len", "128"]) == 0   # a state tune's window holds a reply
    return d


def _decoded_load_run(loads):
    """load_run holding the base, then its base decoded into float32
    weights (release_base): the float32 path over the very same weights."""
    def f(path, base=None, rehash=False, hold_base=False):
        model, tok = load_run(path, base, rehash, hold_base)
        loads.append((path, model.base_dtype))
        if model.base_dtype is not None:
            model.release_base()
        return model, tok
    return f


def _spy_memory(monkeypatch):
    """The lines of every memory check made from now on."""
    seen = []
    real = memory.check
    monkeypatch.setattr(memory, "check", lambda need, what, advice:
                        seen.append(what) or real(need, what, advice))
    return seen


def _eval_json(capsys, argv):
    capsys.readouterr()
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_of_a_base_holding_run_holds_its_base(runs, tmp_path, capsys, monkeypatch):
    lam = tmp_path / "lambada.jsonl"
    lam.write_text("".join(json.dumps({"text": t}) + "\n" for t in
                           ["User: hello there friend", "Assistant: it is a fine day",
                            "User: what is the time now"]))
    prefs = tmp_path / "prefs.jsonl"
    prefs.write_text("".join(json.dumps({"prompt": "User: hi\n\nAssistant:", "chosen": c,
                                         "rejected": r}) + "\n"
                             for c, r in [(" hello", " go away"), (" yes.", " no!")]))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mc.jsonl").write_text(json.dumps({"q": "User: hi", "c": [" a", " b"], "a": 0})
                                    + "\n")
    (tasks / "mc.yaml").write_text(
        f"task: rx_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
        f"{tasks / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"{{q}}\"\ndoc_to_target: a\ndoc_to_choice: c\n"
        "metric_list:\n  - metric: acc\n")
    for tune in ("lora", "state"):
        argv = ["eval", str(runs / tune), "--data", DATA, "--lambada", str(lam), "--passkey",
                "--passkey-lengths", "64", "--passkey-depths", "0,1", "--passkey-trials", "2",
                "--plot", str(tmp_path / "p.png"), "--preferences", str(prefs),
                "--seq-len", "64", "--tasks", "rx_mc", "--include-path", str(tasks)]
        seen = _spy_memory(monkeypatch)
        held = _eval_json(capsys, argv)
        monkeypatch.undo()
        assert any("(its base q8_0)" in w for w in seen), seen
        loads: list = []
        monkeypatch.setattr(cli_eval, "load_any", _decoded_load_run(loads))
        decoded = _eval_json(capsys, argv)
        monkeypatch.undo()
        assert loads == [(checkpoint_path(str(runs / tune)), "q8_0")]   # the run's checkpoint
        for what in ("data", "lambada", "preferences"):
            for k, v in decoded[what].items():
                if isinstance(v, float):
                    assert held[what][k] == pytest.approx(v, rel=1e-5, abs=1e-6), (tune, k)
        assert held["passkey"]["acc"] == decoded["passkey"]["acc"]
        assert held["tasks"] == decoded["tasks"]


def test_a_state_export_holds_the_base(runs, tmp_path, monkeypatch):
    import torch
    seen = _spy_memory(monkeypatch)
    assert main(["export", str(runs / "state"), "--format", "state", "--out",
                 str(tmp_path / "held.pth")]) == 0
    assert any("(its base q8_0)" in w for w in seen), seen
    loads: list = []
    monkeypatch.setattr(cli_export, "load_run", _decoded_load_run(loads))
    assert main(["export", str(runs / "state"), "--format", "state", "--out",
                 str(tmp_path / "f32.pth")]) == 0
    assert loads == [(checkpoint_path(str(runs / "state")), "q8_0")]
    a, b = (torch.load(tmp_path / f, weights_only=True) for f in ("held.pth", "f32.pth"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
