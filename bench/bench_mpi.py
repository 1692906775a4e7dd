"""Data-parallel training over MPI: measured scaling here, modelled scaling on a cluster.

    python3 bench/bench_mpi.py [--preset tiny] [--batch 8] [--seq-len 256] [--steps 10]
                               [--rounds 2] [--node-cores 64] [--measure-rate]

Part 1 (measured): the trainer's real step (Trainer.step: sampler, forward,
backward, gradient allreduce, AdamW) at 1 rank x N threads and at N ranks x
1 thread (N = the cores here), in alternating rounds so both see the same
machine load; each side's best round is reported. For the MPI side each
step's allreduce is split into the wait for the slowest rank (a barrier) and
the reduction itself. It also times a bare Allreduce of the S and M gradient
arenas between the ranks of this machine.

Part 2 (model): step time for P = 2..64 nodes of `--node-cores` cores each,
for the S and M presets at T=512, over 10 and 100 Gbit/s links. Compute per
step = B*T / (P * node tokens/s), the node rate being a per-core rate times
the node's cores (linear within a node: optimistic, so the communication
share it gives is an upper bound). The per-core rates default to the README's
uncontended Zen 4 figures (T=512, B=1, 2 threads: S 5,100 and M 1,029
tokens/s); --measure-rate measures them here instead, which on a loaded
machine understates them. Communication = ring
allreduce of the float32 gradient arena, 2(P-1)/P * 4 * n_params / bandwidth
+ 2(P-1) * latency, plus the 4 small collectives per step (loss, learning
rate, stop and evaluate decisions: each ceil(log2 P) * latency). It prints
the smallest global batch that keeps communication under 10% of a step.

Needs mpi4py and mpiexec (pip install "rwkvx_c[mpi]"). As root, Open MPI
also needs OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

import common  # noqa: F401 -- puts an in-place build first on sys.path
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CORE_RATE = {"S": 5100 / 2, "M": 1029 / 2}  # tokens/s per core, README benchmark table
LINKS = {"10 Gbit/s": (10e9 / 8, 20e-6), "100 Gbit/s": (100e9 / 8, 3e-6)}  # bytes/s, latency
SMALL_COLLECTIVES = 4  # per step besides the gradients: loss, lr, done(), eval_due()


def worker(a):
    """One side of the measurement (run by main, under mpiexec for N ranks)."""
    from rwkvx_c import get_num_threads
    from rwkvx_c._core import RxPtModel
    from rwkvx_c.train import PRESETS, Trainer, TrainOptions
    tr = Trainer(TrainOptions(preset=a.preset, steps=10 ** 6, batch=a.batch, seq_len=a.seq_len,
                              threads=a.threads, seed=1))
    g = tr.group
    waits, reds = [], []
    if g.size > 1:
        reduce = g.average_grads

        def timed(grads, loss):
            t0 = time.perf_counter()
            g.comm.Barrier()
            t1 = time.perf_counter()
            out = reduce(grads, loss)
            waits.append(t1 - t0)
            reds.append(time.perf_counter() - t1)
            return out
        g.average_grads = timed
    steps = []
    for _ in range(a.steps):
        t = time.perf_counter()
        tr.step()
        steps.append(time.perf_counter() - t)
    k = min(2, a.steps - 1)  # the first steps allocate and warm the caches
    row = {"ranks": g.size, "threads": get_num_threads(), "step_s": float(np.median(steps[k:])),
           "tokens_per_s": a.batch * a.seq_len / float(np.median(steps[k:]))}
    if g.size > 1:
        row["wait_s"] = float(np.median(waits[k:]))
        row["allreduce_s"] = float(np.median(reds[k:]))
        row["grad_mib"] = tr.model.n_params * 4 / 2 ** 20
        for p in ("S", "M"):  # a bare in-place Allreduce of that preset's gradient arena
            n = RxPtModel(PRESETS[p]["model"], seed=0).n_params
            buf = np.ones(n, dtype=np.float32)
            ts = []
            for _ in range(3):
                g.comm.Barrier()
                t = time.perf_counter()
                g.comm.Allreduce(g._MPI.IN_PLACE, buf, op=g._MPI.SUM)
                ts.append(time.perf_counter() - t)
            row[f"allreduce_{p}_s"] = min(ts)
            row[f"allreduce_{p}_mib"] = n * 4 / 2 ** 20
        # the S preset's gradients: an allreduce of the order of this step's compute here
        n = RxPtModel(PRESETS["S"]["model"], seed=0).n_params
        row.update(overlap_probe(tr, g, np.ones(n, dtype=np.float32)))
    if g.is_root:
        print("ROW " + json.dumps(row), flush=True)


def overlap_probe(tr, g, buf):
    """Does a non-blocking Iallreduce progress while the C backward runs?
    Starts an Iallreduce of buf, runs a forward+backward, then Waits; the
    time from the last rank's end of compute to the end of the Wait (one
    machine: perf_counter is the same clock in every process) is what the
    reduction still needed. About the bare Allreduce's time: it made no
    progress in the background; about 0: it was hidden. Best of 3."""
    MPI = g._MPI
    x, y = tr.sampler.next()
    lo, hi = tr._rows
    x, y = x[lo:hi], y[lo:hi]
    bare, left = [], []
    for _ in range(3):
        g.comm.Barrier()
        t = time.perf_counter()
        g.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        bare.append(time.perf_counter() - t)
        g.comm.Barrier()
        req = g.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        tr.model.forward(x, return_logits=False)
        tr.model.backward(y)
        computed = time.perf_counter()
        req.Wait()
        done = time.perf_counter()
        last = g.comm.allreduce(computed, op=MPI.MAX)
        left.append(g.comm.allreduce(done, op=MPI.MAX) - last)
    return {"probe_bare_s": min(bare), "probe_left_s": min(left)}


def _run(cmd, env):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if r.returncode:
        sys.exit(f"bench_mpi: {' '.join(cmd[:4])} ... failed:\n{r.stderr[-2000:]}")
    return next(json.loads(line[4:]) for line in r.stdout.splitlines() if line.startswith("ROW "))


def measure(a):
    n = os.cpu_count() or 1
    exe = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    exe = exe if os.access(exe, os.X_OK) else shutil.which("mpiexec")
    if exe is None:
        sys.exit('bench_mpi: mpiexec not found (pip install "rwkvx_c[mpi]")')
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    me = [os.path.abspath(__file__), "--worker", "--preset", a.preset, "--batch", str(a.batch),
          "--seq-len", str(a.seq_len), "--steps", str(a.steps)]
    one = [sys.executable] + me + ["--threads", str(n)]
    many = [exe, "-n", str(n), "--bind-to", "core", sys.executable] + me
    best = {}
    for r in range(a.rounds):
        for name, cmd in (("1 rank", one), (f"{n} ranks", many)):
            row = _run(cmd, env)
            print(f"  round {r + 1} {name:8s}: {row['tokens_per_s']:8.0f} tok/s", flush=True)
            if name not in best or row["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = row
    r1, rn = best["1 rank"], best[f"{n} ranks"]
    print(f"\npreset {a.preset}, global batch {a.batch} x T={a.seq_len}, best of {a.rounds} "
          f"rounds (median step of {a.steps - 2} after 2 warm-up steps)")
    print("| layout | tokens/s | step ms | allreduce ms (share) | wait for slowest ms |")
    print("|---|---|---|---|---|")
    print(f"| 1 rank x {r1['threads']} threads | {r1['tokens_per_s']:.0f} | "
          f"{1e3 * r1['step_s']:.1f} | - | - |")
    print(f"| {rn['ranks']} ranks x {rn['threads']} thread | {rn['tokens_per_s']:.0f} | "
          f"{1e3 * rn['step_s']:.1f} | {1e3 * rn['allreduce_s']:.2f} "
          f"({100 * rn['allreduce_s'] / rn['step_s']:.1f}%) | {1e3 * rn['wait_s']:.2f} |")
    print(f"\n{rn['ranks']} ranks / 1 rank: {rn['tokens_per_s'] / r1['tokens_per_s']:.3f}x "
          f"(1.0 = the same cores used as well by ranks as by threads)")
    print(f"overlap probe: an Iallreduce of the S gradients started before this step's "
          f"forward+backward still needed {1e3 * rn['probe_left_s']:.1f} ms after the last "
          f"rank's compute ended; a bare Allreduce takes {1e3 * rn['probe_bare_s']:.1f} ms "
          f"(equal: no progress in the background; 0: fully hidden)")
    for p in ("S", "M"):
        mib, s = rn[f"allreduce_{p}_mib"], rn[f"allreduce_{p}_s"]
        print(f"bare Allreduce of the {p} gradients ({mib:.1f} MiB) between {rn['ranks']} ranks "
              f"here: {1e3 * s:.2f} ms ({mib / 1024 / s:.2f} GiB/s)")


def model(a):
    from rwkvx_c import get_num_threads
    from rwkvx_c._core import RxPtModel
    from rwkvx_c.train import PRESETS
    T = 512
    how = (f"measured here (B=1, {get_num_threads()} threads, best of 3 steps)"
           if a.measure_rate else "from the README's benchmark table")
    print(f"\nModel: nodes of {a.node_cores} cores, T={T}; per-core rate {how}")
    for preset in ("S", "M"):
        m = RxPtModel(PRESETS[preset]["model"], seed=0)
        rate = CORE_RATE[preset]
        if a.measure_rate:
            x = np.random.default_rng(0).integers(0, 256, size=(1, T), dtype=np.int32)
            best = math.inf
            for _ in range(3):
                t = time.perf_counter()
                m.forward(x, return_logits=False)
                m.backward(x)
                best = min(best, time.perf_counter() - t)
            rate = T / best / get_num_threads()
        node_tps = rate * a.node_cores
        grad = 4 * m.n_params
        print(f"\n{preset}: {m.n_params / 1e6:.1f}M params "
              f"({grad / 2 ** 20:.0f} MiB of gradients), "
              f"{node_tps:,.0f} tokens/s per node")
        print("| link | P | allreduce ms | step ms at B=8/node | comm share | "
              "global batch for < 10% comm |")
        print("|---|---|---|---|---|---|")
        for link, (bw, lat) in LINKS.items():
            for P in (2, 4, 8, 16, 32, 64):
                comm = 2 * (P - 1) / P * grad / bw + 2 * (P - 1) * lat \
                    + SMALL_COLLECTIVES * math.ceil(math.log2(P)) * lat
                compute = 8 * T / node_tps
                # compute >= 9 * comm  <=>  comm <= 10% of compute + comm
                b_node = math.ceil(9 * comm * node_tps / T)
                print(f"| {link} | {P} | {1e3 * comm:.1f} | {1e3 * (compute + comm):.0f} | "
                      f"{100 * comm / (compute + comm):.0f}% | {P * b_node} ({b_node}/node) |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--node-cores", type=int, default=64)
    ap.add_argument("--model-only", action="store_true", help="skip the measurement here")
    ap.add_argument("--measure-rate", action="store_true", help="measure the per-core "
                    "S and M rates of the model here instead of the README's")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    if not a.model_only:
        measure(a)
    model(a)


if __name__ == "__main__":
    main()
