"""The model context (rx_model_ctx, docs/maths.md §LayerNorm and GroupNorm):
a model's ln_eps and gn_eps reach every kernel it runs -- the forward and
backward, with and without recompute, and recurrent inference -- against
the float64 reference given the same values; they are checked by name; a
checkpoint stores them only when they are not the defaults."""
import numpy as np
import pytest
from test_ln0 import IGNORE, _reference

import rwkvx_c as rx
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.run.checkpoint import read_checkpoint
from rwkvx_c.train import CHECKPOINT, Trainer, TrainOptions

from checks import FWD_TOL, GRAD_TOL, assert_rel, full_config, token_batch
from hostile import corpus
from reference.model import leaves, model_forward

# every kind of block, ln0 on; top-k 3 of T/chunk = 3 chunks: every chunk
# chosen, so the reference's selection cannot flip on rounding. The eps are
# far from the defaults: a kernel that kept a default is off by far more
# than the tolerance (checked below).
CFG = full_config(dict(n_embd=16, n_head=2, head_size=8, n_rwkv_layer=3, n_attn_layer=1,
                       vocab_size=19, Dw=4, Da=3, Dg=5, Dv=3, ffn_dim=21, chunk_size=4,
                       moba_top_k=3, ln0=1))
EPS = dict(ln_eps=0.25, gn_eps=3.0)
B, T = 2, 11


@pytest.mark.parametrize("recompute", [False, True])
def test_the_eps_reach_every_training_kernel(recompute):
    m = rx.RxPtModel(dict(CFG, **EPS), seed=3, recompute=recompute)
    assert {k: m.config[k] for k in EPS} == EPS
    tokens, targets = token_batch(CFG["vocab_size"], B, T, seed=5, ignore=IGNORE)
    params = {n: v.copy() for n, v in m.params.items()}
    loss_ref, logits_ref, grads_ref = _reference(params, m.config, tokens, targets)
    logits = m.forward(tokens)
    loss = m.backward(targets, IGNORE)
    assert_rel("ctx.logits", logits, logits_ref, FWD_TOL)
    assert_rel("ctx.loss", loss, loss_ref, FWD_TOL)
    for n in m.param_names:
        assert_rel("ctx.grad", m.grads[n], grads_ref[n], GRAD_TOL)
    # the defaults give other logits: the test sees a kernel that ignores the eps
    default = model_forward(leaves(params), CFG, tokens).value
    assert np.max(np.abs(default - logits)) > 1e3 * FWD_TOL * np.max(np.abs(logits))


def test_the_eps_reach_recurrent_inference():
    m = rx.RxPtModel(dict(CFG, **EPS), seed=3)
    toks = np.random.default_rng(1).integers(0, CFG["vocab_size"], T).astype(np.int32)
    full = m.forward(toks)
    st = rx.InferState(m, max_len=T)
    steps = np.concatenate([st.forward(toks[t:t + 1]) for t in range(T)])
    assert_rel("ctx.infer", steps, full, FWD_TOL)
    # the blocks step through the training forward's functions, which take
    # the context: at position 0 the same bits
    assert np.array_equal(rx.InferState(m, max_len=T).forward(toks), full)
    plain = rx.InferState(rx.RxPtModel(CFG, seed=3), max_len=T).forward(toks)
    assert np.max(np.abs(plain - full)) > 1e3 * FWD_TOL * np.max(np.abs(full))


@pytest.mark.parametrize("key,bad,word", [
    ("ln_eps", 0.0, "ln_eps"), ("ln_eps", float("nan"), "ln_eps"), ("gn_eps", -1.0, "gn_eps"),
    ("gn_eps", 1e-50, "gn_eps"), ("ln_eps", "1e-5", "ln_eps"), ("gn_eps", True, "gn_eps"),
    ("ln_eps", float("inf"), "ln_eps")])
def test_bad_settings_are_refused_by_name(key, bad, word):
    with pytest.raises(ValueError, match=word):
        rx.RxPtModel(dict(CFG, **{key: bad}))
    with pytest.raises(ValueError, match=word):
        rx.check_config(dict(CFG, **{key: bad}))


def test_a_checkpoint_stores_the_eps_only_when_set(tmp_path):
    small = {k: v for k, v in CFG.items() if k not in ("ln_eps", "gn_eps")}
    opts = dict(preset="tiny", data=corpus(str(tmp_path)), batch=2, seq_len=8, steps=1,
                eval_tokens=16, warmup_steps=0, threads=1, cache_dir=str(tmp_path / "cache"),
                model=dict(small, vocab_size=256))
    for out, model in (("plain", {}), ("set", dict(ln_eps=1e-3))):
        tr = Trainer(TrainOptions(**dict(opts, model=dict(opts["model"], **model))),
                     str(tmp_path / out))
        tr.run()
        _, config, state = read_checkpoint(str(tmp_path / out / CHECKPOINT))
        for stored in (config, state["options"]["model"]):
            assert {k: stored[k] for k in ("ln_eps", "gn_eps") if k in stored} == model
        back = Trainer.resume(str(tmp_path / out), steps=2)
        assert back.model.config == ModelConfig.resolve(config) == tr.model.config
        assert back.model.param_buffer.tobytes() == tr.model.param_buffer.tobytes()
