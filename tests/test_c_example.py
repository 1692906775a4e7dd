"""examples/train_step.c, compiled against the package's shared library and
header (rwkvx_c.get_include / get_library_dir / LIBRARY_NAME), computes the
same loss and grads as RxPtModel for the same seed and tokens."""
import os
import shutil
import subprocess

import numpy as np
import pytest

import rwkvx_c as rx

EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                       "train_step.c")
# the config and batch hard-wired in train_step.c
CONFIG = dict(n_embd=32, n_head=2, head_size=16, n_rwkv_layer=3, n_attn_layer=1,
              vocab_size=50, Dw=8, Da=8, Dg=8, Dv=4, ffn_dim=64, chunk_size=4, moba_top_k=1)
IGNORE = 0


def _compiler():
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler")
    lib = rx.get_library_dir()
    assert os.path.exists(os.path.join(rx.get_include(), "rx_pretrain.h"))
    assert os.path.exists(os.path.join(lib, "lib%s.so" % rx.LIBRARY_NAME))
    exe = str(tmp_path_factory.mktemp("example") / "train_step")
    subprocess.run([cc, "-std=c11", "-O2", "-Wall", "-Werror", EXAMPLE, "-I", rx.get_include(),
                    "-L", lib, "-l" + rx.LIBRARY_NAME, "-Wl,-rpath," + lib, "-lm", "-o", exe],
                   check=True)
    return exe


@pytest.mark.parametrize("seed,T", [(0, 16), (987654321987654321, 11)])
def test_c_example_matches_python(example, seed, T):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run([example, str(seed), str(T)], env=env, capture_output=True, text=True,
                         check=True).stdout
    got = dict(line.split() for line in out.splitlines())
    tokens = ((7 * np.arange(T) + 3) % CONFIG["vocab_size"]).astype(np.int32)
    targets = np.append(tokens[1:], IGNORE).astype(np.int32)
    m = rx.RxPtModel(CONFIG, seed=seed)
    rx.set_num_threads(2)
    try:
        m.forward(tokens)
        loss = m.backward(targets, ignore_index=IGNORE)
    finally:
        rx.set_num_threads(0)
    assert got["layers"] == m.layers == "RRRA"
    assert int(got["params"]) == m.n_params
    assert float(got["loss"]) == loss
    norm = float(np.sqrt(np.sum(m.grad_buffer.astype(np.float64) ** 2)))
    assert abs(float(got["grad_norm"]) - norm) <= 1e-9 * norm


def test_pkg_config_builds_the_example(tmp_path):
    """The installed lib/pkgconfig/rwkvx_c.pc gives the flags to build and
    run a C program against the library (no rwkvx_c paths spelled out)."""
    cc, pc = _compiler(), shutil.which("pkg-config")
    if cc is None or pc is None:
        pytest.skip("no C compiler or pkg-config")
    env = dict(os.environ, PKG_CONFIG_PATH=os.path.join(rx.get_library_dir(), "pkgconfig"))
    flags = subprocess.run([pc, "--cflags", "--libs", rx.LIBRARY_NAME], env=env,
                           capture_output=True, text=True, check=True).stdout.split()
    exe = str(tmp_path / "train_step")
    subprocess.run([cc, "-std=c11", "-O2", EXAMPLE, *flags, "-lm", "-o", exe], check=True)
    out = subprocess.run([exe, "0", "16"], env=dict(os.environ, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, check=True).stdout
    assert "loss" in out
