"""The frozen base (docs/finetune.md §The frozen base, csrc/base.c): frozen
matrices held as bf16, GGUF Q8_0, Q4_0 or Q4_K only (q4_k: on a model of
whole super-blocks; its bytes are tests/test_base_q4_k.py's). Its bytes are gguf's and torch's;
at either precision a base model computes bit for bit the logits and every
gradient of the float32 model holding the decoded weights (bf16-rounded,
or gguf's dequantize(quantize(W))), with state and LoRA tuning, recompute,
the chunked head and any thread count; its state and adapter gradients
match the float64 reference; the switch works from TrainOptions and the
command line, and a bf16 .pth streams into a bf16 base."""
import os

import numpy as np
import pytest

import rwkvx_c as rx
from rwkvx_c.model.lora import TARGETS, target_params

from checks import GRAD_TOL, assert_rel, portable_run, token_batch
from reference import nf4, q4_k
from reference.autograd import Var
from reference.lora import lora_params
from reference.model import model_loss

gguf = pytest.importorskip("gguf")

# every matrix's input size a multiple of 32 (Q8_0's block), one attention block; ln0,
# whose backward gathers the embedding's rows again (from the base when it is there)
CFG = dict(n_embd=64, n_head=2, head_size=32, n_rwkv_layer=2, n_attn_layer=1, vocab_size=37,
           Dw=32, Da=32, Dg=32, Dv=32, ffn_dim=96, chunk_size=4, moba_top_k=3, ln0=1)
B, T, IGNORE, R, ALPHA = 2, 12, 5, 4, 8.0
# every matrix's input size a multiple of 256 (Q4_K's super-block)
CFG256 = dict(CFG, n_embd=256, n_head=8, Dw=256, Da=256, Dg=256, Dv=256, ffn_dim=256)


def _bf16(a):
    """float32 -> bf16 bits, round to nearest even (torch's .to(bfloat16))."""
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


# the block dtypes: gguf's own quantization of each
QUANT = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
BLOCKS = tuple(QUANT)


def _stored(w, dtype, name):
    """What a base of dtype stores of parameter name = w: the bits of
    torch's bf16 or of gguf's quantization of W^T [out, in], or of the
    embedding's own rows [vocab, C]."""
    rows = w if name == "emb" else np.ascontiguousarray(w.T)
    if dtype == "nf4":   # no GGUF type: tests/reference/nf4.py, from its definition
        return nf4.quantize(rows)
    if dtype == "q4_k":   # gguf-py has no Q4_K encoder: ours, llama.cpp's bytes (test_base_q4_k)
        return rx.base_quantize("q4_k", np.ascontiguousarray(rows, np.float32))
    return _bf16(rows) if dtype == "bf16" else gguf.quants.quantize(rows, QUANT[dtype])


def _decoded(w, dtype, name):
    """w as a base of dtype holds it, decoded: bf16-rounded, or gguf's
    dequantize(quantize(...)) of its stored rows, in w's layout."""
    if dtype == "bf16":
        return (_bf16(w).astype(np.uint32) << 16).view(np.float32)
    refs = {"nf4": nf4.dequantize, "q4_k": q4_k.dequantize}
    d = refs[dtype](_stored(w, dtype, name)) if dtype in refs else \
        gguf.quants.dequantize(_stored(w, dtype, name), QUANT[dtype])
    return d if name == "emb" else np.ascontiguousarray(d.T)


def _names(m):
    """every matrix: the projections and the embedding"""
    return [n for n in m.param_names if m.params[n].ndim == 2]


