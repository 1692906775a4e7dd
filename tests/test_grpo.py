"""GRPO (docs/maths.md §GRPO, docs/finetune.md §GRPO): the group advantages
and each loss type's value and grad against a direct float64 evaluation
and finite differences; the reward functions' contract (built-ins, user
functions, one line naming a function that fails); prompt records of
each form and a parquet table; runs from Python, the command line and a
config file; bit-exact resume mid --num-iterations; --grad-accum's
micro-batches giving one batch's loss; the log-probabilities and grads at
a sampling temperature (TRL's logits / temperature)."""
import json
import os
import shutil

import numpy as np
import pytest
from test_train import SMALL, _opts

import rwkvx_c as rx
from rwkvx_c.cli import main
from rwkvx_c.data.chat import IGNORE, SEPARATOR
from rwkvx_c.data.prompts import read_prompts
from rwkvx_c.data.tokenizers import ByteTokenizer
from rwkvx_c.errors import DataError
from rwkvx_c.run import RunDir
from rwkvx_c.train import Trainer, TrainError
from rwkvx_c.train.grpo import stop_strings
from rwkvx_c.train.grpo_loss import LOSS_TYPES, advantages, token_loss
from rwkvx_c.train.rewards import load_rewards, score

REWARD = """
def first_digit(prompts, completions, answer, **kw):
    return [1.0 if c[:1] == a[:1] else 0.0 for c, a in zip(completions, answer)]

def raises(prompts, completions, **kw):
    raise KeyError("boom")

def short(prompts, completions, **kw):
    return [1.0]

def spread(prompts, completions, completion_ids, **kw):
    return [(sum(ids) % 5) / 4.0 for ids in completion_ids]

def word(prompts, completions, **kw):
    return ["high"] * len(completions)
"""


def _records(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in rng.integers(0, 9, (n, 2))]


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def _grpo(tmp_path, out, **kw):
    (tmp_path / "rw.py").write_text(REWARD)
    base = dict(model=dict(SMALL, n_attn_layer=0), objective="grpo",
                data=_write(tmp_path / "p.jsonl", _records(24)),
                reward=["numeric", f"{tmp_path / 'rw.py'}:spread"], num_generations=2,
                batch=4, max_completion_length=4, steps=4, warmup_steps=0, lr=1e-6,
                stop=["\\n"], temperature=1.0, precision="fp32")
    base.update(kw)
    return Trainer(_opts(tmp_path, **base), str(tmp_path / out))


# ---------------------------------------------------------------------------- maths
def _direct_loss(logp, mask, adv, old, ref, lt, lo, hi, beta, max_len, accum, n_items):
    """TRL's _compute_loss written out token by token, in float64."""
    N, T = logp.shape
    per = np.zeros((N, T))
    for i in range(N):
        for t in range(T):
            r = np.exp(logp[i, t] - old[i, t])
            c = min(max(r, 1 - lo), 1 + hi)
            v = -min(r * adv[i], c * adv[i])
            if beta:
                d = ref[i, t] - logp[i, t]
                v += beta * (np.exp(d) - d - 1) * r
            per[i, t] = v * mask[i, t]
    if lt == "grpo":
        return np.mean(per.sum(1) / np.maximum(mask.sum(1), 1)) / accum
    if lt == "bnpo":
        return per.sum() / max(mask.sum(), 1) / accum
    if lt == "dr_grpo":
        return per.sum() / (N * max_len) / accum
    return per.sum() / n_items


