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

from typing import Any

import numpy as np

from rwkvx_c._core import RxPtModel
from rwkvx_c.data.tokenizers import WORLD_VOCAB_SIZE as WORLD_VOCAB
from rwkvx_c.data.tokenizers import parse_vocab_file, world_vocab_path
from rwkvx_c.errors import InteropError, TokenizerError
from rwkvx_c.interop.pth import DTYPES
from rwkvx_c.interop.rwkv7 import HF_HOLDS_IT
from rwkvx_c.model.config import ModelConfig, export_refusal
from rwkvx_c.util.atomic import replace_with

__all__ = ["gguf_refusal", "gguf_tensors", "gguf_vocab", "save_gguf"]

ARCH = "rwkv7"
CONTEXT_LENGTH = 1048576   # what the converter writes: RWKV has no context limit
WORLD_EOT = 261   # "\n\n" in the World vocabulary: end of a chat turn
# the lerps, stacked in the order llama.cpp's graph reads them
_LERPS = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")


def _need_gguf() -> Any:
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
    gguf = _need_gguf()
    normal, control, unused = (int(gguf.TokenType.NORMAL), int(gguf.TokenType.CONTROL),
                               int(gguf.TokenType.UNUSED))
    if vocab_size == 256:
        return [_token_text(bytes([i])) for i in range(256)], [normal] * 256
    words = _world_tokens()
    texts = ["<s>"] + [_token_text(t) for t in words]
    types = [control] + [normal] * len(words)
    pad = vocab_size - len(texts)
    return texts + [f"[PAD{i}]" for i in range(pad)], types + [unused] * pad


def gguf_tensors(model: RxPtModel) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 array in the shape given to the writer
    (numpy order: a [out, in] matrix for llama.cpp's [in, out] ggml dims)."""
    why = gguf_refusal(model.config)
    if why:
        raise InteropError(why)
    p = {k: np.asarray(v, dtype=np.float32) for k, v in model.params.items()}

    def t(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.T)

    out = {"token_embd.weight": p["emb"].copy(), "token_embd_norm.weight": p["ln0_w"].copy(),
           "token_embd_norm.bias": p["ln0_b"].copy()}
    for i in range(model.config["n_rwkv_layer"]):
        b, tm, pre = f"blocks.{i}.", f"blocks.{i}.tm.", f"blk.{i}."
        v = "v" if i > 0 else "a"   # layer 0 has no value residual: the loader wants
        #                             a0/a1/a2-shaped stand-ins, which the graph skips
        out.update({
            pre + "attn_norm.weight": p[b + "ln1_w"], pre + "attn_norm.bias": p[b + "ln1_b"],
            pre + "attn_norm_2.weight": p[b + "ln2_w"], pre + "attn_norm_2.bias": p[b + "ln2_b"],
            pre + "time_mix_lerp_fused.weight":
                np.stack([p[tm + x] for x in _LERPS]).reshape(6, 1, 1, -1),
            pre + "time_mix_w0.weight": p[tm + "w0"], pre + "time_mix_w1.weight": t(p[tm + "w1"]),
            pre + "time_mix_w2.weight": t(p[tm + "w2"]),
            pre + "time_mix_a0.weight": p[tm + "a0"], pre + "time_mix_a1.weight": t(p[tm + "a1"]),
            pre + "time_mix_a2.weight": t(p[tm + "a2"]),
            pre + "time_mix_v0.weight": p[tm + v + "0"],
            pre + "time_mix_v1.weight": t(p[tm + v + "1"]),
            pre + "time_mix_v2.weight": t(p[tm + v + "2"]),
            pre + "time_mix_g1.weight": t(p[tm + "g1"]),
            pre + "time_mix_g2.weight": t(p[tm + "g2"]),
            pre + "time_mix_k_k.weight": p[tm + "k_k"], pre + "time_mix_k_a.weight": p[tm + "k_a"],
            pre + "time_mix_r_k.weight": p[tm + "r_k"],
            pre + "time_mix_receptance.weight": t(p[tm + "receptance_w"]),
            pre + "time_mix_key.weight": t(p[tm + "key_w"]),
            pre + "time_mix_value.weight": t(p[tm + "value_w"]),
            pre + "time_mix_output.weight": t(p[tm + "output_w"]),
            pre + "time_mix_ln.weight": p[tm + "ln_x_w"],
            pre + "time_mix_ln.bias": p[tm + "ln_x_b"],
            pre + "channel_mix_lerp_k.weight": p[b + "cm.ffn_x_k"],
            pre + "channel_mix_key.weight": t(p[b + "cm.ffn_key_w"]),
            pre + "channel_mix_value.weight": t(p[b + "cm.ffn_value_w"]),
        })
    out.update({"output_norm.weight": p["ln_out_w"], "output_norm.bias": p["ln_out_b"],
                "output.weight": t(p["head"])})
    return {k: np.array(v, dtype=np.float32) for k, v in out.items()}


def _keeps_f32(name: str, a: np.ndarray) -> bool:
    """The tensors the converter keeps in F32 at any file type: vectors,
    norms, biases, the decay LoRA and the fused lerps."""
    return (a.ndim == 1 or "norm" in name or name.endswith(".bias")
            or "time_mix_w1" in name or "time_mix_w2" in name or "lerp_fused" in name)


def save_gguf(model: RxPtModel, path: str, dtype: str = "fp32") -> None:
    """Writes model as a llama.cpp rwkv7 GGUF at path, atomically; dtype
    (fp32, bf16, fp16) applies to the large matrices, as the converter does."""
    gguf = _need_gguf()
    if dtype not in DTYPES:
        raise InteropError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    c = model.config
    tensors = gguf_tensors(model)
    texts, types = gguf_vocab(c["vocab_size"])
    qtype = {"fp32": gguf.GGMLQuantizationType.F32, "bf16": gguf.GGMLQuantizationType.BF16,
             "fp16": gguf.GGMLQuantizationType.F16}[dtype]
    ftype = {"fp32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
             "fp16": gguf.LlamaFileType.MOSTLY_F16}[dtype]

    def write(tmp: str) -> None:
        w = gguf.GGUFWriter(tmp, ARCH)
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
        for name, a in tensors.items():
            if qtype == gguf.GGMLQuantizationType.F32 or _keeps_f32(name, a):
                w.add_tensor(name, a)
            else:
                w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    replace_with(path, write)
