"""Drawing each row's next token (csrc/sample.c through
rwkvx_c.generation.sampling.draw_rows; docs/training.md §Drawing a token)
against a NumPy float64 reference written from the docs: the same ids for
the same uniforms, over flat, peaked and tied rows, banned ids, every cut;
log-probabilities to the bound of their sums; each row alone (the same bits
in any batch); the AVX2 lanes and the portable build alike, bit for bit;
bad rows refused in one line."""
import os
import subprocess
import sys

import numpy as np
import pytest

from rwkvx_c import _core
from rwkvx_c.errors import SampleError
from rwkvx_c.generation.sampling import draw_rows, sample_rows, sample_token

EPS = np.finfo(np.float64).eps


def lane_sum(e):
    """e summed in eight interleaved lanes (lane i % 8, each in order), then
    ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))."""
    lanes = np.concatenate([e, np.zeros(-len(e) % 8)]).reshape(-1, 8)
    acc = np.zeros(8)
    for row in lanes:        # in order, lane by lane
        acc += row
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))


def ref_draw(x, u, T, P, K):
    """The id docs/training.md §Drawing a token defines, in float64."""
    x = x.astype(np.float64)
    if T <= 0:
        return int(np.argmax(x))
    e = np.exp((x - x.max()) / T)
    V = len(e)
    ids = np.arange(V)
    if P < 1.0 or 0 < K < V:
        order = np.argsort(-e, kind="stable")          # likelier first, ties by id
        total = lane_sum(e)
        if 0 < K < V:
            order = order[:K]
            total = np.cumsum(e[order])[-1]
        if P < 1.0:
            hit = np.flatnonzero(np.cumsum(e[order]) / total >= P)
            if len(hit):
                order = order[:hit[0] + 1]
        ids = np.sort(order)
    cum = np.cumsum(e[ids])
    j = int(np.searchsorted(cum / cum[-1], u, side="right"))
    return int(ids[min(j, len(ids) - 1)])


def ref_logprob(raw, i):
    z = raw.astype(np.float64)
    return z[i] - (np.log(np.exp(z - z.max()).sum()) + z.max())


def rows(V, R=8, seed=0):
    """R rows of V logits: flat, peaked, and tied across a cut."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((R, V)).astype(np.float32)
    x[1::3] *= 0.3          # flat: a top-p cut reaches most of the vocabulary
    x[2::3] *= 12.0         # peaked: a few ids hold the mass
    if R > 3:
        x[3, : V // 2] = x[3, 0]   # half the row tied
    return np.ascontiguousarray(x)


CUTS = [(0.0, 1.0, 0), (1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.5, 40), (1.0, 1.0, 3),
        (2.0, 0.95, 0), (1.0, 0.0, 0), (1.0, 1.0, 1), (0.5, 0.3, 7)]


@pytest.mark.parametrize("T,P,K", CUTS)
@pytest.mark.parametrize("V", [1, 7, 300, 5000])
def test_ids_are_the_references(V, T, P, K):
    x = rows(V)
    u = np.random.default_rng(V).random(len(x))
    u[0] = 0.0
    u[-1] = np.nextafter(1.0, 0.0)
    ids, lps = _core.draw_rows(x, x, u, T, P, K)
    assert ids.tolist() == [ref_draw(x[r], u[r], T, P, K) for r in range(len(x))]
    for r in range(len(x)):   # the lane sums' bound: V/8 + 8 roundings of the sum, log's ulp
        want = ref_logprob(x[r], ids[r])
        assert abs(lps[r] - want) <= (V / 8 + 8) * EPS + 4 * EPS * (1 + abs(want) + abs(x[r]).max())


def test_top_k_past_the_vocabulary_and_the_whole_vocabulary():
    x = rows(300)
    u = np.linspace(0.05, 0.95, len(x))
    for K in (299, 300, 301, 10 ** 6):
        ids, _ = _core.draw_rows(x, x, u, 0.8, 0.9, K)
        assert ids.tolist() == [ref_draw(x[r], u[r], 0.8, 0.9, K) for r in range(len(x))]


def test_a_full_vocabulary_row_with_a_flat_cut():
    V = 65536
    x = rows(V, R=4, seed=3)
    u = np.array([0.1, 0.5, 0.9, 0.999])
    for T, P, K in [(1.0, 0.9, 0), (0.7, 1.0, 0), (1.0, 0.99, 50)]:
        ids, _ = _core.draw_rows(x, x, u, T, P, K)
        assert ids.tolist() == [ref_draw(x[r], u[r], T, P, K) for r in range(4)]


def test_banned_ids_are_never_drawn_and_penalties_leave_the_logprob_raw():
    raw = rows(50, R=16, seed=5)
    x = raw.copy()
    x[:, ::2] = -np.inf           # every even id banned
    x[:, 1] -= 3.0                # a penalty
    for T in (0.0, 0.5, 1.0, 3.0):
        u = np.random.default_rng(int(T * 10)).random(16)
        u[0] = 0.0   # the walk starts on id 0, banned: weight 0, not drawn
        ids, lps = _core.draw_rows(x, raw, u, T, 1.0, 0)
        assert (ids % 2 == 1).all()
        assert ids.tolist() == [ref_draw(x[r], u[r], T, 1.0, 0) for r in range(16)]
        np.testing.assert_allclose(lps, [ref_logprob(raw[r], ids[r]) for r in range(16)],
                                   rtol=0, atol=1e-13)


def test_a_row_draws_alone():
    x = rows(3000, R=64, seed=7)
    u = np.random.default_rng(8).random(64)
    all_ids, all_lps = _core.draw_rows(x, x, u, 0.9, 0.8, 0)
    for r in (0, 13, 63):
        one, lp = _core.draw_rows(x[r:r + 1], x[r:r + 1], u[r:r + 1], 0.9, 0.8, 0)
        assert one[0] == all_ids[r] and lp[0].tobytes() == all_lps[r].tobytes()


def test_the_python_entries_draw_as_the_c_row():
    x = rows(300)
    rngs = [np.random.default_rng(r) for r in range(len(x))]
    u = np.array([np.random.default_rng(r).random() for r in range(len(x))])
    want, _ = _core.draw_rows(x, x, u, 1.0, 0.9, 0)
    assert sample_rows(x, rngs, 1.0, 0.9, 0).tolist() == want.tolist()
    assert [sample_token(x[r], np.random.default_rng(r), 1.0, 0.9) for r in range(len(x))] \
        == want.tolist()
    # greedy draws no uniform: the stream is left as it was
    g = np.random.default_rng(0)
    sample_token(x[0], g, 0.0)
    assert g.random() == np.random.default_rng(0).random()


PORTABLE = """
import hashlib, numpy as np
from rwkvx_c import _core
rng = np.random.default_rng(0)
scale = np.tile([0.3, 3.0, 12.0, 1.0], 4)[:, None]
x = (rng.standard_normal((16, 5003)) * scale).astype(np.float32)
u = rng.random(16)
h = hashlib.sha256()
for T, P, K in [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.5, 40), (0.0, 1.0, 0)]:
    ids, lps = _core.draw_rows(np.ascontiguousarray(x), np.ascontiguousarray(x), u, T, P, K)
    h.update(ids.tobytes() + lps.tobytes())
