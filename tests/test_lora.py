"""LoRA adapters (docs/maths.md §LoRA, docs/finetune.md §LoRA): the C
core's factored forward and its A and B gradients against the float64
reference of tests/reference/lora.py (W_eff = W + (alpha/r) A^T B^T through
tests/reference/model.py) and the reference's own gradients by finite
differences, on odd sizes (C 15, 3 heads of 5, r 3), with and without an
attention block; the same bits at any thread count, under recompute and
the chunked head, frozen base or not; no base grad written; then --tune
lora end to end (base bit-identical, loss falling, resume bit-exact),
load_model merged, exports and merge."""
import os

import numpy as np
import pytest
from test_finetune import _base_run, _tune
from test_interop import _RWKV, H64, TOL, _need, _rel, _tool_logits

import rwkvx_c as rx
from rwkvx_c import interop
from rwkvx_c.cli import main
from rwkvx_c.errors import InteropError
from rwkvx_c.interop.runs import lora_dict
from rwkvx_c.model.lora import DEFAULT_TARGETS, TARGETS, target_params
from rwkvx_c.run.checkpoint import read_checkpoint
from rwkvx_c.sample import load_model
from rwkvx_c.train import Trainer, TrainError, TrainOptions
from rwkvx_c.train.finetune import init_adapters, merge_adapters

from checks import FWD_TOL, GRAD_TOL, assert_rel, full_config, token_batch
from reference.autograd import Var
from reference.lora import lora_params
from reference.model import model_forward, model_loss

CFG = full_config(dict(n_embd=15, n_head=3, head_size=5, n_rwkv_layer=3, n_attn_layer=0,
                       vocab_size=19, Dw=4, Da=3, Dg=5, Dv=3, ffn_dim=21, chunk_size=4,
                       moba_top_k=1))
# one attention block; top-k 3 of T/chunk = 3 chunks: every chunk chosen, so
# the reference's selection cannot flip on rounding
HYB = dict(CFG, n_attn_layer=1, moba_top_k=3)
T, B, IGNORE, R, ALPHA = 11, 3, 4, 3, 5.0
# bf16 projections against the fp32 model (tests/test_bf16.py's bound for a
# model's grads: operands rounded to 8 bits, each product relative 2**-8)
BF16_GRAD_TOL = 0.10


def _data(seed):
    return token_batch(CFG["vocab_size"], B, T, seed, IGNORE)


def _model(cfg=CFG, seed=3, targets=tuple(TARGETS), precision="fp32"):
    """A model with adapters on every target, A and B random (B nonzero, so
    both grads and the forward see them)."""
    m = rx.RxPtModel(cfg, seed=seed, precision=precision)
    m.enable_lora(R, ALPHA, target_params(m.layers, targets))
    rng = np.random.default_rng(seed + 50)
    for v in m.lora.values():
        v[...] = rng.standard_normal(v.shape).astype(np.float32) * 0.2
    return m


def _adapters(m, as_var):
    ads = {}
    for k in m.lora:
        if k.endswith(".lora_A"):
            p = k[:-len(".lora_A")]
            a, b = (m.lora[p + s].astype(np.float64) for s in (".lora_A", ".lora_B"))
            ads[p] = (Var(a), Var(b)) if as_var else (a, b)
    return ads


def _reference(m, cfg, tokens, targets):
    params = {k: Var(np.array(v, np.float64), requires_grad=False) for k, v in m.params.items()}
    ads = _adapters(m, True)
    eff = lora_params(params, ads, R, ALPHA)
    logits = model_forward(eff, cfg, tokens)
    loss = model_loss(eff, cfg, tokens, targets, IGNORE)
    loss.backward()
    return loss.value, logits.value, {p: (a.grad, b.grad) for p, (a, b) in ads.items()}


def _step(m, tokens, targets, chunked=False):
    m.forward(tokens, return_logits=not chunked)
    loss = m.backward(targets, ignore_index=IGNORE)
    return loss, m.lora_grad_buffer.copy()