def _pair(dtype, precision="fp32", recompute=False, seed=3, cfg=CFG):
    """(float32 model holding the decoded weights, base model) of shape
    cfg, both with initial states and adapters on every projection (random,
    equal), the base's ranges frozen in both."""
    src = rx.RxPtModel(cfg, seed=seed)
    # weights of the trained model's size: decay gates stay in range
    for n in _names(src):
        src.params[n][...] *= 0.5
    names = _names(src)
    ref = rx.RxPtModel(cfg, seed=seed, precision=precision, recompute=recompute)
    ref.param_buffer[...] = src.param_buffer
    for n in names:
        ref.params[n][...] = _decoded(src.params[n], dtype, n)
    m = rx.RxPtModel(cfg, seed=seed, precision=precision, recompute=recompute, init=False)
    m.param_buffer[...] = src.param_buffer   # the base's slots are released below
    m.set_base(dtype, names)
    for n in names:
        m.base_fill(n, src.params[n])
    rng = np.random.default_rng(seed)
    targets = target_params(ref.layers, tuple(TARGETS))
    frozen = []
    for n in names:
        b = ref.params[n].__array_interface__["data"][0] - \
            ref.param_buffer.__array_interface__["data"][0]
        frozen.append([b // 4, b // 4 + ref.params[n].size])
    s0 = rng.standard_normal((cfg["n_rwkv_layer"], cfg["n_head"], cfg["head_size"],
                              cfg["head_size"])).astype(np.float32) * 0.1
    ad = None
    for x in (ref, m):
        x.enable_state()
        x.state[...] = s0
        x.enable_lora(R, ALPHA, targets)
        if ad is None:
            ad = rng.standard_normal(x.lora_buffer.shape).astype(np.float32) * 0.05
        x.lora_buffer[...] = ad
        x.freeze_ranges(np.array(frozen, np.int64))
    return ref, m, names


def _run(m, chunked, threads=None):
    tokens, targets = token_batch(CFG["vocab_size"], B, T, 7, IGNORE)
    if threads is not None:
        rx.set_num_threads(threads)
    try:
        logits = m.forward(tokens, return_logits=not chunked)
        loss = m.backward(targets, ignore_index=IGNORE)
    finally:
        rx.set_num_threads(0)
    grads = {n: m.grads[n].copy() for n in m.param_names}
    return logits, loss, grads, m.state_grad.copy(), m.lora_grad_buffer.copy()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])   # bf16: the GEMM's packed layout
