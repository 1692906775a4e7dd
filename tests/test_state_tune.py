"""Trainable initial WKV states (docs/maths.md §Initial state): the model's
forward from them and the grad on them against the float64 reference of
tests/reference/model.py, and the reference's own grad by finite differences,
on odd sizes (head_size 5, 3 heads, T 11) with a batch whose sequences share
the one state."""
import numpy as np
import pytest

import rwkvx_c as rx

from checks import FWD_TOL, GRAD_TOL, assert_rel, full_config, token_batch
from reference.autograd import Var
from reference.model import leaves, model_forward, model_loss

CFG = full_config(dict(n_embd=15, n_head=3, head_size=5, n_rwkv_layer=3, n_attn_layer=0,
                       vocab_size=19, Dw=4, Da=3, Dg=5, Dv=3, ffn_dim=21, chunk_size=4,
                       moba_top_k=1))
T, B, IGNORE = 11, 3, 4


def _data(seed):
    return token_batch(CFG["vocab_size"], B, T, seed, IGNORE)


def _model(seed):
    m = rx.RxPtModel(CFG, seed=seed)
    m.enable_state()
    rng = np.random.default_rng(seed + 100)
    m.state[...] = rng.standard_normal(m.state.shape).astype(np.float32) * 0.5
    return m


def _reference(m, tokens, targets):
    lv = leaves(m.params)
    s0 = [Var(np.array(s, dtype=np.float64)) for s in m.state]
    for v in lv.values():
        v.requires_grad = False
    logits = model_forward(lv, CFG, tokens, state0=s0)
    loss = model_loss(lv, CFG, tokens, targets, IGNORE, state0=s0)
    loss.backward()
    return loss.value, logits.value, np.stack([s.grad for s in s0])


def test_state_starts_at_zero_and_changes_nothing_then():
    m = rx.RxPtModel(CFG, seed=3)
    tokens, targets = _data(4)
    ref = m.forward(tokens)
    assert m.state is None and m.state_grad is None
    m.enable_state()
    assert m.state.shape == (3, 3, 5, 5) and not np.any(m.state)
    assert np.array_equal(m.forward(tokens), ref)   # a zero state is the zero-state model
    m.enable_state()                                # idempotent: the same arenas
    m.backward(targets, ignore_index=IGNORE)
    assert np.any(m.state_grad)


def test_state_forward_and_grad_match_reference():
    m = _model(5)
    tokens, targets = _data(6)
    ref_loss, ref_logits, ref_grad = _reference(m, tokens, targets)
    assert_rel("state.logits", m.forward(tokens), ref_logits, FWD_TOL)
    m.state_grad[...] = 123.0     # written, never accumulated
    loss = m.backward(targets, ignore_index=IGNORE)
    assert abs(loss - ref_loss) <= FWD_TOL * abs(ref_loss)
    assert_rel("state.grad", m.state_grad, ref_grad, GRAD_TOL)
    g = m.state_grad.copy()
    m.backward(targets, ignore_index=IGNORE)
    assert np.array_equal(m.state_grad, g)


def test_state_grad_is_the_sum_over_sequences():
    m = _model(7)
    tokens, targets = _data(8)
    m.forward(tokens)
    m.backward(targets, ignore_index=IGNORE)
    whole = m.state_grad.copy()
    n_valid = [(targets[b] != IGNORE).sum() for b in range(B)]
    acc = np.zeros_like(whole, dtype=np.float64)
    for b in range(B):
        m.forward(tokens[b:b + 1])
        m.backward(targets[b:b + 1], ignore_index=IGNORE)
        acc += m.state_grad * (n_valid[b] / sum(n_valid))   # each row's share of the mean
    assert_rel("state.grad.sum", whole, acc, GRAD_TOL)


