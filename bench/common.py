"""Shared pieces of the rwkvx_c benchmarks.

- numpy_sgemm_gflops: NumPy's own float32 matmul rate, measured in-process
  (the denominator of model-FLOP utilisation).
- peak_rss_mib: peak resident set of this process.
- model_flops_per_token: docs/training.md §Presets model FLOPs per trained token.
- clean_blas_env: re-executes a benchmark without OPENBLAS_CORETYPE /
  OPENBLAS_L2_SIZE, which some machines set for old OpenBLAS builds and which
  slow a current NumPy. Benchmarks only: tests and CI never touch them.
"""
import functools
import glob
import importlib.util
import os
import resource
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# An in-place build (python setup.py build_ext --inplace) wins over an installed
# rwkvx_c; a source tree without a built extension does not shadow it.
if glob.glob(os.path.join(ROOT, "rwkvx_c", "_core*.so")) and ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _load_presets():
    """rwkvx_c/model/presets.py loaded by path: importing the rwkvx_c package here
    would pin this tree's build before bench_ab.py imports another one."""
    path = os.path.join(ROOT, "rwkvx_c", "model", "presets.py")
    spec = importlib.util.spec_from_file_location("rwkvx_c_presets", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PRESETS


# docs/training.md §Presets reference configurations (rx_pt_config field names)
# and their T, the preset's sequence length: the trainer's models without ln0,
# as the benchmarks have always timed them ("default" is tiny again).
PRESETS = {name: dict({k: v for k, v in p["model"].items() if k != "ln0"}, T=p["seq_len"])
           for name, p in _load_presets().items() if name != "default"}

_BLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def clean_blas_env():
    """Re-exec this script without the OpenBLAS core overrides (both together).

    Call before importing numpy-heavy work; a no-op when neither is set.
    """
    if any(v in os.environ for v in _BLAS_VARS):
        env = {k: v for k, v in os.environ.items() if k not in _BLAS_VARS}
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable] + sys.argv, env)


def blas_info():
    """One line naming NumPy's BLAS, its kernel and threads (threadpoolctl when present)."""
    try:
        import threadpoolctl
    except ImportError:
        return "numpy %s (install threadpoolctl to see the BLAS kernel)" % np.__version__
    parts = []
    for d in threadpoolctl.threadpool_info():
        if d.get("user_api") == "blas":
            parts.append("%s %s kernel=%s threads=%s" % (
                d.get("internal_api"), d.get("version"), d.get("architecture"),
                d.get("num_threads")))
    return "numpy %s: %s" % (np.__version__, "; ".join(parts) or "no BLAS found")


class blas_threads:
    """Context manager limiting NumPy's BLAS to n threads (needs threadpoolctl;
    without it the BLAS keeps its default and `limited` is False)."""

    def __init__(self, n):
        self.n, self.ctx, self.limited = n, None, False

    def __enter__(self):
        try:
            import threadpoolctl
        except ImportError:
            return self
        self.ctx = threadpoolctl.threadpool_limits(limits=self.n, user_api="blas")
        self.ctx.__enter__()
        self.limited = True
        return self

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def best_time(fn, repeat=5, min_time=0.2, clock=time.perf_counter):
    """Best time of one call of fn over `repeat` rounds, each round running
    fn enough times to take at least min_time seconds. clock=time.thread_time
    counts only this thread's CPU time: on a shared machine that keeps other
    processes' time slices out of single-threaded measurements."""
    fn()
    t0 = clock()
    fn()
    once = max(clock() - t0, 1e-7)
    inner = max(1, int(min_time / once))
    best = float("inf")
    for _ in range(repeat):
        t0 = clock()
        for _ in range(inner):
            fn()
        best = min(best, (clock() - t0) / inner)
    return best


