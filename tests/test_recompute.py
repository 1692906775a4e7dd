"""Bounded memory (docs/maths.md §Chunked head, §Recompute, §L2Wrap): activation
recompute gives the same loss and grads bit for bit; the chunked head and
loss against the float64 reference, chunk boundaries cutting a row block
included; L2Wrap's gradient against a float64 reference checked by finite
differences; and peak-memory probes, in a fresh process, that fail when a
[B*T, vocab] or an every-block activation buffer comes back."""
import os
import subprocess
import sys

import numpy as np
import pytest

import rwkvx_c as rx

from checks import FWD_TOL, GRAD_TOL, assert_rel, rand
from reference.autograd import fd_grad, leaf
from reference.layers import cross_entropy, head, l2wrap_penalty

# odd sizes: C and heads off the vector widths, T off the chunk size
BASE = dict(n_embd=24, n_head=3, head_size=8, n_rwkv_layer=3, n_attn_layer=0, vocab_size=37,
            Dw=4, Da=4, Dg=6, Dv=3, ffn_dim=40, chunk_size=4, moba_top_k=1, ln0=1)
PATTERNS = {"rwkv_only": BASE, "3R1A": dict(BASE, n_attn_layer=1, moba_top_k=2),
            "5R2A": dict(BASE, n_rwkv_layer=5, n_attn_layer=2)}
# large enough that norms, GEMMs and the loss take their threaded paths
WIDE = dict(n_embd=128, n_head=2, head_size=64, n_rwkv_layer=2, n_attn_layer=1,
            vocab_size=301, Dw=16, Da=16, Dg=32, Dv=8, ffn_dim=256, chunk_size=32,
            moba_top_k=2, ln0=1)


def _batch(cfg, B, T, seed):
    rng = np.random.default_rng(seed)
    V = cfg["vocab_size"]
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    y = rng.integers(0, V, (B, T)).astype(np.int32)
    y[:, 1] = 5   # ignored below
    return x, y


def _step(cfg, x, y, *, precision, recompute, logits, l2wrap=0.0):
    m = rx.RxPtModel(cfg, seed=3, precision=precision, recompute=recompute, l2wrap=l2wrap)
    m.forward(x, return_logits=logits)
    loss = m.backward(y, ignore_index=5)
    again = m.backward(y, ignore_index=5)   # a second backward of one forward
    assert again == loss
    return loss, m.loss(y, ignore_index=5), m.grad_buffer.copy()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_recompute_is_bitwise(name, precision, restore_threads):
    cfg = PATTERNS[name]
    x, y = _batch(cfg, 2, 13, 1)
    rx.set_num_threads(1)
    ref = _step(cfg, x, y, precision=precision, recompute=False, logits=True)
    assert ref[0] == ref[1]
    for threads in (1, 2, 3):
        rx.set_num_threads(threads)
        for logits in (True, False):
            got = _step(cfg, x, y, precision=precision, recompute=True, logits=logits)
            assert got[0] == ref[0] and got[1] == ref[0], (threads, logits)
            assert np.array_equal(got[2], ref[2]), (threads, logits)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recompute_is_bitwise_threaded(precision, restore_threads):
    x, y = _batch(WIDE, 3, 67, 2)
    rx.set_num_threads(2)
    ref = _step(WIDE, x, y, precision=precision, recompute=False, logits=True, l2wrap=1e-4)
    for threads in (1, 2):
        rx.set_num_threads(threads)
        got = _step(WIDE, x, y, precision=precision, recompute=True, logits=False, l2wrap=1e-4)
        assert got[0] == ref[0] and np.array_equal(got[2], ref[2]), threads


