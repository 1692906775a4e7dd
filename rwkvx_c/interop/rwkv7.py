"""The RWKV-LM x070 state dict (RWKV-7, as the ``rwkv`` pip package and
RWKV-LM load it) and the RWKV-X layout of the ``rwkv-x`` pip package, as
name maps between an RxPtModel and a plain dict of float32 NumPy arrays
under the foreign names (no PyTorch needed here)::

    sd = to_rwkv7(model)              # {"emb.weight": ..., "blocks.0.ln0.weight": ...}
    model = from_rwkv7(sd)            # sizes derived from the shapes

The mapping, tensor by tensor, and where the formats' maths differ is
docs/interop.md. A model a format cannot hold is an InteropError with one
line saying why.
"""
from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from rwkvx_c import _core
from rwkvx_c._core import RxPtModel
from rwkvx_c.errors import InteropError
from rwkvx_c.model.config import export_refusal
from rwkvx_c.model.weights import load_params

__all__ = ["to_rwkv7", "from_rwkv7", "stream_rwkv7", "PairedWeights", "StreamedWeights",
            "rwkv7_config", "to_rwkvx", "from_rwkvx", "rwkvx_refusal",
           "linear_prefixes"]

# sizes a model imported from x070 gets for what x070 has no tensor for:
# MoBA settings (no attention blocks) and, with a single layer, the
# value-residual LoRA (layer 0 has none)
_NO_ATTN = dict(n_attn_layer=0, chunk_size=32, moba_top_k=2)

# How a tensor is stored in each layout: "same" (identical array), "vec"
# (ours [C], theirs (1, 1, C)), "lin" (ours [in, out], theirs a torch Linear
# weight [out, in]), "heads" (ours [C], theirs [H, N]).
_TM_X070 = (
    ("x_r", "x_r", "vec"), ("x_w", "x_w", "vec"), ("x_k", "x_k", "vec"),
    ("x_v", "x_v", "vec"), ("x_a", "x_a", "vec"), ("x_g", "x_g", "vec"),
    ("w0", "w0", "vec"), ("w1", "w1", "same"), ("w2", "w2", "same"),
    ("a0", "a0", "vec"), ("a1", "a1", "same"), ("a2", "a2", "same"),
    ("v0", "v0", "vec"), ("v1", "v1", "same"), ("v2", "v2", "same"),
    ("g1", "g1", "same"), ("g2", "g2", "same"),
    ("k_k", "k_k", "vec"), ("k_a", "k_a", "vec"), ("r_k", "r_k", "heads"),
    ("receptance.weight", "receptance_w", "lin"), ("key.weight", "key_w", "lin"),
    ("value.weight", "value_w", "lin"), ("output.weight", "output_w", "lin"),
    ("ln_x.weight", "ln_x_w", "same"), ("ln_x.bias", "ln_x_b", "same"),
)
# the fields RWKV block 0 lacks (the value residual), from the library's schema
_VRES = tuple(name for name, _, at_layer0 in _core.tm_fields() if not at_layer0)


# ---- the x070 names ---------------------------------------------------------


def _rwkv_pairs(i: int, L: int, with_vres: bool) -> Iterator[tuple[str, str, str]]:
    """(x070 name, our name, layout) of RWKV layer i, our block L."""
    pre, ours = f"blocks.{i}.", f"blocks.{L}."
    yield pre + "ln1.weight", ours + "ln1_w", "same"
    yield pre + "ln1.bias", ours + "ln1_b", "same"
    yield pre + "ln2.weight", ours + "ln2_w", "same"
    yield pre + "ln2.bias", ours + "ln2_b", "same"
    for theirs, field, kind in _TM_X070:
        if field in _VRES and not with_vres:
            continue
        yield pre + "att." + theirs, ours + "tm." + field, kind
    yield pre + "ffn.x_k", ours + "cm.ffn_x_k", "vec"
    yield pre + "ffn.key.weight", ours + "cm.ffn_key_w", "lin"
    yield pre + "ffn.value.weight", ours + "cm.ffn_value_w", "lin"


