"""The frozen base (docs/finetune.md §The frozen base, csrc/base.c): frozen
matrices held as bf16 or GGUF Q8_0 only. Its bytes are gguf's and torch's;
at either precision a base model computes bit for bit the logits and every
gradient of the float32 model holding the decoded weights (bf16-rounded,
or gguf's dequantize(quantize(W))), with state and LoRA tuning, recompute,
the chunked head and any thread count; its state and adapter gradients
match the float64 reference; the switch works from TrainOptions and the
command line, and a bf16 .pth streams into a bf16 base."""
import numpy as np
import pytest

import rwkvx_c as rx
from rwkvx_c.model.lora import TARGETS, target_params

from checks import GRAD_TOL, assert_rel, token_batch
from reference.autograd import Var
from reference.lora import lora_params
from reference.model import model_loss

gguf = pytest.importorskip("gguf")

# every matrix's input size a multiple of 32 (Q8_0's block), one attention block
CFG = dict(n_embd=64, n_head=2, head_size=32, n_rwkv_layer=2, n_attn_layer=1, vocab_size=37,
           Dw=32, Da=32, Dg=32, Dv=32, ffn_dim=96, chunk_size=4, moba_top_k=3)
B, T, IGNORE, R, ALPHA = 2, 12, 5, 4, 8.0


def _bf16(a):
    """float32 -> bf16 bits, round to nearest even (torch's .to(bfloat16))."""
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _decoded(w, dtype):
    """W [in, out] as a base of dtype holds it, decoded: bf16-rounded, or
    gguf's dequantize(quantize(W^T, Q8_0)) transposed back."""
    if dtype == "bf16":
        return (_bf16(w).astype(np.uint32) << 16).view(np.float32)
    q = gguf.quants.quantize(np.ascontiguousarray(w.T), gguf.GGMLQuantizationType.Q8_0)
    return np.ascontiguousarray(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).T)


def _names(m):
    return [n for n in m.param_names if n != "emb" and m.params[n].ndim == 2]


def _pair(dtype, precision="fp32", recompute=False, seed=3):
    """(float32 model holding the decoded weights, base model), both with
    initial states and adapters on every projection (random, equal), the
    base's ranges frozen in both."""
    src = rx.RxPtModel(CFG, seed=seed)
    # weights of the trained model's size: decay gates stay in range
    for n in _names(src):
        src.params[n][...] *= 0.5
    names = _names(src)
    ref = rx.RxPtModel(CFG, seed=seed, precision=precision, recompute=recompute)
    ref.param_buffer[...] = src.param_buffer
    for n in names:
        ref.params[n][...] = _decoded(src.params[n], dtype)
    m = rx.RxPtModel(CFG, seed=seed, precision=precision, recompute=recompute, init=False)
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
    s0 = rng.standard_normal((CFG["n_rwkv_layer"], 2, 32, 32)).astype(np.float32) * 0.1
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


def test_stored_bytes_are_gguf_q8_0_and_torch_bf16():
    src = rx.RxPtModel(CFG, seed=1)
    names = _names(src)
    for dtype in ("bf16", "q8_0"):
        m = rx.RxPtModel(CFG, seed=1, init=False)
        m.set_base(dtype, names)
        for n in names:
            m.base_fill(n, src.params[n])
        assert m.base_dtype == dtype and m.base_names == names
        per = 2.0 if dtype == "bf16" else 34 / 32
        assert m.base_bytes == sum(int(src.params[n].size * per) for n in names)
        for n in names:
            w = src.params[n]
            want = _bf16(w.T) if dtype == "bf16" else gguf.quants.quantize(
                np.ascontiguousarray(w.T), gguf.GGMLQuantizationType.Q8_0)
            assert np.array_equal(m.base_data(n), want), n
            assert np.array_equal(m.base_tensor(n), _decoded(w, dtype)), n
            assert not np.any(m.params[n])   # the arena slot holds nothing


@pytest.mark.parametrize("dtype", ["bf16", "q8_0"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute,chunked", [(False, False), (True, True)],
                         ids=["plain", "recompute+chunked_head"])
def test_base_gives_the_float32_models_bits(dtype, precision, recompute, chunked):
    ref, m, names = _pair(dtype, precision, recompute)
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


def test_a_q8_0_base_state_and_adapter_grads_match_the_float64_reference():
    ref, m, names = _pair("q8_0")
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
    loss = model_loss(lora_params(params, ads, R, ALPHA), CFG, tokens, targets, IGNORE,
                      state0=s0)
    loss.backward()
    assert_rel("state0.grad", m.state_grad, s0.grad, GRAD_TOL)
    for p, (a, b) in ads.items():
        assert_rel(f"{p}.lora_A.grad", m.lora_grads[p + ".lora_A"], a.grad, GRAD_TOL)
        assert_rel(f"{p}.lora_B.grad", m.lora_grads[p + ".lora_B"], b.grad, GRAD_TOL)


def test_release_base_gives_the_decoded_float32_weights():
    ref, m, names = _pair("q8_0")
    want = _run(ref, False)
    m.release_base()
    assert m.base_dtype is None and m.base_names == [] and m.base_bytes == 0
    for n in names:
        assert np.array_equal(m.params[n], ref.params[n]), n
    assert np.array_equal(_run(m, False)[0], want[0])


def test_bad_base_requests_are_refused():
    m = rx.RxPtModel(CFG, seed=0, init=False)
    with pytest.raises(ValueError, match="emb.*not a matrix the GEMMs read"):
        m.set_base("bf16", ["emb"])
    with pytest.raises(ValueError, match="base dtype must be one of"):
        m.set_base("q4", ["head"])
    odd = rx.RxPtModel(dict(CFG, Dw=8), seed=0, init=False)
    with pytest.raises(ValueError, match=r"Q8_0 needs its input size a multiple of 32"):
        odd.set_base("q8_0", ["blocks.0.tm.w2"])
    m.set_base("bf16", ["head"])
    with pytest.raises(ValueError, match="has a base already"):
        m.set_base("bf16", ["blocks.0.tm.key_w"])
    with pytest.raises(ValueError, match="takes shape"):
        m.base_fill("head", np.zeros((3, 3), np.float32))
    tokens, _ = token_batch(CFG["vocab_size"], 1, 4, 0, IGNORE)
    with pytest.raises(ValueError, match="base is not filled"):
        m.forward(tokens)
