"""One declaration per field (rwkvx_c.util.registry): these tests walk every
declared training option and model-config field and check each place that
is derived from it -- the flag, its argparse type and --help, the config
schema, the checks, the C route, the resume resolution and what a checkpoint
stores, the exporters' refusals and the README's flag table -- so a field
that one of them misses fails here."""
import argparse
import os
import re

import pytest

import rwkvx_c as rx
from rwkvx_c import _core
from rwkvx_c.cli import build_parser
from rwkvx_c.cli.common import ARG_TYPES
from rwkvx_c.errors import ConfigError, RwkvxError
from rwkvx_c.interop import rwkvx_refusal, to_rwkv7
from rwkvx_c.interop.gguf import gguf_refusal
from rwkvx_c.interop.hf import hf_refusal
from rwkvx_c.model.config import SHAPE_OPTIONS, ModelConfig, export_refusal
from rwkvx_c.model.presets import PRESETS
from rwkvx_c.train.options import TrainOptions, saved_options, schema
from rwkvx_c.util.registry import KINDS, REQUIRED, entries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what rwkvx-c train offers beyond the declared fields: where the run goes
TRAIN_OWN = {"--out", "--resume", "--no-progress", "--config", "--help", "-h"}
SMALL = dict(n_embd=64, n_head=1, head_size=64, n_rwkv_layer=2, n_attn_layer=0, vocab_size=256,
             Dw=4, Da=4, Dg=4, Dv=4, ffn_dim=32, chunk_size=4, moba_top_k=0, ln0=1)


def _train_actions():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {s: a for a in sub.choices["train"]._actions for s in a.option_strings}


def _declared():
    return list(entries(TrainOptions)) + list(entries(ModelConfig))


def test_every_flag_comes_from_a_declaration():
    actions = _train_actions()
    declared = {e.flag: e for e in _declared() if e.flag}
    aliases = {a: e for e in _declared() for a in e.aliases}   # further spellings of a flag
    assert set(actions) - TRAIN_OWN == set(declared) | set(aliases)
    for alias, e in aliases.items():
        assert actions[alias] is actions[e.flag], alias
    for flag, e in declared.items():
        a = actions[flag]
        assert a.dest == (e.key if e in entries(TrainOptions) else e.flag[2:].replace("-", "_"))
        assert e.help.replace("%", "%%").split(" (default")[0] in a.help
        if e.kind == "flag":
            assert isinstance(a, argparse._StoreTrueAction) and a.default is None, flag
        elif e.choices:
            assert list(a.choices) == list(e.choices), flag
        else:
            assert a.type is ARG_TYPES[e.kind], flag
            assert a.metavar == e.metavar, flag


def test_shape_options_are_the_flagged_model_fields():
    flagged = [e for e in entries(ModelConfig) if e.flag]
    assert [o.field for o in SHAPE_OPTIONS] == [e.key for e in flagged]
    for o, e in zip(SHAPE_OPTIONS, flagged):
        assert o.kind == e.kind and o.metavar == e.metavar
        with pytest.raises(ConfigError, match=f"{o.name} must be {KINDS[o.kind].what}"):
            ModelConfig.preset("tiny").with_shape(**{o.name: "x"})


def test_schema_has_every_field_with_type_default_and_check():
    keys = [e.key for e in schema()]
    assert keys == [e.key for e in entries(TrainOptions)] + \
        ["model." + e.key for e in entries(ModelConfig)]
    assert len(set(keys)) == len(keys)
    for e in schema():
        assert e.help and e.type in (int, float, bool, str, list, dict), e.key
        if not e.required and e.default is not None:   # each default passes its own check
            assert e.problem(e.default) is None, e.key
    steps = next(e for e in schema() if e.key == "steps")
    assert steps.problem(0) == "steps must be an integer > 0, got 0"
    assert next(e for e in schema() if e.key == "preset").problem("XL").startswith(
        "unknown preset 'XL'")


def test_every_declared_check_reaches_train_options():
    """A value each entry refuses is refused by TrainOptions.resolved() with
    that entry's message."""
    bad = {"pos_int": 0, "nonneg_int": -1, "pos_float": 0.0, "nonneg_float": -1.0,
           "unit_float": 2.0, "unit_open": 1.0, "flag": "yes", "str": 3, "names": 3,
           "path": 3, "paths": [3], "texts": [3], "config": 3}
    for e in entries(TrainOptions):
        v = "no such choice" if e.choices else bad[e.kind]
        why = e.problem(v)
        assert why is not None, e.key
        with pytest.raises(RwkvxError) as err:
            TrainOptions(**{e.key: v}).resolved()
        assert e.key in str(err.value), (e.key, str(err.value))


