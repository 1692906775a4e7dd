"""DoRA (--adapter dora, docs/maths.md §DoRA): the C core's forward and its
grads of A, B and the magnitudes against a float64 reference written from
the docs (the column norms held constant, as peft does), that reference's
gradients against finite differences, the norms over a frozen bf16 / Q8_0 /
Q4_0 base, a tune that starts as its base, resumes bit-exact and merges,
and the adapter exports that cannot hold DoRA refused in one line. peft's
judgement of the exported folder is tests/test_adapter_kinds.py's."""
import numpy as np
import pytest
from test_finetune import _base_run
from test_interop import _rel
from test_lora import ALPHA, CFG, HYB, IGNORE, R, _data, _lora_run

import rwkvx_c as rx
from rwkvx_c.cli import main
from rwkvx_c.model.lora import M_SUFFIX, TARGETS, dora_merged, target_params
from rwkvx_c.run.checkpoint import read_checkpoint
from rwkvx_c.sample import load_model

from checks import FWD_TOL, GRAD_TOL, assert_rel
from reference.autograd import Var, fd_grad
from reference.model import model_forward, model_loss

S = ALPHA / R


def _dora_model(cfg, seed=3):
    """DoRA adapters on every target, A, B random and each magnitude its
    column's norm times a random factor (so that every part matters)."""
    m = rx.RxPtModel(cfg, seed=seed)
    m.enable_lora(R, ALPHA, target_params(m.layers, tuple(TARGETS)), dora=True)
    rng = np.random.default_rng(seed + 4)
    for k, v in m.lora.items():
        if not k.endswith(M_SUFFIX):
            v[...] = rng.standard_normal(v.shape).astype(np.float32) * 0.2
    for k, v in m.lora.items():
        if k.endswith(M_SUFFIX):
            v[...] = m.lora_norms(k[:-len(M_SUFFIX)]) * rng.uniform(0.5, 1.5, v.shape)
    return m


def _eff(W, A, B, M):
    """W' = W_eff (M / n) [in, out], W_eff = W + s A^T B^T, n its column
    norms over in taken as a constant (peft's detached norm)."""
    eff = W + (A.T @ B.T) * S
    n = np.linalg.norm(eff.value, axis=0)
    return eff * (M / Var(n[None, :], requires_grad=False))


def _reference(m):
    """{param: Var} of W' for every adapted weight, and the adapter Vars."""
    params = {k: Var(np.array(v, np.float64), requires_grad=False) for k, v in m.params.items()}
    ads = {}
    for k in m.lora:
        if k.endswith(".lora_A"):
            p = k[:-len(".lora_A")]
            ads[p] = tuple(Var(m.lora[p + s].astype(np.float64).reshape(shape))
                           for s, shape in ((".lora_A", m.lora[p + ".lora_A"].shape),
                                            (".lora_B", m.lora[p + ".lora_B"].shape),
                                            (M_SUFFIX, (1, -1))))
    eff = dict(params)
    for p, (A, B, M) in ads.items():
        eff[p] = _eff(params[p], A, B, M)
    return eff, ads


@pytest.mark.parametrize("cfg", [CFG, HYB], ids=["rwkv", "hybrid"])
def test_dora_forward_and_grads_match_reference(cfg):
    m = _dora_model(cfg)
    tokens, targets = _data(6)
    for p in {k[:-len(M_SUFFIX)] for k in m.lora if k.endswith(M_SUFFIX)}:
        want = np.linalg.norm(dora_merged(m.params[p], m.lora[p + ".lora_A"],
                                          m.lora[p + ".lora_B"], S, None), axis=0)
        assert_rel(f"{p}.norms", m.lora_norms(p), want, FWD_TOL)
    eff, ads = _reference(m)
    loss = model_loss(eff, cfg, tokens, targets, IGNORE)
    loss.backward()
    assert_rel("dora.logits", m.forward(tokens), model_forward(eff, cfg, tokens).value, FWD_TOL)
    m.freeze_ranges(np.array([[0, m.param_buffer.size]], np.int64))
    got = m.backward(targets, ignore_index=IGNORE)
    assert abs(got - loss.value) <= FWD_TOL * abs(loss.value)
    for p, (a, b, mag) in ads.items():
        assert_rel(f"{p}.lora_A.grad", m.lora_grads[p + ".lora_A"], a.grad, GRAD_TOL)
        assert_rel(f"{p}.lora_B.grad", m.lora_grads[p + ".lora_B"], b.grad, GRAD_TOL)
        assert_rel(f"{p}.magnitude.grad", m.lora_grads[p + M_SUFFIX], mag.grad[0], GRAD_TOL)


