"""RWKV-X's recipe: an x070 model expanded into a hybrid (--init-from X.pth
--n-attn-layer K) gives, at step 0, the rwkv package's logits of X; the
attention blocks start from the RWKV block before them with zero output
projections (rwkvx_c.train.expand)."""
import numpy as np
import pytest
from test_interop import _RWKV, _need, _official_dict, _rel, _tool_logits

from rwkvx_c import interop
from rwkvx_c.cli import main
from rwkvx_c.errors import TrainError
from rwkvx_c.sample import load_model
from rwkvx_c.train import Trainer, TrainOptions
from rwkvx_c.train.finetune import from_source

TOL = 1e-4   # max |logit diff| / max |logit|, fp32 on both sides


@pytest.fixture
def source(tmp_path):
    _need("torch")
    sd = _official_dict(np.random.default_rng(5), V=256, C=64, H=1, N=64, L=4, F=128, Dw=8,
                        Da=8, Dv=8, Dg=8)
    pth = tmp_path / "rwkv7.pth"
    interop.save_pth(sd, str(pth), "fp32")
    corpus = tmp_path / "c.txt"
    corpus.write_text("def f(x):\n    return x * 2\n" * 200)
    return pth, sd, corpus


def _trainer(tmp_path, pth, corpus, name, **model):
    from rwkvx_c.interop.source import read_source
    src = read_source(str(pth))
    o = TrainOptions(data=str(corpus), batch=2, seq_len=32, steps=2, threads=1,
                     precision="fp32", eval_tokens=64, cache_dir=str(tmp_path / "cache"),
                     model=model or None)
    o = from_source(o, src.config, src.tokenizer, str(pth))
    return Trainer(o, str(tmp_path / name), _weights=src.weights)


def test_the_expanded_hybrid_gives_the_sources_logits_at_step_0(tmp_path, source):
    _need("torch", "rwkv")
    pth, sd, corpus = source
    tr = _trainer(tmp_path, pth, corpus, "hybrid", n_attn_layer=2, chunk_size=8, moba_top_k=2)
    m = tr.model
    assert m.layers == "RRARRA" and m.config["n_attn_layer"] == 2
    # the attention block starts from the RWKV block before it, outputs zero
    assert np.array_equal(m.params["blocks.2.key_w"], sd["blocks.1.att.key.weight"].T)
    assert np.array_equal(m.params["blocks.5.receptance_w"], sd["blocks.3.att.receptance.weight"].T)
    assert not m.params["blocks.2.output_w"].any() and not m.params["blocks.5.cm.ffn_value_w"].any()
    assert np.array_equal(m.params["blocks.4.tm.value_w"], sd["blocks.3.att.value.weight"].T)
    tokens = np.frombuffer(b"def f(x):\n    return x * 2\n" * 3, np.uint8).astype(np.int32)
    ref = _tool_logits(_RWKV, pth, tokens, tmp_path)
    err = _rel(m.forward(tokens), ref)
    print(f"hybrid at step 0 vs the rwkv package on its source: {err:.2e}")
    assert err <= TOL
    tr.run()   # and it trains: the new blocks get gradients
    assert m.params["blocks.2.output_w"].any()


def test_expansion_rules(tmp_path, source):
    pth, _, corpus = source
    from rwkvx_c.interop.source import read_source
    src = read_source(str(pth))
    o = TrainOptions(model={"n_attn_layer": 5})
    with pytest.raises(TrainError, match="cannot add 5 attention blocks"):
        from_source(o, src.config, src.tokenizer, str(pth))
    o = TrainOptions(model={"n_attn_layer": 1, "n_embd": 32})
    with pytest.raises(TrainError, match="n_embd: asked 32, the source has 64"):
        from_source(o, src.config, src.tokenizer, str(pth))
    # the command line: --init-from with --n-attn-layer, then the run samples as a hybrid
    out = tmp_path / "cli"
    assert main(["train", "--init-from", str(pth), "--n-attn-layer", "1", "--data", str(corpus),
                 "--steps", "1", "--batch", "2", "--seq-len", "32", "--eval-tokens", "64",
                 "--threads", "1", "--precision", "fp32", "--out", str(out), "--no-progress",
                 "--cache-dir", str(tmp_path / "cache")]) == 0
    assert load_model(str(out)).layers == "RRRRA"


def test_only_the_new_blocks_train(tmp_path, source):
    pth, _, corpus = source
    from rwkvx_c.interop.source import read_source
    src = read_source(str(pth))
    o = TrainOptions(data=str(corpus), batch=2, seq_len=32, steps=3, threads=1,
                     precision="fp32", eval_tokens=64, cache_dir=str(tmp_path / "cache"),
                     model={"n_attn_layer": 2}, train_parts="attn")
    o = from_source(o, src.config, src.tokenizer, str(pth))
    tr = Trainer(o, str(tmp_path / "moba"), _weights=src.weights)
    before = {n: tr.model.params[n].copy() for n in tr.model.param_names}
    tr.run()
    for n in tr.model.param_names:
        attn = n.startswith(("blocks.2.", "blocks.5."))
        assert np.array_equal(tr.model.params[n], before[n]) != attn, n
