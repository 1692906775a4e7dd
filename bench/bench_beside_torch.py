"""rwkvx_c's training step with and without PyTorch in the same process.

    python bench/bench_beside_torch.py [--preset S] [--seq-len 256] [--batch 1]
                                       [--threads 2] [--steps 8] [--rounds 4]
                                       [--env "NAME=VALUE ..." ...]

Three kinds of child process alternate for R rounds, each timing rwkvx_c's
forward+backward (median of --steps steps after a warm-up):

  alone    never imports torch;
  after    imports torch and runs a few torch matmuls before timing;
  between  also runs one torch matmul before every timed step (a program
           that mixes the two libraries, e.g. a torch evaluation or data
           transform between steps).

Each child also reports the OpenMP runtimes mapped into it (a second
runtime's idle workers spin on the cores the first one needs) and its
thread count. The medians over rounds of each kind's median step and their
ratios to `alone` are printed. --env gives one or more environments for
the children (each a quoted list of NAME=VALUE, "-" for the inherited
one), e.g. --env - "GOMP_SPINCOUNT=300000": every round runs every kind
in every environment, so waiting policies compare under the same load.
rwkvx_c bounds libgomp's spin at import when neither GOMP_SPINCOUNT nor
OMP_WAIT_POLICY is set (rwkvx_c/_omp.py); GOMP_SPINCOUNT=300000 restores
libgomp's own default.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402


def child(args):
    import numpy as np

    import rwkvx_c as rx
    rx.set_num_threads(args.threads)
    cfg = {k: v for k, v in common.PRESETS[args.preset].items() if k != "T"}
    m = rx.RxPtModel(cfg, seed=0)
    rng = np.random.default_rng(0)
    seqs = rng.integers(0, cfg["vocab_size"], size=(args.batch, args.seq_len + 1)).astype("int32")
    x, y = np.ascontiguousarray(seqs[:, :-1]), np.ascontiguousarray(seqs[:, 1:])

    def step():
        m.forward(x, return_logits=False)
        m.backward(y)

    between = None
    if args.child != "alone":
        import torch
        a = torch.randn(512, 512)
        for _ in range(5):
            (a @ a).sum()
        if args.child == "between":
            def between():
                (a @ a).sum()
    step()
    times = []
    for _ in range(args.steps):
        if between:
            between()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "openmp": rx.openmp_runtimes(),
            "threads": len(os.listdir("/proc/self/task"))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="S", choices=sorted(common.PRESETS))
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--env", nargs="+", default=["-"],
                    help='environments for the children: "NAME=VALUE ...", "-" for none')
    ap.add_argument("--child", choices=["alone", "after", "between"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    envs = {}
    for spec in args.env:
        env = dict(os.environ)
        if spec != "-":
            env.update(kv.split("=", 1) for kv in spec.split())
        envs[spec] = env
    kinds = ("alone", "after", "between")
    res = {(e, k): [] for e in envs for k in kinds}
    info = {}
    for _ in range(args.rounds):
        for spec, env in envs.items():
            for kind in kinds:
                cmd = [sys.executable, os.path.abspath(__file__), "--child", kind,
                       "--preset", args.preset, "--seq-len", str(args.seq_len),
                       "--batch", str(args.batch), "--threads", str(args.threads),
                       "--steps", str(args.steps)]
                out = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True,
                                                text=True).stdout.splitlines()[-1])
                res[(spec, kind)].append(out["median_s"])
                info[kind] = out
    print("preset %s, B=%d, T=%d, %d threads; median over %d rounds of each process's "
          "median step" % (args.preset, args.batch, args.seq_len, args.threads, args.rounds))
    for kind in kinds:
        print("%-8s threads %d, OpenMP: %s" % (kind, info[kind]["threads"],
                                                ", ".join(info[kind]["openmp"]) or "none"))
    base = statistics.median(res[(args.env[0], "alone")])
    for spec in envs:
        for kind in kinds:
            t = statistics.median(res[(spec, kind)])
            print("env %-28s %-8s %8.1f ms  x%.3f of the first env alone"
                  % (spec, kind, 1e3 * t, t / base))


if __name__ == "__main__":
    main()
