"""rx.wkv7_forward / rx.wkv7_backward against the float64 reference (docs/maths.md §WKV7)."""
import numpy as np
import pytest

import rwkvx_c as rx
from rwkvx_c import _core

from checks import FWD_TOL, GRAD_TOL, assert_rel, kernel_fixture, kernel_runs
from reference.autograd import leaf
from reference.wkv7 import wkv7

NAMES = ("r", "w", "k", "v", "a", "b")


def make_inputs(rng, B, T, H, N):
    """Inputs shaped like the time-mix feeds them: w in (e^-0.61, 1), a = -kk
    and b = kk * iclr with kk unit-norm per head, so the state stays bounded."""
    sh = (B, T, H, N)
    kk = rng.standard_normal(sh)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    ins = {
        "r": rng.standard_normal(sh) * 0.5,
        "w": np.exp(-0.6065306597126334 / (1.0 + np.exp(-rng.standard_normal(sh)))),
        "k": rng.standard_normal(sh) * 0.5,
        "v": rng.standard_normal(sh),
        "a": -kk,
        "b": kk * rng.uniform(0.0, 1.0, sh),
    }
    return {n: x.astype(np.float32) for n, x in ins.items()}


def reference(ins, dy, s_init):
    leaves = [leaf(ins[n]) for n in NAMES]
    s = leaf(np.zeros(dy.shape[:1] + (dy.shape[2], dy.shape[3], dy.shape[3]))
             if s_init is None else s_init)
    y, s_final = wkv7(*leaves, s)
    (y * dy.astype(np.float64)).sum().backward()
    return y.value, s_final.value, [leaf.grad for leaf in leaves], s.grad


WKV_KERNELS = ("portable", "avx2", "avx512f")


wkv_kernel = kernel_fixture(_core._wkv7_use_kernel, WKV_KERNELS, "WKV7 steps")


# N % 8 == 0 runs the AVX2 steps, N % 16 == 0 the AVX-512 ones: T = 1,
# exactly one 16-step chunk and one step more reach every boundary of their
# chunked backward
CASES = [(1, 1, 1, 1), (1, 1, 2, 4), (1, 6, 1, 1), (2, 7, 3, 5), (1, 33, 2, 16), (2, 40, 1, 64),
         (1, 200, 2, 64), (1, 1, 2, 8), (2, 16, 2, 8), (1, 17, 1, 64), (1, 18, 2, 32),
         (1, 1, 1, 16), (2, 9, 1, 48)]


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "s_init"])
@pytest.mark.parametrize("B,T,H,N", CASES)
def test_wkv7_matches_reference(wkv_kernel, B, T, H, N, with_state):
    rng = np.random.default_rng([B, T, H, N, with_state])
    ins = make_inputs(rng, B, T, H, N)
    dy = rng.standard_normal((B, T, H, N)).astype(np.float32)
    s_init = (rng.standard_normal((B, H, N, N)) * 0.5).astype(np.float32) if with_state else None
    y_ref, s_ref, g_ref, ds_ref = reference(ins, dy, s_init)

    y, s_final = rx.wkv7_forward(*[ins[n] for n in NAMES], s_init=s_init)
    assert y.dtype == np.float32 and s_final.dtype == np.float32
    assert_rel("wkv7_forward y", y, y_ref, FWD_TOL)
    assert_rel("wkv7_forward s_final", s_final, s_ref, FWD_TOL)

    grads = rx.wkv7_backward(*[ins[n] for n in NAMES], dy, s_init=s_init)
    for n, g, ref in zip(NAMES, grads[:6], g_ref):
        assert_rel(f"wkv7_backward d{n}", g, ref, GRAD_TOL)
    assert_rel("wkv7_backward ds_init", grads[6], ds_ref, GRAD_TOL)


simd_kernel = kernel_fixture(_core._wkv7_use_kernel, ("avx2", "avx512f"), "WKV7 steps")


# B*H below the team: the vectorised kernels split each head into 16-row
# tiles (wkv7.c; the backward from T = 64, the forward from T = 1024, at 2,
# 3 or 7 threads depending on B*H and G), N = 24 with a ragged last tile,
# N = 128 with eight
@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "s_init"])
@pytest.mark.parametrize("B,T,H,N", [(1, 70, 1, 64), (1, 65, 1, 24), (2, 80, 1, 48),
                                     (1, 96, 1, 128), (1, 64, 3, 32), (1, 1030, 1, 64),
                                     (1, 1024, 1, 24)])
