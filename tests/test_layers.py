"""LayerNorm (docs/maths.md §LayerNorm), embedding, head and cross-entropy
(docs/maths.md §Loss) against the float64 references."""
import numpy as np
import pytest

import rwkvx_c as rx

from checks import FWD_TOL, GRAD_TOL, LN_EPS, assert_rel, rand
from reference.autograd import leaf
from reference.layers import cross_entropy, embedding, head, layernorm

# ---------------------------------------------------------------------------
# LayerNorm

def check_layernorm(x, w, b, dy, label="layernorm"):
    xs, ws, bs = leaf(x), leaf(w), leaf(b)
    out = layernorm(xs, ws, bs, LN_EPS)
    (out * dy.astype(np.float64)).sum().backward()
    assert_rel(f"{label}_forward out", rx.layernorm_forward(x, w, b), out.value, FWD_TOL)
    dx, dw, db = rx.layernorm_backward(x, w, b, dy)
    assert_rel(f"{label}_backward dx", dx, xs.grad, GRAD_TOL)
    assert_rel(f"{label}_backward dw", dw, ws.grad, GRAD_TOL)
    assert_rel(f"{label}_backward db", db, bs.grad, GRAD_TOL)


@pytest.mark.parametrize("B,T,C", [(1, 1, 3), (1, 1, 8), (2, 5, 37), (3, 4, 64), (2, 70, 256)])
def test_layernorm_matches_reference(B, T, C):
    rng = np.random.default_rng([B, T, C])
    check_layernorm(rand(rng, B, T, C, scale=2.0) + 0.5, 1.0 + rand(rng, C, scale=0.2),
                    rand(rng, C, scale=0.2), rand(rng, B, T, C))


@pytest.mark.parametrize("noise", [1.0, 0.01])
def test_layernorm_large_offset(noise):
    """1000 + noise: a one-pass fp32 variance would lose every digit here."""
    rng = np.random.default_rng(3)
    B, T, C = 2, 9, 96
    x = (1000.0 + rng.standard_normal((B, T, C)) * noise).astype(np.float32)
    check_layernorm(x, 1.0 + rand(rng, C, scale=0.2), rand(rng, C, scale=0.2),
                    rand(rng, B, T, C), label="layernorm_offset")


def test_layernorm_single_channel():
    """C = 1: the normalised value is 0, so out = b and dx = 0."""
    x = np.array([[[3.0], [-2.0]]], np.float32)
    w, b = np.array([1.5], np.float32), np.array([0.25], np.float32)
    np.testing.assert_array_equal(rx.layernorm_forward(x, w, b), np.full((1, 2, 1), 0.25))
    dx, _dw, db = rx.layernorm_backward(x, w, b, np.ones((1, 2, 1), np.float32))
    np.testing.assert_array_equal(dx, 0.0)
    np.testing.assert_array_equal(db, [2.0])


def test_layernorm_bad_inputs():
    x, w, b = np.zeros((1, 2, 4), np.float32), np.ones(4, np.float32), np.zeros(4, np.float32)
    with pytest.raises(TypeError, match=r"\bx\b"):
        rx.layernorm_forward(x.astype(np.float64), w, b)
    with pytest.raises(ValueError, match=r"\bx\b"):
        rx.layernorm_forward(np.zeros((2, 4), np.float32), w, b)
    with pytest.raises(ValueError, match=r"\bx\b.*contiguous"):
        rx.layernorm_forward(np.zeros((1, 2, 8), np.float32)[..., ::2], w, b)
    with pytest.raises(ValueError, match=r"\bx\b"):
        rx.layernorm_forward(np.zeros((1, 0, 4), np.float32), w, b)    # T = 0
    with pytest.raises(ValueError, match=r"\bw\b"):
        rx.layernorm_forward(x, np.ones(5, np.float32), b)
    with pytest.raises(TypeError, match=r"\bb\b"):
        rx.layernorm_forward(x, w, [0.0] * 4)
    with pytest.raises(ValueError, match=r"\bdy\b"):
        rx.layernorm_backward(x, w, b, np.zeros((1, 3, 4), np.float32))
    with pytest.raises(TypeError, match=r"\bdy\b"):
        rx.layernorm_backward(x, w, b, np.zeros((1, 2, 4), np.float16))


# ---------------------------------------------------------------------------
# embedding

