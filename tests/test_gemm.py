"""rx_sgemm (csrc/gemm.c) against a float64 NumPy product, through the
rwkvx_c._core._sgemm test hook: every transpose combination, beta accumulate,
odd and block-crossing sizes, every micro-kernel this CPU runs, one and two
threads."""
import numpy as np
import pytest

import rwkvx_c as rx
from rwkvx_c import _core

from checks import kernel_runs, small_and_packed

KERNELS = [k for k in ("generic", "avx2-fma", "avx512f", "avx512f-12x32", "avx512f-8x32")
           if kernel_runs(_core._sgemm_use_kernel, k)]
# the SIMD ones: one FMA per k step in the same order, so bit-identical results
SIMD = [k for k in KERNELS if k != "generic"]

# (M, N, K): tiny, odd, crossing MR=6, 8 and 12 / NR=16 and the 32-column
# tile / KC=256 / MC=144 / the in-place versus packed A switch at N=128
# (N=32 for the 12-row kernel), a last sliver of 8 rows (20, 512: four
# zero rows in a 12-row tile), and N past one NC=1024 panel.
SHAPES = [(1, 1, 1), (7, 13, 5), (6, 16, 1), (5, 17, 3), (13, 128, 9), (13, 129, 9),
          (20, 100, 30), (512, 48, 70),
          (19, 32, 9), (19, 33, 9),
          (25, 40, 11), (150, 33, 257), (145, 200, 300), (64, 64, 64), (3, 4100, 2),
          (16, 16, 16), (17, 31, 19), (47, 130, 33), (161, 1030, 40)]


def _operands(rng, M, N, K, ta, tb):
    a = rng.standard_normal((K, M) if ta else (M, K), dtype=np.float32)
    b = rng.standard_normal((N, K) if tb else (K, N), dtype=np.float32)
    ref = (a.T if ta else a).astype(np.float64) @ (b.T if tb else b).astype(np.float64)
    return a, b, ref


def _close(got, ref):
    # fp32 dot products of length K: error grows like sqrt(K) * eps * |terms|
    scale = max(1.0, float(np.abs(ref).max()))
    assert np.abs(got - ref).max() <= 1e-5 * scale


@pytest.fixture(params=KERNELS)
def kernel(request):
    _core._sgemm_use_kernel(request.param)
    yield request.param
    _core._sgemm_use_kernel(None)


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_sgemm_matches_float64(kernel, M, N, K, ta, tb):
    rng = np.random.default_rng(M * 1000003 + N * 1009 + K * 7 + 2 * ta + tb)
    a, b, ref = _operands(rng, M, N, K, ta, tb)
    _close(_core._sgemm(a, b, ta, tb), ref)
    c0 = rng.standard_normal((M, N), dtype=np.float32)
    c = c0.copy()
    assert _core._sgemm(a, b, ta, tb, out=c, beta=1.0) is c
    _close(c, ref + c0)
    assert _core._sgemm(a, b, ta, tb, out=c) is c   # beta 0 overwrites
    _close(c, ref)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("M,N,K,ta,tb", [(512, 16, 256, False, False),   # LoRA down
                                         (256, 32, 512, True, False),    # LoRA weight grad
                                         (300, 260, 200, False, True),   # dx through a weight
                                         (97, 515, 130, True, False),
                                         (20, 700, 40, False, False),
                                         # one row sliver: cut into column blocks
                                         (16, 300, 600, True, False)])
def test_sgemm_threads(kernel, restore_threads, threads, M, N, K, ta, tb):
    rng = np.random.default_rng(M + N + K)
    a, b, ref = _operands(rng, M, N, K, ta, tb)
    rx.set_num_threads(threads)
    _close(_core._sgemm(a, b, ta, tb), ref)


@pytest.fixture
def full_budget():
    """_core._sgemm_full_budget, the default restored after the test."""
    yield _core._sgemm_full_budget
    _core._sgemm_full_budget(0)


# a parallel GEMM whose units would pack more of op(B) than a thread's
# budget runs in k windows of whole 256-deep blocks, in k order, each
# added to C as the next block would be: the same bits as all of K at once
@pytest.mark.parametrize("M,N,K,ta,tb", [(130, 200, 1000, False, False), (40, 600, 700, True, True),
                                         (16, 300, 600, True, False), (300, 70, 513, False, True)])
