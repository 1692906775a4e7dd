"""bf16 mixed precision: rx_bgemm (csrc/gemm_bf16.c) through the _bgemm test
hook, each bf16 kernel this CPU runs, and the model / trainer with
precision="bf16".

Tolerances (see gemm_bf16.c): the product of two bf16 numbers is exact in
fp32, so a kernel adds exact products in some order. For one output with
P = sum |a_k b_k| over the rounded operands, any fp32 summation order is
within (K + 2) 2^-24 (P + |C_old|) of the exact sum, plus K 2^-125 for
products the hardware flushes to zero. Two kernels agree within twice that.
The rounding itself is checked exactly: op(A) . I returns bf16(op(A)).
"""
import json
import os

import numpy as np
import pytest

import rwkvx_c as rx
from rwkvx_c import _core
from rwkvx_c.train import Trainer, TrainError, TrainOptions

from checks import kernel_fixture, kernel_runs, portable_run, small_and_packed

U = 2.0 ** -24
KERNELS = ("generic-bf16", "avx512-bf16", "amx-bf16")


kernel = kernel_fixture(_core._bgemm_use_kernel, KERNELS, "kernel")


def bf16(x):
    """Round float32 to bf16 as Intel's vcvtne2ps2bf16 does (nearest even;
    NaN stays NaN; a subnormal input becomes a signed zero), returned as
    float32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    r = np.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, r)
    r = np.where((u & 0x7F800000) == 0, (u >> 16) & 0x8000, r)
    return (r.astype(np.uint32) << 16).view(np.float32)


def _operands(rng, M, N, K, ta, tb):
    a = rng.standard_normal((K, M) if ta else (M, K), dtype=np.float32) * 3
    b = rng.standard_normal((N, K) if tb else (K, N), dtype=np.float32)
    A = bf16(a.T if ta else a).astype(np.float64)
    B = bf16(b.T if tb else b).astype(np.float64)
    return a, b, A @ B, np.abs(A) @ np.abs(B)


# tiny, odd, crossing the 16-row / 32-column / 32-k blocks, the 64 x 128 units
SHAPES = [(1, 1, 1), (7, 13, 5), (16, 16, 32), (17, 33, 31), (33, 47, 70), (65, 129, 33),
          (130, 40, 257), (3, 300, 2)]


@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_bgemm_matches_float64_on_rounded_operands(kernel, M, N, K, ta, tb):
    rng = np.random.default_rng(M * 1000003 + N * 1009 + K * 7 + 2 * ta + tb)
    a, b, ref, P = _operands(rng, M, N, K, ta, tb)
    got = _core._bgemm(a, b, ta, tb)
    assert (np.abs(got - ref) <= (K + 2) * U * P + K * 2.0 ** -125).all()
    c0 = rng.standard_normal((M, N), dtype=np.float32)
    c = c0.copy()
    assert _core._bgemm(a, b, ta, tb, out=c, beta=1.0) is c
    tol = (K + 2) * U * (P + np.abs(c0)) + K * 2.0 ** -125
    assert (np.abs(c - (ref + c0)) <= tol).all()


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_bgemm_rounds_to_nearest_even_exactly(kernel, ta, tb):
    """a . I and I . b return the bf16 rounding of a and b bit for bit: ties
    to even, carries into the exponent, the largest finite values,
    subnormal inputs (to zero, the largest ones too, which nearest-even
    rounding alone would carry up to the smallest normal)."""
    rng = np.random.default_rng(5)
    special = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -9, 1 + 3 * 2 ** -9,
                        -(1 + 2 ** -9), 1 - 2 ** -25, 3.3e38, -3.38e38, 1e-39, -1e-39,
                        1.2e-38, 1.1754944e-38, 0.0, -0.0, 65504.0, 2 ** -133, 255.5,
                        1.1754942e-38, -1.1754942e-38],
                       dtype=np.float32)
    M, K = 37, 45
    a = rng.standard_normal((M, K)).astype(np.float32)
    a.flat[:special.size] = special
    assert np.isfinite(bf16(a)).all()
    eye = np.eye(K, dtype=np.float32)
    got = _core._bgemm(np.ascontiguousarray(a.T) if ta else a, eye, ta, tb)
    assert np.array_equal(got, bf16(a))
    b = np.ascontiguousarray(a.T)  # (K, M): I . b = bf16(b)
    got = _core._bgemm(eye, np.ascontiguousarray(b.T) if tb else b, ta, tb)
    assert np.array_equal(got, bf16(b))


def test_bgemm_nan_and_overflow(kernel):
    a = np.ones((3, 4), np.float32)
    a[1, 2] = np.nan
    got = _core._bgemm(a, np.ones((4, 5), np.float32))
    assert np.isnan(got[1]).all() and np.isfinite(got[[0, 2]]).all()
    # above the largest bf16 (0x7F7F...) by more than half an ulp: infinity
    big = np.array([[3.4e38]], np.float32)
    assert _core._bgemm(big, np.ones((1, 1), np.float32))[0, 0] == np.inf


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True)])
def test_kernels_agree_with_fp32_gemm_on_rounded_operands(kernel, ta, tb):
    """Each bf16 kernel against rx_sgemm on operands rounded beforehand (fp32
    FMAs of bf16 values add the same exact products): within twice the
    one-kernel bound, on a projection-like shape."""
    M, N, K = 300, 96, 200
    rng = np.random.default_rng(11)
    a, b, _, P = _operands(rng, M, N, K, ta, tb)
    got = _core._bgemm(a, b, ta, tb)
    want = _core._sgemm(bf16(a), bf16(b), ta, tb)
    assert (np.abs(got - want) <= 2 * (K + 2) * U * P + K * 2.0 ** -124).all()
    assert not np.array_equal(got, _core._sgemm(a, b, ta, tb))  # it did round


# many 64-row panels; two panels, whose columns are cut among the threads,
# and a K of three 256-long ranges (a weight gradient's shape, transposed A)
@pytest.mark.parametrize("M,N,K,ta", [(700, 200, 300, False), (100, 200, 600, True)])
def test_bgemm_independent_of_thread_count(kernel, restore_threads, M, N, K, ta):
    rng = np.random.default_rng(2)
    a = rng.standard_normal((K, M) if ta else (M, K), dtype=np.float32)
    b = rng.standard_normal((K, N), dtype=np.float32)
    outs = []
    for t in (1, 2, 3, 7):
        rx.set_num_threads(t)
        outs.append(_core._bgemm(a, b, ta, False))
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.fixture
def pack_budget():
    """_core._bgemm_pack_budget, the default restored after the test."""
    yield _core._bgemm_pack_budget
    _core._bgemm_pack_budget(0)


# a budget of a few column blocks of op(B) splits each product into windows,
# each its own pass: 256-aligned k ranges when K >= N (added to C in k
# order), else columns (the last window narrower: N, K not multiples of 32)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("M,N,K,ta,tb", [(130, 200, 300, False, False), (40, 301, 70, True, True),
                                         (9, 1000, 33, False, True), (257, 65, 600, True, False)])
def test_bgemm_in_windows_gives_the_same_bits(kernel, restore_threads, pack_budget,
                                                     threads, M, N, K, ta, tb):
    rng = np.random.default_rng(M + N)
    a, b, want, P = _operands(rng, M, N, K, ta, tb)
    c0 = rng.standard_normal((M, N), dtype=np.float32)
    rx.set_num_threads(threads)
    whole = (_core._bgemm(a, b, ta, tb), _core._bgemm(a, b, ta, tb, out=c0.copy(), beta=1.0))
    per = -(-K // 32) * 32   # packed bf16 elements of one column of op(B)
    assert pack_budget(per * 32) == 4 << 20   # the default: 8 MiB of bf16
    for cols in (32, 64, 96):
        assert pack_budget(per * cols) == per * max(cols - 32, 32)
        got = (_core._bgemm(a, b, ta, tb), _core._bgemm(a, b, ta, tb, out=c0.copy(), beta=1.0))
        assert np.array_equal(got[0], whole[0]) and np.array_equal(got[1], whole[1]), cols
    assert (np.abs(whole[0] - want) <= (K + 2) * U * P + K * 2.0 ** -124).all()
    # a budget below one window of 32 columns still computes, 32 at a time
    pack_budget(1)
    assert np.array_equal(_core._bgemm(a, b, ta, tb), whole[0])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_k", "bf16"])
def test_bgemm_over_a_base_in_windows_gives_the_same_bits(kernel, restore_threads,
                                                                 pack_budget, threads, dtype):
    # a frozen base's op(B) packed by its source a window at a time (the
    # head of a big model is 512 MiB packed whole): here 64 columns by 256
    # k, two k ranges; a bf16 base is read in place and takes none of the
    # budget
    from test_base_sliver import stored_and_decoded

    rng = np.random.default_rng(len(dtype) + threads)
    N = 16 * 20 + 5
    rows, w = stored_and_decoded(rng, dtype, N)
    a = rng.standard_normal((70, w.shape[1])).astype(np.float32)
    rx.set_num_threads(threads)
    whole = _core._base_sgemm(dtype, rows, a, bf16=True)
    pack_budget(w.shape[1] * 64)
    assert np.array_equal(_core._base_sgemm(dtype, rows, a, bf16=True), whole)
    A, B = bf16(a).astype(np.float64), bf16(w.T).astype(np.float64)
    assert np.all(np.abs(whole - A @ B) <= (w.shape[1] + 2) * U * (np.abs(A) @ np.abs(B)) + 1e-30)


@pytest.mark.parametrize("tb", [False, True])
def test_bgemm_a_rows_product_does_not_depend_on_the_other_rows(kernel, restore_threads, tb):
    # batch invariance for generation: decoding stacks one row per sequence
    # (M = 1..64), and a row's bf16 product is the same bits alone or
    # among others, at one and two threads
    rng = np.random.default_rng(4)
    a = rng.standard_normal((100, 300), dtype=np.float32)
    b = rng.standard_normal((770, 300) if tb else (300, 770), dtype=np.float32)
    for t in (1, 2):
        rx.set_num_threads(t)
        alone = _core._bgemm(a[33:34].copy(), b, False, tb)[0]
        for m in (34, 40, 64, 100):
            assert np.array_equal(_core._bgemm(a[:m].copy(), b, False, tb)[33], alone), m


def _both_paths(a, b, ta, tb, c0, **blocks):
    return small_and_packed(_core._bgemm, 8, a, b, ta, tb, c0, **blocks)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 7, 8])
@pytest.mark.parametrize("N,K", [(1, 1), (7, 3), (16, 256), (33, 257), (100, 513), (515, 40),
                                 (1030, 300), (23, 700)])
def test_small_m_gives_the_packed_paths_bits(kernel, small_m, restore_threads, threads, M, N, K,
                                             ta, tb):
    # decoding's M = 1..8 rows read op(B) a 16-column block at a time and
    # sum each C element in the order of the kernel's packed path (the
    # generic kernel's, AMX's tile chain, AVX512-BF16's ranges): the same bits
    rng = np.random.default_rng(M * 7919 + N * 31 + K + 2 * ta + tb)
    a, b, ref, mag = _operands(rng, M, N, K, ta, tb)
    c0 = rng.standard_normal((M, N), dtype=np.float32)
    rx.set_num_threads(threads)
    (w, s), (pw, ps) = _both_paths(a, b, ta, tb, c0)
    assert np.all(np.abs(w - ref) <= (K + 2) * U * mag + 1e-30)
    assert np.array_equal(w, pw) and np.array_equal(s, ps)


@pytest.mark.parametrize("ta,tb", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("M,N,K", [(1, 300, 70), (3, 17, 513), (8, 129, 64)])
def test_small_m_leading_dimensions(kernel, small_m, M, N, K, ta, tb):
    # the leading blocks of wider arrays: every operand's rows lie further
    # apart than its columns
    rng = np.random.default_rng(M + N + K + 2 * ta + tb)
    a, b, _, _ = _operands(rng, M + 5, N + 11, K + 3, ta, tb)
    c0 = rng.standard_normal((M, N), dtype=np.float32)
    (w, s), (pw, ps) = _both_paths(a, b, ta, tb, c0, m=M, n=N, k=K)
    A = bf16((a.T if ta else a)[:M, :K]).astype(np.float64)
    B = bf16((b.T if tb else b)[:K, :N]).astype(np.float64)
    assert np.all(np.abs(w - A @ B) <= (K + 2) * U * (np.abs(A) @ np.abs(B)) + 1e-30)
    assert np.array_equal(w, pw) and np.array_equal(s, ps)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("N", [16 * 9 + 5, 16 * 9, 16])
@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_k", "bf16"])
def test_small_m_over_a_base_gives_the_packed_paths_bits(kernel, small_m, restore_threads,
                                                        threads, N, dtype):
    # decoding over a frozen base at bf16 precision: a Q8_0, Q4_0 or Q4_K
    # base's rows become AMX's A tile of the transposed product (small_amx_t,
    # whole 16-column blocks in pairs, an odd one alone, the edge block
    # packed); a bf16 base's packed a column block at a time. Each C
    # element's bits are the packed path's.
    from test_base_sliver import stored_and_decoded

    rng = np.random.default_rng(len(dtype) + threads + N)
    rows, w = stored_and_decoded(rng, dtype, N)
    for M in (1, 2, 3, 5, 8):
        a = rng.standard_normal((M, w.shape[1])).astype(np.float32)
        got = []
        for m in (8, 0):
            _core._sgemm_small_m(m)
            rx.set_num_threads(threads)
            got.append(_core._base_sgemm(dtype, rows, a, bf16=True))
        assert np.array_equal(got[0], got[1]), M
        A, B = bf16(a).astype(np.float64), bf16(w.T).astype(np.float64)
        assert np.all(np.abs(got[0] - A @ B) <= (w.shape[1] + 2) * U * (np.abs(A) @ np.abs(B))
                      + 1e-30)


@pytest.mark.parametrize("dtype", ["q8_0", "q4_0", "q4_k", "bf16"])
def test_bgemm_over_a_base_gives_its_float32_weights_bits(kernel, small_m, restore_threads,
                                                          dtype):
    # a base's blocks (block_bf16's, rows_bf16's tiles or blocks) hold its
    # weights, decoded exactly, rounded as the GEMM rounds a float32 B: the
    # product's bits are those of the float32 weights' product, at
    # decoding's M (the small path) and the packed path's, whole and edge
    # column blocks, every kind of scale (test_base_sliver's)
    from test_base_sliver import stored_and_decoded

    rng = np.random.default_rng(len(dtype))
    rows, w = stored_and_decoded(rng, dtype, 16 * 9 + 5)
    for threads in (1, 2):
        rx.set_num_threads(threads)
        for M in (1, 2, 4, 8, 40):
            a = rng.standard_normal((M, w.shape[1])).astype(np.float32)
            assert np.array_equal(_core._base_sgemm(dtype, rows, a, bf16=True),
                                  _core._bgemm(a, w, False, True)), (threads, M)


def test_the_avx512bf16_base_kernels_without_vbmi_give_the_same_bits():
    """A base's bf16 blocks without AVX-512 VBMI (RWKVX_BASE_PORTABLE=
    avx512bf16: level 2's kernels, as a CPU with AVX512-BF16 alone runs them)."""
    portable_run("test_bf16.py", "base_gives_its_float32", level="avx512bf16")