@pytest.mark.parametrize("lt", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_token_loss_and_grad_equal_the_direct_sum_and_finite_differences(lt, beta):
    rng = np.random.default_rng(3)
    N, T = 5, 6
    logp = -rng.uniform(0.1, 3, (N, T))
    old = logp + rng.normal(0, 0.3, (N, T))      # ratios beyond the clip range too
    ref = logp + rng.normal(0, 0.5, (N, T))
    mask = (rng.random((N, T)) < 0.8).astype(float)
    mask[0] = 0.0                                # a completion left out entirely
    adv = rng.normal(0, 1, N)
    kw = dict(loss_type=lt, eps_low=0.2, eps_high=0.28, beta=beta, old=old, ref=ref,
              max_len=8, accum=2, n_items=40.0)
    got = token_loss(logp, mask, adv, **kw)
    want = _direct_loss(logp, mask, adv, old, ref, lt, 0.2, 0.28, beta, 8, 2, 40.0)
    assert got.loss == pytest.approx(want, rel=1e-12, abs=1e-15)
    h = 1e-6
    for i in range(N):
        for t in range(T):
            up, dn = logp.copy(), logp.copy()
            up[i, t] += h
            dn[i, t] -= h
            fd = (token_loss(up, mask, adv, **kw).loss - token_loss(dn, mask, adv, **kw).loss) \
                / (2 * h)
            assert got.grad[i, t] == pytest.approx(fd, abs=1e-7), (i, t)
    assert 0 < got.metrics["clip_ratio/region_mean"] < 1
    assert ("kl" in got.metrics) == bool(beta)


@pytest.mark.parametrize("chunked", [False, True])
def test_row_losses_and_grads_at_a_temperature_are_those_of_the_logits_over_it(chunked):
    # logits / temp are the logits of the head / temp: the same row losses and
    # grads (the head's times 1 / temp), up to the rounding of head / temp
    temp = 0.7
    cfg = dict(SMALL, vocab_size=97, n_attn_layer=0)
    m, s = rx.RxPtModel(cfg, seed=2), rx.RxPtModel(cfg, seed=2)
    s.params["head"][...] = m.params["head"] / np.float32(temp)
    rng = np.random.default_rng(1)
    x = rng.integers(1, 97, (2, 13)).astype(np.int32)
    y = np.where(rng.random((2, 13)) < 0.6, rng.integers(0, 97, (2, 13)), IGNORE).astype(np.int32)
    w = np.where(y != IGNORE, rng.normal(size=y.shape), 0.0)
    logits = m.forward(x, return_logits=True)
    z = logits.astype(np.float64) / temp
    z -= z.max(-1, keepdims=True)
    lsm = z - np.log(np.exp(z).sum(-1, keepdims=True))
    picked = np.take_along_axis(lsm, np.where(y != IGNORE, y, 0)[..., None], -1)[..., 0]
    direct = np.where(y != IGNORE, -picked, 0.0)
    m.forward(x, return_logits=not chunked)
    rl = m.row_losses(y, IGNORE, temperature=temp)
    np.testing.assert_allclose(rl, direct, rtol=1e-5, atol=1e-6)
    assert not np.allclose(rl, m.row_losses(y, IGNORE), rtol=1e-3)   # the temperature tells
    assert np.array_equal(m.backward_rows(y, w, IGNORE, temperature=temp), rl)
    s.forward(x, return_logits=not chunked)
    np.testing.assert_allclose(s.backward_rows(y, w, IGNORE), rl, rtol=1e-5, atol=1e-6)
    for n in m.param_names:
        want = s.grads[n] / temp if n == "head" else s.grads[n]
        np.testing.assert_allclose(m.grads[n], want, rtol=2e-4,
                                   atol=2e-6 * float(np.abs(want).max()), err_msg=n)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            m.row_losses(y, IGNORE, temperature=bad)


def test_stop_strings_read_escapes_alone():
    assert stop_strings(None) == ("\n\n",)
    assert stop_strings(["\\n", "。", "a\\tb"]) == ("\n", "。", "a\tb")


def test_on_policy_grad_is_the_advantage_weighted_logp_grad():
    logp = -np.ones((2, 3))
    got = token_loss(logp, np.ones((2, 3)), np.array([1.0, -2.0]), loss_type="grpo",
                     eps_low=0.2, eps_high=0.2)
    assert got.loss == pytest.approx(0.5)   # -mean(A): the ratio is 1
    assert np.allclose(got.grad, [[-1 / 6] * 3, [2 / 6] * 3])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls(scale):
    per = np.array([[1, 0], [0, 0], [np.nan, np.nan], [1, 1], [2, 2], [2, 2]], float)
    w = np.array([1.0, 0.5])
    a = advantages(per, w, 3, scale)
    r = np.array([1, 0, np.nan, 1.5, 3, 3])
    g = [r[:3], r[3:]]
    mean = np.repeat([np.nanmean(x) for x in g], 3)
    if scale == "batch":
        std = np.full(6, np.nanstd(r, ddof=1))
    else:
        std = np.repeat([np.nanstd(x, ddof=1) for x in g], 3)
    want = r - mean if scale == "none" else (r - mean) / (std + 1e-4)
    assert np.allclose(a.advantages, np.nan_to_num(want, nan=0.0), rtol=1e-12)
    assert a.advantages[2] == 0.0                 # unscorable: no signal
    assert list(a.zero_std) == ([False] * 6 if scale == "batch" else [False] * 3 + [False] * 3)


# -------------------------------------------------------------------------- rewards
def test_builtin_rewards():
    rs = load_rewards(["exact", "numeric", "format:\\d+", "length:2"], 4)
    got = score(rs, ["p"] * 3, ["12", " 7 ", "x 3.0"], [[1], [1, 2, 3], [1, 2, 3, 4]],
                {"answer": ["12", "7", "3"]})
    assert got.tolist() == [[1, 1, 1, 0], [1, 1, 0, -0.5], [0, 1, 0, -1]]


def test_a_reward_that_fails_stops_the_run_naming_it(tmp_path):
    (tmp_path / "rw.py").write_text(REWARD)
    f = str(tmp_path / "rw.py")
    for name, why in (("raises", "reward raises raised KeyError"),
                      ("short", "reward short returned 1 rewards for 2"),
                      ("word", "reward word returned 'high' for completion 0")):
        with pytest.raises(TrainError, match=why):
            score(load_rewards([f"{f}:{name}"], 4), ["a", "b"], ["x", "y"], [[1], [2]], {})
    with pytest.raises(TrainError, match="needs at least one --reward"):
        load_rewards([], 4)
    with pytest.raises(TrainError, match="has no function nope"):
        load_rewards([f"{f}:nope"], 4)
    with pytest.raises(TrainError, match="cannot import"):
        load_rewards(["no_such_module_xyz:f"], 4)
    with pytest.raises(TrainError, match="no 'answer' field"):
        score(load_rewards(["exact"], 4), ["a"], ["x"], [[1]], {})


# ----------------------------------------------------------------------------- data
def test_prompt_records_of_each_form_render_as_sft_does(tmp_path):
    tok = ByteTokenizer()
    recs = [{"prompt": "Hi", "answer": "1"},
            {"prompt": [{"role": "user", "content": "Hi"}], "answer": "2"},
            {"messages": [{"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "drop me"}], "answer": "3"}]
    p = read_prompts(_write(tmp_path / "p.jsonl", recs), tok)
    want = [SEPARATOR] + list(b"User: Hi\n\nAssistant:")
    assert p.ids == [want] * 3
    assert [c["answer"] for c in p.columns] == ["1", "2", "3"]
    assert p.prompts[2] == [{"role": "user", "content": "Hi"}]
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"prompt": ["Hi", "Yo"], "answer": ["1", "2"]}),
                   str(tmp_path / "p.parquet"))
    t = read_prompts(str(tmp_path / "p.parquet"), tok)
    assert t.ids[0] == want and t.columns[1] == {"answer": "2"}
    with pytest.raises(DataError, match=r"p2\.jsonl:1: no prompt"):
        read_prompts(_write(tmp_path / "p2.jsonl", [{"question": "x"}]), tok)


# ----------------------------------------------------------------------------- runs
def test_run_logs_trls_metrics_and_resumes_bit_for_bit(tmp_path):
    a = _grpo(tmp_path, "a", num_iterations=2, steps=5)
    a.run()
    rows = [r for r in a.read_log() if "reward" in r]
    for k in ("reward", "reward_std", "rewards/numeric/mean", "rewards/spread/mean",
              "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
              "clip_ratio/region_mean", "rollout_s", "update_s"):
        assert k in rows[0], k
    assert rows[0]["clip_ratio/region_mean"] == 0.0   # the first pass is on-policy
    # stopped at step 3 (mid-way through a batch used twice), then resumed
    assert all(r["grad_norm"] > 0 for r in rows) and rows[1]["loss"] != 0.0
    b = _grpo(tmp_path, "b", num_iterations=2, steps=5)
    b.run(stop=lambda: b.step_count == 3)
    Trainer.resume(str(tmp_path / "b"), steps=5).run()
    rb = [r for r in Trainer.resume(str(tmp_path / "b"), steps=5).read_log() if "reward" in r]
    assert [r["loss"] for r in rb] == [r["loss"] for r in rows]
    assert [r["reward"] for r in rb] == [r["reward"] for r in rows]


def test_grad_accum_splits_the_batch_into_micro_batches(tmp_path):
    one = _grpo(tmp_path, "one", batch=8, steps=1, loss_type="grpo")
    r1 = one.step()
    two = _grpo(tmp_path, "two", batch=4, grad_accum=2, steps=1, loss_type="grpo")
    r2 = two.step()
    assert r1["reward"] == r2["reward"]      # the same completions, from the same seeds
    assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-6, abs=1e-9)
    assert two.optim.grad_norm() == pytest.approx(one.optim.grad_norm(), rel=1e-4)
    one.close()
    two.close()


def test_cli_and_config_file_train_grpo(tmp_path, capsys):
    (tmp_path / "rw.py").write_text(REWARD)
    data = _write(tmp_path / "p.jsonl", _records(20))
    args = ["--preset", "tiny", "--n-attn-layer", "0", "--objective", "grpo", "--data", data,
            "--reward", "exact", f"{tmp_path / 'rw.py'}:first_digit", "--reward-weights",
            "1,0.5", "--num-generations", "2", "--batch", "4", "--max-completion-length", "3",
            "--loss-type", "bnpo", "--epsilon-high", "0.28", "--scale-rewards", "batch",
            "--mask-truncated-completions", "--steps", "2", "--threads", "2"]
    assert main(["train", *args, "--out", str(tmp_path / "cli")]) == 0
    # the header names GRPO's own beta and clipping, not the preference objectives'
    assert "  loss   grpo, beta 0, epsilon 0.2, epsilon_high 0.28\n" in capsys.readouterr().out
    cfg = tmp_path / "cli" / "config.toml"
    text = cfg.read_text()
    assert 'loss_type = "bnpo"' in text and "epsilon_high = 0.28" in text
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "cfg")]) == 0
    logs = []
    for d in ("cli", "cfg"):
        with open(os.path.join(tmp_path, d, "log.jsonl"), encoding="utf-8") as f:
            logs.append([json.loads(x) for x in f])
    assert [r.get("loss") for r in logs[0]] == [r.get("loss") for r in logs[1]]
    assert main(["train", "--preset", "tiny", "--beta", "0.1", "--steps", "1",
                 "--out", str(tmp_path / "x")]) == 1   # a GRPO option off --objective grpo


