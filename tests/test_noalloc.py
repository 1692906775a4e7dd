"""A training step (forward, backward, grad norm, AdamW; fp32 and bf16)
allocates nothing once a first step has grown its buffers: tests/c/
noalloc_step.c counts the library's malloc/calloc/realloc/aligned_alloc/
posix_memalign calls during a step, by defining them itself (glibc)."""
import os
import platform
import shutil
import subprocess
import sys

import pytest

import rwkvx_c as rx

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "c", "noalloc_step.c")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the allocator is replaced through glibc's __libc_* entry points")
    lib = rx.get_library_dir()
    exe = str(tmp_path_factory.mktemp("noalloc") / "noalloc_step")
    subprocess.run([cc, "-std=c11", "-O2", "-Wall", "-Werror", SRC, "-I", rx.get_include(),
                    "-L", lib, "-l" + rx.LIBRARY_NAME, "-Wl,-rpath," + lib, "-o", exe],
                   check=True)
    return exe


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("acts", [[], ["1"], ["3", "37"], ["0", "0", "lora"],
                                  ["3", "37", "lora"], ["0", "0", "lora", "rows"],
                                  ["3", "37", "base", "rows"], ["0", "0", "-", "accum"],
                                  ["0", "0", "none", "bf16"], ["3", "37", "lora", "q8_0"],
                                  ["0", "0", "none", "gen"], ["0", "0", "lora", "gen"],
                                  ["0", "0", "dora"], ["3", "37", "dora", "q8_0"],
                                  ["0", "0", "dora", "gen"], ["3", "37", "lora", "groups"]],
                         ids=["plain", "recompute", "recompute+chunked_head", "lora",
                              "lora+recompute+chunked_head", "lora+rows",
                              "recompute+chunked_head+rows", "grad_accum", "bf16_base",
                              "lora+q8_0_base+recompute+chunked_head", "gen", "lora+gen", "dora",
                              "dora+q8_0_base+recompute+chunked_head", "dora+gen",
                              "lora+row_groups+recompute+chunked_head"])
def test_a_step_allocates_nothing(program, threads, acts):
    # recompute (RX_ACTS_RECOMPUTE = 1) and the chunked head (2; 37-row
    # chunks cut the 256 rows unevenly) with L2Wrap allocate nothing either,
    # nor a LoRA or DoRA tune's step (adapters on every projection, the base frozen),
    # nor a preference step (per-position losses, then the row-weighted backward)
    out = subprocess.run([program, *acts], env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    counts = {p: int(c) for _, p, c in (line.split() for line in out.stdout.splitlines())}
    assert counts == {"fp32": 0, "bf16": 0}, out.stdout


def test_no_step_allocates_on_a_loaded_machine(program):
    """With both cores busy a GEMM thread steals other threads' units, which
    units depends on the timing, and a thread that had not yet run a unit
    that wide grew its buffer mid-run (12 of 60 runs allocated in a step
    before every thread sized for the batch's widest unit). Runs the step
    program 20 times beside two spinning processes."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        for _ in range(20):
            out = subprocess.run([program], env=dict(os.environ, OMP_NUM_THREADS="2"),
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            assert out.stdout.split() == ["allocations", "fp32", "0", "allocations", "bf16",
                                          "0"], out.stdout
    finally:
        for p in spin:
            p.kill()
            p.wait()
