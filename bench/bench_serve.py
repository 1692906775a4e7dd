"""Throughput of `rwkvx-c serve`: N concurrent /v1/completions requests of
M new tokens each (greedy), answered by a server of one slot (one request
at a time) and by one of N slots (every request in one batch), through
HTTP in real processes. Besides the wall-clock time, the server's CPU
seconds over the requests (Linux: /proc/PID/stat), which a machine shared
with other work changes less than the wall clock.

    python bench/bench_serve.py [--preset default|tiny|S|M] [--requests 8] [--tokens 64]
        [--threads 1]

The model: the preset's, random (seed 1), saved as a run folder in a
temporary directory. Prints a markdown row per server and one JSON line,
with the CPU.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import rwkvx_c as rx  # noqa: E402
from rwkvx_c.model.presets import PRESETS  # noqa: E402
from rwkvx_c.run.checkpoint import save_checkpoint  # noqa: E402


def _serve(run, slots, threads):
    p = subprocess.Popen([sys.executable, "-m", "rwkvx_c", "serve", run, "--port", "0",
                          "--slots", str(slots), "--threads", str(threads)],
                         stderr=subprocess.PIPE, text=True)
    line = p.stderr.readline()
    if "http://" not in line:
        p.kill()
        sys.exit(f"the server did not start: {line}")
    return p, line.split("at ", 1)[1].split()[0]


def _cpu_seconds(pid):
    """user + system CPU seconds of process pid (None off Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ask(url, prompt, tokens):
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["usage"]["completion_tokens"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default", choices=list(PRESETS))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        m = rx.RxPtModel(dict(PRESETS[a.preset]["model"]), seed=1)
        run = os.path.join(d, "run")
        os.makedirs(run)
        save_checkpoint(os.path.join(run, "checkpoint.safetensors"), m.params, m.config, {})
        for slots in (1, a.requests):
            p, url = _serve(run, slots, a.threads)
            try:
                _ask(url, "warm up", 4)
                made = [0] * a.requests

                def one(i, url=url, made=made):
                    made[i] = _ask(url, f"def f{i}(", a.tokens)
                c0, t0 = _cpu_seconds(p.pid), time.perf_counter()
                ts = [threading.Thread(target=one, args=(i,)) for i in range(a.requests)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                dt = time.perf_counter() - t0
                c1 = _cpu_seconds(p.pid)
            finally:
                p.terminate()
                p.wait()
            rows.append({"slots": slots, "requests": a.requests, "tokens": sum(made),
                         "seconds": round(dt, 3), "tokens_per_s": round(sum(made) / dt, 1),
                         "cpu_seconds": None if c0 is None or c1 is None else
                         round(c1 - c0, 2)})
    print("| slots | requests x new tokens | seconds | tokens/s | server CPU s |\n"
          "|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['slots']} | {a.requests} x {a.tokens} | {r['seconds']:.2f} | "
              f"{r['tokens_per_s']:,.0f} | {r['cpu_seconds']} |")
    print(json.dumps({"cpu": rx.gemm_kernel(), "preset": a.preset, "threads": a.threads,
                      "rows": rows}))


if __name__ == "__main__":
    main()