def test_options_are_checked(tmp_path):
    with pytest.raises(TrainError, match="--num-generations 3"):
        _grpo(tmp_path, "g3", num_generations=3)
    with pytest.raises(TrainError, match="--ref-from names the reference of the KL term"):
        _grpo(tmp_path, "rf", ref_from=str(tmp_path))
    with pytest.raises(TrainError, match="--beta > 0 needs a reference"):
        _grpo(tmp_path, "kl", beta=0.1)
    with pytest.raises(TrainError, match="--temperature > 0"):
        _grpo(tmp_path, "t0", temperature=0.0)
    with pytest.raises(TrainError, match="--epsilon applies to --objective grpo"):
        _opts(tmp_path, epsilon=0.3).resolved()


@pytest.mark.parametrize("base_dtype", ["q8_0", "bf16"])
def test_lora_over_a_frozen_base_rolls_out_and_trains_with_the_kl_term(tmp_path, base_dtype):
    from test_finetune import _base_run
    base = _base_run(tmp_path, model=dict(SMALL, n_attn_layer=0))
    tr = _grpo(tmp_path, "lq", init_from=base, model=None, tune="lora", lora_r=4,
               base_dtype=base_dtype, beta=0.1, steps=2, lr=1e-3)
    assert tr.model.base_dtype == base_dtype
    tr.run()
    rows = [r for r in tr.read_log() if "reward" in r]
    assert len(rows) == 2 and all(np.isfinite(r["kl"]) for r in rows)
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0.0   # the adapters start at zero


