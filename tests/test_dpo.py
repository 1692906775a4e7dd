"""Preference tuning (docs/maths.md §Preference tuning, docs/finetune.md
§Preference tuning): each objective's loss and grads against the float64
reference and finite differences; the model's weighted cross-entropy path
(RxPtModel.row_losses / backward_rows) against the float64 model, chunked
head or not, LoRA or state; the records of both forms, and one line naming
a record that cannot be a pair; runs that train, report TRL's metrics and
resume bit for bit, from Python and from the command line."""
import json
import math
import os

import numpy as np
import pytest
from test_finetune import RWKV, _base_run, _tune
from test_train import SMALL, _opts

import rwkvx_c as rx
from rwkvx_c.cli import main
from rwkvx_c.data.chat import IGNORE, SEPARATOR
from rwkvx_c.data.preferences import pair_segments, read_pairs
from rwkvx_c.data.tokenizers import load as load_tokenizer
from rwkvx_c.errors import DataError
from rwkvx_c.run import RunDir
from rwkvx_c.sample import load_model
from rwkvx_c.train import Trainer, TrainError
from rwkvx_c.train.objectives import REF_FILE, pair_logps, pair_loss

from checks import FWD_TOL, GRAD_TOL, assert_rel
from reference.autograd import Var
from reference.model import leaves
from reference.preference import model_pair_loss
from reference.preference import pair_loss as ref_pair_loss

KINDS = ("dpo", "ipo", "simpo")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
           "logps/chosen", "logps/rejected")


@pytest.mark.parametrize("kind,eps", [("dpo", 0.0), ("dpo", 0.2), ("ipo", 0.0),
                                      ("simpo", 0.0), ("simpo", 0.2)])
def test_pair_loss_and_grads_equal_the_reference_and_finite_differences(kind, eps):
    rng = np.random.default_rng(7)
    P, beta = 5, 0.3
    pc, pr = -rng.uniform(5, 40, P), -rng.uniform(5, 40, P)
    rc, rr = pc + rng.normal(0, 2, P), pr + rng.normal(0, 2, P)
    nc, nr = rng.integers(1, 9, P), rng.integers(1, 9, P)
    got = pair_loss(kind, beta, pc, pr, rc, rr, nc, nr, smoothing=eps)
    vc, vr = Var(pc.copy()), Var(pr.copy())
    ref = ref_pair_loss(kind, beta, vc, vr, rc, rr, nc, nr, eps)
    ref.backward()
    assert got.losses.mean() == pytest.approx(ref.value, rel=1e-13, abs=1e-15)
    assert np.allclose(got.grad_chosen, vc.grad, rtol=1e-12, atol=1e-15)
    assert np.allclose(got.grad_rejected, vr.grad, rtol=1e-12, atol=1e-15)

    def mean_loss(a, b):
        return pair_loss(kind, beta, a, b, rc, rr, nc, nr, smoothing=eps).losses.mean()
    # central differences: rounding error ~ eps * |L| / h, truncation ~ h^2 |L'''|
    h = 1e-6
    tol = 8 * np.finfo(np.float64).eps * max(1.0, abs(mean_loss(pc, pr))) / h
    for i in range(P):
        d = np.zeros(P)
        d[i] = h
        fc = (mean_loss(pc + d, pr) - mean_loss(pc - d, pr)) / (2 * h)
        fr = (mean_loss(pc, pr + d) - mean_loss(pc, pr - d)) / (2 * h)
        assert fc == pytest.approx(got.grad_chosen[i], rel=1e-6, abs=tol)
        assert fr == pytest.approx(got.grad_rejected[i], rel=1e-6, abs=tol)


def test_dpo_of_a_policy_equal_to_its_reference_is_log_2():
    z = np.array([-3.0, -7.5])
    res = pair_loss("dpo", 0.1, z, z - 1, z, z - 1, [2, 3], [2, 2])
    assert np.all(res.losses == math.log(2))
    assert np.all(res.rewards_chosen == 0) and np.all(res.rewards_rejected == 0)


