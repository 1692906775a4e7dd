"""Builds every tests/c/test_*.c together with csrc/*.c under
AddressSanitizer + UndefinedBehaviorSanitizer and runs it.

Each C program checks kernels against plain double loops and exits nonzero
on a failed check; a sanitizer finding aborts it (-fno-sanitize-recover).
The whole module is skipped, with the reason, where the compiler cannot
build or run sanitized programs. The C core is compiled once; each test
program links against those objects."""
import glob
import os
import shlex
import shutil
import subprocess
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
PROGRAMS = sorted(glob.glob(os.path.join(ROOT, "tests", "c", "test_*.c")))
SAN = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-g", "-O1"]
# a call of a legacy form fails the build: the core must not make one, and
# of the test programs only tests/c/test_legacy.c opts out, to test them
BASE = ["-std=gnu11", "-Wall", "-Werror=deprecated-declarations", "-I" + CSRC]
RUN_TIMEOUT = 120


def compiler():
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cmd = shlex.split(cc)
    if shutil.which(cmd[0]):
        return cmd
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    return None


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def tail(r):
    return (r.stdout + r.stderr).strip()[-3000:]


PROBE = """#include <stdlib.h>
int main(void) { int *p = malloc(4 * sizeof *p); p[0] = 1; int v = p[0]; free(p); return v - 1; }
"""


@pytest.fixture(scope="module")
def toolchain(tmp_path_factory):
    """(cc, flags, env) able to build and run sanitized programs, else skip."""
    cc = compiler()
    if cc is None:
        pytest.skip("no C compiler found (set CC)")
    d = tmp_path_factory.mktemp("san_probe")
    src = d / "probe.c"
    src.write_text(PROBE)
    exe = str(d / "probe")
    r = run(cc + SAN + [str(src), "-o", exe])
    if r.returncode != 0:
        pytest.skip(f"{' '.join(cc)} cannot build with -fsanitize=address,undefined: {tail(r)}")
    # OpenMP when the compiler has it (the kernels also build without it)
    omp = ["-fopenmp"] if run(cc + SAN + ["-fopenmp", str(src), "-o", exe]).returncode == 0 else []
    env = dict(os.environ, UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    # LeakSanitizer is not available everywhere (e.g. under ptrace): use it where it runs
    for leaks in ("1", "0"):
        env["ASAN_OPTIONS"] = f"detect_leaks={leaks}:abort_on_error=0"
        r = run([exe], env=env, timeout=60)
        if r.returncode == 0:
            break
    else:
        pytest.skip(f"sanitized programs do not run here: {tail(r)}")
    return cc, omp, env


@pytest.fixture(scope="module")
def core_objects(toolchain, tmp_path_factory):
    """csrc/*.c compiled once with the sanitizers."""
    cc, omp, _ = toolchain
    d = tmp_path_factory.mktemp("san_core")
    objs = []
    for src in sorted(glob.glob(os.path.join(CSRC, "*.c"))):
        obj = str(d / (os.path.basename(src)[:-2] + ".o"))
        r = run(cc + BASE + SAN + omp + ["-c", src, "-o", obj])
        assert r.returncode == 0, f"compiling {src} failed:\n{tail(r)}"
        objs.append(obj)
    return objs


def test_c_programs_exist():
    assert PROGRAMS, "no tests/c/test_*.c found"


@pytest.mark.parametrize("program", PROGRAMS, ids=[os.path.basename(p) for p in PROGRAMS])
def test_c_program_under_sanitizers(program, toolchain, core_objects, tmp_path):
    cc, omp, env = toolchain
    exe = str(tmp_path / os.path.basename(program)[:-2])
    r = run(cc + BASE + SAN + omp + [program] + core_objects + ["-lm", "-o", exe])
    assert r.returncode == 0, f"building {program} failed:\n{tail(r)}"
    r = run([exe], env=env, timeout=RUN_TIMEOUT, cwd=str(tmp_path))
    assert r.returncode == 0, f"{os.path.basename(program)} exited {r.returncode}:\n{tail(r)}"
