"""GGUF export for llama.cpp's RWKV-7 architecture ("rwkv7"), written with the
`gguf` package (pip install "rwkvx_c[gguf]").

Names, layouts and metadata follow what llama.cpp's own converter writes for
an RWKV-7 model and what its rwkv7 loader checks (docs/interop.md has the
table). llama.cpp's rwkv7 holds pure RWKV-7 with ln0, one LoRA rank per kind
and head size 64 in its fast kernels; a model outside that is refused with
one line. The tokenizer goes inside: the 256 byte tokens for a byte-level
model, the RWKV World vocabulary for a 65536-token model (read from the
installed `rwkv` package's vocabulary file; nothing is downloaded).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Container
from typing import Any

import numpy as np

from rwkvx_c._core import RxPtModel, base_dtype_block, base_quantize
from rwkvx_c.data.tokenizers import WORLD_VOCAB_SIZE as WORLD_VOCAB
from rwkvx_c.data.tokenizers import parse_vocab_file, world_vocab_path
from rwkvx_c.errors import InteropError, TokenizerError
from rwkvx_c.interop.pth import DTYPES
from rwkvx_c.interop.rwkv7 import HF_HOLDS_IT
from rwkvx_c.model.config import ModelConfig, export_refusal
from rwkvx_c.util.atomic import replace_with

__all__ = ["GGUF_DTYPES", "QUANTS", "STAND_INS", "need_gguf", "gguf_refusal", "gguf_pairs",
           "gguf_arrays", "gguf_vocab", "gguf_writer", "keeps_f32", "save_gguf"]

ARCH = "rwkv7"
CONTEXT_LENGTH = 1048576   # what the converter writes: RWKV has no context limit
WORLD_EOT = 261   # "\n\n" in the World vocabulary: end of a chat turn
# the lerps, stacked in the order llama.cpp's graph reads them
_LERPS = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
# the GGUF block types written and read as they are (a frozen base's dtypes)
QUANTS = ("q8_0", "q4_0", "q4_k")
# the tensor types of --format gguf: the model formats' and the block types
GGUF_DTYPES = DTYPES + QUANTS


def need_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise InteropError('GGUF export needs the gguf package: pip install "rwkvx_c[gguf]"') \
            from None
    return gguf


def gguf_refusal(config: dict[str, int]) -> str | None:
    """Why llama.cpp's rwkv7 cannot hold this config, or None; each reason
    names the train flags that make a model it holds, and the format that
    holds this one."""
    c = config
    why = export_refusal(c, "gguf", "llama.cpp's rwkv7")
    if why is None and c["vocab_size"] not in (256, WORLD_VOCAB):
        why = (f"no tokenizer to put inside for vocab {c['vocab_size']} (256 bytes or the "
               f"{WORLD_VOCAB}-token World vocabulary: train with --tokenizer byte or world "
               "for gguf)")
    return None if why is None else f"{why}; {HF_HOLDS_IT}"


def _token_text(b: bytes) -> str:
    """A token's bytes as the converter writes them: the bytes' Python repr
    without the b'' quotes (llama.cpp's rwkv tokenizer unescapes it)."""
    return repr(b)[2:-1]


def _world_tokens() -> list[bytes]:
    """The World vocabulary's tokens 1..65529, read as the World tokenizer
    reads them (rwkvx_c.data.tokenizers)."""
    try:
        path = world_vocab_path()
        entries = sorted(parse_vocab_file(path), key=lambda e: e[1])
    except TokenizerError as e:
        raise InteropError(f"a World-vocabulary model needs its vocabulary: {e}") from None
    if [i for _, i in entries] != list(range(1, len(entries) + 1)):
        raise InteropError(f"{path}: the World vocabulary's ids are not 1..{len(entries)}")
    return [t for t, _ in entries]


def gguf_vocab(vocab_size: int) -> tuple[list[str], list[int]]:
    """(token texts, token types) for tokenizer.ggml.tokens / token_type."""
    gguf = need_gguf()
    normal, control, unused = (int(gguf.TokenType.NORMAL), int(gguf.TokenType.CONTROL),
                               int(gguf.TokenType.UNUSED))
    if vocab_size == 256:
        return [_token_text(bytes([i])) for i in range(256)], [normal] * 256
    words = _world_tokens()
    texts = ["<s>"] + [_token_text(t) for t in words]
    types = [control] + [normal] * len(words)
    pad = vocab_size - len(texts)
    return texts + [f"[PAD{i}]" for i in range(pad)], types + [unused] * pad


def gguf_pairs(config: dict[str, int]) -> list[tuple[str, str, str]]:
    """(our parameter, GGUF tensor, how) of every parameter of a model
    llama.cpp's rwkv7 holds: "same" (the numpy array as it is), "t" (our
    [in, out] matrix is the GGUF's numpy [out, in], llama.cpp's [in, out]
    ggml dims, transposed), "lerpJ" (row J of the fused lerps)."""
    pairs = [("emb", "token_embd.weight", "same"), ("ln0_w", "token_embd_norm.weight", "same"),
             ("ln0_b", "token_embd_norm.bias", "same")]
    for i in range(config["n_rwkv_layer"]):
        b, tm, pre = f"blocks.{i}.", f"blocks.{i}.tm.", f"blk.{i}."
        pairs += [(b + "ln1_w", pre + "attn_norm.weight", "same"),
                  (b + "ln1_b", pre + "attn_norm.bias", "same"),
                  (b + "ln2_w", pre + "attn_norm_2.weight", "same"),
                  (b + "ln2_b", pre + "attn_norm_2.bias", "same")]
        pairs += [(tm + x, pre + "time_mix_lerp_fused.weight", f"lerp{j}")
                  for j, x in enumerate(_LERPS)]
        for kind in ("w", "a", "v"):
            if kind == "v" and i == 0:   # layer 0 has no value residual
                continue
            pairs += [(tm + kind + "0", pre + f"time_mix_{kind}0.weight", "same"),
                      (tm + kind + "1", pre + f"time_mix_{kind}1.weight", "t"),
                      (tm + kind + "2", pre + f"time_mix_{kind}2.weight", "t")]
        pairs += [(tm + "g1", pre + "time_mix_g1.weight", "t"),
                  (tm + "g2", pre + "time_mix_g2.weight", "t")]
        pairs += [(tm + x, pre + f"time_mix_{x}.weight", "same") for x in ("k_k", "k_a", "r_k")]
        pairs += [(tm + x + "_w", pre + f"time_mix_{x}.weight", "t")
                  for x in ("receptance", "key", "value", "output")]
        pairs += [(tm + "ln_x_w", pre + "time_mix_ln.weight", "same"),
                  (tm + "ln_x_b", pre + "time_mix_ln.bias", "same"),
                  (b + "cm.ffn_x_k", pre + "channel_mix_lerp_k.weight", "same"),
                  (b + "cm.ffn_key_w", pre + "channel_mix_key.weight", "t"),
                  (b + "cm.ffn_value_w", pre + "channel_mix_value.weight", "t")]
    return pairs + [("ln_out_w", "output_norm.weight", "same"),
                    ("ln_out_b", "output_norm.bias", "same"), ("head", "output.weight", "t")]


# layer 0's value-residual stand-ins: the loader wants a0/a1/a2-shaped
# tensors there, which the graph skips (the converter writes a copy of a*)
STAND_INS = {f"blk.0.time_mix_v{j}.weight": f"blk.0.time_mix_a{j}.weight" for j in range(3)}


Made = tuple[tuple[int, ...], Callable[[], np.ndarray]]


def gguf_arrays(model: RxPtModel, skip: Container[str] = ()) -> dict[str, Made]:
    """GGUF tensor name -> (its shape as given to the writer, a function
    making its float32 array: numpy order, a [out, in] matrix for
    llama.cpp's [in, out] ggml dims, a frozen base's matrices decoded), in
    the file's order; each array is made only when its function is called,
    so an export holds one at a time. skip: our parameters left out."""
    why = gguf_refusal(model.config)
    if why:
        raise InteropError(why)
    base = set(model.base_names)
    p = model.params

    def one(ours: str, transposed: bool) -> Made:
        def make() -> np.ndarray:
            a = model.base_tensor(ours) if ours in base else p[ours]
            return np.ascontiguousarray(a.T if transposed else a, dtype=np.float32)
        shape = p[ours].shape
        return (shape[::-1] if transposed else shape), make

    def stacked(rows: list[str]) -> Made:
        return (6, 1, 1, p[rows[0]].size), lambda: np.stack(
            [np.asarray(p[r], dtype=np.float32) for r in rows]).reshape(6, 1, 1, -1)

    out: dict[str, Made] = {}
    lerps: dict[str, list[str]] = {}
    for ours, theirs, how in gguf_pairs(model.config):
        if ours in skip:
            continue
        if how.startswith("lerp"):
            lerps.setdefault(theirs, []).append(ours)
        else:
            out[theirs] = one(ours, how == "t")
    for name, rows in lerps.items():
        out[name] = stacked(rows)
    out.update({v: out[a] for v, a in STAND_INS.items() if a in out})
    return out


def _held_blocks(model: RxPtModel, dtype: str) -> dict[str, np.ndarray]:
    """GGUF tensor name -> the stored blocks (uint8 rows of W^T) of each
    matrix a frozen base of dtype holds, when the model applies no
    adapters over it: written as they are, never quantized twice."""
    if model.base_dtype != dtype or dtype not in QUANTS or model.lora is not None:
        return {}
    base = set(model.base_names)
    out = {theirs: model.base_data(ours) for ours, theirs, how in gguf_pairs(model.config)
           if ours in base and (how == "t" or ours == "emb")}
    out.update({v: out[a] for v, a in STAND_INS.items() if a in out})
    return out


def _same(a: np.ndarray) -> np.ndarray:
    return a


def keeps_f32(name: str, a: np.ndarray) -> bool:
    """The tensors the converter keeps in F32 at any file type: vectors,
    norms, biases, the decay LoRA and the fused lerps."""
    return (a.ndim == 1 or "norm" in name or name.endswith(".bias")
            or "time_mix_w1" in name or "time_mix_w2" in name or "lerp_fused" in name)


def gguf_writer(path: str, config: dict[str, int], dtype: str) -> Any:
    """A gguf.GGUFWriter at path holding the metadata and tokenizer of an
    rwkv7 model of config whose large matrices are dtype (GGUF_DTYPES), as
    the converter writes them; its tensors are the caller's."""
    gguf = need_gguf()
    c = config
    texts, types = gguf_vocab(c["vocab_size"])
    F = gguf.LlamaFileType
    ftype = {"fp32": F.ALL_F32, "bf16": F.MOSTLY_BF16, "fp16": F.MOSTLY_F16,
             "q8_0": F.MOSTLY_Q8_0, "q4_0": F.MOSTLY_Q4_0,
             "q4_k": F.MOSTLY_Q4_K_S}[dtype]   # Q4_K alone: llama.cpp's "small" mix
    w = gguf.GGUFWriter(path, ARCH)
    w.add_name("rwkvx_c model")
    w.add_file_type(int(ftype))
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(c["n_embd"])
    w.add_block_count(c["n_rwkv_layer"])
    w.add_feed_forward_length(c["ffn_dim"])
    w.add_head_count(0)   # the converter's value: required key, unused by rwkv7
    w.add_layer_norm_eps(ModelConfig.resolve(c)["ln_eps"])
    w.add_wkv_head_size(c["head_size"])
    w.add_decay_lora_rank(c["Dw"])
    w.add_iclr_lora_rank(c["Da"])
    w.add_value_residual_mix_lora_rank(c["Dv"])
    w.add_gate_lora_rank(c["Dg"])
    w.add_tokenizer_model("rwkv")
    w.add_token_list(texts)
    w.add_token_types(types)
    if c["vocab_size"] == WORLD_VOCAB:   # the converter's World special tokens
        w.add_bos_token_id(0)
        w.add_eos_token_id(0)
        w.add_eot_token_id(WORLD_EOT)
    return w


def save_gguf(model: RxPtModel, path: str, dtype: str = "fp32") -> None:
    """Writes model as a llama.cpp rwkv7 GGUF at path, atomically; dtype
    (GGUF_DTYPES: fp32, bf16, fp16, q8_0, q4_0, q4_k) applies to the large
    matrices, as the converter does (a matrix whose rows are not whole
    blocks falls back to F16, as there). A frozen base of dtype q8_0 / q4_0
    / q4_k under no adapters gives its blocks as they are; any other matrix
    is quantized from float32 with gguf.quants.quantize (Q4_K, which it
    has no encoder for: the base's own, llama.cpp's quantize_row_q4_K_ref)."""
    gguf = need_gguf()
    if dtype not in GGUF_DTYPES:
        raise InteropError(f"unknown dtype {dtype!r}; choose one of {', '.join(GGUF_DTYPES)}")
    c = model.config
    T = gguf.GGMLQuantizationType
    held = _held_blocks(model, dtype)
    arrays = gguf_arrays(model, skip={ours for ours, theirs, _ in gguf_pairs(c)
                                      if theirs in held})
    qtype = {"fp32": T.F32, "bf16": T.BF16, "fp16": T.F16, "q8_0": T.Q8_0,
             "q4_0": T.Q4_0, "q4_k": T.Q4_K}[dtype]

    def encoder(name: str, shape: tuple[int, ...]) -> tuple[Callable[[np.ndarray], np.ndarray],
                                                             Any]:
        """(the function giving the bytes written of a tensor's float32
        array, their ggml type: None for F32) by its name and shape"""
        if qtype == T.F32 or keeps_f32(name, np.broadcast_to(np.uint8(0), shape)):
            return _same, None
        block = base_dtype_block(dtype)[0] if qtype == T.Q4_K else gguf.GGML_QUANT_SIZES[qtype][0]
        if shape[-1] % block or (qtype == T.Q4_K and len(shape) != 2):
            return (lambda a: gguf.quants.quantize(a, T.F16)), T.F16   # the converter's F16
        if qtype == T.Q4_K:   # gguf has no Q4_K encoder: the base's, llama.cpp's bytes
            return (lambda a: base_quantize(dtype, a)), qtype
        return (lambda a: gguf.quants.quantize(a, qtype)), qtype

    def write(tmp: str) -> None:
        # every tensor's info first (its bytes' shape from one encoded row),
        # then the tensors one at a time: the file is never held whole
        w = gguf_writer(tmp, c, dtype)
        plan: list[tuple[Callable[[], np.ndarray], Callable[[np.ndarray], np.ndarray]]] = []
        for name, blocks in held.items():
            w.add_tensor_info(name, blocks.shape, blocks.dtype, blocks.nbytes, raw_dtype=qtype)
            plan.append((functools.partial(np.asarray, blocks), _same))
        for name, (shape, make) in arrays.items():
            enc, raw = encoder(name, shape)
            row = enc(np.zeros((1,) * (len(shape) - 1) + shape[-1:], np.float32))
            nbytes = int(np.prod(shape[:-1])) * row.nbytes
            w.add_tensor_info(name, shape[:-1] + row.shape[-1:], row.dtype, nbytes,
                              raw_dtype=raw)
            plan.append((make, enc))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for make, enc in plan:
            w.write_tensor_data(enc(make()))
        w.close()

    replace_with(path, write)