def _pair_batch(rng, P, T, V):
    """x, y (2P, T): random tokens, targets on a random tail of each row
    (the completion), IGNORE before it; a rejected row may be shorter."""
    x = rng.integers(1, V, (2 * P, T)).astype(np.int32)
    y = np.full((2 * P, T), IGNORE, np.int32)
    for b in range(2 * P):
        start = int(rng.integers(1, T - 1))
        end = int(rng.integers(start + 1, T + 1))
        y[b, start:end] = rng.integers(0, V, end - start)
    return x, y


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunked", [False, True])
def test_weighted_backward_equals_the_float64_model_with_lora(kind, chunked):
    cfg = dict(RWKV, n_rwkv_layer=2)
    m = rx.RxPtModel(cfg, seed=5)
    rng = np.random.default_rng(3)
    for v in m.params.values():   # no zero output_w: every path carries signal
        v[...] = rng.normal(0, 0.2, v.shape)
    names = ["blocks.0.tm.receptance_w", "blocks.1.tm.value_w", "blocks.1.cm.ffn_value_w"]
    m.enable_lora(3, 6.0, names)
    for v in m.lora.values():
        v[...] = rng.normal(0, 0.3, v.shape)
    P, T, V = 3, 11, cfg["vocab_size"]
    x, y = _pair_batch(rng, P, T, V)
    trained = y != IGNORE
    n_tok = trained.sum(1)
    rc, rr = rng.normal(-30, 3, P), rng.normal(-30, 3, P)
    beta = 0.5
    m.forward(x, return_logits=not chunked)
    rl = m.row_losses(y, IGNORE)
    pol = -rl.sum(1)
    res = pair_loss(kind, beta, pol[:P], pol[P:], rc, rr, n_tok[:P], n_tok[P:])
    w = np.repeat(np.concatenate([-res.grad_chosen, -res.grad_rejected])[:, None], T, 1)
    rl2 = m.backward_rows(y, w, IGNORE)
    assert np.array_equal(rl, rl2)
    assert np.all(rl[~trained] == 0)
    lv = leaves({n: v.copy() for n, v in m.params.items()})
    ad = {n: (Var(m.lora[n + ".lora_A"].astype(np.float64)),
              Var(m.lora[n + ".lora_B"].astype(np.float64))) for n in names}
    ref = model_pair_loss(lv, m.config, x, np.where(trained, y, 0), trained, kind, beta, rc, rr,
                          n_tok[:P], n_tok[P:], adapters=ad, r=3, alpha=6.0)
    ref.backward()
    assert_rel(f"dpo.{kind}.loss", res.losses.mean(), ref.value, FWD_TOL)
    for n in names:
        assert_rel(f"dpo.{kind}.lora_A", m.lora_grads[n + ".lora_A"], ad[n][0].grad, GRAD_TOL)
        assert_rel(f"dpo.{kind}.lora_B", m.lora_grads[n + ".lora_B"], ad[n][1].grad, GRAD_TOL)
    for n in m.param_names:
        g = lv[n].grad if lv[n].grad is not None else np.zeros(lv[n].shape)
        assert_rel(f"dpo.{kind}.grad.{n}", m.grads[n], g, GRAD_TOL)


@pytest.mark.parametrize("chunked", [False, True])
def test_backward_rows_with_the_mean_weights_is_backward_bit_for_bit(chunked):
    m = rx.RxPtModel(dict(SMALL, vocab_size=97), seed=2)
    rng = np.random.default_rng(1)
    x, y = _pair_batch(rng, 2, 13, 97)
    m.forward(x, return_logits=not chunked)
    loss = m.backward(y, IGNORE)
    g = m.grad_buffer.copy()
    w = np.where(y != IGNORE, 1.0 / np.count_nonzero(y != IGNORE), 0.0)
    rl = m.backward_rows(y, w, IGNORE)
    assert np.array_equal(m.grad_buffer, g)
    assert rl.sum() / np.count_nonzero(y != IGNORE) == pytest.approx(loss, rel=1e-12)
    with pytest.raises(ValueError, match="weight"):
        m.backward_rows(y, w.astype(np.float32), IGNORE)


