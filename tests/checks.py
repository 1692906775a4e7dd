"""Comparison helpers shared by the kernel tests.

assert_rel(label, got, ref, tol) checks max|got - ref| <= tol * max|ref| (the
tolerances of the brief: 1e-5 for forward outputs, 1e-4 for gradients) and
records the measured ratio under `label`; `pytest --rx-errors` prints the
worst ratio per label at the end of the run.

token_batch: a random batch of tokens and targets with an ignored one.
kernel_runs / kernel_fixture: which of a set of forced kernels (a
`_core._*_use_kernel` hook) this CPU runs, and a fixture forcing each in turn.
portable_run: a test file's selected tests again in a process with
RWKVX_BASE_PORTABLE=1 (the frozen base's portable kernels) or =avx2 (its
AVX2 kernels where the CPU has AVX-512).

full_config: a model config with every optional key (ln0, ln_eps, gn_eps)
resolved, which the float64 references take their settings from; LN_EPS,
GN_EPS: the defaults a standalone kernel runs with, for its reference."""
import os
import subprocess
import sys

import numpy as np
import pytest

from rwkvx_c.model.config import ModelConfig

full_config = ModelConfig.resolve
LN_EPS = ModelConfig.default("ln_eps")
GN_EPS = ModelConfig.default("gn_eps")

FWD_TOL = 1e-5
GRAD_TOL = 1e-4

worst = {}


def rel_err(got, ref):
    """max|got - ref| / max|ref| (0 when both are all zero)."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"shape {got.shape} != reference {ref.shape}"
    assert np.all(np.isfinite(got)), "non-finite values in the result"
    diff = np.max(np.abs(got - ref))
    scale = np.max(np.abs(ref))
    if scale == 0.0:
        return 0.0 if diff == 0.0 else np.inf
    return float(diff / scale)


def assert_rel(label, got, ref, tol):
    err = rel_err(got, ref)
    worst[label] = max(worst.get(label, 0.0), err)
    assert err <= tol, f"{label}: max|err| / max|ref| = {err:.3e} > {tol:.0e}"


def rand(rng, *shape, scale=1.0):
    """float32 normal draws (the kernels' input type)."""
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def token_batch(vocab, B, T, seed, ignore):
    """Random (tokens, targets) int32 (B, T) below vocab; every row's
    target 2 is ignore (the loss's ignore_index at work)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (B, T)).astype(np.int32)
    targets = rng.integers(0, vocab, (B, T)).astype(np.int32)
    targets[:, 2] = ignore
    return tokens, targets


def kernel_runs(use_kernel, name):
    """True when use_kernel(name) is accepted here (it raises ValueError for
    a kernel this CPU or OS cannot run); leaves the choice to the CPU."""
    try:
        use_kernel(name)
    except ValueError:
        return False
    use_kernel(None)
    return True


def kernel_fixture(use_kernel, names, what):
    """A fixture that forces each kernel of `names` in turn (one this CPU
    cannot run is skipped with the reason) and gives the CPU the choice back
    after the test."""
    @pytest.fixture(params=[pytest.param(k, marks=pytest.mark.skipif(
        not kernel_runs(use_kernel, k), reason=f"this CPU (or OS) cannot run the {k} {what}"))
        for k in names])
    def forced(request):
        use_kernel(request.param)
        yield request.param
        use_kernel(None)
    return forced


def small_and_packed(gemm, bound, a, b, ta, tb, c0, **blocks):
    """(op(a).op(b), c0 + op(a).op(b)) by gemm (_core._sgemm or _bgemm)
    with the small-M bound at `bound`, then with the small-M path off."""
    from rwkvx_c import _core
    got = []
    for m in (bound, 0):
        _core._sgemm_small_m(m)
        acc = c0.copy()
        got.append((gemm(a, b, ta, tb, **blocks), gemm(a, b, ta, tb, out=acc, beta=1.0, **blocks)))
    return got


def portable_run(test_file, select, level="1"):
    """Runs test_file's (a file of tests/) tests matching -k select in a
    process with RWKVX_BASE_PORTABLE=level: "1", the frozen base's packers
    and decoders without their AVX-512 and AVX2 forms (any x86-64 or other
    CPU); "avx2", without their AVX-512 forms (an AVX2 CPU's kernels, run on
    an AVX-512 one); asserts they pass. cwd tests/: not the source tree's
    rwkvx_c."""
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.join(here, test_file), "-k", select],
                       env=dict(os.environ, RWKVX_BASE_PORTABLE=level), capture_output=True,
                       text=True, timeout=600, cwd=here)
    assert r.returncode == 0, r.stdout[-2000:]
