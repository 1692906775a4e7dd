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
           *rx.cross_entropy_backward(logits, tok, ignore_index=int(tok[0])),
           np.float64(rx.grad_norm(rand(rng, 300_001)))]
    return out


# 64 threads on this machine's few cores: the partition a 64-core team gets
THREADS = (1, 2, 3, 7, 64)


@needs_omp
def test_results_independent_of_thread_count(restore_threads):
    """Every sum over rows (norm affine grads, the loss, the grad norm, the
    WKV7 column sums) runs over fixed blocks added in a fixed order: the
    same bits at any thread count."""
    runs = []
    for n in THREADS:
        rx.set_num_threads(n)
        runs.append(every_kernel(np.random.default_rng(5)))
    for n, run in zip(THREADS[1:], runs[1:]):
        for i, (one, got) in enumerate(zip(runs[0], run)):
            np.testing.assert_array_equal(got, one, err_msg=f"output {i} at {n} threads")


# B*T = 1030 rows: every threaded path runs (time-mix blocks need B*T*C >=
# 65536), and the last of its 16-row blocks (rx_block_rows) is ragged
MID = dict(n_embd=64, n_head=2, head_size=32, n_rwkv_layer=2, n_attn_layer=1, vocab_size=300,
           ffn_dim=128, Dw=8, Da=8, Dg=16, Dv=8, chunk_size=16, moba_top_k=2)


@needs_omp
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_step_independent_of_thread_count(precision, restore_threads):
    x = np.random.default_rng(0).integers(0, MID["vocab_size"], (2, 515)).astype(np.int32)
    runs = []
    for n in THREADS:
        rx.set_num_threads(n)
        m = rx.RxPtModel(MID, seed=0, precision=precision)
        logits = m.forward(x)
        loss = m.backward(x)
        g = np.array(m.grad_buffer)
        runs.append((logits, loss, g, rx.grad_norm(g)))
    for n, (logits, loss, g, norm) in zip(THREADS[1:], runs[1:]):
        assert loss == runs[0][1] and norm == runs[0][3], f"{n} threads"
        np.testing.assert_array_equal(logits, runs[0][0], err_msg=f"{n} threads")
        np.testing.assert_array_equal(g, runs[0][2], err_msg=f"{n} threads")


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


@needs_omp
def test_rows_past_the_block_cap(restore_threads):
    """B*T = 40,000 rows: past 1024 blocks the blocks grow (40 rows each)
    so their scratch stays bounded; the norm's affine grads and the
    channel-mix's lerp grad still agree bit for bit at every thread count,
    and the norm's with float64."""
    rng = np.random.default_rng(7)
    B, T, C, F = 2, 20_000, 8, 8
    x, dy = rand(rng, B, T, C) + 1.0, rand(rng, B, T, C)
    w, b = rand(rng, C), rand(rng, C)
    cm = {"ffn_x_k": rand(rng, C), "ffn_key_w": rand(rng, C, F, scale=0.5),
          "ffn_value_w": rand(rng, F, C, scale=0.5)}
    runs = []
    for n in (1, 2, 3):
        rx.set_num_threads(n)
        _, dw, db = rx.layernorm_backward(x, w, b, dy)
        dx, g, _ = rx.channelmix_backward(cm, x, dy)
        runs.append((dw, db, dx, *g.values()))
    for n, run in zip((2, 3), runs[1:]):
        for i, (one, got) in enumerate(zip(runs[0], run)):
            np.testing.assert_array_equal(got, one, err_msg=f"output {i} at {n} threads")
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    mu = x64.mean(-1, keepdims=True)
    xh = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    # float32 block sums: each term rounds once and is added in a chain of
    # at most 40 rows plus 1000 blocks, each add off by 2^-24 of the partial
    bound = (40 + 1000 + 2) * 2.0 ** -24
    for got, terms in ((runs[0][0], dy64 * xh), (runs[0][1], dy64)):
        want, mag = terms.sum((0, 1)), np.abs(terms).sum((0, 1))
        assert np.all(np.abs(got - want) <= bound * mag), np.abs(got - want) / mag
