"""Row groups (docs/maths.md §Row groups, rx_pt_acts_create_groups): under
recompute a step runs each block over a few sequences at a time, so one
block's recomputed intermediates and backward scratch are sized for the
group. A LoRA tune (every other parameter frozen) keeps every bit: the
logits, the loss and the adapters' grads equal the whole batch's at 1 and 3
threads, over a float32 model and over Q8_0 and bf16 bases, in either
precision. Steps whose grads would change are refused in one line; the
automatic choice and the bytes it saves are the model's."""
import numpy as np
import pytest

import rwkvx_c as rx
from rwkvx_c.model.lora import TARGETS, target_params
from rwkvx_c.model.memory import _heap_in_use

from checks import token_batch

pytest.importorskip("gguf")   # the bases' byte formats are gguf's (tests/test_base.py)

# RWKV blocks only (an attention block's kept products are the whole batch's)
CFG = dict(n_embd=64, n_head=2, head_size=32, n_rwkv_layer=3, n_attn_layer=0, vocab_size=37,
           Dw=32, Da=32, Dg=32, Dv=32, ffn_dim=96, chunk_size=4, moba_top_k=3, ln0=1)
# T a multiple of 256, the GEMMs' k range: every group's rows are whole k ranges
B, T, IGNORE, R, ALPHA = 4, 256, 5, 4, 8.0


def _tune(base=None, precision="fp32", dora=False, seed=3, cfg=CFG):
    """A LoRA tune of a random model: adapters (random) on every
    projection, everything else frozen; its matrices in a base of dtype
    base (None: float32 in the arena)."""
    src = rx.RxPtModel(cfg, seed=seed)
    for n in src.param_names:
        if src.params[n].ndim == 2:
            src.params[n][...] *= 0.5   # a trained model's scale: decay gates in range
    m = rx.RxPtModel(cfg, seed=seed, precision=precision, recompute=True, init=False)
    m.param_buffer[...] = src.param_buffer
    if base:
        names = [n for n in m.param_names if m.params[n].ndim == 2]
        m.set_base(base, names)
        for n in names:
            m.base_fill(n, src.params[n])
    m.enable_lora(R, ALPHA, target_params(m.layers, tuple(TARGETS)), dora=dora)
    rng = np.random.default_rng(seed)
    m.lora_buffer[...] = rng.standard_normal(m.lora_buffer.shape).astype(np.float32) * 0.05
    m.frozen = True
    return m


def _step(m, group, threads, logits=False):
    tokens, targets = token_batch(CFG["vocab_size"], B, T, 7, IGNORE)
    m.row_group = group
    rx.set_num_threads(threads)
    try:
        out = m.forward(tokens, return_logits=logits)
        loss = m.backward(targets, ignore_index=IGNORE)
    finally:
        rx.set_num_threads(0)
    return out, loss, m.lora_grad_buffer.copy()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("base", [None, "q8_0", "bf16"])
def test_row_groups_give_the_whole_batchs_bits(base, precision):
    m = _tune(base, precision)
    assert m.groups_exact
    want = _step(m, 0, 1, logits=True)
    assert np.abs(want[2]).max() > 0
    for group, threads in ((1, 1), (2, 3), (1, 3)):
        got = _step(m, group, threads, logits=True)
        assert m.row_group_of(B, T) == group
        assert np.array_equal(got[0], want[0])   # logits
        assert got[1] == want[1]                 # loss
        assert np.array_equal(got[2], want[2])   # every adapter's grads
        # the chunked head (the trainer's): the same again
        assert _step(m, group, threads)[1:2] == _step(m, 0, threads)[1:2]


def test_a_group_after_the_first_adds_its_grads():
    """The grads of groups of one sequence are the sum over the sequences
    (each its own step): a group that wrote instead of adding would leave
    only the last sequence's."""
    m = _tune("q8_0")
    tokens, targets = token_batch(CFG["vocab_size"], B, T, 7, IGNORE)
    m.row_group = 1
    m.forward(tokens, return_logits=False)
    m.backward(targets, ignore_index=IGNORE)
    whole = m.lora_grad_buffer.copy()
    valid = (targets != IGNORE).sum()
    parts = np.zeros_like(whole, dtype=np.float64)
    for b in range(B):
        m.forward(tokens[b:b + 1], return_logits=False)
        m.backward(targets[b:b + 1], ignore_index=IGNORE)
        parts += m.lora_grad_buffer * ((targets[b] != IGNORE).sum() / valid)
    # sum of B float32 grads, each within a few ulp of its own exact value
    assert np.allclose(whole, parts, rtol=1e-4, atol=1e-6 * np.abs(parts).max())


def test_steps_whose_grads_would_change_are_refused():
    tokens, targets = token_batch(CFG["vocab_size"], B, T, 7, IGNORE)
    # a trainable parameter beside the adapters: its grad is summed over rows outside a GEMM
    m = _tune()
    m.frozen = False
    assert not m.groups_exact and m.row_group_of(B, T) == B   # automatic: the whole batch
    m.row_group = 1
    m.forward(tokens, return_logits=False)
    with pytest.raises(ValueError, match=r"row groups .* LoRA adapters"):
        m.backward(targets, ignore_index=IGNORE)
    # DoRA's magnitudes are such a grad too
    d = _tune(dora=True)
    assert not d.groups_exact
    # an attention block keeps its core products for the whole batch
    a = rx.RxPtModel(dict(CFG, n_attn_layer=1), seed=0, recompute=True)
    a.row_group = 1
    with pytest.raises(ValueError, match="without attention blocks"):
        a.forward(tokens, return_logits=False)
    with pytest.raises(ValueError, match="row_group"):
        a.row_group = -1