def test_targets_cover_every_projection_once():
    m = rx.RxPtModel(HYB, seed=0)
    names = target_params(m.layers, tuple(TARGETS))
    assert len(names) == len(set(names)) == 3 * 6 + 6
    assert all(n in m.params and m.params[n].ndim == 2 for n in names)
    default = target_params(m.layers, DEFAULT_TARGETS)
    assert len(default) == 3 * 6 + 4 and "blocks.3.cm.ffn_key_w" not in default


def test_zero_b_is_the_base_model_bit_for_bit():
    base = rx.RxPtModel(HYB, seed=3)
    tokens, _ = _data(1)
    ref = base.forward(tokens)
    m = rx.RxPtModel(HYB, seed=3)
    m.enable_lora(R, ALPHA, target_params(m.layers, tuple(TARGETS)))
    assert m.lora_rank == (R, ALPHA) and not np.any(m.lora_buffer)
    m.lora["blocks.0.tm.key_w.lora_A"][...] = 1.0   # A alone changes nothing while B is 0
    assert np.array_equal(m.forward(tokens), ref)


@pytest.mark.parametrize("cfg", [CFG, HYB], ids=["rwkv", "hybrid"])
def test_forward_and_adapter_grads_match_reference(cfg):
    m = _model(cfg)
    tokens, targets = _data(6)
    ref_loss, ref_logits, ref_grads = _reference(m, cfg, tokens, targets)
    assert_rel("lora.logits", m.forward(tokens), ref_logits, FWD_TOL)
    m.lora_grad_buffer[...] = 123.0     # written, never accumulated
    m.freeze_ranges(np.array([[0, m.param_buffer.size]], np.int64))
    loss = m.backward(targets, ignore_index=IGNORE)
    assert abs(loss - ref_loss) <= FWD_TOL * abs(ref_loss)
    for p, (ga, gb) in ref_grads.items():
        assert_rel(f"{p}.lora_A.grad", m.lora_grads[p + ".lora_A"], ga, GRAD_TOL)
        assert_rel(f"{p}.lora_B.grad", m.lora_grads[p + ".lora_B"], gb, GRAD_TOL)


def test_adapter_grads_finite_differences():
    m = _model()
    tokens, targets = _data(9)
    _, _, ref_grads = _reference(m, CFG, tokens, targets)
    params = {n: v.astype(np.float64) for n, v in m.params.items()}
    ads = _adapters(m, False)
    _step(m, tokens, targets)
    eps = 1e-5
    rng = np.random.default_rng(0)
    scale = max(max(np.abs(a).max(), np.abs(b).max()) for a, b in ref_grads.values())
    for p in ("blocks.0.tm.receptance_w", "blocks.1.tm.output_w", "blocks.2.cm.ffn_key_w",
              "blocks.1.cm.ffn_value_w"):
        for which, suffix in ((0, ".lora_A"), (1, ".lora_B")):
            g = ref_grads[p][which]
            for idx in (np.unravel_index(np.abs(g).argmax(), g.shape),
                        tuple(int(rng.integers(s)) for s in g.shape)):
                def loss_at(delta, p=p, which=which, idx=idx):
                    a = {k: (v[0].copy(), v[1].copy()) for k, v in ads.items()}
                    a[p][which][idx] += delta
                    return model_loss(lora_params(params, a, R, ALPHA), CFG, tokens, targets,
                                      IGNORE).value
                fd = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
                assert abs(g[idx] - fd) <= 1e-6 * scale + 1e-9, (p, suffix, idx, g[idx], fd)
                got = m.lora_grads[p + suffix][idx]
                assert abs(got - fd) <= GRAD_TOL * scale + 1e-9, (p, suffix, idx)