def test_dora_reference_grads_match_finite_differences():
    """The reference's autograd of A, B and M (norm held at its value) is
    the finite difference of the loss over W' with that norm: a sign or a
    factor wrong in either shows here."""
    cfg = dict(CFG, n_rwkv_layer=1)
    m = _dora_model(cfg)
    tokens, targets = _data(2)
    eff, ads = _reference(m)
    p = "blocks.0.cm.ffn_key_w"
    A, B, M = (v.value for v in ads[p])
    n = np.linalg.norm(m.params[p] + S * A.T @ B.T, axis=0)   # held constant

    def loss_at(a, b, mag):
        w = (m.params[p] + S * a.T @ b.T) * (mag / n[None, :])
        e = dict(eff, **{p: Var(w, requires_grad=False)})
        return model_loss(e, cfg, tokens, targets, IGNORE).value

    loss = model_loss(eff, cfg, tokens, targets, IGNORE)
    loss.backward()
    rng = np.random.default_rng(0)
    for i, v in enumerate(ads[p]):
        for _ in range(3):
            idx = tuple(int(rng.integers(d)) for d in v.value.shape)
            fd = fd_grad(loss_at, [A, B, M], i, idx)
            assert abs(fd - v.grad[idx]) <= 1e-6 + 1e-5 * abs(fd), (i, idx, fd, v.grad[idx])


def _held_and_flat(dtype):
    """(held, flat, src, names): a model whose projections a base holds in
    dtype, a float32 model holding the base's decoded values, the model
    they were made from and the projections, DoRA adapters on both."""
    from test_base import CFG as cfg  # an attention block too; sizes multiples of 32
    held = rx.RxPtModel(cfg, seed=5, init=False)
    src = rx.RxPtModel(cfg, seed=5)
    held.param_buffer[...] = src.param_buffer
    names = target_params(src.layers, tuple(TARGETS))
    held.set_base(dtype, names)
    for n in names:
        held.base_fill(n, src.params[n])
    flat = rx.RxPtModel(cfg, seed=5)
    flat.param_buffer[...] = src.param_buffer
    for n in names:
        flat.params[n][...] = held.base_tensor(n)
    for mdl in (held, flat):
        mdl.enable_lora(R, ALPHA, names, dora=True)
    return held, flat, src, names


@pytest.mark.parametrize("dtype", ["bf16", "q8_0", "q4_0"])
def test_dora_over_a_frozen_base_reads_the_base_values(dtype):
    """A base held in dtype: the norms are those of its decoded values, and
    the forward and grads equal a float32 model holding those values."""
    held, flat, _, _ = _held_and_flat(dtype)
    rng = np.random.default_rng(2)
    for k, v in held.lora.items():
        if not k.endswith(M_SUFFIX):
            v[...] = rng.standard_normal(v.shape).astype(np.float32) * 0.2
            flat.lora[k][...] = v
    for k, v in held.lora.items():
        if k.endswith(M_SUFFIX):
            assert np.array_equal(held.lora_norms(k[:-len(M_SUFFIX)]),
                                  flat.lora_norms(k[:-len(M_SUFFIX)])), k
            v[...] = flat.lora[k][...] = 1.2 * held.lora_norms(k[:-len(M_SUFFIX)])
    tokens = (np.arange(2 * 9, dtype=np.int32) % 37).reshape(2, 9)
    assert_rel("held.logits", held.forward(tokens), flat.forward(tokens), FWD_TOL)
    for mdl in (held, flat):
        mdl.freeze_ranges(np.array([[0, mdl.param_buffer.size]], np.int64))
        mdl.backward(tokens, ignore_index=-1)
    for k in held.lora:
        assert_rel(f"{k}.grad", held.lora_grads[k], flat.lora_grads[k], GRAD_TOL)


