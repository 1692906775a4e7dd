"""LoRA adapters in: a Hugging Face PEFT adapter folder written for the hf
export of a model (adapter_config.json, adapter_model.safetensors), or an
RWKV-PEFT .pth (``{module}.lora_A`` / ``.lora_B``, or MiSS's
``{module}.disha``, under x070 or RWKV-X names, with the parts it trained
beside them), put on their base as a LoRA run that trains on:

    ads = read_adapters("peft_dir/", base_model)   # {param: (A, B)}, alpha, targets
    import_adapters("peft_dir/", "base/", "runs/lora")   # rwkvx-c import --base

The adapters keep PEFT's shapes (A [r, in], B [out, r]) and scale alpha / r,
which rwkvx_c's LoRA computes with (docs/maths.md §LoRA); a module rwkvx_c
does not adapt is refused by name. A PEFT folder must agree with itself as
peft reads it: its config's r is its tensors' rank, and its target_modules
(matched as peft matches them: a str is a regular expression over the whole
module name, a list names modules or their last name parts) names exactly
the modules it holds adapters for; a contradiction is refused naming the
key. docs/finetune.md §Adapters in."""
from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rwkvx_c._core import RxPtModel
from rwkvx_c.errors import InteropError
from rwkvx_c.interop.hf import PEFT_FILES, _need
from rwkvx_c.interop.hf_hybrid import export_modules
from rwkvx_c.interop.pth import PthTensors, load_pth
from rwkvx_c.interop.rwkv7 import linear_prefixes, parts_in, states_in
from rwkvx_c.model.lora import A_SUFFIX, B_SUFFIX, TARGETS, fold_matrix, target_params
from rwkvx_c.model.parts import STATES, part_of
from rwkvx_c.run.checkpoint import STATE_KEY
from rwkvx_c.util.files import check_input, read_json

__all__ = ["Adapters", "is_adapter", "peft_base", "read_adapters"]

_PEFT_PREFIX = "base_model.model."
# PEFT inits that change the base weights the adapters then sit on
_RESIDUAL_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")
_RWKV_PEFT_META = ("lora_alpha", "lora_r")   # what rwkvx_c's lora export adds beside them
DISHA_SUFFIX = ".disha"   # RWKV-PEFT's MiSS (DiSHA, "bone" mode) block [r, out]
# peft's MiSS forms: the default (a [r, out] block), mini (a [r, mini_r]
# block repeated across out: the default form of a repeated block) and bat
# (blocks of W times [r, r] blocks: a change that depends on the base)
_MISS_FORMS = (True, "mini")


@dataclass
class Adapters:
    """LoRA adapters for a base model: {our param name: (A [r, in], B [out, r])},
    alpha (the kind's, rwkvx_c.model.lora.scale), the --lora-targets names
    they cover, their kind (rwkvx_c.model.lora.ADAPTERS: lora, dora or
    miss), DoRA's magnitudes {our param name: M [out]} (a PEFT folder of
    use_dora), and the parts an RWKV-PEFT file trained beside them {our
    param name: tensor}, which replace the base's."""
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]
    alpha: float
    targets: str
    magnitudes: dict[str, np.ndarray] = field(default_factory=dict)
    kind: str = "lora"
    parts: dict[str, np.ndarray] = field(default_factory=dict)

    part_groups: str = ""   # --train-parts' groups of the parts ("ln,time"; "": none)

    def record(self) -> dict[str, Any]:
        """r, alpha, targets, kind and the parts' groups: what fixes the tune
        that trains them on."""
        return {"r": self.r, "alpha": self.alpha, "targets": self.targets, "kind": self.kind,
                "parts": self.part_groups}

    @property
    def r(self) -> int:
        return int(next(iter(self.pairs.values()))[0].shape[0])


def is_adapter(path: str) -> bool:
    """Whether path is a PEFT adapter folder or an RWKV-PEFT adapter .pth."""
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, PEFT_FILES[0]))
    if not (path.endswith(".pth") and os.path.isfile(path)):
        return False
    pth = PthTensors(path)   # its names and shapes alone: no tensor is read
    try:
        return any(k.endswith((A_SUFFIX, DISHA_SUFFIX)) for k in pth.names)
    finally:
        pth.close()


def peft_base(folder: str) -> str | None:
    """The local base a PEFT folder's adapter_config.json names
    (base_model_name_or_path, relative to the folder), or None."""
    with contextlib.suppress(OSError, InteropError):
        cfg = read_json(os.path.join(folder, PEFT_FILES[0]), InteropError, "the PEFT config")
        name = cfg.get("base_model_name_or_path") if isinstance(cfg, dict) else None
        if isinstance(name, str) and name:
            path = os.path.join(folder, name)
            if os.path.isdir(path):
                return path
    return None