def test_bf16_adapter_grads_within_their_tolerance():
    tokens, targets = _data(12)
    _, g32 = _step(_model(HYB), tokens, targets)
    _, g16 = _step(_model(HYB, precision="bf16"), tokens, targets)
    err = np.abs(g16 - g32).max() / np.abs(g32).max()
    assert 0 < err <= BF16_GRAD_TOL


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("cfg", [CFG, HYB], ids=["rwkv", "hybrid"])
def test_same_bits_under_recompute_chunked_head_threads_and_frozen_base(cfg, precision,
                                                                        restore_threads):
    """The adapter grads and the loss are the same bits with recompute on
    or off, the chunked head, 1 to 3 threads, the base frozen or not; a
    frozen base gets no grad written (its grad arena keeps its filler)."""
    tokens, targets = _data(7)
    runs = []
    for recompute, chunked, threads, frozen in [(False, False, 1, False), (True, False, 1, False),
                                                (True, True, 2, False), (False, True, 3, True),
                                                (True, False, 2, True)]:
        rx.set_num_threads(threads)
        m = _model(cfg, precision=precision)
        m.recompute = recompute
        if frozen:
            m.freeze_ranges(np.array([[0, m.param_buffer.size]], np.int64))
            m.grad_buffer[...] = 123.0
        runs.append(_step(m, tokens, targets, chunked))
        if frozen:
            for p in target_params(m.layers, tuple(TARGETS)) + ["head", "emb"]:
                assert np.all(m.grads[p] == 123.0), p
    for loss, g in runs[1:]:
        assert loss == runs[0][0] and np.array_equal(g, runs[0][1])


def test_enable_lora_refuses_bad_input():
    m = rx.RxPtModel(CFG, seed=0)
    with pytest.raises(ValueError, match="r must be an int >= 1"):
        m.enable_lora(0, 1.0, ["blocks.0.tm.key_w"])
    with pytest.raises(ValueError, match="not a parameter"):
        m.enable_lora(2, 1.0, ["blocks.0.tm.nope"])
    with pytest.raises(ValueError, match="is not a block's projection"):
        m.enable_lora(2, 1.0, ["blocks.0.tm.w1"])
    with pytest.raises(ValueError, match="alpha"):
        m.enable_lora(2, float("nan"), ["blocks.0.tm.key_w"])
    with pytest.raises(ValueError, match="named twice"):
        m.enable_lora(2, 1.0, ["blocks.0.tm.key_w", "blocks.0.tm.key_w"])
    m.enable_lora(2, 1.0, ["blocks.0.tm.key_w"])
    with pytest.raises(ValueError, match="has adapters already"):
        m.enable_lora(2, 1.0, ["blocks.0.tm.key_w"])
    view = m.lora["blocks.0.tm.key_w.lora_B"]
    m.disable_lora()
    assert m.lora is None and m.lora_rank is None
    view[...] = 1.0    # the memory stays valid; the model no longer applies it
    assert np.array_equal(m.forward(np.arange(5, dtype=np.int32)),
                          rx.RxPtModel(CFG, seed=0).forward(np.arange(5, dtype=np.int32)))
    with pytest.raises(ValueError, match="or had others"):
        m.enable_lora(2, 1.0, ["blocks.0.tm.value_w"])
    m.enable_lora(2, 1.0, ["blocks.0.tm.key_w"])   # the same ones come back, as they were
    assert np.all(m.lora["blocks.0.tm.key_w.lora_B"] == 1.0)