def test_stored_bytes_are_gguf_blocks_and_torch_bf16(precision):
    src = rx.RxPtModel(CFG, seed=1)
    names = _names(src)
    for dtype in ("bf16", *BLOCKS):
        m = rx.RxPtModel(CFG, seed=1, init=False, precision=precision)
        m.set_base(dtype, names)
        for n in names:
            m.base_fill(n, src.params[n])
        assert m.base_dtype == dtype and m.base_names == names
        values, nbytes = rx.base_dtype_block(dtype)
        per = 2.0 if dtype == "bf16" else nbytes / values
        if dtype == "bf16" and precision == "bf16":   # packed: in and out padded to 32
            def up(d):
                return -(-d // 32) * 32
            size = {n: src.params[n].size if n == "emb" else
                    up(src.params[n].shape[0]) * up(src.params[n].shape[1]) for n in names}
        else:
            size = {n: src.params[n].size for n in names}
        assert m.base_bytes == sum(int(size[n] * per) for n in names)
        for n in names:
            w = src.params[n]
            assert np.array_equal(m.base_data(n), _stored(w, dtype, n)), n
            assert np.array_equal(m.base_tensor(n), _decoded(w, dtype, n)), n
            assert not np.any(m.params[n])   # the arena slot holds nothing


def _cfg(dtype):
    """a model whose every matrix a base of dtype holds"""
    return CFG256 if dtype == "q4_k" else CFG


@pytest.mark.parametrize("dtype", ["bf16", *BLOCKS, "q4_k"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute,chunked", [(False, False), (True, True)],
                         ids=["plain", "recompute+chunked_head"])
def test_base_gives_the_float32_models_bits(dtype, precision, recompute, chunked):
    _assert_same_bits(*_pair(dtype, precision, recompute, cfg=_cfg(dtype)), chunked)


def _assert_same_bits(ref, m, names, chunked):
    """m (over a base) gives ref's logits, loss and gradients bit for bit
    at 1 and 3 threads"""
    want = _run(ref, chunked)
    for threads in (1, 3):
        got = _run(m, chunked, threads)
        if not chunked:
            assert np.array_equal(got[0], want[0])   # logits
        assert got[1] == want[1]                     # loss
        for n in m.param_names:
            if n not in names:
                assert np.array_equal(got[2][n], want[2][n]), n
        assert np.array_equal(got[3], want[3])       # the states' grads
        assert np.array_equal(got[4], want[4])       # the adapters' grads


@pytest.mark.parametrize("dtype", ["q8_0", "q4_k"])
@pytest.mark.parametrize("recompute,chunked", [(False, False), (True, True)],
                         ids=["plain", "recompute+chunked_head"])
def test_a_base_model_in_windows_gives_the_same_bits(dtype, recompute, chunked):
    """The bf16 GEMM packs op(B) in windows when a batch's would outgrow
    its budget (a 7B's head is 512 MiB packed whole); at a budget below one
    window every product runs in the smallest (32 columns or 256 k), and the
    logits, loss and every gradient keep their bits, at 1 and 3 threads."""
    _, m, _ = _pair(dtype, "bf16", recompute, cfg=_cfg(dtype))
    want = _run(m, chunked, 1)
    was = rx._core._bgemm_pack_budget(1)
    try:
        for threads in (1, 3):
            got = _run(m, chunked, threads)
            if not chunked:
                assert np.array_equal(got[0], want[0])
            assert got[1] == want[1] and np.array_equal(got[3], want[3])
            assert np.array_equal(got[4], want[4])
            assert all(np.array_equal(got[2][n], want[2][n]) for n in m.param_names)
    finally:
        rx._core._bgemm_pack_budget(was)


def test_a_base_packed_for_bf16_read_at_fp32_gives_the_float32_bits():
    """A bf16 base made at bf16 precision is stored in the bf16 GEMM's
    layout; switched to fp32, the float32 GEMM reads it element by element."""
    ref, m, _ = _pair("bf16", "bf16", recompute=True)
    ref.precision = m.precision = "fp32"
    want, got = _run(ref, True), _run(m, True, 2)
    assert got[1] == want[1] and np.array_equal(got[3], want[3])
    assert np.array_equal(got[4], want[4])


def test_the_portable_packers_give_the_same_bits():
    """The base's packing without AVX-512 or AVX2 (any x86-64 or other
    CPU): the bit-exact test again in a process with RWKVX_BASE_PORTABLE=1."""
    portable_run("test_base.py", "float32_bits or models_bits")


@pytest.mark.parametrize("dtype", BLOCKS)
def test_a_block_base_state_and_adapter_grads_match_the_float64_reference(dtype):
    ref, m, _ = _pair(dtype)
    tokens, targets = token_batch(CFG["vocab_size"], B, T, 7, IGNORE)
    m.forward(tokens, return_logits=False)
    m.backward(targets, ignore_index=IGNORE)
    params = {n: Var(np.array(ref.params[n], np.float64), requires_grad=False)
              for n in ref.param_names}
    ads = {}
    for k in m.lora:
        if k.endswith(".lora_A"):
            p = k[:-len(".lora_A")]
            ads[p] = tuple(Var(m.lora[p + s].astype(np.float64)) for s in (".lora_A", ".lora_B"))
    s0 = Var(m.state.astype(np.float64))
    loss = model_loss(lora_params(params, ads, R, ALPHA), m.config, tokens, targets, IGNORE,
                      state0=s0)
    loss.backward()
    assert_rel("state0.grad", m.state_grad, s0.grad, GRAD_TOL)
    for p, (a, b) in ads.items():
        assert_rel(f"{p}.lora_A.grad", m.lora_grads[p + ".lora_A"], a.grad, GRAD_TOL)
        assert_rel(f"{p}.lora_B.grad", m.lora_grads[p + ".lora_B"], b.grad, GRAD_TOL)


@pytest.mark.parametrize("dtype", [*BLOCKS, "q4_k"])
def test_release_base_gives_the_decoded_float32_weights(dtype):
    ref, m, names = _pair(dtype, cfg=_cfg(dtype))
    assert len(names) == len(_names(m))   # every matrix held
    want = _run(ref, False)
    m.release_base()
    assert m.base_dtype is None and m.base_names == [] and m.base_bytes == 0
    for n in names:
        assert np.array_equal(m.params[n], ref.params[n]), n
    assert np.array_equal(_run(m, False)[0], want[0])


def test_bad_base_requests_are_refused():
    m = rx.RxPtModel(CFG, seed=0, init=False)
    with pytest.raises(ValueError, match=r"ln_out_w\) is not a matrix"):
        m.set_base("bf16", ["ln_out_w"])
    narrow = rx.RxPtModel(dict(CFG, n_embd=48, n_head=3, head_size=16), seed=0, init=False)
    with pytest.raises(ValueError, match=r"emb \[37, 48\]: Q8_0 needs its row size a multiple"):
        narrow.set_base("q8_0", ["emb"])
    with pytest.raises(ValueError, match="base dtype must be one of"):
        m.set_base("q4", ["head"])
    odd = rx.RxPtModel(dict(CFG, Dw=8), seed=0, init=False)
    with pytest.raises(ValueError, match=r"Q8_0 needs its input size a multiple of 32"):
        odd.set_base("q8_0", ["blocks.0.tm.w2"])
    with pytest.raises(ValueError, match=r"Q4_0 needs its input size a multiple of 32"):
        odd.set_base("q4_0", ["blocks.0.tm.w2"])
    m.set_base("bf16", ["head"])
    with pytest.raises(ValueError, match="has a base already"):
        m.set_base("bf16", ["blocks.0.tm.key_w"])
    with pytest.raises(ValueError, match="takes shape"):
        m.base_fill("head", np.zeros((3, 3), np.float32))
    tokens, _ = token_batch(CFG["vocab_size"], 1, 4, 0, IGNORE)
    with pytest.raises(ValueError, match="base is not filled"):
        m.forward(tokens)


# ---- the run: --base-dtype, a streamed .pth, the memory check, unfreeze, resume ----------

def _bf16_pth(tmp_path, name="o.pth", **sizes):
    pytest.importorskip("torch")
    from test_interop import _official_dict

    from rwkvx_c import interop
    sd = _official_dict(np.random.default_rng(0), **{**dict(V=256, C=64, H=2, N=32, L=2, F=128,
                                                            Dw=32, Da=32, Dv=32, Dg=32), **sizes})
    pth = str(tmp_path / name)
    interop.save_pth(sd, pth, "bf16")
    return pth


def _tune_losses(tmp_path, pth, out, weights=None, **kw):
    """(trainer, losses) of a tune from pth; weights: instead of pth's own
    (read_source's)."""
    from test_train import _opts

    from rwkvx_c.interop.source import read_source
    from rwkvx_c.train import Trainer
    from rwkvx_c.train.finetune import from_source
    src = read_source(pth)
    opts = from_source(_opts(tmp_path, model=None, **kw), src.config, src.tokenizer, pth)
    tr = Trainer(opts, str(tmp_path / out), _weights=src.weights if weights is None else weights)
    rows = []
    tr.run(on_step=rows.append)
    return tr, [r["loss"] for r in rows if "loss" in r]


def _resumed_losses(tmp_path, pth, out, **kw):
    """(trainer, losses) of a tune from pth run to step 3, then resumed from
    its checkpoint to its end (save_every=3 in kw): the resumed run's"""
    from test_train import _opts

    from rwkvx_c.interop.source import read_source
    from rwkvx_c.train import Trainer
    from rwkvx_c.train.finetune import from_source
    src = read_source(pth)
    opts = from_source(_opts(tmp_path, model=None, **kw), src.config, src.tokenizer, pth)
    tr = Trainer(opts, str(tmp_path / out), _weights=src.weights)
    tr.run(stop=lambda: tr.step_count >= 3)
    r = Trainer.resume(str(tmp_path / out))
    rows = []
    r.run(on_step=rows.append)
    return r, [x["loss"] for x in rows if "loss" in x]


def _tune_three_ways(tmp_path, capsys, pth, dtype, held):
    """A 6-step LoRA tune of pth over a dtype base from TrainOptions, the
    command line and a config file: (the first's trainer, each one's
    losses); the command line's header says the base holds `held` matrices."""
    import json

    from rwkvx_c.cli import main
    tr, losses = _tune_losses(tmp_path, pth, "opts", tune="lora", steps=6, lr=0.02,
                              base_dtype=dtype)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    common = ["--init-from", pth, "--tune", "lora", "--data", str(corpus), "--cache-dir",
              str(tmp_path / "cache"), "--steps", "6", "--batch", "2", "--seq-len", "16",
              "--eval-tokens", "32", "--lr", "0.02", "--threads", "2", "--no-progress"]
    assert main(["train", *common, "--base-dtype", dtype, "--out", str(tmp_path / "c")]) == 0
    assert f"frozen base {dtype}, {held} matrices" in capsys.readouterr().out
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'init_from = "{pth}"\ntune = "lora"\nbase_dtype = "{dtype}"\n'
                   f'data = "{corpus}"\ncache_dir = "{tmp_path / "cache"}"\nsteps = 6\n'
                   'batch = 2\nseq_len = 16\neval_tokens = 32\nlr = 0.02\nthreads = 2\n')
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "f"),
                 "--no-progress"]) == 0
    assert f"frozen base {dtype}, {held} matrices" in capsys.readouterr().out
    runs = [losses]
    for run in ("c", "f"):
        with open(tmp_path / run / "log.jsonl") as f:
            runs.append([r["loss"] for r in map(json.loads, f) if "loss" in r])
    return tr, runs


