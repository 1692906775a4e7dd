"""A run's peak memory, estimated before it allocates, against what is free.

Peak = the weights (weight_bytes, the one formula of them: the parameters,
the grads and AdamW's two moments of what trains, all float32, plus what is
being read, a checkpoint on resume) + the step's
activations, ~linear in B*T (far fewer per token under recompute, which
keeps one block's intermediates instead of every block's) + the head's
scratch (head_bytes: a fixed budget of rows, not B*T x vocab logits).
Parameters are counted from the config before
the model exists (an upper estimate: the matrices exactly, every vector as
VECTORS_PER_LAYER C-vectors); the activation bytes per token are measured
on the model itself, from the heap growth between two small steps (see
acts_bytes_per_token), so they follow whatever the C core keeps.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import warnings
from typing import TYPE_CHECKING

import numpy as np

from rwkvx_c import _core
from rwkvx_c.errors import MemoryTooSmall, RwkvxWarning
from rwkvx_c.util.files import MAP_SPAN

if TYPE_CHECKING:
    from rwkvx_c._core import RxPtModel

__all__ = ["MemoryTooSmall", "estimate_params", "param_bytes", "acts_bytes_per_token",
           "acts_bytes", "rough_bytes_per_token", "head_bytes", "available_bytes",
           "address_space_free", "fits",
           "check", "check_step", "weight_bytes", "PARAM_COPIES", "CHECKPOINT_COPIES",
           "TRAINED_COPIES", "HEADROOM"]

TRAINED_COPIES = 3          # a trained element's grad and AdamW's two moments (float32 each)
PARAM_COPIES = 1 + TRAINED_COPIES   # a full run, per parameter
CHECKPOINT_COPIES = 3       # a whole run's checkpoint, per parameter: it, AdamW's m and v
VECTORS_PER_LAYER = 32      # an RWKV block has ~22 C-vectors (lerps, biases, norms); margin
HEADROOM = 0.9              # refuse beyond 90% of MemAvailable: the OS, Python, NumPy need some
ROUGH_MARGIN = 4            # rough_bytes_per_token x this bounds the measured figure


def estimate_params(cfg: dict) -> int:
    """Parameter elements of a model config (>= the model's n_params)."""
    C, V, F = cfg["n_embd"], cfg["vocab_size"], cfg["ffn_dim"]
    lora = cfg["Dw"] + cfg["Da"] + cfg["Dg"] + cfg["Dv"]
    per_block = 4 * C * C + 2 * C * F + VECTORS_PER_LAYER * C
    return (2 * V * C + 2 * C + cfg["n_rwkv_layer"] * (per_block + 2 * C * lora)
            + cfg["n_attn_layer"] * per_block)


def weight_bytes(held: int, trained: int, loading: int, base: int = 0) -> int:
    """The peak bytes of a run's weights, the activations aside: `held`
    float32 parameters, for each of the `trained` elements its grad and
    AdamW's moments (TRAINED_COPIES), `loading` float32 elements being read
    at the same time, and `base` bytes of a frozen base."""
    return 4 * (held + TRAINED_COPIES * trained + loading) + base


def param_bytes(n_params: int) -> int:
    """weight_bytes of a full run of n_params (PARAM_COPIES of each): every
    parameter trains, and a resume reads its checkpoint mapped, holding one
    MAP_SPAN of it at a time as it checks and copies it
    (rwkvx_c.run.checkpoint), at most the whole file."""
    return weight_bytes(n_params, n_params, min(MAP_SPAN // 4, CHECKPOINT_COPIES * n_params))


def _heap_in_use() -> int | None:
    """Bytes glibc's malloc has handed out (arena + mmap'ed blocks), or None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        f = libc.mallinfo2
    except (OSError, AttributeError, TypeError):
        return None

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                                                    "hblkhd", "usmblks", "fsmblks", "uordblks",
                                                    "fordblks", "keepcost")]
    f.restype = Mallinfo2
    m = f()
    return m.uordblks + m.hblkhd


MEASURE_TOKENS = 64   # the smaller of the two measured sequence lengths (at least)


def acts_bytes_per_token(model: RxPtModel, fallback: int | None = None) -> int:
    """Heap bytes one more token of B*T costs a training step of `model`
    (acts_bytes' first figure)."""
    return acts_bytes(model, fallback)[0]


def acts_bytes(model: RxPtModel, fallback: int | None = None) -> tuple[int, int]:
    """(bytes per token, bytes per sequence) of a training step's heap for
    `model` (in its recompute mode, precision and frozen setting, with the
    trainer's chunked head), the head's scratch (head_bytes) aside: a step
    of B sequences of T tokens keeps about B*T*first + B*second. The second
    is what a sequence holds whatever its length: each head's state in the
    WKV recurrence's scratch, [heads][N][N] floats, one for the whole step
    (every RWKV block runs in it in turn): 0.5 MB at the 1.5B shape, 1 MB
    at C 4096, whatever the depth (the backward's chunk of recomputed
    states is per thread).

    Runs forward and backward at two small sequence lengths and divides the
    heap difference (the activation buffers the model keeps) by the token
    difference, and at two sequences of t tokens against one of 2t. A model
    of more than TWIN_BLOCKS blocks is measured on shallow twins instead
    (_twin_bytes): at 7B those steps would cost minutes, more than the step
    they guard. Without glibc's mallinfo2, returns (`fallback` or a bound
    from the config, 0)."""
    c = model.config
    rough = ROUGH_MARGIN * rough_bytes_per_token(c, model.recompute)
    if _heap_in_use() is None:
        return (fallback if fallback is not None else rough), 0
    if c["n_rwkv_layer"] + c["n_attn_layer"] > TWIN_BLOCKS:
        got = _twin_bytes(model)
    else:
        got = _measured_bytes(model)
    if got is None:
        return (fallback if fallback is not None else rough), 0
    return got


# Blocks above which acts_bytes measures shallow twins; a twin's vocabulary:
# the figures hold no [tokens, vocab] buffer (the head's scratch is
# head_bytes, counted apart), so a small one does not change them.
TWIN_BLOCKS = 4
TWIN_VOCAB = 256


def _twin_bytes(model: RxPtModel) -> tuple[int, int] | None:
    """acts_bytes of model from twins with its widths, precision,
    recompute and frozen setting and a TWIN_VOCAB vocabulary: from the
    second RWKV block on each keeps its own buffers per token, and so does
    each attention block after the first (the first two RWKV blocks share
    what the value residual adds, the first attention block what every
    attention block reuses), so with m(R, A) a twin of R RWKV and A
    attention blocks each figure for L RWKV and A attention blocks is
    m(2, 0) + (L - 2) (m(3, 0) - m(2, 0)) + [m(2, 1) - m(2, 0)] +
    (A - 1) (m(2, 2) - m(2, 1)), the bracket when A >= 1 (L >= 3 here: the
    model has more than TWIN_BLOCKS blocks and A <= L). Per sequence a
    block adds nothing (the WKV scratch is the step's, shared by the
    blocks; the checkpoints grow with the tokens): there m(3, 0) - m(2, 0)
    measures malloc's noise of a few KiB either way (a negative difference
    counts 0), so the second figure stays the shallow twin's, the one
    scratch, at any depth."""
    c = dict(model.config)
    L, A = c["n_rwkv_layer"], c["n_attn_layer"]

    def twin(rwkv: int, attn: int) -> tuple[int, int] | None:
        cfg = {**c, "n_rwkv_layer": rwkv, "n_attn_layer": attn, "vocab_size": TWIN_VOCAB}
        m = _core.RxPtModel(cfg, init=False, precision=model.precision,
                            recompute=model.recompute)
        m.frozen = model.frozen
        return _measured_bytes(m)

    two, three = twin(2, 0), twin(3, 0)
    first = twin(2, 1) if A else two
    more = twin(2, 2) if A > 1 else first
    if two is None or three is None or first is None or more is None:
        return None
    def deep(i: int) -> int:
        return two[i] + (L - 2) * max(three[i] - two[i], 0) + max(first[i] - two[i], 0) + \
            (A - 1 if A else 0) * max(more[i] - first[i], 0)

    return deep(0), deep(1)


def _measured_bytes(model: RxPtModel) -> tuple[int, int] | None:
    """acts_bytes measured on model itself; None when the heap did not grow
    with the tokens (nothing to measure)."""
    c = model.config
    # At a few tokens each buffer is a few KiB, and whether malloc serves it
    # from the heap or from page-rounded mmap (its threshold moves with what
    # the process freed before) shifts the figure by 10-20%; at
    # MEASURE_TOKENS that rounding is a few percent.
    cs = c["chunk_size"]
    t1 = -(-MEASURE_TOKENS // cs) * cs
    used = []
    # the first steps only warm up: they make what stays whatever the batch
    # (the threads' GEMM scratch, malloc's arenas). Each later t1 -> 2*t1
    # step measures a token's bytes, each 1 x 2*t1 -> 2 x t1 step (the same
    # tokens) a sequence's; a one-time allocation (a thread's first
    # scratch) can only add to one of them, so the smallest is the figure.
    shapes = [(1, 2 * t1), (1, t1)] * 3 + [(1, 2 * t1), (2, t1)] * 2
    group, model.row_group = model.row_group, 0   # the whole batch at once: group_saving's base
    try:
        for B, T in shapes:
            x = np.zeros((B, T), dtype=np.int32)
            model.forward(x, return_logits=False)
            model.backward(x)
            used.append(_heap_in_use() or 0)
    finally:
        model.row_group = group
    model.zero_grad()
    head = head_bytes(c["vocab_size"], 2 * t1) - head_bytes(c["vocab_size"], t1)
    grown = [used[i + 1] - used[i] - head for i in (1, 3, 5)]
    if min(grown) <= 0:
        return None
    per_seq = min(used[i + 1] - used[i] for i in (6, 8))
    return min(grown) // t1, max(per_seq, 0)


def rough_bytes_per_token(cfg: dict, recompute: bool = False) -> int:
    """A config-only figure for the activation bytes per token, the head's
    scratch aside: the binding's own (the bound RxPtModel.forward checks
    before it allocates), so the two never disagree."""
    return int(_core._act_bytes_per_token(cfg, recompute))


def head_bytes(vocab: int, tokens: int) -> int:
    """Bytes of the head's two [rows, vocab] scratch buffers for a step of
    `tokens` tokens (rows: the fixed budget's, or fewer tokens)."""
    return 8 * vocab * min(tokens, _core.head_chunk_rows(vocab))


# a drawn window: its start (8 B), its NumPy view (~100 B of object), and
# its tokens in four copies (read, int32, inputs, targets), 4 B each
WINDOW_OBJECT_BYTES = 128
WINDOW_TOKEN_COPIES = 4


def batch_bytes(sequences: int, seq_len: int) -> int:
    """Bytes of one step's drawn windows (rwkvx_c.data.sampler: the
    batch x grad-accum windows of seq_len + 1 tokens every optimiser step
    draws), before the model sees any."""
    return sequences * (WINDOW_OBJECT_BYTES + 4 * WINDOW_TOKEN_COPIES * (seq_len + 1))


def fits(need: int, available: int | None = None) -> bool:
    """True when need bytes fit in HEADROOM of the available memory (or
    when the available memory is unknown)."""
    avail = available_bytes() if available is None else available
    return avail is None or need <= HEADROOM * avail


def address_space_free() -> int | None:
    """What this process's address-space limit (RLIMIT_AS, `ulimit -v`)
    leaves: the limit less the address space in use (VmSize); None without
    a limit or where it cannot be read."""
    try:
        import resource
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/status") as f:
            used = next(int(x.split()[1]) << 10 for x in f if x.startswith("VmSize:"))
    except (ImportError, OSError, StopIteration, ValueError):
        return None
    return max(int(limit) - used, 0)


def available_bytes() -> int | None:
    """What this process may still allocate: the smallest of MemAvailable
    (/proc/meminfo), its cgroup's remaining limit (v2 memory.max -
    memory.current, v1 memory.limit_in_bytes - memory.usage_in_bytes; both
    rwkvx_c._core.available_memory, which the model's own allocation checks
    read too) and what its address-space limit leaves; None where none is known."""
    known = [v for v in (_core.available_memory(), address_space_free()) if v is not None]
    return min(known) if known else None


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check(need: int, what: str, advice: str, available: int | None = None) -> None:
    """Raises MemoryTooSmall when need bytes exceed HEADROOM of the available memory."""
    if os.environ.get("RWKVX_NO_MEMCHECK"):
        return
    avail = available_bytes() if available is None else available
    if avail is not None and not fits(need, avail):
        raise MemoryTooSmall(f"{what} needs about {_gib(need)} but only {_gib(avail)} is "
                             f"available; {advice}")


def _step_need(model: RxPtModel, batch: int, seq_len: int, params: int,
               loading: int, groups_exact: bool | None = None) -> tuple[int, int, int] | None:
    """check_step's figure in the model's recompute mode: (bytes, activation
    bytes per token, per sequence), or None when the rough bound already
    fits (far from the limit: not worth the measuring steps)."""
    head = head_bytes(model.config["vocab_size"], batch * seq_len)
    rough = ROUGH_MARGIN * rough_bytes_per_token(model.config, model.recompute)
    if fits(params + max(loading, head + rough * batch * seq_len)):
        return None
    per_tok, per_seq = acts_bytes(model)
    # measured with the whole batch at once; row groups keep one block's
    # intermediates for a group only (RxPtModel.group_saving, the C sizes)
    acts = per_tok * batch * seq_len + per_seq * batch - \
        model.group_saving(batch, seq_len, groups_exact)
    return params + max(loading, head + acts), per_tok, per_seq


def check_step(model: RxPtModel, batch: int, seq_len: int, params: int | None = None,
               loading: int = 0, auto_recompute: bool = False,
               groups_exact: bool | None = None) -> None:
    """Raises MemoryTooSmall when a training step of batch x seq_len tokens
    (with params bytes of weights and what trains: by default the parameter
    copies of PARAM_COPIES; a fine-tune's own figure, rwkvx_c.train.base)
    would not fit. loading: bytes held only while the weights are read
    (a fine-tune's tensors in conversion), gone before the step's buffers
    exist: the peak is the larger of the two on top of params. The rough
    bound decides when the machine is far from the limit; near it the
    activation bytes are measured on the model (acts_bytes).
    auto_recompute (TrainOptions.grad_cp unset): a step that does not fit
    with every block's activations kept but does under activation recompute
    turns the model's recompute on, with an RwkvxWarning saying so.
    groups_exact: what the model's groups_exact will be in the step (a
    tune checked before its adapters exist; None: as it is now), for the
    row groups it then runs in (RxPtModel.row_group_of)."""
    if os.environ.get("RWKVX_NO_MEMCHECK"):
        return
    params = param_bytes(model.n_params) if params is None else params
    got = _step_need(model, batch, seq_len, params, loading, groups_exact)
    if got is None or fits(got[0]):
        return
    switched = auto_recompute and not model.recompute
    if switched:
        model.recompute = True
        lean = _step_need(model, batch, seq_len, params, loading, groups_exact)
        if lean is None or fits(lean[0]):
            avail = available_bytes()
            warnings.warn(RwkvxWarning(
                f"a step of batch {batch} x seq_len {seq_len} needs about {_gib(got[0])} with "
                f"every block's activations kept, but only {_gib(avail or 0)} is available: "
                f"activation recompute (--grad-cp) is on"
                + (f", about {_gib(lean[0])}" if lean else "")), stacklevel=2)
            return
        got = lean
    need, per_tok, per_seq = got
    advice = "lower --batch or --seq-len" + ("" if model.recompute else ", or add --grad-cp")
    try:
        check(need, f"a step of batch {batch} x seq_len {seq_len} ({per_tok:,} bytes of "
              f"activations per token and {per_seq:,} per sequence)", advice)
    except MemoryTooSmall:
        if switched:
            model.recompute = False   # as it came
        raise
