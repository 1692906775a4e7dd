"""Between run folders and files: ``export_model`` writes a model in a
foreign format, ``import_pth`` makes a run folder of a foreign .pth,
``merge_run`` a plain run folder of a LoRA run."""
from __future__ import annotations

import functools
import os
import zipfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rwkvx_c._core import RxPtModel
from rwkvx_c.data.tokenizers import WORLD_VOCAB_SIZE, ByteTokenizer, Tokenizer, run_tokenizer
from rwkvx_c.data.tokenizers import load as load_tokenizer
from rwkvx_c.errors import CheckpointError, InteropError, OutputError, TokenizerError
from rwkvx_c.interop.adapters import DISHA_SUFFIX
from rwkvx_c.interop.gguf import GGUF_DTYPES, save_gguf
from rwkvx_c.interop.gguf_in import GgufWeights
from rwkvx_c.interop.gguf_lora import save_gguf_lora
from rwkvx_c.interop.hf import (
    HF_FILES,
    PEFT_FILES,
    hf_refusal,
    hf_tokenizer,
    save_hf,
    save_peft,
)
from rwkvx_c.interop.hf_hybrid import export_modules, read_hf_folder, save_hybrid
from rwkvx_c.interop.pth import DTYPES, PthTensors, load_pth, save_pth
from rwkvx_c.interop.rwkv7 import (
    from_rwkv7,
    from_rwkvx,
    linear_prefixes,
    parts_out,
    states_out,
    stream_rwkv7,
    to_rwkv7,
    to_rwkvx,
)
from rwkvx_c.interop.source import STATE_KEY, read_run, read_source
from rwkvx_c.model.config import ModelConfig
from rwkvx_c.model.lora import (
    A_SUFFIX,
    ADAPTERS,
    B_SUFFIX,
    M_SUFFIX,
    plain_alpha,
    run_alpha,
    without_adapters,
)
from rwkvx_c.model.weights import load_params
from rwkvx_c.run.rundir import RunDir, checkpoint_path, claim_output, describe_entries
from rwkvx_c.util.words import listed

__all__ = ["FORMATS", "EXPORTS", "ExportFormat", "Adapters", "export_model", "formats_holding",
           "import_pth",
           "import_adapters", "state_dict", "lora_dict", "merge_run"]

# ({param: (A, B)}, alpha, kind, {param: M}, parts): a LoRA run's adapters,
# their kind's alpha and kind (rwkvx_c.model.lora.ADAPTERS), DoRA's
# magnitudes, and the parameters it trained beside them (--train-parts)
Adapters = tuple[Mapping[str, tuple[np.ndarray, np.ndarray]], float, str,
                 Mapping[str, np.ndarray], Sequence[str]]
# a format's writer: (model, out, dtype, tokenizer, adapters); adapters only
# for a format that holds them (export_model refuses a model without them)
Writer = Callable[[RxPtModel, str, str, Tokenizer, Adapters], None]


@dataclass(frozen=True)
class ExportFormat:
    """One export format: its writer and what it can hold."""
    name: str
    write: Writer
    holds: str        # "model" (the weights), "state" (the initial WKV states), "adapters" (LoRA)
    says: str         # what it is and who reads it (the export command's help)
    folder: tuple[str, ...] = ()   # the files it writes into the folder out; (): the file out
    dtypes: tuple[str, ...] = DTYPES   # the tensor types it writes


def _hf(model: RxPtModel, out: str, dtype: str, tok: Tokenizer, _: Adapters,
        chat_template: str | None = None) -> None:
    # rwkv7-hf's layout when it holds the model, else rwkvx_c's own modeling code
    save = save_hf if hf_refusal(model.config) is None else save_hybrid
    save(model, tok, out, dtype, chat_template)


# every export format, by name: the one table export_model, the command's
# choices and help, and the tests read
EXPORTS = {f.name: f for f in (
    ExportFormat("rwkv7", lambda m, out, dtype, _t, _a: save_pth(to_rwkv7(m), out, dtype),
                 "model", "an RWKV-LM x070 .pth (the rwkv package)"),
    ExportFormat("rwkvx", lambda m, out, dtype, _t, _a: save_pth(to_rwkvx(m), out, dtype),
                 "model", "an RWKV-X .pth (the rwkv-x package)"),
    ExportFormat("gguf", lambda m, out, dtype, _t, _a: save_gguf(m, out, dtype), "model",
                 "a GGUF file (llama.cpp)", dtypes=GGUF_DTYPES),
    ExportFormat("hf", _hf, "model", "a Hugging Face folder (flash-linear-attention's rwkv7 "
                 "layout, rwkv7-hf, transformers)", folder=HF_FILES),
    ExportFormat("state", lambda m, out, _d, _t, _a: save_pth(state_dict(m), out, "fp32"),
                 "state", "a state-tuned run's initial states (RWKV-PEFT's time_state file)"),
    ExportFormat("lora", lambda m, out, dtype, _t, a: save_pth(lora_dict(m, *a[:3], a[4]), out,
                                                                dtype),
                 "adapters", "a LoRA run's adapters and the parts it trained beside them "
                 "(RWKV-PEFT's file: lora_A / lora_B, MiSS's disha)"),
    ExportFormat("peft", lambda m, out, dtype, _t, a: save_peft(m, a[0], a[1], out, dtype,
                                                                 export_modules(m), a[2], a[3]),
                 "adapters", "a Hugging Face PEFT adapter folder for the hf export",
                 folder=PEFT_FILES),
    ExportFormat("gguf-lora", lambda m, out, dtype, _t, a: save_gguf_lora(
                     m, a[0], plain_alpha(a[2], _rank(a[0]), a[1]), out, dtype),
                 "adapters", "a LoRA run's adapters as llama.cpp's adapter GGUF (--lora) for "
                 "the gguf export"),
)}
FORMATS = tuple(EXPORTS)


