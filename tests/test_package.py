"""The installed package: its public surface, the type stub, the C header and
library for C programs."""
import ast
import inspect
import os
from pathlib import Path

import rwkvx_c as rx
from rwkvx_c import _core

PKG = os.path.dirname(rx.__file__)


def public_callables():
    return sorted(n for n, v in vars(_core).items()
                  if not n.startswith("_") and callable(v) and not inspect.ismodule(v)
                  and getattr(v, "__module__", "rwkvx_c._core") == "rwkvx_c._core")


def test_every_public_function_has_a_docstring():
    names = public_callables()
    assert "wkv7_forward" in names and "cross_entropy_backward" in names
    for n in names:
        assert (getattr(_core, n).__doc__ or "").strip(), f"{n} has no docstring"
        assert getattr(rx, n) is getattr(_core, n), f"rwkvx_c does not re-export {n}"


def test_stub_matches_the_extension():
    path = os.path.join(PKG, "_core.pyi")
    assert os.path.exists(os.path.join(PKG, "py.typed"))
    tree = ast.parse(Path(path).read_text())
    stubbed = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    missing = set(public_callables()) - stubbed
    assert not missing, f"rwkvx_c/_core.pyi lacks {sorted(missing)}"
    extra = {n for n in stubbed if not n.startswith("_")} - set(dir(_core))
    assert not extra, f"rwkvx_c/_core.pyi names {sorted(extra)} that _core does not define"


def test_c_header_and_library_are_installed():
    assert os.path.isfile(os.path.join(rx.get_include(), "rx_pretrain.h"))
    lib = os.path.join(rx.get_library_dir(), "lib%s.so" % rx.LIBRARY_NAME)
    assert os.path.isfile(lib)


def test_readme_example_runs():
    import re
    readme = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
    # Blocks fenced `python` must run as they stand (`py` ones are sketches).
    blocks = re.findall(r"```python\n(.*?)```", Path(readme).read_text(), re.S)
    assert blocks, "README.md has no python example"
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})


def test_classes_have_signatures_that_bind():
    """inspect.signature of each binding class states the parameters its
    constructor takes (a signature in the docstring, clinic form): every
    one named binds, and a call through them builds the object."""
    cfg = dict(n_embd=32, n_head=2, head_size=16, n_rwkv_layer=1, n_attn_layer=0,
               vocab_size=256, ffn_dim=64, Dw=8, Da=8, Dg=8, Dv=8, chunk_size=8, moba_top_k=1)
    sig = inspect.signature(rx.RxPtModel)
    assert list(sig.parameters) == ["config", "seed", "precision", "recompute", "l2wrap", "init",
                                    "dense"]
    assert sig.parameters["precision"].kind is inspect.Parameter.KEYWORD_ONLY
    kw = {n: p.default for n, p in sig.parameters.items() if p.default is not p.empty}
    m = rx.RxPtModel(*sig.bind(cfg, **kw).args, **sig.bind(cfg, **kw).kwargs)
    assert m.precision == "fp32" and m.recompute is False
    sig = inspect.signature(rx.InferState)
    assert rx.InferState(**sig.bind(m, max_len=4).arguments).pos == 0
    sig = inspect.signature(rx.ByteTrie)
    trie = rx.ByteTrie(**sig.bind([(bytes([i]), i) for i in range(256)], 256).arguments)
    assert trie.vocab_size == 256
    for name in public_callables():
        inspect.signature(getattr(rx, name))   # every function states its own


def test_all_names_the_public_surface():
    public = {n for n in dir(rx) if not n.startswith("_") and not inspect.ismodule(getattr(rx, n))}
    assert set(rx.__all__) - {"__version__"} == public
    assert len(rx.__all__) == len(set(rx.__all__))
    space: dict = {}
    exec("from rwkvx_c import *", space)
    assert "np" not in space and "math" not in space and "RxPtModel" in space


def test_readme_tiny_config_states_the_count_the_cli_prints(tmp_path, capsys):
    import re

    from rwkvx_c.cli import main
    # the checkout's README (the package may be installed elsewhere)
    readme = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
    stated = int(re.search(r"assert m\.n_params == ([\d_]+) +# what `train --preset tiny` "
                           r"prints", readme).group(1))
    data = tmp_path / "notes.txt"
    data.write_text("def main():\n    return 0\n" * 200)
    assert main(["train", "--preset", "tiny", "--steps", "1", "--seq-len", "16", "--batch", "1",
                 "--eval-tokens", "16", "--data", str(data), "--out", str(tmp_path / "run"),
                 "--cache-dir", str(tmp_path / "cache"), "--threads", "1"]) == 0
    printed = re.search(r"layers \w+, ([\d,]+) params", capsys.readouterr().out).group(1)
    assert int(printed.replace(",", "")) == stated
