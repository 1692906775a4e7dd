"""The package's shape (docs/architecture.md): layers whose imports run one
way, deferred imports included; no import circle; modules of a readable
size; one exception base; the public names users depend on.

Imports are read from the source with ast, so a function-level import
counts as much as a top-level one."""
import ast
import importlib
import inspect
import os

import pytest

import rwkvx_c
import rwkvx_c.errors

PKG = os.path.dirname(rwkvx_c.__file__)
# the checkout: an installed package holds no .pyx/.pxi sources and no docs/
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 600

# each module's layer, by its path: a module may import its own layer's and
# lower layers' modules, never a higher one's
LAYERS = {
    "cli": 7,
    # eval scores a trained run (sample.load_run) and serves the command line;
    # server puts a loaded run behind HTTP (sample's chat stops, generation's engine)
    "eval": 6, "server": 6,
    "train": 5, "interop": 5, "sample": 5,
    # the batched engine sample, chat and eval sit on (it takes a model, never loads one)
    "generation": 4,
    "data": 3,
    "model": 2, "run": 2,
    "util": 1, "errors": 1,
    "_omp": 0, "_core": 0, "__init__": 0, "__main__": 8,
}


# the sibling imports docs/architecture.md names: the one reader of a
# fine-tune's source, through which a resumed run and a loaded model are
# rebuilt from the base their checkpoint names
SIBLING_IMPORTS = {"rwkvx_c.interop.source": ("train", "sample")}


def _modules():
    """{dotted name: path} of every .py module of the package."""
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), os.path.dirname(PKG))[:-3]
                name = rel.replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = \
                    os.path.join(d, f)
    return out


MODULES = _modules()


def _layer(mod):
    parts = mod.split(".")
    return LAYERS[parts[1] if len(parts) > 1 else "__init__"]


def _source(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _imports(mod, path):
    """The rwkvx_c modules `mod` imports anywhere in its source."""
    tree = ast.parse(_source(path))
    pkg = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                                + ([base] if base else []))
            # `from pkg import sub` imports the submodule pkg.sub when there is one
            names = [base] + [f"{base}.{a.name}" for a in node.names
                              if f"{base}.{a.name}" in MODULES
                              or f"{base}.{a.name}" == "rwkvx_c._core"]
        else:
            continue
        for n in names:
            while n and n not in MODULES and n != "rwkvx_c._core":
                n = n.rpartition(".")[0]
            if n.startswith("rwkvx_c") and n != mod:
                out.add(n)
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    for m in MODULES:
        _layer(m)


@pytest.mark.parametrize("mod", sorted(MODULES))
def test_imports_run_down_the_layers(mod):
    if mod == "rwkvx_c":
        # the package itself loads only the binding: rwkvx_c.X imports stay lazy
        assert GRAPH[mod] <= {"rwkvx_c._core", "rwkvx_c._omp"}, GRAPH[mod]
        return
    others = [m for m in GRAPH[mod] if m not in ("rwkvx_c", "rwkvx_c._core")]
    up = [m for m in others if _layer(m) > _layer(mod)]
    assert not up, f"{mod} (layer {_layer(mod)}) imports {up} from above it"
    # siblings of one layer (train, interop, sample; model, run; util, errors)
    # stay apart: only a package's own modules import each other
    side = [m for m in others if _layer(m) == _layer(mod)
            and m.split(".")[1] != mod.split(".")[1]
            and mod.split(".")[1] not in SIBLING_IMPORTS.get(m, ())]
    assert not side, f"{mod} imports {side} from a sibling of its layer"


def test_no_import_circle():
    # subpackage __init__ files re-export their own modules: an edge into
    # one's own package's __init__ is a re-export, not a dependency
    def edges(m):
        return {n for n in GRAPH[m] if n != "rwkvx_c" and not m.startswith(n + ".")}
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(edges(m)):
            if n not in GRAPH:
                continue
            if state.get(n) == "open":
                cycle = path[path.index(n):] + [n]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if n not in state:
                visit(n, path + [n])
        state[m] = "done"
    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])


def test_the_circle_check_can_fail():
    saved = dict(GRAPH)
    try:
        GRAPH["rwkvx_c.util.atomic"] = GRAPH["rwkvx_c.util.atomic"] | {"rwkvx_c.cli"}
        with pytest.raises(AssertionError, match="import circle"):
            test_no_import_circle()
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