def test_dora_tune_starts_as_its_base_resumes_bit_exact_and_merges(tmp_path, capsys):
    base = _base_run(tmp_path)
    tr = _lora_run(tmp_path, base, "do", adapter="dora")
    tokens = np.arange(20, dtype=np.int32) % 256
    plain = load_model(base).forward(tokens)
    assert _rel(tr.model.forward(tokens), plain) <= FWD_TOL   # M = ||W||, B = 0
    mags = {k: v.copy() for k, v in tr.model.lora.items() if k.endswith(M_SUFFIX)}
    rows = []
    tr.run(on_step=rows.append)
    assert all(not np.array_equal(tr.model.lora[k], v) for k, v in mags.items())
    ck, _, state = read_checkpoint(str(tmp_path / "do" / "checkpoint.safetensors"))
    assert state["options"]["adapter"] == "dora" and set(mags) <= set(ck)
    from test_adapter_kinds import _resumed
    r = _resumed(_lora_run(tmp_path, base, "do2", adapter="dora"), rows, 4)
    assert np.array_equal(r.model.lora_buffer, tr.model.lora_buffer)
    ours = tr.model.forward(tokens)
    assert _rel(load_model(str(tmp_path / "do")).forward(tokens), ours) <= FWD_TOL
    merged = str(tmp_path / "merged")
    assert main(["merge", str(tmp_path / "do"), "--out", merged]) == 0
    assert _rel(load_model(merged).forward(tokens), ours) <= FWD_TOL
    capsys.readouterr()
    for fmt in ("lora", "gguf-lora"):   # files without a place for the magnitudes
        out = tmp_path / f"x.{fmt}"
        assert main(["export", str(tmp_path / "do"), "--format", fmt, "--out", str(out)]) != 0
        err = capsys.readouterr().err.strip()
        assert not out.exists() and len(err.splitlines()) == 1, err
        assert f"--format {fmt} cannot hold DoRA's magnitude vectors; --format peft" in err


def test_a_peft_dora_folder_imports_and_trains_on_as_dora(tmp_path):
    """Our --format peft folder of a DoRA tune, put back on its base by
    import (then trained on by --resume) and by --init-from --base: DoRA
    tunes with the folder's magnitudes, the model the one we trained."""
    from test_train import _corpus
    base = _base_run(tmp_path)
    tr = _lora_run(tmp_path, base, "do", adapter="dora", steps=2)
    tr.run()
    peft, cont, init = (str(tmp_path / d) for d in ("peft", "cont", "init"))
    assert main(["export", str(tmp_path / "do"), "--format", "peft", "--out", peft]) == 0
    tokens = np.arange(20, dtype=np.int32) % 256
    ours = tr.model.forward(tokens)
    assert main(["import", peft, "--base", base, "--out", cont]) == 0
    assert _rel(load_model(cont).forward(tokens), ours) <= FWD_TOL
    data = ["--data", _corpus(tmp_path), "--cache-dir", str(tmp_path / "cache"), "--batch", "2",
            "--seq-len", "16", "--eval-tokens", "32", "--threads", "2", "--no-progress"]
    assert main(["train", "--resume", "--out", cont, "--steps", "2", *data]) == 0
    assert main(["train", "--init-from", peft, "--base", base, "--out", init, "--steps", "1",
                 "--lr", "1e-9", *data]) == 0
    for run, within in ((cont, 1e-2), (init, 1e-6)):   # init: one step at lr 1e-9
        ck, _, state = read_checkpoint(run + "/checkpoint.safetensors")
        assert state["options"]["adapter"] == "dora", run
        for k, v in tr.model.lora.items():
            assert ck[k].shape == v.shape and np.abs(ck[k] - v).max() < within, (run, k)


def test_dora_on_a_q8_0_base_samples_held_as_it_trained(tmp_path):
    """A DoRA tune on a Q8_0 base: the run held as it trained (rows in
    Q8_0, adapters and magnitudes unmerged) is the trained model, and greedy
    generation (the batched engine's step, which takes the norms itself) picks
    the forward's argmax at every new token."""
    from rwkvx_c.sample import generate, load_run
    base = _base_run(tmp_path)
    tr = _lora_run(tmp_path, base, "q", adapter="dora", base_dtype="q8_0", steps=4)
    tr.run()
    held, tok = load_run(str(tmp_path / "q"), hold_base=True)
    assert held.base_names and any(k.endswith(M_SUFFIX) for k in held.lora)
    text = "".join(generate(held, "def f(x):", max_new_tokens=8, temperature=0.0, tokenizer=tok))
    ids = np.array(tok.encode("def f(x):" + text), np.int32)
    n = len(tok.encode("def f(x):"))
    logits = held.forward(ids)
    assert np.array_equal(np.argmax(logits[n - 1:-1], axis=-1), ids[n:])
    assert _rel(logits, tr.model.forward(ids)) <= FWD_TOL


