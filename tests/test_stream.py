"""Sources that stream into a fine-tune's frozen base (docs/finetune.md §The
frozen base): safetensors files read over a memory map
(rwkvx_c.interop.safetensors_file) bit for bit as the ``safetensors``
package wrote them, hostile files refused in one line before anything is
allocated, and an HF rwkv7 folder, an x070-named and an HF-named
.safetensors file tuning to exactly the losses of the same weights as an
x070 bf16 .pth, their bits copied into the base; loading a large bf16
folder peaks at about the model's own size."""
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest
from test_base import _bf16_pth, _tune_losses

from rwkvx_c.errors import InteropError
from rwkvx_c.interop.safetensors_file import SafetensorsTensors, ShardedTensors


def _torch_dtype(torch, dtype):
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_a_safetensors_file_reads_back_bit_for_bit(tmp_path, dtype):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    rng = np.random.default_rng(0)
    td = _torch_dtype(torch, dtype)
    tensors = {"a.weight": torch.from_numpy(rng.standard_normal((3, 5), np.float32)).to(td),
               "b": torch.from_numpy(rng.standard_normal(7).astype(np.float32)).to(td),
               "empty": torch.zeros(0, 4, dtype=td), "scalar": torch.tensor(1.5, dtype=td)}
    path = str(tmp_path / "t.safetensors")
    st.save_file(tensors, path, metadata={"format": "pt"})
    f = SafetensorsTensors(path)
    assert sorted(f.names) == sorted(tensors)
    for k, t in tensors.items():
        assert f.shape(k) == tuple(t.shape) and f.dtype(k) == dtype
        bits = t.view(torch.int16) if dtype == "bf16" else t
        assert f.raw(k).tobytes() == bits.numpy().tobytes(), k
        assert not f.raw(k).flags.writeable
        assert np.array_equal(f.array(k), t.float().numpy()), k
        f.release(k)   # pages dropped, read again from the file
        assert np.array_equal(f.array(k), t.float().numpy()), k
    # the package's own reading of the file agrees
    for k, t in st.load_file(path).items():
        assert np.array_equal(t.float().numpy(), f.array(k)), k
    f.close()