def _write(path, recs):
    with open(path, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_both_record_forms_give_the_same_pair_and_targets_on_the_completion(tmp_path):
    text = {"prompt": "What is 2 plus 3?", "chosen": "5.", "rejected": "6."}
    conv = {"prompt": [{"role": "user", "content": "What is 2 plus 3?"}],
            "chosen": [{"role": "assistant", "content": "5."}],
            "rejected": [{"role": "assistant", "content": "6."}]}
    assert pair_segments(text, "x") == pair_segments(conv, "x") == (
        ["User: What is 2 plus 3?\n\nAssistant:"], " 5.\n\n", " 6.\n\n")
    tok = load_tokenizer("byte")
    p = read_pairs(_write(tmp_path / "p.jsonl", [text, conv]), tok, 48)
    assert np.array_equal(p.x[0], p.x[1]) and np.array_equal(p.y[0], p.y[1])
    prompt = b"User: What is 2 plus 3?\n\nAssistant:"
    seq = [SEPARATOR] + list(prompt) + list(b" 5.\n\n")
    assert list(p.x[0, 0, :len(seq) - 1]) == seq[:-1]
    tgt = p.y[0, 0]
    assert list(tgt[tgt != IGNORE]) == list(b" 5.\n\n")
    assert np.flatnonzero(tgt != IGNORE)[0] == len(prompt)   # predicted from "Assistant:"
    assert list(p.n_tokens[0]) == [5, 5]


@pytest.mark.parametrize("rec,msg", [
    ({"prompt": "Hi", "chosen": "  ", "rejected": "No."}, "chosen completion is empty"),
    ({"prompt": "Hi", "chosen": "Yes.", "rejected": "x" * 80}, "rejected sequence has"),
    ({"prompt": "Hi", "chosen": "Yes."}, "not a preference record"),
    ({"prompt": "Hi", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
     "list of one assistant message")])
def test_a_record_that_cannot_be_a_pair_gets_one_line_naming_it(tmp_path, rec, msg):
    good = {"prompt": "Hi", "chosen": "Yes.", "rejected": "No."}
    path = _write(tmp_path / "p.jsonl", [good, rec])
    with pytest.raises(DataError, match=msg) as e:
        read_pairs(path, load_tokenizer("byte"), 48)
    assert f"{path}:2" in str(e.value) and "\n" not in str(e.value)


def _rule_pairs(n, seed=0):
    """Pairs whose chosen answer follows a rule: the prompt's word, doubled."""
    rng = np.random.default_rng(seed)
    words = ["cat", "dog", "sun", "map", "pen", "cup", "hat", "box"]
    out = []
    for _ in range(n):
        a, b = rng.choice(words, 2, replace=False)
        out.append({"prompt": f"Say {a}", "chosen": f"{a} {a}", "rejected": f"{b} {b}"})
    return out


def _dpo_run(tmp_path, base, out, **kw):
    data = _write(tmp_path / "pairs.jsonl", _rule_pairs(40))
    kw = {**dict(tune="lora", steps=6, lr=1e-2, save_every=3, precision="fp32",
                 objective="dpo", data=data, batch=4, seq_len=40, eval_every=3), **kw}
    if kw["tune"] == "lora":   # --lora-r has no effect in another mode, and is refused there
        kw.setdefault("lora_r", 4)
    return _tune(tmp_path, base, out, **kw)


def test_dpo_lora_run_reports_trl_metrics_and_resumes_bit_exact(tmp_path):
    base = _base_run(tmp_path)
    tr = _dpo_run(tmp_path, base, "d1")
    rows = []
    tr.run(on_step=rows.append)
    steps = [r for r in rows if "loss" in r]
    # zero adapters at step 1: the policy is its reference, bit for bit
    assert steps[0]["loss"] == math.log(2) and steps[0]["rewards/margins"] == 0.0
    for k in METRICS:
        assert all(k in r for r in steps)
    assert any("eval_rewards/accuracies" in r for r in rows)
    assert os.path.exists(tmp_path / "d1" / REF_FILE)
    assert RunDir(str(tmp_path / "d1")).foreign_entries() == []   # the reference is the run's
    tr2 = _dpo_run(tmp_path, base, "d2")
    tr2.run(stop=lambda: tr2.step_count >= 3)
    r = Trainer.resume(str(tmp_path / "d2"))
    again = []
    r.run(on_step=again.append)
    assert [x["loss"] for x in again if "loss" in x] == [x["loss"] for x in steps[3:]]
    assert np.array_equal(r.model.lora_buffer, tr.model.lora_buffer)


@pytest.mark.parametrize("tune,kind,precision", [("state", "ipo", "fp32"),
                                                 ("full", "simpo", "fp32"),
                                                 ("lora", "dpo", "bf16")])
def test_each_tune_and_precision_trains_on_pairs(tmp_path, tune, kind, precision):
    base = _base_run(tmp_path)
    tr = _dpo_run(tmp_path, base, "s", tune=tune, objective=kind, lr=1e-2, precision=precision)
    rows = []
    tr.run(on_step=rows.append)
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)
    assert os.path.exists(tmp_path / "s" / REF_FILE) == (kind != "simpo")


def test_options_are_checked(tmp_path):
    with pytest.raises(TrainError, match="must be even"):
        Trainer(_opts(tmp_path, objective="dpo", batch=3))
    with pytest.raises(TrainError, match="dpo_label_smoothing"):
        Trainer(_opts(tmp_path, objective="dpo", dpo_label_smoothing=0.5))
    with pytest.raises(TrainError, match="applies to --objective dpo or simpo"):
        Trainer(_opts(tmp_path, objective="ipo", dpo_label_smoothing=0.1))
    with pytest.raises(TrainError, match="unknown objective"):
        Trainer(_opts(tmp_path, objective="orpo"))


def test_cli_trains_dpo_from_a_base(tmp_path, capsys):
    base = _base_run(tmp_path)
    data = _write(tmp_path / "pairs.jsonl", _rule_pairs(30))
    out = str(tmp_path / "cli")
    main(["train", "--init-from", base, "--tune", "lora", "--lora-r", "4", "--objective",
          "dpo", "--dpo-beta", "0.2", "--data", data, "--batch", "4", "--seq-len", "40",
          "--steps", "2", "--threads", "2", "--precision", "fp32", "--out", out])
    with open(os.path.join(out, "log.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    # step 0: the source's baseline, the policy still the reference; no val_bpb
    assert rows[0]["step"] == 0 and rows[0]["val_loss"] == pytest.approx(math.log(2))
    assert "val_bpb" not in rows[0]
    rows = [r for r in rows if "loss" in r]
    assert rows[0]["loss"] == pytest.approx(math.log(2)) and "rewards/accuracies" in rows[0]
    assert os.path.exists(os.path.join(out, REF_FILE))


def test_ref_from_logps_are_another_models_computed_once(tmp_path):
    base = _base_run(tmp_path)
    other = _tune(tmp_path, base, "other", steps=2)
    other.run()
    tr = _dpo_run(tmp_path, base, "rf", tune="full", ref_from=str(tmp_path / "other"), steps=2)
    p = tr.pref
    ref_model = load_model(str(tmp_path / "other"))
    assert np.array_equal(p.ref[:len(p.train)], pair_logps(ref_model, p.train, p.pairs))
    assert not np.array_equal(p.ref[:len(p.train)], pair_logps(tr.model, p.train, p.pairs))
    tr.run()
    saved = np.load(tmp_path / "rf" / REF_FILE)
    # a resumed run reads them back, even with the reference gone
    os.rename(tmp_path / "other", tmp_path / "gone")
    r = Trainer.resume(str(tmp_path / "rf"), steps=3)
    assert np.array_equal(r.pref.ref, saved)
    r.close()
    with pytest.raises(TrainError, match="--ref-from"):
        _dpo_run(tmp_path, base, "rf2", ref_from=str(tmp_path / "missing"))


def test_eval_preferences_scores_held_out_pairs(tmp_path, capsys):
    base = _base_run(tmp_path)
    tr = _dpo_run(tmp_path, base, "ev", steps=4, lr=3e-2)
    tr.run()
    held = _write(tmp_path / "held.jsonl", _rule_pairs(5, seed=9))
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "ev"), "--preferences", held, "--seq-len", "40",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["preferences"]
    assert r["n_pairs"] == 5 and r["objective"] == "dpo"
    for k in ("loss",) + METRICS + ("logps/accuracies",):
        assert np.isfinite(r[k]), k
    # the same figures from the trainer's own code: the policy merged, the base as reference
    pairs = read_pairs(held, load_tokenizer("byte"), 40)
    pol = pair_logps(load_model(str(tmp_path / "ev")), pairs, 8)
    ref = pair_logps(load_model(base), pairs, 8)
    res = pair_loss("dpo", 0.1, pol[:, 0], pol[:, 1], ref[:, 0], ref[:, 1], pairs.n_tokens[:, 0],
                    pairs.n_tokens[:, 1])
    assert r["loss"] == pytest.approx(res.losses.mean(), rel=1e-6)
    assert r["logps/chosen"] == pytest.approx(pol[:, 0].mean(), rel=1e-6)
    # a full run has no base in its checkpoint: one line asks for --ref-from
    assert main(["eval", base, "--preferences", held, "--seq-len", "40"]) == 1
    assert "--ref-from" in capsys.readouterr().err


def test_progress_line_and_plot_show_the_preference_metrics(tmp_path):
    from rwkvx_c.run.plot import plot_log
    from rwkvx_c.train.progress import progress_update

    class Bar:
        n, post = 0, {}

        def set_postfix(self, post, refresh):
            self.post = dict(post)

        def update(self, k):
            self.n += k

    class Run:
        opts = type("O", (), {"steps": 4})()

    bar = Bar()
    row = {"step": 1, "loss": 0.69, "tokens_per_s": 10.0, "rewards/accuracies": 0.75,
           "rewards/margins": 0.125}
    progress_update(bar, Run())(row)
    assert bar.post["acc"] == "0.75" and bar.post["margin"] == "0.125"
    pytest.importorskip("matplotlib")
    rows = [dict(row, step=s) for s in range(1, 5)] + [{"step": 4, "val_loss": 0.6}]
    assert plot_log(rows, str(tmp_path / "loss.png"))
    assert os.path.getsize(tmp_path / "loss.png") > 0
