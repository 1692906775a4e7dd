"""The fast decode's product over a Q8_0 or Q4_0 base (csrc/base_fast.c,
docs/training.md §Fast decode): bit for bit a float64 NumPy reference of
exactly its arithmetic (each row's activations quantised alone to 32-value
int8 blocks, integer dot products with the stored blocks, two float32
roundings a block), at M 1..9 and up to 512 (odd too), odd N, two threads, with the
AVX512-VNNI, AVX2 and portable kernels; each row's result independent of the others; within the
documented bound of the exact product. GenState's fast_decode:
tests/test_gen.py."""
import numpy as np
import pytest
from test_base_sliver import MAKE, K

import rwkvx_c as rx
from rwkvx_c import _core

from checks import portable_run


def _r32(x):
    """float64 values rounded to float32 (a float32 operation computed in
    float64 then rounded: +, *, / of float32 operands round once, exactly)"""
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def _quantise(a):
    """(qx int64 [M, K], dx float64 [M, K/32]): each 32-value block of each
    row, dx = amax / 127, qx = rint(x * (1 / dx or 0)), float32 roundings"""
    M = a.shape[0]
    x = a.astype(np.float64).reshape(M, -1, 32)
    amax = np.abs(x).max(axis=2)
    d = _r32(amax / 127.0)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, _r32(1.0 / np.where(d != 0, d, 1.0)), 0.0)
    q = np.rint(_r32(x * inv[..., None]))
    q = np.where(np.abs(q) <= 127, q, 0).astype(np.int64)
    return q.reshape(M, -1), d


def _stored(dtype, rows):
    """(q int64 [N, K], dw float64 [N, K/32]) of the stored rows"""
    N = rows.shape[0]
    if dtype == "q8_0":
        blk = rows.reshape(N, -1, 34)
        q = blk[..., 2:].view(np.int8).astype(np.int64)
    else:
        blk = rows.reshape(N, -1, 18)
        qs = blk[..., 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.int64) - 8
    dw = np.ascontiguousarray(blk[..., :2]).view(np.float16)[..., 0].astype(np.float64)
    return q.reshape(N, -1), dw


def fast_reference(dtype, rows, a):
    """float32 [M, N]: acc = acc + fl(fl(dw dx) isum) over the blocks in
    order from zero, isum the exact integer dot product of a block"""
    qx, dx = _quantise(a)
    qw, dw = _stored(dtype, rows)
    M, N, nb = a.shape[0], rows.shape[0], a.shape[1] // 32
    isum = np.einsum("mbt,nbt->mnb", qx.reshape(M, nb, 32), qw.reshape(N, nb, 32))
    acc = np.zeros((M, N))
    for b in range(nb):
        s = _r32(dx[:, None, b] * dw[None, :, b])
        acc = _r32(acc + _r32(s * isum[:, :, b].astype(np.float64)))
    return acc.astype(np.float32)


def _rows(dtype, rng, N):
    """stored rows with ordinary scales (the sliver test's every-kind
    scales include -65504, whose products overflow a float32 sum)"""
    rows, _ = MAKE[dtype](rng, N)
    nb = 34 if dtype == "q8_0" else 18
    blk = rows.reshape(N, -1, nb)
    d = (rng.standard_normal(blk.shape[:2]) * 0.02).astype(np.float16)
    d[0, 0] = 0
    blk[..., :2] = d.view(np.uint8).reshape(*d.shape, 2)
    return rows


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("N", [16, 57, 1000])
@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_fast_product_is_its_reference_bit_for_bit(dtype, N, threads, restore_threads):
    rng = np.random.default_rng(N)
    rows = _rows(dtype, rng, N)
    rx.set_num_threads(threads)
    for M in range(1, 10):
        a = rng.standard_normal((M, K)).astype(np.float32)
        a[0, :32] = 0.0                 # a zero block: scale 0, q 0
        a[-1, 32:64] *= 1e-3            # small values
        got = _core._base_sgemm(dtype, rows, a, fast=True)
        np.testing.assert_array_equal(got, fast_reference(dtype, rows, a))
        # each row alone gives its own bits: batch invariance
        for i in range(M):
            np.testing.assert_array_equal(_core._base_sgemm(dtype, rows, a[i:i + 1], fast=True),
                                          got[i:i + 1])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_fast_product_many_rows(dtype, threads, restore_threads):
    # rows past the register tiles, where the AVX2 kernel sweeps a repacked
    # panel (fewer rows read the blocks in place): still the reference bit
    # for bit, and any cut of the batch gives each row the same bits
    rng = np.random.default_rng(7)
    rows = _rows(dtype, rng, 203)       # odd N: a ragged last group
    rx.set_num_threads(threads)
    a = rng.standard_normal((512, K)).astype(np.float32)
    a[3, :32] = 0.0
    a[100, 64:96] *= 1e-3
    a[200, ::41] *= 1e3                 # large values: whole int8 range
    full = _core._base_sgemm(dtype, rows, a, fast=True)
    np.testing.assert_array_equal(full, fast_reference(dtype, rows, a))
    for M in (1, 3, 4, 5, 63, 64, 65, 257):
        for i0 in (0, 97, 512 - M):
            np.testing.assert_array_equal(
                _core._base_sgemm(dtype, rows, a[i0:i0 + M], fast=True), full[i0:i0 + M])


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0"])
def test_fast_product_is_near_the_exact_one(dtype):
    # the bound docs/training.md §Fast decode states: a quantised x is off
    # by at most half a step, amax_b / 254, so a product by at most
    # sum_b amax_b / 254 * |w_b|_1, plus float32 rounding of the sums
    rng = np.random.default_rng(1)
    N = 300
    rows = _rows(dtype, rng, N)
    qw, dw = _stored(dtype, rows)
    w = (qw.reshape(N, -1, 32) * dw[..., None]).reshape(N, K)
    a = rng.standard_normal((4, K)).astype(np.float32)
    a[:, ::37] *= 30.0                  # a large value in some blocks
    exact = a.astype(np.float64) @ w.T
    fast = _core._base_sgemm(dtype, rows, a, fast=True)
    amax = np.abs(a.astype(np.float64)).reshape(4, -1, 32).max(axis=2)
    wsum = np.abs(w).reshape(N, -1, 32).sum(axis=2)
    bound = amax @ wsum.T / 254 + 2.0 ** -20 * (np.abs(a).astype(np.float64) @ np.abs(w).T)
    err = np.abs(fast - exact)
    assert (err <= bound).all()
    assert err.max() > 0.01 * bound.max()   # the bound is not vacuous here


def test_fast_product_nonfinite_and_refusals():
    rng = np.random.default_rng(2)
    rows = _rows("q8_0", rng, 24)
    a = rng.standard_normal((2, K)).astype(np.float32)
    a[1, 40] = np.nan
    got = _core._base_sgemm("q8_0", rows, a, fast=True)
    assert np.isfinite(got[0]).all() and np.isnan(got[1]).all()
    with pytest.raises(ValueError, match="fast decode"):
        _core._base_sgemm("bf16", MAKE["bf16"](rng, 8)[0], a, fast=True)


@pytest.mark.parametrize("level", ["1", "avx2"])
def test_fast_product_portable_and_avx2_kernels(level):
    # the portable kernel (RWKVX_BASE_PORTABLE=1), and the AVX2 ones alone
    # where the CPU has AVX-512 (=avx2; there they otherwise take only a
    # ragged last group), give the reference's bits
    portable_run("test_base_fast.py", "test_fast_product_is_its_reference_bit_for_bit or "
                 "test_fast_product_many_rows", level)