print(h.hexdigest())
"""


def test_the_avx2_lanes_and_the_portable_build_give_the_same_bits(tmp_path):
    def run(portable):
        # the package as imported here, run from a folder with no source tree
        env = dict(os.environ, RWKVX_SAMPLE_PORTABLE="1" if portable else "0",
                   PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(_core.__file__))))
        r = subprocess.run([sys.executable, "-c", PORTABLE], env=env, capture_output=True,
                           text=True, cwd=str(tmp_path))
        assert r.returncode == 0, r.stderr
        return r.stdout
    assert run(True) == run(False) != ""


def test_bad_rows_are_one_line():
    x = rows(20, R=3)
    bad = x.copy()
    bad[1, 4] = np.nan
    with pytest.raises(SampleError, match="not finite"):
        draw_rows(bad, bad, [np.random.default_rng(0)] * 3, 1.0)
    banned = np.full_like(x, -np.inf)
    with pytest.raises(SampleError, match="every token is banned"):
        draw_rows(banned, x, [np.random.default_rng(0)] * 3, 1.0)
    u = np.full(3, 0.5)
    for T, P, K, uu in [(np.nan, 1.0, 0, u), (-1.0, 1.0, 0, u), (1.0, 1.5, 0, u),
                        (1.0, 1.0, -2, u), (1.0, 1.0, 0, np.full(3, 1.0))]:
        with pytest.raises(ValueError):
            _core.draw_rows(x, x, uu, T, P, K)
    with pytest.raises(ValueError, match="must agree"):
        _core.draw_rows(x, x[:2], u, 1.0, 1.0, 0)


def test_exact_boundaries_of_the_cut_and_the_draw():
    x = np.zeros((1, 4), np.float32)   # p = 1/4 each, every sum exact
    for P, u, want in [(0.5, 0.7, 1),    # mass 0.5 reaches 0.5: two ids kept, not three
                       (0.5, 0.5, 1),    # a uniform on a step goes past it (searchsorted right)
                       (0.75, 0.7, 2), (1.0, 0.75, 3), (0.0, 0.99, 0)]:
        ids, _ = _core.draw_rows(x, x, np.array([u]), 1.0, P, 0)
        assert ids[0] == want == ref_draw(x[0], u, 1.0, P, 0)
