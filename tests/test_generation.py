"""The batched generation engine (rwkvx_c.generation, docs/training.md
§Sampling): a sequence's tokens do not depend on the batch, stop reasons,
log-probabilities, n samples forking one prompt, slots refilled mid-way,
`sample --prompts`, and
a base-holding run kept as it trained (and its fast decode)."""
import json
import os

import numpy as np
import pytest
from test_generate import HYBRID, RWKV, _save, bigram_model

import rwkvx_c as rx
from rwkvx_c.cli import main
from rwkvx_c.errors import SampleError
from rwkvx_c.generation import STOP_REASONS, Request, Sampling, generate, run_requests
from rwkvx_c.sample import load_run

PROMPTS = ["def f(", "hello", "", "x" * 40]
HOT = Sampling(temperature=1.0, top_p=0.9, alpha_presence=0.2, alpha_frequency=0.3)


@pytest.mark.parametrize("cfg", [RWKV, HYBRID], ids=["rwkv", "hybrid"])
def test_a_sequence_is_the_same_at_any_batch(cfg):
    m = rx.RxPtModel(cfg, seed=7)
    runs = [generate(m, PROMPTS, n=3, max_new_tokens=25, sampling=HOT, seed=5, batch_size=b)
            for b in (1, 4, 64)]
    for a, b in zip(runs[0], runs[2]):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
    for other in runs[1:]:
        assert [(c.text, c.token_ids) for c in other] == [(c.text, c.token_ids) for c in runs[0]]
    # samples of one prompt differ (their own streams), the seed matters
    assert len({tuple(c.token_ids) for c in runs[0][:3]}) == 3
    again = generate(m, PROMPTS, n=3, max_new_tokens=25, sampling=HOT, seed=6)
    assert [c.token_ids for c in again] != [c.token_ids for c in runs[0]]


def test_greedy_equals_the_streaming_generate():
    from rwkvx_c.sample import generate as stream
    m = rx.RxPtModel(RWKV, seed=3)
    outs = generate(m, PROMPTS, max_new_tokens=30, sampling=Sampling(temperature=0))
    for p, c in zip(PROMPTS, outs):
        assert c.text == "".join(stream(m, p, 30, temperature=0))
        assert c.stop_reason == "length" and len(c.token_ids) == 30


def test_stop_reasons():
    m = bigram_model()   # after ":" it writes " OK." then newlines
    p = "User: Hi\n\nAssistant:"
    s = Sampling(temperature=0)
    [c] = generate(m, p, max_new_tokens=12, sampling=s)
    assert (c.text, c.stop_reason) == (" OK." + "\n" * 8, "length")
    [c] = generate(m, p, max_new_tokens=12, sampling=Sampling(temperature=0, stop="\n\n"))
    assert (c.text, c.stop_reason) == (" OK.", "stop")
    assert c.token_ids == [ord(t) for t in " OK.\n\n"]   # what was drawn, the stop included
    [c] = generate(m, p, max_new_tokens=12, sampling=Sampling(temperature=0,
                                                               token_stop=[ord(".")]))
    assert (c.text, c.stop_reason, c.token_ids[-1]) == (" OK", "stop_id", ord("."))
    assert set(STOP_REASONS) == {"length", "stop", "stop_id"}


def test_logprobs_are_the_log_softmax_of_each_steps_logits():
    m = rx.RxPtModel(HYBRID, seed=4)
    [c] = generate(m, "abc", max_new_tokens=10, sampling=HOT, seed=2)
    st = rx.GenState(m, 1, max_len=64)
    logits = st.step([0], [3], np.frombuffer(b"abc", np.uint8).astype(np.int32))[0]
    for t, lp in zip(c.token_ids, c.logprobs):
        z = logits.astype(np.float64)
        want = z[t] - (np.log(np.exp(z - z.max()).sum()) + z.max())
        assert lp == pytest.approx(want, rel=1e-12, abs=1e-12)
        logits = st.step([0], [1], np.array([t], np.int32))[0]