@pytest.mark.parametrize("source", [False, True])
def test_the_memory_check_measures_a_prompt_and_its_completion(tmp_path, monkeypatch, source):
    """The step's memory check is asked for sequences of the longest prompt
    plus --max-completion-length tokens (what an update runs), not --seq-len,
    for a new model and a fine-tune of a source alike."""
    from rwkvx_c.model import memory
    asked = []
    real = memory.check_step
    monkeypatch.setattr(memory, "check_step",
                        lambda m, b, t, *a, **k: (asked.append((b, t)), real(m, b, t, *a, **k)))
    kw = {}
    if source:
        from test_finetune import _base_run
        kw = dict(init_from=_base_run(tmp_path, model=dict(SMALL, n_attn_layer=0)), model=None,
                  tune="lora", lora_r=4)
        asked.clear()
    tr = _grpo(tmp_path, "mem", seq_len=4096, max_completion_length=6, **kw)
    longest = max(tr.pref.train.longest(), tr.pref.val.longest())
    assert asked == [(4, longest + 6)]


@pytest.mark.parametrize("full", [False, True])
def test_a_resumed_run_reads_the_pinned_reference_not_the_source(tmp_path, full):
    # --ref-from's run (or, for a full tune, --init-from's as the reference)
    # is pinned as the run starts: resumed after the source is gone, the
    # run goes on as one that never stopped
    from test_finetune import _base_run
    base = _base_run(tmp_path, model=dict(SMALL, n_attn_layer=0))
    kw = dict(init_from=base, model=None) if full else dict(ref_from=base)
    a = _grpo(tmp_path, "a", beta=0.1, steps=4, lr=1e-3, **kw)
    a.run()
    rows = [r for r in a.read_log() if "reward" in r]
    assert all(r["kl"] > 0.0 for r in rows[1:])   # the reference is read
    b = _grpo(tmp_path, "b", beta=0.1, steps=4, lr=1e-3, **kw)
    b.run(stop=lambda: b.step_count == 2)
    assert len(RunDir(str(tmp_path / "b")).pins()) == 1
    shutil.rmtree(base)
    Trainer.resume(str(tmp_path / "b"), steps=4).run()
    rb = [r for r in Trainer.resume(str(tmp_path / "b"), steps=4).read_log() if "reward" in r]
    assert [(r["loss"], r["kl"]) for r in rb] == [(r["loss"], r["kl"]) for r in rows]
    os.remove(RunDir(str(tmp_path / "b")).pins()[0])
    with pytest.raises(TrainError, match=r"the pin of the reference .* is missing"):
        Trainer.resume(str(tmp_path / "b"), steps=5)