def _write(path, header, data=b"", length=None):
    """A safetensors file of header (a dict, or raw bytes) and data."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h) if length is None else length) + h + data)
    return str(path)


def _entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


HOSTILE = [
    ("short", b"", None, b"", r"not a safetensors file \(0 bytes"),
    ("long", b"{}", 10**12, b"", r"header claims 1,000,000,000,000 bytes of a 10-byte file"),
    ("garbage", b"{not json", None, b"", "header is not JSON"),
    ("list", b"[]", None, b"", "header is not a JSON object"),
    ("huge", {"x": _entry("F32", (10**6, 10**6), 0, 4)}, None, b"\0" * 4,
     r"tensor x claims shape \(1000000, 1000000\) of F32 \(4,000,000,000,000 bytes\)"),
    ("outside", {"x": _entry("F32", (2,), 4, 12)}, None, b"\0" * 8,
     r"tensor x claims shape \(2,\) of F32 \(8 bytes\) at data_offsets \[4, 12\]; the file's "
     "data is 8 bytes"),
    ("overlap", {"x": _entry("F32", (2,), 0, 8), "y": _entry("F32", (2,), 4, 12)}, None,
     b"\0" * 12, "tensors x and y overlap"),
    ("i64", {"x": _entry("I64", (1,), 0, 8)}, None, b"\0" * 8,
     r"tensor x has dtype 'I64'; rwkvx_c reads BF16, F16, F32"),
    ("f64", {"x": _entry("F64", (1,), 0, 8)}, None, b"\0" * 8, "tensor x has dtype 'F64'"),
    ("negative", {"x": _entry("F32", (-1,), 0, 0)}, None, b"",
     r"tensor x has shape \[-1\], not a list of non-negative integers"),
    ("offsets", {"x": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, None, b"\0" * 4,
     r"tensor x has data_offsets \[0\], not \[begin, end\]"),
    ("entry", {"x": 3}, None, b"", "tensor x's header entry is not an object"),
]


@pytest.mark.parametrize("name,header,length,data,match", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_safetensors_files_are_one_line(tmp_path, name, header, length, data, match):
    path = _write(tmp_path / f"{name}.safetensors", header, data, length)
    if name == "short":
        open(path, "wb").close()
    with pytest.raises(InteropError, match=match) as e:
        SafetensorsTensors(path)
    assert len(str(e.value).splitlines()) == 1 and path in str(e.value)


def test_hostile_shard_indexes_are_one_line(tmp_path):
    one = _write(tmp_path / "a.safetensors", {"x": _entry("F32", (1,), 0, 4)}, b"\0" * 4)
    shutil.copy(one, tmp_path / "b.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    cases = [({"x": "a.safetensors", "y": "c.safetensors"}, r"names the shard c\.safetensors, "
              "which .* lacks"),
             ({"x": "a.safetensors", "z": "b.safetensors"}, r"x appears in two shards of .*: "
              r"a\.safetensors and b\.safetensors"),
             ({"x": "../a.safetensors"}, "not a .safetensors file in the folder")]
    for weight_map, match in cases:
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(InteropError, match=match) as e:
            ShardedTensors(str(index))
        assert len(str(e.value).splitlines()) == 1
    index.write_text("{")
    with pytest.raises(InteropError, match="is not a safetensors index"):
        ShardedTensors(str(index))


def test_a_safetensors_file_of_no_model_names_stays_a_checkpoint(tmp_path):
    from rwkvx_c.interop.source import read_source
    path = _write(tmp_path / "x.safetensors", {"w": _entry("F32", (1,), 0, 4)}, b"\0" * 4)
    with pytest.raises(InteropError, match="no rwkvx_c metadata"):
        read_source(path)
    with pytest.raises(InteropError, match="no safetensors header"):
        read_source(_write(tmp_path / "g.safetensors", b"{x", length=10**12))


# ---- the streamed sources tune as the .pth does --------------------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """An x070 bf16 .pth of head size 64 and the same weights as an HF bf16
    folder (sharded in two), an x070-named and an HF-named .safetensors."""
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    from rwkvx_c import interop
    from rwkvx_c.data.tokenizers import ByteTokenizer
    from rwkvx_c.interop import hf
    d = tmp_path_factory.mktemp("stream")
    pth = _bf16_pth(d, C=128, H=2, N=64)
    model = interop.from_rwkv7(interop.load_pth(pth))   # bf16 values: exact at bf16
    hf.save_hf(model, ByteTokenizer(), str(d / "hf"), "bf16")
    sd = torch.load(pth, weights_only=True)
    st.save_file(sd, str(d / "x070.safetensors"))
    shutil.copy(d / "hf" / "model.safetensors", d / "hf.safetensors")
    shutil.copytree(d / "hf", d / "sharded")
    os.remove(d / "sharded" / "model.safetensors")
    whole = st.load_file(str(d / "hf" / "model.safetensors"))
    names = sorted(whole)
    parts = {"model-00001-of-00002.safetensors": names[::2],
             "model-00002-of-00002.safetensors": names[1::2]}
    for f, ks in parts.items():
        st.save_file({k: whole[k] for k in ks}, str(d / "sharded" / f))
    (d / "sharded" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, ks in parts.items() for k in ks}}))
    return d, pth


@pytest.mark.parametrize("tune", ["state", "lora"])
def test_streamed_sources_tune_to_the_pths_losses_on_its_bits(sources, tmp_path, tune):
    from rwkvx_c.interop.pth import PthTensors
    from rwkvx_c.interop.rwkv7 import StreamedWeights
    from rwkvx_c.interop.source import read_source
    d, pth = sources
    kw = dict(tune=tune, steps=3, threads=1)
    _, want = _tune_losses(tmp_path, pth, "pth", **kw)
    assert len(want) == 3
    bits = PthTensors(pth).raw("blocks.1.att.key.weight")
    for name in ("hf", "sharded", "x070.safetensors", "hf.safetensors"):
        src = read_source(str(d / name))
        assert isinstance(src.weights, StreamedWeights) and src.dtype == "bf16", name
        tr, got = _tune_losses(tmp_path, str(d / name), name, **kw)
        assert tr.model.base_dtype == "bf16" and got == want, name
        assert np.array_equal(tr.model.base_data("blocks.1.tm.key_w"), bits), name


def test_a_tied_head_streams_the_embedding(sources, tmp_path):
    st = pytest.importorskip("safetensors.torch")
    from rwkvx_c.interop.source import read_source
    d, _ = sources
    folder = tmp_path / "tied"
    shutil.copytree(d / "hf", folder)
    sd = st.load_file(str(folder / "model.safetensors"))
    del sd["lm_head.weight"]
    st.save_file(sd, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=True)))
    w = read_source(str(folder)).weights
    assert np.array_equal(w["head"], w["emb"].T)
    (folder / "config.json").write_text(json.dumps(dict(cfg, norm_eps=1e-6)))
    with pytest.raises(InteropError, match="norm_eps is 1e-06"):
        read_source(str(folder))


# ---- memory ----------------------------------------------------------------------

# a large bf16 HF folder: C 1024, 4 blocks, the World vocabulary (about 360 MB)
BIG = dict(n_embd=1024, n_head=16, head_size=64, n_rwkv_layer=4, n_attn_layer=0,
           vocab_size=65536, ffn_dim=4096, Dw=64, Da=64, Dv=32, Dg=128, chunk_size=32,
           moba_top_k=2, ln0=1)
MARGIN = 48 * 2**20   # what loading may hold besides: small tensors, the allocator's slack

_CHILD = """
import json, os, sys
from rwkvx_c.interop.source import read_source
from rwkvx_c.train import TrainOptions
from rwkvx_c.train.base import model_from_source
from rwkvx_c.train.finetune import from_source
folder, corpus = sys.argv[1:3]
def hwm():   # this process's own peak: ru_maxrss would carry the forking parent's
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024
before = hwm()
src = read_source(folder)
opts = from_source(TrainOptions(data=corpus, tune="state", batch=1, seq_len=16, threads=1,
                                cache_dir=os.path.dirname(corpus)),
                   src.config, src.tokenizer, folder).resolved()
