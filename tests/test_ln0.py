"""The optional embedding LayerNorm ln0 (docs/maths.md §Whole model, docs/layout.md): names
and order, the bit-exact test init, forward and every gradient against the float64
reference on odd sizes, finite differences through ln0, the batched path,
recurrent inference, and the config key's checks."""
import numpy as np
import pytest

import rwkvx_c as rx

from checks import FWD_TOL, GRAD_TOL, assert_rel, full_config
from reference.model import init_params, leaves, model_forward, model_loss, param_specs

# odd sizes: C = 15 = 3 heads of 5, vocab 23, ragged LoRA sizes
ODD = full_config(dict(n_embd=15, n_head=3, head_size=5, n_rwkv_layer=3, n_attn_layer=0,
                       vocab_size=23, Dw=3, Da=5, Dg=7, Dv=2, ffn_dim=19, chunk_size=3,
                       moba_top_k=0, ln0=1))
PATTERNS = {"rwkv_only": ODD, "hybrid": dict(ODD, n_attn_layer=1)}
IGNORE = 4


def _batch(cfg, seed, shape):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg["vocab_size"], shape).astype(np.int32)
    targets = rng.integers(0, cfg["vocab_size"], shape).astype(np.int32)
    targets.reshape(-1)[::5] = IGNORE
    return tokens, targets


def _reference(params, cfg, tokens, targets):
    lv = leaves(params)
    logits = model_forward(lv, cfg, tokens)
    loss = model_loss(lv, cfg, tokens, targets, IGNORE)
    loss.backward()
    return loss.value, logits.value, {k: v.grad for k, v in lv.items()}


def _emb_dominates(m):
    """Scale emb up so ln0 does real work (its input far from unit scale)."""
    m.params["emb"][...] *= 40.0


def test_names_order_and_config():
    m = rx.RxPtModel(ODD)
    assert m.param_names[:4] == ["emb", "ln0_w", "ln0_b", "blocks.0.ln1_w"]
    assert [(n, m.params[n].shape) for n in m.param_names] == param_specs(ODD)
    assert m.config["ln0"] == 1
    plain = dict(ODD)
    del plain["ln0"]
    assert rx.RxPtModel(plain).config["ln0"] == 0
    assert "ln0_w" not in rx.RxPtModel(plain).param_names


@pytest.mark.parametrize("seed", [0, 99])
def test_init_bit_exact(seed):
    cfg = PATTERNS["hybrid"]
    m = rx.RxPtModel(cfg, seed=seed)
    ref = init_params(cfg, seed)
    flat = np.concatenate([ref[n].reshape(-1) for n in m.param_names])
    assert flat.tobytes() == m.param_buffer.tobytes()
    w = m.params["ln0_w"]
    assert np.all(np.abs(w - 1.0) <= 0.1) and np.all(np.abs(m.params["ln0_b"]) <= 0.1)


def test_ln0_off_is_the_model_without_the_key():
    plain = {k: v for k, v in ODD.items() if k != "ln0"}
    a, b = rx.RxPtModel(plain, seed=3), rx.RxPtModel(dict(plain, ln0=0), seed=3)
    assert a.param_buffer.tobytes() == b.param_buffer.tobytes()
    tokens, _ = _batch(plain, 1, (9,))
    assert a.forward(tokens).tobytes() == b.forward(tokens).tobytes()


@pytest.mark.parametrize("name", PATTERNS)
def test_gradients_match_reference(name):
    cfg = PATTERNS[name]
    m = rx.RxPtModel(cfg, seed=5)
    _emb_dominates(m)
    tokens, targets = _batch(cfg, 6, (2, 11))
    params = {n: v.copy() for n, v in m.params.items()}
    ref_loss, ref_logits, ref_grads = _reference(params, cfg, tokens, targets)
    assert_rel("ln0.logits", m.forward(tokens), ref_logits, FWD_TOL)
    loss = m.backward(targets, ignore_index=IGNORE)
    assert abs(loss - ref_loss) <= FWD_TOL * abs(ref_loss)
    for n in m.param_names:
        assert_rel(f"ln0.grad.{n.split('.')[-1]}", m.grads[n], ref_grads[n], GRAD_TOL)
    # ln0 normalises: a common scale of emb leaves the logits unchanged, so
    # the grad on emb is orthogonal to emb row by row
    g, e = m.grads["emb"].astype(np.float64), m.params["emb"].astype(np.float64)
    per_row = np.abs((g * (e - e.mean(1, keepdims=True))).sum(1))
    assert per_row.max() <= 1e-4 * np.abs(g).max() * np.abs(e).max()