def read_adapters(path: str, base: RxPtModel, alpha: float | None = None,
                  init: str | None = None) -> Adapters:
    """The adapters at path (a PEFT folder or an RWKV-PEFT .pth) under the
    parameter names of base. alpha: for a .pth that does not record it
    (RWKV-PEFT's own files; merge_lora.py takes it as an argument). init:
    an RWKV-PEFT PiSSA checkpoint's init_pissa.pth (_with_pissa_init)."""
    mags: dict[str, np.ndarray] = {}
    parts: dict[str, np.ndarray] = {}
    if os.path.isdir(path):
        pairs, alpha, kind, mags = _read_peft(path, base)
    else:
        if init is not None and alpha is not None:
            raise InteropError(f"{path}: an RWKV-PEFT PiSSA checkpoint (--lora-init) scales "
                               "by 1; drop --lora-alpha")
        pairs, read_alpha, kind, parts = _read_rwkv_peft(path, base, alpha, init is None)
        if init is not None:
            pairs, read_alpha = _with_pissa_init(path, pairs, kind, read_alpha, init, base)
        assert read_alpha is not None   # _read_rwkv_peft refuses a file without one
        alpha = read_alpha
    if not pairs:
        raise InteropError(f"{path} holds no LoRA adapters")
    ranks = {A.shape[0] for A, _ in pairs.values()}
    if len(ranks) > 1:
        raise InteropError(f"{path}: adapters of ranks {sorted(ranks)}; rwkvx_c's LoRA has one "
                           "rank for all")
    for name, (A, B) in pairs.items():
        n_in, n_out = base.params[name].shape
        r = A.shape[0]
        if A.shape != (r, n_in) or B.shape != (n_out, r):
            raise InteropError(f"{path}: the adapter of {name} has lora_A {A.shape} and lora_B "
                               f"{B.shape}; its projection wants ({r}, {n_in}) and ({n_out}, {r})")
        if not (np.all(np.isfinite(A)) and np.all(np.isfinite(B))):
            raise InteropError(f"{path}: the adapter of {name} holds NaN or inf")
        if mags and (name not in mags or mags[name].shape != (n_out,)
                     or not np.all(np.isfinite(mags[name]))):
            raise InteropError(f"{path}: the DoRA adapter of {name} wants a finite "
                               f"lora_magnitude_vector of shape ({n_out},)")
    groups = sorted({STATES if n == STATE_KEY else part_of(n, base.layers) or "?"
                     for n in parts})
    return Adapters(pairs, float(alpha), _targets_of(path, base, pairs), mags, kind, parts,
                    ",".join(groups))


def _module_params(base: RxPtModel) -> dict[str, str]:
    """{module name in the exports (x070 / RWKV-X): our param name}."""
    return {mod: ours for ours, mod in linear_prefixes(base).items()}


def _read_peft(folder: str, base: RxPtModel
               ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], float, str,
                          dict[str, np.ndarray]]:
    cpath = os.path.join(folder, PEFT_FILES[0])
    try:
        cfg = read_json(cpath, InteropError, "the PEFT config")
    except OSError as e:
        raise InteropError(f"{cpath} is not readable: {e.strerror or e}") from None
    if not isinstance(cfg, dict):
        raise InteropError(f"{cpath} does not hold a JSON object")
    _check_peft_config(cfg, cpath)
    miss = cfg["peft_type"] == "MISS"
    r = int(cfg["r"])
    alpha = float(r if miss else cfg["lora_alpha"])   # MiSS: scale 1, its alpha unused
    mini = int(cfg.get("mini_r") or 0) if miss and cfg.get("init_weights") == "mini" else 0
    if cfg.get("use_rslora"):   # scale alpha / sqrt(r): the same scale as alpha * sqrt(r) / r
        alpha *= math.sqrt(r)
    torch, st = _need("reading a PEFT adapter folder")
    wpath = os.path.join(folder, PEFT_FILES[1])
    if not os.path.isfile(wpath):
        raise InteropError(f"{folder} has no {PEFT_FILES[1]} (pickled adapter_model.bin is not "
                           "read)")
    try:
        tensors = {k: v.to(torch.float32).numpy() for k, v in st.load_file(wpath).items()}
    except Exception as e:  # noqa: BLE001 -- safetensors raises several types
        raise InteropError(f"{wpath} is not a readable safetensors file: {e}") from None
    params = {mod: ours for ours, mod in export_modules(base).items()}
    found: dict[str, dict[str, np.ndarray]] = {}
    mags: dict[str, np.ndarray] = {}
    for key, a in tensors.items():
        mod, part = _split_peft_key(key, wpath, miss, bool(cfg.get("use_dora")))
        if mod not in params:
            raise InteropError(f"{wpath}: {mod} is not a projection rwkvx_c adapts (it adapts "
                               f"{', '.join(sorted(TARGETS))} in every block)")
        if miss:   # its block M [r, out] is B^T beside the fixed fold A
            part, a = "B", _miss_block(a, mini, base.params[params[mod]].shape[1], key)
            found.setdefault(params[mod], {})["A"] = \
                fold_matrix(a.shape[1], base.params[params[mod]].shape[0])
        if part == "magnitude":
            mags[params[mod]] = np.ascontiguousarray(a.reshape(-1), dtype=np.float32)
        else:
            found.setdefault(params[mod], {})[part] = a
    pairs = _pairs(found, wpath)
    _agree(cfg, cpath, params, pairs, r)
    return pairs, alpha, "miss" if miss else "dora" if mags else "lora", mags


