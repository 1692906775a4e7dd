"""Adapter kinds of --tune lora (--adapter, docs/finetune.md §Adapter kinds):
for each kind, the C core's forward and adapter grads against the float64
reference of tests/reference/lora.py, a tune that resumes bit-exact, the
merged model, the RWKV-PEFT file, and the PEFT folder judged by the peft
package on the rwkv7-hf export of the base (within TOL of the largest logit)."""
import json
import math
import os

import numpy as np
import pytest
from test_finetune import _base_run, _tune
from test_interop import H64, TOL, _need, _rel
from test_lora import ALPHA, CFG, HYB, IGNORE, R, _adapters, _data, _lora_run

import rwkvx_c as rx
from rwkvx_c.cli import build_parser, main
from rwkvx_c.errors import InteropError
from rwkvx_c.interop.pth import load_pth
from rwkvx_c.interop.source import read_source
from rwkvx_c.model.lora import (
    ADAPTER_KINDS,
    ADAPTERS,
    TARGETS,
    core_alpha,
    plain_alpha,
    target_params,
)
from rwkvx_c.run.checkpoint import read_checkpoint
from rwkvx_c.sample import load_model
from rwkvx_c.train import Trainer, TrainError, TrainOptions
from rwkvx_c.train.finetune import lisa_blocks, unfreeze

from checks import FWD_TOL, GRAD_TOL, assert_rel
from reference.autograd import Var
from reference.lora import lora_params
from reference.model import model_forward, model_loss


def test_every_kind_is_declared_once_and_is_an_adapter_choice():
    assert tuple(ADAPTERS) == ADAPTER_KINDS and ADAPTER_KINDS[0] == "lora"
    args = build_parser().parse_args(["train", "--adapter", "rslora", "--out", "x"])
    assert args.adapter == "rslora"


@pytest.mark.parametrize("cfg", [CFG, HYB], ids=["rwkv", "hybrid"])
def test_rslora_forward_and_grads_match_reference(cfg):
    """rsLoRA's scale alpha / sqrt(r) reaches the C core as the plain alpha
    alpha * sqrt(r): the reference computes with alpha / sqrt(r) itself."""
    m = rx.RxPtModel(cfg, seed=3)
    m.enable_lora(R, plain_alpha("rslora", R, ALPHA), target_params(m.layers, tuple(TARGETS)))
    rng = np.random.default_rng(7)
    for v in m.lora.values():
        v[...] = rng.standard_normal(v.shape).astype(np.float32) * 0.2
    tokens, targets = _data(6)
    params = {k: Var(np.array(v, np.float64), requires_grad=False) for k, v in m.params.items()}
    ads = _adapters(m, True)
    eff = lora_params(params, ads, R, ALPHA, rs=True)
    ref_logits = model_forward(eff, cfg, tokens).value
    loss = model_loss(eff, cfg, tokens, targets, IGNORE)
    loss.backward()
    assert_rel("rslora.logits", m.forward(tokens), ref_logits, FWD_TOL)
    m.freeze_ranges(np.array([[0, m.param_buffer.size]], np.int64))
    got = m.backward(targets, ignore_index=IGNORE)
    assert abs(got - loss.value) <= FWD_TOL * abs(loss.value)
    for p, (a, b) in ads.items():
        assert_rel(f"{p}.lora_A.grad", m.lora_grads[p + ".lora_A"], a.grad, GRAD_TOL)
        assert_rel(f"{p}.lora_B.grad", m.lora_grads[p + ".lora_B"], b.grad, GRAD_TOL)


def _resumed(tr, rows, at):
    """tr, a new run like the one whose step rows are `rows`, stopped at
    step `at` and resumed: its later losses are those rows' bit for bit.
    Returns the resumed Trainer."""
    tr.run(stop=lambda: tr.step_count >= at)
    r = Trainer.resume(str(tr.out_dir))
    again = []
    r.run(on_step=again.append)
    assert [x["loss"] for x in again if "loss" in x] == \
        [x["loss"] for x in rows if "loss" in x][at:]
    return r


