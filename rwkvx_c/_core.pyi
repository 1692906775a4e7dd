# Type stub of rwkvx_c._core (the Cython extension). Shapes follow SPEC §10:
# every array is float32 (tokens / targets int32) and C-contiguous.
# Each concern appends its section below.
import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]

# -- RWKV-7 time-mix, channel-mix, block (SPEC §3, §4, §6) ----------------------
# params: dict name -> F32 ('x_r' .. 'ln_x_b' for the time-mix, 'ffn_x_k' ..
# for the channel-mix, 'ln1_w', 'tm.x_r', ..., 'cm.ffn_value_w' for the block);
# grads come back keyed the same. v_first / d_v_first: see SPEC §10.
def timemix_forward(p: dict[str, F32], x: F32, x_prev_init: F32 | None = ...,
                    v_first: F32 | None = ..., *, n_head: int, head_size: int,
                    layer_id: int) -> tuple[F32, F32]: ...
def timemix_backward(p: dict[str, F32], x: F32, dy: F32, x_prev_init: F32 | None = ...,
                     v_first: F32 | None = ..., d_v_first: F32 | None = ..., *, n_head: int,
                     head_size: int,
                     layer_id: int) -> tuple[F32, dict[str, F32], F32, F32 | None]: ...
def channelmix_forward(p: dict[str, F32], x: F32, x_prev_init: F32 | None = ...) -> F32: ...
def channelmix_backward(p: dict[str, F32], x: F32, dy: F32,
                        x_prev_init: F32 | None = ...) -> tuple[F32, dict[str, F32], F32]: ...
def block_forward(p: dict[str, F32], x: F32, tm_xprev_init: F32 | None = ...,
                  cm_xprev_init: F32 | None = ..., v_first: F32 | None = ..., *, n_head: int,
                  head_size: int, layer_id: int) -> tuple[F32, F32]: ...
def block_backward(p: dict[str, F32], x: F32, dy: F32, tm_xprev_init: F32 | None = ...,
                   cm_xprev_init: F32 | None = ..., v_first: F32 | None = ...,
                   d_v_first: F32 | None = ..., *, n_head: int, head_size: int,
                   layer_id: int) -> tuple[F32, dict[str, F32], F32, F32, F32 | None]: ...
