"""The whole model (docs/maths.md, docs/layout.md): RxPtModel against the float64
reference of tests/reference/model.py -- names, order, shapes, bit-exact
init, zero-copy views, whole-model gradients for three layer patterns,
finite differences, batches, and clean errors on bad input."""
import gc

import numpy as np
import pytest

import rwkvx_c as rx

from checks import FWD_TOL, GRAD_TOL, assert_rel, full_config
from reference.model import (
    init_params,
    layer_order,
    leaves,
    min_gate_margin,
    model_forward,
    model_loss,
    param_specs,
)

# whole configs (ln0, ln_eps, gn_eps resolved): the references take them from it
BASE = full_config(dict(n_embd=16, n_head=2, head_size=8, n_rwkv_layer=3, n_attn_layer=0,
                        vocab_size=23, Dw=4, Da=4, Dg=6, Dv=3, ffn_dim=24, chunk_size=4,
                        moba_top_k=1))
PATTERNS = {
    "rwkv_only": dict(BASE),
    "3R1A": dict(BASE, n_attn_layer=1, moba_top_k=2),
    "5R2A": dict(BASE, n_rwkv_layer=5, n_attn_layer=2, moba_top_k=1),
}
T = 13
IGNORE = 5


def batch(cfg, seed, B=None, n_ignored=2, T=T):
    """Random tokens and targets, n_ignored targets per sequence set to IGNORE."""
    rng = np.random.default_rng(seed)
    shape = (T,) if B is None else (B, T)
    tokens = rng.integers(0, cfg["vocab_size"], shape).astype(np.int32)
    targets = rng.integers(0, cfg["vocab_size"], shape).astype(np.int32)
    targets[targets == IGNORE] = IGNORE + 1
    for row in targets.reshape(-1, T):
        row[rng.choice(T, n_ignored, replace=False)] = IGNORE
    return tokens, targets


def reference(params, cfg, tokens, targets, ignore_index):
    """(loss, logits, grads) of the float64 reference at float32 params."""
    lv = leaves(params)
    logits = model_forward(lv, cfg, tokens)
    loss = model_loss(lv, cfg, tokens, targets, ignore_index)
    loss.backward()
    grads = {k: v.grad if v.grad is not None else np.zeros(v.shape) for k, v in lv.items()}
    return loss.value, logits.value, grads


def batch_reference(name, seed, B=2):
    """A fresh model of PATTERNS[name], a batch of B sequences with stable
    selections, and the reference (loss, logits, grads) on it."""
    cfg = PATTERNS[name]
    m = rx.RxPtModel(cfg, seed=seed)
    tokens, targets = batch(cfg, seed + 1, B=B)
    params = {n: v.copy() for n, v in m.params.items()}
    for b in range(B):
        stable_selection(params, cfg, tokens[b])
    return (m, tokens, targets, *reference(params, cfg, tokens, targets, IGNORE))


def stable_selection(params, cfg, tokens):
    """The C and float64 MoBA selections cannot differ: every kept/dropped
    gate gap is far above fp32 rounding."""
    assert min_gate_margin(params, cfg, tokens) > 1e-3


# ---- structure ------------------------------------------------------------


@pytest.mark.parametrize("n_rwkv,n_attn,expected", [
    (5, 2, "RRARRAR"), (3, 1, "RRRA"), (4, 2, "RRARRA"), (6, 2, "RRRARRRA"), (2, 0, "RR"),
    (1, 1, "RA"), (3, 3, "RARARA"), (7, 3, "RRARRARRAR"), (5, 3, "RARARARR")])
def test_layer_order(n_rwkv, n_attn, expected):
    cfg = dict(BASE, n_rwkv_layer=n_rwkv, n_attn_layer=n_attn)
    assert layer_order(cfg) == expected
    m = rx.RxPtModel(cfg)
    assert m.layers == expected
    assert f"layers='{expected}'" in repr(m)