def test_wkv7_split_heads_give_the_same_bits(simd_kernel, restore_threads, B, T, H, N,
                                             with_state):
    if N % (16 if simd_kernel == "avx512f" else 8):
        pytest.skip(f"N = {N} does not run the {simd_kernel} steps")
    rng = np.random.default_rng([B, T, H, N])
    ins = [make_inputs(rng, B, T, H, N)[n] for n in NAMES]
    dy = rng.standard_normal((B, T, H, N)).astype(np.float32)
    s_init = (rng.standard_normal((B, H, N, N)) * 0.5).astype(np.float32) if with_state else None
    runs = {}
    for nt in (1, 2, 3, 7):
        rx.set_num_threads(nt)
        runs[nt] = [*rx.wkv7_forward(*ins, s_init=s_init),
                    *rx.wkv7_backward(*ins, dy, s_init=s_init)]
    for nt in (2, 3, 7):
        for i, (one, many) in enumerate(zip(runs[1], runs[nt])):
            np.testing.assert_array_equal(many, one, err_msg=f"output {i} at {nt} threads")


def test_wkv7_kernel_names():
    assert _core._wkv7_kernel(5) == "portable"
    if kernel_runs(_core._wkv7_use_kernel, "avx512f"):
        assert _core._wkv7_kernel(64) == "avx512f" and _core._wkv7_kernel(24) == "avx2"
    with pytest.raises(ValueError, match="unknown"):
        _core._wkv7_use_kernel("sse9")


def test_wkv7_state_carries_across_calls():
    """Two halves chained through s_final equal one call over the whole."""
    rng = np.random.default_rng(11)
    ins = make_inputs(rng, 2, 20, 2, 8)
    y, s = rx.wkv7_forward(*[ins[n] for n in NAMES])
    y1, s1 = rx.wkv7_forward(*[np.ascontiguousarray(ins[n][:, :9]) for n in NAMES])
    y2, s2 = rx.wkv7_forward(*[np.ascontiguousarray(ins[n][:, 9:]) for n in NAMES], s_init=s1)
    np.testing.assert_array_equal(np.concatenate([y1, y2], axis=1), y)
    np.testing.assert_array_equal(s2, s)


def good_args(shape=(1, 3, 2, 4)):
    rng = np.random.default_rng(0)
    return [x for x in make_inputs(rng, *shape).values()]


@pytest.mark.parametrize("fn", ["forward", "backward"])
def test_wkv7_bad_inputs(fn):
    shape = (1, 3, 2, 4)

    def call(args, **kw):
        if fn == "forward":
            return rx.wkv7_forward(*args, **kw)
        return rx.wkv7_backward(*args, np.zeros(shape, np.float32), **kw)

    args = good_args(shape)
    for i, n in enumerate(NAMES):
        bad = list(args)
        bad[i] = args[i].astype(np.float64)
        with pytest.raises(TypeError, match=rf"\b{n}\b"):
            call(bad)
        bad[i] = np.zeros((1, 3, 2, 8), np.float32)[..., ::2]
        with pytest.raises(ValueError, match=rf"\b{n}\b.*contiguous"):
            call(bad)
        if i > 0:
            bad[i] = np.zeros((1, 3, 2, 5), np.float32)
            with pytest.raises(ValueError, match=rf"\b{n}\b.*shape"):
                call(bad)
    with pytest.raises(TypeError, match=r"\br\b"):
        call([args[0].tolist()] + args[1:])
    with pytest.raises(ValueError, match=r"\br\b"):
        call([np.zeros((1, 0, 2, 4), np.float32)] + args[1:])      # T = 0
    with pytest.raises(ValueError, match=r"\bs_init\b"):
        call(args, s_init=np.zeros((1, 2, 4, 3), np.float32))
    with pytest.raises(TypeError, match=r"\bs_init\b"):
        call(args, s_init=np.zeros((1, 2, 4, 4), np.float64))
    if fn == "backward":
        with pytest.raises(ValueError, match=r"\bdy\b"):
            rx.wkv7_backward(*args, np.zeros((1, 3, 2, 5), np.float32))