def test_sgemm_in_k_windows_gives_the_same_bits(kernel, restore_threads, full_budget, M, N, K,
                                                ta, tb):
    rng = np.random.default_rng(M + N + K)
    a, b, ref = _operands(rng, M, N, K, ta, tb)
    c0 = rng.standard_normal((M, N), dtype=np.float32)
    rx.set_num_threads(2)   # the parallel path: one thread packs for itself
    whole = (_core._sgemm(a, b, ta, tb), _core._sgemm(a, b, ta, tb, out=c0.copy(), beta=1.0))
    _close(whole[0], ref)
    assert full_budget(512 * 256) == 2 << 20   # the default: 8 MiB of floats
    for blocks in (1, 2):   # windows of 256 and 512 k (K rounded up: one budget fits all)
        full_budget(512 * 256 * blocks)
        got = (_core._sgemm(a, b, ta, tb), _core._sgemm(a, b, ta, tb, out=c0.copy(), beta=1.0))
        assert np.array_equal(got[0], whole[0]) and np.array_equal(got[1], whole[1]), blocks
    full_budget(1)   # below one block: windows of 256 k all the same
    assert np.array_equal(_core._sgemm(a, b, ta, tb), whole[0])


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_k", "bf16"])
def test_sgemm_over_a_base_in_k_windows_gives_the_same_bits(restore_threads, full_budget, dtype):
    # a frozen base's op(B) packed by its source from the window's first k
    from test_base_sliver import stored_and_decoded

    rng = np.random.default_rng(len(dtype))
    N = 16 * 20 + 5
    rows, w = stored_and_decoded(rng, dtype, N)
    a = rng.standard_normal((70, w.shape[1])).astype(np.float32)
    rx.set_num_threads(2)
    whole = _core._base_sgemm(dtype, rows, a)
    full_budget(1)   # windows of 256 k
    assert w.shape[1] > 256 and np.array_equal(_core._base_sgemm(dtype, rows, a), whole)
    _close(whole, a.astype(np.float64) @ w.T.astype(np.float64))


def test_sgemm_beta_accumulates_in_place_twice():
    rng = np.random.default_rng(3)
    a, b, ref = _operands(rng, 9, 20, 11, False, False)
    c = np.full((9, 20), np.nan, np.float32)
    _core._sgemm(a, b, out=c)                  # beta 0 never reads out
    _core._sgemm(a, b, out=c, beta=1.0)
    _close(c, 2 * ref)


