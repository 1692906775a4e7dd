"""RWKV-7 time-mix, channel-mix and residual block (docs/maths.md): the C
kernels through the Python API against the float64 reference
(tests/reference/rwkv.py), forward and every gradient.

Tolerances (tests/checks.py): forward max-abs error <= 1e-5 * max|reference|,
each gradient <= 1e-4 * max|reference gradient| of that tensor.
`pytest --rx-errors` prints the worst ratio per tensor and case."""
import functools
import zlib

import numpy as np
import pytest

import rwkvx_c as rx

from checks import FWD_TOL, GN_EPS, GRAD_TOL, LN_EPS, assert_rel, rel_err
from reference.autograd import Var
from reference.layers import channelmix as ref_channelmix
from reference.rwkv import block_param_shapes, rwkv_block, timemix, tm_param_shapes


def make_params(rng, shapes):
    """float32 params: matrices scaled to keep activations O(1), norm gains
    near 1, other vectors in [-1, 1]."""
    p = {}
    for k, s in shapes.items():
        u = rng.uniform(-1.0, 1.0, s)
        if len(s) == 2:
            u *= np.sqrt(3.0 / s[0])
        elif k.split(".")[-1] in ("ln1_w", "ln2_w", "ln_x_w"):
            u = 1.0 + 0.2 * u
        p[k] = u.astype(np.float32)
    return p


# (name, kind, B, T, H, N, (Dw, Da, Dg, Dv), F, layer_id, carries, inject d_v_first)
CASES = [
    ("tm_l0", "tm", 2, 5, 3, 8, (3, 5, 6, 4), 0, 0, True, True),
    ("tm_l2", "tm", 2, 5, 3, 8, (3, 5, 6, 4), 0, 2, True, False),
    ("tm_l0_T1_nocarry", "tm", 2, 1, 3, 8, (4, 3, 5, 6), 0, 0, False, True),
    ("tm_l2_T1_carry", "tm", 2, 1, 3, 8, (4, 3, 5, 6), 0, 2, True, False),
    ("tm_l1_T19_N5", "tm", 1, 19, 5, 5, (3, 3, 4, 5), 0, 1, True, False),
    ("cm", "cm", 2, 5, 3, 8, None, 37, 0, True, False),
    ("cm_T1_nocarry", "cm", 2, 1, 3, 8, None, 37, 0, False, False),
    ("block_l0", "block", 2, 5, 3, 8, (3, 5, 6, 4), 37, 0, True, True),
    ("block_l2", "block", 2, 5, 3, 8, (3, 5, 6, 4), 37, 2, True, False),
    ("block_l0_T1", "block", 2, 1, 3, 8, (6, 4, 3, 5), 37, 0, False, False),
    ("block_l2_T19", "block", 1, 19, 3, 8, (6, 4, 3, 5), 37, 2, True, False),
    # C = 100: rows not a multiple of any vector width
    ("block_l1_C100", "block", 2, 3, 5, 20, (3, 4, 5, 6), 37, 1, True, False),
    # B*T = 57: two token blocks of the backward's per-block sums, the first
    # one straddling sequences 0 and 1
    ("block_l1_B3_T19", "block", 3, 19, 3, 8, (6, 4, 3, 5), 37, 1, True, False),
    # F*B*T < C: the channel-mix lerp backward has no room for block sums
    # and runs as one block
    ("cm_T1_C100", "cm", 1, 1, 5, 20, None, 37, 0, True, False),
]
# Big enough that every OpenMP path runs threaded (B*T*C >= 65536).
BIG = ("block_l1_big", "block", 2, 128, 4, 64, (8, 8, 16, 4), 96, 1, True, False)
# one head, B = 1: from 2 threads the WKV7 forward and backward split the
# head into row tiles sharing the block's per-head scratch (wkv7.c)
SPLIT = ("block_l1_split", "block", 1, 1030, 1, 64, (8, 8, 16, 4), 96, 1, True, False)


def case_data(case):
    """The float32 inputs of a case: params dict and the array arguments."""
    name, kind, B, T, H, N, dims, F, lid, carries, inject = case
    C = H * N
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if kind == "cm":
        shapes = {"ffn_x_k": (C,), "ffn_key_w": (C, F), "ffn_value_w": (F, C)}
    elif kind == "tm":
        shapes = tm_param_shapes(C, *dims, lid)
    else:
        shapes = block_param_shapes(C, *dims, F, lid)
    p = make_params(rng, shapes)

    def f32(*s):
        return rng.standard_normal(s).astype(np.float32)

    a = dict(x=f32(B, T, C), dy=f32(B, T, C))
    a["xp1"] = f32(B, C) if carries else None
    a["xp2"] = f32(B, C) if carries and kind == "block" else None
    a["vf"] = f32(B, T, C) if lid > 0 else None
    a["dvf"] = f32(B, T, C) if lid == 0 and inject else None
    return p, a