def test_init_is_peft_s():
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform, a = sqrt(5)), B = 0,
    the same for the same seed and another for another."""
    m = rx.RxPtModel(CFG, seed=0)
    m.enable_lora(R, ALPHA, target_params(m.layers, DEFAULT_TARGETS))
    init_adapters(m, 7)
    a = m.lora["blocks.1.cm.ffn_value_w.lora_A"]     # in = ffn_dim = 21
    assert a.shape == (R, 21) and np.abs(a).max() <= 1 / np.sqrt(21) and np.abs(a).max() > 0.1
    assert not np.any(m.lora["blocks.1.cm.ffn_value_w.lora_B"])
    first = m.lora_buffer.copy()
    init_adapters(m, 7)
    assert np.array_equal(m.lora_buffer, first)
    init_adapters(m, 8)
    assert not np.array_equal(m.lora_buffer, first)


def test_merge_adapters_gives_the_same_model():
    m = _model(HYB)
    tokens, _ = _data(2)
    factored = m.forward(tokens)
    merge_adapters(m)
    assert m.lora is None
    assert _rel(m.forward(tokens), factored) <= FWD_TOL


def _lora_run(tmp_path, base, out, **kw):
    kw = {**dict(tune="lora", lora_r=4, steps=8, lr=1e-2, save_every=4, precision="fp32"), **kw}
    return _tune(tmp_path, base, out, **kw)


def test_lora_tune_trains_the_adapters_alone_and_resumes_bit_exact(tmp_path):
    base = _base_run(tmp_path)
    tensors, _, _ = read_checkpoint(base + "/checkpoint.safetensors")
    tr = _lora_run(tmp_path, base, "lo")
    n = tr.model.lora_buffer.size
    assert n == 2 * 4 * (4 * (32 + 32) + (32 + 64) + (64 + 32))   # six targets per block
    assert tr.optim.m.size == n
    val0 = tr.evaluate()["val_loss"]
    rows = []
    assert tr.run(on_step=rows.append)["val_loss"] < val0
    for name in tr.model.param_names:   # the base never moves
        assert np.array_equal(tr.model.params[name], tensors[name]), name
    ck, _, state = read_checkpoint(str(tmp_path / "lo" / "checkpoint.safetensors"))
    assert ck["optim.m"].shape == (n,)
    assert state["options"]["lora_alpha"] == 32.0 and state["options"]["tune"] == "lora"
    for k, v in tr.model.lora.items():
        assert np.array_equal(ck[k], v), k
    losses = [r["loss"] for r in rows if "loss" in r]
    tr2 = _lora_run(tmp_path, base, "lo2")
    tr2.run(stop=lambda: tr2.step_count >= 4)
    r = Trainer.resume(str(tmp_path / "lo2"))
    again = []
    r.run(on_step=again.append)
    assert [x["loss"] for x in again if "loss" in x] == losses[4:]
    assert np.array_equal(r.model.lora_buffer, tr.model.lora_buffer)
    # load_model merges: the model that was trained, without adapters
    m = load_model(str(tmp_path / "lo"))
    assert m.lora is None
    tokens = np.arange(20, dtype=np.int32) % 256
    assert _rel(m.forward(tokens), tr.model.forward(tokens)) <= FWD_TOL
    # a LoRA run as --init-from source starts from the merged weights
    tr3 = _tune(tmp_path, str(tmp_path / "lo"), "next", steps=1)
    assert np.array_equal(tr3.model.param_buffer, m.param_buffer)


def test_lora_options_refused_in_one_line(tmp_path):
    base = _base_run(tmp_path)
    with pytest.raises(TrainError, match=r"--lora-targets: unknown target 'att\.nope'"):
        _lora_run(tmp_path, base, "a", lora_targets="att.key,att.nope")
    with pytest.raises(TrainError, match="names no projection of this model"):
        _lora_run(tmp_path, base, "b", lora_targets="attn.q")
    with pytest.raises(TrainError, match="--lora-targets sets the adapters of --tune lora"):
        _tune(tmp_path, base, "c", lora_targets="att.key")
    with pytest.raises(TrainError, match="lora_r must be an integer > 0, got 0"):
        TrainOptions(tune="lora", lora_r=0).resolved()
    with pytest.raises(TrainError, match="--tune lora freezes the whole base"):
        _lora_run(tmp_path, base, "d", freeze="ln")


def test_merged_export_runs_in_the_rwkv_package_and_lora_file_is_rwkv_peft_s(tmp_path, capsys):
    """export --format rwkv7 of a LoRA run is the merged model: the rwkv
    package reproduces our logits; export --format lora holds RWKV-PEFT's
    names and shapes, and RWKV-PEFT's merge (W += B @ A * alpha / r on the
    base's export) gives the merged export again; merge makes a plain run."""
    _need("torch", "rwkv")
    base = _base_run(tmp_path, dict(H64, n_rwkv_layer=2))
    tr = _lora_run(tmp_path, base, "run", steps=3)
    tr.run()
    run = str(tmp_path / "run")
    rng = np.random.default_rng(0)
    m = load_model(run)
    # the trained adapters are small after 3 steps: make the difference plain
    for v in tr.model.lora.values():
        v[...] = rng.standard_normal(v.shape).astype(np.float32) * 0.05
    tr.save()
    m = load_model(run)
    tokens = np.frombuffer(b"def f(x):\n    return x", np.uint8).astype(np.int32)
    ours = tr.model.forward(tokens)
    assert _rel(load_model(base).forward(tokens), ours) > 100 * TOL   # the adapters matter
    assert main(["export", run, "--format", "rwkv7", "--out", str(tmp_path / "m.pth")]) == 0
    assert "adapters are merged" in capsys.readouterr().out
    err = _rel(ours, _tool_logits(_RWKV, tmp_path / "m.pth", tokens, tmp_path))
    print(f"rwkv package with the merged LoRA export vs RxPtModel: {err:.2e}")
    assert err <= TOL
    # the adapters alone, as RWKV-PEFT names them
    assert main(["export", run, "--format", "lora", "--out", str(tmp_path / "lora.pth")]) == 0
    ad = interop.load_pth(str(tmp_path / "lora.pth"))
    assert ad.pop("lora_alpha").tolist() == [32.0] and ad.pop("lora_r").tolist() == [4.0]
    assert ad["blocks.0.att.receptance.lora_A"].shape == (4, 128)
    assert ad["blocks.1.ffn.key.lora_B"].shape == (512, 4)
    assert ad["blocks.1.ffn.value.lora_A"].shape == (4, 512)
    assert len(ad) == 2 * 2 * 6
    w = interop.load_pth(str(tmp_path / "m.pth"))
    interop.export_model(load_model(base), "rwkv7", str(tmp_path / "base.pth"))
    peft = interop.load_pth(str(tmp_path / "base.pth"))
    for k in list(ad):
        if k.endswith(".lora_A"):
            pre = k[:-len(".lora_A")]
            A, Bm = ad[k].astype(np.float64), ad[pre + ".lora_B"].astype(np.float64)
            peft[pre + ".weight"] = peft[pre + ".weight"] + Bm @ A * (32.0 / A.shape[0])
    assert set(peft) == set(w)
    for k in w:
        assert np.allclose(peft[k], w[k], rtol=0, atol=1e-6), k
    # rwkvx-c merge: a plain run folder with the merged weights; never over its input
    assert main(["merge", run, "--out", str(tmp_path / "merged")]) == 0
    merged = load_model(str(tmp_path / "merged"))
    assert merged.lora is None and np.array_equal(merged.param_buffer, m.param_buffer)
    ck, _, _ = read_checkpoint(str(tmp_path / "merged" / "checkpoint.safetensors"))
    assert not any("lora" in k or k.startswith("optim.") for k in ck)
    before = os.path.getmtime(os.path.join(run, "checkpoint.safetensors"))
    assert main(["merge", run, "--out", run]) == 1
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert os.path.getmtime(os.path.join(run, "checkpoint.safetensors")) == before
    # a run without adapters: one line each
    assert main(["export", base, "--format", "lora", "--out", str(tmp_path / "x.pth")]) == 1
    assert "has no LoRA adapters" in capsys.readouterr().err.strip().splitlines()[-1]
    assert main(["merge", base, "--out", str(tmp_path / "m2")]) == 1
    assert "holds no LoRA adapters" in capsys.readouterr().err
    with pytest.raises(InteropError, match="no LoRA adapters"):
        interop.export_model(m, "lora", str(tmp_path / "y.pth"))