def test_rslora_tune_resumes_bit_exact_and_merges(tmp_path):
    base = _base_run(tmp_path)
    tr = _lora_run(tmp_path, base, "rs", adapter="rslora", lora_alpha=8.0)
    assert tr.model.lora_rank == (4, 8.0 * 2.0)   # r 4: the plain alpha alpha * sqrt(r)
    rows = []
    tr.run(on_step=rows.append)
    _, _, state = read_checkpoint(str(tmp_path / "rs" / "checkpoint.safetensors"))
    assert state["options"]["adapter"] == "rslora"
    r = _resumed(_lora_run(tmp_path, base, "rs2", adapter="rslora", lora_alpha=8.0), rows, 4)
    assert r.opts.adapter == "rslora"
    assert np.array_equal(r.model.lora_buffer, tr.model.lora_buffer)
    tokens = np.arange(20, dtype=np.int32) % 256
    assert _rel(load_model(str(tmp_path / "rs")).forward(tokens),
                tr.model.forward(tokens)) <= FWD_TOL
    # the RWKV-PEFT file holds the plain LoRA of the same scale
    out = str(tmp_path / "rs.pth")
    assert main(["export", str(tmp_path / "rs"), "--format", "lora", "--out", out]) == 0
    assert load_pth(out)["lora_alpha"].tolist() == [16.0]


def test_pissa_init_is_the_principal_split_and_the_tune_resumes_bit_exact(tmp_path):
    """PiSSA's A0, B0 are the top-r singular directions of W scaled as PEFT
    does, the arena holds W - s B0 A0, so step 0 is the base model to
    float32 rounding; the checkpoint holds A0, B0 beside A, B; a resume is
    bit-exact; the merged model (over the original base) is the trained one."""
    base = _base_run(tmp_path)
    src, _, _ = read_checkpoint(base + "/checkpoint.safetensors")
    tr = _lora_run(tmp_path, base, "pi", adapter="pissa", lora_alpha=8.0)
    r, s = 4, 8.0 / 4
    p = "blocks.1.tm.key_w"
    W = src[p].astype(np.float64)
    A0, B0 = (tr.model.lora[p + k].astype(np.float64) for k in (".lora_A", ".lora_B"))
    u, sv, vt = np.linalg.svd(W.T)
    assert np.allclose(np.abs(A0), np.abs(np.sqrt(sv[:r] / s)[:, None] * vt[:r]), atol=1e-5)
    assert np.allclose(np.abs(B0), np.abs(u[:, :r] * np.sqrt(sv[:r] / s)), atol=1e-5)
    assert np.allclose(tr.model.params[p] + s * A0.T @ B0.T, W, atol=1e-6)
    rows = []
    tr.run(on_step=rows.append)
    ck, _, state = read_checkpoint(str(tmp_path / "pi" / "checkpoint.safetensors"))
    assert state["options"]["adapter"] == "pissa" and p not in ck
    assert np.array_equal(ck[p + ".lora_A0"], A0.astype(np.float32))
    r2 = _resumed(_lora_run(tmp_path, base, "pi2", adapter="pissa", lora_alpha=8.0), rows, 4)
    assert np.array_equal(r2.model.lora_buffer, tr.model.lora_buffer)
    tokens = np.arange(20, dtype=np.int32) % 256
    merged = load_model(str(tmp_path / "pi"))
    assert _rel(merged.forward(tokens), tr.model.forward(tokens)) <= FWD_TOL
    # a PiSSA run as --init-from source starts from the merged weights
    assert np.array_equal(_tune(tmp_path, str(tmp_path / "pi"), "next", steps=1)
                          .model.param_buffer, merged.param_buffer)
    out = str(tmp_path / "pi.pth")   # RWKV-PEFT's file: the converted LoRA, rank 2r
    assert main(["export", str(tmp_path / "pi"), "--format", "lora", "--out", out]) == 0
    sd = load_pth(out)
    assert sd["lora_alpha"].tolist() == [16.0] and sd["lora_r"].tolist() == [8.0]
    with pytest.raises(TrainError, match="--adapter pissa splits given weights"):
        TrainOptions(tune="lora", adapter="pissa").resolved()
    # GRPO's KL reference is not the residual the base holds (adapters off)
    with pytest.raises(TrainError, match="--adapter pissa with --beta > 0 needs --ref-from"):
        TrainOptions(tune="lora", adapter="pissa", init_from=str(tmp_path), objective="grpo",
                     beta=0.04).resolved()