def _x070_pairs(config: Mapping[str, int], prefix: str = "") -> list[tuple[str, str, str]]:
    """Every (x070 name, our name, layout) of a model without attention
    blocks, x070 names under prefix."""
    pairs = [("emb.weight", "emb", "same"), ("blocks.0.ln0.weight", "ln0_w", "same"),
             ("blocks.0.ln0.bias", "ln0_b", "same")]
    for i in range(config["n_rwkv_layer"]):
        pairs += list(_rwkv_pairs(i, i, i > 0))
    pairs += [("ln_out.weight", "ln_out_w", "same"), ("ln_out.bias", "ln_out_b", "same"),
              ("head.weight", "head", "lin")]
    return [(prefix + t, o, k) for t, o, k in pairs]


def _to_foreign(a: np.ndarray, kind: str) -> np.ndarray:
    """Ours to theirs for every layout but "heads" (which needs H, N)."""
    if kind == "vec":
        return a.reshape(1, 1, -1).copy()
    if kind == "lin":
        return np.ascontiguousarray(a.T)
    return a.copy()


def _from_foreign(a: np.ndarray, kind: str) -> np.ndarray:
    if kind == "lin":
        return np.ascontiguousarray(a.T)
    if kind in ("vec", "heads"):
        return a.reshape(-1)
    return a


def _export_pairs(model: RxPtModel, pairs: Sequence[tuple[str, str, str]]
                  ) -> dict[str, np.ndarray]:
    p, H, N = model.params, model.config["n_head"], model.config["head_size"]
    out = {}
    for theirs, ours, kind in pairs:
        a = np.asarray(p[ours], dtype=np.float32)
        out[theirs] = a.reshape(H, N).copy() if kind == "heads" else _to_foreign(a, kind)
    return out


# what every refusal of a format ends with: the format that holds any model
# rwkvx_c makes (its own modeling code for transformers, rwkvx_c.interop.hf_hybrid)
HF_HOLDS_IT = "--format hf holds this model (transformers, trust_remote_code=True)"


def to_rwkv7(model: RxPtModel) -> dict[str, np.ndarray]:
    """The RWKV-LM x070 state dict of a model without attention blocks:
    float32 arrays under the official names and layouts (Linear weights
    [out, in], lerps and offsets (1, 1, C), r_k [H, N], head [V, C]).
    Layer 0 gets no v0/v1/v2 (it has none; loaders ignore them there)."""
    c = model.config
    why = export_refusal(c, "rwkv7", "rwkv7 (x070)")
    if why is not None:
        dense = "" if rwkvx_refusal(c) else ", and so does --format rwkvx (the rwkv-x package)"
        raise InteropError(f"{why}; {HF_HOLDS_IT}{dense}")
    return _export_pairs(model, _x070_pairs(c))


def _shape(sd: Mapping[str, np.ndarray], name: str, ndim: int) -> tuple[int, ...]:
    if name not in sd:
        raise InteropError(f"not an RWKV-7 (x070) state dict: {name} is missing")
    s = tuple(np.shape(sd[name]))
    if len(s) != ndim:
        raise InteropError(f"{name} has shape {s}, expected {ndim} dimensions")
    return s


def rwkv7_config(sd: Mapping[str, np.ndarray], prefix: str = "") -> dict[str, int]:
    """The RxPtModel config of an x070 state dict (names under prefix), every
    size derived from the tensor shapes."""
    V, C = _shape(sd, prefix + "emb.weight", 2)
    H, N = _shape(sd, prefix + "blocks.0.att.r_k", 2)
    layers = {int(m.group(1)) for k in sd
              for m in [re.match(re.escape(prefix) + r"blocks\.(\d+)\.", k)] if m}
    n_layer = max(layers) + 1
    if layers != set(range(n_layer)):
        raise InteropError(f"layer numbers have gaps: {sorted(set(range(n_layer)) - layers)[:3]}"
                           " missing")
    pre = prefix + "blocks.0."
    F = _shape(sd, pre + "ffn.key.weight", 2)[0]
    Dw = _shape(sd, pre + "att.w1", 2)[1]
    Da = _shape(sd, pre + "att.a1", 2)[1]
    Dg = _shape(sd, pre + "att.g1", 2)[1]
    if n_layer > 1:
        Dv = _shape(sd, prefix + "blocks.1.att.v1", 2)[1]
    elif pre + "att.v1" in sd:
        Dv = _shape(sd, pre + "att.v1", 2)[1]
    else:
        Dv = Dw  # a single layer has no value residual: any size serves
    if H * N != C:
        raise InteropError(f"r_k is [{H}, {N}] but the embedding width is {C}")
    return dict(n_embd=C, n_head=H, head_size=N, n_rwkv_layer=n_layer, vocab_size=V,
                ffn_dim=F, Dw=Dw, Da=Da, Dg=Dg, Dv=Dv, ln0=1, **_NO_ATTN)