def _falls(losses):
    return len(losses) >= 4 and losses[-1] < losses[0]


def _resumes_and_exports(tmp_path, capsys, pth, dtype):
    """A 6-step LoRA tune of pth over a dtype base resumes from step 3 bit
    for bit, and its rwkv7 export merges into the source's own weights."""
    from rwkvx_c.cli import main
    kw = dict(tune="lora", steps=6, save_every=3, base_dtype=dtype)
    _, want = _tune_losses(tmp_path, pth, "a", **kw)
    r, got = _resumed_losses(tmp_path, pth, "b", **kw)
    assert r.model.base_dtype == dtype and got == want[3:]
    capsys.readouterr()
    out = str(tmp_path / "m.pth")
    assert main(["export", str(tmp_path / "a"), "--format", "rwkv7", "--out", out]) == 0
    assert "merged into the original weights of its base" in capsys.readouterr().out
    assert os.path.getsize(out) > 0


def _counts_its_bytes(cfg, dtype, per, nbytes):
    """every matrix of a model of cfg in a dtype base: nbytes a per values"""
    from rwkvx_c.train.base import base_bytes
    assert rx.base_dtype_block(dtype) == (per, nbytes)
    m = rx.RxPtModel(cfg, seed=0, init=False)
    names = _names(m)
    m.set_base(dtype, names)
    assert m.base_bytes == base_bytes(m, names, dtype) == \
        sum(m.params[n].size for n in names) * nbytes // per