def test_finite_differences_through_ln0():
    """Central differences of the float64 reference loss confirm its
    autograd and the C grads on emb, ln0_w and ln0_b."""
    cfg = dict(ODD, n_rwkv_layer=2)
    m = rx.RxPtModel(cfg, seed=8)
    _emb_dominates(m)
    tokens, targets = _batch(cfg, 9, (7,))
    params = {n: v.astype(np.float64) for n, v in m.params.items()}
    _, _, ref_grads = _reference(params, cfg, tokens, targets)
    m.forward(tokens)
    m.backward(targets, ignore_index=IGNORE)
    eps = 1e-5
    rng = np.random.default_rng(0)
    for n in ("emb", "ln0_w", "ln0_b"):
        g = ref_grads[n]
        scale = np.abs(g).max()
        rows = [np.unravel_index(np.abs(g).argmax(), g.shape)]
        rows += [tuple(int(rng.integers(s)) for s in g.shape) for _ in range(3)]
        for idx in rows:
            p_hi, p_lo = dict(params), dict(params)
            p_hi[n], p_lo[n] = params[n].copy(), params[n].copy()
            p_hi[n][idx] += eps
            p_lo[n][idx] -= eps
            fd = (model_loss(p_hi, cfg, tokens, targets, IGNORE).value
                  - model_loss(p_lo, cfg, tokens, targets, IGNORE).value) / (2 * eps)
            assert abs(g[idx] - fd) <= 1e-6 * scale + 1e-9, (n, idx, g[idx], fd)
            assert abs(m.grads[n][idx] - fd) <= GRAD_TOL * scale + 1e-9, (n, idx)


def test_batch_equals_per_sequence():
    cfg = PATTERNS["hybrid"]
    m = rx.RxPtModel(cfg, seed=12)
    _emb_dominates(m)
    tokens, _ = _batch(cfg, 13, (3, 10))
    full = m.forward(tokens)
    for b in range(3):
        assert_rel("ln0.batch", full[b], m.forward(tokens[b]), FWD_TOL)


@pytest.mark.parametrize("name", PATTERNS)
def test_inference_equals_forward(name):
    cfg = PATTERNS[name]
    m = rx.RxPtModel(cfg, seed=14)
    _emb_dominates(m)
    tokens, _ = _batch(cfg, 15, (17,))
    full = m.forward(tokens)
    st = rx.InferState(m, max_len=17)
    parts = [st.forward(tokens[:6])] + [st.forward(tokens[t:t + 1]) for t in range(6, 17)]
    assert_rel("ln0.infer", np.concatenate(parts), full, FWD_TOL)


@pytest.mark.parametrize("bad", [2, -1, True, 1.0, "1", None])
def test_bad_ln0_value(bad):
    with pytest.raises(ValueError, match="ln0"):
        rx.RxPtModel(dict(ODD, ln0=bad))


def test_presets_turn_ln0_on_and_old_checkpoints_keep_loading(tmp_path):
    """A run without ln0 is saved as one from before the ln0 key existed (no
    ln0 in its config or options), and resumes as an ln0 = 0 model, bit for
    bit, and samples."""
    from rwkvx_c.run.checkpoint import read_checkpoint
    from rwkvx_c.sample import load_model
    from rwkvx_c.train import CHECKPOINT, PRESETS, Trainer, TrainOptions

    assert all(p["model"]["ln0"] == 1 for p in PRESETS.values())
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    small = dict(n_embd=16, n_head=2, head_size=8, n_rwkv_layer=2, n_attn_layer=0,
                 vocab_size=256, ffn_dim=32, Dw=4, Da=4, Dg=4, Dv=4, chunk_size=8, moba_top_k=1)
    opts = TrainOptions(preset="tiny", data=str(corpus), batch=2, seq_len=16, steps=2,
                        eval_tokens=32, warmup_steps=1, threads=1,
                        cache_dir=str(tmp_path / "cache"))
    assert Trainer(TrainOptions(**{**opts.to_dict(), "model": dict(small)}),
                   str(tmp_path / "new")).model.config["ln0"] == 1
    out = str(tmp_path / "old")
    tr = Trainer(TrainOptions(**{**opts.to_dict(), "model": dict(small, ln0=0)}), out)
    tr.run()
    path = f"{out}/{CHECKPOINT}"
    _, config, state = read_checkpoint(path)
    # ln0 = 0 is what its absence means: the checkpoint stores no ln0 key (nor
    # an eps at its default), as a version before ln0 wrote it and reads it
    assert not set(rx.OPTION_FIELDS) & (set(config) | set(state["options"]["model"]))
    assert "ln0_w" not in load_model(out).param_names
    more = Trainer.resume(out, steps=3)
    assert more.model.config["ln0"] == 0
    assert more.model.param_buffer.tobytes() == tr.model.param_buffer.tobytes()
    more.run()
    assert Trainer.resume(out, steps=4).step_count == 3