# the Cython sources: the extension module and the files it includes, held
# to the same size as a module (an include is a module's worth of code)
SOURCES = os.path.join(ROOT, "rwkvx_c")
CYTHON = sorted(f for f in os.listdir(SOURCES) if f.endswith((".pyx", ".pxi")))


@pytest.mark.parametrize("mod", sorted(MODULES) + CYTHON)
def test_module_size(mod):
    n = len(_source(MODULES.get(mod) or os.path.join(SOURCES, mod)).splitlines())
    assert n <= MAX_LINES, f"{mod} has {n} lines (at most {MAX_LINES})"


def test_every_cython_file_is_sized():
    """The size rule sees the extension module and its includes."""
    assert "_core.pyx" in CYTHON and "_model.pxi" in CYTHON


def test_one_exception_base():
    """Every exception class of the package is defined in rwkvx_c.errors
    and derives from RwkvxError."""
    for m in MODULES:
        if m == "rwkvx_c.__main__":
            continue
        tree = ast.parse(_source(MODULES[m]))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b) for b in node.bases}
                assert m == "rwkvx_c.errors" or not any(
                    b.endswith(("Error", "Exception")) for b in bases), \
                    f"{m} defines exception {node.name}; define it in rwkvx_c.errors"
    errors = [v for v in vars(rwkvx_c.errors).values()
              if inspect.isclass(v) and issubclass(v, BaseException)
              and not issubclass(v, Warning)]
    # the one warning class, which is no error
    assert [v for v in vars(rwkvx_c.errors).values()
            if inspect.isclass(v) and issubclass(v, Warning)] == [rwkvx_c.errors.RwkvxWarning]
    assert len(errors) >= 10
    for e in errors:
        assert issubclass(e, rwkvx_c.errors.RwkvxError), e


# the names the README and users import (docs/architecture.md keeps the list)
PUBLIC = {
    "rwkvx_c": ["RxPtModel", "InferState", "wkv7_forward", "wkv7_backward", "adamw_step",
                "get_include", "get_library_dir", "set_num_threads", "get_num_threads",
                "gemm_kernel", "has_openmp", "LIBRARY_NAME", "__version__"],
    "rwkvx_c.train": ["Trainer", "TrainOptions", "TrainError", "PRESETS", "CHECKPOINT", "LOG"],
    "rwkvx_c.sample": ["load_model", "load_run", "generate", "sample_token"],
    "rwkvx_c.generation": ["generate", "Completion", "Sampling", "STOP_REASONS"],
    "rwkvx_c.data": ["load_corpus", "Corpus", "DataError", "BatchSampler", "ByteTokenizer"],
    "rwkvx_c.interop": ["to_rwkv7", "from_rwkv7", "to_rwkvx", "from_rwkvx", "load_pth",
                        "save_pth", "export_model", "import_pth", "InteropError"],
    "rwkvx_c.cli": ["main", "build_parser"],
    "rwkvx_c.errors": ["RwkvxError"],
    "rwkvx_c.model": ["ModelConfig", "PRESETS", "init_model"],
    "rwkvx_c.run": ["RunDir", "read_checkpoint", "save_checkpoint"],
}


@pytest.mark.parametrize("mod", sorted(PUBLIC))
def test_public_names(mod):
    m = importlib.import_module(mod)
    for name in PUBLIC[mod]:
        assert hasattr(m, name), f"{mod}.{name} is gone"


def test_run_folder_names_are_the_documented_ones():
    """docs/training.md §The run folder's table is RUN_FILES, row for row,
    and every name a run folder's checks use comes from it."""
    from rwkvx_c.run import RunDir
    from rwkvx_c.run.rundir import PINS, RUN_FILES, SNAPSHOTS
    from rwkvx_c.train import CHECKPOINT, LOG
    doc = _source(os.path.join(ROOT, "docs", "training.md"))
    table = doc[doc.index("| file | holds |"):].split("\n\n")[0].splitlines()[2:]
    rows = [tuple(c.strip() for c in r.strip("|").split("|")) for r in table]
    assert rows == [(f"`{f.name}`", f.holds) for f in RUN_FILES]
    assert CHECKPOINT in [f.name for f in RUN_FILES] and LOG in [f.name for f in RUN_FILES]
    names = [os.path.basename(p) for p in RunDir("x").own_files()]
    assert names == [f.name for f in RUN_FILES if f.name not in (SNAPSHOTS, PINS)]
