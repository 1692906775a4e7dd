"""One core's arithmetic peak per instruction (bench/peak.c): the ceiling of
each GEMM kernel on this CPU, and whether a bf16 kernel can beat fp32 here.

    python bench/bench_peak.py [--runs 3]

Builds peak.c with the C compiler ($CC, else cc) into a temporary folder
and runs it --runs times (each run reports its best of 7 repetitions by
thread CPU time); prints each instruction's best and median GFLOP/s and the
ratios that decide the precision: vdpbf16ps and AMX tdpbf16ps over 512-bit
fp32 FMA. A shared core lowers some runs, so the best is the machine's
figure and the spread says how busy it was.

bench.py and bench_gemm.py call measure() in their own run and count
utilisation against these peaks times the threads in use, beside the
NumPy-relative figure: a BLAS limited by its environment (an old
OPENBLAS_CORETYPE, a kernel for an older CPU) is no measure of the machine.
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


def measure(runs=3):
    """{instruction: [GFLOP/s of each run]} for one core; an empty list where
    the CPU lacks the instruction."""
    rates = {name: [] for name in NAMES}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(tmp)
        for _ in range(runs):
            out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
            for line in out.splitlines():
                name, value = line.split()
                if value != "-":
                    rates[name].append(float(value))
    return rates


def peaks(rates):
    """(fp32, bf16) one-core peaks in GFLOP/s from measure()'s rates: the
    faster fp32 FMA, and the faster bf16 instruction (AMX tiles or
    vdpbf16ps; the fp32 FMA where the CPU has neither, as the generic bf16
    kernel computes in fp32)."""
    best = {k: max(v) for k, v in rates.items() if v}
    fp32 = max(best.get("fma-zmm", 0.0), best.get("fma-ymm", 0.0))
    return fp32, max(best.get("dpbf16-zmm", 0.0), best.get("amx-bf16", 0.0), fp32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rates = measure(args.runs)
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