def test_peft_loads_the_adapters_onto_the_hf_export(tmp_path):
    """export --format peft of a LoRA run, put on the hf export of its base
    by the peft package (PeftModel.from_pretrained on rwkv7-hf's model),
    reproduces our logits; so does the hf export of the run (merged)."""
    _need("torch", "safetensors", "transformers", "rwkv7_hf", "peft")
    import torch
    from peft import PeftModel
    from rwkv7_hf import RWKV7ForCausalLM
    base = _base_run(tmp_path, dict(H64, n_rwkv_layer=2))
    tr = _lora_run(tmp_path, base, "run", steps=2)
    tr.run()
    rng = np.random.default_rng(1)
    for v in tr.model.lora.values():
        v[...] = rng.standard_normal(v.shape).astype(np.float32) * 0.05
    tr.save()
    run = str(tmp_path / "run")
    for fmt, src, out in (("hf", base, "base_hf"), ("peft", run, "peft"), ("hf", run, "hf")):
        assert main(["export", src, "--format", fmt, "--out", str(tmp_path / out)]) == 0
    tokens = np.frombuffer(b"def f(x):\n    return x", np.uint8).astype(np.int32)
    ours = tr.model.forward(tokens)

    def logits(m):
        m.eval()
        with torch.no_grad():
            return m(torch.from_numpy(tokens.astype(np.int64))[None]).logits[0].float().numpy()

    hf_base = RWKV7ForCausalLM.from_pretrained(str(tmp_path / "base_hf"),
                                               torch_dtype=torch.float32)
    assert _rel(logits(hf_base), ours) > 100 * TOL            # the adapters matter
    peft = PeftModel.from_pretrained(hf_base, str(tmp_path / "peft"))
    err = _rel(logits(peft), ours)
    print(f"peft on rwkv7-hf with the exported adapters vs RxPtModel: {err:.2e}")
    assert err <= TOL
    merged = RWKV7ForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32)
    assert _rel(logits(merged), ours) <= TOL


