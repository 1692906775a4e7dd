"""rwkvx_c: a CPU pretraining engine for RWKV-X language models.

The kernels (docs/maths.md) are C with OpenMP; this package is their validated
Python surface. Every array is float32 (tokens int32) and C-contiguous.
"""
import os as _os

from rwkvx_c._omp import bound_spin as _bound_spin
from rwkvx_c._omp import openmp_runtimes  # noqa: F401

_bound_spin()   # before the C core loads the OpenMP runtime; see _omp.py

from rwkvx_c._core import *  # noqa: E402, F403
from rwkvx_c._core import (  # noqa: E402,F401
    gemm_kernel,
    get_num_threads,
    has_openmp,
    set_num_threads,
)

__version__ = "0.1.0"

LIBRARY_NAME = "rwkvx_c"
"""Link name of the C core's shared library: -lrwkvx_c."""


def get_include() -> str:
    """Folder holding rx_pretrain.h, for C programs: -I$(this)."""
    return _os.path.join(_os.path.dirname(__file__), "include")


def get_library_dir() -> str:
    """Folder holding librwkvx_c.so, for C programs: -L$(this) -Wl,-rpath,$(this)."""
    return _os.path.join(_os.path.dirname(__file__), "lib")
