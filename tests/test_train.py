"""The training stack on the real model: batched grads, init, AdamW ranges,
the Trainer (resume bit for bit, clear errors)."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

import rwkvx_c as rx
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.model.init import init_model
from rwkvx_c.run.checkpoint import read_checkpoint
from rwkvx_c.train import CHECKPOINT, LOG, Trainer, TrainError, TrainOptions
from rwkvx_c.train.optim import AdamW, decay_ranges
from rwkvx_c.train.schedule import lr_at

from reference import optim as ref

SMALL = dict(n_embd=32, n_head=2, head_size=16, n_rwkv_layer=2, n_attn_layer=1, vocab_size=256,
             ffn_dim=64, Dw=8, Da=8, Dg=8, Dv=8, chunk_size=8, moba_top_k=1)


def _corpus(tmp_path):
    p = tmp_path / "corpus.txt"
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "(", ")", ":"]
    p.write_text(" ".join(rng.choice(words, 6000)))
    return str(p)


def _opts(tmp_path, **kw):
    base = dict(preset="tiny", data=_corpus(tmp_path), model=dict(SMALL), batch=2, seq_len=24,
                steps=6, eval_tokens=96, warmup_steps=2, lr=3e-3, threads=2,
                cache_dir=str(tmp_path / "cache"))
    base.update(kw)
    return TrainOptions(**base)


@pytest.mark.parametrize("ignore", [False, True])
def test_batched_grads_are_the_sum_of_per_sequence_grads(ignore):
    """The batch loss is the mean over all valid tokens, so its grads are the
    per-sequence grads summed with weights n_valid_b / n_valid."""
    m = rx.RxPtModel(SMALL, seed=3)
    B, T = 3, 19  # T > (top_k + 1) * chunk_size: MoBA selection is active
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, size=(B, T), dtype=np.int32)
    y = rng.integers(0, 256, size=(B, T), dtype=np.int32)
    ii = -1
    if ignore:  # unequal valid counts per sequence
        ii = 7
        y[0, :5] = ii
        y[2, 3] = ii
    nv = (y != ii).sum(axis=1) if ignore else np.full(B, T)
    losses, grads = [], []
    for b in range(B):
        m.forward(np.ascontiguousarray(x[b]))
        losses.append(m.backward(np.ascontiguousarray(y[b]), ignore_index=ii))
        grads.append(m.grad_buffer.astype(np.float64))
    logits = m.forward(x)
    loss = m.backward(y, ignore_index=ii)
    assert logits.shape == (B, T, 256)
    w = nv / nv.sum()
    assert abs(loss - np.dot(w, losses)) <= 1e-5 * abs(loss)
    want = sum(wb * g for wb, g in zip(w, grads))
    got = m.grad_buffer
    for name in m.param_names:
        a = m.grads[name]
        off = (a.__array_interface__["data"][0] - got.__array_interface__["data"][0]) // 4
        ref_t = want[off:off + a.size].reshape(a.shape)
        assert np.max(np.abs(a - ref_t)) <= 1e-4 * max(np.max(np.abs(ref_t)), 1e-30), name


def test_rwkv7_init():
    m = rx.RxPtModel(SMALL, seed=0)
    before = m.param_buffer.copy()
    init_model(m, "spec")
    np.testing.assert_array_equal(m.param_buffer, before)
    init_model(m, "rwkv7", seed=5)
    p = m.params
    C = SMALL["n_embd"]
    assert np.abs(p["emb"]).max() <= 1e-4
    layers = m.layers
    r = layers.index("R")
    a = layers.index("A")
    for name in ("tm.output_w", "cm.ffn_value_w", "tm.w1", "tm.a1", "tm.g1"):
        assert not p[f"blocks.{r}.{name}"].any(), name
    assert not p[f"blocks.{a}.output_w"].any()
    W = p[f"blocks.{r}.tm.receptance_w"].astype(np.float64)
    np.testing.assert_allclose(W @ W.T, np.eye(C), atol=1e-5)
    K = p[f"blocks.{r}.cm.ffn_key_w"].astype(np.float64)  # [C, F], F > C: orthonormal rows
    np.testing.assert_allclose(K @ K.T, np.eye(C), atol=1e-5)
    for f in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
        v = p[f"blocks.{r}.tm.{f}"]
        assert v.min() >= 0 and v.max() <= 1 and v.std() > 0.05, f
    # deeper blocks mix less of the previous token
    last_r = max(i for i, k in enumerate(layers) if k == "R")
    assert p[f"blocks.{last_r}.tm.x_k"].mean() < p[f"blocks.{r}.tm.x_k"].mean()
    w0 = p[f"blocks.{r}.tm.w0"]
    assert w0.max() - w0.min() > 4  # a spread of decay speeds
    np.testing.assert_allclose(p[f"blocks.{r}.tm.k_a"], 1.02, rtol=1e-6)
    for n in m.param_names:
        if n.endswith(("ln1_w", "ln2_w")) or n == "ln_out_w":
            assert (p[n] == 1).all()
    init_model(m, "rwkv7", seed=5)
    again = m.param_buffer.copy()
    init_model(m, "rwkv7", seed=5)
    np.testing.assert_array_equal(m.param_buffer, again)
    with pytest.raises(ValueError, match="unknown init"):
        init_model(m, "xavier")


def test_decay_ranges_cover_the_matrices():
    m = rx.RxPtModel(SMALL)
    r = decay_ranges(m)
    mask = ref.decay_mask(m.n_params, r)
    base = m.param_buffer.__array_interface__["data"][0]
    n2d = 0
    for name in m.param_names:
        a = m.params[name]
        off = (a.__array_interface__["data"][0] - base) // 4
        assert mask[off:off + a.size].all() == (a.ndim == 2), name
        assert mask[off:off + a.size].any() == (a.ndim == 2), name
        n2d += a.size if a.ndim == 2 else 0
    assert mask.sum() == n2d


def test_adamw_on_the_model_matches_reference():
    m = rx.RxPtModel(SMALL, seed=1)
    x = np.arange(20, dtype=np.int32).reshape(2, 10)
    m.forward(x)
    m.backward((x + 1) % 256)
    p0 = m.param_buffer.astype(np.float64)
    g = m.grad_buffer.copy()
    opt = AdamW(m.param_buffer, m.grad_buffer, decay_ranges(m), weight_decay=0.1, grad_clip=0.5)
    norm = opt.step(1e-3)
    assert abs(norm - ref.grad_norm(g)) <= 1e-9 * norm
    want, _, _ = ref.adamw_step(p0, g, np.zeros_like(p0), np.zeros_like(p0), lr=1e-3, step=1,
                                beta2=0.99, weight_decay=0.1, decay_ranges=opt.ranges,
                                grad_scale=ref.clip_scale(norm, 0.5))
    assert np.max(np.abs(m.param_buffer - want)) <= 1e-5 * np.max(np.abs(want))


def test_lr_schedule():
    for s in range(1, 120):
        prog = max(0.0, (s - 10) / 90)
        assert abs(lr_at(s, prog, lr=1e-3, warmup_steps=10, min_lr_frac=0.1)
                   - ref.cosine_lr(s, lr=1e-3, warmup=10, total=100, min_lr_frac=0.1)) < 1e-15


def _losses(tr, until):
    out = []
    while tr.step_count < until:
        out.append(tr.step()["loss"])
    return out


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    full = Trainer(_opts(tmp_path), str(tmp_path / "full"))
    ref_losses = _losses(full, 6)
    ref_eval = full.evaluate()
    assert np.isfinite(ref_losses).all() and ref_losses[-1] < ref_losses[0]

    part = Trainer(_opts(tmp_path), str(tmp_path / "part"))
    first = _losses(part, 3)
    part.evaluate()  # evaluating must not disturb the training stream
    part.save()
    del part
    resumed = Trainer.resume(str(tmp_path / "part"))
    assert resumed.step_count == 3
    rest = _losses(resumed, 6)
    assert first + rest == ref_losses  # bit for bit
    assert resumed.evaluate() == ref_eval


def test_resume_on_another_thread_count(tmp_path):
    """A step's result does not depend on the thread count (fixed row blocks
    everywhere), so a run resumed on 1 thread repeats the 2-thread run bit
    for bit; B*T*C = 32768 takes the norms' threaded path."""
    big = dict(batch=4, seq_len=256, threads=2)
    ref_losses = _losses(Trainer(_opts(tmp_path, **big), str(tmp_path / "full")), 4)
    part = Trainer(_opts(tmp_path, **big), str(tmp_path / "part"))
    first = _losses(part, 2)
    part.save()
    del part
    resumed = Trainer.resume(str(tmp_path / "part"), threads=1)
    assert first + _losses(resumed, 4) == ref_losses  # bit for bit


