"""Recurrent inference (csrc/infer.c): step-by-step logits equal the
full-sequence forward's, with MoBA selection active; sampling helpers."""
import os

import numpy as np
import pytest

import rwkvx_c as rx
from rwkvx_c.sample import generate, sample_token

from checks import FWD_TOL, assert_rel

# chunk 4, top_k 1: beyond position 8 every query selects among earlier chunks
CFG = dict(n_embd=32, n_head=2, head_size=16, n_rwkv_layer=3, n_attn_layer=2, vocab_size=256,
           ffn_dim=48, Dw=8, Da=8, Dg=8, Dv=4, chunk_size=4, moba_top_k=1)


def _close(got, want):
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


@pytest.mark.parametrize("seed", [0, 1])
def test_step_by_step_equals_full_forward(seed):
    # the test init (docs/layout.md §Init schemes): every block active
    m = rx.RxPtModel(CFG, seed=seed)
    T = 37
    toks = np.random.default_rng(seed).integers(0, 256, T).astype(np.int32)
    full = m.forward(toks)
    st = rx.InferState(m, max_len=T)
    steps = np.concatenate([st.forward(toks[t:t + 1]) for t in range(T)])
    _close(steps, full)
    assert st.pos == T
    # a prompt at once, then single steps, then a few at a time
    st.reset()
    parts = [st.forward(toks[:13])]
    parts += [st.forward(toks[t:t + 1]) for t in range(13, 20)]
    parts.append(st.forward(toks[20:]))
    _close(np.concatenate(parts), full)
    # the selection matters here: attending every chunk gives other logits
    dense = rx.RxPtModel(dict(CFG, moba_top_k=0), seed=seed).forward(toks)
    assert np.max(np.abs(dense - full)) > 1e-3


# odd sizes, ln0, selection from position 6 on (chunk 3, top_k 1)
ODD = dict(n_embd=15, n_head=3, head_size=5, n_rwkv_layer=4, n_attn_layer=2, vocab_size=23,
           ffn_dim=19, Dw=3, Da=5, Dg=7, Dv=2, chunk_size=3, moba_top_k=1, ln0=1)
PIECES = [1] * 9 + [4, 1, 7, 2, 11, 1, 5]   # 41 tokens: single steps, then chunks


@pytest.mark.parametrize("cfg", [CFG, ODD, dict(ODD, n_attn_layer=0)],
                         ids=["hybrid", "odd_ln0", "rwkv"])
def test_inference_steps_through_the_training_forward(cfg):
    """Each block advances through the training forward's own function
    (rx_block_step, rx_attn_step in csrc/), so: a call at position 0 gives
    the forward's logits bit for bit; RWKV blocks carry their state exactly,
    at any split; attention after position 0 runs the decoding core, which
    selects the same chunks with the same code and differs from the
    training core only in the order its softmax sums a query's keys (one
    query at a time against dense tiles merged by log-sum-exp), a few float32
    roundings of the attention output, within the forward tolerance."""
    m = rx.RxPtModel(cfg, seed=5)
    T = sum(PIECES)
    toks = np.random.default_rng(5).integers(0, cfg["vocab_size"], T).astype(np.int32)
    full = m.forward(toks)
    st = rx.InferState(m, max_len=T)
    assert np.array_equal(st.forward(toks), full)
    st.reset()
    ends = np.cumsum(PIECES)
    got = np.concatenate([st.forward(toks[e - n:e]) for n, e in zip(PIECES, ends)])
    assert st.pos == T
    assert np.array_equal(got[:1], full[:1])
    if cfg["n_attn_layer"] == 0:
        assert np.array_equal(got, full)
    else:
        assert_rel("infer.pieces", got, full, FWD_TOL)


def test_rwkv_only_and_state_reset():
    cfg = dict(CFG, n_attn_layer=0)
    m = rx.RxPtModel(cfg, seed=4)
    toks = np.arange(50, 90, dtype=np.int32)
    full = m.forward(toks)
    st = rx.InferState(m, max_len=1)  # no attention: max_len does not bound it
    a = np.concatenate([st.forward(toks[t:t + 1]) for t in range(len(toks))])
    _close(a, full)


def test_bad_inputs():
    m = rx.RxPtModel(CFG)
    st = rx.InferState(m, max_len=5)
    with pytest.raises(ValueError, match="max_len"):
        st.forward(np.zeros(6, np.int32))
    assert st.pos == 0
    with pytest.raises(ValueError, match="tokens"):
        st.forward(np.array([256], np.int32))
    with pytest.raises(TypeError, match="tokens"):
        st.forward(np.zeros(2, np.int64))
    with pytest.raises(ValueError, match="max_len"):
        rx.InferState(m, max_len=0)
    with pytest.raises(TypeError):
        rx.InferState(object(), max_len=3)


def test_sample_token():
    rng = np.random.default_rng(0)
    logits = np.array([0.0, 5.0, 4.0, -10.0])
    assert sample_token(logits, rng, temperature=0) == 1
    draws = {sample_token(logits, rng, temperature=1.0, top_p=0.5) for _ in range(50)}
    assert draws == {1}  # the top token alone holds > 0.5 of the mass
    draws = {sample_token(logits, rng, temperature=1.0, top_p=0.99) for _ in range(200)}
    assert draws == {1, 2}
    draws = {sample_token(logits, rng, temperature=100.0, top_p=1.0) for _ in range(200)}
    assert draws == {0, 1, 2, 3}


def test_generate_is_seeded():
    m = rx.RxPtModel(CFG, seed=2)
    a = "".join(generate(m, "def f(", 30, temperature=1.0, top_p=0.9, seed=3))
    b = "".join(generate(m, "def f(", 30, temperature=1.0, top_p=0.9, seed=3))
    assert a == b and len(a.encode("utf-8", "replace")) >= 1
    g = "".join(generate(m, "", 5, temperature=0))
    assert isinstance(g, str)


_LONG_PROMPT = """
import resource, sys, numpy as np, rwkvx_c as rx
from rwkvx_c.sample import generate
cfg = dict(%r, n_embd=128, n_head=2, head_size=64, ffn_dim=512, n_attn_layer=0)
m = rx.RxPtModel(cfg, seed=2)
prompt = bytes(np.random.default_rng(0).integers(32, 127, %d).astype(np.uint8))
"".join(generate(m, prompt[:600], 2))          # warm: the threads, the arenas
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
"".join(generate(m, prompt, 2))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_long_prompt_runs_in_pieces():
    """A 40,000-byte prompt raises the peak RSS by well under what one call
    over it would hold (its intermediates, ~100 floats per token per RWKV
    block, and its [T, vocab] logits: ~60 MB a block here), in a fresh
    process (RWKV blocks only: attention's key/value cache is the prompt's
    length by nature); and the pieces' logits are the one call's to
    rounding."""
    import subprocess
    import sys
    # run from tests/: in the repository root a non-editable install's
    # source tree would shadow the installed package
    r = subprocess.run([sys.executable, "-c", _LONG_PROMPT % (CFG, 40000)],
                       capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-1]) < 24 << 20, r.stdout
    m = rx.RxPtModel(CFG, seed=4)
    toks = np.random.default_rng(4).integers(0, 256, 1100).astype(np.int32)
    whole = rx.InferState(m, max_len=1100).forward(toks)[-1]
    st = rx.InferState(m, max_len=1100)
    for i in range(0, 1100, 512):
        last = st.forward(toks[i:i + 512])[-1]
    _close(last, whole)
