"""The C error convention seen from Python: a C failure code becomes an
exception in one place (_check_rc), RX_EINVAL / RX_ECONFIG a ValueError and
RX_ENOMEM a MemoryError, carrying the C side's rx_last_error() message
(tests/c/test_errors.c checks the codes and messages themselves)."""
import os

import numpy as np
import pytest

import rwkvx_c as rx
from rwkvx_c._core import ByteTrie

CFG = dict(n_embd=64, n_head=4, head_size=16, n_rwkv_layer=1, n_attn_layer=1, vocab_size=64,
           ffn_dim=64, Dw=4, Da=4, Dg=4, Dv=4, chunk_size=4, moba_top_k=1)


def test_config_error_carries_the_c_message():
    # every field passes the Python checks; only the C validation sees the size
    with pytest.raises(ValueError, match=r"rx_pt_config_validate: config too large: "
                                         r"a \[64, 1073741824\] parameter tensor"):
        rx.RxPtModel(dict(CFG, vocab_size=2 ** 30))


def test_invalid_argument_carries_the_c_message():
    entries = [(bytes([i]), i) for i in range(255)] + [(b"ab", 300)]
    with pytest.raises(ValueError, match="rx_trie_build: byte 0xff has no one-byte entry"):
        ByteTrie(entries, 400)


def _unmappable(nbytes):
    """True when this kernel refuses to map nbytes at once: its overcommit
    policy checks a request against RAM + swap and nbytes exceeds them."""
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            policy = int(f.read())
        with open("/proc/meminfo") as f:
            kib = {ln.split(":")[0]: int(ln.split()[1]) for ln in f if ln.split()[-1] == "kB"}
    except (OSError, ValueError, IndexError):
        return False
    return policy in (0, 2) and nbytes > 2 * 1024 * (kib["MemTotal"] + kib["SwapTotal"])


def test_out_of_memory_is_a_memory_error():
    # the attention key cache alone: max_len * n_embd floats, 512 GiB
    L = 2 ** 31 - 1
    if not _unmappable(L * CFG["n_embd"] * 4) or os.environ.get("ASAN_OPTIONS"):
        pytest.skip("this kernel would map the cache (overcommit), so it cannot fail here")
    m = rx.RxPtModel(CFG)
    with pytest.raises(MemoryError, match=f"rx_infer_create: out of memory for max_len = {L}"):
        rx.InferState(m, max_len=L)
    # the failure left nothing behind: the model still runs
    assert m.forward(np.arange(8, dtype=np.int32)).shape == (8, CFG["vocab_size"])
