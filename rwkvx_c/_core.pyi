# Type stub of rwkvx_c._core (each concern appends its section).
import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]

# --- whole model (_model.pxi) ---
I32 = npt.NDArray[np.int32]

CONFIG_FIELDS: tuple[str, ...]

class RxPtModel:
    """RWKV-X model over two flat float32 arenas (params, grads); SPEC §7, §8, §10."""
    def __init__(self, config: dict[str, int], seed: int = ...) -> None: ...
    @property
    def config(self) -> dict[str, int]: ...
    @property
    def layers(self) -> str: ...                      # e.g. "RRARRAR"
    @property
    def param_names(self) -> list[str]: ...
    @property
    def params(self) -> dict[str, F32]: ...           # writable zero-copy views
    @property
    def grads(self) -> dict[str, F32]: ...
    @property
    def param_buffer(self) -> F32: ...                # 1-D view of the whole arena
    @property
    def grad_buffer(self) -> F32: ...
    @property
    def n_params(self) -> int: ...
    def forward(self, tokens: I32) -> F32: ...        # (T,) -> (T, V); (B, T) -> (B, T, V)
    def backward(self, targets: I32, ignore_index: int = ...) -> float: ...
    def zero_grad(self) -> None: ...
