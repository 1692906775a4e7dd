"""Memory a decode step streams whole sits on transparent huge pages where
the kernel gives them on request (csrc/cpu.c's rx_advise_huge): a model's
parameter arena when every parameter is written (made with init, or
dense=True: a whole model read from a file, as sample.load_model reads a
run without a base), a frozen base's store; never a lazily mapped arena
that a base leaves mostly unwritten, where a huge page would take 2 MiB at
a small tensor's first write. Read from /proc/self/smaps: the mapping's
VmFlags "hg" is the MADV_HUGEPAGE request itself (whether the kernel then
finds free huge pages is its own affair, so the test never asks)."""
import os

import numpy as np
import pytest

import rwkvx_c as rx

SMAPS = "/proc/self/smaps"
pytestmark = pytest.mark.skipif(not os.path.exists(SMAPS), reason="no /proc/self/smaps")

# an arena of a few MiB (the huge pages start at 2 MiB)
CFG = dict(n_embd=256, n_head=4, head_size=64, n_rwkv_layer=2, n_attn_layer=0,
           vocab_size=256, Dw=32, Da=32, Dg=32, Dv=32, ffn_dim=1024, chunk_size=16,
           moba_top_k=2)


def _advised(addr):
    """whether the mapping holding addr asks for huge pages (None: the
    kernel does not report VmFlags)"""
    inside = False
    with open(SMAPS) as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    return None


def _arena(m):
    return m.param_buffer.ctypes.data + m.param_buffer.nbytes // 2


def _flags_reported():
    if _advised(np.zeros(1).ctypes.data) is None:
        pytest.skip("the kernel reports no VmFlags")


def test_a_dense_or_initialised_arena_asks_for_huge_pages():
    _flags_reported()
    assert _advised(_arena(rx.RxPtModel(CFG, init=False, dense=True)))
    assert _advised(_arena(rx.RxPtModel(CFG)))


def test_a_lazy_arena_keeps_small_pages():
    """A model a base will hold stays 4 KiB pages: its slots stay unmapped."""
    _flags_reported()
    m = rx.RxPtModel(CFG, init=False)
    assert not _advised(_arena(m))
    assert not _advised(m.grad_buffer.ctypes.data + m.grad_buffer.nbytes // 2)


def test_a_run_loaded_whole_is_dense(tmp_path):
    """sample.load_model of a run (every parameter read from its file) asks
    for huge pages: the route `rwkvx-c sample` and the engine take."""
    _flags_reported()
    from rwkvx_c.sample import load_model
    from rwkvx_c.train.options import TrainOptions
    from rwkvx_c.train.trainer import Trainer

    from hostile import corpus
    out = str(tmp_path / "run")
    Trainer(TrainOptions(preset="tiny", data=corpus(str(tmp_path)), model=CFG, batch=1,
                         seq_len=16, steps=1, eval_tokens=16, threads=2), out).run()
    m = load_model(out)
    assert m.param_buffer.nbytes >= 2 << 20, "the arena below one huge page tests nothing"
    assert _advised(_arena(m))