def test_two_ranks_match_one_process(tmp_path):
    """Rollouts (each rank samples its prompts' groups, seeded as one
    process seeds them) and updates split over 2 MPI ranks: 10 steps give
    the one-process losses and grad norms within 1e-5 relative."""
    from test_distributed import _launch, _losses
    (tmp_path / "rw.py").write_text(REWARD)
    data = _write(tmp_path / "p.jsonl", _records(40))
    out = {}
    for lt in ("dapo", "grpo"):
        args = ["--preset", "tiny", "--n-attn-layer", "0", "--objective", "grpo",
                "--reward", "numeric", f"{tmp_path / 'rw.py'}:spread", "--num-generations",
                "2", "--batch", "8", "--max-completion-length", "4", "--stop", "\\n",
                "--num-iterations", "2", "--loss-type", lt, "--steps", "10", "--lr", "1e-6",
                "--warmup", "0", "--precision", "fp32", "--seed", "1", "--no-progress"]
        for n in (1, 2):
            d = str(tmp_path / f"{lt}{n}")
            r = _launch(n, ["--out", d] + args, tmp_path, data=data)
            assert r.returncode == 0, r.stderr
            out[lt, n] = [row for row in _losses(d)[1] if "reward" in row]
        one, two = out[lt, 1], out[lt, 2]
        assert len(one) == len(two) == 10 and {r["world_size"] for r in two} == {2}
        assert [r["reward"] for r in one] == [r["reward"] for r in two]
        for key in ("loss", "grad_norm"):
            a = np.array([r[key] for r in one])
            b = np.array([r[key] for r in two])
            assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), (lt, key, a, b)


def test_eval_rewards_scores_greedy_completions(tmp_path, capsys):
    tr = _grpo(tmp_path, "ev", steps=1)
    tr.run()
    held = _write(tmp_path / "held.jsonl", _records(5, seed=9))
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "ev"), "--rewards", held, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["rewards"]
    assert r["n_prompts"] == 5 and 0 <= r["reward"] <= 2
    assert set(r) >= {"rewards/numeric/mean", "rewards/spread/mean"}
    assert main(["eval", str(tmp_path / "ev"), "--rewards", held, "--reward", "exact",
                 "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["rewards"]) == \
        {"reward", "rewards/exact/mean", "n_prompts"}
    assert main(["eval", str(tmp_path / "ev"), "--reward", "exact"]) == 2
