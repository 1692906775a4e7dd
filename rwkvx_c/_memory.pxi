# Memory the process may still use, and the checks RxPtModel makes before it
# allocates (docs/training.md §Memory). Included by _core.pyx before _model.pxi.
#
# The C core allocates with calloc, which Linux grants lazily: a model or an
# activation buffer larger than the machine is handed out, then filled, and
# the kernel kills the process (SIGKILL, no message) part-way. So the
# binding compares the bytes with what is available first and raises
# MemoryError naming both. "Available" is the smaller of the kernel's
# MemAvailable and what the process's cgroup (v2 memory.max - memory.current,
# v1 memory.limit_in_bytes - memory.usage_in_bytes) still allows: a
# container's limit is invisible in /proc/meminfo.
import os as _mem_os

# fraction of the available memory one allocation may take: Python, NumPy
# and the OS need the rest (rwkvx_c.model.memory.HEADROOM is the same)
ALLOC_HEADROOM = 0.9
_UNLIMITED = 1 << 62


def _read_int(path):
    try:
        with open(path) as f:
            s = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if s == "max":
        return _UNLIMITED
    try:
        return int(s)
    except ValueError:
        return None


def cgroup_free_bytes(root="/"):
    """Bytes the process's cgroup still allows (limit - usage; v2 and v1),
    or None when it has no limit or none can be read. root: where /proc
    and /sys are (tests point it at a fake tree)."""
    try:
        with open(_mem_os.path.join(root, "proc/self/cgroup")) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    free = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, path = parts
        rel = path.lstrip("/")
        if ctrls == "":   # v2: the unified hierarchy (under unified/ on a hybrid system)
            bases = ("sys/fs/cgroup", "sys/fs/cgroup/unified")
            names = ("memory.max", "memory.current")
        elif "memory" in ctrls.split(","):
            bases = ("sys/fs/cgroup/memory",)
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        # a container sees its own cgroup as the root of the mount: try the
        # full path, then the mount root
        for d in [_mem_os.path.join(root, b, *([rel] if rel else [])) for b in bases] + \
                [_mem_os.path.join(root, b) for b in bases if rel]:
            limit, used = (_read_int(_mem_os.path.join(d, n)) for n in names)
            if limit is not None and used is not None:
                if limit < _UNLIMITED // 2:   # v1 writes "no limit" as a huge number
                    free.append(max(limit - used, 0))
                break
    return min(free) if free else None


def meminfo_available_bytes(root="/"):
    """MemAvailable of /proc/meminfo, or None."""
    try:
        with open(_mem_os.path.join(root, "proc/meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory(root="/"):
    """Bytes this process may still allocate: the smaller of MemAvailable
    and its cgroup's remaining limit; None when neither is known."""
    known = [v for v in (meminfo_available_bytes(root), cgroup_free_bytes(root))
             if v is not None]
    return min(known) if known else None


def _check_alloc(need, what, advice):
    """MemoryError naming the sizes when need bytes exceed ALLOC_HEADROOM of
    the available memory (RWKVX_NO_MEMCHECK=1 turns the check off)."""
    if _mem_os.environ.get("RWKVX_NO_MEMCHECK"):
        return
    avail = available_memory()
    if avail is not None and need > ALLOC_HEADROOM * avail:
        raise MemoryError(f"{what} needs about {need / 2**30:.1f} GiB but only "
                          f"{avail / 2**30:.1f} GiB is available; {advice}")


def _param_elems(dict config):
    """An upper estimate of a config's parameter elements (the count of
    rwkvx_c.model.memory.estimate_params; tests/test_surfaces.py keeps the two
    equal)."""
    C, V, F = config["n_embd"], config["vocab_size"], config["ffn_dim"]
    lora = config["Dw"] + config["Da"] + config["Dg"] + config["Dv"]
    per_block = 4 * C * C + 2 * C * F + 32 * C
    return (2 * V * C + 2 * C + config["n_rwkv_layer"] * (per_block + 2 * C * lora)
            + config["n_attn_layer"] * per_block)


def _act_bytes_per_token(dict config, bint recompute=False):
    """Activation bytes one token of a step keeps, the head's fixed scratch
    aside (rwkvx_c.model.memory.rough_bytes_per_token is this figure):
    every block's intermediates (~24 C + 2 F floats each), or under
    recompute the layout of docs/performance.md §Long contexts: the kept
    block inputs and the model's residual grads ((n_blocks + 6) C), one
    region for the lean set of one RWKV block (16 C, its LoRA hiddens, the
    bonus sums and the WKV7 checkpoints) or of one attention block, one
    block backward's scratch, each attention block's kept core products
    (its output, selection and log-sum-exp) and 4 C for the GEMM's packed
    operands."""
    nb = config["n_rwkv_layer"] + config["n_attn_layer"]
    C, F = config["n_embd"], config["ffn_dim"]
    if not recompute:
        return 4 * (nb * (24 * C + 2 * F) + (nb + 8) * C)
    H, N = config["n_head"], config["head_size"]
    lora = config["Dw"] + config["Da"] + config["Dg"] + config["Dv"]
    region = 16 * C + lora + H + H * N * N // 64   # the WKV7 checkpoints: RX_WKV7_CHUNK
    work = max(10 * C + lora + H, 3 * C + 2 * F)
    kept = 0
    if config["n_attn_layer"]:
        kk, cs = max(config["moba_top_k"], 0), config["chunk_size"]
        region = max(region, 8 * C + F + H * (2 * N // cs + 3 * kk + 2 + kk * N))
        work = max(work, 5 * C + F)
        kept = config["n_attn_layer"] * (C + H * (kk + 1))   # each one's core products
    return 4 * ((nb + 6) * C + region + 2 * C + work + 4 * C + kept)
