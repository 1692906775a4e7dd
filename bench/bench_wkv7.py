"""WKV7 forward + backward throughput, tokens/s.

    python3 bench/bench_wkv7.py                     # B=1 T=512 H=8 N=64, 1 and 2 threads
    python3 bench/bench_wkv7.py --threads 1 2 4 --repeat 5

A token is one (b, t) position: tokens/s = B*T / (seconds of one forward
plus one backward). The best of --repeat timed runs is reported, after one
warm-up run."""
import argparse
import time

import numpy as np

import rwkvx_c as rx


def inputs(B, T, H, N, seed=0):
    rng = np.random.default_rng(seed)
    sh = (B, T, H, N)
    kk = rng.standard_normal(sh)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    f = lambda x: np.ascontiguousarray(x, dtype=np.float32)
    return [f(rng.standard_normal(sh) * 0.5),
            f(np.exp(-0.6065306597126334 / (1.0 + np.exp(-rng.standard_normal(sh))))),
            f(rng.standard_normal(sh) * 0.5), f(rng.standard_normal(sh)),
            f(-kk), f(kk * rng.uniform(0, 1, sh))], f(rng.standard_normal(sh))


def bench(B, T, H, N, threads, repeat):
    args, dy = inputs(B, T, H, N)
    rx.set_num_threads(threads)

    def step():
        rx.wkv7_forward(*args)
        rx.wkv7_backward(*args, dy)
    step()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return B * T / best, best


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=512)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--N", type=int, default=64)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    print(f"WKV7 forward+backward  B={a.B} T={a.T} H={a.H} N={a.N}  "
          f"(OpenMP {'on' if rx.has_openmp() else 'off'})")
    for n in a.threads:
        tps, sec = bench(a.B, a.T, a.H, a.N, n, a.repeat)
        print(f"threads={n}: {tps:10.0f} tokens/s  ({sec * 1e3:.1f} ms per fwd+bwd)")


if __name__ == "__main__":
    main()