def export_model(model: RxPtModel, fmt: str, out: str, dtype: str = "fp32", *,
                 inputs: Iterable[str] = (), tokenizer: Tokenizer | None = None,
                 adapters: Adapters | None = None, chat_template: str | None = None) -> None:
    """Writes model to out in format fmt (EXPORTS: rwkv7, rwkvx or gguf; hf:
    the folder out, with tokenizer's files: rwkv7-hf's layout for a model it
    holds, rwkvx_c's own modeling code for any other) at dtype (fp32, bf16 or fp16;
    gguf also q8_0, q4_0, q4_k),
    atomically; InteropError when the format cannot hold the model (nothing
    is written then). fmt "state": the model's trained initial WKV states
    alone, as RWKV-PEFT saves them (state_dict); "lora": a LoRA run's
    adapters (the model's base is not written) under RWKV-PEFT's names at
    dtype (lora_dict); "peft": the same as a Hugging Face PEFT adapter folder
    for the hf export's module names (save_peft); "gguf-lora": the same as
    llama.cpp's adapter GGUF (save_gguf_lora). chat_template: the Jinja
    template an hf export's tokenizer_config.json carries (the run's), so
    apply_chat_template renders what the run trained on. OutputError when out (for
    a folder: any file it writes there) is one of `inputs` (the model's run folder
    or file) or a run folder's own file (rwkvx_c.run.rundir.claim_output).

    The model files hold the weights only: a state-tuned model's initial
    states travel in the state file beside them."""
    if fmt not in EXPORTS:
        raise InteropError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    f = EXPORTS[fmt]
    if dtype not in f.dtypes:
        raise InteropError(f"--format {fmt} writes no dtype {dtype!r}; choose one of "
                           f"{', '.join(f.dtypes)}")
    for name in f.folder or (None,):   # a folder: each file it writes there
        claim_output(out if name is None else os.path.join(out, name), inputs)
    if f.holds == "adapters" and adapters is None:
        raise InteropError("the model has no LoRA adapters (train with --tune lora)")
    if f.holds == "adapters" and fmt != "peft" and adapters and ADAPTERS[adapters[2]].dora:
        raise InteropError(f"--format {fmt} cannot hold DoRA's magnitude vectors; --format "
                           f"peft holds DoRA adapters (use_dora), --format "
                           f"{formats_holding('model')} the merged model")
    if f.holds == "adapters" and fmt != "lora" and adapters and adapters[4]:
        raise InteropError(f"--format {fmt} holds adapters alone, and the run also trained "
                           f"{adapters[4][0]} and {len(adapters[4]) - 1} more (--train-parts); "
                           "--format lora holds both (RWKV-PEFT's file), --format "
                           f"{formats_holding('model')} the merged model")
    # the template is tokenizer metadata only an HF folder holds
    write = functools.partial(_hf, chat_template=chat_template) if f.write is _hf else f.write
    write(model, out, dtype, tokenizer or ByteTokenizer(), adapters or ({}, 0.0, "lora", {}, ()))


def formats_holding(holds: str) -> str:
    """'rwkv7, rwkvx, gguf or hf': the formats that hold `holds` (EXPORTS)."""
    return listed(n for n, f in EXPORTS.items() if f.holds == holds)


def state_dict(model: RxPtModel) -> dict[str, np.ndarray]:
    """{'blocks.{i}.att.time_state': float32 [H, N, N]} for each RWKV block i,
    RWKV-PEFT's state file: state[h][v][k] (value row, key column), the
    layout the rwkv package's x070 model takes as state[3*i+1]
    (tests/test_finetune.py runs it). InteropError without states."""
    if model.state is None:
        raise InteropError("the model has no trained initial states (train with --tune state)")
    return states_out(model, prefixed=False)