@pytest.mark.parametrize("T,V,C", [(1, 1, 1), (17, 11, 5), (64, 300, 256)])
def test_embedding_matches_reference(T, V, C):
    rng = np.random.default_rng([T, V, C])
    emb = rand(rng, V, C)
    tokens = rng.integers(0, V, T).astype(np.int32)
    tokens[: T // 2] = tokens[T - 1]                    # repeated tokens accumulate
    d_out = rand(rng, T, C)
    e = leaf(emb)
    out = embedding(e, tokens)
    (out * d_out.astype(np.float64)).sum().backward()
    got = rx.embedding_forward(emb, tokens)
    np.testing.assert_array_equal(got, out.value)
    assert_rel("embedding_forward out", got, out.value, FWD_TOL)
    assert_rel("embedding_backward d_emb", rx.embedding_backward(tokens, d_out, V), e.grad,
               GRAD_TOL)


def test_embedding_bad_inputs():
    emb, tokens = np.zeros((5, 3), np.float32), np.array([0, 4, 2], np.int32)
    with pytest.raises(ValueError, match=r"\btokens\b"):
        rx.embedding_forward(emb, np.array([0, 5], np.int32))         # token = vocab
    with pytest.raises(ValueError, match=r"\btokens\b"):
        rx.embedding_forward(emb, np.array([-1, 2], np.int32))        # negative token
    with pytest.raises(TypeError, match=r"\btokens\b"):
        rx.embedding_forward(emb, tokens.astype(np.int64))
    with pytest.raises(ValueError, match=r"\btokens\b"):
        rx.embedding_forward(emb, np.zeros(0, np.int32))               # T = 0
    with pytest.raises(ValueError, match=r"\btokens\b.*contiguous"):
        rx.embedding_forward(emb, np.zeros(6, np.int32)[::2])
    with pytest.raises(TypeError, match=r"\bemb\b"):
        rx.embedding_forward(emb.astype(np.float64), tokens)
    with pytest.raises(ValueError, match=r"\bemb\b"):
        rx.embedding_forward(np.zeros(5, np.float32), tokens)
    d_out = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match=r"\btokens\b"):
        rx.embedding_backward(tokens, d_out, 4)                        # token 4 = vocab
    with pytest.raises(ValueError, match=r"\btokens\b"):
        rx.embedding_backward(np.array([0, -2, 1], np.int32), d_out, 5)
    with pytest.raises(ValueError, match=r"\bd_out\b"):
        rx.embedding_backward(tokens, np.zeros((4, 3), np.float32), 5)
    with pytest.raises(ValueError, match=r"\bvocab\b"):
        rx.embedding_backward(tokens, d_out, 0)
    with pytest.raises(TypeError, match=r"\bvocab\b"):
        rx.embedding_backward(tokens, d_out, 5.0)


# ---------------------------------------------------------------------------
# head

@pytest.mark.parametrize("T,C,V", [(1, 1, 1), (1, 13, 17), (9, 13, 17), (64, 128, 300)])
def test_head_matches_reference(T, C, V):
    rng = np.random.default_rng([T, C, V])
    x, w, g = rand(rng, T, C), rand(rng, C, V, scale=0.3), rand(rng, T, V)
    xs, ws = leaf(x), leaf(w)
    out = head(xs, ws)
    (out * g.astype(np.float64)).sum().backward()
    assert_rel("head_forward logits", rx.head_forward(x, w), out.value, FWD_TOL)
    dx, dh = rx.head_backward(x, w, g)
    assert_rel("head_backward dx", dx, xs.grad, GRAD_TOL)
    assert_rel("head_backward d_head", dh, ws.grad, GRAD_TOL)


def test_head_bad_inputs():
    x, w = np.zeros((2, 3), np.float32), np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError, match=r"\bhead\b"):
        rx.head_forward(x, np.zeros((4, 4), np.float32))
    with pytest.raises(TypeError, match=r"\bx\b"):
        rx.head_forward(x.astype(np.float64), w)
    with pytest.raises(ValueError, match=r"\bx\b.*contiguous"):
        rx.head_forward(np.zeros((2, 6), np.float32)[:, ::2], w)
    with pytest.raises(ValueError, match=r"\bx\b"):
        rx.head_forward(np.zeros((0, 3), np.float32), w)               # T = 0
    with pytest.raises(ValueError, match=r"\bdlogits\b"):
        rx.head_backward(x, w, np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match=r"\bhead\b.*contiguous"):
        rx.head_backward(x, np.zeros((4, 3), np.float32).T, np.zeros((2, 4), np.float32))


