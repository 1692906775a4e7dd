"""AdamW and the grad norm (csrc/optim.c) against the NumPy float64 reference."""
import numpy as np
import pytest

import rwkvx_c as rx

from reference import optim as ref


def _bufs(n, seed=0):
    g = np.random.default_rng(seed)
    p = g.standard_normal(n).astype(np.float32)
    gr = (g.standard_normal(n) * 0.1).astype(np.float32)
    return p, gr, np.zeros(n, np.float32), np.zeros(n, np.float32)


@pytest.mark.parametrize("n", [1, 7, 1000, 200003])
def test_grad_norm_matches_reference(n):
    _, g, _, _ = _bufs(n, seed=n)
    got = rx.grad_norm(g)
    want = ref.grad_norm(g)
    assert abs(got - want) <= 1e-12 * want


def test_grad_norm_deterministic_and_thread_independent(restore_threads):
    _, g, _, _ = _bufs(300001, seed=3)
    assert rx.grad_norm(g) == rx.grad_norm(g)
    many = rx.grad_norm(g)
    rx.set_num_threads(1)
    assert rx.grad_norm(g) == many   # ranges set by n alone: the same bits


@pytest.mark.parametrize("n", [1, 5, 4099, 150001])
def test_adamw_matches_reference_over_steps(n):
    p, g, m, v = _bufs(n, seed=n)
    rng = np.random.default_rng(n + 1)
    ranges = np.array([[0, n // 3], [n // 2, n]], dtype=np.int64)
    rp, rm, rv = p.astype(np.float64), m.astype(np.float64), v.astype(np.float64)
    kw = dict(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    for step in range(1, 6):
        g = (rng.standard_normal(n) * 0.05).astype(np.float32)
        lr = 1e-2 * step
        scale = 0.7 if step % 2 else 1.0
        rx.adamw_step(p, g, m, v, lr=lr, step=step, decay_ranges=ranges, grad_scale=scale, **kw)
        rp, rm, rv = ref.adamw_step(rp, g, rm, rv, lr=lr, step=step, decay_ranges=ranges,
                                    grad_scale=scale, **kw)
        # the float64 reference is fed the C state, so errors do not compound
        for got, want in ((p, rp), (m, rm), (v, rv)):
            assert np.max(np.abs(got - want)) <= 1e-5 * max(np.max(np.abs(want)), 1e-30)
        rp, rm, rv = p.astype(np.float64), m.astype(np.float64), v.astype(np.float64)


def test_decay_only_inside_ranges():
    n = 1000
    p = np.ones(n, np.float32)
    g = np.zeros(n, np.float32)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    ranges = np.array([[10, 20], [500, 501]], dtype=np.int64)
    rx.adamw_step(p, g, m, v, lr=0.1, step=1, weight_decay=0.5, decay_ranges=ranges)
    mask = ref.decay_mask(n, ranges)
    np.testing.assert_array_equal(p[mask], np.float32(1 - 0.1 * 0.5))
    np.testing.assert_array_equal(p[~mask], 1.0)
    # None decays everything, an empty table nothing
    p[:] = 1
    rx.adamw_step(p, g, m, v, lr=0.1, step=1, weight_decay=0.5)
    np.testing.assert_array_equal(p, np.float32(0.95))
    p[:] = 1
    rx.adamw_step(p, g, m, v, lr=0.1, step=1, weight_decay=0.5,
                  decay_ranges=np.zeros((0, 2), np.int64))
    np.testing.assert_array_equal(p, 1.0)


def test_clipping_scale_is_applied():
    n = 3000
    p, g, m, v = _bufs(n, seed=9)
    g *= 100
    norm = rx.grad_norm(g)
    scale = ref.clip_scale(norm, 1.0)
    assert scale < 0.01
    p0 = p.copy()
    rx.adamw_step(p, g, m, v, lr=1e-3, step=1, grad_scale=scale, weight_decay=0.0)
    rp, rm, rv = ref.adamw_step(p0, g, np.zeros(n), np.zeros(n), lr=1e-3, step=1,
                                grad_scale=scale)
    np.testing.assert_allclose(m, rm, rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(v, rv, rtol=1e-5, atol=1e-16)
    assert np.max(np.abs(p - rp)) <= 1e-5 * np.max(np.abs(rp))
    # the clipped first moment has the norm of the clipped grad times (1-b1)
    assert abs(np.linalg.norm(m.astype(np.float64)) - 0.1 * norm * scale) < 1e-5


def test_thread_count_does_not_change_the_update(restore_threads):
    n = 200001
    outs = []
    for t in (1, 2, 3):
        rx.set_num_threads(t)
        p, g, m, v = _bufs(n, seed=4)
        rx.adamw_step(p, g, m, v, lr=1e-3, step=3, weight_decay=0.1,
                      decay_ranges=np.array([[5, 100000]], np.int64))
        outs.append((p, m, v))
    for o in outs[1:]:
        for a, b in zip(outs[0], o):
            np.testing.assert_array_equal(a, b)


def test_bad_inputs():
    p, g, m, v = _bufs(10)
    with pytest.raises(TypeError, match="params"):
        rx.adamw_step(p.astype(np.float64), g, m, v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="grads"):
        rx.adamw_step(p, g[:9].copy(), m, v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="C-contiguous"):
        rx.adamw_step(p, g, np.zeros(20, np.float32)[::2], v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="step"):
        rx.adamw_step(p, g, m, v, lr=1e-3, step=0)
    with pytest.raises(ValueError, match="betas"):
        rx.adamw_step(p, g, m, v, lr=1e-3, step=1, beta1=1.0)
    with pytest.raises(ValueError, match="decay_ranges"):
        rx.adamw_step(p, g, m, v, lr=1e-3, step=1, decay_ranges=np.array([[5, 3]]))
    with pytest.raises(ValueError, match="decay_ranges"):
        rx.adamw_step(p, g, m, v, lr=1e-3, step=1, decay_ranges=np.array([[0, 11]]))
    with pytest.raises(ValueError, match="decay_ranges"):
        rx.adamw_step(p, g, m, v, lr=1e-3, step=1, decay_ranges=np.array([[0, 5], [4, 6]]))
    with pytest.raises(ValueError, match="writable"):
        ro = p.copy()
        ro.flags.writeable = False
        rx.adamw_step(ro, g, m, v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="empty"):
        rx.grad_norm(np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="1-D"):
        rx.grad_norm(np.zeros((2, 2), np.float32))


def test_buffers_that_share_memory_are_refused_untouched():
    # each element's update reads grads and m, v while writing params: an
    # aliased pair would mix a buffer's old and new values, so the C side
    # refuses it before writing anything
    p, g, m, v = _bufs(10)
    mv = np.zeros(15, np.float32)
    cases = [((p, p, m, v), "the output params overlaps the input grads"),
             ((p, g, mv[:10], mv[5:]), "the output v overlaps the output m")]
    for (pp, gg, mm, vv), msg in cases:
        before = [x.copy() for x in (pp, gg, mm, vv)]
        with pytest.raises(ValueError, match="rx_adamw_step: " + msg):
            rx.adamw_step(pp, gg, mm, vv, lr=1e-3, step=1)
        for x, b in zip((pp, gg, mm, vv), before):
            np.testing.assert_array_equal(x, b)
