"""The float64 attention reference checks itself: selection by hand, autograd
gradients by central finite differences where the selection is stable."""
import numpy as np

from checks import LN_EPS
from reference.attn import attn_block, attn_block_qk, attn_core, moba_gate_margin, moba_mask
from reference.autograd import fd_grad, leaf


def test_mask_by_hand():
    """H = N = chunk_size = 1: gate_j = q_t * k_j, so a positive query keeps
    the top_k largest earlier keys."""
    k = np.array([0.5, 3.0, -1.0, 2.0, 2.0, 0.0, 1.0])
    q = np.ones(7)
    m = moba_mask(q.reshape(1, 7, 1), k.reshape(1, 7, 1), 1, 2, 1, 1)[0, 0]
    expect = np.zeros((7, 7), bool)
    for t, kept in enumerate([[], [0], [0, 1], [0, 1], [1, 3], [1, 3], [1, 3]]):
        expect[t, kept] = True      # t = 4..6: keys 3 and 4 tie at 2.0, 3 wins
        expect[t, t] = True
    assert np.array_equal(m, expect)
    # a negative query flips the order
    m = moba_mask(-q.reshape(1, 7, 1), k.reshape(1, 7, 1), 1, 2, 1, 1)[0, 0]
    assert m[6, :6].nonzero()[0].tolist() == [2, 5]
    # top_k <= 0 or >= candidates: plain causal attention
    for top_k in (0, -1, 6):
        m = moba_mask(q.reshape(1, 7, 1), k.reshape(1, 7, 1), 1, top_k, 1, 1)[0, 0]
        assert np.array_equal(m, np.tril(np.ones((7, 7), bool)))


def test_mask_chunks():
    """chunk_size 3, T = 11: own chunk causal, earlier chunks whole, the
    partial last chunk never a candidate."""
    rng = np.random.default_rng(0)
    B, T, H, N, cs = 2, 11, 2, 3, 3
    q, k = rng.standard_normal((B, T, H * N)), rng.standard_normal((B, T, H * N))
    m = moba_mask(q, k, cs, 1, H, N)
    for t in range(T):
        ct = t // cs
        assert m[..., t, ct * cs:t + 1].all() and not m[..., t, t + 1:].any()
        kept = m[..., t, :ct * cs].reshape(B, H, ct, cs)
        assert np.all(kept.all(-1) | ~kept.any(-1))
        assert np.all(kept.all(-1).sum(-1) == min(ct, 1))


def test_core_grads_fd():
    rng = np.random.default_rng(1)
    B, T, H, N, cs, top_k = 2, 10, 2, 3, 3, 1
    C = H * N
    q, k, v, w = (rng.standard_normal((B, T, C)) for _ in range(4))
    mask = moba_mask(q, k, cs, top_k, H, N)      # held fixed, as docs/maths.md §Blocks says
    assert (np.tril(np.ones((T, T), bool)) & ~mask).any()

    def f(q, k, v):
        _, y = attn_core(leaf(q), leaf(k), leaf(v), H, N, cs, top_k, mask=mask)
        return float((y.value * w).sum())

    Q, K, V = leaf(q), leaf(k), leaf(v)
    _, y = attn_core(Q, K, V, H, N, cs, top_k, mask=mask)
    (y * w).sum().backward()
    for i, g in enumerate((Q.grad, K.grad, V.grad)):
        for idx in [(0, 0, 0), (1, 9, 5), (0, 7, 2), (1, 4, 3)]:
            assert abs(fd_grad(f, [q, k, v], i, idx) - g[idx]) < 1e-7 * max(1.0, abs(g[idx]))


def test_block_grads_fd():
    """Whole block, selection recomputed on every evaluation: the gate
    margin keeps it stable under the 1e-6 perturbations."""
    rng = np.random.default_rng(2)
    B, T, H, N, cs, top_k, F = 2, 9, 2, 2, 2, 2, 5
    C = H * N
    shapes = {"ln1_w": (C,), "ln1_b": (C,), "receptance_w": (C, C), "key_w": (C, C),
              "value_w": (C, C), "output_w": (C, C), "ln2_w": (C,), "ln2_b": (C,),
              "cm.ffn_x_k": (C,), "cm.ffn_key_w": (C, F), "cm.ffn_value_w": (F, C)}
    names = list(shapes)
    vals = [rng.standard_normal(s) * (0.6 if len(s) == 2 else 0.3)
            + (1.0 if n in ("ln1_w", "ln2_w") else 0.0) for n, s in shapes.items()]
    x, cm = rng.standard_normal((B, T, C)), rng.standard_normal((B, C))
    w = rng.standard_normal((B, T, C))
    q64, k64 = attn_block_qk(dict(zip(names, vals)), x, H, N, LN_EPS)
    assert moba_gate_margin(q64, k64, cs, top_k, H, N) > 1e-3
    assert (np.tril(np.ones((T, T), bool)) & ~moba_mask(q64, k64, cs, top_k, H, N)).any()

    def f(*args):
        p = {n: leaf(a) for n, a in zip(names, args[:-2])}
        y = attn_block(p, leaf(args[-2]), leaf(args[-1]), H, N, cs, top_k, LN_EPS)
        return float((y.value * w).sum())

    leaves = [leaf(a) for a in vals + [x, cm]]
    out = attn_block(dict(zip(names, leaves[:-2])), leaves[-2], leaves[-1], H, N, cs, top_k,
                     LN_EPS)
    (out * w).sum().backward()
    inputs = vals + [x, cm]
    for i, lf in enumerate(leaves):
        flat = [np.unravel_index(j, lf.shape) for j in rng.choice(lf.value.size, 3, replace=False)]
        for idx in flat:
            g = lf.grad[idx]
            assert abs(fd_grad(f, inputs, i, idx) - g) < 1e-6 * max(1.0, abs(g)), (i, idx)