# ---------------------------------------------------------------------------
# cross-entropy

def check_ce(logits, targets, ignore_index, label="cross_entropy"):
    ls = leaf(logits)
    loss = cross_entropy(ls, targets, ignore_index)
    loss.backward()
    got = rx.cross_entropy_forward(logits, targets, ignore_index=ignore_index)
    assert isinstance(got, float)
    assert_rel(f"{label}_forward loss", got, loss.value, FWD_TOL)
    got_b, dl = rx.cross_entropy_backward(logits, targets, ignore_index=ignore_index)
    assert got_b == got
    assert_rel(f"{label}_backward dlogits", dl, ls.grad, GRAD_TOL)
    return got, dl


@pytest.mark.parametrize("T,V", [(1, 1), (1, 5), (10, 7), (70, 600)])
def test_cross_entropy_matches_reference(T, V):
    rng = np.random.default_rng([T, V])
    check_ce(rand(rng, T, V, scale=3.0), rng.integers(0, V, T).astype(np.int32), -1)


def test_cross_entropy_ignore_index():
    rng = np.random.default_rng(1)
    T, V = 12, 9
    logits = rand(rng, T, V, scale=2.0)
    targets = rng.integers(0, V, T).astype(np.int32)
    targets[[1, 4, 5]] = 3
    _, dl = check_ce(logits, targets, 3)
    assert not np.any(dl[targets == 3])
    # ignore_index outside the vocab: those targets are never range-checked
    targets[[0, 7]] = 100
    check_ce(logits, targets, 100)
    # a negative ignore_index ignores nothing
    targets[[0, 7]] = 2
    check_ce(logits, targets, -5)


def test_cross_entropy_all_ignored():
    logits = np.ones((4, 6), np.float32)
    targets = np.full(4, 2, np.int32)
    assert rx.cross_entropy_forward(logits, targets, ignore_index=2) == 0.0
    loss, dl = rx.cross_entropy_backward(logits, targets, ignore_index=2)
    assert loss == 0.0
    assert dl.shape == (4, 6) and not np.any(dl)


def test_cross_entropy_extreme_logits():
    rng = np.random.default_rng(2)
    T, V = 16, 50
    logits = np.where(rng.random((T, V)) < 0.5, -1e4, 1e4).astype(np.float32)
    logits[:, 0] = 0.0
    targets = rng.integers(0, V, T).astype(np.int32)
    loss, dl = check_ce(logits, targets, -1, label="cross_entropy_1e4")
    assert np.isfinite(loss) and np.all(np.isfinite(dl))


def test_cross_entropy_bad_inputs():
    logits, targets = np.zeros((3, 4), np.float32), np.array([0, 3, 1], np.int32)
    for fn in (rx.cross_entropy_forward, rx.cross_entropy_backward):
        with pytest.raises(ValueError, match=r"\btargets\b"):
            fn(logits, np.array([0, 4, 1], np.int32))                   # target = vocab
        with pytest.raises(ValueError, match=r"\btargets\b"):
            fn(logits, np.array([0, -1, 1], np.int32))                  # -1 is not ignored
        with pytest.raises(ValueError, match=r"\btargets\b"):
            fn(logits, np.array([0, 4, 1], np.int32), ignore_index=2)
        with pytest.raises(ValueError, match=r"\btargets\b"):
            fn(logits, targets[:2])
        with pytest.raises(TypeError, match=r"\btargets\b"):
            fn(logits, targets.astype(np.uint32))
        with pytest.raises(TypeError, match=r"\blogits\b"):
            fn(logits.astype(np.float64), targets)
        with pytest.raises(ValueError, match=r"\blogits\b"):
            fn(np.zeros((0, 4), np.float32), np.zeros(0, np.int32))     # T = 0
        with pytest.raises(ValueError, match=r"\blogits\b.*contiguous"):
            fn(np.zeros((3, 8), np.float32)[:, ::2], targets)
        with pytest.raises(TypeError, match=r"\bignore_index\b"):
            fn(logits, targets, ignore_index=1.5)
