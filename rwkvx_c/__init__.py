"""rwkvx_c: a CPU training engine for RWKV-X language models.

The kernels (docs/maths.md) are C with OpenMP; this package is their
validated Python surface. Every array is float32 (tokens int32) and
C-contiguous. The layers above the binding (docs/architecture.md):
rwkvx_c.cli -> rwkvx_c.train, rwkvx_c.interop, rwkvx_c.sample ->
rwkvx_c.data -> rwkvx_c.model, rwkvx_c.run -> rwkvx_c.util, rwkvx_c.errors.
"""
import glob as _glob
import os as _os

from rwkvx_c._omp import bound_spin as _bound_spin
from rwkvx_c._omp import openmp_runtimes

_bound_spin()   # before the C core loads the OpenMP runtime; see _omp.py

_HERE = _os.path.dirname(_os.path.abspath(__file__))
try:
    from rwkvx_c._core import (
        ALLOC_HEADROOM,
        BASE_DTYPES,
        CONFIG_FIELDS,
        MAX_THREADS,
        OPTION_FIELDS,
        ByteTrie,
        GenState,
        InferState,
        RxPtModel,
        adamw_step,
        attn_backward,
        attn_forward,
        attn_score_av_backward,
        attn_score_av_forward,
        available_memory,
        axpby,
        base_dequantize,
        base_dtype_block,
        base_quantize,
        bf16_hardware,
        bf16_pays,
        block_backward,
        block_forward,
        cgroup_free_bytes,
        channelmix_backward,
        channelmix_forward,
        check_config,
        cross_entropy_backward,
        cross_entropy_forward,
        draw_rows,
        embedding_backward,
        embedding_forward,
        gemm_kernel,
        get_num_threads,
        grad_norm,
        has_openmp,
        head_backward,
        head_chunk_rows,
        head_forward,
        head_loss,
        layernorm_backward,
        layernorm_forward,
        meminfo_available_bytes,
        profile,
        profile_enable,
        set_num_threads,
        timemix_backward,
        timemix_forward,
        tm_fields,
        tm_shapes,
        wkv7_backward,
        wkv7_forward,
    )
except ModuleNotFoundError as _e:
    if _e.name != "rwkvx_c._core" or _glob.glob(_os.path.join(_HERE, "_core*.so")):
        raise
    # a checkout's rwkvx_c/ (first on sys.path when Python runs in the
    # repository root) shadows the installed package and has no extension
    raise ImportError(
        f"rwkvx_c was imported from the source tree {_HERE}, which has no built extension: "
        "run from another folder to use the installed package, or build it in place "
        "with `pip install -e .`") from None

__version__ = "0.1.0"

# the names `from rwkvx_c import *` gives: the binding's (rwkvx_c._core,
# typed in _core.pyi) and this module's; the layers above are subpackages
__all__ = [
    "RxPtModel", "InferState", "GenState", "ByteTrie", "CONFIG_FIELDS", "OPTION_FIELDS",
    "ALLOC_HEADROOM", "MAX_THREADS", "BASE_DTYPES", "base_dtype_block", "base_quantize",
    "base_dequantize", "check_config",
    "tm_fields", "tm_shapes",
    "wkv7_forward", "wkv7_backward", "timemix_forward", "timemix_backward",
    "channelmix_forward", "channelmix_backward", "attn_forward", "attn_backward",
    "attn_score_av_forward", "attn_score_av_backward", "block_forward", "block_backward",
    "layernorm_forward", "layernorm_backward", "embedding_forward", "embedding_backward",
    "head_forward", "head_backward", "head_loss", "head_chunk_rows",
    "cross_entropy_forward", "cross_entropy_backward", "draw_rows", "adamw_step", "grad_norm",
    "axpby",
    "gemm_kernel", "bf16_hardware", "bf16_pays", "set_num_threads", "get_num_threads", "has_openmp",
    "openmp_runtimes", "available_memory", "meminfo_available_bytes", "cgroup_free_bytes",
    "profile", "profile_enable",
    "get_include", "get_library_dir", "LIBRARY_NAME", "__version__",
]

LIBRARY_NAME = "rwkvx_c"
"""Link name of the C core's shared library: -lrwkvx_c."""


def get_include() -> str:
    """Folder holding rx_pretrain.h, for C programs: -I$(this)."""
    return _os.path.join(_HERE, "include")


def get_library_dir() -> str:
    """Folder holding librwkvx_c.so, for C programs: -L$(this) -Wl,-rpath,$(this)."""
    return _os.path.join(_HERE, "lib")
