"""Fine-tune cost on a 0.1B-shaped model (C 768, 12 RWKV blocks, head size 64,
the World vocabulary's 65536 ids): tokens/s of one training step (forward,
backward, grad norm, AdamW) and peak RSS, --tune full vs state vs lora
(r 32 on the default targets).

    python bench/bench_finetune.py                 # every mode, interleaved
    python bench/bench_finetune.py --mode lora     # one mode, in this process
    python bench/bench_finetune.py --paired 6      # full/state/lora steps alternating

Each mode runs in its own process (peak RSS is a per-process high-water
mark), the three alternating --rounds times; on a shared machine compare the
ratios of runs next to each other, not the absolute rates."""
import argparse
import json
import os
import subprocess
import sys
import time

from common import peak_rss_mib

SHAPE = dict(n_embd=768, n_head=12, head_size=64, n_rwkv_layer=12, n_attn_layer=0,
             vocab_size=65536, Dw=64, Da=64, Dg=128, Dv=32, ffn_dim=3072, chunk_size=64,
             moba_top_k=0, ln0=1)


MODES = ("full", "state", "lora")


def one(mode, T, steps, threads, precision):
    import numpy as np

    import rwkvx_c as rx
    from rwkvx_c.train.finetune import make_optimizer
    from rwkvx_c.train.options import TrainOptions

    rx.set_num_threads(threads)
    # the C init (every tensor random, output_w too, so the states get a
    # grad): init_model's NumPy temporaries would set the peak RSS instead
    m = rx.RxPtModel(SHAPE, precision=precision)
    opt = make_optimizer(m, TrainOptions(tune=mode))
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps + 1):     # the first step allocates scratch: not timed
        x = rng.integers(0, SHAPE["vocab_size"], (1, T)).astype(np.int32)
        t = time.perf_counter()
        m.forward(x, return_logits=False)
        m.backward(np.roll(x, -1, axis=1))
        opt.step(1e-4)
        times.append(time.perf_counter() - t)
    best = min(times[1:])
    return {"mode": mode, "T": T, "threads": threads, "precision": precision,
            "tokens_per_s": T / best, "step_s": best, "peak_rss_mib": peak_rss_mib()}


def paired(T, pairs, threads, precision, steps):
    """full, state and lora steps alternating in this process (the
    machine's noise falls on all alike): per round, each mode's fastest of
    `steps` steps in a row, and the ratios of those.
    full and state share one model; lora has its own (the same weights),
    since adapters once on stay on."""
    import numpy as np

    import rwkvx_c as rx
    from rwkvx_c.train.finetune import make_optimizer
    from rwkvx_c.train.options import TrainOptions

    rx.set_num_threads(threads)
    # the C init (every tensor random, output_w too, so the states get a
    # grad): init_model's NumPy temporaries would set the peak RSS instead
    m = rx.RxPtModel(SHAPE, precision=precision)
    ml = rx.RxPtModel(SHAPE, precision=precision)
    # every optimiser made (and its moments touched) once, before timing
    opt = {k: make_optimizer(m, TrainOptions(tune=k)) for k in ("full", "state")}
    opt["lora"] = make_optimizer(ml, TrainOptions(tune="lora"))
    frozen = {"full": np.zeros((0, 2), np.int64),
              "state": np.array([[0, m.n_params]], np.int64)}
    rng = np.random.default_rng(0)
    ratios = {"state": [], "lora": []}
    for i in range(pairs + 1):   # round 0 allocates scratch: not counted
        dt = {}
        for mode in MODES[i % 3:] + MODES[:i % 3]:
            model = ml if mode == "lora" else m
            if mode != "lora":
                m.freeze_ranges(frozen[mode])
            best = float("inf")
            for _ in range(steps):
                x = rng.integers(0, SHAPE["vocab_size"], (1, T)).astype(np.int32)
                t = time.perf_counter()
                model.forward(x, return_logits=False)
                model.backward(np.roll(x, -1, axis=1))
                opt[mode].step(1e-6)
                best = min(best, time.perf_counter() - t)
            dt[mode] = best
        if i:
            row = {"round": i, **{f"{k}_s": v for k, v in dt.items()}}
            for k in ratios:
                ratios[k].append(dt["full"] / dt[k])
                row[f"{k}_over_full_tokens_per_s"] = ratios[k][-1]
            print(json.dumps(row), flush=True)
    for k, r in ratios.items():
        print(f"median {k}/full tokens/s over {pairs} rounds: {float(np.median(r)):.2f}x")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=list(MODES))
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3,
                    help="steps per mode (per round with --paired), the fastest counted")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--paired", type=int, default=0, metavar="PAIRS",
                    help="alternate full, state and lora steps in this process")
    a = ap.parse_args()
    if a.paired:
        paired(a.T, a.paired, a.threads, a.precision, a.steps)
        return
    if a.mode:
        print(json.dumps(one(a.mode, a.T, a.steps, a.threads, a.precision)))
        return
    rows = []
    for _ in range(a.rounds):
        for mode in MODES:
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--mode", mode,
                                "--T", str(a.T), "--steps", str(a.steps), "--threads",
                                str(a.threads), "--precision", a.precision],
                               capture_output=True, text=True, check=True)
            rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    for i in range(0, len(rows), 3):
        f, s, lo = rows[i], rows[i + 1], rows[i + 2]
        print(f"round {i // 3}: tokens/s state/full {s['tokens_per_s'] / f['tokens_per_s']:.2f}x"
              f", lora/full {lo['tokens_per_s'] / f['tokens_per_s']:.2f}x; peak RSS full "
              f"{f['peak_rss_mib']:.0f}, state {s['peak_rss_mib']:.0f}, lora "
              f"{lo['peak_rss_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