def test_small_m_rounds_as_the_packed_path(kernel, small_m):
    # ties, subnormals (to signed zero), infinities: the operands' rounding
    # is the packed path's
    a = np.array([[1 + 2 ** -8, 1 + 3 * 2 ** -8, 1e-40, -1e-40, np.inf, 3.0]], np.float32)
    b = np.array([[1.0, 2.0], [-1.0, 1 + 2 ** -8], [1e30, 1.0], [1.0, 2.0], [0.5, 0.0],
                  [1e-39, 7.0]], np.float32)
    (w, s), (pw, ps) = _both_paths(a, b, False, False, np.ones((1, 2), np.float32))
    assert np.array_equal(w, pw, equal_nan=True) and np.array_equal(s, ps, equal_nan=True)


def test_kernel_names_and_hooks():
    assert rx.gemm_kernel() in ("generic", "avx2-fma", "avx512f", "avx512f-12x32", "avx512f-8x32")
    picked = rx.gemm_kernel("bf16")
    assert picked in KERNELS and kernel_runs(_core._bgemm_use_kernel, picked)
    assert rx.bf16_hardware() == (picked != "generic-bf16")
    with pytest.raises(ValueError, match="precision"):
        rx.gemm_kernel("fp16")
    with pytest.raises(ValueError, match="unknown or cannot run here"):
        _core._bgemm_use_kernel("no-such-kernel")
    with pytest.raises(ValueError, match="inner dimension"):
        _core._bgemm(np.ones((2, 3), np.float32), np.ones((4, 2), np.float32))