@pytest.mark.parametrize("name", PATTERNS)
def test_names_order_shapes(name):
    cfg = PATTERNS[name]
    m = rx.RxPtModel(cfg, seed=3)
    specs = param_specs(cfg)
    assert m.param_names == [n for n, _ in specs]
    assert m.param_names[:4] == ["emb", "blocks.0.ln1_w", "blocks.0.ln1_b", "blocks.0.tm.x_r"]
    assert m.param_names[-3:] == ["ln_out_w", "ln_out_b", "head"]
    assert "blocks.0.tm.v0" not in m.param_names and "blocks.1.tm.v0" in m.param_names
    params, grads = m.params, m.grads
    assert list(params) == list(grads) == m.param_names
    for n, shape in specs:
        assert params[n].shape == grads[n].shape == shape, n
        assert params[n].dtype == grads[n].dtype == np.float32
        assert params[n].flags.c_contiguous and params[n].flags.writeable
    n_params = sum(int(np.prod(s)) for _, s in specs)
    assert m.n_params == n_params == m.param_buffer.size == m.grad_buffer.size
    assert m.config == dict(cfg, ln0=0) and m.config is not m.config
    assert f"n_params={n_params:,}" in repr(m)


def test_attention_block_names():
    m = rx.RxPtModel(PATTERNS["3R1A"])
    assert [n for n in m.param_names if n.startswith("blocks.3.")] == [
        "blocks.3." + f for f in ("ln1_w", "ln1_b", "receptance_w", "key_w", "value_w",
                                  "output_w", "ln2_w", "ln2_b", "cm.ffn_x_k", "cm.ffn_key_w",
                                  "cm.ffn_value_w")]


@pytest.mark.parametrize("seed", [0, 0xDEADBEEFCAFEF00D])
def test_init_bit_exact(seed):
    cfg = PATTERNS["5R2A"]
    m = rx.RxPtModel(cfg, seed=seed)
    ref = init_params(cfg, seed)
    flat = np.concatenate([ref[n].reshape(-1) for n in m.param_names])
    assert flat.tobytes() == m.param_buffer.tobytes()
    assert not np.any(m.grad_buffer)


def test_init_scheme_ranges():
    m = rx.RxPtModel(PATTERNS["5R2A"], seed=7)
    p = m.params
    assert np.all(np.abs(p["emb"]) <= 0.25) and np.abs(p["emb"]).max() > 0.2
    assert np.all(np.abs(p["head"]) <= 0.15) and np.abs(p["head"]).max() > 0.12
    assert np.all(np.abs(p["blocks.0.ln1_w"] - 1.0) <= 0.1)
    assert np.all(np.abs(p["blocks.1.tm.ln_x_b"]) <= 0.1)
    assert not np.array_equal(p["head"], rx.RxPtModel(PATTERNS["5R2A"], seed=8).params["head"])


# ---- zero-copy views --------------------------------------------------------


def test_views_share_the_arenas():
    m = rx.RxPtModel(PATTERNS["3R1A"], seed=1)
    for n in m.param_names:
        assert np.shares_memory(m.params[n], m.param_buffer)
        assert np.shares_memory(m.grads[n], m.grad_buffer)
        assert not np.shares_memory(m.params[n], m.grad_buffer)
    m.param_buffer[:m.params["emb"].size] = 0.5
    assert np.all(m.params["emb"] == 0.5)
    m.grads["head"][...] = 3.0
    assert np.all(m.grad_buffer[-m.params["head"].size:] == 3.0)
    m.zero_grad()
    assert not np.any(m.grad_buffer)


def test_write_through_params_changes_forward():
    m = rx.RxPtModel(PATTERNS["3R1A"], seed=1)
    tokens, _ = batch(m.config, 0)
    logits = m.forward(tokens)
    m.params["head"][...] *= 2.0          # logits are linear in head: exactly doubled
    assert np.array_equal(m.forward(tokens), 2.0 * logits)
    m.params["emb"][tokens[0]] += 1.0
    assert not np.array_equal(m.forward(tokens)[0], 2.0 * logits[0])


