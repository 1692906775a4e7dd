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
