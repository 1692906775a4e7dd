"""Build of rwkvx_c: the C core (csrc/) compiled twice from the same sources,
into the Cython extension rwkvx_c._core and into librwkvx_c.so for C programs.

Environment knobs (all optional):
  RWKVX_NATIVE=1     add -march=native (faster on the build machine only;
                     the default build runs on any x86-64 and picks AVX2+FMA
                     kernels at run time)
  RWKVX_NO_OPENMP=1  build without OpenMP (single-threaded)
  RWKVX_DEBUG=1      -O0 -g
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "*.c")))
LIBNAME = "rwkvx_c"


def _flag(name):
    return os.environ.get(name, "") not in ("", "0")


def _compiler_accepts(cc, args, source):
    """True when `cc args` compiles and links the given C source."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "probe.c")
        with open(src, "w") as f:
            f.write(source)
        try:
            r = subprocess.run(cc + [src, "-o", os.path.join(d, "probe")] + args,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError:
            return False
        return r.returncode == 0


OMP_PROBE = """#include <omp.h>
int main(void) { int n = 0;
#pragma omp parallel reduction(+:n)
n += 1;
return n > 0 ? 0 : 1; }
"""


def _say(msg):
    """A progress line on stderr (pip shows it with -v: pip install -v .)."""
    sys.stderr.write("rwkvx_c build: %s\n" % msg)
    sys.stderr.flush()


def _parallel_compile(compiler, jobs):
    """compiler.compile, its files compiled `jobs` at a time, each one said
    as it finishes ([k/N] name, seconds since the build began)."""
    t0 = time.perf_counter()

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                extra_preargs=None, extra_postargs=None, depends=None):
        macros, objects, extra, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
        # the largest first (the Cython module takes longest), so none is left alone at the end
        todo = sorted(((obj, src, ext) for obj, (src, ext) in build.items()),
                      key=lambda job: -os.path.getsize(job[1]))

        def one(job):
            obj, src, ext = job
            compiler._compile(obj, src, ext, cc_args, extra, pp_opts)
            return src
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            done = [pool.submit(one, job) for job in todo]
            for k, f in enumerate(as_completed(done), 1):
                _say("[%d/%d] %s (%.0f s)" % (k, len(todo), os.path.basename(f.result()),
                                             time.perf_counter() - t0))
        return objects
    return compile