def reference(case, p, a):
    """{name: float64 array}: forward outputs and the grads of
    sum(out*dy) (+ sum(v_first*dvf) at layer 0) from tests/reference."""
    _name, kind, B, _T, H, N, _dims, _F, lid, _carries, _inject = case
    C = H * N

    def leaf(v, shape):   # a None carry is zero: the reference differentiates w.r.t. it
        return Var(np.zeros(shape) if v is None else v)

    P = {k: Var(v) for k, v in p.items()}
    X, XP1, XP2 = Var(a["x"]), leaf(a["xp1"], (B, C)), leaf(a["xp2"], (B, C))
    VF = None if a["vf"] is None else Var(a["vf"])
    if kind == "cm":
        out, vout = ref_channelmix(P, X, XP1), None
    elif kind == "tm":
        out, vout = timemix(P, X, XP1, VF, H, N, lid, GN_EPS)
    else:
        out, vout = rwkv_block(P, X, XP1, XP2, VF, H, N, lid, LN_EPS, GN_EPS)
    loss = (out * a["dy"]).sum()
    if a["dvf"] is not None:
        loss = loss + (vout * a["dvf"]).sum()
    loss.backward()
    ref = {"out": out.value, "dx": X.grad}
    if kind == "block":
        ref.update(d_tm_xprev=XP1.grad, d_cm_xprev=XP2.grad)
    else:
        ref["d_xprev_init"] = XP1.grad
    if kind != "cm":
        ref.update({"v_first": vout.value} if lid == 0 else {"d_v_first": VF.grad})
    ref.update({"grad " + k: v.grad for k, v in P.items()})
    return ref


def run_c(case, p, a, threads=None):
    """The same quantities as reference() from the C kernels."""
    _name, kind, _B, _T, H, N, _dims, _F, lid, _carries, _inject = case
    x, dy, xp1, xp2, vf, dvf = (a[k] for k in ("x", "dy", "xp1", "xp2", "vf", "dvf"))
    sz = dict(n_head=H, head_size=N, layer_id=lid)
    if threads:
        rx.set_num_threads(threads)
    try:
        if kind == "cm":
            got = {"out": rx.channelmix_forward(p, x, xp1)}
            dx, g, got["d_xprev_init"] = rx.channelmix_backward(p, x, dy, xp1)
        elif kind == "tm":
            out, vgot = rx.timemix_forward(p, x, xp1, vf, **sz)
            got = {"out": out}
            dx, g, got["d_xprev_init"], dvf_got = rx.timemix_backward(p, x, dy, xp1, vf, dvf,
                                                                      **sz)
        else:
            out, vgot = rx.block_forward(p, x, xp1, xp2, vf, **sz)
            got = {"out": out}
            dx, g, got["d_tm_xprev"], got["d_cm_xprev"], dvf_got = rx.block_backward(
                p, x, dy, xp1, xp2, vf, dvf, **sz)
    finally:
        if threads:
            rx.set_num_threads(0)
    got["dx"] = dx
    if kind != "cm":
        if lid == 0:
            assert dvf_got is None
            got["v_first"] = vgot
        else:
            assert vgot is vf
            got["d_v_first"] = dvf_got
    assert list(g) == list(p)
    got.update({"grad " + k: v for k, v in g.items()})
    return got


@functools.lru_cache(maxsize=1)
def _data_and_reference(case):
    p, a = case_data(case)
    return p, a, reference(case, p, a)


def tol(key):
    return FWD_TOL if key in ("out", "v_first") else GRAD_TOL


def check_case(case, threads=None):
    """Every tensor of the C kernels within tolerance of the reference;
    returns the C results."""
    p, a, ref = _data_and_reference(case)
    got = run_c(case, p, a, threads)
    assert set(got) == set(ref)
    for k in ref:
        assert got[k].dtype == np.float32, k
        assert_rel(f"rwkv {case[0]} {k}", got[k], ref[k], tol(k))
    return got


