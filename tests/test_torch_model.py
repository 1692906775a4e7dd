"""bench/torch_model.py (the PyTorch side of the benchmark) computes the same
model as rwkvx_c: bit-identical docs/layout.md §Init, and in float64 the same loss and
gradients as RxPtModel. Skipped where PyTorch is not installed (it is an
optional benchmark extra, not a dependency)."""
import importlib.util
import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import rwkvx_c as rx  # noqa: E402

_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "bench")


def _torch_model():
    sys.path.insert(0, _BENCH)
    try:
        spec = importlib.util.spec_from_file_location("torch_model",
                                                      os.path.join(_BENCH, "torch_model.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(_BENCH)
    return mod


CFG = dict(n_embd=32, n_head=2, head_size=16, n_rwkv_layer=5, n_attn_layer=2, vocab_size=50,
           ffn_dim=48, Dw=4, Da=4, Dg=6, Dv=3, chunk_size=8, moba_top_k=2)


def test_torch_model_matches_rwkvx_c():
    tm = _torch_model()
    m = rx.RxPtModel(CFG, seed=7)
    init = tm.init_params(CFG, seed=7)
    assert list(init) == m.param_names
    for name, arr in init.items():
        assert np.array_equal(arr, m.params[name]), name
    rng = np.random.default_rng(1)
    tok = rng.integers(0, 50, 45).astype(np.int32)
    tgt = rng.integers(0, 50, 45).astype(np.int32)
    m.forward(tok)
    loss = m.backward(tgt)
    t = tm.RwkvXTorch(CFG, seed=7, dtype=torch.float64)
    lt = t.loss(torch.tensor(tok[None]).long(), torch.tensor(tgt[None]).long())
    lt.backward()
    assert abs(loss - lt.item()) <= 1e-5 * abs(lt.item())
    for name, p in zip(t.names, t.plist):
        ref = p.grad.numpy()
        assert np.abs(m.grads[name] - ref).max() <= 1e-4 * np.abs(ref).max(), name


def test_chunked_wkv7_matches_recurrence():
    tm = _torch_model()
    g = torch.Generator().manual_seed(0)
    B, T, H, N = 2, 37, 2, 8
    r, k, v = (torch.randn(B, T, H, N, dtype=torch.float64, generator=g) * 0.5 for _ in range(3))
    w = torch.exp(-tm.E_HALF * torch.sigmoid(torch.randn(B, T, H, N, dtype=torch.float64,
                                                         generator=g)))
    kk = torch.nn.functional.normalize(torch.randn(B, T, H, N, dtype=torch.float64, generator=g),
                                       dim=-1)
    a, b = -kk, kk * 0.7
    s0 = torch.randn(B, H, N, N, dtype=torch.float64, generator=g) * 0.3
    ins = [x.requires_grad_() for x in (r, w, k, v, a, b, s0)]
    y1, S1 = tm.wkv7_loop(*ins)
    y2, S2 = tm.wkv7_chunked(*ins)
    assert torch.allclose(y1, y2, rtol=0, atol=1e-12) and torch.allclose(S1, S2, rtol=0, atol=1e-12)
    g1 = torch.autograd.grad(y1.square().sum() + S1.sum(), ins)
    g2 = torch.autograd.grad(y2.square().sum() + S2.sum(), ins)
    for x, z in zip(g1, g2):
        assert torch.allclose(x, z, rtol=0, atol=1e-10)


def test_peer_lora_is_the_merged_weight():
    """The LoRA peer (bench/peer_lora.py) computes W + (alpha/r) B A: with
    random B its loss is the plain model's on the merged weights, and only
    the adapters get grads."""
    tm = _torch_model()
    base = tm.RwkvXTorch(CFG, seed=3, dtype=torch.float64)
    lora = tm.RwkvXTorch(CFG, seed=3, dtype=torch.float64)
    adapters = lora.add_lora(4, 8.0, ("tm.key_w", "cm.ffn_value_w"), seed=1)
    assert len(adapters) == 2 * 2 * CFG["n_rwkv_layer"]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in lora.names:
            if name + ".lora_A" in lora.params:
                B = lora.params[name + ".lora_B"]
                B.copy_(torch.randn(B.shape, generator=g, dtype=B.dtype))
                A = lora.params[name + ".lora_A"]
                base.params[name] += 2.0 * (B @ A).t()      # W [in, out] += s (B A)^T
    x = torch.randint(0, CFG["vocab_size"], (2, 13), generator=g)
    with torch.no_grad():
        want = base.loss(x[:, :-1], x[:, 1:])
    got = lora.loss(x[:, :-1], x[:, 1:])
    assert abs(float(got.detach() - want)) <= 1e-12 * abs(float(want))
    got.backward()
    assert all(p.grad is None for p in lora.plist)
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in adapters)
