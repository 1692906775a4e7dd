"""MoBA-sparse attention (docs/maths.md §Blocks): the C kernels against the float64 reference."""
import numpy as np
import pytest

import rwkvx_c as rx

from checks import FWD_TOL, GRAD_TOL, LN_EPS, assert_rel
from reference.attn import attn_block, attn_block_qk, attn_core, moba_gate_margin, moba_mask
from reference.autograd import leaf

KEYS = ("ln1_w", "ln1_b", "receptance_w", "key_w", "value_w", "output_w",
        "ln2_w", "ln2_b", "cm.ffn_x_k", "cm.ffn_key_w", "cm.ffn_value_w")

# A test's selection must be this far (relative gap between the last kept and
# the first dropped gate) from a tie: fp32 q and k differ from float64 by
# ~1e-6 relative, so the C and reference selections provably agree.
MIN_MARGIN = 1e-4


def check(label, got, ref, tol):
    """max|got - ref| <= tol * max|ref|; where the reference is exactly zero
    (dq, dk at T = 1: the softmax over one key is constant) the scale is 1,
    the size of the inputs."""
    if np.abs(ref).max() == 0.0:
        assert np.abs(got).max() <= tol, label
    else:
        assert_rel("attn " + label, got, ref, tol)


def block_params(rng, C, F):
    shapes = {"ln1_w": (C,), "ln1_b": (C,), "receptance_w": (C, C), "key_w": (C, C),
              "value_w": (C, C), "output_w": (C, C), "ln2_w": (C,), "ln2_b": (C,),
              "cm.ffn_x_k": (C,), "cm.ffn_key_w": (C, F), "cm.ffn_value_w": (F, C)}
    p = {}
    for key, s in shapes.items():
        if len(s) == 2:
            p[key] = rng.standard_normal(s) / np.sqrt(s[0])
        elif key in ("ln1_w", "ln2_w"):
            p[key] = 1.0 + 0.2 * rng.standard_normal(s)
        elif key == "cm.ffn_x_k":
            p[key] = rng.uniform(0.0, 1.0, s)
        else:
            p[key] = 0.2 * rng.standard_normal(s)
    return {key: v.astype(np.float32) for key, v in p.items()}


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def choosing(T, cs, top_k):
    """True when some query keeps a strict subset of its earlier chunks."""
    return top_k > 0 and any(top_k < t // cs for t in range(T))


# (B, T, H, N, chunk_size, moba_top_k, seed)
CASES = {
    "active": (2, 37, 3, 5, 4, 2, 0),           # T not a multiple of chunk_size
    "active_k1": (1, 29, 2, 3, 3, 1, 9),
    "top_k_zero": (2, 30, 2, 4, 4, 0, 2),
    "top_k_negative": (1, 17, 2, 3, 4, -3, 3),
    "top_k_all": (2, 30, 2, 4, 4, 7, 4),        # >= every query's candidates
    "chunk_1": (1, 20, 1, 4, 1, 3, 5),
    "T_lt_chunk": (2, 5, 2, 3, 8, 2, 6),
    "T_1": (2, 1, 2, 3, 2, 1, 7),
    "N_1": (2, 19, 3, 1, 3, 2, 13),
    "active_long_chunks": (1, 300, 2, 3, 70, 2, 14),   # chunks span several 64-row tiles
    "T_lt_long_chunk": (1, 150, 1, 4, 200, 1, 15),
}


@pytest.mark.parametrize("case", CASES)
def test_score_av_matches_reference(case):
    B, T, H, N, cs, top_k, seed = CASES[case]
    rng = np.random.default_rng(seed)
    C = H * N
    q, k, v, dy = (f32(rng, B, T, C) for _ in range(4))
    kw = dict(n_head=H, head_size=N, chunk_size=cs, moba_top_k=top_k)
    assert moba_gate_margin(q, k, cs, top_k, H, N) > MIN_MARGIN
    p, y = rx.attn_score_av_forward(q, k, v, **kw)
    dq, dk, dv = rx.attn_score_av_backward(q, k, v, dy, **kw)

    mask = moba_mask(q, k, cs, top_k, H, N)
    causal = np.tril(np.ones((T, T), bool))
    # the selection drops earlier keys exactly when some query chooses
    assert (causal & ~mask).any() == choosing(T, cs, top_k)
    assert choosing(T, cs, top_k) == case.startswith(("active", "chunk_1", "N_1"))
    assert np.array_equal(p > 0, mask)
    assert np.all(p[~mask] == 0.0)
    assert np.abs(p.sum(-1, dtype=np.float64) - 1.0).max() < 1e-6

    Q, K, V = leaf(q), leaf(k), leaf(v)
    pr, yr = attn_core(Q, K, V, H, N, cs, top_k)
    (yr * dy.astype(np.float64)).sum().backward()
    check(f"score_av[{case}] p", p, pr.value, FWD_TOL)
    check(f"score_av[{case}] y", y, yr.value, FWD_TOL)
    for name, c, r in (("dq", dq, Q.grad), ("dk", dk, K.grad), ("dv", dv, V.grad)):
        check(f"score_av[{case}] {name}", c, r, GRAD_TOL)


def test_score_av_wide_scores_underflow():
    """Scores spread far beyond exp's range: the weights of the far losers
    underflow to exactly zero (rx_expf flushes below about -104), and y and
    every grad still match the reference. Integer q and k in eighths with
    N = 4 (scale 1/2) make every score exact in fp32, so only the softmax
    itself is compared."""
    B, T, H, N, cs, top_k = 1, 40, 2, 4, 4, 2
    rng = np.random.default_rng(16)
    C = H * N
    q = rng.integers(-12, 13, (B, T, C)).astype(np.float32)
    k = (rng.integers(-64, 65, (B, T, C)) / 8).astype(np.float32)
    v, dy = f32(rng, B, T, C), f32(rng, B, T, C)
    kw = dict(n_head=H, head_size=N, chunk_size=cs, moba_top_k=top_k)
    assert moba_gate_margin(q, k, cs, top_k, H, N) > MIN_MARGIN
    p, y = rx.attn_score_av_forward(q, k, v, **kw)
    dq, dk, dv = rx.attn_score_av_backward(q, k, v, dy, **kw)
    mask = moba_mask(q, k, cs, top_k, H, N)
    assert np.all(np.isfinite(p)) and np.all(p >= 0.0) and np.all(p[~mask] == 0.0)
    assert (mask & (p == 0.0)).any()            # the cut-off is exercised
    Q, K, V = leaf(q), leaf(k), leaf(v)
    pr, yr = attn_core(Q, K, V, H, N, cs, top_k)
    (yr * dy.astype(np.float64)).sum().backward()
    check("score_av[wide] p", p, pr.value, FWD_TOL)
    check("score_av[wide] y", y, yr.value, FWD_TOL)
    for name, c, r in (("dq", dq, Q.grad), ("dk", dk, K.grad), ("dv", dv, V.grad)):
        check(f"score_av[wide] {name}", c, r, GRAD_TOL)


def test_selection_is_active():
    """The 'active' cases really drop earlier chunks (a test that cannot fail otherwise)."""
    B, T, H, N, cs, top_k, seed = CASES["active"]
    rng = np.random.default_rng(seed)
    q, k = f32(rng, B, T, H * N), f32(rng, B, T, H * N)
    mask = moba_mask(q, k, cs, top_k, H, N)
    causal = np.tril(np.ones((T, T), bool))
    assert (causal & ~mask).any()
    # a choosing query keeps exactly top_k whole earlier chunks plus its own prefix
    t = T - 1
    ct = t // cs
    kept = mask[..., t, :ct * cs].reshape(B, H, ct, cs)
    assert np.all(kept.all(-1) | ~kept.any(-1))
    assert np.all(kept.all(-1).sum(-1) == top_k)
    assert mask[..., t, ct * cs:].all()


def test_score_av_with_c_selection():
    """Many queries, small chunks: whatever the C kernel selects (near ties
    included), the reference run on the C selection gives the same p, y and
    grads, and the C selection has the shape docs/maths.md gives."""
    B, T, H, N, cs, top_k = 2, 64, 2, 4, 2, 3
    rng = np.random.default_rng(11)
    C = H * N
    q, k, v, dy = (f32(rng, B, T, C) for _ in range(4))
    kw = dict(n_head=H, head_size=N, chunk_size=cs, moba_top_k=top_k)
    p, y = rx.attn_score_av_forward(q, k, v, **kw)
    dq, dk, dv = rx.attn_score_av_backward(q, k, v, dy, **kw)
    mask = p > 0
    for t in range(T):
        ct = t // cs
        assert mask[..., t, ct * cs:t + 1].all() and not mask[..., t, t + 1:].any()
        kept = mask[..., t, :ct * cs].reshape(B, H, ct, cs)
        assert np.all(kept.all(-1) | ~kept.any(-1))
        assert np.all(kept.all(-1).sum(-1) == (ct if top_k >= ct else top_k))
    # the float64 selection differs at most on near ties
    ref_mask = moba_mask(q, k, cs, top_k, H, N)
    assert (mask != ref_mask).mean() < 0.01

    Q, K, V = leaf(q), leaf(k), leaf(v)
    pr, yr = attn_core(Q, K, V, H, N, cs, top_k, mask=mask)
    (yr * dy.astype(np.float64)).sum().backward()
    for name, c, r, tol in (("p", p, pr.value, FWD_TOL), ("y", y, yr.value, FWD_TOL),
                            ("dq", dq, Q.grad, GRAD_TOL), ("dk", dk, K.grad, GRAD_TOL),
                            ("dv", dv, V.grad, GRAD_TOL)):
        check(f"score_av[C selection] {name}", c, r, tol)


def test_equal_gates_choose_the_smaller_chunk():
    """Chunks 0 and 1 hold identical keys, so their gates tie exactly. With
    moba_top_k = 1 every query that chooses keeps chunk 0; with moba_top_k = 2
    and chunk 2 ahead of both, it keeps chunks 2 and 0 (the tie is decided
    after a larger gate has displaced one of the tied chunks)."""
    B, T, H, N, cs = 1, 24, 1, 4, 4
    rng = np.random.default_rng(5)
    q = np.abs(f32(rng, B, T, N)) + 1.0
    k = 0.1 * f32(rng, B, T, N)
    k[:, :cs] += 2.0
    k[:, cs:2 * cs] = k[:, :cs]
    k[:, 2 * cs:3 * cs] += 3.0
    v = f32(rng, B, T, N)
    for top_k, kept, dropped in ((1, [2], [0, 1]), (2, [0, 2], [1])):
        p, _ = rx.attn_score_av_forward(q, k, v, n_head=H, head_size=N, chunk_size=cs,
                                        moba_top_k=top_k)
        ref = moba_mask(q, k, cs, top_k, H, N)
        for t in range(3 * cs, T):   # chunks 0, 1, 2 all candidates
            for j in kept:
                assert (p[0, 0, t, j * cs:(j + 1) * cs] > 0).all(), (top_k, t, j)
                assert ref[0, 0, t, j * cs:(j + 1) * cs].all()
            for j in dropped:
                assert (p[0, 0, t, j * cs:(j + 1) * cs] == 0).all(), (top_k, t, j)
                assert not ref[0, 0, t, j * cs:(j + 1) * cs].any()
    # top_k = 1 among the tied pair alone (queries of chunk 2 see chunks 0, 1)
    p, _ = rx.attn_score_av_forward(q, k, v, n_head=H, head_size=N, chunk_size=cs, moba_top_k=1)
    for t in range(2 * cs, 3 * cs):
        assert (p[0, 0, t, :cs] > 0).all() and (p[0, 0, t, cs:2 * cs] == 0).all()


def test_popular_chunk_gathers_many_queries():
    """Every choosing query picks chunk 0, so its key-major tiles gather more
    queries than fit in one (64-row) tile."""
    B, T, H, N, cs, top_k = 1, 200, 2, 4, 2, 1
    rng = np.random.default_rng(8)
    q = np.abs(f32(rng, B, T, H * N)) + 1.0
    k = 0.1 * f32(rng, B, T, H * N)
    k[:, :cs] += 3.0
    v, dy = f32(rng, B, T, H * N), f32(rng, B, T, H * N)
    kw = dict(n_head=H, head_size=N, chunk_size=cs, moba_top_k=top_k)
    assert moba_gate_margin(q, k, cs, top_k, H, N) > MIN_MARGIN
    p, y = rx.attn_score_av_forward(q, k, v, **kw)
    dq, dk, dv = rx.attn_score_av_backward(q, k, v, dy, **kw)
    mask = moba_mask(q, k, cs, top_k, H, N)
    assert mask[..., 2 * cs:, :cs].all() and np.array_equal(p > 0, mask)
    Q, K, V = leaf(q), leaf(k), leaf(v)
    pr, yr = attn_core(Q, K, V, H, N, cs, top_k)
    (yr * dy.astype(np.float64)).sum().backward()
    for name, c, r, tol in (("p", p, pr.value, FWD_TOL), ("y", y, yr.value, FWD_TOL),
                            ("dq", dq, Q.grad, GRAD_TOL), ("dk", dk, K.grad, GRAD_TOL),
                            ("dv", dv, V.grad, GRAD_TOL)):
        check(f"score_av[popular chunk] {name}", c, r, tol)


BLOCK_CASES = {
    # (B, T, H, N, chunk_size, moba_top_k, ffn, seed, with_carry)
    "active": (2, 37, 3, 5, 4, 2, 19, 1, True),
    "active_no_carry": (1, 26, 2, 3, 3, 1, 7, 2, False),
    "top_k_zero": (2, 30, 2, 4, 4, 0, 8, 3, True),
    "top_k_all": (1, 30, 2, 4, 4, 100, 8, 4, True),
    "chunk_1": (1, 20, 1, 4, 1, 3, 8, 16, True),
    "T_lt_chunk": (2, 5, 2, 3, 8, 2, 6, 6, True),
    "T_1": (2, 1, 2, 3, 2, 1, 5, 7, True),
}


@pytest.mark.parametrize("case", BLOCK_CASES)
def test_block_matches_reference(case):
    B, T, H, N, cs, top_k, F, seed, carry = BLOCK_CASES[case]
    rng = np.random.default_rng(seed)
    C = H * N
    p = block_params(rng, C, F)
    x, dy = f32(rng, B, T, C), f32(rng, B, T, C)
    cm = f32(rng, B, C) if carry else None
    kw = dict(n_head=H, head_size=N, chunk_size=cs, moba_top_k=top_k)
    q64, k64 = attn_block_qk(p, x, H, N, LN_EPS)
    assert moba_gate_margin(q64, k64, cs, top_k, H, N) > MIN_MARGIN
    if case.startswith("active") or case == "chunk_1":
        assert choosing(T, cs, top_k)

    out = rx.attn_forward(p, x, cm, **kw)
    dx, grads, dcm = rx.attn_backward(p, x, dy, cm, **kw)

    P = {key: leaf(a) for key, a in p.items()}
    X = leaf(x)
    CM = leaf(cm) if carry else leaf(np.zeros((B, C)))
    ref = attn_block(P, X, CM, H, N, cs, top_k, LN_EPS)
    (ref * dy.astype(np.float64)).sum().backward()
    check(f"block[{case}] out", out, ref.value, FWD_TOL)
    check(f"block[{case}] dx", dx, X.grad, GRAD_TOL)
    check(f"block[{case}] d_cm_xprev", dcm, CM.grad, GRAD_TOL)
    assert set(grads) == set(KEYS)
    for key in KEYS:
        assert grads[key].shape == p[key].shape
        check(f"block[{case}] {key}", grads[key], P[key].grad, GRAD_TOL)


def test_threads_do_not_change_results(restore_threads):
    """Selection and sums are independent of the thread count (bit for bit)."""
    B, T, H, N, cs, top_k, F = 2, 128, 2, 8, 8, 2, 16
    rng = np.random.default_rng(21)
    p = block_params(rng, H * N, F)
    x, dy = f32(rng, B, T, H * N), f32(rng, B, T, H * N)
    kw = dict(n_head=H, head_size=N, chunk_size=cs, moba_top_k=top_k)
    results = []
    for n in (1, 2):
        rx.set_num_threads(n)
        results.append((rx.attn_forward(p, x, **kw), rx.attn_backward(p, x, dy, **kw)))
    (o1, (dx1, g1, _)), (o2, (dx2, g2, _)) = results
    assert np.array_equal(o1, o2) and np.array_equal(dx1, dx2)
    for key in KEYS:
        assert np.array_equal(g1[key], g2[key]), key


# ---------------------------------------------------------------------------
# bad inputs


def _good(rng=None):
    rng = rng or np.random.default_rng(0)
    B, T, H, N, F = 2, 6, 2, 3, 5
    p = block_params(rng, H * N, F)
    x = f32(rng, B, T, H * N)
    kw = dict(n_head=H, head_size=N, chunk_size=2, moba_top_k=1)
    return p, x, kw


def test_bad_params_dict():
    p, x, kw = _good()
    for key in ("key_w", "cm.ffn_x_k"):
        q = dict(p)
        del q[key]
        with pytest.raises(ValueError, match=key):
            rx.attn_forward(q, x, **kw)
    with pytest.raises(ValueError, match="bogus"):
        rx.attn_forward({**p, "bogus": p["ln1_w"]}, x, **kw)
    with pytest.raises(ValueError, match="output_w"):
        rx.attn_forward({**p, "output_w": p["output_w"][:, :5].copy()}, x, **kw)
    with pytest.raises(ValueError, match=r"cm\.ffn_value_w"):
        rx.attn_backward({**p, "cm.ffn_value_w": np.zeros((4, 6), np.float32)}, x, x, **kw)
    with pytest.raises(TypeError, match="ln2_b"):
        rx.attn_forward({**p, "ln2_b": p["ln2_b"].astype(np.float64)}, x, **kw)
    with pytest.raises(ValueError, match="receptance_w"):
        rx.attn_forward({**p, "receptance_w": np.asfortranarray(p["receptance_w"])}, x, **kw)
    with pytest.raises(TypeError, match="p must be a dict"):
        rx.attn_forward(list(p.values()), x, **kw)


def test_bad_arrays_and_sizes():
    p, x, kw = _good()
    B, T, C = x.shape
    with pytest.raises(TypeError, match="x"):
        rx.attn_forward(p, x.astype(np.float64), **kw)
    with pytest.raises(TypeError, match="x"):
        rx.attn_forward(p, x.tolist(), **kw)
    with pytest.raises(ValueError, match="x"):
        rx.attn_forward(p, x[:, ::2], **kw)
    with pytest.raises(ValueError, match="x"):
        rx.attn_forward(p, np.zeros((B, 0, C), np.float32), **kw)
    with pytest.raises(ValueError, match="x"):
        rx.attn_forward(p, x[..., :C - 1].copy(), **kw)
    with pytest.raises(ValueError, match="cm_xprev_init"):
        rx.attn_forward(p, x, np.zeros((B + 1, C), np.float32), **kw)
    with pytest.raises(ValueError, match="dy"):
        rx.attn_backward(p, x, x[:, :T - 1].copy(), **kw)
    with pytest.raises(ValueError, match="cm_xprev_init"):
        rx.attn_backward(p, x, x, np.zeros((B, C + 1), np.float32), **kw)
    with pytest.raises(ValueError, match="chunk_size"):
        rx.attn_forward(p, x, **{**kw, "chunk_size": 0})
    with pytest.raises(ValueError, match="n_head"):
        rx.attn_forward(p, x, **{**kw, "n_head": 0})
    with pytest.raises(TypeError, match="moba_top_k"):
        rx.attn_forward(p, x, **{**kw, "moba_top_k": 1.5})
    with pytest.raises(TypeError, match="head_size"):
        rx.attn_forward(p, x, **{**kw, "head_size": "3"})
    with pytest.raises(TypeError):
        rx.attn_forward(p, x, n_head=2, head_size=3, chunk_size=2)   # moba_top_k missing


def test_bad_hook_inputs():
    rng = np.random.default_rng(0)
    B, T, H, N = 2, 6, 2, 3
    q, k, v = (f32(rng, B, T, H * N) for _ in range(3))
    kw = dict(n_head=H, head_size=N, chunk_size=2, moba_top_k=1)
    with pytest.raises(ValueError, match="k"):
        rx.attn_score_av_forward(q, k[:, :T - 1].copy(), v, **kw)
    with pytest.raises(TypeError, match="v"):
        rx.attn_score_av_forward(q, k, v.astype(np.float16), **kw)
    with pytest.raises(ValueError, match="q"):
        rx.attn_score_av_forward(q, k, v, **{**kw, "head_size": 4})
    with pytest.raises(ValueError, match="dy"):
        rx.attn_score_av_backward(q, k, v, np.zeros((B, T, H * N + 1), np.float32), **kw)
    with pytest.raises(ValueError, match="chunk_size"):
        rx.attn_score_av_backward(q, k, v, q, **{**kw, "chunk_size": -1})
    with pytest.raises(ValueError, match="q"):
        rx.attn_score_av_forward(q[:, :, None].copy(), k, v, **kw)


@pytest.mark.parametrize("threads", [1, 2])
def test_profile_counts_tile_products_as_attention(threads, restore_threads):
    """rx.profile() charges the attention core's tile GEMMs to "attention
    core" at every thread count (at 1 thread they once counted as "gemm",
    so a 1- and a 2-thread breakdown disagreed)."""
    rng = np.random.default_rng(0)
    B, T, H, N = 1, 256, 2, 64
    q, k, v, dy = (f32(rng, B, T, H * N) for _ in range(4))
    kw = dict(n_head=H, head_size=N, chunk_size=32, moba_top_k=2)
    rx.set_num_threads(threads)
    try:
        rx.profile_enable(True)
        rx.attn_score_av_backward(q, k, v, dy, **kw)
        prof = rx.profile()
    finally:
        rx.profile_enable(False)
    assert prof["gemm"] == 0.0 and prof["attention core"] > 0.0, prof