def test_the_automatic_choice():
    m = _tune("q8_0")
    assert m.row_group is None
    # the fewest sequences of GROUP_ROWS tokens or more, a multiple of GROUP_ALIGN
    assert m.row_group_of(8, 256) == 4 and m.row_group_of(8, 1024) == 1
    assert m.row_group_of(8, 512) == 2 and m.row_group_of(6, 512) == 2
    assert m.row_group_of(8, 100) == 8   # no aligned group: the whole batch
    assert m.row_group_of(3, 256) == 3   # no divisor of 3 reaches 1,024 tokens
    m.row_group = 3
    assert m.row_group_of(8, 256) == 2   # the largest divisor not above 3
    m.row_group = 0
    assert m.row_group_of(8, 1024) == 8 and m.group_saving(8, 1024) == 0
    m.row_group = None
    m.recompute = False
    assert m.row_group_of(8, 1024) == 8


@pytest.mark.skipif(_heap_in_use() is None, reason="needs glibc's mallinfo2")
def test_group_saving_is_what_the_step_keeps_fewer():
    """The bytes a grouped step's activations take fewer, by the heap
    (model.memory's measure), are group_saving's, within malloc's rounding."""
    m = _tune("q8_0")
    tokens, targets = token_batch(CFG["vocab_size"], 8, T, 7, IGNORE)
    held = {}
    for group in (0, 1):
        m.row_group = group
        m.forward(tokens, return_logits=False)
        m.backward(targets, ignore_index=IGNORE)
        held[group] = _heap_in_use()
    m.row_group = 1
    saving = m.group_saving(8, T)
    assert saving > 0
    assert abs((held[0] - held[1]) - saving) <= 0.02 * saving


def _routes(tmp_path, capsys, pth, group):
    """The losses of a 3-step LoRA tune of pth under --grad-cp at batch 4
    x 128 (two sequences: 256 tokens, one k range) with row_group group,
    from TrainOptions, the command line and a config file, and the first
    one's trainer."""
    import json

    from test_base import _tune_losses

    from rwkvx_c.cli import main
    kw = dict(tune="lora", steps=3, batch=4, seq_len=128, eval_tokens=32, grad_cp=True,
              base_dtype="q8_0")
    tr, losses = _tune_losses(tmp_path, pth, f"o{group}", row_group=group, **kw)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    flags = ["--init-from", pth, "--tune", "lora", "--data", str(corpus), "--cache-dir",
             str(tmp_path / "cache"), "--steps", "3", "--batch", "4", "--seq-len", "128",
             "--eval-tokens", "32", "--grad-cp", "--base-dtype", "q8_0", "--threads", "2",
             "--no-progress", "--row-group", str(group)]
    assert main(["train", *flags, "--out", str(tmp_path / f"c{group}")]) == 0
    cfg = tmp_path / f"run{group}.toml"
    cfg.write_text(f'init_from = "{pth}"\ntune = "lora"\nbase_dtype = "q8_0"\n'
                   f'data = "{corpus}"\ncache_dir = "{tmp_path / "cache"}"\nsteps = 3\n'
                   f'batch = 4\nseq_len = 128\neval_tokens = 32\ngrad_cp = true\nthreads = 2\n'
                   f'row_group = {group}\n')
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / f"f{group}"),
                 "--no-progress"]) == 0
    capsys.readouterr()
    runs = [losses]
    for run in (f"c{group}", f"f{group}"):
        with open(tmp_path / run / "log.jsonl") as f:
            runs.append([r["loss"] for r in map(json.loads, f) if "loss" in r])
    return tr, runs


def test_row_group_from_every_route_trains_the_whole_batchs_losses(tmp_path, capsys):
    from test_base import _bf16_pth
    pth = _bf16_pth(tmp_path)
    tr0, whole = _routes(tmp_path, capsys, pth, 0)
    assert tr0.model.row_group == 0 and tr0.model.row_group_of(4, 128) == 4
    tr, grouped = _routes(tmp_path, capsys, pth, 2)
    assert tr.model.row_group == 2 and tr.model.row_group_of(4, 128) == 2
    # each route's losses bit for bit (the command line and the file are one run)
    assert len(whole[0]) == 3 and grouped == whole and whole[1] == whole[2]


def test_row_group_where_it_cannot_hold_is_refused(tmp_path):
    from test_base import _bf16_pth, _tune_losses

    from rwkvx_c.train import TrainError
    pth = _bf16_pth(tmp_path)
    for kw, why in ((dict(tune="lora", grad_cp=False), "without --grad-cp"),
                    (dict(tune="state", grad_cp=True, unfreeze_at=2), "past --unfreeze-at"),
                    (dict(tune="state", grad_cp=True), "drop --row-group"),
                    (dict(tune="lora", adapter="dora", grad_cp=True), "drop --row-group")):
        with pytest.raises(TrainError, match=why):
            _tune_losses(tmp_path, pth, "bad", steps=1, row_group=1, **kw)