def test_state_grad_finite_differences():
    m = _model(9)
    tokens, targets = _data(10)
    _, _, ref_grad = _reference(m, tokens, targets)
    params = {n: v.astype(np.float64) for n, v in m.params.items()}
    state = m.state.astype(np.float64)

    def loss_at(idx, delta):
        s = state.copy()
        s[idx] += delta
        return model_loss(params, CFG, tokens, targets, IGNORE,
                          state0=[Var(x, requires_grad=False) for x in s]).value

    m.forward(tokens)
    m.backward(targets, ignore_index=IGNORE)
    rng = np.random.default_rng(0)
    scale, eps = np.abs(ref_grad).max(), 1e-5
    picks = {np.unravel_index(np.abs(ref_grad[i]).argmax(), ref_grad[i].shape) for i in range(3)}
    idxs = [(i, *p) for i, p in zip(range(3), picks)]
    idxs += [tuple(int(rng.integers(s)) for s in state.shape) for _ in range(4)]
    for idx in idxs:
        fd = (loss_at(idx, eps) - loss_at(idx, -eps)) / (2 * eps)
        assert abs(ref_grad[idx] - fd) <= 1e-6 * scale + 1e-9, (idx, ref_grad[idx], fd)
        assert abs(m.state_grad[idx] - fd) <= GRAD_TOL * scale + 1e-9, idx


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_state_grad_bit_identical_across_threads(threads, restore_threads):
    m = _model(11)
    tokens, targets = _data(12)
    rx.set_num_threads(1)
    m.forward(tokens)
    m.backward(targets, ignore_index=IGNORE)
    g1 = m.state_grad.copy()
    rx.set_num_threads(threads)
    m.forward(tokens)
    m.backward(targets, ignore_index=IGNORE)
    assert np.array_equal(m.state_grad, g1)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_frozen_base_gives_the_same_state_grad_without_weight_grads(precision):
    """frozen: the same loss and state grad bit for bit, and no weight-grad
    product runs (the grad arena keeps what was in it: the head's and the
    projections' grads are never written)."""
    m = _model(13)
    m.precision = precision
    tokens, targets = _data(14)
    m.forward(tokens)
    loss = m.backward(targets, ignore_index=IGNORE)
    g = m.state_grad.copy()
    m.frozen = True
    assert m.frozen
    m.grad_buffer[...] = 123.0
    assert m.backward(targets, ignore_index=IGNORE) == loss
    assert np.array_equal(m.state_grad, g)
    for name in ("head", "emb", "blocks.1.tm.receptance_w", "blocks.2.cm.ffn_value_w",
                 "blocks.1.tm.w1"):
        assert np.all(m.grads[name] == 123.0), name
    m.frozen = False
    m.backward(targets, ignore_index=IGNORE)
    assert not np.all(m.grads["head"] == 123.0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layers", [0, 1])
def test_recompute_and_the_chunked_head_keep_the_state_grad(precision, layers):
    """A state tune under --grad-cp (each block's forward again in its
    backward, from a fresh copy of its initial state) and the chunked head
    gives the same loss, state grads and weight grads, bit for bit, frozen
    base or not; with and without an attention block."""
    cfg = dict(CFG, n_attn_layer=layers)
    tokens, targets = _data(7)
    runs = []
    for recompute in (False, True):
        for frozen in (False, True):
            m = _model(3) if layers == 0 else rx.RxPtModel(cfg, seed=3, precision=precision)
            if layers:
                m.enable_state()
                m.state[...] = np.random.default_rng(9).standard_normal(
                    m.state.shape).astype(np.float32) * 0.5
            m.precision = precision
            m.recompute = recompute
            if frozen:
                m.freeze_ranges(np.array([[0, m.param_buffer.size]], np.int64))
            m.forward(tokens, return_logits=False)
            loss = m.backward(targets, ignore_index=IGNORE)
            runs.append((frozen, loss, m.state_grad.copy(), m.grad_buffer.copy()))
    for frozen, loss, sg, g in runs[1:]:
        assert loss == runs[0][1] and np.array_equal(sg, runs[0][2])
        if not frozen:
            assert np.array_equal(g, runs[0][3])
    assert np.array_equal(runs[1][3], runs[3][3])   # frozen: the same (few) grads written


def test_load_states_checks_the_shape():
    from rwkvx_c.errors import CheckpointError
    from rwkvx_c.model.weights import load_states
    m = rx.RxPtModel(CFG, seed=0)
    load_states(m, None, "nothing")
    assert m.state is None                      # no states: the model starts from zero
    with pytest.raises(CheckpointError, match="initial states have shape"):
        load_states(m, np.zeros((2, 3, 5, 5), np.float32), "ckpt")
    s = np.random.default_rng(0).standard_normal((3, 3, 5, 5)).astype(np.float32)
    load_states(m, s, "ckpt")
    assert np.array_equal(m.state, s)
