"""Central finite differences confirm the gradients the autograd references
produce, for every reference function, on small float64 inputs."""
import numpy as np
import pytest

from checks import LN_EPS
from reference.autograd import Var, fd_grad, leaf
from reference.layers import channelmix, cross_entropy, embedding, head, layernorm, token_shift
from reference.wkv7 import wkv7


def fd_check(fn, inputs, rtol=1e-6):
    """fn(*Vars) -> scalar Var. Compares the autograd grad of every input
    element with a central difference."""
    leaves = [leaf(x) for x in inputs]
    fn(*leaves).backward()

    def f(*xs):
        return float(fn(*[Var(x, requires_grad=False) for x in xs]).value)

    for i, x in enumerate(inputs):
        g = np.zeros(x.shape) if leaves[i].grad is None else leaves[i].grad
        fd = np.array([fd_grad(f, inputs, i, idx) for idx in np.ndindex(x.shape)]).reshape(x.shape)
        scale = max(np.abs(fd).max(), 1e-3)
        assert np.abs(g - fd).max() <= rtol * scale, f"input {i}: autograd {g} vs FD {fd}"


def proj(rng, *shape):
    """A fixed random cotangent: sum(out * proj) makes any output a scalar."""
    return rng.standard_normal(shape)


def wkv7_inputs(rng, B, T, H, N):
    r = rng.standard_normal((B, T, H, N)) * 0.5
    w = np.exp(-0.6065306597126334 / (1.0 + np.exp(-rng.standard_normal((B, T, H, N)))))
    k = rng.standard_normal((B, T, H, N)) * 0.5
    v = rng.standard_normal((B, T, H, N))
    kk = rng.standard_normal((B, T, H, N))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    a = -kk
    b = kk * rng.uniform(0.0, 1.0, (B, T, H, N))
    s = rng.standard_normal((B, H, N, N)) * 0.5
    return [r, w, k, v, a, b, s]


@pytest.mark.parametrize("B,T,H,N", [(1, 1, 1, 1), (2, 4, 2, 3), (1, 5, 1, 4)])
def test_wkv7_reference_gradients(B, T, H, N):
    rng = np.random.default_rng(B * 100 + T * 10 + N)
    gy, gs = proj(rng, B, T, H, N), proj(rng, B, H, N, N)

    def loss(r, w, k, v, a, b, s):
        y, s_final = wkv7(r, w, k, v, a, b, s)
        return (y * gy).sum() + (s_final * gs).sum()
    fd_check(loss, wkv7_inputs(rng, B, T, H, N))


def test_wkv7_reference_matches_loop():
    """The vectorised reference against the docs/maths.md §WKV7 loop written out by hand."""
    rng = np.random.default_rng(7)
    B, T, H, N = 2, 3, 2, 3
    r, w, k, v, a, b, s = wkv7_inputs(rng, B, T, H, N)
    y, s_final = wkv7(*[Var(x) for x in (r, w, k, v, a, b, s)])
    y_loop = np.zeros((B, T, H, N))
    for bi in range(B):
        for h in range(H):
            S = s[bi, h].copy()
            for t in range(T):
                sa = [sum(a[bi, t, h, j] * S[i, j] for j in range(N)) for i in range(N)]
                for i in range(N):
                    for j in range(N):
                        S[i, j] = (S[i, j] * w[bi, t, h, j] + v[bi, t, h, i] * k[bi, t, h, j]
                                   + sa[i] * b[bi, t, h, j])
                for i in range(N):
                    y_loop[bi, t, h, i] = sum(S[i, j] * r[bi, t, h, j] for j in range(N))
            np.testing.assert_allclose(s_final.value[bi, h], S, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(y.value, y_loop, rtol=1e-12, atol=1e-12)


def test_token_shift_reference_gradients():
    rng = np.random.default_rng(1)
    g = proj(rng, 2, 3, 4)
    fd_check(lambda x, init: (token_shift(x, init) * g).sum(),
             [rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 4))])


def test_layernorm_reference_gradients():
    rng = np.random.default_rng(2)
    g = proj(rng, 2, 3, 5)
    fd_check(lambda x, w, b: (layernorm(x, w, b, LN_EPS) * g).sum(),
             [rng.standard_normal((2, 3, 5)) + 3.0, rng.standard_normal(5), rng.standard_normal(5)])


def test_channelmix_reference_gradients():
    rng = np.random.default_rng(3)
    B, T, C, F = 2, 3, 4, 6
    g = proj(rng, B, T, C)

    def loss(x, init, mix, wk, wv):
        p = {"ffn_x_k": mix, "ffn_key_w": wk, "ffn_value_w": wv}
        return (channelmix(p, x, init) * g).sum()
    fd_check(loss, [rng.standard_normal((B, T, C)), rng.standard_normal((B, C)),
                    rng.uniform(0, 1, C), rng.standard_normal((C, F)), rng.standard_normal((F, C))])


def test_embedding_reference_gradients():
    rng = np.random.default_rng(4)
    tokens = np.array([3, 0, 3, 5, 3])          # repeats accumulate
    g = proj(rng, 5, 4)
    fd_check(lambda e: (embedding(e, tokens) * g).sum(), [rng.standard_normal((6, 4))])


def test_head_reference_gradients():
    rng = np.random.default_rng(5)
    g = proj(rng, 3, 7)
    fd_check(lambda x, w: (head(x, w) * g).sum(),
             [rng.standard_normal((3, 4)), rng.standard_normal((4, 7))])


@pytest.mark.parametrize("targets,ignore_index", [
    ([1, 0, 4, 2], -1),
    ([1, 2, 4, 2], 2),          # two ignored rows
    ([9, 0, 9, 3], 9),          # ignore_index outside the vocab
    ([2, 2, 2, 2], 2),          # every position ignored: loss 0, zero grads
])
def test_cross_entropy_reference_gradients(targets, ignore_index):
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((4, 5)) * 3.0
    fd_check(lambda z: cross_entropy(z, targets, ignore_index), [logits])


def test_cross_entropy_reference_values():
    """Against a direct evaluation, including the all-ignored case."""
    logits = np.array([[0.0, 1.0, 2.0], [1e4, -1e4, 0.0]])
    targets = np.array([2, 1])
    direct = np.log(np.exp(logits[0]).sum()) - 2.0
    assert cross_entropy(Var(logits), targets, 1).value == pytest.approx(direct, rel=1e-14)
    both = (direct + 2e4) / 2.0
    assert cross_entropy(Var(logits), targets).value == pytest.approx(both, rel=1e-14)
    x = leaf(logits)
    loss = cross_entropy(x, np.array([1, 1]), 1)
    loss.backward()
    assert loss.value == 0.0 and not np.any(x.grad)