def test_env_var_forces_kernel(tmp_path):
    """RWKVX_BF16_KERNEL picks the kernel for a process (one this CPU lacks is
    ignored)."""
    import subprocess
    import sys
    code = "import rwkvx_c as rx; print(rx.gemm_kernel('bf16'))"
    for name in ("generic-bf16", "no-such-kernel"):
        # the package as imported here, run from a folder with no source tree
        env = dict(os.environ, RWKVX_BF16_KERNEL=name,
                   PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(rx.__file__))))
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, cwd=str(tmp_path))
        assert r.returncode == 0, r.stderr
        want = name if name == "generic-bf16" else rx.gemm_kernel("bf16")
        assert r.stdout.strip() == want


# ---- the model -------------------------------------------------------------

SMALL = dict(n_embd=64, n_head=2, head_size=32, n_rwkv_layer=2, n_attn_layer=1, vocab_size=97,
             ffn_dim=128, Dw=8, Da=8, Dg=16, Dv=8, chunk_size=8, moba_top_k=1)


def _fwd_bwd(m, x, y):
    logits = m.forward(x).astype(np.float64)
    loss = m.backward(y)
    return logits, loss, m.grad_buffer.astype(np.float64)


def test_precision_keyword_and_property():
    m = rx.RxPtModel(SMALL)
    assert m.precision == "fp32"
    m.precision = "bf16"
    assert m.precision == "bf16"
    assert rx.RxPtModel(SMALL, precision="bf16").precision == "bf16"
    with pytest.raises(ValueError, match="precision"):
        rx.RxPtModel(SMALL, precision="fp16")
    with pytest.raises(ValueError, match="precision"):
        m.precision = "half"
    assert m.precision == "bf16"