def _rank(adapters: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> int:
    """The rank r of adapters (A [r, in] of any one)."""
    return int(next(iter(adapters.values()))[0].shape[0])


def lora_dict(model: RxPtModel, adapters: Mapping[str, tuple[np.ndarray, np.ndarray]],
              alpha: float, kind: str = "lora", parts: Sequence[str] = ()
              ) -> dict[str, np.ndarray]:
    """RWKV-PEFT's adapter file under the export's names (x070's
    "blocks.{i}.att.receptance", RWKV-X's "moba.{j}.att.key", ...):
    '{module}.lora_A' [r, in] and '{module}.lora_B' [out, r] for each
    adapted Linear, with one-element 'lora_alpha' and 'lora_r' recording the
    scale alpha / r (RWKV-PEFT's merge_lora.py takes alpha as an argument,
    reads r from the shapes, and passes over keys holding "lora" that are
    not adapters); MiSS as RWKV-PEFT's DiSHA of "bone" mode, its block
    '{module}.disha' [r, out] alone (scale 1, r from the shape:
    merge_disha.py); and the parameters `parts` (our names; STATE_KEY: the
    initial states, as '{block}.att.time_state') that the run trained
    beside them, as RWKV-PEFT saves its train_parts. Adapters of
    another kind are written as the plain LoRA that computes the same
    (rwkvx_c.model.lora.plain_alpha: rsLoRA's alpha * sqrt(r))."""
    names = linear_prefixes(model)
    out = parts_out(model, [p for p in parts if p != STATE_KEY])
    if STATE_KEY in parts:   # RWKV-PEFT's time_state beside its adapters
        out.update(states_out(model))
    if ADAPTERS[kind].fold:
        for ours, (_, B) in adapters.items():
            out[names[ours] + DISHA_SUFFIX] = np.array(B.T, dtype=np.float32)
        return out
    for ours, (A, B) in adapters.items():
        out[names[ours] + A_SUFFIX] = np.array(A, dtype=np.float32)
        out[names[ours] + B_SUFFIX] = np.array(B, dtype=np.float32)
    r = _rank(adapters)
    out["lora_alpha"] = np.array([plain_alpha(kind, r, alpha)], dtype=np.float32)
    out["lora_r"] = np.array([r], dtype=np.float32)
    return out


def merge_run(path: str, out_dir: str, base: str | None = None) -> str:
    """A plain run folder out_dir holding the LoRA run at path (a run folder
    or checkpoint) with its adapters folded into the weights (weights only,
    as `rwkvx-c import` makes: `sample` runs it, `train --init-from` or
    `--resume` starts a new run from it) and its tokenizer. Never writes
    over its input; InteropError for a run without adapters. base: where
    the run's base lies now, when it moved (--base)."""
    src = checkpoint_path(path)
    try:
        tensors, config, state = read_run(src, base, rehash=True)   # merged: every weight read
        tok = run_tokenizer(os.path.dirname(os.path.abspath(src)), state.get("tokenizer"))
    except (CheckpointError, TokenizerError) as e:
        raise InteropError(str(e)) from None
    if not any(k.endswith(A_SUFFIX) for k in tensors):
        raise InteropError(f"{path} holds no LoRA adapters (a run trained with --tune lora "
                           "has them)")
    run = RunDir(out_dir)
    if run.has_checkpoint():
        raise InteropError(f"{out_dir} already holds a checkpoint; choose another --out")
    foreign = run.foreign_entries()
    if foreign and not run.holds_run():
        raise OutputError(f"{out_dir} already holds {describe_entries(foreign)} and no run; "
                          "choose a new folder for --out")
    claim_output(run.checkpoint, [path, src, os.path.dirname(os.path.abspath(src))])
    try:
        merged = without_adapters(tensors, run_alpha(state, src))
    except CheckpointError as e:
        raise InteropError(str(e)) from None
    merged = {k: v for k, v in merged.items() if not k.startswith("optim.")}
    run.create()
    tok.save(out_dir)
    meta = {"imported_from": os.path.abspath(path), "format": "lora-merged", "step": 0,
            "tokenizer": tok.identity()}
    return run.save_checkpoint(merged, ModelConfig.stored(config), meta)


def _new_run(path: str, out_dir: str) -> RunDir:
    """The run folder an import makes of path: refused when it holds a
    checkpoint or other files, or is the input itself."""
    run = RunDir(out_dir)
    if run.has_checkpoint():
        raise InteropError(f"{out_dir} already holds a checkpoint; choose another --out")
    if os.path.isdir(path) and os.path.realpath(path) == os.path.realpath(out_dir):
        raise InteropError(f"--out {out_dir} is the folder being imported; choose another")
    foreign = run.foreign_entries()
    if foreign and not run.holds_run():
        raise OutputError(f"{out_dir} already holds {describe_entries(foreign)} and no run; "
                          "choose a new folder for --out")
    claim_output(run.checkpoint, [path])
    return run


def import_adapters(path: str, base: str, out_dir: str, lora_alpha: float | None = None,
                    lora_init: str | None = None) -> str:
    """A LoRA run folder out_dir of the adapters at path (a PEFT folder or an
    RWKV-PEFT LoRA .pth, rwkvx_c.interop.adapters) on the model at base (a
    run folder, checkpoint, .pth or Hugging Face folder): base weights,
    adapters apart, and the adapters' r, alpha and targets in its state, so
    `rwkvx-c train --resume --out DIR` trains them on. Returns the
    checkpoint path. lora_init: an RWKV-PEFT PiSSA checkpoint's initial
    adapters (its init_pissa.pth)."""
    run = _new_run(path, out_dir)
    claim_output(run.checkpoint, [base] + ([lora_init] if lora_init else []))
    src = read_source(path, base, lora_alpha, lora_init=lora_init)
    ads = src.adapters
    assert ads is not None   # read_source refuses a path without adapters
    tensors = {**src.weights, **ads.parts}   # the parts it trained replace the base's
    for name, (A, B) in ads.pairs.items():
        tensors[name + A_SUFFIX], tensors[name + B_SUFFIX] = A, B
    for name, M in ads.magnitudes.items():
        tensors[name + M_SUFFIX] = M
    if src.state0 is not None and STATE_KEY not in ads.parts:   # the file's states win
        tensors[STATE_KEY] = src.state0
    state: dict[str, Any] = {
        "imported_from": os.path.abspath(path), "imported_base": os.path.abspath(base),
        "format": "peft" if os.path.isdir(path) else "rwkv-peft", "step": 0,
        "lora": ads.record()}
    if src.tokenizer is not None:
        tok = load_tokenizer(src.tokenizer)
        run.create()
        tok.save(out_dir)
        state["tokenizer"] = tok.identity()
    return run.save_checkpoint(tensors, src.config, state)


def _open_x070(path: str) -> PthTensors | None:
    """The .pth at path, open, when it is an x070 state dict (a zip with
    no RWKV-X names); else None (read whole by load_pth)."""
    if not zipfile.is_zipfile(path):
        return None
    pth = PthTensors(path)
    if any(k.startswith("rwkv.") for k in pth.names):
        pth.close()
        return None
    return pth


def import_pth(path: str, out_dir: str) -> str:
    """A run folder out_dir holding the .pth at path -- an x070 state dict,
    or an RWKV-X checkpoint (names under rwkv. / moba.) -- as a checkpoint
    (weights only: `rwkvx-c sample` runs it, `rwkvx-c train --resume`
    starts a new run from it). A folder at path is a Hugging Face rwkv7
    model (rwkvx_c.interop.hf), whose tokenizer comes along; so does a
    .gguf's (rwkvx_c.interop.gguf_in: float32, gguf's dequantized values). Returns the
    checkpoint path; refuses a folder that already holds a checkpoint."""
    run = _new_run(path, out_dir)
    tok = None
    if os.path.isdir(path):
        fmt = "hf"
        model = read_hf_folder(path)
        tok = hf_tokenizer(path, model.config["vocab_size"])
    elif path.endswith(".gguf"):   # gguf's dequantized values, exactly
        fmt = "gguf"
        g = GgufWeights(path)
        model = RxPtModel(g.config, init=False, dense=True)
        for n in model.param_names:
            model.params[n][...] = g[n]
        tok = load_tokenizer(g.tokenizer)
    elif (pth := _open_x070(path)) is not None:
        # streamed tensor by tensor, as --init-from reads it: the model's
        # float32 arena and one tensor at a time, never the file whole
        fmt = "rwkv7"
        weights = stream_rwkv7(pth)
        model = RxPtModel(weights.config, init=False, dense=True)
        load_params(model, weights, f"the state dict {path}", InteropError)
    else:
        sd = load_pth(path)
        fmt = "rwkvx" if any(k.startswith("rwkv.") for k in sd) else "rwkv7"
        model = from_rwkvx(sd) if fmt == "rwkvx" else from_rwkv7(sd)
    tensors = {n: model.params[n] for n in model.param_names}
    state = {"imported_from": os.path.abspath(path), "format": fmt, "step": 0}
    if tok is not None:
        run.create()
        tok.save(out_dir)
        state["tokenizer"] = tok.identity()
    elif model.config["vocab_size"] == WORLD_VOCAB_SIZE:
        # official weights of this size use the World vocabulary: sample and
        # train --resume then tokenise with it (rwkvx_c.data.tokenizers.run_tokenizer)
        state["tokenizer"] = {"name": "world", "sha256": None}
    return run.save_checkpoint(tensors, ModelConfig.stored(model.config), state)