def test_norms_over_a_held_base_are_kept_while_what_they_read_stays():
    """Over a held base the column norms are taken once and kept while the
    adapters' A, B (bit for bit) and the base's contents stay: a forward,
    backward or generation step then takes no norms (the profile's "dora
    norms" slot stays empty); one changed bit of a B, a refilled base
    tensor or a new magnitude gives the results of a float32 model that
    takes every norm afresh. A float32 W (its NumPy view can be written
    unseen) is never kept."""
    held, flat, src, names = _held_and_flat("q8_0")
    rng = np.random.default_rng(4)
    for k, v in held.lora.items():
        v[...] = flat.lora[k][...] = rng.standard_normal(v.shape).astype(np.float32) * 0.2 + \
            (1.0 if k.endswith(M_SUFFIX) else 0.0)
    tokens = (np.arange(2 * 9, dtype=np.int32) % 37).reshape(2, 9)

    def norms_taken(mdl, run):
        rx.profile_enable(True)
        try:
            out = run(mdl)
            return rx.profile()["dora norms"] > 0.0, out
        finally:
            rx.profile_enable(False)

    def same(what):
        taken, ours = norms_taken(held, lambda mdl: mdl.forward(tokens))
        assert_rel(f"{what}.logits", ours, flat.forward(tokens), FWD_TOL)
        return taken

    assert same("first")   # nothing kept yet for these adapters
    taken, _ = norms_taken(held, lambda mdl: (mdl.forward(tokens), mdl.backward(
        tokens, ignore_index=-1), rx.GenState(mdl, 1, max_len=16, max_tokens=9).step(
            [0], [9], tokens[0])))
    assert not taken   # kept through the forward, backward and generation steps
    assert norms_taken(flat, lambda mdl: mdl.forward(tokens))[0]   # a float32 W: always taken
    b = names[1] + ".lora_B"
    for mdl in (held, flat):
        mdl.lora[b][0, 0] = np.nextafter(mdl.lora[b][0, 0], np.float32(np.inf))
    assert same("one bit of B")
    for mdl in (held, flat):
        mdl.lora[names[0] + M_SUFFIX][...] *= 1.5
    assert not same("new magnitudes")   # c = M / n moves, the norms stay
    w = src.params[names[2]] * 1.25
    held.base_fill(names[2], w)
    flat.params[names[2]][...] = held.base_tensor(names[2])
    assert same("refilled base")


def test_the_batched_engine_takes_the_norms_itself():
    """A fresh DoRA model's first GenState step (no forward before it to
    compute the norms) gives the forward's logits."""
    m = _dora_model(CFG)
    state = rx.GenState(m, 1, max_len=32, max_tokens=16)
    tokens = np.arange(9, dtype=np.int32) % CFG["vocab_size"]
    first = state.step([0], [9], tokens)[-1].copy()
    assert_rel("gen.logits", first, m.forward(tokens)[-1], FWD_TOL)


def test_a_zero_column_is_refused_at_init_and_never_divides():
    """A weight with a zero column has no direction there: a DoRA tune is
    refused in one line; the core itself scales such a column by 0 and gives
    its magnitude a zero grad, never 0 / 0."""
    from rwkvx_c.train import TrainError, TrainOptions
    from rwkvx_c.train.finetune import make_optimizer
    m = rx.RxPtModel(CFG, seed=3)
    m.params["blocks.1.tm.output_w"][:, 4] = 0.0
    with pytest.raises(TrainError, match=r"--adapter dora: blocks\.1\.tm\.output_w has a zero "
                                         r"column \(output 4\)"):
        make_optimizer(m, TrainOptions(tune="lora", adapter="dora", lora_r=R).resolved())
    m = _dora_model(CFG)
    p = "blocks.1.tm.output_w"
    m.params[p][:, 4] = 0.0
    m.lora[p + ".lora_B"][4] = 0.0
    tokens, targets = _data(6)
    assert np.all(np.isfinite(m.forward(tokens)))
    m.freeze_ranges(np.array([[0, m.param_buffer.size]], np.int64))
    assert np.isfinite(m.backward(targets, ignore_index=IGNORE))
    assert np.all(np.isfinite(m.lora_grad_buffer)) and m.lora_grads[p + M_SUFFIX][4] == 0.0