def _miss_block(M: np.ndarray, mini: int, n_out: int, key: str) -> np.ndarray:
    """B [out, r] of a MiSS block M: [r, out], or mini's [r, mini_r], which
    peft repeats across out (miss_block.repeat(1, out / mini_r)): the same
    function as the default form's block of those repeats."""
    want = (M.shape[0], mini or n_out)
    if M.ndim != 2 or M.shape != want:
        raise InteropError(f"{key} has shape {M.shape}; MiSS's {'mini ' if mini else ''}"
                           f"block on this projection is {want}")
    return np.tile(M, (1, n_out // mini)).T if mini else M.T


def _targeted(targets: str | list[str], module: str) -> bool:
    """Whether peft puts an adapter on module for target_modules `targets`
    (peft.tuners.tuners_utils.check_target_module_exists)."""
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return module in targets or any(module.endswith("." + t) for t in targets)


def _agree(cfg: Mapping[str, Any], what: str, params: Mapping[str, str],
           pairs: Mapping[str, tuple[np.ndarray, np.ndarray]], r: int) -> None:
    """Refuses a PEFT config that contradicts its tensors: r not their rank,
    target_modules leaving out a module they adapt or naming an adaptable
    one they hold nothing for (peft would load the first's tensors nowhere
    and give the second a fresh adapter)."""
    rank = next(iter(pairs.values()))[0].shape[0] if pairs else r
    if rank != r:
        raise InteropError(f"{what}: r is {r} but the adapters have rank {rank}; the scale "
                           f"alpha / r needs the rank they were trained at")
    targets = cfg.get("target_modules")
    if targets == "all-linear":   # peft: every Linear but the output layer
        targets = ".*"
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as e:
            raise InteropError(f"{what}: target_modules {targets!r} is no regular expression "
                               f"({e})") from None
    elif not isinstance(targets, list) or not targets or \
            not all(isinstance(t, str) for t in targets):
        raise InteropError(f"{what}: target_modules is {targets!r}; expected the adapted "
                           "modules' names (a list, or a regular expression)")
    for module, name in params.items():
        held = name in pairs
        if held and not _targeted(targets, module):
            raise InteropError(f"{what}: target_modules leaves out {module}, which the folder "
                               "holds an adapter for")
        if not held and isinstance(targets, list) and _targeted(targets, module):
            raise InteropError(f"{what}: target_modules names {module}, which the folder holds "
                               "no adapter for")


def _check_peft_config(cfg: Mapping[str, Any], what: str) -> None:
    """Refuses a PEFT config whose adapters compute something else than W + (alpha/r) B A
    (MISS: W + fold_r(x) M, MiSS's default form)."""
    if cfg.get("peft_type") not in ("LORA", "MISS"):
        raise InteropError(f"{what}: peft_type {cfg.get('peft_type')!r}; rwkvx_c reads LORA "
                           "and MISS")
    if cfg["peft_type"] == "MISS" and cfg.get("init_weights", True) not in _MISS_FORMS:
        raise InteropError(f"{what}: init_weights is {cfg['init_weights']!r}, whose change "
                           "depends on the base weights; rwkvx_c tunes MiSS's default and mini "
                           "forms: merge it with peft (merge_and_unload) and import the merged "
                           "model")
    if cfg["peft_type"] == "MISS" and cfg.get("init_weights") == "mini":
        v = cfg.get("mini_r")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InteropError(f"{what}: mini_r is {v!r}, expected a positive integer")
    for key, ok in (("fan_in_fan_out", False), ("bias", "none"),
                    ("modules_to_save", None), ("rank_pattern", {}), ("alpha_pattern", {}),
                    ("layers_to_transform", None), ("exclude_modules", None)):
        v = cfg.get(key)
        if v and v != ok:
            raise InteropError(f"{what}: {key} is {v!r}; rwkvx_c's LoRA has {ok!r}")
    init = str(cfg.get("init_lora_weights", "")).lower()
    if init.startswith(_RESIDUAL_INITS):   # peft applies these to a residual of the base
        raise InteropError(f"{what}: init_lora_weights is {cfg['init_lora_weights']!r}, whose "
                           "adapters sit on a residual of the base; save it converted to LoRA "
                           "(peft's path_initial_model_for_weight_conversion)")
    for key in ("r",) if cfg["peft_type"] == "MISS" else ("r", "lora_alpha"):
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise InteropError(f"{what}: {key} is {v!r}, expected a positive number")
    if not float(cfg["r"]).is_integer():
        raise InteropError(f"{what}: r is {cfg['r']!r}, expected an integer (the rank)")


def _split_peft_key(key: str, what: str, miss: bool = False, dora: bool = False
                    ) -> tuple[str, str]:
    """'base_model.model.X.lora_A.weight' -> ('X', 'A'); a MISS folder's
    'base_model.model.X.miss_block' -> ('X', 'M'); a DoRA folder's
    'base_model.model.X.lora_magnitude_vector' -> ('X', 'magnitude')."""
    tails = (("M", ".miss_block"),) if miss else \
        (("A", ".lora_A.weight"), ("B", ".lora_B.weight")) + \
        ((("magnitude", ".lora_magnitude_vector"),) if dora else ())
    for part, tail in tails:
        if key.startswith(_PEFT_PREFIX) and key.endswith(tail):
            return key[len(_PEFT_PREFIX):-len(tail)], part
    raise InteropError(f"{what}: {key} is not a " + (
        "MiSS tensor (base_model.model.<module>.miss_block)" if miss else
        "LoRA adapter tensor (base_model.model.<module>.lora_A.weight / lora_B.weight)"))


def _read_rwkv_peft(path: str, base: RxPtModel, alpha: float | None, need_alpha: bool = True
                    ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], float | None, str,
                               dict[str, np.ndarray]]:
    """An RWKV-PEFT file: LoRA's lora_A / lora_B or MiSS's disha [r, out]
    (its "bone" mode) on each adapted Linear, and the parameters it trained
    beside them (its train_parts, "ln" by default), under the base's names.
    The alpha is the file's record or the given one (None: neither, where
    not need_alpha)."""
    sd = load_pth(path)
    params = _module_params(base)
    read = parts_in(base, sd, path)
    parts = dict(read.values())
    states = states_in(base, sd, path)   # RWKV-PEFT's time_state (a state tune beside them)
    if states is not None:
        parts[STATE_KEY] = states
        read.update({n: (STATE_KEY, states) for n in sd if n.endswith(".att.time_state")})
    found: dict[str, dict[str, np.ndarray]] = {}
    kinds = set()
    for key, a in sd.items():
        if key in _RWKV_PEFT_META or key in read:
            continue
        part = "A" if key.endswith(A_SUFFIX) else "B" if key.endswith(B_SUFFIX) else \
            "M" if key.endswith(DISHA_SUFFIX) else None
        mod = key[:key.rindex(".")] if part else key
        if part is None or mod not in params:
            raise InteropError(f"{path}: {key} is neither a parameter of the base nor an "
                               "adapter of a projection rwkvx_c adapts "
                               f"({', '.join(sorted(TARGETS))} in every block)")
        kinds.add("miss" if part == "M" else "lora")
        if part == "M":   # MiSS's block M [r, out] is B^T beside the fixed fold A
            n_in, n_out = base.params[params[mod]].shape
            if a.ndim == 3:
                raise InteropError(f"{path}: {key} is a DiSHA block of RWKV-PEFT's bat mode "
                                   "([in/r, r, r]), whose change depends on the base weights; "
                                   "rwkvx_c tunes its bone mode: merge it with RWKV-PEFT's "
                                   "merge_disha.py and import the merged .pth")
            part, a = "B", _miss_block(a, 0, n_out, key)
            found.setdefault(params[mod], {})["A"] = fold_matrix(a.shape[1], n_in)
        found.setdefault(params[mod], {})[part] = a
    if len(kinds) > 1:
        raise InteropError(f"{path} holds both LoRA (lora_A / lora_B) and MiSS (disha) "
                           "adapters; rwkvx_c tunes one kind at a time")
    kind = kinds.pop() if kinds else "lora"
    if kind == "miss":   # scale 1: alpha is r, whatever the file says
        alpha = float(next(iter(found.values()))["B"].shape[1])
    elif "lora_alpha" in sd:
        recorded = float(np.asarray(sd["lora_alpha"]).reshape(-1)[0])
        if alpha is not None and alpha != recorded:
            raise InteropError(f"{path} records lora_alpha {recorded:g}; --lora-alpha {alpha:g} "
                               "contradicts it")
        alpha = recorded
    if alpha is None and need_alpha:
        raise InteropError(f"{path} does not record its alpha (RWKV-PEFT passes it to "
                           "merge_lora.py): give it with --lora-alpha")
    return _pairs(found, path), alpha, kind, parts


def _with_pissa_init(path: str, pairs: dict[str, tuple[np.ndarray, np.ndarray]], kind: str,
                     alpha: float | None, init: str, base: RxPtModel
                     ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], float]:
    """An RWKV-PEFT PiSSA checkpoint (lora_A, lora_B at scale 1 on a base
    that held its initial adapters subtracted) with those initial adapters
    (init: '{module}.init_lora_A' / '.init_lora_B', its init_pissa.pth) as
    the plain LoRA that computes the same on the original base, as PEFT
    converts PiSSA: A [A; A0], B [B, -B0] at rank 2r and scale 1
    (merge_pissa.py's W - B0 A0 + B A). Returns (pairs, alpha)."""
    if kind != "lora" or alpha is not None:
        raise InteropError(f"{path}: --lora-init goes with an RWKV-PEFT PiSSA checkpoint, "
                           "whose adapters are lora_A / lora_B at scale 1 (no lora_alpha "
                           "record, no --lora-alpha)")
    check_input(init, InteropError, "--lora-init")
    sd = load_pth(init)
    params = _module_params(base)
    names = {ours: mod for mod, ours in params.items()}
    wanted = {names[p] + t for p in pairs for t in (".init_lora_A", ".init_lora_B")}
    if set(sd) != wanted:
        odd = sorted(set(sd) ^ wanted)[0]
        raise InteropError(f"{init}: {odd} " + ("is not an initial adapter of one of "
                           f"{path}'s" if odd in sd else "is missing, the initial adapter of "
                           f"one of {path}'s") + " (RWKV-PEFT's init_pissa.pth holds "
                           "{module}.init_lora_A / .init_lora_B for each)")
    out = {}
    for p, (A, B) in pairs.items():
        A0, B0 = (np.asarray(sd[names[p] + t], dtype=np.float32)
                  for t in (".init_lora_A", ".init_lora_B"))
        if A0.shape != A.shape or B0.shape != B.shape:
            raise InteropError(f"{init}: the initial adapter of {names[p]} has shapes "
                               f"{A0.shape}, {B0.shape}; {path}'s has {A.shape}, {B.shape}")
        out[p] = (np.concatenate([A, A0]), np.concatenate([B, -B0], axis=1))
    r = next(iter(out.values()))[0].shape[0]
    return out, float(r)   # scale 1 at rank 2r


def _pairs(found: Mapping[str, Mapping[str, np.ndarray]], what: str
           ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    out = {}
    for name, parts in found.items():
        if set(parts) != {"A", "B"}:
            raise InteropError(f"{what}: the adapter of {name} lacks lora_"
                               f"{'B' if 'A' in parts else 'A'}")
        out[name] = (np.ascontiguousarray(parts["A"], dtype=np.float32),
                     np.ascontiguousarray(parts["B"], dtype=np.float32))
    return out


def _targets_of(path: str, base: RxPtModel, pairs: Mapping[str, Any]) -> str:
    """The --lora-targets names the adapters cover, every block of each kind:
    rwkvx_c puts an adapter on a projection in every block or in none."""
    names = [t for t, (kind, p) in TARGETS.items()
             if any(n.endswith("." + p) and base.layers[int(n.split(".")[1])] == kind
                    for n in pairs)]
    if set(target_params(base.layers, tuple(names))) != set(pairs):
        missing = sorted(set(target_params(base.layers, tuple(names))) - set(pairs))
        raise InteropError(f"{path} adapts some blocks' projections and not others "
                           f"(none on {missing[0]}); rwkvx_c's LoRA adapts a projection in "
                           "every block")
    return ",".join(names)