def test_views_outlive_the_model():
    m = rx.RxPtModel(PATTERNS["3R1A"], seed=2)
    head, gbuf = m.params["head"], m.grad_buffer
    expected = init_params(PATTERNS["3R1A"], 2)["head"]
    tokens, targets = batch(m.config, 1)
    m.forward(tokens)
    m.backward(targets)
    gcopy = gbuf.copy()
    del m
    gc.collect()
    junk = [np.full(4096, 7.0, np.float32) for _ in range(64)]   # reuse freed memory
    assert np.array_equal(head, expected)
    assert np.array_equal(gbuf, gcopy)
    head[0, 0] = 1.0                       # still writable, still owned
    assert head[0, 0] == 1.0 and len(junk) == 64


# ---- gradients against the float64 reference --------------------------------


@pytest.mark.parametrize("ignore_index", [IGNORE, -1])
@pytest.mark.parametrize("name", PATTERNS)
def test_gradients_match_reference(name, ignore_index):
    cfg = PATTERNS[name]
    m = rx.RxPtModel(cfg, seed=11)
    tokens, targets = batch(cfg, 12)
    if ignore_index < 0:
        targets[targets == IGNORE] = 0
    params = {n: v.copy() for n, v in m.params.items()}
    stable_selection(params, cfg, tokens)
    ref_loss, ref_logits, ref_grads = reference(params, cfg, tokens, targets, ignore_index)
    logits = m.forward(tokens)
    assert_rel(f"model.{name}.logits", logits, ref_logits, FWD_TOL)
    loss = m.backward(targets, ignore_index=ignore_index)
    assert abs(loss - ref_loss) <= FWD_TOL * abs(ref_loss)
    grads = m.grads
    for n in m.param_names:
        kind = n.split(".", 2)[-1] if n.startswith("blocks.") else n
        assert_rel(f"model.{name}.grad.{kind}", grads[n], ref_grads[n], GRAD_TOL)


def test_backward_overwrites_and_repeats():
    m = rx.RxPtModel(PATTERNS["3R1A"], seed=4)
    tokens, targets = batch(m.config, 5)
    m.forward(tokens)
    loss = m.backward(targets, ignore_index=IGNORE)
    g1 = m.grad_buffer.copy()
    m.grad_buffer[...] = 123.0            # the arena is overwritten, never accumulated
    assert m.backward(targets, ignore_index=IGNORE) == loss
    assert np.array_equal(m.grad_buffer, g1)


def test_forward_without_logits_trains_the_same():
    # the trainer's step: backward reads the model's own logits, so a
    # forward that copies none out gives the same loss and grads bit for bit
    m = rx.RxPtModel(PATTERNS["3R1A"], seed=4)
    tokens, targets = batch(m.config, 5, B=2)
    logits = m.forward(tokens)
    loss = m.backward(targets, ignore_index=IGNORE)
    g1 = m.grad_buffer.copy()
    assert m.forward(tokens, return_logits=False) is None
    assert m.backward(targets, ignore_index=IGNORE) == loss
    assert np.array_equal(m.grad_buffer, g1)
    assert np.array_equal(m.forward(tokens, return_logits=True), logits)
    with pytest.raises(TypeError):
        m.forward(tokens, False)            # keyword only


def test_backward_repeats_with_selection_and_thread_change(restore_threads):
    """Attention blocks keep their forward's intermediates (q, k, v, the chunk
    selection, the log-sum-exp): backward after one batched forward, with MoBA
    selection active, is exact, and again after the thread count grows (the
    kept per-thread scratch grows with it)."""
    # 5R2A: chunk 4, top_k 1, T 13: queries t >= 8 choose
    m, tokens, targets, ref_loss, _, ref_grads = batch_reference("5R2A", 51)
    rx.set_num_threads(1)
    m.forward(tokens)
    for threads in (1, 2, 1):
        rx.set_num_threads(threads)
        m.grad_buffer[...] = 123.0
        assert abs(m.backward(targets, ignore_index=IGNORE) - ref_loss) <= FWD_TOL * ref_loss
        for n in m.param_names:
            assert_rel("model.repeat.grads", m.grads[n], ref_grads[n], GRAD_TOL)