def sensitivity(case, trials=2):
    """Largest relative change of any reference tensor when every input is
    perturbed by a relative 2^-24 (half an fp32 ulp): what any fp32
    implementation must be allowed, whatever its care."""
    p, a = case_data(case)
    ref = reference(case, p, a)
    rng = np.random.default_rng(1)

    def jig(v):
        return None if v is None else v * (1.0 + 2.0**-24 * rng.standard_normal(v.shape))

    worst = {}
    for _ in range(trials):
        pp = {k: jig(v.astype(np.float64)) for k, v in p.items()}
        aa = {k: v if k in ("dy", "dvf") or v is None else jig(v.astype(np.float64))
              for k, v in a.items()}
        for k, v in reference(case, pp, aa).items():
            worst[k] = max(worst.get(k, 0.0), rel_err(v, ref[k]))
    return worst


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_against_reference(case):
    check_case(case)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cases_well_conditioned(case):
    """The tolerances assume well-conditioned data: a case whose exact
    result moves by more than a tenth of the tolerance under half-ulp input
    noise would test the data, not the kernels. (At T = 1 the WKV7 output
    of a head is exactly v*(r.k); a head with r.k near 0 puts the group
    norm at var ~ eps, where 2^-24 input noise moves the grads by ~1e-4.)"""
    worst = sensitivity(case, trials=1)
    bad = {k: e for k, e in worst.items() if e > 0.1 * tol(k)}
    assert not bad, f"ill-conditioned case data: {bad}"


@pytest.mark.skipif(not rx.has_openmp(), reason="built without OpenMP")
def test_big_threaded():
    """Sizes where every OpenMP path runs threaded: 1 and 2 threads both
    match the reference and differ from each other only by summation order."""
    one, two = check_case(BIG, 1), check_case(BIG, 2)
    for k in one:
        scale = max(float(np.abs(one[k]).max()), 1e-30)
        np.testing.assert_allclose(two[k], one[k], rtol=0, atol=1e-6 * scale, err_msg=k)


@pytest.mark.skipif(not rx.has_openmp(), reason="built without OpenMP")
def test_split_head_threaded():
    one, two = check_case(SPLIT, 1), check_case(SPLIT, 2)
    for k in one:
        scale = max(float(np.abs(one[k]).max()), 1e-30)
        np.testing.assert_allclose(two[k], one[k], rtol=0, atol=1e-6 * scale, err_msg=k)


# ---------------------------------------------------------------------------
# bad inputs

H0, N0, C0, B0, T0 = 2, 4, 8, 1, 3


def _tm(lid=0):
    return make_params(np.random.default_rng(0), tm_param_shapes(C0, 3, 3, 3, 3, lid))


def _blk(lid=0):
    return make_params(np.random.default_rng(0), block_param_shapes(C0, 3, 3, 3, 3, 5, lid))


def _x():
    return np.zeros((B0, T0, C0), np.float32)


SZ = dict(n_head=H0, head_size=N0)


def test_defaults_run():
    out, vf = rx.timemix_forward(_tm(), _x(), **SZ, layer_id=0)
    assert out.shape == vf.shape == (B0, T0, C0)
    out, vf = rx.block_forward(_blk(), _x(), **SZ, layer_id=0)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("fn", ["timemix_forward", "block_forward"])
def test_missing_extra_misshaped_param(fn):
    p = _tm() if fn == "timemix_forward" else _blk()
    key = "k_a" if fn == "timemix_forward" else "tm.k_a"
    f = getattr(rx, fn)
    q = dict(p)
    del q[key]
    with pytest.raises(ValueError, match=key):
        f(q, _x(), **SZ, layer_id=0)
    q = dict(p, bogus=np.zeros(C0, np.float32))
    with pytest.raises(ValueError, match="bogus"):
        f(q, _x(), **SZ, layer_id=0)
    q = dict(p, **{key: np.zeros(C0 + 1, np.float32)})
    with pytest.raises(ValueError, match=key):
        f(q, _x(), **SZ, layer_id=0)
    q = dict(p, **{key: np.zeros(C0, np.float64)})
    with pytest.raises(TypeError, match=key):
        f(q, _x(), **SZ, layer_id=0)
    # v0/v1/v2 exist only at layer_id > 0
    vkey = key.replace("k_a", "v0")
    vf_arg = (None, _x()) if fn == "timemix_forward" else (None, None, _x())
    with pytest.raises(ValueError, match=vkey):
        f(p, _x(), *vf_arg, **SZ, layer_id=1)
    with pytest.raises(ValueError, match=vkey):
        f(_tm(1) if fn == "timemix_forward" else _blk(1), _x(), **SZ, layer_id=0)
    # a LoRA down matrix whose rows are not C
    q = dict(p, **{key.replace("k_a", "w1"): np.zeros((C0 + 1, 3), np.float32)})
    with pytest.raises(ValueError, match="w1"):
        f(q, _x(), **SZ, layer_id=0)
    # w2 disagreeing with the Dw that w1 implies
    q = dict(p, **{key.replace("k_a", "w2"): np.zeros((4, C0), np.float32)})
    with pytest.raises(ValueError, match="w2"):
        f(q, _x(), **SZ, layer_id=0)
    with pytest.raises(TypeError):
        f([("x_r", 1)], _x(), **SZ, layer_id=0)