def test_c_routes_are_the_bindings():
    routes = {}
    for e in entries(ModelConfig):
        assert e.c_route in ("struct", "ctx"), e.key
        routes.setdefault(e.c_route, []).append(e.key)
    assert tuple(routes["struct"]) == _core.CONFIG_FIELDS
    assert routes["ctx"] == list(_core.OPTION_FIELDS)
    for k, v in _core.OPTION_FIELDS.items():   # the binding's default is the declared one
        assert next(e for e in entries(ModelConfig) if e.key == k).default == v
    assert [e.key for e in entries(ModelConfig) if e.required] == list(_core.CONFIG_FIELDS)


def _header():
    with open(os.path.join(ROOT, "csrc", "rx_pretrain.h"), encoding="utf-8") as f:
        return f.read()


def _c_struct(text, name):
    """[(field, C type)] of `typedef struct { ... } name;` in C text."""
    body = re.search(r"typedef struct \{([^}]*)\}\s*" + name + ";", text).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    return [(m.group(2), m.group(1)) for m in re.finditer(r"(\w+)\s+(\w+)\s*;", body)]


def test_the_model_context_is_the_declared_one():
    """rx_model_ctx (csrc/rx_pretrain.h), its defaults (RX_DEFAULT_*) and its
    designated default initializer against the declaration: the ModelConfig
    fields routed "ctx" (in order), then the model's settings that are
    attributes (l2wrap); the binding's struct (_rx.pxd) field for field."""
    h = _header()
    fields = _c_struct(h, "rx_model_ctx")
    declared = [e for e in entries(ModelConfig) if e.c_route == "ctx"]
    assert sorted(k for k, _ in fields) == sorted([e.key for e in declared]
                                                   + list(_core._CTX_SETTINGS))
    assert list(_core._CTX_KEYS) == [e.key for e in declared] == list(_core.OPTION_FIELDS)
    with open(os.path.join(ROOT, "rwkvx_c", "_rx.pxd"), encoding="utf-8") as f:
        block = re.search(r"ctypedef struct rx_model_ctx:\n((?: {8}\S.*\n)+)", f.read()).group(1)
    assert [tuple(line.split()[::-1]) for line in block.splitlines()] == fields
    init = re.search(r"#define RX_MODEL_CTX_DEFAULT \{(.*?)\}", h, re.S).group(1)
    pairs = re.findall(r"\.(\w+)\s*=\s*(\w+)", init)
    assert pairs == [(k, "RX_DEFAULT_" + k.upper()) for k, _ in fields]
    kinds = {"double": float, "int": int}   # the C type of each kind's values
    for e in declared:
        value = re.search(r"#define RX_DEFAULT_" + e.key.upper() + r" (\S+)", h).group(1)
        assert float(value) == e.default == _core.OPTION_FIELDS[e.key], e.key
        assert kinds[dict(fields)[e.key]] is KINDS[e.kind].type, e.key


def test_the_hf_hybrid_config_holds_every_context_key():
    """rwkvx_c's own hf layout writes each model-context key (a transformers
    name for ln0 and the eps, its own name for any other)."""
    from rwkvx_c.interop import hf_hybrid
    cfg = ModelConfig.resolve(dict(SMALL))
    out = hf_hybrid.hybrid_config(cfg, "RR")
    for e in entries(ModelConfig):
        if e.c_route == "ctx" and e.key not in hf_hybrid._CTX_NAMED:
            assert out[e.key] == cfg[e.key], e.key


def test_the_key_norm_floor_is_one_constant():
    """RX_KK_FLOOR is the binding's KK_FLOOR; the float64 reference
    (tests/reference/rwkv.py, written from docs/maths.md on its own) and the
    hf export's modeling code (package data that runs without rwkvx_c) keep
    their own literal, which must be the same number."""
    import numpy as np

    from reference import rwkv
    h = _header()
    assert float(re.search(r"#define RX_KK_FLOOR (\S+)f", h).group(1)) == 1e-12
    path = os.path.join(ROOT, "rwkvx_c", "interop", "hf_code", "modeling_rwkvx.py")
    with open(path, encoding="utf-8") as f:
        hf = float(re.search(r"^KEY_NORM_FLOOR = (\S+)", f.read(), re.M).group(1))
    for v in (rwkv.KK_FLOOR, hf):
        assert np.float32(v) == np.float32(_core.KK_FLOOR)