def test_run_writes_log_checkpoint_and_resumes_further(tmp_path):
    out = str(tmp_path / "run")
    tr = Trainer(_opts(tmp_path, eval_every=3), out)
    final = tr.run()
    assert set(final) == {"val_loss", "val_bpb"}
    assert abs(final["val_bpb"] - final["val_loss"] / np.log(2)) < 1e-12
    rows = [json.loads(line) for line in Path(out, LOG).read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == list(range(1, 7))
    assert {"step", "loss", "lr", "tokens_per_s"} <= set(rows[0])
    assert any("val_bpb" in r for r in rows[:-1]) and "val_bpb" in rows[-1]
    tensors, config, state = read_checkpoint(os.path.join(out, CHECKPOINT))
    # the stored config: the model's, less the keys at what their absence means
    assert ModelConfig.resolve(config) == tr.model.config and state["step"] == 6
    assert "ln_eps" not in config and "gn_eps" not in config
    assert tensors["optim.m"].shape == (tr.model.n_params,)
    more = Trainer.resume(out, steps=8)
    more.run()
    rows = [json.loads(line) for line in Path(out, LOG).read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))


def test_resume_errors(tmp_path):
    out = str(tmp_path / "run")
    tr = Trainer(_opts(tmp_path, steps=2), out)
    tr.run()
    with pytest.raises(TrainError, match="already holds a run"):
        Trainer(_opts(tmp_path, steps=2), out)
    with pytest.raises(TrainError, match="different configuration: batch"):
        Trainer.resume(out, batch=3)
    with pytest.raises(TrainError, match=r"model\.n_embd"):
        Trainer.resume(out, model=dict(SMALL, n_embd=64))
    ck = os.path.join(out, CHECKPOINT)
    blob = Path(ck).read_bytes()
    Path(ck).write_bytes(blob[: len(blob) // 2])
    with pytest.raises(TrainError, match="truncated"):
        Trainer.resume(out)
    bad = bytearray(blob)
    bad[-5] ^= 1
    Path(ck).write_bytes(bytes(bad))
    with pytest.raises(TrainError, match="corrupt"):
        Trainer.resume(out)
    with pytest.raises(TrainError, match="no checkpoint"):
        Trainer.resume(str(tmp_path / "nowhere"))


def test_option_errors(tmp_path):
    for kw, msg in ((dict(preset="XL"), "unknown preset"), (dict(batch=0), "batch"),
                    (dict(lr=-1.0), "lr"), (dict(init="foo"), "unknown init"),
                    (dict(model=dict(SMALL, n_head=3)), "bad model config"),
                    (dict(model={"bogus": 1}), "unknown model config"),
                    (dict(data=str(tmp_path / "missing")), "does not exist")):
        with pytest.raises((TrainError, ValueError), match=msg):
            Trainer(_opts(tmp_path, **kw), None)


def test_time_budget_stops_and_evaluates(tmp_path):
    tr = Trainer(_opts(tmp_path, steps=None, time_budget=0.05), str(tmp_path / "r"))  # 3 s
    final = tr.run()
    assert tr.step_count >= 2 and np.isfinite(final["val_loss"])
    assert tr.train_seconds() <= 3.0 + 0.5
