"""Batched generation (csrc/gen.c, GenState): slots advanced together, each
by one token or a prompt chunk, give every slot the logits it gets alone
(bit for bit: a GEMM row's result depends on that row alone) and the
training forward's over its sequence (bit for bit without attention; with
it, to float32 rounding: tests/test_infer.py says why)."""
import numpy as np
import pytest

import rwkvx_c as rx
from rwkvx_c.train.finetune import merge_adapters

from checks import FWD_TOL, assert_rel

# chunk 4, top_k 1: beyond position 8 every query selects among earlier chunks
HYB = dict(n_embd=32, n_head=2, head_size=16, n_rwkv_layer=3, n_attn_layer=2, vocab_size=256,
           ffn_dim=48, Dw=8, Da=8, Dg=8, Dv=4, chunk_size=4, moba_top_k=1)
RWKV = dict(HYB, n_attn_layer=0)
# odd sizes, ln0
ODD = dict(n_embd=15, n_head=3, head_size=5, n_rwkv_layer=4, n_attn_layer=2, vocab_size=23,
           ffn_dim=19, Dw=3, Da=5, Dg=7, Dv=2, chunk_size=3, moba_top_k=1, ln0=1)
ODD_RWKV = dict(ODD, n_attn_layer=0)

# per slot: (prompt length, the step it joins at, tokens in all)
PLAN = [(7, 0, 23), (1, 0, 17), (12, 3, 25), (5, 6, 9)]


def _seqs(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg["vocab_size"], n).astype(np.int32) for _, _, n in PLAN]


def _batched(g, seqs, plan=PLAN, slots=None):
    """Every sequence through g by plan, slots sharing steps: slot k joins
    at its step with its prompt, then takes one token a step. Each slot's
    logits at every position, and the step logits (all=0) checked against
    the last rows."""
    slots = list(range(len(seqs))) if slots is None else slots
    got = [[] for _ in seqs]
    done = [0] * len(seqs)
    step = 0
    while any(done[k] < len(s) for k, s in enumerate(seqs)):
        sl, cnt, tok = [], [], []
        for k, (p, start, n) in enumerate(plan):
            if step < start or done[k] >= n:
                continue
            c = p if done[k] == 0 else 1
            sl.append(slots[k])
            cnt.append(c)
            tok.append(seqs[k][done[k]:done[k] + c])
        if sl:
            out = g.step(sl, cnt, np.concatenate(tok), all_logits=True)
            ends = np.cumsum(cnt)
            for i, s in enumerate(sl):
                k = slots.index(s)
                got[k].append(out[ends[i] - cnt[i]:ends[i]])
                done[k] += cnt[i]
        step += 1
    return [np.concatenate(x) for x in got]


def _alone(m, seq, prompt, max_len=64):
    g = rx.GenState(m, 1, max_len=max_len, max_tokens=max(prompt, 32))
    parts = [g.step([0], [prompt], seq[:prompt], all_logits=True)]
    parts += [g.step([0], [1], seq[t:t + 1]) for t in range(prompt, len(seq))]
    return np.concatenate(parts)


def _check(m, cfg, seed=0, exact_train=None):
    seqs = _seqs(cfg, seed)
    g = rx.GenState(m, 6, max_len=64, max_tokens=32)
    # the slots in a shuffled order of the state's six
    got = _batched(g, seqs, slots=[4, 0, 5, 2])
    exact = cfg["n_attn_layer"] == 0 if exact_train is None else exact_train
    for k, s in enumerate(seqs):
        assert g.pos([4, 0, 5, 2][k]) == len(s)
        assert np.array_equal(got[k], _alone(m, s, PLAN[k][0])), f"slot {k}"
        full = m.forward(s)
        if exact:
            assert np.array_equal(got[k], full), f"slot {k}"
        else:
            assert np.array_equal(got[k][:PLAN[k][0]], full[:PLAN[k][0]])
            assert_rel("gen.train", got[k], full, FWD_TOL)


@pytest.mark.parametrize("cfg", [RWKV, HYB, ODD, ODD_RWKV],
                         ids=["rwkv", "hybrid", "odd_ln0", "odd_ln0_rwkv"])
