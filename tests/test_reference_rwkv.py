"""The float64 references of the RWKV-7 time-mix and block
(tests/reference/rwkv.py) against central finite differences: every
parameter, the input, both carries and v_first (in and out)."""
import numpy as np
import pytest

from checks import GN_EPS, LN_EPS
from reference.autograd import Var, fd_grad
from reference.rwkv import block_param_shapes, rwkv_block, timemix, tm_param_shapes

B, T, H, N, F = 2, 3, 2, 3, 5
C = H * N
DIMS = (3, 4, 3, 5)   # Dw, Da, Dg, Dv


def _inputs(kind, lid, rng):
    shapes = (tm_param_shapes(C, *DIMS, lid) if kind == "tm"
              else block_param_shapes(C, *DIMS, F, lid))
    arrs = {}
    for k, s in shapes.items():
        u = rng.uniform(-1.0, 1.0, s)
        arrs[k] = u * np.sqrt(3.0 / s[0]) if len(s) == 2 else u
    arrs["@x"] = rng.standard_normal((B, T, C))
    arrs["@xp1"] = rng.standard_normal((B, C))
    if kind == "block":
        arrs["@xp2"] = rng.standard_normal((B, C))
    if lid > 0:
        arrs["@vf"] = rng.standard_normal((B, T, C))
    return arrs


def _loss(kind, lid, names, dy, dvf):
    """f(*arrays) -> sum(out*dy) (+ sum(v_first_out*dvf) at layer 0)."""
    def f(*arrs):
        a = {k: Var(v) for k, v in zip(names, arrs)}
        p = {k: v for k, v in a.items() if not k.startswith("@")}
        if kind == "tm":
            out, vout = timemix(p, a["@x"], a["@xp1"], a.get("@vf"), H, N, lid, GN_EPS)
        else:
            out, vout = rwkv_block(p, a["@x"], a["@xp1"], a["@xp2"], a.get("@vf"), H, N, lid,
                                       LN_EPS, GN_EPS)
        loss = (out * dy).sum()
        if lid == 0:
            loss = loss + (vout * dvf).sum()
        return loss, a
    return f


@pytest.mark.parametrize("kind,lid", [("tm", 0), ("tm", 3), ("block", 0), ("block", 1)])
def test_reference_grads_match_finite_differences(kind, lid):
    rng = np.random.default_rng(7 + lid)
    arrs = _inputs(kind, lid, rng)
    names = list(arrs)
    dy, dvf = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    f = _loss(kind, lid, names, dy, dvf)
    loss, a = f(*arrs.values())
    loss.backward()
    values = list(arrs.values())

    def scalar(*v):
        return float(f(*v)[0].value)

    for i, k in enumerate(names):
        g = a[k].grad
        scale = max(1.0, float(np.max(np.abs(g))))
        for _ in range(3):
            idx = tuple(int(rng.integers(0, s)) for s in g.shape)
            fd = fd_grad(scalar, values, i, idx)
            assert abs(fd - g[idx]) <= 1e-6 * scale, (k, idx, fd, g[idx])
