"""Thread control: set/get round trip, OMP_NUM_THREADS, and results that do
not depend on the thread count."""
import os
import subprocess
import sys

import numpy as np
import pytest

import rwkvx_c as rx

from checks import rand

needs_omp = pytest.mark.skipif(not rx.has_openmp(), reason="built without OpenMP")


@needs_omp
def test_set_get_round_trip(restore_threads):
    for n in (1, 3, 2):
        rx.set_num_threads(n)
        assert rx.get_num_threads() == n


def run_python(code, **env):
    """Runs code in a fresh interpreter that imports the same rwkvx_c as this one."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(rx.__file__)))
    full = dict(os.environ, PYTHONPATH=here, **env)
    r = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                       text=True, timeout=60, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


@needs_omp
def test_omp_num_threads_respected():
    code = ("import rwkvx_c as rx; print(rx.get_num_threads()); rx.set_num_threads(1); "
            "print(rx.get_num_threads()); rx.set_num_threads(0); print(rx.get_num_threads())")
    assert run_python(code, OMP_NUM_THREADS="3") == ["3", "1", "3"]


def every_kernel(rng):
    """Each kernel run once on sizes big enough to take its threaded path."""
    B, T, H, N, V = 2, 70, 4, 64, 600
    C = H * N
    sh = (B, T, H, N)
    kk = rng.standard_normal(sh)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    wkv = [rand(rng, *sh, scale=0.5), np.full(sh, 0.9, np.float32), rand(rng, *sh, scale=0.5),
           rand(rng, *sh), (-kk).astype(np.float32), (kk * 0.5).astype(np.float32)]
    dy = rand(rng, *sh)
    x = rand(rng, B, T, C) + 3.0
    w, b = rand(rng, C), rand(rng, C)
    emb, tok = rand(rng, V, C), rng.integers(0, V, T).astype(np.int32)
    x2, hw = rand(rng, T, C), rand(rng, C, V, scale=0.1)
    logits = rx.head_forward(x2, hw)
    out = [*rx.wkv7_forward(*wkv), *rx.wkv7_backward(*wkv, dy),
           rx.layernorm_forward(x, w, b), *rx.layernorm_backward(x, w, b, x),
           rx.embedding_forward(emb, tok), rx.embedding_backward(tok, x2, V),
           logits, *rx.head_backward(x2, hw, logits),
           np.float64(rx.cross_entropy_forward(logits, tok)),
           *rx.cross_entropy_backward(logits, tok, ignore_index=int(tok[0]))]
    return out


@needs_omp
def test_results_independent_of_thread_count(restore_threads):
    runs = []
    for n in (1, 2):
        rx.set_num_threads(n)
        runs.append(every_kernel(np.random.default_rng(5)))
    for one, two in zip(*runs):
        # only summation order may differ: fp32 rounding, nothing more
        np.testing.assert_allclose(two, one, rtol=0, atol=1e-6 * max(np.abs(one).max(), 1e-30))


def test_fewer_threads_granted_than_asked():
    # OMP_THREAD_LIMIT=1 makes OpenMP grant one thread where two are asked for:
    # work split by thread id would silently skip the second half.
    code = """
import numpy as np, rwkvx_c as rx
from rwkvx_c._core import _sgemm
rx.set_num_threads(2)
rng = np.random.default_rng(0)
a = rng.standard_normal((300, 200)).astype(np.float32)
b = rng.standard_normal((200, 400)).astype(np.float32)
ref = a.astype(np.float64) @ b
err = np.abs(_sgemm(a, b) - ref).max() / np.abs(ref).max()
assert err < 1e-5, err
g = rng.standard_normal(1 << 20).astype(np.float32)
n = rx.grad_norm(g)
assert abs(n - np.sqrt((g.astype(np.float64) ** 2).sum())) < 1e-6 * n, n
p, m, v = np.zeros_like(g), np.zeros_like(g), np.zeros_like(g)
rx.adamw_step(p, g, m, v, lr=1e-3, step=1)
assert np.all(p != 0) and np.all(m != 0)
print("ok")
"""
    assert run_python(code, OMP_THREAD_LIMIT="1")[-1] == "ok"