def test_recompute_and_l2wrap_settable_and_checked():
    m = rx.RxPtModel(BASE)
    assert m.recompute is False and m.l2wrap == 0.0
    m.recompute, m.l2wrap = True, 1e-4
    assert m.recompute is True and m.l2wrap == 1e-4
    with pytest.raises(TypeError, match="recompute"):
        m.recompute = 1
    for bad in (-1e-4, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="l2wrap"):
            m.l2wrap = bad
    with pytest.raises(ValueError, match="no forward"):
        rx.RxPtModel(BASE).loss(np.zeros(3, np.int32))


def test_loss_leaves_the_grads():
    x, y = _batch(BASE, 2, 9, 4)
    m = rx.RxPtModel(BASE, seed=1)
    m.forward(x, return_logits=False)
    loss = m.backward(y)
    g = m.grad_buffer.copy()
    m.forward(x[:, ::-1].copy(), return_logits=False)
    assert m.loss(y) != loss
    assert np.array_equal(m.grad_buffer, g)


# ------------------------------------------------------------- chunked head

def _reference(x, w, y, ignore_index, l2wrap):
    """(loss, dx, d_head) in float64: CE of x . w, its grads plus L2Wrap's."""
    xs, ws = leaf(x), leaf(w)
    logits = head(xs, ws)
    loss = cross_entropy(logits, y, ignore_index)
    total = loss + l2wrap_penalty(logits, l2wrap) if l2wrap else loss
    total.backward()
    return loss.value, xs.grad, ws.grad


@pytest.mark.parametrize("l2wrap", [0.0, 1e-4, 0.05])
@pytest.mark.parametrize("rows", [1, 7, 8, 13, 100, 301])
def test_chunked_head_matches_reference(rows, l2wrap):
    # T = 301 has row blocks of 8 (rx_block_rows): chunks of 7, 13 and 100
    # rows cut them, 8 follows them, 1 and 301 are the extremes
    rng = np.random.default_rng([rows, int(l2wrap * 1e5)])
    T, C, V = 301, 19, 53
    x, w = rand(rng, T, C), rand(rng, C, V, scale=1.5)
    y = rng.integers(0, V, T).astype(np.int32)
    y[::11] = 4
    loss, dx, dh = rx.head_loss(x, w, y, rows=rows, ignore_index=4, l2wrap=l2wrap)
    rl, rdx, rdh = _reference(x, w, y, 4, l2wrap)
    assert_rel("head_loss loss", loss, rl, FWD_TOL)
    assert_rel("head_loss dx", dx, rdx, GRAD_TOL)
    assert_rel("head_loss d_head", dh, rdh, GRAD_TOL)
    assert rx.head_loss(x, w, y, rows=rows, ignore_index=4, grads=False) == loss


@pytest.mark.parametrize("rows", [1, 7, 256, 512, 1000])
def test_chunked_head_bits_against_the_unchunked(rows, restore_threads):
    """The loss and dx have the unchunked bits at any chunk size; d_head too
    when rows is a multiple of the fp32 GEMM's K block (docs/maths.md
    §Chunked head), else to rounding."""
    rng = np.random.default_rng(rows)
    T, C, V = 1031, 67, 513
    x, w = rand(rng, T, C), rand(rng, C, V, scale=0.3)
    y = rng.integers(0, V, T).astype(np.int32)
    loss0, dl = rx.cross_entropy_backward(rx.head_forward(x, w), y)
    dx0, dh0 = rx.head_backward(x, w, dl)
    for threads in (1, 2):
        rx.set_num_threads(threads)
        loss, dx, dh = rx.head_loss(x, w, y, rows=rows)
        assert loss == loss0 and np.array_equal(dx, dx0)
        if rows % 256 == 0:
            assert np.array_equal(dh, dh0)
        else:
            assert_rel("head_loss d_head vs unchunked", dh, dh0, 1e-5)