def numpy_sgemm_gflops(threads=None, sizes=((1024, 1024, 1024), (2048, 2048, 1024),
                                            (1536, 1536, 1536)), repeat=5):
    """NumPy's float32 matmul rate in GFLOP/s: the best over a few large
    square-ish shapes, each the best of `repeat` rounds. threads: limit the
    BLAS to that many threads (threadpoolctl), None for its default."""
    rng = np.random.default_rng(0)
    best = 0.0
    with blas_threads(threads) if threads else _nullctx():
        for M, N, K in sizes:
            a = rng.standard_normal((M, K), dtype=np.float32)
            b = rng.standard_normal((K, N), dtype=np.float32)
            c = np.empty((M, N), dtype=np.float32)
            t = best_time(functools.partial(np.matmul, a, b, out=c), repeat=repeat)
            best = max(best, 2.0 * M * N * K / t / 1e9)
    return best


def bf16_matmul_gflops(threads, size=2048, repeat=5):
    """The bf16 matmul rate in GFLOP/s that bf16 MFU is counted against, and
    where it comes from: PyTorch's bf16 matmul (oneDNN; AMX where the CPU has
    it) on a size^3 product at `threads` threads, else rwkvx_c's own bf16
    GEMM when torch is missing."""
    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    try:
        import torch
    except ImportError:
        import rwkvx_c as rx
        from rwkvx_c import _core
        rx.set_num_threads(threads)
        c = np.empty_like(a)
        t = best_time(lambda: _core._bgemm(a, a, out=c), repeat=repeat)
        return 2.0 * size ** 3 / t / 1e9, "rwkvx_c " + rx.gemm_kernel("bf16")
    torch.set_num_threads(threads)
    x = torch.from_numpy(a).bfloat16()
    t = best_time(lambda: torch.matmul(x, x), repeat=repeat)
    return 2.0 * size ** 3 / t / 1e9, "torch %s bf16 matmul" % torch.__version__


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def peak_rss_mib():
    """Peak resident set size of this process in MiB (ru_maxrss: KiB on Linux,
    bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / (1024.0 * 1024.0) if sys.platform == "darwin" else r / 1024.0


def attended_keys(T, chunk_size, top_k):
    """Total attended keys over the T queries of one sequence (docs/maths.md §Blocks):
    the causal part of the query's own chunk plus every selected earlier chunk
    (all of them when top_k <= 0 or top_k >= the number of earlier chunks)."""
    total = 0
    for t in range(T):
        ct = t // chunk_size
        sel = ct if top_k <= 0 or top_k >= ct else top_k
        total += sel * chunk_size + (t - ct * chunk_size + 1)
    return total


def model_macs_per_token(cfg, T=None):
    """Forward multiply-adds per token (docs/training.md §Presets): projections, LoRAs,
    channel-mix, 4*C*N for the WKV7 state, 2*C per attended key, the head."""
    T = T if T is not None else cfg["T"]
    C, N = cfg["n_embd"], cfg["head_size"]
    ffn, vocab = cfg["ffn_dim"], cfg["vocab_size"]
    n_rwkv, n_attn = cfg["n_rwkv_layer"], cfg["n_attn_layer"]
    proj = 4 * C * C
    cm = 2 * C * ffn
    lora = 2 * C * (cfg["Dw"] + cfg["Da"] + cfg["Dg"])
    lora_v = 2 * C * cfg["Dv"]          # layer_id > 0 only
    wkv = 4 * C * N
    rwkv = n_rwkv * (proj + lora + cm + wkv) + (n_rwkv - 1) * lora_v
    keys = attended_keys(T, cfg["chunk_size"], cfg["moba_top_k"]) / T
    attn = n_attn * (proj + cm + 2 * C * keys)
    return rwkv + attn + C * vocab


def model_flops_per_token(cfg, T=None):
    """Model FLOPs per trained token: 2 x 3 x the forward multiply-adds
    (forward plus a backward of twice its cost)."""
    return 6.0 * model_macs_per_token(cfg, T)
