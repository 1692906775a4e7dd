"""Bounded memory before allocating, and no hangs or races: the cgroup's
limit counts, RxPtModel and its forward refuse sizes that do not fit with
the sizes named, World decodes millions of ids without a list of pieces,
a tiny time budget ends, one InferState is stepped by one thread at once."""
import os
import threading
import tracemalloc

import numpy as np
import pytest

import rwkvx_c as rx
from rwkvx_c import _core
from rwkvx_c.errors import RwkvxWarning
from rwkvx_c.model import memory
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.util.files import MAP_SPAN

from hostile import SMALL, corpus, python


def _tree(tmp_path, cgroup, files, avail_kb=8 << 20):
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text(cgroup)
    (tmp_path / "proc" / "meminfo").write_text(f"MemTotal: 99 kB\nMemAvailable: {avail_kb} kB\n")
    for rel, text in files.items():
        p = tmp_path / "sys" / "fs" / "cgroup" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(tmp_path)


def test_cgroup_v2_limit_counts(tmp_path):
    root = _tree(tmp_path, "0::/user.slice/job\n",
                 {"user.slice/job/memory.max": "1073741824\n",
                  "user.slice/job/memory.current": "536870912\n"})
    assert _core.cgroup_free_bytes(root) == 512 << 20
    assert _core.available_memory(root) == 512 << 20     # less than MemAvailable's 8 GiB


def test_cgroup_v2_hybrid_and_unlimited(tmp_path):
    root = _tree(tmp_path, "0::/\n", {"unified/memory.max": "max\n",
                                      "unified/memory.current": "5\n"})
    assert _core.cgroup_free_bytes(root) is None
    assert _core.available_memory(root) == 8 << 30


def test_cgroup_v1_limit_in_a_container(tmp_path):
    # the container's own cgroup is the mount root: the full path is absent
    root = _tree(tmp_path, "4:memory:/docker/abc\n0::/\n",
                 {"memory/memory.limit_in_bytes": str(3 << 30) + "\n",
                  "memory/memory.usage_in_bytes": str(1 << 30) + "\n"})
    assert _core.available_memory(root) == 2 << 30
    root2 = _tree(tmp_path / "b", "4:memory:/x\n",
                  {"memory/memory.limit_in_bytes": "9223372036854771712\n",
                   "memory/memory.usage_in_bytes": "7\n"}, avail_kb=1024)
    assert _core.available_memory(root2) == 1 << 20    # v1's "no limit" is no limit


def test_memory_check_reads_the_cgroup():
    assert memory.available_bytes() == _core.available_memory()
    avail = _core.meminfo_available_bytes()
    assert avail is None or memory.available_bytes() <= avail


def test_param_count_agrees_with_the_trainer_estimate():
    for name in ("tiny", "S", "M"):
        cfg = ModelConfig.preset(name).to_dict()
        assert _core._param_elems(cfg) == memory.estimate_params(cfg)


def test_one_formula_counts_the_weights(monkeypatch):
    """A full run's figure (PARAM_COPIES) and a fine-tune's (tune_bytes)
    both come from memory.weight_bytes."""
    from rwkvx_c.train import TrainOptions, base
    # a resume's mapped checkpoint: one span of it at a time, at most the whole file
    whole = memory.PARAM_COPIES + memory.CHECKPOINT_COPIES
    assert memory.param_bytes(10) == 4 * whole * 10
    assert memory.param_bytes(MAP_SPAN) == 4 * memory.PARAM_COPIES * MAP_SPAN + MAP_SPAN
    calls = []
    real = memory.weight_bytes
    monkeypatch.setattr(memory, "weight_bytes", lambda *a: calls.append(a) or real(*a))
    memory.param_bytes(10)
    m = rx.RxPtModel(ModelConfig.preset("tiny").to_dict(), init=False)
    opts = TrainOptions(preset="tiny", tune="state").resolved()
    base.tune_bytes(m, opts, [], "fp32")
    assert len(calls) == 3   # a fine-tune's held weights and its loading