def _new_model(config: dict[str, Any], whose: str) -> RxPtModel:
    """RxPtModel(config) for _fill, its ValueError an InteropError naming
    whose sizes. _fill writes every parameter (the pairs name them all), so
    no init runs and the grads are never touched (a dense arena: no memory
    for them)."""
    try:
        return _core.RxPtModel(config, init=False, dense=True)
    except ValueError as e:
        raise InteropError(f"{whose} sizes make no valid model: {e}") from None


def _fill(model: RxPtModel, sd: Mapping[str, np.ndarray],
          pairs: Sequence[tuple[str, str, str]], optional: Sequence[str] = ()) -> None:
    """Copies sd into model by pairs after checking every name and shape:
    nothing is written unless all of sd is understood."""
    known = {t for t, _, _ in pairs}
    extra = [k for k in sd if k not in known and k not in optional]
    if extra:
        raise InteropError(f"{extra[0]} is not a tensor of the RWKV-7 model rwkvx_c holds "
                           f"({len(extra)} such; DeepEmbed and other variants are not "
                           "supported)")
    p, H, N = model.params, model.config["n_head"], model.config["head_size"]
    staged = []
    for theirs, ours, kind in pairs:
        if theirs not in sd:
            raise InteropError(f"not an RWKV-7 (x070) state dict: {theirs} is missing")
        a = np.asarray(sd[theirs])
        want = p[ours].shape
        if kind == "lin":
            want = want[::-1]
        elif kind == "vec":
            want = (1, 1) + want
        elif kind == "heads":
            want = (H, N)
        if a.shape != want:
            raise InteropError(f"{theirs} has shape {a.shape}, expected {want}")
        if not np.issubdtype(a.dtype, np.floating):
            raise InteropError(f"{theirs} has dtype {a.dtype}, expected floating point")
        staged.append((ours, _from_foreign(a.astype(np.float32, copy=False), kind)))
    for k in optional:
        if k in sd and not np.issubdtype(np.asarray(sd[k]).dtype, np.floating):
            raise InteropError(f"{k} has dtype {np.asarray(sd[k]).dtype}")
    load_params(model, dict(staged), "the state dict", InteropError)


def from_rwkv7(sd: Mapping[str, np.ndarray]) -> RxPtModel:
    """An RxPtModel (ln0 = 1, no attention blocks) holding an x070 state
    dict's weights. Layer 0's v0/v1/v2 may be present (they are unused) or
    absent; any other unknown tensor is an InteropError."""
    config = rwkv7_config(sd)
    model = _new_model(config, "the state dict's")
    _fill(model, sd, _x070_pairs(config),
          optional=tuple(f"blocks.0.att.{v}" for v in _VRES))
    return model


class PairedWeights(Mapping[str, np.ndarray]):
    """A file's weights under our parameter names, each read when asked for
    (__getitem__, the subclass's): _pairs maps our name to where it lies in
    the file, _shapes to its shape in our layout."""

    _pairs: dict[str, tuple[str, str]]
    _shapes: dict[str, tuple[int, ...]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._pairs)

    def __contains__(self, name: object) -> bool:
        return name in self._pairs

    def __len__(self) -> int:
        return len(self._pairs)

    def shape(self, name: str) -> tuple[int, ...]:
        """Parameter name's shape in our layout, without reading it."""
        return self._shapes[name]


