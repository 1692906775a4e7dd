""".pth without torch (docs/interop.md §.pth files): save_pth writes the zip
torch.save writes, which torch.load(weights_only=True) reads back exactly
(bf16 rounded to nearest even as torch rounds, fp16, shapes and order,
tensors aligned for mmap), and load_pth reads both its own and torch's
files with torch absent; an export and an import in a process that cannot
import torch."""
import os
import subprocess
import sys

import numpy as np
import pytest

from rwkvx_c.errors import InteropError
from rwkvx_c.interop.pth import ALIGN, PthTensors, load_pth, save_pth, to_bf16_bits

DT = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _sd():
    rng = np.random.default_rng(0)
    return {"emb.weight": rng.standard_normal((7, 5)).astype(np.float32),
            "blocks.0.att.r_k": rng.standard_normal((2, 3)).astype(np.float32) * 1e-3,
            "scalar": np.full((), 3.25, np.float32), "none": np.zeros((0, 4), np.float32)}


@pytest.mark.parametrize("dtype", list(DT))
def test_torch_loads_what_save_pth_writes(tmp_path, dtype):
    torch = pytest.importorskip("torch")
    sd, path = _sd(), str(tmp_path / "m.pth")
    save_pth(sd, path, dtype)
    for mmap in (False, True):   # mmap needs torch's alignment of each tensor
        got = torch.load(path, weights_only=True, mmap=mmap)
        assert list(got) == list(sd)
        for k, v in sd.items():
            want = torch.from_numpy(np.asarray(v, np.float32)).to(getattr(torch, DT[dtype]))
            assert got[k].dtype == want.dtype and torch.equal(got[k], want), k
    back = load_pth(path)
    assert all(np.array_equal(back[k], got[k].float().numpy()) for k in sd)
    ref = str(tmp_path / "torch.pth")   # and torch's own file, read without torch
    torch.save({k: torch.from_numpy(np.asarray(v, np.float32)).to(getattr(torch, DT[dtype]))
                for k, v in sd.items()}, ref)
    theirs = load_pth(ref)
    assert all(np.array_equal(theirs[k], back[k]) for k in sd)


def test_tensors_start_aligned(tmp_path):
    path = str(tmp_path / "m.pth")
    save_pth(_sd(), path, "bf16")
    p = PthTensors(path)
    for k in p.names:
        r = p.raw(k)
        if r.size:
            start = r.__array_interface__["data"][0] - np.frombuffer(
                p._map, np.uint8, count=1).__array_interface__["data"][0]
            assert start % ALIGN == 0, k
    p.close()


def test_bf16_rounds_as_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x = np.concatenate([
        (rng.standard_normal(200_000) * 10.0 ** rng.uniform(-40, 38, 200_000)),
        [np.inf, -np.inf, 3.4e38, -3.4e38, 1e-45, 0.0, -0.0]]).astype(np.float32)
    # ties: a float32 exactly halfway between two bfloat16 values
    ties = (np.arange(1, 2000, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    x = np.concatenate([x, ties, -ties])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(to_bf16_bits(x), want)
    nan = to_bf16_bits(np.array([np.nan], np.float32)).astype(np.uint32) << 16
    assert np.isnan(nan.view(np.float32)).all()


def test_a_non_float_tensor_is_one_line(tmp_path):
    torch = pytest.importorskip("torch")
    path = str(tmp_path / "ints.pth")
    torch.save({"w": torch.zeros(3, dtype=torch.int64)}, path)
    with pytest.raises(InteropError, match="LongStorage"):
        load_pth(path)


def test_export_and_import_with_no_torch(tmp_path):
    """A process where `import torch` fails writes and reads .pth."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from rwkvx_c.cli import main\n"
        f"run = {str(tmp_path / 'run')!r}\n"
        "assert main(['train', '--preset', 'tiny', '--n-attn-layer', '0', '--steps', '1',"
        " '--seq-len', '16', '--batch', '2', '--eval-tokens', '32', '--threads', '1',"
        f" '--cache-dir', {str(tmp_path / 'cache')!r}, '--out', run]) == 0\n"
        f"assert main(['export', run, '--format', 'rwkv7', '--dtype', 'bf16', '--out',"
        f" {str(tmp_path / 'm.pth')!r}]) == 0\n"
        f"assert main(['import', {str(tmp_path / 'm.pth')!r}, '--out',"
        f" {str(tmp_path / 'imp')!r}]) == 0\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    # run outside the checkout: the package as installed, not its source tree
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"),
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    torch = pytest.importorskip("torch")
    assert torch.load(str(tmp_path / "m.pth"), weights_only=True)["emb.weight"].dtype == \
        torch.bfloat16
