"""Between run folders and files: ``export_model`` writes a model in a
foreign format, ``import_pth`` makes a run folder of a foreign .pth."""
from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

from rwkvx_c._core import RxPtModel
from rwkvx_c.data.tokenizers import WORLD_VOCAB_SIZE, ByteTokenizer, Tokenizer
from rwkvx_c.errors import InteropError, OutputError
from rwkvx_c.interop.gguf import save_gguf
from rwkvx_c.interop.hf import HF_FILES, from_hf, hf_tokenizer, load_hf, save_hf
from rwkvx_c.interop.pth import DTYPES, load_pth, save_pth
from rwkvx_c.interop.rwkv7 import from_rwkv7, from_rwkvx, to_rwkv7, to_rwkvx
from rwkvx_c.run.rundir import RunDir, claim_output, describe_entries

__all__ = ["FORMATS", "export_model", "import_pth", "state_dict"]

FORMATS = ("rwkv7", "rwkvx", "gguf", "hf", "state")


def export_model(model: RxPtModel, fmt: str, out: str, dtype: str = "fp32", *,
                 inputs: Iterable[str] = (), tokenizer: Tokenizer | None = None) -> None:
    """Writes model to the file out in format fmt (rwkv7, rwkvx or gguf; hf:
    the folder out, with tokenizer's files) at dtype (fp32, bf16 or fp16),
    atomically; InteropError when the format cannot hold the model (nothing
    is written then). fmt "state": the model's trained initial WKV states
    alone, as RWKV-PEFT saves them (state_dict). OutputError when out (for
    hf: any file it writes there) is one of `inputs` (the model's run folder
    or file) or a run folder's own file (rwkvx_c.run.rundir.claim_output).

    The model files hold the weights only: a state-tuned model's initial
    states travel in the state file beside them."""
    if dtype not in DTYPES:
        raise InteropError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if fmt not in FORMATS:
        raise InteropError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "hf":   # a folder: each file it writes there
        for name in HF_FILES:
            claim_output(os.path.join(out, name), inputs)
    else:
        claim_output(out, inputs)
    if fmt == "rwkv7":
        save_pth(to_rwkv7(model), out, dtype)
    elif fmt == "rwkvx":
        save_pth(to_rwkvx(model), out, dtype)
    elif fmt == "hf":
        save_hf(model, tokenizer or ByteTokenizer(), out, dtype)
    elif fmt == "state":
        save_pth(state_dict(model), out, "fp32")
    else:
        save_gguf(model, out, dtype)


def state_dict(model: RxPtModel) -> dict[str, np.ndarray]:
    """{'blocks.{i}.att.time_state': float32 [H, N, N]} for each RWKV block i,
    RWKV-PEFT's state file: state[h][v][k] (value row, key column), the
    layout the rwkv package's x070 model takes as state[3*i+1]
    (tests/test_finetune.py runs it). InteropError without states."""
    if model.state is None:
        raise InteropError("the model has no trained initial states (train with --tune state)")
    return {f"blocks.{i}.att.time_state": np.array(s, dtype=np.float32)
            for i, s in enumerate(model.state)}


def import_pth(path: str, out_dir: str) -> str:
    """A run folder out_dir holding the .pth at path -- an x070 state dict,
    or an RWKV-X checkpoint (names under rwkv. / moba.) -- as a checkpoint
    (weights only: `rwkvx-c sample` runs it, `rwkvx-c train --resume`
    starts a new run from it). A folder at path is a Hugging Face rwkv7
    model (rwkvx_c.interop.hf), whose tokenizer comes along. Returns the
    checkpoint path; refuses a folder that already holds a checkpoint."""
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
    tok = None
    if os.path.isdir(path):
        fmt = "hf"
        model = from_hf(*load_hf(path))
        tok = hf_tokenizer(path, model.config["vocab_size"])
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
    return run.save_checkpoint(tensors, model.config, state)