class StreamedWeights(PairedWeights):
    """An x070 state dict's weights under our names (a .pth, a .safetensors
    file, or HF names read as x070 by rwkvx_c.interop.hf.HfAsX070), each
    read from the file and converted (float32, our orientation) only when
    asked for: a source that never holds the whole model. dtype: "bf16" when every matrix is bf16
    in the file. raw_t(name): a matrix's bf16 bits as the file holds them,
    torch's [out, in] (the embedding's [vocab, C]; RxPtModel.base_fill(...,
    transposed=True) takes them as they are), None unless bf16;
    release(name) drops its mapped pages."""

    def __init__(self, pth: Any, config: Mapping[str, int]) -> None:
        self._pth = pth
        self.config = dict(config)
        H, N = config["n_head"], config["head_size"]
        self._pairs = {o: (t, k) for t, o, k in _x070_pairs(config)}
        known = set(t for t, _ in self._pairs.values())
        optional = {f"blocks.0.att.{v}" for v in _VRES}
        extra = [k for k in pth.names if k not in known and k not in optional]
        if extra:
            raise InteropError(f"{extra[0]} is not a tensor of the RWKV-7 model rwkvx_c holds "
                               f"({len(extra)} such; DeepEmbed and other variants are not "
                               "supported)")
        shapes = {n: tuple(a.shape) for n, a in _core.RxPtModel(dict(config), init=False)
                  .params.items()}
        self._shapes = shapes
        for ours, (theirs, kind) in self._pairs.items():
            if theirs not in pth.names:
                raise InteropError(f"not an RWKV-7 (x070) state dict: {theirs} is missing")
            want = shapes[ours]
            want = want[::-1] if kind == "lin" else (1, 1) + want if kind == "vec" else \
                (H, N) if kind == "heads" else want
            if pth.shape(theirs) != want:
                raise InteropError(f"{theirs} has shape {pth.shape(theirs)}, expected {want}")
        self.dtype = "bf16" if all(pth.dtype(t) == "bf16" for t, k in self._pairs.values()
                                   if k == "lin") else "fp32"

    def __getitem__(self, name: str) -> np.ndarray:
        theirs, kind = self._pairs[name]
        a = self._pth.array(theirs)
        self._pth.release(theirs)   # copied: its mapped pages need not wait for the model
        return _from_foreign(a, kind)

    def raw_t(self, name: str) -> np.ndarray | None:
        theirs, kind = self._pairs[name]
        if (kind != "lin" and name != "emb") or self._pth.dtype(theirs) != "bf16":
            return None
        return self._pth.raw(theirs)

    def release(self, name: str) -> None:
        self._pth.release(self._pairs[name][0])


def stream_rwkv7(pth: Any) -> StreamedWeights:
    """The x070 weights of an open tensor file (rwkvx_c.interop.pth.PthTensors,
    safetensors_file.SafetensorsTensors, hf.HfAsX070: names, shape, dtype,
    raw, array, release), every name and shape checked, nothing read yet; .config is the model's."""
    shapes = {n: np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), pth.shape(n),
                                                 (0,) * len(pth.shape(n)))
              for n in pth.names}   # shape-only stand-ins for rwkv7_config
    config = rwkv7_config(shapes)
    return StreamedWeights(pth, config)


# ---- RWKV-X (the rwkv-x pip package) ------------------------------------------------


def _attn_pairs(j: int, L: int) -> list[tuple[str, str, str]]:
    """(rwkv-x name, our name, layout) of attention block j, our block L."""
    pre, ours = f"moba.{j}.", f"blocks.{L}."
    return [(pre + "ln1.weight", ours + "ln1_w", "same"),
            (pre + "ln1.bias", ours + "ln1_b", "same"),
            (pre + "att.receptance.weight", ours + "receptance_w", "lin"),
            (pre + "att.key.weight", ours + "key_w", "lin"),
            (pre + "att.value.weight", ours + "value_w", "lin"),
            (pre + "att.output.weight", ours + "output_w", "lin"),
            (pre + "ln2.weight", ours + "ln2_w", "same"),
            (pre + "ln2.bias", ours + "ln2_b", "same"),
            (pre + "ffn.x_k", ours + "cm.ffn_x_k", "vec"),
            (pre + "ffn.key.weight", ours + "cm.ffn_key_w", "lin"),
            (pre + "ffn.value.weight", ours + "cm.ffn_value_w", "lin")]