def test_a_slot_refilled_midway_changes_no_other():
    """Two slots, five requests of different lengths: slots free and refill
    while others run; every sequence equals its run alone."""
    m = rx.RxPtModel(RWKV, seed=8)
    reqs = [Request(list(b"ab" * (i + 1)), 1, max_new_tokens=3 + 7 * i) for i in range(5)]
    together = run_requests(m, reqs, HOT, 40, seed=1, batch_size=2)
    for i, r in enumerate(reqs):
        alone = run_requests(m, [Request(r.ids, 1, r.max_new_tokens)] * (i + 1), HOT, 40,
                             seed=1, batch_size=1)[i]
        assert together[i][0].token_ids == alone[0].token_ids
        assert len(together[i][0].token_ids) == r.max_new_tokens


def test_n_samples_fork_one_prompt_read_once(monkeypatch):
    m = rx.RxPtModel(RWKV, seed=9)
    steps = []
    real = rx.GenState.step

    class Counting(rx.GenState):
        def step(self, slots, counts, tokens, all_logits=False, out=None):
            steps.append(list(counts))
            return real(self, slots, counts, tokens, all_logits, out)
    monkeypatch.setattr(rx._core, "GenState", Counting)
    outs = generate(m, "y" * 30, n=5, max_new_tokens=4, sampling=HOT, batch_size=8)
    assert [c.sample_index for c in outs] == list(range(5))
    assert steps[0] == [30]   # the prompt once; its state copied to the other four
    assert sum(sum(s) for s in steps) == 30 + 5 * 3
    # at batch 2 the prompt is read again for the samples that wait
    steps.clear()
    assert [c.token_ids for c in generate(m, "y" * 30, n=5, max_new_tokens=4, sampling=HOT,
                                          batch_size=2)] == [c.token_ids for c in outs]


def test_bad_requests_are_one_line():
    m = rx.RxPtModel(RWKV)
    for kw, what in [({"n": 0}, "n must"), ({"max_new_tokens": 0}, "at least 1")]:
        with pytest.raises(SampleError, match=what):
            generate(m, "a", **kw)
    with pytest.raises(SampleError, match="str or bytes"):
        generate(m, [[1, 2]])