def test_bf16_model_close_to_fp32_model():
    """Loose bound, stated: each projection's inputs carry a relative rounding
    error <= 2^-9, so one GEMM's output is off by <= 2^-8 of its |a||b| sum;
    the logits pass through about 4 GEMMs per block (3 blocks) and the head,
    ~13 in series: norm-wise 13 * 2^-8 ~ 5%. Grads pass through twice as
    many (forward and backward): 10%. The loss (a mean of log-softmax)
    moves by at most the logits' max change."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 97, (2, 40)).astype(np.int32)
    y = rng.integers(0, 97, (2, 40)).astype(np.int32)
    l32, loss32, g32 = _fwd_bwd(rx.RxPtModel(SMALL, seed=4), x, y)
    l16, loss16, g16 = _fwd_bwd(rx.RxPtModel(SMALL, seed=4, precision="bf16"), x, y)
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
    assert 0 < rel(l16, l32) <= 0.05
    assert abs(loss16 - loss32) <= 2 * np.abs(l16 - l32).max()
    assert 0 < rel(g16, g32) <= 0.10


def test_bf16_model_kernels_agree(kernel):
    """The bf16 model on each kernel against the generic kernel: the kernels
    differ only in fp32 summation order, but a later rounding to bf16 can
    turn a last-bit difference into 2^-8 of that element, rarely; norm-wise
    1% on the logits and 3% on the grads. Repeated calls are bitwise equal."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 97, (2, 24)).astype(np.int32)
    y = rng.integers(0, 97, (2, 24)).astype(np.int32)
    m = rx.RxPtModel(SMALL, seed=2, precision="bf16")
    l_k, _loss_k, g_k = _fwd_bwd(m, x, y)
    _core._bgemm_use_kernel("generic-bf16")
    l_g, _loss_g, g_g = _fwd_bwd(m, x, y)
    # the kernels' sums differ in the last fp32 bits; a rounding to bf16
    # further on may then land on the other side (2^-8), rarely
    assert np.linalg.norm(l_k - l_g) <= 1e-2 * np.linalg.norm(l_g)
    assert np.linalg.norm(g_k - g_g) <= 3e-2 * np.linalg.norm(g_g)
    again = _fwd_bwd(m, x, y)
    assert np.array_equal(again[0], l_g) and np.array_equal(again[2], g_g)  # deterministic