def rwkvx_refusal(config: Mapping[str, int]) -> str | None:
    """Why the rwkv-x package (0.2.x) cannot run this config exactly, or None.

    rwkv-x attends densely (causal softmax over every earlier token, no MoBA
    chunk selection), derives the head count as n_embd // 64, gives its
    attention blocks' channel-mix 4 * n_embd hidden units, and with several
    attention blocks runs RWKV blocks in groups of n_rwkv // n_attn, dropping
    any remainder. Each reason names the train flags that make a model rwkv-x runs."""
    c = config
    why = export_refusal(c, "rwkvx", "rwkv-x")
    if why is not None:
        return why
    na, nr = c["n_attn_layer"], c["n_rwkv_layer"]
    if na == 0:
        return None
    if c["moba_top_k"] > 0:
        return (f"rwkv-x attends densely (no MoBA chunk selection); this model selects "
                f"moba_top_k={c['moba_top_k']} chunks of {c['chunk_size']} (train with "
                "--moba-top-k 0, dense, for rwkvx)")
    if c["ffn_dim"] != 4 * c["n_embd"]:
        return (f"rwkv-x's attention blocks have a 4*n_embd = {4 * c['n_embd']} channel-mix; "
                f"this model's ffn_dim is {c['ffn_dim']} (train with --ffn-dim "
                f"{4 * c['n_embd']} for rwkvx)")
    if na > 1 and nr % na:
        return (f"rwkv-x drops the last n_rwkv_layer % n_attn_layer RWKV blocks; "
                f"{nr} % {na} != 0 here (train with --n-layer a multiple of --n-attn-layer "
                "for rwkvx)")
    return None


def to_rwkvx(model: RxPtModel) -> dict[str, np.ndarray]:
    """The RWKV-X checkpoint dict of a model: the x070 dict under "rwkv."
    (RWKV blocks numbered in their own array) and the attention blocks under
    "moba.<j>.". InteropError when rwkv-x cannot run the model exactly."""
    why = rwkvx_refusal(model.config)
    if why:
        raise InteropError(f"{why}; {HF_HOLDS_IT}")
    return _export_pairs(model, _rwkvx_pairs(model))


def _rwkvx_pairs(model: RxPtModel) -> list[tuple[str, str, str]]:
    """Every (rwkv-x name, our name, layout) of a model, in our block order."""
    pairs = [("rwkv." + t, o, k) for t, o, k in
             (("emb.weight", "emb", "same"), ("blocks.0.ln0.weight", "ln0_w", "same"),
              ("blocks.0.ln0.bias", "ln0_b", "same"))]
    i = j = 0
    for L, kind in enumerate(model.layers):
        if kind == "R":
            pairs += [("rwkv." + t, o, k) for t, o, k in _rwkv_pairs(i, L, i > 0)]
            i += 1
        else:
            pairs += _attn_pairs(j, L)
            j += 1
    pairs += [("rwkv.ln_out.weight", "ln_out_w", "same"), ("rwkv.ln_out.bias", "ln_out_b", "same"),
              ("rwkv.head.weight", "head", "lin")]
    return pairs


def from_rwkvx(sd: Mapping[str, np.ndarray]) -> RxPtModel:
    """An RxPtModel holding an RWKV-X checkpoint dict (the inverse of
    to_rwkvx): dense attention (moba_top_k 0), sizes from the shapes."""
    rwkv = {k: v for k, v in sd.items() if k.startswith("rwkv.")}
    moba = {int(m.group(1)) for k in sd for m in [re.match(r"moba\.(\d+)\.", k)] if m}
    other = [k for k in sd if not k.startswith("rwkv.") and not k.startswith("moba.")]
    if other:
        raise InteropError(f"{other[0]} is neither under rwkv. nor under moba.: not an RWKV-X "
                           "checkpoint")
    config = rwkv7_config(rwkv, prefix="rwkv.")
    n_attn = len(moba)
    if moba != set(range(n_attn)):
        raise InteropError("attention block numbers have gaps")
    config.update(n_attn_layer=n_attn, moba_top_k=0)
    if n_attn and config["ffn_dim"] != 4 * config["n_embd"]:
        raise InteropError(f"rwkv-x attention blocks need ffn_dim 4*n_embd; the RWKV blocks "
                           f"have {config['ffn_dim']}")
    why = rwkvx_refusal(config)
    if why:
        raise InteropError(why)
    model = _new_model(config, "the checkpoint's")
    _fill(model, sd, _rwkvx_pairs(model),
          optional=tuple(f"rwkv.blocks.0.att.{v}" for v in _VRES))
    return model