def test_cli_lora_tune_with_train_parts(tmp_path, capsys):
    base = _base_run(tmp_path)
    data = ["--data", str(tmp_path / "corpus.txt"), "--cache-dir", str(tmp_path / "cache")]
    fast = ["--steps", "2", "--batch", "2", "--seq-len", "16", "--eval-tokens", "32",
            "--threads", "1", "--no-progress"]
    out = str(tmp_path / "lo")
    assert main(["train", "--init-from", base, "--tune", "lora", "--lora-r", "2",
                 "--lora-alpha", "4", "--lora-targets", "att.key,ffn.value", "--train-parts",
                 "ln", "--out", out] + data + fast) == 0
    ck, _, state = read_checkpoint(os.path.join(out, "checkpoint.safetensors"))
    src, _, _ = read_checkpoint(os.path.join(base, "checkpoint.safetensors"))
    ads = sorted(k for k in ck if "lora" in k)
    assert ads == sorted(f"blocks.{i}.{p}.{s}" for i in range(2)
                         for p in ("tm.key_w", "cm.ffn_value_w") for s in ("lora_A", "lora_B"))
    assert state["options"]["lora_r"] == 2 and state["options"]["lora_alpha"] == 4.0
    n_ln = sum(v.size for k, v in src.items() if k.rsplit(".", 1)[-1].startswith("ln")
               and not k.startswith("optim."))
    assert ck["optim.m"].size == sum(ck[k].size for k in ads) + n_ln
    assert not np.array_equal(ck["blocks.0.ln1_w"], src["blocks.0.ln1_w"])   # ln trained
    # the frozen base is named, not held (tests/test_base_checkpoint.py)
    assert "blocks.0.tm.key_w" not in ck and os.path.samefile(
        state["base"]["path"], os.path.join(base, "checkpoint.safetensors"))
    with pytest.raises(SystemExit) as e:
        main(["train", "--init-from", base, "--tune", "lora", "--lora-r", "0",
              "--out", str(tmp_path / "bad")] + data + fast)
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "argument --lora-r: expected a positive integer, got '0'")


def test_lora_file_of_a_hybrid_uses_rwkv_x_names():
    m = _model(dict(HYB, ln0=1))
    sd = lora_dict(m, _adapters(m, False), ALPHA)
    assert sd["lora_alpha"].tolist() == [ALPHA] and sd["lora_r"].tolist() == [R]
    assert sd["rwkv.blocks.0.att.receptance.lora_A"].shape == (R, 15)
    assert sd["rwkv.blocks.2.ffn.value.lora_B"].shape == (15, R)
    assert sd["moba.0.att.output.lora_B"].shape == (15, R)
    assert sd["moba.0.ffn.key.lora_A"].shape == (R, 15)
    assert np.array_equal(sd["moba.0.att.key.lora_A"], m.lora["blocks.3.key_w.lora_A"])
    assert len(sd) == 2 + 2 * (3 * 6 + 6)