def test_no_valid_target_gives_zero_loss_and_grads():
    m = rx.RxPtModel(PATTERNS["3R1A"], seed=4)
    tokens, _ = batch(m.config, 5)
    m.forward(tokens)
    m.grad_buffer[...] = 1.0
    assert m.backward(np.full(T, IGNORE, np.int32), ignore_index=IGNORE) == 0.0
    assert not np.any(m.grad_buffer)


def test_finite_differences():
    """Central differences of the float64 reference loss on two elements of
    every tensor (its largest-grad element and a random one) agree with the
    reference autograd and with the C grads."""
    cfg = dict(BASE, n_rwkv_layer=2, n_attn_layer=1, chunk_size=2, moba_top_k=1)
    m = rx.RxPtModel(cfg, seed=21)
    tokens, targets = batch(cfg, 22, T=8)
    params = {n: v.astype(np.float64) for n, v in m.params.items()}
    stable_selection(params, cfg, tokens)
    _, _, ref_grads = reference(params, cfg, tokens, targets, IGNORE)
    m.forward(tokens)
    m.backward(targets, ignore_index=IGNORE)
    grads = m.grads

    def loss_at(name, idx, delta):
        p = dict(params)
        p[name] = params[name].copy()
        p[name][idx] += delta
        return model_loss(p, cfg, tokens, targets, IGNORE).value

    rng = np.random.default_rng(0)
    eps = 1e-5
    for n in m.param_names:
        g = ref_grads[n]
        scale = np.abs(g).max()
        for idx in {np.unravel_index(np.abs(g).argmax(), g.shape),
                    tuple(int(rng.integers(s)) for s in g.shape)}:
            fd = (loss_at(n, idx, eps) - loss_at(n, idx, -eps)) / (2 * eps)
            assert abs(g[idx] - fd) <= 1e-6 * scale + 1e-9, (n, idx, g[idx], fd)
            assert abs(grads[n][idx] - fd) <= GRAD_TOL * scale + 1e-9, (n, idx, grads[n][idx], fd)


# ---- batches ------------------------------------------------------------------


def test_batch_equals_per_sequence():
    """(B, T) tokens run the batched C path; its loss is the mean over every
    valid position of the batch, so it is the valid-count-weighted mean of
    the per-sequence losses, and likewise the grads."""
    cfg = PATTERNS["5R2A"]
    m = rx.RxPtModel(cfg, seed=31)
    B = 3
    tokens, targets = batch(cfg, 32, B=B)
    targets[1, :5] = IGNORE                     # unequal valid counts
    logits = m.forward(tokens)
    assert logits.shape == (B, T, cfg["vocab_size"])
    loss = m.backward(targets, ignore_index=IGNORE)
    grads = m.grad_buffer.copy()
    n_valid = (targets != IGNORE).sum(1)
    loss_sum, grad_sum = 0.0, np.zeros(m.n_params)
    for b in range(B):
        assert_rel("model.batch.logits", logits[b], m.forward(tokens[b]), FWD_TOL)
        lb = m.backward(targets[b], ignore_index=IGNORE)
        loss_sum += lb * n_valid[b]
        grad_sum += m.grad_buffer * float(n_valid[b])
    assert abs(loss - loss_sum / n_valid.sum()) <= 1e-6 * loss
    off = 0
    for n in m.param_names:      # per tensor, as everywhere
        size = m.params[n].size
        assert_rel("model.batch.grads", grads[off:off + size],
                   grad_sum[off:off + size] / n_valid.sum(), GRAD_TOL)
        off += size


def test_batch_matches_reference():
    m, tokens, targets, ref_loss, ref_logits, ref_grads = batch_reference("3R1A", 41)
    assert_rel("model.batch.logits", m.forward(tokens), ref_logits, FWD_TOL)
    assert abs(m.backward(targets, ignore_index=IGNORE) - ref_loss) <= FWD_TOL * ref_loss
    for n in m.param_names:
        assert_rel("model.batch.grads", m.grads[n], ref_grads[n], GRAD_TOL)