def _named_pairs(model: RxPtModel) -> list[tuple[str, str, str]]:
    """Every (export name, our name, layout) of model: x070's without
    attention blocks, RWKV-X's rwkv. / moba. names with them."""
    return _rwkvx_pairs(model) if model.config["n_attn_layer"] else _x070_pairs(model.config)


def parts_out(model: RxPtModel, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The parameters `names` of model under the export's names and layouts
    (the trained parts RWKV-PEFT saves beside its adapters)."""
    wanted = set(names)
    return _export_pairs(model, [p for p in _named_pairs(model) if p[1] in wanted])


def parts_in(model: RxPtModel, sd: Mapping[str, np.ndarray], what: str
             ) -> dict[str, tuple[str, np.ndarray]]:
    """{export name: (our name, float32 tensor)} of those tensors of sd that
    are model parameters under the export's names (checked against their
    shapes); the other names are the caller's."""
    H, N = model.config["n_head"], model.config["head_size"]
    out = {}
    for theirs, ours, kind in _named_pairs(model):
        if theirs not in sd:
            continue
        a = np.asarray(sd[theirs])
        want = model.params[ours].shape
        want = want[::-1] if kind == "lin" else (1, 1) + want if kind == "vec" else \
            (H, N) if kind == "heads" else want
        if a.shape != want or not np.issubdtype(a.dtype, np.floating):
            raise InteropError(f"{what}: {theirs} has shape {a.shape} and dtype {a.dtype}; "
                               f"the base's wants {want} of floating point")
        out[theirs] = ours, _from_foreign(a.astype(np.float32, copy=False), kind)
    return out


def _state_names(model: RxPtModel, prefixed: bool = True) -> list[str]:
    """The export's name of each RWKV block's initial state (RWKV-PEFT's
    time_state; prefixed: RWKV-X's rwkv. names in a hybrid, blocks counted
    among the RWKV ones)."""
    pre = "rwkv." if prefixed and model.config["n_attn_layer"] else ""
    return [f"{pre}blocks.{i}.att.time_state" for i in range(model.config["n_rwkv_layer"])]


def states_out(model: RxPtModel, prefixed: bool = True) -> dict[str, np.ndarray]:
    """The model's initial states (it must hold them) under the export's
    names, float32 [H, N, N] each (state[h][v][k], RWKV-PEFT's layout);
    not prefixed: blocks.{i} in a hybrid too (the state file's names)."""
    assert model.state is not None
    return {n: np.array(s, dtype=np.float32)
            for n, s in zip(_state_names(model, prefixed), model.state)}


def states_in(model: RxPtModel, sd: Mapping[str, np.ndarray], what: str) -> np.ndarray | None:
    """The initial states [n_rwkv, H, N, N] that sd holds under the export's
    names (all of them or none), float32; None when it holds none."""
    names = _state_names(model)
    held = [n for n in names if n in sd]
    if not held:
        return None
    if len(held) != len(names):
        missing = next(n for n in names if n not in sd)
        raise InteropError(f"{what} holds initial states for some RWKV blocks and not "
                           f"{missing}")
    want = (model.config["n_head"], model.config["head_size"], model.config["head_size"])
    for n in names:
        a = np.asarray(sd[n])
        if a.shape != want or not np.issubdtype(a.dtype, np.floating):
            raise InteropError(f"{what}: {n} has shape {a.shape} and dtype {a.dtype}; an "
                               f"initial state is {want} of floating point")
    return np.stack([np.asarray(sd[n], dtype=np.float32) for n in names])


def linear_prefixes(model: RxPtModel) -> dict[str, str]:
    """{our matrix name: its module's name} for every Linear weight of the
    model in the export's naming (x070 without attention blocks, RWKV-X's
    rwkv. / moba. names with them): "blocks.0.tm.key_w" -> "blocks.0.att.key",
    the prefix RWKV-PEFT hangs "lora_A" / "lora_B" on."""
    return {ours: theirs[:-len(".weight")] for theirs, ours, kind in _named_pairs(model)
            if kind == "lin" and ours != "head"}
