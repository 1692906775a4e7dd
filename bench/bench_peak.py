"""One core's arithmetic peak per instruction (bench/peak.c): the ceiling of
each GEMM kernel on this CPU, and whether a bf16 kernel can beat fp32 here.

    python bench/bench_peak.py [--runs 3]

Builds peak.c with the C compiler ($CC, else cc) into a temporary folder
and runs it --runs times (each run reports its best of 7 repetitions by
thread CPU time); prints each instruction's best and median GFLOP/s and the
ratios that decide the precision: vdpbf16ps and AMX tdpbf16ps over 512-bit
fp32 FMA. A shared core lowers some runs, so the best is the machine's
figure and the spread says how busy it was.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = {"fma-ymm": "vfmadd231ps ymm (avx2-fma sgemm)",
         "fma-zmm": "vfmadd231ps zmm (avx512f sgemm)",
         "dpbf16-zmm": "vdpbf16ps zmm (avx512-bf16 bgemm)",
         "amx-bf16": "tdpbf16ps 2x2 tiles (amx-bf16 bgemm)"}


def build(tmp):
    exe = os.path.join(tmp, "peak")
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-O3", "-o", exe, os.path.join(HERE, "peak.c")], check=True)
    return exe


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rates = {name: [] for name in NAMES}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(tmp)
        for _ in range(args.runs):
            out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
            for line in out.splitlines():
                name, value = line.split()
                if value != "-":
                    rates[name].append(float(value))
    print("one core, GFLOP/s: best (median) of %d runs" % args.runs)
    for name, label in NAMES.items():
        v = rates[name]
        shown = "%8.1f (%.1f)" % (max(v), statistics.median(v)) if v else "     not on this CPU"
        print("  %-38s %s" % (label, shown))
    fp32 = rates["fma-zmm"] or rates["fma-ymm"]
    for name in ("dpbf16-zmm", "amx-bf16"):
        if rates[name] and fp32:
            print("%s / best fp32 FMA: %.2fx" % (name, max(rates[name]) / max(fp32)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