# ---- the trainer -------------------------------------------------------------

def _opts(tmp_path, **kw):
    p = tmp_path / "corpus.txt"
    if not p.exists():
        rng = np.random.default_rng(0)
        words = ["def", "return", "self", "import", "class", "for", "in", "if", "(", ")", ":"]
        p.write_text(" ".join(rng.choice(words, 6000)))
    base = dict(preset="tiny", data=str(p), model=dict(SMALL, vocab_size=256), batch=2,
                seq_len=24, steps=6, eval_tokens=96, warmup_steps=2, lr=3e-3, threads=2,
                cache_dir=str(tmp_path / "cache"), precision="bf16")
    base.update(kw)
    return TrainOptions(**base)


def _losses(tr, until):
    out = []
    while tr.step_count < until:
        out.append(tr.step()["loss"])
    return out


def test_bf16_resume_reproduces_the_uninterrupted_run(tmp_path):
    full = Trainer(_opts(tmp_path), str(tmp_path / "full"))
    assert full.model.precision == "bf16"
    ref_losses = _losses(full, 6)
    part = Trainer(_opts(tmp_path), str(tmp_path / "part"))
    first = _losses(part, 3)
    part.save()
    del part
    resumed = Trainer.resume(str(tmp_path / "part"), precision="auto")
    assert resumed.model.precision == "bf16"
    assert first + _losses(resumed, 6) == ref_losses  # bit for bit