def test_cli_prompts_file(tmp_path, capsys):
    run = _save(bigram_model(), str(tmp_path / "run"))
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "User: Hi\n\nAssistant:", "id": 7}) + "\n\n"
                   + json.dumps({"prompt": "K"}) + "\n")
    args = ["sample", run, "--prompts", str(src), "--temperature", "0", "--max-new-tokens", "6",
            "--stop", "\n\n", "--num-samples", "2"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "tokens/s" in err.strip().splitlines()[-1]
    recs = [json.loads(x) for x in (tmp_path / "p.completions.jsonl").read_text().splitlines()]
    assert recs[0]["id"] == 7 and len(recs[0]["completions"]) == 2
    c = recs[0]["completions"][0]
    assert (c["text"], c["stop_reason"]) == (" OK.", "stop")
    assert len(c["token_ids"]) == len(c["logprobs"]) == 6
    assert recs[1]["completions"][1]["text"] == "."
    out = tmp_path / "o.jsonl"
    assert main([*args, "--out", str(out)]) == 0 and out.exists()
    # never over the input; bad records and misplaced options are one line
    for extra, msg in [(["--out", str(src)], "is the prompts file itself"),
                       (["--prompt", "x"], "not both")]:
        assert main([*args, *extra]) != 0
        assert msg in capsys.readouterr().err
    assert main(["sample", run, "--num-samples", "2"]) != 0
    assert "go with --prompts" in capsys.readouterr().err
    src.write_text('{"text": "no prompt"}\n')
    assert main(args) != 0
    assert 'p.jsonl:1: a record must be an object with a "prompt"' in capsys.readouterr().err
    assert json.loads(out.read_text().splitlines()[0])["id"] == 7   # untouched


def test_a_lora_run_holds_its_base_as_trained(tmp_path, capsys):
    """A LoRA run on a Q8_0 base samples from that base as it trained
    (rows in Q8_0, adapters unmerged); the memory check states the base's
    dtype; greedy text matches the merged float32 model's where the
    quantisation does not flip an argmax (checked by log-probabilities)."""
    base, lora = str(tmp_path / "base"), str(tmp_path / "lora")
    common = ["--data", os.path.join(os.path.dirname(__file__), "data", "chat.jsonl"),
              "--batch", "2", "--seq-len", "32"]
    assert main(["train", "--preset", "tiny", "--steps", "1", "--out", base, *common]) == 0
    assert main(["train", "--init-from", base, "--tune", "lora", "--lora-r", "4",
                 "--base-dtype", "q8_0", "--steps", "1", "--out", lora, *common]) == 0
    capsys.readouterr()
    held, tok = load_run(lora, hold_base=True)
    merged, _ = load_run(lora)
    assert "emb" in held.base_names and held.lora_rank is not None
    assert merged.base_names == [] and merged.lora_rank is None
    a = generate(held, "User: hi", max_new_tokens=8, sampling=Sampling(temperature=0),
                 tokenizer=tok)[0]
    b = generate(merged, "User: hi", max_new_tokens=8, sampling=Sampling(temperature=0),
                 tokenizer=tok)[0]
    assert np.allclose(a.logprobs[:1], b.logprobs[:1], atol=0.05)
    import rwkvx_c.model.memory as memory
    seen = []
    real = memory.check
    memory.check = lambda need, what, advice: seen.append(what) or real(need, what, advice)
    try:
        load_run(lora, hold_base=True)
    finally:
        memory.check = real
    assert any("(its base q8_0)" in w for w in seen)
    assert main(["sample", lora, "--prompt", "User:", "--max-new-tokens", "3"]) == 0
    # the fast decode (int8 activations over the Q8_0 base): the same
    # tokens at any batch and in the streaming generate, near the exact path
    from rwkvx_c.sample import generate as stream
    greedy = Sampling(temperature=0)
    fast = [generate(held, ["User: hi", "x"] * 2, max_new_tokens=8, sampling=greedy,
                     tokenizer=tok, batch_size=b, fast_decode=True) for b in (1, 4)]
    assert [c.token_ids for c in fast[0]] == [c.token_ids for c in fast[1]]
    assert fast[0][0].text == "".join(stream(held, "User: hi", 8, temperature=0, tokenizer=tok,
                                             fast_decode=True))
    assert np.allclose(fast[0][0].logprobs[:1], a.logprobs[:1], atol=0.05)
    assert main(["sample", lora, "--prompt", "User:", "--max-new-tokens", "3",
                 "--fast-decode"]) == 0


def test_row_penalties_are_the_one_sequence_rule_bit_for_bit():
    """RowPenalties (sparse, the batch's) against Penalties (one sequence,
    the rwkv pipeline's rule) and a dense float64 reference of that rule,
    over draws, weightless draws, a banned id and a slot reset."""
    from rwkvx_c.generation.sampling import Penalties, RowPenalties
    V, R = 50, 4
    s = Sampling(alpha_presence=0.4, alpha_frequency=0.7, alpha_decay=0.9, token_ban=(3,))
    rows = RowPenalties(s, R, V)
    ones = [Penalties(s) for _ in range(R)]
    count, seen = np.zeros((R, V)), np.zeros((R, V), bool)
    rng = np.random.default_rng(0)
    for step in range(40):
        x = rng.standard_normal((R, V)).astype(np.float32)
        got = rows.apply(x, np.arange(R))
        dense = x.copy()
        dense[:, 3] = -np.inf
        dense -= np.where(seen, 0.4 + count * 0.7, 0.0).astype(np.float32)
        assert got.tobytes() == dense.tobytes()
        for r in range(R):
            assert got[r].tobytes() == ones[r].apply(x[r]).tobytes()
        ids = rng.integers(0, 12, R)                 # few ids, so they repeat
        w = (rng.random(R) < 0.8).astype(float)      # a weightless token counts 0
        rows.add(np.arange(R), ids, w)
        count *= 0.9
        count[np.arange(R), ids] += w
        seen[np.arange(R), ids] = True
        for r in range(R):
            ones[r].add(int(ids[r]), "x" if w[r] else " ")
        if step == 20:                               # slot 2 takes a new sequence
            rows.reset(2)
            ones[2] = Penalties(s)
            count[2], seen[2] = 0.0, False