def test_a_tune_from_a_base_naming_run_streams_that_base(tmp_path):
    """--init-from a state run on a bf16 .pth: the next tune reads the base
    from its file, bf16 bits as they are, never the whole model in float32;
    it computes what the same tune on those weights in memory computes."""
    from rwkvx_c.interop.pth import PthTensors
    from rwkvx_c.interop.source import Layered, read_source
    pth = _bf16_pth(tmp_path)
    _tune_losses(tmp_path, pth, "a", tune="state", steps=2)
    run = str(tmp_path / "a")
    src = read_source(run)
    assert isinstance(src.weights, Layered) and src.dtype == "bf16" and src.state0 is not None
    assert not any(k.startswith("optim.") or k == "state0" for k in src.weights)
    tr, got = _tune_losses(tmp_path, run, "b", tune="lora", steps=3)
    assert tr.model.base_dtype == "bf16"
    raw = PthTensors(pth).raw("blocks.1.att.key.weight")
    assert np.array_equal(tr.model.base_data("blocks.1.tm.key_w"), raw)
    _, want = _tune_losses(tmp_path, run, "c", weights=dict(src.weights), tune="lora", steps=3,
                           base_dtype="bf16")
    assert got == want
    # as the command line takes it: the run's states over its still unread weights
    from test_train import _opts

    from rwkvx_c.train.assemble import start_from_source
    from rwkvx_c.train.distributed import ProcessGroup
    os.makedirs(tmp_path / "d")
    _, w, pin = start_from_source(_opts(tmp_path, model=None, init_from=run, tune="state"),
                                  ProcessGroup(), str(tmp_path / "d"))
    assert os.path.samefile(pin["path"], os.path.join(run, "checkpoint.safetensors"))
    assert hasattr(w, "raw_t") and w.dtype == "bf16" and "state0" in w


