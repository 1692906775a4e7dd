"""The fp32 GEMM over a frozen base (Q8_0, Q4_0, bf16 rows), op(B) packed
from the stored rows one 16-column sliver at a time by the dtype's sliver
kernel (the AVX2 ones: csrc/rx_simd.h's rx_sliver_q32, base_bf16.c's) or
its scalar decoder, or at 1-4 rows read in place by its small-M kernel
(rx_small_q32, base_bf16.c's small_bf16_group): at
every M of the small-M path (1..8) and at the packed path's (9), the bits
of the same product over the decoded weights held as float32 (the GEMM's
float path, which no base kernel touches). The shapes meet every edge of a
sliver: N not a multiple of 16, K of several blocks and past one KC-deep
chunk (256), units of two threads starting half a sliver in; scales of
every kind (subnormal halves, zero, the largest, negative), bf16 values
of every kind but NaN and infinity. The same in a
process with RWKVX_BASE_PORTABLE=1 (the scalar decoders only)."""
import numpy as np
import pytest

import rwkvx_c as rx
from rwkvx_c import _core

from checks import portable_run

K = 11 * 32   # 11 blocks: a KC chunk of 256, then 96


def _scales(rng, n):
    """n fp16 scales: random, and every kind of half the decoders meet"""
    d = (rng.standard_normal(n) * 0.02).astype(np.float16)
    d[::7] = np.float16(2.0 ** -24)    # the smallest subnormal half
    d[2::9] = np.float16(3.0 * 2.0 ** -20)   # another subnormal
    d[3::11] = 0
    d[5::13] = np.float16(-65504.0)    # the largest, negative
    return d


def _q8_0(rng, N):
    """(stored rows [N, K/32*34], decoded W^T [N, K] float32)"""
    nb = K // 32
    q = rng.integers(-128, 128, (N, nb, 32)).astype(np.int8)
    d = _scales(rng, N * nb).reshape(N, nb)
    rows = np.concatenate([d.view(np.uint8).reshape(N, nb, 2), q.view(np.uint8)], axis=2)
    w = q.astype(np.float32) * d.astype(np.float32)[..., None]   # exact
    return np.ascontiguousarray(rows.reshape(N, -1)), w.reshape(N, K)


def _q4_0(rng, N):
    """the same for Q4_0: value i < 16 the low nibble of byte i, 16 + i its high"""
    nb = K // 32
    nib = rng.integers(0, 16, (N, nb, 32)).astype(np.uint8)
    d = _scales(rng, N * nb).reshape(N, nb)
    qs = nib[..., :16] | (nib[..., 16:] << 4)
    rows = np.concatenate([d.view(np.uint8).reshape(N, nb, 2), qs], axis=2)
    w = (nib.astype(np.float32) - 8.0) * d.astype(np.float32)[..., None]   # exact
    return np.ascontiguousarray(rows.reshape(N, -1)), w.reshape(N, K)


def _bf16(rng, N, k=K):
    """the same for bf16 (k values a row): random bits of every kind but NaN
    and infinity (subnormals kept: the fp32 GEMM reads a bf16 as it is)"""
    h = rng.integers(0, 1 << 16, (N, k)).astype(np.uint16)
    h[(h & 0x7F80) == 0x7F80] &= 0xBFFF   # an exponent of all ones -> a finite one
    w = (h.astype(np.uint32) << 16).view(np.float32)
    w = np.where(np.abs(w) > 1e30, np.float32(0.5), w)   # no overflow in the sums
    h = (w.view(np.uint32) >> 16).astype(np.uint16)
    return np.ascontiguousarray(h.view(np.uint8)), w


MAKE = {"q8_0": _q8_0, "q4_0": _q4_0, "bf16": _bf16}


def stored_and_decoded(rng, dtype, N):
    """(stored rows, decoded W^T float32) of N random rows of dtype: MAKE's,
    or for q4_k three random super-blocks (test_base_q4_k's rows, decoded
    by the reference)"""
    if dtype != "q4_k":
        return MAKE[dtype](rng, N)
    from test_base_q4_k import _random_rows

    from reference import q4_k
    rows = _random_rows(rng, N, 3 * 256)
    return rows, q4_k.dequantize(rows).astype(np.float32)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("N", [16, 57, 1000])
@pytest.mark.parametrize("dtype", list(MAKE))
def test_a_base_products_bits_are_the_decoded_weights(dtype, N, threads, restore_threads):
    # N 1000 at two threads: M = 1's two units, the second from column 504
    rng = np.random.default_rng(N)
    rows, w = MAKE[dtype](rng, N)
    rx.set_num_threads(threads)
    for M in range(1, 10):
        a = rng.standard_normal((M, K)).astype(np.float32)
        want = _core._sgemm(a, w, tb=True)
        got = _core._base_sgemm(dtype, rows, a)
        assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist(), (M, dtype)


@pytest.mark.parametrize("k", [16, 272, 360, 24])
def test_bf16_products_at_any_depth(k, restore_threads):
    """bf16 rows read in place at 1-4 rows (base_bf16.c's small-M kernel,
    16 k a step): one step, a KC chunk and one step more, and depths of
    no whole steps (360, 24: the kernel declines and the slivers are
    packed): the bits of the float32 product, at one and two threads."""
    rng = np.random.default_rng(k)
    rows, w = _bf16(rng, 75, k)
    for threads in (1, 2):
        rx.set_num_threads(threads)
        for M in (1, 2, 3, 4, 5):
            a = rng.standard_normal((M, k)).astype(np.float32)
            want = _core._sgemm(a, w, tb=True)
            got = _core._base_sgemm("bf16", rows, a)
            assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist(), (M, k)


def test_the_hook_refuses_rows_of_another_shape():
    rows, _ = _q8_0(np.random.default_rng(0), 16)
    a = np.ones((1, K), np.float32)
    with pytest.raises(ValueError, match="whole 32-value blocks"):
        _core._base_sgemm("q8_0", rows[:, :-1].copy(), a)
    with pytest.raises(ValueError, match="base dtype"):
        _core._base_sgemm("q5_1", rows, a)


def test_the_scalar_decoders_give_the_same_bits():
    """The products again in a process with RWKVX_BASE_PORTABLE=1: no AVX2
    sliver kernels (any x86-64 or other CPU)."""
    portable_run("test_base_sliver.py", "decoded_weights")
