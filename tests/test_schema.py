"""One schema source: the time-mix fields are csrc/rx_internal.h's
RX_TM_FIELDS (exported as rx_tm_field, rwkvx_c.tm_fields) and the presets are
rwkvx_c/model/presets.py. These tests hold each against the docs and against every
place that reads it, so a change in one place that the others miss fails
here rather than as a misplaced tensor."""
import os
import re

import numpy as np

import rwkvx_c as rx

from reference.rwkv import tm_schema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = dict(C=16, Dw=4, Da=5, Dg=6, Dv=3)


def test_tm_fields_are_the_docs_table():
    # tm_schema reads docs/layout.md §Parameters; the C list must be it
    assert rx.tm_fields() == tm_schema()
    names = [n for n, _, _ in rx.tm_fields()]
    assert len(set(names)) == len(names)
    assert [n for n, _, at0 in rx.tm_fields() if not at0] == ["v0", "v1", "v2"]


def test_tm_shapes_follow_the_fields():
    for lid in (0, 1):
        shapes = rx.tm_shapes(SIZES, lid)
        want = [n for n, _, at0 in rx.tm_fields() if at0 or lid > 0]
        assert list(shapes) == want
        for n, dims, _ in rx.tm_fields():
            if n in shapes:
                assert shapes[n] == tuple(SIZES[d] for d in dims)


def test_model_blocks_hold_the_schema():
    cfg = dict(n_embd=16, n_head=2, head_size=8, n_rwkv_layer=2, n_attn_layer=0, vocab_size=11,
               Dw=4, Da=5, Dg=6, Dv=3, ffn_dim=8, chunk_size=4, moba_top_k=1)
    m = rx.RxPtModel(cfg, seed=0)
    for L in (0, 1):
        pre = f"blocks.{L}.tm."
        got = {n[len(pre):]: m.params[n].shape for n in m.param_names if n.startswith(pre)}
        assert list(got.items()) == list(rx.tm_shapes(SIZES, L).items())


def test_bindings_fill_every_field_by_offset():
    # a distinct value per tensor: a field filled from another's array, or
    # left NULL, changes the output or is rejected by the C check
    rng = np.random.default_rng(0)
    C, H, N = SIZES["C"], 2, 8
    p = {n: (rng.standard_normal(s) * 0.3).astype(np.float32)
         for n, s in rx.tm_shapes(SIZES, 1).items()}
    x = rng.standard_normal((1, 3, C)).astype(np.float32)
    vf = rng.standard_normal((1, 3, C)).astype(np.float32)
    out, _ = rx.timemix_forward(p, x, v_first=vf, n_head=H, head_size=N, layer_id=1)
    _, grads, _, _ = rx.timemix_backward(p, x, np.ones_like(x), v_first=vf, n_head=H,
                                         head_size=N, layer_id=1)
    assert list(grads) == list(p) and np.isfinite(out).all()
    for n, g in grads.items():
        assert g.shape == p[n].shape and np.any(g != 0), n


def test_interop_maps_every_field():
    from rwkvx_c.interop import rwkv7
    ours = [f for _, f, _ in rwkv7._TM_X070]
    assert sorted(ours) == sorted(n for n, _, _ in rx.tm_fields())
    assert rwkv7._VRES == ("v0", "v1", "v2")


def _docs_presets():
    """{name: (config, T)} from the table of docs/training.md §Presets."""
    with open(os.path.join(ROOT, "docs", "training.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("## Presets", 1)[1].split("\n\n")[2]
    out = {}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        ints = [[int(v) for v in re.split(r"[ x/,]+", c)] for c in cells[1:]]
        (C,), (H, N), (nr, na), (V,), (F,), (Dw, Da, Dg, Dv), (cs, k), (T,) = ints
        out[cells[0]] = (dict(n_embd=C, n_head=H, head_size=N, n_rwkv_layer=nr, n_attn_layer=na,
                              vocab_size=V, ffn_dim=F, Dw=Dw, Da=Da, Dg=Dg, Dv=Dv,
                              chunk_size=cs, moba_top_k=k), T)
    return out


def test_presets_are_the_docs_table():
    from rwkvx_c.model.presets import PRESETS
    docs = _docs_presets()
    assert set(docs) == set(PRESETS) - {"default"}
    for name, (cfg, T) in docs.items():
        assert PRESETS[name]["model"] == dict(cfg, ln0=1), name
        assert PRESETS[name]["seq_len"] == T, name
    assert PRESETS["default"] == dict(PRESETS["tiny"], time_budget=9.5)


def test_bench_presets_are_the_trainers():
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_common",
                                                  os.path.join(ROOT, "bench", "common.py"))
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    from rwkvx_c.model.presets import PRESETS
    for name, (cfg, T) in _docs_presets().items():
        assert common.PRESETS[name] == dict(cfg, T=T), name
    assert set(common.PRESETS) == set(PRESETS) - {"default"}