@pytest.mark.parametrize("kind", ["pissa", "dora"])
def test_unfreeze_merges_into_what_the_model_holds(tmp_path, kind):
    """--unfreeze-at: the adapters fold into the weights the model holds
    (PiSSA's residual; DoRA's magnitudes applied; a q8_0 base decoded
    first), the model the same across the switch."""
    base = _base_run(tmp_path)
    tr = _lora_run(tmp_path, base, "u", adapter=kind, base_dtype="q8_0", unfreeze_at=5)
    tr.run(stop=lambda: tr.step_count >= 4)
    tokens = np.arange(20, dtype=np.int32) % 256
    before = tr.model.forward(tokens)
    tr.optim = unfreeze(tr.model, tr.optim, tr.opts)   # what step 5 begins with
    assert tr.model.lora is None and tr.model.base_dtype is None
    assert _rel(tr.model.forward(tokens), before) <= FWD_TOL
    tr.run()
    assert _rel(load_model(str(tmp_path / "u")).forward(tokens),
                tr.model.forward(tokens)) <= FWD_TOL


@pytest.mark.parametrize("dtype", ["bf16", "q8_0", "q4_0"])
def test_pissa_residual_lives_in_a_quantised_base(tmp_path, dtype):
    """With a bf16 / q8_0 base the residual is stored in the base's dtype:
    the tune starts from Q(W - s B0 A0) + s B0 A0, off the base by the
    rounding of the residual alone; --grad-cp trains it and a resume is
    bit-exact."""
    base = _base_run(tmp_path)
    src, _, _ = read_checkpoint(base + "/checkpoint.safetensors")
    kw = dict(adapter="pissa", lora_alpha=8.0, base_dtype=dtype, grad_cp=True)
    tr = _lora_run(tmp_path, base, "q", **kw)
    p = "blocks.0.cm.ffn_value_w"
    assert p in tr.model.base_names
    A0, B0 = (tr.model.lora[p + k].astype(np.float64) for k in (".lora_A", ".lora_B"))
    res = tr.model.base_tensor(p).astype(np.float64)
    W = src[p].astype(np.float64)
    err = np.abs(res + 2.0 * A0.T @ B0.T - W).max()
    # two roundings in the base's dtype: W as the base took it, then the
    # residual (half a bf16 ulp, half a q8_0 step of a block's largest, or
    # a whole q4_0 step where its 16 levels clip the side opposite the largest)
    u = {"bf16": 2.0 ** -8, "q8_0": 1 / 254, "q4_0": 1 / 8}[dtype]
    assert 0 < err <= u * (np.abs(W).max() + np.abs(res).max())
    rows = []
    tr.run(on_step=rows.append)
    r = _resumed(_lora_run(tmp_path, base, "q2", **kw), rows, 4)
    assert np.array_equal(r.model.lora_buffer, tr.model.lora_buffer)