def test_forward_shape_changes_reallocate():
    m = rx.RxPtModel(PATTERNS["rwkv_only"], seed=5)
    tokens, targets = batch(m.config, 6, B=2)
    l2 = m.forward(tokens)
    l1 = m.forward(tokens[1, :7].copy())
    assert l1.shape == (7, 23)
    assert_rel("model.batch.logits", l1, m.forward(tokens[1, :7].copy()), 0.0)
    with pytest.raises(ValueError, match="shape"):
        m.backward(targets)
    assert np.isfinite(m.backward(targets[1, :7].copy()))
    assert_rel("model.batch.logits", m.forward(tokens), l2, 0.0)


# ---- errors ----------------------------------------------------------------------


@pytest.mark.parametrize("change,match", [
    (dict(n_head=3), "n_head"), (dict(head_size=4), "n_embd"),
    (dict(n_attn_layer=4), "n_attn_layer"), (dict(n_attn_layer=-1), "n_attn_layer"),
    (dict(n_embd=0), "n_embd"), (dict(vocab_size=0), "vocab_size"), (dict(Dw=0), "Dw"),
    (dict(Da=-1), "Da"), (dict(Dg=0), "Dg"), (dict(Dv=0), "Dv"), (dict(ffn_dim=-4), "ffn_dim"),
    (dict(chunk_size=0), "chunk_size"), (dict(n_rwkv_layer=0), "n_rwkv_layer"),
    (dict(n_head=-2, head_size=-8), "n_head"), (dict(n_embd=2.0), "n_embd"),
    (dict(Dw=True), "Dw"), (dict(Da="4"), "Da"), (dict(ffn_dim=2 ** 31), "ffn_dim"),
    (dict(extra=1), "extra"), (dict(vocab_size=2 ** 30), "too large"),
])
def test_bad_config(change, match):
    with pytest.raises(ValueError, match=match):
        rx.RxPtModel(dict(BASE, **change))


def test_bad_config_missing_key_and_type():
    cfg = dict(BASE)
    del cfg["chunk_size"]
    with pytest.raises(ValueError, match="chunk_size"):
        rx.RxPtModel(cfg)
    with pytest.raises(TypeError, match="config"):
        rx.RxPtModel(list(BASE.items()))
    with pytest.raises(ValueError, match="seed"):
        rx.RxPtModel(BASE, seed=-1)
    with pytest.raises(ValueError, match="seed"):
        rx.RxPtModel(BASE, seed=2 ** 64)
    with pytest.raises(TypeError, match="seed"):
        rx.RxPtModel(BASE, seed=1.0)
    assert rx.RxPtModel(dict(BASE, moba_top_k=-3)).config["moba_top_k"] == -3


def test_bad_tokens_and_targets():
    m = rx.RxPtModel(PATTERNS["3R1A"], seed=9)
    tokens, targets = batch(m.config, 10)
    with pytest.raises(ValueError, match="forward"):
        m.backward(targets)
    for bad, err in [(np.append(tokens[:-1], 23).astype(np.int32), ValueError),
                     (np.append(tokens[:-1], -1).astype(np.int32), ValueError),
                     (tokens.astype(np.int64), TypeError), (tokens.astype(np.float32), TypeError),
                     (list(tokens), TypeError), (tokens.reshape(1, 1, T), ValueError),
                     (np.zeros(0, np.int32), ValueError), (np.zeros((2, 0), np.int32), ValueError),
                     (np.repeat(tokens, 2)[::2], ValueError)]:
        with pytest.raises(err, match="tokens"):
            m.forward(bad)
    m.forward(tokens)
    for bad, err in [(np.append(targets[:-1], 23).astype(np.int32), ValueError),
                     (np.append(targets[:-1], -2).astype(np.int32), ValueError),
                     (targets.astype(np.int64), TypeError), (targets[:-1].copy(), ValueError),
                     (targets.reshape(1, T), ValueError), (np.repeat(targets, 2)[::2], ValueError)]:
        with pytest.raises(err, match="targets"):
            m.backward(bad, ignore_index=IGNORE)
    with pytest.raises(ValueError, match="targets"):     # ignore_index < 0 keeps every position
        m.backward(np.append(targets[:-1], -1).astype(np.int32), ignore_index=-1)
    assert np.isfinite(m.backward(targets, ignore_index=IGNORE))