def test_absence_resolves_and_is_not_stored():
    """A field that declares its absence: a saved dict without it resolves to
    it; a value equal to it is not stored (an older version reads the run)."""
    for cls in (TrainOptions, ModelConfig):
        for e in entries(cls):
            if not e.declares_absent:
                assert e.absent == e.default or e.required, e.key
                continue
            full = dict(SMALL) if cls is ModelConfig else TrainOptions().to_dict()
            full[e.key] = e.absent
            kept = ModelConfig.stored(full) if cls is ModelConfig else \
                TrainOptions(**full).stored()
            assert e.key not in kept, e.key
            without = {k: v for k, v in full.items() if k != e.key}
            resolved = ModelConfig.resolve(without) if cls is ModelConfig else \
                saved_options(without, "x").to_dict()
            assert resolved[e.key] == e.absent, e.key


def test_saved_options_fill_the_model_config_absences():
    old = {k: v for k, v in SMALL.items() if k != "ln0"}   # a run from before ln0
    opts = saved_options(TrainOptions(preset="tiny", model=old).to_dict(), "x")
    assert opts.model == ModelConfig.resolve(old)
    assert opts.model["ln0"] == 0 and PRESETS["tiny"]["model"]["ln0"] == 1   # not the preset's


REFUSALS = {"gguf": gguf_refusal, "hf": hf_refusal, "rwkvx": rwkvx_refusal,
            "rwkv7": lambda c: _raises(to_rwkv7, rx.RxPtModel(c))}


def _raises(f, *a):
    try:
        f(*a)
    except RwkvxError as e:
        return str(e)
    return None


def _other(e, want):
    """A value of field e other than `want` that still makes a model."""
    if e.key == "head_size":
        return dict(head_size=32, n_head=2)
    if e.kind == "pos_float":
        return {e.key: want * 2}
    return {e.key: 1 - want if e.kind == "bit" else want + 1}


def test_every_export_limit_is_refused():
    """Each field's exports (the one value a format holds): a model with
    another value is refused by that format's exporter, naming the field."""
    seen = 0
    for e in entries(ModelConfig):
        for fmt, want in e.exports.items():
            cfg = dict(SMALL, **{e.key: want})
            assert export_refusal(cfg, fmt, fmt) is None, (e.key, fmt)
            cfg.update(_other(e, want))
            if cfg["n_attn_layer"] > cfg["n_rwkv_layer"]:
                cfg["n_rwkv_layer"] = cfg["n_attn_layer"]
            why = REFUSALS[fmt](cfg)
            assert why is not None and e.key in why, (e.key, fmt, why)
            seen += 1
    assert seen >= 10


def _readme_flags():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    table = text[text.index("Useful flags"):]
    table = table[:table.index("\n\n", table.index("| flag |"))]
    for row in table.splitlines()[3:]:
        for cell in re.findall(r"`(--[^`]+)`", row.split("|")[1]):
            yield cell.replace("\\|", "|")


def test_readme_flag_table_matches_the_declarations():
    """Every flag the README's table names exists, with the metavar or
    choices it shows."""
    actions = _train_actions()
    names = list(_readme_flags())
    assert len(names) >= 10
    for cell in names:
        flag, _, shown = cell.partition(" ")
        assert flag in actions, cell
        a = actions[flag]
        if shown:
            want = "|".join(a.choices) if a.choices else a.metavar
            assert sorted(shown.split("|")) == sorted(want.split("|")), (cell, want)


def test_required_fields_have_no_default():
    for e in entries(ModelConfig):
        assert (e.default is REQUIRED) == e.required


def test_the_eps_defaults_are_written_once():
    """The norms' eps defaults are literals in csrc/rx_pretrain.h alone
    (RX_DEFAULT_LN_EPS, RX_DEFAULT_GN_EPS): no kernel, module, reference or
    benchmark writes its own."""
    literal = re.compile(r"(?<![\w.])(1e-0?5f?|64e-0?5f?|0\.00064|0\.00001)(?![\w.])")
    places = [os.path.join("csrc", f) for f in os.listdir(os.path.join(ROOT, "csrc"))]
    for top in ("rwkvx_c", os.path.join("tests", "reference")):
        places += [os.path.join(d, f)[len(ROOT) + 1:] for d, _, fs in
                   os.walk(os.path.join(ROOT, top)) for f in fs if f.endswith((".py", ".pxi"))]
    places += [os.path.join("bench", "torch_model.py")]
    found = []
    for rel in places:
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            found += [rel for line in f if literal.search(line.split("#")[0].split("//")[0])]
    assert set(found) == {os.path.join("csrc", "rx_pretrain.h")}, found


def test_the_binding_declares_c_in_rx_pxd_alone():
    for f in os.listdir(os.path.join(ROOT, "rwkvx_c")):
        if f.endswith((".pxi", ".pyx")):
            with open(os.path.join(ROOT, "rwkvx_c", f), encoding="utf-8") as fh:
                assert "cdef extern" not in fh.read(), f
