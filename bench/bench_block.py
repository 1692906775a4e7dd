"""RWKV-7 block forward + backward throughput, tokens/s.

    python3 bench/bench_block.py     # config M block: C=512 H=8 N=64 T=512, 1 and 2 threads
    python3 bench/bench_block.py --threads 1 2 4 --repeat 5 --layer-id 0

A token is one (b, t) position: tokens/s = B*T / (seconds of one
block_forward plus one block_backward; the backward recomputes the forward
itself, as the whole-model backward does). The best of --repeat timed runs
is reported after one warm-up. GFLOP/s counts the docs/training.md §Presets model FLOPs of
the block (2*3 x the forward multiply-adds), not the recompute."""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: F401  (puts an in-place build of rwkvx_c first)

import rwkvx_c as rx


def block_params(C, Dw, Da, Dg, Dv, F, layer_id, rng):
    shapes = {"ln1_w": (C,), "ln1_b": (C,)}
    tm = rx.tm_shapes(dict(C=C, Dw=Dw, Da=Da, Dg=Dg, Dv=Dv), layer_id)
    shapes.update({"tm." + f: s for f, s in tm.items()})
    shapes.update({"ln2_w": (C,), "ln2_b": (C,), "cm.ffn_x_k": (C,), "cm.ffn_key_w": (C, F),
                   "cm.ffn_value_w": (F, C)})
    p = {}
    for k, s in shapes.items():
        u = rng.uniform(-1.0, 1.0, s) * (np.sqrt(3.0 / s[0]) if len(s) == 2 else 0.5)
        if k.endswith(("ln1_w", "ln2_w", "ln_x_w")):
            u += 1.0
        p[k] = u.astype(np.float32)
    return p


def model_flops_per_token(C, N, Dw, Da, Dg, Dv, F, layer_id):
    macs = 4 * C * C + 2 * C * (Dw + Da + Dg + (Dv if layer_id > 0 else 0)) + 2 * C * F
    return 2 * 3 * (macs + 4 * C * N)


def bench(a, threads):
    rng = np.random.default_rng(0)
    C = a.H * a.N
    p = block_params(C, a.Dw, a.Da, a.Dg, a.Dv, a.F, a.layer_id, rng)
    x = rng.standard_normal((a.B, a.T, C)).astype(np.float32)
    dy = rng.standard_normal((a.B, a.T, C)).astype(np.float32)
    vf = rng.standard_normal((a.B, a.T, C)).astype(np.float32) if a.layer_id > 0 else None
    sz = dict(n_head=a.H, head_size=a.N, layer_id=a.layer_id)
    rx.set_num_threads(threads)

    def step():
        t0 = time.perf_counter()
        rx.block_forward(p, x, None, None, vf, **sz)
        t1 = time.perf_counter()
        rx.block_backward(p, x, dy, None, None, vf, **sz)
        return t1 - t0, time.perf_counter() - t1
    step()
    best = min((step() for _ in range(a.repeat)), key=sum)
    rx.set_num_threads(0)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--N", type=int, default=64)
    ap.add_argument("--Dw", type=int, default=64)
    ap.add_argument("--Da", type=int, default=64)
    ap.add_argument("--Dg", type=int, default=128)
    ap.add_argument("--Dv", type=int, default=32)
    ap.add_argument("--F", type=int, default=2048, help="ffn_dim")
    ap.add_argument("--layer-id", type=int, default=1, help="0: no value residual LoRA")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    C = a.H * a.N
    flops = model_flops_per_token(C, a.N, a.Dw, a.Da, a.Dg, a.Dv, a.F, a.layer_id)
    print(f"RWKV-7 block forward+backward  B={a.B} T={a.T} C={C} H={a.H} N={a.N} "
          f"D={a.Dw},{a.Da},{a.Dg},{a.Dv} ffn={a.F} layer_id={a.layer_id}  "
          f"(OpenMP {'on' if rx.has_openmp() else 'off'}, gemm {rx.gemm_kernel()})")
    for n in a.threads:
        fwd, bwd = bench(a, n)
        tps = a.B * a.T / (fwd + bwd)
        print(f"threads={n}: {tps:8.0f} tokens/s  (fwd {fwd * 1e3:.1f} ms + bwd {bwd * 1e3:.1f} ms;"
              f" {tps * flops / 1e9:.1f} model GFLOP/s)")


if __name__ == "__main__":
    main()