@pytest.mark.parametrize("tune", ["state", "lora"])
def test_a_bf16_pth_streams_into_a_bf16_base_with_the_float32_losses(tmp_path, tune):
    from rwkvx_c.interop.rwkv7 import StreamedWeights
    from rwkvx_c.interop.source import read_source
    pth = _bf16_pth(tmp_path)
    src = read_source(pth)
    assert isinstance(src.weights, StreamedWeights) and src.dtype == "bf16"
    tr32, want = _tune_losses(tmp_path, pth, "fp32", tune=tune, steps=3, base_dtype="fp32")
    assert tr32.model.base_dtype is None
    tr, got = _tune_losses(tmp_path, pth, "auto", tune=tune, steps=3)   # auto: bf16
    # the blocks' matrices, the head and the embedding
    assert tr.model.base_dtype == "bf16" and len(tr.model.base_names) == 12 + 14 + 2
    assert got == want and got[-1] < got[0] + 1.0
    # the bits of the file, copied: no rounding on the way
    from rwkvx_c.interop.pth import PthTensors
    raw = PthTensors(pth).raw("blocks.1.att.key.weight")
    assert np.array_equal(tr.model.base_data("blocks.1.tm.key_w"), raw)
    trq, q = _tune_losses(tmp_path, pth, "q8", tune=tune, steps=3, base_dtype="q8_0")
    assert trq.model.base_dtype == "q8_0" and q != want and abs(q[0] - want[0]) < 1e-2