def test_default_chunk_rows():
    assert rx.head_chunk_rows(4096) == 2048
    assert rx.head_chunk_rows(65536) == 128
    assert rx.head_chunk_rows(300) == (2 ** 23 // 300) // 256 * 256
    assert rx.head_chunk_rows(2 ** 30) == 1


def test_l2wrap_reference_by_finite_differences():
    rng = np.random.default_rng(7)
    logits = rand(rng, 5, 9, scale=2.0).astype(np.float64)
    ls = leaf(logits)
    l2wrap_penalty(ls, 0.3).backward()
    for idx in [(0, int(np.argmax(logits[0]))), (3, int(np.argmax(logits[3]))), (2, 0)]:
        fd = fd_grad(lambda v: l2wrap_penalty(leaf(v), 0.3).value, [logits], 0, idx)
        assert abs(fd - ls.grad[idx]) <= 1e-7, idx


def test_l2wrap_adds_the_documented_grad():
    # the model's own grads: L2Wrap changes the head and the blocks' grads,
    # not the loss, by the reference amount on the head
    cfg = dict(BASE, n_rwkv_layer=1)
    x, y = _batch(cfg, 2, 9, 8)
    m = rx.RxPtModel(cfg, seed=2)
    logits = m.forward(x).reshape(-1, cfg["vocab_size"])
    base = m.backward(y)
    g0 = m.grads["head"].copy()
    m.l2wrap = 0.01
    assert m.backward(y) == base
    h = rx.head_forward(np.zeros((1, cfg["n_embd"]), np.float32), m.params["head"])   # shape only
    assert h.shape == (1, cfg["vocab_size"])
    lnout = np.linalg.lstsq(m.params["head"].T.astype(np.float64),
                            logits.T.astype(np.float64), rcond=None)[0].T
    ls = leaf(logits)
    l2wrap_penalty(ls, 0.01).backward()
    assert_rel("l2wrap d_head", m.grads["head"] - g0, lnout.T @ ls.grad, 1e-3)


def test_head_loss_bad_inputs():
    x, w, y = np.zeros((4, 3), np.float32), np.zeros((3, 5), np.float32), np.zeros(4, np.int32)
    with pytest.raises(ValueError, match="rows"):
        rx.head_loss(x, w, y, rows=-1)
    with pytest.raises(ValueError, match="l2wrap"):
        rx.head_loss(x, w, y, l2wrap=-1.0)
    with pytest.raises(ValueError, match="targets"):
        rx.head_loss(x, w, np.full(4, 9, np.int32))
    with pytest.raises(ValueError, match=r"\bhead\b"):
        rx.head_loss(x, np.zeros((4, 5), np.float32), y)


# ------------------------------------------------------------- peak memory

_PROBE = """
import sys, numpy as np, rwkvx_c as rx
from rwkvx_c.model import memory
cfg, B, T, recompute = %r, %d, %d, %r
m = rx.RxPtModel(cfg, recompute=recompute)
x = np.zeros((B, T), np.int32)
if memory._heap_in_use() is None:
    print("skip"); sys.exit(0)
small = np.zeros((1, cfg["chunk_size"]), np.int32)
for t in (x, small):   # the threads' scratch, malloc's arenas: not per step
    m.forward(t, return_logits=False); m.backward(t)
h0 = memory._heap_in_use()
m.forward(x, return_logits=False); m.backward(x)
print(memory._heap_in_use() - h0)
"""


def _heap_growth(cfg, B, T, recompute):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # from tests/: in the repository root a non-editable install's source
    # tree would shadow the installed package
    r = subprocess.run([sys.executable, "-c", _PROBE % (cfg, B, T, recompute)], env=env,
                       capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
    assert r.returncode == 0, r.stderr[-2000:]
    if r.stdout.strip() == "skip":
        pytest.skip("no mallinfo2")
    return int(r.stdout.split()[-1])


def test_training_step_holds_no_logits():
    """A step at V = 65,536 grows the heap by less than one [B*T, V] float
    buffer: the logits and their grad (2 x 256 MiB here) never exist."""
    cfg = dict(WIDE, vocab_size=65536, n_attn_layer=0)
    B, T = 4, 256
    grown = _heap_growth(cfg, B, T, False)
    assert grown < 4 * B * T * cfg["vocab_size"], grown


def test_recompute_holds_one_block():
    """Under recompute a step keeps the block inputs and one block's
    intermediates: at 8 RWKV blocks it grows the heap by under a third of
    the every-block figure (which a full-activation buffer would bring back)."""
    cfg = dict(WIDE, n_rwkv_layer=8, n_attn_layer=0)
    full = _heap_growth(cfg, 1, 1024, False)
    rec = _heap_growth(cfg, 1, 1024, True)
    assert rec < full / 3, (rec, full)


@pytest.mark.parametrize("attn", [0, 2])
def test_recompute_keeps_the_lean_layout(attn):
    """The heap a recompute step grows by stays within the lean layout's
    figure (docs/performance.md §Long contexts, the estimate the memory
    check uses), which holds no lerp, no zg, no channel-mix buffer outside
    the block scratch and no attention scratch outside the shared region:
    one more [B*T, C] buffer per block (8 C floats a token here, a quarter
    of the figure) would cross it."""
    from rwkvx_c.model.memory import head_bytes
    cfg = dict(WIDE, n_rwkv_layer=8, n_attn_layer=attn, ln0=0)
    T = 1024
    # the difference of two lengths: what a token costs, without the fixed
    # scratch (WKV7 states, row-block sums) and the head's rows
    grown = _heap_growth(cfg, 1, 2 * T, True) - _heap_growth(cfg, 1, T, True)
    per_tok = (grown - head_bytes(cfg["vocab_size"], 2 * T) +
               head_bytes(cfg["vocab_size"], T)) / T
    lean = rx._core._act_bytes_per_token(cfg, True)
    per_block = 4 * cfg["n_embd"] * (cfg["n_rwkv_layer"] + attn)
    assert per_tok <= lean < per_tok + per_block, (per_tok, lean, per_block)


# ------------------------------------------------------------- the trainer

def _train_opts(tmp_path, **kw):
    from rwkvx_c.train import TrainOptions
    p = tmp_path / "corpus.txt"
    if not p.exists():
        words = ["def", "return", "self", "import", "class", "for", "in", "if", "(", ")", ":"]
        p.write_text(" ".join(np.random.default_rng(0).choice(words, 6000)))
    base = dict(preset="tiny", data=str(p), model=dict(BASE, n_attn_layer=1, vocab_size=256),
                batch=2, seq_len=24, steps=4, eval_tokens=96, warmup_steps=1, lr=3e-3,
                threads=2, cache_dir=str(tmp_path / "cache"))
    return TrainOptions(**{**base, **kw})


def _run(tr, until):
    return [tr.step()["loss"] for _ in range(until - tr.step_count)]


def test_grad_cp_trains_the_same_and_resumes_without_it(tmp_path):
    from rwkvx_c.train import Trainer
    plain = Trainer(_train_opts(tmp_path), str(tmp_path / "plain"))
    want, want_eval = _run(plain, 4), plain.evaluate()
    cp = Trainer(_train_opts(tmp_path, grad_cp=True), str(tmp_path / "cp"))
    assert cp.model.recompute
    first = _run(cp, 2)
    cp.save()
    del cp
    resumed = Trainer.resume(str(tmp_path / "cp"), grad_cp=False)   # a resumable option
    assert not resumed.model.recompute
    assert first + _run(resumed, 4) == want   # bit for bit
    assert resumed.evaluate() == want_eval


def test_l2wrap_option(tmp_path):
    from rwkvx_c.train import Trainer, TrainError
    with pytest.raises(TrainError, match="l2wrap"):
        Trainer(_train_opts(tmp_path, l2wrap=-1e-4), None)
    with pytest.raises(TrainError, match="grad_cp"):
        Trainer(_train_opts(tmp_path, grad_cp="yes"), None)
    a = _run(Trainer(_train_opts(tmp_path), None), 3)
    tr = Trainer(_train_opts(tmp_path, l2wrap=0.5), str(tmp_path / "run"))
    assert tr.model.l2wrap == 0.5
    b = _run(tr, 3)
    assert a[0] == b[0] and a[1:] != b[1:]   # a grad-only term: the first loss is the same
    tr.save()
    tr.close()
    with pytest.raises(TrainError, match="l2wrap"):   # it changes what a run computes
        Trainer.resume(str(tmp_path / "run"), l2wrap=0.1)


def test_cli_flags(tmp_path):
    from rwkvx_c.cli import build_parser
    a = build_parser().parse_args(["train", "--grad-cp", "--l2wrap", "1e-4"])
    assert a.grad_cp is True and a.l2wrap == 1e-4
    a = build_parser().parse_args(["train"])
    assert a.grad_cp is None and a.l2wrap is None


def test_an_unset_grad_cp_follows_the_memory_check(tmp_path, monkeypatch):
    """--grad-cp unset (the default of TrainOptions and the command line): a
    run whose step fits only under recompute turns it on with a warning;
    grad_cp = false in a config file (or TrainOptions) refuses as before."""
    from dataclasses import fields

    from rwkvx_c.errors import RwkvxWarning
    from rwkvx_c.model import memory
    from rwkvx_c.train import Trainer, TrainError, TrainOptions, options_from_file
    assert TrainOptions().grad_cp is None
    gib = 1 << 30
    tokens = 2 * 24   # the options' batch x seq_len
    # 1 GiB of activations kept, a quarter under recompute; 0.6 GiB available
    monkeypatch.setattr(memory, "acts_bytes", lambda model: (
        (gib // 4 if model.recompute else gib) // tokens, 0))
    monkeypatch.setattr(memory, "rough_bytes_per_token", lambda cfg, recompute=False: gib)
    monkeypatch.setattr(memory, "available_bytes", lambda: int(0.6 * gib / memory.HEADROOM))
    with pytest.warns(RwkvxWarning, match=r"recompute \(--grad-cp\) is on"):
        tr = Trainer(_train_opts(tmp_path), None)
    assert tr.model.recompute
    tr.close()
    cfg = tmp_path / "run.toml"
    cfg.write_text("grad_cp = false\n")
    o = _train_opts(tmp_path)
    given = {f.name: getattr(o, f.name) for f in fields(o)
             if f.name != "grad_cp" and getattr(o, f.name) is not None}
    with pytest.raises(TrainError, match="or add --grad-cp"):
        Trainer(options_from_file(str(cfg), **given), None)


def test_an_unset_grad_cp_from_the_command_line(tmp_path, monkeypatch, capsys):
    """The command line's route: no --grad-cp and a step that fits only
    under recompute: the run turns it on, says so, and trains."""
    from rwkvx_c.cli import main
    from rwkvx_c.model import memory
    gib = 1 << 30
    monkeypatch.setattr(memory, "acts_bytes", lambda model: (
        (gib // 4 if model.recompute else gib) // 48, 0))
    monkeypatch.setattr(memory, "rough_bytes_per_token", lambda cfg, recompute=False: gib)
    monkeypatch.setattr(memory, "available_bytes", lambda: int(0.6 * gib / memory.HEADROOM))
    o = _train_opts(tmp_path)
    assert main(["train", "--preset", "tiny", "--data", o.data, "--batch", "2",
                 "--seq-len", "24", "--steps", "1", "--eval-tokens", "96", "--no-progress",
                 "--threads", "1", "--cache-dir", o.cache_dir,
                 "--out", str(tmp_path / "run")]) == 0
    # the command prints warnings as "rwkvx-c: warning: ..." lines
    assert "activation recompute (--grad-cp) is on" in capsys.readouterr().err