def test_loading_and_the_step_peak_apart(monkeypatch):
    """A fine-tune's loading bytes (gone before the first step) and its
    step's buffers are not held at once: the check takes the larger on top
    of the held weights; a GGUF's blocks of the base's own dtype are copied
    in, so the largest tensor the loading counts is one converted."""
    from rwkvx_c.train import TrainOptions, base
    m = rx.RxPtModel(ModelConfig.preset("tiny").to_dict(), init=False)
    gib = 1 << 30
    monkeypatch.setattr(memory, "acts_bytes", lambda model: (gib // 200, 0))   # 0.5 GiB at T 100
    need = gib // 10 + gib   # the weights and the loading: more than the step's 0.5 GiB
    for room, fits in ((need + gib // 20, True), (need - gib // 20, False)):
        monkeypatch.setattr(memory, "available_bytes", lambda r=room: int(r / memory.HEADROOM))
        try:
            memory.check_step(m, 1, 100, params=gib // 10, loading=gib)
            assert fits   # the sum, 1.6 GiB, would not have
        except memory.MemoryTooSmall:
            assert not fits
    opts = TrainOptions(preset="tiny", tune="lora").resolved()
    names = [n for n in m.param_names if m.params[n].ndim == 2]
    largest = max(m.params[n].size for n in m.param_names)
    _, loading = base.tune_bytes(m, opts, names, "q8_0")
    assert loading == 4 * 2 * largest
    _, loading = base.tune_bytes(m, opts, names, "q8_0", raw=frozenset(names))
    assert loading == 4 * 2 * max(m.params[n].size for n in m.param_names if n not in names)


def test_a_model_too_big_is_refused_before_allocating(monkeypatch):
    monkeypatch.setattr(_core, "available_memory", lambda root="/": 1 << 30)
    cfg = dict(SMALL, n_embd=4096, n_head=64, head_size=64, ffn_dim=16384, n_rwkv_layer=24)
    with pytest.raises(MemoryError, match=r"RxPtModel .* needs about \d+\.\d GiB but only "
                                          r"1\.0 GiB is available"):
        rx.RxPtModel(cfg)


def test_a_forward_too_long_is_refused_before_allocating(monkeypatch):
    m = rx.RxPtModel(ModelConfig.preset("tiny").to_dict())
    monkeypatch.setattr(_core, "available_memory", lambda root="/": 2 << 30)
    x = np.zeros((1, 200_000), np.int32)
    with pytest.raises(MemoryError, match=r"a forward of 1 x 200000 tokens needs about 10\.4 GiB"):
        m.forward(x)
    m.forward(x[:, :64])   # the model is still usable


def test_a_model_too_big_in_a_real_process_is_one_error():
    """In a child: a model of twice what this machine has free is refused
    at once (no allocation, no SIGKILL)."""
    r = python("import rwkvx_c as rx\nfrom hostile import SMALL\n"
               "avail = rx.available_memory()\n"
               "L = int(2 * avail / (8 * 12.6e6)) + 1   # blocks of C = 1024, F = 4096\n"
               "try:\n    rx.RxPtModel(dict(SMALL, n_embd=1024, n_head=16, head_size=64, "
               "ffn_dim=4096, n_rwkv_layer=L))\nexcept MemoryError as e:\n"
               "    print('refused:', e)\n",
               timeout=60)
    assert r.returncode == 0 and "refused:" in r.stdout, r.stderr[-2000:]


def test_world_decode_of_millions_of_ids_without_a_list(tmp_path):
    pytest.importorskip("rwkv")
    from rwkvx_c.data.tokenizers import WorldTokenizer
    tok = WorldTokenizer()
    ids = np.random.default_rng(0).integers(0, 65530, 2_000_000).astype(np.int32)
    small = ids[:5000]
    assert tok.decode(small) == b"".join(tok._bytes[i] for i in small.tolist())
    tracemalloc.start()
    out = tok.decode(ids)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # the output (about 7 bytes an id) and its parts, plus a chunk's index
    # arrays; a list of 2M pieces alone takes 16 MB, their ints 56 MB more
    assert peak < 2 * len(out) + (16 << 20), (peak, len(out))


def test_a_tiny_time_budget_ends(tmp_path):
    for budget in ("1e-9", "1e-320"):
        r = python("from rwkvx_c.train.trainer import Trainer\n"
                   "from rwkvx_c.train.options import TrainOptions\nfrom hostile import SMALL\n"
                   f"tr = Trainer(TrainOptions(preset='tiny', data={corpus(str(tmp_path))!r}, "
                   "model=dict(SMALL), batch=2, seq_len=16, eval_tokens=32, "
                   f"time_budget={budget}, cache_dir={str(tmp_path / 'c')!r}), None)\n"
                   "print(tr.run(), tr.step_count)", timeout=60)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip().endswith(" 1")


def test_one_infer_state_two_threads():
    """2 threads x 1000 steps on one state: every step is either taken or
    refused with RuntimeError, never lost (the position counts them)."""
    m = rx.RxPtModel(dict(SMALL, n_attn_layer=0))
    st = rx.InferState(m, 8)
    taken, refused = [0, 0], [0, 0]
    tok = np.array([1], np.int32)

    def work(k):
        for _ in range(1000):
            try:
                st.forward(tok)
                taken[k] += 1
            except RuntimeError as e:
                assert "another thread" in str(e)
                refused[k] += 1

    ts = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert st.pos == sum(taken) and sum(taken) + sum(refused) == 2000
    assert os.environ.get("RWKVX_NO_MEMCHECK") is None


def test_an_unset_grad_cp_turns_recompute_on_only_where_that_alone_fits(monkeypatch):
    """TrainOptions.grad_cp unset (auto_recompute): a step that fits with
    every block's activations kept leaves recompute off; one that fits only
    under recompute turns it on, with a warning naming both figures; one
    that fits in neither is refused with the recompute figure (no "add
    --grad-cp") and the model left as it came; grad_cp false
    (auto_recompute off) is refused with that advice, as before."""
    m = rx.RxPtModel(ModelConfig.preset("tiny").to_dict(), init=False)
    gib = 1 << 30
    # 1 GiB of activations at T 100 kept, a quarter of it under recompute;
    # the rough bound never decides (it would not fit)
    monkeypatch.setattr(memory, "acts_bytes",
                        lambda model: ((gib // 400 if model.recompute else gib // 100), 0))
    monkeypatch.setattr(memory, "rough_bytes_per_token", lambda cfg, recompute=False: gib)
    params = gib // 10
    head = memory.head_bytes(m.config["vocab_size"], 100)
    full, lean = params + head + gib, params + head + gib // 4

    def room(r):
        monkeypatch.setattr(memory, "available_bytes", lambda: int(r / memory.HEADROOM) + 1)

    room(full)
    memory.check_step(m, 1, 100, params=params, auto_recompute=True)
    assert not m.recompute
    room(full - gib // 8)
    with pytest.warns(RwkvxWarning, match=r"activation recompute \(--grad-cp\) is on"):
        memory.check_step(m, 1, 100, params=params, auto_recompute=True)
    assert m.recompute
    m.recompute = False
    room(lean - gib // 16)
    with pytest.raises(memory.MemoryTooSmall) as e:
        memory.check_step(m, 1, 100, params=params, auto_recompute=True)
    assert "--grad-cp" not in str(e.value) and not m.recompute
    room(full - gib // 8)
    with pytest.raises(memory.MemoryTooSmall, match="or add --grad-cp"):
        memory.check_step(m, 1, 100, params=params)
    assert not m.recompute