def test_batched_equals_alone_and_training(cfg):
    _check(rx.RxPtModel(cfg, seed=5), cfg)


def test_state_tuned_initial_states():
    m = rx.RxPtModel(HYB, seed=2)
    m.enable_state()
    m.state[...] = np.random.default_rng(2).standard_normal(m.state.shape).astype(np.float32) * .1
    _check(m, HYB)


def test_lora_unmerged():
    m = rx.RxPtModel(RWKV, seed=3)
    names = [n for n in m.param_names if n.endswith(("key_w", "value_w", "receptance_w"))]
    m.enable_lora(4, 8.0, names)
    m.lora_buffer[...] = (np.random.default_rng(3).standard_normal(m.lora_buffer.shape) *
                          0.05).astype(np.float32)
    _check(m, RWKV)
    seqs = _seqs(RWKV)
    got = _batched(rx.GenState(m, 4, max_len=64, max_tokens=32), seqs)
    merge_adapters(m)
    for k, s in enumerate(seqs):
        assert_rel("gen.lora_merged", got[k], m.forward(s), FWD_TOL)


@pytest.mark.parametrize("dtype", ["bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_frozen_base(dtype, precision):
    # Q8_0 blocks of 32 along each matrix's input (the embedding's rows)
    _check(_based(dtype, precision), HYB)


def _based(dtype, precision="fp32", cfg=HYB):
    """cfg's model with every matrix whose input is whole 32-value blocks
    in a frozen base of dtype"""
    src = rx.RxPtModel(cfg, seed=4)
    names = [n for n in src.param_names if src.params[n].ndim == 2 and
             src.params[n].shape[n == "emb"] % 32 == 0]
    m = rx.RxPtModel(cfg, seed=4, init=False, precision=precision)
    m.param_buffer[...] = src.param_buffer
    m.set_base(dtype, names)
    for n in names:
        m.base_fill(n, src.params[n])
    return m


@pytest.mark.parametrize("cfg", [RWKV, HYB], ids=["rwkv", "hybrid"])
@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fast_decode(dtype, precision, cfg):
    # the fast decode: each slot's logits are its own alone (bit for bit),
    # near the exact path's, and not them (the integer products ran)
    m = _based(dtype, precision, cfg)
    seqs = _seqs(cfg)
    exact = _batched(rx.GenState(m, 4, max_len=64, max_tokens=32), seqs)
    g = rx.GenState(m, 6, max_len=64, max_tokens=32, fast_decode=True)
    assert g.fast_decode
    got = _batched(g, seqs, slots=[4, 0, 5, 2])
    for k, s in enumerate(seqs):
        a = rx.GenState(m, 1, max_len=64, max_tokens=32, fast_decode=True)
        parts = [a.step([0], [PLAN[k][0]], s[:PLAN[k][0]], all_logits=True)]
        parts += [a.step([0], [1], s[t:t + 1]) for t in range(PLAN[k][0], len(s))]
        assert np.array_equal(got[k], np.concatenate(parts)), f"slot {k}"
        assert not np.array_equal(got[k], exact[k])
        # int8 activations: about 1% of a logit's range at a step, which the
        # recurrence carries on (the hybrid's top-1 chunk choice may flip)
        rms = np.sqrt(np.mean((got[k] - exact[k]) ** 2) / np.mean(exact[k] ** 2))
        assert cfg is HYB or rms < 0.05, rms
    g.fast_decode = False
    for slot in range(6):
        g.reset(slot)
    assert np.array_equal(_batched(g, seqs, slots=[4, 0, 5, 2])[0], exact[0])
    with pytest.raises(TypeError, match="fast_decode"):
        g.fast_decode = "yes"


def test_bf16_precision():
    _check(rx.RxPtModel(RWKV, seed=6, precision="bf16"), RWKV)


def test_reset_copy_and_neighbours():
    """A slot that ends (reset) or joins changes no other slot's logits;
    copy clones a slot's state."""
    m = rx.RxPtModel(HYB, seed=7)
    s = _seqs(HYB, 7)[0]
    g = rx.GenState(m, 3, max_len=64, max_tokens=32)
    ref = _alone(m, s, 7)
    a = g.step([0], [7], s[:7], all_logits=True)
    g.step([1, 2], [5, 3], np.arange(8, dtype=np.int32))
    g.reset(1)
    rows = [a]
    for t in range(7, len(s)):
        other = np.array([t % 256], np.int32)
        out = g.step([2, 0], [1, 1], np.concatenate([other, s[t:t + 1]]))
        rows.append(out[1:])
        if t == 12:
            g.copy(1, 0)
            assert g.pos(1) == g.pos(0)
            assert np.array_equal(g.step([1], [1], s[t + 1:t + 2]), ref[t + 1:t + 2])
    assert np.array_equal(np.concatenate(rows), ref)
    g.reset(0)
    assert g.pos(0) == 0 and g.pos(2) == 3 + len(s) - 7


def test_max_len_refused_and_nothing_moves():
    m = rx.RxPtModel(HYB, seed=8)
    g = rx.GenState(m, 2, max_len=6, max_tokens=16)
    g.step([0, 1], [5, 2], np.arange(7, dtype=np.int32))
    with pytest.raises(ValueError, match="max_len"):
        g.step([1, 0], [1, 2], np.arange(3, dtype=np.int32))
    assert (g.pos(0), g.pos(1)) == (5, 2)
    # a pure RWKV model ignores max_len
    r = rx.GenState(rx.RxPtModel(RWKV, seed=8), 1, max_len=1, max_tokens=4)
    r.step([0], [4], np.arange(4, dtype=np.int32))
    r.step([0], [4], np.arange(4, dtype=np.int32))
    assert r.pos(0) == 8


def test_bad_arguments():
    m = rx.RxPtModel(RWKV, seed=9)
    g = rx.GenState(m, 3, max_len=8, max_tokens=6)
    t = np.zeros(2, np.int32)
    bad = [(([0, 0], [1, 1], t), "distinct"), (([3], [2], t), "slots"),
           (([-1], [2], t), "slots"), (([0], [0], t[:0]), "counts"),
           (([0, 1], [1], t), "counts"), (([0], [7], np.zeros(7, np.int32)), "max_tokens"),
           (([0], [2], np.array([0, 256], np.int32)), "tokens"),
           (([0], [2], np.zeros(3, np.int32)), "tokens"), (([], [], t), "slots"),
           (([0], [2], t.astype(np.int64)), "tokens"), (([0.5], [2], t), "slots")]
    for args, what in bad:
        with pytest.raises((ValueError, TypeError), match=what):
            g.step(*args)
    with pytest.raises(ValueError, match="out"):
        g.step([0], [2], t, out=np.zeros((2, 256), np.float32))
    for f, args in ((g.reset, (3,)), (g.copy, (0, -1)), (g.pos, (5,))):
        with pytest.raises(ValueError):
            f(*args)
    for kw in (dict(n_slots=0), dict(n_slots=1, max_len=0), dict(n_slots=1, max_tokens=0)):
        with pytest.raises(ValueError):
            rx.GenState(m, **kw)
    assert all(g.pos(s) == 0 for s in range(3))
    out = np.empty((1, 256), np.float32)
    assert g.step(np.array([2]), np.array([2]), t, out=out) is out


@pytest.mark.parametrize("cfg", [RWKV, HYB], ids=["rwkv", "hybrid"])
def test_long_prompts_beside_decoding(cfg):
    """Prompts long enough that the WKV's units run on the whole team (a
    thread's group cut by rows), joining while a slot decodes."""
    m = rx.RxPtModel(cfg, seed=10)
    plan = [(1, 0, 40), (150, 2, 153), (90, 2, 92), (130, 5, 131)]
    rng = np.random.default_rng(10)
    seqs = [rng.integers(0, 256, n).astype(np.int32) for _, _, n in plan]
    got = _batched(rx.GenState(m, 4, max_len=160, max_tokens=400), seqs, plan)
    for k, s in enumerate(seqs):
        assert np.array_equal(got[k], _alone(m, s, plan[k][0], max_len=160)), f"slot {k}"
        if cfg["n_attn_layer"] == 0:
            assert np.array_equal(got[k], m.forward(s)), f"slot {k}"
        else:
            assert_rel("gen.train", got[k], m.forward(s), FWD_TOL)
