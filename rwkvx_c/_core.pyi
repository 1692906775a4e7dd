# Type stub of rwkvx_c._core (each concern appends its section).
import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]

# --- gemm (test/bench hook) ---
def _sgemm(a: F32, b: F32, ta: bool = ..., tb: bool = ..., c: F32 | None = ...) -> F32: ...
def _sgemm_use_kernel(name: str | None = ...) -> None: ...
