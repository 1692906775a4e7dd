"""Training-step benchmark of rwkvx_c beside the same model in PyTorch.

    python bench/bench.py --preset S|M [--seq-len T] [--batch B] [--threads N]
                          [--steps K] [--rounds R] [--no-torch] [--scaling]
                          [--precision fp32|bf16] [--json FILE]

Each implementation runs in its own process that imports only its own library
(so each peak RSS is its own). The processes alternate for R rounds and each
implementation reports its best round: on a shared or cloud machine the
speed drifts over tens of seconds, and alternating lets both sides sample
the same drift rather than one side catching a slow stretch. This parent
process measures NumPy's float32
sgemm rate at the same thread count, the denominator of the NumPy-relative
model-FLOP utilisation (MFU = model FLOP/s per docs/training.md §Presets /
NumPy sgemm FLOP/s), and one core's fp32 FMA and bf16 dot-product peaks
(bench_peak.py), whose product with the cores in use is the denominator of
MFU against the machine ("of peak"): NumPy's rate is only as good as the
BLAS kernel its environment lets it pick.

Each ratio between two implementations is that of their bests, followed by
the median and range of the per-round ratios (the two sides of a round ran
seconds apart). Reported per implementation: tokens/s of forward+backward and of a full
training step (forward+backward+AdamW, where an optimiser exists), MFU, peak
RSS, and a per-kernel time breakdown where the implementation can give one.
The PyTorch side runs only where torch is importable (bench/torch_model.py).
--scaling adds rwkvx_c at 1 thread to the alternating rounds and reports
its N-thread over 1-thread speed-up, both sides sampling the same drift.
--precision bf16 adds rwkvx_c with precision="bf16" and PyTorch under
torch.autocast("cpu", dtype=torch.bfloat16) (its WKV7 kept fp32) to the same
alternating rounds, beside the fp32 runs; their MFU counts against a measured
bf16 matmul rate (common.bf16_matmul_gflops) instead of NumPy's sgemm.
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
import bench_peak  # noqa: E402
import common  # noqa: E402


def _tokens(rng, B, T, vocab):
    return rng.integers(0, vocab, size=(B, T + 1)).astype("int32")


# ---------------------------------------------------------------------------
# child: rwkvx_c


def run_rx(args, cfg):
    import numpy as np

    import rwkvx_c as rx
    rx.set_num_threads(args.threads)
    bf16 = args.precision == "bf16"
    out = {"impl": "rwkvx_c" + (" bf16" if bf16 else ""),
           "gemm_kernel": rx.gemm_kernel(args.precision), "threads": rx.get_num_threads()}
    if not hasattr(rx, "RxPtModel"):
        out["error"] = "rwkvx_c.RxPtModel is not built yet"
        return out
    model_cfg = {k: v for k, v in cfg.items() if k != "T"}
    m = rx.RxPtModel(model_cfg, seed=0)
    if bf16:
        m.precision = "bf16"
    rng = np.random.default_rng(0)
    B, T = args.batch, args.seq_len
    seqs = _tokens(rng, B, T, cfg["vocab_size"])

    def fwd_bwd():
        loss = 0.0
        for b in range(B):
            m.forward(np.ascontiguousarray(seqs[b, :T]), return_logits=False)
            loss += m.backward(np.ascontiguousarray(seqs[b, 1:]))
        return loss / B

    step = None
    if hasattr(rx, "adamw_step"):
        opt_m = np.zeros_like(m.param_buffer)
        opt_v = np.zeros_like(m.param_buffer)
        count = [0]

        def step():
            fwd_bwd()
            count[0] += 1
            rx.adamw_step(m.param_buffer, m.grad_buffer, opt_m, opt_v, lr=1e-4, step=count[0])

    (step or fwd_bwd)()  # warm-up: first-touch of activations, buffers, optimiser state
    times, stimes = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        fwd_bwd()
        times.append(time.perf_counter() - t0)
        if step:
            t0 = time.perf_counter()
            step()
            stimes.append(time.perf_counter() - t0)
    out["fwd_bwd_s"] = min(times)
    out["fwd_bwd_tok_s"] = B * T / min(times)
    if stimes:
        out["step_tok_s"] = B * T / min(stimes)
    out["peak_rss_mib"] = common.peak_rss_mib()
    if args.breakdown:
        rx.profile_enable(True)
        t0 = time.perf_counter()
        fwd_bwd()
        tot = time.perf_counter() - t0
        prof = rx.profile()
        rx.profile_enable(False)
        out["breakdown"] = [(k, v * 1e3, v / tot) for k, v in
                            sorted(prof.items(), key=lambda kv: -kv[1])]
    return out


# ---------------------------------------------------------------------------
# child: PyTorch


def run_torch(args, cfg):
    import torch
    import torch_model as tm
    torch.set_num_threads(args.threads)
    bf16 = args.precision == "bf16"
    out = {"impl": "torch %s" % torch.__version__ + (" bf16" if bf16 else ""),
           "threads": torch.get_num_threads()}
    model_cfg = {k: v for k, v in cfg.items() if k != "T"}
    m = tm.RwkvXTorch(model_cfg, seed=0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.0, foreach=True)
    g = torch.Generator().manual_seed(0)
    B, T = args.batch, args.seq_len
    seqs = torch.randint(0, cfg["vocab_size"], (B, T + 1), generator=g)
    x, y = seqs[:, :T], seqs[:, 1:]

    def fwd_bwd():
        m.zero_grad(set_to_none=False)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = m.loss(x, y)
        loss.backward()
        return float(loss)

    def step():
        fwd_bwd()
        opt.step()

    step()  # warm-up (also creates the optimiser state)
    tfb, tst = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        fwd_bwd()
        tfb.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        step()
        tst.append(time.perf_counter() - t0)
    out["fwd_bwd_s"] = min(tfb)
    out["fwd_bwd_tok_s"] = B * T / min(tfb)
    out["step_tok_s"] = B * T / min(tst)
    out["peak_rss_mib"] = common.peak_rss_mib()
    if args.breakdown:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fwd_bwd()
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
        tot = sum(e.self_cpu_time_total for e in prof.key_averages())
        out["breakdown"] = [(e.key, e.self_cpu_time_total / 1e3, e.self_cpu_time_total / tot)
                            for e in rows]
    return out


# ---------------------------------------------------------------------------
# parent


def child(impl, args, threads, precision="fp32"):
    """Run one implementation in a fresh process; its JSON result."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, "--preset", args.preset,
           "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--threads",
           str(threads), "--steps", str(args.steps), "--precision", precision] + \
        (["--breakdown"] if args.breakdown else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"impl": impl, "error": (r.stderr or r.stdout).strip().splitlines()[-1:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="S", choices=sorted(common.PRESETS))
    ap.add_argument("--seq-len", type=int, default=None, help="T (default: the preset's)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (best is reported)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="alternating rounds of the implementations (best is reported)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch side")
    ap.add_argument("--scaling", action="store_true",
                    help="also time rwkvx_c at 1 thread in the same rounds; report the speed-up")
    ap.add_argument("--breakdown", action="store_true",
                    help="per-kernel time breakdown of one more step (rx.profile; torch profiler)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                    help="bf16: also run both sides in bf16 (rwkvx_c precision='bf16', "
                    "torch autocast), beside fp32")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    cfg = dict(common.PRESETS[args.preset])
    args.seq_len = args.seq_len or cfg["T"]
    if args.child:
        res = (run_rx if args.child == "rx" else run_torch)(args, cfg)
        print("RESULT " + json.dumps(res))
        return
    common.clean_blas_env()
    flops = common.model_flops_per_token(cfg, args.seq_len)
    peak = common.numpy_sgemm_gflops(args.threads)
    print("preset %s  T=%d  B=%d  threads=%d  model %.1f MFLOP/token (docs/training.md §Presets)"
          % (args.preset, args.seq_len, args.batch, args.threads, flops / 1e6))
    print("NumPy sgemm %.1f GFLOP/s at %d threads (%s)" % (peak, args.threads, common.blas_info()))
    cores = min(args.threads, os.cpu_count() or 1)
    core_fp32, core_bf16 = bench_peak.peaks(bench_peak.measure())
    print("one core's peaks (bench_peak.py): fp32 FMA %.1f, bf16 %.1f GFLOP/s; x %d cores in "
          "use: the \"of peak\" denominators" % (core_fp32, core_bf16, cores))
    peak_bf16 = None
    if args.precision == "bf16":
        peak_bf16, src = common.bf16_matmul_gflops(args.threads)
        print("bf16 matmul %.1f GFLOP/s at %d threads (%s): the bf16 runs' MFU denominator"
              % (peak_bf16, args.threads, src))
    impls = ["rx"]
    if not args.no_torch:
        try:
            import importlib.util
            if importlib.util.find_spec("torch") is not None:
                impls.append("torch")
        except (ImportError, ValueError):   # a broken torch install: bench without it
            pass
    runs = [(impl, args.threads, "fp32") for impl in impls]
    if args.precision == "bf16":
        runs += [(impl, args.threads, "bf16") for impl in impls]
    if args.scaling and args.threads > 1:
        runs.append(("rx", 1, "fp32"))
    best, per_round = {}, {run: [] for run in runs}
    for _ in range(max(1, args.rounds)):
        for run in runs:
            res = child(run[0], args, run[1], run[2])
            per_round[run].append(res)
            prev = best.get(run)
            if prev is None or ("error" in prev and "error" not in res) or (
                    "error" not in res and res["fwd_bwd_tok_s"] > prev["fwd_bwd_tok_s"]):
                best[run] = res
    print("best of %d alternating round(s) x %d steps" % (max(1, args.rounds), args.steps))
    results = [best[r] for r in runs if r[1] == args.threads]
    for res, run in zip(results, runs):
        if "error" in res:
            print("%-14s %s" % (res["impl"], res["error"]))
            continue
        bf16 = run[2] == "bf16"
        mfu = res["fwd_bwd_tok_s"] * flops / ((peak_bf16 if bf16 else peak) * 1e9)
        res["mfu"] = mfu
        res["mfu_of_peak"] = mfu_hw = res["fwd_bwd_tok_s"] * flops / (
            (core_bf16 if bf16 else core_fp32) * cores * 1e9)
        line = "%-19s fwd+bwd %8.0f tok/s  MFU %5.1f%% (%5.1f%% of peak)  peak RSS %7.1f MiB" % (
            res["impl"], res["fwd_bwd_tok_s"], 100 * mfu, 100 * mfu_hw, res["peak_rss_mib"])
        if "step_tok_s" in res:
            line += "  full step %8.0f tok/s" % res["step_tok_s"]
        print(line)
        for row in res.get("breakdown") or []:
            print("    %-40s %9.2f ms  %5.1f%%" % (row[0], row[1], 100 * row[2]))
    by = {(run[0], run[2]): res for res, run in zip(results, runs) if "error" not in res}
    rounds_of = {(run[0], run[2]): per_round[run] for run in runs if run[1] == args.threads}
    ratios = {}
    for a, b, what in ((("rx", "fp32"), ("torch", "fp32"), "rwkvx_c / torch"),
                       (("rx", "bf16"), ("torch", "bf16"), "rwkvx_c bf16 / torch bf16"),
                       (("rx", "bf16"), ("rx", "fp32"), "rwkvx_c bf16 / rwkvx_c fp32"),
                       (("torch", "bf16"), ("torch", "fp32"), "torch bf16 / torch fp32")):
        if a in by and b in by:
            # each round's two sides ran seconds apart: their ratio sees less
            # of the machine's drift than the ratio of the two bests
            rr = sorted(x["fwd_bwd_tok_s"] / y["fwd_bwd_tok_s"]
                        for x, y in zip(rounds_of[a], rounds_of[b])
                        if "error" not in x and "error" not in y)
            ratios[what] = rr
            print("%s: %.2fx tokens/s (per round: median %.2fx, %.2f-%.2fx over %d), "
                  "%.2fx peak RSS"
                  % (what, by[a]["fwd_bwd_tok_s"] / by[b]["fwd_bwd_tok_s"],
                     statistics.median(rr), rr[0], rr[-1], len(rr),
                     by[a]["peak_rss_mib"] / by[b]["peak_rss_mib"]))
    one = best.get(("rx", 1, "fp32"))
    if one and "error" not in one and "error" not in results[0]:
        print("rwkvx_c at 1 thread %8.0f tok/s: %d threads give %.2fx"
              % (one["fwd_bwd_tok_s"], args.threads,
                 results[0]["fwd_bwd_tok_s"] / one["fwd_bwd_tok_s"]))
        results[0]["one_thread_tok_s"] = one["fwd_bwd_tok_s"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "T": args.seq_len, "B": args.batch,
                       "threads": args.threads, "rounds": args.rounds,
                       "model_flops_per_token": flops,
                       "numpy_sgemm_gflops": peak, "bf16_matmul_gflops": peak_bf16,
                       "core_peak_fp32_gflops": core_fp32, "core_peak_bf16_gflops": core_bf16,
                       "cores": cores,
                       "results": results, "round_ratios": ratios}, f, indent=1)


if __name__ == "__main__":
    main()