def test_sgemm_bad_inputs():
    a = np.ones((4, 3), np.float32)
    b = np.ones((3, 5), np.float32)
    with pytest.raises(TypeError, match="a"):
        _core._sgemm(a.astype(np.float64), b)
    with pytest.raises(TypeError, match="b"):
        _core._sgemm(a, [[1.0]])
    with pytest.raises(ValueError, match="inner dimension"):
        _core._sgemm(a, b, ta=True)
    with pytest.raises(ValueError, match="C-contiguous"):
        _core._sgemm(np.ones((3, 4), np.float32).T, b)
    with pytest.raises(ValueError, match="out has shape"):
        _core._sgemm(a, b, out=np.zeros((5, 4), np.float32))
    with pytest.raises(ValueError, match="beta"):
        _core._sgemm(a, b, out=np.zeros((4, 5), np.float32), beta=0.5)
    with pytest.raises(ValueError, match="None"):
        _core._sgemm(a, b, beta=1.0)
    with pytest.raises(ValueError, match="empty"):
        _core._sgemm(np.ones((0, 3), np.float32), b)
    ro = np.zeros((4, 5), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        _core._sgemm(a, b, out=ro)
    with pytest.raises(ValueError, match="kernel"):
        _core._sgemm_use_kernel("no-such-kernel")


@pytest.mark.parametrize("gemm", [_core._sgemm, _core._bgemm])
def test_gemm_refuses_an_output_on_its_input(gemm):
    # threads would read op(A) while others already write C: a result that
    # depends on timing, so the batch is refused before anything is written
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    b = np.ones((4, 4), np.float32)
    for out, which in ((a, "input A"), (b, "input B")):
        before = out.copy()
        with pytest.raises(ValueError, match="output C of GEMM 0 of 1 overlaps the " + which):
            gemm(a, b, out=out)
        assert np.array_equal(out, before)


@pytest.mark.skipif(not {"avx2-fma", "avx512f"} <= set(SIMD),
                    reason="this CPU does not run both the AVX2 and the AVX-512 kernels")
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("M,N,K", [(64, 64, 63), (6, 33, 64), (61, 37, 29), (64, 48, 1),
                                   (5, 64, 17)])
def test_tiles_in_place_match_the_packed_kernels(M, N, K, ta, tb):
    # up to 64 x 64 over k <= 64 (the attention's tiles) the AVX-512
    # kernels read the operands in place (gemm.c "tiles"); the AVX2 kernel
    # packs them: both must give the same bits, written and accumulated
    rng = np.random.default_rng(M + 5 * N + 3 * K + 2 * ta + tb)
    a, b, ref = _operands(rng, M, N, K, ta, tb)
    c0 = rng.standard_normal((M, N), dtype=np.float32)
    got = {}
    try:
        for k in ("avx2-fma", "avx512f", "avx512f-12x32", "avx512f-8x32"):
            if k not in SIMD:
                continue
            _core._sgemm_use_kernel(k)
            acc = c0.copy()
            got[k] = (_core._sgemm(a, b, ta, tb), _core._sgemm(a, b, ta, tb, out=acc, beta=1.0))
    finally:
        _core._sgemm_use_kernel(None)
    _close(got["avx512f"][0], ref)
    _close(got["avx512f"][1], ref + c0)
    for k, (w, s) in got.items():
        assert np.array_equal(w, got["avx2-fma"][0]), k
        assert np.array_equal(s, got["avx2-fma"][1]), k


@pytest.mark.skipif(len(SIMD) < 2, reason="this CPU runs fewer than two SIMD GEMM kernels")
@pytest.mark.parametrize("M,N,K,ta,tb", [(161, 1030, 300, False, False), (47, 130, 33, True, True),
                                         (20, 100, 30, False, False), (512, 48, 70, True, False),
                                         (33, 100, 20, False, True), (100, 20, 520, True, False),
                                         (40, 530, 300, True, False)])
def test_simd_kernels_bit_identical(M, N, K, ta, tb):
    # the tile height must not change a result: a run's numbers do not
    # depend on the CPU vendor's kernel choice
    rng = np.random.default_rng(M + 7 * N + 11 * K)
    a, b, _ = _operands(rng, M, N, K, ta, tb)
    got = []
    try:
        for k in SIMD:
            _core._sgemm_use_kernel(k)
            got.append(_core._sgemm(a, b, ta, tb))
    finally:
        _core._sgemm_use_kernel(None)
    for k, g in zip(SIMD[1:], got[1:]):
        assert np.array_equal(g, got[0]), k


def _both_paths(a, b, ta, tb, c0, **blocks):
    return small_and_packed(_core._sgemm, 16, a, b, ta, tb, c0, **blocks)


@pytest.mark.skipif(not SIMD, reason="the small-M path runs on the x86 SIMD kernels")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("M", [1, 2, 5, 7, 8, 16])
@pytest.mark.parametrize("N,K", [(1, 1), (7, 3), (16, 256), (33, 257), (100, 513), (515, 40),
                                 (1030, 300), (4100, 9)])
def test_small_m_gives_the_packed_paths_bits(small_m, restore_threads, threads, M, N, K, ta,
                                             tb):
    # decoding's M = 1..16 rows read op(B) in place (gemm.c "small M"):
    # each C element the packed kernels' FMA chain, so the same bits, for
    # every kernel the CPU picks (the SIMD kernels share their bits)
    rng = np.random.default_rng(M * 7919 + N * 31 + K + 2 * ta + tb)
    a, b, ref = _operands(rng, M, N, K, ta, tb)
    c0 = rng.standard_normal((M, N), dtype=np.float32)
    rx.set_num_threads(threads)
    (w, s), (pw, ps) = _both_paths(a, b, ta, tb, c0)
    _close(w, ref)
    _close(s, ref + c0)
    assert np.array_equal(w, pw) and np.array_equal(s, ps)


@pytest.mark.skipif(not SIMD, reason="the small-M path runs on the x86 SIMD kernels")
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("M,N,K", [(1, 300, 70), (3, 17, 513), (9, 129, 64)])
def test_small_m_leading_dimensions(small_m, M, N, K, ta, tb):
    # the leading blocks of wider arrays: every operand's rows lie further
    # apart than its columns
    rng = np.random.default_rng(M + N + K + 2 * ta + tb)
    a, b, _ = _operands(rng, M + 5, N + 11, K + 3, ta, tb)
    c0 = rng.standard_normal((M, N), dtype=np.float32)
    (w, s), (pw, ps) = _both_paths(a, b, ta, tb, c0, m=M, n=N, k=K)
    ar = (a.T if ta else a)[:M, :K].astype(np.float64)
    br = (b.T if tb else b)[:K, :N].astype(np.float64)
    _close(w, ar @ br)
    assert np.array_equal(w, pw) and np.array_equal(s, ps)


@pytest.mark.skipif(not SIMD, reason="the small-M path runs on the x86 SIMD kernels")
def test_a_rows_product_does_not_depend_on_the_other_rows(small_m):
    # batch invariance: a row's result is the same bits alone, in a batch
    # of 8 (small-M path) and in one of 40 (packed)
    rng = np.random.default_rng(11)
    a = rng.standard_normal((40, 300), dtype=np.float32)
    b = rng.standard_normal((300, 770), dtype=np.float32)
    _core._sgemm_small_m(8)
    alone = _core._sgemm(a[3:4].copy(), b)
    assert np.array_equal(_core._sgemm(a[:8].copy(), b)[3], alone[0])
    assert np.array_equal(_core._sgemm(a, b)[3], alone[0])
