"""How the OpenMP threads of rwkvx_c wait, and which OpenMP runtimes a
process holds.

GNU OpenMP (libgomp) lets an idle worker spin up to GOMP_SPINCOUNT
iterations (300,000 by default, about 20 ms of PAUSE instructions on a
Sapphire Rapids core) before it sleeps. That pays on a dedicated machine,
but whenever a team shares its cores with anything else -- another
process, PyTorch's threads, another OpenMP runtime -- a worker spins at a
barrier while the thread it waits for is descheduled, and every barrier
of a training step can cost a time slice. On a loaded 2-core machine an
S step ran 9-14x faster with GOMP_SPINCOUNT=1000 or OMP_WAIT_POLICY=passive
than with the default (bench/bench_beside_torch.py). Too short a spin costs
on idle cores instead: a worker sleeps at every barrier it waits at for
longer, and each wake-up takes tens of microseconds; an S or M step at 2
threads ran 3-5% faster with 3000 than with 1000, and no faster with
10,000 (docs/performance.md). libgomp reads these variables once,
when it is loaded, so rwkvx_c sets a bounded spin before it loads its C
core, unless the user chose a policy or the runtime was already loaded
(by torch, say): then the user's environment decides.
"""
import os

SPIN_DEFAULT = "3000"
"""GOMP_SPINCOUNT set at import when the user set neither it nor OMP_WAIT_POLICY."""

# file-name prefixes of the OpenMP runtimes used on Linux: GNU, LLVM, Intel
_RUNTIMES = ("libgomp", "libomp", "libiomp")


def openmp_runtimes() -> list[str]:
    """Paths of the OpenMP runtime libraries mapped into this process (Linux;
    elsewhere an empty list). More than one means two thread pools whose idle
    workers compete for the same cores; see docs/performance.md."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(_RUNTIMES))


def bound_spin() -> bool:
    """Sets GOMP_SPINCOUNT to SPIN_DEFAULT when the user set neither it nor
    OMP_WAIT_POLICY and no OpenMP runtime is loaded yet (it would not read
    it). True when it set it."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    if openmp_runtimes():
        return False
    os.environ["GOMP_SPINCOUNT"] = SPIN_DEFAULT
    return True