model = model_from_source(opts, src.weights)
peak = hwm()
base = set(model.base_names)
kept = sum(4 * model.params[n].size for n in model.param_names if n not in base)
largest = max(4 * model.params[n].size for n in model.param_names)
print(json.dumps(dict(growth=peak - before, base=model.base_bytes, kept=kept, largest=largest,
                      dtype=model.base_dtype)))
"""


def _big_folder(folder):
    """BIG as an HF bf16 folder of random finite weights, written tensor by
    tensor with the safetensors layout (no float32 model anywhere)."""
    import rwkvx_c as rx
    from rwkvx_c.interop import hf
    from rwkvx_c.interop.rwkv7 import _x070_pairs
    H, N = BIG["n_head"], BIG["head_size"]
    params = rx.RxPtModel(dict(BIG), init=False).params
    shapes = {}
    for x070, ours, kind in _x070_pairs(BIG):
        s = tuple(params[ours].shape)
        s = s[::-1] if kind == "lin" else (H, N) if kind == "heads" else \
            (1, 1) + s if kind == "vec" else s
        name, hkind = hf._hf_name(x070)
        shapes[name] = s[::-1] if hkind == "T" else s[-1:] if hkind == "flat" else s
    header, at = {}, 0
    for k, s in shapes.items():
        n = 2 * int(np.prod(s))
        header[k] = _entry("BF16", s, at, at + n)
        at += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    os.makedirs(folder)
    rng = np.random.default_rng(0)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for s in shapes.values():   # small values of either sign
            f.write((rng.integers(0x3c00, 0x3c80, s, dtype=np.uint16)
                     | (rng.integers(0, 2, s, dtype=np.uint16) << 15)).tobytes())
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf.hf_config(BIG), f)


def test_a_large_bf16_folder_loads_within_the_models_size(tmp_path):
    _big_folder(str(tmp_path / "big"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # run from tmp_path: from the source tree a non-editable install's child
    # would import the unbuilt rwkvx_c there
    p = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "big"), str(corpus)],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"load growth {r['growth'] / 2**20:.0f} MiB: base {r['base'] / 2**20:.0f} MiB + "
          f"float32 {r['kept'] / 2**20:.0f} MiB")
    assert r["dtype"] == "bf16" and r["growth"] <= r["base"] + 2**30
    # the model itself, and the largest tensor once more: its float32 copy on the way
    # to the model, or its mapped bf16 pages while the base copies them
    assert r["growth"] <= r["base"] + r["kept"] + r["largest"] + MARGIN


_RUN_CHILD = """
import json, sys
from rwkvx_c.sample import load_model
def hwm():
    status = open("/proc/self/status").read()
    return int(status.split("VmHWM:")[1].split()[0]) * 1024
before = hwm()
model = load_model(sys.argv[1])
print(json.dumps(dict(growth=hwm() - before, params=4 * model.n_params,
                      largest=max(4 * model.params[n].size for n in model.param_names))))
"""


def test_a_full_runs_checkpoint_loads_within_the_models_size(tmp_path):
    """A whole run's checkpoint (its parameters and their two AdamW moments,
    3x the model) loads holding the parameters once: the file's pages are
    mapped, checksummed a span at a time and dropped, and each parameter's
    dropped again once copied; never the moments, never the file whole (it
    was read whole before: 4x the model's size at the peak)."""
    import rwkvx_c as rx
    from rwkvx_c.run.checkpoint import save_checkpoint
    model = rx.RxPtModel(dict(BIG, vocab_size=256), init=True)
    n = model.n_params
    tensors = {k: v for k, v in model.params.items()}
    rng = np.random.default_rng(0)
    tensors["optim.m"] = rng.standard_normal(n, dtype=np.float32)
    tensors["optim.v"] = rng.random(n, dtype=np.float32)
    os.makedirs(tmp_path / "run")
    save_checkpoint(str(tmp_path / "run" / "checkpoint.safetensors"), tensors, model.config,
                    {"step": 1, "tokenizer": {"name": "byte"}})
    del model, tensors
    p = subprocess.run([sys.executable, "-c", _RUN_CHILD, str(tmp_path / "run")],
                       capture_output=True, text=True, cwd=str(tmp_path),
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"load growth {r['growth'] / 2**20:.0f} MiB for {r['params'] / 2**20:.0f} MiB "
          "of parameters")
    assert r["growth"] <= r["params"] + r["largest"] + MARGIN