def test_base_dtype_from_the_command_line_and_its_header(tmp_path, capsys):
    from rwkvx_c.cli import main
    from rwkvx_c.run.checkpoint import read_checkpoint
    pth = _bf16_pth(tmp_path)
    (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    args = ["train", "--init-from", pth, "--tune", "lora", "--data", str(tmp_path / "corpus.txt"),
            "--cache-dir", str(tmp_path / "cache"), "--steps", "2", "--batch", "2", "--seq-len",
            "16", "--eval-tokens", "32", "--threads", "1", "--no-progress"]
    assert main(args + ["--base-dtype", "q8_0", "--out", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    assert "frozen base q8_0, 28 matrices in 0 MiB" in out and "params;" in out
    # the checkpoint holds what trains and names its base (docs/finetune.md)
    ck, _, state = read_checkpoint(str(tmp_path / "q" / "checkpoint.safetensors"))
    assert "blocks.0.tm.key_w" not in ck and state["base"]["path"] == os.path.abspath(pth)
    with pytest.raises(SystemExit) as e:
        main(args + ["--base-dtype", "fp16", "--out", str(tmp_path / "bad")])
    assert e.value.code == 2 and "--base-dtype: invalid choice" in capsys.readouterr().err


def test_a_state_tune_on_a_base_resumes_bit_exact_and_unfreezes(tmp_path):
    from rwkvx_c.train import Trainer
    pth = _bf16_pth(tmp_path)
    _, want = _tune_losses(tmp_path, pth, "a", tune="state", steps=6, save_every=3,
                           base_dtype="q8_0", unfreeze_at=5)
    from test_train import _opts

    from rwkvx_c.interop.source import read_source
    from rwkvx_c.train.finetune import from_source
    src = read_source(pth)
    opts = from_source(_opts(tmp_path, model=None, tune="state", steps=6, save_every=3,
                             base_dtype="q8_0", unfreeze_at=5), src.config, src.tokenizer, pth)
    tr = Trainer(opts, str(tmp_path / "b"), _weights=src.weights)
    tr.run(stop=lambda: tr.step_count >= 3)
    assert tr.model.base_dtype == "q8_0"
    r = Trainer.resume(str(tmp_path / "b"))
    rows = []
    r.run(on_step=rows.append)
    assert [x["loss"] for x in rows if "loss" in x] == want[3:]
    assert r.model.base_dtype is None   # unfrozen: float32, the dequantised values trained


def test_a_pth_claiming_more_than_it_holds_is_one_line(tmp_path):
    torch = pytest.importorskip("torch")
    from rwkvx_c.errors import InteropError
    from rwkvx_c.interop.source import read_source
    pth = str(tmp_path / "huge.pth")
    torch.save({"emb.weight": torch.zeros(1).expand(10**6, 10**6)}, pth)
    with pytest.raises(InteropError, match=r"claims shape \(1000000, 1000000\) with strides "
                       r"\(0, 0\) at offset 0 over a storage of 1 elements"):
        read_source(pth)


def test_the_rwkv_package_on_the_bf16_pth_gives_a_bf16_base_models_logits(tmp_path):
    from test_interop import _RWKV, TOL, _need, _rel, _tool_logits
    from test_train import _opts
    _need("torch", "rwkv")
    from rwkvx_c.interop.source import read_source
    from rwkvx_c.train.base import model_from_source
    from rwkvx_c.train.finetune import from_source
    pth = _bf16_pth(tmp_path)
    src = read_source(pth)
    opts = from_source(_opts(tmp_path, model=None, tune="lora", precision="fp32"), src.config,
                       src.tokenizer, pth).resolved()
    model = model_from_source(opts, src.weights)
    assert model.base_dtype == "bf16"
    tokens = np.random.default_rng(5).integers(0, 256, 40).astype(np.int32)
    ours = model.forward(tokens)
    theirs = _tool_logits(_RWKV, pth, tokens, tmp_path)
    assert _rel(ours, theirs) < TOL


@pytest.mark.parametrize("dtype", [None, "bf16", "q8_0", "q4_k"])
def test_decoding_reads_the_base_in_place_with_the_packed_bits(dtype):
    """Forwards of 1, 4 and 8 rows (decoding's M) take the GEMM's small-M
    path, which reads float32 weights in place and packs a base's B one
    sliver at a time: the same logits, bit for bit, as the packed path, at
    one and two threads (dtype None: no base; q4_k: a model of whole
    super-blocks)."""
    cfg = _cfg(dtype)
    src = rx.RxPtModel(cfg, seed=5)
    m = rx.RxPtModel(cfg, seed=5, init=False)
    m.param_buffer[...] = src.param_buffer
    if dtype is not None:
        m.set_base(dtype, _names(src))
        for n in _names(src):
            m.base_fill(n, src.params[n])
    tokens = np.array([[3, 1, 4, 1, 5, 9, 2, 6]], np.int32)
    small = rx._core._sgemm_small_m(0)
    got = []
    try:
        for bound in (small, 0):
            rx._core._sgemm_small_m(bound)
            for threads in (1, 2):
                rx.set_num_threads(threads)
                got.append([m.forward(tokens[:, :t], return_logits=True) for t in (1, 4, 8)])
    finally:
        rx._core._sgemm_small_m(small)
        rx.set_num_threads(0)
    for g in got[1:]:
        assert all(np.array_equal(x, y) for x, y in zip(g, got[0]))