def test_precision_in_checkpoint_and_resume_refuses_a_change(tmp_path):
    out = str(tmp_path / "run")
    Trainer(_opts(tmp_path, steps=2), out).run()
    from rwkvx_c.run.checkpoint import read_checkpoint
    state = read_checkpoint(os.path.join(out, "checkpoint.safetensors"))[2]
    assert state["options"]["precision"] == "bf16"
    with pytest.raises(TrainError, match="precision 'bf16' -> 'fp32'"):
        Trainer.resume(out, precision="fp32")
    with pytest.raises(TrainError, match="unknown precision 'fp16'"):
        Trainer(_opts(tmp_path, precision="fp16"), str(tmp_path / "other"))


def test_auto_precision_follows_the_hardware(tmp_path):
    o = _opts(tmp_path, precision="auto").resolved()
    # independent of the library's own pick: the CPU's flags and vendor. bf16
    # on AMX, and on AVX512-BF16 where vdpbf16ps runs at the FMA rate (AMD:
    # Zen 4 and Zen 5), as long as that kernel is the one picked
    with open("/proc/cpuinfo") as f:
        info = f.read()
    amd = "AuthenticAMD" in info
    k = rx.gemm_kernel("bf16")
    pays = ((" amx_bf16" in info and k == "amx-bf16")
            or (" avx512_bf16" in info and amd and k == "avx512-bf16"))
    assert o.precision == ("bf16" if pays else "fp32")
    assert _core.bf16_pays() == pays
    json.dumps(o.to_dict())