def test_bad_arrays_and_sizes():
    p = _tm()
    with pytest.raises(TypeError, match="x"):
        rx.timemix_forward(p, _x().astype(np.float64), **SZ, layer_id=0)
    with pytest.raises(ValueError, match="x"):
        rx.timemix_forward(p, np.zeros((B0, T0, 2 * C0), np.float32)[:, :, ::2], **SZ,
                           layer_id=0)
    with pytest.raises(ValueError, match="x"):
        rx.timemix_forward(p, np.zeros((B0, 0, C0), np.float32), **SZ, layer_id=0)
    with pytest.raises(ValueError, match="n_head"):
        rx.timemix_forward(p, _x(), n_head=3, head_size=N0, layer_id=0)
    with pytest.raises(ValueError, match="head_size"):
        rx.timemix_forward(p, _x(), n_head=H0, head_size=0, layer_id=0)
    with pytest.raises(ValueError, match="x_prev_init"):
        rx.timemix_forward(p, _x(), np.zeros((B0 + 1, C0), np.float32), **SZ, layer_id=0)
    with pytest.raises(ValueError, match="layer_id"):
        rx.timemix_forward(p, _x(), **SZ, layer_id=-1)
    with pytest.raises(TypeError, match="layer_id"):
        rx.timemix_forward(p, _x(), **SZ, layer_id=1.0)
    with pytest.raises(TypeError, match="layer_id"):
        rx.timemix_forward(p, _x(), **SZ, layer_id=True)
    # v_first: produced at layer 0, required at layer > 0
    with pytest.raises(ValueError, match="v_first"):
        rx.timemix_forward(p, _x(), None, _x(), **SZ, layer_id=0)
    with pytest.raises(ValueError, match="v_first"):
        rx.timemix_forward(_tm(1), _x(), **SZ, layer_id=1)
    with pytest.raises(ValueError, match="v_first"):
        rx.timemix_forward(_tm(1), _x(), None, np.zeros((B0, T0 + 1, C0), np.float32), **SZ,
                           layer_id=1)
    with pytest.raises(ValueError, match="d_v_first"):
        rx.timemix_backward(_tm(1), _x(), _x(), None, _x(), _x(), **SZ, layer_id=1)
    with pytest.raises(ValueError, match="d_v_first"):
        rx.timemix_backward(p, _x(), _x(), None, None, np.zeros((B0, T0, 1), np.float32),
                            **SZ, layer_id=0)
    with pytest.raises(ValueError, match="dy"):
        rx.timemix_backward(p, _x(), np.zeros((B0, T0, C0 + 1), np.float32), **SZ, layer_id=0)
    with pytest.raises(TypeError, match="dy"):
        rx.block_backward(_blk(), _x(), [0.0], **SZ, layer_id=0)
    with pytest.raises(ValueError, match="cm_xprev_init"):
        rx.block_forward(_blk(), _x(), None, np.zeros((B0, C0 - 1), np.float32), **SZ,
                         layer_id=0)
    with pytest.raises(TypeError):
        rx.timemix_forward(p, _x(), n_head=H0, layer_id=0)  # head_size is required


def test_channelmix_bad_inputs():
    p = {"ffn_x_k": np.zeros(C0, np.float32), "ffn_key_w": np.zeros((C0, 5), np.float32),
         "ffn_value_w": np.zeros((5, C0), np.float32)}
    assert rx.channelmix_forward(p, _x()).shape == (B0, T0, C0)
    with pytest.raises(ValueError, match="ffn_value_w"):
        rx.channelmix_forward(dict(p, ffn_value_w=np.zeros((4, C0), np.float32)), _x())
    with pytest.raises(ValueError, match="ffn_key_w"):
        rx.channelmix_forward(dict(p, ffn_key_w=np.zeros((C0 + 1, 5), np.float32)), _x())
    with pytest.raises(ValueError, match="ffn_x_k"):
        rx.channelmix_forward({k: v for k, v in p.items() if k != "ffn_x_k"}, _x())
    with pytest.raises(ValueError, match="extra_thing"):
        rx.channelmix_forward(dict(p, extra_thing=p["ffn_x_k"]), _x())
    with pytest.raises(TypeError, match="dy"):
        rx.channelmix_backward(p, _x(), _x().astype(np.float16))


def test_inputs_not_modified():
    p, x = _blk(2), np.random.default_rng(1).standard_normal((B0, T0, C0)).astype(np.float32)
    vf = x * 0.5
    keep = {k: v.copy() for k, v in p.items()}
    x0, vf0 = x.copy(), vf.copy()
    rx.block_backward(p, x, x, None, None, vf, **SZ, layer_id=2)
    rx.block_forward(p, x, None, None, vf, **SZ, layer_id=2)
    assert all(np.array_equal(keep[k], p[k]) for k in p)
    assert np.array_equal(x, x0) and np.array_equal(vf, vf0)