def test_lisa_trains_drawn_blocks_keeps_the_always_trained_moments_and_resumes(tmp_path):
    """--lisa-layers 1 --lisa-interval 3 on a 2-block model: each period
    trains one drawn block (the other bit-identical through it) beside the
    embedding, head and final norms, whose AdamW moments carry over a switch
    while the new block's start at zero; a resume at a period's end is
    bit-exact."""
    base = _base_run(tmp_path)
    kw = dict(tune="full", steps=8, lr=1e-2, save_every=6, precision="fp32", lisa_layers=1,
              lisa_interval=3)
    tr = _tune(tmp_path, base, "li", **kw)
    draws = [lisa_blocks(tr.opts, 2, p) for p in range(3)]
    assert all(len(d) == 1 for d in draws)
    seen, rows = [], []
    for step in range(8):
        before = {k: v.copy() for k, v in tr.model.params.items()}
        rows.append(tr.step())
        moved = {k.split(".")[1] for k, v in tr.model.params.items()
                 if k.startswith("blocks.") and not np.array_equal(v, before[k])}
        assert moved == {str(draws[step // 3][0])}, (step, moved)
        assert not np.array_equal(tr.model.params["emb"], before["emb"])
        seen.append(tr.optim.lisa_period)
    assert seen == [0, 0, 0, 1, 1, 1, 2, 2]
    n_always = sum(v.size for k, v in tr.model.params.items() if not k.startswith("blocks."))
    assert np.any(tr.optim.m[:n_always])
    tr.save()
    r = _resumed(_tune(tmp_path, base, "li2", **kw), rows, 6)   # at a period's end
    assert np.array_equal(r.model.param_buffer, tr.model.param_buffer)
    with pytest.raises(TrainError, match="--lisa-layers is a schedule of a plain full tune"):
        TrainOptions(tune="lora", lisa_layers=1).resolved()
    with pytest.raises(TrainError, match="--lisa-interval sets the schedule of --lisa-layers"):
        TrainOptions(lisa_interval=5).resolved()
    with pytest.raises(TrainError, match="--lisa-layers 2: the model has 2 blocks"):
        _tune(tmp_path, base, "li3", **dict(kw, lisa_layers=2))


@pytest.mark.parametrize("cfg", [CFG, HYB], ids=["rwkv", "hybrid"])
def test_miss_forward_and_block_grads_match_reference(cfg):
    """MiSS adds fold_r(x) M (x's r-wide slices summed, times M [r, out]):
    the reference computes that in float64 from the docs; the C core runs
    it as LoRA with A the fixed fold and B = M^T, scale 1."""
    m = rx.RxPtModel(cfg, seed=3)
    m.enable_lora(R, core_alpha("miss", R, ALPHA), target_params(m.layers, tuple(TARGETS)))
    rng = np.random.default_rng(8)
    for k, v in m.lora.items():
        v[...] = np.zeros(v.shape, np.float32) if k.endswith(".lora_A") else \
            rng.standard_normal(v.shape).astype(np.float32) * 0.2
        if k.endswith(".lora_A"):
            v[np.arange(v.shape[1]) % R, np.arange(v.shape[1])] = 1.0
    tokens, targets = _data(6)
    params = {k: Var(np.array(v, np.float64), requires_grad=False) for k, v in m.params.items()}
    blocks = {k[:-len(".lora_B")]: Var(m.lora[k].T.astype(np.float64))
              for k in m.lora if k.endswith(".lora_B")}
    eff = dict(params)
    for p, M in blocks.items():   # W + P M, P [in, r] the fold: P[i, k] = 1 where i % r == k
        n_in = m.params[p].shape[0]
        P = (np.arange(n_in)[:, None] % R == np.arange(R)[None, :]).astype(np.float64)
        eff[p] = params[p] + Var(P, requires_grad=False) @ M
    ref = model_forward(eff, cfg, tokens).value
    loss = model_loss(eff, cfg, tokens, targets, IGNORE)
    loss.backward()
    assert_rel("miss.logits", m.forward(tokens), ref, FWD_TOL)
    m.freeze_ranges(np.array([[0, m.param_buffer.size]], np.int64))
    m.backward(targets, ignore_index=IGNORE)
    for p, M in blocks.items():
        assert_rel(f"{p}.miss_block.grad", m.lora_grads[p + ".lora_B"].T, M.grad, GRAD_TOL)


def test_miss_tune_trains_the_blocks_alone_and_resumes_bit_exact(tmp_path):
    base = _base_run(tmp_path)
    tr = _lora_run(tmp_path, base, "mi", adapter="miss")
    assert tr.model.lora_rank == (4, 4.0)   # scale 1
    A = {k: v.copy() for k, v in tr.model.lora.items() if k.endswith(".lora_A")}
    assert tr.optim.m.size == sum(v.size for k, v in tr.model.lora.items()
                                  if k.endswith(".lora_B"))
    rows = []
    tr.run(on_step=rows.append)
    for k, v in A.items():
        assert np.array_equal(tr.model.lora[k], v), k
    assert np.any(tr.model.lora["blocks.0.tm.key_w.lora_B"])
    r = _resumed(_lora_run(tmp_path, base, "mi2", adapter="miss"), rows, 4)
    assert np.array_equal(r.model.lora_buffer, tr.model.lora_buffer)
    tokens = np.arange(20, dtype=np.int32) % 256
    assert _rel(load_model(str(tmp_path / "mi")).forward(tokens),
                tr.model.forward(tokens)) <= FWD_TOL
    with pytest.raises(TrainError, match="--adapter miss scales by 1"):
        TrainOptions(tune="lora", adapter="miss", lora_alpha=8.0).resolved()


@pytest.mark.parametrize("kind", ["rslora", "pissa", "miss", "dora", "lisa"])
def test_every_kind_trains_in_bf16_under_grad_cp(tmp_path, kind):
    """bf16 projections with --grad-cp: the held-out loss falls."""
    base = _base_run(tmp_path)
    kw = dict(steps=6, precision="bf16", grad_cp=True, lr=1e-2)
    tr = _tune(tmp_path, base, "b", tune="full", lisa_layers=1, lisa_interval=2, **kw) \
        if kind == "lisa" else _lora_run(tmp_path, base, "b", adapter=kind, **kw)
    val0 = tr.evaluate()["val_loss"]
    assert tr.run()["val_loss"] < val0


def test_kind_options_refused_in_one_line(tmp_path):
    with pytest.raises(TrainError, match="--adapter sets the adapters of --tune lora"):
        TrainOptions(tune="state", adapter="rslora").resolved()
    choices = ", ".join(ADAPTER_KINDS)
    with pytest.raises(TrainError, match=f"unknown adapter 'nope'; choose one of {choices}"):
        TrainOptions(tune="lora", adapter="nope").resolved()


@pytest.mark.parametrize("kind", ["rslora", "pissa", "miss", "dora"])
def test_peft_applies_the_exported_kind_onto_the_hf_export(tmp_path, kind):
    """export --format peft of a tune of this kind, put on the hf export of
    its base by peft, reproduces our logits within TOL."""
    _need("torch", "safetensors", "transformers", "rwkv7_hf", "peft")
    import torch
    from peft import PeftModel
    from rwkv7_hf import RWKV7ForCausalLM
    base = _base_run(tmp_path, dict(H64, n_rwkv_layer=2))
    fold = ADAPTERS[kind].fold
    tr = _lora_run(tmp_path, base, "run", steps=2, adapter=kind,
                   **({} if fold else {"lora_alpha": 6.0}))
    tr.run()
    rng = np.random.default_rng(1)
    for k, v in tr.model.lora.items():   # trained a little: away from the init
        if not (fold and k.endswith(".lora_A")):   # MiSS's A is fixed
            v[...] += rng.standard_normal(v.shape).astype(np.float32) * 0.05
    tr.save()
    run = str(tmp_path / "run")
    for fmt, src, out in (("hf", base, "base_hf"), ("peft", run, "peft")):
        assert main(["export", src, "--format", fmt, "--out", str(tmp_path / out)]) == 0
    with open(tmp_path / "peft" / "adapter_config.json") as f:
        cfg = json.load(f)
    for k, v in ADAPTERS[kind].peft.items():
        assert cfg[k] == v, k
    # PiSSA as PEFT converts it (path_initial_model_for_weight_conversion): rank 2r
    twice = 2 if ADAPTERS[kind].principal else 1
    assert cfg["r"] == 4 * twice and cfg.get("lora_alpha") == (None if fold else 6.0 * twice)
    tokens = np.frombuffer(b"def f(x):\n    return x", np.uint8).astype(np.int32)
    ours = tr.model.forward(tokens)
    hf_base = RWKV7ForCausalLM.from_pretrained(str(tmp_path / "base_hf"),
                                               torch_dtype=torch.float32)
    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    with torch.no_grad():
        assert _rel(hf_base(ids).logits[0].float().numpy(), ours) > 100 * TOL   # they matter
    peft = PeftModel.from_pretrained(hf_base, str(tmp_path / "peft"))
    peft.eval()
    with torch.no_grad():
        theirs = peft(ids).logits[0].float().numpy()
    err = _rel(theirs, ours)
    print(f"peft ({kind}) on rwkv7-hf vs RxPtModel: {err:.2e}")
    assert err <= TOL
    # and back in: import puts the folder on the base, the model we trained
    back = str(tmp_path / "back")
    assert main(["import", str(tmp_path / "peft"), "--base", base, "--out", back]) == 0
    assert _rel(load_model(back).forward(tokens), ours) <= FWD_TOL
    if ADAPTERS[kind].principal:   # an unconverted PiSSA folder sits on a residual: refused
        cfg["init_lora_weights"] = "pissa"
        with open(tmp_path / "peft" / "adapter_config.json", "w") as f:
            json.dump(cfg, f)
        with pytest.raises(InteropError, match="init_lora_weights is 'pissa', whose adapters "
                           "sit on a residual of the base"):
            read_source(str(tmp_path / "peft"), base)
    assert math.isclose(float(np.abs(ours).max()), float(np.abs(theirs).max()), rel_tol=1e-3)
    assert os.path.isfile(tmp_path / "peft" / "adapter_model.safetensors")
    # our init is peft's init_lora_weights="pissa": the residual and s B0 A0
    # to 1e-5 of the largest element of W, peft's float32 SVD and residual against our float64 ones
    # (a few dozen float32 ulps; A0, B0 alone differ by each direction's sign)
    if ADAPTERS[kind].principal:
        from peft import LoraConfig, get_peft_model

        from rwkvx_c.interop.hf import hf_modules
        mods = hf_modules(tr.model)
        fresh = RWKV7ForCausalLM.from_pretrained(str(tmp_path / "base_hf"),
                                                 torch_dtype=torch.float32)
        theirs = get_peft_model(fresh, LoraConfig(r=4, lora_alpha=6.0, init_lora_weights="pissa",
                                                  target_modules=sorted(set(mods.values()))))
        ck, _, _ = read_checkpoint(str(tmp_path / "run" / "checkpoint.safetensors"))
        for p, mod in mods.items():
            layer = theirs.base_model.model.get_submodule(mod)
            res = layer.base_layer.weight.detach().numpy()
            assert np.abs(res - tr.model.params[p].T).max() <= 1e-5 * np.abs(res).max(), p
            ba = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight).detach()
            ours_ba = ck[p + ".lora_B0"].astype(np.float64) @ ck[p + ".lora_A0"]
            err = 6.0 / 4 * np.abs(ba.numpy() - ours_ba).max()   # s (B A), as W's part
            assert err <= 1e-5 * np.abs(res).max(), p


@pytest.mark.parametrize("tune,flags,kw", [
    ("lora", ["--adapter", "rslora"], dict(adapter="rslora")),
    ("lora", ["--adapter", "dora"], dict(adapter="dora")),
    ("lora", ["--train-parts", "state"], dict(train_parts="state")),
    ("full", ["--lisa-layers", "1", "--lisa-interval", "1"], dict(lisa_layers=1, lisa_interval=1)),
])
def test_kind_options_from_the_cli_python_and_a_config_file(tmp_path, tune, flags, kw):
    from test_train import _corpus
    base = _base_run(tmp_path)
    data = _corpus(tmp_path)
    common = dict(data=data, batch=2, seq_len=24, steps=2, eval_tokens=96, threads=2,
                  cache_dir=str(tmp_path / "cache"))
    argv = ["train", "--init-from", base, "--tune", tune, *flags, "--data", data, "--batch", "2",
            "--seq-len", "24", "--steps", "2", "--eval-tokens", "96", "--threads", "2",
            "--cache-dir", common["cache_dir"]]
    assert main([*argv, "--out", str(tmp_path / "cli")]) == 0
    assert main(["train", "--config", str(tmp_path / "cli" / "config.toml"),
                 "--out", str(tmp_path / "cfg")]) == 0
    Trainer(TrainOptions(init_from=base, tune=tune, **kw, **common), str(tmp_path / "py")).run()
    losses = []
    for d in ("cli", "cfg", "py"):
        with open(tmp_path / d / "log.jsonl", encoding="utf-8") as f:
            losses.append([json.loads(x).get("loss") for x in f])
    assert losses[0] == losses[1] == losses[2] and any(v is not None for v in losses[0])