class BuildExt(build_ext):
    """Detects OpenMP, then builds the extension and the standalone library
    (the C core compiled once for both, RWKVX_JOBS files at a time: default
    every core), saying each file as it is done."""

    def build_extensions(self):
        jobs = int(os.environ.get("RWKVX_JOBS") or os.cpu_count() or 1)
        self.compiler.compile = _parallel_compile(self.compiler, jobs)
        _say("compiling the C core and the extension (%d files, %d at a time)"
             % (len(CSRC) + 1, jobs))
        cc = list(self.compiler.compiler_so[:1])
        # -fno-math-errno: nothing reads errno, and setting it keeps sqrtf a
        # scalar library call in loops that would otherwise vectorise.
        cflags = ["-std=gnu11", "-fno-strict-aliasing", "-fno-math-errno", "-Wall",
                  "-Wno-unused-function"]
        cflags += ["-O0", "-g"] if _flag("RWKVX_DEBUG") else ["-O3"]
        if _flag("RWKVX_NATIVE"):
            cflags.append("-march=native")
        omp_c, omp_l = [], []
        if _flag("RWKVX_NO_OPENMP"):
            self.warn("rwkvx_c: OpenMP disabled by RWKVX_NO_OPENMP; the build is single-threaded")
        elif _compiler_accepts(cc, ["-fopenmp"], OMP_PROBE):
            omp_c, omp_l = ["-fopenmp"], ["-fopenmp"]
        else:
            self.warn("rwkvx_c: the C compiler has no OpenMP; building SINGLE-THREADED. "
                      "Install an OpenMP runtime (libgomp / libomp) and rebuild for threads.")
        # `omp simd` reductions vectorise even without the OpenMP runtime.
        if not omp_c and _compiler_accepts(cc, ["-fopenmp-simd"], "int main(void){return 0;}"):
            omp_c.append("-fopenmp-simd")
        for ext in self.extensions:
            ext.extra_compile_args = cflags + omp_c
            ext.extra_link_args = omp_l
        super().build_extensions()
        self._build_shared_library(cflags + omp_c + ["-fvisibility=default"], omp_l)

    def _build_shared_library(self, cflags, ldflags):
        pkg_dir = os.path.dirname(self.get_ext_fullpath("rwkvx_c._core"))
        # the extension's objects of csrc/ are the library's: the same flags,
        # position-independent; compiled again only where symbols were hidden
        objs = [self.compiler.object_filenames([s], output_dir=self.build_temp)[0]
                for s in CSRC]
        hidden = any("-fvisibility=hidden" in a for a in self.compiler.compiler_so)
        if hidden or not all(os.path.exists(o) for o in objs):
            _say("compiling the C core again for librwkvx_c.so")
            objs = self.compiler.compile(CSRC, output_dir=os.path.join(self.build_temp, "libcore"),
                                         include_dirs=["csrc"], extra_postargs=cflags + ["-fPIC"])
        _say("linking librwkvx_c.so")
        lib = os.path.join(pkg_dir, "lib", "lib%s.so" % LIBNAME)
        os.makedirs(os.path.dirname(lib), exist_ok=True)
        self.compiler.link_shared_object(objs, lib, extra_postargs=ldflags + ["-lm"])
        inc = os.path.join(pkg_dir, "include")
        os.makedirs(inc, exist_ok=True)
        shutil.copy2(os.path.join("csrc", "rx_pretrain.h"), inc)
        self._write_pkgconfig(os.path.join(pkg_dir, "lib", "pkgconfig"))

    @staticmethod
    def _write_pkgconfig(folder):
        """lib/pkgconfig/rwkvx_c.pc, relative to itself (${pcfiledir}), so the
        installed package works wherever it lands:
        PKG_CONFIG_PATH=$(python -c 'import rwkvx_c; print(rwkvx_c.get_library_dir())')/pkgconfig
        """
        from setuptools.config.pyprojecttoml import read_configuration
        version = read_configuration(os.path.join(HERE, "pyproject.toml"))["project"]["version"]
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "%s.pc" % LIBNAME), "w") as f:
            f.write("prefix=${pcfiledir}/../..\n"
                    "libdir=${prefix}/lib\n"
                    "includedir=${prefix}/include\n\n"
                    "Name: %s\n"
                    "Description: CPU pretraining kernels of RWKV-X language models\n"
                    "Version: %s\n"
                    "Cflags: -I${includedir}\n"
                    "Libs: -L${libdir} -l%s -Wl,-rpath,${libdir}\n"
                    "Libs.private: -lm\n" % (LIBNAME, version, LIBNAME))

    def copy_extensions_to_source(self):
        # --inplace / editable builds: the library and header follow the extension.
        super().copy_extensions_to_source()
        built = os.path.join(self.build_lib, "rwkvx_c")
        src = self.get_finalized_command("build_py").get_package_dir("rwkvx_c")
        for sub in ("lib", "include"):
            shutil.copytree(os.path.join(built, sub), os.path.join(src, sub), dirs_exist_ok=True)


extensions = [
    Extension(
        "rwkvx_c._core",
        sources=["rwkvx_c/_core.pyx"] + CSRC,
        include_dirs=["csrc", np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        depends=glob.glob("csrc/*.h") + glob.glob("rwkvx_c/*.pxi") + glob.glob("rwkvx_c/*.pxd"),
        libraries=["m"],
    )
]

if sys.platform == "win32":
    sys.exit("rwkvx_c builds on Linux and macOS (GCC or Clang)")

_say("cythonizing rwkvx_c/_core.pyx (when it changed)")
setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={
            "language_level": "3",
            "boundscheck": False,
            "wraparound": False,
            "initializedcheck": False,
            "cdivision": True,
            "embedsignature": True,
            # signatures as __text_signature__, which inspect.signature reads;
            # a class states its own in its docstring's first line, "--" after it
            "embedsignature.format": "clinic",
        },
    ),
    cmdclass={"build_ext": BuildExt},
)
